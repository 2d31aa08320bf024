/* piectl.c — the command-line client of a Pie-C cluster.
 *
 * Owns: argument parsing and the cluster commands: health (grpc.health.v1 on any service),
 * status (Controller/ClusterStatus), models (Lifecycle/ListModels). The program, instance and
 * export commands (upload, run, attach, ps, kill, programs, delete, exports, unexport) are in
 * piectl_lc.c. Exit status: 0
 * success, 1 the cluster said no or is unhealthy, 2 usage error; run and attach exit with the
 * inferlet's exit code, or 100 + the status code when it did not end by itself. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_file.h"
#include "rpc.h"
#include "svc.h"

#include "piectl.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: piectl [options] COMMAND\n"
            "commands:\n"
            "  health   grpc.health.v1 Check on each --addr (default: the three local services)\n"
            "  status   cluster status from the controller (--addr, default 127.0.0.1:50052)\n"
            "  models   models served, from a lifecycle replica (--addr, default 127.0.0.1:50051)\n"
            "  programs                      programs stored on the replica\n"
            "  upload FILE [NAME]            store a program (progress on stderr); prints its id\n"
            "  delete PROGRAM_ID             remove a stored program (non-admin: your hold)\n"
            "  run [RUN OPTIONS] PROGRAM [ARGS...]\n"
            "                                launch PROGRAM (an id, or a .wasm file: uploaded\n"
            "                                first) and attach: output streams live, stdin lines\n"
            "                                go to the inferlet as messages, EOF closes its input\n"
            "  attach INSTANCE_ID            attach to a running or recently exited instance\n"
            "  ps                            instances of the replica\n"
            "  kill INSTANCE_ID              terminate an instance\n"
            "  exports [--all]               KV page exports of your tenant (--all: every\n"
            "                                tenant's; admin tenants only)\n"
            "  unexport NAME [TENANT]        remove an export (e.g. a persistent one whose\n"
            "                                exporter ended); another tenant's needs admin\n"
            "run options: --model NAME, --no-stdin, --cpu-ms N, --wall-ms N, --memory-mib N,\n"
            "             --kv-pages N (0 = server default)\n"
            "run/attach exit with the inferlet's exit code, or 100 + the status code (e.g. 101\n"
            "CANCELLED, 104 DEADLINE_EXCEEDED, 108 RESOURCE_EXHAUSTED, 110 ABORTED) otherwise.\n"
            "options:\n"
            "  -a, --addr HOST:PORT   service address (repeat for several)\n"
            "  -s, --service NAME     health: service name (default \"\" = whole server)\n"
            "  -t, --token TOKEN      bearer token (default: $PIE_TOKEN)\n"
            "      --tls-ca FILE      speak TLS, trusting this PEM CA (default: $PIE_TLS_CA)\n"
            "      --timeout MS       per-call deadline (default 2000)\n"
            "      --wait MS          health: retry until SERVING for up to MS (default 0)\n"
            "  -h, --help             this text\n");
}

int64_t piectl_now_ms(void) { return rpc_now_ns() / 1000000; }

static void sleep_ms(int64_t ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

rpc_channel *piectl_dial(const piectl_opts *o, const char *addr, pie_status *st) {
    rpc_channel_opts co = {.token = o->token && o->token[0] ? o->token : NULL,
                           .max_recv_bytes = -1,
                           .tls_ca_pem = o->tls_ca_pem};
    return rpc_channel_create(addr, &co, st);
}

static const char *health_name(rpc_health_status h) {
    switch (h) {
    case RPC_HEALTH_SERVING: return "SERVING";
    case RPC_HEALTH_NOT_SERVING: return "NOT_SERVING";
    case RPC_HEALTH_SERVICE_UNKNOWN: return "SERVICE_UNKNOWN";
    default: return "UNKNOWN";
    }
}

/* One address: retries until SERVING or the wait is over. Returns 0 when SERVING. */
static int health_one(const piectl_opts *o, const char *addr) {
    pie_status st;
    rpc_channel *ch = piectl_dial(o, addr, &st);
    if (ch == NULL) {
        printf("%-22s %-18s ERROR %s\n", addr, o->service[0] ? o->service : "\"\"", st.msg);
        return 1;
    }
    int64_t until = piectl_now_ms() + o->wait_ms;
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    pie_code rc;
    for (;;) {
        rc = rpc_health_check(ch, o->service, o->timeout_ms, &hs, &st);
        if ((rc == PIE_OK && hs == RPC_HEALTH_SERVING) || piectl_now_ms() >= until) break;
        sleep_ms(100);
    }
    rpc_channel_destroy(ch);
    const char *svc_label = o->service[0] ? o->service : "\"\"";
    if (rc != PIE_OK) {
        printf("%-22s %-18s %s: %s\n", addr, svc_label, pie_code_name(rc), st.msg);
        return 1;
    }
    printf("%-22s %-18s %s\n", addr, svc_label, health_name(hs));
    return hs == RPC_HEALTH_SERVING ? 0 : 1;
}

