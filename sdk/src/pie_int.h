/* pie_int.h — declarations shared by the SDK's source files, not part of the public interface.
 *
 * Owns: the KV page table (reference counts of pages held by several contexts, and which pages
 * are pinned read-only because they were exported or imported), address conversion for the
 * ABI, and the output helpers the generation loops share.
 * Does not own: anything an inferlet author calls (pie.h). */
#ifndef PIE_INT_H
#define PIE_INT_H

#include "pie.h"

/* Linear-memory address of p, as the ABI's descriptors carry it (wasm32: pointers are 32-bit). */
#define PIE_ADDR(p) ((uint32_t)(uintptr_t)(p))

/* ---- checked futures (pie_core.c) ----------------------------------------------------------
 * Calls without a result report a failure only through a later synchronize of their queue.
 * A result that depends on them (next_dist after forward) is armed right after a synchronize
 * of its queue; pie_future_take[_try] takes that synchronize first, so an earlier failure is
 * the result's failure instead of a result computed from garbage; pie_future_discard drops
 * both. */
void pie_future_set_check(uint32_t f, uint32_t sync_f);

/* ---- page table (pie_res.c) ----------------------------------------------------------------
 * Every KV page allocated through the SDK has an entry: holders (contexts referencing it) and
 * pinned (exported or imported: read-only for good). A page is writable when exactly one
 * holder has it and it is not pinned. */
void pie_page_track(uint32_t id);              /* new page, one holder */
void pie_page_ref(uint32_t id);                /* one more holder */
uint32_t pie_page_unref(uint32_t id);          /* one holder less; returns holders left */
void pie_page_pin(uint32_t id);
bool pie_page_writable(uint32_t id);
uint32_t pie_page_holders(uint32_t id);
void pie_page_untrack(uint32_t id);

/* ---- context internals used by the generation loops (pie_ctx.c) ---------------------------- */
void pie_ctx_push_token(pie_ctx *c, uint32_t t); /* append one pending token */
uint32_t pie_ctx_page_size(const pie_ctx *c);

/* ---- sampling (pie_sample.c) ---------------------------------------------------------------- */
/* A candidate a sampler may draw: its index in the distribution and its probability of being
 * drawn. */
typedef struct pie_cand {
    uint32_t i; /* index into d->ids / d->probs */
    double p;   /* over the kept candidates these sum to 1 */
} pie_cand;
/* A prefix whose mass is within this of top_p reaches it: probabilities and top_p are floats,
 * so a prefix meant to hold exactly top_p may come out a rounding error short. */
#define PIE_TOP_P_SLACK 1e-6
/* The candidates s (temperature > 0) draws from d, most likely first: d's entries with
 * probability > 0 ordered by probability descending (equal ones by index), cut to the top_k
 * first, tempered (p^(1/T) renormalised: softmax(logits / T) over them), then cut to the
 * smallest prefix whose tempered mass reaches top_p. c has room for d->k entries; returns how
 * many it filled (0: no entry has probability > 0). */
uint32_t pie_sample_keep(const pie_sampler *s, const pie_dist *d, pie_cand *c);

/* ---- output (pie_gen.c) --------------------------------------------------------------------- */
/* Starts o for model m if it was not started. */
void pie_output_start(pie_output *o, const pie_model *m);
/* Records generated token t and its text; true when a stop string now ends the text. */
bool pie_output_push(pie_output *o, const pie_stop *stop, uint32_t t);
/* Passes held-back text on (end of generation). */
void pie_output_finish(pie_output *o, const pie_stop *stop);
/* Whether t ends generation under stop (model stop tokens unless ignored, extra ones). */
bool pie_stop_is_token(const pie_stop *stop, const pie_model *m, uint32_t t);

#endif
