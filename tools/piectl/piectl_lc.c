/* piectl_lc.c — piectl's program and instance commands (pie.v1.Lifecycle).
 *
 * Owns: upload (chunked, progress on stderr for large files), programs, delete, run (launch +
 * attach on one call: output streamed live, stdin lines forwarded as messages by a second
 * thread, end of input on EOF), attach, ps, kill, and the exit status of run/attach (the
 * inferlet's exit code, or 100 + the status code when it did not end by itself).
 * Does not own: option parsing and the cluster commands (piectl.c). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pie/v1/lifecycle.pb-c.h"
#include "pie_file.h"
#include "piectl.h"

#define LC_DEFAULT_ADDR  "127.0.0.1:50051"
#define CHUNK_BYTES      (256u << 10)
#define PROGRESS_ABOVE   (1u << 20) /* files larger than this show upload progress */
#define EXIT_STATUS_BASE 100

static const char *lc_addr(const piectl_opts *o) {
    return o->n_addrs ? o->addrs[0] : LC_DEFAULT_ADDR;
}

static rpc_channel *lc_dial(const piectl_opts *o) {
    pie_status st;
    rpc_channel *ch = piectl_dial(o, lc_addr(o), &st);
    if (ch == NULL) fprintf(stderr, "piectl: %s: %s\n", lc_addr(o), st.msg);
    return ch;
}

static int parse_id(const char *s, uint64_t *out) {
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 16); /* ids are shown as 16 hex digits */
    if (errno || end == s || *end || v == 0) {
        fprintf(stderr, "piectl: instance id '%s' is not a non-zero hex number\n", s);
        return 2;
    }
    *out = v;
    return 0;
}

/* ---- upload -------------------------------------------------------------------------------- */

/* Uploads the file; id gets the program id. Returns 0 or 1. */
static int upload_file(const piectl_opts *o, rpc_channel *ch, const char *path, const char *name,
                       char id[65]) {
    size_t len = 0;
    char *bytes = NULL;
    pie_status st;
    if (pie_file_read(path, "program", SIZE_MAX, &bytes, &len, &st) != PIE_OK) {
        fprintf(stderr, "piectl: %s\n", st.msg);
        return 1;
    }
    uint8_t *data = (uint8_t *)bytes;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    rpc_call_opts co = {.timeout_ms = o->timeout_ms + (int64_t)(len >> 10)}; /* +1 ms per KiB */
    rpc_stream *s = rpc_stream_open(ch, "/pie.v1.Lifecycle/UploadProgram",
                                    &pie__v1__upload_program_response__descriptor, &co, &st);
    if (s == NULL) {
        fprintf(stderr, "piectl: upload: %s\n", st.msg);
        free(data);
        return 1;
    }
    Pie__V1__ProgramMetadata md = PIE__V1__PROGRAM_METADATA__INIT;
    md.name = (char *)(name ? name : base);
    md.size_bytes = len;
    Pie__V1__UploadProgramRequest r = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
    r.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_METADATA;
    r.metadata = &md;
    pie_code rc = rpc_stream_send(s, &r.base, &st);
    bool progress = len > PROGRESS_ABOVE;
    for (size_t off = 0; rc == PIE_OK && off < len; off += CHUNK_BYTES) {
        Pie__V1__UploadProgramRequest c = PIE__V1__UPLOAD_PROGRAM_REQUEST__INIT;
        c.part_case = PIE__V1__UPLOAD_PROGRAM_REQUEST__PART_CHUNK;
        c.chunk.data = data + off;
        c.chunk.len = len - off < CHUNK_BYTES ? len - off : CHUNK_BYTES;
        rc = rpc_stream_send(s, &c.base, &st);
        if (progress)
            fprintf(stderr, "\rupload %s: %3zu%% of %.1f MiB", base,
                    (off + c.chunk.len) * 100 / len, (double)len / (1 << 20));
    }
    if (progress) fprintf(stderr, "%s\n", rc == PIE_OK ? ", validating..." : "");
    rpc_stream_close_send(s, &st);
    ProtobufCMessage *m = NULL;
    bool got = rpc_stream_recv(s, &m, -1) == RPC_RECV_MESSAGE;
    if (got) {
        Pie__V1__UploadProgramResponse *u = (Pie__V1__UploadProgramResponse *)m;
        snprintf(id, 65, "%s", u->program_id);
        if (progress)
            fprintf(stderr, "upload %s: %s\n", base,
                    u->already_cached ? "already stored" : "stored");
        rpc_msg_free(m);
    }
    rc = rpc_stream_finish(s, &st);
    rpc_stream_destroy(s);
    free(data);
    if (rc != PIE_OK || !got) {
        fprintf(stderr, "piectl: upload %s: %s: %s\n", path, pie_code_name(rc), st.msg);
        return 1;
    }
    return 0;
}

