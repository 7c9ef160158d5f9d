"""Hybrid mode on emulated nodes, one stage at a time, each under a host deadline: the stage that does
not end is named with what every rank's kernels left behind.

One GPU acts as NODES x PER_NODE ranks (`deep_ep.emulated.EmulatedGroup`; hybrid mode, or direct mode
with ``--direct``) and runs a fresh dispatch with CPU sync, a combine, a cached dispatch and a second combine, each
checked against `deep_ep.reference` (combine in the hybrid order). Every rank's thread marks its
stage; the main thread watches. When a rank stays in a stage past ``--stage-secs`` (the kernels'
own timeout is ``--gpu-timeout``: by then every GPU wait should have given up), it prints for every
rank: its stage, whether its communication and NIC streams finished, run or faulted, the mapped
error record and counts report, and its window's control words (error record, epoch, round,
arrivals and done counters) and GIN state (done words, queues, signals), read on a stream of their
own; then it exits with code 3 (the stuck threads are left behind).

Usage (on the GPU machine, about a minute with the kernels to compile):
    python3 tools/diagnose_hybrid.py [--nodes 2] [--per-node 2] [--seed 1] [--contexts 2]
        [--gpu-timeout 4] [--stage-secs 30] [--direct]
Exit code: 0 every stage passed its check, 1 a check failed or a rank raised, 3 a stage did not end.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

STAGES = ("create", "dispatch: notify (waiting for the counts)", "dispatch: data kernel", "combine",
          "cached dispatch", "combine again", "barrier and destroy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1, help="the emulated NIC's seed")
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--gpu-timeout", type=float, default=4.0, help="the kernels' timeout (num_gpu_timeout_secs)")
    ap.add_argument("--stage-secs", type=float, default=30.0, help="host deadline of each stage")
    ap.add_argument("--direct", action="store_true", help="direct mode (allow_hybrid_mode=False) instead")
    args = ap.parse_args()
    if args.nodes < 2 or args.per_node < 1:
        ap.error("at least 2 nodes of at least 1 rank")

    import torch

    from deep_ep.comm.gin import EmulatedGinSettings
    from deep_ep.emulated import EmulatedGroup
    num_ranks = args.nodes * args.per_node
    # the group first: it sets CUDA's settings before anything initialises CUDA
    group = EmulatedGroup(num_ranks, device=torch.device("cuda", 0), num_nvlink_ranks=args.per_node,
                          gin_settings=EmulatedGinSettings(seed=args.seed, num_contexts=args.contexts))
    mode = "direct" if args.direct else "hybrid"
    print(f"{mode} mode, {args.nodes} nodes x {args.per_node} ranks, NIC seed {args.seed}, {args.contexts} contexts, "
          f"GPU timeout {args.gpu_timeout} s, stage deadline {args.stage_secs} s", flush=True)
    start = time.monotonic()
    _build(mode)
    print(f"kernels built in {time.monotonic() - start:.1f} s", flush=True)
    probe = _Probe(group.device, num_ranks)
    run = _Run(group, args, probe)
    runner = threading.Thread(target=run.go, name="diagnose-ranks", daemon=True)
    runner.start()
    while runner.is_alive():
        runner.join(0.2)
        late = run.late(args.stage_secs)
        if late:
            print(f"\n!!! stage deadline ({args.stage_secs} s) passed: " + "; ".join(late), flush=True)
            for rank in range(num_ranks):
                try:
                    print(probe.report(rank, run), flush=True)
                except Exception as exc:  # noqa: BLE001 - the other ranks' reports still help
                    print(f"--- rank {rank}: no report ({type(exc).__name__}: {exc})", flush=True)
            os._exit(3)
    if run.error is not None:
        print(f"\nFAILED: {run.error}", flush=True)
        return 1
    print(f"\nevery stage passed on every rank ({time.monotonic() - start:.1f} s)", flush=True)
    return 0


def _build(mode: str) -> None:
    """Compile the modules of this run before any stage's clock starts (loading stays collective)."""
    from deep_ep.backends.gpu import modules
    gin = 1 if mode == "direct" else 2
    for kind, structure in (("dispatch", (512, 0, 4, False)), ("combine", (256, 4, False)), ("gin_nic", ())):
        modules.build_module(kind, structure, False, gin)


