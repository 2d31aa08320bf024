#!/usr/bin/env python3
"""Project rules for deploy/docker/Dockerfile that generic linters do not know (hadolint is not
packaged for Debian or npm; dockerfile-utils and dockerfilelint cover syntax and the common
best practices, see tests/deploy/run.sh). Each rule is one item of the checklist in
docs/deploy.md, "Container images".

    check-dockerfile.py [--root REPO] [--targets controller,lifecycle,worker,gateway] DOCKERFILE

Exit 0 when every rule holds, 1 with one line per violation (FILE:LINE: message).
"""
import argparse
import glob
import json
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Packages a build stage may install beyond tools/setup.sh's list.
BUILD_EXTRAS = {"ca-certificates", "python3"}
WASM_TOOLCHAIN = {"wabt", "tcc", "clang", "lld", "wasi-libc"}


class Instr:
    def __init__(self, line, keyword, args):
        self.line, self.keyword, self.args = line, keyword, args


def parse(path):
    """Instructions with continuation lines joined and comment lines dropped."""
    instrs = []
    buf, start = "", None
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if line.strip().startswith("#") or (not line.strip() and not buf):
                continue
            if start is None:
                start = n
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            buf += line
            kw, _, rest = buf.strip().partition(" ")
            instrs.append(Instr(start, kw.upper(), rest.strip()))
            buf, start = "", None
    return instrs


def stages_of(instrs):
    stages = []
    for ins in instrs:
        if ins.keyword == "FROM":
            toks = ins.args.split()
            flags = [t for t in toks if t.startswith("--")]
            toks = [t for t in toks if not t.startswith("--")]
            name = toks[2] if len(toks) >= 3 and toks[1].upper() == "AS" else None
            stages.append({"line": ins.line, "image": toks[0], "name": name, "instrs": [],
                           "flags": flags})
        elif stages:
            stages[-1]["instrs"].append(ins)
    return stages


def setup_debs(root):
    text = open(os.path.join(root, "tools", "setup.sh"), encoding="utf-8").read()
    m = re.search(r"^debs=\((.*?)^\)", text, re.S | re.M)
    return set(m.group(1).split()) if m else set()


def cmake_bin_targets(root):
    """Executable targets whose binaries land in ${CMAKE_BINARY_DIR}/bin."""
    execs, in_bin = set(), set()
    lists = []
    for d, subdirs, files in os.walk(root):
        subdirs[:] = [s for s in subdirs if not s.startswith(("build", "."))]
        if "CMakeLists.txt" in files:
            lists.append(os.path.join(d, "CMakeLists.txt"))
    for cm in lists:
        text = open(cm, encoding="utf-8").read()
        execs.update(re.findall(r"add_executable\(\s*([\w.-]+)", text))
        for m in re.finditer(r"set_target_properties\(\s*([\w.-]+)\s+PROPERTIES([^)]*)\)", text):
            if re.search(r"RUNTIME_OUTPUT_DIRECTORY\s+\$\{CMAKE_BINARY_DIR\}/bin", m.group(2)):
                in_bin.add(m.group(1))
    return execs & in_bin


def inferlet_targets(root):
    """Targets pie_add_inferlet (sdk/CMakeLists.txt) defines: inferlet_<name>, whose output is
    <build>/inferlets/<name>.wasm."""
    out = set()
    path = os.path.join(root, "inferlets", "CMakeLists.txt")
    if not os.path.exists(path):
        return out
    text = open(path, encoding="utf-8").read()
    out.update(f"inferlet_{n}" for n in re.findall(r"pie_add_inferlet\(\s*([\w.-]+)", text))
    for m in re.finditer(r"foreach\(\s*name\s+([^)]*)\)(.*?)endforeach", text, re.S):
        if "pie_add_inferlet(${name}" in m.group(2):
            out.update(f"inferlet_{n}" for n in m.group(1).split())
    return out


def config_value(root, svc, section, key):
    """A scalar of deploy/config/<svc>.yaml (two-level layout, as --print-config writes it)."""
    text = open(os.path.join(root, "deploy", "config", f"{svc}.yaml"), encoding="utf-8").read()
    m = re.search(rf"^{section}:\n((?:(?:  .*|\s*)\n)+)", text + "\n", re.M)
    v = re.search(rf"^  {key}:\s*\"?([^\"\n]*)\"?\s*$", m.group(1), re.M) if m else None
    return v.group(1) if v else None


