/* mdl_config.c — config.json of a Llama-family Hugging Face model → mdl_config.
 *
 * Owns: the model directory check, every key the decoder depends on with its type, range and
 * default (transformers' LlamaConfig defaults), the two spellings of RoPE scaling
 * (rope_scaling and the newer rope_parameters, whose rope_theta wins), and the checks across
 * keys (GQA divisibility, head_dim, token ids inside the vocabulary). The messages are listed
 * in mdl.c's header comment. Does not own: the weights (mdl.c, mdl_st.c). */
#include <errno.h>
#include <float.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "mdl_internal.h"

#define CFG_INT_MAX INT32_MAX /* the kernels index with int */

typedef struct cfg_ctx {
    const char *path; /* "<dir>/config.json", the prefix of every message */
    pie_status *st;
} cfg_ctx;

/* ---- one key each -------------------------------------------------------------------------- */

/* Sets st to "<path>: missing required key '<name>'". */
static pie_code cfg_missing(const cfg_ctx *c, const char *name) {
    return pie_status_set(c->st, PIE_INVALID_ARGUMENT, "%s: missing required key '%s'", c->path,
                          name);
}

/* Sets st to "<path>: <name>: expected <what>, got <v>". */
static pie_code cfg_bad(const cfg_ctx *c, const char *name, const char *what, const json_t *v) {
    char shown[64];
    mdl_json_show(v, shown, sizeof shown);
    return pie_status_set(c->st, PIE_INVALID_ARGUMENT, "%s: %s: expected %s, got %s", c->path, name,
                          what, shown);
}

/* The value of key in obj; NULL when absent, or when null and null_is_absent. */
static json_t *cfg_get(json_t *obj, const char *key, int null_is_absent) {
    json_t *v = json_object_get(obj, key);
    if (v != NULL && null_is_absent && json_is_null(v)) return NULL;
    return v;
}

/* Integer in [lo, CFG_INT_MAX]. Absent (or null): def, or an error when required. */
static pie_code cfg_int(const cfg_ctx *c, json_t *obj, const char *key, const char *name,
                        int required, int64_t lo, int64_t def, int64_t *out) {
    json_t *v = cfg_get(obj, key, !required);
    if (v == NULL) {
        if (required) return cfg_missing(c, name);
        *out = def;
        return PIE_OK;
    }
    char what[64];
    snprintf(what, sizeof what, "an integer in [%lld, %d]", (long long)lo, CFG_INT_MAX);
    if (!json_is_integer(v)) return cfg_bad(c, name, what, v);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > CFG_INT_MAX) return cfg_bad(c, name, what, v);
    *out = (int64_t)x;
    return PIE_OK;
}

static pie_code cfg_u32(const cfg_ctx *c, json_t *obj, const char *key, const char *name,
                        int required, uint32_t def, uint32_t *out) {
    int64_t x;
    pie_code rc = cfg_int(c, obj, key, name, required, 1, def, &x);
    if (rc == PIE_OK) *out = (uint32_t)x;
    return rc;
}

/* A finite number > 0 that fits a float (integers accepted). */
static pie_code cfg_pos_float(const cfg_ctx *c, json_t *obj, const char *key, const char *name,
                              int required, float def, float *out) {
    json_t *v = cfg_get(obj, key, !required);
    if (v == NULL) {
        if (required) return cfg_missing(c, name);
        *out = def;
        return PIE_OK;
    }
    const char *what = "a finite positive number";
    if (!json_is_number(v)) return cfg_bad(c, name, what, v);
    double x = json_number_value(v);
    if (!(x > 0) || x > FLT_MAX || (float)x <= 0.0f) return cfg_bad(c, name, what, v);
    *out = (float)x;
    return PIE_OK;
}

/* A JSON boolean; absent or null → def. */
static pie_code cfg_bool(const cfg_ctx *c, json_t *obj, const char *key, int def, int *out) {
    json_t *v = cfg_get(obj, key, 1);
    if (v == NULL) {
        *out = def;
        return PIE_OK;
    }
    if (!json_is_boolean(v)) return cfg_bad(c, key, "true or false", v);
    *out = json_is_true(v);
    return PIE_OK;
}

/* A string; absent or null → *out = NULL (or an error when required). */
static pie_code cfg_str(const cfg_ctx *c, json_t *obj, const char *key, const char *name,
                        int required, const char **out) {
    json_t *v = cfg_get(obj, key, !required);
    *out = NULL;
    if (v == NULL) return required ? cfg_missing(c, name) : PIE_OK;
    if (!json_is_string(v)) return cfg_bad(c, name, "a string", v);
    *out = json_string_value(v);
    return PIE_OK;
}

