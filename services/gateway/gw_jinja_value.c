/* gw_jinja_value.c — the chat-template interpreter's run-time values.
 *
 * Owns: gj_val's life (reference counts; every byte counted against the render's live budget,
 * GW_JINJA_MAX_LIVE_BYTES; containers no deeper than GJ_MAX_VALUE_DEPTH, so that recursion over a
 * value is bounded), truthiness and equality, the text a value renders as in {{ }} and its JSON
 * (`tojson`; both as @huggingface/jinja writes them: JavaScript number formatting, JSON.stringify
 * string escapes), and the conversion of the caller's jansson context.
 * Does not own: evaluation (gw_jinja.c), filters and methods (gw_jinja_builtins.c). */
#include "gw_jinja_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- life ------------------------------------------------------------------------------------ */

static int gj_account(gj_ctx *x, size_t add) {
    if (add > GW_JINJA_MAX_LIVE_BYTES || x->live_bytes > GW_JINJA_MAX_LIVE_BYTES - add) {
        gj_fail(x, 0, "template values need more than %u bytes", (unsigned)GW_JINJA_MAX_LIVE_BYTES);
        return -1;
    }
    x->live_bytes += add;
    return 0;
}

gj_val *gj_new(gj_ctx *x, gj_kind kind) {
    if (gj_account(x, sizeof(gj_val)) != 0) return NULL;
    gj_val *v = calloc(1, sizeof *v);
    if (!v) {
        x->live_bytes -= sizeof(gj_val);
        gj_fail(x, 0, "out of memory");
        return NULL;
    }
    v->kind = kind, v->refs = 1, v->size = sizeof(gj_val);
    return v;
}

gj_val *gj_new_bool(gj_ctx *x, bool b) {
    gj_val *v = gj_new(x, GJ_BOOL);
    if (v) v->u.b = b;
    return v;
}

gj_val *gj_new_int(gj_ctx *x, long long i) {
    gj_val *v = gj_new(x, GJ_INT);
    if (v) v->u.i = i;
    return v;
}

gj_val *gj_new_float(gj_ctx *x, double f) {
    gj_val *v = gj_new(x, GJ_FLOAT);
    if (v) v->u.f = f;
    return v;
}

gj_val *gj_new_str(gj_ctx *x, const char *s, size_t n) {
    if (gj_charge(x, n / 64, 0) != 0) return NULL;
    gj_val *v = gj_new(x, GJ_STR);
    if (!v) return NULL;
    if (gj_account(x, n + 1) != 0) {
        gj_unref(x, v);
        return NULL;
    }
    v->size += n + 1;
    if (!(v->u.s.p = malloc(n + 1))) {
        gj_fail(x, 0, "out of memory");
        gj_unref(x, v);
        return NULL;
    }
    if (n) memcpy(v->u.s.p, s, n);
    v->u.s.p[n] = '\0';
    v->u.s.n = n;
    return v;
}

gj_val *gj_new_str_buf(gj_ctx *x, gj_buf *b) {
    gj_val *v = gj_new_str(x, b->p ? b->p : "", b->n);
    free(b->p);
    *b = (gj_buf){0};
    return v;
}

gj_val *gj_ref(gj_val *v) {
    if (v) v->refs++;
    return v;
}

void gj_unref(gj_ctx *x, gj_val *v) {
    if (!v || --v->refs > 0) return;
    switch (v->kind) {
    case GJ_STR: free(v->u.s.p); break;
    case GJ_LIST:
        for (size_t i = 0; i < v->u.l.n; i++) gj_unref(x, v->u.l.v[i]);
        free(v->u.l.v);
        break;
    case GJ_DICT:
    case GJ_NS:
        for (size_t i = 0; i < v->u.d.n; i++) {
            free(v->u.d.k[i]);
            gj_unref(x, v->u.d.v[i]);
        }
        free(v->u.d.k);
        free(v->u.d.kn);
        free(v->u.d.v);
        break;
    default: break;
    }
    x->live_bytes -= v->size < x->live_bytes ? v->size : x->live_bytes;
    free(v);
}

