/* eng_cpu_tp.c — the cpu engine as one rank of a tensor-parallel group (Megatron-style).
 *
 * Owns: binding the rank's weight shard (eng_shard.h) — row ranges of wq/wk/wv, w_gate/w_up,
 * embed_tokens and lm_head are views into the mapped files; the column slices of wo and
 * w_down are copied once at open into one region —, the vocabulary-parallel embedding (each
 * rank embeds the tokens of its slice, zeros elsewhere, one all-reduce), next_dist without
 * gathering logits (below) and the gathered logits of eng_logits.
 * Does not own: the layers' all-reduces (eng_cpu.c, eng_residual), the collective
 * (services/worker/tp/wrk_coll.c), the split itself (eng_shard.c).
 *
 * next_dist over a group, per row, exactly the softmax of the whole vocabulary:
 *   1. each rank finds its slice's largest logit (NaN left out; the lowest id on ties) and the
 *      ranks all-gather them: M = the global maximum, A = its lowest id (the ranks' slices are
 *      in vocabulary order, so the first rank holding M holds A);
 *   2. each rank computes exp((l - M) / T) over its slice with the kernel krn_cpu_softmax uses
 *      (krn_cpu_exp_shifted), its sum, and its local top_k of those values — the limits
 *      (infinite M, T whose inverse overflows) put 1 on A and 0 elsewhere, as krn_cpu_softmax;
 *   3. the ranks all-gather (sum, local top-k) records; every rank adds the sums in rank order
 *      and merges the lists scaled by 1 / sum (eng_tp_merge_lists, shared with the cuda
 *      engine). The global top_k is among the union of the local ones, so nothing is
 *      approximated; the result differs from tp_size 1 only by the order of float additions
 *      (the layers' all-reduces, the sum).
 * The exchange is two small all-gathers per group of rows instead of [rows, vocab] floats. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eng_cpu_impl.h"
#include "eng_tp_dist.h"
#include "wrk_coll.h"

#define ENG_TP_REC_HEAD 16u   /* a record: double sum, uint32 k, pad, then ids[kmax], vals[kmax] */
#define ENG_TP_K_BUDGET 1024u /* rows of a next_dist group are sized for this top_k each */

/* ---- weights ------------------------------------------------------------------------------- */

static size_t eng_tp_tensor_bytes(const mdl_tensor *t) {
    return (size_t)t->rows * t->cols * mdl_dtype_size(t->dtype);
}

/* Columns [c0, c0 + n) of t copied to dst ([t.rows, n], same dtype). */
static mdl_tensor eng_tp_cols(const mdl_tensor *t, uint32_t c0, uint32_t n, char *dst) {
    size_t elt = mdl_dtype_size(t->dtype);
    for (uint32_t r = 0; r < t->rows; r++)
        memcpy(dst + (size_t)r * n * elt, (const char *)t->data + ((size_t)r * t->cols + c0) * elt,
               (size_t)n * elt);
    return (mdl_tensor){.data = dst, .dtype = t->dtype, .rows = t->rows, .cols = n};
}

static size_t eng_tp_align(size_t n) { return (n + 63) / 64 * 64; }

