/* test_run_output.c — issue 11, hole 4: while a client is attached, an instance's output is
 * never dropped. A slow client slows the inferlet down instead: its send() or stdout write waits
 * while the output waiting for the client is at instances.output_buffer, for as long as its wall
 * quota allows. Dropping (oldest first, dropped_bytes at the next attach) is only for output
 * written while no client is attached.
 *
 * A real pie-controller, CPU pie-worker and pie-lifecycle on loopback (tests/e2e/e2e_support.h)
 * with the fixture tests/wasm/sec_flood.c, which sends numbered messages (and stdout lines) as
 * fast as it can:
 *   * a Run whose client reads slowly (nothing at first, then in bursts with pauses) receives
 *     every message and line, in order, with no dropped_bytes, and the instance finishes — the
 *     issue's reproduction lost megabytes of a 50,000-message flood right after `started`;
 *   * a Run whose client stops reading: the inferlet blocks with at most about
 *     instances.output_buffer of its output held for the client, its wall quota ends it with
 *     DEADLINE_EXCEEDED, and everything it wrote before reaches the client when it reads again;
 *   * meanwhile another instance runs to its end undisturbed, and Terminate ends the blocked
 *     one at once;
 *   * a client that detaches from a blocked instance lets it run on under the detached policy. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_testutil.h"

TestSuite(security, .fini = pie_test_leak_check, .timeout = 600);

#define WAIT_MS 240000 /* sanitizer builds on 2 shared cores are slow */
#define MIB     (1u << 20)
/* What a client that stops reading may find waiting for it: the lifecycle's share is
 * instances.output_buffer (default 1 MiB) plus the message in flight; gRPC's stream windows
 * and the kernel's socket buffers on loopback hold a few MiB more (5-8 MiB measured, on a
 * connection that carries nothing else: another stream's traffic grows the windows). Without
 * back-pressure the lifecycle held 256 messages more than that (256 MiB of 1 MiB messages). */
#define HELD_MAX (16 * MIB)

/* ---- a client that checks what it reads ---------------------------------------------------- */

/* What one Run or Attach call delivered, checked as it arrives against sec_flood's output:
 * message i is SIZE bytes starting with i as 8 digits; in "mixed" mode stdout line i
 * ("line <i>") follows message i. */
typedef struct reader {
    rpc_stream *s;
    size_t size;  /* expected message size */
    bool mixed;   /* stdout lines follow the messages */
    long first;   /* index of the first message expected (after a drop: whatever comes first) */
    long n_msgs;  /* messages received */
    long n_lines; /* stdout lines received */
    char line[64];
    size_t line_len; /* stdout not yet ended by '\n' */
    uint64_t started_id;
    bool got_dropped;
    uint64_t dropped;
    char err[512]; /* stderr (the start of it) */
    size_t err_len;
    bool exited;
    uint32_t status;
    char status_msg[512];
    int32_t exit_code;
} reader;

static void reader_init(reader *r, rpc_stream *s, size_t size, bool mixed) {
    memset(r, 0, sizeof *r);
    r->s = s;
    r->size = size;
    r->mixed = mixed;
}

static void take_message(reader *r, const ProtobufCBinaryData *m) {
    long want = r->first + r->n_msgs;
    char head[9] = {0};
    if (m->len >= 8) memcpy(head, m->data, 8);
    if (r->n_msgs == 0 && r->got_dropped) { /* after a drop the stream resumes anywhere */
        r->first = atol(head);
        want = r->first;
    }
    char want_head[16];
    snprintf(want_head, sizeof want_head, "%08ld", want);
    if (m->len != r->size || memcmp(head, want_head, 8) != 0 ||
        m->data[m->len - 1] != (uint8_t)('a' + want % 26))
        cr_assert_fail("message %ld (after %ld in order): %zu bytes starting \"%s\", expected "
                       "%zu bytes starting \"%s\" and ending '%c'",
                       r->n_msgs, r->n_msgs, m->len, head, r->size, want_head,
                       (char)('a' + want % 26));
    if (r->mixed && r->n_lines != r->n_msgs)
        cr_assert_fail("message %ld arrived after %ld stdout lines: output out of order", want,
                       r->n_lines);
    r->n_msgs++;
}

