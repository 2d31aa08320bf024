/* fuzz_config_yaml.c — the YAML configuration loader (services/common/pie_config.c).
 *
 * Input: "<env lines>\0<YAML>" — everything before the first NUL byte is split into lines that
 * become the environment (PIE_*=value overrides; other lines are passed too), the rest is the
 * config file's text. Without a NUL the whole input is the YAML and the environment is empty.
 * The schema has one field of every type the loader knows (strings, a secret, signed and
 * unsigned integers of each width, sizes, durations, a double, a bool, an enum, a list, a
 * required key with a default-free bound), nested sections and dotted keys.
 * Checks: no crash, leak or UB; a failure leaves *out without allocations (pie_config.h); a
 * success prints (pie_config_print) YAML that loads back to the same printout. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "pie_config.h"

typedef struct fz_config {
    char *name, *secret, *nullable;
    int8_t i8;
    int16_t i16;
    int32_t i32;
    int64_t i64;
    uint8_t u8;
    uint16_t u16, port;
    uint32_t u32;
    uint64_t u64, size_bytes, small_size;
    int32_t timeout_ms;
    int64_t period_ms;
    double ratio, any_double;
    bool flag;
    int level;
    pie_config_strlist list, empty_list;
} fz_config;

static const char *const fz_levels[] = {"debug", "info", "warn", "error", NULL};

static const pie_config_field fz_fields[] = {
    {"server.name", PIE_CFG_STRING, PIE_CONFIG_AT(fz_config, name), .def = "pie", .doc = "s"},
    {"server.token", PIE_CFG_STRING, PIE_CONFIG_AT(fz_config, secret), .doc = "secret",
     .flags = PIE_CONFIG_SECRET},
    {"server.nullable", PIE_CFG_STRING, PIE_CONFIG_AT(fz_config, nullable), .doc = "null"},
    {"server.port", PIE_CFG_UINT, PIE_CONFIG_AT(fz_config, port), .def = "5000", .min = "1",
     .max = "65535", .doc = "port"},
    {"ints.i8", PIE_CFG_INT, PIE_CONFIG_AT(fz_config, i8), .def = "-3", .doc = "i8"},
    {"ints.i16", PIE_CFG_INT, PIE_CONFIG_AT(fz_config, i16), .min = "-100", .max = "100",
     .doc = "i16"},
    {"ints.i32", PIE_CFG_INT, PIE_CONFIG_AT(fz_config, i32), .doc = "i32"},
    {"ints.i64", PIE_CFG_INT, PIE_CONFIG_AT(fz_config, i64), .def = "-9223372036854775808",
     .doc = "i64"},
    {"uints.u8", PIE_CFG_UINT, PIE_CONFIG_AT(fz_config, u8), .doc = "u8"},
    {"uints.u16", PIE_CFG_UINT, PIE_CONFIG_AT(fz_config, u16), .max = "1000", .doc = "u16"},
    {"uints.u32", PIE_CFG_UINT, PIE_CONFIG_AT(fz_config, u32), .doc = "u32"},
    {"uints.u64", PIE_CFG_UINT, PIE_CONFIG_AT(fz_config, u64), .def = "18446744073709551615",
     .doc = "u64"},
    {"limits.memory", PIE_CFG_SIZE, PIE_CONFIG_AT(fz_config, size_bytes), .def = "4GiB",
     .min = "64KiB", .doc = "size"},
    {"limits.small", PIE_CFG_SIZE, PIE_CONFIG_AT(fz_config, small_size), .max = "1MB",
     .doc = "size"},
    {"limits.timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(fz_config, timeout_ms), .def = "2s",
     .doc = "duration"},
    {"limits.period", PIE_CFG_DURATION, PIE_CONFIG_AT(fz_config, period_ms), .min = "10ms",
     .max = "1h", .def = "1m", .doc = "duration"},
    {"sched.ratio", PIE_CFG_DOUBLE, PIE_CONFIG_AT(fz_config, ratio), .def = "0.5", .min = "0",
     .max = "1", .doc = "double"},
    {"sched.any", PIE_CFG_DOUBLE, PIE_CONFIG_AT(fz_config, any_double), .doc = "double"},
    {"sched.flag", PIE_CFG_BOOL, PIE_CONFIG_AT(fz_config, flag), .def = "true", .doc = "bool"},
    {"log.level", PIE_CFG_ENUM, PIE_CONFIG_AT(fz_config, level), .def = "info",
     .choices = fz_levels, .doc = "enum"},
    {"log.tags", PIE_CFG_STRLIST, PIE_CONFIG_AT(fz_config, list), .def = "a, b", .doc = "list"},
    {"log.more", PIE_CFG_STRLIST, PIE_CONFIG_AT(fz_config, empty_list), .doc = "list"},
};
static const pie_config_schema fz_schema = PIE_CONFIG_SCHEMA(fz_config, fz_fields);

/* pie_config_print's output in a malloc'd string. */
static char *print_config(const fz_config *cfg, size_t *len) {
    char *text = NULL;
    FILE *f = open_memstream(&text, len);
    if (f == NULL) abort();
    pie_status st;
    if (pie_config_print(&fz_schema, cfg, f, &st) != PIE_OK)
        fuzz_fail("pie_config_print: %s", st.msg);
    fclose(f);
    return text;
}

static void check_empty(const fz_config *cfg) {
    if (cfg->name || cfg->secret || cfg->nullable || cfg->list.items || cfg->list.n ||
        cfg->empty_list.items || cfg->empty_list.n)
        fuzz_fail("a failed load left allocations in *out");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    const char *yaml = (const char *)data;
    size_t yaml_len = size;
    char *env_text = NULL;
    char *envp[17] = {NULL};
    if (nul != NULL) {
        size_t env_len = (size_t)(nul - data);
        env_text = malloc(env_len + 1);
        if (env_text == NULL) abort();
        memcpy(env_text, data, env_len);
        env_text[env_len] = '\0';
        size_t n = 0;
        for (char *save = NULL, *line = strtok_r(env_text, "\n", &save); line && n < 16;
             line = strtok_r(NULL, "\n", &save))
            envp[n++] = line;
        yaml = (const char *)nul + 1;
        yaml_len = size - env_len - 1;
    }
    fz_config cfg;
    memset(&cfg, 0, sizeof cfg);
    pie_status st;
    pie_code rc = pie_config_load_buffer(&fz_schema, &cfg, "fuzz.yaml", yaml, yaml_len, envp, &st);
    if (rc != PIE_OK) {
        if (rc == PIE_INTERNAL) fuzz_fail("the schema was judged broken: %s", st.msg);
        check_empty(&cfg);
        free(env_text);
        return 0;
    }
    size_t len1 = 0, len2 = 0;
    char *text1 = print_config(&cfg, &len1);
    /* The printout redacts the secret: put it back through the environment-free reload as the
     * file shows it, then compare the printouts (which redact it the same way). */
    fz_config again;
    memset(&again, 0, sizeof again);
    if (pie_config_load_buffer(&fz_schema, &again, "printed.yaml", text1, len1, NULL, &st) !=
        PIE_OK)
        fuzz_fail("the printed config does not load back: %s\n--- printed:\n%s", st.msg, text1);
    char *text2 = print_config(&again, &len2);
    if (len1 != len2 || memcmp(text1, text2, len1) != 0)
        fuzz_fail("print → load → print differs:\n--- first:\n%s\n--- second:\n%s", text1, text2);
    free(text1);
    free(text2);
    pie_config_free(&fz_schema, &again);
    pie_config_free(&fz_schema, &cfg);
    free(env_text);
    return 0;
}