pie_code eng_tp_bind_weights(eng *e, pie_status *st) {
    const mdl_model *m = e->m;
    const eng_shard *s = &e->shard;
    uint32_t hd = m->cfg.head_dim, L = m->cfg.n_layers;
    if (s->size == 1) {
        e->layers = m->layers;
        e->embed = m->embed;
        e->lm_head = m->lm_head;
        e->info.weight_bytes = m->weight_bytes;
        return PIE_OK;
    }
    size_t elt = mdl_dtype_size(m->embed.dtype);
    size_t wo_bytes = eng_tp_align((size_t)m->cfg.hidden_size * e->qd * elt);
    size_t down_bytes = eng_tp_align((size_t)m->cfg.hidden_size * e->ffn * elt);
    e->own_layers = calloc(L ? L : 1, sizeof *e->own_layers);
    if (!e->own_layers)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    pie_code rc = eng_cpu_map(&e->slices, (wo_bytes + down_bytes) * L,
                              "this rank's slices of o_proj and down_proj", st);
    if (rc != PIE_OK) return rc;
    e->embed = eng_shard_rows(&m->embed, s->vocab0, s->n_vocab);
    e->lm_head = eng_shard_rows(&m->lm_head, s->vocab0, s->n_vocab);
    size_t bytes = eng_tp_tensor_bytes(&e->embed) + eng_tp_tensor_bytes(&m->norm);
    if (!m->cfg.tie_word_embeddings) bytes += eng_tp_tensor_bytes(&e->lm_head);
    char *dst = e->slices.p;
    for (uint32_t l = 0; l < L; l++) {
        const mdl_layer *src = &m->layers[l];
        mdl_layer *o = &e->own_layers[l];
        o->attn_norm = src->attn_norm;
        o->ffn_norm = src->ffn_norm;
        o->wq = eng_shard_rows(&src->wq, s->head0 * hd, s->n_heads * hd);
        o->wk = eng_shard_rows(&src->wk, s->kv_head0 * hd, s->n_kv_heads * hd);
        o->wv = eng_shard_rows(&src->wv, s->kv_head0 * hd, s->n_kv_heads * hd);
        o->wo = eng_tp_cols(&src->wo, s->head0 * hd, s->n_heads * hd, dst);
        o->w_gate = eng_shard_rows(&src->w_gate, s->ffn0, s->n_ffn);
        o->w_up = eng_shard_rows(&src->w_up, s->ffn0, s->n_ffn);
        o->w_down = eng_tp_cols(&src->w_down, s->ffn0, s->n_ffn, dst + wo_bytes);
        dst += wo_bytes + down_bytes;
        const mdl_tensor *all[] = {&o->attn_norm, &o->ffn_norm, &o->wq,   &o->wk,    &o->wv,
                                   &o->wo,        &o->w_gate,   &o->w_up, &o->w_down};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            bytes += eng_tp_tensor_bytes(all[i]);
    }
    e->layers = e->own_layers;
    e->info.weight_bytes = bytes;
    return PIE_OK;
}

/* ---- embed --------------------------------------------------------------------------------- */

pie_code eng_tp_embed_text(eng *e, const uint32_t *slots, const uint32_t *tokens,
                           const uint32_t *positions, uint32_t n, pie_status *st) {
    size_t d = e->info.hidden_size;
    uint32_t T = e->info.max_batch_tokens, v0 = e->shard.vocab0, nv = e->shard.n_vocab;
    for (uint32_t start = 0; start < n; start += T) {
        uint32_t rows = n - start < T ? n - start : T;
        for (uint32_t i = 0; i < rows; i++) {
            float *row = e->x + (size_t)i * d;
            uint32_t t = tokens[start + i];
            if (t >= v0 && t - v0 < nv) {
                uint32_t local = t - v0;
                krn_cpu_embed(e->embed.data, eng_cpu_wt(e, &e->embed), (int)d, &local, 1, row);
            } else {
                memset(row, 0, d * sizeof(float));
            }
        }
        /* exactly one rank holds each row: the sum is that row, bit for bit */
        pie_code rc = wrk_coll_allreduce_sum_f32(e->coll, e->x, (size_t)rows * d, st);
        if (rc != PIE_OK) return rc;
        for (uint32_t i = 0; i < rows; i++) {
            memcpy(e->emb + (size_t)slots[start + i] * d, e->x + (size_t)i * d, d * sizeof(float));
            e->emb_pos[slots[start + i]] = positions[start + i];
        }
    }
    return PIE_OK;
}

/* ---- next_dist ----------------------------------------------------------------------------- */

static size_t eng_tp_rec_bytes(uint32_t kmax) { return ENG_TP_REC_HEAD + (size_t)kmax * 8; }

