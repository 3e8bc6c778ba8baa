"""Regenerate the Python protobuf/gRPC code under deepco/wire/ from the .proto files in protos/.

    .venv/bin/python protos/generate.py            # rewrite deepco/wire/*_pb2*.py
    .venv/bin/python protos/generate.py --check    # exit 1 if the committed code is not current

The output depends on the grpcio-tools version (its bundled protoc stamps the protobuf version into the
code), so use the pinned one: grpcio-tools==1.81.1, whose code runs on protobuf 6.33.5+ (and on 7.x, with
a warning), the range tritonclient[grpc] allows.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
WIRE = ROOT / "deepco" / "wire"
PACKAGE = "deepco.wire"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every protos/*.proto into ``out_dir``; return the generated files, sorted."""
    from grpc_tools import protoc  # a build-time tool: imported only here

    sources = sorted(PROTOS.glob("*.proto"))
    well_known = resources.files("grpc_tools") / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", *[str(s) for s in sources]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see the messages above)")
    files = sorted(out_dir.glob("*_pb2*.py"))
    for path in files:
        # protoc writes top-level imports ("import inference_pb2 as ..."); the modules live in a package.
        text = re.sub(r"^import (\w+_pb2) as ", rf"from {PACKAGE} import \1 as ", path.read_text(),
                      flags=re.MULTILINE)
        # Register in deepco.wire's private descriptor pool, not the default one (see deepco/wire/_pool.py:
        # tritonclient defines the same inference.* messages there).
        if "_descriptor_pool.Default()" in text:
            text = text.replace("_descriptor_pool.Default()", "_deepco_pool.POOL")
            text = text.replace("from google.protobuf import descriptor_pool as _descriptor_pool\n",
                                f"from google.protobuf import descriptor_pool as _descriptor_pool\n"
                                f"from {PACKAGE} import _pool as _deepco_pool\n", 1)
        path.write_text(text)
    return files


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing in) deepco/wire/, or are extra there."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    committed = {p.name: p.read_bytes() for p in WIRE.glob("*_pb2*.py")}
    return sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))


def main(argv: list[str] | None = None) -> int:
    """Regenerate, or with --check only compare."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if anything is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code in {WIRE}: {', '.join(stale)}; run protos/generate.py", file=sys.stderr)
            return 1
        print("generated code is current")
        return 0
    for old in WIRE.glob("*_pb2*.py"):
        old.unlink()
    for path in generate(WIRE):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
