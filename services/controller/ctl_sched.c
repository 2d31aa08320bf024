/* ctl_sched.c — see ctl_sched.h. */
#include "ctl_sched.h"

#include <stdlib.h>
#include <string.h>

const char *const ctl_strategy_names[] = {"work_conserving", "eager", "k_only", "t_only", NULL};

const char *ctl_kind_name(int kind) {
    switch (kind) {
    case CTL_KIND_EMBED: return "embed_text";
    case CTL_KIND_FORWARD: return "forward";
    case CTL_KIND_MASK: return "mask_kv_page";
    case CTL_KIND_COPY: return "copy_kv_page";
    case CTL_KIND_DIST: return "next_dist";
    case CTL_KIND_CTRL: return "controller";
    default: return "none";
    }
}

int ctl_sched_init(ctl_sched *s, const ctl_sched_config *cfg) {
    memset(s, 0, sizeof *s);
    s->cfg = *cfg;
    if (s->cfg.max_step_batches == 0) s->cfg.max_step_batches = 1;
    if (s->cfg.k == 0) s->cfg.k = 1;
    for (int k = 0; k < CTL_KIND_N; k++) s->ready[k].prev = s->ready[k].next = &s->ready[k];
    s->scratch_cap = 256;
    s->scratch = malloc(s->scratch_cap * sizeof *s->scratch);
    return s->scratch ? 0 : -1;
}

void ctl_sched_destroy(ctl_sched *s) {
    free(s->scratch);
    s->scratch = NULL;
    s->scratch_cap = 0;
}

void ctl_sched_unready(ctl_sched *s, ctl_sq *q) {
    if (q->kind < 0 || q->kind >= CTL_KIND_N || q->next == NULL) {
        q->kind = CTL_KIND_NONE;
        return;
    }
    q->prev->next = q->next;
    q->next->prev = q->prev;
    q->prev = q->next = NULL;
    s->n_ready[q->kind]--;
    q->kind = CTL_KIND_NONE;
}

void ctl_sched_ready(ctl_sched *s, ctl_sq *q, int kind, uint64_t seq, int64_t t_ns) {
    ctl_sched_unready(s, q);
    ctl_sq *head = &s->ready[kind];
    q->prev = head->prev;
    q->next = head;
    head->prev->next = q;
    head->prev = q;
    q->kind = kind;
    q->seq = seq;
    q->t_ns = t_ns;
    s->n_ready[kind]++;
}

uint32_t ctl_sched_waiting(const ctl_sched *s) {
    uint32_t n = 0;
    for (int k = 0; k < CTL_KIND_N; k++) n += s->n_ready[k];
    return n;
}

/* The ready queue of `kind` whose head call is oldest. */
static const ctl_sq *oldest(const ctl_sched *s, int kind) {
    const ctl_sq *best = NULL;
    for (const ctl_sq *q = s->ready[kind].next; q != &s->ready[kind]; q = q->next)
        if (best == NULL || q->seq < best->seq) best = q;
    return best;
}

/* Whether the candidate batch of `kind` (oldest call o) may fire now; if not, *due_ns gets
 * when it will. */
static bool may_fire(const ctl_sched *s, int kind, const ctl_sq *o, int64_t now, int64_t *due_ns) {
    switch (s->cfg.strategy) {
    case CTL_STRATEGY_K_ONLY:
        if (s->n_ready[kind] >= s->cfg.k || now - o->t_ns >= s->cfg.k_timeout_ns) return true;
        *due_ns = o->t_ns + s->cfg.k_timeout_ns;
        return false;
    case CTL_STRATEGY_T_ONLY:
        if (now - o->t_ns >= s->cfg.t_ns) return true;
        *due_ns = o->t_ns + s->cfg.t_ns;
        return false;
    case CTL_STRATEGY_WORK_CONSERVING:
    case CTL_STRATEGY_EAGER:
    default: return true;
    }
}

