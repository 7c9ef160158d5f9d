"""Run the all-gather / reduce-scatter primitives bench on emulated ranks and, if it stalls, say
where: every rank's AGRS header words (entered, configuration and call flags) read while the ranks'
streams still wait, first by a kernel into mapped host memory (no copy engine), then by a
copy-engine copy (each on a fresh stream, each given a few seconds). Which flags are up tells
whether a rank's stream stopped before its own writes, or its copies never finished with their
gates open; whether the copy-engine read finishes tells whether the copy engines still move.

Usage (GPU): python tools/diagnose_agrs_stall.py [--ranks 4] [--stall-secs 45] [--seed N] [-- bench arguments]
(e.g. ``-- --iters 5 --warmup 1`` for shorter runs).
Exit code 0: the bench finished; 3: it stalled (the report printed, the process then ends at once).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from deep_ep.backends.gpu import agrs as gpu_agrs  # noqa: E402
from deep_ep.backends.gpu.errors import MappedWords  # noqa: E402
from deep_ep.bench import primitives_gpu  # noqa: E402
from deep_ep.cuda.streams import new_stream, poll_event  # noqa: E402

_benches: list = []


def _register() -> None:
    original = primitives_gpu._AgrsBench.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _benches.append(self)
    primitives_gpu._AgrsBench.__init__ = init


def _rows(words: list, num_ranks: int) -> str:
    names = {gpu_agrs._ENTERED_ROW: "entered", gpu_agrs._CONFIG_ROW: "config bytes/32",
             gpu_agrs._CONFIG_ROW + 1: "config ops", gpu_agrs._FLAG_ROW: "call 1 flags",
             gpu_agrs._FLAG_ROW + 1: "call 2 flags"}
    return "; ".join(f"{name} {words[row * num_ranks:(row + 1) * num_ranks]}" for row, name in sorted(names.items()))


def _report() -> None:
    for bench in list(_benches):
        mover = getattr(bench.buffer, "_agrs_mover", None)
        if mover is None:
            print(f"rank {bench.rank}: no AGRS mover yet", flush=True)
            continue
        num_ranks = mover.num_ranks
        num_words = gpu_agrs._HEADER_ROWS * num_ranks
        header = mover._window_view(gpu_agrs.AGRS_OFFSET, 4 * num_words).view(torch.int32)
        mapped = MappedWords(mover.device, num_words)
        for i in range(num_words):
            mapped.words[i] = -7
        target = torch.as_tensor(gpu_agrs._WindowBytes(mapped.device_ptr, 4 * num_words), dtype=torch.uint8,
                                 device=mover.device).view(torch.int32)
        stream = new_stream(mover.device)
        with torch.cuda.stream(stream):
            torch.add(header, 0, out=target)      # a kernel: no copy engine
            done = torch.cuda.Event()
            done.record(stream)
        ok = poll_event(done, 5.0)
        print(f"rank {bench.rank}, kernel read {'finished' if ok else 'did NOT finish in 5 s'}: "
              f"{_rows(list(mapped.words), num_ranks)}", flush=True)
        pinned = torch.empty(num_words, dtype=torch.int32, pin_memory=True)
        stream = new_stream(mover.device)
        with torch.cuda.stream(stream):
            pinned.copy_(header, non_blocking=True)   # a copy engine
            done = torch.cuda.Event()
            done.record(stream)
        ok = poll_event(done, 5.0)
        print(f"rank {bench.rank}, copy-engine read {'finished' if ok else 'did NOT finish in 5 s'}"
              + (f": {_rows(pinned.tolist(), num_ranks)}" if ok else ""), flush=True)
        print(f"rank {bench.rank}: {len(mover.pending)} stream waits pending; host view of sessions: "
              f"{[(entry[2], entry[3], entry[4], entry[0].query()) for entry in mover.pending]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--stall-secs", type=float, default=45.0,
                        help="seconds after which the bench counts as stalled (a run takes about 25 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("bench_args", nargs="*", help="more arguments of the bench, after --")
    args = parser.parse_args()
    _register()
    from deep_ep.__main__ import main as deep_ep_main
    result: list = []
    worker = threading.Thread(target=lambda: result.append(deep_ep_main(
        ["bench", "--primitive", "agrs", "--virtual-ranks", str(args.ranks), "--seed", str(args.seed),
         *args.bench_args])), daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(args.stall_secs)
    if not worker.is_alive():
        print(f"bench finished in {time.monotonic() - start:.0f} s: {result}", flush=True)
        return 0
    print(f"STALL: the bench has not finished after {time.monotonic() - start:.0f} s", flush=True)
    _report()
    sys.stdout.flush()
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
