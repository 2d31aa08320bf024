/* fuzz_rpc_health.c — the request message of grpc.health.v1.Health (Check, Watch), the one
 * service every Pie-C server answers without a token.
 *
 * The RPC layer's own health service (services/common/rpc/rpc_health.c, as rpc_server.c
 * registers it) with "" SERVING and "pie.v1.Lifecycle" NOT_SERVING, driven by fuzz_rpc.h's
 * stand-in for the gRPC server (record format there). Watch streams stay open until the
 * client cancels; records with op 7 set a service's status in between (set_status). Checks: no
 * crash, leak or UB; fuzz_rpc.h's checks on every handler. Seeds: gen_corpus.py. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_rpc.h"
#include "fuzz_util.h"
#include "pie_log.h"
#include "rpc_internal.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    pie_log_set_level(PIE_LOG_DEBUG);
    if (getenv("PIE_FUZZ_LOG") == NULL) pie_log_set_fd(open("/dev/null", O_WRONLY));
    return 0;
}

/* op 7 (fz_rpc_on_event): payload[0] % 4 is the new status of the service named by the rest
 * (RPC_HEALTH_SERVICE_UNKNOWN removes it); every watcher of it is sent the change. */
static void set_status(void *user, const uint8_t *p, size_t n) {
    if (n == 0 || memchr(p, 0, n) != NULL) return;
    char service[256];
    size_t len = n - 1 < sizeof service - 1 ? n - 1 : sizeof service - 1;
    memcpy(service, p + 1, len);
    service[len] = '\0';
    pie_status st;
    rpc__health_set(user, service, (rpc_health_status)(p[0] % 4), &st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rpc_health *h = rpc__health_create(false);
    if (h == NULL) fuzz_fail("rpc__health_create failed");
    pie_status st;
    if (rpc__health_set(h, "", RPC_HEALTH_SERVING, &st) != PIE_OK ||
        rpc__health_set(h, "pie.v1.Lifecycle", RPC_HEALTH_NOT_SERVING, &st) != PIE_OK)
        fuzz_fail("rpc__health_set: %s", st.msg);
    rpc_method methods[2];
    rpc__health_methods(h, false, methods);
    fz_rpc *f = fz_rpc_create(methods, 2);
    fz_rpc_on_event(f, set_status, h);
    fz_rpc_feed(f, data, size);
    rpc__health_shutdown(h);
    fz_rpc_destroy(f);
    rpc__health_destroy(h);
    return 0;
}
