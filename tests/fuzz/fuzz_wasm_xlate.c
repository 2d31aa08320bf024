/* fuzz_wasm_xlate.c — tier 0's own validator and translator (lc_wasm_xlate) on arbitrary bytes.
 *
 * What a module meets on its way to tcc: lc_wasm_parse with the default complexity limits (the
 * compile-bomb checks in front), then lc_wasm_xlate. Checks: no crash, leak, UB or runaway
 * time; a refusal is PIE_UNIMPLEMENTED (declined), PIE_INVALID_ARGUMENT (invalid) or
 * PIE_RESOURCE_EXHAUSTED with a message; an accepted module yields NUL-terminated C of the
 * length it says; lc_wasm_xlate_to (tcc's feed) gives the same verdict and, in pieces, the same
 * text. The oracle, when enabled: every module it accepts must be valid for wabt's
 * wasm-validate (PIE_FUZZ_WASM_VALIDATE=<path of wasm-validate>: the generated C is the
 * sandbox, so accepting an invalid module is the finding that matters), and its C must compile
 * with tcc (PIE_FUZZ_TCC=<path of tcc>). Both spawn a process per accepted input: slower, so
 * they are off by default (run.sh --smoke). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "fuzz_util.h"
#include "lc_wasm_int.h"
#include "lc_wasm_xlate.h"

static int run_tool(const char *cmd) {
    int rc = system(cmd);
    return rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc);
}

/* lc_wasm_xlate_to's sink (how tcc gets the text in the lifecycle): collects the pieces. */
typedef struct pieces {
    char *text;
    size_t len;
} pieces;

static bool pieces_write(void *user, const char *text, size_t n, pie_status *st) {
    (void)st;
    pieces *p = user;
    if (n == 0) fuzz_fail("lc_wasm_xlate_to gave an empty piece");
    char *t = realloc(p->text, p->len + n);
    if (t == NULL) fuzz_fail("out of memory");
    memcpy(t + p->len, text, n);
    p->text = t;
    p->len += n;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lc_wasm_info info;
    pie_status st, pst;
    if (lc_wasm_parse(data, size, &info, &st) != PIE_OK) return 0;
    lc_wasm_info_free(&info);
    lc_wasm_xlate_out x;
    pie_code rc = lc_wasm_xlate(data, size, "wfuzz", &x, &st);
    /* in pieces: the same verdict, and when accepted the same text */
    pieces p = {0};
    lc_wasm_xlate_sink sink = {.write = pieces_write, .user = &p};
    pie_code prc = lc_wasm_xlate_to(data, size, "wfuzz", &sink, NULL, &pst);
    if (prc != rc)
        fuzz_fail("lc_wasm_xlate_to: %s, lc_wasm_xlate: %s", pie_code_name(prc), pie_code_name(rc));
    if (rc == PIE_OK && (p.len != x.len || memcmp(p.text, x.c, x.len) != 0))
        fuzz_fail("lc_wasm_xlate_to's pieces (%zu bytes) differ from lc_wasm_xlate's text (%zu)",
                  p.len, x.len);
    free(p.text);
    if (rc != PIE_OK) {
        if (rc != PIE_UNIMPLEMENTED && rc != PIE_INVALID_ARGUMENT && rc != PIE_RESOURCE_EXHAUSTED)
            fuzz_fail("lc_wasm_xlate failed with %s", pie_code_name(rc));
        if (st.msg[0] == '\0')
            fuzz_fail("lc_wasm_xlate failed (%s) with no message", pie_code_name(rc));
        if (x.c != NULL) fuzz_fail("lc_wasm_xlate failed but returned text");
        return 0;
    }
    if (x.c == NULL || strlen(x.c) != x.len) fuzz_fail("C text not NUL-terminated at its length");
    const char *validate = getenv("PIE_FUZZ_WASM_VALIDATE"), *tcc = getenv("PIE_FUZZ_TCC");
    char path[600], cpath[600], cmd[2048];
    if (validate != NULL && validate[0] != '\0') {
        fuzz_write_file("module.wasm", data, size, path, sizeof path);
        /* custom sections (names) do not make a module invalid (core spec 1.0, 5.5.3) */
        snprintf(cmd, sizeof cmd, "'%s' --ignore-custom-section-errors '%s' >/dev/null 2>&1",
                 validate, path);
        if (run_tool(cmd) != 0)
            fuzz_fail("lc_wasm_xlate accepted a module that wasm-validate refuses (%s)", path);
    }
    if (tcc != NULL && tcc[0] != '\0') {
        fuzz_write_file("module.c", x.c, x.len, cpath, sizeof cpath);
        snprintf(cmd, sizeof cmd, "'%s' -c -o '%s.o' '%s' 2>&1 | head -5 >&2; test -s '%s.o'", tcc,
                 cpath, cpath, cpath);
        snprintf(path, sizeof path, "rm -f '%s.o'", cpath);
        (void)run_tool(path);
        if (run_tool(cmd) != 0) fuzz_fail("tcc refused the C of an accepted module (%s)", cpath);
    }
    free(x.c);
    return 0;
}
