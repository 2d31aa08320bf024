/* pie_metrics.c — see pie_metrics.h.
 *
 * Layout: the registry holds a list of families; a family holds a list of series; each
 * series' values live in their own cache-line-aligned cell (pie_counter / pie_gauge /
 * pie_histogram) so that hot counters updated by different threads do not share a line.
 * Doubles are kept as their bit patterns in _Atomic uint64_t and updated by CAS. */
#include "pie_metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MET_CACHE_LINE 64

struct pie_counter {
    _Atomic uint64_t v;
};

struct pie_gauge {
    _Atomic uint64_t bits; /* a double */
};

struct pie_histogram {
    const double *bounds;     /* the family's, [n_bounds] */
    size_t n_bounds;
    _Atomic uint64_t sum_bits; /* a double */
    _Atomic uint64_t counts[]; /* [n_bounds + 1], per bucket (not cumulative); last is +Inf */
};

typedef enum met_kind { MET_COUNTER, MET_GAUGE, MET_HISTOGRAM } met_kind;

typedef struct met_series {
    struct met_series *next;
    char *values[PIE_METRICS_MAX_LABELS];
    void *cell; /* pie_counter | pie_gauge | pie_histogram */
} met_series;

typedef struct met_family {
    struct met_family *next;
    char *name, *help;
    met_kind kind;
    size_t n_labels;
    char *labels[PIE_METRICS_MAX_LABELS];
    double *bounds; /* histograms: [n_bounds] */
    size_t n_bounds;
    size_t n_series;
    met_series *series, **series_tail;
} met_family;

typedef struct met_collector {
    void (*fn)(void *arg);
    void *arg;
} met_collector;

struct pie_metrics {
    pthread_mutex_t mu; /* guards the lists and collectors, never the values */
    met_family *families, **tail;
    met_collector collectors[PIE_METRICS_MAX_COLLECTORS];
    size_t n_collectors;
};

static const char *const kind_names[] = {"counter", "gauge", "histogram"};

/* A default mutex fails to lock or unlock only when misused (EINVAL, EPERM); that is a bug in
 * this file, and carrying on would corrupt the registry. */
static void met_lock(pie_metrics *m) {
    if (pthread_mutex_lock(&m->mu) != 0) abort();
}

static void met_unlock(pie_metrics *m) {
    if (pthread_mutex_unlock(&m->mu) != 0) abort();
}

/* ---- doubles in atomics --------------------------------------------------------------------- */

static uint64_t met_bits(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

static double met_double(uint64_t u) {
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

static void met_atomic_add_double(_Atomic uint64_t *a, double delta) {
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(a, &old, met_bits(met_double(old) + delta),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

/* ---- hot path ------------------------------------------------------------------------------- */

void pie_counter_add(pie_counter *c, uint64_t n) {
    if (c) atomic_fetch_add_explicit(&c->v, n, memory_order_relaxed);
}

uint64_t pie_counter_value(const pie_counter *c) {
    return c ? atomic_load_explicit(&((pie_counter *)c)->v, memory_order_relaxed) : 0;
}

void pie_gauge_set(pie_gauge *g, double v) {
    if (g) atomic_store_explicit(&g->bits, met_bits(v), memory_order_relaxed);
}

void pie_gauge_add(pie_gauge *g, double delta) {
    if (g) met_atomic_add_double(&g->bits, delta);
}

double pie_gauge_value(const pie_gauge *g) {
    return g ? met_double(atomic_load_explicit(&((pie_gauge *)g)->bits, memory_order_relaxed))
             : 0.0;
}

void pie_histogram_observe(pie_histogram *h, double v) {
    if (!h) return;
    size_t lo = 0, hi = h->n_bounds; /* first i with v <= bounds[i]; n_bounds = +Inf */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v <= h->bounds[mid]) hi = mid;
        else lo = mid + 1;
    }
    atomic_fetch_add_explicit(&h->counts[lo], 1, memory_order_relaxed);
    met_atomic_add_double(&h->sum_bits, v);
}

uint64_t pie_histogram_count(const pie_histogram *h) {
    uint64_t n = 0;
    if (!h) return 0;
    for (size_t i = 0; i <= h->n_bounds; i++)
        n += atomic_load_explicit(&((pie_histogram *)h)->counts[i], memory_order_relaxed);
    return n;
}

double pie_histogram_sum(const pie_histogram *h) {
    return h ? met_double(atomic_load_explicit(&((pie_histogram *)h)->sum_bits,
                                               memory_order_relaxed))
             : 0.0;
}

void pie_metrics_exponential_bounds(double start, double factor, size_t n, double *out) {
    double b = start;
    for (size_t i = 0; i < n; i++) {
        out[i] = b;
        b *= factor;
    }
}

/* ---- registry ------------------------------------------------------------------------------- */

pie_metrics *pie_metrics_create(void) {
    pie_metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    if (pthread_mutex_init(&m->mu, NULL) != 0) {
        free(m);
        return NULL;
    }
    m->tail = &m->families;
    return m;
}

static void met_series_free(met_series *s, size_t n_labels) {
    for (size_t i = 0; i < n_labels; i++) free(s->values[i]);
    free(s->cell);
    free(s);
}

static void met_family_free(met_family *f) {
    for (met_series *s = f->series, *next; s; s = next) {
        next = s->next;
        met_series_free(s, f->n_labels);
    }
    for (size_t i = 0; i < f->n_labels; i++) free(f->labels[i]);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f);
}

void pie_metrics_destroy(pie_metrics *m) {
    if (!m) return;
    for (met_family *f = m->families, *next; f; f = next) {
        next = f->next;
        met_family_free(f);
    }
    (void)pthread_mutex_destroy(&m->mu); /* fails only if locked: a caller bug we cannot fix */
    free(m);
}

pie_code pie_metrics_add_collector(pie_metrics *m, void (*fn)(void *arg), void *arg,
                                   pie_status *st) {
    if (!m || !fn) return pie_status_set(st, PIE_INVALID_ARGUMENT, "metrics: collector is NULL");
    pie_code rc = PIE_OK;
    met_lock(m);
    if (m->n_collectors == PIE_METRICS_MAX_COLLECTORS)
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "metrics: more than %d collectors",
                            PIE_METRICS_MAX_COLLECTORS);
    else m->collectors[m->n_collectors++] = (met_collector){fn, arg};
    met_unlock(m);
    if (rc == PIE_OK) pie_status_ok(st);
    return rc;
}

