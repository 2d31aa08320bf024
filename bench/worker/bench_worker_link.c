/* bench_worker_link.c — the worker's share of a decode step: round trip of one scheduling step
 * (embed_text, forward, next_dist for N sequences) from a controller stand-in in this process to
 * a real pie-worker and back, on loopback.
 *
 * Owns: nothing outside this file; results are recorded in bench/results/worker.md.
 *
 *   bench_worker_link [--backend null|cpu] [--model DIR] [--instances 1,32,256] [--steps 2000]
 *                     [--k 256]
 *
 * The worker is build/bin/pie-worker (next to this binary's directory), started with one
 * credit (the paper's work-conserving dispatch: the next step is sent when the results of the
 * previous one arrive). Reports per N: round-trip p50/p99/mean, the worker's own execution time
 * (sum of the batches' exec_us), and steps and tokens per second. */
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "rpc.h"

extern char **environ;

#define PAGE 16

/* ---- controller stand-in: one WorkerLink call, received messages in a queue ---------------- */

typedef struct ctl {
    rpc_server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rpc_call *call;
    Pie__V1__WorkerUp *q[1024];
    size_t q_len;
} ctl;

static bool on_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    ctl *c = user;
    rpc_call_ref(call);
    pthread_mutex_lock(&c->mu);
    if (c->call) rpc_call_unref(c->call);
    c->call = call;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return false;
}

static bool on_message(rpc_call *call, ProtobufCMessage *msg, void *user) {
    (void)call;
    ctl *c = user;
    Pie__V1__WorkerUp *up = (Pie__V1__WorkerUp *)msg;
    if (up->stats && up->n_results == 0 && up->credits == 0 && !up->registration) return false;
    pthread_mutex_lock(&c->mu);
    bool kept = c->q_len < sizeof c->q / sizeof c->q[0];
    if (kept) c->q[c->q_len++] = up;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return kept;
}

static void on_done(rpc_call *call, void *user) {
    ctl *c = user;
    pthread_mutex_lock(&c->mu);
    bool mine = c->call == call;
    if (mine) c->call = NULL;
    pthread_mutex_unlock(&c->mu);
    if (mine) rpc_call_unref(call);
}

static Pie__V1__WorkerUp *recv_up(ctl *c) {
    int64_t deadline = rpc_now_ns() + 20LL * 1000000000;
    pthread_mutex_lock(&c->mu);
    while (c->q_len == 0) {
        if (rpc_now_ns() > deadline) {
            pthread_mutex_unlock(&c->mu);
            fprintf(stderr, "bench_worker_link: no message from the worker within 20 s\n");
            exit(1);
        }
        struct timespec ts = {.tv_sec = deadline / 1000000000, .tv_nsec = deadline % 1000000000};
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    Pie__V1__WorkerUp *up = c->q[0];
    memmove(c->q, c->q + 1, (--c->q_len) * sizeof c->q[0]);
    pthread_mutex_unlock(&c->mu);
    return up;
}

static void send_down(ctl *c, const Pie__V1__WorkerDown *d) {
    pthread_mutex_lock(&c->mu);
    rpc_call *call = c->call;
    if (call) rpc_call_ref(call);
    pthread_mutex_unlock(&c->mu);
    if (call == NULL || rpc_call_send(call, &d->base) != PIE_OK) {
        fprintf(stderr, "bench_worker_link: cannot send to the worker\n");
        exit(1);
    }
    rpc_call_unref(call);
}

/* ---- the worker process ---------------------------------------------------------------------- */

static pid_t spawn_worker(int ctl_port, const char *backend, const char *model, uint32_t n_max) {
    char self[PATH_MAX], bin[PATH_MAX + 32];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        perror("readlink /proc/self/exe");
        exit(1);
    }
    self[n] = '\0';
    snprintf(bin, sizeof bin, "%s/../bin/pie-worker", dirname(self));
    static char e_ctl[64], e_backend[64], e_model[PATH_MAX + 32], e_kv[64], e_emb[64];
    snprintf(e_ctl, sizeof e_ctl, "PIE_CONTROLLER_ADDRESS=127.0.0.1:%d", ctl_port);
    snprintf(e_backend, sizeof e_backend, "PIE_BACKEND=%s", backend);
    snprintf(e_model, sizeof e_model, "PIE_MODEL_PATH=%s", model);
    snprintf(e_kv, sizeof e_kv, "PIE_POOL_KV_PAGES=%u", n_max);
    snprintf(e_emb, sizeof e_emb, "PIE_POOL_EMBED_SLOTS=%u", 2 * n_max);
    char *env[256];
    size_t k = 0;
    for (char **e = environ; *e && k < 240; e++)
        if (strncmp(*e, "PIE_", 4) != 0) env[k++] = *e;
    char *mine[] = {e_ctl,
                    e_backend,
                    e_model,
                    e_kv,
                    e_emb,
                    "PIE_SERVER_LISTEN=127.0.0.1:0",
                    "PIE_METRICS_LISTEN=",
                    "PIE_LOG_LEVEL=warn"};
    for (size_t i = 0; i < sizeof mine / sizeof mine[0]; i++) env[k++] = mine[i];
    env[k] = NULL;
    char *argv[] = {bin, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, bin, NULL, NULL, argv, env);
    if (rc != 0) {
        fprintf(stderr, "bench_worker_link: cannot start %s: %s\n", bin, strerror(rc));
        exit(1);
    }
    return pid;
}

