/* pie_testref.h — reference next-token distributions for the tests that check what the system
 * computed over a context (KV pages kept across calls, shared, imported, moved between workers).
 *
 * The reference is a fresh forward of the whole context on the engine in this process: one
 * sequence, every token an input at its position, no KV page read or written. A lost prefix, a
 * wrong position or a stale page in the system under test changes its distributions but not
 * the reference's. Whole top-k distributions (ids and probabilities) are compared, not greedy
 * tokens: tiny-f32's argmax is the last token whatever came before it, so its greedy tokens
 * cannot see the context, while its probabilities do.
 *
 * Owns: the reference engine of a test (CPU, one thread) and the comparison rule.
 * Does not own: the system's distributions (each test collects them). */
#ifndef PIE_TESTREF_H
#define PIE_TESTREF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PIE_TESTREF_MAX_K   16
#define PIE_TESTREF_MAX_CTX 256
/* Absolute tolerance on a probability: f32 on the same kernels, with a different split of the
 * work (one prefill against a prefill plus decode steps), agrees to about 1e-6. */
#define PIE_TESTREF_TOL 1e-4f

/* A top-k next-token distribution, most likely first. */
typedef struct pie_testref_dist {
    uint32_t k;
    uint32_t ids[PIE_TESTREF_MAX_K];
    float probs[PIE_TESTREF_MAX_K];
} pie_testref_dist;

typedef struct pie_testref pie_testref;

/* The reference engine on the model in model_dir; asserts on failure. */
pie_testref *pie_testref_open(const char *model_dir);
void pie_testref_close(pie_testref *r);

/* *out ← the top-k distribution (temperature 1) of the token after tokens[0..n). */
void pie_testref_next(pie_testref *r, const uint32_t *tokens, size_t n, uint32_t k,
                      pie_testref_dist *out);

/* Whether got matches want within tol: the same k, and every id of either list has a
 * probability within tol in the other, or is absent from it with a probability within tol of
 * the other's smallest (it fell off the other's top-k by a rounding difference). why ← the
 * first difference. */
bool pie_testref_same(const pie_testref_dist *got, const pie_testref_dist *want, float tol,
                      char *why, size_t cap);

/* Asserts that a generation's distributions are the reference's: for every step s < n_gen,
 * got[s], the system's distribution after prompt + gen[0..s), matches the reference's after
 * the same tokens (PIE_TESTREF_TOL); the failure names label and the step. */
void pie_testref_expect_gen(pie_testref *r, const char *label, const uint32_t *prompt,
                            size_t n_prompt, const uint32_t *gen, const pie_testref_dist *got,
                            size_t n_gen);

#endif
