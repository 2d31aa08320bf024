/* test_services.c — the three service binaries as processes: start on loopback with ephemeral
 * ports, health, the cluster they form (WorkerLink, Session, ClusterStatus, ListModels, Info),
 * re-registration after a controller restart and the redial cadence while it is down,
 * bearer-token auth, configuration errors and the command line, /metrics, and a clean exit 0 on
 * SIGTERM/SIGINT.
 *
 * Processes come from tests/support/pie_proc.h; calls go through services/common/rpc. Every
 * wait polls with a deadline; reconnect backoffs are shortened through the environment so the
 * whole file runs in well under a minute, under the sanitizers too. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "pie/v1/controller.pb-c.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie/v1/worker.pb-c.h"
#include "pie_proc.h"
#include "pie_testcerts.h"
#include "pie_testutil.h"
#include "rpc.h"

#define START_MS 20000 /* a service is serving within this (generous: sanitizers, loaded CI) */
#define STOP_MS  20000 /* and exits within this after SIGTERM */
#define LINK_MS  10000 /* worker/replica linked (or unlinked) within this */
#define CALL_MS  5000  /* deadline of one RPC */
#define TOKEN    "s3cret-token"

/* Short backoffs for every process that dials the controller. */
#define ENV_RECONNECT "PIE_CONTROLLER_RECONNECT_INITIAL=50ms", "PIE_CONTROLLER_RECONNECT_MAX=200ms"
/* What every worker serves: the generated tiny model, under the name "tiny". */
#define ENV_MODEL "PIE_MODEL_PATH=" PIE_MODELS_DIR "/tiny-f32", "PIE_MODEL_NAME=tiny"

typedef Pie__V1__ClusterStatusResponse cluster_status;
typedef Pie__V1__ListModelsResponse models_list;

TestSuite(services, .fini = pie_test_leak_check, .timeout = 90);

/* ---- helpers -------------------------------------------------------------------------------- */

static pie_proc *start(const char *bin, const char *const *env) {
    pie_status st;
    pie_proc_opts o = {.env = env};
    pie_proc *p = pie_proc_start(bin, &o, START_MS, &st);
    cr_assert(p, "%s", st.msg);
    return p;
}

/* SIGTERM (or sig), and the exit status must be 0. */
static void stop_ok(pie_proc *p, int sig) {
    pie_status st;
    cr_assert_eq(pie_proc_signal(p, sig, &st), PIE_OK, "%s", st.msg);
    int rc = pie_proc_wait(p, STOP_MS, &st);
    char *tail = pie_proc_log_tail(p, 3000);
    cr_assert_eq(rc, 0, "%s exited with %d after signal %d: %s\nlog:\n%s", pie_proc_name(p), rc,
                 sig, st.msg, tail ? tail : "");
    free(tail);
    pie_proc_destroy(p);
}

static rpc_channel *channel_to(const pie_proc *p, const char *token) {
    pie_status st;
    rpc_channel_opts o = {.token = token, .reconnect_initial_ms = 50, .reconnect_max_ms = 200};
    rpc_channel *ch = rpc_channel_create(pie_proc_addr(p), &o, &st);
    cr_assert(ch, "%s", st.msg);
    return ch;
}

static pie_code get_cluster_status(rpc_channel *ch, cluster_status **out, pie_status *st) {
    Pie__V1__ClusterStatusRequest req = PIE__V1__CLUSTER_STATUS_REQUEST__INIT;
    rpc_call_opts co = {.timeout_ms = CALL_MS};
    return rpc_unary(ch, "/pie.v1.Controller/ClusterStatus", &req.base,
                     &pie__v1__cluster_status_response__descriptor, (ProtobufCMessage **)out, &co,
                     st);
}

static pie_code get_models(rpc_channel *ch, models_list **out, pie_status *st) {
    Pie__V1__ListModelsRequest req = PIE__V1__LIST_MODELS_REQUEST__INIT;
    rpc_call_opts co = {.timeout_ms = CALL_MS};
    return rpc_unary(ch, "/pie.v1.Lifecycle/ListModels", &req.base,
                     &pie__v1__list_models_response__descriptor, (ProtobufCMessage **)out, &co, st);
}

/* Polls ClusterStatus until it lists n_workers workers and n_replicas replicas; returns that
 * response (caller frees), failing the test with the last answer at the deadline. */
