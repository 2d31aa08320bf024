/* pie_log.h — leveled key=value logging to stderr.
 *
 * One line per event: `ts=2026-11-21T17:03:04.123456Z level=info svc=controller
 * event=rpc.listen addr=127.0.0.1:5000`. The event is a dotted name; the rest is key=value
 * pairs written by the caller's format. Values that may contain spaces or quotes go through
 * pie_log_quote. Lines are written with one write(2) each, so threads never interleave. */
#ifndef PIE_LOG_H
#define PIE_LOG_H

#include <stddef.h>

typedef enum pie_log_level {
    PIE_LOG_DEBUG = 0,
    PIE_LOG_INFO = 1,
    PIE_LOG_WARN = 2,
    PIE_LOG_ERROR = 3,
    PIE_LOG_OFF = 4,
} pie_log_level;

/* Process-wide settings; set once at start-up (before threads) from the service config. */
void pie_log_set_level(pie_log_level level);
pie_log_level pie_log_get_level(void);
void pie_log_set_service(const char *svc); /* copied; "" drops the svc= field */
void pie_log_set_fd(int fd);               /* default 2 (stderr); tests redirect */

/* "debug" | "info" | "warn" | "error" | "off" → level; returns 0 on success, -1 if unknown. */
int pie_log_parse_level(const char *name, pie_log_level *out);
const char *pie_log_level_name(pie_log_level level);

void pie_log_write(pie_log_level level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define pie_log_debug(event, ...) pie_log_write(PIE_LOG_DEBUG, event, __VA_ARGS__)
#define pie_log_info(event, ...)  pie_log_write(PIE_LOG_INFO, event, __VA_ARGS__)
#define pie_log_warn(event, ...)  pie_log_write(PIE_LOG_WARN, event, __VA_ARGS__)
#define pie_log_error(event, ...) pie_log_write(PIE_LOG_ERROR, event, __VA_ARGS__)

/* Writes s as a double-quoted logfmt value (escaping \ " and control bytes) into buf;
 * returns buf. Truncates to fit n. */
char *pie_log_quote(char *buf, size_t n, const char *s);

#endif
