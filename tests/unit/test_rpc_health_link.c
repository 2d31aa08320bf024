/* test_rpc_health_link.c — the grpc.health.v1.Health service (Check, Watch, runtime changes,
 * shutdown) and the reconnecting link (rpc_link) of services/common/rpc. */
#include <criterion/criterion.h>

#include "test_rpc_util.h"

typedef Grpc__Health__V1__HealthCheckResponse hresp;
#define HRESP_DESC (&grpc__health__v1__health_check_response__descriptor)

static void leak_check(void) { TLEAK_CHECK(); }

/* One timeout for every test of this file: with different ones, Criterion's runner (its BoxFort
 * timeout list) was seen to leak 48 bytes under -j2, which fails the ASan build's run. */
TestSuite(rpc_health, .fini = leak_check, .timeout = 120);
TestSuite(rpc_link, .fini = leak_check, .timeout = 120);

static rpc_stream *watch_open(rpc_channel *ch, const char *service) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(ch, "/grpc.health.v1.Health/Watch", HRESP_DESC, NULL, &st);
    cr_assert(s, "%s", st.msg);
    tmsg req = tmsg_of(service);
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(rpc_stream_close_send(s, &st), PIE_OK, "%s", st.msg);
    return s;
}

static int watch_next(rpc_stream *s, int64_t timeout_ms) {
    ProtobufCMessage *m = NULL;
    rpc_recv_result r = rpc_stream_recv(s, &m, timeout_ms);
    if (r == RPC_RECV_TIMEOUT) return -1;
    if (r == RPC_RECV_END) return -2;
    int v = (int)((hresp *)m)->status;
    rpc_msg_free(m);
    return v;
}

