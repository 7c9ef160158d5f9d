"""Layout of the symmetric window the GPU kernels use (one per rank, same offsets on every rank).

Owned by the GPU backend; the public API only asks it for sizes. Filled in by the GPU issue.
"""

BUFFER_ALIGNMENT = 2 * 1024 * 1024  # window sizes are rounded up to 2 MiB (NCCL's allocation granularity)


def buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                     use_fp8_dispatch: bool = False) -> int:
    """Bytes of symmetric window one rank needs; a multiple of 2 MiB. See the GPU backend."""
    raise NotImplementedError
