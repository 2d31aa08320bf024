/* test_inferlet_apps.c — the application examples end to end: attention sinks, tree of thought,
 * a ReAct agent calling an HTTP tool, JSON-constrained decoding, watermarking and messaging
 * between two inferlets. Each test starts a real pie-controller, CPU pie-worker (small-f32) and
 * pie-lifecycle on loopback, uploads the example's .wasm and runs it through the public
 * Lifecycle API; results are checked against the engine's own computation in this process
 * (eng.h on the same model: greedy decoding, log-probabilities, and forwards with explicit
 * attention masks) and against re-implementations of each example's rule written from its
 * specification (the JSON shape, the watermark's green list, the tree's selection rule).
 *
 * Owns: the tests, a masked-attention reference and a one-request-at-a-time HTTP test server on
 * loopback.
 * Does not own: the shared cluster/API/reference helpers (e2e_support.c). */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "e2e_support.h"
#include "eng.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_testutil.h"
#include "tok.h"

TestSuite(e2e_apps, .fini = pie_test_leak_check, .timeout = 600);

#define MAXT E2E_MAX_TOKENS

/* ---- small helpers ----------------------------------------------------------------------- */

/* Parses "a,b,c" (up to the first byte that is neither digit nor comma) into out. */
static size_t parse_ids(const char *s, uint32_t *out, size_t cap) {
    size_t n = 0;
    while (*s >= '0' && *s <= '9') {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        cr_assert_lt(n, cap, "more than %zu ids in \"%s\"", cap, s);
        out[n++] = (uint32_t)v;
        s = *end == ',' ? end + 1 : end;
        if (end == s && *end != ',') break;
    }
    return n;
}

/* The value after "key=" in msg, as a pointer into msg (asserts it is there). */
static const char *field(const char *msg, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "%s=", key);
    const char *p = strstr(msg, pat);
    while (p && p != msg && p[-1] != ' ') p = strstr(p + 1, pat);
    cr_assert(p, "no %s in \"%s\"", pat, msg);
    return p + strlen(pat);
}

static long field_long(const char *msg, const char *key) { return strtol(field(msg, key), NULL, 10); }

static void expect_ref_text(e2e_ref *ref, const char *got, size_t got_len, const uint32_t *toks,
                            size_t n, const char *what) {
    size_t len;
    char *want = e2e_ref_text(ref, toks, n, &len);
    cr_expect(got_len == len && memcmp(got, want, len) == 0, "%s: got\n  \"%s\"\nexpected\n  \"%s\"",
              what, got, want);
    free(want);
}

/* ---- masked-attention reference -------------------------------------------------------------
 * The engine in this process, one sequence at a time: forwards with explicit attention masks
 * (run lengths as pie.v1.AttentionMask) and raw logits. */

typedef struct mref {
    eng *e;
    tok *t;
    const eng_info *info;
    uint32_t pages[MAXT / E2E_PAGE + 1];
    size_t n; /* tokens stored */
} mref;

