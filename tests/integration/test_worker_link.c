/* test_worker_link.c — a real pie-worker executing batches over WorkerLink.
 *
 * The test process plays the controller: it serves pie.v1.Controller/WorkerLink with the rpc
 * layer, starts pie-worker (tests/support/pie_proc.h) dialling it with the generated tiny-f32
 * model, receives the registration, and sends scheduling steps. What comes back is compared
 * with the engine run directly in this process on the same model (eng.h), bit for bit: both
 * use one kernel thread, so the arithmetic is the same.
 *
 * Covered: the registration's ModelInfo and capacities, credits (the configured grant after
 * `registered`, one back with the results of every step, results of a step in one message),
 * prompt distributions and greedy generation equal to the engine, mask/copy/slot batches, a
 * reallocated page and embedding slot reading exactly as never-written ones (zeroed),
 * per-item and per-batch errors with the worker serving on, the stats heartbeat, re-registration
 * after the link drops (all slots free, engine kept), Drain with shutdown, the null backend, and
 * start-up failures (bad model.path or backend cuda without a device: NOT_SERVING with Info
 * state FAILED, exit 1 on SIGTERM; missing model.path: exit 2), and the memory policy (issue
 * 13): swap's registration, outputs and swap counters; its refusals. */
#include <criterion/criterion.h>

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "eng.h"
#include "mdl.h"
#include "pie/v1/controller.pb-c.h"
#include "pie/v1/worker.pb-c.h"
#include "pie_proc.h"
#include "pie_testutil.h"
#include "rpc.h"
#include "tok.h"
#include "wrk_nulldev.h"
#include "wrk_numa.h"

#define START_MS    20000 /* the worker serves within this (generous: sanitizers, loaded CI) */
#define WAIT_MS     10000 /* a message the worker must send arrives within this */
#define STOP_MS     20000
#define MODEL_DIR   PIE_MODELS_DIR "/tiny-f32"
#define PAGE        16
#define KV_PAGES    64
#define EMBED_SLOTS 256
#define MAX_TOKENS  256

TestSuite(worker_link, .fini = pie_test_leak_check, .timeout = 120);


/* ---- the fake controller --------------------------------------------------------------------- */

typedef struct fc {
    rpc_server *srv;
    int port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rpc_call *call;        /* the WorkerLink call now open (a reference is held) */
    int calls;             /* WorkerLink calls accepted so far */
    Pie__V1__WorkerUp **q; /* received and not yet taken, oldest first */
    size_t q_len, q_cap;
} fc;

static bool fc_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    fc *f = user;
    rpc_call_ref(call);
    pthread_mutex_lock(&f->mu);
    rpc_call *old = f->call;
    f->call = call;
    f->calls++;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    if (old) rpc_call_unref(old);
    return false;
}

static bool fc_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    (void)call;
    fc *f = user;
    pthread_mutex_lock(&f->mu);
    if (f->q_len == f->q_cap) {
        size_t cap = f->q_cap ? 2 * f->q_cap : 64;
        Pie__V1__WorkerUp **q = realloc(f->q, cap * sizeof *q);
        if (q == NULL) {
            pthread_mutex_unlock(&f->mu);
            return false; /* dropped: the test waiting for it fails with a timeout */
        }
        f->q = q;
        f->q_cap = cap;
    }
    f->q[f->q_len++] = (Pie__V1__WorkerUp *)msg;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return true;
}

static void fc_on_half_close(rpc_call *call, void *user) {
    (void)user;
    rpc_call_finish(call, PIE_OK, NULL);
}

static void fc_on_done(rpc_call *call, void *user) {
    fc *f = user;
    pthread_mutex_lock(&f->mu);
    bool mine = f->call == call;
    if (mine) f->call = NULL;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    if (mine) rpc_call_unref(call);
}

