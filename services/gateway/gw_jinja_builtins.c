/* gw_jinja_builtins.c — the chat-template interpreter's library: filters, tests, methods and
 * global functions.
 *
 * Owns: the filter and test name tables (a name not in them is a parse error naming it);
 * filters: abs capitalize default/d dictsort first float indent int items join last length/count
 *   list lower map (attribute= or a filter name) reject rejectattr replace reverse safe select
 *   selectattr sort string title tojson trim unique upper;
 * tests: boolean callable defined undefined none string number integer float iterable mapping
 *   sequence odd even true false lower upper eq/equalto;
 * string methods: upper lower strip lstrip rstrip title capitalize startswith endswith split
 *   replace join format; dict methods: get items keys values;
 * globals: raise_exception range namespace strftime_now.
 * Case mapping (upper, lower, title, capitalize) is ASCII only; other characters pass unchanged.
 * Does not own: evaluation (gw_jinja.c), values (gw_jinja_value.c). */
#include "gw_jinja_int.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- text helpers ---------------------------------------------------------------------------- */

/* JavaScript's \s (what String.prototype.trim strips): ASCII white space, U+00A0, U+1680,
 * U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000, U+FEFF. */
bool gj_is_space_at(const char *s, size_t n, size_t i, size_t *w) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x80) {
        *w = 1;
        return c == ' ' || (c >= '\t' && c <= '\r');
    }
    unsigned cp = gj_utf8_at(s, n, i, w);
    return cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000 || cp == 0xFEFF;
}

