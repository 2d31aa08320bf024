/* wrk_node.c — see wrk_node.h.
 *
 * Threads and the one lock that matters: the link thread runs on_connect / on_message /
 * on_disconnect; the executor thread emits results; the heartbeat thread sends stats. Every
 * send happens under send_mu together with a check of the link's epoch (bumped in
 * on_disconnect) or of worker_index (non-zero only between `registered` and the next
 * disconnect), so nothing reaches a new stream before its registration, and results of steps
 * received on a lost stream are dropped instead of reaching the next one. */
#include "wrk_node.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "pie/v1/worker.pb-c.h"
#include "pie_log.h"
#include "svc.h"
#include "wrk_exec.h"
#include "wrk_memrt.h"
#include "wrk_tp.h"
#include "wrk_tp_cuda.h"

#define WRK_DEFAULT_HEARTBEAT_MS 1000u /* WorkerRegistered.heartbeat_ms 0, and before it */

struct wrk_node {
    wrk_node_config cfg;
    _Atomic(const char *) group_id; /* cfg.group_id, or the default set by link_start */
    char default_group[320];
    rpc_method methods[2];
    pie_gauge *g_linked;
    pie_metrics *metrics;

    /* loading state: the fields below it are written before `state` is stored */
    atomic_int state; /* Pie__V1__LoadState */
    pie_status failed;
    wrk_node_ready ready;
    char device[128];
    /* a group's ranks (wrk_node_ready.ranks copied) and their messages, which point into it */
    wrk_tp_rank_info *rank_info;
    Pie__V1__TpRank *rank_pb, **rank_ptrs;
    size_t n_ranks;
    /* a group whose ranks start one by one: what TpJoin offers (rank 0), under tp_mu */
    pthread_mutex_t tp_mu;
    wrk_tp_offer tp_offer;
    bool has_tp_offer;

    wrk_exec *exec;
    rpc_channel *ch;
    rpc_link *link;

    pthread_mutex_t send_mu;   /* guards every send and every change of the three below */
    rpc_link *cur_link;        /* the link while a stream is connected (set in on_connect) */
    _Atomic uint64_t epoch;    /* bumped when a stream ends (read lock-free by the link thread) */
    uint32_t worker_index;     /* assigned by the controller; 0 while unregistered */
    atomic_bool warned_credit; /* a step without a credit was logged on this stream */
    atomic_uint linked_index;  /* worker_index, for Info without the lock */
    atomic_uint heartbeat_ms;
    atomic_int credits;  /* granted and not yet used by the controller on this stream */
    atomic_bool closing; /* wrk_node_destroy began: no more sends or submissions */

    pthread_t beat_th;
    bool beat_started;
    pthread_mutex_t beat_mu;
    pthread_cond_t beat_cv;
    bool beat_stop, beat_kick;

    /* drain (wrk_node_drain); drain_done is guarded by beat_mu */
    pthread_cond_t drain_cv; /* drain_done became true */
    atomic_bool draining;    /* every registration from now on says WorkerUp.draining */
    bool drain_done;         /* the controller released us (Drain{shutdown}) or the link ended */
};

/* The drain is over: wakes wrk_node_drain. */
static void drain_finish(wrk_node *w) {
    pthread_mutex_lock(&w->beat_mu);
    w->drain_done = true;
    pthread_cond_broadcast(&w->drain_cv);
    pthread_mutex_unlock(&w->beat_mu);
}

static void stats_of(wrk_node *w, Pie__V1__WorkerStats *s) {
    pie__v1__worker_stats__init(s);
    wrk_exec_stats(w->exec, s);
    s->device_memory_bytes = w->ready.device_pool_bytes;
    s->host_memory_bytes = w->ready.host_pool_bytes;
    wrk_memrt_stats(w->ready.mem, s);
}

/* ---- WorkerLink (client side) -------------------------------------------------------------- */

/* The backend in use, as the wire names it. pie.v1.Backend has no null: the benchmark-only null
 * backend reports cpu. Valid once the worker is ready. */
