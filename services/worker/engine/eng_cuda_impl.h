/* eng_cuda_impl.h — the cuda engine's object and the helpers its files share (internal).
 *
 * Owns: struct eng_cuda (device pool and its carving, host mirrors, staging, streams, cuBLAS,
 * the graph cache) and the error macros that turn a cudaError_t / cublasStatus_t into a
 * pie_status naming the call, file and line. eng_cuda.c: open/close, embed, pages,
 * distributions; eng_cuda_fwd.c: forward validation, planning, execution, graphs; eng_cuda_tp.c:
 * the engine as one rank of a tensor-parallel group over NCCL. */
#ifndef ENG_CUDA_IMPL_H
#define ENG_CUDA_IMPL_H

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "eng_check.h"
#include "eng_cuda.h"
#include "eng_shard.h"
#include "eng_tp_dist.h"
#include "krn_cuda.h"
#include "mdl.h"
#include "wrk_tier.h"

#define EC_ALIGN       256u /* every carved device buffer */
#define EC_DIST_ROWS   64u  /* slots per lm_head call in next_dist */
#define EC_SPLIT_ROWS  256u /* rows of split-KV partials: split tiles share these */
/* The partial buffers hold EC_PART_SPLITS * split_rows (split, row) pairs: a launch of s
 * splits has (that / s) partial rows, so few rows can take many splits (a batch-1 decode
 * over a long context: 64 splits keep every SM busy) in the memory 16 splits of every row
 * took before. */
#define EC_PART_SPLITS 16u
#define EC_GRAPH_MAX_T 128u /* decode batches up to this many items replay graphs */
#define EC_GRAPHS      8u   /* one graph per bucket 1, 2, 4, ..., EC_GRAPH_MAX_T */
_Static_assert(1u << (EC_GRAPHS - 1) == EC_GRAPH_MAX_T, "a graph for every bucket");
#define EC_CUBLAS_WS   (32u << 20)
#define EC_STAGE_BYTES (64u << 20) /* pinned staging for weight upload */

/* cudaError_t / cublasStatus_t → pie_status (PIE_INTERNAL) naming the call and where; a device
 * fault (eng_cuda_error_is_fault) is said so and recorded for the process (eng_cuda_fault). */
pie_code ec_cuda_fail(pie_status *st, cudaError_t err, const char *call, const char *file,
                      int line);
pie_code ec_cublas_fail(pie_status *st, cublasStatus_t s, const char *call, const char *file,
                        int line);

