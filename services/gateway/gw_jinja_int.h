/* gw_jinja_int.h — the chat-template interpreter's internals, shared by its files:
 *   gw_jinja_parse.c    source → tokens → syntax tree (gj_node), gw_jinja_parse/free;
 *   gw_jinja_value.c    run-time values (gj_val): lifetime, text and JSON forms, jansson input;
 *   gw_jinja.c          the renderer: scopes, expressions, statements, gw_jinja_render;
 *   gw_jinja_builtins.c filters, tests, methods and global functions.
 * Not part of the gateway's API (gw_jinja.h is). */
#ifndef GW_JINJA_INT_H
#define GW_JINJA_INT_H

#include "gw_jinja.h"

#include <stdbool.h>
#include <stddef.h>

/* ---- syntax tree ----------------------------------------------------------------------------- */

typedef enum gj_node_kind {
    /* statements */
    GJ_N_TEXT,   /* str: literal text */
    GJ_N_OUTPUT, /* a: expression of {{ }} */
    GJ_N_IF,     /* a: test; body; alt (an elif is one GJ_N_IF in alt) */
    GJ_N_FOR,    /* a: target (NAME or TUPLE); b: iterable; c: filter or NULL; body; alt: else */
    GJ_N_SET,    /* a: target; b: value, or NULL with body: block set */
    GJ_N_MACRO,  /* str: name; items: parameters (GJ_E_NAME or GJ_E_KWARG with default); body */
    GJ_N_BREAK,
    GJ_N_CONTINUE,
    /* expressions */
    GJ_E_INT,   /* i */
    GJ_E_FLOAT, /* f */
    GJ_E_STR,   /* str */
    GJ_E_NAME,  /* str */
    GJ_E_LIST,  /* items */
    GJ_E_TUPLE, /* items */
    GJ_E_DICT,  /* items: GJ_E_PAIR (a: key, b: value) */
    GJ_E_PAIR,
    GJ_E_ATTR,    /* a: object; str: name (a.name), or i with op 1 (a.0) */
    GJ_E_INDEX,   /* a: object; b: subscript */
    GJ_E_SLICE,   /* a: object; items: start, stop, step (NULL where omitted) */
    GJ_E_CALL,    /* a: callee; items: arguments (GJ_E_KWARG for name=value) */
    GJ_E_KWARG,   /* str: name; a: value */
    GJ_E_FILTER,  /* a: operand; str: filter name; op: gj_filter; items: arguments */
    GJ_E_TEST,    /* a: operand; str: test name; op: gj_test; i: 1 when negated (is not) */
    GJ_E_UNARY,   /* op: gj_op (NOT, NEG, POS); a */
    GJ_E_BINARY,  /* op: gj_op; a, b */
    GJ_E_TERNARY, /* a: value if b; c: else value */
    GJ_E_SELECT,  /* a if b (no else: undefined when b is false) */
} gj_node_kind;

typedef enum gj_op {
    GJ_OP_NONE,
    GJ_OP_OR,
    GJ_OP_AND,
    GJ_OP_NOT,
    GJ_OP_NEG,
    GJ_OP_POS,
    GJ_OP_EQ,
    GJ_OP_NE,
    GJ_OP_LT,
    GJ_OP_GT,
    GJ_OP_LE,
    GJ_OP_GE,
    GJ_OP_IN,
    GJ_OP_NOT_IN,
    GJ_OP_ADD,
    GJ_OP_SUB,
    GJ_OP_CONCAT,
    GJ_OP_MUL,
    GJ_OP_DIV,
    GJ_OP_FLOORDIV,
    GJ_OP_MOD,
    GJ_OP_POW,
} gj_op;

typedef struct gj_node gj_node;
typedef struct gj_nodes {
    gj_node **v;
    size_t n, cap;
} gj_nodes;

struct gj_node {
    gj_node_kind kind;
    int op, line;
    int height; /* 1 + the tallest child's; capped, so that evaluation recursion is bounded */
    char *str;
    size_t len;
    long long i;
    double f;
    gj_node *a, *b, *c;
    gj_nodes items, body, alt;
};

struct gw_jinja {
    gj_nodes body;
};

/* ---- run-time values ------------------------------------------------------------------------- */

