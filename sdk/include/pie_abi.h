/* pie_abi.h — the `pie` import module: the raw ABI between an inferlet (wasm32) and the host.
 *
 * Owns: the one definition of every host function an inferlet can import from module "pie",
 * the return convention, and the byte layouts of structs and future payloads. The host
 * (services/lifecycle/lc_host*.c) includes this file for the layouts and constants; inferlets
 * include it through sdk/include/pie.h. docs/inferlet-abi.md explains it for authors of other
 * source languages (Rust, Zig, AssemblyScript, ...): everything here is plain i32/i64/f32 and
 * little-endian bytes in linear memory.
 *
 * Conventions
 * * Every function returns i32 unless noted: >= 0 is success (a count, a length or 0), < 0 is
 *   -(gRPC status code) (PIE_ABI_E_* below). The message of the instance's last failed call is
 *   read with pie_last_error.
 * * Strings and buffers are (pointer, length) pairs of linear memory; strings are UTF-8 and
 *   not NUL-terminated. A pointer range outside linear memory ends the instance (a trap with
 *   the function's name), because it is a bug in the inferlet, not a condition to handle.
 * * Output buffers are (buf, cap): the function writes min(needed, cap) bytes and returns the
 *   length it needed, so a caller with a short buffer learns the size and retries.
 * * Object ids (queues, KV pages, embeddings, futures) are u32 chosen by the inferlet, private
 *   to the instance. Queue and future ids are non-zero.
 * * Models are named by string; an empty name (len 0) is the instance's default model.
 *
 * GPU calls (queues, pages, embeddings, embed_text, forward, next_dist, export/import) are
 * asynchronous: they return at once after checking their arguments locally; the controller
 * runs them in issue order per queue. Calls without a result that fail later (an unknown id,
 * an exhausted quota) report the failure through the next pie_synchronize future of the same
 * queue: it resolves with the first such error since the previous synchronize. Calls with a
 * result take a future id and resolve it.
 *
 * Futures: a call that arms future f makes f busy until the inferlet consumes its result with
 * pie_future_result (or drops it with pie_future_drop); arming a busy id fails with
 * PIE_ABI_E_ALREADY_EXISTS. A future resolves with a status and, when OK, a payload of bytes
 * laid out as documented at the arming function. */
#ifndef PIE_ABI_H
#define PIE_ABI_H

#include <stdint.h>

/* Error codes: pie functions return the negation (gRPC status code numbers). */
enum {
    PIE_ABI_OK = 0,
    PIE_ABI_E_CANCELLED = -1,
    PIE_ABI_E_UNKNOWN = -2,
    PIE_ABI_E_INVALID_ARGUMENT = -3,
    PIE_ABI_E_DEADLINE_EXCEEDED = -4,
    PIE_ABI_E_NOT_FOUND = -5,
    PIE_ABI_E_ALREADY_EXISTS = -6,
    PIE_ABI_E_PERMISSION_DENIED = -7,
    PIE_ABI_E_RESOURCE_EXHAUSTED = -8,
    PIE_ABI_E_FAILED_PRECONDITION = -9,
    PIE_ABI_E_ABORTED = -10,
    PIE_ABI_E_OUT_OF_RANGE = -11, /* end of input: receive after the client closed input */
    PIE_ABI_E_UNIMPLEMENTED = -12,
    PIE_ABI_E_INTERNAL = -13,
    PIE_ABI_E_UNAVAILABLE = -14,
};

/* Queue priorities (pie_set_queue_priority). */
enum { PIE_ABI_PRIORITY_NORMAL = 0, PIE_ABI_PRIORITY_LOW = 1, PIE_ABI_PRIORITY_HIGH = 2 };

/* pie_model_info fills this (all little-endian u32; 64 bytes). */
typedef struct pie_abi_model_info {
    uint32_t vocab_size;         /* rows of the LM head; distribution ids are below this */
    uint32_t num_tokens;         /* ids the tokenizer defines (<= vocab_size usually) */
    uint32_t kv_page_size;       /* tokens per KV page */
    uint32_t max_context_tokens; /* largest position + 1 */
    uint32_t max_forward_tokens; /* most inputs of one forward / embed_text / next_dist */
    uint32_t default_top_k;      /* k of next_dist with top_k 0 */
    uint32_t max_top_k;          /* largest k of next_dist */
    uint32_t bos_token_id;       /* meaningful when has_bos_token */
    uint32_t has_bos_token;      /* 1 when prompts start with bos_token_id */
    uint32_t n_stop_tokens;      /* stop (eos/eot) tokens, read with pie_model_stop_tokens */
    uint32_t num_layers, hidden_size, num_heads, num_kv_heads, head_dim;
    uint32_t reserved; /* 0 */
} pie_abi_model_info;

