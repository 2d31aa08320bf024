/* test_eng_tp.c — the cpu engine as a tensor-parallel group (eng.h's tp_rank / tp_size / coll,
 * engine/eng_cpu_tp.c, engine/eng_shard.c) against the same engine at tp_size 1.
 *
 * One scenario runs at tp 1, 2 and 4, each rank a forked process with its own engine and the
 * group's host collective (services/worker/tp/wrk_coll.h): a prefill with two outputs, a
 * second sequence sharing the first's KV page 0, decode steps of both in one batch, a page
 * mask on the shared page, a page copy read without appending, an explicit attention mask,
 * distributions with small and large top_k (larger than one rank's vocabulary slice) and
 * temperatures, and full logits. Also: 64 greedy tokens of small-bf16, a rank that dies
 * mid-generation, shapes that do not split and collectives that do not match.
 * tiny models have 4 heads and 2 KV heads: tp 2 splits the KV heads, tp 4 replicates them
 * (one query head per rank); small-f32 has 8 and 2 (at tp 4, two query heads per rank).
 * Expected: every rank of a group returns the same bits; the group's distributions equal tp
 * 1's (ids, and probabilities and logits within 1e-5 relative on f32 models, 1e-4 on bf16
 * ones: the sums run in another order, and AMX picks its path per shape), its KV pool a share
 * of tp 1's.
 * No test sets Criterion's .timeout: its watchdog now and then leaks an allocation in the runner
 * under LeakSanitizer; ctest's TIMEOUT bounds a hang, and every wait of the collective has its
 * own deadline. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "eng.h"
#include "pie_testranks.h"
#include "wrk_coll.h"

#define PAGE      16
#define MAX_DISTS 24
#define MAX_K     300
#define MAX_VOCAB 2048
#define TOL_REL   1e-5
/* bf16 weights: on a CPU with AMX the bf16 linear kernel rounds its activations to bf16 and is
 * chosen per shape, so a rank's shard can take another path than tp 1's whole matrix (seen at
 * tp 4 on tiny-bf16: 1.9e-5). The issue asks bf16 groups for the same greedy tokens (tested
 * below, 64 of them); their distributions are held to this. */
#define TOL_REL_BF16 1e-4

typedef struct tp_dist {
    uint32_t k;
    uint32_t ids[MAX_K];
    float probs[MAX_K];
} tp_dist;

/* What one rank observed. */
typedef struct tp_result {
    uint32_t n_dists;
    tp_dist dists[MAX_DISTS];
    float logits[MAX_VOCAB];
    eng_info info;
    eng_swap_stats swap;   /* after the scenario */
    eng_offload_stats off; /* after the scenario */
} tp_result;

/* The memory policy a scenario runs under (tests of policies inside a group). */
typedef enum tp_policy { TP_GPU, TP_SWAP, TP_OFFLOAD } tp_policy;

typedef struct tp_run {
    const char *model;
    tp_result *res;         /* [n_ranks], shared with the parent */
    const char *tcp_leader; /* the collective's TCP transport (rank 0's listener); NULL: shm */
    int listen_fd;          /* rank 0's listener when tcp_leader is set */
    tp_policy policy;
} tp_run;

/* ---- the scenario (runs in every rank) ---------------------------------------------------- */

typedef struct tp_ctx {
    eng *e;
    tp_result *out;
    uint32_t rank;
    pie_status st;
} tp_ctx;

static uint32_t tok(uint32_t seq, uint32_t i) { return (seq * 7919u + i * 104729u + 13u) % 512u; }

static int embed(tp_ctx *c, uint32_t slot0, uint32_t seq, uint32_t from, uint32_t n) {
    uint32_t slots[64], toks[64], pos[64];
    for (uint32_t i = 0; i < n; i++) {
        slots[i] = slot0 + i;
        toks[i] = tok(seq, from + i);
        pos[i] = from + i;
    }
    PIE_RANK_CHECK(c->rank, eng_embed_text(c->e, slots, toks, pos, n, &c->st) == PIE_OK,
                   "embed: %s", c->st.msg);
    return 0;
}

/* slot ← token at position pos */
static int embed_one(tp_ctx *c, uint32_t slot, uint32_t token, uint32_t pos) {
    PIE_RANK_CHECK(c->rank, eng_embed_text(c->e, &slot, &token, &pos, 1, &c->st) == PIE_OK,
                   "embed: %s", c->st.msg);
    return 0;
}

