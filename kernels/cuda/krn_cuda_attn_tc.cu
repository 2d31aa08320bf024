/* krn_cuda_attn_tc.cu — paged attention on tensor cores for prefill-shaped tiles
 * (krn_cuda_attention_tc): flash attention with bf16 WMMA products and f32 softmax/accumulation.
 *
 * Owns: the kernel for tiles of many query rows (a prompt, a chunk of one, a long draft). A block
 * takes one tile (up to KRN_CUDA_TC_QVECS = 64 query vectors: rows x the query heads of one KV
 * head) and streams the keys through shared memory 64 at a time; each of its 4 warps owns 16
 * query vectors: S = Q K^T (WMMA 16x16x16, bf16 in, f32 out), masking and the online softmax
 * in f32 on S, P (bf16) V accumulated into an f32 output kept in shared memory.
 * Visibility is the same as krn_cuda_attn.cu's (causality or explicit runs, page masks on the
 * context); the tile and argument structs are the same (krn_cuda.h). No split-KV: prefill tiles
 * are many. head_dim 16, 32, 64 or 128 (Llama 3 and the test models); other shapes use
 * krn_cuda_attention.
 * Does not own: decode tiles (krn_cuda_attn.cu), which tiles exist (the engine). */
#include <cuda_bf16.h>
#include <math.h>
#include <mma.h>

#include "krn_cuda.h"
#include "krn_cuda_impl.cuh"

using namespace nvcuda;

#define TC_THREADS 128
#define TC_Q       KRN_CUDA_TC_QVECS /* query vectors per block */
#define TC_KT      64                /* keys per step */
#define TC_SLD     (TC_KT + 4)       /* row stride of S (floats) */
#define TC_PLD     (TC_KT + 8)       /* row stride of P (bf16) */

template <int HD> struct tc_smem {
    __nv_bfloat16 q[TC_Q][HD + 8], k[TC_KT][HD + 8], v[TC_KT][HD + 8];
    float s[TC_Q][TC_SLD];
    __nv_bfloat16 p[TC_Q][TC_PLD];
    float o[TC_Q][HD + 4];
    float m[TC_Q], l[TC_Q];
    unsigned long long vis[TC_Q]; /* per tile row: keys k0..k0+63 visible */
    krn_run_state run[TC_Q];      /* explicit mask rows */
};