static Pie__V1__Backend backend_pb(const wrk_node *w) {
    return w->ready.backend.name && strcmp(w->ready.backend.name, "cuda") == 0
               ? PIE__V1__BACKEND__BACKEND_CUDA
               : PIE__V1__BACKEND__BACKEND_CPU;
}

/* The registration carries the model's tokenizer.json so that lifecycle replicas can fetch it
 * from the controller (controller.proto, WorkerRegistration.tokenizer_json) — unless the file
 * would push the message over max_message_bytes: then it is left out, and replicas need the
 * file on their tokenizer.path. */
static void attach_tokenizer(wrk_node *w, Pie__V1__WorkerUp *up) {
    const wrk_desc *d = w->ready.desc;
    if (d->tokenizer_json == NULL || d->tokenizer_json_bytes == 0) return;
    uint64_t max = w->cfg.max_message_bytes;
    size_t rest = protobuf_c_message_get_packed_size(&up->base);
    const size_t framing = 16; /* the field's tag and length, with room to spare */
    if (max != 0 && rest + framing + d->tokenizer_json_bytes > max) {
        pie_log_warn("wrk.link.tokenizer_not_sent",
                     "bytes=%zu max_message=%llu: lifecycle replicas need tokenizer.json on "
                     "their tokenizer.path",
                     d->tokenizer_json_bytes, (unsigned long long)max);
        return;
    }
    up->registration->tokenizer_json.data = (uint8_t *)d->tokenizer_json;
    up->registration->tokenizer_json.len = d->tokenizer_json_bytes;
}

static void link_on_connect(rpc_link *link, void *user) {
    wrk_node *w = user;
    wrk_desc_pb pb;
    wrk_desc_to_pb(w->ready.desc, &pb);
    Pie__V1__WorkerRegistration reg = PIE__V1__WORKER_REGISTRATION__INIT;
    reg.group_id = (char *)atomic_load(&w->group_id);
    reg.version = "pie-c/" PIE_VERSION;
    reg.model = &pb.model;
    reg.backend = backend_pb(w);
    reg.memory_policy = wrk_memrt_policy_pb(w->ready.mem);
    wrk_memrt_capacity(w->ready.mem, &pb.capacity);
    reg.capacity = &pb.capacity;
    reg.tp_size = w->cfg.tp_size;
    reg.device = w->device;
    reg.address = (char *)w->cfg.advertise;
    reg.n_ranks = w->n_ranks;
    reg.ranks = w->rank_ptrs;
    reg.may_defer = w->ready.may_defer;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.registration = &reg;
    attach_tokenizer(w, &up);
    pie_status st;
    pthread_mutex_lock(&w->send_mu);
    bool closing = atomic_load(&w->closing);
    if (!closing) {
        w->cur_link = link;
        atomic_store(&w->warned_credit, false);
    }
    pie_code rc = closing ? PIE_OK : rpc_link_send(link, &up.base, &st);
    pthread_mutex_unlock(&w->send_mu);
    if (rc != PIE_OK) pie_log_warn("wrk.link.register_failed", "error=\"%s\"", st.msg);
}

/* The controller accepted us: grant the configured credits (with a first stats report). */
static void on_registered(wrk_node *w, const Pie__V1__WorkerRegistered *r) {
    Pie__V1__WorkerStats stats;
    stats_of(w, &stats);
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.credits = w->cfg.credits;
    up.stats = &stats;
    up.draining = atomic_load(&w->draining); /* a new controller must not place on us either */
    pie_status st;
    /* before this link's first step: it arrives after this message on the same thread */
    wrk_exec_set_defer(w->exec, r->defer_ok);
    pthread_mutex_lock(&w->send_mu);
    w->worker_index = r->worker_index;
    atomic_store(&w->linked_index, r->worker_index);
    atomic_store(&w->heartbeat_ms, r->heartbeat_ms ? r->heartbeat_ms : WRK_DEFAULT_HEARTBEAT_MS);
    atomic_store(&w->credits, (int)w->cfg.credits);
    pie_code rc = w->cur_link ? rpc_link_send(w->cur_link, &up.base, &st) : PIE_UNAVAILABLE;
    pthread_mutex_unlock(&w->send_mu);
    if (rc != PIE_OK) pie_log_debug("wrk.link.credits_not_sent", "code=%s", pie_code_name(rc));
    pthread_mutex_lock(&w->beat_mu);
    w->beat_kick = true; /* restart the heartbeat timer with the new interval */
    pthread_cond_signal(&w->beat_cv);
    pthread_mutex_unlock(&w->beat_mu);
    pie_gauge_set(w->g_linked, 1);
    pie_log_info("wrk.link.registered",
                 "worker_index=%u deferral=%s controller_version=%s heartbeat_ms=%u",
                 r->worker_index, wrk_exec_defers(w->exec) ? "on" : "off", r->version,
                 atomic_load(&w->heartbeat_ms));
}

