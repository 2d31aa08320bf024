/* wrk_nulldev.c — see wrk_nulldev.h. */
#include "wrk_nulldev.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "wrk_swapsim.h"

struct wrk_nulldev {
    wrk_nulldev_config cfg;
    pthread_mutex_t mu; /* the benchmarks' and the worker's scrape threads read stats */
    wrk_swapsim_pipe pipe;
    wrk_nulldev_stats stats;
    wrk_offplace_item *items; /* [max_items] the null backend's scratch */
    /* offload (cfg.offload_device_pages > 0) */
    wrk_offplace place;
    uint8_t *item_host; /* [max_items] */
    wrk_off_costs costs;
};

#define NULLDEV_PROBE_ROWS 16u /* the profile's second linear probe, as the cpu engine's */

/* The costs a profile of this device measures (eng_cpu_offload.c's probes, in virtual time):
 * the linear layers at 1 and NULLDEV_PROBE_ROWS rows, attention per KV token on either side,
 * one token's KV of every layer over the link. */
static wrk_off_costs nulldev_profile(const wrk_nulldev_config *c) {
    double L = c->n_layers, r = NULLDEV_PROBE_ROWS;
    double tok_bytes = c->page_size ? (double)c->page_layer_bytes / c->page_size * L : 0;
    return (wrk_off_costs){
        .lin_fixed = L * (c->layer_us + c->layer_token_us) * 1e-6,
        .lin_tok = L * ((c->layer_us + r * c->layer_token_us) - (c->layer_us + c->layer_token_us)) /
                   (r - 1) * 1e-6,
        .dattn_kv = L * c->layer_kv_us * 1e-6,
        .hattn_kv = L * c->host_attn_kv_us * 1e-6,
        .xfer_tok = c->link_bytes_per_s > 0 ? tok_bytes / c->link_bytes_per_s : 0,
    };
}

pie_code wrk_nulldev_create(const wrk_nulldev_config *c, wrk_nulldev **out, pie_status *st) {
    *out = NULL;
    if (c->n_layers == 0 || c->n_layers > WRK_SWAPSIM_MAX_LAYERS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "null backend: the emulated device models 1..%u layers, not %u",
                              WRK_SWAPSIM_MAX_LAYERS, c->n_layers);
    const double costs[] = {c->batch_us,        c->token_us,    c->layer_us,
                            c->layer_token_us,  c->layer_kv_us, c->host_attn_kv_us,
                            c->link_bytes_per_s};
    for (size_t i = 0; i < sizeof costs / sizeof costs[0]; i++)
        if (!(costs[i] >= 0)) /* also NaN */
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "null backend: emulated device costs must be >= 0");
    if (c->offload_device_pages && (c->offload_device_pages > c->kv_pages || !c->page_size))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "null backend: offload's %u device pages need a page size and at "
                              "most kv_pages (%u) page ids",
                              c->offload_device_pages, c->kv_pages);
    wrk_nulldev *d = calloc(1, sizeof *d);
    if (d == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "null backend: out of memory");
    d->cfg = *c;
    if (d->cfg.max_items == 0) d->cfg.max_items = 4096;
    d->items = calloc(d->cfg.max_items, sizeof *d->items);
    d->item_host = calloc(d->cfg.max_items, 1);
    pie_code rc = d->items && d->item_host
                      ? PIE_OK
                      : pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "null backend: out of memory");
    if (rc == PIE_OK && c->offload_device_pages)
        rc = wrk_offplace_init(&d->place, c->kv_pages, c->offload_device_pages, c->page_size,
                               d->cfg.max_items, st);
    if (rc == PIE_OK && c->offload_device_pages)
        wrk_offplace_set_defer(&d->place, c->offload_defer);
    if (rc != PIE_OK) {
        free(d->items);
        free(d->item_host);
        free(d);
        return rc;
    }
    if (c->offload_device_pages) d->costs = nulldev_profile(&d->cfg);
    uint32_t n = c->n_layers;
    if (d->cfg.min_slots == 0) d->cfg.min_slots = n < 2 ? n : 2;
    if (d->cfg.min_slots > n) d->cfg.min_slots = n;
    if (d->cfg.slots == 0 || d->cfg.slots > n) d->cfg.slots = n;
    if (d->cfg.slots < d->cfg.min_slots) d->cfg.slots = d->cfg.min_slots;
    if (pthread_mutex_init(&d->mu, NULL) != 0) {
        wrk_offplace_free(&d->place);
        free(d->items);
        free(d->item_host);
        free(d);
        return pie_status_set(st, PIE_INTERNAL, "null backend: pthread_mutex_init failed");
    }
    wrk_swapsim_pipe_init(&d->pipe, n, d->cfg.slots);
    d->stats.slots = d->pipe.slots;
    d->stats.on_host = wrk_swapsim_pipe_on_host(&d->pipe);
    *out = d;
    return PIE_OK;
}

