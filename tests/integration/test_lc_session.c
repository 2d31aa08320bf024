/* test_lc_session.c — the lifecycle's Session with the controller (services/lifecycle/
 * lc_session.c) against a fake controller in this process: an rpc_server that serves
 * /pie.v1.Controller/Session, welcomes every stream and records what each stream carried.
 *
 * Covers (issue 11, hole 7): parts the sender took out of the outbox for one stream never leave
 * on the stream of a later reconnect (the race is forced with the sender's before_send hook:
 * the sender is held between taking the parts and sending them while the fake controller ends
 * the stream and the link reconnects); an outbox that cannot grow (an injected allocation
 * failure) fails the flush with UNAVAILABLE and a reason and restarts the Session at once, so
 * every instance of it is failed (on_lost) instead of waiting for calls that were never sent;
 * so does a send that fails on the open stream (a SessionUp above the channel's message limit:
 * before, it was only logged and the calls were lost); a flush of more parts than one SessionUp
 * holds arrives whole, in order, split over several messages. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lc_session.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_log.h"
#include "pie_testutil.h"
#include "rpc.h"
#include "svc.h"

#define WAIT_MS     20000 /* hang guard: far above any real wait, reached only when stuck */
#define MAX_STREAMS 16

TestSuite(lc_session, .fini = pie_test_leak_check, .timeout = 120);

/* ---- the fake controller --------------------------------------------------------------------- */

typedef struct fake_stream {
    rpc_call *call; /* referenced until the test ends */
    int hellos, ups;
    size_t begins, calls, ends;
    uint64_t last_call_id; /* the highest call_id seen, for the order check */
    bool in_order;         /* call ids arrived ascending */
    bool done;
} fake_stream;

typedef struct fake_ctl {
    rpc_server *srv;
    int port;
    pthread_mutex_t mu; /* guards the fields below */
    fake_stream streams[MAX_STREAMS];
    int n_streams;
} fake_ctl;

static bool fake_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    fake_ctl *f = user;
    pthread_mutex_lock(&f->mu);
    int i = f->n_streams < MAX_STREAMS ? f->n_streams++ : -1;
    if (i >= 0) {
        f->streams[i] = (fake_stream){.call = call, .in_order = true};
        rpc_call_ref(call);
    }
    pthread_mutex_unlock(&f->mu);
    rpc_call_set_data(call, (void *)(intptr_t)(i + 1));
    return false;
}

static bool fake_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    fake_ctl *f = user;
    const Pie__V1__SessionUp *up = (const Pie__V1__SessionUp *)msg;
    int i = (int)(intptr_t)rpc_call_get_data(call) - 1;
    if (i < 0) return false;
    pthread_mutex_lock(&f->mu);
    fake_stream *fs = &f->streams[i];
    fs->ups++;
    if (up->hello) fs->hellos++;
    fs->begins += up->n_begins;
    fs->ends += up->n_ends;
    for (size_t k = 0; k < up->n_calls; k++) {
        if (up->calls[k]->call_id <= fs->last_call_id) fs->in_order = false;
        fs->last_call_id = up->calls[k]->call_id;
    }
    fs->calls += up->n_calls;
    pthread_mutex_unlock(&f->mu);
    if (up->hello) {
        Pie__V1__SessionWelcome w = PIE__V1__SESSION_WELCOME__INIT;
        w.replica_index = 1;
        w.version = "pie-c/0.1.0";
        Pie__V1__SessionDown down = PIE__V1__SESSION_DOWN__INIT;
        down.welcome = &w;
        (void)rpc_call_send(call, &down.base);
    }
    return false;
}

static void fake_on_half_close(rpc_call *call, void *user) {
    (void)user;
    (void)rpc_call_finish(call, PIE_OK, NULL);
}

static void fake_on_done(rpc_call *call, void *user) {
    fake_ctl *f = user;
    int i = (int)(intptr_t)rpc_call_get_data(call) - 1;
    if (i < 0) return;
    pthread_mutex_lock(&f->mu);
    f->streams[i].done = true;
    pthread_mutex_unlock(&f->mu);
}

