/* fuzz_lc_session.c — what the controller sends a lifecycle replica: SessionDown messages
 * (welcome, call results, instance terminations, topic deliveries, lost workers, model lists,
 * dropped programs) through the replica's Session (lc_session_deliver) into its host state
 * (lc_host: results and events routed to instances — none live here, so they are orphans —
 * model snapshots) and its registry client (program_dropped).
 *
 * Input: records [len lo][len hi][SessionDown bytes]; each decodes as rpc_link would (an
 * undecodable one is skipped, as the link would end the stream). Checks: no crash, leak, UB or
 * deadlock. Seeds: gen_corpus.py. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz_util.h"
#include "lc_host.h"
#include "lc_program.h"
#include "lc_session.h"
#include "lc_store.h"
#include "lc_wasm.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_log.h"

static lc_wasm_rt *the_rt;
static char native_dir[600];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    pie_log_set_level(PIE_LOG_DEBUG);
    if (getenv("PIE_FUZZ_LOG") == NULL) pie_log_set_fd(open("/dev/null", O_WRONLY));
    snprintf(native_dir, sizeof native_dir, "%s/native", fuzz_dir());
    size_t n_fns = 0;
    const lc_wasm_host_fn *fns = lc_host_fns(&n_fns);
    lc_wasm_rt_opts ro = {.cache_dir = native_dir, .host_fns = fns, .n_host_fns = n_fns};
    pie_status st;
    if (lc_wasm_rt_create(&ro, &the_rt, &st) != PIE_OK) fuzz_fail("lc_wasm_rt_create: %s", st.msg);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pie_status st;
    lc_session_config sc = {.replica_id = "fuzz", .advertise = ""};
    lc_session *session = lc_session_create(&sc, NULL, &st);
    if (session == NULL) fuzz_fail("lc_session_create: %s", st.msg);
    lc_program_store *programs =
        lc_program_store_create(fuzz_dir(), native_dir, the_rt, 64 << 10, &st);
    if (programs == NULL) fuzz_fail("lc_program_store_create: %s", st.msg);
    lc_store_config stc = {.programs = false,
                           .max_program_bytes = 64 << 10,
                           .max_tokenizer_bytes = 1 << 20,
                           .call_timeout_ms = 1000};
    lc_store *store = lc_store_create(&stc, session, programs, NULL, &st);
    if (store == NULL) fuzz_fail("lc_store_create: %s", st.msg);
    lc_host_config hc = {
        .tokenizer_path = "", .http_allow = "", .http_timeout_ms = 1000, .http_max_bytes = 1 << 20};
    lc_host *host = lc_host_create(&hc, session, NULL, &st);
    if (host == NULL) fuzz_fail("lc_host_create: %s", st.msg);

    for (size_t at = 0; at + 2 <= size;) {
        size_t len = (size_t)data[at] | (size_t)data[at + 1] << 8;
        at += 2;
        if (len > size - at) len = size - at;
        Pie__V1__SessionDown *down = pie__v1__session_down__unpack(NULL, len, data + at);
        at += len;
        if (down) lc_session_deliver(session, down);
    }

    lc_store_stop(store);
    lc_session_destroy(session);
    lc_host_destroy(host);
    lc_store_destroy(store);
    lc_program_store_destroy(programs);
    return 0;
}
