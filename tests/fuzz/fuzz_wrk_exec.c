/* fuzz_wrk_exec.c — the worker's input from the controller: WorkerDown steps through the
 * executor (services/worker/wrk_exec.c), the layer that validates every batch before the
 * engine sees it.
 *
 * Input: records [op][len lo][len hi][payload]. op & 3 == 1: the link was lost and re-made
 * (wrk_exec_reset, the next epoch); otherwise the payload is one WorkerDown, decoded as the
 * worker's link decodes it (protobuf_c_message_unpack; an unparseable one is skipped: the real
 * link would end) and submitted. Capacities: 4-token pages, 16 pages, 64 embedding slots,
 * vocab 2048, 1024 positions, top_k at most 8.
 * The backend is a checking one, not the engine: wrk_exec.h promises that only items whose
 * slots are inside the capacities (and live) reach the backend, with well-formed counts; this
 * backend aborts on any id, offset or count the engine would read or write out of bounds with
 * (liveness is not re-checked here), reads every mask entry and fills every next_dist output
 * (ASan sees a short buffer).
 * Checks: no crash, leak, UB or deadlock; the backend's checks; every WorkerUp the executor
 * emits is one credit and packs. Seeds: gen_corpus.py. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "pie_log.h"
#include "wrk_backend.h"
#include "wrk_exec.h"

enum { PAGE = 4, KV_PAGES = 16, EMBEDS = 64, VOCAB = 2048, MAX_POS = 1024, MAX_TOP_K = 8 };

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    pie_log_set_level(PIE_LOG_DEBUG);
    if (getenv("PIE_FUZZ_LOG") == NULL) pie_log_set_fd(open("/dev/null", O_WRONLY));
    return 0;
}

/* ---- the checking backend (runs on the executor thread) ------------------------------------ */

static void check_page(uint32_t page, const char *what) {
    if (page >= KV_PAGES) fuzz_fail("backend got %s page %u of %u", what, page, KV_PAGES);
}

static void check_embed(uint32_t slot, const char *what) {
    if (slot >= EMBEDS) fuzz_fail("backend got %s embedding slot %u of %u", what, slot, EMBEDS);
}

static pie_code chk_embed_text(void *ctx, const uint32_t *slots, const uint32_t *tokens,
                               const uint32_t *positions, uint32_t n, pie_status *st) {
    (void)ctx;
    for (uint32_t i = 0; i < n; i++) {
        check_embed(slots[i], "embed_text");
        if (tokens[i] >= VOCAB) fuzz_fail("backend got token %u of %u", tokens[i], VOCAB);
        if (positions[i] >= MAX_POS) fuzz_fail("backend got position %u", positions[i]);
    }
    pie_status_ok(st);
    return PIE_OK;
}

static pie_code chk_forward(void *ctx, const eng_forward_item *items, uint32_t n, pie_status *st) {
    (void)ctx;
    for (uint32_t i = 0; i < n; i++) {
        const eng_forward_item *it = &items[i];
        for (uint32_t k = 0; k < it->n_kv_pages; k++) check_page(it->kv_pages[k], "forward");
        if ((it->n_kv_pages == 0) != (it->kv_last_page_len == 0) || it->kv_last_page_len > PAGE)
            fuzz_fail("forward: %u pages with last page length %u", it->n_kv_pages,
                      it->kv_last_page_len);
        if (it->n_in == 0 || it->n_out > it->n_in)
            fuzz_fail("forward: %u inputs, %u outputs", it->n_in, it->n_out);
        for (uint32_t k = 0; k < it->n_in; k++) check_embed(it->in_slots[k], "forward input");
        for (uint32_t k = 0; k < it->n_out; k++) check_embed(it->out_slots[k], "forward output");
        for (uint32_t k = 0; k < it->n_mask_runs; k++) (void)it->mask_runs[k]; /* readable */
    }
    pie_status_ok(st);
    return PIE_OK;
}

static pie_code chk_mask_page(void *ctx, uint32_t page, const bool *masked, pie_status *st) {
    (void)ctx;
    check_page(page, "mask_page");
    for (uint32_t k = 0; k < PAGE; k++) (void)masked[k]; /* kv_page_size entries readable */
    pie_status_ok(st);
    return PIE_OK;
}

