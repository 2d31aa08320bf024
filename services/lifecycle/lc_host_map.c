/* lc_host_map.c — the host API's u64 → pointer map (lc_hmap, declared in lc_host_int.h):
 * instance ids → instances, future ids → futures, call ids → calls, queue ids → queues.
 *
 * Owns: open addressing with linear probing and deletion by backward shift (no tombstones, so
 * churn of short-lived futures and calls never degrades it). Key 0 is reserved for free cells;
 * capacities are powers of two at most 3/4 full. Does not own what the keys mean.
 * (ctl_map.h in the controller is the same idea; the lifecycle does not link the controller.) */
#include <stdlib.h>

#include "lc_host_int.h"

static size_t hmap_slot(uint64_t key, size_t cap) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return (size_t)key & (cap - 1);
}

void *lc_hmap_get(const lc_hmap *m, uint64_t key) {
    if (m->cap == 0) return NULL;
    for (size_t i = hmap_slot(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->cells[i].key == key) return m->cells[i].val;
        if (m->cells[i].key == 0) return NULL;
    }
}

static int hmap_grow(lc_hmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 16;
    lc_hmap_cell *c = calloc(cap, sizeof *c);
    if (c == NULL) return -1;
    for (size_t i = 0; i < m->cap; i++) {
        if (m->cells[i].key == 0) continue;
        size_t k = hmap_slot(m->cells[i].key, cap);
        while (c[k].key) k = (k + 1) & (cap - 1);
        c[k] = m->cells[i];
    }
    free(m->cells);
    m->cells = c;
    m->cap = cap;
    return 0;
}

int lc_hmap_put(lc_hmap *m, uint64_t key, void *val) {
    if ((m->n + 1) * 4 > m->cap * 3 && hmap_grow(m) != 0) return -1;
    size_t i = hmap_slot(key, m->cap);
    while (m->cells[i].key && m->cells[i].key != key) i = (i + 1) & (m->cap - 1);
    if (m->cells[i].key == 0) m->n++;
    m->cells[i] = (lc_hmap_cell){key, val};
    return 0;
}

void *lc_hmap_del(lc_hmap *m, uint64_t key) {
    if (m->cap == 0) return NULL;
    size_t i = hmap_slot(key, m->cap);
    while (m->cells[i].key != key) {
        if (m->cells[i].key == 0) return NULL;
        i = (i + 1) & (m->cap - 1);
    }
    void *val = m->cells[i].val;
    /* Backward shift: later cells of the probe run move into the hole when they may. */
    for (size_t j = (i + 1) & (m->cap - 1); m->cells[j].key; j = (j + 1) & (m->cap - 1)) {
        size_t home = hmap_slot(m->cells[j].key, m->cap);
        if (((j - home) & (m->cap - 1)) >= ((j - i) & (m->cap - 1))) {
            m->cells[i] = m->cells[j];
            i = j;
        }
    }
    m->cells[i] = (lc_hmap_cell){0};
    m->n--;
    return val;
}

void lc_hmap_free(lc_hmap *m) {
    free(m->cells);
    *m = (lc_hmap){0};
}

