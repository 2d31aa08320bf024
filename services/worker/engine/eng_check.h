/* eng_check.h — the engine's argument validation, shared by its cpu and cuda backends
 * (engine-internal).
 *
 * Owns: every check a handler of eng.h makes before touching state, with its exact message
 * (listed below, asserted by tests/unit/test_eng.c and tests/cuda/test_eng_cuda.c): eng_open's
 * options and model shape, embed_text, forward (and the per-item plan it produces), mask_page,
 * copy_pages, next_dist, logits and slot_position; the validation marks that find repeated
 * pages, outputs and written positions in O(1) per id without clearing anything between
 * calls (a fresh generation number per check), allocated once at open.
 * Does not own: the rules every layer shares and their messages (services/common/pie_check.h:
 * ranges, forward's counts, masks, copies, temperatures), anything a backend does after
 * validation, a backend's own capacities beyond the two totals eng_check_set_caps names (cuda).
 *
 * Errors the caller can cause (all PIE_INVALID_ARGUMENT unless noted; <i> = item index). The
 * shared rules' messages are pie_check.h's, under the prefix "<handler>: item <i>: ":
 *   eng_open: "eng_open: opts, out and opts->model_dir must not be NULL" (each backend's),
 *     "eng_open: kv_page_size N is out of range [1, 65536]",
 *     "eng_open: max_batch_tokens N is out of range [1, 1048576]",
 *     "eng_open: embed_slots N is out of range [1, 16777216]",
 *     "eng_open: kv_pages N x kv_page_size M exceeds 2^30 tokens",
 *     "eng_open: <dir>: head_dim N must be even and n_kv_heads M must divide n_heads H",
 *     "eng_open: cannot allocate the page masks and marks of N pages" (RESOURCE_EXHAUSTED);
 *     the backends add their own (eng_cpu.c, eng_cuda.h) and mdl_open's (model/mdl.h).
 *   embed_text: "embed_text: slots, tokens and positions must not be NULL",
 *     "embed_text: item <i>: slot N is out of range [0, S)" (and token [0, V), position [0, P)).
 *   forward: "forward: items is NULL", "forward: item <i>: kv_pages is NULL",
 *     pie_check_forward's under the names in_slots, out_slots, kv_pages, kv_last_page_len
 *     ("forward: item <i>: in_slots is empty",
 *     "forward: item <i>: kv_last_page_len N must be 0 when kv_pages is empty",
 *     "forward: item <i>: kv_last_page_len N is out of range [1, P]",
 *     "forward: item <i>: out_slots has N entries, more than the M of in_slots"),
 *     "forward: item <i>: kv_pages[j] = N is out of range [0, K)",
 *     "forward: item <i>: kv page N appears twice (kv_pages[a] and kv_pages[b])",
 *     "forward: item <i>: in_slots is NULL", "forward: item <i>: out_slots is NULL",
 *     "forward: item <i>: the batch reaches N input tokens, more than max_batch_tokens M",
 *     "forward: item <i>: in_slots[j] = N is out of range [0, S)" (and out_slots),
 *     "forward: item <i>: out_slots[j] = N is also an output of item <k>",
 *     "forward: item <i>: append_kv with n_in N but kv_pages hold only M tokens",
 *     "forward: item <i>: input j writes kv page N offset M, as does item <k>",
 *     "forward: item <i>: in_slots[j] = N is an output of item <k>",
 *     "forward: item <i>: mask_runs is NULL with n_mask_runs N", and pie_check_mask's
 *     messages; with caps set (cuda), RESOURCE_EXHAUSTED "forward: item <i>: the batch lists N
 *     kv pages in all, more than this cuda engine's M" and "forward: item <i>: the batch's
 *     attention masks have N runs in all, more than this cuda engine's M".
 *   mask_page: "mask_page: masked is NULL", "mask_page: page N is out of range [0, K)".
 *   copy_pages: "copy_pages: items is NULL", "copy_pages: item <i>: src N is out of range
 *     [0, K)" (and dst), then pie_check_copy's ("copy_pages: item <i>: token_count 0 is out of
 *     range [1, P]", "copy_pages: item <i>: src_offset N + token_count M exceeds kv_page_size
 *     P" (and dst_offset), "copy_pages: item <i>: source [a, b) and destination [c, d) overlap
 *     in kv page N").
 *   next_dist: "next_dist: items is NULL", "next_dist: item <i>: slot N is out of range [0, S)",
 *     "next_dist: item <i>: top_k N is out of range [1, V]" (V: the backend's top_k_max),
 *     "next_dist: item <i>: temperature X is not a finite number > 0",
 *     "next_dist: item <i>: ids and probs must not be NULL".
 *   logits / slot_position: "logits: slot N is out of range [0, S)", "logits: logits is NULL",
 *     "slot_position: slot N is out of range [0, S)", "slot_position: pos is NULL".
 *   clear_pages / clear_embeds: "clear_pages: pages is NULL", "clear_pages: item <i>: page N is
 *     out of range [0, K)", "clear_embeds: slots is NULL", "clear_embeds: item <i>: slot N is
 *     out of range [0, S)". */
