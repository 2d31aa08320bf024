/* eng_tier.h — the swap policy's tier (services/worker/mem/wrk_tier.h) as eng.h reports and
 * steers it, for both backends (eng_cpu_swap.c, eng_cuda_swap.c); and offload's stats from its
 * placement (eng_cpu_offload.c, eng_cuda_off.c).
 *
 * Owns: the tier's configuration from eng_opts, eng_swap_stats from the tier's counters, and
 * the slot count through eng.h's contract (refused without the policy); offload's options
 * checked, and eng_offload_stats from an engine's counters, its placement's and its costs.
 * Does not own: the tier, the engines' use of it (a backend adds its device, eng_cuda_swap.c). */
#ifndef ENG_TIER_H
#define ENG_TIER_H

#include "eng.h"
#include "wrk_offplace.h"
#include "wrk_tier.h"

/* What eng_opts asks of the tier for n layers of layer_bytes: slots, min_slots (2, or 1 for one
 * layer, when swap_min_slots is 0), the host buffers swap_host_bytes holds, the link, the host
 * pool's NUMA node, a test's copy. */
wrk_tier_config eng_tier_config(const eng_opts *o, uint32_t n_layers, size_t layer_bytes);

/* t NULL (no swap policy): all zero. */
void eng_tier_stats(wrk_tier *t, eng_swap_stats *out);
/* t NULL: FAILED_PRECONDITION "swap_set_slots: the engine was opened without the swap
 * policy". */
pie_code eng_tier_set_slots(wrk_tier *t, uint32_t slots, uint32_t *applied, pie_status *st);

/* offload's options for an engine of kv_pages page ids, whatever the backend: not with swap,
 * offload_host_attn_s a finite number >= 0, offload_device_pages <= kv_pages
 * (INVALID_ARGUMENT naming the option otherwise). */
pie_code eng_tier_offload_check(const eng_opts *o, uint32_t kv_pages, pie_status *st);

/* *out = own with the placement's page counts (ps) and the costs the scheduler decides with. */
void eng_tier_offload_stats(const eng_offload_stats *own, const wrk_offplace_stats *ps,
                            const wrk_off_costs *costs, eng_offload_stats *out);

#endif