/* ---- one run --------------------------------------------------------------------------------- */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Steps of n sequences; prints one table row. Slots: kv i, input embedding i, output n + i. */
static void run(ctl *c, uint32_t n, int steps, uint32_t k, uint64_t *batch_id) {
    uint32_t *ids = calloc(2 * n, sizeof *ids), *toks = calloc(n, sizeof *toks),
             *pos = calloc(n, sizeof *pos), *lens = calloc(n, sizeof *lens);
    Pie__V1__ForwardItem *fi = calloc(n, sizeof *fi), **fip = calloc(n, sizeof *fip);
    Pie__V1__NextDistItem *di = calloc(n, sizeof *di), **dip = calloc(n, sizeof *dip);
    int64_t *rtt = calloc((size_t)steps, sizeof *rtt);
    if (!ids || !toks || !pos || !lens || !fi || !fip || !di || !dip || !rtt) {
        fprintf(stderr, "bench_worker_link: out of memory\n");
        exit(1);
    }
    for (uint32_t i = 0; i < 2 * n; i++) ids[i] = i;

    /* allocate the slots: one SlotBatch */
    Pie__V1__SlotBatch sb = PIE__V1__SLOT_BATCH__INIT;
    sb.n_alloc_kv_slots = n;
    sb.alloc_kv_slots = ids;
    sb.n_alloc_embed_slots = 2 * n;
    sb.alloc_embed_slots = ids;
    Pie__V1__Batch b0 = PIE__V1__BATCH__INIT, *b0p = &b0;
    b0.batch_id = (*batch_id)++;
    b0.kind_case = PIE__V1__BATCH__KIND_SLOTS;
    b0.slots = &sb;
    Pie__V1__WorkerDown d0 = PIE__V1__WORKER_DOWN__INIT;
    d0.n_batches = 1;
    d0.batches = &b0p;
    send_down(c, &d0);
    rpc_msg_free(&recv_up(c)->base);

    Pie__V1__EmbedTextBatch eb = PIE__V1__EMBED_TEXT_BATCH__INIT;
    eb.n_embed_slots = eb.n_token_ids = eb.n_positions = n;
    eb.embed_slots = ids;
    eb.token_ids = toks;
    eb.positions = pos;
    Pie__V1__ForwardBatch fb = PIE__V1__FORWARD_BATCH__INIT;
    fb.n_items = n;
    fb.items = fip;
    Pie__V1__NextDistBatch nb = PIE__V1__NEXT_DIST_BATCH__INIT;
    nb.n_items = n;
    nb.items = dip;
    for (uint32_t i = 0; i < n; i++) {
        pie__v1__forward_item__init(&fi[i]);
        fi[i].n_kv_slots = 1;
        fi[i].kv_slots = &ids[i];
        fi[i].append_kv = 1;
        fi[i].n_input_embed_slots = 1;
        fi[i].input_embed_slots = &ids[i];
        fi[i].n_output_embed_slots = 1;
        fi[i].output_embed_slots = &ids[n + i];
        fip[i] = &fi[i];
        pie__v1__next_dist_item__init(&di[i]);
        di[i].embed_slot = n + i;
        di[i].top_k = k;
        di[i].temperature = 1.0f;
        dip[i] = &di[i];
    }
    Pie__V1__Batch b[3] = {PIE__V1__BATCH__INIT, PIE__V1__BATCH__INIT, PIE__V1__BATCH__INIT};
    Pie__V1__Batch *bp[3] = {&b[0], &b[1], &b[2]};
    b[0].kind_case = PIE__V1__BATCH__KIND_EMBED_TEXT;
    b[0].embed_text = &eb;
    b[1].kind_case = PIE__V1__BATCH__KIND_FORWARD;
    b[1].forward = &fb;
    b[2].kind_case = PIE__V1__BATCH__KIND_NEXT_DIST;
    b[2].next_dist = &nb;
    Pie__V1__WorkerDown d = PIE__V1__WORKER_DOWN__INIT;
    d.n_batches = 3;
    d.batches = bp;

    int warmup = steps / 10 + 5;
    uint64_t exec_us = 0, failures = 0;
    for (int s = -warmup; s < steps; s++) {
        uint32_t p = (uint32_t)(s + warmup) % PAGE; /* each sequence rewrites its one page */
        for (uint32_t i = 0; i < n; i++) {
            toks[i] = (7u * i + (uint32_t)(s + warmup)) % 500u;
            pos[i] = p;
            fi[i].kv_last_page_len = p + 1;
        }
        for (int j = 0; j < 3; j++) b[j].batch_id = (*batch_id)++;
        int64_t t0 = rpc_now_ns();
        send_down(c, &d);
        Pie__V1__WorkerUp *up = recv_up(c);
        int64_t t1 = rpc_now_ns();
        if (s >= 0) {
            rtt[s] = t1 - t0;
            for (size_t j = 0; j < up->n_results; j++) {
                exec_us += up->results[j]->exec_us;
                failures += up->results[j]->code != 0;
            }
        }
        rpc_msg_free(&up->base);
    }
    if (failures)
        fprintf(stderr, "bench_worker_link: %llu batches failed\n", (unsigned long long)failures);
    int64_t sum = 0;
    for (int s = 0; s < steps; s++) sum += rtt[s];
    qsort(rtt, (size_t)steps, sizeof *rtt, cmp_i64);
    double mean_us = (double)sum / steps / 1e3;
    printf("| %u | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f |\n", n, (double)rtt[steps / 2] / 1e3,
           (double)rtt[steps * 99 / 100] / 1e3, mean_us, (double)exec_us / steps, 1e6 / mean_us,
           1e6 / mean_us * n);
    fflush(stdout);

    sb.n_alloc_kv_slots = sb.n_alloc_embed_slots = 0; /* free them again */
    sb.n_free_kv_slots = n;
    sb.free_kv_slots = ids;
    sb.n_free_embed_slots = 2 * n;
    sb.free_embed_slots = ids;
    b0.batch_id = (*batch_id)++;
    send_down(c, &d0);
    rpc_msg_free(&recv_up(c)->base);
    free(ids), free(toks), free(pos), free(lens), free(fi), free(fip), free(di), free(dip);
    free(rtt);
}

