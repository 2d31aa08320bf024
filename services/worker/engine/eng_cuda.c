/* eng_cuda.c — the cuda backend's engine object: open/close, the device pool, weight upload,
 * and the handlers other than forward (embed, page mask and copy, clearing freshly allocated
 * pages and embedding slots, distributions, logits).
 *
 * Owns: the one device allocation made at open and its carving (weights as bf16 with q|k|v and
 * gate|up fused into one matrix each, the layer-major KV pool, page masks, embedding slots,
 * activation scratch for max_batch_tokens, split-KV partials, per-batch tables, distribution
 * buffers, the cuBLAS workspace), pinned host staging, the compute and copy streams, the
 * cuBLAS handle. No handler allocates; each ends with a stream synchronisation, so errors of
 * the device work belong to the call that caused them.
 * Does not own: the forward pass (eng_cuda_fwd.c), the kernels (kernels/cuda), the model files
 * (services/worker/model), validating what a caller can get wrong (eng_check.c: the same
 * checks and messages as the cpu backend). Device failures are PIE_INTERNAL "cuda: <call>
 * failed at <file>:<line>: <reason>". */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eng_cuda_impl.h"
#include "eng_mask.h"
#include "krn_cpu.h"

/* ---- errors ------------------------------------------------------------------------------ */

/* The first device fault of the process. Global because a CUDA context is per process: a fault
 * met by one engine has killed them all. Set once (ec_fault_state 0 → 1 → 2), read after. */
static _Atomic int ec_fault_state;
static char ec_fault_msg[PIE_STATUS_MSG_MAX];
static void (*ec_fault_hook)(const char *why, void *arg);
static void *ec_fault_hook_arg;

/* driver_types.h says of each: the process must be terminated and relaunched (an uncorrectable
 * ECC error: the data is lost). */
bool eng_cuda_error_is_fault(int cuda_error) {
    switch ((cudaError_t)cuda_error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorContained:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorExternalDevice: return true;
    default: return false;
    }
}

bool eng_cuda_fault(char *why, size_t cap) {
    if (atomic_load(&ec_fault_state) != 2) return false;
    if (why && cap) snprintf(why, cap, "%s", ec_fault_msg);
    return true;
}

void eng_cuda_on_fault(void (*hook)(const char *why, void *arg), void *arg) {
    ec_fault_hook = hook;
    ec_fault_hook_arg = arg;
}

/* Records msg as the process's device fault (the first one wins) and calls the hook. */
static void ec_note_fault(const char *msg) {
    int expect = 0;
    if (!atomic_compare_exchange_strong(&ec_fault_state, &expect, 1)) return;
    snprintf(ec_fault_msg, sizeof ec_fault_msg, "%s", msg);
    atomic_store(&ec_fault_state, 2);
    if (ec_fault_hook) ec_fault_hook(ec_fault_msg, ec_fault_hook_arg);
}

pie_code ec_cuda_fail(pie_status *st, cudaError_t err, const char *call, const char *file,
                      int line) {
    const char *base = strrchr(file, '/');
    bool fault = eng_cuda_error_is_fault((int)err);
    pie_status_set(st, PIE_INTERNAL, "cuda: %s%s failed at %s:%d: %s%s",
                   fault ? "device fault: " : "", call, base ? base + 1 : file, line,
                   cudaGetErrorString(err),
                   fault ? " (the CUDA context is lost; the worker must restart)" : "");
    if (fault) ec_note_fault(st->msg);
    return PIE_INTERNAL;
}

pie_code ec_cublas_fail(pie_status *st, cublasStatus_t s, const char *call, const char *file,
                        int line) {
    /* cuBLAS says EXECUTION_FAILED (or worse) for a dead context: the runtime says why */
    cudaError_t err = cudaPeekAtLastError();
    if (eng_cuda_error_is_fault((int)err)) return ec_cuda_fail(st, err, call, file, line);
    const char *base = strrchr(file, '/');
    return pie_status_set(st, PIE_INTERNAL, "cuda: %s failed at %s:%d: cublas status %d", call,
                          base ? base + 1 : file, line, (int)s);
}

/* ---- the pool ---------------------------------------------------------------------------- */

static size_t ec_mul(size_t a, size_t b) { return a != 0 && b > SIZE_MAX / a ? SIZE_MAX : a * b; }
static size_t ec_add(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }
static size_t ec_align(size_t n) {
    return n >= SIZE_MAX - EC_ALIGN ? SIZE_MAX : (n + EC_ALIGN - 1) / EC_ALIGN * EC_ALIGN;
}

/* Two passes over the same code: measure (base NULL), then assign. */
typedef struct ec_carver {
    char *base;
    size_t used;
} ec_carver;

static void *ec_carve(ec_carver *c, size_t bytes) {
    size_t at = c->used;
    c->used = ec_add(c->used, ec_align(bytes));
    return c->base ? c->base + at : NULL;
}

#define EC_CARVE(c, n, type) ((type *)ec_carve((c), ec_mul((n), sizeof(type))))