static fake_ctl *fake_start(void) {
    fake_ctl *f = calloc(1, sizeof *f);
    cr_assert(f);
    cr_assert_eq(pthread_mutex_init(&f->mu, NULL), 0);
    pie_status st;
    f->srv = rpc_server_create(&(rpc_server_opts){.addr = "127.0.0.1:0"}, &st);
    cr_assert(f->srv, "%s", st.msg);
    rpc_method m = {.path = "/pie.v1.Controller/Session",
                    .kind = RPC_BIDI,
                    .request = &pie__v1__session_up__descriptor,
                    .response = &pie__v1__session_down__descriptor,
                    .on_call = fake_on_call,
                    .on_message = fake_on_message,
                    .on_half_close = fake_on_half_close,
                    .on_done = fake_on_done,
                    .user = f};
    cr_assert_eq(rpc_server_add_methods(f->srv, &m, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(rpc_server_start(f->srv, &st), PIE_OK, "%s", st.msg);
    f->port = rpc_server_port(f->srv);
    return f;
}

static void fake_stop(fake_ctl *f) {
    rpc_server_shutdown(f->srv, 0);
    for (int i = 0; i < f->n_streams; i++) rpc_call_unref(f->streams[i].call);
    rpc_server_destroy(f->srv);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

/* A copy of stream i's record (zero if it does not exist yet). */
static fake_stream fake_get(fake_ctl *f, int i) {
    pthread_mutex_lock(&f->mu);
    fake_stream s = i < f->n_streams ? f->streams[i] : (fake_stream){0};
    pthread_mutex_unlock(&f->mu);
    return s;
}

static int fake_n_streams(fake_ctl *f) {
    pthread_mutex_lock(&f->mu);
    int n = f->n_streams;
    pthread_mutex_unlock(&f->mu);
    return n;
}

/* ---- the session under test, with its sink and hooks ----------------------------------------- */

typedef struct harness {
    fake_ctl *ctl;
    svc_config svc_cfg; /* svc keeps a pointer to it */
    svc *sv;
    lc_session *s;
    pthread_mutex_t mu; /* guards the fields below */
    pthread_cond_t cv;
    int lost;            /* on_lost calls */
    pie_status lost_why; /* the last one's status */
    bool hold;           /* before_send: block the next send that carries parts */
    bool held;           /* the sender is blocked in before_send */
    uint64_t held_epoch; /* the epoch the held parts were filled for */
    bool fail_grow;      /* outbox_realloc: fail */
} harness;

static void on_down(void *ctx, const Pie__V1__SessionDown *down) {
    (void)ctx;
    (void)down;
}

static void on_lost(void *ctx, const pie_status *why) {
    harness *h = ctx;
    pthread_mutex_lock(&h->mu);
    h->lost++;
    h->lost_why = *why;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

static void before_send(void *ctx, uint64_t epoch, size_t parts) {
    harness *h = ctx;
    pthread_mutex_lock(&h->mu);
    if (h->hold && parts > 0) {
        h->hold = false;
        h->held = true;
        h->held_epoch = epoch;
        pthread_cond_broadcast(&h->cv);
        while (h->held) pthread_cond_wait(&h->cv, &h->mu);
    }
    pthread_mutex_unlock(&h->mu);
}

static void *outbox_realloc(void *ctx, void *p, size_t bytes) {
    harness *h = ctx;
    pthread_mutex_lock(&h->mu);
    bool fail = h->fail_grow;
    pthread_mutex_unlock(&h->mu);
    return fail ? NULL : realloc(p, bytes);
}

/* max_message: the session's channel limit (server.max_message). */
static void harness_start_max(harness *h, uint64_t max_message) {
    memset(h, 0, sizeof *h);
    cr_assert_eq(pthread_mutex_init(&h->mu, NULL), 0);
    cr_assert_eq(pthread_cond_init(&h->cv, NULL), 0);
    h->ctl = fake_start();
    pie_status st;
    h->svc_cfg = (svc_config){.listen = "127.0.0.1:0",
                              .threads = 1,
                              .max_message_bytes = max_message,
                              .auth_token = "",
                              .auth_token_file = "",
                              .metrics_listen = "",
                              .log_level = PIE_LOG_WARN};
    h->sv = svc_create("lifecycle", &h->svc_cfg, &st);
    cr_assert(h->sv, "%s", st.msg);
    lc_session_config lsc = {.replica_id = "test-lc-session", .advertise = ""};
    h->s = lc_session_create(&lsc, svc_metrics(h->sv), &st);
    cr_assert(h->s, "%s", st.msg);
    size_t nm;
    const rpc_method *m = lc_session_methods(h->s, &nm);
    cr_assert_eq(svc_serve(h->sv, m, nm, &st), PIE_OK, "%s", st.msg);
    lc_session_set_sink(h->s, &(lc_session_sink){.ctx = h, .on_down = on_down, .on_lost = on_lost});
    lc_session_set_test_hooks(h->s, &(lc_session_test_hooks){.ctx = h,
                                                             .before_send = before_send,
                                                             .outbox_realloc = outbox_realloc});
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", h->ctl->port);
    svc_dial_config dc = {.address = addr, .reconnect_initial_ms = 20, .reconnect_max_ms = 50};
    cr_assert_eq(lc_session_start(h->s, h->sv, &dc, &st), PIE_OK, "%s", st.msg);
}

static void harness_start(harness *h) { harness_start_max(h, 64u << 20); }

static void harness_stop(harness *h) {
    pthread_mutex_lock(&h->mu);
    h->held = false; /* never leave the sender blocked */
    h->hold = false;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    svc_drain(h->sv);
    lc_session_destroy(h->s);
    svc_stop(h->sv);
    fake_stop(h->ctl);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
}

/* Waits until the session is connected on a stream other than `not` and the fake controller
 * has its hello (and so the session's welcome went out); returns the epoch. */
static uint64_t wait_connected(harness *h, uint64_t not ) {
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        uint64_t e = lc_session_epoch(h->s);
        if (e != 0 && e != not &&lc_session_replica_index(h->s) != 0) return e;
        cr_assert(pie_test_now_ms() < deadline, "the session did not (re)connect");
        pie_test_sleep_ms(2);
    }
}

/* Stages an InstanceBegin for instance id and n ApiCalls (call ids 1..n) into sg. */
static void stage_instance(lc_session_stage *sg, uint64_t id, size_t n, size_t pad) {
    pie_status st;
    Pie__V1__InstanceBegin b = PIE__V1__INSTANCE_BEGIN__INIT;
    b.instance_id = id;
    b.program_id = "p";
    b.model = "m";
    cr_assert_eq(lc_session_stage_add(sg, LC_SESSION_BEGIN, &b.base, &st), PIE_OK, "%s", st.msg);
    char *name = calloc(1, pad + 1);
    cr_assert(name);
    memset(name, 'x', pad);
    for (size_t i = 0; i < n; i++) {
        Pie__V1__Subscribe sub = PIE__V1__SUBSCRIBE__INIT;
        sub.topic = name;
        Pie__V1__ApiCall c = PIE__V1__API_CALL__INIT;
        c.instance_id = id;
        c.call_id = i + 1;
        c.op_case = PIE__V1__API_CALL__OP_SUBSCRIBE;
        c.subscribe = &sub;
        cr_assert_eq(lc_session_stage_add(sg, LC_SESSION_CALL, &c.base, &st), PIE_OK, "%s", st.msg);
    }
    free(name);
}

/* Waits until on_lost was called; returns its status. */
static pie_status wait_lost(harness *h, int64_t t0) {
    pthread_mutex_lock(&h->mu);
    while (h->lost == 0 && pie_test_now_ms() < t0 + WAIT_MS) {
        pthread_mutex_unlock(&h->mu);
        pie_test_sleep_ms(2);
        pthread_mutex_lock(&h->mu);
    }
    int lost = h->lost;
    pie_status why = h->lost_why;
    pthread_mutex_unlock(&h->mu);
    cr_assert_eq(lost, 1, "the Session's instances were failed (on_lost %d times)", lost);
    return why;
}

/* ---- tests ----------------------------------------------------------------------------------- */

/* An instance thread flushing one stage (lc_session_flush may send on the caller's thread). */
typedef struct flusher {
    lc_session *s;
    uint64_t epoch;
    lc_session_stage *sg;
    pie_code rc;
    pie_status st;
} flusher;

static void *flusher_main(void *arg) {
    flusher *f = arg;
    f->rc = lc_session_flush(f->s, f->epoch, f->sg, false, &f->st);
    return NULL;
}

Test(lc_session, parts_taken_for_a_stream_never_leave_on_the_stream_of_a_reconnect) {
    harness h;
    harness_start(&h);
    uint64_t e1 = wait_connected(&h, 0);
    cr_assert_eq(fake_n_streams(h.ctl), 1);

    /* The parts of stream 1 are taken for sending and held before they go. Nothing else is
     * queued, so the flushing instance's own thread sends them (lc_session_flush): it is the
     * one held, as the sender thread is when parts wait in the outbox. */
    pthread_mutex_lock(&h.mu);
    h.hold = true;
    pthread_mutex_unlock(&h.mu);
    lc_session_stage sg = {0};
    stage_instance(&sg, (1ull << 48) | 7, 3, 8);
    pie_status st;
    flusher fl = {.s = h.s, .epoch = e1, .sg = &sg};
    pthread_t fth;
    cr_assert_eq(pthread_create(&fth, NULL, flusher_main, &fl), 0);
    pthread_mutex_lock(&h.mu);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    while (!h.held && pie_test_now_ms() < deadline) {
        pthread_mutex_unlock(&h.mu);
        pie_test_sleep_ms(2);
        pthread_mutex_lock(&h.mu);
    }
    bool held = h.held;
    uint64_t held_epoch = h.held_epoch;
    pthread_mutex_unlock(&h.mu);
    cr_assert(held, "the sender never took the staged parts");
    cr_assert_eq(held_epoch, e1);
    /* A second instance flushes while that send is held: its parts wait in the outbox for the
     * sender thread, which must not carry them onto the next stream either. */
    lc_session_stage sg2 = {0};
    stage_instance(&sg2, (1ull << 48) | 6, 2, 8);
    cr_assert_eq(lc_session_flush(h.s, e1, &sg2, false, &st), PIE_OK, "%s", st.msg);
    lc_session_stage_free(&sg2);

    /* Meanwhile the controller ends stream 1 and the session reconnects on stream 2. */
    rpc_call_cancel(fake_get(h.ctl, 0).call, PIE_UNAVAILABLE, "test: stream 1 ends");
    uint64_t e2 = wait_connected(&h, e1);
    cr_assert_neq(e2, e1);
    cr_assert_eq(fake_n_streams(h.ctl), 2);
    cr_assert_eq(fake_get(h.ctl, 1).hellos, 1, "stream 2 starts with its hello");

    /* The sender goes on with the parts it took for stream 1. */
    pthread_mutex_lock(&h.mu);
    h.held = false;
    pthread_cond_broadcast(&h.cv);
    pthread_mutex_unlock(&h.mu);
    cr_assert_eq(pthread_join(fth, NULL), 0);
    cr_assert_eq(fl.rc, PIE_OK, "the flush was accepted before the stream ended: %s", fl.st.msg);
    pie_test_sleep_ms(300); /* room for a stale send to arrive, if one were made */

    fake_stream s1 = fake_get(h.ctl, 0), s2 = fake_get(h.ctl, 1);
    cr_assert_eq(s2.begins + s2.calls + s2.ends, 0,
                 "stream 2 got %zu begins and %zu calls made for stream 1 (stale parts on a "
                 "new stream)",
                 s2.begins, s2.calls);
    cr_assert_eq(s1.begins + s1.calls, 0, "stream 1 had ended: nothing reached it either");
    pthread_mutex_lock(&h.mu);
    int lost = h.lost;
    pthread_mutex_unlock(&h.mu);
    cr_assert_eq(lost, 1, "the end of stream 1 failed its instances once (on_lost), got %d", lost);

    /* Parts of the old stream are refused at flush; parts of the new one go through. */
    stage_instance(&sg, (1ull << 48) | 8, 1, 8);
    cr_assert_eq(lc_session_flush(h.s, e1, &sg, false, &st), PIE_UNAVAILABLE);
    stage_instance(&sg, (1ull << 48) | 9, 2, 8);
    cr_assert_eq(lc_session_flush(h.s, e2, &sg, false, &st), PIE_OK, "%s", st.msg);
    deadline = pie_test_now_ms() + WAIT_MS;
    while (fake_get(h.ctl, 1).calls < 2 && pie_test_now_ms() < deadline) pie_test_sleep_ms(2);
    s2 = fake_get(h.ctl, 1);
    cr_assert_eq(s2.begins, 1);
    cr_assert_eq(s2.calls, 2);
    lc_session_stage_free(&sg);
    harness_stop(&h);
}

Test(lc_session, an_outbox_that_cannot_grow_fails_every_instance_at_once_with_unavailable) {
    harness h;
    harness_start(&h);
    uint64_t e1 = wait_connected(&h, 0);
    pthread_mutex_lock(&h.mu);
    h.fail_grow = true;
    pthread_mutex_unlock(&h.mu);
    int64_t t0 = pie_test_now_ms();
    lc_session_stage sg = {0};
    stage_instance(&sg, (1ull << 48) | 7, 4, 2000); /* 8 KB: more than the outbox holds */
    pie_status st;
    pie_code rc = lc_session_flush(h.s, e1, &sg, false, &st);
    cr_assert_eq(rc, PIE_UNAVAILABLE, "flush: %s: %s", pie_code_name(rc), st.msg);
    cr_assert(strstr(st.msg, "out of memory"), "the reason is given: %s", st.msg);
    cr_assert_eq(sg.len, 0u, "the stage is emptied");
    pthread_mutex_lock(&h.mu);
    h.fail_grow = false;
    pthread_mutex_unlock(&h.mu);
    pie_status why = wait_lost(&h, t0);
    cr_assert_eq(why.code, PIE_UNAVAILABLE, "on_lost: %s: %s", pie_code_name(why.code), why.msg);
    cr_assert(strstr(why.msg, "out of memory"), "on_lost names the reason: %s", why.msg);
    cr_assert_lt(pie_test_now_ms() - t0, 5000, "failed within 5 s, not at the wall limit");
    /* Other parts of the lost stream are refused from then on; a new stream works. */
    stage_instance(&sg, (1ull << 48) | 8, 1, 8);
    cr_assert_eq(lc_session_flush(h.s, e1, &sg, false, &st), PIE_UNAVAILABLE);
    uint64_t e2 = wait_connected(&h, e1);
    stage_instance(&sg, (1ull << 48) | 9, 2, 8);
    cr_assert_eq(lc_session_flush(h.s, e2, &sg, false, &st), PIE_OK, "%s", st.msg);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    while (fake_get(h.ctl, 1).calls < 2 && pie_test_now_ms() < deadline) pie_test_sleep_ms(2);
    fake_stream s1 = fake_get(h.ctl, 0), s2 = fake_get(h.ctl, 1);
    cr_assert_eq(s1.calls, 0, "nothing of the failed flush was sent");
    cr_assert_eq(s2.begins, 1);
    cr_assert_eq(s2.calls, 2);
    lc_session_stage_free(&sg);
    harness_stop(&h);
}

Test(lc_session, a_flush_larger_than_one_session_up_arrives_whole_and_in_order) {
    harness h;
    harness_start(&h);
    uint64_t e1 = wait_connected(&h, 0);
    lc_session_stage sg = {0};
    stage_instance(&sg, (1ull << 48) | 7, 10000, 4);
    pie_status st;
    cr_assert_eq(lc_session_flush(h.s, e1, &sg, false, &st), PIE_OK, "%s", st.msg);
    int64_t deadline = pie_test_now_ms() + WAIT_MS;
    while (fake_get(h.ctl, 0).calls < 10000 && pie_test_now_ms() < deadline) pie_test_sleep_ms(2);
    fake_stream s1 = fake_get(h.ctl, 0);
    cr_assert_eq(s1.begins, 1);
    cr_assert_eq(s1.calls, 10000u, "%zu of 10000 calls arrived", s1.calls);
    cr_assert(s1.in_order, "calls arrived in issue order");
    cr_assert_gt(s1.ups, 2, "split over several SessionUps (%d messages)", s1.ups);
    lc_session_stage_free(&sg);
    harness_stop(&h);
}

Test(lc_session, a_send_that_fails_restarts_the_session_and_fails_its_instances_at_once) {
    harness h;
    harness_start_max(&h, 64u << 10); /* the channel refuses messages above 64 KiB */
    uint64_t e1 = wait_connected(&h, 0);
    int64_t t0 = pie_test_now_ms();
    lc_session_stage sg = {0};
    stage_instance(&sg, (1ull << 48) | 7, 100, 1000); /* one SessionUp of ~100 KB */
    pie_status st;
    cr_assert_eq(lc_session_flush(h.s, e1, &sg, false, &st), PIE_OK, "%s", st.msg);
    pie_status why = wait_lost(&h, t0);
    cr_assert_eq(why.code, PIE_UNAVAILABLE, "on_lost: %s: %s", pie_code_name(why.code), why.msg);
    cr_assert(strstr(why.msg, "sending 101 calls to the controller failed"),
              "on_lost names the failed send: %s", why.msg);
    cr_assert_lt(pie_test_now_ms() - t0, 5000, "failed within 5 s, not at the wall limit");
    uint64_t e2 = wait_connected(&h, e1);
    cr_assert_neq(e2, e1, "the Session restarted");
    fake_stream s1 = fake_get(h.ctl, 0);
    cr_assert_eq(s1.begins + s1.calls, 0, "nothing of the failed send arrived");
    lc_session_stage_free(&sg);
    harness_stop(&h);
}
