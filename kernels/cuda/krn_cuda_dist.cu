/* krn_cuda_dist.cu — next-token distributions: softmax over the vocabulary and its top k.
 *
 * Owns: krn_cuda_topk, its tensor-parallel form krn_cuda_topk_shifted, krn_cuda_row_max. One
 * block per row. The softmax's max (of the numbers: NaN is left out),
 * the first index holding it and the sum are block reductions; the probabilities are written
 * over the logits. The k-th largest probability is found by a radix select over 32-bit keys
 * that order the probabilities (NaN below every number: key 0), four 8-bit passes with a
 * 256-bin histogram, so nothing is sorted but the k candidates: those above the threshold,
 * plus the lowest-id ones equal to it (equal probabilities — underflowed zeros too — go to the
 * lower id, as on the CPU backend). The candidates (k <= 1024) are sorted with a bitonic sort
 * in shared memory. Ranking the probabilities rather than the logits is what makes ties of
 * different logits (zeros) fall in id order; the edges (+inf, NaN, temperatures whose inverse
 * overflows) are krn_cpu_softmax's, checked by tests/kcheck's reference. */
#include <math.h>

#include "krn_cuda.h"
#include "krn_cuda_impl.cuh"

#define TOPK_THREADS 1024

/* Larger probability → larger key; NaN → 0, below every number. p >= 0 (never -0: every
 * probability is a product of non-negative numbers or an assigned +0 / 1). */
__device__ __forceinline__ uint32_t order_key(float p) {
    return isnan(p) ? 0u : (__float_as_uint(p) | 0x80000000u);
}

/* (key desc, id asc): true when a comes before b. */
__device__ __forceinline__ bool before(uint32_t ka, uint32_t ia, uint32_t kb, uint32_t ib) {
    return ka > kb || (ka == kb && ia < ib);
}

/* Exclusive prefix sum over the block of one value per thread (TOPK_THREADS threads). */
__device__ static uint32_t block_exclusive_scan(uint32_t v, uint32_t *warp_tot) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        uint32_t n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) warp_tot[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        uint32_t t = warp_tot[lane], s = t;
        for (int o = 1; o < 32; o <<= 1) {
            uint32_t n = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += n;
        }
        warp_tot[lane] = s - t; /* exclusive over warps */
    }
    __syncthreads();
    return warp_tot[warp] + inc - v;
}

