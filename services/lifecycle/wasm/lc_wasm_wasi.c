/* lc_wasm_wasi.c — the WASI preview1 import module (wasi_snapshot_preview1) for inferlets.
 *
 * Owns: every function of WASI preview1 as wasm2c calls it (Z_wasi_snapshot_preview1Z_<name>),
 * and the table of their names and types that module loading checks imports against.
 * Implemented: args and environ (from the instance options), clocks, random (getrandom),
 * fd_write to fds 1 and 2 through the instance's output callback, fd_read of fd 0 (always end of
 * input), fd_fdstat_get / fd_filestat_get of fds 0-2 (character devices, so wasi-libc line-buffers
 * stdout), poll_oneoff on clocks (sleeps, waking early on interrupt or the wall quota),
 * sched_yield, proc_exit (ends the instance with its code). There is no file system and there are
 * no sockets: no preopened directories (fd_prestat_get answers EBADF, which ends wasi-libc's
 * preopen scan), every other descriptor is EBADF and operations that stdio does not support are
 * ENOTSUP/ESPIPE — the answers a WASI program expects from a sandbox without capabilities.
 * Every pointer argument is bounds-checked (EFAULT), unaligned access is done with memcpy.
 * Spec: WebAssembly/WASI, legacy/preview1/witx/wasi_snapshot_preview1.witx. */
#include <errno.h>
#include <sched.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "lc_wasm_int.h"

typedef struct Z_wasi_snapshot_preview1_instance_t wasi_t;

enum {
    W_ESUCCESS = 0,
    W_EBADF = 8,
    W_EFAULT = 21,
    W_EINVAL = 28,
    W_EIO = 29,
    W_ENOSYS = 52,
    W_ENOTSUP = 58,
    W_ESPIPE = 70,
};

enum { W_FILETYPE_CHARACTER_DEVICE = 2 };
enum { W_EVENTTYPE_CLOCK = 0, W_EVENTTYPE_FD_READ = 1, W_EVENTTYPE_FD_WRITE = 2 };
#define W_RIGHT_FD_READ           (1ull << 1)
#define W_RIGHT_FD_WRITE          (1ull << 6)
#define W_RIGHT_POLL_FD_READWRITE (1ull << 27)

/* ---- linear memory access ----------------------------------------------------------------- */

static lc_wasm_instance *enter(wasi_t *w) { return lc_wasm_wasi_enter(w); }

static bool put_u32(lc_wasm_instance *inst, uint32_t addr, uint32_t v) {
    void *p = lc_wasm_mem(inst, addr, 4);
    if (p) memcpy(p, &v, 4); /* wasm is little-endian, so is every host we build for */
    return p != NULL;
}

static bool put_u64(lc_wasm_instance *inst, uint32_t addr, uint64_t v) {
    void *p = lc_wasm_mem(inst, addr, 8);
    if (p) memcpy(p, &v, 8);
    return p != NULL;
}

static bool get_u32(lc_wasm_instance *inst, uint32_t addr, uint32_t *v) {
    void *p = lc_wasm_mem(inst, addr, 4);
    if (p) memcpy(v, p, 4);
    return p != NULL;
}

/* ---- args and environ ----------------------------------------------------------------------- */

static uint32_t strings_sizes(lc_wasm_instance *inst, size_t n, size_t bytes, uint32_t count_ptr,
                              uint32_t size_ptr) {
    if (!put_u32(inst, count_ptr, (uint32_t)n) || !put_u32(inst, size_ptr, (uint32_t)bytes))
        return W_EFAULT;
    return W_ESUCCESS;
}

