/* mdl.c — opening a Llama-family Hugging Face model directory (see mdl.h).
 *
 * Owns: finding the weights (model.safetensors, else the shards of
 * model.safetensors.index.json), binding every tensor the decoder needs by name with its shape
 * checked against the config and one dtype for all, the aligned copy of a misaligned tensor,
 * mdl_close, and the dtype helpers. config.json is mdl_config.c's, one safetensors file is
 * mdl_st.c's, JSON file reading is mdl_json.c's.
 *
 * Every message a user can cause, exactly (<dir> as given without trailing slashes; <cfg> =
 * <dir>/config.json; <idx> = <dir>/model.safetensors.index.json; <file> = the safetensors file
 * concerned; <v> a JSON value shown as 0, -3, 64.0, "64", true, null, a list of 3 values, an
 * empty list, an object; every one is tested in tests/unit/test_mdl.c). Code INVALID_ARGUMENT
 * unless noted.
 *
 *  directory
 *   D1 "model directory: the path is empty"
 *   D2 "<first 60 bytes>...: model directory path is too long (<n> bytes, at most 400)"
 *   D3 "<dir>: cannot open model directory: No such file or directory"         NOT_FOUND
 *   D4 "<dir>: not a directory"
 *  JSON files (config.json, model.safetensors.index.json)
 *   J1 "cannot open JSON file '<cfg>': No such file or directory"               NOT_FOUND
 *   J2 "JSON file '<cfg>' is not a regular file"
 *   J3 "JSON file '<cfg>' is larger than 67108864 bytes"
 *   J4 "<cfg>: invalid JSON at line <l>, column <c>: <jansson's text>"
 *   J5 "<cfg>: expected a JSON object at the top level"
 *  config.json keys (<key> is dotted inside a block: rope_scaling.factor; eos_token_id[1])
 *   C1 "<cfg>: missing required key '<key>'"       model_type, vocab_size, hidden_size,
 *        intermediate_size, num_hidden_layers, num_attention_heads; in a llama3 RoPE block:
 *        rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
 *   C2 "<cfg>: <key>: expected an integer in [1, 2147483647], got <v>"   the sizes above and
 *        num_key_value_heads, head_dim, max_position_embeddings, original_max_position_embeddings
 *   C3 "<cfg>: <key>: expected an integer in [0, 2147483647], got <v>"   bos_token_id,
 *        eos_token_id[i]
 *   C4 "<cfg>: eos_token_id: expected an integer in [0, 2147483647], a list of them, or null,
 *        got <v>"
 *   C5 "<cfg>: <key>: expected a finite positive number, got <v>"  rms_norm_eps, rope_theta,
 *        factor, low_freq_factor, high_freq_factor
 *   C6 "<cfg>: <key>: expected true or false, got <v>"  tie_word_embeddings, attention_bias,
 *        mlp_bias
 *   C7 "<cfg>: <key>: expected a string, got <v>"  model_type, hidden_act, torch_dtype, dtype,
 *        rope_type
 *   C8 "<cfg>: <block>: expected an object or null, got <v>"  rope_scaling, rope_parameters
 *   C9 "<cfg>: model_type: unsupported model type 'qwen2' (supported: llama)"
 *   C10 "<cfg>: hidden_act: unsupported activation 'gelu' (supported: silu)"
 *   C11 "<cfg>: attention_bias: true is not supported (Llama without biases only)"  (mlp_bias)
 *   C12 "<cfg>: num_attention_heads 32 is not a multiple of num_key_value_heads 6"
 *   C13 "<cfg>: hidden_size 100 is not a multiple of num_attention_heads 3 and head_dim is not
 *        given"
 *   C14 "<cfg>: head_dim 15 is odd (RoPE rotates pairs of dimensions)"
 *   C15 "<cfg>: num_attention_heads 65536 × head_dim 65536 exceeds 2147483647"
 *   C16 "<cfg>: <block>.rope_type: unsupported rope type 'yarn' (supported: default, llama3)"
 *        (<block>.type when the block spells it "type")
 *   C17 "<cfg>: <block>: high_freq_factor 1 must be greater than low_freq_factor 4"
 *   C18 "<cfg>: torch_dtype: unsupported dtype 'int8' (supported: float32, float16, bfloat16)"
 *        (dtype: ... when the key is "dtype")
 *   C19 "<cfg>: eos_token_id 600 is not below vocab_size 512"  (bos_token_id, eos_token_id[i])
 *  finding the weights
 *   W1 "<dir>: no weights: neither model.safetensors nor model.safetensors.index.json exists"
 *                                                                                NOT_FOUND
 *   W2 index.json: J2–J5 with <idx>
 *   W3 "<idx>: missing required key 'weight_map'"
 *   W4 "<idx>: weight_map: expected an object, got <v>"
 *   W5 "<idx>: weight_map['<tensor>']: expected a file name, got <v>"
 *   W6 "<idx>: weight_map['<tensor>']: shard name '<name>' is not a plain file name"  (empty,
 *        ".", "..", containing '/', or longer than 255 bytes)
 *   W7 "<dir>/<shard>: cannot open: No such file or directory (named by
 *        model.safetensors.index.json)"                                          NOT_FOUND
 *  one safetensors file
 *   S1 "<file>: not a regular file"
 *   S2 "<file>: file is 5 bytes, too short for the 8-byte header length"
 *   S3 "<file>: header length 1234567 exceeds the file size 800"
 *   S4 "<file>: header is not valid JSON at line <l>, column <c>: <jansson's text>"
 *        (duplicate tensor names land here: jansson's "duplicate object key")
 *   S5 "<file>: header is not a JSON object"
 *   S6 "<file>: tensor '<t>': expected an object with dtype, shape and data_offsets, got <v>"
 *   S7 "<file>: tensor '<t>': missing 'dtype'"  (shape, data_offsets)
 *   S8 "<file>: tensor '<t>': dtype: expected a string, got <v>"
 *   S9 "<file>: tensor '<t>': unknown dtype 'Q4'"
 *   S10 "<file>: tensor '<t>': shape: expected a list of non-negative integers, got <v>"
 *   S11 "<file>: tensor '<t>': shape has 9 dimensions (at most 8 supported)"
 *   S12 "<file>: tensor '<t>': shape[1]: expected a non-negative integer, got <v>"
 *   S13 "<file>: tensor '<t>': data_offsets: expected a list of 2 integers [begin, end], got <v>"
 *   S14 "<file>: tensor '<t>': data_offsets[0]: expected a non-negative integer, got <v>"
 *   S15 "<file>: tensor '<t>': data_offsets [8, 4]: begin is after end"
 *   S16 "<file>: tensor '<t>': data_offsets [0, 4096] exceed the 1024 bytes of data"
 *   S17 "<file>: tensor '<t>': shape [4294967296, 4294967296] of F32 overflows 64-bit sizes"
 *   S18 "<file>: tensor '<t>': shape [4, 8] of F32 is 128 bytes, but data_offsets [0, 64] span 64"
 *   S19 "<file>: tensor '<t>': data_offsets [64, 192] overlap tensor '<u>' [0, 128]"
 *  binding (<file> is the file the tensor is in, or should be in)
 *   B1 "<file>: missing tensor 'model.norm.weight'"                       (one file)
 *   B2 "<idx>: missing tensor 'model.norm.weight' (not in weight_map)"
 *   B3 "<dir>/<shard>: missing tensor 'model.norm.weight' (model.safetensors.index.json maps it
 *        to this file)"
 *   B4 "<file>: tensor '<t>' has dtype I8 (supported: F32, F16, BF16)"
 *   B5 "<file>: tensor '<t>' has shape [64, 32], expected [128, 32]"
 *   B6 "<file>: tensor '<t>' has dtype F16, but 'model.embed_tokens.weight' has BF16 (all
 *        weights must share one dtype)"
 *
 * Not caused by the input, untested: "<path>: cannot stat|cannot read: <strerror>" (INTERNAL),
 * "<file>: mmap of <n> bytes failed: <strerror>" (INTERNAL, RESOURCE_EXHAUSTED for ENOMEM),
 * "<path>: out of memory ..." (RESOURCE_EXHAUSTED), "<path>: path is too long" past 4095 bytes,
 * "cannot open: Permission denied" (PERMISSION_DENIED). A file truncated while mapped is
 * outside what mmap can protect against (SIGBUS on access), as for every mmap loader. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "mdl_internal.h"

#define MDL_INDEX_NAME  "model.safetensors.index.json"
#define MDL_SINGLE_NAME "model.safetensors"
#define MDL_COPY_ALIGN  64 /* alignment of the copy of a misaligned tensor */

