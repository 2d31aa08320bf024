/* wrk_expand.h — adaptive expansion of the host memory pool (issue 13; the pooling paper, seed
 * 000, §3.4.2): how many of a model's n layers keep their KV cache on the device.
 *
 * Owns: the decision, one observation window (epoch) at a time. With S of the n layers' caches
 * on the device (slots), each layer's cache holds a/S of the device's KV memory a, so the pool
 * offers n/S times the pages of a device-only pool (the expansion) and n - S layers are swapped
 * in and out every step, FIFO (wrk_swapsim.h models it). The controller starts with every layer
 * on the device (S = n), moves one more layer to the host while swaps finish before they are
 * needed and throughput still rises, moves one back when compute waited for a swap, stops where
 * throughput stops scaling, and probes one step further now and then (the workload or the link
 * may have changed). Whether throughput still scales is judged against the rise of the pages
 * the work holds (kv_live), not the capacity added: whole requests use capacity in steps. A
 * try whose extra pages went unused while the same work held the same pages (the most pages
 * live stayed within 1/16 below the base's, not above: one layer's gain was too small to admit
 * the next request) is inconclusive, not a failure: while nothing stalls it goes one layer
 * further from the same base, and is judged when the pages are used. Does not own: measuring
 * (the worker's step loop fills an observation), moving the data (the copy engine), the
 * mapping table. */
#ifndef WRK_EXPAND_H
#define WRK_EXPAND_H

#include <stdbool.h>
#include <stdint.h>

typedef struct wrk_expand_config {
    uint32_t n_layers;    /* n */
    uint32_t min_slots;   /* fewest layers on the device (the swap pipeline needs >= 2); 0: 2 */
    double stall_frac;    /* compute waited for swaps more than this share of an epoch: too
                             far (0: 0.01) */
    double gain;          /* a try counts as scaling when throughput rises by more than this
                             share of the rise of the pages live (kv_live; without counts: of
                             the 1/(S-1) a step from S to S-1 slots adds) (0: 0.25) */
    uint32_t probe_every; /* epochs between probes one step further at a plateau (0: 20) */
} wrk_expand_config;

/* What the worker saw during one epoch at the current slot count. */
typedef struct wrk_expand_obs {
    double tokens_per_s; /* throughput of the epoch */
    double stall_s;      /* time compute waited for a layer still in transfer */
    double busy_s;       /* length of the epoch */
    bool link_idle;      /* the link had nothing to do at some point while layers were on the
                            host: swaps finished before they were needed (room to expand) */
    bool kv_limited;     /* some work waited for KV pages (more capacity would be used) */
    uint32_t kv_live;    /* most KV pages live at once during the epoch (0: not known) */
} wrk_expand_obs;

typedef enum wrk_expand_state {
    WRK_EXPAND_GROWING = 0, /* moving layers to the host while it pays */
    WRK_EXPAND_TRYING,      /* one step further was taken: judged at the next epoch */
    WRK_EXPAND_PLATEAU,     /* holding; a probe every probe_every epochs */
} wrk_expand_state;

typedef struct wrk_expand {
    wrk_expand_config cfg;
    uint32_t slots; /* layers on the device now (n: no swapping) */
    wrk_expand_state state;
    double base_tps; /* throughput at the slot count a try started from */
    uint32_t base_slots;
    uint32_t base_live;   /* most pages live then */
    uint32_t since_probe; /* epochs at the plateau */
    uint64_t epochs, grows, shrinks, stalls;
} wrk_expand;

void wrk_expand_init(wrk_expand *e, const wrk_expand_config *cfg);
/* Feeds one epoch observed at e->slots; returns the slot count for the next epoch (the caller
 * moves layers so that this many are on the device). */
uint32_t wrk_expand_observe(wrk_expand *e, const wrk_expand_obs *o);
/* n / slots: how many times a device-only pool's pages the pool offers now. */
double wrk_expand_ratio(const wrk_expand *e);

#endif
