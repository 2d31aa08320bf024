/* pie_log.c — see pie_log.h. */
#include "pie_log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Process-wide logger settings. Global because every subsystem logs and threading a logger
 * handle through every call would add noise for no gain; the level is atomic because it is
 * read on every line from any thread, the rest is written only at start-up. */
static _Atomic int log_level = PIE_LOG_INFO;
static _Atomic int log_fd = 2;
static char log_svc[32];

static const char *const level_names[] = {"debug", "info", "warn", "error", "off"};

void pie_log_set_level(pie_log_level level) { atomic_store(&log_level, (int)level); }
pie_log_level pie_log_get_level(void) { return (pie_log_level)atomic_load(&log_level); }
void pie_log_set_fd(int fd) { atomic_store(&log_fd, fd); }

void pie_log_set_service(const char *svc) {
    snprintf(log_svc, sizeof log_svc, "%s", svc ? svc : "");
}

int pie_log_parse_level(const char *name, pie_log_level *out) {
    for (int i = 0; i <= PIE_LOG_OFF; i++) {
        if (strcmp(name, level_names[i]) == 0) {
            *out = (pie_log_level)i;
            return 0;
        }
    }
    return -1;
}

const char *pie_log_level_name(pie_log_level level) {
    if ((int)level < 0 || level > PIE_LOG_OFF) return "unknown";
    return level_names[level];
}

void pie_log_write(pie_log_level level, const char *event, const char *fmt, ...) {
    if ((int)level < atomic_load(&log_level) || level >= PIE_LOG_OFF) return;
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ level=%s",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000, level_names[level]);
    if (log_svc[0] && n < (int)sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, " svc=%s", log_svc);
    if (n < (int)sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, " event=%s", event);
    if (fmt && fmt[0] && n < (int)sizeof line - 1) {
        line[n++] = ' ';
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
        va_end(ap);
        if (k > 0) n += k;
        else n--; /* the fields came out empty (or failed): no trailing separator */
    }
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(atomic_load(&log_fd), line, (size_t)n);
    (void)w; /* a log line that cannot be written has nowhere else to go */
}

char *pie_log_quote(char *buf, size_t n, const char *s) {
    size_t o = 0;
    if (n < 3) {
        if (n) buf[0] = '\0';
        return buf;
    }
    buf[o++] = '"';
    for (; s && *s && o + 5 < n; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            buf[o++] = '\\';
            buf[o++] = (char)c;
        } else if (c < 0x20) {
            o += (size_t)snprintf(buf + o, n - o, "\\x%02x", c);
        } else {
            buf[o++] = (char)c;
        }
    }
    buf[o++] = '"';
    buf[o] = '\0';
    return buf;
}
