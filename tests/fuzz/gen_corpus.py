#!/usr/bin/env python3
"""gen_corpus.py — writes the generated seed inputs: those of the harnesses that take protobuf
messages (corpus/ctl_rpc, lc_rpc, lc_session, wrk_rpc, wrk_exec, rpc_health) from the text-format messages below, with
`protoc --encode` against proto/pie/v1, and corpus/mdl_safetensors/tiny_model.st. The other
seeds are hand-written files. The seeds are committed; rerun this after a wire-contract change:

    python3 tests/fuzz/gen_corpus.py

Record format (fuzz_rpc.h): [op][len lo][len hi][payload]; op & 7: 0 open a call (payload[0]
= method index, then the request for unary methods), 1 stream message, 2 half-close, 3 client
cancel; (op >> 3) & 3: the call's slot."""
import hashlib
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROTO = os.path.join(ROOT, "proto")


def enc(msg_type, text):
    r = subprocess.run(
        ["protoc", "-I" + PROTO, "--encode=pie.v1." + msg_type,
         "pie/v1/controller.proto", "pie/v1/lifecycle.proto", "pie/v1/worker.proto"],
        input=text.encode(), capture_output=True, cwd=PROTO)
    if r.returncode != 0:
        sys.exit("protoc --encode=%s failed: %s\n%s" % (msg_type, r.stderr.decode(), text))
    return r.stdout


def rec(op, slot, payload=b""):
    return bytes([op | slot << 3, len(payload) & 255, len(payload) >> 8]) + payload


def open_call(slot, method, request=b""):
    return rec(0, slot, bytes([method]) + request)


def msg(slot, payload):
    return rec(1, slot, payload)


def half_close(slot):
    return rec(2, slot)


def cancel(slot):
    return rec(3, slot)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- pie.v1.Controller: method indices of ctl_cluster_methods --------------------------------
(WORKER_LINK, SESSION, CLUSTER_STATUS, GET_TOKENIZER, PUT_PROGRAM, GET_PROGRAM, DROP_PROGRAM,
 LIST_TENANT_EXPORTS, DELETE_TENANT_EXPORT) = range(9)

TOKENIZER = b'{"version":"1.0","model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":[]}}'
TOK_SHA = hashlib.sha256(TOKENIZER).hexdigest()
PROGRAM = b"\0asm\1\0\0\0"
PROGRAM_SHA = hashlib.sha256(PROGRAM).hexdigest()

MODEL = """name: "m" kv_page_size: 4 vocab_size: 100 max_context_tokens: 1024
  max_forward_tokens: 64 default_top_k: 4 max_top_k: 8 dtype: "f32" architecture: "llama"
  num_layers: 1 hidden_size: 8 num_heads: 2 num_kv_heads: 2 head_dim: 4
  tokenizer { kind: "hf" tokenizer_sha256: "%s" num_tokens: 2 }""" % TOK_SHA


def registration(with_tokenizer=False, group="g1"):
    tok = ' tokenizer_json: "%s"' % TOKENIZER.decode().replace('"', '\\"') if with_tokenizer else ""
    return enc("WorkerUp", """registration { group_id: "%s" version: "pie-c/0.1.0"
      model { %s } backend: BACKEND_CPU memory_policy: MEMORY_POLICY_GPU
      capacity { kv_pages_max: 16 kv_pages_effective: 16 kv_pages_gpu: 16 embed_slots: 64
                 max_batch_tokens: 32 max_batch_items: 8 }
      tp_size: 1 device: "cpu" %s } credits: 2""" % (group, MODEL, tok))


INST = 1 << 48 | 1  # replica index 1 in the high 16 bits (InstanceBegin)
HELLO = enc("SessionUp", 'hello { replica_id: "lc-0" version: "pie-c/0.1.0" address: "127.0.0.1:1" }')
BEGIN = enc("SessionUp", """begins { instance_id: %(inst)d program_id: "%(sha)s" model: "m"
  limits { memory_bytes: 1000000 kv_pages: 8 embeddings: 32 queues: 4 message_bytes: 1024
           cpu_ms: 1000 wall_ms: 10000 } }""" % {"inst": INST, "sha": PROGRAM_SHA})
