/* test_mdl.c — services/worker/model: loading Hugging Face Llama directories.
 *
 * Three parts. (1) Every message of the list in mdl.c's header comment, exactly, from a model
 * directory written here in C: a small valid model (vocab 16, hidden 8, 2 layers, 2 heads, 1 KV
 * head, ffn 12) with one thing broken per test. (2) Successful loads of such directories:
 * defaults, the RoPE spellings, eos lists, head_dim, tying, unused tensors, misaligned data.
 * (3) The models generated at build time by tools/tinymodel (PIE_MODELS_DIR): config values of
 * the presets, weight accounting, mapping, and that bf16/f16/sharded variants hold exactly the
 * tiny-f32 weights (rounded to nearest even / identical bytes).
 *
 * Each test runs in its own process (Criterion's default) with a fresh mkdtemp directory. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mdl.h"

/* Dimensions of the C-written model. */
enum { V = 16, D = 8, FFN = 12, L = 2, H = 2, KV = 1, HD = 4 };

static char dir[64];

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void setup(void) {
    snprintf(dir, sizeof dir, "/tmp/pie-test-mdl-XXXXXX");
    cr_assert_not_null(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
}

static void teardown(void) { (void)nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

TestSuite(mdl, .init = setup, .fini = teardown);

/* ---- writing model files -------------------------------------------------------------------- */

static void path_of(char *buf, size_t n, const char *name) {
    int k = snprintf(buf, n, "%s/%s", dir, name);
    cr_assert(k > 0 && (size_t)k < n);
}

static void put(const char *name, const void *data, size_t n) {
    char path[256];
    path_of(path, sizeof path, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "fopen %s: %s", path, strerror(errno));
    cr_assert_eq(fwrite(data, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

static void put_str(const char *name, const char *s) { put(name, s, strlen(s)); }

/* Writes obj as name and drops the reference. */
static void put_json(const char *name, json_t *obj) {
    cr_assert_not_null(obj);
    char *s = json_dumps(obj, JSON_INDENT(2) | JSON_ENCODE_ANY);
    cr_assert_not_null(s);
    put_str(name, s);
    free(s);
    json_decref(obj);
}

/* config.json of the C-written model (head_dim derived, tied, llama3 rope_scaling). */
static json_t *cfg_base(void) {
    json_t *c =
        json_pack("{s:[s], s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f,"
                  " s:{s:s, s:f, s:f, s:f, s:i}, s:b, s:s, s:i, s:[i, i]}",
                  "architectures", "LlamaForCausalLM", "model_type", "llama", "hidden_act", "silu",
                  "vocab_size", V, "hidden_size", D, "intermediate_size", FFN, "num_hidden_layers",
                  L, "num_attention_heads", H, "num_key_value_heads", KV, "max_position_embeddings",
                  64, "rms_norm_eps", 1e-5, "rope_theta", 10000.0, "rope_scaling", "rope_type",
                  "llama3", "factor", 8.0, "low_freq_factor", 1.0, "high_freq_factor", 4.0,
                  "original_max_position_embeddings", 32, "tie_word_embeddings", 1, "torch_dtype",
                  "float32", "bos_token_id", 1, "eos_token_id", 2, 3);
    cr_assert_not_null(c, "json_pack");
    return c;
}

static void cfg_set(json_t *c, const char *key, json_t *v) {
    cr_assert_eq(json_object_set_new(c, key, v), 0);
}

/* A tensor of a safetensors file being written. */
typedef struct tt {
    char name[96];
    char dtype[16];
    int ndim;
    uint64_t shape[10];
} tt;

typedef struct tset {
    tt t[48];
    int n;
} tset;

static size_t dtype_bytes(const char *dt) {
    if (strcmp(dt, "F32") == 0) return 4;
    if (strcmp(dt, "F16") == 0 || strcmp(dt, "BF16") == 0) return 2;
    if (strcmp(dt, "F64") == 0 || strcmp(dt, "I64") == 0) return 8;
    if (strcmp(dt, "I8") == 0) return 1;
    return 4;
}

static uint64_t numel(const tt *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static tt *tset_add(tset *s, const char *name, const char *dtype, int ndim, uint64_t r,
                    uint64_t c) {
    cr_assert_lt(s->n, 48);
    tt *t = &s->t[s->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    snprintf(t->dtype, sizeof t->dtype, "%s", dtype);
    t->ndim = ndim;
    t->shape[0] = r;
    t->shape[1] = c;
    return t;
}

static tt *tset_find(tset *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->t[i].name, name) == 0) return &s->t[i];
    cr_assert_fail("no tensor %s in the test set", name);
    return NULL;
}

static void tset_drop(tset *s, const char *name) {
    tt *t = tset_find(s, name);
    int i = (int)(t - s->t);
    memmove(&s->t[i], &s->t[i + 1], (size_t)(s->n - i - 1) * sizeof *t);
    s->n--;
}

/* Every tensor of the C-written model in HF order; lm_head when untied. */
static void tset_std(tset *s, const char *dtype, int tied) {
    s->n = 0;
    tset_add(s, "model.embed_tokens.weight", dtype, 2, V, D);
    for (int l = 0; l < L; l++) {
        char n[96];
#define LAYER(suffix, nd, r, c)                             \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix); \
    tset_add(s, n, dtype, nd, r, c)
        LAYER("input_layernorm.weight", 1, D, 0);
        LAYER("self_attn.q_proj.weight", 2, H * HD, D);
        LAYER("self_attn.k_proj.weight", 2, KV * HD, D);
        LAYER("self_attn.v_proj.weight", 2, KV * HD, D);
        LAYER("self_attn.o_proj.weight", 2, D, H * HD);
        LAYER("post_attention_layernorm.weight", 1, D, 0);
        LAYER("mlp.gate_proj.weight", 2, FFN, D);
        LAYER("mlp.up_proj.weight", 2, FFN, D);
        LAYER("mlp.down_proj.weight", 2, D, FFN);
#undef LAYER
    }
    tset_add(s, "model.norm.weight", dtype, 1, D, 0);
    if (!tied) tset_add(s, "lm_head.weight", dtype, 2, V, D);
}

/* Element j of the k-th tensor of a file: multiples of 1/8 in [-4, 4), exact in every dtype. */
static float tval(int k, uint64_t j) {
    return (float)((k * 31 + (int)(j % 64)) % 64) / 8.0f - 4.0f;
}

static uint16_t f32_bits_hi(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (uint16_t)(b >> 16);
}

/* f32 → f16 for values exact in f16 (all tval values). */
static uint16_t f16_of_exact(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if ((b & 0x7fffffffu) == 0) return (uint16_t)(b >> 16);
    uint32_t sign = (b >> 16) & 0x8000u, exp = (b >> 23) & 0xff, mant = b & 0x7fffffu;
    return (uint16_t)(sign | ((exp - 127 + 15) << 10) | (mant >> 13));
}

/* Writes a safetensors file of s with contiguous data; the data section starts at a file
 * offset ≡ misalign (mod 8) (0: aligned, as HF writes). */
static void put_st(const char *name, const tset *s, int misalign) {
    json_t *h = json_object();
    cr_assert_eq(json_object_set_new(h, "__metadata__", json_pack("{s:s}", "format", "pt")), 0);
    uint64_t off = 0;
    for (int i = 0; i < s->n; i++) {
        const tt *t = &s->t[i];
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
        uint64_t bytes = numel(t) * dtype_bytes(t->dtype);
        cr_assert_eq(json_object_set_new(h, t->name,
                                         json_pack("{s:s, s:o, s:[I, I]}", "dtype", t->dtype,
                                                   "shape", shape, "data_offsets", (json_int_t)off,
                                                   (json_int_t)(off + bytes))),
                     0);
        off += bytes;
    }
    char *hs = json_dumps(h, JSON_COMPACT);
    cr_assert_not_null(hs);
    json_decref(h);
    size_t hlen = strlen(hs);
    while ((8 + hlen) % 8 != (size_t)misalign) hlen++;
    size_t total = 8 + hlen + off;
    uint8_t *buf = calloc(1, total);
    cr_assert_not_null(buf);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memset(buf + 8, ' ', hlen);
    memcpy(buf + 8, hs, strlen(hs));
    free(hs);
    uint8_t *p = buf + 8 + hlen;
    for (int i = 0; i < s->n; i++) {
        const tt *t = &s->t[i];
        size_t es = dtype_bytes(t->dtype);
        for (uint64_t j = 0; j < numel(t); j++, p += es) {
            float v = tval(i, j);
            if (strcmp(t->dtype, "F32") == 0)
                memcpy(p, &v, 4);
            else if (strcmp(t->dtype, "BF16") == 0) {
                uint16_t b = f32_bits_hi(v);
                memcpy(p, &b, 2);
            } else if (strcmp(t->dtype, "F16") == 0) {
                uint16_t b = f16_of_exact(v);
                memcpy(p, &b, 2);
            }
        }
    }
    put(name, buf, total);
    free(buf);
}

/* Writes a safetensors file from a header given as text, followed by data_len zero bytes. */
static void put_raw_st(const char *name, const char *header, size_t data_len) {
    size_t hlen = strlen(header), total = 8 + hlen + data_len;
    uint8_t *buf = calloc(1, total);
    cr_assert_not_null(buf);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memcpy(buf + 8, header, hlen);
    put(name, buf, total);
    free(buf);
}

/* The valid C-written model: config.json + model.safetensors (f32, tied). */
static void put_model(void) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 1);
    put_st("model.safetensors", &s, 0);
}

/* ---- asserting outcomes -------------------------------------------------------------------- */

static mdl_model *open_ok(const char *path) {
    mdl_model *m = NULL;
    pie_status st;
    pie_code rc = mdl_open(path, &m, &st);
    cr_assert_eq(rc, PIE_OK, "mdl_open(%s): %s %s", path, pie_code_name(rc), st.msg);
    cr_assert_not_null(m);
    return m;
}

/* mdl_open(path) fails with code and exactly the message fmt (formatted). */
static void open_fails_at(const char *path, pie_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void open_fails_at(const char *path, pie_code code, const char *fmt, ...) {
    char want[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(want, sizeof want, fmt, ap);
    va_end(ap);
    mdl_model *m = (mdl_model *)&want; /* must be reset to NULL */
    pie_status st;
    pie_code rc = mdl_open(path, &m, &st);
    cr_assert_eq(rc, code, "code %s, want %s; message: %s", pie_code_name(rc), pie_code_name(code),
                 st.msg);
    cr_assert_eq(st.code, code);
    cr_assert_null(m);
    cr_assert_str_eq(st.msg, want, "message\n  got:  %s\n  want: %s", st.msg, want);
}

#define OPEN_FAILS(code, ...) open_fails_at(dir, code, __VA_ARGS__)

/* Writes cfg as config.json; mdl_config_load and mdl_open both fail with exactly
 * "<dir>/config.json: <detail>". */
static void config_fails(json_t *cfg, const char *detail) {
    put_json("config.json", cfg);
    char want[1024];
    snprintf(want, sizeof want, "%s/config.json: %s", dir, detail);
    mdl_config c;
    pie_status st;
    pie_code rc = mdl_config_load(dir, &c, &st);
    cr_assert_eq(rc, PIE_INVALID_ARGUMENT, "code %s; message: %s", pie_code_name(rc), st.msg);
    cr_assert_str_eq(st.msg, want, "message\n  got:  %s\n  want: %s", st.msg, want);
    OPEN_FAILS(PIE_INVALID_ARGUMENT, "%s", want);
}

/* Config with key set to the JSON text v; expects detail. */
static void config_key_fails(const char *key, const char *v, const char *detail) {
    json_t *c = cfg_base();
    json_error_t e;
    json_t *val = json_loads(v, JSON_DECODE_ANY, &e);
    cr_assert_not_null(val, "bad test value %s", v);
    cfg_set(c, key, val);
    config_fails(c, detail);
}

/* Config with rope_scaling.key set to v (NULL: removed). */
static void rope_key_fails(const char *key, const char *v, const char *detail) {
    json_t *c = cfg_base();
    json_t *r = json_object_get(c, "rope_scaling");
    if (v == NULL) {
        cr_assert_eq(json_object_del(r, key), 0);
    } else {
        json_error_t e;
        json_t *val = json_loads(v, JSON_DECODE_ANY, &e);
        cr_assert_not_null(val);
        cr_assert_eq(json_object_set_new(r, key, val), 0);
    }
    config_fails(c, detail);
}

/* ---- D: the directory ----------------------------------------------------------------------- */

Test(mdl, D1_empty_path) {
    open_fails_at("", PIE_INVALID_ARGUMENT, "model directory: the path is empty");
    mdl_config c;
    pie_status st;
    cr_assert_eq(mdl_config_load("", &c, &st), PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "model directory: the path is empty");
}

Test(mdl, D2_path_too_long) {
    char path[460];
    memset(path, 'a', 450);
    path[450] = '\0';
    open_fails_at(path, PIE_INVALID_ARGUMENT,
                  "%.60s...: model directory path is too long (450 bytes, at most 400)", path);
}

Test(mdl, D3_missing_directory) {
    char path[128];
    path_of(path, sizeof path, "nope");
    open_fails_at(path, PIE_NOT_FOUND, "%s: cannot open model directory: No such file or directory",
                  path);
}

Test(mdl, D4_not_a_directory) {
    put_str("file", "x");
    char path[128];
    path_of(path, sizeof path, "file");
    open_fails_at(path, PIE_INVALID_ARGUMENT, "%s: not a directory", path);
}

/* ---- J: config.json as a file ---------------------------------------------------------------- */

Test(mdl, J1_missing_config_json) {
    OPEN_FAILS(PIE_NOT_FOUND, "cannot open JSON file '%s/config.json': No such file or directory",
               dir);
}

Test(mdl, J2_config_json_is_a_directory) {
    char path[128];
    path_of(path, sizeof path, "config.json");
    cr_assert_eq(mkdir(path, 0755), 0);
    OPEN_FAILS(PIE_INVALID_ARGUMENT, "JSON file '%s/config.json' is not a regular file", dir);
    /* a FIFO is refused without blocking on the open */
    cr_assert_eq(rmdir(path), 0);
    cr_assert_eq(mkfifo(path, 0644), 0);
    OPEN_FAILS(PIE_INVALID_ARGUMENT, "JSON file '%s/config.json' is not a regular file", dir);
}

Test(mdl, J3_config_json_too_large) {
    char path[128];
    path_of(path, sizeof path, "config.json");
    int fd = open(path, O_CREAT | O_WRONLY, 0644);
    cr_assert_geq(fd, 0);
    cr_assert_eq(ftruncate(fd, (64 << 20) + 1), 0); /* sparse: costs no disk */
    cr_assert_eq(close(fd), 0);
    OPEN_FAILS(PIE_INVALID_ARGUMENT, "JSON file '%s/config.json' is larger than 67108864 bytes",
               dir);
}

Test(mdl, J4_config_json_bad_json_names_line_and_column) {
    put_str("config.json", "{\n  \"hidden_size\": 64,\n  oops\n}\n");
    OPEN_FAILS(
        PIE_INVALID_ARGUMENT,
        "%s/config.json: invalid JSON at line 3, column 6: string or '}' expected near 'oops'",
        dir);
}

Test(mdl, J5_config_json_not_an_object) {
    put_str("config.json", "[1, 2]");
    OPEN_FAILS(PIE_INVALID_ARGUMENT, "%s/config.json: expected a JSON object at the top level",
               dir);
}

/* ---- C: config.json keys --------------------------------------------------------------------- */

Test(mdl, C1_missing_required_keys) {
    static const char *const keys[] = {"model_type",        "vocab_size",
                                       "hidden_size",       "intermediate_size",
                                       "num_hidden_layers", "num_attention_heads"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        json_t *c = cfg_base();
        cr_assert_eq(json_object_del(c, keys[i]), 0);
        char detail[128];
        snprintf(detail, sizeof detail, "missing required key '%s'", keys[i]);
        config_fails(c, detail);
    }
}

Test(mdl, C1_missing_required_keys_of_the_rope_block) {
    rope_key_fails("factor", NULL, "missing required key 'rope_scaling.factor'");
    rope_key_fails("low_freq_factor", NULL, "missing required key 'rope_scaling.low_freq_factor'");
    rope_key_fails("high_freq_factor", NULL,
                   "missing required key 'rope_scaling.high_freq_factor'");
    rope_key_fails("original_max_position_embeddings", NULL,
                   "missing required key 'rope_scaling.original_max_position_embeddings'");
    rope_key_fails("rope_type", NULL, "missing required key 'rope_scaling.rope_type'");
}

Test(mdl, C2_sizes_must_be_positive_integers) {
    config_key_fails("hidden_size", "\"64\"",
                     "hidden_size: expected an integer in [1, 2147483647], got \"64\"");
    config_key_fails("hidden_size", "0",
                     "hidden_size: expected an integer in [1, 2147483647], got 0");
    config_key_fails("vocab_size", "-3",
                     "vocab_size: expected an integer in [1, 2147483647], got -3");
    config_key_fails("intermediate_size", "2147483648",
                     "intermediate_size: expected an integer in [1, 2147483647], got 2147483648");
    config_key_fails("num_hidden_layers", "2.0",
                     "num_hidden_layers: expected an integer in [1, 2147483647], got 2.0");
    config_key_fails("num_attention_heads", "null",
                     "num_attention_heads: expected an integer in [1, 2147483647], got null");
    config_key_fails("num_key_value_heads", "0",
                     "num_key_value_heads: expected an integer in [1, 2147483647], got 0");
    config_key_fails("head_dim", "[4]",
                     "head_dim: expected an integer in [1, 2147483647], got a list of 1 value");
    config_key_fails(
        "max_position_embeddings", "{}",
        "max_position_embeddings: expected an integer in [1, 2147483647], got an object");
    rope_key_fails("original_max_position_embeddings", "0",
                   "rope_scaling.original_max_position_embeddings: expected an integer in [1, "
                   "2147483647], got 0");
}

Test(mdl, C3_token_ids_must_be_non_negative_integers) {
    config_key_fails("bos_token_id", "-1",
                     "bos_token_id: expected an integer in [0, 2147483647], got -1");
    config_key_fails("bos_token_id", "true",
                     "bos_token_id: expected an integer in [0, 2147483647], got true");
    config_key_fails("eos_token_id", "[2, \"x\"]",
                     "eos_token_id[1]: expected an integer in [0, 2147483647], got \"x\"");
}

Test(mdl, C4_eos_token_id_of_the_wrong_type) {
    config_key_fails(
        "eos_token_id", "\"2\"",
        "eos_token_id: expected an integer in [0, 2147483647], a list of them, or null, got \"2\"");
    config_key_fails("eos_token_id", "-2",
                     "eos_token_id: expected an integer in [0, 2147483647], got -2");
}

Test(mdl, C5_numbers_must_be_finite_and_positive) {
    config_key_fails("rms_norm_eps", "0", "rms_norm_eps: expected a finite positive number, got 0");
    config_key_fails("rms_norm_eps", "-1e-05",
                     "rms_norm_eps: expected a finite positive number, got -1e-05");
    config_key_fails("rms_norm_eps", "\"1e-5\"",
                     "rms_norm_eps: expected a finite positive number, got \"1e-5\"");
    config_key_fails("rope_theta", "1e39",
                     "rope_theta: expected a finite positive number, got 1e+39");
    rope_key_fails("factor", "0.0",
                   "rope_scaling.factor: expected a finite positive number, got 0.0");
    rope_key_fails("low_freq_factor", "false",
                   "rope_scaling.low_freq_factor: expected a finite positive number, got false");
    rope_key_fails("high_freq_factor", "-4",
                   "rope_scaling.high_freq_factor: expected a finite positive number, got -4");
}

Test(mdl, C6_booleans) {
    config_key_fails("tie_word_embeddings", "\"yes\"",
                     "tie_word_embeddings: expected true or false, got \"yes\"");
    config_key_fails("attention_bias", "0", "attention_bias: expected true or false, got 0");
    config_key_fails("mlp_bias", "[]", "mlp_bias: expected true or false, got an empty list");
}

Test(mdl, C7_strings) {
    config_key_fails("model_type", "7", "model_type: expected a string, got 7");
    config_key_fails("hidden_act", "5", "hidden_act: expected a string, got 5");
    config_key_fails("torch_dtype", "16", "torch_dtype: expected a string, got 16");
    rope_key_fails("rope_type", "3", "rope_scaling.rope_type: expected a string, got 3");
}

Test(mdl, C8_rope_block_of_the_wrong_type) {
    config_key_fails("rope_scaling", "\"llama3\"",
                     "rope_scaling: expected an object or null, got \"llama3\"");
    config_key_fails("rope_parameters", "[]",
                     "rope_parameters: expected an object or null, got an empty list");
}

Test(mdl, C9_unsupported_model_type) {
    config_key_fails("model_type", "\"qwen2\"",
                     "model_type: unsupported model type 'qwen2' (supported: llama)");
}

Test(mdl, C10_unsupported_activation) {
    config_key_fails("hidden_act", "\"gelu\"",
                     "hidden_act: unsupported activation 'gelu' (supported: silu)");
}

Test(mdl, C11_biases_are_not_supported) {
    config_key_fails("attention_bias", "true",
                     "attention_bias: true is not supported (Llama without biases only)");
    config_key_fails("mlp_bias", "true",
                     "mlp_bias: true is not supported (Llama without biases only)");
}

Test(mdl, C12_heads_not_a_multiple_of_kv_heads) {
    config_key_fails("num_key_value_heads", "3",
                     "num_attention_heads 2 is not a multiple of num_key_value_heads 3");
}

Test(mdl, C13_hidden_size_not_divisible_without_head_dim) {
    config_key_fails(
        "hidden_size", "9",
        "hidden_size 9 is not a multiple of num_attention_heads 2 and head_dim is not given");
}

Test(mdl, C14_odd_head_dim) {
    config_key_fails("head_dim", "3", "head_dim 3 is odd (RoPE rotates pairs of dimensions)");
}

Test(mdl, C15_query_width_overflows) {
    json_t *c = cfg_base();
    cfg_set(c, "num_attention_heads", json_integer(65536));
    cfg_set(c, "head_dim", json_integer(65536));
    config_fails(c, "num_attention_heads 65536 × head_dim 65536 exceeds 2147483647");
}

Test(mdl, C16_unknown_rope_type) {
    rope_key_fails(
        "rope_type", "\"yarn\"",
        "rope_scaling.rope_type: unsupported rope type 'yarn' (supported: default, llama3)");
    json_t *c = cfg_base();
    cfg_set(c, "rope_scaling", json_pack("{s:s, s:f}", "type", "linear", "factor", 2.0));
    config_fails(c,
                 "rope_scaling.type: unsupported rope type 'linear' (supported: default, llama3)");
    c = cfg_base();
    cfg_set(c, "rope_parameters",
            json_pack("{s:s, s:f}", "rope_type", "dynamic", "rope_theta", 1e4));
    config_fails(
        c,
        "rope_parameters.rope_type: unsupported rope type 'dynamic' (supported: default, llama3)");
}

Test(mdl, C17_high_freq_factor_not_above_low) {
    json_t *c = cfg_base();
    json_t *r = json_object_get(c, "rope_scaling");
    json_object_set_new(r, "high_freq_factor", json_real(1.0));
    json_object_set_new(r, "low_freq_factor", json_real(4.0));
    config_fails(c, "rope_scaling: high_freq_factor 1 must be greater than low_freq_factor 4");
}

Test(mdl, C18_unsupported_dtype) {
    config_key_fails(
        "torch_dtype", "\"int8\"",
        "torch_dtype: unsupported dtype 'int8' (supported: float32, float16, bfloat16)");
    config_key_fails("dtype", "\"float64\"",
                     "dtype: unsupported dtype 'float64' (supported: float32, float16, bfloat16)");
}

Test(mdl, C19_token_ids_outside_the_vocabulary) {
    config_key_fails("bos_token_id", "16", "bos_token_id 16 is not below vocab_size 16");
    config_key_fails("eos_token_id", "16", "eos_token_id 16 is not below vocab_size 16");
    config_key_fails("eos_token_id", "[2, 99]", "eos_token_id[1] 99 is not below vocab_size 16");
}

/* ---- W: finding the weights ------------------------------------------------------------------ */

/* config.json plus an index with the given weight_map text (and shards written by the test). */
static void put_index(const char *text) {
    put_json("config.json", cfg_base());
    put_str("model.safetensors.index.json", text);
}

Test(mdl, W1_no_weights) {
    put_json("config.json", cfg_base());
    OPEN_FAILS(PIE_NOT_FOUND,
               "%s: no weights: neither model.safetensors nor model.safetensors.index.json exists",
               dir);
}

Test(mdl, W2_index_is_checked_as_a_json_file) {
    put_index("{\"weight_map\": {,}}");
    OPEN_FAILS(PIE_INVALID_ARGUMENT,
               "%s/model.safetensors.index.json: invalid JSON at line 1, column 17: string or '}' "
               "expected near ','",
               dir);
    put_index("[]");
    OPEN_FAILS(PIE_INVALID_ARGUMENT,
               "%s/model.safetensors.index.json: expected a JSON object at the top level", dir);
}

Test(mdl, W3_index_without_weight_map) {
    put_index("{\"metadata\": {}}");
    OPEN_FAILS(PIE_INVALID_ARGUMENT,
               "%s/model.safetensors.index.json: missing required key 'weight_map'", dir);
}

Test(mdl, W4_weight_map_not_an_object) {
    put_index("{\"weight_map\": []}");
    OPEN_FAILS(PIE_INVALID_ARGUMENT,
               "%s/model.safetensors.index.json: weight_map: expected an object, got an empty list",
               dir);
}

Test(mdl, W5_weight_map_value_not_a_string) {
    put_index("{\"weight_map\": {\"model.norm.weight\": 3}}");
    OPEN_FAILS(PIE_INVALID_ARGUMENT,
               "%s/model.safetensors.index.json: weight_map['model.norm.weight']: expected a file "
               "name, got 3",
               dir);
}

Test(mdl, W6_shard_name_must_stay_in_the_directory) {
    char longest[257]; /* 256 bytes: one more than a file name may have (shown cut at 80) */
    memset(longest, 'x', 256);
    longest[256] = '\0';
    const char *const bad[] = {"../x.safetensors", "", ".", "..", "a/b", longest};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[512];
        snprintf(text, sizeof text, "{\"weight_map\": {\"model.norm.weight\": \"%s\"}}", bad[i]);
        put_index(text);
        OPEN_FAILS(PIE_INVALID_ARGUMENT,
                   "%s/model.safetensors.index.json: weight_map['model.norm.weight']: shard name "
                   "'%.80s' is not a plain file name",
                   dir, bad[i]);
    }
}

Test(mdl, W7_index_names_a_missing_shard) {
    tset s;
    tset_std(&s, "F32", 1);
    put_st("model-00001-of-00002.safetensors", &s, 0);
    put_index(
        "{\"weight_map\": {\"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\","
        " \"model.norm.weight\": \"model-00002-of-00002.safetensors\"}}");
    OPEN_FAILS(PIE_NOT_FOUND,
               "%s/model-00002-of-00002.safetensors: cannot open: No such file or directory (named "
               "by model.safetensors.index.json)",
               dir);
}

/* ---- S: one safetensors file ----------------------------------------------------------------- */

/* config.json + model.safetensors with the given header text and data bytes. */
static void put_single_raw(const char *header, size_t data_len) {
    put_json("config.json", cfg_base());
    put_raw_st("model.safetensors", header, data_len);
}

#define ST_FAILS(...) OPEN_FAILS(PIE_INVALID_ARGUMENT, __VA_ARGS__)

Test(mdl, S1_weights_not_a_regular_file) {
    put_json("config.json", cfg_base());
    char path[128];
    path_of(path, sizeof path, "model.safetensors");
    cr_assert_eq(mkdir(path, 0755), 0);
    ST_FAILS("%s/model.safetensors: not a regular file", dir);
    cr_assert_eq(rmdir(path), 0);
    cr_assert_eq(mkfifo(path, 0644), 0);
    ST_FAILS("%s/model.safetensors: not a regular file", dir);
}

Test(mdl, S2_truncated_header_length) {
    put_json("config.json", cfg_base());
    put("model.safetensors", "\x10\0\0\0\0", 5);
    ST_FAILS("%s/model.safetensors: file is 5 bytes, too short for the 8-byte header length", dir);
}

Test(mdl, S3_header_length_larger_than_the_file) {
    put_json("config.json", cfg_base());
    uint8_t buf[800] = {0};
    uint64_t n = 1234567;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(n >> (8 * i));
    put("model.safetensors", buf, sizeof buf);
    ST_FAILS("%s/model.safetensors: header length 1234567 exceeds the file size 800", dir);
    /* one byte more than fits */
    n = 793;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(n >> (8 * i));
    put("model.safetensors", buf, sizeof buf);
    ST_FAILS("%s/model.safetensors: header length 793 exceeds the file size 800", dir);
}

Test(mdl, S4_header_bad_json) {
    put_single_raw("{\"a\": {\"dtype\": \"F32\",}", 0);
    ST_FAILS("%s/model.safetensors: header is not valid JSON at line 1, column 23: string or '}' "
             "expected near '}'",
             dir);
}

Test(mdl, S4_duplicate_tensor_names) {
    put_single_raw("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
                   "\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
                   8);
    ST_FAILS("%s/model.safetensors: header is not valid JSON at line 1, column 65: duplicate "
             "object key near '\"a\"'",
             dir);
}

Test(mdl, S5_header_not_an_object) {
    put_single_raw("[]", 0);
    ST_FAILS("%s/model.safetensors: header is not a JSON object", dir);
}

Test(mdl, S6_tensor_entry_not_an_object) {
    put_single_raw("{\"w\": 3}", 0);
    ST_FAILS("%s/model.safetensors: tensor 'w': expected an object with dtype, shape and "
             "data_offsets, got 3",
             dir);
}

Test(mdl, S7_tensor_entry_missing_a_field) {
    put_single_raw("{\"w\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
    ST_FAILS("%s/model.safetensors: tensor 'w': missing 'dtype'", dir);
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4);
    ST_FAILS("%s/model.safetensors: tensor 'w': missing 'shape'", dir);
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4);
    ST_FAILS("%s/model.safetensors: tensor 'w': missing 'data_offsets'", dir);
}

Test(mdl, S8_dtype_not_a_string) {
    put_single_raw("{\"w\": {\"dtype\": 4, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
    ST_FAILS("%s/model.safetensors: tensor 'w': dtype: expected a string, got 4", dir);
}

Test(mdl, S9_unknown_dtype) {
    put_single_raw("{\"w\": {\"dtype\": \"Q4\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4);
    ST_FAILS("%s/model.safetensors: tensor 'w': unknown dtype 'Q4'", dir);
}

Test(mdl, S10_shape_not_a_list) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": \"2x2\", \"data_offsets\": [0, 16]}}",
                   16);
    ST_FAILS("%s/model.safetensors: tensor 'w': shape: expected a list of non-negative integers, "
             "got \"2x2\"",
             dir);
}

Test(mdl, S11_too_many_dimensions) {
    put_single_raw(
        "{\"w\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}}",
        4);
    ST_FAILS("%s/model.safetensors: tensor 'w': shape has 9 dimensions (at most 8 supported)", dir);
}

Test(mdl, S12_negative_dimension) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [2, -1], \"data_offsets\": [0, 4]}}",
                   4);
    ST_FAILS("%s/model.safetensors: tensor 'w': shape[1]: expected a non-negative integer, got -1",
             dir);
}

Test(mdl, S13_data_offsets_not_a_pair) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", 4);
    ST_FAILS("%s/model.safetensors: tensor 'w': data_offsets: expected a list of 2 integers "
             "[begin, end], got a list of 1 value",
             dir);
}

