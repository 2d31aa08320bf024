/* test_lc_wasm_xlate_attack.c — tier 0's own wasm → C translator (lc_wasm_xlate.c) against
 * hostile and corner-case modules: what it must refuse (every module the WebAssembly validator
 * rejects; it may also decline valid ones, which then go to wasm2c) and, for what it accepts,
 * results equal to the spec's.
 *
 * Modules are WAT text assembled at test time by wabt's wat2wasm (--no-check for the invalid
 * ones), or raw bytes where the text format cannot say it (LEB128 encodings, section layout).
 * A semantic probe is a function $p (result i32) in a fixed module frame; _start passes its
 * result to pie.test_fail, so the outcome's message carries the value ("test_fail(N) ended the
 * instance") or the trap. The expected values are wabt's wasm-interp's (the reference
 * interpreter of the same wabt), taken once when the probes were written. Each probe runs on the
 * own translator (asserting it was used: stats.own_translations); when the outcome differs, also
 * on the wasm2c pipeline (lc_wasm_rt_opts.tier0_wasm2c), whose outcome the failure message shows. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lc_wasm.h"
#include "lc_wasm_xlate.h"
#include "test_wasm_util.h"
#include "wasm_test_host.h"

TestSuite(xlate_valid, .init = wt_setup, .fini = wt_teardown, .timeout = 120);
TestSuite(xlate_sem, .init = wt_setup, .fini = wt_teardown, .timeout = 120);

/* The module that wat2wasm makes of text (check false: --no-check, for invalid modules). */
static wt_bytes wat(const char *text, bool check) {
    char in[128], out[128], cmd[512];
    snprintf(in, sizeof in, "%s/m.wat", wt_dir);
    snprintf(out, sizeof out, "%s/m.wasm", wt_dir);
    FILE *f = fopen(in, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "wat2wasm %s --enable-all %s -o %s 2>&1", check ? "" : "--no-check",
             in, out);
    int rc = system(cmd);
    cr_assert_eq(rc, 0, "wat2wasm failed (%d) on:\n%s", rc, text);
    return wt_read_file(out);
}

/* lc_wasm_xlate's verdict on b; msg gets its reason. */
static pie_code xlate(const uint8_t *b, size_t n, char *msg, size_t cap) {
    lc_wasm_xlate_out o;
    pie_status st;
    pie_code rc = lc_wasm_xlate(b, n, "wtest", &o, &st);
    snprintf(msg, cap, "%s", rc == PIE_OK ? "translated" : st.msg);
    if (rc == PIE_OK) free(o.c);
    return rc;
}

/* An invalid module: the translator must not translate it (invalid or declined, either way no
 * C of it is compiled). */
static void expect_refused_bytes(const uint8_t *b, size_t n, const char *what) {
    char msg[PIE_STATUS_MSG_MAX];
    pie_code rc = xlate(b, n, msg, sizeof msg);
    cr_expect_neq(rc, PIE_OK, "%s: an invalid module was translated into C", what);
}

static void expect_refused(const char *text) {
    wt_bytes b = wat(text, false);
    expect_refused_bytes(b.data, b.len, text);
    free(b.data);
}

static void expect_translated(const char *text) {
    wt_bytes b = wat(text, true);
    char msg[PIE_STATUS_MSG_MAX];
    pie_code rc = xlate(b.data, b.len, msg, sizeof msg);
    cr_expect_eq(rc, PIE_OK, "a valid module was not translated (%s):\n%s", msg, text);
    free(b.data);
}

typedef struct result {
    bool loaded, own;
    lc_wasm_outcome out;
    char err[PIE_STATUS_MSG_MAX + 16];
} result;

static void run_limited(const wt_bytes *b, bool wasm2c, lc_wasm_limits lim, result *r) {
    memset(r, 0, sizeof *r);
    lc_wasm_rt_opts o = {.cache_dir = wt_dir,
                         .host_fns = wasm_test_host_fns,
                         .n_host_fns = wasm_test_host_n_fns,
                         .tier0_wasm2c = wasm2c};
    lc_wasm_rt *rt = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "rt_create: %s", st.msg);
    lc_wasm_module *m = NULL;
    if (lc_wasm_module_load(rt, b->data, b->len, &m, &st) != PIE_OK) {
        snprintf(r->err, sizeof r->err, "load: %s", st.msg);
        lc_wasm_rt_destroy(rt);
        return;
    }
    r->loaded = true;
    r->own = lc_wasm_rt_stats_get(rt).own_translations == 1;
    const char *argv[] = {"p", NULL};
    lc_wasm_instance_opts io = {.argv = argv, .argc = 1, .limits = lim};
    lc_wasm_instance *inst = NULL;
    cr_assert_eq(lc_wasm_instance_create(m, &io, &inst, &st), PIE_OK, "create: %s", st.msg);
    cr_assert_eq(lc_wasm_instance_run(inst, &r->out, &st), PIE_OK, "run: %s", st.msg);
    lc_wasm_instance_free(inst);
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    wt_dir_empty(); /* each runtime starts from an empty cache */
}

static void run_on(const wt_bytes *b, bool wasm2c, result *r) {
    run_limited(b, wasm2c, (lc_wasm_limits){0}, r);
}

static const char FRAME_HEAD[] =
    "(module (import \"pie\" \"test_fail\" (func $fail (param i32))) (memory 1 4) "
    "(table 4 funcref) (global $g (mut i32) (i32.const 0))\n";
static const char FRAME_TAIL[] = "\n (func (export \"_start\") call $p call $fail))\n";

/* The text of the module that runs body (functions with $p) in the frame. */
static char *framed(const char *body) {
    size_t n = strlen(FRAME_HEAD) + strlen(body) + strlen(FRAME_TAIL) + 1;
    char *src = malloc(n);
    cr_assert_not_null(src);
    snprintf(src, n, "%s%s%s", FRAME_HEAD, body, FRAME_TAIL);
    return src;
}

/* Runs probe body (functions with $p) in the frame on both pipelines; the own translator must
 * translate it and end with trap (LC_WASM_TRAP_HOST: text is test_fail's message). */
static void probe(const char *body, lc_wasm_trap trap, const char *text) {
    char *src = framed(body);
    wt_bytes b = wat(src, true);
    result own, ref;
    memset(&ref, 0, sizeof ref);
    run_on(&b, false, &own);
    bool ok = own.out.end == LC_WASM_TRAPPED && own.out.trap == trap &&
              (text[0] == '\0' || strstr(own.out.message, text) != NULL);
    /* on a difference, the wasm2c pipeline's outcome for the failure message (not asserted) */
    if (!ok) run_on(&b, true, &ref);
    cr_assert(own.loaded, "%s", own.err);
    cr_expect(own.own, "the own translator did not translate (or tcc refused its C) a valid "
                       "module; wasm2c's code ran instead:\n%s", src);
    cr_expect(ok, "own translator: \"%s\" (trap %d), expected trap %d \"%s\"; wasm2c pipeline: "
                  "\"%s\"\n%s",
              own.out.message, own.out.trap, trap, text, ref.loaded ? ref.out.message : ref.err,
              src);
    free(b.data);
    free(src);
}

#define PROBE(name, trap, text, body) \
    Test(xlate_sem, name) { probe(body, trap, text); }


/* ---- validation: invalid modules are never translated ----------------------------------------- */

#define M(body) "(module (memory 1) (table 2 funcref) (global $c i32 (i32.const 1)) " \
                "(global $m (mut i32) (i32.const 1)) (type $t2 (func (result i32 i32))) " \
                "(type $p2 (func (param i32 i32) (result i32))) " body \
                " (func (export \"_start\")))"

/* call_indirect through a type with two results pushes two values; a module that uses one is
 * invalid (wasm-validate: "type mismatch at end of function, expected [] but got [i32]"). */
Test(xlate_valid, call_indirect_of_a_two_result_type_pushes_two_values) {
    expect_refused(M("(func $f (result i32) i32.const 0 call_indirect (type $t2))"));
    expect_refused(M("(func $f i32.const 0 call_indirect (type $t2) drop)"));
}

Test(xlate_valid, operand_stack_underflow_is_refused) {
    expect_refused(M("(func i32.const 1 i32.add drop)"));
    expect_refused(M("(func (result i32) (block (result i32)))"));
    expect_refused(M("(func i32.const 1 (block i32.eqz drop) drop)"));    /* a block's values are its own */
    expect_refused(M("(func i32.const 1 (loop i32.eqz drop) drop)"));
    expect_refused(M("(func i32.const 1 i32.const 1 (if (then drop)) drop)"));
    expect_refused(M("(func i32.const 1 i32.const 1 (if (then) (else drop)) drop)"));
    expect_refused(M("(func (result i32) (block (type $p2) i32.add))"));  /* params missing */
    expect_refused(M("(func (result i32) i32.const 1 (block (type $p2) i32.add))"));
    expect_refused(M("(func drop)"));
    expect_refused(M("(func i32.const 0 select drop)"));
    expect_refused(M("(func (result i32) return)"));
    expect_refused(M("(func (result i32) (block (result i32) br 0))"));
    expect_refused(M("(func (block (result i32) i32.const 0 br_if 0) drop)"));
    expect_refused(M("(func (result i32) (block (result i32) i32.const 0 br_table 0))"));
    expect_refused(M("(func i32.const 0 local.set 0)"));
    expect_refused(M("(func (param i32) local.set 0)"));
    expect_refused(M("(func global.set $m)"));
    expect_refused(M("(func i32.store)"));
    expect_refused(M("(func i32.const 0 memory.fill)"));
}

