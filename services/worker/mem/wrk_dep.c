/* wrk_dep.c — see wrk_dep.h. */
#include "wrk_dep.h"

#include <stdlib.h>
#include <string.h>

pie_code wrk_dep_init(wrk_dep *d, uint32_t kv_pages, uint32_t embed_slots, pie_status *st) {
    memset(d, 0, sizeof *d);
    d->kv_pages = kv_pages;
    d->embed_slots = embed_slots;
    size_t nk = kv_pages ? kv_pages : 1, ne = embed_slots ? embed_slots : 1;
    d->kv = calloc(nk, 1);
    d->emb = calloc(ne, 1);
    d->kv_list = calloc(nk, sizeof *d->kv_list);
    d->emb_list = calloc(ne, sizeof *d->emb_list);
    if (!d->kv || !d->emb || !d->kv_list || !d->emb_list) {
        wrk_dep_free(d);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "deferral: out of memory for the footprint of %u pages and %u "
                              "embedding slots",
                              kv_pages, embed_slots);
    }
    return PIE_OK;
}

void wrk_dep_free(wrk_dep *d) {
    free(d->kv);
    free(d->emb);
    free(d->kv_list);
    free(d->emb_list);
    memset(d, 0, sizeof *d);
}

void wrk_dep_clear(wrk_dep *d) {
    for (uint32_t i = 0; i < d->n_kv; i++) d->kv[d->kv_list[i]] = 0;
    for (uint32_t i = 0; i < d->n_emb; i++) d->emb[d->emb_list[i]] = 0;
    d->n_kv = d->n_emb = 0;
}

/* Whether any of ids[0, n) carries a bit of mask in marks[0, limit). */
static bool dep_any(const uint8_t *marks, uint32_t limit, const uint32_t *ids, uint32_t n,
                    uint8_t mask) {
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] < limit && (marks[ids[i]] & mask)) return true;
    return false;
}

bool wrk_dep_hits(const wrk_dep *d, const wrk_dep_access *a) {
    if (wrk_dep_empty(d)) return false;
    return dep_any(d->kv, d->kv_pages, a->kv_read, a->n_kv_read, WRK_DEP_WRITE) ||
           dep_any(d->kv, d->kv_pages, a->kv_write, a->n_kv_write, WRK_DEP_READ | WRK_DEP_WRITE) ||
           dep_any(d->emb, d->embed_slots, a->emb_read, a->n_emb_read, WRK_DEP_WRITE) ||
           dep_any(d->emb, d->embed_slots, a->emb_write, a->n_emb_write,
                   WRK_DEP_READ | WRK_DEP_WRITE);
}

/* Marks ids[0, n) with bit in marks[0, limit), listing each id the first time. */
static void dep_mark(uint8_t *marks, uint32_t limit, uint32_t *list, uint32_t *n_list,
                     const uint32_t *ids, uint32_t n, uint8_t bit) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = ids[i];
        if (id >= limit) continue;
        if (marks[id] == 0) list[(*n_list)++] = id;
        marks[id] |= bit;
    }
}

void wrk_dep_add(wrk_dep *d, const wrk_dep_access *a) {
    dep_mark(d->kv, d->kv_pages, d->kv_list, &d->n_kv, a->kv_read, a->n_kv_read, WRK_DEP_READ);
    dep_mark(d->kv, d->kv_pages, d->kv_list, &d->n_kv, a->kv_write, a->n_kv_write, WRK_DEP_WRITE);
    dep_mark(d->emb, d->embed_slots, d->emb_list, &d->n_emb, a->emb_read, a->n_emb_read,
             WRK_DEP_READ);
    dep_mark(d->emb, d->embed_slots, d->emb_list, &d->n_emb, a->emb_write, a->n_emb_write,
             WRK_DEP_WRITE);
}