static void mref_open(mref *m) {
    *m = (mref){0};
    eng_opts o = {.model_dir = PIE_MODELS_DIR "/" E2E_MODEL, .kv_page_size = E2E_PAGE,
                  .kv_pages = MAXT / E2E_PAGE + 1, .embed_slots = MAXT, .max_batch_tokens = MAXT,
                  .n_threads = 1};
    pie_status st;
    cr_assert_eq(eng_open(&o, &m->e, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(tok_load(PIE_MODELS_DIR "/" E2E_MODEL "/tokenizer.json", &m->t, &st), PIE_OK, "%s",
                 st.msg);
    m->info = eng_get_info(m->e);
    for (uint32_t i = 0; i < MAXT / E2E_PAGE + 1; i++) m->pages[i] = i;
}

static void mref_close(mref *m) {
    eng_close(m->e);
    tok_free(m->t);
}

/* Appends toks[0..n) (positions continue the sequence); every input row sees what runs[0..nr)
 * says (nr 0 = causal); the last input's hidden state goes to slot MAXT - 1. */
static void mref_forward(mref *m, const uint32_t *toks, uint32_t n, const uint32_t *runs,
                         uint32_t nr) {
    uint32_t in[MAXT], pos[MAXT], out = MAXT - 1;
    cr_assert_leq(m->n + n, (size_t)MAXT - 1);
    for (uint32_t i = 0; i < n; i++) in[i] = i, pos[i] = (uint32_t)m->n + i;
    pie_status st;
    cr_assert_eq(eng_embed_text(m->e, in, toks, pos, n, &st), PIE_OK, "%s", st.msg);
    size_t total = m->n + n;
    eng_forward_item it = {.kv_pages = m->pages,
                           .n_kv_pages = (uint32_t)((total + E2E_PAGE - 1) / E2E_PAGE),
                           .kv_last_page_len = (uint32_t)((total - 1) % E2E_PAGE + 1),
                           .append_kv = true, .in_slots = in, .n_in = n, .out_slots = &out,
                           .n_out = 1, .mask_runs = runs, .n_mask_runs = nr};
    cr_assert_eq(eng_forward(m->e, &it, 1, &st), PIE_OK, "%s", st.msg);
    m->n = total;
}

static void mref_logits(mref *m, float *logits) {
    pie_status st;
    cr_assert_eq(eng_logits(m->e, MAXT - 1, logits, &st), PIE_OK, "%s", st.msg);
}

static uint32_t argmax_where(const float *v, uint32_t n, const bool *allowed) {
    uint32_t best = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++)
        if ((!allowed || allowed[i]) && (best == UINT32_MAX || v[i] > v[best])) best = i;
    cr_assert_neq(best, UINT32_MAX, "no allowed token");
    return best;
}

/* ==== attention sink ========================================================================= */

/* The attention-sink rule from its specification: the prompt prefilled causally; the token
 * forwarded when a tokens are stored sees tokens [0, sink) and [a - window, a] when
 * a > sink + window (every stored token otherwise). Greedy; returns the generated count. */
static size_t sink_reference(mref *m, const uint32_t *prompt, size_t np, uint32_t sink,
                             uint32_t window, size_t max_new, uint32_t *out) {
    float *logits = malloc(m->info->vocab_size * sizeof *logits);
    cr_assert(logits);
    mref_forward(m, prompt, (uint32_t)np, NULL, 0);
    for (size_t k = 0; k < max_new; k++) {
        mref_logits(m, logits);
        out[k] = argmax_where(logits, m->info->vocab_size, NULL);
        if (k + 1 == max_new) break;
        uint32_t a = (uint32_t)m->n, runs[3] = {sink, a - window - sink, window + 1};
        bool windowed = a > sink + window;
        mref_forward(m, &out[k], 1, windowed ? runs : NULL, windowed ? 3 : 0);
    }
    free(logits);
    return max_new;
}

Test(e2e_apps, attention_sink_keeps_kv_pages_bounded_and_matches_masked_attention) {
    /* A KV-page quota of 6 pages (96 tokens): the windowed run needs fewer at any time, a run of
     * the same length that keeps every token cannot fit. */
    const char *lenv[] = {"PIE_LIMITS_DEFAULT_KV_PAGES=6", NULL};
    e2e_cluster c;
    e2e_cluster_start_env(&c, lenv);
    e2e_ref *ref = e2e_ref_open();
    mref m;
    mref_open(&m);
    char *prog = e2e_upload(&c, "attention_sink");
    const char *prompt = "The quick brown fox jumps over the lazy dog. Once upon a time";
    uint32_t p[MAXT], want[MAXT];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    const uint32_t sink = 4, window = 24, n_new = 120;
    cr_assert_gt(np + n_new, 6 * E2E_PAGE, "the run must be longer than the quota allows");

    /* 1. sink 4 + window 24 over 120 tokens: the engine's masked attention, pages bounded */
    sink_reference(&m, p, np, sink, window, n_new, want);
    e2e_run r;
    const char *a1[] = {"--prompt", prompt, "--sink", "4", "--window", "24", "--max-tokens", "120",
                        "--ignore-eos", NULL};
    e2e_run_program(&c, prog, a1, NULL, &r);
    e2e_assert_success(&r, "attention_sink window 24");
    cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
    expect_ref_text(ref, r.msgs[0], r.msg_lens[0], want, n_new, "window 24 vs masked attention");
    long max_pages = field_long(r.msgs[1], "max_pages");
    /* sink pages + the pages a window of W stored tokens plus the new one can straddle */
    long bound = (sink + E2E_PAGE - 1) / E2E_PAGE + (window + 1 + E2E_PAGE - 1) / E2E_PAGE + 1;
    cr_expect_leq(max_pages, bound, "%s: more pages than sink + window need (%ld)", r.msgs[1], bound);
    cr_expect_eq(field_long(r.msgs[1], "tokens"), (long)n_new, "%s", r.msgs[1]);
    cr_expect_gt(field_long(r.msgs[1], "dropped"), 0, "%s", r.msgs[1]);
    /* every token outside sink + window was hidden: stored tokens minus what stays visible */
    cr_expect_eq(field_long(r.msgs[1], "masked"), (long)(np + n_new - 1 - sink - window), "%s",
                 r.msgs[1]);
    e2e_run_free(&r);

    /* 2. a window larger than the sequence is plain greedy decoding */
    size_t nw = e2e_ref_greedy(ref, p, np, 48, true, want);
    const char *a2[] = {"--prompt", prompt, "--window", "100000", "--max-tokens", "48",
                        "--ignore-eos", NULL};
    e2e_run_program(&c, prog, a2, NULL, &r);
    e2e_assert_success(&r, "attention_sink window 100000");
    expect_ref_text(ref, r.msgs[0], r.msg_lens[0], want, nw, "huge window vs greedy");
    cr_expect_eq(field_long(r.msgs[1], "dropped"), 0, "%s", r.msgs[1]);
    cr_expect_eq(field_long(r.msgs[1], "masked"), 0, "%s", r.msgs[1]);
    e2e_run_free(&r);

    /* 3. the same length without a window exceeds the controller's KV quota */
    const char *a3[] = {"--prompt", prompt, "--window", "100000", "--max-tokens", "120",
                        "--ignore-eos", NULL};
    e2e_run_program(&c, prog, a3, NULL, &r);
    cr_expect(r.status_code != 0 || r.exit_code != 0, "keeping every token fit in 6 pages?");
    cr_expect(r.err && strstr(r.err, "KV pages"), "expected a KV page quota error, stderr:\n%s",
              r.err ? r.err : "");
    e2e_run_free(&r);

    free(prog);
    mref_close(&m);
    e2e_ref_close(ref);
    e2e_cluster_stop(&c);
}

/* ==== tree of thought ======================================================================== */

typedef struct tot_node {
    unsigned level, id, parent;
    double score;
    int hit;
    uint32_t toks[64];
    size_t n;
    const char *text;
} tot_node;

static tot_node parse_node(const char *msg) {
    tot_node t = {0};
    int used = 0;
    cr_assert_eq(sscanf(msg, "%u\t%u\t%u\t%lf\t%d\t%n", &t.level, &t.id, &t.parent, &t.score, &t.hit,
                        &used),
                 5, "node message \"%s\"", msg);
    t.n = parse_ids(msg + used, t.toks, 64);
    t.text = strchr(msg + used, '\t');
    cr_assert(t.text, "node message \"%s\" has no text", msg);
    t.text++;
    return t;
}

/* The tokens of node id's path from the question (ancestors first). */
static size_t tot_path(const tot_node *nodes, size_t n, unsigned id, uint32_t *out) {
    if (id == 0) return 0;
    cr_assert(id <= n, "node id %u", id);
    const tot_node *t = &nodes[id - 1];
    size_t k = tot_path(nodes, n, t->parent, out);
    memcpy(out + k, t->toks, t->n * sizeof *out);
    return k + t->n;
}

static int better(const tot_node *a, const tot_node *b) { /* the selection rule */
    if (a->hit != b->hit) return a->hit > b->hit;
    if (a->score != b->score) return a->score > b->score;
    return a->id < b->id;
}

typedef struct tot_args {
    unsigned branch, depth, keep, step;
    const char *answer;
} tot_args;

/* Runs the search and checks every rule of it; the messages stay in *r (caller frees). */
static void check_tree(e2e_cluster *c, e2e_ref *ref, const char *prog, const char *prompt,
                       tot_args ta, e2e_run *r) {
    unsigned branch = ta.branch, depth = ta.depth, keep = ta.keep, step = ta.step;
    char b[8], d[8], k[8], s[8];
    snprintf(b, sizeof b, "%u", branch);
    snprintf(d, sizeof d, "%u", depth);
    snprintf(k, sizeof k, "%u", keep);
    snprintf(s, sizeof s, "%u", step);
    const char *args[] = {"--prompt", prompt, "--branch", b, "--depth", d, "--keep", k,
                          "--step-tokens", s, "--answer", ta.answer, NULL};
    e2e_run_program(c, prog, args, NULL, r);
    e2e_assert_success(r, "tree_of_thought");
    /* sizes: level 1 has branch nodes, each later level min(keep, previous) * branch */
    size_t want_nodes = 0, level_size = branch;
    for (unsigned l = 1; l <= depth; l++) {
        want_nodes += level_size;
        level_size = (level_size < keep ? level_size : keep) * branch;
    }
    cr_assert_eq(r->n_msgs, want_nodes + 1, "%zu messages, expected %zu nodes + a summary", r->n_msgs,
                 want_nodes);
    tot_node *nodes = calloc(want_nodes, sizeof *nodes);
    cr_assert(nodes);
    uint32_t p[MAXT], path[MAXT], want[MAXT];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    for (size_t i = 0; i < want_nodes; i++) {
        nodes[i] = parse_node(r->msgs[i]);
        tot_node *t = &nodes[i];
        cr_assert_eq(t->id, i + 1, "node ids in creation order");
        cr_expect_eq(t->n, step, "node %u has %zu tokens", t->id, t->n);
        size_t n = tot_path(nodes, i + 1, t->id, path);
        /* a hit is a path whose text contains the answer */
        size_t tl;
        char *text = e2e_ref_text(ref, path, n, &tl);
        cr_expect_eq(t->hit, strstr(text, ta.answer) != NULL, "node %u: hit %d for \"%s\"", t->id,
                     t->hit, text);
        free(text);
        /* the score is the path's log-probability under the model */
        double lp = e2e_ref_logprob(ref, p, np, path, n);
        cr_expect(fabs(t->score - lp) <= 1e-3 * fmax(1, fabs(lp)), "node %u score %.6f, engine %.6f",
                  t->id, t->score, lp);
        /* after its first token the node continues greedily */
        uint32_t pre[MAXT];
        memcpy(pre, p, np * sizeof *p);
        memcpy(pre + np, path, (n - t->n + 1) * sizeof *path);
        size_t g = e2e_ref_greedy(ref, pre, np + n - t->n + 1, step - 1, true, want);
        cr_expect(g == t->n - 1 && memcmp(want, t->toks + 1, g * sizeof *want) == 0,
                  "node %u does not continue greedily after its first token", t->id);
        /* siblings start differently, the more likely first token first */
        if (i > 0 && nodes[i - 1].parent == t->parent) {
            cr_expect_neq(nodes[i - 1].toks[0], t->toks[0], "siblings %u and %u start alike",
                          t->id - 1, t->id);
            size_t base = n - t->n;
            double lp_base = e2e_ref_logprob(ref, p, np, path, base);
            double mine = e2e_ref_logprob(ref, p, np, path, base + 1) - lp_base;
            path[base] = nodes[i - 1].toks[0];
            double prev = e2e_ref_logprob(ref, p, np, path, base + 1) - lp_base;
            cr_expect_geq(prev + 1e-4, mine, "sibling %u's first token (%.5f) is less likely than "
                          "sibling %u's (%.5f)", t->id - 1, prev, t->id, mine);
        }
    }
    /* each level's parents are the `keep` best nodes of the level before */
    for (unsigned l = 2; l <= depth; l++) {
        for (size_t i = 0; i < want_nodes; i++) {
            if (nodes[i].level != l) continue;
            const tot_node *par = &nodes[nodes[i].parent - 1];
            cr_assert_eq(par->level, l - 1, "node %u's parent %u is on level %u", nodes[i].id,
                         par->id, par->level);
            unsigned rank = 0; /* how many nodes of the parent's level are better */
            for (size_t j = 0; j < want_nodes; j++)
                if (nodes[j].level == l - 1 && better(&nodes[j], par)) rank++;
            cr_expect_lt(rank, keep, "node %u was expanded but %u nodes of its level are better",
                         par->id, rank);
        }
    }
    /* the winner is the best leaf */
    unsigned best = 0;
    for (size_t i = 0; i < want_nodes; i++)
        if (nodes[i].level == depth && (!best || better(&nodes[i], &nodes[best - 1]))) best = nodes[i].id;
    char head[64];
    snprintf(head, sizeof head, "best=%u nodes=%zu path=", best, want_nodes);
    cr_expect(strncmp(r->msgs[want_nodes], head, strlen(head)) == 0, "summary \"%s\", expected \"%s...\"",
              r->msgs[want_nodes], head);
    free(nodes);
}

Test(e2e_apps, tree_of_thought_follows_its_selection_rule_and_is_deterministic) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    e2e_ref *ref = e2e_ref_open();
    char *prog = e2e_upload(&c, "tree_of_thought");
    const char *prompt = "Question: Tom has 17 apples and buys 25 more. How many apples does he "
                         "have? Let us think step by step.";
    e2e_run r1, r2, r3, r4;
    const tot_args deep = {.branch = 3, .depth = 3, .keep = 1, .step = 5, .answer = "42"};
    check_tree(&c, ref, prog, prompt, deep, &r1);
    check_tree(&c, ref, prog, prompt, deep, &r2); /* greedy: the same tree again */
    cr_assert_eq(r1.n_msgs, r2.n_msgs);
    for (size_t i = 0; i < r1.n_msgs; i++)
        cr_expect_str_eq(r1.msgs[i], r2.msgs[i], "message %zu differs between two runs", i);
    /* 2 + 4 + 4 nodes */
    check_tree(&c, ref, prog, prompt, (tot_args){2, 3, 2, 4, "42"}, &r3);

    /* An answer found only on a first-level node that lost the first search makes that node
     * the one expanded (a hit outranks any score). */
    unsigned expanded = parse_node(r1.msgs[deep.branch]).parent, pick = 0;
    for (unsigned i = 0; i < deep.branch && !pick; i++) {
        tot_node t = parse_node(r1.msgs[i]);
        bool unique = t.id != expanded && t.text[0];
        for (unsigned j = 0; j < deep.branch && unique; j++)
            unique = j == i || !strstr(parse_node(r1.msgs[j]).text, t.text);
        if (unique) pick = t.id;
    }
    cr_assert(pick,
              "tree_of_thought: the text of every first-level node other than the expanded "
              "one (%u) is empty or inside another's: no answer hits it alone, so the hit "
              "case cannot be built from this prompt (choose another)",
              expanded);
    char answer[256];
    snprintf(answer, sizeof answer, "%s", parse_node(r1.msgs[pick - 1]).text);
    tot_args hit = deep;
    hit.answer = answer;
    check_tree(&c, ref, prog, prompt, hit, &r4);
    tot_node again = parse_node(r4.msgs[pick - 1]), child = parse_node(r4.msgs[deep.branch]);
    cr_expect_eq(again.hit, 1, "node %u should hit \"%s\"", again.id, answer);
    cr_expect_eq(child.parent, pick, "the hit node %u was not expanded (node %u's parent is %u)",
                 pick, child.id, child.parent);
    e2e_run_free(&r4);
    e2e_run_free(&r1);
    e2e_run_free(&r2);
    e2e_run_free(&r3);
    free(prog);
    e2e_ref_close(ref);
    e2e_cluster_stop(&c);
}

