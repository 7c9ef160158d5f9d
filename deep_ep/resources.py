"""How many SMs and RDMA queue pairs (QPs) a dispatch or combine should use: DeepEP V2's analytic model.

Behind `ElasticBuffer.get_theoretical_num_sms` and `ElasticBuffer.get_theoretical_num_qps`; the backend
supplies the device's numbers (`DeviceResources`). The model assumes a balanced gate: every token picks
``K`` distinct experts uniformly among ``E``, spread evenly over ``g`` groups (ranks, or nodes). A
token then reaches ``k_g = g (1 - C(E - E/g, K) / C(E, K))`` distinct groups on average (a group is
missed when all ``K`` experts fall outside its ``E/g``).

Traffic is counted per row delivered to a destination rank (a token reaches ``k = k_R`` ranks, so
reading it once costs ``1/k`` per delivered row). With ``S_o`` scale-out and ``S_u`` scale-up ranks
(logical), ``N`` NVLink ranks and ``R`` ranks in all, ``k_o = k_{S_o}`` nodes per token:

* hybrid (``S_o > 1``): SMs read ``1/k`` (the token) ``+ k_o/k`` (forwarders read what arrived per
  node) and write ``1/k`` (send buffer) ``+ k_o/(k S_o)`` (the local node's copy) ``+ 1`` (the forward
  to the final rank); RDMA carries ``k_o (1 - 1/S_o) / k``, NVLink ``1 - 1/S_u``;
* otherwise (one node, or direct mode): SMs read ``1/k`` and write ``N/R`` (plus ``1/k`` for a send
  buffer when there are RDMA ranks); NVLink carries ``(N/R)(1 - 1/N)``, RDMA ``(R - N)/R``.

The bounding link is RDMA when ``S_o > 1`` and ``rdma / rdma_gbs > nvlink / nvlink_gbs``, else NVLink
(as in DeepEP, direct mode is always bound by NVLink here). The SMs that keep it busy are
``max(gbs / traffic * read / sm_read_gbs, gbs / traffic * write / sm_write_gbs)`` (every SM of the
device when nothing crosses a link, e.g. one rank), then ``+25 %``, rounded up to an even count of at
least 4, at least 64 with ``prefer_overlap_with_compute=False``, at most what the rank may use
(emulated ranks share one device). Backends without SMs (CPU) get 0, which ``dispatch`` reads as
"automatic". Link rates not given come from the backend, else `DEFAULT_NVLINK_GBS` /
`DEFAULT_RDMA_GBS` (no ``ibstat`` probe, and never a division by zero).

QPs: direct mode ``min(num_sms, 9)`` (fewer doorbells), hybrid ``num_sms * 16 + 1`` (every channel
and the notify warps their own), capped by the QPs allocated; 0 SMs: 0 QPs. A buffer allocates 129
QPs in hybrid mode and 17 in direct mode when ``num_allocated_qps=0`` (DeepEP's counts without a
ConnectX-8; 0 on CPU). Across nodes the buffer asks NCCL (or the emulated GIN) for that many GIN
contexts; a call's data kernel spreads its puts over ``num_qps`` of those it got (0: all of them,
`deep_ep.comm.transport.Transport.kernel_args_using`), the control kernels use the first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["DeviceResources", "DEFAULT_NVLINK_GBS", "DEFAULT_RDMA_GBS", "expected_ranks_per_token",
           "theoretical_num_sms", "theoretical_num_qps", "default_num_allocated_qps"]

#: NVLink bandwidth per GPU and direction when neither the caller nor the backend gives one (H100 / H200
#: NVLink 4, the datasheet's 450 GB/s).
DEFAULT_NVLINK_GBS = 450.0
#: RDMA bandwidth per GPU when neither the caller nor the backend gives one (a 400 Gb/s NIC).
DEFAULT_RDMA_GBS = 50.0

_HYBRID_QPS, _DIRECT_QPS = 129, 17


@dataclass(frozen=True)
class DeviceResources:
    """What a backend's device offers the model (supplied by `Backend.device_resources`).

    Attributes:
        num_device_sms: SMs of the device.
        max_sms: SMs one rank's kernels may use (less than the device's when emulated ranks share it).
        nvlink_gbs: NVLink bandwidth per GPU and direction, GB/s (0: unknown).
        rdma_gbs: RDMA bandwidth per GPU, GB/s (0: unknown).
    """
    num_device_sms: int
    max_sms: int
    nvlink_gbs: float
    rdma_gbs: float = 0.0


def expected_ranks_per_token(num_experts: int, num_topk: int, num_ranks: int) -> float:
    """Mean number of distinct groups a token reaches when it picks ``num_topk`` distinct experts
    uniformly among ``num_experts``, spread evenly over ``num_ranks`` groups (ranks, or nodes).

    Raises:
        ValueError: ``num_ranks`` does not divide ``num_experts``.
    """
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts cannot be spread evenly over {num_ranks} groups")
    outside = num_experts - num_experts // num_ranks
    return num_ranks * (1.0 - math.comb(outside, num_topk) / math.comb(num_experts, num_topk))


def _traffic(num_experts: int, num_topk: int, num_ranks: int, num_scaleout_ranks: int, num_scaleup_ranks: int,
             num_rdma_ranks: int, num_nvlink_ranks: int) -> tuple:
    """``(SM reads, SM writes, RDMA traffic, NVLink traffic)`` per delivered row (module docstring)."""
    ranks_reached = expected_ranks_per_token(num_experts, num_topk, num_ranks)
    per_token = 1 / ranks_reached
    sm_read, sm_write = per_token, 0.0
    if num_scaleout_ranks > 1:
        nodes_reached = expected_ranks_per_token(num_experts, num_topk, num_scaleout_ranks)
        sm_write += per_token
        sm_write += per_token * (nodes_reached / num_scaleout_ranks)
        rdma = per_token * (nodes_reached * (1 - 1 / num_scaleout_ranks))
        sm_read += nodes_reached / ranks_reached
        sm_write += 1
        nvlink = 1 - 1 / num_scaleup_ranks
    else:
        if num_rdma_ranks > 1:
            sm_write += per_token
        nvlink_share = num_nvlink_ranks / num_ranks
        sm_write += nvlink_share
        nvlink = nvlink_share * (1 - 1 / num_nvlink_ranks)
        rdma = (num_ranks - num_nvlink_ranks) / num_ranks
    return sm_read, sm_write, rdma, nvlink


def theoretical_num_sms(num_experts: int, num_topk: int, *, num_ranks: int,
                        resources: Optional[DeviceResources], nvlink_gbs: float = 0.0, rdma_gbs: float = 0.0,
                        sm_read_gbs: float = 200.0, sm_write_gbs: float = 50.0,
                        prefer_overlap_with_compute: bool = True, num_scaleout_ranks: int = 1,
                        num_scaleup_ranks: int = 0, num_rdma_ranks: int = 1, num_nvlink_ranks: int = 0) -> int:
    """SMs for a dispatch/combine (the module docstring gives the model).

    Args:
        num_experts, num_topk: E (divisible by every group count) and K in ``[1, E]``.
        num_ranks: R.
        resources: the device's numbers; None for a backend without SMs (the result is then 0).
        nvlink_gbs, rdma_gbs: link rates in GB/s; 0 takes ``resources``' rate, else the defaults.
        sm_read_gbs, sm_write_gbs: what one SM reads / writes, GB/s (> 0).
        prefer_overlap_with_compute: False asks for at least 64 SMs.
        num_scaleout_ranks, num_scaleup_ranks: the logical split (default ``(1, R)``; 0 scale-up: R).
        num_rdma_ranks, num_nvlink_ranks: the physical split (default ``(1, R)``; 0 NVLink ranks: R).

    Returns:
        an even count in ``[4, resources.max_sms]`` (``max_sms`` itself when it is smaller), 0 without
        resources.
    """
    if resources is None or resources.max_sms <= 0:
        return 0
    num_scaleup_ranks = num_scaleup_ranks or num_ranks // num_scaleout_ranks
    num_nvlink_ranks = num_nvlink_ranks or num_ranks // num_rdma_ranks
    sm_read, sm_write, rdma, nvlink = _traffic(num_experts, num_topk, num_ranks, num_scaleout_ranks,
                                               num_scaleup_ranks, num_rdma_ranks, num_nvlink_ranks)
    nvlink_gbs = nvlink_gbs or resources.nvlink_gbs or DEFAULT_NVLINK_GBS
    rdma_gbs = rdma_gbs or resources.rdma_gbs or DEFAULT_RDMA_GBS
    if num_scaleout_ranks > 1 and rdma / rdma_gbs > nvlink / nvlink_gbs:
        traffic, gbs = rdma, rdma_gbs
    else:
        traffic, gbs = nvlink, nvlink_gbs
    sms = float(resources.num_device_sms)
    if traffic > 0:
        sms = max(gbs / traffic * sm_read / sm_read_gbs, gbs / traffic * sm_write / sm_write_gbs)
    sms = max(4, math.ceil(sms * 1.25))
    sms += sms % 2
    if not prefer_overlap_with_compute:
        sms = max(sms, 64)
    return min(sms, resources.num_device_sms, resources.max_sms)


def theoretical_num_qps(num_sms: int, num_allocated_qps: int, allow_hybrid_mode: bool = True) -> int:
    """QPs for a call on ``num_sms`` SMs: ``num_sms * 16 + 1`` in hybrid mode, ``min(num_sms, 9)`` in
    direct mode, at most ``num_allocated_qps``; 0 when ``num_sms`` is 0 (no kernel, e.g. CPU)."""
    if num_sms <= 0:
        return 0
    wanted = num_sms * 16 + 1 if allow_hybrid_mode else min(num_sms, 9)
    return min(wanted, num_allocated_qps)


def default_num_allocated_qps(resources: Optional[DeviceResources], allow_hybrid_mode: bool = True) -> int:
    """QPs a buffer allocates when ``num_allocated_qps=0``: 129 hybrid, 17 direct (0 without SMs)."""
    if resources is None:
        return 0
    return _HYBRID_QPS if allow_hybrid_mode else _DIRECT_QPS
