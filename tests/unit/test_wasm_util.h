/* test_wasm_util.h — what the wasm runtime's tests share: a cache directory of their own per test
 * and module bytes read from files (fixtures built into PIE_WASM_FIXTURES, or what a tool wrote).
 *
 * Each test runs in its own process (Criterion's default), so one directory per process:
 * TestSuite(name, .init = wt_setup, .fini = wt_teardown) makes it under /tmp and removes it. */
#ifndef TEST_WASM_UTIL_H
#define TEST_WASM_UTIL_H

#include <criterion/criterion.h>
#include <errno.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The test's directory: the runtime's cache_dir, and room for the files a test writes. */
static char wt_dir[64];

static inline int wt_rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static inline void wt_setup(void) {
    snprintf(wt_dir, sizeof wt_dir, "/tmp/lc_wasm_test.XXXXXX");
    cr_assert_not_null(mkdtemp(wt_dir), "mkdtemp: %s", strerror(errno));
}

static inline void wt_teardown(void) { nftw(wt_dir, wt_rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* Empties the directory (a runtime that follows starts from an empty cache). */
static inline void wt_dir_empty(void) {
    wt_teardown();
    cr_assert_eq(mkdir(wt_dir, 0700), 0, "mkdir %s: %s", wt_dir, strerror(errno));
}

typedef struct wt_bytes {
    uint8_t *data;
    size_t len;
} wt_bytes;

/* The whole file (not empty); the caller frees data. */
static inline wt_bytes wt_read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "open %s: %s", path, strerror(errno));
    wt_bytes b = {0};
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert_gt(n, 0, "%s is empty", path);
    rewind(f);
    b.data = malloc((size_t)n);
    cr_assert_not_null(b.data);
    b.len = fread(b.data, 1, (size_t)n, f);
    cr_assert_eq(b.len, (size_t)n, "short read of %s", path);
    fclose(f);
    return b;
}

/* The fixture module <name>.wasm (tests/wasm/<name>.c, built into PIE_WASM_FIXTURES). */
static inline wt_bytes wt_fixture(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.wasm", PIE_WASM_FIXTURES, name);
    return wt_read_file(path);
}

#endif