Test(xlate_valid, type_mismatches_are_refused) {
    expect_refused(M("(func i32.const 1 i64.const 1 i32.add drop)"));
    expect_refused(M("(func (result i32) i64.const 1)"));
    expect_refused(M("(func (result i32) (block (result i32) f32.const 1))"));
    expect_refused(M("(func (result i32) (block (result i64) i32.const 1 br 0) drop i32.const 0)"));
    expect_refused(M("(func (result i32) (block (result i32) i64.const 1 i32.const 1 br_if 0 drop i32.const 0))"));
    expect_refused(M("(func (result i32) (block (result i32) (block (result f32) i32.const 0 i32.const 0 br_table 0 1) drop i32.const 0))"));
    expect_refused(M("(func (result i32) (block (result i32) (block i32.const 0 i32.const 0 br_table 0 1)) i32.const 0)"));
    expect_refused(M("(func (result i32) i32.const 1 i64.const 2 i32.const 1 select)"));
    expect_refused(M("(func (result i32) i32.const 1 i32.const 2 i64.const 1 select)"));
    expect_refused(M("(func (result i32) f32.const 1 f32.const 2 i32.const 1 select (result i32))"));
    expect_refused(M("(func (local i64) i32.const 1 local.set 0)"));
    expect_refused(M("(func (local i64) i32.const 1 local.tee 0 drop)"));
    expect_refused(M("(func i64.const 1 global.set $m)"));
    expect_refused(M("(func (result i32) i32.const 1 (if (result i32) (then i32.const 1) (else i64.const 1)))"));
    expect_refused(M("(func (result i32) i32.const 1 (if (result i32) (then i32.const 1)))")); /* no else */
    expect_refused(M("(func (result i64) i32.const 1 (if (result i64) (then unreachable)))"));
    expect_refused(M("(func f32.const 0 i32.const 0 call_indirect (type $p2) drop)"));
    expect_refused(M("(func i64.const 0 i32.load drop)"));
    expect_refused(M("(func i32.const 0 i64.const 0 i32.store)"));
    expect_refused(M("(func i64.const 0 memory.grow drop)"));
    expect_refused(M("(func (result i32) i64.const 0 (loop (param i32) (result i32)))"));
    expect_refused(M("(func (result i32) i32.const 0 (loop (param i32) (result i32) i64.const 0 br 0))"));
}

/* After unreachable, br, br_table and return the stack is polymorphic: missing operands are
 * any type, but the values that are there keep their types. */
Test(xlate_valid, unreachable_code_is_still_typed) {
    expect_refused(M("(func unreachable i32.const 0 i64.add drop)"));
    expect_refused(M("(func (result i32) unreachable i64.const 0)"));
    expect_refused(M("(func (result i32) (block (result i32) i32.const 0 br 0 i64.const 0))"));
    expect_refused(M("(func (result i32) return f32.const 0 i32.add)"));
    expect_refused(M("(func unreachable i32.const 0 i64.const 0 i32.const 1 select drop)"));
    expect_refused(M("(func unreachable (block (result i32) i64.const 0) drop)"));
    expect_refused(M("(func unreachable (block i32.const 0) )"));
    expect_refused(M("(func (result i32) unreachable (if (result i32) (then i32.const 0)))"));
    expect_refused(M("(func unreachable i64.const 0 br_if 0)"));
    expect_refused(M("(func (block (result i32) unreachable i64.const 0 br_if 0) drop)"));
    expect_refused(M("(func (block (result i32) (block (result f32) unreachable br_table 0 1) drop))"));
    expect_refused(M("(func (result i32) (block (result i32) (block unreachable i32.const 0 br_table 0 1)) i32.const 0)"));
    expect_refused(M("(func unreachable f32.const 0 local.set 99)"));
    expect_refused(M("(func unreachable call 99)"));
    expect_refused(M("(func unreachable global.set $c)"));
    expect_refused(M("(func unreachable br 5)"));
    expect_refused(M("(func unreachable i32.load align=8 drop)"));
    /* and valid polymorphic code is accepted */
    expect_translated(M("(func (result i32) unreachable)"));
    expect_translated(M("(func (result i32) unreachable select)"));
    expect_translated(M("(func (result i32) unreachable select i64.eqz)"));
    expect_translated(M("(func (result i32) (block (result i32) (block (result f32) unreachable br_table 0 0) drop i32.const 0))"));
    expect_translated(M("(func (result i32) (block (result i32) (loop (result f32) unreachable br_table 1 1) drop i32.const 0))"));
    expect_translated(M("(func (result i32) unreachable (block (type $p2) i32.add))"));
    expect_translated(M("(func (result i32) unreachable i32.const 0 br_if 0)"));
    expect_translated(M("(func (result i32) i32.const 0 (if (result i32) (then unreachable) (else i32.const 1)))"));
}

Test(xlate_valid, indices_out_of_range_are_refused) {
    expect_refused(M("(func (local i32) local.get 1 drop)"));
    expect_refused(M("(func (param i32) local.get 1 drop)"));
    expect_refused(M("(func global.get 2 drop)"));
    expect_refused(M("(func call 99)"));
    expect_refused(M("(func i32.const 0 call_indirect (type 99))"));
    expect_refused(M("(func br 1)"));
    expect_refused(M("(func (block i32.const 0 br_table 0 2))"));
    expect_refused(M("(func global.set $c)")); /* immutable */
    expect_refused(M("(elem (i32.const 0) 99)"));
    expect_refused(M("(start 99)"));
    expect_refused("(module (func $s (param i32)) (start $s) (func (export \"_start\")))");
    expect_refused("(module (func $s (result i32) i32.const 0) (start $s) (func (export \"_start\")))");
    expect_refused("(module (func (export \"_start\")) (export \"x\" (func 5)))");
    expect_refused("(module (func (export \"_start\")) (export \"x\" (global 0)))");
    expect_refused("(module (func (export \"_start\")) (export \"x\" (memory 0)))");
    expect_refused("(module (func (export \"_start\")) (export \"x\" (table 0)))");
    expect_refused("(module (func (export \"_start\")) (export \"_start\" (func 0)))");
}

Test(xlate_valid, memory_and_table_rules_are_enforced) {
    expect_refused("(module (func (export \"_start\") i32.const 0 i32.load drop))");
    expect_refused("(module (func (export \"_start\") memory.size drop))");
    expect_refused("(module (func (export \"_start\") i32.const 0 memory.grow drop))");
    expect_refused("(module (func (export \"_start\") i32.const 0 i32.const 0 i32.const 0 memory.copy))");
    expect_refused("(module (func (export \"_start\") i32.const 0 call_indirect (type 0)))");
    expect_refused("(module (data (i32.const 0) \"a\") (func (export \"_start\")))");
    expect_refused("(module (elem (i32.const 0) 0) (func (export \"_start\")))");
    expect_refused(M("(func i32.const 0 i32.load align=8 drop)"));
    expect_refused(M("(func i32.const 0 i64.load align=16 drop)"));
    expect_refused(M("(func i32.const 0 i32.load8_u align=2 drop)"));
    expect_refused(M("(func i32.const 0 i32.const 0 i32.store16 align=4)"));
    expect_refused(M("(func i32.const 0 i64.const 0 i64.store32 align=8)"));
    expect_refused("(module (memory 2 1) (func (export \"_start\")))");
    expect_refused("(module (memory 65537) (func (export \"_start\")))");
    expect_refused("(module (table 2 1 funcref) (func (export \"_start\")))");
    expect_refused("(module (memory 1) (data (i64.const 0) \"a\") (func (export \"_start\")))");
    expect_refused("(module (memory 1) (data (f32.const 0) \"a\") (func (export \"_start\")))");
    expect_refused("(module (global i32 (i64.const 0)) (func (export \"_start\")))");
    expect_refused("(module (global (mut f32) (f64.const 0)) (func (export \"_start\")))");
    expect_refused("(module (global i32 (global.get 0)) (func (export \"_start\")))");
}

/* ---- validation of the binary encoding ---------------------------------------------------------- */

#define HDR 0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00
#define TYPES 0x01, 0x04, 0x01, 0x60, 0x00, 0x00                                   /* () -> () */
#define FUNCS 0x03, 0x02, 0x01, 0x00                                               /* 1 of type 0 */
#define EXPORT 0x07, 0x0a, 0x01, 0x06, '_', 's', 't', 'a', 'r', 't', 0x00, 0x00 /* func 0 */
#define CODE 0x0a, 0x04, 0x01, 0x02, 0x00, 0x0b                                    /* empty body */
#define REFUSED(...)                                                   \
    do {                                                               \
        static const uint8_t m_[] = {__VA_ARGS__};                     \
        expect_refused_bytes(m_, sizeof m_, #__VA_ARGS__);             \
    } while (0)

Test(xlate_valid, the_minimal_module_is_translated) {
    static const uint8_t m[] = {HDR, TYPES, FUNCS, EXPORT, CODE};
    char msg[PIE_STATUS_MSG_MAX];
    cr_expect_eq(xlate(m, sizeof m, msg, sizeof msg), PIE_OK, "%s", msg);
}

Test(xlate_valid, leb128_too_long_or_too_large_is_refused) {
    /* a function's type index in 6 bytes (u32: at most 5) */
    REFUSED(HDR, TYPES, 0x03, 0x07, 0x01, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00, EXPORT, CODE);
    /* 2^32 in 5 bytes: unused bits set */
    REFUSED(HDR, TYPES, 0x03, 0x06, 0x01, 0x80, 0x80, 0x80, 0x80, 0x10, EXPORT, CODE);
    /* i32.const whose 5th byte's sign bits disagree (0x0f, 0x70) */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x0a, 0x01, 0x08, 0x00, 0x41, 0xff, 0xff, 0xff, 0xff,
            0x0f, 0x1a, 0x0b);
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x0a, 0x01, 0x08, 0x00, 0x41, 0x80, 0x80, 0x80, 0x80,
            0x70, 0x1a, 0x0b);
    /* i64.const in 11 bytes */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x10, 0x01, 0x0e, 0x00, 0x42, 0x80, 0x80, 0x80, 0x80,
            0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 0x1a, 0x0b);
    /* i64.const: 10th byte with sign bits that disagree */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x0f, 0x01, 0x0d, 0x00, 0x42, 0x80, 0x80, 0x80, 0x80,
            0x80, 0x80, 0x80, 0x80, 0x80, 0x02, 0x1a, 0x0b);
    /* a section size in 6 bytes */
    REFUSED(HDR, 0x01, 0x84, 0x80, 0x80, 0x80, 0x80, 0x00, 0x01, 0x60, 0x00, 0x00, FUNCS, EXPORT,
            CODE);
    /* a block type index of 6 bytes (s33: at most 5) */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x0c, 0x01, 0x0a, 0x00, 0x02, 0x80, 0x80, 0x80, 0x80,
            0x80, 0x00, 0x0b, 0x0b);
}