static eng_forward_item item(const uint32_t *pages, uint32_t seq_len, bool append,
                             const uint32_t *in, uint32_t n_in, const uint32_t *out,
                             uint32_t n_out) {
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = (seq_len + PAGE - 1) / PAGE,
                              .kv_last_page_len = (seq_len - 1) % PAGE + 1,
                              .append_kv = append,
                              .in_slots = in,
                              .n_in = n_in,
                              .out_slots = out,
                              .n_out = n_out};
}

static int forward(tp_ctx *c, const eng_forward_item *items, uint32_t n) {
    PIE_RANK_CHECK(c->rank, eng_forward(c->e, items, n, &c->st) == PIE_OK, "forward: %s",
                   c->st.msg);
    return 0;
}

/* Records the distribution of slot; *argmax ← its most likely id. */
static int dist(tp_ctx *c, uint32_t slot, uint32_t k, float temperature, uint32_t *argmax) {
    PIE_RANK_CHECK(c->rank, c->out->n_dists < MAX_DISTS, "too many distributions");
    tp_dist *d = &c->out->dists[c->out->n_dists++];
    eng_dist_item it = {
        .slot = slot, .top_k = k, .temperature = temperature, .ids = d->ids, .probs = d->probs};
    d->k = k;
    PIE_RANK_CHECK(c->rank, eng_next_dist(c->e, &it, 1, &c->st) == PIE_OK, "next_dist: %s",
                   c->st.msg);
    if (argmax) *argmax = d->ids[0];
    return 0;
}

/* Two distributions in one call (the merge handles rows of different top_k together). */
static int dist2(tp_ctx *c, uint32_t slot_a, uint32_t slot_b, uint32_t k_a, uint32_t k_b) {
    PIE_RANK_CHECK(c->rank, c->out->n_dists + 2 <= MAX_DISTS, "too many distributions");
    tp_dist *a = &c->out->dists[c->out->n_dists++], *b = &c->out->dists[c->out->n_dists++];
    a->k = k_a;
    b->k = k_b;
    eng_dist_item its[2] = {
        {.slot = slot_a, .top_k = k_a, .temperature = 1.0f, .ids = a->ids, .probs = a->probs},
        {.slot = slot_b, .top_k = k_b, .temperature = 0.8f, .ids = b->ids, .probs = b->probs}};
    PIE_RANK_CHECK(c->rank, eng_next_dist(c->e, its, 2, &c->st) == PIE_OK, "next_dist: %s",
                   c->st.msg);
    return 0;
}

#define RUN(x)                  \
    do {                        \
        if ((x) != 0) return 1; \
    } while (0)

