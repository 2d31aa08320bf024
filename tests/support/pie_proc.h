/* pie_proc.h — real service processes for the C tests: start, wait until serving, read the
 * log, signal, reap.
 *
 * Owns: spawning a binary of PIE_BIN_DIR (pie-controller, pie-worker, pie-lifecycle, piectl)
 * with a hermetic environment, its log file (stdout and stderr together), the readiness wait
 * (the `event=svc.started ... grpc_port=N metrics_port=M` line, then `event=svc.health
 * serving=true`), signals and the exit status, and the small helpers these tests share: a free
 * loopback port, a temporary directory with files in it. Does not own: what the services say
 * (each test asserts that), gRPC clients (rpc.h).
 *
 * A test writes:
 *
 *     pie_status st;
 *     pie_proc *ctl = pie_proc_start("pie-controller", NULL, 20000, &st);
 *     cr_assert(ctl, "%s", st.msg);
 *     const char *env[] = {pie_proc_env_controller(ctl, buf, sizeof buf), NULL};
 *     ... rpc_channel_create(pie_proc_addr(ctl), ...) ...
 *     cr_assert_eq(pie_proc_stop(ctl, 20000, &st), 0, "%s", st.msg);   // SIGTERM → exit 0
 *     pie_proc_destroy(ctl);
 *
 * ENVIRONMENT. The child gets the test's environment minus every PIE_* variable (so a developer's
 * shell cannot change a test's outcome), plus PIE_SERVER_LISTEN=127.0.0.1:0 and
 * PIE_METRICS_LISTEN=127.0.0.1:0 (ephemeral ports), plus opts->env, which overrides both.
 *
 * CLEAN-UP. A child is killed if the test process dies in any way (PR_SET_PDEATHSIG), and
 * pie_proc_destroy kills (SIGKILL) and reaps a child that is still running and removes its
 * log. Processes still alive when the test process exits normally — a failed cr_assert skips
 * the test's own clean-up — are killed, reaped and their logs removed by an atexit handler.
 *
 * Errors come back as a pie_status whose message names the binary and, where it helps, ends
 * with the tail of its log, so `cr_assert(p, "%s", st.msg)` says what went wrong. */
#ifndef PIE_PROC_H
#define PIE_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

typedef struct pie_proc pie_proc;

typedef struct pie_proc_opts {
    const char *const *env;  /* extra "NAME=value" entries, NULL-terminated; NULL = none */
    const char *const *args; /* argv[1..], NULL-terminated; NULL = none */
} pie_proc_opts;

/* Starts bin (a name in PIE_BIN_DIR such as "pie-worker", or a path containing '/') with its
 * output going to a fresh log file. Does not wait for anything. NULL on failure (st says why). */
pie_proc *pie_proc_spawn(const char *bin, const pie_proc_opts *opts, pie_status *st);

/* Waits up to timeout_ms until the log shows svc.started and then serving=true, and reads the
 * ports from it. PIE_OK; DEADLINE_EXCEEDED (the process is left running), or UNAVAILABLE if it
 * exited first (its exit status is kept: pie_proc_wait returns it at once). */
pie_code pie_proc_wait_ready(pie_proc *p, int64_t timeout_ms, pie_status *st);

/* pie_proc_spawn + pie_proc_wait_ready; on failure the process is destroyed and NULL returned. */
pie_proc *pie_proc_start(const char *bin, const pie_proc_opts *opts, int64_t timeout_ms,
                         pie_status *st);

int pie_proc_pid(const pie_proc *p);
const char *pie_proc_name(const pie_proc *p);     /* "pie-worker" */
const char *pie_proc_log_path(const pie_proc *p);
int pie_proc_grpc_port(const pie_proc *p);        /* after pie_proc_wait_ready; 0 before */
int pie_proc_metrics_port(const pie_proc *p);     /* 0 before, or when metrics are off */
const char *pie_proc_addr(const pie_proc *p);     /* "127.0.0.1:<grpc port>" ("" before) */

/* The whole log so far, NUL-terminated; the caller frees it. NULL only when out of memory. */
char *pie_proc_log(const pie_proc *p);
/* The last max_bytes of the log (from a line start where possible), for failure messages.
 * The caller frees it. */
char *pie_proc_log_tail(const pie_proc *p, size_t max_bytes);
/* Occurrences of needle in the log. */
size_t pie_proc_log_count(const pie_proc *p, const char *needle);
/* Whether some line of the log is exactly `line` (given without its newline). */
bool pie_proc_log_has_line(const pie_proc *p, const char *line);
/* The value of the metric series `series` (its whole name with labels, e.g.
 * `pie_worker_offload_steps_total{decision="forced"}`) on p's metrics port: PIE_OK and *value,
 * NOT_FOUND when the page has no such series, UNAVAILABLE when the port does not answer. */
pie_code pie_proc_metric(const pie_proc *p, const char *series, double *value, pie_status *st);
/* Waits up to timeout_ms until needle occurs at least n times in the log. */
bool pie_proc_wait_log(const pie_proc *p, const char *needle, size_t n, int64_t timeout_ms);

/* Sends sig. PIE_OK, or FAILED_PRECONDITION if the process was already reaped. */
pie_code pie_proc_signal(pie_proc *p, int sig, pie_status *st);

/* Waits up to timeout_ms for the process to end and reaps it. Returns its exit status (0..255),
 * or 128 + N if signal N ended it. If it is still running at the deadline it is killed with
 * SIGKILL and reaped, st says so, and -1 is returned. Once reaped, later calls return the same
 * status at once. */
int pie_proc_wait(pie_proc *p, int64_t timeout_ms, pie_status *st);

/* SIGTERM (unless already reaped), then pie_proc_wait. */
int pie_proc_stop(pie_proc *p, int64_t timeout_ms, pie_status *st);

/* Kills (SIGKILL) and reaps the process if it is still running, removes its log, frees.
 * NULL is fine. */
void pie_proc_destroy(pie_proc *p);

/* "PIE_CONTROLLER_ADDRESS=127.0.0.1:<grpc port of ctl>" into buf; returns buf. */
const char *pie_proc_env_controller(const pie_proc *ctl, char *buf, size_t n);

/* A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read, closed); -1 on
 * failure. Another process may take it in between; tests use it where a fixed port is the
 * point (restarting a service on the same address). */
int pie_proc_free_port(void);

/* A fresh directory under $TMPDIR (or /tmp); the caller frees the path and removes the
 * directory with pie_proc_rmdir. NULL on failure (st says why). */
char *pie_proc_tmpdir(pie_status *st);
/* Writes text to dir/name (created or truncated); returns the path (caller frees) or NULL. */
char *pie_proc_write_file(const char *dir, const char *name, const char *text, pie_status *st);
/* Removes dir with the plain files in it (not recursive). NULL is fine. */
void pie_proc_rmdir(const char *dir);

#endif
