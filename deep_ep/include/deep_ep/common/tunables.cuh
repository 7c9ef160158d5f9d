// The data kernels' build-time tunables and their defaults, all of them (the host's list is
// deep_ep/backends/gpu/modules.py's TUNABLES; DEEP_EP_KERNEL_DEFINES overrides them, tools/tune_gpu.py
// times variants). Each changes how bytes move, never which: every value gives the same outputs.
#pragma once

// 16-byte vectors per lane per chunk when moving a dispatched row (at most; 8 = 4 KiB per warp), and
// the same for the rows a combine sums (fp32 accumulators: 8 per vector). 0 = balanced: the fewest
// chunks of at most 8 vectors (combine: 7, or 4 where more would spill registers, see
// impls/combine_recv.cuh), all of equal size (common/copy.cuh, row_unroll).
#ifndef EP_SEND_UNROLL
#define EP_SEND_UNROLL 0
#endif
#ifndef EP_COMBINE_UNROLL
#define EP_COMBINE_UNROLL 0
#endif

// Vectors per lane per chunk (at most; evened out) of a combined token whose sum has one source row
// and no biases, which needs no accumulators across sources, so more of its loads can be in flight
// at once; 0 = such tokens take the path of every token (impls/combine_recv.cuh).
#ifndef EP_COMBINE_SINGLE_UNROLL
#define EP_COMBINE_SINGLE_UNROLL 8
#endif

// 1: loads of the caller's read-only rows (x, y) skip allocating in L1 (they are used once); 0: the
// plain non-coherent path (common/ptx.cuh, ld_nc).
#ifndef EP_LOAD_NO_L1
#define EP_LOAD_NO_L1 0
#endif

// 1: row data is stored with the evict-first hint (common/ptx.cuh, store_row_vec).
#ifndef EP_STORE_STREAMING
#define EP_STORE_STREAMING 0
#endif
