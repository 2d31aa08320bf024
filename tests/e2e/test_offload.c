/* test_offload.c — the offload memory policy (issue 13; Neo's CPU attention offload) under the
 * whole stack: controller, a cpu worker with memory.policy offload, lifecycle, real inferlets.
 *
 * Covered: with a device share of 4 pages (small-f32: 4 layers x 8 KiB a page) and a 64 MiB host
 * pool, the load-aware scheduler must send decodes' KV and attention to the host (the device
 * cannot hold them); text completion, parallel generation (a fork: pages shared between
 * sequences) and prefix caching's export, import and unexport say byte for byte what a worker
 * with policy gpu says, and the worker's metrics show decodes attended on the host and pages
 * moved there. */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "e2e_support.h"

TestSuite(offload, .timeout = 600);

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
    e2e_vs_gpu v;
    /* 4 device pages of every layer (128 KiB), the rest of the pages in the host pool */
    const char *off_env[] = {"PIE_WORKER_GROUP_ID=offload", "PIE_MEMORY_POLICY=offload",
                             "PIE_MEMORY_DEVICE_KV=128KiB", "PIE_MEMORY_HOST_POOL=64MiB", NULL};
    e2e_vs_gpu_run(&v, "offload", off_env, PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD);
    /* decodes did attend on the host, and pages did move there */
    int port = pie_proc_metrics_port(v.c.wrk);
    cr_assert_gt(port, 0, "the worker serves no metrics");
    double hosted = metric(port, "pie_worker_offload_host_instances_total");
    double moved = metric(port, "pie_worker_offload_pages_moved_total{direction=\"to_host\"}");
    double forced = metric(port, "pie_worker_offload_steps_total{decision=\"forced\"}");
    cr_expect_gt(hosted, 0, "no decode attended on the host");
    cr_expect_gt(moved, 0, "no page moved to the host");
    cr_expect_gt(forced, 0, "4 device pages never forced a decode to the host");

    e2e_vs_gpu_end(&v);
}
