/* test_rpc_util.h — a tiny echo service over services/common/rpc for the RPC tests.
 *
 * Payloads are grpc.health.v1.HealthCheckRequest messages: their `service` string is the text.
 * Methods of "/test.Echo/":
 *   Unary   (unary)          echoes; text commands: "sleep" never answers (deadline tests),
 *                            "later" answers "later-done" from another thread once the test
 *                            calls tsrv_release (tsrv_stop releases too), "error" finishes
 *                            INVALID_ARGUMENT, "meta" answers with the x-token request metadata,
 *                            "big:N" answers with N bytes, "mark" answers with how many stream
 *                            messages the server had taken before it (n_msg)
 *   Collect (client stream)  joins every text with ',' and answers at half-close; "busy:MS"
 *                            keeps the handler busy MS ms first
 *   Repeat  (server stream)  "N" → a thread sends "0".."N-1" with rpc_call_send_wait then
 *                            finishes OK (a send refused with CANCELLED counts n_late_cancelled);
 *                            "flood:N" → a thread sends N-byte messages with rpc_call_send until
 *                            RESOURCE_EXHAUSTED, records how many were accepted, then finishes;
 *                            "room:N:MS" → a thread keeps the call in room_call (a reference)
 *                            and sends N 64 KiB messages, each after rpc_call_wait_room(call,
 *                            100 messages, TROOM_BYTES, MS ms from now; -1: no deadline) until
 *                            that refuses (room_rc), counting room_sent and the most messages
 *                            queued after a send (room_max_queued), then finishes OK
 *   Chat    (bidi)           echoes each text (cancels the call if rpc_call_send refuses);
 *                            "abort" finishes ABORTED "told to abort",
 *                            "cancel" calls rpc_call_cancel(PERMISSION_DENIED, "told to cancel"),
 *                            "stall" blocks the handler (a peer that stops reading) until
 *                            tsrv_release, then echoes; "busy:MS" keeps the handler (and so
 *                            its completion-queue thread) busy MS ms, then echoes;
 *                            at half-close finishes OK with trailing metadata x-count */
#ifndef TEST_RPC_UTIL_H
#define TEST_RPC_UTIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "rpc.h"

#include "pie_testutil.h"

/* Suite .fini: under AddressSanitizer, check for leaks now and abort if there are any. Alone,
 * LeakSanitizer only prints a report from Criterion's child process and the test still passes;
 * an abort in .fini makes the runner say "crashed during its setup or teardown" and exit 1.
 * Everything the test made must be destroyed before this runs. */
#define TLEAK_CHECK() pie_test_leak_check()

typedef Grpc__Health__V1__HealthCheckRequest tmsg;
#define TMSG_DESC (&grpc__health__v1__health_check_request__descriptor)

typedef struct tsrv {
    rpc_server *srv;
    int port;
    atomic_int n_call, n_msg, n_half, n_cancel, n_done, n_late_cancelled, flood_accepted;
    atomic_int room_sent, room_rc, room_max_queued;
    _Atomic(rpc_call *) room_call;
    atomic_long last_remaining_ms;
    pthread_mutex_t mu;
    pthread_cond_t released_cv; /* signalled when released becomes true */
    bool released;              /* "later" calls may answer (under mu) */
    pthread_t threads[256];
    int n_threads;
} tsrv;

/* Hang guard for TWAIT in the RPC tests: far above any real wait on a loaded machine, reached
 * only when something is stuck. Tests assert outcomes, never how long something took. */
#define THANG_MS 30000

typedef struct tchat {
    int count;
} tchat;

static inline tmsg tmsg_of(const char *text) {
    tmsg m = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    m.service = (char *)text;
    return m;
}

static inline const char *tmsg_text(const ProtobufCMessage *m) {
    return ((const tmsg *)m)->service;
}

static inline void tsleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Polls cond every 2 ms for up to ms milliseconds; evaluates to cond's final value. */
#define TWAIT(cond, ms)                                         \
    ({                                                          \
        int64_t tw_end_ = rpc_now_ns() + (int64_t)(ms)*1000000; \
        while (!(cond) && rpc_now_ns() < tw_end_) tsleep_ms(2); \
        (cond);                                                 \
    })

