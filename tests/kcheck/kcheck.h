/* kcheck.h — checks that fail when a kernel or an engine is wrong, shared by the tests of every
 * backend: the CPU backend's (tests/unit/test_kcheck.c, run in CI) and the cuda backend's
 * (tests/cuda, run where there is a GPU) feed the same cases to the same comparisons.
 *
 * Owns:
 *  - the sharpened attention case (kc_attn_*): paged sequences whose every key that must stay
 *    hidden (beyond causality, page- or run-masked for every row, pool tokens no sequence owns)
 *    scores far above everything else and carries V = 1000, and whose visible "marker" keys (one
 *    per 32 keys, the first and last of the context and of the tail, each row's own token) share
 *    the softmax (half of the per-32 ones score 1 lower, so the scale of the scores matters).
 *    A leaked hidden key moves an output by hundreds; a dropped marker, a lost split chunk or a
 *    wrong causal limit moves it by about 1 / (markers seen) ≈ 0.02 or more; the tolerance is
 *    3e-3 · max|V| over the keys a row may see (≈ 1). Keys and queries are exactly
 *    representable in bf16, so a bf16 KV cache holds the same numbers as an f32 one;
 *  - the next-token distribution semantics every backend implements, with its edges (+inf,
 *    NaN and underflowed logits, tiny temperatures), a reference written from them, edge-case
 *    rows, and the comparison of a top-k against it (kc_dist_*);
 *  - engine-level checks (kc_eng_*): logits within a relative tolerance, a tolerance shown to be
 *    tight enough (the difference a mask makes must exceed 5x it), top-1 with a near-tie margin,
 *    bitwise equality, and the scenarios that produce the logits through any engine.
 * Every check returns whether it passed and says why not in a buffer; none asserts, so a test
 * can also require that a deliberately broken variant fails it.
 * Does not own: running kernels or engines (each test does, through its backend's API). */
#ifndef KCHECK_H
#define KCHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "eng.h"

/* ---- sharpened attention ----------------------------------------------------------------- */

#define KC_ATTN_SEQS   5
#define KC_ATTN_RTOL   3e-3 /* of max|V| over the keys a row may see */
#define KC_ATTN_HIDDEN 1000.0f

/* One sequence of the case: keys are its first n_ctx tokens (from its pages) then n_tail
 * tokens (tail rows of kt/vt: inputs attended to without being stored). Row r of its n_q
 * query rows is batch row q_row + r, sits at sequence index q_seq + r and sees keys
 * t <= q_seq + r, further limited by its explicit mask (row_runs[q_row + r] >= 0: the
 * pie.v1.AttentionMask runs starting there, covering q_seq + r + 1 tokens) and, for t < pm_ctx,
 * by the page masks. */
typedef struct kc_attn_seq {
    const char *name;
    int n_ctx, n_tail, n_q, q_seq, pm_ctx;
    int q_row, tail_row; /* first batch row of its queries / of its tail */
    int page0, n_pages;  /* its page list: pages[page0 .. page0 + n_pages) */
    bool runs;           /* has an explicit mask */
} kc_attn_seq;

typedef struct kc_attn_case {
    int n_heads, n_kv_heads, head_dim, page_size, pool_pages;
    int n_seqs;
    kc_attn_seq seq[KC_ATTN_SEQS];
    int rows;        /* query rows of all sequences */
    float scale;     /* 1 / sqrt(head_dim) */
    float *q;        /* [rows][n_heads * head_dim] */
    float *kv;       /* [pool_pages][2][page_size][n_kv_heads * head_dim], K then V */
    float *kt, *vt;  /* [rows][n_kv_heads * head_dim]: tails */
    uint32_t *pages; /* every sequence's page list, concatenated: n_page_list entries */
    int n_page_list;
    uint8_t *page_mask; /* [pool_pages * page_size], 1 = masked */
    uint32_t *runs;     /* explicit masks' runs, concatenated */
    int n_runs;
    int32_t *row_runs; /* [rows]: where row's runs start in runs, -1: causal */
} kc_attn_case;

/* Builds the case for head_dim (any value 16..256 that is a multiple of 16): 8 query heads over
 * 2 KV heads, pages of 16 tokens handed out in a scrambled order, five sequences — "append"
 * (20 rows appended after 700 context tokens, page masks), "decode+tail" (2 rows attending to
 * themselves after 1000 context tokens, page masks), "tree" (3 rows with an explicit mask that
 * hides 5 context tokens from every row and each row's sibling), "long" (one row over 1500
 * tokens: split-KV territory), "empty" (one row, no context). seed varies the random values.
 * Returns false (why set) when memory runs out. */
bool kc_attn_build(kc_attn_case *c, int head_dim, uint64_t seed, char *why, size_t cap);
void kc_attn_free(kc_attn_case *c);

/* The near-uniform variant of a built case: q, K and V (pages and tails) uniform in [-1, 1] and
 * bf16-exact. Softmax is then close to uniform, so it checks every key's arithmetic (scores,
 * scale, weighted sum) with kc_attn_check at a tolerance of 1e-2, but it cannot see a dropped
 * or leaked key (tests/unit/test_kcheck.c shows that). */
void kc_attn_randomize(kc_attn_case *c, uint64_t seed);

/* The parts of visibility, decoded independently of every kernel: the explicit mask's verdict
 * on key t for row r (true without a mask; false beyond the q_seq + r + 1 tokens the row's runs
 * cover), whether t is a page-masked context token, and all of it (causality included). */
bool kc_attn_run_visible(const kc_attn_case *c, int s, int r, int t);
bool kc_attn_page_masked(const kc_attn_case *c, int s, int t);
bool kc_attn_visible(const kc_attn_case *c, int s, int r, int t);

