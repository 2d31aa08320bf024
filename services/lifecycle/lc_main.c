/* lc_main.c — pie-lifecycle: the application layer's process (public API, inferlet runtime).
 *
 * Owns: the lifecycle's configuration schema and start/stop order. The Session with the
 * controller is in lc_session.c, the Wasm runtime in wasm/, the `pie` host API in lc_host*.c,
 * programs in lc_program.c, instances in lc_inst.c, the pie.v1.Lifecycle methods in lc_api.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lc_api.h"
#include "lc_host.h"
#include "lc_inst.h"
#include "lc_program.h"
#include "lc_session.h"
#include "lc_store.h"
#include "lc_tokreg.h"
#include "lc_wasm.h"
#include "pie_log.h"
#include "svc.h"

#define LC_TOKENIZER_MAX_BYTES (512u << 20) /* as the worker's limit on tokenizer.json */
#define LC_STORE_CALL_MS       30000        /* one call to the controller's storage */

typedef struct lc_config {
    svc_config svc;
    svc_dial_config dial; /* controller.* */
    char *tenants_dir;    /* tenants.dir */
    char *replica_id;     /* replica.id */
    char *advertise;      /* replica.advertise */
    char *cache_dir;      /* runtime.cache_dir */
    bool tier1;           /* runtime.tier1 */
    bool tier0_wasm2c;    /* runtime.tier0_wasm2c */
    char *tier1_cc;       /* runtime.tier1_cc */
    uint64_t stack_bytes; /* runtime.instance_stack */
    uint64_t max_program_bytes;
    uint64_t output_buffer_bytes;
    int64_t retention_ms;
    uint64_t retention_max;
    lc_limits defaults, maxima;
    uint64_t replica_memory; /* limits.replica_memory */
    double tenant_memory_share; /* limits.tenant_memory_share */
    uint32_t max_uploads;    /* programs.max_uploads */
    uint32_t max_tenant_uploads; /* programs.max_tenant_uploads */
    uint32_t max_loaded;     /* programs.max_loaded */
    uint64_t store_size;     /* programs.store_size */
    char *tokenizer_path, *http_allow;
    bool tokenizer_fetch; /* tokenizer.fetch */
    bool registry;        /* programs.registry */
    int64_t http_timeout_ms;
    uint64_t http_max_bytes;
    uint32_t http_max_running;
    lc_wasm_module_limits module_limits; /* programs.max_functions, max_function_size, ... */
    int64_t compile_timeout_ms;          /* runtime.compile_timeout */
    int64_t tier1_timeout_ms;            /* runtime.tier1_timeout */
    uint64_t cache_size;                 /* runtime.cache_size */
    uint32_t max_compiles;               /* runtime.max_compiles */
    uint32_t compile_queue;              /* runtime.compile_queue */
} lc_config;

/* The seven quota keys of limits.<which> (which = default or max) into member m. */
/* clang-format off */
#define LC_LIMIT_FIELDS(which, m, mem, kv, emb, q, msg, cpu, wall, what)                       \
    {"limits." which ".memory", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, m.memory_bytes),        \
     .def = mem, .min = "64KiB", .max = "4GiB", .doc = what " linear memory of an instance"},  \
    {"limits." which ".kv_pages", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, m.kv_pages),          \
     .def = kv, .min = "1", .doc = what " KV pages an instance may hold"},                     \
    {"limits." which ".embeddings", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, m.embeddings),      \
     .def = emb, .min = "1", .doc = what " embeddings an instance may hold"},                  \
    {"limits." which ".queues", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, m.queues), .def = q,    \
     .min = "1", .doc = what " command queues an instance may hold"},                          \
    {"limits." which ".message", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, m.message_bytes),      \
     .def = msg, .min = "1", .max = "1GiB",                                                    \
     .doc = what " size of one message to or from an instance"},                               \
    {"limits." which ".cpu", PIE_CFG_DURATION, PIE_CONFIG_AT(lc_config, m.cpu_ms), .def = cpu, \
     .min = "1ms", .max = "8760h", .doc = what " CPU time of an instance's code"},             \
    {"limits." which ".wall", PIE_CFG_DURATION, PIE_CONFIG_AT(lc_config, m.wall_ms),           \
     .def = wall, .min = "1ms", .max = "8760h", .doc = what " lifetime of an instance from launch"}
