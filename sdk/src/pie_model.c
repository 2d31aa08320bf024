/* pie_model.c — models, the tokenizer, streaming detokenization, client messages, broadcasts
 * between inferlets, outbound HTTP and program arguments.
 *
 * Owns: the cache of loaded models (global: a model's info never changes during an instance,
 * and contexts keep pointers to it, so entries live until the instance ends).
 * Does not own: queues and resources (pie_res.c), contexts (pie_ctx.c). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_int.h"

/* ==== models ================================================================================== */

typedef struct model_entry {
    pie_model m;
    struct model_entry *next;
} model_entry;

static model_entry *pie_models; /* loaded models, see the file comment */

/* Reads a (buf, cap) → needed-length string call into a malloc'd NUL-terminated string. */
static char *read_model_traits(const char *name, uint32_t name_len) {
    char small[256];
    int32_t n = pie_model_traits(name, name_len, small, sizeof small);
    if (n < 0) return NULL;
    char *s = pie_xmalloc((size_t)n + 1);
    if ((size_t)n <= sizeof small) {
        memcpy(s, small, (size_t)n);
    } else if (pie_model_traits(name, name_len, s, (uint32_t)n) < 0) {
        free(s);
        return NULL;
    }
    s[n] = 0;
    return s;
}

static bool model_load(model_entry *e, const char *name) {
    pie_model *m = &e->m;
    m->name = pie_xstrdup(name);
    m->name_len = (uint32_t)strlen(name);
    if (pie_model_info(m->name, m->name_len, &m->info) < 0) return false;
    uint32_t n = m->info.n_stop_tokens;
    m->stop_tokens = pie_xcalloc(n ? n : 1, sizeof *m->stop_tokens);
    if (pie_model_stop_tokens(m->name, m->name_len, m->stop_tokens, n) < 0) return false;
    m->traits = read_model_traits(m->name, m->name_len);
    return m->traits != NULL;
}

static void model_entry_free(model_entry *e) {
    free(e->m.name);
    free(e->m.stop_tokens);
    free(e->m.traits);
    free(e);
}

const pie_model *pie_model_get_try(const char *name) {
    if (!name) name = "";
    for (model_entry *e = pie_models; e; e = e->next)
        if (strcmp(e->m.name, name) == 0) return &e->m;
    model_entry *e = pie_xcalloc(1, sizeof *e);
    if (!model_load(e, name)) {
        model_entry_free(e);
        return NULL;
    }
    e->next = pie_models;
    pie_models = e;
    return &e->m;
}

const pie_model *pie_model_get(const char *name) {
    const pie_model *m = pie_model_get_try(name);
    if (!m) pie_fatal("model \"%s\": %s", name ? name : "", pie_error());
    return m;
}

bool pie_model_has_trait(const pie_model *m, const char *trait) {
    size_t tl = strlen(trait);
    for (const char *p = m->traits; *p;) {
        const char *nl = strchr(p, '\n');
        size_t l = nl ? (size_t)(nl - p) : strlen(p);
        if (l == tl && memcmp(p, trait, l) == 0) return true;
        if (!nl) break;
        p = nl + 1;
    }
    return false;
}

bool pie_model_is_stop_token(const pie_model *m, uint32_t token) {
    for (uint32_t i = 0; i < m->info.n_stop_tokens; i++)
        if (m->stop_tokens[i] == token) return true;
    return false;
}

/* ==== tokenizer =============================================================================== */

uint32_t *pie_encode(const pie_model *m, const char *text, size_t len, bool allow_special,
                     size_t *n) {
    size_t cap = len + 16;
    uint32_t *ids = pie_xmalloc(cap * sizeof *ids);
    for (;;) {
        int32_t got = pie_tokenize(m->name, m->name_len, text, (uint32_t)len, allow_special,
                                   ids, (uint32_t)cap);
        pie_check(got, "tokenize");
        if ((size_t)got <= cap) {
            *n = (size_t)got;
            return ids;
        }
        cap = (size_t)got;
        ids = pie_xrealloc(ids, cap * sizeof *ids);
    }
}

