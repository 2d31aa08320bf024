/* test_eng_cuda_nccl.c — the cuda engine's tensor-parallel path (engine/eng_cuda_tp.c) on one
 * GPU: what one device can show of issue 14's cuda groups (NCCL refuses two ranks on one
 * device, so tp > 1 needs two GPUs).
 *
 * Owns three checks. (1) The next_dist split across ranks, without NCCL: a row's logits cut into
 * 1..4 slices, each slice through krn_cuda_row_max and krn_cuda_topk_shifted as a rank would
 * run them, merged on the host with eng_tp_merge_lists (the cpu engine's merge) — must give
 * krn_cuda_topk over the whole row: the same ids (ties excepted) and probabilities within
 * 1e-5 relative (the sums are added in another order), with +inf, T 0 and NaN rows. (2) The
 * NCCL path at tp 1: the engine opened with a one-rank communicator (eng_opts.nccl) runs every
 * tensor-parallel step — embedding through zeros and an all-reduce, an all-reduce after o_proj
 * and after down_proj, next_dist through the shifted top-k and the host merge, logits through
 * an all-gather — and must give the plain engine's results: logits bit for bit (a one-rank
 * all-reduce and all-gather copy), distributions with the same ids (ties excepted) and
 * probabilities within 2 ulp (both divide the same exponentials by the same sum; the host
 * multiplies by 1 / sum as the kernel does, so they are expected equal: 2 ulp leaves room for a
 * compiler contracting differently, and the largest difference is printed). (3) Decode steps
 * replayed from CUDA graphs whose captures hold the all-reduces: no capture failure, graph
 * steps counted, results those of the plain engine replaying its own graphs. (4) wrk_nccl
 * alone at one rank: each collective gives its input back, in a graph too; refusals (one of
 * them needs no device and runs in CI); (5) wrk_nccl_sync's bound: a stream held past the
 * timeout (a host function standing for a peer that never arrives) fails the communicator
 * for good instead of waiting.
 * Skips visibly without a device; (2) to (4) skip visibly in a build without NCCL. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_test.h"
#include "eng.h"
#include "eng_cuda.h"
#include "eng_tp_dist.h"
#include "krn_cuda.h"
#include "pie_testeng.h"
#ifdef PIE_WITH_NCCL
#include "wrk_nccl.h"
#endif

#define PAGE  16
#define V_MAX 4096

/* ---- (1) the split of next_dist, kernels only ------------------------------------------------ */

/* The top k of row[V] at temperature t merged from n slices as the ranks compute them. */
static void split_topk(const float *row, uint32_t V, uint32_t n, float t, uint32_t k, uint32_t *ids,
                       float *probs) {
    static uint32_t g_ids[4][KRN_CUDA_TOPK_MAX];
    static float g_vals[4][KRN_CUDA_TOPK_MAX];
    uint32_t stride = (V + n - 1) / n;
    float maxima[4], sums[4];
    float *d_x[4];
    for (uint32_t r = 0; r < n; r++) { /* step 1: each slice's maximum */
        uint32_t v0 = r * stride, nv = V - v0 < stride ? V - v0 : stride;
        d_x[r] = cuda_test_up(row + v0, nv * sizeof(float));
        float *d_m = cuda_test_up(NULL, sizeof(float));
        CUDA_OK(krn_cuda_row_max(d_x[r], 1, (int)nv, d_m, 0));
        cuda_test_down(&maxima[r], d_m, sizeof(float));
        CUDA_OK(cudaFree(d_m));
    }
    float max;
    uint32_t holder = eng_tp_max_holder(maxima, 1, n, &max);
    const uint32_t *lid[4];
    const float *lval[4];
    int counts[4];
    double sum = 0.0;
    for (uint32_t r = 0; r < n; r++) { /* step 2: each slice's shifted top k */
        uint32_t v0 = r * stride, nv = V - v0 < stride ? V - v0 : stride;
        int32_t kr = (int32_t)(k < nv ? k : nv);
        float shift[2] = {max, holder == r ? 1.0f : 0.0f};
        float *d_shift = cuda_test_up(shift, sizeof shift), *d_t = cuda_test_up(&t, sizeof t);
        int32_t *d_k = cuda_test_up(&kr, sizeof kr);
        uint32_t *d_ids = cuda_test_up(NULL, KRN_CUDA_TOPK_MAX * sizeof(uint32_t));
        float *d_vals = cuda_test_up(NULL, KRN_CUDA_TOPK_MAX * sizeof(float));
        float *d_sum = cuda_test_up(NULL, sizeof(float));
        CUDA_OK(
            krn_cuda_topk_shifted(d_x[r], 1, (int)nv, d_t, d_k, d_shift, d_ids, d_vals, d_sum, 0));
        cuda_test_down(g_ids[r], d_ids, (size_t)kr * sizeof(uint32_t));
        cuda_test_down(g_vals[r], d_vals, (size_t)kr * sizeof(float));
        cuda_test_down(&sums[r], d_sum, sizeof(float));
        for (int32_t i = 0; i < kr; i++) g_ids[r][i] += v0;
        lid[r] = g_ids[r], lval[r] = g_vals[r], counts[r] = kr;
        sum += sums[r];
        void *bufs[] = {d_x[r], d_shift, d_t, d_k, d_ids, d_vals, d_sum};
        for (size_t b = 0; b < sizeof bufs / sizeof bufs[0]; b++) CUDA_OK(cudaFree(bufs[b]));
    }
    eng_tp_merge_lists(lid, lval, counts, n, sum, k, ids, probs); /* step 3 */
}

