/* test_config.c — pie_config: defaults < file < environment, value syntax, and the exact text
 * of every error a user can cause (the promise made in pie_config.h and services/common/README.md).
 *
 * Each test runs in its own process (Criterion's default) inside a fresh mkdtemp directory, so
 * files are written as "config.yaml" and messages read like the ones users see. */
#include <criterion/criterion.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pie_config.h"

/* ---- the schema under test ------------------------------------------------------------------ */

typedef struct tcfg {
    char *listen;
    int32_t port;
    bool tls_enabled;
    char *tls_cert;
    uint64_t max_message_bytes;
    int64_t timeout_ms;
    pie_config_strlist peers;
    int level;
    double ratio;
    int8_t small;
    uint32_t workers;
    char *token;
    int untouched; /* not in the schema: load must leave it alone */
} tcfg;

static const char *const levels[] = {"debug", "info", "warn", "error", NULL};

static const pie_config_field tfields[] = {
    {"server.listen", PIE_CFG_STRING, PIE_CONFIG_AT(tcfg, listen), .def = "127.0.0.1",
     .doc = "Address to bind."},
    {"server.port", PIE_CFG_INT, PIE_CONFIG_AT(tcfg, port), .def = "5000", .min = "0",
     .max = "65535", .doc = "TCP port."},
    {"server.tls.enabled", PIE_CFG_BOOL, PIE_CONFIG_AT(tcfg, tls_enabled), .def = "false",
     .doc = "Serve TLS."},
    {"server.tls.cert", PIE_CFG_STRING, PIE_CONFIG_AT(tcfg, tls_cert), .doc = "PEM file."},
    {"rpc.max_message_bytes", PIE_CFG_SIZE, PIE_CONFIG_AT(tcfg, max_message_bytes),
     .def = "4MiB", .min = "1KiB", .max = "1GiB", .doc = "Largest message."},
    {"rpc.timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(tcfg, timeout_ms), .def = "2s",
     .doc = "Deadline of internal calls."},
    {"rpc.peers", PIE_CFG_STRLIST, PIE_CONFIG_AT(tcfg, peers), .def = "a:1, b:2",
     .doc = "Peers to dial."},
    {"log.level", PIE_CFG_ENUM, PIE_CONFIG_AT(tcfg, level), .def = "info", .choices = levels,
     .doc = "Lowest level written."},
    {"sched.ratio", PIE_CFG_DOUBLE, PIE_CONFIG_AT(tcfg, ratio), .def = "0.25", .min = "0",
     .max = "1", .doc = "Share of the batch."},
    {"sched.small", PIE_CFG_INT, PIE_CONFIG_AT(tcfg, small), .def = "-3",
     .doc = "An 8-bit knob."},
    {"sched.workers", PIE_CFG_UINT, PIE_CONFIG_AT(tcfg, workers), .def = "4",
     .doc = "Threads | workers."},
    {"auth_token", PIE_CFG_STRING, PIE_CONFIG_AT(tcfg, token), .doc = "Bearer token.",
     .flags = PIE_CONFIG_SECRET},
};
static const pie_config_schema tschema = PIE_CONFIG_SCHEMA(tcfg, tfields);

/* ---- fixture -------------------------------------------------------------------------------- */

static char tmpdir[64];

static void setup(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/pie-test-config-XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp: %s", strerror(errno));
    cr_assert_eq(chdir(tmpdir), 0, "chdir: %s", strerror(errno));
}

static void teardown(void) {
    const char *names[] = {"config.yaml", "big.yaml", "printed.yaml"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) (void)unlink(names[i]);
    (void)rmdir("adir");
    (void)rmdir(tmpdir);
}

TestSuite(config, .init = setup, .fini = teardown);

static void write_file(const char *name, const char *text) {
    FILE *f = fopen(name, "w");
    cr_assert_not_null(f, "fopen %s: %s", name, strerror(errno));
    cr_assert_eq(fwrite(text, 1, strlen(text), f), strlen(text));
    cr_assert_eq(fclose(f), 0);
}

/* Loads `yaml` (as config.yaml) with env; asserts success. */
static void load_ok(tcfg *c, const char *yaml, char **env) {
    pie_status st;
    const char *path = NULL;
    if (yaml) {
        write_file("config.yaml", yaml);
        path = "config.yaml";
    }
    c->untouched = 77;
    pie_code rc = pie_config_load(&tschema, c, path, env, &st);
    cr_assert_eq(rc, PIE_OK, "load failed: %s %s", pie_code_name(rc), st.msg);
    cr_assert_eq(c->untouched, 77);
}

/* Loads `yaml` (as config.yaml) with env; asserts the exact code and message, and that nothing
 * is left allocated in the struct. */
