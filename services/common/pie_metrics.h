/* pie_metrics.h — counters, gauges and histograms, rendered for Prometheus.
 *
 * Owns: a registry of metric families (name, help, kind, label names, histogram bounds) and
 * their series (one per distinct set of label values), lock-free updates of those series, and
 * the text exposition format 0.0.4. Does not own: serving it over HTTP (pie_httpd.h).
 *
 * Use: register at start-up, keep the returned handle, update it on the hot path.
 *
 *     pie_counter *req = pie_metrics_counter(m, "pie_lifecycle_launches_total",
 *         "Inferlet launches accepted.", NULL, 0, &st);
 *     pie_histogram *lat = pie_metrics_histogram(m, "pie_ctl_batch_seconds",
 *         "Time from batch pick to worker result.", bounds, n_bounds,
 *         (pie_metric_label[]){{"kind", "forward"}}, 1, &st);
 *     ...
 *     pie_counter_add(req, 1);                 // one relaxed atomic add
 *     pie_histogram_observe(lat, 0.0031);      // one add on the bucket + one CAS on the sum
 *
 * Registering the same name again with the same kind, help, label names (and bounds) returns
 * the series for the given label values — the same handle for the same values — so a family
 * with a small fixed set of label values is registered once per value. Conflicting
 * re-registration is PIE_ALREADY_EXISTS; bad names are PIE_INVALID_ARGUMENT.
 *
 * Names: metric `[a-zA-Z_:][a-zA-Z0-9_:]*`; label `[a-zA-Z_][a-zA-Z0-9_]*`, not starting
 * with `__`, and not `le` on a histogram; help and label values are any UTF-8 (escaped when
 * rendered). A histogram called x also owns x_bucket, x_sum and x_count.
 *
 * Threads: every function may be called from any thread. Updates take no lock; registration
 * and rendering share one mutex. Handles stay valid until pie_metrics_destroy, which must not
 * race with anything. The update functions accept NULL handles and do nothing, so code can run
 * without a registry (unit tests). */
#ifndef PIE_METRICS_H
#define PIE_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

#define PIE_METRICS_MAX_LABELS 4     /* label names per family */
#define PIE_METRICS_MAX_BUCKETS 64   /* finite histogram bounds; +Inf is implicit */
#define PIE_METRICS_MAX_SERIES 1024  /* label-value sets per family: guards cardinality */
#define PIE_METRICS_MAX_COLLECTORS 16

typedef struct pie_metrics pie_metrics;
typedef struct pie_counter pie_counter;
typedef struct pie_gauge pie_gauge;
typedef struct pie_histogram pie_histogram;

typedef struct pie_metric_label {
    const char *name, *value;
} pie_metric_label;

/* NULL when out of memory. */
pie_metrics *pie_metrics_create(void);
void pie_metrics_destroy(pie_metrics *m);

/* Get-or-create the series of family `name` with these labels (n_labels of them, 0..4; labels
 * may be NULL when 0). Returns NULL and fills st on error. Strings are copied. */
pie_counter *pie_metrics_counter(pie_metrics *m, const char *name, const char *help,
                                 const pie_metric_label *labels, size_t n_labels,
                                 pie_status *st);
pie_gauge *pie_metrics_gauge(pie_metrics *m, const char *name, const char *help,
                             const pie_metric_label *labels, size_t n_labels, pie_status *st);
/* bounds: 1..PIE_METRICS_MAX_BUCKETS finite upper bounds, strictly increasing (copied). */
pie_histogram *pie_metrics_histogram(pie_metrics *m, const char *name, const char *help,
                                     const double *bounds, size_t n_bounds,
                                     const pie_metric_label *labels, size_t n_labels,
                                     pie_status *st);

/* Fills out[0..n) with start, start*factor, start*factor^2, ... (start > 0, factor > 1). */
void pie_metrics_exponential_bounds(double start, double factor, size_t n, double *out);

/* Counters count events: monotonic, integer. */
void pie_counter_add(pie_counter *c, uint64_t n);
uint64_t pie_counter_value(const pie_counter *c);

void pie_gauge_set(pie_gauge *g, double v);
void pie_gauge_add(pie_gauge *g, double delta); /* negative to decrease */
double pie_gauge_value(const pie_gauge *g);

/* v falls in the first bucket whose bound is >= v (the +Inf bucket if none). */
void pie_histogram_observe(pie_histogram *h, double v);
uint64_t pie_histogram_count(const pie_histogram *h);
double pie_histogram_sum(const pie_histogram *h);

/* fn(arg) runs at the start of every render, outside the registry lock, e.g. to set gauges
 * sampled at scrape time (free KV pages). It may run on several threads at once. */
pie_code pie_metrics_add_collector(pie_metrics *m, void (*fn)(void *arg), void *arg,
                                   pie_status *st);

/* The whole registry in text format 0.0.4, families in registration order, series in creation
 * order: # HELP, # TYPE, samples (`name{a="x"} 3`; histograms as cumulative `_bucket{le=".."}`
 * lines ending with le="+Inf", then `_sum` and `_count`, where _count equals the +Inf bucket).
 * *out is malloc'd and NUL-terminated, *len excludes the NUL. PIE_RESOURCE_EXHAUSTED if out
 * of memory, PIE_INVALID_ARGUMENT if m is NULL (then *out is NULL). */
pie_code pie_metrics_render(pie_metrics *m, char **out, size_t *len);

/* v as the shortest text that strtod reads back to v (integers below 1e15 in plain digits:
 * "100", not "1e+02"); NaN, +Inf, -Inf as Prometheus writes them. Returns the length (snprintf-style). Also used by pie_config for doubles. */
int pie_metrics_format_double(char *buf, size_t n, double v);

#endif
