/* tok_decode.c — token ids back to bytes.
 *
 * Owns: tok_decode (raw bytes, byte-level mapping already undone at load) and the streaming
 * detokenizer, whose job is to hand out only complete, valid UTF-8: an incomplete character at
 * the end of what has arrived is held back (at most 3 bytes); a maximal ill-formed subsequence
 * (Unicode's "substitution of maximal subparts") becomes one U+FFFD. */
#include <inttypes.h>
#include <stdlib.h>

#include "tok_int.h"

static pie_code check_ids(const tok *t, const uint32_t *ids, size_t n, size_t *total,
                          const char *who, pie_status *st) {
    size_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= t->n_ids)
            return pie_status_set(st, PIE_OUT_OF_RANGE,
                                  "tok: %s: id %" PRIu32 " at position %zu is out of range (vocab size %" PRIu32 ")",
                                  who, ids[i], i, t->n_ids);
        if (t->entries[ids[i]].flags == 0)
            return pie_status_set(st, PIE_OUT_OF_RANGE,
                                  "tok: %s: id %" PRIu32 " at position %zu has no token (a gap in the vocab)",
                                  who, ids[i], i);
        if (t->entries[ids[i]].len > SIZE_MAX / 8 - sum)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                                  "tok: %s: %zu ids decode to more bytes than fit in memory", who, n);
        sum += t->entries[ids[i]].len;
    }
    *total = sum;
    return PIE_OK;
}

pie_code tok_decode(const tok *t, const uint32_t *ids, size_t n, char **out, size_t *len,
                    pie_status *st) {
    *out = NULL;
    *len = 0;
    size_t total;
    pie_code rc = check_ids(t, ids, n, &total, "decode", st);
    if (rc != PIE_OK) return rc;
    char *buf = malloc(total + 1);
    if (buf == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tok: decode: out of memory for %zu bytes",
                              total);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const tok_entry *e = &t->entries[ids[i]];
        memcpy(buf + k, t->bytes + e->off, e->len);
        k += e->len;
    }
    buf[k] = '\0';
    *out = buf;
    *len = k;
    pie_status_ok(st);
    return PIE_OK;
}

/* ---- streaming ---- */

struct tok_stream {
    const tok *t;
    uint8_t pending[4]; /* the start of a character whose last bytes have not arrived */
    size_t n_pending;
    char *buf; /* what the last call hands out */
    size_t cap;
};

pie_code tok_stream_new(const tok *t, tok_stream **out, pie_status *st) {
    tok_stream *s = calloc(1, sizeof *s);
    if (s == NULL) {
        *out = NULL;
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tok: stream: out of memory");
    }
    s->t = t;
    *out = s;
    pie_status_ok(st);
    return PIE_OK;
}

void tok_stream_free(tok_stream *s) {
    if (s == NULL) return;
    free(s->buf);
    free(s);
}

static pie_code stream_reserve(tok_stream *s, size_t need, pie_status *st) {
    if (need <= s->cap) return PIE_OK;
    size_t cap = s->cap ? s->cap : 64;
    while (cap < need) cap *= 2;
    char *b = realloc(s->buf, cap);
    if (b == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "tok: stream: out of memory for %zu bytes",
                              need);
    s->buf = b;
    s->cap = cap;
    return PIE_OK;
}

static const uint8_t TOK_REPLACEMENT[3] = {0xEF, 0xBF, 0xBD}; /* U+FFFD */

/* The bytes a character starting with lead needs in all (0: lead can start none), and the
 * allowed range of its second byte. */
static size_t utf8_need(uint8_t lead, uint8_t *lo, uint8_t *hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (lead < 0x80) return 1;
    if (lead >= 0xC2 && lead <= 0xDF) return 2;
    if (lead >= 0xE0 && lead <= 0xEF) {
        if (lead == 0xE0) *lo = 0xA0;
        if (lead == 0xED) *hi = 0x9F;
        return 3;
    }
    if (lead >= 0xF0 && lead <= 0xF4) {
        if (lead == 0xF0) *lo = 0x90;
        if (lead == 0xF4) *hi = 0x8F;
        return 4;
    }
    return 0;
}

/* Feeds one byte; appends completed output to s->buf at *k (room was reserved: every byte
 * fed emits at most 3 + 1 bytes, a U+FFFD plus the byte itself). */
static void stream_byte(tok_stream *s, uint8_t c, size_t *k) {
    for (;;) {
        if (s->n_pending == 0) {
            uint8_t lo, hi;
            size_t need = utf8_need(c, &lo, &hi);
            if (need == 1) {
                s->buf[(*k)++] = (char)c;
            } else if (need == 0) {
                memcpy(s->buf + *k, TOK_REPLACEMENT, 3);
                *k += 3;
            } else {
                s->pending[0] = c;
                s->n_pending = 1;
            }
            return;
        }
        uint8_t lo, hi;
        size_t need = utf8_need(s->pending[0], &lo, &hi);
        if (s->n_pending > 1) {
            lo = 0x80;
            hi = 0xBF;
        }
        if (c >= lo && c <= hi) {
            s->pending[s->n_pending++] = c;
            if (s->n_pending == need) {
                memcpy(s->buf + *k, s->pending, need);
                *k += need;
                s->n_pending = 0;
            }
            return;
        }
        /* The pending bytes are a maximal ill-formed subsequence: one U+FFFD, then c starts
         * afresh. */
        memcpy(s->buf + *k, TOK_REPLACEMENT, 3);
        *k += 3;
        s->n_pending = 0;
    }
}

pie_code tok_stream_push(tok_stream *s, const uint32_t *ids, size_t n, const char **text,
                         size_t *len, pie_status *st) {
    const tok *t = s->t;
    *text = "";
    *len = 0;
    size_t total;
    pie_code rc = check_ids(t, ids, n, &total, "stream", st);
    if (rc != PIE_OK) return rc;
    /* total <= SIZE_MAX / 8 (check_ids), so the reservation below cannot overflow. */
    rc = stream_reserve(s, 4 * total + 16, st);
    if (rc != PIE_OK) return rc;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const tok_entry *e = &t->entries[ids[i]];
        for (uint32_t j = 0; j < e->len; j++) stream_byte(s, t->bytes[e->off + j], &k);
    }
    s->buf[k] = '\0';
    *text = s->buf;
    *len = k;
    pie_status_ok(st);
    return PIE_OK;
}

pie_code tok_stream_finish(tok_stream *s, const char **text, size_t *len, pie_status *st) {
    *text = "";
    *len = 0;
    pie_code rc = stream_reserve(s, 8, st);
    if (rc != PIE_OK) return rc;
    size_t k = 0;
    if (s->n_pending > 0) {
        memcpy(s->buf, TOK_REPLACEMENT, 3);
        k = 3;
        s->n_pending = 0;
    }
    s->buf[k] = '\0';
    *text = s->buf;
    *len = k;
    pie_status_ok(st);
    return PIE_OK;
}
