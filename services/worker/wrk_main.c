/* wrk_main.c — pie-worker: one inference worker (one GPU, the CPU backend, or a
 * tensor-parallel group of tp.size ranks on the cpu backend).
 *
 * Owns: the worker's configuration schema, loading what it serves (the engine for the cpu
 * backend, only a description for null) and the start/stop order: serve Info and health
 * (NOT_SERVING) at once, load, then link to the controller and report SERVING. A failed load
 * leaves the process up, NOT_SERVING, with Info state FAILED and the error (worker.proto), and
 * it exits 1 on SIGTERM. A device fault of the cuda backend (wrk_backend_fault) stops the
 * worker as SIGTERM does, and it exits 1 saying why. Registration, batches and Info are in
 * wrk_node.c / wrk_exec.c.
 *
 * With tp.size N > 1 this process is the group's launcher (tp/wrk_tp.h): it forks N ranks and
 * supervises them. Rank 0 is the worker above (it alone serves gRPC and links to the
 * controller); ranks 1..N-1 serve nothing: they load their shard, then run the steps rank 0
 * broadcasts until rank 0 stops them (exit 0) or the group fails (exit 1). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eng.h"
#include "pie_log.h"
#include "svc.h"
#include "wrk_backend.h"
#include "wrk_coll.h"
#include "wrk_desc.h"
#include "wrk_memrt.h"
#include "wrk_nulldev.h"
#include "wrk_mempol.h"
#include "wrk_offload.h"
#include "wrk_offrt.h"
#include "wrk_node.h"
#include "wrk_numa.h"
#include "wrk_tp.h"
#include "wrk_tp_cuda.h"
#ifdef PIE_WITH_NCCL
#include "wrk_nccl.h"
#endif

enum { WRK_BACKEND_CPU = 0, WRK_BACKEND_CUDA = 1, WRK_BACKEND_NULL = 2 };
static const char *const wrk_backends[] = {"cpu", "cuda", "null", NULL};
/* engine.kv_dtype, indexed by eng_kv_dtype */
static const char *const wrk_kv_dtypes[] = {"f32", "bf16", NULL};

typedef struct wrk_config {
    svc_config svc;
    svc_dial_config dial;      /* controller.* */
    char *group_id;            /* worker.group_id */
    char *advertise;           /* worker.advertise */
    int backend;               /* backend: WRK_BACKEND_* */
    char *model_path;          /* model.path */
    char *model_name;          /* model.name */
    char *model_description;   /* model.description */
    uint32_t engine_threads;   /* engine.threads */
    int kv_dtype;              /* engine.kv_dtype: eng_kv_dtype */
    uint32_t kv_page_size;     /* pool.kv_page_size */
    uint32_t kv_pages;         /* pool.kv_pages */
    uint32_t embed_slots;      /* pool.embed_slots */
    uint32_t max_batch_tokens; /* batch.max_tokens */
    uint32_t max_batch_items;  /* batch.max_items */
    uint32_t credits;          /* batch.credits */
    wrk_null_cost null_cost;   /* null.*: the emulated device */
    uint32_t tp_size;          /* tp.size */
    int32_t tp_rank;           /* tp.rank */
    char *tp_leader;           /* tp.leader */
    int64_t tp_timeout_ms;     /* tp.timeout */
    int64_t tp_form_timeout_ms; /* tp.form_timeout */
    uint64_t tp_chunk_bytes;   /* tp.chunk */
    uint32_t tp_port;          /* tp.port */
    int mem_policy;            /* memory.policy: wrk_mem_policy */
    uint64_t mem_device_kv;    /* memory.device_kv */
    uint64_t mem_host_pool;    /* memory.host_pool */
    uint32_t mem_device_layers; /* memory.device_layers */
    double mem_link_gbps;      /* memory.emulate_link_gbps */
    int32_t mem_host_numa_node; /* memory.host_numa_node (-1: the kernel's placement) */
    bool mem_offload_defer;     /* memory.offload_defer */
    double mem_offload_host_attn_us; /* memory.offload_host_attn_us (0: profiled) */
} wrk_config;

