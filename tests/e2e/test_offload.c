/* test_offload.c — the offload memory policy (issue 13; Neo's CPU attention offload) under the
 * whole stack: controller, a cpu worker with memory.policy offload, lifecycle, real inferlets.
 *
 * Covered: with a device share of 4 pages (small-f32: 4 layers x 8 KiB a page) and a 64 MiB host
 * pool, the load-aware scheduler must send decodes' KV and attention to the host (the device
 * cannot hold them); text completion, parallel generation (a fork: pages shared between
 * sequences) and prefix caching's export, import and unexport say byte for byte what a worker
 * with policy gpu says, and the worker's metrics show decodes attended on the host and pages
 * moved there. The cluster helpers are test_swap.c's (a shared e2e helper would do). */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "e2e_support.h"
#include "pie/v1/controller.pb-c.h"
#include "pie_testutil.h"

#define STOP_MS 60000
#define WAIT_MS 60000 /* hang guard of every poll: sanitizer builds on 2 shared cores */

TestSuite(offload, .timeout = 600);

static Pie__V1__ClusterStatusResponse *cluster_status(rpc_channel *ch) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = WAIT_MS};
    if (rpc_unary(ch, "/pie.v1.Controller/ClusterStatus", &req.base,
                  &pie__v1__cluster_status_response__descriptor, &m, &o, &st) != PIE_OK)
        return NULL;
    return (Pie__V1__ClusterStatusResponse *)m;
}

/* Polls until worker `group` is the only one linked; returns its memory policy. */
static Pie__V1__MemoryPolicy wait_worker(rpc_channel *ctl, const char *group) {
    int64_t until = pie_test_now_ms() + WAIT_MS;
    for (;;) {
        Pie__V1__ClusterStatusResponse *cs = cluster_status(ctl);
        bool ok = cs && cs->n_workers == 1 && strcmp(cs->workers[0]->group_id, group) == 0;
        Pie__V1__MemoryPolicy p = ok ? cs->workers[0]->memory_policy : 0;
        rpc_msg_free(cs ? &cs->base : NULL);
        if (ok) return p;
        cr_assert(pie_test_now_ms() < until, "worker %s never linked alone", group);
        pie_test_sleep_ms(10);
    }
}

/* Replaces the cluster's worker with one started with env. */
static void replace_worker(e2e_cluster *c, const char *const *env) {
    pie_status st;
    int rc = pie_proc_stop(c->wrk, STOP_MS, &st);
    cr_assert_eq(rc, 0, "the worker exited with %d: %s", rc, st.msg);
    pie_proc_destroy(c->wrk);
    char ctl_env[96];
    pie_proc_env_controller(c->ctl, ctl_env, sizeof ctl_env);
    c->wrk = e2e_worker_start_env(ctl_env, env);
}

static void expect_same(const e2e_run *got, const e2e_run *want, const char *what) {
    cr_expect_eq(got->n_msgs, want->n_msgs, "%s: %zu messages, %zu with policy gpu", what,
                 got->n_msgs, want->n_msgs);
    for (size_t j = 0; j < got->n_msgs && j < want->n_msgs; j++)
        cr_expect(got->msg_lens[j] == want->msg_lens[j] &&
                      memcmp(got->msgs[j], want->msgs[j], want->msg_lens[j]) == 0,
                  "%s, message %zu: offload sent\n  \"%s\"\ngpu sent\n  \"%s\"", what, j, got->msgs[j],
                  want->msgs[j]);
}

#define N_RUNS 5
static const char *const tc_args[] = {
    "--prompt",     "The quick brown fox jumps over the lazy dog.",
    "--max-tokens", "32",
    "--ignore-eos", NULL};
static const char *const pg_args[] = {
    "--prompt",     "In a small village by the sea there lived an old fisherman who",
    "--n",          "3",
    "--suffixes",   " one day| never|",
    "--max-tokens", "20",
    "--ignore-eos", NULL};
static const char *const pc_args[] = {
    "--prefix",     "You are a helpful assistant who answers briefly and precisely.",
    "--prompt",     " Question: what is the color of the sky? Answer:",
    "--max-tokens", "16",
    "--ignore-eos", "--name",
    "offload-prefix",  NULL};
