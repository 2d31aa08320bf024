/* mdl_st.c — one safetensors file: mapped read-only and validated whole.
 *
 * Format: 8 bytes little-endian header length N, N bytes of JSON
 *   {"<tensor>": {"dtype": "F32", "shape": [r, c], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {...}}
 * then the data section; offsets are relative to its start (byte 8 + N of the file).
 *
 * Owns: the mapping (whole file, PROT_READ, MAP_PRIVATE), the header parse (duplicate names
 * rejected), the per-tensor checks (known dtype, shape of at most MDL_MAX_DIMS non-negative
 * dimensions whose byte size fits 64 bits, data_offsets inside the data and equal in length to
 * shape × dtype size, no two tensors overlapping) and lookup by name. __metadata__ is not
 * interpreted. Does not own: which tensors a model needs and their shapes (mdl.c). The messages
 * are listed in mdl.c's header comment. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mdl_internal.h"

/* Every dtype of the safetensors format with a whole-byte element; the first three are the
 * ones the kernels read. */
static const mdl_st_dtype st_dtypes[] = {
    {"F32", 4, MDL_F32}, {"F16", 2, MDL_F16}, {"BF16", 2, MDL_BF16}, {"F64", 8, -1},
    {"I64", 8, -1},      {"U64", 8, -1},      {"I32", 4, -1},        {"U32", 4, -1},
    {"I16", 2, -1},      {"U16", 2, -1},      {"I8", 1, -1},         {"U8", 1, -1},
    {"BOOL", 1, -1},     {"F8_E4M3", 1, -1},  {"F8_E5M2", 1, -1},    {"F8_E8M0", 1, -1},
};

static const mdl_st_dtype *st_dtype_find(const char *name) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(st_dtypes[i].name, name) == 0) return &st_dtypes[i];
    return NULL;
}

void mdl_st_shape_str(const uint64_t *shape, int ndim, char *buf, size_t n) {
    size_t o = 0;
    if (n == 0) return;
    buf[0] = '\0';
    for (int i = 0; i <= ndim && o < n; i++) {
        int k;
        if (i == ndim)
            k = snprintf(buf + o, n - o, "]");
        else
            k = snprintf(buf + o, n - o, "%s%llu", i == 0 ? "[" : ", ",
                         (unsigned long long)shape[i]);
        if (k < 0) return;
        o += (size_t)k;
    }
    if (ndim == 0 && o < n) snprintf(buf, n, "[]");
}

