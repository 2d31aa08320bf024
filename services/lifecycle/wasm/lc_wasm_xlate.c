/* lc_wasm_xlate.c — tier 0's own wasm → C translator, with the validator it relies on.
 *
 * Owns: decoding and validating a module (WebAssembly core spec 1.0 §3 "Validation" for what
 * it accepts: MVP, mutable globals, sign extension, saturating float-to-int, memory.copy and
 * memory.fill, multi-value block types, one funcref table for call_indirect) and writing one C
 * translation unit for tcc as it decodes. Everything else is declined with a reason and the
 * caller (lc_wasm_compile.c) falls back to wasm2c. Does not own: the compile-bomb limits and
 * import checks (lc_wasm_parse.c, run before this), compiling (lc_wasm_compile.c).
 *
 * The generated code is the sandbox, so nothing is emitted for a module that is not valid: the
 * caller uses the text only when this returns PIE_OK, after the whole module was read.
 *
 * ABI (the same as wasm2c 1.0.32's code and our runtime, lc_wasm_rt.c): wasm-rt.h's memories
 * (8 GiB reservations: loads and stores are plain accesses at data + (u64)addr + offset, and a
 * fault is the bounds check), funcref tables with registered type ids, wasm_rt_trap with the
 * same reasons, host functions Z_<module>Z_<name>(struct Z_<module>_instance_t *, ...) named by
 * lc_wasm_mangle_import; the module's entry points are the lc_wasm glue (<cname>_lc_*) that
 * lc_wasm_compile.c's wasm.h gives wasm2c's code. Float helpers reproduce wasm2c's (NaN results
 * of min/max are tcc's NAN, nearest/floor/... quiet their NaN input).
 *
 * Less C than wasm2c: operands are kept as pending C expressions on a compile-time value stack
 * and folded into the instruction that consumes them. Evaluation order is kept exactly:
 *  - an entry is "effectful" if evaluating it may trap or read state that an effect can change
 *    (loads, calls, trapping arithmetic, memory.size/grow, mutable globals); at most one
 *    effectful entry is pending at any time (making a new one first stores any other into its
 *    temporary), so C's unspecified operand order never matters;
 *  - before any statement (store, call without result, global.set, branch, block entry) every
 *    pending effectful entry is stored, in stack order; local.set stores entries that read
 *    locals first;
 *  - at block, loop and if entry every entry is stored (temporaries named by stack depth and
 *    type, like wasm2c's), so that all control paths agree on where values live;
 *  - select materialises an effectful operand first (C's ?: evaluates only one arm).
 * Expressions are also stored when they nest deeper than XL_MAX_NEST or grow longer than
 * XL_MAX_EXPR, or refer to a temporary above their own depth (which a later store could
 * overwrite). */
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lc_wasm_int.h"
#include "lc_wasm_xlate.h"

#define XL_MAX_NEST 12
#define XL_MAX_EXPR 1000
/* Work bounds of the in-process translation (beyond them: declined, and wasm2c, a process
 * under the compile time limit, gets the module): C text, locals of all functions together
 * (each is declared), values a block or a branch carries. */
#define XL_MAX_C_BYTES    (96u << 20)
#define XL_MAX_ALL_LOCALS 2000000u
#define XL_MAX_ARITY      64u
/* Functions whose locals and temporaries take more than this are entered through a stack check
 * (lc_wasm_stack_floor): tcc does not probe the stack, and a frame larger than the guard (at
 * least 64 KiB, lc_wasm_instance_run checks) could step over it. */
#define XL_BIG_FRAME (16u << 10)

enum { T_I32 = 0x7f, T_I64 = 0x7e, T_F32 = 0x7d, T_F64 = 0x7c };

/* ---- growable text buffers ------------------------------------------------------------------ */

typedef struct xb {
    char *p;
    size_t len, cap;
    bool oom;
} xb;

