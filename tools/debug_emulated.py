"""Run GPU test cases one at a time on emulated ranks, each in a fresh `EmulatedGroup`, and print,
for a failing case, every rank's traceback and the control words of every rank's window (signals
received from each peer, epoch, round, done-counter, error record) as they were at destroy().

Usage: python tools/debug_emulated.py NUM_RANKS [CASE_SUBSTRING ...]
Environment: DEEP_EP_TEST_GPU_TIMEOUT (seconds, default 20) for the kernels' timeout.
Exit code: the number of failed cases.
"""
import os
import sys
import traceback

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
import torch  # noqa: E402
from gpu_cases import cases_for  # noqa: E402
import test_gpu_backend as T  # noqa: E402
from deep_ep.backends.gpu import abi  # noqa: E402
from deep_ep.comm import emulated as tr  # noqa: E402
from deep_ep.emulated import EmulatedGroup  # noqa: E402

K_MAX_RANKS = abi.MAX_RANKS
snapshots: dict = {}
_destroy = tr.EmulatedTransport.destroy


def _snapshot_then_destroy(self):
    words = self.window_tensor()[: 4 * (K_MAX_RANKS + 8)].view(torch.int32).cpu().tolist()
    snapshots[self.rank] = {"arrive": words[: self.num_ranks], "epoch": words[K_MAX_RANKS],
                            "round": words[K_MAX_RANKS + 1], "done": words[K_MAX_RANKS + 2],
                            "error": words[K_MAX_RANKS + 4: K_MAX_RANKS + 8]}
    _destroy(self)


tr.EmulatedTransport.destroy = _snapshot_then_destroy

R = int(sys.argv[1])
wanted = sys.argv[2:]
dev = torch.device("cuda", 0)
failed = 0
for case in cases_for(R):
    if wanted and not any(w in case.name for w in wanted):
        continue
    snapshots.clear()
    print("case", case.name, flush=True)
    try:
        T.run_case(case, EmulatedGroup(R, device=dev).run, dev)
        print("  ok", flush=True)
    except BaseException:  # noqa: BLE001 - report and go on
        failed += 1
        traceback.print_exc()
        for r in sorted(snapshots):
            print(f"  rank {r}: {snapshots[r]}", flush=True)
sys.exit(failed)