static const pie_config_field wrk_fields[] = {
    SVC_CONFIG_FIELDS(wrk_config, "0.0.0.0:50053", "0.0.0.0:9093"),
    SVC_DIAL_FIELDS(wrk_config, dial),
    {"worker.group_id", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, group_id), .def = "",
     .doc = "name of this worker group in status and logs (empty = <hostname>:<grpc port>)"},
    {"worker.advertise", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, advertise), .def = "",
     .doc = "host:port at which others reach this worker's gRPC service (empty = unknown)"},
    {"backend", PIE_CFG_ENUM, PIE_CONFIG_AT(wrk_config, backend), .def = "cpu",
     .choices = wrk_backends,
     .doc = "compute backend: cpu, cuda, or null (benchmarks only: instant well-formed results, "
            "no model)"},
    {"model.path", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, model_path), .def = "",
     .doc = "Hugging Face model directory (config.json, *.safetensors, tokenizer.json); "
            "required unless backend is null"},
    {"model.name", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, model_name), .def = "",
     .doc = "name under which the model is served (empty = the basename of model.path)"},
    {"model.description", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, model_description), .def = "",
     .doc = "free text shown by ListModels"},
    {"engine.threads", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, engine_threads), .def = "0",
     .max = "1024",
     .doc = "CPU threads of the cpu backend's kernels, and of the cuda backend's "
            "host attention under memory.policy offload (0 = online cores)"},
    {"engine.kv_dtype", PIE_CFG_ENUM, PIE_CONFIG_AT(wrk_config, kv_dtype), .def = "f32",
     .choices = wrk_kv_dtypes,
     .doc = "what the cpu backend's KV pool stores: f32, or bf16 (half the memory per token and "
            "half the bytes decode attention reads; each K/V value rounded to nearest, logits "
            "within 5e-3 relative of the exact model's); backend cuda: f32 only"},
    {"pool.kv_page_size", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, kv_page_size), .def = "16",
     .min = "1", .max = "256", .doc = "tokens per KV page"},
    {"pool.kv_pages", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, kv_pages), .def = "1024", .min = "1",
     .max = "16777216", .doc = "KV pages in the worker's pool"},
    {"pool.embed_slots", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, embed_slots), .def = "4096",
     .min = "1", .max = "16777216", .doc = "embedding slots in the worker's pool"},
    {"batch.max_tokens", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, max_batch_tokens), .def = "4096",
     .min = "1", .max = "1048576",
     .doc = "most input tokens in one forward batch (also the model's max_forward_tokens)"},
    {"batch.max_items", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, max_batch_items), .def = "256",
     .min = "1", .max = "65536", .doc = "most items in one batch of any kind"},
    {"batch.credits", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, credits), .def = "2", .min = "1",
     .max = "64",
     .doc = "scheduling steps the controller may have outstanding on this worker: 2 lets the "
            "work-conserving controller queue the next step behind the running one, so the "
            "worker never idles for a controller round trip; 1 = dispatch only to an idle "
            "worker"},
    {"null.batch_us", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, null_cost.batch_us), .def = "0",
     .max = "10000000",
     .doc = "null backend only: emulated device time of a forward batch, fixed part in "
            "microseconds (0 = instant)"},
    {"null.token_us", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, null_cost.token_us), .def = "0",
     .max = "1000000",
     .doc = "null backend only: emulated device time per input token of a forward batch, in "
            "microseconds"},
    {"null.layer_us", PIE_CFG_DOUBLE, PIE_CONFIG_AT(wrk_config, null_cost.layer_us), .def = "0",
     .min = "0", .max = "1000000",
     .doc = "null backend only: emulated compute of one layer of a forward batch, fixed part in "
            "microseconds (the swap policy's pipeline overlaps layer copies with it)"},
    {"null.layer_token_us", PIE_CFG_DOUBLE, PIE_CONFIG_AT(wrk_config, null_cost.layer_token_us),
     .def = "0", .min = "0", .max = "1000000",
     .doc = "null backend only: emulated compute of one layer per input token, microseconds"},
    {"null.layer_kv_us", PIE_CFG_DOUBLE, PIE_CONFIG_AT(wrk_config, null_cost.layer_kv_us),
     .def = "0", .min = "0", .max = "1000000",
     .doc = "null backend only: emulated attention of one layer per context token attended, "
            "microseconds"},
    {"null.host_attn_kv_us", PIE_CFG_DOUBLE, PIE_CONFIG_AT(wrk_config, null_cost.host_attn_kv_us),
     .def = "0", .min = "0", .max = "1000000",
     .doc = "null backend only: emulated host (CPU) attention of one layer per context token, "
            "microseconds (the offload policy's cost; its pages move over "
            "memory.emulate_link_gbps)"},
    {"tp.size", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, tp_size), .def = "1", .min = "1",
     .max = "64",
     .doc = "tensor-parallel ranks of this worker group (cpu backend; cuda where NCCL was "
            "built: one GPU per rank): this process forks them (or, with tp.rank, is one of "
            "them) and the group registers as one worker; 1 = no tensor parallelism"},
    {"tp.rank", PIE_CFG_INT, PIE_CONFIG_AT(wrk_config, tp_rank), .def = "-1", .min = "-1",
     .max = "63",
     .doc = "rank of this process in a group started rank by rank, e.g. one pod each (-1 = not "
            "one: with tp.size > 1 this process starts every rank itself); rank 0 serves "
            "Worker/TpJoin, the others join it at tp.leader; LWS_WORKER_INDEX fills it"},
    {"tp.leader", PIE_CFG_STRING, PIE_CONFIG_AT(wrk_config, tp_leader), .def = "",
     .doc = "rank 0's gRPC host:port for ranks started on their own (empty = "
            "LWS_LEADER_ADDRESS, if set; without a port, this worker's server.listen port)"},
    {"tp.timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(wrk_config, tp_timeout_ms), .def = "30s",
     .min = "100ms", .max = "1h",
     .doc = "longest wait for another rank of the group within a step (and for all ranks to "
            "join, unless tp.form_timeout says otherwise); a rank that dies is noticed at once"},
    {"tp.form_timeout", PIE_CFG_DURATION, PIE_CONFIG_AT(wrk_config, tp_form_timeout_ms),
     .def = "0s", .max = "24h",
     .doc = "longest wait for the group to form: rank 0 for every rank to join, the others for "
            "rank 0 to answer (0 = tp.timeout); ranks started one by one in pods that start "
            "far apart need more than a step's tp.timeout"},
    {"tp.chunk", PIE_CFG_SIZE, PIE_CONFIG_AT(wrk_config, tp_chunk_bytes), .def = "1MiB",
     .min = "4KiB", .max = "256MiB",
     .doc = "bytes per rank per step of the group's shared-memory collective (/dev/shm needs "
            "2 * (tp.size + 1) * tp.chunk)"},
    {"tp.port", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, tp_port), .def = "0", .max = "65535",
     .doc = "rank 0 of ranks started one by one: TCP port of the group's collective, on all "
            "interfaces (0 = any free port; fix it where a NetworkPolicy must allow it)"},
    {"memory.policy", PIE_CFG_ENUM, PIE_CONFIG_AT(wrk_config, mem_policy), .def = "gpu",
     .choices = wrk_mem_policy_names,
     .doc = "KV memory policy: gpu (device memory only), swap (layer-wise swapping to the host "
            "pool with adaptive expansion), offload (CPU attention offload: decodes whose KV is "
            "in the host pool attend on host cores), auto (swap or offload, chosen at load from "
            "costs profiled then); the last three on the cpu backend (tensor-parallel groups "
            "too: every memory.* key is per rank, rank 0 decides for the group) and the null "
            "backend's emulated device; on cuda all of them on one GPU (the host pool pinned)"},
    {"memory.device_kv", PIE_CFG_SIZE, PIE_CONFIG_AT(wrk_config, mem_device_kv), .def = "0",
     .doc = "swap, offload: device memory for KV (0 = what pool.kv_pages of every layer take); "
            "swap's effective KV pages are device_kv / (layers on the device x one page of one "
            "layer), offload's device_kv / (one page of every layer) plus the host pool's"},
    {"memory.host_pool", PIE_CFG_SIZE, PIE_CONFIG_AT(wrk_config, mem_host_pool), .def = "0",
     .doc = "swap, offload: host memory for KV; bounds swap's expansion (a pool that cannot hold "
            "2 layer caches fails the load, saying how much is needed) and adds host_pool / (one "
            "page of every layer) pages under offload"},
    {"memory.device_layers", PIE_CFG_UINT, PIE_CONFIG_AT(wrk_config, mem_device_layers), .def = "0",
     .max = "65536",
     .doc = "swap: layers whose KV is on the device at once, fixed (2..layers); 0 = adaptive "
            "expansion, starting with every layer on the device"},
    {"memory.host_numa_node", PIE_CFG_INT, PIE_CONFIG_AT(wrk_config, mem_host_numa_node),
     .def = "-1", .min = "-1", .max = "63",
     .doc = "swap, offload: the NUMA node the host pool's memory comes from, bound "
            "before it is touched, never another (-1 = the kernel's default placement: first "
            "touch); a node the machine does not have exits 2 at start; per rank in a "
            "tensor-parallel group"},
    {"memory.emulate_link_gbps", PIE_CFG_DOUBLE, PIE_CONFIG_AT(wrk_config, mem_link_gbps),
     .def = "0", .min = "0", .max = "100000",
     .doc = "swap: emulated device-host link in gigabits/s each way (cpu backend: 0 = memory "
            "speed; null backend: the link of the emulated device, 0 = copies take no time, for "
            "offload's page moves too); auto weighs it against a layer's compute"},
    {"memory.offload_defer", PIE_CFG_BOOL, PIE_CONFIG_AT(wrk_config, mem_offload_defer),
     .def = "false",
     .doc = "offload (and auto when it chooses offload), cpu backend, tp.size 1: the load-aware "
            "scheduler may defer a host decode whose attention would not hide behind the "
            "step's device work to a later step (Neo's rule; at most 8 steps in a row), once "
            "the controller agrees (it offers the call again); false = every item of a batch "
            "runs"},
    {"memory.offload_host_attn_us", PIE_CFG_DOUBLE,
     PIE_CONFIG_AT(wrk_config, mem_offload_host_attn_us), .def = "0", .min = "0", .max = "1000000",
     .doc = "offload, auto (cpu backend): host attention per KV token for all layers, in "
            "microseconds, that the load-aware scheduler (and auto's choice) uses instead of "
            "the cost profiled at load (0 = profiled; the wrk.mem.offload log line shows what "
            "is used); pins the decisions where a profile taken under load would be off"},
};
static const pie_config_schema wrk_schema = PIE_CONFIG_SCHEMA(wrk_config, wrk_fields);

