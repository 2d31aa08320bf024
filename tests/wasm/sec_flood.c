/* sec_flood.c — fixture of tests/security/test_run_output.c: an inferlet that writes output as
 * fast as it can, to check that a slow client slows it down instead of losing output (issue 11,
 * hole 4). Raw `pie` ABI; argv[1] names what it writes, N and SIZE are argv[2] and argv[3]:
 *   send N SIZE   N messages (pie_send) of SIZE bytes each (SIZE >= 8): message i starts with
 *                 i as 8 decimal digits, the rest is 'a' + i % 26
 *   mixed N SIZE  the same N messages, each followed by the stdout line "line <i>\n" (stdout is
 *                 a character device, so wasi-libc writes each line with its own fd_write)
 * With a fourth argument "wait" it first waits for one client message (or end of input). Then
 * it prints "sent N" to stderr and exits 0; exits 3 if a send failed (its error to stderr). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_abi.h"

static char msg[4 << 20];

/* Waits for the client's first message or end of input (its content is not used). */
static void wait_for_client(void) {
    if (pie_receive(1) >= 0) pie_future_result(1, msg, sizeof msg);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    long n = argc > 2 ? atol(argv[2]) : 0;
    long size = argc > 3 ? atol(argv[3]) : 0;
    bool mixed = strcmp(mode, "mixed") == 0;
    if ((!mixed && strcmp(mode, "send") != 0) || n < 0 || size < 8 || size > (long)sizeof msg) {
        fprintf(stderr, "usage: send|mixed N SIZE (8 <= SIZE <= %zu)\n", sizeof msg);
        return 2;
    }
    if (argc > 4 && strcmp(argv[4], "wait") == 0) wait_for_client();
    for (long i = 0; i < n; i++) {
        char head[16];
        snprintf(head, sizeof head, "%08ld", i % 100000000);
        memcpy(msg, head, 8);
        memset(msg + 8, 'a' + (int)(i % 26), (size_t)size - 8);
        int32_t rc = pie_send(msg, (uint32_t)size);
        if (rc < 0) {
            char err[256];
            int32_t len = pie_last_error(err, sizeof err - 1);
            err[len > 0 ? len : 0] = 0;
            fprintf(stderr, "send %ld failed: %d %s\n", i, (int)rc, err);
            return 3;
        }
        if (mixed) printf("line %ld\n", i);
    }
    fprintf(stderr, "sent %ld\n", n);
    return 0;
}