static inline void tsrv_spawn(tsrv *t, void *(*fn)(void *), void *arg) {
    pthread_mutex_lock(&t->mu);
    if (t->n_threads < 256 && pthread_create(&t->threads[t->n_threads], NULL, fn, arg) == 0)
        t->n_threads++;
    pthread_mutex_unlock(&t->mu);
}

/* --- Unary --- */

typedef struct tlater {
    tsrv *t;
    rpc_call *call;
    char text[64];
} tlater;

/* Lets every "later" call answer, now and from now on. */
static inline void tsrv_release(tsrv *t) {
    pthread_mutex_lock(&t->mu);
    t->released = true;
    pthread_cond_broadcast(&t->released_cv);
    pthread_mutex_unlock(&t->mu);
}

static inline void *tlater_main(void *arg) {
    tlater *l = arg;
    pthread_mutex_lock(&l->t->mu);
    while (!l->t->released) pthread_cond_wait(&l->t->released_cv, &l->t->mu);
    pthread_mutex_unlock(&l->t->mu);
    tmsg r = tmsg_of(l->text);
    (void)rpc_call_reply(l->call, &r.base);
    rpc_call_unref(l->call);
    free(l);
    return NULL;
}

static inline bool t_unary(rpc_call *call, ProtobufCMessage *req, void *user) {
    tsrv *t = user;
    /* before n_call: a test that saw n_call change reads this call's value */
    atomic_store(&t->last_remaining_ms, (long)rpc_call_remaining_ms(call));
    atomic_fetch_add(&t->n_call, 1);
    const char *text = tmsg_text(req);
    if (strcmp(text, "sleep") == 0)
        return false; /* never answered: the client's deadline ends it */
    if (strcmp(text, "error") == 0) {
        (void)rpc_call_finish(call, PIE_INVALID_ARGUMENT, "error requested");
        return false;
    }
    if (strcmp(text, "later") == 0) {
        tlater *l = calloc(1, sizeof *l);
        if (!l) {
            (void)rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "oom");
            return false;
        }
        rpc_call_ref(call);
        l->t = t;
        l->call = call;
        snprintf(l->text, sizeof l->text, "later-done");
        tsrv_spawn(t, tlater_main, l);
        return false;
    }
    if (strcmp(text, "mark") == 0) {
        char n[16];
        snprintf(n, sizeof n, "%d", atomic_load(&t->n_msg));
        tmsg r = tmsg_of(n);
        (void)rpc_call_reply(call, &r.base);
        return false;
    }
    if (strcmp(text, "meta") == 0) {
        const char *v = rpc_call_metadata(call, "x-token");
        tmsg r = tmsg_of(v ? v : "(none)");
        (void)rpc_call_reply(call, &r.base);
        return false;
    }
    if (strncmp(text, "big:", 4) == 0) {
        size_t n = (size_t)atol(text + 4);
        char *buf = malloc(n + 1);
        if (!buf) return false;
        memset(buf, 'b', n);
        buf[n] = '\0';
        tmsg r = tmsg_of(buf);
        pie_code rc = rpc_call_reply(call, &r.base);
        free(buf);
        if (rc != PIE_OK) (void)rpc_call_finish(call, rc, "reply refused");
        return false;
    }
    tmsg r = tmsg_of(text);
    (void)rpc_call_reply(call, &r.base);
    return false;
}

/* --- Collect --- */

static inline bool t_collect_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    tsrv *t = user;
    atomic_fetch_add(&t->n_call, 1);
    char *acc = calloc(1, 4096);
    rpc_call_set_data(call, acc);
    return false;
}

static inline bool t_collect_msg(rpc_call *call, ProtobufCMessage *msg, void *user) {
    tsrv *t = user;
    atomic_fetch_add(&t->n_msg, 1);
    if (strncmp(tmsg_text(msg), "busy:", 5) == 0) tsleep_ms(atoi(tmsg_text(msg) + 5));
    char *acc = rpc_call_get_data(call);
    if (acc) {
        size_t n = strlen(acc);
        snprintf(acc + n, 4096 - n, "%s%s", n ? "," : "", tmsg_text(msg));
    }
    return false;
}