/* What a load produced; everything the process serves from. */
typedef struct wrk_loaded {
    wrk_desc desc;
    eng *engine; /* cpu backend; NULL otherwise */
    wrk_backend backend;
    char device[128];
    char rank_device[128]; /* a group's rank: its own share ("cpu: 1 threads") */
    uint64_t pool_bytes;
    wrk_mem_plan plan; /* the memory policy's sizing */
    wrk_mem_policy auto_choice; /* memory.policy auto: what it chose (else WRK_MEM_GPU) */
    char auto_why[192];
    wrk_nulldev *nulldev; /* null backend: its emulated device */
} wrk_loaded;

/* Kernel threads of one rank: engine.threads, or the online cores shared by the ranks. */
static long rank_threads(const wrk_config *cfg) {
    if (cfg->engine_threads) return (long)cfg->engine_threads;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    long per = (cores > 0 ? cores : 1) / (long)(cfg->tp_size ? cfg->tp_size : 1);
    return per > 0 ? per : 1;
}

/* KV heads one rank of a group of tp_size stores (eng_shard.h: an even split, or one head
 * replicated when the ranks outnumber the heads; a shape that splits neither way is refused by
 * eng_open). */
static uint32_t rank_kv_heads(uint32_t n_kv_heads, uint32_t tp_size) {
    if (tp_size <= 1) return n_kv_heads;
    return n_kv_heads > tp_size ? n_kv_heads / tp_size : 1;
}

/* The memory policy's sizing for the model in l->desc (wrk_mempol.h). In a tensor-parallel
 * group every key is per rank: memory.device_kv is one rank's device, memory.host_pool its own
 * host pool partition, and a page of a layer is that rank's KV heads' share of it; every rank
 * computes the same plan, so page ids and capacities agree across the group. */
static pie_code plan_memory(const wrk_config *cfg, wrk_mem_policy policy, wrk_loaded *l,
                            pie_status *st) {
    wrk_mem_config mc = {.policy = policy,
                         .device_kv = cfg->mem_device_kv,
                         .host_pool = cfg->mem_host_pool,
                         .device_layers = cfg->mem_device_layers,
                         .link_gbps = cfg->mem_link_gbps};
    uint32_t ps = cfg->kv_page_size ? cfg->kv_page_size : 16;
    uint32_t by_tokens = (1u << 30) / ps; /* the engine's limit on pages x page size */
    wrk_mem_shape sh = {
        .n_layers = l->desc.num_layers,
        /* the cuda backend's KV pool is bf16 whatever engine.kv_dtype says */
        .page_layer_bytes =
            (uint64_t)2 * ps * rank_kv_heads(l->desc.num_kv_heads, cfg->tp_size) *
            l->desc.head_dim *
            (cfg->kv_dtype == ENG_KV_BF16 || cfg->backend == WRK_BACKEND_CUDA ? 2 : 4),
        .pool_pages = cfg->kv_pages,
        .max_pages = by_tokens < 16777216u ? by_tokens : 16777216u,
        .page_size = ps,
    };
    return wrk_mem_plan_make(&mc, &sh, &l->plan, st);
}

/* memory.policy auto: the device was opened under offload (the cpu engine's open profiled the
 * costs; the null backend's emulated device computes its profile), os its costs; chooses
 * (mem/wrk_offload.h) and, for swap, re-plans l->plan. In a group (g) rank 0 chooses from its
 * own profile and the others take its choice: the ranks' timings differ, and ranks under
 * different policies would not meet in the same collectives. */
static pie_code choose_auto(const wrk_config *cfg, wrk_tp_group *g, const wrk_tp_rank *me,
                            const wrk_off_costs *os, wrk_loaded *l, pie_status *st) {
    const wrk_mem_plan *op = &l->plan;
    uint32_t ps = cfg->kv_page_size ? cfg->kv_page_size : 16;
    /* the link: emulated, or memory speed (what the profile's transfer cost says) */
    double tok_bytes = (double)op->page_layer_bytes / ps * op->n_layers;
    double link = cfg->mem_link_gbps > 0 ? cfg->mem_link_gbps * 1e9 / 8
                  : os->xfer_tok > 0    ? tok_bytes / os->xfer_tok
                                        : 0;
    double layer_bytes = (double)op->kv_pages_gpu * op->page_layer_bytes;
    uint32_t batch = cfg->max_batch_tokens ? cfg->max_batch_tokens : 4096;
    wrk_mem_auto_in in = {
        .costs = *os,
        .n_layers = op->n_layers,
        .layer_swap_s = link > 0 ? layer_bytes / link : 0,
        .batch_tokens = batch,
        /* a typical decode: the device's pages shared by 16 sequences */
        .decode_ctx = op->kv_pages_gpu * ps / 16 ? op->kv_pages_gpu * ps / 16 : ps,
    };
    wrk_mem_auto_out out;
    wrk_mem_auto_choose(&in, &out);
    if (g) {
        uint32_t chosen = (uint32_t)out.policy;
        pie_code rc = wrk_coll_bcast(wrk_tp_group_coll(g), 0, &chosen, sizeof chosen, st);
        if (rc != PIE_OK) return rc;
        if (me->rank != 0) {
            out.policy = (wrk_mem_policy)chosen;
            snprintf(out.why, sizeof out.why, "rank 0 chose it");
        }
    }
    l->auto_choice = out.policy;
    snprintf(l->auto_why, sizeof l->auto_why, "%s", out.why);
    if (out.policy == WRK_MEM_SWAP) return plan_memory(cfg, WRK_MEM_SWAP, l, st);
    return PIE_OK;
}

