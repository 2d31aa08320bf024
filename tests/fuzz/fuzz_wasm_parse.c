/* fuzz_wasm_parse.c — the lifecycle's wasm parser and import validator on arbitrary bytes.
 *
 * What lc_wasm_module_load runs on an uploaded program before wasm2c ever sees it:
 * lc_wasm_parse (magic, version, section bounds, import and export kinds, `_start`), then
 * lc_wasm_check_imports against the real host table (lc_host_fns: every `pie` function, and
 * WASI preview1). Checks: no crash, leak or UB; a failure says why (non-empty message);
 * success yields an import list consistent with its flags, each import with a type rendered
 * as WAT ("" or "(param ...)"/"(result ...)"; v128 and reference types included, which the
 * host table never uses, so lc_wasm_type_is_canonical does not apply). */
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"
#include "lc_host.h"
#include "lc_wasm_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t n_fns = 0;
    const lc_wasm_host_fn *fns = lc_host_fns(&n_fns);
    lc_wasm_info info;
    memset(&info, 0, sizeof info);
    pie_status st;
    pie_code rc = lc_wasm_parse(data, size, &info, &st);
    if (rc != PIE_OK) {
        if (st.msg[0] == '\0')
            fuzz_fail("lc_wasm_parse failed (%s) with no message", pie_code_name(rc));
        lc_wasm_info_free(&info);
        return 0;
    }
    bool pie = false, wasi = false;
    for (size_t i = 0; i < info.n_imports; i++) {
        const lc_wasm_import *im = &info.imports[i];
        if (im->module == NULL || im->name == NULL || im->type == NULL)
            fuzz_fail("import %zu: NULL module, name or type", i);
        if (im->type[0] != '\0' && strncmp(im->type, "(param", 6) != 0 &&
            strncmp(im->type, "(result", 7) != 0)
            fuzz_fail("import %zu: type \"%s\" is not WAT type text", i, im->type);
        pie |= strcmp(im->module, "pie") == 0;
        wasi |= strcmp(im->module, "wasi_snapshot_preview1") == 0;
    }
    if (pie != info.imports_pie || wasi != info.imports_wasi)
        fuzz_fail("imports_pie/imports_wasi (%d/%d) disagree with the import list (%d/%d)",
                  info.imports_pie, info.imports_wasi, pie, wasi);
    rc = lc_wasm_check_imports(&info, fns, n_fns, &st);
    if (rc != PIE_OK && st.msg[0] == '\0')
        fuzz_fail("lc_wasm_check_imports failed (%s) with no message", pie_code_name(rc));
    lc_wasm_info_free(&info);
    return 0;
}
