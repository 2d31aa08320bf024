/* pie_testranks.c — see pie_testranks.h. */
#include "pie_testranks.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/wait.h>

/* LeakSanitizer's check, present only in sanitized builds: a rank ends with _exit (no atexit
 * handlers of the test process may run in it), which skips the check LeakSanitizer makes at
 * exit, so the rank asks for it. */
extern int __lsan_do_recoverable_leak_check(void) __attribute__((weak));

static unsigned testranks_group; /* several groups in one test process get distinct names */

void pie_testranks_next_name(char *buf, size_t cap) {
    (void)snprintf(buf, cap, "/pie-test-tp-%ld-%u", (long)getpid(), testranks_group);
}

int pie_testranks_run(uint32_t n_ranks, pie_testranks_fn fn, void *arg, int *status) {
    char name[PIE_TESTRANKS_NAME_MAX];
    pie_testranks_next_name(name, sizeof name);
    testranks_group++;
    pid_t pids[PIE_TESTRANKS_MAX];
    if (n_ranks == 0 || n_ranks > PIE_TESTRANKS_MAX) return -1;
    uint32_t started = 0;
    for (; started < n_ranks; started++) {
        fflush(NULL);
        pid_t p = fork();
        if (p < 0) break;
        if (p == 0) {
            int rc = fn(started, n_ranks, name, arg);
            if (__lsan_do_recoverable_leak_check && __lsan_do_recoverable_leak_check() != 0 &&
                rc == 0)
                rc = 1;
            fflush(NULL);
            _exit(rc == 0 ? 0 : (rc & 0x7f ? rc & 0x7f : 1));
        }
        pids[started] = p;
    }
    int failed = started < n_ranks ? -1 : 0;
    for (uint32_t r = 0; r < started; r++) {
        int ws = 0;
        while (waitpid(pids[r], &ws, 0) < 0 && errno == EINTR) {}
        status[r] = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + (WIFSIGNALED(ws) ? WTERMSIG(ws) : 0);
        if (failed >= 0 && status[r] != 0) failed++;
    }
    return failed;
}

void pie_testranks_expect_ok(uint32_t n_ranks, pie_testranks_fn fn, void *arg) {
    int status[PIE_TESTRANKS_MAX];
    int failed = pie_testranks_run(n_ranks, fn, arg, status);
    cr_assert_geq(failed, 0, "fork failed");
    for (uint32_t r = 0; r < n_ranks; r++)
        cr_expect_eq(status[r], 0, "rank %u of %u failed (status %d; its stderr says why)", r,
                     n_ranks, status[r]);
}

uint64_t pie_testranks_hash(const void *bytes, size_t n) {
    const unsigned char *b = bytes;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}