static size_t gj_cp_count(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* Is s[i] one of chars (UTF-8)? NULL chars: white space. */
static bool gj_strip_char(const char *s, size_t n, size_t i, const gj_val *chars, size_t *w) {
    if (!chars) return gj_is_space_at(s, n, i, w);
    gj_utf8_at(s, n, i, w);
    for (size_t k = 0; k < chars->u.s.n;) {
        size_t cw;
        gj_utf8_at(chars->u.s.p, chars->u.s.n, k, &cw);
        if (cw == *w && memcmp(chars->u.s.p + k, s + i, cw) == 0) return true;
        k += cw;
    }
    return false;
}

/* strip (left, right or both) of chars (NULL: white space). */
static gj_val *gj_strip(gj_ctx *x, const gj_val *v, bool left, bool right, const gj_val *chars) {
    const char *s = v->u.s.p;
    size_t a = 0, b = v->u.s.n, w;
    while (left && a < b && gj_strip_char(s, b, a, chars, &w)) a += w;
    while (right && b > a) {
        size_t start = b - 1;
        while (start > a && ((unsigned char)s[start] & 0xC0) == 0x80) start--;
        if (!gj_strip_char(s, b, start, chars, &w) || start + w != b) break;
        b = start;
    }
    return gj_new_str(x, s + a, b - a);
}

typedef enum { GJ_CASE_UPPER, GJ_CASE_LOWER, GJ_CASE_TITLE, GJ_CASE_CAPITALIZE } gj_case;

static gj_val *gj_recase(gj_ctx *x, const gj_val *v, gj_case how) {
    gj_val *r = gj_new_str(x, v->u.s.p, v->u.s.n);
    if (!r) return NULL;
    bool prev_alpha = false;
    for (size_t i = 0; i < r->u.s.n; i++) {
        unsigned char c = (unsigned char)r->u.s.p[i];
        bool up = how == GJ_CASE_UPPER || (how == GJ_CASE_TITLE && !prev_alpha) ||
                  (how == GJ_CASE_CAPITALIZE && i == 0);
        r->u.s.p[i] = (char)(c >= 0x80 ? c : up ? toupper(c) : tolower(c));
        prev_alpha = isalpha(c) || (c >= 0x80 && prev_alpha);
    }
    return r;
}

/* replace(old, new[, count]) as Python's str.replace (an empty old inserts between characters). */
static gj_val *gj_replace(gj_ctx *x, const gj_val *s, const gj_val *old, const gj_val *new_,
                          long long count) {
    gj_buf b = {0};
    size_t i = 0, n = s->u.s.n, on = old->u.s.n;
    long long done = 0;
    int rc = 0;
    while (rc == 0 && i <= n && (count < 0 || done < count)) {
        if (on == 0) {
            size_t w = 1;
            rc = gj_buf_put(x, &b, new_->u.s.p, new_->u.s.n);
            if (i < n) gj_utf8_at(s->u.s.p, n, i, &w);
            if (rc == 0 && i < n) rc = gj_buf_put(x, &b, s->u.s.p + i, w);
            i += w, done++;
            continue;
        }
        const char *hit = NULL;
        for (size_t k = i; k + on <= n && !hit; k++)
            if (memcmp(s->u.s.p + k, old->u.s.p, on) == 0) hit = s->u.s.p + k;
        if (!hit) break;
        rc = gj_buf_put(x, &b, s->u.s.p + i, (size_t)(hit - s->u.s.p) - i);
        if (rc == 0) rc = gj_buf_put(x, &b, new_->u.s.p, new_->u.s.n);
        i = (size_t)(hit - s->u.s.p) + on, done++;
    }
    if (rc == 0 && i < n) rc = gj_buf_put(x, &b, s->u.s.p + i, n - i);
    if (rc != 0) {
        free(b.p);
        return NULL;
    }
    return gj_new_str_buf(x, &b);
}

static int gj_push_str(gj_ctx *x, gj_val *list, const char *s, size_t n) {
    gj_val *e = gj_new_str(x, s, n);
    return e ? gj_list_push(x, list, e) : -1;
}

/* split(sep=None, maxsplit=-1) as Python's str.split. */
static gj_val *gj_split(gj_ctx *x, const gj_val *s, const gj_val *sep, long long maxsplit,
                        int line) {
    gj_val *l = gj_new(x, GJ_LIST);
    const char *p = s->u.s.p;
    size_t n = s->u.s.n, i = 0, w;
    if (!l) return NULL;
    if (sep && sep->u.s.n == 0) {
        gj_fail(x, line, "split(): empty separator");
        goto fail;
    }
    for (long long splits = 0;; splits++) {
        if (!sep) {
            while (i < n && gj_is_space_at(p, n, i, &w)) i += w;
            if (i >= n) break;
        }
        size_t end = i;
        bool found = false;
        if (maxsplit < 0 || splits < maxsplit) {
            for (; end < n; end += sep ? 1 : w) {
                if (sep ? end + sep->u.s.n <= n && memcmp(p + end, sep->u.s.p, sep->u.s.n) == 0
                        : gj_is_space_at(p, n, end, &w)) {
                    found = true;
                    break;
                }
                if (!sep) gj_utf8_at(p, n, end, &w);
            }
        } else
            end = n;
        if (!sep && !found && end == n &&
            (maxsplit >= 0 && splits >= maxsplit)) { /* the rest, trailing space kept */
            if (gj_push_str(x, l, p + i, n - i) != 0) goto fail;
            break;
        }
        if (gj_push_str(x, l, p + i, end - i) != 0) goto fail;
        if (!found) break;
        i = end + (sep ? sep->u.s.n : w);
    }
    return l;
fail:
    gj_unref(x, l);
    return NULL;
}

static bool gj_affix(const gj_val *s, const gj_val *a, bool prefix) {
    if (a->u.s.n > s->u.s.n) return false;
    return memcmp(s->u.s.p + (prefix ? 0 : s->u.s.n - a->u.s.n), a->u.s.p, a->u.s.n) == 0;
}

/* ---- arguments ------------------------------------------------------------------------------- */

/* Argument `pos` or keyword `name`, borrowed; NULL when not given. */
static gj_val *gj_arg(gj_val **args, size_t n, const gj_val *kw, size_t pos, const char *name) {
    if (pos < n) return args[pos];
    return kw && name ? gj_dict_get(kw, name, strlen(name)) : NULL;
}

static bool gj_arg_kind(gj_ctx *x, const gj_val *a, gj_kind kind, const char *what, int line) {
    if (!a || a->kind == kind) return true;
    gj_fail(x, line, "%s must be %s, not %s", what, gj_kind_a(kind), gj_kind_a(a->kind));
    return false;
}

/* ---- tests ----------------------------------------------------------------------------------- */

static const char *const gj_test_names[] = {
    [GJ_TE_BOOLEAN] = "boolean", [GJ_TE_CALLABLE] = "callable", [GJ_TE_DEFINED] = "defined",
    [GJ_TE_EQ] = "eq",           [GJ_TE_EVEN] = "even",         [GJ_TE_FALSE] = "false",
    [GJ_TE_FLOAT] = "float",     [GJ_TE_INTEGER] = "integer",   [GJ_TE_ITERABLE] = "iterable",
    [GJ_TE_LOWER] = "lower",     [GJ_TE_MAPPING] = "mapping",   [GJ_TE_NONE] = "none",
    [GJ_TE_NUMBER] = "number",   [GJ_TE_ODD] = "odd",           [GJ_TE_SEQUENCE] = "sequence",
    [GJ_TE_STRING] = "string",   [GJ_TE_TRUE] = "true",         [GJ_TE_UNDEFINED] = "undefined",
    [GJ_TE_UPPER] = "upper"};

gj_test gj_test_lookup(const char *name) {
    if (!strcmp(name, "equalto") || !strcmp(name, "==")) return GJ_TE_EQ;
    for (size_t i = 1; i < sizeof gj_test_names / sizeof gj_test_names[0]; i++)
        if (gj_test_names[i] && !strcmp(name, gj_test_names[i])) return (gj_test)i;
    return GJ_TE_UNKNOWN;
}

static bool gj_all_case(const gj_val *v, bool upper) {
    if (v->kind != GJ_STR) return false;
    for (size_t i = 0; i < v->u.s.n; i++) {
        int c = (unsigned char)v->u.s.p[i];
        if (upper ? islower(c) : isupper(c)) return false;
    }
    return true;
}

int gj_test_apply(gj_ctx *x, gj_test t, const gj_val *v, const gj_val *arg, int line) {
    gj_kind k = v->kind;
    switch (t) {
    case GJ_TE_BOOLEAN: return k == GJ_BOOL;
    case GJ_TE_CALLABLE: return k == GJ_FUNC;
    case GJ_TE_DEFINED: return k != GJ_UNDEF;
    case GJ_TE_UNDEFINED: return k == GJ_UNDEF;
    case GJ_TE_NONE: return k == GJ_NONE;
    case GJ_TE_STRING: return k == GJ_STR;
    case GJ_TE_NUMBER: return k == GJ_INT || k == GJ_FLOAT;
    case GJ_TE_INTEGER: return k == GJ_INT;
    case GJ_TE_FLOAT: return k == GJ_FLOAT;
    case GJ_TE_ITERABLE: return k == GJ_LIST || k == GJ_STR || k == GJ_DICT;
    case GJ_TE_MAPPING: return k == GJ_DICT;
    case GJ_TE_SEQUENCE: return k == GJ_LIST || k == GJ_STR || k == GJ_DICT;
    case GJ_TE_TRUE: return k == GJ_BOOL && v->u.b;
    case GJ_TE_FALSE: return k == GJ_BOOL && !v->u.b;
    case GJ_TE_LOWER: return gj_all_case(v, false);
    case GJ_TE_UPPER: return gj_all_case(v, true);
    case GJ_TE_EQ:
        if (!arg) {
            gj_fail(x, line, "test 'eq' needs a value to compare with");
            return -1;
        }
        return gj_equal(v, arg);
    case GJ_TE_ODD:
    case GJ_TE_EVEN:
        if (k != GJ_INT) {
            gj_fail(x, line, "test '%s' needs an integer, not %s", gj_test_names[t], gj_kind_a(k));
            return -1;
        }
        return (v->u.i % 2 != 0) == (t == GJ_TE_ODD);
    default: gj_fail(x, line, "unknown test"); return -1;
    }
}

/* ---- filters --------------------------------------------------------------------------------- */

static const char *const gj_filter_names[] = {[GJ_FI_ABS] = "abs",
                                              [GJ_FI_CAPITALIZE] = "capitalize",
                                              [GJ_FI_DEFAULT] = "default",
                                              [GJ_FI_DICTSORT] = "dictsort",
                                              [GJ_FI_FIRST] = "first",
                                              [GJ_FI_FLOAT] = "float",
                                              [GJ_FI_INDENT] = "indent",
                                              [GJ_FI_INT] = "int",
                                              [GJ_FI_ITEMS] = "items",
                                              [GJ_FI_JOIN] = "join",
                                              [GJ_FI_LAST] = "last",
                                              [GJ_FI_LENGTH] = "length",
                                              [GJ_FI_LIST] = "list",
                                              [GJ_FI_LOWER] = "lower",
                                              [GJ_FI_MAP] = "map",
                                              [GJ_FI_REJECT] = "reject",
                                              [GJ_FI_REJECTATTR] = "rejectattr",
                                              [GJ_FI_REPLACE] = "replace",
                                              [GJ_FI_REVERSE] = "reverse",
                                              [GJ_FI_SAFE] = "safe",
                                              [GJ_FI_SELECT] = "select",
                                              [GJ_FI_SELECTATTR] = "selectattr",
                                              [GJ_FI_SORT] = "sort",
                                              [GJ_FI_STRING] = "string",
                                              [GJ_FI_TITLE] = "title",
                                              [GJ_FI_TOJSON] = "tojson",
                                              [GJ_FI_TRIM] = "trim",
                                              [GJ_FI_UNIQUE] = "unique",
                                              [GJ_FI_UPPER] = "upper"};

gj_filter gj_filter_lookup(const char *name) {
    if (!strcmp(name, "d")) return GJ_FI_DEFAULT;
    if (!strcmp(name, "count")) return GJ_FI_LENGTH;
    if (!strcmp(name, "e") || !strcmp(name, "escape")) return GJ_FI_UNKNOWN;
    for (size_t i = 1; i < sizeof gj_filter_names / sizeof gj_filter_names[0]; i++)
        if (gj_filter_names[i] && !strcmp(name, gj_filter_names[i])) return (gj_filter)i;
    return GJ_FI_UNKNOWN;
}

static gj_val *gj_bad_operand(gj_ctx *x, const gj_node *e, const gj_val *v) {
    gj_fail(x, e->line, "filter '%s' cannot take %s", e->str, gj_kind_a(v->kind));
    return NULL;
}

/* attribute path "a.b.0" of v (map(attribute=), selectattr): borrowed, NULL when absent. */
static gj_val *gj_attr_path(gj_val *v, const gj_val *path) {
    const char *p = path->u.s.p, *end = p + path->u.s.n;
    while (v) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t n = dot ? (size_t)(dot - p) : (size_t)(end - p);
        if (v->kind == GJ_DICT || v->kind == GJ_NS)
            v = gj_dict_get(v, p, n);
        else if (v->kind == GJ_LIST && n > 0 && n < 19 && strspn(p, "0123456789") >= n) {
            size_t i = (size_t)strtoull(p, NULL, 10);
            v = i < v->u.l.n ? v->u.l.v[i] : NULL;
        } else
            v = NULL;
        if (!dot) break;
        p = dot + 1;
    }
    return v;
}

