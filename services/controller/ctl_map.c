/* ctl_map.c — see ctl_map.h. Growth and deletion are pie_map.c's; the lookups are here. */
#include "ctl_map.h"

#include <stdlib.h>
#include <string.h>

#include "pie_map.h"

/* ---- u32 → u32 ---------------------------------------------------------------------------- */

static uint32_t h32(uint32_t k) {
    uint32_t h = k * 0x9E3779B1u;
    return h ^ (h >> 15);
}

static bool used32(const void *c) { return ((const ctl_map32_cell *)c)->val != CTL_MAP32_EMPTY; }
static size_t hash32(const void *c) { return h32(((const ctl_map32_cell *)c)->key); }
static void clear32(void *c) { *(ctl_map32_cell *)c = (ctl_map32_cell){0, CTL_MAP32_EMPTY}; }
static const pie_map_kind kind32 = {sizeof(ctl_map32_cell), used32, hash32, clear32};

/* The cell holding key, or the free cell where it would go (the table is never full). */
static size_t find32(const ctl_map32 *m, uint32_t key) {
    size_t mask = m->cap - 1, i = h32(key) & mask;
    while (m->cells[i].val != CTL_MAP32_EMPTY && m->cells[i].key != key) i = (i + 1) & mask;
    return i;
}

bool ctl_map32_get(const ctl_map32 *m, uint32_t key, uint32_t *val) {
    if (m->n == 0) return false;
    const ctl_map32_cell *c = &m->cells[find32(m, key)];
    if (c->val == CTL_MAP32_EMPTY) return false;
    if (val) *val = c->val;
    return true;
}

int ctl_map32_reserve(ctl_map32 *m, uint32_t n) {
    ctl_map32_cell *cells = pie_map_reserve(&kind32, m->cells, &m->cap, n);
    if (cells == NULL) return -1;
    m->cells = cells;
    return 0;
}

int ctl_map32_put(ctl_map32 *m, uint32_t key, uint32_t val) {
    if (ctl_map32_reserve(m, m->n + 1) != 0) return -1;
    ctl_map32_cell *c = &m->cells[find32(m, key)];
    if (c->val == CTL_MAP32_EMPTY) m->n++;
    *c = (ctl_map32_cell){key, val};
    return 0;
}

bool ctl_map32_del(ctl_map32 *m, uint32_t key, uint32_t *old) {
    if (m->n == 0) return false;
    size_t i = find32(m, key);
    if (m->cells[i].val == CTL_MAP32_EMPTY) return false;
    if (old) *old = m->cells[i].val;
    pie_map_remove_at(&kind32, m->cells, m->cap, i);
    m->n--;
    return true;
}

void ctl_map32_free(ctl_map32 *m) {
    free(m->cells);
    memset(m, 0, sizeof *m);
}

/* ---- string → pointer ---------------------------------------------------------------------- */

static uint64_t hstr(const char *s) { /* FNV-1a, then the splitmix64 finaliser */
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ull;
    }
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

static bool usedstr(const void *c) { return ((const ctl_mapstr_cell *)c)->key != NULL; }
static size_t hashstr(const void *c) { return (size_t)((const ctl_mapstr_cell *)c)->hash; }
static void clearstr(void *c) { *(ctl_mapstr_cell *)c = (ctl_mapstr_cell){0}; }
static const pie_map_kind kindstr = {sizeof(ctl_mapstr_cell), usedstr, hashstr, clearstr};

/* The cell holding key (hash h), or the free cell where it would go. */
static size_t findstr(const ctl_mapstr *m, const char *key, uint64_t h) {
    size_t mask = m->cap - 1, i = h & mask;
    for (;; i = (i + 1) & mask) {
        const ctl_mapstr_cell *c = &m->cells[i];
        if (c->key == NULL || (c->hash == h && strcmp(c->key, key) == 0)) return i;
    }
}

void *ctl_mapstr_get(const ctl_mapstr *m, const char *key) {
    if (m->n == 0) return NULL;
    return m->cells[findstr(m, key, hstr(key))].val; /* a free cell's val is NULL */
}

int ctl_mapstr_put(ctl_mapstr *m, const char *key, void *val) {
    ctl_mapstr_cell *cells = pie_map_reserve(&kindstr, m->cells, &m->cap, m->n + 1);
    if (cells == NULL) return -1;
    m->cells = cells;
    uint64_t h = hstr(key);
    ctl_mapstr_cell *c = &cells[findstr(m, key, h)];
    if (c->key == NULL) m->n++;
    *c = (ctl_mapstr_cell){.key = key, .hash = h, .val = val};
    return 0;
}

void *ctl_mapstr_del(ctl_mapstr *m, const char *key) {
    if (m->n == 0) return NULL;
    size_t i = findstr(m, key, hstr(key));
    void *val = m->cells[i].val;
    if (m->cells[i].key == NULL) return NULL;
    pie_map_remove_at(&kindstr, m->cells, m->cap, i);
    m->n--;
    return val;
}

void ctl_mapstr_free(ctl_mapstr *m) {
    free(m->cells);
    memset(m, 0, sizeof *m);
}
