/* lc_wasm_compile.c — from wasm bytes to a loaded native library, and the cache directory.
 *
 * Owns: the cache directory <cache_dir>/<sha256>/ (module.wasm; wasm.h, the glue entry points
 * that wasm2c's code includes; t0.h, tcc's prelude; t0.so from wasm2c | tcc, t1.so from
 * wasm2c | cc -O2; and a `lock` file whose flock makes one process compile while others wait),
 * running the tools (posix_spawn, each in a process group of its own; a pipe from wasm2c to the
 * compiler; diagnostics captured for messages; killed on cancel, shutdown or the time limit),
 * the tier-0 compile slots (concurrency cap and queue), dlopen of a tier with its glue entry
 * points and executable segment, and the tier-1 thread. Every file a reader may open is written
 * under a temporary name and renamed into place, so a crash or a concurrent reader never sees half
 * a library. Does not own: which module is loaded when (lc_wasm_instance.c), the directory's
 * size bound and removing entries (lc_wasm_cache.c). */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lc_wasm_int.h"
#include "lc_wasm_xlate.h"

extern char **environ;

/* Sequence for temporary file names: process-wide because runtimes (and their tier-1 threads)
 * may write into the same cache entry at once; the pid separates processes. */
static atomic_uint g_tmp_seq;

/* ---- files --------------------------------------------------------------------------------- */

static pie_code path_join(char *out, const char *dir, const char *file, pie_status *st) {
    int n = snprintf(out, PATH_MAX, "%s/%s", dir, file);
    if (n < 0 || n >= PATH_MAX)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache path too long: %s/%s", dir, file);
    return PIE_OK;
}

static bool exists(const char *dir, const char *file) {
    char p[PATH_MAX];
    if (path_join(p, dir, file, NULL) != PIE_OK) return false;
    return access(p, F_OK) == 0;
}

static pie_code tmp_name(char *out, const char *final, pie_status *st) {
    int n = snprintf(out, PATH_MAX, "%s.tmp.%ld.%u", final, (long)getpid(),
                     atomic_fetch_add(&g_tmp_seq, 1u));
    if (n < 0 || n >= PATH_MAX)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "cache path too long: %s", final);
    return PIE_OK;
}

pie_code lc_wasm_write_file(const char *path, const void *data, size_t len, pie_status *st) {
    char tmp[PATH_MAX];
    if (tmp_name(tmp, path, st) != PIE_OK) return st->code;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return pie_status_set(st, PIE_INTERNAL, "create %s: %s", tmp, strerror(errno));
    const char *p = data;
    size_t left = len;
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = w < 0 ? errno : EIO;
            close(fd);
            unlink(tmp);
            return pie_status_set(st, PIE_INTERNAL, "write %s: %s", tmp, strerror(e));
        }
        p += w;
        left -= (size_t)w;
    }
    if (close(fd) != 0 || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return pie_status_set(st, PIE_INTERNAL, "write %s: %s", path, strerror(e));
    }
    return PIE_OK;
}

/* Writes dir/file with lc_wasm_write_file. */
static pie_code write_file(const char *dir, const char *file, const void *data, size_t len,
                           pie_status *st) {
    char final[PATH_MAX];
    if (path_join(final, dir, file, st) != PIE_OK) return st->code;
    return lc_wasm_write_file(final, data, len, st);
}

/* ---- tools ------------------------------------------------------------------------------------
 */

/* One spawned tool. Its diagnostics go to a memory file rather than a pipe, so that nobody has
 * to drain them while the tool runs (a pipeline has two tools and one waiting thread). Each tool
 * leads a process group of its own, so that killing the group also kills what it started (cc
 * runs cc1, as and ld). */
typedef struct lc_tool {
    const char *what; /* "tier-0 compile (tcc)": the start of every message about it */
    char *const *argv;
    pid_t pid;  /* 0 when not started or reaped; while not reaped also its process group */
    int pidfd;  /* readable once the tool exits; -1 when none (old kernels: polled instead) */
    int log_fd; /* memfd: stderr, and stdout unless that goes to a pipe; -1 when none */
    int status; /* waitpid status once reaped; -1 before (neither exited nor signalled) */
    uint64_t ended_ns; /* CLOCK_MONOTONIC when reaped (within a poll of its exit); 0 before */
} lc_tool;

static void tool_close(lc_tool *t) {
    if (t->log_fd >= 0) close(t->log_fd);
    t->log_fd = -1;
}

static int pidfd_of(pid_t pid) {
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    return -1;
#endif
}

/* Starts t->argv[0] (looked up in PATH) in dir, in a new process group, with stdin from in_fd
 * (-1: /dev/null) and stdout to out_fd (-1: the log). */
static pie_code tool_spawn(lc_tool *t, const char *dir, int in_fd, int out_fd, pie_status *st) {
    t->pid = 0;
    t->pidfd = -1;
    t->log_fd = memfd_create("lc_wasm_tool", MFD_CLOEXEC);
    if (t->log_fd < 0)
        return pie_status_set(st, PIE_INTERNAL, "%s: memfd_create: %s", t->what, strerror(errno));
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    pie_code rc = PIE_OK;
    bool fa_ok = posix_spawn_file_actions_init(&fa) == 0;
    bool attr_ok = fa_ok && posix_spawnattr_init(&attr) == 0;
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    if (!attr_ok ||
        (in_fd < 0 ? posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0)
                   : posix_spawn_file_actions_adddup2(&fa, in_fd, 0)) != 0 ||
        posix_spawn_file_actions_adddup2(&fa, out_fd < 0 ? t->log_fd : out_fd, 1) != 0 ||
        posix_spawn_file_actions_adddup2(&fa, t->log_fd, 2) != 0 ||
        posix_spawn_file_actions_addchdir_np(&fa, dir) != 0 ||
        posix_spawnattr_setsigmask(&attr, &none) != 0 ||
        posix_spawnattr_setsigdefault(&attr, &all) != 0 ||
        posix_spawnattr_setpgroup(&attr, 0) != 0 ||
        posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF |
                                            POSIX_SPAWN_SETPGROUP) != 0) {
        rc = pie_status_set(st, PIE_INTERNAL, "%s: posix_spawn setup failed", t->what);
        goto done;
    }
    int err = posix_spawnp(&t->pid, t->argv[0], &fa, &attr, t->argv, environ);
    if (err != 0) {
        t->pid = 0;
        rc = pie_status_set(st, PIE_FAILED_PRECONDITION, "%s: cannot run %s: %s", t->what,
                            t->argv[0], strerror(err));
    } else {
        t->pidfd = pidfd_of(t->pid);
    }
done:
    if (attr_ok) posix_spawnattr_destroy(&attr);
    if (fa_ok) posix_spawn_file_actions_destroy(&fa);
    if (rc != PIE_OK) tool_close(t);
    return rc;
}

