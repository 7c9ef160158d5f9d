"""Expert load balancing (EPLB): replicate hot experts, place replicas, dispatch to them.

* :func:`rebalance_experts` plans, per layer, which logical expert every physical expert slot
  holds (hierarchical over nodes, or global), from measured loads.
* :class:`ReplicaMap` maps logical ``topk_idx`` to physical ids (CPU, or one GPU kernel), so that
  ``ElasticBuffer.dispatch(..., num_experts=num_replicas)`` runs unchanged on the replicas.
* :class:`LoadMonitor` accumulates dispatch's receive statistics over steps and ranks, and plans.
* :func:`move_expert_weights` / :class:`ExpertPlacement` move expert weights to a new placement
  over the process group, the old placement valid until an explicit switch.

Helpers for measuring plans: :func:`gpu_loads`, :func:`static_gpu_loads`, :func:`hierarchy_bound`.
The algorithm and its guarantees: ``docs/eplb.md``.
"""
from .monitor import LoadMonitor
from .planner import gpu_loads, hierarchy_bound, rebalance_experts, static_gpu_loads
from .replica_map import ReplicaMap, replica_hash
from .weights import ExpertMoveError, ExpertPlacement, move_expert_weights

__all__ = ["rebalance_experts", "ReplicaMap", "replica_hash", "LoadMonitor", "move_expert_weights",
           "ExpertPlacement", "ExpertMoveError", "gpu_loads", "static_gpu_loads", "hierarchy_bound"]
