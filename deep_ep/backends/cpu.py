"""CPU backend: dispatch and combine over a gloo group through ``torch.distributed`` collectives.

This is the executable specification run distributed: its outputs are bit-identical to
`deep_ep.reference` (same row order, same float32 summation order, see that module's docstring).

Protocol of one dispatch on rank ``r`` (all collectives on ``group``):

1. *Header* (``all_gather``, int64 ``[F + 2R]``): the call's configuration (op, E, H, K, x format, layout
   flags, M), this rank's token count and how many tokens it sends to every rank. Every rank checks
   that all ranks agree and that every receive fits; any violation raises the same `RuntimeError` on
   every rank, before data moves (no hang, nothing written past an allocation).
2. Expanded mode only: ``all_gather`` of int64 ``[E]`` pair counts per expert, from which every source
   computes where its pairs land (``send_pos``) without asking the destination.
3. *Rows* (two ``all_to_all_single``): each token travels once to every rank holding one of its
   experts, ordered by (destination, token): first the packed uint8 metadata
   ``scale factors | topk_idx | topk_weights | source token``, then the data rows alone (viewed as
   int64 words, received in place for non-expanded outputs). The destination lays rows out
   (expanding them in expanded mode) exactly as the reference does.

Combine sends every valid received row back to its source (header first, with the row counts both
sides expect; then the bf16 rows and, when needed, the weights) and reduces in the reference's order.

Timeouts and failures: every collective (each *phase* of a call) is issued with the buffer's
``num_cpu_timeout_secs`` as its own timeout (gloo honours a per-operation timeout), independent of
the process group's. On entry to each call a rank also writes "I am in call #n of this buffer" into
the group's store (one small ``set``, no wait). When a phase fails (timeout, or a peer that crashed),
the rank reads those stamps to find which peer never reached the call and raises
``TimeoutError("deep_ep CPU timeout on rank r: peer rank p did not arrive within T s in phase ...")``
(or a `RuntimeError` naming the phase, when every peer arrived and the connection failed). Gloo
closes its connections after a timeout, so the buffer is then unusable: every later call raises a
`RuntimeError` saying so; destroy the buffer and the process group (both return promptly).
The stamps assume SPMD buffer creation: ranks create the buffers of one group in the same order.
"""
from __future__ import annotations

import datetime
import itertools
from typing import Optional

import torch
import torch.distributed as dist

from ..handle import EPHandle
from ..reference import align_up, alloc_recv_sf, as_bits, as_rows, worst_case_recv_rows
from . import outputs
from .base import Backend, BufferConfig

__all__ = ["CPUBackend"]

# Header fields (int64). The ones in _AGREE must be equal on every rank.
_OP, _E, _H, _K, _XKIND, _NSF, _EXPAND, _ALIGN, _M, _SYNC, _HASW, _T = range(12)
_F = 12
_AGREE = {_OP: "operation", _E: "num_experts", _H: "hidden", _K: "num_topk",
          _XKIND: "x format (0 bf16, 1 FP8 + float32 sf, 2 FP8 + packed UE8M0 sf)",
          _NSF: "number of scale factors", _EXPAND: "do_expand", _ALIGN: "expert_alignment",
          _SYNC: "do_cpu_sync", _HASW: "weights given"}
_OP_DISPATCH, _OP_COMBINE = 1, 2

#: Buffers created so far per process group (by group name): the n-th buffer of a group has the same
#: number on every rank, which names its arrival stamps in the group's store.
_buffers_per_group: dict = {}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A ``[rows, n]`` tensor viewed as ``[rows, n * itemsize]`` uint8 (no copy when it is dense)."""
    t = t.contiguous()
    if t.dim() and t.stride(-1) != 1:
        # An empty tensor counts as contiguous whatever its strides (``torch.rand(0, 1) + 0.5`` has
        # strides (1, 0)), but a dtype-changing view needs a unit last stride: make a dense copy.
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def _typed(b: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """uint8 ``[rows, width * itemsize]`` columns → ``[rows, width]`` of ``dtype``."""
    # A fresh copy: `contiguous()` may return a strided view for 0 or 1 rows, which `view` rejects.
    return b.clone(memory_format=torch.contiguous_format).view(dtype).reshape(b.shape[0], width)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """`as_rows` limited to the integer types gloo sends (int64, int32, else uint8)."""
    return as_rows(t, (torch.int64, torch.int32))


def _pack(parts: list, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of each uint8 ``[n, w]`` part, side by side: ``[len(rows), sum w]`` uint8."""
    width = sum(w for _, w in parts)
    buf = torch.empty((rows.numel(), width), dtype=torch.uint8)
    col = 0
    for b, w in parts:
        buf[:, col:col + w] = b.index_select(0, rows)
        col += w
    return buf


