/* test_wrk_numa.c — the host pool on a NUMA node (services/worker/mem/wrk_numa.h) and the two
 * host pools that use it: the swap tier's host region (wrk_tier) and, through the worker,
 * offload's (test_worker_link covers the refusal at start).
 *
 * This machine may have one node (the development VM has node 0 only): what is checked is that
 * a bound range's pages come from the node asked for under a binding policy, that an unbound
 * range has none, and that nodes the machine lacks are refused — on a machine with more nodes
 * the same tests bind to the last one. */
#include <criterion/criterion.h>
#include <string.h>
#include <sys/mman.h>

#include "pie_testutil.h"
#include "wrk_numa.h"
#include "wrk_tier.h"

TestSuite(wrk_numa, .fini = pie_test_leak_check);

#define BYTES ((size_t)4 << 20)

Test(wrk_numa, a_bound_range_is_allocated_on_its_node_and_an_unbound_one_is_not_bound) {
    int node = wrk_numa_nodes() - 1; /* 0 here; the last node on a NUMA machine */
    cr_assert(wrk_numa_node_exists(node));
    char *p = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *q = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert(p != MAP_FAILED && q != MAP_FAILED);
    pie_status st = {0};
    cr_assert_eq(wrk_numa_bind(p, BYTES, node, "the test's range", &st), PIE_OK, "%s", st.msg);
    memset(p, 1, BYTES);
    memset(q, 1, BYTES);
    bool bound = false;
    cr_expect_eq(wrk_numa_node_of(p, &bound), node);
    cr_expect(bound, "the first page is not under a binding policy");
    cr_expect_eq(wrk_numa_node_of(p + BYTES - 1, &bound), node);
    cr_expect(bound, "the last page is not under a binding policy");
    cr_expect_geq(wrk_numa_node_of(q, &bound), 0);
    cr_expect(!bound, "an unbound range reports a binding policy");
    munmap(p, BYTES);
    munmap(q, BYTES);
}

Test(wrk_numa, nodes_the_machine_lacks_are_refused) {
    int n = wrk_numa_nodes();
    cr_assert_geq(n, 1);
    cr_expect(!wrk_numa_node_exists(n), "node %d exists beyond the %d online", n, n);
    cr_expect(!wrk_numa_node_exists(-1));
    cr_expect(!wrk_numa_node_exists(WRK_NUMA_MAX_NODES));
    char *p = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert(p != MAP_FAILED);
    pie_status st = {0};
    if (n < WRK_NUMA_MAX_NODES) {
        cr_expect_eq(wrk_numa_bind(p, BYTES, n, "the test's range", &st), PIE_UNAVAILABLE);
        cr_expect(strstr(st.msg, "cannot bind the test's range") != NULL, "%s", st.msg);
    }
    cr_expect_eq(wrk_numa_bind(p, BYTES, WRK_NUMA_MAX_NODES, "the test's range", &st),
                 PIE_INVALID_ARGUMENT);
    cr_expect_str_eq(st.msg, "NUMA node 64 for the test's range is out of range [0, 64)");
    munmap(p, BYTES);
}

/* The swap tier's host region is bound when asked: a layer moved to the host lives on the
 * node; the device region is not bound. */
Test(wrk_numa, the_swap_tiers_host_region_is_on_its_node) {
    int node = wrk_numa_nodes() - 1;
    wrk_tier_config c = {.n_layers = 4,
                         .layer_bytes = 1 << 20,
                         .slots = 2,
                         .min_slots = 2,
                         .host_buffers = 4,
                         .host_numa_bind = true,
                         .host_numa_node = node};
    wrk_tier *t = NULL;
    pie_status st = {0};
    cr_assert_eq(wrk_tier_open(&c, &t, &st), PIE_OK, "%s", st.msg);
    wrk_tier_touch(t, 1 << 20);
    for (uint32_t l = 0; l < 4; l++) { /* each layer written once: two end on the host */
        void *base = NULL;
        cr_assert_eq(wrk_tier_acquire(t, l, &base, &st), PIE_OK, "%s", st.msg);
        memset(base, (int)l + 1, 1 << 20);
        wrk_tier_release(t, l);
    }
    wrk_tier_quiesce(t);
    wrk_tier_hold(t);
    wrk_tier_stats s;
    wrk_tier_get_stats(t, &s);
    cr_assert_eq(s.on_host, 2);
    uint32_t hosts = 0, devs = 0;
    for (uint32_t l = 0; l < 4; l++) {
        bool bound = false;
        const unsigned char *b = wrk_tier_where(t, l);
        int at = wrk_numa_node_of(b, &bound);
        if (bound) {
            hosts++;
            cr_expect_eq(at, node, "layer %u's host buffer is on node %d", l, at);
            cr_expect_eq(b[0], l + 1, "layer %u moved with its bytes", l);
        } else {
            devs++;
        }
    }
    cr_expect_eq(hosts, 2, "%u layers in a bound buffer, want the 2 on the host", hosts);
    cr_expect_eq(devs, 2);
    wrk_tier_resume(t);
    wrk_tier_close(t);
    /* a node the machine lacks fails the open, saying which */
    c.host_numa_node = wrk_numa_nodes();
    if (c.host_numa_node < WRK_NUMA_MAX_NODES) {
        cr_assert_eq(wrk_tier_open(&c, &t, &st), PIE_UNAVAILABLE);
        cr_expect(strstr(st.msg, "swap policy's host region") != NULL, "%s", st.msg);
    }
}
