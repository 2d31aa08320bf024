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
#include "svc.h"

#define CTL_MAX_LINKS 65535 /* worker_index and replica_index are 16-bit, 0 unused */

typedef enum ctl_link_kind { CTL_LINK_WORKER, CTL_LINK_REPLICA } ctl_link_kind;

/* One connected worker group or lifecycle replica: the per-call data of its stream. */
typedef struct ctl_link {
    ctl_link_kind kind;
    uint32_t index;              /* worker_index / replica_index; 0 until registered */
    rpc_call *call;              /* referenced while in the table */
    uint64_t connected_unix_ms;
    Pie__V1__WorkerUp *reg;      /* worker: the kept message holding its registration */
    Pie__V1__WorkerUp *stats;    /* worker: the kept message holding its latest stats */
    Pie__V1__SessionHello *hello; /* replica: copy of its hello (kept SessionUp) */
    Pie__V1__SessionUp *hello_msg;
    uint64_t calls;              /* replica: API calls received */
    uint32_t instances;          /* replica: begins minus ends */
    struct ctl_link *next;
} ctl_link;

struct ctl_cluster {
    pthread_mutex_t mu;          /* guards everything below */
    ctl_link *links;             /* registered workers and replicas */
    uint64_t started_unix_ms;
    rpc_method methods[3];
    pie_gauge *g_workers, *g_replicas;
    pie_counter *c_calls;
};

static uint64_t unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Smallest index 1..65535 not used by a link of this kind; 0 when all are taken. */
static uint32_t free_index(ctl_cluster *c, ctl_link_kind kind) {
    for (uint32_t i = 1; i <= CTL_MAX_LINKS; i++) {
        bool used = false;
        for (ctl_link *l = c->links; l && !used; l = l->next) used = l->kind == kind && l->index == i;
        if (!used) return i;
    }
    return 0;
}

static size_t count_links(const ctl_cluster *c, ctl_link_kind kind) {
    size_t n = 0;
    for (const ctl_link *l = c->links; l; l = l->next) n += l->kind == kind;
    return n;
}

static void update_gauges(ctl_cluster *c) {
    pie_gauge_set(c->g_workers, (double)count_links(c, CTL_LINK_WORKER));
    pie_gauge_set(c->g_replicas, (double)count_links(c, CTL_LINK_REPLICA));
}

static int cmp_model_name(const void *a, const void *b) {
    const Pie__V1__ModelInfo *x = *(Pie__V1__ModelInfo *const *)a;
    const Pie__V1__ModelInfo *y = *(Pie__V1__ModelInfo *const *)b;
    return strcmp(x->name, y->name);
}

/* Distinct models served by registered workers, ordered by name (borrowed pointers; caller
 * holds mu and frees the array). */
static Pie__V1__ModelInfo **served_models(ctl_cluster *c, size_t *n) {
    size_t cap = count_links(c, CTL_LINK_WORKER), k = 0;
    Pie__V1__ModelInfo **out = calloc(cap ? cap : 1, sizeof *out);
    if (out == NULL) {
        *n = 0;
        return NULL;
    }
    for (ctl_link *l = c->links; l; l = l->next) {
        if (l->kind != CTL_LINK_WORKER) continue;
        Pie__V1__ModelInfo *m = l->reg->registration->model;
        bool dup = false;
        for (size_t i = 0; i < k && !dup; i++) dup = strcmp(out[i]->name, m->name) == 0;
        if (!dup) out[k++] = m;
    }
    qsort(out, k, sizeof *out, cmp_model_name);
    *n = k;
    return out;
}

/* Sends SessionDown{events: [extra?, models_changed]} to one replica or (to == NULL) all. */
static void announce_models(ctl_cluster *c, ctl_link *to, Pie__V1__SessionEvent *extra) {
    size_t n;
    Pie__V1__ModelInfo **models = served_models(c, &n);
    Pie__V1__ModelsChanged mc = PIE__V1__MODELS_CHANGED__INIT;
    mc.n_models = n;
    mc.models = models;
    Pie__V1__SessionEvent ev = PIE__V1__SESSION_EVENT__INIT;
    ev.event_case = PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED;
    ev.models_changed = &mc;
    Pie__V1__SessionEvent *events[2];
    size_t n_events = 0;
    if (extra) events[n_events++] = extra;
    events[n_events++] = &ev;
    Pie__V1__SessionDown down = PIE__V1__SESSION_DOWN__INIT;
    down.n_events = n_events;
    down.events = events;
    for (ctl_link *l = c->links; l; l = l->next) {
        if (l->kind != CTL_LINK_REPLICA || (to && l != to)) continue;
        pie_code rc = rpc_call_send(l->call, &down.base);
        if (rc != PIE_OK && rc != PIE_CANCELLED)
            pie_log_warn("ctl.session.send_failed", "replica_index=%u code=%s", l->index,
                         pie_code_name(rc));
    }
    free(models);
}

