/* wrk_swapsim.c — see wrk_swapsim.h. */
#include "wrk_swapsim.h"

#include <float.h>
#include <stdbool.h>
#include <string.h>

enum { RESIDENT, ON_HOST, FETCHING, EVICTING };

typedef wrk_swapsim_pipe sim;

static uint32_t occupied(const sim *s) {
    uint32_t k = 0;
    for (uint32_t i = 0; i < s->n; i++) k += s->state[i] != ON_HOST;
    return k;
}

/* Layers after `from` in compute order (cyclic), nearest first: distance 0..n-1. */
static uint32_t dist(const sim *s, uint32_t from, uint32_t layer) {
    return (layer + s->n - from) % s->n;
}

static int32_t hottest_on_host(const sim *s) {
    int32_t best = -1;
    uint32_t bd = UINT32_MAX;
    for (uint32_t i = 0; i < s->n; i++)
        if (s->state[i] == ON_HOST && dist(s, s->cur, i) < bd) {
            bd = dist(s, s->cur, i);
            best = (int32_t)i;
        }
    return best;
}

/* The resident layer whose next use is farthest, never the one computing now. */
static int32_t coldest_resident(const sim *s) {
    int32_t best = -1;
    uint32_t bd = 0;
    for (uint32_t i = 0; i < s->n; i++) {
        if (s->state[i] != RESIDENT || i == s->cur) continue;
        uint32_t d = dist(s, s->cur, i);
        if (best < 0 || d > bd) {
            bd = d;
            best = (int32_t)i;
        }
    }
    return best;
}

static void evict(sim *s, int32_t victim, double t) {
    s->state[victim] = EVICTING;
    s->out_layer = victim;
    s->out_until = t + s->ts;
    s->swaps_out++;
}

/* Starts what the idle directions can do at time t. */
static void kick(sim *s, double t) {
    if (s->out_layer < 0 && occupied(s) > s->slots) { /* the slot count was lowered */
        int32_t victim = coldest_resident(s);
        if (victim >= 0) evict(s, victim, t);
    }
    int32_t want = hottest_on_host(s);
    if (want < 0) return; /* nothing on the host: no swapping at all */
    if (s->out_layer < 0 && occupied(s) >= s->slots) {
        int32_t victim = coldest_resident(s);
        /* evict only a layer needed later than the one it makes room for */
        if (victim >= 0 && dist(s, s->cur, (uint32_t)victim) > dist(s, s->cur, (uint32_t)want))
            evict(s, victim, t);
    }
    if (s->in_layer < 0 && occupied(s) < s->slots) {
        s->state[want] = FETCHING;
        s->in_layer = want;
        s->in_until = t + s->ts;
        s->swaps_in++;
        if (s->measuring) s->in_busy += s->ts;
    }
}

/* Completes the transfers that end by t (in time order), kicking after each. */
static void run_until(sim *s, double t) {
    for (;;) {
        double next = DBL_MAX;
        if (s->in_layer >= 0) next = s->in_until;
        if (s->out_layer >= 0 && s->out_until < next) next = s->out_until;
        if (next > t) return;
        if (s->in_layer >= 0 && s->in_until == next) {
            s->state[s->in_layer] = RESIDENT;
            s->fetched_at[s->in_layer] = next;
            s->in_layer = -1;
        } else {
            s->state[s->out_layer] = ON_HOST;
            s->out_layer = -1;
        }
        kick(s, next);
    }
}

/* The earliest end of a transfer in flight (DBL_MAX: none). */
static double next_event(const sim *s) {
    double next = DBL_MAX;
    if (s->in_layer >= 0) next = s->in_until;
    if (s->out_layer >= 0 && s->out_until < next) next = s->out_until;
    return next;
}

static uint32_t clamp_slots(uint32_t n, uint32_t slots) {
    if (slots > n) slots = n;
    if (slots < 2 && slots < n) slots = 2 <= n ? 2 : n;
    return slots;
}

