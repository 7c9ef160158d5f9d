"""The `NotImplementedError` of the parts of DeepEP's V1 ``Buffer`` not built yet (`planned`), and
the keywords of DeepEP's side branches, taken and refused (`refuse_side_keywords`) unless they hold
their defaults."""
from __future__ import annotations

import torch

__all__ = ["planned", "SIDE_BRANCH_KEYWORDS", "refuse_side_keywords"]


def planned(name: str, what: str = "low-latency mode / internode"):
    """Raise the `NotImplementedError` of a part of ``deep_ep.Buffer`` not built yet."""
    raise NotImplementedError(f"deep_ep.Buffer.{name}: not built yet ({what} are planned)")


#: Keywords only DeepEP's side branches give these methods (NVFP4 dispatch, single-batch overlap,
#: signalled sources, eager RDMA, MNNVL fabric memory, PCIe normal mode), with their defaults there.
#: deep_ep takes them (keyword-only: the branches place them differently) and refuses any other
#: value. (``internode_dispatch``'s ``num_worst_tokens`` is supported: `deep_ep.legacy.internode`.)
SIDE_BRANCH_KEYWORDS = {
    "__init__": {"use_fabric": False, "allow_nvlink_for_normal_mode": True, "eager_support": False},
    "get_low_latency_rdma_size_hint": {"eager_support": False},
    "low_latency_dispatch": {"topk_weights": None, "x_global_scale": None, "use_nvfp4": False,
                             "use_ue8m0_for_sf": False, "use_eager": False},
    "low_latency_combine": {"overlap": False, "packed_recv_count": None, "comp_signal": None, "block_m": 64,
                            "threshold": 0, "num_sms": 3, "src_signals": None, "src_signal_expect_value": 0,
                            "use_eager": False},
}


def _is_default(value, default) -> bool:
    if default is None or value is None:
        return value is default
    return isinstance(value, (bool, int)) and value == default      # flags may come as 0 / 1


def refuse_side_keywords(method: str, values: dict) -> None:
    """Raise `NotImplementedError` naming the first of ``values`` (keyword -> value given) that is
    not its side-branch default (`SIDE_BRANCH_KEYWORDS`)."""
    for name, default in SIDE_BRANCH_KEYWORDS[method].items():
        value = values[name]
        if not _is_default(value, default):
            shown = type(value).__name__ if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(
                f"deep_ep.Buffer.{method}({name}={shown}): {name} is a keyword of DeepEP's side branches; deep_ep "
                f"takes only its default ({default!r}), the feature behind it is not built")