static void unlink_entry(ctl_cluster *c, ctl_link *link) {
    for (ctl_link **p = &c->links; *p; p = &(*p)->next) {
        if (*p == link) {
            *p = link->next;
            return;
        }
    }
}

static void link_free(ctl_link *l) {
    if (l == NULL) return;
    rpc_msg_free(l->reg ? &l->reg->base : NULL);
    rpc_msg_free(l->stats ? &l->stats->base : NULL);
    rpc_msg_free(l->hello_msg ? &l->hello_msg->base : NULL);
    free(l);
}

/* ---- WorkerLink ---------------------------------------------------------------------------- */

static bool worker_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    (void)user;
    ctl_link *l = calloc(1, sizeof *l);
    if (l == NULL) {
        rpc_call_cancel(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return false;
    }
    l->kind = CTL_LINK_WORKER;
    l->call = call;
    rpc_call_set_data(call, l);
    return false;
}

static pie_code check_registration(const Pie__V1__WorkerRegistration *r, pie_status *st) {
    if (r->model == NULL || r->model->name[0] == '\0')
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "registration: model.name is empty");
    if (r->model->kv_page_size == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "registration: model.kv_page_size is 0");
    if (r->capacity == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "registration: capacity is missing");
    if (r->capacity->kv_pages_effective > r->capacity->kv_pages_max)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "registration: capacity.kv_pages_effective %u exceeds kv_pages_max %u",
                              r->capacity->kv_pages_effective, r->capacity->kv_pages_max);
    if (r->tp_size == 0) return pie_status_set(st, PIE_INVALID_ARGUMENT, "registration: tp_size is 0");
    return PIE_OK;
}

static void worker_register(ctl_cluster *c, ctl_link *l, Pie__V1__WorkerUp *up) {
    pie_status st;
    if (check_registration(up->registration, &st) != PIE_OK) {
        rpc_call_cancel(l->call, st.code, st.msg);
        rpc_msg_free(&up->base);
        return;
    }
    pthread_mutex_lock(&c->mu);
    uint32_t index = free_index(c, CTL_LINK_WORKER);
    if (index == 0) {
        pthread_mutex_unlock(&c->mu);
        rpc_call_cancel(l->call, PIE_RESOURCE_EXHAUSTED, "controller: 65535 worker groups linked");
        rpc_msg_free(&up->base);
        return;
    }
    l->index = index;
    l->reg = up;
    l->connected_unix_ms = unix_ms();
    rpc_call_ref(l->call);
    l->next = c->links;
    c->links = l;
    Pie__V1__WorkerRegistered reg = PIE__V1__WORKER_REGISTERED__INIT;
    reg.worker_index = index;
    reg.version = "pie-c/" PIE_VERSION;
    reg.heartbeat_ms = 1000;
    Pie__V1__WorkerDown down = PIE__V1__WORKER_DOWN__INIT;
    down.registered = &reg;
    rpc_call_send(l->call, &down.base);
    announce_models(c, NULL, NULL);
    update_gauges(c);
    pthread_mutex_unlock(&c->mu);
    pie_log_info("ctl.worker.registered", "worker_index=%u group=%s model=%s kv_pages=%u",
                 index, up->registration->group_id, up->registration->model->name,
                 up->registration->capacity->kv_pages_effective);
}