template <int HD>
__global__ static void __launch_bounds__(TC_THREADS) tc_kernel(krn_cuda_attn_args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const krn_cuda_attn_tile t = a.tiles[blockIdx.x];
    if (t.n_q <= 0) return;
    extern __shared__ __align__(128) unsigned char tc_raw[];
    tc_smem<HD> &sm = *reinterpret_cast<tc_smem<HD> *>(tc_raw);
    const int g = a.n_heads / a.n_kv_heads, kvh = blockIdx.y, nqv = t.n_q * g;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const __nv_bfloat16 zero = __float2bfloat16(0.0f);

    for (int i = tid; i < TC_Q * HD; i += TC_THREADS) {
        int m = i / HD, d = i % HD;
        float v = 0.0f;
        if (m < nqv) {
            int r = m / g, h = kvh * g + m % g;
            v = a.q[(size_t)(t.q_row + r) * a.q_stride + (size_t)h * HD + d];
        }
        sm.q[m][d] = __float2bfloat16(v);
    }
    for (int i = tid; i < TC_Q * HD; i += TC_THREADS) sm.o[i / HD][i % HD] = 0.0f;
    if (tid < TC_Q) {
        sm.m[tid] = -INFINITY;
        sm.l[tid] = 0.0f;
        if (tid < t.n_q && t.mask_row >= 0) {
            sm.run[tid] = krn_run_state{a.row_runs[t.mask_row + tid], 0, 1};
        }
    }
    const int key_lim = min(t.n_ctx + t.n_tail, t.q_seq + t.n_q);

    for (int k0 = 0; k0 < key_lim; k0 += TC_KT) {
        const int nk = min(TC_KT, key_lim - k0);
        __syncthreads(); /* the previous step's K, V and visibility are consumed */
        for (int i = tid; i < TC_KT * (HD / 8); i += TC_THREADS) {
            int j = i / (HD / 8), c = (i % (HD / 8)) * 8;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (j < nk) {
                kv4 = *reinterpret_cast<const uint4 *>(krn_attn_kv(a, t, k0 + j, kvh, 0) + c);
                vv4 = *reinterpret_cast<const uint4 *>(krn_attn_kv(a, t, k0 + j, kvh, 1) + c);
            }
            *reinterpret_cast<uint4 *>(&sm.k[j][c]) = kv4;
            *reinterpret_cast<uint4 *>(&sm.v[j][c]) = vv4;
        }
        if (tid < t.n_q)
            sm.vis[tid] = krn_attn_row_vis<unsigned long long>(a, t, tid, k0, nk, &sm.run[tid]);
        __syncthreads();

        /* S rows [16 warp, 16 warp + 16) = Q K^T */
        const int m0 = warp * 16;
        if (m0 < nqv) {
            for (int n = 0; n < TC_KT / 16; n++) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
                wmma::fill_fragment(acc, 0.0f);
                for (int kk = 0; kk < HD / 16; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
                    wmma::load_matrix_sync(fa, &sm.q[m0][kk * 16], HD + 8);
                    wmma::load_matrix_sync(fb, &sm.k[n * 16][kk * 16], HD + 8);
                    wmma::mma_sync(acc, fa, fb, acc);
                }
                wmma::store_matrix_sync(&sm.s[m0][n * 16], acc, TC_SLD, wmma::mem_row_major);
            }
            __syncwarp();
            /* online softmax of the warp's 16 rows; lane covers keys lane and lane + 32 */
            for (int i = 0; i < 16; i++) {
                int m = m0 + i;
                if (m >= nqv) { /* padding query vectors: P = 0 */
                    sm.p[m][lane] = zero;
                    sm.p[m][lane + 32] = zero;
                    continue;
                }
                unsigned long long vb = sm.vis[m / g];
                float s0 =
                    (lane < nk && ((vb >> lane) & 1ull)) ? sm.s[m][lane] * a.scale : -INFINITY;
                float s1 = (lane + 32 < nk && ((vb >> (lane + 32)) & 1ull))
                               ? sm.s[m][lane + 32] * a.scale
                               : -INFINITY;
                float m_old = sm.m[m];
                float m_new = fmaxf(m_old, krn_warp_max(fmaxf(s0, s1)));
                float p0 = 0.0f, p1 = 0.0f, corr = 1.0f;
                if (m_new != -INFINITY) {
                    p0 = s0 == -INFINITY ? 0.0f : expf(s0 - m_new);
                    p1 = s1 == -INFINITY ? 0.0f : expf(s1 - m_new);
                    corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                }
                float psum = krn_warp_sum(p0 + p1);
                sm.p[m][lane] = __float2bfloat16(p0);
                sm.p[m][lane + 32] = __float2bfloat16(p1);
                for (int d = lane; d < HD; d += 32) sm.o[m][d] *= corr;
                /* every lane has read sm.m[m] above: shuffles order no shared memory
                   (racecheck flagged the write below against those reads) */
                __syncwarp();
                if (lane == 0) {
                    sm.l[m] = sm.l[m] * corr + psum;
                    sm.m[m] = m_new;
                }
            }
            __syncwarp();
            /* O rows += P V */
            for (int n = 0; n < HD / 16; n++) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
                wmma::load_matrix_sync(acc, &sm.o[m0][n * 16], HD + 4, wmma::mem_row_major);
                for (int kk = 0; kk < TC_KT / 16; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
                    wmma::load_matrix_sync(fa, &sm.p[m0][kk * 16], TC_PLD);
                    wmma::load_matrix_sync(fb, &sm.v[kk * 16][n * 16], HD + 8);
                    wmma::mma_sync(acc, fa, fb, acc);
                }
                wmma::store_matrix_sync(&sm.o[m0][n * 16], acc, HD + 4, wmma::mem_row_major);
            }
        }
    }
    __syncthreads();
    const int qd = a.n_heads * HD;
    for (int i = tid; i < nqv * HD; i += TC_THREADS) {
        int m = i / HD, d = i % HD, r = m / g, h = kvh * g + m % g;
        float l = sm.l[m];
        a.out[(size_t)(t.o_row + r) * qd + (size_t)h * HD + d] =
            krn_f32_to_bf16(l > 0.0f ? sm.o[m][d] / l : 0.0f);
    }
