/* ctl_map.h — the controller's hash maps.
 *
 * Owns: two tables and their lookups: u32 → u32 (an instance's virtual ids → physical slots,
 * queue ids → queue index) and string → pointer (export names, topics). The table discipline
 * (linear probing, growth, deletion by backward shift, at most 3/4 full) is pie_map.h's, shared
 * with the u64 → pointer map (instance ids), pie_map64 in services/common. Does not own what
 * the keys mean.
 *
 * A zeroed struct is an empty map. Functions that can fail return -1 when out of memory and
 * leave the map unchanged. */
#ifndef CTL_MAP_H
#define CTL_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_map64.h" /* u64 → pointer, shared with the lifecycle */

/* ---- u32 → u32 ---------------------------------------------------------------------------- */

#define CTL_MAP32_EMPTY UINT32_MAX /* never stored as a value: marks a free cell */

typedef struct ctl_map32_cell {
    uint32_t key;
    uint32_t val; /* CTL_MAP32_EMPTY: free cell */
} ctl_map32_cell;

typedef struct ctl_map32 {
    ctl_map32_cell *cells; /* [cap] */
    size_t cap;            /* 0 or a power of two */
    uint32_t n;            /* entries */
} ctl_map32;

bool ctl_map32_get(const ctl_map32 *m, uint32_t key, uint32_t *val);
/* Makes room for `n` entries in all without growing later. */
int ctl_map32_reserve(ctl_map32 *m, uint32_t n);
/* Inserts or replaces; val must not be CTL_MAP32_EMPTY. */
int ctl_map32_put(ctl_map32 *m, uint32_t key, uint32_t val);
/* Removes key; *old (may be NULL) gets its value. False if absent. */
bool ctl_map32_del(ctl_map32 *m, uint32_t key, uint32_t *old);
void ctl_map32_free(ctl_map32 *m);

/* ---- string → pointer (keys are borrowed: they must live as long as their entry) ------------ */

typedef struct ctl_mapstr_cell {
    const char *key; /* NULL: free cell */
    uint64_t hash;
    void *val;
} ctl_mapstr_cell;

typedef struct ctl_mapstr {
    ctl_mapstr_cell *cells;
    size_t cap, n;
} ctl_mapstr;

void *ctl_mapstr_get(const ctl_mapstr *m, const char *key);
int ctl_mapstr_put(ctl_mapstr *m, const char *key, void *val); /* key NUL-terminated */
void *ctl_mapstr_del(ctl_mapstr *m, const char *key);
void ctl_mapstr_free(ctl_mapstr *m);

#endif
