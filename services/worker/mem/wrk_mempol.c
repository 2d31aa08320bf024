/* wrk_mempol.c — see wrk_mempol.h. */
#include "wrk_mempol.h"

#include <inttypes.h>

const char *const wrk_mem_policy_names[] = {"gpu", "swap", "offload", "auto", NULL};

static uint32_t wrk_mem_pages(uint64_t bytes, uint64_t per_page, uint32_t cap) {
    uint64_t n = per_page ? bytes / per_page : 0;
    return n > cap ? cap : (uint32_t)n;
}

uint32_t wrk_mem_effective(const wrk_mem_plan *p, uint32_t slots) {
    if (p->policy != WRK_MEM_SWAP || slots == 0) return p->kv_pages_max;
    uint32_t n = wrk_mem_pages(p->device_kv, (uint64_t)slots * p->page_layer_bytes, UINT32_MAX);
    return n < p->kv_pages_max ? n : p->kv_pages_max;
}

uint32_t wrk_mem_slots_for(const wrk_mem_plan *p, uint32_t pages) {
    for (uint32_t s = p->n_layers; s >= p->min_slots && s > 0; s--)
        if (wrk_mem_effective(p, s) >= pages) return s;
    return 0;
}

/* Host bytes the FIFO needs with at least `min` layers on the device. */
static uint64_t wrk_mem_host_need(const wrk_mem_plan *p, uint32_t min) {
    uint32_t pages = wrk_mem_pages(p->device_kv, (uint64_t)min * p->page_layer_bytes, UINT32_MAX);
    return (uint64_t)(p->n_layers - min + 2) * pages * p->page_layer_bytes;
}

static pie_code wrk_mem_plan_swap(const wrk_mem_config *c, const wrk_mem_shape *s, wrk_mem_plan *p,
                                  pie_status *st) {
    uint32_t n = s->n_layers;
    if (n < 2)
        return pie_status_set(
            st, PIE_FAILED_PRECONDITION,
            "memory.policy swap: the model has %u layer; swapping needs 2 or more", n);
    if (c->device_layers > n || c->device_layers == 1)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "memory.device_layers %u is out of range [2, %u] for this model "
                              "(0 = adaptive)",
                              c->device_layers, n);
    p->device_kv = c->device_kv ? c->device_kv : (uint64_t)s->pool_pages * n * s->page_layer_bytes;
    p->kv_pages_gpu = wrk_mem_pages(p->device_kv, (uint64_t)n * s->page_layer_bytes, s->max_pages);
    if (p->kv_pages_gpu == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "memory.device_kv %" PRIu64 " bytes holds no KV page of every layer "
                              "(%" PRIu64 " bytes)",
                              p->device_kv, (uint64_t)n * s->page_layer_bytes);
    uint32_t lo = c->device_layers ? c->device_layers : 2;
    uint32_t min = lo;
    while (min <= n && wrk_mem_host_need(p, min) > c->host_pool) min++;
    if (min > n || (c->device_layers && min != c->device_layers)) {
        uint32_t at = c->device_layers ? c->device_layers : n;
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "memory.host_pool %" PRIu64 " bytes is too small: %u layers with %u "
                              "on the device need %" PRIu64 " bytes of host memory",
                              c->host_pool, n, at, wrk_mem_host_need(p, at));
    }
    p->min_slots = min;
    p->adaptive = c->device_layers == 0;
    p->start_slots = p->adaptive ? n : c->device_layers;
    p->kv_pages_max =
        wrk_mem_pages(p->device_kv, (uint64_t)min * s->page_layer_bytes, s->max_pages);
    p->host_bytes = wrk_mem_host_need(p, min);
    p->link_bytes_per_s = c->link_gbps > 0 ? c->link_gbps * 1e9 / 8 : 0;
    return PIE_OK;
}

/* Offload (Neo): whole pages live on the device or in the host pool; page ids cover both. */
static pie_code wrk_mem_plan_offload(const wrk_mem_config *c, const wrk_mem_shape *s,
                                     wrk_mem_plan *p, pie_status *st) {
    uint32_t n = s->n_layers;
    uint64_t page_all = (uint64_t)n * s->page_layer_bytes; /* one page of every layer */
    p->device_kv = c->device_kv ? c->device_kv : (uint64_t)s->pool_pages * page_all;
    p->kv_pages_gpu = wrk_mem_pages(p->device_kv, page_all, s->max_pages);
    if (p->kv_pages_gpu == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "memory.device_kv %" PRIu64 " bytes holds no KV page of every layer "
                              "(%" PRIu64 " bytes)",
                              p->device_kv, page_all);
    uint32_t host = wrk_mem_pages(c->host_pool, page_all, s->max_pages);
    if (host == 0)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "memory.host_pool %" PRIu64 " bytes is too small: offload needs at "
                              "least one KV page of every layer (%" PRIu64 " bytes)",
                              c->host_pool, page_all);
    uint64_t max = (uint64_t)p->kv_pages_gpu + host;
    p->kv_pages_max = max > s->max_pages ? s->max_pages : (uint32_t)max;
    p->host_bytes = (uint64_t)(p->kv_pages_max - p->kv_pages_gpu) * page_all;
    p->start_slots = p->min_slots = n;
    return PIE_OK;
}

