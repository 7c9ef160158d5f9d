"""GPU runner of ``python -m deep_ep bench``.

Ranks:
* started by ``torchrun`` (``WORLD_SIZE`` > 1): one rank per process/GPU, the real NCCL path; rank 0
  prints, with the NVLink floor (a peer-to-peer copy) and ``all_to_all_single`` measured in the run;
* ``--virtual-ranks N``: N emulated ranks on one GPU (`deep_ep.emulated`), one thread per rank;
* otherwise: EP=1 through a one-rank NCCL group (torch's communicator, symmetric window).

Per rank and pass (`deep_ep.bench.session.RankSession`): the first calls, checked; the timed loop
(each of full dispatch with / without CPU sync, cached dispatch and combine timed alone, with CUDA
events and with a device sync before and after); the loop's calls once more, poisoned and checked;
then, here, each call back to back (no sync between calls) and cached dispatch and combine replayed
from CUDA graphs, timed, then one replay with poisoned static outputs checked: per rank, 10 calls to
a graph (at EP=1 also the full dispatch without CPU sync, the serving decode step's call); with
emulated ranks, whose threads cannot capture at the same time, one graph of every rank's call,
captured by rank 0's thread (`deep_ep.bench.rank_graphs`). Measured in the same run: the floor (the
slower of a device copy with the operation's HBM traffic and a fill of the bytes it writes,
`deep_ep.bench.gpu_timing.floor_us`; every rank's bytes with emulated ranks) and, at EP=1, plain
torch's permute / un-permute.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional

import torch

from .. import envs
from .check import poison_in_place, reference_outputs
from .config import BenchConfig, Workload, floor_bytes
from .gpu_timing import (CudaClock, capture_calls, floor_us, nvlink_floor_and_all_to_all_us,
                         host_reference_us, single_rank_nccl_group, time_graph, torch_baselines_us)
from .progress import Progress
from .rank_graphs import run_rank_graphs
from .report import rank_row
from .session import CALLS, RankSession

__all__ = ["GpuSetup", "setup", "run_pass", "legacy_keys"]

GRAPH_CALLS = ("cached_dispatch", "combine")
#: Also captured when the bench runs one rank (EP=1): several ranks replaying fresh dispatches from
#: graphs have not been run yet.
GRAPH_CALLS_EP1 = GRAPH_CALLS + ("full_dispatch_no_cpu_sync",)
CALLS_PER_GRAPH = 10


@dataclasses.dataclass
class GpuSetup:
    """Where the GPU bench runs: ``num_ranks`` ranks, this process being ``rank`` (0 unless under
    torchrun), ``emulated`` ranks or not, ``runner`` / ``device`` as the report names them."""

    device: torch.device
    num_ranks: int
    rank: int
    emulated: bool
    multiprocess: bool
    runner: str
    device_name: str


def setup(args) -> GpuSetup:
    """Select the device, join torchrun's process group if there is one; nothing is measured yet.

    Raises:
        SystemExit: ``--virtual-ranks`` under torchrun.
    """
    import torch.distributed as dist
    world = int(envs.get("WORLD_SIZE"))
    multiprocess = world > 1
    if multiprocess:
        if args.virtual_ranks is not None:
            raise SystemExit("error: --virtual-ranks emulates ranks in one process; drop it under torchrun")
        torch.cuda.set_device(int(envs.get("LOCAL_RANK")))
    device = torch.device("cuda", torch.cuda.current_device())
    if multiprocess and not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    emulated = args.virtual_ranks is not None and args.virtual_ranks >= 1
    num_ranks = args.virtual_ranks if emulated else world
    props = torch.cuda.get_device_properties(device)
    runner = f"gpu/emulated x{num_ranks}" if emulated else f"gpu/nccl x{num_ranks}"
    return GpuSetup(device=device, num_ranks=num_ranks, rank=dist.get_rank() if multiprocess else 0,
                    emulated=emulated, multiprocess=multiprocess, runner=runner,
                    device_name=f"{props.name}, {props.multi_processor_count} SMs")


def _back_to_back(sess: RankSession, n: int) -> None:
    """Each call ``n`` times with no sync between calls: seconds per call until the host returned from
    the last one (``b2b_host_s``) and until the device finished (``b2b_s``)."""
    for name in CALLS:
        sess.clock.sync()
        sess.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            sess.call(name)
        t1 = time.perf_counter()
        sess.clock.sync()
        t2 = time.perf_counter()
        sess.extra[name].update(b2b_s=(t2 - t0) / n, b2b_host_s=(t1 - t0) / n)
    sess.progress.say(f"rank {sess.rank}: back-to-back calls done ({n} of each)")


def _graphs(sess: RankSession, iters: int, names=GRAPH_CALLS) -> None:
    """The calls ``names`` from CUDA graphs: device time per call, then the outputs of one replay
    (static outputs poisoned first) compared with the reference."""
    for name in names:
        captured = capture_calls(lambda: sess.call(name), CALLS_PER_GRAPH)
        if captured is None:
            continue
        graph, out = captured
        sess.extra[name]["graph_us"] = time_graph(graph, CALLS_PER_GRAPH, iters, sess.barrier)
        if sess.checker is not None:
            # Only the outputs each call allocates: a cached dispatch returns the handle's own
            # indices and weights again, which later calls read; a fresh one also writes its
            # handle's device words and its copy of the routing (not the caller's own tensor).
            if name == "full_dispatch_no_cpu_sync":
                handle = out[3]
                state = handle.backend_state   # None on the CPU backend (the tests' stand-in)
                own_topk = handle.topk_idx is not None and \
                    handle.topk_idx.data_ptr() != sess.mine["topk_idx"].data_ptr()   # the handle's copy
                poison_in_place(out[0], out[1], out[2], None if state is None else state.words,
                                handle.topk_idx if own_topk else None)
            else:
                poison_in_place(out[0], out[1] if name == "combine" else None)
            graph.replay()
            torch.cuda.synchronize()
            sess.check(name, out, "graph-replay")
        del graph, out, captured
    sess.progress.say(f"rank {sess.rank}: CUDA graphs timed" + (" and checked" if sess.checker else ""))


def legacy_keys(row: Dict[str, Any]) -> Dict[str, Any]:
    """Row keys of earlier bench versions (tools and recorded runs read them), from ``row["calls"]``."""
    c = row["calls"]
    return {"cached_dispatch_us": c["cached_dispatch"]["event_us"],
            "cached_dispatch_host_us": c["cached_dispatch"]["host_us"], "combine_host_us": c["combine"]["host_us"],
            "cached_dispatch_host_b2b_us": c["cached_dispatch"]["b2b_host_us"],
            "combine_host_b2b_us": c["combine"]["b2b_host_us"],
            "cached_dispatch_graph_us": c["cached_dispatch"]["graph_us"], "combine_graph_us": c["combine"]["graph_us"]}


def run_pass(cfg: BenchConfig, gs: GpuSetup, work: Workload, progress: Progress) -> Optional[Dict[str, Any]]:
    """One pass on every rank; returns ``{"name", "rows", "mismatches", "checked", "floors",
    "baselines", "gpu"}`` on rank 0, None on the other ranks of a torchrun job."""
    import torch.distributed as dist
    from .. import jit
    from ..backends import gpu as gpu_backend
    from ..buffer import ElasticBuffer

    run_cfg, device, R = work.run_cfg, gs.device, gs.num_ranks
    jit.reset_stats()
    mine = range(R) if gs.emulated else [gs.rank]
    if gs.multiprocess:
        from ..buffer import get_logical_domain_size
        if get_logical_domain_size(dist.group.WORLD)[1] < R:
            # the check's reference is one domain's: a hybrid combine sums in another order
            raise SystemExit(f"error: these {R} ranks span several NVLink domains; the plain bench checks one "
                             f"domain's results. Across nodes use --nvlink-ranks N (emulated nodes, "
                             f"--virtual-ranks) for the scale-out bench")
    inputs = [work.inputs(s, device) for s in range(R)]
    expected = reference_outputs(run_cfg, inputs, ranks=list(mine)) if cfg.check else None
    # Floors and baselines, in the same run: the slower of a device copy with the operation's HBM
    # traffic and a fill of the rows it writes (writes alone run slower than a copy's mix: the
    # expanded dispatch writes each token once per expert); emulated ranks share one GPU, so theirs
    # is every rank's traffic.
    nbytes = floor_bytes(run_cfg, [inputs[r]["topk_idx"] for r in mine], R)
    parts = {name: floor_us(moved, written, device) for name, (moved, written) in nbytes.items()}
    floors = {name: p["floor"] for name, p in parts.items()}
    floor_parts = {f"floor_{name}_{kind}_us": p[kind] for name, p in parts.items() for kind in ("copy", "write")}
    floor_parts.update({f"floor_{name}_{kind}_bytes": n for name, pair in nbytes.items()
                        for kind, n in zip(("moved", "written"), pair)})
    if device.type == "cuda":
        torch.cuda.empty_cache()   # the floors' buffers (GBs with emulated ranks), before the windows
    baselines = torch_baselines_us(run_cfg, inputs[0], device) if R == 1 else {}
    baselines.update(host_reference_us(device))
    if gs.multiprocess:
        baselines.update(nvlink_floor_and_all_to_all_us(run_cfg, inputs, gs.rank, device))
    del inputs
    progress.say("reference, floor and baselines ready" if cfg.check else "floor and baselines ready")

    results: List[Optional[Dict[str, Any]]] = [None] * R
    silent = Progress(progress.tag, enabled=False)
    sessions: List[Optional[RankSession]] = [None] * R
    rank_graphs: Dict[str, Any] = {}
    emulated_group = None

    def body(rank: int, group, barrier) -> None:
        buf = ElasticBuffer(group, num_max_tokens_per_rank=cfg.max_tokens, hidden=cfg.hidden,
                            num_topk=cfg.top_k, use_fp8_dispatch=cfg.fp8, explicitly_destroy=True)
        try:
            sess = RankSession(work, rank, buf, device, barrier, CudaClock(), progress if rank == 0 else silent,
                               expected[rank] if expected is not None else None)
            sess.first_calls()
            sess.timed_loop()
            sess.checked_iteration()
            _back_to_back(sess, max(20, cfg.iters))
            if not gs.emulated:
                _graphs(sess, max(50, cfg.iters), GRAPH_CALLS_EP1 if R == 1 else GRAPH_CALLS)
            else:
                # Rank 0's thread captures every rank's call while the others wait here, idle.
                sessions[rank] = sess
                barrier()
                if rank == 0:
                    rank_graphs.update(run_rank_graphs(emulated_group, sessions, floors, max(20, cfg.iters),
                                                       progress))
                barrier()
            res = sess.result()
            res["num_sms"] = cfg.num_sms or buf.get_theoretical_num_sms(run_cfg.num_experts, cfg.top_k)
            results[rank] = res
            barrier()
        finally:
            buf.destroy()

    if gs.emulated:
        from .. import emulated
        emulated_group = emulated.EmulatedGroup(R, device=device)
        emulated_group.run(lambda g: body(g.rank(), g, g.barrier))
    else:
        group = single_rank_nccl_group(device)  # torchrun already made the job's group
        body(gs.rank, group, (lambda: dist.barrier()) if gs.multiprocess else (lambda: None))
        if gs.multiprocess:  # every rank's result to rank 0
            gathered = [None] * R if gs.rank == 0 else None
            dist.gather_object(results[gs.rank], gathered, dst=0)
            if gs.rank != 0:
                return None
            results = gathered

    rows = []
    for res in results:
        row = rank_row(run_cfg, res, floors, extra={"combine_floor_us": floors["combine"], "num_sms": res["num_sms"]})
        row.update(legacy_keys(row))
        rows.append(row)
    st = jit.stats()
    return {"name": work.name, "rows": rows, "mismatches": [m for r in results for m in r["mismatches"]],
            "checked": results[0]["checked"], "floors": floors, "baselines": baselines,
            "gpu": {"floor_dispatch_us": floors["dispatch"], "floor_combine_us": floors["combine"], **floor_parts,
                    **baselines, **({"rank_graphs": rank_graphs} if rank_graphs else {}),
                    "kernel_modules": gpu_backend.num_modules_built(), "jit": st}}
