/* kcheck.c — see kcheck.h. */
#include "kcheck.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ----------------------------------------------------------------------------- */

static bool kc_fail(char *why, size_t cap, const char *fmt, ...) {
    if (why && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, cap, fmt, ap);
        va_end(ap);
    }
    return false;
}

typedef struct kc_rng {
    uint64_t s;
} kc_rng;

static uint64_t kc_next(kc_rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

/* uniform in [-1, 1) */
static float kc_unit(kc_rng *r) {
    return (float)((double)(kc_next(r) >> 11) / 4503599627370496.0 - 1.0);
}

/* f rounded to the nearest bf16 (ties to even), as an f32: the value a bf16 cache holds. */
static float kc_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- sharpened attention ----------------------------------------------------------------- */

enum { KC_HEADS = 8, KC_KV_HEADS = 2, KC_PAGE = 16, KC_SPARE_PAGES = 8 };

/* Context tokens each sequence hides with its page masks (sequence index, count). */
typedef struct kc_span {
    int seq, from, count;
} kc_span;
static const kc_span kc_page_masked[] = {
    {0, 37, 1}, {0, 320, 16}, {0, 699, 1}, /* "append": a token, a whole page, the last */
    {1, 0, 1},  {1, 512, 4},               /* "decode+tail" */
};

/* "tree": rows cover 31, 32, 33 tokens; each hides context tokens 5..9, rows 1 and 2 also
 * their sibling's token (30, then 31). */
static const uint32_t kc_tree_runs[] = {5, 5, 21, 5, 5, 20, 1, 1, 5, 5, 21, 1, 1};
static const int kc_tree_row_start[] = {0, 3, 8};

static size_t kc_kvd(const kc_attn_case *c) { return (size_t)c->n_kv_heads * c->head_dim; }

/* K (which 0) or V (which 1) of key t of sequence s. */
static float *kc_key(const kc_attn_case *c, int s, int t, int which) {
    const kc_attn_seq *q = &c->seq[s];
    size_t kvd = kc_kvd(c);
    if (t < q->n_ctx) {
        size_t page = c->pages[q->page0 + t / c->page_size];
        return c->kv +
               ((page * 2 + (size_t)which) * c->page_size + (size_t)(t % c->page_size)) * kvd;
    }
    float *tail = which ? c->vt : c->kt;
    return tail + (size_t)(q->tail_row + t - q->n_ctx) * kvd;
}

bool kc_attn_run_visible(const kc_attn_case *c, int s, int r, int t) {
    const kc_attn_seq *q = &c->seq[s];
    if (!q->runs) return true;
    if (t < 0 || t > q->q_seq + r) return false; /* beyond the row's runs */
    int i = c->row_runs[q->q_row + r], at = 0;
    bool vis = true;
    for (;;) {
        int run = (int)c->runs[i++];
        if (t < at + run) return vis;
        at += run;
        vis = !vis;
    }
}

bool kc_attn_page_masked(const kc_attn_case *c, int s, int t) {
    const kc_attn_seq *q = &c->seq[s];
    if (t >= q->pm_ctx) return false;
    size_t page = c->pages[q->page0 + t / c->page_size];
    return c->page_mask[page * c->page_size + (size_t)(t % c->page_size)] != 0;
}

bool kc_attn_visible(const kc_attn_case *c, int s, int r, int t) {
    const kc_attn_seq *q = &c->seq[s];
    if (t < 0 || t >= q->n_ctx + q->n_tail || t > q->q_seq + r) return false;
    return kc_attn_run_visible(c, s, r, t) && !kc_attn_page_masked(c, s, t);
}

void kc_attn_dense_mask(const kc_attn_case *c, int s, uint8_t *mask) {
    const kc_attn_seq *q = &c->seq[s];
    int keys = q->n_ctx + q->n_tail;
    for (int r = 0; r < q->n_q; r++)
        for (int t = 0; t < keys; t++) mask[(size_t)r * keys + t] = kc_attn_visible(c, s, r, t);
}

int kc_attn_chunk(const kc_attn_case *c, int n_splits) {
    int most = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        int keys = c->seq[s].n_ctx + c->seq[s].n_tail;
        if (keys > most) most = keys;
    }
    int chunk = (most + n_splits - 1) / n_splits;
    return (chunk + 31) / 32 * 32;
}