static void load_fails(const char *yaml, char **env, pie_code code, const char *msg) {
    pie_status st;
    tcfg c;
    memset(&c, 0xab, sizeof c);
    if (yaml) write_file("config.yaml", yaml);
    pie_code rc = pie_config_load(&tschema, &c, yaml ? "config.yaml" : NULL, env, &st);
    cr_assert_eq(rc, code, "code %s, want %s; message: %s", pie_code_name(rc),
                 pie_code_name(code), st.msg);
    cr_assert_str_eq(st.msg, msg, "message\n  got:  %s\n  want: %s", st.msg, msg);
    cr_assert_null(c.listen);
    cr_assert_null(c.tls_cert);
    cr_assert_null(c.peers.items);
    cr_assert_eq(c.peers.n, 0);
}

/* ---- values --------------------------------------------------------------------------------- */

Test(config, defaults_only_when_no_file_and_no_environment) {
    tcfg c;
    load_ok(&c, NULL, NULL);
    cr_assert_str_eq(c.listen, "127.0.0.1");
    cr_assert_eq(c.port, 5000);
    cr_assert_eq(c.tls_enabled, false);
    cr_assert_null(c.tls_cert);
    cr_assert_eq(c.max_message_bytes, 4u << 20);
    cr_assert_eq(c.timeout_ms, 2000);
    cr_assert_eq(c.peers.n, 2);
    cr_assert_str_eq(c.peers.items[0], "a:1");
    cr_assert_str_eq(c.peers.items[1], "b:2");
    cr_assert_eq(c.level, 1);
    cr_assert_float_eq(c.ratio, 0.25, 1e-15);
    cr_assert_eq(c.small, -3);
    cr_assert_eq(c.workers, 4);
    cr_assert_null(c.token);
    pie_config_free(&tschema, &c);
    cr_assert_null(c.listen);
    cr_assert_null(c.peers.items);
}

Test(config, file_sets_nested_and_dotted_keys) {
    tcfg c;
    load_ok(&c,
            "# a comment\n"
            "server:\n"
            "  listen: 0.0.0.0\n"
            "  port: 8080\n"
            "  tls:\n"
            "    enabled: true\n"
            "    cert: \"/etc/pie/cert.pem\"\n"
            "rpc.timeout: 500ms\n"
            "log: {level: debug}\n"
            "sched:\n"
            "  ratio: 1e-1\n"
            "  small: -128\n"
            "  workers: 0\n"
            "auth_token: 's3cret'\n",
            NULL);
    cr_assert_str_eq(c.listen, "0.0.0.0");
    cr_assert_eq(c.port, 8080);
    cr_assert_eq(c.tls_enabled, true);
    cr_assert_str_eq(c.tls_cert, "/etc/pie/cert.pem");
    cr_assert_eq(c.timeout_ms, 500);
    cr_assert_eq(c.level, 0);
    cr_assert_float_eq(c.ratio, 0.1, 1e-15);
    cr_assert_eq(c.small, -128);
    cr_assert_eq(c.workers, 0);
    cr_assert_str_eq(c.token, "s3cret");
    cr_assert_eq(c.max_message_bytes, 4u << 20, "untouched keys keep their defaults");
    pie_config_free(&tschema, &c);
}

Test(config, empty_file_and_null_sections_keep_defaults) {
    tcfg c;
    load_ok(&c, "", NULL);
    cr_assert_eq(c.port, 5000);
    pie_config_free(&tschema, &c);
    load_ok(&c, "# nothing but a comment\n", NULL);
    cr_assert_eq(c.port, 5000);
    pie_config_free(&tschema, &c);
    load_ok(&c, "server:\n  # port: 1\nlog:\n", NULL);
    cr_assert_eq(c.port, 5000);
    pie_config_free(&tschema, &c);
    load_ok(&c, "---\n...\n", NULL);
    cr_assert_eq(c.port, 5000);
    pie_config_free(&tschema, &c);
}

Test(config, null_clears_strings_and_lists) {
    tcfg c;
    load_ok(&c, "server:\n  listen: ~\nrpc:\n  peers: null\n", NULL);
    cr_assert_null(c.listen);
    cr_assert_eq(c.peers.n, 0);
    cr_assert_null(c.peers.items);
    pie_config_free(&tschema, &c);
}

Test(config, precedence_is_default_then_file_then_environment) {
    tcfg c;
    char *env[] = {"HOME=/root",
                   "PIE_SERVER_PORT=9090",
                   "PIE_RPC_PEERS= x:1 ,, y:2 ,",
                   "PIE_LOG_LEVEL=error",
                   "PIE_SERVER_PORT=1111", /* a second entry: the first wins, as with getenv */
                   "PIE_SERVICE_HOST=10.0.0.1", /* not a field: ignored (Kubernetes injects these) */
                   "PIE_SERVER_TLS_ENABLED=TRUE",
                   "PIE_RPC_MAX_MESSAGE_BYTES=64MiB",
                   "PIE_SERVER_LISTEN=",
                   NULL};
    load_ok(&c, "server:\n  port: 8080\n  listen: 0.0.0.0\nrpc:\n  timeout: 3s\n", env);
    cr_assert_eq(c.port, 9090, "environment beats file");
    cr_assert_eq(c.timeout_ms, 3000, "file beats default");
    cr_assert_eq(c.workers, 4, "default stays when nobody sets it");
    cr_assert_eq(c.level, 3);
    cr_assert_eq(c.tls_enabled, true);
    cr_assert_eq(c.max_message_bytes, 64u << 20);
    cr_assert_str_eq(c.listen, "", "an empty variable is an empty string");
    cr_assert_eq(c.peers.n, 2, "empty items are dropped, spaces trimmed");
    cr_assert_str_eq(c.peers.items[0], "x:1");
    cr_assert_str_eq(c.peers.items[1], "y:2");
    pie_config_free(&tschema, &c);
}

