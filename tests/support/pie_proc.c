/* pie_proc.c — see pie_proc.h.
 *
 * Children are made with fork + execve rather than posix_spawn because the child must ask the
 * kernel to kill it when the test process dies (prctl PR_SET_PDEATHSIG): a Criterion test that
 * times out is SIGKILLed and runs no clean-up, and orphaned services would hold their ports and
 * keep ctest waiting. Between fork and execve the child calls only async-signal-safe functions;
 * everything it needs (argv, envp, the log fd, the exec error text) is prepared before fork. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* close_range */
#endif
#include "pie_proc.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef PIE_BIN_DIR
#error "PIE_BIN_DIR must name the directory of the service binaries (tests/CMakeLists.txt sets it)"
#endif

#define PIE_PROC_POLL_MS 5          /* between looks at a log or at waitpid */
#define PIE_PROC_TAIL_BYTES 3000    /* log tail appended to failure messages */

extern char **environ;

struct pie_proc {
    char name[64];          /* basename of the binary: "pie-worker" */
    char log_path[256];
    pid_t pid;
    bool reaped;
    int status;             /* exit status (0..255) or 128 + signal, once reaped */
    int grpc_port, metrics_port;
    char addr[32];          /* "127.0.0.1:<grpc_port>" */
    struct pie_proc *next;  /* in live_procs */
};

/* Processes not yet destroyed, for the atexit handler: a failed cr_assert leaves the test
 * function without running its clean-up, and the children and log files would outlive it.
 * Global because atexit handlers take no argument; guarded by live_mu. */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static pie_proc *live_procs;
static pthread_once_t atexit_once = PTHREAD_ONCE_INIT;

static void kill_and_free(pie_proc *p);

static void destroy_live_procs(void) {
    pthread_mutex_lock(&live_mu);
    pie_proc *p = live_procs;
    live_procs = NULL;
    pthread_mutex_unlock(&live_mu);
    while (p) {
        pie_proc *next = p->next;
        kill_and_free(p);
        p = next;
    }
}

static void register_atexit(void) { atexit(destroy_live_procs); }

static void live_add(pie_proc *p) {
    pthread_once(&atexit_once, register_atexit);
    pthread_mutex_lock(&live_mu);
    p->next = live_procs;
    live_procs = p;
    pthread_mutex_unlock(&live_mu);
}

static void live_remove(pie_proc *p) {
    pthread_mutex_lock(&live_mu);
    for (pie_proc **q = &live_procs; *q; q = &(*q)->next) {
        if (*q == p) {
            *q = p->next;
            break;
        }
    }
    pthread_mutex_unlock(&live_mu);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---- environment and argv ------------------------------------------------------------------- */

static size_t env_name_len(const char *entry) {
    const char *eq = strchr(entry, '=');
    return eq ? (size_t)(eq - entry) : strlen(entry);
}

static bool env_overridden(const char *entry, const char *const *over, size_t n_over) {
    size_t len = env_name_len(entry);
    for (size_t i = 0; i < n_over; i++)
        if (env_name_len(over[i]) == len && strncmp(entry, over[i], len) == 0) return true;
    return false;
}

static size_t count_strings(const char *const *v) {
    size_t n = 0;
    while (v && v[n]) n++;
    return n;
}

/* environ without PIE_* + the ephemeral-port defaults + extra (later entries win). The strings
 * are borrowed; the caller frees only the array. */
static char **build_env(const char *const *extra) {
    static const char *const defaults[] = {"PIE_SERVER_LISTEN=127.0.0.1:0",
                                           "PIE_METRICS_LISTEN=127.0.0.1:0"};
    size_t n_extra = count_strings(extra), n_env = count_strings((const char *const *)environ);
    char **envp = calloc(n_env + 2 + n_extra + 1, sizeof *envp);
    if (envp == NULL) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++)
        if (strncmp(environ[i], "PIE_", 4) != 0) envp[k++] = environ[i];
    for (size_t i = 0; i < 2; i++)
        if (!env_overridden(defaults[i], extra, n_extra)) envp[k++] = (char *)defaults[i];
    for (size_t i = 0; i < n_extra; i++)
        if (!env_overridden(extra[i], extra + i + 1, n_extra - i - 1)) envp[k++] = (char *)extra[i];
    envp[k] = NULL;
    return envp;
}

