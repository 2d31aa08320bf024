/* eng_cpu_offload.c — the cpu engine under CPU attention offload (issue 13; Neo, seed 004):
 * decode items whose KV lives wholly in the host region have their attention run by a host
 * attention pool while the engine's ("device") pool runs the rest.
 *
 * Owns: the two regions (both indexed by page id over the whole id space, so page ids never
 * change when KV moves), moving a page (every layer's block, one copy per layer each way), the
 * host attention pool and its driver thread, the cost model profiled at open, the stats. Where
 * each page lives and the per-step split (wrk_offload.h's scheduler, or the test's pick
 * callback) are mem/wrk_offplace.h's, shared with the null backend's emulated device.
 *
 * One step (eng_forward): every item's pages are made to live where its attention runs (a
 * page read by a device item and a host item of the same batch keeps the host item on the
 * device: a fork's shared prefix). The linear layers run over the whole batch as before; in
 * each layer, after K/V are stored (each item into its own region), one attention call's
 * items are split: the host ones go to the driver thread, which runs them on the host pool,
 * while the calling thread runs the device ones on the engine pool; both use the plan the
 * whole call would have used (krn_cpu_attention_plan), so every item's output is bit for bit
 * policy gpu's. On the cpu backend the linear layers are not split into the two sub-batches
 * of Neo's asymmetric pipeline: the linear kernels' rounding depends on the row count
 * (krn_linear.c picks its path by it), so splitting the rows would change the bits; what
 * overlaps here is host attention with device attention, and the full layer schedule (one
 * sub-batch's linear layers over the other's host attention) is modelled in wrk_offsim.h.
 *
 * Under tensor parallelism each rank holds its KV heads' share of every page in its own two
 * regions; rank 0 alone decides a step's split and broadcasts it (one byte per item), so every
 * rank moves the same pages and attends the same items on its host pool: the ranks' profiled
 * costs differ, and two plans would make the faster rank wait at each layer's all-reduce.
 *
 * Deferral (eng_forward_plan, eng_forward_skip; Neo §3.3): the plan decides over the whole
 * batch with the scheduler allowed to defer host decodes, and keeps the split; the caller then
 * runs the batch without the deferred items (and those depending on them), compacted, and the
 * kept split is applied to the full batch's page table (skipped items move no page, write
 * nothing) and compacted the same way. The kept items run as a batch of their own: what they
 * compute is what eng_forward computes for that batch.
 *
 * Without offload (e->off NULL) every hook does what policy gpu does. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng.h"
#include "eng_cpu_impl.h"
#include "eng_tier.h"
#include "wrk_coll.h"
#include "wrk_offload.h"
#include "wrk_numa.h"
#include "wrk_offplace.h"

#define OFF_PROFILE_PAGES 64u /* KV pages of the attention probes at open */
#define OFF_PROFILE_ROWS  16u /* rows of the linear probe */
#define OFF_PROFILE_COPY  (4u << 20)
#define OFF_PROFILE_REPS  4 /* runs of each probe; the least counts */

struct eng_offload {
    uint32_t device_pages;
    wrk_offplace place;       /* where each page lives, the step's split (mem/wrk_offplace.h) */
    wrk_offplace_item *pitems; /* [T] the forward's items as the placement sees them */
    const eng_forward_item *step_items; /* the forward being prepared (for the pick callback) */
    eng_region *host_regions; /* [n_layers] */
    krn_kv_layer *kv_host;    /* [n_layers] */
    uint8_t *item_host;       /* [T] per forward item: its attention runs on the host */
    uint32_t *attn_item;      /* [T] forward item of each entry of e->attn */
    krn_attn_item *dev_items, *host_items; /* [T] */
    wrk_off_costs costs;
    /* deferral: the last eng_forward_plan's batch (its items' pitems and item_host, full
     * length), until the eng_forward_skip that runs it */
    bool planned;
    uint32_t plan_n;
    uint8_t *skip;          /* [T] the skip mask of that run */
    eng_forward_item *kept; /* [T] the items run, compacted */
    bool (*pick)(void *user, uint32_t item, const eng_forward_item *it);
    void *pick_user;
    eng_offload_stats stats;