Test(mdl, S14_negative_data_offset) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-1, 4]}}", 4);
    ST_FAILS("%s/model.safetensors: tensor 'w': data_offsets[0]: expected a non-negative integer, "
             "got -1",
             dir);
}

Test(mdl, S15_data_offsets_reversed) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}", 8);
    ST_FAILS("%s/model.safetensors: tensor 'w': data_offsets [8, 4]: begin is after end", dir);
}

Test(mdl, S16_data_offsets_out_of_range) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [1024], \"data_offsets\": [0, 4096]}}",
                   1024);
    ST_FAILS(
        "%s/model.safetensors: tensor 'w': data_offsets [0, 4096] exceed the 1024 bytes of data",
        dir);
}

Test(mdl, S17_shape_size_overflows) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], "
                   "\"data_offsets\": [0, 4]}}",
                   4);
    ST_FAILS("%s/model.safetensors: tensor 'w': shape [4294967296, 4294967296] of F32 overflows "
             "64-bit sizes",
             dir);
}

Test(mdl, S18_shape_times_dtype_differs_from_the_byte_length) {
    put_single_raw("{\"w\": {\"dtype\": \"F32\", \"shape\": [4, 8], \"data_offsets\": [0, 64]}}",
                   64);
    ST_FAILS("%s/model.safetensors: tensor 'w': shape [4, 8] of F32 is 128 bytes, but data_offsets "
             "[0, 64] span 64",
             dir);
}