static uint32_t strings_get(lc_wasm_instance *inst, const char *buf, size_t n, size_t bytes,
                            uint32_t ptrs, uint32_t out) {
    if (bytes > UINT32_MAX || n > UINT32_MAX / 4) return W_EFAULT;
    char *dst = lc_wasm_mem(inst, out, (uint32_t)bytes);
    if (dst == NULL || lc_wasm_mem(inst, ptrs, (uint32_t)(n * 4)) == NULL) return W_EFAULT;
    memcpy(dst, buf, bytes);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        put_u32(inst, ptrs + (uint32_t)(4 * i), out + (uint32_t)at);
        at += strlen(buf + at) + 1;
    }
    return W_ESUCCESS;
}

uint32_t Z_wasi_snapshot_preview1Z_args_sizes_get(wasi_t *w, uint32_t argc, uint32_t size) {
    lc_wasm_instance *inst = enter(w);
    return strings_sizes(inst, inst->argc, inst->args_bytes, argc, size);
}

uint32_t Z_wasi_snapshot_preview1Z_args_get(wasi_t *w, uint32_t argv, uint32_t buf) {
    lc_wasm_instance *inst = enter(w);
    return strings_get(inst, inst->args_buf, inst->argc, inst->args_bytes, argv, buf);
}

uint32_t Z_wasi_snapshot_preview1Z_environ_sizes_get(wasi_t *w, uint32_t count, uint32_t size) {
    lc_wasm_instance *inst = enter(w);
    return strings_sizes(inst, inst->n_env, inst->env_bytes, count, size);
}

uint32_t Z_wasi_snapshot_preview1Z_environ_get(wasi_t *w, uint32_t env_ptrs, uint32_t buf) {
    lc_wasm_instance *inst = enter(w);
    return strings_get(inst, inst->env_buf, inst->n_env, inst->env_bytes, env_ptrs, buf);
}

/* ---- clocks, random, scheduling, exit -------------------------------------------------------- */

static bool clock_of(uint32_t id, clockid_t *c) {
    switch (id) {
    case 0: *c = CLOCK_REALTIME; return true;
    case 1: *c = CLOCK_MONOTONIC; return true;
    case 2: *c = CLOCK_PROCESS_CPUTIME_ID; return true;
    case 3: *c = CLOCK_THREAD_CPUTIME_ID; return true;
    default: return false;
    }
}

uint32_t Z_wasi_snapshot_preview1Z_clock_res_get(wasi_t *w, uint32_t id, uint32_t out) {
    lc_wasm_instance *inst = enter(w);
    clockid_t c;
    struct timespec ts;
    if (!clock_of(id, &c)) return W_EINVAL;
    if (clock_getres(c, &ts) != 0) return W_EINVAL;
    uint64_t ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    return put_u64(inst, out, ns) ? W_ESUCCESS : W_EFAULT;
}

uint32_t Z_wasi_snapshot_preview1Z_clock_time_get(wasi_t *w, uint32_t id, uint64_t precision,
                                                  uint32_t out) {
    (void)precision;
    lc_wasm_instance *inst = enter(w);
    clockid_t c;
    if (!clock_of(id, &c)) return W_EINVAL;
    return put_u64(inst, out, lc_wasm_now_ns(c)) ? W_ESUCCESS : W_EFAULT;
}

