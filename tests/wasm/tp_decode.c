/* tp_decode.c — fixture of tests/e2e/test_tp.c (issue 14): greedy decoding through the raw
 * `pie` ABI with explicit attention masks and a KV page mask, so that a tensor-parallel group
 * and a tp 1 worker can be compared on exactly the same calls.
 *
 * Steps, one queue on the cluster's first model:
 *  1. a 20-token prompt (fixed ids, BOS first when the model has one) prefilled in one forward
 *     whose explicit mask hides prompt tokens 3..5 from rows 8 and later;
 *  2. --steps N (default 64) decode steps: embed the previous step's top token, forward over
 *     the whole context (odd steps with an explicit mask hiding tokens 10..13; even steps
 *     causal), next_dist with top-k 8; after step 40 a mask_kv_page hides the first 4 tokens
 *     of page 1 for every later step;
 *  3. a synchronize, then the pages and embeddings are freed.
 * --no-masks runs the same calls without any mask (all causal), to show that the masks matter.
 * Messages: one per next-token distribution, "<i> <id>:<prob %a> ..." (8 pairs, descending),
 * the first (i = 0) after the prompt; then "done". Any failed call: a message "error <what>:
 * <last_error>" and exit 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_abi.h"

#define Q         1u
#define F         2u
#define PROMPT    20u
#define TOP_K     8u
#define MAX_STEPS 256u
#define OUT_EMB   500u                       /* the embedding the last input writes */
#define IN_EMB    501u                       /* a decode step's input */
#define ADDR(p)   ((uint32_t)(uintptr_t)(p)) /* a linear-memory address */

static char out[1024];
static char err[512];
static uint8_t buf[4 + TOP_K * 8];
static uint32_t pages[(PROMPT + MAX_STEPS) / 8 + 2];
static uint32_t runs[PROMPT * 3];
static char model[128];
static pie_abi_model_info info;

static void fail(const char *what) {
    int32_t n = pie_last_error(err, sizeof err - 1);
    err[n < 0 ? 0 : (n < (int32_t)sizeof err ? n : (int32_t)sizeof err - 1)] = '\0';
    snprintf(out, sizeof out, "error %s: %s", what, err);
    pie_send(out, (uint32_t)strlen(out));
    exit(1);
}

static void check(int32_t rc, const char *what) {
    if (rc < 0) fail(what);
}

static uint32_t pages_for(uint32_t tokens) {
    return (tokens + info.kv_page_size - 1) / info.kv_page_size;
}

/* Forward of n inputs (embeddings in[0..n)) after ctx stored tokens; the last input writes
 * OUT_EMB. mask: n_runs runs (0 = causal). */
static void forward(uint32_t ctx, const uint32_t *in, uint32_t n, const uint32_t *mask,
                    uint32_t n_runs) {
    uint32_t ps = info.kv_page_size, n_ctx_pages = pages_for(ctx), first_out = ctx / ps;
    uint32_t out_emb = OUT_EMB;
    pie_abi_forward d = {
        .kv_page_ids = ADDR(pages),
        .n_kv_pages = n_ctx_pages,
        .kv_page_last_len = n_ctx_pages ? ctx - (n_ctx_pages - 1) * ps : 0,
        .input_embed_ids = ADDR(in),
        .n_inputs = n,
        .output_kv_page_ids = ADDR(pages + first_out),
        .n_output_kv_pages = pages_for(ctx + n) - first_out,
        .output_embed_ids = ADDR(&out_emb),
        .n_outputs = 1,
        .mask_runs = ADDR(mask),
        .n_mask_runs = n_runs,
    };
    check(pie_forward(Q, &d), "forward");
}

