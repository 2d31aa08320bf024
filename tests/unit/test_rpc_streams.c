/* test_rpc_streams.c — cancellation both ways, late sends, backpressure, many concurrent
 * streams and shutdown with calls in flight, for services/common/rpc. */
#include <criterion/criterion.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_rpc_util.h"

static tsrv *T;
static rpc_channel *CH;

static void setup(void) {
    pie_status st;
    /* two completion-queue threads: calls land on either, sends come from any thread */
    T = tsrv_start(&(rpc_server_opts){.n_threads = 2}, &st);
    cr_assert(T, "server start: %s", st.msg);
    CH = tchan(T->port, NULL);
    cr_assert(CH);
}

static void teardown(void) {
    rpc_channel_destroy(CH);
    tsrv_stop(T, 1000);
    TLEAK_CHECK();
}

static void leak_check(void) { TLEAK_CHECK(); }

/* One timeout for every test of this file: with different ones, Criterion's runner (its BoxFort
 * timeout list) was seen to leak 48 bytes under -j2, which fails the ASan build's run. */
TestSuite(rpc_streams, .init = setup, .fini = teardown, .timeout = 120);

static rpc_stream *chat_open(rpc_channel *ch) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(ch, "/test.Echo/Chat", TMSG_DESC, NULL, &st);
    cr_assert(s, "%s", st.msg);
    return s;
}

static void chat_roundtrip(rpc_stream *s, const char *text) {
    pie_status st;
    tmsg m = tmsg_of(text);
    cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK, "send %s: %s", text, st.msg);
    ProtobufCMessage *r = NULL;
    cr_assert_eq(rpc_stream_recv(s, &r, 10000), RPC_RECV_MESSAGE, "echo of %s", text);
    cr_assert_str_eq(tmsg_text(r), text);
    rpc_msg_free(r);
}

Test(rpc_streams, client_cancel_mid_stream_is_seen_as_cancel_not_half_close) {
    rpc_stream *s = chat_open(CH);
    chat_roundtrip(s, "one");
    chat_roundtrip(s, "two");
    rpc_stream_cancel(s);
    pie_status st;
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_CANCELLED, "%s", pie_code_name(st.code));
    rpc_stream_destroy(s);
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, 5000), "on_done ran");
    cr_assert_eq(atomic_load(&T->n_cancel), 1, "on_cancel ran once");
    cr_assert_eq(atomic_load(&T->n_half), 0, "a cancel is not a half-close");
}

Test(rpc_streams, client_cancel_of_a_client_stream_is_cancel) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(CH, "/test.Echo/Collect", TMSG_DESC, NULL, &st);
    cr_assert(s);
    tmsg m = tmsg_of("x");
    cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK);
    cr_assert(TWAIT(atomic_load(&T->n_msg) == 1, 5000));
    rpc_stream_cancel(s);
    cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_CANCELLED, "send after cancel");
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_CANCELLED);
    rpc_stream_destroy(s);
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, 5000));
    cr_assert_eq(atomic_load(&T->n_cancel), 1);
    cr_assert_eq(atomic_load(&T->n_half), 0);
}

Test(rpc_streams, destroy_without_finish_cancels) {
    rpc_stream *s = chat_open(CH);
    chat_roundtrip(s, "x");
    rpc_stream_destroy(s);
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, 5000));
    cr_assert_eq(atomic_load(&T->n_cancel), 1);
}

Test(rpc_streams, server_finish_with_error_mid_stream_reaches_client) {
    rpc_stream *s = chat_open(CH);
    chat_roundtrip(s, "hi");
    pie_status st;
    tmsg m = tmsg_of("abort");
    cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK);
    ProtobufCMessage *r = NULL;
    cr_assert_eq(rpc_stream_recv(s, &r, 5000), RPC_RECV_END);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_ABORTED, "%s", pie_code_name(st.code));
    cr_assert_str_eq(st.msg, "told to abort");
    rpc_stream_destroy(s);
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, 5000));
    cr_assert_eq(atomic_load(&T->n_cancel), 0, "a finish is not a cancel");
}

Test(rpc_streams, server_cancel_reaches_client_with_its_status) {
    rpc_stream *s = chat_open(CH);
    chat_roundtrip(s, "hi");
    pie_status st;
    tmsg m = tmsg_of("cancel");
    cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK);
    ProtobufCMessage *r = NULL;
    cr_assert_eq(rpc_stream_recv(s, &r, 5000), RPC_RECV_END);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_PERMISSION_DENIED, "%s: %s", pie_code_name(st.code),
                 st.msg);
    cr_assert_str_eq(st.msg, "told to cancel");
    /* the client keeps sending into a finished call: refused, never a crash */
    cr_assert_neq(rpc_stream_send(s, &m.base, &st), PIE_OK);
    rpc_stream_destroy(s);
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, 5000));
    cr_assert_eq(atomic_load(&T->n_cancel), 1, "the handler's own cancel is reported");
}

