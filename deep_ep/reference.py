"""Executable specification of dispatch and combine (docs/design.md, "Semantics").

Everything here takes *all* ranks' inputs in one process and returns *every* rank's outputs, with
plain vectorised torch (no per-token Python loops), so it runs in seconds at DeepSeek-V3 sizes
(4096 tokens x 7168 channels x 8 ranks). The CPU backend must match it bit for bit; the GPU kernels
are checked against it.

Entry points:
    reference_dispatch(xs, topk_idxs, topk_weights, num_experts, ...) -> list[ReferenceDispatch]
    reference_combine(ys, handles, topk_weights=None, biases=None)    -> list[(combined_x, combined_w)]
    check_dispatch(...) / check_combine(...)                          compare a backend's outputs
    worst_case_recv_rows(...)                                         do_cpu_sync=False sizes

Summation order of combine (what makes results bit-identical): each output row starts at +0.0 in
float32; non-expanded adds the contributions of destination ranks d = 0, 1, ... R-1 in order;
expanded adds ``w * x`` (the product rounded to float32 first) for k = 0, 1, ... K-1 in order; then
bias 0, then bias 1 are added; the float32 sum is rounded to bfloat16 (round to nearest even).
Skipped contributions are not added (adding +0.0 would give the same bits: the sum is never -0.0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .handle import EPHandle

__all__ = [
    "ReferenceDispatch", "reference_dispatch", "reference_combine", "worst_case_recv_rows",
    "align_up", "as_bits", "as_rows", "split_x", "alloc_recv_sf", "check_dispatch", "check_combine",
]

Tensor = torch.Tensor
XType = Union[Tensor, tuple]


# ---------------------------------------------------------------------------------------------- helpers
def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``value``."""
    return (value + alignment - 1) // alignment * alignment


def split_x(x: XType) -> tuple:
    """``x`` → ``(data, sf)``: ``(x, None)`` for a bf16 tensor, the pair itself for an FP8 tuple."""
    if isinstance(x, (tuple, list)):
        return x[0], x[1]
    return x, None


def worst_case_recv_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int,
                         num_local_experts: int, expert_alignment: int, do_expand: bool) -> int:
    """Rows of the receive tensors of a ``do_cpu_sync=False`` dispatch (design.md).

    Non-expanded: ``R * M``. Expanded: ``R * M * min(K, L) + L * (A - 1)`` rounded up to ``A``.
    """
    if not do_expand:
        return num_ranks * num_max_tokens_per_rank
    pairs = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    return align_up(pairs + num_local_experts * (expert_alignment - 1), expert_alignment)


def alloc_recv_sf(rows: int, num_sf: int, dtype: torch.dtype, device, col_major: bool,
                  zero: bool = True) -> Tensor:
    """Allocate received scale factors ``[rows, num_sf]``.

    Row-major normally; with ``col_major`` a ``[rows, num_sf]`` view of a ``[num_sf, align4(rows)]``
    storage (the TMA-aligned layout DeepGEMM reads).
    """
    make = torch.zeros if zero else torch.empty
    if not col_major:
        return make((rows, num_sf), dtype=dtype, device=device)
    storage = make((num_sf, align_up(rows, 4)), dtype=dtype, device=device)
    return storage.t()[:rows]


def as_bits(t: Tensor) -> Tensor:
    """View a tensor as the integer dtype of the same width (row moves of any dtype, FP8 included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def as_rows(t: Tensor, dtypes: tuple = (torch.int64, torch.int32, torch.int16)) -> Tensor:
    """View a contiguous ``[rows, n]`` tensor as ``[rows, m]`` of the widest integer type of ``dtypes``
    (none narrower than an element) that divides a row, else as uint8 bytes: moving whole rows
    (index_select / index_copy_) is then a few wide copies per row."""
    row_bytes = t.shape[1] * t.element_size()
    for dtype in dtypes:
        if row_bytes % dtype.itemsize == 0 and dtype.itemsize >= t.element_size():
            return t.view(dtype)
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------- dispatch
@dataclass
class ReferenceDispatch:
    """One rank's dispatch outputs: what `ElasticBuffer.dispatch` returns there (less the event)."""
    recv_x: XType
    recv_topk_idx: Tensor
    recv_topk_weights: Optional[Tensor]
    handle: EPHandle
    num_valid_rows: int          # rows that hold data (excl. rows past the true count), incl. padding
    is_padding_row: Tensor       # [rows] bool: expanded padding rows (within the true count)

    def as_tuple(self):
        """``(recv_x, recv_topk_idx, recv_topk_weights, handle)``, as `ElasticBuffer.dispatch` returns
        them (less the event)."""
        return self.recv_x, self.recv_topk_idx, self.recv_topk_weights, self.handle


