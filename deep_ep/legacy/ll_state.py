"""The state and checks behind DeepEP's V1 low-latency methods (`deep_ep.legacy.low_latency`, which
inherits them): argument checks, the window of each buffer half, the pending receive hooks (double
buffering), the zero-copy combine buffers, the rank mask.

Contract: two buffer halves. A low-latency dispatch takes one no pending receive hook holds,
preferring one whose last dispatch was combined (`_free_half`; every rank makes the same calls and hooks, so every rank takes the same), its
combine takes the dispatch's; a call with a receive hook holds its half until the hook is called
(`_hook`); a call that raises before returning its hook holds nothing (`release_on_error`). On
the GPU each half is a window of its own (`_low_latency_elastic_buffer`): half 0 the low-latency
window made with the Buffer when it holds the call, half 1 one made on its first use (collective). Across nodes
every low-latency window is in direct mode with ``num_qps_per_rank`` QPs (`deep_ep.legacy.internode`;
the Buffer's own is then in hybrid mode); on the CPU backend both halves then use the Buffer's
direct-mode `ElasticBuffer`.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import checks
from . import ll_layout, ll_reduce
from .deferred import launch_receive, num_sends, sent_since
from .layouts import NUM_CHANNELS_PER_SCALE, ReceiveHook, low_latency_rdma_size_hint

__all__ = ["LowLatencyState", "release_on_error"]

# The attributes holding a low-latency window of each buffer half (half 0's made with the Buffer,
# or, within one node with num_nvl_bytes=0, the Buffer's own).
_HALF_BUFFERS = ("_low_latency_extra_buffer", "_low_latency_second_buffer")


def release_on_error(method):
    """Wrap a low-latency call (a method of `LowLatencyState`) so that, when it raises, the buffer
    halves it took are free again: a half its hook was to hold, and the window its send half holds
    on the GPU, whose receive is launched (the peers sent their rows to this call; the receive
    keeps the window in step with theirs). The exception is raised as it was."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        pending_before, sends_before = list(self._pending_hooks()), num_sends()
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            pending = self._pending_hooks()
            for slot, holder in enumerate(pending_before):
                if holder is None:
                    pending[slot] = None
            for buffer, deferred in sent_since(sends_before):
                try:
                    launch_receive(buffer, deferred)   # frees the window first, whatever follows
                except Exception:   # the call's own error is the one to raise
                    pass
            raise
    return call


