/* test_lc_wasm_xlate.c — tier 0's own translator (services/lifecycle/wasm/lc_wasm_xlate.c):
 * every fixture runs with the same observable behaviour (output, exit code, trap and its
 * message) through our translator and through wasm2c; hand-written modules check each trap
 * kind and the evaluation order the expression folding must keep; invalid modules are refused
 * by the validator (and wasm-validate agrees that they are invalid); declined modules fall
 * back to wasm2c.
 *
 * Modules written as WAT are assembled at test time with wabt's wat2wasm (wabt is a dependency
 * of the runtime already: wasm2c), the invalid ones are written byte by byte. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lc_wasm.h"
#include "lc_wasm_xlate.h"
#include "pie_wasmgen.h"
#include "test_wasm_util.h"
#include "wasm_test_host.h"

TestSuite(lc_wasm_xlate, .init = wt_setup, .fini = wt_teardown, .timeout = 300);

/* Runs a shell command; its exit status. */
static int sh(const char *cmd) {
    int rc = system(cmd);
    return rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

/* Assembles WAT text with wat2wasm (flags: e.g. "--no-check"). */
static wt_bytes wat(const char *name, const char *text, const char *flags) {
    char src[256], out[256], cmd[1024];
    snprintf(src, sizeof src, "%s/%s.wat", wt_dir, name);
    snprintf(out, sizeof out, "%s/%s.wasm", wt_dir, name);
    FILE *f = fopen(src, "w");
    cr_assert_not_null(f);
    cr_assert_eq(fputs(text, f) >= 0, true);
    cr_assert_eq(fclose(f), 0);
    snprintf(cmd, sizeof cmd, "wat2wasm %s %s -o %s", flags, src, out);
    cr_assert_eq(sh(cmd), 0, "wat2wasm failed on %s", name);
    return wt_read_file(out);
}

/* Whether wabt's wasm-validate accepts the module (the oracle for the validator). */
static bool wabt_accepts(const char *name, const wt_bytes *b) {
    char path[256], cmd[512];
    snprintf(path, sizeof path, "%s/%s.check.wasm", wt_dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b->data, 1, b->len, f), b->len);
    cr_assert_eq(fclose(f), 0);
    snprintf(cmd, sizeof cmd, "wasm-validate %s 2>/dev/null", path);
    return sh(cmd) == 0;
}

/* ---- the two runtimes ------------------------------------------------------------------------ */

typedef struct pair {
    lc_wasm_rt *own, *w2c; /* separate cache directories: no library is shared */
} pair;

/* A runtime caching in wt_dir/sub; tcc: the compiler to run (NULL: tcc from PATH). */
static lc_wasm_rt *make_with(const char *sub, bool w2c, const char *tcc) {
    char dir[128];
    snprintf(dir, sizeof dir, "%s/%s", wt_dir, sub);
    lc_wasm_rt_opts o = {.cache_dir = dir,
                         .host_fns = wasm_test_host_fns,
                         .n_host_fns = wasm_test_host_n_fns,
                         .tier0_wasm2c = w2c,
                         .tcc = tcc};
    lc_wasm_rt *rt = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "rt_create: %s", st.msg);
    return rt;
}

static lc_wasm_rt *make(const char *sub, bool w2c) { return make_with(sub, w2c, NULL); }

static pair pair_make(void) {
    cr_assert_eq(unsetenv("PIE_WASM_TIER0"), 0);
    return (pair){make("own", false), make("w2c", true)};
}

static void pair_destroy(pair *p) {
    lc_wasm_rt_destroy(p->own);
    lc_wasm_rt_destroy(p->w2c);
}

typedef struct result {
    lc_wasm_outcome out;
    char stdout_[4096], stderr_[4096];
    size_t n_out, n_err;
} result;

static void on_output(void *ctx, int fd, const char *data, size_t len) {
    result *r = ctx;
    char *buf = fd == 1 ? r->stdout_ : r->stderr_;
    size_t *n = fd == 1 ? &r->n_out : &r->n_err;
    size_t take = len < sizeof r->stdout_ - 1 - *n ? len : sizeof r->stdout_ - 1 - *n;
    memcpy(buf + *n, data, take);
    *n += take;
    buf[*n] = '\0';
}

/* Loads b into rt and runs it once with argv (NULL-terminated); false if the load failed. */
static bool run(lc_wasm_rt *rt, const wt_bytes *b, const char *const *argv, result *r,
                pie_status *load_st) {
    memset(r, 0, sizeof *r);
    lc_wasm_module *m = NULL;
    if (lc_wasm_module_load(rt, b->data, b->len, &m, load_st) != PIE_OK) return false;
    size_t argc = 0;
    while (argv[argc] != NULL) argc++;
    lc_wasm_instance_opts o = {.argv = argv,
                               .argc = argc,
                               .limits = {.max_memory_pages = 512, .cpu_ms = 20000},
                               .output = on_output,
                               .output_ctx = r};
    lc_wasm_instance *inst = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_instance_create(m, &o, &inst, &st), PIE_OK, "create: %s", st.msg);
    cr_assert_eq(lc_wasm_instance_run(inst, &r->out, &st), PIE_OK, "run: %s", st.msg);
    lc_wasm_instance_free(inst);
    lc_wasm_module_release(m);
    return true;
}

/* Runs b through both runtimes and expects the same outcome; the own runtime must have used
 * its translator (not the fallback). Returns the own runtime's result in *own. */