Test(rpc_streams, late_sends_after_cancel_fail_with_cancelled) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(CH, "/test.Echo/Repeat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    tmsg req = tmsg_of("100000000");
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK);
    for (int i = 0; i < 3; i++) {
        ProtobufCMessage *r = NULL;
        cr_assert_eq(rpc_stream_recv(s, &r, 5000), RPC_RECV_MESSAGE);
        rpc_msg_free(r);
    }
    rpc_stream_cancel(s);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_CANCELLED);
    rpc_stream_destroy(s);
    cr_assert(TWAIT(atomic_load(&T->n_late_cancelled) == 1, 5000),
              "the sender thread saw CANCELLED");
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, 5000));
    cr_assert_eq(atomic_load(&T->n_cancel), 1);
}

Test(rpc_streams, send_queue_is_bounded_and_drains_in_order) {
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.send_queue_max = 4}, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    rpc_stream *s = rpc_stream_open(ch, "/test.Echo/Repeat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    tmsg req = tmsg_of("flood:65536");
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK);
    /* Not reading: flow control stops the transport, the queue fills, send says so. */
    cr_assert(TWAIT(atomic_load(&t->flood_accepted) > 0, 20000), "queue never filled");
    int accepted = atomic_load(&t->flood_accepted);
    cr_assert(accepted >= 4 && accepted < 200, "accepted %d messages", accepted);
    int got = 0;
    ProtobufCMessage *r = NULL;
    while (rpc_stream_recv(s, &r, 10000) == RPC_RECV_MESSAGE) {
        cr_assert_eq(strlen(tmsg_text(r)), 65536u);
        rpc_msg_free(r);
        got++;
    }
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(got, accepted, "every accepted message arrived");
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

/* Issue 11, hole 7: a queue bounded in bytes, not only in messages. */
Test(rpc_streams, send_queue_byte_bound_refuses_a_flood_the_client_does_not_read) {
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.send_queue_max_bytes = 3 * 65536}, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    rpc_stream *s = rpc_stream_open(ch, "/test.Echo/Repeat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    tmsg req = tmsg_of("flood:65536");
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK);
    /* Not reading: the transport stops, three 64 KiB messages fill the queue, send refuses. */
    cr_assert(TWAIT(atomic_load(&t->flood_accepted) > 0, 20000),
              "the byte bound never refused a message");
    int accepted = atomic_load(&t->flood_accepted);
    cr_assert(accepted >= 2 && accepted < 200, "accepted %d messages", accepted);
    int got = 0;
    ProtobufCMessage *r = NULL;
    while (rpc_stream_recv(s, &r, 10000) == RPC_RECV_MESSAGE) {
        cr_assert_eq(strlen(tmsg_text(r)), 65536u);
        rpc_msg_free(r);
        got++;
    }
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(got, accepted, "every accepted message arrived");
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

Test(rpc_streams, send_queue_byte_bound_takes_one_message_larger_than_itself) {
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.send_queue_max_bytes = 1000}, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    rpc_stream *s = rpc_stream_open(ch, "/test.Echo/Chat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    char big[4001];
    memset(big, 'b', 4000);
    big[4000] = '\0';
    tmsg m = tmsg_of(big);
    for (int i = 0; i < 3; i++) { /* echoed one at a time: the queue is empty each time */
        cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK, "%s", st.msg);
        ProtobufCMessage *r = NULL;
        cr_assert_eq(rpc_stream_recv(s, &r, 10000), RPC_RECV_MESSAGE, "echo %d", i);
        cr_assert_eq(strlen(tmsg_text(r)), 4000u);
        rpc_msg_free(r);
    }
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

Test(rpc_streams, send_wait_applies_backpressure_without_loss) {
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.send_queue_max = 2}, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    rpc_stream *s = rpc_stream_open(ch, "/test.Echo/Repeat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    tmsg req = tmsg_of("2000");
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK);
    for (int i = 0; i < 2000; i++) {
        ProtobufCMessage *r = NULL;
        cr_assert_eq(rpc_stream_recv(s, &r, 10000), RPC_RECV_MESSAGE, "message %d", i);
        cr_assert_eq(atoi(tmsg_text(r)), i);
        rpc_msg_free(r);
    }
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 1000);
}

