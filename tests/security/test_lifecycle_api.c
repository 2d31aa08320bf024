/* test_lifecycle_api.c — issue 11, item 8: the public Lifecycle API's answers to requests at its
 * edges, through a real pie-controller, CPU pie-worker and pie-lifecycle on loopback
 * (tests/e2e/e2e_support.h), with the fixtures tests/wasm/lc_echo.c and tests/wasm/hostile.c:
 *   * a launch that asks for the largest linear memory (the default limits.max.memory, 4GiB)
 *     runs, with the runtime's real maximum (65,535 pages) as its effective limit;
 *   * a request that does not parse is INVALID_ARGUMENT (INTERNAL is for server bugs), on a
 *     unary call and on a stream;
 *   * a second launch in Run, or a second start in Attach, is FAILED_PRECONDITION;
 *   * every instance's end is logged at info level with its instance, program, tenant, status
 *     and reason: lc.inst.exited, or lc.inst.trapped when its code trapped. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_testutil.h"

TestSuite(security, .fini = pie_test_leak_check, .timeout = 600);

#define WAIT_MS 120000

/* What a Run or Attach call delivered. */
typedef struct ended {
    uint64_t started_id;     /* InstanceStarted (Run) */
    uint64_t started_memory; /* its limits.memory_bytes */
    bool exited;
    uint32_t status;
    char status_msg[512];
    int32_t exit_code;
    pie_code call_code; /* the call's own gRPC status */
    char call_msg[PIE_STATUS_MSG_MAX];
} ended;

static rpc_stream *open_stream(e2e_cluster *c, const char *method) {
    char path[64];
    snprintf(path, sizeof path, "/pie.v1.Lifecycle/%s", method);
    pie_status st;
    rpc_call_opts o = {.timeout_ms = WAIT_MS, .wait_for_ready = true};
    rpc_stream *s = rpc_stream_open(c->ch, path, &pie__v1__attach_response__descriptor, &o, &st);
    cr_assert(s, "%s: %s", method, st.msg);
    return s;
}

static void send_ok(rpc_stream *s, const ProtobufCMessage *m) {
    pie_status st;
    cr_assert_eq(rpc_stream_send(s, m, &st), PIE_OK, "send: %s", st.msg);
}

/* Sends Run's launch of prog with args (NULL-terminated); memory_bytes 0: the default. */
static void send_launch(rpc_stream *s, const char *prog, const char *const *args,
                        uint64_t memory_bytes) {
    Pie__V1__ResourceLimits lim = PIE__V1__RESOURCE_LIMITS__INIT;
    lim.memory_bytes = memory_bytes;
    Pie__V1__LaunchRequest l = PIE__V1__LAUNCH_REQUEST__INIT;
    l.program_id = (char *)prog;
    while (args && args[l.n_args]) l.n_args++;
    l.args = (char **)args;
    l.limits = &lim;
    Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
    r.msg_case = PIE__V1__RUN_REQUEST__MSG_LAUNCH;
    r.launch = &l;
    send_ok(s, &r.base);
}

/* Reads s to its end into *e and destroys it. */
static void collect(rpc_stream *s, ended *e) {
    memset(e, 0, sizeof *e);
    for (;;) {
        ProtobufCMessage *m = NULL;
        rpc_recv_result rr = rpc_stream_recv(s, &m, WAIT_MS);
        cr_assert_neq(rr, RPC_RECV_TIMEOUT, "nothing for %d ms", WAIT_MS);
        if (rr == RPC_RECV_END) break;
        const Pie__V1__AttachResponse *a = (const Pie__V1__AttachResponse *)m;
        if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_STARTED) {
            e->started_id = a->started->instance_id;
            e->started_memory = a->started->limits ? a->started->limits->memory_bytes : 0;
        } else if (a->msg_case == PIE__V1__ATTACH_RESPONSE__MSG_EXIT_STATUS) {
            e->exited = true;
            e->exit_code = a->exit_status->exit_code;
            if (a->exit_status->status) {
                e->status = a->exit_status->status->code;
                snprintf(e->status_msg, sizeof e->status_msg, "%s",
                         a->exit_status->status->message);
            }
        }
        rpc_msg_free(m);
    }
    pie_status st;
    e->call_code = rpc_stream_finish(s, &st);
    snprintf(e->call_msg, sizeof e->call_msg, "%s", st.msg);
    rpc_stream_destroy(s);
}

