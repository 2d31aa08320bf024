/* test_rpc_alink.c — the asynchronous link (rpc_link_opts.server): a reconnecting bidi stream
 * driven by a server's own thread, whose sends never wait for gRPC.
 *
 * Setup: a "home" server (the lifecycle's gRPC server in production) that only carries the
 * link, and the echo service of test_rpc_util.h as the peer (the controller): its Chat echoes
 * every text, so what the link's on_message sees is what the peer received, in order. */
#include <criterion/criterion.h>

#include "test_rpc_util.h"

#define HANG_MS THANG_MS

static void leak_check(void) { TLEAK_CHECK(); }

TestSuite(rpc_alink, .fini = leak_check, .timeout = 120);

/* Echoes seen by the link, in arrival order, and what its callbacks reported. */
#define AL_MAX 8192
typedef struct alink_rec {
    pthread_mutex_t mu;
    char *text[AL_MAX]; /* strdup'ed echoes */
    int n;
    atomic_int connects, disconnects, last_code, off_thread; /* off_thread: callbacks not on rpc-srv-0 */
    char last_msg[PIE_STATUS_MSG_MAX];
} alink_rec;

static void rec_init(alink_rec *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
}

static void rec_free(alink_rec *r) {
    for (int i = 0; i < r->n; i++) free(r->text[i]);
    pthread_mutex_destroy(&r->mu);
}

static int rec_count(alink_rec *r) {
    pthread_mutex_lock(&r->mu);
    int n = r->n;
    pthread_mutex_unlock(&r->mu);
    return n;
}

static bool rec_has(alink_rec *r, const char *text) {
    pthread_mutex_lock(&r->mu);
    bool found = false;
    for (int i = 0; i < r->n && !found; i++) found = strcmp(r->text[i], text) == 0;
    pthread_mutex_unlock(&r->mu);
    return found;
}

static void note_thread(alink_rec *r) {
    char name[16] = "";
    if (pthread_getname_np(pthread_self(), name, sizeof name) != 0 || strcmp(name, "rpc-srv-0"))
        atomic_fetch_add(&r->off_thread, 1);
}

static void a_connect(rpc_link *l, void *user) {
    alink_rec *r = user;
    note_thread(r);
    int n = atomic_fetch_add(&r->connects, 1) + 1;
    char text[32];
    snprintf(text, sizeof text, "register-%d", n);
    tmsg m = tmsg_of(text);
    pie_status st;
    if (rpc_link_send_gen(l, rpc_link_generation(l), &m.base, &st) != PIE_OK)
        fprintf(stderr, "register send: %s\n", st.msg);
}

static bool a_message(rpc_link *l, ProtobufCMessage *msg, void *user) {
    (void)l;
    alink_rec *r = user;
    note_thread(r);
    pthread_mutex_lock(&r->mu);
    if (r->n < AL_MAX) r->text[r->n++] = strdup(tmsg_text(msg));
    pthread_mutex_unlock(&r->mu);
    return false;
}

static void a_disconnect(rpc_link *l, const pie_status *st, void *user) {
    (void)l;
    alink_rec *r = user;
    pthread_mutex_lock(&r->mu);
    snprintf(r->last_msg, sizeof r->last_msg, "%s", st->msg);
    pthread_mutex_unlock(&r->mu);
    atomic_store(&r->last_code, (int)st->code);
    atomic_fetch_add(&r->disconnects, 1);
}

static rpc_link_opts alink_opts(alink_rec *r, rpc_server *home) {
    return (rpc_link_opts){
        .path = "/test.Echo/Chat",
        .response = TMSG_DESC,
        .backoff_initial_ms = 20,
        .backoff_max_ms = 200,
        .on_connect = a_connect,
        .on_message = a_message,
        .on_disconnect = a_disconnect,
        .user = r,
        .server = home,
    };
}

static rpc_server *home_start(void) {
    pie_status st;
    rpc_server *h = rpc_server_create(&(rpc_server_opts){.addr = "127.0.0.1:0"}, &st);
    cr_assert(h, "%s", st.msg);
    cr_assert_eq(rpc_server_start(h, &st), PIE_OK, "%s", st.msg);
    return h;
}

static rpc_channel_opts fast_reconnect = {.reconnect_initial_ms = 50, .reconnect_max_ms = 200};

