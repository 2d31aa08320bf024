/* lc_api.h — the public API pie.v1.Lifecycle (proto/pie/v1/lifecycle.proto) of a replica.
 *
 * Owns: the method table — UploadProgram (client-streamed, assembled here, validated and
 * stored on a thread of its own because compiling takes tens of milliseconds), ListPrograms,
 * DeleteProgram, Launch, Attach, Run, Terminate, ListInstances — plus ListModels from
 * lc_session; request checks and the translation between messages and lc_inst / lc_program.
 * Does not own: instances (lc_inst.c), storage (lc_program.c), the Session (lc_session.c). */
#ifndef LC_API_H
#define LC_API_H

#include <stddef.h>

#include "lc_inst.h"
#include "lc_program.h"
#include "lc_session.h"
#include "rpc.h"

typedef struct lc_api lc_api;

lc_api *lc_api_create(lc_program_store *programs, lc_inst_mgr *insts, lc_session *session,
                      pie_status *st);
/* Every pie.v1.Lifecycle method (ListModels from the session); *n gets the count. */
const rpc_method *lc_api_methods(lc_api *a, size_t *n);
/* After the server has shut down: waits for uploads still being validated. NULL is fine. */
void lc_api_destroy(lc_api *a);

#endif
