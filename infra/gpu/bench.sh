#!/usr/bin/env bash
# The GPU machine's one command: `python -m jobs.bench gpu` on this checkout alone, with the machine's python3 as it
# is (nothing installed, no network, no data beside the checkout: Amazon Beauty from the package, random weights),
# cell by cell within a time budget, the report rewritten after every cell (docs/benchmarks.md, "The GPU call").
#
#   bash infra/gpu/bench.sh [--budget-s 480] [--out DIR] [--smoke] [--plan] [other `jobs.bench gpu` flags]
#
# Writes DIR/gpu.json, DIR/gpu.md and DIR/gpu-<device>-<date>.md (DIR: --out, else $OUT). --smoke: every cell at
# smoke sizes on the CPU (the rehearsal, tests/test_gpu_rehearsal.py). --plan: each cell's expected seconds on an H100.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-python3}
budget=480
out=${OUT:-}
plan=0
flags=()
while (($#)); do
  case $1 in
    --budget-s) budget=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --smoke) flags+=(--smoke --device cpu --layers 2 --hidden 64 --heads 4); shift ;;
    --plan) plan=1; shift ;;
    *) flags+=("$1"); shift ;;
  esac
done

missing=$("$py" -c '
import importlib.util
need = ("torch", "transformers", "numpy", "pyarrow", "pandas", "yaml", "tqdm", "tokenizers", "safetensors")
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
') || { echo "bench.sh: no working $py" >&2; exit 3; }
if [ -n "$missing" ]; then
  echo "bench.sh: $py lacks $missing (this script installs nothing)" >&2
  exit 3
fi

if ((plan)); then
  cd "$root"
  exec "$py" -m jobs.bench gpu --plan --engines eager compiled --budget-s "$budget" ${flags[@]+"${flags[@]}"}
fi
if [ -z "$out" ]; then
  echo "bench.sh: set OUT or pass --out DIR" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd) # a relative --out is the caller's, resolved before leaving for the checkout
cd "$root"

summary() {
  "$py" -c '
import collections, json, sys
cells = json.load(open(sys.argv[1]))["cells"]
counts = collections.Counter(c["status"].split(":")[0] for c in cells)
print(f"bench.sh: {len(cells)} cells:", ", ".join(f"{n} {s}" for s, n in counts.items()), "->", sys.argv[1])
' "$out/gpu.json" || true
}

work=$(mktemp -d "${TMPDIR:-/tmp}/bench-gpu.XXXXXX")
child=
trap 'rm -rf "$work"' EXIT # runs after the child has exited: the traps below wait for it
# SIGTERM / Ctrl-C: passed on to python, which records the cell it cuts and writes the report; then the scratch goes
stop() {
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null || true
    wait "$child" || true
    summary
  fi
  exit "$1"
}
trap 'stop 143' TERM
trap 'stop 130' INT
# a cold compile, timed as a fresh machine pays it, in this run's own caches; nothing fetched
export TORCHINDUCTOR_CACHE_DIR="$work/inductor" TRITON_CACHE_DIR="$work/triton" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$py" -m jobs.bench gpu --data "$work/beauty" --out "$out" --page "$out" --budget-s "$budget" \
  --engines eager compiled ${flags[@]+"${flags[@]}"} > "$work/stdout" &
child=$!
wait "$child"
child=
summary
