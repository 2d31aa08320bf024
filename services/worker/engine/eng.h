/* eng.h — the inference engine: a loaded model, its KV-page and embedding-slot pools, and the
 * batch handlers the worker executes for the controller.
 *
 * Owns: the handler contract of the paper's inference layer over PHYSICAL slot ids (the
 * controller maps each instance's ids onto them): embed text, forward over a ragged batch,
 * mask KV page, copy KV page, next-token distribution. Backend-neutral: eng_cpu.c implements it
 * with kernels/cpu; the CUDA backend implements the same functions' semantics.
 * Does not own: id virtualisation and validation against instances (controller), the wire
 * format (the worker translates WorkerLink batches into these calls).
 *
 * Pools. KV pages are stored layer-major: for each layer one contiguous region
 * [kv_pages][2][page_size][n_kv_heads][head_dim] (K then V). Each page also holds a per-token
 * mask (mask_page); masked tokens are invisible to every query. An embedding slot holds one
 * hidden-state vector [hidden] and its position.
 *
 * Validation. Every handler checks every id and count before touching state; on error it
 * changes nothing and the message names the item and field, e.g.
 *   "forward: item 2: kv_last_page_len 17 is out of range [1, 16]". */
#ifndef ENG_H
#define ENG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

typedef enum eng_backend { ENG_BACKEND_CPU = 1, ENG_BACKEND_CUDA = 2 } eng_backend;

struct eng_forward_item;

typedef enum eng_kv_dtype { ENG_KV_F32 = 0, ENG_KV_BF16 = 1 } eng_kv_dtype;

typedef struct eng_opts {
    const char *model_dir;  /* Hugging Face layout: config.json, *.safetensors, tokenizer.json */
    eng_backend backend;    /* 0 → CPU */
    uint32_t kv_page_size;  /* tokens per page; 0 → 16 */
    uint32_t kv_pages;      /* pages in the pool; 0 → 256 */
    uint32_t embed_slots;   /* embedding slots; 0 → 1024 */
    uint32_t max_batch_tokens; /* most input tokens of one forward call; 0 → 4096 */
    int n_threads;          /* CPU threads (the caller included); 0 → online cores */
    /* What the KV pool stores (cpu backend; the cuda backend refuses bf16): f32, or bf16 —
     * half the bytes, each K/V value rounded to nearest even when the forward computes it (the
     * inputs a forward attends to without appending them are rounded the same way, so results
     * never depend on whether a token came from a page). Attention converts back exactly. */
    eng_kv_dtype kv_dtype;
    /* Tensor parallelism (cpu backend over coll; cuda backend over nccl, below): this engine is
     * rank tp_rank of tp_size (0 or 1: the whole model) and loads only its shard (eng_shard.h:
     * heads, KV heads, MLP columns, a vocabulary slice); coll is the group's host collective
     * (services/worker/tp/wrk_coll.h) of tp_size ranks, borrowed, outliving the engine. Then
     * every rank must call every handler with the same arguments in the same order: the pools'
     * metadata (page masks, slot positions) are replicated, the KV pool holds this rank's KV
     * heads under the same page ids, and embed_text, forward, next_dist and logits exchange
     * data through coll. A collective failure (a rank died, a timeout) fails the handler with
     * coll's error and leaves the group unusable. */
    uint32_t tp_rank, tp_size;
    struct wrk_coll *coll;
    /* The cuda backend's collective (services/worker/tp/wrk_nccl.h): the group's NCCL
     * communicator of tp_size ranks, this one tp_rank, borrowed, outliving the engine. Needed
     * for tp_size > 1; given at tp_size 1 the engine runs its sharded path over a one-rank
     * communicator (what the device tests compare with the plain engine). The same contract
     * as coll; the pools' page ids are the same on every rank. */
    struct wrk_nccl *nccl;
    /* The swap policy (issue 13, services/worker/mem/wrk_tier.h; the cuda backend's twin:
     * eng_cuda.h). 0: every layer's KV in one region (policy gpu). Else the KV of
     * at most swap_slots of the n layers is in the "device" region at once, the rest in a
     * "host" region of swap_host_bytes, and a copy engine moves whole layers between them
     * while the forward runs (FIFO, seed 000 Fig. 4). Results are bit for bit those of 0. */
    uint32_t swap_slots;            /* layers on the device at start: swap_min_slots..n */
    uint32_t swap_min_slots;        /* fewest eng_swap_set_slots accepts; 0: 2 (1 if n is 1) */
    uint64_t swap_host_bytes;       /* host region: >= (n - swap_min_slots + 2) layer caches */
    double swap_link_bytes_per_s;   /* emulated link each way; 0: memcpy speed */
    /* NULL: memcpy; else copies one layer (tests inject failures through it) */
    pie_code (*swap_copy)(void *user, void *dst, const void *src, size_t bytes, pie_status *st);
    void *swap_copy_user;
    /* CPU attention offload (cpu backend; issue 13, Neo: engine/eng_cpu_offload.c and
     * services/worker/mem/wrk_offload.h). 0: off. Else page ids [0, kv_pages) may each live in
     * the "device" or the "host" region; at most offload_device_pages of them are meant for the
     * device. A decode item (one input appended) whose pages all move to the host has its
     * attention run by a pool of offload_host_threads host threads while the device pool runs
     * the other items' attention. Results are bit for bit those of 0. Exclusive with swap. */
    uint32_t offload_device_pages;
    int offload_host_threads; /* 0 → 1 */
    /* The host pool (swap's host region, offload's host page region) on NUMA node
     * host_numa_node (services/worker/mem/wrk_numa.h: bound before it is touched, no fall
     * back to another node); false: the kernel's default placement. */
    bool host_numa_bind;
    int host_numa_node;
    /* NULL: the load-aware scheduler decides; else asked for every decode item that may go to
     * the host (item = its index in the forward batch): true sends it (tests). Under tensor
     * parallelism only rank 0 decides (scheduler or pick) and each forward carries its choice
     * to the other ranks, whose own scheduler and pick are never asked. */
    bool (*offload_pick)(void *user, uint32_t item, const struct eng_forward_item *it);
    void *offload_pick_user;
    /* The host attention cost the load-aware scheduler uses, seconds per KV token for all
     * layers, instead of the one profiled at open (0: profiled). A profile taken on a busy
     * machine can be far off; pinning it makes the decisions reproducible (tests make every
     * host decode that cannot hide deferrable with it). */
    double offload_host_attn_s;
} eng_opts;