static bool met_name_ok(const char *s, bool colon) {
    if (!s || !*s) return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                  (colon && c == ':') || (i > 0 && c >= '0' && c <= '9');
        if (!ok) return false;
    }
    return true;
}

static bool met_utf8_ok(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        size_t n;
        unsigned min;
        if (c < 0x80) { p++; continue; }
        if ((c & 0xe0) == 0xc0) { n = 1; min = 0x80; c &= 0x1f; }
        else if ((c & 0xf0) == 0xe0) { n = 2; min = 0x800; c &= 0x0f; }
        else if ((c & 0xf8) == 0xf0) { n = 3; min = 0x10000; c &= 0x07; }
        else return false;
        for (size_t i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80) return false;
            c = (c << 6) | (p[i] & 0x3fu);
        }
        if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return false;
        p += n + 1;
    }
    return true;
}

static met_family *met_find(pie_metrics *m, const char *name) {
    for (met_family *f = m->families; f; f = f->next)
        if (strcmp(f->name, name) == 0) return f;
    return NULL;
}

/* True if `name` is one of the series a histogram called `hist` writes: hist_bucket, hist_sum,
 * hist_count. */
static bool met_is_series_of(const char *hist, const char *name) {
    static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
    size_t hl = strlen(hist);
    if (strncmp(name, hist, hl) != 0) return false;
    for (size_t k = 0; k < 3; k++)
        if (strcmp(name + hl, suffixes[k]) == 0) return true;
    return false;
}