/* Reaps t if it has ended; true once it is reaped (or was never started). */
static bool tool_reaped(lc_tool *t) {
    if (t->pid == 0) return true;
    pid_t r;
    while ((r = waitpid(t->pid, &t->status, WNOHANG)) < 0 && errno == EINTR) {}
    if (r == 0) return false;
    t->pid = 0; /* reaped (r == pid), or not our child any more (ECHILD): gone either way */
    t->ended_ns = lc_wasm_now_ns(CLOCK_MONOTONIC);
    if (t->pidfd >= 0) close(t->pidfd);
    t->pidfd = -1;
    return true;
}

static bool tool_ok(const lc_tool *t) {
    return WIFEXITED(t->status) && WEXITSTATUS(t->status) == 0;
}

/* Why a compile stops before its tools end. */
enum { LC_STOP_NONE, LC_STOP_CANCEL, LC_STOP_SHUTDOWN, LC_STOP_TIMEOUT };

/* Whether a compile (or a wait for one) must stop now: compiles stopped, cancel fired, or
 * deadline_ns (CLOCK_MONOTONIC; 0: none) passed. */
static int stop_reason(lc_wasm_rt *rt, lc_wasm_cancel *cancel, uint64_t deadline_ns) {
    if (atomic_load(&rt->compiles_stopped)) return LC_STOP_SHUTDOWN;
    if (cancel != NULL && atomic_load(&cancel->fired)) return LC_STOP_CANCEL;
    if (deadline_ns != 0 && lc_wasm_now_ns(CLOCK_MONOTONIC) >= deadline_ns) return LC_STOP_TIMEOUT;
    return LC_STOP_NONE;
}

/* The status of a load stopped by cancel or shutdown (not a timeout: the caller words that). */
static pie_code stop_status(int why, pie_status *st) {
    if (why == LC_STOP_CANCEL)
        return pie_status_set(st, PIE_CANCELLED, "compile cancelled: the caller went away");
    return pie_status_set(st, PIE_UNAVAILABLE,
                          "compile stopped: the lifecycle is shutting down; try again");
}

/* Waits until every tool of a pipeline has ended and is reaped. When cancel fires, compiles are
 * stopped or deadline_ns passes, kills every tool's process group (so the wait ends within
 * LC_WASM_CANCEL_POLL_MS) and returns why; LC_STOP_NONE when the tools ended by themselves. */
static int tools_wait(lc_wasm_rt *rt, lc_tool *const *tools, size_t n, lc_wasm_cancel *cancel,
                      uint64_t deadline_ns) {
    int why = LC_STOP_NONE;
    for (;;) {
        struct pollfd pf[2];
        nfds_t np = 0;
        bool running = false, polled = false;
        for (size_t i = 0; i < n; i++) {
            if (tool_reaped(tools[i])) continue;
            running = true;
            if (tools[i]->pidfd >= 0 && np < 2)
                pf[np++] = (struct pollfd){.fd = tools[i]->pidfd, .events = POLLIN};
            else
                polled = true;
        }
        if (!running) return why;
        if (why == LC_STOP_NONE && (why = stop_reason(rt, cancel, deadline_ns)) != LC_STOP_NONE)
            for (size_t i = 0; i < n; i++)
                if (tools[i]->pid > 0) kill(-tools[i]->pid, SIGKILL); /* not reaped: still ours */
        int slice_ms = polled ? 5 : LC_WASM_CANCEL_POLL_MS;
        if (why == LC_STOP_NONE && deadline_ns != 0) {
            uint64_t now = lc_wasm_now_ns(CLOCK_MONOTONIC);
            uint64_t left_ms = deadline_ns > now ? (deadline_ns - now) / 1000000u + 1 : 0;
            if (left_ms < (uint64_t)slice_ms) slice_ms = (int)left_ms;
        }
        (void)poll(pf, np, slice_ms); /* EINTR or a timeout: look again */
    }
}

/* "SIGSEGV (signal 11, Segmentation fault)" */
static void signal_text(int sig, char *out, size_t n) {
    const char *abbrev = sigabbrev_np(sig), *descr = sigdescr_np(sig);
    if (abbrev)
        snprintf(out, n, "SIG%s (signal %d, %s)", abbrev, sig, descr ? descr : "unknown");
    else
        snprintf(out, n, "signal %d", sig);
}

/* The first bytes of t's output on one line, into out (n bytes); returns its length. */
static size_t tool_output(const lc_tool *t, char *out, size_t n) {
    ssize_t got = t->log_fd >= 0 ? pread(t->log_fd, out, n - 1, 0) : 0;
    size_t used = got > 0 ? (size_t)got : 0;
    out[used] = '\0';
    while (used > 0 && (out[used - 1] == '\n' || out[used - 1] == ' ')) out[--used] = '\0';
    for (char *c = out; *c; c++)
        if (*c == '\n') *c = ' ';
    return used;
}

/* The status of a tool that did not exit 0, with the start of its output on one line:
 * INTERNAL when a signal killed it (it crashed), INVALID_ARGUMENT when it exited non-zero. */
static pie_code tool_error(const lc_tool *t, pie_status *st) {
    char out[1024];
    size_t used = tool_output(t, out, sizeof out);
    if (WIFSIGNALED(t->status)) {
        char sig[96];
        signal_text(WTERMSIG(t->status), sig, sizeof sig);
        return pie_status_set(st, PIE_INTERNAL, "%s: %s crashed: killed by %s%s%s", t->what,
                              t->argv[0], sig, used ? ": " : "", out);
    }
    return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s failed: %s", t->what,
                          used ? out : "(no output)");
}

/* ---- translation and compilation ----------------------------------------------------------------
 *
 * wasm2c writes the C to its stdout and the compiler reads it from its stdin as it comes: the two
 * run at once (on two cores the cold load takes about the longer of the two, not their sum), and
 * no C file is written. wasm2c's stdout form is the header followed by the code, which includes
 * "wasm.h" (the header's name in that form) after the header's text: the cache entry's wasm.h is
 * our glue, compiled in the same translation unit. Tier 1 translates again (tens of ms beside
 * seconds of cc -O2) rather than keeping 2 MB of C per module on disk. */

/* The glue gives the host entry points with fixed C types (no calls through mismatched function
 * pointer types) and the size of the generated instance struct. wasm2c orders the import
 * instances of Z_<name>_instantiate by module name, so "pie" comes before "wasi_...". */
static pie_code write_glue(lc_wasm_module *m, pie_status *st) {
    const char *n = m->cname;
    char text[2048];
    int len = snprintf(text, sizeof text,
                       "/* Generated by lc_wasm (services/lifecycle/wasm/lc_wasm_compile.c): the\n"
                       " * lc_wasm entry points, included by wasm2c's code after its header. */\n"
                       "struct Z_pie_instance_t;\n"
                       "struct Z_wasi_snapshot_preview1_instance_t;\n"
                       "size_t %s_lc_instance_size(void) { return sizeof(Z_%s_instance_t); }\n"
                       "void %s_lc_init_module(void) { Z_%s_init_module(); }\n"
                       "void %s_lc_instantiate(void *i, struct Z_pie_instance_t *p,\n"
                       "                       struct Z_wasi_snapshot_preview1_instance_t *w) {\n"
                       "  (void)p; (void)w;\n"
                       "  Z_%s_instantiate((Z_%s_instance_t *)i%s%s);\n"
                       "}\n"
                       "void %s_lc_start(void *i) { Z_%sZ__start((Z_%s_instance_t *)i); }\n"
                       "void %s_lc_free(void *i) { Z_%s_free((Z_%s_instance_t *)i); }\n",
                       n, n, n, n, n, n, n, m->imports_pie ? ", p" : "",
                       m->imports_wasi ? ", w" : "", n, n, n, n, n, n);
    if (len < 0 || (size_t)len >= sizeof text)
        return pie_status_set(st, PIE_INTERNAL, "glue text too long");
    return write_file(m->dir, "wasm.h", text, (size_t)len, st);
}