def reference_dispatch(xs: Sequence[XType], topk_idxs: Sequence[Tensor],
                       topk_weights: Optional[Sequence[Optional[Tensor]]], num_experts: int, *,
                       do_expand: bool = False, expert_alignment: int = 1, do_zero_padding: bool = True,
                       do_cpu_sync: bool = True, num_max_tokens_per_rank: int = 0,
                       use_tma_aligned_col_major_sf: bool = False) -> list:
    """Every rank's dispatch result, from every rank's inputs.

    Args:
        xs: per source rank ``s``, bf16 ``[T_s, H]`` or ``(fp8 data [T_s, H], sf [T_s, num_sf])``.
        topk_idxs: per rank, int64 ``[T_s, K]``; ``-1`` = no selection.
        topk_weights: None, or per rank float32 ``[T_s, K]`` (or None for every rank).
        num_experts: E, divisible by the number of ranks R = ``len(xs)``.
        do_expand, expert_alignment, do_zero_padding, use_tma_aligned_col_major_sf: as in
            `ElasticBuffer.dispatch`. Padding rows are always zero here (with ``do_zero_padding=False``
            their content is unspecified, so zero is as good as anything).
        do_cpu_sync: False → outputs sized for the worst case (`worst_case_recv_rows`), rows past the
            true count hold zeros, ``recv_topk_idx = -1``, weights 0, sources -1.
        num_max_tokens_per_rank: M, needed when ``do_cpu_sync=False``.

    Returns:
        list of `ReferenceDispatch`, one per rank, whose ``handle`` has ``buffer_id = -1``.
    """
    num_ranks = len(xs)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by {num_ranks} ranks")
    L = num_experts // num_ranks
    A = int(expert_alignment)
    datas, sfs = zip(*(split_x(x) for x in xs))
    is_fp8 = sfs[0] is not None
    device = datas[0].device
    num_tokens = [int(d.shape[0]) for d in datas]
    hidden = int(datas[0].shape[1])
    K = int(topk_idxs[0].shape[1])
    if not do_cpu_sync and num_max_tokens_per_rank <= 0:
        raise ValueError("do_cpu_sync=False needs num_max_tokens_per_rank > 0")
    has_weights = topk_weights is not None and topk_weights[0] is not None

    # All tokens of all ranks, in (source rank, source token) order: global index g.
    data_all = torch.cat(datas, 0)
    sf_all = torch.cat([s.contiguous() for s in sfs], 0) if is_fp8 else None
    idx_all = torch.cat(list(topk_idxs), 0).to(torch.int64)
    w_all = torch.cat(list(topk_weights), 0).float() if has_weights else None
    src_rank_all = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                           torch.tensor(num_tokens, device=device)).to(torch.int32)
    src_tok_all = torch.cat([torch.arange(t, device=device, dtype=torch.int32) for t in num_tokens])
    offsets = [0]
    for t in num_tokens:
        offsets.append(offsets[-1] + t)
    N = offsets[-1]
    owner = torch.where(idx_all >= 0, torch.div(idx_all, L, rounding_mode="floor"),
                        torch.full_like(idx_all, -1))

    send_pos_all = torch.full((N, K if do_expand else num_ranks), -1, dtype=torch.int32, device=device)
    results = []
    for d in range(num_ranks):
        local = owner == d                                            # [N, K]
        local_expert = idx_all - d * L                                # valid where local
        counts = torch.bincount(local_expert[local], minlength=L).to(torch.int32)   # unpadded pairs
        padded = align_up(counts, A)
        if not do_expand:
            rows_g = local.any(1).nonzero().squeeze(1)                # ordered by (s, t)
            n_true = int(rows_g.numel())
            rows = n_true if do_cpu_sync else worst_case_recv_rows(
                num_ranks, num_max_tokens_per_rank, K, L, A, False)
            if n_true > rows:
                raise ValueError(f"rank {d} receives {n_true} rows, more than the {rows} allocated")
            row_of = torch.arange(n_true, device=device)
            src_g = rows_g
            tokens_per_src = torch.bincount(src_rank_all[rows_g].long(), minlength=num_ranks)
            send_pos_all[rows_g, d] = row_of.to(torch.int32)
            recv_idx = torch.full((rows, K), -1, dtype=torch.int64, device=device)
            recv_idx[:n_true] = torch.where(local[rows_g], local_expert[rows_g],
                                            torch.full_like(local_expert[rows_g], -1))
            recv_w = None
            if has_weights:
                recv_w = torch.zeros((rows, K), dtype=torch.float32, device=device)
                recv_w[:n_true] = torch.where(local[rows_g], w_all[rows_g], torch.zeros_like(w_all[rows_g]))
            n_valid = n_true
            is_pad = torch.zeros(rows, dtype=torch.bool, device=device)
            handle_w = None
        else:
            pair = local.flatten().nonzero().squeeze(1)              # ascending (g, k)
            e = local_expert.flatten()[pair]
            order = torch.sort(e, stable=True).indices               # by expert, then (g, k)
            pair, e = pair[order], e[order]
            g, k = torch.div(pair, K, rounding_mode="floor"), pair % K
            starts = torch.cumsum(padded, 0) - padded                # padded group starts
            ustarts = torch.cumsum(counts, 0) - counts               # unpadded group starts
            rank_in_group = torch.arange(pair.numel(), device=device) - ustarts[e]
            row_of = starts[e] + rank_in_group
            n_valid = int(padded.sum())
            rows = n_valid if do_cpu_sync else worst_case_recv_rows(
                num_ranks, num_max_tokens_per_rank, K, L, A, True)
            if n_valid > rows:
                raise ValueError(f"rank {d} receives {n_valid} rows, more than the {rows} allocated")
            src_g = g
            tokens_per_src = torch.bincount(src_rank_all[g].long(), minlength=num_ranks)
            send_pos_all[g, k] = row_of.to(torch.int32)
            recv_idx = torch.full((rows,), -1, dtype=torch.int64, device=device)
            recv_idx[row_of] = e
            recv_w = torch.zeros(rows, dtype=torch.float32, device=device)
            recv_w[row_of] = w_all[g, k] if has_weights else 1.0
            is_pad = torch.zeros(rows, dtype=torch.bool, device=device)
            is_pad[:n_valid] = True
            is_pad[row_of] = False
            handle_w = recv_w

        recv_data = torch.zeros((rows, hidden), dtype=data_all.dtype, device=device)
        as_rows(recv_data).index_copy_(0, row_of, as_rows(data_all).index_select(0, src_g))
        if is_fp8:
            recv_sf = alloc_recv_sf(rows, sf_all.shape[1], sf_all.dtype, device,
                                    use_tma_aligned_col_major_sf)
            recv_sf[row_of] = sf_all[src_g]
            recv_x = (recv_data, recv_sf)
        else:
            recv_x = recv_data
        recv_src_rank = torch.full((rows,), -1, dtype=torch.int32, device=device)
        recv_src_token = torch.full((rows,), -1, dtype=torch.int32, device=device)
        recv_src_rank[row_of] = src_rank_all[src_g]
        recv_src_token[row_of] = src_tok_all[src_g]

        handle = EPHandle(
            buffer_id=-1, num_ranks=num_ranks, rank=d, num_experts=num_experts, num_topk=K,
            hidden=hidden, do_expand=do_expand, expert_alignment=A,
            num_max_tokens_per_rank=int(num_max_tokens_per_rank), num_tokens=num_tokens[d],
            num_recv_tokens=n_valid if do_cpu_sync else None,
            num_recv_tokens_gpu=torch.tensor([n_valid], dtype=torch.int32, device=device),
            rank_prefix_sum=torch.cumsum(tokens_per_src, 0).to(torch.int32),
            num_recv_tokens_per_expert=padded.to(torch.int32),
            num_recv_tokens_per_expert_list=padded.tolist() if do_cpu_sync else None,
            recv_src_rank=recv_src_rank, recv_src_token=recv_src_token,
            send_pos=None, topk_idx=topk_idxs[d].to(torch.int64).clone(), recv_topk_weights=handle_w)
        results.append(ReferenceDispatch(recv_x, recv_idx, recv_w, handle, n_valid, is_pad))

    for s, res in enumerate(results):
        res.handle.send_pos = send_pos_all[offsets[s]:offsets[s + 1]].clone()
    return results


