/* wrk_desc.h — what a worker announces about itself: the ModelInfo of the model it serves and
 * its WorkerCapacity, as sent in WorkerRegistration and answered by Worker/Info.
 *
 * Owns: reading the model directory's descriptive files (config.json through mdl_config_load,
 * tokenizer.json for its SHA-256, token count and bytes — kept for the registration —,
 * tokenizer_config.json for the chat template and add_bos_token), the fixed description of
 * the null backend, the limits derived from them (max_top_k, default_top_k,
 * max_forward_tokens) and the protobuf view of all of it.
 * Does not own: loading weights or pools (engine/), the link (wrk_node.c). */
#ifndef WRK_DESC_H
#define WRK_DESC_H

#include <stdbool.h>
#include <stdint.h>

#include "eng.h"
#include "mdl.h"
#include "pie/v1/common.pb-c.h"
#include "pie_status.h"
#include "wrk_exec.h"

#define WRK_DEFAULT_TOP_K 256u  /* the paper's default k */
#define WRK_MAX_TOP_K     1024u /* largest k, or the vocabulary when smaller */

typedef struct wrk_desc {
    char name[129]; /* 1..128 bytes of [A-Za-z0-9._-] */
    char *description;
    char architecture[32];
    char dtype[8];
    uint32_t kv_page_size, vocab_size, max_context_tokens, max_forward_tokens;
    uint32_t default_top_k, max_top_k;
    uint32_t num_layers, hidden_size, num_heads, num_kv_heads, head_dim;
    char tokenizer_sha256[65]; /* lowercase hex; "" for the null backend without a model */
    uint32_t tokenizer_num_tokens;
    uint32_t bos_token_id;
    bool has_bos_token;
    uint32_t stop_token_ids[MDL_MAX_EOS];
    size_t n_stop_token_ids;
    char *chat_template; /* "" when the model has none */
    char *bos_token, *eos_token; /* tokenizer_config.json's texts; NULL when it names none */
    /* tokenizer.json as read (hashes to tokenizer_sha256), sent to the controller with the
     * registration (WorkerRegistration.tokenizer_json); NULL for the null backend. */
    char *tokenizer_json;
    size_t tokenizer_json_bytes;
    /* WorkerCapacity */
    uint32_t kv_pages, embed_slots, max_batch_tokens, max_batch_items;
} wrk_desc;

/* Fills the model part of d from the files of the Hugging Face directory dir (weights are not
 * read). Errors name the file: NOT_FOUND for a missing config.json or tokenizer.json,
 * INVALID_ARGUMENT for malformed content (mdl_config_load's and tok_load's messages). On
 * failure d holds nothing to free. */
pie_code wrk_desc_load(wrk_desc *d, const char *dir, pie_status *st);

/* Fills the model part of d with the null backend's fixed model: a Llama-3-8B-shaped
 * description with vocab_size 32000 and no tokenizer. */
void wrk_desc_null_model(wrk_desc *d);

/* Overrides what the loaded engine knows better: the weights' dtype as stored, the shape. */
void wrk_desc_set_engine(wrk_desc *d, const eng_info *ei);

/* Sets the serving name (name, or when empty the basename of dir, or "null" when dir is empty
 * too), the description, the page size and the capacities, and derives the limits.
 * INVALID_ARGUMENT if the name is not 1..128 bytes of [A-Za-z0-9._-] (the message names it and
 * says which key sets it). */
pie_code wrk_desc_finish(wrk_desc *d, const char *name, const char *dir, const char *description,
                         uint32_t kv_page_size, uint32_t kv_pages, uint32_t embed_slots,
                         uint32_t max_batch_tokens, uint32_t max_batch_items, pie_status *st);

/* Frees what d holds (not d). */
void wrk_desc_free(wrk_desc *d);

/* The executor's limits for what d announces (every rank of a group uses the same). */
wrk_exec_limits wrk_desc_exec_limits(const wrk_desc *d);

/* The protobuf view of d: pointers into d, valid while d is. */
typedef struct wrk_desc_pb {
    Pie__V1__ModelInfo model;
    Pie__V1__TokenizerInfo tokenizer;
    Pie__V1__WorkerCapacity capacity;
} wrk_desc_pb;
void wrk_desc_to_pb(const wrk_desc *d, wrk_desc_pb *pb);

#endif
