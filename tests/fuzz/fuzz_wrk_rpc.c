/* fuzz_wrk_rpc.c — every request message of pie.v1.Worker (Info, TpJoin) through its handler.
 *
 * The worker's real method table (wrk_node_methods) over a wrk_node that is still loading
 * (Info then reports LOADING; no model is needed), driven by fuzz_rpc.h's stand-in for the
 * gRPC server (record format there; requests decoded as rpc_server.c decodes them). The
 * worker's other input, the controller's WorkerDown steps, is fuzz_wrk_exec's. Checks: no
 * crash, leak or UB; fuzz_rpc.h's checks on every handler. Seeds: gen_corpus.py. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>

#include "fuzz_rpc.h"
#include "fuzz_util.h"
#include "pie_log.h"
#include "eng.h"
#include "wrk_node.h"

/* The memory policy's runtime (wrk_memrt.c) asks the cpu engine for its swap and offload state; a node that
 * is still loading has no engine, so these are never reached here. Stand-ins rather than the
 * engine library: its SIMD kernels do not build with the fuzz build's clang. */
pie_code eng_swap_set_slots(eng *e, uint32_t slots, uint32_t *applied, pie_status *st) {
    (void)e, (void)slots, (void)applied, (void)st;
    fuzz_fail("eng_swap_set_slots reached without an engine");
}
void eng_swap_get_stats(eng *e, eng_swap_stats *out) {
    (void)e, (void)out;
    fuzz_fail("eng_swap_get_stats reached without an engine");
}
void eng_offload_get_stats(eng *e, eng_offload_stats *out) {
    (void)e, (void)out;
    fuzz_fail("eng_offload_get_stats reached without an engine");
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    pie_log_set_level(PIE_LOG_DEBUG);
    if (getenv("PIE_FUZZ_LOG") == NULL) pie_log_set_fd(open("/dev/null", O_WRONLY));
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    wrk_node_config cfg = {.group_id = "fuzz", .advertise = "127.0.0.1:1", .credits = 2};
    pie_status st;
    wrk_node *w = wrk_node_create(&cfg, NULL, &st);
    if (w == NULL) fuzz_fail("wrk_node_create: %s", st.msg);
    size_t n = 0;
    const rpc_method *methods = wrk_node_methods(w, &n);
    fz_rpc *f = fz_rpc_create(methods, n);
    fz_rpc_feed(f, data, size);
    fz_rpc_destroy(f);
    wrk_node_destroy(w);
    return 0;
}
