/* test_inferlets.c — the example inferlets end to end: a real pie-controller, CPU pie-worker
 * (small-f32) and pie-lifecycle on loopback; each example's .wasm is uploaded and run through
 * the public Lifecycle API (UploadProgram + Run), and its output is compared with the
 * engine's own computation in this process (eng.h on the same model, the same tokenizer).
 *
 * Covers: greedy text completion equals the engine's greedy decoding (prompt as argument and
 * as a client message, stop at eos, stop string), and so does sampling that keeps one candidate
 * (top-k 1, a tiny top-p) at any temperature, and so does a prompt longer than the instance's
 * embedding limit (filled in chunks); with a one-page KV quota text completion stops at the
 * failed allocation with its error instead of decoding garbage; parallel generation: every fork of
 * a shared prefix equals single-context greedy decoding of its own prompt; prefix caching: a second
 * instance imports the first one's exported prefix and produces the no-cache output; beam
 * search: width 1 is greedy, wider beams come sorted by a score that equals the engine's
 * log-probability of their tokens; n-gram speculative decoding equals greedy decoding and
 * reports exactly the acceptance an independent simulation of its drafter predicts. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie_testutil.h"

TestSuite(e2e, .fini = pie_test_leak_check, .timeout = 600);

/* One test's world: a cluster, the reference engine and the uploaded inferlet. */
typedef struct env {
    e2e_cluster c;
    e2e_ref *ref;
    char *prog;
} env;

static void env_start(env *e, const char *inferlet) {
    e2e_cluster_start(&e->c);
    e->ref = e2e_ref_open();
    e->prog = e2e_upload(&e->c, inferlet);
}

static void env_stop(env *e) {
    free(e->prog);
    e2e_ref_close(e->ref);
    e2e_cluster_stop(&e->c);
}

/* Asserts that message i of r is exactly the reference text of toks. */
static void expect_text(e2e_ref *ref, const e2e_run *r, size_t i, const uint32_t *toks, size_t n,
                        const char *what) {
    size_t len;
    char *want = e2e_ref_text(ref, toks, n, &len);
    cr_assert_gt(r->n_msgs, i, "%s: %zu messages, expected one at %zu", what, r->n_msgs, i);
    cr_expect(r->msg_lens[i] == len && memcmp(r->msgs[i], want, len) == 0,
              "%s: the inferlet produced\n  \"%s\"\nthe engine's greedy decoding is\n  \"%s\"", what,
              r->msgs[i], want);
    free(want);
}

/* ---- text completion ---------------------------------------------------------------------- */