Test(mdl, S19_overlapping_tensors) {
    put_single_raw("{\"a\": {\"dtype\": \"F32\", \"shape\": [32], \"data_offsets\": [0, 128]},"
                   " \"e\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [100, 100]},"
                   " \"b\": {\"dtype\": \"F32\", \"shape\": [32], \"data_offsets\": [64, 192]}}",
                   192);
    ST_FAILS("%s/model.safetensors: tensor 'b': data_offsets [64, 192] overlap tensor 'a' [0, 128]",
             dir);
}

/* ---- B: binding ------------------------------------------------------------------------------ */

Test(mdl, B1_missing_tensor) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 1);
    tset_drop(&s, "model.norm.weight");
    put_st("model.safetensors", &s, 0);
    ST_FAILS("%s/model.safetensors: missing tensor 'model.norm.weight'", dir);
}

Test(mdl, B1_untied_model_without_lm_head) {
    json_t *c = cfg_base();
    cfg_set(c, "tie_word_embeddings", json_false());
    put_json("config.json", c);
    tset s;
    tset_std(&s, "F32", 1);
    put_st("model.safetensors", &s, 0);
    ST_FAILS("%s/model.safetensors: missing tensor 'lm_head.weight'", dir);
}

/* Writes s split in two shards (first half / second half) and an index naming all but
 * `unlisted` (may be NULL). */
