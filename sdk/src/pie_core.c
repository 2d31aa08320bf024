/* pie_core.c — the SDK's foundations: fatal errors, checked allocation, growable buffers, id
 * pools and futures.
 *
 * Owns: the id pools of every object kind (global: an inferlet is one single-threaded
 * instance, and ids are private to that instance, so one pool per kind is exactly the id space
 * the host checks against), and the static buffer pie_error() returns.
 * Does not own: anything that talks to a queue (pie_res.c), models (pie_model.c). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

/* ==== errors ================================================================================= */

_Noreturn void pie_fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("pie: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stdout);
    exit(1);
}

/* Written by pie_error(); global because the host keeps only the last error per instance. */
static char pie_error_buf[1024];

const char *pie_error(void) {
    int32_t n = pie_last_error(pie_error_buf, sizeof pie_error_buf - 1);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof pie_error_buf) n = sizeof pie_error_buf - 1;
    pie_error_buf[n] = 0;
    return pie_error_buf;
}

int32_t pie_check(int32_t rc, const char *what) {
    if (rc < 0) pie_fatal("%s: %s (code %d)", what, pie_error(), (int)-rc);
    return rc;
}

void *pie_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) pie_fatal("out of memory allocating %zu bytes", n);
    return p;
}

void *pie_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) pie_fatal("out of memory growing a block to %zu bytes", n);
    return q;
}

void *pie_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) pie_fatal("out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

char *pie_xstrdup(const char *s) {
    size_t n = strlen(s);
    char *d = pie_xmalloc(n + 1);
    memcpy(d, s, n + 1);
    return d;
}

/* ==== buffers ================================================================================= */

void pie_buf_reserve(pie_buf *b, size_t cap) {
    if (cap + 1 <= b->cap) return;
    size_t c = b->cap ? b->cap : 64;
    while (c < cap + 1) c *= 2;
    b->data = pie_xrealloc(b->data, c);
    b->cap = c;
    b->data[b->len] = 0;
}

void pie_buf_append(pie_buf *b, const void *p, size_t n) {
    pie_buf_reserve(b, b->len + n);
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

void pie_buf_append_str(pie_buf *b, const char *s) { pie_buf_append(b, s, strlen(s)); }

void pie_buf_appendf(pie_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) pie_fatal("pie_buf_appendf: bad format \"%s\"", fmt);
    pie_buf_reserve(b, b->len + (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void pie_buf_clear(pie_buf *b) {
    b->len = 0;
    if (b->data) b->data[0] = 0;
}

void pie_buf_free(pie_buf *b) {
    free(b->data);
    *b = (pie_buf){0};
}

/* ==== id pools ================================================================================ */

typedef struct id_pool {
    uint32_t next; /* ids below next were handed out at least once; 0 = never used */
    uint32_t *free_ids;
    size_t n_free, cap_free;
} id_pool;

/* One pool per object kind for the whole instance (see the file comment). */
static id_pool pie_pools[PIE_ID_KIND_COUNT];

uint32_t pie_id_get(pie_id_kind kind) {
    id_pool *p = &pie_pools[kind];
    if (p->n_free) return p->free_ids[--p->n_free];
    if (p->next == UINT32_MAX) pie_fatal("id pool %d exhausted", (int)kind);
    return ++p->next; /* ids start at 1: queue and future ids must be non-zero */
}

void pie_id_put(pie_id_kind kind, uint32_t id) {
    id_pool *p = &pie_pools[kind];
    if (p->n_free == p->cap_free) {
        p->cap_free = p->cap_free ? p->cap_free * 2 : 64;
        p->free_ids = pie_xrealloc(p->free_ids, p->cap_free * sizeof *p->free_ids);
    }
    p->free_ids[p->n_free++] = id;
}

/* ==== futures ================================================================================= */

uint32_t pie_future_new(void) { return pie_id_get(PIE_ID_FUTURE); }

/* check_of[f]: the synchronize future armed just before f on f's queue (0 = none), indexed by
 * future id (ids are dense: they come from the pool). Global for the same reason as the pools. */
static uint32_t *pie_check_of;
static size_t pie_check_cap;

void pie_future_set_check(uint32_t f, uint32_t sync_f) {
    if (f >= pie_check_cap) {
        size_t cap = pie_check_cap ? pie_check_cap : 64;
        while (cap <= f) cap *= 2;
        pie_check_of = pie_xrealloc(pie_check_of, cap * sizeof *pie_check_of);
        memset(pie_check_of + pie_check_cap, 0, (cap - pie_check_cap) * sizeof *pie_check_of);
        pie_check_cap = cap;
    }
    pie_check_of[f] = sync_f;
}

/* Detaches and returns f's synchronize future (0 = none). */
static uint32_t check_detach(uint32_t f) {
    if (f >= pie_check_cap) return 0;
    uint32_t s = pie_check_of[f];
    pie_check_of[f] = 0;
    return s;
}

static int32_t take_plain(uint32_t f, pie_buf *out) {
    pie_buf_reserve(out, 255);
    for (;;) {
        int32_t n = pie_future_result(f, out->data, (uint32_t)(out->cap - 1));
        if (n < 0) { /* the host released f */
            pie_id_put(PIE_ID_FUTURE, f);
            pie_buf_clear(out);
            return n;
        }
        if ((size_t)n <= out->cap - 1) { /* complete: f released */
            out->len = (size_t)n;
            out->data[n] = 0;
            pie_id_put(PIE_ID_FUTURE, f);
            return n;
        }
        pie_buf_reserve(out, (size_t)n); /* short buffer: f stays armed, ask again */
    }
}

/* Takes f's synchronize future first when it has one: a failure of an earlier call on the
 * queue is f's failure (f is dropped, *from_check set). */
static int32_t take_checked(uint32_t f, pie_buf *out, bool *from_check) {
    *from_check = false;
    uint32_t s = check_detach(f);
    if (s) {
        pie_buf b = {0};
        int32_t rc = take_plain(s, &b);
        pie_buf_free(&b);
        if (rc < 0) {
            *from_check = true;
            if (pie_future_drop(f) < 0) pie_fatal("future_drop %u: %s", (unsigned)f, pie_error());
            pie_id_put(PIE_ID_FUTURE, f);
            pie_buf_clear(out);
            return rc;
        }
    }
    return take_plain(f, out);
}

int32_t pie_future_take_try(uint32_t f, pie_buf *out) {
    bool from_check;
    return take_checked(f, out, &from_check);
}

size_t pie_future_take(uint32_t f, pie_buf *out, const char *what) {
    bool from_check;
    int32_t rc = take_checked(f, out, &from_check);
    if (rc < 0 && from_check) {
        /* Read the message before anything else can fail. */
        pie_fatal("%s: a call issued before it on its queue failed: %s (code %d)", what,
                  pie_error(), (int)-rc);
    }
    return (size_t)pie_check(rc, what);
}

void pie_future_discard(uint32_t f) {
    uint32_t s = check_detach(f);
    if (s) pie_future_discard(s);
    pie_check(pie_future_drop(f), "future_drop");
    pie_id_put(PIE_ID_FUTURE, f);
}