static pie_code met_check_args(pie_metrics *m, met_kind kind, const char *name, const char *help,
                               const double *bounds, size_t n_bounds,
                               const pie_metric_label *labels, size_t n_labels, pie_status *st) {
    const char *shown = name ? name : "(null)";
    if (!m) return pie_status_set(st, PIE_INVALID_ARGUMENT, "metrics: registry is NULL");
    if (!met_name_ok(name, true))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "metric name '%s' is not valid (want [a-zA-Z_:][a-zA-Z0-9_:]*)",
                              shown);
    if (!help || !met_utf8_ok(help))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "metric '%s': help is not UTF-8 text",
                              name);
    if (n_labels > PIE_METRICS_MAX_LABELS || (n_labels && !labels))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "metric '%s': %zu labels (at most %d)",
                              name, n_labels, PIE_METRICS_MAX_LABELS);
    for (size_t i = 0; i < n_labels; i++) {
        const char *ln = labels[i].name ? labels[i].name : "(null)";
        if (!met_name_ok(labels[i].name, false) || strncmp(ln, "__", 2) == 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "metric '%s': label name '%s' is not valid (want "
                                  "[a-zA-Z_][a-zA-Z0-9_]*, not starting with __)",
                                  name, ln);
        if (kind == MET_HISTOGRAM && strcmp(ln, "le") == 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "metric '%s': label 'le' is reserved for histogram buckets",
                                  name);
        for (size_t j = 0; j < i; j++)
            if (strcmp(labels[j].name, ln) == 0)
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "metric '%s': label '%s' given twice", name, ln);
        if (!labels[i].value || !met_utf8_ok(labels[i].value))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "metric '%s': value of label '%s' is not UTF-8 text", name, ln);
    }
    if (kind == MET_HISTOGRAM) {
        if (!bounds || n_bounds == 0 || n_bounds > PIE_METRICS_MAX_BUCKETS)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "metric '%s': %zu bucket bounds (want 1..%d)", name, n_bounds,
                                  PIE_METRICS_MAX_BUCKETS);
        for (size_t i = 0; i < n_bounds; i++) {
            if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
                return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                      "metric '%s': bucket bounds must be finite and strictly "
                                      "increasing (bound %zu)",
                                      name, i);
        }
    }
    return PIE_OK;
}

/* The existing family must match what the caller registers now. */
static pie_code met_check_same(const met_family *f, met_kind kind, const char *help,
                               const double *bounds, size_t n_bounds,
                               const pie_metric_label *labels, size_t n_labels, pie_status *st) {
    if (f->kind != kind)
        return pie_status_set(st, PIE_ALREADY_EXISTS, "metric '%s' is already a %s", f->name,
                              kind_names[f->kind]);
    if (strcmp(f->help, help) != 0)
        return pie_status_set(st, PIE_ALREADY_EXISTS,
                              "metric '%s' is already registered with other help text", f->name);
    bool same = f->n_labels == n_labels;
    for (size_t i = 0; same && i < n_labels; i++) same = strcmp(f->labels[i], labels[i].name) == 0;
    if (!same)
        return pie_status_set(st, PIE_ALREADY_EXISTS,
                              "metric '%s' is already registered with other label names",
                              f->name);
    if (kind == MET_HISTOGRAM &&
        (f->n_bounds != n_bounds || memcmp(f->bounds, bounds, n_bounds * sizeof *bounds) != 0))
        return pie_status_set(st, PIE_ALREADY_EXISTS,
                              "metric '%s' is already registered with other bucket bounds",
                              f->name);
    return PIE_OK;
}

static met_family *met_family_new(met_kind kind, const char *name, const char *help,
                                  const double *bounds, size_t n_bounds,
                                  const pie_metric_label *labels, size_t n_labels) {
    met_family *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->kind = kind;
    f->series_tail = &f->series;
    f->name = strdup(name);
    f->help = strdup(help);
    bool ok = f->name && f->help;
    for (size_t i = 0; i < n_labels; i++) {
        f->labels[i] = strdup(labels[i].name);
        f->n_labels = i + 1;
        ok = ok && f->labels[i];
    }
    if (kind == MET_HISTOGRAM) {
        f->bounds = malloc(n_bounds * sizeof *bounds);
        ok = ok && f->bounds;
        if (f->bounds) {
            memcpy(f->bounds, bounds, n_bounds * sizeof *bounds);
            f->n_bounds = n_bounds;
        }
    }
    if (!ok) {
        met_family_free(f);
        return NULL;
    }
    return f;
}

static void *met_cell_new(const met_family *f) {
    size_t size = sizeof(pie_counter);
    if (f->kind == MET_GAUGE) size = sizeof(pie_gauge);
    if (f->kind == MET_HISTOGRAM)
        size = sizeof(pie_histogram) + (f->n_bounds + 1) * sizeof(_Atomic uint64_t);
    size = (size + MET_CACHE_LINE - 1) / MET_CACHE_LINE * MET_CACHE_LINE;
    void *cell = aligned_alloc(MET_CACHE_LINE, size);
    if (!cell) return NULL;
    memset(cell, 0, size);
    if (f->kind == MET_COUNTER) {
        atomic_init(&((pie_counter *)cell)->v, 0);
    } else if (f->kind == MET_GAUGE) {
        atomic_init(&((pie_gauge *)cell)->bits, met_bits(0.0));
    } else {
        pie_histogram *h = cell;
        h->bounds = f->bounds;
        h->n_bounds = f->n_bounds;
        atomic_init(&h->sum_bits, met_bits(0.0));
        for (size_t i = 0; i <= f->n_bounds; i++) atomic_init(&h->counts[i], 0);
    }
    return cell;
}