void wrk_nulldev_destroy(wrk_nulldev *d) {
    if (d == NULL) return;
    pthread_mutex_destroy(&d->mu);
    wrk_offplace_free(&d->place);
    free(d->items);
    free(d->item_host);
    free(d);
}

static double layer_s(const wrk_nulldev_config *c, uint64_t tokens, uint64_t kv_tokens) {
    return (c->layer_us + (double)tokens * c->layer_token_us + (double)kv_tokens * c->layer_kv_us) *
           1e-6;
}

static double fixed_s(const wrk_nulldev_config *c, uint64_t tokens) {
    return (c->batch_us + (double)tokens * c->token_us) * 1e-6;
}

double wrk_nulldev_compute_s(const wrk_nulldev *d, uint64_t tokens, uint64_t kv_tokens) {
    return fixed_s(&d->cfg, tokens) + d->cfg.n_layers * layer_s(&d->cfg, tokens, kv_tokens);
}

/* Bytes of one layer's device buffer with `slots` layers on the device. */
static uint64_t layer_bytes(const wrk_nulldev *d, uint32_t slots) {
    return slots ? d->cfg.device_kv / slots : 0;
}

wrk_nulldev_batch wrk_nulldev_forward(wrk_nulldev *d, uint64_t tokens, uint64_t kv_tokens) {
    wrk_nulldev_batch b = {0};
    pthread_mutex_lock(&d->mu);
    b.t_layer_s = layer_s(&d->cfg, tokens, kv_tokens);
    uint64_t bytes = layer_bytes(d, d->pipe.slots);
    b.t_swap_s = d->cfg.link_bytes_per_s > 0 ? (double)bytes / d->cfg.link_bytes_per_s : 0;
    uint64_t in0 = d->pipe.swaps_in, out0 = d->pipe.swaps_out;
    wrk_swapsim_step s = wrk_swapsim_pipe_step(&d->pipe, b.t_layer_s, b.t_swap_s);
    b.compute_s = d->cfg.n_layers * b.t_layer_s;
    b.stall_s = s.stall_s;
    b.time_s = fixed_s(&d->cfg, tokens) + s.step_s;
    wrk_nulldev_stats *st = &d->stats;
    st->swaps_in += d->pipe.swaps_in - in0;
    st->swaps_out += d->pipe.swaps_out - out0;
    st->swap_in_bytes += (d->pipe.swaps_in - in0) * bytes;
    st->swap_out_bytes += (d->pipe.swaps_out - out0) * bytes;
    st->stalls += s.stalls;
    st->stall_ns += (uint64_t)(s.stall_s * 1e9 + 0.5);
    st->forwards++;
    st->device_ns += (uint64_t)(b.time_s * 1e9 + 0.5);
    st->on_host = wrk_swapsim_pipe_on_host(&d->pipe);
    pthread_mutex_unlock(&d->mu);
    return b;
}

/* KV tokens an item's attention is charged for: the tokens of its pages (as the sums path). */
static uint64_t item_kv(const wrk_offplace_item *it) {
    return (uint64_t)it->ctx + (it->append ? it->n_in : 0);
}

/* wrk_offplace's move: the emulated device only counts pages. */
static void nulldev_count_move(void *user, uint32_t page, uint8_t to) {
    (void)page, (void)to;
    (*(uint64_t *)user)++;
}

/* Linear layers of one layer over t tokens (0 for none). */
static double lin_s(const wrk_nulldev_config *c, uint64_t t) {
    return t ? (c->layer_us + (double)t * c->layer_token_us) * 1e-6 : 0;
}

/* One offloaded step, d->mu held. */
static wrk_nulldev_batch nulldev_offload_step(wrk_nulldev *d, const wrk_offplace_item *items,
                                              uint32_t n) {
    const wrk_nulldev_config *c = &d->cfg;
    wrk_offplace_decide(&d->place, &d->costs, items, n, NULL, NULL, d->item_host, NULL);
    uint64_t moved = 0;
    uint32_t hosted = wrk_offplace_apply(&d->place, items, n, d->item_host, nulldev_count_move,
                                         &moved);
    uint64_t t0 = 0, k0 = 0, t1 = 0, k1 = 0;
    uint32_t deferred = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (d->item_host[i] == WRK_OFF_DEFER)
            deferred++;
        else if (d->item_host[i])
            t1 += items[i].n_in, k1 += item_kv(&items[i]);
        else t0 += items[i].n_in, k0 += item_kv(&items[i]);
    }
    double L = c->n_layers;
    double host = (double)k1 * c->host_attn_kv_us * 1e-6, lin0 = lin_s(c, t0);
    double layer = hosted ? fmax(lin0, host) + lin_s(c, t1) + (double)k0 * c->layer_kv_us * 1e-6
                          : lin_s(c, t0) + (double)k0 * c->layer_kv_us * 1e-6;
    double bytes = (double)moved * (double)c->page_layer_bytes * L;
    double xfer = c->link_bytes_per_s > 0 ? bytes / c->link_bytes_per_s : 0;
    wrk_nulldev_batch b = {.t_layer_s = layer,
                           .compute_s = L * layer,
                           .host_items = hosted,
                           .deferred = deferred,
                           .item_state = d->item_host};
    b.host_s = hosted ? L * host : 0;
    b.wait_s = hosted ? L * fmax(0, host - lin0) : 0;
    b.time_s = fixed_s(c, t0 + t1) + fmax(L * layer, xfer);
    wrk_nulldev_stats *st = &d->stats;
    st->forwards++;
    st->device_ns += (uint64_t)(b.time_s * 1e9 + 0.5);
    st->offload_steps += hosted > 0;
    st->host_items += hosted;
    st->last_host_items = hosted;
    st->last_host_attn_ns = (uint64_t)(b.host_s * 1e9 + 0.5);
    st->host_attn_ns += st->last_host_attn_ns;
    st->host_wait_ns += (uint64_t)(b.wait_s * 1e9 + 0.5);
    st->place = d->place.stats;
    return b;
}

