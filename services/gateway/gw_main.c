/* gw_main.c — pie-gateway: the OpenAI-compatible HTTP front of a Pie-C cluster.
 *
 * Owns: the gateway's configuration schema and start/stop order. The HTTP server is in
 * gw_http.c, the generation flow in gw_gen.c, OpenAI's JSON in gw_openai.c, chat templates in
 * gw_chat.c (+ gw_jinja.c), the lifecycle client in gw_lc.c. Stateless: any number of
 * replicas behind a load balancer; all state lives in the cluster. Docs: docs/openai.md. */
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gw_chat.h"
#include "gw_gen.h"
#include "gw_http.h"
#include "gw_lc.h"
#include "pie_log.h"
#include "svc.h"

typedef struct gw_config {
    svc_config svc;
    char *http_listen;
    uint32_t max_connections;
    uint64_t max_body_bytes;
    int64_t idle_timeout_ms;
    char *lc_address;
    int64_t call_timeout_ms, run_timeout_ms, models_cache_ms;
    char *program_path;
} gw_config;

static const pie_config_field gw_fields[] = {
    SVC_CONFIG_FIELDS(gw_config, "0.0.0.0:50054", "0.0.0.0:9094"),
    {"http.listen", PIE_CFG_STRING, PIE_CONFIG_AT(gw_config, http_listen), .def = "0.0.0.0:8000",
     .doc = "host:port of the OpenAI-compatible HTTP API (port 0 = any free port)"},
    {"http.max_connections", PIE_CFG_UINT, PIE_CONFIG_AT(gw_config, max_connections),
     .def = "1024", .min = "1", .max = "65536",
     .doc = "open HTTP connections at once (one thread each); more are refused"},
    {"http.max_body", PIE_CFG_SIZE, PIE_CONFIG_AT(gw_config, max_body_bytes), .def = "8MiB",
     .min = "1KiB", .max = "1GiB", .doc = "largest request body; larger ones get HTTP 413"},
    {"http.idle_timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(gw_config, idle_timeout_ms),
     .def = "5m", .min = "1s", .max = "24h",
     .doc = "close a keep-alive connection idle this long (a streaming response is not idle)"},
    {"lifecycle.address", PIE_CFG_STRING, PIE_CONFIG_AT(gw_config, lc_address),
     .def = "127.0.0.1:50051",
     .doc = "gRPC target of the lifecycle replicas; requests are spread round-robin over every "
            "address it resolves to whose readiness is SERVING (dns:///name:port for a "
            "Kubernetes headless service, ipv4:a:p,b:q for a fixed list)"},
    {"lifecycle.timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(gw_config, call_timeout_ms),
     .def = "30s", .min = "1ms", .max = "1h",
     .doc = "deadline of ListModels and of uploading the built-in program"},
    {"requests.timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(gw_config, run_timeout_ms),
     .def = "1h", .min = "1s", .max = "168h",
     .doc = "longest a completion may run (its Run's deadline)"},
    {"models.cache", PIE_CFG_DURATION, PIE_CONFIG_AT(gw_config, models_cache_ms), .def = "5s",
     .max = "1h", .doc = "how long the model list (templates, context sizes) is reused"},
    {"program.path", PIE_CFG_STRING, PIE_CONFIG_AT(gw_config, program_path), .def = "",
     .doc = "the openai_chat inferlet (.wasm) the gateway runs per request; empty = "
            "<directory of pie-gateway>/../inferlets/openai_chat.wasm"},
};
static const pie_config_schema gw_schema = PIE_CONFIG_SCHEMA(gw_config, gw_fields);

/* program.path, or its default next to the executable. */
static void program_path(const gw_config *cfg, char *out, size_t cap) {
    if (cfg->program_path[0] != '\0') {
        snprintf(out, cap, "%s", cfg->program_path);
        return;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) {
        snprintf(out, cap, "openai_chat.wasm");
        return;
    }
    exe[n] = '\0';
    snprintf(out, cap, "%s/../inferlets/openai_chat.wasm", dirname(exe));
}

