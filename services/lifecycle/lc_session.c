/* lc_session.c — see lc_session.h. */
#include "lc_session.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_log.h"
#include "svc.h"

struct lc_session {
    lc_session_config cfg;
    char replica_id[320];
    rpc_channel *ch;
    rpc_link *link;
    _Atomic uint32_t replica_index; /* from the controller's welcome; 0 while not connected */
    pthread_mutex_t mu;             /* guards models */
    Pie__V1__SessionDown *models;   /* kept message holding the last ModelsChanged */
    Pie__V1__ModelsChanged *models_changed;
    rpc_method methods[1];
    pie_gauge *g_connected, *g_models;
};

static void session_on_connect(rpc_link *link, void *user) {
    lc_session *s = user;
    Pie__V1__SessionHello hello = PIE__V1__SESSION_HELLO__INIT;
    hello.replica_id = s->replica_id;
    hello.version = "pie-c/" PIE_VERSION;
    hello.address = (char *)s->cfg.advertise;
    Pie__V1__SessionUp up = PIE__V1__SESSION_UP__INIT;
    up.hello = &hello;
    pie_status st;
    if (rpc_link_send(link, &up.base, &st) != PIE_OK)
        pie_log_warn("lc.session.hello_failed", "error=\"%s\"", st.msg);
}

/* Keeps down (returns true) when it holds the newest model list. */
static bool take_models(lc_session *s, Pie__V1__SessionDown *down) {
    Pie__V1__ModelsChanged *mc = NULL;
    for (size_t i = 0; i < down->n_events; i++)
        if (down->events[i]->event_case == PIE__V1__SESSION_EVENT__EVENT_MODELS_CHANGED)
            mc = down->events[i]->models_changed;
    if (mc == NULL) return false;
    pthread_mutex_lock(&s->mu);
    rpc_msg_free(s->models ? &s->models->base : NULL);
    s->models = down;
    s->models_changed = mc;
    pthread_mutex_unlock(&s->mu);
    pie_gauge_set(s->g_models, (double)mc->n_models);
    pie_log_info("lc.session.models", "count=%zu", mc->n_models);
    return true;
}

static bool session_on_message(rpc_link *link, ProtobufCMessage *msg, void *user) {
    (void)link;
    lc_session *s = user;
    Pie__V1__SessionDown *down = (Pie__V1__SessionDown *)msg;
    if (down->welcome) {
        atomic_store(&s->replica_index, down->welcome->replica_index);
        pie_gauge_set(s->g_connected, 1);
        pie_log_info("lc.session.welcome", "replica_index=%u controller_version=%s",
                     down->welcome->replica_index, down->welcome->version);
    }
    for (size_t i = 0; i < down->n_events; i++)
        if (down->events[i]->event_case == PIE__V1__SESSION_EVENT__EVENT_WORKER_LOST)
            pie_log_warn("lc.session.worker_lost", "worker_index=%u group=%s",
                         down->events[i]->worker_lost->worker_index,
                         down->events[i]->worker_lost->group_id);
    return take_models(s, down);
}

static void session_on_disconnect(rpc_link *link, const pie_status *st, void *user) {
    (void)link;
    lc_session *s = user;
    uint32_t was = atomic_exchange(&s->replica_index, 0);
    pie_gauge_set(s->g_connected, 0);
    if (was)
        pie_log_warn("lc.session.lost", "replica_index=%u code=%s error=\"%s\"", was,
                     pie_code_name(st->code), st->msg);
}

/* ListModels answers from the cache: models as this replica last heard from the controller. */
static bool list_models_on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    lc_session *s = user;
    Pie__V1__ListModelsResponse resp = PIE__V1__LIST_MODELS_RESPONSE__INIT;
    pthread_mutex_lock(&s->mu);
    if (s->models_changed) {
        resp.n_models = s->models_changed->n_models;
        resp.models = s->models_changed->models;
    }
    rpc_call_reply(call, &resp.base); /* packs now: safe to release the lock after */
    pthread_mutex_unlock(&s->mu);
    return false;
}

lc_session *lc_session_create(const lc_session_config *cfg, pie_metrics *metrics,
                              pie_status *st) {
    lc_session *s = calloc(1, sizeof *s);
    if (s == NULL || pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    s->cfg = *cfg;
    s->g_connected = pie_metrics_gauge(metrics, "pie_lifecycle_session_connected",
                                       "1 while the Session with the controller is open.",
                                       NULL, 0, st);
    s->g_models = pie_metrics_gauge(metrics, "pie_lifecycle_models",
                                    "Models the cluster serves, as last announced.", NULL, 0, st);
    s->methods[0] = (rpc_method){
        .path = "/pie.v1.Lifecycle/ListModels",
        .kind = RPC_UNARY,
        .request = &pie__v1__list_models_request__descriptor,
        .response = &pie__v1__list_models_response__descriptor,
        .on_call = list_models_on_call,
        .user = s,
    };
    return s;
}

const rpc_method *lc_session_methods(lc_session *s, size_t *n) {
    *n = sizeof s->methods / sizeof s->methods[0];
    return s->methods;
}

pie_code lc_session_start(lc_session *s, const svc *sv, const svc_dial_config *dial,
                          pie_status *st) {
    int grpc_port = svc_port(sv);
    if (s->cfg.replica_id && s->cfg.replica_id[0]) {
        snprintf(s->replica_id, sizeof s->replica_id, "%s", s->cfg.replica_id);
    } else {
        char host[256] = "lifecycle";
        if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "lifecycle");
        snprintf(s->replica_id, sizeof s->replica_id, "%s:%d", host, grpc_port);
    }
    rpc_link_opts lo = {
        .path = "/pie.v1.Controller/Session",
        .response = &pie__v1__session_down__descriptor,
        .on_connect = session_on_connect,
        .on_message = session_on_message,
        .on_disconnect = session_on_disconnect,
        .user = s,
    };
    if (svc_dial_controller(sv, dial, &lo, &s->ch, &s->link, st) != PIE_OK) return st->code;
    pie_log_info("lc.session.dialling", "replica_id=%s", s->replica_id);
    return PIE_OK;
}

uint32_t lc_session_replica_index(lc_session *s) { return atomic_load(&s->replica_index); }

pie_code lc_session_resolve_model(lc_session *s, const char *requested, char *out, size_t cap,
                                  pie_status *st) {
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&s->mu);
    size_t n = s->models_changed ? s->models_changed->n_models : 0;
    Pie__V1__ModelInfo **models = n ? s->models_changed->models : NULL;
    if (n == 0) {
        rc = pie_status_set(st, PIE_UNAVAILABLE, "no model is served now (controller %s)",
                            atomic_load(&s->replica_index) ? "connected, no worker registered"
                                                           : "not connected");
    } else if (requested == NULL || requested[0] == '\0') {
        if (n == 1)
            snprintf(out, cap, "%s", models[0]->name);
        else
            rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                                "model: empty, but the cluster serves %zu models (%s, %s%s); "
                                "name one",
                                n, models[0]->name, models[1]->name, n > 2 ? ", ..." : "");
    } else {
        size_t i = 0;
        while (i < n && strcmp(models[i]->name, requested) != 0) i++;
        if (i < n)
            snprintf(out, cap, "%s", requested);
        else
            rc = pie_status_set(st, PIE_NOT_FOUND, "model \"%s\" is not served by this cluster",
                                requested);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void lc_session_destroy(lc_session *s) {
    if (s == NULL) return;
    rpc_link_stop(s->link);
    rpc_channel_destroy(s->ch);
    rpc_msg_free(s->models ? &s->models->base : NULL);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
