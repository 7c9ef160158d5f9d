"""What the GPU kernels need beyond the public fields of an `EPHandle`."""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

__all__ = ["GPUHandleState", "WordPlan", "word_plan"]


class WordPlan(NamedTuple):
    """Where a fresh dispatch's int32 words hold each piece (one allocation of ``total`` words; offsets
    in words; every piece starts on a 128-byte boundary). Made by
    `word_plan`, cached per shape."""

    total: int
    layout_words: int   # the layout words (common/abi.cuh), at 0
    pos_tok_at: int     # pos_tok [T, R] (tokens, ranks)
    pos_pair_at: int    # pos_pair [T, K] (tokens, top-k; expanded, else an empty piece)
    meta_at: int        # recv_src_metadata [meta_rows, K + 2] (its rows known before the call; else empty)
    num_tokens: int
    num_ranks: int
    num_topk: int
    num_local_experts: int
    expanded: bool
    meta_rows: int
    tok_prefix: int     # the handle's three layout tensors: offsets inside the layout words
    psum_expert: int
    raw_counts: int

    def addresses(self, base: int) -> tuple:
        """``(pos_tok, pos_pair, recv_src_metadata)`` device addresses in words starting at ``base``;
        None for an empty or absent piece (as a kernel argument: no tensor)."""
        return (base + 4 * self.pos_tok_at if self.num_tokens * self.num_ranks else None,
                base + 4 * self.pos_pair_at if self.expanded and self.num_tokens * self.num_topk else None,
                base + 4 * self.meta_at if self.meta_rows else None)


def _align_words(num_words: int) -> int:
    """``num_words`` int32 words rounded up to a multiple of 32 (128 bytes)."""
    return (num_words + 31) // 32 * 32


@functools.lru_cache(maxsize=256)
def word_plan(layout_index, num_ranks: int, num_local_experts: int, num_tokens: int, num_topk: int, expanded: bool,
              meta_rows: int) -> WordPlan:
    """How a fresh dispatch's int32 words are laid out (`WordPlan`): the layout words (their offsets
    from ``layout_index``, `abi.layout_index`), pos_tok ``[T * R]``, pos_pair ``[T * K]`` (empty
    unless expanded), recv_src_metadata ``[meta_rows * (K + 2)]`` (where its rows are known before
    the call: without CPU sync the worst case; else empty), each starting on a 128-byte boundary as a tensor of its own
    would. The kernels get addresses inside the one allocation; the tensor views are made only when
    read (`GPUHandleState`)."""
    starts = []
    end = 0
    for size in (layout_index.size, num_tokens * num_ranks, num_tokens * num_topk if expanded else 0,
                 meta_rows * (num_topk + 2)):
        starts.append(end)
        end = _align_words(end + size)
    return WordPlan(total=end, layout_words=layout_index.size, pos_tok_at=starts[1], pos_pair_at=starts[2],
                    meta_at=starts[3], num_tokens=num_tokens, num_ranks=num_ranks, num_topk=num_topk,
                    num_local_experts=num_local_experts, expanded=bool(expanded), meta_rows=meta_rows,
                    tok_prefix=layout_index.tok_prefix, psum_expert=layout_index.psum_expert,
                    raw_counts=layout_index.raw_counts)


