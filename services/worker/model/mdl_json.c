/* mdl_json.c — reading the small JSON files of a model directory (config.json,
 * model.safetensors.index.json) and quoting JSON values in error messages.
 *
 * Owns: the jansson parse with line/column in the message, the value printer, the path join,
 * and the errno → pie_code mapping of this folder's other file operations. Does not own: what
 * the keys mean (mdl_config.c, mdl.c), the bounded whole-file read (pie_file.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mdl_internal.h"
#include "pie_file.h"

int mdl_path_join(char *buf, size_t n, const char *dir, const char *name) {
    int k = snprintf(buf, n, "%s/%s", dir, name);
    return (k < 0 || (size_t)k >= n) ? -1 : 0;
}

pie_code mdl_errno_code(int err) {
    if (err == ENOENT || err == ENOTDIR) return PIE_NOT_FOUND;
    if (err == EACCES || err == EPERM) return PIE_PERMISSION_DENIED;
    if (err == ENOMEM) return PIE_RESOURCE_EXHAUSTED;
    return PIE_INTERNAL;
}

pie_code mdl_json_load_object(const char *path, json_t **out, pie_status *st) {
    char *buf = NULL;
    size_t len = 0;
    json_t *root = NULL;
    *out = NULL;
    pie_code rc = pie_file_read(path, "JSON file", MDL_JSON_MAX_BYTES, &buf, &len, st);
    if (rc != PIE_OK) return rc;

    json_error_t jerr;
    root = json_loadb(buf, len, 0, &jerr);
    if (root == NULL) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: invalid JSON at line %d, column %d: %s",
                            path, jerr.line, jerr.column, jerr.text);
        goto done;
    }
    if (!json_is_object(root)) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: expected a JSON object at the top level",
                            path);
        goto done;
    }
    *out = root;
    root = NULL;

done:
    json_decref(root);
    free(buf);
    return rc;
}

/* Shortest "%.*g" that reads back as v; ".0" added when it would look like an integer. */
static void show_real(double v, char *buf, size_t n) {
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    if (strpbrk(buf, ".eEni") == NULL && strlen(buf) + 2 < n) strcat(buf, ".0");
}

void mdl_json_show(const json_t *v, char *buf, size_t n) {
    if (n == 0) return;
    switch (json_typeof(v)) {
    case JSON_OBJECT: snprintf(buf, n, "an object"); break;
    case JSON_ARRAY: {
        size_t k = json_array_size(v);
        if (k == 0)
            snprintf(buf, n, "an empty list");
        else
            snprintf(buf, n, "a list of %zu value%s", k, k == 1 ? "" : "s");
        break;
    }
    case JSON_STRING: {
        const char *s = json_string_value(v);
        size_t len = json_string_length(v);
        snprintf(buf, n, "\"%.40s%s\"", s, len > 40 ? "..." : "");
        break;
    }
    case JSON_INTEGER: snprintf(buf, n, "%" JSON_INTEGER_FORMAT, json_integer_value(v)); break;
    case JSON_REAL: show_real(json_real_value(v), buf, n); break;
    case JSON_TRUE: snprintf(buf, n, "true"); break;
    case JSON_FALSE: snprintf(buf, n, "false"); break;
    case JSON_NULL: snprintf(buf, n, "null"); break;
    default: snprintf(buf, n, "a value"); break;
    }
}