static int gj_set_depth(gj_ctx *x, gj_val *c, const gj_val *item) {
    int d = item && (item->kind == GJ_LIST || item->kind == GJ_DICT || item->kind == GJ_NS)
                ? item->depth + 1
                : 1;
    if (d > GJ_MAX_VALUE_DEPTH) {
        gj_fail(x, 0, "a value is nested more than %d levels deep", GJ_MAX_VALUE_DEPTH);
        return -1;
    }
    if (d > c->depth) c->depth = d;
    if (item && (item->kind == GJ_NS || item->has_ns)) c->has_ns = true;
    return 0;
}

int gj_list_push(gj_ctx *x, gj_val *list, gj_val *item) {
    if (gj_set_depth(x, list, item) != 0) goto fail;
    if (list->u.l.n == list->u.l.cap) {
        size_t cap = list->u.l.cap ? list->u.l.cap * 2 : 4;
        if (gj_account(x, (cap - list->u.l.cap) * sizeof(gj_val *)) != 0) goto fail;
        list->size += (cap - list->u.l.cap) * sizeof(gj_val *);
        gj_val **nv = realloc(list->u.l.v, cap * sizeof *nv);
        if (!nv) {
            gj_fail(x, 0, "out of memory");
            goto fail;
        }
        list->u.l.v = nv;
        list->u.l.cap = cap;
    }
    list->u.l.v[list->u.l.n++] = item;
    return 0;
fail:
    gj_unref(x, item);
    return -1;
}

static long gj_dict_find(const gj_val *d, const char *k, size_t kn) {
    for (size_t i = 0; i < d->u.d.n; i++)
        if (d->u.d.kn[i] == kn && memcmp(d->u.d.k[i], k, kn) == 0) return (long)i;
    return -1;
}

gj_val *gj_dict_get(const gj_val *d, const char *k, size_t kn) {
    long i = gj_dict_find(d, k, kn);
    return i < 0 ? NULL : d->u.d.v[i];
}

static int gj_dict_grow(gj_ctx *x, gj_val *d) {
    size_t cap = d->u.d.cap ? d->u.d.cap * 2 : 4,
           add = (cap - d->u.d.cap) * (sizeof(char *) + sizeof(size_t) + sizeof(gj_val *));
    if (gj_account(x, add) != 0) return -1;
    d->size += add;
    char **nk = realloc(d->u.d.k, cap * sizeof *nk);
    if (nk) d->u.d.k = nk;
    size_t *nn = nk ? realloc(d->u.d.kn, cap * sizeof *nn) : NULL;
    if (nn) d->u.d.kn = nn;
    gj_val **nv = nn ? realloc(d->u.d.v, cap * sizeof *nv) : NULL;
    if (!nv) {
        gj_fail(x, 0, "out of memory");
        return -1;
    }
    d->u.d.v = nv;
    d->u.d.cap = cap;
    return 0;
}

/* Adds key k (known to be absent) or, with replace, sets it. */
static int gj_dict_put(gj_ctx *x, gj_val *d, const char *k, size_t kn, gj_val *v, bool replace) {
    long i = replace ? gj_dict_find(d, k, kn) : -1;
    if (gj_set_depth(x, d, v) != 0) goto fail;
    if (i >= 0) {
        gj_unref(x, d->u.d.v[i]);
        d->u.d.v[i] = v;
        return 0;
    }
    if (d->u.d.n == d->u.d.cap && gj_dict_grow(x, d) != 0) goto fail;
    if (gj_account(x, kn + 1) != 0) goto fail;
    char *key = malloc(kn + 1);
    if (!key) {
        x->live_bytes -= kn + 1;
        gj_fail(x, 0, "out of memory");
        goto fail;
    }
    d->size += kn + 1;
    if (kn) memcpy(key, k, kn);
    key[kn] = '\0';
    d->u.d.k[d->u.d.n] = key, d->u.d.kn[d->u.d.n] = kn, d->u.d.v[d->u.d.n] = v;
    d->u.d.n++;
    return 0;
fail:
    gj_unref(x, v);
    return -1;
}