/* Everything the process runs, in start order (stopped in reverse). */
typedef struct gw_parts {
    svc *s;
    gw_lc *lc;
    gw_chat *chat;
    gw_metrics mx;
    gw_gen_env env;
    gw_http *http;
} gw_parts;

static pie_code gw_start(const gw_config *cfg, gw_parts *p, pie_status *st) {
    if ((p->s = svc_create("gateway", &cfg->svc, st)) == NULL) return st->code;
    char path[PATH_MAX + 64];
    program_path(cfg, path, sizeof path);
    gw_lc_opts lo = {
        .target = cfg->lc_address,
        .program_path = path,
        .call_timeout_ms = cfg->call_timeout_ms,
        .run_timeout_ms = cfg->run_timeout_ms,
        .models_cache_ms = cfg->models_cache_ms,
        .max_message_bytes = cfg->svc.max_message_bytes,
    };
    rpc_channel_opts tls = {0};
    svc_tls_client(p->s, &tls);
    lo.tls_ca_pem = tls.tls_ca_pem;
    lo.tls_cert_pem = tls.tls_cert_pem;
    lo.tls_key_pem = tls.tls_key_pem;
    if ((p->lc = gw_lc_create(&lo, st)) == NULL) return st->code;
    if ((p->chat = gw_chat_create()) == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    if (gw_metrics_register(svc_metrics(p->s), &p->mx, st) != PIE_OK) return st->code;
    p->env = (gw_gen_env){.lc = p->lc, .chat = p->chat, .mx = &p->mx};
    if (svc_serve(p->s, NULL, 0, st) != PIE_OK) return st->code; /* gRPC health, /metrics */
    gw_http_opts ho = {
        .listen = cfg->http_listen,
        .max_connections = cfg->max_connections,
        .max_body_bytes = cfg->max_body_bytes,
        .idle_timeout_s = (unsigned)((cfg->idle_timeout_ms + 999) / 1000),
    };
    if ((p->http = gw_http_start(&ho, &p->env, svc_metrics(p->s), st)) == NULL) return st->code;
    pie_log_info("gw.started", "http_port=%d grpc_port=%d lifecycle=\"%s\" program=%s",
                 gw_http_port(p->http), svc_port(p->s), cfg->lc_address,
                 gw_lc_program_id(p->lc));
    svc_set_serving(p->s, true);
    return PIE_OK;
}

static void gw_stop(gw_parts *p) {
    gw_http_stop(p->http); /* first: no request runs after it */
    svc_drain(p->s);
    gw_chat_destroy(p->chat);
    gw_lc_destroy(p->lc);
    svc_stop(p->s);
}

int main(int argc, char **argv) {
    svc_block_signals();
    svc_args args;
    int rc = svc_parse_args(argc, argv, "pie-gateway", &args);
    if (rc) return rc == 1 ? 0 : 2;
    gw_config cfg;
    rc = svc_load_config("pie-gateway", &args, &gw_schema, &cfg);
    if (rc) return rc == 1 ? 0 : 2;
    gw_parts p = {0};
    pie_status st;
    int status = 1;
    if (gw_start(&cfg, &p, &st) != PIE_OK) {
        pie_log_error("gw.start_failed", "error=\"%s\"", st.msg);
        fprintf(stderr, "pie-gateway: %s\n", st.msg);
    } else {
        int sig = svc_wait_for_signal();
        pie_log_info("gw.signal", "signal=%d", sig);
        svc_set_serving(p.s, false);
        /* Drain: /readyz fails, no new connections, requests in flight (streams too) get up
         * to server.shutdown_grace to finish; what is left is cut by gw_stop. */
        unsigned left = gw_http_drain(p.http, cfg.svc.shutdown_grace_ms);
        pie_log_info("gw.drained", "requests_cut=%u", left);
        status = 0;
    }
    gw_stop(&p);
    pie_config_free(&gw_schema, &cfg);
    return status;
}