def local_expert_counts(results: Sequence[ReferenceDispatch]) -> list:
    """Per rank, int32 ``[L]`` unpadded received pairs per local expert (what
    ``cumulative_local_expert_recv_stats`` is incremented by)."""
    out = []
    for res in results:
        h = res.handle
        L = h.num_local_experts
        idx = res.recv_topk_idx
        valid = idx[idx >= 0]
        out.append(torch.bincount(valid, minlength=L).to(torch.int32))
    return out


# ---------------------------------------------------------------------------------------------- combine
def _normalise_bias(bias) -> tuple:
    if bias is None:
        return ()
    if isinstance(bias, Tensor):
        return (bias,)
    return tuple(b for b in bias if b is not None)


def reference_combine(ys: Sequence[Tensor], handles: Sequence[EPHandle],
                      topk_weights: Optional[Sequence[Optional[Tensor]]] = None,
                      biases: Optional[Sequence] = None) -> list:
    """Every rank's combine result.

    Args:
        ys: per rank ``d``, bf16 ``[handles[d].num_recv_rows, H]`` (the expert outputs, in the
            received layout).
        handles: per rank, the handle its dispatch returned (reference or real).
        topk_weights: None, or per rank float32 ``[rows_d, K]`` (non-expanded) / ``[rows_d]``
            (expanded) to be reduced back like dispatch's backward.
        biases: None, or per rank None / a bf16 ``[T_s, H]`` tensor / a tuple of up to two.

    Returns:
        per rank ``(combined_x bf16 [T_s, H], combined_topk_weights float32 [T_s, K] or None)``.
    """
    num_ranks = len(ys)
    has_w = topk_weights is not None and topk_weights[0] is not None
    out = []
    for s in range(num_ranks):
        h = handles[s]
        T, H, K = h.num_tokens, h.hidden, h.num_topk
        device = ys[s].device
        acc = torch.zeros((T, H), dtype=torch.float32, device=device)
        cw = torch.zeros((T, K), dtype=torch.float32, device=device) if has_w else None
        # One dense step per destination rank (non-expanded) or per top-k slot (expanded): gather the
        # contributions into a [T, H] staging tensor (zero where there is none), then add it to every
        # row at once. Adding +0.0 leaves the float32 sum's bits unchanged (it is never -0.0), so
        # this equals adding only the real contributions, in the documented order.
        staging = torch.empty((T, H), dtype=torch.bfloat16, device=device)
        if not h.do_expand:
            for d in range(num_ranks):
                pos = h.send_pos[:, d].long()
                tok = (pos >= 0).nonzero().squeeze(1)
                if tok.numel() == 0:
                    continue
                p = pos[tok]
                staging.zero_()
                as_rows(staging).index_copy_(0, tok, as_rows(ys[d]).index_select(0, p))
                acc += staging.float()
                if has_w:
                    cw.index_add_(0, tok, topk_weights[d].index_select(0, p).float())
        else:
            L = h.num_local_experts
            owner = torch.div(h.topk_idx, L, rounding_mode="floor")
            for k in range(K):
                pos = h.send_pos[:, k].long()
                w = torch.zeros((T, 1), dtype=torch.float32, device=device)
                staging.zero_()
                any_pair = False
                for d in range(num_ranks):
                    tok = ((pos >= 0) & (owner[:, k] == d)).nonzero().squeeze(1)
                    if tok.numel() == 0:
                        continue
                    any_pair = True
                    p = pos[tok]
                    as_rows(staging).index_copy_(0, tok, as_rows(ys[d]).index_select(0, p))
                    w[tok, 0] = handles[d].recv_topk_weights[p]
                    if has_w:
                        cw[tok, k] = topk_weights[d][p].float()
                if any_pair:
                    acc += w * staging.float()
        for b in _normalise_bias(biases[s] if biases is not None else None):
            acc += b.float()
        out.append((acc.to(torch.bfloat16), cw))
    return out


