/* krn_vec.c — the per-element and per-row kernels of a decoder layer.
 *
 * Owns: RMSNorm, residual add, SiLU-multiply, embedding gather, rotary frequencies (with
 * Llama-3 scaling as HF transformers computes them) and RoPE in the rotate_half convention.
 * Each has a portable C version and, where it pays, AVX2 and AVX-512 versions chosen by
 * krn_simd_level().
 * Does not own: softmax / top-k (krn_dist.c), linear layers (krn_linear.c). */
#include "krn_cpu_impl.h"

#include <math.h>

#define KRN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define KRN_TARGET_AVX2   __attribute__((target("avx2,fma,f16c")))

/* ---- add --------------------------------------------------------------------------------- */

static void add_scalar(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

#if KRN_X86
KRN_TARGET_AVX2 static void add_avx2(float *x, const float *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    add_scalar(x + i, y + i, n - i);
}

KRN_TARGET_AVX512 static void add_avx512(float *x, const float *y, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(
            x + i, m,
            _mm512_add_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
    }
}
#endif

void krn_cpu_add(float *x, const float *y, size_t n) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: add_avx512(x, y, n); return;
    case KRN_SIMD_AVX2: add_avx2(x, y, n); return;
#endif
    default: add_scalar(x, y, n); return;
    }
}

/* ---- silu_mul ---------------------------------------------------------------------------- */

static void silu_mul_scalar(float *g, const float *u, size_t n) {
    for (size_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#if KRN_X86
KRN_TARGET_AVX2 static void silu_mul_avx2(float *g, const float *u, size_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = krn_exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    silu_mul_scalar(g + i, u + i, n - i);
}

KRN_TARGET_AVX512 static void silu_mul_avx512(float *g, const float *u, size_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = krn_mask16(n - i);
        __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        __m512 e = krn_exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
        __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}
#endif

void krn_cpu_silu_mul(float *gate, const float *up, size_t n) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: silu_mul_avx512(gate, up, n); return;
    case KRN_SIMD_AVX2: silu_mul_avx2(gate, up, n); return;
#endif
    default: silu_mul_scalar(gate, up, n); return;
    }
}

/* ---- rmsnorm ----------------------------------------------------------------------------- */

static float sumsq_scalar(const float *x, int d) {
    float s = 0.0f;
    for (int i = 0; i < d; i++) s += x[i] * x[i];
    return s;
}

/* y[i] = x[i] * inv * w[i] for w already in f32. */
static void scale_mul_scalar(const float *x, const float *w, float inv, int d, float *y) {
    for (int i = 0; i < d; i++) y[i] = x[i] * inv * w[i];
}

#if KRN_X86
KRN_TARGET_AVX2 static float sumsq_avx2(const float *x, int d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; i + 8 <= d; i += 8) {
        __m256 v0 = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
    }
    a0 = _mm256_add_ps(a0, a1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s) + sumsq_scalar(x + i, d - i);
}

KRN_TARGET_AVX2 static void scale_mul_avx2(const float *x, const float *w, float inv, int d,
                                           float *y) {
    __m256 vi = _mm256_set1_ps(inv);
    int i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi),
                                              _mm256_loadu_ps(w + i)));
    scale_mul_scalar(x + i, w + i, inv, d - i, y + i);
}

KRN_TARGET_AVX512 static float sumsq_avx512(const float *x, int d) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= d; i += 32) {
        __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i < d; i += 16) {
        __mmask16 m = krn_mask16(d - i);
        __m512 v0 = _mm512_maskz_loadu_ps(m, x + i);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

KRN_TARGET_AVX512 static void scale_mul_avx512(const float *x, const float *w, float inv, int d,
                                               float *y) {
    __m512 vi = _mm512_set1_ps(inv);
    for (int i = 0; i < d; i += 16) {
        __mmask16 m = krn_mask16(d - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vi);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}
#endif

static float sumsq(const float *x, int d) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: return sumsq_avx512(x, d);
    case KRN_SIMD_AVX2: return sumsq_avx2(x, d);
#endif
    default: return sumsq_scalar(x, d);
    }
}

