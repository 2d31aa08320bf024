/* gw_gen.c — the generation flow of one completion request (gw_gen.h). */
#include "gw_gen.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_log.h"
#include "rpc.h"

#define GW_POLL_MS 200 /* how often a waiting request checks that its client is still there */

static const char *const gw_endpoint_names[2] = {"completions", "chat_completions"};

pie_code gw_metrics_register(pie_metrics *m, gw_metrics *out, pie_status *st) {
    memset(out, 0, sizeof *out);
    double lat[16];
    pie_metrics_exponential_bounds(0.005, 2, 16, lat);
    for (int ep = 0; ep < 2; ep++) {
        pie_metric_label l = {"endpoint", gw_endpoint_names[ep]};
        out->requests[ep] = pie_metrics_counter(m, "pie_gateway_requests_total",
                                                "OpenAI requests received.", &l, 1, st);
        out->errors[ep] = pie_metrics_counter(
            m, "pie_gateway_errors_total",
            "OpenAI requests answered with an error (HTTP 4xx/5xx or an error event).", &l, 1, st);
        out->latency[ep] = pie_metrics_histogram(
            m, "pie_gateway_request_seconds", "Time from request to its last byte.", lat, 16, &l,
            1, st);
        out->first_token[ep] = pie_metrics_histogram(
            m, "pie_gateway_first_token_seconds", "Time from request to its first token.", lat,
            16, &l, 1, st);
        double tpot[16];
        pie_metrics_exponential_bounds(0.001, 2, 16, tpot); /* 1 ms .. 33 s */
        out->per_token[ep] = pie_metrics_histogram(
            m, "pie_gateway_time_per_output_token_seconds",
            "Mean time per output token after the first, per request with two or more tokens "
            "(all choices of a request counted).",
            tpot, 16, &l, 1, st);
        if (!out->requests[ep] || !out->errors[ep] || !out->latency[ep] || !out->first_token[ep] ||
            !out->per_token[ep])
            return st->code;
    }
    out->prompt_tokens = pie_metrics_counter(m, "pie_gateway_prompt_tokens_total",
                                             "Prompt tokens of served requests.", NULL, 0, st);
    out->completion_tokens = pie_metrics_counter(
        m, "pie_gateway_completion_tokens_total", "Completion tokens generated.", NULL, 0, st);
    out->active = pie_metrics_gauge(m, "pie_gateway_active_requests",
                                    "OpenAI requests in flight.", NULL, 0, st);
    out->disconnects = pie_metrics_counter(
        m, "pie_gateway_client_disconnects_total",
        "Requests whose client went away before the end (their Run was cancelled).", NULL, 0,
        st);
    if (!out->prompt_tokens || !out->completion_tokens || !out->active || !out->disconnects)
        return st->code;
    return PIE_OK;
}

/* Stream state. */
typedef enum gw_phase { GW_PH_ROLES, GW_PH_TOKENS, GW_PH_USAGE, GW_PH_DONE, GW_PH_OVER } gw_phase;

struct gw_gen {
    const gw_gen_env *env;
    gw_req req;
    gw_result res;
    gw_run *run;
    bool run_over;
    bool failed; /* answered with an error (metrics) */
    bool client_gone;
    bool first_token_seen;
    int64_t first_token_ns; /* when it was seen */
    int64_t start_ns;
    gw_phase phase;
};

/* The prompt of the request: the completions prompt, or the rendered chat. */
static bool prepare_prompt(gw_gen *g, const gw_model *m, gw_error *e) {
    if (g->req.endpoint == GW_COMPLETIONS) return true;
    size_t len = 0;
    return gw_chat_render(g->env->chat, m, g->req.messages, g->req.tools, &g->req.prompt, &len,
                          e);
}

/* The next message of the Run, waiting while the client is there. GW_RUN_EXIT with st when
 * the Run ended; a gone client cancels the Run and reports it as GW_RUN_EXIT (CANCELLED). */
static gw_run_result next_message(gw_gen *g, gw_client_alive_fn alive, void *arg, char **msg,
                                  size_t *len, pie_status *st) {
    for (;;) {
        gw_run_result rr = gw_run_next(g->run, alive ? GW_POLL_MS : -1, msg, len, st);
        if (rr != GW_RUN_TIMEOUT) {
            if (rr == GW_RUN_EXIT) g->run_over = true;
            return rr;
        }
        if (alive != NULL && !alive(arg)) {
            g->client_gone = true;
            pie_counter_add(g->env->mx->disconnects, 1);
            gw_run_cancel(g->run);
            g->run_over = true;
            pie_status_set(st, PIE_CANCELLED, "the client went away");
            return GW_RUN_EXIT;
        }
    }
}