Test(xlate_valid, section_layout_errors_are_refused) {
    REFUSED(HDR, TYPES, EXPORT, FUNCS, CODE);             /* out of order */
    REFUSED(HDR, TYPES, TYPES, FUNCS, EXPORT, CODE);      /* repeated */
    REFUSED(HDR, TYPES, FUNCS, EXPORT);                   /* a function without a body */
    REFUSED(HDR, TYPES, EXPORT, CODE);                    /* a body without a function */
    REFUSED(HDR, TYPES, 0x03, 0x03, 0x02, 0x00, 0x00, EXPORT, CODE); /* 2 functions, 1 body */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, CODE, 0x0d, 0x00); /* unknown section 13 */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x05, 0x01, 0x02, 0x00, 0x0b); /* section too short */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x05, 0x01, 0x03, 0x00, 0x0b, 0x0b); /* after end */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x05, 0x01, 0x03, 0x00, 0x02, 0x40); /* no end */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x06, 0x01, 0x02, 0x00, 0x0b, 0x00, 0x00); /* left over */
    REFUSED(HDR, TYPES, FUNCS, 0x07, 0x0a, 0x01, 0x06, '_', 's', 't', 0xff, 'r', 't', 0x00, 0x00,
            CODE);                                        /* export name not UTF-8 */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x07, 0x01, 0x05, 0x00, 0x3f, 0x01, 0x1a, 0x0b);
    /* locals: two groups of 2^32-1 */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x10, 0x01, 0x0e, 0x02, 0xff, 0xff, 0xff, 0xff, 0x0f,
            0x7f, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x7f, 0x0b);
    /* a value type that does not exist (0x7a) in a type, a local, a block */
    REFUSED(HDR, 0x01, 0x05, 0x01, 0x60, 0x01, 0x7a, 0x00, FUNCS, EXPORT, CODE);
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x06, 0x01, 0x04, 0x01, 0x01, 0x7a, 0x0b);
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x07, 0x01, 0x05, 0x00, 0x02, 0x7a, 0x0b, 0x0b);
    /* a block type index past the type section (99, as s33) */
    REFUSED(HDR, TYPES, FUNCS, EXPORT, 0x0a, 0x08, 0x01, 0x06, 0x00, 0x02, 0xe3, 0x00, 0x0b, 0x0b);
    /* memory.size's and call_indirect's reserved index bytes */
    REFUSED(HDR, TYPES, FUNCS, 0x05, 0x03, 0x01, 0x00, 0x01, EXPORT, 0x0a, 0x07, 0x01, 0x05, 0x00,
            0x3f, 0x80, 0x00, 0x1a, 0x0b);
    REFUSED(HDR, TYPES, FUNCS, 0x04, 0x04, 0x01, 0x70, 0x00, 0x01, EXPORT, 0x0a, 0x08, 0x01, 0x06,
            0x00, 0x41, 0x00, 0x11, 0x00, 0x01, 0x0b);
}

/* The data count section must equal the data section's count, also when there is no data
 * section (then 0). */
Test(xlate_valid, data_count_without_a_data_section_is_refused) {
    REFUSED(HDR, TYPES, FUNCS, 0x05, 0x03, 0x01, 0x00, 0x01, EXPORT, 0x0c, 0x01, 0x01, CODE);
}

/* wasm-validate's verdict (wabt) on n bytes. */
static bool wabt_valid(const uint8_t *b, size_t n) {
    char path[128], cmd[256];
    snprintf(path, sizeof path, "%s/v.wasm", wt_dir);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    fwrite(b, 1, n, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "wasm-validate --enable-all --ignore-custom-section-errors %s >/dev/null 2>&1", path);
    return system(cmd) == 0;
}

/* Every prefix of a valid module that the translator accepts is a valid module (a prefix that
 * ends at a section boundary can be); truncated sections are refused. */
Test(xlate_valid, every_truncation_is_refused_unless_valid) {
    wt_bytes b = wat("(module (import \"pie\" \"test_fail\" (func $f (param i32))) (memory 1 2) "
                  "(table 2 funcref) (global $g (mut i64) (i64.const -5)) "
                  "(type $t (func (param i32) (result i32))) "
                  "(func $a (type $t) local.get 0 i32.const 1 i32.add) (elem (i32.const 0) $a) "
                  "(func (export \"_start\") (local f64) i32.const 7 i32.const 0 "
                  "call_indirect (type $t) call $f) (data (i32.const 8) \"xyz\"))",
                  true);
    char msg[PIE_STATUS_MSG_MAX];
    cr_assert_eq(xlate(b.data, b.len, msg, sizeof msg), PIE_OK, "%s", msg);
    for (size_t n = 0; n < b.len; n++)
        if (xlate(b.data, n, msg, sizeof msg) == PIE_OK)
            cr_expect(wabt_valid(b.data, n), "the first %zu of %zu bytes (invalid) were translated",
                      n, b.len);
    free(b.data);
}

/* Single-byte mutations of a valid module: whatever the translator accepts, wasm-validate
 * accepts. */
Test(xlate_valid, byte_mutations_accepted_only_if_valid) {
    wt_bytes b = wat("(module (import \"pie\" \"test_fail\" (func $f (param i32))) (memory 1 2) "
                  "(table 2 funcref) (global $g (mut i64) (i64.const -5)) "
                  "(type $t (func (param i32) (result i32))) (type $bt (func (param i32) (result i32 i32))) "
                  "(func $a (type $t) (local i64 f32) local.get 0 i32.const 1 i32.add "
                  "(block (type $bt) i32.const 2 (if (type $t) (then i32.const 3 i32.mul) (else i32.const 4 i32.sub)) i32.const 5 i32.const 0 (br_table 0 0)) "
                  "i32.add (loop (result i32) i32.const 9 br_if 0 i32.const 1) i32.add) (elem (i32.const 0) $a) "
                  "(func (export \"_start\") (local f64) i32.const 7 i32.const 0 "
                  "call_indirect (type $t) global.get $g i32.wrap_i64 i32.add i32.const 4 i32.load offset=4 align=2 i32.add call $f) (data (i32.const 8) \"xyz\"))",
                  true);
    static const uint8_t vals[] = {0x00, 0x01, 0x02, 0x0b, 0x40, 0x7f, 0x7e, 0x7c, 0x80, 0xff};
    char msg[PIE_STATUS_MSG_MAX];
    uint8_t *m = malloc(b.len);
    int accepted_invalid = 0;
    for (size_t i = 8; i < b.len; i++)
        for (size_t k = 0; k < sizeof vals; k++) {
            if (vals[k] == b.data[i]) continue;
            memcpy(m, b.data, b.len);
            m[i] = vals[k];
            if (xlate(m, b.len, msg, sizeof msg) == PIE_OK && !wabt_valid(m, b.len)) {
                cr_expect(false, "byte %zu set to 0x%02x: invalid, and translated", i, vals[k]);
                if (++accepted_invalid > 10) goto out;
            }
        }
out:
    free(m);
    free(b.data);
}

/* ---- semantics: values and traps equal the spec's (wasm-interp's) ------------------------------ */

PROBE(f32_neg_zero_const, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f32.const -0.0 i32.reinterpret_f32)")
PROBE(f64_neg_zero_const, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f64.const -0.0 i64.reinterpret_f64 i64.const 32 i64.shr_u "
          "i32.wrap_i64)")
PROBE(f32_min_subnormal_const, LC_WASM_TRAP_HOST, "test_fail(1) ended the instance",
      "(func $p (result i32) f32.const 0x1p-149 i32.reinterpret_f32)")
PROBE(f64_min_subnormal_const, LC_WASM_TRAP_HOST, "test_fail(1) ended the instance",
      "(func $p (result i32) f64.const 0x0.0000000000001p-1022 i64.reinterpret_f64 i32."
          "wrap_i64)")
PROBE(f32_max_const, LC_WASM_TRAP_HOST, "test_fail(2139095039) ended the instance",
      "(func $p (result i32) f32.const 0x1.fffffep+127 i32.reinterpret_f32)")