/* Runs prog with args to its end (input closed after the launch). */
static void run(e2e_cluster *c, const char *prog, const char *const *args, uint64_t memory_bytes,
                ended *e) {
    rpc_stream *s = open_stream(c, "Run");
    send_launch(s, prog, args, memory_bytes);
    Pie__V1__CloseInput ci = PIE__V1__CLOSE_INPUT__INIT;
    Pie__V1__RunRequest r = PIE__V1__RUN_REQUEST__INIT;
    r.msg_case = PIE__V1__RUN_REQUEST__MSG_CLOSE_INPUT;
    r.close_input = &ci;
    send_ok(s, &r.base);
    collect(s, e);
    cr_assert_eq(e->call_code, PIE_OK, "Run: %s", e->call_msg);
    cr_assert(e->exited, "Run ended without an exit status");
}

Test(security, a_launch_asking_for_the_largest_memory_runs_with_the_runtimes_maximum) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "lc_echo");
    const char *args[] = {"exit", "0", NULL};
    ended e;
    run(&c, prog, args, 4ull << 30, &e); /* 4GiB: the default limits.max.memory */
    cr_expect_eq(e.status, PIE_OK, "asking for 4GiB of memory: status %u \"%s\"", e.status,
                 e.status_msg);
    cr_expect_eq(e.started_memory, 65535ull * 65536,
                 "the effective memory limit is %llu bytes, not the runtime's 65,535 pages",
                 (unsigned long long)e.started_memory);
    run(&c, prog, args, 0, &e); /* the default (256MiB) is unchanged */
    cr_expect_eq(e.status, PIE_OK, "%s", e.status_msg);
    cr_expect_eq(e.started_memory, 256ull << 20);
    free(prog);
    e2e_cluster_stop(&c);
}

Test(security, a_request_that_does_not_parse_is_invalid_argument) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    /* TerminateRequest{instance_id = 5} is field 1 as a varint; LaunchRequest's field 1
     * (program_id) and RunRequest's (launch) are length-delimited: neither parses. */
    Pie__V1__TerminateRequest bad = PIE__V1__TERMINATE_REQUEST__INIT;
    bad.instance_id = 5;
    pie_status st;
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = WAIT_MS, .wait_for_ready = true};
    pie_code rc = rpc_unary(c.ch, "/pie.v1.Lifecycle/Launch", &bad.base,
                            &pie__v1__launch_response__descriptor, &resp, &o, &st);
    rpc_msg_free(resp);
    cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "Launch with unparseable bytes: %s (%s)",
                 pie_code_name(rc), st.msg);
    cr_expect_str_eq(st.msg, "cannot parse request as pie.v1.LaunchRequest");

    rpc_stream *s = open_stream(&c, "Run");
    send_ok(s, &bad.base);
    ended e;
    collect(s, &e);
    cr_expect_eq(e.call_code, PIE_INVALID_ARGUMENT, "Run with unparseable bytes: %s (%s)",
                 pie_code_name(e.call_code), e.call_msg);
    cr_expect_str_eq(e.call_msg, "cannot parse request as pie.v1.RunRequest");
    e2e_cluster_stop(&c);
}