static int scenario(tp_ctx *c) {
    static const uint32_t pages_a[] = {0, 1}, pages_b[] = {0, 2}, pages_c[] = {0, 3};
    uint32_t in[32], next_a = 0, next_b = 0;
    for (uint32_t i = 0; i < 32; i++) in[i] = i;
    /* 1. sequence A: 20 tokens prefilled into pages 0 and 1, the last two inputs out */
    RUN(embed(c, 0, 0, 0, 20));
    uint32_t out_a[2] = {39, 40};
    eng_forward_item a = item(pages_a, 20, true, in, 20, out_a, 2);
    RUN(forward(c, &a, 1));
    RUN(dist(c, 40, 16, 1.0f, &next_a));
    RUN(dist(c, 39, MAX_K, 1.0f, NULL)); /* more than a tp 4 rank's 128 vocabulary rows */
    RUN(dist(c, 40, 8, 0.7f, NULL));
    /* 2. sequence B shares page 0 (A's first 16 tokens) and prefills 6 tokens into page 2,
     *    in one batch with A's first decode step */
    uint32_t len_a = 21, len_b = 22, slot_next = 60;
    RUN(embed(c, 20, 1, 16, 6));
    RUN(embed_one(c, 26, next_a, 20));
    uint32_t out_42 = 42, out_41 = 41;
    eng_forward_item batch[2] = {item(pages_a, len_a, true, &in[26], 1, &out_42, 1),
                                 item(pages_b, len_b, true, &in[20], 6, &out_41, 1)};
    RUN(forward(c, batch, 2));
    RUN(dist2(c, 42, 41, 16, 64));
    RUN(dist(c, 41, 1, 1.0f, &next_b));
    RUN(dist(c, 42, 1, 1.0f, &next_a));
    /* 3. decode both greedily, one batch per step; page 0's token 5 masked before the last */
    for (uint32_t step = 0; step < 4; step++) {
        if (step == 3) {
            bool masked[PAGE] = {false};
            masked[5] = true;
            PIE_RANK_CHECK(c->rank, eng_mask_page(c->e, 0, masked, &c->st) == PIE_OK,
                           "mask_page: %s", c->st.msg);
        }
        uint32_t sa = slot_next++, sb = slot_next++, oa = slot_next++, ob = slot_next++;
        RUN(embed_one(c, sa, next_a, len_a));
        RUN(embed_one(c, sb, next_b, len_b));
        len_a++;
        len_b++;
        eng_forward_item b2[2] = {item(pages_a, len_a, true, &sa, 1, &oa, 1),
                                  item(pages_b, len_b, true, &sb, 1, &ob, 1)};
        RUN(forward(c, b2, 2));
        RUN(dist(c, oa, 32, 1.0f, &next_a));
        RUN(dist(c, ob, 32, 1.3f, &next_b));
    }
    /* 4. A's page 1 copied to page 3; C reads pages 0 and 3 as context without appending */
    eng_copy_item cp = {.src = 1, .dst = 3, .src_off = 0, .dst_off = 0, .count = len_a - PAGE};
    PIE_RANK_CHECK(c->rank, eng_copy_pages(c->e, &cp, 1, &c->st) == PIE_OK, "copy_pages: %s",
                   c->st.msg);
    uint32_t sc = slot_next++, oc = slot_next++;
    RUN(embed_one(c, sc, next_a, len_a));
    eng_forward_item ci = item(pages_c, len_a, false, &sc, 1, &oc, 1);
    RUN(forward(c, &ci, 1));
    RUN(dist(c, oc, 16, 1.0f, NULL));
    /* 5. two inputs after A's context with an explicit mask (tokens 3-6, then 5-6, hidden) */
    uint32_t sd[2] = {slot_next, slot_next + 1}, od[2] = {slot_next + 2, slot_next + 3};
    slot_next += 4;
    RUN(embed_one(c, sd[0], next_a, len_a));
    RUN(embed_one(c, sd[1], next_b, len_a + 1));
    uint32_t runs[6] = {3, 4, len_a + 1 - 7, 5, 2, len_a + 2 - 7};
    eng_forward_item di = item(pages_a, len_a, false, sd, 2, od, 2);
    di.mask_runs = runs;
    di.n_mask_runs = 6;
    RUN(forward(c, &di, 1));
    RUN(dist2(c, od[0], od[1], 16, 16));
    /* 6. full logits */
    PIE_RANK_CHECK(c->rank, eng_get_info(c->e)->vocab_size <= MAX_VOCAB, "vocabulary too large");
    PIE_RANK_CHECK(c->rank, eng_logits(c->e, oc, c->out->logits, &c->st) == PIE_OK, "logits: %s",
                   c->st.msg);
    return 0;
}

/* Offload's pick on rank 0 (every decode to the host) and on the others (none): a rank that
 * decided for itself would attend nothing on its host pool. */
static bool pick_all(void *user, uint32_t item, const eng_forward_item *it) {
    (void)user, (void)item, (void)it;
    return true;
}

static bool pick_none(void *user, uint32_t item, const eng_forward_item *it) {
    (void)user, (void)item, (void)it;
    return false;
}

