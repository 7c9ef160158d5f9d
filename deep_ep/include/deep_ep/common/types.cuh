// Fixed-width integer types and bf16 for every deep_ep header. NVRTC has no libc headers: there the
// types come from libcu++ (CCCL).
#pragma once

#include <cuda_bf16.h>
#ifdef __CUDACC_RTC__
#include <cuda/std/cstdint>
using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uint8_t;
#else
#include <stdint.h>
#endif
