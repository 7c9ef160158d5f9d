"""A model of the direct low-latency kernels (include/deep_ep/impls/ll_direct.cuh) in torch ops on the
CPU, byte for byte on a model of each rank's window: the send phases write rows, scales, pair words and
tagged flags at the byte offsets the host passes, the receive phases check the flags' tags and
fingerprints and write the outputs; a launch of both phases (a call without a receive hook) runs
the rank's send, then its receive. tests/test_legacy_ll_direct.py runs `deep_ep.legacy.ll_direct`'s
host code on it (its launches replaced by `launch`) against the spec of tests/test_legacy_low_latency.py.
Rank masks as the kernels apply them (a dispatch on its copy of the mask, its combine on the
dispatch's decisions); the model runs a receive after the sends of the ranks that called, so a flag
of another tag is one that will never come: a timeout (an assertion without a mask or for the
rank's own flags)."""
from __future__ import annotations

import torch

from deep_ep.legacy import ll_direct
from deep_ep.legacy.layouts import cast_to_fp8

_CONSTANTS = ll_direct._CONSTANTS
_CTRL_WORD = _CONSTANTS["kLlDirectCtrlWord"]
_HALF_WORDS = _CONSTANTS["kLlDirectHalfWords"]
_ABSENT_BIT = 1 << _CONSTANTS["kLlDirectAbsentShift"]
_TAG_SHIFT, _TAG_MASK = _CONSTANTS["kLlDirectIncludedTagShift"], _CONSTANTS["kLlDirectIncludedTagMask"]
_COUNT_MASK = _CONSTANTS["kLlDirectIncludedCountMask"]
#: (rank, peer, "dispatch" / "combine") of every wait that timed out under a rank mask
TIMEOUTS = []


def _word(half: int, word: int) -> int:
    return _CTRL_WORD + half * _HALF_WORDS + _CONSTANTS[word]


def _flag_offset(half: int, word: str, index: int) -> int:
    return _word(half, word) * 4 + index * 8