static void put_sharded(const tset *s, const char *unlisted) {
    tset a = {.n = 0}, b = {.n = 0};
    json_t *wm = json_object();
    for (int i = 0; i < s->n; i++) {
        int first = i < s->n / 2;
        tset *dst = first ? &a : &b;
        dst->t[dst->n++] = s->t[i];
        if (unlisted == NULL || strcmp(unlisted, s->t[i].name) != 0)
            json_object_set_new(wm, s->t[i].name,
                                json_string(first ? "model-00001-of-00002.safetensors"
                                                  : "model-00002-of-00002.safetensors"));
    }
    put_st("model-00001-of-00002.safetensors", &a, 0);
    put_st("model-00002-of-00002.safetensors", &b, 0);
    put_json("model.safetensors.index.json",
             json_pack("{s:{s:i}, s:o}", "metadata", "total_size", 0, "weight_map", wm));
}

Test(mdl, B2_tensor_not_in_weight_map) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 1);
    put_sharded(&s, "model.layers.1.mlp.up_proj.weight");
    ST_FAILS("%s/model.safetensors.index.json: missing tensor 'model.layers.1.mlp.up_proj.weight' "
             "(not in weight_map)",
             dir);
}

Test(mdl, B3_shard_lacks_the_tensor_the_index_maps_to_it) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 1);
    put_sharded(&s, NULL);
    /* rewrite shard 2 without model.norm.weight (the last tensor) */
    tset b = {.n = 0};
    for (int i = s.n / 2; i < s.n - 1; i++) b.t[b.n++] = s.t[i];
    put_st("model-00002-of-00002.safetensors", &b, 0);
    ST_FAILS("%s/model-00002-of-00002.safetensors: missing tensor 'model.norm.weight' "
             "(model.safetensors.index.json maps it to this file)",
             dir);
}

