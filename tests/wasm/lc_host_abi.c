/* lc_host_abi.c — fixture of tests/integration/test_lc_host.c: an inferlet that exercises the raw
 * `pie` ABI (sdk/include/pie_abi.h) in the scenario argv[1] names, and reports what it saw to the
 * client with pie_send, one message per observation ("name=value"), so the test asserts them:
 *   greedy N t1,t2,...   greedy generation of N tokens after the prompt; sends "tokens=a,b,..."
 *                        and "dists=id:p,id:p,...;..." (each step's top-8 distribution, in order)
 *   tokenize TEXT        sends "ids=..." and "text=<detokenized>"
 *   futures              receive futures: poll, wait with timeout, wait_any, short buffers, drop
 *   deferred             dealloc of a page that is not allocated, then synchronize
 *   invalid              calls with invalid arguments: "<call>=<code>|<last_error>"
 *   oob                  pie_send with a pointer outside linear memory (traps)
 *   oversize N           pie_send of N bytes
 *   http URL             GET URL: "http=<code>|<status>|<body or last_error>"
 *   sub TOPIC            subscribes, sends "subscribed", sends the first broadcast it receives
 *   pub TOPIC MSG        broadcasts MSG every 20 ms until a client message arrives
 *   hold N M             allocates N KV pages, sends "held=<code>", waits for a message, then
 *                        allocates M more (if M > 0), sends "more=<code>" and waits again
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_abi.h"

static char out[1 << 16];
static char err[512];

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    __builtin_va_list ap;
    __builtin_va_start(ap, fmt);
    int n = vsnprintf(out, sizeof out, fmt, ap);
    __builtin_va_end(ap);
    pie_send(out, (uint32_t)(n < (int)sizeof out ? n : (int)sizeof out - 1));
}

static const char *last_error(void) {
    int32_t n = pie_last_error(err, sizeof err - 1);
    err[n < 0 ? 0 : (n < (int32_t)sizeof err ? n : (int32_t)sizeof err - 1)] = '\0';
    return err;
}

static void report(const char *name, int32_t rc) { say("%s=%d|%s", name, rc, rc < 0 ? last_error() : ""); }

#define Q 1u

/* ---- generation --------------------------------------------------------------------------- */

#define DIST_K 8

static uint32_t dist[4096]; /* next_dist's payload: u32 k, k ids, k f32 probabilities */

/* Runs forward over toks[0..n) at positions at.., appending to pages, leaves the last token's
 * top-DIST_K next-token distribution in dist and returns its argmax (or -code). */
static int64_t step(const uint32_t *pages, uint32_t ps, uint32_t at, const uint32_t *toks,
                    uint32_t n) {
    uint32_t emb[64], pos[64], outp[8], out_emb = 100;
    for (uint32_t i = 0; i < n; i++) emb[i] = i, pos[i] = at + i;
    if (pie_embed_text(Q, emb, toks, pos, n) < 0) return -1;
    uint32_t ctx_pages = (at + ps - 1) / ps, total = at + n;
    uint32_t first = at / ps, last = (total - 1) / ps, n_out = last - first + 1;
    for (uint32_t i = 0; i < n_out; i++) outp[i] = pages[first + i];
    pie_abi_forward d = {
        .kv_page_ids = (uint32_t)(uintptr_t)pages, .n_kv_pages = ctx_pages,
        .kv_page_last_len = ctx_pages ? at - (ctx_pages - 1) * ps : 0,
        .input_embed_ids = (uint32_t)(uintptr_t)emb, .n_inputs = n,
        .output_kv_page_ids = (uint32_t)(uintptr_t)outp, .n_output_kv_pages = n_out,
        .output_embed_ids = (uint32_t)(uintptr_t)&out_emb, .n_outputs = 1,
    };
    int32_t rc = pie_forward(Q, &d);
    if (rc < 0) return rc;
    if ((rc = pie_next_dist(Q, &out_emb, 1, DIST_K, 0.0f, 7)) < 0) return rc;
    rc = pie_future_result(7, dist, sizeof dist);
    if (rc < 0) return rc;
    return dist[0] == DIST_K ? (int64_t)dist[1] : -1000; /* the most likely id comes first */
}