static inline void t_collect_half(rpc_call *call, void *user) {
    tsrv *t = user;
    atomic_fetch_add(&t->n_half, 1);
    char *acc = rpc_call_get_data(call);
    tmsg r = tmsg_of(acc ? acc : "");
    (void)rpc_call_reply(call, &r.base);
}

static inline void t_count_cancel(rpc_call *call, void *user) {
    (void)call;
    atomic_fetch_add(&((tsrv *)user)->n_cancel, 1);
}

static inline void t_free_data_done(rpc_call *call, void *user) {
    free(rpc_call_get_data(call));
    rpc_call_set_data(call, NULL);
    atomic_fetch_add(&((tsrv *)user)->n_done, 1);
}

/* --- Repeat --- */

typedef struct trepeat {
    tsrv *t;
    rpc_call *call;
    int n;
    size_t flood_bytes;
    bool room;
    int room_ms;
} trepeat;

#define TROOM_MSG   65536
#define TROOM_BYTES (3 * TROOM_MSG) /* two packed 64 KiB messages fit, three do not */

static inline void trepeat_room(trepeat *r) {
    char *buf = malloc(TROOM_MSG + 1);
    if (buf == NULL) return;
    memset(buf, 'r', TROOM_MSG);
    buf[TROOM_MSG] = '\0';
    rpc_call_ref(r->call);
    atomic_store(&r->t->room_call, r->call);
    for (int i = 0; i < r->n; i++) {
        int64_t deadline =
            r->room_ms < 0 ? RPC_DEADLINE_NONE : rpc_now_ns() + r->room_ms * 1000000ll;
        pie_code rc = rpc_call_wait_room(r->call, 100, TROOM_BYTES, deadline);
        if (rc != PIE_OK) {
            atomic_store(&r->t->room_rc, (int)rc);
            break;
        }
        snprintf(buf, 16, "%08d", i);
        buf[8] = 'r';
        tmsg m = tmsg_of(buf);
        if (rpc_call_send(r->call, &m.base) != PIE_OK) break;
        atomic_fetch_add(&r->t->room_sent, 1);
        int q = (int)rpc_call_send_queued(r->call);
        if (q > atomic_load(&r->t->room_max_queued)) atomic_store(&r->t->room_max_queued, q);
    }
    free(buf);
}

static inline void *trepeat_main(void *arg) {
    trepeat *r = arg;
    if (r->room) {
        trepeat_room(r);
    } else if (r->flood_bytes) {
        char *buf = malloc(r->flood_bytes + 1);
        if (buf) {
            memset(buf, 'f', r->flood_bytes);
            buf[r->flood_bytes] = '\0';
            tmsg m = tmsg_of(buf);
            int accepted = 0;
            for (int i = 0; i < 100000; i++) {
                pie_code rc = rpc_call_send(r->call, &m.base);
                if (rc != PIE_OK) break;
                accepted++;
                tsleep_ms(1);
            }
            atomic_store(&r->t->flood_accepted, accepted);
            free(buf);
        }
    } else {
        for (int i = 0; i < r->n; i++) {
            char text[32];
            snprintf(text, sizeof text, "%d", i);
            tmsg m = tmsg_of(text);
            pie_code rc = rpc_call_send_wait(r->call, &m.base, 5000);
            if (rc != PIE_OK) {
                if (rc == PIE_CANCELLED) atomic_fetch_add(&r->t->n_late_cancelled, 1);
                break;
            }
        }
    }
    (void)rpc_call_finish(r->call, PIE_OK, NULL);
    rpc_call_unref(r->call);
    free(r);
    return NULL;
}