static void same(pair *p, const char *what, const wt_bytes *b, const char *const *argv, result *own) {
    static result w;
    pie_status st;
    lc_wasm_rt_stats s0 = lc_wasm_rt_stats_get(p->own);
    cr_assert(run(p->own, b, argv, own, &st), "%s: own load failed: %s", what, st.msg);
    cr_assert(run(p->w2c, b, argv, &w, &st), "%s: wasm2c load failed: %s", what, st.msg);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(p->own);
    /* a module run before was unloaded with its last reference: this run found its native code
     * in the own runtime's disk cache, which that earlier run's check covered */
    cr_expect(s.own_translations == s0.own_translations + 1 || s.disk_hits > s0.disk_hits,
              "%s: the own runtime did not use its translator", what);
    cr_expect_eq(own->out.end, w.out.end, "%s: ended %d vs %d (%s | %s)", what, own->out.end,
                 w.out.end, own->out.message, w.out.message);
    cr_expect_eq(own->out.trap, w.out.trap, "%s: trap %d vs %d", what, own->out.trap, w.out.trap);
    cr_expect_eq(own->out.exit_code, w.out.exit_code, "%s: exit %d vs %d", what, own->out.exit_code,
                 w.out.exit_code);
    cr_expect_str_eq(own->out.message, w.out.message, "%s: message", what);
    cr_expect_str_eq(own->stdout_, w.stdout_, "%s: stdout", what);
    cr_expect_str_eq(own->stderr_, w.stderr_, "%s: stderr", what);
}

/* ---- fixtures through both translators ------------------------------------------------------- */

Test(lc_wasm_xlate, every_fixture_behaves_the_same_through_both_translators) {
    static const char *const runs[][4] = {
        {"hello", "hello", NULL},
        {"hello", "hello", "pie", NULL},
        {"trivial", "trivial", NULL},
        {"host_calls", "host_calls", "calls", NULL},
        {"host_calls", "host_calls", "fail", NULL},
        {"numeric", "numeric", NULL},
        {"big", "big", NULL},
        {"big", "big", "7", NULL},
        {"big_dwarf", "big", NULL},
        {"hostile", "hostile", "oob-read", NULL},
        {"hostile", "hostile", "oob-write", NULL},
        {"hostile", "hostile", "div0", NULL},
        {"hostile", "hostile", "overflow", NULL},
        {"hostile", "hostile", "convert", NULL},
        {"hostile", "hostile", "unreachable", NULL},
        {"hostile", "hostile", "indirect", NULL},
        {"hostile", "hostile", "recurse", NULL},
        {"hostile", "hostile", "grow", NULL},
        {"hostile", "hostile", "storm", NULL},
        {"hostile", "hostile", "exit", NULL},
    };
    pair p = pair_make();
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        wt_bytes b = wt_fixture(runs[i][0]);
        result r;
        char what[96];
        snprintf(what, sizeof what, "%s %s", runs[i][0], runs[i][2] ? runs[i][2] : "");
        same(&p, what, &b, &runs[i][1], &r);
        free(b.data);
    }
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(p.own);
    cr_expect_eq(s.own_declines, 0u, "a fixture fell back to wasm2c");
    cr_expect_eq(s.translations, 0u, "the own runtime ran wasm2c");
    pair_destroy(&p);
}

/* The sink of lc_wasm_xlate_to (tcc reads the text while it is made): it collects the pieces,
 * refusing the one numbered refuse_at (0: none). */
typedef struct pieces {
    char *text;
    size_t len, n, refuse_at;
} pieces;

static bool pieces_write(void *user, const char *text, size_t n, pie_status *st) {
    pieces *p = user;
    cr_assert_gt(n, 0u, "an empty piece");
    if (++p->n == p->refuse_at) {
        pie_status_set(st, PIE_CANCELLED, "the reader went away");
        return false;
    }
    char *t = realloc(p->text, p->len + n);
    cr_assert_not_null(t);
    memcpy(t + p->len, text, n);
    p->text = t;
    p->len += n;
    return true;
}

Test(lc_wasm_xlate, the_text_in_pieces_is_the_whole_text_and_a_refusing_reader_stops_it) {
    wt_bytes b = wt_fixture("big");
    lc_wasm_xlate_out x;
    pie_status st;
    cr_assert_eq(lc_wasm_xlate(b.data, b.len, "wt", &x, &st), PIE_OK, "%s", st.msg);
    pieces p = {0};
    lc_wasm_xlate_sink sink = {.write = pieces_write, .user = &p};
    uint32_t n_funcs = 0;
    cr_assert_eq(lc_wasm_xlate_to(b.data, b.len, "wt", &sink, &n_funcs, &st), PIE_OK, "%s", st.msg);
    cr_expect_eq(n_funcs, x.n_funcs);
    cr_expect_gt(p.n, x.len / LC_WASM_XLATE_PIECE / 2, "%zu pieces for %zu bytes: not streamed",
                 p.n, x.len);
    cr_assert_eq(p.len, x.len, "the pieces add up to %zu bytes, the text is %zu", p.len, x.len);
    cr_expect(memcmp(p.text, x.c, x.len) == 0, "the pieces differ from the text");
    free(p.text);
    /* a reader that goes away at its third piece stops the translation with its status */
    pieces q = {.refuse_at = 3};
    sink.user = &q;
    cr_expect_eq(lc_wasm_xlate_to(b.data, b.len, "wt", &sink, NULL, &st), PIE_CANCELLED);
    cr_expect(strstr(st.msg, "the reader went away"), "%s", st.msg);
    cr_expect_eq(q.n, 3u, "pieces offered after the refusal: %zu", q.n - 3);
    free(q.text);
    free(x.c);
    free(b.data);
}

