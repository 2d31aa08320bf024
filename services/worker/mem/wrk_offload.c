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

/* gain_kv of wrk_off_choice (wrk_offload.h): what the device-resident part of the step hides
 * at a gain. */
static double off_gain_kv(const wrk_off_costs *c, const wrk_off_batch *b) {
    if (b->n_reqs == 0) return 0;
    uint64_t n0 = 0, kv0 = 0, kv_all = 0;
    for (uint32_t i = 0; i < b->n_reqs; i++) {
        kv_all += b->reqs[i].kv;
        if (!b->reqs[i].on_host) n0++, kv0 += b->reqs[i].kv;
    }
    double tl0 = off_lin(c, (uint64_t)b->dev_tokens + n0);
    if (tl0 <= 0) return 0;
    if (!(c->hattn_kv > 0)) return INFINITY;
    double hide = tl0 / c->hattn_kv, mean = (double)kv_all / b->n_reqs;
    double n1 = floor(hide / mean);
    if (n1 < 1) return 0;
    if (n1 > UINT32_MAX) n1 = UINT32_MAX; /* a near-free host: any batch is bounded far below */
    double t0 = tl0 + c->dattn_kv * (double)(b->dev_kv + kv0);
    double x0 = (double)b->dev_items + (double)n0;
    return n1 * t0 > x0 * off_lin(c, (uint64_t)n1) ? hide : 0;
}

/* One request r of the CPU run queue (Neo §3.3 step 4) against the split so far (s; joined:
 * what hidden requests added to sub-batch 1, which the device-only schedule lacks).
 * Returns where it attends this step; *stuck is set when a starving request stays on the host. */
static uint8_t off_queue_take(const wrk_off_costs *c, const wrk_off_batch *b,
                              const wrk_off_req *r, off_sums *s, off_sums *joined, bool *stuck) {
    if (r->waited >= WRK_OFF_DEFER_MAX) {
        /* starving: it runs; on the host (exposed) or back on the device, the cheaper */
        off_sums stay = *s, back = *s;
        stay.n1++, stay.kv1 += r->kv;
        back.n0++, back.kv0 += r->kv, back.moved += r->kv;
        if (back.kv0 <= b->device_kv_budget && off_est(c, b, &back) <= off_est(c, b, &stay)) {
            *s = back;
            return WRK_OFF_DEVICE;
        }
        *s = stay;
        *stuck = true;
        return WRK_OFF_HOST;
    }
    off_sums with = *s;
    with.n1++, with.kv1 += r->kv;
    /* hidden behind sub-batch 0's linear layers, or nothing on the device to wait for (an idle
     * device hides nothing, but deferring would only leave it idle) */
    double tl0 = off_lin(c, (uint64_t)b->dev_tokens + s->n0);
    if (c->hattn_kv * (double)with.kv1 > tl0 && tl0 > 0) return WRK_OFF_DEFER;
    *s = with;
    joined->n1++, joined->kv1 += r->kv;
    return WRK_OFF_HOST;
}

/* Neo's rules (defer_ok; wrk_offload.h). */
static void off_decide_defer(const wrk_off_costs *c, const wrk_off_batch *b, uint8_t *host,
                             wrk_off_choice *out) {
    off_sums s = {0}; /* the device-resident decodes in sub-batch 0; the host ones not yet */
    for (uint32_t i = 0; i < b->n_reqs; i++)
        if (!b->reqs[i].on_host) s.n0++, s.kv0 += b->reqs[i].kv;
    /* memory (step 2): what the device cannot hold goes to the host, whatever it costs */
    bool forced = false;
    for (uint32_t i = 0; i < b->n_reqs && s.kv0 > b->device_kv_budget; i++) {
        const wrk_off_req *r = &b->reqs[i];
        if (r->on_host) continue;
        host[i] = WRK_OFF_HOST;
        s.n0--, s.kv0 -= r->kv, s.n1++, s.kv1 += r->kv, s.moved += r->kv;
        forced = true;
    }
    /* the CPU run queue (step 4), longest-waiting first (a wait past the bound counts as the
     * bound), then batch order */
    off_sums joined = {0};
    bool stuck = false; /* a starving request stays on the host: device-only is not possible */
    for (int w = WRK_OFF_DEFER_MAX; w >= 0; w--)
        for (uint32_t i = 0; i < b->n_reqs; i++) {
            const wrk_off_req *r = &b->reqs[i];
            int waited = r->waited < WRK_OFF_DEFER_MAX ? r->waited : WRK_OFF_DEFER_MAX;
            if (!r->on_host || waited != w) continue;
            host[i] = off_queue_take(c, b, r, &s, &joined, &stuck);
            out->n_defer += host[i] == WRK_OFF_DEFER;
        }
    double x_off = (double)b->dev_items + (double)(s.n0 + s.n1);
    out->t_off = s.n1 ? off_est(c, b, &s) : INFINITY;
    off_sums d = s; /* device-only: the joined ones deferred */
    d.n1 -= joined.n1, d.kv1 -= joined.kv1;
    double x_dev = (double)b->dev_items + (double)(d.n0 + d.n1);
    bool dev_ok = !forced && !stuck;
    out->t_dev = dev_ok ? off_est(c, b, &d) : INFINITY;
    out->forced = forced;
    /* greedy (step 6): the higher x / T; device-only on a tie */
    bool two = s.n1 > 0 && (!dev_ok || x_dev == 0 || x_off * out->t_dev > x_dev * out->t_off);
    if (!two) {
        for (uint32_t i = 0; i < b->n_reqs; i++)
            if (host[i] == WRK_OFF_HOST && b->reqs[i].on_host) {
                host[i] = WRK_OFF_DEFER; /* joined sub-batch 1: deferred instead */
                out->n_defer++;
            }
        return;
    }
    out->offload = true;
    out->n_host = (uint32_t)s.n1;
    out->host_kv = s.kv1;
}

