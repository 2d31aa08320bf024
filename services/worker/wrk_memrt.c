/* wrk_memrt.c — see wrk_memrt.h. */
#include "wrk_memrt.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pie_log.h"
#include "wrk_nulldev.h"
#include "wrk_offload.h"
#include "wrk_offrt.h"

struct wrk_memrt {
    wrk_mem_plan plan;
    const wrk_backend *sb;  /* policy swap: the engine side of the backend (cpu, cuda), or NULL */
    wrk_nulldev *nd;        /* the null backend's emulated device instead of sb, or NULL */
    wrk_mem_adapt adapt;    /* step thread only */
    const wrk_backend *ob;  /* policy offload: the engine side whose host share adapts, or NULL */
    wrk_nulldev *ond;       /* policy offload on the null backend: its emulated device, or NULL */
    wrk_off_adapt oadapt;   /* step thread only */
    uint64_t last_wait_ns;  /* step thread only */
    uint64_t last_gain_pages, last_gain_steps; /* step thread only */
    uint32_t slots;         /* step thread only */
    uint64_t last_stall_ns; /* step thread only */
    atomic_uint effective;
    void (*on_capacity)(void *user, uint32_t eff);
    void *on_capacity_user;
    /* metrics; the counters follow the engine's cumulative stats at each scrape */
    pthread_mutex_t scrape_mu;
    eng_swap_stats seen; /* what the counters hold */
    pie_gauge *g_policy[4], *g_effective, *g_slots, *g_on_host;
    pie_counter *c_in, *c_out, *c_stalls, *c_stall_us, *c_changes;
};

static const Pie__V1__MemoryPolicy wrk_memrt_pb[] = {
    PIE__V1__MEMORY_POLICY__MEMORY_POLICY_GPU,
    PIE__V1__MEMORY_POLICY__MEMORY_POLICY_SWAP,
    PIE__V1__MEMORY_POLICY__MEMORY_POLICY_OFFLOAD,
    PIE__V1__MEMORY_POLICY__MEMORY_POLICY_AUTO,
};

Pie__V1__MemoryPolicy wrk_memrt_policy_pb(const wrk_memrt *r) {
    return wrk_memrt_pb[r->plan.policy];
}

void wrk_memrt_capacity(const wrk_memrt *r, Pie__V1__WorkerCapacity *c) {
    c->kv_pages_max = r->plan.kv_pages_max;
    c->kv_pages_effective = atomic_load(&r->effective);
    c->kv_pages_gpu = r->plan.kv_pages_gpu;
}

static void wrk_memrt_swap_stats(const wrk_memrt *r, eng_swap_stats *s) {
    memset(s, 0, sizeof *s);
    if (r->sb) {
        r->sb->swap_get_stats(r->sb->ctx, s);
    } else if (r->nd) {
        wrk_nulldev_stats n;
        wrk_nulldev_get_stats(r->nd, &n);
        *s = (eng_swap_stats){.slots = n.slots,
                              .on_device = r->plan.n_layers - n.on_host,
                              .on_host = n.on_host,
                              .swap_in_bytes = n.swap_in_bytes,
                              .swap_out_bytes = n.swap_out_bytes,
                              .swaps_in = n.swaps_in,
                              .swaps_out = n.swaps_out,
                              .stalls = n.stalls,
                              .stall_ns = n.stall_ns};
    }
}

/* Moves the device's slot count (the engine's, or the emulated device's). */
static pie_code wrk_memrt_set_slots(wrk_memrt *r, uint32_t want, uint32_t *got, pie_status *st) {
    if (r->sb) return r->sb->swap_set_slots(r->sb->ctx, want, got, st);
    *got = wrk_nulldev_set_slots(r->nd, want);
    return PIE_OK;
}

void wrk_memrt_use_backend(wrk_memrt *r, const wrk_backend *b) {
    if (r->plan.policy == WRK_MEM_SWAP && b->swap_get_stats && b->swap_set_slots) r->sb = b;
    if (r->plan.policy == WRK_MEM_OFFLOAD && b->offload_get_stats) r->ob = b;
}

void wrk_memrt_use_nulldev(wrk_memrt *r, wrk_nulldev *d) {
    if (r->plan.policy == WRK_MEM_SWAP && r->sb == NULL) r->nd = d;
    if (r->plan.policy == WRK_MEM_OFFLOAD && r->ob == NULL) r->ond = d;
}

void wrk_memrt_offload_tune(wrk_memrt *r, const wrk_off_adapt_opts *o) {
    wrk_off_adapt_tune(&r->oadapt, o);
    atomic_store(&r->effective, r->oadapt.pages);
}

void wrk_memrt_stats(const wrk_memrt *r, Pie__V1__WorkerStats *s) {
    eng_swap_stats ss;
    wrk_memrt_swap_stats(r, &ss);
    s->swap_in_bytes = ss.swap_in_bytes;
    s->swap_out_bytes = ss.swap_out_bytes;
}