typedef struct eng_info {
    char architecture[32];
    char dtype[8];          /* weights as stored: "f32", "f16", "bf16" */
    uint32_t vocab_size, hidden_size, intermediate_size, n_layers, n_heads, n_kv_heads,
        head_dim, max_position;
    int32_t bos_token_id, eos_token_id;
    uint32_t kv_page_size, kv_pages, embed_slots, max_batch_tokens;
    uint32_t tp_rank, tp_size;   /* 0 and 1 without tensor parallelism */
    uint32_t local_kv_heads;     /* KV heads this rank's pool stores (n_kv_heads at tp_size 1) */
    size_t weight_bytes;    /* this rank's weights (mapped, plus the slices it copied) */
    size_t kv_pool_bytes;   /* KV pages + masks */
    size_t embed_pool_bytes;
    size_t scratch_bytes;   /* activations sized for max_batch_tokens */
    size_t kv_page_layer_bytes; /* one page of one layer: 2 * page_size * local_kv_heads *
                                   head_dim * (4, or 2 with a bf16 KV pool) */
    char kv_dtype[8];           /* what the KV pool stores: "f32" or "bf16" */
    uint32_t swap_min_slots;    /* 0 without the swap policy */
    /* cpu backend: bytes of the bf16 linear weights packed once at open for the kernels without
     * AMX (PIE_KRN_PREPACK; 0: none packed) and the time packing took */
    size_t packed_weight_bytes;
    double pack_ms;
} eng_info;

typedef struct eng eng;

pie_code eng_open(const eng_opts *opts, eng **out, pie_status *st);
void eng_close(eng *e);
const eng_info *eng_get_info(const eng *e);

/* slots[i] ← embedding of tokens[i] at positions[i]. */
pie_code eng_embed_text(eng *e, const uint32_t *slots, const uint32_t *tokens,
                        const uint32_t *positions, uint32_t n, pie_status *st);

