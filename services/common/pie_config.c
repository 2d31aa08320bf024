/* pie_config.c — see pie_config.h.
 *
 * Owns: the schema check, the value syntax (one parser per type, shared by defaults, the file,
 * the environment and the schema's bounds), the walk over libyaml's document tree, and the
 * printers. Order of a load: check schema → clear members → defaults → file → environment →
 * required. Everything is per call; there is no global state. */
#include "pie_config.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <yaml.h>

#include "pie_file.h"
#include "pie_metrics.h" /* pie_metrics_format_double: the one shortest-round-trip formatter */
#include "pie_utf8.h"

#define CFG_MAX_FILE_BYTES ((size_t)1 << 20) /* a config file is a page or two; 1 MiB is plenty */
#define CFG_MAX_PATH 120                      /* longest field path in a schema */
#define CFG_SHOW_MAX 64                       /* bytes of an offending value quoted in messages */
#define CFG_ERR_MAX PIE_STATUS_MSG_MAX

/* ---- small helpers ------------------------------------------------------------------------ */

/* snprintf for messages, where cutting at the buffer's end is the intended behaviour. */
static void cfg_fmt(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void cfg_fmt(char *buf, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
}

/* Writes s[0..len) for a message: \ ' and control bytes escaped, cut at CFG_SHOW_MAX bytes. */
static void cfg_show(char *buf, size_t n, const char *s, size_t len) {
    size_t o = 0;
    if (n == 0) return;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        char tmp[8];
        size_t k;
        if (i == CFG_SHOW_MAX) {
            memcpy(tmp, "...", 3);
            k = 3;
            i = len; /* stop after this */
        } else if (c == '\\' || c == '\'') {
            tmp[0] = '\\';
            tmp[1] = (char)c;
            k = 2;
        } else if (c < 0x20 || c == 0x7f) {
            k = (size_t)snprintf(tmp, sizeof tmp, "\\x%02x", c);
        } else {
            tmp[0] = (char)c;
            k = 1;
        }
        if (o + k >= n) break;
        memcpy(buf + o, tmp, k);
        o += k;
    }
    buf[o] = '\0';
}

/* A YAML file can only hold UTF-8, so strings from defaults and the environment must be too
 * (or --print-config would write YAML that does not load). */
static bool cfg_utf8_valid(const char *s, size_t len) {
    uint32_t cp;
    for (size_t i = 0, k; i < len; i += k)
        if ((k = pie_utf8_next((const unsigned char *)s + i, len - i, &cp)) == 0) return false;
    return true;
}

static size_t cfg_member_bits(size_t size) { return size * 8u; }

static char *cfg_member(void *cfg, const pie_config_field *f) { return (char *)cfg + f->offset; }
static const char *cfg_cmember(const void *cfg, const pie_config_field *f) {
    return (const char *)cfg + f->offset;
}

static bool cfg_is_numeric(pie_config_type t) {
    return t == PIE_CFG_INT || t == PIE_CFG_UINT || t == PIE_CFG_SIZE || t == PIE_CFG_DURATION ||
           t == PIE_CFG_DOUBLE;
}

int pie_config_env_name(const char *path, char *buf, size_t n) {
    size_t len = strlen(path);
    if (n < len + 5) return -1;
    memcpy(buf, "PIE_", 4);
    for (size_t i = 0; i < len; i++) {
        char c = path[i];
        if (c == '.') c = '_';
        else if (c >= 'a' && c <= 'z') c = (char)(c - 'a' + 'A');
        buf[4 + i] = c;
    }
    buf[4 + len] = '\0';
    return 0;
}

/* ---- numbers -------------------------------------------------------------------------------- */

typedef union cfg_num {
    int64_t i;  /* INT, DURATION */
    uint64_t u; /* UINT, SIZE */
    double d;   /* DOUBLE */
} cfg_num;

typedef enum cfg_raw { RAW_OK, RAW_SYNTAX, RAW_OVERFLOW } cfg_raw;

/* Decimal digits at s[*i..len) → *v; RAW_SYNTAX if there are none. Advances *i. */
static cfg_raw cfg_digits(const char *s, size_t len, size_t *i, uint64_t *v) {
    size_t start = *i;
    bool over = false;
    uint64_t x = 0;
    while (*i < len && s[*i] >= '0' && s[*i] <= '9') {
        unsigned d = (unsigned)(s[*i] - '0');
        if (x > (UINT64_MAX - d) / 10) over = true;
        else x = x * 10 + d;
        (*i)++;
    }
    if (*i == start) return RAW_SYNTAX;
    *v = x;
    return over ? RAW_OVERFLOW : RAW_OK;
}

typedef struct cfg_unit {
    const char *name;
    uint64_t mult;
} cfg_unit;