/* ---- groups of keys ------------------------------------------------------------------------ */

/* model_type, hidden_act, attention_bias, mlp_bias: what this module can run. */
static pie_code cfg_family(const cfg_ctx *c, json_t *root, mdl_config *cfg) {
    const char *s;
    pie_code rc = cfg_str(c, root, "model_type", "model_type", 1, &s);
    if (rc != PIE_OK) return rc;
    if (strcmp(s, "llama") != 0)
        return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                              "%s: model_type: unsupported model type '%.40s' (supported: llama)",
                              c->path, s);
    snprintf(cfg->architecture, sizeof cfg->architecture, "%s", s);

    if ((rc = cfg_str(c, root, "hidden_act", "hidden_act", 0, &s)) != PIE_OK) return rc;
    if (s != NULL && strcmp(s, "silu") != 0)
        return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                              "%s: hidden_act: unsupported activation '%.40s' (supported: silu)",
                              c->path, s);

    static const char *const biases[] = {"attention_bias", "mlp_bias"};
    for (size_t i = 0; i < sizeof biases / sizeof biases[0]; i++) {
        int on = 0;
        if ((rc = cfg_bool(c, root, biases[i], 0, &on)) != PIE_OK) return rc;
        if (on)
            return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                                  "%s: %s: true is not supported (Llama without biases only)",
                                  c->path, biases[i]);
    }
    return PIE_OK;
}

/* Sizes: vocabulary, widths, layers, heads (GQA), head_dim, positions. */
static pie_code cfg_sizes(const cfg_ctx *c, json_t *root, mdl_config *cfg) {
    pie_code rc;
    if ((rc = cfg_u32(c, root, "vocab_size", "vocab_size", 1, 0, &cfg->vocab_size)) != PIE_OK ||
        (rc = cfg_u32(c, root, "hidden_size", "hidden_size", 1, 0, &cfg->hidden_size)) != PIE_OK ||
        (rc = cfg_u32(c, root, "intermediate_size", "intermediate_size", 1, 0,
                      &cfg->intermediate_size)) != PIE_OK ||
        (rc = cfg_u32(c, root, "num_hidden_layers", "num_hidden_layers", 1, 0, &cfg->n_layers)) !=
            PIE_OK ||
        (rc = cfg_u32(c, root, "num_attention_heads", "num_attention_heads", 1, 0,
                      &cfg->n_heads)) != PIE_OK ||
        (rc = cfg_u32(c, root, "num_key_value_heads", "num_key_value_heads", 0, cfg->n_heads,
                      &cfg->n_kv_heads)) != PIE_OK ||
        (rc = cfg_u32(c, root, "max_position_embeddings", "max_position_embeddings", 0, 2048,
                      &cfg->max_position)) != PIE_OK)
        return rc;

    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return pie_status_set(
            c->st, PIE_INVALID_ARGUMENT,
            "%s: num_attention_heads %u is not a multiple of num_key_value_heads %u", c->path,
            cfg->n_heads, cfg->n_kv_heads);

    if (cfg_get(root, "head_dim", 1) != NULL) {
        if ((rc = cfg_u32(c, root, "head_dim", "head_dim", 1, 0, &cfg->head_dim)) != PIE_OK)
            return rc;
    } else {
        if (cfg->hidden_size % cfg->n_heads != 0)
            return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                                  "%s: hidden_size %u is not a multiple of num_attention_heads %u "
                                  "and head_dim is not given",
                                  c->path, cfg->hidden_size, cfg->n_heads);
        cfg->head_dim = cfg->hidden_size / cfg->n_heads;
    }
    if (cfg->head_dim % 2 != 0)
        return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                              "%s: head_dim %u is odd (RoPE rotates pairs of dimensions)", c->path,
                              cfg->head_dim);
    if ((uint64_t)cfg->n_heads * cfg->head_dim > CFG_INT_MAX)
        return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                              "%s: num_attention_heads %u × head_dim %u exceeds %d", c->path,
                              cfg->n_heads, cfg->head_dim, CFG_INT_MAX);
    return PIE_OK;
}

