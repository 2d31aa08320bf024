/* rpc_link.c — a long-lived bidi stream that reopens itself.
 *
 * Owns: the link thread (open → wait until the server accepts → on_connect → receive loop →
 * on_disconnect → on_backoff → backoff with jitter → reopen), rpc_link_send from any thread,
 * and stopping.
 * Lifecycle replicas and worker groups hold one link each to the controller; on_connect is
 * where they (re-)register. Built on rpc_stream (rpc_client.c). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pie_log.h"
#include "rpc_internal.h"

struct rpc_link {
    rpc_channel *ch;
    rpc_link_opts o; /* path and md point at the copies below */
    char *path;
    rpc_md *md;
    char *md_strings;
    pthread_t th;
    unsigned seed; /* jitter; per link, so no shared random state */
    atomic_uint connects;

    pthread_mutex_t mu; /* guards the fields below */
    pthread_cond_t cv;
    rpc_stream *stream; /* the open stream while the thread is in an attempt */
    bool connected;
    bool stop;
    unsigned senders; /* rpc_link_send calls using stream right now */
    uint64_t gen;     /* generation of the connected stream (its on_connect count); 0: none */
    bool reset;       /* rpc_link_reset ended the stream of gen: on_disconnect gets reset_st */
    pie_status reset_st;
};

/* A connected stream that lived this long (or delivered a message) resets the backoff. */
#define RPC_LINK_HEALTHY_NS (1000LL * 1000000)

static int64_t link_delay_ms(rpc_link *l, unsigned attempt) {
    double d = (double)l->o.backoff_initial_ms;
    for (unsigned i = 0; i < attempt && d < (double)l->o.backoff_max_ms; i++)
        d *= l->o.backoff_multiplier;
    if (d > (double)l->o.backoff_max_ms) d = (double)l->o.backoff_max_ms;
    if (l->o.backoff_jitter > 0) {
        double u = (double)rand_r(&l->seed) / (double)RAND_MAX; /* [0,1] */
        d *= 1.0 + l->o.backoff_jitter * (2.0 * u - 1.0);
    }
    return d < 1 ? 1 : (int64_t)d;
}

/* Sleeps ms unless stopped first. Returns true if the link is stopping. */
static bool link_sleep(rpc_link *l, int64_t ms) {
    int64_t deadline = rpc_now_ns() + ms * 1000000;
    struct timespec ts = {.tv_sec = deadline / 1000000000, .tv_nsec = deadline % 1000000000};
    pthread_mutex_lock(&l->mu);
    while (!l->stop && pthread_cond_timedwait(&l->cv, &l->mu, &ts) != ETIMEDOUT) {}
    bool stop = l->stop;
    pthread_mutex_unlock(&l->mu);
    return stop;
}