static int rank_scenario(uint32_t rank, uint32_t n, const char *name, void *arg) {
    const tp_run *run = arg;
    tp_ctx c = {.out = &run->res[rank], .rank = rank};
    memset(c.out, 0, sizeof *c.out);
    wrk_coll *coll = NULL;
    if (n > 1) {
        wrk_coll_opts co = {
            .name = name, .epoch = 1, .rank = rank, .n_ranks = n, .timeout_ms = 60000};
        if (run->tcp_leader) {
            co.tcp_leader = run->tcp_leader;
            co.tcp_listen_fd = rank == 0 ? run->listen_fd : -1;
            if (rank != 0) close(run->listen_fd); /* rank 0's, inherited */
        }
        PIE_RANK_CHECK(rank, wrk_coll_open(&co, &coll, &c.st) == PIE_OK, "wrk_coll_open: %s",
                       c.st.msg);
    }
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", PIE_MODELS_DIR, run->model);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = 8,
                  .embed_slots = 96,
                  .max_batch_tokens = 64,
                  .n_threads = 1,
                  .tp_rank = rank,
                  .tp_size = n,
                  .coll = coll};
    if (run->policy == TP_SWAP) { /* every layer on the device at open */
        o.swap_slots = 4;
        o.swap_min_slots = 2;
        o.swap_host_bytes = 64u << 20;
    } else if (run->policy == TP_OFFLOAD) {
        o.offload_device_pages = o.kv_pages;
        o.offload_host_threads = 1;
        o.offload_pick = rank == 0 ? pick_all : pick_none;
    }
    PIE_RANK_CHECK(rank, eng_open(&o, &c.e, &c.st) == PIE_OK, "eng_open: %s", c.st.msg);
    c.out->info = *eng_get_info(c.e);
    /* swap: rank 0 alone moves two layers to the host, as the worker's expansion does */
    if (run->policy == TP_SWAP && rank == 0)
        PIE_RANK_CHECK(rank, eng_swap_set_slots(c.e, 2, NULL, &c.st) == PIE_OK,
                       "swap_set_slots: %s", c.st.msg);
    int rc = scenario(&c);
    eng_swap_quiesce(c.e);
    eng_swap_get_stats(c.e, &c.out->swap);
    eng_offload_get_stats(c.e, &c.out->off);
    eng_close(c.e);
    wrk_coll_close(coll);
    return rc;
}

/* ---- comparison (in the test process) ---------------------------------------------------------
 */

/* Whether got matches want: the same probabilities position by position within tol_rel
 * (relative), and the same ids, except that two ids whose probabilities are within that
 * tolerance of each other may trade places (a tie broken by a rounding difference). */
static bool same_dist(const tp_dist *got, const tp_dist *want, double tol_rel, char *why,
                      size_t cap, double *worst) {
    for (uint32_t j = 0; j < want->k; j++) {
        double tol = tol_rel * fabs((double)want->probs[j]) + 1e-12;
        double d = fabs((double)got->probs[j] - want->probs[j]);
        if (want->probs[j] > 0) *worst = fmax(*worst, d / want->probs[j]);
        if (d > tol) {
            snprintf(why, cap, "position %u: probability %.9g, want %.9g", j, got->probs[j],
                     want->probs[j]);
            return false;
        }
        if (got->ids[j] == want->ids[j]) continue;
        bool tie = false; /* got's id sits nearby in want with a probability within tol */
        for (uint32_t i = 0; i < want->k && !tie; i++)
            tie = want->ids[i] == got->ids[j] &&
                  fabs((double)want->probs[i] - got->probs[j]) <= 2 * tol;
        if (!tie) {
            snprintf(why, cap, "position %u: id %u (p %.9g), want id %u (p %.9g)", j, got->ids[j],
                     got->probs[j], want->ids[j], want->probs[j]);
            return false;
        }
    }
    return true;
}

static tp_result *shared_results(size_t n) {
    void *p = mmap(NULL, n * sizeof(tp_result), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                   -1, 0);
    cr_assert_neq(p, MAP_FAILED, "mmap of the results");
    return p;
}

/* Runs the scenario at tp 1, 2 and 4 on model and checks the groups against tp 1 within tol
 * (relative). */
