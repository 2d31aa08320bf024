/* krn_dist.c — turning logits into a distribution and picking its largest entries.
 *
 * Owns: softmax with temperature (max-subtracted, the max found by a vector pass, vector exp and
 * scaling; its exponentials alone for a slice of the logits), top-k by a bounded min-heap (O(n log
 * k); ties keep the lower index first; NaN ranks below every number) fed only numbers at or above a
 * floor taken from block maxima, whose scan skips, 8 or 16 at a time, the numbers that cannot
 * enter the heap, and the merge of several top-k lists. Edges, the same
 * on every SIMD path and on the cuda backend (tests/kcheck): a NaN logit is left out of the max
 * and the sum and keeps a NaN probability; an infinite largest logit, a temperature that is not
 * > 0 or whose inverse overflows put all mass on the first largest number.
 * Does not own: sampling policy (the engine decides what to do with the distribution). */
#include "krn_cpu_impl.h"

#include <math.h>

#define KRN_TOPK_MERGE_MAX 64 /* lists krn_cpu_topk_merge takes (the ranks of a group) */
/* The top-k floor (topk_floor): blocks per entry wanted, at most this many blocks, and blocks
 * of at least this many numbers (below that the scan is cheap anyway). */
#define KRN_TOPK_BLOCKS_PER_K 4
#define KRN_TOPK_MAX_BLOCKS   4096
#define KRN_TOPK_MIN_BLOCK    32

#define KRN_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define KRN_TARGET_AVX2   __attribute__((target("avx2,fma,f16c")))

/* ---- softmax ----------------------------------------------------------------------------- */

/* x[i] = exp((x[i] - max) * inv_t) for every number (NaN stays NaN); returns the sum of the
 * numbers. */
static float exp_sum_scalar(float *x, int n, float max, float inv_t) {
    double sum = 0.0; /* a vocabulary of 128k terms summed in f32 one by one loses 1e-4 */
    for (int i = 0; i < n; i++) {
        if (isnan(x[i])) continue;
        x[i] = expf((x[i] - max) * inv_t);
        sum += x[i];
    }
    return (float)sum;
}

static void scale_scalar(float *x, int n, float s) {
    for (int i = 0; i < n; i++) x[i] *= s;
}

#if KRN_X86
KRN_TARGET_AVX2 static float exp_sum_avx2(float *x, int n, float max, float inv_t) {
    __m256 vm = _mm256_set1_ps(max), vt = _mm256_set1_ps(inv_t);
    double sum = 0.0;
    int i = 0;
    while (i + 8 <= n) {
        /* lanes summed in f32 for at most 512 elements, then flushed to a double */
        __m256 acc = _mm256_setzero_ps();
        int end = n - i > 512 ? i + 512 : n;
        for (; i + 8 <= end; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i), nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
            __m256 e = krn_exp256(_mm256_mul_ps(_mm256_sub_ps(v, vm), vt));
            _mm256_storeu_ps(x + i, _mm256_blendv_ps(e, v, nan)); /* NaN stays NaN */
            acc = _mm256_add_ps(acc, _mm256_andnot_ps(nan, e));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int l = 0; l < 8; l++) sum += lanes[l];
    }
    return (float)(sum + exp_sum_scalar(x + i, n - i, max, inv_t));
}

