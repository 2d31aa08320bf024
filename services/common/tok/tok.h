/* tok.h — the Hugging Face byte-level BPE tokenizer (Llama 3, GPT-2 and Qwen2 styles).
 *
 * Owns: loading a `tokenizer.json`, encoding text to token ids, decoding ids to raw bytes, and
 * streaming detokenization that only ever hands out complete UTF-8. Used by workers and by
 * lifecycle replicas (inferlets tokenize locally).
 * Does not own: chat templates, BOS insertion (the post_processor is not applied: callers add
 * `<|begin_of_text|>` themselves with tok_special_id), truncation, padding.
 *
 * Threads: a loaded tok is never modified, so every function that takes a `const tok *` may run
 * on any number of threads at once. A tok_stream belongs to one thread at a time.
 *
 * Memory: ids from tok_encode and text from tok_decode are malloc'd and freed by the caller
 * with free(). Pointers from tok_token_bytes live as long as the tok. Text handed out by a
 * tok_stream lives until the next call on that stream. */
#ifndef PIE_TOK_H
#define PIE_TOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pie_status.h"

typedef struct tok tok;
typedef struct tok_stream tok_stream;

/* Loads a tokenizer.json file. Errors: PIE_NOT_FOUND (the file cannot be opened),
 * PIE_INVALID_ARGUMENT (malformed JSON or fields; the message names the file and the field),
 * PIE_UNIMPLEMENTED (a model, normalizer, pre-tokenizer or decoder type this loader does not
 * support; the message names it). */
pie_code tok_load(const char *path, tok **out, pie_status *st);

/* Same as tok_load from a JSON text of len bytes; name is used in error messages. */
pie_code tok_load_json(const char *json, size_t len, const char *name, tok **out,
                       pie_status *st);

/* NULL is fine. */
void tok_free(tok *t);

/* One past the largest token id (BPE vocab and added tokens). */
uint32_t tok_vocab_size(const tok *t);

/* The raw bytes of token id (byte-level mapping undone; an added token's content as UTF-8);
 * *len is set. NULL (and *len = 0) when id >= tok_vocab_size or no token has that id. */
const uint8_t *tok_token_bytes(const tok *t, uint32_t id, size_t *len);

/* The id of the added token whose content is exactly `content` ("<|begin_of_text|>"); -1 when
 * there is none. Looks at added_tokens only, special or not. */
int64_t tok_special_id(const tok *t, const char *content);

/* Whether id is an added token marked `"special": true`. */
bool tok_is_special(const tok *t, uint32_t id);

/* Encodes len bytes of text (need not be NUL-terminated) into *ids (malloc'd, *n of them; for
 * len 0, *ids is NULL and *n 0). Added tokens are matched first (leftmost, longest): special
 * ones only when allow_special, non-special ones always; the text between them goes through the
 * pre-tokenizer and BPE. Invalid UTF-8 is not an error: bytes that are not part of a valid
 * UTF-8 sequence match no regex alternative, so each run of them becomes its own pre-token
 * and is encoded through the byte tokens. Errors: PIE_INVALID_ARGUMENT (a byte with no token
 * and no unk_token in the model), PIE_RESOURCE_EXHAUSTED (out of memory, or the regex engine
 * hit its match limit; the message says which), PIE_INTERNAL (a custom Split regex reported a
 * match outside the text it was given, e.g. with \K). */
pie_code tok_encode(const tok *t, const char *text, size_t len, bool allow_special,
                    uint32_t **ids, size_t *n, pie_status *st);

/* The raw bytes of ids concatenated into *out (malloc'd, NUL-terminated for convenience; *len
 * excludes the NUL). The bytes may be invalid UTF-8 (a token can hold part of a character);
 * use a tok_stream for text shown to people. Errors: PIE_OUT_OF_RANGE (an id >= vocab size or
 * an id no token has; the message names its position and value). */
pie_code tok_decode(const tok *t, const uint32_t *ids, size_t n, char **out, size_t *len,
                    pie_status *st);

/* Streaming detokenizer over t (which must outlive it). */
pie_code tok_stream_new(const tok *t, tok_stream **out, pie_status *st);
void tok_stream_free(tok_stream *s);

/* Appends the bytes of ids and sets *text and *len to the newly completed UTF-8: a character split
 * across tokens is held back until its last byte arrives; a byte that can never be part of
 * valid UTF-8 becomes U+FFFD (one per maximal ill-formed subsequence). *text is valid until the
 * next call on s; it is NUL-terminated. Errors as tok_decode; on error nothing is consumed. */
pie_code tok_stream_push(tok_stream *s, const uint32_t *ids, size_t n, const char **text,
                         size_t *len, pie_status *st);

/* Ends the stream: held-back bytes of an incomplete character become one U+FFFD. The stream is
 * then empty and may be reused. */
pie_code tok_stream_finish(tok_stream *s, const char **text, size_t *len, pie_status *st);

#endif
