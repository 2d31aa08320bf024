/* bench_rpc.c — loopback latency and throughput of services/common/rpc.
 *
 * Measures, against an echo server on 127.0.0.1 (in this process unless --target is given):
 *   unary      blocking rpc_unary round trips, one at a time: p50 / p99 / mean latency
 *   pingpong   one bidi stream, send one message and wait for its echo: p50 / p99 / mean
 *   oneway     one client stream, small messages sent back to back; the server counts them and
 *              answers at half-close: messages per second (time until the answer arrives)
 * Payloads are grpc.health.v1.HealthCheckRequest with a 16-byte string.
 * First it prints the machine's floor: a one-byte round trip between two threads over pipes
 * (two cross-thread wake-ups, like one RPC round trip). On small VMs this floor moves a lot
 * with the host's load; read the RPC numbers relative to it.
 *
 * Usage: bench_rpc [--quick] [--threads N] [--spin-us N] [--only unary|pingpong|oneway] [--target
 * HOST:PORT]
 *                  [--serve ADDR]
 *   --serve ADDR  only run the echo server (for running client and server as two processes)
 *   --target      benchmark a server started with --serve elsewhere */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "grpc/health/v1/health.pb-c.h"
#include "rpc.h"

typedef Grpc__Health__V1__HealthCheckRequest bmsg;
#define BMSG_DESC (&grpc__health__v1__health_check_request__descriptor)
#define PAYLOAD   "0123456789abcdef"

/* ---- server ---- */

static bool b_unary(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)user;
    (void)rpc_call_reply(call, req);
    return false;
}

static bool b_chat_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)call;
    (void)req;
    (void)user;
    return false;
}

static bool b_chat_msg(rpc_call *call, ProtobufCMessage *msg, void *user) {
    (void)user;
    (void)rpc_call_send(call, msg);
    return false;
}

static void b_finish_ok(rpc_call *call, void *user) {
    (void)user;
    (void)rpc_call_finish(call, PIE_OK, NULL);
}

static bool b_sink_call(rpc_call *call, ProtobufCMessage *req, void *user) {
    (void)req;
    (void)user;
    rpc_call_set_data(call, NULL); /* message count, kept in the data pointer */
    return false;
}

static bool b_sink_msg(rpc_call *call, ProtobufCMessage *msg, void *user) {
    (void)msg;
    (void)user;
    rpc_call_set_data(call, (void *)((uintptr_t)rpc_call_get_data(call) + 1));
    return false;
}

static void b_sink_half(rpc_call *call, void *user) {
    (void)user;
    char n[32];
    snprintf(n, sizeof n, "%lu", (unsigned long)(uintptr_t)rpc_call_get_data(call));
    bmsg r = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    r.service = n;
    (void)rpc_call_reply(call, &r.base);
}

static rpc_server *server_start(const char *addr, int threads) {
    pie_status st;
    rpc_server *srv =
        rpc_server_create(&(rpc_server_opts){.addr = addr, .n_threads = threads}, &st);
    if (!srv) {
        fprintf(stderr, "bench_rpc: %s\n", st.msg);
        return NULL;
    }
    rpc_method m[3] = {
        {.path = "/bench.Echo/Unary",
         .kind = RPC_UNARY,
         .request = BMSG_DESC,
         .response = BMSG_DESC,
         .on_call = b_unary},
        {.path = "/bench.Echo/Chat",
         .kind = RPC_BIDI,
         .request = BMSG_DESC,
         .response = BMSG_DESC,
         .on_call = b_chat_call,
         .on_message = b_chat_msg,
         .on_half_close = b_finish_ok},
        {.path = "/bench.Echo/Sink",
         .kind = RPC_CLIENT_STREAM,
         .request = BMSG_DESC,
         .response = BMSG_DESC,
         .on_call = b_sink_call,
         .on_message = b_sink_msg,
         .on_half_close = b_sink_half},
    };
    if (rpc_server_add_methods(srv, m, 3, &st) != PIE_OK || rpc_server_start(srv, &st) != PIE_OK) {
        fprintf(stderr, "bench_rpc: %s\n", st.msg);
        rpc_server_destroy(srv);
        return NULL;
    }
    return srv;
}