KRN_TARGET_AVX512 static float exp_sum_avx512(float *x, int n, float max, float inv_t) {
    __m512 vm = _mm512_set1_ps(max), vt = _mm512_set1_ps(inv_t);
    double sum = 0.0;
    for (int i = 0; i < n;) {
        /* lanes summed in f32 for at most 1024 elements, then flushed to a double */
        __m512 acc = _mm512_setzero_ps();
        int end = n - i > 1024 ? i + 1024 : n;
        for (; i < end; i += 16) {
            __mmask16 m = krn_mask16(end - i);
            __m512 v = _mm512_maskz_loadu_ps(m, x + i);
            __mmask16 num = (__mmask16)(m & ~_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
            __m512 e = krn_exp512(_mm512_mul_ps(_mm512_sub_ps(v, vm), vt));
            e = _mm512_maskz_mov_ps(num, e);
            _mm512_mask_storeu_ps(x + i, num, e); /* NaN stays NaN */
            acc = _mm512_add_ps(acc, e);
        }
        sum += _mm512_reduce_add_ps(acc);
    }
    return (float)sum;
}

/* x[i] *= s, 16 or 8 at a time: the same products as scale_scalar (the compiler leaves that
 * loop scalar at -O2, and it is a pass over the whole vocabulary). */
KRN_TARGET_AVX2 static void scale_avx2(float *x, int n, float s) {
    __m256 vs = _mm256_set1_ps(s);
    int i = 0;
    for (; n - i >= 8; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    scale_scalar(x + i, n - i, s);
}

KRN_TARGET_AVX512 static void scale_avx512(float *x, int n, float s) {
    __m512 vs = _mm512_set1_ps(s);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = krn_mask16(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
        if (n - i <= 16) break;
    }
}
#endif

static void scale(float *x, int n, float s) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: scale_avx512(x, n, s); return;
    case KRN_SIMD_AVX2: scale_avx2(x, n, s); return;
#endif
    default: scale_scalar(x, n, s);
    }
}

/* The SIMD path's exp_sum. */
static float exp_sum(float *x, int n, float max, float inv_t) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: return exp_sum_avx512(x, n, max, inv_t);
    case KRN_SIMD_AVX2: return exp_sum_avx2(x, n, max, inv_t);
#endif
    default: return exp_sum_scalar(x, n, max, inv_t);
    }
}

typedef int (*next_candidate_fn)(const float *x, int i, int n, float root);
static next_candidate_fn pick_next_candidate(void);
static float block_max(const float *x, int n);

/* The index of the first largest number of x[0, n) (NaN left out), or -1 if there is none: the
 * largest by a SIMD pass, then the first index holding it (a number > the float just below
 * it; -0 and +0 are equal, as to a scalar compare). */
static int first_max(const float *x, int n) {
    if (n <= 0) return -1;
    float m = block_max(x, n);
    float below = m > -INFINITY ? nextafterf(m, -INFINITY) : NAN; /* NaN: any number */
    int arg = pick_next_candidate()(x, 0, n, below);
    return arg < n ? arg : -1;
}

void krn_cpu_softmax(float *x, int n, float temperature) {
    int arg = first_max(x, n);
    if (arg < 0) return; /* nothing but NaN (or n <= 0): every probability is NaN already */
    float max = x[arg], inv_t = 1.0f / temperature;
    if (!(temperature > 0.0f) || isinf(max) || isinf(inv_t)) {
        /* the limit T → 0 (or an infinite logit): all mass on the first maximum */
        for (int i = 0; i < n; i++)
            if (!isnan(x[i])) x[i] = i == arg ? 1.0f : 0.0f;
        return;
    }
    scale(x, n, 1.0f / exp_sum(x, n, max, inv_t));
}

float krn_cpu_exp_shifted(float *x, int n, float max, float temperature) {
    return n > 0 ? exp_sum(x, n, max, 1.0f / temperature) : 0.0f;
}

/* ---- top-k ------------------------------------------------------------------------------- */

/* Whether (va, ia) ranks above (vb, ib): larger value first, NaN last, ties to the lower
 * index. */
static int ranks_above(float va, uint32_t ia, float vb, uint32_t ib) {
    int na = isnan(va), nb = isnan(vb);
    if (na || nb) {
        if (na != nb) return nb;
        return ia < ib;
    }
    if (va != vb) return va > vb;
    return ia < ib;
}

/* Restores the min-heap (the lowest-ranked entry at the root) below position i. */
static void sift_down(uint32_t *ids, float *vals, int size, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, low = i;
        if (l < size && ranks_above(vals[low], ids[low], vals[l], ids[l])) low = l;
        if (r < size && ranks_above(vals[low], ids[low], vals[r], ids[r])) low = r;
        if (low == i) return;
        float tv = vals[i];
        uint32_t ti = ids[i];
        vals[i] = vals[low];
        ids[i] = ids[low];
        vals[low] = tv;
        ids[low] = ti;
        i = low;
    }
}

