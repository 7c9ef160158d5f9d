"""The GPU test matrix on real NCCL, one process per GPU. Run with torchrun:

    CUDA_MODULE_LOADING=EAGER PYTHONPATH=. torchrun --nproc-per-node 8 tools/torchrun_suite.py [CASE_SUBSTRING ...]

Every rank runs every case of tests/gpu_cases.py at the world size (the same cases the emulated
suite runs), computes all ranks' inputs and the reference from one seed, and checks its own
outputs element by element. Rank 0 prints one line per case; the exit code is non-zero on a failure.
"""
import os
import sys
import traceback

import torch
import torch.distributed as dist

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests"))
sys.path.insert(0, os.path.join(here, "..", "tests", "gpu"))
from gpu_cases import cases_for  # noqa: E402
import test_gpu_backend as T  # noqa: E402


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    wanted = sys.argv[1:]
    failed = 0
    for case in cases_for(world):
        if wanted and not any(w in case.name for w in wanted):
            continue
        status = "ok"
        try:
            T.run_case(case, lambda body: {rank: body(dist.group.WORLD)}, dev)
        except Exception as exc:  # noqa: BLE001 - reported, then the next case
            status = f"FAIL on rank {rank}: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        flags = [None] * world
        dist.all_gather_object(flags, status)
        bad = [f for f in flags if f != "ok"]
        failed += bool(bad)
        if rank == 0:
            print(f"{case.name}: {'ok' if not bad else '; '.join(bad)}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
