/* fuzz_ctl_rpc.c — every request message of pie.v1.Controller through its handler.
 *
 * The controller's real method table (ctl_cluster_methods: Session, WorkerLink, ClusterStatus,
 * GetTokenizer, PutProgram, GetProgram, DropProgram) over a real ctl_cluster (core, registry,
 * timer thread), driven by fuzz_rpc.h's stand-in for the gRPC server: each input is a
 * sequence of calls and stream messages (record format in fuzz_rpc.h), decoded exactly as
 * rpc_server.c decodes them and handed to the same callbacks. A Session's first SessionUp is
 * the replica's hello and a WorkerLink's first WorkerUp its registration (tokenizer hashed and
 * stored); later messages are instance begins/ends and API calls validated by the core (and,
 * with a worker registered, turned into batches), worker credits, capacity and batch results.
 * Checks: no crash, leak, UB or deadlock; fuzz_rpc.h's checks on every handler. Seeds:
 * gen_corpus.py. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>

#include "ctl_cluster.h"
#include "fuzz_rpc.h"
#include "fuzz_util.h"
#include "pie_log.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    /* Every log line is formatted (fuzzed names go through pie_log) and thrown away, unless
     * PIE_FUZZ_LOG is set (reading what one input did). */
    pie_log_set_level(PIE_LOG_DEBUG);
    if (getenv("PIE_FUZZ_LOG") == NULL) pie_log_set_fd(open("/dev/null", O_WRONLY));
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ctl_cluster_config cfg = {
        .core = {.sched = {.strategy = CTL_STRATEGY_WORK_CONSERVING,
                           .k = 2,
                           .t_ns = 1000000,
                           .k_timeout_ns = 5000000,
                           .max_step_batches = 32},
                 .contention = CTL_CONTENTION_KILL_NEWEST,
                 .heartbeat_ms = 60000,
                 .max_message_bytes = 1 << 20},
        .registry_bytes = 1 << 20,
        .program_max_bytes = 64 << 10,
    };
    pie_status st;
    ctl_cluster *c = ctl_cluster_create(&cfg, NULL, &st);
    if (c == NULL) fuzz_fail("ctl_cluster_create: %s", st.msg);
    size_t n = 0;
    const rpc_method *methods = ctl_cluster_methods(c, &n);
    fz_rpc *f = fz_rpc_create(methods, n);
    fz_rpc_feed(f, data, size);
    ctl_cluster_destroy(c);
    fz_rpc_destroy(f);
    return 0;
}
