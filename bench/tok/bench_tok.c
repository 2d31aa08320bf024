/* bench_tok.c — throughput of the byte-level BPE tokenizer (services/common/tok).
 *
 * Owns: the benchmark setup (train tokenizers with tools/tinymodel/bpe_train.py on the
 * committed corpus, or load a given tokenizer.json) and the measurements recorded in
 * bench/results/tok.md:
 *   encode, one call   — the corpus repeated to ~8 MB, encoded in one tok_encode call
 *   encode, per call   — the corpus encoded whole (76 KB) in each call: the per-call cache starts
 *                        empty every time
 *   encode, per line   — every line of the corpus its own call (short prompts, cold cache)
 *   decode             — the ids of the 8 MB text back to bytes
 *   stream             — the same ids pushed one at a time through a tok_stream
 *
 * Usage: bench_tok [--quick] [--vocab N] [--tokenizer PATH] [--text PATH] [--source DIR]
 *   --source: the repository root (default: derived from this file's path at build time).
 *   --tokenizer: benchmark this tokenizer.json instead of training llama3 and gpt2 styles.
 *   --text: encode this file instead of the corpus. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pie_file.h"
#include "tok.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of reps runs of fn, in seconds. */
typedef int (*bench_fn)(void *ctx);
static double timed(bench_fn fn, void *ctx, int reps, int *failed) {
    double t[16];
    if (reps > 16) reps = 16;
    for (int i = 0; i < reps; i++) {
        double t0 = now_s();
        if (fn(ctx) != 0) {
            *failed = 1;
            return 0;
        }
        t[i] = now_s() - t0;
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_double);
    return t[reps / 2];
}

typedef struct ctx {
    const tok *t;
    const char *text; /* the repeated text */
    size_t len;
    const char *unit; /* the corpus (or --text) once */
    size_t unit_len;
    size_t unit_reps; /* how many times "per call" encodes unit */
    uint32_t *ids;    /* ids of text */
    size_t n_ids;
} ctx;

static int encode_one_call(void *p) {
    ctx *c = p;
    pie_status st;
    uint32_t *ids;
    size_t n;
    if (tok_encode(c->t, c->text, c->len, true, &ids, &n, &st) != PIE_OK) {
        fprintf(stderr, "bench_tok: %s\n", st.msg);
        return 1;
    }
    free(ids);
    return 0;
}

static int encode_per_call(void *p) {
    ctx *c = p;
    pie_status st;
    for (size_t r = 0; r < c->unit_reps; r++) {
        uint32_t *ids;
        size_t n;
        if (tok_encode(c->t, c->unit, c->unit_len, true, &ids, &n, &st) != PIE_OK) {
            fprintf(stderr, "bench_tok: %s\n", st.msg);
            return 1;
        }
        free(ids);
    }
    return 0;
}

static int encode_per_line(void *p) {
    ctx *c = p;
    pie_status st;
    const char *s = c->unit, *end = c->unit + c->unit_len;
    while (s < end) {
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        const char *e = nl ? nl + 1 : end;
        uint32_t *ids;
        size_t n;
        if (tok_encode(c->t, s, (size_t)(e - s), true, &ids, &n, &st) != PIE_OK) {
            fprintf(stderr, "bench_tok: %s\n", st.msg);
            return 1;
        }
        free(ids);
        s = e;
    }
    return 0;
}

static int decode_all(void *p) {
    ctx *c = p;
    pie_status st;
    char *out;
    size_t len;
    if (tok_decode(c->t, c->ids, c->n_ids, &out, &len, &st) != PIE_OK || len != c->len) {
        fprintf(stderr, "bench_tok: decode: %s\n", st.msg);
        return 1;
    }
    free(out);
    return 0;
}

static int stream_all(void *p) {
    ctx *c = p;
    pie_status st;
    tok_stream *s;
    if (tok_stream_new(c->t, &s, &st) != PIE_OK) return 1;
    size_t total = 0;
    for (size_t i = 0; i < c->n_ids; i++) {
        const char *text;
        size_t len;
        if (tok_stream_push(s, c->ids + i, 1, &text, &len, &st) != PIE_OK) {
            tok_stream_free(s);
            return 1;
        }
        total += len;
    }
    tok_stream_free(s);
    return total == c->len ? 0 : 1;
}