int gj_dict_set(gj_ctx *x, gj_val *d, const char *k, size_t kn, gj_val *v) {
    return gj_dict_put(x, d, k, kn, v, true);
}

/* ---- truth and equality ---------------------------------------------------------------------- */

bool gj_truthy(const gj_val *v) {
    switch (v->kind) {
    case GJ_UNDEF:
    case GJ_NONE: return false;
    case GJ_BOOL: return v->u.b;
    case GJ_INT: return v->u.i != 0;
    case GJ_FLOAT: return v->u.f != 0 && !isnan(v->u.f);
    case GJ_STR: return v->u.s.n > 0;
    case GJ_LIST: return v->u.l.n > 0;
    case GJ_DICT: return v->u.d.n > 0;
    default: return true; /* namespaces and functions */
    }
}

static bool gj_numeric(const gj_val *v, double *d) {
    if (v->kind == GJ_INT)
        *d = (double)v->u.i;
    else if (v->kind == GJ_FLOAT)
        *d = v->u.f;
    else if (v->kind == GJ_BOOL)
        *d = v->u.b;
    else
        return false;
    return true;
}

/* ==: numbers (and booleans as 0/1) by value, strings by content, none equals undefined (as in
 * @huggingface/jinja), lists and dicts element by element. */
bool gj_equal(const gj_val *a, const gj_val *b) {
    double da, db;
    if (a->kind == GJ_INT && b->kind == GJ_INT) return a->u.i == b->u.i;
    if (gj_numeric(a, &da) && gj_numeric(b, &db)) return da == db;
    bool an = a->kind == GJ_NONE || a->kind == GJ_UNDEF,
         bn = b->kind == GJ_NONE || b->kind == GJ_UNDEF;
    if (an || bn) return an && bn;
    if (a->kind != b->kind) return false;
    switch (a->kind) {
    case GJ_STR: return a->u.s.n == b->u.s.n && memcmp(a->u.s.p, b->u.s.p, a->u.s.n) == 0;
    case GJ_LIST:
        if (a->u.l.n != b->u.l.n) return false;
        for (size_t i = 0; i < a->u.l.n; i++)
            if (!gj_equal(a->u.l.v[i], b->u.l.v[i])) return false;
        return true;
    case GJ_DICT:
    case GJ_NS:
        if (a->u.d.n != b->u.d.n) return false;
        for (size_t i = 0; i < a->u.d.n; i++) {
            const gj_val *o = gj_dict_get(b, a->u.d.k[i], a->u.d.kn[i]);
            if (!o || !gj_equal(a->u.d.v[i], o)) return false;
        }
        return true;
    default: return a == b;
    }
}

const char *gj_kind_a(gj_kind k) {
    static const char *const names[] = {
        "an undefined value", "none",   "a boolean", "an integer",  "a float",
        "a string",           "a list", "a dict",    "a namespace", "a function"};
    return names[k];
}

const char *gj_kind_name(gj_kind k) {
    static const char *const names[] = {"undefined", "none", "boolean", "integer",   "float",
                                        "string",    "list", "dict",    "namespace", "function"};
    return names[k];
}

/* ---- numbers as JavaScript writes them ------------------------------------------------------- */

double gj_floor(double f) {
    if (!(f > -4503599627370496.0 && f < 4503599627370496.0))
        return f; /* |f| >= 2^52 (or NaN): integral */
    double t = (double)(long long)f;
    return t > f ? t - 1 : t;
}

