/* fuzz_gw_openai.c — the gateway's OpenAI request parsing and the inferlet's messages
 * (services/gateway/gw_openai.c).
 *
 * Input: byte 0 picks the endpoint (even: completions, odd: chat); the rest is split at the
 * first NUL into a request body and a stream of inferlet messages separated by '\n'. The body
 * goes through gw_req_parse (and, when valid, gw_req_args); the messages through
 * gw_result_apply, then every response and chunk builder runs. Checks: no crash, leak or UB; a
 * refusal has an HTTP status in 400..599 and a message; every JSON produced parses back. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "fuzz_util.h"
#include "gw_openai.h"

static void must_parse(char *json, const char *what) {
    if (json == NULL) fuzz_fail("%s: NULL", what);
    json_t *v = json_loads(json, JSON_ALLOW_NUL, NULL); /* \u0000 is valid JSON */
    if (v == NULL) fuzz_fail("%s is not JSON: %.200s", what, json);
    json_decref(v);
    free(json);
}

static void check_error(const gw_error *e, const char *what) {
    if (e->http_status < 400 || e->http_status > 599 || e->message[0] == '\0')
        fuzz_fail("%s: status %d, message \"%s\"", what, e->http_status, e->message);
    must_parse(gw_error_json(e), "error JSON");
}

static void feed(gw_result *res, const char *p, size_t n) {
    while (n > 0) {
        const char *nl = memchr(p, '\n', n);
        size_t len = nl ? (size_t)(nl - p) : n;
        gw_event ev;
        gw_error e;
        if (!gw_result_apply(res, p, len, &ev, &e)) check_error(&e, "gw_result_apply");
        else if (ev.kind == GW_EV_ERROR) check_error(&e, "an inferlet refusal");
        else if (ev.kind == GW_EV_TOKEN) must_parse(gw_chunk_token(res, &ev), "token chunk");
        else if (ev.kind == GW_EV_FINISH) must_parse(gw_chunk_finish(res, ev.choice), "finish chunk");
        json_decref(ev.logprob);
        p += len + (nl ? 1 : 0);
        n -= len + (nl ? 1 : 0);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    gw_endpoint ep = (data[0] & 1) ? GW_CHAT : GW_COMPLETIONS;
    const char *body = (const char *)data + 1;
    size_t rest = size - 1;
    const char *nul = memchr(body, 0, rest);
    size_t body_len = nul ? (size_t)(nul - body) : rest;
    gw_req r;
    gw_error e;
    if (!gw_req_parse(ep, body, body_len, &r, &e)) {
        check_error(&e, "gw_req_parse");
        return 0;
    }
    char **args = NULL;
    size_t n_args = 0;
    if (!gw_req_args(&r, &args, &n_args)) fuzz_fail("gw_req_args failed");
    gw_args_free(args, n_args);
    gw_result res;
    if (!gw_result_init(&res, &r)) fuzz_fail("gw_result_init failed");
    if (nul) feed(&res, nul + 1, rest - body_len - 1);
    must_parse(gw_result_json(&res), "response");
    must_parse(gw_chunk_usage(&res), "usage chunk");
    must_parse(gw_chunk_role(&res, 0), "role chunk");
    gw_result_free(&res);
    gw_req_free(&r);
    return 0;
}
