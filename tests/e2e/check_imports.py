"""check_imports.py — every import of every example inferlet is a function of the `pie` module
that sdk/include/pie_abi.h declares, or a WASI preview1 function the lifecycle runtime serves.

Usage: check_imports.py --abi pie_abi.h --objdump wasm-objdump <dir with *.wasm>
Exits 1 naming each offending import (and 1 if the directory holds no .wasm file)."""
import argparse
import glob
import os
import re
import subprocess
import sys

# WASI preview1 functions wasi-libc may import and services/lifecycle/wasm serves.
WASI = {"args_get", "args_sizes_get", "environ_get", "environ_sizes_get", "clock_time_get",
        "clock_res_get", "random_get", "fd_write", "fd_read", "fd_close", "fd_seek",
        "fd_fdstat_get", "fd_fdstat_set_flags", "fd_filestat_get", "fd_prestat_get",
        "fd_prestat_dir_name", "proc_exit", "sched_yield", "poll_oneoff"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--abi", required=True)
    ap.add_argument("--objdump", required=True)
    ap.add_argument("dir")
    a = ap.parse_args()
    with open(a.abi) as f:
        abi = set(re.findall(r"PIE_ABI_IMPORT\((\w+)\)", f.read()))
    if not abi:
        sys.exit(f"no PIE_ABI_IMPORT in {a.abi}")
    files = sorted(glob.glob(os.path.join(a.dir, "*.wasm")))
    if not files:
        sys.exit(f"no .wasm files in {a.dir}")
    bad = []
    for w in files:
        out = subprocess.run([a.objdump, "-x", "-j", "Import", w], check=True,
                             capture_output=True, text=True).stdout
        imports = re.findall(r"<- (\w+)\.(\w+)", out)
        wrong = [f"{os.path.basename(w)}: import {m}.{n} is not in the ABI" for m, n in imports
                 if not ((m == "pie" and n in abi) or (m == "wasi_snapshot_preview1" and n in WASI))]
        if not imports:
            wrong.append(f"{w}: no imports found (objdump output changed?)")
        print(f"{os.path.basename(w)}: {len(imports)} imports, {len(wrong)} not allowed")
        bad += wrong
    if bad:
        print("\n".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
