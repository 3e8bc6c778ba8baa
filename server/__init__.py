"""`deepco serve`: an Open Inference Protocol (KServe v2 / Triton gRPC) server running ONNX Runtime.

- ``server.models``: execution-provider choice, loaded models (ORT sessions) and request validation,
- ``server.service``: the gRPC servicers (inference.GRPCInferenceService, deepco.DeepcoService),
- ``server.app``: the process: sockets, limits, health, graceful shutdown.

It imports ``deepco`` (wire code, errors) and never ``device``.
"""
