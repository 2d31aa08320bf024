/* eng_check.c — the engine's argument validation, shared by its cpu and cuda backends.
 *
 * Owns: the functions of eng_check.h: the rules every layer checks (pie_check.h) applied to
 * the engine's items, plus the engine's own (physical ranges, NULL pointers, conflicts within
 * a batch, capacities). Forward's checks use marks instead of clearing tables:
 * each check takes a fresh generation number and stamps the ids it sees with it, so "seen in
 * this check" is one compare; the marks are reset only when the 32-bit counter would wrap.
 * Does not own: the shared rules and their messages (services/common/pie_check.c). */
#include "eng_check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_mask.h"
#include "pie_check.h"

#define ENG_CHECK_MAX_PAGE_SIZE 65536u
#define ENG_CHECK_MAX_BATCH     (1u << 20)
#define ENG_CHECK_MAX_SLOTS     (1u << 24)
#define ENG_CHECK_MAX_KV_TOKENS (1ull << 30)

/* ---- open -------------------------------------------------------------------------------- */

pie_code eng_check_opts(const eng_opts *o, eng_check_dims *d, pie_status *st) {
    d->page_size = o->kv_page_size ? o->kv_page_size : 16;
    d->pages = o->kv_pages ? o->kv_pages : 256;
    d->slots = o->embed_slots ? o->embed_slots : 1024;
    d->batch_tokens = o->max_batch_tokens ? o->max_batch_tokens : 4096;
    const pie_check_at at = PIE_AT("eng_open");
    if (pie_check_range(at, "kv_page_size", d->page_size, 1, ENG_CHECK_MAX_PAGE_SIZE, st) !=
            PIE_OK ||
        pie_check_range(at, "max_batch_tokens", d->batch_tokens, 1, ENG_CHECK_MAX_BATCH, st) !=
            PIE_OK ||
        pie_check_range(at, "embed_slots", d->slots, 1, ENG_CHECK_MAX_SLOTS, st) != PIE_OK)
        return st->code;
    if (o->kv_dtype != ENG_KV_F32 && o->kv_dtype != ENG_KV_BF16)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: kv_dtype %d is neither f32 (0) nor bf16 (1)",
                              (int)o->kv_dtype);
    if ((uint64_t)d->pages * d->page_size > ENG_CHECK_MAX_KV_TOKENS)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: kv_pages %u x kv_page_size %u exceeds 2^30 tokens",
                              d->pages, d->page_size);
    return PIE_OK;
}

pie_code eng_check_model(const mdl_config *c, const char *dir, pie_status *st) {
    if (c->head_dim == 0 || c->head_dim % 2 != 0 || c->n_kv_heads == 0 ||
        c->n_heads % c->n_kv_heads != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: %s: head_dim %u must be even and n_kv_heads %u must "
                              "divide n_heads %u",
                              dir, c->head_dim, c->n_kv_heads, c->n_heads);
    return PIE_OK;
}

void eng_check_fill_info(eng_info *in, const mdl_model *m, const eng_check_dims *d) {
    const mdl_config *c = &m->cfg;
    snprintf(in->architecture, sizeof in->architecture, "%s", c->architecture);
    snprintf(in->dtype, sizeof in->dtype, "%s", mdl_dtype_name(m->embed.dtype));
    snprintf(in->kv_dtype, sizeof in->kv_dtype, "f32"); /* the cpu backend may say bf16 */
    in->vocab_size = c->vocab_size;
    in->hidden_size = c->hidden_size;
    in->intermediate_size = c->intermediate_size;
    in->n_layers = c->n_layers;
    in->n_heads = c->n_heads;
    in->n_kv_heads = c->n_kv_heads;
    in->head_dim = c->head_dim;
    in->max_position = c->max_position;
    in->bos_token_id = c->bos_token_id;
    in->eos_token_id = c->eos_token_id;
    in->kv_page_size = d->page_size;
    in->kv_pages = d->pages;
    in->embed_slots = d->slots;
    in->max_batch_tokens = d->batch_tokens;
    in->tp_rank = 0;
    in->tp_size = 1;
    in->local_kv_heads = c->n_kv_heads;
    in->weight_bytes = m->weight_bytes;
}