static void check_model(const char *model, double tol) {
    tp_result *res = shared_results(1 + 2 + 4);
    tp_result *at[5] = {NULL, res, res + 1, NULL, res + 3};
    for (uint32_t tp = 1; tp <= 4; tp *= 2) {
        tp_run run = {.model = model, .res = at[tp]};
        int status[PIE_TESTRANKS_MAX];
        int failed = pie_testranks_run(tp, rank_scenario, &run, status);
        cr_assert_eq(failed, 0, "%s at tp %u: %d rank(s) failed (their stderr says why)", model, tp,
                     failed);
    }
    const tp_result *ref = at[1];
    cr_assert_eq(ref->info.local_kv_heads, ref->info.n_kv_heads);
    for (uint32_t tp = 2; tp <= 4; tp *= 2) {
        const tp_result *g = at[tp];
        for (uint32_t r = 1; r < tp; r++)
            cr_expect(memcmp(g[r].dists, g[0].dists, sizeof g[0].dists) == 0 &&
                          memcmp(g[r].logits, g[0].logits, sizeof g[0].logits) == 0,
                      "%s at tp %u: rank %u's results differ from rank 0's", model, tp, r);
        cr_assert_eq(g[0].n_dists, ref->n_dists);
        double worst = 0;
        for (uint32_t i = 0; i < ref->n_dists; i++) {
            char why[256];
            cr_expect(same_dist(&g[0].dists[i], &ref->dists[i], tol, why, sizeof why, &worst),
                      "%s at tp %u: distribution %u (top_k %u): %s", model, tp, i, ref->dists[i].k,
                      why);
        }
        double lw = 0, scale = 0;
        for (uint32_t v = 0; v < ref->info.vocab_size; v++) {
            lw = fmax(lw, fabs((double)g[0].logits[v] - ref->logits[v]));
            scale = fmax(scale, fabs((double)ref->logits[v]));
        }
        cr_expect(lw <= tol * scale, "%s at tp %u: logits differ by %.3g (relative), more than %g",
                  model, tp, lw / scale, tol);
        /* KV heads: split at tp 2 (2 → 1 each), replicated at tp 4 (1 each) */
        for (uint32_t r = 0; r < tp; r++) {
            cr_expect_eq(g[r].info.tp_rank, r);
            cr_expect_eq(g[r].info.tp_size, tp);
            cr_expect_eq(g[r].info.local_kv_heads, 1u);
            cr_expect_eq(g[r].info.kv_pool_bytes * 2 - ref->info.kv_pool_bytes,
                         (size_t)ref->info.kv_pages * ref->info.kv_page_size +
                             (size_t)ref->info.kv_pages * sizeof(uint32_t),
                         "%s at tp %u: rank %u's KV pool is not half of tp 1's (masks aside)",
                         model, tp, r);
            cr_expect_lt(g[r].info.weight_bytes, ref->info.weight_bytes);
        }
        cr_log_info("%s at tp %u: worst relative probability difference %.3g", model, tp, worst);
    }
    munmap(res, 7 * sizeof(tp_result));
}

Test(eng_tp, tp_2_and_4_give_tp_1_distributions_on_f32) { check_model("tiny-f32", TOL_REL); }

Test(eng_tp, tp_2_and_4_give_tp_1_distributions_with_an_untied_lm_head) {
    check_model("tiny-sharded", TOL_REL);
}

Test(eng_tp, tp_2_and_4_give_tp_1_distributions_on_bf16) { check_model("tiny-bf16", TOL_REL_BF16); }

/* 8 heads, 2 KV heads: at tp 4 two ranks share each KV head, two query heads each */
Test(eng_tp, tp_2_and_4_give_tp_1_distributions_on_the_small_model) {
    check_model("small-f32", TOL_REL);
}

/* ---- greedy generation ------------------------------------------------------------------------
 */

#define GREEDY_PROMPT 8
#define GREEDY_STEPS  64