static void fc_start(fc *f) {
    memset(f, 0, sizeof *f);
    cr_assert_eq(pthread_mutex_init(&f->mu, NULL), 0);
    pthread_condattr_t ca;
    cr_assert_eq(pthread_condattr_init(&ca), 0);
    cr_assert_eq(pthread_condattr_setclock(&ca, CLOCK_MONOTONIC), 0);
    cr_assert_eq(pthread_cond_init(&f->cv, &ca), 0);
    pthread_condattr_destroy(&ca);
    pie_status st;
    rpc_server_opts so = {
        .addr = "127.0.0.1:0", .n_threads = 1, .max_recv_bytes = -1, .max_send_bytes = -1};
    f->srv = rpc_server_create(&so, &st);
    cr_assert(f->srv, "%s", st.msg);
    rpc_method m = {
        .path = "/pie.v1.Controller/WorkerLink",
        .kind = RPC_BIDI,
        .request = &pie__v1__worker_up__descriptor,
        .response = &pie__v1__worker_down__descriptor,
        .on_call = fc_on_call,
        .on_message = fc_on_message,
        .on_half_close = fc_on_half_close,
        .on_done = fc_on_done,
        .user = f,
    };
    cr_assert_eq(rpc_server_add_methods(f->srv, &m, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(rpc_server_start(f->srv, &st), PIE_OK, "%s", st.msg);
    f->port = rpc_server_port(f->srv);
}

static void fc_stop(fc *f) {
    rpc_server_shutdown(f->srv, 0);
    rpc_server_destroy(f->srv);
    for (size_t i = 0; i < f->q_len; i++) rpc_msg_free(&f->q[i]->base);
    free(f->q);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
}

/* Waits on cv until the absolute CLOCK_MONOTONIC deadline; false once it passed. */
static bool fc_wait(fc *f, int64_t deadline_ms) {
    if (pie_test_now_ms() >= deadline_ms) return false;
    int64_t ns = deadline_ms * 1000000;
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    pthread_cond_timedwait(&f->cv, &f->mu, &ts);
    return true;
}

/* A heartbeat alone: stats and nothing else. */
static bool stats_only(const Pie__V1__WorkerUp *up) {
    return up->stats && !up->registration && up->n_results == 0 && up->credits == 0 &&
           !up->capacity;
}

/* The next WorkerUp (heartbeats skipped unless want_stats), or NULL after timeout_ms. */
static Pie__V1__WorkerUp *fc_recv_opt(fc *f, int64_t timeout_ms, bool want_stats) {
    int64_t deadline = pie_test_now_ms() + timeout_ms;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (f->q_len > 0) {
            Pie__V1__WorkerUp *up = f->q[0];
            memmove(f->q, f->q + 1, (f->q_len - 1) * sizeof *f->q);
            f->q_len--;
            if (want_stats || !stats_only(up)) {
                pthread_mutex_unlock(&f->mu);
                return up;
            }
            rpc_msg_free(&up->base);
        }
        if (!fc_wait(f, deadline)) break;
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static Pie__V1__WorkerUp *fc_recv(fc *f, const pie_proc *w) {
    Pie__V1__WorkerUp *up = fc_recv_opt(f, WAIT_MS, false);
    if (up == NULL) {
        char *tail = w ? pie_proc_log_tail(w, 3000) : NULL;
        cr_assert_fail("no WorkerUp from the worker within %d ms; worker log:\n%s", WAIT_MS,
                       tail ? tail : "");
    }
    return up;
}

/* Waits until the worker has opened its n-th WorkerLink call. */
static void fc_wait_call(fc *f, int n) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    pthread_mutex_lock(&f->mu);
    while (!(f->calls >= n && f->call != NULL) && fc_wait(f, deadline)) {}
    bool ok = f->calls >= n && f->call != NULL;
    int calls = f->calls;
    pthread_mutex_unlock(&f->mu);
    cr_assert(ok, "the worker opened %d WorkerLink calls, not %d, within %d ms", calls, n, WAIT_MS);
}

static void fc_send(fc *f, const Pie__V1__WorkerDown *down) {
    pthread_mutex_lock(&f->mu);
    rpc_call *call = f->call;
    if (call) rpc_call_ref(call);
    pthread_mutex_unlock(&f->mu);
    cr_assert(call, "no WorkerLink call to send on");
    pie_code rc = rpc_call_send(call, &down->base);
    rpc_call_unref(call);
    cr_assert_eq(rc, PIE_OK, "rpc_call_send: %s", pie_code_name(rc));
}

/* Ends the current call as a controller that goes away would. */
static void fc_drop(fc *f) {
    pthread_mutex_lock(&f->mu);
    rpc_call *call = f->call;
    if (call) rpc_call_ref(call);
    pthread_mutex_unlock(&f->mu);
    cr_assert(call, "no WorkerLink call to drop");
    rpc_call_cancel(call, PIE_UNAVAILABLE, "test: the controller drops the link");
    rpc_call_unref(call);
}

/* ---- the worker process -----------------------------------------------------------------------
 */

typedef struct wopts {
    const char *backend;     /* NULL: cpu (the default) */
    const char *model_path;  /* NULL: tiny-f32; "": not set */
    const char *credits;     /* NULL: 1 (these tests count credits one step at a time) */
    const char *listen;      /* NULL: an ephemeral port */
    const char *max_message; /* server.max_message; NULL: the default */
    const char *const *env;  /* more VAR=value settings, NULL-terminated; NULL: none */
} wopts;

static pie_proc *spawn_worker(const fc *f, const wopts *o) {
    char ctl[64], model[512], backend[64], credits[64], listen[64], maxmsg[64];
    const char *env[32];
    size_t n = 0;
    snprintf(ctl, sizeof ctl, "PIE_CONTROLLER_ADDRESS=127.0.0.1:%d", f->port);
    env[n++] = ctl;
    const char *mp = o && o->model_path ? o->model_path : MODEL_DIR;
    if (mp[0] != '\0') {
        snprintf(model, sizeof model, "PIE_MODEL_PATH=%s", mp);
        env[n++] = model;
    }
    if (o && o->backend) {
        snprintf(backend, sizeof backend, "PIE_BACKEND=%s", o->backend);
        env[n++] = backend;
    }
    snprintf(credits, sizeof credits, "PIE_BATCH_CREDITS=%s", o && o->credits ? o->credits : "1");
    env[n++] = credits;
    if (o && o->listen) {
        snprintf(listen, sizeof listen, "PIE_SERVER_LISTEN=%s", o->listen);
        env[n++] = listen;
    }
    if (o && o->max_message) {
        snprintf(maxmsg, sizeof maxmsg, "PIE_SERVER_MAX_MESSAGE=%s", o->max_message);
        env[n++] = maxmsg;
    }
    env[n++] = "PIE_ENGINE_THREADS=1";
    env[n++] = "PIE_POOL_KV_PAGES=64";
    env[n++] = "PIE_POOL_EMBED_SLOTS=256";
    env[n++] = "PIE_BATCH_MAX_TOKENS=256";
    env[n++] = "PIE_WORKER_GROUP_ID=test-worker";
    env[n++] = "PIE_CONTROLLER_RECONNECT_INITIAL=50ms";
    env[n++] = "PIE_CONTROLLER_RECONNECT_MAX=200ms";
    for (size_t i = 0; o && o->env && o->env[i]; i++) {
        cr_assert(n + 1 < sizeof env / sizeof env[0], "too many settings");
        env[n++] = o->env[i];
    }
    env[n] = NULL;
    pie_status st;
    pie_proc_opts po = {.env = env};
    pie_proc *p = pie_proc_spawn("pie-worker", &po, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

static pie_proc *start_worker(const fc *f, const wopts *o) {
    pie_proc *p = spawn_worker(f, o);
    pie_status st;
    cr_assert_eq(pie_proc_wait_ready(p, START_MS, &st), PIE_OK, "%s", st.msg);
    return p;
}

/* SIGTERM; the exit status must be `want`. */
static void stop_worker(pie_proc *p, int want) {
    pie_status st;
    if (pie_proc_signal(p, SIGTERM, &st) != PIE_OK) { /* already exited */
    }
    int rc = pie_proc_wait(p, STOP_MS, &st);
    char *tail = pie_proc_log_tail(p, 3000);
    cr_assert_eq(rc, want, "pie-worker exited with %d, not %d: %s\nlog:\n%s", rc, want, st.msg,
                 tail ? tail : "");
    free(tail);
    pie_proc_destroy(p);
}

/* Receives the registration; the caller frees it. */
static Pie__V1__WorkerUp *expect_registration(fc *f, const pie_proc *w, int nth_call) {
    fc_wait_call(f, nth_call);
    Pie__V1__WorkerUp *up = fc_recv(f, w);
    cr_assert(up->registration, "the first WorkerUp carries no registration");
    return up;
}

/* `registered`, agreeing to deferred items (defer_ok) or not. */
static void send_registered_defer(fc *f, uint32_t index, uint32_t heartbeat_ms, bool defer_ok) {
    Pie__V1__WorkerRegistered r = PIE__V1__WORKER_REGISTERED__INIT;
    r.worker_index = index;
    r.version = "pie-c/0.1.0";
    r.heartbeat_ms = heartbeat_ms;
    r.defer_ok = defer_ok;
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.registered = &r;
    fc_send(f, &down);
}

static void send_registered(fc *f, uint32_t index, uint32_t heartbeat_ms) {
    Pie__V1__WorkerRegistered r = PIE__V1__WORKER_REGISTERED__INIT;
    r.worker_index = index;
    r.version = "pie-c/0.1.0";
    r.heartbeat_ms = heartbeat_ms;
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.registered = &r;
    fc_send(f, &down);
}

static void expect_credits(fc *f, const pie_proc *w, uint32_t n) {
    Pie__V1__WorkerUp *up = fc_recv(f, w);
    cr_assert_eq(up->n_results, 0, "the credit grant carries %zu results", up->n_results);
    cr_assert_eq(up->credits, n, "the worker granted %u credits after registering, not %u",
                 up->credits, n);
    rpc_msg_free(&up->base);
}

/* Registration, `registered` (heartbeat 60 s: no heartbeats during a test), the credit grant. */
static void link_up(fc *f, const pie_proc *w, uint32_t credits) {
    Pie__V1__WorkerUp *reg = expect_registration(f, w, 1);
    rpc_msg_free(&reg->base);
    send_registered(f, 1, 60000);
    expect_credits(f, w, credits);
}

/* ---- building steps ----------------------------------------------------------------------------
 */

typedef struct arena {
    _Alignas(16) char buf[1 << 17];
    size_t used;
} arena;

static void *anew(arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    cr_assert_leq(a->used + n, sizeof a->buf, "test arena too small");
    void *p = a->buf + a->used;
    a->used += n;
    memset(p, 0, n);
    return p;
}

static uint32_t *acopy(arena *a, const uint32_t *v, size_t n) {
    if (n == 0) return NULL;
    uint32_t *p = anew(a, n * sizeof *p);
    memcpy(p, v, n * sizeof *p);
    return p;
}

static Pie__V1__Batch *b_new(arena *a, uint64_t id) {
    Pie__V1__Batch *b = anew(a, sizeof *b);
    pie__v1__batch__init(b);
    b->batch_id = id;
    return b;
}

typedef struct slots_spec {
    const uint32_t *alloc_kv, *alloc_emb, *free_kv, *free_emb;
    size_t n_alloc_kv, n_alloc_emb, n_free_kv, n_free_emb;
} slots_spec;

static Pie__V1__Batch *b_slots(arena *a, uint64_t id, slots_spec s) {
    Pie__V1__Batch *b = b_new(a, id);
    Pie__V1__SlotBatch *sb = anew(a, sizeof *sb);
    pie__v1__slot_batch__init(sb);
    sb->alloc_kv_slots = acopy(a, s.alloc_kv, sb->n_alloc_kv_slots = s.n_alloc_kv);
    sb->alloc_embed_slots = acopy(a, s.alloc_emb, sb->n_alloc_embed_slots = s.n_alloc_emb);
    sb->free_kv_slots = acopy(a, s.free_kv, sb->n_free_kv_slots = s.n_free_kv);
    sb->free_embed_slots = acopy(a, s.free_emb, sb->n_free_embed_slots = s.n_free_emb);
    b->kind_case = PIE__V1__BATCH__KIND_SLOTS;
    b->slots = sb;
    return b;
}

static Pie__V1__Batch *b_embed(arena *a, uint64_t id, const uint32_t *slots, const uint32_t *toks,
                               const uint32_t *pos, size_t n) {
    Pie__V1__Batch *b = b_new(a, id);
    Pie__V1__EmbedTextBatch *e = anew(a, sizeof *e);
    pie__v1__embed_text_batch__init(e);
    e->embed_slots = acopy(a, slots, e->n_embed_slots = n);
    e->token_ids = acopy(a, toks, e->n_token_ids = n);
    e->positions = acopy(a, pos, e->n_positions = n);
    b->kind_case = PIE__V1__BATCH__KIND_EMBED_TEXT;
    b->embed_text = e;
    return b;
}

static Pie__V1__ForwardItem *fwd_item(arena *a, const eng_forward_item *it) {
    Pie__V1__ForwardItem *fi = anew(a, sizeof *fi);
    pie__v1__forward_item__init(fi);
    fi->kv_slots = acopy(a, it->kv_pages, fi->n_kv_slots = it->n_kv_pages);
    fi->kv_last_page_len = it->kv_last_page_len;
    fi->append_kv = it->append_kv;
    fi->input_embed_slots = acopy(a, it->in_slots, fi->n_input_embed_slots = it->n_in);
    fi->output_embed_slots = acopy(a, it->out_slots, fi->n_output_embed_slots = it->n_out);
    return fi;
}

/* A forward batch of the items the engine would be given. */
static Pie__V1__Batch *b_forward(arena *a, uint64_t id, const eng_forward_item *items, size_t n) {
    Pie__V1__Batch *b = b_new(a, id);
    Pie__V1__ForwardBatch *fb = anew(a, sizeof *fb);
    pie__v1__forward_batch__init(fb);
    fb->n_items = n;
    fb->items = anew(a, n * sizeof *fb->items);
    for (size_t i = 0; i < n; i++) fb->items[i] = fwd_item(a, &items[i]);
    b->kind_case = PIE__V1__BATCH__KIND_FORWARD;
    b->forward = fb;
    return b;
}

static Pie__V1__Batch *b_next_dist(arena *a, uint64_t id, const uint32_t *slots, const uint32_t *k,
                                   const float *t, size_t n) {
    Pie__V1__Batch *b = b_new(a, id);
    Pie__V1__NextDistBatch *nb = anew(a, sizeof *nb);
    pie__v1__next_dist_batch__init(nb);
    nb->n_items = n;
    nb->items = anew(a, n * sizeof *nb->items);
    for (size_t i = 0; i < n; i++) {
        Pie__V1__NextDistItem *it = anew(a, sizeof *it);
        pie__v1__next_dist_item__init(it);
        it->embed_slot = slots[i];
        it->top_k = k[i];
        it->temperature = t[i];
        nb->items[i] = it;
    }
    b->kind_case = PIE__V1__BATCH__KIND_NEXT_DIST;
    b->next_dist = nb;
    return b;
}

static Pie__V1__Batch *b_mask(arena *a, uint64_t id, uint32_t slot, const bool *masked, size_t n) {
    Pie__V1__Batch *b = b_new(a, id);
    Pie__V1__MaskPageBatch *mb = anew(a, sizeof *mb);
    pie__v1__mask_page_batch__init(mb);
    Pie__V1__MaskPageItem *it = anew(a, sizeof *it);
    pie__v1__mask_page_item__init(it);
    it->kv_slot = slot;
    it->n_masked = n;
    it->masked = anew(a, n * sizeof *it->masked);
    for (size_t i = 0; i < n; i++) it->masked[i] = masked[i];
    mb->n_items = 1;
    mb->items = anew(a, sizeof *mb->items);
    mb->items[0] = it;
    b->kind_case = PIE__V1__BATCH__KIND_MASK_PAGE;
    b->mask_page = mb;
    return b;
}

static Pie__V1__Batch *b_copy(arena *a, uint64_t id, const eng_copy_item *c) {
    Pie__V1__Batch *b = b_new(a, id);
    Pie__V1__CopyPageBatch *cb = anew(a, sizeof *cb);
    pie__v1__copy_page_batch__init(cb);
    Pie__V1__CopyPageItem *it = anew(a, sizeof *it);
    pie__v1__copy_page_item__init(it);
    it->src_kv_slot = c->src;
    it->dst_kv_slot = c->dst;
    it->src_offset = c->src_off;
    it->dst_offset = c->dst_off;
    it->token_count = c->count;
    cb->n_items = 1;
    cb->items = anew(a, sizeof *cb->items);
    cb->items[0] = it;
    b->kind_case = PIE__V1__BATCH__KIND_COPY_PAGE;
    b->copy_page = cb;
    return b;
}

static void send_step(fc *f, Pie__V1__Batch **batches, size_t n) {
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.n_batches = n;
    down.batches = batches;
    fc_send(f, &down);
}

/* The results of one step: n results with the step's batch ids and one credit. Caller frees. */
static Pie__V1__WorkerUp *expect_results(fc *f, const pie_proc *w, Pie__V1__Batch **batches,
                                         size_t n) {
    Pie__V1__WorkerUp *up = fc_recv(f, w);
    cr_assert_eq(up->n_results, n, "a step of %zu batches came back as %zu results", n,
                 up->n_results);
    cr_assert_eq(up->credits, 1, "a step's results return %u credits, not 1", up->credits);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(up->results[i]->batch_id, batches[i]->batch_id,
                     "result %zu is for batch %llu, not %llu", i,
                     (unsigned long long)up->results[i]->batch_id,
                     (unsigned long long)batches[i]->batch_id);
    return up;
}

static void assert_batch_ok(const Pie__V1__BatchResult *r, size_t n_items) {
    cr_assert_eq(r->code, 0, "batch %llu failed: %s %s", (unsigned long long)r->batch_id,
                 pie_code_name((int)r->code), r->message);
    cr_assert_eq(r->n_items, n_items, "batch %llu has %zu item results, not %zu",
                 (unsigned long long)r->batch_id, r->n_items, n_items);
}

/* ---- the direct engine ------------------------------------------------------------------------
 */

static eng *open_engine_kv(const char *dir, uint32_t kv_pages, eng_kv_dtype kv) {
    eng_opts o = {.model_dir = dir,
                  .kv_page_size = PAGE,
                  .kv_pages = kv_pages,
                  .embed_slots = EMBED_SLOTS,
                  .max_batch_tokens = MAX_TOKENS,
                  .n_threads = 1,
                  .kv_dtype = kv};
    eng *e = NULL;
    pie_status st;
    cr_assert_eq(eng_open(&o, &e, &st), PIE_OK, "eng_open: %s", st.msg);
    return e;
}

static eng *open_engine_at(const char *dir, uint32_t kv_pages) {
    return open_engine_kv(dir, kv_pages, ENG_KV_F32);
}

static eng *open_engine(void) { return open_engine_at(MODEL_DIR, KV_PAGES); }

/* Distributions straight from the engine, computed in ONE call as the worker does for one
 * batch: lm_head runs over all rows of a call at once, and the rows of a call share its
 * arithmetic (a one-row and a two-row product may round differently). want[i] gets the ids and
 * probabilities of slots[i]; at most 4 items of k <= 512. */
typedef struct direct_dist {
    uint32_t ids[512];
    float probs[512];
    uint32_t k;
} direct_dist;

static void engine_dists(eng *e, const uint32_t *slots, const uint32_t *k, const float *t, size_t n,
                         direct_dist *want) {
    eng_dist_item it[4];
    cr_assert_leq(n, 4);
    for (size_t i = 0; i < n; i++) {
        cr_assert_leq(k[i], 512);
        want[i].k = k[i];
        it[i] = (eng_dist_item){.slot = slots[i],
                                .top_k = k[i],
                                .temperature = t[i],
                                .ids = want[i].ids,
                                .probs = want[i].probs};
    }
    pie_status st;
    cr_assert_eq(eng_next_dist(e, it, (uint32_t)n, &st), PIE_OK, "eng_next_dist: %s", st.msg);
}

/* A distribution from the link equals the engine's, bit for bit. */
static void assert_dist_equal(const direct_dist *want, const Pie__V1__Distribution *d,
                              const char *what) {
    cr_assert(d, "%s: no distribution", what);
    cr_assert_eq(d->n_token_ids, want->k, "%s: %zu token ids, not %u", what, d->n_token_ids,
                 want->k);
    cr_assert_eq(d->n_probs, want->k, "%s: %zu probabilities, not %u", what, d->n_probs, want->k);
    for (uint32_t i = 0; i < want->k; i++) {
        cr_assert_eq(d->token_ids[i], want->ids[i], "%s: token %u is %u over the link, %u direct",
                     what, i, d->token_ids[i], want->ids[i]);
        cr_assert(d->probs[i] == want->probs[i], "%s: p[%u] is %.9g over the link, %.9g direct",
                  what, i, (double)d->probs[i], (double)want->probs[i]);
    }
}

/* What a SlotBatch allocating KV pages does to the engine: zeroed K/V, an all-visible mask. */
static void alloc_pages(eng *e, const uint32_t *pages, size_t n) {
    pie_status st;
    cr_assert_eq(eng_clear_pages(e, pages, (uint32_t)n, &st), PIE_OK, "%s", st.msg);
}

/* A deterministic prompt below the special tokens (507..511 in tiny-f32). */
static uint32_t prompt_token(uint32_t i) { return (i * 37u + 11u) % 500u; }

/* ---- tests: registration ------------------------------------------------------------------------
 */

/* sha256sum of path, lowercase hex, into out[65]. */
static void sha256_file(const char *path, char out[65]) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "sha256sum '%s'", path);
    FILE *p = popen(cmd, "r");
    cr_assert(p, "popen sha256sum");
    char line[256] = "";
    cr_assert(fgets(line, sizeof line, p), "sha256sum printed nothing");
    cr_assert_eq(pclose(p), 0, "sha256sum failed");
    memcpy(out, line, 64);
    out[64] = '\0';
}

Test(worker_link, registers_with_the_models_info_and_capacities_then_grants_one_credit) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    const Pie__V1__WorkerRegistration *r = up->registration;
    cr_assert_str_eq(r->group_id, "test-worker");
    cr_assert_str_eq(r->version, "pie-c/0.1.0");
    cr_assert_eq(r->backend, PIE__V1__BACKEND__BACKEND_CPU);
    cr_assert_eq(r->memory_policy, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU);
    cr_assert_eq(r->tp_size, 1);
    cr_assert_str_eq(r->device, "cpu: 1 threads");

    mdl_config c;
    pie_status st;
    cr_assert_eq(mdl_config_load(MODEL_DIR, &c, &st), PIE_OK, "%s", st.msg);
    const Pie__V1__ModelInfo *m = r->model;
    cr_assert(m, "registration without a model");
    cr_assert_str_eq(m->name, "tiny-f32", "model.name defaults to the directory's basename");
    cr_assert_eq(m->vocab_size, c.vocab_size);
    cr_assert_eq(m->kv_page_size, PAGE);
    cr_assert_eq(m->num_layers, c.n_layers);
    cr_assert_eq(m->hidden_size, c.hidden_size);
    cr_assert_eq(m->num_heads, c.n_heads);
    cr_assert_eq(m->num_kv_heads, c.n_kv_heads);
    cr_assert_eq(m->head_dim, c.head_dim);
    cr_assert_eq(m->max_context_tokens, c.max_position);
    cr_assert_eq(m->max_forward_tokens, MAX_TOKENS);
    cr_assert_str_eq(m->dtype, "f32");
    cr_assert_str_eq(m->architecture, c.architecture);
    cr_assert_eq(m->default_top_k, 256);
    cr_assert_eq(m->max_top_k, c.vocab_size < 1024 ? c.vocab_size : 1024);
    cr_assert_eq(m->n_traits, 5);
    cr_assert_str_eq(m->traits[0], "allocate");

    const Pie__V1__TokenizerInfo *t = m->tokenizer;
    cr_assert(t, "model without tokenizer info");
    cr_assert_str_eq(t->kind, "bpe-bytelevel");
    char sha[65];
    sha256_file(MODEL_DIR "/tokenizer.json", sha);
    cr_assert_str_eq(t->tokenizer_sha256, sha);
    tok *tk = NULL;
    cr_assert_eq(tok_load(MODEL_DIR "/tokenizer.json", &tk, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(t->num_tokens, tok_vocab_size(tk));
    tok_free(tk);
    cr_assert(t->has_bos_token);
    cr_assert_eq((int32_t)t->bos_token_id, c.bos_token_id);
    cr_assert_eq(t->n_stop_token_ids, c.n_eos_token_ids);
    for (size_t i = 0; i < t->n_stop_token_ids; i++)
        cr_assert_eq((int32_t)t->stop_token_ids[i], c.eos_token_ids[i]);

    const Pie__V1__WorkerCapacity *cap = r->capacity;
    cr_assert(cap, "registration without capacity");
    cr_assert_eq(cap->kv_pages_max, KV_PAGES);
    cr_assert_eq(cap->kv_pages_effective, KV_PAGES);
    cr_assert_eq(cap->kv_pages_gpu, KV_PAGES);
    cr_assert_eq(cap->embed_slots, EMBED_SLOTS);
    cr_assert_eq(cap->max_batch_tokens, MAX_TOKENS);
    cr_assert_eq(cap->max_batch_items, 256);
    rpc_msg_free(&up->base);

    send_registered(&f, 7, 60000);
    expect_credits(&f, w, 1);

    /* Info agrees, READY and linked. */
    rpc_channel *ch = rpc_channel_create(pie_proc_addr(w), NULL, &st);
    cr_assert(ch, "%s", st.msg);
    Pie__V1__InfoRequest ireq = PIE__V1__INFO_REQUEST__INIT;
    Pie__V1__InfoResponse *info = NULL;
    rpc_call_opts co = {.timeout_ms = WAIT_MS};
    cr_assert_eq(rpc_unary(ch, "/pie.v1.Worker/Info", &ireq.base,
                           &pie__v1__info_response__descriptor, (ProtobufCMessage **)&info, &co,
                           &st),
                 PIE_OK, "Info: %s", st.msg);
    cr_assert_eq(info->state, PIE__V1__LOAD_STATE__LOAD_STATE_READY);
    cr_assert(info->model && strcmp(info->model->name, "tiny-f32") == 0);
    cr_assert(info->capacity && info->capacity->kv_pages_max == KV_PAGES);
    cr_assert(info->controller_linked);
    cr_assert_gt(info->device_pool_bytes, 0);
    rpc_msg_free(&info->base);
    rpc_channel_destroy(ch);

    stop_worker(w, 0);
    fc_stop(&f);
}

/* ---- tests: execution ---------------------------------------------------------------------------
 */

#define PROMPT 20

/* Sends the prompt step (slots, embed_text, forward, next_dist with k = 0 → 256 at t = 0 → 1
 * and k = 10 at t = 0.7) and runs the same on e; checks every result. Output embedding: slot
 * PROMPT. Pages 0 and 1 hold the prompt's K/V afterwards. */
static void prompt_step(fc *f, const pie_proc *w, eng *e) {
    uint32_t slots[PROMPT], toks[PROMPT], pos[PROMPT], out = PROMPT, kv[2] = {0, 1};
    uint32_t emb_all[PROMPT + 2];
    for (uint32_t i = 0; i < PROMPT; i++) slots[i] = i, toks[i] = prompt_token(i), pos[i] = i;
    for (uint32_t i = 0; i < PROMPT + 2; i++) emb_all[i] = i;
    eng_forward_item it = {.kv_pages = kv,
                           .n_kv_pages = 2,
                           .kv_last_page_len = PROMPT - PAGE,
                           .append_kv = true,
                           .in_slots = slots,
                           .n_in = PROMPT,
                           .out_slots = &out,
                           .n_out = 1};
    static arena a;
    a.used = 0;
    uint32_t dslots[2] = {out, out}, dk[2] = {0, 10};
    float dt[2] = {0.0f, 0.7f};
    Pie__V1__Batch *b[4] = {
        b_slots(
            &a, 1,
            (slots_spec){
                .alloc_kv = kv, .n_alloc_kv = 2, .alloc_emb = emb_all, .n_alloc_emb = PROMPT + 2}),
        b_embed(&a, 2, slots, toks, pos, PROMPT),
        b_forward(&a, 3, &it, 1),
        b_next_dist(&a, 4, dslots, dk, dt, 2),
    };
    send_step(f, b, 4);
    pie_status st;
    alloc_pages(e, kv, 2);
    cr_assert_eq(eng_embed_text(e, slots, toks, pos, PROMPT, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(e, &it, 1, &st), PIE_OK, "%s", st.msg);

    Pie__V1__WorkerUp *up = expect_results(f, w, b, 4);
    assert_batch_ok(up->results[0], 0);
    assert_batch_ok(up->results[1], 0);
    assert_batch_ok(up->results[2], 0);
    assert_batch_ok(up->results[3], 2);
    const Pie__V1__BatchResult *nd = up->results[3];
    cr_assert_eq(nd->items[0]->code, 0, "%s", nd->items[0]->message);
    cr_assert_eq(nd->items[1]->code, 0, "%s", nd->items[1]->message);
    static direct_dist want[2];
    uint32_t wk[2] = {256, 10}; /* the defaults resolved: k 0 → 256, t 0 → 1 */
    float wt[2] = {1.0f, 0.7f};
    engine_dists(e, dslots, wk, wt, 2, want);
    assert_dist_equal(&want[0], nd->items[0]->distribution, "k=0, t=0");
    assert_dist_equal(&want[1], nd->items[1]->distribution, "k=10, t=0.7");
    rpc_msg_free(&up->base);
}

Test(worker_link, prompt_distributions_over_the_link_equal_the_engines) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    link_up(&f, w, 1);
    eng *e = open_engine();
    prompt_step(&f, w, e);
    eng_close(e);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* engine.kv_dtype bf16 reaches the engine: the distributions are a bf16-KV engine's, bit for
 * bit (an f32 pool's differ from them). */
Test(worker_link, a_bf16_kv_worker_serves_what_a_bf16_kv_engine_serves) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_ENGINE_KV_DTYPE=bf16", NULL};
    pie_proc *w = start_worker(&f, &(wopts){.env = env});
    link_up(&f, w, 1);
    eng *e = open_engine_kv(MODEL_DIR, KV_PAGES, ENG_KV_BF16);
    prompt_step(&f, w, e);
    eng_close(e);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, greedy_generation_of_16_tokens_over_the_link_equals_the_engine) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    link_up(&f, w, 1);
    eng *e = open_engine();
    prompt_step(&f, w, e);

    /* Greedy from the prompt: the link's argmax and the engine's must agree at every step. */
    uint32_t out = PROMPT, in = PROMPT + 1, kv[3] = {0, 1, 2}, n_pages = 2, len = PROMPT;
    uint32_t got[16], want[16];
    uint32_t k1 = 1;
    float t1 = 1.0f;
    pie_status st;
    for (int s = 0; s < 16; s++) {
        static arena a;
        a.used = 0;
        /* the next token: argmax of the last output, over the link and directly */
        uint32_t id_direct;
        float p_direct;
        eng_dist_item di = {
            .slot = out, .top_k = 1, .temperature = 1.0f, .ids = &id_direct, .probs = &p_direct};
        cr_assert_eq(eng_next_dist(e, &di, 1, &st), PIE_OK, "%s", st.msg);
        want[s] = id_direct;
        Pie__V1__Batch *b[4];
        size_t nb = 0;
        if (len == n_pages * PAGE) {
            uint32_t page = n_pages;
            b[nb++] = b_slots(&a, 100 + 10 * (uint64_t)s,
                              (slots_spec){.alloc_kv = &page, .n_alloc_kv = 1});
            alloc_pages(e, &page, 1);
            n_pages++;
        }
        b[nb++] = b_next_dist(&a, 101 + 10 * (uint64_t)s, &out, &k1, &t1, 1);
        send_step(&f, b, nb);
        Pie__V1__WorkerUp *up = expect_results(&f, w, b, nb);
        const Pie__V1__BatchResult *nd = up->results[nb - 1];
        assert_batch_ok(nd, 1);
        cr_assert_eq(nd->items[0]->code, 0, "%s", nd->items[0]->message);
        got[s] = nd->items[0]->distribution->token_ids[0];
        cr_assert(nd->items[0]->distribution->probs[0] == p_direct,
                  "step %d: p(argmax) %.9g over the link, %.9g direct", s,
                  (double)nd->items[0]->distribution->probs[0], (double)p_direct);
        rpc_msg_free(&up->base);
        cr_assert_eq(got[s], want[s], "step %d: token %u over the link, %u direct", s, got[s],
                     want[s]);

        /* embed it at position len and run one decode step: one message, three batches */
        a.used = 0;
        uint32_t tokv = got[s], posv = len;
        len++;
        eng_forward_item it = {.kv_pages = kv,
                               .n_kv_pages = n_pages,
                               .kv_last_page_len = len - (n_pages - 1) * PAGE,
                               .append_kv = true,
                               .in_slots = &in,
                               .n_in = 1,
                               .out_slots = &out,
                               .n_out = 1};
        Pie__V1__Batch *d[2] = {b_embed(&a, 102 + 10 * (uint64_t)s, &in, &tokv, &posv, 1),
                                b_forward(&a, 103 + 10 * (uint64_t)s, &it, 1)};
        send_step(&f, d, 2);
        cr_assert_eq(eng_embed_text(e, &in, &tokv, &posv, 1, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(eng_forward(e, &it, 1, &st), PIE_OK, "%s", st.msg);
        up = expect_results(&f, w, d, 2);
        assert_batch_ok(up->results[0], 0);
        assert_batch_ok(up->results[1], 0);
        rpc_msg_free(&up->base);
    }
    cr_log_info("greedy tokens: %u %u %u %u ...", got[0], got[1], got[2], got[3]);
    eng_close(e);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, copy_mask_and_slot_batches_match_the_engine_and_a_reused_page_starts_unmasked) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    link_up(&f, w, 1);
    eng *e = open_engine();
    prompt_step(&f, w, e); /* pages 0, 1 hold 20 tokens */

    /* Copy page 0 into page 2, hide token 3 of the copy, and decode one token over [2, 1]. */
    static arena a;
    a.used = 0;
    uint32_t page2 = 2, in = PROMPT + 1, out = PROMPT, tokv = 42, posv = PROMPT;
    uint32_t ctx[2] = {2, 1};
    bool masked[PAGE] = {false};
    masked[3] = true;
    eng_copy_item cp = {.src = 0, .dst = 2, .src_off = 0, .dst_off = 0, .count = PAGE};
    eng_forward_item it = {.kv_pages = ctx,
                           .n_kv_pages = 2,
                           .kv_last_page_len = PROMPT - PAGE,
                           .append_kv = false,
                           .in_slots = &in,
                           .n_in = 1,
                           .out_slots = &out,
                           .n_out = 1};
    uint32_t k = 16;
    float t = 1.0f;
    Pie__V1__Batch *b[6] = {
        b_slots(&a, 11, (slots_spec){.alloc_kv = &page2, .n_alloc_kv = 1}),
        b_copy(&a, 12, &cp),
        b_mask(&a, 13, 2, masked, PAGE),
        b_embed(&a, 14, &in, &tokv, &posv, 1),
        b_forward(&a, 15, &it, 1),
        b_next_dist(&a, 16, &out, &k, &t, 1),
    };
    send_step(&f, b, 6);
    pie_status st;
    alloc_pages(e, &page2, 1);
    cr_assert_eq(eng_copy_pages(e, &cp, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_mask_page(e, 2, masked, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_embed_text(e, &in, &tokv, &posv, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(e, &it, 1, &st), PIE_OK, "%s", st.msg);
    Pie__V1__WorkerUp *up = expect_results(&f, w, b, 6);
    for (int i = 0; i < 5; i++) assert_batch_ok(up->results[i], 0);
    assert_batch_ok(up->results[5], 1);
    const Pie__V1__Distribution *masked_dist = up->results[5]->items[0]->distribution;
    static direct_dist want;
    engine_dists(e, &out, &k, &t, 1, &want);
    assert_dist_equal(&want, masked_dist, "masked copy");
    float p_masked[16];
    memcpy(p_masked, masked_dist->probs, sizeof p_masked);
    rpc_msg_free(&up->base);

    /* Free page 2 and allocate it again in one SlotBatch (frees first), then copy only tokens
     * 0..2 over it: token 3 is zeroed by the allocation, and visible again only if the
     * allocation cleared the mask. */
    a.used = 0;
    cp.count = 3;
    Pie__V1__Batch *c[5] = {
        b_slots(
            &a, 21,
            (slots_spec){.free_kv = &page2, .n_free_kv = 1, .alloc_kv = &page2, .n_alloc_kv = 1}),
        b_copy(&a, 22, &cp),
        b_embed(&a, 23, &in, &tokv, &posv, 1),
        b_forward(&a, 24, &it, 1),
        b_next_dist(&a, 25, &out, &k, &t, 1),
    };
    send_step(&f, c, 5);
    alloc_pages(e, &page2, 1);
    cr_assert_eq(eng_copy_pages(e, &cp, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_embed_text(e, &in, &tokv, &posv, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(e, &it, 1, &st), PIE_OK, "%s", st.msg);
    up = expect_results(&f, w, c, 5);
    for (int i = 0; i < 4; i++) assert_batch_ok(up->results[i], 0);
    assert_batch_ok(up->results[4], 1);
    const Pie__V1__Distribution *clear_dist = up->results[4]->items[0]->distribution;
    engine_dists(e, &out, &k, &t, 1, &want);
    assert_dist_equal(&want, clear_dist, "reallocated page");
    cr_assert(memcmp(p_masked, clear_dist->probs, sizeof p_masked) != 0,
              "hiding token 3 did not change the distribution: the test proves nothing");
    rpc_msg_free(&up->base);
    eng_close(e);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, a_reallocated_page_and_embedding_slot_hold_nothing_of_their_previous_use) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    link_up(&f, w, 1);
    eng *e = open_engine();
    prompt_step(&f, w, e); /* page 0 holds prompt tokens 0..15, slot PROMPT the output state */

    /* Page 0 and slot PROMPT freed and allocated again (another owner, for the controller);
     * next_dist on the slot before anything wrote it, then token 42 at position 16 over page 0
     * as a full context, its state into the slot. */
    static arena a;
    a.used = 0;
    uint32_t page = 0, slot = PROMPT, in = PROMPT + 1, tokv = 42, posv = PAGE, k = 8;
    float t = 1.0f;
    eng_forward_item it = {.kv_pages = &page,
                           .n_kv_pages = 1,
                           .kv_last_page_len = PAGE,
                           .append_kv = false,
                           .in_slots = &in,
                           .n_in = 1,
                           .out_slots = &slot,
                           .n_out = 1};
    Pie__V1__Batch *b[5] = {
        b_slots(&a, 31,
                (slots_spec){.free_kv = &page,
                             .n_free_kv = 1,
                             .alloc_kv = &page,
                             .n_alloc_kv = 1,
                             .free_emb = &slot,
                             .n_free_emb = 1,
                             .alloc_emb = &slot,
                             .n_alloc_emb = 1}),
        b_next_dist(&a, 32, &slot, &k, &t, 1),
        b_embed(&a, 33, &in, &tokv, &posv, 1),
        b_forward(&a, 34, &it, 1),
        b_next_dist(&a, 35, &slot, &k, &t, 1),
    };
    send_step(&f, b, 5);
    Pie__V1__WorkerUp *up = expect_results(&f, w, b, 5);
    for (int i = 0; i < 5; i++) assert_batch_ok(up->results[i], i == 1 || i == 4 ? 1 : 0);

    /* What storage nobody ever wrote gives: a fresh engine's (its pools start zeroed). */
    eng *fresh = open_engine();
    static direct_dist want;
    engine_dists(fresh, &slot, &k, &t, 1, &want);
    assert_dist_equal(&want, up->results[1]->items[0]->distribution,
                      "next_dist of a reallocated embedding slot");
    pie_status st;
    cr_assert_eq(eng_embed_text(fresh, &in, &tokv, &posv, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(fresh, &it, 1, &st), PIE_OK, "%s", st.msg);
    engine_dists(fresh, &slot, &k, &t, 1, &want);
    assert_dist_equal(&want, up->results[4]->items[0]->distribution,
                      "a forward over a reallocated page");
    rpc_msg_free(&up->base);
    eng_close(fresh);
    eng_close(e);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* ---- tests: errors ------------------------------------------------------------------------------
 */

static void assert_item(const Pie__V1__BatchResult *r, size_t i, pie_code code, const char *text) {
    cr_assert_lt(i, r->n_items, "batch %llu: no item result %zu (it has %zu)",
                 (unsigned long long)r->batch_id, i, r->n_items);
    const Pie__V1__ItemResult *it = r->items[i];
    cr_assert_eq(it->code, (uint32_t)code, "batch %llu item %zu: %s (%s), not %s",
                 (unsigned long long)r->batch_id, i, pie_code_name((int)it->code), it->message,
                 pie_code_name(code));
    if (text)
        cr_assert_str_eq(it->message, text, "batch %llu item %zu", (unsigned long long)r->batch_id,
                         i);
    else
        cr_assert_str_empty(it->message);
}

static void assert_batch_failed(const Pie__V1__BatchResult *r, pie_code code, const char *text) {
    cr_assert_eq(r->code, (uint32_t)code, "batch %llu: %s (%s), not %s",
                 (unsigned long long)r->batch_id, pie_code_name((int)r->code), r->message,
                 pie_code_name(code));
    cr_assert_str_eq(r->message, text, "batch %llu", (unsigned long long)r->batch_id);
    cr_assert_eq(r->n_items, 0, "a failed batch carries %zu item results", r->n_items);
}

Test(worker_link, invalid_slot_ids_fail_their_item_or_batch_and_the_worker_serves_on) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    link_up(&f, w, 1);
    static arena a;
    uint32_t kv0 = 0, emb01[2] = {0, 1};
    uint32_t es[4] = {0, 9999, 1, 5}, et[4] = {1, 2, 3, 4}, ep[4] = {0, 1, 2, 3};
    uint32_t ds[3] = {1, 77777, 1}, dk[3] = {4, 4, 100000};
    float dt[3] = {1.0f, 1.0f, 1.0f};
    uint32_t bad_kv[2] = {0, 3}, in0 = 0, out1 = 1;
    eng_forward_item fi[2] = {
        {.kv_pages = bad_kv,
         .n_kv_pages = 2,
         .kv_last_page_len = 1,
         .append_kv = false,
         .in_slots = &in0,
         .n_in = 1},
        {.kv_pages = &kv0,
         .n_kv_pages = 1,
         .kv_last_page_len = 1,
         .append_kv = false,
         .in_slots = &in0,
         .n_in = 1,
         .out_slots = &out1,
         .n_out = 1},
    };
    uint32_t unalloc = 5, short_pos[1] = {0};
    Pie__V1__Batch *b[8];
    b[0] = b_slots(
        &a, 1,
        (slots_spec){.alloc_kv = &kv0, .n_alloc_kv = 1, .alloc_emb = emb01, .n_alloc_emb = 2});
    b[1] = b_embed(&a, 2, es, et, ep, 4);
    b[2] = b_next_dist(&a, 3, ds, dk, dt, 3);
    b[3] = b_slots(&a, 4, (slots_spec){.free_kv = &unalloc, .n_free_kv = 1});
    b[4] = b_new(&a, 5); /* no kind */
    b[5] = b_forward(&a, 6, fi, 2);
    b[6] = b_embed(&a, 7, es, et, short_pos, 1);
    b[6]->embed_text->n_token_ids = 2; /* lists of different lengths */
    b[6]->embed_text->token_ids = et;
    b[7] = b_slots(&a, 8, (slots_spec){.alloc_kv = &kv0, .n_alloc_kv = 1});
    send_step(&f, b, 8);
    Pie__V1__WorkerUp *up = expect_results(&f, w, b, 8);
    assert_batch_ok(up->results[0], 0);

    const Pie__V1__BatchResult *r = up->results[1];
    assert_batch_ok(r, 4);
    assert_item(r, 0, PIE_OK, NULL);
    assert_item(r, 1, PIE_INVALID_ARGUMENT,
                "embed_text: item 1: embed slot 9999 is out of range [0, 256)");
    assert_item(r, 2, PIE_OK, NULL);
    assert_item(r, 3, PIE_INVALID_ARGUMENT, "embed_text: item 3: embed slot 5 is not allocated");

    r = up->results[2];
    assert_batch_ok(r, 3);
    assert_item(r, 0, PIE_OK, NULL);
    cr_assert(r->items[0]->distribution && r->items[0]->distribution->n_token_ids == 4);
    assert_item(r, 1, PIE_INVALID_ARGUMENT,
                "next_dist: item 1: embed slot 77777 is out of range [0, 256)");
    cr_assert_null(r->items[1]->distribution);
    assert_item(r, 2, PIE_INVALID_ARGUMENT,
                "next_dist: item 2: top_k 100000 is out of range [1, 512]");

    assert_batch_failed(up->results[3], PIE_INVALID_ARGUMENT,
                        "slots: free_kv_slots[0] = 5 is not allocated");
    assert_batch_failed(up->results[4], PIE_UNIMPLEMENTED,
                        "batch 5: no kind this worker knows (slots, embed_text, forward, "
                        "mask_page, copy_page, next_dist)");
    r = up->results[5];
    assert_batch_ok(r, 2);
    assert_item(r, 0, PIE_INVALID_ARGUMENT, "forward: item 0: kv_slots[1] = 3 is not allocated");
    assert_item(r, 1, PIE_OK, NULL);
    assert_batch_failed(up->results[6], PIE_INVALID_ARGUMENT,
                        "embed_text: embed_slots, token_ids and positions have 1, 2 and 1 "
                        "entries; they must be equal");
    assert_batch_failed(up->results[7], PIE_INVALID_ARGUMENT,
                        "slots: alloc_kv_slots[0] = 0 is already allocated");
    rpc_msg_free(&up->base);

    /* The worker serves on: a valid step runs, and the failed SlotBatch changed nothing. */
    a.used = 0;
    uint32_t k4 = 4;
    float t1 = 1.0f;
    Pie__V1__Batch *c[2] = {b_next_dist(&a, 9, &emb01[1], &k4, &t1, 1),
                            b_slots(&a, 10, (slots_spec){.free_kv = &kv0, .n_free_kv = 1})};
    send_step(&f, c, 2);
    up = expect_results(&f, w, c, 2);
    assert_batch_ok(up->results[0], 1);
    assert_item(up->results[0], 0, PIE_OK, NULL);
    assert_batch_ok(up->results[1], 0);
    rpc_msg_free(&up->base);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* ---- tests: credits, heartbeat, link loss, drain ------------------------------------------------
 */

Test(worker_link, credits_are_granted_after_registering_and_returned_one_per_step) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, &(wopts){.credits = "3"});
    link_up(&f, w, 3);
    /* Three steps at once (the grant allows it), two batches each: three answers, in order,
     * each with both results and one credit. */
    static arena a;
    uint32_t emb[3] = {0, 1, 2}, tk[3] = {5, 6, 7}, pos[3] = {0, 1, 2};
    Pie__V1__Batch *steps[3][2];
    for (int s = 0; s < 3; s++) {
        steps[s][0] =
            b_slots(&a, 10 * (uint64_t)s + 1, (slots_spec){.alloc_emb = &emb[s], .n_alloc_emb = 1});
        steps[s][1] = b_embed(&a, 10 * (uint64_t)s + 2, &emb[s], &tk[s], &pos[s], 1);
    }
    for (int s = 0; s < 3; s++) send_step(&f, steps[s], 2);
    for (int s = 0; s < 3; s++) {
        Pie__V1__WorkerUp *up = expect_results(&f, w, steps[s], 2);
        assert_batch_ok(up->results[0], 0);
        assert_batch_ok(up->results[1], 0);
        rpc_msg_free(&up->base);
    }
    /* A Drain without shutdown uses no credit and gets no answer; the worker stays linked. */
    Pie__V1__Drain dr = PIE__V1__DRAIN__INIT;
    dr.reason = "test";
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.drain = &dr;
    fc_send(&f, &down);
    Pie__V1__WorkerUp *none = fc_recv_opt(&f, 300, false);
    cr_assert_null(none, "a Drain without batches was answered (credits %u, %zu results)",
                   none ? none->credits : 0, none ? none->n_results : 0);
    cr_assert(pie_proc_wait_log(w, "event=wrk.link.drain shutdown=0", 1, WAIT_MS));
    a.used = 0;
    uint32_t k = 3;
    float t = 1.0f;
    Pie__V1__Batch *d[1] = {b_next_dist(&a, 40, &emb[0], &k, &t, 1)};
    send_step(&f, d, 1);
    Pie__V1__WorkerUp *up = expect_results(&f, w, d, 1);
    assert_batch_ok(up->results[0], 1);
    rpc_msg_free(&up->base);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, results_larger_than_max_message_are_split_at_batch_boundaries) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, &(wopts){.max_message = "2KiB"});
    link_up(&f, w, 1);
    /* Three next_dist results of k = 150 (about 900 bytes each) do not fit in one 2 KiB
     * message with the rest; one of k = 400 (about 2.4 KB) fits in none and is replaced by its
     * failure. */
    static arena a;
    uint32_t emb[2] = {0, 1}, tk[2] = {5, 6}, pos[2] = {0, 1}, k150 = 150, k400 = 400;
    float t = 1.0f;
    Pie__V1__Batch *b[6] = {
        b_slots(&a, 1, (slots_spec){.alloc_emb = emb, .n_alloc_emb = 2}),
        b_embed(&a, 2, emb, tk, pos, 2),
        b_next_dist(&a, 3, &emb[0], &k150, &t, 1),
        b_next_dist(&a, 4, &emb[1], &k150, &t, 1),
        b_next_dist(&a, 5, &emb[0], &k150, &t, 1),
        b_next_dist(&a, 6, &emb[1], &k400, &t, 1),
    };
    send_step(&f, b, 6);
    uint64_t next_id = 1;
    int messages = 0;
    while (next_id <= 6) {
        Pie__V1__WorkerUp *up = fc_recv(&f, w);
        messages++;
        cr_assert_gt(up->n_results, 0, "a part without results");
        for (size_t i = 0; i < up->n_results; i++, next_id++) {
            const Pie__V1__BatchResult *r = up->results[i];
            cr_assert_eq(r->batch_id, next_id, "result for batch %llu where %llu was due",
                         (unsigned long long)r->batch_id, (unsigned long long)next_id);
            if (next_id == 6)
                cr_assert_eq(r->code, PIE_RESOURCE_EXHAUSTED, "the oversize result: %s %s",
                             pie_code_name((int)r->code), r->message);
            else
                assert_batch_ok(r, next_id >= 3 ? 1 : 0);
        }
        cr_assert_eq(up->credits, next_id > 6 ? 1u : 0u, "credits %u in part %d", up->credits,
                     messages);
        rpc_msg_free(&up->base);
    }
    cr_assert_geq(messages, 3, "six results of about 5 KB in %d messages of 2 KiB", messages);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, stats_arrive_every_heartbeat_and_count_batches_and_live_pages) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    Pie__V1__WorkerUp *reg = expect_registration(&f, w, 1);
    rpc_msg_free(&reg->base);
    send_registered(&f, 1, 50);
    expect_credits(&f, w, 1);
    static arena a;
    uint32_t kv[3] = {4, 5, 6};
    Pie__V1__Batch *b[1] = {b_slots(&a, 1, (slots_spec){.alloc_kv = kv, .n_alloc_kv = 3})};
    send_step(&f, b, 1);
    Pie__V1__WorkerUp *up = expect_results(&f, w, b, 1);
    rpc_msg_free(&up->base);
    /* heartbeat_ms 50 is adopted: the worker logs the period its heartbeat thread now uses
     * (read, not timed: counting beats per second of wall time flakes on a loaded machine). */
    cr_assert(pie_proc_wait_log(w, "controller_version=pie-c/0.1.0 heartbeat_ms=50\n", 1, WAIT_MS),
              "the worker did not adopt heartbeat_ms 50");
    int beats = 0;
    while (beats < 10) {
        up = fc_recv_opt(&f, WAIT_MS, true);
        cr_assert(up, "only %d heartbeats in %d ms", beats, WAIT_MS);
        cr_assert(stats_only(up), "unexpected WorkerUp between heartbeats");
        cr_assert_eq(up->stats->batches, 1, "stats.batches %llu",
                     (unsigned long long)up->stats->batches);
        cr_assert_eq(up->stats->kv_pages_on_device, 3);
        cr_assert_gt(up->stats->device_memory_bytes, 0);
        rpc_msg_free(&up->base);
        beats++;
    }
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, after_the_link_drops_the_worker_reregisters_with_all_slots_free) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    link_up(&f, w, 1);
    static arena a;
    uint32_t emb = 3, tk = 9, pos = 0;
    Pie__V1__Batch *b[1] = {b_slots(&a, 1, (slots_spec){.alloc_emb = &emb, .n_alloc_emb = 1})};
    send_step(&f, b, 1);
    Pie__V1__WorkerUp *up = expect_results(&f, w, b, 1);
    rpc_msg_free(&up->base);

    fc_drop(&f);
    Pie__V1__WorkerUp *reg = expect_registration(&f, w, 2);
    cr_assert_str_eq(reg->registration->model->name, "tiny-f32");
    cr_assert_str_eq(reg->registration->group_id, "test-worker");
    rpc_msg_free(&reg->base);
    send_registered(&f, 2, 60000);
    expect_credits(&f, w, 1);

    a.used = 0;
    Pie__V1__Batch *c[1] = {b_embed(&a, 1, &emb, &tk, &pos, 1)};
    send_step(&f, c, 1);
    up = expect_results(&f, w, c, 1);
    assert_batch_ok(up->results[0], 1);
    assert_item(up->results[0], 0, PIE_INVALID_ARGUMENT,
                "embed_text: item 0: embed slot 3 is not allocated");
    rpc_msg_free(&up->base);
    cr_assert_eq(pie_proc_log_count(w, "event=wrk.loaded "), 1, "the engine was loaded again");
    cr_assert_eq(pie_proc_log_count(w, "event=wrk.link.lost "), 1);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, drain_with_shutdown_answers_the_step_before_it_then_exits_0) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, NULL);
    link_up(&f, w, 1);
    static arena a;
    uint32_t emb = 0;
    Pie__V1__Batch *b[1] = {b_slots(&a, 1, (slots_spec){.alloc_emb = &emb, .n_alloc_emb = 1})};
    Pie__V1__Drain dr = PIE__V1__DRAIN__INIT;
    dr.shutdown = true;
    dr.reason = "scale down";
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.n_batches = 1;
    down.batches = b;
    down.drain = &dr;
    fc_send(&f, &down);
    Pie__V1__WorkerUp *up = expect_results(&f, w, b, 1);
    assert_batch_ok(up->results[0], 0);
    rpc_msg_free(&up->base);
    pie_status st;
    int rc = pie_proc_wait(w, STOP_MS, &st);
    cr_assert_eq(rc, 0, "after Drain{shutdown} the worker exited %d: %s", rc, st.msg);
    cr_assert(pie_proc_log_count(w, "event=wrk.drain.shutdown reason=\"scale down\"") == 1);
    pie_proc_destroy(w);
    fc_stop(&f);
}

/* ---- tests: backends and start-up --------------------------------------------------------------
 */

Test(worker_link, null_backend_registers_without_a_model_and_answers_at_once) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, &(wopts){.backend = "null", .model_path = ""});
    Pie__V1__WorkerUp *reg = expect_registration(&f, w, 1);
    const Pie__V1__ModelInfo *m = reg->registration->model;
    cr_assert_str_eq(m->name, "null");
    cr_assert_eq(m->vocab_size, 32000);
    cr_assert_eq(m->kv_page_size, PAGE);
    cr_assert_eq(m->max_top_k, 1024);
    rpc_msg_free(&reg->base);
    send_registered(&f, 1, 60000);
    expect_credits(&f, w, 1);

    static arena a;
    uint32_t kv = 0, emb[2] = {0, 1}, tk = 31999, pos = 0, out = 1, k = 5;
    float t = 1.0f;
    eng_forward_item it = {.kv_pages = &kv,
                           .n_kv_pages = 1,
                           .kv_last_page_len = 1,
                           .append_kv = true,
                           .in_slots = &emb[0],
                           .n_in = 1,
                           .out_slots = &out,
                           .n_out = 1};
    Pie__V1__Batch *b[4] = {
        b_slots(&a, 1,
                (slots_spec){.alloc_kv = &kv, .n_alloc_kv = 1, .alloc_emb = emb, .n_alloc_emb = 2}),
        b_embed(&a, 2, &emb[0], &tk, &pos, 1),
        b_forward(&a, 3, &it, 1),
        b_next_dist(&a, 4, &out, &k, &t, 1),
    };
    send_step(&f, b, 4);
    Pie__V1__WorkerUp *up = expect_results(&f, w, b, 4);
    for (int i = 0; i < 3; i++) assert_batch_ok(up->results[i], 0);
    assert_batch_ok(up->results[3], 1);
    const Pie__V1__Distribution *d = up->results[3]->items[0]->distribution;
    cr_assert(d && d->n_token_ids == 5 && d->n_probs == 5);
    float sum = 0;
    for (uint32_t i = 0; i < 5; i++) {
        cr_assert_eq(d->token_ids[i], i);
        if (i > 0) cr_assert_lt(d->probs[i], d->probs[i - 1], "probabilities must descend");
        sum += d->probs[i];
    }
    cr_assert(sum > 0 && sum <= 1.0f, "probabilities sum to %g", (double)sum);
    rpc_msg_free(&up->base);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* A worker whose load fails: NOT_SERVING, Info FAILED with code and message, never dials the
 * controller, exits 1 on SIGTERM. */
static void assert_load_fails(const wopts *o, pie_code code, const char *text) {
    fc f;
    fc_start(&f);
    int port = pie_proc_free_port();
    cr_assert_gt(port, 0);
    char listen[64];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    wopts wo = *o;
    wo.listen = listen;
    pie_proc *w = spawn_worker(&f, &wo);
    cr_assert(pie_proc_wait_log(w, "event=wrk.load_failed", 1, START_MS),
              "no wrk.load_failed in the log");
    pie_status st;
    rpc_channel *ch = rpc_channel_create(listen, NULL, &st);
    cr_assert(ch, "%s", st.msg);
    rpc_health_status hs;
    cr_assert_eq(rpc_health_check(ch, "", WAIT_MS, &hs, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(hs, RPC_HEALTH_NOT_SERVING, "health %d after a failed load", (int)hs);
    Pie__V1__InfoRequest ireq = PIE__V1__INFO_REQUEST__INIT;
    Pie__V1__InfoResponse *info = NULL;
    rpc_call_opts co = {.timeout_ms = WAIT_MS};
    cr_assert_eq(rpc_unary(ch, "/pie.v1.Worker/Info", &ireq.base,
                           &pie__v1__info_response__descriptor, (ProtobufCMessage **)&info, &co,
                           &st),
                 PIE_OK, "Info: %s", st.msg);
    cr_assert_eq(info->state, PIE__V1__LOAD_STATE__LOAD_STATE_FAILED);
    cr_assert(info->status, "Info without status");
    cr_assert_eq(info->status->code, (uint32_t)code, "Info status %s: %s",
                 pie_code_name((int)info->status->code), info->status->message);
    cr_assert(strstr(info->status->message, text), "Info status message '%s' lacks '%s'",
              info->status->message, text);
    cr_assert_null(info->model, "Info reports a model after a failed load");
    cr_assert(!info->controller_linked);
    rpc_msg_free(&info->base);
    rpc_channel_destroy(ch);
    pthread_mutex_lock(&f.mu);
    int calls = f.calls;
    pthread_mutex_unlock(&f.mu);
    cr_assert_eq(calls, 0, "a worker that failed to load dialled the controller");
    stop_worker(w, 1);
    fc_stop(&f);
}

Test(worker_link, bad_model_path_leaves_the_worker_not_serving_with_state_failed) {
    assert_load_fails(&(wopts){.model_path = "/nonexistent/model-dir"}, PIE_NOT_FOUND,
                      "/nonexistent/model-dir");
}

/* Where no CUDA device exists the cuda backend fails the load: UNAVAILABLE in a worker built
 * with nvcc, UNIMPLEMENTED in one built without (-DPIE_CUDA=OFF). With a device the load
 * succeeds; tests/cuda cover that backend. */
Test(worker_link, backend_cuda_without_a_device_fails_the_load) {
    if (access("/dev/nvidiactl", F_OK) == 0)
        cr_skip_test("a CUDA device is present: the cuda backend loads (see tests/cuda)");
#if PIE_TEST_WORKER_HAS_CUDA
    assert_load_fails(&(wopts){.backend = "cuda"}, PIE_UNAVAILABLE, "backend cuda: no CUDA device");
#else
    assert_load_fails(
        &(wopts){.backend = "cuda"}, PIE_UNIMPLEMENTED,
        "backend cuda: not built into this worker (nvcc was not found at build time)");
#endif
}

/* ---- tests: the memory policy (issue 13) ------------------------------------------------------
 */

#define SWAP_MODEL PIE_MODELS_DIR "/small-f32" /* 4 layers */

/* One SlotBatch allocating pages 0..KV_PAGES-3 (into kv, KV_PAGES - 2 of them) and embed
 * slot 0 (*emb): nearly every page live, as an expansion epoch requires. */
static void alloc_nearly_all(fc *f, pie_proc *w, arena *a, uint32_t *kv, uint32_t *emb) {
    for (uint32_t i = 0; i < KV_PAGES - 2; i++) kv[i] = i;
    *emb = 0;
    a->used = 0;
    Pie__V1__Batch *sb[1] = {b_slots(
        a, 1,
        (slots_spec){
            .alloc_kv = kv, .n_alloc_kv = KV_PAGES - 2, .alloc_emb = emb, .n_alloc_emb = 1})};
    send_step(f, sb, 1);
    Pie__V1__WorkerUp *up = expect_results(f, w, sb, 1);
    assert_batch_ok(up->results[0], 0);
    rpc_msg_free(&up->base);
}

/* Step t of a decode into page kv[0]: token tk at position t into slot *emb, the page then
 * holding len tokens; asserts both batches' results. Returns the effective pages of a
 * CapacityChange that came before the results, 0 if none did. */
static uint32_t decode_in_page_0(fc *f, pie_proc *w, arena *a, const uint32_t *kv, uint32_t *emb,
                                 uint32_t t, uint32_t tk, uint32_t len) {
    a->used = 0;
    eng_forward_item it = {.kv_pages = kv,
                           .n_kv_pages = 1,
                           .kv_last_page_len = len,
                           .append_kv = true,
                           .in_slots = emb,
                           .n_in = 1,
                           .out_slots = emb,
                           .n_out = 1};
    Pie__V1__Batch *b[2] = {b_embed(a, 10 + 2 * t, emb, &tk, &t, 1),
                            b_forward(a, 11 + 2 * t, &it, 1)};
    send_step(f, b, 2);
    uint32_t capacity = 0;
    Pie__V1__WorkerUp *up = fc_recv(f, w);
    if (up->capacity) {
        capacity = up->capacity->kv_pages_effective;
        rpc_msg_free(&up->base);
        up = fc_recv(f, w);
    }
    cr_assert_eq(up->n_results, 2, "step %u: %zu results", t, up->n_results);
    assert_batch_ok(up->results[1], 0);
    rpc_msg_free(&up->base);
    return capacity;
}

/* A worker of SWAP_MODEL with memory policy `policy` (env): it registers the policy with
 * kv_pages_gpu = KV_PAGES, twice that as its maximum capacity and `effective` as its effective
 * capacity (`why`), and one prompt step over the link gives policy gpu's engine's distributions
 * bit for bit. Returns the registered worker. */
static pie_proc *policy_worker_serves_what_gpu_serves(fc *f, const char **env,
                                                      Pie__V1__MemoryPolicy policy,
                                                      uint32_t effective, const char *why) {
    pie_proc *w = start_worker(f, &(wopts){.model_path = SWAP_MODEL, .env = env});
    Pie__V1__WorkerUp *up = expect_registration(f, w, 1);
    const Pie__V1__WorkerRegistration *r = up->registration;
    cr_assert_eq(r->memory_policy, policy);
    cr_assert(r->capacity);
    cr_assert_eq(r->capacity->kv_pages_gpu, KV_PAGES);
    cr_assert_eq(r->capacity->kv_pages_effective, effective, "%s", why);
    cr_assert_eq(r->capacity->kv_pages_max, 2 * KV_PAGES);
    rpc_msg_free(&up->base);
    send_registered(f, 1, 100);
    expect_credits(f, w, 1);
    eng *e = open_engine_at(SWAP_MODEL, 2 * KV_PAGES);
    prompt_step(f, w, e);
    eng_close(e);
    return w;
}

/* memory.policy swap with 2 of small-f32's 4 layers on the device: the registration says SWAP
 * with twice policy gpu's pages as the effective capacity (kv_pages_gpu is what pool.kv_pages
 * of every layer take), and a prompt's distributions over the link are bit for bit those of
 * the engine without swapping (policy gpu) in this process. */
Test(worker_link, swap_policy_registers_its_capacities_and_serves_what_policy_gpu_serves) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=swap", "PIE_MEMORY_DEVICE_LAYERS=2",
                         "PIE_MEMORY_HOST_POOL=64MiB", "PIE_MEMORY_EMULATE_LINK_GBPS=16", NULL};
    pie_proc *w =
        policy_worker_serves_what_gpu_serves(&f, env, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP,
                                             2 * KV_PAGES, "4 layers / 2 on the device");
    /* the heartbeat's WorkerStats count the layers the forward swapped in and out */
    uint64_t in = 0, out = 0;
    for (int64_t end = pie_test_now_ms() + WAIT_MS; (in == 0 || out == 0) &&
                                                    pie_test_now_ms() < end;) {
        Pie__V1__WorkerUp *s = fc_recv_opt(&f, WAIT_MS, true);
        cr_assert(s, "no heartbeat");
        if (s->stats) in = s->stats->swap_in_bytes, out = s->stats->swap_out_bytes;
        rpc_msg_free(&s->base);
    }
    cr_assert(in > 0 && out > 0, "swap bytes in %llu, out %llu", (unsigned long long)in,
              (unsigned long long)out);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* Adaptive expansion (memory.device_layers 0): the worker starts with all 4 layers on the
 * device (effective = kv_pages_gpu = 64); after an epoch of 16 forward steps with nearly every
 * page allocated and no stall it moves one layer to the host and tells the controller the new
 * capacity, 64 * 4 / 3 = 85 pages, in a CapacityChange, before that step's results. The
 * decision is deterministic: with every layer on the device nothing moves, so the first epoch
 * cannot stall. */
Test(worker_link, swap_adaptive_expansion_grows_the_capacity_and_tells_the_controller) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=64MiB", NULL};
    pie_proc *w = start_worker(&f, &(wopts){.model_path = SWAP_MODEL, .env = env});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    cr_assert_eq(up->registration->capacity->kv_pages_effective, KV_PAGES);
    cr_assert_eq(up->registration->capacity->kv_pages_max, 2 * KV_PAGES, "down to 2 of 4 layers");
    rpc_msg_free(&up->base);
    send_registered(&f, 1, 60000);
    expect_credits(&f, w, 1);
    static arena a;
    uint32_t kv[KV_PAGES - 2], emb = 0;
    alloc_nearly_all(&f, w, &a, kv, &emb);
    uint32_t capacity = 0;
    for (uint32_t t = 0; t < 16; t++) { /* one decode token per step into page 0 */
        uint32_t changed = decode_in_page_0(&f, w, &a, kv, &emb, t, prompt_token(t), t + 1);
        if (changed) { /* sent before the results of the step that ended the epoch */
            capacity = changed;
            cr_assert_eq(t, 15, "a capacity change after step %u, not at the epoch's end", t);
        }
    }
    cr_assert_eq(capacity, KV_PAGES * 4 / 3, "CapacityChange to %u pages", capacity);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* The null backend's emulated device (issue 13): the null model's 32 layers of 131072-byte
 * pages (16 tokens x 8 KV heads x 128 x K,V x 4 bytes), 64 pages with every layer on the
 * device, layers of 20 us over a 400 Gb/s link. The worker runs the real policy code: it
 * registers SWAP with 64 effective pages of at most 1024 (2 layers on the device), grows by
 * one layer after the first epoch (CapacityChange to 64 * 32 / 31 = 66), and its swap counters
 * are exactly what the device model (mem/wrk_nulldev.h) run in this process on the same
 * 32 forward batches says. */
#define NULL_LAYER_BYTES 131072ull
Test(worker_link, null_backend_swap_runs_the_policy_on_the_emulated_device) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=8GiB",
                         "PIE_NULL_LAYER_US=20", "PIE_MEMORY_EMULATE_LINK_GBPS=400", NULL};
    pie_proc *w = start_worker(&f, &(wopts){.backend = "null", .model_path = "", .env = env});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    const Pie__V1__WorkerRegistration *r = up->registration;
    cr_assert_eq(r->memory_policy, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP);
    cr_assert_eq(r->capacity->kv_pages_gpu, KV_PAGES);
    cr_assert_eq(r->capacity->kv_pages_effective, KV_PAGES);
    cr_assert_eq(r->capacity->kv_pages_max, KV_PAGES * 32 / 2);
    rpc_msg_free(&up->base);
    send_registered(&f, 1, 100);
    expect_credits(&f, w, 1);
    static arena a;
    uint32_t kv[KV_PAGES - 2], emb = 0;
    alloc_nearly_all(&f, w, &a, kv, &emb);
    /* the same device in this process */
    wrk_nulldev_config dc = {.n_layers = 32,
                             .page_size = PAGE,
                             .layer_us = 20,
                             .link_bytes_per_s = 400e9 / 8,
                             .device_kv = KV_PAGES * 32 * NULL_LAYER_BYTES,
                             .slots = 32,
                             .min_slots = 2};
    pie_status st;
    wrk_nulldev *d = NULL;
    cr_assert_eq(wrk_nulldev_create(&dc, &d, &st), PIE_OK, "%s", st.msg);
    uint32_t capacity = 0;
    for (uint32_t t = 0; t < 32; t++) { /* one decode token per step into page 0 */
        uint32_t changed = decode_in_page_0(&f, w, &a, kv, &emb, t, t, t % PAGE + 1);
        if (changed && capacity == 0) {
            capacity = changed;
            cr_assert_eq(t, 15, "a capacity change after step %u, not at the epoch's end", t);
        }
        wrk_nulldev_forward(d, 1, t % PAGE + 1);
        if (t == 15) wrk_nulldev_set_slots(d, 31);
    }
    cr_assert_eq(capacity, KV_PAGES * 32 / 31, "CapacityChange to %u pages", capacity);
    wrk_nulldev_stats want;
    wrk_nulldev_get_stats(d, &want);
    wrk_nulldev_destroy(d);
    cr_assert_gt(want.swaps_in, 0, "the model moved nothing: the test proves nothing");
    uint64_t in = 0, out = 0;
    for (int64_t end = pie_test_now_ms() + WAIT_MS;
         (in != want.swap_in_bytes || out != want.swap_out_bytes) && pie_test_now_ms() < end;) {
        Pie__V1__WorkerUp *s = fc_recv_opt(&f, WAIT_MS, true);
        cr_assert(s, "no heartbeat");
        if (s->stats) in = s->stats->swap_in_bytes, out = s->stats->swap_out_bytes;
        rpc_msg_free(&s->base);
    }
    cr_assert_eq(in, want.swap_in_bytes, "swapped in %llu bytes, the model %llu",
                 (unsigned long long)in, (unsigned long long)want.swap_in_bytes);
    cr_assert_eq(out, want.swap_out_bytes, "swapped out %llu bytes, the model %llu",
                 (unsigned long long)out, (unsigned long long)want.swap_out_bytes);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* The null backend's emulated device under offload (issue 13, Neo): the null model's 32 layers
 * of 131072-byte pages (4 MiB a page of every layer), 16 MiB of device KV (4 pages) and a 240
 * MiB host pool (60 pages): the worker registers OFFLOAD with 4 device pages of 64. Eight
 * decodes over 2 pages each per step cannot all keep their KV on 4 device pages, so the real
 * load-aware scheduler (mem/wrk_offload.h through mem/wrk_offplace.h) moves some to the host
 * (forced) and attends them there; the worker's offload counters are exactly what the same
 * device model run in this process on the same batches says, and something did go to the
 * host. Costs at H100-like ratios (per layer: 20 us fixed, 0.2 us a token, device attention
 * 0.01 us a KV token, host attention 0.1 us a KV token), a 400 Gb/s link. */
#define OFF_ITEMS 8
#define OFF_STEPS 12
Test(worker_link, null_backend_offload_runs_the_scheduler_on_the_emulated_device) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=offload",     "PIE_MEMORY_DEVICE_KV=16MiB",
                         "PIE_MEMORY_HOST_POOL=240MiB",   "PIE_NULL_LAYER_US=20",
                         "PIE_NULL_LAYER_TOKEN_US=0.2",   "PIE_NULL_LAYER_KV_US=0.01",
                         "PIE_NULL_HOST_ATTN_KV_US=0.1",  "PIE_MEMORY_EMULATE_LINK_GBPS=400",
                         NULL};
    pie_proc *w = start_worker(&f, &(wopts){.backend = "null", .model_path = "", .env = env});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    const Pie__V1__WorkerRegistration *r = up->registration;
    cr_assert_eq(r->memory_policy, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD);
    cr_assert_eq(r->capacity->kv_pages_gpu, 4);
    cr_assert_eq(r->capacity->kv_pages_max, 64);
    rpc_msg_free(&up->base);
    send_registered(&f, 1, 100);
    expect_credits(&f, w, 1);
    static arena a;
    uint32_t kv[2 * OFF_ITEMS], emb[OFF_ITEMS];
    for (uint32_t i = 0; i < 2 * OFF_ITEMS; i++) kv[i] = i;
    for (uint32_t i = 0; i < OFF_ITEMS; i++) emb[i] = i;
    a.used = 0;
    Pie__V1__Batch *sb[1] = {b_slots(&a, 1,
                                     (slots_spec){.alloc_kv = kv,
                                                  .n_alloc_kv = 2 * OFF_ITEMS,
                                                  .alloc_emb = emb,
                                                  .n_alloc_emb = OFF_ITEMS})};
    send_step(&f, sb, 1);
    /* the worker offers the device's 4 pages until its scheduler estimates a gain: the
     * allocation spills past them (a CapacityChange first) */
    up = fc_recv(&f, w);
    cr_assert(up->capacity, "no CapacityChange before the results of the spilling SlotBatch");
    cr_assert_eq(up->capacity->kv_pages_effective, 2 * OFF_ITEMS);
    rpc_msg_free(&up->base);
    up = expect_results(&f, w, sb, 1);
    assert_batch_ok(up->results[0], 0);
    rpc_msg_free(&up->base);
    /* the same device in this process */
    wrk_nulldev_config dc = {.n_layers = 32,
                             .page_size = PAGE,
                             .layer_us = 20,
                             .layer_token_us = 0.2,
                             .layer_kv_us = 0.01,
                             .host_attn_kv_us = 0.1,
                             .link_bytes_per_s = 400e9 / 8,
                             .device_kv = 4 * 32 * NULL_LAYER_BYTES,
                             .offload_device_pages = 4,
                             .kv_pages = 64,
                             .page_layer_bytes = NULL_LAYER_BYTES,
                             .max_items = MAX_TOKENS};
    pie_status st;
    wrk_nulldev *d = NULL;
    cr_assert_eq(wrk_nulldev_create(&dc, &d, &st), PIE_OK, "%s", st.msg);
    for (uint32_t t = 0; t < OFF_STEPS; t++) { /* every sequence decodes one token a step */
        a.used = 0;
        eng_forward_item it[OFF_ITEMS];
        wrk_offplace_item mi[OFF_ITEMS];
        uint32_t toks[OFF_ITEMS], pos[OFF_ITEMS], len = t % PAGE + 1;
        for (uint32_t i = 0; i < OFF_ITEMS; i++) {
            toks[i] = i + t;
            pos[i] = PAGE + len - 1;
            it[i] = (eng_forward_item){.kv_pages = &kv[2 * i],
                                       .n_kv_pages = 2,
                                       .kv_last_page_len = len,
                                       .append_kv = true,
                                       .in_slots = &emb[i],
                                       .n_in = 1,
                                       .out_slots = &emb[i],
                                       .n_out = 1};
            mi[i] = (wrk_offplace_item){
                .pages = &kv[2 * i], .n_pages = 2, .ctx = PAGE + len - 1, .n_in = 1, .append = true};
        }
        Pie__V1__Batch *b[2] = {b_embed(&a, 10 + 2 * t, emb, toks, pos, OFF_ITEMS),
                                b_forward(&a, 11 + 2 * t, it, OFF_ITEMS)};
        send_step(&f, b, 2);
        up = fc_recv(&f, w);
        if (up->capacity) { /* offload's capacity may move; not what this test checks */
            rpc_msg_free(&up->base);
            up = fc_recv(&f, w);
        }
        cr_assert_eq(up->n_results, 2, "step %u: %zu results", t, up->n_results);
        assert_batch_ok(up->results[1], 0);
        rpc_msg_free(&up->base);
        wrk_nulldev_batch nb;
        cr_assert_eq(wrk_nulldev_forward_items(d, mi, OFF_ITEMS, &nb, &st), PIE_OK, "%s", st.msg);
    }
    wrk_nulldev_stats want;
    wrk_nulldev_get_stats(d, &want);
    wrk_nulldev_destroy(d);
    cr_assert_gt(want.host_items, 0, "the model attended nothing on the host: the test proves "
                                     "nothing");
    cr_assert_gt(want.place.forced_steps, 0, "the model was never forced");
    struct {
        const char *series;
        uint64_t want;
    } checks[] = {
        {"pie_worker_offload_host_instances_total", want.host_items},
        {"pie_worker_offload_steps_total{decision=\"two_sub_batches\"}", want.offload_steps},
        {"pie_worker_offload_steps_total{decision=\"forced\"}", want.place.forced_steps},
        {"pie_worker_offload_pages_moved_total{direction=\"to_host\"}", want.place.pages_to_host},
        {"pie_worker_offload_pages_moved_total{direction=\"to_device\"}",
         want.place.pages_to_device},
        {"pie_worker_offload_pages_on_host", want.place.pages_on_host},
    };
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        double got = 0;
        cr_assert_eq(pie_proc_metric(w, checks[i].series, &got, &st), PIE_OK, "%s", st.msg);
        cr_expect_eq((uint64_t)got, checks[i].want, "%s is %g, the model says %llu",
                     checks[i].series, got, (unsigned long long)checks[i].want);
    }
    stop_worker(w, 0);
    fc_stop(&f);
}

