/* pie_map64.c — see pie_map64.h. */
#include "pie_map64.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

static uint64_t h64(uint64_t x) { /* splitmix64 finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void *pie_map64_get(const pie_map64 *m, uint64_t key) {
    if (m->n == 0 || key == 0) return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = h64(key) & mask;; i = (i + 1) & mask) {
        if (m->cells[i].key == 0) return NULL;
        if (m->cells[i].key == key) return m->cells[i].val;
    }
}

static void put64_nogrow(pie_map64 *m, uint64_t key, void *val) {
    size_t mask = m->cap - 1;
    for (size_t i = h64(key) & mask;; i = (i + 1) & mask) {
        if (m->cells[i].key == 0) {
            m->cells[i].key = key;
            m->cells[i].val = val;
            m->n++;
            return;
        }
        if (m->cells[i].key == key) {
            m->cells[i].val = val;
            return;
        }
    }
}

int pie_map64_put(pie_map64 *m, uint64_t key, void *val) {
    size_t cap = pie_map_grown_cap(m->cap, m->n + 1);
    if (cap != m->cap) {
        pie_map64_cell *cells = calloc(cap, sizeof *cells);
        if (cells == NULL) return -1;
        pie_map64 old = *m;
        m->cells = cells;
        m->cap = cap;
        m->n = 0;
        for (size_t i = 0; i < old.cap; i++)
            if (old.cells[i].key) put64_nogrow(m, old.cells[i].key, old.cells[i].val);
        free(old.cells);
    }
    put64_nogrow(m, key, val);
    return 0;
}

void *pie_map64_del(pie_map64 *m, uint64_t key) {
    if (m->n == 0 || key == 0) return NULL;
    size_t mask = m->cap - 1;
    size_t i = h64(key) & mask;
    for (;; i = (i + 1) & mask) {
        if (m->cells[i].key == 0) return NULL;
        if (m->cells[i].key == key) break;
    }
    void *val = m->cells[i].val;
    for (size_t j = (i + 1) & mask; m->cells[j].key != 0; j = (j + 1) & mask) {
        size_t k = h64(m->cells[j].key) & mask;
        if (pie_map_cyc_between(k, i, j)) {
            m->cells[i] = m->cells[j];
            i = j;
        }
    }
    m->cells[i].key = 0;
    m->cells[i].val = NULL;
    m->n--;
    return val;
}

void pie_map64_free(pie_map64 *m) {
    free(m->cells);
    memset(m, 0, sizeof *m);
}