static int cmd_upload(const piectl_opts *o, int argc, char **argv) {
    if (argc < 1 || argc > 2) {
        fprintf(stderr, "piectl: usage: upload FILE [NAME]\n");
        return 2;
    }
    rpc_channel *ch = lc_dial(o);
    if (ch == NULL) return 1;
    char id[65];
    int rc = upload_file(o, ch, argv[0], argc > 1 ? argv[1] : NULL, id);
    if (rc == 0) printf("%s\n", id);
    rpc_channel_destroy(ch);
    return rc;
}

/* ---- programs ------------------------------------------------------------------------------ */

static const char *tier_name(int t) {
    return t == PIE__V1__PROGRAM_TIER__PROGRAM_TIER_OPTIMIZED ? "optimized"
           : t == PIE__V1__PROGRAM_TIER__PROGRAM_TIER_QUICK   ? "quick"
                                                              : "none";
}

static int cmd_programs(const piectl_opts *o) {
    Pie__V1__ListProgramsRequest req = PIE__V1__LIST_PROGRAMS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    if (piectl_unary(o, LC_DEFAULT_ADDR, "/pie.v1.Lifecycle/ListPrograms", &req.base,
                     &pie__v1__list_programs_response__descriptor, &m))
        return 1;
    Pie__V1__ListProgramsResponse *r = (Pie__V1__ListProgramsResponse *)m;
    if (r->n_programs == 0) printf("no programs stored\n");
    for (size_t i = 0; i < r->n_programs; i++) {
        Pie__V1__ProgramInfo *p = r->programs[i];
        time_t t = (time_t)(p->uploaded_unix_ms / 1000);
        char when[32];
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", gmtime(&t));
        printf("%s %10llu %-9s %s %s", p->program_id, (unsigned long long)p->size_bytes,
               tier_name(p->tier), when, p->name);
        for (size_t k = 0; k < p->n_holders; k++) /* an admin's listing names them */
            printf("%s%s", k ? "," : "  held by ", p->holders[k]);
        printf("\n");
    }
    rpc_msg_free(m);
    return 0;
}

static int cmd_delete(const piectl_opts *o, int argc, char **argv) {
    if (argc != 1) {
        fprintf(stderr, "piectl: usage: delete PROGRAM_ID\n");
        return 2;
    }
    Pie__V1__DeleteProgramRequest req = PIE__V1__DELETE_PROGRAM_REQUEST__INIT;
    req.program_id = argv[0];
    ProtobufCMessage *m = NULL;
    int rc = piectl_unary(o, LC_DEFAULT_ADDR, "/pie.v1.Lifecycle/DeleteProgram", &req.base,
                          &pie__v1__delete_program_response__descriptor, &m);
    rpc_msg_free(m);
    return rc;
}

/* ---- instances ----------------------------------------------------------------------------- */

static const char *state_name(int s) {
    switch (s) {
    case PIE__V1__INSTANCE_STATE__INSTANCE_STATE_STARTING: return "starting";
    case PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING: return "running";
    case PIE__V1__INSTANCE_STATE__INSTANCE_STATE_EXITED: return "exited";
    default: return "?";
    }
}