static cluster_status *wait_cluster(rpc_channel *ch, size_t n_workers, size_t n_replicas,
                                    int64_t timeout_ms) {
    int64_t deadline = pie_test_now_ms() + timeout_ms;
    pie_status st = {0};
    size_t last_w = 0, last_r = 0;
    for (;;) {
        cluster_status *cs = NULL;
        if (get_cluster_status(ch, &cs, &st) == PIE_OK) {
            if (cs->n_workers == n_workers && cs->n_replicas == n_replicas) return cs;
            last_w = cs->n_workers;
            last_r = cs->n_replicas;
            rpc_msg_free(&cs->base);
        }
        cr_assert(pie_test_now_ms() < deadline,
                  "ClusterStatus: wanted %zu workers and %zu replicas within %lld ms; last answer "
                  "%zu and %zu (last call: %s %s)",
                  n_workers, n_replicas, (long long)timeout_ms, last_w, last_r,
                  pie_code_name(st.code), st.msg);
        pie_test_sleep_ms(20);
    }
}

/* Polls ListModels until it lists n models; returns that response (caller frees). */
static models_list *wait_models(rpc_channel *ch, size_t n, int64_t timeout_ms) {
    int64_t deadline = pie_test_now_ms() + timeout_ms;
    pie_status st = {0};
    size_t last = 0;
    for (;;) {
        models_list *ml = NULL;
        if (get_models(ch, &ml, &st) == PIE_OK) {
            if (ml->n_models == n) return ml;
            last = ml->n_models;
            rpc_msg_free(&ml->base);
        }
        cr_assert(
            pie_test_now_ms() < deadline,
            "ListModels: wanted %zu models within %lld ms; last answer %zu (last call: %s %s)", n,
            (long long)timeout_ms, last, pie_code_name(st.code), st.msg);
        pie_test_sleep_ms(20);
    }
}

/* The process is live ("" SERVING) and its service becomes ready within LINK_MS (the
 * lifecycle's is ready once its Session knows a model). */
static void assert_serving(const pie_proc *p, const char *service) {
    rpc_channel *ch = channel_to(p, NULL); /* health needs no token */
    const char *names[] = {"", service};
    for (size_t i = 0; i < 2; i++) {
        int64_t deadline = pie_test_now_ms() + (i ? LINK_MS : 0);
        for (;;) {
            pie_status st;
            rpc_health_status hs = RPC_HEALTH_UNKNOWN;
            cr_assert_eq(rpc_health_check(ch, names[i], CALL_MS, &hs, &st), PIE_OK,
                         "%s: health check of '%s': %s", pie_proc_name(p), names[i], st.msg);
            if (hs == RPC_HEALTH_SERVING) break;
            cr_assert(pie_test_now_ms() < deadline, "%s: health of '%s' is %d, not SERVING",
                      pie_proc_name(p), names[i], (int)hs);
            pie_test_sleep_ms(20);
        }
    }
    rpc_channel_destroy(ch);
}

/* Plain HTTP/1.0 GET of 127.0.0.1:port/path; returns the whole response (caller frees). */
static char *http_get(int port, const char *path) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert(fd >= 0, "socket: %s", strerror(errno));
    struct timeval tv = {.tv_sec = CALL_MS / 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "connect to :%d: %s", port,
                 strerror(errno));
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    cr_assert_eq(send(fd, req, (size_t)n, MSG_NOSIGNAL), n, "send: %s", strerror(errno));
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    cr_assert(buf);
    ssize_t r;
    while ((r = recv(fd, buf + len, cap - len - 1, 0)) > 0) {
        len += (size_t)r;
        if (len + 1 == cap) {
            buf = realloc(buf, cap *= 2);
            cr_assert(buf);
        }
    }
    buf[len] = '\0';
    close(fd);
    return buf;
}

/* Polls GET /metrics until a line is exactly `line`. */
static void wait_metric_line(int port, const char *line, int64_t timeout_ms) {
    int64_t deadline = pie_test_now_ms() + timeout_ms;
    char want[256];
    snprintf(want, sizeof want, "\n%s\n", line);
    for (;;) {
        char *body = http_get(port, "/metrics");
        bool ok = strncmp(body, "HTTP/1.1 200 ", 13) == 0 && strstr(body, want) != NULL;
        if (ok || pie_test_now_ms() >= deadline) {
            cr_assert(ok, "/metrics on :%d has no line '%s' after %lld ms:\n%s", port, line,
                      (long long)timeout_ms, body);
            free(body);
            return;
        }
        free(body);
        pie_test_sleep_ms(20);
    }
}

/* One controller and, linked to it, one worker and one lifecycle replica. */
typedef struct cluster {
    pie_proc *ctl, *wrk, *lc;
    char ctl_env[64];
} cluster;

