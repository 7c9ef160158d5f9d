#!/usr/bin/env bash
# DeepEP V2's own tests (tests/elastic/test_ep.py of deepseek-ai/DeepEP by default), unchanged, against
# this deep_ep, on one process: `<test> --num-processes 1 [arguments]`. The whole output goes to
# $OUT/deepep_<test name>.log; the exit status is the test's.
# Usage: bash tools/run_deepep_tests.sh [more test_ep.py arguments, e.g. --skip-perf-test --num-tokens 1024]
#   DEEPEP_DIR: a DeepEP checkout, or only its tests/ and deep_ep/utils/ (default: .deepep/ in the
#     repository root, which git ignores: name it in the device tool's carry). Made from a DeepEP git
#     directory with
#       mkdir -p .deepep && git -C <DeepEP git dir> archive HEAD tests deep_ep/utils | tar x -C .deepep
#   DEEPEP_IMPORT_ONLY=1: assemble the tree and import the test's modules, nothing more (no GPU needed).
#   DEEPEP_TEST: the test file, relative to DEEPEP_DIR (default tests/elastic/test_ep.py; also
#     tests/legacy/test_low_latency.py and tests/legacy/test_intranode.py, DeepEP's tests of its V1 Buffer).
#   DEEPEP_TIMEOUT: seconds the test may run (default 540).
# The test runs in a temporary tree, removed afterwards: a copy of this deep_ep package; DeepEP's
# deep_ep/utils/*.py under deep_ep/utils/ (but event.py: this package's own stays, its classes being
# the ones deep_ep returns), with an empty __init__.py where this package has none
# (DeepEP's imports its C extension's EventHandle, which the test does not use); and deep_ep/_C.py,
# a stand-in for that extension, which DeepEP's utils/envs.py and utils/comm.py import: the test
# calls none of its functions, so every name of it raises. Nothing of DeepEP's enters this repository.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEEPEP_DIR=${DEEPEP_DIR:-$ROOT/.deepep}
TEST=$DEEPEP_DIR/${DEEPEP_TEST:-tests/elastic/test_ep.py}
if [ ! -f "$TEST" ] || [ ! -d "$DEEPEP_DIR/deep_ep/utils" ]; then
  echo "no DeepEP ${DEEPEP_TEST:-tests/elastic/test_ep.py} and deep_ep/utils/ under $DEEPEP_DIR; make them with" >&2
  echo "  mkdir -p .deepep && git -C <DeepEP git dir> archive HEAD tests deep_ep/utils | tar x -C .deepep" >&2
  exit 2
fi
DEEPEP_DIR=$(cd "$DEEPEP_DIR" && pwd)
TEST=$DEEPEP_DIR/${DEEPEP_TEST:-tests/elastic/test_ep.py}
OUT=${OUT:-/tmp/deep_ep_out}; mkdir -p "$OUT"
LOG=$OUT/deepep_$(basename "$TEST" .py).log

TREE=$(mktemp -d "${TMPDIR:-/tmp}/deepep_tree.XXXXXX")
trap 'rm -rf "$TREE"' EXIT
tar -C "$ROOT" --exclude=__pycache__ -cf - deep_ep | tar -C "$TREE" -xf -
mkdir -p "$TREE/deep_ep/utils"
for f in "$DEEPEP_DIR"/deep_ep/utils/*.py; do
  name=$(basename "$f")
  [ "$name" = __init__.py ] && continue
  if [ "$name" = event.py ]; then
    continue   # this package's deep_ep.utils.event (the same classes as deep_ep's) stays
  fi
  if [ -e "$TREE/deep_ep/utils/$name" ]; then
    echo "deep_ep/utils/$name exists in this package and in DeepEP's: the tree would be ambiguous" >&2
    exit 2
  fi
  cp "$f" "$TREE/deep_ep/utils/$name"
done
[ -f "$TREE/deep_ep/utils/__init__.py" ] || : > "$TREE/deep_ep/utils/__init__.py"
cat > "$TREE/deep_ep/_C.py" <<'EOF'
"""Stand-in for DeepEP's C extension in the temporary tree of tools/run_deepep_tests.sh (never part of
deep_ep). DeepEP's deep_ep/utils/envs.py and comm.py import it; tests/elastic/test_ep.py calls none
of its functions, so every name raises."""


def __getattr__(name):
    raise AttributeError(f"deep_ep._C.{name}: DeepEP's C extension is not part of deep_ep, and the stand-in "
                         f"of tools/run_deepep_tests.sh provides none of it")
EOF

# The tree first: its deep_ep, not the repository's (or an installed one), is the one imported.
export PYTHONPATH=$TREE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cd "$TREE"
python3 - "$TREE" <<'EOF' 2>&1 | tee "$LOG" || exit 1
import os, sys
import deep_ep, deep_ep.utils.envs, deep_ep.utils.gate, deep_ep.utils.math, deep_ep.utils.refs, deep_ep.utils.testing
tree = os.path.realpath(sys.argv[1])
assert os.path.realpath(deep_ep.__file__).startswith(tree + os.sep), f"deep_ep imported from {deep_ep.__file__}"
print(f"deep_ep {deep_ep.__version__} from {os.path.dirname(deep_ep.__file__)}, DeepEP's utils imported")
EOF
if [ "${DEEPEP_IMPORT_ONLY:-0}" = 1 ]; then exit 0; fi

echo "=== python3 $TEST --num-processes 1 $*" | tee -a "$LOG"
timeout "${DEEPEP_TIMEOUT:-540}" python3 "$TEST" --num-processes 1 "$@" >> "$LOG" 2>&1
rc=$?
echo "exit status $rc; modes started: $(grep -c '> Testing with' "$LOG")" | tee -a "$LOG"
# The log's end without the per-mode lines (all of them are in the log).
grep -v '> Testing with' "$LOG" | tail -40
exit $rc
