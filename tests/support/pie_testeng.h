/* pie_testeng.h — driving the engine (eng.h) in the test process: forward items over paged
 * sequences, and the mixed workload whose outputs the memory-policy tests compare with policy
 * gpu bit for bit (tests/unit/test_eng_swap.c, tests/unit/test_eng_offload.c).
 *
 * Owns: pie_test_item (an item over a sequence's pages, its page count and last page's fill
 * derived from the sequence length), consecutive slot ids, a forward that must succeed, and
 * the workload: its sequences, steps and recorded outputs (logits and top-8 distributions).
 * Does not own: the engines (each test opens its own, with the policy under test) or what a
 * test notes between steps (its step callback). */
#ifndef PIE_TESTENG_H
#define PIE_TESTENG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"

/* An item over `pages` (page_size tokens each) that hold seq_len tokens, the appended inputs
 * included when append; in/out slots as given. */
eng_forward_item pie_test_item(uint32_t page_size, const uint32_t *pages, uint32_t seq_len,
                               bool append, const uint32_t *in, uint32_t n_in, const uint32_t *out,
                               uint32_t n_out);

/* Consecutive ids first..first+n-1 into buf; returns buf. */
const uint32_t *pie_test_range(uint32_t *buf, uint32_t first, uint32_t n);

/* eng_forward that must succeed (asserts, with the engine's message). */
void pie_test_forward_ok(eng *e, const eng_forward_item *items, uint32_t n);

/* ---- the mixed workload -------------------------------------------------------------------- */

/* The engine the workload runs on (pie_testwork_opts): small-f32 (4 layers), pages of
 * PIE_TESTWORK_PAGE tokens, PIE_TESTWORK_PAGES of them (the workload uses ids 0-10), 256 embed
 * slots (it uses 0-167). */
#define PIE_TESTWORK_MODEL   "small-f32"
#define PIE_TESTWORK_PAGE    16
#define PIE_TESTWORK_PAGES   24
#define PIE_TESTWORK_MAX_OUT 20

/* What one run produced: the logits and top-8 distribution of every recorded output. */
typedef struct pie_testwork_out {
    uint32_t vocab;
    float *logits; /* [PIE_TESTWORK_MAX_OUT][vocab] */
    uint32_t ids[PIE_TESTWORK_MAX_OUT][8];
    float probs[PIE_TESTWORK_MAX_OUT][8];
    uint32_t n;
} pie_testwork_out;

/* Called after each of the workload's steps with the step's number (0, 1, ...). */
typedef void (*pie_testwork_step_fn)(eng *e, uint32_t step, void *user);

/* The options of that engine without a memory policy (policy gpu), 2 threads, batches of up to
 * 128 tokens; dir (cap bytes) receives the model's path, which the options point to. */
eng_opts pie_testwork_opts(char *dir, size_t cap);

/* *r ← no outputs, room for PIE_TESTWORK_MAX_OUT of e's vocabulary (free r->logits). */
void pie_testwork_out_init(pie_testwork_out *r, eng *e);

/* Slots slot0.. ← tokens of sequence seq at indices [from, from + n), positions the same
 * (at most 128; asserts). */
void pie_testwork_embed(eng *e, uint32_t slot0, uint32_t seq, uint32_t from, uint32_t n);

/* Records slot's logits and top-8 distribution (temperature 1) as output r->n. */
void pie_testwork_record(eng *e, pie_testwork_out *r, uint32_t slot);

/* Sequence A in pages 0-2, B in 3-4, C in 5: prefill, decode steps, a mixed batch (A decodes,
 * C runs 3 drafted tokens as a tree without appending, D prefills into pages 6-7), a page
 * mask, page copies, pages 6-7 reused after clear_pages, decodes of B's copy; 13 outputs. With
 * fork, then a fork of A sharing A's first page and its own page 10 prefills and decodes in
 * one batch with A; 16 outputs. step (NULL: none) runs after every step. */
void pie_testwork_run(eng *e, pie_testwork_out *r, bool fork, pie_testwork_step_fn step,
                      void *user);

/* Number of outputs whose logits or distribution differ from the reference's (asserts that
 * both recorded as many). */
uint32_t pie_testwork_n_differing(const pie_testwork_out *a, const pie_testwork_out *ref);

#endif