/* One RoPE block (rope_parameters or rope_scaling), an object. */
static pie_code cfg_rope_block(const cfg_ctx *c, json_t *blk, const char *blk_name,
                               mdl_config *cfg) {
    char name[64];
    pie_code rc;
    const char *type_key = json_object_get(blk, "rope_type") != NULL ? "rope_type" : "type";
    if (json_object_get(blk, type_key) == NULL) type_key = "rope_type"; /* named when missing */
    snprintf(name, sizeof name, "%s.rope_theta", blk_name);
    if ((rc = cfg_pos_float(c, blk, "rope_theta", name, 0, cfg->rope_theta, &cfg->rope_theta)) !=
        PIE_OK)
        return rc;

    const char *type;
    snprintf(name, sizeof name, "%s.%s", blk_name, type_key);
    if ((rc = cfg_str(c, blk, type_key, name, 1, &type)) != PIE_OK) return rc;
    if (strcmp(type, "default") == 0) return PIE_OK;
    if (strcmp(type, "llama3") != 0)
        return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                              "%s: %s: unsupported rope type '%.40s' (supported: default, llama3)",
                              c->path, name, type);

    snprintf(name, sizeof name, "%s.factor", blk_name);
    if ((rc = cfg_pos_float(c, blk, "factor", name, 1, 0, &cfg->rope_factor)) != PIE_OK) return rc;
    snprintf(name, sizeof name, "%s.low_freq_factor", blk_name);
    if ((rc = cfg_pos_float(c, blk, "low_freq_factor", name, 1, 0, &cfg->rope_low_freq_factor)) !=
        PIE_OK)
        return rc;
    snprintf(name, sizeof name, "%s.high_freq_factor", blk_name);
    if ((rc = cfg_pos_float(c, blk, "high_freq_factor", name, 1, 0, &cfg->rope_high_freq_factor)) !=
        PIE_OK)
        return rc;
    snprintf(name, sizeof name, "%s.original_max_position_embeddings", blk_name);
    if ((rc = cfg_u32(c, blk, "original_max_position_embeddings", name, 1, 0,
                      &cfg->rope_orig_max_position)) != PIE_OK)
        return rc;
    if (!(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor))
        return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                              "%s: %s: high_freq_factor %g must be greater than low_freq_factor %g",
                              c->path, blk_name, (double)cfg->rope_high_freq_factor,
                              (double)cfg->rope_low_freq_factor);
    return PIE_OK;
}

/* rope_theta, then rope_parameters (newer) or rope_scaling; null or absent = no scaling. */
static pie_code cfg_rope(const cfg_ctx *c, json_t *root, mdl_config *cfg) {
    pie_code rc = cfg_pos_float(c, root, "rope_theta", "rope_theta", 0, 10000.0f, &cfg->rope_theta);
    if (rc != PIE_OK) return rc;
    const char *blk_name = "rope_parameters";
    json_t *blk = cfg_get(root, blk_name, 1);
    if (blk == NULL) {
        blk_name = "rope_scaling";
        blk = cfg_get(root, blk_name, 1);
    }
    if (blk == NULL) return PIE_OK;
    if (!json_is_object(blk)) return cfg_bad(c, blk_name, "an object or null", blk);
    rc = cfg_rope_block(c, blk, blk_name, cfg);
    if (rc != PIE_OK) return rc;
    if (cfg->rope_factor == 0) { /* "default": report no scaling at all */
        cfg->rope_low_freq_factor = cfg->rope_high_freq_factor = 0;
        cfg->rope_orig_max_position = 0;
    }
    return PIE_OK;
}

/* dtype (transformers ≥ 4.56) or torch_dtype. */
static pie_code cfg_dtype(const cfg_ctx *c, json_t *root, mdl_config *cfg) {
    const char *key = cfg_get(root, "dtype", 1) != NULL ? "dtype" : "torch_dtype";
    const char *s;
    pie_code rc = cfg_str(c, root, key, key, 0, &s);
    if (rc != PIE_OK) return rc;
    cfg->dtype = MDL_F32;
    cfg->dtype_declared = s != NULL;
    if (s == NULL || strcmp(s, "float32") == 0) return PIE_OK;
    if (strcmp(s, "float16") == 0) {
        cfg->dtype = MDL_F16;
    } else if (strcmp(s, "bfloat16") == 0) {
        cfg->dtype = MDL_BF16;
    } else {
        return pie_status_set(c->st, PIE_INVALID_ARGUMENT,
                              "%s: %s: unsupported dtype '%.40s' (supported: float32, float16, "
                              "bfloat16)",
                              c->path, key, s);
    }
    return PIE_OK;
}

/* A token id inside the vocabulary. */
static pie_code cfg_token_in_vocab(const cfg_ctx *c, const char *name, int64_t id,
                                   const mdl_config *cfg) {
    if (id < (int64_t)cfg->vocab_size) return PIE_OK;
    return pie_status_set(c->st, PIE_INVALID_ARGUMENT, "%s: %s %lld is not below vocab_size %u",
                          c->path, name, (long long)id, cfg->vocab_size);
}

