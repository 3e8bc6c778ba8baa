"""Triton's protocol extensions beyond plain inference: model configuration, statistics and classification.

What Triton's own tools (perf_analyzer, model_analyzer, tritonclient's helpers) ask a server besides
ModelInfer, answered from what a loaded ONNX model already tells: its configuration is derived from the
ORT session (there is no config.pbtxt), and its statistics are counted per loaded model while requests
run. Formats follow Triton's protocol extension documents (extension_model_configuration.md,
extension_statistics.md, extension_classification.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

import numpy as np
from deepco_server.errors import invalid
from deepco_server.models import PLATFORM, LoadedModel

from deepco.wire import inference_pb2 as pb
from deepco.wire.tensors import bytes_raw

BACKEND = "onnxruntime"
# What ServerMetadata lists as served, in Triton's names (besides DeepCo's own key=value facts).
EXTENSIONS = ("model_repository", "model_configuration", "statistics", "classification")
CLASSIFICATION = "classification"  # the requested output's parameter tritonclient sends for class_count
# Triton's classification extension covers the numeric types below (not BOOL, FP16 or BYTES).
CLASSIFIABLE = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64")
PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


def _data_type(datatype: str) -> int:
    """The model configuration's DataType of a protocol data type ("FP32" -> TYPE_FP32, BYTES -> TYPE_STRING)."""
    return pb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def model_config(model: LoadedModel) -> pb.ModelConfig:
    """The Triton model configuration of a loaded ONNX model.

    ``max_batch_size`` is 0: the server runs each request as it comes and never batches requests together,
    so the dims are the model's full shapes, the first (batch) dimension included; -1 is any size.
    """
    return pb.ModelConfig(
        name=model.name, platform=PLATFORM, backend=BACKEND, max_batch_size=0,
        input=[pb.ModelInput(name=s.name, data_type=_data_type(s.datatype), dims=s.shape) for s in model.inputs],
        output=[pb.ModelOutput(name=s.name, data_type=_data_type(s.datatype), dims=s.shape)
                for s in model.outputs])


# ---- statistics ---------------------------------------------------------------------------------------
class RequestTimer:
    """The clock of one inference request: ``lap(phase)`` adds the time since the last lap to ``phase``."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter_ns()
        self.ns = dict.fromkeys(PHASES, 0)

    def lap(self, phase: str | None) -> None:
        """Charge the time since the previous lap to ``phase`` (None: to no phase, e.g. sending an event)."""
        now = time.perf_counter_ns()
        if phase is not None:
            self.ns[phase] += now - self._last
        self._last = now


class _ModelCounters:
    """Cumulative counts and nanoseconds of one loaded model, as Triton's InferStatistics holds them."""

    def __init__(self) -> None:
        self.durations = {name: [0, 0] for name in ("success", "fail", *PHASES)}  # name -> [count, ns]
        self.inferences = self.executions = 0
        self.last_inference_ms = 0

    def message(self, model: LoadedModel) -> pb.ModelStatistics:
        stats = pb.InferStatistics(**{name: pb.StatisticDuration(count=c, ns=ns)
                                      for name, (c, ns) in self.durations.items()})
        return pb.ModelStatistics(name=model.name, version=model.version, last_inference=self.last_inference_ms,
                                  inference_count=self.inferences, execution_count=self.executions,
                                  inference_stats=stats)


class Statistics:
    """Triton's statistics extension: per loaded model, thread-safe.

    Counters are keyed by the LoadedModel object itself (weakly), so an unloaded or replaced model's numbers
    go with it, as in Triton, and a model loaded again starts from zero.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: weakref.WeakKeyDictionary[LoadedModel, _ModelCounters] = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def measuring(self, model: LoadedModel) -> Iterator[RequestTimer]:
        """Time one request on ``model``: success (with its phases) if the block ends normally, else fail."""
        timer = RequestTimer()
        try:
            yield timer
        except BaseException:
            self._record(model, timer, ok=False)
            raise
        self._record(model, timer, ok=True)

    def _record(self, model: LoadedModel, timer: RequestTimer, ok: bool) -> None:
        total = time.perf_counter_ns() - timer.start
        with self._lock:
            counters = self._models.setdefault(model, _ModelCounters())
            outcome = counters.durations["success" if ok else "fail"]
            outcome[0] += 1
            outcome[1] += total
            if not ok:
                return
            # Triton counts the phases of successful requests only; one request is one execution here
            # (max_batch_size 0: no batching), and one inference.
            for phase in PHASES:
                counters.durations[phase][0] += 1
                counters.durations[phase][1] += timer.ns[phase]
            counters.inferences += 1
            counters.executions += 1
            counters.last_inference_ms = time.time_ns() // 1_000_000

    def response(self, models: Iterable[LoadedModel]) -> pb.ModelStatisticsResponse:
        """The ModelStatistics answer for ``models`` (zeros for one that has not run yet)."""
        with self._lock:
            return pb.ModelStatisticsResponse(
                model_stats=[self._models.get(m, _ModelCounters()).message(m) for m in models])


# ---- classification -----------------------------------------------------------------------------------
def classification_counts(request: pb.ModelInferRequest, model: LoadedModel) -> dict[str, int]:
    """Requested output -> class count, for the outputs whose "classification" parameter asks for classes."""
    datatypes = {s.name: s.datatype for s in model.outputs}
    counts = {}
    for output in request.outputs:
        if CLASSIFICATION not in output.parameters:
            continue
        parameter = output.parameters[CLASSIFICATION]
        kind = parameter.WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise invalid(f"output {output.name!r}: parameter 'classification' must be an integer (the class "
                          f"count), got {kind or 'nothing'}")
        count = getattr(parameter, kind)
        if count < 0:
            raise invalid(f"output {output.name!r}: classification count must be >= 0, got {count}")
        if count and datatypes.get(output.name) not in (*CLASSIFIABLE, None):
            raise invalid(f"output {output.name!r}: classification is not available for datatype "
                          f"{datatypes[output.name]} (only {', '.join(CLASSIFIABLE)})")
        if count:
            counts[output.name] = count
    return counts


def top_classes(array: np.ndarray, count: int) -> list[bytes]:
    """Triton's classification of an output of a model without batching: the ``count`` highest elements
    of the whole tensor, highest first (ties: lower index first), as "<value>:<index>" strings.

    The value is printed as C++'s std::to_string prints it, as Triton does: six decimals for floating
    point ("0.930000:3"), plain digits for integers.
    """
    flat = np.asarray(array).reshape(-1)
    # A stable descending order: sort the reversed array ascending, then reverse back (works for unsigned too).
    order = (flat.size - 1 - np.argsort(flat[::-1], kind="stable"))[::-1][:count]
    floating = flat.dtype.kind == "f"
    return [(f"{float(flat[i]):f}" if floating else f"{int(flat[i])}").encode() + f":{i}".encode() for i in order]


def add_classification(response: pb.ModelInferResponse, name: str, array: np.ndarray, count: int) -> None:
    """Append output ``name`` as its top ``count`` classes: a BYTES tensor of shape [min(count, elements)]."""
    classes = top_classes(array, count)
    response.outputs.add(name=name, datatype="BYTES", shape=[len(classes)])
    response.raw_output_contents.append(bytes_raw(classes))