static pie_code chk_copy_pages(void *ctx, const eng_copy_item *items, uint32_t n, pie_status *st) {
    (void)ctx;
    for (uint32_t i = 0; i < n; i++) {
        const eng_copy_item *c = &items[i];
        check_page(c->src, "copy_page source");
        check_page(c->dst, "copy_page destination");
        if (c->count == 0 || c->src_off > PAGE || c->dst_off > PAGE || c->count > PAGE ||
            c->src_off + c->count > PAGE || c->dst_off + c->count > PAGE)
            fuzz_fail("copy_page: %u tokens from %u to %u of a %u-token page", c->count, c->src_off,
                      c->dst_off, PAGE);
    }
    pie_status_ok(st);
    return PIE_OK;
}

static pie_code chk_next_dist(void *ctx, eng_dist_item *items, uint32_t n, pie_status *st) {
    (void)ctx;
    for (uint32_t i = 0; i < n; i++) {
        eng_dist_item *it = &items[i];
        check_embed(it->slot, "next_dist");
        if (it->top_k == 0 || it->top_k > MAX_TOP_K || !(it->temperature > 0))
            fuzz_fail("next_dist: top_k %u, temperature %g", it->top_k, (double)it->temperature);
        for (uint32_t k = 0; k < it->top_k; k++) {
            it->ids[k] = k;
            it->probs[k] = 1.0f / (float)it->top_k;
        }
    }
    pie_status_ok(st);
    return PIE_OK;
}

static pie_code chk_clear_pages(void *ctx, const uint32_t *ids, uint32_t n, pie_status *st) {
    (void)ctx;
    for (uint32_t i = 0; i < n; i++) check_page(ids[i], "clear");
    pie_status_ok(st);
    return PIE_OK;
}

static pie_code chk_clear_embeds(void *ctx, const uint32_t *ids, uint32_t n, pie_status *st) {
    (void)ctx;
    for (uint32_t i = 0; i < n; i++) check_embed(ids[i], "clear");
    pie_status_ok(st);
    return PIE_OK;
}

static void on_emit(void *user, uint64_t epoch, const Pie__V1__WorkerUp *up) {
    (void)user;
    (void)epoch;
    if (up->credits != 1) fuzz_fail("a step's WorkerUp carries %u credits, want 1", up->credits);
    size_t n = protobuf_c_message_get_packed_size(&up->base);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL) abort();
    if (protobuf_c_message_pack(&up->base, buf) != n) fuzz_fail("WorkerUp: pack size mismatch");
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    wrk_exec_opts o = {.backend = {.name = "fuzz-check",
                                   .embed_text = chk_embed_text,
                                   .forward = chk_forward,
                                   .mask_page = chk_mask_page,
                                   .copy_pages = chk_copy_pages,
                                   .next_dist = chk_next_dist,
                                   .clear_pages = chk_clear_pages,
                                   .clear_embeds = chk_clear_embeds},
                       .lim = {.kv_pages = KV_PAGES,
                               .embed_slots = EMBEDS,
                               .kv_page_size = PAGE,
                               .vocab_size = VOCAB,
                               .max_context_tokens = MAX_POS,
                               .max_top_k = MAX_TOP_K,
                               .default_top_k = 4},
                       .emit = on_emit};
    pie_status st;
    wrk_exec *x = wrk_exec_start(&o, &st);
    if (x == NULL) fuzz_fail("wrk_exec_start: %s", st.msg);
    uint64_t epoch = 1;
    size_t i = 0;
    while (i < size) {
        uint8_t op = data[i++];
        size_t len = 0;
        if (i < size) len = data[i++];
        if (i < size) len |= (size_t)data[i++] << 8;
        if (len > size - i) len = size - i;
        const uint8_t *p = data + i;
        i += len;
        if ((op & 3) == 1) {
            wrk_exec_reset(x);
            epoch++;
            continue;
        }
        ProtobufCMessage *m =
            protobuf_c_message_unpack(&pie__v1__worker_down__descriptor, NULL, len, p);
        if (m != NULL) wrk_exec_submit(x, (Pie__V1__WorkerDown *)m, epoch);
    }
    wrk_exec_stop(x);
    return 0;
}
