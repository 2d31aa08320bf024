/* eng_cuda_off.c — CPU attention offload on the cuda backend (issue 13; Neo, seed 004): decode
 * items whose KV lives in the host pool have their attention run by host threads with the cpu
 * attention kernels, as a second sub-batch whose host attention overlaps the device's work on
 * the other items.
 *
 * Owns: the host pool (pinned: every page id has its home there, layer-major, the cpu kernels'
 * page layout), the device's KV slots (offload_device_pages of them per layer, carved in the
 * device pool instead of a cache for every page id) and the page table between them
 * (mem/wrk_kvslots.h), the per-step split (mem/wrk_offplace.h's scheduler, or the test's pick),
 * the host sub-batch layer by layer, page copies and clears under the policy, the cost profile
 * and the stats.
 *
 * The rule: a page with a device slot has its KV there, any other at home. A step (prepare):
 * the split is decided; every page a device item reads or writes gets a slot (a page holding
 * KV is fetched, others zeroed; when none is free the clock's next page not used by this step
 * is spilled home and counts on the host), every host item's page goes home. The step then
 * runs as Neo's two asymmetric sub-batches (§3.2): sub-batch 0, the device items, is the
 * forward's own path over tables that name slots instead of page ids; sub-batch 1, the host
 * items, runs around each of its layers on the same stream — before it, their norm, q/k/v and
 * RoPE, copied to pinned memory (an event); while the device runs sub-batch 0's layer, the
 * engine's thread waits for the event, appends their K/V at home and runs their attention on
 * the host pool (its own thread included); after it, their layer tail over the attention
 * copied back. So host attention hides behind sub-batch 0's whole layer (linear layers and
 * attention), and sub-batch 1 reads the weights a second time (the cost the scheduler weighs).
 * Such a step launches directly (the host phase needs the engine's thread inside every layer);
 * steps without host items replay graphs as under policy gpu.
 *
 * Not here: items with an explicit or page mask attend on the device (device_only: the host
 * side applies no mask); tensor parallelism (refused at open); a step whose device items need
 * more pages than the device has slots fails (RESOURCE_EXHAUSTED) instead of spilling prefills.
 * Results differ from policy gpu by rounding (the cpu attention kernel sums in another order;
 * the host sub-batch's linear layers run over its own rows), within the bf16 KV's tolerance
 * (tests/cuda/test_eng_cuda_offload.c). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "eng_cuda_impl.h"
#include "eng_mask.h"
#include "eng_tier.h"
#include "krn_cpu.h"
#include "wrk_kvslots.h"
#include "wrk_numa.h"
#include "wrk_offplace.h"

#define OFF_PROFILE_PAGES 64u
#define OFF_PROFILE_ROWS  16u
#define OFF_PROFILE_REPS  4

struct ec_off {
    uint32_t dev_pages; /* device slots */
    wrk_offplace place;
    wrk_kvslots slots;
    wrk_offplace_item *pitems; /* [T] */
    uint8_t *item_host;        /* [T] WRK_OFF_HOST: attends on the host this step */
    const eng_forward_item *step_items;
    bool (*pick)(void *user, uint32_t item, const eng_forward_item *it);
    void *pick_user;

    uint8_t *home;                 /* pinned [n_layers][kv_pages] page blocks */
    size_t home_layer, home_bytes; /* one layer's homes, all of them */
    bool home_pinned;
    krn_kv_layer *kv_home; /* [n_layers]: the cpu kernels' view of each layer's homes */
    krn_pool *hpool;

    /* the step's sub-batches: the device items (compacted), the host items */
    eng_forward_item *dev_items; /* [T] */
    uint32_t n_dev;
    uint32_t n_host, host_out; /* host items; of which with an output */
    uint32_t *host_item;       /* [T] forward item of each */
    uint32_t *host_ctx;        /* [T] its context (the forward's plan is sub-batch 0's later) */
    int32_t *h_rows;           /* pinned [3T]: each host item's input slot, position, output
                                  slot (or -1) */
    int32_t *d_rows;           /* device [3T] */
    float *x1, *tmp1, *y1;     /* device [T, d]: the host sub-batch's residual, its layer
                                  tail's output, its final norm */
    float *h_qkv;              /* pinned [T, qkvd]: q (rotated) | k | v rows of a layer */
    uint16_t *h_k, *h_v;       /* pinned [T, kvd] bf16: K (rotated) and V as stored */
    krn_bf16 *d_att;           /* device [T, qd] */
    uint16_t *h_att;           /* pinned [T, qd] */
    float *h_out;              /* [T, qd] host attention's f32 output */
    krn_attn_item *attn;       /* [T] */
    cudaEvent_t rows_ready;

    wrk_off_costs costs;
    eng_offload_stats stats;
};

