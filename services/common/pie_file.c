/* pie_file.c — see pie_file.h. */
#include "pie_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

pie_code pie_file_errno_code(int err) {
    if (err == ENOENT || err == ENOTDIR) return PIE_NOT_FOUND;
    if (err == EACCES || err == EPERM) return PIE_PERMISSION_DENIED;
    if (err == ENOMEM) return PIE_RESOURCE_EXHAUSTED;
    if (err == EISDIR || err == ELOOP || err == ENAMETOOLONG) return PIE_INVALID_ARGUMENT;
    return PIE_INTERNAL;
}

pie_code pie_file_read(const char *path, const char *what, size_t max_bytes, char **buf,
                       size_t *len, pie_status *st) {
    char eb[128];
    *buf = NULL;
    *len = 0;
    /* O_NONBLOCK: a FIFO in place of the file must not block the open (it is then refused as
     * not a regular file); regular files ignore the flag. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        return pie_status_set(st, pie_file_errno_code(e), "cannot open %s '%s': %s", what, path,
                              strerror_r(e, eb, sizeof eb));
    }
    pie_code rc = PIE_OK;
    char *b = NULL;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        rc = pie_status_set(st, PIE_INTERNAL, "cannot stat %s '%s': %s", what, path,
                            strerror_r(e, eb, sizeof eb));
        goto done;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "%s '%s' is not a regular file", what, path);
        goto done;
    }
    if (sb.st_size < 0 || (uintmax_t)sb.st_size > (uintmax_t)max_bytes ||
        (uintmax_t)sb.st_size >= (uintmax_t)SIZE_MAX) { /* the last test keeps cap + 1 exact */
        rc = pie_status_set(st, PIE_INVALID_ARGUMENT, "%s '%s' is larger than %zu bytes", what,
                            path, max_bytes);
        goto done;
    }
    size_t cap = (size_t)sb.st_size;
    b = malloc(cap + 1);
    if (b == NULL) {
        rc = pie_status_set(st, PIE_RESOURCE_EXHAUSTED, "out of memory reading %s '%s' (%zu bytes)",
                            what, path, cap);
        goto done;
    }
    size_t n = 0;
    while (n < cap) {
        ssize_t k = read(fd, b + n, cap - n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            int e = errno;
            rc = pie_status_set(st, PIE_INTERNAL, "cannot read %s '%s': %s", what, path,
                                strerror_r(e, eb, sizeof eb));
            goto done;
        }
        if (k == 0) break; /* the file shrank: return what is there */
        n += (size_t)k;
    }
    b[n] = '\0';
    *buf = b;
    *len = n;
    b = NULL;
done:
    free(b);
    (void)close(fd); /* read-only: nothing to lose */
    return rc;
}