static bool worker_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    ctl_cluster *c = user;
    ctl_link *l = rpc_call_get_data(call);
    Pie__V1__WorkerUp *up = (Pie__V1__WorkerUp *)msg;
    if (l->index == 0) {
        if (up->registration == NULL) {
            rpc_call_cancel(call, PIE_FAILED_PRECONDITION,
                            "WorkerLink: the first WorkerUp must carry a registration");
            return false;
        }
        worker_register(c, l, up);
        return true;
    }
    if (up->registration) {
        rpc_call_cancel(call, PIE_FAILED_PRECONDITION, "WorkerLink: registration sent twice");
        return false;
    }
    if (up->stats) {
        pthread_mutex_lock(&c->mu);
        rpc_msg_free(l->stats ? &l->stats->base : NULL);
        l->stats = up;
        pthread_mutex_unlock(&c->mu);
        return true;
    }
    return false;
}

static void link_on_half_close(rpc_call *call, void *user) {
    (void)user;
    rpc_call_finish(call, PIE_OK, NULL);
}

static void worker_on_done(rpc_call *call, void *user) {
    ctl_cluster *c = user;
    ctl_link *l = rpc_call_get_data(call);
    if (l == NULL) return;
    if (l->index != 0) {
        pthread_mutex_lock(&c->mu);
        unlink_entry(c, l);
        Pie__V1__Status status = PIE__V1__STATUS__INIT;
        status.code = PIE_UNAVAILABLE;
        status.message = "worker link ended";
        Pie__V1__WorkerLost lost = PIE__V1__WORKER_LOST__INIT;
        lost.worker_index = l->index;
        lost.group_id = l->reg->registration->group_id;
        lost.model = l->reg->registration->model->name;
        lost.status = &status;
        Pie__V1__SessionEvent ev = PIE__V1__SESSION_EVENT__INIT;
        ev.event_case = PIE__V1__SESSION_EVENT__EVENT_WORKER_LOST;
        ev.worker_lost = &lost;
        announce_models(c, NULL, &ev);
        update_gauges(c);
        pthread_mutex_unlock(&c->mu);
        pie_log_warn("ctl.worker.lost", "worker_index=%u group=%s", l->index,
                     l->reg->registration->group_id);
        rpc_call_unref(call);
    }
    link_free(l);
}

/* ---- Session ------------------------------------------------------------------------------- */

static bool session_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    (void)user;
    ctl_link *l = calloc(1, sizeof *l);
    if (l == NULL) {
        rpc_call_cancel(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return false;
    }
    l->kind = CTL_LINK_REPLICA;
    l->call = call;
    rpc_call_set_data(call, l);
    return false;
}

static bool session_hello(ctl_cluster *c, ctl_link *l, Pie__V1__SessionUp *up) {
    pthread_mutex_lock(&c->mu);
    uint32_t index = free_index(c, CTL_LINK_REPLICA);
    if (index == 0) {
        pthread_mutex_unlock(&c->mu);
        rpc_call_cancel(l->call, PIE_RESOURCE_EXHAUSTED, "controller: 65535 replicas linked");
        return false;
    }
    l->index = index;
    l->hello = up->hello;
    l->hello_msg = up;
    l->connected_unix_ms = unix_ms();
    rpc_call_ref(l->call);
    l->next = c->links;
    c->links = l;
    Pie__V1__SessionWelcome w = PIE__V1__SESSION_WELCOME__INIT;
    w.replica_index = index;
    w.version = "pie-c/" PIE_VERSION;
    Pie__V1__SessionDown down = PIE__V1__SESSION_DOWN__INIT;
    down.welcome = &w;
    rpc_call_send(l->call, &down.base);
    announce_models(c, l, NULL);
    update_gauges(c);
    pthread_mutex_unlock(&c->mu);
    pie_log_info("ctl.replica.joined", "replica_index=%u replica_id=%s", index, up->hello->replica_id);
    return true;
}

/* Until the control layer lands, every call fails with UNIMPLEMENTED, one result per call, in
 * one SessionDown: the contract's shape is kept so lifecycle code can be written against it. */