/* A visible key that takes a share of the softmax: 2 for the first and last keys of the
 * context and of the tail and each row's own token; one key per 32 (at a varying offset) gets 2
 * in even blocks and 1 in odd ones (a score 1 lower: the weights then depend on the scale of
 * the scores). 0: not a marker. */
static int kc_marker(const kc_attn_seq *q, int t) {
    if (t == 0 || t == q->n_ctx - 1 || t == q->n_ctx || t == q->n_ctx + q->n_tail - 1 ||
        (t >= q->q_seq && t < q->q_seq + q->n_q))
        return 2;
    if (t % 32 == (t / 32 * 7) % 32) return t / 32 % 2 ? 1 : 2;
    return 0;
}

/* u[kvh][hd]: the direction markers and hidden keys share with every query of the KV head. */
static void kc_fill_key(const kc_attn_case *c, const float *u, float k_scale, float v_fixed,
                        kc_rng *r, float *k, float *v) {
    size_t kvd = kc_kvd(c);
    for (size_t d = 0; d < kvd; d++) {
        if (k_scale != 0.0f) {
            k[d] = k_scale * u[d];
        } else {
            k[d] = kc_bf16(kc_unit(r));
        }
        if (v_fixed != 0.0f)
            v[d] = v_fixed;
        else if (k_scale != 0.0f)
            v[d] = (kc_next(r) & 1) ? 1.0f : -1.0f; /* a marker */
        else
            v[d] = kc_bf16(kc_unit(r));
    }
}

