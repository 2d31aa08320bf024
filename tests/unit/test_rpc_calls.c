/* test_rpc_calls.c — the four call kinds, metadata, deadlines, unknown methods, message size
 * limits, bearer-token auth, the buffer conversion, the channel arguments and connection
 * attempts of services/common/rpc. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rpc_internal.h"
#include "test_rpc_util.h"

static tsrv *T;
static rpc_channel *CH;

static void setup(void) {
    pie_status st;
    T = tsrv_start(NULL, &st);
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

static pie_code unary(rpc_channel *ch, const char *text, int64_t timeout_ms, char *out, size_t n,
                      pie_status *st) {
    tmsg req = tmsg_of(text);
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    pie_code rc = rpc_unary(ch, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp, &o, st);
    if (out) snprintf(out, n, "%s", resp ? tmsg_text(resp) : "");
    rpc_msg_free(resp);
    return rc;
}

TestSuite(rpc_calls, .init = setup, .fini = teardown, .timeout = 60);

Test(rpc_calls, unary_echoes_the_request) {
    pie_status st;
    char out[64];
    cr_assert_eq(unary(CH, "hello", 5000, out, sizeof out, &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(out, "hello");
    cr_assert_eq(unary(CH, "", 5000, out, sizeof out, &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(out, "");
}

Test(rpc_calls, unary_error_status_carries_code_and_message) {
    pie_status st;
    cr_assert_eq(unary(CH, "error", 5000, NULL, 0, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "error requested");
}

/* A "later" call on ch: the handler returns without answering, the reply comes from another
 * thread only after the client is known to be waiting for it. */
static void assert_later_reply(rpc_channel *ch) {
    int calls = atomic_load(&T->n_call);
    tunary u = {.ch = ch, .text = "later"};
    cr_assert_eq(tunary_start(&u), 0);
    cr_assert(TWAIT(atomic_load(&T->n_call) == calls + 1, THANG_MS), "the handler got the call");
    cr_assert(!atomic_load(&u.done), "the call ended before it was answered: %s",
              pie_code_name(u.rc));
    tsrv_release(T);
    pthread_join(u.th, NULL);
    cr_assert_eq(u.rc, PIE_OK, "%s", u.out);
    cr_assert_str_eq(u.out, "later-done");
}

Test(rpc_calls, unary_answered_later_from_another_thread) { assert_later_reply(CH); }

Test(rpc_calls, spinning_client_gets_fast_and_slow_replies) {
    /* spin_us only changes how the caller waits: a reply inside the spin (echo) and one after
     * the caller had to wait ("later", sent once the handler has returned) both arrive intact. */
    rpc_channel *spin = tchan(T->port, &(rpc_channel_opts){.spin_us = 200});
    cr_assert(spin);
    pie_status st;
    char out[64];
    cr_assert_eq(unary(spin, "fast", 5000, out, sizeof out, &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(out, "fast");
    assert_later_reply(spin);
    cr_assert_eq(unary(spin, "error", 5000, NULL, 0, &st), PIE_INVALID_ARGUMENT);
    rpc_channel_destroy(spin);
}

Test(rpc_calls, unary_reads_request_metadata) {
    tmsg req = tmsg_of("meta");
    ProtobufCMessage *resp = NULL;
    rpc_md md[] = {{"x-token", "abc123"}};
    rpc_call_opts o = {.timeout_ms = 5000, .md = md, .n_md = 1};
    pie_status st;
    cr_assert_eq(rpc_unary(CH, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp, &o, &st), PIE_OK,
                 "%s", st.msg);
    cr_assert_str_eq(tmsg_text(resp), "abc123");
    rpc_msg_free(resp);
    rpc_md bad[] = {{"Bad Key", "v"}};
    o.md = bad;
    cr_assert_eq(rpc_unary(CH, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp, &o, &st),
                 PIE_INVALID_ARGUMENT);
}

Test(rpc_calls, client_streaming_collects_every_message) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(CH, "/test.Echo/Collect", TMSG_DESC, NULL, &st);
    cr_assert(s, "%s", st.msg);
    const char *words[] = {"a", "bb", "ccc", "dddd"};
    for (int i = 0; i < 4; i++) {
        tmsg m = tmsg_of(words[i]);
        cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK, "%s", st.msg);
    }
    cr_assert_eq(rpc_stream_close_send(s, &st), PIE_OK, "%s", st.msg);
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_recv(s, &m, 5000), RPC_RECV_MESSAGE);
    cr_assert_str_eq(tmsg_text(m), "a,bb,ccc,dddd");
    rpc_msg_free(m);
    cr_assert_eq(rpc_stream_recv(s, &m, 5000), RPC_RECV_END);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    rpc_stream_destroy(s);
    cr_assert_eq(atomic_load(&T->n_msg), 4);
    cr_assert_eq(atomic_load(&T->n_half), 1);
}

