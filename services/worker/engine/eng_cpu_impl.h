/* eng_cpu_impl.h — the cpu engine's object, shared by its two files (engine-internal):
 * eng_cpu.c (open, pools, forward, pages, distributions) and eng_cpu_tp.c (what differs on a
 * rank of a tensor-parallel group: the weight shard, vocab-parallel embedding, the merged
 * distributions, gathered logits). */
#ifndef ENG_CPU_IMPL_H
#define ENG_CPU_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "eng.h"
#include "eng_check.h"
#include "eng_shard.h"
#include "krn_cpu.h"
#include "mdl.h"

/* A region from mmap: zeroed, page aligned, committed on first touch. */
typedef struct eng_region {
    void *p;
    size_t bytes;
} eng_region;

/* One row's largest logit in a rank's vocabulary slice (tensor parallel next_dist). */
typedef struct eng_tp_max {
    float max;    /* the largest number (NaN left out) */
    uint32_t arg; /* the lowest vocabulary id holding it */
    uint32_t has; /* 0: the slice holds nothing but NaN */
} eng_tp_max;

struct eng {
    mdl_model *m;
    eng_info info;
    krn_pool *pool;
    float attn_scale; /* 1 / sqrt(head_dim) */
    float *inv_freq;  /* [head_dim / 2] */
    uint32_t qd, kvd; /* this rank's n_heads * head_dim, n_kv_heads * head_dim */
    uint32_t ffn;     /* this rank's intermediate columns */

    /* the weights this rank multiplies: at tp_size 1 the model's own tensors; else views of
     * row ranges of the mapped tensors, and the column slices of wo and w_down copied into
     * `slices` (eng_cpu_tp.c) */
    eng_shard shard;
    struct wrk_coll *coll;   /* the group's collective; NULL at tp_size 1 */
    const mdl_layer *layers; /* [n_layers] */
    mdl_layer *own_layers;   /* [n_layers] when sharded (what `layers` points to) */
    mdl_tensor embed;        /* [n_vocab, hidden] this rank's rows of embed_tokens */
    mdl_tensor lm_head;      /* [n_vocab, hidden] this rank's rows of lm_head */
    eng_region slices;
    eng_region wpack; /* the linear weights packed once (eng_cpu_wpack.c); empty: none */

    /* KV pool: one region per layer, [kv_pages][2][page_size][n_kv_heads][head_dim] f32; under
     * the swap policy the layers live in `tier`'s buffers instead (kv_regions unmapped) and
     * kv[l].base is set where layer l is whenever it is used */
    eng_region *kv_regions;  /* [n_layers] */
    krn_kv_layer *kv;        /* [n_layers] */
    struct wrk_tier *tier;   /* NULL: policy gpu */
    struct eng_offload *off; /* CPU attention offload (eng_cpu_offload.c); NULL: off */
    uint8_t *page_mask;      /* [kv_pages * page_size], 1 = masked */
    uint32_t *page_n_masked; /* [kv_pages] masked tokens per page */

    /* embedding slots */
    eng_region emb_region;
    float *emb;        /* [embed_slots, hidden] */
    uint32_t *emb_pos; /* [embed_slots] */

    /* scratch, one region carved at open; T = max_batch_tokens */
    eng_region scratch;
    float *x, *xn;          /* [T, hidden]: residual stream, normed / projected rows */
    float *q, *k, *v, *att; /* [T, qd], [T, kvd], [T, kvd], [T, qd]; share memory with: */
    float *gate, *up;       /* [T, ffn] (the MLP runs after attention is consumed) */
    float *logits;          /* [dist_rows, vocab_stride] (this rank's slice of the vocabulary) */
    uint32_t dist_rows;
    uint32_t *pos;       /* [T] RoPE position of each row */
    uint32_t *out_rows;  /* [T] rows whose states go to output slots, ascending */
    uint32_t *out_slot;  /* [T] their slots */
    krn_attn_item *attn; /* [T] attention work of one kernel call */
    uint8_t *mask;       /* [mask_cap] dense masks of the attention items of one call */
    size_t mask_cap;
    /* tensor parallel next_dist (empty at tp_size 1): per row the slice's maximum, then a
     * record of its exponential sum and local top-k (eng_cpu_tp.c), gathered from every rank */
    eng_tp_max *tp_max;     /* [dist_rows] */
    eng_tp_max *tp_max_all; /* [tp_size][dist_rows] */
    char *tp_rec;           /* [tp_rec_cap] */
    char *tp_rec_all;       /* [tp_size][tp_rec_cap] */
    size_t tp_rec_cap;

    eng_check_state chk; /* validation marks and the plan of the last forward */
};

/* y[rows, w.rows] = x[rows, w.cols] · w^T */
void eng_cpu_linear(eng *e, const float *x, uint32_t rows, const mdl_tensor *w, float *y);