static char **build_argv(const char *path, const char *const *args) {
    size_t n = count_strings(args);
    char **argv = calloc(n + 2, sizeof *argv);
    if (argv == NULL) return NULL;
    argv[0] = (char *)path;
    for (size_t i = 0; i < n; i++) argv[i + 1] = (char *)args[i];
    return argv;
}

/* ---- spawning ------------------------------------------------------------------------------- */

/* The child, between fork and execve: async-signal-safe calls only. */
static void child_exec(const char *path, char **argv, char **envp, int log_fd, pid_t parent,
                       const char *exec_err, size_t exec_err_len) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127);
    /* stdin is an empty pipe, not /dev/null: on some machines (this project's CI among them)
     * /dev/null is a regular file that collects whatever was written to it, and a child that
     * reads stdin (piectl run) would see that instead of end of input. */
    int in[2];
    if (pipe(in) != 0 || close(in[1]) != 0 || dup2(in[0], 0) < 0 || dup2(log_fd, 1) < 0 ||
        dup2(log_fd, 2) < 0)
        _exit(127);
    close_range(3, ~0u, 0); /* nothing of the test process (Criterion's pipes, sockets) leaks */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGPIPE, &sa, NULL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execve(path, argv, envp);
    ssize_t w = write(2, exec_err, exec_err_len);
    (void)w;
    _exit(127);
}

static void basename_of(const char *path, char *out, size_t n) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t len = strnlen(base, n - 1);
    memcpy(out, base, len);
    out[len] = '\0';
}

pie_proc *pie_proc_spawn(const char *bin, const pie_proc_opts *opts, pie_status *st) {
    char path[512], exec_err[640];
    char **argv = NULL, **envp = NULL;
    int log_fd = -1;
    pie_proc *p = calloc(1, sizeof *p);
    if (p == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "pie_proc_spawn: out of memory");
        return NULL;
    }
    if (strchr(bin, '/'))
        snprintf(path, sizeof path, "%s", bin);
    else
        snprintf(path, sizeof path, "%s/%s", PIE_BIN_DIR, bin);
    basename_of(path, p->name, sizeof p->name);
    if (access(path, X_OK) != 0) {
        pie_status_set(st, PIE_NOT_FOUND, "%s: cannot execute '%s': %s", p->name, path,
                       strerror(errno));
        goto fail;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(p->log_path, sizeof p->log_path, "%s/%s-XXXXXX.log", tmp && tmp[0] ? tmp : "/tmp",
             p->name);
    log_fd = mkostemps(p->log_path, 4, O_CLOEXEC | O_APPEND);
    if (log_fd < 0) {
        pie_status_set(st, PIE_INTERNAL, "%s: cannot create log '%s': %s", p->name, p->log_path,
                       strerror(errno));
        p->log_path[0] = '\0';
        goto fail;
    }
    argv = build_argv(path, opts ? opts->args : NULL);
    envp = build_env(opts ? opts->env : NULL);
    if (argv == NULL || envp == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "pie_proc_spawn: out of memory");
        goto fail;
    }
    int n_err = snprintf(exec_err, sizeof exec_err, "pie_proc: cannot execute %s\n", path);
    size_t err_len = n_err < 0 ? 0 : (size_t)n_err >= sizeof exec_err ? sizeof exec_err - 1 : (size_t)n_err;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) child_exec(path, argv, envp, log_fd, parent, exec_err, err_len);
    if (pid < 0) {
        pie_status_set(st, PIE_INTERNAL, "%s: fork: %s", p->name, strerror(errno));
        goto fail;
    }
    p->pid = pid;
    close(log_fd);
    free(argv);
    free(envp);
    live_add(p);
    return p;