uint32_t Z_wasi_snapshot_preview1Z_random_get(wasi_t *w, uint32_t buf, uint32_t len) {
    lc_wasm_instance *inst = enter(w);
    uint8_t *p = lc_wasm_mem(inst, buf, len);
    if (p == NULL) return W_EFAULT;
    while (len > 0) {
        ssize_t r = getrandom(p, len, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return W_EIO;
        p += r;
        len -= (uint32_t)r;
    }
    return W_ESUCCESS;
}

uint32_t Z_wasi_snapshot_preview1Z_sched_yield(wasi_t *w) {
    enter(w);
    sched_yield();
    return W_ESUCCESS;
}

void Z_wasi_snapshot_preview1Z_proc_exit(wasi_t *w, uint32_t code) {
    lc_wasm_instance *inst = enter(w);
    inst->exit_code = (int)code;
    lc_wasm_unwind(LC_WASM_TRAP_EXIT);
}

uint32_t Z_wasi_snapshot_preview1Z_proc_raise(wasi_t *w, uint32_t sig) {
    (void)sig;
    enter(w);
    return W_ENOSYS;
}

/* ---- the three standard descriptors -----------------------------------------------------------
 */

static bool is_stdio(uint32_t fd) { return fd <= 2; }

uint32_t Z_wasi_snapshot_preview1Z_fd_write(wasi_t *w, uint32_t fd, uint32_t iovs, uint32_t n,
                                            uint32_t nwritten) {
    lc_wasm_instance *inst = enter(w);
    if (fd != 1 && fd != 2) return W_EBADF;
    if (n > UINT32_MAX / 8 || lc_wasm_mem(inst, iovs, n * 8) == NULL) return W_EFAULT;
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t buf = 0, len = 0;
        if (!get_u32(inst, iovs + 8 * i, &buf) || !get_u32(inst, iovs + 8 * i + 4, &len))
            return W_EFAULT;
        const char *p = lc_wasm_mem(inst, buf, len);
        if (p == NULL) return W_EFAULT;
        if (len && inst->output) inst->output(inst->output_ctx, (int)fd, p, len);
        total += len;
    }
    if (total > UINT32_MAX) total = UINT32_MAX;
    return put_u32(inst, nwritten, (uint32_t)total) ? W_ESUCCESS : W_EFAULT;
}

uint32_t Z_wasi_snapshot_preview1Z_fd_read(wasi_t *w, uint32_t fd, uint32_t iovs, uint32_t n,
                                           uint32_t nread) {
    lc_wasm_instance *inst = enter(w);
    (void)iovs;
    (void)n;
    if (fd != 0) return W_EBADF;
    return put_u32(inst, nread, 0) ? W_ESUCCESS : W_EFAULT; /* stdin: end of input */
}

uint32_t Z_wasi_snapshot_preview1Z_fd_fdstat_get(wasi_t *w, uint32_t fd, uint32_t out) {
    lc_wasm_instance *inst = enter(w);
    if (!is_stdio(fd)) return W_EBADF;
    uint8_t *p = lc_wasm_mem(inst, out, 24);
    if (p == NULL) return W_EFAULT;
    uint64_t rights = (fd == 0 ? W_RIGHT_FD_READ : W_RIGHT_FD_WRITE) | W_RIGHT_POLL_FD_READWRITE;
    uint64_t zero = 0;
    memset(p, 0, 24);
    p[0] = W_FILETYPE_CHARACTER_DEVICE; /* fs_filetype; fs_flags (u16 at 2) stay 0 */
    memcpy(p + 8, &rights, 8);          /* fs_rights_base */
    memcpy(p + 16, &zero, 8);           /* fs_rights_inheriting */
    return W_ESUCCESS;
}

uint32_t Z_wasi_snapshot_preview1Z_fd_filestat_get(wasi_t *w, uint32_t fd, uint32_t out) {
    lc_wasm_instance *inst = enter(w);
    if (!is_stdio(fd)) return W_EBADF;
    uint8_t *p = lc_wasm_mem(inst, out, 64);
    if (p == NULL) return W_EFAULT;
    memset(p, 0, 64);
    p[16] = W_FILETYPE_CHARACTER_DEVICE; /* dev, ino, nlink, size and times stay 0 */
    return W_ESUCCESS;
}

uint32_t Z_wasi_snapshot_preview1Z_fd_close(wasi_t *w, uint32_t fd) {
    enter(w);
    return is_stdio(fd) ? W_ESUCCESS : W_EBADF;
}

uint32_t Z_wasi_snapshot_preview1Z_fd_seek(wasi_t *w, uint32_t fd, uint64_t offset, uint32_t whence,
                                           uint32_t out) {
    (void)offset, (void)whence, (void)out;
    enter(w);
    return is_stdio(fd) ? W_ESPIPE : W_EBADF;
}