static uint64_t off_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- where a page's KV is ------------------------------------------------------------------ */

static size_t off_page_bytes(const eng_cuda *e) { return e->info.kv_page_layer_bytes; }

/* Layer 0's block of a page at home; layer l is home_layer bytes further per layer. */
static uint8_t *off_home(const eng_cuda *e, uint32_t page) {
    return e->off->home + (size_t)page * off_page_bytes(e);
}

/* Layer 0's block of a slot on the device; the layer pitch is kv_layer_elems bf16. */
static uint8_t *off_slot(const eng_cuda *e, uint32_t slot) {
    return (uint8_t *)e->kv + (size_t)slot * off_page_bytes(e);
}

static size_t off_dev_layer(const eng_cuda *e) { return e->kv_layer_elems * sizeof(krn_bf16); }

/* The page's mask bytes into the slot's (the device's mask is indexed by slot). */
static pie_code off_upload_mask(eng_cuda *e, uint32_t page, uint32_t slot, pie_status *st) {
    size_t ps = e->info.kv_page_size;
    EC_CUDA(st, cudaMemcpyAsync(e->d_page_mask + slot * ps, e->page_mask + page * ps, ps,
                                cudaMemcpyHostToDevice, e->stream));
    return PIE_OK;
}

/* wrk_kvslots' ops: one 2D copy moves every layer's block of a page. */
static pie_code off_fetch(void *user, uint32_t page, uint32_t slot, pie_status *st) {
    eng_cuda *e = user;
    EC_CUDA(st, cudaMemcpy2DAsync(off_slot(e, slot), off_dev_layer(e), off_home(e, page),
                                  e->off->home_layer, off_page_bytes(e), e->info.n_layers,
                                  cudaMemcpyHostToDevice, e->stream));
    return off_upload_mask(e, page, slot, st);
}

static pie_code off_spill(void *user, uint32_t page, uint32_t slot, pie_status *st) {
    eng_cuda *e = user;
    EC_CUDA(st, cudaMemcpy2DAsync(off_home(e, page), e->off->home_layer, off_slot(e, slot),
                                  off_dev_layer(e), off_page_bytes(e), e->info.n_layers,
                                  cudaMemcpyDeviceToHost, e->stream));
    /* the host reads it in this step's host phase or a later handler: both wait for the
     * stream first (the layer's event, or the handler's synchronisation) */
    return PIE_OK;
}

static pie_code off_zero(void *user, uint32_t page, uint32_t slot, pie_status *st) {
    eng_cuda *e = user;
    EC_CUDA(st, cudaMemset2DAsync(off_slot(e, slot), off_dev_layer(e), 0, off_page_bytes(e),
                                  e->info.n_layers, e->stream));
    return off_upload_mask(e, page, slot, st);
}

static void off_evicted(void *user, uint32_t page) {
    eng_cuda *e = user;
    wrk_offplace_evicted(&e->off->place, page);
}

uint32_t ec_off_page(const eng_cuda *e, uint32_t page) {
    if (!e->off) return page;
    uint32_t k = wrk_kvslots_slot(&e->off->slots, page);
    return k == WRK_KVSLOT_NONE ? page : k; /* host items' pages: never read on the device */
}

bool ec_off_step_hosts(const eng_cuda *e) { return e->off && e->off->n_host > 0; }

/* ---- one step's split ------------------------------------------------------------------------ */

static bool off_pick(void *user, uint32_t item) {
    eng_cuda *e = user;
    return e->off->pick(e->off->pick_user, item, &e->off->step_items[item]);
}

/* The two sub-batches: the device items compacted (sub-batch 0, the forward's own path), the
 * host items' slots, positions and outputs uploaded for their sub-batch. */
