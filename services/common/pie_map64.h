/* pie_map64.h — a u64 → pointer hash map, shared by the controller (instance ids) and the
 * lifecycle's host API (instance, future, call and queue ids).
 *
 * Owns: its cells and lookups; the table discipline (linear probing, growth, deletion by
 * backward shift, never more than 3/4 full) is pie_map.h's. Key 0 is reserved (free cells).
 * Does not own what the keys mean. A zeroed struct is an empty map. */
#ifndef PIE_MAP64_H
#define PIE_MAP64_H

#include <stddef.h>
#include <stdint.h>

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