typedef enum gj_kind {
    GJ_UNDEF,
    GJ_NONE,
    GJ_BOOL,
    GJ_INT,
    GJ_FLOAT,
    GJ_STR,
    GJ_LIST,
    GJ_DICT,
    GJ_NS,
    GJ_FUNC,
} gj_kind;

typedef enum gj_func { GJ_F_MACRO, GJ_F_RAISE, GJ_F_RANGE, GJ_F_NAMESPACE, GJ_F_STRFTIME } gj_func;

typedef struct gj_val gj_val;
struct gj_val {
    gj_kind kind;
    int refs;
    /* containers: 1 + the deepest element's depth; capped, so recursion over values is bounded */
    int depth;
    /* a namespace is inside; such a value may not be stored in a namespace, so no cycles form */
    bool has_ns;
    size_t size; /* bytes accounted to the render's live budget */
    union {
        bool b;
        long long i;
        double f;
        struct {
            char *p;
            size_t n;
        } s; /* n bytes of UTF-8, then a NUL */
        struct {
            gj_val **v;
            size_t n, cap;
        } l; /* GJ_LIST */
        struct {
            char **k;
            size_t *kn;
            gj_val **v;
            size_t n, cap;
        } d; /* GJ_DICT, GJ_NS: insertion order */
        struct {
            gj_func id;
            const gj_node *macro;
        } fn;
    } u;
};

#define GJ_MAX_VALUE_DEPTH 256

typedef struct gj_buf {
    char *p;
    size_t n, cap;
} gj_buf;

typedef struct gj_scope gj_scope;
struct gj_scope {
    gj_scope *parent;
    gj_val *vars; /* GJ_DICT */
};

/* One render's state. Every function that can fail returns NULL/-1 after gj_fail. */
typedef struct gj_ctx {
    char *err;
    size_t err_len;
    bool failed;
    int flow; /* 0, or GJ_FLOW_BREAK / GJ_FLOW_CONTINUE while unwinding to the loop */
    int macro_depth;
    size_t iterations, live_bytes, max_out;
    /* work done: one per expression evaluated or byte scanned, 1/64 per byte of string built */
    unsigned long long steps;
    gj_buf *out; /* where text goes: the result, or a capture (block set, macro) */
} gj_ctx;

enum { GJ_FLOW_BREAK = 1, GJ_FLOW_CONTINUE = 2 };