static pie_code off_sub_batches(eng_cuda *e, const eng_forward_item *items, uint32_t n,
                                pie_status *st) {
    ec_off *o = e->off;
    uint32_t T = e->info.max_batch_tokens;
    o->n_dev = o->n_host = o->host_out = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (o->item_host[i] != WRK_OFF_HOST) {
            o->dev_items[o->n_dev++] = items[i];
            continue;
        }
        uint32_t k = o->n_host++, in = items[i].in_slots[0]; /* a host item is one decode */
        o->host_item[k] = i;
        o->host_ctx[k] = e->chk.plan[i].ctx;
        o->h_rows[k] = (int32_t)in;
        o->h_rows[T + k] = (int32_t)e->emb_pos[in];
        o->h_rows[2 * T + k] = items[i].n_out ? (int32_t)items[i].out_slots[0] : -1;
        o->host_out += items[i].n_out != 0;
    }
    if (o->n_host == 0) return PIE_OK;
    EC_CUDA(st, cudaMemcpyAsync(o->d_rows, o->h_rows, 3 * (size_t)T * sizeof(int32_t),
                                cudaMemcpyHostToDevice, e->stream));
    return PIE_OK;
}

pie_code ec_off_prepare(eng_cuda *e, const eng_forward_item *items, uint32_t n, pie_status *st) {
    ec_off *o = e->off;
    if (!o) return PIE_OK;
    o->stats.steps++;
    o->stats.last_host_items = 0;
    o->stats.last_host_attn_ns = 0;
    o->n_host = 0;
    for (uint32_t i = 0; i < n; i++) {
        const eng_check_plan *p = &e->chk.plan[i];
        o->pitems[i] = (wrk_offplace_item){.pages = items[i].kv_pages,
                                           .n_pages = items[i].n_kv_pages,
                                           .ctx = p->ctx,
                                           .n_in = items[i].n_in,
                                           .append = items[i].append_kv,
                                           .device_only = items[i].mask_runs || p->ctx_masked};
    }
    o->step_items = items;
    wrk_offplace_decide(&o->place, &o->costs, o->pitems, n, o->pick ? off_pick : NULL, e,
                        o->item_host, NULL);
    if (e->info.n_layers == 0) memset(o->item_host, WRK_OFF_DEVICE, n); /* nothing to attend */
    uint32_t hosted = 0;
    pie_code rc = wrk_kvslots_place(&o->slots, &o->place, o->pitems, n, o->item_host, &hosted, st);
    if (rc != PIE_OK) return rc;
    if (hosted) o->stats.offload_steps++;
    o->stats.last_host_items = hosted;
    o->stats.host_items += hosted;
    return off_sub_batches(e, items, n, st);
}

void ec_off_device_items(eng_cuda *e, const eng_forward_item **items, uint32_t *n) {
    *items = e->off->dev_items;
    *n = e->off->n_dev;
}

/* ---- the host sub-batch, layer by layer ------------------------------------------------------ */

pie_code ec_off_layer_begin(eng_cuda *e, uint32_t l, pie_status *st) {
    ec_off *o = e->off;
    const mdl_config *c = &e->m->cfg;
    const ec_layer *Ly = &e->layers[l];
    uint32_t nh = o->n_host, T = e->info.max_batch_tokens, d = c->hidden_size;
    if (l == 0) {
        EC_CUDA(st, krn_cuda_gather_rows(o->x1, e->emb, o->d_rows, (int)nh, (int)d, e->stream));
        e->step_launches++;
    }
    EC_CUDA(st, krn_cuda_add_rmsnorm(o->x1, l == 0 ? NULL : o->tmp1, Ly->attn_norm, (int)nh, (int)d,
                                     c->rms_eps, e->xn, NULL, e->stream));
    pie_code rc = ec_linear(e, e->xn, nh, d, Ly->wqkv, e->qkvd, e->qkv, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, krn_cuda_rope_qkv(e->qkv, o->d_rows + T, (int)nh, (int)e->nh, (int)e->nkv,
                                  (int)c->head_dim, e->inv_freq, e->kb, e->vb, e->stream));
    e->step_launches += 2;
    /* the rows the host needs, in the scratch sub-batch 0 overwrites next: copied out first */
    EC_CUDA(st, cudaMemcpyAsync(o->h_qkv, e->qkv, (size_t)nh * e->qkvd * sizeof(float),
                                cudaMemcpyDeviceToHost, e->stream));
    EC_CUDA(st, cudaMemcpyAsync(o->h_k, e->kb, (size_t)nh * e->kvd * sizeof(krn_bf16),
                                cudaMemcpyDeviceToHost, e->stream));
    EC_CUDA(st, cudaMemcpyAsync(o->h_v, e->vb, (size_t)nh * e->kvd * sizeof(krn_bf16),
                                cudaMemcpyDeviceToHost, e->stream));
    EC_CUDA(st, cudaEventRecord(o->rows_ready, e->stream));
    return PIE_OK;
}

