/* fuzz_lc_rpc.c — every request message of pie.v1.Lifecycle (the public API) through its
 * handler.
 *
 * The replica's real method table (lc_api_methods: UploadProgram, ListPrograms, DeleteProgram,
 * Launch, Terminate, ListInstances, Attach, Run, and the Session's ListModels) over real parts
 * wired as lc_main.c wires them — program store, instance manager, host, registry client,
 * Session — driven by fuzz_rpc.h's stand-in for the gRPC server (record format there), which
 * decodes each request as rpc_server.c does and calls the same callbacks. The Session is never
 * started (no controller): launches get as far as the lifecycle's own checks (program, model,
 * arguments, limits) and then UNAVAILABLE, so no inferlet runs. Uploads are assembled,
 * checked and handed to the program store (validated by the wasm parser; a module that parses
 * would be compiled, once per content, into a cache shared by the process).
 * Checks: no crash, leak, UB or deadlock; fuzz_rpc.h's checks on every handler. Seeds:
 * gen_corpus.py. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz_lc.h"
#include "fuzz_rpc.h"
#include "lc_api.h"
#include "lc_inst.h"

static lc_wasm_rt *the_rt;
static char native_dir[600];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    the_rt = fuzz_lc_runtime(native_dir, sizeof native_dir);
    pie_status st;
    /* One stored program (compiled once), so that launches get past "not stored": the seeds
     * launch it by its id (gen_corpus.py: TRIVIAL_SHA). */
    lc_program_store *ps = lc_program_store_create(fuzz_dir(), native_dir, the_rt, 64 << 10, &st);
    if (ps == NULL) fuzz_fail("lc_program_store_create: %s", st.msg);
    size_t len = 0;
    char *wasm = fuzz_read_file(PIE_SOURCE_DIR "/tests/fuzz/corpus/wasm_parse/trivial.wasm", &len);
    char id[65];
    bool already = false;
    if (lc_program_put(ps, (const uint8_t *)wasm, len, NULL, "trivial", NULL, id, &already, &st) !=
        PIE_OK)
        fuzz_fail("storing trivial.wasm: %s", st.msg);
    free(wasm);
    lc_program_store_destroy(ps);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pie_status st;
    fuzz_lc p;
    fuzz_lc_open(&p, the_rt, native_dir);
    lc_limits lim = {.memory_bytes = 64 << 20,
                     .kv_pages = 64,
                     .embeddings = 256,
                     .queues = 8,
                     .message_bytes = 1 << 16,
                     .cpu_ms = 1000,
                     .wall_ms = 5000};
    lc_inst_config ic = {.defaults = lim,
                         .maxima = lim,
                         .output_buffer_bytes = 1 << 16,
                         .retention_ms = 1000,
                         .retention_max = 16,
                         .thread_stack_bytes = 1 << 20};
    lc_inst_mgr *insts = lc_inst_mgr_create(&ic, p.programs, p.host, p.session, &st);
    if (insts == NULL) fuzz_fail("lc_inst_mgr_create: %s", st.msg);
    lc_api *api = lc_api_create(p.programs, insts, p.session, p.store, &st);
    if (api == NULL) fuzz_fail("lc_api_create: %s", st.msg);

    size_t n = 0;
    const rpc_method *methods = lc_api_methods(api, &n);
    fz_rpc *f = fz_rpc_create(methods, n);
    fz_rpc_feed(f, data, size);

    /* lc_main.c's stop order. */
    lc_inst_mgr_stop(insts);
    lc_api_destroy(api);
    fz_rpc_destroy(f);
    lc_inst_mgr_destroy(insts);
    fuzz_lc_close(&p);
    return 0;
}
