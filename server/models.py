"""Loaded models: ONNX Runtime sessions, their tensor signatures, and request validation.

Every problem a client can cause raises a :class:`~deepco_server.errors.ServerFault` naming its kind; the
servicers map it to a gRPC status, so nothing here knows about gRPC.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
from deepco_server.derived import Whole, check_derived, find_whole, unknown_whole, whole_model
from deepco_server.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    ServerFault,
    invalid,
)
from deepco_server.model_checks import (
    DEFAULT_MAX_REQUEST_BYTES,
    SizeBound,
    check_fixed_size_elements,
    check_no_external_data,
    check_no_subgraphs,
    parse_model,
)
from onnx import TensorProto, helper

from deepco.errors import UserError
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire.tensors import DATATYPES, ORT_TYPES, numpy_dtype

log = logging.getLogger("deepco.serve")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# Exact as the CPU (1e-4 of the largest output): ORT's CUDA provider computes convolutions in TF32 on Ampere and
# later GPUs by default, which put an H100's ResNet-18 answers 1.06e-4 away from the CPU's; with TF32 off and
# cuDNN's heuristic algorithm choice they are within 8e-7 (bench/results/gpu/, 2026-11-26).
CUDA_OPTIONS = {"use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"}
DEVICES = ("auto", "cpu", "cuda")
PLATFORM = "onnxruntime_onnx"  # Triton's platform name for ONNX Runtime models
PROFILE_MAX_BYTES = 256 * 1024 * 1024  # Profile inputs are made on the server: bound their size as a message's
# The default total of uploaded ONNX bytes held at once (--max-model-bytes): with --max-models 8 it still
# fits the big models the device uses (tens of MB each) and keeps a misbehaving client from filling memory.
DEFAULT_MAX_MODEL_BYTES = 1 << 30
MAX_NAME_CHARS = 128  # a model name ends up in logs, metrics labels and error messages
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
# A content-addressed name ends in "-sha256-<at least 12 hex digits>": the server loads under it only a file
# whose SHA-256 starts with those digits, so whoever runs the name gets those bytes, whoever loaded them.
CONTENT_NAME = re.compile(r".*-sha256-([0-9a-f]{12,64})")


@dataclass(frozen=True)
class Runtime:
    """How sessions are made: execution providers (in preference order) and ORT thread count."""

    providers: tuple[str, ...]
    threads: int  # ORT intra-op threads; 0 lets ORT choose
    device: str  # "cpu" or "cuda": what the probe session really got

    @property
    def provider(self) -> str:
        """The execution provider models run on first."""
        return self.providers[0]

    def session_options(self) -> ort.SessionOptions:
        """Options for every session of this server."""
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        # One request runs one graph; parallelism across requests comes from gRPC worker threads.
        opts.inter_op_num_threads = 1
        # Fatal only: ORT logs every failed run as an error line on stderr, but a failed run is the client's
        # input (answered INVALID_ARGUMENT with ORT's message), not a server problem.
        opts.log_severity_level = 4
        return opts

    def session(self, model_bytes: bytes) -> ort.InferenceSession:
        """An ORT session for a serialized ONNX model (raises whatever ORT raises on a bad model)."""
        return ort.InferenceSession(model_bytes, sess_options=self.session_options(),
                                    providers=[(p, CUDA_OPTIONS) if p == CUDA else p for p in self.providers])


def _probe_model() -> bytes:
    """A one-node model, enough to ask ORT which providers a session really gets."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # old enough for every ORT we support
    return model.SerializeToString()