/* Spill (issue 13): the controller may allocate beyond kv_pages_effective, up to kv_pages_max,
 * instead of terminating an instance. The null swap worker (64 pages with all 32 layers on the
 * device) given 100 live pages moves to 20 layers on the device (64 * 32 / 20 = 102 pages: 21
 * would hold 97) and says so in a CapacityChange before the SlotBatch's results; forward
 * batches over the new pages run; compute then waits on swaps (12 layers of 13 MB over
 * 50 GB/s per 0.64 ms step), so adaptive expansion backs off one layer after its first epoch
 * (97 pages: fewer than the 100 live, which stay valid — the controller allocates no more
 * until enough are freed, or spills again), and the forward batches over page 99 go on. */
Test(worker_link, null_swap_worker_grows_its_capacity_when_the_controller_spills) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=8GiB",
                         "PIE_NULL_LAYER_US=20", "PIE_MEMORY_EMULATE_LINK_GBPS=400", NULL};
    pie_proc *w = start_worker(&f, &(wopts){.backend = "null", .model_path = "", .env = env});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    cr_assert_eq(up->registration->capacity->kv_pages_effective, KV_PAGES);
    rpc_msg_free(&up->base);
    send_registered(&f, 1, 60000);
    expect_credits(&f, w, 1);
    static arena a;
    uint32_t kv[100], emb = 0;
    for (uint32_t i = 0; i < 100; i++) kv[i] = i;
    a.used = 0;
    Pie__V1__Batch *sb[1] = {b_slots(
        &a, 1, (slots_spec){.alloc_kv = kv, .n_alloc_kv = 100, .alloc_emb = &emb, .n_alloc_emb = 1})};
    send_step(&f, sb, 1);
    up = fc_recv(&f, w);
    cr_assert(up->capacity, "no CapacityChange before the results of the spilling SlotBatch");
    cr_assert_eq(up->capacity->kv_pages_effective, KV_PAGES * 32 / 20);
    rpc_msg_free(&up->base);
    up = expect_results(&f, w, sb, 1);
    assert_batch_ok(up->results[0], 0);
    rpc_msg_free(&up->base);
    uint32_t shrunk = 0;
    for (uint32_t t = 0; t < 24; t++) { /* decode into page 99, the last one spilled */
        a.used = 0;
        uint32_t tk = t;
        eng_forward_item it = {.kv_pages = &kv[99], .n_kv_pages = 1,
                               .kv_last_page_len = t % PAGE + 1, .append_kv = true,
                               .in_slots = &emb, .n_in = 1, .out_slots = &emb, .n_out = 1};
        Pie__V1__Batch *b[2] = {b_embed(&a, 10 + 2 * t, &emb, &tk, &t, 1),
                                b_forward(&a, 11 + 2 * t, &it, 1)};
        send_step(&f, b, 2);
        up = fc_recv(&f, w);
        while (up->capacity) {
            shrunk = up->capacity->kv_pages_effective;
            rpc_msg_free(&up->base);
            up = fc_recv(&f, w);
        }
        cr_assert_eq(up->n_results, 2, "step %u: %zu results", t, up->n_results);
        assert_batch_ok(up->results[1], 0);
        rpc_msg_free(&up->base);
    }
    cr_assert_eq(shrunk, KV_PAGES * 32 / 21, "no back-off to 21 layers (last change: %u)", shrunk);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, swap_policy_with_a_host_pool_too_small_fails_the_load_saying_what_it_needs) {
    const char *env[] = {"PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=4KiB", NULL};
    assert_load_fails(&(wopts){.model_path = SWAP_MODEL, .env = env}, PIE_RESOURCE_EXHAUSTED,
                      "memory.host_pool 4096 bytes is too small: 4 layers with 4 on the device "
                      "need ");
}