static met_series *met_series_new(const met_family *f, const pie_metric_label *labels) {
    met_series *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    bool ok = true;
    for (size_t i = 0; i < f->n_labels; i++) {
        s->values[i] = strdup(labels[i].value);
        ok = ok && s->values[i];
    }
    s->cell = ok ? met_cell_new(f) : NULL;
    if (!s->cell) {
        met_series_free(s, f->n_labels);
        return NULL;
    }
    return s;
}

/* Get-or-create, under the registry lock. */
static void *met_register(pie_metrics *m, met_kind kind, const char *name, const char *help,
                          const double *bounds, size_t n_bounds, const pie_metric_label *labels,
                          size_t n_labels, pie_status *st) {
    if (met_check_args(m, kind, name, help, bounds, n_bounds, labels, n_labels, st) != PIE_OK)
        return NULL;
    void *cell = NULL;
    met_lock(m);
    met_family *f = met_find(m, name);
    if (f) {
        if (met_check_same(f, kind, help, bounds, n_bounds, labels, n_labels, st) != PIE_OK)
            goto out;
        for (met_series *s = f->series; s; s = s->next) {
            bool same = true;
            for (size_t i = 0; same && i < n_labels; i++)
                same = strcmp(s->values[i], labels[i].value) == 0;
            if (same) {
                cell = s->cell;
                goto out;
            }
        }
    } else {
        for (met_family *g = m->families; g; g = g->next) {
            const char *hist = NULL;
            if (g->kind == MET_HISTOGRAM && met_is_series_of(g->name, name)) hist = g->name;
            if (kind == MET_HISTOGRAM && met_is_series_of(name, g->name)) hist = name;
            if (hist) {
                pie_status_set(st, PIE_ALREADY_EXISTS,
                               "metric '%s' clashes with the series of histogram '%s'",
                               hist == name ? g->name : name, hist);
                goto out;
            }
        }
        f = met_family_new(kind, name, help, bounds, n_bounds, labels, n_labels);
        if (!f) {
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
            goto out;
        }
        *m->tail = f;
        m->tail = &f->next;
    }
    if (f->n_series == PIE_METRICS_MAX_SERIES) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "metric '%s' already has %d label sets",
                       name, PIE_METRICS_MAX_SERIES);
        goto out;
    }
    met_series *s = met_series_new(f, labels);
    if (!s) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
        goto out;
    }
    *f->series_tail = s;
    f->series_tail = &s->next;
    f->n_series++;
    cell = s->cell;
out:
    met_unlock(m);
    if (cell) pie_status_ok(st);
    return cell;
}

pie_counter *pie_metrics_counter(pie_metrics *m, const char *name, const char *help,
                                 const pie_metric_label *labels, size_t n_labels,
                                 pie_status *st) {
    return met_register(m, MET_COUNTER, name, help, NULL, 0, labels, n_labels, st);
}

pie_gauge *pie_metrics_gauge(pie_metrics *m, const char *name, const char *help,
                             const pie_metric_label *labels, size_t n_labels, pie_status *st) {
    return met_register(m, MET_GAUGE, name, help, NULL, 0, labels, n_labels, st);
}

pie_histogram *pie_metrics_histogram(pie_metrics *m, const char *name, const char *help,
                                     const double *bounds, size_t n_bounds,
                                     const pie_metric_label *labels, size_t n_labels,
                                     pie_status *st) {
    return met_register(m, MET_HISTOGRAM, name, help, bounds, n_bounds, labels, n_labels, st);
}

/* ---- rendering ------------------------------------------------------------------------------ */

int pie_metrics_format_double(char *buf, size_t n, double v) {
    if (isnan(v)) return snprintf(buf, n, "NaN");
    if (isinf(v)) return snprintf(buf, n, v > 0 ? "+Inf" : "-Inf");
    if (v == floor(v) && fabs(v) < 1e15) return snprintf(buf, n, "%.0f", v); /* 100, not 1e+02 */
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, v);
        if (strtod(tmp, NULL) == v) break;
    }
    return snprintf(buf, n, "%s", tmp);
}

typedef struct met_buf {
    char *p;
    size_t len, cap;
    bool oom;
} met_buf;

static void met_reserve(met_buf *b, size_t more) {
    if (b->oom || b->len + more + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return;
    }
    b->p = p;
    b->cap = cap;
}

static void met_put(met_buf *b, const char *s, size_t len) {
    met_reserve(b, len);
    if (b->oom) return;
    memcpy(b->p + b->len, s, len);
    b->len += len;
    b->p[b->len] = '\0';
}