def choose_runtime(device: str = "auto", threads: int = 0) -> Runtime:
    """Pick the execution providers for ``--device`` and check them with a real session.

    onnxruntime-gpu lists CUDAExecutionProvider even on a machine without a GPU (sessions then fall back
    to CPU silently), so the choice is confirmed by creating a probe session and reading the providers
    it actually got.
    """
    if device not in DEVICES:
        raise UserError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if threads < 0:
        raise UserError(f"--threads must be >= 0, got {threads}")
    available = ort.get_available_providers()
    if device == "cuda" and CUDA not in available:
        raise UserError("--device cuda: this onnxruntime has no CUDAExecutionProvider "
                        f"(available: {', '.join(available)}); install onnxruntime-gpu")
    if device in ("auto", "cuda") and CUDA in available:
        wanted: tuple[str, ...] = (CUDA, CPU)
        # ORT prints a five-line banner on falling back to the CPU, on stdout, whose one line is "listening on ..."
        # (server.app); the outcome is said in one line below (or chosen silently for --device auto)
        banner = io.StringIO()
        with contextlib.redirect_stdout(banner):
            got = Runtime(wanted, threads, "cuda").session(_probe_model()).get_providers()
        if banner.getvalue().strip():
            log.debug("onnxruntime on the CUDA probe session: %s", " ".join(banner.getvalue().split()))
        if CUDA in got:
            return Runtime(wanted, threads, "cuda")
        if device == "cuda":
            raise UserError("--device cuda: onnxruntime could not create a CUDA session (no usable GPU?)")
    return Runtime((CPU,), threads, "cpu")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model, in protocol terms; -1 marks a dimension of any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def _spec(arg: ort.NodeArg, model: str) -> TensorSpec:
    datatype = ORT_TYPES.get(arg.type)
    if datatype is None:
        raise invalid(f"model {model!r}: tensor {arg.name!r} has type {arg.type}, which this server "
                      "cannot exchange")
    # ORT reports symbolic dimensions as strings ("H") or None; both mean "any size" here.
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in arg.shape)
    return TensorSpec(arg.name, datatype, shape)


