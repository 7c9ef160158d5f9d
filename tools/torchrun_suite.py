"""The GPU test matrix on real NCCL, one process per GPU. Run with torchrun:

    CUDA_MODULE_LOADING=EAGER PYTHONPATH=. torchrun --nproc-per-node 8 tools/torchrun_suite.py [CASE_SUBSTRING ...]

Every rank runs every case of tests/gpu_cases.py at the world size (the same cases the emulated
suite runs), computes all ranks' inputs and the reference from one seed, and checks its own
outputs element by element. Then the bodies of the GPU test files that run on emulated ranks, here
on the world group, so that what only several processes exercise runs too: DeepEP's V1 `Buffer` in
both modes (the direct low-latency kernels in one cooperative launch, receive hooks), the GPU
barrier, pipeline send/recv on copy engines and SMs between GPUs, all-gather / reduce-scatter
sessions by copy engines, Engram fetches from peers' device memory and from host shards shared
across processes.

Rank 0 prints one line per case and a last line of counts; the exit code is non-zero on a failure,
and when the substrings match no case. A case that runs past ``TORCHRUN_CASE_TIMEOUT`` seconds (300)
dumps every thread's stack and ends the process, so that a hang says where it is.
"""
import faulthandler
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


def _module_cases(world: int, dev: torch.device) -> list:
    """``(name, body(group), expected result or None)`` from the GPU test files' bodies."""
    import test_gpu_agrs as agrs
    import test_gpu_barrier as barrier
    import test_gpu_engram as engram
    import test_gpu_legacy as legacy
    import test_gpu_legacy_ll_direct as ll_direct
    import test_gpu_pp as pp
    from test_legacy_buffer import TOKENS
    for module in (agrs, barrier, engram, pp):
        module.DEVICE = dev   # the bodies' tensors go to this process's GPU
    sends = 24 * max(world, 2)   # per seed, over the ring (each rank's share of them varies)
    fetches = 3 * 2 * sum(2 if fmt[3] is not None else 1 for fmt in engram.FORMATS)
    cases = []
    if world in TOKENS:   # the V1 normal-mode cases' token counts
        cases.append(("v1-normal", lambda g: legacy._body(g, world), None))
    cases += [
        ("v1-low-latency", lambda g: ll_direct._body(g, world), None),
        ("barrier", barrier._body, None),
        ("pp-random-interleavings", lambda g: pp._stress_body(g, [11, 12], sends, 3, (0, 1, 2, 3)), None),
        ("pp-ring-copy-engine", lambda g: pp._ring_body(g, 3, 0), None),
        ("pp-ring-sms", lambda g: pp._ring_body(g, 3, 2), None),
        ("agrs-sessions", lambda g: agrs._sessions_body(g, 2), None),
        ("engram-device", lambda g: engram._fetch_body(g, "device"), fetches),
        ("engram-host", lambda g: engram._fetch_body(g, "host"), fetches),
    ]
    return cases


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    case_timeout = float(os.environ.get("TORCHRUN_CASE_TIMEOUT", "300"))
    wanted = sys.argv[1:]
    runs = [(case.name, lambda g, case=case: T.run_case(case, lambda body: {rank: body(g)}, dev), None)
            for case in cases_for(world)] + _module_cases(world, dev)
    runs = [run for run in runs if not wanted or any(w in run[0] for w in wanted)]
    failed = 0
    for name, body, expected in runs:
        status = "ok"
        faulthandler.dump_traceback_later(case_timeout, exit=True)
        try:
            result = body(dist.group.WORLD)
            if expected is not None and result != expected:
                status = f"FAIL on rank {rank}: result {result}, expected {expected}"
        except Exception as exc:  # noqa: BLE001 - reported, then the next case
            status = f"FAIL on rank {rank}: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        faulthandler.cancel_dump_traceback_later()
        flags = [None] * world
        dist.all_gather_object(flags, status)
        bad = [f for f in flags if f != "ok"]
        failed += bool(bad)
        if rank == 0:
            print(f"{name}: {'ok' if not bad else '; '.join(bad)}", flush=True)
    if rank == 0:
        print(f"torchrun suite, {world} ranks: {len(runs)} cases, {len(runs) - failed} ok, {failed} failed"
              + ("" if runs else f" (no case matches {wanted})"), flush=True)
    dist.destroy_process_group()
    return 1 if failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
