/* wrk_desc.c — see wrk_desc.h. */
#include "wrk_desc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "pie_file.h"
#include "pie_sha256.h"
#include "tok.h"

#define WRK_TOKENIZER_MAX_BYTES (512u << 20) /* larger tokenizer.json files are refused */

/* Traits of every model this worker serves (ModelInfo.traits). */
static const char *const wrk_traits[] = {"allocate", "forward", "input_text", "tokenize",
                                         "output_text"};

/* tokenizer.json: SHA-256 of its bytes, the number of token ids it defines, and the bytes. */
static pie_code load_tokenizer(wrk_desc *d, const char *dir, pie_status *st) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    char *json = NULL;
    size_t len = 0;
    tok *t = NULL;
    pie_code rc = pie_file_read(path, "tokenizer", WRK_TOKENIZER_MAX_BYTES, &json, &len, st);
    if (rc != PIE_OK) return rc;
    rc = pie_sha256_hex(json, len, d->tokenizer_sha256, st);
    if (rc == PIE_OK) rc = tok_load_json(json, len, path, &t, st);
    if (rc == PIE_OK) {
        d->tokenizer_num_tokens = tok_vocab_size(t);
        d->tokenizer_json = json; /* kept for the registration */
        d->tokenizer_json_bytes = len;
        json = NULL;
    }
    tok_free(t);
    free(json);
    return rc;
}

/* tokenizer_config.json's "bos_token" / "eos_token": a string or an AddedToken object with
 * "content". NULL when absent or of another shape; *oom on allocation failure. */
static char *special_token_text(json_t *root, const char *key, bool *oom) {
    json_t *v = json_object_get(root, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return NULL;
    char *copy = strdup(json_string_value(v));
    if (copy == NULL) *oom = true;
    return copy;
}

/* tokenizer_config.json (optional): chat_template (a string, or the "default" entry of a list
 * of {name, template}), the bos/eos token texts and add_bos_token. */
static pie_code load_tokenizer_config(wrk_desc *d, const char *dir, pie_status *st) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *probe = fopen(path, "rb");
    if (probe == NULL) return PIE_OK; /* absent: no template, has_bos from config.json */
    fclose(probe);
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (root == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s:%d:%d: %s", path, err.line, err.column,
                              err.text);
    pie_code rc = PIE_OK;
    if (!json_is_object(root)) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: expected a JSON object", path);
        goto done;
    }
    const char *tmpl = NULL;
    json_t *ct = json_object_get(root, "chat_template");
    if (json_is_string(ct)) {
        tmpl = json_string_value(ct);
    } else if (json_is_array(ct)) {
        size_t i;
        json_t *e;
        json_array_foreach(ct, i, e) {
            const char *name = json_string_value(json_object_get(e, "name"));
            const char *text = json_string_value(json_object_get(e, "template"));
            if (text != NULL && (tmpl == NULL || (name != NULL && strcmp(name, "default") == 0)))
                tmpl = text;
        }
    }
    if (tmpl != NULL) {
        char *copy = strdup(tmpl);
        if (copy == NULL) {
            rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", path);
            goto done;
        }
        free(d->chat_template);
        d->chat_template = copy;
    }
    bool oom = false;
    d->bos_token = special_token_text(root, "bos_token", &oom);
    d->eos_token = special_token_text(root, "eos_token", &oom);
    if (oom) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", path);
        goto done;
    }
    json_t *bos = json_object_get(root, "add_bos_token");
    if (json_is_boolean(bos)) d->has_bos_token = json_is_true(bos) && d->has_bos_token;
done:
    json_decref(root);
    return rc;
}