Test(rpc_health, check_reports_overall_and_per_service_status) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    cr_assert_eq(rpc_health_check(ch, "", 5000, &hs, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(hs, RPC_HEALTH_SERVING);
    cr_assert_eq(rpc_health_check(ch, "pie.v1.Nope", 5000, &hs, &st), PIE_NOT_FOUND);
    cr_assert(strstr(st.msg, "pie.v1.Nope"), "%s", st.msg);
    cr_assert_eq(rpc_server_set_health(t->srv, "pie.v1.Svc", RPC_HEALTH_NOT_SERVING, &st), PIE_OK);
    cr_assert_eq(rpc_health_check(ch, "pie.v1.Svc", 5000, &hs, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(hs, RPC_HEALTH_NOT_SERVING);
    cr_assert_eq(rpc_server_set_health(t->srv, "pie.v1.Svc", RPC_HEALTH_SERVING, &st), PIE_OK);
    cr_assert_eq(rpc_health_check(ch, "pie.v1.Svc", 5000, &hs, &st), PIE_OK);
    cr_assert_eq(hs, RPC_HEALTH_SERVING);
    cr_assert_eq(rpc_server_set_health(t->srv, "pie.v1.Svc", RPC_HEALTH_SERVICE_UNKNOWN, &st),
                 PIE_OK);
    cr_assert_eq(rpc_health_check(ch, "pie.v1.Svc", 5000, &hs, &st), PIE_NOT_FOUND);
    cr_assert_eq(rpc_server_set_health(t->srv, "", RPC_HEALTH_NOT_SERVING, &st), PIE_OK);
    cr_assert_eq(rpc_health_check(ch, "", 5000, &hs, &st), PIE_OK);
    cr_assert_eq(hs, RPC_HEALTH_NOT_SERVING);
    cr_assert_eq(rpc_server_set_health(t->srv, "", (rpc_health_status)9, &st),
                 PIE_INVALID_ARGUMENT);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

Test(rpc_health, server_can_start_not_serving) {
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.health_not_serving = true}, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    cr_assert_eq(rpc_health_check(ch, "", 5000, &hs, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(hs, RPC_HEALTH_NOT_SERVING);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

Test(rpc_health, watch_pushes_changes_and_ends_at_shutdown) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    cr_assert_eq(rpc_server_set_health(t->srv, "svc", RPC_HEALTH_NOT_SERVING, &st), PIE_OK);
    rpc_stream *w = watch_open(ch, "svc");
    rpc_stream *ghost = watch_open(ch, "ghost");
    cr_assert_eq(watch_next(w, 5000), RPC_HEALTH_NOT_SERVING);
    cr_assert_eq(watch_next(ghost, 5000), RPC_HEALTH_SERVICE_UNKNOWN);
    cr_assert_eq(rpc_server_set_health(t->srv, "svc", RPC_HEALTH_SERVING, &st), PIE_OK);
    cr_assert_eq(watch_next(w, 5000), RPC_HEALTH_SERVING, "the change was pushed");
    /* No push when nothing changed, and other services' watchers hear nothing: pushes arrive in
     * order, so a spurious one would be read below in place of the change that follows. */
    cr_assert_eq(rpc_server_set_health(t->srv, "svc", RPC_HEALTH_SERVING, &st), PIE_OK);
    cr_assert_eq(rpc_server_set_health(t->srv, "svc", RPC_HEALTH_NOT_SERVING, &st), PIE_OK);
    cr_assert_eq(watch_next(w, 5000), RPC_HEALTH_NOT_SERVING,
                 "the next push is the real change (an unchanged set pushed nothing)");
    cr_assert_eq(rpc_server_set_health(t->srv, "svc", RPC_HEALTH_SERVING, &st), PIE_OK);
    cr_assert_eq(watch_next(w, 5000), RPC_HEALTH_SERVING);
    cr_assert_eq(rpc_server_set_health(t->srv, "ghost", RPC_HEALTH_SERVING, &st), PIE_OK);
    cr_assert_eq(watch_next(ghost, 5000), RPC_HEALTH_SERVING,
                 "an unknown service appeared (and svc's changes were not pushed here)");
    rpc_server_shutdown(t->srv, 5000);
    cr_assert_eq(watch_next(w, 5000), RPC_HEALTH_NOT_SERVING, "shutdown is announced");
    cr_assert_eq(watch_next(w, 5000), -2);
    cr_assert_eq(rpc_stream_finish(w, &st), PIE_UNAVAILABLE, "%s", pie_code_name(st.code));
    cr_assert_eq(watch_next(ghost, 5000), RPC_HEALTH_NOT_SERVING);
    cr_assert_eq(rpc_stream_finish(ghost, &st), PIE_UNAVAILABLE);
    rpc_stream_destroy(w);
    rpc_stream_destroy(ghost);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 0);
}

Test(rpc_health, watch_cancelled_by_client_is_cleaned_up) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    for (int i = 0; i < 20; i++) {
        rpc_stream *w = watch_open(ch, "");
        cr_assert_eq(watch_next(w, 5000), RPC_HEALTH_SERVING);
        rpc_stream_destroy(w); /* cancels */
    }
    /* watchers are gone: a change with no watcher left is fine */
    cr_assert_eq(rpc_server_set_health(t->srv, "", RPC_HEALTH_NOT_SERVING, &st), PIE_OK);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

/* --- rpc_link --- */

/* Hang guard for waits below: far above any real wait, only reached when something is stuck. */
#define HANG_MS 30000

enum { TLINK_MAX_BACKOFFS = 64 };

typedef struct tlink {
    atomic_int connects, disconnects, messages, last_code, backoffs;
    char last_text[64];
    unsigned attempt[TLINK_MAX_BACKOFFS]; /* what on_backoff reported, in order (under mu) */
    int64_t delay_ms[TLINK_MAX_BACKOFFS];
    pthread_mutex_t mu;
} tlink;

static void l_connect(rpc_link *l, void *user) {
    tlink *t = user;
    atomic_fetch_add(&t->connects, 1);
    char text[32];
    snprintf(text, sizeof text, "register-%d", atomic_load(&t->connects));
    tmsg m = tmsg_of(text);
    pie_status st;
    pie_code rc = rpc_link_send(l, &m.base, &st);
    if (rc != PIE_OK) fprintf(stderr, "link send: %s\n", st.msg);
}

static bool l_message(rpc_link *l, ProtobufCMessage *msg, void *user) {
    (void)l;
    tlink *t = user;
    pthread_mutex_lock(&t->mu);
    snprintf(t->last_text, sizeof t->last_text, "%s", tmsg_text(msg));
    pthread_mutex_unlock(&t->mu);
    atomic_fetch_add(&t->messages, 1);
    return false;
}

static void l_disconnect(rpc_link *l, const pie_status *st, void *user) {
    (void)l;
    tlink *t = user;
    atomic_store(&t->last_code, (int)st->code);
    atomic_fetch_add(&t->disconnects, 1);
}

static void l_backoff(rpc_link *l, unsigned attempt, int64_t delay_ms, void *user) {
    (void)l;
    tlink *t = user;
    pthread_mutex_lock(&t->mu);
    int i = atomic_load(&t->backoffs);
    if (i < TLINK_MAX_BACKOFFS) {
        t->attempt[i] = attempt;
        t->delay_ms[i] = delay_ms;
    }
    atomic_store(&t->backoffs, i + 1); /* after the record: a reader of the count sees it */
    pthread_mutex_unlock(&t->mu);
}

static bool last_text_is(tlink *t, const char *want) {
    pthread_mutex_lock(&t->mu);
    bool eq = strcmp(t->last_text, want) == 0;
    pthread_mutex_unlock(&t->mu);
    return eq;
}

/* Resets the counters and records of a tlink (each test's is static: its address is the
 * link's user pointer) and initialises its mutex. */
static void tlink_init(tlink *t) {
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
}

static rpc_link_opts link_opts(tlink *t) {
    return (rpc_link_opts){
        .path = "/test.Echo/Chat",
        .response = TMSG_DESC,
        .backoff_initial_ms = 20,
        .backoff_max_ms = 200,
        .on_connect = l_connect,
        .on_message = l_message,
        .on_disconnect = l_disconnect,
        .on_backoff = l_backoff,
        .user = t,
    };
}

typedef struct link_stopper {
    rpc_link *l;
    atomic_bool done;
} link_stopper;

static void *link_stopper_main(void *arg) {
    link_stopper *s = arg;
    rpc_link_stop(s->l);
    atomic_store(&s->done, true);
    return NULL;
}

/* rpc_link_stop from another thread, so that a stop that never returns fails the test with a
 * message instead of hanging it: `why` says what should have ended the wait. */
static void link_stop_or_fail(rpc_link *l, const char *why) {
    static link_stopper s; /* static: still valid for the thread if the assertion ends the test */
    s.l = l;
    atomic_store(&s.done, false);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, link_stopper_main, &s), 0);
    cr_assert(TWAIT(atomic_load(&s.done), HANG_MS), "rpc_link_stop did not return (%s)", why);
    pthread_join(th, NULL);
}

static rpc_channel_opts fast_reconnect = {.reconnect_initial_ms = 50, .reconnect_max_ms = 200};

Test(rpc_link, reconnects_after_the_server_restarts_on_the_same_port) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    int port = t->port;
    rpc_channel *ch = tchan(port, &fast_reconnect);
    static tlink tl;
    tlink_init(&tl);
    rpc_link_opts o = link_opts(&tl);
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "register-1"), HANG_MS), "first registration echoed");
    cr_assert(rpc_link_connected(l));
    tmsg m = tmsg_of("hello");
    cr_assert_eq(rpc_link_send(l, &m.base, &st), PIE_OK, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "hello"), HANG_MS));

    tsrv_stop(t, 0); /* the server goes away */
    cr_assert(TWAIT(atomic_load(&tl.disconnects) >= 1, HANG_MS));
    int code = atomic_load(&tl.last_code);
    cr_assert(code == PIE_UNAVAILABLE || code == PIE_CANCELLED, "disconnect code %s",
              pie_code_name(code));
    cr_assert(TWAIT(!rpc_link_connected(l), HANG_MS));
    cr_assert_eq(rpc_link_send(l, &m.base, &st), PIE_UNAVAILABLE, "no stream, no send");
    /* a few failed attempts while the server is down: the lost stream and two more */
    cr_assert(TWAIT(atomic_load(&tl.disconnects) >= 3, HANG_MS),
              "the link stopped retrying while the server was down (%d attempts ended)",
              atomic_load(&tl.disconnects));
    cr_assert_eq(atomic_load(&tl.connects), 1, "no attempt connected while the server was down");

    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    t = tsrv_start(&(rpc_server_opts){.addr = addr}, &st);
    cr_assert(t, "restart on %s: %s", addr, st.msg);
    cr_assert(TWAIT(atomic_load(&tl.connects) == 2, HANG_MS), "reconnected (connects=%d)",
              atomic_load(&tl.connects));
    cr_assert(TWAIT(last_text_is(&tl, "register-2"), HANG_MS), "re-registered on the new stream");
    cr_assert_eq(rpc_link_connects(l), 2u);
    cr_assert_eq(rpc_link_send(l, &m.base, &st), PIE_OK, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "hello"), HANG_MS));

    /* the stream waits for messages with no deadline: only the cancel in stop can end it */
    link_stop_or_fail(l, "stop must cancel the open stream");
    cr_assert(TWAIT(atomic_load(&t->n_done) == 1, HANG_MS), "the server saw the stream end");
    cr_assert_eq(atomic_load(&t->n_cancel), 1);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
    pthread_mutex_destroy(&tl.mu);
}

