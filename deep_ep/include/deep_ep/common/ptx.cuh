// Memory-model primitives and load/store flavours (inline PTX and intrinsics).
#pragma once

#include "tunables.cuh"
#include "types.cuh"

namespace deep_ep {

// Acquire load / release reduction at system scope: the signal protocol between ranks (a release
// increment makes every earlier write of this GPU visible to a peer that observes it with acquire).
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void red_release_sys_add(uint32_t* p, uint32_t v) {
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A release store of an absolute value (a flag with one writer).
__device__ __forceinline__ void st_release_sys_u32(uint32_t* p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The same for 64-bit flags written by one store (a tag and a value together).
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint32_t ld_volatile(const uint32_t* p) { return *reinterpret_cast<const volatile uint32_t*>(p); }

// 16-byte loads and stores that bypass L1: window memory is written by other GPUs and by other
// ranks' kernels.
__device__ __forceinline__ int4 ld_cg(const int4* p) { return __ldcg(p); }
__device__ __forceinline__ void st_cg(int4* p, const int4& v) { __stcg(p, v); }

// Read-only data of this kernel's caller (x, y): the non-coherent path is safe.
__device__ __forceinline__ int4 ld_nc(const int4* p) {
#if EP_LOAD_NO_L1
    int4 v;
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}

__device__ __forceinline__ void store_row_vec(int4* p, const int4& v) {
#if EP_STORE_STREAMING
    __stcs(p, v);
#else
    *p = v;
#endif
}

// Device-scope acquire / release of 64-bit words (the emulated GIN's queues and signals, one GPU).
__device__ __forceinline__ uint64_t ld_acquire_gpu_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_gpu_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

}  // namespace deep_ep