class GPUHandleState:
    """What the kernels need beyond `EPHandle`'s public fields (device tensors and their addresses).

    words:         the dispatch's one int32 allocation: the layout words (common/abi.cuh, this rank
                   as destination and as source), pos_tok, pos_pair, (when its rows are known
                   before the call) recv_src_metadata, laid out by ``plan`` (`WordPlan`)
    recv_topk_idx: the non-expanded dispatch's recv_topk_idx, returned again by a cached dispatch
    launches:      prepared kernel launches of cached dispatches and combines with this handle
                   (`jit.PreparedLaunch`, keyed by kernel structure and options; not copied by `clone`):
                   their arguments point at this handle's tensors, so a later call with the handle
                   only updates the per-call pointers (inputs, outputs); the handle's own memo
                   (`EPHandle.launch_memo`) finds them first, by the call's options alone

    Views (made on first access, then kept): ``layout`` (the layout words), ``pos_tok`` [T, R] int32
    (token row of each token at each destination, -1: not sent), ``pos_pair`` [T, K] int32 (expanded:
    output row of each (token, slot) pair at its expert's owner; else None), ``src_meta`` (the
    handle's recv_src_metadata: its columns 2.. are the expanded rows of every received token row,
    which cached dispatch and combine read). Their addresses, for the kernels' arguments, are plain
    ints: ``layout_ptr``, ``pos_tok_ptr``, ``pos_pair_ptr``, ``src_meta_ptr`` (None for an empty or
    absent piece), ``tok_capacity`` (rows of ``src_meta``), and ``scaleup_ranks`` (hybrid mode across
    nodes: the ranks of a node, over which ``psum_num_recv_tokens_per_scaleup_rank`` counts; 0: per
    source rank).
    """

    __slots__ = ("words", "plan", "recv_topk_idx", "launches", "layout_ptr", "pos_tok_ptr", "pos_pair_ptr",
                 "src_meta_ptr", "tok_capacity", "scaleup_ranks", "_src_meta", "_views")

    def __init__(self, words: torch.Tensor, plan: WordPlan, recv_topk_idx: Optional[torch.Tensor],
                 src_meta: Optional[torch.Tensor], tok_capacity: int, addresses: Optional[tuple] = None,
                 scaleup_ranks: int = 0):
        """``src_meta``: recv_src_metadata as a tensor of its own, or None when it lives in ``words``
        (``plan``'s meta piece: its first ``tok_capacity`` rows, at most ``plan.meta_rows``).
        ``addresses``: ``words``' address and ``plan.addresses`` of it, where the caller has them
        (a fresh dispatch, which gave them to its kernels); None: computed here."""
        self.words, self.plan, self.recv_topk_idx = words, plan, recv_topk_idx
        self.launches = {}
        self._src_meta, self._views = src_meta, {}
        self.tok_capacity = tok_capacity
        self.scaleup_ranks = scaleup_ranks
        if addresses is None:
            layout_ptr = words.data_ptr()
            addresses = (layout_ptr,) + plan.addresses(layout_ptr)
        self.layout_ptr, self.pos_tok_ptr, self.pos_pair_ptr, self.src_meta_ptr = addresses
        if src_meta is not None:
            self.src_meta_ptr = src_meta.data_ptr() if src_meta.numel() else None

    # ------------------------------------------------------------------ views
    def _view(self, name: str) -> Optional[torch.Tensor]:
        views = self._views
        if name in views:
            return views[name]
        plan, words = self.plan, self.words
        if name == "layout":
            view = words[:plan.layout_words]
        elif name == "pos_tok":
            view = words[plan.pos_tok_at: plan.pos_tok_at + plan.num_tokens * plan.num_ranks].view(
                plan.num_tokens, plan.num_ranks)
        elif name == "pos_pair":
            view = words[plan.pos_pair_at: plan.pos_pair_at + plan.num_tokens * plan.num_topk].view(
                plan.num_tokens, plan.num_topk) if plan.expanded else None
        elif name == "src_meta":   # in the words: their first tok_capacity rows (of meta_rows)
            rows = self.tok_capacity
            view = self._src_meta if self._src_meta is not None else \
                words[plan.meta_at: plan.meta_at + rows * (plan.num_topk + 2)].view(rows, plan.num_topk + 2)
        elif name == "tok_prefix":
            view = words[plan.tok_prefix: plan.tok_prefix + plan.num_ranks]
        elif name == "psum_expert":
            view = words[plan.psum_expert: plan.psum_expert + plan.num_local_experts]
        elif name == "raw_counts":
            view = words[plan.raw_counts: plan.raw_counts + plan.num_local_experts]
        else:
            raise AttributeError(name)
        views[name] = view
        return view

    @property
    def layout(self) -> torch.Tensor:
        return self._view("layout")

    @property
    def pos_tok(self) -> torch.Tensor:
        return self._view("pos_tok")

    @property
    def pos_pair(self) -> Optional[torch.Tensor]:
        return self._view("pos_pair")

    @property
    def src_meta(self) -> torch.Tensor:
        return self._view("src_meta")

    @property
    def computed_fields(self) -> tuple:
        """The `EPHandle.LAZY_FIELDS` that `handle_field` computes rather than views (a handle makes
        them again at every access, so a CUDA graph's replays show in them)."""
        return ("psum_num_recv_tokens_per_scaleup_rank",) if self.scaleup_ranks else ()

    def handle_field(self, name: str) -> torch.Tensor:
        """The `EPHandle` field ``name`` (one of `EPHandle.LAZY_FIELDS`) as a view of this state: a GPU
        dispatch's handle makes them on first access (`EPHandle.with_lazy_fields`), so that a call
        that never reads them never pays for the views."""
        if name == "psum_num_recv_tokens_per_scaleup_rank":
            prefix = self._view("tok_prefix")
            if not self.scaleup_ranks:
                return prefix
            # hybrid mode across nodes: entry j sums the tokens from rank j of every node (DeepEP's)
            counts = torch.diff(prefix, prepend=prefix.new_zeros(1))
            return torch.cumsum(counts.view(-1, self.scaleup_ranks).sum(0), 0).to(torch.int32)
        if name == "psum_num_recv_tokens_per_expert":
            return self._view("psum_expert")
        if name == "num_unaligned_recv_tokens_per_expert":
            return self._view("raw_counts")
        if name == "dst_buffer_slot_idx":
            return self._view("pos_pair" if self.plan.expanded else "pos_tok")
        if name == "recv_src_metadata":
            return self._view("src_meta")
        raise AttributeError(name)

    def tensors(self) -> list:
        """The tensors the kernels read (every view of this state is a view of one of them): what a
        caller keeps alive or records on a stream for the handle (`deep_ep.handle.collect_tensors`)."""
        return [tensor for tensor in (self.words, self.recv_topk_idx, self._src_meta) if tensor is not None]

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict:
        """Copies and pickles leave the prepared launches behind (ctypes memory pointing at the
        original's tensors), and the views (made again from the copy's tensors)."""
        return {"words": self.words, "plan": tuple(self.plan), "recv_topk_idx": self.recv_topk_idx,
                "src_meta": self._src_meta, "tok_capacity": self.tok_capacity, "scaleup_ranks": self.scaleup_ranks}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["words"], WordPlan(*state["plan"]), state["recv_topk_idx"], state["src_meta"],
                      state["tok_capacity"], scaleup_ranks=state.get("scaleup_ranks", 0))

    def clone(self) -> "GPUHandleState":
        """A copy with every tensor cloned (for `EPHandle.clone`); no launches."""
        return GPUHandleState(self.words.clone(), self.plan,
                              None if self.recv_topk_idx is None else self.recv_topk_idx.clone(),
                              None if self._src_meta is None else self._src_meta.clone(), self.tok_capacity,
                              scaleup_ranks=self.scaleup_ranks)