Test(config, environment_without_file) {
    tcfg c;
    char *env[] = {"PIE_SCHED_RATIO=0.75", "PIE_RPC_PEERS=", NULL};
    load_ok(&c, NULL, env);
    cr_assert_float_eq(c.ratio, 0.75, 1e-15);
    cr_assert_eq(c.peers.n, 0);
    pie_config_free(&tschema, &c);
}

Test(config, size_units) {
    static const struct {
        const char *text;
        uint64_t bytes;
    } cases[] = {
        {"1024", 1024},          {"2048B", 2048},         {"64KiB", 64u << 10},
        {"64Ki", 64u << 10},     {"3MiB", 3u << 20},      {"3Mi", 3u << 20},
        {"1GiB", 1u << 30},      {"1Gi", 1u << 30},       {"2kB", 2000},
        {"2KB", 2000},           {"5MB", 5000000},        {"1GB", 1000000000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char yaml[64];
        snprintf(yaml, sizeof yaml, "rpc:\n  max_message_bytes: %s\n", cases[i].text);
        tcfg c;
        load_ok(&c, yaml, NULL);
        cr_assert_eq(c.max_message_bytes, cases[i].bytes, "%s → %" PRIu64, cases[i].text,
                     c.max_message_bytes);
        pie_config_free(&tschema, &c);
    }
}

Test(config, duration_units) {
    static const struct {
        const char *text;
        int64_t ms;
    } cases[] = {
        {"0", 0},       {"250", 250},         {"500ms", 500},     {"2s", 2000},
        {"5m", 300000}, {"1h", 3600000},      {"'7s'", 7000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char yaml[64];
        snprintf(yaml, sizeof yaml, "rpc:\n  timeout: %s\n", cases[i].text);
        tcfg c;
        load_ok(&c, yaml, NULL);
        cr_assert_eq(c.timeout_ms, cases[i].ms, "%s → %" PRId64, cases[i].text, c.timeout_ms);
        pie_config_free(&tschema, &c);
    }
}

Test(config, lists_in_flow_and_block_style) {
    tcfg c;
    load_ok(&c, "rpc:\n  peers:\n    - h1:1\n    - \"h2:2\"\n    - 'a, b'\n", NULL);
    cr_assert_eq(c.peers.n, 3);
    cr_assert_str_eq(c.peers.items[0], "h1:1");
    cr_assert_str_eq(c.peers.items[1], "h2:2");
    cr_assert_str_eq(c.peers.items[2], "a, b", "no comma splitting inside YAML");
    pie_config_free(&tschema, &c);
    load_ok(&c, "rpc: {peers: []}\n", NULL);
    cr_assert_eq(c.peers.n, 0);
    pie_config_free(&tschema, &c);
    load_ok(&c, "rpc.peers: [only]\n", NULL);
    cr_assert_eq(c.peers.n, 1);
    cr_assert_str_eq(c.peers.items[0], "only");
    pie_config_free(&tschema, &c);
}

Test(config, integers_at_the_limits_of_the_member) {
    tcfg c;
    load_ok(&c, "sched: {small: 127}\nserver: {port: 65535}\n", NULL);
    cr_assert_eq(c.small, 127);
    cr_assert_eq(c.port, 65535);
    pie_config_free(&tschema, &c);
    load_ok(&c, "sched: {small: +0, workers: 4294967295}\nserver: {port: 0}\n", NULL);
    cr_assert_eq(c.small, 0);
    cr_assert_eq(c.workers, UINT32_MAX);
    cr_assert_eq(c.port, 0);
    pie_config_free(&tschema, &c);
}

/* ---- errors in the file --------------------------------------------------------------------- */

Test(config, error_unknown_key) {
    load_fails("server:\n    prot: 1\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:5: unknown key 'server.prot'");
    load_fails("logging: {}\n", NULL, PIE_INVALID_ARGUMENT, "config.yaml:1:1: unknown key 'logging'");
    load_fails("server.tls.key: x\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:1: unknown key 'server.tls.key'");
    load_fails("server:\n  \"it's\\n\": 1\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:3: unknown key 'server.it\\'s\\x0a'");
}

Test(config, error_expected_integer) {
    load_fails("server:\n    port: abc\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:11: server.port: expected integer, got 'abc'");
    load_fails("server:\n  port: 1.5\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:9: server.port: expected integer, got '1.5'");
    load_fails("sched:\n  workers: -1\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:12: sched.workers: expected non-negative integer, got '-1'");
}

Test(config, error_out_of_range) {
    load_fails("server:\n    port: 70000\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:11: server.port: 70000 is out of range [0, 65535]");
    load_fails("server: {port: -1}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:16: server.port: -1 is out of range [0, 65535]");
    load_fails("sched: {small: 128}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:16: sched.small: 128 is out of range [-128, 127]");
    load_fails("sched: {workers: 4294967296}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:18: sched.workers: 4294967296 is out of range [0, 4294967295]");
    load_fails("sched: {small: 99999999999999999999}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:16: sched.small: 99999999999999999999 is out of range [-128, 127]");
    load_fails("rpc: {max_message_bytes: 2GiB}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:26: rpc.max_message_bytes: 2GiB is out of range [1KiB, 1GiB]");
    load_fails("rpc: {max_message_bytes: 100000000TiB}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:26: rpc.max_message_bytes: 100000000TiB is out of range [1KiB, "
               "1GiB]");
    load_fails("sched: {ratio: 1.5}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:16: sched.ratio: 1.5 is out of range [0, 1]");
}

Test(config, error_not_one_of_the_choices) {
    load_fails("server: {}\n\n\nlog:\n\n  level: loud\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:6:10: log.level: 'loud' is not one of debug, info, warn, error");
    load_fails("log:\n  level: [info]\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:10: log.level: expected one of debug, info, warn, error, got a "
               "sequence");
}

Test(config, error_section_is_not_a_mapping) {
    load_fails("server: 5\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:9: server: expected a mapping, got a scalar");
    load_fails("server:\n  tls:\n    - a\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:3:5: server.tls: expected a mapping, got a sequence");
}

Test(config, error_value_of_the_wrong_shape) {
    load_fails("server:\n  port: {a: 1}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:9: server.port: expected integer, got a mapping");
    load_fails("server:\n  port:\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:8: server.port: expected integer, got null");
    load_fails("server:\n  listen: [a]\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:11: server.listen: expected string, got a sequence");
    load_fails("rpc:\n  peers: a:1\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:10: rpc.peers: expected a sequence of strings, got 'a:1'");
    load_fails("rpc:\n  peers: [a, {b: 1}]\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:14: rpc.peers[1]: expected string, got a mapping");
    load_fails("rpc:\n  peers:\n    - a\n    -\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:4:6: rpc.peers[1]: expected string, got null");
    load_fails("server:\n  listen: \"a\\0b\"\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:11: server.listen: string contains a NUL byte");
}

Test(config, error_bad_sizes_durations_bools_numbers) {
    load_fails("rpc: {max_message_bytes: 12XB}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:26: rpc.max_message_bytes: expected size (integer with optional "
               "unit B, KiB, MiB, GiB, TiB, kB, MB, GB, TB), got '12XB'");
    load_fails("rpc: {max_message_bytes: 1.5GiB}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:26: rpc.max_message_bytes: expected size (integer with optional "
               "unit B, KiB, MiB, GiB, TiB, kB, MB, GB, TB), got '1.5GiB'");
    load_fails("rpc:\n  timeout: 5 s\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:12: rpc.timeout: expected duration (integer with unit ms, s, m, h; "
               "bare integer = ms), got '5 s'");
    load_fails("rpc:\n  timeout: -5s\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:12: rpc.timeout: expected duration (integer with unit ms, s, m, h; "
               "bare integer = ms), got '-5s'");
    load_fails("server.tls.enabled: yes\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:21: server.tls.enabled: expected true or false, got 'yes'");
    load_fails("sched.ratio: nan\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:14: sched.ratio: expected number, got 'nan'");
    load_fails("sched.ratio: 0x10\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:14: sched.ratio: expected number, got '0x10'");
}

Test(config, error_offending_value_is_escaped_and_cut) {
    load_fails("server:\n  port: \"a'b\\\\c\\td\"\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:9: server.port: expected integer, got 'a\\'b\\\\c\\x09d'");
    char yaml[256], want[256];
    snprintf(yaml, sizeof yaml, "server:\n  port: %s\n",
             "x123456789012345678901234567890123456789012345678901234567890123456789");
    snprintf(want, sizeof want, "config.yaml:2:9: server.port: expected integer, got '%s...'",
             "x123456789012345678901234567890123456789012345678901234567890123");
    load_fails(yaml, NULL, PIE_INVALID_ARGUMENT, want);
}

Test(config, error_duplicate_keys) {
    load_fails("server:\n  port: 1\n  port: 2\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:3:3: duplicate key 'server.port' (first at 2:3)");
    load_fails("server:\n  port: 1\nlog: {}\nserver:\n  listen: x\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:4:1: duplicate key 'server' (first at 1:1)");
    load_fails("server.port: 1\nserver:\n  port: 2\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:3:3: duplicate key 'server.port' (first at 1:1)");
}

Test(config, error_yaml_syntax) {
    load_fails("server:\n  port: [1, 2\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:3:1: YAML syntax error: did not find expected ',' or ']' (while "
               "parsing a flow sequence at 2:9)");
    load_fails("server:\n  port: 1\n bad\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:3:2: YAML syntax error: did not find expected key (while parsing a "
               "block mapping at 1:1)");
    load_fails("a: *nope\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:4: YAML syntax error: found undefined alias");
    load_fails("server:\n  port: 1\n\tlisten: x\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:3:1: YAML syntax error: found a tab character that violates "
               "indentation (while scanning a plain scalar at 2:9)");
}

Test(config, error_invalid_utf8_has_a_position) {
    load_fails("server:\n  listen: ab\xff\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:13: YAML syntax error: invalid leading UTF-8 octet");
}

Test(config, error_top_level_and_documents) {
    load_fails("- a\n- b\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:1: expected a mapping at the top level, got a sequence");
    load_fails("just text\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:1: expected a mapping at the top level, got a scalar");
    load_fails("server: {port: 1}\n---\nserver: {port: 2}\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:2:1: expected a single YAML document, found another");
    load_fails("? [a, b]\n: 1\n", NULL, PIE_INVALID_ARGUMENT,
               "config.yaml:1:3: mapping keys must be scalars, got a sequence");
}

Test(config, error_missing_unreadable_and_oversized_files) {
    pie_status st;
    tcfg c;
    pie_code rc = pie_config_load(&tschema, &c, "x.yaml", NULL, &st);
    cr_assert_eq(rc, PIE_NOT_FOUND);
    cr_assert_str_eq(st.msg, "cannot open config 'x.yaml': No such file or directory", "%s",
                     st.msg);
    cr_assert_null(c.listen);

    cr_assert_eq(mkdir("adir", 0700), 0);
    rc = pie_config_load(&tschema, &c, "adir", NULL, &st);
    cr_assert_eq(rc, PIE_INVALID_ARGUMENT, "%s", pie_code_name(rc));
    cr_assert_str_eq(st.msg, "config 'adir' is not a regular file", "%s", st.msg);

    size_t big = (1u << 20) + 1;
    char *text = malloc(big + 1);
    cr_assert_not_null(text);
    memset(text, '#', big);
    text[big] = '\0';
    write_file("big.yaml", text);
    free(text);
    rc = pie_config_load(&tschema, &c, "big.yaml", NULL, &st);
    cr_assert_eq(rc, PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "config 'big.yaml' is larger than 1048576 bytes", "%s", st.msg);
}

Test(config, error_unreadable_file_is_permission_denied) {
    write_file("config.yaml", "server: {}\n");
    cr_assert_eq(chmod("config.yaml", 0), 0);
    if (geteuid() == 0) { /* root opens any file: become nobody (this test has its own process) */
        cr_assert_eq(setgid(65534), 0, "setgid: %s", strerror(errno));
        cr_assert_eq(setuid(65534), 0, "setuid: %s", strerror(errno));
        /* setuid made the process non-dumpable; LeakSanitizer must attach to it at exit */
        cr_assert_eq(prctl(PR_SET_DUMPABLE, 1), 0);
    }
    pie_status st;
    tcfg c;
    pie_code rc = pie_config_load(&tschema, &c, "config.yaml", NULL, &st);
    cr_assert_eq(rc, PIE_PERMISSION_DENIED);
    cr_assert_str_eq(st.msg, "cannot open config 'config.yaml': Permission denied", "%s", st.msg);
}

/* ---- errors in the environment -------------------------------------------------------------- */

Test(config, error_environment) {
    char *e1[] = {"PIE_SERVER_PORT=x", NULL};
    load_fails(NULL, e1, PIE_INVALID_ARGUMENT,
               "environment PIE_SERVER_PORT: expected integer, got 'x'");
    char *e2[] = {"PIE_SERVER_PORT=70000", NULL};
    load_fails("server: {port: 1}\n", e2, PIE_INVALID_ARGUMENT,
               "environment PIE_SERVER_PORT: 70000 is out of range [0, 65535]");
    char *e3[] = {"PIE_LOG_LEVEL=loud", NULL};
    load_fails(NULL, e3, PIE_INVALID_ARGUMENT,
               "environment PIE_LOG_LEVEL: 'loud' is not one of debug, info, warn, error");
    char *e4[] = {"PIE_SERVER_PORT=", NULL};
    load_fails(NULL, e4, PIE_INVALID_ARGUMENT,
               "environment PIE_SERVER_PORT: expected integer, got ''");
    char *e5[] = {"PIE_RPC_TIMEOUT=2 s", NULL};
    load_fails(NULL, e5, PIE_INVALID_ARGUMENT,
               "environment PIE_RPC_TIMEOUT: expected duration (integer with unit ms, s, m, h; "
               "bare integer = ms), got '2 s'");
    char *e6[] = {"PIE_SERVER_TLS_ENABLED=1", NULL};
    load_fails(NULL, e6, PIE_INVALID_ARGUMENT,
               "environment PIE_SERVER_TLS_ENABLED: expected true or false, got '1'");
}

/* Found by tests/fuzz/fuzz_config_yaml: a YAML file cannot carry bytes that are not UTF-8, so
 * such a value from the environment could be loaded but not printed back (--print-config wrote
 * YAML that libyaml refuses). Strings from the environment must be UTF-8 like the file's. */
Test(config, error_environment_string_is_not_utf8) {
    char *e1[] = {"PIE_SERVER_LISTEN=a\xa0" "b", NULL};
    load_fails(NULL, e1, PIE_INVALID_ARGUMENT,
               "environment PIE_SERVER_LISTEN: string is not valid UTF-8");
    char *e2[] = {"PIE_RPC_PEERS=a, \xc3", NULL};
    load_fails(NULL, e2, PIE_INVALID_ARGUMENT,
               "environment PIE_RPC_PEERS: string is not valid UTF-8");
    char *e3[] = {"PIE_SERVER_LISTEN=\xed\xa0\x80", NULL}; /* a surrogate: not UTF-8 either */
    load_fails(NULL, e3, PIE_INVALID_ARGUMENT,
               "environment PIE_SERVER_LISTEN: string is not valid UTF-8");
    tcfg c;
    char *ok[] = {"PIE_SERVER_LISTEN=gr\xc3\xbc\xc3\x9f \xf0\x9f\x8e\x89", NULL};
    load_ok(&c, NULL, ok);
    cr_assert_str_eq(c.listen, "gr\xc3\xbc\xc3\x9f \xf0\x9f\x8e\x89");
    pie_config_free(&tschema, &c);
}

Test(config, file_errors_come_before_environment_errors) {
    char *env[] = {"PIE_SERVER_PORT=x", NULL};
    load_fails("server: {port: y}\n", env, PIE_INVALID_ARGUMENT,
               "config.yaml:1:16: server.port: expected integer, got 'y'");
}

/* ---- required fields ------------------------------------------------------------------------ */

typedef struct rcfg {
    char *model;
    int64_t pages;
} rcfg;

static const pie_config_field rfields[] = {
    {"model.path", PIE_CFG_STRING, PIE_CONFIG_AT(rcfg, model), .doc = "Model directory.",
     .flags = PIE_CONFIG_REQUIRED},
    {"model.pages", PIE_CFG_INT, PIE_CONFIG_AT(rcfg, pages), .doc = "KV pages.", .min = "1",
     .flags = PIE_CONFIG_REQUIRED},
};
static const pie_config_schema rschema = PIE_CONFIG_SCHEMA(rcfg, rfields);

Test(config, required_keys) {
    pie_status st;
    rcfg c;
    pie_code rc = pie_config_load(&rschema, &c, NULL, NULL, &st);
    cr_assert_eq(rc, PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg,
                     "missing required key 'model.path' (set it in the config file or with "
                     "PIE_MODEL_PATH)",
                     "%s", st.msg);
    write_file("config.yaml", "model:\n  path: ~\n  pages: 8\n");
    rc = pie_config_load(&rschema, &c, "config.yaml", NULL, &st);
    cr_assert_eq(rc, PIE_INVALID_ARGUMENT, "null does not satisfy a required string");
    cr_assert_str_eq(st.msg,
                     "missing required key 'model.path' (set it in the config file or with "
                     "PIE_MODEL_PATH)",
                     "%s", st.msg);
    char *env[] = {"PIE_MODEL_PATH=/models/tiny", NULL};
    rc = pie_config_load(&rschema, &c, "config.yaml", env, &st);
    cr_assert_eq(rc, PIE_OK, "%s", st.msg);
    cr_assert_str_eq(c.model, "/models/tiny");
    cr_assert_eq(c.pages, 8);
    pie_config_free(&rschema, &c);
}

/* ---- schema bugs ---------------------------------------------------------------------------- */

typedef struct scfg {
    int a, b;
    char *s;
} scfg;

static void schema_fails(const pie_config_field *fields, size_t n, const char *msg) {
    pie_config_schema s = {fields, n, sizeof(scfg)};
    pie_status st;
    scfg c;
    pie_code rc = pie_config_load(&s, &c, NULL, NULL, &st);
    cr_assert_eq(rc, PIE_INTERNAL, "%s: %s", pie_code_name(rc), st.msg);
    cr_assert_str_eq(st.msg, msg, "message\n  got:  %s\n  want: %s", st.msg, msg);
}

Test(config, schema_bugs_are_internal_errors) {
    const pie_config_field bad_default[] = {
        {"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .def = "ten", .doc = "A."}};
    schema_fails(bad_default, 1, "config schema: x.a: bad default: expected integer, got 'ten'");
    const pie_config_field wrong_size[] = {
        {"x.a", PIE_CFG_STRING, PIE_CONFIG_AT(scfg, a), .doc = "A."}};
    schema_fails(wrong_size, 1, "config schema: x.a: member size 4 does not fit the type");
    const pie_config_field overlap[] = {
        {"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .doc = "A."},
        {"x.b", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .doc = "B."}};
    schema_fails(overlap, 2, "config schema: x.b: member overlaps the member of 'x.a'");
    const pie_config_field split[] = {
        {"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .doc = "A."},
        {"y.s", PIE_CFG_STRING, PIE_CONFIG_AT(scfg, s), .doc = "S."},
        {"x.b", PIE_CFG_INT, PIE_CONFIG_AT(scfg, b), .doc = "B."}};
    schema_fails(split, 3, "config schema: x.b: fields of section 'x' must be listed together");
    const pie_config_field env_clash[] = {
        {"x.a_b", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .doc = "A."},
        {"x_a.b", PIE_CFG_INT, PIE_CONFIG_AT(scfg, b), .doc = "B."}};
    schema_fails(env_clash, 2,
                 "config schema: x_a.b: shares environment variable PIE_X_A_B with 'x.a_b'");
    const pie_config_field key_and_section[] = {
        {"x", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .doc = "A."},
        {"x.b", PIE_CFG_INT, PIE_CONFIG_AT(scfg, b), .doc = "B."}};
    schema_fails(key_and_section, 2, "config schema: x.b: is both a key and a section with 'x'");
    const pie_config_field bad_path[] = {
        {"X.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .doc = "A."}};
    schema_fails(bad_path, 1,
                 "config schema: X.a: path must be dot-separated segments of [a-z0-9_], at most "
                 "120 bytes");
    const pie_config_field no_doc[] = {{"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a)}};
    schema_fails(no_doc, 1, "config schema: x.a: doc must be one non-empty line");
    const pie_config_field zero_outside[] = {
        {"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .min = "1", .doc = "A."}};
    schema_fails(zero_outside, 1,
                 "config schema: x.a: without a default the value is 0, outside [min, max]");
    const pie_config_field bad_max[] = {
        {"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .max = "5000000000", .doc = "A."}};
    schema_fails(bad_max, 1, "config schema: x.a: bad max '5000000000'");
    const pie_config_field required_default[] = {{"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a),
                                                  .def = "1", .doc = "A.",
                                                  .flags = PIE_CONFIG_REQUIRED}};
    schema_fails(required_default, 1, "config schema: x.a: a required field has no default");
}

/* ---- printing ------------------------------------------------------------------------------- */

static char *print_config(const tcfg *c) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    pie_status st;
    cr_assert_eq(pie_config_print(&tschema, c, f, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(fclose(f), 0);
    return buf;
}

Test(config, print_writes_the_effective_config_as_commented_yaml) {
    tcfg c;
    char *env[] = {"PIE_SERVER_TLS_CERT=/etc/\"x\"\\y", "PIE_AUTH_TOKEN=hunter2",
                   "PIE_RPC_TIMEOUT=90000", "PIE_SCHED_RATIO=0.1", NULL};
    load_ok(&c, NULL, env);
    char *out = print_config(&c);
    const char *want =
        "server:\n"
        "  # Address to bind. (env PIE_SERVER_LISTEN)\n"
        "  listen: \"127.0.0.1\"\n"
        "  # TCP port. (env PIE_SERVER_PORT)\n"
        "  port: 5000\n"
        "  tls:\n"
        "    # Serve TLS. (env PIE_SERVER_TLS_ENABLED)\n"
        "    enabled: false\n"
        "    # PEM file. (env PIE_SERVER_TLS_CERT)\n"
        "    cert: \"/etc/\\\"x\\\"\\\\y\"\n"
        "\n"
        "rpc:\n"
        "  # Largest message. (env PIE_RPC_MAX_MESSAGE_BYTES)\n"
        "  max_message_bytes: 4MiB\n"
        "  # Deadline of internal calls. (env PIE_RPC_TIMEOUT)\n"
        "  timeout: 90s\n"
        "  # Peers to dial. (env PIE_RPC_PEERS)\n"
        "  peers: [\"a:1\", \"b:2\"]\n"
        "\n"
        "log:\n"
        "  # Lowest level written. (env PIE_LOG_LEVEL)\n"
        "  level: info\n"
        "\n"
        "sched:\n"
        "  # Share of the batch. (env PIE_SCHED_RATIO)\n"
        "  ratio: 0.1\n"
        "  # An 8-bit knob. (env PIE_SCHED_SMALL)\n"
        "  small: -3\n"
        "  # Threads | workers. (env PIE_SCHED_WORKERS)\n"
        "  workers: 4\n"
        "# Bearer token. (env PIE_AUTH_TOKEN)\n"
        "auth_token: \"<redacted>\"\n";
    cr_assert_str_eq(out, want, "got:\n%s", out);
    free(out);
    pie_config_free(&tschema, &c);
}

Test(config, empty_secret_is_printed_as_empty) {
    tcfg c;
    char *env[] = {"PIE_AUTH_TOKEN=", NULL};
    load_ok(&c, NULL, env);
    char *out = print_config(&c);
    cr_assert_not_null(strstr(out, "\nauth_token: \"\"\n"), "%s", out);
    free(out);
    pie_config_free(&tschema, &c);
}

Test(config, printed_config_loads_back_to_the_same_values) {
    tcfg a, b;
    load_ok(&a,
            "server: {listen: \"tab\\there\", port: 1, tls: {enabled: true}}\n"
            "rpc: {max_message_bytes: 1000000, timeout: 1500, peers: ['q\"1', 'x']}\n"
            "log.level: warn\n"
            "sched: {ratio: 0.3333333333333333, small: 127, workers: 9}\n",
            NULL);
    char *out = print_config(&a);
    write_file("printed.yaml", out);
    free(out);
    pie_status st;
    b.untouched = 0;
    cr_assert_eq(pie_config_load(&tschema, &b, "printed.yaml", NULL, &st), PIE_OK, "%s", st.msg);
    cr_assert_str_eq(b.listen, a.listen);
    cr_assert_eq(b.port, a.port);
    cr_assert_eq(b.tls_enabled, a.tls_enabled);
    cr_assert_null(b.tls_cert);
    cr_assert_eq(b.max_message_bytes, a.max_message_bytes);
    cr_assert_eq(b.timeout_ms, 1500);
    cr_assert_eq(b.peers.n, 2);
    cr_assert_str_eq(b.peers.items[0], "q\"1");
    cr_assert_eq(b.level, a.level);
    cr_assert(b.ratio == a.ratio, "%.17g != %.17g", b.ratio, a.ratio);
    cr_assert_eq(b.small, a.small);
    cr_assert_eq(b.workers, a.workers);
    pie_config_free(&tschema, &a);
    pie_config_free(&tschema, &b);
}

/* Found by tests/fuzz/fuzz_config_yaml: characters YAML does not allow raw in a scalar (C1
 * controls, the BOM) or folds as line breaks (NEL, LS, PS) must be printed as escapes. */
Test(config, printed_unicode_controls_and_line_breaks_load_back) {
    tcfg a, b;
    load_ok(&a,
            "server: {listen: \"a\\x85b\\u2028c\\u2029d\\x80e\\x9ff\\ufeffg\\u00a0h\\ud7ffi\\ufffd\"}\n"
            "rpc: {peers: [\"\\x85\", \"\\u2028\"]}\n",
            NULL);
    cr_assert_str_eq(a.listen, "a\xc2\x85" "b\xe2\x80\xa8" "c\xe2\x80\xa9" "d\xc2\x80" "e\xc2\x9f"
                               "f\xef\xbb\xbf" "g\xc2\xa0" "h\xed\x9f\xbf" "i\xef\xbf\xbd");
    char *out = print_config(&a);
    write_file("printed.yaml", out);
    pie_status st;
    b.untouched = 0;
    cr_assert_eq(pie_config_load(&tschema, &b, "printed.yaml", NULL, &st), PIE_OK,
                 "%s\n--- printed:\n%s", st.msg, out);
    free(out);
    cr_assert_str_eq(b.listen, a.listen);
    cr_assert_eq(b.peers.n, 2);
    cr_assert_str_eq(b.peers.items[0], a.peers.items[0]);
    cr_assert_str_eq(b.peers.items[1], a.peers.items[1]);
    pie_config_free(&tschema, &a);
    pie_config_free(&tschema, &b);
}

Test(config, docs_are_a_markdown_table) {
    const pie_config_field fields[] = {
        {"x.a", PIE_CFG_INT, PIE_CONFIG_AT(scfg, a), .def = "3", .min = "1", .doc = "A | a."},
        {"x.b", PIE_CFG_ENUM, PIE_CONFIG_AT(scfg, b), .choices = levels, .doc = "B."},
        {"s", PIE_CFG_STRING, PIE_CONFIG_AT(scfg, s), .doc = "S.", .flags = PIE_CONFIG_REQUIRED},
    };
    pie_config_schema s = {fields, 3, sizeof(scfg)};
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    pie_status st;
    cr_assert_eq(pie_config_print_docs(&s, f, &st), PIE_OK, "%s", st.msg);
    cr_assert_eq(fclose(f), 0);
    const char *want =
        "| Key | Environment | Type | Default | Description |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| `x.a` | `PIE_X_A` | integer in [1, 2147483647] | `3` | A \\| a. |\n"
        "| `x.b` | `PIE_X_B` | one of debug, info, warn, error | (none) | B. |\n"
        "| `s` | `PIE_S` | string | required | S. |\n";
    cr_assert_str_eq(buf, want, "got:\n%s", buf);
    free(buf);
}

Test(config, env_name) {
    char buf[32];
    cr_assert_eq(pie_config_env_name("server.tls.cert_file", buf, sizeof buf), 0);
    cr_assert_str_eq(buf, "PIE_SERVER_TLS_CERT_FILE");
    cr_assert_eq(pie_config_env_name("server.tls.cert_file", buf, 10), -1);
}

Test(config, load_buffer_names_the_source) {
    pie_status st;
    tcfg c;
    const char text[] = "server: {port: q}";
    pie_code rc = pie_config_load_buffer(&tschema, &c, "helm values", text, sizeof text - 1,
                                         NULL, &st);
    cr_assert_eq(rc, PIE_INVALID_ARGUMENT);
    cr_assert_str_eq(st.msg, "helm values:1:16: server.port: expected integer, got 'q'", "%s",
                     st.msg);
}