/* ==== ReAct agent ============================================================================ */

/* A loopback HTTP/1.1 server answering one request per connection: GET <target> gets the body
 * "found <n> pages for step <i>" (n = bytes of the decoded q parameter, i = step). It records
 * every target and body. */
typedef struct http_srv {
    int fd;
    uint16_t port;
    pthread_t thread;
    atomic_bool stop;
    pthread_mutex_t mu;
    char targets[8][1024], bodies[8][128];
    size_t n;
} http_srv;

static size_t url_decode(const char *s, size_t len, char *out) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned v;
        if (s[i] == '%' && i + 2 < len && sscanf(s + i + 1, "%2x", &v) == 1) {
            out[n++] = (char)v;
            i += 2;
        } else {
            out[n++] = s[i] == '+' ? ' ' : s[i];
        }
    }
    out[n] = 0;
    return n;
}

static void http_answer(http_srv *h, int fd) {
    char req[4096] = "";
    size_t len = 0;
    while (len < sizeof req - 1 && !strstr(req, "\r\n\r\n")) {
        ssize_t k = read(fd, req + len, sizeof req - 1 - len);
        if (k <= 0) return;
        len += (size_t)k;
        req[len] = 0;
    }
    char target[1024] = "";
    if (sscanf(req, "GET %1023s HTTP/1.1", target) != 1) return;
    const char *q = strstr(target, "q="), *step = strstr(target, "step=");
    char dec[1024];
    size_t qn = q ? url_decode(q + 2, strcspn(q + 2, "&"), dec) : 0;
    char body[128], resp[256];
    snprintf(body, sizeof body, "found %zu pages for step %ld", qn, step ? strtol(step + 5, NULL, 10) : -1);
    int n = snprintf(resp, sizeof resp,
                     "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n\r\n%s", strlen(body), body);
    pthread_mutex_lock(&h->mu);
    if (h->n < 8) {
        snprintf(h->targets[h->n], sizeof h->targets[0], "%s", target);
        snprintf(h->bodies[h->n], sizeof h->bodies[0], "%s", body);
        h->n++;
    }
    pthread_mutex_unlock(&h->mu);
    for (int off = 0; off < n;) {
        ssize_t k = write(fd, resp + off, (size_t)(n - off));
        if (k <= 0) return;
        off += (int)k;
    }
}

