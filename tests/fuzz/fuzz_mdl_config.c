/* fuzz_mdl_config.c — a model's config.json as the worker reads it (services/worker/model).
 *
 * Input: the bytes of config.json. They are written to a scratch model directory and read with
 * mdl_config_load (file read, JSON parse, every field's type and range, defaults, rope scaling,
 * eos lists). Checks: no crash, leak or UB; success means the invariants mdl.h states hold
 * (n_kv_heads divides n_heads, head_dim set, non-zero sizes). */
#include <stdint.h>

#include "fuzz_util.h"
#include "mdl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[700];
    fuzz_write_file("config.json", data, size, path, sizeof path);
    mdl_config cfg;
    pie_status st;
    if (mdl_config_load(fuzz_dir(), &cfg, &st) != PIE_OK) {
        if (st.msg[0] == '\0') fuzz_fail("mdl_config_load failed with no message");
        return 0;
    }
    if (cfg.n_heads == 0 || cfg.n_kv_heads == 0 || cfg.n_heads % cfg.n_kv_heads != 0)
        fuzz_fail("accepted n_heads %u, n_kv_heads %u", cfg.n_heads, cfg.n_kv_heads);
    if (cfg.hidden_size == 0 || cfg.head_dim == 0 || cfg.vocab_size == 0 || cfg.n_layers == 0)
        fuzz_fail("accepted a zero size: hidden %u head_dim %u vocab %u layers %u", cfg.hidden_size,
                  cfg.head_dim, cfg.vocab_size, cfg.n_layers);
    if (cfg.n_eos_token_ids > MDL_MAX_EOS) fuzz_fail("n_eos_token_ids %u", cfg.n_eos_token_ids);
    return 0;
}