/* The sequence numbers of "<prefix><k>" echoes, in arrival order, into seq (at most cap). */
static int rec_seq(alink_rec *r, const char *prefix, int *seq, int cap) {
    size_t pl = strlen(prefix);
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n && n < cap; i++)
        if (strncmp(r->text[i], prefix, pl) == 0) seq[n++] = atoi(r->text[i] + pl);
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* What the tests below run on: the peer, the home server, a channel to the peer and the link
 * carried by the home server, with the record of its callbacks. A test that takes a part down
 * itself sets its field to NULL. Static: the record is large, and it is the link's user
 * pointer, so it must outlive the test's frame if an assertion ends the test early (each test
 * runs in a process of its own). */
typedef struct alink_fx {
    tsrv *peer;
    rpc_server *home;
    rpc_channel *ch;
    rpc_link *l;
    alink_rec r;
} alink_fx;

static alink_fx fx_state;

/* Starts everything, the link with a send queue bound of send_queue_max_bytes (0: the default),
 * and waits until it registered on its first stream. */
static alink_fx *fx_start(size_t send_queue_max_bytes) {
    pie_status st;
    fx_state.peer = tsrv_start(NULL, &st);
    cr_assert(fx_state.peer, "%s", st.msg);
    fx_state.home = home_start();
    fx_state.ch = tchan(fx_state.peer->port, &fast_reconnect);
    rec_init(&fx_state.r);
    rpc_link_opts o = alink_opts(&fx_state.r, fx_state.home);
    o.send_queue_max_bytes = send_queue_max_bytes;
    fx_state.l = rpc_link_start(fx_state.ch, &o, &st);
    cr_assert(fx_state.l, "%s", st.msg);
    cr_assert(TWAIT(rec_has(&fx_state.r, "register-1"), HANG_MS), "the registration was echoed");
    return &fx_state;
}

/* Stops the link first: after that no callback runs, so the record can be read without races. */
static void fx_stop_link(alink_fx *f) {
    rpc_link_stop(f->l);
    f->l = NULL;
}

/* Takes down what the test left running, link first (the suite's leak check follows). */
static void fx_finish(alink_fx *f) {
    if (f->l) fx_stop_link(f);
    rpc_channel_destroy(f->ch);
    rpc_server_destroy(f->home); /* NULL-safe */
    tsrv_stop(f->peer, 1000);
    rec_free(&f->r);
}

Test(rpc_alink, callbacks_run_on_the_server_thread_and_sends_arrive_in_order) {
    alink_fx *fx = fx_start(0);
    pie_status st;
    for (int i = 0; i < 500; i++) { /* back to back: most queue behind the one in flight */
        char text[32];
        snprintf(text, sizeof text, "m%d", i);
        tmsg m = tmsg_of(text);
        cr_assert_eq(rpc_link_send(fx->l, &m.base, &st), PIE_OK, "send %d: %s", i, st.msg);
    }
    cr_assert(TWAIT(rec_count(&fx->r) == 501, HANG_MS), "echoes: %d of 501", rec_count(&fx->r));
    static int seq[AL_MAX];
    int n = rec_seq(&fx->r, "m", seq, AL_MAX);
    cr_assert_eq(n, 500);
    for (int i = 0; i < n; i++) cr_assert_eq(seq[i], i, "echo %d is m%d", i, seq[i]);
    cr_assert_eq(atomic_load(&fx->r.off_thread), 0,
                 "on_connect/on_message ran on a thread other than the server's");
    fx_stop_link(fx);
    cr_assert_eq(atomic_load(&fx->r.disconnects), 0, "stop reports no disconnect");
    fx_finish(fx);
}

typedef struct sender {
    rpc_link *l;
    int id, n;
    uint64_t gen; /* 0: rpc_link_send; else rpc_link_send_gen(gen) until it refuses */
    atomic_int sent, refused;
    atomic_bool *go;
} sender;

static void *sender_main(void *arg) {
    sender *s = arg;
    while (s->go && !atomic_load(s->go)) tsleep_ms(1);
    for (int i = 0; i < s->n; i++) {
        char text[32];
        snprintf(text, sizeof text, "t%d-%d", s->id, i);
        tmsg m = tmsg_of(text);
        pie_status st;
        pie_code rc = s->gen ? rpc_link_send_gen(s->l, s->gen, &m.base, &st)
                             : rpc_link_send(s->l, &m.base, &st);
        if (rc == PIE_OK) {
            atomic_fetch_add(&s->sent, 1);
        } else {
            atomic_fetch_add(&s->refused, 1);
            if (s->gen) break; /* that stream is over: nothing later may go either */
        }
    }
    return NULL;
}

