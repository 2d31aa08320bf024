/* sec_export.c — fixture of tests/security/test_tenants.c: runs the KV page and export steps its
 * arguments name, in order, reporting each to the client as "<step>=<code>|<last_error>" (code 0
 * or a negative status), so the test sees exactly which call a quota or a tenant boundary
 * refused. Raw `pie` ABI, one queue on the default model. Steps:
 *   alloc:N             allocates N more KV pages (ids continue from the previous alloc)
 *   export:NAME:N:P     exports the first N allocated pages under NAME (P = 1: persistent)
 *   import:NAME:N       imports export NAME (N pages) into fresh ids
 *   unexport:NAME       removes export NAME
 *   list                "list=<name>:<pages>:<persistent>;..." of the exports it may see
 *   wait                blocks until a client message or the end of the instance (Terminate)
 *   flood:N             N alloc + dealloc pairs of 256 pages without waiting for any result:
 *                       "flood=<code of the first refused call>|<its index>|<last_error>", or
 *                       "flood=0|N|" when none was refused; then a synchronize ("sync=...")
 * Every step but list and wait ends with a synchronize, whose status is the one reported. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_abi.h"

#define Q        1u
#define F        2u
#define MAX_IDS  512u
#define IMPORT_0 1000u

static char out[4096];
static char err[512];
static uint8_t buf[8192];
static uint32_t n_alloc, n_import;

static const char *last_error(void) {
    int32_t n = pie_last_error(err, sizeof err - 1);
    err[n < 0 ? 0 : (n < (int32_t)sizeof err ? n : (int32_t)sizeof err - 1)] = '\0';
    return err;
}

static void report(const char *step, int32_t rc) {
    snprintf(out, sizeof out, "%s=%d|%s", step, rc, rc < 0 ? last_error() : "");
    pie_send(out, (uint32_t)strlen(out));
}

/* rc of the call, else the queue's synchronize status (the first deferred error). */
static int32_t settle(int32_t rc) {
    if (rc < 0) return rc;
    rc = pie_synchronize(Q, F);
    if (rc >= 0) rc = pie_future_wait(F, -1);
    if (rc >= 0) rc = pie_future_result(F, NULL, 0);
    return rc;
}

static int32_t do_alloc(uint32_t n) {
    uint32_t ids[MAX_IDS];
    if (n == 0 || n_alloc + n > MAX_IDS) return -3;
    for (uint32_t i = 0; i < n; i++) ids[i] = n_alloc + i;
    int32_t rc = settle(pie_alloc_kv_pages(Q, ids, n));
    if (rc >= 0) n_alloc += n;
    return rc;
}

static int32_t do_export(const char *name, uint32_t n, uint32_t persistent) {
    uint32_t ids[MAX_IDS];
    if (n == 0 || n > MAX_IDS) return -3;
    for (uint32_t i = 0; i < n; i++) ids[i] = i;
    return settle(pie_export_kv_pages(Q, ids, n, name, (uint32_t)strlen(name), persistent));
}

static int32_t do_import(const char *name, uint32_t n) {
    uint32_t ids[MAX_IDS];
    if (n == 0 || n > MAX_IDS) return -3;
    for (uint32_t i = 0; i < n; i++) ids[i] = IMPORT_0 + n_import + i;
    int32_t rc = pie_import_kv_pages(Q, ids, n, name, (uint32_t)strlen(name), F);
    if (rc >= 0) rc = pie_future_wait(F, -1);
    if (rc >= 0) rc = pie_future_result(F, buf, sizeof buf);
    if (rc < 0) return rc;
    n_import += n;
    return 0;
}

static uint32_t get_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* "list=<name>:<pages>:<persistent>;..." from the list_exports payload. */
static void do_list(void) {
    int32_t rc = pie_list_exports(F);
    if (rc >= 0) rc = pie_future_wait(F, -1);
    if (rc >= 0) rc = pie_future_result(F, buf, sizeof buf);
    if (rc < 0) {
        report("list", rc);
        return;
    }
    int w = snprintf(out, sizeof out, "list=");
    uint32_t count = get_u32(buf), at = 4;
    for (uint32_t i = 0; i < count && at + 4 <= (uint32_t)rc; i++) {
        uint32_t nl = get_u32(buf + at);
        const char *name = (const char *)buf + at + 4;
        at += 4 + nl;
        uint32_t ml = get_u32(buf + at);
        at += 4 + ml;
        uint32_t pages = get_u32(buf + at), persistent = get_u32(buf + at + 4);
        at += 16;
        w += snprintf(out + w, sizeof out - (size_t)w, "%s%.*s:%u:%u", i ? ";" : "", (int)nl,
                      name, pages, persistent);
    }
    pie_send(out, (uint32_t)strlen(out));
}

static void do_flood(uint32_t n) {
    static uint32_t ids[256];
    for (uint32_t i = 0; i < 256; i++) ids[i] = 100000 + i;
    int32_t rc = 0;
    uint32_t i = 0;
    for (; i < n && rc >= 0; i++) {
        rc = pie_alloc_kv_pages(Q, ids, 256);
        if (rc >= 0) rc = pie_dealloc_kv_pages(Q, ids, 256);
    }
    snprintf(out, sizeof out, "flood=%d|%u|%s", rc < 0 ? rc : 0, rc < 0 ? i - 1 : n,
             rc < 0 ? last_error() : "");
    pie_send(out, (uint32_t)strlen(out));
    report("sync", settle(0));
}

static void do_wait(void) {
    if (pie_receive(F) >= 0) pie_future_wait(F, -1);
}

/* One step "op:a:b:c"; false for an unknown one. */
static int step(char *s) {
    char *op = strtok(s, ":"), *a = strtok(NULL, ":"), *b = strtok(NULL, ":"),
         *c = strtok(NULL, ":");
    if (!op) return 0;
    if (strcmp(op, "alloc") == 0 && a) report("alloc", do_alloc((uint32_t)atoi(a)));
    else if (strcmp(op, "export") == 0 && a && b && c)
        report("export", do_export(a, (uint32_t)atoi(b), (uint32_t)atoi(c)));
    else if (strcmp(op, "import") == 0 && a && b)
        report("import", do_import(a, (uint32_t)atoi(b)));
    else if (strcmp(op, "unexport") == 0 && a)
        report("unexport", settle(pie_unexport_kv_pages(Q, a, (uint32_t)strlen(a))));
    else if (strcmp(op, "list") == 0) do_list();
    else if (strcmp(op, "wait") == 0) do_wait();
    else if (strcmp(op, "flood") == 0 && a) do_flood((uint32_t)atoi(a));
    else return 0;
    return 1;
}

int main(int argc, char **argv) {
    if (pie_create_queue(Q, "", 0) < 0) return 2;
    for (int i = 1; i < argc; i++)
        if (!step(argv[i])) return 1;
    return 0;
}
