#!/usr/bin/env python3
"""Runs the CMake configure command of every build stage of deploy/docker/Dockerfile on this
machine (the same CMakeLists the tests build), and checks that each target the stage builds
with `cmake --build ... --target` exists in that configuration. A Dockerfile whose flags no
longer configure (a new REQUIRED dependency, a renamed option or target) fails here instead of
in an image build, which needs a Docker engine the CI machine does not have.

    dockerfile-configure.py [--root REPO] [--keep] DOCKERFILE

Stages whose configure enables CUDA are skipped (with a line saying so) where nvcc is absent.
Exit 0 when every stage configures and has its targets, 1 otherwise.
"""
import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def load_checker():
    spec = importlib.util.spec_from_file_location("check_dockerfile",
                                                  os.path.join(HERE, "check-dockerfile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stage_args(stage):
    """ARG defaults of a stage (name → value), for ${NAME} in its RUN lines."""
    args = {}
    for ins in stage["instrs"]:
        if ins.keyword == "ARG":
            name, _, value = ins.args.partition("=")
            args[name.strip()] = value.strip()
    return args


def cmake_steps(run, args):
    """(configure argv, build dir, [targets]) for each `cmake -S` in one RUN command line."""
    text = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)),
                  run)
    steps = []
    for part in text.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["cmake", "-S"]:
            build = words[words.index("-B") + 1]
            steps.append([words, build, []])
        elif words[:2] == ["cmake", "--build"] and steps and "--target" in words:
            steps[-1][2].extend(w for w in words[words.index("--target") + 1:]
                                if not w.startswith("-"))
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(HERE)))
    ap.add_argument("--keep", action="store_true", help="keep the build directories")
    ap.add_argument("dockerfile")
    o = ap.parse_args()
    chk = load_checker()
    stages = chk.stages_of(chk.parse(o.dockerfile))
    have_nvcc = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
    failed, ran = False, 0
    for st in stages:
        args = stage_args(st)
        for ins in st["instrs"]:
            if ins.keyword != "RUN":
                continue
            for argv, build, targets in cmake_steps(ins.args, args):
                if "-DPIE_CUDA=ON" in argv and not have_nvcc:
                    print(f"stage {st['name']}: skipped (configures CUDA, no nvcc here)")
                    continue
                tmp = tempfile.mkdtemp(prefix=f"pie-docker-{st['name']}-")
                argv = [tmp if w == build else w for w in argv]
                argv[argv.index("-S") + 1] = o.root
                r = subprocess.run(argv, capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"{o.dockerfile}:{ins.line}: stage {st['name']}: configure failed: "
                          f"{' '.join(argv)}\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
                    failed = True
                else:
                    h = subprocess.run(["cmake", "--build", tmp, "--target", "help"],
                                       capture_output=True, text=True)
                    have = set(re.findall(r"^\.\.\. (\S+)", h.stdout, re.M))
                    missing = [t for t in targets if t not in have]
                    if missing:
                        print(f"{o.dockerfile}:{ins.line}: stage {st['name']}: no target "
                              f"{', '.join(missing)} in that configuration")
                        failed = True
                    else:
                        print(f"stage {st['name']}: configures; targets {' '.join(targets)}")
                    ran += 1
                if not o.keep:
                    shutil.rmtree(tmp, ignore_errors=True)
    if ran == 0 and not failed:
        print("no build stage could be configured here")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
