/* wrk_tier.c — the swap policy's data path: two regions of layer buffers, the mapping table
 * with two-phase updates, the FIFO decisions and the copy engine (one thread per direction).
 * The contract and the policy are in wrk_tier.h. */
#include "wrk_tier.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "wrk_numa.h"

typedef enum wrk_tier_state {
    WRK_TIER_ON_DEVICE = 0,
    WRK_TIER_ON_HOST,
    WRK_TIER_MOVING_IN,  /* host → device: both buffers held, the host one is the truth */
    WRK_TIER_MOVING_OUT, /* device → host: both held, the device one is the truth */
} wrk_tier_state;

/* One row of the mapping table. */
typedef struct wrk_tier_layer {
    wrk_tier_state state;
    int32_t dev;  /* device buffer, or -1 */
    int32_t host; /* host buffer, or -1 */
} wrk_tier_layer;

enum { WRK_TIER_IN = 0, WRK_TIER_OUT = 1 };

/* One direction of the link: at most one layer in flight. */
typedef struct wrk_tier_link {
    struct wrk_tier *t;
    int dir;
    pthread_t thread;
    bool started;
    bool busy;      /* a job is assigned (from prepare until publish) */
    uint32_t layer; /* the job's layer while busy */
    size_t bytes;   /* the job's prefix of the layer (t->used when it started) */
    pthread_cond_t go;
} wrk_tier_link;

/* A region of equal buffers and the free ones. */
typedef struct wrk_tier_region {
    char *base;
    size_t bytes;
    uint32_t n;
    int32_t *free; /* stack of free buffer indices */
    uint32_t n_free;
    const wrk_tier_mem *device_mem; /* a real device's region: its allocator; NULL: mmap */
    size_t stride;                  /* bytes from one buffer to the next */
    size_t *committed;              /* [n]: a committing device's bytes of each buffer, or NULL */
    const wrk_tier_mem *pinned_by;  /* the host region was pinned through it, or NULL */
} wrk_tier_region;

struct wrk_tier {
    wrk_tier_config cfg;
    wrk_tier_region dev, host;
    wrk_tier_layer *layers; /* [n_layers]: the mapping table */
    pthread_mutex_t mu;
    pthread_cond_t changed; /* a transfer was published */
    wrk_tier_link link[2];
    uint32_t slots;
    /* Bytes of every layer buffer that may be non-zero: all writes ever went below it (the
     * engine raises it before writing, wrk_tier_touch), and every buffer is zero above it (the
     * regions start zeroed and copies move only this prefix), so moving the prefix moves the
     * layer. */
    size_t used;
    uint32_t cursor; /* the next layer the engine computes */
    int64_t pinned;  /* layer being computed, or -1 */
    uint32_t holds;  /* wrk_tier_hold depth: nothing starts while > 0 */
    bool stopping;
    pie_status failure; /* the last copy failure not yet reported */
    bool failed;
    wrk_tier_stats stats;
    uint64_t committed; /* Σ dev.committed */
};

static uint64_t wrk_tier_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint32_t wrk_tier_dev_buffers(const wrk_tier_config *c) {
    return c->device_buffers ? c->device_buffers : c->n_layers;
}

uint32_t wrk_tier_host_buffers_needed(uint32_t n_layers, uint32_t min_slots) {
    return n_layers >= min_slots ? n_layers - min_slots + 2 : 2;
}

/* ---- regions ----------------------------------------------------------------------------- */