/* The host items' K/V of layer l appended at home, then (attend) their attention. */
static void off_host_layer(eng_cuda *e, uint32_t l, bool attend) {
    ec_off *o = e->off;
    uint32_t nh = o->n_host, kvd = e->kvd, ps = e->info.kv_page_size;
    int n_att = 0;
    for (uint32_t k = 0; k < nh; k++) {
        const eng_forward_item *it = &o->step_items[o->host_item[k]];
        uint32_t ctx = o->host_ctx[k], page = it->kv_pages[ctx / ps];
        memcpy(krn_kv_k(&o->kv_home[l], page, (int)(ctx % ps)), o->h_k + (size_t)k * kvd,
               kvd * sizeof(uint16_t));
        memcpy(krn_kv_v(&o->kv_home[l], page, (int)(ctx % ps)), o->h_v + (size_t)k * kvd,
               kvd * sizeof(uint16_t));
        if (!attend) continue;
        o->attn[n_att++] = (krn_attn_item){
            .q = o->h_qkv + (size_t)k * e->qkvd, /* q: the first qd of the row, rotated */
            .out = o->h_out + (size_t)k * e->qd,
            .n_q = 1,
            .pages = it->kv_pages,
            .n_ctx = (int)ctx + 1,
            .q_offset = (int)ctx,
        };
    }
    if (n_att)
        krn_cpu_attention(o->hpool, &o->kv_home[l], o->attn, n_att, (int)e->nh, e->attn_scale);
}

pie_code ec_off_layer_end(eng_cuda *e, uint32_t l, pie_status *st) {
    ec_off *o = e->off;
    uint32_t nh = o->n_host;
    /* the last layer matters only for the outputs; a sub-batch without any stores its K/V */
    bool attend = l + 1 < e->info.n_layers || o->host_out > 0;
    uint64_t t0 = off_now_ns();
    EC_CUDA(st, cudaEventSynchronize(o->rows_ready)); /* sub-batch 0's layer l runs meanwhile */
    uint64_t t1 = off_now_ns();
    off_host_layer(e, l, attend);
    uint64_t t2 = off_now_ns();
    o->stats.host_wait_ns += t1 - t0;
    o->stats.host_attn_ns += t2 - t1;
    o->stats.last_host_attn_ns += t2 - t1;
    if (!attend) return PIE_OK;
    krn_cvt_bf16(o->h_out, (size_t)nh * e->qd, o->h_att);
    /* h_att and h_qkv are written again after the next layer's event: read by then */
    EC_CUDA(st, cudaMemcpyAsync(o->d_att, o->h_att, (size_t)nh * e->qd * sizeof(uint16_t),
                                cudaMemcpyHostToDevice, e->stream));
    return ec_layer_tail(e, &e->layers[l], o->x1, nh, o->d_att, o->tmp1, st);
}

pie_code ec_off_finish(eng_cuda *e, pie_status *st) {
    ec_off *o = e->off;
    uint32_t nh = o->n_host, T = e->info.max_batch_tokens, d = e->info.hidden_size;
    if (o->host_out == 0) return PIE_OK;
    EC_CUDA(st, krn_cuda_add_rmsnorm(o->x1, o->tmp1, e->norm, (int)nh, (int)d, e->m->cfg.rms_eps,
                                     NULL, o->y1, e->stream));
    EC_CUDA(st,
            krn_cuda_scatter_rows(e->emb, o->y1, o->d_rows + 2 * T, (int)nh, (int)d, e->stream));
    e->step_launches += 2;
    for (uint32_t k = 0; k < nh; k++) /* an output inherits its input's position */
        if (o->h_rows[2 * T + k] >= 0)
            e->emb_pos[o->h_rows[2 * T + k]] = (uint32_t)o->h_rows[T + k];
    return PIE_OK;
}

