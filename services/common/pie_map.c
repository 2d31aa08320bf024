/* pie_map.c — see pie_map.h. */
#include "pie_map.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static char *cell_at(const pie_map_kind *k, void *cells, size_t i) {
    return (char *)cells + i * k->cell_size;
}

/* The capacity (a power of two, at least 8) that keeps need entries at most 3/4 full; 0 when
 * that does not fit a size_t. */
static size_t grown_cap(size_t cap, size_t need) {
    size_t c = cap ? cap : 8;
    while (need > c / 4 * 3) {
        if (c > SIZE_MAX / 2) return 0;
        c *= 2;
    }
    return c;
}

/* Is i inside the cyclic range [h, j)? An entry at j whose home is h may move to the hole at i
 * only then. */
static bool cyc_between(size_t h, size_t i, size_t j) {
    return h <= j ? (h <= i && i < j) : (h <= i || i < j);
}

void *pie_map_reserve(const pie_map_kind *k, void *cells, size_t *cap, size_t need) {
    size_t old_cap = *cap, new_cap = grown_cap(old_cap, need);
    if (new_cap == old_cap) return cells;
    if (new_cap == 0 || new_cap > SIZE_MAX / k->cell_size) return NULL;
    void *fresh = malloc(new_cap * k->cell_size);
    if (fresh == NULL) return NULL;
    for (size_t i = 0; i < new_cap; i++) k->clear(cell_at(k, fresh, i));
    size_t mask = new_cap - 1;
    for (size_t i = 0; i < old_cap; i++) {
        const char *c = cell_at(k, cells, i);
        if (!k->used(c)) continue;
        size_t j = k->hash(c) & mask;
        while (k->used(cell_at(k, fresh, j))) j = (j + 1) & mask;
        memcpy(cell_at(k, fresh, j), c, k->cell_size);
    }
    free(cells);
    *cap = new_cap;
    return fresh;
}

void pie_map_remove_at(const pie_map_kind *k, void *cells, size_t cap, size_t i) {
    size_t mask = cap - 1;
    for (size_t j = (i + 1) & mask; k->used(cell_at(k, cells, j)); j = (j + 1) & mask) {
        size_t h = k->hash(cell_at(k, cells, j)) & mask;
        if (cyc_between(h, i, j)) {
            memcpy(cell_at(k, cells, i), cell_at(k, cells, j), k->cell_size);
            i = j;
        }
    }
    k->clear(cell_at(k, cells, i));
}
