/* ctl_cluster.c — see ctl_cluster.h. */
#include "ctl_cluster.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie/v1/controller.pb-c.h"
#include "pie_log.h"

struct ctl_cluster {
    pthread_mutex_t mu; /* serialises every call into core */
    pthread_cond_t cv;  /* wakes the timer thread (CLOCK_MONOTONIC) */
    pthread_t timer;
    bool timer_started, stop;
    int64_t timer_due; /* what the timer thread sleeps until; 0: no deadline */
    ctl_core *core;
    rpc_method methods[3];
};

/* Per-stream state (rpc_call data). */
typedef struct ctl_stream {
    ctl_replica *r; /* Session, once joined */
    ctl_worker *w;  /* WorkerLink, once registered */
} ctl_stream;

/* ---- sink: the core's output ------------------------------------------------------------------
 */

static void send_checked(rpc_call *call, const ProtobufCMessage *m, const char *what) {
    pie_code rc = rpc_call_send(call, m);
    if (rc != PIE_OK && rc != PIE_CANCELLED)
        pie_log_warn("ctl.send_failed", "stream=%s code=%s", what, pie_code_name(rc));
}

static void sink_replica(void *user, void *link, const Pie__V1__SessionDown *m) {
    (void)user;
    send_checked(link, &m->base, "session");
}

static void sink_worker(void *user, void *link, const Pie__V1__WorkerDown *m) {
    (void)user;
    send_checked(link, &m->base, "worker_link");
}

static void sink_end(void *user, void *link, pie_code code, const char *msg) {
    (void)user;
    rpc_call_cancel(link, code, msg);
}

/* After an entry into the core (mu held): wake the timer thread if something is now due
 * earlier than it planned for. */
static void kick_timer(ctl_cluster *c) {
    int64_t wake = ctl_core_next_wake(c->core);
    if (wake != 0 && (c->timer_due == 0 || wake < c->timer_due)) {
        c->timer_due = wake;
        pthread_cond_signal(&c->cv);
    }
}

static void *timer_main(void *arg) {
    ctl_cluster *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        int64_t now = rpc_now_ns();
        int64_t due = ctl_core_next_wake(c->core);
        if (due != 0 && due <= now) {
            ctl_core_tick(c->core, now);
            continue;
        }
        c->timer_due = due;
        if (due == 0) {
            pthread_cond_wait(&c->cv, &c->mu);
        } else {
            struct timespec ts = {.tv_sec = due / 1000000000, .tv_nsec = due % 1000000000};
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- streams ------------------------------------------------------------------------------- */

static bool stream_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    (void)user;
    ctl_stream *s = calloc(1, sizeof *s);
    if (s == NULL) {
        rpc_call_cancel(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return false;
    }
    rpc_call_set_data(call, s);
    return false;
}

static void stream_on_half_close(rpc_call *call, void *user) {
    (void)user;
    rpc_call_finish(call, PIE_OK, NULL);
}

static bool session_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    Pie__V1__SessionUp *up = (Pie__V1__SessionUp *)msg;
    if (s == NULL) return false;
    int64_t now = rpc_now_ns();
    bool kept = true;
    pthread_mutex_lock(&c->mu);
    if (s->r == NULL) {
        if (up->hello == NULL) {
            rpc_call_cancel(call, PIE_FAILED_PRECONDITION,
                            "Session: the first SessionUp must carry a hello");
            kept = false;
        } else {
            pie_status st;
            s->r = ctl_core_replica_join(c->core, call, up, now, &st);
            if (s->r == NULL) {
                rpc_call_cancel(call, st.code, st.msg);
                kept = false;
            }
        }
    } else {
        ctl_core_session_up(c->core, s->r, up, now);
    }
    kick_timer(c);
    pthread_mutex_unlock(&c->mu);
    return kept;
}

static void session_on_done(rpc_call *call, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    if (s == NULL) return;
    if (s->r) {
        pthread_mutex_lock(&c->mu);
        ctl_core_replica_leave(c->core, s->r, rpc_now_ns());
        kick_timer(c);
        pthread_mutex_unlock(&c->mu);
    }
    rpc_call_set_data(call, NULL);
    free(s);
}

static bool worker_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    Pie__V1__WorkerUp *up = (Pie__V1__WorkerUp *)msg;
    if (s == NULL) return false;
    int64_t now = rpc_now_ns();
    bool kept = true;
    pthread_mutex_lock(&c->mu);
    if (s->w == NULL) {
        if (up->registration == NULL) {
            rpc_call_cancel(call, PIE_FAILED_PRECONDITION,
                            "WorkerLink: the first WorkerUp must carry a registration");
            kept = false;
        } else {
            pie_status st;
            s->w = ctl_core_worker_join(c->core, call, up, now, &st);
            if (s->w == NULL) {
                pie_log_warn("ctl.worker.refused", "group=%s code=%s error=\"%s\"",
                             up->registration->group_id, pie_code_name(st.code), st.msg);
                rpc_call_cancel(call, st.code, st.msg);
                kept = false;
            }
        }
    } else {
        ctl_core_worker_up(c->core, s->w, up, now);
    }
    kick_timer(c);
    pthread_mutex_unlock(&c->mu);
    return kept;
}

