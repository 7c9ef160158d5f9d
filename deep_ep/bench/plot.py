"""Charts of a bench result (``--plot PNG``; needs matplotlib)."""
from __future__ import annotations

import importlib.util
import math
from typing import Any, Dict, Sequence

__all__ = ["require_matplotlib", "plot", "plot_sm_sweep"]


def require_matplotlib() -> None:
    """Raise `SystemExit` with the install command when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(
            "error: --plot needs matplotlib, which is not installed; "
            "install it with `pip install matplotlib` (or this package's `plot` extra)"
        )


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(path: str, result: Dict[str, Any]) -> None:
    """Bar charts per rank: tokens sent / received (left) and logical bandwidth (right), to ``path``."""
    plt = _pyplot()
    rows = result["rows"]
    ranks = [r["rank"] for r in rows]
    xs = list(range(len(ranks)))
    width = 0.4
    fig, (ax_load, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
    ax_load.bar([x - width / 2 for x in xs], [r["sent"] for r in rows], width, label="sent")
    ax_load.bar([x + width / 2 for x in xs], [r["received"] for r in rows], width, label="received")
    ax_load.set_xlabel("rank")
    ax_load.set_ylabel("token copies" if not result["config"]["expand"] else "(token, expert) pairs")
    ax_load.set_title("load per rank")
    ax_load.set_xticks(xs, [str(r) for r in ranks])

    def nan_to_zero(v):
        return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v
    ax_bw.bar([x - width / 2 for x in xs], [nan_to_zero(r["dispatch_gbps"]) for r in rows], width, label="dispatch")
    ax_bw.bar([x + width / 2 for x in xs], [nan_to_zero(r["combine_gbps"]) for r in rows], width, label="combine")
    ax_bw.set_xlabel("rank")
    ax_bw.set_ylabel("logical GB/s")
    ax_bw.set_title("logical bandwidth per rank")
    ax_bw.set_xticks(xs, [str(r) for r in ranks])
    for ax in (ax_load, ax_bw):  # headroom so the legend does not cover the bars
        ax.set_ylim(0, max(ax.get_ylim()[1], 1e-9) * 1.25)
        ax.legend(loc="upper center", ncol=2)
    c = result["config"]
    fig.suptitle(f"deep_ep bench: {c['model']}, {c['num_ranks']} ranks x {c['tokens']} tokens, "
                 f"{'FP8' if c['fp8'] else 'BF16'}{', expanded' if c['expand'] else ''} ({result['runner']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sm_sweep(path: str, points: Sequence[Dict[str, Any]], title: str) -> None:
    """Logical bandwidth (left) and device time from CUDA graphs (right) against SMs, to ``path``."""
    plt = _pyplot()
    sms = [p["num_sms"] for p in points]
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    ax_bw.plot(sms, [p["dispatch_gbps_mean"] for p in points], "o-", label="dispatch")
    ax_bw.plot(sms, [p["combine_gbps_mean"] for p in points], "s-", label="combine")
    ax_bw.set_xlabel("SMs per kernel")
    ax_bw.set_ylabel("logical GB/s (mean over ranks, per call)")
    for key, label, mark in (("cached_dispatch_graph_us", "cached dispatch", "o-"), ("combine_graph_us", "combine", "s-")):
        ys = [p[key] for p in points]
        if all(y is not None for y in ys):
            ax_t.plot(sms, ys, mark, label=label)
    ax_t.set_xlabel("SMs per kernel")
    ax_t.set_ylabel("us, replayed from a CUDA graph (rank 0)")
    for ax in (ax_bw, ax_t):
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