static inline bool t_repeat(rpc_call *call, ProtobufCMessage *req, void *user) {
    tsrv *t = user;
    atomic_fetch_add(&t->n_call, 1);
    trepeat *r = calloc(1, sizeof *r);
    if (!r) return false;
    r->t = t;
    r->call = call;
    const char *text = tmsg_text(req);
    if (strncmp(text, "flood:", 6) == 0) {
        r->flood_bytes = (size_t)atol(text + 6);
    } else if (sscanf(text, "room:%d:%d", &r->n, &r->room_ms) == 2) {
        r->room = true;
    } else {
        r->n = atoi(text);
    }
    rpc_call_ref(call);
    tsrv_spawn(t, trepeat_main, r);
    return false;
}

static inline void t_count_done(rpc_call *call, void *user) {
    (void)call;
    atomic_fetch_add(&((tsrv *)user)->n_done, 1);
}

/* --- Chat --- */

static inline bool t_chat_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    tsrv *t = user;
    atomic_fetch_add(&t->n_call, 1);
    const char *tok = rpc_call_metadata(call, "x-token");
    if (tok) (void)rpc_call_add_metadata(call, "x-echo-token", tok);
    rpc_call_set_data(call, calloc(1, sizeof(tchat)));
    return false;
}

static inline bool t_chat_msg(rpc_call *call, ProtobufCMessage *msg, void *user) {
    tsrv *t = user;
    atomic_fetch_add(&t->n_msg, 1);
    tchat *c = rpc_call_get_data(call);
    if (c) c->count++;
    const char *text = tmsg_text(msg);
    if (strcmp(text, "abort") == 0) {
        (void)rpc_call_finish(call, PIE_ABORTED, "told to abort");
        return false;
    }
    if (strcmp(text, "cancel") == 0) {
        rpc_call_cancel(call, PIE_PERMISSION_DENIED, "told to cancel");
        return false;
    }
    if (strcmp(text, "stall") == 0) {
        pthread_mutex_lock(&t->mu);
        while (!t->released) pthread_cond_wait(&t->released_cv, &t->mu);
        pthread_mutex_unlock(&t->mu);
    }
    if (strncmp(text, "busy:", 5) == 0) tsleep_ms(atoi(text + 5));
    pie_code rc = rpc_call_send(call, msg);
    if (rc != PIE_OK && rc != PIE_CANCELLED)
        rpc_call_cancel(call, rc, "echo refused by rpc_call_send");
    return false;
}

static inline void t_chat_half(rpc_call *call, void *user) {
    tsrv *t = user;
    atomic_fetch_add(&t->n_half, 1);
    tchat *c = rpc_call_get_data(call);
    char n[16];
    snprintf(n, sizeof n, "%d", c ? c->count : -1);
    (void)rpc_call_add_trailing_metadata(call, "x-count", n);
    (void)rpc_call_finish(call, PIE_OK, NULL);
}

static inline void tsrv_methods(tsrv *t, rpc_method m[4]) {
    memset(m, 0, 4 * sizeof *m);
    m[0] = (rpc_method){.path = "/test.Echo/Unary",
                        .kind = RPC_UNARY,
                        .request = TMSG_DESC,
                        .response = TMSG_DESC,
                        .on_call = t_unary,
                        .on_cancel = t_count_cancel,
                        .on_done = t_count_done,
                        .user = t};
    m[1] = (rpc_method){.path = "/test.Echo/Collect",
                        .kind = RPC_CLIENT_STREAM,
                        .request = TMSG_DESC,
                        .response = TMSG_DESC,
                        .on_call = t_collect_call,
                        .on_message = t_collect_msg,
                        .on_half_close = t_collect_half,
                        .on_cancel = t_count_cancel,
                        .on_done = t_free_data_done,
                        .user = t};
    m[2] = (rpc_method){.path = "/test.Echo/Repeat",
                        .kind = RPC_SERVER_STREAM,
                        .request = TMSG_DESC,
                        .response = TMSG_DESC,
                        .on_call = t_repeat,
                        .on_cancel = t_count_cancel,
                        .on_done = t_count_done,
                        .user = t};
    m[3] = (rpc_method){.path = "/test.Echo/Chat",
                        .kind = RPC_BIDI,
                        .request = TMSG_DESC,
                        .response = TMSG_DESC,
                        .on_call = t_chat_call,
                        .on_message = t_chat_msg,
                        .on_half_close = t_chat_half,
                        .on_cancel = t_count_cancel,
                        .on_done = t_free_data_done,
                        .user = t};
}

