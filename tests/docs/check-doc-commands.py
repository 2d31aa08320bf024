#!/usr/bin/python3
"""tests/docs/check-doc-commands.py — runs the shell commands of README.md and docs/*.md.

Owns: finding every fenced ```sh / ```bash / ```shell / ```console block of README.md and
docs/*.md, running each one that can run on a CI machine against a built tree, and failing when
a block fails or is neither run nor marked. Registered with CTest as
docs/commands_in_readme_and_docs_run (label docs).
Does not own: the cluster's processes (deploy/local/pie-local.sh starts and stops them).

Markers: an HTML comment on the line before a block's opening fence (blank lines between are
allowed); GitHub and other renderers do not show it.

    <!-- doc-test: skip (needs a GPU) -->    not run; the reason in parentheses is required
    <!-- doc-test: cluster -->               run while a local cluster is up on the default
                                             ports (lifecycle 127.0.0.1:50051, controller 50052,
                                             worker 50053, gateway 50054 and its HTTP API
                                             50055, metrics at +10000), as tools/run.sh leaves
                                             one
    <!-- doc-test: file NAME -->             (a block in any language) written to NAME in the
                                             scratch directory, for the blocks after it
    <!-- doc-test: run -->                   the default for a shell block, may be spelled out

Every unmarked shell block runs. Blocks without a language, or in another language (text, c,
yaml, ...), are not commands and are not run. A ```console block runs its `$ `-prefixed lines.

How a block runs: `bash -c 'set -eo pipefail; <block>'` with stdin from /dev/null, in one scratch
directory per run that mirrors the repository (a symbolic link for every top-level entry) with
`build` pointing at the build under test, so `build/bin/piectl` is that build's piectl; blocks
run in document order (README.md first, then docs/ by name) and see the files earlier blocks
made. The cluster (pie-local.sh: one controller, one CPU worker, one lifecycle replica, one
OpenAI gateway when the build has it, the
bundled models/pie-tiny or else the build's tiny-f32, as the quickstart) is up for every block.

Network: where `unshare -rn` works, everything runs in a private network namespace holding only
a loopback interface: the default ports cannot collide with another cluster on the machine and
no command can reach beyond loopback. Elsewhere the commands run in the machine's namespace and
the default ports must be free.

Usage: check-doc-commands.py BUILD_DIR [--source DIR] [--list] [--keep] [--block-timeout S]
  --list   print every shell block with what happens to it, run nothing
  --keep   keep the scratch directory and the cluster's logs
"""
import argparse
import fcntl
import glob
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile

SHELL_LANGS = {"sh", "bash", "shell", "console"}
MARKER_RE = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
FENCE_RE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
DEFAULT_PORTS = (50051, 50052, 50053, 50054, 50055, 60051, 60052, 60053, 60054)


class Block:
    def __init__(self, path, line, lang, text, marker):
        self.path, self.line, self.lang, self.text, self.marker = path, line, lang, text, marker
        self.action, self.arg = "run", ""  # run | cluster | skip | file | ignore

    def where(self):
        return f"{self.path}:{self.line}"


def parse_marker(block, errors):
    m = block.marker
    if m is None:
        block.action = "run" if block.lang in SHELL_LANGS else "ignore"
        return
    if m in ("run", "cluster"):
        block.action = m
    elif m.startswith("skip"):
        r = re.fullmatch(r"skip\s*\((.+)\)", m)
        if not r or not r.group(1).strip():
            errors.append(f"{block.where()}: 'doc-test: {m}' needs a reason: skip (why it cannot run on CI)")
        block.action, block.arg = "skip", (r.group(1).strip() if r else "")
    elif m.startswith("file"):
        name = m[4:].strip()
        if not name or "/" in name or name.startswith("."):
            errors.append(f"{block.where()}: 'doc-test: {m}' needs a plain file name: file NAME")
        block.action, block.arg = "file", name
    else:
        errors.append(f"{block.where()}: unknown marker 'doc-test: {m}' (run, cluster, skip (reason), file NAME)")
    if block.action in ("run", "cluster") and block.lang not in SHELL_LANGS:
        errors.append(f"{block.where()}: 'doc-test: {m}' on a ```{block.lang or '(no language)'} block: "
                      f"only sh, bash, shell and console blocks run")