static void ec_carve_pool(eng_cuda *e, ec_carver *c) {
    const mdl_config *cf = &e->m->cfg;
    const eng_info *in = &e->info;
    size_t d = cf->hidden_size, V = e->nv, T = in->max_batch_tokens; /* V: this rank's rows */
    size_t kv_tokens = (size_t)in->kv_pages * in->kv_page_size;
    /* under offload the device caches off_pages pages per layer (eng_cuda_off.c) */
    size_t kv_cached = (size_t)(e->off_pages ? e->off_pages : in->kv_pages) * in->kv_page_size;
    e->embed = EC_CARVE(c, V * d, krn_bf16);
    e->lm_head = cf->tie_word_embeddings ? e->embed : EC_CARVE(c, V * d, krn_bf16);
    e->norm = EC_CARVE(c, d, krn_bf16);
    for (uint32_t l = 0; l < cf->n_layers; l++) {
        ec_layer *L = &e->layers[l];
        L->attn_norm = EC_CARVE(c, d, krn_bf16);
        L->wqkv = EC_CARVE(c, ec_mul(e->qkvd, d), krn_bf16);
        L->wo = EC_CARVE(c, ec_mul(d, e->qd), krn_bf16);
        L->ffn_norm = EC_CARVE(c, d, krn_bf16);
        L->w_gate_up = EC_CARVE(c, ec_mul(2 * (size_t)e->ffn, d), krn_bf16);
        L->w_down = EC_CARVE(c, ec_mul(d, e->ffn), krn_bf16);
    }
    e->kv_layer_elems = ec_mul(ec_mul(kv_cached, 2), e->kvd);
    /* under the swap policy the layers live in the tier's regions (eng_cuda_swap.c) */
    size_t pool_layers = e->swap_on ? 0 : (cf->n_layers ? cf->n_layers : 1);
    e->kv = EC_CARVE(c, ec_mul(e->kv_layer_elems, pool_layers), krn_bf16);
    e->d_page_mask = EC_CARVE(c, kv_tokens, uint8_t);
    e->emb = EC_CARVE(c, ec_mul(in->embed_slots, d), float);
    e->inv_freq = EC_CARVE(c, cf->head_dim / 2, float);
    e->x = EC_CARVE(c, ec_mul(T, d), float);
    e->x2 = EC_CARVE(c, ec_mul(T, d), float);
    e->tmp = EC_CARVE(c, ec_mul(T, d), float);
    e->xn = EC_CARVE(c, ec_mul(T, d), krn_bf16);
    size_t shared = e->qkvd > 2 * (size_t)e->ffn ? e->qkvd : 2 * (size_t)e->ffn;
    e->qkv = EC_CARVE(c, ec_mul(T, shared), float);
    e->gu = e->qkv; /* the MLP runs after attention has consumed q, and k/v live in kb/vb */
    e->kb = EC_CARVE(c, ec_mul(T, e->kvd), krn_bf16);
    e->vb = EC_CARVE(c, ec_mul(T, e->kvd), krn_bf16);
    e->att = EC_CARVE(c, ec_mul(T, e->qd), krn_bf16);
    e->h = EC_CARVE(c, ec_mul(T, e->ffn), krn_bf16);
    e->logits = EC_CARVE(c, ec_mul(e->dist_rows, V), float);
    size_t parts = ec_mul(ec_mul(EC_PART_SPLITS, e->split_rows), e->nh);
    e->part_acc = EC_CARVE(c, ec_mul(parts, cf->head_dim), float);
    e->part_ml = EC_CARVE(c, ec_mul(parts, 2), float);
    e->d_meta = EC_CARVE(c, e->meta_words, int32_t);
    e->d_top_ids = EC_CARVE(c, ec_mul(e->dist_rows, KRN_CUDA_TOPK_MAX), uint32_t);
    e->d_top_probs = EC_CARVE(c, ec_mul(e->dist_rows, KRN_CUDA_TOPK_MAX), float);
    e->d_temp = EC_CARVE(c, e->dist_rows, float);
    e->d_topk = EC_CARVE(c, e->dist_rows, int32_t);
    e->d_slot_idx = EC_CARVE(c, e->dist_rows, int32_t);
    e->cublas_ws = ec_carve(c, EC_CUBLAS_WS);
    /* the tensor-parallel exchanges (empty without nccl) */
    size_t tp = e->nccl ? e->shard.size : 0, top = ec_mul(e->dist_rows, KRN_CUDA_TOPK_MAX);
    size_t rows = tp ? e->dist_rows : 0;
    e->d_max = EC_CARVE(c, rows, float);
    e->d_g_max = EC_CARVE(c, ec_mul(tp, rows), float);
    e->d_shift = EC_CARVE(c, 2 * rows, float);
    e->d_sums = EC_CARVE(c, rows, float);
    e->d_g_sums = EC_CARVE(c, ec_mul(tp, rows), float);
    e->d_g_ids = EC_CARVE(c, ec_mul(tp, top), uint32_t);
    e->d_g_vals = EC_CARVE(c, ec_mul(tp, top), float);
    e->d_g_logits = EC_CARVE(c, ec_mul(tp, e->shard.vocab_stride), float);
}

/* ---- weights ----------------------------------------------------------------------------- */