Test(lc_wasm_xlate, simd_and_foreign_imports_are_declined_and_fall_back_to_wasm2c) {
    wt_bytes b = wt_fixture("simd");
    lc_wasm_xlate_out x;
    pie_status st;
    cr_expect_eq(lc_wasm_xlate(b.data, b.len, "wt", &x, &st), PIE_UNIMPLEMENTED, "%s", st.msg);
    cr_expect(strstr(st.msg, "declined") != NULL, "%s", st.msg);
    /* through the runtime: the same refusal as wasm2c gives (it aborts on SIMD) */
    pair p = pair_make();
    lc_wasm_module *m = NULL;
    pie_status a, c;
    pie_code ra = lc_wasm_module_load(p.own, b.data, b.len, &m, &a);
    if (ra == PIE_OK) lc_wasm_module_release(m);
    pie_code rc = lc_wasm_module_load(p.w2c, b.data, b.len, &m, &c);
    if (rc == PIE_OK) lc_wasm_module_release(m);
    cr_expect_eq(ra, rc, "own %d (%s) vs wasm2c %d (%s)", ra, a.msg, rc, c.msg);
    cr_expect_eq(lc_wasm_rt_stats_get(p.own).own_declines, 1u);
    free(b.data);
    pair_destroy(&p);
}

Test(lc_wasm_xlate, forcing_wasm2c_by_environment_skips_the_translator) {
    cr_assert_eq(setenv("PIE_WASM_TIER0", "wasm2c", 1), 0);
    lc_wasm_rt *rt = make("env", false);
    cr_assert_eq(unsetenv("PIE_WASM_TIER0"), 0);
    wt_bytes b = wt_fixture("trivial");
    result r;
    pie_status st;
    cr_assert(run(rt, &b, (const char *const[]){"trivial", NULL}, &r, &st), "%s", st.msg);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.translations, 1u);
    cr_expect_eq(s.own_translations, 0u);
    free(b.data);
    lc_wasm_rt_destroy(rt);
}

/* ---- traps and evaluation order (hand-written modules) --------------------------------------- */

/* A command module: `body` is the text of a function $main (result i32) whose value becomes
 * the exit code; `extra` adds fields (functions, tables, data). */
static wt_bytes command(const char *name, const char *extra, const char *body) {
    char text[8192];
    snprintf(text, sizeof text,
             "(module\n"
             "  (import \"wasi_snapshot_preview1\" \"proc_exit\" (func $exit (param i32)))\n"
             "  (memory 1)\n"
             "  (global $g (mut i32) (i32.const 5))\n"
             "  (func $next (result i32) (global.set $g (i32.add (global.get $g) (i32.const 1)))"
             " (global.get $g))\n"
             "  %s\n"
             "  (func $main (result i32) %s)\n"
             "  (func (export \"_start\") (call $exit (call $main))))\n",
             extra, body);
    return wat(name, text, "");
}

typedef struct expect {
    const char *name, *extra, *body;
    int end;   /* LC_WASM_EXITED or LC_WASM_TRAPPED */
    int value; /* exit code, or the trap */
} expect;

