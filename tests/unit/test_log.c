/* test_log.c — pie_log: the line format, level filtering, quoting, truncation, and one write(2)
 * per line. Each test runs in its own process, so the process-wide settings do not leak. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pie_log.h"

static int pipe_fds[2];

static void capture(void) {
    cr_assert_eq(pipe2(pipe_fds, O_NONBLOCK | O_CLOEXEC), 0, "pipe: %s", strerror(errno));
    pie_log_set_fd(pipe_fds[1]);
    pie_log_set_service("test");
    pie_log_set_level(PIE_LOG_INFO);
}

static void release(void) {
    close(pipe_fds[0]);
    close(pipe_fds[1]);
}

TestSuite(log, .init = capture, .fini = release);

/* What has been logged since the last call; "" if nothing. */
static const char *captured(void) {
    static char buf[65536];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(pipe_fds[0], buf + len, sizeof buf - 1 - len);
        if (r <= 0) break;
        len += (size_t)r;
    }
    buf[len] = '\0';
    return buf;
}

static void assert_matches(const char *text, const char *pattern) {
    regex_t re;
    cr_assert_eq(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB), 0, "bad pattern %s", pattern);
    int rc = regexec(&re, text, 0, NULL, 0);
    regfree(&re);
    cr_assert_eq(rc, 0, "line\n  %s\ndoes not match\n  %s", text, pattern);
}

#define TS "ts=[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6}Z"

Test(log, line_format) {
    pie_log_info("rpc.listen", "addr=%s port=%d", "127.0.0.1", 5000);
    assert_matches(captured(),
                   "^" TS " level=info svc=test event=rpc\\.listen addr=127\\.0\\.0\\.1 port=5000\n$");
}

/* The clock the logger reads (CLOCK_REALTIME), whole seconds. Not time(): glibc may serve it
 * from the coarse clock, which lags by up to a tick, so at a second's edge the line's stamp
 * could be a second past a time() taken after it. */
static time_t now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec;
}

Test(log, timestamp_is_utc_now) {
    time_t before = now_s();
    pie_log_warn("x", "%s", "");
    time_t after = now_s();
    struct tm tm = {0};
    const char *line = captured();
    cr_assert_not_null(strptime(line, "ts=%Y-%m-%dT%H:%M:%S", &tm), "%s", line);
    time_t ts = timegm(&tm);
    cr_assert(ts >= before && ts <= after, "ts %lld not in [%lld, %lld]", (long long)ts,
              (long long)before, (long long)after);
}

Test(log, no_fields_and_no_service) {
    pie_log_set_service("");
    pie_log_error("worker.exit", NULL);
    pie_log_error("worker.exit", "%s", "");
    assert_matches(captured(), "^" TS " level=error event=worker\\.exit\n" TS
                               " level=error event=worker\\.exit\n$");
}

Test(log, levels_below_the_threshold_are_dropped) {
    pie_log_set_level(PIE_LOG_WARN);
    pie_log_debug("a", "n=%d", 1);
    pie_log_info("b", "n=%d", 2);
    pie_log_warn("c", "n=%d", 3);
    pie_log_error("d", "n=%d", 4);
    assert_matches(captured(), "^" TS " level=warn svc=test event=c n=3\n" TS
                               " level=error svc=test event=d n=4\n$");
    pie_log_set_level(PIE_LOG_DEBUG);
    pie_log_debug("e", NULL);
    assert_matches(captured(), "^" TS " level=debug svc=test event=e\n$");
    pie_log_set_level(PIE_LOG_OFF);
    pie_log_error("f", NULL);
    cr_assert_str_eq(captured(), "");
    pie_log_set_level(PIE_LOG_DEBUG);
    pie_log_write(PIE_LOG_OFF, "g", NULL); /* OFF is a threshold, never a level of a line */
    pie_log_write((pie_log_level)99, "h", NULL);
    cr_assert_str_eq(captured(), "");
    cr_assert_eq(pie_log_get_level(), PIE_LOG_DEBUG);
}

