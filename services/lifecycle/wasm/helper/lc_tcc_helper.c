/* lc_tcc_helper.c — pie-tcc-helper: tier 0's compiler kept warm between modules.
 *
 * Owns: compiling the C text lc_wasm's own translator makes into a shared object with libtcc
 * (the same tcc 0.9.27 as the `tcc` program), module after module, in one long-lived process
 * that the lifecycle starts and keeps. A tcc child per module pays an exec and, on a VM whose
 * fresh pages are dear, some 800 page faults every time; here the heap stays faulted in
 * (bench/results/wasm.md, 2026-11-30: 36.6 ms per compile of `big` as a child, 17.5 ms here).
 *
 * Protocol, on descriptor 3 (a SOCK_SEQPACKET socket; lc_wasm_compile.c is the other end): a
 * request is one message holding the output path (NUL-terminated) with the C text's socket
 * attached (SCM_RIGHTS); the text is read to its end from that socket as tcc compiles it
 * (descriptor 0, tcc's "-"), and the answer is one message: "ok", or "error: " and tcc's first
 * diagnostic. The helper ends when the lifecycle closes its end. A crash or a hang costs the
 * compile in progress only: the lifecycle kills the helper's process group and starts another.
 * Does not own: time limits, cancel, the fallback to wasm2c (lc_wasm_compile.c). */
#include <errno.h>
#include <fcntl.h>
#include <libtcc.h>
#include <limits.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define HELPER_FD      3
#define HELPER_MSG_MAX 1024 /* an answer's size limit, lc_wasm_compile.c's buffer */

/* tcc's first diagnostic of a compile (the rest follow from it). */
typedef struct first_error {
    char msg[HELPER_MSG_MAX - 16];
    int seen;
} first_error;

static void on_error(void *user, const char *msg) {
    first_error *e = user;
    if (e->seen++) return;
    snprintf(e->msg, sizeof e->msg, "%s", msg);
}

/* The next request: 1 with path and *text_fd filled, 0 when the lifecycle closed, -1 on a
 * malformed request or an error. */
static int recv_request(char *path, size_t cap, int *text_fd) {
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = path, .iov_len = cap - 1};
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t n;
    do n = recvmsg(HELPER_FD, &mh, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n == 0) return 0;
    if (n < 0) return -1;
    path[n] = '\0';
    *text_fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
            c->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(text_fd, CMSG_DATA(c), sizeof(int));
    if (*text_fd < 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) return -1;
    return 1;
}

/* Compiles what descriptor 0 holds into path; 0 or -1 with e filled. */
static int compile(const char *path, first_error *e) {
    TCCState *s = tcc_new();
    if (s == NULL) {
        snprintf(e->msg, sizeof e->msg, "tcc_new failed");
        return -1;
    }
    tcc_set_error_func(s, e, on_error);
    int rc = tcc_set_output_type(s, TCC_OUTPUT_DLL);
    tcc_set_options(s, "-fPIC");
    if (rc == 0) rc = tcc_add_file(s, "-");
    if (rc == 0) rc = tcc_add_library(s, "m");
    if (rc == 0) rc = tcc_output_file(s, path);
    tcc_delete(s);
    if (rc != 0 && !e->seen) snprintf(e->msg, sizeof e->msg, "tcc failed without a message");
    return rc == 0 ? 0 : -1;
}

int main(void) {
    /* Keep freed memory in the heap: the next module's compile reuses it without faulting. */
    (void)mallopt(M_TRIM_THRESHOLD, 256 << 20);
    (void)mallopt(M_MMAP_THRESHOLD, 256 << 20);
    signal(SIGPIPE, SIG_IGN);
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) return 1;
    for (;;) {
        char path[PATH_MAX];
        int text_fd;
        int r = recv_request(path, sizeof path, &text_fd);
        if (r <= 0) return r == 0 ? 0 : 1;
        if (dup2(text_fd, 0) < 0) return 1;
        close(text_fd);
        first_error e = {{0}, 0};
        int ok = compile(path, &e) == 0;
        /* Drop the text's socket: a translator still writing learns that tcc stopped. */
        if (dup2(devnull, 0) < 0) return 1;
        char answer[HELPER_MSG_MAX];
        int len = ok ? snprintf(answer, sizeof answer, "ok")
                     : snprintf(answer, sizeof answer, "error: %s", e.msg);
        if (len < 0) return 1;
        if (len >= (int)sizeof answer) len = (int)sizeof answer - 1;
        if (send(HELPER_FD, answer, (size_t)len, MSG_NOSIGNAL) != len) return 1;
    }
}
