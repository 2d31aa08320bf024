"""The public Lifecycle API from Python: grpcio stubs generated from proto/ upload an inferlet
(tests/wasm/lc_echo.c), run it, exchange messages with it and read its exit status — the
cross-language acceptance check of the lifecycle issue."""
import hashlib
import os
import queue
import threading
import time
import unittest

import grpc

from pie.v1 import lifecycle_pb2, lifecycle_pb2_grpc

import pie_cluster

BUILD_DIR = os.path.dirname(os.path.abspath(pie_cluster.BIN_DIR))
FIXTURE = os.path.join(BUILD_DIR, "tests", "wasm", "lc_echo.wasm")


def upload(stub, data, name, chunk=16 << 10):
    def parts():
        yield lifecycle_pb2.UploadProgramRequest(metadata=lifecycle_pb2.ProgramMetadata(
            name=name, size_bytes=len(data), expected_sha256=hashlib.sha256(data).hexdigest()))
        for off in range(0, len(data), chunk):
            yield lifecycle_pb2.UploadProgramRequest(chunk=data[off:off + chunk])
    return stub.UploadProgram(parts(), timeout=120)


class LifecycleClientFromPython(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = pie_cluster.Cluster()
        cls.channel = grpc.insecure_channel(cls.cluster.lifecycle.addr)
        cls.stub = lifecycle_pb2_grpc.LifecycleStub(cls.channel)
        deadline = time.monotonic() + 30
        while not cls.stub.ListModels(lifecycle_pb2.ListModelsRequest(), timeout=5).models:
            if time.monotonic() > deadline:
                raise AssertionError("the lifecycle never learned a model")
            time.sleep(0.05)
        with open(FIXTURE, "rb") as f:
            cls.wasm = f.read()

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        codes = cls.cluster.stop()
        assert codes == {"lifecycle": 0, "worker": 0, "controller": 0}, codes

    def test_upload_is_content_addressed_and_idempotent(self):
        r = upload(self.stub, self.wasm, "echo")
        self.assertEqual(r.program_id, hashlib.sha256(self.wasm).hexdigest())
        self.assertEqual(r.size_bytes, len(self.wasm))
        again = upload(self.stub, self.wasm, "echo-again")
        self.assertTrue(again.already_cached)
        listed = self.stub.ListPrograms(lifecycle_pb2.ListProgramsRequest(), timeout=10).programs
        self.assertIn(("echo-again", len(self.wasm)),
                      [(p.name, p.size_bytes) for p in listed if p.program_id == r.program_id])

    def test_not_wasm_is_rejected_with_a_reason(self):
        with self.assertRaises(grpc.RpcError) as cm:
            upload(self.stub, b"print('hello')\n", "python")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(cm.exception.details(), "a reason is given")

    def test_run_exchanges_messages_and_reads_exit_status(self):
        program = upload(self.stub, self.wasm, "echo").program_id
        requests = queue.Queue()
        requests.put(lifecycle_pb2.RunRequest(launch=lifecycle_pb2.LaunchRequest(
            program_id=program, args=["echo"])))

        def request_iter():
            while True:
                item = requests.get()
                if item is None:
                    return
                yield item

        responses = self.stub.Run(request_iter(), timeout=120)
        first = next(responses)
        self.assertEqual(first.WhichOneof("msg"), "started")
        self.assertNotEqual(first.started.instance_id, 0)
        self.assertGreater(first.started.limits.message_bytes, 0)

        words = [b"alpha", b"\x00binary\xff", "ünïcode".encode()]
        got = []
        stdout = b""
        exit_status = None
        for w in words:
            requests.put(lifecycle_pb2.RunRequest(message=w))
        for resp in responses:
            kind = resp.WhichOneof("msg")
            if kind == "message":
                got.append(resp.message)
                if len(got) == len(words):
                    requests.put(lifecycle_pb2.RunRequest(close_input=lifecycle_pb2.CloseInput()))
                    requests.put(None)  # half-close: Run keeps streaming until the exit status
            elif kind == "stdout_data":
                stdout += resp.stdout_data
            elif kind == "exit_status":
                exit_status = resp.exit_status
        self.assertEqual(got, [b"echo:" + w for w in words])
        self.assertEqual(stdout, b"input closed after 3 messages\n")
        self.assertIsNotNone(exit_status, "the exit status came last")
        self.assertEqual(exit_status.status.code, 0, exit_status.status.message)
        self.assertEqual(exit_status.exit_code, 0)

        instances = self.stub.ListInstances(lifecycle_pb2.ListInstancesRequest(), timeout=10)
        mine = [i for i in instances.instances if i.instance_id == first.started.instance_id]
        self.assertEqual(len(mine), 1)
        self.assertEqual(mine[0].state, lifecycle_pb2.INSTANCE_STATE_EXITED)

    def test_launch_attach_and_exit_code(self):
        program = upload(self.stub, self.wasm, "echo").program_id
        launched = self.stub.Launch(lifecycle_pb2.LaunchRequest(program_id=program,
                                                                args=["exit", "5", "py"]),
                                    timeout=30)
        start = lifecycle_pb2.AttachRequest(start=lifecycle_pb2.AttachStart(
            instance_id=launched.instance_id))
        done = threading.Event()

        def attach_iter():
            yield start
            done.wait(120)  # keep the call open (a half-close would detach)

        out, exit_status = b"", None
        for resp in self.stub.Attach(attach_iter(), timeout=120):
            if resp.WhichOneof("msg") == "stdout_data":
                out += resp.stdout_data
            elif resp.WhichOneof("msg") == "exit_status":
                exit_status = resp.exit_status
        done.set()
        self.assertEqual(out, b"hello exit 5 py\n")
        self.assertEqual(exit_status.status.code, 0)
        self.assertEqual(exit_status.exit_code, 5)


if __name__ == "__main__":
    unittest.main()
