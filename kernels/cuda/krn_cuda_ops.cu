/* krn_cuda_ops.cu — the element-wise and per-row kernels of krn_cuda.h: embedding gather, row
 * gather/scatter, bf16 conversion, RMSNorm fused with the residual add, RoPE on the fused qkv
 * rows (with the KV append fused in, the engine's form), KV append, SiLU-multiply and page copy.
 * The per-row kernels use several blocks per row (RoPE, KV append) or up to 1024 threads per
 * row (RMSNorm) so that a batch-1 decode step is not a chain of one-block launches.
 * Does not own: attention (krn_cuda_attn.cu), GEMV (krn_cuda_linear.cu), top-k
 * (krn_cuda_dist.cu). */
#include "krn_cuda.h"
#include "krn_cuda_impl.cuh"

/* ---- rows ------------------------------------------------------------------------------ */

__global__ static void embed_kernel(const krn_bf16 *table, int d, const uint32_t *tokens,
                                    const uint32_t *slots, float *out) {
    int i = blockIdx.x;
    const krn_bf16 *src = table + (size_t)tokens[i] * (size_t)d;
    float *dst = out + (size_t)slots[i] * (size_t)d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = krn_bf16_to_f32(src[j]);
}

extern "C" cudaError_t krn_cuda_embed(const krn_bf16 *table, int d, const uint32_t *tokens,
                                      const uint32_t *slots, int n, float *out,
                                      cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    embed_kernel<<<n, 256, 0, stream>>>(table, d, tokens, slots, out);
    return cudaGetLastError();
}

/* Row i of the index list: gather copies src row idx[i] to dst row i, scatter src row i to dst
 * row idx[i]; idx[i] < 0 copies nothing. */
template <bool Scatter>
__global__ static void move_rows_kernel(float *dst, const float *src, const int32_t *idx, int d) {
    int i = blockIdx.x;
    int s = idx[i];
    if (s < 0) return;
    const float *from = src + (size_t)(Scatter ? i : s) * (size_t)d;
    float *to = dst + (size_t)(Scatter ? s : i) * (size_t)d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) to[j] = from[j];
}

template <bool Scatter>
static cudaError_t move_rows(float *dst, const float *src, const int32_t *idx, int n, int d,
                             cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    move_rows_kernel<Scatter><<<n, 256, 0, stream>>>(dst, src, idx, d);
    return cudaGetLastError();
}

extern "C" cudaError_t krn_cuda_gather_rows(float *dst, const float *src, const int32_t *idx, int n,
                                            int d, cudaStream_t stream) {
    return move_rows<false>(dst, src, idx, n, d, stream);
}

extern "C" cudaError_t krn_cuda_scatter_rows(float *dst, const float *src, const int32_t *idx,
                                             int n, int d, cudaStream_t stream) {
    return move_rows<true>(dst, src, idx, n, d, stream);
}

__global__ static void to_bf16_kernel(const float *x, size_t n, krn_bf16 *y) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = krn_f32_to_bf16(x[i]);
}