static bool xb_reserve(xb *b, size_t more) {
    if (b->oom) return false;
    if (b->len + more + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more + 1) {
        if (cap > SIZE_MAX / 4) {
            b->oom = true;
            return false;
        }
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (p == NULL) {
        b->oom = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

static void xb_put(xb *b, const char *s, size_t n) {
    if (n == 0) return; /* s may be an empty buffer's NULL */
    if (!xb_reserve(b, n)) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void xb_puts(xb *b, const char *s) { xb_put(b, s, strlen(s)); }

static void xb_ch(xb *b, char c) {
    if (!xb_reserve(b, 1)) return;
    b->p[b->len++] = c;
    b->p[b->len] = '\0';
}

static void xb_dec(xb *b, uint64_t v) {
    char tmp[24];
    int n = 0;
    do {
        tmp[sizeof tmp - 1 - n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    xb_put(b, tmp + sizeof tmp - n, (size_t)n);
}

/* ---- translator state ----------------------------------------------------------------------- */

typedef struct xtype {
    const uint8_t *p, *r; /* value types of params and results (in the module's bytes) */
    uint32_t np, nr;
} xtype;

typedef struct xelem {
    uint32_t off, n;
    uint32_t *fn;
} xelem;

typedef struct xdata {
    uint32_t off, n;
    const uint8_t *bytes;
} xdata;

/* A compile-time operand stack entry. */
enum { K_DEAD, K_CONST, K_TMP, K_LOC, K_EXPR };
typedef struct xv {
    uint8_t t;       /* value type; 0: unknown (unreachable code) */
    uint8_t k;       /* K_* */
    uint8_t eff;     /* may trap or read state an effect changes */
    uint8_t rdloc;   /* reads a local */
    uint8_t nest;    /* depth of the expression tree */
    uint8_t load;    /* K_EXPR: a memory load is its outermost operation (see op_drop) */
    int32_t tmax;    /* deepest temporary it reads; -1 none */
    uint32_t idx;    /* K_TMP: depth; K_LOC: local */
    uint64_t c;      /* K_CONST: bits */
    size_t off, len; /* K_EXPR: text in the arena */
} xv;

enum { C_BLOCK, C_LOOP, C_IF, C_FUNC };
typedef struct xc {
    uint8_t kind;
    bool unr;     /* validation: the rest of the frame is unreachable (polymorphic stack) */
    bool live;    /* emission: code here is written */
    bool live_in; /* emission: code at the frame's start was written */
    bool used;    /* a branch targets the label */
    bool has_else;
    const uint8_t *pt, *rt;
    uint32_t np, nr, base, label;
} xc;

typedef struct xl {
    const uint8_t *base;
    pie_status *st;
    bool failed;
    pie_code code; /* why it failed */
    const char *cname;
    xtype *types;
    uint32_t n_types;
    uint32_t *ftype;
    uint32_t n_funcs, n_imp, cap_funcs;
    char **imp_c;     /* mangled C names of imported functions */
    uint8_t *imp_mod; /* 0: pie, 1: wasi_snapshot_preview1 */
    uint8_t *gtype, *gmut;
    uint64_t *ginit;
    uint32_t n_globals;
    bool has_mem, has_tab, has_start, has_entry, decls_done, has_dcount;
    uint32_t mem_min, mem_max, tab_min, tab_max, start, entry, dcount, n_code;
    xelem *elems;
    uint32_t n_elems;
    xdata *datas;
    uint32_t n_datas;
    xb out, fn, ex, sc;
    const lc_wasm_xlate_sink *sink; /* NULL: out keeps the whole text */
    size_t sent;                    /* bytes of out already given to sink */
    /* the function being translated */
    uint8_t *lt;
    uint32_t n_loc, cap_loc;
    xv *vs;
    uint32_t nv, capv;
    xc *cs;
    uint32_t nc, capc;
    xv *args;
    uint32_t cap_args;
    uint32_t *tgt;
    uint32_t cap_tgt;
    uint32_t tdep[4];
    uint32_t n_labels;
    /* Bounds that keep the stack scans linear in the body's size: */
    int64_t eff_at; /* index of the one pending effectful entry, or -1 */
    uint32_t lo_rd; /* entries below may not read locals while pending */
    uint32_t clean; /* entries below are all stored in their temporaries */
    uint64_t all_locals;
} xl;

typedef struct xr {
    const uint8_t *p, *end;
} xr;

static void xfail(xl *x, const xr *r, pie_code code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void xfail(xl *x, const xr *r, pie_code code, const char *fmt, ...) {
    if (x->failed) return;
    x->failed = true;
    x->code = code;
    char msg[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pie_status_set(x->st, code, "%s at byte %zu: %s",
                   code == PIE_UNIMPLEMENTED ? "declined" : "invalid",
                   r ? (size_t)(r->p - x->base) : (size_t)0, msg);
}
#define INVALID(...) xfail(x, r, PIE_INVALID_ARGUMENT, __VA_ARGS__)
#define DECLINE(...) xfail(x, r, PIE_UNIMPLEMENTED, __VA_ARGS__)

static void *xgrow(xl *x, void *p, uint32_t *cap, uint32_t need, size_t elt) {
    if (need <= *cap) return p;
    uint32_t c = *cap ? *cap : 16;
    while (c < need) {
        if (c > UINT32_MAX / 2) {
            xfail(x, NULL, PIE_RESOURCE_EXHAUSTED, "out of memory");
            return NULL;
        }
        c *= 2;
    }
    void *q = realloc(p, (size_t)c * elt);
    if (q == NULL) {
        xfail(x, NULL, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    *cap = c;
    return q;
}

/* ---- reading -------------------------------------------------------------------------------- */

static uint8_t rd_byte(xl *x, xr *r) {
    if (x->failed) return 0;
    if (r->p >= r->end) {
        INVALID("unexpected end");
        return 0;
    }
    return *r->p++;
}

/* Unsigned LEB128 of at most `bits` bits, with the spec's limits on length and unused bits. */
static uint64_t rd_uleb(xl *x, xr *r, unsigned bits) {
    uint64_t v = 0;
    unsigned maxb = (bits + 6) / 7;
    for (unsigned i = 0; i < maxb; i++) {
        uint8_t b = rd_byte(x, r);
        if (x->failed) return 0;
        unsigned shift = 7 * i;
        if (i == maxb - 1) {
            unsigned used = bits - shift;
            if ((b & 0x80) || (used < 7 && (b & 0x7f) >> used)) {
                INVALID("integer representation too long or too large");
                return 0;
            }
        }
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return v;
    }
    return v;
}

/* Signed LEB128 of at most `bits` bits; the result sign-extended to 64 bits. */
static uint64_t rd_sleb(xl *x, xr *r, unsigned bits) {
    uint64_t v = 0;
    unsigned maxb = (bits + 6) / 7;
    for (unsigned i = 0; i < maxb; i++) {
        uint8_t b = rd_byte(x, r);
        if (x->failed) return 0;
        unsigned shift = 7 * i;
        if (i == maxb - 1) {
            unsigned used = bits - shift; /* 1..7 meaningful bits; the rest copy the sign */
            if (b & 0x80) {
                INVALID("integer representation too long");
                return 0;
            }
            if (used < 7) {
                unsigned hi = (b & 0x7fu) >> (used - 1), all = (1u << (8 - used)) - 1;
                if (hi != 0 && hi != all) {
                    INVALID("integer too large");
                    return 0;
                }
            }
        }
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            shift += 7;
            if (shift < 64 && (b & 0x40)) v |= ~(uint64_t)0 << shift;
            return v;
        }
    }
    return v;
}

static uint32_t rd_u32(xl *x, xr *r) { return (uint32_t)rd_uleb(x, r, 32); }

static uint64_t rd_fixed(xl *x, xr *r, unsigned n) {
    if (x->failed) return 0;
    if ((size_t)(r->end - r->p) < n) {
        INVALID("unexpected end");
        return 0;
    }
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++) v |= (uint64_t)r->p[i] << (8 * i);
    r->p += n;
    return v;
}

static bool utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            len = 2;
            cp = c & 0x1f;
        } else if ((c & 0xf0) == 0xe0) {
            len = 3;
            cp = c & 0x0f;
        } else if ((c & 0xf8) == 0xf0) {
            len = 4;
            cp = c & 0x07;
        } else {
            return false;
        }
        if (n - i < len) return false;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += len;
    }
    return true;
}

/* A name: returns its bytes (in the module) and length. */
static const uint8_t *rd_name(xl *x, xr *r, uint32_t *len) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return NULL;
    if ((size_t)(r->end - r->p) < n) {
        INVALID("name runs past its section");
        return NULL;
    }
    const uint8_t *s = r->p;
    if (!utf8_ok(s, n)) {
        INVALID("name is not valid UTF-8");
        return NULL;
    }
    r->p += n;
    *len = n;
    return s;
}

static bool numtype(uint8_t t) { return t >= T_F64 && t <= T_I32; }

static int ti(uint8_t t) { return T_I32 - t; } /* i32 0, i64 1, f32 2, f64 3 */
static const char *const CT[4] = {"u32", "u64", "f32", "f64"};
static const char LET[4] = {'i', 'j', 'f', 'd'};

/* A temporary's name: '_', the letter of its type and its stack depth ("_f32": an f32 at depth
 * 32). Without the '_' depths 32 and 64 would name f32 temporaries "f32" and "f64", shadowing
 * the prelude's typedefs (tcc then refuses the C). Block-scope names of '_' and a lowercase
 * letter belong to the program (C11 7.1.3: reserved only at file scope), so no header can
 * define them as macros, and the prelude defines none. */
static void put_tmp(xb *b, int k, uint32_t depth) { /* k: ti() of its type */
    xb_ch(b, '_');
    xb_ch(b, LET[k]);
    xb_dec(b, depth);
}

static const char *tname(uint8_t t) {
    switch (t) {
    case T_I32: return "i32";
    case T_I64: return "i64";
    case T_F32: return "f32";
    case T_F64: return "f64";
    case 0: return "unknown";
    default: return "other";
    }
}

/* ---- values as C text ----------------------------------------------------------------------- */

static void put_const(xb *b, uint8_t t, uint64_t c) {
    char tmp[64];
    switch (t) {
    case T_I32:
        xb_dec(b, (uint32_t)c);
        xb_ch(b, 'u');
        return;
    case T_I64:
        xb_dec(b, c);
        xb_puts(b, "ull");
        return;
    case T_F32: {
        uint32_t bits = (uint32_t)c;
        if ((bits & 0x7f800000u) == 0x7f800000u) {
            xb_puts(b, "lc_f32(");
            xb_dec(b, bits);
            xb_puts(b, "u)");
            return;
        }
        float f;
        memcpy(&f, &bits, 4);
        snprintf(tmp, sizeof tmp, (bits >> 31) ? "(%af)" : "%af", (double)f);
        xb_puts(b, tmp);
        return;
    }
    default: {
        if ((c & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) {
            xb_puts(b, "lc_f64(");
            xb_dec(b, c);
            xb_puts(b, "ull)");
            return;
        }
        double d;
        memcpy(&d, &c, 8);
        snprintf(tmp, sizeof tmp, (c >> 63) ? "(%a)" : "%a", d);
        xb_puts(b, tmp);
        return;
    }
    }
}

static void put_val(xl *x, xb *b, const xv *v) {
    switch (v->k) {
    case K_CONST: put_const(b, v->t, v->c); return;
    case K_TMP: put_tmp(b, ti(v->t), v->idx); return;
    case K_LOC:
        xb_ch(b, 'l');
        xb_dec(b, v->idx);
        return;
    case K_EXPR: xb_put(b, x->ex.p + v->off, v->len); return;
    default: xb_ch(b, '0'); return; /* never written: dead code emits nothing */
    }
}

/* ---- the compile-time stack ----------------------------------------------------------------- */

static xc *top(xl *x) { return &x->cs[x->nc - 1]; }
static bool live(xl *x) { return x->cs[x->nc - 1].live; }

static void note_tmp(xl *x, uint8_t t, uint32_t depth) {
    int k = ti(t);
    if (depth + 1 > x->tdep[k]) x->tdep[k] = depth + 1;
}

/* Stores entry i into its temporary (its depth, its type). */
static void mat(xl *x, uint32_t i) {
    xv *v = &x->vs[i];
    if (v->k == K_DEAD || (v->k == K_TMP && v->idx == i)) return;
    xb *b = &x->fn;
    put_tmp(b, ti(v->t), i);
    xb_ch(b, '=');
    put_val(x, b, v);
    xb_puts(b, ";\n");
    note_tmp(x, v->t, i);
    if (x->eff_at == (int64_t)i) x->eff_at = -1;
    *v = (xv){.t = v->t, .k = K_TMP, .idx = i, .tmax = (int32_t)i};
}

/* Stores the pending effectful entry (there is at most one) if it sits below upto. */
static void flush_eff(xl *x, uint32_t upto) {
    if (x->eff_at >= 0 && x->eff_at < (int64_t)upto && x->eff_at < (int64_t)x->nv)
        mat(x, (uint32_t)x->eff_at);
}

static void flush_loc(xl *x) {
    for (uint32_t i = x->lo_rd; i < x->nv; i++)
        if (x->vs[i].rdloc) mat(x, i);
    x->lo_rd = x->nv;
}

static void flush_all(xl *x) {
    for (uint32_t i = x->clean; i < x->nv; i++) mat(x, i);
    x->clean = x->nv;
    x->lo_rd = x->nv;
}

/* The stack shrank to nv entries. */
static void shrunk(xl *x) {
    if (x->clean > x->nv) x->clean = x->nv;
    if (x->eff_at >= (int64_t)x->nv) x->eff_at = -1;
}

static xv *push(xl *x, uint8_t t) {
    xv *vs = xgrow(x, x->vs, &x->capv, x->nv + 1, sizeof *vs);
    if (vs == NULL) return NULL;
    x->vs = vs;
    xv *v = &vs[x->nv++];
    *v = (xv){.t = t, .k = K_DEAD, .tmax = -1};
    return v;
}

static xv pop(xl *x, xr *r, uint8_t want) {
    xc *c = top(x);
    xv v = {.t = want, .k = K_DEAD, .tmax = -1};
    if (x->nv == c->base) {
        if (!c->unr)
            INVALID("operand stack underflow (%s expected)", want ? tname(want) : "a value");
        return v;
    }
    v = x->vs[--x->nv];
    shrunk(x);
    if (want && v.t && v.t != want)
        INVALID("type mismatch: %s expected, %s found", tname(want), tname(v.t));
    return v;
}

/* Pushes the expression now in x->sc as a new entry of type t; stores it at once when it is
 * too deep, too long or reads a temporary above its depth. Effectful: every other pending
 * effectful entry is stored first. */
static void push_sc(xl *x, uint8_t t, bool eff, bool rdloc, int nest, int32_t tmax) {
    if (x->failed) return;
    if (!live(x)) {
        push(x, t);
        return;
    }
    if (eff) flush_eff(x, x->nv);
    size_t lo = 0;
    for (uint32_t i = x->nv; i-- > 0;)
        if (x->vs[i].k == K_EXPR) {
            lo = x->vs[i].off + x->vs[i].len;
            break;
        }
    x->ex.len = lo;
    xb_put(&x->ex, x->sc.p, x->sc.len);
    uint32_t d = x->nv;
    xv *v = push(x, t);
    if (v == NULL) return;
    *v = (xv){.t = t,
              .k = K_EXPR,
              .eff = eff,
              .rdloc = rdloc,
              .nest = (uint8_t)(nest > 255 ? 255 : nest),
              .tmax = tmax,
              .off = lo,
              .len = x->sc.len};
    if (eff) x->eff_at = d;
    if (rdloc && d < x->lo_rd) x->lo_rd = d;
    if (tmax > (int32_t)d || nest > XL_MAX_NEST || x->sc.len > XL_MAX_EXPR) mat(x, d);
}

/* Expands tpl ('@' a, '#' b, '$' c) into a new entry of type t. */
static void res(xl *x, uint8_t t, const char *tpl, const xv *a, const xv *b, const xv *c,
                bool traps) {
    if (x->failed) return;
    if (!live(x)) {
        push(x, t);
        return;
    }
    const xv *ops[3] = {a, b, c};
    bool eff = traps, rdloc = false;
    int nest = 0;
    int32_t tmax = -1;
    for (int i = 0; i < 3; i++)
        if (ops[i]) {
            eff |= ops[i]->eff;
            rdloc |= ops[i]->rdloc;
            if (ops[i]->nest + 1 > nest) nest = ops[i]->nest + 1;
            if (ops[i]->tmax > tmax) tmax = ops[i]->tmax;
        }
    x->sc.len = 0;
    for (const char *s = tpl; *s; s++) {
        if (*s == '@')
            put_val(x, &x->sc, a);
        else if (*s == '#')
            put_val(x, &x->sc, b);
        else if (*s == '$')
            put_val(x, &x->sc, c);
        else
            xb_ch(&x->sc, *s);
    }
    push_sc(x, t, eff, rdloc, nest, tmax);
}

static void emit_val(xl *x, const xv *v) { put_val(x, &x->fn, v); }

/* ---- numeric instructions 0x45..0xc4 -------------------------------------------------------- */

typedef struct xop {
    const char *tpl;
    uint8_t a, b, out, traps; /* operand types (b 0: unary) */
} xop;

#define I T_I32
#define J T_I64
#define F T_F32
#define D T_F64
static const xop NUM[0xc5 - 0x45] = {
    [0x45 - 0x45] = {"((u32)!@)", I, 0, I, 0},
    [0x46 - 0x45] = {"((u32)(@==#))", I, I, I, 0},
    [0x47 - 0x45] = {"((u32)(@!=#))", I, I, I, 0},
    [0x48 - 0x45] = {"((u32)((s32)@<(s32)#))", I, I, I, 0},
    [0x49 - 0x45] = {"((u32)(@<#))", I, I, I, 0},
    [0x4a - 0x45] = {"((u32)((s32)@>(s32)#))", I, I, I, 0},
    [0x4b - 0x45] = {"((u32)(@>#))", I, I, I, 0},
    [0x4c - 0x45] = {"((u32)((s32)@<=(s32)#))", I, I, I, 0},
    [0x4d - 0x45] = {"((u32)(@<=#))", I, I, I, 0},
    [0x4e - 0x45] = {"((u32)((s32)@>=(s32)#))", I, I, I, 0},
    [0x4f - 0x45] = {"((u32)(@>=#))", I, I, I, 0},
    [0x50 - 0x45] = {"((u32)!@)", J, 0, I, 0},
    [0x51 - 0x45] = {"((u32)(@==#))", J, J, I, 0},
    [0x52 - 0x45] = {"((u32)(@!=#))", J, J, I, 0},
    [0x53 - 0x45] = {"((u32)((s64)@<(s64)#))", J, J, I, 0},
    [0x54 - 0x45] = {"((u32)(@<#))", J, J, I, 0},
    [0x55 - 0x45] = {"((u32)((s64)@>(s64)#))", J, J, I, 0},
    [0x56 - 0x45] = {"((u32)(@>#))", J, J, I, 0},
    [0x57 - 0x45] = {"((u32)((s64)@<=(s64)#))", J, J, I, 0},
    [0x58 - 0x45] = {"((u32)(@<=#))", J, J, I, 0},
    [0x59 - 0x45] = {"((u32)((s64)@>=(s64)#))", J, J, I, 0},
    [0x5a - 0x45] = {"((u32)(@>=#))", J, J, I, 0},
    [0x5b - 0x45] = {"((u32)(@==#))", F, F, I, 0},
    [0x5c - 0x45] = {"((u32)(@!=#))", F, F, I, 0},
    [0x5d - 0x45] = {"((u32)(@<#))", F, F, I, 0},
    [0x5e - 0x45] = {"((u32)(@>#))", F, F, I, 0},
    [0x5f - 0x45] = {"((u32)(@<=#))", F, F, I, 0},
    [0x60 - 0x45] = {"((u32)(@>=#))", F, F, I, 0},
    [0x61 - 0x45] = {"((u32)(@==#))", D, D, I, 0},
    [0x62 - 0x45] = {"((u32)(@!=#))", D, D, I, 0},
    [0x63 - 0x45] = {"((u32)(@<#))", D, D, I, 0},
    [0x64 - 0x45] = {"((u32)(@>#))", D, D, I, 0},
    [0x65 - 0x45] = {"((u32)(@<=#))", D, D, I, 0},
    [0x66 - 0x45] = {"((u32)(@>=#))", D, D, I, 0},
    [0x67 - 0x45] = {"lc_clz32(@)", I, 0, I, 0},
    [0x68 - 0x45] = {"lc_ctz32(@)", I, 0, I, 0},
    [0x69 - 0x45] = {"lc_popcnt32(@)", I, 0, I, 0},
    [0x6a - 0x45] = {"(@+#)", I, I, I, 0},
    [0x6b - 0x45] = {"(@-#)", I, I, I, 0},
    [0x6c - 0x45] = {"(@*#)", I, I, I, 0},
    [0x6d - 0x45] = {"lc_divs32(@,#)", I, I, I, 1},
    [0x6e - 0x45] = {"lc_divu32(@,#)", I, I, I, 1},
    [0x6f - 0x45] = {"lc_rems32(@,#)", I, I, I, 1},
    [0x70 - 0x45] = {"lc_remu32(@,#)", I, I, I, 1},
    [0x71 - 0x45] = {"(@&#)", I, I, I, 0},
    [0x72 - 0x45] = {"(@|#)", I, I, I, 0},
    [0x73 - 0x45] = {"(@^#)", I, I, I, 0},
    [0x74 - 0x45] = {"(@<<(#&31))", I, I, I, 0},
    [0x75 - 0x45] = {"((u32)((s32)@>>(#&31)))", I, I, I, 0},
    [0x76 - 0x45] = {"(@>>(#&31))", I, I, I, 0},
    [0x77 - 0x45] = {"lc_rotl32(@,#)", I, I, I, 0},
    [0x78 - 0x45] = {"lc_rotr32(@,#)", I, I, I, 0},
    [0x79 - 0x45] = {"lc_clz64(@)", J, 0, J, 0},
    [0x7a - 0x45] = {"lc_ctz64(@)", J, 0, J, 0},
    [0x7b - 0x45] = {"lc_popcnt64(@)", J, 0, J, 0},
    [0x7c - 0x45] = {"(@+#)", J, J, J, 0},
    [0x7d - 0x45] = {"(@-#)", J, J, J, 0},
    [0x7e - 0x45] = {"(@*#)", J, J, J, 0},
    [0x7f - 0x45] = {"lc_divs64(@,#)", J, J, J, 1},
    [0x80 - 0x45] = {"lc_divu64(@,#)", J, J, J, 1},
    [0x81 - 0x45] = {"lc_rems64(@,#)", J, J, J, 1},
    [0x82 - 0x45] = {"lc_remu64(@,#)", J, J, J, 1},
    [0x83 - 0x45] = {"(@&#)", J, J, J, 0},
    [0x84 - 0x45] = {"(@|#)", J, J, J, 0},
    [0x85 - 0x45] = {"(@^#)", J, J, J, 0},
    [0x86 - 0x45] = {"(@<<(#&63))", J, J, J, 0},
    [0x87 - 0x45] = {"((u64)((s64)@>>(#&63)))", J, J, J, 0},
    [0x88 - 0x45] = {"(@>>(#&63))", J, J, J, 0},
    [0x89 - 0x45] = {"lc_rotl64(@,#)", J, J, J, 0},
    [0x8a - 0x45] = {"lc_rotr64(@,#)", J, J, J, 0},
    [0x8b - 0x45] = {"lc_absf(@)", F, 0, F, 0},
    [0x8c - 0x45] = {"lc_negf(@)", F, 0, F, 0},
    [0x8d - 0x45] = {"lc_ceilf(@)", F, 0, F, 0},
    [0x8e - 0x45] = {"lc_floorf(@)", F, 0, F, 0},
    [0x8f - 0x45] = {"lc_truncf(@)", F, 0, F, 0},
    [0x90 - 0x45] = {"lc_nearf(@)", F, 0, F, 0},
    [0x91 - 0x45] = {"lc_sqrtf(@)", F, 0, F, 0},
    [0x92 - 0x45] = {"(@+#)", F, F, F, 0},
    [0x93 - 0x45] = {"(@-#)", F, F, F, 0},
    [0x94 - 0x45] = {"(@*#)", F, F, F, 0},
    [0x95 - 0x45] = {"(@/#)", F, F, F, 0},
    [0x96 - 0x45] = {"lc_minf(@,#)", F, F, F, 0},
    [0x97 - 0x45] = {"lc_maxf(@,#)", F, F, F, 0},
    [0x98 - 0x45] = {"copysignf(@,#)", F, F, F, 0},
    [0x99 - 0x45] = {"lc_abs(@)", D, 0, D, 0},
    [0x9a - 0x45] = {"lc_neg(@)", D, 0, D, 0},
    [0x9b - 0x45] = {"lc_ceil(@)", D, 0, D, 0},
    [0x9c - 0x45] = {"lc_floor(@)", D, 0, D, 0},
    [0x9d - 0x45] = {"lc_trunc(@)", D, 0, D, 0},
    [0x9e - 0x45] = {"lc_near(@)", D, 0, D, 0},
    [0x9f - 0x45] = {"lc_sqrt(@)", D, 0, D, 0},
    [0xa0 - 0x45] = {"(@+#)", D, D, D, 0},
    [0xa1 - 0x45] = {"(@-#)", D, D, D, 0},
    [0xa2 - 0x45] = {"(@*#)", D, D, D, 0},
    [0xa3 - 0x45] = {"(@/#)", D, D, D, 0},
    [0xa4 - 0x45] = {"lc_min(@,#)", D, D, D, 0},
    [0xa5 - 0x45] = {"lc_max(@,#)", D, D, D, 0},
    [0xa6 - 0x45] = {"copysign(@,#)", D, D, D, 0},
    [0xa7 - 0x45] = {"((u32)@)", J, 0, I, 0},
    [0xa8 - 0x45] = {"lc_ts32f(@)", F, 0, I, 1},
    [0xa9 - 0x45] = {"lc_tu32f(@)", F, 0, I, 1},
    [0xaa - 0x45] = {"lc_ts32d(@)", D, 0, I, 1},
    [0xab - 0x45] = {"lc_tu32d(@)", D, 0, I, 1},
    [0xac - 0x45] = {"((u64)(s64)(s32)@)", I, 0, J, 0},
    [0xad - 0x45] = {"((u64)@)", I, 0, J, 0},
    [0xae - 0x45] = {"lc_ts64f(@)", F, 0, J, 1},
    [0xaf - 0x45] = {"lc_tu64f(@)", F, 0, J, 1},
    [0xb0 - 0x45] = {"lc_ts64d(@)", D, 0, J, 1},
    [0xb1 - 0x45] = {"lc_tu64d(@)", D, 0, J, 1},
    [0xb2 - 0x45] = {"((f32)(s32)@)", I, 0, F, 0},
    [0xb3 - 0x45] = {"((f32)@)", I, 0, F, 0},
    [0xb4 - 0x45] = {"((f32)(s64)@)", J, 0, F, 0},
    [0xb5 - 0x45] = {"((f32)@)", J, 0, F, 0},
    [0xb6 - 0x45] = {"((f32)lc_quiet(@))", D, 0, F, 0},
    [0xb7 - 0x45] = {"((f64)(s32)@)", I, 0, D, 0},
    [0xb8 - 0x45] = {"((f64)@)", I, 0, D, 0},
    [0xb9 - 0x45] = {"((f64)(s64)@)", J, 0, D, 0},
    [0xba - 0x45] = {"((f64)@)", J, 0, D, 0},
    [0xbb - 0x45] = {"((f64)lc_quietf(@))", F, 0, D, 0},
    [0xbc - 0x45] = {"lc_i32f(@)", F, 0, I, 0},
    [0xbd - 0x45] = {"lc_i64d(@)", D, 0, J, 0},
    [0xbe - 0x45] = {"lc_f32(@)", I, 0, F, 0},
    [0xbf - 0x45] = {"lc_f64(@)", J, 0, D, 0},
    [0xc0 - 0x45] = {"((u32)(s32)(s8)@)", I, 0, I, 0},
    [0xc1 - 0x45] = {"((u32)(s32)(s16)@)", I, 0, I, 0},
    [0xc2 - 0x45] = {"((u64)(s64)(s8)@)", J, 0, J, 0},
    [0xc3 - 0x45] = {"((u64)(s64)(s16)@)", J, 0, J, 0},
    [0xc4 - 0x45] = {"((u64)(s64)(s32)@)", J, 0, J, 0},
};
/* 0xfc 0..7: saturating truncation */
static const xop SAT[8] = {
    {"lc_ss32f(@)", F, 0, I, 0}, {"lc_su32f(@)", F, 0, I, 0}, {"lc_ss32d(@)", D, 0, I, 0},
    {"lc_su32d(@)", D, 0, I, 0}, {"lc_ss64f(@)", F, 0, J, 0}, {"lc_su64f(@)", F, 0, J, 0},
    {"lc_ss64d(@)", D, 0, J, 0}, {"lc_su64d(@)", D, 0, J, 0},
};
#undef I
#undef J
#undef F
#undef D

static void numeric(xl *x, xr *r, const xop *o) {
    xv b = {0}, a;
    if (o->b) b = pop(x, r, o->b);
    a = pop(x, r, o->a);
    res(x, o->out, o->tpl, &a, o->b ? &b : NULL, NULL, o->traps);
}

/* ---- memory instructions -------------------------------------------------------------------- */

static const struct {
    const char *pre, *ct, *post;
    uint8_t out, align;
} LOADS[14] = {
    {"", "u32", "", T_I32, 2},        {"", "u64", "", T_I64, 3},
    {"", "f32", "", T_F32, 2},        {"", "f64", "", T_F64, 3},
    {"((u32)", "s8", ")", T_I32, 0},  {"((u32)", "u8", ")", T_I32, 0},
    {"((u32)", "s16", ")", T_I32, 1}, {"((u32)", "u16", ")", T_I32, 1},
    {"((u64)", "s8", ")", T_I64, 0},  {"((u64)", "u8", ")", T_I64, 0},
    {"((u64)", "s16", ")", T_I64, 1}, {"((u64)", "u16", ")", T_I64, 1},
    {"((u64)", "s32", ")", T_I64, 2}, {"((u64)", "u32", ")", T_I64, 2},
};
static const struct {
    const char *ct;
    uint8_t in, align;
} STORES[9] = {
    {"u32", T_I32, 2}, {"u64", T_I64, 3}, {"f32", T_F32, 2}, {"f64", T_F64, 3}, {"u8", T_I32, 0},
    {"u16", T_I32, 1}, {"u8", T_I64, 0},  {"u16", T_I64, 1}, {"u32", T_I64, 2},
};

static uint32_t memarg(xl *x, xr *r, unsigned natural) {
    uint32_t align = rd_u32(x, r);
    uint32_t off = rd_u32(x, r);
    if (x->failed) return 0;
    if (!x->has_mem)
        INVALID("memory access without a memory");
    else if (align > natural)
        INVALID("alignment 2^%u larger than natural (2^%u)", align, natural);
    return off;
}

static void load(xl *x, xr *r, unsigned k) {
    uint32_t off = memarg(x, r, LOADS[k].align);
    xv a = pop(x, r, T_I32);
    if (x->failed) return;
    if (!live(x)) {
        push(x, LOADS[k].out);
        return;
    }
    x->sc.len = 0;
    xb_puts(&x->sc, LOADS[k].pre);
    xb_puts(&x->sc, "LD(");
    xb_puts(&x->sc, LOADS[k].ct);
    xb_ch(&x->sc, ',');
    put_val(x, &x->sc, &a);
    xb_ch(&x->sc, ',');
    xb_dec(&x->sc, off);
    xb_puts(&x->sc, "u)");
    xb_puts(&x->sc, LOADS[k].post);
    push_sc(x, LOADS[k].out, true, a.rdloc, a.nest + 1, a.tmax);
    if (!x->failed && x->vs[x->nv - 1].k == K_EXPR) x->vs[x->nv - 1].load = 1;
}

static void store(xl *x, xr *r, unsigned k) {
    uint32_t off = memarg(x, r, STORES[k].align);
    xv v = pop(x, r, STORES[k].in);
    xv a = pop(x, r, T_I32);
    if (x->failed || !live(x)) return;
    flush_eff(x, x->nv);
    xb *b = &x->fn;
    xb_puts(b, "ST(");
    xb_puts(b, STORES[k].ct);
    xb_ch(b, ',');
    emit_val(x, &a);
    xb_ch(b, ',');
    xb_dec(b, off);
    xb_puts(b, "u,");
    emit_val(x, &v);
    xb_puts(b, ");\n");
}

/* ---- control -------------------------------------------------------------------------------- */

static const uint8_t ONE_TYPE[4] = {T_F64, T_F32, T_I64, T_I32};

/* A block type: 0x40, one value type or a type index. */
static void blocktype(xl *x, xr *r, xc *c) {
    c->np = c->nr = 0;
    c->pt = c->rt = NULL;
    if (x->failed) return;
    if (r->p >= r->end) {
        INVALID("unexpected end");
        return;
    }
    uint8_t b = *r->p;
    if (b == 0x40) {
        r->p++;
        return;
    }
    if (numtype(b)) {
        r->p++;
        c->rt = &ONE_TYPE[b - T_F64];
        c->nr = 1;
        return;
    }
    if (b == 0x7b || b == 0x70 || b == 0x6f) {
        DECLINE("block of type 0x%02x (SIMD or reference types)", b);
        return;
    }
    uint64_t v = rd_sleb(x, r, 33);
    if (x->failed) return;
    if (v >= x->n_types) {
        INVALID("block type index %lld out of range", (long long)v);
        return;
    }
    xtype *t = &x->types[v];
    if (t->np > XL_MAX_ARITY || t->nr > XL_MAX_ARITY) {
        DECLINE("block type with more than %u parameters or results", XL_MAX_ARITY);
        return;
    }
    c->pt = t->p;
    c->np = t->np;
    c->rt = t->r;
    c->nr = t->nr;
}

/* Checks that the top n entries have types ts (fewer allowed only in unreachable code). */
static void check_top(xl *x, xr *r, const uint8_t *ts, uint32_t n) {
    xc *c = top(x);
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        uint8_t want = ts[n - 1 - i];
        if (x->nv - c->base <= i) {
            if (!c->unr) INVALID("operand stack underflow at a branch (%s expected)", tname(want));
            return;
        }
        uint8_t t = x->vs[x->nv - 1 - i].t;
        if (t && t != want)
            INVALID("branch operand of type %s where %s is expected", tname(t), tname(want));
    }
}

static void label_types(const xc *t, const uint8_t **ts, uint32_t *n) {
    *ts = t->kind == C_LOOP ? t->pt : t->rt;
    *n = t->kind == C_LOOP ? t->np : t->nr;
}

/* The values a branch to frame t carries (the top n, stored in their temporaries) copied to
 * where t expects them, then the jump. Live code only. */
static void emit_branch(xl *x, xc *t) {
    const uint8_t *ts;
    uint32_t n;
    label_types(t, &ts, &n);
    xb *b = &x->fn;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t from = x->nv - n + i, to = t->base + i;
        if (from == to) continue;
        put_tmp(b, ti(ts[i]), to);
        xb_ch(b, '=');
        put_tmp(b, ti(ts[i]), from);
        xb_ch(b, ';');
        note_tmp(x, ts[i], to);
    }
    xb_puts(b, "goto L");
    xb_dec(b, t->label);
    xb_puts(b, ";\n");
    t->used = true;
}

static void set_unreachable(xl *x) {
    xc *c = top(x);
    x->nv = c->base;
    shrunk(x);
    c->unr = true;
    c->live = false;
}

static xc *frame_push(xl *x, uint8_t kind) {
    xc *cs = xgrow(x, x->cs, &x->capc, x->nc + 1, sizeof *cs);
    if (cs == NULL) return NULL;
    x->cs = cs;
    xc *c = &cs[x->nc++];
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->label = x->n_labels++;
    return c;
}

static void block_start(xl *x, xr *r, uint8_t kind) {
    xc bt;
    blocktype(x, r, &bt);
    xv cond = {0};
    if (kind == C_IF) cond = pop(x, r, T_I32);
    if (x->failed) return;
    bool was_live = live(x);
    if (was_live) flush_all(x);
    /* the parameters move from the outer frame into the new one */
    check_top(x, r, bt.pt, bt.np);
    if (x->failed) return;
    uint32_t have = x->nv - top(x)->base;
    uint32_t keep = bt.np < have ? bt.np : have;
    uint32_t base = x->nv - keep;
    if (was_live && kind == C_IF) {
        xb_puts(&x->fn, "if(");
        emit_val(x, &cond);
        xb_puts(&x->fn, "){\n");
    }
    xc *c = frame_push(x, kind);
    if (c == NULL) return;
    c->pt = bt.pt;
    c->np = bt.np;
    c->rt = bt.rt;
    c->nr = bt.nr;
    c->live = c->live_in = was_live;
    /* The parameters (checked above) become the new frame's first values. Live, they are the
     * stored entries already there; in unreachable code (where fewer may be present, the
     * missing ones being the deepest) they are replaced by entries of the declared types. */
    x->nv = base;
    shrunk(x);
    c->base = base;
    if (was_live)
        x->nv += keep;
    else
        for (uint32_t i = 0; i < bt.np; i++) push(x, bt.pt[i]);
    if (was_live && kind == C_LOOP) {
        xb_ch(&x->fn, 'L');
        xb_dec(&x->fn, c->label);
        xb_puts(&x->fn, ":;\n");
    }
}

/* The end of a frame's code (at else or end): results checked and, in live code, stored in the
 * frame's result temporaries. Leaves the stack at the frame's base. */
static void frame_results(xl *x, xr *r, xc *c) {
    if (c->live) {
        if (x->nv != c->base + c->nr) {
            INVALID("%u values at the end of a block that returns %u", x->nv - c->base, c->nr);
            return;
        }
        for (uint32_t i = 0; i < c->nr; i++) mat(x, c->base + i);
    }
    for (uint32_t i = c->nr; i-- > 0 && !x->failed;) pop(x, r, c->rt[i]);
    if (!x->failed && x->nv != c->base) INVALID("values left on the stack at the end of a block");
}

static void op_else(xl *x, xr *r) {
    xc *c = top(x);
    if (c->kind != C_IF || c->has_else) {
        INVALID("else without if");
        return;
    }
    frame_results(x, r, c);
    if (x->failed) return;
    c->has_else = true;
    c->unr = false;
    c->live = c->live_in;
    for (uint32_t i = 0; i < c->np; i++) {
        xv *v = push(x, c->pt[i]);
        if (v && c->live_in)
            *v =
                (xv){.t = c->pt[i], .k = K_TMP, .idx = c->base + i, .tmax = (int32_t)(c->base + i)};
    }
    if (c->live_in) xb_puts(&x->fn, "}else{\n");
}

static bool types_eq(const uint8_t *a, uint32_t na, const uint8_t *b, uint32_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, na) == 0);
}

static void op_end(xl *x, xr *r) {
    xc *c = top(x);
    if (c->kind == C_FUNC && c->live && !c->used && c->nr == 1 && x->nv == c->base + 1) {
        xv v = pop(x, r, c->rt[0]);
        if (x->failed) return;
        xb_puts(&x->fn, "return ");
        emit_val(x, &v);
        xb_puts(&x->fn, ";\n");
        x->nc--;
        return;
    }
    frame_results(x, r, c);
    if (x->failed) return;
    if (c->kind == C_IF && !c->has_else && !types_eq(c->pt, c->np, c->rt, c->nr)) {
        INVALID("if without else must have the same parameter and result types");
        return;
    }
    xb *b = &x->fn;
    if (c->live_in) {
        if (c->kind == C_IF) xb_puts(b, "}\n");
        if (c->used && c->kind != C_LOOP) {
            xb_ch(b, 'L');
            xb_dec(b, c->label);
            xb_puts(b, ":;\n");
        }
        if (c->kind == C_FUNC && c->nr == 1) {
            note_tmp(x, c->rt[0], 0);
            xb_puts(b, "return ");
            put_tmp(b, ti(c->rt[0]), 0);
            xb_puts(b, ";\n");
        }
    }
    x->nc--;
    if (x->nc == 0) return;
    for (uint32_t i = 0; i < c->nr; i++) {
        xv *v = push(x, c->rt[i]);
        if (v && c->live_in) {
            *v =
                (xv){.t = c->rt[i], .k = K_TMP, .idx = c->base + i, .tmax = (int32_t)(c->base + i)};
            note_tmp(x, c->rt[i], c->base + i);
        }
    }
}

static xc *label(xl *x, xr *r, uint32_t depth) {
    if (depth >= x->nc) {
        INVALID("branch to label %u with %u open", depth, x->nc);
        return NULL;
    }
    return &x->cs[x->nc - 1 - depth];
}

static void op_br(xl *x, xr *r) {
    xc *t = label(x, r, rd_u32(x, r));
    if (t == NULL || x->failed) return;
    const uint8_t *ts;
    uint32_t n;
    label_types(t, &ts, &n);
    check_top(x, r, ts, n);
    if (x->failed) return;
    if (live(x)) {
        flush_eff(x, x->nv);
        for (uint32_t i = x->nv - n; i < x->nv; i++) mat(x, i);
        emit_branch(x, t);
    }
    set_unreachable(x);
}

static void op_br_if(xl *x, xr *r) {
    xc *t = label(x, r, rd_u32(x, r));
    xv cond = pop(x, r, T_I32);
    if (t == NULL || x->failed) return;
    const uint8_t *ts;
    uint32_t n;
    label_types(t, &ts, &n);
    check_top(x, r, ts, n);
    if (x->failed) return;
    if (live(x)) {
        flush_eff(x, x->nv);
        for (uint32_t i = x->nv - n; i < x->nv; i++) mat(x, i);
        xb_puts(&x->fn, "if(");
        emit_val(x, &cond);
        xb_puts(&x->fn, "){");
        emit_branch(x, t);
        xb_puts(&x->fn, "}\n");
    } else {
        for (uint32_t i = n; i-- > 0 && !x->failed;) pop(x, r, ts[i]);
        for (uint32_t i = 0; i < n; i++) push(x, ts[i]);
    }
}

static void op_br_table(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if ((size_t)(r->end - r->p) < (size_t)n + 1) {
        INVALID("br_table with %u labels runs past the end of its function", n);
        return;
    }
    uint32_t *tg = xgrow(x, x->tgt, &x->cap_tgt, n + 1, sizeof *tg);
    if (tg == NULL) return;
    x->tgt = tg;
    for (uint32_t i = 0; i <= n && !x->failed; i++) tg[i] = rd_u32(x, r);
    xv idx = pop(x, r, T_I32);
    if (x->failed) return;
    xc *def = label(x, r, tg[n]);
    if (def == NULL) return;
    const uint8_t *dts;
    uint32_t arity;
    label_types(def, &dts, &arity);
    for (uint32_t i = 0; i <= n && !x->failed; i++) {
        xc *t = label(x, r, tg[i]);
        if (t == NULL) return;
        const uint8_t *ts;
        uint32_t m;
        label_types(t, &ts, &m);
        if (m != arity) {
            INVALID("br_table targets of different arities (%u and %u)", m, arity);
            return;
        }
        check_top(x, r, ts, m);
    }
    if (x->failed) return;
    if (live(x)) {
        flush_eff(x, x->nv);
        for (uint32_t i = x->nv - arity; i < x->nv; i++) mat(x, i);
        xb *b = &x->fn;
        xb_puts(b, "switch(");
        emit_val(x, &idx);
        xb_puts(b, "){\n");
        for (uint32_t i = 0; i <= n; i++) {
            if (i < n) {
                xb_puts(b, "case ");
                xb_dec(b, i);
                xb_ch(b, ':');
            } else {
                xb_puts(b, "default:");
            }
            emit_branch(x, &x->cs[x->nc - 1 - tg[i]]);
        }
        xb_puts(b, "}\n");
    }
    set_unreachable(x);
}

static void op_return(xl *x, xr *r) {
    xc *f = &x->cs[0];
    check_top(x, r, f->rt, f->nr);
    if (x->failed) return;
    if (live(x)) {
        flush_eff(x, x->nv - f->nr);
        xb_puts(&x->fn, "return");
        if (f->nr) {
            xb_ch(&x->fn, ' ');
            emit_val(x, &x->vs[x->nv - 1]);
        }
        xb_puts(&x->fn, ";\n");
    }
    set_unreachable(x);
}

/* ---- calls ---------------------------------------------------------------------------------- */

static void put_ctype_list(xb *b, const uint8_t *ts, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        xb_ch(b, ',');
        xb_puts(b, CT[ti(ts[i])]);
    }
}