static void take_stdout(reader *r, const ProtobufCBinaryData *d) {
    for (size_t i = 0; i < d->len; i++) {
        char ch = (char)d->data[i];
        if (ch != '\n') {
            cr_assert_lt(r->line_len, sizeof r->line - 1, "stdout line too long");
            r->line[r->line_len++] = ch;
            continue;
        }
        r->line[r->line_len] = 0;
        char want[32];
        snprintf(want, sizeof want, "line %ld", r->first + r->n_lines);
        if (strcmp(r->line, want) != 0 || r->n_msgs != r->n_lines + 1)
            cr_assert_fail("stdout line \"%s\" after %ld messages; expected \"%s\" after %ld",
                           r->line, r->n_msgs, want, r->n_lines + 1);
        r->n_lines++;
        r->line_len = 0;
    }
}

static void take(reader *r, const Pie__V1__AttachResponse *a) {
    cr_assert(!r->exited, "output after the exit status");
    switch (a->msg_case) {
    case PIE__V1__ATTACH_RESPONSE__MSG_STARTED: r->started_id = a->started->instance_id; break;
    case PIE__V1__ATTACH_RESPONSE__MSG_MESSAGE: take_message(r, &a->message); break;
    case PIE__V1__ATTACH_RESPONSE__MSG_STDOUT_DATA: take_stdout(r, &a->stdout_data); break;
    case PIE__V1__ATTACH_RESPONSE__MSG_STDERR_DATA: {
        size_t n = a->stderr_data.len;
        if (n > sizeof r->err - 1 - r->err_len) n = sizeof r->err - 1 - r->err_len;
        memcpy(r->err + r->err_len, a->stderr_data.data, n);
        r->err_len += n;
        break;
    }
    case PIE__V1__ATTACH_RESPONSE__MSG_DROPPED_BYTES:
        cr_assert(!r->got_dropped, "dropped_bytes sent twice");
        cr_assert_eq(r->n_msgs + r->n_lines, 0, "dropped_bytes after output");
        r->got_dropped = true;
        r->dropped = a->dropped_bytes;
        break;
    case PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS:
        r->exited = true;
        r->exit_code = a->exit_status->exit_code;
        if (a->exit_status->status) {
            r->status = a->exit_status->status->code;
            snprintf(r->status_msg, sizeof r->status_msg, "%s", a->exit_status->status->message);
        }
        break;
    default: cr_assert_fail("unexpected AttachResponse case %d", (int)a->msg_case);
    }
}

/* Reads one response; false at the end of the call (which must end OK). */
static bool read_one(reader *r) {
    ProtobufCMessage *m = NULL;
    rpc_recv_result rr = rpc_stream_recv(r->s, &m, WAIT_MS);
    cr_assert_neq(rr, RPC_RECV_TIMEOUT, "nothing for %d ms after %ld messages", WAIT_MS, r->n_msgs);
    if (rr == RPC_RECV_END) {
        pie_status st;
        cr_assert_eq(rpc_stream_finish(r->s, &st), PIE_OK, "the call ended %s: %s",
                     pie_code_name(st.code), st.msg);
        return false;
    }
    take(r, (const Pie__V1__AttachResponse *)m);
    rpc_msg_free(m);
    return true;
}

/* Reads to the end of the call, pausing pause_ms after every `every` responses, and destroys
 * the stream. */
static void read_to_end(reader *r, long every, int pause_ms) {
    for (long n = 1; read_one(r); n++)
        if (every && n % every == 0) pie_test_sleep_ms(pause_ms);
    rpc_stream_destroy(r->s);
    r->s = NULL;
    cr_assert(r->exited, "the call ended without an exit status");
}

/* ---- calls ----------------------------------------------------------------------------------- */

static rpc_stream *open_stream_on(rpc_channel *ch, const char *method) {
    char path[64];
    snprintf(path, sizeof path, "/pie.v1.Lifecycle/%s", method);
    pie_status st;
    rpc_call_opts o = {.timeout_ms = 2 * WAIT_MS, .wait_for_ready = true};
    rpc_stream *s = rpc_stream_open(ch, path, &pie__v1__attach_response__descriptor, &o, &st);
    cr_assert(s, "%s: %s", method, st.msg);
    return s;
}

static rpc_stream *open_stream(e2e_cluster *c, const char *method) {
    return open_stream_on(c->ch, method);
}

/* A second channel to c's lifecycle; its own TCP connection (rpc channels use a local
 * subchannel pool). */
static rpc_channel *own_channel(e2e_cluster *c) {
    pie_status st;
    rpc_channel *ch = rpc_channel_create(pie_proc_addr(c->lc), NULL, &st);
    cr_assert(ch, "%s", st.msg);
    return ch;
}