size_t eng_tp_rec_cap(const eng *e) {
    if (e->shard.size == 1) return 0;
    uint32_t stride = e->shard.vocab_stride;
    uint32_t k = stride < ENG_TP_K_BUDGET ? stride : ENG_TP_K_BUDGET;
    size_t rows = e->dist_rows * eng_tp_rec_bytes(k), one = eng_tp_rec_bytes(stride);
    size_t cap = rows > one ? rows : one;
    /* eng_tp_logits gathers [vocab_stride] floats per rank through the same buffers */
    size_t logits = (size_t)stride * sizeof(float);
    return cap > logits ? cap : logits;
}

/* The rows of the next group (from items[0]) and the top_k its records hold: as many rows as
 * fit tp_rec_cap (at least one: the cap holds a record of the whole slice). Every rank
 * computes the same grouping from the same arguments. */
static uint32_t eng_tp_group(const eng *e, const eng_dist_item *items, uint32_t n, uint32_t *kmax) {
    uint32_t rows = 0, k = 0, lim = n < e->dist_rows ? n : e->dist_rows;
    while (rows < lim) {
        uint32_t ki =
            items[rows].top_k < e->shard.vocab_stride ? items[rows].top_k : e->shard.vocab_stride;
        uint32_t nk = ki > k ? ki : k;
        if (rows > 0 && (size_t)(rows + 1) * eng_tp_rec_bytes(nk) > e->tp_rec_cap) break;
        k = nk;
        rows++;
    }
    *kmax = k;
    return rows;
}

typedef struct eng_tp_job {
    eng *e;
    const eng_dist_item *items; /* the rows of this group */
    uint32_t kmax;
    size_t rec_bytes;
} eng_tp_job;

/* Step 1 of one row: the largest number of this rank's slice and its lowest id. */
static void eng_tp_max_task(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const eng_tp_job *job = arg;
    const eng *e = job->e;
    uint32_t nv = e->shard.n_vocab;
    const float *x = e->logits + (size_t)task * nv;
    eng_tp_max r = {.max = 0.0f, .arg = 0, .has = 0};
    for (uint32_t i = 0; i < nv; i++)
        if (!isnan(x[i]) && (!r.has || x[i] > r.max))
            r = (eng_tp_max){x[i], e->shard.vocab0 + i, 1};
    e->tp_max[task] = r;
}

/* The group's maximum of each row from every rank's (in rank order = vocabulary order, so a
 * strict > keeps the lowest id among equal maxima). */
static void eng_tp_reduce_max(eng *e, uint32_t rows) {
    for (uint32_t row = 0; row < rows; row++) {
        eng_tp_max g = {.max = 0.0f, .arg = 0, .has = 0};
        for (uint32_t r = 0; r < e->shard.size; r++) {
            const eng_tp_max *m = &e->tp_max_all[(size_t)r * rows + row];
            if (m->has && (!g.has || m->max > g.max)) g = *m;
        }
        e->tp_max[row] = g;
    }
}

/* Step 2 of one row: this slice's exponentials, their sum and its top k, as a record. */
static void eng_tp_rec_task(void *arg, int task, int n_tasks) {
    (void)n_tasks;
    const eng_tp_job *job = arg;
    const eng *e = job->e;
    const eng_dist_item *it = &job->items[task];
    uint32_t nv = e->shard.n_vocab, v0 = e->shard.vocab0;
    float *x = e->logits + (size_t)task * nv;
    const eng_tp_max *g = &e->tp_max[task];
    double sum = 0.0;
    if (g->has) { /* else every logit is NaN: they stay NaN, as krn_cpu_softmax leaves them */
        float inv_t = 1.0f / it->temperature;
        if (!(it->temperature > 0.0f) || isinf(g->max) || isinf(inv_t)) {
            for (uint32_t i = 0; i < nv; i++)
                if (!isnan(x[i])) x[i] = v0 + i == g->arg ? 1.0f : 0.0f;
            sum = g->arg >= v0 && g->arg - v0 < nv ? 1.0 : 0.0;
        } else {
            sum = krn_cpu_exp_shifted(x, (int)nv, g->max, it->temperature);
        }
    }
    char *rec = e->tp_rec + (size_t)task * job->rec_bytes;
    uint32_t *ids = (uint32_t *)(rec + ENG_TP_REC_HEAD);
    float *vals = (float *)(rec + ENG_TP_REC_HEAD + (size_t)job->kmax * sizeof(uint32_t));
    uint32_t k = it->top_k < nv ? it->top_k : nv;
    krn_cpu_topk(x, (int)nv, (int)k, ids, vals);
    for (uint32_t i = 0; i < k; i++) ids[i] += v0;
    memcpy(rec, &sum, sizeof sum);
    memcpy(rec + sizeof sum, &k, sizeof k);
}