/* Reads the first message: prompt_tokens, or the inferlet's refusal. */
static bool read_first(gw_gen *g, gw_client_alive_fn alive, void *arg, gw_error *e) {
    char *msg = NULL;
    size_t len = 0;
    pie_status st;
    gw_run_result rr = next_message(g, alive, arg, &msg, &len, &st);
    if (rr == GW_RUN_EXIT) {
        if (st.code == PIE_OK)
            pie_status_set(&st, PIE_INTERNAL, "the generation program ended without output");
        gw_error_from_status(&st, e);
        return false;
    }
    gw_event ev;
    bool ok = gw_result_apply(&g->res, msg, len, &ev, e);
    free(msg);
    if (ok && ev.kind == GW_EV_PROMPT) {
        pie_counter_add(g->env->mx->prompt_tokens, g->res.prompt_tokens);
        return true;
    }
    if (ok && ev.kind != GW_EV_ERROR)
        gw_error_set(e, 500, "server_error", NULL, NULL,
                     "the generation program did not report the prompt's tokens first");
    json_decref(ev.logprob);
    return false;
}

static bool launch(gw_gen *g, const char *auth, gw_client_alive_fn alive, void *arg,
                   gw_error *e) {
    gw_model m;
    pie_status st;
    if (gw_lc_model(g->env->lc, auth, g->req.model, &m, &st) != PIE_OK) {
        gw_error_from_status(&st, e);
        return false;
    }
    bool ok = prepare_prompt(g, &m, e);
    gw_model_free(&m);
    char **args = NULL;
    size_t n_args = 0;
    if (ok && !gw_req_args(&g->req, &args, &n_args))
        ok = gw_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    if (!ok) return false;
    g->run = gw_run_start(g->env->lc, auth, g->req.model, args, n_args, g->req.prompt,
                          strlen(g->req.prompt), &st);
    gw_args_free(args, n_args);
    if (g->run == NULL) {
        gw_error_from_status(&st, e);
        return false;
    }
    return read_first(g, alive, arg, e);
}

gw_gen *gw_gen_start(const gw_gen_env *env, gw_endpoint endpoint, const char *auth,
                     const char *body, size_t len, gw_client_alive_fn alive, void *arg,
                     gw_error *e) {
    pie_counter_add(env->mx->requests[endpoint], 1);
    gw_gen *g = calloc(1, sizeof *g);
    if (g == NULL) {
        pie_counter_add(env->mx->errors[endpoint], 1);
        gw_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    g->env = env;
    g->start_ns = rpc_now_ns();
    pie_gauge_add(env->mx->active, 1);
    bool ok = gw_req_parse(endpoint, body, len, &g->req, e);
    if (ok && !gw_result_init(&g->res, &g->req))
        ok = gw_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    if (ok) ok = launch(g, auth, alive, arg, e);
    if (!ok) {
        g->req.endpoint = endpoint;
        g->failed = true;
        gw_gen_free(g);
        return NULL;
    }
    g->phase = endpoint == GW_CHAT ? GW_PH_ROLES : GW_PH_TOKENS;
    return g;
}

bool gw_gen_streaming(const gw_gen *g) { return g->req.stream; }

static void note_token(gw_gen *g) {
    if (g->first_token_seen) return;
    g->first_token_seen = true;
    g->first_token_ns = rpc_now_ns();
    pie_histogram_observe(g->env->mx->first_token[g->req.endpoint],
                          (double)(rpc_now_ns() - g->start_ns) / 1e9);
}

/* After the Run ended with st: every choice must have finished, else the end is an error. */
static bool check_end(gw_gen *g, const pie_status *st, gw_error *e) {
    if (st->code != PIE_OK) {
        gw_error_from_status(st, e);
        return false;
    }
    if (g->res.finished != g->res.n)
        return gw_error_set(e, 500, "server_error", NULL, NULL,
                            "the generation program ended before every choice finished");
    return true;
}

char *gw_gen_collect(gw_gen *g, gw_client_alive_fn alive, void *arg, gw_error *e) {
    for (;;) {
        char *msg = NULL;
        size_t len = 0;
        pie_status st;
        if (next_message(g, alive, arg, &msg, &len, &st) == GW_RUN_EXIT) {
            if (!check_end(g, &st, e)) break;
            char *body = gw_result_json(&g->res);
            if (body == NULL) gw_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            else return body;
            break;
        }
        gw_event ev;
        bool ok = gw_result_apply(&g->res, msg, len, &ev, e);
        free(msg);
        json_decref(ev.logprob);
        if (!ok || ev.kind == GW_EV_ERROR) break;
        if (ev.kind == GW_EV_TOKEN) note_token(g);
    }
    g->failed = true;
    return NULL;
}

/* ------------------------------------------------------------------------------------------
 * Server-Sent Events */

typedef struct sse_buf {
    char *p;
    size_t len, cap;
    bool failed;
} sse_buf;

static void sse_add(sse_buf *b, const char *data) {
    if (data == NULL) {
        b->failed = true;
        return;
    }
    size_t n = strlen(data) + sizeof "data: \n\n";
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->len + n) cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->failed = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    b->len += (size_t)snprintf(b->p + b->len, b->cap - b->len, "data: %s\n\n", data);
}