bool kc_attn_build(kc_attn_case *c, int head_dim, uint64_t seed, char *why, size_t cap) {
    memset(c, 0, sizeof *c);
    if (head_dim < 16 || head_dim > 256 || head_dim % 16 != 0)
        return kc_fail(why, cap, "kc_attn_build: head_dim %d is not a multiple of 16 in [16, 256]",
                       head_dim);
    static const kc_attn_seq shapes[KC_ATTN_SEQS] = {
        {.name = "append", .n_ctx = 720, .n_tail = 0, .n_q = 20, .q_seq = 700, .pm_ctx = 700},
        {.name = "decode+tail",
         .n_ctx = 1000,
         .n_tail = 2,
         .n_q = 2,
         .q_seq = 1000,
         .pm_ctx = 1000},
        {.name = "tree", .n_ctx = 30, .n_tail = 3, .n_q = 3, .q_seq = 30, .runs = true},
        {.name = "long", .n_ctx = 1500, .n_tail = 0, .n_q = 1, .q_seq = 1499},
        {.name = "empty", .n_ctx = 0, .n_tail = 1, .n_q = 1, .q_seq = 0},
    };
    kc_rng rng = {seed * 0x9e3779b97f4a7c15ull + 1};
    c->n_heads = KC_HEADS;
    c->n_kv_heads = KC_KV_HEADS;
    c->head_dim = head_dim;
    c->page_size = KC_PAGE;
    c->scale = 1.0f / sqrtf((float)head_dim);
    c->n_seqs = KC_ATTN_SEQS;
    int pages = 0;
    for (int s = 0; s < KC_ATTN_SEQS; s++) {
        kc_attn_seq *q = &c->seq[s];
        *q = shapes[s];
        q->q_row = c->rows;
        q->tail_row = c->rows; /* a tail is the rows' own inputs, as in the engine */
        q->page0 = pages;
        q->n_pages = (q->n_ctx + KC_PAGE - 1) / KC_PAGE;
        c->rows += q->n_q;
        pages += q->n_pages;
    }
    c->pool_pages = pages + KC_SPARE_PAGES;
    c->n_page_list = pages;
    size_t kvd = kc_kvd(c), qd = (size_t)c->n_heads * head_dim;
    size_t pool_tokens = (size_t)c->pool_pages * KC_PAGE;
    c->q = malloc(sizeof(float) * c->rows * qd);
    c->kv = malloc(sizeof(float) * pool_tokens * 2 * kvd);
    c->kt = malloc(sizeof(float) * c->rows * kvd);
    c->vt = malloc(sizeof(float) * c->rows * kvd);
    c->pages = malloc(sizeof(uint32_t) * (size_t)(pages ? pages : 1));
    c->page_mask = calloc(pool_tokens, 1);
    c->n_runs = (int)(sizeof kc_tree_runs / sizeof kc_tree_runs[0]);
    c->runs = malloc(sizeof kc_tree_runs);
    c->row_runs = malloc(sizeof(int32_t) * c->rows);
    uint32_t *perm = malloc(sizeof(uint32_t) * c->pool_pages);
    float *u = malloc(sizeof(float) * kvd);
    if (!c->q || !c->kv || !c->kt || !c->vt || !c->pages || !c->page_mask || !c->runs ||
        !c->row_runs || !perm || !u) {
        free(perm);
        free(u);
        kc_attn_free(c);
        return kc_fail(why, cap, "kc_attn_build: out of memory");
    }
    /* pages handed out in a scrambled order; the last KC_SPARE_PAGES belong to no sequence */
    for (int i = 0; i < c->pool_pages; i++) perm[i] = (uint32_t)i;
    for (int i = c->pool_pages - 1; i > 0; i--) {
        int j = (int)(kc_next(&rng) % (uint64_t)(i + 1));
        uint32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    memcpy(c->pages, perm, sizeof(uint32_t) * (size_t)pages);
    memcpy(c->runs, kc_tree_runs, sizeof kc_tree_runs);
    for (int i = 0; i < c->rows; i++) c->row_runs[i] = -1;
    for (int r = 0; r < 3; r++) c->row_runs[c->seq[2].q_row + r] = kc_tree_row_start[r];
    for (size_t i = 0; i < sizeof kc_page_masked / sizeof kc_page_masked[0]; i++) {
        const kc_span *sp = &kc_page_masked[i];
        const kc_attn_seq *q = &c->seq[sp->seq];
        for (int t = sp->from; t < sp->from + sp->count; t++)
            c->page_mask[(size_t)c->pages[q->page0 + t / KC_PAGE] * KC_PAGE + t % KC_PAGE] = 1;
    }

    /* Markers score ~40 (or ~39) for every query, hidden keys ~80 (far above), other keys
     * 0 ± 2 (a weight below e^-37). */
    for (size_t d = 0; d < kvd; d++) u[d] = (kc_next(&rng) & 1) ? 1.0f : -1.0f;
    float mark = kc_bf16(40.0f / sqrtf((float)head_dim)), hide = 2.0f * mark;
    float mark1 = kc_bf16(39.0f / sqrtf((float)head_dim));
    for (int i = 0; i < c->rows; i++)
        for (int h = 0; h < c->n_heads; h++)
            for (int d = 0; d < head_dim; d++) {
                int kvh = h / (c->n_heads / c->n_kv_heads);
                c->q[(size_t)i * qd + (size_t)h * head_dim + d] =
                    kc_bf16(u[(size_t)kvh * head_dim + d] + 0.5f * kc_unit(&rng));
            }
    /* everything no sequence sees is a hidden key: spare pages, ends of last pages, unused tails */
    for (size_t tok = 0; tok < pool_tokens; tok++) {
        size_t page = tok / KC_PAGE, off = tok % KC_PAGE;
        float *k = c->kv + ((page * 2) * KC_PAGE + off) * kvd;
        float *v = c->kv + ((page * 2 + 1) * KC_PAGE + off) * kvd;
        kc_fill_key(c, u, hide, KC_ATTN_HIDDEN, &rng, k, v);
    }
    for (int i = 0; i < c->rows; i++)
        kc_fill_key(c, u, hide, KC_ATTN_HIDDEN, &rng, c->kt + (size_t)i * kvd,
                    c->vt + (size_t)i * kvd);
    for (int s = 0; s < c->n_seqs; s++) {
        const kc_attn_seq *q = &c->seq[s];
        for (int t = 0; t < q->n_ctx + q->n_tail; t++) {
            bool seen = false;
            for (int r = 0; r < q->n_q && !seen; r++) seen = kc_attn_visible(c, s, r, t);
            float *k = kc_key(c, s, t, 0), *v = kc_key(c, s, t, 1);
            if (!seen)
                kc_fill_key(c, u, hide, KC_ATTN_HIDDEN, &rng, k, v);
            else if (kc_marker(q, t))
                kc_fill_key(c, u, kc_marker(q, t) == 2 ? mark : mark1, 0.0f, &rng, k, v);
            else
                kc_fill_key(c, u, 0.0f, 0.0f, &rng, k, v);
        }
    }
    free(perm);
    free(u);
    return true;
}

void kc_attn_randomize(kc_attn_case *c, uint64_t seed) {
    kc_rng rng = {seed * 0x9e3779b97f4a7c15ull + 7};
    size_t kvd = kc_kvd(c), qd = (size_t)c->n_heads * c->head_dim;
    size_t kv = (size_t)c->pool_pages * c->page_size * 2 * kvd;
    for (size_t i = 0; i < kv; i++) c->kv[i] = kc_bf16(kc_unit(&rng));
    for (size_t i = 0; i < (size_t)c->rows * qd; i++) c->q[i] = kc_bf16(kc_unit(&rng));
    for (size_t i = 0; i < (size_t)c->rows * kvd; i++) {
        c->kt[i] = kc_bf16(kc_unit(&rng));
        c->vt[i] = kc_bf16(kc_unit(&rng));
    }
}

void kc_attn_free(kc_attn_case *c) {
    free(c->q);
    free(c->kv);
    free(c->kt);
    free(c->vt);
    free(c->pages);
    free(c->page_mask);
    free(c->runs);
    free(c->row_runs);
    memset(c, 0, sizeof *c);
}

bool kc_attn_check(const kc_attn_case *c, const float *out, double rtol, char *why, size_t cap) {
    int hd = c->head_dim, g = c->n_heads / c->n_kv_heads;
    size_t qd = (size_t)c->n_heads * hd;
    int most = 1;
    for (int s = 0; s < c->n_seqs; s++)
        if (c->seq[s].n_ctx + c->seq[s].n_tail > most) most = c->seq[s].n_ctx + c->seq[s].n_tail;
    double *score = malloc(sizeof(double) * (size_t)most), *acc = malloc(sizeof(double) * hd);
    if (!score || !acc) {
        free(score);
        free(acc);
        return kc_fail(why, cap, "kc_attn_check: out of memory");
    }
    bool ok = true;
    for (int s = 0; s < c->n_seqs && ok; s++) {
        const kc_attn_seq *q = &c->seq[s];
        int keys = q->n_ctx + q->n_tail;
        for (int r = 0; r < q->n_q && ok; r++)
            for (int h = 0; h < c->n_heads && ok; h++) {
                const float *qv = c->q + (size_t)(q->q_row + r) * qd + (size_t)h * hd;
                int kvh = h / g;
                double m = -INFINITY, sum = 0, vmax = 0;
                for (int t = 0; t < keys; t++) {
                    score[t] = -INFINITY;
                    if (!kc_attn_visible(c, s, r, t)) continue;
                    const float *k = kc_key(c, s, t, 0) + (size_t)kvh * hd;
                    double dot = 0;
                    for (int d = 0; d < hd; d++) dot += (double)qv[d] * k[d];
                    score[t] = dot * c->scale;
                    if (score[t] > m) m = score[t];
                }
                for (int d = 0; d < hd; d++) acc[d] = 0;
                for (int t = 0; t < keys; t++) {
                    if (score[t] == -INFINITY) continue;
                    double p = exp(score[t] - m);
                    const float *v = kc_key(c, s, t, 1) + (size_t)kvh * hd;
                    sum += p;
                    for (int d = 0; d < hd; d++) {
                        acc[d] += p * v[d];
                        if (fabs(v[d]) > vmax) vmax = fabs(v[d]);
                    }
                }
                double tol = rtol * (vmax > 0 ? vmax : 1.0);
                const float *o = out + (size_t)(q->q_row + r) * qd + (size_t)h * hd;
                for (int d = 0; d < hd; d++) {
                    double want = sum > 0 ? acc[d] / sum : 0.0;
                    if (!(fabs((double)o[d] - want) <= tol)) { /* NaN fails too */
                        ok = kc_fail(why, cap,
                                     "attention head_dim %d, sequence \"%s\" row %d head %d dim "
                                     "%d: %.6g, expected %.6g (tolerance %.3g = %.0e x max|V| "
                                     "%.3g)",
                                     hd, q->name, r, h, d, (double)o[d], want, tol, rtol, vmax);
                        break;
                    }
                }
            }
    }
    free(score);
    free(acc);
    return ok;
}

/* ---- next-token distributions ------------------------------------------------------------ */

void kc_dist_reference(const float *x, uint32_t n, float temperature, float *p) {
    int64_t arg = -1;
    for (uint32_t i = 0; i < n; i++)
        if (!isnan(x[i]) && (arg < 0 || x[i] > x[arg])) arg = i;
    if (arg < 0) {
        for (uint32_t i = 0; i < n; i++) p[i] = NAN;
        return;
    }
    float m = x[arg], inv_t = 1.0f / temperature;
    if (!(temperature > 0.0f) || isinf(m) || isinf(inv_t)) {
        for (uint32_t i = 0; i < n; i++) p[i] = isnan(x[i]) ? NAN : (i == arg ? 1.0f : 0.0f);
        return;
    }
    double sum = 0;
    for (uint32_t i = 0; i < n; i++)
        if (!isnan(x[i])) sum += exp((double)(x[i] - m) * inv_t);
    for (uint32_t i = 0; i < n; i++)
        p[i] = isnan(x[i]) ? NAN : (float)(exp((double)(x[i] - m) * inv_t) / sum);
}

/* (p desc, NaN last, id asc) */
static int kc_rank_cmp(const void *a, const void *b, void *arg) {
    const float *p = arg;
    uint32_t ia = *(const uint32_t *)a, ib = *(const uint32_t *)b;
    bool na = isnan(p[ia]), nb = isnan(p[ib]);
    if (na != nb) return na ? 1 : -1;
    if (!na && p[ia] != p[ib]) return p[ia] > p[ib] ? -1 : 1;
    return ia < ib ? -1 : ia > ib;
}

bool kc_dist_check(const float *x, uint32_t n, float temperature, uint32_t k, const uint32_t *ids,
                   const float *probs, double rtol, char *why, size_t cap) {
    if (k > n) return kc_fail(why, cap, "top-k: k %u is more than the vocabulary %u", k, n);
    float *p = malloc(sizeof(float) * n);
    uint32_t *order = malloc(sizeof(uint32_t) * n);
    uint8_t *seen = calloc(n, 1);
    if (!p || !order || !seen) {
        free(p);
        free(order);
        free(seen);
        return kc_fail(why, cap, "kc_dist_check: out of memory");
    }
    kc_dist_reference(x, n, temperature, p);
    for (uint32_t i = 0; i < n; i++) order[i] = i;
    qsort_r(order, n, sizeof *order, kc_rank_cmp, p);
    bool ok = true;
    for (uint32_t j = 0; j < k && ok; j++) {
        uint32_t id = ids[j], want = order[j];
        if (id >= n) {
            ok = kc_fail(why, cap, "top-k rank %u: id %u is outside the vocabulary %u", j, id, n);
            break;
        }
        if (seen[id]) {
            ok = kc_fail(why, cap, "top-k rank %u: id %u appears twice", j, id);
            break;
        }
        seen[id] = 1;
        float pr = p[id], ps = p[want];
        if (isnan(ps) != isnan(pr)) {
            ok = kc_fail(why, cap,
                         "top-k rank %u: id %u (logit %g, p %g), expected id %u (logit %g, p %g): "
                         "NaN logits rank after every number",
                         j, id, (double)x[id], (double)pr, want, (double)x[want], (double)ps);
        } else if (!isnan(ps) && !(fabs((double)pr - ps) <= rtol * ps)) {
            ok = kc_fail(why, cap,
                         "top-k rank %u: id %u (logit %g, p %.7g), expected id %u (logit %g, p "
                         "%.7g)",
                         j, id, (double)x[id], (double)pr, want, (double)x[want], (double)ps);
        } else if (id != want && (isnan(ps) || (pr == ps && (x[id] == x[want] || ps == 0.0f)))) {
            ok = kc_fail(why, cap,
                         "top-k rank %u: id %u, expected id %u: equal probabilities (%g) go to the "
                         "lower id first",
                         j, id, want, (double)ps);
        } else if (isnan(pr) ? !isnan(probs[j])
                             : !(fabs((double)probs[j] - pr) <= rtol * pr + 1e-37)) {
            ok = kc_fail(why, cap, "top-k rank %u: id %u has probability %.7g, expected %.7g", j,
                         id, (double)probs[j], (double)pr);
        }
    }
    free(p);
    free(order);
    free(seen);
    return ok;
}

/* Multiples of 1/64 in [-span, span]: exact ties happen, near ties do not. */
static float kc_grid(kc_rng *r, float span) { return roundf(kc_unit(r) * span * 64.0f) / 64.0f; }

const char *kc_dist_edge(int which, float *x, uint32_t *n, float *temperature, uint32_t *k) {
    kc_rng r = {0x5eed0000u + (uint64_t)which};
    *temperature = 1.0f;
    switch (which) {
    case 0:
        *n = 16, *k = 16;
        for (uint32_t i = 0; i < *n; i++) x[i] = kc_grid(&r, 4.0f);
        x[3] = x[7] = INFINITY, x[5] = NAN;
        return "+inf twice and a NaN: all mass on the first +inf";
    case 1:
        *n = 64, *k = 64, *temperature = 0.7f;
        for (uint32_t i = 0; i < *n; i++) x[i] = kc_grid(&r, 4.0f);
        x[0] = x[9] = x[63] = NAN;
        return "NaN logits among numbers: left out of the softmax, ranked last";
    case 2:
        *n = 40, *k = 12;
        for (uint32_t i = 0; i < *n; i++) x[i] = i % 2 ? -300.0f : -200.0f;
        x[3] = 5.0f, x[10] = x[11] = 0.0f;
        return "probabilities that underflow to 0: ordered by id, not by logit";
    case 3:
        *n = 8, *k = 3;
        for (uint32_t i = 0; i < *n; i++) x[i] = -INFINITY;
        return "every logit -inf: all mass on the first";
    case 4:
        *n = 8, *k = 3;
        for (uint32_t i = 0; i < *n; i++) x[i] = NAN;
        return "every logit NaN: every probability NaN";
    case 5:
        *n = 32, *k = 4, *temperature = 1e-40f;
        for (uint32_t i = 0; i < *n; i++) x[i] = kc_grid(&r, 4.0f);
        x[4] = x[20] = 9.0f;
        return "a temperature whose inverse overflows: all mass on the first maximum";
    case 6:
        *n = 8, *k = 8;
        for (uint32_t i = 0; i < *n; i++) x[i] = -INFINITY;
        x[0] = NAN;
        return "a NaN before -inf logits: the first -inf takes the mass";
    case 7:
        *n = KC_DIST_EDGE_MAX_N, *k = 1024;
        for (uint32_t i = 0; i < *n; i++) x[i] = -150.0f;
        for (uint32_t j = 0; j < 500; j++) x[(j * 257u + 11u) % *n] = kc_grid(&r, 5.0f);
        x[77] = NAN;
        return "a 128256-token vocabulary whose top 1024 reach underflowed zeros";
    default: *n = 0, *k = 0; return NULL;
    }
}

/* ---- engines ----------------------------------------------------------------------------- */

static pie_code kc_cpu_embed(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                             const uint32_t *positions, uint32_t n, pie_status *st) {
    return eng_embed_text(ctx, slots, tokens, positions, n, st);
}
static pie_code kc_cpu_forward(void *ctx, const eng_forward_item *items, uint32_t n,
                               pie_status *st) {
    return eng_forward(ctx, items, n, st);
}
static pie_code kc_cpu_mask_page(void *ctx, uint32_t page, const bool *masked, pie_status *st) {
    return eng_mask_page(ctx, page, masked, st);
}
static pie_code kc_cpu_logits(void *ctx, uint32_t slot, float *logits, pie_status *st) {
    return eng_logits(ctx, slot, logits, st);
}

kc_engine kc_engine_cpu(eng *e) {
    const eng_info *in = eng_get_info(e);
    return (kc_engine){.ctx = e,
                       .embed_text = kc_cpu_embed,
                       .forward = kc_cpu_forward,
                       .mask_page = kc_cpu_mask_page,
                       .logits = kc_cpu_logits,
                       .vocab = in->vocab_size,
                       .page_size = in->kv_page_size};
}

double kc_rel_diff(const float *a, const float *b, uint32_t n) {
    double worst = 0, scale = 0;
    for (uint32_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= worst)) worst = d; /* NaN makes it NaN */
        scale = fmax(scale, fabs((double)b[i]));
    }
    return worst / (scale > 0 ? scale : 1.0);
}

