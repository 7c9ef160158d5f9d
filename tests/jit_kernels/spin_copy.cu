// A test kernel for the stream-ordering tests (tests/gpu/test_gpu_streams.py): every block waits
// `spin_ns` nanoseconds of GPU global time, then the grid copies `words` 32-bit words from `src` to
// `dst`. Queued ahead of a dispatch or combine on some stream, it rewrites that call's input long
// after the call was issued: a call that is not ordered after the stream reads the old values.
#include <cuda/std/cstdint>

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void spin_then_copy(const uint32_t* __restrict__ src, uint32_t* __restrict__ dst,
                                          int64_t words, uint64_t spin_ns) {
  if (threadIdx.x == 0) {
    const uint64_t start = global_time_ns();
    while (global_time_ns() - start < spin_ns) __nanosleep(1000);
  }
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride)
    dst[i] = src[i];
}