/* One sequence of a forward batch (mirrors pie.v1.ForwardItem). The sequence is the tokens
 * of kv_pages: (n_kv_pages - 1) * page_size + kv_last_page_len of them. With append_kv the
 * n_in inputs are its LAST n_in tokens and their K/V are written there; without, the pages
 * hold only the context and the inputs follow it, attended to but not stored. Each input's
 * RoPE position is the one stored with its embedding slot. The final hidden states (after the
 * last norm) of the last n_out inputs go to out_slots, with those inputs' positions. */
typedef struct eng_forward_item {
    const uint32_t *kv_pages;
    uint32_t n_kv_pages;
    uint32_t kv_last_page_len; /* 1..page_size; 0 iff n_kv_pages == 0 */
    bool append_kv;
    const uint32_t *in_slots;
    uint32_t n_in;             /* >= 1 */
    const uint32_t *out_slots;
    uint32_t n_out;            /* <= n_in */
    /* NULL: causal. Else pie.v1.AttentionMask runs: row i covers the first C + i + 1 tokens
     * (C = context tokens before the inputs), runs alternate visible/masked starting visible. */
    const uint32_t *mask_runs;
    uint32_t n_mask_runs;
} eng_forward_item;

/* Runs every item as one batch (one pass through the layers for all their tokens). As
 * pie.v1.ForwardBatch: per layer every item's new K/V is written before any item attends, so an
 * item may read positions another item of the batch appends; two items writing the same page
 * position, or an item whose input slot is another item's output slot, are refused. Page masks
 * apply to the context tokens (those before the inputs). */
pie_code eng_forward(eng *e, const eng_forward_item *items, uint32_t n, pie_status *st);

/* Deferral under CPU attention offload (issue 13; Neo §3.3, wrk_offload.h's rules with
 * defer_ok): eng_forward_plan validates a forward batch as eng_forward does and decides its
 * split with the scheduler allowed to defer the host decodes whose attention would not hide
 * behind the device's work: defer[i] ← 1 for each (the request's wait is counted: one deferred
 * WRK_OFF_DEFER_MAX steps in a row runs at its next), 0 for the rest. Without offload, or at
 * tp_size > 1, nothing is deferred and nothing is planned. The caller may skip more items (those
 * that depend on a deferred one) and runs the batch with eng_forward_skip over the same items:
 * the items with skip[i] ≠ 0 (every deferred one among them) are not run at all — no K/V
 * stored, no output written, no page of theirs moved — and the others run with the plan's
 * split, exactly as eng_forward runs a batch of them alone. An item skipped as a dependent
 * counts as having waited a step. Without a plan (none, or not offload) eng_forward_skip runs
 * the others with a fresh decision; skipping needs the offload policy (else
 * FAILED_PRECONDITION "forward: skipping items needs the offload memory policy"). */
pie_code eng_forward_plan(eng *e, const eng_forward_item *items, uint32_t n, uint8_t *defer,
                          pie_status *st);
pie_code eng_forward_skip(eng *e, const eng_forward_item *items, uint32_t n, const uint8_t *skip,
                          pie_status *st);

/* Sets the per-token mask of page: masked[page_size], true = hidden from every query. */
pie_code eng_mask_page(eng *e, uint32_t page, const bool *masked, pie_status *st);

/* Copies count tokens (K, V and mask) from src page at src_off to dst page at dst_off, every
 * layer. src may equal dst when the ranges do not overlap. */
typedef struct eng_copy_item {
    uint32_t src, dst, src_off, dst_off, count;
} eng_copy_item;
pie_code eng_copy_pages(eng *e, const eng_copy_item *items, uint32_t n, pie_status *st);

/* What a freshly allocated slot holds, so that nothing of a previous owner can be read:
 * eng_clear_pages zeroes the K/V of pages[i] in every layer and makes its mask all visible;
 * eng_clear_embeds zeroes the hidden state and the position of slots[i]. The worker calls them
 * for every slot a SlotBatch allocates. Ids may repeat; n == 0 does nothing. */
pie_code eng_clear_pages(eng *e, const uint32_t *pages, uint32_t n, pie_status *st);
pie_code eng_clear_embeds(eng *e, const uint32_t *slots, uint32_t n, pie_status *st);
/* The worker freed pages (a SlotBatch): nothing reads them until they are allocated (and
 * cleared) again, so the offload policy stops counting them against the device's room. Ids
 * out of range are ignored; nothing else changes. Under tensor parallelism every rank's
 * executor calls it for the same slot batches. */
