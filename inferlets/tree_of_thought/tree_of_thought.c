/* tree_of_thought.c — tree-of-thought search on an arithmetic question.
 *
 * The question is filled once. Each level expands the frontier: every frontier node is forked
 * --branch B times, child i starting with the i-th most likely next token (so siblings differ)
 * and continuing greedily for --step-tokens T tokens in all; the children of a level decode side
 * by side (their calls batch). Each node is scored: first whether its path (the text from the
 * question to the node) contains --answer, then the path's log-probability under the model. The
 * --keep K best nodes of a level form the next frontier; the others are freed (their private
 * pages go, pages shared with ancestors stay). After --depth D levels the best node wins.
 *
 * Owns: the search (expansion, scoring, selection). Does not own: forking and KV sharing
 * (the SDK's Context), sampling.
 *
 * Arguments: --prompt TEXT (default: an addition question), --answer TEXT (default "42"),
 * --branch B (3), --depth D (2), --keep K (1), --step-tokens T (6). Model stop tokens are
 * ignored, so every node has exactly T tokens.
 * Output: one message per node, in creation order:
 *   "<level>\t<id>\t<parent id, 0 = question>\t<path log-prob %.6f>\t<hit 0|1>\t<ids,...>\t<text>"
 * (ids and text are the node's own tokens); then "best=<id> nodes=<count> path=<path text>". */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pie.h"

typedef struct node {
    pie_ctx *ctx;
    uint32_t id, parent, level;
    double score; /* log-probability of the path from the question */
    int hit;      /* the path's text contains the answer */
    double step_lp; /* this node's tokens' log-probability (accumulated while sampling) */
} node;

/* A greedy sampler that adds log p of each token it picks to *state. */
static uint32_t greedy_logged(pie_sampler *s, const pie_dist *d) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < d->k; i++)
        if (d->probs[i] > d->probs[best]) best = i;
    *(double *)s->state += log((double)d->probs[best]);
    return d->ids[best];
}

/* Better first: a hit, then a higher score, then the older node. */
static int node_cmp(const void *a, const void *b) {
    const node *x = *(node *const *)a, *y = *(node *const *)b;
    if (x->hit != y->hit) return y->hit - x->hit;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->id < y->id ? -1 : 1;
}

static char *path_text(const node *n, size_t prompt_tokens) {
    pie_buf b = {0};
    pie_decode(n->ctx->model, n->ctx->tokens + prompt_tokens, n->ctx->n_tokens - prompt_tokens, &b);
    pie_buf_append(&b, "", 0);
    return b.data;
}

/* Sends a node: its own tokens are the last `own` of its history. */
static void send_node(const node *n, size_t own) {
    const uint32_t *t = n->ctx->tokens + n->ctx->n_tokens - own;
    pie_buf m = {0}, text = {0};
    pie_buf_appendf(&m, "%u\t%u\t%u\t%.6f\t%d\t", n->level, n->id, n->parent, n->score, n->hit);
    for (size_t i = 0; i < own; i++) pie_buf_appendf(&m, i ? ",%u" : "%u", t[i]);
    pie_decode(n->ctx->model, t, own, &text);
    pie_buf_append(&m, "\t", 1);
    pie_buf_append(&m, text.data ? text.data : "", text.len);
    pie_send_bytes(m.data, m.len);
    pie_buf_free(&m);
    pie_buf_free(&text);
}

