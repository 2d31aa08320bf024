/* krn_cuda_impl.cuh — device helpers shared by the kernels of kernels/cuda (not part of the C
 * interface): bf16 <-> f32 with round-to-nearest-even, and warp / block reductions. */
#ifndef KRN_CUDA_IMPL_CUH
#define KRN_CUDA_IMPL_CUH

#include <stdint.h>

#include "krn_cuda.h"

__device__ __forceinline__ float krn_bf16_to_f32(krn_bf16 h) {
    return __uint_as_float((uint32_t)h << 16);
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays a quiet NaN. */
__device__ __forceinline__ krn_bf16 krn_f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (krn_bf16)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (krn_bf16)(u >> 16);
}

/* 8 bf16 (16 bytes) → 8 f32. */
__device__ __forceinline__ void krn_unpack8(uint4 v, float *f) {
    uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ float krn_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float krn_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
 * red: 32 floats of shared memory. */
__device__ __forceinline__ float krn_block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = krn_warp_sum(v);
    __syncthreads(); /* red may still be read by a previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return krn_warp_sum(v);
}

__device__ __forceinline__ float krn_block_max(float v, float *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = krn_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : -INFINITY;
    return krn_warp_max(v);
}

#endif