Test(rpc_alink, many_threads_sending_at_once_each_arrive_exactly_once_in_order) {
    alink_fx *fx = fx_start(0);
    enum { N_THREADS = 16, PER_THREAD = 300 };
    static sender s[N_THREADS];
    static atomic_bool go;
    atomic_store(&go, false);
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        s[i] = (sender){.l = fx->l, .id = i, .n = PER_THREAD, .go = &go};
        cr_assert_eq(pthread_create(&th[i], NULL, sender_main, &s[i]), 0);
    }
    atomic_store(&go, true);
    for (int i = 0; i < N_THREADS; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N_THREADS; i++)
        cr_assert_eq(atomic_load(&s[i].sent), PER_THREAD, "thread %d: %d refused", i,
                     atomic_load(&s[i].refused));
    cr_assert(TWAIT(rec_count(&fx->r) == 1 + N_THREADS * PER_THREAD, HANG_MS), "echoes: %d of %d",
              rec_count(&fx->r), 1 + N_THREADS * PER_THREAD);
    static int seq[AL_MAX];
    for (int i = 0; i < N_THREADS; i++) {
        char prefix[16];
        snprintf(prefix, sizeof prefix, "t%d-", i);
        int n = rec_seq(&fx->r, prefix, seq, AL_MAX);
        cr_assert_eq(n, PER_THREAD, "thread %d: %d echoes", i, n);
        for (int k = 0; k < n; k++)
            cr_assert_eq(seq[k], k, "thread %d: echo %d is message %d", i, k, seq[k]);
    }
    fx_finish(fx);
}

/* The controller restarts while senders keep queueing for the first stream: whatever of stream 1
 * arrived is an in-order prefix without duplicates, nothing of it arrives after the second
 * registration, stream 2's messages all arrive, and the link reports the loss. */
Test(rpc_alink, a_peer_restart_while_messages_queue_loses_only_the_old_streams_tail) {
    alink_fx *fx = fx_start(0);
    pie_status st;
    int port = fx->peer->port;
    uint64_t g1 = rpc_link_generation(fx->l);
    cr_assert_eq(g1, 1u);

    static sender s;
    s = (sender){.l = fx->l, .id = 0, .n = 1000000, .gen = g1};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, sender_main, &s), 0);
    cr_assert(TWAIT(rec_count(&fx->r) > 50, HANG_MS), "stream 1 carries messages");
    tsrv_stop(fx->peer, 0); /* the controller goes away with messages queued and in flight */
    pthread_join(th, NULL); /* ends at the first refusal: stream 1 is over */
    cr_assert_eq(atomic_load(&s.refused), 1);
    cr_assert(TWAIT(atomic_load(&fx->r.disconnects) >= 1, HANG_MS));
    int code = atomic_load(&fx->r.last_code);
    cr_assert(code == PIE_UNAVAILABLE || code == PIE_CANCELLED, "disconnect: %s",
              pie_code_name(code));
    tmsg stale = tmsg_of("stale");
    cr_assert_eq(rpc_link_send_gen(fx->l, g1, &stale.base, &st), PIE_UNAVAILABLE);

    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    fx->peer = tsrv_start(&(rpc_server_opts){.addr = addr}, &st);
    cr_assert(fx->peer, "restart on %s: %s", addr, st.msg);
    cr_assert(TWAIT(rec_has(&fx->r, "register-2"), HANG_MS), "re-registered on the new stream");
    uint64_t g2 = rpc_link_generation(fx->l);
    cr_assert_eq(g2, 2u);
    cr_assert_eq(rpc_link_send_gen(fx->l, g1, &stale.base, &st), PIE_UNAVAILABLE,
                 "a message for stream 1 went on stream 2");
    static sender s2;
    s2 = (sender){.l = fx->l, .id = 1, .n = 200, .gen = g2};
    sender_main(&s2);
    cr_assert_eq(atomic_load(&s2.sent), 200, "%d refused", atomic_load(&s2.refused));
    cr_assert(TWAIT(rec_has(&fx->r, "t1-199"), HANG_MS), "stream 2's last message arrived");

    static int seq[AL_MAX];
    int n0 = rec_seq(&fx->r, "t0-", seq, AL_MAX);
    cr_assert(n0 <= atomic_load(&s.sent));
    for (int k = 0; k < n0; k++) cr_assert_eq(seq[k], k, "stream 1: echo %d is message %d", k, seq[k]);
    int n1 = rec_seq(&fx->r, "t1-", seq, AL_MAX);
    cr_assert_eq(n1, 200);
    for (int k = 0; k < n1; k++) cr_assert_eq(seq[k], k, "stream 2: echo %d is message %d", k, seq[k]);
    /* nothing of stream 1 after stream 2's registration */
    pthread_mutex_lock(&fx->r.mu);
    int reg2 = -1;
    for (int i = 0; i < fx->r.n; i++)
        if (strcmp(fx->r.text[i], "register-2") == 0) reg2 = i;
    bool late = false;
    for (int i = reg2 + 1; i < fx->r.n; i++) late |= strncmp(fx->r.text[i], "t0-", 3) == 0;
    pthread_mutex_unlock(&fx->r.mu);
    cr_assert(!late, "a message of stream 1 arrived on stream 2");
    cr_assert(!rec_has(&fx->r, "stale"));

    fx_finish(fx);
}

