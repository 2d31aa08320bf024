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
 * Under adaptive expansion (swap_min_slots < swap_slots) the device region is an address range
 * per layer whose memory is committed as the used prefix grows, through the driver's virtual
 * memory calls (cuMemCreate/Map/SetAccess, found with cudaGetDriverEntryPointByVersion: no
 * link to libcuda), in pieces of at least 1/32 of a layer, zeroed as committed.
 * Does not own: the FIFO decisions, the mapping table, the copy threads, keeping the committed
 * memory within the budget (wrk_tier.c), choosing the slot count (the worker's wrk_memrt).
 *
 * Ordering. The host enqueues layer l's kernels only after wrk_tier_acquire said l is on the
 * device: its move in had completed (the copy thread synchronised its stream before
 * publishing). After enqueuing them the engine records layer_done[l] on the compute stream and
 * releases l; a move out of l makes its stream wait for that event first, so the copy reads
 * what the kernels wrote. A device buffer is reused only after the move out of its previous
 * layer completed, a host buffer only after the move in from it completed. Every handler ends
 * with a stream synchronisation, so between handlers no kernel is queued on any layer. */
#include <cuda.h> /* the driver's types; its functions come through cudaGetDriverEntryPoint */
#include <stdlib.h>
#include <string.h>

#include "eng_cuda_impl.h"
#include "eng_tier.h"

/* ---- the tier's hooks -------------------------------------------------------------------- */

static pie_code ec_swap_dev_alloc(void *user, size_t bytes, void **out, pie_status *st) {
    eng_cuda *e = user;
    *out = NULL;
    EC_CUDA(st, cudaSetDevice(e->dev));
    void *p = NULL;
    EC_CUDA(st, cudaMalloc(&p, bytes));
    /* the tier's buffers start zeroed; the legacy stream's memset does not order the engine's
     * non-blocking streams after it: wait for it here */
    cudaError_t err = cudaMemset(p, 0, bytes);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
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
    if (bytes)
        EC_CUDA(st, cudaMemcpyAsync(dst, src, bytes,
                                    to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, s));
    EC_CUDA(st, cudaStreamSynchronize(s));
    return PIE_OK;
}

/* ---- adaptive expansion: a device region committed as it is used ------------------------- */

/* The CUDA virtual memory calls, looked up in the driver at open: linking libcuda would make
 * every binary of the build need a driver to start. */
typedef struct ec_vmm {
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *,
                            CUmemAllocationGranularity_flags);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUmemAllocationProp prop;
    CUmemAccessDesc access;
    size_t gran;       /* the device's allocation granularity */
    size_t step;       /* commit piece: one physical allocation each */
    size_t reserved;   /* the region's address range */
    cudaStream_t zero; /* zeroes what is committed */
} ec_vmm;

static pie_code ec_vmm_sym(const char *name, void **fn, pie_status *st) {
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t err = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
    if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || !*fn)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "swap: the CUDA driver has no %s (%s): adaptive expansion on cuda "
                              "needs its virtual memory management; set memory.device_layers",
                              name, err != cudaSuccess ? cudaGetErrorString(err) : "not found");
    return PIE_OK;
}

static pie_code ec_vmm_fail(pie_status *st, CUresult r, const char *call) {
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "swap: %s failed (CUresult %d)", call,
                          (int)r);
}

/* The driver's calls, the device's granularity and the commit piece for layers of
 * `layer_bytes` (at least 1/32 of a layer, so a buffer grows in at most ~32 pieces). */
static pie_code ec_vmm_open(eng_cuda *e, size_t layer_bytes, pie_status *st) {
    ec_vmm *v = calloc(1, sizeof *v);
    if (!v) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    e->vmm = v;
    struct {
        const char *name;
        void **fn;
    } syms[] = {{"cuMemGetAllocationGranularity", (void **)&v->granularity},
                {"cuMemAddressReserve", (void **)&v->reserve},
                {"cuMemAddressFree", (void **)&v->address_free},
                {"cuMemCreate", (void **)&v->create},
                {"cuMemRelease", (void **)&v->release},
                {"cuMemMap", (void **)&v->map},
                {"cuMemUnmap", (void **)&v->unmap},
                {"cuMemSetAccess", (void **)&v->set_access}};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        pie_code rc = ec_vmm_sym(syms[i].name, syms[i].fn, st);
        if (rc != PIE_OK) return rc;
    }
    v->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    v->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    v->prop.location.id = e->dev;
    v->access.location = v->prop.location;
    v->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t gran = 0;
    CUresult r = v->granularity(&gran, &v->prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (r != CUDA_SUCCESS || gran == 0) return ec_vmm_fail(st, r, "cuMemGetAllocationGranularity");
    v->gran = gran;
    size_t piece = layer_bytes / 32;
    v->step = piece <= gran ? gran : (piece + gran - 1) / gran * gran;
    EC_CUDA(st, cudaStreamCreateWithFlags(&v->zero, cudaStreamNonBlocking));
    return PIE_OK;
}

static void ec_vmm_close(eng_cuda *e) {
    ec_vmm *v = e->vmm;
    if (!v) return;
    if (v->zero) (void)cudaStreamDestroy(v->zero);
    free(v);
    e->vmm = NULL;
}

/* dev_alloc of a committing device: addresses only. */
static pie_code ec_vmm_reserve(void *user, size_t bytes, void **out, pie_status *st) {
    eng_cuda *e = user;
    ec_vmm *v = e->vmm;
    CUdeviceptr p = 0;
    CUresult r = v->reserve(&p, bytes, v->gran, 0, 0); /* pieces need only its alignment */
    if (r != CUDA_SUCCESS) return ec_vmm_fail(st, r, "cuMemAddressReserve");
    v->reserved = bytes;
    *out = (void *)(uintptr_t)p;
    return PIE_OK;
}

