"""Table-driven bad input: every invalid argument of every public function raises a clear exception
before any communication (the backend is never called), and the buffer still works afterwards.

`BAD_INPUTS` rows are ``(name, call, exception type, message regex)`` where ``call(c)`` runs the bad
call on the context ``c`` (see `_Ctx`). `CROSS_RANK` rows are calls whose arguments are fine on each
rank alone but disagree between ranks: the backend must raise `RuntimeError` on every rank (no hang).
Runs in two spawned gloo ranks; every row is executed on both.
"""
import re
import traceback

import pytest
import torch
import torch.distributed as dist

from proc_utils import run_gloo_ranks

T, H, K, E, M = 6, 256, 4, 8, 12
FP8 = torch.float8_e4m3fn


class _Ctx:
    """Good inputs of this rank plus a few handles, from which each table row derives a bad call."""

    def __init__(self, buf, other_buf, single_buf, rank):
        from deep_ep.reference import reference_dispatch
        g = torch.Generator().manual_seed(17 + rank)
        self.buf, self.other_buf, self.single_buf, self.rank = buf, other_buf, single_buf, rank
        self.x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        self.idx = torch.rand(T, E, generator=g).topk(K, 1).indices
        self.w = torch.rand(T, K, generator=g)
        self.handle = buf.dispatch(self.x, self.idx, self.w, num_experts=E)[3]
        self.xhandle = buf.dispatch(self.x, self.idx, self.w, num_experts=E, do_expand=True,
                                    expert_alignment=4)[3]
        self.xhandle_nw = buf.dispatch(self.x, self.idx, num_experts=E, do_expand=True)[3]
        self.single_handle = single_buf.dispatch(self.x, self.idx, self.w, num_experts=E, do_expand=True)[3]
        skewed = torch.zeros(T, K, dtype=torch.int64)          # every token to expert 0 only
        skewed[:, 1:] = -1
        self.skewed_handle = buf.dispatch(self.x, skewed, num_experts=E)[3]
        self.foreign_handle = other_buf.dispatch(self.x, self.idx, self.w, num_experts=E)[3]
        self.ref_handle = reference_dispatch([self.x] * 2, [self.idx] * 2, None, E)[rank].handle
        self.y = torch.zeros(self.handle.num_recv_rows, H, dtype=torch.bfloat16)

    def dispatch(self, **changes):
        kw = dict(x=self.x, topk_idx=self.idx, topk_weights=self.w, num_experts=E)
        kw.update(changes)
        return self.buf.dispatch(**kw)

    def combine(self, **changes):
        kw = dict(x=self.y, handle=self.handle)
        kw.update(changes)
        return self.buf.combine(**kw)

    def fp8(self, hidden=H, sf_shape=None, sf_dtype=torch.float32):
        data = torch.zeros(T, hidden, dtype=FP8)
        sf = torch.ones(sf_shape or (T, hidden // 128), dtype=sf_dtype)
        return (data, sf)


def _new_buffer(c, *args, **kw):
    from deep_ep import ElasticBuffer
    return ElasticBuffer(dist.group.WORLD, *args, **kw)


def _noncontig(shape, dtype):
    return torch.zeros(tuple(reversed(shape)), dtype=dtype).t()


BAD_INPUTS = [
    # ---- dispatch: x
    ("x float32", lambda c: c.dispatch(x=c.x.float()), TypeError, "x must have dtype bfloat16"),
    ("x 1-D", lambda c: c.dispatch(x=c.x.flatten()), ValueError, r"x must have shape \[\*, \*\]"),
    ("x not a tensor", lambda c: c.dispatch(x=1.0), TypeError, "x must be a torch.Tensor"),
    ("x non-contiguous", lambda c: c.dispatch(x=_noncontig((T, H), torch.bfloat16)), ValueError, "contiguous"),
    ("x on another device", lambda c: c.dispatch(x=torch.empty(T, H, dtype=torch.bfloat16, device="meta")),
     ValueError, "must be on cpu"),
    ("x bare fp8", lambda c: c.dispatch(x=c.fp8()[0]), TypeError, "tuple"),
    ("fp8 tuple of 3", lambda c: c.dispatch(x=c.fp8() + (None,)), ValueError, "fp8 data, scale factors"),
    ("fp8 hidden not multiple of 128", lambda c: c.dispatch(x=c.fp8(hidden=192, sf_shape=(T, 2))),
     ValueError, "multiple of 128"),
    ("fp8 sf wrong shape", lambda c: c.dispatch(x=c.fp8(sf_shape=(T, 3))), ValueError, r"scale factors.*shape"),
    ("fp8 ue8m0 sf wrong shape", lambda c: c.dispatch(x=c.fp8(sf_shape=(T, 2), sf_dtype=torch.int32)),
     ValueError, r"shape \[6, 1\]"),
    ("fp8 sf float16", lambda c: c.dispatch(x=c.fp8(sf_dtype=torch.float16)), TypeError, "float32/int32"),
    ("fp8 data wrong dtype", lambda c: c.dispatch(x=(c.x, c.fp8()[1])), TypeError, "float8_e4m3fn"),
    # ---- dispatch: routing
    ("topk_idx int32", lambda c: c.dispatch(topk_idx=c.idx.int()), TypeError, "topk_idx must have dtype int64"),
    ("topk_idx wrong rows", lambda c: c.dispatch(topk_idx=c.idx[:-1]), ValueError, r"topk_idx must have shape \[6, \*\]"),
    ("topk_idx 1-D", lambda c: c.dispatch(topk_idx=c.idx[:, 0]), ValueError, "topk_idx must have shape"),
    ("topk_idx non-contiguous", lambda c: c.dispatch(topk_idx=_noncontig((T, K), torch.int64)), ValueError, "contiguous"),
    ("expert id >= num_experts", lambda c: c.dispatch(topk_idx=torch.full((T, K), E)), ValueError,
     r"expert id 8 .*\[0, 8\)"),
    ("expert id < -1", lambda c: c.dispatch(topk_idx=torch.full((T, K), -2)), ValueError, "expert id -2"),
    ("topk_idx missing", lambda c: c.dispatch(topk_idx=None), ValueError, "topk_idx is required"),
    ("topk_idx zero columns", lambda c: c.dispatch(topk_idx=torch.zeros(T, 0, dtype=torch.int64),
                                                   topk_weights=None), ValueError, "at least one column"),
    ("num_topk above the buffer's", lambda c: c.dispatch(topk_idx=torch.zeros(T, 9, dtype=torch.int64),
                                                         topk_weights=None), ValueError, "num_topk=8"),
    ("topk_weights float16", lambda c: c.dispatch(topk_weights=c.w.half()), TypeError, "topk_weights must have dtype float32"),
    ("topk_weights wrong shape", lambda c: c.dispatch(topk_weights=c.w[:, :2]), ValueError, r"topk_weights must have shape \[6, 4\]"),
    ("num_experts not divisible", lambda c: c.dispatch(num_experts=7), ValueError, "divisible by the number of ranks"),
    ("num_experts missing", lambda c: c.dispatch(num_experts=None), ValueError, "num_experts is required"),
    ("num_experts str", lambda c: c.dispatch(num_experts="8"), TypeError, "num_experts must be an int"),
    ("num_experts zero", lambda c: c.dispatch(num_experts=0), ValueError, "num_experts must be >= 1"),
    # ---- dispatch: sizes and flags
    ("more tokens than num_max_tokens_per_rank",
     lambda c: c.dispatch(x=torch.zeros(M + 1, H, dtype=torch.bfloat16),
                          topk_idx=torch.zeros(M + 1, K, dtype=torch.int64), topk_weights=None),
     ValueError, "13 tokens, more than num_max_tokens_per_rank=12"),
    ("num_max_tokens_per_rank above the buffer's", lambda c: c.dispatch(num_max_tokens_per_rank=M + 1),
     ValueError, "exceeds the buffer's"),
    ("fewer max tokens than tokens", lambda c: c.dispatch(num_max_tokens_per_rank=T - 1), ValueError,
     "more than num_max_tokens_per_rank=5"),
    ("hidden above the buffer's", lambda c: c.dispatch(x=torch.zeros(T, 1024, dtype=torch.bfloat16)),
     ValueError, "hidden=1024, more than the buffer's hidden=512"),
    ("expert_alignment zero", lambda c: c.dispatch(expert_alignment=0), ValueError, "expert_alignment must be >= 1"),
    ("expert_alignment float", lambda c: c.dispatch(expert_alignment=1.5), TypeError, "expert_alignment must be an int"),
    ("expert_alignment beyond int32", lambda c: c.dispatch(expert_alignment=2 ** 40), ValueError,
     "expert_alignment must be <= 2147483647"),
    ("num_sms negative", lambda c: c.dispatch(num_sms=-1), ValueError, "num_sms must be >= 0"),
    ("previous_event wrong type", lambda c: c.dispatch(previous_event=object()), TypeError, "EventOverlap"),
    ("previous_event_before_epilogue wrong type", lambda c: c.dispatch(previous_event_before_epilogue=1),
     TypeError, "previous_event_before_epilogue must be None, an EventHandle"),
    ("num_qps negative", lambda c: c.dispatch(num_qps=-1), ValueError, "num_qps must be >= 0"),
    ("num_qps a tensor", lambda c: c.dispatch(num_qps=torch.zeros(2, dtype=torch.int64)), TypeError,
     "num_qps must be an int"),
    ("num_sms a bool", lambda c: c.dispatch(num_sms=True), TypeError, "num_sms must be an int"),
    ("num_qps above the allocated", lambda c: c.dispatch(num_qps=1), ValueError,
     "num_qps=1 exceeds the buffer's num_allocated_qps=0"),
    ("do_expand not bool", lambda c: c.dispatch(do_expand="yes"), TypeError, "do_expand must be a bool"),
    ("do_cpu_sync 2", lambda c: c.dispatch(do_cpu_sync=2), TypeError, "do_cpu_sync must be a bool"),
    ("do_expand None", lambda c: c.dispatch(do_expand=None), TypeError, "do_expand must be a bool"),
    ("do_handle_copy 1.0", lambda c: c.dispatch(do_handle_copy=1.0), TypeError, "do_handle_copy must be a bool"),
    ("async_with_compute_stream a two-element tensor",
     lambda c: c.dispatch(async_with_compute_stream=torch.ones(2, dtype=torch.bool)), TypeError,
     "async_with_compute_stream must be a bool"),
    ("stats int64", lambda c: c.dispatch(cumulative_local_expert_recv_stats=torch.zeros(E // 2, dtype=torch.int64)),
     TypeError, "cumulative_local_expert_recv_stats must have dtype int32"),
    ("stats wrong shape", lambda c: c.dispatch(cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int32)),
     ValueError, r"cumulative_local_expert_recv_stats must have shape \[4\]"),
    ("no-sync dispatch without num_max_tokens_per_rank",
     lambda c: c.other_buf.dispatch(c.x, c.idx, num_experts=E, do_cpu_sync=False), ValueError,
     "needs num_max_tokens_per_rank"),
    # ---- dispatch: handles
    ("handle of another buffer", lambda c: c.dispatch(topk_idx=None, topk_weights=None, num_experts=None,
                                                      handle=c.foreign_handle), ValueError, "made by ElasticBuffer #"),
    ("handle of the reference", lambda c: c.dispatch(topk_idx=None, topk_weights=None, num_experts=None,
                                                     handle=c.ref_handle), ValueError, "deep_ep.reference"),
    ("handle not an EPHandle", lambda c: c.dispatch(topk_idx=None, topk_weights=None, handle=(1, 2)),
     TypeError, "handle must be an EPHandle"),
    ("handle plus topk_idx", lambda c: c.dispatch(handle=c.handle, topk_weights=None, num_experts=None),
     ValueError, "takes no topk_idx"),
    ("handle with other x rows", lambda c: c.dispatch(x=c.x[:-1], topk_idx=None, topk_weights=None,
                                                      num_experts=None, handle=c.handle),
     ValueError, r"handle's shape \[6, 256\]"),
    ("handle with other num_experts", lambda c: c.dispatch(topk_idx=None, topk_weights=None, num_experts=16,
                                                           handle=c.handle), ValueError, "num_experts=16 does not match"),
    ("handle with other alignment", lambda c: c.dispatch(topk_idx=None, topk_weights=None, num_experts=None,
                                                         expert_alignment=8, handle=c.xhandle),
     ValueError, "expert_alignment=8 does not match"),
    ("handle with do_cpu_sync", lambda c: c.dispatch(topk_idx=None, topk_weights=None, num_experts=None,
                                                     handle=c.handle, do_cpu_sync=True), ValueError, "never synchronises"),
    ("cached topk_weights wrong shape", lambda c: c.dispatch(topk_idx=None, topk_weights=c.w[:, :2], num_experts=None,
                                                             handle=c.handle),
     ValueError, r"topk_weights must have shape \[6, 4\]"),
    ("expanded cached dispatch of a flat handle",
     lambda c: c.dispatch(topk_idx=None, topk_weights=None, num_experts=None, handle=c.handle, do_expand=True),
     ValueError, "non-expanded dispatch"),
    # ---- combine
    ("combine x wrong rows", lambda c: c.combine(x=c.y[:-1]), ValueError, r"x must have shape"),
    ("combine x float32", lambda c: c.combine(x=c.y.float()), TypeError, "x must have dtype bfloat16"),
    ("combine x fp8 tuple", lambda c: c.combine(x=c.fp8()), TypeError, "not an FP8 tuple"),
    ("combine x non-contiguous", lambda c: c.combine(x=_noncontig(tuple(c.y.shape), torch.bfloat16)),
     ValueError, "contiguous"),
    ("combine handle None", lambda c: c.combine(handle=None), TypeError, "EPHandle"),
    ("combine handle of another buffer", lambda c: c.combine(handle=c.foreign_handle), ValueError, "made by ElasticBuffer"),
    ("combine expanded handle, flat x rows", lambda c: c.combine(handle=c.xhandle)
     if c.xhandle.num_recv_rows != c.y.shape[0] else c.combine(x=c.y[:-1], handle=c.xhandle),
     ValueError, "x must have shape"),
    ("combine topk_weights wrong shape", lambda c: c.combine(topk_weights=torch.zeros(c.y.shape[0]) ),
     ValueError, r"topk_weights must have shape \[\d+, 4\]"),
    ("bias wrong shape", lambda c: c.combine(bias=torch.zeros(T, H + 1, dtype=torch.bfloat16)), ValueError,
     r"bias\[0\] must have shape \[6, 256\]"),
    ("bias wrong dtype", lambda c: c.combine(bias=torch.zeros(T, H)), TypeError, r"bias\[0\] must have dtype bfloat16"),
    ("second bias wrong shape", lambda c: c.combine(bias=(torch.zeros(T, H, dtype=torch.bfloat16),
                                                          torch.zeros(T - 1, H, dtype=torch.bfloat16))),
     ValueError, r"bias\[1\] must have shape"),
    ("three biases", lambda c: c.combine(bias=(None, None, None)), ValueError, "at most two"),
    ("bias int", lambda c: c.combine(bias=3), TypeError, "bias must be None, a tensor or a tuple"),
    ("bias non-contiguous", lambda c: c.combine(bias=_noncontig((T, H), torch.bfloat16)), ValueError, "contiguous"),
    ("combine num_sms float", lambda c: c.combine(num_sms=1.0), TypeError, "num_sms must be an int"),
    ("combine num_qps above the allocated", lambda c: c.combine(num_qps=3), ValueError, "num_allocated_qps=0"),
    ("combine apply_dispatch_weights 2", lambda c: c.combine(apply_dispatch_weights=2), TypeError,
     "apply_dispatch_weights must be a bool"),
    ("combine apply_dispatch_weights, flat handle", lambda c: c.combine(apply_dispatch_weights=True), ValueError,
     "needs an expanded handle"),
    ("combine apply_dispatch_weights without dispatch weights",
     lambda c: c.combine(x=torch.zeros(c.xhandle_nw.num_recv_rows, H, dtype=torch.bfloat16), handle=c.xhandle_nw,
                         apply_dispatch_weights=True), ValueError, "whose dispatch had topk_weights"),
    ("expanded combine weights without multiple reduction",
     lambda c: c.single_buf.combine(torch.zeros(c.single_handle.num_recv_rows, H, dtype=torch.bfloat16),
                                    c.single_handle, topk_weights=torch.zeros(c.single_handle.num_recv_rows)),
     ValueError, "allow_multiple_reduction=True"),
    # ---- constructor, sizes, topology
    ("ctor negative max tokens", lambda c: _new_buffer(c, num_max_tokens_per_rank=-1), ValueError, ">= 0"),
    ("ctor hidden str", lambda c: _new_buffer(c, hidden="7168"), TypeError, "hidden must be an int"),
    ("ctor timeout zero", lambda c: _new_buffer(c, num_cpu_timeout_secs=0), ValueError, "num_cpu_timeout_secs must be > 0"),
    ("ctor timeout infinite", lambda c: _new_buffer(c, num_gpu_timeout_secs=float("inf")), ValueError,
     "num_gpu_timeout_secs must be finite"),
    ("ctor flag 2", lambda c: _new_buffer(c, deterministic=2), TypeError, "deterministic must be a bool"),
    ("ctor flag None", lambda c: _new_buffer(c, explicitly_destroy=None), TypeError,
     "explicitly_destroy must be a bool"),
    ("ctor fp8 hidden", lambda c: _new_buffer(c, hidden=100, use_fp8_dispatch=True), ValueError, "multiple of 128"),
    ("ctor num_bytes negative", lambda c: _new_buffer(c, -5), ValueError, "num_bytes must be >= 0"),
    ("ctor bad group", lambda c: __import__("deep_ep").ElasticBuffer(object()), TypeError, "ProcessGroup"),
    ("ctor sl_idx 16", lambda c: _new_buffer(c, sl_idx=16), ValueError, "sl_idx must be <= 15"),
    ("ctor num_cpu_bytes unaligned", lambda c: _new_buffer(c, num_cpu_bytes=4096), ValueError, "multiple of 2 MiB"),
    ("ctor num_allocated_qps negative", lambda c: _new_buffer(c, num_allocated_qps=-1), ValueError,
     "num_allocated_qps must be >= 0"),
    ("ctor num_allocated_qps float", lambda c: _new_buffer(c, num_allocated_qps=2.0), TypeError,
     "num_allocated_qps must be an int"),
    ("size hint negative", lambda c: c.buf.get_buffer_size_hint(dist.group.WORLD, -1, H), ValueError, ">= 0"),
    ("size hint fp8 hidden", lambda c: c.buf.get_buffer_size_hint(dist.group.WORLD, M, 100, 0, True),
     ValueError, "multiple of 128"),
    ("theoretical sms zero experts", lambda c: c.buf.get_theoretical_num_sms(0, 8), ValueError, ">= 1"),
    ("theoretical sms experts not divisible", lambda c: c.buf.get_theoretical_num_sms(7, 2), ValueError, "divisible"),
    ("theoretical sms top-k above experts", lambda c: c.buf.get_theoretical_num_sms(8, 9), ValueError,
     "num_topk must be <= 8"),
    ("theoretical sms scale-out top-k", lambda c: c.buf.get_theoretical_num_sms(8, 2, 1), ValueError,
     "num_scaleout_topk is reserved"),
    ("theoretical sms read rate zero", lambda c: c.buf.get_theoretical_num_sms(8, 2, sm_read_gbs=0), ValueError,
     "sm_read_gbs must be > 0"),
    ("theoretical sms nvlink negative", lambda c: c.buf.get_theoretical_num_sms(8, 2, nvlink_gbs=-1), ValueError,
     "nvlink_gbs must be >= 0"),
    ("theoretical qps negative", lambda c: c.buf.get_theoretical_num_qps(-1), ValueError, "num_sms must be >= 0"),
    ("barrier flag str", lambda c: c.buf.barrier(with_cpu_sync="yes"), TypeError, "with_cpu_sync must be a bool"),
    ("logical domain flag -1", lambda c: __import__("deep_ep").get_logical_domain_size(dist.group.WORLD, -1),
     TypeError, "allow_hybrid_mode must be a bool"),
    ("physical domain bad group", lambda c: __import__("deep_ep").get_physical_domain_size(3), TypeError,
     "ProcessGroup"),
]


def _cross_rank_table():
    """Rows: (name, call(c) -> result, regex). Each rank's arguments are valid alone."""
    return [
        ("ranks disagree on num_experts", lambda c: c.dispatch(num_experts=8 if c.rank == 0 else 16),
         r"disagree on num_experts: per-rank values \[8, 16\]"),
        ("ranks disagree on layout", lambda c: c.dispatch(do_expand=c.rank == 0), "disagree on do_expand"),
        ("ranks disagree on x format", lambda c: c.dispatch(x=c.fp8() if c.rank == 0 else c.x),
         "disagree on x format"),
        ("ranks disagree on max tokens (no-sync sizes)",
         lambda c: c.dispatch(num_max_tokens_per_rank=M - c.rank, do_cpu_sync=False),
         r"num_max_tokens_per_rank .*\[12, 11\]"),
        ("ranks call different operations",
         lambda c: c.dispatch() if c.rank == 0 else c.combine(), "different operations"),
        ("handles from different dispatches",
         lambda c: c.combine(handle=c.handle if c.rank == 0 else c.xhandle,
                             x=torch.zeros((c.handle if c.rank == 0 else c.xhandle).num_recv_rows, H,
                                           dtype=torch.bfloat16)),
         r"disagree on do_expand"),
        ("handles from different routings",
         lambda c: c.combine(handle=c.handle if c.rank == 0 else c.skewed_handle,
                             x=torch.zeros((c.handle if c.rank == 0 else c.skewed_handle).num_recv_rows, H,
                                           dtype=torch.bfloat16)),
         r"handles do not match across ranks"),
    ]


def _good_round(c):
    recv_x, _, _, h, _ = c.dispatch()
    out = c.buf.combine(recv_x, h)[0]
    assert out.shape == (T, H)


def _worker(rank, world_size):
    from deep_ep import ElasticBuffer
    buf = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=512, num_topk=8)
    other = ElasticBuffer(dist.group.WORLD)
    single = ElasticBuffer(dist.group.WORLD, allow_multiple_reduction=False)
    c = _Ctx(buf, other, single, rank)
    calls = []
    for name in ("dispatch", "combine", "barrier"):
        real = getattr(buf._backend, name)
        setattr(buf._backend, name, (lambda real, name: lambda *a, **k: (calls.append(name), real(*a, **k))[1])(real, name))
    failures = []
    for name, call, exc_type, pattern in BAD_INPUTS:
        calls.clear()
        try:
            call(c)
            failures.append(f"{name}: no exception")
        except Exception as exc:  # noqa: BLE001 - we check the type below
            if type(exc) is not exc_type or not re.search(pattern, str(exc)):
                failures.append(f"{name}: got {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        if calls:
            failures.append(f"{name}: the backend was called ({calls}) before the error")
        _good_round(c)
    for name, call, pattern in _cross_rank_table():
        try:
            call(c)
            failures.append(f"{name}: no exception")
        except RuntimeError as exc:
            if not re.search(pattern, str(exc)):
                failures.append(f"{name}: message {exc}")
        _good_round(c)
    buf.destroy()
    for call in (lambda: c.dispatch(), lambda: c.combine(), buf.barrier):
        with pytest.raises(RuntimeError, match="destroyed"):
            call()
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    other.destroy()
    single.destroy()


def test_bad_input_table(tmp_path):
    run_gloo_ranks(_worker, 2, tmp_path, deadline=180)