/* clang-format on */

static const pie_config_field lc_fields[] = {
    SVC_CONFIG_FIELDS(lc_config, "0.0.0.0:50051", "0.0.0.0:9091"),
    SVC_DIAL_FIELDS(lc_config, dial),
    {"tenants.dir", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, tenants_dir), .def = "",
     .doc = "directory of tenant files <name>.yaml (token, admin, quotas; a mounted Secret): "
            "clients then need a tenant's token, auth.token is only for the internal links "
            "(empty = one anonymous tenant)"},
    {"replica.id", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, replica_id), .def = "",
     .doc = "name of this replica in status and logs (empty = <hostname>:<grpc port>)"},
    {"replica.advertise", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, advertise), .def = "",
     .doc = "host:port at which clients reach this replica (empty = unknown)"},
    {"runtime.cache_dir", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, cache_dir),
     .def = "/var/cache/pie",
     .doc = "directory of stored programs and compiled code (replicas may share it)"},
    {"runtime.tier1", PIE_CFG_BOOL, PIE_CONFIG_AT(lc_config, tier1), .def = "true",
     .doc = "recompile programs with cc -O2 in the background; later launches use it"},
    {"runtime.tier0_wasm2c", PIE_CFG_BOOL, PIE_CONFIG_AT(lc_config, tier0_wasm2c), .def = "false",
     .doc = "first compiles translate with wasm2c instead of lc_wasm's own translator (for A/B "
            "comparisons and as an escape hatch; the own one falls back to wasm2c by itself for "
            "modules it declines)"},
    {"runtime.tier1_cc", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, tier1_cc), .def = "cc",
     .doc = "C compiler of tier 1 (gcc or clang; PATH is searched)"},
    {"runtime.instance_stack", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, stack_bytes), .def = "512KiB",
     .min = "256KiB", .max = "256MiB",
     .doc = "native stack of an instance thread (address space; only touched pages count)"},
    {"runtime.compile_timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(lc_config, compile_timeout_ms),
     .def = "60s", .min = "100ms", .max = "1h",
     .doc = "longest a program's first compile (wasm2c | tcc) may run: it is then killed and "
            "the upload or launch fails RESOURCE_EXHAUSTED"},
    {"runtime.tier1_timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(lc_config, tier1_timeout_ms),
     .def = "10m", .min = "1s", .max = "24h",
     .doc = "longest a tier-1 recompile (cc -O2) may run: it is then killed and the program "
            "stays at tier 0"},
    {"runtime.cache_size", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, cache_size), .def = "4GiB",
     .doc = "disk the compiled code under runtime.cache_dir/native may take (~130-400 KiB a "
            "program); beyond it that of programs not loaded is removed, least recently used "
            "first, down to 3/4 of it, and compiled again when launched (0 = no bound; stored "
            "programs are not counted or removed)"},
    {"runtime.max_compiles", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, max_compiles), .def = "2",
     .min = "1", .max = "256",
     .doc = "first compiles of programs that run at once (uploads, launches of programs not "
            "compiled on this replica yet)"},
    {"runtime.compile_queue", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, compile_queue), .def = "32",
     .max = "100000",
     .doc = "compiles that may wait for one of runtime.max_compiles to end; more fail "
            "RESOURCE_EXHAUSTED at once (0: none wait)"},
    {"programs.max_size", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, max_program_bytes), .def = "64MiB",
     .min = "1KiB", .max = "1GiB", .doc = "largest program accepted by upload"},
    {"programs.max_functions", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, module_limits.max_functions),
     .def = "20000", .min = "1", .max = "1000000",
     .doc = "most functions a program may define, checked before it is compiled (wasm2c's "
            "time grows faster than linearly with them)"},
    {"programs.max_function_size", PIE_CFG_SIZE,
     PIE_CONFIG_AT(lc_config, module_limits.max_function_bytes), .def = "1MiB", .min = "1KiB",
     .max = "64MiB", .doc = "largest function body of a program, checked before it is compiled"},
    {"programs.max_nesting", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, module_limits.max_nesting),
     .def = "4096", .min = "16", .max = "1000000",
     .doc = "deepest nesting of blocks, loops and ifs in a program's function, checked before "
            "it is compiled (wasm2c crashes near 15000 on an 8 MiB stack)"},
    {"programs.max_uploads", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, max_uploads), .def = "16",
     .min = "1", .max = "4096",
     .doc =
         "uploads in progress at once on this replica; more are refused RESOURCE_EXHAUSTED "
         "(each holds its program's bytes in memory until it is stored; it stops counting before "
         "its answer is sent, so one client's uploads in a row never meet their own)"},
    {"programs.max_tenant_uploads", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, max_tenant_uploads),
     .def = "0", .max = "4096",
     .doc = "with tenants, uploads in progress at once of one tenant's on this replica, so that "
            "one tenant never takes every programs.max_uploads slot (0 = half of them, rounded "
            "up); more are refused RESOURCE_EXHAUSTED naming the tenant"},
    {"programs.max_loaded", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, max_loaded), .def = "512",
     .min = "1", .max = "1000000",
     .doc = "programs kept loaded (native code mapped, ~140 KiB each) for quick launches; beyond "
            "it the least recently used is unloaded and loaded again from the store when "
            "launched (running instances keep theirs)"},
    {"programs.store_size", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, store_size), .def = "4GiB",
     .doc = "disk the stored programs (runtime.cache_dir/programs: uploads, and programs fetched "
            "from the registry to launch) may take; an upload or fetch past it is refused "
            "RESOURCE_EXHAUSTED until programs are deleted (0 = no bound)"},
    {"programs.registry", PIE_CFG_BOOL, PIE_CONFIG_AT(lc_config, registry), .def = "true",
     .doc = "share programs through the controller's program registry: uploads are put there, "
            "launches of ids this replica lacks fetch them, deletes are cluster-wide"},
    {"instances.output_buffer", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, output_buffer_bytes),
     .def = "1MiB", .min = "1KiB", .max = "1GiB",
     .doc = "output kept per instance: while no client is attached, the oldest is dropped "
            "beyond it; while one is, the inferlet's writes wait beyond it"},
    {"instances.retention", PIE_CFG_DURATION, PIE_CONFIG_AT(lc_config, retention_ms), .def = "60s",
     .max = "168h", .doc = "how long exited instances stay listed and attachable"},
    {"instances.retention_max", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, retention_max),
     .def = "10000", .max = "10000000",
     .doc = "most exited instances kept (listed, attachable) at once; beyond it the earliest "
            "exits are dropped before their retention ends (~2 KiB each, plus kept output)"},
    LC_LIMIT_FIELDS("default", defaults, "256MiB", "1024", "1024", "16", "1MiB", "10m", "1h",
                    "default (launch leaves it 0):"),
    LC_LIMIT_FIELDS("max", maxima, "4GiB", "65536", "65536", "256", "4MiB", "24h", "168h",
                    "largest allowed:"),
    {"limits.replica_memory", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, replica_memory), .def = "0",
     .doc = "memory all instances of this replica may hold at once: linear memories, queued "
            "calls, inboxes, uploads in flight; launches beyond it and memory.grow beyond it "
            "fail (0 = 3/4 of the memory the process may use: its cgroup limit or the RAM)"},
    {"limits.tenant_memory_share", PIE_CFG_DOUBLE, PIE_CONFIG_AT(lc_config, tenant_memory_share),
     .def = "0.5", .min = "0", .max = "1",
     .doc = "with tenants, the part of limits.replica_memory one tenant's instances' linear "
            "memories may hold, so one tenant cannot spend the replica's memory for all "
            "(memory.grow and launches beyond it fail; 0 or 1 = no share of their own)"},
    {"tokenizer.path", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, tokenizer_path), .def = "",
     .doc = "':'-separated directories searched first for models' tokenizer.json (model dirs "
            "or their parents); optional: tokenizers are fetched from the controller"},
    {"tokenizer.fetch", PIE_CFG_BOOL, PIE_CONFIG_AT(lc_config, tokenizer_fetch), .def = "true",
     .doc = "fetch a tokenizer.json not found on tokenizer.path from the controller (checked "
            "against its SHA-256, cached under runtime.cache_dir/tokenizers)"},
    {"http.allow", PIE_CFG_STRING, PIE_CONFIG_AT(lc_config, http_allow), .def = "",
     .doc = "','-separated URL prefixes inferlets may fetch (empty = none)"},
    {"http.timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(lc_config, http_timeout_ms), .def = "10s",
     .min = "1ms", .max = "10m", .doc = "timeout of one outbound HTTP request of an inferlet"},
    {"http.max_bytes", PIE_CFG_SIZE, PIE_CONFIG_AT(lc_config, http_max_bytes), .def = "8MiB",
     .min = "1", .max = "1GiB", .doc = "largest HTTP response body an inferlet may receive"},
    {"http.max_running", PIE_CFG_UINT, PIE_CONFIG_AT(lc_config, http_max_running), .def = "16",
     .min = "1", .max = "1024",
     .doc = "inferlets' HTTP requests running at once in this replica (one tenant: at most half); "
            "their responses hold up to this many times http.max_bytes"},
};
static const pie_config_schema lc_schema = PIE_CONFIG_SCHEMA(lc_config, lc_fields);

