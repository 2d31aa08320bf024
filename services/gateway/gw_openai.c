/* gw_openai.c — OpenAI request parsing, the inferlet's messages, response JSON (gw_openai.h). */
#include "gw_openai.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "pie_utf8.h"

bool gw_error_set(gw_error *e, int http_status, const char *type, const char *param,
                  const char *code, const char *fmt, ...) {
    e->http_status = http_status;
    e->type = type;
    e->param = param;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return false;
}

static json_t *str_or_null(const char *s) { return s ? json_string(s) : json_null(); }

char *gw_error_json(const gw_error *e) {
    json_t *inner = json_object();
    json_t *root = json_object();
    if (inner == NULL || root == NULL) goto fail;
    json_object_set_new(inner, "message", gw_json_text(e->message, strlen(e->message)));
    json_object_set_new(inner, "type", json_string(e->type ? e->type : "server_error"));
    json_object_set_new(inner, "param", str_or_null(e->param));
    json_object_set_new(inner, "code", str_or_null(e->code));
    json_object_set_new(root, "error", inner);
    char *out = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return out;
fail:
    json_decref(inner);
    json_decref(root);
    return NULL;
}

void gw_error_from_status(const pie_status *st, gw_error *e) {
    switch (st->code) {
    case PIE_UNAUTHENTICATED:
        gw_error_set(e, 401, "invalid_request_error", NULL, "invalid_api_key",
                     "Incorrect API key provided: %s", st->msg);
        break;
    case PIE_PERMISSION_DENIED:
        gw_error_set(e, 403, "invalid_request_error", NULL, "permission_denied", "%s", st->msg);
        break;
    case PIE_NOT_FOUND:
        gw_error_set(e, 404, "invalid_request_error", "model", "model_not_found", "%s", st->msg);
        break;
    case PIE_INVALID_ARGUMENT:
    case PIE_OUT_OF_RANGE:
    case PIE_FAILED_PRECONDITION:
        gw_error_set(e, 400, "invalid_request_error", NULL, NULL, "%s", st->msg);
        break;
    case PIE_RESOURCE_EXHAUSTED:
        gw_error_set(e, 429, "rate_limit_error", NULL, "rate_limit_exceeded", "%s", st->msg);
        break;
    case PIE_UNAVAILABLE:
        gw_error_set(e, 503, "server_error", NULL, "service_unavailable",
                     "no lifecycle replica could serve the request: %s", st->msg);
        break;
    case PIE_DEADLINE_EXCEEDED:
        gw_error_set(e, 504, "server_error", NULL, "timeout", "%s", st->msg);
        break;
    default:
        gw_error_set(e, 500, "server_error", NULL, NULL, "%s: %s", pie_code_name(st->code),
                     st->msg);
    }
}

/* ------------------------------------------------------------------------------------------
 * UTF-8 */

json_t *gw_json_text(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    char *buf = malloc(len * 3 + 1); /* each invalid byte grows to 3 (U+FFFD) */
    if (buf == NULL) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t k = pie_utf8_next(u + i, len - i, NULL);
        if (k == 0) {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        } else {
            memcpy(buf + o, u + i, k);
            o += k;
            i += k;
        }
    }
    json_t *v = json_stringn(buf, o);
    free(buf);
    return v;
}

/* ------------------------------------------------------------------------------------------
 * Requests */