def _put(window: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
    data = tensor.contiguous().view(torch.uint8).reshape(-1)
    window[offset:offset + data.numel()] = data


def _get(window: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return window[offset:offset + count * size].clone().view(dtype)


def _seq(window: torch.Tensor, half: int, word: str) -> int:
    return int(_get(window, _word(half, word) * 4, 1, torch.int32)[0])


def _advance(window: torch.Tensor, half: int, word: str) -> None:
    _put(window, _word(half, word) * 4, torch.tensor([_seq(window, half, word) + 1], dtype=torch.int32))


def _flag(tag: int, fingerprint: int, value: int) -> torch.Tensor:
    bits = ((fingerprint & 0xFFFF) << 48) | ((tag & 0xFFFF) << 32) | value
    return torch.tensor([bits - (1 << 64) if bits >= 1 << 63 else bits], dtype=torch.int64)


def _included(window: torch.Tensor, half: int, word: str, index: int, tag: int = None, count: int = None) -> int:
    """The sender's word of what it last sent on the half in a call that included the receiver (the
    kernels' ll_direct_included), read, or written when ``tag`` is given."""
    offset = _word(half, word) * 4 + index * 4
    if tag is not None:
        _put(window, offset, torch.tensor([((tag & _TAG_MASK) << _TAG_SHIFT) | (count & _COUNT_MASK)],
                                          dtype=torch.int64).to(torch.int32))
    return int(_get(window, offset, 1, torch.int32)[0]) & 0xFFFFFFFF


def _absent_flag(window: torch.Tensor, half: int, word: str, index: int, tag: int) -> int:
    """The kernels' ll_direct_absent_flag: the absent value naming the last included call; once that
    call is 2^13 calls old, the word names a call 2^14 ahead instead."""
    last = _included(window, half, word, index)
    if (tag - (last >> _TAG_SHIFT)) & _TAG_MASK >= (_TAG_MASK + 1) // 4:
        last = _included(window, half, word, index, tag + (_TAG_MASK + 1) // 2, 0)
    return _ABSENT_BIT | last


def _is_absent(value: int) -> bool:
    return bool(value & _ABSENT_BIT)


def _wait(window: torch.Tensor, offset: int, tag: int, fingerprint: int, masks: bool = False,
          lenient: bool = False):
    """The flag's value. With ``masks``, a flag of a later call on the half is read as the kernels
    do: an absent flag naming this call as the last that included this rank gives its count, any
    other an absent value; where ``lenient`` (a peer's flags), None for a timeout."""
    bits = int(_get(window, offset, 1, torch.int64)[0]) & ((1 << 64) - 1)
    ahead = ((bits >> 32) - tag) & 0xFFFF
    if masks and 0 < ahead < 0x8000:
        later = bits & 0xFFFFFFFF
        named = (later >> _TAG_SHIFT) & _TAG_MASK
        since = ((bits >> 32) - named) & _TAG_MASK
        this_call = _is_absent(later) and named == tag & _TAG_MASK and 0 < since < (_TAG_MASK + 1) // 4
        return later & _COUNT_MASK if this_call else _ABSENT_BIT
    if lenient and ahead:
        return None
    assert (bits >> 32) & 0xFFFF == tag & 0xFFFF, "a receive would wait: the flag carries another call's tag"
    assert bits >> 48 == fingerprint & 0xFFFF, "the ranks disagree on the call"
    return bits & 0xFFFFFFFF


def _left_out(present, rank_state, peer: int) -> bool:
    """Whether a combine leaves ``peer`` out before any flag: its dispatch did, or the peer was taken
    as failed since."""
    return not bool(present[peer]) or bool(rank_state[len(present) + peer])


def _decide(flags: list, rank_state, rank: int, kind: str) -> list:
    """The receive's decision about each peer from its flags' values (None: timed out): in unless
    one of the two masks the other; a peer that timed out is masked and taken as failed
    (``rank_state``: the mask, then the failed ranks)."""
    inside = []
    for peer, values in enumerate(flags):
        if values is None:                      # this rank masks it (or its dispatch left it out)
            inside.append(False)
        elif any(value is None for value in values):
            TIMEOUTS.append((rank, peer, kind))
            rank_state[peer] = rank_state[len(flags) + peer] = 1
            inside.append(False)
        else:
            inside.append(not any(_is_absent(value) for value in values))
    return inside


def launch(owner, window, name: str, blocks: int, args: tuple, device) -> None:
    """Run kernel ``name`` of ``owner``'s rank on the model's windows (``args``: the host's tuple)."""
    transport, phase, half, regions = args[:4]
    if name == ll_direct.DISPATCH_KERNEL:
        (x, topk_idx, num_tokens, hidden, num_topk, num_experts, num_local_experts, num_slots, use_fp8, round_scale,
         use_ue8m0, data_out, scales_out, recv_count, src_info, layout_range, stats, routes, rank_view, rank_state,
         present, fingerprint, _, _) = args[4:]
        assert (rank_view is None) == (rank_state is None) == (present is None)
        assert rank_view is None or rank_view.data_ptr() != rank_state.data_ptr()   # the call's own copy
        assert phase in (ll_direct.SEND_PHASE, ll_direct.RECEIVE_PHASE, ll_direct.BOTH_PHASES)
        if phase & ll_direct.SEND_PHASE:
            _dispatch_send(transport.rank, transport.windows, half, regions, x, topk_idx, num_tokens, hidden, num_topk,
                           num_experts, num_local_experts, num_slots, use_fp8, round_scale, rank_view, fingerprint)
        if phase & ll_direct.RECEIVE_PHASE:
            _dispatch_recv(transport.rank, transport.windows, half, regions, data_out, scales_out, recv_count,
                           src_info, layout_range, stats, routes, num_local_experts, num_slots, num_topk, hidden,
                           use_fp8, use_ue8m0, rank_view, rank_state, present, fingerprint)
        return
    assert name == ll_direct.COMBINE_KERNEL
    (x, expert_stride, row_stride, recv_count, routes, num_local_experts, num_slots, num_topk, hidden, topk_idx,
     topk_weights, out, num_tokens, rank_state, present, fingerprint, _, _) = args[4:]
    assert (rank_state is None) == (present is None)
    assert phase in (ll_direct.SEND_PHASE, ll_direct.RECEIVE_PHASE, ll_direct.BOTH_PHASES)
    if phase & ll_direct.SEND_PHASE:
        _combine_send(transport.rank, transport.windows, half, regions, x, expert_stride, row_stride, recv_count,
                      routes, num_local_experts, num_slots, num_topk, hidden, present, rank_state, fingerprint)
    if phase & ll_direct.RECEIVE_PHASE:
        _combine_recv(transport.rank, transport.windows, half, regions, topk_idx, topk_weights, out, num_tokens,
                      num_topk, hidden, num_local_experts, rank_state, present, fingerprint)


def _dispatch_send(rank, windows, half, regions, x, topk_idx, num_tokens, hidden, num_topk, num_experts,
                   num_local_experts, num_slots, use_fp8, round_scale, rank_view, fingerprint):
    num_ranks = len(windows)
    row_bytes = hidden if use_fp8 else 2 * hidden
    for token in range(num_tokens):
        for slot in range(num_topk):
            expert = int(topk_idx[token, slot])
            if expert < 0:
                continue
            place = int((topk_idx[:token] == expert).any(dim=1).sum())
            owner, local = divmod(expert, num_local_experts)
            if rank_view is not None and rank_view[owner]:
                continue
            row = (local * num_ranks + rank) * num_slots + place
            target = windows[owner]
            if use_fp8:
                data, scales = cast_to_fp8(x[token:token + 1], bool(round_scale))
                _put(target, regions.rows + row * row_bytes, data)
                _put(target, regions.scales + row * (hidden // 128) * 4, scales)
            else:
                _put(target, regions.rows + row * row_bytes, x[token])
            _put(target, regions.pairs + row * 4, torch.tensor([token * num_topk + slot], dtype=torch.int32))
    tag = _seq(windows[rank], half, "kLlDirectDispatchSeq") + 1
    for expert in range(num_experts):
        owner, local = divmod(expert, num_local_experts)
        count = int((topk_idx[:num_tokens] == expert).sum())
        place = local * num_ranks + owner            # the flag's place in the owner's window
        if rank_view is not None and rank_view[owner]:
            count = _absent_flag(windows[rank], half, "kLlDirectDispatchIncluded", place, tag)
        elif rank_view is not None:
            _included(windows[rank], half, "kLlDirectDispatchIncluded", place, tag, count)
        _put(windows[owner], _flag_offset(half, "kLlDirectDispatchFlags", local * num_ranks + rank),
             _flag(tag, fingerprint.value, count))


def _dispatch_recv(rank, windows, half, regions, data_out, scales_out, recv_count, src_info, layout_range, stats,
                   routes, num_local_experts, num_slots, num_topk, hidden, use_fp8, use_ue8m0, rank_view, rank_state,
                   present, fingerprint):
    window = windows[rank]
    num_ranks = len(windows)
    num_rows = num_ranks * num_slots
    num_scales = hidden // 128
    row_bytes = hidden if use_fp8 else 2 * hidden
    tag = _seq(window, half, "kLlDirectDispatchSeq") + 1
    data_bytes = data_out.view(torch.uint8).view(-1)

    masks = rank_view is not None

    def value(local, source):
        return _wait(window, _flag_offset(half, "kLlDirectDispatchFlags", local * num_ranks + source), tag,
                     fingerprint.value, masks=masks, lenient=masks and source != rank)

    inside = [True] * num_ranks
    if masks:    # not waited for: the peers the call's mask masks, and those taken as failed since
        inside = _decide([None if rank_view[source] or rank_state[num_ranks + source] else
                          [value(local, source) for local in range(num_local_experts)]
                          for source in range(num_ranks)], rank_state, rank, "dispatch")
        present.copy_(torch.tensor(inside, dtype=torch.int32))
    for local in range(num_local_experts):
        counts = [value(local, source) if inside[source] else 0 for source in range(num_ranks)]
        begins = [sum(counts[:source]) for source in range(num_ranks + 1)]
        total = begins[-1]
        recv_count[local] = total
        if stats is not None:
            stats[local] += total
        for source in range(num_ranks):
            layout_range[local, source] = (begins[source] << 32) | counts[source]
        src_info[local, total:] = -1
        for row in range(total):
            source = max(s for s in range(num_ranks) if begins[s] <= row)
            window_row = (local * num_ranks + source) * num_slots + row - begins[source]
            out_row = local * num_rows + row
            data_bytes[out_row * row_bytes:(out_row + 1) * row_bytes] = _get(
                window, regions.rows + window_row * row_bytes, row_bytes, torch.uint8)
            if use_fp8:
                scales = _get(window, regions.scales + window_row * num_scales * 4, num_scales, torch.float32)
                for column in range(num_scales):
                    if use_ue8m0:
                        word = (local * (num_scales // 4) + column // 4) * num_rows + row
                        exponent = (int(scales[column:column + 1].view(torch.int32)) >> 23) & 0xFF
                        scales_out.view(torch.uint8)[word * 4 + column % 4] = exponent
                    else:
                        scales_out[(local * num_scales + column) * num_rows + row] = scales[column]
            pair = int(_get(window, regions.pairs + window_row * 4, 1, torch.int32)[0])
            src_info[local, row] = pair // num_topk
            routes[local, row] = source * num_slots * num_topk + pair
    _advance(window, half, "kLlDirectDispatchSeq")


def _combine_send(rank, windows, half, regions, x, expert_stride, row_stride, recv_count, routes, num_local_experts,
                  num_slots, num_topk, hidden, present, rank_state, fingerprint):
    num_ranks = len(windows)
    pairs_per_rank = num_slots * num_topk
    assert expert_stride.value == x.stride(0) * 2 // 16 and row_stride.value == x.stride(1) * 2 // 16
    absent = [present is not None and _left_out(present, rank_state, peer) for peer in range(num_ranks)]
    for local in range(num_local_experts):
        for row in range(int(recv_count[local])):
            peer, pair = divmod(int(routes[local, row]), pairs_per_rank)
            if not absent[peer]:
                _put(windows[peer], regions.combine + pair * hidden * 2, x[local, row])
    tag = _seq(windows[rank], half, "kLlDirectCombineSeq") + 1
    for peer in range(num_ranks):
        value = 1
        if absent[peer]:
            value = _absent_flag(windows[rank], half, "kLlDirectCombineIncluded", peer, tag)
        elif present is not None:
            _included(windows[rank], half, "kLlDirectCombineIncluded", peer, tag, 1)
        _put(windows[peer], _flag_offset(half, "kLlDirectCombineFlags", rank), _flag(tag, fingerprint.value, value))


def _combine_recv(rank, windows, half, regions, topk_idx, topk_weights, out, num_tokens, num_topk, hidden,
                  num_local_experts, rank_state, present, fingerprint):
    from deep_ep.legacy.ll_reduce import weighted_sum_torch
    window = windows[rank]
    tag = _seq(window, half, "kLlDirectCombineSeq") + 1
    values = [None if present is not None and _left_out(present, rank_state, peer) else
              [_wait(window, _flag_offset(half, "kLlDirectCombineFlags", peer), tag, fingerprint.value,
                     masks=present is not None, lenient=present is not None and peer != rank)]
              for peer in range(len(windows))]
    pairs = _get(window, regions.combine, num_tokens * num_topk * hidden, torch.bfloat16)
    out_of_call = None           # rank masks: a slot whose expert's rank is out of the call adds nothing
    if present is not None:
        out_of_call = torch.tensor([int(not inside) for inside in _decide(values, rank_state, rank, "combine")], dtype=torch.int32)
    weighted_sum_torch(pairs.view(num_tokens, num_topk, hidden), topk_idx, topk_weights, out_of_call,
                       num_local_experts, out)
    _advance(window, half, "kLlDirectCombineSeq")