Test(e2e, text_completion_greedy_equals_the_engine) {
    env e;
    env_start(&e, "text_completion");
    e2e_ref *ref = e.ref;
    const char *prog = e.prog;
    const char *prompt = "The quick brown fox jumps over the lazy dog. Once upon a time";
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);

    /* 1. prompt as an argument, stopping at eos or 40 tokens */
    size_t nw = e2e_ref_greedy(ref, p, np, 40, false, want);
    e2e_run r;
    const char *args[] = {"--prompt", prompt, "--max-tokens", "40", NULL};
    e2e_run_program(&e.c, prog, args, NULL, &r);
    e2e_assert_success(&r, "text_completion");
    cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
    expect_text(ref, &r, 0, want, nw, "text_completion --prompt");
    char tail[64];
    snprintf(tail, sizeof tail, "reason=%s tokens=%zu", nw == 40 ? "max_tokens" : "stop_token", nw);
    cr_expect_str_eq(r.msgs[1], tail);
    /* stdout streams the same text (plus a newline) */
    cr_expect(r.out_len == r.msg_lens[0] + 1 && memcmp(r.out, r.msgs[0], r.msg_lens[0]) == 0,
              "stdout \"%s\" differs from the completion \"%s\"", r.out ? r.out : "", r.msgs[0]);
    e2e_run_free(&r);

    /* 2. prompt as a client message, eos ignored: exactly 24 tokens */
    nw = e2e_ref_greedy(ref, p, np, 24, true, want);
    cr_assert_eq(nw, 24);
    const char *args2[] = {"--max-tokens", "24", "--ignore-eos", NULL};
    const char *in[] = {prompt, NULL};
    e2e_run_program(&e.c, prog, args2, in, &r);
    e2e_assert_success(&r, "text_completion (message)");
    expect_text(ref, &r, 0, want, nw, "text_completion prompt as message");
    cr_expect_str_eq(r.msgs[1], "reason=max_tokens tokens=24");
    e2e_run_free(&r);

    /* 3. a stop string: the text is cut before its first occurrence */
    size_t full_len;
    char *full = e2e_ref_text(ref, want, nw, &full_len);
    cr_assert_gt(full_len, 6);
    char stop[4];
    memcpy(stop, full + full_len / 2, 3); /* 3 bytes from the middle of the greedy text */
    stop[3] = 0;
    if (strlen(stop) == 3) {
        char *hit = strstr(full, stop);
        size_t cut = (size_t)(hit - full);
        const char *args3[] = {"--prompt", prompt, "--max-tokens", "24", "--ignore-eos", "--stop",
                               stop, NULL};
        e2e_run_program(&e.c, prog, args3, NULL, &r);
        e2e_assert_success(&r, "text_completion --stop");
        cr_expect(r.msg_lens[0] == cut && memcmp(r.msgs[0], full, cut) == 0,
                  "stop \"%s\": got \"%s\", expected the first %zu bytes of \"%s\"", stop,
                  r.msgs[0], cut, full);
        cr_expect(strncmp(r.msgs[1], "reason=stop_string", 18) == 0, "%s", r.msgs[1]);
        e2e_run_free(&r);
    }
    free(full);

    /* 4. samplers that keep a single candidate draw the greedy text at any temperature and
     * seed: top-k 1 (pie_sampler_top_k), and a top-p the most likely token alone reaches
     * (pie_sampler_top_p) */
    const char *one_k[] = {"--prompt", prompt, "--max-tokens", "24", "--ignore-eos",
                           "--temperature", "1.7", "--top-k", "1", "--seed", "5", NULL};
    const char *tiny_p[] = {"--prompt", prompt, "--max-tokens", "24", "--ignore-eos",
                            "--temperature", "0.9", "--top-p", "0.000001", "--seed", "6", NULL};
    const char *const *sampled[] = {one_k, tiny_p};
    const char *names[] = {"text_completion --top-k 1", "text_completion --top-p 0.000001"};
    for (int i = 0; i < 2; i++) {
        e2e_run_program(&e.c, prog, sampled[i], NULL, &r);
        e2e_assert_success(&r, names[i]);
        expect_text(ref, &r, 0, want, nw, names[i]);
        e2e_run_free(&r);
    }
    env_stop(&e);
}

/* A prompt longer than the instance's embedding limit: the fill runs in chunks of the
 * embeddings the instance can still allocate, and the completion equals the engine's. */
Test(e2e, text_completion_prompt_longer_than_the_embedding_limit_equals_the_engine) {
    const char *lenv[] = {"PIE_LIMITS_DEFAULT_EMBEDDINGS=16", NULL};
    env e;
    e2e_cluster_start_env(&e.c, lenv);
    e.ref = e2e_ref_open();
    e.prog = e2e_upload(&e.c, "text_completion");
    const char *prompt = "The quick brown fox jumps over the lazy dog. Once upon a time there "
                         "was a little town by a river, and in the town lived an old baker who "
                         "got up every morning before the sun to bake bread for everyone.";
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(e.ref, &prompt, 1, p);
    cr_assert_gt(np, 2 * 16, "the prompt (%zu tokens) must be longer than the limit", np);
    size_t nw = e2e_ref_greedy(e.ref, p, np, 12, true, want);
    e2e_run r;
    const char *args[] = {"--prompt", prompt, "--max-tokens", "12", "--ignore-eos", NULL};
    e2e_run_program(&e.c, e.prog, args, NULL, &r);
    e2e_assert_success(&r, "text_completion over the embedding limit");
    expect_text(e.ref, &r, 0, want, nw, "text_completion with 16 embeddings");
    e2e_run_free(&r);
    env_stop(&e);
}

/* A KV quota of one page: generation fails when the sequence needs a second page, and the
 * inferlet stops there with the failed call's error instead of decoding on from garbage. */
