"""`EPHandle`: the routing metadata of one dispatch, with DeepEP V2's field names and meanings.

A handle is made by `ElasticBuffer.dispatch` on every rank. `combine` needs it to send the expert
outputs back, and `dispatch(handle=...)` repeats its layout with new data (a *cached* dispatch: no
routing input, no host synchronisation; the handle is returned as it is).

Notation: ``R`` ranks, ``E`` experts, ``L = E / R`` local experts, ``K`` top-k, ``M`` =
``num_max_tokens_per_rank``, ``A`` = ``expert_alignment``, ``T`` tokens dispatched by this rank.
Tensors live on the buffer's device. The full contract is docs/design.md, "The handle".

DeepEP's fields (same names, same meanings)
    do_expand                bool  expanded layout (one row per (token, local expert)) or not
    num_experts              int   E
    expert_alignment         int   A: per-expert row counts are padded up to a multiple of A
    num_max_tokens_per_rank  int   M of the dispatch (0 = not given; only with a CPU sync)
    num_sms                  int   SMs the dispatch used, reused by combine (0 on CPU)
    topk_idx                 int64 [T, K]  the routing; a copy exactly when ``do_handle_copy``,
                                   else the caller's tensor itself
    num_recv_tokens          int   received tokens (a token once per destination rank); without
                                   CPU sync the worst case ``R * M``
    num_expanded_tokens      int   rows of an expanded receive, padding included; without CPU
                                   sync the worst case ``R * M * min(K, L) + L * (A - 1)``, aligned
    num_recv_tokens_per_expert_list  list[int]  received pairs per local expert, aligned up to A;
                                   ``[]`` without CPU sync
    psum_num_recv_tokens_per_scaleup_rank  int32 [S]  inclusive prefix sum over scale-up ranks of
                                   received tokens (both layouts); the last element is the true
                                   number of received tokens. S = R (one node, or direct mode):
                                   per source rank; hybrid mode across nodes, S ranks per node: entry
                                   j counts the tokens from rank j of every node (DeepEP's); rows stay
                                   in source-rank order, so these are then counts, not row blocks
    psum_num_recv_tokens_per_expert  int32 [L]  non-expanded: inclusive prefix sum of the aligned
                                   counts; expanded: aligned count of the experts before i plus the
                                   unaligned count of i (`deep_ep.shapes.expert_prefix_sum`)
    num_unaligned_recv_tokens_per_expert  int32 [L]  received pairs per local expert (both layouts)
    recv_src_metadata        int32 [num_recv_tokens, K + 2]  one row per received token, in the
                                   non-expanded received order (source rank, then source token):
                                   col 0 ``src_rank * M + src_token``; col 1 ``src_rank * K + k``
                                   with ``k`` the token's last top-k slot local to this rank; cols
                                   2.. the expanded row of each slot (-1 where not local, and always
                                   -1 in the non-expanded layout). Rows past the true count: -1.
    dst_buffer_slot_idx      int32  where this rank's tokens landed: non-expanded ``[T, R]``, the
                                   row of token t at rank d (-1: not sent there); expanded
                                   ``[T, K]``, the row of slot (t, k) at the owner of its expert (-1)
    token_metadata_at_forward, channel_linked_list  None (DeepEP's hybrid scale-out mode only)

deep_ep's own fields
    buffer_id                int   the `ElasticBuffer` that made it (-1: `deep_ep.reference`)
    num_ranks, rank          int   group size and this rank
    hidden                   int   H, channels per token
    do_cpu_sync              bool  whether the dispatch waited for the counts on the host
    recv_topk_weights        float32 [num_expanded_tokens] or None  expanded layout: the dispatch's
                                   weight of every row (0 on padding), for
                                   ``combine(apply_dispatch_weights=True)``; None otherwise
    backend_state            backend-private (GPU: `deep_ep.backends.gpu.GPUHandleState`)

On the GPU backend the three int32 layout tensors (the two prefix sums and the unaligned counts),
``dst_buffer_slot_idx`` and, for a dispatch without CPU sync, ``recv_src_metadata`` (sized for the
worst case) are views of one allocation (the layout words, ``dst_buffer_slot_idx`` and
``recv_src_metadata`` each start on a 128-byte boundary; the layout tensors are ranges inside the
layout words): keeping any of them keeps all of them; ``.clone()`` one to keep it alone.

Derived views (properties, computed from the fields above): ``num_topk``, ``num_tokens``,
``num_local_experts``, ``num_recv_rows``, ``recv_src_rank`` / ``recv_src_token`` (source of every
receive row), ``rank_prefix_sum`` (received pairs per source rank in the expanded layout),
``device``.
"""
from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, fields
from typing import Optional

import torch

from . import shapes

__all__ = ["EPHandle", "collect_tensors"]