uint32_t Z_wasi_snapshot_preview1Z_fd_tell(wasi_t *w, uint32_t fd, uint32_t out) {
    (void)out;
    enter(w);
    return is_stdio(fd) ? W_ESPIPE : W_EBADF;
}

uint32_t Z_wasi_snapshot_preview1Z_fd_prestat_get(wasi_t *w, uint32_t fd, uint32_t out) {
    (void)fd, (void)out;
    enter(w);
    return W_EBADF; /* no preopened directories */
}

uint32_t Z_wasi_snapshot_preview1Z_fd_prestat_dir_name(wasi_t *w, uint32_t fd, uint32_t path,
                                                       uint32_t len) {
    (void)fd, (void)path, (void)len;
    enter(w);
    return W_EBADF;
}

/* ---- poll_oneoff: clocks only ------------------------------------------------------------------
 */

/* Subscription (48 bytes): userdata u64 @0, tag u8 @8, clock id u32 @16, timeout u64 @24,
 * precision u64 @32, flags u16 @40 (1 = absolute); fd_read/fd_write: fd u32 @16.
 * Event (32 bytes): userdata u64 @0, error u16 @8, type u8 @10, nbytes u64 @16, flags u16 @24. */
static void put_event(uint8_t *e, uint64_t userdata, uint16_t error, uint8_t type) {
    memset(e, 0, 32);
    memcpy(e, &userdata, 8);
    memcpy(e + 8, &error, 2);
    e[10] = type;
}

/* Sleeps until deadline (CLOCK_MONOTONIC ns), the wall quota, or an interrupt. */
static void sleep_until(lc_wasm_instance *inst, uint64_t deadline) {
    if (inst->wall_deadline_ns < deadline) deadline = inst->wall_deadline_ns;
    struct timespec ts = {(time_t)(deadline / 1000000000u), (long)(deadline % 1000000000u)};
    pthread_mutex_lock(&inst->mu);
    while (!lc_wasm_interrupted(inst) && lc_wasm_now_ns(CLOCK_MONOTONIC) < deadline)
        if (pthread_cond_timedwait(&inst->cv, &inst->mu, &ts) == ETIMEDOUT) break;
    pthread_mutex_unlock(&inst->mu);
    if (inst->wall_deadline_ns <= lc_wasm_now_ns(CLOCK_MONOTONIC)) {
        int none = 0;
        atomic_compare_exchange_strong(&inst->interrupt, &none, LC_WASM_TRAP_WALL_TIME);
    }
    lc_wasm_host_checkpoint(inst);
}

/* When a clock subscription is due, as CLOCK_MONOTONIC ns, from clock readings taken once per
 * call (so both passes below agree); false for clocks one cannot sleep on. */
static bool clock_deadline(const uint8_t *s, uint64_t real_now, uint64_t mono_now, uint64_t *at) {
    uint32_t id;
    uint64_t timeout;
    uint16_t flags;
    memcpy(&id, s + 16, 4);
    memcpy(&timeout, s + 24, 8);
    memcpy(&flags, s + 40, 2);
    if (id != 0 && id != 1) return false; /* CPU-time clocks do not advance while sleeping */
    uint64_t rel = timeout;
    if (flags & 1) {
        uint64_t now = id == 0 ? real_now : mono_now;
        rel = timeout > now ? timeout - now : 0;
    }
    *at = rel > UINT64_MAX - mono_now ? UINT64_MAX : mono_now + rel;
    return true;
}

