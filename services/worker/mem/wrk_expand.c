/* wrk_expand.c — see wrk_expand.h. */
#include "wrk_expand.h"

static double or_default(double v, double def) { return v > 0 ? v : def; }

void wrk_expand_init(wrk_expand *e, const wrk_expand_config *cfg) {
    *e = (wrk_expand){.cfg = *cfg};
    if (e->cfg.min_slots < 2) e->cfg.min_slots = 2;
    if (e->cfg.min_slots > e->cfg.n_layers) e->cfg.min_slots = e->cfg.n_layers;
    e->cfg.stall_frac = or_default(cfg->stall_frac, 0.01);
    e->cfg.gain = or_default(cfg->gain, 0.25);
    if (e->cfg.probe_every == 0) e->cfg.probe_every = 20;
    e->slots = e->cfg.n_layers;
    e->state = WRK_EXPAND_GROWING;
}

double wrk_expand_ratio(const wrk_expand *e) {
    return e->slots ? (double)e->cfg.n_layers / (double)e->slots : 1.0;
}

/* One more layer to the host, remembering where the try started. */
static uint32_t try_further(wrk_expand *e, double tps, uint32_t live) {
    e->base_tps = tps;
    e->base_slots = e->slots;
    e->base_live = live;
    e->slots--;
    e->grows++;
    e->state = WRK_EXPAND_TRYING;
    return e->slots;
}

static uint32_t back_off(wrk_expand *e) {
    if (e->slots < e->cfg.n_layers) e->slots++;
    e->shrinks++;
    return e->slots;
}

uint32_t wrk_expand_observe(wrk_expand *e, const wrk_expand_obs *o) {
    e->epochs++;
    bool stalled = o->busy_s > 0 && o->stall_s > e->cfg.stall_frac * o->busy_s;
    bool can_grow = e->slots > e->cfg.min_slots;
    if (stalled) { /* compute waited on a swap: the link cannot carry this many layers */
        e->stalls++;
        e->state = WRK_EXPAND_PLATEAU;
        e->since_probe = 0;
        return back_off(e);
    }
    switch (e->state) {
    case WRK_EXPAND_TRYING: {
        /* the pages the work holds rose by this share (without counts: what one layer adds) */
        double pages_gain = e->base_live && o->kv_live > e->base_live
                                ? (double)(o->kv_live - e->base_live) / e->base_live
                                : 1.0 / (double)(e->base_slots > 1 ? e->base_slots - 1 : 1);
        if (o->tokens_per_s > e->base_tps * (1 + e->cfg.gain * pages_gain)) {
            /* it paid: go on while there is room and demand for pages */
            if (can_grow && o->link_idle && o->kv_limited)
                return try_further(e, o->tokens_per_s, o->kv_live);
            e->state = WRK_EXPAND_PLATEAU;
            e->since_probe = 0;
            return e->slots;
        }
        if (e->base_live && o->kv_live <= e->base_live &&
            o->kv_live + e->base_live / 16 >= e->base_live && can_grow && o->link_idle) {
            /* inconclusive: the same work holds the same pages and the extra ones went unused
             * (too few for its next request): one more layer from the same base */
            e->slots--;
            e->grows++;
            return e->slots;
        }
        /* no gain: the previous count was as good and swapped less */
        e->slots = e->base_slots;
        e->state = WRK_EXPAND_PLATEAU;
        e->since_probe = 0;
        return e->slots;
    }
    case WRK_EXPAND_GROWING:
        if (can_grow && (e->slots == e->cfg.n_layers || o->link_idle) && o->kv_limited)
            return try_further(e, o->tokens_per_s, o->kv_live);
        e->state = WRK_EXPAND_PLATEAU;
        e->since_probe = 0;
        return e->slots;
    case WRK_EXPAND_PLATEAU:
    default:
        if (++e->since_probe >= e->cfg.probe_every && can_grow && o->kv_limited &&
            (e->slots == e->cfg.n_layers || o->link_idle)) {
            e->since_probe = 0;
            return try_further(e, o->tokens_per_s, o->kv_live);
        }
        return e->slots;
    }
}
