"""Orchestration around the engine: the emulated testbed, `deepco bench` and `deepco demo`.

It sits above the product: it imports the device (``deepco_device``) and ``deepco``, and starts servers only as
processes (`deepco serve`), never by importing ``deepco_server``. Neither the core library nor the device nor
the server imports it (import-linter contracts in pyproject.toml).
"""
