"""`deepco serve`: an Open Inference Protocol (KServe v2 / Triton gRPC) server running ONNX Runtime.

- ``server.errors``: the transport-free refusals (ServerFault and its kinds) the data plane raises,
- ``server.models``: execution-provider choice, loaded models (ORT sessions) and request validation,
- ``server.dataplane``: the state the servicers share and the admission of compute,
- ``server.split_jobs``: split jobs (bands computed level by level, halos exchanged between servers),
- ``server.service``: the gRPC servicers (inference.GRPCInferenceService, deepco.DeepcoService), which
  translate the protocol and map ServerFaults to status codes in one place (``status_of``),
- ``server.app``: the process: sockets, limits, health, graceful shutdown.

It imports ``deepco`` (wire code, errors) and never ``device``.
"""