/* ---- page handlers under the policy ---------------------------------------------------------- */

/* Token t of a page, layer 0, K (v false) or V: on the device or at home. */
static uint8_t *off_token(const eng_cuda *e, uint32_t page, uint32_t t, bool v, size_t *pitch) {
    uint32_t k = wrk_kvslots_slot(&e->off->slots, page);
    size_t row = (size_t)e->kvd * sizeof(krn_bf16);
    size_t at = ((v ? e->info.kv_page_size : 0) + (size_t)t) * row;
    *pitch = k == WRK_KVSLOT_NONE ? e->off->home_layer : off_dev_layer(e);
    return (k == WRK_KVSLOT_NONE ? off_home(e, page) : off_slot(e, k)) + at;
}

pie_code ec_off_copy_items(eng_cuda *e, const eng_copy_item *items, uint32_t n, pie_status *st) {
    ec_off *o = e->off;
    uint32_t ps = e->info.kv_page_size;
    size_t row = (size_t)e->kvd * sizeof(krn_bf16);
    for (uint32_t i = 0; i < n; i++) {
        const eng_copy_item *c = &items[i];
        /* a step of its own: dst may take any slot (even src's: src is then read at home), so
         * a copy never fails for want of one */
        wrk_kvslots_begin_step(&o->slots);
        pie_code rc = wrk_kvslots_copy_dst(&o->slots, &o->place, c->dst, st);
        if (rc != PIE_OK) return rc;
        for (int v = 0; v < 2; v++) { /* K rows, then V rows, of every layer: one 2D copy each */
            size_t sp, dp;
            const uint8_t *src = off_token(e, c->src, c->src_off, v, &sp);
            uint8_t *dst = off_token(e, c->dst, c->dst_off, v, &dp);
            EC_CUDA(st, cudaMemcpy2DAsync(dst, dp, src, sp, c->count * row, e->info.n_layers,
                                          cudaMemcpyDefault, e->stream));
        }
        eng_mask_page_copy(e->page_mask, e->page_n_masked, ps, c);
        uint32_t k = wrk_kvslots_slot(&o->slots, c->dst);
        if (k != WRK_KVSLOT_NONE) {
            rc = off_upload_mask(e, c->dst, k, st);
            if (rc != PIE_OK) return rc;
        }
        wrk_offplace_copied(&o->place, c->dst);
    }
    EC_CUDA(st, cudaStreamSynchronize(e->stream)); /* the pageable mask rows, the homes */
    return PIE_OK;
}

pie_code ec_off_clear(eng_cuda *e, const uint32_t *pages, uint32_t n) {
    ec_off *o = e->off;
    for (uint32_t i = 0; i < n; i++) {
        wrk_kvslots_forget(&o->slots, pages[i]);
        for (uint32_t l = 0; l < e->info.n_layers; l++)
            memset(off_home(e, pages[i]) + l * o->home_layer, 0, off_page_bytes(e));
    }
    wrk_offplace_cleared(&o->place, pages, n);
    return PIE_OK;
}

pie_code ec_off_mask_page(eng_cuda *e, uint32_t page, pie_status *st) {
    uint32_t k = wrk_kvslots_slot(&e->off->slots, page);
    if (k == WRK_KVSLOT_NONE) return PIE_OK; /* uploaded when the page gets a slot */
    pie_code rc = off_upload_mask(e, page, k, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, cudaStreamSynchronize(e->stream)); /* the mirror is pageable */
    return PIE_OK;
}

void eng_cuda_pages_freed(eng_cuda *e, const uint32_t *pages, uint32_t n) {
    if (!e || !e->off) return;
    wrk_offplace_freed(&e->off->place, pages, n);
    for (uint32_t i = 0; i < n; i++) wrk_kvslots_forget(&e->off->slots, pages[i]);
}

/* ---- the cost profile ------------------------------------------------------------------------ */