/* Tier 0 compiles with this prelude (tcc -include) in front of wasm2c's output. tcc 0.9.27 lacks
 * the bit-counting builtins that wasm2c's code uses (gcc and clang have them; wasm2c maps a zero
 * argument of clz/ctz to the bit width before calling them), and without __has_builtin wasm-rt.h
 * makes every linear-memory load and store a call of libc memcpy; a plain access of the right
 * width is 30% faster at tier 0 (wasm is little-endian like every host we build for, and x86-64
 * and arm64 allow unaligned access). wasm-rt.h is included first so that its definition of
 * wasm_rt_memcpy can be replaced. */
static const char tcc_prelude[] =
    "/* Generated by lc_wasm (services/lifecycle/wasm/lc_wasm_compile.c). */\n"
    "#include \"wasm-rt.h\"\n"
    "static int lc_clz64(unsigned long long x) { int n = 0; while (!(x >> 63)) { x <<= 1; n++; } "
    "return n; }\n"
    "static int lc_ctz64(unsigned long long x) { int n = 0; while (!(x & 1)) { x >>= 1; n++; } "
    "return n; }\n"
    "static int lc_popcount64(unsigned long long x) { int n = 0; while (x) { x &= x - 1; n++; } "
    "return n; }\n"
    "#define __builtin_clz(x) (lc_clz64((unsigned long long)(unsigned)(x)) - 32)\n"
    "#define __builtin_clzll(x) lc_clz64((unsigned long long)(x))\n"
    "#define __builtin_ctz(x) lc_ctz64((unsigned long long)(unsigned)(x))\n"
    "#define __builtin_ctzll(x) lc_ctz64((unsigned long long)(x))\n"
    "#define __builtin_popcount(x) lc_popcount64((unsigned long long)(unsigned)(x))\n"
    "#define __builtin_popcountll(x) lc_popcount64((unsigned long long)(x))\n"
    "#undef wasm_rt_memcpy\n"
    "#define wasm_rt_memcpy(d, s, n) do { \\\n"
    "  if ((n) == 4) *(unsigned *)(d) = *(const unsigned *)(s); \\\n"
    "  else if ((n) == 8) *(unsigned long long *)(d) = *(const unsigned long long *)(s); \\\n"
    "  else if ((n) == 1) *(unsigned char *)(d) = *(const unsigned char *)(s); \\\n"
    "  else if ((n) == 2) *(unsigned short *)(d) = *(const unsigned short *)(s); \\\n"
    "  else memcpy((d), (s), (n)); } while (0)\n";

/* The status of a pipeline in which a tool failed. wasm2c's own failure is the module's fault
 * (it validates: INVALID_ARGUMENT with its reason; it aborts on features it cannot translate,
 * SIMD for one; it crashes on modules beyond what it can handle, which the parser's limits are
 * there to keep out), unless the compiler died first and took wasm2c's pipe with it; a failing
 * compiler is ours (INTERNAL). */
static pie_code pipeline_error(const lc_tool *w2c, const lc_tool *cc, pie_status *st) {
    bool broken_pipe = WIFSIGNALED(w2c->status) && WTERMSIG(w2c->status) == SIGPIPE;
    if (tool_ok(w2c) || (broken_pipe && !tool_ok(cc))) {
        tool_error(cc, st);
        return st->code = PIE_INTERNAL;
    }
    char out[1024], sig[96];
    size_t used = tool_output(w2c, out, sizeof out);
    if (!WIFSIGNALED(w2c->status))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "invalid wasm module (wasm2c): %s",
                              used ? out : "(no output)");
    int signo = WTERMSIG(w2c->status);
    signal_text(signo, sig, sizeof sig);
    if (signo == SIGABRT)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "unsupported wasm module: %s aborted, %s%s%s; SIMD "
                              "(-msimd128) and other post-MVP features that wasm2c 1.0.32 lacks "
                              "do this",
                              w2c->what, sig, used ? ": " : "", out);
    return pie_status_set(st, PIE_INVALID_ARGUMENT,
                          "%s crashed on this module, killed by %s%s%s; it cannot be "
                          "compiled here (very deep nesting or very large functions do this)",
                          w2c->what, sig, used ? ": " : "", out);
}

/* The pipe from wasm2c to the compiler: 1 MiB (Linux's default limit for F_SETPIPE_SZ) instead of
 * 64 KiB saves ~5 ms of the two tools' wake-ups on a 2 MB translation. */
#define LC_WASM_PIPE_BYTES (1 << 20)

/* "60 s" or "1500 ms" */
static void duration_text(uint64_t ms, char *out, size_t n) {
    if (ms % 1000 == 0)
        snprintf(out, n, "%llu s", (unsigned long long)(ms / 1000));
    else
        snprintf(out, n, "%llu ms", (unsigned long long)ms);
}

/* RESOURCE_EXHAUSTED for a compile (what) that ran out of timeout_ms (the setting timeout_key)
 * with `running` still at work. */
static pie_code timeout_status(const char *what, uint64_t timeout_ms, const char *timeout_key,
                               const char *running, pie_status *st) {
    char d[32];
    duration_text(timeout_ms, d, sizeof d);
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                          "%s: gave up after %s (%s) with %s still running: the module is too "
                          "large or complex to compile here in time (fewer or smaller "
                          "functions compile faster)",
                          what, d, timeout_key, running);
}

/* wasm2c | compiler, both reaped; PIE_OK when both exited 0. Killed (both process groups) when
 * cancel fires, compiles are stopped, or timeout_ms passes (then RESOURCE_EXHAUSTED naming
 * timeout_key and the tool still running). */