extern "C" cudaError_t krn_cuda_to_bf16(const float *x, size_t n, krn_bf16 *y,
                                        cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    size_t blocks = (n + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    to_bf16_kernel<<<(unsigned)blocks, 256, 0, stream>>>(x, n, y);
    return cudaGetLastError();
}

/* ---- per-row math ---------------------------------------------------------------------- */

static bool krn_aligned(const void *p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* 4 f32 → 4 bf16 in 8 bytes (the first value in the low half), and back. */
__device__ __forceinline__ uint2 krn_pack4(float a, float b, float c, float d) {
    return make_uint2((uint32_t)krn_f32_to_bf16(a) | ((uint32_t)krn_f32_to_bf16(b) << 16),
                      (uint32_t)krn_f32_to_bf16(c) | ((uint32_t)krn_f32_to_bf16(d) << 16));
}

__device__ __forceinline__ float4 krn_unpack4(uint2 v) {
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                       __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
}

/* add + RMSNorm with 16-byte accesses: one block per row, thread t holding the float4 columns
 * t + k * blockDim.x (k < V) in registers from the loads to the stores — every load of x, r and
 * w is issued before the first store, so a row costs about one memory round trip whatever the
 * batch. The block size and V depend on d only (krn_cuda_add_rmsnorm), so a row's result does
 * not depend on how many rows the launch has (graph buckets pad the batch). */
template <int V>
__global__ static void __launch_bounds__(1024)
    add_rmsnorm_vec_kernel(float *x, const float *r, const krn_bf16 *w, int d, float eps,
                           krn_bf16 *yb, float *yf) {
    __shared__ float red[32];
    int d4 = d >> 2;
    size_t base = (size_t)blockIdx.x * (size_t)d;
    float4 *xr = reinterpret_cast<float4 *>(x + base);
    const float4 *rr = r ? reinterpret_cast<const float4 *>(r + base) : nullptr;
    const uint2 *wr = reinterpret_cast<const uint2 *>(w);
    float4 v[V], a[V];
    uint2 wv[V];
#pragma unroll
    for (int k = 0; k < V; k++) {
        int c = (int)threadIdx.x + k * (int)blockDim.x;
        v[k] = a[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        wv[k] = make_uint2(0, 0);
        if (c < d4) {
            v[k] = xr[c];
            if (rr) a[k] = rr[c];
            wv[k] = wr[c];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < V; k++) {
        int c = (int)threadIdx.x + k * (int)blockDim.x;
        if (c >= d4) continue;
        if (rr) {
            v[k].x += a[k].x, v[k].y += a[k].y, v[k].z += a[k].z, v[k].w += a[k].w;
            xr[c] = v[k];
        }
        ss += v[k].x * v[k].x;
        ss += v[k].y * v[k].y;
        ss += v[k].z * v[k].z;
        ss += v[k].w * v[k].w;
    }
    ss = krn_block_sum(ss, red);
    float inv = rsqrtf(ss / (float)d + eps);
#pragma unroll
    for (int k = 0; k < V; k++) {
        int c = (int)threadIdx.x + k * (int)blockDim.x;
        if (c >= d4) continue;
        float4 wf = krn_unpack4(wv[k]);
        float4 y = make_float4(v[k].x * inv * wf.x, v[k].y * inv * wf.y, v[k].z * inv * wf.z,
                               v[k].w * inv * wf.w);
        if (yb) reinterpret_cast<uint2 *>(yb + base)[c] = krn_pack4(y.x, y.y, y.z, y.w);
        if (yf) reinterpret_cast<float4 *>(yf + base)[c] = y;
    }
}

/* The general case (d % 4 != 0, unaligned pointers, d > 16384): one block per row, two passes. */
__global__ static void add_rmsnorm_kernel(float *x, const float *r, const krn_bf16 *w, int d,
                                          float eps, krn_bf16 *yb, float *yf) {
    __shared__ float red[32];
    size_t base = (size_t)blockIdx.x * (size_t)d;
    float *xr = x + base;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float v = xr[j];
        if (r) {
            v += r[base + j];
            xr[j] = v;
        }
        ss += v * v;
    }
    ss = krn_block_sum(ss, red);
    float inv = rsqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float y = xr[j] * inv * krn_bf16_to_f32(w[j]);
        if (yb) yb[base + j] = krn_f32_to_bf16(y);
        if (yf) yf[base + j] = y;
    }
}

extern "C" cudaError_t krn_cuda_add_rmsnorm(float *x, const float *r, const krn_bf16 *w, int n,
                                            int d, float eps, krn_bf16 *yb, float *yf,
                                            cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    bool vec = d > 0 && d % 4 == 0 && d <= 4 * 4 * 1024 && krn_aligned(x, 16) &&
               (!r || krn_aligned(r, 16)) && (!yf || krn_aligned(yf, 16)) && krn_aligned(w, 8) &&
               (!yb || krn_aligned(yb, 8));
    if (!vec) {
        add_rmsnorm_kernel<<<n, 256, 0, stream>>>(x, r, w, d, eps, yb, yf);
        return cudaGetLastError();
    }
    int d4 = d / 4, v = d4 <= 1024 ? 1 : d4 <= 2048 ? 2 : 4;
    int threads = ((d4 + v - 1) / v + 31) / 32 * 32; /* up to 1024 */
    if (v == 1)
        add_rmsnorm_vec_kernel<1><<<n, threads, 0, stream>>>(x, r, w, d, eps, yb, yf);
    else if (v == 2)
        add_rmsnorm_vec_kernel<2><<<n, threads, 0, stream>>>(x, r, w, d, eps, yb, yf);
    else
        add_rmsnorm_vec_kernel<4><<<n, threads, 0, stream>>>(x, r, w, d, eps, yb, yf);
    return cudaGetLastError();
}

/* RoPE on the fused qkv rows, v into bf16 and (when layer is not NULL) the KV append, in one
 * launch: grid (rows, chunks of ROPE_THREADS items). A row's items are first the rotations —
 * (nh + nkv) heads × hd / 2 / W groups of W pairs (j, j + hd/2), q heads then k heads, which lie
 * at the same offsets h · hd of the row — then kvd / W groups of W values of v. W = 4 uses
 * 16-byte loads and 8-byte bf16 stores (hd % 8 == 0 and aligned pointers), W = 1 is the
 * general case; the arithmetic per value is the same. K and V go to kb / vb and, where
 * dst[row] >= 0, to that pool token of the layer (the values written to both are the same). */
enum { ROPE_THREADS = 128 };

template <int W> __device__ __forceinline__ void krn_ld(const float *p, float *o) {
    if (W == 4) {
        float4 v = *reinterpret_cast<const float4 *>(p);
        o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) o[i] = p[i];
    }
}

template <int W> __device__ __forceinline__ void krn_st(float *p, const float *v) {
    if (W == 4) {
        *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) p[i] = v[i];
    }
}