/* ---- client ---- */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void report(const char *name, int64_t *ns, int n) {
    qsort(ns, (size_t)n, sizeof *ns, cmp_i64);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += (double)ns[i];
    printf("%-9s n=%-7d p50_us=%-8.1f p99_us=%-8.1f mean_us=%-8.1f min_us=%.1f\n", name, n,
           (double)ns[n / 2] / 1e3, (double)ns[(int)((double)n * 0.99)] / 1e3, sum / n / 1e3,
           (double)ns[0] / 1e3);
}

static int bench_unary(rpc_channel *ch, int warm, int n) {
    int64_t *ns = malloc((size_t)n * sizeof *ns);
    if (!ns) return -1;
    bmsg req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = PAYLOAD;
    pie_status st;
    for (int i = -warm; i < n; i++) {
        ProtobufCMessage *resp = NULL;
        int64_t t0 = rpc_now_ns();
        pie_code rc = rpc_unary(ch, "/bench.Echo/Unary", &req.base, BMSG_DESC, &resp,
                                &(rpc_call_opts){.timeout_ms = 5000}, &st);
        int64_t dt = rpc_now_ns() - t0;
        rpc_msg_free(resp);
        if (rc != PIE_OK) {
            fprintf(stderr, "unary: %s %s\n", pie_code_name(rc), st.msg);
            free(ns);
            return -1;
        }
        if (i >= 0) ns[i] = dt;
    }
    report("unary", ns, n);
    free(ns);
    return 0;
}

static int bench_pingpong(rpc_channel *ch, int warm, int n) {
    int64_t *ns = malloc((size_t)n * sizeof *ns);
    pie_status st;
    rpc_stream *s = ns ? rpc_stream_open(ch, "/bench.Echo/Chat", BMSG_DESC, NULL, &st) : NULL;
    if (!s) {
        free(ns);
        return -1;
    }
    bmsg m = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    m.service = PAYLOAD;
    int rc = 0;
    for (int i = -warm; i < n; i++) {
        ProtobufCMessage *r = NULL;
        int64_t t0 = rpc_now_ns();
        if (rpc_stream_send(s, &m.base, &st) != PIE_OK ||
            rpc_stream_recv(s, &r, 5000) != RPC_RECV_MESSAGE) {
            fprintf(stderr, "pingpong: stream failed at %d\n", i);
            rc = -1;
            break;
        }
        int64_t dt = rpc_now_ns() - t0;
        rpc_msg_free(r);
        if (i >= 0) ns[i] = dt;
    }
    if (rpc_stream_finish(s, &st) != PIE_OK) {
        fprintf(stderr, "pingpong: %s\n", st.msg);
        rc = -1;
    }
    rpc_stream_destroy(s);
    if (rc == 0) report("pingpong", ns, n);
    free(ns);
    return rc;
}

static int bench_oneway(rpc_channel *ch, int n) {
    pie_status st;
    rpc_stream *s = rpc_stream_open(ch, "/bench.Echo/Sink", BMSG_DESC, NULL, &st);
    if (!s) return -1;
    bmsg m = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    m.service = PAYLOAD;
    int rc = 0;
    int64_t t0 = rpc_now_ns();
    for (int i = 0; i < n && rc == 0; i++)
        if (rpc_stream_send(s, &m.base, &st) != PIE_OK) rc = -1;
    ProtobufCMessage *r = NULL;
    if (rc == 0 && (rpc_stream_close_send(s, &st) != PIE_OK ||
                    rpc_stream_recv(s, &r, 60000) != RPC_RECV_MESSAGE))
        rc = -1;
    int64_t dt = rpc_now_ns() - t0;
    long got = r ? atol(((bmsg *)r)->service) : -1;
    rpc_msg_free(r);
    if (rpc_stream_finish(s, &st) != PIE_OK) rc = -1;
    rpc_stream_destroy(s);
    if (rc != 0 || got != n) {
        fprintf(stderr, "oneway: failed (server counted %ld of %d): %s\n", got, n, st.msg);
        return -1;
    }
    printf("%-9s n=%-7d msgs_per_s=%.0f total_ms=%.1f\n", "oneway", n,
           (double)n / ((double)dt / 1e9), (double)dt / 1e6);
    return 0;
}

