/* ctl_pubsub.h — topics for the inferlets' broadcast / subscribe / unsubscribe.
 *
 * Owns: the topic table (name → subscribers) and each subscriber's list of its topics, kept in
 * step so that subscribe, unsubscribe and dropping a subscriber are O(1) per topic. Topics with
 * no subscriber are removed. Does not own: delivery (ctl_core.c groups a topic's subscribers by
 * lifecycle replica and sends one TopicDelivery per replica), names' validation (ctl_vspace.h
 * ctl_name_check). */
#ifndef CTL_PUBSUB_H
#define CTL_PUBSUB_H

#include <stdint.h>

#include "ctl_map.h"
#include "pie_status.h"

typedef struct ctl_subs ctl_subs;

typedef struct ctl_sub {
    void *who;      /* the subscriber (an instance) */
    ctl_subs *subs; /* its topic list */
    uint32_t back;  /* index of this topic in subs */
} ctl_sub;

typedef struct ctl_topic {
    char *name;
    ctl_sub *subs;
    uint32_t n, cap;
} ctl_topic;

typedef struct ctl_topic_ref {
    ctl_topic *topic;
    uint32_t at; /* index of the subscriber in topic->subs */
} ctl_topic_ref;

/* A subscriber's topics (embedded in the instance; zeroed = none). */
struct ctl_subs {
    ctl_topic_ref *t;
    uint32_t n, cap;
};

typedef struct ctl_pubsub {
    ctl_mapstr topics;
} ctl_pubsub;

/* Idempotent. RESOURCE_EXHAUSTED only when out of memory. */
pie_code ctl_pubsub_subscribe(ctl_pubsub *ps, ctl_subs *subs, void *who, const char *topic,
                              pie_status *st);
/* Idempotent. */
void ctl_pubsub_unsubscribe(ctl_pubsub *ps, ctl_subs *subs, const char *topic);
/* Every topic of the subscriber; frees its list. */
void ctl_pubsub_drop(ctl_pubsub *ps, ctl_subs *subs);
/* The topic, or NULL if nobody subscribes. */
const ctl_topic *ctl_pubsub_topic(const ctl_pubsub *ps, const char *topic);
void ctl_pubsub_free(ctl_pubsub *ps);

#endif