/* krn_cuda_topk over the whole row. */
static void whole_topk(const float *row, uint32_t V, float t, uint32_t k, uint32_t *ids,
                       float *probs) {
    int32_t kk = (int32_t)k;
    float *d_x = cuda_test_up(row, V * sizeof(float)), *d_t = cuda_test_up(&t, sizeof t);
    int32_t *d_k = cuda_test_up(&kk, sizeof kk);
    uint32_t *d_ids = cuda_test_up(NULL, KRN_CUDA_TOPK_MAX * sizeof(uint32_t));
    float *d_p = cuda_test_up(NULL, KRN_CUDA_TOPK_MAX * sizeof(float));
    CUDA_OK(krn_cuda_topk(d_x, 1, (int)V, d_t, d_k, d_ids, d_p, 0));
    cuda_test_down(ids, d_ids, k * sizeof(uint32_t));
    cuda_test_down(probs, d_p, k * sizeof(float));
    void *bufs[] = {d_x, d_t, d_k, d_ids, d_p};
    for (size_t b = 0; b < sizeof bufs / sizeof bufs[0]; b++) CUDA_OK(cudaFree(bufs[b]));
}

/* Same probabilities (within rel; NaN where NaN) position by position, and the same ids where
 * the probabilities differ from their neighbours (equal ones may come in another order only if
 * rounding made them equal on one side: then the probabilities still agree). */
static void expect_same_dist(const uint32_t *ia, const float *pa, const uint32_t *ib,
                             const float *pb, uint32_t k, double rel, const char *what,
                             double *worst) {
    for (uint32_t i = 0; i < k; i++) {
        if (isnan(pb[i])) {
            cr_assert(isnan(pa[i]) && ia[i] == ib[i],
                      "%s: entry %u: id %u (%g), expected NaN "
                      "for id %u",
                      what, i, ia[i], pa[i], ib[i]);
            continue;
        }
        double d = fabs((double)pa[i] - pb[i]), lim = rel * fabs((double)pb[i]);
        if (worst && pb[i] != 0.0f && d / fabs((double)pb[i]) > *worst)
            *worst = d / fabs((double)pb[i]);
        cr_assert(d <= lim, "%s: entry %u: probability %.9g (id %u), expected %.9g (id %u)", what,
                  i, pa[i], ia[i], pb[i], ib[i]);
        bool tie = (i > 0 && pb[i - 1] == pb[i]) || (i + 1 < k && pb[i + 1] == pb[i]);
        cr_assert(ia[i] == ib[i] || tie, "%s: entry %u is id %u, expected id %u (p %.9g)", what, i,
                  ia[i], ib[i], pb[i]);
    }
}