/* choose_auto from the costs the engine profiled when it opened under offload (l->backend). */
static pie_code choose_auto_profiled(const wrk_config *cfg, wrk_tp_group *g, const wrk_tp_rank *me,
                                     wrk_loaded *l, pie_status *st) {
    eng_offload_stats os;
    l->backend.offload_get_stats(l->backend.ctx, &os);
    wrk_off_costs oc = {.lin_tok = os.lin_tok,
                        .lin_fixed = os.lin_fixed,
                        .dattn_kv = os.dattn_kv,
                        .hattn_kv = os.hattn_kv,
                        .xfer_tok = os.xfer_tok};
    return choose_auto(cfg, g, me, &oc, l, st);
}

/* g: the group's collective when this is a rank of a tensor-parallel group, else NULL. */
static pie_code load_cpu(const wrk_config *cfg, wrk_tp_group *g, const wrk_tp_rank *me,
                         wrk_loaded *l, pie_status *st) {
    pie_code rc = wrk_desc_load(&l->desc, cfg->model_path, st);
    wrk_mem_policy policy = (wrk_mem_policy)cfg->mem_policy;
    /* auto: open under offload first (its open profiles the costs), then choose */
    if (rc == PIE_OK) rc = plan_memory(cfg, policy == WRK_MEM_AUTO ? WRK_MEM_OFFLOAD : policy, l, st);
    if (rc != PIE_OK) return rc;
    const wrk_mem_plan *mp = &l->plan;
again:;
    bool swap = mp->policy == WRK_MEM_SWAP, offload = mp->policy == WRK_MEM_OFFLOAD;
    long threads = rank_threads(cfg);
    eng_opts eo = {
        .model_dir = cfg->model_path,
        .backend = ENG_BACKEND_CPU,
        .kv_page_size = cfg->kv_page_size,
        .kv_pages = mp->kv_pages_max, /* page ids: the most expanded point under swap */
        .embed_slots = cfg->embed_slots,
        .max_batch_tokens = cfg->max_batch_tokens,
        .n_threads = (int)threads,
        .kv_dtype = (eng_kv_dtype)cfg->kv_dtype,
        .tp_rank = g ? me->rank : 0,
        .tp_size = g ? me->size : 1,
        .coll = g ? wrk_tp_group_coll(g) : NULL,
        .swap_slots = swap ? mp->start_slots : 0,
        .swap_min_slots = swap ? mp->min_slots : 0,
        .swap_host_bytes = swap ? mp->host_bytes : 0,
        .swap_link_bytes_per_s = swap ? mp->link_bytes_per_s : 0,
        .offload_device_pages = offload ? mp->kv_pages_gpu : 0,
        .offload_host_threads = offload ? (int)threads : 0,
        .offload_host_attn_s = offload ? cfg->mem_offload_host_attn_us * 1e-6 : 0,
        .host_numa_bind = cfg->mem_host_numa_node >= 0,
        .host_numa_node = cfg->mem_host_numa_node,
    };
    rc = eng_open(&eo, &l->engine, st);
    if (rc != PIE_OK) return rc;
    wrk_backend_engine(&l->backend, l->engine);
    if (policy == WRK_MEM_AUTO && l->auto_choice == WRK_MEM_GPU) {
        rc = choose_auto_profiled(cfg, g, me, l, st);
        if (rc != PIE_OK) return rc;
        if (l->plan.policy != WRK_MEM_OFFLOAD) { /* swap: reopen under its plan */
            eng_close(l->engine);
            l->engine = NULL;
            goto again;
        }
    }
    const eng_info *ei = eng_get_info(l->engine);
    if (mp->policy != WRK_MEM_GPU && ei->kv_page_layer_bytes != mp->page_layer_bytes)
        return pie_status_set(st, PIE_INTERNAL,
                              "memory.policy %s: planned %llu bytes a page of a layer, the engine "
                              "stores %zu",
                              wrk_mem_policy_names[mp->policy],
                              (unsigned long long)mp->page_layer_bytes, ei->kv_page_layer_bytes);
    wrk_desc_set_engine(&l->desc, ei);
    if (g)
        snprintf(l->device, sizeof l->device,
                 "cpu: tensor-parallel group of %u ranks, %ld threads each", me->size, threads);
    else
        snprintf(l->device, sizeof l->device, "cpu: %ld threads", threads);
    snprintf(l->rank_device, sizeof l->rank_device, "cpu: %ld threads", threads);
    l->pool_bytes = (uint64_t)ei->kv_pool_bytes + ei->embed_pool_bytes;
    return PIE_OK;
}

/* g and me: as load_cpu; a group's ranks join its NCCL communicator first (each rank one
 * process, one GPU: device 0 of its CUDA_VISIBLE_DEVICES). */
static pie_code load_cuda(const wrk_config *cfg, wrk_tp_group *g, const wrk_tp_rank *me,
                          wrk_loaded *l, pie_status *st) {
    pie_code rc = wrk_desc_load(&l->desc, cfg->model_path, st);
    if (rc == PIE_OK && g) rc = wrk_tp_group_open_nccl(g, me, st);
    /* auto (one GPU: main refuses it in a group): open under offload first (its open profiles
     * the costs), then choose, as on the cpu backend */
    wrk_mem_policy policy = (wrk_mem_policy)cfg->mem_policy;
    if (rc == PIE_OK)
        rc = plan_memory(cfg, policy == WRK_MEM_AUTO ? WRK_MEM_OFFLOAD : policy, l, st);
    if (rc != PIE_OK) return rc;
    const wrk_mem_plan *mp = &l->plan;
again:;
    bool swap = mp->policy == WRK_MEM_SWAP, offload = mp->policy == WRK_MEM_OFFLOAD;
    eng_opts eo = {
        .model_dir = cfg->model_path,
        .backend = ENG_BACKEND_CUDA,
        .kv_page_size = cfg->kv_page_size,
        .kv_pages = mp->kv_pages_max,
        .embed_slots = cfg->embed_slots,
        .max_batch_tokens = cfg->max_batch_tokens,
        .tp_rank = g ? me->rank : 0,
        .tp_size = g ? me->size : 1,
        .nccl = g ? wrk_tp_group_nccl(g) : NULL,
        .swap_slots = swap ? mp->start_slots : 0,
        .swap_min_slots = swap ? mp->min_slots : 0,
        .swap_host_bytes = swap ? mp->host_bytes : 0,
        .swap_link_bytes_per_s = swap ? mp->link_bytes_per_s : 0,
        .offload_device_pages = offload ? mp->kv_pages_gpu : 0,
        .offload_host_threads = offload ? (int)rank_threads(cfg) : 0,
        .offload_host_attn_s = offload ? cfg->mem_offload_host_attn_us * 1e-6 : 0,
        .host_numa_bind = cfg->mem_host_numa_node >= 0,
        .host_numa_node = cfg->mem_host_numa_node,
    };
    const eng_info *ei = NULL;
    rc = wrk_backend_open_cuda(&l->backend, &eo, &ei, l->device, sizeof l->device, st);
    if (rc != PIE_OK) return rc;
    if (policy == WRK_MEM_AUTO && l->auto_choice == WRK_MEM_GPU) {
        rc = choose_auto_profiled(cfg, NULL, NULL, l, st);
        if (rc != PIE_OK) return rc;
        if (l->plan.policy != WRK_MEM_OFFLOAD) { /* swap: reopen under its plan */
            wrk_backend_release(&l->backend);
            goto again;
        }
    }
    snprintf(l->rank_device, sizeof l->rank_device, "%.120s", l->device);
    if (g)
        snprintf(l->device, sizeof l->device, "cuda: tensor-parallel group of %u ranks on %.70s",
                 me->size, l->rank_device + strlen("cuda: "));
    wrk_desc_set_engine(&l->desc, ei);
    l->pool_bytes = (uint64_t)ei->kv_pool_bytes + ei->embed_pool_bytes;
    return PIE_OK;
}