/* 64 greedy tokens after an 8-token prompt, one decode step each, into out[rank]. */
static int rank_greedy(uint32_t rank, uint32_t n, const char *name, void *arg) {
    uint32_t(*out)[GREEDY_STEPS] = arg;
    pie_status st = {0};
    wrk_coll *coll = NULL;
    if (n > 1) {
        wrk_coll_opts co = {
            .name = name, .epoch = 1, .rank = rank, .n_ranks = n, .timeout_ms = 60000};
        PIE_RANK_CHECK(rank, wrk_coll_open(&co, &coll, &st) == PIE_OK, "wrk_coll_open: %s", st.msg);
    }
    char dir[512];
    snprintf(dir, sizeof dir, "%s/small-bf16", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = 8,
                  .embed_slots = 16,
                  .max_batch_tokens = 16,
                  .n_threads = 1,
                  .tp_rank = rank,
                  .tp_size = n,
                  .coll = coll};
    tp_ctx c = {.rank = rank};
    PIE_RANK_CHECK(rank, eng_open(&o, &c.e, &st) == PIE_OK, "eng_open: %s", st.msg);
    static const uint32_t pages[] = {0, 1, 2, 3, 4};
    uint32_t in[GREEDY_PROMPT], slot_out = 15, token = 0;
    for (uint32_t i = 0; i < GREEDY_PROMPT; i++) in[i] = i;
    RUN(embed(&c, 0, 3, 0, GREEDY_PROMPT));
    eng_forward_item it = item(pages, GREEDY_PROMPT, true, in, GREEDY_PROMPT, &slot_out, 1);
    RUN(forward(&c, &it, 1));
    for (uint32_t s = 0; s < GREEDY_STEPS; s++) {
        float p;
        eng_dist_item d = {
            .slot = slot_out, .top_k = 1, .temperature = 1.0f, .ids = &token, .probs = &p};
        PIE_RANK_CHECK(rank, eng_next_dist(c.e, &d, 1, &st) == PIE_OK, "next_dist: %s", st.msg);
        out[rank][s] = token;
        uint32_t len = GREEDY_PROMPT + s + 1, slot_in = s % 2;
        RUN(embed_one(&c, slot_in, token, len - 1));
        it = item(pages, len, true, &slot_in, 1, &slot_out, 1);
        RUN(forward(&c, &it, 1));
    }
    eng_close(c.e);
    wrk_coll_close(coll);
    return 0;
}

Test(eng_tp, tp_2_and_4_generate_tp_1s_64_greedy_tokens_on_bf16) {
    uint32_t(*res)[GREEDY_STEPS] =
        mmap(NULL, 7 * sizeof *res, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq((void *)res, MAP_FAILED);
    uint32_t(*at[5])[GREEDY_STEPS] = {NULL, res, res + 1, NULL, res + 3};
    for (uint32_t tp = 1; tp <= 4; tp *= 2) {
        int status[PIE_TESTRANKS_MAX];
        cr_assert_eq(pie_testranks_run(tp, rank_greedy, at[tp], status), 0,
                     "tp %u: a rank failed (its stderr says why)", tp);
    }
    for (uint32_t tp = 2; tp <= 4; tp *= 2)
        for (uint32_t r = 0; r < tp; r++)
            for (uint32_t s = 0; s < GREEDY_STEPS; s++)
                cr_expect_eq(at[tp][r][s], at[1][0][s], "tp %u rank %u: token %u is %u, want %u",
                             tp, r, s, at[tp][r][s], at[1][0][s]);
    uint32_t distinct = 0;
    for (uint32_t s = 0; s < GREEDY_STEPS; s++) distinct += s == 0 || res[0][s] != res[0][s - 1];
    cr_log_info("greedy small-bf16: %u changes of token in %u steps", distinct, GREEDY_STEPS);
    munmap(res, 7 * sizeof *res);
}

/* ---- a rank that dies ------------------------------------------------------------------------ */

/* Rank 1 exits after the prefill; rank 0's next forward fails naming it, and so does every
 * later call that needs the group. */
static int rank_dies_mid_generation(uint32_t rank, uint32_t n, const char *name, void *arg) {
    (void)arg;
    pie_status st = {0};
    wrk_coll *coll = NULL;
    wrk_coll_opts co = {.name = name, .epoch = 1, .rank = rank, .n_ranks = n, .timeout_ms = 60000};
    PIE_RANK_CHECK(rank, wrk_coll_open(&co, &coll, &st) == PIE_OK, "wrk_coll_open: %s", st.msg);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny-f32", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = 4,
                  .embed_slots = 16,
                  .max_batch_tokens = 16,
                  .n_threads = 1,
                  .tp_rank = rank,
                  .tp_size = n,
                  .coll = coll};
    eng *e = NULL;
    PIE_RANK_CHECK(rank, eng_open(&o, &e, &st) == PIE_OK, "eng_open: %s", st.msg);
    tp_ctx c = {.e = e, .rank = rank};
    static const uint32_t pages[] = {0};
    uint32_t in[4] = {0, 1, 2, 3}, out = 8;
    RUN(embed(&c, 0, 0, 0, 4));
    eng_forward_item it = item(pages, 4, true, in, 4, &out, 1);
    RUN(forward(&c, &it, 1));
    if (rank == 1) _exit(0); /* as a crash: no close */
    uint32_t next = 9, pos = 4, token = 7;
    it = item(pages, 5, true, &next, 1, &out, 1);
    pie_code rc = eng_embed_text(e, &next, &token, &pos, 1, &st);
    PIE_RANK_CHECK(rank, rc == PIE_UNAVAILABLE, "embed_text with rank 1 gone returned %s: %s",
                   pie_code_name(rc), st.msg);
    PIE_RANK_CHECK(rank, strstr(st.msg, "rank 1 of 2 is gone"), "message: %s", st.msg);
    rc = eng_forward(e, &it, 1, &st);
    PIE_RANK_CHECK(rank, rc == PIE_UNAVAILABLE && strstr(st.msg, "the group failed earlier"),
                   "forward after the failure returned %s: %s", pie_code_name(rc), st.msg);
    eng_close(e);
    wrk_coll_close(coll);
    return 0;
}