# ---------------------------------------------------------------------------------------------- checks
def _assert_equal(name: str, actual: Tensor, expected: Tensor, rows: Optional[Tensor] = None) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {expected.dtype}")
    a, e = actual, expected
    if rows is not None:
        a, e = a[rows], e[rows]
    a, e = a.cpu(), e.cpu()
    if a.dtype.is_floating_point and a.element_size() <= 2 or a.dtype == torch.float8_e4m3fn:
        a, e = a.view(torch.uint8 if a.element_size() == 1 else torch.int16), \
               e.view(torch.uint8 if e.element_size() == 1 else torch.int16)
    elif a.dtype == torch.float32:
        a, e = a.view(torch.int32), e.view(torch.int32)
    bad = (a != e)
    if bad.any():
        first = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} element(s) differ, first at {first}: "
                             f"got {actual[rows][tuple(first)] if rows is not None else actual[tuple(first)]}, "
                             f"expected {expected[rows][tuple(first)] if rows is not None else expected[tuple(first)]}")


def check_dispatch(actual: Sequence, expected: ReferenceDispatch, *, do_zero_padding: bool = True,
                   check_handle: bool = True, rank: Optional[int] = None) -> None:
    """Raise `AssertionError` unless a backend's dispatch outputs equal the reference, bit for bit.

    ``actual`` is ``(recv_x, recv_topk_idx, recv_topk_weights, handle[, event])``. Data rows past the
    true count are not compared (unspecified); padding rows only with ``do_zero_padding``. Every other
    element (indices, weights, sources, every handle field but ``buffer_id``) is compared.
    """
    where = f"rank {expected.handle.rank if rank is None else rank}: "
    recv_x, recv_idx, recv_w, handle = actual[:4]
    exp_data, exp_sf = split_x(expected.recv_x)
    data, sf = split_x(recv_x)
    if (sf is None) != (exp_sf is None):
        raise AssertionError(where + "recv_x: FP8 tuple expected" if exp_sf is not None else
                             where + "recv_x: bf16 tensor expected")
    rows = torch.arange(expected.num_valid_rows, device=exp_data.device)
    if not do_zero_padding:
        rows = rows[~expected.is_padding_row[:expected.num_valid_rows]]
    _assert_equal(where + "recv_x", data, exp_data, rows)
    if exp_sf is not None:
        _assert_equal(where + "recv_x sf", sf, exp_sf, rows)
        if exp_sf.stride() != sf.stride():
            raise AssertionError(where + f"recv_x sf strides {sf.stride()}, expected {exp_sf.stride()}")
    _assert_equal(where + "recv_topk_idx", recv_idx, expected.recv_topk_idx)
    if expected.recv_topk_weights is None:
        if recv_w is not None:
            raise AssertionError(where + "recv_topk_weights should be None")
    else:
        if recv_w is None:
            raise AssertionError(where + "recv_topk_weights is None")
        _assert_equal(where + "recv_topk_weights", recv_w, expected.recv_topk_weights)
    if not check_handle:
        return
    eh = expected.handle
    for name in ("num_ranks", "rank", "num_experts", "num_topk", "hidden", "do_expand",
                 "expert_alignment", "num_max_tokens_per_rank", "num_tokens", "num_recv_tokens",
                 "num_recv_tokens_per_expert_list"):
        if getattr(handle, name) != getattr(eh, name):
            raise AssertionError(where + f"handle.{name} = {getattr(handle, name)!r}, "
                                 f"expected {getattr(eh, name)!r}")
    for name in ("num_recv_tokens_gpu", "rank_prefix_sum", "num_recv_tokens_per_expert",
                 "recv_src_rank", "recv_src_token", "send_pos", "topk_idx", "recv_topk_weights"):
        a, e = getattr(handle, name), getattr(eh, name)
        if e is None:
            if a is not None:
                raise AssertionError(where + f"handle.{name} should be None")
            continue
        if a is None:
            raise AssertionError(where + f"handle.{name} is None")
        _assert_equal(where + f"handle.{name}", a, e)


def check_combine(actual: Sequence, expected: tuple, *, rank: int = 0) -> None:
    """Raise `AssertionError` unless ``(combined_x, combined_topk_weights[, event])`` equals the
    reference ``(combined_x, combined_topk_weights)`` bit for bit."""
    where = f"rank {rank}: "
    _assert_equal(where + "combined_x", actual[0], expected[0])
    if expected[1] is None:
        if actual[1] is not None:
            raise AssertionError(where + "combined_topk_weights should be None")
    else:
        if actual[1] is None:
            raise AssertionError(where + "combined_topk_weights is None")
        _assert_equal(where + "combined_topk_weights", actual[1], expected[1])
