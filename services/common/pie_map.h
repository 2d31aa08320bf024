/* pie_map.h — the open-addressing discipline shared by the hash maps: pie_map64 (u64 → pointer,
 * here) and the controller's u32 → u32 and string → pointer maps (ctl_map.c).
 *
 * Owns: table sizing (capacities are powers of two, at least 8, kept at most 3/4 full; tables
 * grow and never shrink until freed), growing a table (every entry moved to its probe position
 * in a fresh one) and deletion by backward shift (no tombstones, so churn of short-lived entries
 * never degrades a table). Probing is linear from the cell's home (its hash masked).
 * Does not own: cell layouts, hashes and key comparison (each map's; lookups stay in the map's
 * own file so that they compile to a tight loop). */
#ifndef PIE_MAP_H
#define PIE_MAP_H

#include <stdbool.h>
#include <stddef.h>

/* How one map's cells look to the shared code. */
typedef struct pie_map_kind {
    size_t cell_size;
    bool (*used)(const void *cell);   /* false: a free cell */
    size_t (*hash)(const void *cell); /* of a used cell's key; masked here */
    void (*clear)(void *cell);        /* makes a free cell */
} pie_map_kind;

/* cells[*cap] grown, when needed, so that `need` entries keep it at most 3/4 full: returns the
 * table to use from now on (cells itself when big enough, else a fresh one, cells freed) and
 * sets *cap; NULL when out of memory (cells and *cap unchanged). */
void *pie_map_reserve(const pie_map_kind *k, void *cells, size_t *cap, size_t need);

/* Frees the used cell at index i of cells[cap], moving later entries of its probe run back. */
void pie_map_remove_at(const pie_map_kind *k, void *cells, size_t cap, size_t i);

#endif