static uint64_t rng_s = 0x2545f4914f6cdd1dull;
static float uniform(void) {
    rng_s ^= rng_s << 13, rng_s ^= rng_s >> 7, rng_s ^= rng_s << 17;
    return (float)(rng_s >> 40) / (float)(1u << 24);
}

Test(eng_cuda_nccl, next_dist_split_over_1_to_4_slices_gives_krn_cuda_topk) {
    CUDA_TEST_REQUIRE_DEVICE();
    static float row[V_MAX];
    static uint32_t ia[KRN_CUDA_TOPK_MAX], ib[KRN_CUDA_TOPK_MAX];
    static float pa[KRN_CUDA_TOPK_MAX], pb[KRN_CUDA_TOPK_MAX];
    const uint32_t V = 3001;
    const float temps[] = {1.0f, 0.05f, 0.0f};
    for (int c = 0; c < 4; c++) { /* random, +inf in the middle, NaN slice, all NaN */
        for (uint32_t i = 0; i < V; i++) row[i] = 12.0f * uniform() + (float)(i / 800);
        if (c == 1) row[1700] = INFINITY, row[2900] = INFINITY;
        if (c == 2)
            for (uint32_t i = 0; i < 1000; i++) row[i] = NAN;
        if (c == 3)
            for (uint32_t i = 0; i < V; i++) row[i] = NAN;
        for (uint32_t n = 1; n <= 4; n++)
            for (size_t t = 0; t < 3; t++) {
                uint32_t k = c == 3 ? 5 : 200;
                char what[96];
                snprintf(what, sizeof what, "case %d, %u slices, T %g", c, n, temps[t]);
                split_topk(row, V, n, temps[t], k, ia, pa);
                whole_topk(row, V, temps[t], k, ib, pb);
                expect_same_dist(ia, pa, ib, pb, k, 1e-5, what, NULL);
            }
    }
}

/* ---- (2), (3) the NCCL path at tp 1 ---------------------------------------------------------- */

#ifdef PIE_WITH_NCCL

typedef struct two {
    eng_cuda *plain, *tp; /* tp: the sharded path over a one-rank communicator */
    wrk_nccl *comm;
    uint32_t vocab;
} two;

static two open_two(const char *model) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", PIE_MODELS_DIR, model);
    eng_opts o = {.model_dir = dir,
                  .backend = ENG_BACKEND_CUDA,
                  .kv_page_size = PAGE,
                  .kv_pages = 64,
                  .embed_slots = 256,
                  .max_batch_tokens = 256};
    pie_status st = {0};
    two w = {0};
    cr_assert_eq(eng_cuda_open(&o, &w.plain, &st), PIE_OK, "plain: %s", st.msg);
    uint8_t id[WRK_NCCL_ID_BYTES];
    cr_assert_eq(wrk_nccl_unique_id(id, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_nccl_open(id, 0, 1, 0, &w.comm, &st), PIE_OK, "%s", st.msg);
    o.tp_rank = 0, o.tp_size = 1, o.nccl = w.comm;
    cr_assert_eq(eng_cuda_open(&o, &w.tp, &st), PIE_OK, "nccl path: %s", st.msg);
    w.vocab = eng_cuda_get_info(w.plain)->vocab_size;
    cr_assert_eq(eng_cuda_get_info(w.tp)->vocab_size, w.vocab);
    return w;
}

static void close_two(two *w) {
    eng_cuda_close(w->tp);
    eng_cuda_close(w->plain);
    wrk_nccl_close(w->comm);
}

/* The same call on both engines, which must succeed. */
#define BOTH(w, call_plain, call_tp)                             \
    do {                                                         \
        pie_status st_ = {0};                                    \
        cr_assert_eq(call_plain, PIE_OK, "plain: %s", st_.msg);  \
        cr_assert_eq(call_tp, PIE_OK, "nccl path: %s", st_.msg); \
    } while (0)

