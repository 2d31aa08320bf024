/* wrk_offrt.c — see wrk_offrt.h. */
#include "wrk_offrt.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct wrk_offrt {
    const wrk_backend *b;   /* its offload_get_stats, or NULL */
    wrk_nulldev *nd;        /* the null backend's emulated device instead of b, or NULL */
    pthread_mutex_t mu;     /* collectors may run on several threads at once */
    eng_offload_stats seen; /* what the counters hold */
    pie_gauge *g_instances, *g_attn_us, *g_on_host, *g_auto[2];
    pie_counter *c_steps[3], *c_attn_us, *c_items, *c_moved[2];
};

void wrk_offrt_nulldev_stats(wrk_nulldev *d, eng_offload_stats *out) {
    wrk_nulldev_stats n;
    wrk_nulldev_get_stats(d, &n);
    wrk_off_costs c = wrk_nulldev_offload_costs(d);
    *out = (eng_offload_stats){
        .device_pages = wrk_nulldev_config_of(d)->offload_device_pages,
        .pages_on_host = n.place.pages_on_host,
        .pages_on_device = n.place.pages_on_device,
        .steps = n.forwards,
        .offload_steps = n.offload_steps,
        .forced_steps = n.place.forced_steps,
        .host_items = n.host_items,
        .last_host_items = n.last_host_items,
        .host_attn_ns = n.host_attn_ns,
        .last_host_attn_ns = n.last_host_attn_ns,
        .host_wait_ns = n.host_wait_ns,
        .pages_to_host = n.place.pages_to_host,
        .pages_to_device = n.place.pages_to_device,
        .deferred = n.place.deferred,
        .gain_pages = n.place.gain_pages,
        .gain_steps = n.place.gain_steps,
        .lin_tok = c.lin_tok,
        .lin_fixed = c.lin_fixed,
        .dattn_kv = c.dattn_kv,
        .hattn_kv = c.hattn_kv,
        .xfer_tok = c.xfer_tok,
    };
}

void wrk_offrt_use_nulldev(wrk_offrt *r, wrk_nulldev *d) {
    if (r->b == NULL) r->nd = d;
}

static void wrk_offrt_collect(void *arg) {
    wrk_offrt *r = arg;
    eng_offload_stats s;
    if (r->nd) wrk_offrt_nulldev_stats(r->nd, &s);
    else if (r->b)
        r->b->offload_get_stats(r->b->ctx, &s);
    else
        memset(&s, 0, sizeof s);
    pie_gauge_set(r->g_instances, s.last_host_items);
    pie_gauge_set(r->g_attn_us, (double)s.last_host_attn_ns / 1e3);
    pie_gauge_set(r->g_on_host, s.pages_on_host);
    pthread_mutex_lock(&r->mu);
    uint64_t device_only = (s.steps - s.offload_steps) - (r->seen.steps - r->seen.offload_steps);
    uint64_t forced = s.forced_steps - r->seen.forced_steps;
    uint64_t two = s.offload_steps - r->seen.offload_steps;
    pie_counter_add(r->c_steps[0], device_only);
    pie_counter_add(r->c_steps[1], two);
    pie_counter_add(r->c_steps[2], forced);
    pie_counter_add(r->c_attn_us, s.host_attn_ns / 1000 - r->seen.host_attn_ns / 1000);
    pie_counter_add(r->c_items, s.host_items - r->seen.host_items);
    pie_counter_add(r->c_moved[0], s.pages_to_host - r->seen.pages_to_host);
    pie_counter_add(r->c_moved[1], s.pages_to_device - r->seen.pages_to_device);
    r->seen = s;
    pthread_mutex_unlock(&r->mu);
}

static pie_code wrk_offrt_metrics(wrk_offrt *r, wrk_mem_policy auto_choice, pie_metrics *m,
                                  pie_status *st) {
    struct {
        pie_gauge **g;
        const char *name, *help;
    } gauges[] = {
        {&r->g_instances, "pie_worker_offload_host_instances",
         "decode instances whose attention ran on the host in the last forward batch"},
        {&r->g_attn_us, "pie_worker_offload_host_attention_microseconds",
         "host attention time of the last forward batch"},
        {&r->g_on_host, "pie_worker_offload_pages_on_host",
         "written KV pages whose KV is in the host pool now"},
    };
    for (size_t i = 0; i < sizeof gauges / sizeof gauges[0]; i++)
        if (!(*gauges[i].g = pie_metrics_gauge(m, gauges[i].name, gauges[i].help, NULL, 0, st)))
            return st->code;
    static const char *const kinds[] = {"device_only", "two_sub_batches", "forced"};
    for (int i = 0; i < 3; i++) {
        pie_metric_label l = {"decision", kinds[i]};
        r->c_steps[i] = pie_metrics_counter(
            m, "pie_worker_offload_steps_total",
            "forward batches by the load-aware scheduler's decision (forced: the device could not "
            "hold every decode's KV; also counted as two_sub_batches when something moved)",
            &l, 1, st);
        if (!r->c_steps[i]) return st->code;
    }
    static const char *const dirs[] = {"to_host", "to_device"};
    for (int i = 0; i < 2; i++) {
        pie_metric_label l = {"direction", dirs[i]};
        r->c_moved[i] = pie_metrics_counter(m, "pie_worker_offload_pages_moved_total",
                                            "KV pages moved (every layer) between the device and "
                                            "the host pool",
                                            &l, 1, st);
        if (!r->c_moved[i]) return st->code;
    }
    if (!(r->c_attn_us = pie_metrics_counter(m, "pie_worker_offload_host_attention_microseconds_total",
                                             "host attention time", NULL, 0, st)))
        return st->code;
    if (!(r->c_items = pie_metrics_counter(m, "pie_worker_offload_host_instances_total",
                                           "decode items whose attention ran on the host", NULL,
                                           0, st)))
        return st->code;
    static const wrk_mem_policy choices[] = {WRK_MEM_SWAP, WRK_MEM_OFFLOAD};
    for (int i = 0; i < 2; i++) {
        pie_metric_label l = {"policy", wrk_mem_policy_names[choices[i]]};
        r->g_auto[i] = pie_metrics_gauge(m, "pie_worker_memory_auto_choice",
                                         "memory.policy auto: 1 for the policy it chose at load "
                                         "(the reason is in the wrk.mem.auto log line)",
                                         &l, 1, st);
        if (!r->g_auto[i]) return st->code;
        pie_gauge_set(r->g_auto[i], auto_choice == choices[i]);
    }
    return pie_metrics_add_collector(m, wrk_offrt_collect, r, st);
}

wrk_offrt *wrk_offrt_create(const wrk_backend *b, wrk_mem_policy auto_choice, pie_metrics *metrics,
                            pie_status *st) {
    wrk_offrt *r = calloc(1, sizeof *r);
    if (!r) {
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "worker: out of memory");
        return NULL;
    }
    r->b = b && b->offload_get_stats ? b : NULL;
    if (pthread_mutex_init(&r->mu, NULL) != 0) {
        free(r);
        pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "worker: pthread_mutex_init failed");
        return NULL;
    }
    if (metrics && wrk_offrt_metrics(r, auto_choice, metrics, st) != PIE_OK) {
        wrk_offrt_destroy(r);
        return NULL;
    }
    return r;
}

void wrk_offrt_destroy(wrk_offrt *r) {
    if (!r) return;
    pthread_mutex_destroy(&r->mu);
    free(r);
}