static const char *ret_ctype(const xtype *t) { return t->nr ? CT[ti(t->r[0])] : "void"; }

/* Pops a call's arguments (types t->p) into x->args. */
static bool pop_args(xl *x, xr *r, const xtype *t) {
    xv *a = xgrow(x, x->args, &x->cap_args, t->np + 1, sizeof *a);
    if (a == NULL) return false;
    x->args = a;
    for (uint32_t i = t->np; i-- > 0 && !x->failed;) a[i] = pop(x, r, t->p[i]);
    return !x->failed;
}

/* The call text now in x->sc, whose operands are x->args[0..nargs): a statement (no result)
 * or a pending effectful entry of type rt. */
static void finish_call(xl *x, uint32_t nargs, uint8_t rt) {
    if (!live(x)) {
        if (rt) push(x, rt);
        return;
    }
    bool rdloc = false;
    int nest = 0;
    int32_t tmax = -1;
    for (uint32_t i = 0; i < nargs; i++) {
        rdloc |= x->args[i].rdloc;
        if (x->args[i].nest + 1 > nest) nest = x->args[i].nest + 1;
        if (x->args[i].tmax > tmax) tmax = x->args[i].tmax;
    }
    if (rt == 0) {
        flush_eff(x, x->nv);
        xb_put(&x->fn, x->sc.p, x->sc.len);
        xb_puts(&x->fn, ";\n");
        return;
    }
    push_sc(x, rt, true, rdloc, nest, tmax);
}