/* Step 3 of one row: the sums in rank order, the local lists merged by their probabilities. */
static void eng_tp_merge(const eng *e, const eng_tp_job *job, uint32_t rows, uint32_t row,
                         eng_dist_item *it) {
    const uint32_t *ids[WRK_COLL_MAX_RANKS];
    const float *vals[WRK_COLL_MAX_RANKS];
    int counts[WRK_COLL_MAX_RANKS];
    double sum = 0.0;
    for (uint32_t r = 0; r < e->shard.size; r++) {
        const char *rec = e->tp_rec_all + ((size_t)r * rows + row) * job->rec_bytes;
        double s;
        uint32_t k;
        memcpy(&s, rec, sizeof s);
        memcpy(&k, rec + sizeof s, sizeof k);
        sum += s;
        ids[r] = (const uint32_t *)(rec + ENG_TP_REC_HEAD);
        vals[r] = (const float *)(rec + ENG_TP_REC_HEAD + (size_t)job->kmax * sizeof(uint32_t));
        counts[r] = (int)k;
    }
    eng_tp_merge_lists(ids, vals, counts, e->shard.size, sum, it->top_k, it->ids, it->probs);
}

pie_code eng_tp_next_dist(eng *e, eng_dist_item *items, uint32_t n, pie_status *st) {
    for (uint32_t start = 0; start < n;) {
        uint32_t kmax = 0;
        uint32_t rows = eng_tp_group(e, &items[start], n - start, &kmax);
        eng_tp_job job = {e, &items[start], kmax, eng_tp_rec_bytes(kmax)};
        eng_cpu_lm_head(e, &items[start], rows);
        krn_pool_run(e->pool, eng_tp_max_task, &job, (int)rows);
        pie_code rc =
            wrk_coll_allgather(e->coll, e->tp_max, rows * sizeof(eng_tp_max), e->tp_max_all, st);
        if (rc != PIE_OK) return rc;
        eng_tp_reduce_max(e, rows);
        krn_pool_run(e->pool, eng_tp_rec_task, &job, (int)rows);
        rc = wrk_coll_allgather(e->coll, e->tp_rec, rows * job.rec_bytes, e->tp_rec_all, st);
        if (rc != PIE_OK) return rc;
        for (uint32_t row = 0; row < rows; row++)
            eng_tp_merge(e, &job, rows, row, &items[start + row]);
        start += rows;
    }
    return PIE_OK;
}

/* ---- logits -------------------------------------------------------------------------------- */

pie_code eng_tp_logits(eng *e, uint32_t slot, float *logits, pie_status *st) {
    uint32_t stride = e->shard.vocab_stride, nv = e->shard.n_vocab;
    float *mine = (float *)e->tp_rec, *all = (float *)e->tp_rec_all; /* [stride], [size][stride] */
    eng_cpu_linear(e, e->emb + (size_t)slot * e->info.hidden_size, 1, &e->lm_head, mine);
    memset(mine + nv, 0, (size_t)(stride - nv) * sizeof(float));
    pie_code rc = wrk_coll_allgather(e->coll, mine, (size_t)stride * sizeof(float), all, st);
    if (rc != PIE_OK) return rc;
    memcpy(logits, all, (size_t)e->info.vocab_size * sizeof(float)); /* slices in vocab order */
    return PIE_OK;
}
