/* eng_tier.c — the swap policy's tier as eng.h reports and steers it, and offload's options
 * and stats for both backends (eng_tier.h). */
#include "eng_tier.h"

#include <math.h>
#include <string.h>

wrk_tier_config eng_tier_config(const eng_opts *o, uint32_t n_layers, size_t layer_bytes) {
    uint64_t host_buffers = layer_bytes ? o->swap_host_bytes / layer_bytes : 0;
    return (wrk_tier_config){
        .n_layers = n_layers,
        .layer_bytes = layer_bytes,
        .slots = o->swap_slots,
        .min_slots = o->swap_min_slots ? o->swap_min_slots : (n_layers > 1 ? 2 : 1),
        .host_buffers = host_buffers > UINT32_MAX ? UINT32_MAX : (uint32_t)host_buffers,
        .link_bytes_per_s = o->swap_link_bytes_per_s,
        .copy = o->swap_copy,
        .copy_user = o->swap_copy_user,
        .host_numa_bind = o->host_numa_bind,
        .host_numa_node = o->host_numa_node,
    };
}

void eng_tier_stats(wrk_tier *t, eng_swap_stats *out) {
    memset(out, 0, sizeof *out);
    if (!t) return;
    wrk_tier_stats s;
    wrk_tier_get_stats(t, &s);
    *out = (eng_swap_stats){
        .slots = s.slots,
        .on_device = s.on_device,
        .on_host = s.on_host,
        .swap_in_bytes = s.swap_in_bytes,
        .swap_out_bytes = s.swap_out_bytes,
        .swaps_in = s.swaps_in,
        .swaps_out = s.swaps_out,
        .stalls = s.stalls,
        .stall_ns = s.stall_ns,
        .copy_failures = s.copy_failures,
    };
}

pie_code eng_tier_set_slots(wrk_tier *t, uint32_t slots, uint32_t *applied, pie_status *st) {
    if (!t)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "swap_set_slots: the engine was opened without the swap policy");
    uint32_t got = wrk_tier_set_slots(t, slots);
    if (applied) *applied = got;
    return PIE_OK;
}

pie_code eng_tier_offload_check(const eng_opts *o, uint32_t kv_pages, pie_status *st) {
    if (o->swap_slots)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: offload_device_pages and swap_slots exclude each other");
    if (!(o->offload_host_attn_s >= 0) || isinf(o->offload_host_attn_s))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: offload_host_attn_s %g is not a finite number >= 0",
                              o->offload_host_attn_s);
    if (o->offload_device_pages > kv_pages)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: offload_device_pages %u exceeds kv_pages %u",
                              o->offload_device_pages, kv_pages);
    return PIE_OK;
}

void eng_tier_offload_stats(const eng_offload_stats *own, const wrk_offplace_stats *ps,
                            const wrk_off_costs *costs, eng_offload_stats *out) {
    *out = *own;
    out->lin_tok = costs->lin_tok;
    out->lin_fixed = costs->lin_fixed;
    out->dattn_kv = costs->dattn_kv;
    out->hattn_kv = costs->hattn_kv;
    out->xfer_tok = costs->xfer_tok;
    out->pages_on_host = ps->pages_on_host;
    out->pages_on_device = ps->pages_on_device;
    out->pages_to_host = ps->pages_to_host;
    out->pages_to_device = ps->pages_to_device;
    out->forced_steps = ps->forced_steps;
    out->deferred = ps->deferred;
    out->gain_pages = ps->gain_pages;
    out->gain_steps = ps->gain_steps;
}
