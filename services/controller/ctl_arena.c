/* ctl_arena.c — see ctl_arena.h. */
#include "ctl_arena.h"

#include <stdlib.h>
#include <string.h>

#define ARENA_MIN_CHUNK (16u * 1024u)

struct ctl_arena_chunk {
    ctl_arena_chunk *next;
    size_t size; /* bytes of data[] */
    _Alignas(16) unsigned char data[];
};

static size_t align16(size_t n) { return (n + 15u) & ~(size_t)15u; }

void *ctl_arena_alloc(ctl_arena *a, size_t n) {
    n = align16(n ? n : 1);
    if (a->cur && a->used + n <= a->cur->size) {
        void *p = a->cur->data + a->used;
        a->used += n;
        return p;
    }
    /* The next kept chunk (used before the last reset), if it fits; else a new one, twice the
     * size of the current, inserted after it. */
    ctl_arena_chunk *c = a->cur ? a->cur->next : a->chunks;
    if (c == NULL || c->size < n) {
        size_t size = a->cur ? a->cur->size * 2 : ARENA_MIN_CHUNK;
        if (size < n) size = n;
        c = malloc(sizeof *c + size);
        if (c == NULL) return NULL;
        c->size = size;
        if (a->cur) {
            c->next = a->cur->next;
            a->cur->next = c;
        } else {
            c->next = a->chunks;
            a->chunks = c;
        }
    }
    a->cur = c;
    a->used = n;
    return c->data;
}

void *ctl_arena_zalloc(ctl_arena *a, size_t n) {
    void *p = ctl_arena_alloc(a, n);
    if (p) memset(p, 0, n ? n : 1);
    return p;
}

char *ctl_arena_strdup(ctl_arena *a, const char *s) {
    if (s == NULL) s = "";
    size_t n = strlen(s) + 1;
    char *p = ctl_arena_alloc(a, n);
    if (p) memcpy(p, s, n);
    return p;
}

void ctl_arena_reset(ctl_arena *a) {
    a->cur = NULL;
    a->used = 0;
}

void ctl_arena_free(ctl_arena *a) {
    ctl_arena_chunk *c = a->chunks;
    while (c) {
        ctl_arena_chunk *n = c->next;
        free(c);
        c = n;
    }
    memset(a, 0, sizeof *a);
}

/* ---- slab ---------------------------------------------------------------------------------- */

void ctl_slab_init(ctl_slab *s, size_t size, size_t per_block) {
    memset(s, 0, sizeof *s);
    size_t al = sizeof(void *) > 8 ? sizeof(void *) : 8;
    if (size < sizeof(void *)) size = sizeof(void *);
    s->size = (size + al - 1) / al * al;
    s->per_block = per_block ? per_block : 64;
}

void *ctl_slab_get(ctl_slab *s) {
    if (s->free == NULL) {
        if (s->n_blocks == s->cap_blocks) {
            size_t cap = s->cap_blocks ? s->cap_blocks * 2 : 8;
            void **b = realloc(s->blocks, cap * sizeof *b);
            if (b == NULL) return NULL;
            s->blocks = b;
            s->cap_blocks = cap;
        }
        unsigned char *blk = calloc(s->per_block, s->size); /* zeroed: see ctl_slab_get */
        if (blk == NULL) return NULL;
        s->blocks[s->n_blocks++] = blk;
        for (size_t i = s->per_block; i-- > 0;) {
            void *obj = blk + i * s->size;
            *(void **)obj = s->free;
            s->free = obj;
        }
    }
    void *p = s->free;
    s->free = *(void **)p;
    s->live++;
    return p;
}

void ctl_slab_put(ctl_slab *s, void *p) {
    if (p == NULL) return;
    *(void **)p = s->free;
    s->free = p;
    s->live--;
}

void ctl_slab_free_each(ctl_slab *s, void (*fn)(void *obj)) {
    for (void *p = s->free; p; p = *(void **)p) fn(p);
    ctl_slab_free(s);
}

void ctl_slab_free(ctl_slab *s) {
    for (size_t i = 0; i < s->n_blocks; i++) free(s->blocks[i]);
    free(s->blocks);
    size_t size = s->size, per = s->per_block;
    memset(s, 0, sizeof *s);
    s->size = size;
    s->per_block = per;
}

/* ---- vectors ------------------------------------------------------------------------------- */

int ctl_vec32_reserve(ctl_vec32 *v, uint32_t n) {
    if (n <= v->cap) return 0;
    uint32_t cap = v->cap ? v->cap : 16;
    while (cap < n) {
        if (cap > UINT32_MAX / 2) return -1;
        cap *= 2;
    }
    uint32_t *p = realloc(v->v, (size_t)cap * sizeof *p);
    if (p == NULL) return -1;
    v->v = p;
    v->cap = cap;
    return 0;
}

int ctl_vec32_push(ctl_vec32 *v, uint32_t x) {
    if (v->n == v->cap && ctl_vec32_reserve(v, v->n + 1) != 0) return -1;
    v->v[v->n++] = x;
    return 0;
}

void ctl_vec32_free(ctl_vec32 *v) {
    free(v->v);
    memset(v, 0, sizeof *v);
}

int ctl_vecp_reserve(ctl_vecp *v, size_t n) {
    if (n <= v->cap) return 0;
    size_t cap = v->cap ? v->cap : 16;
    while (cap < n) cap *= 2;
    void **p = realloc(v->v, cap * sizeof *p);
    if (p == NULL) return -1;
    v->v = p;
    v->cap = cap;
    return 0;
}

int ctl_vecp_push(ctl_vecp *v, void *p) {
    if (v->n == v->cap && ctl_vecp_reserve(v, v->n + 1) != 0) return -1;
    v->v[v->n++] = p;
    return 0;
}

void ctl_vecp_free(ctl_vecp *v) {
    free(v->v);
    memset(v, 0, sizeof *v);
}
