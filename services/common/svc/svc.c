/* svc.c — see svc.h. */
#include "svc.h"

#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie_desc.h"
#include "pie_file.h"
#include "pie_httpd.h"
#include "pie_procstat.h"
#include "pie_log.h"
#include "rpc_reflect.h"

const char *const svc_log_levels[] = {"debug", "info", "warn", "error", "off", NULL};

#define SVC_MAX_HEALTH 8

struct svc {
    char name[32];
    rpc_server *server;
    pie_metrics *metrics;
    pie_httpd *httpd;
    rpc_reflect *reflect; /* server reflection; outlives the server */
    const svc_config *cfg; /* borrowed; outlives the svc */
    char token[512];
    pie_tenants tenants; /* svc_load_tenants; empty without tenants */
    char *tls_cert, *tls_key, *tls_client_ca, *tls_ca; /* PEM text of the tls.* files, or NULL */
    double call_bounds[20]; /* buckets of pie_grpc_server_handling_seconds: 100 µs .. 1 h */
    /* Health: "" is `serving`; each name of health[] is serving && its ready flag. Set from the
     * main thread (serving) and from the service's own threads (ready), hence the lock. */
    pthread_mutex_t health_mu;
    const char *health[SVC_MAX_HEALTH]; /* service names reported in health besides "" */
    bool ready[SVC_MAX_HEALTH];
    size_t n_health;
    bool serving;
    uint64_t send_queue_msgs, send_queue_bytes; /* svc_set_send_queue; 0: unbounded */
};

int svc_parse_args(int argc, char **argv, const char *prog, svc_args *out) {
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'}, {"print-config", no_argument, NULL, 'p'},
        {"help-config", no_argument, NULL, 'H'},  {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},         {NULL, 0, NULL, 0},
    };
    memset(out, 0, sizeof *out);
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "c:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'c': out->config_path = optarg; break;
        case 'p': out->print_config = true; break;
        case 'H': out->help_config = true; break;
        case 'V': printf("%s %s\n", prog, PIE_VERSION); return 1;
        case 'h':
            printf(
                "usage: %s [--config FILE] [--print-config] [--help-config] [--version]\n"
                "  --config FILE    YAML configuration (PIE_* environment variables override it)\n"
                "  --print-config   print the effective configuration and exit\n"
                "  --help-config    print every configuration key and exit\n",
                prog);
            return 1;
        default: return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[optind]);
        return 2;
    }
    return 0;
}

extern char **environ;

int svc_load_config(const char *prog, const svc_args *args, const pie_config_schema *schema,
                    void *cfg) {
    pie_status st;
    if (args->help_config) {
        if (pie_config_print_docs(schema, stdout, &st) != PIE_OK) {
            fprintf(stderr, "%s: %s\n", prog, st.msg);
            return 2;
        }
        return 1;
    }
    if (pie_config_load(schema, cfg, args->config_path, environ, &st) != PIE_OK) {
        fprintf(stderr, "%s: %s\n", prog, st.msg);
        return 2;
    }
    if (args->print_config) {
        pie_code rc = pie_config_print(schema, cfg, stdout, &st);
        pie_config_free(schema, cfg);
        if (rc != PIE_OK) {
            fprintf(stderr, "%s: %s\n", prog, st.msg);
            return 2;
        }
        return 1;
    }
    return 0;
}

static void signal_set(sigset_t *set) {
    sigemptyset(set);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
}

void svc_block_signals(void) {
    sigset_t set;
    signal_set(&set);
    sigaddset(&set, SIGPIPE); /* peers that vanish are handled as write errors */
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}

int svc_wait_for_signal(void) {
    sigset_t set;
    signal_set(&set);
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {}
    return sig;
}

/* "host:port" → host (into buf) and port; IPv6 as "[::1]:9090". Returns 0 or -1. */
static int split_host_port(const char *addr, char *host, size_t n, uint16_t *port) {
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || colon == addr) return -1;
    const char *h = addr;
    size_t hl = (size_t)(colon - addr);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl + 1 > n) return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    char *end;
    errno = 0;
    long p = strtol(colon + 1, &end, 10);
    if (errno || *end || end == colon + 1 || p < 0 || p > 65535) return -1;
    *port = (uint16_t)p;
    return 0;
}

