/* eng_shard.h — what rank r of a tensor-parallel group of size N holds (engine-internal).
 *
 * Owns: the Megatron-style split of a Llama model and its checks: query heads split evenly
 * (N divides n_heads); KV heads split evenly when N <= n_kv_heads (N divides them), else each
 * rank stores the one KV head its query heads read, replicated N / n_kv_heads times (then
 * n_kv_heads divides N); the MLP's intermediate columns split as evenly as they go
 * ([ffn * r / N, ffn * (r + 1) / N)); the vocabulary cut into slices of ceil(vocab / N) rows
 * (the last may be shorter; every rank needs one row at least), so rank r's slice starts at
 * r * vocab_stride and a gather of [N][vocab_stride] is the vocabulary in order.
 * Also: eng_shard_rows, the row view both backends slice with, and eng_shard_cols_bf16, a column
 * slice in bf16 (the cuda engine's upload).
 * Does not own: the cpu engine's f32 column copies (eng_cpu_tp.c), the collective
 * (services/worker/tp). */
#ifndef ENG_SHARD_H
#define ENG_SHARD_H

#include <stdint.h>

#include "mdl.h"
#include "pie_status.h"

typedef struct eng_shard {
    uint32_t rank, size;           /* size 1: the whole model */
    uint32_t head0, n_heads;       /* query heads [head0, head0 + n_heads) */
    uint32_t kv_head0, n_kv_heads; /* KV heads stored: [kv_head0, kv_head0 + n_kv_heads) */
    uint32_t ffn0, n_ffn;          /* intermediate columns [ffn0, ffn0 + n_ffn) */
    uint32_t vocab0, n_vocab;      /* rows of embed_tokens and lm_head [vocab0, vocab0 + n_vocab) */
    uint32_t vocab_stride;         /* ceil(vocab / size): vocab0 = rank * vocab_stride */
} eng_shard;

/* The shard of rank `rank` of `size` (0 counts as 1) for model c (checked with
 * eng_check_model first). INVALID_ARGUMENT naming the dimension that does not split:
 *   "eng_open: tp_rank R is out of range [0, N)",
 *   "eng_open: tp_size N must divide n_heads H",
 *   "eng_open: tp_size N must divide n_kv_heads K or be a multiple of it",
 *   "eng_open: tp_size N exceeds intermediate_size F",
 *   "eng_open: tp_size N leaves rank R no rows of the vocabulary (vocab_size V)". */
pie_code eng_shard_plan(const mdl_config *c, uint32_t rank, uint32_t size, eng_shard *out,
                        pie_status *st);

/* Rows [r0, r0 + n) of t: a view of the same data (no copy). */
mdl_tensor eng_shard_rows(const mdl_tensor *t, uint32_t r0, uint32_t n);

/* f as bf16 bits, rounded to nearest even (a NaN stays a NaN: 0x7fc0). */
uint16_t eng_bf16_from_f32(float f);

/* Rows [r0, r0 + rows) of t's columns [c0, c0 + n) as bf16 bits into dst[rows][n] (bf16
 * copied, other dtypes rounded by eng_bf16_from_f32): the column slice of o_proj or down_proj
 * a row-parallel rank stores, for a backend that keeps bf16 (the cuda engine uploads it in
 * chunks of rows). */
void eng_shard_cols_bf16(const mdl_tensor *t, uint32_t c0, uint32_t n, size_t r0, size_t rows,
                         uint16_t *dst);

#endif
