/* test_compile_bombs.c — issue 11, hole 5: a program upload cannot keep the lifecycle's
 * compilers busy beyond its limits, through a real pie-controller, CPU pie-worker and
 * pie-lifecycle on loopback (tests/e2e/e2e_support.h). The modules are written by
 * tests/support/pie_wasmgen.c:
 *   * 50,000 functions (wasm2c: minutes) and 20,000 nested blocks (wasm2c: crash) are refused at
 *     upload by the parser, with the default configuration, naming the limit and the value;
 *   * with the limits raised so that such a module reaches wasm2c, its compile is killed when
 *     the client goes away, SIGTERM does not wait for it, and uploads beyond
 *     runtime.max_compiles + runtime.compile_queue fail RESOURCE_EXHAUSTED at once.
 * The lifecycle's compilers are its child processes (wasm2c, tcc): they are read from /proc. */
#include <criterion/criterion.h>

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_testutil.h"
#include "pie_wasmgen.h"

TestSuite(security, .fini = pie_test_leak_check, .timeout = 600);

#define WAIT_MS 60000

/* Settings that let a 50,000-function module reach wasm2c (which then runs for minutes). Tier 0
 * translates with lc_wasm's own translator by default, for which such a module is no bomb (it
 * loads in well under a second): these tests take the wasm2c path (runtime.tier0_wasm2c) to
 * have a compile that runs long enough to be killed, queued or refused. */
#define RAISED_LIMITS                                                                            \
    "PIE_PROGRAMS_MAX_FUNCTIONS=1000000", "PIE_RUNTIME_COMPILE_TIMEOUT=30m",                       \
        "PIE_RUNTIME_TIER0_WASM2C=true"

/* ---- the lifecycle's child processes -------------------------------------------------------- */

/* The pids of the processes whose parent is pid (at most cap). */
static size_t children(int pid, int *out, size_t cap) {
    DIR *d = opendir("/proc");
    cr_assert(d, "cannot list /proc");
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && n < cap) {
        char *end;
        long p = strtol(e->d_name, &end, 10);
        if (*end != '\0' || p <= 0) continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%ld/stat", p);
        FILE *f = fopen(path, "r");
        if (f == NULL) continue; /* gone meanwhile */
        size_t got = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[got] = '\0';
        const char *rp = strrchr(buf, ')'); /* "pid (comm) state ppid ..." */
        char state;
        int ppid;
        if (rp && sscanf(rp + 1, " %c %d", &state, &ppid) == 2 && ppid == pid && state != 'Z')
            out[n++] = (int)p;
    }
    closedir(d);
    return n;
}

/* Waits up to timeout_ms until the lifecycle has a child process that is not in seen[0..n_seen)
 * (a compile started); returns it, or 0. */
static int wait_new_child(const e2e_cluster *c, const int *seen, size_t n_seen,
                          int64_t timeout_ms) {
    int64_t until = pie_test_now_ms() + timeout_ms;
    do {
        int kids[16];
        size_t n = children(pie_proc_pid(c->lc), kids, 16);
        for (size_t i = 0; i < n; i++) {
            bool old = false;
            for (size_t j = 0; j < n_seen; j++) old |= kids[i] == seen[j];
            if (!old) return kids[i];
        }
        pie_test_sleep_ms(20);
    } while (pie_test_now_ms() < until);
    return 0;
}

/* Waits up to timeout_ms until the lifecycle has no child process; returns how many it has. */
static size_t wait_no_children(const e2e_cluster *c, int64_t timeout_ms) {
    int64_t until = pie_test_now_ms() + timeout_ms;
    int kids[16];
    size_t n;
    while ((n = children(pie_proc_pid(c->lc), kids, 16)) > 0 && pie_test_now_ms() < until)
        pie_test_sleep_ms(50);
    return n;
}

/* ---- uploads --------------------------------------------------------------------------------- */

/* Opens an upload of the module o describes and sends all of it (half-closed); the answer is
 * left to upload_end. */
static rpc_stream *upload_start(e2e_cluster *c, const pie_wasmgen_opts *o, int64_t timeout_ms) {
    size_t len = 0;
    uint8_t *bytes = pie_wasmgen(o, &len);
    cr_assert(bytes, "pie_wasmgen: out of memory");
    pie_status st;
    rpc_stream *s = e2e_upload_begin(c, "bomb", len, bytes, len, timeout_ms);
    cr_assert_eq(rpc_stream_close_send(s, &st), PIE_OK, "%s", st.msg);
    free(bytes);
    return s;
}