pie_code wrk_desc_load(wrk_desc *d, const char *dir, pie_status *st) {
    memset(d, 0, sizeof *d);
    mdl_config c;
    pie_code rc = mdl_config_load(dir, &c, st);
    if (rc != PIE_OK) return rc;
    d->chat_template = strdup("");
    if (d->chat_template == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", dir);
    snprintf(d->architecture, sizeof d->architecture, "%s", c.architecture);
    snprintf(d->dtype, sizeof d->dtype, "%s", mdl_dtype_name(c.dtype));
    d->vocab_size = c.vocab_size;
    d->max_context_tokens = c.max_position;
    d->num_layers = c.n_layers;
    d->hidden_size = c.hidden_size;
    d->num_heads = c.n_heads;
    d->num_kv_heads = c.n_kv_heads;
    d->head_dim = c.head_dim;
    d->has_bos_token = c.bos_token_id >= 0;
    d->bos_token_id = c.bos_token_id >= 0 ? (uint32_t)c.bos_token_id : 0;
    if (c.n_eos_token_ids > 0) {
        for (uint32_t i = 0; i < c.n_eos_token_ids && i < MDL_MAX_EOS; i++)
            if (c.eos_token_ids[i] >= 0)
                d->stop_token_ids[d->n_stop_token_ids++] = (uint32_t)c.eos_token_ids[i];
    } else if (c.eos_token_id >= 0) {
        d->stop_token_ids[d->n_stop_token_ids++] = (uint32_t)c.eos_token_id;
    }
    rc = load_tokenizer(d, dir, st);
    if (rc == PIE_OK) rc = load_tokenizer_config(d, dir, st);
    if (rc != PIE_OK) wrk_desc_free(d);
    return rc;
}

void wrk_desc_null_model(wrk_desc *d) {
    memset(d, 0, sizeof *d);
    snprintf(d->architecture, sizeof d->architecture, "llama");
    snprintf(d->dtype, sizeof d->dtype, "bf16");
    d->vocab_size = 32000;
    d->max_context_tokens = 131072;
    d->num_layers = 32;
    d->hidden_size = 4096;
    d->num_heads = 32;
    d->num_kv_heads = 8;
    d->head_dim = 128;
    d->tokenizer_num_tokens = 32000;
    d->bos_token_id = 1;
    d->has_bos_token = true;
    d->stop_token_ids[0] = 2;
    d->n_stop_token_ids = 1;
    d->chat_template = NULL; /* shown as "" */
}

void wrk_desc_set_engine(wrk_desc *d, const eng_info *ei) {
    snprintf(d->architecture, sizeof d->architecture, "%s", ei->architecture);
    snprintf(d->dtype, sizeof d->dtype, "%s", ei->dtype);
    d->vocab_size = ei->vocab_size;
    d->max_context_tokens = ei->max_position;
    d->num_layers = ei->n_layers;
    d->hidden_size = ei->hidden_size;
    d->num_heads = ei->n_heads;
    d->num_kv_heads = ei->n_kv_heads;
    d->head_dim = ei->head_dim;
}

/* The last path component of dir, trailing slashes ignored, into out. */
static void basename_of(const char *dir, char *out, size_t n) {
    size_t end = strlen(dir);
    while (end > 1 && dir[end - 1] == '/') end--;
    size_t start = end;
    while (start > 0 && dir[start - 1] != '/') start--;
    size_t len = end - start;
    if (len >= n) len = n - 1;
    memcpy(out, dir + start, len);
    out[len] = '\0';
}

static bool valid_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 128) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == '-';
        if (!ok) return false;
    }
    return true;
}

