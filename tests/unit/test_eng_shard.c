/* test_eng_shard.c — what rank r of N holds (engine/eng_shard.h), as both backends use it: the
 * ranges of every rank tile each dimension exactly (query heads, MLP columns, vocabulary rows;
 * KV heads split, or replicated so that every rank's query heads read the KV head it stores),
 * on the tiny, small, Llama 1B and 8B shapes; the column slices a bf16 backend uploads (the
 * cuda engine's o_proj and down_proj) put together are the whole matrix; bf16 rounding. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "eng_shard.h"

typedef struct shape {
    const char *name;
    uint32_t heads, kv_heads, ffn, vocab;
} shape;

static const shape shapes[] = {
    {"tiny", 4, 2, 172, 512},
    {"small", 8, 2, 688, 2048},
    {"llama-3.2-1b", 32, 8, 8192, 128256},
    {"llama-3.1-8b", 32, 8, 14336, 128256},
};

static void check_plan(const shape *sh, uint32_t n) {
    mdl_config c;
    memset(&c, 0, sizeof c);
    c.n_heads = sh->heads, c.n_kv_heads = sh->kv_heads, c.intermediate_size = sh->ffn;
    c.vocab_size = sh->vocab;
    uint32_t heads = 0, ffn = 0, vocab = 0, kv_seen = 0, group = sh->heads / sh->kv_heads;
    for (uint32_t r = 0; r < n; r++) {
        eng_shard s;
        pie_status st;
        cr_assert_eq(eng_shard_plan(&c, r, n, &s, &st), PIE_OK, "%s tp %u: %s", sh->name, n,
                     st.msg);
        cr_assert_eq(s.head0, heads, "%s tp %u rank %u: heads start at %u, not %u", sh->name, n, r,
                     s.head0, heads);
        cr_assert_eq(s.ffn0, ffn, "%s tp %u rank %u: ffn starts at %u", sh->name, n, r, s.ffn0);
        cr_assert_eq(s.vocab0, vocab, "%s tp %u rank %u: vocabulary starts at %u", sh->name, n, r,
                     s.vocab0);
        cr_assert(s.n_vocab >= 1 && s.n_vocab <= s.vocab_stride && s.n_ffn >= 1);
        /* every query head of the rank reads a KV head the rank stores */
        for (uint32_t h = s.head0; h < s.head0 + s.n_heads; h++)
            cr_assert(h / group >= s.kv_head0 && h / group < s.kv_head0 + s.n_kv_heads,
                      "%s tp %u rank %u: head %u reads KV head %u, the rank stores [%u, %u)",
                      sh->name, n, r, h, h / group, s.kv_head0, s.kv_head0 + s.n_kv_heads);
        if (n <= sh->kv_heads) {
            cr_assert_eq(s.kv_head0, kv_seen, "%s tp %u rank %u: KV heads split", sh->name, n, r);
            kv_seen += s.n_kv_heads;
        } else {
            cr_assert_eq(s.n_kv_heads, 1, "%s tp %u: one KV head, replicated", sh->name, n);
        }
        heads += s.n_heads, ffn += s.n_ffn, vocab += s.n_vocab;
    }
    cr_assert_eq(heads, sh->heads, "%s tp %u: %u heads in all", sh->name, n, heads);
    cr_assert_eq(ffn, sh->ffn, "%s tp %u: %u MLP columns in all", sh->name, n, ffn);
    cr_assert_eq(vocab, sh->vocab, "%s tp %u: %u vocabulary rows in all", sh->name, n, vocab);
    if (n <= sh->kv_heads) cr_assert_eq(kv_seen, sh->kv_heads);
}

Test(eng_shard, every_ranks_ranges_tile_each_dimension_exactly) {
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (uint32_t n = 1; n <= shapes[i].heads && n <= 8; n *= 2) check_plan(&shapes[i], n);
}

Test(eng_shard, column_slices_put_together_are_the_whole_matrix_in_bf16) {
    enum { ROWS = 5, COLS = 13 };
    static float f[ROWS * COLS];
    static uint16_t b[ROWS * COLS], whole[ROWS * COLS], part[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++) {
        f[i] = sinf((float)i * 0.37f) * 3.0f + (float)i / 7.0f;
        b[i] = eng_bf16_from_f32(-f[i]);
    }
    const mdl_tensor tensors[] = {{.data = f, .dtype = MDL_F32, .rows = ROWS, .cols = COLS},
                                  {.data = b, .dtype = MDL_BF16, .rows = ROWS, .cols = COLS}};
    for (int t = 0; t < 2; t++) {
        const mdl_tensor *m = &tensors[t];
        eng_shard_cols_bf16(m, 0, COLS, 0, ROWS, whole);
        for (int i = 0; i < ROWS * COLS; i++)
            cr_assert_eq(whole[i], t ? b[i] : eng_bf16_from_f32(f[i]), "element %d", i);
        for (uint32_t n = 1; n <= 4; n++)
            for (uint32_t r = 0; r < n; r++) { /* the MLP split: [F r / N, F (r + 1) / N) */
                uint32_t c0 = COLS * r / n, nc = COLS * (r + 1) / n - c0;
                /* two chunks of rows, as the upload goes through its stage */
                eng_shard_cols_bf16(m, c0, nc, 0, 2, part);
                eng_shard_cols_bf16(m, c0, nc, 2, ROWS - 2, part + 2 * nc);
                for (uint32_t row = 0; row < ROWS; row++)
                    for (uint32_t k = 0; k < nc; k++)
                        cr_assert_eq(part[row * nc + k], whole[row * COLS + c0 + k],
                                     "dtype %d, rank %u of %u: row %u column %u", t, r, n, row,
                                     c0 + k);
            }
    }
}

Test(eng_shard, bf16_rounds_to_nearest_even_and_keeps_nan) {
    cr_assert_eq(eng_bf16_from_f32(1.0f), 0x3f80);
    cr_assert_eq(eng_bf16_from_f32(-2.0f), 0xc000);
    cr_assert_eq(eng_bf16_from_f32(1.0f + 0x1p-8f), 0x3f80, "a tie goes to the even mantissa");
    cr_assert_eq(eng_bf16_from_f32(1.0f + 0x3p-8f), 0x3f82, "a tie goes to the even mantissa");
    cr_assert_eq(eng_bf16_from_f32(1.0f + 0x1p-7f + 0x1p-9f), 0x3f81, "below half: down");
    cr_assert_eq(eng_bf16_from_f32(INFINITY), 0x7f80);
    cr_assert_eq(eng_bf16_from_f32(NAN), 0x7fc0);
}
