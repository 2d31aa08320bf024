/* bench_gateway.c — what the OpenAI gateway costs on top of a direct Run, and how it holds up
 * under many concurrent streams.
 *
 * Runs inside a local cluster (deploy/local/pie-local.sh --exec; reads PIE_LOCAL_GATEWAYS,
 * PIE_LOCAL_LIFECYCLES, PIE_LOCAL_BIN):
 *   1. Latency, interleaved rounds on an otherwise idle cluster: the same greedy completion
 *      (--tokens T, the model's stop tokens ignored) as a direct Run of the openai_chat inferlet
 *      (the gateway's own client code, gw_lc.c, without HTTP or JSON) and as a streamed
 *      POST /v1/completions through the gateway (a raw HTTP/1.1 client: the time each chunk
 *      arrives). Reports p50 of the time to the first token, of the whole request and of the
 *      gap between tokens for both, and their differences: the gateway's overhead per request
 *      and per streamed token.
 *   2. Load: --concurrency C clients at once, each streaming --load-requests requests of
 *      --load-tokens tokens; every response must end with [DONE] after the right number of
 *      tokens. Reports errors, completion tokens per second and request latency p50/p99.
 * Usage: bench_gateway [--tokens 64] [--rounds 20] [--concurrency 256] [--load-tokens 16]
 *                      [--load-requests 2] [--prompt TEXT] */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "gw_lc.h"

#define MAX_EVENTS 4096

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void die(const char *what) {
    fprintf(stderr, "bench_gateway: %s\n", what);
    exit(1);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p) {
    if (n == 0) return 0;
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return v[i];
}

/* One timed request: when it started, when each token arrived. */
typedef struct timing {
    double start, tok[MAX_EVENTS];
    size_t n_tok;
    bool done; /* ended as it should ([DONE] / exit 0) */
} timing;

/* ------------------------------------------------------------------------------------------
 * Direct Runs (gw_lc.c) */

static void run_direct(gw_lc *lc, const char *model, unsigned tokens, const char *prompt,
                       timing *t) {
    char mt[32];
    snprintf(mt, sizeof mt, "%u", tokens);
    char *args[] = {"--max-tokens", mt, "--temperature", "0", "--ignore-eos"};
    pie_status st;
    memset(t, 0, sizeof *t);
    t->start = now_ms();
    gw_run *r = gw_run_start(lc, NULL, model, args, 5, prompt, strlen(prompt), &st);
    if (r == NULL) {
        fprintf(stderr, "bench_gateway: direct Run: %s\n", st.msg);
        return;
    }
    for (;;) {
        char *msg = NULL;
        size_t len = 0;
        gw_run_result rr = gw_run_next(r, -1, &msg, &len, &st);
        if (rr == GW_RUN_EXIT) {
            t->done = st.code == PIE_OK;
            break;
        }
        if (strncmp(msg, "{\"c\":", 5) == 0 && strstr(msg, "\"finish\"") == NULL &&
            t->n_tok < MAX_EVENTS)
            t->tok[t->n_tok++] = now_ms();
        free(msg);
    }
    gw_run_free(r);
}

/* ------------------------------------------------------------------------------------------
 * HTTP client: one streamed POST, timing each event that carries a token */

typedef struct http_target {
    struct sockaddr_storage addr;
    socklen_t addr_len;
    char hostport[256];
} http_target;

static void parse_target(const char *url, http_target *t) {
    const char *hp = strstr(url, "://");
    hp = hp ? hp + 3 : url;
    snprintf(t->hostport, sizeof t->hostport, "%s", hp);
    char host[256];
    snprintf(host, sizeof host, "%s", hp);
    char *colon = strrchr(host, ':');
    if (colon == NULL) die("gateway URL without a port");
    *colon = '\0';
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *ai = NULL;
    if (getaddrinfo(host, colon + 1, &hints, &ai) != 0) die("cannot resolve the gateway");
    memcpy(&t->addr, ai->ai_addr, ai->ai_addrlen);
    t->addr_len = ai->ai_addrlen;
    freeaddrinfo(ai);
}