static int greedy(int n_new, const char *csv) {
    uint32_t toks[64], n = 0;
    for (const char *p = csv; *p && n < 64; n++) {
        toks[n] = (uint32_t)strtoul(p, (char **)&p, 10);
        if (*p == ',') p++;
    }
    pie_abi_model_info mi;
    if (pie_model_info("", 0, &mi) < 0 || pie_create_queue(Q, "", 0) < 0) return 2;
    uint32_t ps = mi.kv_page_size, pages[16], emb[101];
    for (uint32_t i = 0; i < 16; i++) pages[i] = i;
    for (uint32_t i = 0; i < 101; i++) emb[i] = i;
    if (pie_alloc_kv_pages(Q, pages, 16) < 0 || pie_alloc_embeds(Q, emb, 101) < 0) return 3;
    static char dists[1 << 15];
    char *w = out, *dw = dists;
    w += sprintf(w, "tokens=");
    dw += sprintf(dw, "dists=");
    uint32_t at = 0;
    for (int k = 0; k < n_new && k < 64; k++) {
        int64_t t = step(pages, ps, at, toks, n);
        if (t < 0) {
            say("error=%lld|%s", (long long)t, last_error());
            return 4;
        }
        at += n;
        toks[0] = (uint32_t)t;
        n = 1;
        w += sprintf(w, "%s%u", k ? "," : "", (uint32_t)t);
        for (int i = 0; i < DIST_K; i++) {
            float p;
            memcpy(&p, &dist[1 + DIST_K + i], sizeof p);
            dw += sprintf(dw, "%s%u:%.9g", i ? "," : k ? ";" : "", dist[1 + i], (double)p);
        }
    }
    pie_send(out, (uint32_t)(w - out));
    pie_send(dists, (uint32_t)(dw - dists));
    return 0;
}

/* ---- tokenizer ---------------------------------------------------------------------------- */

static int tokenize(const char *text) {
    uint32_t ids[8], all[1024];
    int32_t n = pie_tokenize("", 0, text, (uint32_t)strlen(text), 0, ids, 8);
    if (n < 0) {
        report("tokenize", n);
        return 1;
    }
    int32_t m = pie_tokenize("", 0, text, (uint32_t)strlen(text), 0, all, 1024);
    char *w = out;
    w += sprintf(w, "ids=");
    for (int32_t i = 0; i < m; i++) w += sprintf(w, "%s%u", i ? "," : "", all[i]);
    pie_send(out, (uint32_t)(w - out));
    say("short=%d", n == m && memcmp(ids, all, (size_t)(n < 8 ? n : 8) * 4) == 0);
    static char txt[4096];
    int32_t len = pie_detokenize("", 0, all, (uint32_t)m, txt, 4);
    int32_t len2 = pie_detokenize("", 0, all, (uint32_t)m, txt, sizeof txt);
    say("text=%.*s", len2, txt);
    say("detok_needed=%d", len == len2);
    char one[64];
    int32_t b = pie_token_bytes("", 0, all[0], one, sizeof one);
    say("first=%.*s", b < 0 ? 0 : b, one);
    report("unknown_id", pie_token_bytes("", 0, 0x7fffffff, one, sizeof one));
    return 0;
}

/* ---- futures ------------------------------------------------------------------------------ */

static int futures(void) {
    char buf[64];
    report("receive", pie_receive(1));
    report("poll_pending", pie_future_poll(1));
    report("wait_timeout", pie_future_wait(1, 20));
    report("busy", pie_receive(1));
    uint32_t ids[2] = {1, 2};
    report("wait_any_unarmed", pie_future_wait_any(ids, 2, 0));
    report("receive2", pie_receive(2));
    report("wait_any_timeout", pie_future_wait_any(ids, 2, 10));
    say("ready=1"); /* the test now sends "first message" and "second" */
    report("wait_any", pie_future_wait_any(ids, 2, -1));
    report("wait", pie_future_wait(1, -1));
    report("poll_done", pie_future_poll(1));
    report("result_short", pie_future_result(1, buf, 5));
    say("short_bytes=%.5s", buf);
    report("result_full", pie_future_result(1, buf, sizeof buf));
    say("full_bytes=%.13s", buf);
    report("poll_released", pie_future_poll(1));
    report("wait2", pie_future_wait(2, -1));
    report("drop", pie_future_drop(2)); /* resolved with "second": discarded */
    report("drop_again", pie_future_drop(2));
    report("result_unarmed", pie_future_result(3, buf, sizeof buf));
    report("receive4", pie_receive(4));
    say("closing=1"); /* the test closes the input */
    int32_t n = pie_future_result(4, buf, sizeof buf);
    report("after_close", n);
    return 0;
}

/* ---- deferred errors ---------------------------------------------------------------------- */

static int deferred(void) {
    if (pie_create_queue(Q, "", 0) < 0) return 2;
    uint32_t bogus = 12345;
    report("dealloc", pie_dealloc_kv_pages(Q, &bogus, 1));
    report("sync_call", pie_synchronize(Q, 5));
    report("sync1", pie_future_result(5, NULL, 0));
    pie_synchronize(Q, 5);
    report("sync2", pie_future_result(5, NULL, 0));
    return 0;
}

/* ---- invalid arguments -------------------------------------------------------------------- */

