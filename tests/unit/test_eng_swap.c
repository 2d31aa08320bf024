/* test_eng_swap.c — the swap policy on the cpu engine (issue 13; services/worker/mem/wrk_tier.h,
 * services/worker/engine/eng_cpu_swap.c): a "device" region holding the KV of `slots` of the
 * model's layers, a "host" region for the rest, and a copy engine moving whole layers between
 * them while the forward runs.
 *
 * The promise tested: the swap policy changes where bytes are, never what is computed. One
 * mixed workload (prefill, decode, a batch mixing appends and a non-appending item with an
 * explicit tree mask, page masks, page copies, clear_pages of a reused page) runs on an engine
 * without swapping (policy gpu) and on engines with 2 and 3 of small-f32's 4 layers on the
 * device, with and without an emulated link slow enough that compute waits, and while the slot
 * count changes between steps; every output's logits and distribution must be BIT-identical.
 *
 * Why these tests can fail. Every one of the 4 layers holds different K/V (different weights),
 * and under the FIFO every layer leaves the device and comes back every step when slots < 4.
 * A copy engine that skipped a swap (or moved the wrong layer) would hand a layer another
 * layer's or stale K/V: `a_skipped_swap_is_caught` runs the workload with a copy that does
 * nothing and asserts the outputs then DIFFER from policy gpu — so the equality assertions
 * above compare something a broken swap changes. Each test also asserts that swaps happened
 * (swap bytes > 0, layers seen on the host), so an engine that silently never swapped would
 * not pass for one that swaps correctly. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eng.h"
#include "pie_testeng.h"
#include "wrk_tier.h"

#define PAGE  PIE_TESTWORK_PAGE
#define PAGES PIE_TESTWORK_PAGES /* of small-f32 (4 layers): pie_testwork_opts */

/* ---- engines ------------------------------------------------------------------------------ */

typedef struct swap_setup {
    uint32_t slots;  /* 0: policy gpu */
    double link_bps; /* emulated link; 0: memcpy */
    uint64_t host_bytes;
    pie_code (*copy)(void *, void *, const void *, size_t, pie_status *);
    void *copy_user;
    eng_kv_dtype kv_dtype;
} swap_setup;

static size_t layer_bytes(void) {
    /* small-f32: 2 KV heads of 32 → [PAGES][2][PAGE][64] f32 */
    return (size_t)PAGES * 2 * PAGE * 2 * 32 * sizeof(float);
}

static pie_code open_swap(const swap_setup *s, eng **out, pie_status *st) {
    char dir[512];
    eng_opts o = pie_testwork_opts(dir, sizeof dir);
    o.swap_slots = s->slots;
    o.swap_host_bytes = s->host_bytes ? s->host_bytes : 8 * layer_bytes();
    o.swap_link_bytes_per_s = s->link_bps;
    o.swap_copy = s->copy;
    o.kv_dtype = s->kv_dtype;
    o.swap_copy_user = s->copy_user;
    return eng_open(&o, out, st);
}

static eng *open_ok(const swap_setup *s) {
    pie_status st = {0};
    eng *e = NULL;
    cr_assert_eq(open_swap(s, &e, &st), PIE_OK, "eng_open (slots %u): %s", s->slots, st.msg);
    return e;
}

/* ---- the workload ------------------------------------------------------------------------- */

/* What one run produced: the workload's outputs, and the most layers seen only on the host
 * between steps. */
typedef struct run_out {
    pie_testwork_out o;
    uint32_t max_on_host;
} run_out;

/* Called between steps with the step's number (changes the slot count in one test). */
typedef void (*step_hook)(eng *e, uint32_t step);

typedef struct stepper {
    run_out *r;
    step_hook hook;
} stepper;

static void note_host(eng *e, uint32_t step, void *user) {
    stepper *sp = user;
    eng_swap_stats s;
    eng_swap_get_stats(e, &s);
    if (s.on_host > sp->r->max_on_host) sp->r->max_on_host = s.on_host;
    if (sp->hook) sp->hook(e, step);
}

/* The workload without the fork (13 outputs; tests/support/pie_testeng.h). */
static void workload(eng *e, run_out *r, step_hook hook) {
    stepper sp = {.r = r, .hook = hook};
    pie_testwork_run(e, &r->o, false, note_host, &sp);
}

static run_out run(const swap_setup *s, step_hook hook) {
    eng *e = open_ok(s);
    run_out r = {0};
    pie_testwork_out_init(&r.o, e);
    workload(e, &r, hook);
    eng_close(e);
    return r;
}