Test(eng_tp, a_rank_that_dies_fails_the_others_calls_with_unavailable) {
    int status[PIE_TESTRANKS_MAX];
    int failed = pie_testranks_run(2, rank_dies_mid_generation, NULL, status);
    cr_assert_eq(failed, 0, "%d rank(s) failed (status %d, %d; their stderr says why)", failed,
                 status[0], status[1]);
}

/* ---- refusals ------------------------------------------------------------------------------ */

static void expect_open_fails(eng_opts *o, pie_code code, const char *msg) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny-f32", PIE_MODELS_DIR);
    o->model_dir = dir;
    o->kv_pages = 4;
    o->embed_slots = 8;
    o->max_batch_tokens = 16;
    o->n_threads = 1;
    pie_status st = {0};
    eng *e = NULL;
    cr_expect_eq(eng_open(o, &e, &st), code, "eng_open: %s", st.msg);
    cr_expect_str_eq(st.msg, msg);
    cr_expect_null(e);
}

Test(eng_tp, shapes_that_do_not_split_and_missing_collectives_are_refused) {
    eng_opts o = {.tp_size = 3, .tp_rank = 0};
    expect_open_fails(&o, PIE_INVALID_ARGUMENT, "eng_open: tp_size 3 must divide n_heads 4");
    o = (eng_opts){.tp_size = 8, .tp_rank = 0};
    expect_open_fails(&o, PIE_INVALID_ARGUMENT, "eng_open: tp_size 8 must divide n_heads 4");
    o = (eng_opts){.tp_size = 2, .tp_rank = 2};
    expect_open_fails(&o, PIE_INVALID_ARGUMENT, "eng_open: tp_rank 2 is out of range [0, 2)");
    o = (eng_opts){.tp_size = 2, .tp_rank = 1};
    expect_open_fails(&o, PIE_INVALID_ARGUMENT,
                      "eng_open: tp_size 2 needs a collective (coll is NULL)");
    wrk_coll_opts co = {.n_ranks = 1};
    wrk_coll *one = NULL;
    pie_status st = {0};
    cr_assert_eq(wrk_coll_open(&co, &one, &st), PIE_OK, "%s", st.msg);
    o = (eng_opts){.tp_size = 2, .tp_rank = 1, .coll = one};
    expect_open_fails(&o, PIE_INVALID_ARGUMENT,
                      "eng_open: tp_rank 1 of tp_size 2, but the collective is rank 0 of 1");
    wrk_coll_close(one);
}

/* The group over the collective's TCP transport (ranks on different nodes) computes exactly
 * what it computes over shared memory: both sum in rank order, so the bits are the same. */
