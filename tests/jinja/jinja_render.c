/* tests/jinja/jinja_render.c — renders one chat template with one JSON context (tests/jinja).
 *
 * Usage: jinja_render TEMPLATE CONTEXT.json [MAX_OUT]
 *   prints the rendering (exact bytes, nothing added) and exits 0; on a parse or render error
 *   prints the message on stderr and exits 2; on bad usage or unreadable files exits 1. */
#include "gw_jinja.h"

#include <stdio.h>
#include <stdlib.h>

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t cap = 0, n = 0;
    if (!f) return NULL;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 4096;
            char *nb = realloc(buf, cap);
            if (!nb) goto fail;
            buf = nb;
        }
        size_t k = fread(buf + n, 1, cap - n, f);
        n += k;
        if (k == 0) break;
    }
    if (ferror(f)) goto fail;
    fclose(f);
    *len = n;
    return buf;
fail:
    free(buf);
    fclose(f);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: jinja_render TEMPLATE CONTEXT.json [MAX_OUT]\n");
        return 1;
    }
    size_t max_out = argc == 4 ? (size_t)strtoull(argv[3], NULL, 10) : (size_t)1 << 24;
    size_t len = 0;
    char *src = read_file(argv[1], &len), err[512];
    if (!src) {
        fprintf(stderr, "jinja_render: cannot read %s\n", argv[1]);
        return 1;
    }
    json_error_t jerr;
    json_t *ctx = json_load_file(argv[2], 0, &jerr);
    if (!ctx) {
        fprintf(stderr, "jinja_render: %s: %s (line %d)\n", argv[2], jerr.text, jerr.line);
        free(src);
        return 1;
    }
    int rc = 2;
    gw_jinja *t = gw_jinja_parse(src, len, err, sizeof err);
    if (t) {
        size_t out_len = 0;
        char *out = gw_jinja_render(t, ctx, max_out, &out_len, err, sizeof err);
        if (out) {
            rc = fwrite(out, 1, out_len, stdout) == out_len && fflush(stdout) == 0 ? 0 : 1;
            free(out);
        }
    }
    if (rc == 2) fprintf(stderr, "%s\n", err);
    gw_jinja_free(t);
    json_decref(ctx);
    free(src);
    return rc;
}