/* Issue 11, hole 7: a message packed for one stream must never leave on the stream of a later
 * reconnect, and a stream ended because something was lost reports why. */
Test(rpc_link, a_send_for_an_ended_stream_never_reaches_the_next_one) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, &fast_reconnect);
    static tlink tl;
    tlink_init(&tl);
    rpc_link_opts o = link_opts(&tl);
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "register-1"), HANG_MS), "first registration echoed");
    uint64_t g1 = rpc_link_generation(l);
    cr_assert_eq(g1, 1u);

    rpc_link_reset(l, g1, PIE_UNAVAILABLE, "test: a message of stream 1 was lost");
    cr_assert(TWAIT(last_text_is(&tl, "register-2"), HANG_MS), "reconnected after the reset");
    cr_assert_eq(atomic_load(&tl.disconnects), 1);
    cr_assert_eq(atomic_load(&tl.last_code), PIE_UNAVAILABLE, "on_disconnect got %s",
                 pie_code_name(atomic_load(&tl.last_code)));
    uint64_t g2 = rpc_link_generation(l);
    cr_assert_eq(g2, 2u);

    tmsg stale = tmsg_of("stale"), fresh = tmsg_of("fresh");
    cr_assert_eq(rpc_link_send_gen(l, g1, &stale.base, &st), PIE_UNAVAILABLE,
                 "a message for stream 1 was sent on stream 2");
    cr_assert_eq(rpc_link_send_gen(l, g2, &fresh.base, &st), PIE_OK, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "fresh"), HANG_MS));
    cr_assert_eq(atomic_load(&t->n_msg), 3, "register-1, register-2, fresh: nothing stale");
    /* A reset of a stream that already ended does nothing to the one open now. */
    rpc_link_reset(l, g1, PIE_UNAVAILABLE, "late");
    tsleep_ms(100);
    cr_assert_eq(rpc_link_generation(l), g2);
    cr_assert_eq(atomic_load(&tl.disconnects), 1);

    link_stop_or_fail(l, "stop must cancel the open stream");
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
    pthread_mutex_destroy(&tl.mu);
}