/* Dense mask of sequence s for krn_cpu_attention: [n_q][n_ctx + n_tail], 1 = visible. */
void kc_attn_dense_mask(const kc_attn_case *c, int s, uint8_t *mask);

/* The key chunk that splits the longest sequence into n_splits pieces (a multiple of 32). */
int kc_attn_chunk(const kc_attn_case *c, int n_splits);

/* Compares out ([rows][n_heads * head_dim], every sequence's rows) with a float64 reference;
 * each element within rtol · max|V| over the keys its row and head may see. */
bool kc_attn_check(const kc_attn_case *c, const float *out, double rtol, char *why, size_t cap);

/* ---- next-token distributions ------------------------------------------------------------ */

/* The semantics (eng.h next_dist; krn_cpu_softmax + krn_cpu_topk; krn_cuda_topk), written here
 * once: probabilities of softmax(logits / T) in f32, where NaN logits are left out (their
 * probability is NaN); when T is not > 0, 1/T overflows, or the largest number is infinite, all
 * mass goes to the first largest number (the others 0, NaN stays NaN; every logit NaN: every
 * probability NaN). The top k are in descending probability, NaN after every number, equal
 * probabilities (underflowed zeros included) by lower id. p[n] ← the probabilities. */
void kc_dist_reference(const float *logits, uint32_t n, float temperature, float *p);

/* Whether ids / probs [k] are the top k of that distribution: each rank holds a token whose
 * reference probability is within rtol of the reference's at that rank (near ties may swap),
 * exact ties (equal logits, or probability 0) are in id order, NaN only after every number,
 * no id twice; each probability within rtol of the reference. */
bool kc_dist_check(const float *logits, uint32_t n, float temperature, uint32_t k,
                   const uint32_t *ids, const float *probs, double rtol, char *why, size_t cap);

/* Edge-case rows: which < KC_DIST_EDGES fills logits[*n] (n <= KC_DIST_EDGE_MAX_N), its
 * temperature and k (k <= 1024, k <= n) and names it. */
#define KC_DIST_EDGES      8
#define KC_DIST_EDGE_MAX_N 128256u
const char *kc_dist_edge(int which, float *logits, uint32_t *n, float *temperature, uint32_t *k);

/* ---- engines ----------------------------------------------------------------------------- */

/* The handlers a scenario needs, with eng.h's signatures (the cpu engine's, or eng_cuda's). */
typedef struct kc_engine {
    void *ctx;
    pie_code (*embed_text)(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                           const uint32_t *positions, uint32_t n, pie_status *st);
    pie_code (*forward)(void *ctx, const eng_forward_item *items, uint32_t n, pie_status *st);
    pie_code (*mask_page)(void *ctx, uint32_t page, const bool *masked, pie_status *st);
    pie_code (*logits)(void *ctx, uint32_t slot, float *logits, pie_status *st);
    uint32_t vocab, page_size;
} kc_engine;

/* Logit tolerances of the cuda backend against the cpu backend (kc_rel_diff): bf16 weights,
 * KV and matrix-product inputs against f32 KV; f32 checkpoints are rounded to bf16 as well. */
#define KC_ENG_TOL_BF16 3e-2
#define KC_ENG_TOL_F32  6e-2

/* The cpu engine behind a kc_engine. */
kc_engine kc_engine_cpu(eng *e);

/* max |a - b| / max |b| over n values (b the reference). */
double kc_rel_diff(const float *a, const float *b, uint32_t n);

/* got within tol (kc_rel_diff) of want. */
bool kc_eng_agree(const float *got, const float *want, uint32_t n, double tol, const char *what,
                  char *why, size_t cap);

/* The tolerance can see a mask: the reference's logits with and without it differ by at least
 * factor x tol (so an engine that ignored the mask would fail kc_eng_agree by that factor). */
bool kc_eng_mask_visible(const float *with, const float *without, uint32_t n, double tol,
                         double factor, const char *what, char *why, size_t cap);

/* got_id may be want's top-1: its reference logit is within 2 · abs_err of the largest (each
 * logit may be off by abs_err, so closer candidates are a near tie either way). */
bool kc_eng_top1(const float *want_logits, uint32_t n, uint32_t got_id, double abs_err,
                 const char *what, char *why, size_t cap);

/* a and b bitwise equal (determinism). */
bool kc_eng_bitwise(const float *a, const float *b, uint32_t n, const char *what, char *why,
                    size_t cap);

/* The mask scenario: a 48-token context in pages 0-2 (append, every position its index), then
 * one input (position 48, append_kv false) attended four ways, each into its own output slot:
 * [0] with an explicit mask hiding context tokens 8..39, [1] causal, [2] with page masks hiding
 * the same tokens (the pages are unmasked again after), [3] with an explicit mask hiding one
 * token (20). logits[4][vocab] ← the four outputs' logits. Needs kv_pages >= 3,
 * embed_slots >= 64, max_batch_tokens >= 48. */
#define KC_MASK_CASES 4
bool kc_eng_mask_scenario(const kc_engine *e, float *logits, char *why, size_t cap);

/* The decode scenario: n_seqs sequences (sequence b in pages [b * per, (b + 1) * per) with
 * per = ceil((ctx + steps) / page_size), tokens depending on b) prefilled with ctx tokens, then
 * `steps` decode steps of all of them in one batch. logits[n_seqs][vocab] ← the last step's.
 * Needs kv_pages >= n_seqs * per, embed_slots >= 2 * n_seqs + ctx, max_batch_tokens >= ctx. */
bool kc_eng_decode_scenario(const kc_engine *e, uint32_t n_seqs, uint32_t ctx, uint32_t steps,
                            float *logits, char *why, size_t cap);

#endif
