/* pie_map64.h — a u64 → pointer hash map, shared by the controller (instance ids) and the
 * lifecycle's host API (instance, future, call and queue ids).
 *
 * Owns: open addressing with linear probing and deletion by backward shift (no tombstones, so
 * churn of short-lived entries never degrades it); capacities are powers of two kept at most 3/4
 * full; tables grow and never shrink until freed. Key 0 is reserved (free cells). Does not own
 * what the keys mean. A zeroed struct is an empty map. */
#ifndef PIE_MAP64_H
#define PIE_MAP64_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The table discipline of this map, also used by the controller's u32 and string maps
 * (ctl_map.c). */
/* The capacity (a power of two, at least 8) that keeps need entries at most 3/4 full. */
static inline size_t pie_map_grown_cap(size_t cap, size_t need) {
    size_t c = cap ? cap : 8;
    while (need * 4 > c * 3) c *= 2;
    return c;
}
/* Is i inside the cyclic range [k, j)? (Backward-shift deletion: an entry at j whose home is k
 * may move to the hole at i only if i lies between its home and its current cell.) */
static inline bool pie_map_cyc_between(size_t k, size_t i, size_t j) {
    return k <= j ? (k <= i && i < j) : (k <= i || i < j);
}

typedef struct pie_map64_cell {
    uint64_t key; /* 0: free cell */
    void *val;
} pie_map64_cell;

typedef struct pie_map64 {
    pie_map64_cell *cells;
    size_t cap, n;
} pie_map64;

void *pie_map64_get(const pie_map64 *m, uint64_t key);
/* Inserts or replaces (key != 0, val != NULL); -1 when out of memory, the map unchanged. */
int pie_map64_put(pie_map64 *m, uint64_t key, void *val);
void *pie_map64_del(pie_map64 *m, uint64_t key); /* the removed value, or NULL */
void pie_map64_free(pie_map64 *m);

#endif
