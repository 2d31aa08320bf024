/* test_ctl_send_queue.c — the controller's send queues (issue 11, hole 7): a real pie-controller
 * on loopback with a small streams.send_queue, driven over the Session stream by this test
 * acting as a lifecycle replica that stops reading its results.
 *
 * Covers: the controller never queues without bound for a peer that does not read: once the
 * stream's queue is full the stream is ended at once (UNAVAILABLE with the reason, or CANCELLED
 * when a message was stuck in the transport) and the controller says why in its log, instead of
 * results silently piling up or being lost while the replica's futures wait; a replica that
 * reads gets every result of the same load. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_proc.h"
#include "pie_testutil.h"
#include "rpc.h"

#define START_MS 30000
#define STOP_MS  20000
#define WAIT_MS  30000
#define PER_UP   200  /* calls per SessionUp */
#define MAX_UPS  2000 /* 400,000 failing calls: ~40 MB of results if nothing bounded them */

TestSuite(ctl_send_queue, .fini = pie_test_leak_check, .timeout = 300);

static pie_proc *start_controller(void) {
    const char *env[] = {"PIE_STREAMS_SEND_QUEUE=64KiB", "PIE_STREAMS_SEND_QUEUE_MESSAGES=64",
                         NULL};
    pie_proc_opts o = {.env = env};
    pie_status st;
    pie_proc *p = pie_proc_start("pie-controller", &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

static void stop_ok(pie_proc *p) {
    pie_status st;
    int rc = pie_proc_stop(p, STOP_MS, &st);
    cr_assert_eq(rc, 0, "%s exited with %d: %s", pie_proc_name(p), rc, st.msg);
    pie_proc_destroy(p);
}

/* Opens a Session, says hello, begins one instance; returns its id in *inst. */
static rpc_stream *session_open(rpc_channel *ch, uint64_t *inst) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(ch, "/pie.v1.Controller/Session",
                                    &pie__v1__session_down__descriptor, NULL, &st);
    cr_assert(s, "%s", st.msg);
    Pie__V1__SessionHello hello = PIE__V1__SESSION_HELLO__INIT;
    hello.replica_id = "test-send-queue";
    hello.version = "pie-c/0.1.0";
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.hello = &hello;
    cr_assert_eq(rpc_stream_send(s, &up.base, &st), PIE_OK, "%s", st.msg);
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_recv(s, &m, WAIT_MS), RPC_RECV_MESSAGE, "no welcome");
    Pie__V1__SessionDown *down = (Pie__V1__SessionDown *)m;
    cr_assert(down->welcome);
    *inst = ((uint64_t)down->welcome->replica_index << 48) | 1;
    rpc_msg_free(m);
    Pie__V1__InstanceBegin b = PIE__V1__INSTANCE_BEGIN__INIT, *bp = &b;
    b.instance_id = *inst;
    b.program_id = "p";
    b.model = "m";
    Pie__V1__SessionUp bu = PIE__V1__SESSION_UP__INIT;
    bu.n_begins = 1;
    bu.begins = &bp;
    cr_assert_eq(rpc_stream_send(s, &bu.base, &st), PIE_OK, "%s", st.msg);
    return s;
}

/* Sends SessionUp number i: PER_UP calls with no op, each answered with an error result. */
static pie_code send_failing_calls(rpc_stream *s, uint64_t inst, int i, pie_status *st) {
    Pie__V1__ApiCall calls[PER_UP], *cp[PER_UP];
    for (int k = 0; k < PER_UP; k++) {
        pie__v1__api_call__init(&calls[k]);
        calls[k].instance_id = inst;
        calls[k].call_id = (uint64_t)i * PER_UP + (uint64_t)k + 1;
        cp[k] = &calls[k];
    }
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.n_calls = PER_UP;
    up.calls = cp;
    return rpc_stream_send(s, &up.base, st);
}

/* Reads results until the stream ends or nothing comes for 10 s; returns how many arrived and
 * whether the stream ended in *ended. */
static size_t read_results(rpc_stream *s, bool *ended) {
    size_t n = 0;
    ProtobufCMessage *m = NULL;
    rpc_recv_result r;
    while ((r = rpc_stream_recv(s, &m, 10000)) == RPC_RECV_MESSAGE) {
        n += ((Pie__V1__SessionDown *)m)->n_results;
        rpc_msg_free(m);
    }
    *ended = r == RPC_RECV_END;
    return n;
}