Test(mdl, B4_bound_tensor_of_an_unsupported_dtype) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 1);
    snprintf(tset_find(&s, "model.layers.0.input_layernorm.weight")->dtype, 16, "I8");
    put_st("model.safetensors", &s, 0);
    ST_FAILS("%s/model.safetensors: tensor 'model.layers.0.input_layernorm.weight' has dtype I8 "
             "(supported: F32, F16, BF16)",
             dir);
}

Test(mdl, B5_wrong_shape) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 1);
    tset_find(&s, "model.layers.0.mlp.up_proj.weight")->shape[0] = 6;
    put_st("model.safetensors", &s, 0);
    ST_FAILS("%s/model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' has shape [6, 8], "
             "expected [12, 8]",
             dir);
}

Test(mdl, B5_vector_stored_as_a_matrix) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 1);
    tt *t = tset_find(&s, "model.norm.weight");
    t->ndim = 2;
    t->shape[1] = 1;
    put_st("model.safetensors", &s, 0);
    ST_FAILS("%s/model.safetensors: tensor 'model.norm.weight' has shape [8, 1], expected [8]",
             dir);
}

Test(mdl, B5_shapes_follow_the_config) {
    /* the file is right for num_key_value_heads 1; the config now says 2 */
    json_t *c = cfg_base();
    cfg_set(c, "num_key_value_heads", json_integer(2));
    put_json("config.json", c);
    tset s;
    tset_std(&s, "F32", 1);
    put_st("model.safetensors", &s, 0);
    ST_FAILS("%s/model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape "
             "[4, 8], expected [8, 8]",
             dir);
}

Test(mdl, B6_mixed_dtypes) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "BF16", 1);
    snprintf(tset_find(&s, "model.layers.1.self_attn.o_proj.weight")->dtype, 16, "F16");
    put_st("model.safetensors", &s, 0);
    ST_FAILS("%s/model.safetensors: tensor 'model.layers.1.self_attn.o_proj.weight' has dtype F16, "
             "but 'model.embed_tokens.weight' has BF16 (all weights must share one dtype)",
             dir);
}

/* ---- successful loads of C-written models ---------------------------------------------------- */

/* 1 if t's bytes lie inside one of m's mappings. */
static int in_maps(const mdl_model *m, const mdl_tensor *t) {
    uintptr_t p = (uintptr_t)t->data;
    size_t bytes = (size_t)t->rows * t->cols * mdl_dtype_size(t->dtype);
    for (int i = 0; i < m->n_maps; i++) {
        uintptr_t b = (uintptr_t)m->maps[i];
        if (p >= b && p + bytes <= b + m->map_lens[i]) return 1;
    }
    return 0;
}

/* Calls fn on every bound tensor of m with its HF name. */
static void each_tensor(const mdl_model *m,
                        void (*fn)(const mdl_model *, const char *, const mdl_tensor *, void *),
                        void *arg) {
    char n[128];
    fn(m, "model.embed_tokens.weight", &m->embed, arg);
    for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
        const mdl_layer *y = &m->layers[l];
        const struct {
            const char *s;
            const mdl_tensor *t;
        } w[] = {{"input_layernorm.weight", &y->attn_norm},
                 {"self_attn.q_proj.weight", &y->wq},
                 {"self_attn.k_proj.weight", &y->wk},
                 {"self_attn.v_proj.weight", &y->wv},
                 {"self_attn.o_proj.weight", &y->wo},
                 {"post_attention_layernorm.weight", &y->ffn_norm},
                 {"mlp.gate_proj.weight", &y->w_gate},
                 {"mlp.up_proj.weight", &y->w_up},
                 {"mlp.down_proj.weight", &y->w_down}};
        for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
            snprintf(n, sizeof n, "model.layers.%u.%s", l, w[i].s);
            fn(m, n, w[i].t, arg);
        }
    }
    fn(m, "model.norm.weight", &m->norm, arg);
    if (!m->cfg.tie_word_embeddings) fn(m, "lm_head.weight", &m->lm_head, arg);
}

static void check_mapped(const mdl_model *m, const char *name, const mdl_tensor *t, void *arg) {
    (void)arg;
    cr_assert(in_maps(m, t), "tensor %s is not inside the mapped files", name);
    cr_assert_eq((uintptr_t)t->data % mdl_dtype_size(t->dtype), 0, "tensor %s misaligned", name);
}

/* The k-th tensor of the C-written file holds tval(k, j); checks a few elements. */
typedef struct value_check {
    int k;
} value_check;

static void check_values(const mdl_model *m, const char *name, const mdl_tensor *t, void *arg) {
    (void)m;
    value_check *vc = arg;
    size_t n = (size_t)t->rows * t->cols;
    for (size_t j = 0; j < n; j++)
        cr_assert_eq(mdl_tensor_at(t, j), tval(vc->k, j), "%s[%zu] = %g, want %g", name, j,
                     (double)mdl_tensor_at(t, j), (double)tval(vc->k, j));
    vc->k++;
}

static size_t expected_weight_bytes(const mdl_config *c) {
    size_t d = c->hidden_size, q = (size_t)c->n_heads * c->head_dim,
           kv = (size_t)c->n_kv_heads * c->head_dim, f = c->intermediate_size, v = c->vocab_size;
    size_t per_layer = 2 * d + 2 * q * d + 2 * kv * d + 3 * f * d;
    size_t n = v * d * (c->tie_word_embeddings ? 1 : 2) + c->n_layers * per_layer + d;
    return n * mdl_dtype_size(c->dtype);
}