PROBE(f32_snan_const_keeps_payload, LC_WASM_TRAP_HOST, "test_fail(2139095041) ended the instance",
      "(func $p (result i32) f32.const nan:0x1 i32.reinterpret_f32)")
PROBE(f32_neg_snan_const_keeps_payload, LC_WASM_TRAP_HOST, "test_fail(4288675841) ended the instance",
      "(func $p (result i32) f32.const -nan:0x200001 i32.reinterpret_f32)")
PROBE(f64_snan_const_keeps_payload, LC_WASM_TRAP_HOST, "test_fail(1) ended the instance",
      "(func $p (result i32) f64.const -nan:0x1 i64.reinterpret_f64 i64.const 0xfff0000"
          "000000000 i64.xor i32.wrap_i64)")
PROBE(f32_inf_const, LC_WASM_TRAP_HOST, "test_fail(4286578688) ended the instance",
      "(func $p (result i32) f32.const -inf i32.reinterpret_f32)")
PROBE(f32_snan_through_memory, LC_WASM_TRAP_HOST, "test_fail(2139095041) ended the instance",
      "(func $p (result i32) i32.const 8 f32.const nan:0x1 f32.store i32.const 8 i32.lo"
          "ad)")
PROBE(f32_snan_through_local, LC_WASM_TRAP_HOST, "test_fail(2139095041) ended the instance",
      "(func $p (result i32) (local f32) f32.const nan:0x1 local.set 0 local.get 0 i32."
          "reinterpret_f32)")
PROBE(f32_snan_through_call, LC_WASM_TRAP_HOST, "test_fail(2139095041) ended the instance",
      "(func $id (param f32) (result f32) local.get 0) (func $p (result i32) f32.const "
          "nan:0x1 call $id i32.reinterpret_f32)")
PROBE(f32_neg_flips_nan_sign, LC_WASM_TRAP_HOST, "test_fail(4288675840) ended the instance",
      "(func $p (result i32) f32.const nan:0x200000 f32.neg i32.reinterpret_f32)")
PROBE(f64_neg_flips_nan_sign, LC_WASM_TRAP_HOST, "test_fail(4294443008) ended the instance",
      "(func $p (result i32) f64.const nan f64.neg i64.reinterpret_f64 i64.const 32 i64"
          ".shr_u i32.wrap_i64)")
PROBE(f32_neg_of_zero, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) (local f32) local.get 0 f32.neg i32.reinterpret_f32)")
PROBE(f32_abs_clears_nan_sign, LC_WASM_TRAP_HOST, "test_fail(2139095041) ended the instance",
      "(func $p (result i32) f32.const -nan:0x1 f32.abs i32.reinterpret_f32)")
PROBE(f32_copysign_nan_sign, LC_WASM_TRAP_HOST, "test_fail(3212836864) ended the instance",
      "(func $p (result i32) f32.const 1 f32.const -nan f32.copysign i32.reinterpret_f3"
          "2)")
PROBE(f32_min_neg_zero, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f32.const 0 f32.const -0 f32.min i32.reinterpret_f32)")
PROBE(f64_max_neg_zero, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) f64.const -0 f64.const 0 f64.max i64.reinterpret_f64 i64.c"
          "onst 32 i64.shr_u i32.wrap_i64)")
PROBE(f32_nearest_half_even, LC_WASM_TRAP_HOST, "test_fail(42) ended the instance",
      "(func $p (result i32) f32.const 2.5 f32.nearest i32.trunc_f32_s f32.const 3.5 f3"
          "2.nearest i32.trunc_f32_s i32.const 10 i32.mul i32.add)")
PROBE(f64_nearest_neg_half, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f64.const -0.5 f64.nearest i64.reinterpret_f64 i64.const 3"
          "2 i64.shr_u i32.wrap_i64)")
PROBE(f32_convert_u64_max, LC_WASM_TRAP_HOST, "test_fail(1602224128) ended the instance",
      "(func $p (result i32) i64.const -1 f32.convert_i64_u i32.reinterpret_f32)")
PROBE(f32_convert_u64_double_rounding, LC_WASM_TRAP_HOST, "test_fail(1593835521) ended the instance",
      "(func $p (result i32) i64.const 0x8000008000000001 f32.convert_i64_u i32.reinter"
          "pret_f32)")
PROBE(f32_convert_s64_double_rounding, LC_WASM_TRAP_HOST, "test_fail(1509949441) ended the instance",
      "(func $p (result i32) i64.const 0x0020000020000001 f32.convert_i64_s i32.reinter"
          "pret_f32)")
PROBE(f64_convert_u64_high, LC_WASM_TRAP_HOST, "test_fail(1) ended the instance",
      "(func $p (result i32) i64.const 0x8000000000000401 f64.convert_i64_u i64.reinter"
          "pret_f64 i32.wrap_i64)")
PROBE(f32_convert_u32_max, LC_WASM_TRAP_HOST, "test_fail(1333788672) ended the instance",
      "(func $p (result i32) i32.const -1 f32.convert_i32_u i32.reinterpret_f32)")
PROBE(f64_convert_u32_max, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(func $p (result i32) i32.const -1 f64.convert_i32_u i32.trunc_f64_u)")
PROBE(f32_demote_rounding, LC_WASM_TRAP_HOST, "test_fail(1065353216) ended the instance",
      "(func $p (result i32) f64.const 0x1.000001p+0 f32.demote_f64 i32.reinterpret_f32"
          ")")
PROBE(trunc_f64_u64_above_2p63, LC_WASM_TRAP_HOST, "test_fail(4190951585) ended the instance",
      "(func $p (result i32) f64.const 1.8e19 i64.trunc_f64_u i64.const 32 i64.shr_u i3"
          "2.wrap_i64)")
PROBE(trunc_f32_u64_above_2p63, LC_WASM_TRAP_HOST, "test_fail(4190951680) ended the instance",
      "(func $p (result i32) f32.const 1.8e19 i64.trunc_f32_u i64.const 32 i64.shr_u i3"
          "2.wrap_i64)")
PROBE(trunc_sat_f64_u64_above_2p63, LC_WASM_TRAP_HOST, "test_fail(4190951585) ended the instance",
      "(func $p (result i32) f64.const 1.8e19 i64.trunc_sat_f64_u i64.const 32 i64.shr_"
          "u i32.wrap_i64)")
PROBE(trunc_f32_s32_int_min_ok, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f32.const -2147483648 i32.trunc_f32_s)")
PROBE(trunc_f64_s32_just_below_min_ok, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f64.const -2147483648.9 i32.trunc_f64_s)")
PROBE(trunc_f64_s32_min_minus_one_traps, LC_WASM_TRAP_INT_OVERFLOW, "",
      "(func $p (result i32) f64.const -2147483649 i32.trunc_f64_s)")
PROBE(trunc_f32_u32_minus_0_9_ok, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) f32.const -0.9 i32.trunc_f32_u)")
PROBE(trunc_f32_u32_2p32_traps, LC_WASM_TRAP_INT_OVERFLOW, "",
      "(func $p (result i32) f32.const 4294967296 i32.trunc_f32_u)")
PROBE(trunc_nan_traps, LC_WASM_TRAP_INVALID_CONVERSION, "",
      "(func $p (result i32) f32.const nan i32.trunc_f32_s)")
PROBE(trunc_sat_nan_is_0, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) f32.const nan i32.trunc_sat_f32_s)")
PROBE(trunc_sat_neg_inf, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f64.const -inf i32.trunc_sat_f64_s)")
PROBE(trunc_sat_u_neg, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) f64.const -5 i32.trunc_sat_f64_u)")
PROBE(trunc_sat_s64_big, LC_WASM_TRAP_HOST, "test_fail(2147483647) ended the instance",
      "(func $p (result i32) f32.const 1e30 i64.trunc_sat_f32_s i64.const 32 i64.shr_u "
          "i32.wrap_i64)")
PROBE(div_s_int_min_by_minus_1_traps, LC_WASM_TRAP_INT_OVERFLOW, "",
      "(func $p (result i32) i32.const 0x80000000 i32.const -1 i32.div_s)")
PROBE(rem_s_int_min_by_minus_1_is_0, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) i32.const 0x80000000 i32.const -1 i32.rem_s)")
PROBE(rem_s64_int_min_by_minus_1_is_0, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) i64.const 0x8000000000000000 i64.const -1 i64.rem_s i32.wr"
          "ap_i64)")
PROBE(div_s64_overflow_traps, LC_WASM_TRAP_INT_OVERFLOW, "",
      "(func $p (result i32) i64.const 0x8000000000000000 i64.const -1 i64.div_s i32.wr"
          "ap_i64)")
PROBE(div_u_by_zero_traps, LC_WASM_TRAP_DIV_BY_ZERO, "",
      "(func $p (result i32) i32.const 1 i32.const 0 i32.div_u)")
