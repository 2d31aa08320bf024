/* pie_procstat.h — the standard process_* metrics of Prometheus client libraries, for every
 * service: CPU seconds, resident and virtual memory, open and maximum file descriptors, start
 * time. Owns: reading them from /proc/self at scrape time. Does not own: the registry
 * (pie_metrics.h). */
#ifndef PIE_PROCSTAT_H
#define PIE_PROCSTAT_H

#include "pie_metrics.h"
#include "pie_status.h"

/* Registers the process_* gauges and a collector that refreshes them at each scrape.
 * process_cpu_seconds_total is exposed as a gauge (the registry's counters are integers), which
 * rate() reads the same. */
pie_code pie_procstat_register(pie_metrics *m, pie_status *st);

#endif