/* The null backend over its emulated device (mem/wrk_nulldev.h), sized by the memory plan:
 * the swap policy's layers move over memory.emulate_link_gbps while the layers compute; under
 * offload its pages move over that link and its decodes may attend on the emulated host; auto
 * chooses between them from the emulated device's profile, as on the cpu backend. */
static pie_code load_null(const wrk_config *cfg, wrk_loaded *l, pie_status *st) {
    wrk_mem_policy policy = (wrk_mem_policy)cfg->mem_policy;
    pie_code rc = plan_memory(cfg, policy == WRK_MEM_AUTO ? WRK_MEM_OFFLOAD : policy, l, st);
    if (rc != PIE_OK) return rc;
    const wrk_null_cost *c = &cfg->null_cost;
    const wrk_mem_plan *mp = &l->plan;
again:;
    bool offload = mp->policy == WRK_MEM_OFFLOAD;
    wrk_nulldev_config dc = {
        .n_layers = l->desc.num_layers,
        .page_size = cfg->kv_page_size,
        .batch_us = c->batch_us,
        .token_us = c->token_us,
        .layer_us = c->layer_us,
        .layer_token_us = c->layer_token_us,
        .layer_kv_us = c->layer_kv_us,
        .host_attn_kv_us = c->host_attn_kv_us,
        .link_bytes_per_s = mp->policy == WRK_MEM_SWAP ? mp->link_bytes_per_s
                            : offload                  ? cfg->mem_link_gbps * 1e9 / 8
                                                       : 0,
        .device_kv = mp->device_kv,
        .slots = mp->start_slots,
        .min_slots = mp->min_slots,
        .offload_device_pages = offload ? mp->kv_pages_gpu : 0,
        .kv_pages = mp->kv_pages_max,
        .page_layer_bytes = mp->page_layer_bytes,
        .max_items = cfg->max_batch_tokens,
    };
    rc = wrk_nulldev_create(&dc, &l->nulldev, st);
    if (rc != PIE_OK) return rc;
    if (policy == WRK_MEM_AUTO && l->auto_choice == WRK_MEM_GPU) {
        wrk_off_costs oc = wrk_nulldev_offload_costs(l->nulldev);
        rc = choose_auto(cfg, NULL, NULL, &oc, l, st);
        if (rc != PIE_OK) return rc;
        if (l->plan.policy != WRK_MEM_OFFLOAD) { /* swap: a device under its plan */
            wrk_nulldev_destroy(l->nulldev);
            l->nulldev = NULL;
            goto again;
        }
    }
    wrk_backend_null(&l->backend, l->nulldev);
    if (c->batch_us || c->token_us || c->layer_us > 0 || c->layer_token_us > 0 ||
        c->layer_kv_us > 0) {
        snprintf(l->device, sizeof l->device, "null: emulated device (benchmarks only)");
        pie_log_info("wrk.null.device",
                     "batch_us=%u token_us=%u layers=%u layer_us=%g layer_token_us=%g "
                     "layer_kv_us=%g host_attn_kv_us=%g link_bytes_per_s=%g device_kv=%llu",
                     c->batch_us, c->token_us, dc.n_layers, c->layer_us, c->layer_token_us,
                     c->layer_kv_us, c->host_attn_kv_us, dc.link_bytes_per_s,
                     (unsigned long long)dc.device_kv);
    }
    else
        snprintf(l->device, sizeof l->device, "null: no compute (benchmarks only)");
    return PIE_OK;
}

/* Loads what cfg asks for into *l (zeroed first); g and me: as load_cpu. On failure *l holds
 * nothing to free. */
static pie_code load(const wrk_config *cfg, wrk_tp_group *g, const wrk_tp_rank *me, wrk_loaded *l,
                     pie_status *st) {
    memset(l, 0, sizeof *l);
    pie_code rc;
    switch (cfg->backend) {
    case WRK_BACKEND_CUDA:
        rc = load_cuda(cfg, g, me, l, st);
        if (rc != PIE_OK) goto fail;
        break;
    case WRK_BACKEND_NULL:
        if (cfg->model_path[0] != '\0') {
            rc = wrk_desc_load(&l->desc, cfg->model_path, st); /* description only */
            if (rc != PIE_OK) return rc;
        } else {
            wrk_desc_null_model(&l->desc);
        }
        rc = load_null(cfg, l, st);
        if (rc != PIE_OK) goto fail;
        break;
    default:
        rc = load_cpu(cfg, g, me, l, st);
        if (rc != PIE_OK) goto fail;
    }
    rc = wrk_desc_finish(&l->desc, cfg->model_name, cfg->model_path, cfg->model_description,
                         cfg->kv_page_size, l->plan.kv_pages_max, cfg->embed_slots,
                         cfg->max_batch_tokens, cfg->max_batch_items, st);
    if (rc == PIE_OK) return PIE_OK;
fail:
    wrk_backend_release(&l->backend);
    eng_close(l->engine);
    wrk_nulldev_destroy(l->nulldev);
    wrk_desc_free(&l->desc);
    memset(l, 0, sizeof *l);
    return rc;
}

static void unload(wrk_loaded *l) {
    wrk_backend_release(&l->backend); /* the cuda engine; nothing for cpu and null */
    eng_close(l->engine);
    wrk_nulldev_destroy(l->nulldev);
    wrk_desc_free(&l->desc);
    memset(l, 0, sizeof *l);
}

/* Rank 0 of a group whose ranks start one by one: a fresh epoch and the collective's listener
 * in *me, and TpJoin admits the others from now on (*offer). */
static pie_code offer_join(const wrk_config *cfg, uint16_t port, wrk_node *node, wrk_tp_rank *me,
                           wrk_tp_offer *offer, pie_status *st) {
    wrk_tp_model_id id;
    pie_code rc = wrk_tp_model_id_load(cfg->model_path, cfg->model_name, &id, st);
    if (rc == PIE_OK) rc = wrk_tp_offer_open(cfg->group_id, &id, port, me, offer, st);
#ifdef PIE_WITH_NCCL
    if (rc == PIE_OK && cfg->backend == WRK_BACKEND_CUDA) { /* this epoch's NCCL id, in TpJoin */
        rc = wrk_nccl_unique_id(offer->nccl_id, st);
        offer->has_nccl_id = me->nccl = me->has_nccl_id = rc == PIE_OK;
        memcpy(me->nccl_id, offer->nccl_id, sizeof me->nccl_id);
    }
#endif
    if (rc != PIE_OK) return rc;
    wrk_node_set_tp_offer(node, offer);
    pie_log_info("wrk.tp.offer", "group=%s tp_size=%u epoch=%016llx collective_port=%u model=%s",
                 offer->group_id, offer->tp_size, (unsigned long long)offer->epoch, offer->port,
                 id.name);
    return PIE_OK;
}

