/* wrk_backend.h — the compute behind the worker's executor: the engine (cpu backend) or the
 * benchmark-only null backend, behind one table of functions with eng.h's signatures.
 *
 * Owns: the null backend (every handler succeeds at once; next_dist returns token ids
 * 0..k-1 with a fixed descending distribution) and the adapter that calls the engine.
 * Does not own: validation against capacities and slot liveness (wrk_exec.c checks that
 * before any backend call), the engine itself (engine/eng.h). */
#ifndef WRK_BACKEND_H
#define WRK_BACKEND_H

#include <stdbool.h>
#include <stdint.h>

#include "eng.h"
#include "pie_status.h"

typedef struct wrk_backend {
    const char *name; /* "cpu", "null" */
    void *ctx;        /* the eng for "cpu"; NULL for "null" */
    pie_code (*embed_text)(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                           const uint32_t *positions, uint32_t n, pie_status *st);
    pie_code (*forward)(void *ctx, const eng_forward_item *items, uint32_t n, pie_status *st);
    pie_code (*mask_page)(void *ctx, uint32_t page, const bool *masked, pie_status *st);
    pie_code (*copy_pages)(void *ctx, const eng_copy_item *items, uint32_t n, pie_status *st);
    pie_code (*next_dist)(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st);
} wrk_backend;

/* Handlers that call e (borrowed; it must outlive every use of *b). */
void wrk_backend_engine(wrk_backend *b, eng *e);

/* The null backend. */
void wrk_backend_null(wrk_backend *b);

#endif
