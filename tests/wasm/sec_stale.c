/* sec_stale.c — fixture of tests/security/test_stale_data.c: an inferlet that either writes KV
 * and embedding state and exits without freeing it, or reads storage it allocated but never
 * wrote, to check that no instance observes another's data (issue 11, hole 1). Raw `pie` ABI;
 * argv[1] names the scenario, results go to the client as "name=value" messages:
 *   write T P1,...,P16  the 16 prompt tokens P into kv page 0 (positions 0..15), then token T at
 *                       position 16 over that context into embedding 16; sends "kv=<dist>" (the
 *                       distribution after T) and exits holding everything
 *   readkv T            allocates kv page 0 and never writes it; runs token T at position 16
 *                       over it as a full 16-token context; sends "kv=<dist>"
 *   reademb N           allocates embeddings 0..N-1 and never writes them; next_dist on each:
 *                       "emb<i>=<dist>" or "emb<i>=<code>|<last_error>"; then synchronize:
 *                       "sync=<code>|<last_error>"
 * A distribution is its top 8 as "id:<f32 bits in hex>,...", so equal means bit-identical. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pie_abi.h"

#define Q      1u
#define DIST_K 8u
#define PROMPT 16u

static char out[4096];
static char err[512];
static uint32_t dist[1 + 2 * DIST_K];

static const char *last_error(void) {
    int32_t n = pie_last_error(err, sizeof err - 1);
    err[n < 0 ? 0 : (n < (int32_t)sizeof err ? n : (int32_t)sizeof err - 1)] = '\0';
    return err;
}

static void send_str(const char *s) { pie_send(s, (uint32_t)strlen(s)); }

/* next_dist of embedding e into out as "<name>=<dist>" or "<name>=<code>|<last_error>". */
static int32_t report_dist(const char *name, uint32_t e, uint32_t future) {
    int32_t rc = pie_next_dist(Q, &e, 1, DIST_K, 0.0f, future);
    if (rc >= 0) rc = pie_future_result(future, dist, sizeof dist);
    if (rc < 0) {
        snprintf(out, sizeof out, "%s=%d|%s", name, rc, last_error());
        send_str(out);
        return rc;
    }
    int w = snprintf(out, sizeof out, "%s=", name);
    for (uint32_t i = 0; i < dist[0] && i < DIST_K; i++)
        w += snprintf(out + w, sizeof out - (size_t)w, "%s%u:%08x", i ? "," : "", dist[1 + i],
                      dist[1 + dist[0] + i]);
    send_str(out);
    return 0;
}

/* Token t at position PROMPT attends to the full page `page`; its output goes to embedding
 * `o`. */
static int32_t step_over_page(uint32_t page, uint32_t t, uint32_t in, uint32_t o) {
    uint32_t pos = PROMPT;
    int32_t rc = pie_embed_text(Q, &in, &t, &pos, 1);
    if (rc < 0) return rc;
    pie_abi_forward d = {
        .kv_page_ids = (uint32_t)(uintptr_t)&page,
        .n_kv_pages = 1,
        .kv_page_last_len = PROMPT,
        .input_embed_ids = (uint32_t)(uintptr_t)&in,
        .n_inputs = 1,
        .output_embed_ids = (uint32_t)(uintptr_t)&o,
        .n_outputs = 1,
    };
    return pie_forward(Q, &d);
}

static int setup(uint32_t n_emb) {
    pie_abi_model_info mi;
    if (pie_model_info("", 0, &mi) < 0 || mi.kv_page_size != PROMPT) return 2;
    if (pie_create_queue(Q, "", 0) < 0) return 2;
    uint32_t page = 0, emb[64];
    for (uint32_t i = 0; i < n_emb && i < 64; i++) emb[i] = i;
    if (pie_alloc_kv_pages(Q, &page, 1) < 0 || pie_alloc_embeds(Q, emb, n_emb) < 0) return 3;
    return 0;
}

static int write_state(uint32_t t, const char *csv) {
    int rc = setup(PROMPT + 1);
    if (rc) return rc;
    uint32_t toks[PROMPT], pos[PROMPT], emb[PROMPT], page = 0, o = PROMPT, n = 0;
    for (const char *p = csv; *p && n < PROMPT; n++) {
        toks[n] = (uint32_t)strtoul(p, (char **)&p, 10);
        pos[n] = emb[n] = n;
        if (*p == ',') p++;
    }
    if (n != PROMPT) return 4;
    if (pie_embed_text(Q, emb, toks, pos, PROMPT) < 0) return 5;
    pie_abi_forward d = {
        .input_embed_ids = (uint32_t)(uintptr_t)emb,
        .n_inputs = PROMPT,
        .output_kv_page_ids = (uint32_t)(uintptr_t)&page,
        .n_output_kv_pages = 1,
        .output_embed_ids = (uint32_t)(uintptr_t)&o,
        .n_outputs = 1,
    };
    if (pie_forward(Q, &d) < 0 || step_over_page(page, t, 0, o) < 0) return 6;
    return report_dist("kv", o, 7) < 0 ? 7 : 0; /* exits holding page 0 and every embedding */
}

static int read_kv(uint32_t t) {
    int rc = setup(2);
    if (rc) return rc;
    if (step_over_page(0, t, 0, 1) < 0) return 6;
    return report_dist("kv", 1, 7) < 0 ? 7 : 0;
}

static int read_embeds(uint32_t n) {
    if (n == 0 || n > 64) return 4;
    int rc = setup(n);
    if (rc) return rc;
    char name[16];
    for (uint32_t i = 0; i < n; i++) {
        snprintf(name, sizeof name, "emb%u", i);
        report_dist(name, i, 7 + i);
    }
    int32_t s = pie_synchronize(Q, 100);
    if (s >= 0) s = pie_future_result(100, NULL, 0);
    snprintf(out, sizeof out, "sync=%d|%s", s, s < 0 ? last_error() : "");
    send_str(out);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "write") == 0)
        return write_state((uint32_t)strtoul(argv[2], NULL, 10), argv[3]);
    if (argc >= 3 && strcmp(argv[1], "readkv") == 0)
        return read_kv((uint32_t)strtoul(argv[2], NULL, 10));
    if (argc >= 3 && strcmp(argv[1], "reademb") == 0)
        return read_embeds((uint32_t)strtoul(argv[2], NULL, 10));
    return 1;
}
