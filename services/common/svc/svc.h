/* svc.h — the process shell every Pie-C service binary shares.
 *
 * Owns: the configuration keys common to all services (listen address, CQ threads, message
 * size, auth token, metrics endpoint, log level, shutdown grace), the command line
 * (--config, --print-config, --help-config, --version), signal handling (SIGTERM/SIGINT are
 * blocked in every thread and taken by svc_wait_for_signal), and starting/stopping the gRPC
 * server with health and the Prometheus endpoint. Does not own: any service's methods.
 *
 * A service's main():
 *     svc_block_signals();
 *     svc_args args; parse with svc_parse_args; load its config (which embeds svc_config);
 *     svc *s = svc_create("controller", &cfg.svc, &st);       // logging, token, metrics
 *     build its state (registering metrics on svc_metrics(s)), then
 *     svc_serve(s, methods, n, &st);                          // gRPC server + /metrics
 *     ... start its own threads, then svc_set_serving(s, true);
 *     svc_wait_for_signal();
 *     svc_set_serving(s, false); svc_drain(s); stop its threads; svc_stop(s);
 */
#ifndef PIE_SVC_H
#define PIE_SVC_H

#include <stdbool.h>
#include <stdint.h>

#include "pie_config.h"
#include "pie_metrics.h"
#include "pie_status.h"
#include "rpc.h"

#define PIE_VERSION "0.1.0"

/* Keys shared by all services; each service's config struct embeds one as member `svc`. */
typedef struct svc_config {
    char *listen;               /* server.listen: "host:port" of the gRPC server */
    uint32_t threads;           /* server.threads: completion-queue threads */
    uint64_t max_message_bytes; /* server.max_message: largest message sent or received */
    int64_t shutdown_grace_ms;  /* server.shutdown_grace: drain time on SIGTERM */
    char *auth_token;           /* auth.token: bearer token required on every call ("" = none) */
    char *auth_token_file;      /* auth.token_file: read the token from this file instead */
    char *tls_cert_file;        /* tls.cert_file: PEM certificate the server presents */
    char *tls_key_file;         /* tls.key_file: its private key */
    char *tls_client_ca_file;   /* tls.client_ca_file: require client certificates of this CA */
    char *tls_ca_file;          /* tls.ca_file: CA that signed the services this one dials */
    char *metrics_listen;       /* metrics.listen: "host:port" of /metrics ("" = off) */
    int log_level;              /* log.level: pie_log_level */
} svc_config;

/* Field table entries for svc_config inside service struct T (member `svc`); defaults are the
 * service's ports. Used as the first entries of each service's pie_config_field array. */