CALLS = enc("SessionUp", """
  calls { instance_id: %(inst)d queue_id: 1 call_id: 1 create_queue { model: "m" } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 2 alloc_kv_pages { kv_page_ids: [0, 1] } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 3 alloc_embeds { embed_ids: [0, 1, 2] } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 4 embed_text { embed_ids: [0, 1] token_ids: [5, 6] positions: [0, 1] } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 5 forward { input_embed_ids: [0, 1] output_kv_page_ids: [0] output_embed_ids: [2] } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 6 next_dist { embed_ids: [2] top_k: 4 temperature: 1.0 } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 7 synchronize { } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 8 mask_kv_page { kv_page_id: 0 masked: [true, false, false, true] } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 9 copy_kv_page { src_kv_page_id: 0 dst_kv_page_id: 1 token_count: 2 } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 10 set_priority { priority: QUEUE_PRIORITY_HIGH } }
""" % {"inst": INST})
SHARING = enc("SessionUp", """
  calls { instance_id: %(inst)d queue_id: 1 call_id: 20 export_kv_pages { kv_page_ids: [0] name: "e" persistent: true } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 21 list_exports { } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 22 import_kv_pages { kv_page_ids: [5] name: "e" } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 23 unexport_kv_pages { name: "e" } }
  calls { instance_id: %(inst)d queue_id: 0 call_id: 24 subscribe { topic: "t" } }
  calls { instance_id: %(inst)d queue_id: 0 call_id: 25 broadcast { topic: "t" message: "hi" } }
  calls { instance_id: %(inst)d queue_id: 0 call_id: 26 unsubscribe { topic: "t" } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 27 dealloc_kv_pages { kv_page_ids: [1] } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 28 dealloc_embeds { embed_ids: [0] } }
  calls { instance_id: %(inst)d queue_id: 1 call_id: 29 destroy_queue { } }
""" % {"inst": INST})
END = enc("SessionUp", 'ends { instance_id: %d status { code: 0 message: "done" } }' % INST)
RESULTS = enc("WorkerUp", """credits: 1
  results { batch_id: 1 exec_us: 10 items { code: 0 } }
  results { batch_id: 2 exec_us: 10 items { code: 0 } items { code: 0 } }
  results { batch_id: 3 exec_us: 10 items { code: 0 distribution { token_ids: [1, 2] probs: [0.5, 0.5] } } }
  results { batch_id: 4 code: 13 message: "boom" }
  capacity { kv_pages_effective: 12 }
  stats { batches: 4 items: 5 busy_us: 40 }""")

write("ctl_rpc", "session_and_worker",
      open_call(0, SESSION) + msg(0, HELLO) + open_call(1, WORKER_LINK) + msg(1, registration()) +
      msg(0, BEGIN) + msg(0, CALLS) + msg(1, RESULTS) + msg(0, SHARING) + msg(0, END) +
      half_close(0) + half_close(1))
write("ctl_rpc", "worker_with_tokenizer",
      open_call(1, WORKER_LINK) + msg(1, registration(True)) + open_call(2, GET_TOKENIZER,
      enc("GetTokenizerRequest", 'tokenizer_sha256: "%s" offset: 3 max_bytes: 10' % TOK_SHA)) +
      open_call(0, SESSION) + msg(0, HELLO) + open_call(3, CLUSTER_STATUS) + cancel(1))
write("ctl_rpc", "two_workers_two_replicas",
      open_call(0, SESSION) + msg(0, HELLO) + open_call(1, WORKER_LINK) + msg(1, registration()) +
      open_call(2, WORKER_LINK) + msg(2, registration(group="g2")) +
      open_call(3, SESSION) + msg(3, enc("SessionUp", 'hello { replica_id: "lc-1" version: "pie-c/0.1.0" }')) +
      msg(0, BEGIN) + msg(0, CALLS) + cancel(1) + msg(2, RESULTS) + cancel(0))