static int cmd_health(piectl_opts *o) {
    if (o->n_addrs == 0) {
        o->addrs[o->n_addrs++] = "127.0.0.1:50051";
        o->addrs[o->n_addrs++] = "127.0.0.1:50052";
        o->addrs[o->n_addrs++] = "127.0.0.1:50053";
    }
    int bad = 0;
    for (int i = 0; i < o->n_addrs; i++) bad |= health_one(o, o->addrs[i]);
    return bad ? 1 : 0;
}

static const char *backend_name(int b) {
    return b == PIE__V1__BACKEND__BACKEND_CPU ? "cpu" : b == PIE__V1__BACKEND__BACKEND_CUDA ? "cuda" : "?";
}

int piectl_unary(const piectl_opts *o, const char *default_addr, const char *path,
                 const ProtobufCMessage *req, const ProtobufCMessageDescriptor *rd,
                 ProtobufCMessage **resp) {
    const char *addr = o->n_addrs ? o->addrs[0] : default_addr;
    pie_status st;
    rpc_channel *ch = piectl_dial(o, addr, &st);
    if (ch == NULL) {
        fprintf(stderr, "piectl: %s\n", st.msg);
        return 1;
    }
    rpc_call_opts co = {.timeout_ms = o->timeout_ms};
    pie_code rc = rpc_unary(ch, path, req, rd, resp, &co, &st);
    rpc_channel_destroy(ch);
    if (rc != PIE_OK) {
        fprintf(stderr, "piectl: %s %s: %s: %s\n", addr, path, pie_code_name(rc), st.msg);
        return 1;
    }
    return 0;
}

static int cmd_status(const piectl_opts *o) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    if (piectl_unary(o, "127.0.0.1:50052", "/pie.v1.Controller/ClusterStatus", &req.base,
              &pie__v1__cluster_status_response__descriptor, &m))
        return 1;
    Pie__V1__ClusterStatusResponse *r = (Pie__V1__ClusterStatusResponse *)m;
    printf("controller %s  instances %u  exports %u\n", r->version, r->instances, r->exports);
    printf("workers (%zu):\n", r->n_workers);
    for (size_t i = 0; i < r->n_workers; i++) {
        const Pie__V1__WorkerStatus *w = r->workers[i];
        printf("  #%-3u %-28s model=%s backend=%s tp=%u kv_pages=%u/%u device=%s\n",
               w->worker_index, w->group_id, w->model, backend_name(w->backend), w->tp_size,
               w->kv_pages_used, w->capacity ? w->capacity->kv_pages_effective : 0, w->device);
        for (size_t k = 0; k < w->n_ranks; k++) /* a tensor-parallel group: each rank */
            printf("       rank %u: device=%s host=%s pid=%u\n", w->ranks[k]->rank,
                   w->ranks[k]->device, w->ranks[k]->host, w->ranks[k]->pid);
    }
    printf("lifecycle replicas (%zu):\n", r->n_replicas);
    for (size_t i = 0; i < r->n_replicas; i++)
        printf("  #%-3u %-28s instances=%u calls=%llu\n", r->replicas[i]->replica_index,
               r->replicas[i]->replica_id, r->replicas[i]->instances,
               (unsigned long long)r->replicas[i]->calls);
    printf("models (%zu):\n", r->n_models);
    for (size_t i = 0; i < r->n_models; i++)
        printf("  %-20s workers=%u kv_pages=%llu\n", r->models[i]->info->name,
               r->models[i]->workers, (unsigned long long)r->models[i]->kv_pages_effective);
    rpc_msg_free(m);
    return 0;
}