/* Reads the bearer token from path, dropping trailing newlines and spaces. */
static pie_code read_token_file(const char *path, char *out, size_t n, pie_status *st) {
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "auth.token_file: cannot open '%s': %s",
                              path, strerror(errno));
    size_t len = fread(out, 1, n - 1, f);
    int err = ferror(f);
    fclose(f);
    if (err)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "auth.token_file: cannot read '%s'", path);
    out[len] = '\0';
    while (len > 0 && (out[len - 1] == '\n' || out[len - 1] == '\r' || out[len - 1] == ' '))
        out[--len] = '\0';
    if (len == 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "auth.token_file: '%s' is empty", path);
    return PIE_OK;
}

static pie_code start_metrics(svc *s, const svc_config *cfg, pie_status *st) {
    if (cfg->metrics_listen == NULL || cfg->metrics_listen[0] == '\0') return PIE_OK;
    char host[256];
    uint16_t port;
    if (split_host_port(cfg->metrics_listen, host, sizeof host, &port) != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "metrics.listen: '%s' is not host:port",
                              cfg->metrics_listen);
    pie_httpd_options opt = {.host = host, .port = port, .metrics = s->metrics};
    return pie_httpd_start(&opt, &s->httpd, st);
}

static void register_build_info(svc *s) {
    pie_status st;
    pie_metric_label labels[] = {{"service", s->name}, {"version", PIE_VERSION}};
    pie_gauge *g =
        pie_metrics_gauge(s->metrics, "pie_build_info",
                          "Always 1; labels name the service and its version.", labels, 2, &st);
    pie_gauge_set(g, 1);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    pie_gauge *start =
        pie_metrics_gauge(s->metrics, "pie_process_start_time_seconds",
                          "Start time of the process since the Unix epoch.", NULL, 0, &st);
    pie_gauge_set(start, (double)ts.tv_sec + (double)ts.tv_nsec / 1e9);
    if (pie_procstat_register(s->metrics, &st) != PIE_OK)
        pie_log_warn("svc.procstat", "process_* metrics unavailable: %s", st.msg);
}

#define SVC_PEM_MAX (1u << 20)

/* path's contents into *out (NULL when path is empty). */
static pie_code read_pem(const char *path, const char *key, char **out, pie_status *st) {
    *out = NULL;
    if (path == NULL || path[0] == '\0') return PIE_OK;
    size_t len;
    if (pie_file_read(path, key, SVC_PEM_MAX, out, &len, st) != PIE_OK) return st->code;
    if (strstr(*out, "-----BEGIN ") == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: '%s' holds no PEM block", key, path);
    return PIE_OK;
}

static pie_code load_tls(svc *s, const svc_config *cfg, pie_status *st) {
    if (read_pem(cfg->tls_cert_file, "tls.cert_file", &s->tls_cert, st) != PIE_OK ||
        read_pem(cfg->tls_key_file, "tls.key_file", &s->tls_key, st) != PIE_OK ||
        read_pem(cfg->tls_client_ca_file, "tls.client_ca_file", &s->tls_client_ca, st) != PIE_OK ||
        read_pem(cfg->tls_ca_file, "tls.ca_file", &s->tls_ca, st) != PIE_OK)
        return st->code;
    if ((s->tls_cert != NULL) != (s->tls_key != NULL))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tls.cert_file and tls.key_file go together (one is empty)");
    if (s->tls_client_ca && !s->tls_cert)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "tls.client_ca_file needs tls.cert_file and tls.key_file");
    return PIE_OK;
}

void svc_tls_client(const svc *s, rpc_channel_opts *co) {
    co->tls_ca_pem = s->tls_ca;
    co->tls_cert_pem = s->tls_ca ? s->tls_cert : NULL;
    co->tls_key_pem = s->tls_ca ? s->tls_key : NULL;
}

