"""The nine attacks of the server's second hostile review, each held for ``--seconds`` against a real
`deepco serve` process with small budgets, probing ServerReady every 100 ms with a 1 s deadline.

    python bench/attacks.py [--seconds 30] [--only 1,2,...] [-- SERVE FLAGS...]

Starts `python -m deepco serve --port 0 --device cpu --threads 1 --max-request-bytes 16MiB --max-held-bytes
32MiB --max-inflight 2 --stream-idle-timeout 5 SERVE FLAGS`, loads a small conv net, then runs each attack in
turn, in a loop, for ``--seconds``. Prints one line per attack: the server's peak RSS during it (VmHWM,
restarted before each attack) against the bound (idle RSS + inflight x request bound + held bytes + 256 MB),
the slowest and failed probes, what the attack's calls ended with, and a traceback count of the log. The
attacks themselves are tests/attack_support.py's, which tests/test_server_bounds.py holds for seconds.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from attack_support import (  # noqa: E402 (tests/ is put on the path above)
    TYPED_CASES,
    Prober,
    answer_within,
    compressed_echo,
    headers_only,
    identity_model,
    made_up_exchanges,
    peak_mb,
    repeated_outputs_request,
    reset_peak,
    rss_mb,
    string_doubling_model,
    typed_request,
    unread_replies,
    wide_conv_transpose_model,
)
from onnx import TensorProto  # noqa: E402
from test_server_support import conv_model, serve_process  # noqa: E402

from deepco.wire import deepco_service_pb2 as dpb  # noqa: E402
from deepco.wire import inference_pb2 as pb  # noqa: E402
from deepco.wire.client import InferenceClient, ServerError  # noqa: E402
from deepco.wire.rows import encode_rows  # noqa: E402

MIB = 1 << 20
REQUEST, HELD, INFLIGHT, IDLE = 16 * MIB, 32 * MIB, 2, 5


def _code(call: Callable[[], object]) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name
    except ServerError as exc:
        return exc.code.name


def _repeat(seconds: float, threads: int, attack: Callable[[], str]) -> collections.Counter:
    """Run ``attack`` in ``threads`` threads back to back for ``seconds``; its outcomes, counted."""
    outcomes: collections.Counter = collections.Counter()
    end = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < end:
            outcomes[attack()] += 1

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return outcomes


def attacks(address: str) -> dict[str, Callable[[float], collections.Counter]]:
    """Attack number -> a function holding it for so many seconds."""
    big = np.zeros((1, 3, 256, 341), np.float32)  # 1 MiB

    def strings(seconds: float) -> collections.Counter:
        with InferenceClient(address, timeout=30) as c:
            return _repeat(seconds, 1, lambda: _code(lambda: c.load_model(string_doubling_model(27), "strings")))

    def repeated(seconds: float) -> collections.Counter:
        request = repeated_outputs_request("conv", big, "output", 1000)
        with grpc.insecure_channel(address) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=pb.ModelInferRequest.SerializeToString)
            run = channel.unary_stream("/deepco.DeepcoService/Run",
                                       request_serializer=pb.ModelInferRequest.SerializeToString)
            return _repeat(seconds, 4, lambda: _code(lambda: (infer(request, timeout=30),
                                                              list(run(request, timeout=30)))))

    def headers(method: str, metadata: tuple = ()) -> Callable[[float], collections.Counter]:
        def hold(seconds: float) -> collections.Counter:
            outcomes: collections.Counter = collections.Counter()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                with headers_only(address, method, 8, metadata=metadata, seconds=10):
                    for _ in range(4):
                        time.sleep(0.5)
                        for name, outcome in answer_within(address).items():
                            code, took = outcome.split()
                            outcomes[f"{name} {code}"] += 1
                            outcomes["slowest control/probe call ms"] = max(
                                outcomes["slowest control/probe call ms"], int(float(took[:-1]) * 1000))
            return outcomes
        return hold

    def replies(seconds: float) -> collections.Counter:
        outcomes: collections.Counter = collections.Counter()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for status in unread_replies(address, 40, 16 * MIB, seconds=IDLE + 5).values():
                outcomes[grpc.StatusCode.RESOURCE_EXHAUSTED.name if status == 8 else str(status)] += 1
        return outcomes

    def workspace(seconds: float) -> collections.Counter:
        with InferenceClient(address, timeout=30) as c:
            c.load_model(wide_conv_transpose_model(32), "wide")
            try:
                x = np.zeros((1, 1, 1024, 1024), np.float32)  # 4 MiB in, 4 MiB out, 4 GiB of column buffer
                return _repeat(seconds, 2, lambda: _code(lambda: c.infer("wide", x)))
            finally:
                c.unload_model("wide")

    def compressed(seconds: float) -> collections.Counter:
        return _repeat(seconds, 2, lambda: compressed_echo(address, 250 * MIB, timeout=30))

    def mailboxes(seconds: float) -> collections.Counter:
        level0 = dpb.SplitLevel(owned=[dpb.RowRange(start=0, stop=4), dpb.RowRange(start=4, stop=8)])
        level1 = dpb.SplitLevel(owned=[dpb.RowRange(start=0, stop=4), dpb.RowRange(start=4, stop=8)],
                                window=[dpb.RowRange(start=0, stop=5), dpb.RowRange(start=3, stop=8)], crop=[0, 1])
        jobs = iter(range(1 << 30))

        def victim() -> str:
            job = dpb.SplitRequest(job_id=f"victim-{next(jobs)}", peers=[address, "127.0.0.1:9"], server_index=0,
                                   segment_models=["conv"], levels=[level0, level1], lookahead=True,
                                   input=encode_rows(np.zeros((1, 3, 5, 8), np.float32), 0))
            with grpc.insecure_channel(address) as channel:
                run = channel.unary_stream("/deepco.DeepcoService/SplitRun",
                                           request_serializer=dpb.SplitRequest.SerializeToString)
                return "victim " + _code(lambda: list(run(job, timeout=30)))

        outcomes: collections.Counter = collections.Counter()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for code, count in made_up_exchanges(address, 17, prefix=f"made-up-{time.monotonic()}").items():
                outcomes[f"exchange {code}"] += count
            outcomes[victim()] += 1
        return outcomes

    def typed(seconds: float) -> collections.Counter:
        with InferenceClient(address, timeout=30) as c:
            for datatype in TYPED_CASES:
                c.load_model(identity_model(getattr(TensorProto, datatype)), f"identity-{datatype.lower()}")
            with grpc.insecure_channel(address) as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                            request_serializer=pb.ModelInferRequest.SerializeToString)
                cases = iter(sorted(TYPED_CASES) * (1 << 20))

                def one() -> str:
                    datatype = next(cases)
                    field, value = TYPED_CASES[datatype]
                    return _code(lambda: infer(typed_request(f"identity-{datatype.lower()}", datatype, field, value),
                                               timeout=30))

                try:
                    return _repeat(seconds, 2, one)
                finally:
                    for datatype in TYPED_CASES:
                        c.unload_model(f"identity-{datatype.lower()}")

    return {"1 strings": strings, "2 repeated outputs": repeated,
            "3 headers-only probes": headers("/inference.GRPCInferenceService/ServerReady"),
            "4 unread replies": replies, "5 conv workspace": workspace, "6 compressed": compressed,
            "7 made-up exchanges": mailboxes,
            "8 headers-only control": headers("/inference.GRPCInferenceService/RepositoryIndex"),
            "9 typed contents": typed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--only", default="", help="comma-separated attack numbers (default: all nine)")
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args()
    flags = ["--device", "cpu", "--threads", "1", "--max-request-bytes", str(REQUEST), "--max-held-bytes", str(HELD),
             "--max-inflight", str(INFLIGHT), "--stream-idle-timeout", str(IDLE), *args.serve_flags]
    only = {int(n) for n in args.only.split(",") if n}
    with serve_process(*flags) as server:
        pid = server.proc.pid
        with InferenceClient(server.address, timeout=30) as c:
            c.load_model(conv_model(channels=(3, 4)), "conv")
            c.infer("conv", np.zeros((1, 3, 8, 8), np.float32))
        time.sleep(1.0)
        idle = rss_mb(pid)
        bound = idle + (INFLIGHT * REQUEST + HELD) / MIB + 256
        print(f"idle RSS {idle:.0f} MB; bound {bound:.0f} MB (idle + {INFLIGHT} x {REQUEST // MIB} MiB + "
              f"{HELD // MIB} MiB + 256 MB); {args.seconds:g} s per attack", flush=True)
        for name, attack in attacks(server.address).items():
            if only and int(name.split()[0]) not in only:
                continue
            reset_peak(pid)
            tracebacks = "".join(server.stderr_lines).count("Traceback")
            with Prober(server.address, own_process=True) as prober:
                started = time.monotonic()
                outcomes = attack(args.seconds)
                took = time.monotonic() - started
                time.sleep(1.0)  # and a second after
            peak = peak_mb(pid)
            tracebacks = "".join(server.stderr_lines).count("Traceback") - tracebacks
            print(f"{name:24s} peak {peak:6.0f} MB ({'within' if peak <= bound else 'OVER'} bound), after "
                  f"{rss_mb(pid):5.0f} MB, probes {len(prober.results)} failed {len(prober.failed)} slowest "
                  f"{prober.slowest * 1000:4.0f} ms, {took:.0f} s, tracebacks {tracebacks}; "
                  f"{dict(outcomes)}", flush=True)
            if server.proc.poll() is not None:
                print("the server died", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