/* Number.prototype.toString: the shortest digits that read back as x. */
static void gj_js_double(char *out, size_t cap, double x) {
    if (isnan(x)) {
        snprintf(out, cap, "NaN");
        return;
    }
    if (isinf(x)) {
        snprintf(out, cap, x < 0 ? "-Infinity" : "Infinity");
        return;
    }
    if (x == 0) {
        snprintf(out, cap, "0");
        return;
    }
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    char digits[24];
    size_t k = 0;
    const char *q = e;
    bool neg = *q == '-';
    if (neg) q++;
    for (; *q && *q != 'e'; q++)
        if (*q != '.' && k < sizeof digits - 1) digits[k++] = *q;
    while (k > 1 && digits[k - 1] == '0') k--;
    digits[k] = '\0';
    int n = atoi(q + 1) + 1; /* the decimal point sits after n digits */
    size_t o = 0;
#define GJ_OUT(...) (o += (size_t)snprintf(out + o, o < cap ? cap - o : 0, __VA_ARGS__))
    if (neg) GJ_OUT("-");
    if ((int)k <= n && n <= 21) {
        GJ_OUT("%s", digits);
        for (int i = (int)k; i < n; i++) GJ_OUT("0");
    } else if (0 < n && n <= 21) {
        GJ_OUT("%.*s.%s", n, digits, digits + n);
    } else if (-6 < n && n <= 0) {
        GJ_OUT("0.");
        for (int i = n; i < 0; i++) GJ_OUT("0");
        GJ_OUT("%s", digits);
    } else {
        GJ_OUT("%c%s%s", digits[0], k > 1 ? "." : "", digits + 1);
        GJ_OUT("e%c%d", n - 1 >= 0 ? '+' : '-', n - 1 >= 0 ? n - 1 : 1 - n);
    }
#undef GJ_OUT
}

/* {{ }} form (json=false): integral floats as "2.0" (FloatValue.toString); JSON form: as Python's
 * json.dumps writes a float (2.0; NaN and infinities as null, which JSON cannot spell). */
int gj_write_number(gj_ctx *x, gj_buf *b, const gj_val *v, bool json) {
    char s[64];
    if (v->kind == GJ_INT)
        snprintf(s, sizeof s, "%lld", v->u.i);
    else if (v->kind == GJ_BOOL)
        snprintf(s, sizeof s, "%s", v->u.b ? "true" : "false");
    else {
        double f = v->u.f;
        if (json && (isnan(f) || isinf(f)))
            snprintf(s, sizeof s, "null");
        else if (!json && f == 0 && signbit(f))
            snprintf(s, sizeof s, "-0.0");
        else if (isfinite(f) && f == gj_floor(f) && fabs(f) < (json ? 1e16 : 1e21))
            snprintf(s, sizeof s, "%.1f", f);
        else
            gj_js_double(s, sizeof s, f);
    }
    return gj_buf_puts(x, b, s);
}

/* ---- JSON ------------------------------------------------------------------------------------ */

static int gj_json_u(gj_ctx *x, gj_buf *b, unsigned u) {
    char e[16]; /* u < 0x10000 here: 6 bytes + NUL; room for the compiler's worst case */
    snprintf(e, sizeof e, "\\u%04x", u & 0xFFFFu);
    return gj_buf_puts(x, b, e);
}

/* Decodes the UTF-8 character at s[i] (invalid bytes: U+FFFD, 1 byte). */
unsigned gj_utf8_at(const char *s, size_t n, size_t i, size_t *w) {
    const unsigned char *u = (const unsigned char *)s + i;
    size_t left = n - i;
    if (u[0] < 0x80) return *w = 1, u[0];
    if ((u[0] & 0xE0) == 0xC0 && left >= 2 && (u[1] & 0xC0) == 0x80)
        return *w = 2, (unsigned)(u[0] & 0x1F) << 6 | (u[1] & 0x3F);
    if ((u[0] & 0xF0) == 0xE0 && left >= 3 && (u[1] & 0xC0) == 0x80 && (u[2] & 0xC0) == 0x80)
        return *w = 3, (unsigned)(u[0] & 0x0F) << 12 | (unsigned)(u[1] & 0x3F) << 6 | (u[2] & 0x3F);
    if ((u[0] & 0xF8) == 0xF0 && left >= 4 && (u[1] & 0xC0) == 0x80 && (u[2] & 0xC0) == 0x80 &&
        (u[3] & 0xC0) == 0x80)
        return *w = 4, (unsigned)(u[0] & 0x07) << 18 | (unsigned)(u[1] & 0x3F) << 12 |
                           (unsigned)(u[2] & 0x3F) << 6 | (u[3] & 0x3F);
    return *w = 1, 0xFFFD;
}