svc *svc_create(const char *name, const svc_config *cfg, pie_status *st) {
    svc *s = calloc(1, sizeof *s);
    if (s == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    int rc = pthread_mutex_init(&s->health_mu, NULL);
    if (rc != 0) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "svc: pthread_mutex_init: %s", strerror(rc));
        free(s);
        return NULL;
    }
    snprintf(s->name, sizeof s->name, "%s", name);
    s->cfg = cfg;
    pie_log_set_service(name);
    pie_log_set_level((pie_log_level)cfg->log_level);
    if (cfg->auth_token_file && cfg->auth_token_file[0]) {
        if (read_token_file(cfg->auth_token_file, s->token, sizeof s->token, st) != PIE_OK)
            goto fail;
    } else if (cfg->auth_token) {
        snprintf(s->token, sizeof s->token, "%s", cfg->auth_token);
    }
    if (load_tls(s, cfg, st) != PIE_OK) goto fail;
    s->metrics = pie_metrics_create();
    if (s->metrics == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        goto fail;
    }
    register_build_info(s);
    pie_metrics_exponential_bounds(0.0001, 2.5, 20, s->call_bounds); /* streams: up to 1 h */
    return s;
fail:
    svc_stop(s);
    return NULL;
}

/* The services a server with these methods serves, for reflection's list_services: each
 * method's service ("/pie.v1.Lifecycle/Run" → "pie.v1.Lifecycle"), health and reflection. */
#define SVC_MAX_SERVICES 16
static size_t served_services(const rpc_method *methods, size_t n, char names[][128]) {
    static const char *const always[] = {"grpc.health.v1.Health",
                                         "grpc.reflection.v1alpha.ServerReflection",
                                         "grpc.reflection.v1.ServerReflection"};
    size_t k = 0;
    for (size_t i = 0; i < sizeof always / sizeof always[0]; i++)
        snprintf(names[k++], 128, "%s", always[i]);
    for (size_t i = 0; i < n && k < SVC_MAX_SERVICES; i++) {
        const char *p = methods[i].path + 1, *slash = strchr(p, '/');
        if (methods[i].path[0] != '/' || slash == NULL || slash - p >= 128) continue;
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)(slash - p), p);
        bool dup = false;
        for (size_t j = 0; j < k && !dup; j++) dup = strcmp(names[j], name) == 0;
        if (!dup) memcpy(names[k++], name, sizeof name);
    }
    return k;
}

/* gRPC server reflection over the compiled-in descriptor set (grpcurl works without .proto
 * files): methods for the server, the index kept in s. */
static pie_code add_reflection(svc *s, const rpc_method *methods, size_t n, pie_status *st) {
    char names[SVC_MAX_SERVICES][128];
    const char *ptrs[SVC_MAX_SERVICES];
    size_t k = served_services(methods, n, names);
    for (size_t i = 0; i < k; i++) ptrs[i] = names[i];
    s->reflect = rpc_reflect_create(pie_proto_descriptor_set, pie_proto_descriptor_set_len, ptrs,
                                    k, st);
    if (s->reflect == NULL) return st ? st->code : PIE_INTERNAL;
    rpc_method rm[2];
    rpc_reflect_methods(s->reflect, rm);
    return rpc_server_add_methods(s->server, rm, 2, st);
}

void svc_set_send_queue(svc *s, uint64_t max_msgs, uint64_t max_bytes) {
    s->send_queue_msgs = max_msgs;
    s->send_queue_bytes = max_bytes;
}

/* rpc_server_opts.on_finished: per-method call counts by status and durations. The series are
 * looked up per call (get-or-create under the registry's lock): unary calls are rare next to
 * the streams' messages, which this does not see. */
static void call_finished(void *user, const char *method, pie_code code, int64_t dur_ns) {
    svc *s = user;
    pie_status st;
    pie_metric_label l[2] = {{"method", method}, {"code", pie_code_name(code)}};
    pie_counter_add(pie_metrics_counter(s->metrics, "pie_grpc_server_handled_total",
                                        "gRPC calls finished, by method and status code.", l, 2,
                                        &st),
                    1);
    pie_histogram_observe(pie_metrics_histogram(s->metrics, "pie_grpc_server_handling_seconds",
                                                "gRPC call duration, arrival to status.",
                                                s->call_bounds, 20, l, 1, &st),
                          (double)dur_ns / 1e9);
}