/* Stores W values as bf16 at p and, when p2 is not NULL, at p2. */
template <int W>
__device__ __forceinline__ void krn_st_bf16(krn_bf16 *p, krn_bf16 *p2, const float *v) {
    if (W == 4) {
        uint2 b = krn_pack4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<uint2 *>(p) = b;
        if (p2) *reinterpret_cast<uint2 *>(p2) = b;
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) {
            krn_bf16 b = krn_f32_to_bf16(v[i]);
            p[i] = b;
            if (p2) p2[i] = b;
        }
    }
}

template <int W>
__global__ static void __launch_bounds__(ROPE_THREADS)
    rope_qkv_kernel(float *qkv, const int32_t *pos, int nh, int nkv, int hd, const float *inv_freq,
                    krn_bf16 *kb, krn_bf16 *vb, krn_bf16 *layer, int page_size,
                    const int32_t *dst) {
    int row = blockIdx.x;
    int i = (int)(blockIdx.y * blockDim.x + threadIdx.x);
    int half = hd / 2, groups = half / W, kvd = nkv * hd;
    int nrot = (nh + nkv) * groups;
    if (i >= nrot + kvd / W) return;
    float *q = qkv + (size_t)row * (size_t)(nh + 2 * nkv) * (size_t)hd;
    krn_bf16 *pk = nullptr; /* the pool token's K (its V is page_size * kvd further) */
    if (layer) {
        int t = dst[row];
        if (t >= 0) {
            size_t page = (size_t)t / (size_t)page_size, off = (size_t)t % (size_t)page_size;
            pk = layer + (page * 2 * (size_t)page_size + off) * (size_t)kvd;
        }
    }
    if (i < nrot) {
        int h = i / groups, j = (i % groups) * W;
        float p = (float)pos[row], f[W], s[W], c[W], a[W], b[W], lo[W], hi[W];
        krn_ld<W>(inv_freq + j, f);
        float *src = q + (size_t)h * hd + j;
        krn_ld<W>(src, a);
        krn_ld<W>(src + half, b);
#pragma unroll
        for (int e = 0; e < W; e++) {
            sincosf(p * f[e], &s[e], &c[e]); /* the angle rounded to f32, as HF computes it */
            lo[e] = a[e] * c[e] - b[e] * s[e];
            hi[e] = b[e] * c[e] + a[e] * s[e];
        }
        if (h < nh) {
            krn_st<W>(src, lo);
            krn_st<W>(src + half, hi);
        } else {
            size_t o = (size_t)(h - nh) * hd + j;
            krn_bf16 *kr = kb + (size_t)row * kvd + o;
            krn_st_bf16<W>(kr, pk ? pk + o : nullptr, lo);
            krn_st_bf16<W>(kr + half, pk ? pk + o + half : nullptr, hi);
        }
    } else {
        size_t j = (size_t)(i - nrot) * W;
        float v[W];
        krn_ld<W>(q + (size_t)(nh + nkv) * hd + j, v);
        krn_st_bf16<W>(vb + (size_t)row * kvd + j, pk ? pk + (size_t)page_size * kvd + j : nullptr,
                       v);
    }
}

