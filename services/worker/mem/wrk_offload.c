/* wrk_offload.c — the load-aware scheduler of CPU attention offload (wrk_offload.h). */
#include "wrk_offload.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Running totals of a split: n0/kv0 sub-batch 0's decodes (the prefill is added at estimate
 * time), n1/kv1 sub-batch 1's, moved = KV tokens that cross the link. */
typedef struct off_sums {
    uint64_t n0, n1, kv0, kv1, moved;
} off_sums;

/* The linear layers over `tokens` rows: a roofline (wrk_offload.h). */
static double off_lin(const wrk_off_costs *c, uint64_t tokens) {
    if (tokens == 0) return 0;
    double t = c->lin_tok * (double)tokens;
    return t > c->lin_fixed ? t : c->lin_fixed;
}

static double off_est(const wrk_off_costs *c, const wrk_off_batch *b, const off_sums *s) {
    double tl0 = off_lin(c, (uint64_t)b->dev_tokens + s->n0);
    double tl1 = off_lin(c, s->n1);
    double tca1 = c->hattn_kv * (double)s->kv1;
    double tga0 = c->dattn_kv * (double)(b->dev_kv + s->kv0);
    double tx = c->xfer_tok * (double)s->moved;
    if (s->n1 == 0) /* device-only: the transfers back overlap the whole step */
        return fmax(tl0 + tga0, tx);
    return fmax(fmax(tl0, tca1), tx) + tl1 + tga0;
}

/* Moves request r of the sums from sub-batch 0 to 1 (to = 1) or back (to = 0). */
static void off_move(off_sums *s, const wrk_off_req *r, int to) {
    if (to) {
        s->n0--, s->kv0 -= r->kv, s->n1++, s->kv1 += r->kv;
        if (r->on_host) s->moved -= r->kv;
        else s->moved += r->kv;
    } else {
        s->n1--, s->kv1 -= r->kv, s->n0++, s->kv0 += r->kv;
        if (r->on_host) s->moved += r->kv;
        else s->moved -= r->kv;
    }
}

static off_sums off_all_device(const wrk_off_batch *b) {
    off_sums s = {0};
    for (uint32_t i = 0; i < b->n_reqs; i++) {
        s.n0++;
        s.kv0 += b->reqs[i].kv;
        if (b->reqs[i].on_host) s.moved += b->reqs[i].kv;
    }
    return s;
}

double wrk_off_estimate(const wrk_off_costs *c, const wrk_off_batch *b, const uint8_t *host) {
    off_sums s = off_all_device(b);
    for (uint32_t i = 0; i < b->n_reqs; i++)
        if (host[i]) off_move(&s, &b->reqs[i], 1);
    return off_est(c, b, &s);
}

double wrk_off_estimate_dev(const wrk_off_costs *c, const wrk_off_batch *b) {
    off_sums s = off_all_device(b);
    return off_est(c, b, &s);
}

/* Sub-batch 1's host attention stays hidden behind sub-batch 0's linear layers with r too. */
static bool off_fits(const wrk_off_costs *c, const wrk_off_batch *b, const off_sums *s,
                     const wrk_off_req *r) {
    double tl0 = off_lin(c, (uint64_t)b->dev_tokens + s->n0 - 1);
    return c->hattn_kv * (double)(s->kv1 + r->kv) <= tl0;
}