static void sse_add_owned(sse_buf *b, char *data) {
    sse_add(b, data);
    free(data);
}

/* One inferlet message as events; false when the stream must end with an error. */
static bool stream_message(gw_gen *g, const char *msg, size_t len, sse_buf *b, gw_error *e) {
    gw_event ev;
    bool ok = gw_result_apply(&g->res, msg, len, &ev, e);
    if (ok && ev.kind == GW_EV_TOKEN) {
        note_token(g);
        if (ev.text_len > 0 || ev.logprob != NULL) sse_add_owned(b, gw_chunk_token(&g->res, &ev));
    } else if (ok && ev.kind == GW_EV_FINISH) {
        sse_add_owned(b, gw_chunk_finish(&g->res, ev.choice));
    }
    json_decref(ev.logprob);
    return ok && ev.kind != GW_EV_ERROR;
}

/* The stream ends with an error event (OpenAI's shape), then [DONE]. */
static void stream_error(gw_gen *g, const gw_error *e, sse_buf *b) {
    g->failed = true;
    sse_add_owned(b, gw_error_json(e));
    g->phase = GW_PH_DONE;
}

static void stream_step(gw_gen *g, gw_client_alive_fn alive, void *arg, sse_buf *b) {
    gw_error e;
    if (g->phase == GW_PH_ROLES) {
        for (uint32_t i = 0; i < g->res.n; i++) sse_add_owned(b, gw_chunk_role(&g->res, i));
        g->phase = GW_PH_TOKENS;
        return;
    }
    if (g->phase == GW_PH_TOKENS) {
        char *msg = NULL;
        size_t len = 0;
        pie_status st;
        if (next_message(g, alive, arg, &msg, &len, &st) == GW_RUN_EXIT) {
            if (g->client_gone) g->phase = GW_PH_OVER;
            else if (!check_end(g, &st, &e)) stream_error(g, &e, b);
            else g->phase = g->req.include_usage ? GW_PH_USAGE : GW_PH_DONE;
            return;
        }
        bool ok = stream_message(g, msg, len, b, &e);
        free(msg);
        if (!ok) {
            gw_run_cancel(g->run);
            stream_error(g, &e, b);
        }
        return;
    }
    if (g->phase == GW_PH_USAGE) {
        sse_add_owned(b, gw_chunk_usage(&g->res));
        g->phase = GW_PH_DONE;
        return;
    }
    if (g->phase == GW_PH_DONE) {
        sse_add(b, "[DONE]");
        g->phase = GW_PH_OVER;
    }
}

bool gw_gen_next_events(gw_gen *g, gw_client_alive_fn alive, void *arg, char **out,
                        size_t *len) {
    sse_buf b = {0};
    while (b.len == 0 && !b.failed && g->phase != GW_PH_OVER) stream_step(g, alive, arg, &b);
    if (b.failed || b.len == 0) {
        if (b.failed) {
            g->failed = true;
            gw_run_cancel(g->run);
            g->phase = GW_PH_OVER;
        }
        free(b.p);
        return false;
    }
    *out = b.p;
    *len = b.len;
    return true;
}

void gw_gen_free(gw_gen *g) {
    if (g == NULL) return;
    gw_endpoint ep = g->req.endpoint;
    const gw_metrics *mx = g->env->mx;
    if (g->req.stream && g->phase != GW_PH_OVER && !g->client_gone && !g->failed) {
        /* The HTTP layer ended the stream early: a write to the client failed. */
        g->client_gone = true;
        pie_counter_add(mx->disconnects, 1);
    }
    if (g->run != NULL && !g->run_over) gw_run_cancel(g->run);
    gw_run_free(g->run);
    uint32_t ct = 0;
    for (uint32_t i = 0; g->res.choices && i < g->res.n; i++)
        ct += g->res.choices[i].completion_tokens;
    pie_counter_add(mx->completion_tokens, ct);
    if (g->failed || g->client_gone) pie_counter_add(mx->errors[ep], 1);
    int64_t end_ns = rpc_now_ns();
    pie_histogram_observe(mx->latency[ep], (double)(end_ns - g->start_ns) / 1e9);
    if (g->first_token_seen && ct > 1 && !g->failed)
        pie_histogram_observe(mx->per_token[ep],
                              (double)(end_ns - g->first_token_ns) / 1e9 / (double)(ct - 1));
    pie_gauge_add(mx->active, -1);
    gw_result_free(&g->res);
    gw_req_free(&g->req);
    free(g);
}