/* Reads s to its end: every message must be a "room" message in order; returns the count. */
static int read_room_messages(rpc_stream *s) {
    int got = 0;
    ProtobufCMessage *r = NULL;
    while (rpc_stream_recv(s, &r, 10000) == RPC_RECV_MESSAGE) {
        cr_assert_eq(strlen(tmsg_text(r)), (size_t)TROOM_MSG);
        cr_assert_eq(atoi(tmsg_text(r)), got, "message %d is \"%.8s\"", got, tmsg_text(r));
        rpc_msg_free(r);
        got++;
    }
    pie_status st;
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    return got;
}

Test(rpc_streams, wait_room_holds_a_producer_to_its_byte_bound_until_its_deadline) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(CH, "/test.Echo/Repeat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    tmsg req = tmsg_of("room:100000:300");
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK);
    /* Not reading: flow control stops the transport, the producer waits, its deadline passes. */
    cr_assert(TWAIT(atomic_load(&T->room_rc) != 0, THANG_MS), "the producer never waited");
    cr_assert_eq(atomic_load(&T->room_rc), PIE_DEADLINE_EXCEEDED, "%s",
                 pie_code_name((pie_code)atomic_load(&T->room_rc)));
    /* 100 messages would be allowed: the byte bound let at most two wait, three after a send */
    cr_assert_leq(atomic_load(&T->room_max_queued), 3);
    cr_assert_eq(read_room_messages(s), atomic_load(&T->room_sent), "every sent message arrived");
    rpc_stream_destroy(s);
}

Test(rpc_streams, end_waits_releases_a_producer_waiting_without_deadline) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(CH, "/test.Echo/Repeat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    tmsg req = tmsg_of("room:100000:-1");
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK);
    cr_assert(TWAIT(atomic_load(&T->room_call) != NULL, THANG_MS), "no Repeat call");
    rpc_call_end_waits(atomic_load(&T->room_call));
    cr_assert(TWAIT(atomic_load(&T->room_rc) != 0, THANG_MS), "end_waits did not release it");
    cr_assert_eq(atomic_load(&T->room_rc), PIE_ABORTED, "%s",
                 pie_code_name((pie_code)atomic_load(&T->room_rc)));
    cr_assert_eq(read_room_messages(s), atomic_load(&T->room_sent), "every sent message arrived");
    rpc_stream_destroy(s);
}

typedef struct recv_ctx {
    rpc_stream *s;
    int n;
} recv_ctx;

static void *receiver(void *arg) {
    recv_ctx *c = arg;
    ProtobufCMessage *r = NULL;
    while (rpc_stream_recv(c->s, &r, 10000) == RPC_RECV_MESSAGE) {
        rpc_msg_free(r);
        c->n++;
    }
    return NULL;
}

Test(rpc_streams, one_sender_and_one_receiver_thread_share_a_stream) {
    rpc_stream *s = chat_open(CH);
    recv_ctx c = {s, 0};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, receiver, &c), 0);
    pie_status st;
    for (int i = 0; i < 500; i++) {
        tmsg m = tmsg_of("ping");
        cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK, "%s", st.msg);
    }
    cr_assert_eq(rpc_stream_close_send(s, &st), PIE_OK);
    pthread_join(th, NULL);
    cr_assert_eq(c.n, 500, "received %d", c.n);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    rpc_stream_destroy(s);
}

#define N_STREAMS 1000

Test(rpc_streams, thousand_concurrent_bidi_streams) {
    static rpc_stream *s[N_STREAMS];
    char text[32];
    pie_status st;
    for (int i = 0; i < N_STREAMS; i++) {
        s[i] = chat_open(CH);
        snprintf(text, sizeof text, "%d-a", i);
        tmsg m = tmsg_of(text);
        cr_assert_eq(rpc_stream_send(s[i], &m.base, &st), PIE_OK, "stream %d: %s", i, st.msg);
    }
    cr_assert(TWAIT(atomic_load(&T->n_call) == N_STREAMS, 20000), "%d calls arrived",
              atomic_load(&T->n_call));
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N_STREAMS; i++) {
            ProtobufCMessage *r = NULL;
            cr_assert_eq(rpc_stream_recv(s[i], &r, 20000), RPC_RECV_MESSAGE, "stream %d", i);
            snprintf(text, sizeof text, "%d-%c", i, round ? 'b' : 'a');
            cr_assert_str_eq(tmsg_text(r), text);
            rpc_msg_free(r);
            if (round == 0) {
                snprintf(text, sizeof text, "%d-b", i);
                tmsg m = tmsg_of(text);
                cr_assert_eq(rpc_stream_send(s[i], &m.base, &st), PIE_OK, "%s", st.msg);
            }
        }
    }
    for (int i = 0; i < N_STREAMS; i++) {
        cr_assert_eq(rpc_stream_finish(s[i], &st), PIE_OK, "stream %d: %s", i, st.msg);
        cr_assert_str_eq(rpc_stream_trailing_metadata(s[i], "x-count"), "2");
        rpc_stream_destroy(s[i]);
    }
    cr_assert(TWAIT(atomic_load(&T->n_done) == N_STREAMS, 20000));
    cr_assert_eq(atomic_load(&T->n_msg), 2 * N_STREAMS);
    cr_assert_eq(atomic_load(&T->n_cancel), 0);
}