pie_code svc_load_tenants(svc *s, const char *dir, pie_status *st) {
    if (!dir || !dir[0]) return PIE_OK;
    if (pie_tenants_load(dir, s->token, &s->tenants, st) != PIE_OK) return st->code;
    pie_log_info("svc.tenants", "dir=%s tenants=%zu", dir, s->tenants.n);
    return PIE_OK;
}

const pie_tenants *svc_tenants(const svc *s) { return &s->tenants; }

pie_code svc_serve(svc *s, const rpc_method *methods, size_t n, pie_status *st) {
    const svc_config *cfg = s->cfg;
    int max_msg =
        cfg->max_message_bytes > (uint64_t)INT32_MAX ? INT32_MAX : (int)cfg->max_message_bytes;
    rpc_server_opts so = {
        .addr = cfg->listen,
        .n_threads = (int)cfg->threads,
        .token = s->token,
        .tenants = &s->tenants,
        .tls_cert_pem = s->tls_cert,
        .tls_key_pem = s->tls_key,
        .tls_client_ca_pem = s->tls_client_ca,
        .on_finished = call_finished,
        .on_finished_user = s,
        .health_not_serving = true,
        .max_recv_bytes = max_msg,
        .max_send_bytes = max_msg,
        .send_queue_max = (size_t)s->send_queue_msgs,
        .send_queue_max_bytes = (size_t)s->send_queue_bytes,
    };
    s->server = rpc_server_create(&so, st);
    if (s->server == NULL) return st ? st->code : PIE_INTERNAL;
    if (n > 0 && rpc_server_add_methods(s->server, methods, n, st) != PIE_OK) return st->code;
    if (add_reflection(s, methods, n, st) != PIE_OK) return st->code;
    if (rpc_server_start(s->server, st) != PIE_OK) return st->code;
    if (start_metrics(s, cfg, st) != PIE_OK) return st->code;
    pie_log_info("svc.started", "version=%s grpc_port=%d metrics_port=%d tls=%s auth=%s",
                 PIE_VERSION, rpc_server_port(s->server), svc_metrics_port(s),
                 s->tls_client_ca ? "mutual" : s->tls_cert ? "on" : "off",
                 s->tenants.n ? "tenants" : s->token[0] ? "on" : "off");
    return PIE_OK;
}

/* Publishes health[i]; health_mu held. Nothing once the server is gone (svc_drain). */
static void health_publish(svc *s, size_t i) {
    if (s->server == NULL) return;
    bool on = s->serving && s->ready[i];
    rpc_server_set_health(s->server, s->health[i], on ? RPC_HEALTH_SERVING : RPC_HEALTH_NOT_SERVING,
                          NULL);
}

void svc_add_health(svc *s, const char *service) {
    pthread_mutex_lock(&s->health_mu);
    if (s->n_health < SVC_MAX_HEALTH) {
        s->health[s->n_health] = service;
        s->ready[s->n_health] = true;
        health_publish(s, s->n_health++);
    }
    pthread_mutex_unlock(&s->health_mu);
}

void svc_set_serving(svc *s, bool serving) {
    pthread_mutex_lock(&s->health_mu);
    s->serving = serving;
    for (size_t i = 0; i < s->n_health; i++) health_publish(s, i);
    if (s->server)
        rpc_server_set_health(s->server, "", serving ? RPC_HEALTH_SERVING : RPC_HEALTH_NOT_SERVING,
                              NULL);
    pthread_mutex_unlock(&s->health_mu);
    pie_log_info("svc.health", "serving=%s", serving ? "true" : "false");
}

void svc_set_health_ready(svc *s, const char *service, bool ready) {
    bool changed = false;
    pthread_mutex_lock(&s->health_mu);
    for (size_t i = 0; i < s->n_health; i++) {
        if (strcmp(s->health[i], service) != 0 || s->ready[i] == ready) continue;
        s->ready[i] = ready;
        health_publish(s, i);
        changed = true;
    }
    pthread_mutex_unlock(&s->health_mu);
    if (changed)
        pie_log_info("svc.health.ready", "service=%s ready=%s", service, ready ? "true" : "false");
}