static cudaError_t rope_qkv(float *qkv, const int32_t *pos, int n, int nh, int nkv, int hd,
                            const float *inv_freq, krn_bf16 *kb, krn_bf16 *vb, krn_bf16 *layer,
                            int page_size, const int32_t *dst, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    if (hd <= 0 || hd % 2 != 0 || nh < 0 || nkv < 0) return cudaErrorInvalidValue;
    bool vec = hd % 8 == 0 && krn_aligned(qkv, 16) && krn_aligned(inv_freq, 16) &&
               krn_aligned(kb, 8) && krn_aligned(vb, 8) && (!layer || krn_aligned(layer, 8));
    int w = vec ? 4 : 1;
    long long items = (long long)(nh + nkv) * (hd / 2 / w) + (long long)nkv * hd / w;
    long long chunks = (items + ROPE_THREADS - 1) / ROPE_THREADS;
    if (chunks == 0) return cudaSuccess;
    if (chunks > 65535) return cudaErrorInvalidValue;
    dim3 grid((unsigned)n, (unsigned)chunks);
    if (vec)
        rope_qkv_kernel<4><<<grid, ROPE_THREADS, 0, stream>>>(qkv, pos, nh, nkv, hd, inv_freq, kb,
                                                              vb, layer, page_size, dst);
    else
        rope_qkv_kernel<1><<<grid, ROPE_THREADS, 0, stream>>>(qkv, pos, nh, nkv, hd, inv_freq, kb,
                                                              vb, layer, page_size, dst);
    return cudaGetLastError();
}

extern "C" cudaError_t krn_cuda_rope_qkv(float *qkv, const int32_t *pos, int n, int nh, int nkv,
                                         int hd, const float *inv_freq, krn_bf16 *kb, krn_bf16 *vb,
                                         cudaStream_t stream) {
    return rope_qkv(qkv, pos, n, nh, nkv, hd, inv_freq, kb, vb, nullptr, 0, nullptr, stream);
}

extern "C" cudaError_t krn_cuda_rope_qkv_append(float *qkv, const int32_t *pos, int n, int nh,
                                                int nkv, int hd, const float *inv_freq,
                                                krn_bf16 *kb, krn_bf16 *vb, krn_bf16 *layer,
                                                int page_size, const int32_t *dst,
                                                cudaStream_t stream) {
    if (!layer || !dst || page_size <= 0) return cudaErrorInvalidValue;
    return rope_qkv(qkv, pos, n, nh, nkv, hd, inv_freq, kb, vb, layer, page_size, dst, stream);
}

/* grid (rows, chunks): item i of a row copies W bf16 of K (i < kvd / W) or of V. W = 8 is one
 * 16-byte copy (kvd % 8 == 0 and aligned pointers). */
template <int W>
__global__ static void kv_append_kernel(krn_bf16 *layer, int page_size, int kvd, const krn_bf16 *kb,
                                        const krn_bf16 *vb, const int32_t *dst) {
    int row = blockIdx.x;
    int i = (int)(blockIdx.y * blockDim.x + threadIdx.x), per = kvd / W;
    int t = dst[row];
    if (t < 0 || i >= 2 * per) return;
    int which = i >= per;
    size_t j = (size_t)(i - which * per) * W;
    size_t page = (size_t)t / (size_t)page_size, off = (size_t)t % (size_t)page_size;
    krn_bf16 *to = layer + ((page * 2 + (size_t)which) * (size_t)page_size + off) * (size_t)kvd + j;
    const krn_bf16 *from = (which ? vb : kb) + (size_t)row * kvd + j;
    if (W == 8) {
        *reinterpret_cast<uint4 *>(to) = *reinterpret_cast<const uint4 *>(from);
    } else {
#pragma unroll
        for (int e = 0; e < W; e++) to[e] = from[e];
    }
}

extern "C" cudaError_t krn_cuda_kv_append(krn_bf16 *layer, int page_size, int kvd,
                                          const krn_bf16 *kb, const krn_bf16 *vb,
                                          const int32_t *dst, int n, cudaStream_t stream) {
    if (n <= 0 || kvd <= 0) return cudaSuccess;
    bool vec = kvd % 8 == 0 && krn_aligned(layer, 16) && krn_aligned(kb, 16) && krn_aligned(vb, 16);
    long long items = 2LL * kvd / (vec ? 8 : 1), chunks = (items + 127) / 128;
    if (chunks > 65535) return cudaErrorInvalidValue;
    dim3 grid((unsigned)n, (unsigned)chunks);
    if (vec)
        kv_append_kernel<8><<<grid, 128, 0, stream>>>(layer, page_size, kvd, kb, vb, dst);
    else
        kv_append_kernel<1><<<grid, 128, 0, stream>>>(layer, page_size, kvd, kb, vb, dst);
    return cudaGetLastError();
}

__global__ static void silu_mul_kernel(const float *gu, size_t n, int ffn, krn_bf16 *h) {
    size_t total = n * (size_t)ffn, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        size_t row = i / (size_t)ffn, j = i % (size_t)ffn;
        float a = gu[row * 2 * ffn + j];
        h[i] = krn_f32_to_bf16(a / (1.0f + expf(-a)) * gu[row * 2 * ffn + ffn + j]);
    }
}