static void op_call(xl *x, xr *r) {
    uint32_t f = rd_u32(x, r);
    if (x->failed) return;
    if (f >= x->n_funcs) {
        INVALID("call of function %u of %u", f, x->n_funcs);
        return;
    }
    const xtype *t = &x->types[x->ftype[f]];
    if (!pop_args(x, r, t)) return;
    if (live(x)) {
        xb *b = &x->sc;
        b->len = 0;
        if (f < x->n_imp) {
            xb_puts(b, x->imp_c[f]);
            xb_puts(b, x->imp_mod[f] ? "(I->wasi" : "(I->pie");
        } else {
            xb_ch(b, 'F');
            xb_dec(b, f);
            xb_puts(b, "(I");
        }
        for (uint32_t i = 0; i < t->np; i++) {
            xb_ch(b, ',');
            put_val(x, b, &x->args[i]);
        }
        xb_ch(b, ')');
    }
    finish_call(x, t->np, t->nr ? t->r[0] : 0);
}

static void op_call_indirect(xl *x, xr *r) {
    uint32_t ty = rd_u32(x, r);
    uint32_t tab = rd_u32(x, r);
    if (x->failed) return;
    if (ty >= x->n_types) {
        INVALID("call_indirect with type %u of %u", ty, x->n_types);
        return;
    }
    if (!x->has_tab || tab != 0) {
        INVALID("call_indirect through table %u, which does not exist", tab);
        return;
    }
    const xtype *t = &x->types[ty];
    if (t->nr > 1) {
        DECLINE("call_indirect of a type with %u results (multi-value functions)", t->nr);
        return;
    }
    if (live(x)) {
        /* the index check may trap: no other operand may be left to evaluate after it */
        uint32_t c = t->np + 1 < x->nv - top(x)->base ? t->np + 1 : x->nv - top(x)->base;
        for (uint32_t i = x->nv - c; i < x->nv; i++)
            if (x->vs[i].eff) mat(x, i);
    }
    xv idx = pop(x, r, T_I32);
    if (!pop_args(x, r, t)) return;
    if (live(x)) {
        xb *b = &x->sc;
        b->len = 0;
        xb_puts(b, "((");
        xb_puts(b, ret_ctype(t));
        xb_puts(b, "(*)(lcI*");
        put_ctype_list(b, t->p, t->np);
        xb_puts(b, "))lc_ci(&I->t0,");
        put_val(x, b, &idx);
        xb_puts(b, ",FT[");
        xb_dec(b, ty);
        xb_puts(b, "]))(I");
        for (uint32_t i = 0; i < t->np; i++) {
            xb_ch(b, ',');
            put_val(x, b, &x->args[i]);
        }
        xb_ch(b, ')');
        x->args[t->np] = idx; /* pop_args made room: the index folds like an argument */
    }
    finish_call(x, t->np + 1, t->nr ? t->r[0] : 0);
}

/* ---- one function body ---------------------------------------------------------------------- */

