#!/usr/bin/env bash
# Check `deepco serve --device cuda` after CUDA_OPTIONS (no TF32) on a lent GPU machine, in two device calls:
#
#   bash bench/gpu_verify.sh prep     carry .gpu_carry/c1: unpack onnxruntime-gpu's CUDA provider, check the image
#   bash bench/gpu_verify.sh verify   carry .gpu_carry/c2: the rest of onnxruntime-gpu, the models, pytest wheels;
#                                     runs bench/gpu_check.py (env, ort_whole, serve) and tests/test_gpu_serve.py
#
# The second must follow the first on the same (warm) machine: the unpacked provider lives in /tmp/ortsite.
# .gpu_carry/ is ignored through .git/info/exclude (never committed); bench/results/gpu/REPORT.md says how its
# onnxruntime-gpu 1.30.0 wheel was pruned to sm_90 and split in two xz archives to fit the tool's 64 MiB per call.
# Without a GPU (or without the carried files) every step says so and the script still ends with status 0.
set -u
MODE=${1:-verify}
OUT=${OUT:-/tmp/gpu_verify_out}
mkdir -p "$OUT"
C=.gpu_carry
SITE=${ORT_SITE:-/tmp/ortsite}
PY=${PY:-python3}
mkdir -p "$SITE"
HERE=$(pwd)
say() { echo "[$(date +%T)] $*"; }

PYSITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LIBS="$PYSITE/nvidia/cu13/lib:$PYSITE/nvidia/cudnn/lib"
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

prep() {
    say "prep: unpack the CUDA provider into $SITE"
    if [ -f "$C/c1/part_cuda.tar.xz" ]; then
        time (xz -dc "$C/c1/part_cuda.tar.xz" | tar -x -C "$SITE") || say "unpack FAILED"
    else
        say "no $C/c1/part_cuda.tar.xz carried"
    fi
    say "environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || true
    $PY -c 'import sys; print("python", sys.version.split()[0], sys.executable)'
    for m in pytest xdist grpc google.protobuf cv2 matplotlib onnx onnxruntime torch prometheus_client; do
        $PY -c "import $m; print('$m', getattr($m, '__version__', 'ok'))" 2>&1 | tail -1
    done
    for d in $(echo "$LIBS" | tr : ' '); do [ -d "$d" ] && say "lib dir ok: $d" || say "lib dir MISSING: $d"; done
    so="$SITE/onnxruntime/capi/libonnxruntime_providers_cuda.so"
    if [ -f "$so" ]; then
        ls -la "$so"
        ldd "$so" | grep -E "not found|cudnn|cublas|cudart" || true
    fi
    df -h /tmp | tail -1
    say "prep done"
}

verify() {
    say "verify: unpack the rest of onnxruntime-gpu into $SITE"
    if [ -f "$C/c2/part_rest.tar.xz" ]; then
        xz -dc "$C/c2/part_rest.tar.xz" | tar -x -C "$SITE" || say "unpack FAILED"
    fi
    if [ -f "$C/c2/ort_so.sha256" ]; then
        (cd "$SITE" && sha256sum -c "$HERE/$C/c2/ort_so.sha256") ||
            say "onnxruntime-gpu files MISSING or changed (not the machine prep ran on?)"
    fi
    if PYTHONPATH="$SITE" $PY -c "import onnxruntime" 2>/dev/null; then
        export PYTHONPATH="$SITE:${PYTHONPATH:-}"
    else
        say "the carried onnxruntime-gpu does not import here: going on with the installed onnxruntime"
    fi
    export PYTHONUNBUFFERED=1
    $PY -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.__file__, o.get_available_providers())'

    say "gpu_check: env, ort_whole (cuda_serve = CUDA_OPTIONS, cuda_ort_default = before the fix), serve"
    DEEPCO_GPU_MODELS="$C/c2/models" timeout 200 $PY bench/gpu_check.py --out "$OUT" --parts env,ort_whole,serve \
        --cuda-configs cuda_serve,cuda_ort_default --budget 150 ${GPU_CHECK_EXTRA:-}
    say "gpu_check exit $?"

    say "pytest tests/test_gpu_serve.py"
    EXTRA=(-n 0)  # serially, so that -s shows the test's own line
    if ! $PY -c "import pytest, xdist" 2>/dev/null; then
        say "pytest or pytest-xdist missing: installing the carried pytest wheels, no xdist"
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pytest_site \
            "$C"/c2/pytest_wheels/*.whl
        export PYTHONPATH="/tmp/pytest_site:${PYTHONPATH:-}"
        EXTRA=(-o "addopts=-ra")
    fi
    # gpu_check made /tmp/deepco_gpu_site (grpcio-health-checking, ...) and /tmp/deepco_gpu_shim (deepco_server,
    # deepco_device, deepco_bench: the names pyproject.toml installs server/, device/, bench/deepco_bench under)
    export PYTHONPATH="/tmp/deepco_gpu_site:$PWD:/tmp/deepco_gpu_shim:${PYTHONPATH:-}"
    timeout 180 $PY -m pytest -q -p no:cacheprovider "${EXTRA[@]}" tests/test_gpu_serve.py -s -rA
    say "pytest exit $?"
}

case "$MODE" in
    prep) prep 2>&1 | tee -a "$OUT/prep.log" ;;
    verify) verify 2>&1 | tee -a "$OUT/verify.log" ;;
    *) echo "usage: bash bench/gpu_verify.sh prep|verify" >&2; exit 2 ;;
esac
exit 0
