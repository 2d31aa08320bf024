/* krn_cuda_attn.cu — paged attention over layer-major bf16 KV pages (krn_cuda_attention).
 *
 * Owns: one kernel for prefill, append and decode, and the merge of split-KV partials.
 * A block takes one tile (up to KRN_CUDA_ATTN_QVECS / group query rows of one sequence) for one
 * KV head: all query heads of the group share every key and value it loads (GQA), and for a
 * prefill the rows of the tile share them too. Keys stream through shared memory in tiles of
 * ATT_KT: the page lookups of a tile's keys first (one per key, in parallel), then all of its K
 * and V loaded in one batch of 16-byte loads per thread; each lane scores one key, the softmax is online (running max and sum per query), and
 * each lane accumulates head_dim / 32 output dimensions. Split-KV (decode over long contexts:
 * too few tiles to fill the GPU): the grid has n_splits blocks per (tile, KV head) in z, and a
 * tile with n_split > 1 uses the first n_split of them, each over one chunk of its keys, writing
 * an unnormalised partial; merge_kernel combines them (flash-decoding). Blocks beyond a tile's
 * n_split return at once, so the split count of each tile is table data and one launch shape
 * (a captured graph) serves every split count. Shared memory: q and one K/V tile in f32, sized
 * by head_dim (96 KiB at 256, 48 KiB at 128), checked against the device by krn_cuda_init.
 * Visibility of key t for tile row r: t <= q_seq + r (causality, or the length of an explicit
 * mask row, which covers exactly that many tokens), the explicit mask's runs when there is one,
 * and the page mask for t < pm_ctx. Does not own: which rows form a tile (the engine). */
#include <math.h>

#include "krn_cuda.h"
#include "krn_cuda_impl.cuh"

#define ATT_THREADS 128
#define ATT_WARPS   (ATT_THREADS / 32)
#define ATT_KT      32 /* keys per shared-memory tile: one per lane */
#define ATT_QPW     (KRN_CUDA_ATTN_QVECS / ATT_WARPS) /* query vectors per warp */
#define ATT_LDG     4 /* 16-byte chunks of K and of V a thread loads at once (head_dim 128: all) */
/* Blocks per SM the registers allow (128 a thread), what the split count plans for; 3 at
 * head_dim > 128, whose 8 accumulators per query would spill at 128. */
#define ATT_MIN_BLOCKS 4

static size_t attn_smem_bytes(int hd) {
    return ((size_t)KRN_CUDA_ATTN_QVECS * hd + 2 * (size_t)ATT_KT * (hd + 1)) * sizeof(float);
}

extern "C" int krn_cuda_attn_tile_rows(int n_heads, int n_kv_heads) {
    int g = n_kv_heads > 0 ? n_heads / n_kv_heads : 1;
    int rows = g > 0 ? KRN_CUDA_ATTN_QVECS / g : 1;
    return rows > 0 ? rows : 1;
}

/* How many of the launch's split blocks tile t uses (1: not split). */
__device__ __forceinline__ int attn_tile_splits(const krn_cuda_attn_args &a,
                                                const krn_cuda_attn_tile &t) {
    return a.n_splits > 1 && t.n_split > 1 ? min(t.n_split, a.n_splits) : 1;
}

/* DL: output dims per lane, head_dim / 32 rounded up to 1, 2, 4 or 8 (the accumulators are
 * ATT_QPW x DL registers: sized for the model's head_dim, not the largest one). */