/* Seconds of one device call sequence, the least of OFF_PROFILE_REPS (events on the stream). */
static pie_code off_time_linear(eng_cuda *e, uint32_t rows, double *secs, pie_status *st) {
    const ec_layer *L = &e->layers[0];
    uint32_t d = e->info.hidden_size;
    cudaEvent_t a, b;
    EC_CUDA(st, cudaEventCreate(&a));
    cudaError_t err = cudaEventCreate(&b);
    if (err != cudaSuccess) {
        (void)cudaEventDestroy(a);
        return ec_cuda_fail(st, err, "cudaEventCreate", __FILE__, __LINE__);
    }
    pie_code rc = PIE_OK;
    *secs = INFINITY;
    for (int rep = 0; rep < OFF_PROFILE_REPS && rc == PIE_OK; rep++) {
        err = cudaEventRecord(a, e->stream);
        if (err == cudaSuccess) rc = ec_linear(e, e->xn, rows, d, L->wqkv, e->qkvd, e->qkv, st);
        if (rc == PIE_OK) rc = ec_linear(e, e->att, rows, e->qd, L->wo, d, e->tmp, st);
        if (rc == PIE_OK) rc = ec_linear(e, e->xn, rows, d, L->w_gate_up, 2 * e->ffn, e->gu, st);
        if (rc == PIE_OK) rc = ec_linear(e, e->h, rows, e->ffn, L->w_down, d, e->tmp, st);
        if (rc == PIE_OK && err == cudaSuccess) err = cudaEventRecord(b, e->stream);
        if (rc == PIE_OK && err == cudaSuccess) err = cudaEventSynchronize(b);
        float ms = 0;
        if (rc == PIE_OK && err == cudaSuccess) err = cudaEventElapsedTime(&ms, a, b);
        if (rc == PIE_OK && err != cudaSuccess)
            rc = ec_cuda_fail(st, err, "cudaEvent (offload profile)", __FILE__, __LINE__);
        if (rc == PIE_OK) *secs = fmin(*secs, ms * 1e-3);
    }
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
    return rc;
}

/* Seconds to copy `bytes` between two buffers (a device-to-device copy: the device's memory
 * bandwidth; host to device: the link's), the least of OFF_PROFILE_REPS. */
static pie_code off_time_copy(eng_cuda *e, void *dst, const void *src, size_t bytes, double *secs,
                              pie_status *st) {
    *secs = INFINITY;
    for (int rep = 0; rep < OFF_PROFILE_REPS; rep++) {
        uint64_t t0 = off_now_ns();
        EC_CUDA(st, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, e->stream));
        EC_CUDA(st, cudaStreamSynchronize(e->stream));
        *secs = fmin(*secs, (double)(off_now_ns() - t0) * 1e-9);
    }
    return PIE_OK;
}

/* The scheduler's costs (wrk_offload.h; seconds for all layers): the linear layers timed on
 * the device over 1 and OFF_PROFILE_ROWS rows (fixed pass and slope), device attention per KV
 * token as its bytes over the device's copy bandwidth (attention is a pass over the KV), host
 * attention timed on the pool over OFF_PROFILE_PAGES pages, transfers over the link's. */
static pie_code off_profile(eng_cuda *e, pie_status *st) {
    ec_off *o = e->off;
    const eng_info *in = &e->info;
    double L = in->n_layers, tok_bytes = (double)off_page_bytes(e) / in->kv_page_size;
    uint32_t rows =
        in->max_batch_tokens < OFF_PROFILE_ROWS ? in->max_batch_tokens : OFF_PROFILE_ROWS;
    double t1 = 0, tn = 0;
    pie_code rc = off_time_linear(e, 1, &t1, st);
    if (rc == PIE_OK && rows > 1) rc = off_time_linear(e, rows, &tn, st);
    if (rc != PIE_OK) return rc;
    o->costs.lin_fixed = t1 * L;
    o->costs.lin_tok = rows > 1 && tn > t1 ? (tn - t1) / (rows - 1) * L : t1 * L;
    /* bandwidths over one layer's slots (device) and one layer's homes (link) */
    size_t span = (size_t)o->dev_pages * off_page_bytes(e) / 2; /* > 0: a page is > 1 byte */
    double td = 0, tl = 0;
    rc = off_time_copy(e, e->kv + span / sizeof(krn_bf16), e->kv, span, &td, st);
    if (rc == PIE_OK) rc = off_time_copy(e, e->kv, o->home, span, &tl, st);
    if (rc != PIE_OK) return rc;
    o->costs.dattn_kv = td / (double)span * tok_bytes * L;
    o->costs.xfer_tok = tl / (double)span * tok_bytes * L;
    /* host attention: one decode row over OFF_PROFILE_PAGES pages of layer 0's homes */
    uint32_t pages = in->kv_pages < OFF_PROFILE_PAGES ? in->kv_pages : OFF_PROFILE_PAGES;
    uint32_t *ids = malloc((pages ? pages : 1) * sizeof *ids);
    if (!ids) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    for (uint32_t i = 0; i < pages; i++) ids[i] = i;
    int ctx = (int)(pages * in->kv_page_size);
    memset(o->h_qkv, 0, e->qkvd * sizeof(float));
    krn_attn_item a = {
        .q = o->h_qkv, .out = o->h_out, .n_q = 1, .pages = ids, .n_ctx = ctx, .q_offset = ctx - 1};
    double th = INFINITY;
    for (int rep = 0; rep < OFF_PROFILE_REPS && ctx > 0; rep++) {
        uint64_t t0 = off_now_ns();
        krn_cpu_attention(o->hpool, &o->kv_home[0], &a, 1, (int)e->nh, e->attn_scale);
        th = fmin(th, (double)(off_now_ns() - t0) * 1e-9);
    }
    free(ids);
    o->costs.hattn_kv = ctx > 0 ? th * L / ctx : 0;
    return PIE_OK;
}

