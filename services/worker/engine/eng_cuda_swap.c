/* eng_cuda_swap.c — the cuda engine under the swap policy (issue 13; the pooling paper, seed
 * 000, Fig. 4): its KV layers live in a wrk_tier whose "device" region is device memory for
 * swap_slots layers and whose "host" region is the host pool, pinned, and two copy streams
 * move whole layers between them while the forward pass computes.
 *
 * Owns: the tier's hooks into this device (the device region from cudaMalloc; the host region
 * mapped and NUMA-bound by the tier, then pinned with cudaHostRegister so the copy engines
 * reach it by DMA and kernels address it at its host address; a move is one cudaMemcpyAsync
 * on the direction's stream, waited for on the tier's copy thread), the per-layer events that
 * keep a layer from leaving before the kernels already queued on it ran, and eng_cuda.h's
 * eng_cuda_swap_* functions.
 * Does not own: the FIFO decisions, the mapping table, the copy threads (wrk_tier.c), the
 * adaptive expansion (the worker's; on this backend the device holds a fixed swap_slots
 * layers, see eng_cuda.h).
 *
 * Ordering. The host enqueues layer l's kernels only after wrk_tier_acquire said l is on the
 * device: its move in had completed (the copy thread synchronised its stream before
 * publishing). After enqueuing them the engine records layer_done[l] on the compute stream and
 * releases l; a move out of l makes its stream wait for that event first, so the copy reads
 * what the kernels wrote. A device buffer is reused only after the move out of its previous
 * layer completed, a host buffer only after the move in from it completed. Every handler ends
 * with a stream synchronisation, so between handlers no kernel is queued on any layer. */
#include <stdlib.h>
#include <string.h>

#include "eng_cuda_impl.h"

/* ---- the tier's hooks -------------------------------------------------------------------- */

static pie_code ec_swap_dev_alloc(void *user, size_t bytes, void **out, pie_status *st) {
    eng_cuda *e = user;
    *out = NULL;
    EC_CUDA(st, cudaSetDevice(e->dev));
    void *p = NULL;
    EC_CUDA(st, cudaMalloc(&p, bytes));
    cudaError_t err = cudaMemset(p, 0, bytes); /* the tier's buffers start zeroed */
    if (err != cudaSuccess) {
        (void)cudaFree(p);
        return ec_cuda_fail(st, err, "cudaMemset", __FILE__, __LINE__);
    }
    *out = p;
    return PIE_OK;
}

static void ec_swap_dev_free(void *user, void *p) {
    eng_cuda *e = user;
    (void)cudaSetDevice(e->dev);
    (void)cudaFree(p);
}

static pie_code ec_swap_host_pin(void *user, void *p, size_t bytes, pie_status *st) {
    eng_cuda *e = user;
    EC_CUDA(st, cudaSetDevice(e->dev));
    EC_CUDA(st, cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    /* copy_pages and clear_pages run kernels on layers that are in the host pool at the time:
     * they pass the host address, which must be the device's address of it too */
    void *dp = NULL;
    cudaError_t err = cudaHostGetDevicePointer(&dp, p, 0);
    if (err != cudaSuccess || dp != p) {
        (void)cudaHostUnregister(p);
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "swap: this device cannot address the pinned host pool at its host "
                              "address (%s), which the swap policy on cuda needs",
                              err != cudaSuccess ? cudaGetErrorString(err)
                                                 : "it maps it elsewhere");
    }
    return PIE_OK;
}

static void ec_swap_host_unpin(void *user, void *p) {
    eng_cuda *e = user;
    (void)cudaSetDevice(e->dev);
    (void)cudaHostUnregister(p);
}

