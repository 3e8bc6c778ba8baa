"""Readiness and memory of a real `deepco serve` process under a flood of large inference requests.

    python bench/readiness_flood.py --clients 200 --mib 8 --seconds 10 [-- SERVE FLAGS...]

Starts `python -m deepco serve --port 0 --device cpu --threads 1 SERVE FLAGS`, loads a small conv net, then
``--clients`` threads (one channel each) send ModelInfer requests of about ``--mib`` MiB back to back for
``--seconds``. Meanwhile, and for ``--after`` seconds after, ServerReady and grpc.health.v1 Health/Check are
probed every 0.25 s with a 1 s deadline, and the server's RSS is sampled. Then the model is unloaded and the
RSS read again. Prints one JSON object: the probes that failed or took over 1 s, the flood's status codes,
the slowest refusal, and RSS (MiB) before, at peak, after the flood and after the unload.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from onnx import TensorProto, helper, numpy_helper

from deepco.wire import inference_pb2 as pb
from deepco.wire.client import InferenceClient
from deepco.wire.tensors import encode_request

ROOT = Path(__file__).resolve().parent.parent
PROBE_EVERY = 0.25
DEADLINE = 1.0


def conv_model() -> bytes:
    """One 3x3 conv, 3 -> 4 channels, any height and width."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    node = helper.make_node("Conv", ["input", "w"], ["output"], kernel_shape=[3, 3], pads=[1] * 4)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, "H", "W"])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4, "H", "W"])
    model = helper.make_model(helper.make_graph([node], "conv", [x], [y], initializer=[w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Probes:
    """ServerReady and Health/Check every PROBE_EVERY seconds with a DEADLINE, and RSS samples.

    Run in a process of its own (:func:`probe_process`): in the flooding process, the probes' own thread
    waited for that process's GIL and its 200 busy channels, which is not the server's delay.
    """

    def __init__(self, address: str, pid: int):
        self.channel = grpc.insecure_channel(address)
        self.ready = self.channel.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                              request_serializer=pb.ServerReadyRequest.SerializeToString,
                                              response_deserializer=pb.ServerReadyResponse.FromString)
        self.check = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                              request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                              response_deserializer=health_pb2.HealthCheckResponse.FromString)
        self.pid = pid
        self.results: list[tuple[str, float, str, float]] = []  # (probe, seconds, "OK" or the code, when)
        self.rss: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _one(self, name: str, call, request) -> None:
        start = time.perf_counter()
        try:
            call(request, timeout=DEADLINE)
            outcome = "OK"
        except grpc.RpcError as exc:
            code = exc.code()
            outcome = code.name if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"{code.name}: {exc.details()}"
        self.results.append((name, time.perf_counter() - start, outcome, time.time()))

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self._one("ServerReady", self.ready, pb.ServerReadyRequest())
            self._one("Health/Check", self.check, health_pb2.HealthCheckRequest(service=""))
            self.rss.append(rss_mib(self.pid))
            self._stop.wait(max(0.0, PROBE_EVERY - (time.monotonic() - began)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.channel.close()


def probe_process(address: str, pid: int, stop: multiprocessing.synchronize.Event,
                  out: multiprocessing.queues.Queue) -> None:
    """Probe until ``stop`` is set, then put (results, RSS samples) on ``out``."""
    probes = Probes(address, pid)
    probes.start()
    stop.wait()
    probes.stop()
    out.put((probes.results, probes.rss))


def flood(address: str, method: str, payload: bytes, until: float, codes: collections.Counter,
          refusals: list[float]) -> None:
    """Send ``payload`` to ``method`` back to back until ``until``, counting status codes."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1),
                                                 ("grpc.max_receive_message_length", -1)]) as channel:
        infer = channel.unary_unary(method)
        while time.monotonic() < until:
            start = time.perf_counter()
            try:
                infer(payload, timeout=30)
                codes["OK"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refusals.append(time.perf_counter() - start)


def main() -> None:
    """Run the flood and print the summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--mib", type=float, default=8.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--after", type=float, default=5.0)
    p.add_argument("--method", default="/inference.GRPCInferenceService/ModelInfer",
                   help="the method flooded (another one is answered UNIMPLEMENTED without reading the request)")
    p.add_argument("--server-cpus", help="pin the server to these CPUs (taskset list, e.g. 1) and the flood to "
                                          "the others, as if they were different machines")
    p.add_argument("--server-log", type=Path, help="write the server's stderr here (default: dropped)")
    p.add_argument("serve", nargs="*", help="extra `deepco serve` flags (after --)")
    args = p.parse_args()
    pin: list[str] = []
    if args.server_cpus:
        pin = ["taskset", "-c", args.server_cpus]
        server_cpus = {int(c) for c in args.server_cpus.split(",")}
        os.sched_setaffinity(0, (os.sched_getaffinity(0) - server_cpus) or os.sched_getaffinity(0))
    proc = subprocess.Popen([*pin, sys.executable, "-m", "deepco", "serve", "--port", "0", "--device", "cpu",
                             "--threads", "1", *args.serve], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=args.server_log.open("w") if args.server_log else subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        address = line.rsplit(" ", 1)[-1].strip()
        width = max(1, int(args.mib * 2**20 / (3 * 4 * 1024)))
        x = np.random.default_rng(0).standard_normal((1, 3, 1024, width)).astype(np.float32)
        with InferenceClient(address, timeout=30) as c:
            c.load_model(conv_model(), "conv")
            payload = encode_request("conv", {"input": x}).SerializeToString()
            time.sleep(1.0)
            before = rss_mib(proc.pid)
            spawn = multiprocessing.get_context("spawn")
            stop, out = spawn.Event(), spawn.Queue()
            prober = spawn.Process(target=probe_process, args=(address, proc.pid, stop, out), daemon=True)
            prober.start()
            time.sleep(1.0)  # the prober's start-up (imports)
            began, began_wall = time.monotonic(), time.time()
            codes: collections.Counter = collections.Counter()
            refusals: list[float] = []
            until = time.monotonic() + args.seconds
            threads = [threading.Thread(target=flood, args=(address, args.method, payload, until, codes, refusals),
                                        daemon=True) for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            flood_seconds = time.monotonic() - began
            time.sleep(args.after)
            stop.set()
            results, rss = out.get(timeout=60)
            prober.join(timeout=10)
            after = rss_mib(proc.pid)
            c.unload_model("conv")
            time.sleep(3.0)  # the server gives freed memory back once quiet for a second
            unloaded = rss_mib(proc.pid)
        bad = [(n, round(s, 3), o, round(t - began_wall, 1)) for n, s, o, t in results if o != "OK" or s > DEADLINE]
        print(json.dumps({
            "clients": args.clients, "request_mib": round(len(payload) / 2**20, 2), "seconds": args.seconds,
            "serve_flags": args.serve, "probes": len(results), "flood_seconds": round(flood_seconds, 1),
            "probes_failed": len(bad), "failed (probe, s, outcome, at s)": bad[:20],
            "slowest_probe_s": round(max(r[1] for r in results), 3),
            "flood_codes": dict(codes),
            "refusal_s": {"median": round(float(np.median(refusals)), 3), "max": round(max(refusals), 3)}
            if refusals else None,
            "rss_mib": {"before": round(before), "peak": round(max(rss)), "after_flood": round(after),
                        "after_unload": round(unloaded)},
            "server_alive": proc.poll() is None}))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