class LowLatencyState:
    """Helpers of `deep_ep.legacy.low_latency.LowLatencyMethods` (a mixin of `deep_ep.Buffer`)."""

    def _low_latency_check(self, name: str, num_max_dispatch_tokens_per_rank: int, hidden: int,
                           num_experts: int) -> None:
        self._alive()
        if not self.low_latency_mode:
            raise RuntimeError(f"deep_ep.Buffer.{name} needs a Buffer made with low_latency_mode=True")
        checks.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
        checks.check_int("num_experts", num_experts, minimum=1)
        if hidden <= 0 or hidden % NUM_CHANNELS_PER_SCALE:
            raise ValueError(f"{name}: hidden={hidden} must be a positive multiple of {NUM_CHANNELS_PER_SCALE}")
        if num_experts % self.group_size:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the group size {self.group_size}")
        need = low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
        if need > self.num_rdma_bytes:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is less than the {need} bytes low-latency mode "
                             f"needs here (get_low_latency_rdma_size_hint({num_max_dispatch_tokens_per_rank}, "
                             f"{hidden}, {self.group_size}, {num_experts})); pass at least that as num_rdma_bytes")

    def _low_latency_elastic_buffer(self, max_pairs: int, hidden: int, slot: int = 0):
        """The `ElasticBuffer` a low-latency call of up to ``max_pairs`` (token, expert) pairs per rank
        at ``hidden`` runs on in buffer half ``slot``: the Buffer's own on CPU (both halves; across
        nodes its direct-mode one); on the GPU for half 0 the low-latency window made with the Buffer
        when it holds the call (within one node the Buffer's own when ``num_nvl_bytes`` is 0,
        `deep_ep.legacy.internode.open_elastic_buffers`); else one sized for the call (one per half),
        made here (collective: every rank makes the same calls; not while a CUDA graph is being
        captured) and kept for later calls."""
        buffer = self._alive()
        if buffer.device.type == "cpu":
            return buffer if self._low_latency_cpu_buffer is None else self._low_latency_cpu_buffer
        from ..backends.gpu import window
        need = window.buffer_size_hint(self.group_size, max_pairs, hidden, 0, False)
        if slot == 0 and self.num_rdma_ranks == 1 and self.num_nvl_bytes == 0 and buffer.num_bytes >= need:
            return buffer   # its one window is the low-latency one (across nodes the Buffer's is hybrid)
        key = _HALF_BUFFERS[slot]
        extra = self.__dict__.get(key)
        if extra is not None and extra.num_bytes >= need:
            return extra
        if torch.cuda.is_current_stream_capturing():
            have = (extra or buffer).num_bytes
            why = (f"a {need}-byte window, larger than its low-latency window's {have}" if extra is not None or slot == 0
                   else "the second window of double buffering (two low-latency results alive)")
            raise RuntimeError(f"deep_ep.Buffer: this low-latency call needs {why}; make the first such call before "
                               f"CUDA-graph capture (or pass a larger num_rdma_bytes)")
        from ..buffer import ElasticBuffer
        if extra is not None:
            extra.destroy()
        extra = ElasticBuffer(self.group, num_bytes=need, explicitly_destroy=self.explicitly_destroy,
                              **self._low_latency_options)
        self.__dict__[key] = extra
        return extra

    def _load_low_latency_kernels(self, device: torch.device) -> None:
        """Load the layout and reduce kernels on a CUDA ``device`` before the call's first launch (and
        before any graph capture; nothing during one). A module load waits for the device to drain,
        so emulated ranks, whose kernels wait on each other, load together the first time (the
        group's ``load_collectively``: every rank's Buffer makes its first low-latency dispatch at
        the same call); elsewhere each call checks (a dict read once loaded)."""
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        load_collectively = getattr(self.group, "load_collectively", None)
        if load_collectively is None:
            ll_reduce.load_kernel(device)
            ll_layout.load_kernels(device)
        elif not self.__dict__.get("_low_latency_kernels_loaded"):
            load_collectively(("deep_ep_ll_kernels", device.index),
                              lambda: (ll_reduce.load_kernel(device), ll_layout.load_kernels(device)))
            self.__dict__["_low_latency_kernels_loaded"] = True

    def _low_latency_buffers(self) -> list:
        """The `ElasticBuffer` objects low-latency calls may have run on."""
        keys = _HALF_BUFFERS + ("_low_latency_cpu_buffer",)
        return [b for b in [self._alive()] + [self.__dict__.get(key) for key in keys] if b is not None]

    def _pending_hooks(self) -> list:
        """Per buffer half, the name of the call whose receive hook is pending there, or None."""
        return self.__dict__.setdefault("_low_latency_pending", [None, None])

    def _refuse_hooks_over_gin(self, return_recv_hook: bool) -> None:
        """Receive hooks split a call's data kernel in two launches, which the GIN transport (emulated
        nodes) does not support yet: refused before anything is sent."""
        if return_recv_hook and getattr(self._alive()._backend, "transport_gin", False):
            raise NotImplementedError("deep_ep.Buffer: return_recv_hook=True over the GIN transport (ranks on "
                                      "several nodes) is not implemented yet; call without a receive hook")

    def _uncombined(self) -> list:
        """Per buffer half, the number of the last dispatch there while it waits for its combine, or None."""
        return self.__dict__.setdefault("_low_latency_uncombined", [None, None])

    def _mark_dispatched(self, half: int) -> int:
        """Number this rank's low-latency dispatch on ``half`` (its handle keeps the number) and
        mark the half as waiting for that dispatch's combine."""
        number = self.__dict__.get("_low_latency_dispatches", 0) + 1
        self.__dict__["_low_latency_dispatches"] = number
        self._uncombined()[half] = number
        return number

    def _mark_combined(self, handle) -> None:
        uncombined = self._uncombined()
        if uncombined[handle.slot] == getattr(handle, "number", None):
            uncombined[handle.slot] = None

    def _free_half(self, name: str) -> int:
        """A buffer half no pending receive hook holds, preferring one whose last dispatch was
        combined, so that two micro-batches' dispatch-then-combine sequences interleave (every rank
        makes the same calls and hooks, so every rank picks the same).

        Raises:
            RuntimeError: both are held (two low-latency results alive).
        """
        pending, uncombined = self._pending_hooks(), self._uncombined()
        free = [slot for slot, holder in enumerate(pending) if holder is None]
        for slot in free:
            if uncombined[slot] is None:
                return slot
        if free:
            return free[0]
        raise RuntimeError(f"deep_ep.Buffer.{name}: two low-latency results are alive, the receive hooks of a "
                           f"{pending[0]} and a {pending[1]} were not called yet: at most two can be (DeepEP's "
                           f"double buffering); call one of those hooks first. Nothing was sent")

    def _hook(self, receive, name: str, device: torch.device, slot: int, also_release=None) -> ReceiveHook:
        """A `ReceiveHook` for ``receive`` that holds buffer half ``slot`` until it is called (then runs
        ``also_release`` too, if given)."""
        pending = self._pending_hooks()

        def release() -> None:
            pending[slot] = None
            if also_release is not None:
                also_release()

        hook = ReceiveHook(receive, name, device, release)
        pending[slot] = name
        return hook

    def _receive_or_hook(self, receive, name: str, device: torch.device, slot: int,
                         return_recv_hook: bool, also_release=None) -> Optional[ReceiveHook]:
        """The end of a low-latency call whose send is launched: the next call gets the other
        zero-copy combine buffer; then with ``return_recv_hook`` the `ReceiveHook` that runs
        ``receive`` (holding buffer half ``slot`` until it is called), else ``receive`` runs now and
        None comes back."""
        self._flip()
        if return_recv_hook:
            return self._hook(receive, name, device, slot, also_release)
        receive()
        return None

    def _combine_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> torch.Tensor:
        """The current (of two) zero-copy combine buffer: bf16 ``[L, R*T, hidden]`` with DeepEP's row
        stride (``hidden`` plus two bf16 per 128 channels), on the buffer's device."""
        key = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        state = self.__dict__.setdefault("_low_latency_state", {"index": 0, "key": None, "buffers": None})
        if state["key"] != key:
            num_rows = self.group_size * num_max_dispatch_tokens_per_rank
            num_local_experts = num_experts // self.group_size
            row = hidden + 2 * (hidden // NUM_CHANNELS_PER_SCALE)
            state["buffers"] = [torch.zeros((num_local_experts, num_rows, row), dtype=torch.bfloat16,
                                            device=self._alive().device) for _ in range(2)]
            state["key"] = key
        return state["buffers"][state["index"]][:, :, :hidden]

    def _flip(self) -> None:
        state = self.__dict__.setdefault("_low_latency_state", {"index": 0, "key": None, "buffers": None})
        state["index"] ^= 1

    @staticmethod
    def _hook_flags(async_finish, return_recv_hook) -> tuple:
        async_finish = checks.check_bool("async_finish", async_finish)
        return_recv_hook = checks.check_bool("return_recv_hook", return_recv_hook)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (DeepEP's rule)")
        return async_finish, return_recv_hook

    def _check_stats(self, name: str, stats, dtype, size: int) -> None:
        if stats is not None:
            checks.check_tensor(name, stats, dtype=dtype, shape=(size,), device=self._alive().device)

    def _low_latency_num_sms(self, device: torch.device) -> int:
        return 0 if device.type == "cpu" else type(self).num_sms

    def _mask_if_shrink(self) -> Optional[torch.Tensor]:
        """The rank mask (int32 ``[R]``, 1 = masked, made with the `Buffer`) with ``enable_shrink``, else None."""
        return self._rank_mask if self.enable_shrink else None

    def _shrink_mask(self, name: str) -> torch.Tensor:
        self._alive()
        if not self.enable_shrink:
            raise RuntimeError(f"deep_ep.Buffer.{name} needs a Buffer made with enable_shrink=True")
        return self._mask_if_shrink()