/* dev: allocate the region on a real device through it (NULL: host memory). */
static pie_code wrk_tier_region_open(wrk_tier_region *r, uint32_t n, size_t each, const char *what,
                                     const wrk_tier_mem *dev, pie_status *st) {
    memset(r, 0, sizeof *r);
    bool commits = dev && dev->dev_commit;
    if (commits) /* committed in dev_step pieces: every buffer starts aligned */
        each = each > SIZE_MAX - dev->dev_step
                   ? SIZE_MAX
                   : (each + dev->dev_step - 1) / dev->dev_step * dev->dev_step;
    if (n == 0) return PIE_OK;
    if (each == 0 || each > SIZE_MAX / n)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "swap: the %s region of %u layer buffers of %zu bytes is too large",
                              what, n, each);
    size_t bytes = each * n;
    r->free = malloc(sizeof *r->free * n);
    if (commits) r->committed = calloc(n, sizeof *r->committed);
    if (!r->free || (commits && !r->committed)) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "swap: out of memory");
        goto fail;
    }
    void *p = NULL;
    if (dev) {
        pie_status why;
        pie_status_ok(&why);
        if (dev->dev_alloc(dev->user, bytes, &p, &why) != PIE_OK) {
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                           "swap: cannot allocate the %s region (%u layer buffers of %zu bytes): "
                           "%s",
                           what, n, each, why.msg);
            goto fail;
        }
        r->device_mem = dev;
    } else {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
        if (p == MAP_FAILED) {
            pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                           "swap: cannot allocate the %s region (%u layer buffers of %zu bytes)",
                           what, n, each);
            goto fail;
        }
    }
    r->base = p;
    r->bytes = bytes;
    r->stride = each;
    r->n = n;
    for (uint32_t i = 0; i < n; i++) r->free[i] = (int32_t)(n - 1 - i); /* 0 on top */
    r->n_free = n;
    return PIE_OK;
fail:
    free(r->free);
    free(r->committed);
    memset(r, 0, sizeof *r);
    return PIE_RESOURCE_EXHAUSTED; /* every failure above says so */
}

static void wrk_tier_region_close(wrk_tier_region *r) {
    for (uint32_t i = 0; r->committed && i < r->n; i++)
        if (r->committed[i])
            r->device_mem->dev_decommit(r->device_mem->user, r->base + (size_t)i * r->stride,
                                        r->committed[i]);
    free(r->committed);
    if (r->pinned_by) r->pinned_by->host_unpin(r->pinned_by->user, r->base);
    if (r->base && r->device_mem)
        r->device_mem->dev_free(r->device_mem->user, r->base);
    else if (r->base)
        (void)munmap(r->base, r->bytes);
    free(r->free);
    memset(r, 0, sizeof *r);
}

static int32_t wrk_tier_take(wrk_tier_region *r) { return r->n_free ? r->free[--r->n_free] : -1; }

static void wrk_tier_give(wrk_tier_region *r, int32_t i) { r->free[r->n_free++] = i; }

static void *wrk_tier_buf(const wrk_tier_region *r, int32_t i) {
    return r->base + (size_t)i * r->stride;
}

/* ---- a committing device ----------------------------------------------------------------- */

static bool wrk_tier_commits(const wrk_tier *t) { return t->dev.committed != NULL; }

/* What a buffer holding a layer must have committed: the used prefix in dev_step pieces. */
static size_t wrk_tier_need(const wrk_tier *t) {
    size_t step = t->cfg.mem->dev_step;
    return (t->used + step - 1) / step * step;
}

/* Layers the device may hold now: the slots, and for a committing device its budget over
 * what each needs (never below min_slots: the plan sized the page space for them). */
static uint32_t wrk_tier_slots_now(const wrk_tier *t) {
    if (!wrk_tier_commits(t) || wrk_tier_need(t) == 0) return t->slots;
    uint64_t fit = t->cfg.mem->device_bytes / wrk_tier_need(t);
    uint32_t cap = fit < t->cfg.min_slots ? t->cfg.min_slots
                   : fit > t->slots       ? t->slots
                                          : (uint32_t)fit;
    return cap;
}

/* Gives back the memory of free buffers (other than `keep`) while the committed bytes plus
 * `more` exceed the budget. */
static void wrk_tier_trim(wrk_tier *t, int32_t keep, size_t more) {
    wrk_tier_region *r = &t->dev;
    const wrk_tier_mem *m = t->cfg.mem;
    for (uint32_t k = 0; k < r->n_free && t->committed + more > m->device_bytes; k++) {
        int32_t j = r->free[k];
        if (j == keep || r->committed[j] == 0) continue;
        m->dev_decommit(m->user, wrk_tier_buf(r, j), r->committed[j]);
        t->committed -= r->committed[j];
        r->committed[j] = 0;
    }
}

