"""pie_cluster — starts real Pie-C services on loopback for tests written in Python.

Each service listens on ephemeral ports (server.listen and metrics.listen set to port 0 through
PIE_* environment overrides); the bound ports are read from the service's `svc.started` log
line. Services are stopped with SIGTERM and their exit status is checked.
"""
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

SANITIZER = re.compile(rb"LeakSanitizer|AddressSanitizer|runtime error:")
BIN_DIR = os.environ.get("PIE_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))
MODELS_DIR = os.environ.get("PIE_MODELS_DIR", os.path.join(BIN_DIR, "../models"))
STARTED = re.compile(rb"event=svc\.started .*grpc_port=(\d+) metrics_port=(\d+)(?s:.*)event=svc\.health serving=true")


class Service:
    def __init__(self, name, env=None, timeout=20.0):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"pie-{name}-", suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.update({"PIE_SERVER_LISTEN": "127.0.0.1:0", "PIE_METRICS_LISTEN": "127.0.0.1:0"})
        full_env.update(env or {})
        self.proc = subprocess.Popen([os.path.join(BIN_DIR, f"pie-{name}")], env=full_env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            m = STARTED.search(self.read_log())
            if m:
                self.port, self.metrics_port = int(m.group(1)), int(m.group(2))
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"pie-{name} exited {self.proc.returncode}:\n{self.read_log().decode()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"pie-{name} did not start:\n{self.read_log().decode()}")
            time.sleep(0.02)
        self.addr = f"127.0.0.1:{self.port}"

    def read_log(self):
        with open(self.log.name, "rb") as f:
            return f.read()

    def wait_log(self, needle, timeout=20.0):
        """Waits until the log contains needle (bytes)."""
        deadline = time.monotonic() + timeout
        while needle not in self.read_log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pie-{self.name}: no {needle!r} in its log:\n"
                                   f"{self.read_log().decode(errors='replace')}")
            time.sleep(0.02)

    def stop(self, timeout=20.0):
        """SIGTERM, then the exit status (0 expected). A sanitizer report in the log (the
        ASan+UBSan test build) fails the test whatever the status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        log = self.read_log()
        self.log.close()
        os.unlink(self.log.name)
        if SANITIZER.search(log):
            raise AssertionError(f"pie-{self.name} reported a sanitizer error:\n{log.decode(errors='replace')}")
        return rc


class Cluster:
    """One controller, one worker, one lifecycle replica, optionally with a bearer token."""

    def __init__(self, token=None, lifecycle_env=None):
        env = {"PIE_AUTH_TOKEN": token} if token else {}
        # The lifecycle stores programs and compiled code here (removed by stop()).
        self.cache_dir = tempfile.mkdtemp(prefix="pie-lc-cache-")
        self.controller = Service("controller", env)
        link = dict(env, PIE_CONTROLLER_ADDRESS=self.controller.addr)
        # The generated tiny model, served under the name "tiny".
        model = {"PIE_MODEL_PATH": os.path.join(MODELS_DIR, "tiny-f32"), "PIE_MODEL_NAME": "tiny"}
        self.worker = Service("worker", dict(link, **model))
        lc = dict(link, PIE_RUNTIME_CACHE_DIR=self.cache_dir, PIE_TOKENIZER_PATH=MODELS_DIR,
                  PIE_RUNTIME_TIER1="false", **(lifecycle_env or {}))
        self.lifecycle = Service("lifecycle", lc)
        # Ready to launch (its readiness health) once its Session knows the worker's model.
        self.lifecycle.wait_log(b"event=svc.health.ready service=pie.v1.Lifecycle ready=true")

    def services(self):
        return [self.lifecycle, self.worker, self.controller]

    def stop(self):
        codes = {s.name: s.stop() for s in self.services()}
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        return codes