pie_code eng_cpu_map(eng_region *r, size_t bytes, const char *what, pie_status *st);
void eng_cpu_unmap(eng_region *r);

/* lm_head over the states of items[0, rows)'s slots into e->logits [rows, n_vocab]. */
void eng_cpu_lm_head(eng *e, const eng_dist_item *items, uint32_t rows);

/* ---- eng_cpu_swap.c (each does nothing when e->tier is NULL, except open) ---- */

/* Opens e->tier for o->swap_slots > 0 with layer buffers of layer_bytes. */
pie_code eng_swap_open(eng *e, const eng_opts *o, size_t layer_bytes, pie_status *st);
void eng_swap_close(eng *e);
/* Layer l on the device, pinned, kv[l].base pointing at it (the forward, before touching l). */
pie_code eng_kv_acquire(eng *e, uint32_t l, pie_status *st);
void eng_kv_release(eng *e, uint32_t l);
/* Before a forward or a page copy writes: the pages they write join the range the tier moves
 * (clearing writes zeros, what is already beyond that range, so it needs none). */
void eng_kv_touch_forward(eng *e, const eng_forward_item *items, uint32_t n);
void eng_kv_touch_copies(eng *e, const eng_copy_item *items, uint32_t n);
/* Tensor parallelism (e->coll set): rank 0's slot count becomes every rank's, one broadcast at
 * the start of each forward (every rank calls it; the worker sets the count on rank 0 only, so
 * the group runs rank 0's expansion and spills). Does nothing at tp 1 or without the tier. */
pie_code eng_swap_share_slots(eng *e, pie_status *st);
/* Nothing moves between hold and resume; kv[*].base point where every layer is. */
void eng_kv_hold(eng *e);
void eng_kv_resume(eng *e);

/* ---- eng_cpu_offload.c (each does what policy gpu does when e->off is NULL) ---- */

typedef struct eng_offload eng_offload;
/* Opens e->off for o->offload_device_pages > 0: host regions of layer_bytes per layer, the
 * host attention pool and its driver, the cost model profiled. */
pie_code eng_offload_open(eng *e, const eng_opts *o, size_t layer_bytes, pie_status *st);
void eng_offload_close(eng *e);
/* Before a forward's layers (after eng_check_forward): which items attend on the host; their
 * pages moved there, every other item's pages to the device. Under tensor parallelism rank 0
 * decides (its scheduler or its pick callback) and broadcasts the choice, which the other
 * ranks execute without deciding: every rank moves the same pages and splits the same items. */
pie_code eng_offload_prepare(eng *e, const eng_forward_item *items, uint32_t n, pie_status *st);
/* The KV layer item `item` of the forward reads and writes. */
const krn_kv_layer *eng_item_kv(const eng *e, uint32_t item, uint32_t layer);
/* e->attn[entry] is forward item `item`'s. */
void eng_attn_note(eng *e, uint32_t entry, uint32_t item);
/* Runs e->attn[0, n_att) of layer `layer`: the host items on the host pool while the device
 * pool runs the rest, both with the plan of the whole call. */
void eng_attn_run(eng *e, uint32_t layer, int n_att);
/* One page copy (every layer), each page read or written where it lives. */
void eng_offload_copy(eng *e, const eng_copy_item *c);
/* After clear_pages zeroed the device region's copy of these pages: it is theirs now. */
void eng_offload_cleared(eng *e, const uint32_t *pages, uint32_t n);

/* ---- eng_cpu_wpack.c ---- */

/* Packs this rank's bf16 linear weights into e->wpack and rebinds them (after
 * eng_tp_bind_weights and the pool), when PIE_KRN_PREPACK or the default says so; sets
 * info.packed_weight_bytes and info.pack_ms. */
pie_code eng_wpack_open(eng *e, pie_status *st);
/* The dtype the kernels are given for t: KRN_BF16_PANEL for a weight in e->wpack. */
krn_dtype eng_cpu_wt(const eng *e, const mdl_tensor *t);

/* ---- eng_cpu_tp.c ---- */

/* Binds e->layers, e->embed, e->lm_head to this rank's shard of e->m (copying the column
 * slices when e->shard.size > 1) and sets info.weight_bytes. */
pie_code eng_tp_bind_weights(eng *e, pie_status *st);

/* Bytes of the tensor-parallel next_dist records per rank (0 at tp_size 1). */
size_t eng_tp_rec_cap(const eng *e);

/* The sharded forms of the handlers (e->shard.size > 1; arguments already validated). */
pie_code eng_tp_embed_text(eng *e, const uint32_t *slots, const uint32_t *tokens,
                           const uint32_t *positions, uint32_t n, pie_status *st);
pie_code eng_tp_next_dist(eng *e, eng_dist_item *items, uint32_t n, pie_status *st);
pie_code eng_tp_logits(eng *e, uint32_t slot, float *logits, pie_status *st);

#endif