size_t mdl_dtype_size(mdl_dtype t) { return t == MDL_F32 ? 4 : 2; }

const char *mdl_dtype_name(mdl_dtype t) {
    switch (t) {
    case MDL_F32: return "f32";
    case MDL_F16: return "f16";
    case MDL_BF16: return "bf16";
    }
    return "?";
}

/* IEEE half → float, exactly. */
static float mdl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    float f;
    if (exp == 0) {
        f = (float)mant * 0x1p-24f; /* zero or subnormal: exact */
        return sign ? -f : f;
    }
    if (exp == 31)
        bits = sign | 0x7f800000u | (mant << 13);
    else
        bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

float mdl_tensor_at(const mdl_tensor *t, size_t i) {
    const uint8_t *p = (const uint8_t *)t->data + i * mdl_dtype_size(t->dtype);
    float f;
    uint16_t h;
    switch (t->dtype) {
    case MDL_F32: memcpy(&f, p, sizeof f); return f;
    case MDL_F16: memcpy(&h, p, sizeof h); return mdl_f16_to_f32(h);
    case MDL_BF16: {
        memcpy(&h, p, sizeof h);
        uint32_t bits = (uint32_t)h << 16;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    }
    return 0.0f;
}

/* ---- where the tensors are -------------------------------------------------------------- */

/* The safetensors files of a model: one file, or the shards of an index. */
typedef struct mdl_src {
    const char *dir;
    char index_path[MDL_PATH_MAX]; /* "" for a single file */
    json_t *index;                 /* the index object (owns shard_names' strings) */
    json_t *weight_map;            /* borrowed from index */
    const char **shard_names;      /* [n_files] when sharded */
    mdl_st_file *files;            /* [n_files] */
    int n_files;
} mdl_src;

static void mdl_src_free(mdl_src *s) {
    for (int i = 0; i < s->n_files; i++) mdl_st_close(&s->files[i]);
    free(s->files);
    free(s->shard_names);
    json_decref(s->index);
    memset(s, 0, sizeof *s);
}

/* 1 if name can be joined to a directory without leaving it. */
static int mdl_plain_name(const char *name) {
    size_t len = strlen(name);
    return len > 0 && len <= 255 && strchr(name, '/') == NULL && strcmp(name, ".") != 0 &&
           strcmp(name, "..") != 0;
}

/* Reads the index, checks weight_map and opens each shard it names once. */
static pie_code mdl_src_open_index(mdl_src *s, pie_status *st) {
    pie_code rc = mdl_json_load_object(s->index_path, &s->index, st);
    if (rc != PIE_OK) return rc;
    char shown[64];
    s->weight_map = json_object_get(s->index, "weight_map");
    if (s->weight_map == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: missing required key 'weight_map'",
                              s->index_path);
    if (!json_is_object(s->weight_map)) {
        mdl_json_show(s->weight_map, shown, sizeof shown);
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: weight_map: expected an object, got %s", s->index_path, shown);
    }

    size_t cap = json_object_size(s->weight_map);
    s->shard_names = calloc(cap > 0 ? cap : 1, sizeof *s->shard_names);
    s->files = calloc(cap > 0 ? cap : 1, sizeof *s->files);
    if (s->shard_names == NULL || s->files == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", s->index_path);

    int n_names = 0;
    const char *tensor;
    json_t *v;
    json_object_foreach(s->weight_map, tensor, v) {
        if (!json_is_string(v)) {
            mdl_json_show(v, shown, sizeof shown);
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: weight_map['%.80s']: expected a file name, got %s",
                                  s->index_path, tensor, shown);
        }
        const char *name = json_string_value(v);
        if (!mdl_plain_name(name))
            return pie_status_set(
                st, PIE_INVALID_ARGUMENT,
                "%s: weight_map['%.80s']: shard name '%.80s' is not a plain file name",
                s->index_path, tensor, name);
        int seen = 0;
        for (int i = 0; i < n_names && !seen; i++) seen = strcmp(s->shard_names[i], name) == 0;
        if (!seen) s->shard_names[n_names++] = name;
    }

    for (int i = 0; i < n_names; i++) {
        char path[MDL_PATH_MAX];
        if (mdl_path_join(path, sizeof path, s->dir, s->shard_names[i]) != 0)
            return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: path is too long", s->dir);
        if ((rc = mdl_st_open(path, MDL_INDEX_NAME, &s->files[i], st)) != PIE_OK) return rc;
        s->n_files = i + 1;
    }
    return PIE_OK;
}

/* model.safetensors when it exists, else the index. */
static pie_code mdl_src_open(mdl_src *s, const char *dir, pie_status *st) {
    memset(s, 0, sizeof *s);
    s->dir = dir;
    char single[MDL_PATH_MAX];
    if (mdl_path_join(single, sizeof single, dir, MDL_SINGLE_NAME) != 0 ||
        mdl_path_join(s->index_path, sizeof s->index_path, dir, MDL_INDEX_NAME) != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: path is too long", dir);

    struct stat sb;
    if (stat(single, &sb) == 0 || errno != ENOENT) {
        s->index_path[0] = '\0';
        s->files = calloc(1, sizeof *s->files);
        if (s->files == NULL)
            return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", single);
        pie_code rc = mdl_st_open(single, NULL, &s->files[0], st);
        if (rc == PIE_OK) s->n_files = 1;
        return rc;
    }
    if (stat(s->index_path, &sb) != 0 && errno == ENOENT)
        return pie_status_set(
            st, PIE_NOT_FOUND,
            "%s: no weights: neither " MDL_SINGLE_NAME " nor " MDL_INDEX_NAME " exists", dir);
    return mdl_src_open_index(s, st);
}

/* The file and header entry of tensor name. */
static pie_code mdl_src_find(const mdl_src *s, const char *name, const mdl_st_file **file,
                             const mdl_st_tensor **t, pie_status *st) {
    if (s->index_path[0] == '\0') {
        *file = &s->files[0];
        *t = mdl_st_find(*file, name);
        if (*t == NULL)
            return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: missing tensor '%s'",
                                  (*file)->path, name);
        return PIE_OK;
    }
    json_t *v = json_object_get(s->weight_map, name);
    if (v == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: missing tensor '%s' (not in weight_map)", s->index_path, name);
    for (int i = 0; i < s->n_files; i++) {
        if (strcmp(s->shard_names[i], json_string_value(v)) != 0) continue;
        *file = &s->files[i];
        *t = mdl_st_find(*file, name);
        if (*t == NULL)
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "%s: missing tensor '%s' (" MDL_INDEX_NAME
                                  " maps it to this file)",
                                  (*file)->path, name);
        return PIE_OK;
    }
    /* every name of weight_map was opened by mdl_src_open_index */
    return pie_status_set(st, PIE_INTERNAL, "%s: shard of '%s' not open", s->index_path, name);
}

/* ---- binding -------------------------------------------------------------------------------- */

typedef struct mdl_binder {
    mdl_model *m;
    const mdl_src *src;
    const mdl_st_dtype *dtype; /* of the first bound tensor (model.embed_tokens.weight) */
    pie_status *st;
} mdl_binder;

/* Binds tensor name of shape [rows] (ndim 1) or [rows, cols] (ndim 2) into out. */
static pie_code mdl_bind(mdl_binder *b, const char *name, int ndim, uint64_t rows, uint64_t cols,
                         mdl_tensor *out) {
    const mdl_st_file *f;
    const mdl_st_tensor *t;
    pie_code rc = mdl_src_find(b->src, name, &f, &t, b->st);
    if (rc != PIE_OK) return rc;
    if (t->dtype->mdl < 0)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "%s: tensor '%s' has dtype %s (supported: F32, F16, BF16)", f->path,
                              name, t->dtype->name);
    uint64_t want[2] = {rows, cols};
    if (t->ndim != ndim || t->shape[0] != rows || (ndim == 2 && t->shape[1] != cols)) {
        char got_s[160], want_s[64];
        mdl_st_shape_str(t->shape, t->ndim, got_s, sizeof got_s);
        mdl_st_shape_str(want, ndim, want_s, sizeof want_s);
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "%s: tensor '%s' has shape %s, expected %s", f->path, name, got_s,
                              want_s);
    }
    if (b->dtype == NULL) b->dtype = t->dtype;
    if (t->dtype != b->dtype)
        return pie_status_set(b->st, PIE_INVALID_ARGUMENT,
                              "%s: tensor '%s' has dtype %s, but 'model.embed_tokens.weight' has "
                              "%s (all weights must share one dtype)",
                              f->path, name, t->dtype->name, b->dtype->name);

    size_t bytes = (size_t)(t->end - t->begin);
    const uint8_t *data = f->data + t->begin;
    mdl_model *m = b->m;
    if ((uintptr_t)data % t->dtype->size != 0) {
        size_t cap = (bytes + MDL_COPY_ALIGN - 1) / MDL_COPY_ALIGN * MDL_COPY_ALIGN;
        void *copy = aligned_alloc(MDL_COPY_ALIGN, cap);
        if (copy == NULL)
            return pie_status_set(b->st, PIE_RESOURCE_EXHAUSTED,
                                  "%s: out of memory copying misaligned tensor '%s' (%zu bytes)",
                                  f->path, name, bytes);
        memcpy(copy, data, bytes);
        m->copies[m->n_copied++] = copy;
        m->copied_bytes += bytes;
        data = copy;
    }
    out->data = data;
    out->dtype = (mdl_dtype)t->dtype->mdl;
    out->rows = (uint32_t)rows;
    out->cols = ndim == 2 ? (uint32_t)cols : 1;
    m->weight_bytes += bytes;
    return PIE_OK;
}