static bool link_on_message(rpc_link *link, ProtobufCMessage *msg, void *user) {
    (void)link;
    wrk_node *w = user;
    Pie__V1__WorkerDown *down = (Pie__V1__WorkerDown *)msg;
    if (atomic_load(&w->closing)) return false;
    if (down->registered) on_registered(w, down->registered);
    if (down->n_batches == 0 && down->drain == NULL) return false;
    /* No lock here: the link thread must not wait behind a send blocked on flow control. (When
     * the executor is idle, wrk_exec_submit runs the step on this thread and sends its results
     * before returning.) */
    uint64_t epoch = atomic_load(&w->epoch);
    bool no_credit = down->n_batches > 0 && atomic_fetch_sub(&w->credits, 1) <= 0;
    if (no_credit) {
        if (!atomic_exchange(&w->warned_credit, true))
            pie_log_warn("wrk.link.no_credit",
                         "the controller sent a step (first batch %llu) without a credit; it "
                         "runs anyway, after the steps before it",
                         (unsigned long long)down->batches[0]->batch_id);
    }
    if (down->drain)
        pie_log_info("wrk.link.drain", "shutdown=%d reason=\"%s\" after_batches=%zu",
                     down->drain->shutdown, down->drain->reason, down->n_batches);
    wrk_exec_submit(w->exec, down, epoch);
    return true;
}

static void link_on_disconnect(rpc_link *link, const pie_status *st, void *user) {
    (void)link;
    wrk_node *w = user;
    pthread_mutex_lock(&w->send_mu);
    uint32_t was = w->worker_index;
    atomic_fetch_add(&w->epoch, 1);
    w->worker_index = 0;
    w->cur_link = NULL;
    atomic_store(&w->linked_index, 0);
    pthread_mutex_unlock(&w->send_mu);
    wrk_exec_reset(w->exec); /* queued steps dropped; every slot free for the next link */
    wrk_exec_set_defer(w->exec, false); /* the next controller decides again */
    pie_gauge_set(w->g_linked, 0);
    if (atomic_load(&w->draining)) drain_finish(w); /* nothing is placed on us any more */
    if (was)
        pie_log_warn("wrk.link.lost", "worker_index=%u code=%s error=\"%s\"", was,
                     pie_code_name(st->code), st->msg);
    else
        pie_log_debug("wrk.link.retry", "code=%s error=\"%s\"", pie_code_name(st->code), st->msg);
}

/* Bytes one BatchResult adds to a WorkerUp: tag, length, body. */
static size_t result_wire_bytes(const Pie__V1__BatchResult *r) {
    size_t n = protobuf_c_message_get_packed_size(&r->base), len = 1;
    for (size_t v = n; v >= 0x80; v >>= 7) len++;
    return 1 + len + n;
}

/* Sends a step's results: in one WorkerUp when it fits in max_message_bytes (the usual case),
 * else in as few as fit, split at batch boundaries, the credit with the last. A result too
 * large alone is replaced by its failure (RESOURCE_EXHAUSTED). Caller holds send_mu. */