#define SVC_CONFIG_FIELDS(T, listen_def, metrics_def)                                              \
    {"server.listen", PIE_CFG_STRING, PIE_CONFIG_AT(T, svc.listen), .def = (listen_def),           \
     .doc = "host:port the gRPC server binds (port 0 = any free port); several, comma-"            \
            "separated; unix:PATH binds a Unix socket (for services on the same machine)"},        \
        {"server.threads",                                                                         \
         PIE_CFG_UINT,                                                                             \
         PIE_CONFIG_AT(T, svc.threads),                                                            \
         .def = "1",                                                                               \
         .min = "1",                                                                               \
         .max = "64",                                                                              \
         .doc = "completion-queue threads of the gRPC server (1: lowest latency)"},                \
        {"server.max_message",                                                                     \
         PIE_CFG_SIZE,                                                                             \
         PIE_CONFIG_AT(T, svc.max_message_bytes),                                                  \
         .def = "64MiB",                                                                           \
         .min = "1KiB",                                                                            \
         .max = "1GiB",                                                                            \
         .doc = "largest gRPC message sent or received; larger ones fail RESOURCE_EXHAUSTED"},     \
        {"server.shutdown_grace",                                                                  \
         PIE_CFG_DURATION,                                                                         \
         PIE_CONFIG_AT(T, svc.shutdown_grace_ms),                                                  \
         .def = "5s",                                                                              \
         .max = "10m",                                                                             \
         .doc = "on SIGTERM, how long work in flight may finish (calls; the instances of a "       \
                "lifecycle replica or placed on a worker)"},                                       \
        {"auth.token",                                                                             \
         PIE_CFG_STRING,                                                                           \
         PIE_CONFIG_AT(T, svc.auth_token),                                                         \
         .def = "",                                                                                \
         .doc = "bearer token every caller must send (empty = no authentication)",                 \
         .flags = PIE_CONFIG_SECRET},                                                              \
        {"auth.token_file", PIE_CFG_STRING, PIE_CONFIG_AT(T, svc.auth_token_file), .def = "",      \
         .doc =                                                                                    \
             "file holding the bearer token (a mounted Kubernetes secret); overrides auth.token"}, \
        {"tls.cert_file", PIE_CFG_STRING, PIE_CONFIG_AT(T, svc.tls_cert_file), .def = "",          \
         .doc = "PEM certificate of the gRPC server: with tls.key_file it speaks TLS only "        \
                "(empty = plaintext)"},                                                            \
        {"tls.key_file", PIE_CFG_STRING, PIE_CONFIG_AT(T, svc.tls_key_file), .def = "",            \
         .doc = "PEM private key of tls.cert_file"},                                               \
        {"tls.client_ca_file", PIE_CFG_STRING, PIE_CONFIG_AT(T, svc.tls_client_ca_file),           \
         .def = "",                                                                                \
         .doc = "PEM CA whose client certificates the server requires (mutual TLS; empty = "       \
                "none asked)"},                                                                    \
        {"tls.ca_file", PIE_CFG_STRING, PIE_CONFIG_AT(T, svc.tls_ca_file), .def = "",              \
         .doc = "PEM CA that signed the services this one dials (the controller, the gateway's "   \
                "lifecycle): those links use TLS and present tls.cert_file when set (empty = "     \
                "plaintext)"},                                                                     \
        {"metrics.listen", PIE_CFG_STRING, PIE_CONFIG_AT(T, svc.metrics_listen),                   \
         .def = (metrics_def),                                                                     \
         .doc = "host:port of the Prometheus /metrics endpoint (empty = off)"},                    \
    {                                                                                              \
        "log.level", PIE_CFG_ENUM, PIE_CONFIG_AT(T, svc.log_level),                                \
            .def = "info", .choices = svc_log_levels, .doc = "lowest log level written"            \
    }

extern const char *const svc_log_levels[];

/* How a worker or a lifecycle replica reaches the controller (keys controller.*). */
typedef struct svc_dial_config {
    char *address;                /* controller.address */
    int64_t reconnect_initial_ms; /* controller.reconnect_initial */
    int64_t reconnect_max_ms;     /* controller.reconnect_max */
} svc_dial_config;

/* Field table entries for an svc_dial_config member `m` of struct T. */
#define SVC_DIAL_FIELDS(T, m)                                                                      \
    {"controller.address", PIE_CFG_STRING, PIE_CONFIG_AT(T, m.address), .def = "127.0.0.1:50052",  \
     .doc = "controller to dial (host:port, dns:///name:port, or unix:PATH on the same machine)"}, \
        {"controller.reconnect_initial",                                                           \
         PIE_CFG_DURATION,                                                                         \
         PIE_CONFIG_AT(T, m.reconnect_initial_ms),                                                 \
         .def = "100ms",                                                                           \
         .min = "1ms",                                                                             \
         .max = "1m",                                                                              \
         .doc = "first redial delay after the controller link fails (grows 1.6x, +-20% jitter)"},  \
    {                                                                                              \
        "controller.reconnect_max", PIE_CFG_DURATION, PIE_CONFIG_AT(T, m.reconnect_max_ms),        \
            .def = "1s", .min = "1ms", .max = "10m",                                               \
            .doc = "longest redial delay of the controller link"                                   \
    } /* "debug", "info", "warn", "error", "off", NULL */

typedef struct svc_args {
    const char *config_path; /* --config PATH (NULL: defaults + environment) */
    bool print_config;       /* --print-config: print the effective config and exit */
    bool help_config;        /* --help-config: print the config reference and exit */
} svc_args;

/* Parses argv. Returns 0 to go on, 1 when the process should exit with status 0 (--help,
 * --version printed), 2 on a usage error (message printed to stderr). */
int svc_parse_args(int argc, char **argv, const char *prog, svc_args *out);

/* Loads the config and handles --print-config / --help-config. Returns 0 to go on, 1 to exit
 * with status 0, 2 to exit with status 2 (the error was printed as "<prog>: <message>"). */
