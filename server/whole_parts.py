"""Whole models sent in parts, one over each of the device's antennas at once (issue 27: models cross the radio once).

A device with several antennas (radio links) reaches a server at one address per antenna. To send its whole model
(RepositoryModelLoad with ``deepco_whole``, server.derived) in a fraction of the time, it splits the bytes and sends
each part over another antenna, all at once, as loads of their own: ``deepco_whole: true``, ``sha256`` (the WHOLE
model's digest), ``deepco_part`` (``"OFFSET/TOTAL"``: where the part's bytes start in the whole model, and the whole
model's size) and the part's bytes as the file (``file:1/model.onnx``), under the whole model's name. Each part's
load is answered once the part is stored; the one whose part completes the whole joins the bytes, checks their
SHA-256 and holds them with `Registry.load_whole`, the very checks and limits of an uploaded whole model, so its
answer is that load's. A part of a whole model the caller's identity holds already under that name and digest is
answered at once, nothing stored (the part at offset 0 counts as the load: one more reference, as an upload of
the same bytes; the others add none, so that a device's one unload drops what its one load added).

Anyone may send any bytes, so the parts are kept within bounds and checked before anything is joined:

- a ``deepco_part`` that is not two decimal integers, a TOTAL below 1, a negative OFFSET, an empty part or one
  that ends past TOTAL; a part without ``deepco_whole: true``, without the whole model's exact ``sha256``, with a
  ``deepco_peer`` too; another TOTAL than an earlier part of the same (identity, name, digest) said; a part over
  the bytes of an earlier, different part (an exact repeat, e.g. a retry, is stored once), or a whole model in
  more than ``MAX_PARTS`` parts: INVALID_ARGUMENT;
- the parts pending count against ``--max-model-bytes`` with the models held (`Registry.hold_part`), so that many
  half-sent whole models cannot hold more than it in all: a TOTAL larger than the room left, or a part that does
  not fit, is RESOURCE_EXHAUSTED, and so is a ``MAX_PENDING``-th + 1 whole model pending for one identity;
- a whole model that got no new part for ``PART_SECONDS`` is dropped (looked at on each load, no thread of its
  own): a device that died half-way costs memory only for a while;
- the joined bytes are checked against ``sha256`` before anything parses them (INVALID_ARGUMENT naming both
  digests, as for an upload whose file is not its ``sha256``), and counted against ``--max-held-bytes`` while the
  load holds them (RESOURCE_EXHAUSTED: the parts stay, a retry of any of them joins them again); the parts are
  dropped whatever the load answers.

Each part's load is an upload like any other for the server's budgets (server.budgets): its request counts
against ``--max-held-bytes`` and gRPC's message limit while it is read.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from deepco_server.budgets import reserve
from deepco_server.derived import PEER_PARAMETER, WHOLE_PARAMETER, is_whole
from deepco_server.errors import ResourceExhausted, invalid
from deepco_server.models import SHA256_HEX, Registry, model_from_load_request, sha256_text

log = logging.getLogger("deepco.serve")

PART_PARAMETER = "deepco_part"  # RepositoryModelLoad: the file is the part "OFFSET/TOTAL" of a whole model
PART_SECONDS = 60.0  # a whole model that got no new part this long is dropped
MAX_PENDING = 4  # whole models being sent in parts at once, per identity
MAX_PARTS = 64  # parts of one whole model: a device sends one per antenna (a retry is no new part)
PART_FORM = re.compile(r"(-?[0-9]{1,20})/(-?[0-9]{1,20})")


@dataclass(frozen=True)
class Part:
    """A part of a whole model: its bytes, where they start in it, its size and its digest."""

    sha256: str
    offset: int
    total: int
    data: bytes

    def describe(self) -> str:
        """The part in words, for refusals."""
        return f"part {self.offset}/{self.total} ({len(self.data)} bytes)"


def part_from_load_request(parameters: Mapping[str, object]) -> Part | None:
    """The part a load's ``deepco_part`` parameter sends, or None for a load without one; INVALID_ARGUMENT for one
    that is malformed (the module doc)."""
    value = parameters.get(PART_PARAMETER)
    if value is None:
        return None
    if value.WhichOneof("parameter_choice") != "string_param":
        raise invalid(f"parameter '{PART_PARAMETER}' must be a string ('OFFSET/TOTAL': where the part starts in the "
                      "whole model, and the whole model's size in bytes)")
    if not is_whole(parameters):
        raise invalid(f"parameter '{PART_PARAMETER}' sends a part of a whole model only: add '{WHOLE_PARAMETER}': "
                      "true")
    if PEER_PARAMETER in parameters:
        raise invalid(f"a load sends either a part of a whole model or a '{PEER_PARAMETER}' to fetch it from, "
                      "not both")
    digest = sha256_text(parameters)
    if not SHA256_HEX.fullmatch(digest):
        raise invalid(f"a part of a whole model needs the whole model's exact 'sha256' (64 hex digits): the joined "
                      f"parts are checked against it (got {digest[:80]!r})")
    form = PART_FORM.fullmatch(value.string_param)
    if form is None:
        raise invalid(f"parameter '{PART_PARAMETER}' must be 'OFFSET/TOTAL' (two decimal integers: where the part "
                      f"starts in the whole model, and its size in bytes), got {value.string_param[:80]!r}")
    offset, total = int(form.group(1)), int(form.group(2))
    if total < 1 or offset < 0:
        raise invalid(f"parameter '{PART_PARAMETER}' {offset}/{total}: the whole model's size must be >= 1 and the "
                      "part's offset >= 0")
    # The file as an upload's (one 'file:<version>/<name>.onnx' of bytes, a JSON config); its digest is the whole's
    data, _ = model_from_load_request({k: v for k, v in parameters.items() if k != "sha256"})
    part = Part(digest, offset, total, data)
    if not data:
        raise invalid(f"{part.describe()} of a whole model is empty")
    if offset + len(data) > total:
        raise invalid(f"{part.describe()} ends at byte {offset + len(data)}, past the whole model's {total}")
    return part


@dataclass
class _Assembly:
    """A whole model's parts so far, by offset, and when the last new one came."""

    total: int
    parts: dict[int, bytes] = field(default_factory=dict)
    stored: int = 0
    last: float = field(default_factory=time.monotonic)

    def is_new(self, part: Part, name: str) -> bool:
        """Whether ``part`` brings bytes not stored yet (False: an exact repeat of a part stored); INVALID_ARGUMENT
        for one over the bytes of another part, or one part too many."""
        end = part.offset + len(part.data)
        for offset, data in self.parts.items():
            if offset < end and part.offset < offset + len(data):
                if offset == part.offset and data == part.data:
                    return False
                what = ("repeats an earlier part's bytes with other bytes" if (offset, len(data)) ==
                        (part.offset, len(part.data)) else f"overlaps bytes {offset}-{offset + len(data)} of an "
                        "earlier part")
                raise invalid(f"{part.describe()} of whole model {name!r} (sha256 {part.sha256[:16]}...) {what}: "
                              "each byte is sent in one part")
        if len(self.parts) >= MAX_PARTS:
            raise invalid(f"{part.describe()} of whole model {name!r} (sha256 {part.sha256[:16]}...) is one too "
                          f"many: a whole model is sent in at most {MAX_PARTS} parts")
        return True

    def store(self, part: Part) -> None:
        """Keep ``part`` (checked by `is_new`)."""
        self.parts[part.offset] = part.data
        self.stored += len(part.data)
        self.last = time.monotonic()

    def joined(self) -> bytes:
        """The whole model's bytes (all parts stored: they cover it without overlap)."""
        return b"".join(self.parts[offset] for offset in sorted(self.parts))