static void sift_up(uint32_t *ids, float *vals, int i) {
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (!ranks_above(vals[parent], ids[parent], vals[i], ids[i])) return;
        float tv = vals[i];
        uint32_t ti = ids[i];
        vals[i] = vals[parent];
        ids[i] = ids[parent];
        vals[parent] = tv;
        ids[parent] = ti;
        i = parent;
    }
}

/* ---- top-k: the scan past a full heap ---------------------------------------------------- *
 * Every index the scan reaches is above every id in the heap, so x[j] ranks above the heap's
 * root (value root) exactly when x[j] > root, or root is NaN and x[j] is not (a tie loses to
 * the root's lower index; a NaN x[j] ranks below a number and loses a NaN tie by index). Most
 * of a vocabulary fails that test, so it is made on 8 or 16 numbers at once; these return the
 * first index in [i, n) that passes, or n. */

static int next_candidate_scalar(const float *x, int i, int n, float root) {
    if (isnan(root)) {
        while (i < n && isnan(x[i])) i++;
    } else {
        while (i < n && !(x[i] > root)) i++;
    }
    return i;
}

#if KRN_X86
KRN_TARGET_AVX2 static int next_candidate_avx2(const float *x, int i, int n, float root) {
    int nan_root = isnan(root);
    __m256 r = _mm256_set1_ps(root);
    while (n - i >= 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 hit = nan_root ? _mm256_cmp_ps(v, v, _CMP_ORD_Q) : _mm256_cmp_ps(v, r, _CMP_GT_OQ);
        unsigned bits = (unsigned)_mm256_movemask_ps(hit);
        if (bits) return i + __builtin_ctz(bits);
        i += 8;
    }
    return next_candidate_scalar(x, i, n, root);
}

KRN_TARGET_AVX512 static int next_candidate_avx512(const float *x, int i, int n, float root) {
    int nan_root = isnan(root);
    __m512 r = _mm512_set1_ps(root);
    while (i < n) {
        __mmask16 m = krn_mask16(n - i);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        __mmask16 hit = nan_root ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_ORD_Q)
                                 : _mm512_mask_cmp_ps_mask(m, v, r, _CMP_GT_OQ);
        if (hit) return i + __builtin_ctz((unsigned)hit);
        if (n - i <= 16) break;
        i += 16;
    }
    return n;
}
#endif

static next_candidate_fn pick_next_candidate(void) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: return next_candidate_avx512;
    case KRN_SIMD_AVX2: return next_candidate_avx2;
#endif
    default: return next_candidate_scalar;
    }
}

/* ---- top-k: a floor from block maxima ---------------------------------------------------- */

/* The largest number of x[0, n) (NaN left out), or -inf. A compare and a masked move rather
 * than max: what a max instruction returns for NaN depends on the operands' order. */
static float block_max_scalar(const float *x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    return m;
}

#if KRN_X86
KRN_TARGET_AVX2 static float block_max_avx2(const float *x, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; n - i >= 8; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_blendv_ps(m, v, _mm256_cmp_ps(v, m, _CMP_GT_OQ));
    }
    float lanes[8], r = block_max_scalar(x + i, n - i);
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++)
        if (lanes[l] > r) r = lanes[l];
    return r;
}

KRN_TARGET_AVX512 static float block_max_avx512(const float *x, int n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 16) {
        __mmask16 in = krn_mask16(n - i);
        __m512 v = _mm512_maskz_loadu_ps(in, x + i);
        m = _mm512_mask_mov_ps(m, _mm512_mask_cmp_ps_mask(in, v, m, _CMP_GT_OQ), v);
        if (n - i <= 16) break;
    }
    return _mm512_reduce_max_ps(m); /* no NaN in m */
}
#endif

static float block_max(const float *x, int n) {
    switch (krn_simd_level()) {
#if KRN_X86
    case KRN_SIMD_AVX512: return block_max_avx512(x, n);
    case KRN_SIMD_AVX2: return block_max_avx2(x, n);
#endif
    default: return block_max_scalar(x, n);
    }
}

static void topk_heap(const float *x, int n, int k, float floor, uint32_t *ids, float *vals);

