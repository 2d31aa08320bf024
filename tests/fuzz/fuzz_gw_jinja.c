/* fuzz_gw_jinja.c — the gateway's chat-template interpreter (services/gateway/gw_jinja.c).
 *
 * Input: a template, then a NUL byte, then a JSON context (messages, tools, any keys); without
 * a NUL the whole input is the template and the context is a fixed two-message chat. The
 * template is parsed and, when it parses, rendered with a 64 KiB output cap. Checks: no crash,
 * leak, UB or runaway (the interpreter's own step, loop and memory caps must end hostile
 * templates well inside libFuzzer's timeout); every failure has a message; a rendering is
 * NUL-terminated at its reported length and within the cap. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "fuzz_util.h"
#include "gw_jinja.h"

#define FUZZ_MAX_OUT (64u << 10)

static json_t *context_of(const uint8_t *data, size_t size, size_t *tmpl_len) {
    const uint8_t *nul = memchr(data, 0, size);
    *tmpl_len = nul ? (size_t)(nul - data) : size;
    json_t *ctx = NULL;
    if (nul) ctx = json_loadb((const char *)nul + 1, size - *tmpl_len - 1, 0, NULL);
    if (!json_is_object(ctx)) {
        json_decref(ctx);
        ctx = json_pack("{s:[{s:s,s:s},{s:s,s:s}],s:b,s:s,s:s}", "messages", "role", "system",
                        "content", "be brief", "role", "user", "content", "hi",
                        "add_generation_prompt", 1, "bos_token", "<s>", "eos_token", "</s>");
    }
    return ctx;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t tl;
    json_t *ctx = context_of(data, size, &tl);
    char err[256] = "";
    gw_jinja *t = gw_jinja_parse((const char *)data, tl, err, sizeof err);
    if (t == NULL) {
        if (err[0] == '\0') fuzz_fail("gw_jinja_parse failed with no message");
        json_decref(ctx);
        return 0;
    }
    size_t len = 0;
    err[0] = '\0';
    char *out = gw_jinja_render(t, ctx, FUZZ_MAX_OUT, &len, err, sizeof err);
    if (out == NULL && err[0] == '\0') fuzz_fail("gw_jinja_render failed with no message");
    if (out != NULL && (len > FUZZ_MAX_OUT || out[len] != '\0'))
        fuzz_fail("rendering of %zu bytes over the cap or not terminated", len);
    free(out);
    gw_jinja_free(t);
    json_decref(ctx);
    return 0;
}
