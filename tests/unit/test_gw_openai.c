/* test_gw_openai.c — the gateway's OpenAI request parsing, launch arguments and response JSON
 * (services/gateway/gw_openai.c), without a cluster: requests in, the inferlet's messages in,
 * JSON out. */
#include <criterion/criterion.h>
#include <string.h>

#include "gw_openai.h"

static bool parse(gw_endpoint ep, const char *body, gw_req *r, gw_error *e) {
    return gw_req_parse(ep, body, strlen(body), r, e);
}

/* Asserts that body fails with HTTP 400 naming param (NULL: no param). */
static void assert_refused(gw_endpoint ep, const char *body, const char *param) {
    gw_req r;
    gw_error e;
    cr_assert_not(parse(ep, body, &r, &e), "accepted: %s", body);
    cr_assert_eq(e.http_status, 400, "%s: status %d", body, e.http_status);
    if (param) cr_assert_str_eq(e.param ? e.param : "(null)", param, "%s: %s", body, e.message);
    else cr_assert_null(e.param, "%s", body);
    char *json = gw_error_json(&e);
    cr_assert_not_null(strstr(json, "\"type\":\"invalid_request_error\""), "%s", json);
    free(json);
}

Test(gw_openai, completion_defaults_follow_openai) {
    gw_req r;
    gw_error e;
    cr_assert(parse(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"hi\"}", &r, &e), "%s", e.message);
    cr_assert_str_eq(r.model, "m");
    cr_assert_str_eq(r.prompt, "hi");
    cr_assert_eq(r.max_tokens, 16); /* OpenAI's completions default */
    cr_assert_eq(r.n, 1);
    cr_assert_float_eq(r.temperature, 1.0, 0);
    cr_assert_float_eq(r.top_p, 1.0, 0);
    cr_assert_not(r.stream);
    cr_assert_not(r.logprobs);
    gw_req_free(&r);
}

Test(gw_openai, chat_takes_max_completion_tokens_and_joins_text_parts) {
    gw_req r;
    gw_error e;
    const char *body =
        "{\"model\":\"m\",\"max_tokens\":5,\"max_completion_tokens\":7,\"messages\":["
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
        "{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\",\"content\":null}],"
        "\"unknown_field\":{\"ignored\":true}}";
    cr_assert(parse(GW_CHAT, body, &r, &e), "%s", e.message);
    cr_assert_eq(r.max_tokens, 7);
    cr_assert_eq(json_array_size(r.messages), 2);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(r.messages, 0), "content")),
                     "ab");
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(r.messages, 1), "content")),
                     "");
    gw_req_free(&r);
}

Test(gw_openai, bad_values_are_400_naming_the_parameter) {
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"temperature\":2.5}",
                   "temperature");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"top_p\":-0.1}", "top_p");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"n\":17}", "n");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":0}",
                   "max_tokens");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":1.5}",
                   "max_tokens");
    assert_refused(GW_COMPLETIONS,
                   "{\"model\":\"m\",\"prompt\":\"x\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}",
                   "stop");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"stop\":[1]}", "stop");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"presence_penalty\":3}",
                   "presence_penalty");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":[1,2,3]}", "prompt");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\"}", "prompt");
    assert_refused(GW_COMPLETIONS, "{\"prompt\":\"x\"}", "model");
    assert_refused(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"logprobs\":21}",
                   "logprobs");
    assert_refused(GW_CHAT, "{\"model\":\"m\",\"messages\":[]}", "messages");
    assert_refused(GW_CHAT, "{\"model\":\"m\",\"messages\":[{\"content\":\"x\"}]}", "messages");
    assert_refused(GW_CHAT,
                   "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
                   "\"image_url\",\"image_url\":{\"url\":\"x\"}}]}]}",
                   "messages");
    assert_refused(GW_CHAT,
                   "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                   "\"top_logprobs\":2}",
                   "top_logprobs");
    assert_refused(GW_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                            "\"stream\":\"yes\"}",
                   "stream");
}