static rpc_channel *channel_to(const pie_proc *p) {
    pie_status st;
    rpc_channel_opts o = {.max_recv_bytes = 64 << 20, .max_send_bytes = 64 << 20};
    rpc_channel *ch = rpc_channel_create(pie_proc_addr(p), &o, &st);
    cr_assert(ch, "%s", st.msg);
    return ch;
}

Test(ctl_send_queue, a_session_that_does_not_read_is_ended_at_once_not_buffered_forever) {
    pie_proc *ctl = start_controller();
    rpc_channel *ch = channel_to(ctl);
    uint64_t inst;
    rpc_stream *s = session_open(ch, &inst);
    pie_status st;
    int sent = 0;
    while (sent < MAX_UPS && send_failing_calls(s, inst, sent, &st) == PIE_OK) sent++;
    /* Stop reading for real: no gRPC call in this process until the controller gives up, so
     * nothing polls the client's socket and the controller's writes back up into its own send
     * queue. (Not posting a receive is not enough: gRPC reads the socket and grants window
     * whenever a thread of this process polls, e.g. while a send waits, and reading at once
     * after the sends drained the controller faster than its queue filled: CI saw all 400,000
     * results arrive once.) */
    cr_assert(pie_proc_wait_log(ctl, "ctl.send_failed", 1, WAIT_MS),
              "the controller did not end the stream of a client that stopped reading (%d "
              "SessionUps sent)",
              sent);
    int64_t t0 = pie_test_now_ms();
    bool ended = false;
    size_t got = read_results(s, &ended);
    cr_assert(ended,
              "the controller kept the stream open with %zu of %d results read: its send queue "
              "grew without bound instead of ending the stream",
              got, sent * PER_UP);
    cr_assert_lt(got, (size_t)sent * PER_UP, "results were lost, yet the stream looked fine");
    cr_assert_lt(pie_test_now_ms() - t0, WAIT_MS);
    pie_code rc = rpc_stream_finish(s, &st);
    cr_assert(rc == PIE_UNAVAILABLE || rc == PIE_CANCELLED, "status %s: %s", pie_code_name(rc),
              st.msg);
    if (rc == PIE_UNAVAILABLE)
        cr_assert(strstr(st.msg, "send queue"), "the status names the queue: %s", st.msg);
    rpc_stream_destroy(s);
    char *log = pie_proc_log(ctl);
    cr_assert(log);
    cr_assert(strstr(log, "ctl.send_failed") && strstr(log, "stream=session"),
              "the controller logs why it ended the stream");
    free(log);
    /* The controller is fine: the next Session works. */
    s = session_open(ch, &inst);
    cr_assert_eq(send_failing_calls(s, inst, 0, &st), PIE_OK, "%s", st.msg);
    ProtobufCMessage *m = NULL;
    cr_assert_eq(rpc_stream_recv(s, &m, WAIT_MS), RPC_RECV_MESSAGE);
    rpc_msg_free(m);
    rpc_stream_cancel(s);
    (void)rpc_stream_finish(s, &st);
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    stop_ok(ctl);
}

Test(ctl_send_queue, a_session_that_reads_gets_every_result) {
    pie_proc *ctl = start_controller();
    rpc_channel *ch = channel_to(ctl);
    uint64_t inst;
    rpc_stream *s = session_open(ch, &inst);
    pie_status st;
    size_t got = 0;
    for (int i = 0; i < 200; i++) { /* each batch read before the next is sent */
        cr_assert_eq(send_failing_calls(s, inst, i, &st), PIE_OK, "%s", st.msg);
        size_t want = (size_t)(i + 1) * PER_UP;
        while (got < want) {
            ProtobufCMessage *m = NULL;
            cr_assert_eq(rpc_stream_recv(s, &m, WAIT_MS), RPC_RECV_MESSAGE,
                         "after %zu of %zu results", got, want);
            Pie__V1__SessionDown *d = (Pie__V1__SessionDown *)m;
            for (size_t k = 0; k < d->n_results; k++)
                cr_assert_eq(d->results[k]->code, (uint32_t)PIE_UNIMPLEMENTED);
            got += d->n_results;
            rpc_msg_free(m);
        }
    }
    cr_assert_eq(got, 200u * PER_UP);
    rpc_stream_cancel(s);
    (void)rpc_stream_finish(s, &st);
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    stop_ok(ctl);
}
