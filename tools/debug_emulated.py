"""Run GPU test cases one at a time on emulated ranks, stopping at the first failure with every
rank's traceback. Usage: python tools/debug_emulated.py NUM_RANKS CASE_SUBSTRING [...]"""
import os
import sys
import traceback

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
import torch  # noqa: E402
from gpu_cases import cases_for  # noqa: E402
import test_gpu_backend as T  # noqa: E402
from deep_ep.emulated import EmulatedGroup  # noqa: E402

R = int(sys.argv[1])
wanted = sys.argv[2:]
dev = torch.device("cuda", 0)
group = EmulatedGroup(R, device=dev)
for case in cases_for(R):
    if wanted and not any(w in case.name for w in wanted):
        continue
    print("case", case.name, flush=True)
    try:
        T.run_case(case, group.run, dev)
        print("  ok", flush=True)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
