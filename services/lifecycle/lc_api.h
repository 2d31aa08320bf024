/* lc_api.h — the public API pie.v1.Lifecycle (proto/pie/v1/lifecycle.proto) of a replica.
 *
 * Owns: the method table — UploadProgram (client-streamed, assembled here, validated, stored
 * and put into the controller's registry on a thread of its own because compiling takes tens
 * of milliseconds), ListPrograms, DeleteProgram (cluster-wide, on a thread), Launch, Attach,
 * Run (a program this replica lacks is fetched from the registry on a thread first; a Run's
 * client messages meanwhile are kept and replayed), Terminate, ListInstances — plus ListModels
 * from lc_session; request checks and the translation between messages and lc_inst /
 * lc_program.
 * Does not own: instances (lc_inst.c), storage (lc_program.c), the registry client
 * (lc_store.c), the Session (lc_session.c). */
#ifndef LC_API_H
#define LC_API_H

#include <stddef.h>

#include "lc_inst.h"
#include "lc_program.h"
#include "lc_session.h"
#include "lc_store.h"
#include "pie_budget.h"
#include "rpc.h"

typedef struct lc_api lc_api;

/* store: the controller's program registry (lc_store.h); NULL: programs stay on this replica. */
lc_api *lc_api_create(lc_program_store *programs, lc_inst_mgr *insts, lc_session *session,
                      lc_store *store, pie_status *st);
/* Every pie.v1.Lifecycle method (ListModels from the session); *n gets the count. */
/* Uploads in progress at once (0: 16), of them at most max_tenant_uploads of one tenant's when
 * tenants are configured (0: half, rounded up), and the budget their buffers are charged to
 * (may be NULL). Before serving. */
void lc_api_set_limits(lc_api *a, uint32_t max_uploads, uint32_t max_tenant_uploads,
                       pie_budget *budget);
const rpc_method *lc_api_methods(lc_api *a, size_t *n);
/* After the server has shut down: waits for jobs still running (uploads being validated and
 * registered, fetches, deletes). NULL is fine. */
void lc_api_destroy(lc_api *a);

#endif