fail:
    if (log_fd >= 0) close(log_fd);
    if (p->log_path[0]) unlink(p->log_path);
    free(argv);
    free(envp);
    free(p);
    return NULL;
}

/* ---- exit status ---------------------------------------------------------------------------- */

static int decode_status(int wstatus) {
    if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
    if (WIFSIGNALED(wstatus)) return 128 + WTERMSIG(wstatus);
    return -1;
}

/* Reaps p if it has ended (block: wait for it). Returns true once reaped. */
static bool try_reap(pie_proc *p, bool block) {
    if (p->reaped) return true;
    int wstatus;
    pid_t r;
    do {
        r = waitpid(p->pid, &wstatus, block ? 0 : WNOHANG);
    } while (r < 0 && errno == EINTR);
    if (r == p->pid) {
        p->reaped = true;
        p->status = decode_status(wstatus);
    } else if (r < 0) { /* ECHILD: someone else reaped it; nothing more to learn */
        p->reaped = true;
        p->status = -1;
    }
    return p->reaped;
}

int pie_proc_wait(pie_proc *p, int64_t timeout_ms, pie_status *st) {
    int64_t deadline = now_ms() + timeout_ms;
    while (!try_reap(p, false)) {
        if (now_ms() >= deadline) {
            kill(p->pid, SIGKILL);
            try_reap(p, true);
            char *tail = pie_proc_log_tail(p, PIE_PROC_TAIL_BYTES);
            pie_status_set(st, PIE_DEADLINE_EXCEEDED,
                           "%s (pid %d) did not exit within %lld ms; killed it. Log tail:\n%s",
                           p->name, (int)p->pid, (long long)timeout_ms, tail ? tail : "");
            free(tail);
            return -1;
        }
        sleep_ms(PIE_PROC_POLL_MS);
    }
    pie_status_ok(st);
    return p->status;
}

pie_code pie_proc_signal(pie_proc *p, int sig, pie_status *st) {
    if (p->reaped)
        return pie_status_set(st, PIE_FAILED_PRECONDITION, "%s (pid %d) has already exited (%d)",
                              p->name, (int)p->pid, p->status);
    if (kill(p->pid, sig) != 0)
        return pie_status_set(st, PIE_INTERNAL, "kill %s (pid %d) with %d: %s", p->name,
                              (int)p->pid, sig, strerror(errno));
    pie_status_ok(st);
    return PIE_OK;
}

int pie_proc_stop(pie_proc *p, int64_t timeout_ms, pie_status *st) {
    if (!p->reaped) (void)kill(p->pid, SIGTERM);
    return pie_proc_wait(p, timeout_ms, st);
}

static void kill_and_free(pie_proc *p) {
    if (!p->reaped) {
        kill(p->pid, SIGKILL);
        try_reap(p, true);
    }
    unlink(p->log_path);
    free(p);
}

void pie_proc_destroy(pie_proc *p) {
    if (p == NULL) return;
    live_remove(p);
    kill_and_free(p);
}

/* ---- the log -------------------------------------------------------------------------------- */

