/* mdl.h — a Llama-family model as stored in a Hugging Face directory.
 *
 * Owns: parsing config.json (rope_scaling and the newer rope_parameters, head_dim,
 * tie_word_embeddings, GQA), memory-mapping model.safetensors or the shards named by
 * model.safetensors.index.json, and binding every tensor the decoder needs by name with its
 * dtype and checked shape. Weights are mapped, not copied (but see Alignment). Does not own:
 * the tokenizer (services/common/tok), the math (kernels/cpu), pools and batches
 * (services/worker/engine).
 *
 * Every malformed file gives an error that names the file and the problem, e.g.
 *   "<dir>/config.json: hidden_size: expected an integer in [1, 2147483647], got 0"
 *   "<dir>/model.safetensors: header length 1234567 exceeds the file size 800"
 *   "<dir>/model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' has shape [64, 32],
 *    expected [128, 32]"
 *   "<dir>/model.safetensors: missing tensor 'model.norm.weight'" ... (the exact list is in
 *   mdl.c's header comment and tested in tests/unit/test_mdl.c). Codes: PIE_NOT_FOUND for a
 *   missing directory or file, PIE_INVALID_ARGUMENT for malformed content,
 *   PIE_PERMISSION_DENIED for an unreadable file, PIE_RESOURCE_EXHAUSTED when memory runs out,
 *   PIE_INTERNAL when the OS fails a read or mmap.
 *
 * Alignment. The kernels read a weight as an array of its element type, so each tensor's data
 * must be aligned to its element size. Files written by Hugging Face (and by
 * tools/tinymodel) pad the header so that every tensor is; a tensor that is not is copied
 * once into an aligned buffer at load (the only copy this module makes), counted in
 * mdl_model.n_copied / copied_bytes.
 *
 * Thread safety: none needed; a loaded model is read-only and may be shared by threads. */
#ifndef MDL_H
#define MDL_H

#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

typedef enum mdl_dtype { MDL_F32 = 0, MDL_F16 = 1, MDL_BF16 = 2 } mdl_dtype;

size_t mdl_dtype_size(mdl_dtype t);      /* 4, 2, 2 */
const char *mdl_dtype_name(mdl_dtype t); /* "f32", "f16", "bf16" */

/* A 1- or 2-D weight, row-major as stored: shape [rows, cols]; vectors (1-D tensors) have
 * rows = n, cols = 1. data points into a mapped file (or, for a misaligned tensor, into an
 * aligned copy owned by the model) and is aligned to mdl_dtype_size(dtype). */
typedef struct mdl_tensor {
    const void *data;
    mdl_dtype dtype;
    uint32_t rows, cols;
} mdl_tensor;

/* Reads element i (row-major) of t as f32: f16 and bf16 are widened exactly. For tests and
 * tools; the kernels read weights directly. */
float mdl_tensor_at(const mdl_tensor *t, size_t i);

#define MDL_MAX_EOS 8 /* eos ids kept from a list in config.json */

/* What config.json says, checked. Defaults are those of transformers' LlamaConfig. */
typedef struct mdl_config {
    char architecture[32]; /* "llama" */
    uint32_t vocab_size;
    uint32_t hidden_size;       /* d */
    uint32_t intermediate_size; /* ffn width */
    uint32_t n_layers;
    uint32_t n_heads;
    uint32_t n_kv_heads;   /* divides n_heads */
    uint32_t head_dim;     /* config head_dim, else hidden_size / n_heads */
    uint32_t max_position; /* max_position_embeddings (default 2048) */
    float rms_eps;         /* rms_norm_eps (default 1e-6) */
    float rope_theta;      /* rope_theta (default 10000); inside rope_parameters wins */
    /* Llama-3 frequency scaling (rope_type "llama3"); factor 0 = none (rope_type "default",
     * rope_scaling null or absent). Read from rope_parameters when present, else from
     * rope_scaling; "type" is accepted for "rope_type". */
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    uint32_t rope_orig_max_position; /* original_max_position_embeddings; 0 when no scaling */
    int tie_word_embeddings;         /* 1: lm_head is embed_tokens (default 0) */
    /* mdl_config_load: torch_dtype (or dtype) of config.json, MDL_F32 when absent (as HF).
     * mdl_open: the dtype the weights are stored in (which is what the kernels see; HF too
     * loads a checkpoint whose config names another dtype). */
    mdl_dtype dtype;
    int dtype_declared;                 /* 1: config.json named torch_dtype or dtype */
    int32_t bos_token_id, eos_token_id; /* -1 when absent or null (first of a list for eos) */
    int32_t eos_token_ids[MDL_MAX_EOS]; /* every eos id when a list (first MDL_MAX_EOS) */
    uint32_t n_eos_token_ids;           /* 0 when absent */
} mdl_config;

typedef struct mdl_layer {
    mdl_tensor attn_norm; /* [d] input_layernorm.weight */
    mdl_tensor wq;        /* [n_heads*head_dim, d] */
    mdl_tensor wk;        /* [n_kv_heads*head_dim, d] */
    mdl_tensor wv;        /* [n_kv_heads*head_dim, d] */
    mdl_tensor wo;        /* [d, n_heads*head_dim] */
    mdl_tensor ffn_norm;  /* [d] post_attention_layernorm.weight */
    mdl_tensor w_gate;    /* [ffn, d] */
    mdl_tensor w_up;      /* [ffn, d] */
    mdl_tensor w_down;    /* [d, ffn] */
} mdl_layer;

typedef struct mdl_model {
    char dir[512]; /* as given, trailing slashes removed (at most 400 bytes) */
    mdl_config cfg;
    mdl_tensor embed;    /* [vocab, d] model.embed_tokens.weight */
    mdl_layer *layers;   /* [n_layers] */
    mdl_tensor norm;     /* [d] model.norm.weight */
    mdl_tensor lm_head;  /* [vocab, d]; == embed when tied */
    size_t weight_bytes; /* bytes of all bound tensors (tied counted once) */
    int n_copied;        /* tensors copied because their data was misaligned */
    size_t copied_bytes; /* their bytes (included in weight_bytes) */
    /* mapped files, one per safetensors file, whole-file read-only mappings (internal, but
     * tests check that tensor data lies inside them) */
    void **maps;
    size_t *map_lens;
    int n_maps;
    void **copies; /* [n_copied] aligned buffers (internal) */
} mdl_model;

/* Parses <dir>/config.json only (cheap; used by tools and the worker's registration). On
 * failure *out is unspecified. */
pie_code mdl_config_load(const char *dir, mdl_config *out, pie_status *st);

/* Loads config and maps the weights: <dir>/model.safetensors, or when it does not exist the
 * shards named by <dir>/model.safetensors.index.json. Every header is validated whole (also
 * tensors the decoder does not use); every tensor the decoder needs is bound with its shape
 * checked against the config, and all of them must share one dtype (F32, F16 or BF16).
 * Other tensors in the files are ignored. On failure *out is NULL and nothing stays mapped. */
pie_code mdl_open(const char *dir, mdl_model **out, pie_status *st);
void mdl_close(mdl_model *m); /* NULL is fine */

#endif
