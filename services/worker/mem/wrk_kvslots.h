/* wrk_kvslots.h — a device that holds some KV pages in a fixed number of slots while every
 * page has its home in the host pool: the page table of CPU attention offload on the cuda
 * backend (issue 13; engine/eng_cuda_off.c), kept apart from CUDA so CI tests it on a CPU.
 *
 * Owns: page id → device slot and back, the free slots, which pages a step has pinned, and the
 * choice of the page that leaves when a step needs a slot and none is free (a clock hand over
 * the slots, skipping those the step pinned). The rule every operation keeps: a page with a
 * slot has its data there; a page without one has it at home. Moving data is the caller's
 * (the ops: one copy of every layer's block of the page each way, zeroing a fresh slot).
 * wrk_kvslots_place and wrk_kvslots_copy_dst run the engine's side of a step and of a page
 * copy over the placement, so the whole protocol is tested here without a device.
 * Does not own: where a page is meant to attend (mem/wrk_offplace.h decides; its `written`
 * table says which pages hold KV), the memory of either side. Not thread safe. */
#ifndef WRK_KVSLOTS_H
#define WRK_KVSLOTS_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_status.h"
#include "wrk_offplace.h"

#define WRK_KVSLOT_NONE UINT32_MAX

typedef struct wrk_kvslots_ops {
    /* every layer's block of the page: its home → the slot (fetch), the slot → its home (spill) */
    pie_code (*fetch)(void *user, uint32_t page, uint32_t slot, pie_status *st);
    pie_code (*spill)(void *user, uint32_t page, uint32_t slot, pie_status *st);
    /* a slot taken by a page that holds no KV: make it read as an empty page */
    pie_code (*zero)(void *user, uint32_t page, uint32_t slot, pie_status *st);
    /* a page holding KV left the device to make room for a pinned one (its data is home now) */
    void (*evicted)(void *user, uint32_t page);
    void *user;
} wrk_kvslots_ops;

typedef struct wrk_kvslots_stats {
    uint64_t fetched, spilled, zeroed, evicted; /* pages, summed */
    uint32_t resident;                          /* slots in use now */
} wrk_kvslots_stats;

typedef struct wrk_kvslots {
    uint32_t n_pages, n_slots;
    uint32_t *slot_of; /* [n_pages]: WRK_KVSLOT_NONE when at home */
    uint32_t *page_of; /* [n_slots]: WRK_KVSLOT_NONE when free */
    uint64_t *pinned;  /* [n_slots]: the step that pinned it last */
    uint32_t *free;    /* [n_slots]: a stack of free slots */
    uint32_t n_free, hand;
    uint64_t step;          /* starts at 1: a slot pinned at 0 was never pinned */
    const uint8_t *written; /* [n_pages], the caller's: 1 = the page holds KV */
    wrk_kvslots_ops ops;
    wrk_kvslots_stats stats;
} wrk_kvslots;

/* n_pages page ids, n_slots device slots (both > 0), every page at home. RESOURCE_EXHAUSTED
 * when the tables cannot be allocated. */
pie_code wrk_kvslots_init(wrk_kvslots *s, uint32_t n_pages, uint32_t n_slots,
                          const uint8_t *written, const wrk_kvslots_ops *ops, pie_status *st);
void wrk_kvslots_free(wrk_kvslots *s);

/* A new step: nothing is pinned. */
void wrk_kvslots_begin_step(wrk_kvslots *s);

/* Pins a page already on the device for this step (it will not be evicted); a page at home is
 * left there. Returns whether it is on the device. */
bool wrk_kvslots_touch(wrk_kvslots *s, uint32_t page);

/* Puts the page on the device, pinned for this step: a free slot, else the clock's next slot
 * not pinned this step (its page spilled home first when it holds KV, then ops.evicted), then
 * fetched (a page holding KV) or zeroed. *slot gets the slot. RESOURCE_EXHAUSTED when every
 * slot is pinned; a copy's failure is returned as the op set it (the page stays home). */
pie_code wrk_kvslots_pin(wrk_kvslots *s, uint32_t page, uint32_t *slot, pie_status *st);

/* Sends the page home (spilled when it holds KV) and frees its slot; a page at home: nothing. */
pie_code wrk_kvslots_unload(wrk_kvslots *s, uint32_t page, pie_status *st);

/* Frees the page's slot without copying: what it held is never read again (a freed or cleared
 * page). Ids past the table are ignored. */
void wrk_kvslots_forget(wrk_kvslots *s, uint32_t page);

/* One step's split (item_host, from wrk_offplace_decide over items) executed: every page a
 * device item reads or writes gets a slot, pinned (fetched when it holds KV; fresh pages
 * zeroed: this runs before the placement marks appended pages written), wrk_offplace_apply
 * records the regions, then every host item's pages go home (spilled when they hold KV; a page
 * holding none may have had a slot too). ops.evicted must tell the placement
 * (wrk_offplace_evicted). *hosted: the items on the host. A failure (a step needing more
 * slots than there are, a copy's) leaves every page's data where its slot says. */
pie_code wrk_kvslots_place(wrk_kvslots *s, wrk_offplace *p, const wrk_offplace_item *items,
                           uint32_t n, const uint8_t *item_host, uint32_t *hosted, pie_status *st);

/* Before a page copy writes `page`: a page holding no KV goes where the placement means it to
 * be (a slot when its region is the device, home otherwise), so wrk_offplace_copied counts it
 * right. Each copy a step of its own (wrk_kvslots_begin_step first): then it never fails for
 * want of a slot, and the copy's source is read wherever it is afterwards. */
pie_code wrk_kvslots_copy_dst(wrk_kvslots *s, wrk_offplace *p, uint32_t page, pie_status *st);

static inline uint32_t wrk_kvslots_slot(const wrk_kvslots *s, uint32_t page) {
    return s->slot_of[page];
}

#endif
