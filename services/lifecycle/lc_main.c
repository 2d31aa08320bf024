/* lc_main.c — pie-lifecycle: the application layer's process (public API, inferlet runtime).
 *
 * Owns: the lifecycle's configuration schema and start/stop order. The Session with the
 * controller and the implemented pie.v1.Lifecycle methods are in lc_session.c. */
#include <stdio.h>
#include <stdlib.h>

#include "lc_session.h"
#include "pie_log.h"
#include "svc.h"

typedef struct lc_config {
    svc_config svc;
    svc_dial_config dial;         /* controller.* */
    char *replica_id;             /* replica.id */
    char *advertise;              /* replica.advertise */
} lc_config;

static const pie_config_field lc_fields[] = {
    SVC_CONFIG_FIELDS(lc_config, "0.0.0.0:50051", "0.0.0.0:9091"),
    SVC_DIAL_FIELDS(lc_config, dial),
    {"replica.id", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, replica_id), .def = "",
     .doc = "name of this replica in status and logs (empty = <hostname>:<grpc port>)"},
    {"replica.advertise", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, advertise), .def = "",
     .doc = "host:port at which clients reach this replica (empty = unknown)"},
};
static const pie_config_schema lc_schema = PIE_CONFIG_SCHEMA(lc_config, lc_fields);

int main(int argc, char **argv) {
    svc_block_signals();
    svc_args args;
    int rc = svc_parse_args(argc, argv, "pie-lifecycle", &args);
    if (rc) return rc == 1 ? 0 : 2;
    lc_config cfg;
    rc = svc_load_config("pie-lifecycle", &args, &lc_schema, &cfg);
    if (rc) return rc == 1 ? 0 : 2;

    int status = 1;
    pie_status st;
    lc_session *session = NULL;
    svc *s = svc_create("lifecycle", &cfg.svc, &st);
    if (s == NULL) {
        fprintf(stderr, "pie-lifecycle: %s\n", st.msg);
        goto done;
    }
    lc_session_config sc = {
        .replica_id = cfg.replica_id ? cfg.replica_id : "",
        .advertise = cfg.advertise ? cfg.advertise : "",
    };
    session = lc_session_create(&sc, svc_metrics(s), &st);
    if (session == NULL) {
        fprintf(stderr, "pie-lifecycle: %s\n", st.msg);
        goto done;
    }
    size_t n_methods;
    const rpc_method *methods = lc_session_methods(session, &n_methods);
    if (svc_serve(s, methods, n_methods, &st) != PIE_OK ||
        lc_session_start(session, s, &cfg.dial, &st) != PIE_OK) {
        fprintf(stderr, "pie-lifecycle: %s\n", st.msg);
        goto done;
    }
    svc_add_health(s, "pie.v1.Lifecycle");
    svc_set_serving(s, true);
    int sig = svc_wait_for_signal();
    pie_log_info("lc.signal", "signal=%d", sig);
    svc_set_serving(s, false);
    status = 0;
done:
    svc_drain(s); /* server first: no callback runs after it */
    lc_session_destroy(session); /* closes the Session: the controller forgets this replica */
    svc_stop(s); /* last: threads stopped above may update its metrics */
    pie_config_free(&lc_schema, &cfg);
    return status;
}