static gj_val *gj_f_tojson(gj_ctx *x, const gj_val *v, gj_val **args, size_t n, gj_val *kw,
                           int line) {
    gj_json_opts o = {.undef_as_null = true};
    gj_val *indent = gj_arg(args, n, kw, 0, "indent"), *ea = gj_arg(NULL, 0, kw, 0, "ensure_ascii");
    gj_val *sk = gj_arg(NULL, 0, kw, 0, "sort_keys"), *sep = gj_arg(NULL, 0, kw, 0, "separators");
    if (indent && indent->kind != GJ_NONE &&
        !gj_arg_kind(x, indent, GJ_INT, "tojson's indent", line))
        return NULL;
    if (!gj_arg_kind(x, ea, GJ_BOOL, "tojson's ensure_ascii", line) ||
        !gj_arg_kind(x, sk, GJ_BOOL, "tojson's sort_keys", line))
        return NULL;
    if (sep && sep->kind != GJ_NONE) {
        if (sep->kind != GJ_LIST || sep->u.l.n != 2 || sep->u.l.v[0]->kind != GJ_STR ||
            sep->u.l.v[1]->kind != GJ_STR) {
            gj_fail(x, line, "tojson's separators must be two strings");
            return NULL;
        }
        o.item_sep = sep->u.l.v[0]->u.s.p, o.key_sep = sep->u.l.v[1]->u.s.p;
    }
    if (indent && indent->kind == GJ_INT)
        o.indent = indent->u.i < 0 ? 0 : indent->u.i > 64 ? 64 : indent->u.i;
    o.ensure_ascii = ea && ea->u.b, o.sort_keys = sk && sk->u.b;
    gj_buf b = {0};
    if (gj_write_json(x, &b, v, &o, 0, line) != 0) {
        free(b.p);
        return NULL;
    }
    return gj_new_str_buf(x, &b);
}

/* join(d=''[, attribute]) */
static gj_val *gj_f_join(gj_ctx *x, const gj_node *e, const gj_val *v, gj_val **args, size_t n,
                         gj_val *kw) {
    gj_val *sep = gj_arg(args, n, kw, 0, "d"), *attr = gj_arg(args, n, kw, 1, "attribute");
    if (!sep) sep = gj_arg(NULL, 0, kw, 0, "separator");
    if (!gj_arg_kind(x, sep, GJ_STR, "join's separator", e->line) ||
        !gj_arg_kind(x, attr, GJ_STR, "join's attribute", e->line))
        return NULL;
    if (v->kind == GJ_STR) {
        gj_val *l = gj_new(x, GJ_LIST), *r = NULL;
        size_t w;
        for (size_t i = 0; l && i < v->u.s.n; i += w) {
            gj_utf8_at(v->u.s.p, v->u.s.n, i, &w);
            if (gj_push_str(x, l, v->u.s.p + i, w) != 0) gj_unref(x, l), l = NULL;
        }
        if (l) r = gj_f_join(x, e, l, args, n, kw);
        gj_unref(x, l);
        return r;
    }
    if (v->kind != GJ_LIST) return gj_bad_operand(x, e, v);
    gj_buf b = {0};
    for (size_t i = 0; i < v->u.l.n; i++) {
        const gj_val *it = attr ? gj_attr_path(v->u.l.v[i], attr) : v->u.l.v[i];
        if ((i > 0 && sep && gj_buf_put(x, &b, sep->u.s.p, sep->u.s.n) != 0) ||
            (it && gj_write(x, &b, it, e->line) != 0)) {
            free(b.p);
            return NULL;
        }
    }
    return gj_new_str_buf(x, &b);
}

/* indent(width=4, first=False, blank=False) */
static gj_val *gj_f_indent(gj_ctx *x, const gj_node *e, const gj_val *v, gj_val **args, size_t n,
                           gj_val *kw) {
    gj_val *width = gj_arg(args, n, kw, 0, "width"), *first = gj_arg(args, n, kw, 1, "first");
    gj_val *blank = gj_arg(args, n, kw, 2, "blank");
    char pad[65];
    const char *pp = pad;
    size_t pn = 4;
    memset(pad, ' ', sizeof pad);
    if (width && width->kind == GJ_INT)
        pn = width->u.i < 0 ? 0 : width->u.i > 64 ? 64 : (size_t)width->u.i;
    else if (width && width->kind == GJ_STR)
        pp = width->u.s.p, pn = width->u.s.n;
    else if (width)
        return gj_bad_operand(x, e, width);
    if (v->kind != GJ_STR) return gj_bad_operand(x, e, v);
    gj_buf b = {0};
    const char *s = v->u.s.p, *end = s + v->u.s.n;
    for (bool first_line = true;; first_line = false) {
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        size_t len = nl ? (size_t)(nl - s) : (size_t)(end - s);
        bool skip = (first_line && !(first && gj_truthy(first))) ||
                    (len == 0 && !(blank && gj_truthy(blank)));
        if ((!skip && gj_buf_put(x, &b, pp, pn) != 0) || gj_buf_put(x, &b, s, len) != 0 ||
            (nl && gj_buf_put(x, &b, "\n", 1) != 0)) {
            free(b.p);
            return NULL;
        }
        if (!nl) break;
        s = nl + 1;
    }
    return gj_new_str_buf(x, &b);
}