Test(mdl, c_model_loads_with_every_value_and_shape) {
    put_model();
    mdl_model *m = open_ok(dir);
    const mdl_config *c = &m->cfg;
    cr_assert_str_eq(m->dir, dir);
    cr_assert_str_eq(c->architecture, "llama");
    cr_assert_eq(c->vocab_size, V);
    cr_assert_eq(c->hidden_size, D);
    cr_assert_eq(c->intermediate_size, FFN);
    cr_assert_eq(c->n_layers, L);
    cr_assert_eq(c->n_heads, H);
    cr_assert_eq(c->n_kv_heads, KV);
    cr_assert_eq(c->head_dim, HD);
    cr_assert_eq(c->max_position, 64);
    cr_assert_eq(c->rms_eps, 1e-5f);
    cr_assert_eq(c->rope_theta, 10000.0f);
    cr_assert_eq(c->rope_factor, 8.0f);
    cr_assert_eq(c->rope_low_freq_factor, 1.0f);
    cr_assert_eq(c->rope_high_freq_factor, 4.0f);
    cr_assert_eq(c->rope_orig_max_position, 32);
    cr_assert_eq(c->tie_word_embeddings, 1);
    cr_assert_eq(c->dtype, MDL_F32);
    cr_assert_eq(c->dtype_declared, 1);
    cr_assert_eq(c->bos_token_id, 1);
    cr_assert_eq(c->eos_token_id, 2);
    cr_assert_eq(c->n_eos_token_ids, 2);
    cr_assert_eq(c->eos_token_ids[0], 2);
    cr_assert_eq(c->eos_token_ids[1], 3);

    cr_assert_eq(m->embed.rows, V);
    cr_assert_eq(m->embed.cols, D);
    cr_assert_eq(m->layers[1].wq.rows, H * HD);
    cr_assert_eq(m->layers[1].wk.rows, KV * HD);
    cr_assert_eq(m->layers[1].wo.cols, H * HD);
    cr_assert_eq(m->layers[1].w_down.rows, D);
    cr_assert_eq(m->layers[1].w_down.cols, FFN);
    cr_assert_eq(m->layers[0].attn_norm.rows, D);
    cr_assert_eq(m->layers[0].attn_norm.cols, 1);
    cr_assert_eq(m->norm.rows, D);
    cr_assert_eq(m->lm_head.data, m->embed.data, "tied: lm_head is the embedding");
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(c));
    cr_assert_eq(m->weight_bytes,
                 (size_t)(V * D + L * (2 * D + 2 * 8 * D + 2 * 4 * D + 3 * FFN * D) + D) * 4);
    cr_assert_eq(m->n_maps, 1);
    cr_assert_eq(m->n_copied, 0);
    cr_assert_eq(m->copied_bytes, 0);
    each_tensor(m, check_mapped, NULL);
    value_check vc = {0};
    each_tensor(m, check_values, &vc);
    mdl_close(m);
}

Test(mdl, config_load_needs_no_weights_and_trailing_slashes_are_dropped) {
    put_json("config.json", cfg_base());
    char path[128];
    snprintf(path, sizeof path, "%s//", dir);
    mdl_config c;
    pie_status st;
    cr_assert_eq(mdl_config_load(path, &c, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(c.hidden_size, D);
    tset s;
    tset_std(&s, "F32", 1);
    put_st("model.safetensors", &s, 0);
    mdl_model *m = open_ok(path);
    cr_assert_str_eq(m->dir, dir);
    mdl_close(m);
    mdl_close(NULL);
}

Test(mdl, defaults_of_optional_keys) {
    json_t *c = cfg_base();
    static const char *const optional[] = {"num_key_value_heads", "max_position_embeddings",
                                           "rms_norm_eps",        "rope_theta",
                                           "rope_scaling",        "tie_word_embeddings",
                                           "torch_dtype",         "bos_token_id",
                                           "eos_token_id",        "hidden_act",
                                           "architectures"};
    for (size_t i = 0; i < sizeof optional / sizeof optional[0]; i++)
        cr_assert_eq(json_object_del(c, optional[i]), 0, "%s", optional[i]);
    put_json("config.json", c);
    mdl_config cfg;
    pie_status st;
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.n_kv_heads, H);
    cr_assert_eq(cfg.max_position, 2048);
    cr_assert_eq(cfg.rms_eps, 1e-6f);
    cr_assert_eq(cfg.rope_theta, 10000.0f);
    cr_assert_eq(cfg.rope_factor, 0.0f);
    cr_assert_eq(cfg.rope_orig_max_position, 0);
    cr_assert_eq(cfg.tie_word_embeddings, 0);
    cr_assert_eq(cfg.dtype, MDL_F32);
    cr_assert_eq(cfg.dtype_declared, 0);
    cr_assert_eq(cfg.bos_token_id, -1);
    cr_assert_eq(cfg.eos_token_id, -1);
    cr_assert_eq(cfg.n_eos_token_ids, 0);
}

Test(mdl, rope_scaling_null_and_default_mean_no_scaling) {
    json_t *c = cfg_base();
    cfg_set(c, "rope_scaling", json_null());
    cfg_set(c, "head_dim", json_null()); /* null = absent */
    put_json("config.json", c);
    mdl_config cfg;
    pie_status st;
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.rope_factor, 0.0f);
    cr_assert_eq(cfg.head_dim, HD);

    c = cfg_base();
    cfg_set(c, "rope_scaling", json_pack("{s:s}", "rope_type", "default"));
    put_json("config.json", c);
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.rope_factor, 0.0f);
    cr_assert_eq(cfg.rope_low_freq_factor, 0.0f);
    cr_assert_eq(cfg.rope_orig_max_position, 0);
}

Test(mdl, rope_scaling_with_type_key) {
    json_t *c = cfg_base();
    cfg_set(c, "rope_scaling",
            json_pack("{s:s, s:f, s:f, s:f, s:i}", "type", "llama3", "factor", 32.0,
                      "low_freq_factor", 1.0, "high_freq_factor", 4.0,
                      "original_max_position_embeddings", 8192));
    put_json("config.json", c);
    mdl_config cfg;
    pie_status st;
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.rope_factor, 32.0f);
    cr_assert_eq(cfg.rope_orig_max_position, 8192);
}

Test(mdl, rope_parameters_win_over_rope_scaling_and_carry_rope_theta) {
    json_t *c = cfg_base(); /* rope_scaling: factor 8, orig 32; rope_theta 10000 */
    cfg_set(c, "rope_parameters",
            json_pack("{s:s, s:f, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "rope_theta",
                      500000.0, "factor", 32.0, "low_freq_factor", 2.0, "high_freq_factor", 8.0,
                      "original_max_position_embeddings", 8192));
    put_json("config.json", c);
    mdl_config cfg;
    pie_status st;
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.rope_theta, 500000.0f);
    cr_assert_eq(cfg.rope_factor, 32.0f);
    cr_assert_eq(cfg.rope_low_freq_factor, 2.0f);
    cr_assert_eq(cfg.rope_high_freq_factor, 8.0f);
    cr_assert_eq(cfg.rope_orig_max_position, 8192);

    /* rope_parameters without rope_theta: the top-level one */
    c = cfg_base();
    cfg_set(c, "rope_parameters", json_pack("{s:s}", "rope_type", "default"));
    put_json("config.json", c);
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.rope_theta, 10000.0f);
    cr_assert_eq(cfg.rope_factor, 0.0f);
}

