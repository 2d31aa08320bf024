/* test_tenants.c — issue 11, holes 2 and 3: tenants own their exports and stay within quotas.
 *
 * A real pie-controller, CPU pie-worker and pie-lifecycle on loopback (tests/e2e/e2e_support.h)
 * with tenants.dir holding three tenants: alice (export_pages 4, kv_pages 8, instances 1),
 * bob (uploads up to 64 KiB, no other quota) and root (admin). The fixture tests/wasm/sec_export.c
 * runs the KV page and export steps it is given and reports each call's status.
 *   * The pinning attack: an instance exports pages persistently and exits; before tenants the
 *     pages stayed held forever and any instance could list, unexport or take over the name.
 *     Now the tenant's persistent export pages are bounded (RESOURCE_EXHAUSTED naming the
 *     quota), other tenants neither see nor import nor remove them, and an admin frees them
 *     with Lifecycle.DeleteExport.
 *   * Quotas: KV pages and running instances per tenant refuse with RESOURCE_EXHAUSTED naming
 *     the quota; instances of another tenant are invisible (ListInstances, Terminate).
 *   * Tokens: only a tenant's token opens the public API, never the internal service token.
 *   * Topics: broadcasts reach only the instances of the sender's tenant.
 *   * The controller's program registry: one tenant's uploads evict its own programs, not those
 *     of a tenant holding less.
 *   * Stored programs: carol (program_bytes: two and a half of the variants below) holds at
 *     most that many bytes of programs on a replica; her DeleteProgram releases her hold and
 *     never removes a program another tenant holds. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "e2e_support.h"
#include "pie/v1/lifecycle.pb-c.h"
#include "pie_sha256.h"
#include "pie_testutil.h"

TestSuite(security, .fini = pie_test_leak_check, .timeout = 600);

#define TOKEN_ALICE "alice-token-0123456789"
#define TOKEN_BOB   "bob-token-0123456789ab"
#define TOKEN_ROOT  "root-token-0123456789a"
#define TOKEN_CAROL "carol-token-0123456789"
#define VARIANT_OF  PIE_INFERLETS_DIR "/sec_export.wasm" /* the programs carol uploads */
#define TOKEN_SVC   "internal-service-token-0123"
#define CALL_MS     10000

typedef struct tenants_env {
    char *dir;
    char dir_env[600];
    e2e_cluster c;                  /* c.ch: alice's channel */
    rpc_channel *bob, *root, *none; /* channels with bob's, root's and no token */
    rpc_channel *carol;
} tenants_env;

static void write_file(const char *dir, const char *name, const char *text) {
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert(f, "cannot write %s", path);
    cr_assert_eq(fputs(text, f) >= 0 && fclose(f) == 0, 1);
}

static rpc_channel *channel(const e2e_cluster *c, const char *token) {
    pie_status st;
    rpc_channel_opts co = {.token = token};
    rpc_channel *ch = rpc_channel_create(pie_proc_addr(c->lc), &co, &st);
    cr_assert(ch, "%s", st.msg);
    return ch;
}

/* Starts the cluster, its controller with ctl_env and its lifecycle with lc_extra too
 * (NULL-terminated "PIE_KEY=value", at most 4; NULL: none). */
static void env_start_with(tenants_env *e, const char *const *ctl_env,
                           const char *const *lc_extra) {
    pie_status st;
    memset(e, 0, sizeof *e);
    e->dir = pie_proc_tmpdir(&st);
    cr_assert(e->dir, "%s", st.msg);
    write_file(e->dir, "alice.yaml",
               "token: " TOKEN_ALICE "\nexport_pages: 4\nkv_pages: 8\ninstances: 1\n");
    write_file(e->dir, "bob.yaml", "token: " TOKEN_BOB "\nupload_bytes: 64KiB\n");
    write_file(e->dir, "root.yaml", "token: " TOKEN_ROOT "\nadmin: true\n");
    struct stat sb; /* carol: room for two variants of VARIANT_OF, not three */
    cr_assert_eq(stat(VARIANT_OF, &sb), 0, "%s", VARIANT_OF);
    char carol[200];
    snprintf(carol, sizeof carol, "token: " TOKEN_CAROL "\nprogram_bytes: %lld\n",
             (long long)(sb.st_size + PIE_TEST_WASM_VARIANT_EXTRA) * 5 / 2);
    write_file(e->dir, "carol.yaml", carol);
    snprintf(e->dir_env, sizeof e->dir_env, "PIE_TENANTS_DIR=%s", e->dir);
    const char *env[8] = {e->dir_env, "PIE_AUTH_TOKEN=" TOKEN_SVC};
    for (size_t i = 0; lc_extra && lc_extra[i]; i++) {
        cr_assert(i < 4, "at most 4 extra lifecycle settings");
        env[2 + i] = lc_extra[i];
    }
    e2e_cluster_start_ctl(&e->c, ctl_env, NULL, env, TOKEN_ALICE);
    e->bob = channel(&e->c, TOKEN_BOB);
    e->root = channel(&e->c, TOKEN_ROOT);
    e->none = channel(&e->c, NULL);
    e->carol = channel(&e->c, TOKEN_CAROL);
}