/* The worker the cluster sees: a whole worker, or rank 0 of a group (me->size > 1). Returns
 * the exit status. */
static int serve(const wrk_config *cfg, const wrk_tp_config *tpc, const wrk_tp_rank *me) {
    int status = 1;
    pie_status st;
    wrk_node *node = NULL;
    wrk_tp_group *group = NULL;
    wrk_memrt *mem = NULL;
    wrk_offrt *off = NULL;
    wrk_loaded loaded;
    memset(&loaded, 0, sizeof loaded);
    /* A group of ranks started one by one: rank 0 offers TpJoin before its server answers, so
     * an early rank never meets a worker that does not know yet that it forms a group. */
    bool offering = me->size > 1 && tpc->rank == 0, offered = false;
    wrk_tp_rank joined = *me;
    wrk_tp_offer offer;
    pie_code rc = PIE_OK;
    svc *s = svc_create("worker", &cfg->svc, &st);
    if (s == NULL) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    wrk_node_config nc = {
        .group_id = cfg->group_id,
        .advertise = cfg->advertise,
        .credits = cfg->credits,
        .max_message_bytes = cfg->svc.max_message_bytes,
        .tp_size = me->size,
    };
    node = wrk_node_create(&nc, svc_metrics(s), &st);
    if (node == NULL) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    if (offering) {
        rc = offer_join(cfg, tpc->port, node, &joined, &offer, &st);
        offered = rc == PIE_OK;
    }
    size_t n_methods;
    const rpc_method *methods = wrk_node_methods(node, &n_methods);
    if (svc_serve(s, methods, n_methods, &st) != PIE_OK) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    svc_add_health(s, "pie.v1.Worker");

    pie_log_info("wrk.loading", "backend=%s model_path=\"%s\" tp_size=%u",
                 wrk_backends[cfg->backend], cfg->model_path, me->size);
    int64_t t0 = rpc_now_ns();
    if (rc == PIE_OK && me->size > 1)
        rc = wrk_tp_group_open(tpc, &joined, cfg->group_id, &group, &st);
    joined.tcp_listen_fd = -1; /* the collective took it over, in any case */
    if (offered) { /* from now on TpJoin says the group formed, or to come back later */
        offer.state = rc == PIE_OK ? WRK_TP_OFFER_FORMED : WRK_TP_OFFER_ENDED;
        wrk_node_set_tp_offer(node, &offer);
    }
    if (rc == PIE_OK) rc = load(cfg, group, &joined, &loaded, &st);
    if (rc == PIE_OK && group) rc = wrk_tp_group_loaded(group, loaded.rank_device, &st);
    if (rc != PIE_OK) {
        wrk_node_set_failed(node, &st);
        pie_log_error("wrk.load_failed", "backend=%s code=%s error=\"%s\"",
                      wrk_backends[cfg->backend], pie_code_name(st.code), st.msg);
        /* Rank 0 of ranks started one by one whose group did not form (a rank never came, or
         * died while loading): exit, so whoever restarts the group forms it under a new epoch;
         * staying up FAILED would keep the group's pods from ever re-forming. */
        if (me->size > 1 && tpc->rank == 0) goto done;
        int sig = svc_wait_for_signal();
        pie_log_info("wrk.signal", "signal=%d", sig);
        goto done; /* exit 1: the worker never served */
    }
    const wrk_desc *d = &loaded.desc;
    pie_log_info("wrk.loaded",
                 "backend=%s model=%s vocab=%u layers=%u hidden=%u dtype=%s kv_pages=%u "
                 "kv_page_size=%u embed_slots=%u pool_bytes=%llu device=\"%s\" load_ms=%lld",
                 wrk_backends[cfg->backend], d->name, d->vocab_size, d->num_layers, d->hidden_size,
                 d->dtype, d->kv_pages, d->kv_page_size, d->embed_slots,
                 (unsigned long long)loaded.pool_bytes, loaded.device,
                 (long long)((rpc_now_ns() - t0) / 1000000));
    mem = wrk_memrt_create(&loaded.plan, svc_metrics(s), &st);
    if (mem == NULL) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    wrk_memrt_use_backend(mem, &loaded.backend);
    if (loaded.nulldev) wrk_memrt_use_nulldev(mem, loaded.nulldev);
    off = wrk_offrt_create(&loaded.backend, loaded.auto_choice, svc_metrics(s), &st);
    if (off == NULL) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    if (loaded.nulldev) wrk_offrt_use_nulldev(off, loaded.nulldev);
    if (loaded.auto_choice != WRK_MEM_GPU)
        pie_log_info("wrk.mem.auto", "policy=%s reason=\"%s\"",
                     wrk_mem_policy_names[loaded.auto_choice], loaded.auto_why);
    /* Deferral needs the cpu engine's plan (eng_forward_plan) and one rank: a group's ranks
     * would each have to skip the same items, and rank 0's plan travels without deferral. */
    bool may_defer = cfg->mem_offload_defer && loaded.plan.policy == WRK_MEM_OFFLOAD &&
                     loaded.engine != NULL && group == NULL;
    if (cfg->mem_offload_defer && !may_defer)
        pie_log_info("wrk.mem.offload_defer", "deferral=off reason=\"%s\"",
                     loaded.plan.policy != WRK_MEM_OFFLOAD ? "the memory policy is not offload"
                     : group                               ? "not in a tensor-parallel group"
                             : "the backend has no offload scheduler to defer with");
    if (loaded.plan.policy == WRK_MEM_OFFLOAD) {
        eng_offload_stats os;
        if (loaded.nulldev) wrk_offrt_nulldev_stats(loaded.nulldev, &os);
        else
            loaded.backend.offload_get_stats(loaded.backend.ctx, &os);
        pie_log_info("wrk.mem.offload",
                     "device_kv=%llu host_pool_used=%llu kv_pages_gpu=%u kv_pages_max=%u "
                     "cost_us: linear_per_token=%.3f linear_pass=%.1f device_attn_per_kv=%.5f "
                     "host_attn_per_kv=%.5f%s transfer_per_token=%.4f defer=%s",
                     (unsigned long long)loaded.plan.device_kv,
                     (unsigned long long)loaded.plan.host_bytes, loaded.plan.kv_pages_gpu,
                     loaded.plan.kv_pages_max, os.lin_tok * 1e6, os.lin_fixed * 1e6,
                     os.dattn_kv * 1e6, os.hattn_kv * 1e6,
                     cfg->mem_offload_host_attn_us > 0 ? "(memory.offload_host_attn_us)" : "",
                     os.xfer_tok * 1e6, may_defer ? "true" : "false");
    }
    if (loaded.plan.policy == WRK_MEM_SWAP)
        pie_log_info("wrk.mem.swap",
                     "device_kv=%llu host_pool_used=%llu kv_pages_gpu=%u kv_pages_max=%u "
                     "device_layers=%u min_device_layers=%u adaptive=%s link_gbps=%g "
                     "host_numa_node=%d",
                     (unsigned long long)loaded.plan.device_kv,
                     (unsigned long long)loaded.plan.host_bytes, loaded.plan.kv_pages_gpu,
                     loaded.plan.kv_pages_max, loaded.plan.start_slots, loaded.plan.min_slots,
                     loaded.plan.adaptive ? "true" : "false", cfg->mem_link_gbps,
                     cfg->mem_host_numa_node);
    wrk_node_ready ready = {
        .may_defer = may_defer,
        .mem = mem,
        .desc = &loaded.desc,
        .backend = loaded.backend,
        .device = loaded.device,
        .device_pool_bytes = loaded.pool_bytes,
    };
    if (group) {
        ready.group = wrk_tp_group_leader_hooks(group);
        ready.ranks = wrk_tp_group_ranks(group, &ready.n_ranks);
    }
    if (wrk_node_set_ready(node, &ready, &st) != PIE_OK ||
        wrk_node_link_start(node, s, &cfg->dial, &st) != PIE_OK) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    svc_set_serving(s, true);
    int sig = svc_wait_for_signal();
    pie_log_info("wrk.signal", "signal=%d", sig);
    svc_set_serving(s, false);
    char fault[PIE_STATUS_MSG_MAX];
    if (wrk_backend_fault(fault, sizeof fault)) { /* the stop was the device fault's */
        pie_log_error("wrk.exit", "status=1 reason=\"device fault: %s\"", fault);
        fprintf(stderr, "pie-worker: exiting after a device fault: %s\n", fault);
        status = 1;
    } else {
        /* Drain: readiness fails, the controller places nothing new here, instances placed
         * here get up to server.shutdown_grace to end; closing the link ends the rest. */
        int64_t drain_t0 = rpc_now_ns();
        bool released = wrk_node_drain(node, cfg->svc.shutdown_grace_ms);
        pie_log_info("wrk.drained", "released=%s", released ? "true" : "false");
        int64_t rest_ms = cfg->svc.shutdown_grace_ms - (rpc_now_ns() - drain_t0) / 1000000;
        svc_drain_within(s, rest_ms > 0 ? rest_ms : 0); /* Info calls: nothing to wait for */
        status = 0;
    }
done:
    if (offered && joined.tcp_listen_fd > 0) (void)close(joined.tcp_listen_fd); /* not used */
    svc_drain(s);             /* server first: no callback runs after it */
    wrk_node_destroy(node);   /* closes the controller link: the worker leaves the cluster */
    wrk_memrt_destroy(mem);   /* after the executor (the node's) stopped */
    wrk_offrt_destroy(off);
    svc_stop(s);              /* last: threads stopped above may update its metrics */
    wrk_tp_group_stop(group); /* the executor is stopped: the other ranks may exit */
    unload(&loaded);
    wrk_tp_group_close(group);
    return status;
}