Test(e2e, text_completion_stops_at_the_first_failed_call_with_its_error) {
    const char *lenv[] = {"PIE_LIMITS_DEFAULT_KV_PAGES=1", NULL};
    env e;
    e2e_cluster_start_env(&e.c, lenv);
    e.ref = e2e_ref_open();
    e.prog = e2e_upload(&e.c, "text_completion");
    const char *prompt = "Once upon a time";
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(e.ref, &prompt, 1, p);
    cr_assert_lt(np, E2E_PAGE, "the prompt must fit the one page");
    size_t nw = e2e_ref_greedy(e.ref, p, np, 40, true, want);
    size_t full_len;
    char *full = e2e_ref_text(e.ref, want, nw, &full_len);
    e2e_run r;
    const char *args[] = {"--prompt", prompt, "--max-tokens", "40", "--ignore-eos", NULL};
    e2e_run_program(&e.c, e.prog, args, NULL, &r);
    cr_expect(r.exit_code != 0 || r.status_code != 0, "40 tokens fit one page of %d?", E2E_PAGE);
    cr_expect_eq(r.n_msgs, 0, "a failed run sent %zu messages (first: \"%s\")", r.n_msgs,
                 r.n_msgs ? r.msgs[0] : "");
    const char *err = r.err ? r.err : "";
    cr_expect(strstr(err, "alloc_kv_pages") && strstr(err, "limit of 1"),
              "stderr does not name the failed allocation: \"%s\"", err);
    /* what was streamed before the failure is the engine's text, no garbage after it */
    cr_expect(r.out_len <= full_len && memcmp(r.out ? r.out : "", full, r.out_len) == 0,
              "stdout \"%s\" is not a prefix of the greedy text \"%s\"", r.out ? r.out : "", full);
    free(full);
    e2e_run_free(&r);
    env_stop(&e);
}

/* ---- parallel generation ------------------------------------------------------------------ */

Test(e2e, parallel_generation_forks_equal_single_context_greedy) {
    env e;
    env_start(&e, "parallel_generation");
    e2e_ref *ref = e.ref;
    const char *prog = e.prog;
    /* a prompt whose last page is partial, so each fork's suffix copies it (copy-on-write) */
    const char *prompt = "In a small village by the sea there lived an old fisherman who";
    const char *suffixes[] = {" one day", " never", ""};
    e2e_run r;
    const char *args[] = {"--prompt", prompt, "--n", "3", "--suffixes", " one day| never|",
                          "--max-tokens", "20", "--ignore-eos", NULL};
    e2e_run_program(&e.c, prog, args, NULL, &r);
    e2e_assert_success(&r, "parallel_generation");
    cr_assert_eq(r.n_msgs, 3, "messages: %zu", r.n_msgs);
    for (size_t i = 0; i < 3; i++) {
        const char *parts[] = {prompt, suffixes[i]};
        uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
        size_t np = e2e_ref_prompt(ref, parts, suffixes[i][0] ? 2 : 1, p);
        size_t nw = e2e_ref_greedy(ref, p, np, 20, true, want);
        char what[64];
        snprintf(what, sizeof what, "fork %zu (suffix \"%s\")", i, suffixes[i]);
        expect_text(ref, &r, i, want, nw, what);
    }
    e2e_run_free(&r);
    env_stop(&e);
}

/* ---- prefix caching ----------------------------------------------------------------------- */

Test(e2e, prefix_caching_imported_prefix_gives_the_no_cache_output) {
    env e;
    env_start(&e, "prefix_caching");
    e2e_ref *ref = e.ref;
    const char *prog = e.prog;
    const char *prefix = "You are a helpful assistant who answers briefly and precisely.";
    const char *prompt = " Question: what is the color of the sky? Answer:";
    const char *base[] = {"--prefix", prefix, "--prompt", prompt, "--max-tokens", "16",
                          "--ignore-eos", "--name", "e2e-prefix", NULL};
    const char *parts[] = {prefix, prompt};
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(ref, parts, 2, p);
    size_t nw = e2e_ref_greedy(ref, p, np, 16, true, want);

    const char *expect_how[] = {"miss", "hit"};
    for (int i = 0; i < 2; i++) { /* the first instance computes and exports, the second imports */
        e2e_run r;
        e2e_run_program(&e.c, prog, base, NULL, &r);
        e2e_assert_success(&r, expect_how[i]);
        cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
        cr_expect_str_eq(r.msgs[0], expect_how[i], "instance %d: cache %s, expected %s", i,
                         r.msgs[0], expect_how[i]);
        expect_text(ref, &r, 1, want, nw, expect_how[i]);
        e2e_run_free(&r);
    }
    const char *nocache[] = {"--prefix", prefix, "--prompt", prompt, "--max-tokens", "16",
                             "--ignore-eos", "--no-cache", NULL};
    e2e_run r;
    e2e_run_program(&e.c, prog, nocache, NULL, &r);
    e2e_assert_success(&r, "no-cache");
    cr_expect_str_eq(r.msgs[0], "off");
    expect_text(ref, &r, 1, want, nw, "no-cache");
    e2e_run_free(&r);

    /* removing the export makes the next instance miss again */
    const char *unexport[] = {"--unexport", "--name", "e2e-prefix", NULL};
    e2e_run_program(&e.c, prog, unexport, NULL, &r);
    e2e_assert_success(&r, "unexport");
    e2e_run_free(&r);
    e2e_run_program(&e.c, prog, base, NULL, &r);
    e2e_assert_success(&r, "after unexport");
    cr_expect_str_eq(r.msgs[0], "miss");
    expect_text(ref, &r, 1, want, nw, "after unexport");
    e2e_run_free(&r);
    env_stop(&e);
}

