"""DeepEP's V1 ``Buffer`` over `ElasticBuffer` objects: normal mode, within a node or across nodes
(`deep_ep.legacy.internode`), and low-latency mode (`deep_ep.legacy.low_latency`)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import checks
from ..backends import group_rank_and_size
from ..buffer import ElasticBuffer
from ..event import EventHandle, EventOverlap, cuda_event_of
from .config import COMBINE_CONFIGS, DISPATCH_CONFIGS, Config, recommended_config
from .exchange import exchange_metadata, rank_routing, reduce_weights_back, settle
from .handle import LegacyHandle
from .internode import (InternodeMethods, build_handle, node_bits, normal_mode_buffer, open_elastic_buffers,
                        rdma_channel_prefix, rdma_counts)
from .low_latency import LowLatencyMethods
from .planned import planned, refuse_side_keywords

__all__ = ["Buffer"]


class Buffer(LowLatencyMethods, InternodeMethods):
    """DeepEP's V1 communication buffer (docs/design.md, "DeepEP's V1 Buffer"; across nodes,
    docs/design.md "DeepEP's V1 Buffer across nodes"); `ElasticBuffer` objects do the communication.

    Args (DeepEP's, in its order):
        group: the ranks; None needs ``comm``. Where torch sees a CUDA device the Buffer runs on the GPU
            whatever the group's backend (a gloo group gets a private NCCL communicator: vLLM passes its
            CPU group with GPU tensors); without CUDA, or with ``device="cpu"``, a gloo group runs on CPU
            tensors (`deep_ep.ElasticBuffer`, docs/design.md "Which backend").
        num_nvl_bytes: the GPU window per rank (`Config.get_nvl_buffer_size_hint`); unused on CPU.
        num_rdma_bytes: in low-latency mode, at least `get_low_latency_rdma_size_hint` of the calls
            made; outside it, stored (deep_ep's normal mode needs no RDMA buffer of its own).
        low_latency_mode: enables `low_latency_dispatch` / `low_latency_combine`. On the GPU within
            one node normal-mode calls use a window of ``num_nvl_bytes`` and low-latency calls one of
            ``num_rdma_bytes`` (each rounded up to 2 MiB), as DeepEP's two buffers; with
            ``num_nvl_bytes=0`` low-latency calls use the Buffer's one window and normal-mode calls
            raise (`deep_ep.legacy.internode.normal_mode_buffer`).
        num_qps_per_rank: RDMA QPs per peer (>= 1 in low-latency mode or across nodes): across
            nodes, the ``num_allocated_qps`` of the direct-mode `ElasticBuffer` low-latency calls run on.
        allow_nvlink_for_low_latency_mode, allow_mnnvl: validated and stored.
        explicitly_destroy: resources are released by `destroy()` only.
        enable_shrink: keep a rank mask for low-latency mode (`low_latency_update_mask_buffer`).
        comm: an ``mpi4py`` communicator instead of ``group``: NotImplementedError.
        use_fabric, allow_nvlink_for_normal_mode, eager_support: keywords of DeepEP's side branches
            (keyword-only here): only their defaults (False, True, False), else NotImplementedError.
        device: (deep_ep's extension, keyword-only) None (automatic, as above), ``"cpu"`` or ``"cuda"``:
            the backend, as `deep_ep.ElasticBuffer`'s ``device``.
        num_cpu_timeout_secs, num_gpu_timeout_secs: (deep_ep's extensions, keyword-only) seconds before
            a host wait / a GPU kernel gives up on a peer and raises TimeoutError naming it (defaults
            300 and 100, `deep_ep.ElasticBuffer`'s): a rank whose call was refused leaves its peers
            waiting that long, so tests pass smaller values.

    Attributes: ``num_sms`` (class-wide, `set_num_sms`), ``rank``, ``group_size``, ``group``,
    ``num_nvl_bytes``, ``num_rdma_bytes``, ``low_latency_mode``, ``explicitly_destroy``,
    ``enable_shrink``, ``num_rdma_ranks`` / ``num_nvl_ranks`` (nodes, ranks per node: the group's
    domains), ``elastic_buffer`` (the `ElasticBuffer` of normal mode).

    Raises:
        ValueError: neither ``group`` nor ``comm``; TypeError / ValueError: bad arguments;
        NotImplementedError: ``comm``, an NVLink domain of more than 8 ranks (`deep_ep.legacy.internode`).
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, *, use_fabric: bool = False, allow_nvlink_for_normal_mode: bool = True,
                 eager_support: bool = False, device=None, num_cpu_timeout_secs: float = 300,
                 num_gpu_timeout_secs: float = 100) -> None:
        self.elastic_buffer = None
        refuse_side_keywords("__init__", {"use_fabric": use_fabric, "eager_support": eager_support,
                                          "allow_nvlink_for_normal_mode": allow_nvlink_for_normal_mode})
        timeouts = dict(num_cpu_timeout_secs=checks.check_number("num_cpu_timeout_secs", num_cpu_timeout_secs),
                        num_gpu_timeout_secs=checks.check_number("num_gpu_timeout_secs", num_gpu_timeout_secs))
        if group is None:
            if comm is None:
                raise ValueError("deep_ep.Buffer: either 'group' or 'comm' must be provided")
            planned("__init__(comm=...)", "mpi4py communicators")
        checks.check_int("num_nvl_bytes", num_nvl_bytes, minimum=0, maximum=None)
        checks.check_int("num_rdma_bytes", num_rdma_bytes, minimum=0, maximum=None)
        checks.check_int("num_qps_per_rank", num_qps_per_rank, minimum=0)
        low_latency_mode = checks.check_bool("low_latency_mode", low_latency_mode)
        allow_nvlink_for_low_latency_mode = checks.check_bool("allow_nvlink_for_low_latency_mode",
                                                              allow_nvlink_for_low_latency_mode)
        allow_mnnvl = checks.check_bool("allow_mnnvl", allow_mnnvl)
        explicitly_destroy = checks.check_bool("explicitly_destroy", explicitly_destroy)
        enable_shrink = checks.check_bool("enable_shrink", enable_shrink)
        rank, group_size = group_rank_and_size(group)
        self.rank = rank
        self.group = group
        self.group_size = group_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        open_elastic_buffers(self, group, num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, low_latency_mode,
                             explicitly_destroy, device, timeouts)
        if enable_shrink:   # made and zeroed here: made in a CUDA-graph capture, replays would zero it
            # the rank mask, then the ranks taken as failed (a timeout of the direct kernels)
            self._rank_state = torch.zeros(2 * group_size, dtype=torch.int32, device=self.elastic_buffer.device)
            self._rank_mask = self._rank_state[:group_size]

    # ------------------------------------------------------------------ lifecycle, settings
    def _alive(self) -> ElasticBuffer:
        if self.elastic_buffer is None or self.elastic_buffer.is_destroyed:
            raise RuntimeError("deep_ep.Buffer was destroyed; create a new one")
        return self.elastic_buffer

    @property
    def runtime(self):
        """The object doing the work (DeepEP's C++ runtime; here the `ElasticBuffer`); None once destroyed."""
        return self.elastic_buffer

    def destroy(self) -> None:
        """Release the resources (collective on GPU); every other method then raises RuntimeError.

        Raises:
            RuntimeError: the buffer was made without ``explicitly_destroy`` (DeepEP's rule: it is then
            released when collected).
        """
        if not self.explicitly_destroy:
            raise RuntimeError("deep_ep.Buffer.destroy: `explicitly_destroy` flag must be set: create the Buffer "
                               "with explicitly_destroy=True to release it with destroy(); without it, it is "
                               "released when garbage-collected")
        if self.elastic_buffer is not None:
            self.elastic_buffer.destroy()
            self.elastic_buffer = None
        for key in ("_low_latency_extra_buffer", "_low_latency_second_buffer", "_low_latency_cpu_buffer",
                    "_ll_direct_window"):
            extra = self.__dict__.pop(key, None)
            if extra is not None:
                extra.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether FP8 (SM90) paths are available: always True (NVRTC builds them for the device)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the class-wide SM count of the default configs (even, >= 0).

        Raises:
            TypeError: not an int. ValueError: odd or negative.
        """
        checks.check_int("new_num_sms", new_num_sms, minimum=0)
        if new_num_sms % 2:
            raise ValueError(f"The SM count must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An `EventOverlap` holding an `EventHandle` recorded on the current CUDA stream (a no-op one
        where the process has no CUDA work, e.g. on CPU), for ``previous_event``."""
        return EventOverlap(EventHandle())

    def get_comm_stream(self):
        """The communication stream (a ``torch.cuda.Stream``), or None on CPU."""
        return self._alive().get_comm_stream()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The recommended dispatch `Config` for ``num_ranks`` (DeepEP's table, with `Buffer.num_sms`).

        Raises:
            ValueError: a rank count outside DeepEP's table (2, 4, 8, 16, ..., 160).
        """
        return recommended_config(DISPATCH_CONFIGS, num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The recommended combine `Config` for ``num_ranks`` (DeepEP's table, with `Buffer.num_sms`).

        Raises:
            ValueError: a rank count outside DeepEP's table.
        """
        return recommended_config(COMBINE_CONFIGS, num_ranks, Buffer.num_sms)

    # ------------------------------------------------------------------ helpers
    def _device(self) -> torch.device:
        return self._alive().device

    def _default_config(self, table) -> Config:
        # DeepEP's tables start at 2 ranks; a rank alone takes the default chunk sizes
        return table(self.group_size) if self.group_size > 1 else Config(Buffer.num_sms)

    @staticmethod
    def _flags(async_finish, allocate_on_comm_stream, previous_event) -> bool:
        async_finish = checks.check_bool("async_finish", async_finish)
        checks.check_bool("allocate_on_comm_stream", allocate_on_comm_stream)
        checks.check_event("previous_event", previous_event)
        return async_finish

    @staticmethod
    def _wait(previous_event) -> None:
        # Work done here with torch runs on the current stream: it waits for the event first.
        event = cuda_event_of(previous_event)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    @staticmethod
    def _finish(async_finish: bool, tensors: tuple) -> EventOverlap:
        # Every call ends on the current stream: the event marks that point (no-op on CPU).
        return EventOverlap(EventHandle(), tensors) if async_finish else EventOverlap()

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """The routing a `dispatch` needs, from ``topk_idx`` (no communication; torch on its device).

        Args:
            topk_idx: `deep_ep.topk_idx_t` (int64) ``[T, K]`` expert ids in ``[0, num_experts)`` or -1.
            num_experts: E, a multiple of the group size.
            previous_event: an `EventOverlap` / `EventHandle` the work waits for. async_finish: return
                an event marking the end. allocate_on_comm_stream: accepted (flag).

        Returns:
            ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank (int32 [nodes], tokens going to
            each node, once per node; None on one node), num_tokens_per_expert int32 [E] (one count
            per top-k slot), is_token_in_rank bool [T, R], event)``.

        Raises:
            TypeError / ValueError: bad arguments or expert ids.
        """
        device = self._device()
        async_finish = self._flags(async_finish, allocate_on_comm_stream, previous_event)
        checks.check_int("num_experts", num_experts, minimum=1)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the group size {self.group_size}")
        checks.check_tensor("topk_idx", topk_idx, dtype=checks.topk_idx_t, shape=(None, None), device=device)
        checks.check_topk_values(topk_idx, num_experts)
        self._wait(previous_event)
        num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = self._layout(topk_idx, num_experts)
        per_rdma_rank = rdma_counts(is_token_in_rank, self.num_rdma_ranks) if self.num_rdma_ranks > 1 else None
        event = self._finish(async_finish, (topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank))
        return num_tokens_per_rank, per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event

    def _layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple:
        # device ops only (no host read): masked slots add 0 to expert 0
        num_local_experts = num_experts // self.group_size
        valid = topk_idx >= 0
        num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device).index_add_(
            0, topk_idx.clamp(min=0).flatten(), valid.flatten().to(torch.int32))
        owner = torch.where(valid, topk_idx // num_local_experts, self.group_size)
        is_token_in_rank = torch.zeros((topk_idx.shape[0], self.group_size + 1), dtype=torch.bool,
                                       device=topk_idx.device)
        is_token_in_rank.scatter_(1, owner, True)
        is_token_in_rank = is_token_in_rank[:, :self.group_size].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, handle: Optional[tuple] = None, num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send every token to the ranks in its row of ``is_token_in_rank`` (collective).

        Args:
            x: bf16 ``[T, H]``, or ``(float8_e4m3fn [T, H], float32 [T, H/128])`` (H a multiple of 128).
            handle: a `LegacyHandle` of an earlier dispatch of this buffer on this rank: a cached
                dispatch (same layout; the routing arguments must then be None).
            num_tokens_per_rank: int32 ``[R]``; is_token_in_rank: bool ``[T, R]``;
                num_tokens_per_expert: int32 ``[E]`` (`get_dispatch_layout`'s; required without ``handle``).
            num_tokens_per_rdma_rank: across nodes, int32 ``[nodes]`` (`get_dispatch_layout`'s;
                required); within one NVLink domain ignored, as DeepEP does.
            topk_idx: optional `topk_idx_t` ``[T, K]`` global expert ids or -1; it must agree with
                ``is_token_in_rank`` and ``num_tokens_per_expert``.
            topk_weights: optional float32 ``[T, K]`` (needs ``topk_idx``).
            expert_alignment: >= 1; the per-expert counts returned are rounded up to it.
            num_worst_tokens: > 0: outputs padded to this many rows (the count list is then []).
            config: a `Config` (default `get_dispatch_config`); its ``num_sms`` is used on the GPU.
            previous_event: an `EventOverlap` / `EventHandle` to wait for. async_finish: return an
                event marking the end. allocate_on_comm_stream: accepted (flag).

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            event)``: ``recv_x`` like ``x`` with one row per received token (source rank order, then
            source token order); ``recv_topk_idx`` int64 ``[rows, K]`` local expert ids, -1 for other
            ranks' experts and past the true count; ``recv_topk_weights`` float32 ``[rows, K]``, 0
            where the id is -1 (both None without ``topk_idx``); the count list ``[E / R]`` ints;
            ``handle`` a `LegacyHandle` (across nodes its 10-item `InternodeHandle`). A cached dispatch
            returns ``(recv_x, None, None, None, None, event)``.

        Raises:
            TypeError / ValueError: bad arguments, routing tensors that disagree, a receive larger than
            ``num_worst_tokens`` (before any communication, except the last, found after it).
        """
        buffer = normal_mode_buffer(self)
        device = buffer.device
        async_finish = self._flags(async_finish, allocate_on_comm_stream, previous_event)
        checks.check_int("expert_alignment", expert_alignment, minimum=1)
        checks.check_int("num_worst_tokens", num_worst_tokens, minimum=0)
        if config is None:
            config = self._default_config(self.get_dispatch_config)
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a deep_ep.Config, got {type(config).__name__}")
        num_sms = 0 if device.type == "cpu" else config.num_sms
        data, sf = checks.check_x(x, device)
        num_tokens = data.shape[0]
        if handle is not None:
            return self._cached_dispatch(buffer, data, sf, handle, num_tokens_per_rank, is_token_in_rank,
                                         num_tokens_per_expert, topk_idx, topk_weights, num_sms, previous_event,
                                         async_finish)
        R = self.group_size
        for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is None:
                raise ValueError(f"deep_ep.Buffer.dispatch: {name} is required without a handle "
                                 f"(get_dispatch_layout gives it)")
        checks.check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(R,), device=device)
        if isinstance(is_token_in_rank, torch.Tensor) and is_token_in_rank.dim() == 2 and \
                is_token_in_rank.shape[0] != num_tokens:   # name both: either may be the one cut wrong
            raise ValueError(f"deep_ep.Buffer.dispatch: x has {num_tokens} tokens but is_token_in_rank (from "
                             f"get_dispatch_layout) has {is_token_in_rank.shape[0]}: they must describe the same "
                             f"tokens")
        checks.check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, R),
                            device=device)
        checks.check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, shape=(None,),
                            device=device)
        if self.num_rdma_ranks > 1:
            checks.check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32,
                                shape=(self.num_rdma_ranks,), device=device)
        num_experts = num_tokens_per_expert.shape[0]
        if num_experts == 0 or num_experts % R:
            raise ValueError(f"num_tokens_per_expert must have a positive multiple of {R} (the group size) "
                             f"entries, got {num_experts}")
        settle(device)
        if not torch.equal(num_tokens_per_rank, is_token_in_rank.sum(0, dtype=torch.int32)):
            raise ValueError("num_tokens_per_rank must be the column sums of is_token_in_rank "
                             "(get_dispatch_layout gives both)")
        if self.num_rdma_ranks > 1 and not torch.equal(num_tokens_per_rdma_rank,
                                                       rdma_counts(is_token_in_rank, self.num_rdma_ranks)):
            raise ValueError("num_tokens_per_rdma_rank does not match is_token_in_rank "
                             "(get_dispatch_layout gives both)")
        if topk_idx is None:
            if topk_weights is not None:
                raise ValueError("topk_weights needs topk_idx")
        else:
            checks.check_tensor("topk_idx", topk_idx, dtype=checks.topk_idx_t, shape=(num_tokens, None),
                                device=device)
            if topk_idx.shape[1] == 0:
                raise ValueError("topk_idx must have at least one column")
            checks.check_topk_values(topk_idx, num_experts)
            if topk_weights is not None:
                checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape),
                                    device=device)
            _, want_per_expert, want_in_rank = self._layout(topk_idx, num_experts)
            if not torch.equal(want_in_rank, is_token_in_rank):
                raise ValueError("is_token_in_rank does not match topk_idx (a token goes to the ranks owning "
                                 "its experts; get_dispatch_layout gives it)")
            if not torch.equal(want_per_expert, num_tokens_per_expert):
                raise ValueError("num_tokens_per_expert does not match topk_idx (get_dispatch_layout gives it)")
        self._wait(previous_event)

        # The data, then the top-k ids, weights and the counts every rank needs (DeepEP's notify
        # step), in the same order (`deep_ep.legacy.exchange`).
        L = num_experts // R
        routing = rank_routing(is_token_in_rank, L)
        recv_x, _, _, ep_handle, _ = buffer.dispatch(data if sf is None else (data, sf), topk_idx=routing,
                                                     num_experts=num_experts, num_sms=num_sms)
        settle(device)
        C, N = config.num_channels, self.num_rdma_ranks
        counts = [num_tokens_per_expert.view(R, L), num_tokens_per_rank.unsqueeze(0).expand(R, R),
                  torch.full((R, 1), num_tokens, dtype=torch.int32, device=device)]
        if N > 1:   # each rank's RDMA channel counts of its node, and each token's ranks per node
            counts.append(rdma_channel_prefix(is_token_in_rank, N, C).repeat_interleave(R // N, dim=0))
        recv_topk_idx, recv_topk_weights, counts, bits = exchange_metadata(
            buffer, routing, topk_idx, topk_weights, torch.cat(counts, dim=1), num_experts, num_sms,
            node_bits(is_token_in_rank, N) if N > 1 else None)
        counts = counts.to(torch.int64)                      # by source rank
        per_expert = counts[:, :L].sum(0).tolist()
        sent = counts[:, L:L + R]                            # N[s, d]
        source_tokens = counts[:, L + R].tolist()
        if recv_topk_idx is not None:
            local = (recv_topk_idx >= 0) & (recv_topk_idx // L == self.rank)
            recv_topk_idx = torch.where(local, recv_topk_idx - self.rank * L, -1)
            if recv_topk_weights is not None:
                recv_topk_weights = torch.where(local, recv_topk_weights, 0.0)
        num_recv = ep_handle.num_recv_tokens
        if num_worst_tokens and num_recv > num_worst_tokens:
            raise ValueError(f"deep_ep.Buffer.dispatch: rank {self.rank} received {num_recv} tokens, more than "
                             f"num_worst_tokens={num_worst_tokens}")
        num_rows = num_worst_tokens or num_recv
        if num_rows > num_recv:
            recv_x, recv_topk_idx, recv_topk_weights, _ = self._pad(num_rows, recv_x, recv_topk_idx,
                                                                    recv_topk_weights, None)
        node = None if N == 1 else (counts[:, L + R + 1:], bits[:, self.rank // (R // N)])
        legacy_handle = build_handle(self.rank, is_token_in_rank, sent, source_tokens, ep_handle, num_rows, C, N, node)
        count_list = [] if num_worst_tokens else [-(-count // expert_alignment) * expert_alignment
                                                    for count in per_expert]
        event = self._finish(async_finish, (x, recv_x, recv_topk_idx, recv_topk_weights, legacy_handle))
        return recv_x, recv_topk_idx, recv_topk_weights, count_list, legacy_handle, event

    @staticmethod
    def _pad(num_rows: int, recv_x, recv_topk_idx, recv_topk_weights, recv_src_idx) -> tuple:
        """Outputs grown to ``num_rows`` rows: zero data, -1 ids and sources, 0 weights."""
        def grow(t, fill):
            if t is None:
                return None
            out = torch.full((num_rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[:t.shape[0]] = t
            return out
        if isinstance(recv_x, tuple):
            recv_x = (grow(recv_x[0], 0), grow(recv_x[1], 0))
        else:
            recv_x = grow(recv_x, 0)
        return recv_x, grow(recv_topk_idx, -1), grow(recv_topk_weights, 0), grow(recv_src_idx, -1)

    def _check_handle(self, handle) -> "LegacyHandle":
        if not isinstance(handle, LegacyHandle):
            raise TypeError(f"handle must be the handle a deep_ep.Buffer.dispatch returned, got "
                            f"{type(handle).__name__}")
        buffer = self._alive()
        handle.ep_handle.check_matches(buffer_id=buffer.buffer_id, num_ranks=buffer.num_ranks, rank=buffer.rank,
                                       device=buffer.device, kind="deep_ep.Buffer")
        return handle

    def _cached_dispatch(self, buffer, data, sf, handle, num_tokens_per_rank, is_token_in_rank,
                         num_tokens_per_expert, topk_idx, topk_weights, num_sms, previous_event, async_finish):
        handle = self._check_handle(handle)
        for name, value in (("topk_idx", topk_idx), ("topk_weights", topk_weights),
                            ("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is not None:
                raise ValueError(f"a cached dispatch (handle=...) takes no {name}: the handle holds the layout")
        ep_handle = handle.ep_handle
        if data.shape[0] != ep_handle.num_tokens:
            raise ValueError(f"x has {data.shape[0]} tokens, the handle's dispatch had {ep_handle.num_tokens}")
        self._wait(previous_event)
        recv_x, _, _, _, _ = buffer.dispatch(data if sf is None else (data, sf), handle=ep_handle, num_sms=num_sms)
        if handle.num_rows > ep_handle.num_recv_tokens:
            recv_x = self._pad(handle.num_rows, recv_x, None, None, None)[0]
        return recv_x, None, None, None, None, self._finish(async_finish, (data, sf, recv_x, handle))

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None, bias=None,
                config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send each received row back to its source rank and sum a token's rows there (collective;
        rows are added as they are, no weighting): in float32, the biases first, then the ranks in
        rank order, rounded once to bf16 (DeepEP's order; over nodes, its hybrid order: docs/scaleout.md).

        Args:
            x: bf16 ``[rows, H]``, rows as the dispatch returned them (with ``num_worst_tokens``, the
                padded count; rows past the true count are not read).
            handle: the `LegacyHandle` of the dispatch on this rank.
            topk_weights: optional float32 ``[rows, K]`` (any K >= 1): returned summed over the ranks
                each token went to, per column (DeepEP's reduction; a dispatch's own weights, 0 where
                the expert is another rank's, come back as they were sent).
            bias: None, a bf16 ``[T, H]`` tensor, or a tuple of two, added to the sum.
            config: a `Config` (default `get_combine_config`). previous_event, async_finish,
                allocate_on_comm_stream: as in `dispatch`.

        Returns:
            ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K] or None, event)``.

        Raises:
            TypeError / ValueError: bad arguments (before any communication).
        """
        buffer = normal_mode_buffer(self)
        device = buffer.device
        async_finish = self._flags(async_finish, allocate_on_comm_stream, previous_event)
        if config is None:
            config = self._default_config(self.get_combine_config)
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a deep_ep.Config, got {type(config).__name__}")
        handle = self._check_handle(handle)
        ep_handle = handle.ep_handle
        checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(handle.num_rows, ep_handle.hidden), device=device)
        if topk_weights is not None:
            checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(handle.num_rows, None),
                                device=device)
            if topk_weights.shape[1] == 0:
                raise ValueError("topk_weights must have at least one column")
        checks.normalise_bias(bias, ep_handle.num_tokens, ep_handle.hidden, device)
        num_recv = ep_handle.num_recv_tokens
        if handle.num_rows > num_recv:
            x = x[:num_recv].contiguous()
            topk_weights = None if topk_weights is None else topk_weights[:num_recv].contiguous()
        self._wait(previous_event)
        num_sms = 0 if device.type == "cpu" else config.num_sms
        combined_x, _, _ = buffer.combine(x, ep_handle, bias=bias, num_sms=num_sms)
        combined_topk_weights = None if topk_weights is None else reduce_weights_back(
            buffer, topk_weights, ep_handle.recv_src_rank[:num_recv], handle.is_token_in_rank, ep_handle.num_experts,
            num_sms, self.num_nvl_ranks)
        event = self._finish(async_finish, (x, topk_weights, combined_x, combined_topk_weights, handle))
        return combined_x, combined_topk_weights, event