static void op_local(xl *x, xr *r, uint8_t op) {
    uint32_t i = rd_u32(x, r);
    if (x->failed) return;
    if (i >= x->n_loc) {
        INVALID("local %u of %u", i, x->n_loc);
        return;
    }
    uint8_t t = x->lt[i];
    if (op == 0x20) {
        xv *v = push(x, t);
        if (v && live(x)) {
            *v = (xv){.t = t, .k = K_LOC, .idx = i, .rdloc = 1, .tmax = -1};
            if (x->nv - 1 < x->lo_rd) x->lo_rd = x->nv - 1;
        }
        return;
    }
    xv v = pop(x, r, t);
    if (x->failed) return;
    if (live(x)) {
        flush_loc(x);
        xb_ch(&x->fn, 'l');
        xb_dec(&x->fn, i);
        xb_ch(&x->fn, '=');
        emit_val(x, &v);
        xb_puts(&x->fn, ";\n");
    }
    if (op == 0x22) {
        xv *p = push(x, t);
        if (p && live(x)) {
            *p = (xv){.t = t, .k = K_LOC, .idx = i, .rdloc = 1, .tmax = -1};
            if (x->nv - 1 < x->lo_rd) x->lo_rd = x->nv - 1;
        }
    }
}

static void op_global(xl *x, xr *r, uint8_t op) {
    uint32_t g = rd_u32(x, r);
    if (x->failed) return;
    if (g >= x->n_globals) {
        INVALID("global %u of %u", g, x->n_globals);
        return;
    }
    uint8_t t = x->gtype[g];
    if (op == 0x23) {
        if (!x->gmut[g]) {
            xv *v = push(x, t);
            if (v && live(x)) *v = (xv){.t = t, .k = K_CONST, .c = x->ginit[g], .tmax = -1};
            return;
        }
        x->sc.len = 0;
        xb_puts(&x->sc, "I->g");
        xb_dec(&x->sc, g);
        push_sc(x, t, true, false, 0, -1);
        return;
    }
    if (!x->gmut[g]) {
        INVALID("global.set of immutable global %u", g);
        return;
    }
    xv v = pop(x, r, t);
    if (x->failed || !live(x)) return;
    flush_eff(x, x->nv);
    xb_puts(&x->fn, "I->g");
    xb_dec(&x->fn, g);
    xb_ch(&x->fn, '=');
    emit_val(x, &v);
    xb_puts(&x->fn, ";\n");
}

static void op_select(xl *x, xr *r, uint8_t op) {
    uint8_t want = 0;
    if (op == 0x1c) {
        uint32_t n = rd_u32(x, r);
        if (x->failed) return;
        if (n != 1) {
            INVALID("typed select with %u types", n);
            return;
        }
        want = rd_byte(x, r);
        if (x->failed) return;
        if (!numtype(want)) {
            DECLINE("select of type 0x%02x", want);
            return;
        }
    }
    if (live(x)) {
        uint32_t have = x->nv - top(x)->base, c = have < 3 ? have : 3;
        for (uint32_t i = x->nv - c; i < x->nv; i++)
            if (x->vs[i].eff) mat(x, i);
    }
    xv cond = pop(x, r, T_I32);
    xv b = pop(x, r, want);
    xv a = pop(x, r, want ? want : b.t);
    if (x->failed) return;
    uint8_t t = a.t ? a.t : b.t;
    if (t && !numtype(t)) {
        DECLINE("select of a non-numeric type");
        return;
    }
    res(x, t, "($?@:#)", &a, &b, &cond, false);
}

static void op_fc(xl *x, xr *r) {
    uint32_t sub = rd_u32(x, r);
    if (x->failed) return;
    if (sub <= 7) {
        numeric(x, r, &SAT[sub]);
        return;
    }
    if (sub != 10 && sub != 11) {
        DECLINE("instruction 0xfc %u (bulk memory or table operations other than memory.copy "
                "and memory.fill)",
                sub);
        return;
    }
    if (rd_byte(x, r) != 0 || (sub == 10 && rd_byte(x, r) != 0)) {
        if (!x->failed) INVALID("memory index other than 0");
        return;
    }
    if (!x->has_mem) {
        INVALID("memory.%s without a memory", sub == 10 ? "copy" : "fill");
        return;
    }
    xv n = pop(x, r, T_I32);
    xv s = pop(x, r, T_I32);
    xv d = pop(x, r, T_I32);
    if (x->failed || !live(x)) return;
    flush_eff(x, x->nv);
    xb_puts(&x->fn, sub == 10 ? "lc_copy(&I->m0," : "lc_fill(&I->m0,");
    emit_val(x, &d);
    xb_ch(&x->fn, ',');
    emit_val(x, &s);
    xb_ch(&x->fn, ',');
    emit_val(x, &n);
    xb_puts(&x->fn, ");\n");
}

/* drop: an effectful value is still evaluated, as the statement "(void)e;". But a load at the
 * top of e is an lvalue, and tcc does not read an lvalue whose value is cast to void (volatile
 * or not): the access, and with it the out-of-bounds fault that is the bounds check, would be
 * skipped. So a dropped load is stored into its temporary instead, an assignment that tcc always
 * performs. Only dropped loads pay for it (one store); loads whose value is used are as before. */
static void op_drop(xl *x, xr *r) {
    if (live(x) && x->nv > top(x)->base && x->vs[x->nv - 1].load) mat(x, x->nv - 1);
    xv v = pop(x, r, 0);
    if (x->failed || !live(x) || !v.eff) return;
    xb_puts(&x->fn, "(void)");
    emit_val(x, &v);
    xb_puts(&x->fn, ";\n");
}

static void instr(xl *x, xr *r) {
    uint8_t op = rd_byte(x, r);
    if (x->failed) return;
    if (op >= 0x45 && op <= 0xc4) {
        numeric(x, r, &NUM[op - 0x45]);
        return;
    }
    if (op >= 0x28 && op <= 0x35) {
        load(x, r, op - 0x28);
        return;
    }
    if (op >= 0x36 && op <= 0x3e) {
        store(x, r, op - 0x36);
        return;
    }
    switch (op) {
    case 0x00:
        if (live(x)) {
            flush_eff(x, x->nv);
            xb_puts(&x->fn, "TRAP(UNREACHABLE);\n");
        }
        set_unreachable(x);
        return;
    case 0x01: return;
    case 0x02: block_start(x, r, C_BLOCK); return;
    case 0x03: block_start(x, r, C_LOOP); return;
    case 0x04: block_start(x, r, C_IF); return;
    case 0x05: op_else(x, r); return;
    case 0x0b: op_end(x, r); return;
    case 0x0c: op_br(x, r); return;
    case 0x0d: op_br_if(x, r); return;
    case 0x0e: op_br_table(x, r); return;
    case 0x0f: op_return(x, r); return;
    case 0x10: op_call(x, r); return;
    case 0x11: op_call_indirect(x, r); return;
    case 0x1a: op_drop(x, r); return;
    case 0x1b:
    case 0x1c: op_select(x, r, op); return;
    case 0x20:
    case 0x21:
    case 0x22: op_local(x, r, op); return;
    case 0x23:
    case 0x24: op_global(x, r, op); return;
    case 0x3f:
    case 0x40: {
        if (rd_byte(x, r) != 0) {
            if (!x->failed) INVALID("memory index other than 0");
            return;
        }
        if (!x->has_mem) {
            INVALID("memory.%s without a memory", op == 0x3f ? "size" : "grow");
            return;
        }
        if (op == 0x3f) {
            x->sc.len = 0;
            xb_puts(&x->sc, "I->m0.pages");
            push_sc(x, T_I32, true, false, 0, -1);
        } else {
            xv n = pop(x, r, T_I32);
            res(x, T_I32, "wasm_rt_grow_memory(&I->m0,@)", &n, NULL, NULL, true);
        }
        return;
    }
    case 0x41:
    case 0x42:
    case 0x43:
    case 0x44: {
        uint8_t t = op == 0x41 ? T_I32 : op == 0x42 ? T_I64 : op == 0x43 ? T_F32 : T_F64;
        uint64_t c = op == 0x41   ? (uint32_t)rd_sleb(x, r, 32)
                     : op == 0x42 ? rd_sleb(x, r, 64)
                     : op == 0x43 ? rd_fixed(x, r, 4)
                                  : rd_fixed(x, r, 8);
        if (x->failed) return;
        xv *v = push(x, t);
        if (v && live(x)) *v = (xv){.t = t, .k = K_CONST, .c = c, .tmax = -1};
        return;
    }
    case 0xfc: op_fc(x, r); return;
    case 0x06:
    case 0x07:
    case 0x08:
    case 0x09:
    case 0x0a:
    case 0x18:
    case 0x19:
        r->p--;
        DECLINE("exception handling instruction 0x%02x", op);
        return;
    case 0x12:
    case 0x13:
    case 0x14:
    case 0x15:
        r->p--;
        DECLINE("tail call or typed function reference instruction 0x%02x", op);
        return;
    case 0x25:
    case 0x26:
    case 0xd0:
    case 0xd1:
    case 0xd2:
        r->p--;
        DECLINE("reference types instruction 0x%02x", op);
        return;
    case 0xfd:
        r->p--;
        DECLINE("SIMD instruction");
        return;
    case 0xfe:
        r->p--;
        DECLINE("threads (atomic) instruction");
        return;
    default:
        r->p--;
        INVALID("unknown opcode 0x%02x", op);
        return;
    }
}

/* "static R F<f><suffix>(lcI*I,T l0,...)" (names) or "static R F<f><suffix>(lcI*,T,...)" */
static void func_sig_as(xl *x, xb *b, uint32_t f, bool names, const char *suffix) {
    const xtype *t = &x->types[x->ftype[f]];
    xb_puts(b, "static ");
    xb_puts(b, ret_ctype(t));
    xb_puts(b, " F");
    xb_dec(b, f);
    xb_puts(b, suffix);
    xb_puts(b, names ? "(lcI*I" : "(lcI*");
    for (uint32_t i = 0; i < t->np; i++) {
        xb_ch(b, ',');
        xb_puts(b, CT[ti(t->p[i])]);
        if (names) {
            xb_puts(b, " l");
            xb_dec(b, i);
        }
    }
    xb_ch(b, ')');
}

static void func_sig(xl *x, xb *b, uint32_t f, bool names) { func_sig_as(x, b, f, names, ""); }

static void body(xl *x, xr *r, uint32_t f) {
    const xtype *t = &x->types[x->ftype[f]];
    x->n_loc = 0;
    uint8_t *lt = xgrow(x, x->lt, &x->cap_loc, t->np + 1, 1);
    if (lt == NULL) return;
    x->lt = lt;
    memcpy(x->lt, t->p, t->np);
    x->n_loc = t->np;
    uint32_t groups = rd_u32(x, r);
    for (uint32_t g = 0; g < groups && !x->failed; g++) {
        uint32_t n = rd_u32(x, r);
        uint8_t ty = rd_byte(x, r);
        if (x->failed) return;
        if (!numtype(ty)) {
            if (ty == 0x7b || ty == 0x70 || ty == 0x6f)
                DECLINE("local of type 0x%02x", ty);
            else
                INVALID("local of unknown type 0x%02x", ty);
            return;
        }
        if ((uint64_t)x->n_loc + n > LC_WASM_MAX_LOCALS) {
            DECLINE("more than %u locals", LC_WASM_MAX_LOCALS);
            return;
        }
        x->all_locals += n;
        if (x->all_locals > XL_MAX_ALL_LOCALS) {
            DECLINE("more than %u locals in all functions", XL_MAX_ALL_LOCALS);
            return;
        }
        lt = xgrow(x, x->lt, &x->cap_loc, x->n_loc + n + 1, 1);
        if (lt == NULL) return;
        x->lt = lt;
        memset(x->lt + x->n_loc, ty, n);
        x->n_loc += n;
    }
    x->fn.len = 0;
    x->ex.len = 0;
    x->nv = x->nc = 0;
    x->eff_at = -1;
    x->lo_rd = x->clean = 0;
    memset(x->tdep, 0, sizeof x->tdep);
    x->n_labels = 0;
    xc *c = frame_push(x, C_FUNC);
    if (c == NULL) return;
    c->rt = t->r;
    c->nr = t->nr;
    c->live = c->live_in = true;
    while (x->nc > 0 && !x->failed) {
        if (r->p >= r->end) {
            INVALID("function %u: body ends inside a block", f);
            return;
        }
        instr(x, r);
    }
    if (x->failed) return;
    if (r->p != r->end) {
        INVALID("function %u: bytes after the end of its body", f);
        return;
    }
    /* header, locals, temporaries, body */
    xb *o = &x->out;
    uint64_t frame = 8u * ((uint64_t)x->n_loc + x->tdep[0] + x->tdep[1] + x->tdep[2] + x->tdep[3]);
    if (frame > XL_BIG_FRAME) {
        /* F<f> checks that the frame of F<f>_b fits above the stack's floor before entering
         * it: a frame larger than the guard could step over it into another mapping */
        func_sig_as(x, o, f, false, "_b");
        xb_puts(o, ";\n");
        func_sig(x, o, f, true);
        xb_puts(o, "{char p;if((uintptr_t)&p<lc_wasm_stack_floor()+");
        xb_dec(o, frame + (64u << 10));
        xb_puts(o, "ull)TRAP(EXHAUSTION);");
        xb_puts(o, t->nr ? "return F" : "F");
        xb_dec(o, f);
        xb_puts(o, "_b(I");
        for (uint32_t i = 0; i < t->np; i++) {
            xb_puts(o, ",l");
            xb_dec(o, i);
        }
        xb_puts(o, ");}\n");
        func_sig_as(x, o, f, true, "_b");
    } else {
        func_sig(x, o, f, true);
    }
    xb_puts(o, "{\n");
    for (int k = 0; k < 4; k++) {
        bool first = true;
        for (uint32_t i = t->np; i < x->n_loc; i++) {
            if (ti(x->lt[i]) != k) continue;
            xb_puts(o, first ? CT[k] : ",");
            xb_puts(o, first ? " l" : "l");
            xb_dec(o, i);
            xb_puts(o, "=0");
            first = false;
        }
        if (!first) xb_puts(o, ";\n");
        for (uint32_t i = 0; i < x->tdep[k]; i++) {
            xb_puts(o, i ? "," : CT[k]);
            if (!i) xb_ch(o, ' ');
            put_tmp(o, k, i);
        }
        if (x->tdep[k]) xb_puts(o, ";\n");
    }
    xb_put(o, x->fn.p, x->fn.len);
    xb_puts(o, "}\n");
}