/* ctl_listen: PIE_SERVER_LISTEN of the controller ("" = ephemeral); token: "" = no auth. */
static void cluster_start(cluster *c, const char *ctl_listen, const char *token) {
    char listen_env[64], token_env[128];
    snprintf(listen_env, sizeof listen_env, "PIE_SERVER_LISTEN=%s",
             ctl_listen[0] ? ctl_listen : "127.0.0.1:0");
    snprintf(token_env, sizeof token_env, "PIE_AUTH_TOKEN=%s", token);
    const char *ctl_env[] = {listen_env, token_env, NULL};
    c->ctl = start("pie-controller", ctl_env);
    pie_proc_env_controller(c->ctl, c->ctl_env, sizeof c->ctl_env);
    const char *link_env[] = {c->ctl_env, token_env, ENV_RECONNECT, NULL};
    const char *wrk_env[] = {c->ctl_env, token_env, ENV_RECONNECT, ENV_MODEL, NULL};
    c->wrk = start("pie-worker", wrk_env);
    c->lc = start("pie-lifecycle", link_env);
}

/* Stops in dependency order (clients of the controller first) and asserts exit status 0. */
static void cluster_stop(cluster *c) {
    if (c->lc) stop_ok(c->lc, SIGTERM);
    if (c->wrk) stop_ok(c->wrk, SIGTERM);
    if (c->ctl) stop_ok(c->ctl, SIGTERM);
    memset(c, 0, sizeof *c);
}

/* ---- tests: processes, health, signals ------------------------------------------------------ */

Test(services, each_service_serves_health_overall_and_by_name_and_exits_0_on_sigterm) {
    cluster c;
    cluster_start(&c, "", "");
    assert_serving(c.ctl, "pie.v1.Controller");
    assert_serving(c.wrk, "pie.v1.Worker");
    assert_serving(c.lc, "pie.v1.Lifecycle");
    cr_assert_gt(pie_proc_metrics_port(c.ctl), 0, "metrics_port of the controller");
    cr_assert_eq(pie_proc_log_count(c.ctl, "auth=off"), 1,
                 "controller without a token logs auth=off");

    rpc_channel *ch = channel_to(c.ctl, NULL);
    pie_status st;
    rpc_health_status hs;
    cr_assert_eq(rpc_health_check(ch, "pie.v1.NoSuchService", CALL_MS, &hs, &st), PIE_NOT_FOUND,
                 "health of an unknown service: %s %s", pie_code_name(st.code), st.msg);
    rpc_channel_destroy(ch);
    cluster_stop(&c);
}

Test(services, controller_exits_0_on_sigint) {
    pie_proc *ctl = start("pie-controller", NULL);
    stop_ok(ctl, SIGINT);
}

/* ---- tests: the cluster --------------------------------------------------------------------- */

Test(services, cluster_status_and_list_models_follow_the_worker) {
    cluster c;
    cluster_start(&c, "", "");
    rpc_channel *ctl_ch = channel_to(c.ctl, NULL), *lc_ch = channel_to(c.lc, NULL),
                *wrk_ch = channel_to(c.wrk, NULL);

    cluster_status *cs = wait_cluster(ctl_ch, 1, 1, LINK_MS);
    cr_assert_eq(strncmp(cs->version, "pie-c/", 6), 0, "version '%s'", cs->version);
    const Pie__V1__WorkerStatus *w = cs->workers[0];
    cr_assert_eq(w->worker_index, 1);
    cr_assert_str_eq(w->model, "tiny");
    cr_assert_eq(w->tp_size, 1);
    cr_assert_eq(w->state, PIE__V1__WORKER_STATE__WORKER_STATE_READY);
    cr_assert(w->capacity, "worker status without capacity");
    cr_assert_eq(w->capacity->kv_pages_max, 1024);
    cr_assert_eq(cs->replicas[0]->replica_index, 1);
    cr_assert_eq(strncmp(cs->replicas[0]->version, "pie-c/", 6), 0);
    cr_assert_eq(cs->n_models, 1);
    cr_assert_str_eq(cs->models[0]->info->name, "tiny");
    cr_assert_eq(cs->models[0]->workers, 1);
    cr_assert_eq(cs->models[0]->kv_pages_effective, 1024);
    rpc_msg_free(&cs->base);

    models_list *ml = wait_models(lc_ch, 1, LINK_MS);
    cr_assert_str_eq(ml->models[0]->name, "tiny");
    cr_assert_eq(ml->models[0]->kv_page_size, 16);
    rpc_msg_free(&ml->base);

    Pie__V1__InfoRequest ireq = PIE__V1__INFO_REQUEST__INIT;
    Pie__V1__InfoResponse *info = NULL;
    pie_status st;
    rpc_call_opts co = {.timeout_ms = CALL_MS};
    cr_assert_eq(rpc_unary(wrk_ch, "/pie.v1.Worker/Info", &ireq.base,
                           &pie__v1__info_response__descriptor, (ProtobufCMessage **)&info, &co,
                           &st),
                 PIE_OK, "Worker/Info: %s", st.msg);
    cr_assert_eq(info->rank, 0);
    cr_assert_eq(info->tp_size, 1);
    cr_assert(info->model, "Info without model");
    cr_assert_str_eq(info->model->name, "tiny");
    cr_assert_eq(info->state, PIE__V1__LOAD_STATE__LOAD_STATE_READY);
    cr_assert(info->controller_linked, "Info says the worker is not linked");
    rpc_msg_free(&info->base);
    rpc_channel_destroy(wrk_ch);

    stop_ok(c.wrk, SIGTERM);
    c.wrk = NULL;
    cs = wait_cluster(ctl_ch, 0, 1, LINK_MS);
    cr_assert_eq(cs->n_models, 0, "ClusterStatus still lists %zu models", cs->n_models);
    rpc_msg_free(&cs->base);
    ml = wait_models(lc_ch, 0, LINK_MS);
    rpc_msg_free(&ml->base);

    rpc_channel_destroy(ctl_ch);
    rpc_channel_destroy(lc_ch);
    cluster_stop(&c);
}

