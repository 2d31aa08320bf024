/* mdl_internal.h — what the files of services/worker/model share and nobody else sees.
 *
 * Owns: the declarations of the JSON file reader and value printer (mdl_json.c) and of one
 * validated, memory-mapped safetensors file (mdl_st.c). mdl_config.c and mdl.c use them.
 * Not installed: the public interface is mdl.h. */
#ifndef MDL_INTERNAL_H
#define MDL_INTERNAL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "mdl.h"

#define MDL_PATH_MAX       4096        /* longest path this module builds */
#define MDL_DIR_MAX        400         /* longest model directory accepted (mdl_model.dir) */
#define MDL_JSON_MAX_BYTES (64u << 20) /* largest config.json / index.json read */
#define MDL_MAX_DIMS       8           /* most dimensions of a safetensors tensor */

/* ---- JSON files (mdl_json.c) ------------------------------------------------------------- */

/* Reads path (a regular file of at most MDL_JSON_MAX_BYTES) and parses it as a JSON object.
 * Errors: pie_file_read's with "JSON file" as the role ("cannot open JSON file '<path>': ..."),
 * "<path>: invalid JSON at line L, column C: <jansson's text>",
 * "<path>: expected a JSON object at the top level" (mdl.c's list). *out is a new reference on
 * success. */
pie_code mdl_json_load_object(const char *path, json_t **out, pie_status *st);

/* Writes a short rendering of v for messages: 0, -3, 64.0, "64", true, null, a list of 3
 * values, an empty list, an object. Strings are cut at 40 bytes. */
void mdl_json_show(const json_t *v, char *buf, size_t n);

/* The code of a failed system call on a model file: NOT_FOUND (ENOENT, ENOTDIR),
 * PERMISSION_DENIED (EACCES, EPERM), RESOURCE_EXHAUSTED (ENOMEM), else INTERNAL. */
pie_code mdl_errno_code(int err);

/* Joins dir and name with '/'; fails (returns -1) if the result does not fit in n bytes. */
int mdl_path_join(char *buf, size_t n, const char *dir, const char *name);

/* ---- config.json (mdl_config.c) ---------------------------------------------------------- */

/* Checks that dir names a directory and writes it to norm[n] without trailing slashes.
 * Errors: the directory messages of mdl.c's list. */
pie_code mdl_dir_check(const char *dir, char *norm, size_t n, pie_status *st);

/* Parses <dir>/config.json (dir as written by mdl_dir_check). */
pie_code mdl_config_parse(const char *dir, mdl_config *cfg, pie_status *st);

/* ---- one safetensors file (mdl_st.c) ------------------------------------------------------ */

/* A safetensors dtype as the header names it, with its element size in bytes. */
typedef struct mdl_st_dtype {
    const char *name; /* "F32", "BF16", "I8", ... */
    uint32_t size;
    int mdl; /* the mdl_dtype for F32/F16/BF16, else -1 */
} mdl_st_dtype;

typedef struct mdl_st_tensor {
    const char *name; /* a key of the header object (lives as long as the header) */
    const mdl_st_dtype *dtype;
    int ndim;
    uint64_t shape[MDL_MAX_DIMS];
    uint64_t begin, end; /* data_offsets, relative to the data section */
} mdl_st_tensor;

typedef struct mdl_st_file {
    char path[MDL_PATH_MAX];
    void *map; /* the whole file, PROT_READ, MAP_PRIVATE */
    size_t map_len;
    const uint8_t *data; /* map + 8 + header length */
    uint64_t data_len;
    json_t *header;         /* parsed header; freed by mdl_st_drop_header */
    mdl_st_tensor *tensors; /* [n_tensors], in header order */
    size_t n_tensors;
} mdl_st_file;

/* Opens, maps and validates path: header length, header JSON, each tensor's dtype, shape and
 * data_offsets (inside the data, consistent with shape × dtype size, no overlaps). On failure
 * f holds nothing (mdl_st_close is still safe). named_by (may be NULL) is appended to the
 * cannot-open message as " (named by <named_by>)". */
pie_code mdl_st_open(const char *path, const char *named_by, mdl_st_file *f, pie_status *st);

/* The tensor called name, or NULL. */
const mdl_st_tensor *mdl_st_find(const mdl_st_file *f, const char *name);

/* Writes "[a, b, ...]" for messages. */
void mdl_st_shape_str(const uint64_t *shape, int ndim, char *buf, size_t n);

/* Frees the parsed header (tensor names die with it); the mapping stays. */
void mdl_st_drop_header(mdl_st_file *f);

/* Unmaps and frees everything; f may be zeroed or half-open. */
void mdl_st_close(mdl_st_file *f);

#endif