Test(gw_openai, unparseable_bodies_are_400_without_a_parameter) {
    assert_refused(GW_CHAT, "{\"model\":", NULL);
    assert_refused(GW_CHAT, "[1,2]", NULL);
    assert_refused(GW_CHAT, "", NULL);
    assert_refused(GW_CHAT, "{\"model\":\"a\",\"model\":\"b\"}", NULL); /* duplicate keys */
}

/* The launch arguments, joined with spaces. */
static void args_of(const char *body, gw_endpoint ep, char *out, size_t cap) {
    gw_req r;
    gw_error e;
    cr_assert(parse(ep, body, &r, &e), "%s", e.message);
    char **args = NULL;
    size_t n = 0;
    cr_assert(gw_req_args(&r, &args, &n));
    out[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        strncat(out, args[i], cap - strlen(out) - 1);
        if (i + 1 < n) strncat(out, " ", cap - strlen(out) - 1);
    }
    gw_args_free(args, n);
    gw_req_free(&r);
}

Test(gw_openai, launch_arguments_carry_every_sampling_parameter) {
    char a[1024];
    args_of("{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":9,\"temperature\":0.5,\"top_p\":0.25,"
            "\"seed\":-3,\"n\":2,\"stop\":[\"\\n\",\"END\"],\"logprobs\":3,"
            "\"presence_penalty\":0.5,\"frequency_penalty\":-1,\"ignore_eos\":true}",
            GW_COMPLETIONS, a, sizeof a);
    cr_assert_str_eq(a, "--max-tokens 9 --temperature 0.5 --top-p 0.25 --seed -3 --n 2 --stop \n "
                        "--stop END --logprobs 3 --presence-penalty 0.5 --frequency-penalty -1 "
                        "--ignore-eos");
    args_of("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_p\":0,"
            "\"stop\":\"\"}",
            GW_CHAT, a, sizeof a);
    cr_assert_str_eq(a, "--max-tokens 0 --temperature 0 --chat"); /* top_p 0 = greedy */
}

/* Feeds the inferlet's messages into a result for body. */
static void run_messages(gw_endpoint ep, const char *body, const char *const *msgs, size_t n,
                         gw_req *r, gw_result *res) {
    gw_error e;
    cr_assert(parse(ep, body, r, &e), "%s", e.message);
    cr_assert(gw_result_init(res, r));
    for (size_t i = 0; i < n; i++) {
        gw_event ev;
        cr_assert(gw_result_apply(res, msgs[i], strlen(msgs[i]), &ev, &e), "%s: %s", msgs[i],
                  e.message);
        json_decref(ev.logprob);
    }
}

Test(gw_openai, chat_response_collects_text_finish_and_usage) {
    const char *msgs[] = {
        "{\"prompt_tokens\":11}",
        "{\"c\":1,\"text\":\"B\"}",
        "{\"c\":0,\"text\":\"Hel\"}",
        "{\"c\":0,\"text\":\"lo\"}",
        "{\"c\":0,\"finish\":\"stop\",\"completion_tokens\":3}",
        "{\"c\":1,\"finish\":\"length\",\"completion_tokens\":1}",
    };
    gw_req r;
    gw_result res;
    run_messages(GW_CHAT,
                 "{\"model\":\"tiny\",\"n\":2,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
                 msgs, 6, &r, &res);
    char *json = gw_result_json(&res);
    json_t *v = json_loads(json, 0, NULL);
    cr_assert_not_null(v, "%s", json);
    cr_assert_str_eq(json_string_value(json_object_get(v, "object")), "chat.completion");
    cr_assert_str_eq(json_string_value(json_object_get(v, "model")), "tiny");
    cr_assert_eq(strncmp(json_string_value(json_object_get(v, "id")), "chatcmpl-", 9), 0);
    json_t *c0 = json_array_get(json_object_get(v, "choices"), 0);
    json_t *c1 = json_array_get(json_object_get(v, "choices"), 1);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(c0, "message"), "content")),
                     "Hello");
    cr_assert_str_eq(json_string_value(json_object_get(c0, "finish_reason")), "stop");
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(c1, "message"), "content")),
                     "B");
    cr_assert_str_eq(json_string_value(json_object_get(c1, "finish_reason")), "length");
    json_t *u = json_object_get(v, "usage");
    cr_assert_eq(json_integer_value(json_object_get(u, "prompt_tokens")), 11);
    cr_assert_eq(json_integer_value(json_object_get(u, "completion_tokens")), 4);
    cr_assert_eq(json_integer_value(json_object_get(u, "total_tokens")), 15);
    json_decref(v);
    free(json);
    gw_result_free(&res);
    gw_req_free(&r);
}

