/* lc_echo.c — fixture of the lifecycle tests and benchmark: a small inferlet that talks to its
 * client through the raw `pie` ABI (sdk/include/pie_abi.h), in the mode argv[1] names:
 *   exit N       prints "hello <args>" to stdout and "to stderr" to stderr, exits with code N
 *   echo         answers every client message M with the message "echo:M" until the client
 *                closes its input, then prints "input closed after K messages" and exits 0
 *   spam N       writes N bytes to stdout in lines of 100 bytes, then exits 0
 *   wait         waits for one client message (or end of input), then exits 0 (idle instance)
 *   bench-host N times N pie.model_count calls (answered in-process) and prints ns per call
 *   bench-gpu N  creates a queue and times N awaited synchronize round trips (lifecycle →
 *                controller → worker → back), printing the median and mean in ns
 *   bench-dist N forwards one token, then times N awaited next_dist round trips on its output
 *                embedding (top_k 1), printing the median and mean in ns
 *   abuse KIND   misuses the API the way a hostile inferlet would, KIND = alloc-storm (KV pages
 *                until refused), foreign-ids (frees and forwards ids it never allocated),
 *                oversize (sends a message above its quota), bad-url (fetches a URL outside the
 *                allowlist), future-storm (arms futures until refused); when the host refuses,
 *                prints "refused: <pie_last_error>" to stderr and exits 1, as the SDK does */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie_abi.h"

#define F_IN  1u /* future ids */
#define F_GPU 2u

static char buf[1 << 20];

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The next client message into buf: its length, or -code (OUT_OF_RANGE at end of input). */
static int32_t next_message(void) {
    int32_t rc = pie_receive(F_IN);
    if (rc < 0) return rc;
    return pie_future_result(F_IN, buf, sizeof buf);
}

static int echo(void) {
    int n = 0;
    for (;;) {
        int32_t len = next_message();
        if (len == PIE_ABI_E_OUT_OF_RANGE) break;
        if (len < 0) {
            fprintf(stderr, "receive failed: %d\n", (int)len);
            return 3;
        }
        static char out[sizeof buf + 8];
        memcpy(out, "echo:", 5);
        memcpy(out + 5, buf, (size_t)len);
        if (pie_send(out, (uint32_t)len + 5) < 0) return 4;
        n++;
    }
    printf("input closed after %d messages\n", n);
    return 0;
}