static const cfg_unit size_units[] = {
    {"B", 1},
    {"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30}, {"TiB", 1ull << 40},
    {"Ki", 1ull << 10},  {"Mi", 1ull << 20},  {"Gi", 1ull << 30},  {"Ti", 1ull << 40},
    {"kB", 1000ull},     {"KB", 1000ull},     {"MB", 1000000ull},  {"GB", 1000000000ull},
    {"TB", 1000000000000ull},
};
static const cfg_unit duration_units[] = {
    {"ms", 1}, {"s", 1000}, {"m", 60000}, {"h", 3600000},
};

/* Digits followed by an optional unit from the table (exactly, to the end of the text). */
static cfg_raw cfg_scaled(const char *s, size_t len, const cfg_unit *units, size_t n_units,
                          uint64_t *v) {
    size_t i = 0;
    uint64_t x;
    cfg_raw r = cfg_digits(s, len, &i, &x);
    if (r == RAW_SYNTAX) return r;
    uint64_t mult = 1;
    if (i < len) {
        size_t k;
        for (k = 0; k < n_units; k++) {
            size_t ul = strlen(units[k].name);
            if (ul == len - i && memcmp(s + i, units[k].name, ul) == 0) break;
        }
        if (k == n_units) return RAW_SYNTAX;
        mult = units[k].mult;
    }
    if (r == RAW_OVERFLOW || (x != 0 && mult > UINT64_MAX / x)) return RAW_OVERFLOW;
    *v = x * mult;
    return RAW_OK;
}

/* The raw syntax of each numeric type, without bounds. */
static cfg_raw cfg_parse_num(pie_config_type t, const char *s, size_t len, cfg_num *v) {
    switch (t) {
    case PIE_CFG_INT: {
        size_t i = 0;
        bool neg = false;
        if (len > 0 && (s[0] == '-' || s[0] == '+')) {
            neg = s[0] == '-';
            i = 1;
        }
        uint64_t mag;
        cfg_raw r = cfg_digits(s, len, &i, &mag);
        if (r == RAW_SYNTAX || i != len) return RAW_SYNTAX;
        if (r == RAW_OVERFLOW) return RAW_OVERFLOW;
        if (neg) {
            if (mag > (uint64_t)INT64_MAX + 1) return RAW_OVERFLOW;
            v->i = mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag;
        } else {
            if (mag > (uint64_t)INT64_MAX) return RAW_OVERFLOW;
            v->i = (int64_t)mag;
        }
        return RAW_OK;
    }
    case PIE_CFG_UINT: {
        size_t i = 0;
        cfg_raw r = cfg_digits(s, len, &i, &v->u);
        if (r == RAW_SYNTAX || i != len) return RAW_SYNTAX;
        return r;
    }
    case PIE_CFG_SIZE:
        return cfg_scaled(s, len, size_units, sizeof size_units / sizeof size_units[0], &v->u);
    case PIE_CFG_DURATION: {
        uint64_t ms;
        cfg_raw r = cfg_scaled(s, len, duration_units,
                               sizeof duration_units / sizeof duration_units[0], &ms);
        if (r != RAW_OK) return r;
        if (ms > (uint64_t)INT64_MAX) return RAW_OVERFLOW;
        v->i = (int64_t)ms;
        return RAW_OK;
    }
    case PIE_CFG_DOUBLE: {
        char buf[CFG_SHOW_MAX];
        if (len == 0 || len >= sizeof buf) return RAW_SYNTAX;
        for (size_t i = 0; i < len; i++) { /* decimal only: no inf, nan, hex floats */
            if (!strchr("0123456789+-.eE", s[i]) || s[i] == '\0') return RAW_SYNTAX;
        }
        memcpy(buf, s, len);
        buf[len] = '\0';
        char *end;
        errno = 0;
        double d = strtod(buf, &end);
        if (end != buf + len) return RAW_SYNTAX;
        if (!isfinite(d)) return RAW_OVERFLOW;
        v->d = d;
        return RAW_OK;
    }
    default:
        return RAW_SYNTAX;
    }
}

/* The representable range of the member, before the schema's own bounds. */
static void cfg_limits(const pie_config_field *f, cfg_num *lo, cfg_num *hi) {
    size_t bits = cfg_member_bits(f->size);
    switch (f->type) {
    case PIE_CFG_INT:
        hi->i = bits >= 64 ? INT64_MAX : (int64_t)((UINT64_C(1) << (bits - 1)) - 1);
        lo->i = -hi->i - 1;
        break;
    case PIE_CFG_UINT:
    case PIE_CFG_SIZE:
        lo->u = 0;
        hi->u = bits >= 64 ? UINT64_MAX : (UINT64_C(1) << bits) - 1;
        break;
    case PIE_CFG_DURATION:
        lo->i = 0;
        hi->i = bits >= 64 ? INT64_MAX : (int64_t)((UINT64_C(1) << (bits - 1)) - 1);
        break;
    default:
        lo->d = -INFINITY;
        hi->d = INFINITY;
        break;
    }
}

/* -1, 0, 1 as a <, ==, > b in the type's arithmetic. */
static int cfg_cmp(pie_config_type t, cfg_num a, cfg_num b) {
    switch (t) {
    case PIE_CFG_INT:
    case PIE_CFG_DURATION: return (a.i > b.i) - (a.i < b.i);
    case PIE_CFG_UINT:
    case PIE_CFG_SIZE: return (a.u > b.u) - (a.u < b.u);
    default: return (a.d > b.d) - (a.d < b.d);
    }
}

/* Effective bounds: the schema's text when given (checked by cfg_check_field), else limits. */
static void cfg_bounds(const pie_config_field *f, cfg_num *lo, cfg_num *hi) {
    cfg_limits(f, lo, hi);
    if (f->min) (void)cfg_parse_num(f->type, f->min, strlen(f->min), lo);
    if (f->max) (void)cfg_parse_num(f->type, f->max, strlen(f->max), hi);
}

static void cfg_bound_text(const pie_config_field *f, bool upper, char *buf, size_t n) {
    const char *txt = upper ? f->max : f->min;
    if (txt) {
        snprintf(buf, n, "%s", txt);
        return;
    }
    cfg_num lo, hi;
    cfg_limits(f, &lo, &hi);
    cfg_num b = upper ? hi : lo;
    switch (f->type) {
    case PIE_CFG_INT:
    case PIE_CFG_DURATION: snprintf(buf, n, "%" PRId64, b.i); break;
    case PIE_CFG_UINT:
    case PIE_CFG_SIZE: snprintf(buf, n, "%" PRIu64, b.u); break;
    default: snprintf(buf, n, "%s", upper ? "inf" : "-inf"); break;
    }
}

static void cfg_store_num(const pie_config_field *f, char *dst, cfg_num v) {
    switch (f->type) {
    case PIE_CFG_INT:
    case PIE_CFG_DURATION:
        switch (f->size) {
        case 1: { int8_t x = (int8_t)v.i; memcpy(dst, &x, 1); break; }
        case 2: { int16_t x = (int16_t)v.i; memcpy(dst, &x, 2); break; }
        case 4: { int32_t x = (int32_t)v.i; memcpy(dst, &x, 4); break; }
        default: memcpy(dst, &v.i, 8); break;
        }
        break;
    case PIE_CFG_UINT:
    case PIE_CFG_SIZE:
        switch (f->size) {
        case 1: { uint8_t x = (uint8_t)v.u; memcpy(dst, &x, 1); break; }
        case 2: { uint16_t x = (uint16_t)v.u; memcpy(dst, &x, 2); break; }
        case 4: { uint32_t x = (uint32_t)v.u; memcpy(dst, &x, 4); break; }
        default: memcpy(dst, &v.u, 8); break;
        }
        break;
    default: memcpy(dst, &v.d, sizeof v.d); break;
    }
}

static cfg_num cfg_load_num(const pie_config_field *f, const char *src) {
    cfg_num v = {0};
    switch (f->type) {
    case PIE_CFG_INT:
    case PIE_CFG_DURATION:
        switch (f->size) {
        case 1: { int8_t x; memcpy(&x, src, 1); v.i = x; break; }
        case 2: { int16_t x; memcpy(&x, src, 2); v.i = x; break; }
        case 4: { int32_t x; memcpy(&x, src, 4); v.i = x; break; }
        default: memcpy(&v.i, src, 8); break;
        }
        break;
    case PIE_CFG_UINT:
    case PIE_CFG_SIZE:
        switch (f->size) {
        case 1: { uint8_t x; memcpy(&x, src, 1); v.u = x; break; }
        case 2: { uint16_t x; memcpy(&x, src, 2); v.u = x; break; }
        case 4: { uint32_t x; memcpy(&x, src, 4); v.u = x; break; }
        default: memcpy(&v.u, src, 8); break;
        }
        break;
    default: memcpy(&v.d, src, sizeof v.d); break;
    }
    return v;
}

/* ---- values --------------------------------------------------------------------------------- */

/* "<what>" of "expected <what>, got ..." */
static void cfg_expected(const pie_config_field *f, char *buf, size_t n) {
    switch (f->type) {
    case PIE_CFG_STRING: snprintf(buf, n, "string"); break;
    case PIE_CFG_INT: snprintf(buf, n, "integer"); break;
    case PIE_CFG_UINT: snprintf(buf, n, "non-negative integer"); break;
    case PIE_CFG_SIZE:
        snprintf(buf, n, "size (integer with optional unit B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)");
        break;
    case PIE_CFG_DURATION:
        snprintf(buf, n, "duration (integer with unit ms, s, m, h; bare integer = ms)");
        break;
    case PIE_CFG_DOUBLE: snprintf(buf, n, "number"); break;
    case PIE_CFG_BOOL: snprintf(buf, n, "true or false"); break;
    case PIE_CFG_ENUM: {
        size_t o = (size_t)snprintf(buf, n, "one of ");
        for (size_t k = 0; f->choices[k] && o < n; k++)
            o += (size_t)snprintf(buf + o, n - o, "%s%s", k ? ", " : "", f->choices[k]);
        break;
    }
    case PIE_CFG_STRLIST: snprintf(buf, n, "a sequence of strings"); break;
    }
}

static void cfg_err_got(const pie_config_field *f, char *err, size_t errn, const char *got) {
    char what[256];
    cfg_expected(f, what, sizeof what);
    cfg_fmt(err, errn, "expected %s, got %s", what, got);
}

static void cfg_err_got_text(const pie_config_field *f, char *err, size_t errn, const char *s,
                             size_t len) {
    char shown[CFG_SHOW_MAX * 4 + 8], got[sizeof shown + 2];
    cfg_show(shown, sizeof shown, s, len);
    cfg_fmt(got, sizeof got, "'%s'", shown);
    cfg_err_got(f, err, errn, got);
}

static void cfg_strlist_clear(pie_config_strlist *l) {
    for (size_t i = 0; i < l->n; i++) free(l->items[i]);
    free(l->items);
    l->items = NULL;
    l->n = 0;
}

static pie_code cfg_strlist_push(pie_config_strlist *l, const char *s, size_t len) {
    char **items = realloc(l->items, (l->n + 1) * sizeof *items);
    if (!items) return PIE_RESOURCE_EXHAUSTED;
    l->items = items;
    char *copy = strndup(s, len);
    if (!copy) return PIE_RESOURCE_EXHAUSTED;
    l->items[l->n++] = copy;
    return PIE_OK;
}

static void cfg_set_string_ptr(void *cfg, const pie_config_field *f, char *s) {
    char **slot = (char **)(void *)cfg_member(cfg, f);
    free(*slot);
    *slot = s;
}

/* Text form of a value (defaults, environment, bounds, file scalars) → the member. On a bad
 * value writes the message tail to err and returns PIE_INVALID_ARGUMENT. `list_text` allows
 * the comma-separated form of STRLIST (everywhere but the file). */
static pie_code cfg_set_text(const pie_config_field *f, void *cfg, const char *s, size_t len,
                             bool list_text, char *err, size_t errn) {
    switch (f->type) {
    case PIE_CFG_STRING: {
        if (memchr(s, '\0', len)) {
            snprintf(err, errn, "string contains a NUL byte");
            return PIE_INVALID_ARGUMENT;
        }
        if (!cfg_utf8_valid(s, len)) {
            snprintf(err, errn, "string is not valid UTF-8");
            return PIE_INVALID_ARGUMENT;
        }
        char *copy = strndup(s, len);
        if (!copy) return PIE_RESOURCE_EXHAUSTED;
        cfg_set_string_ptr(cfg, f, copy);
        return PIE_OK;
    }
    case PIE_CFG_STRLIST: {
        if (!list_text) {
            cfg_err_got_text(f, err, errn, s, len);
            return PIE_INVALID_ARGUMENT;
        }
        if (!cfg_utf8_valid(s, len)) {
            snprintf(err, errn, "string is not valid UTF-8");
            return PIE_INVALID_ARGUMENT;
        }
        pie_config_strlist fresh = {0};
        size_t i = 0;
        while (i <= len) {
            size_t j = i;
            while (j < len && s[j] != ',') j++;
            size_t a = i, b = j;
            while (a < b && (s[a] == ' ' || s[a] == '\t')) a++;
            while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t')) b--;
            if (b > a && cfg_strlist_push(&fresh, s + a, b - a) != PIE_OK) {
                cfg_strlist_clear(&fresh);
                return PIE_RESOURCE_EXHAUSTED;
            }
            i = j + 1;
        }
        pie_config_strlist *slot = (pie_config_strlist *)(void *)cfg_member(cfg, f);
        cfg_strlist_clear(slot);
        *slot = fresh;
        return PIE_OK;
    }
    case PIE_CFG_BOOL: {
        static const char *const yes[] = {"true", "True", "TRUE"};
        static const char *const no[] = {"false", "False", "FALSE"};
        for (int k = 0; k < 3; k++) {
            bool t = strlen(yes[k]) == len && memcmp(s, yes[k], len) == 0;
            bool fl = strlen(no[k]) == len && memcmp(s, no[k], len) == 0;
            if (t || fl) {
                bool v = t;
                memcpy(cfg_member(cfg, f), &v, sizeof v);
                return PIE_OK;
            }
        }
        cfg_err_got_text(f, err, errn, s, len);
        return PIE_INVALID_ARGUMENT;
    }
    case PIE_CFG_ENUM: {
        for (int k = 0; f->choices[k]; k++) {
            if (strlen(f->choices[k]) == len && memcmp(s, f->choices[k], len) == 0) {
                memcpy(cfg_member(cfg, f), &k, sizeof k);
                return PIE_OK;
            }
        }
        char shown[CFG_SHOW_MAX * 4 + 8], what[256];
        cfg_show(shown, sizeof shown, s, len);
        cfg_expected(f, what, sizeof what); /* "one of a, b" */
        cfg_fmt(err, errn, "'%s' is not %s", shown, what);
        return PIE_INVALID_ARGUMENT;
    }
    default: break;
    }
    /* numbers */
    cfg_num v, lo, hi;
    cfg_raw r = cfg_parse_num(f->type, s, len, &v);
    if (r == RAW_SYNTAX) {
        cfg_err_got_text(f, err, errn, s, len);
        return PIE_INVALID_ARGUMENT;
    }
    cfg_bounds(f, &lo, &hi);
    if (r == RAW_OVERFLOW || cfg_cmp(f->type, v, lo) < 0 || cfg_cmp(f->type, v, hi) > 0) {
        char shown[CFG_SHOW_MAX * 4 + 8], lot[64], hit[64];
        cfg_show(shown, sizeof shown, s, len);
        cfg_bound_text(f, false, lot, sizeof lot);
        cfg_bound_text(f, true, hit, sizeof hit);
        cfg_fmt(err, errn, "%s is out of range [%s, %s]", shown, lot, hit);
        return PIE_INVALID_ARGUMENT;
    }
    cfg_store_num(f, cfg_member(cfg, f), v);
    return PIE_OK;
}

/* ---- schema check --------------------------------------------------------------------------- */

static bool cfg_size_ok(const pie_config_field *f) {
    switch (f->type) {
    case PIE_CFG_STRING: return f->size == sizeof(char *);
    case PIE_CFG_INT:
    case PIE_CFG_UINT:
    case PIE_CFG_SIZE: return f->size == 1 || f->size == 2 || f->size == 4 || f->size == 8;
    case PIE_CFG_DURATION: return f->size == 4 || f->size == 8;
    case PIE_CFG_DOUBLE: return f->size == sizeof(double);
    case PIE_CFG_BOOL: return f->size == sizeof(bool);
    case PIE_CFG_ENUM: return f->size == sizeof(int);
    case PIE_CFG_STRLIST: return f->size == sizeof(pie_config_strlist);
    }
    return false;
}

static bool cfg_path_ok(const char *p) {
    size_t len = strlen(p);
    if (len == 0 || len > CFG_MAX_PATH || p[0] == '.' || p[len - 1] == '.') return false;
    for (size_t i = 0; i < len; i++) {
        char c = p[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
                  (c == '.' && p[i + 1] != '.');
        if (!ok) return false;
    }
    return true;
}

/* Length of the section that holds p[0..len): "server.tls.cert",15 → 10 ("server.tls");
 * "server.tls",10 → 6; "port",4 → 0 (top level). */
static size_t cfg_parent_len(const char *p, size_t len) {
    while (len > 0 && p[len - 1] != '.') len--;
    return len > 0 ? len - 1 : 0;
}

/* True if sec[0..len) is a section (a whole-segment prefix) of path p. */
static bool cfg_in_section(const char *p, const char *sec, size_t len) {
    return strncmp(p, sec, len) == 0 && p[len] == '.';
}

static pie_code cfg_check_field(const pie_config_schema *s, size_t i, pie_status *st) {
    const pie_config_field *f = &s->fields[i];
    const char *p = f->path ? f->path : "(null)";
#define BAD(...) pie_status_set(st, PIE_INTERNAL, "config schema: " __VA_ARGS__)
    if (!f->path || !cfg_path_ok(f->path))
        return BAD("%s: path must be dot-separated segments of [a-z0-9_], at most %d bytes", p,
                   CFG_MAX_PATH);
    if (f->type < PIE_CFG_STRING || f->type > PIE_CFG_STRLIST)
        return BAD("%s: unknown type %d", p, (int)f->type);
    if (!cfg_size_ok(f)) return BAD("%s: member size %zu does not fit the type", p, f->size);
    if (f->offset > s->struct_size || f->size > s->struct_size - f->offset)
        return BAD("%s: member at offset %zu lies outside the %zu-byte struct", p, f->offset,
                   s->struct_size);
    if (!f->doc || !f->doc[0] || strchr(f->doc, '\n'))
        return BAD("%s: doc must be one non-empty line", p);
    if ((f->type == PIE_CFG_ENUM) != (f->choices != NULL))
        return BAD("%s: choices are for ENUM fields, and ENUM fields need them", p);
    if (f->choices) {
        if (!f->choices[0]) return BAD("%s: choices are empty", p);
        for (size_t k = 0; f->choices[k]; k++) {
            if (!f->choices[k][0]) return BAD("%s: choice %zu is empty", p, k);
            if (k > INT32_MAX) return BAD("%s: too many choices", p);
        }
    }
    if ((f->min || f->max) && !cfg_is_numeric(f->type))
        return BAD("%s: min/max are for numeric fields", p);
    cfg_num lim_lo, lim_hi, lo, hi;
    cfg_limits(f, &lim_lo, &lim_hi);
    lo = lim_lo;
    hi = lim_hi;
    if (f->min && (cfg_parse_num(f->type, f->min, strlen(f->min), &lo) != RAW_OK ||
                   cfg_cmp(f->type, lo, lim_lo) < 0 || cfg_cmp(f->type, lo, lim_hi) > 0))
        return BAD("%s: bad min '%s'", p, f->min);
    if (f->max && (cfg_parse_num(f->type, f->max, strlen(f->max), &hi) != RAW_OK ||
                   cfg_cmp(f->type, hi, lim_lo) < 0 || cfg_cmp(f->type, hi, lim_hi) > 0))
        return BAD("%s: bad max '%s'", p, f->max);
    if (cfg_cmp(f->type, lo, hi) > 0) return BAD("%s: min is greater than max", p);
    if ((f->flags & PIE_CONFIG_REQUIRED) && f->def)
        return BAD("%s: a required field has no default", p);
    if ((f->flags & PIE_CONFIG_SECRET) && f->type != PIE_CFG_STRING)
        return BAD("%s: only strings can be secret", p);
    cfg_num zero = {0};
    if (!f->def && !(f->flags & PIE_CONFIG_REQUIRED) && cfg_is_numeric(f->type) &&
        (cfg_cmp(f->type, zero, lo) < 0 || cfg_cmp(f->type, zero, hi) > 0))
        return BAD("%s: without a default the value is 0, outside [min, max]", p);
    if (f->flags & ~(unsigned)(PIE_CONFIG_REQUIRED | PIE_CONFIG_SECRET))
        return BAD("%s: unknown flags 0x%x", p, f->flags);

    char env[CFG_MAX_PATH + 8], env2[CFG_MAX_PATH + 8];
    (void)pie_config_env_name(f->path, env, sizeof env);
    for (size_t j = 0; j < i; j++) {
        const pie_config_field *g = &s->fields[j];
        if (strcmp(g->path, f->path) == 0) return BAD("%s: listed twice", p);
        if (cfg_in_section(g->path, f->path, strlen(f->path)) ||
            cfg_in_section(f->path, g->path, strlen(g->path)))
            return BAD("%s: is both a key and a section with '%s'", p, g->path);
        (void)pie_config_env_name(g->path, env2, sizeof env2);
        if (strcmp(env, env2) == 0)
            return BAD("%s: shares environment variable %s with '%s'", p, env, g->path);
        if (f->offset < g->offset + g->size && g->offset < f->offset + f->size)
            return BAD("%s: member overlaps the member of '%s'", p, g->path);
    }
    /* Sections must be contiguous in the table so that printing yields each mapping once. */
    if (i > 0) {
        const char *prev = s->fields[i - 1].path;
        for (size_t sl = cfg_parent_len(p, strlen(p)); sl > 0; sl = cfg_parent_len(p, sl)) {
            if (cfg_in_section(prev, p, sl)) break; /* prev shares this section and its parents */
            for (size_t j = 0; j + 1 < i; j++)
                if (cfg_in_section(s->fields[j].path, p, sl))
                    return BAD("%s: fields of section '%.*s' must be listed together", p,
                               (int)sl, p);
        }
    }
#undef BAD
    return PIE_OK;
}

static pie_code cfg_check_schema(const pie_config_schema *s, pie_status *st) {
    if (!s || (s->n_fields > 0 && !s->fields))
        return pie_status_set(st, PIE_INTERNAL, "config schema: no field table");
    for (size_t i = 0; i < s->n_fields; i++) {
        pie_code rc = cfg_check_field(s, i, st);
        if (rc != PIE_OK) return rc;
    }
    return PIE_OK;
}

/* ---- loading -------------------------------------------------------------------------------- */

typedef struct cfg_load {
    const pie_config_schema *schema;
    void *cfg;
    const char *name;     /* the file, as named in messages */
    yaml_mark_t *file_at; /* per field: where the file set it (line SIZE_MAX: not set) */
    bool *set;            /* per field: given a non-null value by the file or the environment */
    pie_status *st;
} cfg_load;

static pie_code cfg_oom(pie_status *st) {
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
}

static pie_code cfg_fail_at(cfg_load *L, yaml_mark_t m, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static pie_code cfg_fail_at(cfg_load *L, yaml_mark_t m, const char *fmt, ...) {
    char tail[CFG_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tail, sizeof tail, fmt, ap);
    va_end(ap);
    return pie_status_set(L->st, PIE_INVALID_ARGUMENT, "%s:%zu:%zu: %s", L->name, m.line + 1,
                          m.column + 1, tail);
}

static const char *cfg_kind(const yaml_node_t *n) {
    switch (n->type) {
    case YAML_SCALAR_NODE: return "a scalar";
    case YAML_SEQUENCE_NODE: return "a sequence";
    case YAML_MAPPING_NODE: return "a mapping";
    default: return "nothing";
    }
}

/* YAML 1.2 core null: a plain `~`, `null`, `Null`, `NULL` or nothing at all. */
static bool cfg_is_null(const yaml_node_t *n) {
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return false;
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL"};
    for (size_t k = 0; k < sizeof nulls / sizeof nulls[0]; k++)
        if (n->data.scalar.length == strlen(nulls[k]) &&
            memcmp(n->data.scalar.value, nulls[k], n->data.scalar.length) == 0)
            return true;
    return false;
}

/* Field index of an exact path, or -1 with *section telling whether path is a section. */
static int cfg_find(const pie_config_schema *s, const char *path, size_t len, bool *section) {
    *section = false;
    for (size_t i = 0; i < s->n_fields; i++) {
        const char *fp = s->fields[i].path;
        size_t fl = strlen(fp);
        if (fl == len && memcmp(fp, path, len) == 0) return (int)i;
        if (fl > len && memcmp(fp, path, len) == 0 && fp[len] == '.') *section = true;
    }
    return -1;
}

static pie_code cfg_set_sequence(cfg_load *L, yaml_document_t *doc, const pie_config_field *f,
                                 yaml_node_t *v) {
    pie_config_strlist fresh = {0};
    pie_code rc = PIE_OK;
    yaml_node_item_t *start = v->data.sequence.items.start;
    for (yaml_node_item_t *it = start; it < v->data.sequence.items.top; it++) {
        yaml_node_t *item = yaml_document_get_node(doc, *it);
        size_t idx = (size_t)(it - start);
        if (!item) {
            rc = pie_status_set(L->st, PIE_INTERNAL, "libyaml returned a broken document");
            goto fail;
        }
        if (item->type != YAML_SCALAR_NODE || cfg_is_null(item)) {
            rc = cfg_fail_at(L, item->start_mark, "%s[%zu]: expected string, got %s", f->path,
                             idx, cfg_is_null(item) ? "null" : cfg_kind(item));
            goto fail;
        }
        const char *s = (const char *)item->data.scalar.value;
        size_t len = item->data.scalar.length;
        if (memchr(s, '\0', len)) {
            rc = cfg_fail_at(L, item->start_mark, "%s[%zu]: string contains a NUL byte", f->path,
                             idx);
            goto fail;
        }
        if (cfg_strlist_push(&fresh, s, len) != PIE_OK) {
            rc = cfg_oom(L->st);
            goto fail;
        }
    }
    pie_config_strlist *slot = (pie_config_strlist *)(void *)cfg_member(L->cfg, f);
    cfg_strlist_clear(slot);
    *slot = fresh;
    return PIE_OK;
fail:
    cfg_strlist_clear(&fresh);
    return rc;
}

/* A leaf's value node → the member. */
static pie_code cfg_set_node(cfg_load *L, yaml_document_t *doc, size_t fi, yaml_node_t *v) {
    const pie_config_field *f = &L->schema->fields[fi];
    char err[CFG_ERR_MAX];
    pie_code rc;
    if (v->type == YAML_SEQUENCE_NODE && f->type == PIE_CFG_STRLIST) {
        rc = cfg_set_sequence(L, doc, f, v);
        L->set[fi] = rc == PIE_OK;
        return rc;
    }
    if (cfg_is_null(v) && f->type == PIE_CFG_STRING) {
        cfg_set_string_ptr(L->cfg, f, NULL);
        L->set[fi] = false;
        return PIE_OK;
    }
    if (cfg_is_null(v) && f->type == PIE_CFG_STRLIST) {
        cfg_strlist_clear((pie_config_strlist *)(void *)cfg_member(L->cfg, f));
        L->set[fi] = false;
        return PIE_OK;
    }
    if (cfg_is_null(v)) {
        cfg_err_got(f, err, sizeof err, "null");
        rc = PIE_INVALID_ARGUMENT;
    } else if (v->type != YAML_SCALAR_NODE) {
        cfg_err_got(f, err, sizeof err, cfg_kind(v));
        rc = PIE_INVALID_ARGUMENT;
    } else {
        rc = cfg_set_text(f, L->cfg, (const char *)v->data.scalar.value, v->data.scalar.length,
                          false, err, sizeof err);
    }
    if (rc == PIE_RESOURCE_EXHAUSTED) return cfg_oom(L->st);
    if (rc != PIE_OK) return cfg_fail_at(L, v->start_mark, "%s: %s", f->path, err);
    L->set[fi] = true;
    return PIE_OK;
}

/* One mapping of the document whose keys extend `prefix` (a section, or "" at the top). */
static pie_code cfg_walk(cfg_load *L, yaml_document_t *doc, yaml_node_t *map, const char *prefix,
                         size_t plen) {
    yaml_node_pair_t *start = map->data.mapping.pairs.start;
    for (yaml_node_pair_t *pair = start; pair < map->data.mapping.pairs.top; pair++) {
        yaml_node_t *k = yaml_document_get_node(doc, pair->key);
        yaml_node_t *v = yaml_document_get_node(doc, pair->value);
        if (!k || !v) return pie_status_set(L->st, PIE_INTERNAL, "libyaml returned a broken document");
        if (k->type != YAML_SCALAR_NODE)
            return cfg_fail_at(L, k->start_mark, "mapping keys must be scalars, got %s",
                               cfg_kind(k));
        const char *ks = (const char *)k->data.scalar.value;
        size_t kl = k->data.scalar.length;
        char full[CFG_MAX_PATH + 1];
        size_t fl = plen + (plen ? 1 : 0) + kl;
        bool section = false;
        int fi = -1;
        if (fl <= CFG_MAX_PATH) {
            memcpy(full, prefix, plen);
            if (plen) full[plen] = '.';
            memcpy(full + fl - kl, ks, kl);
            full[fl] = '\0';
            fi = cfg_find(L->schema, full, fl, &section);
        }
        if (fi < 0 && !section) {
            char shown[CFG_SHOW_MAX * 4 + 8];
            cfg_show(shown, sizeof shown, ks, kl);
            return cfg_fail_at(L, k->start_mark, "unknown key '%s%s%s'", prefix, plen ? "." : "",
                               shown);
        }
        /* Every earlier key of this mapping is known (or we would have stopped), so this scan is
         * bounded by the schema, not by the file. */
        for (yaml_node_pair_t *q = start; q < pair; q++) {
            yaml_node_t *k2 = yaml_document_get_node(doc, q->key);
            if (k2 && k2->type == YAML_SCALAR_NODE && k2->data.scalar.length == kl &&
                memcmp(k2->data.scalar.value, ks, kl) == 0)
                return cfg_fail_at(L, k->start_mark, "duplicate key '%s' (first at %zu:%zu)", full,
                                   k2->start_mark.line + 1, k2->start_mark.column + 1);
        }
        pie_code rc;
        if (fi >= 0) {
            yaml_mark_t *first = &L->file_at[fi];
            if (first->line != SIZE_MAX)
                return cfg_fail_at(L, k->start_mark, "duplicate key '%s' (first at %zu:%zu)", full,
                                   first->line + 1, first->column + 1);
            *first = k->start_mark;
            rc = cfg_set_node(L, doc, (size_t)fi, v);
        } else if (cfg_is_null(v)) {
            rc = PIE_OK; /* `server:` with everything under it commented out */
        } else if (v->type != YAML_MAPPING_NODE) {
            rc = cfg_fail_at(L, v->start_mark, "%s: expected a mapping, got %s", full,
                             cfg_kind(v));
        } else {
            rc = cfg_walk(L, doc, v, full, fl);
        }
        if (rc != PIE_OK) return rc;
    }
    return PIE_OK;
}

static pie_code cfg_yaml_error(cfg_load *L, const yaml_parser_t *p, const char *text,
                               size_t len) {
    if (p->error == YAML_MEMORY_ERROR) return cfg_oom(L->st);
    yaml_mark_t m = p->problem_mark;
    if (p->error == YAML_READER_ERROR) { /* the reader reports a byte offset, not a mark */
        m.line = m.column = 0;
        for (size_t i = 0; i < p->problem_offset && i < len; i++) {
            if (text[i] == '\n') {
                m.line++;
                m.column = 0;
            } else if (((unsigned char)text[i] & 0xc0) != 0x80) {
                m.column++; /* count characters, as libyaml's marks do */
            }
        }
    }
    const char *problem = p->problem ? p->problem : "unknown problem";
    if (p->context)
        return cfg_fail_at(L, m, "YAML syntax error: %s (%s at %zu:%zu)", problem, p->context,
                           p->context_mark.line + 1, p->context_mark.column + 1);
    return cfg_fail_at(L, m, "YAML syntax error: %s", problem);
}

static pie_code cfg_apply_yaml(cfg_load *L, const char *text, size_t len) {
    yaml_parser_t parser;
    yaml_document_t doc, next;
    pie_code rc = PIE_OK;
    if (!yaml_parser_initialize(&parser)) return cfg_oom(L->st);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) { /* libyaml frees the document on failure */
        rc = cfg_yaml_error(L, &parser, text, len);
        goto out_parser;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root) goto out_doc; /* an empty stream: defaults only */
    if (root->type == YAML_MAPPING_NODE)
        rc = cfg_walk(L, &doc, root, "", 0);
    else if (!cfg_is_null(root))
        rc = cfg_fail_at(L, root->start_mark, "expected a mapping at the top level, got %s",
                         cfg_kind(root));
    if (rc != PIE_OK) goto out_doc;
    if (!yaml_parser_load(&parser, &next)) {
        rc = cfg_yaml_error(L, &parser, text, len);
        goto out_doc;
    }
    if (yaml_document_get_root_node(&next))
        rc = cfg_fail_at(L, next.start_mark, "expected a single YAML document, found another");
    yaml_document_delete(&next);
out_doc:
    yaml_document_delete(&doc);
out_parser:
    yaml_parser_delete(&parser);
    return rc;
}

static pie_code cfg_apply_env(cfg_load *L, char *const *envp) {
    const pie_config_schema *s = L->schema;
    for (size_t i = 0; i < s->n_fields; i++) {
        const pie_config_field *f = &s->fields[i];
        char name[CFG_MAX_PATH + 8], err[CFG_ERR_MAX];
        (void)pie_config_env_name(f->path, name, sizeof name); /* fits: checked paths */
        size_t nl = strlen(name);
        const char *val = NULL;
        for (char *const *e = envp; *e; e++) { /* the first match, as getenv does */
            if (strncmp(*e, name, nl) == 0 && (*e)[nl] == '=') {
                val = *e + nl + 1;
                break;
            }
        }
        if (!val) continue;
        pie_code rc = cfg_set_text(f, L->cfg, val, strlen(val), true, err, sizeof err);
        if (rc == PIE_RESOURCE_EXHAUSTED) return cfg_oom(L->st);
        if (rc != PIE_OK)
            return pie_status_set(L->st, PIE_INVALID_ARGUMENT, "environment %s: %s", name, err);
        L->set[i] = true;
    }
    return PIE_OK;
}

static pie_code cfg_apply_defaults(cfg_load *L) {
    const pie_config_schema *s = L->schema;
    for (size_t i = 0; i < s->n_fields; i++) {
        const pie_config_field *f = &s->fields[i];
        char err[CFG_ERR_MAX];
        if (!f->def) continue;
        pie_code rc = cfg_set_text(f, L->cfg, f->def, strlen(f->def), true, err, sizeof err);
        if (rc == PIE_RESOURCE_EXHAUSTED) return cfg_oom(L->st);
        if (rc != PIE_OK)
            return pie_status_set(L->st, PIE_INTERNAL, "config schema: %s: bad default: %s",
                                  f->path, err);
    }
    return PIE_OK;
}

static pie_code cfg_check_required(cfg_load *L) {
    const pie_config_schema *s = L->schema;
    for (size_t i = 0; i < s->n_fields; i++) {
        const pie_config_field *f = &s->fields[i];
        if (!(f->flags & PIE_CONFIG_REQUIRED) || L->set[i]) continue;
        char name[CFG_MAX_PATH + 8];
        (void)pie_config_env_name(f->path, name, sizeof name);
        return pie_status_set(L->st, PIE_INVALID_ARGUMENT,
                              "missing required key '%s' (set it in the config file or with %s)",
                              f->path, name);
    }
    return PIE_OK;
}

/* Zero every member (NULL strings, empty lists) without freeing: what was there is not ours. */
static void cfg_clear(const pie_config_schema *s, void *cfg) {
    for (size_t i = 0; i < s->n_fields; i++) {
        const pie_config_field *f = &s->fields[i];
        memset(cfg_member(cfg, f), 0, f->size);
        if (f->type == PIE_CFG_STRING) *(char **)(void *)cfg_member(cfg, f) = NULL;
        if (f->type == PIE_CFG_STRLIST)
            *(pie_config_strlist *)(void *)cfg_member(cfg, f) = (pie_config_strlist){NULL, 0};
    }
}

void pie_config_free(const pie_config_schema *schema, void *cfg) {
    if (!schema || !cfg) return;
    for (size_t i = 0; i < schema->n_fields; i++) {
        const pie_config_field *f = &schema->fields[i];
        if (f->type == PIE_CFG_STRING) cfg_set_string_ptr(cfg, f, NULL);
        if (f->type == PIE_CFG_STRLIST)
            cfg_strlist_clear((pie_config_strlist *)(void *)cfg_member(cfg, f));
    }
}

static pie_code cfg_load_text(const pie_config_schema *schema, void *out, const char *name,
                         const char *text, size_t len, char *const *envp, pie_status *st) {
    pie_code rc = cfg_check_schema(schema, st);
    if (rc != PIE_OK) return rc;
    cfg_clear(schema, out);
    size_t n = schema->n_fields ? schema->n_fields : 1;
    cfg_load L = {schema, out, name, calloc(n, sizeof(yaml_mark_t)), calloc(n, sizeof(bool)), st};
    if (!L.file_at || !L.set) {
        rc = cfg_oom(st);
        goto done;
    }
    for (size_t i = 0; i < schema->n_fields; i++) L.file_at[i].line = SIZE_MAX;
    rc = cfg_apply_defaults(&L);
    if (rc == PIE_OK && text) rc = cfg_apply_yaml(&L, text, len);
    if (rc == PIE_OK && envp) rc = cfg_apply_env(&L, envp);
    if (rc == PIE_OK) rc = cfg_check_required(&L);
done:
    free(L.file_at);
    free(L.set);
    if (rc != PIE_OK) pie_config_free(schema, out);
    else pie_status_ok(st);
    return rc;
}

pie_code pie_config_load_buffer(const pie_config_schema *schema, void *out, const char *name,
                                const char *text, size_t len, char *const *envp,
                                pie_status *st) {
    return cfg_load_text(schema, out, name ? name : "<config>", text ? text : "", text ? len : 0, envp,
                    st);
}

pie_code pie_config_load(const pie_config_schema *schema, void *out, const char *path,
                         char *const *envp, pie_status *st) {
    if (!path) return cfg_load_text(schema, out, "<defaults>", NULL, 0, envp, st);
    pie_code rc = cfg_check_schema(schema, st); /* before touching the file system */
    if (rc != PIE_OK) return rc;
    char *text = NULL;
    size_t len = 0;
    rc = pie_file_read(path, "config", CFG_MAX_FILE_BYTES, &text, &len, st);
    if (rc != PIE_OK) {
        cfg_clear(schema, out);
        return rc;
    }
    rc = cfg_load_text(schema, out, path, text, len, envp, st);
    free(text);
    return rc;
}

/* ---- printing ------------------------------------------------------------------------------- */

/* A double-quoted YAML scalar that loads back to s: escapes for what YAML does not allow raw
 * (C0 and C1 controls, DEL, the BOM, U+FFFE/U+FFFF) or would fold as a line break (NEL, LS,
 * PS). A byte that is not UTF-8 (a member not set by the loader) becomes \xNN, i.e. U+00NN. */
static void cfg_put_quoted(FILE *f, const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    size_t len = strlen(s);
    fputc('"', f);
    for (size_t i = 0, k; i < len; i += k) {
        uint32_t cp;
        k = pie_utf8_next(p + i, len - i, &cp);
        if (k == 0) {
            fprintf(f, "\\x%02x", p[i]);
            k = 1;
        } else if (cp == '"' || cp == '\\') {
            fprintf(f, "\\%c", (char)cp);
        } else if (cp < 0x20 || (cp >= 0x7f && cp <= 0x9f)) {
            fprintf(f, "\\x%02x", (unsigned)cp);
        } else if (cp == 0x2028 || cp == 0x2029 || cp == 0xfeff || cp == 0xfffe || cp == 0xffff) {
            fprintf(f, "\\u%04x", (unsigned)cp);
        } else {
            fwrite(p + i, 1, k, f);
        }
    }
    fputc('"', f);
}

static void cfg_put_scaled(FILE *f, uint64_t v, const cfg_unit *units, size_t n_units) {
    for (size_t k = n_units; v != 0 && k-- > 0;) {
        if (units[k].mult > 1 && v % units[k].mult == 0) {
            fprintf(f, "%" PRIu64 "%s", v / units[k].mult, units[k].name);
            return;
        }
    }
    fprintf(f, "%" PRIu64, v);
}

static void cfg_put_value(FILE *f, const pie_config_field *fd, const void *cfg) {
    const char *m = cfg_cmember(cfg, fd);
    switch (fd->type) {
    case PIE_CFG_STRING: {
        const char *s;
        memcpy(&s, m, sizeof s);
        if (!s) fputs("null", f);
        else if ((fd->flags & PIE_CONFIG_SECRET) && s[0]) fputs("\"<redacted>\"", f);
        else cfg_put_quoted(f, s);
        break;
    }
    case PIE_CFG_INT: fprintf(f, "%" PRId64, cfg_load_num(fd, m).i); break;
    case PIE_CFG_UINT: fprintf(f, "%" PRIu64, cfg_load_num(fd, m).u); break;
    case PIE_CFG_SIZE:
        /* binary units only (KiB..TiB, table entries 1-4): the decimal ones would print 1000 as 1kB */
        cfg_put_scaled(f, cfg_load_num(fd, m).u, size_units, 5);
        break;
    case PIE_CFG_DURATION: {
        int64_t ms = cfg_load_num(fd, m).i;
        if (ms == 0) fputs("0ms", f);
        else if (ms < 0) fprintf(f, "%" PRId64, ms); /* not loadable: the caller wrote it */
        else if (ms % 1000 != 0) fprintf(f, "%" PRId64 "ms", ms);
        else cfg_put_scaled(f, (uint64_t)ms, duration_units, 4);
        break;
    }
    case PIE_CFG_DOUBLE: {
        char buf[64];
        pie_metrics_format_double(buf, sizeof buf, cfg_load_num(fd, m).d);
        fputs(buf, f);
        break;
    }
    case PIE_CFG_BOOL: {
        bool b;
        memcpy(&b, m, sizeof b);
        fputs(b ? "true" : "false", f);
        break;
    }
    case PIE_CFG_ENUM: {
        int k;
        memcpy(&k, m, sizeof k);
        size_t n = 0;
        while (fd->choices[n]) n++;
        if (k >= 0 && (size_t)k < n) fputs(fd->choices[k], f);
        else fprintf(f, "%d", k); /* not loadable: the caller wrote it */
        break;
    }
    case PIE_CFG_STRLIST: {
        const pie_config_strlist *l = (const pie_config_strlist *)(const void *)m;
        fputc('[', f);
        for (size_t i = 0; i < l->n; i++) {
            if (i) fputs(", ", f);
            cfg_put_quoted(f, l->items[i]);
        }
        fputc(']', f);
        break;
    }
    }
}

static pie_code cfg_flush(FILE *f, pie_status *st) {
    if (fflush(f) != 0 || ferror(f)) {
        char eb[128];
        return pie_status_set(st, PIE_INTERNAL, "cannot write the configuration: %s",
                              strerror_r(errno, eb, sizeof eb));
    }
    pie_status_ok(st);
    return PIE_OK;
}

pie_code pie_config_print(const pie_config_schema *schema, const void *cfg, FILE *f,
                          pie_status *st) {
    pie_code rc = cfg_check_schema(schema, st);
    if (rc != PIE_OK) return rc;
    for (size_t i = 0; i < schema->n_fields; i++) {
        const pie_config_field *fd = &schema->fields[i];
        const char *p = fd->path, *prev = i ? schema->fields[i - 1].path : "";
        size_t depth = 0, start = 0;
        bool shared = i > 0;
        for (size_t k = 0; p[k]; k++) {
            if (p[k] != '.') continue;
            if (shared && cfg_in_section(prev, p, k)) {
                depth++;
                start = k + 1;
                continue;
            }
            shared = false;
            if (depth == 0 && i > 0) fputc('\n', f);
            fprintf(f, "%*s%.*s:\n", (int)(2 * depth), "", (int)(k - start), p + start);
            depth++;
            start = k + 1;
        }
        char env[CFG_MAX_PATH + 8];
        (void)pie_config_env_name(p, env, sizeof env);
        fprintf(f, "%*s# %s (env %s)\n", (int)(2 * depth), "", fd->doc, env);
        fprintf(f, "%*s%s: ", (int)(2 * depth), "", p + start);
        cfg_put_value(f, fd, cfg);
        fputc('\n', f);
    }
    return cfg_flush(f, st);
}

/* s with '|' escaped, for a Markdown table cell. */
static void cfg_put_cell(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '|') fputc('\\', f);
        fputc(*s, f);
    }
}