static void *http_loop(void *arg) {
    http_srv *h = arg;
    while (!atomic_load(&h->stop)) {
        struct pollfd pf = {.fd = h->fd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0) continue;
        int fd = accept(h->fd, NULL, NULL);
        if (fd < 0) continue;
        http_answer(h, fd);
        close(fd);
    }
    return NULL;
}

static void http_start(http_srv *h) {
    memset(h, 0, sizeof *h);
    h->fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(h->fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    cr_assert_eq(bind(h->fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(h->fd, 8), 0);
    cr_assert_eq(getsockname(h->fd, (struct sockaddr *)&a, &al), 0);
    h->port = ntohs(a.sin_port);
    cr_assert_eq(pthread_mutex_init(&h->mu, NULL), 0);
    atomic_init(&h->stop, false);
    cr_assert_eq(pthread_create(&h->thread, NULL, http_loop, h), 0);
}

static void http_stop(http_srv *h) {
    atomic_store(&h->stop, true);
    pthread_join(h->thread, NULL);
    close(h->fd);
    pthread_mutex_destroy(&h->mu);
}

/* Appends the tokens of text (no BOS) to seq. */
static size_t push_text(e2e_ref *ref, uint32_t *seq, size_t n, const char *text) {
    return n + e2e_ref_encode(ref, text, seq + n, MAXT / 2 - n);
}

Test(e2e_apps, react_agent_calls_the_tool_and_keeps_its_kv_between_generations) {
    http_srv h;
    http_start(&h);
    char allow[160], url[96];
    snprintf(url, sizeof url, "http://127.0.0.1:%u/tool", (unsigned)h.port);
    snprintf(allow, sizeof allow, "PIE_HTTP_ALLOW=%s", url);
    const char *lenv[] = {allow, NULL};
    e2e_cluster c;
    e2e_cluster_start_env(&c, lenv);
    e2e_ref *ref = e2e_ref_open();
    char *prog = e2e_upload(&c, "react_agent");
    const char *question = "Which river flows through the old town?";
    const unsigned steps = 3, think = 6, act = 4;
    e2e_run r;
    const char *args[] = {"--question", question, "--url", url, "--steps", "3", "--think-tokens",
                          "6", "--action-tokens", "4", NULL};
    e2e_run_program(&c, prog, args, NULL, &r);
    e2e_assert_success(&r, "react_agent");
    cr_assert_eq(r.n_msgs, steps + 1, "messages: %zu", r.n_msgs);
    pthread_mutex_lock(&h.mu);
    size_t n_req = h.n;
    pthread_mutex_unlock(&h.mu);
    cr_assert_eq(n_req, steps, "the tool server got %zu requests", n_req);

    /* Rebuild the token sequence the context must hold and check each piece against it. */
    char first[256];
    snprintf(first, sizeof first, "Question: %s\nThought:", question);
    const char *fp = first;
    uint32_t seq[MAXT], want[MAXT], prev_pages[64], pages[64];
    size_t n = e2e_ref_prompt(ref, &fp, 1, seq), n_prev_pages = 0;
    for (unsigned i = 0; i < steps; i++) {
        const char *m = r.msgs[i];
        cr_assert_eq(field_long(m, "step"), (long)i + 1, "%s", m);
        cr_expect_eq(field_long(m, "status"), 200, "%s", m);
        uint32_t th[64], ac[64];
        size_t nth = parse_ids(field(m, "think"), th, 64), nac = parse_ids(field(m, "action"), ac, 64);
        cr_assert_eq(nth, think);
        cr_assert_eq(nac, act);
        /* the thought is greedy given everything before it, observations included */
        e2e_ref_greedy(ref, seq, n, think, true, want);
        cr_expect(memcmp(th, want, think * sizeof *th) == 0, "step %u: the thought is not the "
                  "greedy continuation of the whole episode", i + 1);
        memcpy(seq + n, th, think * sizeof *th), n += think;
        n = push_text(ref, seq, n, "\nAction: search[");
        e2e_ref_greedy(ref, seq, n, act, true, want);
        cr_expect(memcmp(ac, want, act * sizeof *ac) == 0, "step %u: the query is not greedy", i + 1);
        memcpy(seq + n, ac, act * sizeof *ac), n += act;
        /* the request carried the model's query; the observation is the server's answer */
        const char *tab1 = strchr(m, '\t'), *tab2 = tab1 ? strchr(tab1 + 1, '\t') : NULL;
        cr_assert(tab1 && tab2, "%s", m);
        char target[1024], dec[1024], query[512];
        snprintf(target, sizeof target, "%s", h.targets[i]);
        snprintf(query, sizeof query, "%.*s", (int)(tab2 - tab1 - 1), tab1 + 1);
        char *q = strstr(target, "q=");
        cr_assert(q, "request %s", target);
        url_decode(q + 2, strlen(q + 2), dec);
        cr_expect_str_eq(dec, query, "request %u asked for \"%s\", the model's query was \"%s\"", i + 1,
                         dec, query);
        cr_expect_str_eq(tab2 + 1, h.bodies[i], "observation %u", i + 1);
        /* kept KV: when the answer came, every token but the pending last one was stored; the
         * observation's fill then stored exactly its own tokens plus that one */
        cr_expect_eq(field_long(m, "kv_before"), (long)n - 1, "step %u: %s", i + 1, m);
        char obs[512];
        snprintf(obs, sizeof obs, "]\nObservation: %s\nThought:", h.bodies[i]);
        n = push_text(ref, seq, n, obs);
        cr_expect_eq(field_long(m, "kv_after"), (long)n, "step %u: %s", i + 1, m);
        /* the pages that held the episode so far are still the same pages */
        size_t np = parse_ids(field(m, "pages"), pages, 64);
        cr_expect_eq(np, (n + E2E_PAGE - 1) / E2E_PAGE);
        cr_expect(np >= n_prev_pages && memcmp(pages, prev_pages, n_prev_pages * sizeof *pages) == 0,
                  "step %u: the context's pages changed: %s", i + 1, m);
        memcpy(prev_pages, pages, np * sizeof *pages);
        n_prev_pages = np;
    }
    /* the transcript is the context's text after the question */
    size_t pl = e2e_ref_prompt(ref, &fp, 1, want);
    expect_ref_text(ref, r.msgs[steps], r.msg_lens[steps], seq + pl, n - pl, "transcript");
    e2e_run_free(&r);

    /* a URL outside the allowlist is refused with a reason */
    const char *bad[] = {"--url", "http://127.0.0.1:1/elsewhere", "--steps", "1", NULL};
    e2e_run_program(&c, prog, bad, NULL, &r);
    cr_expect(r.exit_code != 0 || r.status_code != 0, "a disallowed URL was fetched");
    cr_expect(r.err && strstr(r.err, "allow"), "stderr:\n%s", r.err ? r.err : "");
    e2e_run_free(&r);

    free(prog);
    e2e_ref_close(ref);
    e2e_cluster_stop(&c);
    http_stop(&h);
}

/* ==== JSON-constrained decoding ============================================================== */

/* The shape {"name": "<1..max letters or spaces>", "age": <0..999, no leading zero>}, as a
 * checker over a growing byte string: 1 = complete, 0 = a valid prefix, -1 = invalid. */
static int shape_check(const char *s, size_t n, size_t max_name) {
    static const char lit1[] = "{\"name\": \"", lit2[] = ", \"age\": ";
    size_t i = 0;
    for (size_t k = 0; k < sizeof lit1 - 1; k++, i++) {
        if (i == n) return 0;
        if (s[i] != lit1[k]) return -1;
    }
    size_t name = 0;
    for (;; i++) {
        if (i == n) return 0;
        if (s[i] == '"' && name > 0) break;
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || s[i] == ' ') ||
            ++name > max_name)
            return -1;
    }
    i++;
    for (size_t k = 0; k < sizeof lit2 - 1; k++, i++) {
        if (i == n) return 0;
        if (s[i] != lit2[k]) return -1;
    }
    size_t digits = 0;
    for (;; i++) {
        if (i == n) return 0;
        if (s[i] == '}' && digits > 0) break;
        if (s[i] < '0' || s[i] > '9' || digits == 3 || (digits == 1 && s[i - 1] == '0')) return -1;
        digits++;
    }
    return i + 1 == n ? 1 : -1;
}

