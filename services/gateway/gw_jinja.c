/* gw_jinja.c — the chat-template interpreter's renderer: syntax tree + context → prompt text.
 *
 * Owns: gw_jinja_render; scopes (a for loop and a macro call open one; `set` writes the innermost,
 * as in @huggingface/jinja), the evaluation of expressions (operators, attribute and subscript
 * access, slices, calls) and statements (if, for with loop.* and else, set incl. block set and
 * namespace attributes, macro, break/continue), the output buffer and its max_out cap, the loop
 * iteration cap and the macro recursion cap; the error messages ("chat template line N: ...").
 * Does not own: parsing (gw_jinja_parse.c), values (gw_jinja_value.c), filters/tests/methods
 * (gw_jinja_builtins.c).
 *
 * Semantics follow @huggingface/jinja 0.5.11 (what tests/jinja compares against); where that
 * differs from Python's Jinja and the difference matters for chat templates, Python's is kept and
 * tests/jinja/README.md lists it: attribute or subscript access on undefined or none is an error;
 * looping over undefined renders nothing, over a string visits its characters; `%` and `//` round
 * as Python does. */
#include "gw_jinja_int.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors and output ----------------------------------------------------------------------- */

void gj_fail(gj_ctx *x, int line, const char *fmt, ...) {
    if (x->failed) return;
    x->failed = true;
    if (!x->err || x->err_len == 0) return;
    int k = line > 0 ? snprintf(x->err, x->err_len, "chat template line %d: ", line)
                     : snprintf(x->err, x->err_len, "chat template: ");
    if (k < 0 || (size_t)k >= x->err_len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->err + k, x->err_len - (size_t)k, fmt, ap);
    va_end(ap);
}

