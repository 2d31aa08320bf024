/* fuzz_tok_stream.c — streaming detokenization of arbitrary id sequences.
 *
 * Input: a sequence of records; each is one byte n (1..8 ids in this push, n & 7 + 1) then n
 * little-endian uint16 ids (ids past the vocabulary included, so out-of-range errors are
 * exercised). The ids go through tok_stream_push in those chunks, then tok_stream_finish.
 * Checks: every piece the stream hands out is valid UTF-8 and NUL-terminated; a push that fails
 * fails with OUT_OF_RANGE and consumes nothing; when every id was valid and tok_decode's bytes
 * are valid UTF-8, the pieces put together are exactly tok_decode's bytes. */
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

/* Length of the valid UTF-8 prefix of s (RFC 3629: no overlongs, surrogates or > U+10FFFF). */
static size_t utf8_valid_prefix(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        }
        if ((c & 0xe0) == 0xc0) {
            k = 1, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            k = 2, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            k = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return i;
        }
        if (i + k >= n) return i; /* truncated at the end */
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return i;
            cp = cp << 6 | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
        i += k + 1;
    }
    return n;
}

typedef struct buf {
    char *p;
    size_t n, cap;
} buf;

static void buf_add(buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        if (b->p == NULL) abort();
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void check_piece(const char *text, size_t len, const char *what) {
    if (text == NULL) fuzz_fail("%s: NULL text", what);
    if (text[len] != '\0') fuzz_fail("%s: piece of %zu bytes is not NUL-terminated", what, len);
    if (utf8_valid_prefix((const uint8_t *)text, len) != len)
        fuzz_fail("%s: piece of %zu bytes is not valid UTF-8", what, len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint32_t vocab = tok_vocab_size(the_tok);
    tok_stream *s = NULL;
    pie_status st;
    if (tok_stream_new(the_tok, &s, &st) != PIE_OK) fuzz_fail("tok_stream_new: %s", st.msg);
    buf out = {0}, all_ids = {0};
    size_t i = 0;
    while (i < size) {
        size_t n = (data[i++] & 7) + 1;
        uint32_t ids[8];
        size_t got = 0;
        while (got < n && i + 2 <= size) {
            ids[got++] = (uint32_t)data[i] | (uint32_t)data[i + 1] << 8;
            i += 2;
        }
        const char *text = NULL;
        size_t len = 0;
        pie_code rc = tok_stream_push(s, ids, got, &text, &len, &st);
        if (rc != PIE_OK) {
            if (rc != PIE_OUT_OF_RANGE)
                fuzz_fail("tok_stream_push: code %s, want OUT_OF_RANGE (%s)", pie_code_name(rc),
                          st.msg);
            bool any_bad = false;
            for (size_t k = 0; k < got; k++) {
                size_t bl;
                if (ids[k] >= vocab || tok_token_bytes(the_tok, ids[k], &bl) == NULL)
                    any_bad = true;
            }
            if (!any_bad) fuzz_fail("tok_stream_push failed on valid ids: %s", st.msg);
            continue;
        }
        check_piece(text, len, "tok_stream_push");
        buf_add(&out, text, len);
        buf_add(&all_ids, (const char *)ids, got * sizeof ids[0]);
    }
    const char *text = NULL;
    size_t len = 0;
    if (tok_stream_finish(s, &text, &len, &st) != PIE_OK)
        fuzz_fail("tok_stream_finish: %s", st.msg);
    check_piece(text, len, "tok_stream_finish");
    buf_add(&out, text, len);
    /* Pushes that failed consumed nothing, so the accepted ids alone made the pieces. */
    char *dec = NULL;
    size_t dec_len = 0;
    size_t n_ids = all_ids.n / sizeof(uint32_t);
    if (tok_decode(the_tok, (const uint32_t *)all_ids.p, n_ids, &dec, &dec_len, &st) != PIE_OK)
        fuzz_fail("tok_decode of ids the stream accepted failed: %s", st.msg);
    if (utf8_valid_prefix((const uint8_t *)dec, dec_len) == dec_len &&
        (out.n != dec_len || memcmp(out.p, dec, dec_len) != 0))
        fuzz_fail("stream pieces (%zu bytes) differ from tok_decode's valid UTF-8 (%zu bytes)",
                  out.n, dec_len);
    free(dec);
    free(out.p);
    free(all_ids.p);
    tok_stream_free(s);
    return 0;
}