/* Commits device buffer b to `need`, first giving back the memory of free buffers while the
 * budget would be exceeded. A failure is recorded for the engine (the next acquire). */
static bool wrk_tier_commit(wrk_tier *t, int32_t b, size_t need) {
    wrk_tier_region *r = &t->dev;
    size_t have = r->committed[b];
    if (have >= need) return true;
    const wrk_tier_mem *m = t->cfg.mem;
    wrk_tier_trim(t, b, need - have);
    pie_status st;
    pie_status_ok(&st);
    if (m->dev_commit(m->user, wrk_tier_buf(r, b), have, need, &st) != PIE_OK) {
        if (!t->failed)
            pie_status_set(&t->failure, PIE_RESOURCE_EXHAUSTED,
                           "swap: committing %zu bytes of a layer's device buffer failed: %s", need,
                           st.msg);
        t->failed = true;
        return false;
    }
    r->committed[b] = need;
    t->committed += need - have;
    return true;
}

/* ---- decisions (under mu) ---------------------------------------------------------------- */

static uint32_t wrk_tier_dist(const wrk_tier *t, uint32_t l) {
    return (l + t->cfg.n_layers - t->cursor) % t->cfg.n_layers;
}

/* Layers holding a device buffer. */
static uint32_t wrk_tier_dev_used(const wrk_tier *t) { return t->dev.n - t->dev.n_free; }

/* The layer in `state` with the smallest (hottest) or largest (coldest) distance, not pinned;
 * -1 if none. */
static int64_t wrk_tier_pick(const wrk_tier *t, wrk_tier_state state, bool hottest) {
    int64_t best = -1;
    uint32_t best_d = 0;
    for (uint32_t l = 0; l < t->cfg.n_layers; l++) {
        if (t->layers[l].state != state || (int64_t)l == t->pinned) continue;
        uint32_t d = wrk_tier_dist(t, l);
        if (best < 0 || (hottest ? d < best_d : d > best_d)) {
            best = l;
            best_d = d;
        }
    }
    return best;
}

/* Prepare (phase one): the destination buffer is taken and recorded, the layer is moving. */
static void wrk_tier_start(wrk_tier *t, int dir, uint32_t l) {
    wrk_tier_layer *L = &t->layers[l];
    if (dir == WRK_TIER_IN) {
        L->dev = wrk_tier_take(&t->dev);
        if (wrk_tier_commits(t) && !wrk_tier_commit(t, L->dev, wrk_tier_need(t))) {
            wrk_tier_give(&t->dev, L->dev); /* the layer stays on the host; acquire reports it */
            L->dev = -1;
            pthread_cond_broadcast(&t->changed);
            return;
        }
        L->state = WRK_TIER_MOVING_IN;
    } else {
        L->host = wrk_tier_take(&t->host);
        L->state = WRK_TIER_MOVING_OUT;
    }
    t->link[dir].busy = true;
    t->link[dir].layer = l;
    t->link[dir].bytes = t->used;
    pthread_cond_signal(&t->link[dir].go);
}

static void wrk_tier_pump_out(wrk_tier *t) {
    if (t->link[WRK_TIER_OUT].busy || t->host.n_free == 0) return;
    int64_t victim = wrk_tier_pick(t, WRK_TIER_ON_DEVICE, false);
    if (victim < 0) return;
    uint32_t used = wrk_tier_dev_used(t), slots = wrk_tier_slots_now(t);
    bool over = used > slots;
    int64_t want = wrk_tier_pick(t, WRK_TIER_ON_HOST, true);
    /* the pinned layer (skipped by pick) is the hottest when it waits on the host */
    if (t->pinned >= 0 && t->layers[t->pinned].state == WRK_TIER_ON_HOST) want = t->pinned;
    bool hotter = want >= 0 && used >= slots &&
                  wrk_tier_dist(t, (uint32_t)want) < wrk_tier_dist(t, (uint32_t)victim);
    if (over || hotter) wrk_tier_start(t, WRK_TIER_OUT, (uint32_t)victim);
}