static void send_ok(rpc_stream *s, const ProtobufCMessage *m) {
    pie_status st;
    cr_assert_eq(rpc_stream_send(s, m, &st), PIE_OK, "send: %s", st.msg);
}

/* Run of prog with args (NULL-terminated) and wall_ms (0: the default); input closed. Reads
 * `started` into r. */
static void run_open_on(reader *r, rpc_channel *ch, const char *prog, const char *const *args,
                        uint64_t wall_ms, size_t size, bool mixed) {
    reader_init(r, open_stream_on(ch, "Run"), size, mixed);
    Pie__V1__ResourceLimits lim = PIE__V1__RESOURCE_LIMITS__INIT;
    lim.wall_ms = wall_ms;
    Pie__V1__LaunchRequest l = PIE__V1__LAUNCH_REQUEST__INIT;
    l.program_id = (char *)prog;
    while (args[l.n_args]) l.n_args++;
    l.args = (char **)args;
    l.limits = &lim;
    Pie__V1__RunRequest req = PIE__V1__RUN_REQUEST__INIT;
    req.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    req.launch = &l;
    send_ok(r->s, &req.base);
    Pie__V1__CloseInput ci = PIE__V1__CLOSE_INPUT__INIT;
    Pie__V1__RunRequest close = PIE__V1__RUN_REQUEST__INIT;
    close.msg_case = PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT;
    close.close_input = &ci;
    send_ok(r->s, &close.base);
    cr_assert(read_one(r), "Run ended before `started`");
    cr_assert_neq(r->started_id, 0, "the first response is not `started`");
}

static void run_open(reader *r, e2e_cluster *c, const char *prog, const char *const *args,
                     uint64_t wall_ms, size_t size, bool mixed) {
    run_open_on(r, c->ch, prog, args, wall_ms, size, mixed);
}

static ProtobufCMessage *unary(e2e_cluster *c, const char *method, const ProtobufCMessage *req,
                               const ProtobufCMessageDescriptor *resp_desc) {
    char path[64];
    snprintf(path, sizeof path, "/pie.v1.Lifecycle/%s", method);
    pie_status st;
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = WAIT_MS, .wait_for_ready = true};
    cr_assert_eq(rpc_unary(c->ch, path, req, resp_desc, &resp, &o, &st), PIE_OK, "%s: %s", method,
                 st.msg);
    return resp;
}

/* Waits for the lifecycle's log line of instance id's end (written before the exit status is
 * sent); false if none came within timeout_ms. */
static bool wait_exited(e2e_cluster *c, uint64_t id, int64_t timeout_ms) {
    char needle[96];
    snprintf(needle, sizeof needle, "event=lc.inst.exited instance=%016llx ",
             (unsigned long long)id);
    return pie_proc_wait_log(c->lc, needle, 1, timeout_ms);
}

/* Instance id as ListInstances shows it (asserts it is listed). */
static void instance_state(e2e_cluster *c, uint64_t id, Pie__V1__InstanceState *state,
                           bool *attached) {
    Pie__V1__ListInstancesRequest req = PIE__V1__LIST_INSTANCES_REQUEST__INIT;
    Pie__V1__ListInstancesResponse *l = (Pie__V1__ListInstancesResponse *)unary(
        c, "ListInstances", &req.base, &pie__v1__list_instances_response__descriptor);
    bool found = false;
    for (size_t i = 0; i < l->n_instances; i++)
        if (l->instances[i]->instance_id == id) {
            found = true;
            *state = l->instances[i]->state;
            *attached = l->instances[i]->attached;
        }
    rpc_msg_free(&l->base);
    cr_assert(found, "instance %016llx is not listed", (unsigned long long)id);
}

/* ---- tests ----------------------------------------------------------------------------------- */

Test(security, a_slow_reader_of_run_gets_every_message_and_line_in_order) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "sec_flood");
    /* The issue lost output right after `started` in 4 Runs of 6: Run launched the instance and
     * attached the call only afterwards, so a flood that began in between met a detached
     * instance's buffer (oldest dropped). Several floods at once, each 20 times the buffer,
     * every one read slowly. */
    const char *args[] = {"mixed", "20000", "1000", NULL};