void wrk_memrt_on_capacity(wrk_memrt *r, void (*fn)(void *user, uint32_t eff), void *user) {
    r->on_capacity = fn;
    r->on_capacity_user = user;
}

/* ---- metrics ----------------------------------------------------------------------------- */

static void wrk_memrt_collect(void *arg) {
    wrk_memrt *r = arg;
    eng_swap_stats s;
    wrk_memrt_swap_stats(r, &s);
    pie_gauge_set(r->g_effective, atomic_load(&r->effective));
    pie_gauge_set(r->g_slots, r->plan.policy == WRK_MEM_SWAP ? s.slots : r->plan.n_layers);
    pie_gauge_set(r->g_on_host, s.on_host);
    pthread_mutex_lock(&r->scrape_mu); /* collectors may run on several threads at once */
    pie_counter_add(r->c_in, s.swap_in_bytes - r->seen.swap_in_bytes);
    pie_counter_add(r->c_out, s.swap_out_bytes - r->seen.swap_out_bytes);
    pie_counter_add(r->c_stalls, s.stalls - r->seen.stalls);
    pie_counter_add(r->c_stall_us, s.stall_ns / 1000 - r->seen.stall_ns / 1000);
    r->seen = s;
    pthread_mutex_unlock(&r->scrape_mu);
}

static pie_code wrk_memrt_metrics(wrk_memrt *r, pie_metrics *m, pie_status *st) {
    for (int i = 0; i < 4; i++) {
        pie_metric_label l = {"policy", wrk_mem_policy_names[i]};
        r->g_policy[i] =
            pie_metrics_gauge(m, "pie_worker_memory_policy",
                              "1 for the worker's memory.policy, 0 for the others", &l, 1, st);
        if (!r->g_policy[i]) return st->code;
        pie_gauge_set(r->g_policy[i], (int)r->plan.policy == i);
    }
    struct {
        pie_gauge **g;
        const char *name, *help;
    } gauges[] = {
        {&r->g_effective, "pie_worker_kv_pages_effective",
         "KV pages the controller may allocate now (grows and shrinks with expansion)"},
        {&r->g_slots, "pie_worker_swap_device_layers",
         "layers whose KV the device region holds at once (the model's layers: no swapping)"},
        {&r->g_on_host, "pie_worker_swap_layers_on_host",
         "layers whose KV is only in the host region now"},
    };
    for (size_t i = 0; i < sizeof gauges / sizeof gauges[0]; i++)
        if (!(*gauges[i].g = pie_metrics_gauge(m, gauges[i].name, gauges[i].help, NULL, 0, st)))
            return st->code;
    struct {
        pie_counter **c;
        const char *name, *help;
    } counters[] = {
        {&r->c_in, "pie_worker_swap_in_bytes_total", "KV bytes swapped host → device"},
        {&r->c_out, "pie_worker_swap_out_bytes_total", "KV bytes swapped device → host"},
        {&r->c_stalls, "pie_worker_swap_stalls_total",
         "layers whose compute waited for their swap-in"},
        {&r->c_stall_us, "pie_worker_swap_stall_microseconds_total",
         "time compute waited for swaps"},
        {&r->c_changes, "pie_worker_swap_expansion_changes_total",
         "times adaptive expansion moved the number of layers on the device"},
    };
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++)
        if (!(*counters[i].c =
                  pie_metrics_counter(m, counters[i].name, counters[i].help, NULL, 0, st)))
            return st->code;
    return pie_metrics_add_collector(m, wrk_memrt_collect, r, st);
}

/* ---- open / close ------------------------------------------------------------------------ */

wrk_memrt *wrk_memrt_create(const wrk_mem_plan *plan, pie_metrics *metrics, pie_status *st) {
    wrk_memrt *r = calloc(1, sizeof *r);
    if (!r) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "worker: out of memory");
        return NULL;
    }
    r->plan = *plan;
    r->slots = plan->start_slots;
    atomic_store(&r->effective, wrk_mem_effective(&r->plan, r->slots));
    wrk_mem_adapt_init(&r->adapt, &r->plan, 0);
    wrk_off_adapt_init(&r->oadapt, plan->kv_pages_gpu, plan->kv_pages_max, 0, plan->page_size);
    if (plan->policy == WRK_MEM_OFFLOAD) { /* the capacity follows the scheduler's estimate */
        wrk_off_adapt_tune(&r->oadapt, &(wrk_off_adapt_opts){.estimate = true});
        atomic_store(&r->effective, r->oadapt.pages);
    }
    pthread_mutex_init(&r->scrape_mu, NULL);
    if (metrics && wrk_memrt_metrics(r, metrics, st) != PIE_OK) {
        wrk_memrt_destroy(r);
        return NULL;
    }
    return r;
}

void wrk_memrt_destroy(wrk_memrt *r) {
    if (!r) return;
    pthread_mutex_destroy(&r->scrape_mu);
    free(r);
}