typedef struct reason_link {
    atomic_int disconnects;
    pie_status st; /* the first on_disconnect's, under mu */
    pthread_mutex_t mu;
} reason_link;

static bool r_message(rpc_link *l, ProtobufCMessage *msg, void *user) {
    (void)l;
    (void)msg;
    (void)user;
    return false;
}

static void r_disconnect(rpc_link *l, const pie_status *st, void *user) {
    (void)l;
    reason_link *r = user;
    pthread_mutex_lock(&r->mu);
    if (atomic_load(&r->disconnects) == 0) r->st = *st;
    pthread_mutex_unlock(&r->mu);
    atomic_fetch_add(&r->disconnects, 1);
}

Test(rpc_link, reset_reports_its_reason_to_on_disconnect) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, &fast_reconnect);
    static reason_link r;
    memset(&r, 0, sizeof r);
    pthread_mutex_init(&r.mu, NULL);
    rpc_link_opts o = {.path = "/test.Echo/Chat",
                       .response = TMSG_DESC,
                       .backoff_initial_ms = 20,
                       .on_message = r_message,
                       .on_disconnect = r_disconnect,
                       .user = &r};
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(rpc_link_generation(l) == 1, HANG_MS));
    rpc_link_reset(l, 1, PIE_UNAVAILABLE, "test: the reason");
    cr_assert(TWAIT(atomic_load(&r.disconnects) >= 1, HANG_MS));
    pthread_mutex_lock(&r.mu);
    pie_status got = r.st;
    pthread_mutex_unlock(&r.mu);
    cr_assert_eq(got.code, PIE_UNAVAILABLE, "%s: %s", pie_code_name(got.code), got.msg);
    cr_assert_str_eq(got.msg, "test: the reason");
    cr_assert(TWAIT(rpc_link_generation(l) == 2, HANG_MS), "the link reconnected");
    link_stop_or_fail(l, "stop must cancel the open stream");
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
    pthread_mutex_destroy(&r.mu);
}