PROBE(rem_s_negative, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(func $p (result i32) i32.const -7 i32.const 2 i32.rem_s)")
PROBE(dropped_div_by_zero_still_traps, LC_WASM_TRAP_DIV_BY_ZERO, "",
      "(func $p (result i32) i32.const 1 i32.const 0 i32.div_s drop i32.const 5)")
PROBE(shl_by_33, LC_WASM_TRAP_HOST, "test_fail(2) ended the instance",
      "(func $p (result i32) i32.const 1 i32.const 33 i32.shl)")
PROBE(shr_s_by_minus_1, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(func $p (result i32) i32.const 0x80000000 i32.const -1 i32.shr_s)")
PROBE(shr_u64_by_65, LC_WASM_TRAP_HOST, "test_fail(2) ended the instance",
      "(func $p (result i32) i64.const 4 i64.const 65 i64.shr_u i32.wrap_i64)")
PROBE(rotl_by_37, LC_WASM_TRAP_HOST, "test_fail(48) ended the instance",
      "(func $p (result i32) i32.const 0x80000001 i32.const 37 i32.rotl)")
PROBE(rotr64_by_65, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) i64.const 1 i64.const 65 i64.rotr i64.const 32 i64.shr_u i"
          "32.wrap_i64)")
PROBE(rotl_by_0, LC_WASM_TRAP_HOST, "test_fail(305419896) ended the instance",
      "(func $p (result i32) i32.const 0x12345678 i32.const 32 i32.rotl)")
PROBE(clz_ctz_popcnt, LC_WASM_TRAP_HOST, "test_fail(160) ended the instance",
      "(func $p (result i32) i32.const 0 i32.clz i32.const 0 i32.ctz i32.add i32.const "
          "-1 i32.popcnt i32.add i64.const 0 i64.clz i32.wrap_i64 i32.add)")
PROBE(mul_wraps, LC_WASM_TRAP_HOST, "test_fail(131073) ended the instance",
      "(func $p (result i32) i32.const 0x10001 i32.const 0x10001 i32.mul)")
PROBE(signed_compare, LC_WASM_TRAP_HOST, "test_fail(1) ended the instance",
      "(func $p (result i32) i32.const -1 i32.const 1 i32.lt_s i32.const -1 i32.const 1"
          " i32.lt_u i32.const 2 i32.mul i32.add)")
PROBE(i64_signed_compare, LC_WASM_TRAP_HOST, "test_fail(2) ended the instance",
      "(func $p (result i32) i64.const -1 i64.const 1 i64.gt_s i64.const -1 i64.const 1"
          " i64.gt_u i32.const 2 i32.mul i32.add)")
PROBE(extend_i32_s, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(func $p (result i32) i32.const -2 i64.extend_i32_s i64.const 32 i64.shr_u i32.w"
          "rap_i64)")
PROBE(extend_i32_u, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) i32.const -2 i64.extend_i32_u i64.const 32 i64.shr_u i32.w"
          "rap_i64)")
PROBE(sign_ext_ops, LC_WASM_TRAP_HOST, "test_fail(4294934655) ended the instance",
      "(func $p (result i32) i32.const 0x80 i32.extend8_s i32.const 0x8000 i32.extend16"
          "_s i32.xor i64.const 0x80000000 i64.extend32_s i64.const 32 i64.shr_u i32.wrap_i"
          "64 i32.xor)")
PROBE(i64_const_sign, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) i64.const -0x7fffffffffffffff i64.const 32 i64.shr_u i32.w"
          "rap_i64)")
PROBE(load8_s_sign_extends_to_i64, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(func $p (result i32) i32.const 0 i32.const 0xff i32.store8 i32.const 0 i64.load"
          "8_s i64.const 32 i64.shr_u i32.wrap_i64)")
PROBE(load32_u_zero_extends, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) i32.const 0 i32.const -1 i32.store i32.const 0 i64.load32_"
          "u i64.const 32 i64.shr_u i32.wrap_i64)")
PROBE(load_offset_beyond_memory_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 0 i32.load offset=65536)")
PROBE(load_max_addr_max_offset_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const -1 i64.load offset=0xffffffff i32.wrap_i64)")
PROBE(store_max_addr_max_offset_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const -1 i64.const 1 i64.store offset=0xffffffff i32.c"
          "onst 0)")
PROBE(load_last_bytes_ok, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) i32.const 65532 i32.load)")
PROBE(order_load_then_local_tee, LC_WASM_TRAP_HOST, "test_fail(97) ended the instance",
      "(func $p (result i32) (local i32) i32.const 0 i32.const 7 i32.store i32.const 4 "
          "i32.const 9 i32.store local.get 0 i32.load i32.const 4 local.tee 0 i32.load i32."
          "const 10 i32.mul i32.add)")
PROBE(order_local_get_then_set, LC_WASM_TRAP_HOST, "test_fail(53) ended the instance",
      "(func $p (result i32) (local i32) i32.const 3 local.set 0 local.get 0 i32.const "
          "5 local.set 0 local.get 0 i32.const 10 i32.mul i32.add)")
PROBE(order_call_result_then_store, LC_WASM_TRAP_HOST, "test_fail(21) ended the instance",
      "(func $rd (result i32) i32.const 0 i32.load) (func $p (result i32) i32.const 0 i"
          "32.const 1 i32.store call $rd i32.const 0 i32.const 2 i32.store call $rd i32.con"
          "st 10 i32.mul i32.add)")
PROBE(order_global_get_around_call, LC_WASM_TRAP_HOST, "test_fail(52) ended the instance",
      "(func $set (result i32) i32.const 5 global.set $g i32.const 0) (func $p (result "
          "i32) i32.const 2 global.set $g global.get $g call $set i32.add global.get $g i32"
          ".const 10 i32.mul i32.add)")
PROBE(order_load_then_grow_size, LC_WASM_TRAP_HOST, "test_fail(21) ended the instance",
      "(func $p (result i32) memory.size i32.const 1 memory.grow drop memory.size i32.c"
          "onst 10 i32.mul i32.add)")
PROBE(order_load_oob_before_div_zero, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const -4 i32.load i32.const 1 i32.const 0 i32.div_s i3"
          "2.add)")
PROBE(order_div_zero_before_load_oob, LC_WASM_TRAP_DIV_BY_ZERO, "",
      "(func $p (result i32) i32.const 1 i32.const 0 i32.div_s i32.const -4 i32.load i3"
          "2.add)")
PROBE(order_trunc_trap_before_load, LC_WASM_TRAP_INVALID_CONVERSION, "",
      "(func $p (result i32) f32.const nan i32.trunc_f32_s i32.const -4 i32.load i32.ad"
          "d)")
PROBE(order_store_value_trap_before_store, LC_WASM_TRAP_DIV_BY_ZERO, "",
      "(func $p (result i32) i32.const -4 i32.const 1 i32.const 0 i32.div_u i32.store i"
          "32.const 0)")
PROBE(order_call_indirect_arg_before_index, LC_WASM_TRAP_OOB, "",
      "(type $ti (func (param i32) (result i32))) (func $p (result i32) i32.const -4 i3"
          "2.load i32.const 99 call_indirect (type $ti))")
PROBE(order_call_indirect_index_expr_before_check, LC_WASM_TRAP_DIV_BY_ZERO, "",
      "(type $ti (func (param i32) (result i32))) (func $p (result i32) i32.const 1 i32"
          ".const 1 i32.const 0 i32.div_u call_indirect (type $ti))")
PROBE(order_select_both_arms_evaluated, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 1 i32.const -4 i32.load i32.const 1 select)")
PROBE(order_select_cond_traps, LC_WASM_TRAP_DIV_BY_ZERO, "",
      "(func $p (result i32) i32.const 1 i32.const 2 i32.const 1 i32.const 0 i32.div_u "
          "select)")
PROBE(order_load_discarded_by_br, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) (block (result i32) i32.const -4 i32.load i32.const 3 br 0"
          "))")
PROBE(order_load_discarded_by_br_if, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) (block (result i32) i32.const -4 i32.load drop i32.const 3"
          " i32.const 1 br_if 0))")
PROBE(order_load_below_return, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const -4 i32.load i32.const 3 return)")
PROBE(order_call_below_return, LC_WASM_TRAP_HOST, "test_fail(77) ended the instance",
      "(func $side (result i32) i32.const 77 call $fail i32.const 0) (func $p (result i"
          "32) call $side i32.const 3 return)")
PROBE(order_load_below_br_table, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) (block (result i32) i32.const -4 i32.load i32.const 3 i32."
          "const 0 br_table 0 0))")
PROBE(order_load_below_unreachable, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const -4 i32.load unreachable)")
PROBE(order_memory_fill_then_load, LC_WASM_TRAP_HOST, "test_fail(2880154539) ended the instance",
      "(func $p (result i32) i32.const 0 i32.load i32.const 0 i32.const 0xab i32.const "
          "4 memory.fill i32.const 0 i32.load i32.add)")
PROBE(order_call_then_call_args, LC_WASM_TRAP_HOST, "test_fail(321) ended the instance",
      "(func $inc (result i32) global.get $g i32.const 1 i32.add global.set $g global.g"
          "et $g) (func $p (result i32) call $inc call $inc i32.const 10 i32.mul i32.add ca"
          "ll $inc i32.const 100 i32.mul i32.add)")
PROBE(order_local_tee_in_call_args, LC_WASM_TRAP_HOST, "test_fail(35) ended the instance",
      "(func $two (param i32 i32) (result i32) local.get 0 i32.const 10 i32.mul local.g"
          "et 1 i32.add) (func $p (result i32) (local i32) i32.const 3 local.set 0 local.ge"
          "t 0 i32.const 5 local.tee 0 call $two)")
PROBE(order_br_if_keeps_values, LC_WASM_TRAP_HOST, "test_fail(5) ended the instance",
      "(func $p (result i32) (local i32) (block (result i32) i32.const 4 local.get 0 br"
          "_if 0 i32.const 1 local.set 0 local.get 0 i32.add))")
PROBE(memory_copy_overlap_forward, LC_WASM_TRAP_HOST, "test_fail(67305985) ended the instance",
      "(data (i32.const 0) \"\\01\\02\\03\\04\\05\") (func $p (result i32) i32.const 1 i32.con"
          "st 0 i32.const 4 memory.copy i32.const 1 i32.load)")