write("ctl_rpc", "programs",
      open_call(0, PUT_PROGRAM) +
      msg(0, enc("PutProgramRequest", 'header { program_id: "%s" size_bytes: %d name: "p" }' % (PROGRAM_SHA, len(PROGRAM)))) +
      msg(0, enc("PutProgramRequest", 'chunk: "\\000asm\\001\\000\\000\\000"')) + half_close(0) +
      open_call(1, GET_PROGRAM, enc("GetProgramRequest", 'program_id: "%s" offset: 0 max_bytes: 4' % PROGRAM_SHA)) +
      open_call(2, SESSION) + msg(2, HELLO) +
      open_call(3, DROP_PROGRAM, enc("DropProgramRequest", 'program_id: "%s"' % PROGRAM_SHA)))
write("ctl_rpc", "protocol_errors",
      open_call(0, SESSION) + msg(0, BEGIN) + open_call(1, WORKER_LINK) + msg(1, RESULTS) +
      open_call(2, GET_TOKENIZER, enc("GetTokenizerRequest", 'tokenizer_sha256: "nothex"')) +
      open_call(3, PUT_PROGRAM) + msg(3, enc("PutProgramRequest", 'chunk: "x"')) +
      open_call(0, SESSION) + msg(0, HELLO) + msg(0, HELLO) + msg(0, b"\xff\xff"))

write("ctl_rpc", "tenant_exports",
      open_call(0, LIST_TENANT_EXPORTS, enc("ListTenantExportsRequest", 'tenant: "alice"')) +
      open_call(1, LIST_TENANT_EXPORTS, enc("ListTenantExportsRequest", "all: true")) +
      open_call(2, DELETE_TENANT_EXPORT, enc("DeleteTenantExportRequest", 'tenant: "alice" name: "x"')) +
      open_call(3, DELETE_TENANT_EXPORT, enc("DeleteTenantExportRequest", 'name: ""')))

# ---- SessionDown messages (fuzz_lc_session: [len lo][len hi][SessionDown]...) -------------------
def downs(*texts):
    out = b""
    for t in texts:
        m = enc("SessionDown", t)
        out += bytes([len(m) & 255, len(m) >> 8]) + m
    return out


write("lc_session", "welcome_models_results",
      downs('welcome { replica_index: 1 version: "pie-c/0.1.0" }',
            "events { models_changed { models { %s } } }" % MODEL,
            'results { instance_id: 281474976710657 call_id: 1 code: 0 synced { } }',
            'results { instance_id: 5 call_id: 2 code: 8 message: "quota" }',
            "events { models_changed { } }"))
write("lc_session", "events",
      downs('events { instance_terminated { instance_id: 7 status { code: 14 message: "lost" } } }',
            'events { delivery { topic: "t" message: "m" sender_instance_id: 1 instance_ids: [2, 3] } }',
            'events { worker_lost { worker_index: 1 group_id: "g" } }',
            'events { program_dropped { program_id: "%s" } }' % PROGRAM_SHA))

# ---- pie.v1.Lifecycle: method indices of lc_api_methods --------------------------------------
(UPLOAD, LIST_PROGRAMS, DELETE_PROGRAM, LAUNCH, TERMINATE, LIST_INSTANCES, ATTACH, RUN,
 LIST_EXPORTS, DELETE_EXPORT, LIST_MODELS) = range(11)
# fuzz_lc_rpc stores corpus/wasm_parse/trivial.wasm before the first input: launches of it get
# past "not stored" to the model and limits checks.
with open(os.path.join(HERE, "corpus", "wasm_parse", "trivial.wasm"), "rb") as _f:
    TRIVIAL_SHA = hashlib.sha256(_f.read()).hexdigest()
LAUNCH_REQ = """program_id: "%s" args: ["--n", "3"] model: "m"
  limits { memory_bytes: 1000000 kv_pages: 8 embeddings: 32 queues: 4 message_bytes: 1024
           cpu_ms: 1000 wall_ms: 10000 }""" % TRIVIAL_SHA