static pie_code send_results(wrk_node *w, const Pie__V1__WorkerUp *up, pie_status *st) {
    uint64_t max = w->cfg.max_message_bytes;
    if (max == 0 || protobuf_c_message_get_packed_size(&up->base) <= max)
        return rpc_link_send(w->cur_link, &up->base, st);
    const size_t reserve = 16; /* the credits field, with room to spare */
    size_t i = 0;
    while (i < up->n_results) {
        size_t j = i, bytes = reserve;
        while (j < up->n_results && bytes + result_wire_bytes(up->results[j]) <= max)
            bytes += result_wire_bytes(up->results[j++]);
        Pie__V1__BatchResult failed, *one = &failed;
        Pie__V1__WorkerUp part = PIE__V1__WORKER_UP__INIT;
        char msg[200];
        if (j == i) { /* results[i] alone is too large */
            const Pie__V1__BatchResult *r = up->results[i];
            pie__v1__batch_result__init(&failed);
            failed.batch_id = r->batch_id;
            failed.code = PIE_RESOURCE_EXHAUSTED;
            snprintf(msg, sizeof msg,
                     "batch %llu: its results take %zu bytes, more than server.max_message %llu",
                     (unsigned long long)r->batch_id, protobuf_c_message_get_packed_size(&r->base),
                     (unsigned long long)max);
            failed.message = msg;
            failed.exec_us = r->exec_us;
            part.n_results = 1;
            part.results = &one;
            j = i + 1;
        } else {
            part.n_results = j - i;
            part.results = up->results + i;
        }
        part.credits = j == up->n_results ? up->credits : 0;
        pie_code rc = rpc_link_send(w->cur_link, &part.base, st);
        if (rc != PIE_OK) return rc;
        i = j;
    }
    return PIE_OK;
}

/* Executor: one step's results, sent only on the stream the step came from. */
static void exec_emit(void *user, uint64_t epoch, const Pie__V1__WorkerUp *up) {
    wrk_node *w = user;
    pie_status st;
    pie_code rc = PIE_UNAVAILABLE;
    pthread_mutex_lock(&w->send_mu);
    bool current = epoch == atomic_load(&w->epoch) && w->cur_link != NULL;
    if (current) {
        /* Count the credit back before it leaves: the next step may arrive (on the link
         * thread) before rpc_link_send returns here. */
        atomic_fetch_add(&w->credits, (int)up->credits);
        rc = send_results(w, up, &st);
        if (rc != PIE_OK) atomic_fetch_sub(&w->credits, (int)up->credits);
    }
    pthread_mutex_unlock(&w->send_mu);
    if (!current)
        pie_log_debug("wrk.link.results_dropped",
                      "results=%zu reason=\"the link they came on "
                      "was lost\"",
                      up->n_results);
    else if (rc != PIE_OK)
        pie_log_debug("wrk.link.results_not_sent", "results=%zu error=\"%s\"", up->n_results,
                      st.msg);
}

/* Executor: a Drain, after the batches before it. With shutdown the process stops as if by
 * SIGTERM (svc_wait_for_signal in main takes it), leaving the cluster cleanly; while draining
 * (wrk_node_drain) it ends the wait instead: the controller placed nothing new on us and the
 * last instance placed on us has ended. */
static void exec_drain(void *user, uint64_t epoch, const Pie__V1__Drain *d) {
    wrk_node *w = user;
    pthread_mutex_lock(&w->send_mu);
    bool current = epoch == atomic_load(&w->epoch);
    pthread_mutex_unlock(&w->send_mu);
    if (!current || !d->shutdown) return;
    pie_log_info("wrk.drain.shutdown", "reason=\"%s\"", d->reason);
    bool was_draining = atomic_exchange(&w->draining, true);
    drain_finish(w); /* main's drain, now or after the signal below, need not wait */
    if (was_draining) return;
    if (kill(getpid(), SIGTERM) != 0)
        pie_log_error("wrk.drain.shutdown", "kill: %s", strerror(errno));
}

/* Expansion moved the effective KV capacity (wrk_memrt, on the step thread): tell the
 * controller now; a later registration carries it too. */
static void send_capacity(void *user, uint32_t kv_pages_effective) {
    wrk_node *w = user;
    Pie__V1__CapacityChange cc = PIE__V1__CAPACITY_CHANGE__INIT;
    cc.kv_pages_effective = kv_pages_effective;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.capacity = &cc;
    pthread_mutex_lock(&w->send_mu);
    if (w->worker_index != 0 && w->cur_link != NULL)
        (void)rpc_link_send(w->cur_link, &up.base, NULL);
    pthread_mutex_unlock(&w->send_mu);
}

