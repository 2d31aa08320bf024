/* gw_chat.c — chat templates: parse once, render per request (gw_chat.h). */
#include "gw_chat.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gw_jinja.h"

#define GW_CHAT_MAX_TEMPLATES 64      /* distinct templates kept parsed (one per model) */
#define GW_CHAT_MAX_PROMPT (16u << 20) /* rendered prompt bytes */

const char gw_chat_chatml[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

typedef struct gw_chat_entry {
    char *source;
    gw_jinja *tmpl; /* NULL when the source did not parse (error kept in err) */
    char err[256];
} gw_chat_entry;

struct gw_chat {
    pthread_mutex_t mu;
    gw_chat_entry entries[GW_CHAT_MAX_TEMPLATES];
    size_t n;
};

gw_chat *gw_chat_create(void) {
    gw_chat *c = calloc(1, sizeof *c);
    if (c != NULL && pthread_mutex_init(&c->mu, NULL) != 0) {
        free(c);
        return NULL;
    }
    return c;
}

void gw_chat_destroy(gw_chat *c) {
    if (c == NULL) return;
    for (size_t i = 0; i < c->n; i++) {
        free(c->entries[i].source);
        gw_jinja_free(c->entries[i].tmpl);
    }
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* The parsed template of source (parsing it the first time). Entries are never removed, so the
 * pointer stays valid; when the table is full the oldest entry's slot is not reused: the
 * template is parsed for this request only (*owned set, the caller frees it). */
static const gw_jinja *lookup(gw_chat *c, const char *source, gw_jinja **owned, char *err,
                              size_t err_len) {
    *owned = NULL;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->entries[i].source, source) == 0) {
            const gw_jinja *t = c->entries[i].tmpl;
            if (t == NULL) snprintf(err, err_len, "%s", c->entries[i].err);
            pthread_mutex_unlock(&c->mu);
            return t;
        }
    gw_jinja *t = gw_jinja_parse(source, strlen(source), err, err_len);
    char *copy = c->n < GW_CHAT_MAX_TEMPLATES ? strdup(source) : NULL;
    if (copy != NULL) {
        gw_chat_entry *e = &c->entries[c->n++];
        e->source = copy;
        e->tmpl = t;
        snprintf(e->err, sizeof e->err, "%s", t ? "" : err);
    } else {
        *owned = t;
    }
    pthread_mutex_unlock(&c->mu);
    return t;
}

static json_t *render_context(const gw_model *m, json_t *messages, json_t *tools) {
    json_t *ctx = json_pack("{s:O,s:b,s:s,s:s}", "messages", messages, "add_generation_prompt",
                            1, "bos_token", m->bos_token ? m->bos_token : "", "eos_token",
                            m->eos_token ? m->eos_token : "");
    if (ctx != NULL && tools != NULL) json_object_set(ctx, "tools", tools);
    return ctx;
}

bool gw_chat_render(gw_chat *c, const gw_model *m, json_t *messages, json_t *tools,
                    char **prompt, size_t *len, gw_error *e) {
    const char *source = m->chat_template && m->chat_template[0] ? m->chat_template
                                                                 : gw_chat_chatml;
    char err[256] = "";
    gw_jinja *owned = NULL;
    const gw_jinja *t = lookup(c, source, &owned, err, sizeof err);
    if (t == NULL)
        return gw_error_set(e, 500, "server_error", NULL, "chat_template_unsupported",
                            "the chat template of model '%s' cannot be used: %s", m->name, err);
    json_t *ctx = render_context(m, messages, tools);
    bool ok = false;
    if (ctx == NULL) {
        gw_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    } else {
        *prompt = gw_jinja_render(t, ctx, GW_CHAT_MAX_PROMPT, len, err, sizeof err);
        ok = *prompt != NULL;
        if (!ok)
            gw_error_set(e, 400, "invalid_request_error", "messages", "invalid_chat",
                         "the chat template of model '%s' rejected the messages: %s", m->name,
                         err);
    }
    json_decref(ctx);
    gw_jinja_free(owned);
    return ok;
}
