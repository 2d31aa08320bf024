/* wrk_offplace.h — where CPU attention offload's pages live, and one step's split (issue 13;
 * Neo, seed 004 §3.3): the bookkeeping the cpu engine (engine/eng_cpu_offload.c) and the null
 * backend's emulated device (wrk_nulldev.h) share, so both run the same scheduler over the same
 * page states.
 *
 * Owns: per page id its region (device or host) and whether it holds KV (written); the step's
 * decode requests (an item with one input, appended, over at least one page), the device's room
 * for them (its pages minus those written and not theirs), the decision (wrk_off_decide, or a
 * pick callback), the fixed point that keeps an item on the device when a device item reads one
 * of its pages (a fork's shared prefix), and the moves that follow (a callback per written page
 * that changes region: the engine copies its layers, the emulated device counts bytes).
 * Does not own: the data (the engine), the costs (their profile), what a step costs (the
 * engine runs it; wrk_nulldev models it). Not thread safe: the step thread only. */
#ifndef WRK_OFFPLACE_H
#define WRK_OFFPLACE_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_status.h"
#include "wrk_offload.h"

/* One item of a forward batch as offload sees it. */
typedef struct wrk_offplace_item {
    const uint32_t *pages; /* its KV pages */
    uint32_t n_pages;
    uint32_t ctx;          /* context tokens before its inputs */
    uint32_t n_in;         /* inputs (>= 1) */
    bool append;           /* the inputs' K/V are written into its pages */
    bool device_only;      /* attends on the device whatever the costs (a mask the host side
                              does not apply: the cuda engine's masked items) */
} wrk_offplace_item;

typedef struct wrk_offplace_stats {
    uint32_t pages_on_host, pages_on_device; /* written pages in each region now */
    uint64_t pages_to_host, pages_to_device; /* moves of written pages, summed */
    uint64_t forced_steps; /* steps whose decodes the device could not hold */
    uint64_t deferred;     /* decodes deferred a step (defer on), summed */
    uint32_t last_deferred;
    /* the scheduler's estimate of what the host can serve at a gain (wrk_off_choice.gain_kv),
     * in pages (gain_kv / page size, rounded down), summed over the gain_steps steps that had
     * decodes: offload's capacity rule reads it (wrk_off_adapt, estimate mode) */
    uint64_t gain_pages, gain_steps;
} wrk_offplace_stats;

typedef struct wrk_offplace {
    uint32_t n_pages, device_pages, page_size, max_items;
    uint8_t *loc;     /* [n_pages] 0 device, 1 host */
    uint8_t *written; /* [n_pages] 1 once K/V were stored or copied there (cleared: 0) */
    uint8_t *mark;    /* [n_pages] scratch of one step: read by a device item */
    wrk_off_req *reqs;   /* [max_items] */
    uint32_t *req_item;  /* [max_items] */
    uint8_t *req_host;   /* [max_items] */
    uint16_t *waited;    /* [n_pages] steps deferred in a row, by the request's first page */
    bool defer;          /* the caller skips deferred items (wrk_offplace_set_defer) */
    wrk_offplace_stats stats;
} wrk_offplace;

/* Tables for page ids [0, n_pages), device_pages of them meant for the device, steps of at most
 * max_items items. RESOURCE_EXHAUSTED when they cannot be allocated. */
pie_code wrk_offplace_init(wrk_offplace *p, uint32_t n_pages, uint32_t device_pages,
                           uint32_t page_size, uint32_t max_items, pie_status *st);
void wrk_offplace_free(wrk_offplace *p);

/* A decode that may attend on the host: one input, appended, over at least one page, not
 * device_only. */
bool wrk_offplace_eligible(const wrk_offplace_item *it);

/* Deferral (Neo §3.3; wrk_offload.h's rules with defer_ok): on, the decision may mark an item
 * WRK_OFF_DEFER — the caller must then not run it this step (it is offered again later; the
 * scheduler bounds the wait, WRK_OFF_DEFER_MAX). A request is known by its first page (page ids
 * never change; forks sharing a first page share one count). Off by default: on for the cpu
 * engine's eng_forward_plan and the emulated device's offload_defer. */
void wrk_offplace_set_defer(wrk_offplace *p, bool on);

/* The step's split into item_host[0, n) (WRK_OFF_HOST: attends on the host; WRK_OFF_DEFER:
 * skipped, with deferral on). pick NULL: the load-aware
 * scheduler over costs (*choice gets its decision; choice may be NULL); else pick(user, i) for
 * each eligible item i. Then the fixed point (an item reading a page a device item reads stays
 * on the device). Moves nothing. */
void wrk_offplace_decide(wrk_offplace *p, const wrk_off_costs *costs,
                         const wrk_offplace_item *items, uint32_t n,
                         bool (*pick)(void *user, uint32_t item), void *user, uint8_t *item_host,
                         wrk_off_choice *choice);

/* The caller skips more items than the decision deferred (skip[i] ≠ 0: they depend on a
 * deferred one): they become WRK_OFF_DEFER in item_host, and a decode request among them counts
 * a step of waiting as a deferred one does (it did wait). */
void wrk_offplace_skip(wrk_offplace *p, const wrk_offplace_item *items, uint32_t n,
                       uint8_t *item_host, const uint8_t *skip);

/* Executes a split: every item's pages go where it attends — move(user, page, to) for each
 * written page that changes region (to = 1: to the host) — and the pages the step appends to
 * are written from now on; a deferred item is left as it is. Returns the items on the host. */
uint32_t wrk_offplace_apply(wrk_offplace *p, const wrk_offplace_item *items, uint32_t n,
                            const uint8_t *item_host,
                            void (*move)(void *user, uint32_t page, uint8_t to), void *user);

/* A page holding KV left the device outside a split (the cuda engine made room for another:
 * mem/wrk_kvslots.h): it is on the host from now on. */
void wrk_offplace_evicted(wrk_offplace *p, uint32_t page);
/* A page copy wrote dst (where it lives). */
void wrk_offplace_copied(wrk_offplace *p, uint32_t dst);
/* Pages were freed (the worker's slot batch): what they hold is never read again, so they
 * stop counting against the device's room; where they are does not matter (a freed page is
 * cleared again when it is allocated). Ids past the table are ignored. */
void wrk_offplace_freed(wrk_offplace *p, const uint32_t *pages, uint32_t n);
/* Pages were cleared: empty, and on the device (the engine zeroes the device copy). */
void wrk_offplace_cleared(wrk_offplace *p, const uint32_t *pages, uint32_t n);

static inline bool wrk_offplace_on_host(const wrk_offplace *p, uint32_t page) {
    return p->loc[page] != 0;
}

#endif