/* Copies tensor t (any dtype) as bf16 to dst on the device, through the pinned stage. */
pie_code ec_upload(eng_cuda *e, const mdl_tensor *t, krn_bf16 *dst, pie_status *st) {
    size_t n = (size_t)t->rows * t->cols;
    size_t chunk = EC_STAGE_BYTES / sizeof(uint16_t);
    for (size_t at = 0; at < n; at += chunk) {
        size_t len = n - at < chunk ? n - at : chunk;
        uint16_t *s = (uint16_t *)e->h_stage;
        if (t->dtype == MDL_BF16)
            memcpy(s, (const uint16_t *)t->data + at, len * sizeof(uint16_t));
        else
            for (size_t i = 0; i < len; i++) s[i] = eng_bf16_from_f32(mdl_tensor_at(t, at + i));
        EC_CUDA(st, cudaMemcpy(dst + at, s, len * sizeof(uint16_t), cudaMemcpyHostToDevice));
    }
    return PIE_OK;
}

static pie_code ec_upload_weights(eng_cuda *e, pie_status *st) {
    if (e->nccl) return ec_tp_upload_weights(e, st); /* this rank's shard */
    const mdl_model *m = e->m;
    size_t d = m->cfg.hidden_size;
    pie_code rc = ec_upload(e, &m->embed, e->embed, st);
    if (rc == PIE_OK && !m->cfg.tie_word_embeddings) rc = ec_upload(e, &m->lm_head, e->lm_head, st);
    if (rc == PIE_OK) rc = ec_upload(e, &m->norm, e->norm, st);
    for (uint32_t l = 0; rc == PIE_OK && l < m->cfg.n_layers; l++) {
        const mdl_layer *L = &m->layers[l];
        ec_layer *D = &e->layers[l];
        krn_bf16 *qkv = (krn_bf16 *)D->wqkv, *gu = (krn_bf16 *)D->w_gate_up;
        rc = ec_upload(e, &L->attn_norm, (krn_bf16 *)D->attn_norm, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->wq, qkv, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->wk, qkv + (size_t)e->qd * d, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->wv, qkv + (size_t)(e->qd + e->kvd) * d, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->wo, (krn_bf16 *)D->wo, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->ffn_norm, (krn_bf16 *)D->ffn_norm, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->w_gate, gu, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->w_up, gu + (size_t)e->ffn * d, st);
        if (rc == PIE_OK) rc = ec_upload(e, &L->w_down, (krn_bf16 *)D->w_down, st);
    }
    return rc;
}

/* ---- open / close ------------------------------------------------------------------------ */

/* eng_check_model's shape, then the attention kernels' limits. */
static pie_code ec_check_model(const eng_cuda *e, const char *dir, pie_status *st) {
    const mdl_config *c = &e->m->cfg;
    pie_code rc = eng_check_model(c, dir, st);
    if (rc != PIE_OK) return rc;
    if (c->head_dim > KRN_CUDA_MAX_HEAD_DIM || c->n_heads / c->n_kv_heads > KRN_CUDA_MAX_GROUP ||
        c->n_kv_heads > 65535)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "eng_open: backend cuda: %s: head_dim %u (at most %d) or "
                              "n_heads / n_kv_heads %u (at most %d) is beyond the attention "
                              "kernel",
                              dir, c->head_dim, KRN_CUDA_MAX_HEAD_DIM, c->n_heads / c->n_kv_heads,
                              KRN_CUDA_MAX_GROUP);
    return PIE_OK;
}

/* Host arrays: mirrors, validation marks and plans (eng_check.c), and the pinned buffers. */
static pie_code ec_alloc_host(eng_cuda *e, pie_status *st) {
    const eng_info *in = &e->info;
    size_t kv_tokens = (size_t)in->kv_pages * in->kv_page_size;
    e->page_mask = calloc(kv_tokens ? kv_tokens : 1, 1);
    e->page_n_masked = calloc(in->kv_pages, sizeof *e->page_n_masked);
    e->emb_pos = calloc(in->embed_slots, sizeof *e->emb_pos);
    if (!e->page_mask || !e->page_n_masked || !e->emb_pos)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot allocate the page masks and marks of %u pages",
                              in->kv_pages);
    pie_code rc = eng_check_init(&e->chk, &e->info, st);
    if (rc != PIE_OK) return rc;
    eng_check_set_caps(&e->chk, "cuda", e->page_cap, e->runs_cap);
    size_t top = (size_t)e->dist_rows * KRN_CUDA_TOPK_MAX;
    EC_CUDA(st, cudaMallocHost((void **)&e->h_meta, e->meta_words * sizeof(int32_t)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_top_ids, top * sizeof(uint32_t)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_top_probs, top * sizeof(float)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_dist_f, e->dist_rows * sizeof(float)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_dist_i, 2 * e->dist_rows * sizeof(int32_t)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_stage, EC_STAGE_BYTES));
    if (!e->nccl) return PIE_OK;
    size_t tp = e->shard.size, rows = e->dist_rows;
    EC_CUDA(st, cudaMallocHost((void **)&e->h_shift, 2 * rows * sizeof(float)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_g_max, tp * rows * sizeof(float)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_g_sums, tp * rows * sizeof(float)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_g_ids, tp * top * sizeof(uint32_t)));
    EC_CUDA(st, cudaMallocHost((void **)&e->h_g_vals, tp * top * sizeof(float)));
    return PIE_OK;
}