/* select/reject([test[, value]]) and selectattr/rejectattr(attribute[, test[, value]]). */
static gj_val *gj_f_select(gj_ctx *x, const gj_node *e, const gj_val *v, gj_val **args, size_t n) {
    bool by_attr = e->op == GJ_FI_SELECTATTR || e->op == GJ_FI_REJECTATTR;
    bool select = e->op == GJ_FI_SELECTATTR || e->op == GJ_FI_SELECT;
    gj_val *attr = by_attr && n > 0 ? args[0] : NULL;
    size_t t0 = by_attr ? 1 : 0;
    gj_val *tname = n > t0 ? args[t0] : NULL, *targ = n > t0 + 1 ? args[t0 + 1] : NULL;
    if (by_attr && !attr) {
        gj_fail(x, e->line, "%s needs an attribute name", e->str);
        return NULL;
    }
    if (!gj_arg_kind(x, attr, GJ_STR, "the attribute", e->line) ||
        !gj_arg_kind(x, tname, GJ_STR, "the test", e->line))
        return NULL;
    gj_test t = tname ? gj_test_lookup(tname->u.s.p) : GJ_TE_UNKNOWN;
    if (tname && t == GJ_TE_UNKNOWN) {
        gj_fail(x, e->line, "unknown test '%s'", tname->u.s.p);
        return NULL;
    }
    if (v->kind == GJ_UNDEF) return gj_new(x, GJ_LIST);
    if (v->kind != GJ_LIST) return gj_bad_operand(x, e, v);
    gj_val *out = gj_new(x, GJ_LIST), undef = {.kind = GJ_UNDEF, .refs = 1};
    for (size_t i = 0; out && i < v->u.l.n; i++) {
        gj_val *item = v->u.l.v[i], *a = attr ? gj_attr_path(item, attr) : item;
        int r = tname ? gj_test_apply(x, t, a ? a : &undef, targ, e->line) : a && gj_truthy(a);
        if (r < 0 || (r == select && gj_list_push(x, out, gj_ref(item)) != 0))
            gj_unref(x, out), out = NULL;
    }
    return out;
}

/* map(attribute=name[, default=value]) */
static gj_val *gj_filter_run(gj_ctx *x, const gj_node *e, gj_val *v, gj_val **args, size_t n,
                             gj_val *kw);
static gj_val *gj_dict_items(gj_ctx *x, const gj_val *d, int what);

/* map(attribute=name[, default=value]), or map('filter', filter arguments...) */
static gj_val *gj_f_map(gj_ctx *x, const gj_node *e, const gj_val *v, gj_val **args, size_t n,
                        gj_val *kw) {
    gj_val *attr = gj_arg(NULL, 0, kw, 0, "attribute"), *def = gj_arg(NULL, 0, kw, 0, "default");
    gj_node fe = {.kind = GJ_E_FILTER, .line = e->line};
    if (!attr && (n == 0 || args[0]->kind != GJ_STR)) {
        gj_fail(x, e->line, "map needs attribute= or a filter name");
        return NULL;
    }
    if (!gj_arg_kind(x, attr, GJ_STR, "map's attribute", e->line)) return NULL;
    if (!attr && (fe.op = (int)gj_filter_lookup(args[0]->u.s.p)) == GJ_FI_UNKNOWN) {
        gj_fail(x, e->line, "unknown filter '%s'", args[0]->u.s.p);
        return NULL;
    }
    fe.str = attr ? NULL : args[0]->u.s.p;
    if (v->kind != GJ_LIST) return gj_bad_operand(x, e, v);
    gj_val *out = gj_new(x, GJ_LIST);
    for (size_t i = 0; out && i < v->u.l.n; i++) {
        gj_val *a = attr ? gj_attr_path(v->u.l.v[i], attr) : NULL, *m;
        if (!attr)
            m = gj_filter_run(x, &fe, v->u.l.v[i], args + 1, n - 1, kw);
        else
            m = a ? gj_ref(a) : def ? gj_ref(def) : gj_new(x, GJ_UNDEF);
        if (!m || gj_list_push(x, out, m) != 0) gj_unref(x, out), out = NULL;
    }
    return out;
}

/* The order of two values for sort/dictsort: numbers by value, strings by bytes (folding ASCII
 * case unless case_sensitive), none/undefined equal to each other; other mixes are an error. */