/* A field that is absent or JSON null counts as not given (OpenAI's clients send nulls). */
static json_t *field(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

static bool number_in(json_t *obj, const char *key, double lo, double hi, double *out,
                      gw_error *e) {
    json_t *v = field(obj, key);
    if (v == NULL) return true;
    if (!json_is_number(v))
        return gw_error_set(e, 400, "invalid_request_error", key, "invalid_type",
                            "Invalid type for '%s': expected a number.", key);
    double x = json_number_value(v);
    if (!(x >= lo))
        return gw_error_set(e, 400, "invalid_request_error", key, "decimal_below_min_value",
                            "Invalid '%s': decimal below minimum value. Expected a value >= %g, "
                            "but got %g instead.", key, lo, x);
    if (!(x <= hi))
        return gw_error_set(e, 400, "invalid_request_error", key, "decimal_above_max_value",
                            "Invalid '%s': decimal above maximum value. Expected a value <= %g, "
                            "but got %g instead.", key, hi, x);
    *out = x;
    return true;
}

static bool integer_in(json_t *obj, const char *key, int64_t lo, int64_t hi, int64_t *out,
                       bool *given, gw_error *e) {
    json_t *v = field(obj, key);
    if (given) *given = v != NULL;
    if (v == NULL) return true;
    if (!json_is_integer(v))
        return gw_error_set(e, 400, "invalid_request_error", key, "invalid_type",
                            "Invalid type for '%s': expected an integer.", key);
    json_int_t x = json_integer_value(v);
    if (x < lo)
        return gw_error_set(e, 400, "invalid_request_error", key, "integer_below_min_value",
                            "Invalid '%s': integer below minimum value. Expected a value >= %" PRId64
                            ", but got %" PRId64 " instead.", key, lo, (int64_t)x);
    if (x > hi)
        return gw_error_set(e, 400, "invalid_request_error", key, "integer_above_max_value",
                            "Invalid '%s': integer above maximum value. Expected a value <= %" PRId64
                            ", but got %" PRId64 " instead.", key, hi, (int64_t)x);
    *out = (int64_t)x;
    return true;
}

static bool boolean(json_t *obj, const char *key, bool *out, gw_error *e) {
    json_t *v = field(obj, key);
    if (v == NULL) return true;
    if (!json_is_boolean(v))
        return gw_error_set(e, 400, "invalid_request_error", key, "invalid_type",
                            "Invalid type for '%s': expected a boolean.", key);
    *out = json_is_true(v);
    return true;
}

static bool oom(gw_error *e) {
    return gw_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
}

static bool parse_stop(json_t *obj, gw_req *r, gw_error *e) {
    json_t *v = field(obj, "stop");
    if (v == NULL) return true;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    json_t *arr = NULL;
    if (json_is_array(v)) {
        arr = v;
        n = json_array_size(arr);
        if (n > GW_MAX_STOP)
            return gw_error_set(e, 400, "invalid_request_error", "stop", "array_above_max_length",
                                "Invalid 'stop': array too long. Expected an array with maximum "
                                "length %d, but got an array with length %zu instead.",
                                GW_MAX_STOP, n);
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = arr ? json_array_get(arr, i) : items[i];
        if (!json_is_string(s))
            return gw_error_set(e, 400, "invalid_request_error", "stop", "invalid_type",
                                "Invalid type for 'stop': expected a string or an array of "
                                "strings.");
        if (json_string_length(s) == 0) continue; /* an empty stop string stops nothing */
        char *copy = strndup(json_string_value(s), json_string_length(s));
        if (copy == NULL) return oom(e);
        r->stop[r->n_stop++] = copy;
    }
    return true;
}

/* completions' "prompt": a string, or an array holding exactly one string. */
static bool parse_prompt(json_t *obj, gw_req *r, gw_error *e) {
    json_t *v = field(obj, "prompt");
    if (json_is_array(v)) {
        if (json_array_size(v) != 1 || !json_is_string(json_array_get(v, 0)))
            return gw_error_set(e, 400, "invalid_request_error", "prompt", "unsupported_value",
                                "'prompt' must be a string or an array of one string: batches "
                                "and token-id prompts are not supported; send one request per "
                                "prompt.");
        v = json_array_get(v, 0);
    }
    if (!json_is_string(v))
        return gw_error_set(e, 400, "invalid_request_error", "prompt",
                            v ? "invalid_type" : "missing_required_parameter",
                            v ? "Invalid type for 'prompt': expected a string."
                              : "Missing required parameter: 'prompt'.");
    r->prompt = strndup(json_string_value(v), json_string_length(v));
    return r->prompt ? true : oom(e);
}

/* The text of a message's content: a string, null, or an array of {"type":"text","text":..}
 * parts joined. New reference, or NULL with e filled. */
static json_t *content_text(json_t *content, size_t index, gw_error *e) {
    if (content == NULL || json_is_null(content)) return json_string("");
    if (json_is_string(content)) return json_incref(content);
    if (!json_is_array(content)) {
        gw_error_set(e, 400, "invalid_request_error", "messages", "invalid_type",
                     "Invalid type for 'messages[%zu].content': expected a string or an array "
                     "of content parts.", index);
        return NULL;
    }
    size_t total = 0, i;
    json_t *part;
    json_array_foreach(content, i, part) {
        const char *type = json_string_value(json_object_get(part, "type"));
        json_t *text = json_object_get(part, "text");
        if (type == NULL || strcmp(type, "text") != 0 || !json_is_string(text)) {
            gw_error_set(e, 400, "invalid_request_error", "messages", "unsupported_value",
                         "'messages[%zu].content[%zu]': only text parts are supported (this "
                         "model takes no images, audio or files).", index, i);
            return NULL;
        }
        total += json_string_length(text);
    }
    char *buf = malloc(total + 1);
    if (buf == NULL) return (void)oom(e), NULL;
    size_t o = 0;
    json_array_foreach(content, i, part) {
        json_t *text = json_object_get(part, "text");
        memcpy(buf + o, json_string_value(text), json_string_length(text));
        o += json_string_length(text);
    }
    json_t *s = json_stringn(buf, o);
    free(buf);
    if (s == NULL) oom(e);
    return s;
}

/* chat's "messages": a non-empty array of objects with a string role; a copy where every
 * content is a string (what chat templates expect). */
static bool parse_messages(json_t *obj, gw_req *r, gw_error *e) {
    json_t *v = field(obj, "messages");
    if (v == NULL)
        return gw_error_set(e, 400, "invalid_request_error", "messages",
                            "missing_required_parameter", "Missing required parameter: 'messages'.");
    if (!json_is_array(v) || json_array_size(v) == 0)
        return gw_error_set(e, 400, "invalid_request_error", "messages",
                            json_is_array(v) ? "empty_array" : "invalid_type",
                            "Invalid 'messages': expected a non-empty array of messages.");
    r->messages = json_array();
    if (r->messages == NULL) return oom(e);
    size_t i;
    json_t *m;
    json_array_foreach(v, i, m) {
        if (!json_is_object(m) || !json_is_string(json_object_get(m, "role")))
            return gw_error_set(e, 400, "invalid_request_error", "messages", "invalid_type",
                                "Invalid 'messages[%zu]': expected an object with a string "
                                "'role'.", i);
        json_t *copy = json_copy(m);
        json_t *text = copy ? content_text(json_object_get(m, "content"), i, e) : NULL;
        if (copy == NULL || text == NULL) {
            json_decref(copy);
            return copy == NULL ? oom(e) : false;
        }
        json_object_set_new(copy, "content", text);
        if (json_array_append_new(r->messages, copy) != 0) return oom(e);
    }
    return true;
}

/* chat's "tools": an array the chat template may render (tool calls in the output are not
 * parsed: docs/openai.md). */
static bool parse_tools(json_t *obj, gw_req *r, gw_error *e) {
    json_t *v = field(obj, "tools");
    if (v == NULL) return true;
    if (!json_is_array(v))
        return gw_error_set(e, 400, "invalid_request_error", "tools", "invalid_type",
                            "Invalid type for 'tools': expected an array.");
    r->tools = json_deep_copy(v);
    return r->tools ? true : oom(e);
}

static bool parse_logprobs(json_t *obj, gw_req *r, gw_error *e) {
    int64_t k = 0;
    if (r->endpoint == GW_COMPLETIONS) { /* logprobs: an integer, the alternatives wanted */
        bool given = false;
        if (!integer_in(obj, "logprobs", 0, GW_MAX_TOP_LOGPROBS, &k, &given, e)) return false;
        r->logprobs = given;
        r->top_logprobs = (uint32_t)k;
        return true;
    }
    if (!boolean(obj, "logprobs", &r->logprobs, e)) return false;
    bool given = false;
    if (!integer_in(obj, "top_logprobs", 0, GW_MAX_TOP_LOGPROBS, &k, &given, e)) return false;
    if (given && k > 0 && !r->logprobs)
        return gw_error_set(e, 400, "invalid_request_error", "top_logprobs", "invalid_value",
                            "Invalid value for 'top_logprobs': 'logprobs' must be set to true "
                            "when 'top_logprobs' is used.");
    r->top_logprobs = (uint32_t)k;
    return true;
}

static bool parse_limits(json_t *obj, gw_req *r, gw_error *e) {
    int64_t mt = r->endpoint == GW_COMPLETIONS ? 16 : 0; /* OpenAI's defaults */
    bool given = false;
    const char *key = "max_tokens";
    if (r->endpoint == GW_CHAT && field(obj, "max_completion_tokens")) key = "max_completion_tokens";
    if (!integer_in(obj, key, 1, UINT32_MAX, &mt, &given, e)) return false;
    r->max_tokens = (uint32_t)mt;
    int64_t n = 1;
    if (!integer_in(obj, "n", 1, GW_MAX_N, &n, NULL, e)) return false;
    r->n = (uint32_t)n;
    return integer_in(obj, "seed", INT64_MIN, INT64_MAX, &r->seed, &r->has_seed, e);
}

static bool parse_sampling(json_t *obj, gw_req *r, gw_error *e) {
    r->temperature = 1;
    r->top_p = 1;
    return number_in(obj, "temperature", 0, 2, &r->temperature, e) &&
           number_in(obj, "top_p", 0, 1, &r->top_p, e) &&
           number_in(obj, "presence_penalty", -2, 2, &r->presence_penalty, e) &&
           number_in(obj, "frequency_penalty", -2, 2, &r->frequency_penalty, e) &&
           boolean(obj, "ignore_eos", &r->ignore_eos, e);
}

static bool parse_stream(json_t *obj, gw_req *r, gw_error *e) {
    if (!boolean(obj, "stream", &r->stream, e)) return false;
    json_t *so = field(obj, "stream_options");
    if (so == NULL) return true;
    if (!json_is_object(so))
        return gw_error_set(e, 400, "invalid_request_error", "stream_options", "invalid_type",
                            "Invalid type for 'stream_options': expected an object.");
    return boolean(so, "include_usage", &r->include_usage, e);
}

static bool parse_model(json_t *obj, gw_req *r, gw_error *e) {
    json_t *v = field(obj, "model");
    if (!json_is_string(v) || json_string_length(v) == 0)
        return gw_error_set(e, 400, "invalid_request_error", "model",
                            v ? "invalid_type" : "missing_required_parameter",
                            v ? "Invalid 'model': expected a non-empty string."
                              : "Missing required parameter: 'model'.");
    r->model = strdup(json_string_value(v));
    return r->model ? true : oom(e);
}

bool gw_req_parse(gw_endpoint endpoint, const char *body, size_t len, gw_req *r, gw_error *e) {
    memset(r, 0, sizeof *r);
    r->endpoint = endpoint;
    json_error_t jerr;
    json_t *obj = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (obj == NULL)
        return gw_error_set(e, 400, "invalid_request_error", NULL, NULL,
                            "We could not parse the JSON body of your request: %s (line %d, "
                            "column %d). The OpenAI API expects a JSON payload.",
                            jerr.text, jerr.line, jerr.column);
    bool ok = json_is_object(obj) ||
              gw_error_set(e, 400, "invalid_request_error", NULL, NULL,
                           "The request body must be a JSON object.");
    ok = ok && parse_model(obj, r, e) &&
         (endpoint == GW_CHAT ? parse_messages(obj, r, e) && parse_tools(obj, r, e)
                              : parse_prompt(obj, r, e)) &&
         parse_limits(obj, r, e) && parse_sampling(obj, r, e) && parse_stop(obj, r, e) &&
         parse_logprobs(obj, r, e) && parse_stream(obj, r, e);
    json_decref(obj);
    if (!ok) gw_req_free(r);
    return ok;
}

void gw_req_free(gw_req *r) {
    free(r->model);
    free(r->prompt);
    json_decref(r->messages);
    json_decref(r->tools);
    for (size_t i = 0; i < r->n_stop; i++) free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

/* ------------------------------------------------------------------------------------------
 * Launch arguments */

typedef struct argv_buf {
    char **v;
    size_t n, cap;
    bool failed;
} argv_buf;

static void arg_push(argv_buf *a, const char *s) {
    if (a->failed) return;
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 16;
        char **v = realloc(a->v, cap * sizeof *v);
        if (v == NULL) {
            a->failed = true;
            return;
        }
        a->v = v;
        a->cap = cap;
    }
    char *copy = strdup(s);
    if (copy == NULL) a->failed = true;
    else a->v[a->n++] = copy;
}

static void arg_pushf(argv_buf *a, const char *flag, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void arg_pushf(argv_buf *a, const char *flag, const char *fmt, ...) {
    char buf[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    arg_push(a, flag);
    arg_push(a, buf);
}

bool gw_req_args(const gw_req *r, char ***args, size_t *n) {
    argv_buf a = {0};
    arg_pushf(&a, "--max-tokens", "%" PRIu32, r->max_tokens);
    /* top_p = 0 keeps only the most likely token: greedy, as the OpenAI API describes it. */
    double temperature = r->top_p == 0 ? 0 : r->temperature;
    arg_pushf(&a, "--temperature", "%.17g", temperature);
    if (r->top_p < 1 && r->top_p > 0) arg_pushf(&a, "--top-p", "%.17g", r->top_p);
    if (r->has_seed) arg_pushf(&a, "--seed", "%" PRId64, r->seed);
    if (r->n > 1) arg_pushf(&a, "--n", "%" PRIu32, r->n);
    for (size_t i = 0; i < r->n_stop; i++) {
        arg_push(&a, "--stop");
        arg_push(&a, r->stop[i]);
    }
    if (r->logprobs) arg_pushf(&a, "--logprobs", "%" PRIu32, r->top_logprobs);
    if (r->presence_penalty != 0) arg_pushf(&a, "--presence-penalty", "%.17g", r->presence_penalty);
    if (r->frequency_penalty != 0)
        arg_pushf(&a, "--frequency-penalty", "%.17g", r->frequency_penalty);
    if (r->endpoint == GW_CHAT) arg_push(&a, "--chat");
    if (r->ignore_eos) arg_push(&a, "--ignore-eos");
    if (a.failed) {
        gw_args_free(a.v, a.n);
        return false;
    }
    *args = a.v;
    *n = a.n;
    return true;
}

void gw_args_free(char **args, size_t n) {
    for (size_t i = 0; i < n; i++) free(args[i]);
    free(args);
}

/* ------------------------------------------------------------------------------------------
 * Results */

bool gw_result_init(gw_result *res, const gw_req *r) {
    memset(res, 0, sizeof *res);
    res->endpoint = r->endpoint;
    res->n = r->n;
    res->model = r->model;
    res->created = (int64_t)time(NULL);
    res->choices = calloc(r->n, sizeof *res->choices);
    if (res->choices == NULL) return false;
    uint8_t rnd[12];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
        struct timespec ts; /* ids need to be unique, not secret: a clock fallback will do */
        clock_gettime(CLOCK_REALTIME, &ts);
        memcpy(rnd, &ts, sizeof rnd < sizeof ts ? sizeof rnd : sizeof ts);
    }
    int o = snprintf(res->id, sizeof res->id, "%s", r->endpoint == GW_CHAT ? "chatcmpl-" : "cmpl-");
    for (size_t i = 0; i < sizeof rnd; i++) o += snprintf(res->id + o, sizeof res->id - (size_t)o, "%02x", rnd[i]);
    return true;
}

void gw_result_free(gw_result *res) {
    for (uint32_t i = 0; res->choices && i < res->n; i++) {
        free(res->choices[i].text);
        json_decref(res->choices[i].logprobs);
    }
    free(res->choices);
    json_decref(res->last);
    memset(res, 0, sizeof *res);
}

static bool protocol_error(gw_error *e, const char *what) {
    return gw_error_set(e, 500, "server_error", NULL, NULL,
                        "the generation program sent a message the gateway does not understand "
                        "(%s)", what);
}

static bool text_append(gw_choice *c, const char *s, size_t len) {
    if (c->text_len + len + 1 > c->text_cap) {
        size_t cap = c->text_cap ? c->text_cap : 256;
        while (cap < c->text_len + len + 1) cap *= 2;
        char *t = realloc(c->text, cap);
        if (t == NULL) return false;
        c->text = t;
        c->text_cap = cap;
    }
    memcpy(c->text + c->text_len, s, len);
    c->text_len += len;
    c->text[c->text_len] = '\0';
    return true;
}

/* The token text of an inferlet token object {"id","bytes":[..],"logprob"}: its bytes as a
 * JSON string (invalid UTF-8 → U+FFFD) and as the bytes array. */
static json_t *token_text(json_t *tok, json_t **bytes_out) {
    json_t *bytes = json_object_get(tok, "bytes");
    if (!json_is_array(bytes)) return NULL;
    size_t n = json_array_size(bytes);
    char *buf = malloc(n + 1);
    if (buf == NULL) return NULL;
    for (size_t i = 0; i < n; i++) {
        json_int_t b = json_integer_value(json_array_get(bytes, i));
        buf[i] = (char)(unsigned char)(b & 0xFF);
    }
    json_t *s = gw_json_text(buf, n);
    free(buf);
    *bytes_out = bytes;
    return s;
}

/* A logprob for JSON: finite (OpenAI writes -9999.0 for an impossible token). */
static json_t *logprob_value(json_t *tok) {
    double lp = json_number_value(json_object_get(tok, "logprob"));
    return json_real(isfinite(lp) ? lp : -9999.0);
}

/* chat: {"token","logprob","bytes","top_logprobs":[{"token","logprob","bytes"}]} */
static json_t *chat_logprob_entry(json_t *tok) {
    json_t *bytes = NULL;
    json_t *text = token_text(tok, &bytes);
    json_t *top = json_array();
    json_t *entry = json_object();
    if (text == NULL || top == NULL || entry == NULL) goto fail;
    json_object_set_new(entry, "token", text);
    json_object_set_new(entry, "logprob", logprob_value(tok));
    json_object_set(entry, "bytes", bytes);
    size_t i;
    json_t *alt;
    json_array_foreach(json_object_get(tok, "top"), i, alt) {
        json_t *abytes = NULL;
        json_t *atext = token_text(alt, &abytes);
        json_t *a = json_object();
        if (atext == NULL || a == NULL) {
            json_decref(atext);
            json_decref(a);
            goto fail_entry;
        }
        json_object_set_new(a, "token", atext);
        json_object_set_new(a, "logprob", logprob_value(alt));
        json_object_set(a, "bytes", abytes);
        json_array_append_new(top, a);
    }
    json_object_set_new(entry, "top_logprobs", top);
    return entry;
fail:
    json_decref(text);
fail_entry:
    json_decref(top);
    json_decref(entry);
    return NULL;
}

/* completions: {"tokens":[t],"token_logprobs":[l],"top_logprobs":[{t:l,..}],"text_offset":[o]}
 * for one token at text offset `offset`. */
static json_t *completion_logprob_entry(json_t *tok, size_t offset) {
    json_t *bytes = NULL;
    json_t *text = token_text(tok, &bytes);
    json_t *top = json_object();
    json_t *entry = json_object();
    if (text == NULL || top == NULL || entry == NULL) {
        json_decref(text);
        json_decref(top);
        json_decref(entry);
        return NULL;
    }
    size_t i;
    json_t *alt;
    json_array_foreach(json_object_get(tok, "top"), i, alt) {
        json_t *abytes = NULL;
        json_t *atext = token_text(alt, &abytes);
        if (atext == NULL) continue;
        json_object_set_new(top, json_string_value(atext), logprob_value(alt));
        json_decref(atext);
    }
    json_object_set_new(entry, "tokens", json_pack("[o]", text));
    json_object_set_new(entry, "token_logprobs", json_pack("[o]", logprob_value(tok)));
    json_object_set_new(entry, "top_logprobs", json_pack("[o]", top));
    json_object_set_new(entry, "text_offset", json_pack("[I]", (json_int_t)offset));
    return entry;
}

/* Appends this token's logprob entry to the choice's accumulated logprobs. */
static bool logprobs_accumulate(gw_result *res, gw_choice *c, json_t *entry) {
    if (res->endpoint == GW_CHAT) {
        if (c->logprobs == NULL && (c->logprobs = json_array()) == NULL) return false;
        return json_array_append(c->logprobs, entry) == 0;
    }
    if (c->logprobs == NULL) {
        c->logprobs = json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs",
                                "top_logprobs", "text_offset");
        if (c->logprobs == NULL) return false;
    }
    const char *keys[] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
    for (size_t k = 0; k < 4; k++)
        if (json_array_extend(json_object_get(c->logprobs, keys[k]),
                              json_object_get(entry, keys[k])) != 0)
            return false;
    return true;
}

static bool apply_error(json_t *msg, gw_event *ev, gw_error *e, gw_endpoint endpoint) {
    json_t *err = json_object_get(msg, "error");
    const char *code = json_string_value(json_object_get(err, "code"));
    const char *text = json_string_value(json_object_get(err, "message"));
    static const char *const known[] = {"context_length_exceeded", "invalid_value"};
    const char *stable = NULL; /* e->code must outlive msg: map onto static strings */
    for (size_t i = 0; code && i < sizeof known / sizeof known[0]; i++)
        if (strcmp(code, known[i]) == 0) stable = known[i];
    ev->kind = GW_EV_ERROR;
    gw_error_set(e, 400, "invalid_request_error",
                 stable == known[0] ? (endpoint == GW_CHAT ? "messages" : "prompt") : NULL,
                 stable, "%s", text && text[0] ? text : "the request cannot be served");
    return true;
}

static bool apply_token(gw_result *res, json_t *msg, gw_event *ev, gw_error *e) {
    json_t *c = json_object_get(msg, "c");
    json_t *text = json_object_get(msg, "text");
    if (!json_is_integer(c) || json_integer_value(c) < 0 ||
        (uint64_t)json_integer_value(c) >= res->n || !json_is_string(text))
        return protocol_error(e, "a token message without a valid choice index and text");
    gw_choice *ch = &res->choices[json_integer_value(c)];
    ev->kind = GW_EV_TOKEN;
    ev->choice = (uint32_t)json_integer_value(c);
    ev->text = json_string_value(text);
    ev->text_len = json_string_length(text);
    json_t *tok = json_object_get(msg, "token");
    if (tok != NULL) {
        ev->logprob = res->endpoint == GW_CHAT ? chat_logprob_entry(tok)
                                               : completion_logprob_entry(tok, ch->text_len);
        if (ev->logprob == NULL || !logprobs_accumulate(res, ch, ev->logprob))
            return protocol_error(e, "a malformed token object");
    }
    if (!text_append(ch, ev->text, ev->text_len))
        return gw_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return true;
}

static bool apply_finish(gw_result *res, json_t *msg, gw_event *ev, gw_error *e) {
    json_t *c = json_object_get(msg, "c");
    const char *finish = json_string_value(json_object_get(msg, "finish"));
    json_t *ct = json_object_get(msg, "completion_tokens");
    if (!json_is_integer(c) || json_integer_value(c) < 0 ||
        (uint64_t)json_integer_value(c) >= res->n || finish == NULL || !json_is_integer(ct))
        return protocol_error(e, "a finish message without choice, reason or token count");
    gw_choice *ch = &res->choices[json_integer_value(c)];
    if (ch->finish != NULL) return protocol_error(e, "a choice finished twice");
    if (strcmp(finish, "stop") == 0) ch->finish = "stop";
    else if (strcmp(finish, "length") == 0) ch->finish = "length";
    else return protocol_error(e, "an unknown finish reason");
    ch->completion_tokens = (uint32_t)json_integer_value(ct);
    res->finished++;
    ev->kind = GW_EV_FINISH;
    ev->choice = (uint32_t)json_integer_value(c);
    return true;
}

bool gw_result_apply(gw_result *res, const char *msg, size_t len, gw_event *ev, gw_error *e) {
    memset(ev, 0, sizeof *ev);
    json_decref(res->last);
    /* ALLOW_NUL: a byte-level token may be the NUL byte, sent as "\u0000" (valid JSON). */
    res->last = json_loadb(msg, len, JSON_ALLOW_NUL, NULL);
    json_t *m = res->last;
    if (!json_is_object(m)) return protocol_error(e, "not a JSON object");
    json_t *pt = json_object_get(m, "prompt_tokens");
    if (pt != NULL) {
        if (!json_is_integer(pt) || res->have_prompt_tokens)
            return protocol_error(e, "a second or malformed prompt_tokens");
        res->have_prompt_tokens = true;
        res->prompt_tokens = (uint32_t)json_integer_value(pt);
        ev->kind = GW_EV_PROMPT;
        return true;
    }
    if (json_object_get(m, "error") != NULL) return apply_error(m, ev, e, res->endpoint);
    if (json_object_get(m, "finish") != NULL) return apply_finish(res, m, ev, e);
    return apply_token(res, m, ev, e);
}

/* ------------------------------------------------------------------------------------------
 * Response JSON */

static uint32_t completion_tokens(const gw_result *res) {
    uint32_t t = 0;
    for (uint32_t i = 0; i < res->n; i++) t += res->choices[i].completion_tokens;
    return t;
}

static json_t *usage_json(const gw_result *res) {
    uint32_t ct = completion_tokens(res);
    return json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)res->prompt_tokens,
                     "completion_tokens", (json_int_t)ct, "total_tokens",
                     (json_int_t)res->prompt_tokens + ct);
}