    krn_pool *hpool;
    pthread_t driver;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool has_job, job_done, stop;
    const krn_kv_layer *job_kv;
    int job_n, job_heads;
    float job_scale;
    krn_attn_plan job_plan;
    uint64_t job_ns;
};

static uint64_t off_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- the host attention driver -------------------------------------------------------------- */

static void *off_driver(void *arg) {
    eng_offload *o = arg;
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (!o->has_job && !o->stop) pthread_cond_wait(&o->cv, &o->mu);
        if (o->stop) break;
        pthread_mutex_unlock(&o->mu);
        uint64_t t0 = off_now_ns();
        krn_cpu_attention_run(o->hpool, o->job_kv, o->host_items, o->job_n, o->job_heads,
                              o->job_scale, &o->job_plan);
        uint64_t ns = off_now_ns() - t0;
        pthread_mutex_lock(&o->mu);
        o->job_ns = ns;
        o->has_job = false;
        o->job_done = true;
        pthread_cond_broadcast(&o->cv);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

void eng_attn_note(eng *e, uint32_t entry, uint32_t item) {
    if (e->off) e->off->attn_item[entry] = item;
}

void eng_attn_run(eng *e, uint32_t layer, int n_att) {
    eng_offload *o = e->off;
    int nh = (int)e->shard.n_heads;
    if (!o) {
        krn_cpu_attention(e->pool, &e->kv[layer], e->attn, n_att, nh, e->attn_scale);
        return;
    }
    krn_attn_plan plan = krn_cpu_attention_plan(e->pool, &e->kv[layer], e->attn, n_att, nh, 0);
    int nd = 0, nhost = 0;
    for (int a = 0; a < n_att; a++) {
        if (o->item_host[o->attn_item[a]]) o->host_items[nhost++] = e->attn[a];
        else o->dev_items[nd++] = e->attn[a];
    }
    if (nhost) {
        pthread_mutex_lock(&o->mu);
        o->job_kv = &o->kv_host[layer];
        o->job_n = nhost;
        o->job_heads = nh;
        o->job_scale = e->attn_scale;
        o->job_plan = plan;
        o->job_done = false;
        o->has_job = true;
        pthread_cond_broadcast(&o->cv);
        pthread_mutex_unlock(&o->mu);
    }
    if (nd) krn_cpu_attention_run(e->pool, &e->kv[layer], o->dev_items, nd, nh, e->attn_scale, &plan);
    if (nhost) {
        uint64_t w0 = off_now_ns();
        pthread_mutex_lock(&o->mu);
        while (!o->job_done) pthread_cond_wait(&o->cv, &o->mu);
        o->stats.host_wait_ns += off_now_ns() - w0;
        o->stats.last_host_attn_ns += o->job_ns;
        o->stats.host_attn_ns += o->job_ns;
        pthread_mutex_unlock(&o->mu);
    }
}

const krn_kv_layer *eng_item_kv(const eng *e, uint32_t item, uint32_t layer) {
    const eng_offload *o = e->off;
    return o && o->item_host[item] ? &o->kv_host[layer] : &e->kv[layer];
}

/* ---- where pages live ---------------------------------------------------------------------- */

static const krn_kv_layer *off_layer(const eng *e, uint32_t page, uint32_t layer) {
    return wrk_offplace_on_host(&e->off->place, page) ? &e->off->kv_host[layer] : &e->kv[layer];
}

/* wrk_offplace's move: every layer's block of a written page, one copy each. */
static void off_move_page(void *user, uint32_t page, uint8_t to) {
    eng *e = user;
    eng_offload *o = e->off;
    size_t bytes = e->info.kv_page_layer_bytes;
    for (uint32_t l = 0; l < e->info.n_layers; l++) {
        float *dev = krn_kv_k(&e->kv[l], page, 0), *host = krn_kv_k(&o->kv_host[l], page, 0);
        memcpy(to ? host : dev, to ? dev : host, bytes);
    }
}

/* wrk_offplace's pick: the test's callback, asked with the engine's item. */
static bool off_pick(void *user, uint32_t item) {
    eng *e = user;
    return e->off->pick(e->off->pick_user, item, &e->off->step_items[item]);
}

/* The split of a step: its pages moved, the host items counted. */
static void off_apply(eng *e, uint32_t n) {
    eng_offload *o = e->off;
    uint32_t hosted = wrk_offplace_apply(&o->place, o->pitems, n, o->item_host, off_move_page, e);
    if (hosted) o->stats.offload_steps++;
    o->stats.last_host_items = hosted;
    o->stats.host_items += hosted;
}

/* eng_offload_prepare of a planned batch run without its skipped items (n_kept of them): the
 * plan's split over the full batch, the skipped items deferred, compacted to the kept ones. */
static void off_prepare_planned(eng *e, uint32_t n_kept) {
    eng_offload *o = e->off;
    o->planned = false;
    wrk_offplace_skip(&o->place, o->pitems, o->plan_n, o->item_host, o->skip);
    off_apply(e, o->plan_n);
    uint32_t k = 0;
    for (uint32_t i = 0; i < o->plan_n; i++)
        if (!o->skip[i]) o->item_host[k++] = o->item_host[i];
    (void)n_kept; /* == k: eng_forward_skip compacted the same mask */
}

pie_code eng_offload_prepare(eng *e, const eng_forward_item *items, uint32_t n,
                             pie_status *st) {
    eng_offload *o = e->off;
    if (!o) return PIE_OK;
    o->stats.steps++;
    o->stats.last_host_items = 0;
    o->stats.last_host_attn_ns = 0;
    if (o->planned) {
        off_prepare_planned(e, n);
        return PIE_OK;
    }
    bool any = false; /* a decode that may go to the host */
    for (uint32_t i = 0; i < n; i++) {
        o->pitems[i] = (wrk_offplace_item){.pages = items[i].kv_pages,
                                           .n_pages = items[i].n_kv_pages,
                                           .ctx = e->chk.plan[i].ctx,
                                           .n_in = items[i].n_in,
                                           .append = items[i].append_kv};
        any = any || wrk_offplace_eligible(&o->pitems[i]);
    }
    o->step_items = items;
    if (!e->coll || e->shard.rank == 0)
        wrk_offplace_decide(&o->place, &o->costs, o->pitems, n, o->pick ? off_pick : NULL, e,
                            o->item_host, NULL);
    /* a group executes rank 0's plan: whether a step may offload at all is the same on every
     * rank (the items are), so a step with no decode skips the broadcast everywhere */
    if (e->coll && any) {
        pie_code rc = wrk_coll_bcast(e->coll, 0, o->item_host, n, st);
        if (rc != PIE_OK) return rc;
    } else if (e->coll) {
        memset(o->item_host, 0, n);
    }
    off_apply(e, n); /* move the pages, then mark what this step writes */
    return PIE_OK;
}

/* ---- deferral -------------------------------------------------------------------------------- */

pie_code eng_forward_plan(eng *e, const eng_forward_item *items, uint32_t n, uint8_t *defer,
                          pie_status *st) {
    if (n) memset(defer, 0, n);
    eng_offload *o = e->off;
    if (o) o->planned = false;
    if (!o || e->coll || n == 0) return PIE_OK; /* a group runs rank 0's plan without deferral */
    uint32_t T = 0;
    pie_code rc = eng_check_forward(&e->chk, items, n, e->page_n_masked, &T, st);
    if (rc != PIE_OK) return rc;
    for (uint32_t i = 0; i < n; i++)
        o->pitems[i] = (wrk_offplace_item){.pages = items[i].kv_pages,
                                           .n_pages = items[i].n_kv_pages,
                                           .ctx = e->chk.plan[i].ctx,
                                           .n_in = items[i].n_in,
                                           .append = items[i].append_kv};
    o->step_items = items;
    wrk_offplace_set_defer(&o->place, true);
    wrk_offplace_decide(&o->place, &o->costs, o->pitems, n, o->pick ? off_pick : NULL, e,
                        o->item_host, NULL);
    wrk_offplace_set_defer(&o->place, false);
    for (uint32_t i = 0; i < n; i++) defer[i] = o->item_host[i] == WRK_OFF_DEFER;
    o->planned = true;
    o->plan_n = n;
    return PIE_OK;
}

pie_code eng_forward_skip(eng *e, const eng_forward_item *items, uint32_t n, const uint8_t *skip,
                          pie_status *st) {
    eng_offload *o = e->off;
    if (o && o->planned && o->plan_n != n) o->planned = false; /* not this batch's plan */
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) m += skip[i] == 0;
    pie_code rc = PIE_OK;
    if (m == n) { /* nothing skipped: the plan (if any) runs as it is */
        if (o && o->planned) memset(o->skip, 0, n);
        rc = eng_forward(e, items, n, st);
    } else if (!o) {
        rc = pie_status_set(st, PIE_FAILED_PRECONDITION,
                            "forward: skipping items needs the offload memory policy");
    } else if (n > e->info.max_batch_tokens) { /* every item has an input: never valid */
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "forward: %u items, more than max_batch_tokens %u", n,
                            e->info.max_batch_tokens);
    } else {
        memcpy(o->skip, skip, n);
        for (uint32_t i = 0, k = 0; i < n; i++)
            if (!skip[i]) o->kept[k++] = items[i];
        if (m > 0) {
            rc = eng_forward(e, o->kept, m, st);
        } else if (o->planned) { /* nothing runs; the skipped requests did wait */
            wrk_offplace_skip(&o->place, o->pitems, o->plan_n, o->item_host, o->skip);
        }
    }
    if (o) o->planned = false; /* used by eng_offload_prepare, or dropped with a failure */
    return rc;
}

