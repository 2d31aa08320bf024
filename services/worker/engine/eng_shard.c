/* eng_shard.c — see eng_shard.h. */
#include "eng_shard.h"

#include <string.h>

pie_code eng_shard_plan(const mdl_config *c, uint32_t rank, uint32_t size, eng_shard *out,
                        pie_status *st) {
    if (size == 0) size = 1;
    if (rank >= size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_rank %u is out of range [0, %u)", rank, size);
    if (c->n_heads % size != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_size %u must divide n_heads %u", size, c->n_heads);
    if (c->n_kv_heads % size != 0 && size % c->n_kv_heads != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_size %u must divide n_kv_heads %u or be a multiple "
                              "of it",
                              size, c->n_kv_heads);
    if (c->intermediate_size < size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_size %u exceeds intermediate_size %u", size,
                              c->intermediate_size);
    uint32_t stride = (uint32_t)(((uint64_t)c->vocab_size + size - 1) / size);
    if ((uint64_t)(size - 1) * stride >= c->vocab_size)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "eng_open: tp_size %u leaves rank %u no rows of the vocabulary "
                              "(vocab_size %u)",
                              size, size - 1, c->vocab_size);
    eng_shard s = {.rank = rank, .size = size, .vocab_stride = stride};
    s.n_heads = c->n_heads / size;
    s.head0 = rank * s.n_heads;
    if (size <= c->n_kv_heads) {
        s.n_kv_heads = c->n_kv_heads / size;
        s.kv_head0 = rank * s.n_kv_heads;
    } else { /* the one KV head of this rank's query heads (n_heads / n_kv_heads per KV head) */
        s.n_kv_heads = 1;
        s.kv_head0 = s.head0 / (c->n_heads / c->n_kv_heads);
    }
    s.ffn0 = (uint32_t)((uint64_t)c->intermediate_size * rank / size);
    s.n_ffn = (uint32_t)((uint64_t)c->intermediate_size * (rank + 1) / size) - s.ffn0;
    s.vocab0 = rank * stride;
    s.n_vocab = c->vocab_size - s.vocab0 < stride ? c->vocab_size - s.vocab0 : stride;
    *out = s;
    return PIE_OK;
}

mdl_tensor eng_shard_rows(const mdl_tensor *t, uint32_t r0, uint32_t n) {
    mdl_tensor v = *t;
    v.data = (const char *)t->data + (size_t)r0 * t->cols * mdl_dtype_size(t->dtype);
    v.rows = n;
    return v;
}

uint16_t eng_bf16_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest even */
    return (uint16_t)(u >> 16);
}

void eng_shard_cols_bf16(const mdl_tensor *t, uint32_t c0, uint32_t n, size_t r0, size_t rows,
                         uint16_t *dst) {
    for (size_t r = 0; r < rows; r++) {
        size_t at = (r0 + r) * t->cols + c0; /* row r0 + r, column c0 */
        if (t->dtype == MDL_BF16)
            memcpy(dst + r * n, (const uint16_t *)t->data + at, (size_t)n * sizeof(uint16_t));
        else
            for (uint32_t k = 0; k < n; k++)
                dst[r * n + k] = eng_bf16_from_f32(mdl_tensor_at(t, at + k));
    }
}
