/* test_tenant.c — pie_tenant: the tenants directory and token lookup (issue 11, hole 3). */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pie_tenant.h"
#include "pie_testutil.h"

TestSuite(tenant, .fini = pie_test_leak_check);

static char dir[64];

static void fresh_dir(void) {
    snprintf(dir, sizeof dir, "/tmp/pie-tenants-XXXXXX");
    cr_assert(mkdtemp(dir), "mkdtemp");
}

static void put(const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    cr_assert(fputs(text, f) >= 0 && fclose(f) == 0);
}

static void rm_dir(void) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

/* Loads dir expecting code; with an error, its message must contain text. */
static void load_fails(pie_code code, const char *text) {
    pie_tenants t;
    pie_status st;
    cr_assert_eq(pie_tenants_load(dir, "service-token-0123456789", &t, &st), code, "%s", st.msg);
    cr_expect(strstr(st.msg, text), "\"%s\" does not say \"%s\"", st.msg, text);
    cr_expect_eq(t.n, 0);
    cr_expect_null(t.v);
}

Test(tenant, loads_every_tenant_file_and_finds_tokens) {
    fresh_dir();
    put("alice.yaml", "token: alice-token-0123456789\nkv_pages: 64\ninstances: 2\n"
                      "export_pages: 8\nupload_bytes: 1MiB\n");
    put("bob.yaml", "token: bob-token-0123456789ab\nadmin: true\n");
    put(".hidden.yaml", "this is not read");
    cr_assert_eq(mkdir(strcat(strcpy((char[128]){0}, dir), "/..data"), 0700), 0);
    pie_tenants t;
    pie_status st;
    cr_assert_eq(pie_tenants_load(dir, "service-token-0123456789", &t, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(t.n, 2);
    const pie_tenant *a = pie_tenants_by_name(&t, "alice");
    cr_assert_not_null(a);
    cr_expect_eq(a->quota.kv_pages, 64);
    cr_expect_eq(a->quota.instances, 2);
    cr_expect_eq(a->quota.export_pages, 8);
    cr_expect_eq(a->quota.upload_bytes, 1u << 20);
    cr_expect(!a->admin);
    cr_expect(pie_tenants_by_name(&t, "bob")->admin);
    const char *hb = "Bearer bob-token-0123456789ab";
    cr_expect_eq(pie_tenants_find(&t, hb, strlen(hb)), pie_tenants_by_name(&t, "bob"));
    const char *ha = "Bearer alice-token-0123456789";
    cr_expect_eq(pie_tenants_find(&t, ha, strlen(ha)), a);
    cr_expect_null(pie_tenants_find(&t, ha, strlen(ha) - 1), "a prefix of a token is no token");
    cr_expect_null(pie_tenants_find(&t, "alice-token-0123456789", 22), "Bearer is required");
    cr_expect_null(pie_tenants_by_name(&t, "carol"));
    pie_tenants_free(&t);
    rm_dir();
}

Test(tenant, refuses_bad_files_naming_the_problem) {
    fresh_dir();
    load_fails(PIE_INVALID_ARGUMENT, "holds no <name>.yaml tenant file");
    put("Alice.yaml", "token: alice-token-0123456789\n");
    load_fails(PIE_INVALID_ARGUMENT, "Alice.yaml' is not <name>.yaml");
    rm_dir();

    fresh_dir();
    put("alice.yaml", "token: short\n");
    load_fails(PIE_INVALID_ARGUMENT, "token: 5 bytes");
    put("alice.yaml", "token: alice token with spaces 012\n");
    load_fails(PIE_INVALID_ARGUMENT, "only letters, digits");
    put("alice.yaml", "admin: true\n");
    load_fails(PIE_INVALID_ARGUMENT, "missing required key 'token'");
    put("alice.yaml", "token: alice-token-0123456789\nkv_page: 3\n");
    load_fails(PIE_INVALID_ARGUMENT, "unknown key 'kv_page'");
    put("alice.yaml", "token: service-token-0123456789\n");
    load_fails(PIE_INVALID_ARGUMENT, "internal service token");
    put("alice.yaml", "token: same-token-0123456789\n");
    put("bob.yaml", "token: same-token-0123456789\n");
    load_fails(PIE_INVALID_ARGUMENT, "tenants alice and bob have the same token");
    rm_dir();
    pie_tenants t;
    pie_status st;
    cr_expect_eq(pie_tenants_load("/nonexistent/pie-tenants", "", &t, &st), PIE_NOT_FOUND, "%s",
                 st.msg);
}

Test(tenant, the_anonymous_tenant_is_the_only_one_and_sees_everything) {
    cr_expect_str_eq(pie_tenant_anonymous.name, "anonymous");
    cr_expect(pie_tenant_anonymous.admin);
    cr_expect_eq(pie_tenant_anonymous.quota.instances, 0);
}

typedef struct tab_entry {
    char name[PIE_TENANT_NAME_MAX + 1];
    unsigned n;
} tab_entry;

Test(tenant, a_tenant_table_finds_makes_and_removes_entries_by_name) {
    pie_tenant_tab t = PIE_TENANT_TAB_INIT(tab_entry);
    cr_assert_null(pie_tenant_tab_find(&t, "alice"));
    tab_entry *a = pie_tenant_tab_get(&t, "alice");
    cr_assert(a && strcmp(a->name, "alice") == 0 && a->n == 0, "a new entry is named and zeroed");
    a->n = 3;
    tab_entry *b = pie_tenant_tab_get(&t, "bob");
    b->n = 5;
    tab_entry *c = pie_tenant_tab_get(&t, "carol");
    c->n = 7;
    cr_assert_eq(t.n, 3);
    cr_assert_eq(((tab_entry *)pie_tenant_tab_get(&t, "bob"))->n, 5, "get finds what is there");
    cr_assert_eq(t.n, 3);
    pie_tenant_tab_remove(&t, pie_tenant_tab_find(&t, "alice"));
    cr_assert_eq(t.n, 2);
    cr_assert_null(pie_tenant_tab_find(&t, "alice"));
    cr_assert_eq(((tab_entry *)pie_tenant_tab_find(&t, "carol"))->n, 7, "the last moved intact");
    cr_assert_eq(((tab_entry *)pie_tenant_tab_find(&t, "bob"))->n, 5);
    pie_tenant_tab_remove(&t, pie_tenant_tab_find(&t, "carol")); /* the last one itself */
    cr_assert_eq(t.n, 1);
    cr_assert_eq(((tab_entry *)pie_tenant_tab_find(&t, "bob"))->n, 5);
    cr_assert_null(pie_tenant_tab_find(&t, ""), "the empty name is a name like any other");
    cr_assert_not_null(pie_tenant_tab_get(&t, ""));
    cr_assert_eq(t.n, 2);
    pie_tenant_tab_free(&t);
    cr_assert_eq(t.n, 0);
}