static int cmd_ps(const piectl_opts *o) {
    Pie__V1__ListInstancesRequest req = PIE__V1__LIST_INSTANCES_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    if (piectl_unary(o, LC_DEFAULT_ADDR, "/pie.v1.Lifecycle/ListInstances", &req.base,
                     &pie__v1__list_instances_response__descriptor, &m))
        return 1;
    Pie__V1__ListInstancesResponse *r = (Pie__V1__ListInstancesResponse *)m;
    printf("%-16s %-8s %-3s %-16s %-12s %8s %8s %6s %s\n", "INSTANCE", "STATE", "ATT", "PROGRAM",
           "MODEL", "CPU_MS", "WALL_MS", "KV", "EXIT");
    for (size_t i = 0; i < r->n_instances; i++) {
        Pie__V1__InstanceInfo *in = r->instances[i];
        char exit_s[600] = "";
        if (in->exit_status && in->exit_status->status) {
            const Pie__V1__Status *s = in->exit_status->status;
            if (s->code == 0)
                snprintf(exit_s, sizeof exit_s, "code %d", in->exit_status->exit_code);
            else
                snprintf(exit_s, sizeof exit_s, "%s: %s", pie_code_name((int)s->code), s->message);
        }
        printf("%016llx %-8s %-3s %-16.16s %-12.12s %8llu %8llu %6u %s\n",
               (unsigned long long)in->instance_id, state_name(in->state),
               in->attached ? "yes" : "no", in->program_name[0] ? in->program_name : in->program_id,
               in->model, in->usage ? (unsigned long long)in->usage->cpu_ms : 0ull,
               in->usage ? (unsigned long long)in->usage->wall_ms : 0ull,
               in->usage ? in->usage->kv_pages : 0u, exit_s);
    }
    rpc_msg_free(m);
    return 0;
}

static int cmd_kill(const piectl_opts *o, int argc, char **argv) {
    uint64_t id;
    if (argc != 1) {
        fprintf(stderr, "piectl: usage: kill INSTANCE_ID\n");
        return 2;
    }
    if (parse_id(argv[0], &id)) return 2;
    Pie__V1__TerminateRequest req = PIE__V1__TERMINATE_REQUEST__INIT;
    req.instance_id = id;
    ProtobufCMessage *m = NULL;
    int rc = piectl_unary(o, LC_DEFAULT_ADDR, "/pie.v1.Lifecycle/Terminate", &req.base,
                          &pie__v1__terminate_response__descriptor, &m);
    rpc_msg_free(m);
    return rc;
}

/* ---- exports ------------------------------------------------------------------------------- */

static int cmd_exports(const piectl_opts *o, int argc, char **argv) {
    bool all = argc == 1 && strcmp(argv[0], "--all") == 0;
    if (argc > 1 || (argc == 1 && !all)) {
        fprintf(stderr, "piectl: usage: exports [--all]\n");
        return 2;
    }
    Pie__V1__ListExportsRequest req = PIE__V1__LIST_EXPORTS_REQUEST__INIT;
    req.all_tenants = all;
    ProtobufCMessage *m = NULL;
    if (piectl_unary(o, LC_DEFAULT_ADDR, "/pie.v1.Lifecycle/ListExports", &req.base,
                     &pie__v1__list_exports_response__descriptor, &m))
        return 1;
    Pie__V1__ListExportsResponse *r = (Pie__V1__ListExportsResponse *)m;
    printf("%-16s %-24s %-16s %6s %-10s %-16s %s\n", "TENANT", "NAME", "MODEL", "PAGES", "KIND",
           "EXPORTER", "EXPIRES");
    for (size_t i = 0; i < r->n_exports; i++) {
        const Pie__V1__ExportInfo *e = r->exports[i];
        char when[32] = "-";
        if (e->expires_unix_ms) {
            time_t t = (time_t)(e->expires_unix_ms / 1000);
            strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", gmtime(&t));
        }
        printf("%-16s %-24s %-16s %6u %-10s %016llx %s\n", e->tenant, e->name, e->model,
               e->page_count, e->persistent ? "persistent" : "tied",
               (unsigned long long)e->exporter_instance_id, when);
    }
    rpc_msg_free(m);
    return 0;
}