/* Children of every frontier node (B each), decoded side by side; returns them (*n_out set). */
static node *expand(node **frontier, size_t n_front, uint32_t branch, uint32_t step_tokens,
                    uint32_t level, uint32_t *next_id, size_t *n_out) {
    node *kids = pie_xcalloc((size_t)n_front * branch, sizeof *kids);
    size_t n = 0;
    pie_dists ds = {0};
    for (size_t f = 0; f < n_front; f++) {
        ctx_next_dist(frontier[f]->ctx, branch, &ds);
        const pie_dist *d = &ds.d[0];
        for (uint32_t i = 0; i < branch && i < d->k; i++) {
            node *k = &kids[n++];
            *k = (node){.ctx = ctx_fork(frontier[f]->ctx), .id = (*next_id)++,
                        .parent = frontier[f]->id, .level = level,
                        .step_lp = log((double)d->probs[i])};
            k->score = frontier[f]->score; /* + step_lp once the step is decoded */
            ctx_append_tokens(k->ctx, &d->ids[i], 1);
        }
    }
    pie_dists_free(&ds);
    pie_stop stop = {.max_tokens = step_tokens - 1, .ignore_model_stop_tokens = true};
    pie_sampler *ss = pie_xcalloc(n ? n : 1, sizeof *ss);
    pie_output *outs = pie_xcalloc(n ? n : 1, sizeof *outs);
    pie_gen *gens = pie_xcalloc(n ? n : 1, sizeof *gens);
    for (size_t i = 0; i < n; i++) {
        ss[i] = pie_sampler_greedy();
        ss[i].sample = greedy_logged;
        ss[i].state = &kids[i].step_lp;
        pie_gen_start(&gens[i], kids[i].ctx, &ss[i], &stop, &outs[i]);
    }
    if (step_tokens > 1) pie_gen_run_all(gens, n);
    for (size_t i = 0; i < n; i++) {
        kids[i].score += kids[i].step_lp;
        pie_output_free(&outs[i]);
    }
    free(gens);
    free(outs);
    free(ss);
    *n_out = n;
    return kids;
}

int main(int argc, char **argv) {
    const char *prompt = pie_arg_str(argc, argv, "prompt",
                                     "Question: Tom has 17 apples and buys 25 more. How many "
                                     "apples does he have? Let us think step by step.");
    const char *answer = pie_arg_str(argc, argv, "answer", "42");
    long branch = pie_arg_int(argc, argv, "branch", 3), depth = pie_arg_int(argc, argv, "depth", 2);
    long keep = pie_arg_int(argc, argv, "keep", 1), step = pie_arg_int(argc, argv, "step-tokens", 6);
    if (branch < 1 || branch > 16 || depth < 1 || depth > 8 || keep < 1 || keep > 16 || step < 1 ||
        step > 64)
        pie_fatal("--branch %ld --depth %ld --keep %ld --step-tokens %ld: need 1..16, 1..8, "
                  "1..16, 1..64", branch, depth, keep, step);

    node root = {.ctx = ctx_new(NULL)};
    ctx_fill(root.ctx, prompt);
    size_t prompt_tokens = root.ctx->n_tokens;
    node *front_store = NULL, **front = pie_xmalloc(sizeof *front);
    front[0] = &root;
    size_t n_front = 1, total = 0;
    uint32_t next_id = 1;
    for (uint32_t level = 1; level <= (uint32_t)depth; level++) {
        size_t n;
        node *kids = expand(front, n_front, (uint32_t)branch, (uint32_t)step, level, &next_id, &n);
        node **order = pie_xmalloc((n ? n : 1) * sizeof *order);
        for (size_t i = 0; i < n; i++) {
            char *text = path_text(&kids[i], prompt_tokens);
            kids[i].hit = strstr(text, answer) != NULL;
            free(text);
            send_node(&kids[i], (size_t)step);
            order[i] = &kids[i];
        }
        total += n;
        qsort(order, n, sizeof *order, node_cmp);
        size_t n_keep = n < (size_t)keep ? n : (size_t)keep;
        for (size_t i = n_keep; i < n; i++) {
            ctx_free(order[i]->ctx);
            order[i]->ctx = NULL;
        }
        for (size_t i = 0; i < n_front; i++) ctx_free(front[i]->ctx);
        free(front_store);
        front_store = kids;
        free(front);
        front = order;
        n_front = n_keep;
    }
    char *best = path_text(front[0], prompt_tokens);
    pie_sendf("best=%u nodes=%zu path=%s", front[0]->id, total, best);
    free(best);
    for (size_t i = 0; i < n_front; i++) ctx_free(front[i]->ctx);
    free(front_store);
    free(front);
    return 0;
}
