"""Whole models held to derive stage models from (issue 27: models cross the radio once).

A device loads the whole model once per server (RepositoryModelLoad with the ``deepco_whole`` parameter, the
file as for any upload); for each stage a plan needs it then sends a `StageDescription` (the ``deepco_stage``
parameter, in place of the file) and the server extracts the stage itself with deepco.partition.derive, the
code the device's partitioner runs, so the stage is the model the device would have uploaded, byte for byte:
the request's ``sha256`` (the device's digest of its own extraction) is checked against it, and a stage that
differs is FAILED_PRECONDITION (the device then uploads the stage instead).

A whole model is held, not run: it takes no model slot and no ONNX Runtime session, but its bytes count
against ``--max-model-bytes`` with the loaded models', it is unloaded by name (reference-counted) or by the
lease like them, and the stage models derived from it are loaded models like uploaded ones (slots, bytes, the
request memory bound, eviction). Every description is checked before anything is extracted: an unknown whole
model is NOT_FOUND (the device loads it and asks again), unknown tensors or other image sizes are
INVALID_ARGUMENT. The parsed whole model and its two prepared copies are kept per whole model, so a stage costs
its own extraction and check only.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from deepco_server.errors import FailedPrecondition, NotFound, invalid
from deepco_server.model_checks import (
    check_fixed_size_elements,
    check_no_external_data,
    check_no_subgraphs,
    parse_model,
)
from google.protobuf.message import DecodeError

from deepco.partition.derive import WholeModel
from deepco.partition.graph import PartitionError
from deepco.wire import deepco_service_pb2 as dpb

log = logging.getLogger("deepco.serve")

STAGE_PARAMETER = "deepco_stage"  # RepositoryModelLoad: a serialized StageDescription instead of the file
WHOLE_PARAMETER = "deepco_whole"  # RepositoryModelLoad: the file is a whole model to derive stages from
PEER_PARAMETER = "deepco_peer"  # RepositoryModelLoad: fetch the whole model from this peer (server.whole_fetch)
MAX_DESCRIPTION_BYTES = 64 * 1024  # a description names a few tensors: a few hundred bytes


@dataclass
class Whole:
    """A whole model held for derivation: its bytes' size and digest, references and last use."""

    name: str
    sha256: str
    size: int
    model: WholeModel
    refs: int = 1
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one derivation at a time: Extractor is lazy
    _lent: bytes | None = field(default=None, repr=False)  # the bytes while peers fetch them (`lend`)
    _borrowers: int = 0

    def derive(self, description: dpb.StageDescription) -> bytes:
        """The stage model ``description`` names, serialized (INVALID_ARGUMENT for a description that names no
        stage of this model)."""
        m = self.model
        if (description.height, description.width) != (m.height, m.width):
            raise invalid(f"stage {description.name[:80]!r}: the description is for a {description.height}x"
                          f"{description.width} image, the whole model {self.sha256[:16]}... takes {m.height}x"
                          f"{m.width}")
        try:
            with self.lock:
                stage = m.stage(list(description.inputs), list(description.outputs), description.dims,
                                description.name, description.open_rows)
        except PartitionError as exc:
            raise invalid(f"cannot derive stage {description.name[:80]!r} from the whole model "
                          f"{self.sha256[:16]}...: {exc}") from None
        self.last_used = time.monotonic()
        return stage.SerializeToString()

    def lend(self) -> bytes:
        """The whole model's bytes, for a peer that fetches it (server.whole_fetch), until `give_back`. They are
        serialized again from the parsed model rather than kept, which would hold a second copy of every whole
        model for a rare fetch; and once for the fetches under way together, so that many fetches at once (16
        streams left unread) cost one copy, not one each. An upload that was not protobuf's own encoding
        serializes to other bytes: NOT_FOUND then, as for a model not held (the device sends the file instead),
        never bytes other than the digest says."""
        with self.lock:  # also keeps a derivation's Extractor from reading the model meanwhile
            if self._lent is None:
                data = self.model.model.SerializeToString()
                if hashlib.sha256(data).hexdigest() != self.sha256:
                    log.warning("whole model %r (sha256 %s...) does not serialize to its own bytes: not served to "
                                "peers", self.name, self.sha256[:16])
                    raise unknown_whole(self.sha256)
                self._lent = data
            self._borrowers += 1
            return self._lent

    def give_back(self) -> None:
        """A fetch that `lend` served has ended: the bytes go with the last one."""
        with self.lock:
            self._borrowers -= 1
            if self._borrowers <= 0:
                self._borrowers, self._lent = 0, None


