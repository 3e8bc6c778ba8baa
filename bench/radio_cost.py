"""What the emulated radio costs the servers' CPU: each server of the camera preset's shares runs a small ORT
convolution loop under its quota while the device sends bytes over the antennas (tc tbf) to some of them; the
table has each server's run time before and during the transfer, for each MTU asked.

    python bench/radio_cost.py [--mtu 1500,9000] [--to 0,1] [--megabytes 12]

The packets' kernel work (veths, a bridge, two shapers) runs in softirq on the machine's cores, and a kernel
without IRQ time accounting charges it to whichever process was running: a server that receives nothing can pay
for the others' transfers. Root, `ip` and `tc` needed (the testbed's kernel emulation). EMULATED throughout.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepco_bench.bench_command import PRESETS
from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec

SHARES = tuple(float(s) for s in PRESETS["camera"]["shares"].split(","))  # the camera preset's servers
SINK = """
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 9000)); s.listen(8)
def drain(c):
    while c.recv(1 << 20):
        pass
print("ready", flush=True)
while True:
    threading.Thread(target=drain, args=(s.accept()[0],), daemon=True).start()
"""
LOOP = """
import sys, time, numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
w = numpy_helper.from_array(np.random.rand(64, 64, 3, 3).astype(np.float32), "w")
nodes = [helper.make_node("Conv", ["x" if i == 0 else f"y{i - 1}", "w"], [f"y{i}"], pads=[1, 1, 1, 1])
         for i in range(6)]
graph = helper.make_graph(nodes, "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 12, 320])],
                          [helper.make_tensor_value_info("y5", TensorProto.FLOAT, None)], [w])
options = ort.SessionOptions(); options.intra_op_num_threads = options.inter_op_num_threads = 1
s = ort.InferenceSession(helper.make_model(graph).SerializeToString(), options, providers=["CPUExecutionProvider"])
x = np.random.rand(1, 64, 12, 320).astype(np.float32)
s.run(None, {"x": x})
end = time.time() + float(sys.argv[2])
with open(sys.argv[1], "w") as out:
    while time.time() < end:
        a = time.time(); s.run(None, {"x": x}); out.write(f"{a} {time.time()}\\n")
"""
SEND = """
import socket, sys, threading, time
data = b"\\0" * int(sys.argv[2])
def go(host):
    with socket.create_connection((host, 9000)) as c:
        c.sendall(data)
threads = [threading.Thread(target=go, args=(h,)) for h in sys.argv[1].split(",")]
print(time.time(), flush=True)
for t in threads: t.start()
for t in threads: t.join()
print(time.time(), flush=True)
"""


def one(mtu: int, to: list[int], size: int, work: Path) -> tuple[str, list[tuple[float, float]], float]:
    """Build the testbed with ``mtu``, run the loops and the transfer; per server (median run ms before, during),
    and the transfer's seconds."""
    spec = TestbedSpec(antenna_mbps=(100.0, 100.0), servers=tuple(ServerSpec(f"s{k}", c) for k, c in enumerate(SHARES)),
                       device_cpu=0.1, mtu=mtu)
    with Testbed(spec) as tb:
        if not tb.kernel:
            raise SystemExit(f"radio_cost needs the kernel testbed: {tb.label}")
        sinks = [tb.spawn([sys.executable, "-c", SINK], server=k, stdout=subprocess.PIPE, text=True)
                 for k in range(len(SHARES))]
        for sink in sinks:
            sink.stdout.readline()
        loops = [tb.spawn([sys.executable, "-c", LOOP, str(work / f"s{k}.txt"), "20"], server=k)
                 for k in range(len(SHARES))]
        time.sleep(6.0)  # the loops' warm-up and a few seconds of runs before
        hosts = ",".join(tb.server_host(k, k % 2) for k in to)
        send = tb.spawn([sys.executable, "-c", SEND, hosts, str(size)], stdout=subprocess.PIPE, text=True)
        start, end = (float(line) for line in send.communicate(timeout=120)[0].split())
        for loop in loops:
            loop.wait(timeout=60)
        label = tb.label
    rows = []
    for k in range(len(SHARES)):
        runs = [tuple(map(float, line.split())) for line in (work / f"s{k}.txt").read_text().splitlines()]
        before = [b - a for a, b in runs if b < start - 0.3]
        during = [b - a for a, b in runs if a >= start and b <= end]
        rows.append((statistics.median(before) * 1e3, statistics.median(during) * 1e3 if during else float("nan")))
    return label, rows, end - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtu", default="1500,9000", help="comma-separated MTUs to compare (default 1500,9000)")
    ap.add_argument("--to", default="0,1", help="the servers the device sends to (default 0,1: one per antenna)")
    ap.add_argument("--megabytes", type=float, default=12.0, help="sent to each of them (default 12)")
    args = ap.parse_args()
    to = [int(k) for k in args.to.split(",")]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, {when}")
    for mtu in (int(m) for m in args.mtu.split(",")):
        with tempfile.TemporaryDirectory() as work:
            label, rows, seconds = one(mtu, to, round(args.megabytes * 1e6), Path(work))
        print(f"{label}\nMTU {mtu}: {args.megabytes:g} MB to each of s{', s'.join(map(str, to))} in {seconds:.2f} s")
        for k, (before, during) in enumerate(rows):
            role = "receives" if k in to else "receives nothing"
            print(f"  s{k} ({SHARES[k]:g} core, {role}): ORT run {before:.1f} ms before, {during:.1f} ms during: "
                  f"{(during / before - 1) * 100:+.0f}%")


if __name__ == "__main__":
    main()