class WholeParts:
    """The whole models being sent in parts, by (identity, name, digest), until joined and held (the module doc);
    safe to use from many gRPC threads."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._assemblies: dict[tuple[str, str, str], _Assembly] = {}
        self._lock = threading.Lock()

    def sweep(self) -> None:
        """Drop the whole models that got no new part for PART_SECONDS (before any load counts the room)."""
        with self._lock:
            self._sweep()

    def _sweep(self) -> None:
        now = time.monotonic()
        for key in [k for k, a in self._assemblies.items() if now - a.last > PART_SECONDS]:
            self._drop(key)
            log.info("dropped the parts of whole model %r (owner %r): no new part for over %gs", key[1], key[0],
                     PART_SECONDS)

    def _drop(self, key: tuple[str, str, str]) -> _Assembly:
        assembly = self._assemblies.pop(key)
        self.registry.drop_parts(assembly.stored)
        return assembly

    def load(self, name: str, part: Part, owner: str = "") -> None:
        """Store ``part`` of ``owner``'s whole model ``name``; the part that completes it has the whole model held
        (`Registry.load_whole`), or refused as that load is. See the module doc for the refusals."""
        key = (owner, name, part.sha256)
        with self._lock:
            self._sweep()
            assembly = self._assemblies.get(key)
            if assembly is not None and assembly.total != part.total:
                raise invalid(f"{part.describe()} of whole model {name!r} (sha256 {part.sha256[:16]}...) says it is "
                              f"{part.total} bytes, an earlier part {assembly.total}")
            room = self.registry.whole_room(name, part.sha256, owner, reference=part.offset == 0)
            if room is None:  # held already: nothing to store, and nothing pending for it any more
                if assembly is not None:
                    self._drop(key)
                return
            if assembly is None:
                if sum(o == owner for o, _, _ in self._assemblies) >= MAX_PENDING:
                    raise ResourceExhausted(f"cannot take a part of whole model {name!r}: {MAX_PENDING} whole models "
                                            f"are being sent in parts for this caller already; retry once one is "
                                            f"held, or after {PART_SECONDS:g}s")
                assembly = _Assembly(part.total)
            if part.total - assembly.stored > room:
                raise ResourceExhausted(f"cannot hold whole model {name!r} ({part.total} bytes, {assembly.stored} of "
                                        f"them sent): --max-model-bytes leaves room for {room} more")
            if assembly.is_new(part, name):
                self.registry.hold_part(name, len(part.data))
                assembly.store(part)
                self._assemblies[key] = assembly
            if assembly.stored < assembly.total:
                return
            if not reserve(assembly.total):  # the joined bytes count as an upload's request would
                raise ResourceExhausted(f"cannot join whole model {name!r} ({assembly.total} bytes) now: the bytes "
                                        "held by admitted calls would pass --max-held-bytes; retry later")
            self._drop(key)
        model_bytes = assembly.joined()
        actual = hashlib.sha256(model_bytes).hexdigest()
        if actual != part.sha256:
            raise invalid(f"whole model {name!r} sent in {len(assembly.parts)} parts: the joined bytes' sha256 is "
                          f"{actual[:16]}..., not the {part.sha256[:16]}... they were sent with: refused, nothing "
                          "loaded (send them again)")
        self.registry.load_whole(name, model_bytes, owner)
        log.info("whole model %r (sha256 %s...) joined from %d parts: %d bytes", name, part.sha256[:16],
                 len(assembly.parts), len(model_bytes))