static void *link_main(void *arg) {
    rpc_link *l = arg;
    (void)pthread_setname_np(pthread_self(), "rpc-link"); /* cosmetic */
    unsigned attempt = 0;
    rpc_call_opts co = {.md = l->o.md, .n_md = l->o.n_md};
    for (;;) {
        pie_status st;
        pie_status_ok(&st);
        bool connected = false, got_msg = false;
        int64_t t_open = rpc_now_ns();
        rpc_stream *s = rpc_stream_open(l->ch, l->path, l->o.response, &co, &st);
        if (s) {
            pthread_mutex_lock(&l->mu);
            bool stop = l->stop;
            if (!stop) l->stream = s;
            pthread_mutex_unlock(&l->mu);
            if (stop) {
                rpc_stream_destroy(s);
                break;
            }
            if (rpc_stream_wait_ready(s, -1, &st) == PIE_OK) {
                connected = true;
                pthread_mutex_lock(&l->mu);
                l->connected = true;
                l->gen = (uint64_t)atomic_fetch_add(&l->connects, 1) + 1;
                pthread_mutex_unlock(&l->mu);
                if (l->o.on_connect) l->o.on_connect(l, l->o.user);
                ProtobufCMessage *m;
                while (rpc_stream_recv(s, &m, -1) == RPC_RECV_MESSAGE) {
                    got_msg = true;
                    if (!l->o.on_message(l, m, l->o.user)) rpc_msg_free(m);
                }
            }
            pthread_mutex_lock(&l->mu);
            l->connected = false;
            l->stream = NULL;
            l->gen = 0;
            while (l->senders > 0) /* their sends fail at once: the call is over or cancelled */
                pthread_cond_wait(&l->cv, &l->mu);
            pthread_mutex_unlock(&l->mu);
            if (connected || st.code == PIE_OK) (void)rpc_stream_finish(s, &st);
            rpc_stream_destroy(s);
            pthread_mutex_lock(&l->mu);
            if (l->reset) { /* our own cancel: report why it was ended, not CANCELLED (a status
                               the server sent first, e.g. its reason for ending, is kept) */
                if (st.code == PIE_CANCELLED || st.code == PIE_OK) st = l->reset_st;
                l->reset = false;
            }
            pthread_mutex_unlock(&l->mu);
        }
        pthread_mutex_lock(&l->mu);
        bool stop = l->stop;
        pthread_mutex_unlock(&l->mu);
        if (stop) break;
        if (st.code == PIE_OK) pie_status_set(&st, PIE_UNAVAILABLE, "the server ended the stream");
        if (l->o.on_disconnect) l->o.on_disconnect(l, &st, l->o.user);
        if (connected && (got_msg || rpc_now_ns() - t_open >= RPC_LINK_HEALTHY_NS)) attempt = 0;
        int64_t delay = link_delay_ms(l, attempt);
        if (l->o.on_backoff) l->o.on_backoff(l, attempt, delay, l->o.user);
        if (attempt < 64) attempt++;
        pie_log_debug("rpc.link_retry", "path=%s code=%s delay_ms=%lld", l->path,
                      pie_code_name(st.code), (long long)delay);
        if (link_sleep(l, delay)) break;
    }
    return NULL;
}

static void link_free(rpc_link *l) {
    free(l->path);
    free(l->md);
    free(l->md_strings);
    free(l);
}

rpc_link *rpc_link_start(rpc_channel *ch, const rpc_link_opts *opts, pie_status *st) {
    if (!ch || !opts || !opts->path || !opts->response || !opts->on_message) {
        pie_status_set(
            st, PIE_INVALID_ARGUMENT,
            "rpc_link_start: channel, opts.path, opts.response and opts.on_message are required");
        return NULL;
    }
    rpc_link *l = calloc(1, sizeof *l);
    if (!l) goto oom;
    l->ch = ch;
    l->o = *opts;
    if (l->o.backoff_initial_ms <= 0) l->o.backoff_initial_ms = 100;
    if (l->o.backoff_max_ms <= 0) l->o.backoff_max_ms = 5000;
    if (l->o.backoff_max_ms < l->o.backoff_initial_ms)
        l->o.backoff_max_ms = l->o.backoff_initial_ms;
    if (l->o.backoff_multiplier < 1.0) l->o.backoff_multiplier = 1.6;
    if (l->o.backoff_jitter == 0) l->o.backoff_jitter = 0.2;
    if (l->o.backoff_jitter > 1) l->o.backoff_jitter = 1;
    l->seed = (unsigned)rpc_now_ns() ^ (unsigned)(uintptr_t)l;
    atomic_init(&l->connects, 0);
    l->path = strdup(opts->path);
    if (!l->path) goto oom;
    l->o.path = l->path;
    if (opts->n_md) {
        size_t bytes = 0;
        for (size_t i = 0; i < opts->n_md; i++)
            bytes += strlen(opts->md[i].key) + strlen(opts->md[i].value) + 2;
        l->md = calloc(opts->n_md, sizeof *l->md);
        l->md_strings = malloc(bytes);
        if (!l->md || !l->md_strings) goto oom;
        char *p = l->md_strings;
        for (size_t i = 0; i < opts->n_md; i++) {
            size_t kl = strlen(opts->md[i].key) + 1, vl = strlen(opts->md[i].value) + 1;
            memcpy(p, opts->md[i].key, kl);
            l->md[i].key = p;
            p += kl;
            memcpy(p, opts->md[i].value, vl);
            l->md[i].value = p;
            p += vl;
        }
        l->o.md = l->md;
    }
    if (pthread_mutex_init(&l->mu, NULL) != 0) {
        link_free(l);
        pie_status_set(st, PIE_INTERNAL, "rpc_link_start: pthread_mutex_init failed");
        return NULL;
    }
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0) {
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        if (rc == 0) rc = pthread_cond_init(&l->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    if (rc != 0) {
        pthread_mutex_destroy(&l->mu);
        link_free(l);
        pie_status_set(st, PIE_INTERNAL, "rpc_link_start: pthread_cond_init failed");
        return NULL;
    }
    rc = pthread_create(&l->th, NULL, link_main, l);
    if (rc != 0) {
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        link_free(l);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_link_start: pthread_create: %s",
                       strerror(rc));
        return NULL;
    }
    return l;
oom:
    if (l) link_free(l);
    pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_link_start: out of memory");
    return NULL;
}

