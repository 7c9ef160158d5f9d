#!/usr/bin/env bash
# Everything one H200 run needs: environment facts, the GPU test suite, the bench. Logs go to $OUT.
# Usage (device tool): bash tools/device_suite.sh [steps...]
#   steps: env jit gpu bench summary (default); extra (CUDA graphs, cached calls, stream semantics,
#          GPU reliability, EPLB, autograd operators, a caller's torch defaults, DeepEP's V1 Buffer,
#          the primitives, the emulated GIN, a gloo group with GPU tensors;
#          EXTRA_FILES="tests/gpu/a.py ..." runs only those);
#          compat (DeepEP V2's test of ElasticBuffer, all 144 modes: EP=1 on NCCL, 2, 4 and 8 emulated ranks;
#                  DEEP_EP_DEEPEP_MODES=k runs every k-th mode on emulated ranks);
#          compat-scaleout (the same test on emulated nodes 2x2, 2x4 and 4x2, direct and hybrid mode;
#                  every DEEP_EP_DEEPEP_MODES-th mode, all unless set (about 320 s); the emulated NIC's
#                  seed from the clock unless DEEP_EP_GIN_SEED is set, in the test ids);
#          deepep (DeepEP V2's own tests/elastic/test_ep.py, unchanged, one process: tools/run_deepep_tests.sh;
#                  needs .deepep/ carried to the device; DEEPEP_ARGS are passed on, e.g. "--skip-perf-test";
#                  DEEPEP_TEST=tests/legacy/test_low_latency.py (or test_intranode.py) runs DeepEP's V1 tests;
#                  $OUT/deepep_<test>.log);
#          primbench (python -m deep_ep bench --primitive for pp, agrs and engram: EP=1, 4 emulated ranks
#                     (PRIMBENCH_RANKS overrides the 4) and, with several GPUs, torchrun one rank per GPU;
#                     bench_primitives_<primitive>_<ep1|emuN|epN>.log/json, up to 12 files, packed at the
#                     end into $OUT/primbench.tgz, since the device tool returns 8 files);
#          multi (several GPUs, one process each under torchrun: tools/torchrun_suite.py (dispatch/combine
#                 cases, V1 Buffer both modes, barrier, PP, AGRS, Engram), the gloo-group file, the bench;
#                 MULTI_TIMEOUT for the suite, 540 s);
#          perf (the performance notes' runs: EP=1 BF16 / expanded / FP8 / decode, an SM sweep, emulated EP=8,
#                torchrun EP=2 and EP=4 with an SM sweep where there are GPUs; kernel profile; PERF_SWEEPS=0
#                leaves out the SM sweeps and the profile)
#          coop (plain launches instead of cooperative: GPU suite with DEEP_EP_COOPERATIVE=0, then tools/tune_gpu.py)
#          hostprof (tools/profile_gpu.py --host-profile: the host cost of each piece of a call, and a cProfile
#                    of each call kind at the decode size; $OUT/host_profile.log)
#          mutate (tools/mutation_check.py: kernels built with each test-only defect, planted in a copy of
#                  the headers (EP_JIT_INCLUDE_OVERLAY), must fail a GPU suite subset and the bench's check,
#                  the clean build must pass both; one line per defect)
#          summary (last: $OUT/summary.txt, the run's record: card, driver, torch, NCCL, commit, date,
#                   passed / failed per test file, bench checks, the mutation lines; see docs/device-runs/)
#          pack (every log and JSON under $OUT into one logs.tgz, summary.txt kept beside it: the device
#                tool returns 8 files)
# Every pytest step writes $OUT/<step>.log and JUnit XML $OUT/<step>.xml (read by summary); the GPU tests'
# failures also go to $OUT/failures.log as they happen.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export EP_JIT_CACHE_DIR=${EP_JIT_CACHE_DIR:-$PWD/.jitcache}
# Emulated ranks spin on each other: no lazy kernel loading, and a hardware queue per stream (deep_ep/emulated.py)
export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
OUT=${OUT:-/tmp/deep_ep_out}; mkdir -p "$OUT"
# every GPU test failure as it happens (tests/gpu/conftest.py), kept if a step's time runs out
export DEEP_EP_FAIL_LOG=${DEEP_EP_FAIL_LOG:-$OUT/failures.log}
# a test running past FAULT_SECS prints every thread's Python stack into its step's log: a hang
# cut short by the step's timeout still says where each rank's thread waited
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o faulthandler_timeout=${FAULT_SECS:-150}"
# GPUs this process can use (CUDA_VISIBLE_DEVICES honoured; nvidia-smi -L would count every physical GPU
# and MIG lines): one torchrun rank per GPU
num_gpus() { python3 -c "import torch; print(torch.cuda.device_count())"; }
steps=${*:-env jit gpu bench summary}
for step in $steps; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    env)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/env.txt"
      python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" 2>&1 | tee -a "$OUT/env.txt"
      python3 -m deep_ep env 2>&1 | tee -a "$OUT/env.txt"
      # The copy of .git on the device can lag the working tree: pass DEEP_EP_COMMIT=<hash> to record it.
      echo "commit ${DEEP_EP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) (device git)}" | tee -a "$OUT/env.txt" ;;
    jit)
      timeout 300 python3 -m pytest -q -x tests/gpu/test_jit_gpu.py -p no:cacheprovider --junitxml="$OUT/jit_gpu.xml" \
        2>&1 | tee "$OUT/jit_gpu.log" | tail -15 ;;
    gpu)
      export DEEP_EP_CASE_LOG=$OUT/gpu_cases.log
      timeout ${GPU_TIMEOUT:-420} python3 -m pytest -q tests/gpu/test_gpu_backend.py -p no:cacheprovider \
        --junitxml="$OUT/gpu_tests.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    extra)
      export DEEP_EP_CASE_LOG=$OUT/gpu_cases.log
      files=${EXTRA_FILES:-"tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_cached.py tests/gpu/test_gpu_streams.py
             tests/gpu/test_gpu_reliability.py tests/gpu/test_gpu_eplb.py tests/gpu/test_gpu_ops.py
             tests/gpu/test_gpu_defaults.py tests/gpu/test_gpu_rank_graphs.py
             tests/gpu/test_gpu_legacy.py tests/gpu/test_gpu_legacy_low_latency.py tests/gpu/test_gpu_legacy_modes.py
             tests/gpu/test_gpu_pp.py
             tests/gpu/test_gpu_agrs.py tests/gpu/test_gpu_engram.py tests/gpu/test_gpu_primitives_across_nodes.py
             tests/gpu/test_gpu_gin.py tests/gpu/test_gpu_barrier.py
             tests/gpu/test_gpu_gloo_group.py tests/gpu/test_gpu_scaleout_features.py"}
      timeout ${GPU_TIMEOUT:-420} python3 -m pytest -q $files -p no:cacheprovider --junitxml="$OUT/gpu_extra.xml" \
        ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_extra.log" | tail -30 ;;
    compat)
      timeout ${COMPAT_TIMEOUT:-300} python3 -m pytest -q tests/gpu/test_gpu_deepep_compat.py -k "not scaleout" \
        -p no:cacheprovider --junitxml="$OUT/gpu_compat.xml" 2>&1 | tee "$OUT/gpu_compat.log" | tail -30 ;;
    compat-scaleout)
      DEEP_EP_DEEPEP_MODES=${DEEP_EP_DEEPEP_MODES:-1} timeout ${COMPAT_TIMEOUT:-560} python3 -m pytest -q -rs \
        tests/gpu/test_gpu_deepep_compat.py -k scaleout -p no:cacheprovider --junitxml="$OUT/gpu_compat_scaleout.xml" \
        2>&1 | tee "$OUT/gpu_compat_scaleout.log" | tail -30 ;;
    deepep)
      DEEPEP_TIMEOUT=${DEEPEP_TIMEOUT:-540} bash tools/run_deepep_tests.sh ${DEEPEP_ARGS:-} ;;
    bench)
      timeout ${BENCH_TIMEOUT:-200} python3 -m deep_ep bench --iters 10 --json "$OUT/bench_ep1.json" 2>&1 | tee "$OUT/bench_ep1.log" | tail -20
      timeout ${BENCH_TIMEOUT:-200} python3 -m deep_ep bench --virtual-ranks 8 --iters 5 --json "$OUT/bench_ep8.json" 2>&1 | tee "$OUT/bench_ep8.log" | tail -20 ;;
    primbench)
      for prim in pp agrs engram; do
        for mode in ep1 "emu${PRIMBENCH_RANKS:-4}"; do
          ranks=""; [ "$mode" != ep1 ] && ranks="--virtual-ranks ${PRIMBENCH_RANKS:-4}"
          echo "--- bench_primitives_${prim}_$mode"
          timeout ${PRIMBENCH_TIMEOUT:-150} python3 -m deep_ep bench --primitive "$prim" $ranks \
            --json "$OUT/bench_primitives_${prim}_$mode.json" > "$OUT/bench_primitives_${prim}_$mode.log" 2>&1
          echo "exit $?"; grep -vE "^\s*$" "$OUT/bench_primitives_${prim}_$mode.log" | tail -16
        done
        n=$(num_gpus)
        if [ "$n" -ge 2 ]; then   # one rank per GPU: the bytes cross NVLink
          echo "--- bench_primitives_${prim}_ep$n"
          timeout ${PRIMBENCH_TIMEOUT:-150} torchrun --nproc-per-node "$n" -m deep_ep bench --primitive "$prim" \
            --json "$OUT/bench_primitives_${prim}_ep$n.json" > "$OUT/bench_primitives_${prim}_ep$n.log" 2>&1
          echo "exit $?"; grep -vE "^\s*$" "$OUT/bench_primitives_${prim}_ep$n.log" | tail -16
        fi
      done
      (cd "$OUT" && tar czf primbench.tgz bench_primitives_* && rm -f bench_primitives_*) \
        && echo "primbench: logs and JSON in $OUT/primbench.tgz" ;;
    multi)
      n=$(num_gpus)
      timeout ${MULTI_TIMEOUT:-540} torchrun --nproc-per-node "$n" tools/torchrun_suite.py 2>&1 | tee "$OUT/torchrun_suite.log" | grep -v "^  " | tail -30
      # a gloo group with GPU tensors on a private NCCL communicator, one process per GPU (vLLM's pattern);
      # no JUnit XML (every rank would write the one file): the summary reads the log's last count line
      timeout ${MULTI_GLOO_TIMEOUT:-300} torchrun --nproc-per-node "$n" -m pytest -q tests/gpu/test_gpu_gloo_group.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/multi_gloo.log" | tail -15
      timeout ${MULTI_BENCH_TIMEOUT:-180} torchrun --nproc-per-node "$n" -m deep_ep bench --iters 10 --json "$OUT/bench_ep$n.json" 2>&1 | tee "$OUT/bench_ep$n.log" | tail -20 ;;
    perf)
      n=$(num_gpus)
      summary() { grep -E "^(floor|rank 0|plain torch|slowest|check|warning|Traceback|[A-Za-z]+Error)" ; }
      pb() {  # name, then the command
        local name=$1; shift
        echo "--- $name"
        timeout ${BENCH_TIMEOUT:-200} "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        summary < "$OUT/$name.log"
      }
      pb bench_ep1 python3 -m deep_ep bench --iters 10
      pb bench_ep1_expand python3 -m deep_ep bench --iters 10 --expand
      pb bench_ep1_fp8 python3 -m deep_ep bench --iters 10 --fp8
      pb bench_ep1_decode python3 -m deep_ep bench --iters 20 --tokens 128
      pb bench_ep8_emulated python3 -m deep_ep bench --virtual-ranks 8 --iters 5
      pb bench_ep1_bias_eplb python3 -m deep_ep bench --iters 5 --bias 2 --eplb 32 --routing zipf
      if [ "${PERF_SWEEPS:-1}" = 1 ]; then
      echo "--- bench_ep1_sm_sweep"
      timeout 300 python3 -m deep_ep bench --iters 10 --sm-sweep 8,16,24,32,48,64,96,132 \
        --json "$OUT/bench_ep1_sm_sweep.json" > "$OUT/bench_ep1_sm_sweep.log" 2>&1
      grep -A10 "^SMs " "$OUT/bench_ep1_sm_sweep.log"
      echo "--- bench_ep1_decode_sm_sweep"
      timeout 200 python3 -m deep_ep bench --iters 20 --tokens 128 --sm-sweep 16,32,64,132 \
        --json "$OUT/bench_ep1_decode_sm_sweep.json" > "$OUT/bench_ep1_decode_sm_sweep.log" 2>&1
      grep -A6 "^SMs " "$OUT/bench_ep1_decode_sm_sweep.log"
      fi
      if [ "$n" -ge 2 ]; then pb bench_ep2 torchrun --nproc-per-node 2 -m deep_ep bench --iters 10; fi
      if [ "$n" -ge 4 ]; then
        pb bench_ep4 torchrun --nproc-per-node 4 -m deep_ep bench --iters 10
        echo "--- bench_ep4_sm_sweep"
        timeout 300 torchrun --nproc-per-node 4 -m deep_ep bench --iters 10 --sm-sweep 16,24,32,48,64 \
          --json "$OUT/bench_ep4_sm_sweep.json" > "$OUT/bench_ep4_sm_sweep.log" 2>&1
        grep -A8 "^SMs " "$OUT/bench_ep4_sm_sweep.log"
        pb bench_ep4_decode torchrun --nproc-per-node 4 -m deep_ep bench --iters 20 --tokens 128
      fi
      if [ "$n" -ge 2 ]; then pb bench_ep2_decode torchrun --nproc-per-node 2 -m deep_ep bench --iters 20 --tokens 128; fi
      if [ "${PERF_SWEEPS:-1}" = 1 ]; then
        timeout 150 python3 tools/profile_gpu.py --iters 50 > "$OUT/profile.log" 2>&1
        grep -E "=====.*(graph|device time|host cost)|^  deep_ep|^  [a-z].* [0-9.]+$" "$OUT/profile.log"
      fi ;;
    coop)  # plain launches of the data kernels (DEEP_EP_COOPERATIVE=0; cooperative is the default): the suite, then timed beside cooperative ones
      DEEP_EP_COOPERATIVE=0 DEEP_EP_CASE_LOG=$OUT/coop_cases.log timeout ${COOP_TIMEOUT:-200} python3 -m pytest -q -x \
        tests/gpu/test_gpu_backend.py tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_cached.py -p no:cacheprovider \
        --junitxml="$OUT/coop_tests.xml" 2>&1 | tee "$OUT/coop_tests.log" | tail -15
      timeout ${TUNE_TIMEOUT:-200} python3 tools/tune_gpu.py --iters 50 --variants ";COOPERATIVE=0;;COOPERATIVE=0" \
        2>&1 | tee "$OUT/coop_tune.log" | tail -15 ;;
    hostprof)
      timeout ${HOSTPROF_TIMEOUT:-200} python3 tools/profile_gpu.py --host-profile > "$OUT/host_profile.log" 2>&1
      grep -A30 "===== host cost" "$OUT/host_profile.log" ;;
    mutate)  # MUTATE_BUDGET seconds for all its runs (each prints its time); MUTATE_BENCH_ARGS e.g. "--tokens 1024"
      timeout $(( ${MUTATE_BUDGET:-480} + 60 )) python3 tools/mutation_check.py --out "$OUT/mutation" \
        --budget ${MUTATE_BUDGET:-480} --bench-args "${MUTATE_BENCH_ARGS:-}" 2>&1 | tee "$OUT/mutation.log" | grep -E "^(clean build|defect|mutation check|  all runs|Traceback)" ;;
    summary)
      python3 tools/mutation_check.py --write-summary "$OUT" ;;
    pack)
      tar czf /tmp/deep_ep_logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete \
        && mv /tmp/deep_ep_logs.tgz "$OUT/logs.tgz" ;;
    *) echo "unknown step $step" ;;
  esac
done