/* bos_token_id (integer or null), eos_token_id (integer, list of integers, or null). */
static pie_code cfg_tokens(const cfg_ctx *c, json_t *root, mdl_config *cfg) {
    int64_t id;
    pie_code rc = cfg_int(c, root, "bos_token_id", "bos_token_id", 0, 0, -1, &id);
    if (rc != PIE_OK) return rc;
    if (id >= 0 && (rc = cfg_token_in_vocab(c, "bos_token_id", id, cfg)) != PIE_OK) return rc;
    cfg->bos_token_id = (int32_t)id;

    cfg->eos_token_id = -1;
    cfg->n_eos_token_ids = 0;
    json_t *eos = cfg_get(root, "eos_token_id", 1);
    if (eos == NULL) return PIE_OK;
    if (json_is_integer(eos)) {
        if ((rc = cfg_int(c, root, "eos_token_id", "eos_token_id", 1, 0, 0, &id)) != PIE_OK ||
            (rc = cfg_token_in_vocab(c, "eos_token_id", id, cfg)) != PIE_OK)
            return rc;
        cfg->eos_token_id = cfg->eos_token_ids[0] = (int32_t)id;
        cfg->n_eos_token_ids = 1;
        return PIE_OK;
    }
    if (!json_is_array(eos))
        return cfg_bad(c, "eos_token_id", "an integer in [0, 2147483647], a list of them, or null",
                       eos);
    for (size_t i = 0; i < json_array_size(eos); i++) {
        char name[48];
        snprintf(name, sizeof name, "eos_token_id[%zu]", i);
        json_t *el = json_array_get(eos, i);
        if (!json_is_integer(el) || json_integer_value(el) < 0 ||
            json_integer_value(el) > CFG_INT_MAX)
            return cfg_bad(c, name, "an integer in [0, 2147483647]", el);
        id = (int64_t)json_integer_value(el);
        if ((rc = cfg_token_in_vocab(c, name, id, cfg)) != PIE_OK) return rc;
        if (i < MDL_MAX_EOS) cfg->eos_token_ids[cfg->n_eos_token_ids++] = (int32_t)id;
    }
    if (cfg->n_eos_token_ids > 0) cfg->eos_token_id = cfg->eos_token_ids[0];
    return PIE_OK;
}

/* ---- entry points ------------------------------------------------------------------------- */

pie_code mdl_dir_check(const char *dir, char *norm, size_t n, pie_status *st) {
    if (dir == NULL || dir[0] == '\0')
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "model directory: the path is empty");
    size_t len = strlen(dir);
    if (len > MDL_DIR_MAX || len >= n)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%.60s...: model directory path is too long (%zu bytes, at most %d)",
                              dir, len, MDL_DIR_MAX);
    memcpy(norm, dir, len + 1);
    while (len > 1 && norm[len - 1] == '/') norm[--len] = '\0';

    struct stat sb;
    if (stat(norm, &sb) != 0) {
        int e = errno;
        return pie_status_set(st, mdl_errno_code(e), "%s: cannot open model directory: %s", norm,
                              strerror(e));
    }
    if (!S_ISDIR(sb.st_mode))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: not a directory", norm);
    return PIE_OK;
}

pie_code mdl_config_parse(const char *dir, mdl_config *cfg, pie_status *st) {
    char path[MDL_PATH_MAX];
    if (mdl_path_join(path, sizeof path, dir, "config.json") != 0)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: path is too long", dir);
    json_t *root;
    pie_code rc = mdl_json_load_object(path, &root, st);
    if (rc != PIE_OK) return rc;

    memset(cfg, 0, sizeof *cfg);
    cfg_ctx c = {path, st};
    if ((rc = cfg_family(&c, root, cfg)) != PIE_OK || (rc = cfg_sizes(&c, root, cfg)) != PIE_OK ||
        (rc = cfg_pos_float(&c, root, "rms_norm_eps", "rms_norm_eps", 0, 1e-6f, &cfg->rms_eps)) !=
            PIE_OK ||
        (rc = cfg_rope(&c, root, cfg)) != PIE_OK ||
        (rc = cfg_bool(&c, root, "tie_word_embeddings", 0, &cfg->tie_word_embeddings)) != PIE_OK ||
        (rc = cfg_dtype(&c, root, cfg)) != PIE_OK || (rc = cfg_tokens(&c, root, cfg)) != PIE_OK)
        goto done;
    pie_status_ok(st);

done:
    json_decref(root);
    return rc;
}

pie_code mdl_config_load(const char *dir, mdl_config *out, pie_status *st) {
    char norm[MDL_DIR_MAX + 1];
    pie_code rc = mdl_dir_check(dir, norm, sizeof norm, st);
    if (rc != PIE_OK) return rc;
    return mdl_config_parse(norm, out, st);
}