/* ---- module sections ------------------------------------------------------------------------ */

static const char PRELUDE[] =
    "/* Generated by lc_wasm_xlate (services/lifecycle/wasm/lc_wasm_xlate.c). */\n"
    "#include \"wasm-rt.h\"\n"
    "typedef uint8_t u8;typedef int8_t s8;typedef uint16_t u16;typedef int16_t s16;\n"
    "typedef uint32_t u32;typedef int32_t s32;typedef uint64_t u64;typedef int64_t s64;\n"
    "typedef float f32;typedef double f64;\n"
    "double floor(double),ceil(double),trunc(double),nearbyint(double),sqrt(double),"
    "copysign(double,double);\n"
    "float floorf(float),ceilf(float),truncf(float),nearbyintf(float),sqrtf(float),"
    "copysignf(float,float);\n"
    "#define TRAP(k) wasm_rt_trap(WASM_RT_TRAP_##k)\n"
    /* (u32): an address is 32 bits whatever the C expression; + a 32-bit offset stays in the
     * memory's 8 GiB reservation */
    "#define LD(T,a,o) (*(T*)(I->m0.data+(u64)(u32)(a)+o))\n"
    "#define ST(T,a,o,v) (*(T*)(I->m0.data+(u64)(u32)(a)+o)=(T)(v))\n"
    "static f32 lc_f32(u32 x){union{u32 i;f32 f;}u;u.i=x;return u.f;}\n"
    "static f64 lc_f64(u64 x){union{u64 i;f64 f;}u;u.i=x;return u.f;}\n"
    "static u32 lc_i32f(f32 x){union{u32 i;f32 f;}u;u.f=x;return u.i;}\n"
    "static u64 lc_i64d(f64 x){union{u64 i;f64 f;}u;u.f=x;return u.i;}\n"
    "static u32 lc_divs32(u32 a,u32 b){if(!b)TRAP(DIV_BY_ZERO);if(a==0x80000000u&&b==0xffffffffu)"
    "TRAP(INT_OVERFLOW);return (u32)((s32)a/(s32)b);}\n"
    "static u32 lc_divu32(u32 a,u32 b){if(!b)TRAP(DIV_BY_ZERO);return a/b;}\n"
    "static u32 lc_rems32(u32 a,u32 b){if(!b)TRAP(DIV_BY_ZERO);if(b==0xffffffffu)return 0;"
    "return (u32)((s32)a%(s32)b);}\n"
    "static u32 lc_remu32(u32 a,u32 b){if(!b)TRAP(DIV_BY_ZERO);return a%b;}\n"
    "static u64 lc_divs64(u64 a,u64 b){if(!b)TRAP(DIV_BY_ZERO);if(a==0x8000000000000000ull&&"
    "b==0xffffffffffffffffull)TRAP(INT_OVERFLOW);return (u64)((s64)a/(s64)b);}\n"
    "static u64 lc_divu64(u64 a,u64 b){if(!b)TRAP(DIV_BY_ZERO);return a/b;}\n"
    "static u64 lc_rems64(u64 a,u64 b){if(!b)TRAP(DIV_BY_ZERO);if(b==0xffffffffffffffffull)"
    "return 0;return (u64)((s64)a%(s64)b);}\n"
    "static u64 lc_remu64(u64 a,u64 b){if(!b)TRAP(DIV_BY_ZERO);return a%b;}\n"
    "static u32 lc_rotl32(u32 x,u32 n){n&=31;return n?(x<<n)|(x>>(32-n)):x;}\n"
    "static u32 lc_rotr32(u32 x,u32 n){n&=31;return n?(x>>n)|(x<<(32-n)):x;}\n"
    "static u64 lc_rotl64(u64 x,u64 n){n&=63;return n?(x<<n)|(x>>(64-n)):x;}\n"
    "static u64 lc_rotr64(u64 x,u64 n){n&=63;return n?(x>>n)|(x<<(64-n)):x;}\n"
    "static u32 lc_clz32(u32 x){u32 n=0;if(!x)return 32;while(!(x>>31)){x<<=1;n++;}return n;}\n"
    "static u32 lc_ctz32(u32 x){u32 n=0;if(!x)return 32;while(!(x&1)){x>>=1;n++;}return n;}\n"
    "static u32 lc_popcnt32(u32 x){u32 n=0;while(x){x&=x-1;n++;}return n;}\n"
    "static u64 lc_clz64(u64 x){u64 n=0;if(!x)return 64;while(!(x>>63)){x<<=1;n++;}return n;}\n"
    "static u64 lc_ctz64(u64 x){u64 n=0;if(!x)return 64;while(!(x&1)){x>>=1;n++;}return n;}\n"
    "static u64 lc_popcnt64(u64 x){u64 n=0;while(x){x&=x-1;n++;}return n;}\n"
    "static f32 lc_quietf(f32 x){return x!=x?lc_f32(lc_i32f(x)|0x7fc00000u):x;}\n"
    "static f64 lc_quiet(f64 x){return x!=x?lc_f64(lc_i64d(x)|0x7ff8000000000000ull):x;}\n"
    "static f32 lc_absf(f32 x){return lc_f32(lc_i32f(x)&0x7fffffffu);}\n"
    "static f64 lc_abs(f64 x){return lc_f64(lc_i64d(x)&0x7fffffffffffffffull);}\n"
    /* neg flips the sign bit, also of a NaN: tcc compiles -x as a subtraction from a zero, which
     * keeps a NaN operand's sign */
    "static f32 lc_negf(f32 x){return lc_f32(lc_i32f(x)^0x80000000u);}\n"
    "static f64 lc_neg(f64 x){return lc_f64(lc_i64d(x)^0x8000000000000000ull);}\n"
    "static f32 lc_ceilf(f32 x){return x!=x?lc_quietf(x):ceilf(x);}\n"
    "static f32 lc_floorf(f32 x){return x!=x?lc_quietf(x):floorf(x);}\n"
    "static f32 lc_truncf(f32 x){return x!=x?lc_quietf(x):truncf(x);}\n"
    "static f32 lc_nearf(f32 x){return x!=x?lc_quietf(x):nearbyintf(x);}\n"
    "static f32 lc_sqrtf(f32 x){return x!=x?lc_quietf(x):sqrtf(x);}\n"
    "static f64 lc_ceil(f64 x){return x!=x?lc_quiet(x):ceil(x);}\n"
    "static f64 lc_floor(f64 x){return x!=x?lc_quiet(x):floor(x);}\n"
    "static f64 lc_trunc(f64 x){return x!=x?lc_quiet(x):trunc(x);}\n"
    "static f64 lc_near(f64 x){return x!=x?lc_quiet(x):nearbyint(x);}\n"
    "static f64 lc_sqrt(f64 x){return x!=x?lc_quiet(x):sqrt(x);}\n"
    /* wasm2c's FMIN/FMAX; the NaN is tcc's NAN (0xffc00000, as wasm2c's code gets with tcc) */
    "static f32 lc_minf(f32 x,f32 y){return x!=x||y!=y?lc_f32(0xffc00000u):x==0&&y==0?"
    "(lc_i32f(x)>>31?x:y):x<y?x:y;}\n"
    "static f32 lc_maxf(f32 x,f32 y){return x!=x||y!=y?lc_f32(0xffc00000u):x==0&&y==0?"
    "(lc_i32f(x)>>31?y:x):x>y?x:y;}\n"
    "static f64 lc_min(f64 x,f64 y){return x!=x||y!=y?(f64)lc_f32(0xffc00000u):x==0&&y==0?"
    "(lc_i64d(x)>>63?x:y):x<y?x:y;}\n"
    "static f64 lc_max(f64 x,f64 y){return x!=x||y!=y?(f64)lc_f32(0xffc00000u):x==0&&y==0?"
    "(lc_i64d(x)>>63?y:x):x>y?x:y;}\n"
    /* wasm2c's TRUNC_S / TRUNC_U bounds */
    "static u32 lc_ts32f(f32 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>=(f32)-2147483648.0&&"
    "x<2147483648.f))TRAP(INT_OVERFLOW);return (u32)(s32)x;}\n"
    "static u64 lc_ts64f(f32 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>=(f32)INT64_MIN&&"
    "x<(f32)INT64_MAX))TRAP(INT_OVERFLOW);return (u64)(s64)x;}\n"
    "static u32 lc_ts32d(f64 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>-2147483649.&&"
    "x<2147483648.))TRAP(INT_OVERFLOW);return (u32)(s32)x;}\n"
    "static u64 lc_ts64d(f64 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>=(f64)INT64_MIN&&"
    "x<(f64)INT64_MAX))TRAP(INT_OVERFLOW);return (u64)(s64)x;}\n"
    "static u32 lc_tu32f(f32 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>(f32)-1&&"
    "x<4294967296.f))TRAP(INT_OVERFLOW);return (u32)x;}\n"
    "static u64 lc_tu64f(f32 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>(f32)-1&&"
    "x<(f32)UINT64_MAX))TRAP(INT_OVERFLOW);return (u64)x;}\n"
    "static u32 lc_tu32d(f64 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>(f64)-1&&"
    "x<4294967296.))TRAP(INT_OVERFLOW);return (u32)x;}\n"
    "static u64 lc_tu64d(f64 x){if(x!=x)TRAP(INVALID_CONVERSION);if(!(x>(f64)-1&&"
    "x<(f64)UINT64_MAX))TRAP(INT_OVERFLOW);return (u64)x;}\n"
    /* wasm2c's TRUNC_SAT_S / TRUNC_SAT_U */
    "static u32 lc_ss32f(f32 x){return x!=x?0:!(x>=(f32)-2147483648.0)?(u32)INT32_MIN:"
    "!(x<2147483648.f)?(u32)INT32_MAX:(u32)(s32)x;}\n"
    "static u64 lc_ss64f(f32 x){return x!=x?0:!(x>=(f32)INT64_MIN)?(u64)INT64_MIN:"
    "!(x<(f32)INT64_MAX)?(u64)INT64_MAX:(u64)(s64)x;}\n"
    "static u32 lc_ss32d(f64 x){return x!=x?0:!(x>-2147483649.)?(u32)INT32_MIN:"
    "!(x<2147483648.)?(u32)INT32_MAX:(u32)(s32)x;}\n"
    "static u64 lc_ss64d(f64 x){return x!=x?0:!(x>=(f64)INT64_MIN)?(u64)INT64_MIN:"
    "!(x<(f64)INT64_MAX)?(u64)INT64_MAX:(u64)(s64)x;}\n"
    "static u32 lc_su32f(f32 x){return x!=x?0:!(x>(f32)-1)?0:!(x<4294967296.f)?UINT32_MAX:"
    "(u32)x;}\n"
    "static u64 lc_su64f(f32 x){return x!=x?0:!(x>(f32)-1)?0:!(x<(f32)UINT64_MAX)?UINT64_MAX:"
    "(u64)x;}\n"
    "static u32 lc_su32d(f64 x){return x!=x?0:!(x>(f64)-1)?0:!(x<4294967296.)?UINT32_MAX:"
    "(u32)x;}\n"
    "static u64 lc_su64d(f64 x){return x!=x?0:!(x>(f64)-1)?0:!(x<(f64)UINT64_MAX)?UINT64_MAX:"
    "(u64)x;}\n"
    "static void lc_fill(wasm_rt_memory_t*m,u32 d,u32 v,u32 n){if((u64)d+n>m->size)TRAP(OOB);"
    "memset(m->data+d,(int)v,n);}\n"
    "static void lc_copy(wasm_rt_memory_t*m,u32 d,u32 s,u32 n){if((u64)d+n>m->size||"
    "(u64)s+n>m->size)TRAP(OOB);memmove(m->data+d,m->data+s,n);}\n"
    "static wasm_rt_function_ptr_t lc_ci(wasm_rt_funcref_table_t*t,u32 i,u32 ty){"
    "if(i>=t->size||!t->data[i].func||t->data[i].func_type!=ty)TRAP(CALL_INDIRECT);"
    "return t->data[i].func;}\n"
    "struct Z_pie_instance_t;struct Z_wasi_snapshot_preview1_instance_t;\n"
    "uintptr_t lc_wasm_stack_floor(void);\n";