/* The meta buffer must hold the tables of the largest batch: rows T, every page list, runs. */
static void ec_size_meta(eng_cuda *e) {
    const eng_info *in = &e->info;
    size_t kv_tokens = (size_t)in->kv_pages * in->kv_page_size;
    e->page_cap = (uint32_t)(4ull * in->kv_pages + in->max_batch_tokens > UINT32_MAX / 2
                                 ? UINT32_MAX / 2
                                 : 4ull * in->kv_pages + in->max_batch_tokens);
    uint64_t runs = 4ull * (kv_tokens + in->max_batch_tokens);
    if (runs < (1u << 20)) runs = 1u << 20;
    if (runs > UINT32_MAX / 2) runs = UINT32_MAX / 2;
    e->runs_cap = (uint32_t)runs;
    size_t tile_words = sizeof(krn_cuda_attn_tile) / sizeof(int32_t);
    e->meta_words =
        (size_t)in->max_batch_tokens * (6 + 2 * tile_words) + e->page_cap + e->runs_cap + 64;
}

static pie_code ec_open_device(eng_cuda *e, pie_status *st) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0)
        return pie_status_set(st, PIE_UNAVAILABLE, "eng_open: backend cuda: no CUDA device (%s)",
                              err != cudaSuccess ? cudaGetErrorString(err)
                                                 : "the driver lists none");
    e->dev = 0;
    struct cudaDeviceProp prop;
    EC_CUDA(st, cudaSetDevice(e->dev));
    EC_CUDA(st, cudaGetDeviceProperties(&prop, e->dev));
    e->n_sms = prop.multiProcessorCount;
    snprintf(e->device, sizeof e->device, "%.256s (sm_%d%d)", prop.name, prop.major, prop.minor);
    EC_CUDA(st, cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking));
    EC_CUDA(st, cudaStreamCreateWithFlags(&e->copy_stream, cudaStreamNonBlocking));
    EC_CUBLAS(st, cublasCreate(&e->cublas));
    EC_CUBLAS(st, cublasSetStream(e->cublas, e->stream));
    EC_CUBLAS(st, cublasSetMathMode(e->cublas, CUBLAS_DEFAULT_MATH));
    const mdl_config *c = &e->m->cfg;
    size_t need = 0, limit = 0;
    EC_CUDA(st, krn_cuda_attn_smem((int)c->head_dim, &need, &limit));
    if (need > limit)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "eng_open: backend cuda: head_dim %u needs %zu bytes of shared "
                              "memory per block for attention; %s allows %zu",
                              c->head_dim, need, e->device, limit);
    EC_CUDA(st, krn_cuda_init((int)c->head_dim));
    if (krn_cuda_attn_tc_fits((int)c->head_dim, (int)e->nh, (int)e->nkv))
        e->tc_rows = (uint32_t)krn_cuda_attn_tc_rows((int)e->nh, (int)e->nkv);
    return PIE_OK;
}

static pie_code ec_open_pool(eng_cuda *e, pie_status *st) {
    ec_carver measure = {0};
    ec_carve_pool(e, &measure);
    if (measure.used == SIZE_MAX)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: the device pool size overflows");
    cudaError_t err = cudaMalloc(&e->pool, measure.used);
    if (err != cudaSuccess) {
        e->pool = NULL;
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED,
                              "eng_open: cannot allocate %zu bytes of device memory for the "
                              "pool (%s)",
                              measure.used, cudaGetErrorString(err));
    }
    e->pool_bytes = measure.used;
    ec_carver carve = {.base = e->pool};
    ec_carve_pool(e, &carve);
    EC_CUDA(st, cudaMemset(e->pool, 0, e->pool_bytes)); /* KV, masks, slots start zeroed */
    EC_CUDA(st, cudaDeviceSynchronize()); /* the engine's streams do not wait for the legacy one */
    EC_CUBLAS(st, cublasSetWorkspace(e->cublas, e->cublas_ws, EC_CUBLAS_WS));
    return PIE_OK;
}

static pie_code ec_upload_freqs(eng_cuda *e, pie_status *st) {
    const mdl_config *c = &e->m->cfg;
    float *f = (float *)e->h_stage;
    krn_cpu_rope_freqs(f, (int)c->head_dim, c->rope_theta, c->rope_factor, c->rope_low_freq_factor,
                       c->rope_high_freq_factor, (int)c->rope_orig_max_position);
    EC_CUDA(st,
            cudaMemcpy(e->inv_freq, f, sizeof(float) * (c->head_dim / 2), cudaMemcpyHostToDevice));
    return PIE_OK;
}

pie_code eng_cuda_open(const eng_opts *opts, eng_cuda **out, pie_status *st) {
    if (!opts || !out || !opts->model_dir)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: opts, out and opts->model_dir must not be NULL");
    *out = NULL;
#ifndef PIE_WITH_NCCL
    if (opts->tp_size > 1 || opts->nccl)
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "eng_open: tp_size %u: the cuda backend was built without NCCL "
                              "(nccl.h and libnccl were not found at build time), so it runs "
                              "tp_size 1 only",
                              opts->tp_size);