static pie_code run_pipeline(lc_wasm_rt *rt, lc_tool *w2c, lc_tool *cc, const char *dir,
                             lc_wasm_cancel *cancel, uint64_t timeout_ms, const char *timeout_key,
                             pie_status *st) {
    int stopped = stop_reason(rt, cancel, 0);
    if (stopped != LC_STOP_NONE) return stop_status(stopped, st); /* nothing to start */
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return pie_status_set(st, PIE_INTERNAL, "pipe: %s", strerror(errno));
    (void)fcntl(p[1], F_SETPIPE_SZ, LC_WASM_PIPE_BYTES); /* best effort: 64 KiB works too */
    uint64_t deadline_ns = lc_wasm_now_ns(CLOCK_MONOTONIC) + timeout_ms * 1000000u;
    pie_code rc = tool_spawn(w2c, dir, -1, p[1], st);
    close(p[1]);
    if (rc == PIE_OK) rc = tool_spawn(cc, dir, p[0], -1, st);
    close(p[0]); /* with no compiler reading, wasm2c ends at its first write */
    lc_tool *const both[2] = {w2c, cc};
    int why = tools_wait(rt, both, 2, cancel, deadline_ns);
    /* the tool still running when the time was up: wasm2c if our SIGKILL ended it */
    bool w2c_ran_out = WIFSIGNALED(w2c->status) && WTERMSIG(w2c->status) == SIGKILL;
    if (rc == PIE_OK && why == LC_STOP_TIMEOUT) {
        rc = timeout_status(cc->what, timeout_ms, timeout_key,
                            w2c_ran_out ? "wasm2c (translating to C)" : "the C compiler", st);
    } else if (rc == PIE_OK && why != LC_STOP_NONE) {
        rc = stop_status(why, st);
    } else if (rc == PIE_OK && (!tool_ok(w2c) || !tool_ok(cc))) {
        rc = pipeline_error(w2c, cc, st);
    }
    if (tool_ok(w2c)) atomic_fetch_add(&rt->translations, 1u);
    tool_close(w2c);
    tool_close(cc);
    return rc;
}

/* Translates module.wasm and compiles it into t<tier>.so with tcc (tier 0) or cc -O2 (tier 1).
 * Tier 0 adds where its time went to the runtime's t0_* sums (files_ns: time spent before it
 * on the cache entry's files, added to the glue's). */
static pie_code compile(lc_wasm_module *m, int tier, lc_wasm_cancel *cancel, uint64_t files_ns,
                        pie_status *st) {
    lc_wasm_rt *rt = m->rt;
    uint64_t t_files = lc_wasm_now_ns(CLOCK_MONOTONIC);
    char final[PATH_MAX], tmp[PATH_MAX];
    if (path_join(final, m->dir, tier ? "t1.so" : "t0.so", st) != PIE_OK ||
        tmp_name(tmp, final, st) != PIE_OK)
        return st->code;
    /* written again for tier 1: a cache entry of an older version may lack it */
    if (write_glue(m, st) != PIE_OK) return st->code;
    char *w2c_argv[] = {rt->wasm2c, "module.wasm", "-n", m->cname, NULL};
    char *tcc_argv[] = {rt->tcc,    "-shared", "-fPIC", "-o",  tmp,
                        "-include", "t0.h",    "-",     "-lm", NULL};
    char *cc_argv[] = {rt->cc, "-O2", "-shared", "-fPIC", "-w",  "-o",
                       tmp,    "-x",  "c",       "-",     "-lm", NULL};
    lc_tool w2c = {.what = "wasm2c (translate to C)",
                   .argv = w2c_argv,
                   .pidfd = -1,
                   .log_fd = -1,
                   .status = -1};
    lc_tool cc = {.what = tier ? "tier-1 compile (cc -O2)" : "tier-0 compile (tcc)",
                  .argv = tier ? cc_argv : tcc_argv,
                  .pidfd = -1,
                  .log_fd = -1,
                  .status = -1};
    uint64_t t_start = lc_wasm_now_ns(CLOCK_MONOTONIC);
    pie_code rc = run_pipeline(rt, &w2c, &cc, m->dir, cancel,
                               tier ? rt->tier1_timeout_ms : rt->compile_timeout_ms,
                               tier ? "runtime.tier1_timeout" : "runtime.compile_timeout", st);
    if (rc == PIE_OK && rename(tmp, final) != 0)
        rc = pie_status_set(st, PIE_INTERNAL, "rename %s: %s", tmp, strerror(errno));
    if (rc != PIE_OK) {
        unlink(tmp);
        return rc;
    }
    atomic_fetch_add(tier ? &rt->tier1_compiles : &rt->tier0_compiles, 1u);
    if (tier == 0) {
        atomic_fetch_add(&rt->t0_files_ns, files_ns + (t_start - t_files));
        /* both were reaped after t_start (tools_wait returns once they are) */
        atomic_fetch_add(&rt->t0_translate_ns, w2c.ended_ns > t_start ? w2c.ended_ns - t_start : 0);
        atomic_fetch_add(&rt->t0_compile_ns, cc.ended_ns > t_start ? cc.ended_ns - t_start : 0);
    }
    return PIE_OK;
}

/* The translator's sink while tcc reads its C through a socket (a socket rather than a pipe:
 * send's MSG_NOSIGNAL makes a tcc that stopped reading an error here, not a SIGPIPE of the
 * whole lifecycle). A full socket waits for tcc in slices, so a cancel, a shutdown or the
 * compile's deadline still stops the translation within LC_WASM_CANCEL_POLL_MS. */
typedef struct own_feed {
    lc_wasm_rt *rt;
    lc_wasm_cancel *cancel;
    uint64_t deadline_ns;
    int fd;
    int why;     /* LC_STOP_*: why the feed stopped the translation */
    bool broken; /* tcc stopped reading (it exited): its status says why */
} own_feed;

static bool own_feed_write(void *user, const char *text, size_t n, pie_status *st) {
    own_feed *f = user;
    while (n > 0) {
        ssize_t w = send(f->fd, text, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            text += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            f->broken = true;
            pie_status_set(st, PIE_INTERNAL, "tcc stopped reading the C text: %s", strerror(errno));
            return false;
        }
        if ((f->why = stop_reason(f->rt, f->cancel, f->deadline_ns)) != LC_STOP_NONE) {
            pie_status_set(st, PIE_CANCELLED, "translation stopped");
            return false;
        }
        struct pollfd pf = {.fd = f->fd, .events = POLLOUT};
        (void)poll(&pf, 1, LC_WASM_CANCEL_POLL_MS); /* EINTR or a timeout: look again */
    }
    return true;
}

/* The end of a tier-0 compile of the own translator's C: t0.so in place and the compile
 * counted (files_ns before it; the translation overlaps the compile: its own time, and the
 * compile's from the compiler's start), or tmp removed. Returns rc, or the rename's failure. */
static pie_code own_finish(lc_wasm_rt *rt, pie_code rc, const char *tmp, const char *final,
                           uint64_t files_ns, uint64_t translate_ns, uint64_t compile_ns,
                           pie_status *st) {
    if (rc == PIE_OK && rename(tmp, final) != 0)
        rc = pie_status_set(st, PIE_INTERNAL, "rename %s: %s", tmp, strerror(errno));
    if (rc != PIE_OK) {
        unlink(tmp);
        return rc;
    }
    atomic_fetch_add(&rt->tier0_compiles, 1u);
    atomic_fetch_add(&rt->t0_files_ns, files_ns);
    atomic_fetch_add(&rt->t0_translate_ns, translate_ns);
    atomic_fetch_add(&rt->t0_compile_ns, compile_ns);
    return PIE_OK;
}

