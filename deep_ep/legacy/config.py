"""DeepEP's V1 ``Config`` (performance settings and buffer size hints)."""
from __future__ import annotations

from .. import checks

__all__ = ["Config", "NUM_MAX_NVL_PEERS", "DISPATCH_CONFIGS", "COMBINE_CONFIGS", "recommended_config"]

#: ranks of one NVLink domain in DeepEP's V1 (above it V1 goes internode)
NUM_MAX_NVL_PEERS = 8
#: room DeepEP's V1 size hints keep per token for top-k entries and scale factors
_HINT_MAX_TOPK = 128
_HINT_MAX_SCALES = 128
#: bytes of DeepEP's internode source metadata per token, part of its NVLink size hint
_HINT_SOURCE_META_BYTES = 8
#: top-k the window behind `Config.get_nvl_buffer_size_hint` is sized for
_HINT_NUM_TOPK = 8
#: bytes of DeepEP's int4 control word per RDMA token slot, part of its RDMA size hint
_HINT_INT4_BYTES = 16
#: DeepEP's recommended configs by rank count: ``(nvl send, nvl recv, rdma send, rdma recv)`` chunk sizes
DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                    160: (28, 720, 12, 128)}
COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                   96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def recommended_config(table: dict, num_ranks: int, num_sms: int) -> "Config":
    """``Config(num_sms, *table[num_ranks])``. Raises ValueError for a rank count outside ``table``."""
    if num_ranks not in table:
        raise ValueError(f"Unsupported number of EP ranks: {num_ranks} (supported: {sorted(table)})")
    return Config(num_sms, *table[num_ranks])


class Config:
    """DeepEP's V1 performance config (the constructor's arguments and defaults are DeepEP's).

    deep_ep's kernels have no chunked ring buffers: ``num_sms`` is passed on as the dispatch's SM
    count (0 = automatic), the chunk sizes only size the buffers in the hints below.

    Args:
        num_sms: SMs of the high-throughput kernels (even; two per channel), default 20.
        num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens: default 6 and 256, send < recv.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: default 6 and 256; the
            receive count is rounded up to a multiple of the send count, and must then be at least twice it.

    Raises:
        TypeError / ValueError: DeepEP's constraints above.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        checks.check_int("num_sms", num_sms, minimum=0)
        checks.check_int("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, minimum=1)
        checks.check_int("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, minimum=1)
        checks.check_int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, minimum=1)
        checks.check_int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, minimum=1)
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"num_max_nvl_chunked_send_tokens ({num_max_nvl_chunked_send_tokens}) must be less than "
                             f"num_max_nvl_chunked_recv_tokens ({num_max_nvl_chunked_recv_tokens})")
        send = num_max_rdma_chunked_send_tokens
        num_max_rdma_chunked_recv_tokens = -(-num_max_rdma_chunked_recv_tokens // send) * send
        if send > num_max_rdma_chunked_recv_tokens // 2:
            raise ValueError(f"num_max_rdma_chunked_send_tokens ({send}) must be at most half of "
                             f"num_max_rdma_chunked_recv_tokens ({num_max_rdma_chunked_recv_tokens}, rounded up "
                             f"to a multiple of the send count)")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    @property
    def num_channels(self) -> int:
        """DeepEP's channels: ``num_sms // 2`` (at least 1), the columns of a handle's channel matrices."""
        return max(self.num_sms // 2, 1)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``num_nvl_bytes`` for tokens of ``hidden_bytes`` bytes over ``num_ranks`` ranks: the
        larger of DeepEP's V1 size and deep_ep's window (`ElasticBuffer`'s GPU window, for
        ``num_channels * num_max_nvl_chunked_recv_tokens`` tokens per rank of bf16 hidden
        ``hidden_bytes // 2`` and top-k 8); a multiple of 128.

        Raises:
            TypeError / ValueError: non-positive sizes, or ``num_ranks`` above 8 and not a multiple of 8.
        """
        checks.check_int("hidden_bytes", hidden_bytes, minimum=1, maximum=None)
        checks.check_int("num_ranks", num_ranks, minimum=1)
        if num_ranks > NUM_MAX_NVL_PEERS and num_ranks % NUM_MAX_NVL_PEERS:
            raise ValueError(f"num_ranks above {NUM_MAX_NVL_PEERS} must be a multiple of it, got {num_ranks}")
        num_rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        num_nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_channels * num_nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        deepep = self.num_channels * num_nvl_ranks * (2 * num_rdma_ranks + 3) * 4
        deepep += slots * (hidden_bytes + _HINT_SOURCE_META_BYTES + _HINT_MAX_TOPK * (8 + 4) + _HINT_MAX_SCALES * 4)
        from ..backends.gpu import window as window_layout
        ours = window_layout.buffer_size_hint(num_nvl_ranks, self.num_channels * self.num_max_nvl_chunked_recv_tokens,
                                              max(hidden_bytes // 2, 1), _HINT_NUM_TOPK)
        return -(-max(deepep, ours) // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``num_rdma_bytes``, DeepEP's formula: 0 within one node of 8 (``num_ranks <= 8``);
        above, for ``num_ranks / 8`` nodes, two sets (send, receive) of ``num_channels *
        num_max_rdma_chunked_recv_tokens`` token slots per node (hidden bytes, source metadata, 128
        top-k ids and weights, 128 scales, a control word) and the channels' counters; a multiple of
        128. deep_ep's normal mode does not use it (its windows are sized by ``num_nvl_bytes`` or per
        call), so any value is accepted at `Buffer` creation.

        Raises:
            TypeError / ValueError: bad sizes, ``num_ranks`` above 8 and not a multiple of 8.
        """
        checks.check_int("hidden_bytes", hidden_bytes, minimum=1, maximum=None)
        checks.check_int("num_ranks", num_ranks, minimum=1)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS:
            raise ValueError(f"num_ranks above {NUM_MAX_NVL_PEERS} must be a multiple of it, got {num_ranks}")
        slots = self.num_channels * (num_ranks // NUM_MAX_NVL_PEERS) * self.num_max_rdma_chunked_recv_tokens
        per_token = (hidden_bytes + _HINT_SOURCE_META_BYTES + _HINT_MAX_TOPK * (8 + 4) + _HINT_MAX_SCALES * 4
                     + _HINT_INT4_BYTES)
        counters = self.num_channels * (num_ranks // NUM_MAX_NVL_PEERS) * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        return -(-(counters + 2 * slots * per_token) // 128) * 128

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")
