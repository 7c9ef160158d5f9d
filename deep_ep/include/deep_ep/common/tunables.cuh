// The data kernels' build-time tunables and their defaults, all of them (the host's list is
// deep_ep/backends/gpu/modules.py's TUNABLES; DEEP_EP_KERNEL_DEFINES overrides them, tools/tune_gpu.py
// times variants). Each changes how bytes move, never which: every value gives the same outputs.
#pragma once

// 16-byte vectors per lane per chunk (at most) moving a dispatched row, or summing combine rows (8
// fp32 accumulators per vector). 0 = the fewest equal chunks of at most 8 (combine: 7, or 4 where
// more would spill registers, impls/combine_recv.cuh); see common/copy.cuh, row_unroll.
#ifndef EP_SEND_UNROLL
#define EP_SEND_UNROLL 0
#endif
#ifndef EP_COMBINE_UNROLL
#define EP_COMBINE_UNROLL 0
#endif

// The same for a combined token with one source row and no biases: no accumulators across sources,
// so more loads can be in flight; 0 = such tokens take the general path (impls/combine_recv.cuh).
#ifndef EP_COMBINE_SINGLE_UNROLL
#define EP_COMBINE_SINGLE_UNROLL 8
#endif

// 1: loads of the caller's read-only rows (x, y) skip allocating in L1 (they are used once).
#ifndef EP_LOAD_NO_L1
#define EP_LOAD_NO_L1 0
#endif

// 1: row data is stored with the evict-first hint (common/ptx.cuh, store_row_vec).
#ifndef EP_STORE_STREAMING
#define EP_STORE_STREAMING 0
#endif