static void wrk_tier_pump_in(wrk_tier *t) {
    if (t->link[WRK_TIER_IN].busy || t->dev.n_free == 0) return;
    if (t->failed || wrk_tier_dev_used(t) >= wrk_tier_slots_now(t)) return;
    int64_t want = wrk_tier_pick(t, WRK_TIER_ON_HOST, true);
    /* the pinned layer is skipped by pick; it may be the one the engine waits for */
    if (t->pinned >= 0 && t->layers[t->pinned].state == WRK_TIER_ON_HOST) want = t->pinned;
    if (want >= 0) wrk_tier_start(t, WRK_TIER_IN, (uint32_t)want);
}

/* Starts what the idle directions should do now (the policy in wrk_tier.h). */
static void wrk_tier_pump(wrk_tier *t) {
    if (t->holds > 0 || t->stopping) return;
    wrk_tier_pump_out(t);
    wrk_tier_pump_in(t);
}

/* Publish (phase two): the copy ended; ok: the destination is the layer's home and the source
 * is free; failed: the move is undone (the source still holds the data). */
static void wrk_tier_publish(wrk_tier *t, int dir, uint32_t l, bool ok) {
    wrk_tier_layer *L = &t->layers[l];
    bool to_dev = dir == WRK_TIER_IN;
    if (ok) {
        if (to_dev) {
            wrk_tier_give(&t->host, L->host);
            L->host = -1;
        } else {
            wrk_tier_give(&t->dev, L->dev);
            L->dev = -1;
            if (wrk_tier_commits(t)) wrk_tier_trim(t, -1, 0); /* over the budget after a touch */
        }
        L->state = to_dev ? WRK_TIER_ON_DEVICE : WRK_TIER_ON_HOST;
        uint64_t *bytes = to_dev ? &t->stats.swap_in_bytes : &t->stats.swap_out_bytes;
        *bytes += t->link[dir].bytes;
        (*(to_dev ? &t->stats.swaps_in : &t->stats.swaps_out))++;
    } else {
        if (to_dev) {
            wrk_tier_give(&t->dev, L->dev);
            L->dev = -1;
        } else {
            wrk_tier_give(&t->host, L->host);
            L->host = -1;
        }
        L->state = to_dev ? WRK_TIER_ON_HOST : WRK_TIER_ON_DEVICE;
        t->stats.copy_failures++;
    }
    t->link[dir].busy = false;
}

/* ---- the copy engine --------------------------------------------------------------------- */

static void wrk_tier_sleep_until(uint64_t until_ns) {
    for (;;) {
        uint64_t now = wrk_tier_now_ns();
        if (now >= until_ns) return;
        uint64_t left = until_ns - now;
        struct timespec ts = {.tv_sec = (time_t)(left / 1000000000u),
                              .tv_nsec = (long)(left % 1000000000u)};
        if (nanosleep(&ts, NULL) != 0 && errno != EINTR) return;
    }
}

/* Moves a layer's first `bytes` (outside mu): the data, then the emulated link time. */
static pie_code wrk_tier_move(wrk_tier *t, uint32_t l, bool to_host, void *dst, const void *src,
                              size_t bytes, pie_status *st) {
    uint64_t t0 = wrk_tier_now_ns();
    pie_code rc = PIE_OK;
    if (t->cfg.mem)
        rc = t->cfg.mem->move(t->cfg.mem->user, l, to_host, dst, src, bytes, st);
    else if (t->cfg.copy)
        rc = t->cfg.copy(t->cfg.copy_user, dst, src, bytes, st);
    else
        memcpy(dst, src, bytes);
    if (rc == PIE_OK && t->cfg.link_bytes_per_s > 0)
        wrk_tier_sleep_until(t0 + (uint64_t)((double)bytes / t->cfg.link_bytes_per_s * 1e9));
    return rc;
}