/* Everything the process runs, in start order (stopped in reverse, see lc_stop). */
typedef struct lc_parts {
    pie_budget budget; /* limits.replica_memory, shared by the instances */
    svc *s;
    lc_session *session;
    lc_wasm_rt *rt;
    lc_program_store *programs;
    lc_store *store;
    lc_tokreg *tokreg;
    lc_host *host;
    lc_inst_mgr *insts;
    lc_api *api;
} lc_parts;

/* pie-tcc-helper beside this executable (the build's bin/, the image's /usr/local/bin) into
 * out; "" when there is none: tier 0 then runs a tcc child per module. */
static void find_tcc_helper(char *out, size_t cap) {
    char exe[PATH_MAX];
    out[0] = '\0';
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash == NULL) return;
    *slash = '\0';
    int w = snprintf(out, cap, "%s/pie-tcc-helper", exe);
    if (w < 0 || (size_t)w >= cap || access(out, X_OK) != 0) out[0] = '\0';
}

static pie_code make_dirs(const lc_config *cfg, char *native, size_t cap, pie_status *st) {
    if (mkdir(cfg->cache_dir, 0700) != 0 && errno != EEXIST)
        return pie_status_set(st, PIE_FAILED_PRECONDITION,
                              "runtime.cache_dir: cannot create %s: %s", cfg->cache_dir,
                              strerror(errno));
    snprintf(native, cap, "%s/native", cfg->cache_dir);
    return PIE_OK;
}

