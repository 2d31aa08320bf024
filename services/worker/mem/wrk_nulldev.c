/* wrk_nulldev.c — see wrk_nulldev.h. */
#include "wrk_nulldev.h"

#include <pthread.h>
#include <stdlib.h>

#include "wrk_swapsim.h"

struct wrk_nulldev {
    wrk_nulldev_config cfg;
    pthread_mutex_t mu; /* the benchmarks' and the worker's scrape threads read stats */
    wrk_swapsim_pipe pipe;
    wrk_nulldev_stats stats;
};

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
    wrk_nulldev *d = calloc(1, sizeof *d);
    if (d == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "null backend: out of memory");
    d->cfg = *c;
    uint32_t n = c->n_layers;
    if (d->cfg.min_slots == 0) d->cfg.min_slots = n < 2 ? n : 2;
    if (d->cfg.min_slots > n) d->cfg.min_slots = n;
    if (d->cfg.slots == 0 || d->cfg.slots > n) d->cfg.slots = n;
    if (d->cfg.slots < d->cfg.min_slots) d->cfg.slots = d->cfg.min_slots;
    if (pthread_mutex_init(&d->mu, NULL) != 0) {
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
