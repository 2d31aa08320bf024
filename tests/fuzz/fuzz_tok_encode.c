/* fuzz_tok_encode.c — the tokenizer's encoder on arbitrary bytes.
 *
 * Input: byte 0 chooses allow_special (bit 0); the rest is the text, any bytes (invalid UTF-8,
 * NULs, added tokens' text). Checks: tok_encode either succeeds or fails with a code tok.h
 * lists; every id it returns is below tok_vocab_size; and the tokenizer (models/pie-tiny: no
 * normalizer, byte-level BPE) is lossless: tok_decode of the ids gives back exactly the text. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "tok.h"

static tok *the_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    pie_status st;
    if (tok_load(PIE_SOURCE_DIR "/models/pie-tiny/tokenizer.json", &the_tok, &st) != PIE_OK)
        fuzz_fail("cannot load the fixture tokenizer: %s", st.msg);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    bool allow_special = data[0] & 1;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    uint32_t *ids = NULL;
    size_t n = 0;
    pie_status st;
    pie_code rc = tok_encode(the_tok, text, len, allow_special, &ids, &n, &st);
    if (rc != PIE_OK) {
        if (rc != PIE_INVALID_ARGUMENT && rc != PIE_RESOURCE_EXHAUSTED && rc != PIE_INTERNAL)
            fuzz_fail("tok_encode: code %s not listed in tok.h (%s)", pie_code_name(rc), st.msg);
        return 0;
    }
    uint32_t vocab = tok_vocab_size(the_tok);
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= vocab) fuzz_fail("tok_encode: id %u at %zu >= vocab %u", ids[i], i, vocab);
    char *back = NULL;
    size_t back_len = 0;
    if (tok_decode(the_tok, ids, n, &back, &back_len, &st) != PIE_OK)
        fuzz_fail("tok_decode of tok_encode's own ids failed: %s", st.msg);
    if (back_len != len || memcmp(back, text, len) != 0)
        fuzz_fail("decode(encode(text)) != text: %zu bytes in, %zu bytes back", len, back_len);
    free(back);
    free(ids);
    return 0;
}