/* ---- open / close / stats -------------------------------------------------------------------- */

pie_code ec_off_check(const eng_opts *opts, uint32_t kv_pages, pie_status *st) {
    if (!opts->offload_device_pages) return PIE_OK;
    pie_code rc = eng_tier_offload_check(opts, kv_pages, st);
    if (rc == PIE_OK && (opts->tp_size > 1 || opts->nccl))
        rc = pie_status_set(st, PIE_UNIMPLEMENTED,
                            "eng_open: memory policy offload on the cuda backend runs one GPU "
                            "(tp_size 1) so far");
    return rc;
}

static pie_code off_alloc(eng_cuda *e, ec_off *o, const eng_opts *opts, pie_status *st) {
    const eng_info *in = &e->info;
    size_t T = in->max_batch_tokens, L = in->n_layers ? in->n_layers : 1;
    size_t d = in->hidden_size;
    o->pitems = calloc(T, sizeof *o->pitems);
    o->dev_items = calloc(T, sizeof *o->dev_items);
    o->item_host = calloc(T, 1);
    o->host_item = calloc(T, sizeof *o->host_item);
    o->host_ctx = calloc(T, sizeof *o->host_ctx);
    o->h_out = calloc(T * e->qd, sizeof *o->h_out);
    o->attn = calloc(T, sizeof *o->attn);
    o->kv_home = calloc(L, sizeof *o->kv_home);
    if (!o->pitems || !o->dev_items || !o->item_host || !o->host_item || !o->host_ctx ||
        !o->h_out || !o->attn || !o->kv_home)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: out of memory for the offload tables");
    /* mapped (zeroed by the kernel), bound to the NUMA node before it is touched, then pinned:
     * the copy engines reach it by DMA */
    o->home_layer = (size_t)in->kv_pages * off_page_bytes(e);
    o->home_bytes = o->home_layer * L;
    void *p = mmap(NULL, o->home_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot map %zu bytes for offload's host pool (%s)",
                              o->home_bytes, strerror(errno));
    o->home = p;
    if (opts->host_numa_bind) {
        pie_code rc =
            wrk_numa_bind(p, o->home_bytes, opts->host_numa_node, "offload's host pool", st);
        if (rc != PIE_OK) return rc;
    }
    cudaError_t err = cudaHostRegister(p, o->home_bytes, cudaHostRegisterPortable);
    if (err != cudaSuccess)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot pin %zu bytes of host memory for offload's host "
                              "pool (%s)",
                              o->home_bytes, cudaGetErrorString(err));
    o->home_pinned = true;
    for (uint32_t l = 0; l < in->n_layers; l++)
        o->kv_home[l] = (krn_kv_layer){.base = o->home + l * o->home_layer,
                                       .page_size = (int)in->kv_page_size,
                                       .n_kv_heads = (int)e->nkv,
                                       .head_dim = (int)e->m->cfg.head_dim,
                                       .dtype = KRN_BF16};
    EC_CUDA(st, cudaMallocHost((void **)&o->h_rows, 3 * T * sizeof(int32_t)));
    EC_CUDA(st, cudaMallocHost((void **)&o->h_qkv, T * e->qkvd * sizeof(float)));
    EC_CUDA(st, cudaMallocHost((void **)&o->h_k, T * e->kvd * sizeof(uint16_t)));
    EC_CUDA(st, cudaMallocHost((void **)&o->h_v, T * e->kvd * sizeof(uint16_t)));
    EC_CUDA(st, cudaMallocHost((void **)&o->h_att, T * e->qd * sizeof(uint16_t)));
    EC_CUDA(st, cudaMalloc((void **)&o->d_rows, 3 * T * sizeof(int32_t)));
    EC_CUDA(st, cudaMalloc((void **)&o->x1, T * d * sizeof(float)));
    EC_CUDA(st, cudaMalloc((void **)&o->tmp1, T * d * sizeof(float)));
    EC_CUDA(st, cudaMalloc((void **)&o->y1, T * d * sizeof(float)));
    EC_CUDA(st, cudaMalloc((void **)&o->d_att, T * e->qd * sizeof(krn_bf16)));
    EC_CUDA(st, cudaEventCreateWithFlags(&o->rows_ready, cudaEventDisableTiming));
    return PIE_OK;
}