/* ---- the marks --------------------------------------------------------------------------- */

static size_t eng_check_kv_tokens(const eng_info *in) {
    size_t n = (size_t)in->kv_pages * in->kv_page_size;
    return n ? n : 1;
}

pie_code eng_check_init(eng_check_state *c, const eng_info *info, pie_status *st) {
    *c = (eng_check_state){
        .info = info, .page_cap = UINT64_MAX, .runs_cap = UINT64_MAX, .backend = "unnamed"};
    c->slot_mark = calloc(info->embed_slots, sizeof *c->slot_mark);
    c->page_mark = calloc(info->kv_pages, sizeof *c->page_mark);
    c->tok_mark = calloc(eng_check_kv_tokens(info), sizeof *c->tok_mark);
    c->plan = calloc(info->max_batch_tokens, sizeof *c->plan);
    if (!c->slot_mark || !c->page_mark || !c->tok_mark || !c->plan)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot allocate the page masks and marks of %u pages",
                              info->kv_pages);
    return PIE_OK;
}

void eng_check_free(eng_check_state *c) {
    free(c->slot_mark);
    free(c->page_mark);
    free(c->tok_mark);
    free(c->plan);
    *c = (eng_check_state){0};
}

size_t eng_check_bytes(const eng_check_state *c) {
    const eng_info *in = c->info;
    return ((size_t)in->embed_slots + in->kv_pages + eng_check_kv_tokens(in)) *
               sizeof(eng_check_mark) +
           (size_t)in->max_batch_tokens * sizeof(eng_check_plan);
}

void eng_check_set_caps(eng_check_state *c, const char *backend, uint64_t page_cap,
                        uint64_t runs_cap) {
    c->backend = backend;
    c->page_cap = page_cap;
    c->runs_cap = runs_cap;
}

/* Makes room for `count` fresh generations before a check starts (the marks are reset when
 * the counter would wrap). */
static void eng_check_reserve_gens(eng_check_state *c, uint64_t count) {
    if ((uint64_t)c->gen + count < UINT32_MAX) return;
    const eng_info *in = c->info;
    memset(c->slot_mark, 0, sizeof *c->slot_mark * in->embed_slots);
    memset(c->page_mark, 0, sizeof *c->page_mark * in->kv_pages);
    memset(c->tok_mark, 0, sizeof *c->tok_mark * (size_t)in->kv_pages * in->kv_page_size);
    c->gen = 0;
}

static uint32_t eng_check_next_gen(eng_check_state *c) { return ++c->gen; }

/* ---- embed ------------------------------------------------------------------------------- */

pie_code eng_check_embed(const eng_info *in, const uint32_t *slots, const uint32_t *tokens,
                         const uint32_t *positions, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!slots || !tokens || !positions)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "embed_text: slots, tokens and positions must not be NULL");
    for (uint32_t i = 0; i < n; i++) {
        const pie_check_at at = PIE_AT_ITEM("embed_text", i);
        if (pie_check_lt(at, "slot", slots[i], in->embed_slots, st) != PIE_OK ||
            pie_check_lt(at, "token", tokens[i], in->vocab_size, st) != PIE_OK ||
            pie_check_lt(at, "position", positions[i], in->max_position, st) != PIE_OK)
            return st->code;
    }
    return PIE_OK;
}

/* ---- forward ----------------------------------------------------------------------------- */

/* The shared rules on the item's counts (pie_check_forward). */
static pie_code eng_check_shape(const eng_check_state *c, const eng_forward_item *it, uint32_t i,
                                pie_status *st) {
    const pie_check_fwd f = {.in = "in_slots",
                             .out = "out_slots",
                             .pages = "kv_pages",
                             .last = "kv_last_page_len",
                             .n_in = it->n_in,
                             .n_out = it->n_out,
                             .n_pages = it->n_kv_pages,
                             .last_len = it->kv_last_page_len};
    /* no per-item bound on inputs: eng_check_io bounds the batch's total */
    return pie_check_forward(PIE_AT_ITEM("forward", i), &f, c->info->kv_page_size, UINT64_MAX, st);
}