def unknown_whole(sha256: str) -> NotFound:
    """FetchWhole's refusal of a digest not held for the caller: the same words whatever is held (for others, or
    nothing), so that a caller learns nothing by asking."""
    return NotFound(f"no whole model with sha256 {sha256[:64]} is held here for this caller")


def whole_model(model_bytes: bytes, name: str) -> WholeModel:
    """The whole model of uploaded bytes, checked as an upload is (INVALID_ARGUMENT when it is not one)."""
    try:
        proto = parse_model(model_bytes, name)
        check_no_external_data(proto, name)
        check_no_subgraphs(proto, name)
        check_fixed_size_elements(proto, name)
        return WholeModel(proto)
    except UnicodeDecodeError:
        raise invalid(f"model {name!r} is not a valid ONNX model (a name or string in it is not UTF-8)") from None
    except PartitionError as exc:
        raise invalid(f"model {name!r} cannot be a whole model to derive stages from: {exc}") from None


def is_whole(parameters: Mapping[str, object]) -> bool:
    """Whether a load's parameters ask to hold its file as a whole model (``deepco_whole``: true)."""
    flag = parameters.get(WHOLE_PARAMETER)
    if flag is None:
        return False
    if flag.WhichOneof("parameter_choice") != "bool_param":
        raise invalid(f"parameter '{WHOLE_PARAMETER}' must be a bool (true: hold the file to derive stages from)")
    return flag.bool_param


def stage_from_load_request(parameters: Mapping[str, object]) -> tuple[dpb.StageDescription, str] | None:
    """(the description, the derived model's expected SHA-256 or "") from a load's ``deepco_stage`` parameter,
    or None when it has none (an ordinary upload)."""
    value = parameters.get(STAGE_PARAMETER)
    if value is None:
        return None
    if value.WhichOneof("parameter_choice") != "bytes_param":
        raise invalid(f"parameter '{STAGE_PARAMETER}' must hold bytes (a serialized deepco.StageDescription)")
    if any(k.startswith("file:") for k in parameters):
        raise invalid(f"a load has either a model file or a '{STAGE_PARAMETER}' description, not both")
    if len(value.bytes_param) > MAX_DESCRIPTION_BYTES:
        raise invalid(f"parameter '{STAGE_PARAMETER}' is {len(value.bytes_param)} bytes, over the "
                      f"{MAX_DESCRIPTION_BYTES} limit")
    description = dpb.StageDescription()
    try:
        description.ParseFromString(value.bytes_param)
        description.name.encode()  # a string field that is not UTF-8 raises only when read
    except (DecodeError, UnicodeDecodeError, ValueError):
        raise invalid(f"parameter '{STAGE_PARAMETER}' does not parse as a deepco.StageDescription") from None
    sha = parameters.get("sha256")
    expected = ""
    if sha is not None:
        if sha.WhichOneof("parameter_choice") != "string_param":
            raise invalid("parameter 'sha256' must be a string (the model file's SHA-256 as 64 hex digits)")
        expected = sha.string_param.strip().lower()
    return description, expected


def find_whole(wholes: Mapping[tuple[str, str], Whole], owner: str, sha256: str) -> Whole:
    """``owner``'s whole model of digest ``sha256``, or NOT_FOUND saying how to load it."""
    digest = sha256.strip().lower()
    for (o, _), whole in wholes.items():
        if o == owner and whole.sha256 == digest:
            return whole
    raise NotFound(f"no whole model with sha256 {digest[:64]!r} is held here to derive stages from: load it first "
                   f"(RepositoryModelLoad with the file and '{WHOLE_PARAMETER}': true)")


def check_derived(name: str, derived_sha256: str, expected: str) -> None:
    """Refuse (FAILED_PRECONDITION) a derived stage whose digest is not the one the device computed: the two
    sides' extraction differs (another onnx version), and the device uploads the stage instead."""
    if expected and derived_sha256 != expected:
        raise FailedPrecondition(f"stage {name!r} derived here has sha256 {derived_sha256[:16]}..., the device's "
                                 f"{expected[:16]}...: upload the stage model itself")
