/* gw_http.c — HTTP/1.1 with libmicrohttpd: routing, bodies, streams (gw_http.h). */
#include "gw_http.h"

#include <stdatomic.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "pie_log.h"
#include "rpc.h"

#define GW_STREAM_BLOCK (16u << 10) /* bytes MHD asks a stream for at a time */
#define GW_THREAD_STACK (512u << 10)
#define GW_READY_TIMEOUT_MS 1000

struct gw_http {
    struct MHD_Daemon *d;
    const gw_gen_env *env;
    pie_metrics *metrics;
    uint64_t max_body;
    int port;
    atomic_bool draining;
    atomic_uint in_flight; /* requests between their first header and their last byte */
};

/* One HTTP request, from its first header to the end of its response. */
typedef struct gw_conn {
    gw_http *h;
    struct MHD_Connection *c;
    char *body;
    size_t body_len, body_cap;
    bool too_large;
} gw_conn;

/* A streamed response: owned by MHD's response object (freed by its free callback, which may
 * run after the connection's own state is gone). */
typedef struct gw_stream {
    gw_gen *g;
    struct MHD_Connection *c; /* used only by the reader, which runs while it lives */
    char *pending;            /* event bytes not yet handed to MHD */
    size_t pending_len, pending_off;
} gw_stream;

/* ------------------------------------------------------------------------------------------
 * Responses */

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, const char *type,
                             char *body, size_t len) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (r == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result rc = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result reply_json(struct MHD_Connection *c, unsigned status, char *json) {
    if (json == NULL) return MHD_NO;
    return reply(c, status, "application/json", json, strlen(json));
}

static enum MHD_Result reply_error(struct MHD_Connection *c, const gw_error *e) {
    return reply_json(c, (unsigned)e->http_status, gw_error_json(e));
}

static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned status, const char *text) {
    char *copy = strdup(text);
    if (copy == NULL) return MHD_NO;
    return reply(c, status, "text/plain; charset=utf-8", copy, strlen(copy));
}

/* ------------------------------------------------------------------------------------------
 * Simple endpoints */

static json_t *model_object(const gw_model *m) {
    return json_pack("{s:s,s:s,s:i,s:s,s:I}", "id", m->name, "object", "model", "created", 0,
                     "owned_by", "pie", "max_model_len", (json_int_t)m->max_context_tokens);
}

/* GET /v1/models (id NULL) or /v1/models/{id}. */
static enum MHD_Result serve_models(gw_conn *k, const char *auth, const char *id) {
    gw_model *models = NULL;
    size_t n = 0;
    pie_status st;
    gw_error e;
    if (gw_lc_models(k->h->env->lc, auth, &models, &n, &st) != PIE_OK) {
        gw_error_from_status(&st, &e);
        return reply_error(k->c, &e);
    }
    json_t *out = NULL;
    if (id == NULL) {
        json_t *data = json_array();
        for (size_t i = 0; data && i < n; i++) json_array_append_new(data, model_object(&models[i]));
        out = json_pack("{s:s,s:o}", "object", "list", "data", data);
    } else {
        for (size_t i = 0; i < n && out == NULL; i++)
            if (strcmp(models[i].name, id) == 0) out = model_object(&models[i]);
    }
    gw_models_free(models, n);
    if (out == NULL && id != NULL) {
        gw_error_set(&e, 404, "invalid_request_error", "model", "model_not_found",
                     "The model `%s` does not exist.", id);
        return reply_error(k->c, &e);
    }
    char *s = out ? json_dumps(out, JSON_COMPACT) : NULL;
    json_decref(out);
    return reply_json(k->c, 200, s);
}

static enum MHD_Result serve_metrics(gw_conn *k) {
    char *text = NULL;
    size_t len = 0;
    if (pie_metrics_render(k->h->metrics, &text, &len) != PIE_OK) return MHD_NO;
    return reply(k->c, 200, "text/plain; version=0.0.4; charset=utf-8", text, len);
}

static enum MHD_Result serve_ready(gw_conn *k) {
    if (atomic_load(&k->h->draining)) return reply_text(k->c, 503, "draining\n");
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    pie_status st;
    pie_code rc = gw_lc_health(k->h->env->lc, GW_READY_TIMEOUT_MS, &hs, &st);
    if (rc == PIE_OK && hs == RPC_HEALTH_SERVING) return reply_text(k->c, 200, "ok\n");
    char msg[PIE_STATUS_MSG_MAX + 64];
    snprintf(msg, sizeof msg, "no lifecycle replica is serving: %s\n",
             rc == PIE_OK ? "NOT_SERVING" : st.msg);
    return reply_text(k->c, 503, msg);
}

/* ------------------------------------------------------------------------------------------
 * Completions */

