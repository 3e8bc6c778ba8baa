"""Every plan kind, every output, at a camera's size: real `deepco serve` processes on loopback, one frame per
plan forced with `deepco run --plan`, each output against ONNX Runtime on the whole model (issue 29: "at
736x1280, in bench/").

    python bench/exact_plans.py [--input-size 736x1280] [--models yolov8n,unet,ppocr,yolox] [--json F.json]

The models: the zoo's detector and U-Net, and two real third-party ones from wheels of the `test` extra:
PaddleOCR's PP-OCRv6 text detector (Paddle, from `rapidocr`) and ddddocr's YOLOX detector (PyTorch 1.9, from
`ddddocr`; the file is fixed at 416x416, so it is made dynamic first with onnx's own `update_model_dims`, as a
user re-exporting with dynamic axes would). The plans, made by the staged planner on the servers' measured
rates: local, offload, round-robin; splits at single-tensor cuts with and without lookahead, the tail on the
device and on a server, in parts (the interior while the halo is in flight); one stage across scales; the
planner's chain of stages across scales; and a chain exchanging halos at every stage with the tail on a server.
A kind the model cannot take (a cut with too few rows, no chain) is reported with why, never counted as passed.

Prints one line per model and plan (the plan, its stages, its largest relative error over the outputs, each
output judged on its own scale: max |out - ref| / max |ref|) and exits 1 if any exceeds 1e-4. The servers run
unthrottled: this measures exactness, not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from deepco_bench.third_party import dynamic_yolox, wheel_file
from deepco_device.answers import relative_error
from deepco_device.plan_command import save_plan
from deepco_device.session import Device
from deepco_device.staged import StagedPlanner
from step_overhead import server

from deepco.cli import main as cli_main
from deepco.cluster import parse_cluster
from deepco.parsing import parse_size
from deepco.planning.staged import StagedPlan, in_parts, scales_chain, scales_plan, split_plan, split_shares

TOLERANCE = 1e-4
PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
PPOCR_CARD = 'order = "bgr"\nmean = [0.5]\nstd = [0.5]\nresize = "stretch"\n'
YOLOX_CARD = 'order = "bgr"\nmean = [0.0]\nstd = [1.0]\nscale = 1.0\nresize = "stretch"\n'


def _shipped(package: str, *parts: str) -> Path:
    path = wheel_file(package, *parts)
    if path is None:
        raise SystemExit(f"{package} is not installed: pip install -e '.[test]'")
    return path


def model_path(name: str, folder: Path) -> str:
    """A zoo name as it is, or a third-party model written into ``folder`` beside its model card."""
    if name == "ppocr":
        path = folder / "ppocr.onnx"
        path.write_bytes(_shipped("rapidocr", "models", "PP-OCRv6_det_small.onnx").read_bytes())
        (folder / "ppocr.toml").write_text(f"[input]\n{PPOCR_CARD}")
        return str(path)
    if name == "yolox":
        model = dynamic_yolox(onnx.load(_shipped("ddddocr", "common_det.onnx")))
        path = folder / "yolox.onnx"
        onnx.save(model, path)
        (folder / "yolox.toml").write_text(f"[input]\n{YOLOX_CARD}")
        return str(path)
    return name


def plans(planner: StagedPlanner, names: list[str]) -> dict[str, StagedPlan | str]:
    """Every plan kind for the planner's model over ``names``; a string says why a kind does not apply."""
    costs, rates = planner.costs, planner.rates()
    cuts = [c.name for c in costs.cuts]
    levels = [lv.name for lv in costs.p.levels[1:]]
    made: dict[str, StagedPlan | str | None] = {
        "local": planner.named("local"), "offload": planner.named("offload"),
        "round-robin": planner.named("round-robin")}
    if cuts:
        made |= {
            "split, lookahead, tail on the device": split_plan(costs, rates, names, [cuts[-1]], True, None),
            "split, lookahead, tail on a server": split_plan(costs, rates, names, [cuts[-1]], True, names[0]),
            "split, no lookahead, tail on the device": split_plan(costs, rates, names, cuts[-2:], False, None),
            "split, no lookahead, tail on a server": split_plan(costs, rates, names, cuts[-2:], False, names[-1]),
        }
        two = split_plan(costs, rates, names, [cuts[0], cuts[-1]], True, None)
        parted = in_parts(two, costs) if two is not None else None
        made["split in parts (overlap)"] = (parted if parted is None or parted.overlap
                                            else "no stage of the split can overlap its halo")
    else:
        made["split at a single-tensor cut"] = "no single-tensor cut"
    made["one stage across scales"] = scales_plan(costs, rates, names)
    chain = scales_chain(costs, rates, names, True)
    made["stages across scales (the planner's chain)"] = (scales_plan(costs, rates, names, levels=chain)
                                                          if chain else "no chain fits")
    # the chain again, each stage's halo exchanged (no lookahead), the rest of the model on a server; where the
    # chain is a single stage, every fourth level
    stages = chain if len(chain) > 1 else levels[max(1, len(levels) // 4)::max(1, len(levels) // 4)]
    if stages and costs.p.level_tail(stages[-1]) is None:  # nothing after the last level for a server to run
        stages = stages[:-1]
    made["stages across scales, halo exchanges, tail on a server"] = (
        scales_plan(costs, rates, names, levels=stages, lookahead=False, tail=names[0]) if stages else None)
    return {k: v if v is not None else "the planner made none (too few rows at a level)" for k, v in made.items()}


def check(model: str, height: int, width: int, addresses: list[str], folder: Path) -> list[dict]:
    """One frame of the photo through every plan kind of ``model``, each plan saved and run with `deepco run
    --plan` as a user forces it (`--save-outputs`): a record per plan, each output against ONNX Runtime on the
    whole model fed the inputs the run saved."""
    data = {"servers": [{"name": f"s{i}", "address": a} for i, a in enumerate(addresses)]}
    cluster_file = folder / "cluster.toml"
    cluster_file.write_text("".join(f'[[servers]]\nname = "s{i}"\naddress = "{a}"\n' for i, a in enumerate(addresses)))
    with Device(parse_cluster(data), model, height, width, log=lambda _: None) as dev:
        dev.setup(rows=False)
        made = plans(StagedPlanner(dev), [s["name"] for s in data["servers"]])
        reference, costs = dev.reference_model, dev.costs
    session = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    records = []
    for k, (kind, plan) in enumerate(made.items()):
        record = {"model": model, "kind": kind}
        if isinstance(plan, str):
            records.append(record | {"skipped": plan})
            continue
        saved, out = folder / f"plan-{k}.json", folder / f"out-{k}.npz"
        save_plan(str(saved), model, height, width, plan)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = cli_main(["run", "--cluster", str(cluster_file), "--model", model, "--input-size",
                             f"{height}x{width}", "--source", str(PHOTO), "--frames", "1", "--plan", str(saved),
                             "--quiet", "--save-outputs", str(out)])
        if code != 0:
            records.append(record | {"plan": plan.describe(), "failed": printed.getvalue().strip()[-300:]})
            continue
        got = np.load(out)
        want = dict(zip(names, session.run(None, {session.get_inputs()[0].name: got["inputs"].astype(np.float32)}),
                        strict=True))
        keys = {n: "outputs" if len(names) == 1 else f"outputs/{n}" for n in names}
        errors = {n: relative_error({n: got[keys[n]]}, {n: want[n]}) for n in names if keys[n] in got}
        records.append(record | {"plan": plan.describe(), "stages": len(plan.levels), "overlap": bool(plan.overlap),
                                 "split_share": split_shares(plan, costs)["plan"],
                                 "outputs": len(errors) == len(names), "errors": errors,
                                 "max_error": max(errors.values(), default=float("inf"))})
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-size", default="736x1280")
    parser.add_argument("--models", default="yolov8n,unet,ppocr,yolox")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    height, width = parse_size(args.input_size)
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as folder, server(1, 256) as a, server(1, 256) as b, server(1, 256) as c:
        addresses = [a, b, c][: args.servers]
        for name in args.models.split(","):
            path = model_path(name, Path(folder))
            for record in check(path, height, width, addresses, Path(folder)):
                record["model"] = name
                records.append(record)
                if "skipped" in record:
                    print(f"{name:8} {record['kind']:58} not made: {record['skipped']}", flush=True)
                elif "failed" in record:
                    print(f"{name:8} {record['kind']:58} FAILED: {record['failed']}", flush=True)
                else:
                    print(f"{name:8} {record['kind']:58} {record['stages']:2} stage(s)"
                          f"{' in parts' if record['overlap'] else ''}, split share "
                          f"{record['split_share']:6.1%}, max error {record['max_error']:.1e}"
                          f"{'' if record['outputs'] else ', OUTPUTS MISSING'}", flush=True)
    bad = [r for r in records
           if "failed" in r or "skipped" not in r and (r["max_error"] > TOLERANCE or not r["outputs"])]
    print(f"{len(records) - len(bad) - sum('skipped' in r for r in records)} plans exact within {TOLERANCE:g}, "
          f"{len(bad)} not, {sum('skipped' in r for r in records)} kinds not made; {height}x{width}")
    if args.json:
        Path(args.json).write_text(json.dumps({"input_size": [height, width], "records": records}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