Test(mdl, eos_forms) {
    json_t *c = cfg_base();
    cfg_set(c, "eos_token_id", json_integer(7));
    put_json("config.json", c);
    mdl_config cfg;
    pie_status st;
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.eos_token_id, 7);
    cr_assert_eq(cfg.n_eos_token_ids, 1);
    cr_assert_eq(cfg.eos_token_ids[0], 7);

    c = cfg_base();
    cfg_set(c, "eos_token_id", json_pack("[i,i,i,i,i,i,i,i,i,i]", 9, 1, 2, 3, 4, 5, 6, 7, 8, 15));
    cfg_set(c, "bos_token_id", json_null());
    put_json("config.json", c);
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.bos_token_id, -1);
    cr_assert_eq(cfg.eos_token_id, 9);
    cr_assert_eq(cfg.n_eos_token_ids, MDL_MAX_EOS);
    cr_assert_eq(cfg.eos_token_ids[7], 7);

    c = cfg_base();
    cfg_set(c, "eos_token_id", json_array());
    put_json("config.json", c);
    cr_assert_eq(mdl_config_load(dir, &cfg, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(cfg.eos_token_id, -1);
    cr_assert_eq(cfg.n_eos_token_ids, 0);
}

Test(mdl, explicit_head_dim_sets_the_projection_shapes) {
    json_t *c = cfg_base();
    cfg_set(c, "head_dim", json_integer(6)); /* q: 2*6 = 12 rows, k/v: 6 rows, o: 12 cols */
    put_json("config.json", c);
    tset s;
    tset_std(&s, "F32", 1);
    for (int l = 0; l < L; l++) {
        char n[96];
        snprintf(n, sizeof n, "model.layers.%d.self_attn.q_proj.weight", l);
        tset_find(&s, n)->shape[0] = 12;
        snprintf(n, sizeof n, "model.layers.%d.self_attn.k_proj.weight", l);
        tset_find(&s, n)->shape[0] = 6;
        snprintf(n, sizeof n, "model.layers.%d.self_attn.v_proj.weight", l);
        tset_find(&s, n)->shape[0] = 6;
        snprintf(n, sizeof n, "model.layers.%d.self_attn.o_proj.weight", l);
        tset_find(&s, n)->shape[1] = 12;
    }
    put_st("model.safetensors", &s, 0);
    mdl_model *m = open_ok(dir);
    cr_assert_eq(m->cfg.head_dim, 6);
    cr_assert_eq(m->layers[0].wq.rows, 12);
    cr_assert_eq(m->layers[0].wk.rows, 6);
    cr_assert_eq(m->layers[0].wo.cols, 12);
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    mdl_close(m);
}

Test(mdl, untied_model_binds_lm_head) {
    json_t *c = cfg_base();
    cfg_set(c, "tie_word_embeddings", json_false());
    put_json("config.json", c);
    tset s;
    tset_std(&s, "F32", 0);
    put_st("model.safetensors", &s, 0);
    mdl_model *m = open_ok(dir);
    cr_assert_neq(m->lm_head.data, m->embed.data);
    cr_assert_eq(m->lm_head.rows, V);
    cr_assert_eq(mdl_tensor_at(&m->lm_head, 5), tval(s.n - 1, 5));
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    each_tensor(m, check_mapped, NULL);
    mdl_close(m);
}

Test(mdl, tied_model_ignores_a_stored_lm_head_and_unused_tensors) {
    put_json("config.json", cfg_base());
    tset s;
    tset_std(&s, "F32", 0); /* lm_head.weight present although tied */
    tset_add(&s, "model.layers.0.self_attn.rotary_emb.inv_freq", "F32", 1, 2, 0);
    tset_add(&s, "extra.int8_table", "I8", 2, 3, 5); /* unused: its dtype does not matter */
    tset_add(&s, "extra.empty", "F64", 1, 0, 0);
    put_st("model.safetensors", &s, 0);
    mdl_model *m = open_ok(dir);
    cr_assert_eq(m->lm_head.data, m->embed.data);
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    mdl_close(m);
}

Test(mdl, config_dtype_differing_from_the_weights_reports_the_weights) {
    put_json("config.json", cfg_base()); /* torch_dtype float32 */
    tset s;
    tset_std(&s, "BF16", 1);
    put_st("model.safetensors", &s, 0);
    mdl_config c;
    pie_status st;
    cr_assert_eq(mdl_config_load(dir, &c, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(c.dtype, MDL_F32);
    mdl_model *m = open_ok(dir);
    cr_assert_eq(m->cfg.dtype, MDL_BF16);
    cr_assert_eq(m->cfg.dtype_declared, 1);
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    value_check vc = {0};
    each_tensor(m, check_values, &vc);
    mdl_close(m);
}

Test(mdl, f16_weights_widen_exactly) {
    json_t *c = cfg_base();
    cfg_set(c, "torch_dtype", json_string("float16"));
    put_json("config.json", c);
    tset s;
    tset_std(&s, "F16", 1);
    put_st("model.safetensors", &s, 0);
    mdl_model *m = open_ok(dir);
    cr_assert_eq(m->cfg.dtype, MDL_F16);
    value_check vc = {0};
    each_tensor(m, check_values, &vc);
    mdl_close(m);
}

static void check_copied(const mdl_model *m, const char *name, const mdl_tensor *t, void *arg) {
    (void)arg;
    cr_assert(!in_maps(m, t), "misaligned tensor %s was not copied", name);
    cr_assert_eq((uintptr_t)t->data % 64, 0, "copy of %s is not 64-byte aligned", name);
}

Test(mdl, misaligned_tensors_are_copied_once_and_counted) {
    static const char *const dtypes[] = {"F32", "BF16"};
    for (int i = 0; i < 2; i++) {
        put_json("config.json", cfg_base());
        tset s;
        tset_std(&s, dtypes[i], 1);
        put_st("model.safetensors", &s, 3); /* data starts at an odd offset */
        mdl_model *m = open_ok(dir);
        cr_assert_eq(m->n_copied, s.n, "%s: %d copied, want %d", dtypes[i], m->n_copied, s.n);
        cr_assert_eq(m->copied_bytes, m->weight_bytes);
        each_tensor(m, check_copied, NULL);
        value_check vc = {0};
        each_tensor(m, check_values, &vc);
        mdl_close(m);
    }
}

Test(mdl, sharded_c_model_loads) {
    json_t *c = cfg_base();
    cfg_set(c, "tie_word_embeddings", json_false());
    put_json("config.json", c);
    tset s;
    tset_std(&s, "F32", 0);
    put_sharded(&s, NULL);
    mdl_model *m = open_ok(dir);
    cr_assert_eq(m->n_maps, 2);
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    each_tensor(m, check_mapped, NULL);
    mdl_close(m);
}

/* ---- models generated by tools/tinymodel ----------------------------------------------------- */

static void model_path(char *buf, size_t n, const char *name) {
    int k = snprintf(buf, n, "%s/%s", PIE_MODELS_DIR, name);
    cr_assert(k > 0 && (size_t)k < n);
}

static mdl_model *open_generated(const char *name) {
    char path[512];
    model_path(path, sizeof path, name);
    return open_ok(path);
}

/* From the model's tokenizer.json: the number of ids, and the id of a special token. */
static uint32_t tokenizer_ids(const char *name) {
    char path[512];
    model_path(path, sizeof path, name);
    strcat(path, "/tokenizer.json");
    json_error_t e;
    json_t *tok = json_load_file(path, 0, &e);
    cr_assert_not_null(tok, "%s: %s", path, e.text);
    json_int_t max = -1;
    const char *k;
    json_t *v;
    json_object_foreach(json_object_get(json_object_get(tok, "model"), "vocab"), k, v) {
        if (json_integer_value(v) > max) max = json_integer_value(v);
    }
    size_t i;
    json_array_foreach(json_object_get(tok, "added_tokens"), i, v) {
        json_int_t id = json_integer_value(json_object_get(v, "id"));
        if (id > max) max = id;
    }
    json_decref(tok);
    return (uint32_t)(max + 1);
}

/* The id of special token content in the model's tokenizer.json, -1 when it has none. */
static int32_t find_special(const char *name, const char *content) {
    char path[512];
    model_path(path, sizeof path, name);
    strcat(path, "/tokenizer.json");
    json_error_t e;
    json_t *tok = json_load_file(path, 0, &e);
    cr_assert_not_null(tok, "%s: %s", path, e.text);
    size_t i;
    json_t *v;
    int32_t id = -1;
    json_array_foreach(json_object_get(tok, "added_tokens"), i, v) {
        if (strcmp(json_string_value(json_object_get(v, "content")), content) == 0)
            id = (int32_t)json_integer_value(json_object_get(v, "id"));
    }
    json_decref(tok);
    return id;
}

static int32_t special_id(const char *name, const char *content) {
    int32_t id = find_special(name, content);
    cr_assert_geq(id, 0, "%s/tokenizer.json has no special token %s", name, content);
    return id;
}

/* The tiny preset (tools/tinymodel/gen_tiny_model.py). */
static void assert_tiny_config(const mdl_config *c, const char *name) {
    cr_assert_str_eq(c->architecture, "llama");
    cr_assert_eq(c->vocab_size, tokenizer_ids(name), "vocab_size is the tokenizer's size");
    cr_assert_eq(c->hidden_size, 64);
    cr_assert_eq(c->intermediate_size, 172);
    cr_assert_eq(c->n_layers, 2);
    cr_assert_eq(c->n_heads, 4);
    cr_assert_eq(c->n_kv_heads, 2);
    cr_assert_eq(c->head_dim, 16);
    cr_assert_eq(c->max_position, 2048);
    cr_assert_eq(c->rms_eps, 1e-5f);
    cr_assert_eq(c->rope_theta, 10000.0f);
    cr_assert_eq(c->rope_factor, 8.0f);
    cr_assert_eq(c->rope_low_freq_factor, 1.0f);
    cr_assert_eq(c->rope_high_freq_factor, 4.0f);
    cr_assert_eq(c->rope_orig_max_position, 256);
    cr_assert_eq(c->dtype_declared, 1);
}

static void assert_llama3_specials(const mdl_config *c, const char *name) {
    cr_assert_eq(c->bos_token_id, special_id(name, "<|begin_of_text|>"));
    cr_assert_eq(c->n_eos_token_ids, 2);
    cr_assert_eq(c->eos_token_id, special_id(name, "<|end_of_text|>"));
    cr_assert_eq(c->eos_token_ids[1], special_id(name, "<|eot_id|>"));
}

Test(mdl, generated_tiny_f32) {
    mdl_model *m = open_generated("tiny-f32");
    assert_tiny_config(&m->cfg, "tiny-f32");
    assert_llama3_specials(&m->cfg, "tiny-f32");
    cr_assert_eq(m->cfg.dtype, MDL_F32);
    cr_assert_eq(m->cfg.tie_word_embeddings, 1);
    cr_assert_eq(m->lm_head.data, m->embed.data);
    cr_assert_eq(m->n_maps, 1);
    cr_assert_eq(m->n_copied, 0, "the generator aligns every tensor");
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    each_tensor(m, check_mapped, NULL);
    /* norm weights are 1 ± small noise, projections are centred */
    for (uint32_t i = 0; i < m->norm.rows; i++) {
        float w = mdl_tensor_at(&m->norm, i);
        cr_assert(w > 0.75f && w < 1.25f, "model.norm.weight[%u] = %g", i, (double)w);
    }
    double sum = 0;
    size_t n = (size_t)m->layers[0].wq.rows * m->layers[0].wq.cols;
    for (size_t i = 0; i < n; i++) sum += mdl_tensor_at(&m->layers[0].wq, i);
    cr_assert(fabs(sum / (double)n) < 0.02, "q_proj mean %g", sum / (double)n);
    mdl_close(m);
}

/* Pairs a generated model with tiny-f32 (same seed): tensor by tensor. */
typedef struct pair_check {
    const mdl_model *ref;
    int mode; /* 0: identical bytes; 1: bf16 = RNE(f32); 2: f16 nearest to f32 */
} pair_check;

static const mdl_tensor *tensor_by_name(const mdl_model *m, const char *name) {
    if (strcmp(name, "model.embed_tokens.weight") == 0) return &m->embed;
    if (strcmp(name, "model.norm.weight") == 0) return &m->norm;
    unsigned l;
    char suffix[64];
    cr_assert_eq(sscanf(name, "model.layers.%u.%63s", &l, suffix), 2, "%s", name);
    const mdl_layer *y = &m->layers[l];
    const struct {
        const char *s;
        const mdl_tensor *t;
    } w[] = {{"input_layernorm.weight", &y->attn_norm},
             {"self_attn.q_proj.weight", &y->wq},
             {"self_attn.k_proj.weight", &y->wk},
             {"self_attn.v_proj.weight", &y->wv},
             {"self_attn.o_proj.weight", &y->wo},
             {"post_attention_layernorm.weight", &y->ffn_norm},
             {"mlp.gate_proj.weight", &y->w_gate},
             {"mlp.up_proj.weight", &y->w_up},
             {"mlp.down_proj.weight", &y->w_down}};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (strcmp(w[i].s, suffix) == 0) return w[i].t;
    cr_assert_fail("unknown tensor %s", name);
    return NULL;
}

static uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float f16_value(uint16_t h) {
    mdl_tensor t = {.data = &h, .dtype = MDL_F16, .rows = 1, .cols = 1};
    return mdl_tensor_at(&t, 0);
}

static void check_pair(const mdl_model *m, const char *name, const mdl_tensor *t, void *arg) {
    pair_check *pc = arg;
    (void)m;
    if (strcmp(name, "lm_head.weight") == 0) return; /* tiny-f32 is tied */
    const mdl_tensor *r = tensor_by_name(pc->ref, name);
    cr_assert_eq(t->rows, r->rows);
    cr_assert_eq(t->cols, r->cols);
    size_t n = (size_t)t->rows * t->cols;
    if (pc->mode == 0) {
        cr_assert_eq(memcmp(t->data, r->data, n * 4), 0, "%s differs from tiny-f32", name);
        return;
    }
    const uint16_t *h = t->data;
    for (size_t i = 0; i < n; i++) {
        float x = mdl_tensor_at(r, i);
        if (pc->mode == 1) {
            cr_assert_eq(h[i], bf16_rne(x), "%s[%zu]: bf16 %#06x, RNE(%a) = %#06x", name, i, h[i],
                         (double)x, bf16_rne(x));
        } else {
            /* no f16 neighbour is nearer to x */
            float e = fabsf(f16_value(h[i]) - x);
            cr_assert(fabsf(f16_value((uint16_t)(h[i] + 1)) - x) >= e &&
                          fabsf(f16_value((uint16_t)(h[i] - 1)) - x) >= e,
                      "%s[%zu]: f16 %#06x is not the nearest to %a", name, i, h[i], (double)x);
        }
    }
}

static void check_against_tiny_f32(const char *name, mdl_dtype dtype, int mode) {
    mdl_model *ref = open_generated("tiny-f32");
    mdl_model *m = open_generated(name);
    assert_tiny_config(&m->cfg, name);
    assert_llama3_specials(&m->cfg, name);
    cr_assert_eq(m->cfg.dtype, dtype);
    cr_assert_eq(m->cfg.vocab_size, ref->cfg.vocab_size);
    cr_assert_eq(m->n_copied, 0);
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    each_tensor(m, check_mapped, NULL);
    pair_check pc = {ref, mode};
    each_tensor(m, check_pair, &pc);
    mdl_close(m);
    mdl_close(ref);
}

Test(mdl, generated_tiny_bf16_is_tiny_f32_rounded_to_nearest_even) {
    check_against_tiny_f32("tiny-bf16", MDL_BF16, 1);
}

Test(mdl, generated_tiny_f16_is_tiny_f32_rounded_to_nearest) {
    check_against_tiny_f32("tiny-f16", MDL_F16, 2);
}

Test(mdl, generated_tiny_sharded_untied_rope_parameters) {
    check_against_tiny_f32("tiny-sharded", MDL_F32, 0);
    mdl_model *m = open_generated("tiny-sharded");
    cr_assert_eq(m->n_maps, 2);
    cr_assert_eq(m->cfg.tie_word_embeddings, 0);
    cr_assert_neq(m->lm_head.data, m->embed.data);
    cr_assert_eq(m->lm_head.rows, m->cfg.vocab_size);
    mdl_close(m);
}

Test(mdl, generated_tiny_gpt2tok) {
    mdl_model *m = open_generated("tiny-gpt2tok");
    assert_tiny_config(&m->cfg, "tiny-gpt2tok");
    /* GPT-2's <|endoftext|> is bos and eos when the tokenizer has it, else Llama 3's tokens */
    int32_t eot = find_special("tiny-gpt2tok", "<|endoftext|>");
    if (eot >= 0) {
        cr_assert_eq(m->cfg.bos_token_id, eot);
        cr_assert_eq(m->cfg.eos_token_id, eot);
        cr_assert_eq(m->cfg.n_eos_token_ids, 1);
    } else {
        assert_llama3_specials(&m->cfg, "tiny-gpt2tok");
    }
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(&m->cfg));
    mdl_close(m);
}

Test(mdl, generated_small_f32) {
    mdl_model *m = open_generated("small-f32");
    const mdl_config *c = &m->cfg;
    cr_assert_eq(c->vocab_size, tokenizer_ids("small-f32"));
    cr_assert_eq(c->hidden_size, 256);
    cr_assert_eq(c->intermediate_size, 688);
    cr_assert_eq(c->n_layers, 4);
    cr_assert_eq(c->n_heads, 8);
    cr_assert_eq(c->n_kv_heads, 2);
    cr_assert_eq(c->head_dim, 32);
    cr_assert_eq(c->rope_theta, 500000.0f);
    cr_assert_eq(c->rope_factor, 32.0f);
    cr_assert_eq(c->rope_orig_max_position, 8192);
    cr_assert_eq(c->tie_word_embeddings, 0);
    cr_assert_eq(c->dtype, MDL_F32);
    cr_assert_eq(m->weight_bytes, expected_weight_bytes(c));
    each_tensor(m, check_mapped, NULL);
    mdl_close(m);
}