Test(lc_wasm_xlate, traps_and_evaluation_order_match_the_spec_on_both_paths) {
    static const expect cases[] = {
        /* operands are evaluated left to right: next() gives 6 then 7 */
        {"call_order", "", "(i32.add (i32.mul (call $next) (i32.const 10)) (call $next))",
         LC_WASM_EXITED, 67},
        /* a load pending on the stack is not moved past a store */
        {"load_store", "(data (i32.const 0) \"\\03\")",
         "(i32.load8_u (i32.const 0)) (i32.store8 (i32.const 0) (i32.const 7)) "
         "(i32.const 100) (i32.add)",
         LC_WASM_EXITED, 103},
        /* a local read pending on the stack is not moved past local.set */
        {"local_order", "",
         "(local $a i32) (local.set $a (i32.const 4)) (local.get $a) "
         "(local.set $a (i32.const 9)) (local.get $a) (i32.add) (local.get $a) (i32.mul)",
         LC_WASM_EXITED, 117},
        /* a global read pending on the stack is not moved past a call that changes it */
        {"global_order", "",
         "(global.get $g) (drop (call $next)) (global.get $g) (i32.sub) "
         "(i32.const 10) (i32.add)",
         LC_WASM_EXITED, 9},
        /* memory.size pending across memory.grow */
        {"grow_order", "",
         "(memory.size) (drop (memory.grow (i32.const 1))) (memory.size) "
         "(i32.sub) (i32.const 10) (i32.add)",
         LC_WASM_EXITED, 9},
        /* the trapping load comes before the call that would exit */
        {"trap_before_call", "", "(i32.add (i32.load (i32.const -4)) (call $main2))",
         LC_WASM_TRAPPED, LC_WASM_TRAP_OOB},
        /* the call (which exits) comes before the division that would trap */
        {"call_before_trap", "(func $e (result i32) (call $exit (i32.const 42)) (i32.const 1))",
         "(i32.div_u (call $e) (i32.const 0))", LC_WASM_EXITED, 42},
        /* select evaluates both arms: the unselected one still traps */
        {"select_traps", "",
         "(select (i32.div_u (i32.const 1) (i32.const 0)) (i32.const 2) (i32.const 0))",
         LC_WASM_TRAPPED, LC_WASM_TRAP_DIV_BY_ZERO},
        {"select_value", "", "(select (i32.const 3) (call $next) (i32.const 0))", LC_WASM_EXITED,
         6},
        /* blocks, loops with parameters (multi-value), br_if and br_table carrying values */
        {"loop_params", "",
         "(local $i i32) (i32.const 0) (loop $l (param i32) (result i32) "
         "(local.set $i (i32.add (local.get $i) (i32.const 1))) (i32.add (local.get $i)) "
         "(br_if $l (i32.lt_u (local.get $i) (i32.const 10))))",
         LC_WASM_EXITED, 55},
        {"br_table_values", "",
         "(block $a (result i32) (block $b (result i32) (i32.const 20) (i32.const 1) "
         "(br_table $b $a $b)) (i32.const 1) (i32.add)) (i32.const 3) (i32.add)",
         LC_WASM_EXITED, 23},
        {"if_else_params", "",
         "(i32.const 5) (i32.const 0) (if (param i32) (result i32) (then (i32.const 1) "
         "(i32.add)) (else (i32.const 2) (i32.mul)))",
         LC_WASM_EXITED, 10},
        /* a long chain of pure operations (deeper than the folding limit) */
        {"deep_expr", "",
         "(i32.const 1) (i32.const 1) (i32.add) (i32.const 1) (i32.add) (i32.const 1) (i32.add) "
         "(i32.const 1) (i32.add) (i32.const 1) (i32.add) (i32.const 1) (i32.add) (i32.const 1) "
         "(i32.add) (i32.const 1) (i32.add) (i32.const 1) (i32.add) (i32.const 1) (i32.add) "
         "(i32.const 1) (i32.add) (i32.const 1) (i32.add) (i32.const 1) (i32.add) (i32.const 1) "
         "(i32.add) (i32.const 1) (i32.add) (i32.const 1) (i32.add) (i32.const 1) (i32.add)",
         LC_WASM_EXITED, 18},
        /* numbers */
        {"rem_s_overflow_is_zero", "", "(i32.rem_s (i32.const 0x80000000) (i32.const -1))",
         LC_WASM_EXITED, 0},
        {"sat_trunc", "",
         "(i32.add (i32.trunc_sat_f32_s (f32.const nan)) (i32.add (i32.shr_u "
         "(i32.trunc_sat_f64_u (f64.const 1e20)) (i32.const 28)) (i32.trunc_sat_f32_u "
         "(f32.const -3))))",
         LC_WASM_EXITED, 15},
        {"float_bits", "",
         "(i32.shr_u (i32.reinterpret_f32 (f32.min (f32.const nan) (f32.const 1))) "
         "(i32.const 24)) (i32.shr_u (i32.reinterpret_f32 (f32.neg (f32.const 0))) (i32.const "
         "31)) (i32.add) (i32.wrap_i64 (i64.shr_u (i64.reinterpret_f64 (f64.nearest (f64.const "
         "2.5))) (i64.const 52))) (i32.add)",
         LC_WASM_EXITED, -1},
        {"extend_and_rotate", "",
         "(i32.add (i32.extend8_s (i32.const 0x80)) (i32.rotl (i32.const 0x80000001) (i32.const "
         "1))) (i32.const 131) (i32.add) (i32.wrap_i64 (i64.popcnt (i64.const -1))) (i32.add)",
         LC_WASM_EXITED, 70},
        /* traps */
        {"div_s_overflow", "",
         "(i32.wrap_i64 (i64.div_s (i64.const 0x8000000000000000) "
         "(i64.const -1)))",
         LC_WASM_TRAPPED, LC_WASM_TRAP_INT_OVERFLOW},
        {"rem_u_zero", "", "(i32.wrap_i64 (i64.rem_u (i64.const 1) (i64.const 0)))",
         LC_WASM_TRAPPED, LC_WASM_TRAP_DIV_BY_ZERO},
        {"trunc_overflow", "", "(i32.trunc_f64_s (f64.const 3e9))", LC_WASM_TRAPPED,
         LC_WASM_TRAP_INT_OVERFLOW},
        {"trunc_nan", "", "(i32.trunc_f32_u (f32.const nan))", LC_WASM_TRAPPED,
         LC_WASM_TRAP_INVALID_CONVERSION},
        {"unreachable", "", "(unreachable)", LC_WASM_TRAPPED, LC_WASM_TRAP_UNREACHABLE},
        {"indirect_type",
         "(type $t (func (param i32) (result i32))) (table 2 funcref) "
         "(elem (i32.const 0) $next)",
         "(call_indirect (type $t) (i32.const 1) (i32.const 0))", LC_WASM_TRAPPED,
         LC_WASM_TRAP_CALL_INDIRECT},
        {"indirect_null", "(table 2 funcref) (elem (i32.const 0) $next)",
         "(call_indirect (result i32) (i32.const 1))", LC_WASM_TRAPPED, LC_WASM_TRAP_CALL_INDIRECT},
        {"indirect_range", "(table 2 funcref) (elem (i32.const 0) $next)",
         "(call_indirect (result i32) (i32.const 7))", LC_WASM_TRAPPED, LC_WASM_TRAP_CALL_INDIRECT},
        {"indirect_ok", "(table 2 funcref) (elem (i32.const 1) $next)",
         "(call_indirect (result i32) (i32.const 1))", LC_WASM_EXITED, 6},
        {"fill_oob", "",
         "(memory.fill (i32.const 65000) (i32.const 1) (i32.const 1000)) (i32.const 0)",
         LC_WASM_TRAPPED, LC_WASM_TRAP_OOB},
        {"copy_oob", "",
         "(memory.copy (i32.const 0) (i32.const 65500) (i32.const 100)) (i32.const 0)",
         LC_WASM_TRAPPED, LC_WASM_TRAP_OOB},
        {"copy_ok", "(data (i32.const 10) \"\\2a\")",
         "(memory.copy (i32.const 11) (i32.const 10) (i32.const 1)) (i32.load8_u (i32.const 11))",
         LC_WASM_EXITED, 42},
        {"data_oob", "(data (i32.const 65535) \"ab\")", "(i32.const 0)", LC_WASM_TRAPPED,
         LC_WASM_TRAP_OOB},
        {"elem_oob", "(table 1 funcref) (elem (i32.const 1) $next)", "(i32.const 0)",
         LC_WASM_TRAPPED, LC_WASM_TRAP_OOB},
    };
    pair p = pair_make();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const expect *c = &cases[i];
        char extra[512];
        snprintf(extra, sizeof extra,
                 "%s (func $main2 (result i32) (call $exit (i32.const 7)) "
                 "(i32.const 0))",
                 c->extra);
        wt_bytes b = command(c->name, extra, c->body);
        result r;
        same(&p, c->name, &b, (const char *const[]){c->name, NULL}, &r);
        cr_expect_eq(r.out.end, c->end, "%s: ended %d (%s)", c->name, r.out.end, r.out.message);
        if (c->end == LC_WASM_EXITED && c->value >= 0)
            cr_expect_eq(r.out.exit_code, c->value, "%s: exit code %d, expected %d", c->name,
                         r.out.exit_code, c->value);
        if (c->end == LC_WASM_TRAPPED)
            cr_expect_eq((int)r.out.trap, c->value, "%s: trap %d, expected %d (%s)", c->name,
                         r.out.trap, c->value, r.out.message);
        free(b.data);
    }
    cr_expect_eq(lc_wasm_rt_stats_get(p.own).own_declines, 0u);
    pair_destroy(&p);
}

