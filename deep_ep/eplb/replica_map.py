"""``ReplicaMap``: logical top-k expert ids to physical replica slots, on CPU (torch) or GPU (one
NVRTC kernel, ``deep_ep/include/deep_ep/kernels/eplb.cuh``).

Token ``t`` (its row in ``topk_idx``, plus ``token_offset``) routed to logical expert ``e`` goes
to replica ``replica_hash(t, e) % logical_count[e]`` of ``e``, that is to physical slot
``logical_to_physical[e, that replica]``. The hash makes the choice deterministic for a given
input and spreads an expert's tokens evenly over its replicas whatever the routing pattern;
``-1`` stays ``-1``. The CPU path below is the specification; the kernel matches it bit for bit.
The kernel is loaded on a device when the map's tables are built there (``to``), before any launch.
"""
from __future__ import annotations

import torch

from .. import jit
from .validate import check_plan

__all__ = ["ReplicaMap", "replica_hash", "load_kernel"]

_MASK32 = 0xFFFFFFFF
_THREADS = 256
_MAX_BLOCKS = 4096


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for int64 ``a`` in ``[0, 2**32)``, without overflowing int64."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def replica_hash(token: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of (token index, logical expert) that picks a replica (int64 tensors in,
    int64 values in ``[0, 2**32)`` out; arguments are taken modulo 2**32). Must equal
    ``deep_ep::eplb_replica_hash`` in ``include/deep_ep/impls/eplb_map.cuh``."""
    h = _mul32(token & _MASK32, 0x9E3779B1) ^ _mul32((expert + 1) & _MASK32, 0x85EBCA77)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


_kernel = jit.LazyKernel("deep_ep_eplb", "deep_ep/kernels/eplb.cuh", "deep_ep_eplb_map")


def load_kernel(device: torch.device) -> None:
    """Build (once per process) and load the map kernel on the CUDA ``device`` now, not at a launch."""
    _kernel().handle(device.index)


class ReplicaMap:
    """Maps logical expert ids to physical replica slots of a plan, so that
    ``ElasticBuffer.dispatch(x, replica_map.map(topk_idx), ..., num_experts=num_replicas)`` sends
    each token to one replica of each of its experts; combine is unchanged.

    Args:
        physical_to_logical: int64 ``[L, N]`` or ``[N]`` (a plan from :func:`rebalance_experts`).
        logical_to_physical: int64 ``[L, E, R]`` or ``[E, R]``, -1 after each expert's replicas.
        logical_count: int64 ``[L, E]`` or ``[E]``.
        layer: keep only this layer of a multi-layer plan (then ``map`` needs no ``layer``).
        num_logical_experts, num_physical_experts: the shape the caller expects; a plan for another
            shape is rejected.
        device: also build the GPU tables on this device now (see ``to``).
        group: the process group of the rank that maps, or None. Loading a CUDA module waits for the
            device to drain, so on emulated ranks (a group with ``load_collectively``, whose kernels
            wait on each other) the kernel loads at a collective call: every rank's map must then
            reach its first ``to(device)`` (the constructor with ``device=``, or the first GPU
            ``map``) at the same call, and each rank needs a map of its own.

    The plan is checked once here (on the host: GPU plan tensors are read back). For CUDA-graph
    capture, build the GPU tables before capturing (``to(device)``, or one ``map`` call).

    Raises:
        TypeError / ValueError: malformed or inconsistent plan tensors, a plan of another shape,
            a layer out of range.
    """

    def __init__(self, physical_to_logical, logical_to_physical, logical_count, *, layer=None,
                 num_logical_experts=None, num_physical_experts=None, device=None, group=None):
        plan = check_plan(physical_to_logical, logical_to_physical, logical_count,
                          num_experts=num_logical_experts, num_replicas=num_physical_experts)
        l2p = torch.from_numpy(plan.logical_to_physical)
        count = torch.from_numpy(plan.logical_count)
        p2l = torch.from_numpy(plan.physical_to_logical)
        if layer is not None:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < plan.num_layers:
                raise ValueError(f"layer must be an int in [0, {plan.num_layers}), got {layer!r}")
            l2p, count, p2l = l2p[layer:layer + 1], count[layer:layer + 1], p2l[layer:layer + 1]
        self._l2p, self._count, self._p2l = l2p.contiguous(), count.contiguous(), p2l.contiguous()
        self.num_layers = self._l2p.shape[0]
        self.num_logical_experts = plan.num_experts
        self.num_physical_experts = plan.num_replicas
        self.max_replicas = plan.max_replicas
        self._device_tables: dict = {}
        self._group = group
        self._loaded_devices: set = set()
        for t in (physical_to_logical, device):
            dev = t.device if isinstance(t, torch.Tensor) else (torch.device(t) if t is not None else None)
            if dev is not None and dev.type == "cuda":
                self.to(dev)

    def physical_to_logical(self, layer=None) -> torch.Tensor:
        """int64 CPU ``[N]``: the logical expert of every physical slot (of ``layer``)."""
        return self._p2l[self._layer(layer)]

    def logical_count(self, layer=None) -> torch.Tensor:
        """int64 CPU ``[E]``: replicas of every logical expert (of ``layer``)."""
        return self._count[self._layer(layer)]

    def to(self, device) -> "ReplicaMap":
        """Load the map kernel on a CUDA ``device`` (once, and not during a CUDA-graph capture;
        collectively on emulated ranks, see ``group``) and build (once) the int32 tables it reads
        there; returns ``self``. Nothing for a CPU device."""
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev not in self._loaded_devices and not torch.cuda.is_current_stream_capturing():
                load_collectively = getattr(self._group, "load_collectively", None)
                if load_collectively is None:
                    load_kernel(dev)
                else:
                    load_collectively(("deep_ep_eplb", dev.index), lambda: load_kernel(dev))
                self._loaded_devices.add(dev)
            if dev not in self._device_tables:
                self._device_tables[dev] = (self._l2p.to(torch.int32).to(dev), self._count.to(torch.int32).to(dev))
        return self

    def _layer(self, layer) -> int:
        if layer is None:
            if self.num_layers != 1:
                raise ValueError(f"this map holds {self.num_layers} layers: pass layer=")
            return 0
        if self.num_layers == 1 and layer == 0:
            return 0
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def map(self, topk_idx: torch.Tensor, *, layer=None, token_offset: int = 0, out=None,
            check: bool | None = None) -> torch.Tensor:
        """Physical expert ids for logical ``topk_idx``.

        Args:
            topk_idx: int64 ``[T, K]``, logical ids in ``[0, E)`` or -1, on CPU or a CUDA device.
            layer: the layer, for a map of several layers.
            token_offset: int >= 0 added to the row index before hashing. Rank-local row indices
                are the same on every rank, so with few tokens per rank (decode) pass e.g.
                ``rank * num_max_tokens_per_rank`` to spread the ranks' tokens over the replicas too.
            out: optional int64 tensor like ``topk_idx`` to write into.
            check: check that every id is in ``[-1, E)``. Default: True on CPU; False on GPU, where
                checking reads a flag back (a host sync, not capturable); unchecked GPU ids outside
                the range map to -1.

        Returns:
            int64 tensor of ``topk_idx``'s shape and device: physical ids in ``[0, N)``, -1 where
            ``topk_idx`` is -1. On GPU: one kernel on the current stream, no host sync, no
            allocation but ``out`` (capturable in a CUDA graph once the tables exist).

        Raises:
            TypeError: ``topk_idx`` not an int64 tensor, ``out`` of the wrong dtype.
            ValueError: ``topk_idx`` not 2-D, ids out of range (when checked), a bad ``layer``,
                ``token_offset`` or ``out`` shape/device.
        """
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64:
            raise TypeError(f"topk_idx must be an int64 tensor, got "
                            f"{topk_idx.dtype if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
        if topk_idx.dim() != 2:
            raise ValueError(f"topk_idx must be [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
        if isinstance(token_offset, bool) or not isinstance(token_offset, int) or token_offset < 0:
            raise ValueError(f"token_offset must be an int >= 0, got {token_offset!r}")
        index = self._layer(layer)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.int64:
                raise TypeError("out must be an int64 tensor")
            if out.shape != topk_idx.shape or out.device != topk_idx.device or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous tensor of shape {tuple(topk_idx.shape)} on {topk_idx.device}")
        if check is None:
            check = topk_idx.device.type != "cuda"
        if check and topk_idx.numel():
            bad = ((topk_idx < -1) | (topk_idx >= self.num_logical_experts)).any()
            if bool(bad):
                raise ValueError(f"topk_idx holds ids outside [-1, {self.num_logical_experts})")
        if topk_idx.device.type == "cuda":
            return self._map_gpu(topk_idx, index, token_offset, out)
        result = self._map_cpu(topk_idx, index, token_offset)
        if out is not None:
            out.copy_(result)
            return out
        return result

    def _map_cpu(self, topk_idx: torch.Tensor, index: int, token_offset: int) -> torch.Tensor:
        T, K = topk_idx.shape
        idx = topk_idx.cpu()
        valid = (idx >= 0) & (idx < self.num_logical_experts)
        expert = torch.where(valid, idx, torch.zeros_like(idx))
        token = (torch.arange(T, dtype=torch.int64, device="cpu") + token_offset).unsqueeze(1).expand(T, K)
        count = self._count[index].take(expert)
        replica = replica_hash(token, expert) % count
        physical = self._l2p[index].take(expert * self.max_replicas + replica)
        return torch.where(valid, physical, torch.full_like(physical, -1)).to(topk_idx.device)

    def _map_gpu(self, topk_idx: torch.Tensor, index: int, token_offset: int, out) -> torch.Tensor:
        self.to(topk_idx.device)
        l2p, count = self._device_tables[topk_idx.device]
        idx = topk_idx.contiguous()
        if out is None:
            out = torch.empty_like(idx)
        n = idx.numel()
        if n == 0:
            return out
        blocks = min((n + _THREADS - 1) // _THREADS, _MAX_BLOCKS)
        _kernel().launch(blocks, _THREADS, (idx, out, jit.i64(n), idx.shape[1], jit.i64(token_offset), l2p[index],
                                           count[index], self.num_logical_experts, self.max_replicas),
                             stream=torch.cuda.current_stream(idx.device))
        return out