PROBE(memory_copy_oob_traps_without_writing, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65530 i32.const 0 i32.const 7 memory.copy i32.co"
          "nst 0)")
PROBE(memory_copy_oob_writes_nothing, LC_WASM_TRAP_OOB, "",
      "(data (i32.const 0) \"\\01\\02\\03\\04\\05\\06\\07\\08\") (func $try (param i32) local.get"
          " 0 i32.const 0 i32.const 8 memory.copy) (func $p (result i32) i32.const 65530 ca"
          "ll $try i32.const 0)")
PROBE(memory_fill_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65535 i32.const 1 i32.const 2 memory.fill i32.co"
          "nst 0)")
PROBE(memory_fill_zero_at_end_ok, LC_WASM_TRAP_HOST, "test_fail(6) ended the instance",
      "(func $p (result i32) i32.const 65536 i32.const 1 i32.const 0 memory.fill i32.co"
          "nst 6)")
PROBE(memory_fill_zero_past_end_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65537 i32.const 1 i32.const 0 memory.fill i32.co"
          "nst 6)")
PROBE(memory_grow_returns_old_size, LC_WASM_TRAP_HOST, "test_fail(13) ended the instance",
      "(func $p (result i32) i32.const 2 memory.grow i32.const 10 i32.mul memory.size i"
          "32.add)")
