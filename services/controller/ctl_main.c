/* ctl_main.c — pie-controller: the control layer's process.
 *
 * Owns: the controller's configuration schema and start/stop order. The control layer itself is
 * ctl_core (ctl_core.h); its gRPC face is ctl_cluster.c. */
#include <stdio.h>
#include <stdlib.h>

#include "ctl_cluster.h"
#include "pie_log.h"
#include "svc.h"

typedef struct ctl_config {
    svc_config svc;
    int strategy;              /* scheduler.strategy: ctl_strategy */
    uint32_t k;                /* scheduler.k */
    uint64_t t_us;             /* scheduler.t */
    int64_t k_timeout_ms;      /* scheduler.k_timeout */
    uint32_t max_step_batches; /* scheduler.max_step_batches */
    int contention;            /* contention.policy: ctl_contention */
    int64_t heartbeat_ms;      /* worker.heartbeat */
    uint32_t export_max_pages; /* exports.max_pages */
    int64_t export_ttl_ms;     /* exports.ttl */
    double export_pool_share;  /* exports.max_pool_share */
    uint64_t registry_bytes;   /* programs.registry_size */
    uint64_t program_max;      /* programs.max_size */
    uint64_t send_queue_bytes; /* streams.send_queue */
    uint32_t send_queue_msgs;  /* streams.send_queue_messages */
} ctl_config;

static const pie_config_field ctl_fields[] = {
    SVC_CONFIG_FIELDS(ctl_config, "0.0.0.0:50052", "0.0.0.0:9092"),
    {"scheduler.strategy", PIE_CFG_ENUM, PIE_CONFIG_AT(ctl_config, strategy),
     .def = "work_conserving", .choices = ctl_strategy_names,
     .doc = "when a batch is sent: work_conserving (when the worker is idle), eager (each call "
            "alone, at once), k_only (batches of k queues, once k wait), t_only (once the "
            "oldest call waited t); work_conserving keeps at most two steps on a worker, the "
            "others send while it is busy as far as its credits allow"},
    {"scheduler.k", PIE_CFG_UINT, PIE_CONFIG_AT(ctl_config, k), .def = "8", .min = "1",
     .max = "65536",
     .doc = "k_only: queues with a call of one kind that fire a batch, and the most queues "
            "one batch holds"},
    {"scheduler.t", PIE_CFG_UINT, PIE_CONFIG_AT(ctl_config, t_us), .def = "1000", .min = "1",
     .max = "10000000",
     .doc = "t_only: microseconds the oldest call of a kind waits before it fires"},
    {"scheduler.k_timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(ctl_config, k_timeout_ms),
     .def = "50ms", .min = "1ms", .max = "1m",
     .doc = "k_only: fire with fewer than k queues once the oldest call waited this long"},
    {"scheduler.max_step_batches", PIE_CFG_UINT, PIE_CONFIG_AT(ctl_config, max_step_batches),
     .def = "32", .min = "1", .max = "4096",
     .doc = "most batches in one scheduling step (one WorkerDown message)"},
    {"contention.policy", PIE_CFG_ENUM, PIE_CONFIG_AT(ctl_config, contention), .def = "kill_newest",
     .choices = ctl_contention_names,
     .doc = "when KV pages run out: kill_newest (terminate the newest later instance holding "
            "pages, FCFS; another tenant's only while that tenant holds at least as many pages "
            "on the worker as the requester's would) or fail_call (the allocation fails "
            "RESOURCE_EXHAUSTED)"},
    {"exports.max_pages", PIE_CFG_UINT, PIE_CONFIG_AT(ctl_config, export_max_pages), .def = "1024",
     .doc = "KV pages a tenant's persistent exports may hold, cluster-wide (a tenant file's "
            "export_pages overrides it; 0 = no limit)"},
    {"exports.max_pool_share", PIE_CFG_DOUBLE, PIE_CONFIG_AT(ctl_config, export_pool_share),
     .def = "0.25", .min = "0", .max = "1",
     .doc = "share of a worker's KV pages one tenant's persistent exports may hold (0 = no "
            "limit): persistent exports never pin a pool"},
    {"exports.ttl", PIE_CFG_DURATION, PIE_CONFIG_AT(ctl_config, export_ttl_ms), .def = "0",
     .max = "8760h",
     .doc = "a persistent export neither exported nor imported for this long is removed "
            "(0 = never)"},
    {"worker.heartbeat", PIE_CFG_DURATION, PIE_CONFIG_AT(ctl_config, heartbeat_ms), .def = "1s",
     .min = "10ms", .max = "1m",
     .doc = "stats interval asked of workers; a worker silent for 3 intervals is dropped"},
    {"programs.registry_size", PIE_CFG_SIZE, PIE_CONFIG_AT(ctl_config, registry_bytes),
     .def = "256MiB", .min = "1KiB", .max = "64GiB",
     .doc = "memory for the program registry lifecycle replicas share (uploaded programs, "
            "fetched by replicas that lack them); beyond it programs nobody holds are evicted, "
            "then those of the tenant holding the most, least recently used first"},
    {"programs.max_size", PIE_CFG_SIZE, PIE_CONFIG_AT(ctl_config, program_max), .def = "64MiB",
     .min = "1KiB", .max = "1GiB",
     .doc = "largest program the registry accepts (keep it >= the lifecycles' programs.max_size)"},
    {"streams.send_queue", PIE_CFG_SIZE, PIE_CONFIG_AT(ctl_config, send_queue_bytes),
     .def = "256MiB", .min = "64KiB", .max = "64GiB",
     .doc = "bytes of results and batches one Session or WorkerLink stream may have waiting "
            "for its peer to read; a peer that falls this far behind has its stream ended with "
            "UNAVAILABLE (its instances or steps fail at once, naming the queue) instead of "
            "growing the controller's memory"},
    {"streams.send_queue_messages", PIE_CFG_UINT, PIE_CONFIG_AT(ctl_config, send_queue_msgs),
     .def = "65536", .min = "16", .max = "16777216",
     .doc = "messages one Session or WorkerLink stream may have waiting for its peer, as "
            "streams.send_queue"},
};
static const pie_config_schema ctl_schema = PIE_CONFIG_SCHEMA(ctl_config, ctl_fields);