pie_code wrk_mem_plan_make(const wrk_mem_config *c, const wrk_mem_shape *s, wrk_mem_plan *p,
                           pie_status *st) {
    *p = (wrk_mem_plan){.policy = c->policy,
                        .n_layers = s->n_layers,
                        .page_layer_bytes = s->page_layer_bytes,
                        .page_size = s->page_size ? s->page_size : 16};
    switch (c->policy) {
    case WRK_MEM_GPU:
        p->kv_pages_max = p->kv_pages_gpu = s->pool_pages;
        p->start_slots = p->min_slots = s->n_layers;
        p->device_kv = (uint64_t)s->pool_pages * s->n_layers * s->page_layer_bytes;
        return PIE_OK;
    case WRK_MEM_SWAP: return wrk_mem_plan_swap(c, s, p, st);
    case WRK_MEM_OFFLOAD: return wrk_mem_plan_offload(c, s, p, st);
    case WRK_MEM_AUTO:
    default:
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "memory.policy %s has no plan of its own: the worker chooses swap or "
                              "offload (wrk_mem_auto_choose) and plans that",
                              (unsigned)c->policy < 4 ? wrk_mem_policy_names[c->policy] : "?");
    }
}

void wrk_mem_adapt_init(wrk_mem_adapt *a, const wrk_mem_plan *p, uint32_t epoch_steps) {
    *a = (wrk_mem_adapt){.plan = p, .epoch_steps = epoch_steps ? epoch_steps : 16};
    wrk_expand_config ec = {.n_layers = p->n_layers, .min_slots = p->min_slots};
    wrk_expand_init(&a->ex, &ec);
    a->ex.slots = p->start_slots;
}

uint32_t wrk_mem_adapt_step(wrk_mem_adapt *a, uint64_t tokens, uint64_t busy_ns, uint64_t stall_ns,
                            uint32_t kv_live) {
    if (a->settle > 0) {
        a->settle--;
        return a->ex.slots;
    }
    uint32_t eff = wrk_mem_effective(a->plan, a->ex.slots);
    uint32_t margin = eff / 16 ? eff / 16 : 1;
    a->steps++;
    a->tokens += tokens;
    a->busy_ns += busy_ns;
    a->stall_ns += stall_ns;
    if (kv_live + margin >= eff) a->kv_limited = true;
    if (kv_live > a->kv_live_max) a->kv_live_max = kv_live;
    if (a->steps < a->epoch_steps) return a->ex.slots;
    double busy_s = (double)a->busy_ns * 1e-9;
    wrk_expand_obs o = {
        .tokens_per_s = busy_s > 0 ? (double)a->tokens / busy_s : 0,
        .stall_s = (double)a->stall_ns * 1e-9,
        .busy_s = busy_s,
        /* no wait for a swap over the whole epoch: the link kept ahead of compute */
        .link_idle = a->stall_ns == 0,
        .kv_limited = a->kv_limited,
        .kv_live = a->kv_live_max,
    };
    a->steps = 0;
    a->tokens = a->busy_ns = a->stall_ns = 0;
    a->kv_limited = false;
    a->kv_live_max = 0;
    uint32_t before = a->ex.slots;
    uint32_t next = wrk_expand_observe(&a->ex, &o);
    if (next != before) a->settle = WRK_MEM_SETTLE_STEPS;
    return next;
}

void wrk_mem_adapt_force(wrk_mem_adapt *a, uint32_t slots) {
    if (slots == a->ex.slots) return;
    a->ex.slots = slots;
    a->ex.state = WRK_EXPAND_PLATEAU;
    a->ex.since_probe = 0;
    a->steps = 0;
    a->tokens = a->busy_ns = a->stall_ns = 0;
    a->kv_limited = false;
    a->kv_live_max = 0;
    a->settle = WRK_MEM_SETTLE_STEPS;
}
