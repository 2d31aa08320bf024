/* pie_config.h — typed YAML configuration: defaults < file < PIE_* environment.
 *
 * Owns: the schema (a static table of fields: dotted key path, type, where the value lives in
 * the caller's struct, default, bounds, one-line doc), loading a YAML file into a caller
 * struct through that schema, environment overrides, validation, and printing the effective
 * config and the schema's docs. Does not own: what the values mean (each service's config.c).
 *
 * A service writes:
 *
 *     typedef struct ctl_config { char *listen; uint16_t port; int64_t timeout_ms; int level; } ctl_config;
 *     static const char *const levels[] = {"debug", "info", "warn", "error", NULL};
 *     static const pie_config_field ctl_fields[] = {
 *         {"server.listen", PIE_CFG_STRING, PIE_CONFIG_AT(ctl_config, listen), .def = "0.0.0.0",
 *          .doc = "Address to bind."},
 *         {"server.port", PIE_CFG_UINT, PIE_CONFIG_AT(ctl_config, port), .def = "5000",
 *          .min = "1", .max = "65535", .doc = "TCP port."},
 *         {"rpc.timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(ctl_config, timeout_ms), .def = "2s",
 *          .doc = "Deadline of internal calls."},
 *         {"log.level", PIE_CFG_ENUM, PIE_CONFIG_AT(ctl_config, level), .def = "info",
 *          .choices = levels, .doc = "Lowest level written."},
 *     };
 *     static const pie_config_schema ctl_schema = PIE_CONFIG_SCHEMA(ctl_config, ctl_fields);
 *     ...
 *     ctl_config cfg;
 *     if (pie_config_load(&ctl_schema, &cfg, path, environ, &st) != PIE_OK) { print st.msg; exit }
 *     ...
 *     pie_config_free(&ctl_schema, &cfg);
 *
 * VALUE SYNTAX (the same for defaults, the file, the environment and min/max):
 *   STRING    any scalar, taken verbatim (YAML quoting rules apply in the file). NUL bytes are
 *             refused, and so is text that is not UTF-8 (a YAML file cannot hold it; in a
 *             default or the environment it is an error too, so that the effective config can
 *             always be printed). A YAML null (`~`, `null`, empty) sets the member to NULL.
 *   INT       optional sign and decimal digits: `-12`, `+7`, `0`. Member: int8..int64.
 *   UINT      decimal digits: `42`. Member: uint8..uint64 (or size_t).
 *   SIZE      bytes: decimal digits with an optional unit, no space: `4096`, `512B`, `64KiB`,
 *             `64Ki`, `2MiB`, `1GiB`, `1TiB` (powers of 1024) or `10kB`, `10KB`, `5MB`, `1GB`,
 *             `1TB` (powers of 1000). Member: uint8..uint64.
 *   DURATION  milliseconds: decimal digits with unit `ms`, `s`, `m` or `h`; a bare number is
 *             milliseconds: `250`, `500ms`, `2s`, `5m`, `1h`. Never negative. Member: int32 or
 *             int64 (milliseconds; name it `*_ms`).
 *   DOUBLE    a finite decimal number as strtod reads it (`0.5`, `1e-3`); no inf or nan.
 *   BOOL      `true`, `True`, `TRUE`, `false`, `False`, `FALSE` (YAML 1.2 core; `yes`/`on` are
 *             refused). Member: bool.
 *   ENUM      one of `choices`; the member (an int, or a C enum with values 0..n-1 in the same
 *             order) receives the index.
 *   STRLIST   in the file a sequence of scalars (`[a, b]` or block style); in a default or the
 *             environment a comma-separated list, spaces around items trimmed, empty items
 *             dropped (`a, b`; empty text = empty list). Member: pie_config_strlist.
 * Numbers are checked against [min, max] (inclusive; an absent bound is the member's limit).
 *
 * FILE SHAPE. The document is a mapping; a dotted path is written as nested mappings
 * (`server: {port: 80}`) or as a dotted key (`server.port: 80`), the two may be mixed. A null
 * section (`server:` with nothing under it) is an empty section. An empty file is allowed.
 * Keys not in the schema are errors; so is setting one key twice.
 *
 * ENVIRONMENT. Each field is overridden by PIE_<PATH> where PATH is its path upper-cased with
 * '.' → '_' (`server.port` → PIE_SERVER_PORT). PIE_* variables that name no field are ignored
 * (Kubernetes injects PIE_SERVICE_HOST and similar for a service called "pie").
 *
 * ERRORS (st->msg, exactly; positions are 1-based line:column, <v> is the offending text with
 * \ ' and control bytes escaped (\\ \' \xNN), cut at 64 bytes with "..."):
 *   reading the file: pie_file_read's messages and codes (pie_file.h) with the role "config":
 *     cannot open config '<file>': <strerror>   (NOT_FOUND, PERMISSION_DENIED, ... by errno)
 *     cannot read config '<file>': <strerror>   (INTERNAL)
 *   PIE_INVALID_ARGUMENT:
 *     config '<file>' is not a regular file
 *     config '<file>' is larger than 1048576 bytes
 *     <file>:<l>:<c>: YAML syntax error: <libyaml problem>[ (<libyaml context> at <l>:<c>)]
 *     <file>:<l>:<c>: expected a single YAML document, found another
 *     <file>:<l>:<c>: expected a mapping at the top level, got a scalar|a sequence
 *     <file>:<l>:<c>: mapping keys must be scalars, got a mapping|a sequence
 *     <file>:<l>:<c>: unknown key '<path>'
 *     <file>:<l>:<c>: duplicate key '<path>' (first at <l>:<c>)
 *     <file>:<l>:<c>: <section>: expected a mapping, got a scalar|a sequence
 *     <file>:<l>:<c>: <path>: expected <what>, got '<v>'|null|a mapping|a sequence
 *     <file>:<l>:<c>: <path>: <v> is out of range [<min>, <max>]
 *     <file>:<l>:<c>: <path>: '<v>' is not one of <c1>, <c2>, ...
 *     <file>:<l>:<c>: <path>: string contains a NUL byte
 *     <file>:<l>:<c>: <path>[<i>]: expected string, got null|a mapping|a sequence
 *     environment <VAR>: expected <what>, got '<v>'
 *     environment <VAR>: <v> is out of range [<min>, <max>]
 *     environment <VAR>: '<v>' is not one of <c1>, <c2>, ...
 *     environment <VAR>: string is not valid UTF-8
 *     missing required key '<path>' (set it in the config file or with <VAR>)
 *   where <what> is: integer | non-negative integer | number | true or false | string |
 *     size (integer with optional unit B, KiB, MiB, GiB, TiB, kB, MB, GB, TB) |
 *     duration (integer with unit ms, s, m, h; bare integer = ms) |
 *     one of <c1>, <c2>, ... (an enum given a non-scalar) | a sequence of strings (a list given
 *     a scalar or mapping).
 *   Value errors point at the value, key errors at the key. <min>/<max> are the schema's text
 *   (e.g. `1KiB`), or the member's limit in decimal (`-inf`/`inf` for doubles).
 *   PIE_INTERNAL — a bug in the schema table, found before anything is read:
 *     config schema: <path>: <problem>
 *   PIE_RESOURCE_EXHAUSTED: out of memory
 * The first error stops the load. */