char *pie_proc_log(const pie_proc *p) {
    int fd = open(p->log_path, O_RDONLY | O_CLOEXEC);
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    if (buf == NULL) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    while (fd >= 0) {
        if (cap - len < 2048) {
            char *bigger = realloc(buf, cap * 2);
            if (bigger == NULL) {
                free(buf);
                close(fd);
                return NULL;
            }
            buf = bigger;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        len += (size_t)r;
    }
    if (fd >= 0) close(fd);
    buf[len] = '\0';
    return buf;
}

char *pie_proc_log_tail(const pie_proc *p, size_t max_bytes) {
    char *log = pie_proc_log(p);
    if (log == NULL) return NULL;
    size_t len = strlen(log);
    if (len <= max_bytes) return log;
    const char *start = log + len - max_bytes;
    const char *nl = memchr(start, '\n', max_bytes);
    if (nl && nl + 1 < log + len) start = nl + 1;
    memmove(log, start, strlen(start) + 1);
    return log;
}

size_t pie_proc_log_count(const pie_proc *p, const char *needle) {
    char *log = pie_proc_log(p);
    size_t n = 0, step = strlen(needle) ? strlen(needle) : 1;
    for (const char *s = log; s && (s = strstr(s, needle)) != NULL; s += step) n++;
    free(log);
    return n;
}

bool pie_proc_log_has_line(const pie_proc *p, const char *line) {
    char *log = pie_proc_log(p);
    size_t len = strlen(line);
    bool found = false;
    for (const char *s = log; s && *s && !found;) {
        const char *nl = strchr(s, '\n');
        size_t l = nl ? (size_t)(nl - s) : strlen(s);
        found = l == len && memcmp(s, line, len) == 0;
        s = nl ? nl + 1 : s + l;
    }
    free(log);
    return found;
}

bool pie_proc_wait_log(const pie_proc *p, const char *needle, size_t n, int64_t timeout_ms) {
    int64_t deadline = now_ms() + timeout_ms;
    for (;;) {
        if (pie_proc_log_count(p, needle) >= n) return true;
        if (now_ms() >= deadline) return false;
        sleep_ms(PIE_PROC_POLL_MS);
    }
}

/* ---- readiness ------------------------------------------------------------------------------ */

/* Finds "key=<digits>" in [line, end) and returns the number, or -1. */
static int int_field(const char *line, const char *end, const char *key) {
    size_t klen = strlen(key);
    for (const char *s = line; s + klen < end; s++) {
        if ((s == line || s[-1] == ' ') && strncmp(s, key, klen) == 0) {
            char *stop;
            long v = strtol(s + klen, &stop, 10);
            return stop > s + klen && v >= 0 && v <= 65535 ? (int)v : -1;
        }
    }
    return -1;
}

/* true once the log holds the started line and, after it, serving=true; sets the ports. */
static bool parse_ready(pie_proc *p, const char *log) {
    const char *started = strstr(log, "event=svc.started ");
    if (started == NULL) return false;
    const char *eol = strchr(started, '\n');
    if (eol == NULL || strstr(eol, "event=svc.health serving=true") == NULL) return false;
    p->grpc_port = int_field(started, eol, "grpc_port=");
    p->metrics_port = int_field(started, eol, "metrics_port=");
    snprintf(p->addr, sizeof p->addr, "127.0.0.1:%d", p->grpc_port);
    return true;
}

pie_code pie_proc_wait_ready(pie_proc *p, int64_t timeout_ms, pie_status *st) {
    int64_t deadline = now_ms() + timeout_ms;
    for (;;) {
        char *log = pie_proc_log(p);
        bool ready = log && parse_ready(p, log);
        free(log);
        if (ready) {
            if (p->grpc_port <= 0 || p->metrics_port < 0) {
                char *tail = pie_proc_log_tail(p, PIE_PROC_TAIL_BYTES);
                pie_status_set(st, PIE_INTERNAL, "%s: svc.started line without ports. Log:\n%s",
                               p->name, tail ? tail : "");
                free(tail);
                return PIE_INTERNAL;
            }
            pie_status_ok(st);
            return PIE_OK;
        }
        bool exited = try_reap(p, false);
        if (exited || now_ms() >= deadline) {
            char *tail = pie_proc_log_tail(p, PIE_PROC_TAIL_BYTES);
            pie_code code =
                exited ? pie_status_set(st, PIE_UNAVAILABLE,
                                        "%s exited with status %d before serving. Log:\n%s",
                                        p->name, p->status, tail ? tail : "")
                       : pie_status_set(st, PIE_DEADLINE_EXCEEDED,
                                        "%s (pid %d) was not serving after %lld ms. Log:\n%s",
                                        p->name, (int)p->pid, (long long)timeout_ms,
                                        tail ? tail : "");
            free(tail);
            return code;
        }
        sleep_ms(PIE_PROC_POLL_MS * 2);
    }
}

pie_proc *pie_proc_start(const char *bin, const pie_proc_opts *opts, int64_t timeout_ms,
                         pie_status *st) {
    pie_proc *p = pie_proc_spawn(bin, opts, st);
    if (p == NULL) return NULL;
    if (pie_proc_wait_ready(p, timeout_ms, st) != PIE_OK) {
        pie_proc_destroy(p);
        return NULL;
    }
    return p;
}

int pie_proc_pid(const pie_proc *p) { return (int)p->pid; }
const char *pie_proc_name(const pie_proc *p) { return p->name; }
const char *pie_proc_log_path(const pie_proc *p) { return p->log_path; }
int pie_proc_grpc_port(const pie_proc *p) { return p->grpc_port; }
int pie_proc_metrics_port(const pie_proc *p) { return p->metrics_port; }
const char *pie_proc_addr(const pie_proc *p) { return p->addr; }

const char *pie_proc_env_controller(const pie_proc *ctl, char *buf, size_t n) {
    snprintf(buf, n, "PIE_CONTROLLER_ADDRESS=%s", ctl->addr);
    return buf;
}

/* ---- ports and temporary files -------------------------------------------------------------- */

int pie_proc_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &alen) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

