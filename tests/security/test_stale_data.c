/* test_stale_data.c — issue 11, hole 1: an instance never observes data it did not write.
 *
 * A real pie-controller, CPU pie-worker (small-f32) and pie-lifecycle on loopback
 * (tests/e2e/e2e_support.h); the fixture tests/wasm/sec_stale.c plays both sides. Instance A
 * writes a 16-token prompt into a KV page and an output embedding, then exits holding them;
 * instance B allocates storage right after (the controller reuses freed slots first, so B gets
 * A's) and reads it without writing it:
 *   * a KV page B never wrote, used as a full context, must give a distribution that does not
 *     depend on what A wrote (the same whichever prompt A had), and not A's;
 *   * next_dist on an embedding B never wrote fails at that call with FAILED_PRECONDITION
 *     naming the embedding, and synchronize has nothing to add. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_support.h"
#include "pie_testutil.h"

TestSuite(security, .fini = pie_test_leak_check, .timeout = 600);

#define NEXT_TOKEN "42"

/* The value of the message "<name>=..." of r (asserts there is one). */
static const char *msg_value(const e2e_run *r, const char *name) {
    size_t len = strlen(name);
    for (size_t i = 0; i < r->n_msgs; i++)
        if (strncmp(r->msgs[i], name, len) == 0 && r->msgs[i][len] == '=')
            return r->msgs[i] + len + 1;
    cr_assert_fail("no message \"%s=...\" among %zu; stderr:\n%s", name, r->n_msgs,
                   r->err ? r->err : "");
    return NULL;
}

/* Runs sec_stale with args, asserts success and returns a copy of its "kv" distribution. */
static char *run_kv(e2e_cluster *c, const char *prog, const char *const *args, const char *what) {
    e2e_run r;
    e2e_run_program(c, prog, args, NULL, &r);
    e2e_assert_success(&r, what);
    char *kv = strdup(msg_value(&r, "kv"));
    cr_assert(kv);
    e2e_run_free(&r);
    return kv;
}

static const char *const prompt_x =
    "101,102,103,104,105,106,107,108,109,110,111,112,113,114,115,116";
static const char *const prompt_y = "7,300,8,299,9,298,10,297,11,296,12,295,13,294,14,293";

Test(security, an_unwritten_kv_page_holds_nothing_of_its_previous_owner) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "sec_stale");

    const char *write_x[] = {"write", NEXT_TOKEN, prompt_x, NULL};
    const char *write_y[] = {"write", NEXT_TOKEN, prompt_y, NULL};
    const char *read[] = {"readkv", NEXT_TOKEN, NULL};
    char *a_x = run_kv(&c, prog, write_x, "A (prompt X)");
    char *b_after_x = run_kv(&c, prog, read, "B after A (prompt X)");
    char *a_y = run_kv(&c, prog, write_y, "A' (prompt Y)");
    char *b_after_y = run_kv(&c, prog, read, "B after A' (prompt Y)");

    cr_assert_str_neq(a_x, a_y, "the two prompts must lead to different distributions");
    cr_expect_str_neq(b_after_x, a_x,
                      "B read A's KV page: over a page it never wrote it got A's distribution "
                      "exactly (%s)",
                      a_x);
    cr_expect_str_eq(b_after_x, b_after_y,
                     "what B reads from a page it never wrote depends on the previous owner: "
                     "after A (prompt X) %s, after A' (prompt Y) %s",
                     b_after_x, b_after_y);
    free(a_x);
    free(a_y);
    free(b_after_x);
    free(b_after_y);
    free(prog);
    e2e_cluster_stop(&c);
}

Test(security, next_dist_on_an_unwritten_embedding_fails_at_the_call) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "sec_stale");

    const char *write_x[] = {"write", NEXT_TOKEN, prompt_x, NULL};
    char *a = run_kv(&c, prog, write_x, "A");
    /* A held 17 embeddings (16 prompt inputs and the output): B allocates as many */
    const char *read[] = {"reademb", "17", NULL};
    e2e_run r;
    e2e_run_program(&c, prog, read, NULL, &r);
    e2e_assert_success(&r, "B");
    for (int i = 0; i < 17; i++) {
        char name[16], want[96];
        snprintf(name, sizeof name, "emb%d", i);
        const char *got = msg_value(&r, name);
        cr_expect_str_neq(got, a, "B read A's output embedding through its embedding %d", i);
        snprintf(want, sizeof want, "%d|next_dist: embedding %d was never written",
                 -(int)PIE_FAILED_PRECONDITION, i);
        cr_expect_str_eq(got, want, "next_dist on B's unwritten embedding %d", i);
    }
    cr_expect_str_eq(msg_value(&r, "sync"), "0|", "synchronize after the failed next_dist calls");
    e2e_run_free(&r);
    free(a);
    free(prog);
    e2e_cluster_stop(&c);
}