Test(rpc_calls, server_streaming_sends_from_another_thread_in_order) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(CH, "/test.Echo/Repeat", TMSG_DESC, NULL, &st);
    cr_assert(s, "%s", st.msg);
    tmsg req = tmsg_of("200");
    cr_assert_eq(rpc_stream_send(s, &req.base, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(rpc_stream_close_send(s, &st), PIE_OK, "%s", st.msg);
    for (int i = 0; i < 200; i++) {
        ProtobufCMessage *m = NULL;
        cr_assert_eq(rpc_stream_recv(s, &m, 5000), RPC_RECV_MESSAGE, "message %d", i);
        cr_assert_eq(atoi(tmsg_text(m)), i);
        rpc_msg_free(m);
    }
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_recv(s, &m, 5000), RPC_RECV_END);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    rpc_stream_destroy(s);
}

Test(rpc_calls, bidi_echoes_and_carries_metadata_both_ways) {
    pie_status st;
    rpc_md md[] = {{"x-token", "t-42"}};
    rpc_call_opts o = {.md = md, .n_md = 1};
    rpc_stream *s = rpc_stream_open(CH, "/test.Echo/Chat", TMSG_DESC, &o, &st);
    cr_assert(s, "%s", st.msg);
    cr_assert_eq(rpc_stream_wait_ready(s, 5000, &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(rpc_stream_initial_metadata(s, "x-echo-token"), "t-42");
    for (int i = 0; i < 50; i++) {
        char text[16];
        snprintf(text, sizeof text, "m%d", i);
        tmsg m = tmsg_of(text);
        cr_assert_eq(rpc_stream_send(s, &m.base, &st), PIE_OK, "%s", st.msg);
        ProtobufCMessage *r = NULL;
        cr_assert_eq(rpc_stream_recv(s, &r, 5000), RPC_RECV_MESSAGE);
        cr_assert_str_eq(tmsg_text(r), text);
        rpc_msg_free(r);
    }
    ProtobufCMessage *r = NULL;
    cr_assert_eq(rpc_stream_recv(s, &r, 0), RPC_RECV_TIMEOUT, "nothing is pending");
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(rpc_stream_trailing_metadata(s, "x-count"), "50");
    rpc_stream_destroy(s);
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, THANG_MS));
    cr_assert_eq(atomic_load(&T->n_half), 1);
    cr_assert_eq(atomic_load(&T->n_cancel), 0);
}

Test(rpc_calls, deadline_exceeded_reaches_client_and_handler) {
    /* The outcome is the status, not how long it took. The deadline is long enough for the
     * call to reach its handler first on a loaded machine (the handler records what it saw). */
    pie_status st;
    cr_assert_eq(unary(CH, "sleep", 1000, NULL, 0, &st), PIE_DEADLINE_EXCEEDED, "%s", st.msg);
    cr_assert(TWAIT(atomic_load(&T->n_call) == 1, THANG_MS), "the handler got the call");
    /* The handler sees the client's deadline, not none. gRPC's grpc-timeout header may round
     * it up (by 10 ms at one second), hence the bound of twice the timeout. */
    long rem = atomic_load(&T->last_remaining_ms);
    cr_assert(rem > 0 && rem <= 2000, "handler saw %ld ms left of a 1000 ms deadline", rem);
    cr_assert(TWAIT(atomic_load(&T->n_cancel) == 1, THANG_MS), "handler's on_cancel ran");
    cr_assert(TWAIT(atomic_load(&T->n_done) == 1, THANG_MS));
}