class _Run:
    """The ranks' bodies and where each one is."""

    HIDDEN, TOPK, EXPERTS_PER_RANK, MAX_TOKENS = 256, 4, 4, 64

    def __init__(self, group, args, probe) -> None:
        import torch

        from deep_ep import reference as ref
        self.group, self.args, self.probe, self.error = group, args, probe, None
        num_ranks = group.num_ranks
        self.stage = [("(not started)", time.monotonic())] * num_ranks
        self.buffers = [None] * num_ranks
        g = torch.Generator().manual_seed(1000 + args.seed)
        experts = self.EXPERTS_PER_RANK * num_ranks
        tokens = [self.MAX_TOKENS - 17 * (r % 3) for r in range(num_ranks)]
        self.xs = [torch.randn(t, self.HIDDEN, generator=g).to(torch.bfloat16) for t in tokens]
        self.idxs = []
        for t in tokens:
            idx = torch.stack([torch.randperm(experts, generator=g)[:self.TOPK] for _ in range(t)])
            idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
            self.idxs.append(idx)
        self.ws = [torch.rand(t, self.TOPK, generator=g) for t in tokens]
        self.experts = experts
        self.expected = ref.reference_dispatch(self.xs, self.idxs, self.ws, experts, num_max_tokens_per_rank=self.MAX_TOKENS)
        self.ys = [torch.randn(e.handle.num_recv_rows, self.HIDDEN, generator=g).to(torch.bfloat16) for e in self.expected]
        scaleup = None if args.direct else group.num_nvlink_ranks
        self.expected_combine = ref.reference_combine(self.ys, [e.handle for e in self.expected],
                                                      num_scaleup_ranks=scaleup)

    def mark(self, rank: int, stage: str) -> None:
        self.stage[rank] = (stage, time.monotonic())
        print(f"  rank {rank}: {stage}", flush=True)

    def late(self, limit: float) -> list:
        now = time.monotonic()
        return [f"rank {r} in '{s}' for {now - t:.0f} s" for r, (s, t) in enumerate(self.stage)
                if s != "done" and not s.startswith("(") and now - t > limit]

    def go(self) -> None:
        try:
            self.group.run(self.body)
        except BaseException as exc:  # noqa: BLE001 - reported by main
            self.error = "".join(traceback.format_exception(exc))

    def body(self, rank_group) -> None:
        rank = rank_group.rank()
        try:
            self._stages(rank_group)
        except BaseException as exc:
            print(f"  rank {rank}: raised in '{self.stage[rank][0]}': {type(exc).__name__}: {exc}", flush=True)
            self.mark(rank, "(raised)")
            raise

    def _stages(self, rank_group) -> None:
        import deep_ep
        from deep_ep import reference as ref
        from deep_ep.emulated import wait_for_stream
        rank, args, dev = rank_group.rank(), self.args, self.group.device
        self.mark(rank, STAGES[0])
        buf = deep_ep.ElasticBuffer(rank_group, num_max_tokens_per_rank=self.MAX_TOKENS, hidden=self.HIDDEN,
                                    num_topk=self.TOPK, allow_hybrid_mode=not args.direct,
                                    num_gpu_timeout_secs=args.gpu_timeout, num_cpu_timeout_secs=args.stage_secs)
        self.buffers[rank] = buf
        backend = buf._backend
        transport = backend.transport
        transport.state.check_transport_args(transport.kernel_args(), transport.base.kernel_args(), rank)
        launch_data = backend.launch_data

        def marked_launch(prepared, num_sms):   # the counts came: the data kernel is next
            if self.stage[rank][0] == STAGES[1]:
                self.mark(rank, STAGES[2])
            launch_data(prepared, num_sms)

        backend.launch_data = marked_launch
        stream = buf.get_comm_stream()

        def finish(what: str) -> None:
            wait_for_stream(stream, args.stage_secs)
            backend.check_errors()   # a kernel's recorded timeout names rank, peer and phase
            print(f"  rank {rank}: {what} ended", flush=True)

        x, idx, w = (t.to(dev) for t in (self.xs[rank], self.idxs[rank], self.ws[rank]))
        self.mark(rank, STAGES[1])
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=self.experts,
                                                            num_max_tokens_per_rank=self.MAX_TOKENS)
        finish("dispatch")
        ref.check_dispatch((recv_x.cpu(), recv_idx.cpu(), recv_w.cpu(), handle), self.expected[rank],
                           check_handle=False, rank=rank)
        y = self.ys[rank].to(dev)
        for stage in (STAGES[3], STAGES[4], STAGES[5]):
            self.mark(rank, stage)
            if stage == STAGES[4]:
                out = buf.dispatch(x, handle=handle, topk_weights=w)
                finish(stage)
                ref.check_dispatch((out[0].cpu(), out[1].cpu(), out[2].cpu(), handle), self.expected[rank],
                                   check_handle=False, rank=rank)
            else:
                combined = buf.combine(y, handle)
                finish(stage)
                ref.check_combine((combined[0].cpu(), None), (self.expected_combine[rank][0], None), rank=rank)
        self.mark(rank, STAGES[6])
        buf.barrier()
        buf.destroy()
        self.mark(rank, "done")


