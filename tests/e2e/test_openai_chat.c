/* test_openai_chat.c — the gateway's built-in inferlet (inferlets/openai_chat) end to end: one
 * cluster (pie-controller, CPU pie-worker on small-f32, pie-lifecycle on loopback) for the whole
 * file; every run's messages are parsed as JSON (jansson, which also rejects invalid UTF-8) and
 * checked against the protocol of inferlets/openai_chat/README.md (prompt_tokens or one error
 * first; per choice token messages, then exactly one finish) before the test looks at them.
 *
 * Covers: greedy output equals text_completion's for the same prompt and max tokens (same
 * prompt tokens, same finish; text compared as UTF-8, invalid bytes as U+FFFD), also when an eos
 * token ends it (no message for it, unless logprobs list it with empty text); --max-tokens ends
 * with "length" after exactly N tokens, also with a held-back stop-string prefix at the end; a stop
 * string straddling two tokens cuts the text before it and finishes with "stop" at the token that
 * completed it; --n 2 with a seed is reproducible, another seed differs, choice 1 equals a single
 * choice seeded S + 1, and --n 16 fits the instance's default quotas; logprobs: K alternatives
 * sorted descending, the sampled token's logprob <= 0 and equal to top[0] under greedy, its bytes
 * spell the text, and the logprobs sum to the engine's own log-probability of the tokens also
 * when sampling at another temperature; presence and frequency penalties change a repetitive
 * greedy continuation, and every penalised greedy choice is the argmax of the penalised logprobs
 * of the listed alternatives; context_length_exceeded with OpenAI's wording (prompt + max tokens,
 * and a prompt alone over the context); bad values give invalid_value, other bad arguments and
 * an empty prompt invalid_request_error; --chat parses special tokens and adds no BOS. */
#include <criterion/criterion.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie_testutil.h"

TestSuite(e2e, .fini = pie_test_leak_check, .timeout = 900);

#define CTX_TOKENS  4096 /* small-f32's max_position_embeddings: the model's context */
#define MAX_CHOICES 16

static const char *const PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time";

/* ---- runs and their messages ----------------------------------------------------------------- */

typedef struct choice_res {
    char *text; /* the "text" fields concatenated (NUL-terminated) */
    size_t text_len;
    size_t n_msgs;  /* token messages */
    json_t *tokens; /* their "token" members, in order */
    char finish[16];
    long completion_tokens;
} choice_res;

typedef struct oai_res {
    long prompt_tokens; /* -1: the request was refused with an error */
    char code[64], message[1024];
    uint32_t n_choices;
    choice_res ch[MAX_CHOICES];
} oai_res;

/* The whole file's world. */
typedef struct env {
    e2e_cluster c;
    e2e_ref *ref;
    char *oai, *tc; /* program ids: openai_chat, text_completion */
} env;

static char *describe(const char *const *args) {
    static char s[512];
    size_t n = 0;
    s[0] = 0;
    for (size_t i = 0; args[i] && n < sizeof s - 1; i++)
        n += (size_t)snprintf(s + n, sizeof s - n, "%s%s", i ? " " : "", args[i]);
    return s;
}

static long json_long(json_t *o, const char *key, const char *what) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_integer(v), "%s: no integer \"%s\"", what, key);
    return (long)json_integer_value(v);
}