/* ---- adaptive expansion ------------------------------------------------------------------ */

/* Runs the device at `want` layers (the engine or the emulated device may clamp it), updates
 * the effective capacity and tells the controller when it moved. */
static void wrk_memrt_apply(wrk_memrt *r, uint32_t want, const char *why) {
    pie_status st;
    uint32_t got = want;
    if (wrk_memrt_set_slots(r, want, &got, &st) != PIE_OK) {
        pie_log_error("wrk.mem.set_slots", "slots=%u error=\"%s\"", want, st.msg);
        return;
    }
    uint32_t eff = wrk_mem_effective(&r->plan, got);
    pie_log_info("wrk.mem.expansion",
                 "device_layers=%u->%u of %u kv_pages_effective=%u->%u reason=%s", r->slots, got,
                 r->plan.n_layers, atomic_load(&r->effective), eff, why);
    r->slots = got;
    if (r->c_changes) pie_counter_add(r->c_changes, 1);
    if (eff == atomic_exchange(&r->effective, eff)) return;
    if (r->on_capacity) r->on_capacity(r->on_capacity_user, eff);
}

/* Offload: the effective capacity moved to eff (why: "exposed", "hidden", "spill"). */
static void wrk_memrt_offload_capacity(wrk_memrt *r, uint32_t eff, const char *why) {
    uint32_t was = atomic_exchange(&r->effective, eff);
    if (eff == was) return;
    pie_log_info("wrk.mem.offload_capacity",
                 "kv_pages_effective=%u->%u of %u reason=%s estimate_window_epochs=%u", was, eff,
                 r->plan.kv_pages_max, why, r->oadapt.window);
    if (r->c_changes) pie_counter_add(r->c_changes, 1);
    if (r->on_capacity) r->on_capacity(r->on_capacity_user, eff);
}

void wrk_memrt_after_forward(void *user, uint64_t tokens, uint64_t ns, uint32_t kv_live) {
    wrk_memrt *r = user;
    if (r && (r->ob || r->ond)) { /* offload: the host's share follows what its attention hides */
        eng_offload_stats os;
        if (r->ond) wrk_offrt_nulldev_stats(r->ond, &os);
        else
            r->ob->offload_get_stats(r->ob->ctx, &os);
        uint64_t wait = os.host_wait_ns - r->last_wait_ns;
        uint64_t gain = os.gain_pages - r->last_gain_pages;
        uint64_t gain_steps = os.gain_steps - r->last_gain_steps;
        r->last_wait_ns = os.host_wait_ns;
        r->last_gain_pages = os.gain_pages;
        r->last_gain_steps = os.gain_steps;
        uint32_t was = atomic_load(&r->effective);
        uint32_t eff =
            wrk_off_adapt_step_est(&r->oadapt, tokens, ns, wait, gain, gain_steps, kv_live);
        if (eff != was) {
            const char *why = r->oadapt.opts.estimate
                                  ? (eff < was ? "estimate_down" : "estimate_up")
                                  : (eff < was ? "exposed" : "hidden");
            wrk_memrt_offload_capacity(r, eff, why);
        }
        return;
    }
    if (!r || (!r->sb && !r->nd) || !r->plan.adaptive) return;
    eng_swap_stats s;
    wrk_memrt_swap_stats(r, &s);
    uint64_t stall = s.stall_ns - r->last_stall_ns;
    r->last_stall_ns = s.stall_ns;
    /* A back-off may leave fewer effective pages than live ones: those stay valid, the
     * controller allocates no more until enough are freed (or spills again). */
    uint32_t want = wrk_mem_adapt_step(&r->adapt, tokens, ns, stall, kv_live);
    if (want == r->slots) return;
    wrk_memrt_apply(r, want, want < r->slots ? "expand" : "back_off");
}

void wrk_memrt_after_slots(void *user, uint32_t kv_live) {
    wrk_memrt *r = user;
    if (r && (r->ob || r->ond) && kv_live > atomic_load(&r->effective)) { /* offload: spilled */
        wrk_memrt_offload_capacity(r, wrk_off_adapt_spill(&r->oadapt, kv_live), "spill");
        return;
    }
    if (!r || (!r->sb && !r->nd) || kv_live <= atomic_load(&r->effective)) return;
    /* the controller spilled: more pages live than the capacity; move layers to the host
     * until they fit (the controller never goes beyond kv_pages_max, which min_slots holds) */
    uint32_t want = wrk_mem_slots_for(&r->plan, kv_live);
    if (want == 0) {
        pie_log_error("wrk.mem.spill", "kv_live=%u exceeds kv_pages_max=%u", kv_live,
                      r->plan.kv_pages_max);
        want = r->plan.min_slots;
    }
    if (want >= r->slots) return;
    wrk_mem_adapt_force(&r->adapt, want);
    wrk_memrt_apply(r, want, "spill");
}