bool kc_eng_agree(const float *got, const float *want, uint32_t n, double tol, const char *what,
                  char *why, size_t cap) {
    double d = kc_rel_diff(got, want, n);
    if (d <= tol) return true;
    return kc_fail(why, cap,
                   "%s: logits differ from the reference by %.3g (max |diff| / max "
                   "|logit|), more than the tolerance %.3g",
                   what, d, tol);
}

bool kc_eng_mask_visible(const float *with, const float *without, uint32_t n, double tol,
                         double factor, const char *what, char *why, size_t cap) {
    double d = kc_rel_diff(without, with, n);
    if (d >= factor * tol) return true;
    return kc_fail(why, cap,
                   "%s: the mask changes the reference's logits by only %.3g, less "
                   "than %.0f x the tolerance %.3g: a backend that ignored it would pass",
                   what, d, factor, tol);
}

bool kc_eng_top1(const float *want, uint32_t n, uint32_t got_id, double abs_err, const char *what,
                 char *why, size_t cap) {
    if (got_id >= n)
        return kc_fail(why, cap, "%s: top-1 id %u is outside [0, %u)", what, got_id, n);
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (want[i] > want[best]) best = i;
    if ((double)want[got_id] >= (double)want[best] - 2.0 * abs_err) return true;
    return kc_fail(why, cap,
                   "%s: top-1 is id %u (reference logit %.6g), the reference's is %u "
                   "(%.6g): a margin of %.3g beyond twice the logit error %.3g",
                   what, got_id, (double)want[got_id], best, (double)want[best],
                   (double)want[best] - want[got_id], abs_err);
}

