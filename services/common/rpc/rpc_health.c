/* rpc_health.c — the grpc.health.v1.Health service every Pie-C server serves.
 *
 * Owns: the per-service status table ("" = the whole server), Check (unary; unknown service →
 * NOT_FOUND) and Watch (server-streaming; unknown service → SERVICE_UNKNOWN, then every change
 * is pushed), and the shutdown transition (all NOT_SERVING, Watch streams ended).
 * It is an ordinary rpc_method table on top of rpc_server.c; Kubernetes gRPC probes call Check.
 * Lock order: health->mu, then a call's own lock inside rpc_call_send/finish. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "pie_log.h"
#include "rpc_internal.h"

typedef struct rpc_health_entry {
    char *service;
    rpc_health_status status;
} rpc_health_entry;

typedef struct rpc_health_watch {
    rpc_call *call; /* alive until on_done, which unlinks the watcher under health->mu */
    char *service;
    rpc_health_status last_sent;
    struct rpc_health_watch *prev, *next;
} rpc_health_watch;

struct rpc_health {
    pthread_mutex_t mu;
    rpc_health_entry *e;
    size_t n, cap;
    rpc_health_watch *watchers;
    bool shutdown;
};

static rpc_health_entry *find_locked(rpc_health *h, const char *service) {
    for (size_t i = 0; i < h->n; i++)
        if (strcmp(h->e[i].service, service) == 0) return &h->e[i];
    return NULL;
}

static rpc_health_status status_locked(rpc_health *h, const char *service) {
    rpc_health_entry *e = find_locked(h, service);
    return e ? e->status : RPC_HEALTH_SERVICE_UNKNOWN;
}

static pie_code send_status(rpc_call *call, rpc_health_status s) {
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)s;
    return rpc_call_send(call, &resp.base);
}

/* Pushes the current status of every watched service that changed. Under h->mu. */
static void notify_locked(rpc_health *h) {
    for (rpc_health_watch *w = h->watchers; w; w = w->next) {
        rpc_health_status s = status_locked(h, w->service);
        if (s == w->last_sent) continue;
        pie_code rc = send_status(w->call, s);
        if (rc == PIE_OK)
            w->last_sent = s;
        else if (rc != PIE_CANCELLED)
            pie_log_warn("rpc.health_push", "service=%s code=%s", w->service, pie_code_name(rc));
    }
}

rpc_health *rpc__health_create(bool start_not_serving) {
    rpc_health *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    if (pthread_mutex_init(&h->mu, NULL) != 0) {
        free(h);
        return NULL;
    }
    if (rpc__health_set(h, "", start_not_serving ? RPC_HEALTH_NOT_SERVING : RPC_HEALTH_SERVING,
                        NULL) != PIE_OK) {
        rpc__health_destroy(h);
        return NULL;
    }
    return h;
}

void rpc__health_destroy(rpc_health *h) {
    if (!h) return;
    for (size_t i = 0; i < h->n; i++) free(h->e[i].service);
    free(h->e);
    /* Watchers are gone: every Watch call reached on_done before the server's threads ended. */
    pthread_mutex_destroy(&h->mu);
    free(h);
}

pie_code rpc__health_set(rpc_health *h, const char *service, rpc_health_status status,
                         pie_status *st) {
    if (!service) service = "";
    if (status < RPC_HEALTH_UNKNOWN || status > RPC_HEALTH_SERVICE_UNKNOWN)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "rpc_server_set_health: status %d is not a health status",
                              (int)status);
    pie_code rc = PIE_OK;
    pthread_mutex_lock(&h->mu);
    if (h->shutdown) goto out; /* everything stays NOT_SERVING until the end */
    rpc_health_entry *e = find_locked(h, service);
    if (status == RPC_HEALTH_SERVICE_UNKNOWN) {
        if (e) {
            free(e->service);
            *e = h->e[--h->n];
        }
    } else if (e) {
        e->status = status;
    } else {
        if (h->n == h->cap) {
            size_t ncap = h->cap ? h->cap * 2 : 8;
            rpc_health_entry *ne = realloc(h->e, ncap * sizeof *ne);
            if (!ne) {
                rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                    "rpc_server_set_health: out of memory");
                goto out;
            }
            h->e = ne;
            h->cap = ncap;
        }
        char *name = strdup(service);
        if (!name) {
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "rpc_server_set_health: out of memory");
            goto out;
        }
        h->e[h->n++] = (rpc_health_entry){name, status};
    }
    notify_locked(h);