/* ---- heartbeat ------------------------------------------------------------------------------ */

static void send_stats(wrk_node *w) {
    Pie__V1__WorkerStats stats;
    stats_of(w, &stats);
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.stats = &stats;
    pthread_mutex_lock(&w->send_mu);
    if (w->worker_index != 0 && w->cur_link != NULL)
        (void)rpc_link_send(w->cur_link, &up.base, NULL);
    pthread_mutex_unlock(&w->send_mu);
}

static void *beat_main(void *arg) {
    wrk_node *w = arg;
    (void)pthread_setname_np(pthread_self(), "wrk-beat"); /* cosmetic */
    pthread_mutex_lock(&w->beat_mu);
    int64_t next = rpc_now_ns() + (int64_t)atomic_load(&w->heartbeat_ms) * 1000000;
    while (!w->beat_stop) {
        struct timespec ts = {.tv_sec = next / 1000000000, .tv_nsec = next % 1000000000};
        (void)pthread_cond_timedwait(&w->beat_cv, &w->beat_mu, &ts);
        if (w->beat_stop) break;
        int64_t now = rpc_now_ns(), period = (int64_t)atomic_load(&w->heartbeat_ms) * 1000000;
        if (w->beat_kick) {
            w->beat_kick = false;
            next = now + period;
            continue;
        }
        if (now < next) continue;
        pthread_mutex_unlock(&w->beat_mu);
        send_stats(w);
        pthread_mutex_lock(&w->beat_mu);
        next = now + period;
    }
    pthread_mutex_unlock(&w->beat_mu);
    return NULL;
}

/* ---- pie.v1.Worker (server side) ----------------------------------------------------------- */

static bool info_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    wrk_node *w = user;
    int state = atomic_load(&w->state);
    wrk_desc_pb pb;
    Pie__V1__InfoResponse resp = PIE__V1__INFO_RESPONSE__INIT;
    Pie__V1__Status status = PIE__V1__STATUS__INIT;
    resp.rank = 0;
    resp.tp_size = w->cfg.tp_size;
    resp.group_id = (char *)atomic_load(&w->group_id);
    resp.version = "pie-c/" PIE_VERSION;
    resp.backend = state == PIE__V1__LOAD_STATE__LOAD_STATE_READY ? backend_pb(w)
                                                                  : PIE__V1__BACKEND__BACKEND_CPU;
    resp.memory_policy = state == PIE__V1__LOAD_STATE__LOAD_STATE_READY
                             ? wrk_memrt_policy_pb(w->ready.mem)
                             : PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU;
    resp.state = state;
    resp.status = &status;
    if (state == PIE__V1__LOAD_STATE__LOAD_STATE_READY) {
        wrk_desc_to_pb(w->ready.desc, &pb);
        resp.model = &pb.model;
        wrk_memrt_capacity(w->ready.mem, &pb.capacity);
        resp.capacity = &pb.capacity;
        resp.device = w->device;
        resp.device_pool_bytes = w->ready.device_pool_bytes;
        resp.host_pool_bytes = w->ready.host_pool_bytes;
        resp.n_ranks = w->n_ranks;
        resp.ranks = w->rank_ptrs;
    } else if (state == PIE__V1__LOAD_STATE__LOAD_STATE_FAILED) {
        status.code = (uint32_t)w->failed.code;
        status.message = w->failed.msg;
    }
    resp.controller_linked = atomic_load(&w->linked_index) != 0;
    if (state == PIE__V1__LOAD_STATE__LOAD_STATE_READY) {
        resp.may_defer = w->ready.may_defer;
        resp.controller_deferral = resp.controller_linked && wrk_exec_defers(w->exec);
    }
    rpc_call_reply(call, &resp.base);
    return false;
}