uint32_t Z_wasi_snapshot_preview1Z_poll_oneoff(wasi_t *w, uint32_t in, uint32_t out, uint32_t n,
                                               uint32_t nevents) {
    lc_wasm_instance *inst = enter(w);
    if (n == 0) return W_EINVAL;
    if (n > UINT32_MAX / 48) return W_EFAULT;
    const uint8_t *subs = lc_wasm_mem(inst, in, n * 48);
    uint8_t *events = lc_wasm_mem(inst, out, n * 32);
    if (subs == NULL || events == NULL || lc_wasm_mem(inst, nevents, 4) == NULL) return W_EFAULT;

    /* Pass 1: descriptor subscriptions are ready at once (stdout and stderr writable, stdin at end
     * of input); bad ones are reported as errors; clocks give the earliest deadline. */
    uint64_t real_now = lc_wasm_now_ns(CLOCK_REALTIME), mono_now = lc_wasm_now_ns(CLOCK_MONOTONIC);
    uint32_t ready = 0;
    uint64_t earliest = UINT64_MAX;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *s = subs + 48 * (size_t)i;
        uint64_t userdata, at;
        memcpy(&userdata, s, 8);
        uint8_t tag = s[8];
        if (tag == W_EVENTTYPE_FD_READ || tag == W_EVENTTYPE_FD_WRITE) {
            uint32_t fd;
            memcpy(&fd, s + 16, 4);
            bool ok = tag == W_EVENTTYPE_FD_READ ? fd == 0 : (fd == 1 || fd == 2);
            put_event(events + 32 * (size_t)ready++, userdata, ok ? W_ESUCCESS : W_EBADF, tag);
        } else if (tag != W_EVENTTYPE_CLOCK) {
            put_event(events + 32 * (size_t)ready++, userdata, W_EINVAL, tag);
        } else if (!clock_deadline(s, real_now, mono_now, &at)) {
            put_event(events + 32 * (size_t)ready++, userdata, W_ENOTSUP, tag);
        } else if (at < earliest) {
            earliest = at;
        }
    }
    /* Pass 2: with nothing ready, sleep until the earliest clock and report the clocks due. */
    if (ready == 0 && earliest != UINT64_MAX) {
        sleep_until(inst, earliest);
        for (uint32_t i = 0; i < n; i++) {
            const uint8_t *s = subs + 48 * (size_t)i;
            uint64_t userdata, at;
            memcpy(&userdata, s, 8);
            if (s[8] == W_EVENTTYPE_CLOCK && clock_deadline(s, real_now, mono_now, &at) &&
                at <= earliest)
                put_event(events + 32 * (size_t)ready++, userdata, W_ESUCCESS, W_EVENTTYPE_CLOCK);
        }
    }
    put_u32(inst, nevents, ready);
    return W_ESUCCESS;
}

/* ---- everything else: no such descriptor, or not supported on stdio ----------------------------
 */

static uint32_t no_fd(wasi_t *w, uint32_t fd) {
    enter(w);
    return is_stdio(fd) ? W_ENOTSUP : W_EBADF;
}