/* Counts the token events in the decoded body text s[0..n) (completions chunks with a
 * non-empty "text"), and notes [DONE]. */
static void scan_events(const char *s, size_t n, timing *t, double at) {
    const char *end = s + n;
    for (const char *p = s; p < end;) {
        const char *e = memmem(p, (size_t)(end - p), "\n\n", 2);
        size_t len = e ? (size_t)(e - p) : (size_t)(end - p);
        if (len >= 12 && memcmp(p, "data: [DONE]", 12) == 0) t->done = true;
        else if (memmem(p, len, "\"text\":\"", 8) && !memmem(p, len, "\"text\":\"\"", 9) &&
                 t->n_tok < MAX_EVENTS)
            t->tok[t->n_tok++] = at;
        p = e ? e + 2 : end;
    }
}

/* Reads a chunked body from fd, timing events; false on a transport or framing error. */
static bool read_chunked(int fd, char *buf, size_t cap, size_t have, timing *t) {
    size_t off = 0; /* start of unparsed bytes in buf */
    for (;;) {
        /* a complete chunk header + data + CRLF in buf[off..have)? */
        char *crlf = memmem(buf + off, have - off, "\r\n", 2);
        if (crlf != NULL) {
            size_t size = strtoul(buf + off, NULL, 16);
            size_t hdr = (size_t)(crlf - (buf + off)) + 2;
            if (size == 0) return true;
            if (have - off >= hdr + size + 2) {
                scan_events(buf + off + hdr, size, t, now_ms());
                off += hdr + size + 2;
                continue;
            }
        }
        if (off > 0) { /* keep the partial chunk at the start */
            memmove(buf, buf + off, have - off);
            have -= off;
            off = 0;
        }
        if (have == cap) return false;
        ssize_t n = recv(fd, buf + have, cap - have, 0);
        if (n <= 0) return false;
        have += (size_t)n;
    }
}

static void run_http(const http_target *ht, const char *model, unsigned tokens,
                     const char *prompt, timing *t) {
    memset(t, 0, sizeof *t);
    char body[2048], req[4096];
    int bl = snprintf(body, sizeof body,
                      "{\"model\":\"%s\",\"prompt\":\"%s\",\"max_tokens\":%u,\"temperature\":0,"
                      "\"ignore_eos\":true,\"stream\":true}",
                      model, prompt, tokens);
    int rl = snprintf(req, sizeof req,
                      "POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                      "application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
                      ht->hostport, bl, body);
    int fd = socket(ht->addr.ss_family, SOCK_STREAM, 0);
    if (fd < 0) return;
    t->start = now_ms();
    if (connect(fd, (const struct sockaddr *)&ht->addr, ht->addr_len) != 0 ||
        send(fd, req, (size_t)rl, MSG_NOSIGNAL) != rl) {
        close(fd);
        return;
    }
    size_t cap = 1 << 20;
    char *buf = malloc(cap);
    size_t have = 0;
    char *hdr_end = NULL;
    while (buf && hdr_end == NULL && have < cap) {
        ssize_t n = recv(fd, buf + have, cap - have, 0);
        if (n <= 0) break;
        have += (size_t)n;
        hdr_end = memmem(buf, have, "\r\n\r\n", 4);
    }
    bool ok = hdr_end && strncmp(buf, "HTTP/1.1 200", 12) == 0 &&
              memmem(buf, (size_t)(hdr_end - buf), "chunked", 7);
    if (ok) {
        size_t rest = have - (size_t)(hdr_end + 4 - buf);
        memmove(buf, hdr_end + 4, rest);
        if (!read_chunked(fd, buf, cap, rest, t)) t->done = false;
    } else {
        t->done = false;
    }
    free(buf);
    close(fd);
}

/* ------------------------------------------------------------------------------------------
 * Reports */

