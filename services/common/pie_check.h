/* pie_check.h — the rules every layer checks on the GPU calls (embed_text, forward,
 * mask_kv_page, copy_kv_page, next_dist) and on the id lists and names of the other calls, with
 * their messages.
 *
 * Owns: one function per rule, shared by the lifecycle (lc_host_ctl.c: the inferlet's
 * arguments, against its queue's model), the controller (ctl_exec.c: ApiCalls, against the
 * ModelInfo) and the worker's engine (eng_check.c: batch items over physical slots, against the
 * engine's sizes); the wire-contract limits on ids per call and name lengths; the one reading
 * of the attention-mask run format for validation (proto/pie/v1/common.proto; decoding rows is
 * the engine's, eng_mask.c). Each layer names its own fields (the inferlet ABI's, the proto's,
 * the engine's) and adds only the checks that need its own state: the lifecycle its queues and
 * futures, the controller id → slot mapping and page layout, the worker slot ranges and
 * conflicts within a batch.
 * Does not own: what a failed check does to the call (each layer's).
 *
 * Every function returns PIE_OK or PIE_INVALID_ARGUMENT with a message that starts with where
 * the check applies, "<fn>: " (e.g. "forward: ") or, for an item of a batch, "<fn>: item <i>: ",
 * and names the field and its value. The messages after that prefix (<f>: the caller's field):
 *   range:       "<f> <v> is out of range [<lo>, <hi>]"
 *   below:       "<f> <v> is out of range [0, <limit>)"; lists "<f>[<i>] = <v> is out of ..."
 *   count:       "<f> is empty", "<f> has <n> entries, more than the <max> allowed"
 *   name:        "<f> is empty", "<f> is <n> bytes, more than 256"
 *   forward:     the count of the inputs, "<last> <v> must be 0 when <pages> is empty",
 *                the range of <last> [1, <page_size>],
 *                "<out> has <n> entries, more than the <m> of <in>"
 *   mask:        "mask runs end in row <r> (<c> of its <len> tokens covered)",
 *                "mask run <k> (length <l>) crosses the end of row <r> (<len> tokens)",
 *                "mask row <r> hides its own token (the last of its <len>)",
 *                "mask has <k> runs left over after row <r>"
 *   page length: "<f> has <n> entries, must have kv_page_size <P>"
 *   copy:        the range of token_count [1, P],
 *                "src_offset <o> + token_count <n> exceeds kv_page_size <P>" (and dst_offset),
 *                "source [<a>, <b>) and destination [<c>, <d>) overlap in kv page <p>"
 *   temperature: "temperature <t> is not a finite number >= 0" (or "> 0") */
#ifndef PIE_CHECK_H
#define PIE_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

#define PIE_MAX_IDS        4096u /* ids per alloc, dealloc, export, import call (wire contract) */
#define PIE_MAX_NAME_BYTES 256u  /* export names and topics (wire contract) */

/* Where a check applies: a call, or one item of a batch (the worker's handlers). Building the
 * prefix costs nothing until a check fails. */
typedef struct pie_check_at {
    const char *fn; /* the call or handler: "forward" */
    int64_t item;   /* index in the batch, or -1 */
} pie_check_at;
#define PIE_AT(fn)         ((pie_check_at){(fn), -1})
#define PIE_AT_ITEM(fn, i) ((pie_check_at){(fn), (int64_t)(i)})

/* A model limit of 0 (unknown) allows everything. */
static inline uint32_t pie_check_limit(uint32_t limit) { return limit ? limit : UINT32_MAX; }

/* lo <= v <= hi. */
pie_code pie_check_range(pie_check_at at, const char *field, uint64_t v, uint64_t lo, uint64_t hi,
                         pie_status *st);
/* v < limit (a token id below vocab_size, a position below the context, a slot index). */
pie_code pie_check_lt(pie_check_at at, const char *field, uint64_t v, uint64_t limit,
                      pie_status *st);
/* Every v[i] < limit. */
pie_code pie_check_below(pie_check_at at, const char *field, const uint32_t *v, size_t n,
                         uint32_t limit, pie_status *st);
/* An id list (or any list) of 1..max entries. */
pie_code pie_check_count(pie_check_at at, const char *field, uint64_t n, uint64_t max,
                         pie_status *st);
/* A name (export, topic) of 1..PIE_MAX_NAME_BYTES bytes. */
pie_code pie_check_name(pie_check_at at, const char *field, size_t len, pie_status *st);

/* The counts of one forward pass, under the caller's field names. */
typedef struct pie_check_fwd {
    const char *in, *out, *pages, *last; /* names of: inputs, outputs, context pages, last len */
    uint64_t n_in, n_out, n_pages;
    uint32_t last_len; /* tokens in the last context page */
} pie_check_fwd;

/* 1..max_in inputs, last_len consistent with the pages, at most one output per input. */
pie_code pie_check_forward(pie_check_at at, const pie_check_fwd *f, uint32_t page_size,
                           uint64_t max_in, pie_status *st);

/* runs[n_runs] describe exactly n_rows rows over ctx context tokens: row i covers the first
 * ctx + i + 1 tokens of the sequence, its runs alternate visible, masked, ... starting visible
 * and sum to its length, and its last token (the input itself) is visible. */
pie_code pie_check_mask(pie_check_at at, const uint32_t *runs, uint64_t n_runs, uint32_t ctx,
                        uint32_t n_rows, pie_status *st);

/* A page mask lists one flag per token of a page. */
pie_code pie_check_page_len(pie_check_at at, const char *field, uint64_t n, uint32_t page_size,
                            pie_status *st);

/* token_count tokens from src_offset of page src to dst_offset of page dst: inside pages of
 * page_size tokens, not overlapping when src == dst. */
pie_code pie_check_copy(pie_check_at at, uint32_t src, uint32_t dst, uint32_t src_offset,
                        uint32_t dst_offset, uint32_t token_count, uint32_t page_size,
                        pie_status *st);

/* A finite temperature >= 0 (zero_ok) or > 0. */
pie_code pie_check_temperature(pie_check_at at, float t, bool zero_ok, pie_status *st);

#endif
