"""The small text forms a user types, each read by one rule everywhere: an input size HxW, an address host:port.

Both the server and the device read them, so they live here (the two never import each other).
"""

from __future__ import annotations

import re

from deepco.errors import UserError

# ASCII digits only: str.isdigit() and int() also take '²' or '٣' or '1_000', which no one means in a size or a port.
_SIZE = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*")
_PORT = re.compile(r"[0-9]{1,5}")
# --input-size's help, the same for every command that takes it (deepco.partition.source.input_size reads it)
SIZE_HELP = ("input height x width, e.g. 224x224; default: a fixed-size model's own size (a model of dynamic size, "
             "as the zoo's are, needs it)")


def parse_size(text: str) -> tuple[int, int]:
    """'HxW' -> (H, W), both positive integers ('224x224', '720 X 1280'); a UserError naming --input-size else."""
    m = _SIZE.fullmatch(text)
    if not m or int(m[1]) <= 0 or int(m[2]) <= 0:
        raise UserError(f"--input-size must be HxW with positive integers (e.g. 224x224), got {text!r}")
    return int(m[1]), int(m[2])


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port): a non-empty host (an IPv6 one in brackets, '[::1]:50051', keeps them) and a
    port in 1..65535. Raises ValueError with a message that quotes ``address``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port with a port in 1..65535, got {address!r}")
    return host, int(port)


def is_address(address: str) -> bool:
    """Whether ``address`` is a host:port that `split_address` accepts."""
    try:
        split_address(address)
    except ValueError:
        return False
    return True