/* ---- validation ------------------------------------------------------------------------------ */

/* A module of one function () -> () with the given body (locals vector first), a table of one
 * funcref, a memory of one page, exported as _start. */
static wt_bytes module_with_body(const uint8_t *code, size_t n) {
    static const uint8_t head[] = {
        0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, /* magic, version */
        0x01, 0x04, 0x01, 0x60, 0x00, 0x00,             /* type: () -> () */
        0x03, 0x02, 0x01, 0x00,                         /* function 0: type 0 */
        0x04, 0x04, 0x01, 0x70, 0x00, 0x01,             /* table: funcref, min 1 */
        0x05, 0x03, 0x01, 0x00, 0x01,                   /* memory: min 1 */
        0x07, 0x0a, 0x01, 0x06, '_',  's',  't',  'a',  'r', 't', 0x00, 0x00, /* export */
    };
    cr_assert_lt(n, 120u);
    wt_bytes b = {malloc(sizeof head + 4 + n), sizeof head + 4 + n};
    cr_assert_not_null(b.data);
    memcpy(b.data, head, sizeof head);
    uint8_t *p = b.data + sizeof head;
    *p++ = 0x0a;             /* code section */
    *p++ = (uint8_t)(n + 2); /* its size */
    *p++ = 0x01;             /* one body */
    *p++ = (uint8_t)n;       /* of n bytes */
    memcpy(p, code, n);
    return b;
}

typedef struct body_case {
    const char *name;
    uint8_t code[24];
    size_t n;
} body_case;