def parse_file(source, rel, errors):
    """The fenced blocks of one Markdown file, with the marker before each."""
    with open(os.path.join(source, rel), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, i, pending = [], 0, None  # pending: (marker text, line number)
    while i < len(lines):
        mm = MARKER_RE.match(lines[i])
        if mm:
            if pending:
                errors.append(f"{rel}:{pending[1]}: doc-test marker not followed by a fenced block")
            pending = (mm.group(1), i + 1)
            i += 1
            continue
        fm = FENCE_RE.match(lines[i])
        if not fm:
            if lines[i].strip() and pending:
                errors.append(f"{rel}:{pending[1]}: doc-test marker not followed by a fenced block")
                pending = None
            i += 1
            continue
        indent, fence, lang = fm.group(1), fm.group(2), fm.group(3).lower()
        start, body = i + 1, []
        i += 1
        close = re.compile(r"^\s*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$")
        while i < len(lines) and not close.match(lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            errors.append(f"{rel}:{start}: fenced block never closed")
        i += 1
        b = Block(rel, start, lang, "\n".join(body) + "\n", pending[0] if pending else None)
        pending = None
        parse_marker(b, errors)
        blocks.append(b)
    if pending:
        errors.append(f"{rel}:{pending[1]}: doc-test marker not followed by a fenced block")
    return blocks


def collect(source):
    errors, blocks = [], []
    files = ["README.md"] + sorted(os.path.relpath(p, source) for p in glob.glob(os.path.join(source, "docs", "*.md")))
    for rel in files:
        blocks += parse_file(source, rel, errors)
    return blocks, errors


def console_commands(text):
    """The commands of a console transcript: `$ ` lines and their `\\` continuations."""
    out, cont = [], False
    for line in text.split("\n"):
        if cont or line.startswith("$ "):
            out.append(line[2:] if not cont else line)
            cont = line.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


def loopback_up():
    """Brings lo up in a fresh network namespace (ioctl SIOCGIFFLAGS / SIOCSIFFLAGS)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req)[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 0x1))  # IFF_UP
    finally:
        s.close()


def ports_free(ports):
    busy = []
    for p in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            busy.append(p)
        finally:
            s.close()
    return busy


def make_scratch(source, build):
    scratch = tempfile.mkdtemp(prefix="pie-doc-test.")
    for name in os.listdir(source):
        if name in ("build", ".git"):
            continue
        os.symlink(os.path.join(source, name), os.path.join(scratch, name))
    os.symlink(build, os.path.join(scratch, "build"))
    return scratch


def run_blocks(args, blocks):
    """Inside the cluster (or with none needed): every block in order. Exit status = failures."""
    scratch = args.scratch
    failed = ran = 0
    for b in blocks:
        if b.action == "file":
            with open(os.path.join(scratch, b.arg), "w", encoding="utf-8") as f:
                f.write(b.text)
            print(f"doc-test: {b.where()}: wrote {b.arg}", flush=True)
            continue
        if b.action not in ("run", "cluster"):
            continue
        script = console_commands(b.text) if b.lang == "console" else b.text
        print(f"doc-test: {b.where()}: running ```{b.lang} block ({b.action})", flush=True)
        ran += 1
        try:
            p = subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], cwd=scratch,
                               input=b"", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=args.block_timeout)
            rc, out = p.returncode, p.stdout.decode("utf-8", "replace")
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", (e.stdout or b"").decode("utf-8", "replace")
            out += f"\n(killed after {args.block_timeout} s)"
        if rc != 0:
            failed += 1
            print(f"FAIL: {b.where()}: the ```{b.lang} block exited with status {rc}", flush=True)
            print("---- block\n" + script.rstrip() + "\n---- output (last 40 lines)", flush=True)
            print("\n".join(out.rstrip().split("\n")[-40:]) + "\n----", flush=True)
        else:
            tail = out.rstrip().split("\n")[-3:]
            print("    ok" + "".join("\n    | " + t for t in tail if t), flush=True)
    print(f"doc-test: {ran} blocks run, {failed} failed", flush=True)
    return min(failed, 100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--source", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--block-timeout", type=int, default=180)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # run by pie-local.sh --exec
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.source, args.build = os.path.abspath(args.source), os.path.abspath(args.build)

    blocks, errors = collect(args.source)
    if args.inner:
        return run_blocks(args, blocks)

    shell = [b for b in blocks if b.lang in SHELL_LANGS or b.action == "file"]
    reexec = not args.list and os.environ.get("PIE_DOC_TEST_NETNS") != "1" and \
        subprocess.run(["unshare", "-rn", "true"], stderr=subprocess.DEVNULL).returncode == 0
    for b in shell if not reexec else []:  # listed once, by the process that runs them
        what = {"skip": f"skip ({b.arg})", "file": f"file {b.arg}"}.get(b.action, b.action)
        print(f"{b.where()}: ```{b.lang or '(none)'}: {what}")
    if errors:
        for e in errors:
            print("FAIL: " + e)
        return 1
    if args.list:
        return 0
    if not os.path.isfile(os.path.join(args.build, "bin", "piectl")):
        print(f"FAIL: {args.build}/bin/piectl is missing: build the tree first")
        return 1

    # A private network namespace (loopback only) when possible: see the header.
    if reexec:
        env = dict(os.environ, PIE_DOC_TEST_NETNS="1")
        return subprocess.run(["unshare", "-rn", sys.executable] + sys.argv, env=env).returncode
    if os.environ.get("PIE_DOC_TEST_NETNS") != "1":
        print("doc-test: note: no private network namespace (unshare -rn failed): running in the "
              "machine's, which must have the default ports free")
    else:
        loopback_up()

    busy = ports_free(DEFAULT_PORTS)
    if busy:
        print(f"FAIL: the cluster's default ports {busy} are in use (another cluster on this machine?)")
        return 1
    args.scratch = make_scratch(args.source, args.build)
    rundir = os.path.join(args.scratch, "cluster")
    model = os.path.join(args.source, "models", "pie-tiny")
    if not os.path.isfile(os.path.join(model, "config.json")):
        model = os.path.join(args.build, "models", "tiny-f32")
    inner = [sys.executable, os.path.abspath(__file__), args.build, "--source", args.source, "--inner",
             "--scratch", args.scratch, "--block-timeout", str(args.block_timeout)]
    cmd = ["bash", os.path.join(args.source, "deploy", "local", "pie-local.sh"), "--bin",
           os.path.join(args.build, "bin"), "--model", model, "--base-port", "50050",
           "--run-dir", rundir, "--wait-s", "120", "--exec"] + inner
    print("doc-test: " + " ".join(cmd), flush=True)
    # input=b"" (an empty pipe), not DEVNULL: /dev/null is a regular file with stale content on
    # some machines, CI's among them, and piectl run forwards its stdin to the inferlet
    rc = subprocess.run(cmd, input=b"").returncode
    for log in sorted(glob.glob(os.path.join(rundir, "*.log"))):
        with open(log, encoding="utf-8", errors="replace") as f:
            if re.search(r"AddressSanitizer|LeakSanitizer|runtime error:", f.read()):
                print(f"FAIL: {log}: a service reported a sanitizer error")
                rc = rc or 1
    if rc == 0 and not args.keep:
        shutil.rmtree(args.scratch, ignore_errors=True)
    else:
        print(f"doc-test: scratch directory and cluster logs kept in {args.scratch}")
    skipped = sum(b.action == "skip" for b in shell)
    print(f"doc-test: {'PASS' if rc == 0 else 'FAIL'}; {skipped} blocks marked skip")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