PROBE(memory_grow_beyond_max_fails, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(func $p (result i32) i32.const 70000 memory.grow)")
PROBE(br_table_huge_index_takes_default, LC_WASM_TRAP_HOST, "test_fail(1) ended the instance",
      "(func $p (result i32) (block (result i32) (block (result i32) i32.const 1 i32.co"
          "nst -1 br_table 0 0 1) drop i32.const 2))")
PROBE(br_table_index_0, LC_WASM_TRAP_HOST, "test_fail(1) ended the instance",
      "(func $p (result i32) (block (result i32) (block (result i32) i32.const 1 i32.co"
          "nst 0 br_table 1 0) drop i32.const 2))")
PROBE(block_with_params, LC_WASM_TRAP_HOST, "test_fail(18) ended the instance",
      "(type $bt (func (param i32 i32) (result i32))) (func $p (result i32) i32.const 3"
          "0 i32.const 12 (block (type $bt) i32.sub))")
PROBE(loop_with_params_counts, LC_WASM_TRAP_HOST, "test_fail(10) ended the instance",
      "(type $lt (func (param i32) (result i32))) (func $p (result i32) (local i32) i32"
          ".const 0 (loop (type $lt) i32.const 1 i32.add local.tee 0 local.get 0 i32.const "
          "10 i32.lt_u br_if 0))")
PROBE(if_with_params_else, LC_WASM_TRAP_HOST, "test_fail(14) ended the instance",
      "(type $bt (func (param i32) (result i32))) (func $p (result i32) i32.const 7 i32"
          ".const 0 (if (type $bt) (then i32.const 1 i32.add) (else i32.const 2 i32.mul)))")
PROBE(if_with_params_no_else, LC_WASM_TRAP_HOST, "test_fail(7) ended the instance",
      "(type $bt (func (param i32) (result i32))) (func $p (result i32) i32.const 7 i32"
          ".const 0 (if (type $bt) (then i32.const 1 i32.add)))")
PROBE(multi_value_block_swap, LC_WASM_TRAP_HOST, "test_fail(21) ended the instance",
      "(type $bt (func (result i32 i32))) (func $p (result i32) (block (type $bt) i32.c"
          "onst 1 i32.const 2) i32.const 10 i32.mul i32.add)")
PROBE(multi_value_br_carries_values, LC_WASM_TRAP_HOST, "test_fail(43) ended the instance",
      "(type $bt (func (result i32 i64))) (func $p (result i32) (block (type $bt) i32.c"
          "onst 3 i64.const 4 br 0) i32.wrap_i64 i32.const 10 i32.mul i32.add)")
PROBE(br_out_of_loop_with_value, LC_WASM_TRAP_HOST, "test_fail(5) ended the instance",
      "(func $p (result i32) (local i32) (block (result i32) (loop local.get 0 i32.cons"
          "t 1 i32.add local.tee 0 local.get 0 i32.const 5 i32.eq br_if 1 drop br 0) i32.co"
          "nst 0))")
PROBE(call_indirect_type_mismatch_traps, LC_WASM_TRAP_CALL_INDIRECT, "",
      "(type $ti (func (param i32) (result i32))) (func $f (result i32) i32.const 9) (e"
          "lem (i32.const 0) $f) (func $p (result i32) i32.const 1 i32.const 0 call_indirec"
          "t (type $ti))")
PROBE(call_indirect_null_traps, LC_WASM_TRAP_CALL_INDIRECT, "",
      "(type $t0 (func (result i32))) (func $p (result i32) i32.const 3 call_indirect ("
          "type $t0))")
PROBE(call_indirect_out_of_table_traps, LC_WASM_TRAP_CALL_INDIRECT, "",
      "(type $t0 (func (result i32))) (func $p (result i32) i32.const 4 call_indirect ("
          "type $t0))")
PROBE(call_indirect_structural_type_ok, LC_WASM_TRAP_HOST, "test_fail(41) ended the instance",
      "(type $a (func (result i32))) (type $b (func (result i32))) (func $f (type $a) i"
          "32.const 41) (elem (i32.const 2) $f) (func $p (result i32) i32.const 2 call_indi"
          "rect (type $b))")
PROBE(call_indirect_import_in_table, LC_WASM_TRAP_HOST, "test_fail(55) ended the instance",
      "(type $ti (func (param i32))) (elem (i32.const 1) $fail) (func $p (result i32) i"
          "32.const 55 i32.const 1 call_indirect (type $ti) i32.const 0)")
PROBE(global_mut_i64_and_f64_init, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(global $h (mut i64) (i64.const -2)) (global $d (mut f64) (f64.const -nan:0x1)) "
          "(func $p (result i32) global.get $h i32.wrap_i64 global.get $d i64.reinterpret_f"
          "64 i32.wrap_i64 i32.add)")
PROBE(global_immutable_f32_nan_const, LC_WASM_TRAP_HOST, "test_fail(2139095041) ended the instance",
      "(global $c f32 (f32.const nan:0x1)) (func $p (result i32) global.get $c i32.rein"
          "terpret_f32)")
PROBE(unreachable_code_after_br_is_typed_loosely, LC_WASM_TRAP_HOST, "test_fail(8) ended the instance",
      "(func $p (result i32) (block (result i32) i32.const 8 br 0 select i64.eqz))")
PROBE(many_f32_temps, LC_WASM_TRAP_HOST, "test_fail(33) ended the instance",
      "(func $p (result i32) f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const "
          "1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.co"
          "nst 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f3"
          "2.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const "
          "1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.co"
          "nst 1 f32.const 1 (block) i32.const 0 f32.load f32.add f32.add f32.add f32.add f"
          "32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f"
          "32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f"
          "32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add i32.trunc"
          "_f32_s)")
PROBE(many_f64_temps_as_f32, LC_WASM_TRAP_HOST, "test_fail(65) ended the instance",
      "(func $p (result i32) f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const "
          "1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.co"
          "nst 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f3"
          "2.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const "
          "1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.co"
          "nst 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f3"
          "2.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const "
          "1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.co"
          "nst 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f3"
          "2.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const 1 f32.const "
          "1 (block) f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.ad"
          "d f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.ad"
          "d f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.ad"
          "d f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.ad"
          "d f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.ad"
          "d f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.add f32.ad"
          "d f32.add f32.add f32.add f32.add f32.add f64.promote_f32 i32.trunc_f64_s)")
PROBE(start_function_runs_first, LC_WASM_TRAP_HOST, "test_fail(11) ended the instance",
      "(start $st) (func $st i32.const 11 global.set $g) (func $p (result i32) global.g"
          "et $g)")
PROBE(data_segment_oob_traps_at_instantiation, LC_WASM_TRAP_OOB, "",
      "(data (i32.const 65535) \"ab\") (func $p (result i32) i32.const 1)")
PROBE(elem_segment_oob_traps_at_instantiation, LC_WASM_TRAP_OOB, "",
      "(elem (i32.const 4) $p) (func $p (result i32) i32.const 1)")
PROBE(dropped_load_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const -4 i32.load drop i32.const 5)")
PROBE(dropped_eqz_of_load_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const -4 i32.load i32.eqz drop i32.const 5)")
PROBE(dropped_i64_load8_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65536 i64.load8_s drop i32.const 5)")
PROBE(dropped_f64_load_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65535 f64.load drop i32.const 5)")
PROBE(dropped_load_with_offset_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 0 i32.load offset=70000 drop i32.const 5)")
PROBE(dropped_select_of_loads_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 0 i32.load i32.const -4 i32.load i32.const 1 sel"
          "ect drop i32.const 5)")
PROBE(dropped_memory_grow_still_grows, LC_WASM_TRAP_HOST, "test_fail(2) ended the instance",
      "(func $p (result i32) i32.const 1 memory.grow drop memory.size)")
PROBE(dropped_trunc_traps, LC_WASM_TRAP_INT_OVERFLOW, "",
      "(func $p (result i32) f64.const 1e300 i64.trunc_f64_s drop i32.const 5)")
PROBE(order_store_addr_then_tee_same_local, LC_WASM_TRAP_HOST, "test_fail(2020) ended the instance",
      "(func $p (result i32) (local i32) i32.const 16 local.set 0 local.get 0 i32.const"
          " 20 local.tee 0 i32.store i32.const 16 i32.load local.get 0 i32.const 100 i32.mu"
          "l i32.add)")
PROBE(multi_value_if_else, LC_WASM_TRAP_HOST, "test_fail(43) ended the instance",
      "(type $bt (func (result i32 i64))) (func $p (result i32) (local i32) i32.const 1"
          " (if (type $bt) (then i32.const 3 i64.const 4) (else i32.const 5 i64.const 6)) i"
          "32.wrap_i64 i32.const 10 i32.mul i32.add)")
PROBE(block_params_rebranched, LC_WASM_TRAP_HOST, "test_fail(4003) ended the instance",
      "(type $bt (func (param i32 i32) (result i32 i32))) (func $p (result i32) i32.con"
          "st 1 i32.const 2 (block (type $bt) i32.add i32.const 40 br 0) i32.const 100 i32."
          "mul i32.add)")
PROBE(loop_params_fib, LC_WASM_TRAP_HOST, "test_fail(55) ended the instance",
      "(type $lt (func (param i32 i32 i32) (result i32))) (func $p (result i32) (local "
          "i32 i32 i32) i32.const 0 i32.const 1 i32.const 10 (loop (type $lt) local.set 0 l"
          "ocal.set 1 local.set 2 local.get 1 local.get 2 local.get 1 i32.add local.get 0 i"
          "32.const 1 i32.sub local.tee 0 local.get 0 br_if 0 drop drop))")
PROBE(trunc_f64_s64_int_min_ok, LC_WASM_TRAP_HOST, "test_fail(2147483648) ended the instance",
      "(func $p (result i32) f64.const -9223372036854775808 i64.trunc_f64_s i64.const 3"
          "2 i64.shr_u i32.wrap_i64)")
PROBE(trunc_f64_s64_2p63_traps, LC_WASM_TRAP_INT_OVERFLOW, "",
      "(func $p (result i32) f64.const 9223372036854775808 i64.trunc_f64_s i32.wrap_i64"
          ")")
PROBE(trunc_f64_u64_minus_0_9_ok, LC_WASM_TRAP_HOST, "test_fail(0) ended the instance",
      "(func $p (result i32) f64.const -0.9 i64.trunc_f64_u i32.wrap_i64)")
PROBE(trunc_f32_u32_largest_ok, LC_WASM_TRAP_HOST, "test_fail(4294967040) ended the instance",
      "(func $p (result i32) f32.const 4294967040 i32.trunc_f32_u)")
PROBE(trunc_sat_f64_u64_1e20_max, LC_WASM_TRAP_HOST, "test_fail(4294967295) ended the instance",
      "(func $p (result i32) f64.const 1e20 i64.trunc_sat_f64_u i32.wrap_i64)")
PROBE(dropped_i64_load_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65535 i64.load drop i32.const 5)")
PROBE(dropped_f32_load_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65535 f32.load drop i32.const 5)")
PROBE(dropped_load16_u_oob_traps, LC_WASM_TRAP_OOB, "",
      "(func $p (result i32) i32.const 65535 i32.load16_u drop i32.const 5)")

/* Large probes, made here: text is the concatenation of the (text, count) pairs up to NULL. */
static char *cat(const char *first, ...) {
    va_list ap;
    size_t n = 1;
    va_start(ap, first);
    for (const char *t = first; t != NULL; t = va_arg(ap, const char *)) n += strlen(t) * (size_t)va_arg(ap, int);
    va_end(ap);
    char *s = malloc(n), *w = s;
    va_start(ap, first);
    for (const char *t = first; t != NULL; t = va_arg(ap, const char *)) {
        int k = va_arg(ap, int);
        for (int i = 0; i < k; i++) w = stpcpy(w, t);
    }
    va_end(ap);
    *w = '\0';
    return s;
}

Test(xlate_sem, deep_expression_chain) {
    char *b = cat("(func $p (result i32) (local i32) ", 1,
                  "local.get 0 i32.const 1 i32.add local.set 0 ", 3, "i32.const 1 ", 1,
                  "i32.const 1 i32.add ", 400, "local.get 0 i32.add)", 1, NULL);
    probe(b, LC_WASM_TRAP_HOST, "test_fail(404) ended the instance");
    free(b);
}

Test(xlate_sem, long_balanced_tree) {
    char *b = cat("(func $p (result i32) ", 1, "i32.const 1 ", 200, "i32.add ", 199, ")", 1, NULL);
    probe(b, LC_WASM_TRAP_HOST, "test_fail(200) ended the instance");
    free(b);
}

/* A function of n i32 parameters called with 0..n-1, returning the first plus the last; want
 * gets the outcome's message. */
static char *many_params_body(int n, char *want, size_t cap) {
    char args[8000] = "";
    for (int i = 0; i < n; i++) snprintf(args + strlen(args), sizeof args - strlen(args), "i32.const %d ", i);
    char last[16];
    snprintf(last, sizeof last, "%d", n - 1);
    snprintf(want, cap, "test_fail(%d) ended the instance", n - 1);
    return cat("(func $many (param ", 1, "i32 ", n, ") (result i32) local.get 0 local.get ", 1,
               last, 1, " i32.add) (func $p (result i32) ", 1, args, 1, "call $many)", 1, NULL);
}

static void many_params(int n) {
    char want[64];
    char *b = many_params_body(n, want, sizeof want);
    probe(b, LC_WASM_TRAP_HOST, want);
    free(b);
}

Test(xlate_sem, many_params_200) { many_params(200); }

/* 223 parameters and a result: LC_WASM_MAX_TYPE_ARITY, the most that loads, on both pipelines. */
Test(xlate_sem, many_params_223_the_limit_runs_on_both_pipelines) {
    many_params(223);
    char want[64];
    char *body = many_params_body(223, want, sizeof want);
    char *src = framed(body);
    wt_bytes b = wat(src, true);
    result r;
    run_on(&b, true, &r);
    cr_assert(r.loaded, "wasm2c pipeline: %s", r.err);
    cr_expect(strstr(r.out.message, want) != NULL, "wasm2c pipeline: %s", r.out.message);
    free(b.data);
    free(src);
    free(body);
}

/* More parameters and results than LC_WASM_MAX_TYPE_ARITY: tcc cannot compile a call with that
 * many arguments ("memory full (vstack)" near 255, for our C and for wasm2c's alike), so the
 * module is refused at load on both pipelines, with a message that names the limit. */
Test(xlate_sem, many_params_300) {
    char want[64];
    char *body = many_params_body(300, want, sizeof want);
    char *src = framed(body);
    wt_bytes b = wat(src, true);
    for (int w2c = 0; w2c < 2; w2c++) {
        result r;
        run_on(&b, w2c, &r);
        cr_expect(!r.loaded, "%s pipeline: a module with 300 parameters loaded",
                  w2c ? "wasm2c" : "own");
        cr_expect(strstr(r.err, "function type 1 has 301 parameters and results, more than the "
                                "224 that the tier-0 compiler (tcc) can pass in one call") != NULL,
                  "%s pipeline: %s", w2c ? "wasm2c" : "own", r.err);
    }
    free(b.data);
    free(src);
    free(body);
}

Test(xlate_sem, deep_if_nesting_4000) {
    char *b = cat("(func $p (result i32) ", 1, "i32.const 1 (if (result i32) (then ", 4000,
                  "i32.const 7", 1, " ) (else i32.const 0))", 4000, ")", 1, NULL);
    probe(b, LC_WASM_TRAP_HOST, "test_fail(7) ended the instance");
    free(b);
}

Test(xlate_sem, br_table_4000_deep) {
    char labels[40000] = "";
    for (int i = 0; i < 4000; i++) snprintf(labels + strlen(labels), sizeof labels - strlen(labels), "%d ", i);
    char *b = cat("(func $p (result i32) (block ", 1, "(block ", 4000, "i32.const 3999 br_table ", 1,
                  labels, 1, "0", 1, ")", 4000, ") i32.const 9)", 1, NULL);
    probe(b, LC_WASM_TRAP_HOST, "test_fail(9) ended the instance");
    free(b);
}

Test(xlate_sem, thirty_thousand_temps) {
    char *b = cat("(func $p (result i32) ", 1, "i32.const 1 ", 30000, "(block) ", 1, "i32.add ", 29999,
                  ")", 1, NULL);
    probe(b, LC_WASM_TRAP_HOST, "test_fail(30000) ended the instance");
    free(b);
}

/* ---- the wasm2c pipeline (what modules the own translator declines, and tier 1, still get) --- */

/* wasm2c 1.0.32 puts an imported function into a table with the address of the instance's
 * import field as its instance (elem_segment_exprs: (char *)instance + offsetof(...)), so a
 * call_indirect of it reaches the host with the wrong pointer (lc_wasm_enter abort()ed the whole
 * process). Such a module must not run on wasm2c's code: the wasm2c pipeline refuses it at load,
 * naming the segment and the import. The own translator's wrapper passes I->pie
 * (xlate_sem::call_indirect_import_in_table), and tier 1 is not built for it (below). */
static const char IMPORT_IN_TABLE[] =
    "(module (import \"pie\" \"test_fail\" (func $fail (param i32))) (table 2 funcref) "
    "(type $ti (func (param i32))) (elem (i32.const 1) $fail) "
    "(func (export \"_start\") i32.const 55 i32.const 1 call_indirect (type $ti)))";

Test(xlate_sem, wasm2c_pipeline_host_function_through_the_table_does_not_abort_the_process) {
    wt_bytes b = wat(IMPORT_IN_TABLE, true);
    result r;
    run_on(&b, true, &r);
    cr_expect(!r.loaded, "loaded on the wasm2c pipeline: %s", r.out.message);
    cr_expect(strstr(r.err, "element segment 0 puts the imported function pie.test_fail into a "
                            "table") != NULL,
              "%s", r.err);
    free(b.data);
}

/* The same through a passive segment (table.init could copy it into the table), in a module that
 * the own translator declines (passive segments): nowhere to run it, so it is refused, saying
 * why wasm2c was asked. */
Test(xlate_sem, declined_module_with_a_host_function_in_a_passive_segment_is_refused) {
    wt_bytes b = wat("(module (import \"pie\" \"test_fail\" (func $fail (param i32))) "
                  "(table 2 funcref) (elem func $fail) (func (export \"_start\")))",
                  true);
    result r;
    run_on(&b, false, &r);
    cr_expect(!r.loaded, "loaded: %s", r.out.message);
    cr_expect(strstr(r.err, "element segment 0 puts the imported function pie.test_fail") != NULL &&
                  strstr(r.err, "declined") != NULL,
              "%s", r.err);
    free(b.data);
}

/* A declarative segment only declares references (ref.func of an import is right in wasm2c's
 * code): not a reason to refuse. */
Test(xlate_sem, a_declarative_segment_naming_an_import_loads_on_the_wasm2c_pipeline) {
    wt_bytes b = wat("(module (import \"pie\" \"test_fail\" (func $fail (param i32))) "
                  "(elem declare func $fail) (func (export \"_start\") i32.const 3 call $fail))",
                  true);
    result r;
    run_on(&b, true, &r);
    cr_assert(r.loaded, "%s", r.err);
    cr_expect_str_eq(r.out.message, "trapped: test_fail(3) ended the instance");
    free(b.data);
}

/* Runs an instance of m (argv "p", no limits) to its end and expects the outcome's message to
 * be want. */
static void expect_instance_message(lc_wasm_module *m, const char *want) {
    const char *argv[] = {"p", NULL};
    lc_wasm_instance_opts io = {.argv = argv, .argc = 1};
    lc_wasm_instance *inst = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_instance_create(m, &io, &inst, &st), PIE_OK, "create: %s", st.msg);
    lc_wasm_outcome out;
    cr_assert_eq(lc_wasm_instance_run(inst, &out, &st), PIE_OK, "run: %s", st.msg);
    cr_expect_str_eq(out.message, want);
    lc_wasm_instance_free(inst);
}