static void *wrk_tier_link_main(void *arg) {
    wrk_tier_link *k = arg;
    wrk_tier *t = k->t;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!k->busy && !t->stopping) pthread_cond_wait(&k->go, &t->mu);
        if (!k->busy) break; /* stopping with nothing in flight */
        uint32_t l = k->layer;
        const wrk_tier_layer *L = &t->layers[l];
        void *dev = wrk_tier_buf(&t->dev, L->dev), *host = wrk_tier_buf(&t->host, L->host);
        bool in = k->dir == WRK_TIER_IN;
        size_t bytes = k->bytes, tail = 0;
        /* a committing device's buffer may have memory below the prefix only (the prefix
         * grew since its layer last ran): the rest of the layer is zero, written as such */
        if (!in && wrk_tier_commits(t) && t->dev.committed[L->dev] < bytes) {
            tail = bytes - t->dev.committed[L->dev];
            bytes = t->dev.committed[L->dev];
        }
        pthread_mutex_unlock(&t->mu);
        pie_status st;
        pie_status_ok(&st);
        pie_code rc = wrk_tier_move(t, l, !in, in ? dev : host, in ? host : dev, bytes, &st);
        if (rc == PIE_OK && tail) memset((char *)host + bytes, 0, tail);
        pthread_mutex_lock(&t->mu);
        if (rc != PIE_OK && !t->failed) {
            pie_status_set(&t->failure, rc, "swap: moving layer %u %s failed: %s", l,
                           in ? "to the device" : "to the host", st.msg);
            t->failed = true;
        }
        wrk_tier_publish(t, k->dir, l, rc == PIE_OK);
        /* after a failure nothing new starts until the engine has seen it */
        if (!t->failed) wrk_tier_pump(t);
        pthread_cond_broadcast(&t->changed);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* ---- open / close ------------------------------------------------------------------------ */

static pie_code wrk_tier_check(const wrk_tier_config *c, pie_status *st) {
    uint32_t n = c->n_layers, floor_slots = n > 1 ? 2 : 1;
    if (n == 0) return pie_status_set(st, PIE_INVALID_ARGUMENT, "swap: the model has no layers");
    if (c->min_slots < floor_slots || c->min_slots > n)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "swap: min_slots %u is out of range [%u, %u] for %u layers",
                              c->min_slots, floor_slots, n, n);
    if (c->slots < c->min_slots || c->slots > n)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "swap: slots %u is out of range [%u, %u]",
                              c->slots, c->min_slots, n);
    uint32_t bufs = wrk_tier_dev_buffers(c);
    if (bufs < c->min_slots || bufs > n)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "swap: device_buffers %u is out of range [%u, %u]", bufs,
                              c->min_slots, n);
    if (c->slots > bufs)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "swap: slots %u is more than the device region's %u layer buffers",
                              c->slots, bufs);
    if (c->mem && (!c->mem->dev_alloc || !c->mem->dev_free || !c->mem->host_pin ||
                   !c->mem->host_unpin || !c->mem->move))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "swap: a device needs all five hooks");
    if (c->mem && (!c->mem->dev_commit != !c->mem->dev_decommit ||
                   (c->mem->dev_commit && (c->mem->dev_step == 0 || c->mem->device_bytes == 0))))
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "swap: a committing device needs dev_commit, dev_decommit, a "
                              "dev_step and a device_bytes budget");
    uint32_t need = wrk_tier_host_buffers_needed(n, c->min_slots); /* >= n - bufs */
    if (c->host_buffers < need)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "swap: the host pool holds %u layer caches of %zu bytes; %u layers "
                              "with %u on the device need %u",
                              c->host_buffers, c->layer_bytes, n, c->min_slots, need);
    if (!(c->link_bytes_per_s >= 0))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "swap: link bandwidth must be >= 0");
    return PIE_OK;
}