#ifndef ENG_CHECK_H
#define ENG_CHECK_H

#include <stdbool.h>
#include <stdint.h>

#include "eng.h"
#include "mdl.h"

/* eng_opts with its defaults applied, in range. */
typedef struct eng_check_dims {
    uint32_t page_size, pages, slots, batch_tokens;
} eng_check_dims;

/* Applies eng_opts' defaults and checks the ranges (not the NULL pointers, not the backend). */
pie_code eng_check_opts(const eng_opts *o, eng_check_dims *d, pie_status *st);

/* The model shape every backend needs: even head_dim, n_kv_heads dividing n_heads. */
pie_code eng_check_model(const mdl_config *c, const char *dir, pie_status *st);

/* eng_info of model m with pools of dims d (the pool byte counts are the backend's to set). */
void eng_check_fill_info(eng_info *in, const mdl_model *m, const eng_check_dims *d);

/* Validation stamp: which check generation last touched an id, and who (an index). */
typedef struct eng_check_mark {
    uint32_t gen, who;
} eng_check_mark;

/* One forward item after validation. */
typedef struct eng_check_plan {
    uint32_t first;  /* its first row in the batch */
    uint32_t ctx;    /* C: tokens before the inputs */
    uint32_t pages;  /* offset of its page list in the batch's page lists, in item order */
    bool ctx_masked; /* a page mask hides a token among its context (C) */
} eng_check_plan;

/* What forward's checks keep between calls. Sized at open; checks allocate nothing. */
typedef struct eng_check_state {
    const eng_info *info;      /* the engine's (borrowed): the limits checked against */
    eng_check_mark *slot_mark; /* [embed_slots] */
    eng_check_mark *page_mark; /* [kv_pages], who = index in the item's kv_pages */
    eng_check_mark *tok_mark;  /* [kv_pages * kv_page_size] */
    eng_check_plan *plan;      /* [max_batch_tokens] (items <= tokens) */
    uint32_t gen;
    /* batch totals of page-list entries and mask runs (cuda's tables); UINT64_MAX: none */
    uint64_t page_cap, runs_cap;
    const char *backend; /* names the engine in the capacity messages */
} eng_check_state;

/* Allocates the marks and plans for info (which must outlive c). On failure
 * "eng_open: cannot allocate the page masks and marks of N pages" (RESOURCE_EXHAUSTED) and c
 * holds nothing to free beyond what eng_check_free releases. */
pie_code eng_check_init(eng_check_state *c, const eng_info *info, pie_status *st);
void eng_check_free(eng_check_state *c);

/* Bytes eng_check_init allocated (reported with the scratch). */
size_t eng_check_bytes(const eng_check_state *c);

/* Forward refuses (RESOURCE_EXHAUSTED) batches whose page lists or mask runs sum past these. */
void eng_check_set_caps(eng_check_state *c, const char *backend, uint64_t page_cap,
                        uint64_t runs_cap);

/* The handlers' checks: PIE_OK or PIE_INVALID_ARGUMENT with a message listed above. n == 0 is
 * valid whatever the pointers. */
pie_code eng_check_embed(const eng_info *in, const uint32_t *slots, const uint32_t *tokens,
                         const uint32_t *positions, uint32_t n, pie_status *st);

/* Checks every item and fills c->plan[0, n) (ctx_masked from the page masks' per-page masked
 * counts); *total gets the batch's input tokens. */
pie_code eng_check_forward(eng_check_state *c, const eng_forward_item *items, uint32_t n,
                           const uint32_t *page_n_masked, uint32_t *total, pie_status *st);

pie_code eng_check_mask_page(const eng_info *in, uint32_t page, const bool *masked, pie_status *st);
pie_code eng_check_copy(const eng_info *in, const eng_copy_item *items, uint32_t n, pie_status *st);

/* top_k_max: the largest top_k the backend serves (at most the vocabulary). */
pie_code eng_check_dist(const eng_info *in, const eng_dist_item *items, uint32_t n,
                        uint32_t top_k_max, pie_status *st);

/* clear_pages (pages, against kv_pages) or clear_embeds (!pages, against embed_slots): every id
 * in range. */
pie_code eng_check_clear(const eng_info *in, bool pages, const uint32_t *ids, uint32_t n,
                         pie_status *st);

/* logits / slot_position: slot in range, then out (named out_name) not NULL; the messages
 * start with handler. */
pie_code eng_check_slot_out(const eng_info *in, const char *handler, uint32_t slot, const void *out,
                            const char *out_name, pie_status *st);

/* One past the highest page id checked items read or write (forward: every item's pages,
 * appending or not; copies: sources and destinations): the swap policy moves only that prefix
 * of every layer's cache and, on a device committed as it is used, has memory only there, so
 * the backends raise it first (wrk_tier_touch). */
uint32_t eng_check_kv_top_forward(const eng_forward_item *items, uint32_t n);
uint32_t eng_check_kv_top_copies(const eng_copy_item *items, uint32_t n);

#endif