/* Every tensor of the decoder, in file order of HF checkpoints. */
static pie_code mdl_bind_all(mdl_binder *b) {
    mdl_model *m = b->m;
    const mdl_config *c = &m->cfg;
    uint64_t d = c->hidden_size, v = c->vocab_size, ffn = c->intermediate_size;
    uint64_t q = (uint64_t)c->n_heads * c->head_dim, kv = (uint64_t)c->n_kv_heads * c->head_dim;
    pie_code rc;
    if ((rc = mdl_bind(b, "model.embed_tokens.weight", 2, v, d, &m->embed)) != PIE_OK) return rc;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        mdl_layer *L = &m->layers[l];
        const struct {
            const char *suffix;
            int ndim;
            uint64_t rows, cols;
            mdl_tensor *out;
        } w[] = {
            {"input_layernorm.weight", 1, d, 1, &L->attn_norm},
            {"self_attn.q_proj.weight", 2, q, d, &L->wq},
            {"self_attn.k_proj.weight", 2, kv, d, &L->wk},
            {"self_attn.v_proj.weight", 2, kv, d, &L->wv},
            {"self_attn.o_proj.weight", 2, d, q, &L->wo},
            {"post_attention_layernorm.weight", 1, d, 1, &L->ffn_norm},
            {"mlp.gate_proj.weight", 2, ffn, d, &L->w_gate},
            {"mlp.up_proj.weight", 2, ffn, d, &L->w_up},
            {"mlp.down_proj.weight", 2, d, ffn, &L->w_down},
        };
        for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
            char name[128];
            snprintf(name, sizeof name, "model.layers.%u.%s", l, w[i].suffix);
            if ((rc = mdl_bind(b, name, w[i].ndim, w[i].rows, w[i].cols, w[i].out)) != PIE_OK)
                return rc;
        }
    }
    if ((rc = mdl_bind(b, "model.norm.weight", 1, d, 1, &m->norm)) != PIE_OK) return rc;
    if (c->tie_word_embeddings) {
        m->lm_head = m->embed;
        return PIE_OK;
    }
    return mdl_bind(b, "lm_head.weight", 2, v, d, &m->lm_head);
}

