"""Training beside live partitioned inference, measured on the EMULATED testbed (deepco_bench.testbed: servers in
network namespaces with cgroup CPU quotas, the antenna shaped with tc).

    sudo .venv/bin/python bench/train_beside_inference.py [--frames 40] [--slack 0.25] [--out F.json]

Three servers: s0 and s1 serve the device's partitioned resnet18 (`deepco serve`, the device's THREAD plan
over them); s2 serves nothing. A model update (real torch training, bench/deep_edge_probe.py) is placed on
them while `deepco run` streams a clip, three ways:

1. alone: no training; the THREAD plan's measured frame completion time (``--slo-basis``: the median,
   default, or p95 of this run, frames one at a time, ``--depth 1``) is T, and SLO = (1 + slack) T. (The
   plan's own predicted frame time is reported too; on this machine it underestimates the measured one, so
   it would make even "alone" miss the SLO.)
2. naive: the fairness placement of Deep-Edge's comparison, every candidate server trains at batch 16;
3. deep-edge: Alg. 1 (deepco.scheduling.deep_edge) with the models fitted on this machine; a server that
   serves inference may train only if EstExecTime predicts its head latency at most (1 + slack) times its
   latency alone, so its slice, and the frame, finish within SLO = (1 + slack) T.
4. alone again, to show the servers recovered (drift of the machine over the run).

Every frame's measured latency comes from `deepco run --json-log`. Output is labelled EMULATED.
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

from deepco.scheduling.deep_edge import EdgeWorker, fair_plan, schedule_update  # noqa: E402
from deepco.scheduling.deep_edge_models import load_models  # noqa: E402

PROBE = str(ROOT / "bench" / "deep_edge_probe.py")
SHARES = {"s0": 0.6, "s1": 0.5, "s2": 0.4}
INFERENCE = ("s0", "s1")
PORT = 50081
MODEL, SIZE = "resnet18", "224x224"


def write_cluster(path: Path, tb: Testbed, bandwidth: float) -> Path:
    lines = ["[device]", "antennas = 1", f"bandwidth = {bandwidth}", ""]
    for k, server in enumerate(tb.spec.servers):
        if server.name in INFERENCE:
            lines += ["[[servers]]", f'name = "{server.name}"', f"capacity = {server.cpu}",
                      f'antenna_addresses = ["{tb.server_host(k, 0)}:{PORT}"]', ""]
    path.write_text("\n".join(lines))
    return path


def stream(tb: Testbed, cluster: Path, clip: Path, frames: int, log: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "deepco", "run", "--cluster", str(cluster), "--model", MODEL, "--input-size", SIZE,
           "--source", str(clip), "--frames", str(frames), "--json-log", str(log), "--quiet", "--depth", "1"]
    if not tb.kernel:
        cmd.append("--pace")
    code = tb.spawn(cmd).wait()
    if code:
        raise RuntimeError(f"deepco run failed (exit {code})")
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]


def summary(records: list[dict], slo: float | None) -> dict:
    lat = [r["latency"] * 1e3 for r in records[3:] if r["error"] is None]  # first frames warm the servers
    out = {"frames": len(lat), "p50_ms": statistics.median(lat), "p95_ms": sorted(lat)[int(0.95 * (len(lat) - 1))],
           "max_ms": max(lat), "predicted_ms": records[0]["predicted"] * 1e3}
    if slo is not None:
        out["within_slo"] = sum(v <= slo for v in lat) / len(lat)
        out["p50_within_slo"] = out["p50_ms"] <= slo
    return out


def run_case(name: str, tb: Testbed, placement: dict[str, int], cluster: Path, clip: Path, frames: int,
             work: Path, slo: float | None) -> dict:
    trainers = {}
    for srv, batch in placement.items():
        k = list(SHARES).index(srv)
        out = work / f"{name}-{srv}.train.json"
        trainers[srv] = (tb.spawn([sys.executable, PROBE, "train", "--batch", str(batch), "--seconds", "900",
                                   "--out", str(out)], server=k), out)
    for srv, (proc, out) in trainers.items():
        end = time.time() + 240
        while not Path(str(out) + ".ready").exists():
            if proc.poll() is not None or time.time() > end:
                raise RuntimeError(f"{name}: the trainer on {srv} did not start")
            time.sleep(0.2)
    records = stream(tb, cluster, clip, frames, work / f"{name}.jsonl")
    train = {}
    for srv, (proc, out) in trainers.items():
        proc.terminate()
        proc.wait(timeout=60)
        d = json.loads(out.read_text())
        if d["steps"]:
            train[srv] = {"batch": d["batch"], "steps": len(d["steps"]),
                          "samples_per_s": d["batch"] * len(d["steps"]) / sum(d["steps"])}
    res = {"case": name, "placement": placement, **summary(records, slo), "training": train}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=120)
    ap.add_argument("--slack", type=float, default=0.25)
    ap.add_argument("--slo-basis", choices=("p50", "p95"), default="p50")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--bandwidth", type=float, default=200.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_beside_inference.json"))
    a = ap.parse_args()
    import cv2
    import numpy as np
    from deepco_device.sources import make_pan_zoom_clip

    models = load_models()
    spec = TestbedSpec(antenna_mbps=(a.bandwidth,), servers=tuple(ServerSpec(n, c) for n, c in SHARES.items()),
                       device_cpu=0.5)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, Testbed(spec, defer_cpu_limits=True) as tb:
        work = Path(tmp)
        img = (np.random.default_rng(0).random((300, 256, 3)) * 255).astype(np.uint8)
        cv2.imwrite(str(work / "still.png"), img)
        clip = make_pan_zoom_clip(work / "still.png", work / "clip.mp4", frames=a.frames)
        host = "0.0.0.0" if tb.kernel else "127.0.0.1"
        procs = [tb.spawn([sys.executable, "-m", "deepco", "serve", "--host", host, "--port", str(PORT), "--threads",
                           "1"], server=k, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for k in range(len(SHARES))]
        for p in procs:
            if "listening" not in p.stdout.readline():
                raise RuntimeError("deepco serve did not start")
        tb.apply_cpu_limits()
        cluster = write_cluster(work / "cluster.toml", tb, a.bandwidth)
        alone = run_case("alone", tb, {}, cluster, clip, a.frames, work, None)
        slo = (1 + a.slack) * alone[f"{a.slo_basis}_ms"]
        alone["within_slo"] = None
        workers = [EdgeWorker(n, q, slo_ms=(1 + a.slack) * models.inference_ms(q, 0.0, 0) if n in INFERENCE
                              else None, link_mbps=a.bandwidth) for n, q in SHARES.items()]
        naive_plan = fair_plan(workers, a.samples, models)
        de_plan = schedule_update(workers, a.samples, models)
        naive = run_case("naive", tb, naive_plan.batch, cluster, clip, a.frames, work, slo)
        deep = run_case("deep-edge", tb, de_plan.batch, cluster, clip, a.frames, work, slo)
        again = run_case("alone-again", tb, {}, cluster, clip, a.frames, work, slo)
        label = tb.label
    doc = {"label": label, "command": "sudo .venv/bin/python bench/train_beside_inference.py "
           f"--frames {a.frames} --slack {a.slack} --slo-basis {a.slo_basis}",
           "machine": f"{platform.machine()} 2-core sandbox",
           "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", "wall_seconds": round(time.time() - t0, 1),
           "slo_basis": a.slo_basis, "shares": SHARES, "inference_servers": INFERENCE, "model": f"{MODEL}@{SIZE}",
           "slo_ms": slo,
           "slack": a.slack, "naive_plan": naive_plan.to_dict(), "deep_edge_plan": de_plan.to_dict(),
           "cases": [alone, naive, deep, again]}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