static void env_start(tenants_env *e) { env_start_with(e, NULL, NULL); }

static void env_stop(tenants_env *e) {
    rpc_channel_destroy(e->bob);
    rpc_channel_destroy(e->root);
    rpc_channel_destroy(e->none);
    rpc_channel_destroy(e->carol);
    e2e_cluster_stop(&e->c);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", e->dir);
    cr_expect_eq(system(cmd), 0);
    free(e->dir);
}

/* The cluster as the tenant of ch sees it: e2e calls through ch. */
static e2e_cluster as_caller(const tenants_env *e, rpc_channel *ch) {
    e2e_cluster as = e->c;
    as.ch = ch;
    return as;
}

/* Runs prog with steps as the tenant of ch; r gets the outcome (asserted successful). */
static void run_as(tenants_env *e, rpc_channel *ch, const char *prog, const char *const *steps,
                   e2e_run *r) {
    e2e_cluster as = as_caller(e, ch);
    e2e_run_program(&as, prog, steps, NULL, r);
    e2e_assert_success(r, steps[0]);
}

/* The report "<step>=..." number i (0-based) among the messages with that step name. */
static const char *report(const e2e_run *r, const char *step, int i) {
    size_t len = strlen(step);
    for (size_t k = 0; k < r->n_msgs; k++)
        if (strncmp(r->msgs[k], step, len) == 0 && r->msgs[k][len] == '=' && i-- == 0)
            return r->msgs[k] + len + 1;
    cr_assert_fail("no report %s #%d among %zu messages", step, i, r->n_msgs);
    return NULL;
}

static int code_of(const char *report_value) { return -atoi(report_value); }

#define expect_ok(r, step, i)                                                                      \
    cr_expect_eq(code_of(report(r, step, i)), 0, "%s #%d: %s", step, i, report(r, step, i))
#define expect_code(r, step, i, code, text)                                                        \
    do {                                                                                           \
        const char *v_ = report(r, step, i);                                                       \
        cr_expect_eq(code_of(v_), (code), "%s #%d: %s", step, i, v_);                              \
        cr_expect(strstr(v_, text) != NULL, "%s #%d: \"%s\" does not say \"%s\"", step, i, v_,   \
                  text);                                                                           \
    } while (0)

static Pie__V1__ListExportsResponse *list_exports(rpc_channel *ch, bool all, pie_code want) {
    Pie__V1__ListExportsRequest req = PIE__V1__LIST_EXPORTS_REQUEST__INIT;
    req.all_tenants = all;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = CALL_MS};
    pie_code rc = rpc_unary(ch, "/pie.v1.Lifecycle/ListExports", &req.base,
                            &pie__v1__list_exports_response__descriptor, &m, &o, &st);
    cr_assert_eq(rc, want, "ListExports(all=%d): %s %s", all, pie_code_name(rc), st.msg);
    return (Pie__V1__ListExportsResponse *)m;
}

static pie_code delete_export(rpc_channel *ch, const char *tenant, const char *name,
                              uint32_t *pages, pie_status *st) {
    Pie__V1__DeleteExportRequest req = PIE__V1__DELETE_EXPORT_REQUEST__INIT;
    req.name = (char *)name;
    req.tenant = (char *)tenant;
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = CALL_MS};
    pie_code rc = rpc_unary(ch, "/pie.v1.Lifecycle/DeleteExport", &req.base,
                            &pie__v1__delete_export_response__descriptor, &m, &o, st);
    if (rc == PIE_OK) *pages = ((Pie__V1__DeleteExportResponse *)m)->page_count;
    rpc_msg_free(m);
    return rc;
}