Test(rpc_calls, no_deadline_is_reported_as_none) {
    pie_status st;
    cr_assert_eq(unary(CH, "x", 0, NULL, 0, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(atomic_load(&T->last_remaining_ms), (long)INT64_MAX);
}

Test(rpc_calls, unknown_method_is_unimplemented_not_left_to_the_deadline) {
    /* Without the server's catch-all an unknown method hangs until the client's deadline and
     * ends DEADLINE_EXCEEDED: the status code tells the two apart, no clock needed. */
    pie_status st;
    rpc_health_status hs;
    cr_assert_eq(rpc_health_check(CH, "", 5000, &hs, &st), PIE_OK, "%s", st.msg); /* connect */
    tmsg req = tmsg_of("x");
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = THANG_MS};
    pie_code rc = rpc_unary(CH, "/test.Echo/Nope", &req.base, TMSG_DESC, &resp, &o, &st);
    cr_assert_eq(rc, PIE_UNIMPLEMENTED, "%s: %s", pie_code_name(rc), st.msg);
    cr_assert(strstr(st.msg, "/test.Echo/Nope"), "message: %s", st.msg);
    /* Also for a whole unknown service, and as a stream. */
    rpc_stream *s = rpc_stream_open(CH, "/nope.Svc/Talk", TMSG_DESC, NULL, &st);
    cr_assert(s);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_UNIMPLEMENTED);
    rpc_stream_destroy(s);
}