static void embed(two *w, uint32_t slot0, uint32_t from, uint32_t n) {
    uint32_t slots[256], toks[256], pos[256];
    cr_assert(n <= 256);
    for (uint32_t i = 0; i < n; i++)
        slots[i] = slot0 + i, toks[i] = (from + i) * 7919u % w->vocab, pos[i] = from + i;
    BOTH(w, eng_cuda_embed_text(w->plain, slots, toks, pos, n, &st_),
         eng_cuda_embed_text(w->tp, slots, toks, pos, n, &st_));
}

static void forward(two *w, const eng_forward_item *items, uint32_t n) {
    BOTH(w, eng_cuda_forward(w->plain, items, n, &st_), eng_cuda_forward(w->tp, items, n, &st_));
}

/* Logits bit for bit; distributions at two temperatures within 2 ulp. */
static void expect_same_outputs(two *w, uint32_t slot, const char *what, double *worst) {
    float *a = malloc(w->vocab * sizeof *a), *b = malloc(w->vocab * sizeof *b);
    cr_assert(a && b);
    BOTH(w, eng_cuda_logits(w->plain, slot, a, &st_), eng_cuda_logits(w->tp, slot, b, &st_));
    cr_assert_eq(memcmp(a, b, w->vocab * sizeof *a), 0, "%s: logits differ", what);
    free(a);
    free(b);
    static uint32_t ia[64], ib[64];
    static float pa[64], pb[64];
    const float temps[] = {1.0f, 0.6f};
    for (int t = 0; t < 2; t++) {
        uint32_t k = w->vocab < 64 ? w->vocab : 64;
        eng_dist_item da = {
            .slot = slot, .top_k = k, .temperature = temps[t], .ids = ia, .probs = pa};
        eng_dist_item db = da;
        db.ids = ib, db.probs = pb;
        BOTH(w, eng_cuda_next_dist(w->plain, &da, 1, &st_),
             eng_cuda_next_dist(w->tp, &db, 1, &st_));
        expect_same_dist(ib, pb, ia, pa, k, 2.4e-7, what, worst);
    }
}

static void prefill_and_decode(const char *model) {
    CUDA_TEST_REQUIRE_DEVICE();
    two w = open_two(model);
    uint32_t pages[8] = {3, 9, 4, 1, 7, 2, 5, 6}, in[40], out = 200;
    double worst = 0.0;
    embed(&w, 0, 0, 40); /* a 40-token prompt: slots 0..39 */
    eng_forward_item pf =
        pie_test_item(PAGE, pages, 40, true, pie_test_range(in, 0, 40), 40, &out, 1);
    forward(&w, &pf, 1);
    expect_same_outputs(&w, out, "prefill", &worst);
    /* decode steps, one token each: graph-shaped (bucket 1), the all-reduces inside */
    for (uint32_t t = 0; t < 12; t++) {
        uint32_t slot = 100 + t, o = 201 + t;
        embed(&w, slot, 40 + t, 1);
        eng_forward_item it = pie_test_item(PAGE, pages, 41 + t, true, &slot, 1, &o, 1);
        forward(&w, &it, 1);
        char what[32];
        snprintf(what, sizeof what, "decode step %u", t);
        expect_same_outputs(&w, o, what, &worst);
    }
    eng_cuda_stats sp, st;
    eng_cuda_get_stats(w.plain, &sp);
    eng_cuda_get_stats(w.tp, &st);
    cr_assert_eq(st.capture_failures, 0, "a capture with NCCL failed: %s", st.capture_error);
    cr_assert_eq(st.graph_steps, sp.graph_steps, "graph steps: %llu, plain %llu",
                 (unsigned long long)st.graph_steps, (unsigned long long)sp.graph_steps);
    if (sp.graph_steps > 0) /* graphs on (PIE_CUDA_GRAPHS=0 turns them off for both) */
        cr_assert_eq(st.graph_steps, 12, "decode steps replayed: %llu of 12",
                     (unsigned long long)st.graph_steps);
    fprintf(stderr,
            "%s: nccl path at tp 1 = plain engine; graph steps %llu; largest relative "
            "probability difference %.3g\n",
            model, (unsigned long long)st.graph_steps, worst);
    close_two(&w);
}