int main(int argc, char **argv) {
    svc_block_signals();
    svc_args args;
    int rc = svc_parse_args(argc, argv, "pie-controller", &args);
    if (rc) return rc == 1 ? 0 : 2;
    ctl_config cfg;
    rc = svc_load_config("pie-controller", &args, &ctl_schema, &cfg);
    if (rc) return rc == 1 ? 0 : 2;

    int status = 1;
    pie_status st;
    svc *s = NULL;
    ctl_cluster *cluster = NULL;
    s = svc_create("controller", &cfg.svc, &st);
    if (s == NULL) {
        fprintf(stderr, "pie-controller: %s\n", st.msg);
        goto done;
    }
    ctl_cluster_config cc = {
        .core =
            {
                .sched =
                    {
                        .strategy = (ctl_strategy)cfg.strategy,
                        .k = cfg.k,
                        .t_ns = (int64_t)cfg.t_us * 1000,
                        .k_timeout_ns = cfg.k_timeout_ms * 1000000,
                        .max_step_batches = cfg.max_step_batches,
                    },
                .contention = (ctl_contention)cfg.contention,
                .heartbeat_ms = (uint32_t)cfg.heartbeat_ms,
                .max_message_bytes = cfg.svc.max_message_bytes,
                .export_max_pages = cfg.export_max_pages,
                .export_ttl_ms = cfg.export_ttl_ms,
                .export_pool_share = cfg.export_pool_share,
            },
        .registry_bytes = cfg.registry_bytes,
        .program_max_bytes = cfg.program_max,
    };
    cluster = ctl_cluster_create(&cc, svc_metrics(s), &st);
    if (cluster == NULL) {
        fprintf(stderr, "pie-controller: %s\n", st.msg);
        goto done;
    }
    size_t n_methods;
    const rpc_method *methods = ctl_cluster_methods(cluster, &n_methods);
    /* The core sends under its one lock and must not wait for any peer (ctl_cluster.c,
     * send_checked): its streams' queues are bounded instead. */
    svc_set_send_queue(s, cfg.send_queue_msgs, cfg.send_queue_bytes);
    if (svc_serve(s, methods, n_methods, &st) != PIE_OK) {
        pie_log_error("ctl.start_failed", "error=\"%s\"", st.msg);
        fprintf(stderr, "pie-controller: %s\n", st.msg);
        goto done;
    }
    pie_log_info("ctl.config",
                 "strategy=%s k=%u t_us=%llu contention=%s heartbeat_ms=%lld "
                 "registry_bytes=%llu",
                 ctl_strategy_names[cfg.strategy], cfg.k, (unsigned long long)cfg.t_us,
                 ctl_contention_names[cfg.contention], (long long)cfg.heartbeat_ms,
                 (unsigned long long)cfg.registry_bytes);
    svc_add_health(s, "pie.v1.Controller");
    svc_set_serving(s, true);
    int sig = svc_wait_for_signal();
    pie_log_info("ctl.signal", "signal=%d", sig);
    svc_set_serving(s, false);
    /* Workers finish the steps they hold (their results still reach the replicas), then stay
     * idle until the stream ends and dial the next controller. */
    int64_t t0 = rpc_now_ns();
    uint32_t left =
        ctl_cluster_drain(cluster, "controller shutting down", cfg.svc.shutdown_grace_ms);
    pie_log_info("ctl.drained", "steps_unanswered=%u ms=%lld", left,
                 (long long)((rpc_now_ns() - t0) / 1000000));
    status = 0;
done:
    svc_drain(s); /* server first: no callback runs after it */
    ctl_cluster_destroy(cluster);
    svc_stop(s); /* last: threads stopped above may update its metrics */
    pie_config_free(&ctl_schema, &cfg);
    return status;
}