void eng_pages_freed(eng *e, const uint32_t *pages, uint32_t n);

/* LM head over slot's hidden state → softmax(logits / temperature) → the top_k token ids and
 * probabilities (descending; probabilities of the full softmax, not renormalised). Under
 * tensor parallelism no rank sees the full logits: each takes the global maximum, its slice's
 * sum of exponentials and its local top_k, and every rank merges the same result exactly
 * (what rank 0 returns). Equal
 * probabilities (underflowed zeros too) go to the lower id; a NaN logit gets a NaN probability,
 * ranked last, and is left out of the softmax; an infinite largest logit puts all mass on the
 * first one (both backends: krn_cpu_softmax, tests/kcheck). */
typedef struct eng_dist_item {
    uint32_t slot;
    uint32_t top_k;      /* 1..vocab */
    float temperature;   /* > 0; 1 = the model's distribution */
    uint32_t *ids;       /* [top_k], filled */
    float *probs;        /* [top_k], filled */
} eng_dist_item;
pie_code eng_next_dist(eng *e, eng_dist_item *items, uint32_t n, pie_status *st);

/* Raw logits [vocab] of a slot (tests and the reference comparison; every rank gets all). */
pie_code eng_logits(eng *e, uint32_t slot, float *logits, pie_status *st);

/* The swap policy (swap_slots > 0 at open; without it: stats all zero, set_slots refused). */
typedef struct eng_swap_stats {
    uint32_t slots;       /* layers the device region may hold now */
    uint32_t on_device;   /* layers holding a device buffer */
    uint32_t on_host;     /* layers whose KV is only in the host region */
    uint64_t swap_in_bytes, swap_out_bytes, swaps_in, swaps_out;
    uint64_t stalls;      /* layers the forward waited for */
    uint64_t stall_ns;    /* time it waited */
    uint64_t copy_failures;
} eng_swap_stats;

/* Between handlers: the device region holds at most `slots` layers from now on (clamped to
 * swap_min_slots..n; *applied: what was set). Pages stay valid whatever the slot count. Under
 * tensor parallelism set it on rank 0: each forward carries rank 0's count to the other ranks
 * (what they set themselves is replaced at their next forward). */
pie_code eng_swap_set_slots(eng *e, uint32_t slots, uint32_t *applied, pie_status *st);
void eng_swap_get_stats(eng *e, eng_swap_stats *out);
/* Waits until the copy engine is idle (tests and benchmarks). */
void eng_swap_quiesce(eng *e);

/* CPU attention offload (offload_device_pages > 0 at open; without it: all zero). */
typedef struct eng_offload_stats {
    uint32_t device_pages;       /* the device's share of the page ids */
    uint32_t pages_on_host;      /* written pages whose KV is in the host region now */
    uint32_t pages_on_device;    /* written pages whose KV is in the device region now */
    uint64_t steps;              /* forward batches */
    uint64_t offload_steps;      /* ... that ran two sub-batches */
    uint64_t forced_steps;       /* ... because the device could not hold every decode's KV */
    uint64_t host_items;         /* decode items whose attention ran on the host, summed */
    uint32_t last_host_items;    /* in the last forward batch */
    uint64_t host_attn_ns;       /* host attention time, summed */
    uint64_t last_host_attn_ns;  /* in the last forward batch */
    uint64_t host_wait_ns;       /* the device side waited for host attention, summed */
    uint64_t pages_to_host, pages_to_device;
    uint64_t deferred;               /* decodes the scheduler deferred (eng_forward_plan) */
    uint64_t gain_pages, gain_steps; /* the scheduler's estimate (wrk_offplace_stats) */
    /* the cost model profiled at open, seconds for all layers (wrk_offload.h) */
    double lin_tok, lin_fixed, dattn_kv, hattn_kv, xfer_tok;
} eng_offload_stats;
void eng_offload_get_stats(eng *e, eng_offload_stats *out);

/* Position stored with a slot (tests). */
pie_code eng_slot_position(eng *e, uint32_t slot, uint32_t *pos, pie_status *st);

#endif