/* TpJoin without an offer: this worker forms no group from separate processes. */
static bool tpjoin_refuse(rpc_call *call, wrk_node *w, const Pie__V1__TpJoinRequest *r) {
    char msg[400];
    if (w->cfg.tp_size <= 1)
        snprintf(msg, sizeof msg,
                 "TpJoin: rank %u asked to join, but this worker group has tp_size 1", r->rank);
    else
        snprintf(msg, sizeof msg,
                 "TpJoin: rank %u asked to join, but worker group %s forms its %u ranks itself "
                 "(one pie-worker with tp.size %u forks them), or has formed already",
                 r->rank, atomic_load(&w->group_id), w->cfg.tp_size, w->cfg.tp_size);
    rpc_call_finish(call, PIE_FAILED_PRECONDITION, msg);
    return false;
}

static bool tpjoin_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    wrk_node *w = user;
    const Pie__V1__TpJoinRequest *r = (const Pie__V1__TpJoinRequest *)req;
    pthread_mutex_lock(&w->tp_mu);
    if (!w->has_tp_offer) {
        pthread_mutex_unlock(&w->tp_mu);
        return tpjoin_refuse(call, w, r);
    }
    pie_status st;
    pie_code rc = wrk_tp_offer_admit(&w->tp_offer, r, &st);
    Pie__V1__TpJoinResponse resp = PIE__V1__TP_JOIN_RESPONSE__INIT;
    char endpoint[300], host[256] = "";
    resp.tp_size = w->tp_offer.tp_size;
    resp.epoch = w->tp_offer.epoch;
    resp.collective = PIE__V1__COLLECTIVE__COLLECTIVE_HOST;
    uint8_t nccl_id[sizeof w->tp_offer.nccl_id]; /* a cuda group's, copied under the lock */
    if (w->tp_offer.has_nccl_id) {
        memcpy(nccl_id, w->tp_offer.nccl_id, sizeof nccl_id);
        wrk_tp_cuda_answer(&resp, nccl_id);
    }
    uint16_t port = w->tp_offer.port;
    pthread_mutex_unlock(&w->tp_mu);
    if (rc != PIE_OK) {
        pie_log_warn("wrk.tp.join_refused", "rank=%u code=%s error=\"%s\"", r->rank,
                     pie_code_name(rc), st.msg);
        rpc_call_finish(call, rc, st.msg);
        return false;
    }
    /* the rank connects to the host it reached us on; this one is for humans and logs */
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "rank0");
    snprintf(endpoint, sizeof endpoint, "%s:%u", host, port);
    resp.host_endpoint = endpoint;
    pie_log_info("wrk.tp.rank_joined", "rank=%u device=\"%s\" epoch=%016llx", r->rank,
                 r->device ? r->device : "", (unsigned long long)resp.epoch);
    rpc_call_reply(call, &resp.base);
    return false;
}