static json_t *envelope(const gw_result *res, bool chunk, json_t *choices) {
    const char *object = res->endpoint == GW_CHAT
                             ? (chunk ? "chat.completion.chunk" : "chat.completion")
                             : "text_completion";
    return json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", res->id, "object", object, "created",
                     (json_int_t)res->created, "model", res->model, "choices", choices);
}

static json_t *choice_logprobs(const gw_result *res, const gw_choice *c) {
    if (c->logprobs == NULL) return json_null();
    if (res->endpoint == GW_CHAT) return json_pack("{s:O}", "content", c->logprobs);
    return json_incref(c->logprobs);
}

static json_t *full_choice(const gw_result *res, uint32_t i) {
    const gw_choice *c = &res->choices[i];
    json_t *text = gw_json_text(c->text ? c->text : "", c->text_len);
    json_t *finish = str_or_null(c->finish);
    if (res->endpoint == GW_CHAT)
        return json_pack("{s:I,s:{s:s,s:o},s:o,s:o}", "index", (json_int_t)i, "message", "role",
                         "assistant", "content", text, "logprobs", choice_logprobs(res, c),
                         "finish_reason", finish);
    return json_pack("{s:I,s:o,s:o,s:o}", "index", (json_int_t)i, "text", text, "logprobs",
                     choice_logprobs(res, c), "finish_reason", finish);
}