Test(services, worker_and_replica_relink_after_controller_restart_on_the_same_port) {
    int port = pie_proc_free_port();
    cr_assert_gt(port, 0, "no free port");
    char listen[32];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    cluster c;
    cluster_start(&c, listen, "");
    cr_assert_eq(pie_proc_grpc_port(c.ctl), port);
    rpc_channel *ctl_ch = channel_to(c.ctl, NULL), *lc_ch = channel_to(c.lc, NULL);
    rpc_msg_free(&wait_cluster(ctl_ch, 1, 1, LINK_MS)->base);
    rpc_msg_free(&wait_models(lc_ch, 1, LINK_MS)->base);
    cr_assert(pie_proc_wait_log(c.wrk, "event=wrk.link.registered ", 1, LINK_MS));

    pie_status st;
    cr_assert_eq(pie_proc_signal(c.ctl, SIGKILL, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(pie_proc_wait(c.ctl, STOP_MS, &st), 128 + SIGKILL, "%s", st.msg);
    pie_proc_destroy(c.ctl);
    cr_assert(pie_proc_wait_log(c.wrk, "event=wrk.link.lost ", 1, LINK_MS),
              "the worker did not notice the controller's death");
    cr_assert(pie_proc_wait_log(c.lc, "event=lc.session.lost ", 1, LINK_MS),
              "the replica did not notice the controller's death");
    /* without its controller the replica cannot launch: alive but not ready */
    rpc_health_status hs = RPC_HEALTH_UNKNOWN;
    cr_assert_eq(rpc_health_check(lc_ch, "", CALL_MS, &hs, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(hs, RPC_HEALTH_SERVING, "liveness must not follow the controller");
    cr_assert_eq(rpc_health_check(lc_ch, "pie.v1.Lifecycle", CALL_MS, &hs, &st), PIE_OK, "%s",
                 st.msg);
    cr_assert_eq(hs, RPC_HEALTH_NOT_SERVING, "a replica without a controller reports ready");

    char listen_env[64];
    snprintf(listen_env, sizeof listen_env, "PIE_SERVER_LISTEN=%s", listen);
    const char *ctl_env[] = {listen_env, NULL};
    int64_t t0 = pie_test_now_ms();
    c.ctl = start("pie-controller", ctl_env);
    cr_assert_eq(pie_proc_grpc_port(c.ctl), port);
    cluster_status *cs = wait_cluster(ctl_ch, 1, 1, LINK_MS);
    int64_t relink_ms = pie_test_now_ms() - t0;
    cr_assert_str_eq(cs->workers[0]->model, "tiny");
    rpc_msg_free(&cs->base);
    cr_assert_eq(pie_proc_log_count(c.wrk, "event=wrk.link.registered "), 2,
                 "the worker registered %zu times, not twice",
                 pie_proc_log_count(c.wrk, "event=wrk.link.registered "));
    models_list *ml = wait_models(lc_ch, 1, LINK_MS);
    cr_assert_str_eq(ml->models[0]->name, "tiny");
    rpc_msg_free(&ml->base);
    cr_log_info("worker and replica relinked %lld ms after the controller restarted",
                (long long)relink_ms);
    assert_serving(c.lc, "pie.v1.Lifecycle"); /* ready again */

    rpc_channel_destroy(ctl_ch);
    rpc_channel_destroy(lc_ch);
    cluster_stop(&c);
}

/* A dead controller is redialled with the configured backoff, not gRPC's default (1 s growing
 * to 120 s). Checked without a clock: each process logs the backoff it gives its channel and
 * link (svc.dialling; unit_test_rpc_calls checks that rpc_channel turns it into gRPC's reconnect
 * arguments), and the test, listening in the controller's place and closing every connection
 * at once, sees each of them dial again and again. Counting dials per second of wall time
 * would flake on a loaded machine. */
Test(services, worker_and_replica_redial_a_dead_controller_at_the_configured_backoff) {
    int lfd[2];
    char ctl_env[2][64];
    for (int i = 0; i < 2; i++) {
        lfd[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        cr_assert(lfd[i] >= 0, "socket: %s", strerror(errno));
        struct sockaddr_in a = {.sin_family = AF_INET};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t alen = sizeof a;
        cr_assert_eq(bind(lfd[i], (struct sockaddr *)&a, sizeof a), 0, "bind: %s", strerror(errno));
        cr_assert_eq(listen(lfd[i], 16), 0, "listen: %s", strerror(errno));
        cr_assert_eq(getsockname(lfd[i], (struct sockaddr *)&a, &alen), 0);
        snprintf(ctl_env[i], sizeof ctl_env[i], "PIE_CONTROLLER_ADDRESS=127.0.0.1:%d",
                 ntohs(a.sin_port));
    }
    const char *wrk_env[] = {ctl_env[0], ENV_RECONNECT, ENV_MODEL, NULL};
    const char *lc_env[] = {ctl_env[1], ENV_RECONNECT, NULL};
    pie_proc *wrk = start("pie-worker", wrk_env), *lc = start("pie-lifecycle", lc_env);

    const char *backoff = "reconnect_initial_ms=50 reconnect_max_ms=200";
    cr_assert(pie_proc_wait_log(wrk, backoff, 1, START_MS), "the worker dials without %s", backoff);
    cr_assert(pie_proc_wait_log(lc, backoff, 1, START_MS), "the replica dials without %s", backoff);
    int accepts[2] = {0, 0};
    const int want = 4;
    int64_t deadline = pie_test_now_ms() + LINK_MS; /* a hang guard, not a cadence */
    while ((accepts[0] < want || accepts[1] < want) && pie_test_now_ms() < deadline) {
        struct pollfd pfd[2] = {{.fd = lfd[0], .events = POLLIN}, {.fd = lfd[1], .events = POLLIN}};
        if (poll(pfd, 2, 20) <= 0) continue;
        for (int i = 0; i < 2; i++) {
            if (!(pfd[i].revents & POLLIN)) continue;
            int fd = accept4(lfd[i], NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0) {
                close(fd);
                accepts[i]++;
            }
        }
    }
    close(lfd[0]);
    close(lfd[1]);
    cr_assert_geq(accepts[0], want, "the worker stopped redialling after %d dials", accepts[0]);
    cr_assert_geq(accepts[1], want, "the replica stopped redialling after %d dials", accepts[1]);
    stop_ok(lc, SIGTERM);
    stop_ok(wrk, SIGTERM);
}

/* ---- tests: authentication ------------------------------------------------------------------ */

Test(services, token_guards_every_method_but_health_and_linked_services_present_it) {
    cluster c;
    cluster_start(&c, "", TOKEN);
    cr_assert_eq(pie_proc_log_count(c.ctl, "auth=on"), 1, "controller with a token logs auth=on");
    rpc_channel *none = channel_to(c.ctl, NULL), *wrong = channel_to(c.ctl, "wrong-token"),
                *right = channel_to(c.ctl, TOKEN);
    pie_status st;
    cluster_status *cs = NULL;
    cr_assert_eq(get_cluster_status(none, &cs, &st), PIE_UNAUTHENTICATED,
                 "ClusterStatus without a token: %s %s", pie_code_name(st.code), st.msg);
    cr_assert_null(cs);
    cr_assert_eq(get_cluster_status(wrong, &cs, &st), PIE_UNAUTHENTICATED,
                 "ClusterStatus with a wrong token: %s %s", pie_code_name(st.code), st.msg);
    cr_assert_null(cs);
    /* The worker and the replica sent the token on their links, or they would not be listed. */
    cs = wait_cluster(right, 1, 1, LINK_MS);
    rpc_msg_free(&cs->base);

    rpc_channel *lc_none = channel_to(c.lc, NULL), *lc_right = channel_to(c.lc, TOKEN);
    models_list *ml = NULL;
    cr_assert_eq(get_models(lc_none, &ml, &st), PIE_UNAUTHENTICATED,
                 "ListModels without a token: %s %s", pie_code_name(st.code), st.msg);
    ml = wait_models(lc_right, 1, LINK_MS);
    cr_assert_str_eq(ml->models[0]->name, "tiny");
    rpc_msg_free(&ml->base);

    assert_serving(c.ctl, "pie.v1.Controller"); /* without a token */
    assert_serving(c.wrk, "pie.v1.Worker");
    assert_serving(c.lc, "pie.v1.Lifecycle");

    rpc_channel_destroy(none);
    rpc_channel_destroy(wrong);
    rpc_channel_destroy(right);
    rpc_channel_destroy(lc_none);
    rpc_channel_destroy(lc_right);
    cluster_stop(&c);
}

/* ---- tests: configuration and command line -------------------------------------------------- */

/* Runs bin to completion with env and args; returns the exit status, *log gets the output. */
static int run_to_exit(const char *bin, const char *const *env, const char *const *args,
                       char **log) {
    pie_status st;
    pie_proc_opts o = {.env = env, .args = args};
    pie_proc *p = pie_proc_spawn(bin, &o, &st);
    cr_assert(p, "%s", st.msg);
    int rc = pie_proc_wait(p, STOP_MS, &st);
    cr_assert_geq(rc, 0, "%s", st.msg);
    *log = pie_proc_log(p);
    cr_assert(*log);
    pie_proc_destroy(p);
    return rc;
}

/* bin --config <yaml in a file> must exit 2 having printed exactly "<bin>: <file>: msg_tail"
 * where msg_tail is the pie_config error after the file name (e.g. "2:3: unknown key ..."). */
static void assert_bad_config_file(const char *bin, const char *yaml, const char *msg_tail) {
    pie_status st;
    char *dir = pie_proc_tmpdir(&st);
    cr_assert(dir, "%s", st.msg);
    char *path = pie_proc_write_file(dir, "bad.yaml", yaml, &st);
    cr_assert(path, "%s", st.msg);
    const char *args[] = {"--config", path, NULL};
    char *log = NULL, want[1024];
    int rc = run_to_exit(bin, NULL, args, &log);
    snprintf(want, sizeof want, "%s: %s:%s\n", bin, path, msg_tail);
    cr_assert_eq(rc, 2, "%s with %s exited %d, not 2; output:\n%s", bin, yaml, rc, log);
    cr_assert_str_eq(log, want, "%s with bad config", bin);
    free(log);
    free(path);
    pie_proc_rmdir(dir);
    free(dir);
}

static void assert_bad_env(const char *bin, const char *env_entry, const char *msg) {
    const char *env[] = {env_entry, NULL};
    char *log = NULL, want[1024];
    int rc = run_to_exit(bin, env, NULL, &log);
    snprintf(want, sizeof want, "%s: %s\n", bin, msg);
    cr_assert_eq(rc, 2, "%s with %s exited %d, not 2; output:\n%s", bin, env_entry, rc, log);
    cr_assert_str_eq(log, want, "%s with %s", bin, env_entry);
    free(log);
}

Test(services, unknown_config_key_exits_2_naming_file_line_and_column) {
    assert_bad_config_file("pie-controller", "server:\n  prot: 5000\n",
                           "2:3: unknown key 'server.prot'");
}

Test(services, config_value_of_the_wrong_type_exits_2) {
    assert_bad_config_file("pie-worker", "server:\n  threads: many\n",
                           "2:12: server.threads: expected non-negative integer, got 'many'");
}

Test(services, config_value_out_of_range_exits_2) {
    assert_bad_config_file("pie-worker", "pool:\n  kv_pages: 0\n",
                           "2:13: pool.kv_pages: 0 is out of range [1, 16777216]");
    assert_bad_config_file("pie-lifecycle", "controller:\n  reconnect_initial: 2h\n",
                           "2:22: controller.reconnect_initial: 2h is out of range [1ms, 1m]");
}

Test(services, bad_environment_value_exits_2) {
    assert_bad_env("pie-lifecycle", "PIE_SERVER_SHUTDOWN_GRACE=5 years",
                   "environment PIE_SERVER_SHUTDOWN_GRACE: expected duration (integer with unit "
                   "ms, s, m, h; bare integer = ms), got '5 years'");
    assert_bad_env("pie-controller", "PIE_LOG_LEVEL=loud",
                   "environment PIE_LOG_LEVEL: 'loud' is not one of debug, info, warn, error, off");
}

Test(services, missing_config_file_and_stray_argument_exit_2) {
    const char *missing[] = {"--config", "/nonexistent/pie.yaml", NULL};
    char *log = NULL;
    cr_assert_eq(run_to_exit("pie-controller", NULL, missing, &log), 2, "output:\n%s", log);
    cr_assert_str_eq(log, "pie-controller: cannot open config '/nonexistent/pie.yaml': No such "
                          "file or directory\n");
    free(log);
    const char *stray[] = {"extra", NULL};
    cr_assert_eq(run_to_exit("pie-worker", NULL, stray, &log), 2, "output:\n%s", log);
    cr_assert_str_eq(log, "pie-worker: unexpected argument 'extra' (see --help)\n");
    free(log);
}

Test(services, print_config_shows_environment_overrides_and_redacts_the_token) {
    const char *env[] = {"PIE_SERVER_LISTEN=127.0.0.1:5999", "PIE_AUTH_TOKEN=" TOKEN,
                         "PIE_POOL_KV_PAGES=2048", NULL};
    const char *args[] = {"--print-config", NULL};
    char *log = NULL;
    cr_assert_eq(run_to_exit("pie-worker", env, args, &log), 0, "output:\n%s", log);
    cr_assert(strstr(log, "server:\n"), "no server section:\n%s", log);
    cr_assert(strstr(log, "\n  listen: \"127.0.0.1:5999\"\n"), "server.listen not from env:\n%s",
              log);
    cr_assert(strstr(log, "\n  kv_pages: 2048\n"), "pool.kv_pages not from env:\n%s", log);
    cr_assert(strstr(log, "\n  token: \"<redacted>\"\n"), "token not redacted:\n%s", log);
    cr_assert_null(strstr(log, TOKEN), "--print-config shows the token:\n%s", log);
    cr_assert_null(strstr(log, "svc.started"), "--print-config started the service:\n%s", log);
    free(log);
}

Test(services, help_config_lists_every_key_and_version_exits_0) {
    const char *help[] = {"--help-config", NULL};
    char *log = NULL;
    cr_assert_eq(run_to_exit("pie-worker", NULL, help, &log), 0, "output:\n%s", log);
    static const char *const keys[] = {
        "| `server.listen` | `PIE_SERVER_LISTEN` |",
        "| `auth.token` | `PIE_AUTH_TOKEN` |",
        "| `metrics.listen` | `PIE_METRICS_LISTEN` |",
        "| `controller.address` | `PIE_CONTROLLER_ADDRESS` |",
        "| `controller.reconnect_initial` | `PIE_CONTROLLER_RECONNECT_INITIAL` |",
        "| `pool.kv_pages` | `PIE_POOL_KV_PAGES` |",
        "| `model.name` | `PIE_MODEL_NAME` |"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        cr_assert(strstr(log, keys[i]), "--help-config lacks %s:\n%s", keys[i], log);
    free(log);

    static const char *const bins[] = {"pie-controller", "pie-worker", "pie-lifecycle"};
    const char *version[] = {"--version", NULL};
    for (size_t i = 0; i < 3; i++) {
        char want[64];
        snprintf(want, sizeof want, "%s 0.1.0\n", bins[i]);
        cr_assert_eq(run_to_exit(bins[i], NULL, version, &log), 0, "output:\n%s", log);
        cr_assert_str_eq(log, want);
        free(log);
    }
}

/* ---- tests: metrics ------------------------------------------------------------------------- */

Test(services, controller_metrics_count_the_linked_worker) {
    pie_proc *ctl = start("pie-controller", NULL);
    wait_metric_line(pie_proc_metrics_port(ctl), "pie_controller_workers 0", CALL_MS);
    char ctl_env[64];
    const char *env[] = {pie_proc_env_controller(ctl, ctl_env, sizeof ctl_env), ENV_RECONNECT,
                         ENV_MODEL, NULL};
    pie_proc *wrk = start("pie-worker", env);
    wait_metric_line(pie_proc_metrics_port(ctl), "pie_controller_workers 1", LINK_MS);
    wait_metric_line(pie_proc_metrics_port(wrk), "pie_worker_controller_linked 1", LINK_MS);
    stop_ok(wrk, SIGTERM);
    wait_metric_line(pie_proc_metrics_port(ctl), "pie_controller_workers 0", LINK_MS);
    stop_ok(ctl, SIGTERM);
}

/* The metric families a /metrics body declares ("# TYPE <name> <kind>"), appended to *names. */
static void families_of(const char *body, char ***names, size_t *n) {
    for (const char *p = strstr(body, "# TYPE "); p; p = strstr(p + 1, "# TYPE ")) {
        const char *name = p + 7, *end = strchr(name, ' ');
        cr_assert(end, "malformed TYPE line");
        *names = realloc(*names, (*n + 1) * sizeof **names);
        cr_assert(*names);
        (*names)[(*n)++] = strndup(name, (size_t)(end - name));
    }
}

/* The "## Metrics" section of docs/operators.md (caller frees). */
static char *metrics_doc(void) {
    FILE *f = fopen(PIE_SOURCE_DIR "/docs/operators.md", "r");
    cr_assert(f, "cannot open docs/operators.md");
    static char text[1 << 18];
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = '\0';
    const char *from = strstr(text, "\n## Metrics\n");
    cr_assert(from, "docs/operators.md has no ## Metrics section");
    const char *to = strstr(from + 1, "\n## ");
    return strndup(from, to ? (size_t)(to - from) : strlen(from));
}

/* Every family the four services serve is in the Metrics table of docs/operators.md, and every
 * family of that table is served by one of them (issue 15, item 6). */
Test(services, every_metric_family_is_documented_and_every_documented_one_is_served) {
    cluster c;
    cluster_start(&c, "", "");
    char lc_env[96];
    snprintf(lc_env, sizeof lc_env, "PIE_LIFECYCLE_ADDRESS=%s", pie_proc_addr(c.lc));
    const char *gw_env[] = {lc_env, "PIE_HTTP_LISTEN=127.0.0.1:0", NULL};
    pie_proc *gw = start("pie-gateway", gw_env);
    rpc_channel *ch = channel_to(c.lc, NULL);
    models_list *ml = wait_models(ch, 1, LINK_MS); /* finished calls: per-method families */
    rpc_msg_free(&ml->base);
    rpc_channel_destroy(ch);
    wait_metric_line(pie_proc_metrics_port(c.ctl), "pie_controller_workers 1", LINK_MS);

    char **names = NULL;
    size_t n = 0;
    const pie_proc *procs[] = {c.ctl, c.wrk, c.lc, gw};
    for (size_t i = 0; i < 4; i++) {
        char *body = http_get(pie_proc_metrics_port(procs[i]), "/metrics");
        families_of(body, &names, &n);
        free(body);
    }
    char *lc_body = http_get(pie_proc_metrics_port(c.lc), "/metrics");
    cr_expect(strstr(lc_body, "\npie_grpc_server_handled_total{method=\"/pie.v1.Lifecycle/"
                              "ListModels\",code=\"OK\"} "),
              "the lifecycle did not count its ListModels calls:\n%s", lc_body);
    free(lc_body);
    char *doc = metrics_doc();
    for (size_t i = 0; i < n; i++) {
        char quoted[160];
        snprintf(quoted, sizeof quoted, "| `%s` |", names[i]);
        cr_expect(strstr(doc, quoted), "served family %s is not in the Metrics table of "
                  "docs/operators.md", names[i]);
    }
    for (const char *p = strstr(doc, "\n| `"); p; p = strstr(p + 1, "\n| `")) {
        const char *name = p + 4, *end = strchr(name, '`');
        cr_assert(end);
        bool served = false;
        for (size_t i = 0; i < n && !served; i++)
            served = strlen(names[i]) == (size_t)(end - name) &&
                     strncmp(names[i], name, (size_t)(end - name)) == 0;
        cr_expect(served, "documented family %.*s is served by no service", (int)(end - name),
                  name);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    free(doc);
    stop_ok(gw, SIGTERM);
    cluster_stop(&c);
}

/* TLS between every service and to clients (issue 15, item 8): the controller and the lifecycle
 * serve TLS, the worker and the lifecycle dial the controller trusting the test CA, a client
 * with the CA is served and a plaintext one is not. */
Test(services, a_cluster_over_tls_serves_tls_clients_only) {
    char dir[64], cert[256], key[256], ca[256];
    cr_assert(pie_test_certs_make(dir, sizeof dir), "cannot make the test certificates");
    char p_cert[200], p_key[200], p_ca[200];
    pie_test_certs_path(dir, "srv.pem", p_cert, sizeof p_cert);
    pie_test_certs_path(dir, "srv.key", p_key, sizeof p_key);
    pie_test_certs_path(dir, "ca.pem", p_ca, sizeof p_ca);
    snprintf(cert, sizeof cert, "PIE_TLS_CERT_FILE=%s", p_cert);
    snprintf(key, sizeof key, "PIE_TLS_KEY_FILE=%s", p_key);
    snprintf(ca, sizeof ca, "PIE_TLS_CA_FILE=%s", p_ca);
    const char *ctl_env[] = {cert, key, NULL};
    pie_proc *ctl = start("pie-controller", ctl_env);
    char link[64];
    pie_proc_env_controller(ctl, link, sizeof link);
    const char *wrk_env[] = {link, ca, ENV_RECONNECT, ENV_MODEL, NULL};
    pie_proc *wrk = start("pie-worker", wrk_env);
    const char *lc_env[] = {link, ca, cert, key, ENV_RECONNECT, NULL};
    pie_proc *lc = start("pie-lifecycle", lc_env);

    char *ca_pem = pie_test_certs_read(dir, "ca.pem");
    cr_assert(ca_pem);
    pie_status st;
    rpc_channel_opts co = {.tls_ca_pem = ca_pem};
    rpc_channel *tls = rpc_channel_create(pie_proc_addr(lc), &co, &st);
    cr_assert(tls, "%s", st.msg);
    models_list *ml = wait_models(tls, 1, LINK_MS); /* the worker linked over TLS */
    rpc_msg_free(&ml->base);
    rpc_channel_destroy(tls);
    rpc_channel *plain = channel_to(lc, NULL);
    models_list *none = NULL;
    cr_expect_eq(get_models(plain, &none, &st), PIE_UNAVAILABLE,
                 "a plaintext client was served by a TLS lifecycle: %s", st.msg);
    if (none) rpc_msg_free(&none->base);
    rpc_channel_destroy(plain);
    free(ca_pem);
    stop_ok(lc, SIGTERM);
    stop_ok(wrk, SIGTERM);
    stop_ok(ctl, SIGTERM);
    pie_test_certs_remove(dir);
}