class _Probe:
    """Reads what the ranks' kernels left behind without waiting for them: mapped host words, stream
    queries, and device words copied on a stream of its own into pinned memory allocated up front."""

    def __init__(self, device, num_ranks: int) -> None:
        import torch

        from deep_ep.cuda.streams import new_stream
        self.device, self.num_ranks = device, num_ranks
        self.side = new_stream(device)
        self.pinned = torch.empty(4 << 20, dtype=torch.uint8, pin_memory=True)

    def _copy(self, address: int, num_bytes: int):
        """``num_bytes`` of device memory at ``address`` as a pinned host tensor view, or an error string."""
        import torch

        from deep_ep.cuda.driver import driver, enter_context, error_name, leave_context
        from deep_ep.cuda.streams import poll_event
        num_bytes = min(num_bytes, self.pinned.numel())
        previous = enter_context(self.device.index)
        try:
            (err,) = driver().cuMemcpyDtoHAsync(self.pinned.data_ptr(), address, num_bytes, self.side.cuda_stream)
        finally:
            leave_context(previous)
        if int(err) != 0:
            return f"copy refused: {error_name(int(err))}"
        done = torch.cuda.Event()
        done.record(self.side)
        if not poll_event(done, 5.0):
            return "copy did not finish within 5 s"
        return self.pinned[:num_bytes].clone()

    def report(self, rank: int, run: _Run) -> str:
        import torch

        from deep_ep.backends.gpu.abi import CONSTANTS, PHASES, READBACK
        from deep_ep.comm.gin import QUEUE_BYTES
        from deep_ep.cuda.driver import error_name, stream_query
        lines = [f"--- rank {rank}: stage '{run.stage[rank][0]}'"]
        buf = run.buffers[rank]
        if buf is None or buf.is_destroyed:
            return lines[0] + (" (no buffer yet)" if buf is None else " (buffer destroyed)")
        backend, transport, num_ranks = buf._backend, buf._backend.transport, self.num_ranks
        for name, stream in (("communication", backend.comm_handle), ("NIC", getattr(transport._nic_stream, "cuda_stream", None))):
            if stream is not None:
                state = stream_query(stream, self.device.index)
                lines.append(f"  {name} stream: " + {0: "finished", 600: "running"}.get(state, f"FAULTED ({error_name(state)})"))
        err = tuple(backend.err_record.words)
        lines.append(f"  host error record (code, rank, peer, phase): {err}"
                     + (f" = {PHASES.get(err[3], err[3])}" if err[0] else ""))
        report = list(backend.readback.words[:READBACK["counts"]])
        lines.append(f"  counts report (seq, status, rank, peer, detail, value, out rows, token rows): {report}; "
                     f"expected seq {backend.call_record.readback_seq}")
        max_ranks = CONSTANTS["kMaxRanks"]
        ctrl = self._copy(transport.window_tensor().data_ptr(), 4 * (CONSTANTS["kCtrlTag"] + 4 * max_ranks + 2))
        if isinstance(ctrl, str):
            lines.append(f"  window: {ctrl}")
        else:
            words = ctrl.view(torch.int32).tolist()
            error = words[CONSTANTS["kCtrlError"]:CONSTANTS["kCtrlError"] + 4]
            lines.append(f"  window error record: {error}" + (f" = {PHASES.get(error[3], error[3])}" if error[0] else ""))
            lines.append(f"  window epoch {words[max_ranks]}, round {words[max_ranks + 1]}, done {words[max_ranks + 2]}, "
                         f"done-wait {words[max_ranks + 3]}, rail-done {words[-2]}, forward-done {words[-1]}")
            lines.append(f"  arrivals from each rank: {words[:num_ranks]}")
            tags = [(words[CONSTANTS['kCtrlTag'] + (slot * max_ranks + p) * 2]) for slot in (0, 1) for p in range(num_ranks)]
            lines.append(f"  tags' call numbers [parity 0 | parity 1]: {tags[:num_ranks]} | {tags[num_ranks:]}")
        gin = transport.state.gin
        done = self._copy(gin.done.data_ptr() + 8 * rank, 8)
        lines.append(f"  NIC done words (user blocks ended, NIC warps ended): "
                     f"{done if isinstance(done, str) else done.view(torch.int32).tolist()}")
        queues = self._copy(gin.queues.data_ptr(), gin.queues.numel() * 8)
        if not isinstance(queues, str):
            rows = queues.view(torch.int64).view(-1, QUEUE_BYTES // 8).tolist()
            for context in range(transport.state.num_contexts):
                for peer in range(num_ranks):
                    issued, consumed, freed, full = rows[(rank * gin.num_contexts + context) * num_ranks + peer]
                    if issued or full:
                        lines.append(f"  queue to rank {peer}, context {context}: issued {issued}, read {consumed}, "
                                     f"landed {freed}, full waits {full}")
        signals = self._copy(gin.signals.data_ptr() + rank * gin.num_contexts * gin.num_signals * 8,
                             transport.state.num_contexts * gin.num_signals * 8)
        if not isinstance(signals, str):
            values = signals.view(torch.int64).view(-1, gin.num_signals).tolist()
            lines.append(f"  GIN signals per context ([parity][source rank]): {values}")
        return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