/* The health name of the public API: the readiness probe's. SERVING only while this replica
 * can serve (its Session is connected, knows a model, and every served model's tokenizer is
 * loaded); "" (liveness) stays SERVING. */
#define LC_HEALTH_NAME "pie.v1.Lifecycle"

/* The model gate of the Session: ready once every served model's tokenizer is loaded; a new
 * model list starts loading (fetching) the tokenizers it names. */
static bool gate_ready(void *ctx, const Pie__V1__ModelsChanged *mc) {
    return lc_tokreg_models_ready(ctx, mc);
}
static void gate_changed(void *ctx, const Pie__V1__ModelsChanged *mc) {
    lc_tokreg_want_models(ctx, mc);
}
static void tokenizer_loaded(void *ctx) { lc_session_update_ready(ctx); }

/* Tokenizers: the path, the cache under the runtime cache dir, the controller. */
static pie_code start_tokenizers(const lc_config *cfg, lc_parts *p, pie_status *st) {
    char cache[4200];
    snprintf(cache, sizeof cache, "%s/tokenizers", cfg->cache_dir);
    lc_tokreg_config tc = {.path = cfg->tokenizer_path ? cfg->tokenizer_path : "",
                           .cache_dir = cache,
                           .fetch = cfg->tokenizer_fetch ? lc_store_fetch_tokenizer : NULL,
                           .fetch_ctx = p->store,
                           .loaded = tokenizer_loaded,
                           .loaded_ctx = p->session};
    if ((p->tokreg = lc_tokreg_create(&tc, st)) == NULL) return st->code;
    lc_session_model_gate g = {.ctx = p->tokreg, .ready = gate_ready, .changed = gate_changed};
    lc_session_set_model_gate(p->session, &g);
    return PIE_OK;
}