int gj_buf_put(gj_ctx *x, gj_buf *b, const char *s, size_t n) {
    if (n == 0) return 0;
    if (n > x->max_out || b->n > x->max_out - n) {
        gj_fail(x, 0, "output longer than the limit of %zu bytes", x->max_out);
        return -1;
    }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) {
            gj_fail(x, 0, "out of memory");
            return -1;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

int gj_buf_puts(gj_ctx *x, gj_buf *b, const char *s) { return gj_buf_put(x, b, s, strlen(s)); }

int gj_charge(gj_ctx *x, unsigned long long steps, int line) {
    x->steps += steps;
    if (x->steps > GW_JINJA_MAX_STEPS) {
        gj_fail(x, line, "the template does more than %llu steps of work",
                (unsigned long long)GW_JINJA_MAX_STEPS);
        return -1;
    }
    return 0;
}

/* ---- scopes ---------------------------------------------------------------------------------- */

static gj_val *gj_lookup(const gj_scope *sc, const char *name, size_t n) {
    for (; sc; sc = sc->parent) {
        gj_val *v = gj_dict_get(sc->vars, name, n);
        if (v) return v;
    }
    return NULL;
}

static int gj_scope_open(gj_ctx *x, gj_scope *sc, gj_scope *parent) {
    sc->parent = parent;
    sc->vars = gj_new(x, GJ_DICT);
    return sc->vars ? 0 : -1;
}

/* The names every template sees unless it sets them itself. */
static gj_val *gj_builtin_name(gj_ctx *x, const char *name) {
    static const struct {
        const char *name;
        gj_func id;
    } funcs[] = {{"raise_exception", GJ_F_RAISE},
                 {"range", GJ_F_RANGE},
                 {"namespace", GJ_F_NAMESPACE},
                 {"strftime_now", GJ_F_STRFTIME}};
    if (!strcmp(name, "true") || !strcmp(name, "True")) return gj_new_bool(x, true);
    if (!strcmp(name, "false") || !strcmp(name, "False")) return gj_new_bool(x, false);
    if (!strcmp(name, "none") || !strcmp(name, "None")) return gj_new(x, GJ_NONE);
    for (size_t i = 0; i < sizeof funcs / sizeof funcs[0]; i++) {
        if (strcmp(name, funcs[i].name) != 0) continue;
        gj_val *f = gj_new(x, GJ_FUNC);
        if (f) f->u.fn.id = funcs[i].id;
        return f;
    }
    return gj_new(x, GJ_UNDEF);
}

/* Binds a for/set target (a name, or names to unpack a list into) in sc; borrows v. */
static int gj_bind(gj_ctx *x, gj_scope *sc, const gj_node *target, gj_val *v) {
    if (target->kind == GJ_E_NAME)
        return gj_dict_set(x, sc->vars, target->str, target->len, gj_ref(v));
    if (v->kind != GJ_LIST) {
        gj_fail(x, target->line, "cannot unpack %s into %zu names", gj_kind_a(v->kind),
                target->items.n);
        return -1;
    }
    if (v->u.l.n != target->items.n) {
        gj_fail(x, target->line, "too %s values to unpack (%zu into %zu names)",
                v->u.l.n < target->items.n ? "few" : "many", v->u.l.n, target->items.n);
        return -1;
    }
    for (size_t i = 0; i < v->u.l.n; i++) {
        const gj_node *t = target->items.v[i];
        if (gj_dict_set(x, sc->vars, t->str, t->len, gj_ref(v->u.l.v[i])) != 0) return -1;
    }
    return 0;
}

/* ---- expressions: access --------------------------------------------------------------------- */

static gj_val *gj_undef_access(gj_ctx *x, const gj_val *obj, const char *what, int line) {
    gj_fail(x, line, "cannot read %s of %s", what,
            obj->kind == GJ_NONE ? "none" : "an undefined value");
    return NULL;
}

/* The index i of a sequence of n (negative: from the end); -1 when out of range. */
static long long gj_seq_index(long long i, size_t n) {
    if (i < 0) i += (long long)n;
    return i >= 0 && (unsigned long long)i < n ? i : -1;
}

/* Code point i of a UTF-8 string as a new string; undefined when out of range. */
static gj_val *gj_str_char(gj_ctx *x, const gj_val *s, long long i) {
    size_t n_cp = 0, off[2] = {0, 0};
    if (gj_charge(x, s->u.s.n, 0) != 0) return NULL;
    for (size_t k = 0; k < s->u.s.n; k++) n_cp += ((unsigned char)s->u.s.p[k] & 0xC0) != 0x80;
    long long at = gj_seq_index(i, n_cp);
    if (at < 0) return gj_new(x, GJ_UNDEF);
    for (size_t k = 0, cp = 0; k <= s->u.s.n; k++) {
        bool start = k == s->u.s.n || ((unsigned char)s->u.s.p[k] & 0xC0) != 0x80;
        if (!start) continue;
        if (cp == (size_t)at) off[0] = k;
        if (cp == (size_t)at + 1) {
            off[1] = k;
            break;
        }
        cp++;
    }
    return gj_new_str(x, s->u.s.p + off[0], off[1] - off[0]);
}

static gj_val *gj_get_item(gj_ctx *x, gj_val *obj, gj_val *key, int line) {
    if (obj->kind == GJ_UNDEF || obj->kind == GJ_NONE)
        return gj_undef_access(x, obj, "an item", line);
    if ((obj->kind == GJ_DICT || obj->kind == GJ_NS) && key->kind == GJ_STR) {
        gj_val *v = gj_dict_get(obj, key->u.s.p, key->u.s.n);
        return v ? gj_ref(v) : gj_new(x, GJ_UNDEF);
    }
    if (obj->kind == GJ_LIST && key->kind == GJ_INT) {
        long long i = gj_seq_index(key->u.i, obj->u.l.n);
        return i < 0 ? gj_new(x, GJ_UNDEF) : gj_ref(obj->u.l.v[i]);
    }
    if (obj->kind == GJ_STR && key->kind == GJ_INT) return gj_str_char(x, obj, key->u.i);
    return gj_new(x, GJ_UNDEF);
}

static gj_val *gj_get_attr(gj_ctx *x, gj_val *obj, const gj_node *e) {
    if (obj->kind == GJ_UNDEF || obj->kind == GJ_NONE) {
        char what[96];
        snprintf(what, sizeof what, "attribute '%s'", e->str);
        return gj_undef_access(x, obj, what, e->line);
    }
    if (e->op) { /* obj.0 */
        gj_val *k = gj_new_int(x, e->i);
        gj_val *v = k ? gj_get_item(x, obj, k, e->line) : NULL;
        gj_unref(x, k);
        return v;
    }
    if (obj->kind == GJ_DICT || obj->kind == GJ_NS) {
        gj_val *v = gj_dict_get(obj, e->str, e->len);
        return v ? gj_ref(v) : gj_new(x, GJ_UNDEF);
    }
    return gj_new(x, GJ_UNDEF);
}

/* Python's slice bounds over n items (utils.ts's slice). */
static gj_val *gj_slice_list(gj_ctx *x, gj_val *obj, long long n, const long long *bound,
                             const bool *given, long long step, bool str, const size_t *cp_off) {
    long long start, stop;
    if (step > 0) {
        start = !given[0]      ? 0
                : bound[0] < 0 ? (n + bound[0] > 0 ? n + bound[0] : 0)
                               : (bound[0] < n ? bound[0] : n);
        stop = !given[1]      ? n
               : bound[1] < 0 ? (n + bound[1] > 0 ? n + bound[1] : 0)
                              : (bound[1] < n ? bound[1] : n);
    } else {
        start = !given[0]      ? n - 1
                : bound[0] < 0 ? (n + bound[0] > -1 ? n + bound[0] : -1)
                               : (bound[0] < n - 1 ? bound[0] : n - 1);
        stop = !given[1]       ? -1
               : bound[1] < -1 ? (n + bound[1] > -1 ? n + bound[1] : -1)
                               : (bound[1] < n - 1 ? bound[1] : n - 1);
    }
    gj_buf b = {0};
    gj_val *out = str ? NULL : gj_new(x, GJ_LIST);
    if (!str && !out) return NULL;
    for (long long i = start; step > 0 ? i < stop : i > stop; i += step) {
        int rc = str ? gj_buf_put(x, &b, obj->u.s.p + cp_off[i], cp_off[i + 1] - cp_off[i])
                     : gj_list_push(x, out, gj_ref(obj->u.l.v[i]));
        if (rc != 0) {
            free(b.p);
            gj_unref(x, out);
            return NULL;
        }
    }
    return str ? gj_new_str_buf(x, &b) : out;
}

static gj_val *gj_slice(gj_ctx *x, gj_scope *sc, gj_val *obj, const gj_node *e) {
    long long bound[3] = {0, 0, 1};
    bool given[3] = {false, false, false};
    for (int k = 0; k < 3; k++) {
        const gj_node *part = e->items.v[k];
        if (!part) continue;
        gj_val *v = gj_eval(x, sc, part);
        if (!v) return NULL;
        if (v->kind == GJ_INT)
            bound[k] = v->u.i, given[k] = true;
        else if (v->kind != GJ_UNDEF && v->kind != GJ_NONE) {
            gj_fail(x, e->line, "a slice bound must be an integer, not %s", gj_kind_a(v->kind));
            gj_unref(x, v);
            return NULL;
        }
        gj_unref(x, v);
    }
    if (bound[2] == 0) {
        gj_fail(x, e->line, "slice step cannot be zero");
        return NULL;
    }
    if (obj->kind == GJ_LIST)
        return gj_slice_list(x, obj, (long long)obj->u.l.n, bound, given, bound[2], false, NULL);
    if (obj->kind != GJ_STR) {
        gj_fail(x, e->line, "cannot slice %s", gj_kind_a(obj->kind));
        return NULL;
    }
    if (gj_charge(x, obj->u.s.n, e->line) != 0) return NULL;
    size_t n_cp = 0, *off = malloc((obj->u.s.n + 1) * sizeof *off);
    if (!off) {
        gj_fail(x, e->line, "out of memory");
        return NULL;
    }
    for (size_t k = 0; k < obj->u.s.n; k++)
        if (((unsigned char)obj->u.s.p[k] & 0xC0) != 0x80) off[n_cp++] = k;
    off[n_cp] = obj->u.s.n;
    gj_val *r = gj_slice_list(x, obj, (long long)n_cp, bound, given, bound[2], true, off);
    free(off);
    return r;
}

/* ---- expressions: calls ---------------------------------------------------------------------- */

/* Evaluates a call's arguments: positional into args[], keyword ones into *kwargs (a dict). */
int gj_eval_args(gj_ctx *x, gj_scope *sc, const gj_nodes *items, gj_val ***args, size_t *n_args,
                 gj_val **kwargs) {
    *args = calloc(items->n ? items->n : 1, sizeof **args);
    *n_args = 0;
    *kwargs = gj_new(x, GJ_DICT);
    if (!*args || !*kwargs) {
        if (!*args) gj_fail(x, 0, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < items->n; i++) {
        const gj_node *a = items->v[i];
        gj_val *v = gj_eval(x, sc, a->kind == GJ_E_KWARG ? a->a : a);
        if (!v) return -1;
        if (a->kind != GJ_E_KWARG)
            (*args)[(*n_args)++] = v;
        else if (gj_dict_get(*kwargs, a->str, a->len)) {
            gj_unref(x, v);
            gj_fail(x, a->line, "keyword argument '%s' given twice", a->str);
            return -1;
        } else if (gj_dict_set(x, *kwargs, a->str, a->len, v) != 0)
            return -1;
    }
    return 0;
}

void gj_free_args(gj_ctx *x, gj_val **args, size_t n_args, gj_val *kwargs) {
    for (size_t i = 0; args && i < n_args; i++) gj_unref(x, args[i]);
    free(args);
    gj_unref(x, kwargs);
}

static gj_val *gj_call_value(gj_ctx *x, gj_scope *sc, gj_val *fn, gj_val **args, size_t n,
                             gj_val *kw, int line) {
    if (fn->u.fn.id == GJ_F_MACRO) return gj_call_macro(x, sc, fn->u.fn.macro, args, n, kw, line);
    return gj_global_call(x, fn, args, n, kw, line);
}

static gj_val *gj_eval_call(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    gj_val **args = NULL, *kw = NULL, *obj = NULL, *fn = NULL, *r = NULL;
    size_t n = 0;
    const gj_node *callee = e->a;
    if (callee->kind == GJ_E_ATTR && !callee->op) {
        if (!(obj = gj_eval(x, sc, callee->a))) goto done;
        if (obj->kind == GJ_DICT || obj->kind == GJ_NS)
            fn = gj_ref(gj_dict_get(obj, callee->str, callee->len));
        if (fn && fn->kind != GJ_FUNC) gj_unref(x, fn), fn = NULL;
    } else if (!(fn = gj_eval(x, sc, callee)))
        goto done;
    if (gj_eval_args(x, sc, &e->items, &args, &n, &kw) != 0) goto done;
    if (fn && fn->kind == GJ_FUNC)
        r = gj_call_value(x, sc, fn, args, n, kw, e->line);
    else if (obj)
        r = gj_method_call(x, obj, callee->str, args, n, kw, e->line);
    else if (callee->kind == GJ_E_NAME)
        gj_fail(x, e->line, "'%s' is %s, not a function", callee->str, gj_kind_name(fn->kind));
    else
        gj_fail(x, e->line, "cannot call %s", gj_kind_a(fn->kind));
done:
    gj_free_args(x, args, n, kw);
    gj_unref(x, obj);
    gj_unref(x, fn);
    return r;
}

/* ---- expressions: operators ------------------------------------------------------------------ */

static const char *gj_op_name(int op) {
    static const char *const names[] = {"",  "or", "and", "not", "-",  "+",      "==", "!=",
                                        "<", ">",  "<=",  ">=",  "in", "not in", "+",  "-",
                                        "~", "*",  "/",   "//",  "%",  "**"};
    return names[op];
}

static gj_val *gj_op_error(gj_ctx *x, int op, const gj_val *a, const gj_val *b, int line) {
    gj_fail(x, line, "cannot apply '%s' to %s and %s", gj_op_name(op), gj_kind_name(a->kind),
            gj_kind_name(b->kind));
    return NULL;
}

static gj_val *gj_int_result(gj_ctx *x, bool overflow, long long r, int line) {
    if (overflow) {
        gj_fail(x, line, "integer overflow");
        return NULL;
    }
    return gj_new_int(x, r);
}

static gj_val *gj_arith_int(gj_ctx *x, int op, long long a, long long b, int line) {
    long long r = 0;
    bool over;
    switch (op) {
    case GJ_OP_ADD: over = __builtin_add_overflow(a, b, &r); return gj_int_result(x, over, r, line);
    case GJ_OP_SUB: over = __builtin_sub_overflow(a, b, &r); return gj_int_result(x, over, r, line);
    case GJ_OP_MUL: over = __builtin_mul_overflow(a, b, &r); return gj_int_result(x, over, r, line);
    case GJ_OP_DIV: return gj_new_float(x, (double)a / (double)b);
    case GJ_OP_FLOORDIV:
    case GJ_OP_MOD: {
        if (a == LLONG_MIN && b == -1) return gj_int_result(x, true, 0, line);
        long long q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) q--, m += b;
        return gj_new_int(x, op == GJ_OP_MOD ? m : q);
    }
    default: { /* ** with b >= 0 */
        long long acc = 1;
        for (long long i = 0; i < b; i++) {
            if (__builtin_mul_overflow(acc, a, &acc)) return gj_int_result(x, true, 0, line);
            if (acc == 0 || acc == 1) break;
        }
        return gj_new_int(x, acc);
    }
    }
}

/* a ** b for a whole-number b (by squaring); other exponents are not supported. */
static gj_val *gj_float_pow(gj_ctx *x, double a, double b, int line) {
    if (b != gj_floor(b) || b > 1e6 || b < -1e6) {
        gj_fail(x, line, "'**' supports whole-number exponents only");
        return NULL;
    }
    long long e = (long long)(b < 0 ? -b : b);
    double r = 1;
    for (double base = a; e > 0; e >>= 1, base *= base)
        if (e & 1) r *= base;
    if (b < 0) r = 1 / r;
    if (isnan(r) || isinf(r)) {
        gj_fail(x, line, "'**' result is not a finite number");
        return NULL;
    }
    return gj_new_float(x, r);
}

static gj_val *gj_arith(gj_ctx *x, int op, const gj_val *a, const gj_val *b, int line) {
    bool ints =
        (a->kind == GJ_INT || a->kind == GJ_BOOL) && (b->kind == GJ_INT || b->kind == GJ_BOOL);
    double fa = a->kind == GJ_FLOAT ? a->u.f : a->kind == GJ_INT ? (double)a->u.i : a->u.b;
    double fb = b->kind == GJ_FLOAT ? b->u.f : b->kind == GJ_INT ? (double)b->u.i : b->u.b;
    long long ia = a->kind == GJ_INT ? a->u.i : a->kind == GJ_BOOL ? a->u.b : 0;
    long long ib = b->kind == GJ_INT ? b->u.i : b->kind == GJ_BOOL ? b->u.b : 0;
    if ((op == GJ_OP_DIV || op == GJ_OP_FLOORDIV || op == GJ_OP_MOD) && fb == 0) {
        gj_fail(x, line, "division by zero");
        return NULL;
    }
    if (ints && !(op == GJ_OP_POW && ib < 0)) return gj_arith_int(x, op, ia, ib, line);
    switch (op) {
    case GJ_OP_ADD: return gj_new_float(x, fa + fb);
    case GJ_OP_SUB: return gj_new_float(x, fa - fb);
    case GJ_OP_MUL: return gj_new_float(x, fa * fb);
    case GJ_OP_DIV: return gj_new_float(x, fa / fb);
    case GJ_OP_FLOORDIV: return gj_new_float(x, gj_floor(fa / fb));
    case GJ_OP_MOD:
        return gj_new_float(x, fa - fb * gj_floor(fa / fb)); /* the divisor's sign, as Python */
    default: return gj_float_pow(x, fa, fb, line);
    }
}

static bool gj_is_num(const gj_val *v) {
    return v->kind == GJ_INT || v->kind == GJ_FLOAT || v->kind == GJ_BOOL;
}

/* Both sides' text joined (~, and + with a string side). */
static gj_val *gj_concat(gj_ctx *x, const gj_val *a, const gj_val *b, int line) {
    gj_buf buf = {0};
    if (gj_write(x, &buf, a, line) != 0 || gj_write(x, &buf, b, line) != 0) {
        free(buf.p);
        return NULL;
    }
    return gj_new_str_buf(x, &buf);
}

static gj_val *gj_list_concat(gj_ctx *x, const gj_val *a, const gj_val *b) {
    gj_val *l = gj_new(x, GJ_LIST);
    for (size_t i = 0; l && i < a->u.l.n + b->u.l.n; i++) {
        gj_val *e = i < a->u.l.n ? a->u.l.v[i] : b->u.l.v[i - a->u.l.n];
        if (gj_list_push(x, l, gj_ref(e)) != 0) {
            gj_unref(x, l);
            return NULL;
        }
    }
    return l;
}

static int gj_compare(gj_ctx *x, int op, const gj_val *a, const gj_val *b, int line) {
    int c;
    if (gj_is_num(a) && gj_is_num(b)) {
        double fa = a->kind == GJ_FLOAT ? a->u.f : a->kind == GJ_INT ? (double)a->u.i : a->u.b;
        double fb = b->kind == GJ_FLOAT ? b->u.f : b->kind == GJ_INT ? (double)b->u.i : b->u.b;
        if (a->kind == GJ_INT && b->kind == GJ_INT)
            c = (a->u.i > b->u.i) - (a->u.i < b->u.i);
        else
            c = (fa > fb) - (fa < fb);
    } else if (a->kind == GJ_STR && b->kind == GJ_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        c = memcmp(a->u.s.p, b->u.s.p, n);
        if (c == 0) c = (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
    } else {
        gj_op_error(x, op, a, b, line);
        return -1;
    }
    return op == GJ_OP_LT ? c < 0 : op == GJ_OP_GT ? c > 0 : op == GJ_OP_LE ? c <= 0 : c >= 0;
}

/* `a in b`: 1, 0, or -1 on error. */
static int gj_contains(gj_ctx *x, const gj_val *a, const gj_val *b, int line) {
    switch (b->kind) {
    case GJ_UNDEF: return 0;
    case GJ_LIST:
        for (size_t i = 0; i < b->u.l.n; i++)
            if ((a->kind == GJ_BOOL) == (b->u.l.v[i]->kind == GJ_BOOL) && gj_equal(a, b->u.l.v[i]))
                return 1;
        return 0;
    case GJ_STR:
        if (a->kind != GJ_STR) break;
        if (a->u.s.n == 0) return 1;
        if (gj_charge(x, b->u.s.n * (a->u.s.n / 64 + 1), line) != 0) return -1;
        for (size_t i = 0; i + a->u.s.n <= b->u.s.n; i++)
            if (memcmp(b->u.s.p + i, a->u.s.p, a->u.s.n) == 0) return 1;
        return 0;
    case GJ_DICT:
    case GJ_NS:
        if (a->kind != GJ_STR) break;
        return gj_dict_get(b, a->u.s.p, a->u.s.n) != NULL;
    default: break;
    }
    gj_op_error(x, GJ_OP_IN, a, b, line);
    return -1;
}

static gj_val *gj_binary_values(gj_ctx *x, int op, const gj_val *a, const gj_val *b, int line) {
    switch (op) {
    case GJ_OP_EQ: return gj_new_bool(x, gj_equal(a, b));
    case GJ_OP_NE: return gj_new_bool(x, !gj_equal(a, b));
    case GJ_OP_IN:
    case GJ_OP_NOT_IN: {
        int c = gj_contains(x, a, b, line);
        return c < 0 ? NULL : gj_new_bool(x, op == GJ_OP_IN ? c : !c);
    }
    case GJ_OP_CONCAT: return gj_concat(x, a, b, line);
    case GJ_OP_LT:
    case GJ_OP_GT:
    case GJ_OP_LE:
    case GJ_OP_GE: {
        int c = gj_compare(x, op, a, b, line);
        return c < 0 ? NULL : gj_new_bool(x, c);
    }
    default: break;
    }
    if (op == GJ_OP_ADD && a->kind == GJ_LIST && b->kind == GJ_LIST) return gj_list_concat(x, a, b);
    bool scalars = gj_is_num(a) || a->kind == GJ_STR, scalarb = gj_is_num(b) || b->kind == GJ_STR;
    if (op == GJ_OP_ADD && scalars && scalarb && (a->kind == GJ_STR || b->kind == GJ_STR))
        return gj_concat(x, a, b, line);
    if (gj_is_num(a) && gj_is_num(b)) return gj_arith(x, op, a, b, line);
    return gj_op_error(x, op, a, b, line);
}

static gj_val *gj_eval_binary(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    gj_val *a = gj_eval(x, sc, e->a), *b = NULL, *r = NULL;
    if (!a) return NULL;
    if (e->op == GJ_OP_AND || e->op == GJ_OP_OR) {
        if (gj_truthy(a) == (e->op == GJ_OP_OR)) return a;
        gj_unref(x, a);
        return gj_eval(x, sc, e->b);
    }
    if ((b = gj_eval(x, sc, e->b))) r = gj_binary_values(x, e->op, a, b, e->line);
    gj_unref(x, a);
    gj_unref(x, b);
    return r;
}

static gj_val *gj_eval_unary(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    gj_val *a = gj_eval(x, sc, e->a), *r = NULL;
    if (!a) return NULL;
    if (e->op == GJ_OP_NOT)
        r = gj_new_bool(x, !gj_truthy(a));
    else if (a->kind == GJ_FLOAT)
        r = gj_new_float(x, e->op == GJ_OP_NEG ? -a->u.f : a->u.f);
    else if (a->kind == GJ_INT || a->kind == GJ_BOOL) {
        long long i = a->kind == GJ_INT ? a->u.i : a->u.b;
        if (e->op == GJ_OP_NEG && i == LLONG_MIN)
            gj_fail(x, e->line, "integer overflow");
        else
            r = gj_new_int(x, e->op == GJ_OP_NEG ? -i : i);
    } else
        gj_fail(x, e->line, "cannot apply unary '%s' to %s", gj_op_name(e->op), gj_kind_a(a->kind));
    gj_unref(x, a);
    return r;
}

/* ---- expressions: the dispatcher ------------------------------------------------------------- */

static gj_val *gj_eval_collection(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    bool dict = e->kind == GJ_E_DICT;
    gj_val *c = gj_new(x, dict ? GJ_DICT : GJ_LIST);
    for (size_t i = 0; c && i < e->items.n; i++) {
        const gj_node *it = e->items.v[i];
        gj_val *k = NULL, *v = gj_eval(x, sc, dict ? it->b : it);
        int rc = -1;
        if (v && !dict)
            rc = gj_list_push(x, c, v);
        else if (v && (k = gj_eval(x, sc, it->a)) && k->kind != GJ_STR) {
            gj_fail(x, it->line, "dict keys must be strings, not %s", gj_kind_a(k->kind));
            gj_unref(x, v);
        } else if (v && k)
            rc = gj_dict_set(x, c, k->u.s.p, k->u.s.n, v);
        else
            gj_unref(x, v);
        gj_unref(x, k);
        if (rc != 0) {
            gj_unref(x, c);
            return NULL;
        }
    }
    return c;
}

static gj_val *gj_eval_name(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    gj_val *v = gj_lookup(sc, e->str, e->len);
    return v ? gj_ref(v) : gj_builtin_name(x, e->str);
}

static gj_val *gj_eval_access(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    gj_val *obj = gj_eval(x, sc, e->a), *r = NULL;
    if (!obj) return NULL;
    if (e->kind == GJ_E_ATTR)
        r = gj_get_attr(x, obj, e);
    else if (e->kind == GJ_E_SLICE)
        r = gj_slice(x, sc, obj, e);
    else {
        gj_val *k = gj_eval(x, sc, e->b);
        if (k) r = gj_get_item(x, obj, k, e->line);
        gj_unref(x, k);
    }
    gj_unref(x, obj);
    return r;
}

static gj_val *gj_eval_test(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    gj_val *v = gj_eval(x, sc, e->a);
    if (!v) return NULL;
    int t = gj_test_apply(x, (gj_test)e->op, v, NULL, e->line);
    gj_unref(x, v);
    return t < 0 ? NULL : gj_new_bool(x, e->i ? !t : t);
}

static gj_val *gj_eval_cond(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    gj_val *c = gj_eval(x, sc, e->b);
    if (!c) return NULL;
    bool t = gj_truthy(c);
    gj_unref(x, c);
    if (t) return gj_eval(x, sc, e->a);
    return e->kind == GJ_E_TERNARY ? gj_eval(x, sc, e->c) : gj_new(x, GJ_UNDEF);
}

gj_val *gj_eval(gj_ctx *x, gj_scope *sc, const gj_node *e) {
    if (gj_charge(x, 1, e->line) != 0) return NULL;
    switch (e->kind) {
    case GJ_E_INT: return gj_new_int(x, e->i);
    case GJ_E_FLOAT: return gj_new_float(x, e->f);
    case GJ_E_STR: return gj_new_str(x, e->str, e->len);
    case GJ_E_NAME: return gj_eval_name(x, sc, e);
    case GJ_E_LIST:
    case GJ_E_TUPLE:
    case GJ_E_DICT: return gj_eval_collection(x, sc, e);
    case GJ_E_ATTR:
    case GJ_E_INDEX:
    case GJ_E_SLICE: return gj_eval_access(x, sc, e);
    case GJ_E_CALL: return gj_eval_call(x, sc, e);
    case GJ_E_FILTER: {
        gj_val *v = gj_eval(x, sc, e->a), *r = v ? gj_filter_apply(x, sc, e, v) : NULL;
        gj_unref(x, v);
        return r;
    }
    case GJ_E_TEST: return gj_eval_test(x, sc, e);
    case GJ_E_UNARY: return gj_eval_unary(x, sc, e);
    case GJ_E_BINARY: return gj_eval_binary(x, sc, e);
    case GJ_E_TERNARY:
    case GJ_E_SELECT: return gj_eval_cond(x, sc, e);
    default: gj_fail(x, e->line, "not an expression"); return NULL;
    }
}

/* ---- statements ------------------------------------------------------------------------------ */

static int gj_render_block(gj_ctx *x, gj_scope *sc, const gj_nodes *body);

/* Renders body into a new string value (block set, macro). */
static gj_val *gj_capture(gj_ctx *x, gj_scope *sc, const gj_nodes *body) {
    gj_buf b = {0}, *saved = x->out;
    x->out = &b;
    int rc = gj_render_block(x, sc, body);
    x->out = saved;
    if (rc != 0) {
        free(b.p);
        return NULL;
    }
    return gj_new_str_buf(x, &b);
}

static int gj_render_set(gj_ctx *x, gj_scope *sc, const gj_node *s) {
    gj_val *v = s->b ? gj_eval(x, sc, s->b) : gj_capture(x, sc, &s->body);
    int rc = -1;
    if (!v) return -1;
    if (s->a->kind != GJ_E_ATTR)
        rc = gj_bind(x, sc, s->a, v);
    else {
        gj_val *obj = gj_eval(x, sc, s->a->a);
        if (obj && obj->kind != GJ_NS)
            gj_fail(x, s->line, "cannot set attribute '%s' of %s (only of a namespace())",
                    s->a->str, gj_kind_a(obj->kind));
        else if (obj && (v->kind == GJ_NS || v->has_ns))
            gj_fail(x, s->line, "attribute '%s' of a namespace cannot hold a namespace", s->a->str);
        else if (obj)
            rc = gj_dict_set(x, obj, s->a->str, s->a->len, gj_ref(v));
        gj_unref(x, obj);
    }
    gj_unref(x, v);
    return rc;
}

static int gj_render_macro_def(gj_ctx *x, gj_scope *sc, const gj_node *s) {
    gj_val *f = gj_new(x, GJ_FUNC);
    if (!f) return -1;
    f->u.fn.id = GJ_F_MACRO;
    f->u.fn.macro = s;
    return gj_dict_set(x, sc->vars, s->str, s->len, f);
}

gj_val *gj_call_macro(gj_ctx *x, gj_scope *sc, const gj_node *m, gj_val **args, size_t n_args,
                      gj_val *kw, int line) {
    gj_scope ms;
    gj_val *r = NULL;
    size_t used_kw = 0;
    if (x->macro_depth >= GW_JINJA_MAX_MACRO_DEPTH) {
        gj_fail(x, line, "macro calls nested more than %d deep", GW_JINJA_MAX_MACRO_DEPTH);
        return NULL;
    }
    if (n_args > m->items.n) {
        gj_fail(x, line, "macro '%s' takes at most %zu arguments, got %zu", m->str, m->items.n,
                n_args);
        return NULL;
    }
    if (gj_scope_open(x, &ms, sc) != 0) return NULL;
    for (size_t i = 0; i < m->items.n; i++) { /* every parameter first, then the defaults */
        const gj_node *p = m->items.v[i];
        gj_val *v = i < n_args ? gj_ref(args[i]) : gj_ref(gj_dict_get(kw, p->str, p->len));
        used_kw += i >= n_args && v;
        if (!v && !(v = gj_new(x, GJ_UNDEF))) goto done;
        if (gj_dict_set(x, ms.vars, p->str, p->len, v) != 0) goto done;
    }
    if (used_kw < kw->u.d.n) {
        gj_fail(x, line, "macro '%s' got an unknown keyword argument", m->str);
        goto done;
    }
    for (size_t i = n_args; i < m->items.n; i++) {
        const gj_node *p = m->items.v[i];
        if (p->kind != GJ_E_KWARG || gj_dict_get(kw, p->str, p->len)) continue;
        gj_val *d = gj_eval(x, &ms, p->a);
        if (!d || gj_dict_set(x, ms.vars, p->str, p->len, d) != 0) goto done;
    }
    x->macro_depth++;
    r = gj_capture(x, &ms, &m->body);
    x->macro_depth--;
    x->flow = 0;
done:
    gj_unref(x, ms.vars);
    return r;
}

/* The loop variable of iteration i of n kept items. */
static gj_val *gj_loop_info(gj_ctx *x, gj_val *items, size_t i) {
    size_t n = items->u.l.n;
    gj_val *d = gj_new(x, GJ_DICT);
    if (!d) return NULL;
    struct {
        const char *k;
        gj_val *v;
    } f[] = {{"index", gj_new_int(x, (long long)i + 1)},
             {"index0", gj_new_int(x, (long long)i)},
             {"revindex", gj_new_int(x, (long long)(n - i))},
             {"revindex0", gj_new_int(x, (long long)(n - i - 1))},
             {"first", gj_new_bool(x, i == 0)},
             {"last", gj_new_bool(x, i + 1 == n)},
             {"length", gj_new_int(x, (long long)n)},
             {"previtem", i > 0 ? gj_ref(items->u.l.v[i - 1]) : gj_new(x, GJ_UNDEF)},
             {"nextitem", i + 1 < n ? gj_ref(items->u.l.v[i + 1]) : gj_new(x, GJ_UNDEF)}};
    int rc = 0;
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++) {
        if (rc == 0 && f[k].v)
            rc = gj_dict_set(x, d, f[k].k, strlen(f[k].k), f[k].v);
        else if (!f[k].v)
            rc = -1;
        else
            gj_unref(x, f[k].v);
    }
    if (rc != 0) gj_unref(x, d), d = NULL;
    return d;
}

static int gj_count_iteration(gj_ctx *x, int line) {
    if (++x->iterations > GW_JINJA_MAX_ITERATIONS) {
        gj_fail(x, line, "more than %u loop iterations", GW_JINJA_MAX_ITERATIONS);
        return -1;
    }
    return 0;
}

/* The items a for loop visits: a list's items, a dict's keys or a string's characters, less those
 * its `if` rejects. */
static gj_val *gj_loop_items(gj_ctx *x, gj_scope *sc, const gj_node *s) {
    gj_val *it = gj_eval(x, sc, s->b), *items = gj_new(x, GJ_LIST);
    if (!it || !items) goto fail;
    if (it->kind == GJ_DICT) {
        for (size_t i = 0; i < it->u.d.n; i++) {
            gj_val *k = gj_new_str(x, it->u.d.k[i], it->u.d.kn[i]);
            if (!k || gj_list_push(x, items, k) != 0) goto fail;
        }
    } else if (it->kind == GJ_LIST) {
        for (size_t i = 0; i < it->u.l.n; i++)
            if (gj_list_push(x, items, gj_ref(it->u.l.v[i])) != 0) goto fail;
    } else if (it->kind == GJ_STR) {
        for (size_t i = 0, w; i < it->u.s.n; i += w) {
            gj_utf8_at(it->u.s.p, it->u.s.n, i, &w);
            gj_val *c = gj_new_str(x, it->u.s.p + i, w);
            if (!c || gj_list_push(x, items, c) != 0) goto fail;
        }
    } else if (it->kind != GJ_UNDEF) {
        gj_fail(x, s->line, "cannot loop over %s", gj_kind_a(it->kind));
        goto fail;
    }
    size_t kept = 0;
    for (size_t i = 0; i < items->u.l.n; i++) {
        bool keep = true;
        if (s->c) {
            gj_scope ts;
            gj_val *c = NULL;
            if (gj_count_iteration(x, s->line) != 0 || gj_scope_open(x, &ts, sc) != 0) goto fail;
            if (gj_bind(x, &ts, s->a, items->u.l.v[i]) == 0) c = gj_eval(x, &ts, s->c);
            gj_unref(x, ts.vars);
            if (!c) goto fail;
            keep = gj_truthy(c);
            gj_unref(x, c);
        }
        if (keep)
            items->u.l.v[kept++] = items->u.l.v[i];
        else
            gj_unref(x, items->u.l.v[i]);
    }
    items->u.l.n = kept;
    gj_unref(x, it);
    return items;
fail:
    gj_unref(x, it);
    gj_unref(x, items);
    return NULL;
}

static int gj_render_for(gj_ctx *x, gj_scope *sc, const gj_node *s) {
    gj_scope ls;
    gj_val *items = NULL;
    int rc = -1;
    if (gj_scope_open(x, &ls, sc) != 0) return -1;
    if (!(items = gj_loop_items(x, &ls, s))) goto done;
    for (size_t i = 0; i < items->u.l.n; i++) {
        gj_val *loop = NULL;
        if (gj_count_iteration(x, s->line) != 0 || !(loop = gj_loop_info(x, items, i))) goto done;
        if (gj_dict_set(x, ls.vars, "loop", 4, loop) != 0 ||
            gj_bind(x, &ls, s->a, items->u.l.v[i]) != 0)
            goto done;
        if (gj_render_block(x, &ls, &s->body) != 0) goto done;
        int flow = x->flow;
        x->flow = 0;
        if (flow == GJ_FLOW_BREAK) break;
    }
    rc = items->u.l.n == 0 ? gj_render_block(x, &ls, &s->alt) : 0;
done:
    gj_unref(x, items);
    gj_unref(x, ls.vars);
    return rc;
}

static int gj_render_stmt(gj_ctx *x, gj_scope *sc, const gj_node *s) {
    switch (s->kind) {
    case GJ_N_TEXT: return gj_buf_put(x, x->out, s->str, s->len);
    case GJ_N_OUTPUT: {
        gj_val *v = gj_eval(x, sc, s->a);
        int rc = v ? gj_write(x, x->out, v, s->line) : -1;
        gj_unref(x, v);
        return rc;
    }
    case GJ_N_IF: {
        gj_val *c = gj_eval(x, sc, s->a);
        if (!c) return -1;
        bool t = gj_truthy(c);
        gj_unref(x, c);
        return gj_render_block(x, sc, t ? &s->body : &s->alt);
    }
    case GJ_N_FOR: return gj_render_for(x, sc, s);
    case GJ_N_SET: return gj_render_set(x, sc, s);
    case GJ_N_MACRO: return gj_render_macro_def(x, sc, s);
    case GJ_N_BREAK:
    case GJ_N_CONTINUE:
        x->flow = s->kind == GJ_N_BREAK ? GJ_FLOW_BREAK : GJ_FLOW_CONTINUE;
        return 0;
    default: {
        gj_val *v = gj_eval(x, sc, s);
        int rc = v ? gj_write(x, x->out, v, s->line) : -1;
        gj_unref(x, v);
        return rc;
    }
    }
}

static int gj_render_block(gj_ctx *x, gj_scope *sc, const gj_nodes *body) {
    for (size_t i = 0; i < body->n && !x->flow; i++)
        if (gj_render_stmt(x, sc, body->v[i]) != 0 || x->failed) return -1;
    return 0;
}

char *gw_jinja_render(const gw_jinja *t, const json_t *ctx, size_t max_out, size_t *out_len,
                      char *err, size_t err_len) {
    gj_buf out = {0};
    gj_ctx x = {.err = err, .err_len = err_len, .max_out = max_out, .out = &out};
    gj_scope top = {0};
    if (err && err_len) err[0] = '\0';
    if (out_len) *out_len = 0;
    if (!t) {
        gj_fail(&x, 0, "no template");
        return NULL;
    }
    if (ctx && !json_is_object(ctx)) {
        gj_fail(&x, 0, "the render context must be a JSON object");
        return NULL;
    }
    if (ctx)
        top.vars = gj_from_json(&x, ctx, 0);
    else
        top.vars = gj_new(&x, GJ_DICT);
    if (!top.vars || gj_render_block(&x, &top, &t->body) != 0) goto fail;
    if (x.flow) {
        gj_fail(&x, 0, "break or continue outside a for loop");
        goto fail;
    }
    if (!out.p && !(out.p = calloc(1, 1))) {
        gj_fail(&x, 0, "out of memory");
        goto fail;
    }
    gj_unref(&x, top.vars);
    if (out_len) *out_len = out.n;
    return out.p;
fail:
    gj_unref(&x, top.vars);
    free(out.p);
    return NULL;
}