/* Waits up to timeout_ms for the upload's answer: its code, the message in msg (PIE_STATUS_MSG_MAX
 * bytes); PIE_UNKNOWN if none came in time (the stream is then still open). Destroys s
 * otherwise. */
static pie_code upload_end(rpc_stream *s, int64_t timeout_ms, char *msg) {
    ProtobufCMessage *m = NULL;
    rpc_recv_result rr = rpc_stream_recv(s, &m, timeout_ms);
    if (rr == RPC_RECV_TIMEOUT) return PIE_UNKNOWN;
    rpc_msg_free(m);
    pie_status st;
    pie_code rc = rpc_stream_finish(s, &st);
    snprintf(msg, PIE_STATUS_MSG_MAX, "%s", st.msg);
    rpc_stream_destroy(s);
    return rc;
}

/* ---- refused by the parser ------------------------------------------------------------------ */

Test(security, a_module_of_50000_functions_is_refused_at_upload_before_any_compile) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    pie_wasmgen_opts o = {.n_funcs = 50000};
    char msg[PIE_STATUS_MSG_MAX];
    pie_code rc = upload_end(upload_start(&c, &o, WAIT_MS), WAIT_MS, msg);
    cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "upload of 50,000 functions: %s (%s)", pie_code_name(rc),
                 msg);
    cr_expect(strstr(msg, "it defines 50000 functions, more than the limit of 20000 "
                          "(programs.max_functions)") != NULL,
              "message: %s", msg);
    cr_expect_eq(wait_no_children(&c, 0), 0u, "a compiler is running");
    e2e_cluster_stop(&c);
}

Test(security, twenty_thousand_nested_blocks_are_refused_by_the_parser_not_blamed_on_simd) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    pie_wasmgen_opts o = {.nest = 20000};
    char msg[PIE_STATUS_MSG_MAX];
    pie_code rc = upload_end(upload_start(&c, &o, WAIT_MS), WAIT_MS, msg);
    cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "%s (%s)", pie_code_name(rc), msg);
    cr_expect(strstr(msg, "function 0 nests blocks more than 4096 deep (the limit, "
                          "programs.max_nesting)") != NULL,
              "message: %s", msg);

    /* With the limit raised, wasm2c gets the module and crashes: the error says so. */
    e2e_cluster_stop(&c);
    const char *env[] = {"PIE_PROGRAMS_MAX_NESTING=1000000", "PIE_RUNTIME_TIER0_WASM2C=true",
                         NULL};
    e2e_cluster_start_env(&c, env);
    o.nest = 200000; /* beyond any stack wasm2c may have: ~550 bytes of it per level */
    rc = upload_end(upload_start(&c, &o, WAIT_MS), WAIT_MS, msg);
    cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "%s (%s)", pie_code_name(rc), msg);
    cr_expect(strstr(msg, "wasm2c (translate to C) crashed on this module, killed by SIG") != NULL,
              "message: %s", msg);
    cr_expect_null(strstr(msg, "SIMD"), "a crash blamed on SIMD: %s", msg);
    e2e_cluster_stop(&c);
}

/* ---- compiles that reached wasm2c ----------------------------------------------------------- */

Test(security, a_compile_is_killed_when_its_client_goes_away) {
    e2e_cluster c;
    const char *env[] = {RAISED_LIMITS, NULL};
    e2e_cluster_start_env(&c, env);
    pie_wasmgen_opts o = {.n_funcs = 50000};
    rpc_stream *s = upload_start(&c, &o, WAIT_MS);
    cr_assert_neq(wait_new_child(&c, NULL, 0, 30000), 0, "no compiler started");
    rpc_stream_cancel(s); /* the client goes away */
    char msg[PIE_STATUS_MSG_MAX];
    cr_expect_eq(upload_end(s, WAIT_MS, msg), PIE_CANCELLED, "%s", msg);
    size_t left = wait_no_children(&c, 10000);
    cr_expect_eq(left, 0u, "%zu compiler processes still run 10 s after the client went away",
                 left);

    /* and when its deadline passes */
    o.salt = 1;
    s = upload_start(&c, &o, 5000);
    cr_assert_neq(wait_new_child(&c, NULL, 0, 30000), 0, "no compiler started");
    pie_code rc = upload_end(s, WAIT_MS, msg);
    cr_expect_eq(rc, PIE_DEADLINE_EXCEEDED, "%s (%s)", pie_code_name(rc), msg);
    left = wait_no_children(&c, 10000);
    cr_expect_eq(left, 0u, "%zu compiler processes still run 10 s after the client's deadline",
                 left);
    e2e_cluster_stop(&c);
}

