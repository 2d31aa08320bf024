/* fuzz_util.h — what the libFuzzer harnesses of tests/fuzz share: a scratch directory per
 * process, writing an input to a file there, and a check that aborts with a message (libFuzzer
 * then saves the input as a crash).
 *
 * Header-only on purpose: each harness is one executable of one .c file plus the libraries it
 * exercises, so that a crash reproduces with `fuzz_<target> <file>` and nothing else. */
#ifndef PIE_FUZZ_UTIL_H
#define PIE_FUZZ_UTIL_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pie_file.h"
#include "pie_status.h"

/* A property the code under test promised and broke: print why, abort (a libFuzzer finding). */
static void fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fuzz_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz: property violated: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

/* The process's scratch directory ($TMPDIR or /tmp, made once, removed at exit). Files the
 * harness writes there are overwritten by the next input. */
static char fuzz_dir_path[512];

static inline void fuzz_dir_remove(void) {
    char cmd[600];
    if (fuzz_dir_path[0] == '\0') return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", fuzz_dir_path);
    if (system(cmd) != 0) fprintf(stderr, "fuzz: could not remove %s\n", fuzz_dir_path);
}

static inline const char *fuzz_dir(void) {
    if (fuzz_dir_path[0] == '\0') {
        const char *tmp = getenv("TMPDIR");
        snprintf(fuzz_dir_path, sizeof fuzz_dir_path, "%s/pie-fuzz-XXXXXX",
                 tmp && tmp[0] ? tmp : "/tmp");
        if (mkdtemp(fuzz_dir_path) == NULL) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(fuzz_dir_remove);
    }
    return fuzz_dir_path;
}

/* Writes n bytes to <fuzz_dir>/<name> (replacing it) and returns the path in buf. */
static inline const char *fuzz_write_file(const char *name, const void *data, size_t n, char *buf,
                                          size_t buf_len) {
    snprintf(buf, buf_len, "%s/%s", fuzz_dir(), name);
    FILE *f = fopen(buf, "wb");
    if (f == NULL || (n > 0 && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror("fuzz: writing a scratch file");
        abort();
    }
    return buf;
}

/* Reads a whole file of the repository (a seed model's tokenizer.json, config.json); aborts
 * if it cannot. Free with free(). */
static inline char *fuzz_read_file(const char *path, size_t *len) {
    char *buf = NULL;
    pie_status st;
    if (pie_file_read(path, "fuzz fixture", (size_t)64 << 20, &buf, len, &st) != PIE_OK) {
        fprintf(stderr, "fuzz: %s\n", st.msg);
        abort();
    }
    return buf;
}

#endif
