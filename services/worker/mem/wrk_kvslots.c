/* wrk_kvslots.c — see wrk_kvslots.h. */
#include "wrk_kvslots.h"

#include <stdlib.h>
#include <string.h>

pie_code wrk_kvslots_init(wrk_kvslots *s, uint32_t n_pages, uint32_t n_slots,
                          const uint8_t *written, const wrk_kvslots_ops *ops, pie_status *st) {
    memset(s, 0, sizeof *s);
    if (n_pages == 0 || n_slots == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "offload: %u pages over %u device slots (both must be > 0)", n_pages,
                              n_slots);
    s->n_pages = n_pages;
    s->n_slots = n_slots;
    s->written = written;
    s->ops = *ops;
    s->step = 1;
    s->slot_of = malloc((size_t)n_pages * sizeof *s->slot_of);
    s->page_of = malloc((size_t)n_slots * sizeof *s->page_of);
    s->pinned = calloc(n_slots, sizeof *s->pinned);
    s->free = malloc((size_t)n_slots * sizeof *s->free);
    if (!s->slot_of || !s->page_of || !s->pinned || !s->free) {
        wrk_kvslots_free(s);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "offload: out of memory for the slot tables of %u pages", n_pages);
    }
    for (uint32_t p = 0; p < n_pages; p++) s->slot_of[p] = WRK_KVSLOT_NONE;
    for (uint32_t k = 0; k < n_slots; k++) {
        s->page_of[k] = WRK_KVSLOT_NONE;
        s->free[k] = k; /* the last slot on top: page ids and slots part from the start, so
                           a table naming a page id where a slot belongs shows in tests */
    }
    s->n_free = n_slots;
    return PIE_OK;
}

void wrk_kvslots_free(wrk_kvslots *s) {
    free(s->slot_of);
    free(s->page_of);
    free(s->pinned);
    free(s->free);
    memset(s, 0, sizeof *s);
}

void wrk_kvslots_begin_step(wrk_kvslots *s) { s->step++; }

bool wrk_kvslots_touch(wrk_kvslots *s, uint32_t page) {
    uint32_t k = s->slot_of[page];
    if (k == WRK_KVSLOT_NONE) return false;
    s->pinned[k] = s->step;
    return true;
}

static void kvslots_release(wrk_kvslots *s, uint32_t slot) {
    s->slot_of[s->page_of[slot]] = WRK_KVSLOT_NONE;
    s->page_of[slot] = WRK_KVSLOT_NONE;
    s->free[s->n_free++] = slot;
    s->stats.resident--;
}

/* A slot for a page about to be pinned: a free one, else the clock's next unpinned one, its
 * page sent home. */
static pie_code kvslots_take(wrk_kvslots *s, uint32_t *slot, pie_status *st) {
    if (s->n_free == 0) {
        uint32_t k = WRK_KVSLOT_NONE;
        for (uint32_t i = 0; i < s->n_slots && k == WRK_KVSLOT_NONE; i++) {
            uint32_t c = (s->hand + i) % s->n_slots;
            if (s->pinned[c] != s->step) k = c;
        }
        if (k == WRK_KVSLOT_NONE)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                  "offload: the step needs more than the device's %u KV pages",
                                  s->n_slots);
        s->hand = (k + 1) % s->n_slots;
        uint32_t victim = s->page_of[k];
        bool holds = s->written[victim] != 0;
        if (holds) {
            pie_code rc = s->ops.spill(s->ops.user, victim, k, st);
            if (rc != PIE_OK) return rc;
            s->stats.spilled++;
        }
        kvslots_release(s, k);
        if (holds) {
            s->stats.evicted++;
            if (s->ops.evicted) s->ops.evicted(s->ops.user, victim);
        }
    }
    *slot = s->free[--s->n_free];
    return PIE_OK;
}

pie_code wrk_kvslots_pin(wrk_kvslots *s, uint32_t page, uint32_t *slot, pie_status *st) {
    if (wrk_kvslots_touch(s, page)) {
        *slot = s->slot_of[page];
        return PIE_OK;
    }
    uint32_t k = WRK_KVSLOT_NONE;
    pie_code rc = kvslots_take(s, &k, st);
    if (rc != PIE_OK) return rc;
    bool holds = s->written[page] != 0;
    rc = holds ? s->ops.fetch(s->ops.user, page, k, st) : s->ops.zero(s->ops.user, page, k, st);
    if (rc != PIE_OK) {
        s->free[s->n_free++] = k; /* the page stays home; the slot is free again */
        return rc;
    }
    if (holds)
        s->stats.fetched++;
    else
        s->stats.zeroed++;
    s->slot_of[page] = k;
    s->page_of[k] = page;
    s->pinned[k] = s->step;
    s->stats.resident++;
    *slot = k;
    return PIE_OK;
}

pie_code wrk_kvslots_unload(wrk_kvslots *s, uint32_t page, pie_status *st) {
    uint32_t k = s->slot_of[page];
    if (k == WRK_KVSLOT_NONE) return PIE_OK;
    if (s->written[page]) {
        pie_code rc = s->ops.spill(s->ops.user, page, k, st);
        if (rc != PIE_OK) return rc;
        s->stats.spilled++;
    }
    kvslots_release(s, k);
    return PIE_OK;
}

void wrk_kvslots_forget(wrk_kvslots *s, uint32_t page) {
    if (page >= s->n_pages || s->slot_of[page] == WRK_KVSLOT_NONE) return;
    kvslots_release(s, s->slot_of[page]);
}

/* ---- the engine's side of a step ----------------------------------------------------------- */

pie_code wrk_kvslots_place(wrk_kvslots *s, wrk_offplace *p, const wrk_offplace_item *items,
                           uint32_t n, const uint8_t *item_host, uint32_t *hosted, pie_status *st) {
    *hosted = 0;
    wrk_kvslots_begin_step(s);
    for (uint32_t i = 0; i < n; i++) /* what is here already stays */
        if (item_host[i] == WRK_OFF_DEVICE)
            for (uint32_t j = 0; j < items[i].n_pages; j++)
                (void)wrk_kvslots_touch(s, items[i].pages[j]);
    for (uint32_t i = 0; i < n; i++) {
        if (item_host[i] != WRK_OFF_DEVICE) continue;
        for (uint32_t j = 0; j < items[i].n_pages; j++) {
            uint32_t slot;
            pie_code rc = wrk_kvslots_pin(s, items[i].pages[j], &slot, st);
            if (rc != PIE_OK) return rc;
        }
    }
    /* the placement's regions and counts; the data has moved already (pinned above) or moves
     * below (home) */
    *hosted = wrk_offplace_apply(p, items, n, item_host, NULL, NULL);
    for (uint32_t i = 0; i < n; i++)
        if (item_host[i] == WRK_OFF_HOST)
            for (uint32_t j = 0; j < items[i].n_pages; j++) {
                pie_code rc = wrk_kvslots_unload(s, items[i].pages[j], st);
                if (rc != PIE_OK) return rc;
            }
    return PIE_OK;
}

pie_code wrk_kvslots_copy_dst(wrk_kvslots *s, wrk_offplace *p, uint32_t page, pie_status *st) {
    if (p->written[page]) return PIE_OK; /* its data is where its slot says */
    if (wrk_offplace_on_host(p, page)) return wrk_kvslots_unload(s, page, st);
    uint32_t slot;
    return wrk_kvslots_pin(s, page, &slot, st);
}