static pie_code lc_start(const lc_config *cfg, lc_parts *p, pie_status *st) {
    char native[4096];
    if ((p->s = svc_create("lifecycle", &cfg->svc, st)) == NULL) return st->code;
    if (svc_load_tenants(p->s, cfg->tenants_dir, st) != PIE_OK) return st->code;
    p->budget.max = cfg->replica_memory ? cfg->replica_memory
                                        : pie_budget_process_memory() / 4 * 3;
    pie_log_info("lc.budget", "replica_memory=%llu", (unsigned long long)p->budget.max);
    lc_session_config sc = {.replica_id = cfg->replica_id ? cfg->replica_id : "",
                            .advertise = cfg->advertise ? cfg->advertise : "",
                            .ready_health = LC_HEALTH_NAME};
    if ((p->session = lc_session_create(&sc, svc_metrics(p->s), st)) == NULL) return st->code;
    if (make_dirs(cfg, native, sizeof native, st) != PIE_OK) return st->code;
    size_t n_fns;
    const lc_wasm_host_fn *fns = lc_host_fns(&n_fns);
    lc_wasm_rt_opts ro = {.cache_dir = native,
                          .host_fns = fns,
                          .n_host_fns = n_fns,
                          .tier1 = cfg->tier1,
                          .tier0_wasm2c = cfg->tier0_wasm2c,
                          .cc = cfg->tier1_cc && cfg->tier1_cc[0] ? cfg->tier1_cc : NULL};
    ro.module_limits = cfg->module_limits;
    ro.compile_timeout_ms = (uint64_t)cfg->compile_timeout_ms;
    ro.tier1_timeout_ms = (uint64_t)cfg->tier1_timeout_ms;
    ro.max_compiles = cfg->max_compiles;
    ro.cache_max_bytes = cfg->cache_size;
    ro.compile_queue = cfg->compile_queue ? (int32_t)cfg->compile_queue : -1; /* 0: none wait */
    char helper[PATH_MAX];
    find_tcc_helper(helper, sizeof helper);
    ro.tcc_helper = helper;
    pie_log_info("lc.tcc_helper", "path=\"%s\"",
                 helper[0] ? helper : "(none: a tcc child per module)");
    if (lc_wasm_rt_create(&ro, &p->rt, st) != PIE_OK) return st->code;
    p->programs =
        lc_program_store_create(cfg->cache_dir, native, p->rt, cfg->max_program_bytes, st);
    if (p->programs == NULL) return st->code;
    lc_program_store_set_max_loaded(p->programs, cfg->max_loaded);
    lc_program_store_set_max_stored(p->programs, cfg->store_size);
    if (lc_program_store_metrics(p->programs, svc_metrics(p->s), st) != PIE_OK) return st->code;
    lc_store_config stc = {.programs = cfg->registry,
                           .max_program_bytes = cfg->max_program_bytes,
                           .max_tokenizer_bytes = LC_TOKENIZER_MAX_BYTES,
                           .call_timeout_ms = LC_STORE_CALL_MS};
    p->store = lc_store_create(&stc, p->session, p->programs, svc_metrics(p->s), st);
    if (p->store == NULL || start_tokenizers(cfg, p, st) != PIE_OK) return st->code;
    lc_host_config hc = {.tokreg = p->tokreg,
                         .tokenizer_path = cfg->tokenizer_path ? cfg->tokenizer_path : "",
                         .http_allow = cfg->http_allow ? cfg->http_allow : "",
                         .http_timeout_ms = (uint64_t)cfg->http_timeout_ms,
                         .http_max_bytes = cfg->http_max_bytes,
                         .http_max_running = cfg->http_max_running,
                         .budget = &p->budget};
    if ((p->host = lc_host_create(&hc, p->session, svc_metrics(p->s), st)) == NULL) return st->code;
    lc_inst_config ic = {.defaults = cfg->defaults,
                         .maxima = cfg->maxima,
                         .output_buffer_bytes = cfg->output_buffer_bytes,
                         .retention_ms = cfg->retention_ms,
                         .retention_max = cfg->retention_max,
                         .thread_stack_bytes = cfg->stack_bytes,
                         .budget = &p->budget,
                         .tenant_memory_share = cfg->tenant_memory_share,
                         .metrics = svc_metrics(p->s)};
    if ((p->insts = lc_inst_mgr_create(&ic, p->programs, p->host, p->session, st)) == NULL)
        return st->code;
    if ((p->api = lc_api_create(p->programs, p->insts, p->session, p->store, st)) == NULL)
        return st->code;
    lc_api_set_limits(p->api, cfg->max_uploads, cfg->max_tenant_uploads, &p->budget);
    size_t n_methods;
    const rpc_method *methods = lc_api_methods(p->api, &n_methods);
    if (svc_serve(p->s, methods, n_methods, st) != PIE_OK) return st->code;
    svc_add_health(p->s, LC_HEALTH_NAME); /* ready once the Session knows a model */
    if (lc_session_start(p->session, p->s, &cfg->dial, st) != PIE_OK) return st->code;
    svc_set_serving(p->s, true);
    return PIE_OK;
}