/* A byte-level token can be the NUL byte; the inferlet sends it as "\u0000", which is valid JSON
 * the gateway must carry through to the response and the stream, not call a protocol error. */
Test(gw_openai, a_nul_byte_in_the_text_survives_to_the_response) {
    const char *msgs[] = {
        "{\"prompt_tokens\":3}",
        "{\"c\":0,\"text\":\"a\\u0000b\"}",
        "{\"c\":0,\"finish\":\"length\",\"completion_tokens\":1}",
    };
    gw_req r;
    gw_result res;
    gw_error e;
    cr_assert(parse(GW_COMPLETIONS, "{\"model\":\"tiny\",\"prompt\":\"x\"}", &r, &e), "%s",
              e.message);
    cr_assert(gw_result_init(&res, &r));
    char *chunk = NULL;
    for (size_t i = 0; i < 3; i++) {
        gw_event ev;
        cr_assert(gw_result_apply(&res, msgs[i], strlen(msgs[i]), &ev, &e), "%s: %s", msgs[i],
                  e.message);
        if (ev.kind == GW_EV_TOKEN) chunk = gw_chunk_token(&res, &ev);
        json_decref(ev.logprob);
    }
    cr_assert_not_null(chunk);
    cr_assert_not_null(strstr(chunk, "\"a\\u0000b\""), "%s", chunk);
    char *json = gw_result_json(&res);
    json_t *v = json_loads(json, JSON_ALLOW_NUL, NULL);
    cr_assert_not_null(v, "%s", json);
    json_t *text = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "text");
    cr_assert_eq(json_string_length(text), 3, "%s", json);
    cr_assert_eq(memcmp(json_string_value(text), "a\0b", 3), 0, "%s", json);
    json_decref(v);
    free(json);
    free(chunk);
    gw_result_free(&res);
    gw_req_free(&r);
}

Test(gw_openai, completion_logprobs_take_openai_legacy_shape) {
    const char *msgs[] = {
        "{\"prompt_tokens\":2}",
        "{\"c\":0,\"text\":\"ab\",\"token\":{\"id\":5,\"bytes\":[97,98],\"logprob\":-0.5,"
        "\"top\":[{\"id\":5,\"bytes\":[97,98],\"logprob\":-0.5},{\"id\":6,\"bytes\":[255],"
        "\"logprob\":-1.5}]}}",
        "{\"c\":0,\"text\":\"c\",\"token\":{\"id\":7,\"bytes\":[99],\"logprob\":-0.25,\"top\":[]}}",
        "{\"c\":0,\"finish\":\"length\",\"completion_tokens\":2}",
    };
    gw_req r;
    gw_result res;
    run_messages(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"logprobs\":2}", msgs, 4, &r,
                 &res);
    char *json = gw_result_json(&res);
    json_t *v = json_loads(json, 0, NULL);
    json_t *lp = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "logprobs");
    cr_assert_not_null(lp, "%s", json);
    cr_assert_str_eq(json_string_value(json_array_get(json_object_get(lp, "tokens"), 1)), "c");
    cr_assert_float_eq(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 0)),
                       -0.5, 1e-12);
    cr_assert_eq(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)), 2);
    json_t *top0 = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    cr_assert_eq(json_object_size(top0), 2, "%s", json);
    cr_assert_not_null(json_object_get(top0, "\xEF\xBF\xBD"), "invalid UTF-8 → U+FFFD: %s", json);
    json_decref(v);
    free(json);
    gw_result_free(&res);
    gw_req_free(&r);
}