static int gj_order(gj_ctx *x, const gj_val *a, const gj_val *b, bool case_sensitive, int line) {
    bool an = a->kind == GJ_INT || a->kind == GJ_FLOAT || a->kind == GJ_BOOL;
    bool bn = b->kind == GJ_INT || b->kind == GJ_FLOAT || b->kind == GJ_BOOL;
    if (an && bn) {
        double fa = a->kind == GJ_FLOAT ? a->u.f : a->kind == GJ_INT ? (double)a->u.i : a->u.b;
        double fb = b->kind == GJ_FLOAT ? b->u.f : b->kind == GJ_INT ? (double)b->u.i : b->u.b;
        return (fa > fb) - (fa < fb);
    }
    if (a->kind == GJ_STR && b->kind == GJ_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        for (size_t i = 0; i < n; i++) {
            int ca = (unsigned char)a->u.s.p[i], cb = (unsigned char)b->u.s.p[i];
            if (!case_sensitive) ca = tolower(ca), cb = tolower(cb);
            if (ca != cb) return ca < cb ? -1 : 1;
        }
        return (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
    }
    bool ablank = a->kind == GJ_NONE || a->kind == GJ_UNDEF,
         bblank = b->kind == GJ_NONE || b->kind == GJ_UNDEF;
    if (ablank && bblank) return 0;
    gj_fail(x, line, "cannot order %s and %s", gj_kind_a(a->kind), gj_kind_a(b->kind));
    return 2;
}

typedef struct gj_sort_key {
    gj_val *item;      /* what the result holds */
    const gj_val *key; /* what it is ordered by */
} gj_sort_key;

/* A stable merge sort of k[0..n) (tmp: n more); -1 when two keys cannot be ordered. */
static int gj_merge_sort(gj_ctx *x, gj_sort_key *k, gj_sort_key *tmp, size_t n, bool cs, bool rev,
                         int line) {
    if (n < 2) return 0;
    size_t h = n / 2, i = 0, j = h, o = 0;
    if (gj_merge_sort(x, k, tmp, h, cs, rev, line) != 0 ||
        gj_merge_sort(x, k + h, tmp, n - h, cs, rev, line) != 0)
        return -1;
    if (gj_charge(x, n, line) != 0) return -1;
    while (i < h && j < n) {
        int c = gj_order(x, k[i].key, k[j].key, cs, line);
        if (c == 2) return -1;
        tmp[o++] = (rev ? c < 0 : c > 0) ? k[j++] : k[i++];
    }
    while (i < h) tmp[o++] = k[i++];
    while (j < n) tmp[o++] = k[j++];
    memcpy(k, tmp, n * sizeof *k);
    return 0;
}

/* The items of list (or, by_value 0/1 for dictsort, the [key, value] pairs), sorted. */
static gj_val *gj_sorted(gj_ctx *x, gj_val *list, const gj_val *attr, int by, bool cs, bool rev,
                         int line) {
    size_t n = list->u.l.n;
    gj_sort_key *k = calloc(2 * (n ? n : 1), sizeof *k);
    gj_val *out = NULL, undef = {.kind = GJ_UNDEF, .refs = 1};
    if (!k) {
        gj_fail(x, line, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        gj_val *it = list->u.l.v[i];
        const gj_val *key = by >= 0 ? it->u.l.v[by] : attr ? gj_attr_path(it, attr) : it;
        k[i] = (gj_sort_key){it, key ? key : &undef};
    }
    if (gj_merge_sort(x, k, k + n, n, cs, rev, line) == 0) out = gj_new(x, GJ_LIST);
    for (size_t i = 0; out && i < n; i++)
        if (gj_list_push(x, out, gj_ref(k[i].item)) != 0) gj_unref(x, out), out = NULL;
    free(k);
    return out;
}

/* sort(reverse=false, case_sensitive=false, attribute=none); dictsort(case_sensitive=false,
 * by='key', reverse=false). */
static gj_val *gj_f_sort(gj_ctx *x, const gj_node *e, gj_val *v, gj_val **args, size_t n,
                         gj_val *kw) {
    bool dict = e->op == GJ_FI_DICTSORT;
    gj_val *rev = gj_arg(args, n, kw, dict ? 2 : 0, "reverse"),
           *cs = gj_arg(args, n, kw, dict ? 0 : 1, "case_sensitive");
    gj_val *attr = dict ? NULL : gj_arg(args, n, kw, 2, "attribute"),
           *by = dict ? gj_arg(args, n, kw, 1, "by") : NULL;
    if (attr && attr->kind == GJ_NONE) attr = NULL;
    if (!gj_arg_kind(x, attr, GJ_STR, "sort's attribute", e->line) ||
        !gj_arg_kind(x, by, GJ_STR, "dictsort's by", e->line))
        return NULL;
    if (by && strcmp(by->u.s.p, "key") != 0 && strcmp(by->u.s.p, "value") != 0) {
        gj_fail(x, e->line, "dictsort's by must be 'key' or 'value'");
        return NULL;
    }
    if (dict ? v->kind != GJ_DICT : v->kind != GJ_LIST) return gj_bad_operand(x, e, v);
    gj_val *list = dict ? gj_dict_items(x, v, 0) : gj_ref(v), *r = NULL;
    int key_at = !dict ? -1 : by && by->u.s.p[0] == 'v' ? 1 : 0;
    if (list)
        r = gj_sorted(x, list, attr, key_at, cs && gj_truthy(cs), rev && gj_truthy(rev), e->line);
    gj_unref(x, list);
    return r;
}

/* unique(case_sensitive=false, attribute=none): the first of each group of equal items. */
static gj_val *gj_f_unique(gj_ctx *x, const gj_node *e, gj_val *v, gj_val **args, size_t n,
                           gj_val *kw) {
    gj_val *cs = gj_arg(args, n, kw, 0, "case_sensitive"),
           *attr = gj_arg(args, n, kw, 1, "attribute");
    if (attr && attr->kind == GJ_NONE) attr = NULL;
    if (!gj_arg_kind(x, attr, GJ_STR, "unique's attribute", e->line)) return NULL;
    if (v->kind != GJ_LIST) return gj_bad_operand(x, e, v);
    gj_val *out = gj_new(x, GJ_LIST), undef = {.kind = GJ_UNDEF, .refs = 1};
    bool sens = cs && gj_truthy(cs);
    for (size_t i = 0; out && i < v->u.l.n; i++) {
        const gj_val *ki = attr ? gj_attr_path(v->u.l.v[i], attr) : v->u.l.v[i];
        bool seen = false;
        if (gj_charge(x, out->u.l.n + 1, e->line) != 0) break;
        for (size_t j = 0; j < out->u.l.n && !seen; j++) {
            const gj_val *kj = attr ? gj_attr_path(out->u.l.v[j], attr) : out->u.l.v[j];
            const gj_val *a = ki ? ki : &undef, *b = kj ? kj : &undef;
            seen = a->kind == GJ_STR && b->kind == GJ_STR && !sens
                       ? gj_order(x, a, b, false, e->line) == 0
                       : gj_equal(a, b);
        }
        if (!seen && gj_list_push(x, out, gj_ref(v->u.l.v[i])) != 0) break;
    }
    if (x->failed) gj_unref(x, out), out = NULL;
    return out;
}

/* Entry i of a dict: [key, value] (what 0), the key (1) or the value (2). */
static gj_val *gj_dict_entry(gj_ctx *x, const gj_val *d, size_t i, int what) {
    if (what == 2) return gj_ref(d->u.d.v[i]);
    gj_val *k = gj_new_str(x, d->u.d.k[i], d->u.d.kn[i]);
    if (!k || what == 1) return k;
    gj_val *pair = gj_new(x, GJ_LIST);
    if (!pair) {
        gj_unref(x, k);
        return NULL;
    }
    if (gj_list_push(x, pair, k) != 0 || gj_list_push(x, pair, gj_ref(d->u.d.v[i])) != 0) {
        gj_unref(x, pair);
        return NULL;
    }
    return pair;
}

static gj_val *gj_dict_items(gj_ctx *x, const gj_val *d, int what /* 0 items, 1 keys, 2 values */) {
    gj_val *l = gj_new(x, GJ_LIST);
    for (size_t i = 0; l && i < d->u.d.n; i++) {
        gj_val *e = gj_dict_entry(x, d, i, what);
        if (!e || gj_list_push(x, l, e) != 0) gj_unref(x, l), l = NULL;
    }
    return l;
}

/* Python's int()/float() of a string (surrounding space allowed); def, or 0, when not a number. */
static gj_val *gj_parse_number(gj_ctx *x, const gj_val *s, bool want_int, const gj_val *def) {
    char buf[64];
    size_t n = s->u.s.n < sizeof buf - 1 ? s->u.s.n : sizeof buf - 1;
    memcpy(buf, s->u.s.p, n);
    buf[n] = '\0';
    char *end;
    double f = strtod(buf, &end);
    while (end != buf && *end && isspace((unsigned char)*end)) end++;
    if (end == buf || *end || s->u.s.n >= sizeof buf || isnan(f) ||
        (want_int && !(fabs(f) < 9.2e18)))
        return def ? gj_ref((gj_val *)def) : want_int ? gj_new_int(x, 0) : gj_new_float(x, 0);
    return want_int ? gj_new_int(x, (long long)f) : gj_new_float(x, f);
}

static gj_val *gj_f_number(gj_ctx *x, const gj_node *e, const gj_val *v, gj_val **args, size_t n,
                           gj_val *kw) {
    bool want_int = e->op == GJ_FI_INT;
    gj_val *def = gj_arg(args, n, kw, 0, "default");
    switch (v->kind) {
    case GJ_STR: return gj_parse_number(x, v, want_int, def);
    case GJ_INT: return want_int ? gj_new_int(x, v->u.i) : gj_new_float(x, (double)v->u.i);
    case GJ_BOOL: return want_int ? gj_new_int(x, v->u.b) : gj_new_float(x, v->u.b);
    case GJ_FLOAT:
        if (!want_int) return gj_new_float(x, v->u.f);
        if (!(fabs(v->u.f) < 9.2e18)) return def ? gj_ref(def) : gj_new_int(x, 0);
        return gj_new_int(x, (long long)v->u.f);
    default: return def ? gj_ref(def) : want_int ? gj_new_int(x, 0) : gj_new_float(x, 0);
    }
}

static gj_val *gj_f_reverse(gj_ctx *x, const gj_node *e, const gj_val *v) {
    if (v->kind == GJ_STR) {
        gj_val *r = gj_new_str(x, v->u.s.p, v->u.s.n);
        size_t w;
        for (size_t i = 0; r && i < v->u.s.n; i += w) {
            gj_utf8_at(v->u.s.p, v->u.s.n, i, &w);
            memcpy(r->u.s.p + v->u.s.n - i - w, v->u.s.p + i, w);
        }
        return r;
    }
    if (v->kind != GJ_LIST) return gj_bad_operand(x, e, v);
    gj_val *l = gj_new(x, GJ_LIST);
    for (size_t i = v->u.l.n; l && i > 0; i--)
        if (gj_list_push(x, l, gj_ref(v->u.l.v[i - 1])) != 0) gj_unref(x, l), l = NULL;
    return l;
}

/* first / last / list / length of a list, string or dict. */
static gj_val *gj_f_sequence(gj_ctx *x, const gj_node *e, gj_val *v) {
    gj_filter f = (gj_filter)e->op;
    if (f == GJ_FI_LENGTH) {
        if (v->kind == GJ_STR) return gj_new_int(x, (long long)gj_cp_count(v->u.s.p, v->u.s.n));
        if (v->kind == GJ_LIST) return gj_new_int(x, (long long)v->u.l.n);
        if (v->kind == GJ_DICT || v->kind == GJ_NS) return gj_new_int(x, (long long)v->u.d.n);
        if (v->kind == GJ_UNDEF) return gj_new_int(x, 0);
        return gj_bad_operand(x, e, v);
    }
    if (v->kind == GJ_DICT) {
        gj_val *keys = gj_dict_items(x, v, 1), *r = keys ? gj_f_sequence(x, e, keys) : NULL;
        gj_unref(x, keys);
        return r;
    }
    if (v->kind == GJ_STR) {
        gj_val *chars = gj_new(x, GJ_LIST), *r = NULL;
        size_t w;
        for (size_t i = 0; chars && i < v->u.s.n; i += w) {
            gj_utf8_at(v->u.s.p, v->u.s.n, i, &w);
            if (gj_push_str(x, chars, v->u.s.p + i, w) != 0) gj_unref(x, chars), chars = NULL;
        }
        if (chars) r = gj_f_sequence(x, e, chars);
        gj_unref(x, chars);
        return r;
    }
    if (v->kind != GJ_LIST) return gj_bad_operand(x, e, v);
    if (f == GJ_FI_LIST) return gj_ref(v);
    if (v->u.l.n == 0) return gj_new(x, GJ_UNDEF);
    return gj_ref(v->u.l.v[f == GJ_FI_FIRST ? 0 : v->u.l.n - 1]);
}

/* Filters on a string only. */
static gj_val *gj_f_text(gj_ctx *x, const gj_node *e, const gj_val *v, gj_val **args, size_t n,
                         gj_val *kw) {
    if (v->kind != GJ_STR) return gj_bad_operand(x, e, v);
    switch ((gj_filter)e->op) {
    case GJ_FI_TRIM: {
        gj_val *chars = gj_arg(args, n, kw, 0, "chars");
        if (chars && chars->kind == GJ_NONE) chars = NULL;
        return gj_arg_kind(x, chars, GJ_STR, "trim's chars", e->line)
                   ? gj_strip(x, v, true, true, chars)
                   : NULL;
    }
    case GJ_FI_UPPER: return gj_recase(x, v, GJ_CASE_UPPER);
    case GJ_FI_LOWER: return gj_recase(x, v, GJ_CASE_LOWER);
    case GJ_FI_TITLE: return gj_recase(x, v, GJ_CASE_TITLE);
    case GJ_FI_CAPITALIZE: return gj_recase(x, v, GJ_CASE_CAPITALIZE);
    default: { /* replace */
        gj_val *old = gj_arg(args, n, kw, 0, "old"), *new_ = gj_arg(args, n, kw, 1, "new"),
               *cnt = gj_arg(args, n, kw, 2, "count");
        if (!old || !new_ || old->kind != GJ_STR || new_->kind != GJ_STR ||
            (cnt && cnt->kind != GJ_INT && cnt->kind != GJ_NONE)) {
            gj_fail(x, e->line, "replace needs two strings (and an optional count)");
            return NULL;
        }
        return gj_replace(x, v, old, new_, cnt && cnt->kind == GJ_INT ? cnt->u.i : -1);
    }
    }
}

static gj_val *gj_filter_run(gj_ctx *x, const gj_node *e, gj_val *v, gj_val **args, size_t n,
                             gj_val *kw) {
    switch ((gj_filter)e->op) {
    case GJ_FI_SAFE: return gj_ref(v);
    case GJ_FI_TOJSON: return gj_f_tojson(x, v, args, n, kw, e->line);
    case GJ_FI_JOIN: return gj_f_join(x, e, v, args, n, kw);
    case GJ_FI_INDENT: return gj_f_indent(x, e, v, args, n, kw);
    case GJ_FI_SELECT:
    case GJ_FI_REJECT:
    case GJ_FI_SELECTATTR:
    case GJ_FI_REJECTATTR: return gj_f_select(x, e, v, args, n);
    case GJ_FI_MAP: return gj_f_map(x, e, v, args, n, kw);
    case GJ_FI_SORT:
    case GJ_FI_DICTSORT: return gj_f_sort(x, e, v, args, n, kw);
    case GJ_FI_UNIQUE: return gj_f_unique(x, e, v, args, n, kw);
    case GJ_FI_INT:
    case GJ_FI_FLOAT: return gj_f_number(x, e, v, args, n, kw);
    case GJ_FI_REVERSE: return gj_f_reverse(x, e, v);
    case GJ_FI_FIRST:
    case GJ_FI_LAST:
    case GJ_FI_LIST:
    case GJ_FI_LENGTH: return gj_f_sequence(x, e, v);
    case GJ_FI_DEFAULT: {
        gj_val *def = gj_arg(args, n, kw, 0, "default_value"),
               *boolean = gj_arg(args, n, kw, 1, "boolean");
        bool use = v->kind == GJ_UNDEF || (boolean && gj_truthy(boolean) && !gj_truthy(v));
        return !use ? gj_ref(v) : def ? gj_ref(def) : gj_new_str(x, "", 0);
    }
    case GJ_FI_STRING: {
        gj_buf b = {0};
        if (v->kind == GJ_NONE) return gj_new_str(x, "None", 4);
        if (gj_write(x, &b, v, e->line) != 0) {
            free(b.p);
            return NULL;
        }
        return gj_new_str_buf(x, &b);
    }
    case GJ_FI_ITEMS:
        if (v->kind == GJ_UNDEF) return gj_new(x, GJ_LIST);
        return v->kind == GJ_DICT || v->kind == GJ_NS ? gj_dict_items(x, v, 0)
                                                      : gj_bad_operand(x, e, v);
    case GJ_FI_ABS:
        if (v->kind == GJ_INT && v->u.i != (long long)(1ULL << 63))
            return gj_new_int(x, v->u.i < 0 ? -v->u.i : v->u.i);
        return v->kind == GJ_FLOAT ? gj_new_float(x, fabs(v->u.f)) : gj_bad_operand(x, e, v);
    default: return gj_f_text(x, e, v, args, n, kw);
    }
}

gj_val *gj_filter_apply(gj_ctx *x, gj_scope *sc, const gj_node *e, gj_val *v) {
    gj_val **args = NULL, *kw = NULL, *r = NULL;
    size_t n = 0;
    if (gj_eval_args(x, sc, &e->items, &args, &n, &kw) == 0)
        r = gj_filter_run(x, e, v, args, n, kw);
    gj_free_args(x, args, n, kw);
    return r;
}

/* ---- methods --------------------------------------------------------------------------------- */

static gj_val *gj_str_affix(gj_ctx *x, const gj_val *s, const gj_val *a, bool prefix, int line) {
    if (a && a->kind == GJ_STR) return gj_new_bool(x, gj_affix(s, a, prefix));
    if (a && a->kind == GJ_LIST) {
        for (size_t i = 0; i < a->u.l.n; i++)
            if (a->u.l.v[i]->kind == GJ_STR && gj_affix(s, a->u.l.v[i], prefix))
                return gj_new_bool(x, true);
        return gj_new_bool(x, false);
    }
    gj_fail(x, line, "%s() needs a string or a list of strings",
            prefix ? "startswith" : "endswith");
    return NULL;
}

/* The field {...} of a format string at f[*i] (just after '{'): the argument it names. */
static const gj_val *gj_format_field(gj_ctx *x, const gj_val *f, size_t *i, gj_val **args, size_t n,
                                     const gj_val *kw, size_t *next, int line) {
    const char *p = f->u.s.p + *i, *close = memchr(p, '}', f->u.s.n - *i);
    if (!close) {
        gj_fail(x, line, "format(): '{' without '}'");
        return NULL;
    }
    size_t len = (size_t)(close - p);
    *i += len + 1;
    if (memchr(p, ':', len) || memchr(p, '!', len) || memchr(p, '{', len)) {
        gj_fail(x, line, "format(): only {}, {N} and {name} fields are supported");
        return NULL;
    }
    const gj_val *v = NULL;
    if (len == 0 || strspn(p, "0123456789") >= len) {
        size_t k = len ? (size_t)strtoull(p, NULL, 10) : (*next)++;
        v = k < n ? args[k] : NULL;
    } else
        v = gj_dict_get(kw, p, len);
    if (!v) gj_fail(x, line, "format(): no argument for field {%.*s}", (int)len, p);
    return v;
}

/* str.format with {}, {N}, {name} and the {{ }} escapes (no format specifications). */
static gj_val *gj_str_format(gj_ctx *x, const gj_val *f, gj_val **args, size_t n, const gj_val *kw,
                             int line) {
    gj_buf b = {0};
    size_t next = 0;
    for (size_t i = 0; i < f->u.s.n;) {
        char c = f->u.s.p[i++];
        bool doubled = i < f->u.s.n && f->u.s.p[i] == c;
        int rc;
        if ((c == '{' || c == '}') && doubled)
            i++, rc = gj_buf_put(x, &b, &c, 1);
        else if (c == '}')
            rc = -1, gj_fail(x, line, "format(): single '}'");
        else if (c == '{') {
            const gj_val *v = gj_format_field(x, f, &i, args, n, kw, &next, line);
            rc = v ? gj_write(x, &b, v, line) : -1;
        } else
            rc = gj_buf_put(x, &b, &c, 1);
        if (rc != 0) {
            free(b.p);
            return NULL;
        }
    }
    return gj_new_str_buf(x, &b);
}

static gj_val *gj_str_method(gj_ctx *x, gj_val *s, const char *name, gj_val **args, size_t n,
                             gj_val *kw, int line) {
    gj_val *a0 = gj_arg(args, n, kw, 0, NULL);
    if (!strcmp(name, "upper")) return gj_recase(x, s, GJ_CASE_UPPER);
    if (!strcmp(name, "lower")) return gj_recase(x, s, GJ_CASE_LOWER);
    if (!strcmp(name, "title")) return gj_recase(x, s, GJ_CASE_TITLE);
    if (!strcmp(name, "capitalize")) return gj_recase(x, s, GJ_CASE_CAPITALIZE);
    if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
        gj_val *chars = a0 && a0->kind == GJ_STR ? a0 : NULL;
        return gj_strip(x, s, name[0] != 'r', name[0] != 'l', chars);
    }
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith"))
        return gj_str_affix(x, s, a0, name[0] == 's', line);
    if (!strcmp(name, "split")) {
        gj_val *sep = gj_arg(args, n, kw, 0, "sep"), *max = gj_arg(args, n, kw, 1, "maxsplit");
        if (sep && sep->kind == GJ_NONE) sep = NULL;
        if (!gj_arg_kind(x, sep, GJ_STR, "split's separator", line) ||
            !gj_arg_kind(x, max, GJ_INT, "split's maxsplit", line))
            return NULL;
        return gj_split(x, s, sep, max ? max->u.i : -1, line);
    }
    if (!strcmp(name, "replace")) {
        gj_val *b = gj_arg(args, n, kw, 1, NULL), *c = gj_arg(args, n, kw, 2, "count");
        if (!a0 || !b || a0->kind != GJ_STR || b->kind != GJ_STR || (c && c->kind != GJ_INT)) {
            gj_fail(x, line, "replace() needs two strings (and an optional count)");
            return NULL;
        }
        return gj_replace(x, s, a0, b, c ? c->u.i : -1);
    }
    if (!strcmp(name, "format")) return gj_str_format(x, s, args, n, kw, line);
    if (!strcmp(name, "join") && a0 && a0->kind == GJ_LIST) {
        gj_buf b = {0};
        for (size_t i = 0; i < a0->u.l.n; i++)
            if ((i > 0 && gj_buf_put(x, &b, s->u.s.p, s->u.s.n) != 0) ||
                gj_write(x, &b, a0->u.l.v[i], line) != 0) {
                free(b.p);
                return NULL;
            }
        return gj_new_str_buf(x, &b);
    }
    gj_fail(x, line, "unknown string method '%s'", name);
    return NULL;
}

gj_val *gj_method_call(gj_ctx *x, gj_val *self, const char *name, gj_val **args, size_t n,
                       gj_val *kw, int line) {
    if (self->kind == GJ_STR) return gj_str_method(x, self, name, args, n, kw, line);
    if (self->kind == GJ_DICT) {
        if (!strcmp(name, "items")) return gj_dict_items(x, self, 0);
        if (!strcmp(name, "keys")) return gj_dict_items(x, self, 1);
        if (!strcmp(name, "values")) return gj_dict_items(x, self, 2);
        if (!strcmp(name, "get")) {
            gj_val *k = gj_arg(args, n, kw, 0, NULL), *def = gj_arg(args, n, kw, 1, "default");
            if (!k || k->kind != GJ_STR) {
                gj_fail(x, line, "get() needs a string key");
                return NULL;
            }
            gj_val *v = gj_dict_get(self, k->u.s.p, k->u.s.n);
            return v ? gj_ref(v) : def ? gj_ref(def) : gj_new(x, GJ_NONE);
        }
    }
    if (self->kind == GJ_UNDEF || self->kind == GJ_NONE)
        gj_fail(x, line, "cannot call %s() on %s", name,
                self->kind == GJ_NONE ? "none" : "an undefined value");
    else
        gj_fail(x, line, "unknown method '%s' of %s", name, gj_kind_a(self->kind));
    return NULL;
}

/* ---- global functions ------------------------------------------------------------------------ */

/* raise_exception(message): the render fails with exactly the message. */
static gj_val *gj_g_raise(gj_ctx *x, gj_val **args, size_t n, int line) {
    gj_buf b = {0};
    if (n > 0 && gj_write(x, &b, args[0], line) != 0) {
        free(b.p);
        return NULL;
    }
    if (!x->failed) {
        x->failed = true;
        if (x->err && x->err_len)
            snprintf(x->err, x->err_len, "%s", b.p ? b.p : "raise_exception() without a message");
    }
    free(b.p);
    return NULL;
}

/* range([start,] stop[, step]) of at most GW_JINJA_MAX_ITERATIONS integers. */
static gj_val *gj_g_range(gj_ctx *x, gj_val **args, size_t n, int line) {
    long long v[3] = {0, 0, 1};
    if (n < 1 || n > 3) {
        gj_fail(x, line, "range() takes 1 to 3 integers");
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (args[i]->kind != GJ_INT) {
            gj_fail(x, line, "range() takes integers, not %s", gj_kind_a(args[i]->kind));
            return NULL;
        }
        v[n == 1 ? 1 : i] = args[i]->u.i;
    }
    if (v[2] == 0) {
        gj_fail(x, line, "range() step must not be zero");
        return NULL;
    }
    gj_val *l = gj_new(x, GJ_LIST);
    size_t count = 0;
    for (long long i = v[0]; l && (v[2] > 0 ? i < v[1] : i > v[1]); count++) {
        gj_val *e = count < GW_JINJA_MAX_ITERATIONS ? gj_new_int(x, i) : NULL;
        if (count >= GW_JINJA_MAX_ITERATIONS)
            gj_fail(x, line, "range() longer than %u", GW_JINJA_MAX_ITERATIONS);
        if (!e || gj_list_push(x, l, e) != 0) gj_unref(x, l), l = NULL;
        if (__builtin_add_overflow(i, v[2], &i)) break;
    }
    return l;
}

/* namespace([dict], **attributes) */
static gj_val *gj_g_namespace(gj_ctx *x, gj_val **args, size_t n, gj_val *kw, int line) {
    gj_val *ns = gj_new(x, GJ_NS);
    const gj_val *srcs[2] = {n > 0 ? args[0] : NULL, kw};
    if (n > 1 || (n == 1 && args[0]->kind != GJ_DICT)) {
        gj_fail(x, line, "namespace() takes keyword arguments (and at most one dict)");
        gj_unref(x, ns);
        return NULL;
    }
    for (int s = 0; ns && s < 2; s++)
        for (size_t i = 0; srcs[s] && ns && i < srcs[s]->u.d.n; i++)
            if (gj_dict_set(x, ns, srcs[s]->u.d.k[i], srcs[s]->u.d.kn[i],
                            gj_ref(srcs[s]->u.d.v[i])) != 0)
                gj_unref(x, ns), ns = NULL;
    return ns;
}

/* strftime_now(format): the local time, formatted by the C library's strftime. */
static gj_val *gj_g_strftime(gj_ctx *x, gj_val **args, size_t n, int line) {
    char out[256];
    struct tm tm;
    time_t now = time(NULL);
    if (n != 1 || args[0]->kind != GJ_STR) {
        gj_fail(x, line, "strftime_now() takes one format string");
        return NULL;
    }
    if (!localtime_r(&now, &tm)) {
        gj_fail(x, line, "strftime_now(): no local time");
        return NULL;
    }
    size_t k = strftime(out, sizeof out, args[0]->u.s.p, &tm);
    if (k == 0 && args[0]->u.s.n > 0) {
        gj_fail(x, line, "strftime_now(): format gives an empty or too long result");
        return NULL;
    }
    return gj_new_str(x, out, k);
}

gj_val *gj_global_call(gj_ctx *x, gj_val *fn, gj_val **args, size_t n, gj_val *kw, int line) {
    switch (fn->u.fn.id) {
    case GJ_F_RAISE: return gj_g_raise(x, args, n, line);
    case GJ_F_RANGE: return gj_g_range(x, args, n, line);
    case GJ_F_NAMESPACE: return gj_g_namespace(x, args, n, kw, line);
    case GJ_F_STRFTIME: return gj_g_strftime(x, args, n, line);
    default: gj_fail(x, line, "not a function"); return NULL;
    }
}
