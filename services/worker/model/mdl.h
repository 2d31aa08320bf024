/* mdl.h — a Llama-family model as stored in a Hugging Face directory.
 *
 * Owns: parsing config.json (rope_scaling and the newer rope_parameters, head_dim,
 * tie_word_embeddings, GQA), memory-mapping model.safetensors or the shards named by
 * model.safetensors.index.json, and binding every tensor the decoder needs by name with its
 * dtype and checked shape. Weights are mapped, never copied. Does not own: the tokenizer
 * (services/common/tok), the math (kernels/cpu), pools and batches (services/worker/engine).
 *
 * Every malformed file gives an error that names the file and the problem, e.g.
 *   "<dir>/config.json: hidden_size: expected a positive integer"
 *   "<dir>/model.safetensors: header length 1234567 exceeds the file size 800"
 *   "<dir>/model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' has shape [64, 32],
 *    expected [128, 32]"
 *   "<dir>: missing tensor 'model.norm.weight'" ... (the exact list is in mdl.c's header
 *   comment and tested in tests/unit/test_mdl.c). */
#ifndef MDL_H
#define MDL_H

#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

typedef enum mdl_dtype { MDL_F32 = 0, MDL_F16 = 1, MDL_BF16 = 2 } mdl_dtype;

size_t mdl_dtype_size(mdl_dtype t);         /* 4, 2, 2 */
const char *mdl_dtype_name(mdl_dtype t);    /* "f32", "f16", "bf16" */

/* A 1- or 2-D weight, row-major as stored: shape [rows, cols] (cols = 1 for vectors is not
 * used: vectors have rows = n, cols = 1). data points into a mapped file. */
typedef struct mdl_tensor {
    const void *data;
    mdl_dtype dtype;
    uint32_t rows, cols;
} mdl_tensor;

typedef struct mdl_config {
    char architecture[32];      /* "llama" */
    uint32_t vocab_size;
    uint32_t hidden_size;       /* d */
    uint32_t intermediate_size; /* ffn width */
    uint32_t n_layers;
    uint32_t n_heads;
    uint32_t n_kv_heads;        /* divides n_heads */
    uint32_t head_dim;          /* config head_dim, else hidden_size / n_heads */
    uint32_t max_position;      /* max_position_embeddings */
    float rms_eps;              /* rms_norm_eps */
    float rope_theta;           /* rope_theta (default 10000) */
    /* Llama-3 frequency scaling (rope_type "llama3"); factor 0 = none. */
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    uint32_t rope_orig_max_position; /* original_max_position_embeddings */
    int tie_word_embeddings;    /* 1: lm_head is embed_tokens */
    mdl_dtype dtype;            /* torch_dtype, or the tensors' dtype when absent */
    int32_t bos_token_id, eos_token_id; /* -1 when absent (first of a list for eos) */
} mdl_config;

typedef struct mdl_layer {
    mdl_tensor attn_norm;  /* [d] input_layernorm.weight */
    mdl_tensor wq;         /* [n_heads*head_dim, d] */
    mdl_tensor wk;         /* [n_kv_heads*head_dim, d] */
    mdl_tensor wv;         /* [n_kv_heads*head_dim, d] */
    mdl_tensor wo;         /* [d, n_heads*head_dim] */
    mdl_tensor ffn_norm;   /* [d] post_attention_layernorm.weight */
    mdl_tensor w_gate;     /* [ffn, d] */
    mdl_tensor w_up;       /* [ffn, d] */
    mdl_tensor w_down;     /* [d, ffn] */
} mdl_layer;

typedef struct mdl_model {
    char dir[512];
    mdl_config cfg;
    mdl_tensor embed;      /* [vocab, d] model.embed_tokens.weight */
    mdl_layer *layers;     /* [n_layers] */
    mdl_tensor norm;       /* [d] model.norm.weight */
    mdl_tensor lm_head;    /* [vocab, d]; == embed when tied */
    size_t weight_bytes;   /* bytes of all bound tensors (tied counted once) */
    /* mapped files (internal) */
    void **maps;
    size_t *map_lens;
    int n_maps;
} mdl_model;

/* Parses <dir>/config.json only (cheap; used by tools and the worker's registration). */
pie_code mdl_config_load(const char *dir, mdl_config *out, pie_status *st);

/* Loads config and maps the weights. On failure nothing stays mapped. */
pie_code mdl_open(const char *dir, mdl_model **out, pie_status *st);
void mdl_close(mdl_model *m);

#endif