/* Number of outputs whose logits or distribution differ from the reference's. */
static uint32_t n_differing(const run_out *a, const run_out *ref) {
    return pie_testwork_n_differing(&a->o, &ref->o);
}

static void assert_identical(const run_out *a, const run_out *ref, const char *what) {
    uint32_t bad = n_differing(a, ref);
    cr_assert_eq(bad, 0, "%s: %u of %u outputs differ from policy gpu", what, bad, ref->o.n);
}

/* ---- tests -------------------------------------------------------------------------------- */

Test(eng_swap, outputs_equal_policy_gpu_bit_for_bit_at_every_slot_count) {
    swap_setup gpu = {0};
    run_out ref = run(&gpu, NULL);
    cr_assert_eq(ref.o.n, 13);
    for (uint32_t slots = 2; slots <= 4; slots++) {
        swap_setup sw = {.slots = slots};
        run_out r = run(&sw, NULL);
        char what[64];
        snprintf(what, sizeof what, "%u of 4 layers on the device", slots);
        assert_identical(&r, &ref, what);
        /* 4 slots: nothing moves; fewer: the FIFO keeps at least 4 - slots layers on the host,
         * and up to two more for a moment (one moving in, counted on the host until it lands,
         * while an eviction that started later has already landed) */
        uint32_t lo = 4 - slots, hi = slots < 4 ? lo + 2 : 0;
        cr_assert(r.max_on_host >= lo && r.max_on_host <= hi,
                  "%s: at most %u layers seen on the host, expected %u..%u", what, r.max_on_host,
                  lo, hi);
        free(r.o.logits);
    }
    free(ref.o.logits);
}

/* 1 GB/s: one layer (PAGES pages: 192 KiB) takes ~0.2 ms each way, about a layer's compute on
 * this model, so compute waits for some layers and the pipeline overlaps the rest. */
Test(eng_swap, outputs_equal_policy_gpu_with_a_slow_emulated_link) {
    swap_setup gpu = {0};
    run_out ref = run(&gpu, NULL);
    swap_setup sw = {.slots = 2, .link_bps = 1e9};
    eng *e = open_ok(&sw);
    run_out r = {0};
    pie_testwork_out_init(&r.o, e);
    workload(e, &r, NULL);
    eng_swap_stats s;
    eng_swap_get_stats(e, &s);
    cr_assert_gt(s.swaps_in, 10, "swaps in: %llu", (unsigned long long)s.swaps_in);
    /* moves carry the pages written so far (pages 0-9 of 24), never more than the layer */
    cr_assert_leq(s.swap_in_bytes, s.swaps_in * layer_bytes());
    cr_assert_geq(s.swap_in_bytes, s.swaps_in * (layer_bytes() / PAGES));
    cr_assert_eq(s.copy_failures, 0);
    eng_close(e);
    assert_identical(&r, &ref, "slots 2, 1 GB/s link");
    free(r.o.logits);
    free(ref.o.logits);
}

/* Between steps the slot count goes 4 → 2 → 3 → 2 → 4 → 3 ...: pages written under one count
 * are read under another. */