/* The client is still there: its socket has not hung up (data it sends is left unread). */
static bool client_alive(void *arg) {
    struct MHD_Connection *c = arg;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci == NULL) return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    int n = poll(&p, 1, 0);
    return !(n > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)));
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    gw_stream *s = cls;
    if (s->pending_off == s->pending_len) {
        free(s->pending);
        s->pending = NULL;
        s->pending_len = s->pending_off = 0;
        if (!gw_gen_next_events(s->g, client_alive, s->c, &s->pending, &s->pending_len))
            return MHD_CONTENT_READER_END_OF_STREAM;
    }
    size_t n = s->pending_len - s->pending_off;
    if (n > max) n = max;
    memcpy(buf, s->pending + s->pending_off, n);
    s->pending_off += n;
    return (ssize_t)n;
}

/* The stream response is over (ended or the client went away): the Run goes with it. */
static void stream_free(void *cls) {
    gw_stream *s = cls;
    gw_gen_free(s->g);
    free(s->pending);
    free(s);
}

static enum MHD_Result start_stream(gw_conn *k, gw_gen *g) {
    gw_stream *s = calloc(1, sizeof *s);
    if (s == NULL) {
        gw_gen_free(g);
        return MHD_NO;
    }
    s->g = g;
    s->c = k->c;
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, GW_STREAM_BLOCK,
                                                               stream_read, s, stream_free);
    if (r == NULL) {
        stream_free(s);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no"); /* nginx-style proxies: do not buffer */
    enum MHD_Result rc = MHD_queue_response(k->c, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result serve_completion(gw_conn *k, gw_endpoint ep, const char *auth) {
    gw_error e;
    if (k->too_large) {
        gw_error_set(&e, 413, "invalid_request_error", NULL, "request_too_large",
                     "The request body is larger than %llu bytes.",
                     (unsigned long long)k->h->max_body);
        return reply_error(k->c, &e);
    }
    gw_gen *g = gw_gen_start(k->h->env, ep, auth, k->body ? k->body : "", k->body_len,
                             client_alive, k->c, &e);
    if (g == NULL) return reply_error(k->c, &e);
    if (gw_gen_streaming(g)) return start_stream(k, g);
    char *body = gw_gen_collect(g, client_alive, k->c, &e);
    gw_gen_free(g);
    return body ? reply_json(k->c, 200, body) : reply_error(k->c, &e);
}

/* ------------------------------------------------------------------------------------------
 * Routing */

/* The Authorization header when it is a bearer key ("Bearer <key>"), else NULL; *bad when the
 * key holds bytes a gRPC header cannot carry (outside printable ASCII). */
static const char *bearer(struct MHD_Connection *c, bool *bad) {
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    *bad = false;
    if (v == NULL || strncasecmp(v, "Bearer ", 7) != 0) return NULL;
    for (const unsigned char *p = (const unsigned char *)v; *p; p++)
        if (*p < 0x20 || *p > 0x7E) *bad = true;
    return v;
}

static enum MHD_Result not_found(struct MHD_Connection *c, const char *method, const char *url) {
    gw_error e;
    gw_error_set(&e, 404, "invalid_request_error", NULL, "unknown_url",
                 "Unknown request URL: %s %.200s. Please check the URL for typos, or see the "
                 "docs at docs/openai.md.", method, url);
    return reply_error(c, &e);
}

static enum MHD_Result wrong_method(struct MHD_Connection *c, const char *method,
                                    const char *allowed) {
    gw_error e;
    gw_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                 "Method %s is not allowed here; use %s.", method, allowed);
    struct MHD_Response *r = NULL;
    char *json = gw_error_json(&e);
    if (json != NULL)
        r = MHD_create_response_from_buffer(strlen(json), json, MHD_RESPMEM_MUST_FREE);
    if (r == NULL) {
        free(json);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allowed);
    enum MHD_Result rc = MHD_queue_response(c, MHD_HTTP_METHOD_NOT_ALLOWED, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result route(gw_conn *k, const char *url, const char *method) {
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    bool post = strcmp(method, "POST") == 0;
    bool bad_key = false;
    const char *auth = bearer(k->c, &bad_key);
    if (bad_key && strncmp(url, "/v1/", 4) == 0) {
        gw_error e;
        gw_error_set(&e, 401, "invalid_request_error", NULL, "invalid_api_key",
                     "Incorrect API key provided: it must be printable ASCII.");
        return reply_error(k->c, &e);
    }
    if (strcmp(url, "/v1/completions") == 0 || strcmp(url, "/v1/chat/completions") == 0) {
        if (!post) return wrong_method(k->c, method, "POST");
        return serve_completion(k, url[4] == 'c' && url[5] == 'h' ? GW_CHAT : GW_COMPLETIONS, auth);
    }
    bool models = strcmp(url, "/v1/models") == 0;
    bool one_model = strncmp(url, "/v1/models/", 11) == 0 && url[11] != '\0';
    bool healthz = strcmp(url, "/healthz") == 0, readyz = strcmp(url, "/readyz") == 0;
    bool metrics = strcmp(url, "/metrics") == 0;
    if (!(models || one_model || healthz || readyz || metrics))
        return not_found(k->c, method, url);
    if (!get) return wrong_method(k->c, method, "GET, HEAD");
    if (models || one_model) return serve_models(k, auth, one_model ? url + 11 : NULL);
    if (healthz) return reply_text(k->c, 200, "ok\n");
    if (readyz) return serve_ready(k);
    return serve_metrics(k);
}

static bool body_append(gw_conn *k, const char *data, size_t n) {
    if (k->too_large || k->body_len + n > k->h->max_body) {
        k->too_large = true;
        return true; /* keep reading (and discarding) so the 413 reaches the client */
    }
    if (k->body_len + n + 1 > k->body_cap) {
        size_t cap = k->body_cap ? k->body_cap : 4096;
        while (cap < k->body_len + n + 1) cap *= 2;
        char *b = realloc(k->body, cap);
        if (b == NULL) return false;
        k->body = b;
        k->body_cap = cap;
    }
    memcpy(k->body + k->body_len, data, n);
    k->body_len += n;
    k->body[k->body_len] = '\0';
    return true;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    (void)version;
    gw_conn *k = *con_cls;
    if (k == NULL) { /* headers only: set up, then MHD delivers the body */
        k = calloc(1, sizeof *k);
        if (k == NULL) return MHD_NO;
        k->h = cls;
        k->c = c;
        *con_cls = k;
        atomic_fetch_add(&k->h->in_flight, 1);
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        bool ok = body_append(k, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return ok ? MHD_YES : MHD_NO;
    }
    return route(k, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode why) {
    (void)cls;
    (void)c;
    (void)why;
    gw_conn *k = *con_cls;
    if (k == NULL) return;
    atomic_fetch_sub(&k->h->in_flight, 1);
    free(k->body);
    free(k);
    *con_cls = NULL;
}

/* Streamed tokens are small writes: without TCP_NODELAY, Nagle's algorithm holds each one
 * until the client acknowledges the previous (up to its delayed-ACK timer, ~40 ms). */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    (void)cls;
    (void)socket_context;
    if (code != MHD_CONNECTION_NOTIFY_STARTED) return;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    int one = 1;
    if (ci != NULL) (void)setsockopt(ci->connect_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n') msg[--n] = '\0';
    pie_log_debug("gw.http", "msg=\"%s\"", msg);
}

/* ------------------------------------------------------------------------------------------
 * Server */

static pie_code resolve_listen(const char *listen, struct sockaddr_storage *ss, pie_status *st) {
    const char *colon = strrchr(listen, ':');
    if (colon == NULL || colon == listen)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "http.listen: '%s' is not host:port", listen);
    char host[256];
    size_t hl = (size_t)(colon - listen);
    if (hl >= sizeof host)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "http.listen: host too long");
    memcpy(host, listen, hl);
    host[hl] = '\0';
    if (host[0] == '[' && hl > 1 && host[hl - 1] == ']') { /* [::]:8000 */
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, colon + 1, &hints, &ai);
    if (rc != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "http.listen: '%s': %s", listen,
                              gai_strerror(rc));
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    return PIE_OK;
}

gw_http *gw_http_start(const gw_http_opts *o, const gw_gen_env *env, pie_metrics *metrics,
                       pie_status *st) {
    struct sockaddr_storage ss;
    if (resolve_listen(o->listen, &ss, st) != PIE_OK) return NULL;
    gw_http *h = calloc(1, sizeof *h);
    if (h == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "gateway: out of memory");
        return NULL;
    }
    h->env = env;
    h->metrics = metrics;
    h->max_body = o->max_body_bytes;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_POLL | MHD_USE_ERROR_LOG | MHD_USE_ITC |
                     (ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0);
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
                            MHD_OPTION_CONNECTION_LIMIT, o->max_connections,
                            MHD_OPTION_CONNECTION_TIMEOUT, o->idle_timeout_s,
                            MHD_OPTION_THREAD_STACK_SIZE, (size_t)GW_THREAD_STACK,
                            MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL,
                            MHD_OPTION_END);
    if (h->d == NULL) {
        pie_status_set(st, PIE_UNAVAILABLE, "http.listen: cannot listen on %s (in use?)",
                       o->listen);
        free(h);
        return NULL;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : 0;
    return h;
}

int gw_http_port(const gw_http *h) { return h->port; }

void gw_http_set_draining(gw_http *h) {
    if (h != NULL) atomic_store(&h->draining, true);
}

unsigned gw_http_drain(gw_http *h, int64_t grace_ms) {
    if (h == NULL) return 0;
    gw_http_set_draining(h);
    MHD_socket fd = MHD_quiesce_daemon(h->d); /* no new connections; ours to close */
    if (fd != MHD_INVALID_SOCKET) close(fd);
    int64_t end = rpc_now_ns() + grace_ms * 1000000;
    while (atomic_load(&h->in_flight) > 0 && rpc_now_ns() < end) {
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
    return atomic_load(&h->in_flight);
}

void gw_http_stop(gw_http *h) {
    if (h == NULL) return;
    MHD_stop_daemon(h->d);
    free(h);
}