/* At least this long for calls in flight after the instances' drain, so that the exit status
 * of an instance ended at the grace reaches its client before the server cancels calls. */
#define LC_CALLS_GRACE_MIN_MS 1000
/* The longest the Session's sender may take to hand the last InstanceEnds to the stream. */
#define LC_SETTLE_MS 500

/* The drain of SIGTERM (docs/operators.md, "Shutdown"): readiness fails, launches are refused,
 * running instances get up to server.shutdown_grace to end by themselves (their clients stay
 * attached; Attach and the rest of the API still answer); the rest end UNAVAILABLE, and calls
 * in flight get what is left of the grace (at least LC_CALLS_GRACE_MIN_MS). */
static void lc_drain(const lc_config *cfg, lc_parts *p) {
    int64_t grace_ms = cfg->svc.shutdown_grace_ms, t0 = rpc_now_ns();
    lc_wasm_rt_stop_compiles(p->rt); /* uploads compiling end UNAVAILABLE now, not at the grace */
    lc_inst_mgr_refuse_launches(p->insts); /* before readiness says so */
    svc_set_serving(p->s, false);
    pie_log_info("lc.draining", "grace_ms=%lld", (long long)grace_ms);
    size_t left = lc_inst_mgr_drain(p->insts, grace_ms);
    pie_log_info("lc.drained", "instances_cut=%zu", left);
    lc_inst_mgr_stop(p->insts);
    lc_session_settle(p->session, LC_SETTLE_MS); /* the InstanceEnds go out before the server
                                                    stops, which ends the Session's stream */
    int64_t rest_ms = grace_ms - (rpc_now_ns() - t0) / 1000000;
    svc_drain_within(p->s, rest_ms > LC_CALLS_GRACE_MIN_MS ? rest_ms : LC_CALLS_GRACE_MIN_MS);
}

static void lc_stop(lc_parts *p) {
    if (p->rt) lc_wasm_rt_stop_compiles(p->rt); /* no job below waits for a compiler */
    lc_inst_mgr_stop(p->insts); /* instances end, attached clients get their exit status */
    if (p->session) lc_session_settle(p->session, LC_SETTLE_MS); /* their InstanceEnds */
    svc_drain(p->s);            /* server next (no-op after lc_drain): no callback after it */
    lc_api_destroy(p->api);     /* waits for uploads being validated */
    lc_inst_mgr_destroy(p->insts);
    lc_store_stop(p->store);        /* no more calls on the Session's channel */
    lc_tokreg_stop(p->tokreg);      /* no more fetches */
    lc_session_destroy(p->session); /* last InstanceEnds, stops the Session thread (the host's
                                       results sink), the controller forgets this replica */
    lc_host_destroy(p->host);
    lc_tokreg_destroy(p->tokreg);
    lc_store_destroy(p->store); /* after the Session: its thread calls the store's hooks */
    lc_program_store_destroy(p->programs);
    lc_wasm_rt_destroy(p->rt);
    svc_stop(p->s); /* last: threads stopped above may update its metrics */
}

int main(int argc, char **argv) {
    svc_block_signals();
    svc_args args;
    int rc = svc_parse_args(argc, argv, "pie-lifecycle", &args);
    if (rc) return rc == 1 ? 0 : 2;
    lc_config cfg;
    rc = svc_load_config("pie-lifecycle", &args, &lc_schema, &cfg);
    if (rc) return rc == 1 ? 0 : 2;

    int status = 1;
    pie_status st;
    lc_parts p = {0};
    if (lc_start(&cfg, &p, &st) != PIE_OK) {
        fprintf(stderr, "pie-lifecycle: %s\n", st.msg);
    } else {
        int sig = svc_wait_for_signal();
        pie_log_info("lc.signal", "signal=%d", sig);
        lc_drain(&cfg, &p);
        status = 0;
    }
    lc_stop(&p);
    pie_config_free(&lc_schema, &cfg);
    return status;
}