static pie_code ec_swap_move(void *user, uint32_t l, bool to_host, void *dst, const void *src,
                             size_t bytes, pie_status *st) {
    eng_cuda *e = user;
    EC_CUDA(st, cudaSetDevice(e->dev)); /* the tier's copy threads start with device 0 */
    cudaStream_t s = to_host ? e->copy_out_stream : e->copy_stream;
    /* never recorded (the layer was not computed yet): the wait is nothing */
    if (to_host) EC_CUDA(st, cudaStreamWaitEvent(s, e->layer_done[l], 0));
    if (e->swap_copy) { /* a test's copy (it may fail), after the kernels on the layer */
        EC_CUDA(st, cudaStreamSynchronize(s));
        return e->swap_copy(e->swap_copy_user, dst, src, bytes, st);
    }
    if (bytes) EC_CUDA(st, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    EC_CUDA(st, cudaStreamSynchronize(s));
    return PIE_OK;
}

/* ---- open / close ------------------------------------------------------------------------ */

pie_code ec_swap_open(eng_cuda *e, const eng_opts *o, pie_status *st) {
    uint32_t n = e->info.n_layers;
    if (n == 0 || o->swap_slots == 0) return PIE_OK;
    e->kv_layer_bytes = e->kv_layer_elems * sizeof(krn_bf16);
    e->layer_done = calloc(n, sizeof *e->layer_done);
    e->kv_at = calloc(n, sizeof *e->kv_at);
    if (!e->layer_done || !e->kv_at)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    for (uint32_t l = 0; l < n; l++)
        EC_CUDA(st, cudaEventCreateWithFlags(&e->layer_done[l], cudaEventDisableTiming));
    EC_CUDA(st, cudaStreamCreateWithFlags(&e->copy_out_stream, cudaStreamNonBlocking));
    e->swap_copy = o->swap_copy;
    e->swap_copy_user = o->swap_copy_user;
    e->swap_mem = (wrk_tier_mem){.user = e,
                                 .dev_alloc = ec_swap_dev_alloc,
                                 .dev_free = ec_swap_dev_free,
                                 .host_pin = ec_swap_host_pin,
                                 .host_unpin = ec_swap_host_unpin,
                                 .move = ec_swap_move};
    uint32_t min = o->swap_min_slots ? o->swap_min_slots : (n > 1 ? 2 : 1);
    if (min > o->swap_slots) min = o->swap_slots;
    uint64_t host_buffers = o->swap_host_bytes / e->kv_layer_bytes;
    wrk_tier_config tc = {
        .n_layers = n,
        .layer_bytes = e->kv_layer_bytes,
        .slots = o->swap_slots,
        .min_slots = min,
        .host_buffers = host_buffers > UINT32_MAX ? UINT32_MAX : (uint32_t)host_buffers,
        .device_buffers = o->swap_slots, /* the device's budget: never more layers there */
        .mem = &e->swap_mem,
        .link_bytes_per_s = o->swap_link_bytes_per_s,
        .host_numa_bind = o->host_numa_bind,
        .host_numa_node = o->host_numa_node,
    };
    pie_code rc = wrk_tier_open(&tc, &e->tier, st);
    if (rc != PIE_OK) return rc;
    e->info.swap_min_slots = min;
    return PIE_OK;
}

void ec_swap_close(eng_cuda *e) {
    wrk_tier_close(e->tier); /* first: its copy threads use the streams and events */
    e->tier = NULL;
    if (e->layer_done)
        for (uint32_t l = 0; l < e->info.n_layers; l++)
            if (e->layer_done[l]) (void)cudaEventDestroy(e->layer_done[l]);
    if (e->copy_out_stream) (void)cudaStreamDestroy(e->copy_out_stream);
    free(e->layer_done);
    free(e->kv_at);
    e->layer_done = NULL;
    e->kv_at = NULL;
}

/* ---- the engine's side ------------------------------------------------------------------- */

krn_bf16 *ec_kv(const eng_cuda *e, uint32_t l) {
    return e->tier ? e->kv_at[l] : e->kv + (size_t)l * e->kv_layer_elems;
}

pie_code ec_swap_acquire(eng_cuda *e, uint32_t l, pie_status *st) {
    if (!e->tier) return PIE_OK;
    void *base = NULL;
    pie_code rc = wrk_tier_acquire(e->tier, l, &base, st);
    if (rc == PIE_OK) e->kv_at[l] = base;
    return rc;
}

void ec_swap_release(eng_cuda *e, uint32_t l) {
    if (!e->tier) return;
    /* without the event a move out could overtake the kernels: wait for them instead */
    if (cudaEventRecord(e->layer_done[l], e->stream) != cudaSuccess)
        (void)cudaStreamSynchronize(e->stream);
    wrk_tier_release(e->tier, l);
}

void ec_swap_hold(eng_cuda *e) {
    if (!e->tier) return;
    wrk_tier_hold(e->tier);
    for (uint32_t l = 0; l < e->info.n_layers; l++) e->kv_at[l] = wrk_tier_where(e->tier, l);
}

void ec_swap_resume(eng_cuda *e) {
    if (e->tier) wrk_tier_resume(e->tier);
}

void ec_swap_touch(eng_cuda *e, uint32_t pages) {
    if (e->tier) wrk_tier_touch(e->tier, (size_t)pages * e->info.kv_page_layer_bytes);
}

/* ---- eng_cuda.h -------------------------------------------------------------------------- */

pie_code eng_cuda_swap_set_slots(eng_cuda *e, uint32_t slots, uint32_t *applied, pie_status *st) {
    if (!e->tier)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "swap_set_slots: the engine was opened without the swap policy");
    uint32_t got = wrk_tier_set_slots(e->tier, slots);
    if (applied) *applied = got;
    return PIE_OK;
}

void eng_cuda_swap_get_stats(eng_cuda *e, eng_swap_stats *out) {
    memset(out, 0, sizeof *out);
    if (!e->tier) return;
    wrk_tier_stats s;
    wrk_tier_get_stats(e->tier, &s);
    *out = (eng_swap_stats){
        .slots = s.slots,
        .on_device = s.on_device,
        .on_host = s.on_host,
        .swap_in_bytes = s.swap_in_bytes,
        .swap_out_bytes = s.swap_out_bytes,
        .swaps_in = s.swaps_in,
        .swaps_out = s.swaps_out,
        .stalls = s.stalls,
        .stall_ns = s.stall_ns,
        .copy_failures = s.copy_failures,
    };
}

void eng_cuda_swap_quiesce(eng_cuda *e) {
    if (e->tier) wrk_tier_quiesce(e->tier);
}