Test(rpc_calls, oversize_messages_are_resource_exhausted) {
    pie_status st;
    tsrv *small =
        tsrv_start(&(rpc_server_opts){.max_recv_bytes = 1024, .max_send_bytes = 1024}, &st);
    cr_assert(small, "%s", st.msg);
    rpc_channel *ch = tchan(small->port, NULL);
    char big[2048];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    /* request larger than the server accepts */
    cr_assert_eq(unary(ch, big, 5000, NULL, 0, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    /* response larger than the server may send: rpc_call_reply refuses it */
    cr_assert_eq(unary(ch, "big:2000", 5000, NULL, 0, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert_eq(unary(ch, "small", 5000, NULL, 0, &st), PIE_OK, "%s", st.msg);
    rpc_channel_destroy(ch);
    /* client limits: sending is refused locally, receiving by the core */
    ch = tchan(T->port, &(rpc_channel_opts){.max_send_bytes = 1024, .max_recv_bytes = 1024});
    cr_assert_eq(unary(ch, big, 5000, NULL, 0, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert_eq(unary(ch, "big:4000", 5000, NULL, 0, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_assert_eq(unary(ch, "big:100", 5000, NULL, 0, &st), PIE_OK, "%s", st.msg);
    rpc_channel_destroy(ch);
    tsrv_stop(small, 1000);
}

Test(rpc_calls, messages_up_to_the_limit_pass) {
    pie_status st;
    char out[8];
    cr_assert_eq(unary(CH, "big:3000000", 10000, out, sizeof out, &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(out, "bbbbbbb");
}

Test(rpc_calls, bearer_token_is_enforced) {
    pie_status st;
    tsrv *sec = tsrv_start(&(rpc_server_opts){.token = "s3cret"}, &st);
    cr_assert(sec, "%s", st.msg);
    rpc_channel *none = tchan(sec->port, NULL);
    rpc_channel *wrong = tchan(sec->port, &(rpc_channel_opts){.token = "s3cre"});
    rpc_channel *right = tchan(sec->port, &(rpc_channel_opts){.token = "s3cret"});
    cr_assert_eq(unary(none, "x", 5000, NULL, 0, &st), PIE_UNAUTHENTICATED, "%s", st.msg);
    cr_assert_eq(unary(wrong, "x", 5000, NULL, 0, &st), PIE_UNAUTHENTICATED, "%s", st.msg);
    cr_assert_eq(unary(right, "x", 5000, NULL, 0, &st), PIE_OK, "%s", st.msg);
    /* a token passed as plain metadata without "Bearer " is not accepted either */
    rpc_md md[] = {{"authorization", "s3cret"}};
    tmsg req = tmsg_of("x");
    ProtobufCMessage *resp = NULL;
    cr_assert_eq(rpc_unary(none, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp,
                           &(rpc_call_opts){.timeout_ms = 5000, .md = md, .n_md = 1}, &st),
                 PIE_UNAUTHENTICATED);
    /* two authorization headers are ambiguous (which one did a proxy check?): refused even
     * when one of them is right */
    rpc_md twice[] = {{"authorization", "Bearer s3cret"}, {"authorization", "Bearer s3cret"}};
    cr_assert_eq(rpc_unary(none, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp,
                           &(rpc_call_opts){.timeout_ms = 5000, .md = twice, .n_md = 2}, &st),
                 PIE_UNAUTHENTICATED, "%s", st.msg);
    cr_assert_str_eq(st.msg, "more than one authorization header");
    rpc_md extra[] = {{"authorization", "Bearer other"}};
    cr_assert_eq(rpc_unary(right, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp,
                           &(rpc_call_opts){.timeout_ms = 5000, .md = extra, .n_md = 1}, &st),
                 PIE_UNAUTHENTICATED, "%s", st.msg);
    /* streams too, and the handler never sees the call */
    rpc_stream *s = rpc_stream_open(wrong, "/test.Echo/Chat", TMSG_DESC, NULL, &st);
    cr_assert(s);
    cr_assert_neq(rpc_stream_wait_ready(s, 5000, &st), PIE_OK);
    cr_assert_eq(rpc_stream_finish(s, &st), PIE_UNAUTHENTICATED, "%s", st.msg);
    rpc_stream_destroy(s);
    cr_assert_eq(atomic_load(&sec->n_call), 1, "only the authorised call reached a handler");
    /* health is exempt by default (Kubernetes probes carry no token) */
    rpc_health_status hs;
    cr_assert_eq(rpc_health_check(none, "", 5000, &hs, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(hs, RPC_HEALTH_SERVING);
    rpc_channel_destroy(none);
    rpc_channel_destroy(wrong);
    rpc_channel_destroy(right);
    tsrv_stop(sec, 1000);
}

Test(rpc_calls, health_can_require_the_token) {
    pie_status st;
    tsrv *sec = tsrv_start(&(rpc_server_opts){.token = "tok", .health_needs_token = true}, &st);
    cr_assert(sec, "%s", st.msg);
    rpc_channel *none = tchan(sec->port, NULL);
    rpc_channel *right = tchan(sec->port, &(rpc_channel_opts){.token = "tok"});
    rpc_health_status hs;
    cr_assert_eq(rpc_health_check(none, "", 5000, &hs, &st), PIE_UNAUTHENTICATED);
    cr_assert_eq(rpc_health_check(right, "", 5000, &hs, &st), PIE_OK, "%s", st.msg);
    rpc_channel_destroy(none);
    rpc_channel_destroy(right);
    tsrv_stop(sec, 1000);
}

Test(rpc_calls, method_table_is_validated) {
    pie_status st;
    rpc_server *srv = rpc_server_create(&(rpc_server_opts){.addr = "127.0.0.1:0"}, &st);
    cr_assert(srv, "%s", st.msg);
    rpc_method m = {.path = "nope",
                    .kind = RPC_UNARY,
                    .request = TMSG_DESC,
                    .response = TMSG_DESC,
                    .on_call = t_unary};
    cr_assert_eq(rpc_server_add_methods(srv, &m, 1, &st), PIE_INVALID_ARGUMENT);
    cr_assert(strstr(st.msg, "nope"), "%s", st.msg);
    m.path = "/a.B/C";
    m.kind = RPC_BIDI; /* no on_message */
    cr_assert_eq(rpc_server_add_methods(srv, &m, 1, &st), PIE_INVALID_ARGUMENT);
    m.kind = RPC_UNARY;
    cr_assert_eq(rpc_server_add_methods(srv, &m, 1, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(rpc_server_add_methods(srv, &m, 1, &st), PIE_ALREADY_EXISTS);
    m.path = "/grpc.health.v1.Health/Check";
    cr_assert_eq(rpc_server_add_methods(srv, &m, 1, &st), PIE_ALREADY_EXISTS);
    rpc_server_destroy(srv); /* never started */
}

Test(rpc_calls, second_server_on_a_taken_port_fails) {
    pie_status st;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", T->port);
    rpc_server *srv = rpc_server_create(&(rpc_server_opts){.addr = addr}, &st);
    cr_assert(srv);
    cr_assert_eq(rpc_server_start(srv, &st), PIE_UNAVAILABLE);
    cr_assert(strstr(st.msg, addr), "%s", st.msg);
    rpc_server_destroy(srv);
}

TestSuite(rpc_buffers, .fini = leak_check);

Test(rpc_buffers, multi_slice_buffers_unpack_through_readall) {
    grpc_init();
    tmsg m = tmsg_of("a string long enough to split over three slices");
    grpc_byte_buffer *bb = NULL;
    cr_assert_eq(rpc__pack(&m.base, -1, &bb, NULL), PIE_OK);
    grpc_slice whole = grpc_slice_ref(bb->data.raw.slice_buffer.slices[0]);
    cr_assert_eq(bb->data.raw.slice_buffer.count, 1, "packed into one slice");
    size_t n = GRPC_SLICE_LENGTH(whole);
    grpc_slice parts[3] = {grpc_slice_sub(whole, 0, 5), grpc_slice_sub(whole, 5, 20),
                           grpc_slice_sub(whole, 20, n)};
    grpc_byte_buffer *multi = grpc_raw_byte_buffer_create(parts, 3);
    ProtobufCMessage *one = rpc__unpack(TMSG_DESC, bb);
    ProtobufCMessage *three = rpc__unpack(TMSG_DESC, multi);
    cr_assert(one && three);
    cr_assert_str_eq(tmsg_text(one), m.service);
    cr_assert_str_eq(tmsg_text(three), m.service);
    rpc_msg_free(one);
    rpc_msg_free(three);
    /* garbage does not parse */
    grpc_slice junk = grpc_slice_from_static_string("\xff\xff\xff");
    grpc_byte_buffer *jb = grpc_raw_byte_buffer_create(&junk, 1);
    cr_assert_null(rpc__unpack(TMSG_DESC, jb));
    grpc_byte_buffer_destroy(jb);
    for (int i = 0; i < 3; i++) grpc_slice_unref(parts[i]);
    grpc_slice_unref(whole);
    grpc_byte_buffer_destroy(multi);
    grpc_byte_buffer_destroy(bb);
    grpc_shutdown();
}

Test(rpc_buffers, pack_respects_the_limit) {
    tmsg m = tmsg_of("0123456789");
    grpc_byte_buffer *bb = NULL;
    pie_status st;
    cr_assert_eq(rpc__pack(&m.base, 5, &bb, &st), PIE_RESOURCE_EXHAUSTED);
    cr_assert_null(bb);
    cr_assert(strstr(st.msg, "grpc.health.v1.HealthCheckRequest"), "%s", st.msg);
}

TestSuite(rpc_channel, .fini = leak_check, .timeout = 60);

/* The integer value of channel argument key in a, or -1 when a lacks it. */
static int channel_arg(const rpc_args *a, const char *key) {
    for (size_t i = 0; i < a->ca.num_args; i++)
        if (strcmp(a->ca.args[i].key, key) == 0) {
            cr_assert_eq(a->ca.args[i].type, GRPC_ARG_INTEGER, "%s is not an integer", key);
            return a->ca.args[i].value.integer;
        }
    return -1;
}

Test(rpc_channel, reconnect_backoff_becomes_grpc_channel_arguments) {
    /* How often gRPC redials is its own business, observable only in wall time; what we own
     * is handing it the configured backoff, checked here exactly. */
    rpc_args a;
    rpc__channel_args(&(rpc_channel_opts){.reconnect_initial_ms = 50, .reconnect_max_ms = 200}, &a);
    cr_assert_eq(channel_arg(&a, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS), 50);
    cr_assert_eq(channel_arg(&a, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS), -1,
                 "the backoff must not bound a connection attempt (gRPC's default: 20 s)");
    cr_assert_eq(channel_arg(&a, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS), 200);
    rpc__channel_args(&(rpc_channel_opts){.connect_timeout_ms = 3000}, &a);
    cr_assert_eq(channel_arg(&a, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS), 3000);
    /* unset: gRPC's defaults */
    rpc__channel_args(&(rpc_channel_opts){0}, &a);
    cr_assert_eq(channel_arg(&a, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS), -1);
    cr_assert_eq(channel_arg(&a, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS), -1);
    cr_assert_eq(channel_arg(&a, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS), -1);
    cr_assert_eq(channel_arg(&a, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL), 1);
}

/* A TCP relay that holds each connection it accepts for delay_ms before it dials the server
 * and relays both ways: a server whose handshake (TCP, TLS, HTTP/2 settings) takes that long,
 * as a loaded or distant one does. */
#define RELAY_MAX_CONNS 64
typedef struct slow_relay {
    int fd, port, upstream_port, delay_ms;
    atomic_bool stop;
    atomic_int accepted;
    pthread_t acceptor, conns[RELAY_MAX_CONNS];
    int n_conns; /* the acceptor's */
} slow_relay;

typedef struct relay_conn {
    slow_relay *r;
    int fd;
} relay_conn;

static int relay_dial(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* Copies what fd `from` has to `to`; false at end of stream or on an error. */
static bool relay_copy(int from, int to) {
    char buf[16384];
    ssize_t n = read(from, buf, sizeof buf);
    for (ssize_t off = 0; n > 0 && off < n;) {
        ssize_t w = write(to, buf + off, (size_t)(n - off));
        if (w <= 0) return false;
        off += w;
    }
    return n > 0;
}

static void *relay_conn_main(void *arg) {
    relay_conn *c = arg;
    slow_relay *r = c->r;
    for (int waited = 0; waited < r->delay_ms && !atomic_load(&r->stop); waited += 10)
        tsleep_ms(10);
    int up = atomic_load(&r->stop) ? -1 : relay_dial(r->upstream_port);
    while (up >= 0 && !atomic_load(&r->stop)) {
        struct pollfd p[2] = {{.fd = c->fd, .events = POLLIN}, {.fd = up, .events = POLLIN}};
        int n = poll(p, 2, 20);
        if (n < 0) break;
        if (p[0].revents && !relay_copy(c->fd, up)) break;
        if (p[1].revents && !relay_copy(up, c->fd)) break;
    }
    if (up >= 0) close(up);
    close(c->fd);
    free(c);
    return NULL;
}

static void *relay_accept_main(void *arg) {
    slow_relay *r = arg;
    while (!atomic_load(&r->stop)) {
        struct pollfd p = {.fd = r->fd, .events = POLLIN};
        if (poll(&p, 1, 20) <= 0) continue;
        int fd = accept(r->fd, NULL, NULL);
        if (fd < 0) continue;
        atomic_fetch_add(&r->accepted, 1);
        relay_conn *c = malloc(sizeof *c);
        if (r->n_conns == RELAY_MAX_CONNS || !c) {
            free(c);
            close(fd);
            continue;
        }
        *c = (relay_conn){.r = r, .fd = fd};
        if (pthread_create(&r->conns[r->n_conns], NULL, relay_conn_main, c) != 0) {
            free(c);
            close(fd);
            continue;
        }
        r->n_conns++;
    }
    return NULL;
}

static void relay_start(slow_relay *r, int upstream_port, int delay_ms) {
    *r = (slow_relay){.upstream_port = upstream_port, .delay_ms = delay_ms};
    r->fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(r->fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    cr_assert_eq(bind(r->fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(r->fd, 64), 0);
    cr_assert_eq(getsockname(r->fd, (struct sockaddr *)&a, &len), 0);
    r->port = ntohs(a.sin_port);
    cr_assert_eq(pthread_create(&r->acceptor, NULL, relay_accept_main, r), 0);
}

static void relay_stop(slow_relay *r) {
    atomic_store(&r->stop, true);
    pthread_join(r->acceptor, NULL);
    for (int i = 0; i < r->n_conns; i++) pthread_join(r->conns[i], NULL);
    close(r->fd);
}

Test(rpc_channel, a_slow_handshake_is_waited_for_whatever_the_reconnect_backoff) {
    /* gRPC gives one connection attempt max(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, the backoff)
     * to finish; when that argument followed reconnect_initial_ms (50 ms here, 100 ms in the
     * services' defaults) an attempt was abandoned after 100-200 ms, so a peer slower than
     * that to answer (loaded, TLS, far away) was never reached at all. */
    pie_status st;
    tsrv *t = tsrv_start(NULL, &st);
    cr_assert(t, "server start: %s", st.msg);
    slow_relay r;
    relay_start(&r, t->port, 600);
    rpc_channel *ch =
        tchan(r.port, &(rpc_channel_opts){.reconnect_initial_ms = 50, .reconnect_max_ms = 200});
    cr_assert(ch);
    tmsg req = tmsg_of("slow");
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = 8000, .wait_for_ready = true};
    pie_code rc = rpc_unary(ch, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp, &o, &st);
    rpc_msg_free(resp);
    rpc_channel_destroy(ch);
    relay_stop(&r);
    tsrv_stop(t, 1000);
    cr_assert_eq(rc, PIE_OK,
                 "a server 600 ms slow to answer was never reached (%d connection attempts): %s",
                 atomic_load(&r.accepted), st.msg);
}

/* ---- several listen addresses, a Unix socket among them ---- */

TestSuite(rpc_listen, .fini = leak_check, .timeout = 60);

/* A socket path of this process under /tmp (gRPC removes a stale file before it binds). */
static void sock_path(char *out, size_t n, const char *tag) {
    snprintf(out, n, "/tmp/test_rpc_calls.%d.%s.sock", (int)getpid(), tag);
}

static void assert_echo_at(const char *target) {
    rpc_channel *ch = rpc_channel_create(target, NULL, NULL);
    cr_assert(ch, "channel to %s", target);
    pie_status st;
    char out[64];
    cr_assert_eq(unary(ch, target, 5000, out, sizeof out, &st), PIE_OK, "%s: %s", target, st.msg);
    cr_assert_str_eq(out, target);
    rpc_channel_destroy(ch);
}

Test(rpc_listen, a_tcp_port_and_a_unix_socket_both_serve_and_the_port_is_the_tcp_one) {
    char path[128], addr[192], unix_target[160], tcp_target[64];
    sock_path(path, sizeof path, "both");
    snprintf(addr, sizeof addr, "unix:%s,127.0.0.1:0", path);
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.addr = addr}, &st);
    cr_assert(t, "start on %s: %s", addr, st.msg);
    cr_assert_gt(t->port, 1, "rpc_server_port is the TCP address's port, not gRPC's 1 for unix");
    snprintf(unix_target, sizeof unix_target, "unix:%s", path);
    snprintf(tcp_target, sizeof tcp_target, "127.0.0.1:%d", t->port);
    assert_echo_at(unix_target);
    assert_echo_at(tcp_target);
    tsrv_stop(t, 1000);
}

Test(rpc_listen, a_unix_socket_alone_serves_and_reports_no_port) {
    char path[128], target[160];
    sock_path(path, sizeof path, "alone");
    snprintf(target, sizeof target, "unix:%s", path);
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.addr = target}, &st);
    cr_assert(t, "start on %s: %s", target, st.msg);
    cr_assert_eq(t->port, 0);
    assert_echo_at(target);
    tsrv_stop(t, 1000);
}

Test(rpc_listen, an_empty_entry_in_the_list_is_refused_by_name) {
    const char *bad[] = {"127.0.0.1:0,", ",127.0.0.1:0", "127.0.0.1:0,,127.0.0.1:0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pie_status st;
        tsrv *t = tsrv_start(&(rpc_server_opts){.addr = bad[i]}, &st);
        cr_assert_null(t, "'%s' was accepted", bad[i]);
        cr_assert_eq(st.code, PIE_INVALID_ARGUMENT, "'%s': %s", bad[i], st.msg);
        cr_assert(strstr(st.msg, bad[i]) != NULL, "the message names the list: %s", st.msg);
    }
}

Test(rpc_listen, an_address_that_cannot_be_bound_fails_the_start_naming_it) {
    pie_status st;
    tsrv *t = tsrv_start(&(rpc_server_opts){.addr = "127.0.0.1:0,unix:/nonexistent-dir/x.sock"},
                         &st);
    cr_assert_null(t);
    cr_assert_eq(st.code, PIE_UNAVAILABLE, "%s", st.msg);
    cr_assert(strstr(st.msg, "unix:/nonexistent-dir/x.sock") != NULL, "%s", st.msg);
}