/* Moves the mappings of src into m (src keeps nothing to unmap). */
static pie_code mdl_take_maps(mdl_model *m, mdl_src *src, pie_status *st) {
    m->maps = calloc((size_t)src->n_files, sizeof *m->maps);
    m->map_lens = calloc((size_t)src->n_files, sizeof *m->map_lens);
    if (m->maps == NULL || m->map_lens == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", m->dir);
    for (int i = 0; i < src->n_files; i++) {
        mdl_st_file *f = &src->files[i];
        m->maps[i] = f->map;
        m->map_lens[i] = f->map_len;
        f->map = NULL;
        f->map_len = 0;
    }
    m->n_maps = src->n_files;
    return PIE_OK;
}

pie_code mdl_open(const char *dir, mdl_model **out, pie_status *st) {
    *out = NULL;
    mdl_src src;
    memset(&src, 0, sizeof src);
    mdl_model *m = calloc(1, sizeof *m);
    if (m == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "model: out of memory");

    pie_code rc = mdl_dir_check(dir, m->dir, sizeof m->dir, st);
    if (rc != PIE_OK) goto fail;
    if ((rc = mdl_config_parse(m->dir, &m->cfg, st)) != PIE_OK) goto fail;
    m->layers = calloc(m->cfg.n_layers, sizeof *m->layers);
    m->copies = calloc((size_t)m->cfg.n_layers * 9 + 3, sizeof *m->copies);
    if (m->layers == NULL || m->copies == NULL) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory for %u layers", m->dir,
                            m->cfg.n_layers);
        goto fail;
    }
    if ((rc = mdl_src_open(&src, m->dir, st)) != PIE_OK) goto fail;

    mdl_binder b = {m, &src, NULL, st};
    if ((rc = mdl_bind_all(&b)) != PIE_OK) goto fail;
    m->cfg.dtype = (mdl_dtype)b.dtype->mdl;
    if ((rc = mdl_take_maps(m, &src, st)) != PIE_OK) goto fail;
    mdl_src_free(&src);
    pie_status_ok(st);
    *out = m;
    return PIE_OK;

fail:
    mdl_src_free(&src);
    mdl_close(m);
    return rc;
}

void mdl_close(mdl_model *m) {
    if (m == NULL) return;
    for (int i = 0; i < m->n_maps; i++)
        if (m->maps[i] != NULL) (void)munmap(m->maps[i], m->map_lens[i]); /* cannot fail here */
    for (int i = 0; i < m->n_copied; i++) free(m->copies[i]);
    free(m->copies);
    free(m->maps);
    free(m->map_lens);
    free(m->layers);
    free(m);
}
