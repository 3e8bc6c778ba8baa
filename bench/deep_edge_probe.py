"""Helpers that `bench/deep_edge_profile.py` starts inside the emulated testbed (one process each):

    python bench/deep_edge_probe.py train --batch B --seconds S --out F   # real torch training steps
    python bench/deep_edge_probe.py spin --duty D                           # background CPU load (duty cycle)
    python bench/deep_edge_probe.py infer --address A --head F --seconds S --out F   # deepco serve latency

``train`` runs forward + backward + SGD steps of the zoo's resnet18 (random 64x64 images, 10 classes) on one
thread for S seconds and writes each step's wall time; ``infer`` loads the ONNX head onto a running
`deepco serve` and times ModelInfer calls back to back for S seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRAIN_SIZE = 64


def train(batch: int, seconds: float, out: str, model_name: str = "resnet18") -> None:
    import torch

    from deepco import zoo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = zoo.build(model_name, TRAIN_SIZE, TRAIN_SIZE)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, TRAIN_SIZE, TRAIN_SIZE)
    y = torch.randint(0, 10, (batch,))
    steps = []

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x)[:, :10], y)
        loss.backward()
        opt.step()

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)  # a driver that stops us early still gets the steps so far
    step()  # warm-up, then tell the driver we are training
    Path(out + ".ready").write_text("ready")
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            step()
            steps.append(time.perf_counter() - t0)
    finally:
        params = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"batch": batch, "steps": steps, "params": params}))


def spin(duty: float) -> None:
    period = 0.01
    while True:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * period:
            pass
        time.sleep(max(0.0, (1 - duty) * period))


def infer(address: str, head: str, seconds: float, out: str, height: int, width: int) -> None:
    import numpy as np

    from deepco.wire.client import InferenceClient

    with InferenceClient(address, timeout=60) as client:
        client.wait_ready(30)
        client.load_model(Path(head).read_bytes(), "head")
        x = np.random.default_rng(0).standard_normal((1, 3, height, width)).astype(np.float32)
        client.infer("head", x)  # warm-up
        lat = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            client.infer("head", x)
            lat.append(time.perf_counter() - t0)
        client.unload_model("head")
    Path(out).write_text(json.dumps({"latency_s": lat, "pid": os.getpid()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("train", "spin", "infer"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--duty", type=float, default=0.5)
    ap.add_argument("--address")
    ap.add_argument("--head")
    ap.add_argument("--height", type=int, default=224)
    ap.add_argument("--width", type=int, default=224)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.what == "train":
        train(a.batch, a.seconds, a.out)
    elif a.what == "spin":
        spin(a.duty)
    else:
        infer(a.address, a.head, a.seconds, a.out, a.height, a.width)


if __name__ == "__main__":
    main()