void wrk_swapsim_pipe_init(wrk_swapsim_pipe *p, uint32_t n, uint32_t slots) {
    if (n > WRK_SWAPSIM_MAX_LAYERS) n = WRK_SWAPSIM_MAX_LAYERS;
    memset(p, 0, sizeof *p);
    p->n = n;
    p->slots = clamp_slots(n, slots);
    p->in_layer = p->out_layer = -1;
    p->slack = DBL_MAX;
    for (uint32_t i = 0; i < n; i++) p->state[i] = i < p->slots ? RESIDENT : ON_HOST;
}

void wrk_swapsim_pipe_set_slots(wrk_swapsim_pipe *p, uint32_t slots) {
    p->slots = clamp_slots(p->n, slots);
}

uint32_t wrk_swapsim_pipe_on_host(const wrk_swapsim_pipe *p) {
    uint32_t k = 0;
    for (uint32_t i = 0; i < p->n; i++) k += p->state[i] == ON_HOST;
    return k;
}

wrk_swapsim_step wrk_swapsim_pipe_step(wrk_swapsim_pipe *s, double t_compute, double t_swap) {
    wrk_swapsim_step r = {0};
    s->ts = t_swap;
    double t0 = s->t;
    for (uint32_t l = 0; l < s->n; l++) {
        s->cur = l;
        kick(s, s->t);
        bool waited = false;
        while (s->state[l] != RESIDENT) { /* stall until it is fetched */
            double next = next_event(s);
            if (next == DBL_MAX) { /* cannot happen: kick above started a transfer */
                s->state[l] = RESIDENT;
                break;
            }
            r.stall_s += next - s->t;
            waited = true;
            run_until(s, next);
            s->t = next;
        }
        if (waited) {
            r.stalls++;
            s->stalls++;
        }
        if (s->measuring && s->fetched_at[l] > 0) {
            double sl = s->t - s->fetched_at[l];
            if (sl < s->slack) s->slack = sl;
        }
        s->fetched_at[l] = 0;
        run_until(s, s->t + t_compute);
        s->t += t_compute;
    }
    r.step_s = s->t - t0;
    return r;
}

wrk_swapsim_result wrk_swapsim_run(uint32_t n, uint32_t slots, double t_compute, double t_swap,
                                   uint32_t warmup, uint32_t steps) {
    wrk_swapsim_result r = {0};
    if (n == 0 || n > WRK_SWAPSIM_MAX_LAYERS || steps == 0) return r;
    sim s;
    wrk_swapsim_pipe_init(&s, n, slots);
    s.ts = t_swap;
    double t0 = 0, stall = 0;
    for (uint32_t step = 0; step < warmup + steps; step++) {
        if (step == warmup) {
            s.measuring = true;
            t0 = s.t;
            /* a transfer in flight counts from here */
            if (s.in_layer >= 0) s.in_busy += s.in_until - s.t;
        }
        wrk_swapsim_step one = wrk_swapsim_pipe_step(&s, t_compute, t_swap);
        if (s.measuring) stall += one.stall_s;
    }
    double span = s.t - t0;
    r.step_s = span / steps;
    r.stall_s = stall / steps;
    /* in-flight work past the end is not link time of the measured span */
    if (s.in_layer >= 0 && s.in_until > s.t) s.in_busy -= s.in_until - s.t;
    r.link_busy = span > 0 ? s.in_busy / span : 0;
    r.slack_s = s.slack == DBL_MAX ? 0 : s.slack;
    if (r.stall_s > 0 && r.slack_s > 0) r.slack_s = -r.stall_s;
    return r;
}

wrk_swapsim_point wrk_swapsim_eval(const wrk_swapsim_model *m, uint32_t slots, uint32_t steps) {
    wrk_swapsim_point p = {0};
    if (slots == 0 || slots > m->n_layers) slots = m->n_layers;
    double pages = m->device_pages * (double)m->n_layers / (double)slots;
    double fit = m->pages_per_seq > 0 ? pages / m->pages_per_seq : m->demand_seqs;
    p.kv_limited = m->demand_seqs > fit;
    p.batch = p.kv_limited ? fit : m->demand_seqs;
    double tc = m->t_layer_fixed + m->t_layer_per_seq * p.batch;
    double ts = m->t_move_all / (double)slots;
    p.sim = wrk_swapsim_run(m->n_layers, slots, tc, ts, 2, steps);
    p.tokens_per_s = p.sim.step_s > 0 ? p.batch / p.sim.step_s : 0;
    return p;
}