/* A thread that sends 64 KiB messages until told to stop, counting what the link took and
 * what it refused. */
typedef struct flooder {
    rpc_link *l;
    pthread_t th;
    atomic_bool stop;
    atomic_int ok, refused;
} flooder;

static void *flooder_main(void *arg) {
    flooder *f = arg;
    static char big[64 * 1024];
    memset(big, 'x', sizeof big - 1);
    tmsg m = tmsg_of(big);
    while (!atomic_load(&f->stop)) {
        pie_status st;
        if (rpc_link_send(f->l, &m.base, &st) == PIE_OK) {
            atomic_fetch_add(&f->ok, 1);
        } else {
            atomic_fetch_add(&f->refused, 1);
            tsleep_ms(1);
        }
    }
    return NULL;
}

/* Starts f's thread on l and waits until the link took 100 of its messages. */
static void flood_start(flooder *f, rpc_link *l) {
    memset(f, 0, sizeof *f);
    f->l = l;
    cr_assert_eq(pthread_create(&f->th, NULL, flooder_main, f), 0);
    cr_assert(TWAIT(atomic_load(&f->ok) > 100, HANG_MS), "the flood is under way");
}

static void flood_stop(flooder *f) {
    atomic_store(&f->stop, true);
    pthread_join(f->th, NULL);
}

/* The home server shuts down while a thread floods the link with large messages: the server's
 * shutdown ends the stream and returns, sends answer UNAVAILABLE from then on, on_disconnect
 * says why, the link never reconnects, and everything is freed (the suite's leak check). */
Test(rpc_alink, server_shutdown_with_sends_in_flight_ends_the_link_cleanly) {
    alink_fx *fx = fx_start(0);
    static flooder f;
    flood_start(&f, fx->l);
    rpc_server_shutdown(fx->home, 0); /* with sends queued and in flight */
    rpc_server_destroy(fx->home);
    fx->home = NULL;
    cr_assert(TWAIT(atomic_load(&fx->r.disconnects) == 1, HANG_MS), "on_disconnect after the shutdown");
    cr_assert_eq(atomic_load(&fx->r.last_code), PIE_UNAVAILABLE, "disconnect: %s",
                 pie_code_name(atomic_load(&fx->r.last_code)));
    int refused = atomic_load(&f.refused);
    cr_assert(TWAIT(atomic_load(&f.refused) > refused + 10, HANG_MS), "sends are refused now");
    cr_assert(!rpc_link_connected(fx->l));
    tsleep_ms(300); /* longer than the 20-200 ms backoff: a reconnect would have happened */
    cr_assert_eq(atomic_load(&fx->r.connects), 1, "the link reconnected without its server");
    cr_assert_eq(atomic_load(&fx->r.disconnects), 1);
    flood_stop(&f);
    fx_finish(fx);
}

/* A peer that stops reading (its handler blocked; HTTP/2 flow control then holds the transport)
 * while the link floods it: once the queue passes its bound the send is refused UNAVAILABLE, the
 * stream ends with the same reason in on_disconnect, and when the peer reads again the link
 * reconnects. Memory stays bounded instead of the queue growing with the flood. */