bool kc_eng_bitwise(const float *a, const float *b, uint32_t n, const char *what, char *why,
                    size_t cap) {
    for (uint32_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof a[i]) != 0)
            return kc_fail(why, cap,
                           "%s: value %u differs between two identical runs: %.9g vs "
                           "%.9g",
                           what, i, (double)a[i], (double)b[i]);
    return true;
}

static uint32_t kc_tok(const kc_engine *e, uint32_t seq, uint32_t i) {
    return (seq * 7919u + i * 104729u + 13u) % e->vocab;
}

static eng_forward_item kc_item(const kc_engine *e, const uint32_t *pages, uint32_t seq_len,
                                bool append, const uint32_t *in, uint32_t n_in, const uint32_t *out,
                                uint32_t n_out) {
    uint32_t ps = e->page_size;
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = (seq_len + ps - 1) / ps,
                              .kv_last_page_len = seq_len ? (seq_len - 1) % ps + 1 : 0,
                              .append_kv = append,
                              .in_slots = in,
                              .n_in = n_in,
                              .out_slots = out,
                              .n_out = n_out};
}

/* Embeds n tokens of sequence seq from index `from` into slots slot0.., positions from.. */
static bool kc_embed_seq(const kc_engine *e, uint32_t slot0, uint32_t seq, uint32_t from,
                         uint32_t n, char *why, size_t cap) {
    uint32_t *buf = malloc(sizeof(uint32_t) * 3 * (n ? n : 1));
    if (!buf) return kc_fail(why, cap, "kcheck: out of memory");
    for (uint32_t i = 0; i < n; i++) {
        buf[i] = slot0 + i;
        buf[n + i] = kc_tok(e, seq, from + i);
        buf[2 * n + i] = from + i;
    }
    pie_status st = {0};
    pie_code rc = e->embed_text(e->ctx, buf, buf + n, buf + 2 * n, n, &st);
    free(buf);
    return rc == PIE_OK || kc_fail(why, cap, "embed_text: %s", st.msg);
}