#else
    __trap(); /* bf16 tensor cores need sm_80+; krn_cuda_attn_tc_fits said no */
#endif
}

extern "C" int krn_cuda_attn_tc_rows(int n_heads, int n_kv_heads) {
    int g = n_kv_heads > 0 ? n_heads / n_kv_heads : 1;
    int rows = g > 0 ? TC_Q / g : 1;
    return rows > 0 ? rows : 1;
}

/* Shared memory of the kernel for head_dim (0: no such kernel). */
static size_t tc_smem_bytes(int head_dim) {
    switch (head_dim) {
    case 16: return sizeof(tc_smem<16>);
    case 32: return sizeof(tc_smem<32>);
    case 64: return sizeof(tc_smem<64>);   /* 72 KiB */
    case 128: return sizeof(tc_smem<128>); /* 112 KiB: not on 99 KiB parts (L4, sm_86/89) */
    default: return 0;
    }
}

/* The current device's compute capability major and per-block shared-memory opt-in limit. */
static cudaError_t tc_device(int *major, size_t *limit) {
    int dev = 0, optin = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    *limit = (size_t)optin;
    return err;
}

extern "C" int krn_cuda_attn_tc_fits(int head_dim, int n_heads, int n_kv_heads) {
    int major = 0;
    size_t limit = 0, need = tc_smem_bytes(head_dim);
    if (tc_device(&major, &limit) != cudaSuccess) return 0;
    return major >= 8 && need > 0 && need <= limit && n_kv_heads > 0 && n_heads % n_kv_heads == 0 &&
           n_heads / n_kv_heads <= TC_Q;
}

template <int HD> static cudaError_t tc_attr(size_t limit) {
    if (sizeof(tc_smem<HD>) > limit) return cudaSuccess; /* not used here: tc_fits says no */
    return cudaFuncSetAttribute(tc_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)sizeof(tc_smem<HD>));
}

extern "C" cudaError_t krn_cuda_attn_tc_init(void) {
    int major = 0;
    size_t limit = 0;
    cudaError_t err = tc_device(&major, &limit);
    if (err == cudaSuccess) err = tc_attr<16>(limit);
    if (err == cudaSuccess) err = tc_attr<32>(limit);
    if (err == cudaSuccess) err = tc_attr<64>(limit);
    if (err == cudaSuccess) err = tc_attr<128>(limit);
    return err;
}

extern "C" cudaError_t krn_cuda_attention_tc(const krn_cuda_attn_args *a, cudaStream_t stream) {
    if (a->n_tiles <= 0) return cudaSuccess;
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0 ||
        a->n_heads / a->n_kv_heads > TC_Q || a->n_kv_heads > 65535)
        return cudaErrorInvalidValue;
    dim3 grid((unsigned)a->n_tiles, (unsigned)a->n_kv_heads);
    switch (a->hd) {
    case 16: tc_kernel<16><<<grid, TC_THREADS, sizeof(tc_smem<16>), stream>>>(*a); break;
    case 32: tc_kernel<32><<<grid, TC_THREADS, sizeof(tc_smem<32>), stream>>>(*a); break;
    case 64: tc_kernel<64><<<grid, TC_THREADS, sizeof(tc_smem<64>), stream>>>(*a); break;
    case 128: tc_kernel<128><<<grid, TC_THREADS, sizeof(tc_smem<128>), stream>>>(*a); break;
    default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