/* The byte the shape takes when no allowed token is among the candidates (json_constrained.c's
 * rule): the literal's next byte, '"' / '}' to close a non-empty name / age, else 'A' / '0'. */
static char shape_default(const char *s, size_t n, size_t max_name) {
    static const char *const tries = "A0{\"name: ,g"; /* A / 0 first: start a name / age */
    char buf[512];
    memcpy(buf, s, n);
    /* a literal byte is the only byte allowed; otherwise prefer closing over starting */
    for (const char *c = "\"}"; *c; c++) {
        buf[n] = *c;
        if (shape_check(buf, n + 1, max_name) >= 0) return *c;
    }
    for (const char *c = tries; *c; c++) {
        buf[n] = *c;
        if (shape_check(buf, n + 1, max_name) >= 0) return *c;
    }
    cr_assert_fail("no byte continues \"%.*s\"", (int)n, s);
    return 0; /* not reached */
}

/* The lowest-id token whose bytes are exactly b (not eos). */
static uint32_t byte_token(mref *m, char b) {
    for (uint32_t id = 0; id < tok_vocab_size(m->t); id++) {
        size_t bl;
        const uint8_t *p = tok_token_bytes(m->t, id, &bl);
        if (p && bl == 1 && p[0] == (uint8_t)b && (int32_t)id != m->info->eos_token_id) return id;
    }
    cr_assert_fail("no token for byte '%c'", b);
    return 0; /* not reached */
}

