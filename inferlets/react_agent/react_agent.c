/* react_agent.c — a ReAct-style agent: the model thinks, names a search query, the inferlet
 * calls a tool over HTTP and writes the observation into the same context, and so on.
 *
 * One Context holds the whole episode. Each step: the model writes a thought (--think-tokens
 * tokens), the inferlet writes "\nAction: search[" and the model writes the query
 * (--action-tokens tokens); the inferlet GETs <--url>?step=<i>&q=<query,
 * percent-encoded> (pie_http_request, allowlisted by the lifecycle replica) and fills
 * "]\nObservation: <response body>\nThought:". The KV pages stay bound while the request runs
 * and every token is forwarded exactly once: the observation is appended to the stored context,
 * never re-prefilled with it.
 *
 * Owns: the agent loop and the tool call. Does not own: HTTP (the lifecycle service runs it),
 * the decode loop (the SDK).
 *
 * Arguments: --question TEXT, --url URL (required), --steps N (2), --think-tokens T (8),
 * --action-tokens A (6). Model stop tokens are ignored.
 * Output, per step: a message "step=<i> status=<http status> kv_before=<tokens stored when the
 * response arrived> kv_after=<after the observation> pages=<page ids, comma-separated>
 * think=<token ids> action=<token ids>\t<query>\t<observation>"; at the end a message with the
 * whole transcript (the context's text after the question). */
#include <stdlib.h>
#include <string.h>

#include "pie.h"

static void append_ids(pie_buf *b, const uint32_t *t, size_t n) {
    for (size_t i = 0; i < n; i++) pie_buf_appendf(b, i ? ",%u" : "%u", t[i]);
}

/* Percent-encodes every byte except unreserved ones (RFC 3986). */
static void url_encode(pie_buf *b, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            strchr("-._~", c) != NULL)
            pie_buf_append(b, &s[i], 1);
        else
            pie_buf_appendf(b, "%%%02X", c);
    }
}

/* GET url; returns the HTTP status, the body in *body. */
static uint32_t http_get(const char *url, pie_buf *body) {
    uint32_t f = pie_future_new();
    if (pie_http_request("GET", 3, url, (uint32_t)strlen(url), "", 0, "", 0, f) < 0)
        pie_fatal("http_request GET %s: %s", url, pie_error());
    pie_buf raw = {0};
    size_t n = pie_future_take(f, &raw, "http_request");
    if (n < 4) pie_fatal("http_request GET %s: payload of %zu bytes, expected >= 4", url, n);
    uint32_t status;
    memcpy(&status, raw.data, 4);
    pie_buf_clear(body);
    pie_buf_append(body, raw.data + 4, n - 4);
    pie_buf_free(&raw);
    return status;
}

/* Greedy generation of exactly max_tokens tokens into *out (the caller frees it). */
static void generate(pie_ctx *c, uint32_t max_tokens, pie_output *out) {
    pie_sampler s = pie_sampler_greedy();
    pie_stop stop = {.max_tokens = max_tokens, .ignore_model_stop_tokens = true};
    *out = (pie_output){0};
    ctx_generate(c, &s, &stop, out);
}

int main(int argc, char **argv) {
    const char *question = pie_arg_str(argc, argv, "question", "What is the capital of France?");
    const char *url = pie_arg_str(argc, argv, "url", NULL);
    if (!url) pie_fatal("--url: required (the tool's address, allowed by http.allow)");
    long steps = pie_arg_int(argc, argv, "steps", 2);
    long think = pie_arg_int(argc, argv, "think-tokens", 8);
    long act = pie_arg_int(argc, argv, "action-tokens", 6);
    if (steps < 1 || think < 1 || act < 1)
        pie_fatal("--steps %ld --think-tokens %ld --action-tokens %ld: each must be >= 1", steps,
                  think, act);

    pie_ctx *ctx = ctx_new(NULL);
    pie_buf q = {0};
    pie_buf_appendf(&q, "Question: %s\nThought:", question);
    ctx_fill(ctx, q.data);
    size_t start = ctx->n_tokens;
    pie_buf req = {0}, body = {0}, msg = {0}, fill = {0};
    for (long i = 1; i <= steps; i++) {
        pie_output th, ac;
        generate(ctx, (uint32_t)think, &th);
        ctx_fill(ctx, "\nAction: search[");
        generate(ctx, (uint32_t)act, &ac);

        pie_buf_clear(&req);
        pie_buf_appendf(&req, "%s?step=%ld&q=", url, i);
        url_encode(&req, ac.text.data ? ac.text.data : "", ac.text.len);
        uint32_t status = http_get(req.data, &body);
        uint32_t kv_before = ctx->kv_len;
        pie_buf_clear(&fill);
        pie_buf_append_str(&fill, "]\nObservation: ");
        pie_buf_append(&fill, body.data ? body.data : "", body.len);
        pie_buf_append_str(&fill, "\nThought:");
        ctx_fill(ctx, fill.data);

        pie_buf_clear(&msg);
        pie_buf_appendf(&msg, "step=%ld status=%u kv_before=%u kv_after=%u pages=", i, status,
                        kv_before, ctx->kv_len);
        append_ids(&msg, ctx->pages, (ctx->kv_len + ctx->model->info.kv_page_size - 1) /
                                         ctx->model->info.kv_page_size);
        pie_buf_append_str(&msg, " think=");
        append_ids(&msg, th.tokens, th.n_tokens);
        pie_buf_append_str(&msg, " action=");
        append_ids(&msg, ac.tokens, ac.n_tokens);
        pie_buf_appendf(&msg, "\t%s\t%s", ac.text.data ? ac.text.data : "",
                        body.data ? body.data : "");
        pie_send_bytes(msg.data, msg.len);
        pie_output_free(&th);
        pie_output_free(&ac);
    }
    pie_buf transcript = {0};
    pie_decode(ctx->model, ctx->tokens + start, ctx->n_tokens - start, &transcript);
    pie_send_bytes(transcript.data, transcript.len);
    pie_buf_free(&transcript);
    pie_buf_free(&q);
    pie_buf_free(&req);
    pie_buf_free(&body);
    pie_buf_free(&msg);
    pie_buf_free(&fill);
    ctx_free(ctx);
    return 0;
}