void pie_decode(const pie_model *m, const uint32_t *ids, size_t n, pie_buf *out) {
    size_t room = n * 8 + 16;
    for (;;) {
        pie_buf_reserve(out, out->len + room);
        int32_t got = pie_detokenize(m->name, m->name_len, ids, (uint32_t)n,
                                     out->data + out->len, (uint32_t)room);
        pie_check(got, "detokenize");
        if ((size_t)got <= room) {
            out->len += (size_t)got;
            out->data[out->len] = 0;
            return;
        }
        room = (size_t)got;
    }
}

void pie_token_append_bytes(const pie_model *m, uint32_t id, pie_buf *out) {
    size_t room = 32;
    for (;;) {
        pie_buf_reserve(out, out->len + room);
        int32_t got = pie_token_bytes(m->name, m->name_len, id, out->data + out->len,
                                      (uint32_t)room);
        if (got < 0) pie_fatal("token_bytes: token %u: %s", (unsigned)id, pie_error());
        if ((size_t)got <= room) {
            out->len += (size_t)got;
            out->data[out->len] = 0;
            return;
        }
        room = (size_t)got;
    }
}

/* ==== streaming detokenization ================================================================ */

void pie_detok_init(pie_detok *d, const pie_model *m) { *d = (pie_detok){.model = m}; }

/* Length of the UTF-8 sequence a lead byte starts; 0 for a byte that cannot start one. */
static size_t utf8_seq_len(unsigned char b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

/* How many bytes at the end of p[0..n) are an incomplete (but so far valid) character. */
static size_t utf8_incomplete_tail(const unsigned char *p, size_t n) {
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char b = p[n - back];
        if ((b & 0xC0) == 0x80) continue; /* continuation byte: look further back */
        size_t need = utf8_seq_len(b);
        return need > back ? back : 0;
    }
    return 0;
}

size_t pie_detok_push(pie_detok *d, uint32_t token, pie_buf *out) {
    pie_token_append_bytes(d->model, token, &d->pending);
    size_t hold = utf8_incomplete_tail((const unsigned char *)d->pending.data, d->pending.len);
    size_t emit = d->pending.len - hold;
    pie_buf_append(out, d->pending.data, emit);
    memmove(d->pending.data, d->pending.data + emit, hold);
    d->pending.len = hold;
    d->pending.data[hold] = 0;
    return emit;
}

size_t pie_detok_flush(pie_detok *d, pie_buf *out) {
    size_t n = d->pending.len;
    pie_buf_append(out, d->pending.data, n);
    pie_buf_clear(&d->pending);
    return n;
}

void pie_detok_free(pie_detok *d) {
    pie_buf_free(&d->pending);
}

/* ==== messages ================================================================================ */

char *pie_receive_string(size_t *len) {
    uint32_t f = pie_future_new();
    pie_check(pie_receive(f), "receive");
    pie_buf b = {0};
    int32_t n = pie_future_take_try(f, &b);
    if (n == PIE_ABI_E_OUT_OF_RANGE) { /* the client closed its input */
        pie_buf_free(&b);
        return NULL;
    }
    pie_check(n, "receive");
    if (len) *len = b.len;
    return b.data; /* NUL-terminated by pie_buf */
}

void pie_send_bytes(const void *p, size_t n) { pie_check(pie_send(p, (uint32_t)n), "send"); }

void pie_send_string(const char *s) { pie_send_bytes(s, strlen(s)); }

void pie_sendf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) pie_fatal("pie_sendf: bad format \"%s\"", fmt);
    char *s = pie_xmalloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    pie_send_bytes(s, (size_t)n);
    free(s);
}

/* ==== broadcasts ============================================================================== */

void pie_publish(const char *topic, const void *msg, size_t len) {
    if (pie_broadcast(topic, (uint32_t)strlen(topic), msg, (uint32_t)len) < 0)
        pie_fatal("broadcast to \"%s\" (%zu bytes): %s", topic, len, pie_error());
}