/* Pages: in range, none twice. Sets *tokens to the tokens the page list holds. */
static pie_code eng_check_pages(eng_check_state *c, const eng_forward_item *it, uint32_t i,
                                uint64_t *tokens, pie_status *st) {
    const eng_info *in = c->info;
    if (it->n_kv_pages > 0 && !it->kv_pages)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: item %u: kv_pages is NULL", i);
    if (pie_check_below(PIE_AT_ITEM("forward", i), "kv_pages", it->kv_pages, it->n_kv_pages,
                        in->kv_pages, st) != PIE_OK)
        return st->code;
    uint32_t gen = eng_check_next_gen(c);
    for (uint32_t j = 0; j < it->n_kv_pages; j++) {
        uint32_t p = it->kv_pages[j];
        if (c->page_mark[p].gen == gen)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: kv page %u appears twice (kv_pages[%u] and "
                                  "kv_pages[%u])",
                                  i, p, c->page_mark[p].who, j);
        c->page_mark[p] = (eng_check_mark){gen, j};
    }
    /* eng_check_shape made kv_last_page_len consistent with the pages */
    *tokens = it->n_kv_pages == 0
                  ? 0
                  : (uint64_t)(it->n_kv_pages - 1) * in->kv_page_size + it->kv_last_page_len;
    return PIE_OK;
}

/* Inputs and outputs: counts, slots, the batch total; out slots unique across the batch
 * (marks of generation `gen`). */
static pie_code eng_check_io(eng_check_state *c, const eng_forward_item *it, uint32_t i,
                             uint32_t gen, uint64_t *total, pie_status *st) {
    const eng_info *in = c->info;
    if (!it->in_slots)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: item %u: in_slots is NULL", i);
    if (it->n_out > 0 && !it->out_slots)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: item %u: out_slots is NULL", i);
    *total += it->n_in;
    if (*total > in->max_batch_tokens)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: the batch reaches %llu input tokens, more than "
                              "max_batch_tokens %u",
                              i, (unsigned long long)*total, in->max_batch_tokens);
    const pie_check_at at = PIE_AT_ITEM("forward", i);
    if (pie_check_below(at, "in_slots", it->in_slots, it->n_in, in->embed_slots, st) != PIE_OK ||
        pie_check_below(at, "out_slots", it->out_slots, it->n_out, in->embed_slots, st) != PIE_OK)
        return st->code;
    for (uint32_t j = 0; j < it->n_out; j++) {
        eng_check_mark *mk = &c->slot_mark[it->out_slots[j]];
        if (mk->gen == gen)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: out_slots[%u] = %u is also an output of item "
                                  "%u",
                                  i, j, it->out_slots[j], mk->who);
        *mk = (eng_check_mark){gen, i};
    }
    return PIE_OK;
}

/* Appended inputs: fit in the pages, and no position written twice in the batch. */
static pie_code eng_check_writes(eng_check_state *c, const eng_forward_item *it, uint32_t i,
                                 uint32_t gen, uint64_t seq_tokens, pie_status *st) {
    if (it->n_in > seq_tokens)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: append_kv with n_in %u but kv_pages hold only "
                              "%llu tokens",
                              i, it->n_in, (unsigned long long)seq_tokens);
    uint32_t ps = c->info->kv_page_size;
    uint64_t ctx = seq_tokens - it->n_in;
    for (uint32_t t = 0; t < it->n_in; t++) {
        uint64_t s = ctx + t;
        uint32_t page = it->kv_pages[s / ps], off = (uint32_t)(s % ps);
        eng_check_mark *mk = &c->tok_mark[(size_t)page * ps + off];
        if (mk->gen == gen)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "forward: item %u: input %u writes kv page %u offset %u, as "
                                  "does item %u",
                                  i, t, page, off, mk->who);
        *mk = (eng_check_mark){gen, i};
    }
    return PIE_OK;
}