pie_code wrk_tier_open(const wrk_tier_config *cfg, wrk_tier **out, pie_status *st) {
    *out = NULL;
    pie_code rc = wrk_tier_check(cfg, st);
    if (rc != PIE_OK) return rc;
    wrk_tier *t = calloc(1, sizeof *t);
    if (!t) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "swap: out of memory");
    t->cfg = *cfg;
    t->slots = cfg->slots;
    t->pinned = -1;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->changed, NULL);
    for (int d = 0; d < 2; d++) {
        t->link[d] = (wrk_tier_link){.t = t, .dir = d};
        pthread_cond_init(&t->link[d].go, NULL);
    }
    uint32_t n = cfg->n_layers;
    t->layers = calloc(n, sizeof *t->layers);
    if (!t->layers) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "swap: out of memory");
        goto fail;
    }
    rc = wrk_tier_region_open(&t->dev, wrk_tier_dev_buffers(cfg), cfg->layer_bytes, "device",
                              cfg->mem, st);
    if (rc == PIE_OK)
        rc = wrk_tier_region_open(&t->host, cfg->host_buffers, cfg->layer_bytes, "host", NULL, st);
    if (rc == PIE_OK && cfg->host_numa_bind && t->host.bytes)
        rc = wrk_numa_bind(t->host.base, t->host.bytes, cfg->host_numa_node,
                           "the swap policy's host region", st);
    if (rc == PIE_OK && cfg->mem && t->host.bytes) { /* after binding: pinning faults it in */
        rc = cfg->mem->host_pin(cfg->mem->user, t->host.base, t->host.bytes, st);
        if (rc == PIE_OK) t->host.pinned_by = cfg->mem;
    }
    if (rc != PIE_OK) goto fail;
    /* layer l on device buffer l (the free stack pops 0 first), on the host past the device's
     * buffers (zero there as well) */
    for (uint32_t l = 0; l < n; l++) {
        int32_t d = wrk_tier_take(&t->dev);
        t->layers[l] = d >= 0 ? (wrk_tier_layer){WRK_TIER_ON_DEVICE, d, -1}
                              : (wrk_tier_layer){WRK_TIER_ON_HOST, -1, wrk_tier_take(&t->host)};
    }
    for (int d = 0; d < 2; d++) {
        if (pthread_create(&t->link[d].thread, NULL, wrk_tier_link_main, &t->link[d]) != 0) {
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "swap: cannot start the copy engine");
            goto fail;
        }
        t->link[d].started = true;
    }
    pthread_mutex_lock(&t->mu);
    wrk_tier_pump(t); /* slots < n: evict down to the budget */
    pthread_mutex_unlock(&t->mu);
    *out = t;
    return PIE_OK;
fail:
    wrk_tier_close(t);
    return rc;
}

void wrk_tier_close(wrk_tier *t) {
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    t->stopping = true; /* a job in flight finishes first */
    for (int d = 0; d < 2; d++) pthread_cond_signal(&t->link[d].go);
    pthread_mutex_unlock(&t->mu);
    for (int d = 0; d < 2; d++)
        if (t->link[d].started) (void)pthread_join(t->link[d].thread, NULL);
    for (int d = 0; d < 2; d++) pthread_cond_destroy(&t->link[d].go);
    pthread_cond_destroy(&t->changed);
    pthread_mutex_destroy(&t->mu);
    wrk_tier_region_close(&t->dev);
    wrk_tier_region_close(&t->host);
    free(t->layers);
    free(t);
}

/* ---- the engine's side ------------------------------------------------------------------- */