/* gw_jinja.c */
void gj_fail(gj_ctx *x, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int gj_buf_put(gj_ctx *x, gj_buf *b, const char *s, size_t n);
int gj_buf_puts(gj_ctx *x, gj_buf *b, const char *s);
gj_val *gj_eval(gj_ctx *x, gj_scope *sc, const gj_node *e);
gj_val *gj_call_macro(gj_ctx *x, gj_scope *sc, const gj_node *macro, gj_val **args, size_t n_args,
                      gj_val *kwargs, int line);
/* A call's arguments: positional ones into a new array, keyword ones into a new dict. */
int gj_eval_args(gj_ctx *x, gj_scope *sc, const gj_nodes *items, gj_val ***args, size_t *n_args,
                 gj_val **kwargs);
void gj_free_args(gj_ctx *x, gj_val **args, size_t n_args, gj_val *kwargs);

/* gw_jinja_value.c */
gj_val *gj_new(gj_ctx *x, gj_kind kind);
gj_val *gj_new_bool(gj_ctx *x, bool b);
gj_val *gj_new_int(gj_ctx *x, long long i);
gj_val *gj_new_float(gj_ctx *x, double f);
gj_val *gj_new_str(gj_ctx *x, const char *s, size_t n);
gj_val *gj_new_str_buf(gj_ctx *x, gj_buf *b); /* takes b's bytes */
gj_val *gj_ref(gj_val *v);
void gj_unref(gj_ctx *x, gj_val *v);
/* Both take the reference of item / v, also when they fail. */
int gj_list_push(gj_ctx *x, gj_val *list, gj_val *item);
int gj_dict_set(gj_ctx *x, gj_val *dict, const char *k, size_t kn, gj_val *v);
int gj_charge(gj_ctx *x, unsigned long long steps, int line);      /* -1 past GW_JINJA_MAX_STEPS */
gj_val *gj_dict_get(const gj_val *dict, const char *k, size_t kn); /* borrowed; NULL if absent */
bool gj_truthy(const gj_val *v);
bool gj_equal(const gj_val *a, const gj_val *b);
double gj_floor(double f); /* floor() without libm: the library links nothing but jansson */
/* The code point at s[i] (an invalid byte: U+FFFD); *w its bytes. */
unsigned gj_utf8_at(const char *s, size_t n, size_t i, size_t *w);
const char *gj_kind_name(gj_kind k);                           /* "integer" */
const char *gj_kind_a(gj_kind k);                              /* "an integer" */
int gj_write(gj_ctx *x, gj_buf *b, const gj_val *v, int line); /* the {{ }} form */
typedef struct gj_json_opts {
    long long indent; /* 0: none */
    bool ensure_ascii, sort_keys, undef_as_null;
    const char *item_sep, *key_sep; /* NULL: the defaults */
} gj_json_opts;
int gj_write_json(gj_ctx *x, gj_buf *b, const gj_val *v, const gj_json_opts *o, int depth,
                  int line);
int gj_write_number(gj_ctx *x, gj_buf *b, const gj_val *v, bool json);
gj_val *gj_from_json(gj_ctx *x, const json_t *j, int depth);

/* gw_jinja_builtins.c */
typedef enum gj_filter {
    GJ_FI_UNKNOWN,
    GJ_FI_ABS,
    GJ_FI_CAPITALIZE,
    GJ_FI_DEFAULT,
    GJ_FI_DICTSORT,
    GJ_FI_FIRST,
    GJ_FI_FLOAT,
    GJ_FI_INDENT,
    GJ_FI_INT,
    GJ_FI_ITEMS,
    GJ_FI_JOIN,
    GJ_FI_LAST,
    GJ_FI_LENGTH,
    GJ_FI_LIST,
    GJ_FI_LOWER,
    GJ_FI_MAP,
    GJ_FI_REJECT,
    GJ_FI_REJECTATTR,
    GJ_FI_REPLACE,
    GJ_FI_REVERSE,
    GJ_FI_SAFE,
    GJ_FI_SELECT,
    GJ_FI_SELECTATTR,
    GJ_FI_SORT,
    GJ_FI_STRING,
    GJ_FI_TITLE,
    GJ_FI_TOJSON,
    GJ_FI_TRIM,
    GJ_FI_UNIQUE,
    GJ_FI_UPPER,
} gj_filter;
typedef enum gj_test {
    GJ_TE_UNKNOWN,
    GJ_TE_BOOLEAN,
    GJ_TE_CALLABLE,
    GJ_TE_DEFINED,
    GJ_TE_EQ,
    GJ_TE_EVEN,
    GJ_TE_FALSE,
    GJ_TE_FLOAT,
    GJ_TE_INTEGER,
    GJ_TE_ITERABLE,
    GJ_TE_LOWER,
    GJ_TE_MAPPING,
    GJ_TE_NONE,
    GJ_TE_NUMBER,
    GJ_TE_ODD,
    GJ_TE_SEQUENCE,
    GJ_TE_STRING,
    GJ_TE_TRUE,
    GJ_TE_UNDEFINED,
    GJ_TE_UPPER,
} gj_test;
gj_filter gj_filter_lookup(const char *name);
gj_test gj_test_lookup(const char *name);
/* 1 (passes), 0, or -1 after an error; arg: the value of eq/equalto, else NULL. */
int gj_test_apply(gj_ctx *x, gj_test t, const gj_val *v, const gj_val *arg, int line);
gj_val *gj_filter_apply(gj_ctx *x, gj_scope *sc, const gj_node *e, gj_val *v); /* borrows v */
gj_val *gj_method_call(gj_ctx *x, gj_val *self, const char *name, gj_val **args, size_t n_args,
                       gj_val *kwargs, int line);
gj_val *gj_global_call(gj_ctx *x, gj_val *fn, gj_val **args, size_t n_args, gj_val *kwargs,
                       int line);
/* Is s[i] white space as JavaScript's \s (what trim strips)? *w: its bytes. */
bool gj_is_space_at(const char *s, size_t n, size_t i, size_t *w);

#endif
