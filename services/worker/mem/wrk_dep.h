/* wrk_dep.h — what a step's deferred items touch, and which later items of the step depend on
 * them (issue 13: offload's deferral, Neo §3.3, run by the worker's executor).
 *
 * When the load-aware scheduler defers a host decode (eng_forward_plan), the worker must not
 * run any later item of the same step whose outcome would differ had the deferred item run
 * first: the controller offers the deferred call again in a later step, after which it runs
 * before every later call of its queue, so an item that ran meanwhile must not have read what
 * the deferred one writes, nor written what it reads or writes. In this API an item's effects
 * are writes to KV pages (forward appends, mask_page, copy_page's destination) and embedding
 * slots (forward outputs, embed_text); its inputs are reads of pages (a forward's context,
 * copy_page's source) and slots (forward inputs, next_dist). Queues are ordered only through
 * those (different queues are unordered: docs/inferlet-abi.md), so slot-level hazards are the
 * whole dependency: a later item depends on the footprint when it reads a slot a deferred item
 * writes (read after write) or writes one a deferred item reads or writes (write after read,
 * write after write). A dependent is deferred in turn and joins the footprint, so chains are
 * followed in one pass over the step. Pages and slots, not token positions: coarser than
 * needed (a later item appending to a page a deferred one only reads is held back too), never
 * finer.
 *
 * Owns: the footprint (per KV page and embedding slot: read and/or written by something
 * deferred in this step) and the test. Does not own: which items the scheduler defers (the
 * engine), what an item accesses (the executor lists it), the wire. Not thread safe: the thread
 * that runs steps. */
#ifndef WRK_DEP_H
#define WRK_DEP_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_status.h"

#define WRK_DEP_READ  1u
#define WRK_DEP_WRITE 2u

/* The slots one item reads and writes (ids past the pools are ignored). */
typedef struct wrk_dep_access {
    const uint32_t *kv_read, *kv_write, *emb_read, *emb_write;
    uint32_t n_kv_read, n_kv_write, n_emb_read, n_emb_write;
} wrk_dep_access;

typedef struct wrk_dep {
    uint32_t kv_pages, embed_slots;
    uint8_t *kv, *emb;            /* [kv_pages], [embed_slots]: WRK_DEP_* bits */
    uint32_t *kv_list, *emb_list; /* the ids marked, each once (clearing costs what was marked) */
    uint32_t n_kv, n_emb;
} wrk_dep;

/* An empty footprint over pools of kv_pages pages and embed_slots slots. RESOURCE_EXHAUSTED
 * when the tables cannot be allocated. */
pie_code wrk_dep_init(wrk_dep *d, uint32_t kv_pages, uint32_t embed_slots, pie_status *st);
void wrk_dep_free(wrk_dep *d);

/* A new step: nothing deferred. */
void wrk_dep_clear(wrk_dep *d);

/* Nothing deferred in this step (no item can depend on anything). */
static inline bool wrk_dep_empty(const wrk_dep *d) { return d->n_kv == 0 && d->n_emb == 0; }

/* Whether an item with access a depends on what was deferred. */
bool wrk_dep_hits(const wrk_dep *d, const wrk_dep_access *a);

/* An item with access a is deferred: what it reads and writes joins the footprint. */
void wrk_dep_add(wrk_dep *d, const wrk_dep_access *a);

#endif