void wrk_node_set_tp_offer(wrk_node *w, const wrk_tp_offer *offer) {
    pthread_mutex_lock(&w->tp_mu);
    if (offer) w->tp_offer = *offer;
    w->has_tp_offer = offer != NULL;
    pthread_mutex_unlock(&w->tp_mu);
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

wrk_node *wrk_node_create(const wrk_node_config *cfg, pie_metrics *metrics, pie_status *st) {
    wrk_node *w = calloc(1, sizeof *w);
    if (w == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    w->cfg = *cfg;
    if (w->cfg.credits == 0) w->cfg.credits = 1;
    if (w->cfg.tp_size == 0) w->cfg.tp_size = 1;
    w->metrics = metrics;
    atomic_store(&w->group_id, cfg->group_id ? cfg->group_id : "");
    atomic_store(&w->state, PIE__V1__LOAD_STATE__LOAD_STATE_LOADING);
    atomic_store(&w->heartbeat_ms, WRK_DEFAULT_HEARTBEAT_MS);
    if (pthread_mutex_init(&w->send_mu, NULL) != 0) {
        free(w);
        pie_status_set(st, PIE_INTERNAL, "pthread_mutex_init failed");
        return NULL;
    }
    if (pthread_mutex_init(&w->beat_mu, NULL) != 0) {
        pthread_mutex_destroy(&w->send_mu);
        free(w);
        pie_status_set(st, PIE_INTERNAL, "pthread_mutex_init failed");
        return NULL;
    }
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc == 0) {
        rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* rpc_now_ns's clock */
        if (rc == 0) rc = pthread_cond_init(&w->beat_cv, &ca);
        if (rc == 0 && (rc = pthread_cond_init(&w->drain_cv, &ca)) != 0)
            pthread_cond_destroy(&w->beat_cv);
        pthread_condattr_destroy(&ca);
    }
    if (rc != 0) {
        pthread_mutex_destroy(&w->beat_mu);
        pthread_mutex_destroy(&w->send_mu);
        free(w);
        pie_status_set(st, PIE_INTERNAL, "pthread_cond_init failed");
        return NULL;
    }
    if (pthread_mutex_init(&w->tp_mu, NULL) != 0) {
        pthread_cond_destroy(&w->drain_cv);
        pthread_cond_destroy(&w->beat_cv);
        pthread_mutex_destroy(&w->beat_mu);
        pthread_mutex_destroy(&w->send_mu);
        free(w);
        pie_status_set(st, PIE_INTERNAL, "pthread_mutex_init failed");
        return NULL;
    }
    w->g_linked = pie_metrics_gauge(metrics, "pie_worker_controller_linked",
                                    "1 while registered with the controller.", NULL, 0, st);
    w->methods[0] = (rpc_method){
        .path = "/pie.v1.Worker/Info",
        .kind = RPC_UNARY,
        .request = &pie__v1__info_request__descriptor,
        .response = &pie__v1__info_response__descriptor,
        .on_call = info_on_call,
        .user = w,
    };
    w->methods[1] = (rpc_method){
        .path = "/pie.v1.Worker/TpJoin",
        .kind = RPC_UNARY,
        .request = &pie__v1__tp_join_request__descriptor,
        .response = &pie__v1__tp_join_response__descriptor,
        .on_call = tpjoin_on_call,
        .user = w,
    };
    return w;
}

const rpc_method *wrk_node_methods(wrk_node *w, size_t *n) {
    *n = sizeof w->methods / sizeof w->methods[0];
    return w->methods;
}

void wrk_node_set_failed(wrk_node *w, const pie_status *why) {
    w->failed = *why;
    atomic_store(&w->state, PIE__V1__LOAD_STATE__LOAD_STATE_FAILED);
}

/* Copies a group's rank reports and builds their messages (registration, Info). */
static pie_code node_set_ranks(wrk_node *w, const wrk_tp_rank_info *ranks, uint32_t n,
                               pie_status *st) {
    if (n == 0) return PIE_OK;
    w->rank_info = malloc(n * sizeof *w->rank_info);
    w->rank_pb = calloc(n, sizeof *w->rank_pb);
    w->rank_ptrs = calloc(n, sizeof *w->rank_ptrs);
    if (!w->rank_info || !w->rank_pb || !w->rank_ptrs)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "worker: out of memory");
    memcpy(w->rank_info, ranks, n * sizeof *ranks);
    for (uint32_t i = 0; i < n; i++) {
        pie__v1__tp_rank__init(&w->rank_pb[i]);
        w->rank_pb[i].rank = w->rank_info[i].rank;
        w->rank_pb[i].device = w->rank_info[i].device;
        w->rank_pb[i].host = w->rank_info[i].host;
        w->rank_pb[i].pid = w->rank_info[i].pid;
        w->rank_ptrs[i] = &w->rank_pb[i];
    }
    w->n_ranks = n;
    return PIE_OK;
}

pie_code wrk_node_set_ready(wrk_node *w, const wrk_node_ready *r, pie_status *st) {
    const wrk_desc *d = r->desc;
    if (node_set_ranks(w, r->ranks, r->n_ranks, st) != PIE_OK) return st->code;
    wrk_exec_opts eo = {
        .backend = r->backend,
        .group = r->group,
        .lim = wrk_desc_exec_limits(d),
        .emit = exec_emit,
        .drain = exec_drain,
        .user = w,
        .metrics = w->metrics,
        .after_forward = wrk_memrt_after_forward,
        .after_slots = wrk_memrt_after_slots,
        .mem_user = r->mem,
        .may_defer = r->may_defer,
    };
    if (r->mem == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "wrk_node_set_ready: no memory policy");
    wrk_memrt_on_capacity(r->mem, send_capacity, w);
    w->exec = wrk_exec_start(&eo, st);
    if (w->exec == NULL) return st->code;
    w->ready = *r;
    snprintf(w->device, sizeof w->device, "%s", r->device ? r->device : "");
    w->ready.device = w->device;
    w->ready.ranks = w->rank_info;
    atomic_store(&w->state, PIE__V1__LOAD_STATE__LOAD_STATE_READY);
    return PIE_OK;
}