/* Offload (issue 13, Neo): 64 device pages (pool.kv_pages) plus a 2 MiB host pool of 64 pages
 * of every layer (small-f32: 4 layers x 8 KiB): the controller may place on 128; a prompt's
 * distributions equal policy gpu's engine's; the log says the profiled costs. */
Test(worker_link, offload_policy_registers_device_plus_host_pages_and_serves_what_gpu_serves) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=offload", "PIE_MEMORY_HOST_POOL=2MiB", NULL};
    /* 64 device + 64 host pages, of which the controller is offered the device's until the
     * scheduler's estimate says host decodes pay (wrk_off_adapt, estimate mode) */
    pie_proc *w =
        policy_worker_serves_what_gpu_serves(&f, env, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD,
                                             KV_PAGES, "the device's pages until an estimate");
    cr_assert_eq(pie_proc_log_count(w, "wrk.mem.offload"), 1, "the offload line at load");
    stop_worker(w, 0);
    fc_stop(&f);
}

/* ---- deferral (issue 13: Neo's rule in the worker, ItemResult.deferred) ----------------- */

/* small-f32 with 2 device pages (64 KiB: 4 layers x 8 KiB a page), a 2 MiB host pool and the
 * scheduler's host attention cost pinned at a second per KV token: a decode whose KV is on the
 * host never hides behind device work, so beside any it is deferred (until its 9th offer). */