/* A follower's executor results go nowhere: rank 0 returns the group's. */
static void follower_emit(void *user, uint64_t epoch, const Pie__V1__WorkerUp *up) {
    (void)user, (void)epoch, (void)up;
}

/* A rank started on its own: joins rank 0 through Worker/TpJoin with s's token and TLS (*me
 * gets the epoch and the collective's endpoint). */
static pie_code join_leader(const wrk_config *cfg, const wrk_tp_config *tpc, const svc *s,
                            wrk_tp_rank *me, pie_status *st) {
    wrk_tp_model_id id;
    pie_code rc = wrk_tp_model_id_load(cfg->model_path, cfg->model_name, &id, st);
    if (rc != PIE_OK) return rc;
    char device[64];
    me->nccl = cfg->backend == WRK_BACKEND_CUDA; /* TpJoin's answer then carries the NCCL id */
    if (me->nccl)
        snprintf(device, sizeof device, "cuda"); /* its GPU is named once the shard is loaded */
    else
        snprintf(device, sizeof device, "cpu: %ld threads", rank_threads(cfg));
    rc = wrk_tp_join(tpc, s, cfg->svc.listen, cfg->group_id, &id, device, me, st);
    if (rc == PIE_OK)
        pie_log_info("wrk.tp.joined", "rank=%u tp_size=%u epoch=%016llx collective=%s", me->rank,
                     me->size, (unsigned long long)me->epoch, me->tcp_leader);
    return rc;
}

/* Ranks 1..N-1 of a group: load the shard, then run what rank 0 broadcasts. Returns the exit
 * status: 0 when rank 0 stopped the group, 1 when it failed, 2 when it refused this rank. */
static int follow(const wrk_config *cfg, const wrk_tp_config *tpc, const wrk_tp_rank *me) {
    pie_log_set_level((pie_log_level)cfg->svc.log_level);
    pie_log_set_service("worker");
    pie_status st;
    wrk_tp_group *group = NULL;
    wrk_exec *x = NULL;
    svc *s = NULL;
    wrk_loaded loaded;
    memset(&loaded, 0, sizeof loaded);
    int status = 1;
    int64_t t0 = rpc_now_ns();
    wrk_tp_rank joined = *me;
    if (tpc->rank > 0) {
        /* A rank started on its own (a pod of its own) serves health only: NOT_SERVING until
         * its shard is loaded in a formed group, so its pod's probes mean what rank 0's do
         * (forked ranks share their launcher's pod and serve nothing). */
        s = svc_create("worker", &cfg->svc, &st);
        if (!s || svc_serve(s, NULL, 0, &st) != PIE_OK) goto done;
        svc_add_health(s, "pie.v1.Worker");
        if (join_leader(cfg, tpc, s, &joined, &st) != PIE_OK) {
            status = 2; /* refused, or rank 0 never answered: a configuration to fix */
            goto done;
        }
    }
    if (wrk_tp_group_open(tpc, &joined, cfg->group_id, &group, &st) != PIE_OK ||
        load(cfg, group, &joined, &loaded, &st) != PIE_OK)
        goto done;
    /* before the barrier: rank 0 registers only after this line is written */
    pie_log_info("wrk.tp.rank_loaded", "rank=%u tp_size=%u device=\"%s\" load_ms=%lld", me->rank,
                 me->size, loaded.device, (long long)((rpc_now_ns() - t0) / 1000000));
    if (wrk_tp_group_loaded(group, loaded.rank_device, &st) != PIE_OK) goto done;
    if (s) svc_set_serving(s, true);
    wrk_exec_opts eo = {
        .backend = loaded.backend,
        .group = wrk_tp_group_follower_hooks(group),
        .lim = wrk_desc_exec_limits(&loaded.desc),
        .emit = follower_emit,
    };
    x = wrk_exec_start(&eo, &st);
    if (x == NULL) goto done;
    if (wrk_tp_group_follow(group, x, &st) != PIE_OK) goto done;
    status = 0;
    pie_log_info("wrk.tp.rank_stopped", "rank=%u", me->rank);
done:
    if (status != 0)
        pie_log_error("wrk.tp.rank_failed", "rank=%u tp_size=%u code=%s error=\"%s\"", me->rank,
                      me->size, pie_code_name(st.code), st.msg);
    wrk_exec_stop(x);
    svc_stop(s);
    unload(&loaded);
    wrk_tp_group_close(group);
    return status;
}

