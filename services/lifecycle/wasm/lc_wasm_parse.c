/* lc_wasm_parse.c — reading a wasm binary as far as the runtime relies on it, before wasm2c.
 *
 * Owns: the checks that give a client a precise reason early (not wasm, wrong version, truncated
 * or overlong sections, imports of kinds other than functions, no `_start` of type () -> ()),
 * the list of function imports with their types as WAT text, the check of those imports against
 * what the host provides, whether an element segment puts an import into a table (wasm2c's code
 * must not run such a module), and wasm2c's name mangling. Full validation of code is wasm2c's (it
 * validates while translating; its message is passed on). Binary format: WebAssembly core spec
 * 1.0, §5 "Binary Format". */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lc_wasm_int.h"

typedef struct reader {
    const uint8_t *p, *end;
    const uint8_t *base; /* for offsets in messages */
    pie_status *st;
    bool failed;
} reader;

static void fail(reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(reader *r, const char *fmt, ...) {
    if (r->failed) return;
    r->failed = true;
    char msg[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pie_status_set(r->st, PIE_INVALID_ARGUMENT, "invalid wasm module at byte %zu: %s",
                   (size_t)(r->p - r->base), msg);
}

/* A module beyond one of the complexity limits: not malformed, so no byte offset. */
static void limit_fail(reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void limit_fail(reader *r, const char *fmt, ...) {
    if (r->failed) return;
    r->failed = true;
    char msg[PIE_STATUS_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pie_status_set(r->st, PIE_INVALID_ARGUMENT, "module too complex to compile here: %s", msg);
}

static uint8_t byte(reader *r) {
    if (r->failed) return 0;
    if (r->p >= r->end) {
        fail(r, "unexpected end of data");
        return 0;
    }
    return *r->p++;
}

/* Unsigned LEB128 of at most 32 bits (5 bytes, the last one's high bits zero). */
static uint32_t u32(reader *r) {
    uint32_t v = 0;
    for (unsigned shift = 0; shift < 35; shift += 7) {
        uint8_t b = byte(r);
        if (r->failed) return 0;
        if (shift == 28 && (b & 0x70)) {
            fail(r, "integer too large for 32 bits");
            return 0;
        }
        v |= (uint32_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return v;
    }
    fail(r, "integer encoding longer than 5 bytes");
    return 0;
}

/* Skips a LEB128 integer of at most max_bytes bytes (its value does not matter to the scan). */
static void skip_leb(reader *r, unsigned max_bytes) {
    for (unsigned i = 0; i < max_bytes; i++) {
        uint8_t b = byte(r);
        if (r->failed || !(b & 0x80)) return;
    }
    fail(r, "integer encoding longer than %u bytes", max_bytes);
}

static void skip_bytes(reader *r, size_t n) {
    if (r->failed) return;
    if ((size_t)(r->end - r->p) < n) {
        fail(r, "unexpected end of data");
        return;
    }
    r->p += n;
}

/* A name: length-prefixed bytes, returned as a NUL-terminated copy (NULL after a failure). */
static char *name(reader *r) {
    uint32_t n = u32(r);
    if (r->failed) return NULL;
    if ((size_t)(r->end - r->p) < n) {
        fail(r, "name of %u bytes runs past the end of its section", n);
        return NULL;
    }
    if (memchr(r->p, 0, n) != NULL) {
        fail(r, "name contains a NUL byte");
        return NULL;
    }
    char *s = malloc((size_t)n + 1);
    if (s == NULL) {
        fail(r, "out of memory");
        return NULL;
    }
    memcpy(s, r->p, n);
    s[n] = '\0';
    r->p += n;
    return s;
}

static const char *valtype_name(uint8_t t) {
    switch (t) {
    case 0x7f: return "i32";
    case 0x7e: return "i64";
    case 0x7d: return "f32";
    case 0x7c: return "f64";
    case 0x7b: return "v128";
    case 0x70: return "funcref";
    case 0x6f: return "externref";
    default: return NULL;
    }
}

/* Limits of a table or memory: flags, min, optional max. */
static void limits(reader *r) {
    uint8_t flags = byte(r);
    if (flags > 1) {
        fail(r, "limits flag 0x%02x (shared or 64-bit memories are not supported)", flags);
        return;
    }
    (void)u32(r);
    if (flags & 1) (void)u32(r);
}

/* ---- types as WAT text ---------------------------------------------------------------------- */

typedef struct functype {
    const uint8_t *params, *results;
    uint32_t n_params, n_results;
} functype;

static void append(char *buf, size_t n, size_t *at, const char *s) {
    size_t l = strlen(s);
    if (*at + l + 1 > n) l = *at + 1 < n ? n - *at - 1 : 0;
    memcpy(buf + *at, s, l);
    *at += l;
    buf[*at] = '\0';
}

static void render_part(char *buf, size_t n, size_t *at, const char *word, const uint8_t *t,
                        uint32_t count) {
    if (count == 0) return;
    if (*at) append(buf, n, at, " ");
    append(buf, n, at, "(");
    append(buf, n, at, word);
    for (uint32_t i = 0; i < count; i++) {
        append(buf, n, at, " ");
        append(buf, n, at, valtype_name(t[i]));
    }
    append(buf, n, at, ")");
}

static char *render_type(const functype *ft) {
    size_t n = 16 + 11 * ((size_t)ft->n_params + ft->n_results);
    char *buf = malloc(n);
    if (buf == NULL) return NULL;
    size_t at = 0;
    buf[0] = '\0';
    render_part(buf, n, &at, "param", ft->params, ft->n_params);
    render_part(buf, n, &at, "result", ft->results, ft->n_results);
    return buf;
}

bool lc_wasm_type_is_canonical(const char *type) {
    /* Re-render what we read: canonical means it renders back identically. */
    if (type == NULL) return false;
    uint8_t params[64], results[64];
    uint32_t np = 0, nr = 0;
    const char *s = type;
    for (int part = 0; part < 2; part++) {
        const char *word = part == 0 ? "(param" : "(result";
        size_t wl = strlen(word);
        if (strncmp(s, word, wl) != 0) continue;
        s += wl;
        while (*s == ' ') {
            s++;
            uint8_t t;
            if (strncmp(s, "i32", 3) == 0)
                t = 0x7f;
            else if (strncmp(s, "i64", 3) == 0)
                t = 0x7e;
            else if (strncmp(s, "f32", 3) == 0)
                t = 0x7d;
            else if (strncmp(s, "f64", 3) == 0)
                t = 0x7c;
            else
                return false;
            s += 3;
            if (part == 0 && np < 64)
                params[np++] = t;
            else if (part == 1 && nr < 64)
                results[nr++] = t;
            else
                return false;
        }
        if (*s++ != ')') return false;
        if (*s == ' ') s++;
    }
    if (*s != '\0') return false;
    functype ft = {params, results, np, nr};
    char *again = render_type(&ft);
    bool ok = again != NULL && strcmp(again, type) == 0;
    free(again);
    return ok;
}

static void read_functype(reader *r, functype *ft) {
    if (byte(r) != 0x60) {
        if (!r->failed) fail(r, "type entry is not a function type");
        return;
    }
    for (int part = 0; part < 2; part++) {
        uint32_t count = u32(r);
        if (r->failed) return;
        if ((size_t)(r->end - r->p) < count) {
            fail(r, "function type with %u value types runs past its section", count);
            return;
        }
        for (uint32_t i = 0; i < count; i++)
            if (valtype_name(r->p[i]) == NULL) {
                r->p += i;
                fail(r, "unknown value type 0x%02x", r->p[0]);
                return;
            }
        if (part == 0) {
            ft->params = r->p;
            ft->n_params = count;
        } else {
            ft->results = r->p;
            ft->n_results = count;
        }
        r->p += count;
    }
}

/* ---- the module ------------------------------------------------------------------------------ */

typedef struct module_scan {
    const lc_wasm_module_limits *lim; /* defaults filled in */
    functype *types;
    uint32_t n_types;
    uint32_t *func_types; /* type index of every function, imported first */
    uint32_t n_funcs, cap_funcs;
    uint32_t n_imported; /* functions imported (the first of func_types) */
    bool has_start_export;
    uint32_t start_func;
} module_scan;

static bool push_func(reader *r, module_scan *m, uint32_t type) {
    if (type >= m->n_types) {
        fail(r, "function uses type %u but the module declares %u types", type, m->n_types);
        return false;
    }
    if (m->n_funcs == m->cap_funcs) {
        uint32_t cap = m->cap_funcs ? 2 * m->cap_funcs : 64;
        uint32_t *f = realloc(m->func_types, (size_t)cap * sizeof *f);
        if (f == NULL) {
            fail(r, "out of memory");
            return false;
        }
        m->func_types = f;
        m->cap_funcs = cap;
    }
    m->func_types[m->n_funcs++] = type;
    return true;
}

static void read_types(reader *r, module_scan *m) {
    uint32_t n = u32(r);
    if (r->failed) return;
    if ((size_t)(r->end - r->p) < (size_t)n * 3) {
        fail(r, "type section declares %u types but is too short for them", n);
        return;
    }
    m->types = calloc(n ? n : 1, sizeof *m->types);
    if (m->types == NULL) {
        fail(r, "out of memory");
        return;
    }
    m->n_types = n;
    for (uint32_t i = 0; i < n && !r->failed; i++) {
        read_functype(r, &m->types[i]);
        uint64_t arity = (uint64_t)m->types[i].n_params + m->types[i].n_results;
        if (!r->failed && arity > LC_WASM_MAX_TYPE_ARITY)
            limit_fail(r,
                       "function type %u has %llu parameters and results, more than the %u that "
                       "the tier-0 compiler (tcc) can pass in one call",
                       i, (unsigned long long)arity, LC_WASM_MAX_TYPE_ARITY);
    }
}

static void read_imports(reader *r, module_scan *m, lc_wasm_info *info) {
    uint32_t n = u32(r);
    if (r->failed) return;
    if ((size_t)(r->end - r->p) < (size_t)n * 4) {
        fail(r, "import section declares %u imports but is too short for them", n);
        return;
    }
    info->imports = calloc(n ? n : 1, sizeof *info->imports);
    if (info->imports == NULL) {
        fail(r, "out of memory");
        return;
    }
    static const char *const kinds[] = {"function", "table", "memory", "global", "tag"};
    for (uint32_t i = 0; i < n && !r->failed; i++) {
        lc_wasm_import *im = &info->imports[info->n_imports];
        im->module = name(r);
        im->name = name(r);
        info->n_imports++;
        uint8_t kind = byte(r);
        if (r->failed) return;
        if (kind != 0) {
            fail(r, "import %s.%s is a %s: only function imports are supported", im->module,
                 im->name, kind < 5 ? kinds[kind] : "thing of unknown kind");
            return;
        }
        uint32_t t = u32(r);
        if (!push_func(r, m, t)) return;
        im->type = render_type(&m->types[t]);
        if (im->type == NULL) fail(r, "out of memory");
        if (strcmp(im->module, "pie") == 0) info->imports_pie = true;
        if (strcmp(im->module, "wasi_snapshot_preview1") == 0) info->imports_wasi = true;
    }
    m->n_imported = m->n_funcs;
}

static void read_functions(reader *r, module_scan *m) {
    uint32_t n = u32(r);
    if (r->failed) return;
    if ((size_t)(r->end - r->p) < n) {
        fail(r, "function section declares %u functions but is too short for them", n);
        return;
    }
    if (n > m->lim->max_functions) {
        limit_fail(r, "it defines %u functions, more than the limit of %u (programs.max_functions)",
                   n, m->lim->max_functions);
        return;
    }
    for (uint32_t i = 0; i < n && !r->failed; i++) push_func(r, m, u32(r));
}

/* ---- function bodies -------------------------------------------------------------------------
 * Every instruction is decoded as far as its immediates go, to find the block structure: the
 * nesting that wasm2c recurses on. Opcodes: the core spec 1.0 and what wasm2c 1.0.32 reads by
 * default (sign extension, saturating truncation, bulk memory, reference types, multi-value
 * block types, SIMD). Anything else is refused here: wasm2c would refuse it too. Types and
 * indices are validated by wasm2c. */

/* memarg: alignment (bit 6: a memory index follows, multi-memory) and offset. */
static void skip_memarg(reader *r) {
    uint32_t align = u32(r);
    if (align & 0x40) skip_leb(r, 5);
    skip_leb(r, 10);
}

/* A block type: 0x40 (none), one value type, or a type index (s33). */
static void skip_blocktype(reader *r) {
    if (r->failed) return;
    if (r->p < r->end && (*r->p == 0x40 || valtype_name(*r->p) != NULL)) {
        r->p++;
        return;
    }
    skip_leb(r, 5);
}

/* The immediates of 0xfc <sub>: saturating truncation (0-7), bulk memory and tables (8-17). */
static bool skip_fc(reader *r, uint32_t sub) {
    if (sub <= 7) return true;
    switch (sub) {
    case 8:  /* memory.init data mem */
    case 10: /* memory.copy mem mem */
    case 12: /* table.init elem table */
    case 14: /* table.copy table table */
        skip_leb(r, 5);
        skip_leb(r, 5);
        return true;
    case 9:  /* data.drop */
    case 11: /* memory.fill */
    case 13: /* elem.drop */
    case 15: /* table.grow */
    case 16: /* table.size */
    case 17: /* table.fill */ skip_leb(r, 5); return true;
    default: return false;
    }
}

/* The immediates of 0xfd <sub> (SIMD): memory accesses, v128.const and i8x16.shuffle (16
 * bytes), lane indices; the other operations have none. */
static bool skip_fd(reader *r, uint32_t sub) {
    if (sub <= 11 || sub == 92 || sub == 93) { /* loads, splats, store, load*_zero */
        skip_memarg(r);
    } else if (sub == 12 || sub == 13) { /* v128.const, i8x16.shuffle */
        skip_bytes(r, 16);
    } else if (sub >= 21 && sub <= 34) { /* extract_lane / replace_lane */
        skip_bytes(r, 1);
    } else if (sub >= 84 && sub <= 91) { /* load*_lane, store*_lane */
        skip_memarg(r);
        skip_bytes(r, 1);
    } else if (sub > 255) {
        return false;
    }
    return true;
}

/* One body's locals: at most LC_WASM_MAX_LOCALS in all. */
static void scan_locals(reader *r, uint32_t func) {
    uint32_t groups = u32(r);
    uint64_t total = 0;
    for (uint32_t g = 0; g < groups && !r->failed; g++) {
        total += u32(r);
        uint8_t t = byte(r);
        if (r->failed) return;
        if (valtype_name(t) == NULL) {
            r->p--;
            fail(r, "function %u: local of unknown value type 0x%02x", func, t);
            return;
        }
        if (total > LC_WASM_MAX_LOCALS) {
            limit_fail(r, "function %u declares more than %u locals", func, LC_WASM_MAX_LOCALS);
            return;
        }
    }
}

/* One function body (its reader spans exactly the body): locals, then instructions to the
 * `end` that closes the body, with at most lim->max_nesting blocks open at once. */
static void scan_body(reader *r, uint32_t func, const lc_wasm_module_limits *lim) {
    scan_locals(r, func);
    uint32_t depth = 1; /* the body is a block */
    while (depth > 0 && !r->failed) {
        uint8_t op = byte(r);
        if (r->failed) return;
        switch (op) {
        case 0x02: /* block */
        case 0x03: /* loop */
        case 0x04: /* if */
            skip_blocktype(r);
            if (depth > lim->max_nesting) { /* depth blocks open after this one */
                limit_fail(r,
                           "function %u nests blocks more than %u deep (the limit, "
                           "programs.max_nesting)",
                           func, lim->max_nesting);
                return;
            }
            depth++;
            break;
        case 0x0b: depth--; break; /* end */
        case 0x0c:                 /* br */
        case 0x0d:                 /* br_if */
        case 0x10:                 /* call */
        case 0x20:
        case 0x21:
        case 0x22:
        case 0x23:
        case 0x24: /* local.*, global.* */
        case 0x25:
        case 0x26: /* table.get, table.set */
        case 0x3f:
        case 0x40: /* memory.size, memory.grow */
        case 0xd2: /* ref.func */ skip_leb(r, 5); break;
        case 0x0e: { /* br_table: n labels and the default */
            uint32_t n = u32(r);
            if (r->failed) return;
            if ((size_t)(r->end - r->p) < (size_t)n + 1) {
                fail(r, "br_table with %u labels runs past the end of its function", n);
                return;
            }
            for (uint64_t i = 0; i <= n && !r->failed; i++) skip_leb(r, 5);
            break;
        }
        case 0x11: /* call_indirect type table */
            skip_leb(r, 5);
            skip_leb(r, 5);
            break;
        case 0x1c: { /* select t* */
            uint32_t n = u32(r);
            if (r->failed) return;
            skip_bytes(r, n);
            break;
        }
        case 0x41: skip_leb(r, 5); break;  /* i32.const */
        case 0x42: skip_leb(r, 10); break; /* i64.const */
        case 0x43: skip_bytes(r, 4); break;
        case 0x44: skip_bytes(r, 8); break;
        case 0xd0: skip_bytes(r, 1); break; /* ref.null t */
        case 0xfc:
        case 0xfd: {
            uint32_t sub = u32(r);
            if (r->failed) return;
            if (!(op == 0xfc ? skip_fc(r, sub) : skip_fd(r, sub))) {
                fail(r, "function %u: unknown or unsupported instruction 0x%02x %u", func, op, sub);
                return;
            }
            break;
        }
        default:
            if (op <= 0x01 || op == 0x05 || op == 0x0f || op == 0x1a || op == 0x1b ||
                (op >= 0x45 && op <= 0xc4) || op == 0xd1)
                break; /* no immediates: unreachable, nop, else, return, drop, select, numeric,
                          sign extension, ref.is_null */
            if (op >= 0x28 && op <= 0x3e) { /* loads and stores */
                skip_memarg(r);
                break;
            }
            r->p--;
            fail(r, "function %u: unknown or unsupported opcode 0x%02x", func, op);
            return;
        }
    }
    if (!r->failed && r->p != r->end)
        fail(r, "function %u: %zu bytes after the end of its body", func, (size_t)(r->end - r->p));
}

static void read_code(reader *r, module_scan *m) {
    uint32_t n = u32(r);
    if (r->failed) return;
    uint32_t defined = m->n_funcs - m->n_imported;
    if (n != defined) {
        fail(r, "code section has %u function bodies, the function section declares %u", n,
             defined);
        return;
    }
    for (uint32_t i = 0; i < n && !r->failed; i++) {
        uint32_t func = m->n_imported + i;
        uint32_t size = u32(r);
        if (r->failed) return;
        if ((size_t)(r->end - r->p) < size) {
            fail(r, "body of function %u declares %u bytes but only %zu remain", func, size,
                 (size_t)(r->end - r->p));
            return;
        }
        if (size > m->lim->max_function_bytes) {
            limit_fail(r,
                       "function %u has a body of %u bytes, more than the limit of %u "
                       "(programs.max_function_size)",
                       func, size, m->lim->max_function_bytes);
            return;
        }
        reader b = {.p = r->p, .end = r->p + size, .base = r->base, .st = r->st};
        scan_body(&b, func, m->lim);
        if (b.failed) {
            r->failed = true;
            return;
        }
        r->p += size;
    }
}

/* ---- element segments ------------------------------------------------------------------------
 * Read only to find imported functions placed in a table (lc_wasm_info.import_in_table); wasm2c
 * validates the rest. Segment forms (core spec 2.0 §5.5.12, flags 0-7): bit 0 passive or
 * declarative, bit 1 with bit 0 declarative, else an explicit table index; bit 2 expressions
 * instead of function indices. */

/* A constant expression up to its `end`; *func gets the index of a ref.func in it (else
 * UINT32_MAX). Instructions: the constants, global.get, ref.null, ref.func and the extended
 * constant arithmetic (no immediates). */
static void const_expr(reader *r, uint32_t *func) {
    *func = UINT32_MAX;
    for (;;) {
        uint8_t op = byte(r);
        if (r->failed || op == 0x0b) return;
        switch (op) {
        case 0x41: skip_leb(r, 5); break;  /* i32.const */
        case 0x42: skip_leb(r, 10); break; /* i64.const */
        case 0x43: skip_bytes(r, 4); break;
        case 0x44: skip_bytes(r, 8); break;
        case 0x23: skip_leb(r, 5); break;   /* global.get */
        case 0xd0: skip_bytes(r, 1); break; /* ref.null t */
        case 0xd2: *func = u32(r); break;   /* ref.func */
        case 0x6a:
        case 0x6b:
        case 0x6c:
        case 0x7c:
        case 0x7d:
        case 0x7e: break; /* i32/i64 add, sub, mul */
        default:
            r->p--;
            fail(r, "instruction 0x%02x in a constant expression", op);
            return;
        }
    }
}

/* Notes function f of segment seg if it is an import placed in a table. */
static void note_elem_func(const module_scan *m, lc_wasm_info *info, uint32_t seg, uint32_t f,
                           bool placed) {
    if (!placed || f >= m->n_imported || info->import_in_table) return;
    info->import_in_table = true;
    info->table_import = f;
    info->table_segment = seg;
}

static void read_elems(reader *r, const module_scan *m, lc_wasm_info *info) {
    uint32_t n = u32(r);
    for (uint32_t i = 0; i < n && !r->failed; i++) {
        uint32_t flags = u32(r), f;
        if (r->failed) return;
        if (flags > 7) {
            fail(r, "element segment %u has unknown flags %u", i, flags);
            return;
        }
        bool placed = (flags & 3) != 3; /* declarative segments only declare references */
        if (flags == 2 || flags == 6) skip_leb(r, 5); /* table index */
        if (!(flags & 1)) const_expr(r, &f);          /* offset */
        if (flags & 3) skip_bytes(r, 1);              /* element kind or reference type */
        uint32_t count = u32(r);
        if (r->failed) return;
        if ((size_t)(r->end - r->p) < count) {
            fail(r, "element segment %u declares %u elements but is too short for them", i, count);
            return;
        }
        for (uint32_t k = 0; k < count && !r->failed; k++) {
            if (flags & 4)
                const_expr(r, &f);
            else
                f = u32(r);
            if (!r->failed) note_elem_func(m, info, i, f, placed);
        }
    }
}

static void read_memories(reader *r) {
    uint32_t n = u32(r);
    for (uint32_t i = 0; i < n && !r->failed; i++) limits(r);
}

static void read_exports(reader *r, module_scan *m) {
    uint32_t n = u32(r);
    if (r->failed) return;
    for (uint32_t i = 0; i < n && !r->failed; i++) {
        char *nm = name(r);
        uint8_t kind = byte(r);
        uint32_t index = u32(r);
        if (!r->failed && kind == 0 && strcmp(nm, "_start") == 0) {
            m->has_start_export = true;
            m->start_func = index;
        }
        free(nm);
    }
}

pie_code lc_wasm_parse(const uint8_t *b, size_t n, lc_wasm_info *info, pie_status *st) {
    return lc_wasm_parse_limited(b, n, NULL, info, st);
}

pie_code lc_wasm_parse_limited(const uint8_t *b, size_t n, const lc_wasm_module_limits *limits,
                               lc_wasm_info *info, pie_status *st) {
    memset(info, 0, sizeof *info);
    lc_wasm_module_limits lim = {0};
    if (limits) lim = *limits;
    if (lim.max_functions == 0) lim.max_functions = LC_WASM_DEFAULT_MAX_FUNCTIONS;
    if (lim.max_function_bytes == 0) lim.max_function_bytes = LC_WASM_DEFAULT_MAX_FUNCTION_BYTES;
    if (lim.max_nesting == 0) lim.max_nesting = LC_WASM_DEFAULT_MAX_NESTING;
    static const uint8_t magic[4] = {0x00, 0x61, 0x73, 0x6d};
    if (n < 8 || memcmp(b, magic, 4) != 0) {
        char got[64] = "";
        size_t at = 0;
        for (size_t i = 0; i < 4 && i < n; i++)
            at += (size_t)snprintf(got + at, sizeof got - at, "%s%02x", i ? " " : "", b[i]);
        if (n < 4)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "not a WebAssembly module: %zu bytes, too short for the "
                                  "8-byte header",
                                  n);
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "not a WebAssembly module: it starts with bytes %s, not the wasm "
                              "magic 00 61 73 6d (\"\\0asm\")%s",
                              got, n < 8 ? " and is shorter than the 8-byte header" : "");
    }
    uint32_t version =
        (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
    if (version != 1)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "unsupported WebAssembly binary version %u (expected 1; components "
                              "are not supported, only core modules)",
                              version);

    reader r = {.p = b + 8, .end = b + n, .base = b, .st = st};
    module_scan m = {.lim = &lim};
    int last_id = 0;
    while (r.p < r.end && !r.failed) {
        uint8_t id = byte(&r);
        uint32_t size = u32(&r);
        if (r.failed) break;
        if ((size_t)(r.end - r.p) < size) {
            fail(&r, "section %u declares %u bytes but only %zu remain", id, size,
                 (size_t)(r.end - r.p));
            break;
        }
        if (id > 12) {
            fail(&r, "unknown section id %u", id);
            break;
        }
        /* Non-custom sections appear at most once, in order (datacount, id 12, sits before code).
         */
        int order = id == 12 ? 95 : id * 10;
        if (id != 0) {
            if (order <= last_id) {
                fail(&r, "section %u is out of order or repeated", id);
                break;
            }
            last_id = order;
        }
        reader s = {.p = r.p, .end = r.p + size, .base = b, .st = st};
        switch (id) {
        case 1: read_types(&s, &m); break;
        case 2: read_imports(&s, &m, info); break;
        case 3: read_functions(&s, &m); break;
        case 5: read_memories(&s); break;
        case 7: read_exports(&s, &m); break;
        case 9: read_elems(&s, &m, info); break;
        case 10: read_code(&s, &m); break;
        default: s.p = s.end; break;
        }
        if (s.failed) {
            r.failed = true;
            break;
        }
        if (s.p != s.end && id != 0) {
            fail(&s, "section %u has %zu bytes left over after its contents", id,
                 (size_t)(s.end - s.p));
            r.failed = true;
            break;
        }
        r.p += size;
    }
    if (!r.failed) {
        if (!m.has_start_export) {
            pie_status_set(st, PIE_INVALID_ARGUMENT,
                           "module exports no function \"_start\": an inferlet is a WASI command "
                           "(build it with a main function)");
            r.failed = true;
        } else if (m.start_func >= m.n_funcs) {
            pie_status_set(st, PIE_INVALID_ARGUMENT, "export \"_start\" names function %u of %u",
                           m.start_func, m.n_funcs);
            r.failed = true;
        } else {
            functype *ft = &m.types[m.func_types[m.start_func]];
            if (ft->n_params || ft->n_results) {
                char *t = render_type(ft);
                pie_status_set(st, PIE_INVALID_ARGUMENT,
                               "export \"_start\" has type %s, expected no parameters and no "
                               "results",
                               t ? t : "?");
                free(t);
                r.failed = true;
            }
        }
    }
    free(m.types);
    free(m.func_types);
    if (r.failed) {
        lc_wasm_info_free(info);
        return st ? st->code : PIE_INVALID_ARGUMENT;
    }
    pie_status_ok(st);
    return PIE_OK;
}

void lc_wasm_info_free(lc_wasm_info *info) {
    for (size_t i = 0; i < info->n_imports; i++) {
        free(info->imports[i].module);
        free(info->imports[i].name);
        free(info->imports[i].type);
    }
    free(info->imports);
    memset(info, 0, sizeof *info);
}

/* ---- imports against the host --------------------------------------------------------------- */

static const lc_wasm_host_fn *find_fn(const lc_wasm_host_fn *fns, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(fns[i].name, name) == 0) return &fns[i];
    return NULL;
}

pie_code lc_wasm_check_imports(const lc_wasm_info *info, const lc_wasm_host_fn *pie_fns,
                               size_t n_pie, pie_status *st) {
    char list[PIE_STATUS_MSG_MAX];
    size_t at = 0;
    list[0] = '\0';
    size_t bad = 0;
    for (size_t i = 0; i < info->n_imports; i++) {
        const lc_wasm_import *im = &info->imports[i];
        const lc_wasm_host_fn *fn = NULL;
        if (strcmp(im->module, "pie") == 0)
            fn = find_fn(pie_fns, n_pie, im->name);
        else if (strcmp(im->module, "wasi_snapshot_preview1") == 0)
            fn = find_fn(lc_wasm_wasi_fns, lc_wasm_wasi_n_fns, im->name);
        char item[200];
        if (fn == NULL)
            snprintf(item, sizeof item, "%s.%s %s", im->module, im->name,
                     im->type[0] ? im->type : "(no parameters or results)");
        else if (strcmp(fn->type, im->type) != 0)
            snprintf(item, sizeof item, "%s.%s with type %s (the host's has type %s)", im->module,
                     im->name, im->type[0] ? im->type : "()", fn->type[0] ? fn->type : "()");
        else
            continue;
        append(list, sizeof list, &at, bad ? "; " : "");
        append(list, sizeof list, &at, item);
        bad++;
    }
    if (bad == 0) {
        pie_status_ok(st);
        return PIE_OK;
    }
    return pie_status_set(st, PIE_INVALID_ARGUMENT,
                          "module imports %zu function%s the host does not provide: %s", bad,
                          bad == 1 ? "" : "s", list);
}

/* wasm2c 1.0.32: [A-Za-z0-9_] except 'Z' stay, everything else becomes 'Z' + two hex digits. */
static void mangle(const char *s, char *out, size_t n, size_t *at) {
    static const char hex[] = "0123456789ABCDEF";
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        bool keep =
            (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Y') || (c >= '0' && c <= '9') || c == '_';
        char esc[4] = {(char)c, 0, 0, 0};
        if (!keep) {
            esc[0] = 'Z';
            esc[1] = hex[c >> 4];
            esc[2] = hex[c & 15];
        }
        append(out, n, at, esc);
    }
}

void lc_wasm_mangle_import(const char *module, const char *name_, char *out, size_t n) {
    size_t at = 0;
    out[0] = '\0';
    append(out, n, &at, "Z_");
    mangle(module, out, n, &at);
    append(out, n, &at, "Z_");
    mangle(name_, out, n, &at);
}