static const char *const defer_env[] = {
    "PIE_MEMORY_POLICY=offload",     "PIE_MEMORY_DEVICE_KV=64KiB",
    "PIE_MEMORY_HOST_POOL=2MiB",     "PIE_MEMORY_OFFLOAD_HOST_ATTN_US=1000000",
    "PIE_MEMORY_OFFLOAD_DEFER=true", NULL};

/* A next_dist batch whose items are each a call of their own (call_items all 1). */
static Pie__V1__Batch *b_next_dist_calls(arena *a, uint64_t id, const uint32_t *slots, size_t n) {
    uint32_t k[8], ones[8];
    float t[8];
    cr_assert_leq(n, 8);
    for (size_t i = 0; i < n; i++) k[i] = 8, t[i] = 1.0f, ones[i] = 1;
    Pie__V1__Batch *b = b_next_dist(a, id, slots, k, t, n);
    b->next_dist->call_items = acopy(a, ones, b->next_dist->n_call_items = n);
    return b;
}

/* Distributions of slots (top 8, t = 1) from the reference engine in one call, as the worker
 * computes one batch's, against the items of r (want_items: which of r's items). */
static void expect_dists(eng *e, const Pie__V1__BatchResult *r, const uint32_t *slots,
                         const size_t *want_items, size_t n, const char *what) {
    static direct_dist want[4];
    uint32_t k[4] = {8, 8, 8, 8};
    float t[4] = {1, 1, 1, 1};
    engine_dists(e, slots, k, t, n, want);
    for (size_t i = 0; i < n; i++) {
        const Pie__V1__ItemResult *it = r->items[want_items[i]];
        cr_assert_eq(it->code, 0, "%s: item %zu: %s", what, want_items[i], it->message);
        assert_dist_equal(&want[i], it->distribution, what);
    }
}