typedef struct summary {
    double ttft, total, gap; /* p50s, ms */
} summary;

static summary summarise(timing *ts, size_t n, unsigned tokens, const char *name, size_t *bad) {
    double *ttft = calloc(n, sizeof *ttft), *total = calloc(n, sizeof *total);
    double *gaps = calloc(n * MAX_EVENTS, sizeof *gaps);
    size_t ng = 0, k = 0;
    *bad = 0;
    for (size_t i = 0; i < n; i++) {
        timing *t = &ts[i];
        if (!t->done || t->n_tok != tokens) {
            (*bad)++;
            continue;
        }
        ttft[k] = t->tok[0] - t->start;
        total[k] = t->tok[t->n_tok - 1] - t->start;
        k++;
        for (size_t j = 1; j < t->n_tok; j++) gaps[ng++] = t->tok[j] - t->tok[j - 1];
    }
    summary s = {pct(ttft, k, 0.5), pct(total, k, 0.5), pct(gaps, ng, 0.5)};
    printf("%-8s %3zu ok %2zu bad   first token p50 %7.3f ms   request p50 %8.3f ms   "
           "token gap p50 %6.3f ms  p90 %6.3f ms\n",
           name, k, *bad, s.ttft, s.total, s.gap, pct(gaps, ng, 0.9));
    free(ttft);
    free(total);
    free(gaps);
    return s;
}

typedef struct load_arg {
    const http_target *ht;
    const char *model, *prompt;
    unsigned tokens, requests;
    pthread_barrier_t *go;
    timing *t; /* [requests] */
} load_arg;

static void *load_client(void *p) {
    load_arg *a = p;
    pthread_barrier_wait(a->go);
    for (unsigned i = 0; i < a->requests; i++) run_http(a->ht, a->model, a->tokens, a->prompt, &a->t[i]);
    return NULL;
}

static void run_load(const http_target *ht, const char *model, const char *prompt,
                     unsigned clients, unsigned requests, unsigned tokens) {
    pthread_t *th = calloc(clients, sizeof *th);
    load_arg *args = calloc(clients, sizeof *args);
    timing *ts = calloc((size_t)clients * requests, sizeof *ts);
    pthread_barrier_t go;
    if (!th || !args || !ts || pthread_barrier_init(&go, NULL, clients + 1) != 0) die("out of memory");
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    for (unsigned i = 0; i < clients; i++) {
        args[i] = (load_arg){ht, model, prompt, tokens, requests, &go, &ts[(size_t)i * requests]};
        if (pthread_create(&th[i], &attr, load_client, &args[i]) != 0) die("pthread_create");
    }
    double t0 = now_ms();
    pthread_barrier_wait(&go);
    for (unsigned i = 0; i < clients; i++) pthread_join(th[i], NULL);
    double wall = now_ms() - t0;
    size_t n = (size_t)clients * requests, bad = 0, toks = 0;
    double *lat = calloc(n, sizeof *lat);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!ts[i].done || ts[i].n_tok != tokens) bad++;
        else lat[k++] = ts[i].tok[ts[i].n_tok - 1] - ts[i].start;
        toks += ts[i].n_tok;
    }
    printf("load: %u clients x %u streamed requests of %u tokens: %zu ok, %zu errors; "
           "%.0f completion tokens/s (%zu tokens in %.2f s); request p50 %.1f ms p99 %.1f ms\n",
           clients, requests, tokens, n - bad, bad, (double)toks / (wall / 1e3), toks,
           wall / 1e3, pct(lat, k, 0.5), pct(lat, k, 0.99));
    free(lat);
    free(ts);
    free(args);
    free(th);
    pthread_barrier_destroy(&go);
    pthread_attr_destroy(&attr);
}