int main(int argc, char **argv) {
    const char *backend = "null", *model = "", *instances = "1,32,256";
    int steps = 2000;
    uint32_t k = 256;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--backend") == 0)
            backend = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--model") == 0)
            model = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--instances") == 0)
            instances = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--steps") == 0)
            steps = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--k") == 0)
            k = (uint32_t)atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [--backend null|cpu] [--model DIR] [--instances 1,32,256] "
                    "[--steps N] [--k K]\n",
                    argv[0]);
            return 2;
        }
    }
    if (steps < 10) steps = 10;
    uint32_t ns[16], n_ns = 0, n_max = 1;
    char list[256];
    snprintf(list, sizeof list, "%s", instances);
    for (char *save, *t = strtok_r(list, ",", &save); t && n_ns < 16;
         t = strtok_r(NULL, ",", &save)) {
        ns[n_ns] = (uint32_t)atoi(t);
        if (ns[n_ns] == 0) continue;
        if (ns[n_ns] > n_max) n_max = ns[n_ns];
        n_ns++;
    }

    ctl c = {0};
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    pie_status st;
    rpc_server_opts so = {.addr = "127.0.0.1:0", .max_recv_bytes = -1, .max_send_bytes = -1};
    c.srv = rpc_server_create(&so, &st);
    rpc_method m = {.path = "/pie.v1.Controller/WorkerLink",
                    .kind = RPC_BIDI,
                    .request = &pie__v1__worker_up__descriptor,
                    .response = &pie__v1__worker_down__descriptor,
                    .on_call = on_call,
                    .on_message = on_message,
                    .on_done = on_done,
                    .user = &c};
    if (!c.srv || rpc_server_add_methods(c.srv, &m, 1, &st) != PIE_OK ||
        rpc_server_start(c.srv, &st) != PIE_OK) {
        fprintf(stderr, "bench_worker_link: %s\n", st.msg);
        return 1;
    }
    pid_t pid = spawn_worker(rpc_server_port(c.srv), backend, model, n_max);
    Pie__V1__WorkerUp *reg = recv_up(&c);
    if (!reg->registration) {
        fprintf(stderr, "bench_worker_link: the worker did not register first\n");
        return 1;
    }
    printf("backend %s, model %s (vocab %u), device \"%s\", k %u, %d steps each\n\n", backend,
           reg->registration->model->name, reg->registration->model->vocab_size,
           reg->registration->device, k, steps);
    rpc_msg_free(&reg->base);
    Pie__V1__WorkerRegistered r = PIE__V1__WORKER_REGISTERED__INIT;
    r.worker_index = 1;
    r.heartbeat_ms = 60000;
    Pie__V1__WorkerDown d = PIE__V1__WORKER_DOWN__INIT;
    d.registered = &r;
    send_down(&c, &d);
    rpc_msg_free(&recv_up(&c)->base); /* the credit */

    printf("| sequences | round trip p50 µs | p99 µs | mean µs | worker exec µs | steps/s | "
           "tokens/s |\n| --- | --- | --- | --- | --- | --- | --- |\n");
    uint64_t batch_id = 1;
    for (uint32_t i = 0; i < n_ns; i++) run(&c, ns[i], steps, k, &batch_id);

    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    rpc_server_shutdown(c.srv, 0);
    rpc_server_destroy(c.srv);
    for (size_t i = 0; i < c.q_len; i++) rpc_msg_free(&c.q[i]->base);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
