#!/usr/bin/env bash
# Old tree vs this tree on one GPU, in one run: outputs bit for bit (tools/compare_outputs.py) and the
# bench's numbers, alternating old / new so that drift of the card shows as spread, not as a gain.
# Usage: OLD=<path of an old checkout> bash tools/side_by_side.sh [rounds]   (logs under $OUT)
#   SKIP_OUTPUTS=1 leaves out the output comparison (benches only); BENCH_ARGS are passed to each bench;
#   PIN_CPU=<cpu list> runs every bench under taskset on those CPUs (the same ones for both trees).
# Make the old tree from a commit, inside the repository so that it travels to a GPU machine (an
# ignored folder, e.g. listed in .git/info/exclude, named in the device tool's carry), and record the commit:
#   rm -rf .trees/old && mkdir -p .trees/old && git archive <commit> | tar x -C .trees/old && echo <commit> > .trees/old/COMMIT
set -u -o pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
OLD=${OLD:?set OLD to the old tree}
ROUNDS=${1:-2}
OUT=${OUT:-/tmp/deep_ep_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
export EP_JIT_CACHE_DIR=${EP_JIT_CACHE_DIR:-$NEW/.jitcache}
echo "=== old tree: commit $(cat "$OLD/COMMIT" 2>/dev/null || echo unknown)"
if [ "${SKIP_OUTPUTS:-0}" = 0 ]; then
  echo "=== outputs $(date -u +%H:%M:%S)"
  # The dumps stay outside $OUT: at the bench's shapes they are larger than what comes back from a device.
  DUMPS=${DUMPS:-/tmp/deep_ep_side_by_side}; mkdir -p "$DUMPS"
  (cd "$OLD" && PYTHONPATH=$OLD timeout 300 python3 "$NEW/tools/compare_outputs.py" dump "$DUMPS/outputs_old.pt") 2>&1 | tail -3
  PYTHONPATH=$NEW timeout 300 python3 tools/compare_outputs.py dump "$DUMPS/outputs_new.pt" 2>&1 | tail -3
  PYTHONPATH=$NEW python3 tools/compare_outputs.py compare "$DUMPS/outputs_old.pt" "$DUMPS/outputs_new.pt" 2>&1 | tail -12
fi
for r in $(seq 1 "$ROUNDS"); do
  for tree in old new; do
    dir=$OLD; [ "$tree" = new ] && dir=$NEW
    echo "=== bench $tree round $r $(date -u +%H:%M:%S)"
    pin=""; [ -n "${PIN_CPU:-}" ] && pin="taskset -c $PIN_CPU"
    (cd "$dir" && PYTHONPATH=$dir timeout 200 $pin python3 -m deep_ep bench --iters 10 ${BENCH_ARGS:-}) \
      > "$OUT/bench_${tree}_$r.log" 2>&1
    grep -E "^(floor|rank 0|call |full dispatch|cached dispatch|combine |plain torch|host reference|check|Traceback|[A-Za-z]+Error)" \
      "$OUT/bench_${tree}_$r.log"
  done
done
