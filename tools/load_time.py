"""Time to get the DeepSeek-V3 kernel modules ready on the GPU in a fresh process.

Builds (or finds in the disk cache) the five modules the bench configurations use (dispatch BF16 /
BF16 expanded / FP8, combine non-expanded / expanded) and loads every kernel onto GPU 0. Run it twice:
the second run measures the warm disk cache (the target: under 0.2 s).

Usage: python tools/load_time.py
"""
import time

t_start = time.perf_counter()
import torch  # noqa: E402

from deep_ep.backends.gpu import modules  # noqa: E402

t_import = time.perf_counter()
STRUCTURES = [("dispatch", (14336, 0, 8, False)), ("dispatch", (14336, 0, 8, True)),
              ("dispatch", (7168, 56, 8, False)), ("combine", (7168, 8, False)), ("combine", (7168, 8, True))]
TRANSPORT_NCCL = True   # what an EP=1 buffer on a torch NCCL group builds


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)  # CUDA and the device's primary context ready (not counted below)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for kind, s in STRUCTURES:
        _, mod = modules.build_module(kind, s, TRANSPORT_NCCL)
        modules.load_module(mod, dev.index)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    print(f"import torch + deep_ep: {t_import - t_start:.2f} s; CUDA init and context: {t0 - t_import:.2f} s; "
          f"{len(STRUCTURES)} modules built or found and loaded on the GPU: {t1 - t0:.3f} s")


if __name__ == "__main__":
    main()