static int cmd_unexport(const piectl_opts *o, int argc, char **argv) {
    if (argc < 1 || argc > 2) {
        fprintf(stderr, "piectl: usage: unexport NAME [TENANT]\n");
        return 2;
    }
    Pie__V1__DeleteExportRequest req = PIE__V1__DELETE_EXPORT_REQUEST__INIT;
    req.name = argv[0];
    req.tenant = argc == 2 ? argv[1] : "";
    ProtobufCMessage *m = NULL;
    int rc = piectl_unary(o, LC_DEFAULT_ADDR, "/pie.v1.Lifecycle/DeleteExport", &req.base,
                          &pie__v1__delete_export_response__descriptor, &m);
    if (rc == 0)
        printf("removed export %s (%u pages)\n", argv[0],
               ((Pie__V1__DeleteExportResponse *)m)->page_count);
    rpc_msg_free(m);
    return rc;
}

/* ---- run and attach ------------------------------------------------------------------------ */

typedef struct stdin_pump {
    rpc_stream *s;
    bool run; /* RunRequest or AttachRequest */
    atomic_bool done;
} stdin_pump;

static pie_code send_input(stdin_pump *p, const char *line, size_t len, bool close) {
    pie_status st;
    ProtobufCBinaryData b = {.len = len, .data = (uint8_t *)line};
    Pie__V1__CloseInput ci = PIE__V1__CLOSE_INPUT__INIT;
    if (p->run) {
        Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
        r.msg_case =
            close ? PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT : PIE__V1__RUN_REQUEST__MSG_MESSAGE;
        if (close) /* a oneof: the members share storage */
            r.close_input = &ci;
        else
            r.message = b;
        return rpc_stream_send(p->s, &r.base, &st);
    }
    Pie__V1__AttachRequest r = PIE__V1__ATTACH_REQUEST__INIT;
    r.msg_case =
        close ? PIE__V1__ATTACH_REQUEST__MSG_CLOSE_INPUT : PIE__V1__ATTACH_REQUEST__MSG_MESSAGE;
    if (close)
        r.close_input = &ci;
    else
        r.message = b;
    return rpc_stream_send(p->s, &r.base, &st);
}

/* Forwards stdin lines (without their newline) as messages; EOF closes the input. Polls so
 * that it notices when the instance has exited. */
static void *stdin_thread(void *arg) {
    stdin_pump *p = arg;
    char *line = NULL;
    size_t cap = 0, used = 0;
    char buf[4096];
    while (!atomic_load(&p->done)) {
        struct pollfd pfd = {.fd = 0, .events = POLLIN};
        int n = poll(&pfd, 1, 100);
        if (n <= 0) continue;
        ssize_t got = read(0, buf, sizeof buf);
        if (got <= 0) {
            if (used) send_input(p, line, used, false);
            send_input(p, NULL, 0, true);
            break;
        }
        for (ssize_t i = 0; i < got; i++) {
            if (buf[i] == '\n') {
                if (send_input(p, line ? line : "", used, false) != PIE_OK) goto out;
                used = 0;
                continue;
            }
            if (used == cap) {
                cap = cap ? cap * 2 : 256;
                char *nl = realloc(line, cap);
                if (nl == NULL) goto out;
                line = nl;
            }
            line[used++] = buf[i];
        }
    }
out:
    free(line);
    return NULL;
}