static pie_code eng_check_mask(const eng_forward_item *it, uint32_t i, uint32_t ctx,
                               pie_status *st) {
    if (!it->mask_runs && !it->n_mask_runs) return PIE_OK;
    if (!it->mask_runs)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "forward: item %u: mask_runs is NULL with n_mask_runs %u", i,
                              it->n_mask_runs);
    return pie_check_mask(PIE_AT_ITEM("forward", i), it->mask_runs, it->n_mask_runs, ctx, it->n_in,
                          st);
}

/* The batch's page lists and mask runs so far (through item i) within the caps. */
static pie_code eng_check_caps(const eng_check_state *c, uint32_t i, uint64_t pages, uint64_t runs,
                               pie_status *st) {
    if (pages > c->page_cap)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "forward: item %u: the batch lists %llu kv pages in all, more than "
                              "this %s engine's %llu",
                              i, (unsigned long long)pages, c->backend,
                              (unsigned long long)c->page_cap);
    if (runs > c->runs_cap)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "forward: item %u: the batch's attention masks have %llu runs in "
                              "all, more than this %s engine's %llu",
                              i, (unsigned long long)runs, c->backend,
                              (unsigned long long)c->runs_cap);
    return PIE_OK;
}

/* Every output is marked with `gen` now: no input may be another item's output. */
static pie_code eng_check_reads(const eng_check_state *c, const eng_forward_item *items, uint32_t n,
                                uint32_t gen, pie_status *st) {
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < items[i].n_in; j++) {
            const eng_check_mark *mk = &c->slot_mark[items[i].in_slots[j]];
            if (mk->gen == gen && mk->who != i)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "forward: item %u: in_slots[%u] = %u is an output of item "
                                      "%u",
                                      i, j, items[i].in_slots[j], mk->who);
        }
    return PIE_OK;
}

pie_code eng_check_forward(eng_check_state *c, const eng_forward_item *items, uint32_t n,
                           const uint32_t *page_n_masked, uint32_t *total, pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!items) return pie_status_set(st, PIE_INVALID_ARGUMENT, "forward: items is NULL");
    const eng_info *in = c->info;
    /* one generation for the batch, one per item; items past max_batch_tokens never get one */
    eng_check_reserve_gens(c, (uint64_t)(n < in->max_batch_tokens ? n : in->max_batch_tokens) + 2);
    uint32_t gen = eng_check_next_gen(c);
    uint64_t rows = 0, pages = 0, runs = 0;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        uint64_t seq = 0;
        uint32_t first = (uint32_t)rows;
        pie_code rc = eng_check_shape(c, it, i, st);
        if (rc == PIE_OK) rc = eng_check_pages(c, it, i, &seq, st);
        if (rc == PIE_OK) rc = eng_check_io(c, it, i, gen, &rows, st);
        if (rc == PIE_OK && it->append_kv) rc = eng_check_writes(c, it, i, gen, seq, st);
        if (rc != PIE_OK) return rc;
        uint32_t ctx = (uint32_t)(it->append_kv ? seq - it->n_in : seq);
        rc = eng_check_mask(it, i, ctx, st);
        pages += it->n_kv_pages;
        runs += it->mask_runs ? it->n_mask_runs : 0;
        if (rc == PIE_OK) rc = eng_check_caps(c, i, pages, runs, st);
        if (rc != PIE_OK) return rc;
        /* i < rows <= max_batch_tokens: the plan array has room. */
        c->plan[i] = (eng_check_plan){
            .first = first,
            .ctx = ctx,
            .pages = (uint32_t)(pages - it->n_kv_pages),
            .ctx_masked = eng_mask_ctx_masked(page_n_masked, in->kv_page_size, it->kv_pages, ctx),
        };
    }
    pie_code rc = eng_check_reads(c, items, n, gen, st);
    if (rc != PIE_OK) return rc;
    *total = (uint32_t)rows;
    return PIE_OK;
}

/* ---- pages, distributions, slots --------------------------------------------------------- */

pie_code eng_check_mask_page(const eng_info *in, uint32_t page, const bool *masked,
                             pie_status *st) {
    if (!masked) return pie_status_set(st, PIE_INVALID_ARGUMENT, "mask_page: masked is NULL");
    return pie_check_lt(PIE_AT("mask_page"), "page", page, in->kv_pages, st);
}