static char *dump(json_t *v) {
    if (v == NULL) return NULL;
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    return s;
}

char *gw_result_json(const gw_result *res) {
    json_t *choices = json_array();
    if (choices == NULL) return NULL;
    for (uint32_t i = 0; i < res->n; i++) json_array_append_new(choices, full_choice(res, i));
    json_t *root = envelope(res, false, choices);
    if (root != NULL) json_object_set_new(root, "usage", usage_json(res));
    return dump(root);
}

/* One stream chunk with one choice: chat {"index","delta","logprobs","finish_reason"},
 * completions {"index","text","logprobs","finish_reason"}. */
static char *chunk1(const gw_result *res, uint32_t i, json_t *delta_or_text, json_t *logprobs,
                    const char *finish) {
    json_t *choice =
        res->endpoint == GW_CHAT
            ? json_pack("{s:I,s:o,s:o,s:o}", "index", (json_int_t)i, "delta", delta_or_text,
                        "logprobs", logprobs, "finish_reason", str_or_null(finish))
            : json_pack("{s:I,s:o,s:o,s:o}", "index", (json_int_t)i, "text", delta_or_text,
                        "logprobs", logprobs, "finish_reason", str_or_null(finish));
    if (choice == NULL) return NULL;
    return dump(envelope(res, true, json_pack("[o]", choice)));
}

char *gw_chunk_role(const gw_result *res, uint32_t choice) {
    return chunk1(res, choice, json_pack("{s:s,s:s}", "role", "assistant", "content", ""),
                  json_null(), NULL);
}

char *gw_chunk_token(const gw_result *res, const gw_event *ev) {
    json_t *text = gw_json_text(ev->text, ev->text_len);
    json_t *lp = json_null();
    if (ev->logprob != NULL)
        lp = res->endpoint == GW_CHAT ? json_pack("{s:[O]}", "content", ev->logprob)
                                      : json_incref(ev->logprob);
    json_t *body = res->endpoint == GW_CHAT ? json_pack("{s:o}", "content", text) : text;
    return chunk1(res, ev->choice, body, lp, NULL);
}

char *gw_chunk_finish(const gw_result *res, uint32_t choice) {
    json_t *body = res->endpoint == GW_CHAT ? json_object() : json_string("");
    return chunk1(res, choice, body, json_null(), res->choices[choice].finish);
}

char *gw_chunk_usage(const gw_result *res) {
    json_t *root = envelope(res, true, json_array());
    if (root != NULL) json_object_set_new(root, "usage", usage_json(res));
    return dump(root);
}
