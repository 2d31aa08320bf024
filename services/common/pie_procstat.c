/* pie_procstat.c — see pie_procstat.h. */
#include "pie_procstat.h"

#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

typedef struct procstat {
    pie_gauge *cpu, *rss, *vsz, *fds, *max_fds, *start;
} procstat;

/* The registry's process_* gauges (get-or-create: the same handles every time). */
static bool gauges(pie_metrics *m, procstat *p, pie_status *st) {
    p->cpu = pie_metrics_gauge(m, "process_cpu_seconds_total",
                               "Total user and system CPU time spent in seconds.", NULL, 0, st);
    p->rss = pie_metrics_gauge(m, "process_resident_memory_bytes",
                               "Resident memory size in bytes.", NULL, 0, st);
    p->vsz = pie_metrics_gauge(m, "process_virtual_memory_bytes", "Virtual memory size in bytes.",
                               NULL, 0, st);
    p->fds = pie_metrics_gauge(m, "process_open_fds", "Number of open file descriptors.", NULL,
                               0, st);
    p->max_fds = pie_metrics_gauge(m, "process_max_fds",
                                   "Maximum number of open file descriptors.", NULL, 0, st);
    p->start = pie_metrics_gauge(m, "process_start_time_seconds",
                                 "Start time of the process since unix epoch in seconds.", NULL,
                                 0, st);
    return p->cpu && p->rss && p->vsz && p->fds && p->max_fds && p->start;
}

/* utime + stime (clock ticks), vsize (bytes) and rss (pages) of /proc/self/stat; false if it
 * cannot be read. Fields after the command, which may hold spaces, start after its ')'. */
static bool read_stat(unsigned long long *ticks, unsigned long long *vsize, long long *rss) {
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    if (f == NULL) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    if (p == NULL) return false;
    unsigned long long utime, stime;
    /* after ')': state(3) ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
     * utime(14) stime cutime cstime priority nice threads itrealvalue starttime vsize(23) rss */
    int got = sscanf(p + 1,
                     " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d "
                     "%*d %*u %llu %lld",
                     &utime, &stime, vsize, rss);
    if (got != 4) return false;
    *ticks = utime + stime;
    return true;
}

static int count_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory stream's own descriptor */
}

/* Collector; arg is the registry (the handles are looked up again: nothing to own or free). */
static void collect(void *arg) {
    procstat ps;
    pie_status st;
    if (!gauges(arg, &ps, &st)) return;
    procstat *p = &ps;
    unsigned long long ticks, vsize;
    long long rss;
    if (read_stat(&ticks, &vsize, &rss)) {
        long hz = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
        if (hz > 0) pie_gauge_set(p->cpu, (double)ticks / (double)hz);
        pie_gauge_set(p->vsz, (double)vsize);
        if (page > 0) pie_gauge_set(p->rss, (double)rss * (double)page);
    }
    int fds = count_fds();
    if (fds >= 0) pie_gauge_set(p->fds, fds);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        pie_gauge_set(p->max_fds, (double)rl.rlim_cur);
}

/* The process's start: now minus its age (/proc/self/stat starttime is in ticks since boot;
 * the uptime clock avoids reading the boot time). */
static double start_time_seconds(void) {
    struct timespec now, up;
    clock_gettime(CLOCK_REALTIME, &now);
    clock_gettime(CLOCK_BOOTTIME, &up);
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    double wall = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
    if (f == NULL) return wall;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    unsigned long long start_ticks;
    long hz = sysconf(_SC_CLK_TCK);
    if (p == NULL || hz <= 0 ||
        sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d "
                      "%*d %llu",
               &start_ticks) != 1)
        return wall;
    double age = (double)up.tv_sec + (double)up.tv_nsec / 1e9 - (double)start_ticks / (double)hz;
    return wall - (age > 0 ? age : 0);
}

pie_code pie_procstat_register(pie_metrics *m, pie_status *st) {
    procstat p;
    if (!gauges(m, &p, st)) return st->code;
    pie_gauge_set(p.start, start_time_seconds());
    return pie_metrics_add_collector(m, collect, m, st);
}