void wrk_off_decide(const wrk_off_costs *c, const wrk_off_batch *b, uint8_t *host,
                    wrk_off_choice *out) {
    memset(out, 0, sizeof *out);
    if (b->n_reqs) memset(host, 0, b->n_reqs);
    out->gain_kv = off_gain_kv(c, b);
    if (b->defer_ok) {
        off_decide_defer(c, b, host, out);
        return;
    }
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
                        uint32_t epoch_steps, uint32_t page_size) {
    *a = (wrk_off_adapt){.gpu_pages = gpu_pages,
                         .max_pages = max_pages > gpu_pages ? max_pages : gpu_pages,
                         .page_size = page_size ? page_size : 16,
                         .epoch_steps = epoch_steps ? epoch_steps : 16};
    a->pages = a->max_pages;
}

void wrk_off_adapt_tune(wrk_off_adapt *a, const wrk_off_adapt_opts *o) {
    a->opts = *o;
    a->pages = o->start_at_gpu || o->estimate ? a->gpu_pages : a->max_pages;
    a->est = 0;
    a->n_lows = a->next_low = 0;
    a->live_sum = 0;
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
    return wrk_off_adapt_step_est(a, tokens, busy_ns, wait_ns, 0, 0, kv_live);
}

/* Epochs a KV token written in this one stays live, on average (Little's law: live tokens /
 * tokens written per step), 1..WRK_OFF_EST_EPOCHS. */
static uint32_t off_adapt_window(const wrk_off_adapt *a) {
    if (a->tokens == 0 || a->steps == 0) return 1;
    double life = (double)a->live_sum * a->page_size / (double)a->tokens; /* steps */
    double w = ceil(life / a->steps);
    return w < 1 ? 1 : w > WRK_OFF_EST_EPOCHS ? WRK_OFF_EST_EPOCHS : (uint32_t)w;
}

/* The estimate knob at an epoch's end (wrk_off_adapt_opts). */
static void off_adapt_estimate(wrk_off_adapt *a) {
    if (a->gain_steps == 0) return; /* no decodes: nothing was estimated */
    a->lows[a->next_low] = a->gain_min; /* what every step of the epoch hid at a gain */
    a->next_low = (a->next_low + 1) % WRK_OFF_EST_EPOCHS;
    if (a->n_lows < WRK_OFF_EST_EPOCHS) a->n_lows++;
    uint32_t w = off_adapt_window(a);
    if (w > a->n_lows) w = a->n_lows;
    a->window = w;
    a->est = INFINITY;
    for (uint32_t k = 1; k <= w; k++) { /* the newest w */
        double low = a->lows[(a->next_low + WRK_OFF_EST_EPOCHS - k) % WRK_OFF_EST_EPOCHS];
        if (low < a->est) a->est = low;
    }
    uint32_t host = a->max_pages - a->gpu_pages;
    double want_d = ceil(a->est);
    uint32_t want = want_d < host ? (uint32_t)want_d : host;
    uint32_t now = a->pages - a->gpu_pages;
    uint32_t diff = want > now ? want - now : now - want;
    if (diff < 4 || diff * 8 < now) return; /* noise: no CapacityChange */
    a->pages = a->gpu_pages + want;
}

uint32_t wrk_off_adapt_step_est(wrk_off_adapt *a, uint64_t tokens, uint64_t busy_ns,
                                uint64_t wait_ns, uint64_t gain_pages, uint64_t gain_steps,
                                uint32_t kv_live) {
    if (gain_steps) {
        double v = (double)gain_pages / (double)gain_steps;
        if (a->gain_steps == 0 || v < a->gain_min) a->gain_min = v;
    }
    a->gain_pages += gain_pages;
    a->gain_steps += gain_steps;
    uint32_t margin = a->pages / 16 ? a->pages / 16 : 1;
    a->steps++;
    a->tokens += tokens;
    a->live_sum += kv_live;
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
    if (o->estimate) {
        off_adapt_estimate(a);
    } else if (o->climb) {
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
    a->live_sum = 0;
    a->busy_ns = a->wait_ns = 0;
    a->gain_pages = a->gain_steps = 0;
    a->kv_limited = false;
    return a->pages;
}

uint32_t wrk_off_adapt_spill(wrk_off_adapt *a, uint32_t kv_live) {
    if (kv_live > a->pages) a->pages = kv_live < a->max_pages ? kv_live : a->max_pages;
    a->steps = 0;
    a->tokens = 0;
    a->live_sum = 0;
    a->busy_ns = a->wait_ns = 0;
    a->gain_pages = a->gain_steps = 0;
    a->kv_limited = false;
    return a->pages;
}