/* Tier 0 with our own translator: tcc starts first and compiles the C as the translator makes
 * it (tcc is one pass: it compiles each function as it reads it), so the translation hides
 * behind the compile instead of preceding it; t0.so as compile() makes it. The translator's
 * own failure (declined, invalid: *xst says why) and tcc refusing our C (a translator bug:
 * stderr says why) return LC_XL_FALLBACK, after which the caller uses wasm2c, except a
 * translation out of memory, which is final like a stop or a time-out. */
#define LC_XL_FALLBACK ((pie_code)-1)
static pie_code compile_own(lc_wasm_module *m, const uint8_t *wasm, size_t len,
                            lc_wasm_cancel *cancel, uint64_t files_ns, pie_status *xst,
                            pie_status *st) {
    lc_wasm_rt *rt = m->rt;
    char final[PATH_MAX], tmp[PATH_MAX];
    if (path_join(final, m->dir, "t0.so", st) != PIE_OK || tmp_name(tmp, final, st) != PIE_OK)
        return st->code;
    int stopped = stop_reason(rt, cancel, 0);
    if (stopped != LC_STOP_NONE) return stop_status(stopped, st);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return pie_status_set(st, PIE_INTERNAL, "socketpair for the C text: %s", strerror(errno));
    char *argv[] = {rt->tcc, "-shared", "-fPIC", "-o", tmp, "-", "-lm", NULL};
    lc_tool cc = {.what = "tier-0 compile (tcc, own translation)",
                  .argv = argv,
                  .pidfd = -1,
                  .log_fd = -1,
                  .status = -1};
    uint64_t t_start = lc_wasm_now_ns(CLOCK_MONOTONIC);
    uint64_t deadline_ns = t_start + rt->compile_timeout_ms * 1000000u;
    pie_code rc = tool_spawn(&cc, m->dir, sv[1], -1, st);
    close(sv[1]);
    own_feed feed = {.rt = rt, .cancel = cancel, .deadline_ns = deadline_ns, .fd = sv[0]};
    lc_wasm_xlate_sink sink = {.write = own_feed_write, .user = &feed};
    pie_code xrc = PIE_OK;
    if (rc == PIE_OK) xrc = lc_wasm_xlate_to(wasm, len, m->cname, &sink, NULL, xst);
    uint64_t t_xlated = lc_wasm_now_ns(CLOCK_MONOTONIC);
    close(sv[0]); /* the end of the text for tcc */
    bool translated = xrc == PIE_OK || feed.broken;
    if (rc == PIE_OK && !translated && cc.pid > 0) kill(-cc.pid, SIGKILL); /* half a text */
    lc_tool *const one[1] = {&cc};
    int why = rc == PIE_OK ? tools_wait(rt, one, 1, cancel, deadline_ns) : LC_STOP_NONE;
    if (rc == PIE_OK && feed.why != LC_STOP_NONE) why = feed.why;
    if (rc != PIE_OK) {
        /* tcc did not start: rc and st say why */
    } else if (why == LC_STOP_TIMEOUT) {
        rc = timeout_status(cc.what, rt->compile_timeout_ms, "runtime.compile_timeout",
                            "the C compiler", st);
    } else if (why != LC_STOP_NONE) {
        rc = stop_status(why, st);
    } else if (!translated) {
        rc = xrc == PIE_RESOURCE_EXHAUSTED
                 ? pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "translating: %s", xst->msg)
                 : LC_XL_FALLBACK;
    } else if (feed.broken || !tool_ok(&cc)) { /* tcc ended before the text did: it failed */
        char out[512];
        tool_output(&cc, out, sizeof out);
        fprintf(stderr, "lc_wasm: tcc refused lc_wasm_xlate's C for module %s (a translator "
                        "bug; using wasm2c): %s\n", m->id, out);
        pie_status_set(xst, PIE_INTERNAL, "tcc refused the own translator's C");
        rc = LC_XL_FALLBACK;
    }
    tool_close(&cc);
    return own_finish(rt, rc, tmp, final, files_ns, t_xlated - t_start,
                      cc.ended_ns > t_start ? cc.ended_ns - t_start : 0, st);
}

/* ---- the compile helpers ---------------------------------------------------------------------
 * pie-tcc-helper (helper/lc_tcc_helper.c) compiles the own translator's C with libtcc in a
 * process kept between modules: no exec and no fresh heap per compile (bench/results/wasm.md,
 * 2026-11-30). One per compile slot, each held by one compile; the same statuses as a tcc child
 * (compile_own): a timeout, a cancel or a shutdown kills it (started again by the next compile),
 * a crash leaves the compile to a tcc child, a refusal (a translator bug) falls back to
 * wasm2c. */

#define LC_TCCH_ANSWER_MAX  1024           /* helper/lc_tcc_helper.c HELPER_MSG_MAX */
#define LC_TCCH_UNAVAILABLE ((pie_code)-2) /* no helper free or startable: use a tcc child */

static void helper_kill(lc_tcch *h) {
    if (h->pid > 0) {
        kill(-h->pid, SIGKILL);
        while (waitpid(h->pid, NULL, 0) < 0 && errno == EINTR) {}
    }
    if (h->fd >= 0) close(h->fd);
    h->pid = 0;
    h->fd = -1;
}

void lc_wasm_helpers_stop(lc_wasm_rt *rt) {
    if (rt->helpers == NULL) return;
    for (uint32_t i = 0; i < rt->max_compiles; i++) {
        pthread_mutex_lock(&rt->helpers[i].mu); /* compiles have ended: stop_compiles came first */
        helper_kill(&rt->helpers[i]);
        pthread_mutex_unlock(&rt->helpers[i].mu);
        pthread_mutex_destroy(&rt->helpers[i].mu);
    }
}

/* A helper no compile holds, held now; NULL when all are busy. */
static lc_tcch *helper_take(lc_wasm_rt *rt) {
    for (uint32_t i = 0; rt->helpers != NULL && i < rt->max_compiles; i++)
        if (pthread_mutex_trylock(&rt->helpers[i].mu) == 0) return &rt->helpers[i];
    return NULL;
}

/* Starts h's process (its control socket on descriptor 3, in a process group of its own). */
static bool helper_start(lc_wasm_rt *rt, lc_tcch *h) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return false;
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    bool ok = posix_spawn_file_actions_init(&fa) == 0;
    if (!ok) {
        close(sv[0]);
        close(sv[1]);
        return false;
    }
    ok = posix_spawnattr_init(&attr) == 0;
    if (ok) {
        sigset_t none, all; /* as tool_spawn: no signal blocked or handled from this process */
        sigemptyset(&none);
        sigfillset(&all);
        ok = posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0) == 0 &&
             posix_spawn_file_actions_adddup2(&fa, sv[1], 3) == 0 &&
             posix_spawnattr_setsigmask(&attr, &none) == 0 &&
             posix_spawnattr_setsigdefault(&attr, &all) == 0 &&
             posix_spawnattr_setpgroup(&attr, 0) == 0 &&
             posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF |
                                                 POSIX_SPAWN_SETPGROUP) == 0;
        char *argv[] = {rt->tcc_helper, NULL};
        pid_t pid = 0;
        if (ok) ok = posix_spawn(&pid, rt->tcc_helper, &fa, &attr, argv, environ) == 0;
        if (ok) {
            h->pid = pid;
            h->fd = sv[0];
            atomic_fetch_add(&rt->helper_starts, 1u);
        }
        posix_spawnattr_destroy(&attr);
    }
    posix_spawn_file_actions_destroy(&fa);
    close(sv[1]);
    if (!ok) close(sv[0]);
    return ok;
}

