/* gw_chat.h — chat messages to prompt text with the model's chat template.
 *
 * Owns: the parsed chat templates (one per distinct template text, parsed once and shared by
 * every request), the render context a template sees (messages, add_generation_prompt,
 * bos_token, eos_token, tools) and the fallback for a model without a template: ChatML.
 * Does not own: the Jinja interpreter (gw_jinja.c), the model list (gw_lc.c). */
#ifndef GW_CHAT_H
#define GW_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "gw_lc.h"
#include "gw_openai.h"

/* The ChatML template, used for models whose tokenizer_config.json has no chat_template. */
extern const char gw_chat_chatml[];

typedef struct gw_chat gw_chat;

gw_chat *gw_chat_create(void);
void gw_chat_destroy(gw_chat *c);

/* Renders messages (strings as content, gw_req_parse's form) and optional tools (NULL = none)
 * with m's template. *prompt is malloc'd, *len its length. false with e filled: 400 when the
 * template refuses the conversation (raise_exception, e.g. roles that do not alternate), 500
 * when the model's template cannot be parsed or uses what the interpreter lacks. Thread-safe. */
bool gw_chat_render(gw_chat *c, const gw_model *m, json_t *messages, json_t *tools,
                    char **prompt, size_t *len, gw_error *e);

#endif