static int invalid(void) {
    uint32_t ids[2] = {1, 2};
    report("queue0", pie_create_queue(0, "", 0));
    report("unknown_model", pie_create_queue(Q, "no-such-model", 13));
    report("no_queue", pie_alloc_kv_pages(9, ids, 1));
    pie_create_queue(Q, "", 0);
    report("dup_queue", pie_create_queue(Q, "", 0));
    report("n0", pie_alloc_kv_pages(Q, ids, 0));
    report("nan", pie_next_dist(Q, ids, 1, 1, NAN, 3));
    report("negative_temp", pie_next_dist(Q, ids, 1, 1, -1.0f, 3));
    report("future0", pie_next_dist(Q, ids, 1, 1, 1.0f, 0));
    report("poll_unknown", pie_future_poll(77));
    report("topk", pie_next_dist(Q, ids, 1, 1000000, 1.0f, 3));
    report("model_info_unknown", pie_model_info("zz", 2, &(pie_abi_model_info){0}));
    return 0;
}

/* ---- messaging ---------------------------------------------------------------------------- */

static char msg[4096];

static int sub(const char *topic) {
    pie_subscribe(topic, (uint32_t)strlen(topic));
    pie_subscription_receive(1);
    pie_future_poll(1); /* a poll sends the staged subscribe */
    say("subscribed=1");
    int32_t n = pie_future_result(1, msg, sizeof msg);
    if (n < 0) {
        report("sub", n);
        return 1;
    }
    uint32_t tl;
    memcpy(&tl, msg, 4);
    say("got=%.*s|%.*s", (int)tl, msg + 4, (int)(n - 4 - (int)tl), msg + 4 + tl);
    return 0;
}

static int pub(const char *topic, const char *m) {
    pie_receive(1);
    do {
        int32_t rc = pie_broadcast(topic, (uint32_t)strlen(topic), m, (uint32_t)strlen(m));
        if (rc < 0) {
            report("broadcast", rc);
            return 1;
        }
    } while (pie_future_wait(1, 20) == 0);
    return 0;
}

static int hold(int n, int more) {
    static uint32_t pages[256];
    if (n + more > 256) return 2;
    for (int i = 0; i < n + more; i++) pages[i] = (uint32_t)i;
    if (pie_create_queue(Q, "", 0) < 0) return 2;
    pie_alloc_kv_pages(Q, pages, (uint32_t)n);
    pie_synchronize(Q, 5);
    report("held", pie_future_result(5, NULL, 0));
    pie_receive(1);
    report("hold_wait", pie_future_result(1, msg, sizeof msg));
    if (more == 0) return 0;
    pie_alloc_kv_pages(Q, pages + n, (uint32_t)more);
    pie_synchronize(Q, 5);
    report("more", pie_future_result(5, NULL, 0));
    pie_receive(1);
    report("more_wait", pie_future_result(1, msg, sizeof msg));
    return 0;
}

/* GET url with the header X-Test and the header lines extra. */
static int http(const char *url, const char *extra) {
    static char body[1 << 16];
    char headers[512];
    int hl = snprintf(headers, sizeof headers, "X-Test: 1\n%s", extra);
    int32_t rc =
        pie_http_request("GET", 3, url, (uint32_t)strlen(url), headers, (uint32_t)hl, "", 0, 9);
    if (rc < 0) {
        report("http", rc);
        return 0;
    }
    int32_t n = pie_future_result(9, body, sizeof body);
    if (n < 0) {
        report("http", n);
        return 0;
    }
    uint32_t status;
    memcpy(&status, body, 4);
    say("http=%d|%u|%.*s", 0, status, n - 4, body + 4);
    return 0;
}

int main(int argc, char **argv) {
    const char *s = argc > 1 ? argv[1] : "";
    const char *a = argc > 2 ? argv[2] : "";
    const char *b = argc > 3 ? argv[3] : "";
    if (!strcmp(s, "greedy")) return greedy(atoi(a), b);
    if (!strcmp(s, "tokenize")) return tokenize(a);
    if (!strcmp(s, "futures")) return futures();
    if (!strcmp(s, "deferred")) return deferred();
    if (!strcmp(s, "invalid")) return invalid();
    if (!strcmp(s, "oob")) return pie_send((const void *)(uintptr_t)0xfffffff0u, 64) ? 1 : 0;
    if (!strcmp(s, "oversize")) {
        static char big[1 << 16];
        report("send", pie_send(big, (uint32_t)atoi(a)));
        return 0;
    }
    if (!strcmp(s, "http")) return http(a, b);
    if (!strcmp(s, "sub")) return sub(a);
    if (!strcmp(s, "pub")) return pub(a, b);
    if (!strcmp(s, "hold")) return hold(atoi(a), atoi(b));
    return 9;
}