void eng_offload_copy(eng *e, const eng_copy_item *c) {
    eng_offload *o = e->off;
    size_t bytes = (size_t)c->count * e->kvd * krn_kv_elt_bytes(&e->kv[0]);
    for (uint32_t l = 0; l < e->info.n_layers; l++) {
        const krn_kv_layer *src = o ? off_layer(e, c->src, l) : &e->kv[l];
        const krn_kv_layer *dst = o ? off_layer(e, c->dst, l) : &e->kv[l];
        memcpy(krn_kv_k(dst, c->dst, (int)c->dst_off), krn_kv_k(src, c->src, (int)c->src_off),
               bytes);
        memcpy(krn_kv_v(dst, c->dst, (int)c->dst_off), krn_kv_v(src, c->src, (int)c->src_off),
               bytes);
    }
    if (o) wrk_offplace_copied(&o->place, c->dst);
}

void eng_pages_freed(eng *e, const uint32_t *pages, uint32_t n) {
    if (e && e->off) wrk_offplace_freed(&e->off->place, pages, n);
}

void eng_offload_cleared(eng *e, const uint32_t *pages, uint32_t n) {
    eng_offload *o = e->off;
    if (o) wrk_offplace_cleared(&o->place, pages, n); /* the device copy is the page now */
}