TestSuite(rpc_shutdown, .fini = leak_check, .timeout = 120);

/* Waits for a shutdown started with tshutdown_start; `why` says what should have ended it. */
static void shutdown_returns(tshutdown *sd, const char *why) {
    cr_assert(TWAIT(atomic_load(&sd->done), THANG_MS), "rpc_server_shutdown did not return: %s",
              why);
    pthread_join(sd->th, NULL);
}

Test(rpc_shutdown, calls_in_flight_are_cancelled_after_the_grace_period) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    rpc_stream *s[5];
    for (int i = 0; i < 5; i++) {
        s[i] = chat_open(ch);
        chat_roundtrip(s[i], "live");
    }
    /* never answered; its deadline is far past the hang guard, so only the server's cancel
     * ends it in time (and with UNAVAILABLE or CANCELLED, not DEADLINE_EXCEEDED) */
    tunary u = {.ch = ch, .text = "sleep", .timeout_ms = 10 * THANG_MS};
    cr_assert_eq(tunary_start(&u), 0);
    cr_assert(TWAIT(atomic_load(&t->n_call) == 6, THANG_MS));
    tshutdown sd;
    cr_assert_eq(tshutdown_start(&sd, t->srv, 200), 0);
    shutdown_returns(&sd, "calls in flight are cancelled when the 200 ms grace period ends");
    cr_assert_eq(atomic_load(&t->n_cancel), 6, "every handler saw its cancel");
    cr_assert_eq(atomic_load(&t->n_done), 6);
    pthread_join(u.th, NULL);
    cr_assert(u.rc == PIE_UNAVAILABLE || u.rc == PIE_CANCELLED, "unary got %s",
              pie_code_name(u.rc));
    for (int i = 0; i < 5; i++) {
        pie_code rc = rpc_stream_finish(s[i], &st);
        cr_assert(rc == PIE_UNAVAILABLE || rc == PIE_CANCELLED, "stream got %s", pie_code_name(rc));
        rpc_stream_destroy(s[i]);
    }
    /* new calls are refused */
    tunary v = {.ch = ch, .text = "x"};
    tunary_main(&v);
    cr_assert_eq(v.rc, PIE_UNAVAILABLE, "%s", pie_code_name(v.rc));
    rpc_channel_destroy(ch);
    tsrv_stop(t, 0);
}

/* The server no longer serves: Check fails or says NOT_SERVING (shutdown began). */
static bool stopped_serving(rpc_channel *ch) {
    pie_status st;
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    return rpc_health_check(ch, "", 5000, &hs, &st) != PIE_OK || hs != RPC_HEALTH_SERVING;
}

Test(rpc_shutdown, calls_that_finish_within_the_grace_period_succeed) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    rpc_channel *ch = tchan(t->port, NULL);
    tunary u = {.ch = ch, .text = "later"};
    cr_assert_eq(tunary_start(&u), 0);
    cr_assert(TWAIT(atomic_load(&t->n_call) == 1, THANG_MS));
    /* A grace period far past the hang guard: shutdown can only return in time by ending with
     * its last call. The call is answered only once the shutdown has begun. */
    tshutdown sd;
    cr_assert_eq(tshutdown_start(&sd, t->srv, 10 * THANG_MS), 0);
    rpc_channel *probe = tchan(t->port, NULL);
    cr_assert(TWAIT(stopped_serving(probe), THANG_MS), "the shutdown never began");
    rpc_channel_destroy(probe);
    cr_assert(!atomic_load(&u.done), "the call in flight ended when the shutdown began: %s %s",
              pie_code_name(u.rc), u.out);
    cr_assert(!atomic_load(&sd.done), "the shutdown ended with a call in flight");
    tsrv_release(t);
    pthread_join(u.th, NULL);
    cr_assert_eq(u.rc, PIE_OK, "%s", u.out);
    cr_assert_str_eq(u.out, "later-done");
    shutdown_returns(&sd, "it waited for the grace period instead of ending with the last call");
    cr_assert_eq(atomic_load(&t->n_cancel), 0);
    rpc_channel_destroy(ch);
    tsrv_stop(t, 0);
}