static bool rd_limits(xl *x, xr *r, uint32_t *min, uint32_t *max, uint32_t cap, const char *what) {
    uint8_t flags = rd_byte(x, r);
    if (x->failed) return false;
    if (flags > 1) {
        DECLINE("%s limits flag 0x%02x (shared or 64-bit)", what, flags);
        return false;
    }
    *min = rd_u32(x, r);
    *max = flags ? rd_u32(x, r) : cap;
    if (x->failed) return false;
    if (*min > cap || (flags && *max > cap)) {
        INVALID("%s size beyond %u", what, cap);
        return false;
    }
    if (flags && *max < *min) {
        INVALID("%s maximum %u below its minimum %u", what, *max, *min);
        return false;
    }
    return true;
}

static void sec_types(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if ((size_t)(r->end - r->p) < (size_t)n * 3) {
        INVALID("type section too short for %u types", n);
        return;
    }
    x->types = calloc(n ? n : 1, sizeof *x->types);
    if (x->types == NULL) {
        xfail(x, r, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    x->n_types = n;
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        if (rd_byte(x, r) != 0x60) {
            if (!x->failed) INVALID("type %u is not a function type", i);
            return;
        }
        for (int part = 0; part < 2 && !x->failed; part++) {
            uint32_t c = rd_u32(x, r);
            if (x->failed) return;
            if ((size_t)(r->end - r->p) < c) {
                INVALID("function type runs past its section");
                return;
            }
            for (uint32_t k = 0; k < c; k++)
                if (!numtype(r->p[k])) {
                    uint8_t t = r->p[k];
                    if (t == 0x7b || t == 0x70 || t == 0x6f)
                        DECLINE("function type with value type 0x%02x", t);
                    else
                        INVALID("unknown value type 0x%02x", t);
                    return;
                }
            if (part == 0) {
                x->types[i].p = r->p;
                x->types[i].np = c;
            } else {
                x->types[i].r = r->p;
                x->types[i].nr = c;
            }
            r->p += c;
        }
        if (!x->failed && (uint64_t)x->types[i].np + x->types[i].nr > LC_WASM_MAX_TYPE_ARITY)
            DECLINE("function type %u with more than %u parameters and results (tcc's limit)", i,
                    LC_WASM_MAX_TYPE_ARITY);
    }
}

static bool add_func(xl *x, xr *r, uint32_t type) {
    if (type >= x->n_types) {
        INVALID("function type %u of %u", type, x->n_types);
        return false;
    }
    if (x->types[type].nr > 1) {
        DECLINE("function with %u results (multi-value functions)", x->types[type].nr);
        return false;
    }
    uint32_t *f = xgrow(x, x->ftype, &x->cap_funcs, x->n_funcs + 1, sizeof *f);
    if (f == NULL) return false;
    x->ftype = f;
    f[x->n_funcs++] = type;
    return true;
}

static void sec_imports(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if ((size_t)(r->end - r->p) < (size_t)n * 4) {
        INVALID("import section too short for %u imports", n);
        return;
    }
    x->imp_c = calloc(n ? n : 1, sizeof *x->imp_c);
    x->imp_mod = calloc(n ? n : 1, 1);
    if (x->imp_c == NULL || x->imp_mod == NULL) {
        xfail(x, r, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        uint32_t ml, nl;
        const uint8_t *m = rd_name(x, r, &ml);
        const uint8_t *nm = rd_name(x, r, &nl);
        uint8_t kind = rd_byte(x, r);
        if (x->failed) return;
        if (kind != 0) {
            DECLINE("import of kind %u (only functions are imported)", kind);
            return;
        }
        uint32_t type = rd_u32(x, r);
        if (x->failed || !add_func(x, r, type)) return;
        char mod[64], name[256];
        if (ml >= sizeof mod || nl >= sizeof name || memchr(m, 0, ml) || memchr(nm, 0, nl)) {
            DECLINE("import name too long or with a NUL byte");
            return;
        }
        memcpy(mod, m, ml);
        mod[ml] = '\0';
        memcpy(name, nm, nl);
        name[nl] = '\0';
        if (strcmp(mod, "pie") == 0)
            x->imp_mod[i] = 0;
        else if (strcmp(mod, "wasi_snapshot_preview1") == 0)
            x->imp_mod[i] = 1;
        else {
            DECLINE("import from module %s", mod);
            return;
        }
        size_t cap = 3 * (ml + nl) + 8;
        x->imp_c[i] = malloc(cap);
        if (x->imp_c[i] == NULL) {
            xfail(x, r, PIE_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        lc_wasm_mangle_import(mod, name, x->imp_c[i], cap);
        x->n_imp++;
    }
}

static void sec_functions(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if ((size_t)(r->end - r->p) < n) {
        INVALID("function section too short for %u functions", n);
        return;
    }
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        uint32_t t = rd_u32(x, r);
        if (x->failed || !add_func(x, r, t)) return;
    }
}

static void sec_table(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if (n > 1) {
        DECLINE("%u tables", n);
        return;
    }
    if (n == 0) return;
    uint8_t t = rd_byte(x, r);
    if (x->failed) return;
    if (t != 0x70) {
        if (t == 0x6f)
            DECLINE("externref table");
        else
            INVALID("table of unknown element type 0x%02x", t);
        return;
    }
    if (rd_limits(x, r, &x->tab_min, &x->tab_max, UINT32_MAX, "table")) x->has_tab = true;
}

static void sec_memory(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if (n > 1) {
        DECLINE("%u memories", n);
        return;
    }
    if (n == 1 && rd_limits(x, r, &x->mem_min, &x->mem_max, 65536, "memory")) x->has_mem = true;
}

/* A constant expression of type t: t.const c; end. */
static uint64_t const_expr(xl *x, xr *r, uint8_t t) {
    uint8_t op = rd_byte(x, r);
    uint64_t c = 0;
    if (x->failed) return 0;
    uint8_t want = op == 0x41   ? T_I32
                   : op == 0x42 ? T_I64
                   : op == 0x43 ? T_F32
                   : op == 0x44 ? T_F64
                                : 0;
    if (want == 0) {
        if (op == 0x23)
            INVALID("global.get in a constant expression (no imported globals)");
        else
            DECLINE("constant expression with opcode 0x%02x", op);
        return 0;
    }
    if (want != t) {
        INVALID("constant of type %s where %s is expected", tname(want), tname(t));
        return 0;
    }
    c = op == 0x41   ? (uint32_t)rd_sleb(x, r, 32)
        : op == 0x42 ? rd_sleb(x, r, 64)
        : op == 0x43 ? rd_fixed(x, r, 4)
                     : rd_fixed(x, r, 8);
    if (rd_byte(x, r) != 0x0b && !x->failed)
        DECLINE("constant expression of more than one instruction");
    return c;
}

static void sec_globals(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if ((size_t)(r->end - r->p) < (size_t)n * 4) {
        INVALID("global section too short for %u globals", n);
        return;
    }
    x->gtype = calloc(n ? n : 1, 1);
    x->gmut = calloc(n ? n : 1, 1);
    x->ginit = calloc(n ? n : 1, sizeof *x->ginit);
    if (!x->gtype || !x->gmut || !x->ginit) {
        xfail(x, r, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        uint8_t t = rd_byte(x, r), m = rd_byte(x, r);
        if (x->failed) return;
        if (!numtype(t)) {
            DECLINE("global of type 0x%02x", t);
            return;
        }
        if (m > 1) {
            INVALID("global mutability flag %u", m);
            return;
        }
        x->gtype[i] = t;
        x->gmut[i] = m;
        x->ginit[i] = const_expr(x, r, t);
        x->n_globals++;
    }
}

static void sec_exports(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if (n > 10000) {
        DECLINE("%u exports", n);
        return;
    }
    const uint8_t **names = calloc(n ? n : 1, sizeof *names);
    uint32_t *lens = calloc(n ? n : 1, sizeof *lens);
    if (!names || !lens) {
        free(names);
        free(lens);
        xfail(x, r, PIE_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        names[i] = rd_name(x, r, &lens[i]);
        uint8_t kind = rd_byte(x, r);
        uint32_t idx = rd_u32(x, r);
        if (x->failed) break;
        for (uint32_t k = 0; k < i; k++)
            if (lens[k] == lens[i] && memcmp(names[k], names[i], lens[i]) == 0) {
                INVALID("duplicate export name");
                break;
            }
        uint32_t count = kind == 0   ? x->n_funcs
                         : kind == 1 ? x->has_tab
                         : kind == 2 ? x->has_mem
                         : kind == 3 ? x->n_globals
                                     : 0;
        if (kind > 3) {
            INVALID("export of unknown kind %u", kind);
            break;
        }
        if (idx >= count) {
            INVALID("export of %s %u, which does not exist", kind == 0 ? "function" : "item", idx);
            break;
        }
        if (kind == 0 && lens[i] == 6 && memcmp(names[i], "_start", 6) == 0) {
            x->has_entry = true;
            x->entry = idx;
        }
    }
    free(names);
    free(lens);
}

static void sec_start(xl *x, xr *r) {
    uint32_t f = rd_u32(x, r);
    if (x->failed) return;
    if (f >= x->n_funcs) {
        INVALID("start function %u of %u", f, x->n_funcs);
        return;
    }
    const xtype *t = &x->types[x->ftype[f]];
    if (t->np || t->nr) {
        INVALID("start function with parameters or results");
        return;
    }
    x->has_start = true;
    x->start = f;
}

/* ---- element and data segments: the same skeleton ------------------------------------------- */

typedef struct xseg {
    const char *what, *target, *declined; /* "element", "table", the kinds that are declined */
} xseg;
static const xseg SEG_ELEM = {"element", "table", "passive, declarative or expressions"};
static const xseg SEG_DATA = {"data", "memory", "passive or with a memory index"};

/* The segment count, which must fit in the section (a segment takes at least a byte), and a
 * zeroed array of that many elt-byte entries; NULL after a failure. */
static void *seg_list(xl *x, xr *r, const xseg *k, size_t elt, uint32_t *n) {
    *n = rd_u32(x, r);
    if (x->failed) return NULL;
    if ((size_t)(r->end - r->p) < *n) {
        INVALID("%s section too short", k->what);
        return NULL;
    }
    void *a = calloc(*n ? *n : 1, elt);
    if (a == NULL) xfail(x, r, PIE_RESOURCE_EXHAUSTED, "out of memory");
    return a;
}

/* A segment's head: flags (0, an active segment of table or memory 0; other kinds are declined),
 * its offset and its item count, which must fit in the rest of the section (an item takes at
 * least a byte). has_target: the module has the table or memory. False after a failure. */
static bool seg_head(xl *x, xr *r, const xseg *k, bool has_target, uint32_t *off, uint32_t *n) {
    uint32_t flags = rd_u32(x, r);
    if (x->failed) return false;
    if (flags != 0) {
        DECLINE("%s segment kind %u (%s)", k->what, flags, k->declined);
        return false;
    }
    if (!has_target) {
        INVALID("%s segment without a %s", k->what, k->target);
        return false;
    }
    *off = (uint32_t)const_expr(x, r, T_I32);
    *n = rd_u32(x, r);
    if (x->failed) return false;
    if ((size_t)(r->end - r->p) < *n) {
        INVALID("%s segment runs past its section", k->what);
        return false;
    }
    return true;
}

static void sec_elems(xl *x, xr *r) {
    uint32_t n;
    x->elems = seg_list(x, r, &SEG_ELEM, sizeof *x->elems, &n);
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        xelem *e = &x->elems[x->n_elems];
        if (!seg_head(x, r, &SEG_ELEM, x->has_tab, &e->off, &e->n)) return;
        x->n_elems++;
        e->fn = malloc((size_t)(e->n ? e->n : 1) * sizeof *e->fn);
        if (e->fn == NULL) {
            xfail(x, r, PIE_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        for (uint32_t k = 0; k < e->n && !x->failed; k++) {
            e->fn[k] = rd_u32(x, r);
            if (!x->failed && e->fn[k] >= x->n_funcs)
                INVALID("element names function %u of %u", e->fn[k], x->n_funcs);
        }
    }
}

static void sec_datas(xl *x, xr *r) {
    uint32_t n;
    x->datas = seg_list(x, r, &SEG_DATA, sizeof *x->datas, &n);
    if (!x->failed && x->has_dcount && x->dcount != n) {
        INVALID("data count section says %u segments, data section has %u", x->dcount, n);
        return;
    }
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        xdata *d = &x->datas[x->n_datas];
        if (!seg_head(x, r, &SEG_DATA, x->has_mem, &d->off, &d->n)) return;
        x->n_datas++;
        d->bytes = r->p;
        r->p += d->n;
    }
}

/* The instance struct, prototypes and import wrappers: everything a body may refer to. */
static void emit_decls(xl *x) {
    if (x->decls_done) return;
    x->decls_done = true;
    xb *o = &x->out;
    xb_puts(o, "typedef struct lcI{struct Z_pie_instance_t*pie;"
               "struct Z_wasi_snapshot_preview1_instance_t*wasi;wasm_rt_memory_t m0;"
               "wasm_rt_funcref_table_t t0;");
    for (uint32_t g = 0; g < x->n_globals; g++)
        if (x->gmut[g]) {
            xb_puts(o, CT[ti(x->gtype[g])]);
            xb_puts(o, " g");
            xb_dec(o, g);
            xb_ch(o, ';');
        }
    xb_puts(o, "}lcI;\nstatic u32 FT[");
    xb_dec(o, x->n_types ? x->n_types : 1);
    xb_puts(o, "];\n");
    for (uint32_t f = 0; f < x->n_funcs; f++) {
        const xtype *t = &x->types[x->ftype[f]];
        if (f < x->n_imp) {
            xb_puts(o, ret_ctype(t));
            xb_ch(o, ' ');
            xb_puts(o, x->imp_c[f]);
            xb_puts(o, x->imp_mod[f] ? "(struct Z_wasi_snapshot_preview1_instance_t*"
                                     : "(struct Z_pie_instance_t*");
            put_ctype_list(o, t->p, t->np);
            xb_puts(o, ");\n");
            /* a wrapper with the module's calling convention, for tables */
            func_sig(x, o, f, true);
            xb_puts(o, t->nr ? "{return " : "{");
            xb_puts(o, x->imp_c[f]);
            xb_puts(o, x->imp_mod[f] ? "(I->wasi" : "(I->pie");
            for (uint32_t i = 0; i < t->np; i++) {
                xb_puts(o, ",l");
                xb_dec(o, i);
            }
            xb_puts(o, ");}\n");
        } else {
            func_sig(x, o, f, false);
            xb_puts(o, ";\n");
        }
    }
}

/* Gives out's text to the sink once it holds a piece (all: whatever it holds). */
static void out_flush(xl *x, bool all) {
    if (x->sink == NULL || x->failed || x->out.oom || x->out.len == 0) return;
    if (!all && x->out.len < LC_WASM_XLATE_PIECE) return;
    if (!x->sink->write(x->sink->user, x->out.p, x->out.len, x->st)) {
        x->failed = true;
        x->code = x->st->code;
        return;
    }
    x->sent += x->out.len;
    x->out.len = 0;
}

static void sec_code(xl *x, xr *r) {
    uint32_t n = rd_u32(x, r);
    if (x->failed) return;
    if (n != x->n_funcs - x->n_imp) {
        INVALID("%u function bodies for %u functions", n, x->n_funcs - x->n_imp);
        return;
    }
    x->n_code = n;
    emit_decls(x);
    out_flush(x, true); /* the compiler reads the prelude's headers while bodies are made */
    for (uint32_t i = 0; i < n && !x->failed; i++) {
        uint32_t size = rd_u32(x, r);
        if (x->failed) return;
        if ((size_t)(r->end - r->p) < size) {
            INVALID("function body runs past the code section");
            return;
        }
        xr b = {r->p, r->p + size};
        body(x, &b, x->n_imp + i);
        r->p += size;
        if (!x->failed && x->sent + x->out.len > XL_MAX_C_BYTES)
            DECLINE("more than %u bytes of C", XL_MAX_C_BYTES);
        out_flush(x, false);
    }
}

/* The data bytes as a C string literal (octal escapes for all but plain printable bytes). */
static void emit_bytes(xb *o, const uint8_t *p, uint32_t n) {
    xb_ch(o, '"');
    size_t col = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t c = p[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\' && c != '?') {
            xb_ch(o, (char)c);
            col++;
        } else {
            char e[4] = {'\\', (char)('0' + (c >> 6)), (char)('0' + ((c >> 3) & 7)),
                         (char)('0' + (c & 7))};
            xb_put(o, e, 4);
            col += 4;
        }
        if (col >= 120) {
            xb_puts(o, "\"\n\"");
            col = 0;
        }
    }
    xb_ch(o, '"');
}

static void emit_tail(xl *x) {
    xb *o = &x->out;
    const char *n = x->cname;
    for (uint32_t i = 0; i < x->n_datas; i++) {
        xb_puts(o, "static const char D");
        xb_dec(o, i);
        xb_puts(o, "[]=");
        emit_bytes(o, x->datas[i].bytes, x->datas[i].n);
        xb_puts(o, ";\n");
    }
    for (uint32_t i = 0; i < x->n_elems; i++) {
        xb_puts(o, "static const struct{u32 t;wasm_rt_function_ptr_t f;}E");
        xb_dec(o, i);
        xb_puts(o, "[]={");
        for (uint32_t k = 0; k < x->elems[i].n; k++) {
            uint32_t f = x->elems[i].fn[k];
            xb_ch(o, '{');
            xb_dec(o, x->ftype[f]);
            xb_puts(o, ",(wasm_rt_function_ptr_t)F");
            xb_dec(o, f);
            xb_puts(o, "},");
        }
        if (x->elems[i].n == 0) xb_puts(o, "{0,0}");
        xb_puts(o, "};\n");
    }
    xb_puts(o, "size_t ");
    xb_puts(o, n);
    xb_puts(o, "_lc_instance_size(void){return sizeof(lcI);}\nvoid ");
    xb_puts(o, n);
    xb_puts(o, "_lc_init_module(void){\n");
    for (uint32_t i = 0; i < x->n_types; i++) {
        const xtype *t = &x->types[i];
        static const char *const RT[4] = {"WASM_RT_I32", "WASM_RT_I64", "WASM_RT_F32",
                                          "WASM_RT_F64"};
        xb_puts(o, "FT[");
        xb_dec(o, i);
        xb_puts(o, "]=wasm_rt_register_func_type(");
        xb_dec(o, t->np);
        xb_ch(o, ',');
        xb_dec(o, t->nr);
        for (uint32_t k = 0; k < t->np; k++) {
            xb_ch(o, ',');
            xb_puts(o, RT[ti(t->p[k])]);
        }
        for (uint32_t k = 0; k < t->nr; k++) {
            xb_ch(o, ',');
            xb_puts(o, RT[ti(t->r[k])]);
        }
        xb_puts(o, ");\n");
    }
    xb_puts(o, "}\nvoid ");
    xb_puts(o, n);
    xb_puts(o, "_lc_instantiate(void*i,struct Z_pie_instance_t*p,"
               "struct Z_wasi_snapshot_preview1_instance_t*w){\nlcI*I=i;u32 k;I->pie=p;I->wasi=w;"
               "(void)k;\n");
    for (uint32_t g = 0; g < x->n_globals; g++)
        if (x->gmut[g]) {
            xb_puts(o, "I->g");
            xb_dec(o, g);
            xb_ch(o, '=');
            put_const(o, x->gtype[g], x->ginit[g]);
            xb_puts(o, ";\n");
        }
    if (x->has_mem) {
        xb_puts(o, "wasm_rt_allocate_memory(&I->m0,");
        xb_dec(o, x->mem_min);
        xb_ch(o, ',');
        xb_dec(o, x->mem_max);
        xb_puts(o, ");\n");
        for (uint32_t i = 0; i < x->n_datas; i++) {
            xb_puts(o, "if(");
            xb_dec(o, (uint64_t)x->datas[i].off + x->datas[i].n);
            xb_puts(o, "ull>I->m0.size)TRAP(OOB);memcpy(I->m0.data+");
            xb_dec(o, x->datas[i].off);
            xb_puts(o, "ull,D");
            xb_dec(o, i);
            xb_ch(o, ',');
            xb_dec(o, x->datas[i].n);
            xb_puts(o, ");\n");
        }
    }
    if (x->has_tab) {
        xb_puts(o, "wasm_rt_allocate_funcref_table(&I->t0,");
        xb_dec(o, x->tab_min);
        xb_puts(o, "u,");
        xb_dec(o, x->tab_max);
        xb_puts(o, "u);\n");
        for (uint32_t i = 0; i < x->n_elems; i++) {
            xb_puts(o, "if(");
            xb_dec(o, (uint64_t)x->elems[i].off + x->elems[i].n);
            xb_puts(o, "ull>I->t0.size)TRAP(OOB);for(k=0;k<");
            xb_dec(o, x->elems[i].n);
            xb_puts(o, "u;k++)I->t0.data[");
            xb_dec(o, x->elems[i].off);
            xb_puts(o, "u+k]=(wasm_rt_funcref_t){FT[E");
            xb_dec(o, i);
            xb_puts(o, "[k].t],E");
            xb_dec(o, i);
            xb_puts(o, "[k].f,I};\n");
        }
    }
    if (x->has_start) {
        xb_ch(o, 'F');
        xb_dec(o, x->start);
        xb_puts(o, "(I);\n");
    }
    xb_puts(o, "}\nvoid ");
    xb_puts(o, n);
    xb_puts(o, "_lc_start(void*i){F");
    xb_dec(o, x->entry);
    xb_puts(o, "((lcI*)i);}\nvoid ");
    xb_puts(o, n);
    xb_puts(o, "_lc_free(void*i){lcI*I=i;");
    if (x->has_tab) xb_puts(o, "wasm_rt_free_funcref_table(&I->t0);");
    if (x->has_mem) xb_puts(o, "wasm_rt_free_memory(&I->m0);");
    xb_puts(o, "(void)I;}\n");
}

static void xl_free(xl *x) {
    free(x->types);
    free(x->ftype);
    for (uint32_t i = 0; i < x->n_imp; i++) free(x->imp_c[i]);
    free(x->imp_c);
    free(x->imp_mod);
    free(x->gtype);
    free(x->gmut);
    free(x->ginit);
    for (uint32_t i = 0; i < x->n_elems; i++) free(x->elems[i].fn);
    free(x->elems);
    free(x->datas);
    free(x->fn.p);
    free(x->ex.p);
    free(x->sc.p);
    free(x->lt);
    free(x->vs);
    free(x->cs);
    free(x->args);
    free(x->tgt);
}

static pie_code xlate(const uint8_t *wasm, size_t n, const char *cname,
                      const lc_wasm_xlate_sink *sink, lc_wasm_xlate_out *out, pie_status *st) {
    memset(out, 0, sizeof *out);
    xl xs = {.base = wasm, .st = st, .cname = cname, .sink = sink};
    xl *x = &xs;
    xr rr = {wasm, wasm + n}, *r = &rr;
    static const uint8_t head[8] = {0x00, 0x61, 0x73, 0x6d, 1, 0, 0, 0};
    if (n < 8 || memcmp(wasm, head, 8) != 0) {
        INVALID("not a wasm 1.0 module");
        goto done;
    }
    r->p += 8;
    xb_puts(&x->out, PRELUDE);
    int last = 0;
    while (r->p < r->end && !x->failed) {
        uint8_t id = rd_byte(x, r);
        uint32_t size = rd_u32(x, r);
        if (x->failed) break;
        if ((size_t)(r->end - r->p) < size) {
            INVALID("section %u runs past the end", id);
            break;
        }
        xr s = {r->p, r->p + size};
        if (id > 12) {
            INVALID("unknown section %u", id);
            break;
        }
        int order = id == 12 ? 95 : id * 10;
        if (id != 0) {
            if (order <= last) {
                INVALID("section %u out of order or repeated", id);
                break;
            }
            last = order;
        }
        switch (id) {
        case 0: {
            uint32_t nl;
            rd_name(x, &s, &nl);
            s.p = s.end;
            break;
        }
        case 1: sec_types(x, &s); break;
        case 2: sec_imports(x, &s); break;
        case 3: sec_functions(x, &s); break;
        case 4: sec_table(x, &s); break;
        case 5: sec_memory(x, &s); break;
        case 6: sec_globals(x, &s); break;
        case 7: sec_exports(x, &s); break;
        case 8: sec_start(x, &s); break;
        case 9: sec_elems(x, &s); break;
        case 10: sec_code(x, &s); break;
        case 11: sec_datas(x, &s); break;
        case 12:
            x->dcount = rd_u32(x, &s);
            x->has_dcount = true;
            break;
        }
        if (!x->failed && s.p != s.end) {
            r->p = s.p;
            INVALID("section %u has bytes left over", id);
        }
        r->p = s.end;
    }
    if (x->failed) goto done;
    if (x->n_code != x->n_funcs - x->n_imp) {
        INVALID("%u functions declared without a code section", x->n_funcs - x->n_imp);
        goto done;
    }
    if (x->has_dcount && x->dcount != x->n_datas) {
        INVALID("data count section says %u segments, the module has %u", x->dcount, x->n_datas);
        goto done;
    }
    if (!x->has_entry || x->types[x->ftype[x->entry]].np || x->types[x->ftype[x->entry]].nr) {
        DECLINE("no export _start of type [] -> []");
        goto done;
    }
    emit_decls(x);
    emit_tail(x);
    if (x->out.oom || x->fn.oom || x->ex.oom || x->sc.oom)
        xfail(x, NULL, PIE_RESOURCE_EXHAUSTED, "out of memory for the C text");
    out_flush(x, true);
done:
    xl_free(x);
    if (x->failed || sink) free(x->out.p);
    if (x->failed) return x->code;
    out->c = sink ? NULL : x->out.p;
    out->len = sink ? x->sent : x->out.len;
    out->n_funcs = x->n_funcs - x->n_imp;
    pie_status_ok(st);
    return PIE_OK;
}

pie_code lc_wasm_xlate(const uint8_t *wasm, size_t n, const char *cname, lc_wasm_xlate_out *out,
                       pie_status *st) {
    return xlate(wasm, n, cname, NULL, out, st);
}

pie_code lc_wasm_xlate_to(const uint8_t *wasm, size_t n, const char *cname,
                          const lc_wasm_xlate_sink *sink, uint32_t *n_funcs, pie_status *st) {
    lc_wasm_xlate_out out;
    pie_code rc = xlate(wasm, n, cname, sink, &out, st);
    if (n_funcs) *n_funcs = out.n_funcs;
    return rc;
}
