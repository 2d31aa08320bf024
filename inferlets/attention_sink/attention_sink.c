/* attention_sink.c — StreamingLLM-style generation: attention sinks plus a sliding window.
 *
 * Every generated token attends to the first --sink S tokens of the sequence (the "attention
 * sinks") and to the --window W most recently stored tokens, plus itself. Tokens that leave the
 * window are hidden with KV page masks (ctx_mask_tokens); a page whose tokens are all hidden is
 * deallocated (ctx_drop_masked_pages), so the KV pages in use stay bounded however long the
 * generation runs. Positions keep increasing (RoPE sees the true distance). The prompt itself is
 * prefilled causally; the window applies from the first generated token on.
 *
 * Owns: the window policy (what to mask when) and its statistics. Does not own: masks and page
 * dropping (the SDK's Context), the attention itself (the worker).
 *
 * Arguments: --prompt TEXT, --sink S (default 4), --window W (default 64), --max-tokens N
 * (default 128), --ignore-eos.
 * Output: message 1 the completion; message 2
 * "tokens=<generated> max_pages=<most KV pages held at once> pages=<held at the end>
 *  dropped=<pages deallocated> masked=<tokens hidden>". */
#include <stdlib.h>

#include "pie.h"

typedef struct window {
    uint32_t sink, size;
    uint32_t masked_to; /* ctx index: stored tokens [sink, masked_to) are hidden */
    size_t max_pages, dropped, masked;
} window;

/* Hides the stored tokens that left the window since the last call and frees pages that hold
 * nothing visible any more. Called between decode steps, before the pending token's forward. */
static void window_slide(window *w, pie_ctx *c) {
    if (c->kv_len <= w->sink + w->size) return;
    uint32_t from = w->masked_to > w->sink ? w->masked_to : w->sink;
    uint32_t to = c->kv_len - w->size;
    if (to > from) {
        ctx_mask_tokens(c, from, to - from, true);
        w->masked += to - from;
        w->masked_to = to;
    }
    size_t d = ctx_drop_masked_pages(c);
    /* dropped pages all lie before masked_to (they hold only hidden tokens) */
    w->masked_to -= (uint32_t)(d * c->model->info.kv_page_size);
    w->dropped += d;
}

int main(int argc, char **argv) {
    const char *prompt = pie_arg_str(argc, argv, "prompt", "Once upon a time");
    long sink = pie_arg_int(argc, argv, "sink", 4), size = pie_arg_int(argc, argv, "window", 64);
    if (sink < 0 || size < 1) pie_fatal("--sink %ld --window %ld: need sink >= 0, window >= 1", sink, size);
    pie_stop stop = {
        .max_tokens = (uint32_t)pie_arg_int(argc, argv, "max-tokens", 128),
        .ignore_model_stop_tokens = pie_arg_flag(argc, argv, "ignore-eos"),
    };
    window w = {.sink = (uint32_t)sink, .size = (uint32_t)size};

    pie_ctx *ctx = ctx_new(NULL);
    ctx_fill(ctx, prompt);
    pie_sampler s = pie_sampler_greedy();
    pie_output out = {0};
    pie_gen g;
    pie_gen_start(&g, ctx, &s, &stop, &out);
    for (;;) {
        window_slide(&w, ctx);
        if (!pie_gen_issue(&g)) break;
        if (ctx->n_pages > w.max_pages) w.max_pages = ctx->n_pages; /* incl. the step's new page */
        if (!pie_gen_take(&g)) break;
    }

    pie_send_bytes(out.text.data, out.text.len);
    pie_sendf("tokens=%zu max_pages=%zu pages=%zu dropped=%zu masked=%zu", out.n_tokens,
              w.max_pages, ctx->n_pages, w.dropped, w.masked);
    pie_output_free(&out);
    ctx_free(ctx);
    return 0;
}
