/* fuzz_mdl_safetensors.c — a safetensors file as the worker maps it (services/worker/model).
 *
 * Input: the bytes of model.safetensors (8-byte little-endian header length, JSON header,
 * data). They are written into a scratch model directory that also holds a config.json of a
 * one-layer model small enough for the fuzzer to build whole (FUZZ_CONFIG), then: mdl_st_open
 * (header length, header JSON, each tensor's dtype, shape and data_offsets: inside the data,
 * consistent with shape × dtype size, no overlaps) and, when that accepts the file, mdl_open on the
 * directory (every tensor the decoder needs bound and its shape checked against the config).
 * Checks: no crash, leak or UB; every tensor mdl_st_open accepts lies inside the mapping; an
 * mdl_open success has every weight inside a mapping. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "mdl.h"
#include "mdl_internal.h"

/* d = 8, ffn = 16, 2 heads of 4, vocab 16, one layer: corpus/mdl_safetensors/tiny_model.st
 * (gen_corpus.py) holds every tensor it needs. */
#define FUZZ_CONFIG                                                         \
    "{\"model_type\":\"llama\",\"hidden_size\":8,\"intermediate_size\":16," \
    "\"num_attention_heads\":2,\"num_hidden_layers\":1,\"vocab_size\":16}"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char path[700];
    fuzz_write_file("config.json", FUZZ_CONFIG, strlen(FUZZ_CONFIG), path, sizeof path);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[700];
    fuzz_write_file("model.safetensors", data, size, path, sizeof path);
    mdl_st_file f;
    pie_status st;
    if (mdl_st_open(path, NULL, &f, &st) != PIE_OK) {
        if (st.msg[0] == '\0') fuzz_fail("mdl_st_open failed with no message");
        mdl_st_close(&f);
        return 0;
    }
    for (size_t i = 0; i < f.n_tensors; i++) {
        const mdl_st_tensor *t = &f.tensors[i];
        if (t->begin > t->end || t->end > f.data_len)
            fuzz_fail("tensor %s: [%llu, %llu) outside %llu data bytes", t->name,
                      (unsigned long long)t->begin, (unsigned long long)t->end,
                      (unsigned long long)f.data_len);
        if ((const uint8_t *)f.data + f.data_len > (const uint8_t *)f.map + f.map_len)
            fuzz_fail("data section runs past the mapping");
    }
    mdl_st_close(&f);
    mdl_model *m = NULL;
    if (mdl_open(fuzz_dir(), &m, &st) == PIE_OK) {
        const uint8_t *lo = m->maps[0], *hi = lo + m->map_lens[0];
        const uint8_t *e = (const uint8_t *)m->embed.data;
        if (m->n_copied == 0 && (e < lo || e >= hi)) fuzz_fail("embed data outside the mapping");
        mdl_close(m);
    }
    return 0;
}