Test(log, level_names_round_trip) {
    const char *names[] = {"debug", "info", "warn", "error", "off"};
    for (int i = 0; i <= PIE_LOG_OFF; i++) {
        pie_log_level l;
        cr_assert_eq(pie_log_parse_level(names[i], &l), 0);
        cr_assert_eq((int)l, i);
        cr_assert_str_eq(pie_log_level_name(l), names[i]);
    }
    pie_log_level l = PIE_LOG_INFO;
    cr_assert_eq(pie_log_parse_level("loud", &l), -1);
    cr_assert_eq(pie_log_parse_level("INFO", &l), -1, "names are lower case");
    cr_assert_eq(l, PIE_LOG_INFO, "untouched on failure");
    cr_assert_str_eq(pie_log_level_name((pie_log_level)7), "unknown");
}

Test(log, quote_escapes_quotes_backslashes_and_control_bytes) {
    char buf[128];
    cr_assert_str_eq(pie_log_quote(buf, sizeof buf, "plain"), "\"plain\"");
    cr_assert_str_eq(pie_log_quote(buf, sizeof buf, "say \"hi\"\\\n\x01\xc3\xa9"),
                     "\"say \\\"hi\\\"\\\\\\x0a\\x01\xc3\xa9\"");
    cr_assert_str_eq(pie_log_quote(buf, sizeof buf, ""), "\"\"");
    cr_assert_str_eq(pie_log_quote(buf, sizeof buf, NULL), "\"\"");
    pie_log_info("quoted", "msg=%s", pie_log_quote(buf, sizeof buf, "a b"));
    assert_matches(captured(), "^" TS " level=info svc=test event=quoted msg=\"a b\"\n$");
}

Test(log, quote_truncates_inside_the_buffer_and_stays_quoted) {
    char buf[16];
    memset(buf, 'Z', sizeof buf);
    pie_log_quote(buf, 10, "abcdefghijklmnop");
    cr_assert_str_eq(buf, "\"abcd\"", "the closing quote and NUL fit in n");
    cr_assert_eq(buf[10], 'Z', "nothing written past n");
    pie_log_quote(buf, 10, "\n\n\n");
    cr_assert_str_eq(buf, "\"\\x0a\"", "an escape is never cut in half");
    pie_log_quote(buf, 2, "x");
    cr_assert_str_eq(buf, "");
    pie_log_quote(buf, 0, "x"); /* must not write at all */
}

Test(log, long_lines_are_cut_and_still_end_with_a_newline) {
    char big[4096];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    pie_log_info("big", "v=%s", big);
    const char *line = captured();
    size_t len = strlen(line);
    cr_assert_eq(len, 2047, "length %zu", len);
    cr_assert_eq(line[len - 1], '\n');
    cr_assert_eq(line[len - 2], 'x');
    cr_assert_null(memchr(line, '\n', len - 1), "one line only");
}

/* Lines from many threads never interleave: each is one write(2). */
#define LOG_THREADS 4
#define LOG_LINES 500

static void *log_main(void *arg) {
    long id = (long)arg;
    char pad[300];
    memset(pad, 'a' + (int)id, sizeof pad - 1);
    pad[sizeof pad - 1] = '\0';
    for (int i = 0; i < LOG_LINES; i++) pie_log_info("t", "id=%ld i=%d pad=%s", id, i, pad);
    return NULL;
}

Test(log, concurrent_lines_do_not_interleave) {
    char path[] = "/tmp/pie-test-log-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(unlink(path), 0);
    pie_log_set_fd(fd);
    pthread_t t[LOG_THREADS];
    for (long i = 0; i < LOG_THREADS; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, log_main, (void *)i), 0);
    for (int i = 0; i < LOG_THREADS; i++) cr_assert_eq(pthread_join(t[i], NULL), 0);
    cr_assert_eq(lseek(fd, 0, SEEK_SET), 0);
    FILE *f = fdopen(fd, "r");
    cr_assert_not_null(f);
    char line[1024];
    int n = 0;
    regex_t re;
    cr_assert_eq(regcomp(&re,
                         "^" TS " level=info svc=test event=t id=([0-3]) i=[0-9]+ pad=(a{299}|b{299}"
                         "|c{299}|d{299})\n$",
                         REG_EXTENDED | REG_NOSUB),
                 0);
    while (fgets(line, sizeof line, f)) {
        cr_assert_eq(regexec(&re, line, 0, NULL, 0), 0, "mangled line %d: %s", n, line);
        n++;
    }
    regfree(&re);
    fclose(f);
    cr_assert_eq(n, LOG_THREADS * LOG_LINES);
}
