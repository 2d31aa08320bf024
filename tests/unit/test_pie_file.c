/* test_pie_file.c — pie_file_read: the one whole-file read of the services and tools, and the
 * exact text and code of each way it fails (the promise made in pie_file.h).
 *
 * Each test runs in its own process (Criterion's default) inside a fresh mkdtemp directory, so
 * paths are written as "f.txt" and messages read like the ones users see. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pie_file.h"

/* ---- fixture -------------------------------------------------------------------------------- */

static char tmpdir[64];

static void setup(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/pie-test-file-XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp: %s", strerror(errno));
    cr_assert_eq(chdir(tmpdir), 0, "chdir: %s", strerror(errno));
}

static void teardown(void) {
    const char *names[] = {"f.txt", "empty.txt", "at.txt", "over.txt", "fifo", "secret.txt"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) (void)unlink(names[i]);
    (void)rmdir("adir");
    (void)rmdir(tmpdir);
}

TestSuite(pie_file, .init = setup, .fini = teardown);

static void write_bytes(const char *path, const char *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "fopen %s: %s", path, strerror(errno));
    cr_assert_eq(fwrite(bytes, 1, n, f), n, "fwrite %s", path);
    cr_assert_eq(fclose(f), 0, "fclose %s", path);
}

/* Reads path with a 16-byte cap and asserts that it fails with code and exactly msg. */
static void read_fails(const char *path, pie_code code, const char *msg) {
    char *buf = (char *)1;
    size_t len = 99;
    pie_status st;
    pie_code rc = pie_file_read(path, "test file", 16, &buf, &len, &st);
    cr_assert_eq(rc, code, "%s: got %s (%s), want %s", path, pie_code_name(rc), st.msg,
                 pie_code_name(code));
    cr_assert_eq(st.code, code);
    cr_assert_str_eq(st.msg, msg);
    cr_assert_null(buf, "%s: *buf is set on failure", path);
    cr_assert_eq(len, 0, "%s: *len is %zu on failure", path, len);
}

/* ---- reads ---------------------------------------------------------------------------------- */

/* Writes the n bytes (a literal: bytes[n] is its NUL) to path and asserts that a read with a
 * 16-byte cap gives back exactly them, followed by a NUL. */
static void reads_back(const char *path, const char *bytes, size_t n) {
    write_bytes(path, bytes, n);
    char *buf = NULL;
    size_t len = 99;
    pie_status st;
    cr_assert_eq(pie_file_read(path, "test file", 16, &buf, &len, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(len, n, "%s: %zu bytes, want %zu", path, len, n);
    cr_assert_not_null(buf);
    cr_assert_eq(memcmp(buf, bytes, n + 1), 0, "%s: bytes or the NUL after them differ", path);
    free(buf);
}

Test(pie_file, regular_file_comes_back_whole_and_nul_terminated) {
    reads_back("f.txt", "ab\0cd", 5);
}

Test(pie_file, empty_file_is_an_empty_string) { reads_back("empty.txt", "", 0); }

Test(pie_file, file_of_exactly_the_cap_is_read_one_byte_more_is_refused) {
    reads_back("at.txt", "0123456789abcdef", 16);
    write_bytes("over.txt", "0123456789abcdefg", 17);
    read_fails("over.txt", PIE_INVALID_ARGUMENT, "test file 'over.txt' is larger than 16 bytes");
}

/* ---- failures ------------------------------------------------------------------------------- */

Test(pie_file, missing_file_is_not_found) {
    read_fails("nope.txt", PIE_NOT_FOUND,
               "cannot open test file 'nope.txt': No such file or "
               "directory");
    write_bytes("f.txt", "x", 1);
    read_fails("f.txt/below", PIE_NOT_FOUND,
               "cannot open test file 'f.txt/below': Not a directory");
}

Test(pie_file, directory_is_not_a_regular_file) {
    cr_assert_eq(mkdir("adir", 0700), 0, "mkdir: %s", strerror(errno));
    read_fails("adir", PIE_INVALID_ARGUMENT, "test file 'adir' is not a regular file");
}

Test(pie_file, fifo_is_refused_without_blocking, .timeout = 10) {
    cr_assert_eq(mkfifo("fifo", 0600), 0, "mkfifo: %s", strerror(errno));
    read_fails("fifo", PIE_INVALID_ARGUMENT, "test file 'fifo' is not a regular file");
}

/* As root the read runs in a child that became nobody (root opens any file); the parent stays
 * root so that the teardown can remove the directory. */
Test(pie_file, unreadable_file_is_permission_denied) {
    write_bytes("secret.txt", "x", 1);
    cr_assert_eq(chmod("secret.txt", 0), 0, "chmod: %s", strerror(errno));
    if (geteuid() != 0) {
        read_fails("secret.txt", PIE_PERMISSION_DENIED,
                   "cannot open test file 'secret.txt': Permission denied");
        return;
    }
    cr_assert_eq(chmod(".", 0711), 0, "chmod: %s", strerror(errno)); /* nobody may look up */
    int fds[2];
    cr_assert_eq(pipe(fds), 0, "pipe: %s", strerror(errno));
    pid_t pid = fork();
    cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
    if (pid == 0) { /* child: nobody, reports the status through the pipe */
        pie_status st = {.code = PIE_UNKNOWN};
        char *buf = NULL;
        size_t len = 0;
        if (setgid(65534) == 0 && setuid(65534) == 0) {
            if (pie_file_read("secret.txt", "test file", 16, &buf, &len, &st) == PIE_OK) free(buf);
        } else {
            snprintf(st.msg, sizeof st.msg, "setgid/setuid: %s", strerror(errno));
        }
        _exit(write(fds[1], &st, sizeof st) == (ssize_t)sizeof st ? 0 : 1);
    }
    (void)close(fds[1]);
    pie_status st;
    ssize_t got = read(fds[0], &st, sizeof st);
    (void)close(fds[0]);
    int wstatus = 0;
    cr_assert_eq(waitpid(pid, &wstatus, 0), pid, "waitpid: %s", strerror(errno));
    cr_assert(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0, "child failed: 0x%x", wstatus);
    cr_assert_eq(got, (ssize_t)sizeof st, "child's status is %zd bytes", got);
    cr_assert_eq(st.code, PIE_PERMISSION_DENIED, "got %s (%s)", pie_code_name(st.code), st.msg);
    cr_assert_str_eq(st.msg, "cannot open test file 'secret.txt': Permission denied");
}
