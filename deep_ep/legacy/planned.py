"""The parts of DeepEP's V1 ``Buffer`` not built yet (internode):
present with DeepEP's signatures, raising `NotImplementedError` that names the method."""
from __future__ import annotations

__all__ = ["planned", "PlannedMethods", "SIDE_BRANCH_KEYWORDS"]


def planned(name: str, what: str = "low-latency mode / internode"):
    """Raise the `NotImplementedError` of a part of ``deep_ep.Buffer`` not built yet."""
    raise NotImplementedError(f"deep_ep.Buffer.{name}: not built yet ({what} are planned)")


#: keywords only DeepEP's side branches give the low-latency calls (NVFP4 dispatch, single-batch
#: overlap, signalled sources)
SIDE_BRANCH_KEYWORDS = frozenset({"use_nvfp4", "x_global_scale", "overlap", "packed_recv_count", "comp_signal",
                                  "block_m", "threshold", "num_sms", "src_signals", "src_signal_expect_value"})


def _with_side_keywords(name: str, side_branch_kwargs: dict) -> str:
    unknown = sorted(set(side_branch_kwargs) - SIDE_BRANCH_KEYWORDS)
    if unknown:
        raise TypeError(f"deep_ep.Buffer.{name}() got an unexpected keyword argument {unknown[0]!r}")
    if not side_branch_kwargs:
        return name
    return f"{name}(keywords {', '.join(sorted(side_branch_kwargs))} of DeepEP's side branches)"


class PlannedMethods:
    """DeepEP's V1 internode methods (`deep_ep.Buffer` inherits them)."""

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config=None, previous_event=None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """Internode dispatch. Raises NotImplementedError (planned)."""
        planned("internode_dispatch")

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Internode combine. Raises NotImplementedError (planned)."""
        planned("internode_combine")
