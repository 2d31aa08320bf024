/* ctl_map.c — see ctl_map.h. */
#include "ctl_map.h"

#include <stdlib.h>
#include <string.h>

/* ---- u32 → u32 ---------------------------------------------------------------------------- */

static uint32_t h32(uint32_t k) {
    uint32_t h = k * 0x9E3779B1u;
    return h ^ (h >> 15);
}

bool ctl_map32_get(const ctl_map32 *m, uint32_t key, uint32_t *val) {
    if (m->n == 0) return false;
    uint32_t mask = m->cap - 1;
    for (uint32_t i = h32(key) & mask;; i = (i + 1) & mask) {
        const ctl_map32_cell *c = &m->cells[i];
        if (c->val == CTL_MAP32_EMPTY) return false;
        if (c->key == key) {
            if (val) *val = c->val;
            return true;
        }
    }
}

static void put32_nogrow(ctl_map32 *m, uint32_t key, uint32_t val) {
    uint32_t mask = m->cap - 1;
    for (uint32_t i = h32(key) & mask;; i = (i + 1) & mask) {
        ctl_map32_cell *c = &m->cells[i];
        if (c->val == CTL_MAP32_EMPTY) {
            c->key = key;
            c->val = val;
            m->n++;
            return;
        }
        if (c->key == key) {
            c->val = val;
            return;
        }
    }
}

int ctl_map32_reserve(ctl_map32 *m, uint32_t n) {
    size_t cap = pie_map_grown_cap(m->cap, n);
    if (cap == m->cap) return 0;
    if (cap > UINT32_MAX / 2) return -1;
    ctl_map32_cell *cells = malloc(cap * sizeof *cells);
    if (cells == NULL) return -1;
    for (size_t i = 0; i < cap; i++) cells[i].val = CTL_MAP32_EMPTY;
    ctl_map32 old = *m;
    m->cells = cells;
    m->cap = (uint32_t)cap;
    m->n = 0;
    for (uint32_t i = 0; i < old.cap; i++)
        if (old.cells[i].val != CTL_MAP32_EMPTY)
            put32_nogrow(m, old.cells[i].key, old.cells[i].val);
    free(old.cells);
    return 0;
}

int ctl_map32_put(ctl_map32 *m, uint32_t key, uint32_t val) {
    if (ctl_map32_reserve(m, m->n + 1) != 0) return -1;
    put32_nogrow(m, key, val);
    return 0;
}

bool ctl_map32_del(ctl_map32 *m, uint32_t key, uint32_t *old) {
    if (m->n == 0) return false;
    uint32_t mask = m->cap - 1;
    uint32_t i = h32(key) & mask;
    for (;; i = (i + 1) & mask) {
        if (m->cells[i].val == CTL_MAP32_EMPTY) return false;
        if (m->cells[i].key == key) break;
    }
    if (old) *old = m->cells[i].val;
    for (uint32_t j = (i + 1) & mask; m->cells[j].val != CTL_MAP32_EMPTY; j = (j + 1) & mask) {
        uint32_t k = h32(m->cells[j].key) & mask;
        if (pie_map_cyc_between(k, i, j)) {
            m->cells[i] = m->cells[j];
            i = j;
        }
    }
    m->cells[i].val = CTL_MAP32_EMPTY;
    m->n--;
    return true;
}

void ctl_map32_free(ctl_map32 *m) {
    free(m->cells);
    memset(m, 0, sizeof *m);
}

size_t ctl_map32_bytes(const ctl_map32 *m) { return (size_t)m->cap * sizeof *m->cells; }

/* ---- u64 → pointer ------------------------------------------------------------------------- */

static uint64_t h64(uint64_t x) { /* splitmix64 finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* ---- string → pointer ---------------------------------------------------------------------- */

static uint64_t hstr(const char *s) { /* FNV-1a, then mixed */
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ull;
    }
    return h64(h);
}

void *ctl_mapstr_get(const ctl_mapstr *m, const char *key) {
    if (m->n == 0) return NULL;
    uint64_t h = hstr(key);
    size_t mask = m->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        const ctl_mapstr_cell *c = &m->cells[i];
        if (c->key == NULL) return NULL;
        if (c->hash == h && strcmp(c->key, key) == 0) return c->val;
    }
}

static void putstr_nogrow(ctl_mapstr *m, const char *key, uint64_t h, void *val) {
    size_t mask = m->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        ctl_mapstr_cell *c = &m->cells[i];
        if (c->key == NULL) {
            c->key = key;
            c->hash = h;
            c->val = val;
            m->n++;
            return;
        }
        if (c->hash == h && strcmp(c->key, key) == 0) {
            c->key = key;
            c->val = val;
            return;
        }
    }
}

int ctl_mapstr_put(ctl_mapstr *m, const char *key, void *val) {
    size_t cap = pie_map_grown_cap(m->cap, m->n + 1);
    if (cap != m->cap) {
        ctl_mapstr_cell *cells = calloc(cap, sizeof *cells);
        if (cells == NULL) return -1;
        ctl_mapstr old = *m;
        m->cells = cells;
        m->cap = cap;
        m->n = 0;
        for (size_t i = 0; i < old.cap; i++)
            if (old.cells[i].key)
                putstr_nogrow(m, old.cells[i].key, old.cells[i].hash, old.cells[i].val);
        free(old.cells);
    }
    putstr_nogrow(m, key, hstr(key), val);
    return 0;
}

void *ctl_mapstr_del(ctl_mapstr *m, const char *key) {
    if (m->n == 0) return NULL;
    uint64_t h = hstr(key);
    size_t mask = m->cap - 1;
    size_t i = h & mask;
    for (;; i = (i + 1) & mask) {
        if (m->cells[i].key == NULL) return NULL;
        if (m->cells[i].hash == h && strcmp(m->cells[i].key, key) == 0) break;
    }
    void *val = m->cells[i].val;
    for (size_t j = (i + 1) & mask; m->cells[j].key != NULL; j = (j + 1) & mask) {
        size_t k = m->cells[j].hash & mask;
        if (pie_map_cyc_between(k, i, j)) {
            m->cells[i] = m->cells[j];
            i = j;
        }
    }
    m->cells[i].key = NULL;
    m->cells[i].val = NULL;
    m->n--;
    return val;
}

void ctl_mapstr_free(ctl_mapstr *m) {
    free(m->cells);
    memset(m, 0, sizeof *m);
}