template <int DL>
__global__ static void __launch_bounds__(ATT_THREADS, DL == 8 ? ATT_MIN_BLOCKS - 1 : ATT_MIN_BLOCKS)
    attn_kernel(krn_cuda_attn_args a) {
    const krn_cuda_attn_tile t = a.tiles[blockIdx.x];
    const int n_split = attn_tile_splits(a, t);
    if (t.n_q <= 0 || (int)blockIdx.z >= n_split) return; /* the whole block: no barrier */
    extern __shared__ float smem[];
    __shared__ uint32_t vis[KRN_CUDA_ATTN_QVECS];
    __shared__ krn_run_state rs[KRN_CUDA_ATTN_QVECS];
    __shared__ const krn_bf16 *kvp[2][ATT_KT]; /* K, V row of each key of the current tile */
    const int hd = a.hd, hd1 = hd + 1, g = a.n_heads / a.n_kv_heads, kvh = blockIdx.y;
    const int nqv = t.n_q * g, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float *qs = smem;                                  /* [QVECS][hd], pre-scaled */
    float *ks = qs + (size_t)KRN_CUDA_ATTN_QVECS * hd; /* [KT][hd + 1] */
    float *vs = ks + (size_t)ATT_KT * hd1;             /* [KT][hd + 1] */

    for (int i = tid; i < nqv * hd; i += ATT_THREADS) {
        int m = i / hd, d = i % hd, r = m / g, h = kvh * g + m % g;
        qs[i] = a.q[(size_t)(t.q_row + r) * a.q_stride + (size_t)h * hd + d] * a.scale;
    }
    int key_lim = min(t.n_ctx + t.n_tail, t.q_seq + t.n_q);
    int kbeg = 0, kend = key_lim;
    if (n_split > 1) {
        kbeg = (int)blockIdx.z * t.kv_chunk;
        kend = min(kbeg + t.kv_chunk, key_lim);
    }
    if (tid < t.n_q && t.mask_row >= 0) {
        krn_run_state st = {a.row_runs[t.mask_row + tid], 0, 1};
        int len = t.q_seq + tid + 1;
        if (kbeg < len) krn_run_seek(&st, a.runs, kbeg);
        rs[tid] = st;
    }

    float mx[ATT_QPW], sum[ATT_QPW], acc[ATT_QPW][DL];
#pragma unroll
    for (int qi = 0; qi < ATT_QPW; qi++) {
        mx[qi] = -INFINITY;
        sum[qi] = 0.0f;
#pragma unroll
        for (int di = 0; di < DL; di++) acc[qi][di] = 0.0f;
    }

    for (int k0 = kbeg; k0 < kend; k0 += ATT_KT) {
        int nk = min(ATT_KT, kend - k0);
        __syncthreads(); /* the previous tile is consumed */
        /* Where each key's K and V rows are, looked up once per tile (one dependent load of the
         * page list per key, in parallel), so the loads below need no page arithmetic. */
        if (tid < nk) {
            kvp[0][tid] = krn_attn_kv(a, t, k0 + tid, kvh, 0);
            kvp[1][tid] = krn_attn_kv(a, t, k0 + tid, kvh, 1);
        }
        if (tid < t.n_q) vis[tid] = krn_attn_row_vis<uint32_t>(a, t, tid, k0, nk, &rs[tid]);
        __syncthreads();
        if ((hd & 7) == 0) { /* 16-byte loads: rows of hd bf16 start 16-byte aligned */
            const int cpr = hd / 8, n = nk * cpr;
            /* ATT_LDG chunks of K and of V per thread in flight at once: the tile costs one
             * memory latency (two at head_dim 256), not one per chunk. */
            for (int i0 = 0; i0 < n; i0 += ATT_LDG * ATT_THREADS) {
                uint4 kr[ATT_LDG], vr[ATT_LDG];
#pragma unroll
                for (int c = 0; c < ATT_LDG; c++) {
                    int i = i0 + c * ATT_THREADS + tid;
                    if (i < n) {
                        int j = i / cpr, e = (i % cpr) * 8;
                        kr[c] = *reinterpret_cast<const uint4 *>(kvp[0][j] + e);
                        vr[c] = *reinterpret_cast<const uint4 *>(kvp[1][j] + e);
                    }
                }
#pragma unroll
                for (int c = 0; c < ATT_LDG; c++) {
                    int i = i0 + c * ATT_THREADS + tid;
                    if (i < n) {
                        int j = i / cpr, e = (i % cpr) * 8;
                        float kf[8], vf[8];
                        krn_unpack8(kr[c], kf);
                        krn_unpack8(vr[c], vf);
#pragma unroll
                        for (int x = 0; x < 8; x++) {
                            ks[j * hd1 + e + x] = kf[x];
                            vs[j * hd1 + e + x] = vf[x];
                        }
                    }
                }
            }
        } else {
            for (int i = tid; i < nk * hd; i += ATT_THREADS) {
                int j = i / hd, d = i % hd;
                ks[j * hd1 + d] = krn_bf16_to_f32(kvp[0][j][d]);
                vs[j * hd1 + d] = krn_bf16_to_f32(kvp[1][j][d]);
            }
        }
        __syncthreads();
#pragma unroll
        for (int qi = 0; qi < ATT_QPW; qi++) {
            int m = warp + qi * ATT_WARPS;
            if (m >= nqv) break;
            const float *qv = qs + (size_t)m * hd;
            float s = -INFINITY;
            if (lane < nk && ((vis[m / g] >> lane) & 1u)) {
                const float *kr = ks + lane * hd1;
                float dot = 0.0f;
                for (int d = 0; d < hd; d++) dot += qv[d] * kr[d];
                s = dot;
            }
            float m_new = fmaxf(mx[qi], krn_warp_max(s));
            if (m_new == -INFINITY) continue; /* nothing visible to this query yet */
            float p = s == -INFINITY ? 0.0f : expf(s - m_new);
            float corr = mx[qi] == -INFINITY ? 0.0f : expf(mx[qi] - m_new);
            sum[qi] = sum[qi] * corr + krn_warp_sum(p);
            mx[qi] = m_new;
#pragma unroll
            for (int di = 0; di < DL; di++) acc[qi][di] *= corr;
            for (int j = 0; j < nk; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
                if (pj == 0.0f) continue;
                const float *vr = vs + j * hd1;
#pragma unroll
                for (int di = 0; di < DL; di++) {
                    int d = lane + 32 * di;
                    if (d < hd) acc[qi][di] += pj * vr[d];
                }
            }
        }
    }

    const int qd = a.n_heads * hd;
#pragma unroll
    for (int qi = 0; qi < ATT_QPW; qi++) {
        int m = warp + qi * ATT_WARPS;
        if (m >= nqv) break;
        int r = m / g, h = kvh * g + m % g;
        if (n_split == 1) {
            float inv = sum[qi] > 0.0f ? 1.0f / sum[qi] : 0.0f; /* nothing visible: zeros */
            krn_bf16 *o = a.out + (size_t)(t.o_row + r) * qd + (size_t)h * hd;
#pragma unroll
            for (int di = 0; di < DL; di++) {
                int d = lane + 32 * di;
                if (d < hd) o[d] = krn_f32_to_bf16(acc[qi][di] * inv);
            }
        } else {
            size_t at = ((size_t)blockIdx.z * a.split_rows + t.part_row + r) * a.n_heads + h;
            float *pa = a.part_acc + at * hd;
#pragma unroll
            for (int di = 0; di < DL; di++) {
                int d = lane + 32 * di;
                if (d < hd) pa[d] = acc[qi][di];
            }
            if (lane == 0) {
                a.part_ml[at * 2] = mx[qi];
                a.part_ml[at * 2 + 1] = sum[qi];
            }
        }
    }
}