#endif
    if (opts->tp_size > 1 && !opts->nccl)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_size %u on the cuda backend needs the group's NCCL "
                              "communicator (eng_opts.nccl)",
                              opts->tp_size);
    if (opts->kv_dtype != ENG_KV_F32) /* issue 17: a cpu backend option so far */
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "eng_open: a bf16 KV pool is implemented for the cpu backend only "
                              "so far (the cuda backend stores f32)");
    if (opts->swap_slots && (opts->tp_size > 1 || opts->nccl))
        return pie_status_set(st, PIE_UNIMPLEMENTED,
                              "eng_open: memory policy swap on the cuda backend runs one GPU "
                              "(tp_size 1) so far");
    eng_check_dims dims;
    pie_code rc = eng_check_opts(opts, &dims, st);
    if (rc == PIE_OK) rc = ec_off_check(opts, dims.pages, st);
    if (rc != PIE_OK) return rc;
    uint32_t ps = dims.page_size, pages = dims.pages, slots = dims.slots, T = dims.batch_tokens;
    eng_cuda *e = calloc(1, sizeof *e);
    if (!e) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
    const char *g = getenv("PIE_CUDA_GRAPHS");
    e->graphs_on = !(g && strcmp(g, "0") == 0);
    /* a test hook: the n-th forward call ends with a trapping kernel (a device fault) */
    const char *f = getenv("PIE_CUDA_FAULT_AFTER");
    e->fault_after = f ? strtoull(f, NULL, 10) : 0;
    rc = mdl_open(opts->model_dir, &e->m, st);
    if (rc == PIE_OK) rc = ec_check_model(e, opts->model_dir, st);
    if (rc != PIE_OK) goto fail;
    const mdl_config *c = &e->m->cfg;
    eng_check_fill_info(&e->info, e->m, &dims);
    e->nccl = opts->nccl;
    rc = eng_shard_plan(c, e->nccl ? opts->tp_rank : 0, e->nccl ? opts->tp_size : 1, &e->shard, st);
    if (rc != PIE_OK) goto fail;
    e->nh = e->shard.n_heads;
    e->nkv = e->shard.n_kv_heads;
    e->nv = e->shard.n_vocab;
    e->info.tp_rank = e->shard.rank;
    e->info.tp_size = e->shard.size;
    e->info.local_kv_heads = e->nkv;
    e->qd = e->nh * c->head_dim;
    e->kvd = e->nkv * c->head_dim;
    e->qkvd = e->qd + 2 * e->kvd;
    e->ffn = e->shard.n_ffn;
    e->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    e->tile_rows = (uint32_t)krn_cuda_attn_tile_rows((int)e->nh, (int)e->nkv);
    e->dist_rows = T < EC_DIST_ROWS ? T : EC_DIST_ROWS;
    e->split_rows = T < EC_SPLIT_ROWS ? T : EC_SPLIT_ROWS;
    ec_size_meta(e);
    e->layers = calloc(c->n_layers ? c->n_layers : 1, sizeof *e->layers);
    if (!e->layers) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "eng_open: out of memory");
        goto fail;
    }
    e->swap_on = opts->swap_slots > 0 && c->n_layers > 0;
    e->off_pages = opts->offload_device_pages;
    e->info.kv_page_layer_bytes = (size_t)2 * ps * e->kvd * sizeof(krn_bf16);
    snprintf(e->info.kv_dtype, sizeof e->info.kv_dtype, "bf16");
    rc = ec_open_device(e, st);
    if (rc == PIE_OK) rc = ec_alloc_host(e, st);
    if (rc == PIE_OK) rc = ec_open_pool(e, st);
    if (rc == PIE_OK) rc = ec_upload_weights(e, st);
    if (rc == PIE_OK) rc = ec_upload_freqs(e, st);
    if (rc == PIE_OK) rc = ec_swap_open(e, opts, st);
    if (rc == PIE_OK) rc = ec_off_open(e, opts, st);
    if (rc != PIE_OK) goto fail;
    size_t kv_tokens = (size_t)pages * ps;
    /* under swap the device's KV budget: swap_min_slots layer caches (committed as used when
     * more layers than that share it) */
    size_t device_layers = e->swap_on ? e->info.swap_min_slots : c->n_layers;
    size_t kv_layers_bytes = ec_mul(ec_mul(e->kv_layer_elems, sizeof(krn_bf16)), device_layers);
    e->info.kv_pool_bytes = kv_layers_bytes + kv_tokens;
    e->info.embed_pool_bytes = (size_t)slots * c->hidden_size * sizeof(float);
    /* the pool holds the rest (the swap policy's device region is allocated apart) */
    e->info.scratch_bytes = e->pool_bytes - (e->swap_on ? 0 : kv_layers_bytes) - kv_tokens -
                            e->info.embed_pool_bytes;
    *out = e;
    return PIE_OK;
fail:
    eng_cuda_close(e);
    return rc;
}

