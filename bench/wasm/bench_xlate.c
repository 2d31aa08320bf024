/* bench_xlate.c — runs lc_wasm's own translator (services/lifecycle/wasm/lc_wasm_xlate.c) on a
 * module file: writes the C (for tcc, for reading, for cold_profile.sh's instruction counts) and
 * prints how long translating took.
 * Usage: bench_xlate module.wasm [out.c] [--repeat N] [--cname NAME]
 * Exit status: 0 translated, 3 declined or invalid (the reason on stderr), 2 usage or I/O. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lc_wasm_xlate.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    const char *in = NULL, *out = NULL, *cname = "wbench";
    int repeat = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--repeat") == 0 && i + 1 < argc)
            repeat = atoi(argv[++i]);
        else if (strcmp(argv[i], "--cname") == 0 && i + 1 < argc)
            cname = argv[++i];
        else if (in == NULL)
            in = argv[i];
        else if (out == NULL)
            out = argv[i];
    }
    if (in == NULL || repeat < 1) {
        fprintf(stderr, "usage: bench_xlate module.wasm [out.c] [--repeat N] [--cname NAME]\n");
        return 2;
    }
    FILE *f = fopen(in, "rb");
    if (f == NULL) {
        perror(in);
        return 2;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *wasm = malloc(n > 0 ? (size_t)n : 1);
    if (wasm == NULL || n < 0 || fread(wasm, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "%s: read failed\n", in);
        fclose(f);
        free(wasm);
        return 2;
    }
    fclose(f);
    lc_wasm_xlate_out x = {0};
    pie_status st;
    double best = 1e9;
    int rc = 0;
    for (int i = 0; i < repeat && rc == 0; i++) {
        free(x.c);
        double t0 = now_ms();
        pie_code c = lc_wasm_xlate(wasm, (size_t)n, cname, &x, &st);
        double t = now_ms() - t0;
        if (t < best) best = t;
        if (c != PIE_OK) {
            fprintf(stderr, "%s: %s\n", in, st.msg);
            rc = 3;
        }
    }
    if (rc == 0) {
        fprintf(stderr,
                "%s: %ld bytes of wasm, %zu bytes of C, %u functions; best of %d: %.3f ms\n", in, n,
                x.len, x.n_funcs, repeat, best);
        if (out != NULL) {
            FILE *o = fopen(out, "wb");
            if (o == NULL || fwrite(x.c, 1, x.len, o) != x.len || fclose(o) != 0) {
                perror(out);
                rc = 2;
            }
        }
    }
    free(x.c);
    free(wasm);
    return rc;
}