/* pie_forward's descriptor: 11 little-endian u32, pointers are linear-memory addresses.
 * Semantics are those of pie.v1.Forward (proto/pie/v1/controller.proto): the inputs attend to
 * the context held in kv_page_ids (every page full except the last, which holds
 * kv_page_last_len tokens), their K/V are appended into output_kv_page_ids (none = discarded),
 * and the last n_outputs inputs write their final hidden states into output_embed_ids.
 * mask_runs: an explicit attention mask as run lengths, exactly pie.v1.AttentionMask: row i
 * covers the first C + i + 1 tokens with runs alternating visible, masked, visible, ...
 * (starting visible; a leading 0 starts masked), rows concatenated; n_mask_runs 0 = causal. */
typedef struct pie_abi_forward {
    uint32_t kv_page_ids, n_kv_pages, kv_page_last_len;
    uint32_t input_embed_ids, n_inputs;
    uint32_t output_kv_page_ids, n_output_kv_pages;
    uint32_t output_embed_ids, n_outputs;
    uint32_t mask_runs, n_mask_runs;
} pie_abi_forward;

#if defined(__wasm__)
#define PIE_ABI_IMPORT(name) __attribute__((import_module("pie"), import_name(#name)))
#define PIE_ABI_PTR(type) type * /* a pointer into linear memory */
#else
#define PIE_ABI_IMPORT(name)
#define PIE_ABI_PTR(type) uint32_t /* the host sees addresses */
#endif

#if defined(__wasm__) /* the declarations below are for inferlets; the host defines Z_pieZ_* */
#define P(t) PIE_ABI_PTR(t)

/* ---- runtime ------------------------------------------------------------------------------ */
/* The message of the instance's last failed pie call (empty if none); returns its length. */
PIE_ABI_IMPORT(last_error) int32_t pie_last_error(P(char) buf, uint32_t cap);
/* This instance's id (InstanceInfo.instance_id). Arguments are WASI argv (args_get). */
PIE_ABI_IMPORT(instance_id) int64_t pie_instance_id(void);
/* Sends a message to the attached client (buffered while none is attached; the oldest buffered
 * output is dropped beyond the replica's instances.output_buffer). Never dropped while a client
 * is attached: blocks while that much output already waits for a slow client (until it reads,
 * detaches, the instance is terminated or its wall_ms quota ends it); stdout/stderr writes
 * share the stream and block alike. INVALID_ARGUMENT above ResourceLimits.message_bytes. */
PIE_ABI_IMPORT(send) int32_t pie_send(P(const void) msg, uint32_t len);
/* Arms future f with the next client message. Payload: the message bytes. Resolves with
 * OUT_OF_RANGE "input closed" once the client closed its input and every message was read. */
PIE_ABI_IMPORT(receive) int32_t pie_receive(uint32_t f);

/* ---- futures ------------------------------------------------------------------------------ */
/* 1 if f is resolved, 0 if pending; NOT_FOUND if f is not armed. */
PIE_ABI_IMPORT(future_poll) int32_t pie_future_poll(uint32_t f);
/* Waits until f resolves (1) or timeout_ms passes (0); timeout_ms < 0 waits without limit. */
PIE_ABI_IMPORT(future_wait) int32_t pie_future_wait(uint32_t f, int64_t timeout_ms);
/* Waits until one of the n futures at ids resolves; returns its index (the lowest if several
 * are ready), or DEADLINE_EXCEEDED after timeout_ms (< 0: no limit). */
PIE_ABI_IMPORT(future_wait_any)
int32_t pie_future_wait_any(P(const uint32_t) ids, uint32_t n, int64_t timeout_ms);
/* Waits for f, then: OK → copies min(len, cap) payload bytes to buf and returns len; f is
 * released only if cap >= len (otherwise call again with a larger buffer). Failed → releases
 * f and returns -code (message: pie_last_error). */