static const char *const pc_unexport[] = {"--unexport", "--name", "offload-prefix", NULL};

static void run_programs(e2e_cluster *c, char *const ids[3], e2e_run out[N_RUNS]) {
    const char *const *args[N_RUNS] = {tc_args, pg_args, pc_args, pc_args, pc_unexport};
    const int prog[N_RUNS] = {0, 1, 2, 2, 2};
    for (int i = 0; i < N_RUNS; i++) {
        e2e_run_program(c, ids[prog[i]], args[i], NULL, &out[i]);
        char what[32];
        snprintf(what, sizeof what, "run %d", i);
        e2e_assert_success(&out[i], what);
    }
}

/* The value of the metric series `series` (its whole name with labels) on the metrics port. */
static double metric(int port, const char *series) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "metrics port %d", port);
    const char req[] = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    cr_assert_eq(write(fd, req, sizeof req - 1), (ssize_t)(sizeof req - 1));
    static char body[1 << 20];
    size_t len = 0;
    for (ssize_t n; (n = read(fd, body + len, sizeof body - 1 - len)) > 0;) len += (size_t)n;
    close(fd);
    body[len] = '\0';
    char key[256];
    snprintf(key, sizeof key, "\n%s ", series);
    const char *at = strstr(body, key);
    cr_assert(at, "no series %s in the worker's metrics", series);
    return strtod(at + strlen(key), NULL);
}

Test(offload, host_attention_changes_no_output_of_fork_export_and_import) {
    const char *gpu_env[] = {"PIE_WORKER_GROUP_ID=gpu", NULL};
    e2e_cluster c;
    e2e_cluster_start_full(&c, gpu_env, NULL, NULL);
    pie_status st;
    rpc_channel *ctl = rpc_channel_create(pie_proc_addr(c.ctl), NULL, &st);
    cr_assert(ctl, "%s", st.msg);
    char *ids[3] = {e2e_upload(&c, "text_completion"), e2e_upload(&c, "parallel_generation"),
                    e2e_upload(&c, "prefix_caching")};
    cr_assert_eq(wait_worker(ctl, "gpu"), PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU);
    e2e_run gpu[N_RUNS], off[N_RUNS];
    run_programs(&c, ids, gpu);

    /* 4 device pages of every layer (128 KiB), the rest of the pages in the host pool */
    const char *off_env[] = {"PIE_WORKER_GROUP_ID=offload", "PIE_MEMORY_POLICY=offload",
                             "PIE_MEMORY_DEVICE_KV=128KiB", "PIE_MEMORY_HOST_POOL=64MiB", NULL};
    replace_worker(&c, off_env);
    cr_assert_eq(wait_worker(ctl, "offload"), PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD);
    run_programs(&c, ids, off);
    const char *what[N_RUNS] = {"text_completion", "parallel_generation", "prefix_caching (export)",
                                "prefix_caching (import)", "prefix_caching (unexport)"};
    for (int i = 0; i < N_RUNS; i++) expect_same(&off[i], &gpu[i], what[i]);
    cr_expect_str_eq(off[2].msgs[0], "miss", "the first prefix_caching instance");
    cr_expect_str_eq(off[3].msgs[0], "hit", "the second prefix_caching instance");
    /* decodes did attend on the host, and pages did move there */
    int port = pie_proc_metrics_port(c.wrk);
    cr_assert_gt(port, 0, "the worker serves no metrics");
    double hosted = metric(port, "pie_worker_offload_host_instances_total");
    double moved = metric(port, "pie_worker_offload_pages_moved_total{direction=\"to_host\"}");
    double forced = metric(port, "pie_worker_offload_steps_total{decision=\"forced\"}");
    cr_expect_gt(hosted, 0, "no decode attended on the host");
    cr_expect_gt(moved, 0, "no page moved to the host");
    cr_expect_gt(forced, 0, "4 device pages never forced a decode to the host");

    for (int i = 0; i < N_RUNS; i++) {
        e2e_run_free(&gpu[i]);
        e2e_run_free(&off[i]);
    }
    for (int i = 0; i < 3; i++) free(ids[i]);
    rpc_channel_destroy(ctl);
    e2e_cluster_stop(&c);
}