static bool kc_forward(const kc_engine *e, const eng_forward_item *items, uint32_t n,
                       const char *what, char *why, size_t cap) {
    pie_status st = {0};
    if (e->forward(e->ctx, items, n, &st) == PIE_OK) return true;
    return kc_fail(why, cap, "%s: forward: %s", what, st.msg);
}

static bool kc_logits_of(const kc_engine *e, uint32_t slot, float *logits, char *why, size_t cap) {
    pie_status st = {0};
    if (e->logits(e->ctx, slot, logits, &st) == PIE_OK) return true;
    return kc_fail(why, cap, "logits of slot %u: %s", slot, st.msg);
}

/* Sets the mask of context tokens [from, to) of pages (false elsewhere in those pages). */
static bool kc_mask_tokens(const kc_engine *e, const uint32_t *pages, uint32_t from, uint32_t to,
                           bool on, char *why, size_t cap) {
    uint32_t ps = e->page_size;
    bool *m = calloc(ps, sizeof *m);
    if (!m) return kc_fail(why, cap, "kcheck: out of memory");
    bool ok = true;
    for (uint32_t p = from / ps; ok && p <= (to - 1) / ps; p++) {
        for (uint32_t o = 0; o < ps; o++) {
            uint32_t t = p * ps + o;
            m[o] = on && t >= from && t < to;
        }
        pie_status st = {0};
        if (e->mask_page(e->ctx, pages[p], m, &st) != PIE_OK)
            ok = kc_fail(why, cap, "mask_page %u: %s", pages[p], st.msg);
    }
    free(m);
    return ok;
}

