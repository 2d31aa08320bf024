/* krn_cuda_impl.cuh — device helpers shared by the kernels of kernels/cuda (not part of the C
 * interface): bf16 <-> f32 with round-to-nearest-even, warp / block reductions, and what both
 * attention kernels (krn_cuda_attn.cu, krn_cuda_attn_tc.cu) read the same way: key visibility
 * (explicit mask runs, page masks) and K/V vectors. */
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

/* Row state of an explicit mask while keys advance: run index, where that run starts, and
 * whether it is a visible run. */
typedef struct krn_run_state {
    int32_t cur, beg, visible;
} krn_run_state;

/* Advances st so that its run contains key t (t < the row's length). */
__device__ __forceinline__ void krn_run_seek(krn_run_state *st, const uint32_t *runs, int t) {
    while (st->beg + (int)runs[st->cur] <= t) {
        st->beg += (int)runs[st->cur];
        st->cur++;
        st->visible ^= 1;
    }
}

/* Visibility bits of keys [k0, k0 + nk) for tile row r (nk <= the bits of Bits): causality
 * (or the explicit mask row's length), the explicit mask's runs, the page mask for keys below
 * pm_ctx. */
template <typename Bits>
__device__ __forceinline__ Bits krn_attn_row_vis(const krn_cuda_attn_args &a,
                                                 const krn_cuda_attn_tile &t, int r, int k0, int nk,
                                                 krn_run_state *st) {
    int len = t.q_seq + r + 1; /* keys this row may see at most */
    const uint32_t *pages = a.page_list + t.pages;
    Bits bits = 0;
    for (int j = 0; j < nk; j++) {
        int key = k0 + j;
        if (key >= len) break;
        int vis = 1;
        if (t.mask_row >= 0) {
            krn_run_seek(st, a.runs, key);
            vis = st->visible;
        }
        if (vis && key < t.pm_ctx) {
            uint32_t page = pages[key / a.page_size];
            vis = a.page_mask[(size_t)page * a.page_size + key % a.page_size] == 0;
        }
        bits |= (Bits)vis << j;
    }
    return bits;
}

/* Key (which = 0) or value (which = 1) vector of sequence index key for kv head kvh: from the
 * tile's pages below n_ctx, from the batch's own K/V rows (the tail) above. */
__device__ __forceinline__ const krn_bf16 *
krn_attn_kv(const krn_cuda_attn_args &a, const krn_cuda_attn_tile &t, int key, int kvh, int which) {
    int kvd = a.n_kv_heads * a.hd;
    if (key < t.n_ctx) {
        size_t page = a.page_list[t.pages + key / a.page_size];
        size_t off = (size_t)(key % a.page_size);
        size_t ps = (size_t)a.page_size;
        return a.kv + ((page * 2 + which) * ps + off) * (size_t)kvd + (size_t)kvh * a.hd;
    }
    const krn_bf16 *tail = which ? a.vb : a.kb;
    return tail + (size_t)(t.tail_row + key - t.n_ctx) * kvd + (size_t)kvh * a.hd;
}

#endif