pie_code wrk_desc_finish(wrk_desc *d, const char *name, const char *dir, const char *description,
                         uint32_t kv_page_size, uint32_t kv_pages, uint32_t embed_slots,
                         uint32_t max_batch_tokens, uint32_t max_batch_items, pie_status *st) {
    char chosen[256];
    if (name != NULL && name[0] != '\0') {
        snprintf(chosen, sizeof chosen, "%s", name);
        if (!valid_name(name))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "model.name '%.200s' must be 1..128 bytes of [A-Za-z0-9._-]",
                                  name);
    } else if (dir != NULL && dir[0] != '\0') {
        basename_of(dir, chosen, sizeof chosen);
        if (!valid_name(chosen))
            return pie_status_set(st, PIE_INVALID_ARGUMENT,
                                  "model.name defaults to the basename of model.path, '%.200s', "
                                  "which is not 1..128 bytes of [A-Za-z0-9._-]: set model.name",
                                  chosen);
    } else {
        snprintf(chosen, sizeof chosen, "null");
    }
    memcpy(d->name, chosen, strlen(chosen) + 1); /* valid_name: at most 128 bytes */
    char *desc = strdup(description ? description : "");
    if (desc == NULL) return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory");
    free(d->description);
    d->description = desc;
    d->kv_page_size = kv_page_size;
    d->kv_pages = kv_pages;
    d->embed_slots = embed_slots;
    d->max_batch_tokens = max_batch_tokens;
    d->max_batch_items = max_batch_items;
    d->max_forward_tokens = max_batch_tokens;
    d->max_top_k = d->vocab_size < WRK_MAX_TOP_K ? d->vocab_size : WRK_MAX_TOP_K;
    d->default_top_k = d->max_top_k < WRK_DEFAULT_TOP_K ? d->max_top_k : WRK_DEFAULT_TOP_K;
    return PIE_OK;
}

void wrk_desc_free(wrk_desc *d) {
    free(d->description);
    free(d->chat_template);
    free(d->bos_token);
    free(d->eos_token);
    free(d->tokenizer_json);
    d->description = NULL;
    d->chat_template = NULL;
    d->bos_token = d->eos_token = NULL;
    d->tokenizer_json = NULL;
    d->tokenizer_json_bytes = 0;
}

void wrk_desc_to_pb(const wrk_desc *d, wrk_desc_pb *pb) {
    Pie__V1__TokenizerInfo *t = &pb->tokenizer;
    pie__v1__tokenizer_info__init(t);
    t->kind = "bpe-bytelevel";
    t->tokenizer_sha256 = (char *)d->tokenizer_sha256;
    t->num_tokens = d->tokenizer_num_tokens;
    t->bos_token_id = d->bos_token_id;
    t->has_bos_token = d->has_bos_token;
    t->n_stop_token_ids = d->n_stop_token_ids;
    t->stop_token_ids = (uint32_t *)d->stop_token_ids;

    Pie__V1__ModelInfo *m = &pb->model;
    pie__v1__model_info__init(m);
    m->name = (char *)d->name;
    m->description = d->description ? d->description : "";
    m->n_traits = sizeof wrk_traits / sizeof wrk_traits[0];
    m->traits = (char **)wrk_traits;
    m->kv_page_size = d->kv_page_size;
    m->vocab_size = d->vocab_size;
    m->max_context_tokens = d->max_context_tokens;
    m->max_forward_tokens = d->max_forward_tokens;
    m->default_top_k = d->default_top_k;
    m->max_top_k = d->max_top_k;
    m->architecture = (char *)d->architecture;
    m->dtype = (char *)d->dtype;
    m->num_layers = d->num_layers;
    m->hidden_size = d->hidden_size;
    m->num_heads = d->num_heads;
    m->num_kv_heads = d->num_kv_heads;
    m->head_dim = d->head_dim;
    m->tokenizer = t;
    m->chat_template = d->chat_template ? d->chat_template : "";
    m->bos_token = d->bos_token ? d->bos_token : "";
    m->eos_token = d->eos_token ? d->eos_token : "";

    Pie__V1__WorkerCapacity *c = &pb->capacity;
    pie__v1__worker_capacity__init(c);
    c->kv_pages_max = d->kv_pages;
    c->kv_pages_effective = d->kv_pages;
    c->kv_pages_gpu = d->kv_pages;
    c->embed_slots = d->embed_slots;
    c->max_batch_tokens = d->max_batch_tokens;
    c->max_batch_items = d->max_batch_items;
}

wrk_exec_limits wrk_desc_exec_limits(const wrk_desc *d) {
    return (wrk_exec_limits){
        .kv_pages = d->kv_pages,
        .embed_slots = d->embed_slots,
        .kv_page_size = d->kv_page_size,
        .vocab_size = d->vocab_size,
        .max_context_tokens = d->max_context_tokens,
        .max_top_k = d->max_top_k,
        .default_top_k = d->default_top_k,
    };
}