void pie_topic_subscribe(const char *topic) {
    if (pie_subscribe(topic, (uint32_t)strlen(topic)) < 0)
        pie_fatal("subscribe \"%s\": %s", topic, pie_error());
}

void pie_topic_unsubscribe(const char *topic) {
    if (pie_unsubscribe(topic, (uint32_t)strlen(topic)) < 0)
        pie_fatal("unsubscribe \"%s\": %s", topic, pie_error());
}

void pie_topic_receive(pie_buf *topic, pie_buf *msg) {
    uint32_t f = pie_future_new();
    pie_check(pie_subscription_receive(f), "subscription_receive");
    pie_buf raw = {0};
    size_t n = pie_future_take(f, &raw, "subscription_receive");
    uint32_t tl = 0;
    if (n >= 4) memcpy(&tl, raw.data, 4);
    if (n < 4 || tl > n - 4) pie_fatal("subscription_receive: malformed payload of %zu bytes", n);
    pie_buf_clear(topic);
    pie_buf_append(topic, raw.data + 4, tl);
    pie_buf_clear(msg);
    pie_buf_append(msg, raw.data + 4 + tl, n - 4 - tl);
    pie_buf_free(&raw);
}

/* ==== HTTP ==================================================================================== */

int32_t pie_http_try(const char *method, const char *url, const char *headers, const void *body,
                     size_t body_len, pie_buf *resp) {
    if (!headers) headers = "";
    uint32_t f = pie_future_new();
    int32_t rc = pie_http_request(method, (uint32_t)strlen(method), url, (uint32_t)strlen(url),
                                  headers, (uint32_t)strlen(headers), body,
                                  body ? (uint32_t)body_len : 0, f);
    if (rc < 0) {
        pie_id_put(PIE_ID_FUTURE, f);
        return rc;
    }
    pie_buf raw = {0};
    rc = pie_future_take_try(f, &raw);
    if (rc >= 0 && raw.len < 4) pie_fatal("http_request %s: malformed payload of %zu bytes", url, raw.len);
    if (rc >= 0) {
        uint32_t status;
        memcpy(&status, raw.data, 4);
        pie_buf_clear(resp);
        pie_buf_append(resp, raw.data + 4, raw.len - 4);
        rc = (int32_t)status;
    }
    pie_buf_free(&raw);
    return rc;
}

/* ==== arguments =============================================================================== */

/* The value of --name ("--name value" or "--name=value"), or NULL. */
static const char *arg_find(int argc, char **argv, const char *name, bool *present) {
    size_t nl = strlen(name);
    *present = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || a[1] != '-' || strncmp(a + 2, name, nl) != 0) continue;
        if (a[2 + nl] == '=') {
            *present = true;
            return a + 3 + nl;
        }
        if (a[2 + nl] == 0) {
            *present = true;
            return i + 1 < argc ? argv[i + 1] : NULL;
        }
    }
    return NULL;
}

const char *pie_arg_str(int argc, char **argv, const char *name, const char *def) {
    bool present;
    const char *v = arg_find(argc, argv, name, &present);
    if (present && !v) pie_fatal("argument --%s needs a value", name);
    return v ? v : def;
}

long pie_arg_int(int argc, char **argv, const char *name, long def) {
    const char *v = pie_arg_str(argc, argv, name, NULL);
    if (!v) return def;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end) pie_fatal("argument --%s: \"%s\" is not an integer", name, v);
    return x;
}

double pie_arg_float(int argc, char **argv, const char *name, double def) {
    const char *v = pie_arg_str(argc, argv, name, NULL);
    if (!v) return def;
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end) pie_fatal("argument --%s: \"%s\" is not a number", name, v);
    return x;
}

bool pie_arg_flag(int argc, char **argv, const char *name) {
    bool present;
    (void)arg_find(argc, argv, name, &present);
    return present;
}