Test(gw_openai, inferlet_refusal_becomes_a_400_with_its_code) {
    gw_req r;
    gw_error e;
    cr_assert(parse(GW_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
                    &r, &e));
    gw_result res;
    cr_assert(gw_result_init(&res, &r));
    const char *m = "{\"error\":{\"code\":\"context_length_exceeded\",\"message\":\"too long\"}}";
    gw_event ev;
    cr_assert(gw_result_apply(&res, m, strlen(m), &ev, &e));
    cr_assert_eq(ev.kind, GW_EV_ERROR);
    cr_assert_eq(e.http_status, 400);
    cr_assert_str_eq(e.code, "context_length_exceeded");
    cr_assert_str_eq(e.param, "messages");
    cr_assert_str_eq(e.message, "too long");
    const char *blank = "{\"error\":{\"message\":\"\"}}"; /* found by fuzz_gw_openai */
    cr_assert(gw_result_apply(&res, blank, strlen(blank), &ev, &e));
    cr_assert_str_eq(e.message, "the request cannot be served", "an error always says something");
    gw_result_free(&res);
    gw_req_free(&r);
}

Test(gw_openai, protocol_violations_are_500_not_crashes) {
    gw_req r;
    gw_error e;
    cr_assert(parse(GW_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\"}", &r, &e));
    gw_result res;
    cr_assert(gw_result_init(&res, &r));
    const char *bad[] = {"not json", "[]", "{\"c\":1,\"text\":\"x\"}", "{\"c\":-1,\"text\":\"x\"}",
                         "{\"c\":0}", "{\"c\":0,\"finish\":\"later\",\"completion_tokens\":1}",
                         "{\"c\":0,\"text\":\"x\",\"token\":{\"bytes\":\"no\"}}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gw_event ev;
        cr_assert_not(gw_result_apply(&res, bad[i], strlen(bad[i]), &ev, &e), "%s", bad[i]);
        cr_assert_eq(e.http_status, 500, "%s", bad[i]);
        json_decref(ev.logprob);
    }
    gw_result_free(&res);
    gw_req_free(&r);
}

Test(gw_openai, stream_chunks_have_openai_shape) {
    const char *msgs[] = {"{\"prompt_tokens\":1}", "{\"c\":0,\"text\":\"hi\"}"};
    gw_req r;
    gw_result res;
    run_messages(GW_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
                 msgs, 2, &r, &res);
    char *role = gw_chunk_role(&res, 0);
    cr_assert_not_null(strstr(role, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}"), "%s",
                       role);
    cr_assert_not_null(strstr(role, "\"object\":\"chat.completion.chunk\""), "%s", role);
    gw_event ev = {.kind = GW_EV_TOKEN, .choice = 0, .text = "hi", .text_len = 2};
    char *tok = gw_chunk_token(&res, &ev);
    cr_assert_not_null(strstr(tok, "\"delta\":{\"content\":\"hi\"}"), "%s", tok);
    cr_assert_not_null(strstr(tok, "\"finish_reason\":null"), "%s", tok);
    res.choices[0].finish = "length";
    char *fin = gw_chunk_finish(&res, 0);
    cr_assert_not_null(strstr(fin, "\"delta\":{}"), "%s", fin);
    cr_assert_not_null(strstr(fin, "\"finish_reason\":\"length\""), "%s", fin);
    char *usage = gw_chunk_usage(&res);
    cr_assert_not_null(strstr(usage, "\"choices\":[]"), "%s", usage);
    cr_assert_not_null(strstr(usage, "\"prompt_tokens\":1"), "%s", usage);
    free(role);
    free(tok);
    free(fin);
    free(usage);
    gw_result_free(&res);
    gw_req_free(&r);
}

Test(gw_openai, json_text_replaces_invalid_utf8_only) {
    const char in[] = "a\xC3\xA9" "b\xFF" "c\xE2\x82" "d\xF0\x9F\x98\x80";
    json_t *s = gw_json_text(in, sizeof in - 1);
    cr_assert_str_eq(json_string_value(s),
                     "a\xC3\xA9" "b\xEF\xBF\xBD" "c\xEF\xBF\xBD\xEF\xBF\xBD" "d\xF0\x9F\x98\x80");
    json_decref(s);
    const char overlong[] = "\xC0\xAF\xED\xA0\x80";
    s = gw_json_text(overlong, sizeof overlong - 1);
    cr_assert_eq(json_string_length(s), 15, "5 invalid bytes → 5 × U+FFFD");
    json_decref(s);
}