/* Sends on the connected stream if its generation is gen (0: whichever is connected). */
static pie_code link_send(rpc_link *l, uint64_t gen, const ProtobufCMessage *msg, pie_status *st) {
    pthread_mutex_lock(&l->mu);
    rpc_stream *s = l->connected ? l->stream : NULL;
    if (!s) {
        pthread_mutex_unlock(&l->mu);
        return pie_status_set(st, PIE_UNAVAILABLE, "rpc_link_send %s: not connected", l->path);
    }
    if (gen != 0 && l->gen != gen) {
        uint64_t now = l->gen;
        pthread_mutex_unlock(&l->mu);
        return pie_status_set(st, PIE_UNAVAILABLE,
                              "rpc_link_send %s: stream %llu ended (stream %llu is open now)",
                              l->path, (unsigned long long)gen, (unsigned long long)now);
    }
    l->senders++;
    pthread_mutex_unlock(&l->mu);
    pie_code rc = rpc_stream_send(s, msg, st);
    pthread_mutex_lock(&l->mu);
    if (--l->senders == 0) pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return rc;
}

pie_code rpc_link_send(rpc_link *l, const ProtobufCMessage *msg, pie_status *st) {
    return link_send(l, 0, msg, st);
}

pie_code rpc_link_send_gen(rpc_link *l, uint64_t gen, const ProtobufCMessage *msg, pie_status *st) {
    if (gen == 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "rpc_link_send %s: not connected", l->path);
    return link_send(l, gen, msg, st);
}

uint64_t rpc_link_generation(rpc_link *l) {
    pthread_mutex_lock(&l->mu);
    uint64_t g = l->connected ? l->gen : 0;
    pthread_mutex_unlock(&l->mu);
    return g;
}

void rpc_link_reset(rpc_link *l, uint64_t gen, pie_code code, const char *msg) {
    pthread_mutex_lock(&l->mu);
    if (gen != 0 && l->connected && l->gen == gen && l->stream && !l->reset && !l->stop) {
        l->reset = true;
        pie_status_set(&l->reset_st, code, "%s", msg ? msg : pie_code_name(code));
        rpc_stream_cancel(l->stream); /* the link thread's receive ends, then on_disconnect */
    }
    pthread_mutex_unlock(&l->mu);
}

bool rpc_link_connected(rpc_link *l) {
    pthread_mutex_lock(&l->mu);
    bool c = l->connected;
    pthread_mutex_unlock(&l->mu);
    return c;
}

unsigned rpc_link_connects(rpc_link *l) { return atomic_load(&l->connects); }

void rpc_link_stop(rpc_link *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    if (l->stream) rpc_stream_cancel(l->stream);
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    int rc = pthread_join(l->th, NULL);
    if (rc != 0) pie_log_error("rpc.link_stop", "pthread_join: %s", strerror(rc));
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    link_free(l);
}