/* blockIdx.x = tile, blockIdx.y = head; combines the n_split partials of each row of a split
 * tile (an unsplit tile's output is already written). */
__global__ static void merge_kernel(krn_cuda_attn_args a) {
    const krn_cuda_attn_tile t = a.tiles[blockIdx.x];
    const int n_split = attn_tile_splits(a, t);
    if (t.n_q <= 0 || n_split == 1) return;
    int h = blockIdx.y, hd = a.hd, qd = a.n_heads * hd;
    for (int r = 0; r < t.n_q; r++) {
        size_t part = (size_t)(t.part_row + r), row = (size_t)(t.o_row + r);
        float m = -INFINITY;
        for (int s = 0; s < n_split; s++)
            m = fmaxf(m, a.part_ml[((s * (size_t)a.split_rows + part) * a.n_heads + h) * 2]);
        float l = 0.0f;
        for (int s = 0; s < n_split; s++) {
            const float *ml = a.part_ml + ((s * (size_t)a.split_rows + part) * a.n_heads + h) * 2;
            if (ml[0] != -INFINITY) l += ml[1] * expf(ml[0] - m);
        }
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float o = 0.0f;
            for (int s = 0; s < n_split; s++) {
                size_t at = (s * (size_t)a.split_rows + part) * a.n_heads + h;
                float ms = a.part_ml[at * 2];
                if (ms != -INFINITY) o += a.part_acc[at * hd + d] * expf(ms - m);
            }
            a.out[row * qd + (size_t)h * hd + d] = krn_f32_to_bf16(o * inv);
        }
    }
}