void wrk_off_decide(const wrk_off_costs *c, const wrk_off_batch *b, uint8_t *host,
                    wrk_off_choice *out) {
    memset(out, 0, sizeof *out);
    if (b->n_reqs) memset(host, 0, b->n_reqs);
    off_sums s = off_all_device(b);
    double t_dev = off_est(c, b, &s);
    /* memory: what the device cannot hold goes to the host, whatever it costs */
    bool forced = false;
    for (uint32_t i = 0; i < b->n_reqs && s.kv0 > b->device_kv_budget; i++) {
        host[i] = 1;
        off_move(&s, &b->reqs[i], 1);
        forced = true;
    }
    /* hiding CPU: those already on the host first, then the rest */
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < b->n_reqs; i++) {
            const wrk_off_req *r = &b->reqs[i];
            if (host[i] || r->on_host != (pass == 0)) continue;
            if (off_fits(c, b, &s, r)) {
                host[i] = 1;
                off_move(&s, r, 1);
                continue;
            }
            if (!r->on_host) continue;
            /* on the host but not hidden: stay (exposed host time) or come back (transfer) */
            double back = off_est(c, b, &s);
            off_move(&s, r, 1);
            double stay = off_est(c, b, &s);
            if (stay < back && s.kv0 <= b->device_kv_budget) {
                host[i] = 1;
            } else {
                off_move(&s, r, 0);
            }
        }
    /* a request that came back may overflow the device: then it stays on the host */
    for (uint32_t i = 0; i < b->n_reqs && s.kv0 > b->device_kv_budget; i++)
        if (!host[i]) {
            host[i] = 1;
            off_move(&s, &b->reqs[i], 1);
            forced = true;
        }
    out->forced = forced;
    out->t_dev = forced ? INFINITY : t_dev;
    out->t_off = s.n1 ? off_est(c, b, &s) : INFINITY;
    if (!forced && !(out->t_off < out->t_dev)) {
        if (b->n_reqs) memset(host, 0, b->n_reqs);
        return;
    }
    out->offload = true;
    out->n_host = (uint32_t)s.n1;
    out->host_kv = s.kv1;
}

void wrk_mem_auto_choose(const wrk_mem_auto_in *in, wrk_mem_auto_out *out) {
    memset(out, 0, sizeof *out);
    const wrk_off_costs *c = &in->costs;
    double layer_compute =
        in->n_layers ? (off_lin(c, in->batch_tokens) +
                        c->dattn_kv * (double)in->batch_tokens * in->decode_ctx) /
                           in->n_layers
                     : 0;
    out->swap_ratio = layer_compute > 0 ? in->layer_swap_s / layer_compute : INFINITY;
    double host = c->hattn_kv * in->decode_ctx;
    /* per device token of a typical batch: its share of the linear pass */
    double lin_per_token = in->batch_tokens ? off_lin(c, in->batch_tokens) / in->batch_tokens : 0;
    out->host_share = host > 0 ? lin_per_token / host : INFINITY;
    if (out->swap_ratio <= 1.0) {
        out->policy = WRK_MEM_SWAP;
        snprintf(out->why, sizeof out->why,
                 "swap: a layer's KV moves in %.2f of a layer's compute (transparent)",
                 out->swap_ratio);
    } else if (out->host_share >= WRK_AUTO_MIN_HOST_SHARE) {
        out->policy = WRK_MEM_OFFLOAD;
        snprintf(out->why, sizeof out->why,
                 "offload: swapping a layer takes %.2fx its compute (it would stall); host "
                 "attention hides %.2f decodes per device token",
                 out->swap_ratio, out->host_share);
    } else {
        out->policy = WRK_MEM_SWAP;
        snprintf(out->why, sizeof out->why,
                 "swap: neither hides (swap %.2fx a layer's compute, host %.3f decodes per "
                 "device token); expansion backs off to every layer on the device",
                 out->swap_ratio, out->host_share);
    }
}

void wrk_off_adapt_init(wrk_off_adapt *a, uint32_t gpu_pages, uint32_t max_pages,
                        uint32_t epoch_steps) {
    *a = (wrk_off_adapt){.gpu_pages = gpu_pages,
                         .max_pages = max_pages > gpu_pages ? max_pages : gpu_pages,
                         .epoch_steps = epoch_steps ? epoch_steps : 16};
    a->pages = a->max_pages;
}

void wrk_off_adapt_tune(wrk_off_adapt *a, const wrk_off_adapt_opts *o) {
    a->opts = *o;
    a->pages = o->start_at_gpu ? a->gpu_pages : a->max_pages;
}

