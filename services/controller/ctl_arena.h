/* ctl_arena.h — the controller's allocation helpers for its hot paths.
 *
 * Owns: ctl_arena, a bump allocator whose chunks are kept across resets (one per outgoing
 * message under construction: a scheduling step, a replica's results), ctl_slab, a free list of
 * fixed-size objects carved from blocks (call records, batch records), and ctl_vec32 / ctl_vecp,
 * growable arrays that keep their storage when cleared. After warm-up none of them touches
 * malloc. Does not own what is stored in them.
 *
 * A zeroed struct is an empty arena / vector; slabs need ctl_slab_init. Allocation failures
 * return NULL / -1. */
#ifndef CTL_ARENA_H
#define CTL_ARENA_H

#include <stddef.h>
#include <stdint.h>

typedef struct ctl_arena_chunk ctl_arena_chunk;

typedef struct ctl_arena {
    ctl_arena_chunk *chunks; /* all chunks, the current one first */
    ctl_arena_chunk *cur;
    size_t used; /* bytes used in cur */
} ctl_arena;

/* n bytes aligned to 16, uninitialised. */
void *ctl_arena_alloc(ctl_arena *a, size_t n);
/* n bytes aligned to 16, zeroed. */
void *ctl_arena_zalloc(ctl_arena *a, size_t n);
/* A copy of s (NULL → ""). */
char *ctl_arena_strdup(ctl_arena *a, const char *s);
/* Forgets every allocation; keeps the chunks. */
void ctl_arena_reset(ctl_arena *a);
void ctl_arena_free(ctl_arena *a);

typedef struct ctl_slab {
    size_t size;      /* object size, rounded up to pointer alignment */
    size_t per_block; /* objects per block */
    void *free;       /* free list threaded through the objects */
    void **blocks;
    size_t n_blocks, cap_blocks;
    size_t live; /* objects handed out */
} ctl_slab;

void ctl_slab_init(ctl_slab *s, size_t size, size_t per_block);
/* An object, or NULL. Objects never handed out before are zeroed; a recycled one keeps what it
 * held when put back, except its first pointer-sized bytes (the free-list link), so objects can
 * keep buffers across reuse. */
void *ctl_slab_get(ctl_slab *s);
void ctl_slab_put(ctl_slab *s, void *p); /* NULL is fine */
/* Frees every block (objects still handed out become invalid). */
void ctl_slab_free(ctl_slab *s);
/* Calls fn on every object in the free list (to free buffers they keep), then ctl_slab_free. */
void ctl_slab_free_each(ctl_slab *s, void (*fn)(void *obj));

typedef struct ctl_vec32 {
    uint32_t *v;
    uint32_t n, cap;
} ctl_vec32;

int ctl_vec32_reserve(ctl_vec32 *v, uint32_t n); /* room for n elements in all */
int ctl_vec32_push(ctl_vec32 *v, uint32_t x);
void ctl_vec32_free(ctl_vec32 *v);

typedef struct ctl_vecp {
    void **v;
    size_t n, cap;
} ctl_vecp;

int ctl_vecp_reserve(ctl_vecp *v, size_t n);
int ctl_vecp_push(ctl_vecp *v, void *p);
void ctl_vecp_free(ctl_vecp *v);

#endif