/* Greedy decoding restricted to tokens that keep the text a valid prefix of the shape, seeing
 * only the k most likely candidates of each step (the host's top-k); *forced counts the steps
 * where none of them was allowed. */
static size_t json_reference(mref *m, const uint32_t *prompt, size_t np, size_t max_name,
                             uint32_t k, uint32_t *out, size_t *forced) {
    uint32_t vocab = m->info->vocab_size, ntok = tok_vocab_size(m->t);
    float *logits = malloc(vocab * sizeof *logits);
    bool *allowed = malloc(vocab);
    char text[512];
    size_t tl = 0, n = 0;
    cr_assert(logits && allowed);
    *forced = 0;
    mref_forward(m, prompt, (uint32_t)np, NULL, 0);
    for (;;) {
        mref_logits(m, logits);
        bool any = false;
        for (uint32_t id = 0; id < vocab; id++) {
            size_t bl = 0;
            const uint8_t *b = id < ntok ? tok_token_bytes(m->t, id, &bl) : NULL;
            allowed[id] = b && bl && tl + bl < sizeof text &&
                          (m->info->eos_token_id < 0 || id != (uint32_t)m->info->eos_token_id);
            if (allowed[id]) {
                memcpy(text + tl, b, bl);
                allowed[id] = shape_check(text, tl + bl, max_name) >= 0;
            }
            any |= allowed[id];
        }
        uint32_t t = any ? argmax_where(logits, vocab, allowed) : UINT32_MAX, rank = 0;
        for (uint32_t id = 0; any && id < vocab; id++) rank += logits[id] > logits[t];
        if (!any || rank >= k) {
            t = byte_token(m, shape_default(text, tl, max_name));
            ++*forced;
        }
        size_t bl;
        const uint8_t *b = tok_token_bytes(m->t, t, &bl);
        memcpy(text + tl, b, bl);
        tl += bl;
        out[n++] = t;
        if (shape_check(text, tl, max_name) == 1) break;
        mref_forward(m, &t, 1, NULL, 0);
    }
    free(logits);
    free(allowed);
    return n;
}