/* Prints what the stream delivers until it ends; returns the process exit status. */
static int stream_output(rpc_stream *s, const char *what) {
    int exit_status = 1;
    bool exited = false;
    for (;;) {
        ProtobufCMessage *m = NULL;
        if (rpc_stream_recv(s, &m, -1) != RPC_RECV_MESSAGE) break;
        Pie__V1__AttachResponse *r = (Pie__V1__AttachResponse *)m;
        switch (r->msg_case) {
        case PIE__V1__ATTACH_RESPONSE__MSG_STARTED:
            fprintf(stderr, "piectl: instance %016llx started\n",
                    (unsigned long long)r->started->instance_id);
            break;
        case PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE:
            fwrite(r->message.data, 1, r->message.len, stdout);
            fputc('\n', stdout);
            fflush(stdout);
            break;
        case PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA:
            fwrite(r->stdout_data.data, 1, r->stdout_data.len, stdout);
            fflush(stdout);
            break;
        case PIE__V1__ATTACH_RESPONSE__MSG_STDERR_DATA:
            fwrite(r->stderr_data.data, 1, r->stderr_data.len, stderr);
            break;
        case PIE__V1__ATTACH_RESPONSE__MSG_DROPPED_BYTES:
            fprintf(stderr, "piectl: %llu bytes of output were dropped while detached\n",
                    (unsigned long long)r->dropped_bytes);
            break;
        case PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS: {
            const Pie__V1__Status *st = r->exit_status->status;
            exited = true;
            if (st == NULL || st->code == 0) {
                exit_status = r->exit_status->exit_code & 0xff;
            } else {
                fprintf(stderr, "piectl: instance ended: %s: %s\n", pie_code_name((int)st->code),
                        st->message);
                exit_status = EXIT_STATUS_BASE + (int)st->code;
            }
            break;
        }
        default: break;
        }
        rpc_msg_free(m);
    }
    pie_status st;
    pie_code rc = rpc_stream_finish(s, &st);
    if (rc != PIE_OK) {
        fprintf(stderr, "piectl: %s: %s: %s\n", what, pie_code_name(rc), st.msg);
        return exited ? exit_status : 1;
    }
    return exit_status;
}

static int follow(rpc_stream *s, bool run, bool forward_stdin, const char *what) {
    stdin_pump p = {.s = s, .run = run};
    atomic_init(&p.done, false);
    pthread_t t;
    bool started = forward_stdin && pthread_create(&t, NULL, stdin_thread, &p) == 0;
    int rc = stream_output(s, what);
    atomic_store(&p.done, true);
    if (started) pthread_join(t, NULL);
    return rc;
}

typedef struct run_args {
    const char *model;
    bool no_stdin;
    Pie__V1__ResourceLimits limits;
} run_args;

/* Parses run options; returns the index of PROGRAM in argv, or -1. */
static int parse_run_args(int argc, char **argv, run_args *ra) {
    int i = 0;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) return i + 1 < argc ? i + 1 : -1;
        if (strcmp(a, "--no-stdin") == 0) {
            ra->no_stdin = true;
            continue;
        }
        if (i + 1 >= argc) return -1;
        const char *v = argv[++i];
        unsigned long long n = strtoull(v, NULL, 10);
        if (strcmp(a, "--model") == 0)
            ra->model = v;
        else if (strcmp(a, "--cpu-ms") == 0)
            ra->limits.cpu_ms = n;
        else if (strcmp(a, "--wall-ms") == 0)
            ra->limits.wall_ms = n;
        else if (strcmp(a, "--memory-mib") == 0)
            ra->limits.memory_bytes = n << 20;
        else if (strcmp(a, "--kv-pages") == 0)
            ra->limits.kv_pages = (uint32_t)n;
        else {
            fprintf(stderr, "piectl: run: unknown option %s\n", a);
            return -1;
        }
    }
    return i < argc ? i : -1;
}