/* The smallest value over the block (blockDim.x == TOPK_THREADS); every thread gets it. */
__device__ static int block_min_int(int v, int *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[lane];
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__global__ static void __launch_bounds__(TOPK_THREADS)
    topk_kernel(float *logits, int vocab, const float *temp, const int32_t *kk, uint32_t *ids,
                float *probs, const float *shift, float *sums) {
    __shared__ float red[32];
    __shared__ int red_i[32];
    __shared__ uint32_t hist[256];
    __shared__ uint32_t cand_key[KRN_CUDA_TOPK_MAX], cand_id[KRN_CUDA_TOPK_MAX];
    __shared__ uint32_t sel[3]; /* prefix, remaining, greater-count cursor */
    __shared__ uint32_t warp_tot[32];
    const int tid = threadIdx.x;
    float *x = logits + (size_t)blockIdx.x * vocab;
    const int k = kk[blockIdx.x];
    const float t = temp[blockIdx.x], inv_t = 1.0f / t;

    float m;
    int arg = vocab;
    bool one_hot;
    if (!shift) {
        /* the largest number (fmaxf drops NaN) and the first index holding it */
        m = -INFINITY;
        for (int i = tid; i < vocab; i += TOPK_THREADS) m = fmaxf(m, x[i]);
        m = krn_block_max(m, red);
        for (int i = tid; i < vocab && arg == vocab; i += TOPK_THREADS)
            if (x[i] == m) arg = i;
        arg = block_min_int(arg, red_i); /* vocab: every logit NaN */
        one_hot = !(t > 0.0f) || isinf(m) || isinf(inv_t);
    } else {
        /* krn_cuda_topk_shifted: the whole row's maximum is given (NaN: no number anywhere);
         * in the limits the 1 goes to the first one only in the slice that holds it */
        m = shift[2 * blockIdx.x];
        one_hot = !isnan(m) && (!(t > 0.0f) || isinf(m) || isinf(inv_t));
        if (one_hot && shift[2 * blockIdx.x + 1] != 0.0f) { /* the same for the whole block */
            for (int i = tid; i < vocab && arg == vocab; i += TOPK_THREADS)
                if (x[i] == m) arg = i;
            arg = block_min_int(arg, red_i);
        }
    }
    float s = 0.0f;
    if (!one_hot) {
        for (int i = tid; i < vocab; i += TOPK_THREADS)
            if (!isnan(x[i])) s += expf((x[i] - m) * inv_t);
        s = krn_block_sum(s, red);
    }
    if (sums && tid == 0) sums[blockIdx.x] = one_hot ? (arg < vocab ? 1.0f : 0.0f) : s;
    /* the probabilities, over the logits: each thread rewrites only elements it alone reads
     * (shifted: the exponentials, not normalised) */
    const float inv_s = one_hot ? 0.0f : shift ? 1.0f : 1.0f / s;
    for (int i = tid; i < vocab; i += TOPK_THREADS) {
        float v = x[i];
        if (isnan(v)) continue;
        x[i] = one_hot ? (i == arg ? 1.0f : 0.0f) : expf((v - m) * inv_t) * inv_s;
    }
    __syncthreads(); /* the passes below read every element */

    /* radix select: the key of the k-th largest probability */
    uint32_t prefix = 0, mask = 0;
    if (tid == 0) sel[1] = (uint32_t)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += TOPK_THREADS) hist[b] = 0;
        __syncthreads();
        for (int i = tid; i < vocab; i += TOPK_THREADS) {
            uint32_t key = order_key(x[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            uint32_t remaining = sel[1], above = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (above + hist[b] >= remaining) break;
                above += hist[b];
            }
            sel[0] = prefix | ((uint32_t)b << shift);
            sel[1] = remaining - above;
        }
        __syncthreads();
        prefix = sel[0];
        mask |= 255u << shift;
    }
    const uint32_t thr = prefix, need_eq = sel[1], n_greater = (uint32_t)k - need_eq;

    /* candidates: every key above thr (any order), then the first need_eq keys equal to it */
    if (tid == 0) sel[2] = 0;
    __syncthreads();
    const int chunk = (vocab + TOPK_THREADS - 1) / TOPK_THREADS;
    const int lo = min(vocab, tid * chunk), hi = min(vocab, lo + chunk);
    uint32_t n_eq = 0;
    for (int i = lo; i < hi; i++) {
        uint32_t key = order_key(x[i]);
        if (key > thr) {
            uint32_t at = atomicAdd(&sel[2], 1u);
            cand_key[at] = key;
            cand_id[at] = (uint32_t)i;
        } else if (key == thr) {
            n_eq++;
        }
    }
    uint32_t rank = block_exclusive_scan(n_eq, warp_tot);
    for (int i = lo; i < hi && rank < need_eq; i++) {
        uint32_t key = order_key(x[i]);
        if (key == thr) {
            cand_key[n_greater + rank] = key;
            cand_id[n_greater + rank] = (uint32_t)i;
            rank++;
        }
    }
    int p2 = 1;
    while (p2 < k) p2 <<= 1;
    for (int i = k + tid; i < p2; i += TOPK_THREADS) cand_key[i] = 0, cand_id[i] = 0xffffffffu;
    __syncthreads();

    /* bitonic sort of p2 <= 1024 candidates, one element per thread */
    for (int size = 2; size <= p2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            int i = tid, j = tid ^ stride;
            if (i < p2 && j > i) {
                bool up = (i & size) == 0; /* this half is ordered "before"-first */
                bool swap = up ? before(cand_key[j], cand_id[j], cand_key[i], cand_id[i])
                               : before(cand_key[i], cand_id[i], cand_key[j], cand_id[j]);
                if (swap) {
                    uint32_t tk = cand_key[i], ti = cand_id[i];
                    cand_key[i] = cand_key[j], cand_id[i] = cand_id[j];
                    cand_key[j] = tk, cand_id[j] = ti;
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += TOPK_THREADS) {
        uint32_t id = cand_id[i];
        ids[(size_t)blockIdx.x * KRN_CUDA_TOPK_MAX + i] = id;
        probs[(size_t)blockIdx.x * KRN_CUDA_TOPK_MAX + i] = x[id];
    }
}

extern "C" cudaError_t krn_cuda_topk(float *logits, int n, int vocab, const float *temp,
                                     const int32_t *k, uint32_t *ids, float *probs,
                                     cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    topk_kernel<<<n, TOPK_THREADS, 0, stream>>>(logits, vocab, temp, k, ids, probs, NULL, NULL);
    return cudaGetLastError();
}

extern "C" cudaError_t krn_cuda_topk_shifted(float *logits, int n, int vocab, const float *temp,
                                             const int32_t *k, const float *shift, uint32_t *ids,
                                             float *vals, float *sums, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    topk_kernel<<<n, TOPK_THREADS, 0, stream>>>(logits, vocab, temp, k, ids, vals, shift, sums);
    return cudaGetLastError();
}

/* One block per row: the largest number (NaN left out), NaN when there is none. */
__global__ static void __launch_bounds__(TOPK_THREADS)
    row_max_kernel(const float *x, int vocab, float *out) {
    __shared__ float red[32];
    __shared__ int red_i[32];
    const float *row = x + (size_t)blockIdx.x * vocab;
    float m = -INFINITY;
    int none = 1;
    for (int i = threadIdx.x; i < vocab; i += TOPK_THREADS)
        if (!isnan(row[i])) m = fmaxf(m, row[i]), none = 0;
    m = krn_block_max(m, red);
    none = block_min_int(none, red_i); /* 0: some thread saw a number */
    if (threadIdx.x == 0) out[blockIdx.x] = none ? __int_as_float(0x7fc00000) : m;
}

extern "C" cudaError_t krn_cuda_row_max(const float *x, int n, int vocab, float *out,
                                        cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    row_max_kernel<<<n, TOPK_THREADS, 0, stream>>>(x, vocab, out);
    return cudaGetLastError();
}