/* Checks one message against the protocol and adds it to *res. */
static void take_msg(oai_res *res, size_t i, const char *msg, size_t len, const char *what) {
    json_error_t je;
    /* ALLOW_NUL: a sampled byte-level token can be the NUL byte, sent as "\u0000". */
    json_t *m = json_loadb(msg, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    cr_assert(json_is_object(m), "%s: message %zu is not a JSON object (%s): %.*s", what, i,
              je.text, (int)len, msg);
    if (i == 0) {
        json_t *err = json_object_get(m, "error");
        if (err) {
            const char *code = json_string_value(json_object_get(err, "code"));
            const char *message = json_string_value(json_object_get(err, "message"));
            cr_assert(code && message, "%s: malformed error %.*s", what, (int)len, msg);
            snprintf(res->code, sizeof res->code, "%s", code);
            snprintf(res->message, sizeof res->message, "%s", message);
        } else {
            res->prompt_tokens = json_long(m, "prompt_tokens", what);
            cr_assert_gt(res->prompt_tokens, 0, "%s", what);
        }
        json_decref(m);
        return;
    }
    cr_assert_geq(res->prompt_tokens, 0, "%s: message %zu after an error: %.*s", what, i, (int)len,
                  msg);
    long c = json_long(m, "c", what);
    cr_assert(c >= 0 && c < MAX_CHOICES, "%s: choice %ld", what, c);
    choice_res *ch = &res->ch[c];
    if (res->n_choices <= (uint32_t)c) res->n_choices = (uint32_t)c + 1;
    cr_assert(!ch->finish[0], "%s: message %zu for choice %ld after its finish: %.*s", what, i, c,
              (int)len, msg);
    json_t *finish = json_object_get(m, "finish");
    if (finish) {
        cr_assert(json_is_string(finish), "%s: %.*s", what, (int)len, msg);
        snprintf(ch->finish, sizeof ch->finish, "%s", json_string_value(finish));
        ch->completion_tokens = json_long(m, "completion_tokens", what);
    } else {
        json_t *text = json_object_get(m, "text");
        cr_assert(json_is_string(text), "%s: no \"text\" in %.*s", what, (int)len, msg);
        size_t tl = json_string_length(text);
        ch->text = realloc(ch->text, ch->text_len + tl + 1);
        cr_assert(ch->text);
        memcpy(ch->text + ch->text_len, json_string_value(text), tl);
        ch->text_len += tl;
        ch->text[ch->text_len] = 0;
        ch->n_msgs++;
        json_t *token = json_object_get(m, "token");
        if (token) {
            if (!ch->tokens) ch->tokens = json_array();
            json_array_append(ch->tokens, token);
        }
    }
    json_decref(m);
}

/* Runs openai_chat with args and the prompt as its message; it must exit 0 and keep the
 * protocol: prompt_tokens or a single error first, every choice up to the last one finished. */
static void oai_call(env *e, const char *const *args, const char *prompt, oai_res *res) {
    const char *what = describe(args);
    const char *in[] = {prompt, NULL};
    e2e_run r;
    e2e_run_program(&e->c, e->oai, args, in, &r);
    e2e_assert_success(&r, what);
    *res = (oai_res){.prompt_tokens = -1};
    cr_assert_gt(r.n_msgs, 0, "%s: no messages", what);
    for (size_t i = 0; i < r.n_msgs; i++) take_msg(res, i, r.msgs[i], r.msg_lens[i], what);
    if (res->prompt_tokens < 0) cr_assert_eq(r.n_msgs, 1, "%s: an error and more", what);
    for (uint32_t c = 0; c < res->n_choices; c++)
        cr_assert(res->ch[c].finish[0], "%s: choice %u never finished", what, c);
    e2e_run_free(&r);
}

static void oai_res_free(oai_res *res) {
    for (uint32_t c = 0; c < MAX_CHOICES; c++) {
        free(res->ch[c].text);
        json_decref(res->ch[c].tokens);
    }
    *res = (oai_res){0};
}

static void expect_finish(const oai_res *res, uint32_t c, const char *finish, long tokens,
                          const char *what) {
    cr_expect_str_eq(res->ch[c].finish, finish, "%s: choice %u", what, c);
    cr_expect_eq(res->ch[c].completion_tokens, tokens, "%s: choice %u: completion_tokens %ld", what,
                 c, res->ch[c].completion_tokens);
}

/* Token ids of choice c's token messages (logprobs runs). */
static size_t token_ids(const oai_res *res, uint32_t c, uint32_t *ids, size_t cap) {
    size_t n = json_array_size(res->ch[c].tokens);
    cr_assert_leq(n, cap);
    for (size_t i = 0; i < n; i++)
        ids[i] = (uint32_t)json_long(json_array_get(res->ch[c].tokens, i), "id", "token");
    return n;
}

static double json_double(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "no number \"%s\"", key);
    return json_number_value(v);
}

