/* fuzz_lc_session.c — what the controller sends a lifecycle replica: SessionDown messages
 * (welcome, call results, instance terminations, topic deliveries, lost workers, model lists,
 * dropped programs) through the replica's Session (lc_session_deliver) into its host state
 * (lc_host: results and events routed to instances — none live here, so they are orphans —
 * model snapshots) and its registry client (program_dropped).
 *
 * Input: records [len lo][len hi][SessionDown bytes]; each decodes as rpc_link would (an
 * undecodable one is skipped, as the link would end the stream). Checks: no crash, leak, UB or
 * deadlock. Seeds: gen_corpus.py. */
#include <stdint.h>

#include "fuzz_lc.h"
#include "pie/v1/controller.pb-c.h"

static lc_wasm_rt *the_rt;
static char native_dir[600];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    the_rt = fuzz_lc_runtime(native_dir, sizeof native_dir);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_lc p;
    fuzz_lc_open(&p, the_rt, native_dir);

    for (size_t at = 0; at + 2 <= size;) {
        size_t len = (size_t)data[at] | (size_t)data[at + 1] << 8;
        at += 2;
        if (len > size - at) len = size - at;
        Pie__V1__SessionDown *down = pie__v1__session_down__unpack(NULL, len, data + at);
        at += len;
        if (down) lc_session_deliver(p.session, down);
    }

    fuzz_lc_close(&p);
    return 0;
}