#define N_RUNS 6
    reader r[N_RUNS];
    for (int i = 0; i < N_RUNS; i++) run_open(&r[i], &c, prog, args, 0, 1000, true);
    pie_test_sleep_ms(300); /* not reading: the inferlets fill whatever they may */
    for (int i = 0; i < N_RUNS; i++) {
        read_to_end(&r[i], 2000, 5);
        cr_expect(!r[i].got_dropped, "run %d: %llu bytes dropped while attached", i,
                  (unsigned long long)r[i].dropped);
        cr_expect_eq(r[i].n_msgs, 20000, "run %d: %ld messages of 20000", i, r[i].n_msgs);
        cr_expect_eq(r[i].n_lines, 20000, "run %d: %ld stdout lines of 20000", i, r[i].n_lines);
        cr_expect(r[i].status == PIE_OK && r[i].exit_code == 0, "run %d: status %u \"%s\", exit %d",
                  i, r[i].status, r[i].status_msg, r[i].exit_code);
        cr_expect_str_eq(r[i].err, "sent 20000\n");
    }
    free(prog);
    e2e_cluster_stop(&c);
}

Test(security, a_client_that_stops_reading_blocks_the_inferlet_until_its_wall_quota) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "sec_flood");
    /* 400 MiB in 1 MiB messages: without back-pressure the lifecycle would hold all of it */
    const char *args[] = {"send", "400", "1048576", NULL};
    reader r;
    run_open(&r, &c, prog, args, 3000, 1048576, false);
    cr_assert(wait_exited(&c, r.started_id, WAIT_MS),
              "the instance blocked on its client did not end at its 3 s wall quota");
    read_to_end(&r, 0, 0);
    cr_expect_eq(r.status, PIE_DEADLINE_EXCEEDED, "status %u \"%s\"", r.status, r.status_msg);
    cr_expect(strstr(r.status_msg, "wall-time quota"), "\"%s\"", r.status_msg);
    cr_expect(!r.got_dropped, "%llu bytes dropped while attached", (unsigned long long)r.dropped);
    /* What the client read after the exit is what the lifecycle held for it (and what gRPC
     * had in flight): about one output buffer, not the 400 MiB the inferlet tried to write. */
    cr_expect_geq(r.n_msgs, 1, "nothing was delivered");
    cr_expect_leq((uint64_t)r.n_msgs * MIB, HELD_MAX,
                  "%ld MiB were held for a client that did not read (output_buffer: 1 MiB)",
                  r.n_msgs);
    free(prog);
    e2e_cluster_stop(&c);
}

/* Under AddressSanitizer freed blocks wait in a quarantine (256 MiB by default) that stays
 * resident, so a process's RSS counts what it ever freed, not what it holds: the RSS bound below
 * then failed about one run in five. The services this test starts inherit the environment;
 * other builds ignore ASAN_OPTIONS. */
static void asan_small_quarantine(void) {
    const char *old = getenv("ASAN_OPTIONS");
    char opts[512];
    snprintf(opts, sizeof opts, "%s%squarantine_size_mb=1", old ? old : "", old && *old ? ":" : "");
    cr_assert_eq(setenv("ASAN_OPTIONS", opts, 1), 0);
}

/* The lifecycle's resident memory (VmRSS of /proc/<pid>/status), in bytes. */
static uint64_t rss_bytes(e2e_cluster *c) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", pie_proc_pid(c->lc));
    FILE *f = fopen(path, "r");
    cr_assert(f, "cannot open %s", path);
    uint64_t kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %llu kB", (unsigned long long *)&kib) == 1) break;
    fclose(f);
    cr_assert_gt(kib, 0, "no VmRSS in %s", path);
    return kib * 1024;
}