/* ---- beam search -------------------------------------------------------------------------- */

typedef struct beam_line {
    double score;
    int finished;
    size_t n_tokens;
    const char *text;
} beam_line;

/* "<score>\t<finished>\t<n tokens>\t<text>"; the text may start with spaces, so the fields are
 * split at the tabs (a scanf "\t" would also eat the text's leading whitespace). */
static beam_line parse_beam(const char *msg) {
    beam_line b = {0};
    const char *t1 = strchr(msg, '\t'), *t2 = t1 ? strchr(t1 + 1, '\t') : NULL;
    const char *t3 = t2 ? strchr(t2 + 1, '\t') : NULL;
    cr_assert(t3, "beam message \"%s\" does not have four tab-separated fields", msg);
    char *end;
    b.score = strtod(msg, &end);
    cr_assert_eq(end, t1, "beam message \"%s\": bad score", msg);
    b.finished = (int)strtol(t1 + 1, &end, 10);
    cr_assert_eq(end, t2, "beam message \"%s\": bad finished flag", msg);
    b.n_tokens = (size_t)strtoull(t2 + 1, &end, 10);
    cr_assert_eq(end, t3, "beam message \"%s\": bad token count", msg);
    b.text = t3 + 1;
    return b;
}

Test(e2e, beam_search_width_1_is_greedy_and_wider_beams_are_sorted_by_true_score) {
    env e;
    env_start(&e, "beam_search");
    e2e_ref *ref = e.ref;
    const char *prog = e.prog;
    const char *prompt = "The meaning of life is";
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    size_t nw = e2e_ref_greedy(ref, p, np, 12, true, want);

    e2e_run r;
    const char *a1[] = {"--prompt", prompt, "--width", "1", "--max-tokens", "12", "--ignore-eos",
                        NULL};
    e2e_run_program(&e.c, prog, a1, NULL, &r);
    e2e_assert_success(&r, "beam_search width 1");
    cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
    beam_line b = parse_beam(r.msgs[0]);
    size_t len;
    char *greedy = e2e_ref_text(ref, want, nw, &len);
    cr_expect_str_eq(b.text, greedy, "width 1 beam \"%s\", greedy \"%s\"", b.text, greedy);
    cr_expect_eq(b.n_tokens, nw);
    double lp = e2e_ref_logprob(ref, p, np, want, nw);
    cr_expect(fabs(b.score - lp) <= 1e-3 * fmax(1.0, fabs(lp)), "score %.6f, engine %.6f", b.score,
              lp);
    cr_expect_str_eq(r.msgs[1], "beams=1");
    free(greedy);
    e2e_run_free(&r);

    const char *a4[] = {"--prompt", prompt, "--width", "4", "--max-tokens", "12", "--ignore-eos",
                        NULL};
    e2e_run_program(&e.c, prog, a4, NULL, &r);
    e2e_assert_success(&r, "beam_search width 4");
    cr_assert_eq(r.n_msgs, 5, "messages: %zu", r.n_msgs);
    cr_expect_str_eq(r.msgs[4], "beams=4");
    double prev = INFINITY;
    size_t verified = 0;
    for (size_t i = 0; i < 4; i++) {
        beam_line bi = parse_beam(r.msgs[i]);
        cr_expect_leq(bi.score, prev, "beam %zu score %.6f after %.6f: not sorted", i, bi.score, prev);
        prev = bi.score;
        cr_expect_eq(bi.n_tokens, 12, "beam %zu: %zu tokens", i, bi.n_tokens);
        /* the reported score is the true log-probability of the beam's tokens */
        uint32_t toks[E2E_MAX_TOKENS];
        size_t nt = e2e_ref_encode(ref, bi.text, toks, E2E_MAX_TOKENS);
        if (nt == bi.n_tokens) { /* re-encoding may merge tokens differently; compare only then */
            verified++;
            double l = e2e_ref_logprob(ref, p, np, toks, nt);
            cr_expect(fabs(bi.score - l) <= 1e-3 * fmax(1.0, fabs(l)), "beam %zu score %.6f, engine %.6f",
                      i, bi.score, l);
        }
        for (size_t j = 0; j < i; j++)
            cr_expect_str_neq(r.msgs[j] + (strchr(r.msgs[j], '\t') - r.msgs[j]),
                              r.msgs[i] + (strchr(r.msgs[i], '\t') - r.msgs[i]),
                              "beams %zu and %zu are the same", j, i);
    }
    cr_expect_gt(verified, 0, "no beam's text re-encodes to its own token count: scores unchecked");
    e2e_run_free(&r);
    env_stop(&e);
}