int main(int argc, char **argv) {
    unsigned tokens = 64, rounds = 20, conc = 256, load_tokens = 16, load_requests = 2;
    const char *prompt = "Once upon a time";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v && strcmp(a, "--tokens") == 0) tokens = (unsigned)atoi(v), i++;
        else if (v && strcmp(a, "--rounds") == 0) rounds = (unsigned)atoi(v), i++;
        else if (v && strcmp(a, "--concurrency") == 0) conc = (unsigned)atoi(v), i++;
        else if (v && strcmp(a, "--load-tokens") == 0) load_tokens = (unsigned)atoi(v), i++;
        else if (v && strcmp(a, "--load-requests") == 0) load_requests = (unsigned)atoi(v), i++;
        else if (v && strcmp(a, "--prompt") == 0) prompt = v, i++;
        else die("usage: bench_gateway [--tokens T] [--rounds R] [--concurrency C] "
                 "[--load-tokens T] [--load-requests N] [--prompt TEXT]");
    }
    if (tokens < 2 || tokens > MAX_EVENTS || load_tokens < 1 || load_tokens > MAX_EVENTS)
        die("--tokens must be 2..4096");
    const char *gws = getenv("PIE_LOCAL_GATEWAYS"), *lcs = getenv("PIE_LOCAL_LIFECYCLES");
    const char *bin = getenv("PIE_LOCAL_BIN");
    if (!gws || !gws[0] || !lcs || !bin) die("run inside deploy/local/pie-local.sh --exec with a gateway");
    char gw[256], target[1024] = "ipv4:", program[1024];
    snprintf(gw, sizeof gw, "%s", gws);
    gw[strcspn(gw, " ")] = '\0';
    for (const char *p = lcs; *p; p++) {
        size_t l = strlen(target);
        if (l + 2 < sizeof target) target[l] = *p == ' ' ? ',' : *p, target[l + 1] = '\0';
    }
    snprintf(program, sizeof program, "%s/../inferlets/openai_chat.wasm", bin);
    gw_lc_opts o = {.target = target, .program_path = program, .call_timeout_ms = 30000,
                    .run_timeout_ms = 600000, .models_cache_ms = 60000,
                    .max_message_bytes = 64 << 20};
    pie_status st;
    gw_lc *lc = gw_lc_create(&o, &st);
    if (lc == NULL) die(st.msg);
    gw_model *models = NULL;
    size_t nm = 0;
    if (gw_lc_models(lc, NULL, &models, &nm, &st) != PIE_OK || nm == 0) die("no model (ListModels)");
    char model[129];
    snprintf(model, sizeof model, "%s", models[0].name);
    gw_models_free(models, nm);
    http_target ht;
    parse_target(gw, &ht);
    printf("gateway %s, lifecycle %s, model %s, prompt \"%s\"\n", gw, target, model, prompt);

    timing warm;
    run_http(&ht, model, tokens, prompt, &warm); /* uploads the program, warms both paths */
    run_direct(lc, model, tokens, prompt, &warm);
    timing *direct = calloc(rounds, sizeof *direct), *http = calloc(rounds, sizeof *http);
    if (!direct || !http) die("out of memory");
    for (unsigned r = 0; r < rounds; r++) { /* interleaved: drift hits both alike */
        run_direct(lc, model, tokens, prompt, &direct[r]);
        run_http(&ht, model, tokens, prompt, &http[r]);
    }
    printf("latency: %u interleaved rounds of one greedy completion of %u tokens\n", rounds, tokens);
    size_t bad_d, bad_h;
    summary d = summarise(direct, rounds, tokens, "direct", &bad_d);
    summary h = summarise(http, rounds, tokens, "gateway", &bad_h);
    printf("gateway overhead: first token %+.3f ms, per request %+.3f ms, per streamed token "
           "%+.3f ms (p50 gap difference)\n",
           h.ttft - d.ttft, h.total - d.total, h.gap - d.gap);
    free(direct);
    free(http);
    if (conc > 0) run_load(&ht, model, prompt, conc, load_requests, load_tokens);
    gw_lc_destroy(lc);
    return bad_d || bad_h ? 1 : 0;
}