/* ---- open / close / stats ------------------------------------------------------------------ */

/* Times each probe's work per unit: the least of OFF_PROFILE_REPS runs (the first warms), so a
 * preemption or a neighbour's burst during one run does not skew the costs auto and the
 * scheduler decide from. */
static void off_profile(eng *e) {
    eng_offload *o = e->off;
    const eng_info *in = &e->info;
    double L = in->n_layers;
    /* the linear layers of one layer over 1 row (the pass over the weights) and over
     * OFF_PROFILE_ROWS rows of the scratch (the slope) */
    uint32_t rows = in->max_batch_tokens < OFF_PROFILE_ROWS ? in->max_batch_tokens : OFF_PROFILE_ROWS;
    if (in->n_layers && rows) {
        const mdl_layer *Ly = &e->layers[0];
        uint32_t counts[2] = {1, rows};
        double t[2] = {INFINITY, INFINITY};
        for (int k = 0; k < 2; k++)
            for (int rep = 0; rep < OFF_PROFILE_REPS; rep++) {
                uint32_t r = counts[k];
                uint64_t t0 = off_now_ns();
                eng_cpu_linear(e, e->xn, r, &Ly->wq, e->q);
                eng_cpu_linear(e, e->xn, r, &Ly->wk, e->k);
                eng_cpu_linear(e, e->xn, r, &Ly->wv, e->v);
                eng_cpu_linear(e, e->att, r, &Ly->wo, e->x);
                eng_cpu_linear(e, e->xn, r, &Ly->w_gate, e->gate);
                eng_cpu_linear(e, e->xn, r, &Ly->w_up, e->up);
                eng_cpu_linear(e, e->gate, r, &Ly->w_down, e->x);
                t[k] = fmin(t[k], (double)(off_now_ns() - t0) * 1e-9);
            }
        o->costs.lin_fixed = t[0] * L;
        o->costs.lin_tok = t[1] * L / rows;
    }
    /* attention over OFF_PROFILE_PAGES pages of layer 0, one decode row, on either pool */
    uint32_t pages = in->kv_pages < OFF_PROFILE_PAGES ? in->kv_pages : OFF_PROFILE_PAGES;
    uint32_t *ids = malloc(pages * sizeof *ids);
    if (ids && pages && in->n_layers && e->qd) {
        for (uint32_t i = 0; i < pages; i++) ids[i] = i;
        int ctx = (int)(pages * in->kv_page_size), nh = (int)e->shard.n_heads;
        memset(e->q, 0, e->qd * sizeof(float));
        krn_attn_item a = {.q = e->q, .out = e->att, .n_q = 1, .pages = ids, .n_ctx = ctx,
                           .q_offset = ctx - 1};
        for (int side = 0; side < 2; side++) {
            krn_pool *p = side ? o->hpool : e->pool;
            const krn_kv_layer *kv = side ? &o->kv_host[0] : &e->kv[0];
            double t = INFINITY;
            for (int rep = 0; rep < OFF_PROFILE_REPS; rep++) {
                uint64_t t0 = off_now_ns();
                krn_cpu_attention(p, kv, &a, 1, nh, e->attn_scale);
                t = fmin(t, (double)(off_now_ns() - t0) * 1e-9);
            }
            if (side) o->costs.hattn_kv = t * L / ctx;
            else o->costs.dattn_kv = t * L / ctx;
        }
    }
    free(ids);
    /* the "link": memcpy between two buffers */
    char *a = malloc(OFF_PROFILE_COPY), *b = malloc(OFF_PROFILE_COPY);
    if (a && b) {
        memset(a, 1, OFF_PROFILE_COPY);
        memset(b, 2, OFF_PROFILE_COPY);
        double t = INFINITY;
        for (int rep = 0; rep < OFF_PROFILE_REPS; rep++) {
            uint64_t t0 = off_now_ns();
            memcpy(b, a, OFF_PROFILE_COPY);
            t = fmin(t, (double)(off_now_ns() - t0) * 1e-9);
        }
        double tok_bytes = (double)in->kv_page_layer_bytes / in->kv_page_size * L;
        o->costs.xfer_tok = t / OFF_PROFILE_COPY * tok_bytes;
        if (b[OFF_PROFILE_COPY - 1] != 1) o->costs.xfer_tok = 0; /* cannot happen */
    }
    free(a);
    free(b);
}