static void session_reject_calls(ctl_cluster *c, ctl_link *l, const Pie__V1__SessionUp *up) {
    if (up->n_calls == 0) return;
    Pie__V1__CallResult *res = calloc(up->n_calls, sizeof *res);
    Pie__V1__CallResult **ptrs = calloc(up->n_calls, sizeof *ptrs);
    if (res == NULL || ptrs == NULL) {
        free(res);
        free(ptrs);
        rpc_call_cancel(l->call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        return;
    }
    for (size_t i = 0; i < up->n_calls; i++) {
        pie__v1__call_result__init(&res[i]);
        res[i].instance_id = up->calls[i]->instance_id;
        res[i].call_id = up->calls[i]->call_id;
        res[i].code = PIE_UNIMPLEMENTED;
        res[i].message = "controller: API calls are not implemented in this version";
        ptrs[i] = &res[i];
    }
    Pie__V1__SessionDown down = PIE__V1__SESSION_DOWN__INIT;
    down.n_results = up->n_calls;
    down.results = ptrs;
    rpc_call_send(l->call, &down.base);
    pie_counter_add(c->c_calls, up->n_calls);
    free(res);
    free(ptrs);
}

static bool session_on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    ctl_cluster *c = user;
    ctl_link *l = rpc_call_get_data(call);
    Pie__V1__SessionUp *up = (Pie__V1__SessionUp *)msg;
    bool kept = false;
    if (l->index == 0) {
        if (up->hello == NULL) {
            rpc_call_cancel(call, PIE_FAILED_PRECONDITION,
                            "Session: the first SessionUp must carry a hello");
            return false;
        }
        if (!session_hello(c, l, up)) return false;
        kept = true;
    } else if (up->hello) {
        rpc_call_cancel(call, PIE_FAILED_PRECONDITION, "Session: hello sent twice");
        return false;
    }
    pthread_mutex_lock(&c->mu);
    l->instances += (uint32_t)up->n_begins;
    l->instances -= up->n_ends > l->instances ? l->instances : (uint32_t)up->n_ends;
    l->calls += up->n_calls;
    pthread_mutex_unlock(&c->mu);
    session_reject_calls(c, l, up);
    return kept;
}

static void session_on_done(rpc_call *call, void *user) {
    ctl_cluster *c = user;
    ctl_link *l = rpc_call_get_data(call);
    if (l == NULL) return;
    if (l->index != 0) {
        pthread_mutex_lock(&c->mu);
        unlink_entry(c, l);
        update_gauges(c);
        pthread_mutex_unlock(&c->mu);
        pie_log_info("ctl.replica.left", "replica_index=%u", l->index);
        rpc_call_unref(call);
    }
    link_free(l);
}

/* ---- ClusterStatus ------------------------------------------------------------------------- */

static int cmp_worker_index(const void *a, const void *b) {
    uint32_t x = (*(Pie__V1__WorkerStatus *const *)a)->worker_index;
    uint32_t y = (*(Pie__V1__WorkerStatus *const *)b)->worker_index;
    return (x > y) - (x < y);
}

static int cmp_replica_index(const void *a, const void *b) {
    uint32_t x = (*(Pie__V1__ReplicaStatus *const *)a)->replica_index;
    uint32_t y = (*(Pie__V1__ReplicaStatus *const *)b)->replica_index;
    return (x > y) - (x < y);
}

static void fill_worker_status(const ctl_link *l, Pie__V1__WorkerStatus *w) {
    const Pie__V1__WorkerRegistration *r = l->reg->registration;
    w->worker_index = l->index;
    w->group_id = r->group_id;
    w->model = r->model->name;
    w->backend = r->backend;
    w->memory_policy = r->memory_policy;
    w->tp_size = r->tp_size;
    w->device = r->device;
    w->address = r->address;
    w->state = PIE__V1__WORKER_STATE__WORKER_STATE_READY;
    w->connected_unix_ms = l->connected_unix_ms;
    w->capacity = r->capacity;
    w->stats = l->stats ? l->stats->stats : NULL;
}

static void fill_replica_status(const ctl_link *l, Pie__V1__ReplicaStatus *r) {
    r->replica_index = l->index;
    r->replica_id = l->hello->replica_id;
    r->address = l->hello->address;
    r->version = l->hello->version;
    r->connected_unix_ms = l->connected_unix_ms;
    r->instances = l->instances;
    r->calls = l->calls;
}

