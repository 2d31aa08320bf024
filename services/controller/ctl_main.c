/* ctl_main.c — pie-controller: the control layer's process.
 *
 * Owns: the controller's configuration schema and start/stop order. The cluster registry and
 * the pie.v1.Controller methods are in ctl_cluster.c. */
#include <stdio.h>
#include <stdlib.h>

#include "ctl_cluster.h"
#include "pie_log.h"
#include "svc.h"

typedef struct ctl_config {
    svc_config svc;
} ctl_config;

static const pie_config_field ctl_fields[] = {
    SVC_CONFIG_FIELDS(ctl_config, "0.0.0.0:50052", "0.0.0.0:9092"),
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
    cluster = ctl_cluster_create(svc_metrics(s));
    if (cluster == NULL) {
        fprintf(stderr, "pie-controller: out of memory\n");
        goto done;
    }
    size_t n_methods;
    const rpc_method *methods = ctl_cluster_methods(cluster, &n_methods);
    if (svc_serve(s, methods, n_methods, &st) != PIE_OK) {
        pie_log_error("ctl.start_failed", "error=\"%s\"", st.msg);
        fprintf(stderr, "pie-controller: %s\n", st.msg);
        goto done;
    }
    svc_add_health(s, "pie.v1.Controller");
    svc_set_serving(s, true);
    int sig = svc_wait_for_signal();
    pie_log_info("ctl.signal", "signal=%d", sig);
    svc_set_serving(s, false);
    status = 0;
done:
    svc_stop(s); /* server first: no callback runs after it */
    ctl_cluster_destroy(cluster);
    pie_config_free(&ctl_schema, &cfg);
    return status;
}