class LoadedModel:
    """A model ready to run: its ORT session and signature."""

    def __init__(self, name: str, version: str, session: ort.InferenceSession, size: int,
                 bound: SizeBound | None = None):
        self.name, self.version, self.session, self.size = name, version, session, size
        self.inputs = [_spec(a, name) for a in session.get_inputs()]
        self.outputs = [_spec(a, name) for a in session.get_outputs()]
        self.providers = tuple(session.get_providers())
        self.bound = bound  # what a request may allocate (None: unchecked, for models made by the server)
        self.running = 0  # requests running on it now (a lease never expires under them)
        self._lock = threading.Lock()

    def check_inputs(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Refuse inputs whose names, data types, ranks or fixed dimensions do not fit the model."""
        expected = {s.name: s for s in self.inputs}
        for name in arrays:
            if name not in expected:
                raise invalid(f"model {self.name!r} has no input {name!r} (inputs: {', '.join(expected)})")
        for spec in self.inputs:
            if spec.name not in arrays:
                raise invalid(f"model {self.name!r}: input {spec.name!r} is missing")
            array = arrays[spec.name]
            want = DATATYPES[spec.datatype]
            if array.dtype != want:
                got = next((k for k, v in DATATYPES.items() if v == array.dtype), str(array.dtype))
                raise invalid(f"model {self.name!r}: input {spec.name!r} has datatype {got}, "
                              f"expected {spec.datatype}")
            if len(array.shape) != len(spec.shape) or any(
                    w != -1 and w != g for w, g in zip(spec.shape, array.shape, strict=True)):
                raise invalid(f"model {self.name!r}: input {spec.name!r} has shape {list(array.shape)}, "
                              f"expected {list(spec.shape)} (-1: any size)")

    def output_names(self, requested: list[str]) -> list[str]:
        """The outputs to compute: the requested ones (checked), or all of them."""
        known = [s.name for s in self.outputs]
        for name in requested:
            if name not in known:
                raise invalid(f"model {self.name!r} has no output {name!r} (outputs: {', '.join(known)})")
        if len(set(requested)) != len(requested):
            # Each name asked for is an output in the reply: 1000 copies of one made a 1 MiB request 4 GB.
            twice = next(n for n in requested if requested.count(n) > 1)
            raise invalid(f"model {self.name!r}: output {twice[:80]!r} is requested more than once (each output "
                          "at most once)")
        return requested or known

    def run(self, arrays: Mapping[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run the model; an input ORT rejects (e.g. smaller than a kernel) is INVALID_ARGUMENT, one whose
        memory cannot be bounded or is over --max-request-bytes RESOURCE_EXHAUSTED (before it runs)."""
        if self.bound is not None:
            self.bound.check({name: array.shape for name, array in arrays.items()})
        with self._lock:
            self.running += 1
        try:
            results = self.session.run(outputs, dict(arrays))
        except Exception as exc:  # ORT raises its own exception types; every one is about this input
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise invalid(f"model {self.name!r} cannot run on this input: {first[:300]}") from None
        finally:
            with self._lock:
                self.running -= 1
        return dict(zip(outputs, results, strict=True))

    def profile(self, shape: list[int], runs: int, warmup: int) -> list[float]:
        """Seconds of each of ``runs`` timed runs on a server-made input of ``shape`` (after ``warmup``)."""
        if len(self.inputs) != 1:
            raise invalid(f"model {self.name!r} has {len(self.inputs)} inputs; Profile needs exactly one")
        spec = self.inputs[0]
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise invalid(f"Profile: shape {list(dims)} has a negative dimension")
        if len(dims) > len(spec.shape):  # checked again below; here it keeps the message short
            raise invalid(f"Profile: shape has {len(dims)} dimensions, model {self.name!r} takes "
                          f"{list(spec.shape)}")
        dtype = numpy_dtype(spec.datatype)
        nbytes = math.prod(dims) * dtype.itemsize  # Python ints: np.prod wraps around on absurd shapes
        if nbytes > PROFILE_MAX_BYTES:
            raise invalid(f"Profile: shape {list(dims)} is {nbytes} bytes, over the {PROFILE_MAX_BYTES} limit")
        rng = np.random.default_rng(0)
        array = (rng.standard_normal(dims).astype(dtype) if dtype.kind == "f" else np.zeros(dims, dtype))
        feeds = {spec.name: array}
        self.check_inputs(feeds)
        outputs = [s.name for s in self.outputs]
        for _ in range(warmup):
            self.run(feeds, outputs)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            self.run(feeds, outputs)
            times.append(time.perf_counter() - start)
        return times



def model_from_load_request(parameters: Mapping[str, object]) -> tuple[bytes, str]:
    """(ONNX bytes, version) from RepositoryModelLoad parameters, as tritonclient's load_model sends them.

    Triton's convention: "config" holds the model configuration as JSON, and each "file:<path>" parameter
    holds one file of the model directory, e.g. "file:1/model.onnx" for version 1. This server keeps no
    repository on disk, so the ONNX file must come in the request.
    """
    config = parameters.get("config")
    if config is not None:
        if config.WhichOneof("parameter_choice") != "string_param":
            raise invalid("parameter 'config' must be a string (the model configuration as JSON)")
        try:
            parsed = json.loads(config.string_param)
        except json.JSONDecodeError as exc:
            raise invalid(f"parameter 'config' is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise invalid("parameter 'config' must be a JSON object")
    files = {k[len("file:"):]: v for k, v in parameters.items() if k.startswith("file:")}
    if not files:
        raise invalid("no model file: send the ONNX bytes in a 'file:1/model.onnx' parameter "
                      "(this server has no model repository on disk)")
    if len(files) > 1:
        raise invalid(f"{len(files)} file: parameters ({', '.join(sorted(files))}); this server takes exactly "
                      "one, '<version>/model.onnx' (no external data files)")
    path, value = next(iter(files.items()))
    if value.WhichOneof("parameter_choice") != "bytes_param":
        raise invalid(f"parameter 'file:{path}' must hold bytes (the ONNX file)")
    version, sep, filename = path.partition("/")
    if not sep or not version.isascii() or not version.isdigit() or len(version) > 18 \
            or not filename.endswith(".onnx") or "/" in filename:
        raise invalid(f"parameter 'file:{path[:80]}': expected 'file:<version>/<name>.onnx', "
                      "e.g. 'file:1/model.onnx'")
    model_bytes = value.bytes_param
    check_sha256(parameters.get("sha256"), model_bytes)
    return model_bytes, str(int(version))


def check_sha256(parameter: object, model_bytes: bytes) -> None:
    """Refuse the upload unless its SHA-256 is the one in the optional ``sha256`` parameter (hex string).

    Checked before ORT sees the bytes, so a corrupted or substituted file is never parsed or run.
    """
    if parameter is None:
        return
    if parameter.WhichOneof("parameter_choice") != "string_param":
        raise invalid("parameter 'sha256' must be a string (the model file's SHA-256 as 64 hex digits)")
    expected = parameter.string_param.strip().lower()
    if not SHA256_HEX.fullmatch(expected):
        raise invalid(f"parameter 'sha256' must be 64 hex digits, got {parameter.string_param[:80]!r}")
    actual = hashlib.sha256(model_bytes).hexdigest()
    if actual != expected:
        raise invalid(f"model file sha256 mismatch: expected {expected}, actual {actual} "
                      f"({len(model_bytes)} bytes received)")


def sha256_text(parameters: Mapping[str, object]) -> str:
    """A load's ``sha256`` parameter, stripped and in lower case ("" when missing or not a string): for the loads
    that name a whole model by its digest rather than send its file whole, which check it is one."""
    sha = parameters.get("sha256")
    if sha is None or sha.WhichOneof("parameter_choice") != "string_param":
        return ""
    return sha.string_param.strip().lower()


def check_model_name(name: str) -> None:
    """Refuse a model name that is empty, too long, or holds control characters."""
    if not name:
        raise invalid("model_name is empty")
    if len(name) > MAX_NAME_CHARS:
        raise invalid(f"model_name is {len(name)} characters, over the {MAX_NAME_CHARS} limit "
                      f"(it starts {name[:40]!r})")
    if not name.isprintable():
        raise invalid(f"model_name {name[:40]!r} holds control characters")


def named_digest(name: str, model_bytes: bytes) -> str:
    """The SHA-256 (hex) of ``model_bytes`` to load as ``name``, after checking the name, and that a
    content-addressed name's digits are the bytes' digest (INVALID_ARGUMENT otherwise)."""
    check_model_name(name)
    sha256 = hashlib.sha256(model_bytes).hexdigest()
    claimed = CONTENT_NAME.fullmatch(name)
    if claimed and not sha256.startswith(claimed.group(1)):
        raise invalid(f"model name {name!r} is content-addressed (sha256 {claimed.group(1)}...) but the file's "
                      f"sha256 is {sha256[:16]}...")
    return sha256


@dataclass
class Holding:
    """A loaded model's place in the registry: who loaded it, how often, and when it was last used."""

    model: LoadedModel
    sha256: str
    refs: int = 1  # loads not yet unloaded: the model goes when the last one is unloaded
    last_used: float = field(default_factory=time.monotonic)


class Registry:
    """The loaded models, at most ``max_models`` of them holding at most ``max_model_bytes`` uploaded bytes
    in all; safe to use from many gRPC threads.

    Models are kept per *owner* (the client's identity: its certificate's name under mutual TLS, else ""
    for everyone): an owner sees, runs and unloads only its own. A loaded name is immutable: loading other
    bytes under it is refused (ALREADY_EXISTS), loading the same bytes adds a reference, and an unload drops
    one (``force`` drops them all). With a ``lease`` (seconds), a model nobody used that long is unloaded.
    """

    def __init__(self, runtime: Runtime, max_models: int, max_model_bytes: int = DEFAULT_MAX_MODEL_BYTES,
                 lease: float | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 derive: bool = True):
        self.runtime, self.max_models, self.max_model_bytes = runtime, max_models, max_model_bytes
        self.lease, self.max_request_bytes = lease, max_request_bytes
        self.derive_stages = derive  # hold whole models and derive stage models from them (server.derived)
        self._models: dict[tuple[str, str], Holding] = {}
        self._wholes: dict[tuple[str, str], Whole] = {}  # (owner, name) -> a whole model held for derivation
        self._parts = 0  # bytes of whole models' parts pending assembly (server.whole_parts)
        self._lock = threading.Lock()

    def _sweep(self) -> None:
        """Unload the models whose lease ran out (called with the lock held)."""
        if not self.lease:
            return
        now = time.monotonic()
        for key in [k for k, h in self._models.items() if now - h.last_used > self.lease and not h.model.running]:
            self._models.pop(key)
            log.info("unloaded model %r (owner %r): unused for over the %gs lease", key[1], key[0], self.lease)
        for key in [k for k, w in self._wholes.items() if now - w.last_used > self.lease]:
            self._wholes.pop(key)
            log.info("dropped whole model %r (owner %r): unused for over the %gs lease", key[1], key[0], self.lease)

    def _check_room(self, name: str, size: int) -> None:
        if len(self._models) >= self.max_models:
            raise ResourceExhausted(f"cannot load model {name!r}: {len(self._models)} models are loaded, the limit "
                                    f"(--max-models) is {self.max_models}; unload one first")
        held = self._held()
        if held + size > self.max_model_bytes:
            raise ResourceExhausted(f"cannot load model {name!r} ({size} bytes): loaded models hold {held} bytes and "
                                    f"the limit (--max-model-bytes) is {self.max_model_bytes}; unload one first")

    def _held(self) -> int:
        """Bytes of the loaded models, the whole models held and the parts pending assembly (called with the lock
        held)."""
        return (sum(h.model.size for h in self._models.values()) + sum(w.size for w in self._wholes.values())
                + self._parts)

    def _same_or_refuse(self, holding: Holding, version: str, sha256: str) -> LoadedModel:
        """A load of a name already loaded: one more reference if it is the same file, else ALREADY_EXISTS."""
        model = holding.model
        if holding.sha256 != sha256 or model.version != version:
            raise AlreadyExists(f"model {model.name!r} is already loaded (version {model.version}, sha256 "
                                f"{holding.sha256[:16]}...) and a loaded name cannot be replaced: this upload "
                                f"(version {version}, sha256 {sha256[:16]}...) differs; load it under another "
                                "name, or unload the old one first")
        holding.refs += 1
        holding.last_used = time.monotonic()
        return model

    def held_bytes(self) -> int:
        """Uploaded bytes of the models loaded now, whole models and parts pending included (what
        --max-model-bytes bounds)."""
        with self._lock:
            self._sweep()
            return self._held()

    def load(self, name: str, version: str, model_bytes: bytes, owner: str = "") -> LoadedModel:
        """Load model ``name`` for ``owner`` (see the class doc); a bad ONNX file is INVALID_ARGUMENT, one
        that references files is INVALID_ARGUMENT and one whose memory cannot be bounded RESOURCE_EXHAUSTED,
        all before ONNX Runtime sees it."""
        sha256 = named_digest(name, model_bytes)
        key = (owner, name)
        with self._lock:
            self._sweep()
            if key in self._models:
                return self._same_or_refuse(self._models[key], version, sha256)
            self._check_room(name, len(model_bytes))  # fail early, before the (possibly slow) session build
        try:  # a string field that is not UTF-8 raises only when read, wherever that is (found by fuzzing)
            proto = parse_model(model_bytes, name)
            check_no_external_data(proto, name)
            check_no_subgraphs(proto, name)
            check_fixed_size_elements(proto, name)
        except UnicodeDecodeError:
            raise invalid(f"model {name!r} is not a valid ONNX model (a name or string in it is not UTF-8)") from None
        try:
            # ORT is the judge of what it can run: a truncated file, an unknown operator or an invalid graph
            # all fail here, with ORT's own one-line reason.
            session = self.runtime.session(model_bytes)
            # Reading the signature decodes names as UTF-8: a mutated file can fail here too (fuzzed).
            model = LoadedModel(name, version, session, len(model_bytes))
        except ServerFault:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise invalid(f"model {name!r} is not a valid ONNX model (ONNX Runtime: {first[:300]})") from None
        try:
            model.bound = SizeBound(proto, name, self.max_request_bytes, [s.name for s in model.inputs])
        except UnicodeDecodeError:
            raise invalid(f"model {name!r} is not a valid ONNX model (a name or string in it is not UTF-8)") from None
        with self._lock:
            if key in self._models:  # another load of this name won the race
                return self._same_or_refuse(self._models[key], version, sha256)
            self._check_room(name, len(model_bytes))  # again: another load may have filled it meanwhile
            self._models[key] = Holding(model, sha256)
        log.info("loaded model %r version %s (%d bytes, sha256 %s, owner %r) on %s", name, version,
                 len(model_bytes), sha256[:16], owner, model.providers[0])
        return model

    def unload(self, name: str, owner: str = "", force: bool = False) -> int:
        """Drop one reference to ``owner``'s model ``name`` (``force``: all of them); returns the references
        left (0: unloaded). Requests already running on it finish normally."""
        check_model_name(name)
        with self._lock:
            self._sweep()
            holding = self._models.get((owner, name))
            if holding is None and (owner, name) in self._wholes:
                return self._drop_whole(owner, name, force)
            if holding is None:
                raise NotFound(f"model {name!r} is not loaded")
            holding.refs = 0 if force else holding.refs - 1
            if holding.refs > 0:
                log.info("model %r (owner %r): one reference dropped, %d left", name, owner, holding.refs)
                return holding.refs
            del self._models[(owner, name)]
        log.info("unloaded model %r (owner %r)", name, owner)
        return 0

    def _drop_whole(self, owner: str, name: str, force: bool) -> int:
        """Drop one reference to a whole model held (called with the lock held); the references left."""
        whole = self._wholes[(owner, name)]
        whole.refs = 0 if force else whole.refs - 1
        if whole.refs <= 0:
            del self._wholes[(owner, name)]
            log.info("dropped whole model %r (owner %r)", name, owner)
        return max(whole.refs, 0)

    def load_whole(self, name: str, model_bytes: bytes, owner: str = "") -> None:
        """Hold ``model_bytes`` as ``owner``'s whole model ``name`` to derive stage models from (server.derived):
        checked as an upload, its bytes counted against --max-model-bytes, no model slot; the same bytes under
        the same name add a reference."""
        self._check_derivation()
        sha256 = named_digest(name, model_bytes)
        with self._lock:
            self._sweep()
            if self._same_whole(owner, name, sha256):
                return
            self._check_bytes(name, len(model_bytes))
        whole = Whole(name, sha256, len(model_bytes), whole_model(model_bytes, name))
        with self._lock:
            if self._same_whole(owner, name, sha256):
                return
            self._check_bytes(name, len(model_bytes))
            self._wholes[(owner, name)] = whole
        log.info("holding whole model %r (%d bytes, sha256 %s, owner %r) to derive stages from", name,
                 len(model_bytes), sha256[:16], owner)

    def whole_room(self, name: str, sha256: str, owner: str = "", reference: bool = True) -> int | None:
        """Before ``owner``'s whole model ``name`` of digest ``sha256`` is fetched from a peer (server.whole_fetch)
        or sent in parts (server.whole_parts): None when it is held already (one more reference, unless not
        ``reference``: nothing to fetch), else the bytes it may take under --max-model-bytes (RESOURCE_EXHAUSTED
        when none). The bytes are then loaded by `load_whole`."""
        self._check_derivation()
        check_model_name(name)
        claimed = CONTENT_NAME.fullmatch(name)
        if claimed and not sha256.startswith(claimed.group(1)):
            raise invalid(f"model name {name!r} is content-addressed (sha256 {claimed.group(1)}...) but the model to "
                          f"fetch or join has sha256 {sha256[:16]}...")
        with self._lock:
            self._sweep()
            if self._same_whole(owner, name, sha256, reference):
                return None
            held = self._held()
        if held >= self.max_model_bytes:
            raise ResourceExhausted(f"cannot hold whole model {name!r}: loaded models hold {held} bytes and the limit "
                                    f"(--max-model-bytes) is {self.max_model_bytes}")
        return self.max_model_bytes - held

    def whole_to_serve(self, sha256: str, owner: str = "") -> Whole:
        """``owner``'s whole model of exact digest ``sha256``, for a peer to fetch (FetchWhole; its bytes by
        `Whole.lend`): NOT_FOUND for any other digest, saying nothing of what is held (INVALID_ARGUMENT: not 64
        hex digits)."""
        digest = sha256.strip().lower()
        if not SHA256_HEX.fullmatch(digest):
            raise invalid(f"FetchWhole: sha256 must be 64 hex digits, got {sha256[:80]!r}")
        with self._lock:
            self._sweep()
            whole = next((w for (o, _), w in self._wholes.items() if o == owner and w.sha256 == digest), None)
            if whole is None:
                raise unknown_whole(digest)
            whole.last_used = time.monotonic()  # a source for peers is in use: its lease is renewed
        return whole

    def _same_whole(self, owner: str, name: str, sha256: str, reference: bool = True) -> bool:
        """Whether ``owner`` holds whole model ``name`` with these bytes already (one more reference, if
        ``reference``), else False; other bytes under the name are ALREADY_EXISTS (called with the lock held)."""
        whole = self._wholes.get((owner, name))
        if whole is None:
            return False
        if whole.sha256 != sha256:
            raise AlreadyExists(f"whole model {name!r} is held with sha256 {whole.sha256[:16]}...; this file "
                                f"({sha256[:16]}...) differs")
        if reference:
            whole.refs += 1
        whole.last_used = time.monotonic()
        return True

    def hold_part(self, name: str, size: int) -> None:
        """Count ``size`` bytes of a part of whole model ``name`` pending assembly (server.whole_parts) against
        --max-model-bytes, until `drop_parts` (RESOURCE_EXHAUSTED when they do not fit)."""
        with self._lock:
            self._sweep()
            held = self._held()
            if held + size > self.max_model_bytes:
                raise ResourceExhausted(f"cannot take a part of whole model {name!r} ({size} bytes): loaded models "
                                        f"and parts pending hold {held} bytes and the limit (--max-model-bytes) is "
                                        f"{self.max_model_bytes}")
            self._parts += size

    def drop_parts(self, size: int) -> None:
        """``size`` bytes of parts counted by `hold_part` are no longer held (assembled, refused or expired)."""
        with self._lock:
            self._parts -= size

    def _check_bytes(self, name: str, size: int) -> None:
        held = self._held()
        if held + size > self.max_model_bytes:
            raise ResourceExhausted(f"cannot hold whole model {name!r} ({size} bytes): loaded models hold {held} "
                                    f"bytes and the limit (--max-model-bytes) is {self.max_model_bytes}")

    def _check_derivation(self) -> None:
        if not self.derive_stages:
            raise FailedPrecondition("this server does not derive stage models (deepco serve --no-derive-stages): "
                                     "upload the model file")

    def derive(self, name: str, version: str, description: dpb.StageDescription, expected_sha256: str,
               owner: str = "") -> LoadedModel:
        """Load as ``name`` the stage model ``description`` names, derived from ``owner``'s whole model of its
        ``whole_sha256`` (NOT_FOUND if none is held); ``expected_sha256``: the device's digest of the stage
        (FAILED_PRECONDITION if the derived bytes differ). Loaded as an upload is, within the same limits."""
        self._check_derivation()
        check_model_name(name)
        with self._lock:
            self._sweep()
            whole = find_whole(self._wholes, owner, description.whole_sha256)
            if (owner, name) in self._models:  # a plan's stage loaded before: one more reference, no derivation
                return self._same_or_refuse(self._models[(owner, name)], version, self._models[(owner, name)].sha256)
            self._check_room(name, 0)  # fail early, before the extraction
        model_bytes = whole.derive(description)
        check_derived(name, hashlib.sha256(model_bytes).hexdigest(), expected_sha256)
        return self.load(name, version, model_bytes, owner)

    def get(self, name: str, version: str = "", owner: str = "") -> LoadedModel:
        """``owner``'s model ``name`` (of ``version``, if given) or NOT_FOUND; renews its lease."""
        check_model_name(name)
        with self._lock:
            self._sweep()
            holding = self._models.get((owner, name))
            if holding is not None:
                holding.last_used = time.monotonic()
            loaded = sorted(n for o, n in self._models if o == owner)
        if holding is None:
            listing = ", ".join(repr(n) for n in loaded[:20]) or "none"
            raise NotFound(f"model {name!r} is not loaded (loaded: {listing})")
        model = holding.model
        if version and version != model.version:
            raise NotFound(f"model {name!r} has no version {version[:40]!r} (loaded: {model.version})")
        return model

    def all(self, owner: str | None = None) -> list[LoadedModel]:
        """Every loaded model of ``owner`` (None: of every owner), by name."""
        with self._lock:
            self._sweep()
            return [self._models[k].model for k in sorted(self._models) if owner is None or k[0] == owner]

    def holdings(self, owner: str | None = None) -> list[tuple[str, Holding]]:
        """(owner, holding) of every loaded model of ``owner`` (None: every owner), by owner and name."""
        with self._lock:
            self._sweep()
            return [(k[0], self._models[k]) for k in sorted(self._models) if owner is None or k[0] == owner]
