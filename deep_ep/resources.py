"""How many SMs and RDMA queue pairs (QPs) a dispatch or combine should use: an analytic model.

Behind `ElasticBuffer.get_theoretical_num_sms` and `ElasticBuffer.get_theoretical_num_qps`. The model
is ours, derived from what our kernels move (docs/design.md, "GPU data path"); the backend supplies
the device's numbers (`DeviceResources`). It assumes a balanced gate: every token picks ``K``
distinct experts uniformly among ``E``.

SMs. With ``R`` ranks and ``L = E / R`` experts per rank, a token reaches
``k = R * (1 - C(E - L, K) / C(E, K))`` distinct ranks on average (a rank is missed when all ``K``
experts fall outside its ``L``). Of those rows a fraction ``(R - 1) / R`` crosses NVLink:
``remote = k (R - 1) / R`` rows per token, in each direction (balanced: a rank receives what it
sends). Per token a rank's SMs

* read ``1 + remote`` rows: the token itself, and each remote row once more when the receive phase
  copies it out of the window;
* write ``k + remote`` rows: one per destination (a peer's window, or the local output), and each
  remote row again into the output.

At the link's rate a token takes ``remote * row / nvlink_gbs``. One SM reads ``sm_read_gbs`` and
writes ``sm_write_gbs`` (loads and stores overlap in the copy loops, so the slower of the two
bounds an SM). The SMs needed to keep the link busy are therefore
``max((1 + remote) / sm_read_gbs, (k + remote) / sm_write_gbs) * nvlink_gbs / remote``, rounded up
to an even count, at least 2, at most what the rank may use. Combine moves the same rows the other
way; one count serves both.

Special cases: ``R = 1`` moves nothing over a link; the copy is bound by HBM and the measured best
is every SM (docs/performance.md: combine kept gaining up to 132 SMs at EP=1), so the model returns
every SM the rank may use. With ``prefer_overlap_with_compute=False`` the communication does not
share the device, so it also gets every SM. Backends without SMs (CPU) get 0, which ``dispatch``
reads as "automatic".

QPs only matter on the scale-out (RDMA) path, which is not built yet: the settings are validated
and stored, and this model is what that path will start from. One QP carries one ordered stream of
RDMA writes and the NIC serves QPs in parallel, so each SM's channel gets its own QP, plus one for
the count exchange: ``num_qps = num_sms + 1``, capped by the QPs allocated (``num_sms = 0``: none).
The automatic allocation is one per device SM plus one (0 on CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["DeviceResources", "expected_ranks_per_token", "theoretical_num_sms", "theoretical_num_qps",
           "default_num_allocated_qps"]


@dataclass(frozen=True)
class DeviceResources:
    """What a backend's device offers the model (supplied by `Backend.device_resources`).

    Attributes:
        num_device_sms: SMs of the device.
        max_sms: SMs one rank's kernels may use (less than the device's when emulated ranks share it).
        nvlink_gbs: NVLink bandwidth per GPU and direction, GB/s.
        rdma_gbs: RDMA bandwidth per GPU, GB/s (0: no scale-out link).
    """
    num_device_sms: int
    max_sms: int
    nvlink_gbs: float
    rdma_gbs: float = 0.0


def expected_ranks_per_token(num_experts: int, num_topk: int, num_ranks: int) -> float:
    """Mean number of distinct ranks a token reaches when it picks ``num_topk`` distinct experts
    uniformly among ``num_experts``, spread evenly over ``num_ranks`` ranks."""
    local = num_experts // num_ranks
    outside = num_experts - local
    miss = math.comb(outside, num_topk) / math.comb(num_experts, num_topk) if num_topk <= outside else 0.0
    return num_ranks * (1.0 - miss)


def theoretical_num_sms(num_experts: int, num_topk: int, *, num_ranks: int,
                        resources: Optional[DeviceResources], nvlink_gbs: float = 0.0,
                        sm_read_gbs: float = 200.0, sm_write_gbs: float = 50.0,
                        prefer_overlap_with_compute: bool = True) -> int:
    """SMs for a dispatch/combine (the module docstring derives it).

    Args:
        num_experts, num_topk: E >= num_ranks and 1 <= K <= E.
        num_ranks: R.
        resources: the device's numbers; None for a backend without SMs (the result is then 0).
        nvlink_gbs: NVLink bandwidth per direction, GB/s; 0 takes ``resources.nvlink_gbs``.
        sm_read_gbs, sm_write_gbs: what one SM reads / writes, GB/s (> 0).
        prefer_overlap_with_compute: False gives the communication every SM.

    Returns:
        an even count in ``[2, resources.max_sms]`` (or ``max_sms`` itself when it is smaller), 0
        without resources.
    """
    if resources is None or resources.max_sms <= 0:
        return 0
    cap = resources.max_sms
    if num_ranks <= 1 or not prefer_overlap_with_compute:
        return cap
    link = nvlink_gbs or resources.nvlink_gbs
    k = expected_ranks_per_token(num_experts, num_topk, num_ranks)
    remote = k * (num_ranks - 1) / num_ranks
    per_token = max((1.0 + remote) / sm_read_gbs, (k + remote) / sm_write_gbs)
    sms = math.ceil(per_token * link / remote - 1e-9)
    sms += sms % 2
    return min(cap, max(2, sms))


def theoretical_num_qps(num_sms: int, num_allocated_qps: int) -> int:
    """QPs for a call on ``num_sms`` SMs: one per SM plus one for the count exchange, capped by
    ``num_allocated_qps``; 0 when ``num_sms`` is 0."""
    if num_sms <= 0:
        return 0
    return min(num_sms + 1, num_allocated_qps)


def default_num_allocated_qps(resources: Optional[DeviceResources]) -> int:
    """QPs a buffer allocates when ``num_allocated_qps=0``: every SM's channel plus one (0 without SMs)."""
    return 0 if resources is None else resources.num_device_sms + 1