/* The climb knob at an epoch's end (wrk_off_adapt_opts). */
static void off_adapt_climb(wrk_off_adapt *a, uint32_t step) {
    const wrk_off_adapt_opts *o = &a->opts;
    double thr = a->busy_ns ? (double)a->tokens / (double)a->busy_ns : 0;
    uint32_t wait = o->climb_wait ? o->climb_wait : 8, hold = o->hold_epochs ? o->hold_epochs : 32;
    a->climb_epochs++;
    if (a->climb_mode == 2) { /* holding after a step back */
        if (a->climb_epochs >= hold) a->climb_mode = 0, a->climb_epochs = 0;
    } else if (a->climb_mode == 0) { /* the capacity filled: probe one step further */
        if (a->kv_limited && a->pages < a->max_pages) {
            a->thr_base = thr;
            a->pages = a->max_pages - a->pages > step ? a->pages + step : a->max_pages;
            a->climb_mode = 1, a->climb_epochs = 0;
        }
    } else if (a->kv_limited && a->climb_epochs >= 2) { /* filled (the first epoch fills) */
        if (thr > a->thr_base * 1.01) {
            a->climb_mode = 0, a->climb_epochs = 0; /* it paid: from here */
        } else {
            a->pages = a->pages - a->gpu_pages > step ? a->pages - step : a->gpu_pages;
            a->climb_mode = 2, a->climb_epochs = 0;
        }
    } else if (a->climb_epochs > wait) { /* never filled: demand does not need more */
        a->climb_mode = 0, a->climb_epochs = 0;
    }
}

uint32_t wrk_off_adapt_step(wrk_off_adapt *a, uint64_t busy_ns, uint64_t wait_ns,
                            uint32_t kv_live) {
    return wrk_off_adapt_step_tokens(a, 0, busy_ns, wait_ns, kv_live);
}

uint32_t wrk_off_adapt_step_tokens(wrk_off_adapt *a, uint64_t tokens, uint64_t busy_ns,
                                   uint64_t wait_ns, uint32_t kv_live) {
    uint32_t margin = a->pages / 16 ? a->pages / 16 : 1;
    a->steps++;
    a->tokens += tokens;
    a->busy_ns += busy_ns;
    a->wait_ns += wait_ns;
    if (kv_live + margin >= a->pages) a->kv_limited = true;
    a->last_live = kv_live;
    if (a->steps < a->epoch_steps) return a->pages;
    const wrk_off_adapt_opts *o = &a->opts;
    double exposed = a->busy_ns ? (double)a->wait_ns / (double)a->busy_ns : 0;
    double ex_max = o->exposed_max > 0 ? o->exposed_max : WRK_OFF_EXPOSED_MAX;
    double ex_grow = o->exposed_grow > 0 ? o->exposed_grow : WRK_OFF_EXPOSED_GROW;
    uint32_t host = a->max_pages - a->gpu_pages;
    uint32_t step = o->grow_pages ? o->grow_pages : host / 8 ? host / 8 : 1;
    uint32_t share = a->pages - a->gpu_pages; /* host pages offered now */
    uint32_t cut = o->shrink_share > 0 ? (uint32_t)ceil(share * o->shrink_share) : step;
    if (o->climb) {
        off_adapt_climb(a, step);
    } else if (o->hold_while_over && a->last_live > a->pages) {
        /* an earlier shrink still drains: judging now would shrink again for the same cause */
    } else if (exposed > ex_max) {
        a->pages = share > cut ? a->pages - cut : a->gpu_pages;
    } else if (exposed < ex_grow && a->kv_limited) {
        a->pages = a->max_pages - a->pages > step ? a->pages + step : a->max_pages;
    }
    a->steps = 0;
    a->tokens = 0;
    a->busy_ns = a->wait_ns = 0;
    a->kv_limited = false;
    return a->pages;
}

uint32_t wrk_off_adapt_spill(wrk_off_adapt *a, uint32_t kv_live) {
    if (kv_live > a->pages) a->pages = kv_live < a->max_pages ? kv_live : a->max_pages;
    a->steps = 0;
    a->tokens = 0;
    a->busy_ns = a->wait_ns = 0;
    a->kv_limited = false;
    return a->pages;
}