static int spam(long n) {
    char line[101];
    memset(line, 'x', 99);
    line[99] = '\n';
    line[100] = 0;
    for (long i = 0; i < n; i += 100) fputs(line, stdout);
    return 0;
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static int bench_host(long n) {
    int64_t t0 = now_ns();
    int32_t sum = 0;
    for (long i = 0; i < n; i++) sum += pie_model_count();
    int64_t t1 = now_ns();
    printf("host_call_ns=%.1f models=%d\n", (double)(t1 - t0) / (double)n, (int)(sum / n));
    return 0;
}

/* Synchronizes queue 1: the first deferred error of its calls, as a negative code, or 0. */
static int32_t sync_queue(void) {
    int32_t rc = pie_synchronize(1, F_GPU);
    return rc < 0 ? rc : pie_future_result(F_GPU, 0, 0);
}

#define MAX_TIMES 100000
static int64_t times[MAX_TIMES];

/* Prints "<name>_p50_ns=... mean_ns=..." of times[0..n). */
static void print_times(const char *name, long n) {
    int64_t total = 0;
    for (long i = 0; i < n; i++) total += times[i];
    qsort(times, (size_t)n, sizeof times[0], cmp64);
    printf("%s_p50_ns=%lld mean_ns=%lld\n", name, (long long)times[n / 2], (long long)(total / n));
}

static int bench_gpu(long n) {
    if (pie_create_queue(1, "", 0) < 0) return 5;
    if (n > MAX_TIMES) n = MAX_TIMES;
    for (long i = 0; i < n; i++) {
        int64_t t0 = now_ns();
        if (pie_synchronize(1, F_GPU) < 0 || pie_future_result(F_GPU, 0, 0) < 0) return 6;
        times[i] = now_ns() - t0;
    }
    print_times("gpu_roundtrip", n);
    return 0;
}

static int bench_dist(long n) {
    uint32_t page = 0, emb[2] = {0, 1}, tok = 1, pos = 0, in = 0, out = 1;
    if (pie_create_queue(1, "", 0) < 0 || pie_alloc_kv_pages(1, &page, 1) < 0 ||
        pie_alloc_embeds(1, emb, 2) < 0 || pie_embed_text(1, &in, &tok, &pos, 1) < 0)
        return 5;
    pie_abi_forward d = {.input_embed_ids = (uint32_t)(uintptr_t)&in,
                         .n_inputs = 1,
                         .output_kv_page_ids = (uint32_t)(uintptr_t)&page,
                         .n_output_kv_pages = 1,
                         .output_embed_ids = (uint32_t)(uintptr_t)&out,
                         .n_outputs = 1};
    if (pie_forward(1, &d) < 0 || sync_queue() < 0) return 6;
    if (n > MAX_TIMES) n = MAX_TIMES;
    for (long i = 0; i < n; i++) {
        int64_t t0 = now_ns();
        if (pie_next_dist(1, &out, 1, 1, 0.0f, F_GPU) < 0 ||
            pie_future_result(F_GPU, buf, sizeof buf) < 0)
            return 7;
        times[i] = now_ns() - t0;
    }
    print_times("next_dist_roundtrip", n);
    return 0;
}

/* Reports the host's refusal of the last call the way the SDK does: stderr, exit code 1. */
static int refused(int32_t rc) {
    char msg[512];
    int32_t n = pie_last_error(msg, sizeof msg - 1);
    msg[n < 0 ? 0 : n > (int32_t)sizeof msg - 1 ? (int32_t)sizeof msg - 1 : n] = 0;
    fprintf(stderr, "refused (%d): %s\n", (int)rc, msg);
    return 1;
}

static int alloc_storm(void) {
    static uint32_t ids[4096];
    for (uint32_t round = 0; round < 1024; round++) {
        for (uint32_t i = 0; i < 4096; i++) ids[i] = round * 4096 + i;
        int32_t rc = pie_alloc_kv_pages(1, ids, 4096);
        if (rc < 0 || (rc = sync_queue()) < 0) return refused(rc);
    }
    return 0; /* 4M pages granted: no quota held */
}

static int foreign_ids(void) {
    uint32_t never = 777;
    int32_t rc = pie_dealloc_kv_pages(1, &never, 1);
    if (rc < 0 || (rc = sync_queue()) < 0) return refused(rc);
    return 0;
}

static int abuse(const char *kind) {
    if (strcmp(kind, "oversize") == 0) {
        int32_t rc = pie_send(buf, sizeof buf); /* 1 MiB: above the test's quota */
        return rc < 0 ? refused(rc) : 0;
    }
    if (strcmp(kind, "bad-url") == 0) {
        static const char url[] = "http://169.254.169.254/latest/meta-data/";
        int32_t rc = pie_http_request("GET", 3, url, sizeof url - 1, "", 0, "", 0, F_GPU);
        if (rc >= 0) rc = pie_future_result(F_GPU, buf, sizeof buf);
        return rc < 0 ? refused(rc) : 0;
    }
    if (strcmp(kind, "future-storm") == 0) {
        for (uint32_t f = 100; f < 100 + (1u << 20); f++) {
            int32_t rc = pie_receive(f);
            if (rc < 0) return refused(rc);
        }
        return 0;
    }
    if (pie_create_queue(1, "", 0) < 0) return refused(-1);
    if (strcmp(kind, "alloc-storm") == 0) return alloc_storm();
    if (strcmp(kind, "foreign-ids") == 0) return foreign_ids();
    fprintf(stderr, "unknown abuse %s\n", kind);
    return 2;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "exit";
    long n = argc > 2 ? atol(argv[2]) : 0;
    if (strcmp(mode, "exit") == 0) {
        printf("hello");
        for (int i = 1; i < argc; i++) printf(" %s", argv[i]);
        printf("\n");
        fprintf(stderr, "to stderr\n");
        return (int)n;
    }
    if (strcmp(mode, "echo") == 0) return echo();
    if (strcmp(mode, "spam") == 0) return spam(n);
    if (strcmp(mode, "wait") == 0) return next_message() < -11 ? 1 : 0;
    if (strcmp(mode, "bench-host") == 0) return bench_host(n > 0 ? n : 100000);
    if (strcmp(mode, "bench-gpu") == 0) return bench_gpu(n > 0 ? n : 1000);
    if (strcmp(mode, "bench-dist") == 0) return bench_dist(n > 0 ? n : 1000);
    if (strcmp(mode, "abuse") == 0) return abuse(argc > 2 ? argv[2] : "");
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