Test(lc_wasm_xlate, invalid_modules_are_refused_by_the_validator) {
    static const body_case bad[] = {
        {"stack_underflow", {0x00, 0x6a, 0x1a, 0x0b}, 4},
        {"block_end_type_mismatch", {0x00, 0x02, 0x7f, 0x42, 0x01, 0x0b, 0x1a, 0x0b}, 8},
        {"block_end_extra_value", {0x00, 0x02, 0x40, 0x41, 0x01, 0x0b, 0x0b}, 7},
        {"br_bad_depth", {0x00, 0x02, 0x40, 0x0c, 0x05, 0x0b, 0x0b}, 7},
        {"bad_local_index", {0x00, 0x20, 0x03, 0x1a, 0x0b}, 5},
        {"call_indirect_bad_type", {0x00, 0x41, 0x00, 0x11, 0x09, 0x00, 0x0b}, 7},
        {"call_bad_function", {0x00, 0x10, 0x05, 0x0b}, 4},
        {"select_type_mismatch", {0x00, 0x41, 0x01, 0x42, 0x01, 0x41, 0x00, 0x1b, 0x1a, 0x0b}, 10},
        {"alignment_above_natural", {0x00, 0x41, 0x00, 0x28, 0x03, 0x00, 0x1a, 0x0b}, 8},
        {"if_without_else_with_result",
         {0x00, 0x41, 0x01, 0x04, 0x7f, 0x41, 0x01, 0x0b, 0x1a, 0x0b},
         10},
        {"else_without_if", {0x00, 0x05, 0x0b}, 3},
        {"br_table_arity_mismatch",
         {0x00, 0x02, 0x7f, 0x02, 0x40, 0x41, 0x00, 0x0e, 0x01, 0x00, 0x01, 0x0b, 0x41, 0x00, 0x0b,
          0x1a, 0x0b},
         17},
        {"bytes_after_end", {0x00, 0x0b, 0x01}, 3},
        {"memory_grow_reserved_byte", {0x00, 0x41, 0x01, 0x40, 0x01, 0x1a, 0x0b}, 7},
        {"br_if_value_type",
         {0x00, 0x02, 0x7f, 0x42, 0x01, 0x41, 0x01, 0x0d, 0x00, 0x0b, 0x1a, 0x0b},
         12},
        {"missing_end", {0x00, 0x01}, 2},
        {"global_out_of_range", {0x00, 0x23, 0x00, 0x1a, 0x0b}, 5},
    };
    static const body_case good[] = {
        {"polymorphic_after_unreachable", {0x00, 0x00, 0x6a, 0x1a, 0x0b}, 5},
        {"polymorphic_after_br",
         {0x00, 0x02, 0x7f, 0x41, 0x00, 0x0c, 0x00, 0x6a, 0x0b, 0x1a, 0x0b},
         11},
        {"empty", {0x00, 0x0b}, 2},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        wt_bytes b = module_with_body(bad[i].code, bad[i].n);
        cr_expect(!wabt_accepts(bad[i].name, &b), "%s: wasm-validate accepts it (bad test)",
                  bad[i].name);
        lc_wasm_xlate_out x;
        pie_status st;
        pie_code rc = lc_wasm_xlate(b.data, b.len, "wt", &x, &st);
        cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "%s: translated (%d): %s", bad[i].name, rc,
                     rc == PIE_OK ? "accepted" : st.msg);
        if (rc == PIE_OK) free(x.c);
        free(b.data);
    }
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        wt_bytes b = module_with_body(good[i].code, good[i].n);
        cr_expect(wabt_accepts(good[i].name, &b), "%s: wasm-validate refuses it (bad test)",
                  good[i].name);
        lc_wasm_xlate_out x;
        pie_status st;
        cr_expect_eq(lc_wasm_xlate(b.data, b.len, "wt", &x, &st), PIE_OK, "%s: %s", good[i].name,
                     st.msg);
        free(x.c);
        free(b.data);
    }
}

Test(lc_wasm_xlate, block_parameters_in_unreachable_code_keep_their_declared_types) {
    /* after `unreachable` one i32 is on the stack; the block takes (i64 i32): inside it the
     * stack is [i64 i32], so i32.add is a type error (the i32 present is the top parameter) */
    wt_bytes b = wat("unr_params",
                  "(module (type $p (func (param i64 i32)))\n"
                  "  (func (export \"_start\") unreachable (i32.const 0)\n"
                  "    (block (type $p) (param i64 i32) (i32.add) (drop))))\n",
                  "--no-check");
    cr_expect(!wabt_accepts("unr_params", &b), "wasm-validate accepts it (bad test)");
    lc_wasm_xlate_out x;
    pie_status st;
    pie_code rc = lc_wasm_xlate(b.data, b.len, "wt", &x, &st);
    cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "%d: %s", rc, rc == PIE_OK ? "accepted" : st.msg);
    if (rc == PIE_OK) free(x.c);
    free(b.data);
    /* and the valid use: i64 below, i32 on top */
    b = wat("unr_params_ok",
            "(module (type $p (func (param i64 i32)))\n"
            "  (func (export \"_start\") unreachable (i32.const 0)\n"
            "    (block (type $p) (param i64 i32) (drop) (drop))))\n",
            "");
    cr_expect_eq(lc_wasm_xlate(b.data, b.len, "wt", &x, &st), PIE_OK, "%s", st.msg);
    free(x.c);
    free(b.data);
}

Test(lc_wasm_xlate, a_data_count_without_its_segments_is_invalid) {
    static const uint8_t code[] = {0x00, 0x0b};
    wt_bytes b = module_with_body(code, sizeof code);
    /* a data count section (id 12) saying 1, before the code section; no data section */
    size_t at = b.len - (4 + sizeof code);
    uint8_t *d = realloc(b.data, b.len + 3);
    cr_assert_not_null(d);
    memmove(d + at + 3, d + at, b.len - at);
    d[at] = 0x0c, d[at + 1] = 0x01, d[at + 2] = 0x01;
    b.data = d;
    b.len += 3;
    /* malformed by the spec (5.5.16); wabt 1.0.32 does not check it, and wasm2c then gets it */
    lc_wasm_xlate_out x;
    pie_status st;
    pie_code rc = lc_wasm_xlate(b.data, b.len, "wt", &x, &st);
    cr_expect_eq(rc, PIE_INVALID_ARGUMENT, "%d: %s", rc, rc == PIE_OK ? "accepted" : st.msg);
    if (rc == PIE_OK) free(x.c);
    free(b.data);
}