static int bench_one(const char *label, const char *tok_path, const char *unit, size_t unit_len,
                     bool quick) {
    pie_status st;
    tok *t;
    double t0 = now_s();
    if (tok_load(tok_path, &t, &st) != PIE_OK) {
        fprintf(stderr, "bench_tok: %s\n", st.msg);
        return 1;
    }
    double load_ms = (now_s() - t0) * 1e3;

    size_t target = quick ? (size_t)2 << 20 : (size_t)8 << 20;
    size_t reps = unit_len ? (target + unit_len - 1) / unit_len : 1;
    char *text = malloc(reps * unit_len + 1);
    if (text == NULL) {
        tok_free(t);
        return 1;
    }
    for (size_t r = 0; r < reps; r++) memcpy(text + r * unit_len, unit, unit_len);
    ctx c = {.t = t, .text = text, .len = reps * unit_len, .unit = unit, .unit_len = unit_len,
             .unit_reps = quick ? 10 : 40};
    if (tok_encode(t, text, c.len, true, &c.ids, &c.n_ids, &st) != PIE_OK) {
        fprintf(stderr, "bench_tok: %s\n", st.msg);
        free(text);
        tok_free(t);
        return 1;
    }
    int reps_t = quick ? 3 : 7, failed = 0;
    double mb = (double)c.len / 1e6, unit_mb = (double)unit_len * (double)c.unit_reps / 1e6;
    double one = timed(encode_one_call, &c, reps_t, &failed);
    double per = timed(encode_per_call, &c, reps_t, &failed);
    double line = timed(encode_per_line, &c, reps_t, &failed);
    double dec = timed(decode_all, &c, reps_t, &failed);
    double str = timed(stream_all, &c, quick ? 1 : 3, &failed);
    if (!failed) {
        printf("%s: vocab %u, load %.1f ms, %.2f bytes/token\n", label, tok_vocab_size(t), load_ms,
               (double)c.len / (double)c.n_ids);
        printf("  encode, one call of %.1f MB : %7.1f MB/s\n", mb, mb / one);
        printf("  encode, %zu KB per call      : %7.1f MB/s\n", unit_len / 1000, unit_mb / per);
        printf("  encode, one call per line   : %7.1f MB/s\n", (double)unit_len / 1e6 / line);
        printf("  decode                      : %7.1f MB/s (%.1f M tokens/s)\n", mb / dec,
               (double)c.n_ids / 1e6 / dec);
        printf("  stream, one id per push     : %7.1f MB/s (%.1f M tokens/s)\n", mb / str,
               (double)c.n_ids / 1e6 / str);
    }
    free(c.ids);
    free(text);
    tok_free(t);
    return failed;
}

int main(int argc, char **argv) {
    bool quick = false;
    int vocab = 7000;
    const char *tok_path = NULL, *text_path = NULL;
    char source[4096];
    /* This file is bench/tok/bench_tok.c: the repository root is three levels up. */
    snprintf(source, sizeof source, "%s", __FILE__);
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(source, '/');
        if (slash == NULL) {
            snprintf(source, sizeof source, ".");
            break;
        }
        *slash = '\0';
    }
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (strcmp(argv[i], "--vocab") == 0 && i + 1 < argc) {
            vocab = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc) {
            tok_path = argv[++i];
        } else if (strcmp(argv[i], "--text") == 0 && i + 1 < argc) {
            text_path = argv[++i];
        } else if (strcmp(argv[i], "--source") == 0 && i + 1 < argc) {
            snprintf(source, sizeof source, "%s", argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--quick] [--vocab N] [--tokenizer PATH] [--text PATH] "
                            "[--source DIR]\n", argv[0]);
            return 2;
        }
    }
    char corpus[4200];
    snprintf(corpus, sizeof corpus, "%s/tools/tinymodel/corpus.txt", source);
    size_t unit_len;
    char *unit = NULL;
    pie_status rst;
    if (pie_file_read(text_path ? text_path : corpus, "text", SIZE_MAX, &unit, &unit_len, &rst) !=
        PIE_OK) {
        fprintf(stderr, "bench_tok: %s\n", rst.msg);
        return 1;
    }
    if (unit_len == 0) {
        fprintf(stderr, "bench_tok: the text is empty\n");
        free(unit);
        return 1;
    }
    printf("text: %s (%zu bytes)%s\n", text_path ? text_path : corpus, unit_len, quick ? ", --quick" : "");

    int rc = 0;
    if (tok_path != NULL) {
        rc = bench_one(tok_path, tok_path, unit, unit_len, quick);
    } else {
        char dir[] = "/tmp/bench_tok.XXXXXX";
        if (mkdtemp(dir) == NULL) {
            fprintf(stderr, "bench_tok: mkdtemp: %s\n", strerror(errno));
            free(unit);
            return 1;
        }
        static const char *const styles[] = {"llama3", "gpt2"};
        for (int s = 0; s < 2 && rc == 0; s++) {
            char path[4300], cmd[13000], label[64];
            snprintf(path, sizeof path, "%s/%s.json", dir, styles[s]);
            snprintf(cmd, sizeof cmd,
                     "/usr/bin/python3 %s/tools/tinymodel/bpe_train.py --corpus %s --vocab-size %d "
                     "--style %s --out %s",
                     source, corpus, vocab, styles[s], path);
            double t0 = now_s();
            if (system(cmd) != 0) {
                fprintf(stderr, "bench_tok: training failed: %s\n", cmd);
                rc = 1;
                break;
            }
            printf("trained %s, vocab %d, in %.2f s (bpe_train.py)\n", styles[s], vocab, now_s() - t0);
            snprintf(label, sizeof label, "%s style", styles[s]);
            rc = bench_one(label, path, unit, unit_len, quick);
            remove(path);
        }
        rmdir(dir);
    }
    free(unit);
    return rc;
}
