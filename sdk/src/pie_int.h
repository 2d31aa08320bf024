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