#ifndef PIE_CONFIG_H
#define PIE_CONFIG_H

#include <stddef.h>
#include <stdio.h>

#include "pie_status.h"

typedef enum pie_config_type {
    PIE_CFG_STRING = 1, /* char *, malloc'd (NULL when unset) */
    PIE_CFG_INT,        /* int8_t .. int64_t */
    PIE_CFG_UINT,       /* uint8_t .. uint64_t */
    PIE_CFG_SIZE,       /* uint8_t .. uint64_t, bytes, unit suffixes */
    PIE_CFG_DURATION,   /* int32_t | int64_t, milliseconds, unit suffixes */
    PIE_CFG_DOUBLE,     /* double */
    PIE_CFG_BOOL,       /* bool */
    PIE_CFG_ENUM,       /* int: index into choices */
    PIE_CFG_STRLIST,    /* pie_config_strlist */
} pie_config_type;

/* A list of strings; items and the array are malloc'd and freed by pie_config_free. */
typedef struct pie_config_strlist {
    char **items;
    size_t n;
} pie_config_strlist;

enum {
    PIE_CONFIG_REQUIRED = 1u << 0, /* must be set by the file or the environment; no default */
    PIE_CONFIG_SECRET = 1u << 1,   /* STRING only: pie_config_print shows "<redacted>" unless empty */
};

typedef struct pie_config_field {
    const char *path;            /* dotted key path, segments of [a-z0-9_]: "server.port" */
    pie_config_type type;
    size_t offset, size;         /* of the member in the caller's struct: use PIE_CONFIG_AT */
    const char *def;             /* default in the value syntax above; NULL = 0 / NULL / empty */
    const char *min, *max;       /* numeric bounds in the value syntax, inclusive; NULL = none */
    const char *const *choices;  /* ENUM: names, NULL-terminated */
    const char *doc;             /* one line, for --print-config and generated docs */
    unsigned flags;              /* PIE_CONFIG_REQUIRED | PIE_CONFIG_SECRET */
} pie_config_field;

#define PIE_CONFIG_AT(T, member) offsetof(T, member), sizeof(((T *)0)->member)

typedef struct pie_config_schema {
    const pie_config_field *fields;
    size_t n_fields;
    size_t struct_size; /* sizeof the caller's struct; every field must lie inside it */
} pie_config_schema;

#define PIE_CONFIG_SCHEMA(T, fields_array)                                                     \
    { (fields_array), sizeof(fields_array) / sizeof((fields_array)[0]), sizeof(T) }

/* Fills the schema's members of *out: defaults, then the YAML file at path (NULL: no file),
 * then PIE_* variables from envp (a NULL-terminated "NAME=value" array such as environ; NULL:
 * no environment), then checks required fields. Members not in the schema are left alone; the
 * schema's members are overwritten without being freed first. On failure returns the code in
 * st (messages listed above) and *out holds no allocations (strings NULL, lists empty). */
pie_code pie_config_load(const pie_config_schema *schema, void *out, const char *path,
                         char *const *envp, pie_status *st);

/* As pie_config_load, with the YAML text in memory; name stands for the file in messages. */
pie_code pie_config_load_buffer(const pie_config_schema *schema, void *out, const char *name,
                                const char *text, size_t len, char *const *envp,
                                pie_status *st);

/* Frees the strings and lists that load allocated and sets them to NULL / empty. */
void pie_config_free(const pie_config_schema *schema, void *cfg);

/* Writes cfg as YAML that pie_config_load reads back to the same values (secrets aside), one
 * "# doc (env VAR)" comment above each key. For --print-config. */
pie_code pie_config_print(const pie_config_schema *schema, const void *cfg, FILE *f,
                          pie_status *st);

/* Writes the schema as a Markdown table: key, environment variable, type and range, default,
 * doc. For generated docs and --help-config. */
pie_code pie_config_print_docs(const pie_config_schema *schema, FILE *f, pie_status *st);

/* "server.port" → "PIE_SERVER_PORT" into buf; returns 0, or -1 if it does not fit. */
int pie_config_env_name(const char *path, char *buf, size_t n);

#endif