/* Asks h to compile what text_fd will carry into out_path. */
static bool helper_send(lc_tcch *h, const char *out_path, int text_fd) {
    char cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {.iov_base = (void *)out_path, .iov_len = strlen(out_path) + 1};
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &text_fd, sizeof(int));
    ssize_t n;
    do n = sendmsg(h->fd, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)iov.iov_len;
}

/* Waits for h's answer: LC_STOP_NONE with answer filled ("" when the helper died), or why it
 * stopped (then the caller kills it). */
static int helper_wait(lc_wasm_rt *rt, lc_tcch *h, lc_wasm_cancel *cancel, uint64_t deadline_ns,
                       char *answer, size_t cap) {
    for (;;) {
        int why = stop_reason(rt, cancel, deadline_ns);
        if (why != LC_STOP_NONE) return why;
        struct pollfd pf = {.fd = h->fd, .events = POLLIN};
        int slice_ms = LC_WASM_CANCEL_POLL_MS;
        uint64_t now = lc_wasm_now_ns(CLOCK_MONOTONIC);
        uint64_t left_ms = deadline_ns > now ? (deadline_ns - now) / 1000000u + 1 : 0;
        if (left_ms < (uint64_t)slice_ms) slice_ms = (int)left_ms;
        if (poll(&pf, 1, slice_ms) <= 0) continue; /* EINTR or a timeout: look again */
        ssize_t n = recv(h->fd, answer, cap - 1, 0);
        if (n < 0 && errno == EINTR) continue;
        answer[n > 0 ? n : 0] = '\0';
        return LC_STOP_NONE;
    }
}

/* compile_own with a helper instead of a tcc child (LC_TCCH_UNAVAILABLE: none free or
 * startable, nothing done). */
static pie_code compile_own_helper(lc_wasm_module *m, const uint8_t *wasm, size_t len,
                                   lc_wasm_cancel *cancel, uint64_t files_ns, pie_status *xst,
                                   pie_status *st) {
    lc_wasm_rt *rt = m->rt;
    lc_tcch *h = helper_take(rt);
    if (h == NULL) return LC_TCCH_UNAVAILABLE;
    char final[PATH_MAX], tmp[PATH_MAX];
    pie_code rc = PIE_OK;
    int sv[2] = {-1, -1};
    if (path_join(final, m->dir, "t0.so", st) != PIE_OK || tmp_name(tmp, final, st) != PIE_OK) {
        rc = st->code;
        goto out;
    }
    int stopped = stop_reason(rt, cancel, 0);
    if (stopped != LC_STOP_NONE) {
        rc = stop_status(stopped, st);
        goto out;
    }
    if ((h->pid == 0 && !helper_start(rt, h)) ||
        socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        rc = LC_TCCH_UNAVAILABLE;
        goto out;
    }
    uint64_t t_start = lc_wasm_now_ns(CLOCK_MONOTONIC);
    uint64_t deadline_ns = t_start + rt->compile_timeout_ms * 1000000u;
    if (!helper_send(h, tmp, sv[1])) { /* it died since its last compile */
        helper_kill(h);
        rc = LC_TCCH_UNAVAILABLE;
        goto out;
    }
    close(sv[1]);
    sv[1] = -1;
    own_feed feed = {.rt = rt, .cancel = cancel, .deadline_ns = deadline_ns, .fd = sv[0]};
    lc_wasm_xlate_sink sink = {.write = own_feed_write, .user = &feed};
    pie_code xrc = lc_wasm_xlate_to(wasm, len, m->cname, &sink, NULL, xst);
    uint64_t t_xlated = lc_wasm_now_ns(CLOCK_MONOTONIC);
    close(sv[0]); /* the end of the text for tcc */
    sv[0] = -1;
    bool translated = xrc == PIE_OK || feed.broken;
    char answer[LC_TCCH_ANSWER_MAX];
    int why = feed.why;
    if (why == LC_STOP_NONE && translated)
        why = helper_wait(rt, h, cancel, deadline_ns, answer, sizeof answer);
    if (why != LC_STOP_NONE || !translated) helper_kill(h); /* mid-compile, or half a text */
    uint64_t t_done = lc_wasm_now_ns(CLOCK_MONOTONIC);
    if (why == LC_STOP_TIMEOUT) {
        rc =
            timeout_status("tier-0 compile (pie-tcc-helper, own translation)",
                           rt->compile_timeout_ms, "runtime.compile_timeout", "the C compiler", st);
    } else if (why != LC_STOP_NONE) {
        rc = stop_status(why, st);
    } else if (!translated) {
        rc = xrc == PIE_RESOURCE_EXHAUSTED
                 ? pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "translating: %s", xst->msg)
                 : LC_XL_FALLBACK;
    } else if (answer[0] == '\0') { /* it died: a tcc child tries (the next compile restarts it) */
        helper_kill(h);
        fprintf(stderr,
                "lc_wasm: pie-tcc-helper died compiling module %s; a tcc child compiles "
                "it\n",
                m->id);
        rc = LC_TCCH_UNAVAILABLE;
    } else if (strcmp(answer, "ok") != 0) { /* refused: a translator bug */
        fprintf(stderr,
                "lc_wasm: pie-tcc-helper refused lc_wasm_xlate's C for module %s (a translator "
                "bug; using wasm2c): %s\n",
                m->id, answer);
        pie_status_set(xst, PIE_INTERNAL, "tcc refused the own translator's C");
        rc = LC_XL_FALLBACK;
    }
    rc = own_finish(rt, rc, tmp, final, files_ns, t_xlated - t_start, t_done - t_start, st);
    if (rc == PIE_OK) atomic_fetch_add(&rt->helper_compiles, 1u);
out:
    if (sv[0] >= 0) close(sv[0]);
    if (sv[1] >= 0) close(sv[1]);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

/* Tier 0 from the bytes: module.wasm (which tier 1 translates again), then our translator and
 * tcc; for a module it declines (or whose C tcc refuses), the prelude and the wasm2c pipeline. */