static void worker_on_done(rpc_call *call, void *user) {
    ctl_cluster *c = user;
    ctl_stream *s = rpc_call_get_data(call);
    if (s == NULL) return;
    if (s->w) {
        pie_status why;
        pie_status_set(&why, PIE_UNAVAILABLE, "%s",
                       rpc_call_is_cancelled(call) ? "link cancelled or lost" : "link closed");
        pthread_mutex_lock(&c->mu);
        ctl_core_worker_leave(c->core, s->w, &why, rpc_now_ns());
        kick_timer(c);
        pthread_mutex_unlock(&c->mu);
    }
    rpc_call_set_data(call, NULL);
    free(s);
}

/* ---- ClusterStatus ------------------------------------------------------------------------- */

static void status_reply(void *arg, const Pie__V1__ClusterStatusResponse *r) {
    rpc_call *call = arg;
    if (r == NULL)
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
    else
        rpc_call_reply(call, &r->base); /* packs now */
}

static bool status_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    ctl_cluster *c = user;
    pthread_mutex_lock(&c->mu);
    ctl_core_status(c->core, status_reply, call);
    pthread_mutex_unlock(&c->mu);
    return false;
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

ctl_cluster *ctl_cluster_create(const ctl_core_config *cfg, pie_metrics *metrics, pie_status *st) {
    ctl_cluster *c = calloc(1, sizeof *c);
    if (c == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return NULL;
    }
    pthread_condattr_t ca;
    bool mu_ok = pthread_mutex_init(&c->mu, NULL) == 0;
    bool cv_ok = pthread_condattr_init(&ca) == 0;
    if (cv_ok) {
        cv_ok = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 &&
                pthread_cond_init(&c->cv, &ca) == 0;
        pthread_condattr_destroy(&ca);
    }
    if (!mu_ok || !cv_ok) {
        if (mu_ok) pthread_mutex_destroy(&c->mu);
        free(c);
        pie_status_set(st, PIE_INTERNAL,
                       "controller: cannot create its mutex / condition variable");
        return NULL;
    }
    ctl_sink sink = {.to_replica = sink_replica, .to_worker = sink_worker, .end_link = sink_end};
    c->core = ctl_core_create(cfg, &sink, metrics, st);
    if (c->core == NULL) {
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return NULL;
    }
    if (pthread_create(&c->timer, NULL, timer_main, c) != 0) {
        ctl_cluster_destroy(c);
        pie_status_set(st, PIE_INTERNAL, "controller: cannot start its timer thread");
        return NULL;
    }
    c->timer_started = true;
    c->methods[0] = (rpc_method){
        .path = "/pie.v1.Controller/WorkerLink",
        .kind = RPC_BIDI,
        .request = &pie__v1__worker_up__descriptor,
        .response = &pie__v1__worker_down__descriptor,
        .on_call = stream_on_call,
        .on_message = worker_on_message,
        .on_half_close = stream_on_half_close,
        .on_done = worker_on_done,
        .user = c,
    };
    c->methods[1] = (rpc_method){
        .path = "/pie.v1.Controller/Session",
        .kind = RPC_BIDI,
        .request = &pie__v1__session_up__descriptor,
        .response = &pie__v1__session_down__descriptor,
        .on_call = stream_on_call,
        .on_message = session_on_message,
        .on_half_close = stream_on_half_close,
        .on_done = session_on_done,
        .user = c,
    };
    c->methods[2] = (rpc_method){
        .path = "/pie.v1.Controller/ClusterStatus",
        .kind = RPC_UNARY,
        .request = &pie__v1__cluster_status_request__descriptor,
        .response = &pie__v1__cluster_status_response__descriptor,
        .on_call = status_on_call,
        .user = c,
    };
    return c;
}

uint32_t ctl_cluster_drain(ctl_cluster *c, const char *reason, int64_t timeout_ms) {
    const int64_t deadline = rpc_now_ns() + timeout_ms * 1000000;
    pthread_mutex_lock(&c->mu);
    ctl_core_drain(c->core, reason, rpc_now_ns());
    kick_timer(c);
    uint32_t out = ctl_core_steps_out(c->core);
    /* Results arrive on the completion-queue thread, which needs the mutex: poll (shutdown
     * only, so a 1 ms period costs nothing that matters). */
    while (out > 0 && rpc_now_ns() < deadline) {
        pthread_mutex_unlock(&c->mu);
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 1000000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&c->mu);
        out = ctl_core_steps_out(c->core);
    }
    ctl_core_end_worker_links(c->core, "controller shutting down (drained)");
    pthread_mutex_unlock(&c->mu);
    return out;
}

const rpc_method *ctl_cluster_methods(ctl_cluster *c, size_t *n) {
    *n = sizeof c->methods / sizeof c->methods[0];
    return c->methods;
}

void ctl_cluster_destroy(ctl_cluster *c) {
    if (c == NULL) return;
    if (c->timer_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_signal(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->timer, NULL);
    }
    ctl_core_destroy(c->core);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}