/* next_dist of OUT_EMB, sent as message i; returns the top token. */
static uint32_t next(uint32_t i) {
    uint32_t e = OUT_EMB;
    check(pie_next_dist(Q, &e, 1, TOP_K, 0.0f, F), "next_dist");
    check(pie_future_wait(F, -1), "next_dist wait");
    int32_t len = pie_future_result(F, buf, sizeof buf);
    check(len, "next_dist result");
    uint32_t k;
    memcpy(&k, buf, 4);
    if (k != TOP_K || (uint32_t)len != 4 + k * 8) {
        snprintf(out, sizeof out, "error next_dist: k %u, %d bytes", k, len);
        pie_send(out, (uint32_t)strlen(out));
        exit(1);
    }
    int w = snprintf(out, sizeof out, "%u", i);
    uint32_t top = 0;
    for (uint32_t j = 0; j < k; j++) {
        uint32_t id;
        float p;
        memcpy(&id, buf + 4 + 4 * j, 4);
        memcpy(&p, buf + 4 + 4 * k + 4 * j, 4);
        if (j == 0) top = id;
        w += snprintf(out + w, sizeof out - (size_t)w, " %u:%a", id, (double)p);
    }
    pie_send(out, (uint32_t)strlen(out));
    return top;
}

int main(int argc, char **argv) {
    uint32_t steps = 64;
    int masks = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps = (uint32_t)atoi(argv[i + 1]);
        if (strcmp(argv[i], "--no-masks") == 0) masks = 0;
    }
    if (steps == 0 || steps > MAX_STEPS) steps = 64;
    int32_t n = pie_model_name(0, model, sizeof model - 1);
    check(n, "model_name");
    model[n] = '\0';
    check(pie_model_info(model, (uint32_t)n, &info), "model_info");
    if (info.kv_page_size < 8 || info.kv_page_size > 256 ||
        pages_for(PROMPT + steps) > sizeof pages / sizeof pages[0]) {
        snprintf(out, sizeof out, "error kv_page_size %u", info.kv_page_size);
        pie_send(out, (uint32_t)strlen(out));
        return 1;
    }
    check(pie_create_queue(Q, model, (uint32_t)n), "create_queue");
    uint32_t n_pages = pages_for(PROMPT + steps);
    for (uint32_t i = 0; i < n_pages; i++) pages[i] = i;
    check(pie_alloc_kv_pages(Q, pages, n_pages), "alloc_kv_pages");
    uint32_t emb[PROMPT + 2], tok[PROMPT], pos[PROMPT];
    for (uint32_t i = 0; i < PROMPT; i++) {
        emb[i] = i;
        pos[i] = i;
        tok[i] = (7 * i + 3) % (info.num_tokens > 2 ? info.num_tokens - 2 : 1);
    }
    if (info.has_bos_token) tok[0] = info.bos_token_id;
    emb[PROMPT] = OUT_EMB;
    emb[PROMPT + 1] = IN_EMB;
    check(pie_alloc_embeds(Q, emb, PROMPT + 2), "alloc_embeds");
    check(pie_embed_text(Q, emb, tok, pos, PROMPT), "embed_text");

    /* the prompt: rows 8.. do not see tokens 3..5 */
    uint32_t nr = 0;
    for (uint32_t row = 0; row < PROMPT; row++) {
        if (row < 8) {
            runs[nr++] = row + 1;
        } else {
            runs[nr++] = 3;
            runs[nr++] = 3;
            runs[nr++] = row + 1 - 6;
        }
    }
    forward(0, emb, PROMPT, masks ? runs : NULL, masks ? nr : 0);
    uint32_t t = next(0);
    uint8_t hide[256] = {0};
    for (uint32_t s = 0; s < steps; s++) {
        uint32_t ctx = PROMPT + s, p = ctx, in = IN_EMB;
        check(pie_embed_text(Q, &in, &t, &p, 1), "embed_text");
        uint32_t m[3] = {10, 4, ctx + 1 - 14};
        int masked = masks && s % 2;
        forward(ctx, &in, 1, masked ? m : NULL, masked ? 3 : 0);
        t = next(s + 1);
        if (masks && s == 40) {
            for (uint32_t i = 0; i < 4 && i < info.kv_page_size; i++) hide[i] = 1;
            check(pie_mask_kv_page(Q, pages[1], hide, info.kv_page_size), "mask_kv_page");
        }
    }
    check(pie_synchronize(Q, F), "synchronize");
    check(pie_future_wait(F, -1), "synchronize wait");
    check(pie_future_result(F, NULL, 0), "synchronize result");
    check(pie_dealloc_kv_pages(Q, pages, n_pages), "dealloc_kv_pages");
    check(pie_dealloc_embeds(Q, emb, PROMPT + 2), "dealloc_embeds");
    pie_send("done", 4);
    return 0;
}
