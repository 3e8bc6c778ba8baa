"""Profile, on this machine, what Deep-Edge's models need: real torch training steps (forward + backward +
SGD) of the zoo's resnet18 at several batch sizes under several CPU quotas and background loads, and the
latency a co-located `deepco serve` running a resnet18 head shows with and without that training beside it.

    sudo .venv/bin/python bench/deep_edge_profile.py [--out deepco/scheduling/data/deep_edge_profile.json]

Each CPU quota is one EMULATED server: a network namespace with a cgroup CPU quota (deepco_bench.testbed), in which
`deepco serve --threads 1` serves the head, the background load (a duty-cycle spinner) and the trainer run;
the inference client runs in the device namespace. Writes the raw measurements with machine and date; the
fitted models are in ``deepco.scheduling.deep_edge_models`` (which load this file).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec  # noqa: E402

PROBE = str(ROOT / "bench" / "deep_edge_probe.py")
QUOTAS = (0.4, 0.7, 1.0)
LOADS = (0.0, 0.4)
BATCHES = (0, 4, 8, 16)  # 0: no training (the inference baseline)
HEAD_CUT = "layer2"
HEAD_SIZE = 160
PORT = 50071
PARAMS: dict[str, int] = {}


def export_head(path: Path) -> None:
    import onnx

    from deepco.partition.partitioner import Partitioner
    from deepco.partition.source import load_model

    head, _ = Partitioner(load_model("resnet18", HEAD_SIZE, HEAD_SIZE), HEAD_SIZE, HEAD_SIZE).split(HEAD_CUT)
    onnx.save(head, str(path))


def wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    end = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited ({proc.returncode}) before it was ready")
        if time.time() > end:
            raise RuntimeError(f"the trainer was not ready in {timeout:.0f} s")
        time.sleep(0.1)


def one_quota(quota: float, work: Path, infer_s: float, rows: list[dict]) -> None:
    spec = TestbedSpec(antenna_mbps=(1000.0,), servers=(ServerSpec("s0", quota),))
    with Testbed(spec, defer_cpu_limits=True) as tb:
        print(tb.label, flush=True)
        host = "0.0.0.0" if tb.kernel else "127.0.0.1"
        serve = tb.spawn([sys.executable, "-m", "deepco", "serve", "--host", host, "--port", str(PORT),
                          "--threads", "1"], server=0, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if "listening" not in serve.stdout.readline():
            raise RuntimeError("deepco serve did not start")
        tb.apply_cpu_limits()
        address = f"{tb.server_host(0)}:{PORT}"
        for load in LOADS:
            spinner = None
            if load:
                spinner = tb.spawn([sys.executable, PROBE, "spin", "--duty", str(load)], server=0)
            for batch in BATCHES:
                tag = f"q{quota}-l{load}-b{batch}"
                trainer = None
                if batch:
                    tout = work / f"{tag}.train.json"
                    trainer = tb.spawn([sys.executable, PROBE, "train", "--batch", str(batch), "--seconds",
                                        str(infer_s + 1.5), "--out", str(tout)], server=0)
                    wait_file(Path(str(tout) + ".ready"), trainer, 180)
                    time.sleep(0.5)
                iout = work / f"{tag}.infer.json"
                head = str(work / "head.onnx")
                code = tb.spawn([sys.executable, PROBE, "infer", "--address", address, "--head", head,
                                 "--seconds", str(infer_s), "--out", str(iout), "--height", str(HEAD_SIZE),
                                 "--width", str(HEAD_SIZE)]).wait()
                if code:
                    raise RuntimeError(f"{tag}: the inference probe failed ({code})")
                lat = json.loads(iout.read_text())["latency_s"]
                row = {"quota": quota, "load": load, "batch": batch, "infer_ms_median": 1e3 * statistics.median(lat),
                       "infer_ms_p95": 1e3 * sorted(lat)[int(0.95 * (len(lat) - 1))], "infer_n": len(lat)}
                if trainer is not None:
                    trainer.wait(timeout=120)
                    tdoc = json.loads(tout.read_text())
                    steps = tdoc["steps"]
                    PARAMS["resnet18"] = tdoc["params"]
                    row.update({"step_s_median": statistics.median(steps), "steps": len(steps),
                                "step_s": steps})
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
            if spinner is not None:
                spinner.terminate()
                spinner.wait()
        serve.terminate()
        serve.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "deepco" / "scheduling" / "data" / "deep_edge_profile.json"))
    ap.add_argument("--infer-seconds", type=float, default=4.0)
    a = ap.parse_args()
    rows: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        export_head(work / "head.onnx")
        for quota in QUOTAS:
            one_quota(quota, work, a.infer_seconds, rows)
    doc = {"what": "EMULATED edge server (network namespace + cgroup CPU quota, deepco_bench.testbed): resnet18 "
                   f"training steps (torch, 1 thread, {64}x{64} inputs) beside `deepco serve --threads 1` "
                   f"running the resnet18 head up to {HEAD_CUT} on {HEAD_SIZE}x{HEAD_SIZE} frames",
           "command": "sudo .venv/bin/python bench/deep_edge_profile.py",
           "machine": f"{platform.machine()} 2-core sandbox, {platform.processor() or 'cpu'}, "
                      f"python {platform.python_version()}",
           "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", "wall_seconds": round(time.time() - t0, 1),
           "quotas": QUOTAS, "loads": LOADS, "batches": BATCHES, "head": f"resnet18/{HEAD_CUT}@{HEAD_SIZE}",
           "train_model": "resnet18@64", "params": PARAMS.get("resnet18"), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