write("lc_rpc", "upload_list_delete",
      open_call(0, UPLOAD) +
      msg(0, enc("UploadProgramRequest", 'metadata { name: "p" size_bytes: %d expected_sha256: "%s" }' % (len(PROGRAM), PROGRAM_SHA))) +
      msg(0, enc("UploadProgramRequest", 'chunk: "\\000asm"')) +
      msg(0, enc("UploadProgramRequest", 'chunk: "\\001\\000\\000\\000"')) + half_close(0) +
      open_call(1, LIST_PROGRAMS, b"") +
      open_call(2, DELETE_PROGRAM, enc("DeleteProgramRequest", 'program_id: "%s"' % PROGRAM_SHA)) +
      open_call(3, LIST_MODELS, b""))
write("lc_rpc", "exports",
      open_call(0, LIST_EXPORTS, enc("ListExportsRequest", "all_tenants: true")) +
      open_call(1, DELETE_EXPORT, enc("DeleteExportRequest", 'name: "p1" tenant: "alice"')) +
      open_call(2, DELETE_EXPORT, enc("DeleteExportRequest", 'name: ""')))
write("lc_rpc", "launch_terminate_list",
      open_call(0, LAUNCH, enc("LaunchRequest", LAUNCH_REQ)) +
      open_call(1, TERMINATE, enc("TerminateRequest", "instance_id: 1")) +
      open_call(2, LIST_INSTANCES, b""))
write("lc_rpc", "run_stream",
      open_call(0, RUN) + msg(0, enc("RunRequest", "launch { %s }" % LAUNCH_REQ)) +
      msg(0, enc("RunRequest", 'message: "hello"')) + msg(0, enc("RunRequest", "close_input { }")) +
      half_close(0))
write("lc_rpc", "attach_stream",
      open_call(1, ATTACH) + msg(1, enc("AttachRequest", "start { instance_id: 1 }")) +
      msg(1, enc("AttachRequest", 'message: "x"')) + half_close(1) +
      open_call(2, ATTACH) + msg(2, enc("AttachRequest", 'message: "first"')) + cancel(2))
write("lc_rpc", "upload_errors",
      open_call(0, UPLOAD) + msg(0, enc("UploadProgramRequest", 'chunk: "x"')) +
      open_call(1, UPLOAD) + msg(1, enc("UploadProgramRequest", 'metadata { name: "" size_bytes: 0 }')) +
      open_call(2, UPLOAD) + msg(2, enc("UploadProgramRequest", 'metadata { name: "q" size_bytes: 3 expected_sha256: "zz" }')) +
      open_call(3, UPLOAD) + msg(3, enc("UploadProgramRequest", 'metadata { name: "q" size_bytes: 2 }')) +
      msg(3, enc("UploadProgramRequest", 'chunk: "abc"')) + half_close(3))

# ---- WorkerDown steps (fuzz_wrk_exec: op 0 a step, op 1 the link was lost) -------------------
STEP_ALLOC = enc("WorkerDown", """
  batches { batch_id: 1 slots { alloc_kv_slots: [0, 1, 2] alloc_kv_owners: [7, 7, 7]
                                alloc_embed_slots: [0, 1, 2, 3] } }
  batches { batch_id: 2 embed_text { embed_slots: [0, 1] token_ids: [5, 2047] positions: [0, 1] } }
  batches { batch_id: 3 forward { items { kv_slots: [0] kv_last_page_len: 2 append_kv: true
                                          input_embed_slots: [0, 1] output_embed_slots: [2] owner: 7 }
                                  items { input_embed_slots: [3] output_embed_slots: [3]
                                          mask { runs: [1] } } } }
  batches { batch_id: 4 mask_page { items { kv_slot: 1 masked: [true, false, true, false] } } }
  batches { batch_id: 5 copy_page { items { src_kv_slot: 0 dst_kv_slot: 2 src_offset: 1 dst_offset: 0 token_count: 3 } } }
  batches { batch_id: 6 next_dist { items { embed_slot: 2 top_k: 4 temperature: 0.7 }
                                    items { embed_slot: 3 top_k: 0 temperature: 1 } } }""")
STEP_FREE = enc("WorkerDown", """
  batches { batch_id: 7 slots { free_kv_slots: [1] free_embed_slots: [0, 1] } }
  batches { batch_id: 8 forward { items { kv_slots: [1] kv_last_page_len: 4 input_embed_slots: [0] } } }
  batches { batch_id: 9 next_dist { items { embed_slot: 99 top_k: 9 temperature: -1 } } }
  drain { shutdown: false reason: "fuzz" }""")