void eng_cuda_close(eng_cuda *e) {
    if (!e) return;
    if (e->stream) (void)cudaStreamSynchronize(e->stream);
    ec_swap_close(e); /* its copy threads use copy_stream */
    ec_off_close(e);
    ec_graphs_free(e);
    if (e->cublas) (void)cublasDestroy(e->cublas);
    if (e->stream) (void)cudaStreamDestroy(e->stream);
    if (e->copy_stream) (void)cudaStreamDestroy(e->copy_stream);
    if (e->pool) (void)cudaFree(e->pool);
    void *pinned[] = {e->h_meta,  e->h_top_ids, e->h_top_probs, e->h_dist_f,
                      e->h_dist_i, e->h_stage,   e->h_shift,     e->h_g_max,
                      e->h_g_sums, e->h_g_ids,   e->h_g_vals};
    for (size_t i = 0; i < sizeof pinned / sizeof pinned[0]; i++)
        if (pinned[i]) (void)cudaFreeHost(pinned[i]);
    mdl_close(e->m);
    free(e->layers);
    free(e->page_mask);
    free(e->page_n_masked);
    free(e->emb_pos);
    eng_check_free(&e->chk);
    free(e);
}

const eng_info *eng_cuda_get_info(const eng_cuda *e) { return &e->info; }
const char *eng_cuda_device_name(const eng_cuda *e) { return e->device; }

void eng_cuda_get_stats(const eng_cuda *e, eng_cuda_stats *out) { *out = e->stats; }

void eng_cuda_set_graphs(eng_cuda *e, bool on) { e->graphs_on = on; }

/* ---- embed ------------------------------------------------------------------------------- */

pie_code eng_cuda_embed_text(eng_cuda *e, const uint32_t *slots, const uint32_t *tokens,
                             const uint32_t *positions, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    const eng_info *in = &e->info;
    pie_code rc = eng_check_embed(in, slots, tokens, positions, n, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, cudaSetDevice(e->dev)); /* handlers may run on any thread */
    if (e->nccl) { /* vocabulary-parallel: each rank embeds its slice's tokens */
        rc = ec_tp_embed_text(e, slots, tokens, n, st);
        if (rc != PIE_OK) return rc;
        for (uint32_t i = 0; i < n; i++) e->emb_pos[slots[i]] = positions[i];
        return PIE_OK;
    }
    /* tokens and slots through the stage in chunks (n is not bounded by any capacity) */
    uint32_t chunk = (uint32_t)(EC_STAGE_BYTES / (2 * sizeof(uint32_t)));
    uint32_t *d_tok = (uint32_t *)e->d_meta, *h_tok = (uint32_t *)e->h_meta;
    uint32_t cap = (uint32_t)(e->meta_words / 2 < chunk ? e->meta_words / 2 : chunk);
    for (uint32_t at = 0; at < n; at += cap) {
        uint32_t len = n - at < cap ? n - at : cap;
        memcpy(h_tok, tokens + at, len * sizeof(uint32_t));
        memcpy(h_tok + cap, slots + at, len * sizeof(uint32_t));
        EC_CUDA(st, cudaMemcpyAsync(d_tok, h_tok, len * sizeof(uint32_t), cudaMemcpyHostToDevice,
                                    e->stream));
        EC_CUDA(st, cudaMemcpyAsync(d_tok + cap, h_tok + cap, len * sizeof(uint32_t),
                                    cudaMemcpyHostToDevice, e->stream));
        EC_CUDA(st, krn_cuda_embed(e->embed, (int)in->hidden_size, d_tok, d_tok + cap, (int)len,
                                   e->emb, e->stream));
        EC_CUDA(st, cudaStreamSynchronize(e->stream)); /* the stage is reused next round */
    }
    for (uint32_t i = 0; i < n; i++) e->emb_pos[slots[i]] = positions[i];
    return PIE_OK;
}

/* ---- pages ------------------------------------------------------------------------------- */

pie_code eng_cuda_mask_page(eng_cuda *e, uint32_t page, const bool *masked, pie_status *st) {
    pie_code rc = eng_check_mask_page(&e->info, page, masked, st);
    if (rc != PIE_OK) return rc;
    uint32_t ps = e->info.kv_page_size;
    uint8_t *m = e->page_mask + (size_t)page * ps;
    uint32_t count = eng_mask_page_set(m, masked, ps);
    e->page_n_masked[page] = count;
    EC_CUDA(st, cudaSetDevice(e->dev));
    if (e->off) return ec_off_mask_page(e, page, st); /* the device's mask is by slot */
    memcpy(e->h_stage, m, ps);
    EC_CUDA(st, cudaMemcpyAsync(e->d_page_mask + (size_t)page * ps, e->h_stage, ps,
                                cudaMemcpyHostToDevice, e->stream));
    EC_CUDA(st, cudaStreamSynchronize(e->stream));
    return PIE_OK;
}

/* One launch per item (per layer under the swap policy: the layers are apart), in order on the
 * stream: a later item may read what an earlier one wrote. Ends synchronised. */
static pie_code ec_copy_items(eng_cuda *e, const eng_copy_item *items, uint32_t n,
                              pie_status *st) {
    uint32_t ps = e->info.kv_page_size, L = e->info.n_layers;
    for (uint32_t i = 0; i < n; i++) {
        const eng_copy_item *c = &items[i];
        int src = (int)(c->src * ps + c->src_off), dst = (int)(c->dst * ps + c->dst_off);
        for (uint32_t l = 0; l < (e->tier ? L : 1); l++) /* the mask bytes: the same each time */
            EC_CUDA(st, krn_cuda_page_copy(ec_kv(e, l), e->kv_layer_elems, e->tier ? 1 : (int)L,
                                           (int)ps, (int)e->kvd, e->d_page_mask, src, dst,
                                           (int)c->count, e->stream));
        eng_mask_page_copy(e->page_mask, e->page_n_masked, ps, c);
    }
    EC_CUDA(st, cudaStreamSynchronize(e->stream));
    return PIE_OK;
}