pie_code eng_offload_open(eng *e, const eng_opts *opts, size_t layer_bytes, pie_status *st) {
    pie_code crc = eng_tier_offload_check(opts, e->info.kv_pages, st);
    if (crc != PIE_OK) return crc;
    eng_offload *o = calloc(1, sizeof *o);
    if (!o) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    e->off = o;
    uint32_t pages = e->info.kv_pages, T = e->info.max_batch_tokens, L = e->info.n_layers;
    o->device_pages = opts->offload_device_pages;
    o->stats.device_pages = o->device_pages;
    o->pick = opts->offload_pick;
    o->pick_user = opts->offload_pick_user;
    pie_code prc = wrk_offplace_init(&o->place, pages, o->device_pages, e->info.kv_page_size, T, st);
    if (prc != PIE_OK) return prc;
    o->pitems = calloc(T, sizeof *o->pitems);
    o->skip = calloc(T, 1);
    o->kept = calloc(T, sizeof *o->kept);
    o->host_regions = calloc(L ? L : 1, sizeof *o->host_regions);
    o->kv_host = calloc(L ? L : 1, sizeof *o->kv_host);
    o->item_host = calloc(T, 1);
    o->attn_item = calloc(T, sizeof *o->attn_item);
    o->dev_items = calloc(T, sizeof *o->dev_items);
    o->host_items = calloc(T, sizeof *o->host_items);
    if (!o->pitems || !o->skip || !o->kept || !o->host_regions || !o->kv_host || !o->item_host ||
        !o->attn_item || !o->dev_items || !o->host_items)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: out of memory for the offload tables");
    for (uint32_t l = 0; l < L; l++) {
        pie_code rc = eng_cpu_map(&o->host_regions[l], layer_bytes,
                                  "a layer of the host KV region (offload)", st);
        if (rc == PIE_OK && opts->host_numa_bind)
            rc = wrk_numa_bind(o->host_regions[l].p, o->host_regions[l].bytes, opts->host_numa_node,
                               "offload's host KV region", st);
        if (rc != PIE_OK) return rc;
        o->kv_host[l] = e->kv[l];
        o->kv_host[l].base = o->host_regions[l].p;
    }
    int threads = opts->offload_host_threads > 0 ? opts->offload_host_threads : 1;
    o->hpool = krn_pool_create(threads);
    if (!o->hpool)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot start %d host attention threads", threads);
    if (pthread_mutex_init(&o->mu, NULL) != 0) {
        krn_pool_destroy(o->hpool);
        o->hpool = NULL;
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&o->cv, NULL) != 0) {
        pthread_mutex_destroy(&o->mu);
        krn_pool_destroy(o->hpool);
        o->hpool = NULL;
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: pthread_cond_init failed");
    }
    if (pthread_create(&o->driver, NULL, off_driver, o) != 0) {
        pthread_cond_destroy(&o->cv);
        pthread_mutex_destroy(&o->mu);
        krn_pool_destroy(o->hpool);
        o->hpool = NULL;
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot start the host attention driver");
    }
    o->started = true;
    off_profile(e);
    if (opts->offload_host_attn_s > 0) /* pinned by the caller (eng_opts) */
        o->costs.hattn_kv = opts->offload_host_attn_s;
    return PIE_OK;
}

void eng_offload_close(eng *e) {
    eng_offload *o = e->off;
    if (!o) return;
    if (o->started) {
        pthread_mutex_lock(&o->mu);
        o->stop = true;
        pthread_cond_broadcast(&o->cv);
        pthread_mutex_unlock(&o->mu);
        pthread_join(o->driver, NULL);
        pthread_cond_destroy(&o->cv);
        pthread_mutex_destroy(&o->mu);
    }
    krn_pool_destroy(o->hpool);
    if (o->host_regions && e->m)
        for (uint32_t l = 0; l < e->info.n_layers; l++) eng_cpu_unmap(&o->host_regions[l]);
    free(o->host_regions);
    free(o->kv_host);
    wrk_offplace_free(&o->place);
    free(o->pitems);
    free(o->skip);
    free(o->kept);
    free(o->item_host);
    free(o->attn_item);
    free(o->dev_items);
    free(o->host_items);
    free(o);
    e->off = NULL;
}

void eng_offload_get_stats(eng *e, eng_offload_stats *out) {
    memset(out, 0, sizeof *out);
    if (e && e->off)
        eng_tier_offload_stats(&e->off->stats, &e->off->place.stats, &e->off->costs, out);
}
