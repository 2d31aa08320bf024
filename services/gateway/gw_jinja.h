/* gw_jinja.h — the chat-template interpreter: a Jinja subset that renders a Hugging Face model's
 * `chat_template` (tokenizer_config.json) into the prompt text.
 *
 * Behaviour follows @huggingface/jinja (the reference tests/jinja compares against, byte for
 * byte): trim_blocks and lstrip_blocks on, one trailing newline of the template dropped, the
 * transformers `{% generation %}` tag removed. What is covered and where it differs from Python's
 * Jinja: services/gateway/gw_jinja.c's header comment and tests/jinja/README.md.
 *
 * Thread safety: a parsed gw_jinja is immutable; any number of threads may render it at once. */
#ifndef GW_JINJA_H
#define GW_JINJA_H

#include <jansson.h>
#include <stddef.h>

typedef struct gw_jinja
    gw_jinja; /* a parsed template, immutable, usable from many threads at once */

/* Parses src[0..len). NULL on error with a message in err ("chat template line 3: unknown tag
 * 'macro'"). err may be NULL when err_len is 0. */
gw_jinja *gw_jinja_parse(const char *src, size_t len, char *err, size_t err_len);

/* Renders with the variables of the JSON object ctx (messages, add_generation_prompt, bos_token,
 * eos_token, tools, ... any keys; NULL: none). Returns a malloc'd NUL-terminated string (*out_len
 * set), or NULL with err filled: raise_exception("m") gives exactly "m"; other errors read
 * "chat template line N: ...". Output over max_out bytes, more than GW_JINJA_MAX_ITERATIONS loop
 * iterations or GW_JINJA_MAX_STEPS of work in one render, or more than GW_JINJA_MAX_LIVE_BYTES of
 * values alive are errors, so that hostile templates end. */
char *gw_jinja_render(const gw_jinja *t, const json_t *ctx, size_t max_out, size_t *out_len,
                      char *err, size_t err_len);

void gw_jinja_free(gw_jinja *t);

/* Limits; the error message names the one exceeded.
 *   ITERATIONS  for-loop iterations, all loops of one render together
 *   LIVE_BYTES  bytes of template values alive at once in one render
 *   STEPS       work of one render: expressions evaluated plus bytes scanned
 *   NESTING     nested blocks, parentheses and operators in the source
 *   MACRO_DEPTH nested macro calls (recursion) */
#define GW_JINJA_MAX_ITERATIONS  1000000u
#define GW_JINJA_MAX_LIVE_BYTES  (256u << 20)
#define GW_JINJA_MAX_STEPS       200000000ull
#define GW_JINJA_MAX_NESTING     64
#define GW_JINJA_MAX_MACRO_DEPTH 64

#endif