Test(lc_wasm_xlate, call_indirect_of_a_multi_value_type_is_declined_and_runs_on_wasm2c) {
    wt_bytes b = command("multi_ci", "(type $m (func (result i32 i32))) (table 1 funcref)",
                      "(call_indirect (type $m) (i32.const 0)) (i32.add)");
    lc_wasm_xlate_out x;
    pie_status st;
    cr_expect_eq(lc_wasm_xlate(b.data, b.len, "wt", &x, &st), PIE_UNIMPLEMENTED, "%s", st.msg);
    pair p = pair_make();
    result own, w;
    cr_assert(run(p.own, &b, (const char *const[]){"multi_ci", NULL}, &own, &st), "%s", st.msg);
    cr_assert(run(p.w2c, &b, (const char *const[]){"multi_ci", NULL}, &w, &st), "%s", st.msg);
    cr_expect_eq(own.out.trap, LC_WASM_TRAP_CALL_INDIRECT, "%s", own.out.message);
    cr_expect_str_eq(own.out.message, w.out.message);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(p.own);
    cr_expect_eq(s.own_declines, 1u);
    cr_expect_eq(s.translations, 1u, "the declined module went to wasm2c");
    free(b.data);
    pair_destroy(&p);
}

Test(lc_wasm_xlate, a_tcc_that_stops_reading_the_own_c_falls_back_to_wasm2c) {
    /* tcc reads the own translator's C while it is made; one that fails part way (here a stand-in
     * that reads 100 bytes and exits 1; the wasm2c pipeline, with its -include, gets the real
     * one) must neither SIGPIPE the process nor lose the load: wasm2c compiles the module */
    char tcc[96], cmd[512];
    snprintf(tcc, sizeof tcc, "%s/failing-tcc", wt_dir);
    snprintf(cmd, sizeof cmd,
             "printf '#!/bin/sh\\nfor a; do [ \"$a\" = -include ] && exec tcc \"$@\"; done\\n"
             "head -c 100 >/dev/null; echo refused >&2; exit 1\\n' > %s && chmod +x %s",
             tcc, tcc);
    cr_assert_eq(sh(cmd), 0, "%s", cmd);
    lc_wasm_rt *rt = make_with("failing-tcc-cache", false, tcc);
    pie_status st;
    wt_bytes b = wt_fixture("big");
    result r;
    cr_assert(run(rt, &b, (const char *const[]){"big", NULL}, &r, &st), "%s", st.msg);
    cr_expect_eq(r.out.trap, LC_WASM_TRAP_NONE, "%s", r.out.message);
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.own_declines, 1u, "the refused C did not fall back");
    cr_expect_eq(s.translations, 1u, "wasm2c did not compile it");
    free(b.data);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm_xlate, an_invalid_module_is_rejected_through_the_runtime_as_wasm2c_rejects_it) {
    static const uint8_t code[] = {0x00, 0x02, 0x7f, 0x42, 0x01, 0x0b, 0x1a, 0x0b};
    wt_bytes b = module_with_body(code, sizeof code);
    pair p = pair_make();
    lc_wasm_module *m = NULL;
    pie_status a, c;
    cr_expect_eq(lc_wasm_module_load(p.own, b.data, b.len, &m, &a), PIE_INVALID_ARGUMENT);
    cr_expect_eq(lc_wasm_module_load(p.w2c, b.data, b.len, &m, &c), PIE_INVALID_ARGUMENT);
    cr_expect_str_eq(a.msg, c.msg);
    cr_expect_eq(lc_wasm_rt_stats_get(p.own).own_translations, 0u);
    free(b.data);
    pair_destroy(&p);
}

/* ---- large native frames --------------------------------------------------------------------- */

static size_t put_leb(uint8_t *p, uint32_t v) {
    size_t n = 0;
    do {
        uint8_t b = v & 0x7f;
        v >>= 7;
        p[n++] = v ? (uint8_t)(b | 0x80) : b;
    } while (v);
    return n;
}

/* A function () -> () that calls itself, then holds `values` i64 temporaries at once (pushed,
 * then stored at a block's entry): a native frame of 8 * values bytes per level, entered with
 * nothing written in it before the next call. */
static wt_bytes big_frame_module(uint32_t values) {
    size_t body_len = 1 + 2 * (size_t)values + 3 + 2 + values + 1;
    wt_bytes b = {malloc(body_len + 64), 0};
    cr_assert_not_null(b.data);
    static const uint8_t head[] = {0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, 0x01, 0x04,
                                   0x01, 0x60, 0x00, 0x00, 0x03, 0x02, 0x01, 0x00, 0x07, 0x0a,
                                   0x01, 0x06, '_',  's',  't',  'a',  'r',  't',  0x00, 0x00};
    uint8_t *p = b.data;
    memcpy(p, head, sizeof head);
    p += sizeof head;
    uint8_t lb[8];
    size_t ln = put_leb(lb, (uint32_t)body_len);
    *p++ = 0x0a;
    p += put_leb(p, (uint32_t)(1 + ln + body_len));
    *p++ = 0x01;
    memcpy(p, lb, ln);
    p += ln;
    *p++ = 0x00;              /* no locals */
    *p++ = 0x10, *p++ = 0x00; /* call 0 first: the return address is the frame's first write */
    for (uint32_t i = 0; i < values; i++) *p++ = 0x42, *p++ = 0x00; /* i64.const 0 */
    *p++ = 0x02, *p++ = 0x40, *p++ = 0x0b;                          /* block end */
    for (uint32_t i = 0; i < values; i++) *p++ = 0x1a;              /* drop */
    *p++ = 0x0b;
    b.len = (size_t)(p - b.data);
    return b;
}

