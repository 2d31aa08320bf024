/* ctl_pubsub.c — see ctl_pubsub.h. */
#include "ctl_pubsub.h"

#include <stdlib.h>
#include <string.h>

static void topic_free(ctl_topic *t) {
    if (t == NULL) return;
    free(t->name);
    free(t->subs);
    free(t);
}

pie_code ctl_pubsub_subscribe(ctl_pubsub *ps, ctl_subs *subs, void *who, const char *topic,
                              pie_status *st) {
    for (uint32_t i = 0; i < subs->n; i++)
        if (strcmp(subs->t[i].topic->name, topic) == 0) return PIE_OK;
    if (subs->n == subs->cap) {
        uint32_t cap = subs->cap ? subs->cap * 2 : 4;
        ctl_topic_ref *p = realloc(subs->t, cap * sizeof *p);
        if (p == NULL) goto oom;
        subs->t = p;
        subs->cap = cap;
    }
    ctl_topic *t = ctl_mapstr_get(&ps->topics, topic);
    if (t == NULL) {
        t = calloc(1, sizeof *t);
        if (t == NULL) goto oom;
        t->name = strdup(topic);
        if (t->name == NULL || ctl_mapstr_put(&ps->topics, t->name, t) != 0) {
            topic_free(t);
            goto oom;
        }
    }
    if (t->n == t->cap) {
        uint32_t cap = t->cap ? t->cap * 2 : 4;
        ctl_sub *p = realloc(t->subs, cap * sizeof *p);
        if (p == NULL) {
            if (t->n == 0) {
                ctl_mapstr_del(&ps->topics, t->name);
                topic_free(t);
            }
            goto oom;
        }
        t->subs = p;
        t->cap = cap;
    }
    t->subs[t->n] = (ctl_sub){who, subs, subs->n};
    subs->t[subs->n++] = (ctl_topic_ref){t, t->n++};
    return PIE_OK;
oom:
    return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "subscribe: controller out of memory");
}

/* Removes entry i of subs (from its topic too), swapping the last entries into the holes. */
static void unsub_at(ctl_pubsub *ps, ctl_subs *subs, uint32_t i) {
    ctl_topic *t = subs->t[i].topic;
    uint32_t at = subs->t[i].at;
    /* Out of the topic: move its last subscriber into `at`. */
    t->subs[at] = t->subs[--t->n];
    if (at < t->n) t->subs[at].subs->t[t->subs[at].back].at = at;
    /* Out of the subscriber's list: move its last topic into i. */
    subs->t[i] = subs->t[--subs->n];
    if (i < subs->n) subs->t[i].topic->subs[subs->t[i].at].back = i;
    if (t->n == 0) {
        ctl_mapstr_del(&ps->topics, t->name);
        topic_free(t);
    }
}

void ctl_pubsub_unsubscribe(ctl_pubsub *ps, ctl_subs *subs, const char *topic) {
    for (uint32_t i = 0; i < subs->n; i++) {
        if (strcmp(subs->t[i].topic->name, topic) == 0) {
            unsub_at(ps, subs, i);
            return;
        }
    }
}

void ctl_pubsub_drop(ctl_pubsub *ps, ctl_subs *subs) {
    while (subs->n) unsub_at(ps, subs, subs->n - 1);
    free(subs->t);
    memset(subs, 0, sizeof *subs);
}

const ctl_topic *ctl_pubsub_topic(const ctl_pubsub *ps, const char *topic) {
    return ctl_mapstr_get(&ps->topics, topic);
}

void ctl_pubsub_free(ctl_pubsub *ps) {
    for (size_t i = 0; i < ps->topics.cap; i++)
        if (ps->topics.cells[i].key) topic_free(ps->topics.cells[i].val);
    ctl_mapstr_free(&ps->topics);
}