static pie_code translate_compile(lc_wasm_module *m, const uint8_t *wasm, size_t len,
                                  lc_wasm_cancel *cancel, uint64_t files_ns, pie_status *st) {
    lc_wasm_rt *rt = m->rt;
    uint64_t t0 = lc_wasm_now_ns(CLOCK_MONOTONIC);
    if (write_file(m->dir, "module.wasm", wasm, len, st) != PIE_OK) return st->code;
    pie_status xst;
    pie_status_set(&xst, PIE_UNIMPLEMENTED, "tier 0 uses wasm2c for every module here");
    if (!rt->tier0_wasm2c) {
        uint64_t t1 = lc_wasm_now_ns(CLOCK_MONOTONIC);
        pie_code rc = compile_own_helper(m, wasm, len, cancel, files_ns + (t1 - t0), &xst, st);
        if (rc == LC_TCCH_UNAVAILABLE)
            rc = compile_own(m, wasm, len, cancel, files_ns + (t1 - t0), &xst, st);
        if (rc != LC_XL_FALLBACK) {
            if (rc == PIE_OK) atomic_fetch_add(&rt->own_translations, 1u);
            return rc;
        }
        atomic_fetch_add(&rt->own_declines, 1u); /* declined, invalid or refused: wasm2c says */
    }
    if (m->no_wasm2c[0])
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "unsupported wasm module: %s, and wasm2c 1.0.32, which compiles the "
                              "modules that the own translator does not (here: %s), would pass "
                              "that function a wrong instance when it is called through the table",
                              m->no_wasm2c, xst.msg);
    if (write_file(m->dir, "t0.h", tcc_prelude, sizeof tcc_prelude - 1, st) != PIE_OK)
        return st->code;
    return compile(m, 0, cancel, files_ns + (lc_wasm_now_ns(CLOCK_MONOTONIC) - t0), st);
}

/* ---- the tier-0 compile slots ----------------------------------------------------------------
 * At most rt->max_compiles tier-0 compiles at once, up to rt->compile_queue loads waiting for
 * one (polling cancel and stop every LC_WASM_CANCEL_POLL_MS), RESOURCE_EXHAUSTED beyond. */

static pie_code slot_acquire(lc_wasm_rt *rt, lc_wasm_cancel *cancel, pie_status *st) {
    pthread_mutex_lock(&rt->mu);
    if (rt->n_compiling >= rt->max_compiles && rt->n_queued >= rt->compile_queue) {
        uint32_t running = rt->n_compiling, queued = rt->n_queued;
        pthread_mutex_unlock(&rt->mu);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "too many programs being compiled: %u compiles running (the limit, "
                              "runtime.max_compiles) and %u waiting (the limit, "
                              "runtime.compile_queue); try again later",
                              running, queued);
    }
    rt->n_queued++;
    pie_code rc = PIE_OK;
    while (rt->n_compiling >= rt->max_compiles) {
        int why = stop_reason(rt, cancel, 0);
        if (why != LC_STOP_NONE) {
            rc = stop_status(why, st);
            break;
        }
        uint64_t t = lc_wasm_now_ns(CLOCK_MONOTONIC) + LC_WASM_CANCEL_POLL_MS * 1000000u;
        struct timespec ts = {(time_t)(t / 1000000000u), (long)(t % 1000000000u)};
        pthread_cond_timedwait(&rt->slot_cv, &rt->mu, &ts);
    }
    rt->n_queued--;
    if (rc == PIE_OK) rt->n_compiling++;
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

static void slot_release(lc_wasm_rt *rt) {
    pthread_mutex_lock(&rt->mu);
    rt->n_compiling--;
    pthread_cond_signal(&rt->slot_cv);
    pthread_mutex_unlock(&rt->mu);
}

/* flock(LOCK_EX) of the cache entry's lock file, given up when cancel fires or compiles stop
 * (another process may be compiling this module for as long as its time limit). */
static pie_code lock_entry(lc_wasm_rt *rt, int fd, const char *path, lc_wasm_cancel *cancel,
                           pie_status *st) {
    while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EINTR) continue;
        if (errno != EWOULDBLOCK)
            return pie_status_set(st, PIE_INTERNAL, "flock %s: %s", path, strerror(errno));
        int why = stop_reason(rt, cancel, 0);
        if (why != LC_STOP_NONE) return stop_status(why, st);
        (void)poll(NULL, 0, 10);
    }
    return PIE_OK;
}

/* ---- loading a tier ----------------------------------------------------------------------------
 */

typedef struct text_search {
    const char *name;
    uintptr_t base, lo, hi;
} text_search;

static int find_text(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    text_search *s = data;
    if (info->dlpi_addr != s->base || info->dlpi_name == NULL || strcmp(info->dlpi_name, s->name))
        return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_X)) continue;
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr, hi = lo + ph->p_memsz;
        if (s->lo == 0 || lo < s->lo) s->lo = lo;
        if (hi > s->hi) s->hi = hi;
    }
    return 1;
}

/* dlsym of "<cname>_lc_<what>" into a function pointer of any type. */
static bool glue_sym(void *dl, const char *cname, const char *what, void *fnptr_out) {
    char sym[96];
    snprintf(sym, sizeof sym, "%s_lc_%s", cname, what);
    void *p = dlsym(dl, sym);
    if (p == NULL) return false;
    memcpy(fnptr_out, &p, sizeof p); /* POSIX: dlsym results convert to function pointers */
    return true;
}