typedef struct frame_run {
    lc_wasm_rt *rt;
    wt_bytes b;
    result r;
    bool loaded;
    pie_status st;
} frame_run;

static void *frame_thread(void *arg) {
    frame_run *f = arg;
    f->loaded = run(f->rt, &f->b, (const char *const[]){"big_frame", NULL}, &f->r, &f->st);
    return NULL;
}

Test(lc_wasm_xlate, a_native_frame_larger_than_the_stack_guard_traps_as_exhaustion) {
    /* 150,000 values: a 1.2 MB frame, far more than the smallest guard lc_wasm_instance_run
     * accepts (64 KiB, used here); the recursion must end in a stack-exhaustion trap, never
     * in a write past the guard */
    frame_run f = {.rt = make("own", false), .b = big_frame_module(150000)};
    cr_assert(wabt_accepts("big_frame", &f.b));
    pthread_attr_t a;
    cr_assert_eq(pthread_attr_init(&a), 0);
    /* 16.5 MiB: the level that runs out lands ~0.5 MB below the stack, past the guard */
    cr_assert_eq(pthread_attr_setstacksize(&a, (16u << 20) + (512u << 10)), 0);
    cr_assert_eq(pthread_attr_setguardsize(&a, 64u << 10), 0);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, &a, frame_thread, &f), 0);
    cr_assert_eq(pthread_join(t, NULL), 0);
    pthread_attr_destroy(&a);
    cr_assert(f.loaded, "%s", f.st.msg);
    cr_expect_eq(f.r.out.end, LC_WASM_TRAPPED, "%s", f.r.out.message);
    cr_expect_eq(f.r.out.trap, LC_WASM_TRAP_EXHAUSTION, "%s", f.r.out.message);
    cr_expect_eq(lc_wasm_rt_stats_get(f.rt).own_translations, 1u);
    free(f.b.data);
    lc_wasm_rt_destroy(f.rt);
}

Test(lc_wasm_xlate, compile_bombs_of_wasm2c_load_quickly_and_run) {
    /* 200,000 nested blocks crash wasm2c and 20,000 functions keep it busy for seconds (the
     * parser's limits keep both out by default; raised here): the own translator neither
     * recurses nor slows down with the number of functions */
    lc_wasm_rt_opts o = {.cache_dir = wt_dir,
                         .host_fns = wasm_test_host_fns,
                         .n_host_fns = wasm_test_host_n_fns,
                         .module_limits = {.max_nesting = 1000000, .max_functions = 1000000}};
    lc_wasm_rt *rt = NULL;
    pie_status st;
    cr_assert_eq(lc_wasm_rt_create(&o, &rt, &st), PIE_OK, "%s", st.msg);
    const pie_wasmgen_opts gens[] = {{.n_funcs = 1, .nest = 200000, .salt = 1},
                                     {.n_funcs = 20000, .salt = 2}};
    for (size_t i = 0; i < 2; i++) {
        wt_bytes b = {0};
        b.data = pie_wasmgen(&gens[i], &b.len);
        cr_assert_not_null(b.data);
        result r;
        cr_assert(run(rt, &b, (const char *const[]){"bomb", NULL}, &r, &st), "%zu: %s", i, st.msg);
        cr_expect_eq(r.out.end, LC_WASM_EXITED, "%zu: %s", i, r.out.message);
        free(b.data);
    }
    lc_wasm_rt_stats s = lc_wasm_rt_stats_get(rt);
    cr_expect_eq(s.own_translations, 2u);
    cr_expect_eq(s.translations, 0u);
    lc_wasm_rt_destroy(rt);
}

Test(lc_wasm_xlate, every_example_inferlet_translates_and_its_c_compiles) {
    /* They import the lifecycle's `pie` functions, which this test's host lacks, so they are
     * translated directly and compiled with tcc (tests/e2e runs them on the real host). */
    DIR *d = opendir(PIE_INFERLETS_DIR);
    cr_assert_not_null(d, "%s: %s", PIE_INFERLETS_DIR, strerror(errno));
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)) != NULL) {
        size_t l = strlen(e->d_name);
        if (l < 6 || strcmp(e->d_name + l - 5, ".wasm") != 0) continue;
        char path[512], cpath[256], cmd[768];
        snprintf(path, sizeof path, "%s/%s", PIE_INFERLETS_DIR, e->d_name);
        wt_bytes b = wt_read_file(path);
        lc_wasm_xlate_out x;
        pie_status st;
        cr_assert_eq(lc_wasm_xlate(b.data, b.len, "winferlet", &x, &st), PIE_OK, "%s: %s",
                     e->d_name, st.msg);
        snprintf(cpath, sizeof cpath, "%s/inferlet.c", wt_dir);
        FILE *f = fopen(cpath, "w");
        cr_assert_not_null(f);
        cr_assert_eq(fwrite(x.c, 1, x.len, f), x.len);
        cr_assert_eq(fclose(f), 0);
        snprintf(cmd, sizeof cmd, "tcc -c -o %s/inferlet.o %s", wt_dir, cpath);
        cr_expect_eq(sh(cmd), 0, "%s: tcc refused its C", e->d_name);
        free(x.c);
        free(b.data);
        n++;
    }
    closedir(d);
    cr_expect_geq(n, 10, "only %d inferlets in %s", n, PIE_INFERLETS_DIR);
}