/* Starts the echo server with opts (addr defaults to 127.0.0.1:0). NULL on failure, with *st. */
static inline tsrv *tsrv_start(const rpc_server_opts *opts, pie_status *st) {
    tsrv *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    pthread_mutex_init(&t->mu, NULL);
    if (pthread_cond_init(&t->released_cv, NULL) != 0) {
        pie_status_set(st, PIE_INTERNAL, "tsrv_start: pthread_cond_init failed");
        pthread_mutex_destroy(&t->mu);
        free(t);
        return NULL;
    }
    rpc_server_opts o = {0};
    if (opts) o = *opts;
    if (!o.addr) o.addr = "127.0.0.1:0";
    t->srv = rpc_server_create(&o, st);
    rpc_method m[4];
    tsrv_methods(t, m);
    if (!t->srv || rpc_server_add_methods(t->srv, m, 4, st) != PIE_OK ||
        rpc_server_start(t->srv, st) != PIE_OK) {
        rpc_server_destroy(t->srv);
        pthread_cond_destroy(&t->released_cv);
        pthread_mutex_destroy(&t->mu);
        free(t);
        return NULL;
    }
    t->port = rpc_server_port(t->srv);
    return t;
}

/* Releases "later" calls, graceful stop with grace_ms, joins helper threads, frees. */
static inline void tsrv_stop(tsrv *t, int64_t grace_ms) {
    if (!t) return;
    tsrv_release(t);
    rpc_server_shutdown(t->srv, grace_ms);
    pthread_mutex_lock(&t->mu);
    int n = t->n_threads;
    pthread_mutex_unlock(&t->mu);
    for (int i = 0; i < n; i++) pthread_join(t->threads[i], NULL);
    rpc_call_unref(atomic_load(&t->room_call));
    rpc_server_destroy(t->srv);
    pthread_cond_destroy(&t->released_cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static inline rpc_channel *tchan(int port, const rpc_channel_opts *o) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    return rpc_channel_create(target, o, NULL);
}

/* --- calls from a thread of their own, so a test can act while they are in flight --- */

typedef struct tunary {
    rpc_channel *ch;
    const char *text;
    int64_t timeout_ms; /* 0: THANG_MS */
    pie_code rc;
    char out[PIE_STATUS_MSG_MAX]; /* the reply's text, or the status message */
    atomic_bool done;
    pthread_t th;
} tunary;

static inline void *tunary_main(void *arg) {
    tunary *u = arg;
    tmsg req = tmsg_of(u->text);
    ProtobufCMessage *resp = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = u->timeout_ms ? u->timeout_ms : THANG_MS};
    u->rc = rpc_unary(u->ch, "/test.Echo/Unary", &req.base, TMSG_DESC, &resp, &o, &st);
    snprintf(u->out, sizeof u->out, "%s", resp ? tmsg_text(resp) : st.msg);
    rpc_msg_free(resp);
    atomic_store(&u->done, true);
    return NULL;
}

/* Starts the call on its own thread; 0 or an errno. */
static inline int tunary_start(tunary *u) {
    atomic_init(&u->done, false);
    return pthread_create(&u->th, NULL, tunary_main, u);
}

typedef struct tshutdown {
    rpc_server *srv;
    int64_t grace_ms;
    atomic_bool done;
    pthread_t th;
} tshutdown;

static inline void *tshutdown_main(void *arg) {
    tshutdown *s = arg;
    rpc_server_shutdown(s->srv, s->grace_ms);
    atomic_store(&s->done, true);
    return NULL;
}

/* rpc_server_shutdown on its own thread (the test watches it and what it does to calls); 0 or
 * an errno. */
static inline int tshutdown_start(tshutdown *s, rpc_server *srv, int64_t grace_ms) {
    s->srv = srv;
    s->grace_ms = grace_ms;
    atomic_init(&s->done, false);
    return pthread_create(&s->th, NULL, tshutdown_main, s);
}

#endif
