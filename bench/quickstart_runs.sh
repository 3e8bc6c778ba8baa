#!/bin/bash
# The Quick start, N times in a row from fresh clones (issue 31's must-show), as root:
#   bench/quickstart_runs.sh [REPO] [N]        (REPO default: this checkout; N default 10)
# Each run: a fresh clone of REPO, this checkout's built .venv copied into it and the clone installed into that
# (`pip install --no-deps -e`: the full install takes minutes and is not what is timed), an empty model cache
# (XDG_CACHE_HOME), then `.venv/bin/deepco demo`, timed from the shell. One line per run; each run's output in
# $OUT (default /tmp/quickstart-runs).
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd); SRC=${1:-$HERE}; N=${2:-10}; OUT=${OUT:-/tmp/quickstart-runs}
mkdir -p "$OUT"
for i in $(seq 1 "$N"); do
  D=$(mktemp -d /tmp/quickstart-XXXX); git clone -q "$SRC" "$D/repo"; cp -a "$HERE/.venv" "$D/repo/.venv"
  (cd / && "$D/repo/.venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$D/repo" >/dev/null 2>&1)
  cd "$D/repo" || exit 1; s=$(date +%s.%N)
  XDG_CACHE_HOME="$D/cache" timeout 300 .venv/bin/deepco demo > "$OUT/run$i.log" 2>&1; rc=$?
  e=$(date +%s.%N)
  echo "run $i: rc=$rc seconds=$(echo "$e - $s" | bc) tracebacks=$(grep -c Traceback "$OUT/run$i.log")" \
       "png=$(ls ./*.png 2>/dev/null | head -1) | $(grep -m1 '^auto ' "$OUT/run$i.log" | cut -c1-110)" \
       "| $(grep -m1 'faster than offload' "$OUT/run$i.log")"
  cd /; rm -rf "$D"
done