static void ec_vmm_unreserve(void *user, void *p) { /* the tier decommitted every buffer */
    eng_cuda *e = user;
    (void)e->vmm->address_free((CUdeviceptr)(uintptr_t)p, e->vmm->reserved);
}

static void ec_vmm_decommit(void *user, void *buf, size_t have) {
    eng_cuda *e = user;
    ec_vmm *v = e->vmm;
    (void)cudaSetDevice(e->dev);
    for (size_t off = 0; off < have; off += v->step) /* one mapping per piece */
        (void)v->unmap((CUdeviceptr)(uintptr_t)buf + off, v->step);
}

static pie_code ec_vmm_commit(void *user, void *buf, size_t have, size_t want, pie_status *st) {
    eng_cuda *e = user;
    ec_vmm *v = e->vmm;
    EC_CUDA(st, cudaSetDevice(e->dev));
    CUdeviceptr base = (CUdeviceptr)(uintptr_t)buf;
    size_t off = have;
    CUresult r = CUDA_SUCCESS;
    for (; off < want; off += v->step) {
        CUmemGenericAllocationHandle h;
        r = v->create(&h, v->step, &v->prop, 0);
        if (r != CUDA_SUCCESS) break;
        r = v->map(base + off, v->step, 0, h, 0);
        (void)v->release(h); /* the mapping holds the memory until it is unmapped */
        if (r != CUDA_SUCCESS) break;
    }
    if (r == CUDA_SUCCESS) r = v->set_access(base + have, want - have, &v->access, 1);
    if (r != CUDA_SUCCESS) { /* back to `have` */
        for (size_t k = have; k < off; k += v->step) (void)v->unmap(base + k, v->step);
        return ec_vmm_fail(st, r, "committing device memory (cuMemCreate/Map/SetAccess)");
    }
    cudaError_t err = cudaMemsetAsync((char *)buf + have, 0, want - have, v->zero);
    if (err == cudaSuccess) err = cudaStreamSynchronize(v->zero);
    if (err != cudaSuccess) { /* back to `have`: the tier still counts that */
        for (size_t k = have; k < want; k += v->step) (void)v->unmap(base + k, v->step);
        return ec_cuda_fail(st, err, "cudaMemsetAsync of committed device memory", __FILE__,
                            __LINE__);
    }
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
    /* the test's copy (o->swap_copy) runs inside ec_swap_move, after the layer's event */
    wrk_tier_config tc = eng_tier_config(o, n, e->kv_layer_bytes);
    if (tc.min_slots > tc.slots) tc.min_slots = tc.slots;
    uint32_t min = tc.min_slots;
    /* Fewer layers allowed on the device than at start: adaptive expansion. The page space is
     * sized for min layers' caches in the device's KV budget, so that budget is min layer
     * buffers; more layers fit it while fewer pages are in use, which needs buffers committed
     * as their used prefix grows. Otherwise the device holds swap_slots buffers for good. */
    bool commit = min < o->swap_slots;
    if (commit) {
        pie_code rc = ec_vmm_open(e, e->kv_layer_bytes, st);
        if (rc != PIE_OK) return rc;
        e->swap_mem.dev_alloc = ec_vmm_reserve;
        e->swap_mem.dev_free = ec_vmm_unreserve;
        e->swap_mem.dev_commit = ec_vmm_commit;
        e->swap_mem.dev_decommit = ec_vmm_decommit;
        size_t step = e->vmm->step;
        e->swap_mem.dev_step = step;
        /* min buffers as committed: each layer rounded up to whole pieces */
        e->swap_mem.device_bytes = (uint64_t)min * ((e->kv_layer_bytes + step - 1) / step * step);
    }
    /* what the FIFO can use at the most expanded point; a larger pool is not pinned */
    if (tc.host_buffers > wrk_tier_host_buffers_needed(n, min))
        tc.host_buffers = wrk_tier_host_buffers_needed(n, min);
    /* committing: a buffer per layer, memory as budgeted; else the budget in buffers */
    tc.device_buffers = commit ? n : o->swap_slots;
    tc.mem = &e->swap_mem;
    pie_code rc = wrk_tier_open(&tc, &e->tier, st);
    if (rc != PIE_OK) return rc;
    e->info.swap_min_slots = min;
    return PIE_OK;
}

void ec_swap_close(eng_cuda *e) {
    wrk_tier_close(e->tier); /* first: its copy threads use the streams and events */
    e->tier = NULL;
    ec_vmm_close(e);
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

pie_code ec_swap_hold(eng_cuda *e, pie_status *st) {
    if (!e->tier) return PIE_OK;
    pie_code rc = wrk_tier_hold_ready(e->tier, st);
    for (uint32_t l = 0; l < e->info.n_layers; l++) e->kv_at[l] = wrk_tier_where(e->tier, l);
    return rc;
}

void ec_swap_resume(eng_cuda *e) {
    if (e->tier) wrk_tier_resume(e->tier);
}

void ec_swap_touch(eng_cuda *e, uint32_t pages) {
    if (e->tier) wrk_tier_touch(e->tier, (size_t)pages * e->info.kv_page_layer_bytes);
}

/* ---- eng_cuda.h -------------------------------------------------------------------------- */

pie_code eng_cuda_swap_set_slots(eng_cuda *e, uint32_t slots, uint32_t *applied, pie_status *st) {
    return eng_tier_set_slots(e->tier, slots, applied, st);
}

void eng_cuda_swap_get_stats(eng_cuda *e, eng_swap_stats *out) { eng_tier_stats(e->tier, out); }

void eng_cuda_swap_quiesce(eng_cuda *e) {
    if (e->tier) wrk_tier_quiesce(e->tier);
}