PIE_ABI_IMPORT(future_result) int32_t pie_future_result(uint32_t f, P(void) buf, uint32_t cap);
/* Releases f now; a result still to come is discarded. NOT_FOUND if f is not armed. */
PIE_ABI_IMPORT(future_drop) int32_t pie_future_drop(uint32_t f);

/* ---- models and traits -------------------------------------------------------------------- */
/* Number of models the cluster serves now. */
PIE_ABI_IMPORT(model_count) int32_t pie_model_count(void);
/* Name of model i (0 <= i < pie_model_count(), ordered by name). */
PIE_ABI_IMPORT(model_name) int32_t pie_model_name(uint32_t i, P(char) buf, uint32_t cap);
/* Fills *info (a pie_abi_model_info); NOT_FOUND for an unknown model. */
PIE_ABI_IMPORT(model_info)
int32_t pie_model_info(P(const char) model, uint32_t model_len, P(pie_abi_model_info) info);
/* The model's traits ("allocate", "forward", "input_text", "tokenize", "output_text", ...),
 * separated by '\n'. */
PIE_ABI_IMPORT(model_traits)
int32_t pie_model_traits(P(const char) model, uint32_t model_len, P(char) buf, uint32_t cap);
/* Copies up to cap stop token ids (u32) and returns how many the model has. */
PIE_ABI_IMPORT(model_stop_tokens)
int32_t pie_model_stop_tokens(P(const char) model, uint32_t model_len, P(uint32_t) ids,
                              uint32_t cap);

/* ---- tokenizer (answered in-process) ------------------------------------------------------ */
/* Encodes text; special tokens ("<|eot_id|>") are matched when allow_special is 1. Copies up
 * to cap ids and returns how many the text has. */
PIE_ABI_IMPORT(tokenize)
int32_t pie_tokenize(P(const char) model, uint32_t model_len, P(const char) text,
                     uint32_t text_len, uint32_t allow_special, P(uint32_t) ids, uint32_t cap);
/* Raw bytes of the ids (may end inside a UTF-8 character; the SDK's streaming decoder holds
 * such bytes back). OUT_OF_RANGE for an id the tokenizer lacks. */
PIE_ABI_IMPORT(detokenize)
int32_t pie_detokenize(P(const char) model, uint32_t model_len, P(const uint32_t) ids,
                       uint32_t n, P(char) buf, uint32_t cap);
/* Raw bytes of one token (vocabulary access); OUT_OF_RANGE for an unknown id. */
PIE_ABI_IMPORT(token_bytes)
int32_t pie_token_bytes(P(const char) model, uint32_t model_len, uint32_t id, P(char) buf,
                        uint32_t cap);

/* ---- command queues ----------------------------------------------------------------------- */
/* Creates queue q on a model (empty = default). */
PIE_ABI_IMPORT(create_queue)
int32_t pie_create_queue(uint32_t q, P(const char) model, uint32_t model_len);
PIE_ABI_IMPORT(destroy_queue) int32_t pie_destroy_queue(uint32_t q);
PIE_ABI_IMPORT(set_queue_priority) int32_t pie_set_queue_priority(uint32_t q, uint32_t priority);
/* Arms f: resolves once every earlier call on q completed, with the first deferred error of
 * q since the previous synchronize (or OK). Empty payload. */
PIE_ABI_IMPORT(synchronize) int32_t pie_synchronize(uint32_t q, uint32_t f);

/* ---- KV pages and embeddings -------------------------------------------------------------- */
PIE_ABI_IMPORT(alloc_kv_pages)
int32_t pie_alloc_kv_pages(uint32_t q, P(const uint32_t) ids, uint32_t n);
PIE_ABI_IMPORT(dealloc_kv_pages)
int32_t pie_dealloc_kv_pages(uint32_t q, P(const uint32_t) ids, uint32_t n);
PIE_ABI_IMPORT(alloc_embeds) int32_t pie_alloc_embeds(uint32_t q, P(const uint32_t) ids, uint32_t n);
PIE_ABI_IMPORT(dealloc_embeds)
int32_t pie_dealloc_embeds(uint32_t q, P(const uint32_t) ids, uint32_t n);
/* Copies token_count tokens of K/V and mask from src[src_offset..] to dst[dst_offset..]. */
PIE_ABI_IMPORT(copy_kv_page)
int32_t pie_copy_kv_page(uint32_t q, uint32_t src, uint32_t dst, uint32_t src_offset,
                         uint32_t dst_offset, uint32_t token_count);