static pie_code eng_check_copy_item(const eng_info *in, const eng_copy_item *c, uint32_t i,
                                    pie_status *st) {
    const pie_check_at at = PIE_AT_ITEM("copy_pages", i);
    if (pie_check_lt(at, "src", c->src, in->kv_pages, st) != PIE_OK ||
        pie_check_lt(at, "dst", c->dst, in->kv_pages, st) != PIE_OK)
        return st->code;
    return pie_check_copy(at, c->src, c->dst, c->src_off, c->dst_off, c->count, in->kv_page_size,
                          st);
}

pie_code eng_check_copy(const eng_info *in, const eng_copy_item *items, uint32_t n,
                        pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!items) return pie_status_set(st, PIE_INVALID_ARGUMENT, "copy_pages: items is NULL");
    for (uint32_t i = 0; i < n; i++) {
        pie_code rc = eng_check_copy_item(in, &items[i], i, st);
        if (rc != PIE_OK) return rc;
    }
    return PIE_OK;
}

static pie_code eng_check_dist_item(const eng_info *in, const eng_dist_item *it, uint32_t i,
                                    uint32_t top_k_max, pie_status *st) {
    const pie_check_at at = PIE_AT_ITEM("next_dist", i);
    if (pie_check_lt(at, "slot", it->slot, in->embed_slots, st) != PIE_OK ||
        pie_check_range(at, "top_k", it->top_k, 1, top_k_max, st) != PIE_OK ||
        pie_check_temperature(at, it->temperature, false, st) != PIE_OK)
        return st->code;
    if (!it->ids || !it->probs)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "next_dist: item %u: ids and probs must not be NULL", i);
    return PIE_OK;
}

pie_code eng_check_dist(const eng_info *in, const eng_dist_item *items, uint32_t n,
                        uint32_t top_k_max, pie_status *st) {
    if (n == 0) return PIE_OK;
    if (!items) return pie_status_set(st, PIE_INVALID_ARGUMENT, "next_dist: items is NULL");
    if (top_k_max > in->vocab_size) top_k_max = in->vocab_size;
    for (uint32_t i = 0; i < n; i++) {
        pie_code rc = eng_check_dist_item(in, &items[i], i, top_k_max, st);
        if (rc != PIE_OK) return rc;
    }
    return PIE_OK;
}

pie_code eng_check_slot_out(const eng_info *in, const char *handler, uint32_t slot, const void *out,
                            const char *out_name, pie_status *st) {
    if (pie_check_lt(PIE_AT(handler), "slot", slot, in->embed_slots, st) != PIE_OK) return st->code;
    if (!out) return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: %s is NULL", handler, out_name);
    return PIE_OK;
}

pie_code eng_check_clear(const eng_info *in, bool pages, const uint32_t *ids, uint32_t n,
                         pie_status *st) {
    const char *handler = pages ? "clear_pages" : "clear_embeds";
    if (n == 0) return PIE_OK;
    if (!ids)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: %s is NULL", handler,
                              pages ? "pages" : "slots");
    uint32_t limit = pages ? in->kv_pages : in->embed_slots;
    for (uint32_t i = 0; i < n; i++)
        if (pie_check_lt(PIE_AT_ITEM(handler, i), pages ? "page" : "slot", ids[i], limit, st) !=
            PIE_OK)
            return st->code;
    return PIE_OK;
}

uint32_t eng_check_kv_top_forward(const eng_forward_item *items, uint32_t n) {
    uint32_t top = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < items[i].n_kv_pages; j++)
            if (items[i].kv_pages[j] >= top) top = items[i].kv_pages[j] + 1;
    return top;
}

uint32_t eng_check_kv_top_copies(const eng_copy_item *items, uint32_t n) {
    uint32_t top = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t p = 0; p < 2; p++) {
            uint32_t id = p ? items[i].dst : items[i].src;
            if (id >= top) top = id + 1;
        }
    return top;
}