extern "C" cudaError_t krn_cuda_silu_mul(const float *gu, int n, int ffn, krn_bf16 *h,
                                         cudaStream_t stream) {
    if (n <= 0 || ffn <= 0) return cudaSuccess;
    size_t blocks = ((size_t)n * (size_t)ffn + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    silu_mul_kernel<<<(unsigned)blocks, 256, 0, stream>>>(gu, (size_t)n, ffn, h);
    return cudaGetLastError();
}

/* ---- pages ----------------------------------------------------------------------------- */

/* blockIdx.x = layer, blockIdx.y = 0 for K, 1 for V. Block (0, 0) also copies the mask. */
__global__ static void page_copy_kernel(krn_bf16 *kv, size_t layer_elems, int page_size, int kvd,
                                        uint8_t *page_mask, int src, int dst, int count) {
    size_t ps = (size_t)page_size;
    size_t sp = (size_t)src / ps, so = (size_t)src % ps, dp = (size_t)dst / ps,
           doff = (size_t)dst % ps;
    krn_bf16 *layer = kv + (size_t)blockIdx.x * layer_elems;
    size_t which = blockIdx.y * ps * (size_t)kvd;
    const krn_bf16 *from = layer + (sp * 2 * ps + so) * (size_t)kvd + which;
    krn_bf16 *to = layer + (dp * 2 * ps + doff) * (size_t)kvd + which;
    size_t n = (size_t)count * (size_t)kvd;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
    if (blockIdx.x == 0 && blockIdx.y == 0)
        for (int i = threadIdx.x; i < count; i += blockDim.x)
            page_mask[dst + i] = page_mask[src + i];
}

extern "C" cudaError_t krn_cuda_page_copy(krn_bf16 *kv, size_t layer_elems, int n_layers,
                                          int page_size, int kvd, uint8_t *page_mask, int src,
                                          int dst, int count, cudaStream_t stream) {
    if (count <= 0) return cudaSuccess;
    int layers = n_layers > 0 ? n_layers : 1; /* one block still copies the mask */
    page_copy_kernel<<<dim3(layers, n_layers > 0 ? 2 : 1), 256, 0, stream>>>(
        kv, layer_elems, page_size, n_layers > 0 ? kvd : 0, page_mask, src, dst, count);
    return cudaGetLastError();
}

/* blockIdx.x = i (page ids[i]), blockIdx.y = layer; block (i, n_layers) clears the mask bytes.
 * A page of a layer is one contiguous run of 2 * page_size * kvd values (K then V). */
__global__ static void clear_pages_kernel(krn_bf16 *kv, size_t layer_elems, int n_layers,
                                          int page_size, int kvd, uint8_t *page_mask,
                                          const int32_t *ids) {
    size_t page = (size_t)ids[blockIdx.x], ps = (size_t)page_size;
    if ((int)blockIdx.y == n_layers) {
        for (size_t i = threadIdx.x; i < ps; i += blockDim.x) page_mask[page * ps + i] = 0;
        return;
    }
    size_t elems = 2 * ps * (size_t)kvd;
    krn_bf16 *p = kv + (size_t)blockIdx.y * layer_elems + page * elems;
    if (elems % 8 == 0 && ((uintptr_t)p & 15u) == 0) { /* 16-byte stores */
        uint4 *q = reinterpret_cast<uint4 *>(p);
        for (size_t i = threadIdx.x; i < elems / 8; i += blockDim.x) q[i] = make_uint4(0, 0, 0, 0);
    } else {
        for (size_t i = threadIdx.x; i < elems; i += blockDim.x) p[i] = 0;
    }
}

extern "C" cudaError_t krn_cuda_clear_pages(krn_bf16 *kv, size_t layer_elems, int n_layers,
                                            int page_size, int kvd, uint8_t *page_mask,
                                            const int32_t *ids, int n, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    if (n_layers < 0 || n > 65535 * 1024) return cudaErrorInvalidValue;
    /* gridDim.x is up to 2^31 - 1; y (layers + 1) up to 65535 */
    clear_pages_kernel<<<dim3((unsigned)n, (unsigned)n_layers + 1), 256, 0, stream>>>(
        kv, layer_elems, n_layers, page_size, kvd, page_mask, ids);
    return cudaGetLastError();
}

/* ---- test hook --------------------------------------------------------------------------- */

__global__ static void trap_kernel(void) { __trap(); }

extern "C" cudaError_t krn_cuda_trap(cudaStream_t stream) {
    trap_kernel<<<1, 1, 0, stream>>>();
    return cudaGetLastError();
}