bool kc_eng_mask_scenario(const kc_engine *e, float *logits, char *why, size_t cap) {
    enum { N = 48, QUERY = 50, OUT0 = 56 };
    uint32_t pages[N], in[N], q = QUERY;
    uint32_t np = (N + e->page_size - 1) / e->page_size;
    if (np > sizeof pages / sizeof pages[0])
        return kc_fail(why, cap, "kc_eng_mask_scenario: page size %u is too small", e->page_size);
    for (uint32_t i = 0; i < np; i++) pages[i] = i;
    for (uint32_t i = 0; i < N; i++) in[i] = i;
    if (!kc_embed_seq(e, 0, 0, 0, N, why, cap)) return false;
    eng_forward_item pre = kc_item(e, pages, N, true, in, N, NULL, 0);
    if (!kc_forward(e, &pre, 1, "mask scenario prefill", why, cap)) return false;
    if (!kc_embed_seq(e, QUERY, 0, N, 1, why, cap)) return false;
    /* the query's row covers N + 1 tokens */
    static const uint32_t hide_span[] = {8, 32, 9}, hide_one[] = {20, 1, 28};
    for (uint32_t c = 0; c < KC_MASK_CASES; c++) {
        uint32_t out = OUT0 + c;
        eng_forward_item it = kc_item(e, pages, N, false, &q, 1, &out, 1);
        if (c == 0) it.mask_runs = hide_span, it.n_mask_runs = 3;
        if (c == 3) it.mask_runs = hide_one, it.n_mask_runs = 3;
        if (c == 2 && !kc_mask_tokens(e, pages, 8, 40, true, why, cap)) return false;
        if (!kc_forward(e, &it, 1, "mask scenario", why, cap)) return false;
        if (c == 2 && !kc_mask_tokens(e, pages, 8, 40, false, why, cap)) return false;
        if (!kc_logits_of(e, out, logits + (size_t)c * e->vocab, why, cap)) return false;
    }
    return true;
}

