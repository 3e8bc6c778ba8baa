"""DeepCo on the wire: generated Open Inference Protocol / DeepCo gRPC code and tensor <-> message helpers.

- ``inference_pb2`` / ``inference_pb2_grpc``: the Open Inference Protocol (KServe v2 / Triton) API,
- ``deepco_service_pb2`` / ``deepco_service_pb2_grpc``: DeepCo's own small service (Profile),
- ``deepco.wire.tensors``: numpy arrays <-> protocol tensors,
- ``deepco.wire.client``: a small blocking client for `deepco serve` (and any Open Inference server).

The generated modules come from protos/ via ``python protos/generate.py``; never edit them by hand.
"""

# gRPC's default receive limit is 4 MiB, far below one camera frame's feature maps: both ends raise it.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

GRPC_MESSAGE_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