pie_code wrk_tier_acquire(wrk_tier *t, uint32_t l, void **base, pie_status *st) {
    pthread_mutex_lock(&t->mu);
    t->cursor = l;
    t->pinned = l;
    uint64_t t0 = 0;
    pie_code rc = PIE_OK;
    for (;;) {
        if (t->failed) { /* reported once; the data stayed where it was */
            t->failed = false;
            rc = pie_status_set(st, t->failure.code, "%s", t->failure.msg);
            t->pinned = -1;
            wrk_tier_pump(t);
            break;
        }
        wrk_tier_pump(t);
        /* on a committing device its buffer also needs memory to the prefix (a failure is
         * reported at the top of the loop: a later acquire tries again) */
        if (t->layers[l].state == WRK_TIER_ON_DEVICE &&
            (!wrk_tier_commits(t) || wrk_tier_commit(t, t->layers[l].dev, wrk_tier_need(t))))
            break;
        if (t->failed) continue;
        if (t0 == 0) {
            t0 = wrk_tier_now_ns();
            t->stats.stalls++;
        }
        pthread_cond_wait(&t->changed, &t->mu);
    }
    if (t0) t->stats.stall_ns += wrk_tier_now_ns() - t0;
    if (rc == PIE_OK) *base = wrk_tier_buf(&t->dev, t->layers[l].dev);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

void wrk_tier_touch(wrk_tier *t, size_t bytes) {
    pthread_mutex_lock(&t->mu);
    if (bytes > t->cfg.layer_bytes) bytes = t->cfg.layer_bytes;
    if (bytes > t->used) {
        t->used = bytes;
        /* a committing device: the layers beyond the budget leave; each buffer gets its
         * memory when the engine acquires or holds its layer (or one moves into it) */
        if (wrk_tier_commits(t)) wrk_tier_pump(t);
    }
    pthread_mutex_unlock(&t->mu);
}

void wrk_tier_release(wrk_tier *t, uint32_t l) {
    pthread_mutex_lock(&t->mu);
    t->pinned = -1;
    t->cursor = (l + 1) % t->cfg.n_layers;
    wrk_tier_pump(t);
    pthread_mutex_unlock(&t->mu);
}

static void wrk_tier_wait_idle(wrk_tier *t) {
    while (t->link[WRK_TIER_IN].busy || t->link[WRK_TIER_OUT].busy)
        pthread_cond_wait(&t->changed, &t->mu);
}

void wrk_tier_hold(wrk_tier *t) {
    pthread_mutex_lock(&t->mu);
    t->holds++;
    wrk_tier_wait_idle(t);
    pthread_mutex_unlock(&t->mu);
}

pie_code wrk_tier_hold_ready(wrk_tier *t, pie_status *st) {
    wrk_tier_hold(t);
    pthread_mutex_lock(&t->mu);
    pie_code rc = PIE_OK;
    size_t need = wrk_tier_commits(t) ? wrk_tier_need(t) : 0;
    for (uint32_t l = 0; need && l < t->cfg.n_layers && !t->failed; l++)
        if (t->layers[l].state == WRK_TIER_ON_DEVICE)
            (void)wrk_tier_commit(t, t->layers[l].dev, need);
    if (t->failed) {
        t->failed = false;
        rc = pie_status_set(st, t->failure.code, "%s", t->failure.msg);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

void *wrk_tier_where(wrk_tier *t, uint32_t l) {
    pthread_mutex_lock(&t->mu);
    const wrk_tier_layer *L = &t->layers[l];
    void *p = L->state == WRK_TIER_ON_DEVICE ? wrk_tier_buf(&t->dev, L->dev)
                                             : wrk_tier_buf(&t->host, L->host);
    pthread_mutex_unlock(&t->mu);
    return p;
}

void wrk_tier_resume(wrk_tier *t) {
    pthread_mutex_lock(&t->mu);
    if (t->holds > 0) t->holds--;
    wrk_tier_pump(t);
    pthread_mutex_unlock(&t->mu);
}

uint32_t wrk_tier_set_slots(wrk_tier *t, uint32_t slots) {
    pthread_mutex_lock(&t->mu);
    if (slots < t->cfg.min_slots) slots = t->cfg.min_slots;
    if (slots > t->dev.n) slots = t->dev.n;
    t->slots = slots;
    slots = wrk_tier_slots_now(t);
    t->slots = slots; /* the prefix never shrinks: what does not fit now never will */
    wrk_tier_pump(t);
    pthread_mutex_unlock(&t->mu);
    return slots;
}

void wrk_tier_quiesce(wrk_tier *t) {
    pthread_mutex_lock(&t->mu);
    wrk_tier_wait_idle(t);
    pthread_mutex_unlock(&t->mu);
}

void wrk_tier_get_stats(wrk_tier *t, wrk_tier_stats *out) {
    pthread_mutex_lock(&t->mu);
    *out = t->stats;
    out->slots = wrk_tier_slots_now(t);
    out->committed = t->committed;
    out->on_device = wrk_tier_dev_used(t);
    uint32_t host = 0;
    for (uint32_t l = 0; l < t->cfg.n_layers; l++)
        if (t->layers[l].state == WRK_TIER_ON_HOST || t->layers[l].state == WRK_TIER_MOVING_IN)
            host++;
    out->on_host = host;
    pthread_mutex_unlock(&t->mu);
}