pie_code pie_config_print_docs(const pie_config_schema *schema, FILE *f, pie_status *st) {
    pie_code rc = cfg_check_schema(schema, st);
    if (rc != PIE_OK) return rc;
    fputs("| Key | Environment | Type | Default | Description |\n", f);
    fputs("| --- | --- | --- | --- | --- |\n", f);
    for (size_t i = 0; i < schema->n_fields; i++) {
        const pie_config_field *fd = &schema->fields[i];
        char env[CFG_MAX_PATH + 8], type[512], lo[64], hi[64];
        (void)pie_config_env_name(fd->path, env, sizeof env);
        switch (fd->type) {
        case PIE_CFG_STRING: snprintf(type, sizeof type, "string"); break;
        case PIE_CFG_INT: snprintf(type, sizeof type, "integer"); break;
        case PIE_CFG_UINT: snprintf(type, sizeof type, "non-negative integer"); break;
        case PIE_CFG_SIZE: snprintf(type, sizeof type, "size"); break;
        case PIE_CFG_DURATION: snprintf(type, sizeof type, "duration"); break;
        case PIE_CFG_DOUBLE: snprintf(type, sizeof type, "number"); break;
        case PIE_CFG_BOOL: snprintf(type, sizeof type, "bool"); break;
        case PIE_CFG_ENUM: cfg_expected(fd, type, sizeof type); break;
        case PIE_CFG_STRLIST: snprintf(type, sizeof type, "list of strings"); break;
        }
        if (fd->min || fd->max) {
            size_t o = strlen(type);
            cfg_bound_text(fd, false, lo, sizeof lo);
            cfg_bound_text(fd, true, hi, sizeof hi);
            snprintf(type + o, sizeof type - o, " in [%s, %s]", lo, hi);
        }
        fprintf(f, "| `%s` | `%s` | ", fd->path, env);
        cfg_put_cell(f, type);
        fputs(" | ", f);
        if (fd->flags & PIE_CONFIG_REQUIRED) {
            fputs("required", f);
        } else if (fd->def) {
            fputc('`', f);
            cfg_put_cell(f, fd->def);
            fputc('`', f);
        } else {
            fputs("(none)", f);
        }
        fputs(" | ", f);
        cfg_put_cell(f, fd->doc);
        fputs(" |\n", f);
    }
    return cfg_flush(f, st);
}