Test(rpc_alink, a_peer_that_stops_reading_ends_the_stream_at_the_queue_bound) {
    alink_fx *fx = fx_start(1u << 20);
    pie_status st;
    tmsg stall = tmsg_of("stall");
    cr_assert_eq(rpc_link_send(fx->l, &stall.base, &st), PIE_OK, "%s", st.msg);
    static char big[64 * 1024];
    memset(big, 'y', sizeof big - 1);
    tmsg m = tmsg_of(big);
    pie_code rc = PIE_OK;
    int sent = 0;
    for (; sent < 4000 && rc == PIE_OK; sent++) rc = rpc_link_send(fx->l, &m.base, &st);
    cr_assert_eq(rc, PIE_UNAVAILABLE, "after %d sends of 64 KiB: %s (%s)", sent,
                 pie_code_name(rc), st.msg);
    cr_assert(strstr(st.msg, "the peer stopped reading"), "%s", st.msg);
    cr_assert(strstr(st.msg, "bound 1048576"), "%s", st.msg);
    cr_assert_geq(sent, 16, "refused before 1 MiB was queued");
    cr_assert(TWAIT(atomic_load(&fx->r.disconnects) == 1, HANG_MS), "on_disconnect after the bound");
    cr_assert_eq(atomic_load(&fx->r.last_code), PIE_UNAVAILABLE);
    pthread_mutex_lock(&fx->r.mu);
    bool why = strstr(fx->r.last_msg, "the peer stopped reading") != NULL;
    pthread_mutex_unlock(&fx->r.mu);
    cr_assert(why, "on_disconnect: %s", fx->r.last_msg);
    tsrv_release(fx->peer); /* it reads again: the link reconnects */
    cr_assert(TWAIT(rec_has(&fx->r, "register-2"), HANG_MS), "no reconnect after the peer recovered");
    fx_finish(fx);
}

/* rpc_link_stop with the stream busy, the server still running: stop cancels, collects every
 * tag, and the server then shuts down normally (its queue is not held by the link's call). */
Test(rpc_alink, stop_with_sends_in_flight_frees_everything_and_the_server_stops) {
    alink_fx *fx = fx_start(0);
    static flooder f;
    flood_start(&f, fx->l);
    flood_stop(&f); /* its last sends are still queued behind the one in flight */
    fx_stop_link(fx);
    rpc_server_shutdown(fx->home, 0); /* returns: the link's call no longer holds its queue */
    cr_assert_eq(atomic_load(&fx->r.disconnects), 0, "stop reports no disconnect");
    fx_finish(fx);
}

Test(rpc_alink, reset_reports_its_reason_and_reconnects) {
    alink_fx *fx = fx_start(0);
    rpc_link_reset(fx->l, 1, PIE_UNAVAILABLE, "test: the reason");
    cr_assert(TWAIT(rec_has(&fx->r, "register-2"), HANG_MS), "reconnected after the reset");
    cr_assert_eq(atomic_load(&fx->r.disconnects), 1);
    cr_assert_eq(atomic_load(&fx->r.last_code), PIE_UNAVAILABLE);
    pthread_mutex_lock(&fx->r.mu);
    char why[PIE_STATUS_MSG_MAX];
    snprintf(why, sizeof why, "%s", fx->r.last_msg);
    pthread_mutex_unlock(&fx->r.mu);
    cr_assert_str_eq(why, "test: the reason");
    cr_assert_eq(rpc_link_generation(fx->l), 2u);
    fx_finish(fx);
}

Test(rpc_alink, a_server_that_is_not_running_is_refused) {
    pie_status st;
    rpc_server *home = rpc_server_create(&(rpc_server_opts){.addr = "127.0.0.1:0"}, &st);
    cr_assert(home, "%s", st.msg);
    rpc_channel *ch = tchan(1, NULL);
    static alink_rec r;
    rec_init(&r);
    rpc_link_opts o = alink_opts(&r, home);
    cr_assert_null(rpc_link_start(ch, &o, &st));
    cr_assert_eq(st.code, PIE_FAILED_PRECONDITION, "%s", st.msg);
    rpc_channel_destroy(ch);
    rpc_server_destroy(home);
    rec_free(&r);
}
