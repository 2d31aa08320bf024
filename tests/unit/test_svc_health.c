/* test_svc_health.c — the service frame's health (services/common/svc): overall serving, named
 * services that follow it, and a named service that is not ready while the server serves
 * (svc_set_health_ready: the lifecycle's readiness), also after the server is gone. */
#include <criterion/criterion.h>

#include <stdio.h>

#include "pie_log.h"
#include "rpc.h"
#include "svc.h"

typedef struct fixture {
    svc_config cfg;
    svc *s;
    rpc_channel *ch;
} fixture;

static void start(fixture *f) {
    f->cfg = (svc_config){.listen = "127.0.0.1:0",
                          .threads = 1,
                          .max_message_bytes = 4u << 20,
                          .shutdown_grace_ms = 100,
                          .auth_token = "",
                          .auth_token_file = "",
                          .metrics_listen = "",
                          .log_level = PIE_LOG_WARN};
    pie_status st;
    f->s = svc_create("test", &f->cfg, &st);
    cr_assert(f->s, "%s", st.msg);
    cr_assert_eq(svc_serve(f->s, NULL, 0, &st), PIE_OK, "%s", st.msg);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", svc_port(f->s));
    f->ch = rpc_channel_create(addr, NULL, &st);
    cr_assert(f->ch, "%s", st.msg);
}

static rpc_health_status health(fixture *f, const char *service) {
    pie_status st;
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    cr_assert_eq(rpc_health_check(f->ch, service, 5000, &hs, &st), PIE_OK, "'%s': %s", service,
                 st.msg);
    return hs;
}

Test(svc_health, a_named_service_is_serving_only_while_the_server_serves_and_it_is_ready) {
    fixture f;
    start(&f);
    svc_add_health(f.s, "test.Api");
    cr_assert_eq(health(&f, ""), RPC_HEALTH_NOT_SERVING, "not serving before svc_set_serving");
    cr_assert_eq(health(&f, "test.Api"), RPC_HEALTH_NOT_SERVING);

    svc_set_health_ready(f.s, "test.Api", false); /* e.g. no controller yet */
    svc_set_serving(f.s, true);
    cr_assert_eq(health(&f, ""), RPC_HEALTH_SERVING, "liveness does not follow readiness");
    cr_assert_eq(health(&f, "test.Api"), RPC_HEALTH_NOT_SERVING, "serving but not ready");

    svc_set_health_ready(f.s, "test.Api", true);
    cr_assert_eq(health(&f, "test.Api"), RPC_HEALTH_SERVING);
    svc_set_health_ready(f.s, "test.Api", false);
    cr_assert_eq(health(&f, "test.Api"), RPC_HEALTH_NOT_SERVING, "readiness can be withdrawn");
    svc_set_health_ready(f.s, "test.Api", true);

    svc_set_serving(f.s, false); /* draining: everything NOT_SERVING, ready or not */
    cr_assert_eq(health(&f, ""), RPC_HEALTH_NOT_SERVING);
    cr_assert_eq(health(&f, "test.Api"), RPC_HEALTH_NOT_SERVING);
    svc_set_health_ready(f.s, "no.Such", true); /* an unregistered name: ignored */

    rpc_channel_destroy(f.ch);
    svc_drain(f.s);
    /* a service thread (the lifecycle's Session) may still report readiness: no effect */
    svc_set_health_ready(f.s, "test.Api", false);
    svc_set_serving(f.s, false);
    svc_stop(f.s);
}