static void expect_deferred(const Pie__V1__BatchResult *r, size_t i, const char *what) {
    cr_assert_eq(r->code, 0, "%s: the batch failed: %s", what, r->message);
    cr_assert_gt(r->n_items, i, "%s: no item results", what);
    const Pie__V1__ItemResult *it = r->items[i];
    cr_assert(it->deferred, "%s: item %zu not deferred (code %u \"%s\")", what, i, it->code,
              it->message);
    cr_assert_eq(it->code, PIE_UNAVAILABLE, "%s", what);
    cr_assert_str_eq(it->message, "deferred", "%s", what);
    cr_assert_null(it->distribution, "%s", what);
}

/* expect_results, after any CapacityChange the step's slot batch caused (allocating past the
 * effective capacity spills: the worker grows it and says so first). */
static Pie__V1__WorkerUp *results_past_capacity(fc *f, const pie_proc *w, Pie__V1__Batch **b,
                                                size_t n) {
    Pie__V1__WorkerUp *up = fc_recv(f, w);
    while (up->capacity && up->n_results == 0) {
        rpc_msg_free(&up->base);
        up = fc_recv(f, w);
    }
    cr_assert_eq(up->n_results, n, "a step of %zu batches came back as %zu results", n,
                 up->n_results);
    for (size_t i = 0; i < n; i++) cr_assert_eq(up->results[i]->batch_id, b[i]->batch_id);
    return up;
}