/* A floor for the top k of x: the k-th largest of the maxima of nb >= k blocks. Those k maxima
 * are k numbers >= floor, so a number below it has k numbers above it and is not in the top
 * k (nor is a NaN); the top k of the numbers >= floor is the top k of x. -inf: no floor (x too
 * short for blocks worth scanning, k too large, or fewer than k blocks hold a number above
 * -inf). ids/vals (k entries) are the scratch of a top-k of the maxima. */
static float topk_floor(const float *x, int n, int k, uint32_t *ids, float *vals) {
    int nb = k * KRN_TOPK_BLOCKS_PER_K;
    if (k > KRN_TOPK_MAX_BLOCKS / KRN_TOPK_BLOCKS_PER_K || n / nb < KRN_TOPK_MIN_BLOCK)
        return -INFINITY;
    float maxima[KRN_TOPK_MAX_BLOCKS];
    for (int b = 0; b < nb; b++) {
        int lo = (int)((int64_t)n * b / nb), hi = (int)((int64_t)n * (b + 1) / nb);
        maxima[b] = block_max(x + lo, hi - lo);
    }
    topk_heap(maxima, nb, k, -INFINITY, ids, vals);
    return vals[0]; /* the heap's root: the k-th largest */
}

/* ---- top-k: the heap --------------------------------------------------------------------- */

/* The top k of x (k <= n) as a min-heap in ids/vals (the lowest-ranked entry at [0]), fed the
 * first k entries of x — or, when floor > -inf (topk_floor: at least k numbers reach it), the
 * first k numbers >= floor — then every later entry that ranks above the root. */
static void topk_heap(const float *x, int n, int k, float floor, uint32_t *ids, float *vals) {
    next_candidate_fn next = pick_next_candidate();
    /* x > below <=> x >= floor for every number (IEEE compares; nothing here sets
     * denormals-are-zero) */
    float below = floor > -INFINITY ? nextafterf(floor, -INFINITY) : NAN;
    int i = 0;
    for (int size = 0; size < k; size++, i++) {
        if (floor > -INFINITY) i = next(x, i, n, below); /* < n: k numbers reach the floor */
        ids[size] = (uint32_t)i;
        vals[size] = x[i];
        sift_up(ids, vals, size);
    }
    for (i = next(x, i, n, vals[0]); i < n; i = next(x, i + 1, n, vals[0])) {
        ids[0] = (uint32_t)i; /* x[i] ranks above the root: it replaces it */
        vals[0] = x[i];
        sift_down(ids, vals, k, 0);
    }
}

void krn_cpu_topk(const float *x, int n, int k, uint32_t *ids, float *vals) {
    if (k > n) k = n;
    if (k <= 0) return;
    /* ids/vals hold the heap while scanning */
    topk_heap(x, n, k, topk_floor(x, n, k, ids, vals), ids, vals);
    /* pop the lowest-ranked entry to the end, k times: descending order */
    for (int end = k - 1; end > 0; end--) {
        float tv = vals[0];
        uint32_t ti = ids[0];
        vals[0] = vals[end];
        ids[0] = ids[end];
        vals[end] = tv;
        ids[end] = ti;
        sift_down(ids, vals, end, 0);
    }
}

void krn_cpu_topk_merge(const uint32_t *const *ids, const float *const *vals, const int *counts,
                        int n_lists, float scale, int k, uint32_t *out_ids, float *out_vals) {
    int at[KRN_TOPK_MERGE_MAX] = {0}; /* next entry of each list */
    if (n_lists > KRN_TOPK_MERGE_MAX) n_lists = KRN_TOPK_MERGE_MAX;
    for (int o = 0; o < k; o++) {
        int best = -1;
        float best_v = 0.0f;
        for (int i = 0; i < n_lists; i++) {
            if (at[i] >= counts[i]) continue;
            float v = vals[i][at[i]] * scale;
            if (best < 0 || ranks_above(v, ids[i][at[i]], best_v, ids[best][at[best]])) {
                best = i;
                best_v = v;
            }
        }
        if (best < 0) return; /* fewer than k entries in all */
        out_ids[o] = ids[best][at[best]];
        out_vals[o] = best_v;
        at[best]++;
    }
}