pie_code eng_cuda_copy_pages(eng_cuda *e, const eng_copy_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    pie_code rc = eng_check_copy(&e->info, items, n, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, cudaSetDevice(e->dev));
    ec_swap_touch(e, eng_check_kv_top_copies(items, n));
    rc = ec_swap_hold(e, st); /* swap policy: nothing moves, ec_kv(l) says where l is */
    if (rc == PIE_OK)
        rc = e->off ? ec_off_copy_items(e, items, n, st) : ec_copy_items(e, items, n, st);
    if (rc != PIE_OK) /* no layer may move while a kernel of this call still runs on it */
        (void)cudaStreamSynchronize(e->stream);
    ec_swap_resume(e);
    return rc;
}

/* The next run of consecutive ids at ids[*i] (ascending or descending): its lowest id and
 * length; *i moves past it. Allocations usually come in runs (fresh slots ascend, reused ones
 * come off a stack), so a run is cleared with one memset per layer. */
static uint32_t ec_next_run(const uint32_t *ids, uint32_t n, uint32_t *i, uint32_t *len) {
    uint32_t lo = ids[*i], hi = ids[*i], k = *i + 1;
    while (k < n && (ids[k] == hi + 1 || ids[k] + 1 == lo)) {
        if (ids[k] == hi + 1)
            hi++;
        else
            lo--;
        k++;
    }
    *len = hi - lo + 1;
    *i = k;
    return lo;
}

/* Clears pages[0, n) in every layer, through the per-batch table (checked ids are < kv_pages
 * <= meta_words): every forward uploads its own tables before it runs, so nothing else reads
 * them now. Under the swap policy one launch per layer (the layers are apart). */
static pie_code ec_clear_ids(eng_cuda *e, const uint32_t *pages, uint32_t n, pie_status *st) {
    uint32_t ps = e->info.kv_page_size, L = e->info.n_layers;
    for (uint32_t done = 0; done < n;) {
        uint32_t k = n - done < e->meta_words ? n - done : (uint32_t)e->meta_words;
        for (uint32_t i = 0; i < k; i++) e->h_meta[i] = (int32_t)pages[done + i];
        EC_CUDA(st, cudaMemcpyAsync(e->d_meta, e->h_meta, (size_t)k * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, e->stream));
        for (uint32_t l = 0; l < (e->tier ? L : 1); l++) /* the mask bytes: the same each time */
            EC_CUDA(st, krn_cuda_clear_pages(ec_kv(e, l), e->kv_layer_elems, e->tier ? 1 : (int)L,
                                             (int)ps, (int)e->kvd, e->d_page_mask, e->d_meta,
                                             (int)k, e->stream));
        EC_CUDA(st, cudaStreamSynchronize(e->stream)); /* before h_meta is written again */
        done += k;
    }
    return PIE_OK;
}

pie_code eng_cuda_clear_pages(eng_cuda *e, const uint32_t *pages, uint32_t n, pie_status *st) {
    pie_code rc = eng_check_clear(&e->info, true, pages, n, st);
    if (rc != PIE_OK || n == 0) return rc;
    uint32_t ps = e->info.kv_page_size;
    EC_CUDA(st, cudaSetDevice(e->dev));
    uint32_t top = 0; /* a device committed as it is used has memory below the touched pages */
    for (uint32_t i = 0; i < n; i++)
        if (pages[i] >= top) top = pages[i] + 1;
    ec_swap_touch(e, top);
    rc = ec_swap_hold(e, st); /* swap policy: nothing moves, ec_kv(l) says where l is */
    if (rc == PIE_OK) rc = e->off ? ec_off_clear(e, pages, n) : ec_clear_ids(e, pages, n, st);
    if (rc != PIE_OK) /* no layer may move while a kernel of this call still runs on it */
        (void)cudaStreamSynchronize(e->stream);
    ec_swap_resume(e);
    if (rc != PIE_OK) return rc;
    for (uint32_t i = 0; i < n; i++) {
        memset(e->page_mask + (size_t)pages[i] * ps, 0, ps);
        e->page_n_masked[pages[i]] = 0;
    }
    return PIE_OK;
}

pie_code eng_cuda_clear_embeds(eng_cuda *e, const uint32_t *slots, uint32_t n, pie_status *st) {
    pie_code rc = eng_check_clear(&e->info, false, slots, n, st);
    if (rc != PIE_OK || n == 0) return rc;
    size_t d = e->info.hidden_size;
    EC_CUDA(st, cudaSetDevice(e->dev));
    for (uint32_t i = 0; i < n;) {
        uint32_t len, lo = ec_next_run(slots, n, &i, &len);
        EC_CUDA(st, cudaMemsetAsync(e->emb + lo * d, 0, len * d * sizeof(float), e->stream));
    }
    for (uint32_t i = 0; i < n; i++) e->emb_pos[slots[i]] = 0;
    EC_CUDA(st, cudaStreamSynchronize(e->stream));
    return PIE_OK;
}

/* ---- distributions ----------------------------------------------------------------------- */