static int cmd_models(const piectl_opts *o) {
    Pie__V1__ListModelsRequest req = PIE__V1__LIST_MODELS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    if (piectl_unary(o, "127.0.0.1:50051", "/pie.v1.Lifecycle/ListModels", &req.base,
              &pie__v1__list_models_response__descriptor, &m))
        return 1;
    Pie__V1__ListModelsResponse *r = (Pie__V1__ListModelsResponse *)m;
    if (r->n_models == 0) printf("no models served yet\n");
    for (size_t i = 0; i < r->n_models; i++) {
        const Pie__V1__ModelInfo *mi = r->models[i];
        printf("%-20s page_size=%u vocab=%u %s\n", mi->name, mi->kv_page_size, mi->vocab_size,
               mi->description);
    }
    rpc_msg_free(m);
    return 0;
}

/* The command after the options: its exit status. */
static int dispatch(piectl_opts *o, int argc, char **argv) {
    const char *cmd = argv[optind];
    int lc = piectl_lc_command(o, cmd, argc - optind - 1, argv + optind + 1);
    if (lc >= 0) return lc;
    if (optind + 1 < argc) {
        fprintf(stderr, "piectl: unexpected argument '%s'\n", argv[optind + 1]);
        return 2;
    }
    if (o->timeout_ms <= 0 || o->wait_ms < 0) {
        fprintf(stderr, "piectl: --timeout must be > 0 and --wait >= 0 (milliseconds)\n");
        return 2;
    }
    if (strcmp(cmd, "health") == 0) return cmd_health(o);
    if (strcmp(cmd, "status") == 0) return cmd_status(o);
    if (strcmp(cmd, "models") == 0) return cmd_models(o);
    fprintf(stderr,
            "piectl: unknown command '%s' (health, status, models, programs, upload, delete, "
            "run, attach, ps, kill, exports, unexport)\n",
            cmd);
    return 2;
}

int main(int argc, char **argv) {
    static const struct option longopts[] = {
        {"addr", required_argument, NULL, 'a'},  {"service", required_argument, NULL, 's'},
        {"token", required_argument, NULL, 't'}, {"timeout", required_argument, NULL, 'T'},
        {"wait", required_argument, NULL, 'w'},  {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},     {"tls-ca", required_argument, NULL, 'C'},
        {NULL, 0, NULL, 0},
    };
    piectl_opts o = {.service = "", .token = getenv("PIE_TOKEN"), .timeout_ms = 2000};
    const char *tls_ca = getenv("PIE_TLS_CA");
    int c;
    /* "+": options end at the command, so an inferlet's own arguments are left alone */
    while ((c = getopt_long(argc, argv, "+a:s:t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'a':
            if (o.n_addrs == PIECTL_MAX_ADDRS) {
                fprintf(stderr, "piectl: at most %d --addr\n", PIECTL_MAX_ADDRS);
                return 2;
            }
            o.addrs[o.n_addrs++] = optarg;
            break;
        case 's': o.service = optarg; break;
        case 't': o.token = optarg; break;
        case 'T': o.timeout_ms = atoll(optarg); break;
        case 'C': tls_ca = optarg; break;
        case 'w': o.wait_ms = atoll(optarg); break;
        case 'V': printf("piectl %s\n", PIE_VERSION); return 0;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    if (tls_ca && tls_ca[0]) {
        size_t len;
        pie_status st;
        if (pie_file_read(tls_ca, "TLS CA", 1u << 20, &o.tls_ca_pem, &len, &st) != PIE_OK) {
            fprintf(stderr, "piectl: %s\n", st.msg);
            return 2;
        }
    }
    int rc = dispatch(&o, argc, argv);
    free(o.tls_ca_pem);
    return rc;
}