/* The raw bytes of choice c's tokens, concatenated (malloc'd, NUL-terminated; logprobs runs). */
static char *token_bytes(const oai_res *res, uint32_t c, size_t *len) {
    size_t n = 0;
    char *b = malloc(1);
    for (size_t i = 0; i < json_array_size(res->ch[c].tokens); i++) {
        json_t *bytes = json_object_get(json_array_get(res->ch[c].tokens, i), "bytes");
        b = realloc(b, n + json_array_size(bytes) + 1);
        for (size_t j = 0; j < json_array_size(bytes); j++)
            b[n++] = (char)json_integer_value(json_array_get(bytes, j));
    }
    b[n] = 0;
    *len = n;
    return b;
}

/* s[0..n) as the protocol's "text" carries it: each byte that does not belong to a well-formed
 * UTF-8 sequence (Unicode's table 3-7) becomes U+FFFD. Malloc'd, NUL-terminated. */
static char *as_utf8(const char *s, size_t n, size_t *len) {
    static const struct {
        unsigned char lead_lo, lead_hi, lo, hi;
        int len;
    } forms[] = {
        {0x00, 0x7F, 0, 0, 1},       {0xC2, 0xDF, 0x80, 0xBF, 2}, {0xE0, 0xE0, 0xA0, 0xBF, 3},
        {0xE1, 0xEC, 0x80, 0xBF, 3}, {0xED, 0xED, 0x80, 0x9F, 3}, {0xEE, 0xEF, 0x80, 0xBF, 3},
        {0xF0, 0xF0, 0x90, 0xBF, 4}, {0xF1, 0xF3, 0x80, 0xBF, 4}, {0xF4, 0xF4, 0x80, 0x8F, 4}};
    const unsigned char *p = (const unsigned char *)s;
    char *out = malloc(3 * n + 1);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int l = 0;
        for (size_t f = 0; f < sizeof forms / sizeof forms[0] && !l; f++) {
            if (p[i] < forms[f].lead_lo || p[i] > forms[f].lead_hi) continue;
            bool ok = forms[f].len == 1 ||
                      (i + forms[f].len <= n && p[i + 1] >= forms[f].lo && p[i + 1] <= forms[f].hi);
            for (int k = 2; ok && k < forms[f].len; k++) ok = (p[i + k] & 0xC0) == 0x80;
            if (ok) l = forms[f].len;
        }
        if (l) {
            memcpy(out + o, p + i, (size_t)l);
            o += (size_t)l;
            i += (size_t)l;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    out[o] = 0;
    *len = o;
    return out;
}

/* ---- the checks ------------------------------------------------------------------------------ */

static void greedy_equals_text_completion(env *e, const char *prompt, const char *max) {
    e2e_run tc;
    const char *targs[] = {"--prompt", prompt, "--max-tokens", max, NULL};
    e2e_run_program(&e->c, e->tc, targs, NULL, &tc);
    e2e_assert_success(&tc, "text_completion");
    cr_assert_eq(tc.n_msgs, 2);
    long tc_tokens = 0;
    char tc_reason[32] = "";
    cr_assert_eq(sscanf(tc.msgs[1], "reason=%31s tokens=%ld", tc_reason, &tc_tokens), 2, "%s",
                 tc.msgs[1]);

    oai_res res;
    const char *args[] = {"--max-tokens", max, "--temperature", "0", NULL};
    oai_call(e, args, prompt, &res);
    uint32_t p[E2E_MAX_TOKENS];
    cr_expect_eq((size_t)res.prompt_tokens, e2e_ref_prompt(e->ref, &prompt, 1, p),
                 "prompt_tokens counts the BOS and the prompt's tokens");
    cr_assert_eq(res.n_choices, 1);
    /* the same bytes, except that the protocol's text is always UTF-8 */
    size_t want_len;
    char *want = as_utf8(tc.msgs[0], tc.msg_lens[0], &want_len);
    cr_expect(res.ch[0].text_len == want_len && !memcmp(res.ch[0].text, want, want_len),
              "openai_chat greedy:\n  \"%s\"\ntext_completion (as UTF-8):\n  \"%s\"",
              res.ch[0].text, want);
    free(want);
    bool by_eos = strcmp(tc_reason, "stop_token") == 0;
    expect_finish(&res, 0, by_eos ? "stop" : "length", tc_tokens + by_eos, "greedy");
    cr_expect_eq((long)res.ch[0].n_msgs, tc_tokens, "a message per token of the text");
    oai_res_free(&res);
    e2e_run_free(&tc);
}

/* "The end." is a prompt after which greedy decoding samples an eos token (28 tokens later) */
static void a_stop_token_ends_with_stop_and_is_listed_with_logprobs(env *e) {
    const char *prompt = "The end.";
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(e->ref, &prompt, 1, p);
    size_t nw = e2e_ref_greedy(e->ref, p, np, 40, false, want);
    cr_assert_lt(nw, 40, "greedy decoding of \"%s\" no longer reaches an eos token", prompt);
    oai_res plain, lp;
    const char *args[] = {"--max-tokens", "40", "--temperature", "0", NULL};
    const char *largs[] = {"--max-tokens", "40", "--temperature", "0", "--logprobs", "2", NULL};
    oai_call(e, args, prompt, &plain);
    oai_call(e, largs, prompt, &lp);
    expect_finish(&plain, 0, "stop", (long)nw + 1, "eos");
    expect_finish(&lp, 0, "stop", (long)nw + 1, "eos --logprobs 2");
    cr_expect_eq(plain.ch[0].n_msgs, nw, "no message for the eos token without logprobs");
    cr_assert_eq(lp.ch[0].n_msgs, nw + 1, "a message for the eos token with logprobs");
    cr_expect_str_eq(lp.ch[0].text, plain.ch[0].text);
    json_t *eos = json_array_get(lp.ch[0].tokens, nw);
    long id = json_long(eos, "id", "eos");
    cr_expect(id == 2044 || id == 2045, "the last token %ld is not an eos token", id);
    /* the text is the engine's tokens before the eos: the eos message adds none */
    size_t len, ulen;
    char *raw = e2e_ref_text(e->ref, want, nw, &len), *text = as_utf8(raw, len, &ulen);
    cr_expect(plain.ch[0].text_len == ulen && !memcmp(plain.ch[0].text, text, ulen),
              "eos: text \"%s\", the engine's \"%s\"", plain.ch[0].text, text);
    free(text);
    free(raw);
    uint32_t ids[E2E_MAX_TOKENS];
    size_t nt = token_ids(&lp, 0, ids, E2E_MAX_TOKENS);
    double sum = 0, ref = e2e_ref_logprob(e->ref, p, np, ids, nt);
    for (size_t i = 0; i < nt; i++)
        sum += json_double(json_array_get(lp.ch[0].tokens, i), "logprob");
    cr_expect(fabs(sum - ref) <= 1e-3 * (1 + fabs(ref)), "logprobs sum %.6f, engine %.6f", sum,
              ref);
    oai_res_free(&plain);
    oai_res_free(&lp);
}

static void max_tokens_end_with_length(env *e) {
    oai_res res;
    const char *args[] = {"--max-tokens", "7", "--temperature", "0", "--ignore-eos", NULL};
    oai_call(e, args, PROMPT, &res);
    expect_finish(&res, 0, "length", 7, "--max-tokens 7");
    cr_expect_eq(res.ch[0].n_msgs, 7);
    /* a stop string the text ends with the start of: held back, then released into the last
     * token's message when max tokens end the choice */
    cr_assert_geq(res.ch[0].text_len, 2);
    char stop[8];
    snprintf(stop, sizeof stop, "%s~~~~", res.ch[0].text + res.ch[0].text_len - 2);
    oai_res held;
    const char *hargs[] = {"--max-tokens", "7", "--temperature", "0", "--ignore-eos", "--stop",
                           stop,           NULL};
    oai_call(e, hargs, PROMPT, &held);
    expect_finish(&held, 0, "length", 7, "--max-tokens 7 --stop (its start held back)");
    cr_expect_eq(held.ch[0].n_msgs, 7);
    cr_expect_str_eq(held.ch[0].text, res.ch[0].text, "the held-back end of the text was lost");
    oai_res_free(&held);
    oai_res_free(&res);
}

/* Greedy with --logprobs 0: the tokens and their bytes, for the stop-string check. */
static void stop_string_across_a_token_boundary_is_cut(env *e) {
    oai_res g;
    const char *gargs[] = {
        "--max-tokens", "24", "--temperature", "0", "--ignore-eos", "--logprobs", "0", NULL};
    oai_call(e, gargs, PROMPT, &g);
    json_t *toks = g.ch[0].tokens;
    cr_assert_eq(json_array_size(toks), 24);
    /* the first boundary between two printable-ASCII tokens of 2+ bytes: stop = 2 bytes before
     * it + 2 after */
    char stop[5] = "";
    for (size_t j = 0; j + 1 < 24 && !stop[0]; j++) {
        json_t *a = json_object_get(json_array_get(toks, j), "bytes");
        json_t *b = json_object_get(json_array_get(toks, j + 1), "bytes");
        size_t na = json_array_size(a), nb = json_array_size(b);
        if (na < 2 || nb < 2) continue;
        int v[4] = {(int)json_integer_value(json_array_get(a, na - 2)),
                    (int)json_integer_value(json_array_get(a, na - 1)),
                    (int)json_integer_value(json_array_get(b, 0)),
                    (int)json_integer_value(json_array_get(b, 1))};
        bool ascii = true;
        for (int k = 0; k < 4; k++) ascii = ascii && v[k] >= 0x21 && v[k] < 0x7f && v[k] != '"';
        if (ascii)
            for (int k = 0; k < 4; k++) stop[k] = (char)v[k];
    }
    cr_assert(stop[0], "no boundary between two printable tokens in \"%s\"", g.ch[0].text);
    size_t raw_len, want_len;
    char *raw = token_bytes(&g, 0, &raw_len);
    const char *hit = strstr(raw, stop);
    cr_assert(hit);
    size_t cut = (size_t)(hit - raw), end = cut + strlen(stop);
    char *want = as_utf8(raw, cut, &want_len);
    /* the token that completes the stop string: the first whose text reaches past `end` - 1 */
    long completing = 0;
    for (size_t j = 0, at = 0; j < 24; j++) {
        at += json_array_size(json_object_get(json_array_get(toks, j), "bytes"));
        if (at >= end) {
            completing = (long)j + 1;
            break;
        }
    }
    oai_res res;
    const char *args[] = {"--max-tokens", "24",   "--temperature", "0",  "--ignore-eos",
                          "--stop",       "zzzq", "--stop",        stop, NULL};
    oai_call(e, args, PROMPT, &res);
    cr_expect(res.ch[0].text_len == want_len && !memcmp(res.ch[0].text, want, want_len),
              "stop \"%s\": got \"%s\", expected \"%s\" (the text before it in \"%s\")", stop,
              res.ch[0].text ? res.ch[0].text : "", want, g.ch[0].text);
    free(want);
    free(raw);
    expect_finish(&res, 0, "stop", completing, "stop string");
    cr_expect_eq((long)res.ch[0].n_msgs, completing, "the completing token still has its message");
    oai_res_free(&res);
    oai_res_free(&g);
}

static void seeded_choices_are_reproducible(env *e) {
    const char *s7[] = {"--n",          "2",  "--seed",       "7", "--temperature", "1",
                        "--max-tokens", "12", "--ignore-eos", NULL};
    const char *s8[] = {"--seed",       "8",  "--temperature", "1",
                        "--max-tokens", "12", "--ignore-eos",  NULL};
    const char *s1000[] = {"--n",          "2",  "--seed",       "1000", "--temperature", "1",
                           "--max-tokens", "12", "--ignore-eos", NULL};
    oai_res a, b, one, other;
    oai_call(e, s7, PROMPT, &a);
    oai_call(e, s7, PROMPT, &b);
    oai_call(e, s8, PROMPT, &one);
    oai_call(e, s1000, PROMPT, &other);
    cr_assert_eq(a.n_choices, 2);
    cr_assert_eq(other.n_choices, 2);
    bool differs = false;
    for (uint32_t c = 0; c < 2; c++) {
        expect_finish(&a, c, "length", 12, "--n 2 --seed 7");
        cr_expect_str_eq(a.ch[c].text, b.ch[c].text, "choice %u with the same seed", c);
        differs = differs || strcmp(a.ch[c].text, other.ch[c].text) != 0;
    }
    cr_expect(differs, "seeds 7 and 1000 gave the same choices \"%s\", \"%s\"", a.ch[0].text,
              a.ch[1].text);
    cr_expect_str_eq(a.ch[1].text, one.ch[0].text, "choice 1 of seed 7 is seed 8's choice");
    oai_res_free(&a);
    oai_res_free(&b);
    oai_res_free(&one);
    oai_res_free(&other);

    oai_res all;
    const char *n16[] = {"--n",          "16", "--temperature", "1",
                         "--max-tokens", "2",  "--ignore-eos",  NULL};
    oai_call(e, n16, PROMPT, &all);
    cr_assert_eq(all.n_choices, 16);
    for (uint32_t c = 0; c < 16; c++) expect_finish(&all, c, "length", 2, "--n 16");
    oai_res_free(&all);
}

/* Every token message of choice 0 carries K alternatives sorted descending and a logprob <= 0;
 * the tokens' bytes spell the text; the logprobs sum to the engine's log-probability. */
static void check_logprobs(env *e, const oai_res *res, size_t k, bool greedy, const char *what) {
    json_t *toks = res->ch[0].tokens;
    size_t n = json_array_size(toks);
    cr_assert_eq(n, res->ch[0].n_msgs, "%s: a token member in every message", what);
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(toks, i), *top = json_object_get(t, "top");
        double lp = json_double(t, "logprob");
        sum += lp;
        cr_expect_leq(lp, 0, "%s: token %zu has logprob %g", what, i, lp);
        cr_assert_eq(json_array_size(top), k, "%s: token %zu has %zu alternatives", what, i,
                     json_array_size(top));
        for (size_t j = 1; j < k; j++)
            cr_expect_geq(json_double(json_array_get(top, j - 1), "logprob"),
                          json_double(json_array_get(top, j), "logprob"),
                          "%s: token %zu: alternatives out of order", what, i);
        if (greedy) {
            cr_expect_eq(json_long(json_array_get(top, 0), "id", what), json_long(t, "id", what),
                         "%s: greedy token %zu is not the most likely", what, i);
            cr_expect_eq(json_double(json_array_get(top, 0), "logprob"), lp, "%s: token %zu", what,
                         i);
        }
    }
    size_t nb, nu;
    char *bytes = token_bytes(res, 0, &nb), *text = as_utf8(bytes, nb, &nu);
    cr_expect(nu == res->ch[0].text_len && !memcmp(text, res->ch[0].text, nu),
              "%s: the tokens' bytes \"%s\" do not spell the text \"%s\"", what, text,
              res->ch[0].text);
    free(text);
    free(bytes);
    uint32_t p[E2E_MAX_TOKENS], ids[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(e->ref, &PROMPT, 1, p);
    size_t nt = token_ids(res, 0, ids, E2E_MAX_TOKENS);
    double want = e2e_ref_logprob(e->ref, p, np, ids, nt);
    cr_expect(fabs(sum - want) <= 1e-3 * (1 + fabs(want)),
              "%s: the logprobs sum to %.6f, the engine's log-probability is %.6f", what, sum,
              want);
}

static void logprobs_list_the_most_likely_tokens(env *e) {
    oai_res res;
    const char *greedy[] = {
        "--max-tokens", "10", "--temperature", "0", "--ignore-eos", "--logprobs", "3", NULL};
    oai_call(e, greedy, PROMPT, &res);
    check_logprobs(e, &res, 3, true, "greedy --logprobs 3");
    oai_res_free(&res);
    /* sampled hotter: the logprobs are still the model's at temperature 1 */
    const char *hot[] = {"--max-tokens",
                         "10",
                         "--temperature",
                         "1.8",
                         "--seed",
                         "3",
                         "--ignore-eos",
                         "--logprobs",
                         "5",
                         NULL};
    oai_call(e, hot, PROMPT, &res);
    check_logprobs(e, &res, 5, false, "--temperature 1.8 --logprobs 5");
    oai_res_free(&res);
}

/* How often id occurs in ids[0..n). */
static uint32_t count_of(const uint32_t *ids, size_t n, uint32_t id) {
    uint32_t k = 0;
    for (size_t i = 0; i < n; i++) k += ids[i] == id;
    return k;
}

static void penalties_change_a_repetitive_greedy_text(env *e) {
    const char *prompt = "the cat the cat the cat the cat the cat the";
    oai_res plain;
    const char *args[] = {"--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--logprobs",
                          "20",           NULL};
    oai_call(e, args, prompt, &plain);
    uint32_t ids[64];
    size_t n = token_ids(&plain, 0, ids, 64);
    bool repeats = false;
    for (size_t i = 0; i < n; i++) repeats = repeats || count_of(ids, i, ids[i]) > 0;
    cr_assert(repeats, "greedy does not repeat itself: \"%s\"", plain.ch[0].text);

    const char *which[][2] = {{"--presence-penalty", "2"}, {"--frequency-penalty", "1.5"}};
    for (int w = 0; w < 2; w++) {
        const char *pargs[] = {"--max-tokens", "16", "--temperature", "0",         "--ignore-eos",
                               "--logprobs",   "20", which[w][0],     which[w][1], NULL};
        oai_res res;
        oai_call(e, pargs, prompt, &res);
        cr_expect_str_neq(res.ch[0].text, plain.ch[0].text, "%s %s changed nothing", which[w][0],
                          which[w][1]);
        /* each token is the argmax of logprob - penalty among the listed alternatives */
        double presence = w == 0 ? 2 : 0, frequency = w == 1 ? 1.5 : 0;
        uint32_t got[64];
        size_t ng = token_ids(&res, 0, got, 64);
        for (size_t i = 0; i < ng; i++) {
            json_t *t = json_array_get(res.ch[0].tokens, i), *top = json_object_get(t, "top");
            uint32_t k = count_of(got, i, got[i]);
            double picked = json_double(t, "logprob") - k * frequency - (k ? presence : 0);
            double best = -INFINITY;
            long best_id = -1;
            for (size_t j = 0; j < json_array_size(top); j++) {
                json_t *alt = json_array_get(top, j);
                uint32_t ka = count_of(got, i, (uint32_t)json_long(alt, "id", "alt"));
                double v = json_double(alt, "logprob") - ka * frequency - (ka ? presence : 0);
                if (v > best) best = v, best_id = json_long(alt, "id", "alt");
            }
            cr_expect_leq(best, picked + 1e-5,
                          "%s: token %zu is %u (penalised %.6f), not %ld (penalised %.6f)",
                          which[w][0], i, got[i], picked, best_id, best);
        }
        oai_res_free(&res);
    }
    oai_res_free(&plain);
}

static void expect_error(env *e, const char *const *args, const char *prompt, const char *code,
                         const char *needle) {
    oai_res res;
    oai_call(e, args, prompt, &res);
    const char *what = describe(args);
    cr_expect_eq(res.prompt_tokens, -1, "%s: ran instead of refusing", what);
    cr_expect_str_eq(res.code, code, "%s", what);
    cr_expect(strstr(res.message, needle), "%s: \"%s\" does not mention %s", what, res.message,
              needle);
    oai_res_free(&res);
}

static void requests_beyond_the_context_are_refused(env *e) {
    uint32_t p[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(e->ref, &PROMPT, 1, p);
    char max[32], want[512];
    snprintf(max, sizeof max, "%zu", CTX_TOKENS - np + 1);
    snprintf(want, sizeof want,
             "This model's maximum context length is %d tokens. However, you requested %d tokens "
             "(%zu in the messages, %s in the completion). Please reduce the length of the "
             "messages or completion.",
             CTX_TOKENS, CTX_TOKENS + 1, np, max);
    const char *args[] = {"--max-tokens", max, NULL};
    expect_error(e, args, PROMPT, "context_length_exceeded", want);

    /* a prompt that alone fills the context ("a" x 4200: one token per " a") */
    size_t len = 2 * 4200;
    char *longp = malloc(len + 1);
    for (size_t i = 0; i < len; i += 2) longp[i] = 'a', longp[i + 1] = ' ';
    longp[len - 1] = 0;
    expect_error(e, (const char *const[]){NULL}, longp, "context_length_exceeded",
                 "This model's maximum context length is 4096 tokens. However, your messages "
                 "resulted in ");
    free(longp);
}

static void bad_arguments_are_refused(env *e) {
    static const struct {
        const char *args[11];
        const char *code, *needle; /* the error's code, a piece of its message */
    } cases[] = {
        {{"--n", "17"}, "invalid_value", "--n \"17\""},
        {{"--n", "0"}, "invalid_value", "--n \"0\""},
        {{"--logprobs", "21"}, "invalid_value", "--logprobs"},
        {{"--temperature", "x\"y"}, "invalid_value", "x\"y"}, /* escaped in the JSON */
        {{"--top-p", "1.5"}, "invalid_value", "--top-p"},
        {{"--presence-penalty", "-2.5"}, "invalid_value", "--presence-penalty"},
        {{"--frequency-penalty", "nan"}, "invalid_value", "--frequency-penalty"},
        {{"--max-tokens", "-1"}, "invalid_value", "--max-tokens"},
        {{"--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e"},
         "invalid_value",
         "at most 4"},
        {{"--bogus", "1"}, "invalid_request_error", "--bogus"},
        {{"--n", "2", "--n", "3"}, "invalid_request_error", "more than once"},
        {{"--chat=yes"}, "invalid_request_error", "--chat"},
        {{"--seed"}, "invalid_request_error", "--seed"},
        {{"positional"}, "invalid_request_error", "positional"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_error(e, cases[i].args, PROMPT, cases[i].code, cases[i].needle);
    const char *chat[] = {"--chat", NULL};
    expect_error(e, chat, "", "invalid_request_error", "empty"); /* no BOS, no tokens */
}

/* The prompt tokens of a --chat run and of a plain run of prompt. */
static void prompt_counts(env *e, const char *prompt, long *chat, long *plain) {
    const char *cargs[] = {"--chat", "--max-tokens", "1", NULL};
    const char *pargs[] = {"--max-tokens", "1", NULL};
    oai_res res;
    oai_call(e, cargs, prompt, &res);
    *chat = res.prompt_tokens;
    oai_res_free(&res);
    oai_call(e, pargs, prompt, &res);
    *plain = res.prompt_tokens;
    oai_res_free(&res);
}

static void chat_prompts_parse_special_tokens_without_a_bos(env *e) {
    uint32_t t[E2E_MAX_TOKENS];
    const char *texts[] = {"user", "\n\nHi there", "assistant", "\n\n"};
    size_t n_text = 0;
    for (int i = 0; i < 4; i++) n_text += e2e_ref_encode(e->ref, texts[i], t, E2E_MAX_TOKENS);
    const char *body = "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n";
    char full[256];
    snprintf(full, sizeof full, "<|begin_of_text|>%s", body);
    long chat, plain;
    /* the template writes the BOS: 6 special tokens + the text between them */
    prompt_counts(e, full, &chat, &plain);
    cr_expect_eq(chat, (long)(6 + n_text), "--chat \"%s\"", full);
    cr_expect_eq(plain, chat, "text_completion's rule adds no BOS before a BOS either");
    /* without it, --chat adds none; a plain prompt gets one */
    prompt_counts(e, body, &chat, &plain);
    cr_expect_eq(chat, (long)(5 + n_text), "--chat \"%s\"", body);
    cr_expect_eq(plain, chat + 1, "a plain prompt starts with the model's BOS");
}

Test(e2e, openai_chat_speaks_the_gateway_protocol) {
    env e;
    e2e_cluster_start(&e.c);
    e.ref = e2e_ref_open();
    e.oai = e2e_upload(&e.c, "openai_chat");
    e.tc = e2e_upload(&e.c, "text_completion");

    greedy_equals_text_completion(&e, PROMPT, "24");
    greedy_equals_text_completion(&e, "The end.", "40"); /* ends at an eos token */
    a_stop_token_ends_with_stop_and_is_listed_with_logprobs(&e);
    max_tokens_end_with_length(&e);
    stop_string_across_a_token_boundary_is_cut(&e);
    seeded_choices_are_reproducible(&e);
    logprobs_list_the_most_likely_tokens(&e);
    penalties_change_a_repetitive_greedy_text(&e);
    requests_beyond_the_context_are_refused(&e);
    bad_arguments_are_refused(&e);
    chat_prompts_parse_special_tokens_without_a_bos(&e);

    free(e.oai);
    free(e.tc);
    e2e_ref_close(e.ref);
    e2e_cluster_stop(&e.c);
}