int svc_load_config(const char *prog, const svc_args *args, const pie_config_schema *schema,
                    void *cfg);

/* Blocks SIGTERM, SIGINT and SIGPIPE in the calling thread; call first in main() so every
 * thread created later inherits the mask. */
void svc_block_signals(void);

/* Waits for SIGTERM or SIGINT; returns the signal number. */
int svc_wait_for_signal(void);

typedef struct svc svc;

/* Applies log settings, reads the token, creates the metrics registry. */
svc *svc_create(const char *name, const svc_config *cfg, pie_status *st);

/* Bounds every server call's send queue (rpc_server_opts.send_queue_max / _bytes; 0:
 * unbounded, the default) for a service whose producers cannot wait for a slow peer; before
 * svc_serve. See services/common/rpc/README.md, "Bounded send queues". */
void svc_set_send_queue(svc *s, uint64_t max_msgs, uint64_t max_bytes);

/* TLS options of a channel this service dials (tls.ca_file, and its own certificate for mutual
 * TLS): fills the tls_* fields of co (borrowed from s). Plaintext when tls.ca_file is empty. */
void svc_tls_client(const svc *s, rpc_channel_opts *co);

/* Client tenants for the public API (pie_tenant.h): loads dir's tenant files (nothing when dir
 * is NULL or ""); from then on svc_serve's server accepts only tenant tokens, never auth.token.
 * Before svc_serve. */
pie_code svc_load_tenants(svc *s, const char *dir, pie_status *st);
/* The loaded tenants (empty without any); valid until svc_stop. */
const pie_tenants *svc_tenants(const svc *s);

/* Starts the gRPC server with methods (health included, overall status NOT_SERVING until
 * svc_set_serving) and the metrics endpoint. Once per svc. */
pie_code svc_serve(svc *s, const rpc_method *methods, size_t n, pie_status *st);

/* Overall health ("") and the health of each service name registered with svc_add_health. */
void svc_set_serving(svc *s, bool serving);
/* Also report `service` (e.g. "pie.v1.Controller") in health; follows svc_set_serving. The
 * string is borrowed and must outlive s. */
void svc_add_health(svc *s, const char *service);
/* Whether `service` (registered with svc_add_health) can do its work now, e.g. the lifecycle
 * while it knows no model to launch on: its health is SERVING only while serving and ready
 * (ready from the start). The overall health ("", what liveness probes ask) does not change.
 * Thread-safe. */
void svc_set_health_ready(svc *s, const char *service, bool ready);

pie_metrics *svc_metrics(svc *s);
int svc_port(const svc *s); /* bound gRPC port */
/* The gRPC server once svc_serve started it (NULL before and after svc_drain): for a link that
 * runs on its thread (rpc_link_opts.server). */
rpc_server *svc_rpc_server(const svc *s);
int svc_metrics_port(const svc *s); /* bound metrics port, 0 if off */

/* Dials the controller: a channel with this service's token and message size, and a
 * reconnecting link on it (lo gives the method, response type and callbacks; the backoff comes
 * from dc and also paces gRPC's own redials, so a controller that comes back is found within
 * reconnect_max). On success *ch and *link are set; stop the link before destroying ch. */
pie_code svc_dial_controller(const svc *s, const svc_dial_config *dc, const rpc_link_opts *lo,
                             rpc_channel **ch, rpc_link **link, pie_status *st);

/* A channel to another service at target ("host:port") with this service's token, TLS and
 * message size (e.g. a tensor-parallel rank calling rank 0's Worker/TpJoin). NULL on failure. */
rpc_channel *svc_channel(const svc *s, const char *target, pie_status *st);

/* Graceful stop of the gRPC server (grace from the config) and the metrics endpoint; the
 * metrics registry stays valid, so threads that still update metrics (links to the
 * controller) can be stopped after it. Idempotent; NULL is fine. */
void svc_drain(svc *s);
/* svc_drain with grace_ms instead of server.shutdown_grace: for a service that spent part of
 * its grace draining its own work first (the lifecycle's instances, a worker's placements). */
void svc_drain_within(svc *s, int64_t grace_ms);

/* svc_drain, then frees the metrics registry and s. Stop every thread that updates metrics
 * first. NULL is fine. */
void svc_stop(svc *s);

#endif