/* Sets st to "<path>: tensor '<name>': <detail>" (INVALID_ARGUMENT). */
static pie_code st_bad(const mdl_st_file *f, const char *name, pie_status *st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static pie_code st_bad(const mdl_st_file *f, const char *name, pie_status *st, const char *fmt,
                       ...) {
    char detail[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: tensor '%.80s': %s", f->path, name,
                          detail);
}

/* A non-negative JSON integer as uint64; 0 on success. */
static int st_uint(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

/* Fills t from the header entry val (all checks but overlaps). */
static pie_code st_tensor(const mdl_st_file *f, const char *name, json_t *val, mdl_st_tensor *t,
                          pie_status *st) {
    char shown[64];
    t->name = name;
    if (!json_is_object(val)) {
        mdl_json_show(val, shown, sizeof shown);
        return st_bad(f, name, st, "expected an object with dtype, shape and data_offsets, got %s",
                      shown);
    }
    static const char *const fields[] = {"dtype", "shape", "data_offsets"};
    for (size_t i = 0; i < 3; i++)
        if (json_object_get(val, fields[i]) == NULL)
            return st_bad(f, name, st, "missing '%s'", fields[i]);

    json_t *dt = json_object_get(val, "dtype");
    if (!json_is_string(dt)) {
        mdl_json_show(dt, shown, sizeof shown);
        return st_bad(f, name, st, "dtype: expected a string, got %s", shown);
    }
    t->dtype = st_dtype_find(json_string_value(dt));
    if (t->dtype == NULL)
        return st_bad(f, name, st, "unknown dtype '%.40s'", json_string_value(dt));

    json_t *shape = json_object_get(val, "shape");
    if (!json_is_array(shape)) {
        mdl_json_show(shape, shown, sizeof shown);
        return st_bad(f, name, st, "shape: expected a list of non-negative integers, got %s",
                      shown);
    }
    if (json_array_size(shape) > MDL_MAX_DIMS)
        return st_bad(f, name, st, "shape has %zu dimensions (at most %d supported)",
                      json_array_size(shape), MDL_MAX_DIMS);
    t->ndim = (int)json_array_size(shape);
    for (int i = 0; i < t->ndim; i++) {
        json_t *d = json_array_get(shape, (size_t)i);
        if (st_uint(d, &t->shape[i]) != 0) {
            mdl_json_show(d, shown, sizeof shown);
            return st_bad(f, name, st, "shape[%d]: expected a non-negative integer, got %s", i,
                          shown);
        }
    }

    json_t *offs = json_object_get(val, "data_offsets");
    if (!json_is_array(offs) || json_array_size(offs) != 2) {
        mdl_json_show(offs, shown, sizeof shown);
        return st_bad(f, name, st,
                      "data_offsets: expected a list of 2 integers [begin, end], got %s", shown);
    }
    uint64_t be[2];
    for (int i = 0; i < 2; i++) {
        json_t *d = json_array_get(offs, (size_t)i);
        if (st_uint(d, &be[i]) != 0) {
            mdl_json_show(d, shown, sizeof shown);
            return st_bad(f, name, st, "data_offsets[%d]: expected a non-negative integer, got %s",
                          i, shown);
        }
    }
    t->begin = be[0];
    t->end = be[1];
    if (t->begin > t->end)
        return st_bad(f, name, st, "data_offsets [%llu, %llu]: begin is after end",
                      (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > f->data_len)
        return st_bad(f, name, st, "data_offsets [%llu, %llu] exceed the %llu bytes of data",
                      (unsigned long long)t->begin, (unsigned long long)t->end,
                      (unsigned long long)f->data_len);

    char shp[160];
    mdl_st_shape_str(t->shape, t->ndim, shp, sizeof shp);
    uint64_t bytes = t->dtype->size;
    for (int i = 0; i < t->ndim; i++)
        if (__builtin_mul_overflow(bytes, t->shape[i], &bytes))
            return st_bad(f, name, st, "shape %s of %s overflows 64-bit sizes", shp,
                          t->dtype->name);
    if (bytes != t->end - t->begin)
        return st_bad(f, name, st,
                      "shape %s of %s is %llu bytes, but data_offsets [%llu, %llu] span %llu", shp,
                      t->dtype->name, (unsigned long long)bytes, (unsigned long long)t->begin,
                      (unsigned long long)t->end, (unsigned long long)(t->end - t->begin));
    return PIE_OK;
}

static int st_cmp_begin(const void *a, const void *b) {
    const mdl_st_tensor *x = *(const mdl_st_tensor *const *)a,
                        *y = *(const mdl_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* No two non-empty tensors share a byte. */
static pie_code st_check_overlaps(const mdl_st_file *f, pie_status *st) {
    if (f->n_tensors < 2) return PIE_OK;
    const mdl_st_tensor **order = malloc(f->n_tensors * sizeof *order);
    if (order == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", f->path);
    for (size_t i = 0; i < f->n_tensors; i++) order[i] = &f->tensors[i];
    qsort(order, f->n_tensors, sizeof *order, st_cmp_begin);
    pie_code rc = PIE_OK;
    const mdl_st_tensor *last = NULL; /* the non-empty tensor reaching furthest so far */
    for (size_t i = 0; i < f->n_tensors; i++) {
        const mdl_st_tensor *t = order[i];
        if (t->begin == t->end) continue;
        if (last != NULL && t->begin < last->end) {
            rc = st_bad(f, t->name, st,
                        "data_offsets [%llu, %llu] overlap tensor '%.80s' [%llu, %llu]",
                        (unsigned long long)t->begin, (unsigned long long)t->end, last->name,
                        (unsigned long long)last->begin, (unsigned long long)last->end);
            break;
        }
        if (last == NULL || t->end > last->end) last = t;
    }
    free(order);
    return rc;
}

/* Parses and checks the header of a mapped file. */
static pie_code st_parse_header(mdl_st_file *f, uint64_t header_len, pie_status *st) {
    json_error_t jerr;
    f->header =
        json_loadb((const char *)f->map + 8, (size_t)header_len, JSON_REJECT_DUPLICATES, &jerr);
    if (f->header == NULL)
        return pie_status_set(st, PIE_INVALID_ARGUMENT,
                              "%s: header is not valid JSON at line %d, column %d: %s", f->path,
                              jerr.line, jerr.column, jerr.text);
    if (!json_is_object(f->header))
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: header is not a JSON object", f->path);

    size_t cap = json_object_size(f->header);
    f->tensors = calloc(cap > 0 ? cap : 1, sizeof *f->tensors);
    if (f->tensors == NULL)
        return pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "%s: out of memory", f->path);
    const char *key;
    json_t *val;
    json_object_foreach(f->header, key, val) {
        if (strcmp(key, "__metadata__") == 0) continue;
        pie_code rc = st_tensor(f, key, val, &f->tensors[f->n_tensors], st);
        if (rc != PIE_OK) return rc;
        f->n_tensors++;
    }
    return st_check_overlaps(f, st);
}

pie_code mdl_st_open(const char *path, const char *named_by, mdl_st_file *f, pie_status *st) {
    memset(f, 0, sizeof *f);
    pie_code rc = PIE_OK;
    int k = snprintf(f->path, sizeof f->path, "%s", path);
    if (k < 0 || (size_t)k >= sizeof f->path)
        return pie_status_set(st, PIE_INVALID_ARGUMENT, "%.80s...: path is too long", path);

    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO must not block */
    if (fd < 0) {
        int e = errno;
        return pie_status_set(st, mdl_errno_code(e), "%s: cannot open: %s%s%s%s", path, strerror(e),
                              named_by ? " (named by " : "", named_by ? named_by : "",
                              named_by ? ")" : "");
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        rc = pie_status_set(st, PIE_INTERNAL, "%s: cannot stat: %s", path, strerror(e));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "%s: not a regular file", path);
        goto fail;
    }
    if (sb.st_size < 8) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "%s: file is %lld bytes, too short for the 8-byte header length", path,
                            (long long)sb.st_size);
        goto fail;
    }
    f->map_len = (size_t)sb.st_size;
    void *map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        int e = errno;
        rc = pie_status_set(st, mdl_errno_code(e), "%s: mmap of %zu bytes failed: %s", path,
                            f->map_len, strerror(e));
        goto fail;
    }
    f->map = map;
    (void)close(fd); /* the mapping stays valid; read-only: nothing to flush */
    fd = -1;

    const uint8_t *b = f->map;
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--) header_len = (header_len << 8) | b[i];
    if (header_len > f->map_len - 8) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT,
                            "%s: header length %llu exceeds the file size %zu", path,
                            (unsigned long long)header_len, f->map_len);
        goto fail;
    }
    f->data = b + 8 + header_len;
    f->data_len = f->map_len - 8 - header_len;
    if ((rc = st_parse_header(f, header_len, st)) != PIE_OK) goto fail;
    return PIE_OK;

fail:
    if (fd >= 0) (void)close(fd);
    mdl_st_close(f);
    return rc;
}

const mdl_st_tensor *mdl_st_find(const mdl_st_file *f, const char *name) {
    for (size_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

void mdl_st_drop_header(mdl_st_file *f) {
    free(f->tensors);
    f->tensors = NULL;
    f->n_tensors = 0;
    json_decref(f->header);
    f->header = NULL;
}

void mdl_st_close(mdl_st_file *f) {
    mdl_st_drop_header(f);
    /* munmap fails only for arguments mmap gave us; nothing to report at close */
    if (f->map != NULL) (void)munmap(f->map, f->map_len);
    f->map = NULL;
    f->map_len = 0;
    f->data = NULL;
    f->data_len = 0;
}
