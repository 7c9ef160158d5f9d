"""``LoadMonitor``: live expert load from dispatch's receive statistics, and the next plan."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collective import comm_device, group_info
from .planner import check_plan_args, rebalance_experts
from .validate import positive_int

__all__ = ["LoadMonitor"]


class LoadMonitor:
    """Accumulates the load of every logical expert, per layer, from the per-rank counters that
    ``ElasticBuffer.dispatch`` increments (``cumulative_local_expert_recv_stats``), and turns it
    into the next plan on demand.

    Each rank holds one int32 counter per local physical slot and layer (:meth:`stats`): pass it to
    dispatch of that layer, or add your own counts with :meth:`add`. :meth:`flush` folds the
    counters into int64 per-logical-expert totals through the current placement (a replica's
    tokens count for its logical expert) and zeroes them; it is local and asynchronous on GPU.
    :meth:`global_load` sums the totals over the group; :meth:`plan` plans from them.

    Args:
        group: the EP process group (``None``: the default group): gloo (CPU tensors) or NCCL
            (CUDA tensors on the current device).
        num_layers: L, MoE layers.
        num_logical_experts: E.
        physical_to_logical: int64 ``[L, N]`` or ``[N]`` (same for every layer), the placement
            dispatch runs with (``num_experts = N`` in dispatch); default: no replication (identity,
            N = E). N must be a multiple of the group size.
        device: where the counters live (default: CUDA for NCCL groups, CPU for gloo).

    The int32 counters overflow after 2**31 pairs per slot: flush at least that often (every few
    thousand steps at 8192 tokens x top-8 per rank). Every method but :meth:`global_load`,
    :meth:`plan` and the constructor's checks is local.

    Raises:
        TypeError / ValueError: bad counts or placement, torch.distributed not initialised.
    """

    def __init__(self, group, num_layers: int, num_logical_experts: int, *, physical_to_logical=None,
                 device=None):
        self.group, self.rank, self.world_size = group_info(group)
        self.num_layers = positive_int(num_layers, "num_layers")
        self.num_logical_experts = positive_int(num_logical_experts, "num_logical_experts")
        preferred = torch.device(device) if device is not None else None
        self.comm_device = comm_device(self.group, preferred)
        self.device = preferred if preferred is not None else self.comm_device
        self._totals = torch.zeros(self.num_layers, self.num_logical_experts, dtype=torch.int64, device=self.device)
        self._stats = None
        self.switch(physical_to_logical)

    @property
    def num_physical_experts(self) -> int:
        """N, the physical slots of the current placement (dispatch's ``num_experts``)."""
        return self._p2l.shape[1]

    def _placement(self, physical_to_logical) -> torch.Tensor:
        L, E = self.num_layers, self.num_logical_experts
        if physical_to_logical is None:
            return torch.arange(E, dtype=torch.int64, device="cpu").expand(L, E).contiguous()
        if not isinstance(physical_to_logical, torch.Tensor) or physical_to_logical.dtype != torch.int64:
            raise TypeError("physical_to_logical must be an int64 tensor")
        p2l = physical_to_logical.detach().to("cpu")
        if p2l.dim() == 1:
            p2l = p2l.expand(L, -1)
        if p2l.dim() != 2 or p2l.shape[0] != L or p2l.shape[1] < E:
            raise ValueError(f"physical_to_logical must be [{L}, N] (or [N]) with N >= {E}, got "
                             f"{tuple(physical_to_logical.shape)}")
        if p2l.shape[1] % self.world_size:
            raise ValueError(f"the placement's {p2l.shape[1]} slots are not a multiple of the group size "
                             f"{self.world_size}")
        if int(p2l.min()) < 0 or int(p2l.max()) >= E:
            raise ValueError(f"physical_to_logical holds ids outside [0, {E})")
        return p2l.contiguous()

    def stats(self, layer: int) -> torch.Tensor:
        """The int32 ``[N / world_size]`` counter of ``layer`` on this rank: pass it to dispatch as
        ``cumulative_local_expert_recv_stats``. The same tensor until the number of slots changes."""
        return self._stats[self._layer(layer)]

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def add(self, layer: int, counts: torch.Tensor) -> None:
        """Add ``counts`` (integer ``[N / world_size]``: received pairs per local physical slot, e.g.
        a counter of your own that you then zero) to ``layer``'s counter."""
        row = self.stats(layer)
        if not isinstance(counts, torch.Tensor) or counts.is_floating_point() or counts.dtype == torch.bool:
            raise TypeError("counts must be an integer tensor")
        if counts.shape != row.shape:
            raise ValueError(f"counts must have shape {tuple(row.shape)} (local slots), got {tuple(counts.shape)}")
        row.add_(counts.to(device=row.device, dtype=torch.int32))

    def flush(self) -> None:
        """Fold the counters into the per-logical-expert totals (through the current placement) and
        zero them. Local; no host sync."""
        self._totals.scatter_add_(1, self._local_p2l, self._stats.to(torch.int64))
        self._stats.zero_()

    def reset(self) -> None:
        """Forget all load seen so far (totals and counters)."""
        self._totals.zero_()
        self._stats.zero_()

    def local_load(self) -> torch.Tensor:
        """int64 ``[L, E]`` on ``device``: this rank's totals (after a :meth:`flush`)."""
        self.flush()
        return self._totals.clone()

    def global_load(self) -> torch.Tensor:
        """Collective: int64 CPU ``[L, E]``, every logical expert's load summed over the group."""
        total = self.local_load().to(self.comm_device)
        dist.all_reduce(total, group=self.group)
        return total.cpu()

    def plan(self, num_replicas: int, num_groups: int = 1, num_nodes: int = 1, num_gpus: int | None = None,
             *, reset: bool = True):
        """Collective: the next plan, :func:`rebalance_experts` of :meth:`global_load`, computed on the
        group's first rank and broadcast, so every rank gets the same plan. ``num_gpus`` defaults
        to the group size. ``reset`` forgets the load after planning. Does not change the placement
        the counters are folded with: call :meth:`switch` when dispatch starts using the new one.

        Returns:
            ``(physical_to_logical [L, N], logical_to_physical [L, E, N - E + 1], logical_count
            [L, E])``, int64 CPU tensors.

        Raises:
            TypeError / ValueError: the errors of :func:`rebalance_experts` (on every rank, before
                any communication).
        """
        gpus = self.world_size if num_gpus is None else num_gpus
        N, groups, nodes, G = check_plan_args(self.num_logical_experts, num_replicas, num_groups, num_nodes, gpus)
        load = self.global_load()
        L, E = self.num_layers, self.num_logical_experts
        if self.rank == 0:
            plan = [t.to(self.comm_device) for t in rebalance_experts(load, N, groups, nodes, G)]
        else:
            plan = [torch.empty(shape, dtype=torch.int64, device=self.comm_device)
                    for shape in ((L, N), (L, E, N - E + 1), (L, E))]
        src = dist.get_global_rank(self.group, 0)
        for t in plan:
            dist.broadcast(t, src=src, group=self.group)
        if reset:
            self.reset()
        return tuple(t.cpu() for t in plan)

    def switch(self, physical_to_logical) -> None:
        """Fold what was counted so far with the old placement, then count with the new one
        (``[L, N]`` or ``[N]``, as in the constructor; None: identity). Call it when dispatch starts
        using the new physical ids. If N changes, :meth:`stats` returns new tensors afterwards."""
        p2l = self._placement(physical_to_logical)
        if self._stats is not None:
            self.flush()
        local = p2l.shape[1] // self.world_size
        self._p2l = p2l
        self._local_p2l = p2l[:, self.rank * local:(self.rank + 1) * local].contiguous().to(self.device)
        if self._stats is None or self._stats.shape[1] != local:
            self._stats = torch.zeros(self.num_layers, local, dtype=torch.int32, device=self.device)