/* ---- speculative decoding ----------------------------------------------------------------- */

/* The n-gram prompt-lookup drafter, written again from its specification: for g = ngram..1,
 * among the earlier occurrences of the last g tokens the latest with the longest continuation
 * (capped at max) gives the draft. */
static size_t sim_propose(const uint32_t *h, size_t n, size_t ngram, uint32_t *out, size_t max) {
    for (size_t g = ngram; g >= 1; g--) {
        if (n <= g) continue;
        size_t best = 0, best_j = 0;
        for (size_t j = 0; j + g < n; j++) { /* every earlier start, oldest first */
            if (memcmp(h + j, h + n - g, g * sizeof *h) != 0) continue;
            size_t follow = n - (j + g) < max ? n - (j + g) : max;
            if (follow >= best && follow > 0) { /* ties: the later occurrence */
                best = follow;
                best_j = j;
            }
        }
        if (best) {
            memcpy(out, h + best_j + g, best * sizeof *out);
            return best;
        }
    }
    return 0;
}

Test(e2e, speculative_decoding_equals_greedy_and_reports_the_predicted_acceptance) {
    env e;
    env_start(&e, "speculative_decoding");
    e2e_ref *ref = e.ref;
    const char *prog = e.prog;
    const char *prompt = "one two three four five one two three four five one two three";
    const size_t max_new = 48, ngram = 3, draft = 4;
    uint32_t p[E2E_MAX_TOKENS], want[E2E_MAX_TOKENS];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    size_t nw = e2e_ref_greedy(ref, p, np, max_new, true, want);
    cr_assert_eq(nw, max_new);

    /* Simulate: one plain step, then per step drafts verified against the greedy tokens. */
    uint32_t hist[E2E_MAX_TOKENS], d[64];
    memcpy(hist, p, np * sizeof *p);
    size_t gen = 1, steps = 0, drafted = 0, accepted = 0;
    while (gen < max_new) {
        memcpy(hist + np, want, gen * sizeof *want);
        size_t room = max_new - gen - 1 < draft ? max_new - gen - 1 : draft;
        size_t k = room ? sim_propose(hist, np + gen, ngram, d, room) : 0;
        size_t a = 0;
        while (a < k && d[a] == want[gen + a]) a++;
        steps++;
        drafted += k;
        accepted += a;
        gen += a + 1;
    }

    e2e_run r;
    const char *args[] = {"--prompt", prompt, "--max-tokens", "48", "--ngram", "3", "--draft", "4",
                          "--ignore-eos", NULL};
    e2e_run_program(&e.c, prog, args, NULL, &r);
    e2e_assert_success(&r, "speculative_decoding");
    cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
    expect_text(ref, &r, 0, want, nw, "speculative_decoding");
    char stats[128];
    snprintf(stats, sizeof stats, "steps=%zu drafted=%zu accepted=%zu tokens=%zu", steps, drafted,
             accepted, nw);
    cr_expect_str_eq(r.msgs[1], stats, "reported \"%s\", simulation \"%s\"", r.msgs[1], stats);
    cr_expect_gt(accepted, 0, "the prompt should make some drafts acceptable: %s", stats);
    e2e_run_free(&r);
    env_stop(&e);
}