/* JSON.stringify of a string; ensure_ascii: code points from U+007F as \uXXXX (UTF-16 units). */
static int gj_json_string(gj_ctx *x, gj_buf *b, const char *s, size_t n, bool ensure_ascii) {
    if (gj_buf_put(x, b, "\"", 1) != 0) return -1;
    size_t run = 0; /* start of the bytes not yet written */
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t w = 1;
        unsigned cp = c;
        if (c >= 0x7F && ensure_ascii) cp = gj_utf8_at(s, n, i, &w);
        bool esc = c < 0x20 || c == '"' || c == '\\' || (ensure_ascii && c >= 0x7F);
        if (!esc) {
            i++;
            continue;
        }
        if (gj_buf_put(x, b, s + run, i - run) != 0) return -1;
        const char *short_ = c == '"'    ? "\\\""
                             : c == '\\' ? "\\\\"
                             : c == '\b' ? "\\b"
                             : c == '\f' ? "\\f"
                             : c == '\n' ? "\\n"
                             : c == '\r' ? "\\r"
                             : c == '\t' ? "\\t"
                                         : NULL;
        int rc;
        if (short_)
            rc = gj_buf_puts(x, b, short_);
        else if (cp >= 0x10000)
            rc = gj_json_u(x, b, 0xD800 + ((cp - 0x10000) >> 10)) ||
                 gj_json_u(x, b, 0xDC00 + ((cp - 0x10000) & 0x3FF));
        else
            rc = gj_json_u(x, b, cp);
        if (rc != 0) return -1;
        i += w;
        run = i;
    }
    if (gj_buf_put(x, b, s + run, n - run) != 0) return -1;
    return gj_buf_put(x, b, "\"", 1);
}

static int gj_json_pad(gj_ctx *x, gj_buf *b, const gj_json_opts *o, int depth) {
    if (gj_buf_put(x, b, "\n", 1) != 0) return -1;
    for (long long i = 0; i < o->indent * depth; i++)
        if (gj_buf_put(x, b, " ", 1) != 0) return -1;
    return 0;
}

static int gj_cmp_keys(const void *a, const void *b, void *d) {
    const gj_val *v = d;
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    return strcmp(v->u.d.k[i], v->u.d.k[j]);
}

/* Dict entry order: insertion, or by key with sort_keys (an insertion sort: dicts are small). */
static size_t *gj_key_order(gj_ctx *x, const gj_val *v, bool sort) {
    size_t *ord = malloc((v->u.d.n ? v->u.d.n : 1) * sizeof *ord);
    if (!ord) {
        gj_fail(x, 0, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < v->u.d.n; i++) {
        size_t j = i;
        ord[i] = i;
        while (sort && j > 0 && gj_cmp_keys(&ord[j - 1], &ord[j], (void *)v) > 0) {
            size_t t = ord[j];
            ord[j] = ord[j - 1], ord[j - 1] = t, j--;
        }
    }
    return ord;
}

static int gj_json_container(gj_ctx *x, gj_buf *b, const gj_val *v, const gj_json_opts *o,
                             int depth, int line) {
    bool list = v->kind == GJ_LIST;
    size_t n = list ? v->u.l.n : v->u.d.n;
    const char *item_sep = o->item_sep ? o->item_sep
                           : o->indent ? ","
                                       : ", ",
               *key_sep = o->key_sep ? o->key_sep : ": ";
    size_t *ord = list ? NULL : gj_key_order(x, v, o->sort_keys);
    if (!list && !ord) return -1;
    int rc = gj_buf_put(x, b, list ? "[" : "{", 1);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        if (i > 0) rc = gj_buf_puts(x, b, item_sep);
        if (rc == 0 && o->indent) rc = gj_json_pad(x, b, o, depth + 1);
        if (rc == 0 && !list) {
            size_t k = ord[i];
            rc = gj_json_string(x, b, v->u.d.k[k], v->u.d.kn[k], o->ensure_ascii);
            if (rc == 0) rc = gj_buf_puts(x, b, key_sep);
        }
        if (rc == 0)
            rc = gj_write_json(x, b, list ? v->u.l.v[i] : v->u.d.v[ord[i]], o, depth + 1, line);
    }
    if (rc == 0 && o->indent && n > 0) rc = gj_json_pad(x, b, o, depth);
    if (rc == 0) rc = gj_buf_put(x, b, list ? "]" : "}", 1);
    free(ord);
    return rc;
}