class CPUBackend(Backend):
    """Dispatch/combine of CPU tensors over a gloo (or any CPU-capable) process group."""

    def __init__(self, group, config: BufferConfig) -> None:
        super().__init__(group, config)
        self.rank = config.rank
        self.num_ranks = config.num_ranks
        self._timeout = datetime.timedelta(seconds=config.num_cpu_timeout_secs)
        self._calls = 0              # calls (dispatch / combine / barrier) entered on this rank
        self._op = ""                # the current (or last) call
        self._broken: Optional[str] = None   # the failure that made the group unusable
        name = str(getattr(group, "group_name", "") or id(group))
        counter = _buffers_per_group.setdefault(name, itertools.count())
        self._stamp_prefix = f"deep_ep/cpu/group{name}/buffer{next(counter)}/rank"
        self._use_store = True       # False once the store failed (it only serves diagnostics)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # ------------------------------------------------------------------ helpers
    def _error(self, msg: str) -> RuntimeError:
        return RuntimeError(f"deep_ep (CPU backend, rank {self.rank} of {self.num_ranks}): {msg}")

    # --- bounded collectives: every phase waits at most num_cpu_timeout_secs
    def _begin(self, op: str) -> None:
        """Start call ``op``: refuse if an earlier failure broke the group, stamp the arrival."""
        if self._broken is not None:
            raise self._error(f"this buffer can no longer communicate after an earlier failure "
                              f"({self._broken}); destroy it and the process group, and start again")
        self._calls += 1
        self._op = op
        store = self._store()
        if store is not None:
            try:
                store.set(self._stamp_prefix + str(self.rank), f"{self._calls} {op}")
            except Exception:  # the store is only used to name a missing peer
                self._use_store = False

    def _store(self):
        """The group's key-value store, looked up on each use and never kept: a reference held past
        the process group's destruction keeps the store client (and its threads) alive until
        interpreter teardown, where it can abort the process."""
        if not self._use_store:
            return None
        try:
            return self.group.get_group_store()
        except Exception:  # an older torch, a group without a store, or a destroyed group
            self._use_store = False
            return None

    def _peer_stamps(self) -> dict:
        """``{peer: (calls entered, last op)}`` from the store; peers without a stamp map to (0, '')."""
        out = {}
        store = self._store()
        for p in range(self.num_ranks):
            if p == self.rank or store is None:
                continue
            key = self._stamp_prefix + str(p)
            try:
                value = store.get(key).decode() if store.check([key]) else "0 "
                n, op = value.split(" ", 1)
                out[p] = (int(n), op)
            except Exception:
                return {}
        return out

    def _failed(self, phase: str, exc: Exception) -> Exception:
        """The error to raise when collective ``phase`` of the current call failed with ``exc``."""
        T = self.config.num_cpu_timeout_secs
        where = f"{self._op} (call #{self._calls} of this buffer on this rank), phase {phase}"
        stamps = self._peer_stamps()
        missing = sorted(p for p, (n, _) in stamps.items() if n < self._calls)
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        if missing:
            seen = ", ".join(f"rank {p} last entered call #{stamps[p][0]}" +
                             (f" ({stamps[p][1]})" if stamps[p][1] else "") for p in missing)
            msg = (f"deep_ep CPU timeout on rank {self.rank}: peer rank{'s' if len(missing) > 1 else ''} "
                   f"{', '.join(map(str, missing))} did not arrive within {T} s in {where} ({seen}). "
                   f"A rank skipped or failed a call: check its log; this buffer and its process group "
                   f"cannot be used any more (destroy them)")
            err: Exception = TimeoutError(msg)
        elif timed_out:
            who = ("every peer had entered the call, so one stopped or failed inside it" if stamps else
                   "a peer did not arrive or stopped inside the call (no store to tell which)")
            msg = (f"deep_ep CPU timeout on rank {self.rank}: {where} did not complete within {T} s; "
                   f"{who}. This buffer "
                   f"and its process group cannot be used any more (destroy them). gloo: {exc}")
            err = TimeoutError(msg)
        else:
            msg = (f"communication failed in {where}: {exc}. A peer may have crashed: check the other "
                   f"ranks' logs; this buffer and its process group cannot be used any more (destroy them)")
            err = self._error(msg)
        self._broken = f"{type(err).__name__} in {where}"
        return err

    def _wait(self, phase: str, work) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self._failed(phase, exc) from exc

    def _all_to_all(self, phase: str, out: torch.Tensor, inp: torch.Tensor, out_splits: list,
                    in_splits: list) -> None:
        """``all_to_all_single`` bounded by ``num_cpu_timeout_secs`` (``out_splits``: rows received
        from each rank, ``in_splits``: rows sent to each rank)."""
        opts = dist.AllToAllOptions()
        opts.timeout = self._timeout
        try:
            work = self.group.alltoall_base(out, inp, out_splits, in_splits, opts)
        except Exception as exc:
            raise self._failed(phase, exc) from exc
        self._wait(phase, work)

    def _all_gather(self, t: torch.Tensor, phase: str) -> torch.Tensor:
        """``[R, *t.shape]``: every rank's ``t`` (an all-to-all of ``R`` copies, so that it takes the
        public per-operation timeout option)."""
        R = self.num_ranks
        flat = t.reshape(1, -1)
        out = torch.empty((R, flat.shape[1]), dtype=t.dtype)
        self._all_to_all(phase, out, flat.expand(R, -1).contiguous(), [1] * R, [1] * R)
        return out.view(R, *t.shape)

    def _exchange_header(self, fields: list, send_counts: torch.Tensor,
                         expect_counts: Optional[torch.Tensor]) -> torch.Tensor:
        R = self.num_ranks
        header = torch.zeros(_F + 2 * R, dtype=torch.int64)
        header[:_F] = torch.tensor(fields, dtype=torch.int64)
        header[_F:_F + R] = send_counts
        if expect_counts is not None:
            header[_F + R:] = expect_counts
        headers = self._all_gather(header, "header exchange")   # [R, F + 2R], same on every rank
        for i, name in _AGREE.items():
            col = headers[:, i]
            if (col != col[0]).any():
                if i == _OP:
                    ops = ["dispatch" if v == _OP_DISPATCH else "combine" for v in col.tolist()]
                    raise self._error(f"ranks called different operations: {ops}")
                raise self._error(f"ranks disagree on {name}: per-rank values {col.tolist()}")
        return headers

    def barrier(self) -> None:
        self._begin("barrier")
        opts = dist.BarrierOptions()
        opts.timeout = self._timeout
        try:
            work = self.group.barrier(opts)
        except Exception as exc:
            raise self._failed("barrier", exc) from exc
        self._wait("barrier", work)

    def destroy(self) -> None:
        """Drop the process group: a destroyed buffer must not keep the group (and its gloo threads)
        alive past ``destroy_process_group``, into interpreter teardown, where their destruction can
        abort the process. (The buffer refuses every later call.)"""
        self.group = None

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, data, sf, topk_idx, topk_weights, *, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, handle, do_handle_copy, do_cpu_sync, do_expand,
                 do_zero_padding, use_tma_aligned_col_major_sf, cumulative_local_expert_recv_stats):
        self._begin("dispatch")
        R, r = self.num_ranks, self.rank
        cached = handle is not None
        if cached:
            topk_idx = handle.topk_idx
        E, A, M = num_experts, expert_alignment, num_max_tokens_per_rank
        L = E // R
        T, H = int(data.shape[0]), int(data.shape[1])
        K = int(topk_idx.shape[1])
        has_w = topk_weights is not None
        xkind = 0 if sf is None else (1 if sf.dtype == torch.float32 else 2)
        num_sf = 0 if sf is None else int(sf.shape[1])

        # --- routing on the source side
        owner = torch.where(topk_idx >= 0, torch.div(topk_idx, L, rounding_mode="floor"),
                            torch.full_like(topk_idx, -1))
        hit = torch.stack([(owner == d).any(1) for d in range(R)], 1) if T > 0 else \
            torch.zeros((0, R), dtype=torch.bool)                 # [T, R]: token t goes to rank d
        send_counts = hit.sum(0).to(torch.int64)

        fields = [0] * _F
        fields[_OP], fields[_E], fields[_H], fields[_K] = _OP_DISPATCH, E, H, K
        fields[_XKIND], fields[_NSF], fields[_EXPAND], fields[_ALIGN] = xkind, num_sf, int(do_expand), A
        fields[_M], fields[_SYNC], fields[_HASW], fields[_T] = M, int(do_cpu_sync), int(has_w), T
        headers = self._exchange_header(fields, send_counts, None)
        counts = headers[:, _F:_F + R]                            # counts[s, d]: tokens s -> d
        if not do_cpu_sync:
            ms = headers[:, _M]
            if (ms != ms[0]).any():
                raise self._error(f"ranks disagree on num_max_tokens_per_rank (needed to size "
                                  f"do_cpu_sync=False outputs): per-rank values {ms.tolist()}")
            over = (headers[:, _T] > M).nonzero().flatten().tolist()
            if over:
                raise self._error(f"rank(s) {over} dispatch {headers[over, _T].tolist()} tokens, more "
                                  f"than num_max_tokens_per_rank={M}: outputs sized for the worst "
                                  f"case could not hold them")
        recv_counts = counts[:, r]                                # tokens s -> r

        pair_counts = None
        if do_expand:
            valid = topk_idx[topk_idx >= 0]
            my_pairs = torch.bincount(valid, minlength=E).to(torch.int64)
            pair_counts = self._all_gather(my_pairs, "expert counts")   # [R sources, E]
            if not do_cpu_sync:
                # Every rank checks every destination (same numbers everywhere, so all raise).
                need = align_up(pair_counts.sum(0), A).view(R, L).sum(1)   # rows per destination
                cap = worst_case_recv_rows(R, M, K, L, A, True)
                over = (need > cap).nonzero().flatten().tolist()
                if over:
                    raise self._error(
                        f"rank(s) {over} would receive {need[over].tolist()} expanded rows, more than the "
                        f"{cap} a do_cpu_sync=False output holds (R x M x min(K, L) pairs + padding: a token "
                        f"that names the same expert more than once can exceed it). Nothing was written")

        # --- send_pos (where this rank's tokens land), computed locally from the exchanged counts
        if not do_expand:
            offsets = counts[:r].sum(0)                           # [R]: rows at d from sources < r
            send_pos = torch.where(hit, offsets.unsqueeze(0) + torch.cumsum(hit.long(), 0) - 1,
                                   torch.full((T, R), -1, dtype=torch.int64)).to(torch.int32)
        else:
            total = pair_counts.sum(0)                            # [E] pairs per expert at its owner
            padded = align_up(total, A)
            pv = padded.view(R, L)
            starts = (torch.cumsum(pv, 1) - pv).flatten()         # group start in the owner's rows
            before = pair_counts[:r].sum(0)                       # pairs of sources < r, per expert
            sel = topk_idx.flatten() >= 0
            flat = sel.nonzero().flatten()
            ge = topk_idx.flatten()[flat]
            order = torch.sort(ge, stable=True).indices
            flat, ge = flat[order], ge[order]
            mine = pair_counts[r]
            ucum = torch.cumsum(mine, 0) - mine
            rank_in = torch.arange(flat.numel()) - ucum[ge]
            send_pos = torch.full((T * K,), -1, dtype=torch.int32)
            send_pos[flat] = (starts[ge] + before[ge] + rank_in).to(torch.int32)
            send_pos = send_pos.view(T, K)

        # --- move rows: each token once per destination rank, in (d, t) order. The data rows travel
        # alone (wide integer view, no packing copy); scale factors, routing and the source token
        # index travel packed side by side in a second, small exchange.
        parts = []
        if sf is not None:
            parts.append((_bytes(sf), num_sf * 4))
        parts.append((_bytes(topk_idx), K * 8))
        if has_w:
            parts.append((_bytes(topk_weights.float()), K * 4))
        parts.append((_bytes(torch.arange(T, dtype=torch.int32).view(T, 1)), 4))
        _, tok_t = hit.t().nonzero(as_tuple=True)                 # sorted by (d, t)
        n_in = int(recv_counts.sum())
        in_splits, out_splits = recv_counts.tolist(), send_counts.tolist()
        meta_out = _pack(parts, tok_t)
        meta_in = torch.empty((n_in, meta_out.shape[1]), dtype=torch.uint8)
        self._all_to_all("routing rows", meta_in, meta_out, in_splits, out_splits)
        # Non-expanded outputs receive the data in place; expanded ones go through a staging tensor.
        rows_needed = n_in if (do_cpu_sync or do_expand) else worst_case_recv_rows(R, M, K, L, A, False)
        in_data_full = outputs.empty((rows_needed, H), data.dtype, "cpu")
        in_data = in_data_full[:n_in]
        self._all_to_all("data rows", _wire(in_data), _wire(data).index_select(0, tok_t), in_splits,
                         out_splits)

        # --- unpack on the destination side (rows arrive ordered by (s, t))
        col = 0
        in_sf = None
        if sf is not None:
            in_sf = _typed(meta_in[:, col:col + num_sf * 4], sf.dtype, num_sf); col += num_sf * 4
        in_idx = _typed(meta_in[:, col:col + K * 8], torch.int64, K); col += K * 8
        in_w = None
        if has_w:
            in_w = _typed(meta_in[:, col:col + K * 4], torch.float32, K); col += K * 4
        in_tok = _typed(meta_in[:, col:col + 4], torch.int32, 1).flatten()
        in_src = torch.repeat_interleave(torch.arange(R, dtype=torch.int32), recv_counts)

        local = (in_idx >= r * L) & (in_idx < (r + 1) * L)        # [n_in, K]
        local_expert = in_idx - r * L
        expert_counts = torch.bincount(local_expert[local], minlength=L).to(torch.int32)
        padded_counts = align_up(expert_counts, A)

        if not do_expand:
            n_valid = n_in
            rows = n_in if do_cpu_sync else worst_case_recv_rows(R, M, K, L, A, False)
            row_of = torch.arange(n_in)
            src_of = row_of                                        # received token feeding each row
            tokens_per_src = recv_counts
            recv_idx = torch.full((rows, K), -1, dtype=torch.int64)
            recv_idx[:n_in] = torch.where(local, local_expert, torch.full_like(local_expert, -1))
            recv_w = None
            if has_w:
                recv_w = torch.zeros((rows, K), dtype=torch.float32)
                recv_w[:n_in] = torch.where(local, in_w, torch.zeros_like(in_w))
            handle_w = None
            pad_rows = None
        else:
            flat = local.flatten().nonzero().flatten()            # ascending (j, k) = (s, t, k)
            e = local_expert.flatten()[flat]
            order = torch.sort(e, stable=True).indices
            flat, e = flat[order], e[order]
            j, k = torch.div(flat, K, rounding_mode="floor"), flat % K
            starts = torch.cumsum(padded_counts, 0) - padded_counts
            ustarts = torch.cumsum(expert_counts, 0) - expert_counts
            row_of = starts[e] + torch.arange(flat.numel()) - ustarts[e]
            n_valid = int(padded_counts.sum())
            rows = n_valid if do_cpu_sync else worst_case_recv_rows(R, M, K, L, A, True)
            src_of = j
            tokens_per_src = torch.bincount(in_src[j].long(), minlength=R)
            recv_idx = torch.full((rows,), -1, dtype=torch.int64)
            recv_idx[row_of] = e
            recv_w = torch.zeros(rows, dtype=torch.float32)
            recv_w[row_of] = in_w[j, k] if has_w else 1.0
            handle_w = recv_w
            pad_rows = torch.ones(n_valid, dtype=torch.bool)
            pad_rows[row_of] = False
        if n_valid > rows:  # cannot happen after the header checks; never write past the allocation
            raise self._error(f"{n_valid} rows received, only {rows} allocated")

        # recv_x: rows past the true count are unspecified; padding rows are zeroed on request
        # (the expanded gather below covers every non-padding row).
        if not do_expand:
            recv_data = in_data_full                               # received in place
        else:
            recv_data = outputs.empty((rows, H), data.dtype, "cpu")
            _wire(recv_data).index_copy_(0, row_of, _wire(in_data).index_select(0, src_of))
            if do_zero_padding:
                as_bits(recv_data)[:n_valid][pad_rows] = 0
        if sf is not None:
            recv_sf = alloc_recv_sf(rows, num_sf, sf.dtype, "cpu", use_tma_aligned_col_major_sf,
                                    zero=False)
            recv_sf[row_of] = in_sf[src_of]
            if do_expand and do_zero_padding:
                recv_sf[:n_valid][pad_rows] = 0
            recv_x = (recv_data, recv_sf)
        else:
            recv_x = recv_data

        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += expert_counts

        if cached:
            # The handle's routing: expanded layouts return the weights of the dispatch that made it.
            return recv_x, recv_idx, (handle.recv_topk_weights if do_expand else None), handle

        recv_src_rank = torch.full((rows,), -1, dtype=torch.int32)
        recv_src_token = torch.full((rows,), -1, dtype=torch.int32)
        recv_src_rank[row_of] = in_src[src_of]
        recv_src_token[row_of] = in_tok[src_of]
        new_handle = EPHandle(
            buffer_id=self.config.buffer_id, num_ranks=R, rank=r, num_experts=E, num_topk=K,
            hidden=H, do_expand=do_expand, expert_alignment=A, num_max_tokens_per_rank=M,
            num_tokens=T, num_recv_tokens=n_valid if do_cpu_sync else None,
            num_recv_tokens_gpu=torch.tensor([n_valid], dtype=torch.int32),
            rank_prefix_sum=torch.cumsum(tokens_per_src, 0).to(torch.int32),
            num_recv_tokens_per_expert=padded_counts,
            num_recv_tokens_per_expert_list=padded_counts.tolist() if do_cpu_sync else None,
            recv_src_rank=recv_src_rank, recv_src_token=recv_src_token, send_pos=send_pos,
            topk_idx=topk_idx.clone(), recv_topk_weights=handle_w)
        return recv_x, recv_idx, recv_w, new_handle

    # ------------------------------------------------------------------ combine
    def combine(self, x, handle, topk_weights, bias, *, num_sms):
        self._begin("combine")
        R = self.num_ranks
        h = handle
        T, H, K, L = h.num_tokens, h.hidden, h.num_topk, h.num_local_experts
        has_w = topk_weights is not None

        # --- destination side: send every valid row back to its source, grouped by source rank
        valid_rows = (h.recv_src_rank >= 0).nonzero().flatten()
        src = h.recv_src_rank[valid_rows].long()
        order = torch.sort(src, stable=True).indices             # by source, then by row
        out_rows = valid_rows[order]
        send_counts = torch.bincount(src, minlength=R).to(torch.int64)

        # --- source side: how many rows each destination returns, and where they go
        if not h.do_expand:
            sent = h.send_pos >= 0                                 # [T, R]
            expect = sent.sum(0).to(torch.int64)
        else:
            owner = torch.where(h.topk_idx >= 0, torch.div(h.topk_idx, L, rounding_mode="floor"),
                                torch.full_like(h.topk_idx, -1))
            sent = h.send_pos >= 0                                 # [T, K]
            expect = torch.stack([(sent & (owner == d)).sum() for d in range(R)]).to(torch.int64) \
                if R > 0 else torch.zeros(0, dtype=torch.int64)

        fields = [0] * _F
        fields[_OP], fields[_E], fields[_H], fields[_K] = _OP_COMBINE, h.num_experts, H, K
        fields[_EXPAND], fields[_ALIGN], fields[_M] = int(h.do_expand), h.expert_alignment, \
            h.num_max_tokens_per_rank
        fields[_SYNC], fields[_HASW], fields[_T] = int(h.do_cpu_sync), int(has_w), T
        headers = self._exchange_header(fields, send_counts, expect)
        sends = headers[:, _F:_F + R]                              # sends[d, s]: rows d returns to s
        expects = headers[:, _F + R:]                              # expects[s, d]
        if (sends != expects.t()).any():
            bad = (sends != expects.t()).nonzero().tolist()
            d, s = bad[0]
            raise self._error(
                f"handles do not match across ranks: rank {d} would return {int(sends[d, s])} rows to "
                f"rank {s}, which expects {int(expects[s, d])} (every rank must combine with the handle "
                f"of the same dispatch)")

        parts = []
        if h.do_expand:
            parts.append((_bytes(h.recv_topk_weights.view(-1, 1)), 4))
        if has_w:
            tw = topk_weights if not h.do_expand else topk_weights.view(-1, 1)
            parts.append((_bytes(tw), 4 * tw.shape[1]))
        n_back = int(expect.sum())
        in_splits, out_splits = expect.tolist(), send_counts.tolist()
        y = torch.empty((n_back, H), dtype=torch.bfloat16)
        self._all_to_all("data rows", _wire(y), _wire(x).index_select(0, out_rows), in_splits, out_splits)
        y_w = y_tw = None
        if parts:
            meta_out = _pack(parts, out_rows)
            meta_in = torch.empty((n_back, meta_out.shape[1]), dtype=torch.uint8)
            self._all_to_all("weights", meta_in, meta_out, in_splits, out_splits)
            col = 0
            if h.do_expand:
                y_w = _typed(meta_in[:, col:col + 4], torch.float32, 1); col += 4
            if has_w:
                width = 1 if h.do_expand else K
                y_tw = _typed(meta_in[:, col:col + 4 * width], torch.float32, width)

        # --- reduce in the reference order
        # Same dense steps as deep_ep.reference.reference_combine (adding +0.0 where a token has no
        # contribution leaves the float32 bits unchanged).
        acc = torch.zeros((T, H), dtype=torch.float32)
        cw = torch.zeros((T, K), dtype=torch.float32) if has_w else None
        staging = torch.empty((T, H), dtype=torch.bfloat16)
        seg = torch.cumsum(expect, 0) - expect                    # first returned row from each d
        if not h.do_expand:
            for d in range(R):
                tok = sent[:, d].nonzero().flatten()             # ascending t == ascending row at d
                if tok.numel() == 0:
                    continue
                first = int(seg[d])
                staging.zero_()
                _wire(staging).index_copy_(0, tok, _wire(y[first:first + tok.numel()]))
                acc += staging.float()
                if has_w:
                    cw.index_add_(0, tok, y_tw[first:first + tok.numel()])
        else:
            pos_y = torch.full((T, K), -1, dtype=torch.int64)
            for d in range(R):
                pairs = (sent & (owner == d)).flatten().nonzero().flatten()
                if pairs.numel() == 0:
                    continue
                by_row = torch.sort(h.send_pos.flatten()[pairs].long()).indices
                pos_y.view(-1)[pairs[by_row]] = torch.arange(int(seg[d]), int(seg[d]) + pairs.numel())
            for k in range(K):
                tok = (pos_y[:, k] >= 0).nonzero().flatten()
                if tok.numel() == 0:
                    continue
                p = pos_y[tok, k]
                w = torch.zeros((T, 1), dtype=torch.float32)
                w[tok] = y_w[p]
                staging.zero_()
                _wire(staging).index_copy_(0, tok, _wire(y).index_select(0, p))
                acc += w * staging.float()
                if has_w:
                    cw[tok, k] = y_tw[p, 0]
        for b in bias:
            acc += b.float()
        return acc.to(torch.bfloat16), cw