static pie_code code_open(lc_wasm_module *m, int tier, lc_wasm_code **out, pie_status *st) {
    char path[PATH_MAX];
    if (path_join(path, m->dir, tier ? "t1.so" : "t0.so", st) != PIE_OK) return st->code;
    void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (dl == NULL) return pie_status_set(st, PIE_INTERNAL, "dlopen: %s", dlerror());
    lc_wasm_code *c = calloc(1, sizeof *c);
    size_t (*size_fn)(void) = NULL;
    void (*init_fn)(void) = NULL;
    if (c == NULL) {
        dlclose(dl);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (!glue_sym(dl, m->cname, "instance_size", &size_fn) ||
        !glue_sym(dl, m->cname, "init_module", &init_fn) ||
        !glue_sym(dl, m->cname, "instantiate", &c->instantiate) ||
        !glue_sym(dl, m->cname, "start", &c->start) ||
        !glue_sym(dl, m->cname, "free", &c->free_instance)) {
        dlclose(dl);
        free(c);
        return pie_status_set(st, PIE_INTERNAL, "%s lacks the lc_wasm glue entry points", path);
    }
    struct link_map *lm = NULL;
    text_search s = {0};
    if (dlinfo(dl, RTLD_DI_LINKMAP, &lm) == 0 && lm != NULL) {
        s.name = lm->l_name;
        s.base = lm->l_addr;
        dl_iterate_phdr(find_text, &s);
    }
    if (s.lo == 0 || s.hi <= s.lo) {
        dlclose(dl);
        free(c);
        return pie_status_set(st, PIE_INTERNAL, "%s: executable segment not found", path);
    }
    c->tier = tier;
    c->dl = dl;
    c->text_lo = s.lo;
    c->text_hi = s.hi;
    c->instance_size = size_fn();
    atomic_init(&c->refs, 1);
    init_fn(); /* registers the module's function types; never traps */
    *out = c;
    return PIE_OK;
}

void lc_wasm_code_release(lc_wasm_code *c) {
    if (c == NULL || atomic_fetch_sub(&c->refs, 1) != 1) return;
    dlclose(c->dl);
    free(c);
}

/* ---- a module's first load
 * ----------------------------------------------------------------------- */

/* True if c was compiled from wasm2c's C (which defines Z_<cname>_instantiate; the own
 * translator's C defines only the glue entry points). */
static bool code_from_wasm2c(const lc_wasm_module *m, const lc_wasm_code *c) {
    char sym[64];
    snprintf(sym, sizeof sym, "Z_%s_instantiate", m->cname);
    return dlsym(c->dl, sym) != NULL;
}

/* Opens tier t from the directory if its library is there; a library that fails to load (a
 * truncated file from a full disk, say) is removed so that it is rebuilt, and so is one made by
 * wasm2c for a module that must not run on wasm2c's code (written by a version before that
 * check). */
static bool try_cached(lc_wasm_module *m, int tier) {
    const char *file = tier ? "t1.so" : "t0.so";
    if (!exists(m->dir, file) || (tier == 1 && m->no_wasm2c[0])) return false;
    pie_status ignored;
    if (code_open(m, tier, &m->code, &ignored) == PIE_OK) {
        if (!m->no_wasm2c[0] || !code_from_wasm2c(m, m->code)) return true;
        lc_wasm_code_release(m->code);
        m->code = NULL;
    }
    char p[PATH_MAX];
    if (path_join(p, m->dir, file, NULL) == PIE_OK) unlink(p);
    return false;
}

/* Creates the module's cache entry if need be and takes its lock: the lock file's descriptor,
 * or -1. An entry removed meanwhile (lc_wasm_cache.c unlinks the lock file last, holding it) is
 * made again: the lock we waited for is then no longer the entry's. */
static int entry_open_locked(lc_wasm_module *m, lc_wasm_cancel *cancel, pie_status *st) {
    char lock_path[PATH_MAX];
    if (path_join(lock_path, m->dir, "lock", st) != PIE_OK) return -1;
    for (int attempt = 0; attempt < 16; attempt++) {
        if (mkdir(m->dir, 0700) != 0 && errno != EEXIST) {
            pie_status_set(st, PIE_INTERNAL, "mkdir %s: %s", m->dir, strerror(errno));
            return -1;
        }
        int lock = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (lock < 0 && errno == ENOENT) continue; /* the directory went between the two */
        if (lock < 0) {
            pie_status_set(st, PIE_INTERNAL, "open %s: %s", lock_path, strerror(errno));
            return -1;
        }
        if (lock_entry(m->rt, lock, lock_path, cancel, st) != PIE_OK) {
            close(lock);
            return -1;
        }
        struct stat sb;
        if (fstat(lock, &sb) == 0 && sb.st_nlink > 0) return lock;
        flock(lock, LOCK_UN);
        close(lock);
    }
    pie_status_set(st, PIE_UNAVAILABLE, "cache entry %s was removed again at each of 16 tries",
                   m->dir);
    return -1;
}

pie_code lc_wasm_compile_load(lc_wasm_module *m, const uint8_t *wasm, size_t len,
                              lc_wasm_cancel *cancel, pie_status *st) {
    lc_wasm_rt *rt = m->rt;
    uint64_t t_entry = lc_wasm_now_ns(CLOCK_MONOTONIC);
    int lock = entry_open_locked(m, cancel, st);
    if (lock < 0) return st->code;
    lc_wasm_cache_used(lock);
    pie_code rc = PIE_OK;
    uint64_t entry_ns = lc_wasm_now_ns(CLOCK_MONOTONIC) - t_entry; /* mkdir, lock */
    uint64_t before = 0;
    bool compiled = false;
    if (try_cached(m, 1) || try_cached(m, 0)) {
        atomic_fetch_add(&rt->disk_hits, 1u);
    } else if ((rc = slot_acquire(rt, cancel, st)) == PIE_OK) {
        before = lc_wasm_cache_entry_bytes(m->dir);
        compiled = true;
        rc = translate_compile(m, wasm, len, cancel, entry_ns, st);
        slot_release(rt);
        uint64_t t_open = lc_wasm_now_ns(CLOCK_MONOTONIC);
        if (rc == PIE_OK) rc = code_open(m, 0, &m->code, st);
        if (rc == PIE_OK)
            atomic_fetch_add(&rt->t0_open_ns, lc_wasm_now_ns(CLOCK_MONOTONIC) - t_open);
    }
    flock(lock, LOCK_UN);
    close(lock);
    /* after the unlock: a prune skips entries whose lock is held, and this module is listed */
    if (compiled) lc_wasm_cache_grew(rt, before, lc_wasm_cache_entry_bytes(m->dir));
    if (rc == PIE_OK)
        m->tier1 = m->code->tier == 1 ? LC_WASM_T1_DONE
                   : !rt->tier1       ? LC_WASM_T1_OFF
                   : m->no_wasm2c[0]  ? LC_WASM_T1_SKIPPED
                                      : LC_WASM_T1_QUEUED;
    return rc;
}

/* ---- tier 1
 * ---------------------------------------------------------------------------------------- */

static void tier1_build(lc_wasm_module *m) {
    pie_status st;
    lc_wasm_code *c = NULL;
    uint64_t before = lc_wasm_cache_entry_bytes(m->dir);
    pie_code rc = compile(m, 1, NULL, 0, &st);
    if (rc == PIE_OK) rc = code_open(m, 1, &c, &st);
    if (rc == PIE_OK) {
        /* Tier 0's library is dead weight on disk now (loads open t1.so first; instances that
         * run on t0.so keep it mapped): half the entry. Gone before tier 1 is announced. */
        char t0[PATH_MAX];
        if (path_join(t0, m->dir, "t0.so", NULL) == PIE_OK) (void)unlink(t0);
    }
    pthread_mutex_lock(&m->mu);
    if (rc == PIE_OK) {
        lc_wasm_code *old = m->code;
        m->code = c; /* later instances start on tier 1; running ones keep their reference */
        m->tier1 = LC_WASM_T1_DONE;
        pthread_cond_broadcast(&m->cv);
        pthread_mutex_unlock(&m->mu);
        lc_wasm_code_release(old);
        lc_wasm_cache_grew(m->rt, before, lc_wasm_cache_entry_bytes(m->dir));
        return;
    }
    m->tier1 = LC_WASM_T1_FAILED;
    snprintf(m->tier1_err, sizeof m->tier1_err, "%s", st.msg);
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
}

void *lc_wasm_tier1_main(void *arg) {
    lc_wasm_rt *rt = arg;
    pthread_mutex_lock(&rt->mu);
    for (;;) {
        while (!rt->stopping && rt->t1_head == NULL) pthread_cond_wait(&rt->t1_cv, &rt->mu);
        if (rt->stopping) break;
        lc_wasm_module *m = rt->t1_head;
        rt->t1_head = m->t1_next;
        if (rt->t1_head == NULL) rt->t1_tail = NULL;
        m->t1_next = NULL;
        m->refs++; /* the compile's: queued modules are held by someone (t1_unlink) */
        pthread_mutex_unlock(&rt->mu);
        tier1_build(m);
        lc_wasm_module_release(m);
        pthread_mutex_lock(&rt->mu);
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}
