/* wrk_node.c — see wrk_node.h. */
#include "wrk_node.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "pie/v1/worker.pb-c.h"
#include "pie_log.h"
#include "svc.h"

struct wrk_node {
    wrk_node_config cfg;
    rpc_channel *ch;
    rpc_link *link;
    _Atomic(const char *) group_id; /* cfg.group_id, or the default set by link_start */
    char default_group[320];
    _Atomic uint32_t worker_index; /* assigned by the controller; 0 while unregistered */
    char device[64];
    rpc_method methods[2];
    pie_gauge *g_linked;
    pie_counter *c_batches;
};

/* The model and capacity as registered and reported by Info. Fills caller-owned structs. */
static void describe(const wrk_node *w, Pie__V1__ModelInfo *m, Pie__V1__WorkerCapacity *cap) {
    pie__v1__model_info__init(m);
    m->name = (char *)w->cfg.model_name;
    m->description = (char *)w->cfg.model_description;
    m->kv_page_size = w->cfg.kv_page_size;
    pie__v1__worker_capacity__init(cap);
    cap->kv_pages_max = w->cfg.kv_pages;
    cap->kv_pages_effective = w->cfg.kv_pages;
    cap->kv_pages_gpu = w->cfg.kv_pages;
    cap->embed_slots = w->cfg.embed_slots;
    cap->max_batch_tokens = w->cfg.max_batch_tokens;
    cap->max_batch_items = w->cfg.max_batch_items;
}

/* ---- WorkerLink (client side) -------------------------------------------------------------- */

static void link_on_connect(rpc_link *link, void *user) {
    wrk_node *w = user;
    Pie__V1__ModelInfo model;
    Pie__V1__WorkerCapacity cap;
    describe(w, &model, &cap);
    Pie__V1__WorkerRegistration reg = PIE__V1__WORKER_REGISTRATION__INIT;
    reg.group_id = (char *)atomic_load(&w->group_id);
    reg.version = "pie-c/" PIE_VERSION;
    reg.model = &model;
    reg.backend = PIE__V1__BACKEND__BACKEND_CPU;
    reg.memory_policy = PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU;
    reg.capacity = &cap;
    reg.tp_size = 1;
    reg.device = w->device;
    reg.address = (char *)w->cfg.advertise;
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.registration = &reg;
    pie_status st;
    if (rpc_link_send(link, &up.base, &st) != PIE_OK)
        pie_log_warn("wrk.link.register_failed", "error=\"%s\"", st.msg);
}

/* No engine yet: every batch fails as a whole with UNIMPLEMENTED so the controller's
 * bookkeeping stays consistent. */
static void answer_batches(wrk_node *w, rpc_link *link, const Pie__V1__WorkerDown *down) {
    if (down->n_batches == 0) return;
    Pie__V1__BatchResult *res = calloc(down->n_batches, sizeof *res);
    Pie__V1__BatchResult **ptrs = calloc(down->n_batches, sizeof *ptrs);
    if (res == NULL || ptrs == NULL) goto done;
    for (size_t i = 0; i < down->n_batches; i++) {
        pie__v1__batch_result__init(&res[i]);
        res[i].batch_id = down->batches[i]->batch_id;
        res[i].code = PIE_UNIMPLEMENTED;
        res[i].message = "worker: batch execution is not implemented in this version";
        ptrs[i] = &res[i];
    }
    Pie__V1__WorkerUp up = PIE__V1__WORKER_UP__INIT;
    up.n_results = down->n_batches;
    up.results = ptrs;
    rpc_link_send(link, &up.base, NULL);
    pie_counter_add(w->c_batches, down->n_batches);
done:
    free(res);
    free(ptrs);
}

static bool link_on_message(rpc_link *link, ProtobufCMessage *msg, void *user) {
    wrk_node *w = user;
    Pie__V1__WorkerDown *down = (Pie__V1__WorkerDown *)msg;
    if (down->registered) {
        atomic_store(&w->worker_index, down->registered->worker_index);
        pie_gauge_set(w->g_linked, 1);
        pie_log_info("wrk.link.registered", "worker_index=%u controller_version=%s",
                     down->registered->worker_index, down->registered->version);
    }
    answer_batches(w, link, down);
    if (down->drain)
        pie_log_info("wrk.link.drain", "shutdown=%d reason=\"%s\"", down->drain->shutdown,
                     down->drain->reason);
    return false;
}

static void link_on_disconnect(rpc_link *link, const pie_status *st, void *user) {
    (void)link;
    wrk_node *w = user;
    uint32_t was = atomic_exchange(&w->worker_index, 0);
    pie_gauge_set(w->g_linked, 0);
    if (was)
        pie_log_warn("wrk.link.lost", "worker_index=%u code=%s error=\"%s\"", was,
                     pie_code_name(st->code), st->msg);
    else
        pie_log_debug("wrk.link.retry", "code=%s error=\"%s\"", pie_code_name(st->code), st->msg);
}

/* ---- pie.v1.Worker (server side) ----------------------------------------------------------- */

static bool info_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    wrk_node *w = user;
    Pie__V1__ModelInfo model;
    Pie__V1__WorkerCapacity cap;
    describe(w, &model, &cap);
    Pie__V1__InfoResponse resp = PIE__V1__INFO_RESPONSE__INIT;
    resp.rank = 0;
    resp.tp_size = 1;
    resp.group_id = (char *)atomic_load(&w->group_id);
    resp.version = "pie-c/" PIE_VERSION;
    resp.model = &model;
    resp.backend = PIE__V1__BACKEND__BACKEND_CPU;
    resp.memory_policy = PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU;
    resp.device = w->device;
    resp.capacity = &cap;
    resp.state = PIE__V1__LOAD_STATE__LOAD_STATE_READY;
    resp.controller_linked = atomic_load(&w->worker_index) != 0;
    rpc_call_reply(call, &resp.base);
    return false;
}

static bool tpjoin_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)user;
    const Pie__V1__TpJoinRequest *r = (const Pie__V1__TpJoinRequest *)req;
    char msg[160];
    snprintf(msg, sizeof msg, "TpJoin: rank %u asked to join, but this worker group has tp_size 1",
             r->rank);
    rpc_call_finish(call, PIE_FAILED_PRECONDITION, msg);
    return false;
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

wrk_node *wrk_node_create(const wrk_node_config *cfg, pie_metrics *metrics, pie_status *st) {
    wrk_node *w = calloc(1, sizeof *w);
    if (w == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    w->cfg = *cfg;
    atomic_store(&w->group_id, cfg->group_id ? cfg->group_id : "");
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(w->device, sizeof w->device, "cpu: %ld threads", ncpu > 0 ? ncpu : 1);
    w->g_linked = pie_metrics_gauge(metrics, "pie_worker_controller_linked",
                                    "1 while registered with the controller.", NULL, 0, st);
    w->c_batches = pie_metrics_counter(metrics, "pie_worker_batches_total",
                                       "Batches received from the controller.", NULL, 0, st);
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

pie_code wrk_node_link_start(wrk_node *w, const svc *s, const svc_dial_config *dial,
                             pie_status *st) {
    int grpc_port = svc_port(s);
    if (atomic_load(&w->group_id)[0] == '\0') {
        char host[256] = "worker";
        if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "worker");
        snprintf(w->default_group, sizeof w->default_group, "%s:%d", host, grpc_port);
        atomic_store(&w->group_id, w->default_group);
    }
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

void wrk_node_destroy(wrk_node *w) {
    if (w == NULL) return;
    rpc_link_stop(w->link);
    rpc_channel_destroy(w->ch);
    free(w);
}