/* Sets page's per-token mask: masked[i] != 0 hides token i; n must equal kv_page_size. */
PIE_ABI_IMPORT(mask_kv_page)
int32_t pie_mask_kv_page(uint32_t q, uint32_t page, P(const uint8_t) masked, uint32_t n);
/* Publishes pages under a cluster-wide name; persistent != 0 outlives this instance. */
PIE_ABI_IMPORT(export_kv_pages)
int32_t pie_export_kv_pages(uint32_t q, P(const uint32_t) ids, uint32_t n, P(const char) name,
                            uint32_t name_len, uint32_t persistent);
PIE_ABI_IMPORT(unexport_kv_pages)
int32_t pie_unexport_kv_pages(uint32_t q, P(const char) name, uint32_t name_len);
/* Arms f: binds ids[0..page_count) to the export's pages. Payload: u32 page_count, then
 * page_count u32 ids. */
PIE_ABI_IMPORT(import_kv_pages)
int32_t pie_import_kv_pages(uint32_t q, P(const uint32_t) ids, uint32_t n, P(const char) name,
                            uint32_t name_len, uint32_t f);
/* Arms f with the current exports. Payload: u32 count, then per export: u32 name_len, name,
 * u32 model_len, model, u32 page_count, u32 persistent, u64 exporter_instance_id. */
PIE_ABI_IMPORT(list_exports) int32_t pie_list_exports(uint32_t f);

/* ---- embed, forward, distributions -------------------------------------------------------- */
/* Writes the embedding of tokens[i] at positions[i] into embeds[i], i < n. */
PIE_ABI_IMPORT(embed_text)
int32_t pie_embed_text(uint32_t q, P(const uint32_t) embeds, P(const uint32_t) tokens,
                       P(const uint32_t) positions, uint32_t n);
/* Runs the model; see pie_abi_forward. */
PIE_ABI_IMPORT(forward) int32_t pie_forward(uint32_t q, P(const pie_abi_forward) desc);
/* Arms f with the top-k next-token distribution of each of the n embeddings (k 0 = default;
 * temperature 0 = 1.0). Payload: per embedding, u32 k, k u32 token ids, k f32 probabilities
 * (descending). */
PIE_ABI_IMPORT(next_dist)
int32_t pie_next_dist(uint32_t q, P(const uint32_t) embeds, uint32_t n, uint32_t top_k,
                      float temperature, uint32_t f);

/* ---- messaging between inferlets ---------------------------------------------------------- */
PIE_ABI_IMPORT(broadcast)
int32_t pie_broadcast(P(const char) topic, uint32_t topic_len, P(const void) msg, uint32_t len);
PIE_ABI_IMPORT(subscribe) int32_t pie_subscribe(P(const char) topic, uint32_t topic_len);
PIE_ABI_IMPORT(unsubscribe) int32_t pie_unsubscribe(P(const char) topic, uint32_t topic_len);
/* Arms f with the next broadcast delivered to this instance. Payload: u32 topic_len, topic,
 * then the message bytes (the rest). */
PIE_ABI_IMPORT(subscription_receive) int32_t pie_subscription_receive(uint32_t f);

/* ---- outbound HTTP ------------------------------------------------------------------------ */
/* Arms f with an HTTP request: method "GET" or "POST", headers as "Name: value" lines
 * separated by '\n' (may be empty), body for POST. URLs must match the replica's allowlist
 * (PERMISSION_DENIED otherwise). Payload: u32 HTTP status, then the response body. Fails
 * with DEADLINE_EXCEEDED on timeout and RESOURCE_EXHAUSTED above the response size cap. */
PIE_ABI_IMPORT(http_request)
int32_t pie_http_request(P(const char) method, uint32_t method_len, P(const char) url,
                         uint32_t url_len, P(const char) headers, uint32_t headers_len,
                         P(const void) body, uint32_t body_len, uint32_t f);

#undef P
#endif /* __wasm__ */

#endif