Test(security, a_blocked_inferlet_stalls_no_other_instance_and_terminate_ends_it) {
    asan_small_quarantine(); /* before the services start: they measure by RSS */
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "sec_flood");
    uint64_t rss0 = rss_bytes(&c);
    const char *flood[] = {"send", "100000", "1048576", NULL}; /* 100 GB: blocks */
    /* A reads on a connection of its own: gRPC grows a connection's flow-control windows with
     * the traffic it carries (BDP probing), so sharing B's fast connection let A's stream
     * window grow to 8-16 MiB more (up to 21 MiB held, 2 runs in parallel under ASan on a
     * loaded machine) — memory of the client's own transport, not the lifecycle's. */
    rpc_channel *own = own_channel(&c);
    reader a;
    run_open_on(&a, own, prog, flood, 0, MIB, false);

    /* meanwhile another flood runs to its end (and gives A ample time to fill its share) */
    const char *other[] = {"mixed", "20000", "1000", NULL};
    reader b;
    run_open(&b, &c, prog, other, 0, 1000, true);
    read_to_end(&b, 0, 0);
    cr_assert(!b.got_dropped);
    cr_assert_eq(b.n_msgs, 20000, "the other instance delivered %ld messages of 20000", b.n_msgs);
    cr_assert_eq(b.n_lines, 20000);
    cr_assert(b.status == PIE_OK && b.exit_code == 0, "status %u \"%s\"", b.status, b.status_msg);

    Pie__V1__InstanceState state;
    bool attached;
    instance_state(&c, a.started_id, &state, &attached);
    cr_assert_eq(state, PIE__V1__INSTANCE_STATE__INSTANCE_STATE_RUNNING);
    cr_assert(attached);
    uint64_t rss1 = rss_bytes(&c);
    cr_expect_lt(rss1, rss0 + 4 * HELD_MAX,
                 "the lifecycle grew by %llu MiB while an instance wrote to a client that does "
                 "not read",
                 (unsigned long long)((rss1 - rss0) / MIB));

    Pie__V1__TerminateRequest t = PIE__V1__TERMINATE_REQUEST__INIT;
    t.instance_id = a.started_id;
    rpc_msg_free(unary(&c, "Terminate", &t.base, &pie__v1__terminate_response__descriptor));
    cr_assert(wait_exited(&c, a.started_id, WAIT_MS), "Terminate did not end the blocked writer");
    read_to_end(&a, 0, 0);
    cr_expect_eq(a.status, PIE_CANCELLED, "status %u \"%s\"", a.status, a.status_msg);
    cr_expect_str_eq(a.status_msg, "terminated by client");
    cr_expect(!a.got_dropped);
    cr_expect_leq((uint64_t)a.n_msgs * MIB, HELD_MAX,
                  "%ld MiB were held for a client that did not read", a.n_msgs);
    free(prog);
    rpc_channel_destroy(own);
    e2e_cluster_stop(&c);
}

Test(security, a_client_that_detaches_from_a_blocked_inferlet_lets_it_run_on_detached) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "sec_flood");
    const char *args[] = {"send", "5000", "1000", "wait", NULL}; /* 5 MB after a client message */
    Pie__V1__LaunchRequest l = PIE__V1__LAUNCH_REQUEST__INIT;
    l.program_id = prog;
    l.n_args = 4;
    l.args = (char **)args;
    Pie__V1__LaunchResponse *lr = (Pie__V1__LaunchResponse *)unary(
        &c, "Launch", &l.base, &pie__v1__launch_response__descriptor);
    uint64_t id = lr->instance_id;
    rpc_msg_free(&lr->base);

    /* attach, let it start, read a little, then stop reading and cancel the call */
    reader r;
    reader_init(&r, open_stream(&c, "Attach"), 1000, false);
    Pie__V1__AttachStart start = PIE__V1__ATTACH_START__INIT;
    start.instance_id = id;
    Pie__V1__AttachRequest ar = PIE__V1__ATTACH_REQUEST__INIT;
    ar.msg_case = PIE__V1__ATTACH_REQUEST__MSG_START;
    ar.start = &start;
    send_ok(r.s, &ar.base);
    Pie__V1__AttachRequest go = PIE__V1__ATTACH_REQUEST__INIT;
    go.msg_case = PIE__V1__ATTACH_REQUEST__MSG_MESSAGE;
    go.message.data = (uint8_t *)"go";
    go.message.len = 2;
    send_ok(r.s, &go.base);
    while (r.n_msgs < 10) cr_assert(read_one(&r), "the call ended early");
    cr_assert(!r.got_dropped);
    rpc_stream_cancel(r.s);
    pie_status st;
    rpc_stream_finish(r.s, &st);
    rpc_stream_destroy(r.s);

    /* detached, it runs to its end; the next client gets the tail after dropped_bytes */
    cr_assert(wait_exited(&c, id, WAIT_MS), "the instance did not run on after the detach");
    reader_init(&r, open_stream(&c, "Attach"), 1000, false);
    send_ok(r.s, &ar.base);
    read_to_end(&r, 0, 0);
    cr_assert(r.status == PIE_OK && r.exit_code == 0, "status %u \"%s\"", r.status, r.status_msg);
    cr_assert_str_eq(r.err, "sent 5000\n");
    cr_assert(r.got_dropped && r.dropped > 0, "no dropped_bytes for output beyond the buffer");
    cr_assert_eq(r.first + r.n_msgs, 5000, "the buffered tail ends at message %ld",
                 r.first + r.n_msgs - 1);
    cr_assert_leq((uint64_t)r.n_msgs * 1000, MIB);
    free(prog);
    e2e_cluster_stop(&c);
}