char *pie_proc_tmpdir(pie_status *st) {
    const char *tmp = getenv("TMPDIR");
    char templ[512];
    snprintf(templ, sizeof templ, "%s/pie-test-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (mkdtemp(templ) == NULL) {
        pie_status_set(st, PIE_INTERNAL, "mkdtemp '%s': %s", templ, strerror(errno));
        return NULL;
    }
    char *dir = strdup(templ);
    if (dir == NULL) {
        rmdir(templ);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "pie_proc_tmpdir: out of memory");
    }
    return dir;
}

char *pie_proc_write_file(const char *dir, const char *name, const char *text, pie_status *st) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *path = malloc(n);
    if (path == NULL) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "pie_proc_write_file: out of memory");
        return NULL;
    }
    snprintf(path, n, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        pie_status_set(st, PIE_INTERNAL, "cannot create '%s': %s", path, strerror(errno));
        goto fail;
    }
    size_t len = strlen(text);
    bool ok = fwrite(text, 1, len, f) == len;
    if (fclose(f) != 0) ok = false;
    if (!ok) {
        pie_status_set(st, PIE_INTERNAL, "cannot write '%s'", path);
        goto fail;
    }
    return path;
fail:
    free(path);
    return NULL;
}

void pie_proc_rmdir(const char *dir) {
    if (dir == NULL) return;
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        char path[1024];
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(dir);
}

pie_code pie_proc_metric(const pie_proc *p, const char *series, double *value, pie_status *st) {
    int port = pie_proc_metrics_port(p);
    if (port <= 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "%s serves no metrics", pie_proc_name(p));
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return pie_status_set(st, PIE_UNAVAILABLE, "socket: %s", strerror(errno));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const char req[] = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        write(fd, req, sizeof req - 1) != (ssize_t)(sizeof req - 1)) {
        close(fd);
        return pie_status_set(st, PIE_UNAVAILABLE, "metrics port %d: %s", port, strerror(errno));
    }
    size_t cap = 1 << 20, len = 0;
    char *body = malloc(cap);
    if (!body) {
        close(fd);
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (ssize_t n; (n = read(fd, body + len, cap - 1 - len)) > 0;) len += (size_t)n;
    close(fd);
    body[len] = '\0';
    char key[256];
    snprintf(key, sizeof key, "\n%s ", series);
    const char *at = strstr(body, key);
    if (at) *value = strtod(at + strlen(key), NULL);
    free(body);
    if (!at)
        return pie_status_set(st, PIE_NOT_FOUND, "no series %s in %s's metrics", series,
                              pie_proc_name(p));
    return PIE_OK;
}