Test(eng_cuda_nccl, tp1_over_nccl_gives_the_plain_engines_results_on_small_bf16) {
    prefill_and_decode("small-bf16");
}

Test(eng_cuda_nccl, tp1_over_nccl_gives_the_plain_engines_results_on_tiny_f32) {
    prefill_and_decode("tiny-f32");
}

Test(eng_cuda_nccl, a_wrong_rank_or_a_missing_communicator_is_refused) {
    CUDA_TEST_REQUIRE_DEVICE();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny-f32", PIE_MODELS_DIR);
    eng_opts o = {.model_dir = dir, .backend = ENG_BACKEND_CUDA, .tp_rank = 0, .tp_size = 2};
    eng_cuda *e = NULL;
    pie_status st = {0};
    cr_assert_eq(eng_cuda_open(&o, &e, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strstr(st.msg, "needs the group's NCCL communicator"), "%s", st.msg);
    uint8_t id[WRK_NCCL_ID_BYTES];
    wrk_nccl *comm = NULL;
    cr_assert_eq(wrk_nccl_unique_id(id, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_nccl_open(id, 0, 1, 0, &comm, &st), PIE_OK, "%s", st.msg);
    o.nccl = comm; /* a communicator of 1 for a rank of 2 */
    cr_assert_neq(eng_cuda_open(&o, &e, &st), PIE_OK);
    cr_assert(strstr(st.msg, "NCCL communicator is rank 0 of 1"), "%s", st.msg);
    cr_assert_null(e);
    wrk_nccl_close(comm);
}

/* The wrapper itself at one rank: every collective copies its input (in place, f32 and bf16;
 * all-gather; broadcast), an all-reduce replayed from a CUDA graph too, the async check, the
 * refusal of a root out of range. */
Test(eng_cuda_nccl, wrk_nccls_collectives_at_one_rank_give_their_input) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { N = 1000 };
    static float in[N], out[N];
    for (int i = 0; i < N; i++) in[i] = (float)i * 0.25f - 3.0f;
    uint8_t id[WRK_NCCL_ID_BYTES];
    wrk_nccl *c = NULL;
    pie_status st = {0};
    cr_assert_eq(wrk_nccl_unique_id(id, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_nccl_open(id, 0, 1, 0, &c, &st), PIE_OK, "%s", st.msg);
    char version[32];
    wrk_nccl_version(version, sizeof version);
    fprintf(stderr, "NCCL %s\n", version);
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *d = cuda_test_up(in, sizeof in), *g = cuda_test_up(NULL, sizeof in);
    cr_assert_eq(wrk_nccl_allreduce_sum(c, d, N, WRK_NCCL_F32, s, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_nccl_allreduce_sum(c, d, N / 2, WRK_NCCL_BF16, s, &st), PIE_OK, "%s",
                 st.msg); /* the same bytes as N / 2 bf16 pairs: one rank leaves them alone */
    cr_assert_eq(wrk_nccl_allgather(c, d, g, sizeof in, s, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_nccl_bcast(c, g, sizeof in, 0, s, &st), PIE_OK, "%s", st.msg);
    CUDA_OK(cudaStreamSynchronize(s));
    cr_assert_eq(wrk_nccl_check(c, &st), PIE_OK, "%s", st.msg);
    cuda_test_down(out, g, sizeof out);
    cr_assert_eq(memcmp(in, out, sizeof in), 0, "one rank's collectives changed the data");
    /* an all-reduce captured in a graph and replayed twice */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    pie_code rc = wrk_nccl_allreduce_sum(c, d, N, WRK_NCCL_F32, s, &st);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    cr_assert_eq(rc, PIE_OK, "captured: %s", st.msg);
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    cuda_test_down(out, d, sizeof out);
    cr_assert_eq(memcmp(in, out, sizeof in), 0, "the replayed all-reduce changed the data");
    cr_assert_eq(wrk_nccl_bcast(c, g, 4, 1, s, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strstr(st.msg, "broadcast root 1 is out of range [0, 1)"), "%s", st.msg);
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaFree(d));
    CUDA_OK(cudaFree(g));
    CUDA_OK(cudaStreamDestroy(s));
    wrk_nccl_close(c);
}

/* Stands for a peer that never arrives: holds the stream for a second, then says so. */
static void CUDART_CB hold_stream_1s(void *released) {
    struct timespec t = {.tv_sec = 1, .tv_nsec = 0};
    while (nanosleep(&t, &t) != 0) {
    }
    atomic_store((_Atomic int *)released, 1);
}

Test(eng_cuda_nccl, wrk_nccl_sync_fails_the_communicator_when_the_stream_outlasts_the_timeout) {
    CUDA_TEST_REQUIRE_DEVICE();
    enum { N = 256 };
    static float in[N];
    for (int i = 0; i < N; i++) in[i] = (float)i;
    uint8_t id[WRK_NCCL_ID_BYTES];
    wrk_nccl *c = NULL;
    pie_status st = {0};
    cr_assert_eq(wrk_nccl_unique_id(id, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_nccl_open(id, 0, 1, 0, &c, &st), PIE_OK, "%s", st.msg);
    wrk_nccl_set_timeout(c, 100);
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *d = cuda_test_up(in, sizeof in);
    int err = -1;
    /* a step that finishes: OK, no CUDA error */
    cr_assert_eq(wrk_nccl_allreduce_sum(c, d, N, WRK_NCCL_F32, s, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(wrk_nccl_sync(c, s, &err, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(err, 0);
    /* a step that does not finish within 100 ms */
    static _Atomic int released;
    atomic_store(&released, 0);
    cr_assert_eq(wrk_nccl_allreduce_sum(c, d, N, WRK_NCCL_F32, s, &st), PIE_OK, "%s", st.msg);
    CUDA_OK(cudaLaunchHostFunc(s, hold_stream_1s, (void *)&released));
    cr_assert_eq(wrk_nccl_sync(c, s, &err, &st), PIE_UNAVAILABLE, "%s", st.msg);
    cr_assert_eq(atomic_load(&released), 0, "the sync waited for the whole hold");
    cr_assert(strstr(st.msg, "did not finish within tp.timeout (100 ms)"), "%s", st.msg);
    /* for good: every later call names the first reason */
    cr_assert_eq(wrk_nccl_allreduce_sum(c, d, N, WRK_NCCL_F32, s, &st), PIE_UNAVAILABLE);
    cr_assert(strstr(st.msg, "tp.timeout (100 ms)"), "%s", st.msg);
    cr_assert_eq(wrk_nccl_check(c, &st), PIE_UNAVAILABLE);
    cr_assert_eq(wrk_nccl_sync(c, s, &err, &st), PIE_UNAVAILABLE);
    CUDA_OK(cudaStreamSynchronize(s));
    cr_assert_eq(atomic_load(&released), 1);
    CUDA_OK(cudaFree(d));
    CUDA_OK(cudaStreamDestroy(s));
    wrk_nccl_close(c);
}

/* No device needed: a rank out of range is refused before NCCL or CUDA is touched (runs in CI). */
Test(eng_cuda_nccl, wrk_nccl_refuses_a_rank_out_of_range) {
    uint8_t id[WRK_NCCL_ID_BYTES] = {0};
    wrk_nccl *c = (wrk_nccl *)&id; /* must be reset to NULL */
    pie_status st = {0};
    cr_assert_eq(wrk_nccl_open(id, 2, 2, 0, &c, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strstr(st.msg, "nccl: rank 2 is out of range [0, 2)"), "%s", st.msg);
    cr_assert_null(c);
    cr_assert_eq(wrk_nccl_open(id, 0, 0, 0, &c, &st), PIE_INVALID_ARGUMENT);
}

#else

Test(eng_cuda_nccl, tp1_over_nccl_gives_the_plain_engines_results) {
    CUDA_TEST_REQUIRE_DEVICE();
    fprintf(stderr, "skipped: built without NCCL\n");
    cr_skip_test("skipped: built without NCCL (nccl.h / libnccl not found at build time)");
}

#endif
