/* ctl_queue.c — see ctl_queue.h. */
#include "ctl_queue.h"

#include <stdlib.h>
#include <string.h>

void ctl_queue_init(ctl_queue *q, uint32_t id, uint32_t model, struct ctl_inst *inst) {
    memset(q, 0, sizeof *q);
    q->id = id;
    q->model = model;
    q->inst = inst;
    q->sq.kind = CTL_KIND_NONE;
    q->sq.rank = CTL_RANK_NORMAL;
}

int ctl_queue_rank(int wire_priority) {
    switch (wire_priority) {
    case PIE__V1__QUEUE_PRIORITY__QUEUE_PRIORITY_LOW: return CTL_RANK_LOW;
    case PIE__V1__QUEUE_PRIORITY__QUEUE_PRIORITY_HIGH: return CTL_RANK_HIGH;
    default: return CTL_RANK_NORMAL;
    }
}

void ctl_queue_push(ctl_queue *q, ctl_call *c) {
    c->next = NULL;
    c->q = q;
    c->state = CTL_CALL_PENDING;
    if (q->pend_tail)
        q->pend_tail->next = c;
    else
        q->pend = c;
    q->pend_tail = c;
    q->n_pend++;
}

ctl_call *ctl_queue_take(ctl_queue *q) {
    ctl_call *c = q->redo;
    if (c) { /* taken again: its FIFO place is where it was first taken */
        q->redo = c->redo_next;
        c->redo_next = NULL;
        c->state = CTL_CALL_INFLIGHT;
        q->n_inflight++;
        return c;
    }
    c = q->pend;
    if (c == NULL) return NULL;
    q->pend = c->next;
    if (q->pend == NULL) q->pend_tail = NULL;
    q->n_pend--;
    c->next = NULL;
    c->state = CTL_CALL_INFLIGHT;
    q->n_inflight++;
    if (q->fifo_tail)
        q->fifo_tail->next = c;
    else
        q->fifo = c;
    q->fifo_tail = c;
    q->n_fifo++;
    return c;
}

void ctl_queue_done(ctl_call *c, uint32_t code, const char *err) {
    if (c->state == CTL_CALL_INFLIGHT && c->q && c->q->n_inflight) c->q->n_inflight--;
    c->state = CTL_CALL_DONE;
    c->code = code;
    if (code != 0) {
        c->has_result = true;
        free(c->err);
        c->err = strdup(err ? err : "");
    }
}

void ctl_queue_defer(ctl_call *c) {
    ctl_queue *q = c->q;
    if (q->n_inflight) q->n_inflight--;
    c->state = CTL_CALL_DEFERRED;
    c->deferrals++;
    ctl_call **at = &q->redo;
    while (*at && (*at)->seq < c->seq) at = &(*at)->redo_next;
    c->redo_next = *at;
    *at = c;
}

ctl_call *ctl_queue_retire(ctl_queue *q) {
    ctl_call *c = q->fifo;
    if (c == NULL || c->state != CTL_CALL_DONE) return NULL;
    q->fifo = c->next;
    if (q->fifo == NULL) q->fifo_tail = NULL;
    q->n_fifo--;
    c->next = NULL;
    return c;
}