Test(security, a_second_launch_in_run_or_start_in_attach_is_failed_precondition) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "lc_echo");
    const char *wait_args[] = {"wait", NULL};

    /* Run: the first launch starts an instance; the second ends the call (and, as for any
     * failed Run, the instance). */
    rpc_stream *s = open_stream(&c, "Run");
    send_launch(s, prog, wait_args, 0);
    send_launch(s, prog, wait_args, 0);
    ended e;
    collect(s, &e);
    cr_assert_neq(e.started_id, 0, "the first launch started an instance");
    cr_expect_eq(e.call_code, PIE_FAILED_PRECONDITION, "a second launch: %s (%s)",
                 pie_code_name(e.call_code), e.call_msg);
    char want[160];
    snprintf(want, sizeof want,
             "launch: this call already launched instance %016llx; only its first message may be "
             "launch",
             (unsigned long long)e.started_id);
    cr_expect_str_eq(e.call_msg, want);

    /* Attach: the first start attaches; the second ends the call; the instance runs on. */
    Pie__V1__LaunchRequest l = PIE__V1__LAUNCH_REQUEST__INIT;
    l.program_id = prog;
    l.n_args = 1;
    l.args = (char **)wait_args;
    ProtobufCMessage *resp = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = WAIT_MS, .wait_for_ready = true};
    cr_assert_eq(rpc_unary(c.ch, "/pie.v1.Lifecycle/Launch", &l.base,
                           &pie__v1__launch_response__descriptor, &resp, &o, &st),
                 PIE_OK, "Launch: %s", st.msg);
    uint64_t id = ((Pie__V1__LaunchResponse *)resp)->instance_id;
    rpc_msg_free(resp);
    s = open_stream(&c, "Attach");
    Pie__V1__AttachStart start = PIE__V1__ATTACH_START__INIT;
    start.instance_id = id;
    Pie__V1__AttachRequest ar = PIE__V1__ATTACH_REQUEST__INIT;
    ar.msg_case = PIE__V1__ATTACH_REQUEST__MSG_START;
    ar.start = &start;
    send_ok(s, &ar.base);
    send_ok(s, &ar.base);
    collect(s, &e);
    cr_expect_eq(e.call_code, PIE_FAILED_PRECONDITION, "a second start: %s (%s)",
                 pie_code_name(e.call_code), e.call_msg);
    snprintf(want, sizeof want,
             "start: this call already is attached to instance %016llx; only its first message "
             "may be start",
             (unsigned long long)id);
    cr_expect_str_eq(e.call_msg, want);
    Pie__V1__TerminateRequest t = PIE__V1__TERMINATE_REQUEST__INIT;
    t.instance_id = id;
    cr_assert_eq(rpc_unary(c.ch, "/pie.v1.Lifecycle/Terminate", &t.base,
                           &pie__v1__terminate_response__descriptor, &resp, &o, &st),
                 PIE_OK, "Terminate: %s", st.msg);
    rpc_msg_free(resp);
    free(prog);
    e2e_cluster_stop(&c);
}

/* The lifecycle's log line for instance id's end (event "lc.inst.exited" or "lc.inst.trapped"),
 * copied into line[cap]; waits for it (it is written before the client sees the exit). */
static void end_line(e2e_cluster *c, const char *event, uint64_t id, char *line, size_t cap) {
    char needle[96];
    snprintf(needle, sizeof needle, "event=%s instance=%016llx ", event, (unsigned long long)id);
    cr_assert(pie_proc_wait_log(c->lc, needle, 1, WAIT_MS), "no \"%s\" in the lifecycle's log",
              needle);
    char *log = pie_proc_log(c->lc);
    cr_assert(log);
    const char *at = strstr(log, needle);
    cr_assert(at);
    const char *bol = at, *eol = strchr(at, '\n');
    while (bol > log && bol[-1] != '\n') bol--;
    size_t n = eol ? (size_t)(eol - bol) : strlen(bol);
    snprintf(line, cap, "%.*s", (int)n, bol);
    free(log);
}

static void expect_in(const char *line, const char *part) {
    cr_expect(strstr(line, part), "\"%s\" is not in the log line\n  %s", part, line);
}

Test(security, every_instance_end_is_logged_at_info_with_its_reason) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *echo = e2e_upload(&c, "lc_echo");
    char *hostile = e2e_upload(&c, "hostile");
    char line[2048], part[160];

    const char *exit3[] = {"exit", "3", NULL};
    ended e;
    run(&c, echo, exit3, 0, &e);
    cr_assert_eq(e.exit_code, 3);
    end_line(&c, "lc.inst.exited", e.started_id, line, sizeof line);
    expect_in(line, "level=info ");
    snprintf(part, sizeof part, " program=%s name=\"lc_echo\" tenant=anonymous status=OK ", echo);
    expect_in(line, part);
    expect_in(line, " exit_code=3 ");
    expect_in(line, " reason=");

    const char *oob[] = {"oob-read", NULL};
    run(&c, hostile, oob, 0, &e);
    cr_assert_eq(e.status, PIE_ABORTED, "%s", e.status_msg);
    end_line(&c, "lc.inst.trapped", e.started_id, line, sizeof line);
    expect_in(line, "level=info ");
    snprintf(part, sizeof part, " program=%s name=\"hostile\" tenant=anonymous status=ABORTED ",
             hostile);
    expect_in(line, part);
    char reason[600];
    snprintf(reason, sizeof reason, " reason=\"%s\"", e.status_msg);
    expect_in(line, reason);
    free(echo);
    free(hostile);
    e2e_cluster_stop(&c);
}