Test(security, sigterm_does_not_wait_for_a_compile) {
    e2e_cluster c;
    const char *env[] = {RAISED_LIMITS, NULL};
    e2e_cluster_start_env(&c, env);
    pie_wasmgen_opts o = {.n_funcs = 50000};
    rpc_stream *s = upload_start(&c, &o, WAIT_MS);
    cr_assert_neq(wait_new_child(&c, NULL, 0, 30000), 0, "no compiler started");
    pie_status st;
    int64_t t0 = pie_test_now_ms();
    cr_assert_eq(pie_proc_signal(c.lc, SIGTERM, &st), PIE_OK, "%s", st.msg);
    int code = pie_proc_wait(c.lc, 20000, &st);
    int64_t took = pie_test_now_ms() - t0;
    cr_expect_eq(code, 0, "SIGTERM during a compile: exit %d after %lld ms (%s)", code,
                 (long long)took, st.msg);
    char msg[PIE_STATUS_MSG_MAX];
    pie_code rc = upload_end(s, WAIT_MS, msg);
    cr_expect_eq(rc, PIE_UNAVAILABLE, "the upload cut by SIGTERM: %s (%s)", pie_code_name(rc), msg);
    e2e_cluster_stop(&c);
}

Test(security, uploads_beyond_the_compile_cap_queue_then_fail_resource_exhausted) {
    e2e_cluster c;
    const char *env[] = {RAISED_LIMITS, "PIE_RUNTIME_MAX_COMPILES=1", "PIE_RUNTIME_COMPILE_QUEUE=1",
                         NULL};
    e2e_cluster_start_env(&c, env);
    pie_wasmgen_opts o = {.n_funcs = 50000, .salt = 1};
    rpc_stream *a = upload_start(&c, &o, WAIT_MS);
    int first = wait_new_child(&c, NULL, 0, 30000);
    cr_assert_neq(first, 0, "no compiler started");
    /* wasm2c's compiler (tcc) starts right after it, reading its output through a pipe: the
     * first compile is both (a fixed sleep here once saw tcc arrive late, under load, and
     * counted it as a second compile) */
    int seen[16];
    size_t n_seen = 0;
    for (int64_t until = pie_test_now_ms() + 30000;
         (n_seen = children(pie_proc_pid(c.lc), seen, 16)) < 2 && pie_test_now_ms() < until;)
        pie_test_sleep_ms(20);
    cr_assert_eq(n_seen, 2u, "the first compile runs %zu processes, want wasm2c and tcc", n_seen);

    /* Two more while the first compiles: one waits in the queue, the other is refused. */
    o.salt = 2;
    rpc_stream *b = upload_start(&c, &o, WAIT_MS);
    o.salt = 3;
    rpc_stream *d = upload_start(&c, &o, WAIT_MS);
    char msg[PIE_STATUS_MSG_MAX];
    rpc_stream *queued = NULL;
    pie_code rc = PIE_UNKNOWN;
    for (int64_t until = pie_test_now_ms() + 30000;
         rc == PIE_UNKNOWN && pie_test_now_ms() < until;) {
        if ((rc = upload_end(b, 100, msg)) != PIE_UNKNOWN) {
            queued = d;
        } else if ((rc = upload_end(d, 100, msg)) != PIE_UNKNOWN) {
            queued = b;
        }
    }
    cr_assert_neq(rc, PIE_UNKNOWN, "neither upload beyond the cap was answered within 30 s");
    cr_expect_eq(rc, PIE_RESOURCE_EXHAUSTED, "%s (%s)", pie_code_name(rc), msg);
    cr_expect(strstr(msg, "1 compiles running (the limit, runtime.max_compiles) and 1 waiting "
                          "(the limit, runtime.compile_queue)") != NULL,
              "message: %s", msg);
    int second = wait_new_child(&c, seen, n_seen, 500);
    char comm[64] = "";
    if (second) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/comm", second);
        FILE *f = fopen(path, "r");
        if (f) {
            if (!fgets(comm, sizeof comm, f)) comm[0] = '\0';
            fclose(f);
        }
    }
    cr_expect_eq(second, 0, "a second compile started (pid %d, %s)", second, comm);

    /* The first client goes away: the queued upload compiles next. */
    rpc_stream_cancel(a);
    upload_end(a, WAIT_MS, msg);
    cr_expect_neq(wait_new_child(&c, seen, n_seen, 30000), 0, "the queued upload never compiled");
    rpc_stream_cancel(queued);
    upload_end(queued, WAIT_MS, msg);
    size_t left = wait_no_children(&c, 10000);
    cr_expect_eq(left, 0u, "%zu compiler processes still run", left);
    e2e_cluster_stop(&c);
}