/* ---- baseline: thread ↔ thread over pipes ---- */

typedef struct pipe_pair {
    int a[2], b[2];
    int n;
} pipe_pair;

static void *pipe_peer(void *arg) {
    pipe_pair *p = arg;
    char c;
    for (int i = 0; i < p->n; i++)
        if (read(p->a[0], &c, 1) != 1 || write(p->b[1], &c, 1) != 1) break;
    return NULL;
}

static void bench_pipe(int n) {
    pipe_pair p = {.n = n};
    if (pipe(p.a) != 0) return;
    if (pipe(p.b) != 0) {
        close(p.a[0]);
        close(p.a[1]);
        return;
    }
    pthread_t th;
    int64_t *ns = malloc((size_t)n * sizeof *ns);
    if (ns && pthread_create(&th, NULL, pipe_peer, &p) == 0) {
        char c = 'x';
        int i = 0;
        for (; i < n; i++) {
            int64_t t0 = rpc_now_ns();
            if (write(p.a[1], &c, 1) != 1 || read(p.b[0], &c, 1) != 1) break;
            ns[i] = rpc_now_ns() - t0;
        }
        pthread_join(th, NULL);
        if (i == n) report("pipe_rtt", ns, n);
    }
    free(ns);
    close(p.a[0]);
    close(p.a[1]);
    close(p.b[0]);
    close(p.b[1]);
}

static volatile sig_atomic_t g_stop; /* set by the signal handler of --serve */

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

int main(int argc, char **argv) {
    bool quick = false;
    int threads = 1, spin_us = 0;
    const char *target = NULL, *serve = NULL, *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--spin-us") == 0 && i + 1 < argc)
            spin_us = atoi(argv[++i]);
        else if (strcmp(argv[i], "--target") == 0 && i + 1 < argc)
            target = argv[++i];
        else if (strcmp(argv[i], "--serve") == 0 && i + 1 < argc)
            serve = argv[++i];
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
            only = argv[++i];
        else {
            fprintf(stderr,
                    "usage: %s [--quick] [--threads N] [--spin-us N] "
                    "[--only unary|pingpong|oneway] [--target HOST:PORT] [--serve ADDR]\n",
                    argv[0]);
            return 2;
        }
    }
    if (serve) {
        rpc_server *srv = server_start(serve, threads);
        if (!srv) return 1;
        printf("serving on port %d\n", rpc_server_port(srv));
        fflush(stdout);
        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);
        while (!g_stop) pause();
        rpc_server_destroy(srv);
        return 0;
    }
    rpc_server *srv = NULL;
    char addr[64];
    if (!target) {
        srv = server_start("127.0.0.1:0", threads);
        if (!srv) return 1;
        snprintf(addr, sizeof addr, "127.0.0.1:%d", rpc_server_port(srv));
        target = addr;
    }
    pie_status st;
    rpc_channel *ch = rpc_channel_create(target, &(rpc_channel_opts){.spin_us = spin_us}, &st);
    if (!ch) {
        fprintf(stderr, "bench_rpc: %s\n", st.msg);
        rpc_server_destroy(srv);
        return 1;
    }
    int n_lat = quick ? 2000 : 20000, warm = quick ? 200 : 2000, n_oneway = quick ? 50000 : 500000;
    printf("bench_rpc target=%s server_threads=%d client_spin_us=%d%s\n", target,
           srv ? threads : -1, spin_us, quick ? " quick" : "");
    int rc = 0;
    bench_pipe(quick ? 2000 : 20000);
    if ((!only || strcmp(only, "unary") == 0) && bench_unary(ch, warm, n_lat) != 0) rc = 1;
    if ((!only || strcmp(only, "pingpong") == 0) && bench_pingpong(ch, warm, n_lat) != 0) rc = 1;
    if ((!only || strcmp(only, "oneway") == 0) &&
        (bench_oneway(ch, n_oneway / 10) != 0 || bench_oneway(ch, n_oneway) != 0))
        rc = 1;
    rpc_channel_destroy(ch);
    rpc_server_destroy(srv);
    return rc;
}