def test_build_type(root):
    text = open(os.path.join(root, "tools", "test.sh"), encoding="utf-8").read()
    m = re.search(r'run_suite "release" \S+ .*-DCMAKE_BUILD_TYPE=(\w+)', text)
    return m.group(1) if m else None


def config_ports(root, svc):
    text = open(os.path.join(root, "deploy", "config", f"{svc}.yaml"), encoding="utf-8").read()
    return {int(p) for p in re.findall(r'^\s*listen:\s*"?[^"\s]*:(\d+)"?\s*$', text, re.M)}


def apt_installs(run):
    """Package lists of every `apt-get install` in one RUN (shell words, options dropped)."""
    out = []
    for cmd in re.split(r"&&|;|\|\|", run):
        words = cmd.split()
        if "apt-get" in words and "install" in words:
            i = words.index("install")
            out.append((words, [w for w in words[i + 1:] if not w.startswith("-") and "$" not in w]))
    return out


def check_chart(root, values_path, stages, names, targets, err):
    """The chart runs the images as the user they declare, with their ENTRYPOINT's binary, on
    the ports they expose (values.yaml is read with patterns: its layout is the chart's own)."""
    text = open(values_path, encoding="utf-8").read()
    psc = re.search(r"^podSecurityContext:\n((?:  .*\n)+)", text, re.M)
    uid = re.search(r"^  runAsUser: (\d+)", psc.group(1), re.M) if psc else None
    gid = re.search(r"^  runAsGroup: (\d+)", psc.group(1), re.M) if psc else None
    for svc in targets:
        if svc not in names:
            continue
        st = stages[names[svc]]
        users = [ins for ins in st["instrs"] if ins.keyword == "USER"]
        if users and uid and gid and users[-1].args.strip() != f"{uid.group(1)}:{gid.group(1)}":
            err(users[-1].line, f"stage {svc}: USER {users[-1].args.strip()} differs from the chart's "
                                f"podSecurityContext {uid.group(1)}:{gid.group(1)}")
        block = re.search(rf"^{svc}:\n((?:(?:  .*)?\n)+)", text, re.M)
        exposed = set()
        for ins in st["instrs"]:
            if ins.keyword == "EXPOSE":
                exposed.update(int(p.split("/")[0]) for p in ins.args.split())
        for key in ("port", "grpcPort", "metricsPort"):
            m = re.search(rf"^  {key}: (\d+)", block.group(1), re.M) if block else None
            if m and int(m.group(1)) not in exposed:
                err(st["line"], f"stage {svc}: the chart's {svc}.{key} {m.group(1)} is not EXPOSEd")
        if svc == "gateway" and block:
            # The chart's program.path must name the file the image carries.
            m = re.search(r"^    program:\n(?:      #.*\n|      .*\n)*?      path: *\"?([^\"\n]*)\"?$", block.group(1), re.M)
            want = config_value(root, "gateway", "program", "path")
            if not m:
                err(st["line"], "stage gateway: the chart's gateway.config.program.path is not set (the binary's default is next to it, not where the image puts the inferlet)")
            elif want is not None and m.group(1) != want:
                err(st["line"], f"stage gateway: the chart's gateway.config.program.path {m.group(1)} is not the image's {want} (deploy/config/gateway.yaml)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--targets", default="controller,lifecycle,worker,gateway")
    ap.add_argument("--chart-values", help="helm/pie/values.yaml: check the images match the chart")
    ap.add_argument("dockerfile")
    a = ap.parse_args()
    root, path = a.root, a.dockerfile
    targets = a.targets.split(",")
    errs = []

    def err(line, msg):
        errs.append(f"{path}:{line}: {msg}")

    instrs = parse(path)
    stages = stages_of(instrs)
    names = {}
    for i, st in enumerate(stages):
        if st["name"]:
            if st["name"] in names:
                err(st["line"], f"stage name '{st['name']}' used twice")
            names[st["name"]] = i

    debs_allowed = setup_debs(root) | BUILD_EXTRAS
    bin_targets = cmake_bin_targets(root)
    wasm_targets = inferlet_targets(root)
    want_type = test_build_type(root)
    built = {}  # stage name -> set of cmake --target names

    for i, st in enumerate(stages):
        img = st["image"]
        # Base images: pinned tag or digest, never latest, never a variable (it could not be checked).
        if img not in names or names[img] >= i:
            if "$" in img:
                err(st["line"], f"base image '{img}' is a variable: write the pinned image")
            elif "@sha256:" not in img:
                tag = img.rsplit(":", 1)[1] if ":" in img.split("/")[-1] else None
                if tag is None:
                    err(st["line"], f"base image '{img}' has no tag")
                elif tag == "latest":
                    err(st["line"], f"base image '{img}' uses latest")
                elif not re.search(r"\d", tag):
                    err(st["line"], f"base image '{img}': tag '{tag}' names no version")
        for ins in st["instrs"]:
            kw, args = ins.keyword, ins.args
            if kw == "ADD":
                if re.search(r"(https?|ftp)://|git@", args):
                    err(ins.line, "ADD from a URL: download in a RUN with checksum verification, or COPY")
                else:
                    err(ins.line, "ADD: use COPY (ADD's archive extraction and URL fetching surprise)")
            if kw == "HEALTHCHECK" and args.strip().upper() != "NONE":
                err(ins.line, "HEALTHCHECK: Kubernetes probes gRPC health directly (see helm/pie)")
            if kw == "COPY":
                m = re.search(r"--from=(\S+)", args)
                if m:
                    src = m.group(1)
                    if src not in names or names[src] >= i:
                        err(ins.line, f"COPY --from={src}: no earlier stage of that name")
            if kw == "RUN":
                if re.search(r"\bsudo\b", args):
                    err(ins.line, "sudo in RUN: stages run as root until USER")
                if re.search(r"apt-get\s+(\S+\s+)*update", args) and "rm -rf /var/lib/apt/lists/*" not in args:
                    err(ins.line, "apt-get update without rm -rf /var/lib/apt/lists/* in the same RUN")
                if re.search(r"apt-get\s+(-\S+\s+)*(upgrade|dist-upgrade)", args):
                    err(ins.line, "apt-get upgrade: rebuild on a newer pinned base instead")
                for words, pkgs in apt_installs(args):
                    if "-y" not in words and "--yes" not in words:
                        err(ins.line, "apt-get install without -y")
                    if "--no-install-recommends" not in words:
                        err(ins.line, "apt-get install without --no-install-recommends")
                    if st["name"] and st["name"].startswith("build"):
                        extra = sorted(set(pkgs) - debs_allowed)
                        if extra:
                            err(ins.line, f"build stage installs {', '.join(extra)}, not in tools/setup.sh")
                for m in re.finditer(r"cmake\s+--build\s+(.*?)(?:&&|$)", args):
                    words = m.group(1).split()
                    if "--target" in words:
                        tgt = []
                        for w in words[words.index("--target") + 1:]:
                            if w.startswith("-"):
                                break
                            tgt.append(w)
                        built.setdefault(st["name"], set()).update(tgt)
                        for t in tgt:
                            if t not in bin_targets and t not in wasm_targets:
                                err(ins.line, f"cmake --target {t}: not an executable CMake builds into bin/ nor an inferlet (pie_add_inferlet)")
                for m in re.finditer(r"cmake\s+-S\s.*?(?:&&|$)", args):
                    bt = re.search(r"-DCMAKE_BUILD_TYPE=(\w+)", m.group(0))
                    if want_type and (not bt or bt.group(1) != want_type):
                        err(ins.line, f"cmake configure: build type must be {want_type}, the one tools/test.sh tests")

    for svc in targets:
        if svc not in names:
            err(1, f"no stage '{svc}' (docker build --target {svc})")
            continue
        st = stages[names[svc]]
        users = [ins for ins in st["instrs"] if ins.keyword == "USER"]
        if not users:
            err(st["line"], f"stage {svc}: no USER (it would run as root)")
        else:
            u = users[-1].args.split(":")[0].strip()
            if u in ("root", "0"):
                err(users[-1].line, f"stage {svc}: runs as root")
        copied = set()
        for ins in st["instrs"]:
            if ins.keyword != "COPY":
                continue
            toks = [t for t in shlex.split(ins.args) if not t.startswith("--")]
            m = re.search(r"--from=(\S+)", ins.args)
            for src in toks[:-1]:
                if m and src.startswith("/build/bin/"):
                    b = os.path.basename(src)
                    copied.add(b)
                    if b not in built.get(m.group(1), set()):
                        err(ins.line, f"stage {svc}: copies {src}, which stage {m.group(1)} does not build (cmake --target)")
            if not m and toks:
                for src in toks[:-1]:
                    if not glob.glob(os.path.join(root, src)):
                        err(ins.line, f"stage {svc}: COPY {src}: no such file in the repository")
        ep = [ins for ins in st["instrs"] if ins.keyword == "ENTRYPOINT"]
        if not ep:
            err(st["line"], f"stage {svc}: no ENTRYPOINT")
        else:
            try:
                argv = json.loads(ep[-1].args)
            except ValueError:
                argv = None
                err(ep[-1].line, f"stage {svc}: ENTRYPOINT must be the exec (JSON) form: signals reach the service")
            if argv is not None:
                want = [f"/usr/local/bin/pie-{svc}", "--config", f"/etc/pie/{svc}.yaml"]
                if argv != want:
                    err(ep[-1].line, f"stage {svc}: ENTRYPOINT must be {json.dumps(want)}")
                if os.path.basename(argv[0]) not in copied:
                    err(ep[-1].line, f"stage {svc}: ENTRYPOINT runs {argv[0]}, which the stage does not copy from a build stage")
                cfg = f"/etc/pie/{svc}.yaml"
                if not any(ins.keyword == "COPY" and ins.args.split()[-1] == cfg for ins in st["instrs"]):
                    err(ep[-1].line, f"stage {svc}: no default config copied to {cfg}")
        exposed = set()
        for ins in st["instrs"]:
            if ins.keyword == "EXPOSE":
                exposed.update(int(p.split("/")[0]) for p in ins.args.split())
        want_ports = config_ports(root, svc) if os.path.exists(os.path.join(root, "deploy", "config", f"{svc}.yaml")) else set()
        if want_ports - exposed:
            err(st["line"], f"stage {svc}: EXPOSE {sorted(exposed)} lacks the ports of deploy/config/{svc}.yaml {sorted(want_ports)}")
        if svc == "gateway":
            # The built-in inferlet must be where deploy/config/gateway.yaml's program.path says,
            # copied from a stage that builds it (cmake --target inferlet_<name>).
            want = config_value(root, "gateway", "program", "path") if os.path.exists(
                os.path.join(root, "deploy", "config", "gateway.yaml")) else None
            if not want:
                err(st["line"], "stage gateway: deploy/config/gateway.yaml sets no program.path (the inferlet's place in the image)")
            else:
                found = False
                for ins in st["instrs"]:
                    if ins.keyword != "COPY":
                        continue
                    toks = [t for t in shlex.split(ins.args) if not t.startswith("--")]
                    m = re.search(r"--from=(\S+)", ins.args)
                    if len(toks) < 2:
                        continue
                    dest = toks[-1]
                    for src in toks[:-1]:
                        b = os.path.basename(src)
                        at = dest + b if dest.endswith("/") else dest
                        if at != want:
                            continue
                        found = True
                        name = b[:-len(".wasm")] if b.endswith(".wasm") else b
                        if not m or f"inferlet_{name}" not in built.get(m.group(1), set()):
                            err(ins.line, f"stage gateway: copies {src}, which no earlier stage builds (cmake --target inferlet_{name})")
                if not found:
                    err(st["line"], f"stage gateway: nothing is copied to {want}, the program.path of deploy/config/gateway.yaml")
        if svc == "lifecycle":
            pkgs = set()
            for ins in st["instrs"]:
                if ins.keyword == "RUN":
                    for _, p in apt_installs(ins.args):
                        pkgs.update(p)
            missing = WASM_TOOLCHAIN - pkgs
            if missing:
                err(st["line"], f"stage lifecycle: lacks the Wasm toolchain packages {', '.join(sorted(missing))}")

    if a.chart_values:
        check_chart(root, a.chart_values, stages, names, targets, err)

    for e in errs:
        print(e)
    if not errs:
        print(f"{path}: {len(stages)} stages, targets {', '.join(targets)}: every project rule holds")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