/* Parses msg as JSON and checks it is exactly {"name": string, "age": integer}. */
static void expect_person(const char *msg, size_t max_name) {
    json_error_t err;
    json_t *j = json_loads(msg, JSON_REJECT_DUPLICATES, &err);
    cr_assert(j, "\"%s\" is not JSON: %s", msg, err.text);
    cr_expect(json_is_object(j) && json_object_size(j) == 2, "\"%s\": not a 2-key object", msg);
    json_t *name = json_object_get(j, "name"), *age = json_object_get(j, "age");
    cr_expect(json_is_string(name) && json_string_length(name) >= 1 &&
                  json_string_length(name) <= max_name,
              "\"%s\": name", msg);
    cr_expect(json_is_integer(age) && json_integer_value(age) >= 0 && json_integer_value(age) <= 999,
              "\"%s\": age", msg);
    cr_expect_eq(shape_check(msg, strlen(msg), max_name), 1, "\"%s\" is not the exact shape", msg);
    json_decref(j);
}

Test(e2e_apps, json_constrained_output_always_parses_and_greedy_matches_the_engine) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    e2e_ref *ref = e2e_ref_open();
    mref m;
    mref_open(&m);
    char *prog = e2e_upload(&c, "json_constrained");
    const char *prompt = "Once upon a time there was a fisherman. As JSON:";
    uint32_t p[MAXT], want[MAXT], got[MAXT];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);

    e2e_run r;
    const char *a1[] = {"--prompt", prompt, NULL};
    e2e_run_program(&c, prog, a1, NULL, &r);
    e2e_assert_success(&r, "json_constrained greedy");
    cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
    expect_person(r.msgs[0], 12);
    size_t forced;
    size_t nw = json_reference(&m, p, np, 12, (uint32_t)field_long(r.msgs[1], "k"), want, &forced);
    size_t ng = parse_ids(field(r.msgs[1], "ids"), got, MAXT);
    cr_expect(ng == nw && memcmp(got, want, nw * sizeof *got) == 0,
              "greedy constrained tokens differ from the engine's (%zu vs %zu tokens): %s", ng, nw,
              r.msgs[1]);
    cr_expect_eq(field_long(r.msgs[1], "forced"), (long)forced, "%s", r.msgs[1]);
    expect_ref_text(ref, r.msgs[0], r.msg_lens[0], want, nw, "constrained greedy text");
    e2e_run_free(&r);

    /* sampled at a high temperature, short names: still always the shape */
    const char *seeds[] = {"1", "2", "3", "4"};
    for (size_t i = 0; i < 4; i++) {
        const char *a[] = {"--prompt", prompt, "--temperature", "1.5", "--seed", seeds[i],
                           "--max-name", "5", NULL};
        e2e_run_program(&c, prog, a, NULL, &r);
        e2e_assert_success(&r, "json_constrained sampled");
        cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
        expect_person(r.msgs[0], 5);
        e2e_run_free(&r);
    }
    free(prog);
    mref_close(&m);
    e2e_ref_close(ref);
    e2e_cluster_stop(&c);
}

/* ==== watermark ============================================================================== */

/* The green list from the specification in watermark.c (key 15485863, gamma 0.5). */
static uint64_t sm64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static bool is_green(uint32_t prev, uint32_t t) {
    uint64_t h = sm64(15485863ull ^ ((uint64_t)prev * 0x9E3779B97F4A7C15ull) ^
                      ((uint64_t)t * 0xC2B2AE3D27D4EB4Full));
    return (h >> 11) < (1ull << 52);
}