/* logits[rows, nv] = lm_head · (the states of slots d_slot_idx[rows]); nv: this rank's rows of
 * the vocabulary (all of it without nccl). */
pie_code ec_lm_head(eng_cuda *e, uint32_t rows, pie_status *st) {
    uint32_t d = e->info.hidden_size;
    EC_CUDA(st, krn_cuda_gather_rows(e->tmp, e->emb, e->d_slot_idx, (int)rows, (int)d, e->stream));
    EC_CUDA(st, krn_cuda_to_bf16(e->tmp, (size_t)rows * d, e->xn, e->stream));
    return ec_linear(e, e->xn, rows, d, e->lm_head, e->nv, e->logits, st);
}

pie_code ec_dist_upload(eng_cuda *e, const eng_dist_item *items, uint32_t rows, uint32_t k_cap,
                        pie_status *st) {
    uint32_t R = e->dist_rows;
    for (uint32_t r = 0; r < rows; r++) {
        e->h_dist_f[r] = items[r].temperature;
        e->h_dist_i[r] = (int32_t)(items[r].top_k < k_cap ? items[r].top_k : k_cap);
        e->h_dist_i[R + r] = (int32_t)items[r].slot;
    }
    EC_CUDA(st, cudaMemcpyAsync(e->d_temp, e->h_dist_f, rows * sizeof(float),
                                cudaMemcpyHostToDevice, e->stream));
    EC_CUDA(st, cudaMemcpyAsync(e->d_topk, e->h_dist_i, rows * sizeof(int32_t),
                                cudaMemcpyHostToDevice, e->stream));
    EC_CUDA(st, cudaMemcpyAsync(e->d_slot_idx, e->h_dist_i + R, rows * sizeof(int32_t),
                                cudaMemcpyHostToDevice, e->stream));
    return PIE_OK;
}

pie_code eng_cuda_next_dist(eng_cuda *e, eng_dist_item *items, uint32_t n, pie_status *st) {
    if (n == 0) return PIE_OK;
    pie_code rc = eng_check_dist(&e->info, items, n, ENG_CUDA_TOPK_MAX, st);
    if (rc != PIE_OK) return rc;
    uint32_t R = e->dist_rows;
    EC_CUDA(st, cudaSetDevice(e->dev));
    if (e->nccl) return ec_tp_next_dist(e, items, n, st); /* merged from the ranks' slices */
    for (uint32_t start = 0; start < n; start += R) {
        uint32_t rows = n - start < R ? n - start : R;
        rc = ec_dist_upload(e, &items[start], rows, e->info.vocab_size, st);
        if (rc == PIE_OK) rc = ec_lm_head(e, rows, st);
        if (rc != PIE_OK) return rc;
        EC_CUDA(st, krn_cuda_topk(e->logits, (int)rows, (int)e->info.vocab_size, e->d_temp,
                                  e->d_topk, e->d_top_ids, e->d_top_probs, e->stream));
        size_t top = (size_t)rows * KRN_CUDA_TOPK_MAX;
        EC_CUDA(st, cudaMemcpyAsync(e->h_top_ids, e->d_top_ids, top * sizeof(uint32_t),
                                    cudaMemcpyDeviceToHost, e->stream));
        EC_CUDA(st, cudaMemcpyAsync(e->h_top_probs, e->d_top_probs, top * sizeof(float),
                                    cudaMemcpyDeviceToHost, e->stream));
        EC_CUDA(st, cudaStreamSynchronize(e->stream));
        for (uint32_t r = 0; r < rows; r++) {
            eng_dist_item *it = &items[start + r];
            memcpy(it->ids, e->h_top_ids + (size_t)r * KRN_CUDA_TOPK_MAX,
                   it->top_k * sizeof(uint32_t));
            memcpy(it->probs, e->h_top_probs + (size_t)r * KRN_CUDA_TOPK_MAX,
                   it->top_k * sizeof(float));
        }
    }
    return PIE_OK;
}

pie_code eng_cuda_logits(eng_cuda *e, uint32_t slot, float *logits, pie_status *st) {
    pie_code rc = eng_check_slot_out(&e->info, "logits", slot, logits, "logits", st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, cudaSetDevice(e->dev));
    if (e->nccl) return ec_tp_logits(e, slot, logits, st); /* the ranks' slices, gathered */
    e->h_dist_i[0] = (int32_t)slot;
    EC_CUDA(st, cudaMemcpyAsync(e->d_slot_idx, e->h_dist_i, sizeof(int32_t), cudaMemcpyHostToDevice,
                                e->stream));
    rc = ec_lm_head(e, 1, st);
    if (rc != PIE_OK) return rc;
    EC_CUDA(st, cudaMemcpyAsync(logits, e->logits, e->info.vocab_size * sizeof(float),
                                cudaMemcpyDeviceToHost, e->stream));
    EC_CUDA(st, cudaStreamSynchronize(e->stream));
    return PIE_OK;
}

pie_code eng_cuda_slot_position(eng_cuda *e, uint32_t slot, uint32_t *pos, pie_status *st) {
    pie_code rc = eng_check_slot_out(&e->info, "slot_position", slot, pos, "pos", st);
    if (rc != PIE_OK) return rc;
    *pos = e->emb_pos[slot];
    return PIE_OK;
}