Test(security, persistent_exports_are_bounded_owned_by_their_tenant_and_removable) {
    tenants_env e;
    env_start(&e);
    char *prog = e2e_upload(&e.c, "sec_export");
    e2e_run r;

    /* alice pins 4 pages with a persistent export and exits; a fifth page is over her quota */
    const char *pin[] = {"alloc:4", "export:p1:4:1", NULL};
    run_as(&e, e.c.ch, prog, pin, &r);
    expect_ok(&r, "export", 0);
    e2e_run_free(&r);
    const char *more[] = {"alloc:1", "export:p2:1:1", "export:t2:1:0", NULL};
    run_as(&e, e.c.ch, prog, more, &r);
    expect_code(&r, "export", 0, PIE_RESOURCE_EXHAUSTED, "quota export_pages (4)");
    expect_ok(&r, "export", 1); /* a non-persistent export is not charged */
    e2e_run_free(&r);

    /* bob sees none of it, cannot take or remove it, and has a namespace of his own */
    const char *bob_steps[] = {"list", "import:p1:4", "unexport:p1", "alloc:1", "export:p1:1:1",
                               "list", NULL};
    run_as(&e, e.bob, prog, bob_steps, &r);
    cr_expect_str_eq(report(&r, "list", 0), "", "bob listed alice's exports");
    expect_code(&r, "import", 0, PIE_NOT_FOUND, "\"p1\"");
    expect_code(&r, "unexport", 0, PIE_NOT_FOUND, "\"p1\"");
    expect_ok(&r, "export", 0);
    cr_expect_str_eq(report(&r, "list", 1), "p1:1:1");
    e2e_run_free(&r);

    /* alice still has hers */
    const char *alice_import[] = {"list", "import:p1:4", NULL};
    run_as(&e, e.c.ch, prog, alice_import, &r);
    cr_expect_str_eq(report(&r, "list", 0), "p1:4:1");
    expect_ok(&r, "import", 0);
    e2e_run_free(&r);

    /* the public API: each tenant lists its own; only an admin lists or deletes any */
    Pie__V1__ListExportsResponse *l = list_exports(e.bob, false, PIE_OK);
    cr_assert_eq(l->n_exports, 1);
    cr_expect_str_eq(l->exports[0]->tenant, "bob");
    rpc_msg_free(&l->base);
    list_exports(e.bob, true, PIE_PERMISSION_DENIED);
    pie_status st;
    uint32_t pages = 0;
    cr_expect_eq(delete_export(e.bob, "alice", "p1", &pages, &st), PIE_PERMISSION_DENIED, "%s",
                 st.msg);
    l = list_exports(e.root, true, PIE_OK);
    cr_assert_eq(l->n_exports, 2, "alice's p1 and bob's p1");
    cr_expect_str_eq(l->exports[0]->tenant, "alice");
    cr_expect_eq(l->exports[0]->page_count, 4);
    cr_expect(l->exports[0]->persistent);
    cr_expect_str_eq(l->exports[1]->tenant, "bob");
    rpc_msg_free(&l->base);
    cr_assert_eq(delete_export(e.root, "alice", "p1", &pages, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(pages, 4);
    cr_expect_eq(delete_export(e.root, "alice", "p1", &pages, &st), PIE_NOT_FOUND, "%s", st.msg);
    cr_expect_eq(delete_export(e.c.ch, "", "nope", &pages, &st), PIE_NOT_FOUND, "%s", st.msg);

    /* alice's pages are free again: her quota holds a new persistent export */
    const char *again[] = {"import:p1:4", "alloc:4", "export:p1:4:1", NULL};
    run_as(&e, e.c.ch, prog, again, &r);
    expect_code(&r, "import", 0, PIE_NOT_FOUND, "\"p1\"");
    expect_ok(&r, "export", 0);
    e2e_run_free(&r);
    cr_assert_eq(delete_export(e.c.ch, "", "p1", &pages, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(delete_export(e.bob, "", "p1", &pages, &st), PIE_OK, "%s", st.msg);
    free(prog);
    env_stop(&e);
}

static uint64_t launch(tenants_env *e, rpc_channel *ch, const char *prog,
                       const char *const *args, pie_code want, pie_status *st) {
    e2e_cluster as = as_caller(e, ch);
    return e2e_launch(&as, prog, args, want, st);
}

static pie_code terminate(tenants_env *e, rpc_channel *ch, uint64_t id, pie_status *st) {
    e2e_cluster as = as_caller(e, ch);
    return e2e_terminate(&as, id, st);
}

/* UploadProgram as ch's tenant declaring size bytes (nothing else sent): its status. */
static pie_code upload_size(tenants_env *e, rpc_channel *ch, uint64_t size, pie_status *st) {
    e2e_cluster as = as_caller(e, ch);
    return e2e_upload_end(e2e_upload_begin(&as, "big", size, NULL, 0, CALL_MS), st);
}

static pie_code delete_program(rpc_channel *ch, const char *id, pie_status *st) {
    Pie__V1__DeleteProgramRequest del = PIE__V1__DELETE_PROGRAM_REQUEST__INIT;
    del.program_id = (char *)id;
    ProtobufCMessage *m = NULL;
    rpc_call_opts o = {.timeout_ms = CALL_MS};
    pie_code rc = rpc_unary(ch, "/pie.v1.Lifecycle/DeleteProgram", &del.base,
                            &pie__v1__delete_program_response__descriptor, &m, &o, st);
    rpc_msg_free(m);
    return rc;
}

/* Whether ch's tenant sees instance id in ListInstances. */
static bool visible(tenants_env *e, rpc_channel *ch, uint64_t id) {
    e2e_cluster as = as_caller(e, ch);
    Pie__V1__ListInstancesResponse *r;
    bool seen = e2e_instance(&as, id, &r) != NULL;
    rpc_msg_free(&r->base);
    return seen;
}

Test(security, tenant_quotas_refuse_with_the_quota_named_and_instances_stay_private) {
    tenants_env e;
    env_start(&e);
    char *prog = e2e_upload(&e.c, "sec_export");
    e2e_run r;
    pie_status st;

    /* KV pages: 8 for alice across her instances */
    const char *kv[] = {"alloc:6", "alloc:3", "alloc:2", NULL};
    run_as(&e, e.c.ch, prog, kv, &r);
    expect_ok(&r, "alloc", 0);
    expect_code(&r, "alloc", 1, PIE_RESOURCE_EXHAUSTED, "quota kv_pages (8)");
    expect_ok(&r, "alloc", 2);
    e2e_run_free(&r);

    /* instances: one at a time for alice; bob is not limited by hers */
    const char *wait[] = {"wait", NULL};
    uint64_t a1 = launch(&e, e.c.ch, prog, wait, PIE_OK, &st);
    launch(&e, e.c.ch, prog, wait, PIE_RESOURCE_EXHAUSTED, &st);
    cr_expect(strstr(st.msg, "quota instances (1)"), "%s", st.msg);
    uint64_t b1 = launch(&e, e.bob, prog, wait, PIE_OK, &st);

    /* another tenant's instance is invisible: not listed, not terminable, not attachable */
    cr_expect(visible(&e, e.c.ch, a1));
    cr_expect(!visible(&e, e.bob, a1), "bob lists alice's instance");
    cr_expect(visible(&e, e.root, a1), "an admin sees every instance");
    cr_expect_eq(terminate(&e, e.bob, a1, &st), PIE_NOT_FOUND, "bob terminated alice's instance");
    cr_expect_eq(terminate(&e, e.c.ch, a1, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(terminate(&e, e.root, b1, &st), PIE_OK, "%s", st.msg);
    /* Terminate answers once the instance has ended and the controller will count it off
     * before any later launch: alice's next launch fits her quota of 1 at once (before, one
     * right after the answer was refused now and then: "quota instances (1) reached") */
    for (int i = 0; i < 10; i++) {
        uint64_t a = launch(&e, e.c.ch, prog, wait, PIE_OK, &st);
        cr_assert_eq(terminate(&e, e.c.ch, a, &st), PIE_OK, "round %d: %s", i, st.msg);
    }

    /* uploads: bob's are bounded by his quota; programs are shared: bob's delete of alice's
     * program releases nothing of hers (only his own holds; an admin's removes it) */
    cr_expect_eq(upload_size(&e, e.bob, 65537, &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_expect(strstr(st.msg, "quota upload_bytes (65536)"), "%s", st.msg);
    delete_program(e.bob, prog, &st);
    const char *quick[] = {"alloc:1", NULL};
    run_as(&e, e.c.ch, prog, quick, &r);
    e2e_run_free(&r);

    /* tokens: none, the internal one, and a wrong one are all refused by the public API */
    rpc_channel *svc = channel(&e.c, TOKEN_SVC);
    rpc_channel *bad = channel(&e.c, "not-a-tenant-token-000");
    rpc_channel *chans[] = {e.none, svc, bad};
    for (size_t i = 0; i < 3; i++) {
        Pie__V1__ListModelsRequest req = PIE__V1__LIST_MODELS_REQUEST__INIT;
        ProtobufCMessage *m = NULL;
        rpc_call_opts o = {.timeout_ms = CALL_MS};
        cr_expect_eq(rpc_unary(chans[i], "/pie.v1.Lifecycle/ListModels", &req.base,
                               &pie__v1__list_models_response__descriptor, &m, &o, &st),
                     PIE_UNAUTHENTICATED, "token #%zu: %s", i, st.msg);
        rpc_msg_free(m);
    }
    rpc_channel_destroy(svc);
    rpc_channel_destroy(bad);
    free(prog);
    env_stop(&e);
}

/* pie_test_wasm_variant number of VARIANT_OF, uploaded as ch's tenant; *id gets its SHA-256. */
static pie_code upload_variant(tenants_env *e, rpc_channel *ch, int number, char id[65],
                               pie_status *st) {
    FILE *f = fopen(VARIANT_OF, "rb");
    cr_assert(f, "%s", VARIANT_OF);
    uint8_t *base = malloc(1 << 20);
    cr_assert(base);
    size_t len = fread(base, 1, 1 << 20, f);
    cr_assert(feof(f), "%s is larger than 1 MiB", VARIANT_OF);
    fclose(f);
    uint8_t *v = pie_test_wasm_variant(base, len, number);
    cr_assert(v);
    size_t k = len + PIE_TEST_WASM_VARIANT_EXTRA;
    cr_assert_eq(pie_sha256_hex(v, k, id, st), PIE_OK);
    e2e_cluster as = as_caller(e, ch);
    pie_code rc = e2e_upload_end(e2e_upload_begin(&as, "variant", k, v, k, CALL_MS), st);
    free(v);
    free(base);
    return rc;
}

/* ListPrograms as ch's tenant: the entry for id (a copy, to free), or NULL when not listed. */
static Pie__V1__ProgramInfo *listing_of(rpc_channel *ch, const char *id) {
    Pie__V1__ListProgramsRequest req = PIE__V1__LIST_PROGRAMS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    pie_status st;
    rpc_call_opts o = {.timeout_ms = CALL_MS};
    cr_assert_eq(rpc_unary(ch, "/pie.v1.Lifecycle/ListPrograms", &req.base,
                           &pie__v1__list_programs_response__descriptor, &m, &o, &st),
                 PIE_OK, "%s", st.msg);
    Pie__V1__ListProgramsResponse *r = (Pie__V1__ListProgramsResponse *)m;
    Pie__V1__ProgramInfo *found = NULL;
    for (size_t i = 0; i < r->n_programs && !found; i++)
        if (strcmp(r->programs[i]->program_id, id) == 0) {
            uint8_t buf[4096];
            size_t n = protobuf_c_message_pack(&r->programs[i]->base, buf);
            cr_assert(n < sizeof buf);
            found = pie__v1__program_info__unpack(NULL, n, buf);
            cr_assert(found);
        }
    rpc_msg_free(m);
    return found;
}

static bool listed_on(rpc_channel *ch, const char *id) {
    Pie__V1__ProgramInfo *pi = listing_of(ch, id);
    if (pi) pie__v1__program_info__free_unpacked(pi, NULL);
    return pi != NULL;
}

static bool listed(tenants_env *e, const char *id) { return listed_on(e->root, id); }

/* A tenant could fill a replica's disk with distinct uploads, and with the store's bound
 * (programs.store_size) every other tenant's uploads with it. Its quota program_bytes bounds
 * what it holds; its DeleteProgram releases its own hold and never removes another's program. */
Test(security, a_tenant_holds_at_most_program_bytes_and_deletes_only_its_own_holds) {
    tenants_env e;
    env_start(&e);
    pie_status st;
    char v[4][65];
    cr_assert_eq(upload_variant(&e, e.carol, 0, v[0], &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&e, e.carol, 1, v[1], &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&e, e.carol, 2, v[2], &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_expect(strstr(st.msg, "tenant \"carol\" quota program_bytes"), "%s", st.msg);
    cr_expect(!listed(&e, v[2]), "the refused upload was stored");
    /* bob has no such quota; the same bytes are then stored, but carol would hold them too */
    cr_assert_eq(upload_variant(&e, e.bob, 2, v[2], &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(upload_variant(&e, e.carol, 2, v[2], &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    /* alice holds variant 0 as well: carol's delete releases only carol's hold */
    cr_assert_eq(upload_variant(&e, e.c.ch, 0, v[3], &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(v[3], v[0]);
    cr_assert_eq(delete_program(e.carol, v[0], &st), PIE_OK, "%s", st.msg);
    cr_expect(listed(&e, v[0]), "carol's delete removed the program alice holds");
    cr_assert_eq(upload_variant(&e, e.carol, 2, v[2], &st), PIE_OK, "room again: %s", st.msg);
    /* carol alone holds variant 1: her delete removes it; bob's delete of a program he does not
     * hold removes nothing */
    cr_assert_eq(delete_program(e.carol, v[1], &st), PIE_OK, "%s", st.msg);
    cr_expect(!listed(&e, v[1]), "carol's own program stayed after her delete");
    cr_expect_eq(delete_program(e.bob, v[0], &st), PIE_NOT_FOUND,
                 "bob's delete of a program he never held answered %s", st.msg);
    cr_expect(strstr(st.msg, "tenant \"bob\" holds") != NULL, "%s", st.msg);
    cr_expect(listed(&e, v[0]), "bob's delete removed a program he never held");
    /* an admin's delete removes a program whoever holds it */
    cr_assert_eq(delete_program(e.root, v[2], &st), PIE_OK, "%s", st.msg);
    cr_expect(!listed(&e, v[2]), "an admin's delete left the program");
    char unknown[65];
    memset(unknown, 'a', 64);
    unknown[64] = '\0';
    cr_expect_eq(delete_program(e.carol, unknown, &st), PIE_NOT_FOUND, "%s", st.msg);
    env_stop(&e);
}

/* What a launch fetches from the registry onto another replica is held by the launching
 * tenant there, within its quota; its DeleteProgram on one replica releases its holds on all. */
Test(security, a_tenants_fetches_count_and_its_delete_releases_them_on_every_replica) {
    tenants_env e;
    env_start(&e);
    e2e_cluster c2 = {.ctl = e.c.ctl}; /* a second replica of the same cluster and tenants */
    const char *env[] = {e.dir_env, "PIE_AUTH_TOKEN=" TOKEN_SVC, NULL};
    e2e_cluster_start_lifecycle(&c2, env, TOKEN_CAROL);
    rpc_channel *root2 = channel(&c2, TOKEN_ROOT);
    pie_status st;
    char v[3][65];
    cr_assert_eq(upload_variant(&e, e.carol, 0, v[0], &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&e, e.carol, 1, v[1], &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&e, e.bob, 2, v[2], &st), PIE_OK, "%s", st.msg);
    const char *args[] = {"alloc:1", NULL};
    for (int i = 0; i < 2; i++) { /* fetched onto replica 2 by carol's launches */
        e2e_launch(&c2, v[i], args, PIE_OK, &st);
        cr_expect(listed_on(root2, v[i]), "variant %d not fetched", i);
    }
    e2e_launch(&c2, v[2], args, PIE_RESOURCE_EXHAUSTED, &st);
    cr_expect(strstr(st.msg, "tenant \"carol\" quota program_bytes"), "%s", st.msg);
    cr_assert_eq(delete_program(e.carol, v[0], &st), PIE_OK, "%s", st.msg); /* on replica 1 */
    bool gone = false;
    for (int k = 0; k < 100 && !gone; k++) {
        gone = !listed_on(root2, v[0]);
        if (!gone) pie_test_sleep_ms(50);
    }
    cr_expect(gone, "carol's release on replica 1 left her copy on replica 2");
    cr_expect(!listed_on(e.root, v[0]), "carol's release left her copy on replica 1");
    e2e_launch(&c2, v[2], args, PIE_OK, &st);
    rpc_channel_destroy(root2);
    c2.ctl = NULL; /* the cluster's, stopped with it */
    e2e_cluster_stop(&c2);
    env_stop(&e);
}

/* ListPrograms listed every program of the replica to every tenant: bob read the ids and names
 * of alice's programs, and with an id he could launch her program. A tenant lists the programs
 * it holds; an admin lists all, with their holders. */
Test(security, a_tenant_lists_only_the_programs_it_holds) {
    tenants_env e;
    env_start(&e);
    pie_status st;
    char a[65], b[65], s[65];
    cr_assert_eq(upload_variant(&e, e.c.ch, 0, a, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&e, e.bob, 1, b, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&e, e.bob, 2, s, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(upload_variant(&e, e.c.ch, 2, s, &st), PIE_OK, "%s", st.msg); /* shared */
    cr_expect(!listed_on(e.bob, a), "bob lists alice's program");
    cr_expect(listed_on(e.bob, b) && listed_on(e.bob, s));
    cr_expect(!listed_on(e.c.ch, b), "alice lists bob's program");
    cr_expect(listed_on(e.c.ch, a) && listed_on(e.c.ch, s));
    Pie__V1__ProgramInfo *pi = listing_of(e.root, s);
    cr_assert(pi, "an admin does not list every program");
    cr_expect(pi->n_holders == 2 && strcmp(pi->holders[0], "alice") == 0 &&
                  strcmp(pi->holders[1], "bob") == 0,
              "holders of the shared program: %zu", pi->n_holders);
    pie__v1__program_info__free_unpacked(pi, NULL);
    pi = listing_of(e.bob, b);
    cr_assert(pi);
    cr_expect_eq(pi->n_holders, 0, "a tenant's listing names holders");
    pie__v1__program_info__free_unpacked(pi, NULL);
    env_stop(&e);
}

/* The controller's program registry, from which replicas fetch what they lack, was one LRU for
 * every tenant: bob's distinct uploads pushed alice's program out of it, and alice could then
 * launch it only on the replica she uploaded it to. Now the tenant holding the most pays. */
Test(security, one_tenants_uploads_cannot_push_another_tenants_program_out_of_the_registry) {
    tenants_env e;
    const char *ctl_env[] = {"PIE_PROGRAMS_REGISTRY_SIZE=136KiB", NULL}; /* 4 variants, not 5 */
    env_start_with(&e, ctl_env, NULL);
    pie_status st;
    char v[7][65];
    cr_assert_eq(upload_variant(&e, e.c.ch, 0, v[0], &st), PIE_OK, "%s", st.msg);
    for (int i = 1; i < 7; i++)
        cr_assert_eq(upload_variant(&e, e.bob, i, v[i], &st), PIE_OK, "%s", st.msg);
    e2e_cluster c2 = {.ctl = e.c.ctl}; /* a replica that holds none of them */
    const char *env[] = {e.dir_env, "PIE_AUTH_TOKEN=" TOKEN_SVC, NULL};
    e2e_cluster_start_lifecycle(&c2, env, TOKEN_ALICE);
    const char *args[] = {"alloc:1", NULL};
    e2e_launch(&c2, v[0], args, PIE_OK, &st); /* fetched from the registry */
    e2e_cluster bob2 = c2;
    bob2.ch = channel(&c2, TOKEN_BOB);
    e2e_launch(&bob2, v[1], args, PIE_NOT_FOUND, &st); /* bob's oldest made room */
    e2e_launch(&bob2, v[6], args, PIE_OK, &st);
    rpc_channel_destroy(bob2.ch);
    c2.ctl = NULL; /* the cluster's, stopped with it */
    e2e_cluster_stop(&c2);
    env_stop(&e);
}

/* programs.max_uploads bounds a replica's uploads in progress: one tenant's held open could take
 * every slot, and every other tenant's uploads were refused while they lasted. With tenants one
 * holds at most its share (programs.max_tenant_uploads: half by default). */
Test(security, one_tenant_holds_at_most_its_share_of_the_upload_slots) {
    tenants_env e;
    const char *lc_extra[] = {"PIE_PROGRAMS_MAX_UPLOADS=4", NULL}; /* bob's share: 2 */
    env_start_with(&e, NULL, lc_extra);
    e2e_cluster bob = as_caller(&e, e.bob);
    rpc_stream *open[3];
    for (int i = 0; i < 3; i++) open[i] = e2e_upload_begin(&bob, "pending", 1024, NULL, 0, 30000);
    /* the three race to the replica: whichever it sees third is refused at once; none is ended
     * before (an ended one would give its slot back) */
    int ended = -1;
    for (int64_t end = pie_test_now_ms() + 10000; ended < 0 && pie_test_now_ms() < end;)
        for (int i = 0; i < 3 && ended < 0; i++) {
            ProtobufCMessage *m = NULL;
            if (rpc_stream_recv(open[i], &m, 10) == RPC_RECV_END) ended = i;
        }
    cr_assert(ended >= 0, "none of bob's three uploads was refused (his share is 2 of 4)");
    pie_status st;
    cr_expect_eq(e2e_upload_end(open[ended], &st), PIE_RESOURCE_EXHAUSTED, "%s", st.msg);
    cr_expect(strstr(st.msg, "tenant \"bob\"") && strstr(st.msg, "programs.max_tenant_uploads"),
              "%s", st.msg);
    /* bob's two still hold their slots: carol uploads beside them */
    char id[65];
    cr_expect_eq(upload_variant(&e, e.carol, 0, id, &st), PIE_OK, "%s", st.msg);
    for (int i = 0; i < 3; i++)
        if (i != ended) cr_expect_neq(e2e_upload_end(open[i], &st), PIE_OK, "stored without bytes");
    env_stop(&e);
}

/* limits.replica_memory is the replica's: one tenant's instances could spend it all, and every
 * other tenant's memory.grow and launches failed while they held it. With tenants each holds at
 * most limits.tenant_memory_share of it (default half) in linear memory. */
Test(security, a_tenant_holds_at_most_its_share_of_the_replica_memory) {
    tenants_env e;
    const char *lc_extra[] = {"PIE_LIMITS_REPLICA_MEMORY=64MiB", NULL}; /* a share: 32 MiB */
    env_start_with(&e, NULL, lc_extra);
    char *prog = e2e_upload(&e.c, "hostile");
    pie_status st;
    e2e_cluster bob = as_caller(&e, e.bob);
    const char *hold[] = {"hold", "400", "60000", NULL}; /* 25 MiB, kept */
    uint64_t held = e2e_launch(&bob, prog, hold, PIE_OK, &st);
    e2e_wait_memory(&bob, held, 400u << 16);
    const char *grow[] = {"hold", "200", "0", NULL}; /* 12.5 MiB more */
    e2e_run r;
    run_as(&e, e.bob, prog, grow, &r);
    cr_expect(strstr(r.out, "grow=-1"), "bob grew past his share of the replica: %s", r.out);
    e2e_run_free(&r);
    run_as(&e, e.c.ch, prog, grow, &r);
    cr_expect(strstr(r.out, "grow=") && !strstr(r.out, "grow=-1"),
              "alice could not grow beside bob's share: %s", r.out);
    e2e_run_free(&r);
    cr_expect_eq(e2e_terminate(&bob, held, &st), PIE_OK, "%s", st.msg);
    free(prog);
    env_stop(&e);
}

/* A messaging producer on topic "shared" writing 2 lines of 3 tokens for 1 consumer. */
#define PRODUCER_ARGS(prompt)                                                              \
    {                                                                                      \
        "--topic", "shared", "--prompt", prompt, "--lines", "2", "--tokens-per-line", "3", \
            "--consumers", "1", NULL                                                       \
    }

/* Topics were one namespace for the whole cluster: an instance of one tenant heard every
 * broadcast of another's on a topic of the same name, and could speak into it. Topics are per
 * tenant: two tenants running the messaging example on the same topic at once each pair their
 * own producer and consumer (before: bob's consumer took carol's lines, and bob's producer then
 * waited for a consumer for ever). */
Test(security, topics_are_per_tenant_an_instance_hears_only_its_own_tenants_broadcasts) {
    tenants_env e;
    env_start(&e);
    char *prod = e2e_upload_path(&e.c, PIE_APPS_DIR "/messaging_producer.wasm", "producer");
    char *cons = e2e_upload_path(&e.c, PIE_APPS_DIR "/messaging_consumer.wasm", "consumer");
    e2e_cluster carol = as_caller(&e, e.carol), bob = as_caller(&e, e.bob);
    const char *ca[] = {"--topic", "shared", NULL};
    rpc_stream *sc = e2e_run_open(&carol, cons, ca, NULL), *sb = e2e_run_open(&bob, cons, ca, NULL);
    const char *pc[] = PRODUCER_ARGS("Once upon a time");
    const char *pb[] = PRODUCER_ARGS("The quick brown fox");
    e2e_run rc, rb, cc, cb;
    e2e_run_program(&carol, prod, pc, NULL, &rc);
    e2e_assert_success(&rc, "carol's producer");
    e2e_run_program(&bob, prod, pb, NULL, &rb);
    e2e_assert_success(&rb, "bob's producer");
    e2e_run_collect(sc, &cc);
    e2e_run_collect(sb, &cb);
    e2e_assert_success(&cc, "carol's consumer");
    e2e_assert_success(&cb, "bob's consumer");
    cr_assert_eq(cc.n_msgs, 3, "carol's consumer: %zu messages", cc.n_msgs);
    cr_assert_eq(cb.n_msgs, 3, "bob's consumer: %zu messages", cb.n_msgs);
    for (size_t i = 0; i < 2; i++) {
        cr_expect_str_eq(cc.msgs[i], rc.msgs[i], "carol's line %zu", i);
        cr_expect_str_eq(cb.msgs[i], rb.msgs[i], "bob's line %zu", i);
    }
    cr_expect_str_neq(rc.msgs[0], rb.msgs[0], "the two producers' lines cannot be told apart");
    e2e_run_free(&rc);
    e2e_run_free(&rb);
    e2e_run_free(&cc);
    e2e_run_free(&cb);
    free(prod);
    free(cons);
    env_stop(&e);
}

/* Without tenants (one anonymous tenant, today's default deployment) the pinning attack of the
 * issue — persistent exports of most of the pool by an instance that then exits — is bounded by
 * exports.max_pool_share (a quarter of the worker's 512 pages here), and the public API lists
 * and frees what is pinned. */
Test(security, persistent_exports_cannot_pin_a_pool_without_tenants) {
    e2e_cluster c;
    e2e_cluster_start(&c);
    char *prog = e2e_upload(&c, "sec_export");
    tenants_env e = {.c = c};
    e2e_run r;
    const char *most[] = {"alloc:200", "export:pin:200:1", NULL};
    run_as(&e, c.ch, prog, most, &r);
    expect_code(&r, "export", 0, PIE_RESOURCE_EXHAUSTED, "quota exports.max_pool_share (128)");
    e2e_run_free(&r);
    const char *some[] = {"alloc:120", "export:pin:120:1", NULL};
    run_as(&e, c.ch, prog, some, &r);
    expect_ok(&r, "export", 0);
    e2e_run_free(&r);
    const char *more[] = {"alloc:9", "export:pin2:9:1", NULL};
    run_as(&e, c.ch, prog, more, &r);
    expect_code(&r, "export", 0, PIE_RESOURCE_EXHAUSTED, "quota exports.max_pool_share (128)");
    e2e_run_free(&r);
    const char *use[] = {"alloc:256", "alloc:100", NULL}; /* the rest of the pool stays usable */
    run_as(&e, c.ch, prog, use, &r);
    expect_ok(&r, "alloc", 0);
    expect_ok(&r, "alloc", 1);
    e2e_run_free(&r);
    Pie__V1__ListExportsResponse *l = list_exports(c.ch, false, PIE_OK);
    cr_assert_eq(l->n_exports, 1);
    cr_expect_str_eq(l->exports[0]->name, "pin");
    cr_expect_str_eq(l->exports[0]->tenant, "anonymous");
    cr_expect_eq(l->exports[0]->page_count, 120);
    rpc_msg_free(&l->base);
    pie_status st;
    uint32_t pages = 0;
    cr_expect_eq(delete_export(c.ch, "", "pin", &pages, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(pages, 120);
    free(prog);
    e2e_cluster_stop(&c);
}