int main(int argc, char **argv) {
    /* The worker's link thread and its server thread both wait on gRPC completion queues.
     * Under gRPC's default epoll1 engine they share one epoll set and hand the poller role to
     * each other on every message (futex wake-ups and context switches on every decode step);
     * the poll engine polls each queue's own descriptors (bench/results/controller.md, "Control
     * plane CPU per decode step"). Under it a connection being set up while no call waits on
     * it (the link in backoff, a fail-fast retry) is polled only by gRPC's backup poller, every
     * 5 s by default, which delayed re-registration after a controller restart by ~5 s; 100 ms
     * bounds that delay for ~40 idle context switches a second. An operator's settings win. */
    if (setenv("GRPC_POLL_STRATEGY", "poll", 0) != 0 ||
        setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", 0) != 0)
        perror("pie-worker: setenv");
    svc_block_signals();
    svc_args args;
    int rc = svc_parse_args(argc, argv, "pie-worker", &args);
    if (rc) return rc == 1 ? 0 : 2;
    wrk_config cfg;
    rc = svc_load_config("pie-worker", &args, &wrk_schema, &cfg);
    if (rc) return rc == 1 ? 0 : 2;
    /* NULL strings (a YAML null) read as empty from here on. */
    char empty[1] = "";
    char **strs[] = {&cfg.group_id,   &cfg.advertise,         &cfg.model_path,
                     &cfg.model_name, &cfg.model_description, &cfg.tp_leader};
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
        if (*strs[i] == NULL) *strs[i] = empty;
    int status = 2;
    pie_status st;
    wrk_tp_config tpc = {
        .size = cfg.tp_size,
        .rank = cfg.tp_rank,
        .leader = cfg.tp_leader,
        .timeout_ms = (uint32_t)cfg.tp_timeout_ms,
        .form_timeout_ms = (uint32_t)cfg.tp_form_timeout_ms,
        .chunk_bytes = cfg.tp_chunk_bytes,
        .port = (uint16_t)cfg.tp_port,
    };
    wrk_tp_rank me = {.rank = 0, .size = 1};
    /* tensor-parallel groups run on the cpu backend only (wrk_tp_resolve), policies included */
    if (cfg.backend == WRK_BACKEND_CUDA && cfg.mem_policy != WRK_MEM_GPU && cfg.tp_size > 1) {
        fprintf(stderr,
                "pie-worker: backend cuda runs memory.policy %s on one GPU (tp.size 1) so far: "
                "in a tensor-parallel group it is implemented for backends cpu and null only\n",
                wrk_mem_policy_names[cfg.mem_policy]);
        goto done;
    }
    if (cfg.mem_host_numa_node >= 0 && !wrk_numa_node_exists(cfg.mem_host_numa_node)) {
        fprintf(stderr,
                "pie-worker: memory.host_numa_node %d: this machine has NUMA nodes 0..%d "
                "(/sys/devices/system/node)\n",
                cfg.mem_host_numa_node, wrk_numa_nodes() - 1);
        goto done;
    }
    if (cfg.kv_dtype != ENG_KV_F32 && cfg.backend == WRK_BACKEND_CUDA) {
        fprintf(stderr, "pie-worker: engine.kv_dtype %s is implemented for backend cpu only so "
                        "far (backend cuda stores f32)\n",
                wrk_kv_dtypes[cfg.kv_dtype]);
        goto done;
    }
    if (cfg.backend != WRK_BACKEND_NULL && cfg.model_path[0] == '\0') {
        fprintf(stderr,
                "pie-worker: model.path is required with backend %s (set it in the config file "
                "or with PIE_MODEL_PATH)\n",
                wrk_backends[cfg.backend]);
        goto done;
    }
    if (wrk_tp_resolve(&tpc, wrk_backends[cfg.backend], &st) != PIE_OK) {
        fprintf(stderr, "pie-worker: %s\n", st.msg);
        goto done;
    }
    cfg.tp_size = tpc.size;
    if (tpc.size > 1 && tpc.rank >= 0) { /* a rank started on its own: rank 0 or a joiner */
        me = (wrk_tp_rank){.rank = (uint32_t)tpc.rank, .size = tpc.size};
    } else if (tpc.size > 1) {
        pie_log_set_level((pie_log_level)cfg.svc.log_level);
        pie_log_set_service("worker");
        /* a cuda group on one node: one GPU per rank, each rank's CUDA_VISIBLE_DEVICES one
         * entry of the launcher's (all checked before any rank starts) */
        const char *visible = getenv("CUDA_VISIBLE_DEVICES");
        char mine[128] = "";
        if (cfg.backend == WRK_BACKEND_CUDA &&
            wrk_tp_cuda_visible(visible, 0, tpc.size, mine, sizeof mine, &st) != PIE_OK) {
            fprintf(stderr, "pie-worker: %s\n", st.msg);
            goto done;
        }
        if (!wrk_tp_launch(&tpc, &me, &status)) goto done; /* the launcher: the group ended */
        if (cfg.backend == WRK_BACKEND_CUDA) { /* a rank, before any CUDA call */
            if (wrk_tp_cuda_visible(visible, me.rank, me.size, mine, sizeof mine, &st) != PIE_OK)
                pie_log_error("wrk.tp.rank_failed", "rank=%u error=\"%s\"", me.rank, st.msg);
            else if (setenv("CUDA_VISIBLE_DEVICES", mine, 1) != 0)
                pie_log_error("wrk.tp.rank_failed",
                              "rank=%u error=\"cannot set CUDA_VISIBLE_DEVICES\"", me.rank);
            else
                pie_log_info("wrk.tp.rank_gpu", "rank=%u CUDA_VISIBLE_DEVICES=%s", me.rank, mine);
            const char *now = getenv("CUDA_VISIBLE_DEVICES");
            if (!now || strcmp(now, mine) != 0) {
                status = 1; /* the launcher takes the group down */
                goto done;
            }
        }
    }
    status = me.rank == 0 ? serve(&cfg, &tpc, &me) : follow(&cfg, &tpc, &me);
done:
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++)
        if (*strs[i] == empty) *strs[i] = NULL;
    pie_config_free(&wrk_schema, &cfg);
    return status;
}
