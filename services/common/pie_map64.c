/* pie_map64.c — see pie_map64.h. */
#include "pie_map64.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "pie_map.h"

static uint64_t h64(uint64_t x) { /* splitmix64 finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static bool cell_used(const void *c) { return ((const pie_map64_cell *)c)->key != 0; }
static size_t cell_hash(const void *c) { return (size_t)h64(((const pie_map64_cell *)c)->key); }
static void cell_clear(void *c) { *(pie_map64_cell *)c = (pie_map64_cell){0}; }
static const pie_map_kind kind = {sizeof(pie_map64_cell), cell_used, cell_hash, cell_clear};

/* The cell holding key, or the free cell where it would go (the table is never full). */
static size_t find(const pie_map64 *m, uint64_t key) {
    size_t mask = m->cap - 1, i = h64(key) & mask;
    while (m->cells[i].key != 0 && m->cells[i].key != key) i = (i + 1) & mask;
    return i;
}

void *pie_map64_get(const pie_map64 *m, uint64_t key) {
    if (m->n == 0 || key == 0) return NULL;
    return m->cells[find(m, key)].val; /* a free cell's val is NULL */
}

int pie_map64_put(pie_map64 *m, uint64_t key, void *val) {
    pie_map64_cell *cells = pie_map_reserve(&kind, m->cells, &m->cap, m->n + 1);
    if (cells == NULL) return -1;
    m->cells = cells;
    pie_map64_cell *c = &cells[find(m, key)];
    if (c->key == 0) m->n++;
    *c = (pie_map64_cell){.key = key, .val = val};
    return 0;
}

void *pie_map64_del(pie_map64 *m, uint64_t key) {
    if (m->n == 0 || key == 0) return NULL;
    size_t i = find(m, key);
    void *val = m->cells[i].val;
    if (m->cells[i].key == 0) return NULL;
    pie_map_remove_at(&kind, m->cells, m->cap, i);
    m->n--;
    return val;
}

void pie_map64_free(pie_map64 *m) {
    free(m->cells);
    memset(m, 0, sizeof *m);
}