uint32_t Z_wasi_snapshot_preview1Z_fd_advise(wasi_t *w, uint32_t fd, uint64_t o, uint64_t l,
                                             uint32_t a) {
    (void)o, (void)l, (void)a;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_fd_allocate(wasi_t *w, uint32_t fd, uint64_t o, uint64_t l) {
    (void)o, (void)l;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_fd_datasync(wasi_t *w, uint32_t fd) { return no_fd(w, fd); }
uint32_t Z_wasi_snapshot_preview1Z_fd_sync(wasi_t *w, uint32_t fd) { return no_fd(w, fd); }
uint32_t Z_wasi_snapshot_preview1Z_fd_fdstat_set_flags(wasi_t *w, uint32_t fd, uint32_t f) {
    (void)f;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_fd_fdstat_set_rights(wasi_t *w, uint32_t fd, uint64_t b,
                                                        uint64_t i) {
    (void)b, (void)i;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_fd_filestat_set_size(wasi_t *w, uint32_t fd, uint64_t s) {
    (void)s;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_fd_filestat_set_times(wasi_t *w, uint32_t fd, uint64_t a,
                                                         uint64_t m, uint32_t f) {
    (void)a, (void)m, (void)f;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_fd_pread(wasi_t *w, uint32_t fd, uint32_t iovs, uint32_t n,
                                            uint64_t off, uint32_t out) {
    (void)iovs, (void)n, (void)off, (void)out;
    enter(w);
    return is_stdio(fd) ? W_ESPIPE : W_EBADF;
}
uint32_t Z_wasi_snapshot_preview1Z_fd_pwrite(wasi_t *w, uint32_t fd, uint32_t iovs, uint32_t n,
                                             uint64_t off, uint32_t out) {
    (void)iovs, (void)n, (void)off, (void)out;
    enter(w);
    return is_stdio(fd) ? W_ESPIPE : W_EBADF;
}
uint32_t Z_wasi_snapshot_preview1Z_fd_readdir(wasi_t *w, uint32_t fd, uint32_t buf, uint32_t len,
                                              uint64_t cookie, uint32_t out) {
    (void)buf, (void)len, (void)cookie, (void)out;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_fd_renumber(wasi_t *w, uint32_t fd, uint32_t to) {
    (void)to;
    return no_fd(w, fd);
}

/* Path operations need a directory descriptor, and there are none. */
static uint32_t no_dir(wasi_t *w) {
    enter(w);
    return W_EBADF;
}
uint32_t Z_wasi_snapshot_preview1Z_path_create_directory(wasi_t *w, uint32_t fd, uint32_t p,
                                                         uint32_t l) {
    (void)fd, (void)p, (void)l;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_filestat_get(wasi_t *w, uint32_t fd, uint32_t fl,
                                                     uint32_t p, uint32_t l, uint32_t out) {
    (void)fd, (void)fl, (void)p, (void)l, (void)out;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_filestat_set_times(wasi_t *w, uint32_t fd, uint32_t fl,
                                                           uint32_t p, uint32_t l, uint64_t a,
                                                           uint64_t m, uint32_t f) {
    (void)fd, (void)fl, (void)p, (void)l, (void)a, (void)m, (void)f;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_link(wasi_t *w, uint32_t fd, uint32_t fl, uint32_t p,
                                             uint32_t l, uint32_t fd2, uint32_t p2, uint32_t l2) {
    (void)fd, (void)fl, (void)p, (void)l, (void)fd2, (void)p2, (void)l2;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_open(wasi_t *w, uint32_t fd, uint32_t dirflags, uint32_t p,
                                             uint32_t l, uint32_t oflags, uint64_t rb, uint64_t ri,
                                             uint32_t fdflags, uint32_t out) {
    (void)fd, (void)dirflags, (void)p, (void)l, (void)oflags, (void)rb, (void)ri, (void)fdflags,
        (void)out;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_readlink(wasi_t *w, uint32_t fd, uint32_t p, uint32_t l,
                                                 uint32_t buf, uint32_t len, uint32_t out) {
    (void)fd, (void)p, (void)l, (void)buf, (void)len, (void)out;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_remove_directory(wasi_t *w, uint32_t fd, uint32_t p,
                                                         uint32_t l) {
    (void)fd, (void)p, (void)l;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_rename(wasi_t *w, uint32_t fd, uint32_t p, uint32_t l,
                                               uint32_t fd2, uint32_t p2, uint32_t l2) {
    (void)fd, (void)p, (void)l, (void)fd2, (void)p2, (void)l2;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_symlink(wasi_t *w, uint32_t p, uint32_t l, uint32_t fd,
                                                uint32_t p2, uint32_t l2) {
    (void)p, (void)l, (void)fd, (void)p2, (void)l2;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_path_unlink_file(wasi_t *w, uint32_t fd, uint32_t p,
                                                    uint32_t l) {
    (void)fd, (void)p, (void)l;
    return no_dir(w);
}
uint32_t Z_wasi_snapshot_preview1Z_sock_accept(wasi_t *w, uint32_t fd, uint32_t f, uint32_t out) {
    (void)f, (void)out;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_sock_recv(wasi_t *w, uint32_t fd, uint32_t d, uint32_t n,
                                             uint32_t f, uint32_t out, uint32_t oflags) {
    (void)d, (void)n, (void)f, (void)out, (void)oflags;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_sock_send(wasi_t *w, uint32_t fd, uint32_t d, uint32_t n,
                                             uint32_t f, uint32_t out) {
    (void)d, (void)n, (void)f, (void)out;
    return no_fd(w, fd);
}
uint32_t Z_wasi_snapshot_preview1Z_sock_shutdown(wasi_t *w, uint32_t fd, uint32_t how) {
    (void)how;
    return no_fd(w, fd);
}

/* ---- the table imports are checked against
 * ------------------------------------------------------- */

#define P1(name, type) \
    { #name, type, (void (*)(void))Z_wasi_snapshot_preview1Z_##name }
#define T_I2 "(param i32 i32) (result i32)"
#define T_I1 "(param i32) (result i32)"
#define T_I3 "(param i32 i32 i32) (result i32)"
#define T_I4 "(param i32 i32 i32 i32) (result i32)"
#define T_I5 "(param i32 i32 i32 i32 i32) (result i32)"
#define T_I6 "(param i32 i32 i32 i32 i32 i32) (result i32)"

const lc_wasm_host_fn lc_wasm_wasi_fns[] = {
    P1(args_get, T_I2),
    P1(args_sizes_get, T_I2),
    P1(environ_get, T_I2),
    P1(environ_sizes_get, T_I2),
    P1(clock_res_get, T_I2),
    P1(clock_time_get, "(param i32 i64 i32) (result i32)"),
    P1(fd_advise, "(param i32 i64 i64 i32) (result i32)"),
    P1(fd_allocate, "(param i32 i64 i64) (result i32)"),
    P1(fd_close, T_I1),
    P1(fd_datasync, T_I1),
    P1(fd_fdstat_get, T_I2),
    P1(fd_fdstat_set_flags, T_I2),
    P1(fd_fdstat_set_rights, "(param i32 i64 i64) (result i32)"),
    P1(fd_filestat_get, T_I2),
    P1(fd_filestat_set_size, "(param i32 i64) (result i32)"),
    P1(fd_filestat_set_times, "(param i32 i64 i64 i32) (result i32)"),
    P1(fd_pread, "(param i32 i32 i32 i64 i32) (result i32)"),
    P1(fd_prestat_get, T_I2),
    P1(fd_prestat_dir_name, T_I3),
    P1(fd_pwrite, "(param i32 i32 i32 i64 i32) (result i32)"),
    P1(fd_read, T_I4),
    P1(fd_readdir, "(param i32 i32 i32 i64 i32) (result i32)"),
    P1(fd_renumber, T_I2),
    P1(fd_seek, "(param i32 i64 i32 i32) (result i32)"),
    P1(fd_sync, T_I1),
    P1(fd_tell, T_I2),
    P1(fd_write, T_I4),
    P1(path_create_directory, T_I3),
    P1(path_filestat_get, T_I5),
    P1(path_filestat_set_times, "(param i32 i32 i32 i32 i64 i64 i32) (result i32)"),
    P1(path_link, "(param i32 i32 i32 i32 i32 i32 i32) (result i32)"),
    P1(path_open, "(param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)"),
    P1(path_readlink, T_I6),
    P1(path_remove_directory, T_I3),
    P1(path_rename, T_I6),
    P1(path_symlink, T_I5),
    P1(path_unlink_file, T_I3),
    P1(poll_oneoff, T_I4),
    P1(proc_exit, "(param i32)"),
    P1(proc_raise, T_I1),
    P1(sched_yield, "(result i32)"),
    P1(random_get, T_I2),
    P1(sock_accept, T_I3),
    P1(sock_recv, T_I6),
    P1(sock_send, T_I5),
    P1(sock_shutdown, T_I2),
};
const size_t lc_wasm_wasi_n_fns = sizeof lc_wasm_wasi_fns / sizeof lc_wasm_wasi_fns[0];