extern "C" cudaError_t krn_cuda_attn_smem(int head_dim, size_t *need, size_t *limit) {
    int dev = 0, optin = 0;
    cudaFuncAttributes fa;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err == cudaSuccess)
        err = cudaFuncGetAttributes(&fa, attn_kernel<8>); /* same for every DL */
    if (err != cudaSuccess) return err;
    *need = attn_smem_bytes(head_dim) + fa.sharedSizeBytes;
    *limit = (size_t)optin;
    return cudaSuccess;
}

/* The dynamic-shared-memory attribute is set to all the device grants, so engines of models
 * with different head_dims can share a process (each launch asks for what its head_dim needs,
 * which krn_cuda_init has checked to fit). */
extern "C" cudaError_t krn_cuda_init(int head_dim) {
    if (head_dim <= 0 || head_dim > KRN_CUDA_MAX_HEAD_DIM) return cudaErrorInvalidValue;
    size_t need = 0, limit = 0;
    cudaError_t err = krn_cuda_attn_smem(head_dim, &need, &limit);
    if (err != cudaSuccess) return err;
    if (need > limit) return cudaErrorInvalidValue;
    size_t stat = need - attn_smem_bytes(head_dim);
    const void *kernels[] = {(const void *)attn_kernel<1>, (const void *)attn_kernel<2>,
                             (const void *)attn_kernel<4>, (const void *)attn_kernel<8>};
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        err = cudaFuncSetAttribute(kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)(limit - stat));
        if (err != cudaSuccess) return err;
    }
    int dev = 0, major = 0;
    err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess || major < 8) return err; /* no tensor-core path before sm_80 */
    return krn_cuda_attn_tc_init();
}

extern "C" cudaError_t krn_cuda_attention(const krn_cuda_attn_args *a, cudaStream_t stream) {
    if (a->n_tiles <= 0) return cudaSuccess;
    if (a->hd <= 0 || a->hd > KRN_CUDA_MAX_HEAD_DIM || a->n_kv_heads <= 0 ||
        a->n_heads % a->n_kv_heads != 0 || a->n_heads / a->n_kv_heads > KRN_CUDA_MAX_GROUP ||
        a->n_splits < 1 || a->n_splits > KRN_CUDA_MAX_SPLITS || a->n_kv_heads > 65535)
        return cudaErrorInvalidValue;
    dim3 grid((unsigned)a->n_tiles, (unsigned)a->n_kv_heads, (unsigned)a->n_splits);
    size_t smem = attn_smem_bytes(a->hd);
    if (a->hd <= 32)
        attn_kernel<1><<<grid, ATT_THREADS, smem, stream>>>(*a);
    else if (a->hd <= 64)
        attn_kernel<2><<<grid, ATT_THREADS, smem, stream>>>(*a);
    else if (a->hd <= 128)
        attn_kernel<4><<<grid, ATT_THREADS, smem, stream>>>(*a);
    else
        attn_kernel<8><<<grid, ATT_THREADS, smem, stream>>>(*a);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || a->n_splits == 1) return err;
    merge_kernel<<<dim3((unsigned)a->n_tiles, (unsigned)a->n_heads), 128, 0, stream>>>(*a);
    return cudaGetLastError();
}
