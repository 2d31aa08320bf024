/* fuzz_lc.h — what the lifecycle harnesses (fuzz_lc_rpc.c, fuzz_lc_session.c) share: the
 * process-wide WebAssembly runtime and the parts of a replica wired as lc_main.c wires them
 * (Session never started, no controller, no registry). */
#ifndef FUZZ_LC_H
#define FUZZ_LC_H

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz_util.h"
#include "lc_host.h"
#include "lc_program.h"
#include "lc_session.h"
#include "lc_store.h"
#include "lc_wasm.h"
#include "pie_log.h"

/* Logs to /dev/null unless PIE_FUZZ_LOG is set; the runtime caches compiled code under
 * native_dir (cap bytes), in the harness's directory. */
static inline lc_wasm_rt *fuzz_lc_runtime(char *native_dir, size_t cap) {
    pie_log_set_level(PIE_LOG_DEBUG);
    if (getenv("PIE_FUZZ_LOG") == NULL) pie_log_set_fd(open("/dev/null", O_WRONLY));
    snprintf(native_dir, cap, "%s/native", fuzz_dir());
    size_t n_fns = 0;
    const lc_wasm_host_fn *fns = lc_host_fns(&n_fns);
    lc_wasm_rt_opts ro = {.cache_dir = native_dir, .host_fns = fns, .n_host_fns = n_fns};
    lc_wasm_rt *rt;
    pie_status st;
    if (lc_wasm_rt_create(&ro, &rt, &st) != PIE_OK) fuzz_fail("lc_wasm_rt_create: %s", st.msg);
    return rt;
}

typedef struct fuzz_lc {
    lc_session *session;
    lc_program_store *programs;
    lc_store *store;
    lc_host *host;
} fuzz_lc;

static inline void fuzz_lc_open(fuzz_lc *p, lc_wasm_rt *rt, const char *native_dir) {
    pie_status st;
    lc_session_config sc = {.replica_id = "fuzz", .advertise = ""};
    if ((p->session = lc_session_create(&sc, NULL, &st)) == NULL)
        fuzz_fail("lc_session_create: %s", st.msg);
    p->programs = lc_program_store_create(fuzz_dir(), native_dir, rt, 64 << 10, &st);
    if (p->programs == NULL) fuzz_fail("lc_program_store_create: %s", st.msg);
    lc_store_config stc = {.programs = false,
                           .max_program_bytes = 64 << 10,
                           .max_tokenizer_bytes = 1 << 20,
                           .call_timeout_ms = 1000};
    if ((p->store = lc_store_create(&stc, p->session, p->programs, NULL, &st)) == NULL)
        fuzz_fail("lc_store_create: %s", st.msg);
    lc_host_config hc = {
        .tokenizer_path = "", .http_allow = "", .http_timeout_ms = 1000, .http_max_bytes = 1 << 20};
    if ((p->host = lc_host_create(&hc, p->session, NULL, &st)) == NULL)
        fuzz_fail("lc_host_create: %s", st.msg);
}

/* lc_main.c's stop order for these parts (after whatever was built on them is gone). */
static inline void fuzz_lc_close(fuzz_lc *p) {
    lc_store_stop(p->store);
    lc_session_destroy(p->session);
    lc_host_destroy(p->host);
    lc_store_destroy(p->store);
    lc_program_store_destroy(p->programs);
}

#endif