/* Batch order: higher rank first, then older head first. */
static int cmp_sq(const void *a, const void *b) {
    const ctl_sq *x = *(ctl_sq *const *)a, *y = *(ctl_sq *const *)b;
    if (x->rank != y->rank) return y->rank - x->rank;
    return (x->seq > y->seq) - (x->seq < y->seq);
}

/* Copies the ready queues of kind into scratch, sorted; returns how many. */
static uint32_t snapshot(ctl_sched *s, int kind) {
    uint32_t n = s->n_ready[kind];
    if (n > s->scratch_cap) {
        uint32_t cap = s->scratch_cap ? s->scratch_cap : 256;
        while (cap < n) cap *= 2;
        ctl_sq **p = realloc(s->scratch, cap * sizeof *p);
        if (p) {
            s->scratch = p;
            s->scratch_cap = cap;
        } else {
            n = s->scratch_cap; /* out of memory: form a smaller batch this time */
        }
    }
    uint32_t i = 0;
    for (ctl_sq *q = s->ready[kind].next; q != &s->ready[kind] && i < n; q = q->next)
        s->scratch[i++] = q;
    /* Queues are appended as they become ready, so the list is usually sorted already. */
    bool sorted = true;
    for (uint32_t j = 1; j < i && sorted; j++)
        sorted = cmp_sq(&s->scratch[j - 1], &s->scratch[j]) <= 0;
    if (!sorted) qsort(s->scratch, i, sizeof *s->scratch, cmp_sq);
    return i;
}

uint32_t ctl_sched_step(ctl_sched *s, int64_t now_ns, const ctl_sched_ops *ops, void *user,
                        int64_t *wake_ns) {
    uint32_t formed = 0;
    const bool eager = s->cfg.strategy == CTL_STRATEGY_EAGER;
    /* k_only's batches are of fixed size: at most k queues each. */
    const uint32_t max_queues =
        s->cfg.strategy == CTL_STRATEGY_K_ONLY && s->cfg.k ? s->cfg.k : UINT32_MAX;
    *wake_ns = 0;
    while (formed < s->cfg.max_step_batches) {
        /* Choose the kind whose candidate batch holds the oldest call, among those that may
         * fire. */
        int kind = CTL_KIND_NONE;
        uint64_t kind_seq = 0;
        *wake_ns = 0;
        for (int k = 0; k < CTL_KIND_N; k++) {
            if (s->n_ready[k] == 0) continue;
            const ctl_sq *o = oldest(s, k);
            int64_t due = 0;
            if (!may_fire(s, k, o, now_ns, &due)) {
                if (*wake_ns == 0 || due < *wake_ns) *wake_ns = due;
                continue;
            }
            if (kind == CTL_KIND_NONE || o->seq < kind_seq) {
                kind = k;
                kind_seq = o->seq;
            }
        }
        if (kind == CTL_KIND_NONE) break;

        uint32_t n = snapshot(s, kind);
        uint32_t taken = 0, failed = 0;
        bool full = false;
        ops->open(user, kind);
        for (uint32_t i = 0; i < n && !full && i < max_queues; i++) {
            ctl_sq *q = s->scratch[i];
            /* Vertical batching: keep taking this queue's calls while they are of the kind. */
            while (q->kind == kind) {
                ctl_admit r = ops->admit(user, q, kind);
                if (r == CTL_ADMIT_TAKEN) {
                    taken++;
                    if (eager) full = true;
                    if (full) break;
                } else if (r == CTL_ADMIT_FAILED) {
                    failed++;
                } else if (r == CTL_ADMIT_CONFLICT) {
                    break;
                } else {
                    full = true;
                    break;
                }
            }
        }
        ops->close(user, kind, taken);
        if (taken) formed++;
        if (ops->settle) ops->settle(user);
        if (taken == 0 && failed == 0) break; /* nothing could be taken: avoid spinning */
    }
    return formed;
}