pie_metrics *svc_metrics(svc *s) { return s->metrics; }
int svc_port(const svc *s) { return rpc_server_port(s->server); }
rpc_server *svc_rpc_server(const svc *s) { return s->server; }
int svc_metrics_port(const svc *s) { return s->httpd ? (int)pie_httpd_port(s->httpd) : 0; }

/* What every channel of this service to another one carries: its token, its message size
 * limit and its TLS. */
static rpc_channel_opts svc_client_opts(const svc *s) {
    int max_msg = s->cfg->max_message_bytes > (uint64_t)INT32_MAX ? INT32_MAX
                                                                  : (int)s->cfg->max_message_bytes;
    rpc_channel_opts co = {
        .token = s->token[0] ? s->token : NULL,
        .max_recv_bytes = max_msg,
        .max_send_bytes = max_msg,
    };
    svc_tls_client(s, &co);
    return co;
}

rpc_channel *svc_channel(const svc *s, const char *target, pie_status *st) {
    rpc_channel_opts co = svc_client_opts(s);
    return rpc_channel_create(target, &co, st);
}

pie_code svc_dial_controller(const svc *s, const svc_dial_config *dc, const rpc_link_opts *lo,
                             rpc_channel **ch, rpc_link **link, pie_status *st) {
    rpc_channel_opts co = svc_client_opts(s);
    co.keepalive_time_ms = 10000;
    co.keepalive_without_calls = true;
    co.reconnect_initial_ms = (int)dc->reconnect_initial_ms;
    co.reconnect_max_ms = (int)dc->reconnect_max_ms;
    *link = NULL;
    *ch = rpc_channel_create(dc->address, &co, st);
    if (*ch == NULL) return st ? st->code : PIE_INTERNAL;
    rpc_link_opts opts = *lo;
    opts.backoff_initial_ms = dc->reconnect_initial_ms;
    opts.backoff_max_ms = dc->reconnect_max_ms;
    *link = rpc_link_start(*ch, &opts, st);
    if (*link == NULL) {
        rpc_channel_destroy(*ch);
        *ch = NULL;
        return st ? st->code : PIE_INTERNAL;
    }
    pie_log_info("svc.dialling",
                 "controller=%s path=%s reconnect_initial_ms=%lld reconnect_max_ms=%lld",
                 dc->address, lo->path, (long long)dc->reconnect_initial_ms,
                 (long long)dc->reconnect_max_ms);
    return PIE_OK;
}

void svc_drain(svc *s) {
    if (s != NULL) svc_drain_within(s, s->cfg->shutdown_grace_ms);
}

void svc_drain_within(svc *s, int64_t grace_ms) {
    if (s == NULL) return;
    if (s->server) {
        pie_log_info("svc.stopping", "grace_ms=%lld", (long long)grace_ms);
        rpc_server_shutdown(s->server, grace_ms);
        /* Service threads may still set health (svc_set_health_ready): under health_mu. */
        pthread_mutex_lock(&s->health_mu);
        rpc_server *srv = s->server;
        s->server = NULL;
        pthread_mutex_unlock(&s->health_mu);
        rpc_server_destroy(srv);
    }
    if (s->httpd) {
        pie_httpd_stop(s->httpd);
        s->httpd = NULL;
    }
}

void svc_stop(svc *s) {
    if (s == NULL) return;
    svc_drain(s);
    rpc_reflect_destroy(s->reflect); /* after the server: no call uses it any more */
    pie_metrics_destroy(s->metrics);
    pie_tenants_free(&s->tenants);
    free(s->tls_cert);
    if (s->tls_key) memset(s->tls_key, 0, strlen(s->tls_key)); /* a private key */
    free(s->tls_key);
    free(s->tls_client_ca);
    free(s->tls_ca);
    pie_log_info("svc.stopped", "%s", "");
    pthread_mutex_destroy(&s->health_mu);
    free(s);
}