/* Runs a generation; returns the z-score this test computes from the reported ids. */
static double wm_generate(e2e_cluster *c, const char *prog, const char *prompt, uint32_t last,
                          const char *delta, char **text) {
    const char *a[] = {"--prompt", prompt, "--delta", delta, "--seed", "7", "--max-tokens", "64", NULL};
    e2e_run r;
    e2e_run_program(c, prog, a, NULL, &r);
    e2e_assert_success(&r, "watermark");
    cr_assert_eq(r.n_msgs, 2, "messages: %zu", r.n_msgs);
    uint32_t ids[MAXT + 1] = {last};
    size_t n = parse_ids(field(r.msgs[1], "ids"), ids + 1, MAXT), g = 0, t = 0;
    cr_assert_eq(n, 64);
    for (size_t i = 1; i <= n; i++) { /* each distinct (previous, token) pair once */
        bool seen = false;
        for (size_t j = 1; j < i && !seen; j++) seen = ids[j - 1] == ids[i - 1] && ids[j] == ids[i];
        if (seen) continue;
        t++;
        g += is_green(ids[i - 1], ids[i]);
    }
    double z = ((double)g - 0.5 * (double)t) / sqrt((double)t * 0.25);
    cr_expect_eq(field_long(r.msgs[1], "scored"), (long)t, "%s: this test scores %zu", r.msgs[1], t);
    cr_expect_eq(field_long(r.msgs[1], "green"), (long)g, "%s: this test counts %zu green", r.msgs[1], g);
    cr_expect(fabs(strtod(field(r.msgs[1], "z"), NULL) - z) < 1e-3, "%s: z %.4f", r.msgs[1], z);
    *text = strdup(r.msgs[0]);
    e2e_run_free(&r);
    return z;
}

static double wm_detect(e2e_cluster *c, const char *prog, const char *text, const char *key) {
    const char *a[] = {"--detect", "--key", key, NULL}, *in[] = {text, NULL};
    e2e_run r;
    e2e_run_program(c, prog, a, in, &r);
    e2e_assert_success(&r, "watermark --detect");
    cr_assert_eq(r.n_msgs, 1, "messages: %zu", r.n_msgs);
    double z = strtod(field(r.msgs[0], "z"), NULL);
    e2e_run_free(&r);
    return z;
}

Test(e2e_apps, watermark_detector_separates_watermarked_from_plain_text) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    e2e_ref *ref = e2e_ref_open();
    char *prog = e2e_upload(&c, "watermark");
    const char *prompt = "In a small village by the sea there lived";
    uint32_t p[MAXT];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    char *marked, *plain;
    double zm = wm_generate(&c, prog, prompt, p[np - 1], "4", &marked);
    double zp = wm_generate(&c, prog, prompt, p[np - 1], "0", &plain);
    cr_expect_gt(zm, 4.0, "watermarked generation: z %.3f", zm);
    cr_expect_lt(fabs(zp), 3.0, "plain generation: z %.3f", zp);
    /* the detector sees only text (re-tokenized): still far apart */
    double dm = wm_detect(&c, prog, marked, "15485863"), dp = wm_detect(&c, prog, plain, "15485863");
    cr_expect_gt(dm, 4.0, "detector on watermarked text: z %.3f (generation %.3f)", dm, zm);
    cr_expect_lt(fabs(dp), 3.0, "detector on plain text: z %.3f (generation %.3f)", dp, zp);
    /* without the key the watermark is invisible */
    double dk = wm_detect(&c, prog, marked, "1");
    cr_expect_lt(fabs(dk), 3.0, "detector with another key on watermarked text: z %.3f", dk);
    free(marked);
    free(plain);
    free(prog);
    e2e_ref_close(ref);
    e2e_cluster_stop(&c);
}

/* ==== messaging ============================================================================== */

Test(e2e_apps, messaging_consumers_receive_every_line_the_producer_broadcasts) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    e2e_ref *ref = e2e_ref_open();
    char *prod = e2e_upload(&c, "messaging_producer"), *cons = e2e_upload(&c, "messaging_consumer");
    const char *prompt = "Once upon a time";
    /* two consumers start first and wait; the producer runs while they do */
    const char *ca[] = {"--topic", "e2e-lines", NULL};
    rpc_stream *s1 = e2e_run_open(&c, cons, ca, NULL), *s2 = e2e_run_open(&c, cons, ca, NULL);
    e2e_run pr, c1, c2;
    const char *pa[] = {"--topic", "e2e-lines", "--prompt", prompt, "--lines", "3",
                        "--tokens-per-line", "6", "--consumers", "2", NULL};
    e2e_run_program(&c, prod, pa, NULL, &pr);
    e2e_assert_success(&pr, "messaging_producer");
    e2e_run_collect(s1, &c1);
    e2e_run_collect(s2, &c2);
    e2e_assert_success(&c1, "messaging_consumer 1");
    e2e_assert_success(&c2, "messaging_consumer 2");
    cr_assert_eq(pr.n_msgs, 4, "producer messages: %zu", pr.n_msgs);
    cr_expect_str_eq(pr.msgs[3], "consumers=2 lines=3");
    /* the lines together are the greedy completion of the prompt */
    uint32_t p[MAXT], want[MAXT];
    size_t np = e2e_ref_prompt(ref, &prompt, 1, p);
    e2e_ref_greedy(ref, p, np, 18, true, want);
    char all[1024] = "";
    for (size_t i = 0; i < 3; i++) strncat(all, pr.msgs[i], sizeof all - strlen(all) - 1);
    expect_ref_text(ref, all, strlen(all), want, 18, "producer lines");
    const e2e_run *cs[] = {&c1, &c2};
    for (size_t k = 0; k < 2; k++) {
        cr_assert_eq(cs[k]->n_msgs, 4, "consumer %zu messages: %zu", k + 1, cs[k]->n_msgs);
        for (size_t i = 0; i < 3; i++)
            cr_expect_str_eq(cs[k]->msgs[i], pr.msgs[i], "consumer %zu line %zu", k + 1, i);
        cr_expect_str_eq(cs[k]->msgs[3], "received=3");
    }
    e2e_run_free(&pr);
    e2e_run_free(&c1);
    e2e_run_free(&c2);
    free(prod);
    free(cons);
    e2e_ref_close(ref);
    e2e_cluster_stop(&c);
}
