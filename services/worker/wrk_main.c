/* wrk_main.c — pie-worker: one inference worker process (one GPU, or the CPU backend).
 *
 * Owns: the worker's configuration schema and start/stop order. Registration with the
 * controller and the pie.v1.Worker methods are in wrk_node.c. */
#include <stdio.h>
#include <stdlib.h>

#include "pie_log.h"
#include "svc.h"
#include "wrk_node.h"

typedef struct wrk_config {
    svc_config svc;
    svc_dial_config dial;         /* controller.* */
    char *group_id;               /* worker.group_id */
    char *advertise;              /* worker.advertise */
    char *model_name;             /* model.name */
    char *model_description;      /* model.description */
    uint32_t kv_page_size;        /* pool.kv_page_size */
    uint32_t kv_pages;            /* pool.kv_pages */
    uint32_t embed_slots;         /* pool.embed_slots */
    uint32_t max_batch_tokens;    /* batch.max_tokens */
    uint32_t max_batch_items;     /* batch.max_items */
} wrk_config;

static const pie_config_field wrk_fields[] = {
    SVC_CONFIG_FIELDS(wrk_config, "0.0.0.0:50053", "0.0.0.0:9093"),
    SVC_DIAL_FIELDS(wrk_config, dial),
    {"worker.group_id", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, group_id), .def = "",
     .doc = "name of this worker group in status and logs (empty = <hostname>:<grpc port>)"},
    {"worker.advertise", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, advertise), .def = "",
     .doc = "host:port at which others reach this worker's gRPC service (empty = unknown)"},
    {"model.name", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, model_name), .def = "tiny",
     .doc = "name under which the model is served (inferlets ask for it by this name)"},
    {"model.description", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, model_description),
     .def = "", .doc = "free text shown by ListModels"},
    {"pool.kv_page_size", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, kv_page_size), .def = "16",
     .min = "1", .max = "1024", .doc = "tokens per KV page"},
    {"pool.kv_pages", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, kv_pages), .def = "1024",
     .min = "1", .max = "16777216", .doc = "KV pages in the worker's pool"},
    {"pool.embed_slots", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, embed_slots), .def = "4096",
     .min = "1", .max = "16777216", .doc = "embedding slots in the worker's pool"},
    {"batch.max_tokens", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, max_batch_tokens),
     .def = "4096", .min = "1", .max = "1048576", .doc = "most input tokens in one forward batch"},
    {"batch.max_items", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, max_batch_items), .def = "256",
     .min = "1", .max = "65536", .doc = "most items in one batch of any kind"},
};
static const pie_config_schema wrk_schema = PIE_CONFIG_SCHEMA(wrk_config, wrk_fields);

int main(int argc, char **argv) {
    svc_block_signals();
    svc_args args;
    int rc = svc_parse_args(argc, argv, "pie-worker", &args);
    if (rc) return rc == 1 ? 0 : 2;
    wrk_config cfg;
    rc = svc_load_config("pie-worker", &args, &wrk_schema, &cfg);
    if (rc) return rc == 1 ? 0 : 2;

    int status = 1;
    pie_status st;
    wrk_node *node = NULL;
    svc *s = svc_create("worker", &cfg.svc, &st);
    if (s == NULL) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    wrk_node_config nc = {
        .group_id = cfg.group_id,
        .model_name = cfg.model_name,
        .model_description = cfg.model_description ? cfg.model_description : "",
        .kv_page_size = cfg.kv_page_size,
        .kv_pages = cfg.kv_pages,
        .embed_slots = cfg.embed_slots,
        .max_batch_tokens = cfg.max_batch_tokens,
        .max_batch_items = cfg.max_batch_items,
        .advertise = cfg.advertise ? cfg.advertise : "",
    };
    node = wrk_node_create(&nc, svc_metrics(s), &st);
    if (node == NULL) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    size_t n_methods;
    const rpc_method *methods = wrk_node_methods(node, &n_methods);
    if (svc_serve(s, methods, n_methods, &st) != PIE_OK) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    if (wrk_node_link_start(node, s, &cfg.dial, &st) != PIE_OK) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    svc_add_health(s, "pie.v1.Worker");
    svc_set_serving(s, true);
    int sig = svc_wait_for_signal();
    pie_log_info("wrk.signal", "signal=%d", sig);
    svc_set_serving(s, false);
    status = 0;
done:
    svc_stop(s);
    wrk_node_destroy(node); /* closes the controller link: the worker leaves the cluster */
    pie_config_free(&wrk_schema, &cfg);
    return status;
}