bool kc_eng_decode_scenario(const kc_engine *e, uint32_t n_seqs, uint32_t ctx, uint32_t steps,
                            float *logits, char *why, size_t cap) {
    uint32_t ps = e->page_size, per = (ctx + steps + ps - 1) / ps;
    uint32_t *pages = malloc(sizeof(uint32_t) * (size_t)n_seqs * per);
    uint32_t *slots = malloc(sizeof(uint32_t) * (ctx + 2 * (size_t)n_seqs));
    eng_forward_item *items = malloc(sizeof *items * n_seqs);
    bool ok = pages && slots && items;
    if (!ok) ok = kc_fail(why, cap, "kcheck: out of memory");
    for (uint32_t i = 0; ok && i < n_seqs * per; i++) pages[i] = i;
    for (uint32_t i = 0; ok && i < ctx + 2 * n_seqs; i++) slots[i] = i;
    uint32_t *in = slots + ctx, *out = slots + ctx + n_seqs;
    for (uint32_t b = 0; ok && b < n_seqs; b++) {
        ok = kc_embed_seq(e, 0, b, 0, ctx, why, cap);
        eng_forward_item it = kc_item(e, pages + (size_t)b * per, ctx, true, slots, ctx, NULL, 0);
        if (ok) ok = kc_forward(e, &it, 1, "decode scenario prefill", why, cap);
    }
    for (uint32_t s = 0; ok && s < steps; s++) {
        for (uint32_t b = 0; ok && b < n_seqs; b++) {
            ok = kc_embed_seq(e, in[b], b, ctx + s, 1, why, cap);
            items[b] =
                kc_item(e, pages + (size_t)b * per, ctx + s + 1, true, &in[b], 1, &out[b], 1);
        }
        if (ok) ok = kc_forward(e, items, n_seqs, "decode scenario step", why, cap);
    }
    for (uint32_t b = 0; ok && b < n_seqs; b++)
        ok = kc_logits_of(e, out[b], logits + (size_t)b * e->vocab, why, cap);
    free(pages);
    free(slots);
    free(items);
    return ok;
}