/* The output an instance writes while no client is attached is kept for the next Attach: up to
 * instances.output_buffer while it runs, and for instances.retention (60 s) after it exits.
 * That memory was charged nowhere: a tenant that launched instances which each write a buffer's
 * worth and exit made the replica hold launches-per-second × 60 s × 1 MiB, whatever its
 * limits.replica_memory (this test: 128 instances, 126 MiB held by a replica with a 32 MiB
 * budget). Buffered output now counts in the budget, and what exited instances keep is the
 * first to go when the budget is short: the oldest exit's output first, its next Attach told
 * dropped_bytes; its exit status stays listed until its retention ends. */
Test(security, the_output_exited_instances_keep_is_held_within_the_replica_budget) {
    asan_small_quarantine(); /* before the services start: they measure by RSS */
    e2e_cluster c;
    const char *env[] = {"PIE_LIMITS_REPLICA_MEMORY=32MiB", NULL};
    e2e_cluster_start_env(&c, env);
    char *prog = e2e_upload(&c, "sec_flood");
    const char *args[] = {"send", "1000", "1000", NULL}; /* ~1 MB of messages, then exits */
    pie_status st;
    /* one instance first, so that what any instance costs is in the baseline */
    uint64_t warm = e2e_launch(&c, prog, args, PIE_OK, &st);
    cr_assert(wait_exited(&c, warm, WAIT_MS), "the first instance did not exit");
    uint64_t rss0 = rss_bytes(&c);
#define N_EXITED 128
    uint64_t ids[N_EXITED];
    for (int i = 0; i < N_EXITED; i++) {
        ids[i] = e2e_launch(&c, prog, args, PIE_OK, &st);
        cr_assert(wait_exited(&c, ids[i], WAIT_MS), "instance %d did not exit", i);
    }
    uint64_t rss1 = rss_bytes(&c);
    /* 32 MiB of output at most, and what ASan adds to it (~30%) */
    cr_expect_lt(rss1, rss0 + 64 * MIB,
                 "the replica grew by %llu MiB holding the output of %d exited instances "
                 "(limits.replica_memory: 32 MiB)",
                 (unsigned long long)((rss1 - rss0) / MIB), N_EXITED);

    /* the newest exit's output is whole */
    Pie__V1__AttachStart start = PIE__V1__ATTACH_START__INIT;
    Pie__V1__AttachRequest ar = PIE__V1__ATTACH_REQUEST__INIT;
    ar.msg_case = PIE__V1__ATTACH_REQUEST__MSG_START;
    ar.start = &start;
    reader r;
    start.instance_id = ids[N_EXITED - 1];
    reader_init(&r, open_stream(&c, "Attach"), 1000, false);
    send_ok(r.s, &ar.base);
    read_to_end(&r, 0, 0);
    cr_expect(!r.got_dropped, "the newest exit lost %llu bytes", (unsigned long long)r.dropped);
    cr_expect_eq(r.n_msgs, 1000, "the newest exit kept %ld messages of 1000", r.n_msgs);
    cr_expect_str_eq(r.err, "sent 1000\n");

    /* the oldest's went first: its Attach says so, and its exit status is still there */
    start.instance_id = ids[0];
    reader_init(&r, open_stream(&c, "Attach"), 1000, false);
    send_ok(r.s, &ar.base);
    read_to_end(&r, 0, 0);
    cr_expect(r.got_dropped, "the oldest exit kept its output beyond the replica's budget");
    cr_expect_eq(r.dropped, 1000u * 1000u + strlen("sent 1000\n"), "dropped_bytes %llu",
                 (unsigned long long)r.dropped);
    cr_expect_eq(r.n_msgs, 0);
    cr_expect(r.status == PIE_OK && r.exit_code == 0, "status %u \"%s\", exit %d", r.status,
              r.status_msg, r.exit_code);

    /* what the exited instances keep never stands in the way of a launch */
    e2e_run run;
    e2e_run_program(&c, prog, args, NULL, &run);
    e2e_assert_success(&run, "a launch after the exits");
    cr_expect_eq(run.n_msgs, 1000);
    e2e_run_free(&run);
    free(prog);
    e2e_cluster_stop(&c);
}