Test(rpc_link, connects_when_the_server_comes_up_later_and_stops_while_waiting) {
    pie_status st;
    /* find a free port, then leave it unserved */
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    int port = t->port;
    tsrv_stop(t, 0);
    rpc_channel *ch = tchan(port, &fast_reconnect);
    static tlink tl;
    tlink_init(&tl);
    rpc_link_opts o = link_opts(&tl);
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(atomic_load(&tl.disconnects) >= 2, HANG_MS), "failed attempts are reported");
    cr_assert_eq(atomic_load(&tl.connects), 0);
    cr_assert_eq(atomic_load(&tl.last_code), PIE_UNAVAILABLE);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    t = tsrv_start(&(rpc_server_opts){.addr = addr}, &st);
    cr_assert(t, "%s", st.msg);
    cr_assert(TWAIT(atomic_load(&tl.connects) == 1, HANG_MS));
    cr_assert(TWAIT(last_text_is(&tl, "register-1"), HANG_MS));
    link_stop_or_fail(l, "stop must cancel the open stream");
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);

    /* Stop during the backoff wait returns without waiting it out: the wait (10 min) is far
     * longer than the hang guard, so only an interrupted wait lets the stop return in time. */
    ch = tchan(port, &fast_reconnect);
    rpc_link_opts slow = link_opts(&tl);
    slow.backoff_initial_ms = 600000;
    slow.backoff_max_ms = 600000;
    int backoffs = atomic_load(&tl.backoffs);
    l = rpc_link_start(ch, &slow, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(atomic_load(&tl.backoffs) == backoffs + 1, HANG_MS),
              "the first attempt failed and the link began its backoff");
    link_stop_or_fail(l, "stop must interrupt the 10 min backoff wait");
    rpc_channel_destroy(ch);
    pthread_mutex_destroy(&tl.mu);
}

Test(rpc_link, start_validates_its_options) {
    pie_status st;
    rpc_channel *ch = tchan(1, NULL);
    rpc_link_opts o = {.path = "/a.B/C", .response = TMSG_DESC};
    cr_assert_null(rpc_link_start(ch, &o, &st));
    cr_assert_eq(st.code, PIE_INVALID_ARGUMENT);
    rpc_channel_destroy(ch);
}

/* Runs a link against the unserved port until on_backoff has reported n delays, stops it and
 * leaves the records in *tl. */
static void record_backoffs(int port, tlink *tl, rpc_link_opts o, int n) {
    rpc_channel *ch = tchan(port, &fast_reconnect);
    pie_status st;
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(atomic_load(&tl->backoffs) >= n, HANG_MS), "only %d of %d backoffs reported",
              atomic_load(&tl->backoffs), n);
    link_stop_or_fail(l, "stop must interrupt the backoff wait");
    rpc_channel_destroy(ch);
    cr_assert_eq(atomic_load(&tl->connects), 0, "nothing serves the port");
}

Test(rpc_link, backoff_grows_with_jitter_up_to_the_cap) {
    /* The schedule is read from on_backoff, not timed: initial 50 ms, ×2 per failed attempt,
     * capped at 200 ms, each delay within ±20% jitter of 50, 100, 200, 200, ... */
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    int port = t->port;
    tsrv_stop(t, 0);
    static tlink tl;
    tlink_init(&tl);
    rpc_link_opts o = link_opts(&tl);
    o.backoff_initial_ms = 50;
    o.backoff_max_ms = 200;
    o.backoff_multiplier = 2;
    enum { N = 8 };
    record_backoffs(port, &tl, o, N);
    int jittered = 0;
    for (int k = 0; k < N; k++) {
        int64_t base = k == 0 ? 50 : k == 1 ? 100 : 200;
        cr_assert_eq(tl.attempt[k], (unsigned)k, "backoff %d reported attempt %u", k,
                     tl.attempt[k]);
        /* -1: 0.8 × base in floating point may truncate to one below */
        cr_assert(tl.delay_ms[k] >= base * 8 / 10 - 1 && tl.delay_ms[k] <= base * 12 / 10,
                  "attempt %d: delay %lld ms is not within 20%% of %lld ms", k,
                  (long long)tl.delay_ms[k], (long long)base);
        if (tl.delay_ms[k] != base) jittered++;
    }
    /* A jittered delay lands exactly on its base with probability 1/20 for 50 ms (1 ms of a
     * 20 ms range), 1/40 for 100 ms and 1/80 for 200 ms: all eight doing so (< 1e-14) means
     * no jitter was applied. */
    cr_assert_gt(jittered, 0, "no delay was jittered");

    /* Without jitter the schedule is exact. */
    pthread_mutex_destroy(&tl.mu);
    tlink_init(&tl);
    o.backoff_jitter = -1;
    record_backoffs(port, &tl, o, 4);
    const int64_t want[4] = {50, 100, 200, 200};
    for (int k = 0; k < 4; k++)
        cr_assert_eq(tl.delay_ms[k], want[k], "attempt %d: delay %lld ms, want %lld", k,
                     (long long)tl.delay_ms[k], (long long)want[k]);
    pthread_mutex_destroy(&tl.mu);
}