static void cycle_slots(eng *e, uint32_t step) {
    static const uint32_t seq[] = {4, 2, 3, 2, 4, 3, 2, 2, 3, 4, 2, 3};
    uint32_t got = 0;
    pie_status st = {0};
    cr_assert_eq(eng_swap_set_slots(e, seq[step % 12], &got, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(got, seq[step % 12]);
}

Test(eng_swap, outputs_equal_policy_gpu_while_the_slot_count_changes_between_steps) {
    swap_setup gpu = {0};
    run_out ref = run(&gpu, NULL);
    swap_setup sw = {.slots = 4};
    run_out r = run(&sw, cycle_slots);
    assert_identical(&r, &ref, "slot count cycling 4/2/3");
    cr_assert_geq(r.max_on_host, 1);
    free(r.o.logits);
    free(ref.o.logits);
}

Test(eng_swap, a_bf16_kv_pool_swaps_half_the_bytes_with_the_same_outputs) {
    swap_setup gpu = {.kv_dtype = ENG_KV_BF16};
    run_out ref = run(&gpu, NULL);
    swap_setup sw = {.slots = 2, .kv_dtype = ENG_KV_BF16};
    eng *e = NULL;
    pie_status st = {0};
    cr_assert_eq(open_swap(&sw, &e, &st), PIE_OK, "%s", st.msg);
    run_out r = {0};
    pie_testwork_out_init(&r.o, e);
    pie_testwork_run(e, &r.o, false, NULL, NULL);
    eng_swap_stats s;
    eng_swap_get_stats(e, &s);
    cr_assert_gt(s.swaps_in, 0);
    cr_assert_leq(s.swap_in_bytes, s.swaps_in * (layer_bytes() / 2),
                  "a bf16 layer is half an f32 one: %llu bytes in %llu swaps",
                  (unsigned long long)s.swap_in_bytes, (unsigned long long)s.swaps_in);
    eng_close(e);
    assert_identical(&r, &ref, "bf16 KV, 2 of 4 layers on the device");
    free(r.o.logits);
    free(ref.o.logits);
}

Test(eng_swap, set_slots_clamps_to_the_budget_and_needs_the_policy) {
    swap_setup sw = {.slots = 3};
    eng *e = open_ok(&sw);
    pie_status st = {0};
    uint32_t got = 0;
    cr_assert_eq(eng_swap_set_slots(e, 1, &got, &st), PIE_OK);
    cr_assert_eq(got, 2, "below min_slots: clamped to 2, got %u", got);
    cr_assert_eq(eng_swap_set_slots(e, 9, &got, &st), PIE_OK);
    cr_assert_eq(got, 4);
    cr_assert_eq(eng_get_info(e)->swap_min_slots, 2);
    eng_close(e);
    swap_setup gpu = {0};
    e = open_ok(&gpu);
    cr_assert_eq(eng_swap_set_slots(e, 2, &got, &st), PIE_FAILED_PRECONDITION);
    cr_assert_str_eq(st.msg, "swap_set_slots: the engine was opened without the swap policy");
    eng_swap_stats s;
    eng_swap_get_stats(e, &s);
    cr_assert_eq(s.slots + s.on_host + s.swaps_in, 0);
    eng_close(e);
}

/* A copy that moves nothing: every swap is "skipped". */
static pie_code copy_nothing(void *user, void *dst, const void *src, size_t bytes, pie_status *st) {
    (void)user, (void)dst, (void)src, (void)bytes, (void)st;
    return PIE_OK;
}

/* A copy that moves everything except one layer-sized move in every 7 (its data stays stale). */
static pie_code copy_skip_some(void *user, void *dst, const void *src, size_t bytes,
                               pie_status *st) {
    (void)st;
    atomic_uint *calls = user;
    if (atomic_fetch_add(calls, 1) % 7 != 3) memcpy(dst, src, bytes);
    return PIE_OK;
}

Test(eng_swap, a_skipped_swap_is_caught) {
    swap_setup gpu = {0};
    run_out ref = run(&gpu, NULL);
    swap_setup none = {.slots = 2, .copy = copy_nothing};
    run_out r = run(&none, NULL);
    cr_assert_gt(n_differing(&r, &ref), ref.o.n / 2,
                 "a copy engine that moves nothing must change most outputs (%u of %u differ)",
                 n_differing(&r, &ref), ref.o.n);
    free(r.o.logits);
    atomic_uint calls = 0;
    swap_setup some = {.slots = 3, .copy = copy_skip_some, .copy_user = &calls};
    r = run(&some, NULL);
    cr_assert_gt(n_differing(&r, &ref), 0,
                 "skipping one move in 7 (%u moves) must change some output", (unsigned)calls);
    free(r.o.logits);
    free(ref.o.logits);
}

/* Fails the copies numbered [from, from + count) (0-based), succeeds otherwise. */
typedef struct fail_plan {
    atomic_uint calls;
    unsigned from, count;
} fail_plan;

static pie_code copy_failing(void *user, void *dst, const void *src, size_t bytes, pie_status *st) {
    fail_plan *p = user;
    unsigned k = atomic_fetch_add(&p->calls, 1);
    if (k >= p->from && k < p->from + p->count)
        return pie_status_set(st, PIE_INTERNAL, "injected copy fault %u", k);
    memcpy(dst, src, bytes);
    return PIE_OK;
}

Test(eng_swap, a_failed_copy_fails_the_forward_clearly_and_the_engine_keeps_serving) {
    swap_setup gpu = {0};
    run_out ref = run(&gpu, NULL);
    /* slots 2: the first forward needs layers 2 and 3 back; copy 0 is the first eviction */
    fail_plan plan = {.from = 0, .count = 1};
    swap_setup sw = {.slots = 2, .copy = copy_failing, .copy_user = &plan};
    eng *e = open_ok(&sw);
    eng_swap_quiesce(e);
    pie_testwork_embed(e, 0, 9, 0, 8);
    uint32_t p[] = {20}, in[8], o = 120;
    eng_forward_item it = pie_test_item(PAGE, p, 8, true, pie_test_range(in, 0, 8), 8, &o, 1);
    pie_status st = {0};
    cr_assert_eq(eng_forward(e, &it, 1, &st), PIE_INTERNAL, "code %d: %s", st.code, st.msg);
    cr_assert(strstr(st.msg, "swap: moving layer ") && strstr(st.msg, "injected copy fault 0"),
              "message: %s", st.msg);
    eng_swap_stats s;
    eng_swap_get_stats(e, &s);
    cr_assert_eq(s.copy_failures, 1);
    /* the engine serves on: the same workload afterwards equals policy gpu bit for bit */
    run_out r = {0};
    pie_testwork_out_init(&r.o, e);
    workload(e, &r, NULL);
    assert_identical(&r, &ref, "after a failed copy");
    eng_close(e);
    free(r.o.logits);
    free(ref.o.logits);
}

/* A copy that, from the `hold_from`-th move on, waits inside the copy until the gate opens:
 * while it waits the move is certainly in flight. */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned calls, hold_from;
    bool entered, open;
} gate;

static pie_code copy_gated(void *user, void *dst, const void *src, size_t bytes, pie_status *st) {
    (void)st;
    gate *g = user;
    pthread_mutex_lock(&g->mu);
    if (g->calls++ >= g->hold_from) {
        g->entered = true;
        pthread_cond_broadcast(&g->cv);
        while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    memcpy(dst, src, bytes);
    return PIE_OK;
}

static void *open_gate_later(void *arg) {
    gate *g = arg;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&g->mu);
    g->open = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* Sequence B's page is freed and handed to a new sequence (clear_pages, as the worker does on
 * allocation) while a layer is in flight to the host: the clear waits for the move, then zeroes
 * the page in every layer wherever it is, and the new owner, reading the page before writing
 * it, sees zeros as under policy gpu. Checked by mutation: with wrk_tier_hold not waiting for
 * the move, the copy lands after the clear and this test fails (1 of 2 outputs differ). */
static void reuse_while_moving(eng *e, gate *g, run_out *r) {
    uint32_t pa[] = {0, 1}, pb[] = {2}, s[32], oa = 100, ob = 101;
    pie_testwork_embed(e, 0, 1, 0, 20);
    eng_forward_item a = pie_test_item(PAGE, pa, 20, true, pie_test_range(s, 0, 20), 20, &oa, 1);
    pie_test_forward_ok(e, &a, 1);
    pie_testwork_embed(e, 40, 2, 0, 10);
    eng_forward_item b = pie_test_item(PAGE, pb, 10, true, pie_test_range(s, 40, 10), 10, &ob, 1);
    pie_test_forward_ok(e, &b, 1);
    pthread_t opener;
    pie_status st = {0};
    if (g) { /* one slot more, then one less again: the pipeline evicts a layer (to the host),
              * held inside the copy — the direction where a clear that did not wait would be
              * overwritten by the copy */
        uint32_t got = 0;
        cr_assert_eq(eng_swap_set_slots(e, 3, &got, &st), PIE_OK, "%s", st.msg);
        eng_swap_quiesce(e);
        pthread_mutex_lock(&g->mu);
        g->hold_from = g->calls;
        pthread_mutex_unlock(&g->mu);
        cr_assert_eq(eng_swap_set_slots(e, 2, &got, &st), PIE_OK, "%s", st.msg);
        pthread_mutex_lock(&g->mu);
        while (!g->entered) pthread_cond_wait(&g->cv, &g->mu);
        pthread_mutex_unlock(&g->mu);
        cr_assert_eq(pthread_create(&opener, NULL, open_gate_later, g), 0);
    }
    cr_assert_eq(eng_clear_pages(e, pb, 1, &st), PIE_OK, "%s", st.msg); /* waits for the move */
    if (g) cr_assert_eq(pthread_join(opener, NULL), 0);
    /* the new owner reads the page's 10 positions before writing any: zeros, not B's K/V
     * (in the layer that was moving too) */
    pie_testwork_embed(e, 60, 3, 10, 1);
    uint32_t ic = 60, oc = 102;
    eng_forward_item c = pie_test_item(PAGE, pb, 10, false, &ic, 1, &oc, 1);
    pie_test_forward_ok(e, &c, 1);
    pie_testwork_embed(e, 70, 1, 20, 1); /* and A decodes on */
    uint32_t in = 70, od = 103;
    eng_forward_item d = pie_test_item(PAGE, pa, 21, true, &in, 1, &od, 1);
    pie_test_forward_ok(e, &d, 1);
    pie_testwork_record(e, &r->o, 102);
    pie_testwork_record(e, &r->o, 103);
}

Test(eng_swap, a_page_reused_while_its_layers_move_reads_as_never_written) {
    run_out ref = {0}, got = {0};
    swap_setup gpu = {0};
    eng *e = open_ok(&gpu);
    pie_testwork_out_init(&ref.o, e);
    reuse_while_moving(e, NULL, &ref);
    eng_close(e);
    gate g = {
        .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .hold_from = UINT32_MAX};
    swap_setup sw = {.slots = 2, .copy = copy_gated, .copy_user = &g};
    e = open_ok(&sw);
    pie_testwork_out_init(&got.o, e);
    reuse_while_moving(e, &g, &got);
    eng_close(e);
    assert_identical(&got, &ref, "page reused while a layer moved");
    free(ref.o.logits);
    free(got.o.logits);
}

Test(eng_swap, a_host_pool_too_small_is_refused_at_open) {
    /* 4 layers, at least 2 on the device: the host region needs 4 layer caches */
    swap_setup sw = {.slots = 2, .host_bytes = 3 * layer_bytes() + 100};
    pie_status st = {0};
    eng *e = (eng *)1;
    cr_assert_eq(open_swap(&sw, &e, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert_null(e);
    char want[256];
    snprintf(want, sizeof want,
             "swap: the host pool holds 3 layer caches of %zu bytes; 4 layers with 2 on the "
             "device need 4",
             layer_bytes());
    cr_assert_str_eq(st.msg, want);
    swap_setup bad = {.slots = 5};
    cr_assert_eq(open_swap(&bad, &e, &st), PIE_INVALID_ARGUMENT, "%s", st.msg);
    cr_assert_str_eq(st.msg, "swap: slots 5 is out of range [2, 4]");
}

/* ---- the tier on its own ------------------------------------------------------------------ */

/* After a step ends (cursor back at layer 0) the idle link prefetches the next step's first
 * layers: with 3 of 6 layers' slots, layers 0, 1, 2 end up on the device, 3-5 on the host. */
Test(wrk_tier, an_idle_link_prefetches_the_next_steps_first_layers) {
    wrk_tier_config c = {
        .n_layers = 6, .layer_bytes = 4096, .slots = 3, .min_slots = 2, .host_buffers = 6};
    wrk_tier *t = NULL;
    pie_status st = {0};
    cr_assert_eq(wrk_tier_open(&c, &t, &st), PIE_OK, "%s", st.msg);
    wrk_tier_touch(t, 4096); /* the whole buffer is written below */
    for (int step = 0; step < 3; step++)
        for (uint32_t l = 0; l < 6; l++) {
            void *base = NULL;
            cr_assert_eq(wrk_tier_acquire(t, l, &base, &st), PIE_OK, "%s", st.msg);
            unsigned char *b = base;
            if (step == 0) memset(b, (int)(l + 1), 4096); /* each layer's own bytes */
            cr_assert_eq(b[0], l + 1, "step %d layer %u holds layer %u's bytes", step, l,
                         b[0] - 1u);
            cr_assert_eq(b[4095], l + 1);
            wrk_tier_release(t, l);
        }
    wrk_tier_quiesce(t);
    wrk_tier_hold(t);
    wrk_tier_stats s;
    wrk_tier_get_stats(t, &s);
    cr_assert_eq(s.on_device, 3);
    cr_assert_eq(s.on_host, 3);
    wrk_tier_resume(t);
    for (uint32_t l = 0; l < 3; l++) { /* resident: no stall */
        void *base = NULL;
        uint64_t stalls = s.stalls;
        cr_assert_eq(wrk_tier_acquire(t, l, &base, &st), PIE_OK);
        wrk_tier_get_stats(t, &s);
        cr_assert_eq(s.stalls, stalls, "layer %u was not prefetched", l);
        wrk_tier_release(t, l);
    }
    wrk_tier_close(t);
}

/* A real device's hooks (wrk_tier_mem), on host memory: what the cuda backend plugs in, seen
 * from the tier's side. */
typedef struct fake_dev {
    int allocs, frees, pins, unpins;
    uint64_t moves_out, moves_in;
    bool out_before_release; /* a layer moved out while the engine still held it */
    int64_t held;            /* the layer the test holds, or -1 */
    pthread_mutex_t mu;
} fake_dev;

static pie_code fake_alloc(void *user, size_t bytes, void **out, pie_status *st) {
    (void)st;
    ((fake_dev *)user)->allocs++;
    *out = calloc(1, bytes);
    return *out ? PIE_OK : PIE_RESOURCE_EXHAUSTED;
}
static void fake_free(void *user, void *p) {
    ((fake_dev *)user)->frees++;
    free(p);
}
static pie_code fake_pin(void *user, void *p, size_t bytes, pie_status *st) {
    (void)p, (void)bytes, (void)st;
    ((fake_dev *)user)->pins++;
    return PIE_OK;
}
static void fake_unpin(void *user, void *p) {
    (void)p;
    ((fake_dev *)user)->unpins++;
}
static pie_code fake_move(void *user, uint32_t l, bool to_host, void *dst, const void *src,
                          size_t bytes, pie_status *st) {
    (void)st;
    fake_dev *f = user;
    pthread_mutex_lock(&f->mu);
    if (to_host && f->held == (int64_t)l) f->out_before_release = true;
    (*(to_host ? &f->moves_out : &f->moves_in))++;
    pthread_mutex_unlock(&f->mu);
    memcpy(dst, src, bytes);
    return PIE_OK;
}

/* A device region of 3 buffers for 6 layers: layers 3-5 start on the host (zero), every layer
 * keeps its own bytes across steps, slots never exceed the buffers, every move goes through
 * the device's hook, and close gives back what open took. */
Test(wrk_tier, a_device_region_smaller_than_the_model_holds_slots_buffers_only) {
    fake_dev f = {.held = -1};
    pthread_mutex_init(&f.mu, NULL);
    wrk_tier_mem mem = {.user = &f,
                        .dev_alloc = fake_alloc,
                        .dev_free = fake_free,
                        .host_pin = fake_pin,
                        .host_unpin = fake_unpin,
                        .move = fake_move};
    wrk_tier_config c = {.n_layers = 6,
                         .layer_bytes = 4096,
                         .slots = 3,
                         .min_slots = 2,
                         .host_buffers = 6,
                         .device_buffers = 3,
                         .mem = &mem};
    wrk_tier *t = NULL;
    pie_status st = {0};
    cr_assert_eq(wrk_tier_open(&c, &t, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(f.allocs, 1);
    cr_assert_eq(f.pins, 1);
    wrk_tier_stats s;
    wrk_tier_get_stats(t, &s);
    cr_assert_eq(s.on_device, 3);
    cr_assert_eq(s.on_host, 3);
    cr_assert_eq(wrk_tier_set_slots(t, 6), 3, "slots past the device's buffers");
    wrk_tier_touch(t, 4096);
    for (int step = 0; step < 3; step++)
        for (uint32_t l = 0; l < 6; l++) {
            void *base = NULL;
            cr_assert_eq(wrk_tier_acquire(t, l, &base, &st), PIE_OK, "%s", st.msg);
            pthread_mutex_lock(&f.mu);
            f.held = l;
            pthread_mutex_unlock(&f.mu);
            unsigned char *b = base;
            if (step == 0) {
                cr_assert_eq(b[0], 0, "layer %u starts zeroed", l);
                cr_assert_eq(b[4095], 0);
                memset(b, (int)(l + 1), 4096);
            }
            cr_assert_eq(b[0], l + 1, "step %d layer %u holds layer %u's bytes", step, l,
                         b[0] - 1u);
            cr_assert_eq(b[4095], l + 1);
            pthread_mutex_lock(&f.mu);
            f.held = -1;
            pthread_mutex_unlock(&f.mu);
            wrk_tier_release(t, l);
            wrk_tier_get_stats(t, &s);
            cr_assert_leq(s.on_device, 3);
        }
    wrk_tier_quiesce(t);
    wrk_tier_get_stats(t, &s);
    cr_assert_eq(s.swaps_out, f.moves_out, "every move out went through the hook");
    cr_assert_eq(s.swaps_in, f.moves_in);
    cr_assert_geq(f.moves_in, 9, "3 host layers fetched in each of 3 steps (%llu)",
                  (unsigned long long)f.moves_in);
    cr_assert(!f.out_before_release, "a layer moved out while the engine held it");
    wrk_tier_close(t);
    cr_assert_eq(f.frees, 1);
    cr_assert_eq(f.unpins, 1);
    pthread_mutex_destroy(&f.mu);
}

Test(wrk_tier, device_buffers_fewer_than_min_slots_or_slots_are_refused) {
    wrk_tier_config c = {.n_layers = 6,
                         .layer_bytes = 4096,
                         .slots = 2,
                         .min_slots = 3,
                         .host_buffers = 6,
                         .device_buffers = 2};
    wrk_tier *t = NULL;
    pie_status st = {0};
    c.min_slots = 2;
    c.slots = 4;
    cr_assert_eq(wrk_tier_open(&c, &t, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "swap: slots 4 is more than the device region's 2 layer buffers");
    c.min_slots = 3;
    c.slots = 3;
    cr_assert_eq(wrk_tier_open(&c, &t, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "swap: device_buffers 2 is out of range [3, 6]");
    cr_assert_null(t);
}

/* A device region committed as it is used (adaptive expansion on a real device): the fake
 * device zeroes what it commits and poisons what it gives back, so a layer read from a buffer
 * that lost its memory, or a prefix moved without its pages, shows as wrong bytes. */
typedef struct fake_commit {
    fake_dev base;
    size_t committed[8];
    char *region;
    size_t stride;
    uint64_t total, most;
    int decommits;
    bool fail; /* every commit fails while set */
} fake_commit;

static pie_code fc_alloc(void *user, size_t bytes, void **out, pie_status *st) {
    fake_commit *f = user;
    pie_code rc = fake_alloc(&f->base, bytes, out, st);
    if (rc == PIE_OK) memset(*out, 0xAA, bytes); /* nothing committed yet */
    f->region = *out;
    return rc;
}
static pie_code fc_commit(void *user, void *buf, size_t have, size_t want, pie_status *st) {
    fake_commit *f = user;
    if (f->fail) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "injected: out of memory");
    size_t i = (size_t)((char *)buf - f->region) / f->stride;
    cr_assert_eq(f->committed[i], have, "buffer %zu: have %zu, the device knows %zu", i, have,
                 f->committed[i]);
    cr_assert_eq(want % 4096, 0, "want %zu is not in dev_step pieces", want);
    memset((char *)buf + have, 0, want - have);
    f->total += want - have;
    if (f->total > f->most) f->most = f->total;
    f->committed[i] = want;
    return PIE_OK;
}
static void fc_decommit(void *user, void *buf, size_t have) {
    fake_commit *f = user;
    size_t i = (size_t)((char *)buf - f->region) / f->stride;
    cr_assert_eq(f->committed[i], have);
    memset(buf, 0xAA, have);
    f->total -= have;
    f->committed[i] = 0;
    f->decommits++;
}
static pie_code fc_pin(void *user, void *p, size_t bytes, pie_status *st) {
    return fake_pin(&((fake_commit *)user)->base, p, bytes, st);
}
static void fc_unpin(void *user, void *p) { fake_unpin(&((fake_commit *)user)->base, p); }
static void fc_free(void *user, void *p) { fake_free(&((fake_commit *)user)->base, p); }
static pie_code fc_move(void *user, uint32_t l, bool to_host, void *dst, const void *src,
                        size_t bytes, pie_status *st) {
    return fake_move(&((fake_commit *)user)->base, l, to_host, dst, src, bytes, st);
}

/* 6 layers of 4 pages of 4 KiB on a fake committing device (4 KiB pieces) whose budget is 3
 * whole layers, every layer on the device at start, at least 2. */
enum { COMMIT_LAYER = 4 * 4096 };
static wrk_tier *open_committing(fake_commit *f, wrk_tier_mem *mem) {
    *f = (fake_commit){.base = {.held = -1}, .stride = COMMIT_LAYER};
    pthread_mutex_init(&f->base.mu, NULL);
    *mem = (wrk_tier_mem){.user = f,
                          .dev_alloc = fc_alloc,
                          .dev_free = fc_free,
                          .host_pin = fc_pin,
                          .host_unpin = fc_unpin,
                          .move = fc_move,
                          .dev_commit = fc_commit,
                          .dev_decommit = fc_decommit,
                          .dev_step = 4096,
                          .device_bytes = 3 * COMMIT_LAYER};
    wrk_tier_config c = {.n_layers = 6,
                         .layer_bytes = COMMIT_LAYER,
                         .slots = 6,
                         .min_slots = 2,
                         .host_buffers = 6,
                         .mem = mem};
    wrk_tier *t = NULL;
    pie_status st = {0};
    cr_assert_eq(wrk_tier_open(&c, &t, &st), PIE_OK, "%s", st.msg);
    return t;
}

/* One step over the 6 layers: each layer's first `bytes` hold its own byte (written at the
 * step `write`), checked every step. */
static void commit_steps(wrk_tier *t, size_t bytes, int steps, bool write_first) {
    pie_status st = {0};
    for (int step = 0; step < steps; step++)
        for (uint32_t l = 0; l < 6; l++) {
            void *base = NULL;
            cr_assert_eq(wrk_tier_acquire(t, l, &base, &st), PIE_OK, "%s", st.msg);
            unsigned char *b = base;
            if (step == 0 && write_first) memset(b, (int)(l + 1), bytes);
            for (size_t k = 0; k < bytes; k += 511)
                cr_assert_eq(b[k], l + 1, "step %d layer %u byte %zu: %u", step, l, k, b[k]);
            cr_assert_eq(b[bytes - 1], l + 1);
            wrk_tier_release(t, l);
        }
}

Test(wrk_tier, a_committing_device_holds_more_layers_while_the_prefix_is_short) {
    fake_commit f;
    wrk_tier_mem mem;
    wrk_tier *t = open_committing(&f, &mem);
    const size_t layer = COMMIT_LAYER;
    /* a quarter of the page space in use: all 6 layers fit the budget of 3 full ones */
    wrk_tier_touch(t, 4096);
    commit_steps(t, 4096, 3, true);
    wrk_tier_quiesce(t);
    wrk_tier_stats s;
    wrk_tier_get_stats(t, &s);
    cr_assert_eq(s.on_device, 6);
    cr_assert_eq(s.slots, 6);
    cr_assert_eq(s.committed, 6 * 4096);
    cr_assert_eq(s.swaps_out, 0);
    /* the whole page space in use: 3 layers fit; the others leave, every byte comes along */
    wrk_tier_touch(t, layer);
    commit_steps(t, 4096, 1, false); /* what was written before the prefix grew */
    commit_steps(t, layer, 3, true);
    wrk_tier_quiesce(t);
    wrk_tier_get_stats(t, &s);
    cr_assert_eq(s.slots, 3);
    cr_assert_leq(s.on_device, 3);
    cr_assert_gt(s.swaps_out, 0);
    cr_assert_leq(s.committed, 3 * layer, "committed %llu over the budget",
                  (unsigned long long)s.committed);
    cr_assert_eq(s.committed, f.total, "the tier's count and the device's disagree");
    cr_assert_gt(f.decommits, 0, "free buffers never gave their memory back");
    cr_assert_eq(wrk_tier_set_slots(t, 6), 3, "more layers than the budget holds");
    wrk_tier_close(t);
    cr_assert_eq(f.total, 0, "close left %llu bytes committed", (unsigned long long)f.total);
    pthread_mutex_destroy(&f.base.mu);
}

/* A commit that fails (the device out of memory) fails the acquire that needed it with the
 * device's reason; the next acquire commits and the layer's bytes are all there. */
Test(wrk_tier, a_failed_commit_fails_its_acquire_and_the_next_one_commits) {
    fake_commit f;
    wrk_tier_mem mem;
    wrk_tier *t = open_committing(&f, &mem);
    pie_status st = {0};
    const size_t layer = COMMIT_LAYER;
    wrk_tier_touch(t, 4096);
    commit_steps(t, 4096, 1, true);
    wrk_tier_quiesce(t);
    f.fail = true;
    wrk_tier_touch(t, layer);
    void *base = NULL;
    cr_assert_eq(wrk_tier_acquire(t, 0, &base, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert(strstr(st.msg, "committing") && strstr(st.msg, "injected: out of memory"), "%s",
              st.msg);
    cr_assert_eq(wrk_tier_hold_ready(t, &st), PIE_RESOURCE_EXHAUSTED, "hold: %s", st.msg);
    wrk_tier_resume(t);
    f.fail = false;
    commit_steps(t, 4096, 1, false); /* each layer: its bytes, committed on acquire */
    cr_assert_eq(wrk_tier_acquire(t, 0, &base, &st), PIE_OK, "%s", st.msg);
    unsigned char *b = base;
    for (size_t k = 4096; k < layer; k += 509)
        cr_assert_eq(b[k], 0, "byte %zu past the old prefix: %u", k, b[k]);
    wrk_tier_release(t, 0);
    wrk_tier_close(t);
    cr_assert_eq(f.total, 0);
    pthread_mutex_destroy(&f.base.mu);
}