Test(eng_tp, tp_2_over_tcp_gives_the_bits_of_tp_2_over_shared_memory) {
    tp_result *res = shared_results(2 + 2);
    pie_status st = {0};
    int fd = -1;
    uint16_t port = 0;
    cr_assert_eq(wrk_coll_tcp_listen("127.0.0.1:0", &fd, &port, &st), PIE_OK, "%s", st.msg);
    char leader[64];
    snprintf(leader, sizeof leader, "127.0.0.1:%u", port);
    tp_run runs[2] = {
        {.model = "small-f32", .res = res},
        {.model = "small-f32", .res = res + 2, .tcp_leader = leader, .listen_fd = fd}};
    for (int i = 0; i < 2; i++) {
        int status[PIE_TESTRANKS_MAX];
        int failed = pie_testranks_run(2, rank_scenario, &runs[i], status);
        cr_assert_eq(failed, 0, "tp 2 over %s: %d rank(s) failed (their stderr says why)",
                     i ? "TCP" : "shared memory", failed);
    }
    close(fd);
    for (uint32_t r = 0; r < 2; r++) {
        cr_assert_eq(res[2 + r].n_dists, res[r].n_dists);
        cr_expect(memcmp(res[2 + r].dists, res[r].dists, sizeof res[r].dists) == 0,
                  "rank %u: the distributions over TCP differ from those over shared memory", r);
        cr_expect(memcmp(res[2 + r].logits, res[r].logits, sizeof res[r].logits) == 0,
                  "rank %u: the logits over TCP differ from those over shared memory", r);
    }
    munmap(res, 4 * sizeof(tp_result));
}

/* ---- memory policies inside a group (issue 13) ------------------------------------------------
 */

/* Swap and offload at tp 2: rank 0's decisions are the group's. Under swap rank 0 alone lowers
 * the device to 2 of small-f32's 4 layers; under offload rank 0's pick sends every decode to the
 * host while rank 1's would send none. Every rank must run rank 0's plan (rank 1 ends with 2
 * layers on the device and the same decodes, pages and moves on its host), and the group's
 * distributions and logits must be tp 2's under policy gpu bit for bit. */
Test(eng_tp, a_group_under_swap_or_offload_runs_rank_0s_plan_and_gives_policy_gpus_bits) {
    tp_result *res = shared_results(3 * 2);
    const tp_policy pols[3] = {TP_GPU, TP_SWAP, TP_OFFLOAD};
    const char *names[3] = {"gpu", "swap", "offload"};
    for (int p = 0; p < 3; p++) {
        tp_run run = {.model = "small-f32", .res = res + 2 * p, .policy = pols[p]};
        int status[PIE_TESTRANKS_MAX];
        int failed = pie_testranks_run(2, rank_scenario, &run, status);
        cr_assert_eq(failed, 0, "tp 2 under %s: %d rank(s) failed (their stderr says why)",
                     names[p], failed);
    }
    const tp_result *gpu = res, *swap = res + 2, *off = res + 4;
    for (int p = 1; p < 3; p++)
        for (uint32_t r = 0; r < 2; r++) {
            const tp_result *g = &res[2 * p + r];
            cr_assert_eq(g->n_dists, gpu[r].n_dists);
            cr_expect(memcmp(g->dists, gpu[r].dists, sizeof g->dists) == 0,
                      "tp 2 under %s, rank %u: distributions differ from policy gpu's", names[p],
                      r);
            cr_expect(memcmp(g->logits, gpu[r].logits, sizeof g->logits) == 0,
                      "tp 2 under %s, rank %u: logits differ from policy gpu's", names[p], r);
        }
    /* swap: rank 1 runs at rank 0's 2 layers, and both really swapped */
    for (uint32_t r = 0; r < 2; r++) {
        cr_expect_eq(swap[r].swap.slots, 2u, "swap, rank %u: %u layers on the device, want 2", r,
                     swap[r].swap.slots);
        cr_expect_gt(swap[r].swap.swaps_in, 0u, "swap, rank %u: no layer came back", r);
    }
    /* offload: rank 1 attended rank 0's decodes on its host pool and moved the same pages */
    cr_expect_gt(off[0].off.host_items, 0u, "offload: rank 0 attended no decode on the host");
    cr_expect_eq(off[1].off.host_items, off[0].off.host_items,
                 "offload: rank 1 attended %llu decodes on the host, rank 0 %llu",
                 (unsigned long long)off[1].off.host_items,
                 (unsigned long long)off[0].off.host_items);
    cr_expect_eq(off[1].off.offload_steps, off[0].off.offload_steps);
    cr_expect_eq(off[1].off.pages_to_host, off[0].off.pages_to_host);
    cr_expect_eq(off[1].off.pages_to_device, off[0].off.pages_to_device);
    cr_expect_eq(off[1].off.pages_on_host, off[0].off.pages_on_host);
    munmap(res, 6 * sizeof(tp_result));
}