Test(rpc_shutdown, idle_server_stops_at_once_and_destroy_alone_suffices) {
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "%s", st.msg);
    tshutdown sd;
    cr_assert_eq(tshutdown_start(&sd, t->srv, 10 * THANG_MS), 0);
    shutdown_returns(&sd, "an idle server does not wait for its grace period");
    tsrv_stop(t, 0);
    rpc_server *srv = rpc_server_create(&(rpc_server_opts){.addr = "127.0.0.1:0"}, &st);
    cr_assert(srv);
    cr_assert_eq(rpc_server_start(srv, &st), PIE_OK, "%s", st.msg);
    rpc_server_destroy(srv);
}

/* ---- fairness between connections on one completion-queue thread ---------------------------- */

TestSuite(rpc_fairness, .fini = leak_check, .timeout = 120);

/* The echo server with one completion-queue thread, alone in a child process: in the test's own
 * process the client's threads would poll the server's connections too (gRPC's epoll1 engine
 * has one epoll set per process), which hides what one server thread does alone. Writes the
 * port to fd, then serves until killed. Forked before this process touches gRPC. */
static void serve_alone(int fd) {
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.n_threads = 1}, &st);
    int port = t ? t->port : -1;
    if (write(fd, &port, sizeof port) != (ssize_t)sizeof port || !t) _exit(1);
    for (;;) pause();
}

/* A stream whose messages are already in the transport completes each receive at once, so a
 * thread that only popped its queue would serve that stream to its last buffered message
 * before it read any other connection (the controller, under one instance's call flood, heard
 * its worker ~1 s late and dropped it as silent). */
Test(rpc_fairness, a_busy_stream_does_not_starve_another_connection) {
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) serve_alone(fds[1]);
    int port = -1;
    cr_assert_eq(read(fds[0], &port, sizeof port), (ssize_t)sizeof port);
    close(fds[0]);
    close(fds[1]);
    cr_assert_gt(port, 0, "the child's server did not start");
    pie_status st;
    rpc_channel *busy_ch = tchan(port, NULL), *other_ch = tchan(port, NULL);
    cr_assert(busy_ch && other_ch);
    tunary warm = {.ch = other_ch, .text = "warm"}; /* connects the other channel first */
    tunary_main(&warm);
    cr_assert_eq(warm.rc, PIE_OK, "%s", warm.out);
    rpc_stream *s = rpc_stream_open(busy_ch, "/test.Echo/Collect", TMSG_DESC, NULL, &st);
    cr_assert(s, "%s", st.msg);
    enum { N_BUSY = 50 }; /* 1 s of work on the server thread */
    tmsg busy = tmsg_of("busy:20");
    for (int i = 0; i < N_BUSY; i++)
        cr_assert_eq(rpc_stream_send(s, &busy.base, &st), PIE_OK, "%s", st.msg);
    tsleep_ms(100); /* the server is in the first busy messages, the others buffered */
    tunary mark = {.ch = other_ch, .text = "mark"};
    tunary_main(&mark);
    cr_assert_eq(mark.rc, PIE_OK, "%s", mark.out);
    int at = atoi(mark.out);
    /* a starving thread answers the mark after all N_BUSY; a fair one after those it served
     * before the mark arrived (~5) and one or two more, with room for a slow client */
    cr_expect_lt(at, N_BUSY - 10, "the other call waited for %d of %d buffered messages", at,
                 N_BUSY);
    cr_assert_eq(rpc_stream_close_send(s, &st), PIE_OK, "%s", st.msg);
    ProtobufCMessage *r = NULL;
    cr_assert_eq(rpc_stream_recv(s, &r, THANG_MS), RPC_RECV_MESSAGE, "the collected reply");
    rpc_msg_free(r);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    rpc_stream_destroy(s);
    rpc_channel_destroy(busy_ch);
    rpc_channel_destroy(other_ch);
    kill(pid, SIGKILL);
    cr_assert_eq(waitpid(pid, NULL, 0), pid);
}
