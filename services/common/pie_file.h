/* pie_file.h — reading a whole file into memory: configs, model JSON, tokenizers, programs.
 *
 * Owns: the one bounded, EINTR-safe whole-file read of the services and tools, its errno →
 * pie_code mapping and its messages. Does not own what the bytes mean (each caller parses). */
#ifndef PIE_FILE_H
#define PIE_FILE_H

#include <stddef.h>

#include "pie_status.h"

/* Reads path, a regular file of at most max_bytes (SIZE_MAX: no cap), into *buf (malloc'd,
 * NUL-terminated; the caller frees it) and *len (the bytes without the NUL). `what` names the
 * file's role in the messages ("config", "tokenizer"). The open does not block on a FIFO:
 * anything but a regular file is refused. If the file shrinks while it is read, what was there
 * is returned. EINTR is retried.
 * Errors (*buf is then NULL and *len 0):
 *   NOT_FOUND          "cannot open <what> '<path>': <strerror>" (ENOENT, ENOTDIR)
 *   PERMISSION_DENIED  the same message (EACCES, EPERM)
 *   INVALID_ARGUMENT   "<what> '<path>' is not a regular file",
 *                      "<what> '<path>' is larger than <max_bytes> bytes",
 *                      or the open's message (EISDIR, ELOOP, ENAMETOOLONG)
 *   RESOURCE_EXHAUSTED "out of memory reading <what> '<path>' (<n> bytes)", or the open's (ENOMEM)
 *   INTERNAL           "cannot stat <what> '<path>': <strerror>",
 *                      "cannot read <what> '<path>': <strerror>", or the open's (other errno) */
pie_code pie_file_read(const char *path, const char *what, size_t max_bytes, char **buf,
                       size_t *len, pie_status *st);

/* The pie_code of an errno from open, stat or read, as pie_file_read maps it. */
pie_code pie_file_errno_code(int err);

#endif