#define EC_CUDA(st, call)                                                                          \
    do {                                                                                           \
        cudaError_t ec_err_ = (call);                                                              \
        if (ec_err_ != cudaSuccess) return ec_cuda_fail((st), ec_err_, #call, __FILE__, __LINE__); \
    } while (0)

#define EC_CUBLAS(st, call)                                                \
    do {                                                                   \
        cublasStatus_t ec_s_ = (call);                                     \
        if (ec_s_ != CUBLAS_STATUS_SUCCESS)                                \
            return ec_cublas_fail((st), ec_s_, #call, __FILE__, __LINE__); \
    } while (0)

/* Per-batch tables, at int32 offsets into the meta buffers for a row capacity R (a graph
 * bucket, or the batch's own row count). */
typedef struct ec_meta_layout {
    size_t in_slot, pos, kv_dst, out_row, out_slot, row_runs, tiles_all, tiles_out, pages, runs;
    size_t end; /* int32 units with every capacity */
} ec_meta_layout;

typedef struct ec_layer {
    const krn_bf16 *attn_norm, *wqkv, *wo, *ffn_norm, *w_gate_up, *w_down;
} ec_layer;

/* The graph of one bucket (graphs[log2(bucket)]): everything else a decode step's launches
 * depend on is table data, split counts included. */
typedef struct ec_graph {
    cudaGraphExec_t exec;
    uint32_t kernels; /* kernel nodes */
    bool failed;      /* capture failed: this bucket launches directly */
} ec_graph;

/* One attention launch: a list of tiles in the tables and the kernel that runs it. */
typedef struct ec_tiles {
    size_t at;       /* int32 offset of its first tile in the tables */
    uint32_t n;      /* tiles (0: nothing to launch) */
    uint32_t splits; /* split blocks per tile in the launch (CUDA-core list; 1 for tensor cores) */
    uint32_t part_rows; /* partial rows of the launch: EC_PART_SPLITS * split_rows / splits */
} ec_tiles;

/* What one forward call runs: counts that fix kernel launch shapes. Attention tiles are cut
 * per item: an item with at least 16 rows in a list goes to the tensor-core kernel (where the
 * device and head_dim allow), the others to the CUDA-core kernel with per-tile split-KV. */
typedef struct ec_run {
    uint32_t rows;           /* R: batch rows (bucket size in graph mode) */
    uint32_t out_rows;       /* rows of the last layer's tail (n_out, or the bucket) */
    uint32_t n_out;          /* real outputs (0: the last layer stops after storing K/V) */
    ec_tiles all_cc, all_tc; /* attention of every row (layers before the last) */
    ec_tiles out_cc, out_tc; /* attention of the output rows (the last layer) */
    uint32_t launches;       /* kernel launches enqueued (a cuBLAS call as 1) */
    ec_meta_layout lay;
} ec_run;

struct eng_cuda {
    mdl_model *m;
    eng_info info;
    char device[288];
    int dev, n_sms;
    /* this rank's shard (eng_shard.h; the whole model without nccl): its query and KV heads,
     * vocabulary rows; qd, kvd and ffn are its widths */
    eng_shard shard;
    uint32_t nh, nkv, nv;
    uint32_t qd, kvd, qkvd, ffn;
    uint32_t tile_rows; /* rows per tile of krn_cuda_attention (decode-shaped work) */
    uint32_t tc_rows;   /* rows per tile of krn_cuda_attention_tc; 0: not on this device */
    float attn_scale;

    /* capacities fixed at open */
    uint32_t page_cap, runs_cap, dist_rows;

    /* the device pool: one allocation, carved */
    void *pool;
    size_t pool_bytes;
    krn_bf16 *embed, *norm, *lm_head; /* lm_head == embed when tied */
    ec_layer *layers;                 /* [n_layers] (host array of device pointers) */
    krn_bf16 *kv;                     /* [n_layers][pages][2][ps][kvd] */
    size_t kv_layer_elems;
    uint8_t *d_page_mask;      /* [pages * ps] */
    float *emb;                /* [slots, d] */
    float *inv_freq;           /* [hd / 2] */
    float *x, *x2, *tmp;       /* [T, d] */
    krn_bf16 *xn;              /* [T, d] */
    float *qkv, *gu;           /* [T, qkvd] and [T, 2 ffn]: the same memory */
    krn_bf16 *kb, *vb;         /* [T, kvd] */
    krn_bf16 *att;             /* [T, qd] */
    krn_bf16 *h;               /* [T, ffn] */
    float *logits;             /* [dist_rows, vocab] */
    float *part_acc, *part_ml; /* split-KV partials */
    uint32_t split_rows;
    int32_t *d_meta; /* per-batch tables */
    size_t meta_words;
    uint32_t *d_top_ids; /* [dist_rows, TOPK_MAX] */
    float *d_top_probs;
    float *d_temp;                /* [dist_rows] */
    int32_t *d_topk, *d_slot_idx; /* [dist_rows] */
    void *cublas_ws;

    /* host side */
    int32_t *h_meta;     /* pinned, meta_words */
    uint32_t *h_top_ids; /* pinned [dist_rows, TOPK_MAX] */
    float *h_top_probs;
    float *h_dist_f;    /* pinned [dist_rows] temperatures */
    int32_t *h_dist_i;  /* pinned [2 * dist_rows]: top_k, slot */
    uint8_t *h_stage;   /* pinned EC_STAGE_BYTES: weight upload, page masks, tokens */
    uint8_t *page_mask; /* [pages * ps] mirror */
    uint32_t *page_n_masked;
    uint32_t *emb_pos;   /* [slots] */
    eng_check_state chk; /* validation marks and the plan of the last forward (eng_check.h) */

    /* tensor parallelism over NCCL (eng_cuda_tp.c); NULL: one GPU, no collective, and every
     * buffer below is empty */
    struct wrk_nccl *nccl;
    float *d_max, *d_g_max;       /* [dist_rows]: each row's slice maximum; [tp][dist_rows] */
    float *d_shift, *h_shift;     /* [dist_rows, 2]: the row's maximum, whether this rank holds it */
    float *d_sums, *d_g_sums;     /* [dist_rows]: the slice's sum of exponentials; [tp][dist_rows] */
    uint32_t *d_g_ids;            /* [tp][dist_rows, TOPK_MAX]: the ranks' local top-k, gathered */
    float *d_g_vals;              /* [tp][dist_rows, TOPK_MAX] */
    float *d_g_logits;            /* [tp][vocab_stride]: eng_cuda_logits' gather */
    float *h_g_max, *h_g_sums;    /* pinned mirrors of the gathers */
    uint32_t *h_g_ids;
    float *h_g_vals;

    cudaStream_t stream, copy_stream; /* copy_stream: the swap policy's moves to the device */

    /* the swap policy (eng_cuda_swap.c); tier NULL: kv holds every layer for good */
    bool swap_on; /* asked for at open (the pool then carves no layer) */
    struct wrk_tier *tier;
    wrk_tier_mem swap_mem;        /* the tier's hooks into this device */
    cudaStream_t copy_out_stream; /* its moves to the host */
    /* adaptive expansion: the device region committed as it is used (eng_cuda_swap.c), or
     * NULL: cudaMalloc'ed for swap_slots layers */
    struct ec_vmm *vmm;
    cudaEvent_t *layer_done;      /* [n_layers]: after a forward's last kernel on the layer */
    krn_bf16 **kv_at;             /* [n_layers]: layer l's cache now (acquired or held) */
    size_t kv_layer_bytes;
    pie_code (*swap_copy)(void *user, void *dst, const void *src, size_t bytes, pie_status *st);
    void *swap_copy_user;
    cublasHandle_t cublas;

    /* CPU attention offload (eng_cuda_off.c); NULL: off. off_pages: the device's KV slots per
     * layer (kv holds that many pages, not kv_pages, and d_page_mask is indexed by slot) */
    struct ec_off *off;
    uint32_t off_pages;

    bool graphs_on;
    ec_graph graphs[EC_GRAPHS];
    eng_cuda_stats stats;
    uint32_t step_launches; /* kernel launches of the forward under way (cuBLAS calls as 1) */
    uint64_t fault_after;   /* PIE_CUDA_FAULT_AFTER: forward call that traps (0: none) */
    uint64_t forward_calls;
};

/* eng_cuda_fwd.c: a y = x · W^T through the GEMV or cuBLAS (y row stride = out); counts one
 * launch in step_launches. */
pie_code ec_linear(eng_cuda *e, const krn_bf16 *x, uint32_t rows, uint32_t in, const krn_bf16 *w,
                   uint32_t out, float *y, pie_status *st);

/* eng_cuda_fwd.c: o-proj of att, the residual, the MLP (down-proj into tmp) over `rows` rows
 * of x (both sub-batches of an offload step use it). */
pie_code ec_layer_tail(eng_cuda *e, const ec_layer *L, float *x, uint32_t rows, const krn_bf16 *att,
                       float *tmp, pie_status *st);

/* eng_cuda_swap.c: the swap policy on this device. Without it (e->tier NULL) the helpers do
 * nothing and ec_kv is layer l's part of the pool. */
pie_code ec_swap_open(eng_cuda *e, const eng_opts *o, pie_status *st);
void ec_swap_close(eng_cuda *e);
krn_bf16 *ec_kv(const eng_cuda *e, uint32_t l);
/* Waits until layer l's cache is on the device (a failed move: its message, the layer not
 * acquired) and points ec_kv(l) at it. */
pie_code ec_swap_acquire(eng_cuda *e, uint32_t l, pie_status *st);
/* After the last kernel on layer l is enqueued: the layer may move once they ran. */
void ec_swap_release(eng_cuda *e, uint32_t l);
/* Around handlers that touch every layer: nothing moves, ec_kv(l) is where l is (the device,
 * or the pinned host pool, which kernels address at its host address). A failure (device
 * memory for a layer's used range, an unreported failed move): held all the same, resume. */
pie_code ec_swap_hold(eng_cuda *e, pie_status *st);
void ec_swap_resume(eng_cuda *e);
/* Raise the prefix the tier moves to `pages` pages. */
void ec_swap_touch(eng_cuda *e, uint32_t pages);

/* eng_cuda_off.c: CPU attention offload. Without it (e->off NULL) ec_off_page is the identity
 * and ec_off_step_hosts false. */
typedef struct ec_off ec_off;
pie_code ec_off_check(const eng_opts *opts, uint32_t kv_pages, pie_status *st);
pie_code ec_off_open(eng_cuda *e, const eng_opts *opts, pie_status *st);
void ec_off_close(eng_cuda *e);
/* The step's split and page moves (after validation, before the tables are filled). */
pie_code ec_off_prepare(eng_cuda *e, const eng_forward_item *items, uint32_t n, pie_status *st);
uint32_t ec_off_page(const eng_cuda *e, uint32_t page); /* the page's slot on the device */
bool ec_off_step_hosts(const eng_cuda *e);              /* the prepared step has host items */
/* A step with host items runs as two sub-batches: the device items (*items, *n: sub-batch 0,
 * the forward's own path, which may be empty) and the host items, whose layer l runs around
 * sub-batch 0's: layer_begin enqueues their norm, q/k/v and RoPE and copies those rows to the
 * host (an event); layer_end waits for it (sub-batch 0's layer l runs meanwhile), appends
 * their K/V at home, runs their attention on the host pool and enqueues their layer tail;
 * finish enqueues their final norm and output slots. */
void ec_off_device_items(eng_cuda *e, const eng_forward_item **items, uint32_t *n);
pie_code ec_off_layer_begin(eng_cuda *e, uint32_t l, pie_status *st);
pie_code ec_off_layer_end(eng_cuda *e, uint32_t l, pie_status *st);
pie_code ec_off_finish(eng_cuda *e, pie_status *st);
pie_code ec_off_copy_items(eng_cuda *e, const eng_copy_item *items, uint32_t n, pie_status *st);
pie_code ec_off_clear(eng_cuda *e, const uint32_t *pages, uint32_t n);
/* After the mirror of a page's mask changed: the slot's copy, when it has one. */
pie_code ec_off_mask_page(eng_cuda *e, uint32_t page, pie_status *st);

/* eng_cuda_fwd.c: releases every captured graph. */
void ec_graphs_free(eng_cuda *e);

/* eng_cuda.c: tensor t (any dtype) as bf16 to dst on the device, through the pinned stage. */
pie_code ec_upload(eng_cuda *e, const mdl_tensor *t, krn_bf16 *dst, pie_status *st);

/* eng_cuda_tp.c: the sharded engine over NCCL (e->nccl set). */
pie_code ec_tp_upload_weights(eng_cuda *e, pie_status *st);
/* x[n] f32 on the compute stream ← its sum over the ranks (capturable). */
pie_code ec_tp_allreduce(eng_cuda *e, float *x, size_t n, pie_status *st);
pie_code ec_tp_embed_text(eng_cuda *e, const uint32_t *slots, const uint32_t *tokens, uint32_t n,
                          pie_status *st);
pie_code ec_tp_next_dist(eng_cuda *e, eng_dist_item *items, uint32_t n, pie_status *st);
pie_code ec_tp_logits(eng_cuda *e, uint32_t slot, float *logits, pie_status *st);
/* Instead of cudaStreamSynchronize where the stream holds collectives: waits at most the
 * group's tp.timeout (a hung peer fails the group: UNAVAILABLE) and checks the communicator's
 * asynchronous errors. */
pie_code ec_tp_sync(eng_cuda *e, pie_status *st);
/* eng_cuda.c: next_dist's per-row arguments of items[rows] to the device (d_temp, d_topk with
 * each top_k capped at k_cap, d_slot_idx). */
pie_code ec_dist_upload(eng_cuda *e, const eng_dist_item *items, uint32_t rows, uint32_t k_cap,
                        pie_status *st);
/* eng_cuda.c: the lm_head of the slots in d_slot_idx[rows] into logits [rows, nv]. */
pie_code ec_lm_head(eng_cuda *e, uint32_t rows, pie_status *st);

#endif