pie_code wrk_nulldev_forward_items(wrk_nulldev *d, const wrk_offplace_item *items, uint32_t n,
                                   wrk_nulldev_batch *out, pie_status *st) {
    if (!d->cfg.offload_device_pages) {
        uint64_t tokens = 0, kv = 0;
        for (uint32_t i = 0; i < n; i++) tokens += items[i].n_in, kv += item_kv(&items[i]);
        *out = wrk_nulldev_forward(d, tokens, kv);
        return PIE_OK;
    }
    if (n > d->cfg.max_items)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: %u items, the emulated device takes at most %u", n,
                              d->cfg.max_items);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < items[i].n_pages; j++)
            if (items[i].pages[j] >= d->cfg.kv_pages)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "forward: item %u: kv page %u is out of range [0, %u)", i,
                                      items[i].pages[j], d->cfg.kv_pages);
    pthread_mutex_lock(&d->mu);
    *out = nulldev_offload_step(d, items, n);
    pthread_mutex_unlock(&d->mu);
    return PIE_OK;
}

wrk_offplace_item *wrk_nulldev_items(wrk_nulldev *d, uint32_t n) {
    return n <= d->cfg.max_items ? d->items : NULL;
}

void wrk_nulldev_cleared(wrk_nulldev *d, const uint32_t *pages, uint32_t n) {
    if (!d->cfg.offload_device_pages) return;
    pthread_mutex_lock(&d->mu);
    for (uint32_t i = 0; i < n; i++) /* ids past the table are not the device's: skipped */
        if (pages[i] < d->cfg.kv_pages) wrk_offplace_cleared(&d->place, &pages[i], 1);
    d->stats.place = d->place.stats;
    pthread_mutex_unlock(&d->mu);
}

void wrk_nulldev_freed(wrk_nulldev *d, const uint32_t *pages, uint32_t n) {
    if (!d->cfg.offload_device_pages) return;
    pthread_mutex_lock(&d->mu);
    wrk_offplace_freed(&d->place, pages, n);
    d->stats.place = d->place.stats;
    pthread_mutex_unlock(&d->mu);
}

void wrk_nulldev_copied(wrk_nulldev *d, uint32_t dst) {
    if (!d->cfg.offload_device_pages || dst >= d->cfg.kv_pages) return;
    pthread_mutex_lock(&d->mu);
    wrk_offplace_copied(&d->place, dst);
    d->stats.place = d->place.stats;
    pthread_mutex_unlock(&d->mu);
}

wrk_off_costs wrk_nulldev_offload_costs(const wrk_nulldev *d) { return d->costs; }

uint32_t wrk_nulldev_set_slots(wrk_nulldev *d, uint32_t slots) {
    pthread_mutex_lock(&d->mu);
    if (slots > d->cfg.n_layers) slots = d->cfg.n_layers;
    if (slots < d->cfg.min_slots) slots = d->cfg.min_slots;
    wrk_swapsim_pipe_set_slots(&d->pipe, slots);
    d->stats.slots = d->pipe.slots;
    pthread_mutex_unlock(&d->mu);
    return slots;
}

void wrk_nulldev_set_link(wrk_nulldev *d, double bytes_per_s) {
    pthread_mutex_lock(&d->mu);
    d->cfg.link_bytes_per_s = bytes_per_s > 0 ? bytes_per_s : 0;
    pthread_mutex_unlock(&d->mu);
}

void wrk_nulldev_get_stats(wrk_nulldev *d, wrk_nulldev_stats *out) {
    pthread_mutex_lock(&d->mu);
    *out = d->stats;
    pthread_mutex_unlock(&d->mu);
}

const wrk_nulldev_config *wrk_nulldev_config_of(const wrk_nulldev *d) { return &d->cfg; }