static double metric(const pie_proc *w, const char *series) {
    double v = -1;
    pie_status st;
    cr_assert_eq(pie_proc_metric(w, series, &v, &st), PIE_OK, "%s: %s", series, st.msg);
    return v;
}

/* A's and B's KV pages in every deferral step. */
static const uint32_t pages_of_a[2] = {0, 1}, pages_of_b[2] = {2, 3};

/* A forward item of one token (embedding *in) over n_pages pages whose last holds
 * last_page_len tokens with it (append: the item writes its K/V there), its output into *out. */
static eng_forward_item token_item(const uint32_t *pages, uint32_t n_pages, uint32_t last_page_len,
                                   bool append, const uint32_t *in, const uint32_t *out) {
    return (eng_forward_item){.kv_pages = pages,
                              .n_kv_pages = n_pages,
                              .kv_last_page_len = last_page_len,
                              .append_kv = append,
                              .in_slots = in,
                              .n_in = 1,
                              .out_slots = out,
                              .n_out = 1};
}

/* d <- the decodes of A (in[0] -> out[0]) and B (in[1] -> out[1]), each appending to its two
 * pages, whose last then holds last_page_len tokens. */
static void decodes_of_a_and_b(eng_forward_item d[2], const uint32_t in[2], const uint32_t out[2],
                               uint32_t last_page_len) {
    d[0] = token_item(pages_of_a, 2, last_page_len, true, &in[0], &out[0]);
    d[1] = token_item(pages_of_b, 2, last_page_len, true, &in[1], &out[1]);
}

/* Steps 1 and 2 on the worker and the reference engine: A (pages 0-1, slots 0-19) and B
 * (pages 2-3, slots 40-59) prefill 20 tokens together, then decode one (inputs 20, 60, outputs
 * 21, 61): the device holds 32 tokens of decodes, A and B need 42, so A's KV goes to the host.
 * Every batch must succeed without deferrals (nothing is on the host before). */