out:
    pthread_mutex_unlock(&h->mu);
    return rc;
}

void rpc__health_shutdown(rpc_health *h) {
    pthread_mutex_lock(&h->mu);
    if (!h->shutdown) {
        for (size_t i = 0; i < h->n; i++) h->e[i].status = RPC_HEALTH_NOT_SERVING;
        notify_locked(h);
        for (rpc_health_watch *w = h->watchers; w; w = w->next)
            (void)rpc_call_finish(w->call, PIE_UNAVAILABLE,
                                  "server shutting down"); /* may be over */
        h->shutdown = true;
    }
    pthread_mutex_unlock(&h->mu);
}

static bool on_check(rpc_call *call, ProtobufCMessage *req, void *user) {
    rpc_health *h = user;
    const Grpc__Health__V1__HealthCheckRequest *r =
        (const Grpc__Health__V1__HealthCheckRequest *)req;
    const char *service = r->service ? r->service : "";
    pthread_mutex_lock(&h->mu);
    rpc_health_status s = status_locked(h, service);
    pthread_mutex_unlock(&h->mu);
    if (s == RPC_HEALTH_SERVICE_UNKNOWN) {
        char msg[300];
        pie_log_quote(msg, sizeof msg, service);
        char text[340];
        snprintf(text, sizeof text, "unknown service %s", msg);
        (void)rpc_call_finish(call, PIE_NOT_FOUND, text); /* fails only if already cancelled */
    } else {
        Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
        resp.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)s;
        (void)rpc_call_reply(call, &resp.base);
    }
    return false;
}

static bool on_watch(rpc_call *call, ProtobufCMessage *req, void *user) {
    rpc_health *h = user;
    const Grpc__Health__V1__HealthCheckRequest *r =
        (const Grpc__Health__V1__HealthCheckRequest *)req;
    rpc_health_watch *w = calloc(1, sizeof *w);
    char *service = strdup(r->service ? r->service : "");
    if (!w || !service) {
        free(w);
        free(service);
        (void)rpc_call_finish(call, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return false;
    }
    w->call = call;
    w->service = service;
    pthread_mutex_lock(&h->mu);
    if (h->shutdown) {
        pthread_mutex_unlock(&h->mu);
        free(w->service);
        free(w);
        (void)rpc_call_finish(call, PIE_UNAVAILABLE, "server shutting down");
        return false;
    }
    w->last_sent = status_locked(h, service);
    pie_code rc = send_status(call, w->last_sent);
    w->next = h->watchers;
    if (h->watchers) h->watchers->prev = w;
    h->watchers = w;
    pthread_mutex_unlock(&h->mu);
    rpc_call_set_data(call, w);
    if (rc != PIE_OK && rc != PIE_CANCELLED)
        pie_log_warn("rpc.health_watch", "service=%s code=%s", service, pie_code_name(rc));
    return false;
}

static void on_watch_done(rpc_call *call, void *user) {
    rpc_health *h = user;
    rpc_health_watch *w = rpc_call_get_data(call);
    if (!w) return;
    pthread_mutex_lock(&h->mu);
    if (w->prev)
        w->prev->next = w->next;
    else
        h->watchers = w->next;
    if (w->next) w->next->prev = w->prev;
    pthread_mutex_unlock(&h->mu);
    free(w->service);
    free(w);
    rpc_call_set_data(call, NULL);
}

void rpc__health_methods(rpc_health *h, bool needs_token, rpc_method methods[2]) {
    memset(methods, 0, 2 * sizeof *methods);
    methods[0] = (rpc_method){
        .path = "/grpc.health.v1.Health/Check",
        .kind = RPC_UNARY,
        .request = &grpc__health__v1__health_check_request__descriptor,
        .response = &grpc__health__v1__health_check_response__descriptor,
        .on_call = on_check,
        .user = h,
        .no_auth = !needs_token,
    };
    methods[1] = (rpc_method){
        .path = "/grpc.health.v1.Health/Watch",
        .kind = RPC_SERVER_STREAM,
        .request = &grpc__health__v1__health_check_request__descriptor,
        .response = &grpc__health__v1__health_check_response__descriptor,
        .on_call = on_watch,
        .on_done = on_watch_done,
        .user = h,
        .no_auth = !needs_token,
    };
}
