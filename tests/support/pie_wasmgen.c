/* pie_wasmgen.c — see pie_wasmgen.h. Binary format: WebAssembly core spec 1.0, §5. */
#include "pie_wasmgen.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct wbuf {
    uint8_t *p;
    size_t n, cap;
    bool oom;
} wbuf;

static void put(wbuf *b, const void *data, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
}

static void put_u8(wbuf *b, uint8_t v) { put(b, &v, 1); }

static void put_leb(wbuf *b, uint32_t v) { /* unsigned LEB128 */
    do {
        uint8_t byte = v & 0x7f;
        v >>= 7;
        put_u8(b, byte | (v ? 0x80 : 0));
    } while (v);
}

static void put_sleb(wbuf *b, int32_t v) { /* signed LEB128 */
    for (;;) {
        uint8_t byte = (uint8_t)(v & 0x7f);
        v >>= 7; /* arithmetic on every compiler we build with; only small values are used */
        bool done = (v == 0 && !(byte & 0x40)) || (v == -1 && (byte & 0x40));
        put_u8(b, done ? byte : byte | 0x80);
        if (done) return;
    }
}

static void put_section(wbuf *out, uint8_t id, wbuf *body) {
    put_u8(out, id);
    put_leb(out, (uint32_t)body->n);
    put(out, body->p, body->n);
    out->oom |= body->oom;
    free(body->p);
    *body = (wbuf){0};
}

uint8_t *pie_wasmgen(const pie_wasmgen_opts *o, size_t *len) {
    uint32_t n = o->n_funcs ? o->n_funcs : 1;
    wbuf out = {0}, s = {0}, body = {0};
    put(&out, "\0asm\1\0\0\0", 8);
    put_leb(&s, 1); /* type section: one type, () -> () */
    put(&s, "\x60\x00\x00", 3);
    put_section(&out, 1, &s);
    put_leb(&s, n); /* function section: every function of type 0 */
    for (uint32_t i = 0; i < n; i++) put_u8(&s, 0);
    put_section(&out, 3, &s);
    put_leb(&s, 1); /* export section: _start = function 0 */
    put_leb(&s, 6);
    put(&s, "_start", 6);
    put_u8(&s, 0);
    put_leb(&s, 0);
    put_section(&out, 7, &s);
    /* code section: function 0 as asked, the others empty */
    put_u8(&body, 0); /* no locals */
    put_u8(&body, 0x41);
    put_sleb(&body, (int32_t)(o->salt & 0x7fffffff));
    put_u8(&body, 0x1a);                                              /* drop */
    for (uint32_t i = 0; i < o->nest; i++) put(&body, "\x02\x40", 2); /* block (no result) */
    for (uint32_t i = 0; i < o->nest; i++) put_u8(&body, 0x0b);
    for (uint32_t i = 0; i < o->pad; i++) put_u8(&body, 0x01); /* nop */
    put_u8(&body, 0x0b);
    put_leb(&s, n);
    put_leb(&s, (uint32_t)body.n);
    put(&s, body.p, body.n);
    s.oom |= body.oom;
    free(body.p);
    for (uint32_t i = 1; i < n; i++) put(&s, "\x02\x00\x0b", 3); /* size 2: no locals, end */
    put_section(&out, 10, &s);
    if (out.oom) {
        free(out.p);
        return NULL;
    }
    *len = out.n;
    return out.p;
}