pie_code ec_off_open(eng_cuda *e, const eng_opts *opts, pie_status *st) {
    if (!opts->offload_device_pages) return PIE_OK;
    ec_off *o = calloc(1, sizeof *o);
    if (!o) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    e->off = o;
    const eng_info *in = &e->info;
    o->dev_pages = opts->offload_device_pages;
    o->stats.device_pages = o->dev_pages;
    o->pick = opts->offload_pick;
    o->pick_user = opts->offload_pick_user;
    pie_code rc = wrk_offplace_init(&o->place, in->kv_pages, o->dev_pages, in->kv_page_size,
                                    in->max_batch_tokens, st);
    if (rc != PIE_OK) return rc;
    wrk_kvslots_ops ops = {.fetch = off_fetch,
                           .spill = off_spill,
                           .zero = off_zero,
                           .evicted = off_evicted,
                           .user = e};
    rc = wrk_kvslots_init(&o->slots, in->kv_pages, o->dev_pages, o->place.written, &ops, st);
    if (rc == PIE_OK) rc = off_alloc(e, o, opts, st);
    if (rc != PIE_OK) return rc;
    int threads = opts->offload_host_threads > 0 ? opts->offload_host_threads : 1;
    o->hpool = krn_pool_create(threads);
    if (!o->hpool)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot start %d host attention threads", threads);
    if (in->n_layers > 0) {
        rc = off_profile(e, st);
        if (rc != PIE_OK) return rc;
    }
    if (opts->offload_host_attn_s > 0) /* pinned by the caller (eng_opts) */
        o->costs.hattn_kv = opts->offload_host_attn_s;
    return PIE_OK;
}

void ec_off_close(eng_cuda *e) {
    ec_off *o = e->off;
    if (!o) return;
    krn_pool_destroy(o->hpool);
    if (o->rows_ready) (void)cudaEventDestroy(o->rows_ready);
    if (o->home_pinned) (void)cudaHostUnregister(o->home);
    if (o->home) (void)munmap(o->home, o->home_bytes);
    void *pinned[] = {o->h_rows, o->h_qkv, o->h_k, o->h_v, o->h_att};
    for (size_t i = 0; i < sizeof pinned / sizeof pinned[0]; i++)
        if (pinned[i]) (void)cudaFreeHost(pinned[i]);
    void *dev[] = {o->d_rows, o->x1, o->tmp1, o->y1, o->d_att};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) (void)cudaFree(dev[i]);
    wrk_kvslots_free(&o->slots);
    wrk_offplace_free(&o->place);
    free(o->pitems);
    free(o->dev_items);
    free(o->item_host);
    free(o->host_item);
    free(o->host_ctx);
    free(o->h_out);
    free(o->attn);
    free(o->kv_home);
    free(o);
    e->off = NULL;
}

void eng_cuda_offload_get_stats(eng_cuda *e, eng_offload_stats *out) {
    memset(out, 0, sizeof *out);
    if (e && e->off)
        eng_tier_offload_stats(&e->off->stats, &e->off->place.stats, &e->off->costs, out);
}