STEP_BAD = enc("WorkerDown", """
  batches { batch_id: 10 slots { alloc_kv_slots: [16] free_embed_slots: [64] } }
  batches { batch_id: 11 embed_text { embed_slots: [0] token_ids: [1, 2] positions: [0] } }
  batches { batch_id: 12 copy_page { items { src_kv_slot: 0 dst_kv_slot: 0 src_offset: 3 dst_offset: 0 token_count: 2 } } }
  batches { batch_id: 13 }""")
write("wrk_exec", "all_kinds", rec(0, 0, STEP_ALLOC) + rec(0, 0, STEP_FREE))
write("wrk_exec", "reset_between", rec(0, 0, STEP_ALLOC) + rec(1, 0) + rec(0, 0, STEP_ALLOC))
write("wrk_exec", "malformed", rec(0, 0, STEP_ALLOC) + rec(0, 0, STEP_BAD))

# ---- pie.v1.Worker: method indices of wrk_node_methods -----------------------------------------
INFO, TP_JOIN = range(2)
write("wrk_rpc", "info_and_tp_join",
      open_call(0, INFO, enc("InfoRequest", "")) +
      open_call(1, TP_JOIN, enc("TpJoinRequest", """group_id: "fuzz" rank: 1 tp_size: 2 model: "m"
        config_sha256: "%s" version: "pie-c/0.1.0" device: "cuda:1" """ % PROGRAM_SHA)) +
      open_call(2, INFO, b"\xff"))

# ---- safetensors: every tensor of fuzz_mdl_safetensors's FUZZ_CONFIG model, F32 ---------------
def tiny_model():
    import json
    import math
    import struct
    d, f, v = 8, 16, 16
    names = [("model.embed_tokens.weight", [v, d])]
    p = "model.layers.0."
    names += [(p + "input_layernorm.weight", [d]), (p + "self_attn.q_proj.weight", [8, d]),
              (p + "self_attn.k_proj.weight", [8, d]), (p + "self_attn.v_proj.weight", [8, d]),
              (p + "self_attn.o_proj.weight", [d, 8]), (p + "post_attention_layernorm.weight", [d]),
              (p + "mlp.gate_proj.weight", [f, d]), (p + "mlp.up_proj.weight", [f, d]),
              (p + "mlp.down_proj.weight", [d, f])]
    names += [("model.norm.weight", [d]), ("lm_head.weight", [v, d])]
    hdr, data = {}, b""
    for n, shape in names:
        size = 4 * math.prod(shape)
        hdr[n] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + size]}
        data += struct.pack("<f", 0.25) * (size // 4)
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # data 8-byte aligned: no tensor is copied
    return struct.pack("<Q", len(h)) + h + data


write("mdl_safetensors", "tiny_model.st", tiny_model())

# ---- grpc.health.v1.Health: Check, Watch --------------------------------------------------------
CHECK, WATCH = range(2)


def health(text):
    r = subprocess.run(["protoc", "-I/usr/share/grpc-proto", "--encode=grpc.health.v1.HealthCheckRequest",
                        "grpc/health/v1/health.proto"], input=text.encode(), capture_output=True)
    if r.returncode != 0:
        sys.exit("protoc --encode=grpc.health.v1.HealthCheckRequest failed: " + r.stderr.decode())
    return r.stdout


write("rpc_health", "check_and_watch",
      open_call(0, CHECK, health('service: ""')) + open_call(1, WATCH, health('service: "pie.v1.Lifecycle"')) +
      open_call(2, CHECK, health('service: "nope"')) + open_call(3, WATCH, health('service: "nope"')) +
      rec(7, 0, bytes([1]) + b"pie.v1.Lifecycle") + rec(7, 0, bytes([1]) + b"nope") +
      open_call(0, CHECK, health('service: "pie.v1.Lifecycle"')) + rec(7, 0, bytes([3]) + b"nope") +
      cancel(3))

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--list":
    print("\n".join(sorted(os.listdir(os.path.join(HERE, "corpus")))))