pie_code wrk_node_link_start(wrk_node *w, const svc *s, const svc_dial_config *dial,
                             pie_status *st) {
    if (w->exec == NULL)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "wrk_node_link_start: the model is not loaded");
    int grpc_port = svc_port(s);
    if (atomic_load(&w->group_id)[0] == '\0') {
        char host[256] = "worker";
        if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "worker");
        snprintf(w->default_group, sizeof w->default_group, "%s:%d", host, grpc_port);
        atomic_store(&w->group_id, w->default_group);
    }
    int rc = pthread_create(&w->beat_th, NULL, beat_main, w);
    if (rc != 0)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "heartbeat: pthread_create: %s",
                              strerror(rc));
    w->beat_started = true;
    rpc_link_opts lo = {
        .path = "/pie.v1.Controller/WorkerLink",
        .response = &pie__v1__worker_down__descriptor,
        .on_connect = link_on_connect,
        .on_message = link_on_message,
        .on_disconnect = link_on_disconnect,
        .user = w,
    };
    if (svc_dial_controller(s, dial, &lo, &w->ch, &w->link, st) != PIE_OK) return st->code;
    return PIE_OK;
}

bool wrk_node_drain(wrk_node *w, int64_t grace_ms) {
    atomic_store(&w->draining, true);
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.draining = true;
    pthread_mutex_lock(&w->send_mu);
    bool linked = w->worker_index != 0 && w->cur_link != NULL;
    if (linked) linked = rpc_link_send(w->cur_link, &up.base, NULL) == PIE_OK;
    pthread_mutex_unlock(&w->send_mu);
    if (!linked) return true; /* no controller places anything on us */
    pie_log_info("wrk.draining", "grace_ms=%lld", (long long)grace_ms);
    int64_t until = rpc_now_ns() + grace_ms * 1000000;
    pthread_mutex_lock(&w->beat_mu);
    while (!w->drain_done && rpc_now_ns() < until) {
        struct timespec ts = {.tv_sec = until / 1000000000, .tv_nsec = until % 1000000000};
        (void)pthread_cond_timedwait(&w->drain_cv, &w->beat_mu, &ts);
    }
    bool done = w->drain_done;
    pthread_mutex_unlock(&w->beat_mu);
    return done;
}

void wrk_node_destroy(wrk_node *w) {
    if (w == NULL) return;
    pthread_mutex_lock(&w->send_mu);
    atomic_store(&w->closing, true);
    w->cur_link = NULL; /* the executor and the heartbeat send nothing from now on */
    atomic_fetch_add(&w->epoch, 1);
    pthread_mutex_unlock(&w->send_mu);
    rpc_link_stop(w->link); /* no link callback runs after this */
    rpc_channel_destroy(w->ch);
    if (w->beat_started) {
        pthread_mutex_lock(&w->beat_mu);
        w->beat_stop = true;
        pthread_cond_signal(&w->beat_cv);
        pthread_mutex_unlock(&w->beat_mu);
        int rc = pthread_join(w->beat_th, NULL);
        if (rc != 0) pie_log_error("wrk.beat.stop", "pthread_join: %s", strerror(rc));
    }
    wrk_exec_stop(w->exec); /* after the link: nothing submits any more */
    pthread_cond_destroy(&w->drain_cv);
    pthread_cond_destroy(&w->beat_cv);
    pthread_mutex_destroy(&w->beat_mu);
    pthread_mutex_destroy(&w->send_mu);
    pthread_mutex_destroy(&w->tp_mu);
    free(w->rank_info);
    free(w->rank_pb);
    free(w->rank_ptrs);
    free(w);
}
