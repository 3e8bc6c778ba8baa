"""`deepco models`: list the models loaded on a cluster's servers, and unload them.

Under mutual TLS a server shows (and unloads) only the models of the client certificate used here.
"""

from __future__ import annotations

import argparse

from deepco.cluster import load_cluster
from deepco.errors import UserError
from deepco.wire import security
from deepco.wire.client import InferenceClient


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `deepco models`."""
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster TOML file (its servers' addresses)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--unload", metavar="NAME", help="unload model NAME from every server that has it")
    what.add_argument("--all", action="store_true", help="unload every model from every server")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="per call to a server (default: 10)")
    security.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """List, or unload, per server; an unreachable server is reported and makes the exit code 1."""
    cluster = load_cluster(args.cluster)
    channel_security = security.from_args(args)
    failed = found = 0
    for server in cluster.servers:
        address = cluster.address_on(server, 0)
        # a server named by its address (a file of addresses only) is shown by it once
        label = address if server.name == address else f"{server.name} {address}"
        try:
            with InferenceClient(address, timeout=args.timeout, security=channel_security) as client:
                index = client.model_index()
                targets = [m.name for m in index if args.all or m.name == args.unload]
                # force: drop every reference (the devices that loaded it are gone, or this is what you want)
                for name in targets:
                    client.unload_model(name, force=True)
                    print(f"{label}: unloaded {name}")
                found += len(targets)
                if not (args.all or args.unload):
                    print(f"{label}: {len(index)} model(s) loaded")
                    for m in index:
                        print(f"  {m.name}  version {m.version}  {m.reason}")
        except UserError as exc:
            # the error names the server's address already
            print(f"error: {exc}" if server.name == address else f"{server.name}: error: {exc}")
            failed += 1
    if args.unload and not found and not failed:
        raise UserError(f"no server of {args.cluster} has a model named {args.unload!r}")
    if args.all or args.unload:
        reached = len(cluster.servers) - failed
        print(f"unloaded {found} model(s) from {reached} server(s)" + (f"; {failed} not reached" if failed else ""))
    return 1 if failed else 0