/* Tier 1 is wasm2c's code too: for a module with an import in a table it is not built, and
 * instances keep running on the own translator's tier 0. */
Test(xlate_sem, tier1_is_not_built_for_a_module_with_a_host_function_in_a_table) {
    wt_bytes b = wat(IMPORT_IN_TABLE, true);
    lc_wasm_rt_opts o = {.cache_dir = wt_dir,
                         .host_fns = wasm_test_host_fns,
                         .n_host_fns = wasm_test_host_n_fns,
                         .tier1 = true};
    lc_wasm_rt *rt = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "rt_create: %s", st.msg);
    lc_wasm_module *m = NULL;
    cr_assert_eq(lc_wasm_module_load(rt, b.data, b.len, &m, &st), PIE_OK, "load: %s", st.msg);
    cr_expect_eq(lc_wasm_module_wait_tier1(m, 60000, &st), PIE_FAILED_PRECONDITION, "%s", st.msg);
    cr_expect(strstr(st.msg, "tier 1 is not built") != NULL, "%s", st.msg);
    cr_expect_eq(lc_wasm_module_tier(m), 0);
    cr_expect_eq(lc_wasm_rt_stats_get(rt).tier1_compiles, 0u);
    expect_instance_message(m, "trapped: test_fail(55) ended the instance");
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    free(b.data);
}

/* A library that wasm2c's C made for such a module (cached by a version before this check: here
 * a stand-in with the glue's entry points and wasm2c's Z_<name>_instantiate) is not used: the
 * module is compiled again by the own translator. */
Test(xlate_sem, a_cached_wasm2c_library_of_a_module_with_a_host_function_in_a_table_is_rebuilt) {
    wt_bytes b = wat(IMPORT_IN_TABLE, true);
    result r;
    run_on(&b, false, &r); /* only to learn the cache entry's name; run_on empties the cache */
    cr_assert(r.loaded, "%s", r.err);
    lc_wasm_rt_opts o = {.cache_dir = wt_dir,
                         .host_fns = wasm_test_host_fns,
                         .n_host_fns = wasm_test_host_n_fns};
    lc_wasm_rt *rt = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "rt_create: %s", st.msg);
    lc_wasm_module *m = NULL;
    cr_assert_eq(lc_wasm_module_load(rt, b.data, b.len, &m, &st), PIE_OK, "load: %s", st.msg);
    char id[65], dir[160], src[200], cmd[600];
    snprintf(id, sizeof id, "%s", lc_wasm_module_id(m));
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    snprintf(dir, sizeof dir, "%s/%s", wt_dir, id);
    snprintf(src, sizeof src, "%s/stale.c", wt_dir);
    FILE *f = fopen(src, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "#include <stddef.h>\n"
            "size_t w%.24s_lc_instance_size(void){return 8;}\n"
            "void w%.24s_lc_init_module(void){}\n"
            "void w%.24s_lc_instantiate(void*i,void*p,void*w){}\n"
            "void w%.24s_lc_start(void*i){}\nvoid w%.24s_lc_free(void*i){}\n"
            "void Z_w%.24s_instantiate(void*i,void*p,void*w){}\n",
            id, id, id, id, id, id);
    cr_assert_eq(fclose(f), 0);
    snprintf(cmd, sizeof cmd, "tcc -shared -fPIC -o %s/t0.so %s", dir, src);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "rt_create: %s", st.msg);
    cr_assert_eq(lc_wasm_module_load(rt, b.data, b.len, &m, &st), PIE_OK, "load: %s", st.msg);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.own_translations, 1u, "the stale library was used");
    cr_expect_eq(s.disk_hits, 0u);
    expect_instance_message(m, "trapped: test_fail(55) ended the instance");
    lc_wasm_module_release(m);
    lc_wasm_rt_destroy(rt);
    free(b.data);
}

/* Whatever code passes a host function a pointer other than its instance's (wasm2c's for an
 * import in a table, if a library cached by an older version still held it), the instance traps
 * and the process goes on. */
Test(xlate_sem, a_host_function_given_a_wrong_instance_pointer_traps_the_instance) {
    for (int w2c = 0; w2c < 2; w2c++) {
        wt_bytes b = wat("(module (import \"pie\" \"test_wrong_pie\" (func $w)) "
                      "(func (export \"_start\") call $w))",
                      true);
        result r;
        run_on(&b, w2c, &r);
        cr_assert(r.loaded, "%s", r.err);
        cr_expect(r.out.end == LC_WASM_TRAPPED && r.out.trap == LC_WASM_TRAP_HOST &&
                      strstr(r.out.message, "wrong instance pointer") != NULL,
                  "ended %d trap %d: %s", r.out.end, r.out.trap, r.out.message);
        free(b.data);
    }
}

/* ---- the sandbox's other walls, with the own translator's code ------------------------------- */

static void expect_own_outcome(const char *text, lc_wasm_limits lim, lc_wasm_end end,
                               lc_wasm_trap trap) {
    wt_bytes b = wat(text, true);
    result r;
    run_limited(&b, false, lim, &r);
    cr_assert(r.loaded, "%s", r.err);
    cr_expect(r.own, "not translated by the own translator");
    cr_expect(r.out.end == end && r.out.trap == trap, "ended %d trap %d: %s (expected %d %d)",
              r.out.end, r.out.trap, r.out.message, end, trap);
    free(b.data);
}

Test(xlate_sem, unbounded_recursion_traps_as_exhaustion) {
    expect_own_outcome("(module (func $r (param i32) (result i32) local.get 0 i32.const 1 i32.add "
                       "call $r) (func (export \"_start\") i32.const 0 call $r drop))",
                       (lc_wasm_limits){0}, LC_WASM_TRAPPED, LC_WASM_TRAP_EXHAUSTION);
}

Test(xlate_sem, infinite_loop_is_interrupted) {
    expect_own_outcome("(module (func (export \"_start\") (loop br 0)))",
                       (lc_wasm_limits){.cpu_ms = 200}, LC_WASM_INTERRUPTED, LC_WASM_TRAP_CPU_TIME);
}

Test(xlate_sem, table_beyond_the_limit_is_refused_at_instantiation) {
    expect_own_outcome("(module (table 100000000 funcref) (func (export \"_start\")))",
                       (lc_wasm_limits){0}, LC_WASM_TRAPPED, LC_WASM_TRAP_MEMORY_LIMIT);
}

Test(xlate_sem, memory_beyond_the_limit_is_refused_at_instantiation) {
    expect_own_outcome("(module (memory 65536) (func (export \"_start\")))",
                       (lc_wasm_limits){.max_memory_pages = 16}, LC_WASM_TRAPPED,
                       LC_WASM_TRAP_MEMORY_LIMIT);
}

Test(xlate_sem, memory_grow_past_the_limit_returns_minus_one) {
    expect_own_outcome("(module (import \"pie\" \"test_fail\" (func $fail (param i32))) (memory 1) "
                       "(func (export \"_start\") i32.const 100 memory.grow call $fail))",
                       (lc_wasm_limits){.max_memory_pages = 16}, LC_WASM_TRAPPED, LC_WASM_TRAP_HOST);
}