static int cmd_run(const piectl_opts *o, int argc, char **argv) {
    run_args ra = {0};
    pie__v1__resource_limits__init(&ra.limits);
    int p = parse_run_args(argc, argv, &ra);
    if (p < 0) {
        fprintf(stderr, "piectl: usage: run [--model M] [--no-stdin] [--cpu-ms N] "
                        "[--wall-ms N] [--memory-mib N] [--kv-pages N] PROGRAM [ARGS...]\n");
        return 2;
    }
    rpc_channel *ch = lc_dial(o);
    if (ch == NULL) return 1;
    char id[65];
    snprintf(id, sizeof id, "%s", argv[p]);
    struct stat sb;
    if (stat(argv[p], &sb) == 0 && S_ISREG(sb.st_mode) && upload_file(o, ch, argv[p], NULL, id)) {
        rpc_channel_destroy(ch);
        return 1;
    }
    Pie__V1__LaunchRequest lr = PIE__V1__LAUNCH_REQUEST__INIT;
    lr.program_id = id;
    lr.model = (char *)(ra.model ? ra.model : "");
    lr.n_args = (size_t)(argc - p - 1);
    lr.args = argv + p + 1;
    lr.limits = &ra.limits;
    Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
    r.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    r.launch = &lr;
    pie_status st;
    rpc_stream *s = rpc_stream_open(ch, "/pie.v1.Lifecycle/Run",
                                    &pie__v1__attach_response__descriptor, NULL, &st);
    int rc = 1;
    if (s == NULL || rpc_stream_send(s, &r.base, &st) != PIE_OK) {
        if (s) rpc_stream_finish(s, &st);
        fprintf(stderr, "piectl: run: %s\n", st.msg);
    } else {
        rc = follow(s, true, !ra.no_stdin, "run");
    }
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    return rc;
}

static int cmd_attach(const piectl_opts *o, int argc, char **argv) {
    uint64_t id;
    bool no_stdin = argc == 2 && strcmp(argv[0], "--no-stdin") == 0;
    if (argc != 1 + no_stdin) {
        fprintf(stderr, "piectl: usage: attach [--no-stdin] INSTANCE_ID\n");
        return 2;
    }
    if (parse_id(argv[no_stdin], &id)) return 2;
    rpc_channel *ch = lc_dial(o);
    if (ch == NULL) return 1;
    Pie__V1__AttachStart as = PIE__V1__ATTACH_START__INIT;
    as.instance_id = id;
    Pie__V1__AttachRequest r = PIE__V1__ATTACH_REQUEST__INIT;
    r.msg_case = PIE__V1__ATTACH_REQUEST__MSG_START;
    r.start = &as;
    pie_status st;
    rpc_stream *s = rpc_stream_open(ch, "/pie.v1.Lifecycle/Attach",
                                    &pie__v1__attach_response__descriptor, NULL, &st);
    int rc = 1;
    if (s == NULL || rpc_stream_send(s, &r.base, &st) != PIE_OK) {
        if (s) rpc_stream_finish(s, &st);
        fprintf(stderr, "piectl: attach: %s\n", st.msg);
    } else {
        rc = follow(s, false, !no_stdin, "attach");
    }
    rpc_stream_destroy(s);
    rpc_channel_destroy(ch);
    return rc;
}

int piectl_lc_command(const piectl_opts *o, const char *cmd, int argc, char **argv) {
    if (strcmp(cmd, "upload") == 0) return cmd_upload(o, argc, argv);
    if (strcmp(cmd, "run") == 0) return cmd_run(o, argc, argv);
    if (strcmp(cmd, "attach") == 0) return cmd_attach(o, argc, argv);
    if (strcmp(cmd, "kill") == 0) return cmd_kill(o, argc, argv);
    if (strcmp(cmd, "delete") == 0) return cmd_delete(o, argc, argv);
    if (strcmp(cmd, "exports") == 0) return cmd_exports(o, argc, argv);
    if (strcmp(cmd, "unexport") == 0) return cmd_unexport(o, argc, argv);
    bool no_args = argc == 0;
    if (strcmp(cmd, "ps") == 0) return no_args ? cmd_ps(o) : 2;
    if (strcmp(cmd, "programs") == 0) return no_args ? cmd_programs(o) : 2;
    return -1;
}
