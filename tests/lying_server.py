"""A `deepco serve` that lies: a real server whose DeepcoService.Run and SplitRun answers are rewritten.

    python tests/lying_server.py LIE [--from-start] -- [deepco serve flags]

LIE is what goes wrong with every answer once the server lies:
  shape    one channel too few (Run outputs, SplitRun bands and outputs)
  dtype    float64 instead of float32
  rows     one row too few in a Run output; a SplitRun band that says it starts one row later
  garbage  the tensor's bytes cut in half (the message no longer decodes)

The server answers honestly (so a device can set up and calibrate) until it gets SIGUSR1, or from the start
with ``--from-start``. Everything else (setup, health, uploads) is the real server. Test helper, not a test.
"""

from __future__ import annotations

import signal
import sys
import threading

import deepco_server.app
import numpy as np
from deepco_server.service import DeepcoServicer

from deepco.cli import main
from deepco.wire import deepco_service_pb2 as dpb
from deepco.wire import inference_pb2 as pb
from deepco.wire.rows import decode_rows, encode_rows
from deepco.wire.tensors import add_output, decode_outputs

LIES = ("shape", "dtype", "rows", "garbage")
lying = threading.Event()


def corrupt(array: np.ndarray, lie: str) -> np.ndarray:
    """The array as the lie would have it (``garbage`` is done on the bytes, not here)."""
    if lie == "shape":
        return np.ascontiguousarray(array[:, :-1])
    if lie == "dtype":
        return array.astype(np.float64)
    if lie == "rows" and array.ndim == 4:
        return np.ascontiguousarray(array[:, :, :-1])
    return array


def lie_in_response(response: pb.ModelInferResponse, lie: str) -> pb.ModelInferResponse:
    if lie == "garbage":
        for k, raw in enumerate(response.raw_output_contents):
            response.raw_output_contents[k] = raw[: len(raw) // 2]
        return response
    outputs = decode_outputs(response)
    told = pb.ModelInferResponse(model_name=response.model_name, model_version=response.model_version, id=response.id)
    for name, array in outputs.items():
        add_output(told, name, corrupt(array, lie))
    return told


def lie_in_rows(rows: dpb.Rows, lie: str) -> dpb.Rows:
    if lie == "garbage":
        return dpb.Rows(datatype=rows.datatype, shape=rows.shape, data=rows.data[: len(rows.data) // 2],
                        start=rows.start)
    array, start = decode_rows(rows)
    if lie == "rows":
        return encode_rows(array, start + 1)
    return encode_rows(corrupt(array, lie), start)


def lying_servicer(lie: str) -> type[DeepcoServicer]:
    class Lying(DeepcoServicer):
        def Run(self, request, context):  # noqa: N802 (gRPC's name)
            for event in super().Run(request, context):
                if lying.is_set() and event.WhichOneof("event") == "result":
                    event.result.response.CopyFrom(lie_in_response(event.result.response, lie))
                yield event

        def SplitRun(self, request, context):  # noqa: N802 (gRPC's name)
            for event in super().SplitRun(request, context):
                if lying.is_set() and event.WhichOneof("event") == "split_result":
                    result = event.split_result
                    for named in result.outputs:  # a gatherer's outputs of the model
                        named.rows.CopyFrom(lie_in_rows(named.rows, lie))
                    if not result.outputs:
                        result.output.CopyFrom(lie_in_rows(result.output, lie))
                yield event

    return Lying


if __name__ == "__main__":
    lie, *rest = sys.argv[1:]
    assert lie in LIES, f"LIE must be one of {LIES}"
    if "--from-start" in rest:
        rest.remove("--from-start")
        lying.set()
    if rest[:1] == ["--"]:
        rest = rest[1:]
    signal.signal(signal.SIGUSR1, lambda *_: lying.set())
    deepco_server.app.DeepcoServicer = lying_servicer(lie)
    sys.exit(main(["serve", *rest]))