@dataclass(eq=False)
class EPHandle:
    """Routing metadata of one dispatch; see the module docstring for every field."""

    # DeepEP's fields
    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor
    recv_src_metadata: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    # deep_ep's own fields
    buffer_id: int
    num_ranks: int
    rank: int
    hidden: int
    do_cpu_sync: bool
    recv_topk_weights: Optional[torch.Tensor] = None
    #: backend-private state a cached dispatch or combine needs (GPU: layout words, per-token rows);
    #: ``None`` for the CPU backend and the reference. Cloned with the handle when it has ``clone()``.
    backend_state: Optional[object] = None
    #: DeepEP's hybrid (scale-out) mode only; always None here.
    token_metadata_at_forward: Optional[torch.Tensor] = None
    channel_linked_list: Optional[torch.Tensor] = None

    #: Tensor fields a backend may leave to be made on first access from its ``backend_state``
    #: (`with_lazy_fields`): they read as any other field, and can be assigned.
    LAZY_FIELDS = ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                   "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx", "recv_src_metadata")

    @classmethod
    def with_lazy_fields(cls, backend_state, values: dict) -> "EPHandle":
        """A handle with ``backend_state`` and every field of ``values`` (field name -> value) set, and
        the `LAZY_FIELDS` missing from it made on first access by ``backend_state.handle_field(name)``
        (then kept). For backends whose per-call host time matters: building tensor views costs about
        a microsecond each, and most calls read none of these fields.

        ``values`` becomes the handle's own attribute dict (not copied: pass a fresh one, e.g. a copy
        of a dict made once per configuration with `field_dict`). It must hold every field but
        ``backend_state`` and the lazy ones, those with defaults too (not checked here, on the per-call
        path: a missing one is an AttributeError when read; tests/test_gpu_host_path.py reads every
        field of the GPU backend's handles). A dict taken as it is, not keyword arguments: binding some
        fifteen keywords into a classmethod's ``**values`` cost about a microsecond per handle, and
        copying them into the new handle's dict about half a microsecond more.
        """
        h = cls.__new__(cls)
        values["backend_state"] = backend_state
        object.__setattr__(h, "__dict__", values)   # a new handle has no launch memo to void
        return h

    @staticmethod
    def field_dict(**values) -> dict:
        """The fields with defaults at their defaults, then ``values``: a dict of every field for
        `with_lazy_fields` (in the order the fields of a handle made field by field are in)."""
        return {**_DEFAULTS, **values}

    def __setattr__(self, name: str, value) -> None:
        # An assignment to any field voids what a backend derived from the fields (`launch_memo`).
        self.__dict__.pop("_launch_memo", None)
        object.__setattr__(self, name, value)

    def launch_memo(self) -> dict:
        """A dict in which a backend keeps what it derived from this handle's fields for a kind of call
        (the GPU backend: its prepared launch), so that the next such call skips re-deriving it. Any
        assignment to a field of the handle empties it (a backend also checks what it read from the
        handle's tensors, which can change in place); copies, pickles, `dataclasses.replace` and
        `clone` make handles without it."""
        d = self.__dict__
        memo = d.get("_launch_memo")
        if memo is None:
            memo = d["_launch_memo"] = {}
        return memo

    def __getstate__(self) -> dict:
        # Copies and pickles leave the memo behind: its launches point at this handle's tensors.
        state = dict(self.__dict__)
        state.pop("_launch_memo", None)
        return state

    def __getattr__(self, name: str):
        # Only reached for names not set on the instance: a lazy field's first access.
        if name in EPHandle.LAZY_FIELDS:
            state = self.__dict__.get("backend_state")
            if state is not None and hasattr(state, "handle_field"):
                v = state.handle_field(name)
                # a view follows the state's words (graph replays included); a value computed from
                # them does not, so it is made again at every access
                if name not in getattr(state, "computed_fields", ()):
                    self.__dict__[name] = v
                return v
            raise AttributeError(f"EPHandle.{name} is made from the handle's backend state on first access, "
                                 f"but backend_state is now {type(state).__name__}: assign the field, or keep "
                                 f"the state the dispatch made")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # ------------------------------------------------------------------ derived values
    @property
    def num_topk(self) -> int:
        """K, the columns of ``topk_idx``."""
        return int(self.topk_idx.shape[1])

    @property
    def num_tokens(self) -> int:
        """T, the tokens this rank dispatched (rows of ``topk_idx``)."""
        return int(self.topk_idx.shape[0])

    @property
    def num_local_experts(self) -> int:
        """L = num_experts / num_ranks."""
        return self.num_experts // self.num_ranks

    @property
    def num_recv_rows(self) -> int:
        """Rows of the receive tensors (``num_expanded_tokens`` expanded, ``num_recv_tokens`` otherwise):
        the rows `combine` expects in its ``x``."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens

    @property
    def recv_src_rank(self) -> torch.Tensor:
        """int32 ``[num_recv_rows]``: the source rank of every receive row (-1 on padding rows and rows
        past the true count)."""
        return shapes.row_sources(self.recv_src_metadata, self.num_recv_rows, self.num_max_tokens_per_rank,
                                  self.do_expand)[0]

    @property
    def recv_src_token(self) -> torch.Tensor:
        """int32 ``[num_recv_rows]``: the source token (on its rank) of every receive row (-1 likewise)."""
        return shapes.row_sources(self.recv_src_metadata, self.num_recv_rows, self.num_max_tokens_per_rank,
                                  self.do_expand)[1]

    @property
    def rank_prefix_sum(self) -> torch.Tensor:
        """int32 ``[R]``: inclusive prefix sum over source ranks of what was received: tokens
        (non-expanded; ``psum_num_recv_tokens_per_scaleup_rank``) or (token, expert) pairs, the unpadded
        rows (expanded)."""
        psum = self.psum_num_recv_tokens_per_scaleup_rank
        if not self.do_expand and psum.numel() == self.num_ranks:
            return psum
        if not self.do_expand:       # hybrid mode: the prefix sum is per scale-up rank, not per source
            meta = self.recv_src_metadata[:int(psum[-1]), 1].to(torch.int64)
            src = torch.div(meta, max(self.num_topk, 1), rounding_mode="floor")
            return torch.cumsum(torch.bincount(src, minlength=self.num_ranks), 0).to(torch.int32)
        return shapes.pairs_prefix_sum_per_source(self.recv_src_metadata, self.num_ranks)

    @property
    def device(self) -> torch.device:
        """The device of the handle's tensors (the buffer's device)."""
        return self.topk_idx.device

    # ------------------------------------------------------------------ checks
    def check_matches(self, *, buffer_id: int, num_ranks: int, rank: int, device: torch.device,
                      what: str = "handle", kind: str = "ElasticBuffer") -> None:
        """Raise `ValueError` unless this handle was made by the given buffer on this rank.

        Args:
            buffer_id: id of the buffer the handle is used with (`ElasticBuffer.buffer_id`).
            num_ranks, rank: that buffer's group size and rank.
            device: that buffer's device.
            what: the argument name used in the message.
            kind: the class the caller made, named in the message (``"deep_ep.Buffer"`` for the V1
                class, whose handles come from the `ElasticBuffer` inside it).
        """
        if self.buffer_id != buffer_id:
            owner = ("deep_ep.reference (no buffer)" if self.buffer_id < 0
                     else f"{kind} #{self.buffer_id}")
            raise ValueError(f"{what} was made by {owner}, but is used with {kind} #{buffer_id}: "
                             f"a handle only works with the buffer whose dispatch made it")
        if self.num_ranks != num_ranks or self.rank != rank:
            raise ValueError(f"{what} was made on rank {self.rank} of {self.num_ranks}, "
                             f"but this is rank {rank} of {num_ranks}")
        if self.topk_idx.device != (device if isinstance(device, torch.device) else torch.device(device)):
            raise ValueError(f"{what} tensors are on {self.device}, the buffer works on {device}")

    # ------------------------------------------------------------------ copies
    def clone(self) -> "EPHandle":
        """A deep copy: every tensor cloned, host values copied."""
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) or (f.name == "backend_state" and hasattr(v, "clone")):
                values[f.name] = v.clone()
            else:
                values[f.name] = copy.copy(v)
        return EPHandle(**values)

    def __repr__(self) -> str:  # compact: tensors by shape only
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                parts.append(f"{f.name}=<{str(v.dtype).replace('torch.', '')}{list(v.shape)}>")
            elif isinstance(v, list) and len(v) > 8:
                parts.append(f"{f.name}=<list[{len(v)}]>")
            else:
                parts.append(f"{f.name}={v!r}")
        return "EPHandle(" + ", ".join(parts) + ")"


_DEFAULTS = {f.name: f.default for f in fields(EPHandle) if f.default is not MISSING}


def collect_tensors(obj) -> list:
    """Every tensor inside nested tuples, lists and `EPHandle` objects: a handle's fields that are set, and
    its backend state's tensors, which the kernels read (a state lists them with ``tensors()``, or is a
    dataclass); a handle's `EPHandle.LAZY_FIELDS` are views of those. What a buffer keeps alive and
    records on streams for a call, and what an operator must not return."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in collect_tensors(o)]
    if callable(getattr(obj, "tensors", None)):
        return [t for o in obj.tensors() for t in collect_tensors(o)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for v in vars(obj).values() for t in collect_tensors(v)]
    return []