static void scale_mul(const float *x, const float *w, float inv, int d, float *y) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: scale_mul_avx512(x, w, inv, d, y); return;
    case KRN_SIMD_AVX2: scale_mul_avx2(x, w, inv, d, y); return;
#endif
    default: scale_mul_scalar(x, w, inv, d, y); return;
    }
}

void krn_cpu_rmsnorm(const float *x, const void *w, krn_dtype wt, int n, int d, float eps,
                     float *y) {
    if (d <= 0) return;
    /* weights converted in chunks so no allocation is needed for any d */
    enum { CHUNK = 1024 };
    float wf[CHUNK];
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * (size_t)d;
        float *yr = y + (size_t)r * (size_t)d;
        float inv = 1.0f / sqrtf(sumsq(xr, d) / (float)d + eps);
        for (int c = 0; c < d; c += CHUNK) {
            int len = d - c < CHUNK ? d - c : CHUNK;
            const float *wc;
            if (wt == KRN_F32) {
                wc = (const float *)w + c;
            } else {
                krn_cvt_f32((const uint16_t *)w + c, wt, (size_t)len, wf);
                wc = wf;
            }
            scale_mul(xr + c, wc, inv, len, yr + c);
        }
    }
}

/* ---- embed ------------------------------------------------------------------------------- */

void krn_cpu_embed(const void *table, krn_dtype wt, int d, const uint32_t *tokens, int n,
                   float *out) {
    size_t es = krn_dtype_size(wt);
    if (wt == KRN_BF16_PANEL) {
        for (int i = 0; i < n; i++) krn_wpack_row(table, d, tokens[i], out + (size_t)i * (size_t)d);
        return;
    }
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)table + (size_t)tokens[i] * (size_t)d * es;
        krn_cvt_f32(row, wt, (size_t)d, out + (size_t)i * (size_t)d);
    }
}

/* ---- rotary embeddings ------------------------------------------------------------------- */

void krn_cpu_rope_freqs(float *inv_freq, int head_dim, float theta, float factor,
                        float low_freq_factor, float high_freq_factor, int orig_max_position) {
    const double pi = 3.14159265358979323846;
    int half = head_dim / 2;
    for (int j = 0; j < half; j++) {
        double f = 1.0 / pow((double)theta, (double)(2 * j) / (double)head_dim);
        if (factor > 0.0f) {
            /* HF transformers' _compute_llama3_parameters */
            double orig = (double)orig_max_position;
            double low_wavelen = orig / (double)low_freq_factor;
            double high_wavelen = orig / (double)high_freq_factor;
            double wavelen = 2.0 * pi / f;
            if (wavelen > low_wavelen) {
                f = f / (double)factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (orig / wavelen - (double)low_freq_factor) /
                                ((double)high_freq_factor - (double)low_freq_factor);
                f = (1.0 - smooth) * f / (double)factor + smooth * f;
            }
        }
        inv_freq[j] = (float)f;
    }
}

void krn_cpu_rope(float *x, const uint32_t *pos, int n, int n_heads, int head_dim,
                  const float *inv_freq) {
    int half = head_dim / 2;
    enum { CHUNK = 64 };
    float c[CHUNK], s[CHUNK];
    for (int i = 0; i < n; i++) {
        float p = (float)pos[i];
        float *row = x + (size_t)i * (size_t)n_heads * (size_t)head_dim;
        for (int j0 = 0; j0 < half; j0 += CHUNK) {
            int len = half - j0 < CHUNK ? half - j0 : CHUNK;
            for (int j = 0; j < len; j++) {
                /* the angle rounded to f32 as HF computes it (position · inv_freq in f32) */
                float a = p * inv_freq[j0 + j];
                c[j] = cosf(a);
                s[j] = sinf(a);
            }
            for (int h = 0; h < n_heads; h++) {
                float *lo = row + (size_t)h * (size_t)head_dim + j0;
                float *hi = lo + half;
                for (int j = 0; j < len; j++) {
                    float a = lo[j], b = hi[j];
                    lo[j] = a * c[j] - b * s[j];
                    hi[j] = b * c[j] + a * s[j];
                }
            }
        }
    }
}