int gj_write_json(gj_ctx *x, gj_buf *b, const gj_val *v, const gj_json_opts *o, int depth,
                  int line) {
    if (depth > GJ_MAX_VALUE_DEPTH) {
        gj_fail(x, line, "a value is nested more than %d levels deep", GJ_MAX_VALUE_DEPTH);
        return -1;
    }
    switch (v->kind) {
    case GJ_UNDEF: return gj_buf_puts(x, b, o->undef_as_null ? "null" : "undefined");
    case GJ_NONE: return gj_buf_puts(x, b, "null");
    case GJ_BOOL:
    case GJ_INT:
    case GJ_FLOAT: return gj_write_number(x, b, v, true);
    case GJ_STR: return gj_json_string(x, b, v->u.s.p, v->u.s.n, o->ensure_ascii);
    case GJ_LIST:
    case GJ_DICT:
    case GJ_NS: return gj_json_container(x, b, v, o, depth, line);
    default: gj_fail(x, line, "cannot convert %s to JSON", gj_kind_a(v->kind)); return -1;
    }
}

/* The text of {{ v }}: none and undefined write nothing, booleans "true"/"false", containers as
 * JSON with `undefined` left as is (@huggingface/jinja's toString). */
int gj_write(gj_ctx *x, gj_buf *b, const gj_val *v, int line) {
    static const gj_json_opts plain = {0};
    switch (v->kind) {
    case GJ_UNDEF:
    case GJ_NONE: return 0;
    case GJ_STR: return gj_buf_put(x, b, v->u.s.p, v->u.s.n);
    case GJ_BOOL:
    case GJ_INT:
    case GJ_FLOAT: return gj_write_number(x, b, v, false);
    case GJ_LIST:
    case GJ_DICT:
    case GJ_NS: return gj_write_json(x, b, v, &plain, 0, line);
    default: gj_fail(x, line, "cannot write %s as text", gj_kind_a(v->kind)); return -1;
    }
}

/* ---- the caller's context -------------------------------------------------------------------- */

gj_val *gj_from_json(gj_ctx *x, const json_t *j, int depth) {
    if (depth > GJ_MAX_VALUE_DEPTH) {
        gj_fail(x, 0, "the render context is nested more than %d levels deep", GJ_MAX_VALUE_DEPTH);
        return NULL;
    }
    switch (json_typeof(j)) {
    case JSON_NULL: return gj_new(x, GJ_NONE);
    case JSON_TRUE: return gj_new_bool(x, true);
    case JSON_FALSE: return gj_new_bool(x, false);
    case JSON_INTEGER: return gj_new_int(x, (long long)json_integer_value(j));
    case JSON_REAL: return gj_new_float(x, json_real_value(j));
    case JSON_STRING: return gj_new_str(x, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        gj_val *l = gj_new(x, GJ_LIST);
        for (size_t i = 0; l && i < json_array_size(j); i++) {
            gj_val *e = gj_from_json(x, json_array_get(j, i), depth + 1);
            if (!e || gj_list_push(x, l, e) != 0) {
                gj_unref(x, l);
                return NULL;
            }
        }
        return l;
    }
    case JSON_OBJECT: {
        gj_val *d = gj_new(x, GJ_DICT);
        const char *k;
        size_t kn;
        json_t *e;
        if (!d) return NULL;
        json_object_keylen_foreach((json_t *)j, k, kn, e) {
            gj_val *v = gj_from_json(x, e, depth + 1);
            if (!v || gj_dict_put(x, d, k, kn, v, false) != 0) { /* jansson's keys are unique */
                gj_unref(x, d);
                return NULL;
            }
        }
        return d;
    }
    }
    gj_fail(x, 0, "unsupported JSON value in the render context");
    return NULL;
}
