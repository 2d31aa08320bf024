/* test_rpc_health_link.c — the grpc.health.v1.Health service (Check, Watch, runtime changes,
 * shutdown) and the reconnecting link (rpc_link) of services/common/rpc. */
#include <criterion/criterion.h>

#include "test_rpc_util.h"

typedef Grpc__Health__V1__HealthCheckResponse hresp;
#define HRESP_DESC (&grpc__health__v1__health_check_response__descriptor)

static void leak_check(void) { TLEAK_CHECK(); }

TestSuite(rpc_health, .fini = leak_check, .timeout = 60);
TestSuite(rpc_link, .fini = leak_check, .timeout = 60);

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

Test(rpc_health, check_reports_overall_and_per_service_status, .timeout = 60) {
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

Test(rpc_health, server_can_start_not_serving, .timeout = 60) {
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

Test(rpc_health, watch_pushes_changes_and_ends_at_shutdown, .timeout = 60) {
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
    cr_assert_eq(rpc_server_set_health(t->srv, "svc", RPC_HEALTH_SERVING, &st), PIE_OK);
    cr_assert_eq(watch_next(w, 100), -1, "no push when nothing changed");
    cr_assert_eq(watch_next(ghost, 0), -1, "other services' watchers hear nothing");
    cr_assert_eq(rpc_server_set_health(t->srv, "ghost", RPC_HEALTH_SERVING, &st), PIE_OK);
    cr_assert_eq(watch_next(ghost, 5000), RPC_HEALTH_SERVING, "an unknown service appeared");
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

Test(rpc_health, watch_cancelled_by_client_is_cleaned_up, .timeout = 60) {
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

typedef struct tlink {
    atomic_int connects, disconnects, messages, last_code;
    char last_text[64];
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

static bool last_text_is(tlink *t, const char *want) {
    pthread_mutex_lock(&t->mu);
    bool eq = strcmp(t->last_text, want) == 0;
    pthread_mutex_unlock(&t->mu);
    return eq;
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
        .user = t,
    };
}

static rpc_channel_opts fast_reconnect = {.reconnect_initial_ms = 50, .reconnect_max_ms = 200};

Test(rpc_link, reconnects_after_the_server_restarts_on_the_same_port, .timeout = 60) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    int port = t->port;
    rpc_channel *ch = tchan(port, &fast_reconnect);
    static tlink tl;
    pthread_mutex_init(&tl.mu, NULL);
    rpc_link_opts o = link_opts(&tl);
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "register-1"), 10000), "first registration echoed");
    cr_assert(rpc_link_connected(l));
    tmsg m = tmsg_of("hello");
    cr_assert_eq(rpc_link_send(l, &m.base, &st), PIE_OK, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "hello"), 5000));

    tsrv_stop(t, 0); /* the server goes away */
    cr_assert(TWAIT(atomic_load(&tl.disconnects) >= 1, 10000));
    int code = atomic_load(&tl.last_code);
    cr_assert(code == PIE_UNAVAILABLE || code == PIE_CANCELLED, "disconnect code %s",
              pie_code_name(code));
    cr_assert(TWAIT(!rpc_link_connected(l), 5000));
    cr_assert_eq(rpc_link_send(l, &m.base, &st), PIE_UNAVAILABLE, "no stream, no send");
    tsleep_ms(300); /* a few failed attempts while the server is down */

    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    t = tsrv_start(&(rpc_server_opts){.addr = addr}, &st);
    cr_assert(t, "restart on %s: %s", addr, st.msg);
    cr_assert(TWAIT(atomic_load(&tl.connects) == 2, 15000), "reconnected (connects=%d)",
              atomic_load(&tl.connects));
    cr_assert(TWAIT(last_text_is(&tl, "register-2"), 5000), "re-registered on the new stream");
    cr_assert_eq(rpc_link_connects(l), 2u);
    cr_assert_eq(rpc_link_send(l, &m.base, &st), PIE_OK, "%s", st.msg);
    cr_assert(TWAIT(last_text_is(&tl, "hello"), 5000));

    int64_t t0 = rpc_now_ns();
    rpc_link_stop(l);
    cr_assert((rpc_now_ns() - t0) / 1000000 < 2000, "stop is prompt");
    cr_assert(TWAIT(atomic_load(&t->n_done) == 1, 5000), "the server saw the stream end");
    cr_assert_eq(atomic_load(&t->n_cancel), 1);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
    pthread_mutex_destroy(&tl.mu);
}

Test(rpc_link, connects_when_the_server_comes_up_later_and_stops_while_waiting, .timeout = 60) {
    pie_status st;
    /* find a free port, then leave it unserved */
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    int port = t->port;
    tsrv_stop(t, 0);
    rpc_channel *ch = tchan(port, &fast_reconnect);
    static tlink tl;
    pthread_mutex_init(&tl.mu, NULL);
    rpc_link_opts o = link_opts(&tl);
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l, "%s", st.msg);
    cr_assert(TWAIT(atomic_load(&tl.disconnects) >= 2, 10000), "failed attempts are reported");
    cr_assert_eq(atomic_load(&tl.connects), 0);
    cr_assert_eq(atomic_load(&tl.last_code), PIE_UNAVAILABLE);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    t = tsrv_start(&(rpc_server_opts){.addr = addr}, &st);
    cr_assert(t, "%s", st.msg);
    cr_assert(TWAIT(atomic_load(&tl.connects) == 1, 15000));
    cr_assert(TWAIT(last_text_is(&tl, "register-1"), 5000));
    rpc_link_stop(l);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);

    /* stop during the backoff sleep returns promptly */
    ch = tchan(port, &fast_reconnect);
    rpc_link_opts slow = link_opts(&tl);
    slow.backoff_initial_ms = 30000;
    slow.backoff_max_ms = 30000;
    l = rpc_link_start(ch, &slow, &st);
    cr_assert(l);
    tsleep_ms(100);
    int64_t t0 = rpc_now_ns();
    rpc_link_stop(l);
    cr_assert((rpc_now_ns() - t0) / 1000000 < 2000, "stop interrupted the backoff");
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

Test(rpc_link, backoff_grows_with_jitter_up_to_the_cap, .timeout = 60) {
    /* No server: count attempts over a window with a known schedule. initial 50 ms, ×2, cap
     * 200 ms, ±20%: attempts start at about 0, 50, 150, 350, 550, 750, 950 ms → ~7 in 1 s; a
     * backoff that did not grow would give ~20, one that ignored the cap ~5. */
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t);
    int port = t->port;
    tsrv_stop(t, 0);
    rpc_channel *ch = tchan(port, &fast_reconnect);
    static tlink tl;
    pthread_mutex_init(&tl.mu, NULL);
    rpc_link_opts o = link_opts(&tl);
    o.backoff_initial_ms = 50;
    o.backoff_max_ms = 200;
    o.backoff_multiplier = 2;
    rpc_link *l = rpc_link_start(ch, &o, &st);
    cr_assert(l);
    tsleep_ms(1000);
    rpc_link_stop(l);
    int n = atomic_load(&tl.disconnects);
    cr_assert(n >= 5 && n <= 10, "%d attempts in 1 s", n);
    rpc_channel_destroy(ch);
    pthread_mutex_destroy(&tl.mu);
}
