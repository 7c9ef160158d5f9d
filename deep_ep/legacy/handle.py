"""DeepEP's V1 intranode handle: the 6-tuple its ``dispatch`` returns and ``combine`` takes (the
internode one, a 10-tuple, is `deep_ep.legacy.internode.InternodeHandle`)."""
from __future__ import annotations

__all__ = ["LegacyHandle"]


class LegacyHandle(tuple):
    """DeepEP's V1 intranode handle: a 6-tuple ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``, plus the `EPHandle`
    of the dispatch behind it in ``ep_handle`` (callers pass the tuple back as it is).

    ``R`` ranks, ``C`` = ``config.num_channels`` of the dispatch, token ``t`` of this rank in channel
    ``t // ceil(T / C)`` (DeepEP's split), ``N[s, d]`` tokens rank ``s`` sends to rank ``d``:
        rank_prefix_matrix          int32 [R, R]  ``sum_{s' <= s} N[s', d]`` (the same on every rank)
        channel_prefix_matrix       int32 [R, C]  per destination, inclusive prefix over channels of
                                    this rank's tokens sent there
        recv_channel_prefix_matrix  int32 [R, C]  per source rank, exclusive prefix over that source's
                                    channels of the tokens it sent here (offsets inside its block)
        recv_src_idx                int32 [rows]  the source token of each received row (-1 past the
                                    true count with ``num_worst_tokens``)
        is_token_in_rank            bool  [T, R]  the dispatch's routing
        send_head                   int32 [T, R]  the row token ``t`` landed in at rank ``d`` (-1: not
                                    sent). DeepEP holds a ring-buffer slot there; only the role is shared.
    """

    def __new__(cls, items: tuple, ep_handle, num_rows: int):
        handle = super().__new__(cls, items)
        handle.ep_handle = ep_handle
        handle.num_rows = num_rows
        return handle

    @property
    def is_token_in_rank(self):
        """The dispatch's routing, bool ``[T, R]`` (item 4 of the intranode handle, 0 of the internode one)."""
        return self[4] if len(self) == 6 else self[0]