static void defer_prologue(fc *f, pie_proc *w, eng *e, arena *a) {
    static const uint32_t kv[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    uint32_t emb[100], slots[40], toks[40], pos[40], sa[20], sb[20];
    for (uint32_t i = 0; i < 100; i++) emb[i] = i;
    for (uint32_t i = 0; i < 20; i++) {
        slots[i] = sa[i] = i, toks[i] = prompt_token(i), pos[i] = i;
        slots[20 + i] = sb[i] = 40 + i, toks[20 + i] = prompt_token(100 + i), pos[20 + i] = i;
    }
    a->used = 0;
    eng_forward_item pre[2] = {{.kv_pages = pages_of_a,
                                .n_kv_pages = 2,
                                .kv_last_page_len = 4,
                                .append_kv = true,
                                .in_slots = sa,
                                .n_in = 20},
                               {.kv_pages = pages_of_b,
                                .n_kv_pages = 2,
                                .kv_last_page_len = 4,
                                .append_kv = true,
                                .in_slots = sb,
                                .n_in = 20}};
    Pie__V1__Batch *s1[3] = {
        b_slots(
            a, 1,
            (slots_spec){.alloc_kv = kv, .n_alloc_kv = 8, .alloc_emb = emb, .n_alloc_emb = 100}),
        b_embed(a, 2, slots, toks, pos, 40), b_forward(a, 3, pre, 2)};
    send_step(f, s1, 3);
    pie_status st;
    alloc_pages(e, kv, 8);
    cr_assert_eq(eng_embed_text(e, slots, toks, pos, 40, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(e, pre, 2, &st), PIE_OK, "%s", st.msg);
    Pie__V1__WorkerUp *up = results_past_capacity(f, w, s1, 3);
    for (int i = 0; i < 3; i++) assert_batch_ok(up->results[i], 0);
    rpc_msg_free(&up->base);
    const uint32_t in[2] = {20, 60}, out[2] = {21, 61},
                   tk[2] = {prompt_token(20), prompt_token(120)}, p20[2] = {20, 20};
    eng_forward_item d1[2];
    decodes_of_a_and_b(d1, in, out, 5);
    Pie__V1__Batch *s2[2] = {b_embed(a, 4, in, tk, p20, 2), b_forward(a, 5, d1, 2)};
    send_step(f, s2, 2);
    cr_assert_eq(eng_embed_text(e, in, tk, p20, 2, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(e, d1, 2, &st), PIE_OK, "%s", st.msg);
    up = expect_results(f, w, s2, 2);
    assert_batch_ok(up->results[0], 0);
    assert_batch_ok(up->results[1], 0);
    rpc_msg_free(&up->base);
}

/* The worker defers A's next decode (its KV on the host, B's decode as device work) and every
 * later item of the step that depends on it: the next_dist of its output (a call of its own,
 * B's beside it runs), a mask of a page it reads, a copy reading the page it appends to, an
 * embed_text into its input. Nothing of them happened: probes of A's pages, of the copy's
 * destination and of A's output slot read what policy gpu — which never ran them — reads; B
 * got what a batch of B alone gets. Offered again alone, A runs and says what policy gpu says.
 * The counters say what was deferred, by kind. */
Test(worker_link, offload_deferral_defers_a_host_decode_and_its_dependents_leaving_no_trace) {
    fc f;
    fc_start(&f);
    pie_proc *w = start_worker(&f, &(wopts){.model_path = SWAP_MODEL, .env = defer_env});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    cr_assert(up->registration->may_defer, "deferral on: the registration offers it");
    rpc_msg_free(&up->base);
    send_registered_defer(&f, 1, 60000, true);
    expect_credits(&f, w, 1);
    cr_assert(pie_proc_wait_log(w, "deferral=on", 1, WAIT_MS), "the link says deferral=on");
    eng *e = open_engine_at(SWAP_MODEL, 2 * KV_PAGES);
    static arena a;
    defer_prologue(&f, w, e, &a);
    pie_status st;
    /* step 3: A and B decode again, then what depends on A */
    const uint32_t in[2] = {22, 62}, out[2] = {23, 63},
                   tk[2] = {prompt_token(21), prompt_token(121)}, p21[2] = {21, 21}, again = 22,
                   tk7 = 7, p30 = 30;
    eng_forward_item d2[2];
    decodes_of_a_and_b(d2, in, out, 6);
    bool masked[PAGE] = {false};
    masked[3] = true;
    const eng_forward_item a_alone = d2[0];
    a.used = 0;
    Pie__V1__Batch *s3[6] = {b_embed(&a, 6, in, tk, p21, 2),
                             b_forward(&a, 7, d2, 2),
                             b_next_dist_calls(&a, 8, out, 2),
                             b_mask(&a, 9, 1, masked, PAGE),
                             b_copy(&a, 10, &(eng_copy_item){1, 6, 0, 0, 4}),
                             b_embed(&a, 11, &again, &tk7, &p30, 1)};
    send_step(&f, s3, 6);
    cr_assert_eq(eng_embed_text(e, in, tk, p21, 2, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(e, &d2[1], 1, &st), PIE_OK, "%s", st.msg); /* what ran: B alone */
    up = expect_results(&f, w, s3, 6);
    assert_batch_ok(up->results[0], 0);
    expect_deferred(up->results[1], 0, "A's decode");
    cr_assert_eq(up->results[1]->items[1]->code, 0, "B's decode ran");
    cr_assert_not(up->results[1]->items[1]->deferred);
    expect_deferred(up->results[2], 0, "the next_dist of A's output");
    expect_dists(e, up->results[2], &out[1], (size_t[]){1}, 1, "B's distribution");
    expect_deferred(up->results[3], 0, "a mask of A's page");
    expect_deferred(up->results[4], 0, "a copy of the page A appends to");
    expect_deferred(up->results[5], 0, "an embed_text into A's input");
    rpc_msg_free(&up->base);
    /* step 4: probes (device work that writes nothing but outputs) */
    const uint32_t pin[2] = {24, 26}, pout[2] = {25, 27}, ptk[2] = {prompt_token(22), 9},
                   ppos[2] = {22, 1}, p6[1] = {6};
    eng_forward_item probes[2] = {token_item(pages_of_a, 2, 7, false, &pin[0], &pout[0]),
                                  token_item(p6, 1, 4, false, &pin[1], &pout[1])};
    const uint32_t look[3] = {25, 27, 23};
    a.used = 0;
    Pie__V1__Batch *s4[3] = {b_embed(&a, 12, pin, ptk, ppos, 2), b_forward(&a, 13, probes, 2),
                             b_next_dist_calls(&a, 14, look, 3)};
    send_step(&f, s4, 3);
    cr_assert_eq(eng_embed_text(e, pin, ptk, ppos, 2, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(eng_forward(e, probes, 2, &st), PIE_OK, "%s", st.msg);
    up = expect_results(&f, w, s4, 3);
    assert_batch_ok(up->results[1], 0);
    assert_batch_ok(up->results[2], 3);
    expect_dists(e, up->results[2], look, (size_t[]){0, 1, 2}, 3,
                 "probes of A's pages, the copy's destination and A's output slot");
    rpc_msg_free(&up->base);
    /* step 5: A's decode offered again, alone: it runs */
    a.used = 0;
    Pie__V1__Batch *s5[2] = {b_forward(&a, 15, &a_alone, 1), b_next_dist_calls(&a, 16, out, 1)};
    send_step(&f, s5, 2);
    cr_assert_eq(eng_forward(e, &a_alone, 1, &st), PIE_OK, "%s", st.msg);
    up = expect_results(&f, w, s5, 2);
    assert_batch_ok(up->results[0], 0);
    assert_batch_ok(up->results[1], 1);
    expect_dists(e, up->results[1], out, (size_t[]){0}, 1, "A, a step late");
    rpc_msg_free(&up->base);
    static const char *const kinds[] = {"embed_text", "forward", "mask_page", "copy_page",
                                        "next_dist"};
    for (int k = 0; k < 5; k++) {
        char series[128];
        snprintf(series, sizeof series, "pie_worker_deferred_items_total{kind=\"%s\"}", kinds[k]);
        cr_assert_eq(metric(w, series), 1.0, "%s", series);
    }
    cr_assert_eq(metric(w, "pie_worker_deferred_items_per_step_count"), 5.0,
                 "five steps ran with deferral on");
    eng_close(e);
    stop_worker(w, 0);
    fc_stop(&f);
}

/* A controller that does not answer defer_ok (an older one) never sees a deferral: the same
 * steps run whole, as with deferral switched off, whose registration does not offer it. */
Test(worker_link, offload_deferral_needs_the_controllers_agreement_and_is_off_by_default) {
    for (int round = 0; round < 2; round++) {
        fc f;
        fc_start(&f);
        const char *const off_env[] = {"PIE_MEMORY_POLICY=offload", "PIE_MEMORY_DEVICE_KV=64KiB",
                                       "PIE_MEMORY_HOST_POOL=2MiB",
                                       "PIE_MEMORY_OFFLOAD_HOST_ATTN_US=1000000", NULL};
        pie_proc *w = start_worker(
            &f, &(wopts){.model_path = SWAP_MODEL, .env = round == 0 ? defer_env : off_env});
        Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
        cr_assert_eq(up->registration->may_defer, round == 0);
        rpc_msg_free(&up->base);
        send_registered_defer(&f, 1, 60000, false);
        expect_credits(&f, w, 1);
        eng *e = open_engine_at(SWAP_MODEL, 2 * KV_PAGES);
        static arena a;
        defer_prologue(&f, w, e, &a);
        const uint32_t in[2] = {22, 62}, out[2] = {23, 63},
                       tk[2] = {prompt_token(21), prompt_token(121)}, p21[2] = {21, 21};
        eng_forward_item d2[2];
        decodes_of_a_and_b(d2, in, out, 6);
        a.used = 0;
        Pie__V1__Batch *s3[3] = {b_embed(&a, 6, in, tk, p21, 2), b_forward(&a, 7, d2, 2),
                                 b_next_dist(&a, 8, out, (uint32_t[]){8, 8}, (float[]){1, 1}, 2)};
        send_step(&f, s3, 3);
        pie_status st;
        cr_assert_eq(eng_embed_text(e, in, tk, p21, 2, &st), PIE_OK, "%s", st.msg);
        cr_assert_eq(eng_forward(e, d2, 2, &st), PIE_OK, "%s", st.msg);
        up = expect_results(&f, w, s3, 3);
        assert_batch_ok(up->results[1], 0); /* the forward ran whole */
        assert_batch_ok(up->results[2], 2);
        expect_dists(e, up->results[2], out, (size_t[]){0, 1}, 2, "both decodes");
        rpc_msg_free(&up->base);
        cr_assert_eq(pie_proc_log_count(w, "deferral=on"), 0);
        cr_assert_eq(metric(w, "pie_worker_deferred_items_total{kind=\"forward\"}"), 0.0);
        eng_close(e);
        stop_worker(w, 0);
        fc_stop(&f);
    }
}

/* Auto: the worker chooses swap or offload at load, registers the one it chose and says why.
 * At memory speed a layer's KV (64 pages: 512 KiB) moves in well under a layer's compute over
 * a batch (a margin of 100x or more on any machine): swap. Over an emulated 1 Mb/s link the
 * same move takes ~4 s: swapping would stall, and the host's attention of a 64-token decode
 * hides behind a device token's linear layers: offload. That second margin is only 6-9x (a
 * small model's thin linear pass): a profile taken in CI on a 2-core EPYC put it at 0.099
 * against auto's 0.1 (0.58-0.86 idle), so that case pins the host's attention cost (host_attn:
 * memory.offload_host_attn_us, the operator's knob for a machine whose profile is off). */
static void expect_auto(const char *link, const char *host_attn, Pie__V1__MemoryPolicy want,
                        const char *reason) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=auto", "PIE_MEMORY_HOST_POOL=64MiB", link, host_attn,
                         NULL};
    pie_proc *w = start_worker(&f, &(wopts){.model_path = SWAP_MODEL, .env = env});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    const Pie__V1__WorkerRegistration *r = up->registration;
    if (r->memory_policy != want) {
        char *log = pie_proc_log(w); /* the choice, its reason and the profiled costs */
        fprintf(stderr, "%s", log ? log : "");
        free(log);
    }
    cr_assert_eq(r->memory_policy, want, "policy %d, want %d", (int)r->memory_policy, (int)want);
    cr_assert_gt(r->capacity->kv_pages_max, KV_PAGES, "a larger pool either way");
    rpc_msg_free(&up->base);
    cr_assert_eq(pie_proc_log_count(w, "wrk.mem.auto"), 1, "the choice and its reason");
    cr_assert_eq(pie_proc_log_count(w, reason), 1, "no reason '%s'", reason);
    send_registered(&f, 1, 100);
    expect_credits(&f, w, 1);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, auto_policy_chooses_registers_and_says_why) {
    expect_auto("PIE_MEMORY_EMULATE_LINK_GBPS=0", NULL,
                PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP, "reason=\"swap: a layer's KV moves in");
    expect_auto("PIE_MEMORY_EMULATE_LINK_GBPS=0.001", "PIE_MEMORY_OFFLOAD_HOST_ATTN_US=0.001",
                PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD,
                "reason=\"offload: swapping a layer takes");
}

/* Auto on the null backend: the choice is made from the emulated device's profile (the costs
 * its offload emulation would use), as the cpu backend's is from its engine's: with copies that
 * take no time swapping is free (swap); over a 1 Mb/s link a layer's 8 MiB takes a minute while
 * the host's attention of a decode hides behind the linear layers (offload: the profile's linear
 * slope is the device's 1 us per token per layer, measured between its two probes — its 16-row
 * probe divided by 16 counted the weights' pass in it and overstated it). */
static void expect_null_auto(const char *link, Pie__V1__MemoryPolicy want, const char *reason) {
    fc f;
    fc_start(&f);
    const char *env[] = {"PIE_MEMORY_POLICY=auto",
                         "PIE_MEMORY_HOST_POOL=1GiB",
                         "PIE_NULL_LAYER_US=20",
                         "PIE_NULL_LAYER_TOKEN_US=1",
                         "PIE_NULL_LAYER_KV_US=0.01",
                         "PIE_NULL_HOST_ATTN_KV_US=0.1",
                         link,
                         NULL};
    pie_proc *w = start_worker(&f, &(wopts){.backend = "null", .model_path = "", .env = env});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    cr_assert_eq(up->registration->memory_policy, want, "policy %d, want %d",
                 (int)up->registration->memory_policy, (int)want);
    rpc_msg_free(&up->base);
    cr_assert_eq(pie_proc_log_count(w, reason), 1, "no reason '%s'", reason);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, null_backend_auto_chooses_from_the_emulated_devices_costs) {
    expect_null_auto("PIE_MEMORY_EMULATE_LINK_GBPS=0", PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP,
                     "reason=\"swap: a layer's KV moves in");
    expect_null_auto("PIE_MEMORY_EMULATE_LINK_GBPS=0.001",
                     PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD,
                     "reason=\"offload: swapping a layer takes");
}

/* A worker started with o exits 2 at once, having printed `line`. */
static void expect_exit_2(const fc *f, const wopts *o, const char *line) {
    pie_proc *w = spawn_worker(f, o);
    pie_status st;
    int rc = pie_proc_wait(w, STOP_MS, &st);
    cr_assert_eq(rc, 2, "exit %d", rc);
    cr_assert(pie_proc_log_has_line(w, line), "no line '%s'", line);
    pie_proc_destroy(w);
}

Test(worker_link, memory_policies_not_implemented_exit_2_saying_so) {
    fc f;
    fc_start(&f);
    const char *group[] = {"PIE_MEMORY_POLICY=swap", "PIE_TP_SIZE=2", "PIE_BACKEND=cuda", NULL};
    expect_exit_2(&f, &(wopts){.env = group},
                  "pie-worker: backend cuda runs memory.policy swap on one GPU (tp.size 1) so "
                  "far: in a tensor-parallel group it is implemented for backends cpu and null "
                  "only");
    const char *ogroup[] = {"PIE_MEMORY_POLICY=auto", "PIE_TP_SIZE=2", "PIE_BACKEND=cuda", NULL};
    expect_exit_2(&f, &(wopts){.env = ogroup},
                  "pie-worker: backend cuda runs memory.policy auto on one GPU (tp.size 1) so "
                  "far: in a tensor-parallel group it is implemented for backends cpu and null "
                  "only");
    const char *kv[] = {"PIE_ENGINE_KV_DTYPE=bf16", "PIE_BACKEND=cuda", NULL};
    expect_exit_2(&f, &(wopts){.env = kv},
                  "pie-worker: engine.kv_dtype bf16 is implemented for backend cpu only so far "
                  "(backend cuda stores f32)");
    fc_stop(&f);
}

/* memory.host_numa_node: the host pool on a node (mem/wrk_numa.h). A node this machine lacks
 * exits 2 at start, naming the nodes it has; the last node it has serves (a swap worker whose
 * host region is bound there: its log says so). */
Test(worker_link, a_host_numa_node_the_machine_lacks_exits_2_and_one_it_has_serves) {
    fc f;
    fc_start(&f);
    int nodes = wrk_numa_nodes();
    char lacks[64], line[160];
    snprintf(lacks, sizeof lacks, "PIE_MEMORY_HOST_NUMA_NODE=%d", nodes);
    snprintf(line, sizeof line,
             "pie-worker: memory.host_numa_node %d: this machine has NUMA nodes 0..%d "
             "(/sys/devices/system/node)",
             nodes, nodes - 1);
    const char *bad[] = {"PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=64MiB", lacks, NULL};
    expect_exit_2(&f, &(wopts){.model_path = SWAP_MODEL, .env = bad}, line);
    char has[64], says[64];
    snprintf(has, sizeof has, "PIE_MEMORY_HOST_NUMA_NODE=%d", nodes - 1);
    snprintf(says, sizeof says, "host_numa_node=%d", nodes - 1);
    const char *good[] = {"PIE_MEMORY_POLICY=swap", "PIE_MEMORY_HOST_POOL=64MiB", has, NULL};
    pie_proc *w = start_worker(&f, &(wopts){.model_path = SWAP_MODEL, .env = good});
    Pie__V1__WorkerUp *up = expect_registration(&f, w, 1);
    cr_assert_eq(up->registration->memory_policy, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP);
    rpc_msg_free(&up->base);
    cr_assert_eq(pie_proc_log_count(w, says), 1, "no '%s' in the wrk.mem.swap line", says);
    stop_worker(w, 0);
    fc_stop(&f);
}

Test(worker_link, backend_cpu_without_model_path_exits_2) {
    fc f;
    fc_start(&f);
    pie_proc *w = spawn_worker(&f, &(wopts){.model_path = ""});
    pie_status st;
    int rc = pie_proc_wait(w, STOP_MS, &st);
    cr_assert_eq(rc, 2, "exit %d", rc);
    cr_assert(pie_proc_log_has_line(w, "pie-worker: model.path is required with backend cpu (set "
                                       "it in the config file or with PIE_MODEL_PATH)"));
    pie_proc_destroy(w);
    fc_stop(&f);
}