static void met_puts(met_buf *b, const char *s) { met_put(b, s, strlen(s)); }

static void met_printf(met_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void met_printf(met_buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = true;
        return;
    }
    if ((size_t)n < sizeof tmp) {
        met_put(b, tmp, (size_t)n);
        return;
    }
    met_reserve(b, (size_t)n);
    if (b->oom) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* HELP text escapes \ and newline; label values also escape ". */
static void met_put_escaped(met_buf *b, const char *s, bool quote) {
    for (; *s; s++) {
        if (*s == '\\') met_put(b, "\\\\", 2);
        else if (*s == '\n') met_put(b, "\\n", 2);
        else if (quote && *s == '"') met_put(b, "\\\"", 2);
        else met_put(b, s, 1);
    }
}

static void met_put_double(met_buf *b, double v) {
    char tmp[40];
    pie_metrics_format_double(tmp, sizeof tmp, v);
    met_puts(b, tmp);
}

/* name{a="x",b="y"[,le="0.5"]} */
static void met_put_series_name(met_buf *b, const met_family *f, const met_series *s,
                                 const char *suffix, const char *le) {
    met_puts(b, f->name);
    met_puts(b, suffix);
    if (f->n_labels == 0 && !le) return;
    met_put(b, "{", 1);
    for (size_t i = 0; i < f->n_labels; i++) {
        if (i) met_put(b, ",", 1);
        met_puts(b, f->labels[i]);
        met_put(b, "=\"", 2);
        met_put_escaped(b, s->values[i], true);
        met_put(b, "\"", 1);
    }
    if (le) {
        if (f->n_labels) met_put(b, ",", 1);
        met_puts(b, "le=\"");
        met_puts(b, le);
        met_put(b, "\"", 1);
    }
    met_put(b, "}", 1);
}

static void met_render_family(met_buf *b, const met_family *f) {
    met_printf(b, "# HELP %s ", f->name);
    met_put_escaped(b, f->help, false);
    met_printf(b, "\n# TYPE %s %s\n", f->name, kind_names[f->kind]);
    for (const met_series *s = f->series; s; s = s->next) {
        if (f->kind == MET_COUNTER) {
            met_put_series_name(b, f, s, "", NULL);
            met_printf(b, " %llu\n", (unsigned long long)pie_counter_value(s->cell));
        } else if (f->kind == MET_GAUGE) {
            met_put_series_name(b, f, s, "", NULL);
            met_put(b, " ", 1);
            met_put_double(b, pie_gauge_value(s->cell));
            met_put(b, "\n", 1);
        } else {
            pie_histogram *h = s->cell;
            uint64_t cum = 0;
            char le[40];
            for (size_t i = 0; i <= h->n_bounds; i++) {
                cum += atomic_load_explicit(&h->counts[i], memory_order_relaxed);
                if (i < h->n_bounds) pie_metrics_format_double(le, sizeof le, h->bounds[i]);
                else snprintf(le, sizeof le, "+Inf");
                met_put_series_name(b, f, s, "_bucket", le);
                met_printf(b, " %llu\n", (unsigned long long)cum);
            }
            met_put_series_name(b, f, s, "_sum", NULL);
            met_put(b, " ", 1);
            met_put_double(b, pie_histogram_sum(h));
            met_put(b, "\n", 1);
            met_put_series_name(b, f, s, "_count", NULL);
            met_printf(b, " %llu\n", (unsigned long long)cum); /* = the +Inf bucket, always */
        }
    }
}

pie_code pie_metrics_render(pie_metrics *m, char **out, size_t *len) {
    met_collector collectors[PIE_METRICS_MAX_COLLECTORS];
    size_t n_collectors;
    *out = NULL;
    *len = 0;
    if (!m) return PIE_INVALID_ARGUMENT;
    met_lock(m);
    n_collectors = m->n_collectors;
    memcpy(collectors, m->collectors, n_collectors * sizeof collectors[0]);
    met_unlock(m);
    for (size_t i = 0; i < n_collectors; i++) collectors[i].fn(collectors[i].arg);

    met_buf b = {0};
    met_reserve(&b, 0); /* an empty registry still renders "" */
    met_lock(m);
    for (const met_family *f = m->families; f && !b.oom; f = f->next) met_render_family(&b, f);
    met_unlock(m);
    if (b.oom) {
        free(b.p);
        return PIE_RESOURCE_EXHAUSTED;
    }
    b.p[b.len] = '\0';
    *out = b.p;
    *len = b.len;
    return PIE_OK;
}