static bool status_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    ctl_cluster *c = user;
    pthread_mutex_lock(&c->mu);
    size_t nw = count_links(c, CTL_LINK_WORKER), nr = count_links(c, CTL_LINK_REPLICA), nm = 0;
    Pie__V1__ModelInfo **models = served_models(c, &nm);
    Pie__V1__WorkerStatus *ws = calloc(nw + 1, sizeof *ws);
    Pie__V1__WorkerStatus **wp = calloc(nw + 1, sizeof *wp);
    Pie__V1__ReplicaStatus *rs = calloc(nr + 1, sizeof *rs);
    Pie__V1__ReplicaStatus **rp = calloc(nr + 1, sizeof *rp);
    Pie__V1__ModelStatus *ms = calloc(nm + 1, sizeof *ms);
    Pie__V1__ModelStatus **mp = calloc(nm + 1, sizeof *mp);
    if (!models || !ws || !wp || !rs || !rp || !ms || !mp) {
        pthread_mutex_unlock(&c->mu);
        rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "controller: out of memory");
        goto done;
    }
    Pie__V1__ClusterStatusResponse resp = PIE__V1__CLUSTER_STATUS_RESPONSE__INIT;
    resp.version = "pie-c/" PIE_VERSION;
    resp.started_unix_ms = c->started_unix_ms;
    for (size_t i = 0; i < nm; i++) {
        pie__v1__model_status__init(&ms[i]);
        ms[i].info = models[i];
        mp[resp.n_models++] = &ms[i];
    }
    for (const ctl_link *l = c->links; l; l = l->next) {
        if (l->kind == CTL_LINK_WORKER) {
            Pie__V1__WorkerStatus *w = &ws[resp.n_workers];
            pie__v1__worker_status__init(w);
            fill_worker_status(l, w);
            wp[resp.n_workers++] = w;
            for (size_t i = 0; i < nm; i++) {
                if (strcmp(models[i]->name, w->model) != 0) continue;
                ms[i].workers++;
                ms[i].kv_pages_effective += w->capacity->kv_pages_effective;
            }
        } else {
            Pie__V1__ReplicaStatus *r = &rs[resp.n_replicas];
            pie__v1__replica_status__init(r);
            fill_replica_status(l, r);
            rp[resp.n_replicas++] = r;
            resp.instances += l->instances;
        }
    }
    qsort(wp, resp.n_workers, sizeof *wp, cmp_worker_index);
    qsort(rp, resp.n_replicas, sizeof *rp, cmp_replica_index);
    resp.workers = wp;
    resp.replicas = rp;
    resp.models = mp;
    rpc_call_reply(call, &resp.base); /* packs now: safe to release the lock after */
    pthread_mutex_unlock(&c->mu);
done:
    free(models);
    free(ws);
    free(wp);
    free(rs);
    free(rp);
    free(ms);
    free(mp);
    return false;
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

ctl_cluster *ctl_cluster_create(pie_metrics *metrics) {
    ctl_cluster *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    if (pthread_mutex_init(&c->mu, NULL) != 0) {
        free(c);
        return NULL;
    }
    c->started_unix_ms = unix_ms();
    pie_status st;
    c->g_workers = pie_metrics_gauge(metrics, "pie_controller_workers",
                                     "Worker groups registered over WorkerLink.", NULL, 0, &st);
    c->g_replicas = pie_metrics_gauge(metrics, "pie_controller_replicas",
                                      "Lifecycle replicas with an open Session.", NULL, 0, &st);
    c->c_calls = pie_metrics_counter(metrics, "pie_controller_api_calls_total",
                                     "API calls received over Session streams.", NULL, 0, &st);
    c->methods[0] = (rpc_method){
        .path = "/pie.v1.Controller/WorkerLink",
        .kind = RPC_BIDI,
        .request = &pie__v1__worker_up__descriptor,
        .response = &pie__v1__worker_down__descriptor,
        .on_call = worker_on_call,
        .on_message = worker_on_message,
        .on_half_close = link_on_half_close,
        .on_done = worker_on_done,
        .user = c,
    };
    c->methods[1] = (rpc_method){
        .path = "/pie.v1.Controller/Session",
        .kind = RPC_BIDI,
        .request = &pie__v1__session_up__descriptor,
        .response = &pie__v1__session_down__descriptor,
        .on_call = session_on_call,
        .on_message = session_on_message,
        .on_half_close = link_on_half_close,
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

const rpc_method *ctl_cluster_methods(ctl_cluster *c, size_t *n) {
    *n = sizeof c->methods / sizeof c->methods[0];
    return c->methods;
}

void ctl_cluster_destroy(ctl_cluster *c) {
    if (c == NULL) return;
    while (c->links) {
        ctl_link *l = c->links;
        c->links = l->next;
        link_free(l);
    }
    pthread_mutex_destroy(&c->mu);
    free(c);
}
