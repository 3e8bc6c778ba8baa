import sys

from deepco.cli import main

sys.exit(main())
