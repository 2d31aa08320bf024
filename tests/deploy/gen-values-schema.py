#!/usr/bin/env python3
"""Regenerates the config sections of helm/pie/values.schema.json from the services' own
schemas (`pie-<svc> --help-config`), like tools/gen-config-docs.sh does for
docs/configuration.md, so the chart accepts exactly the keys, types and ranges the binaries do.

    tests/deploy/gen-values-schema.py BIN_DIR            rewrite helm/pie/values.schema.json
    tests/deploy/gen-values-schema.py --check BIN_DIR    exit 1 (with a diff) if the keys, types,
                                                         ranges or choices are out of date

Only definitions.{controller,worker,lifecycle,gateway}Config are generated; the rest of the schema is
written by hand. Keys the chart sets itself (CHART_OWNED) are left out, so values cannot
override them by accident.
"""
import difflib
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = os.path.join(ROOT, "helm", "pie", "values.schema.json")

# Keys the chart renders from other values or sets per pod (docs/deploy.md, "Chart-owned keys").
COMMON_OWNED = {"server.listen", "metrics.listen", "auth.token", "auth.token_file"}
CHART_OWNED = {
    "controller": COMMON_OWNED,
    "lifecycle": COMMON_OWNED | {"controller.address", "replica.id", "replica.advertise",
                                 "tenants.dir"},
    # memory.policy and memory.host_pool: from worker.memory.policy / hostPool (PIE_MEMORY_*);
    # tp.size and tp.port from worker.tensorParallel, tp.rank and tp.leader per pod (PIE_TP_*)
    "worker": COMMON_OWNED | {"controller.address", "worker.group_id", "worker.advertise",
                              "model.name", "model.path", "memory.policy", "memory.host_pool",
                              "tp.size", "tp.port", "tp.rank", "tp.leader"},
    # The gateway holds no token (auth.* stays unset: it forwards each client's key).
    "gateway": COMMON_OWNED | {"http.listen", "lifecycle.address"},
}

SIZE_UNITS = "B|KiB|MiB|GiB|TiB|Ki|Mi|Gi|Ti|kB|KB|MB|GB|TB"
DURATION_UNITS = "ms|s|m|h"


def parse_help(text, svc):
    """Rows of a --help-config Markdown table: (key, env, type, default, description)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 5:
            sys.exit(f"gen-values-schema: pie-{svc}: unexpected row: {line}")
        key, env, typ, default, desc = (c.replace("\\|", "|") for c in cells)
        rows.append((key.strip("`"), env.strip("`"), typ, default, desc))
    if not rows:
        sys.exit(f"gen-values-schema: pie-{svc} --help-config printed no keys")
    return rows


def type_schema(typ, key):
    m = re.fullmatch(r"(.*?)(?: in \[(.*), (.*)\])?", typ)
    base, lo, hi = m.group(1), m.group(2), m.group(3)
    if base == "string":
        return {"type": "string"}
    if base in ("integer", "non-negative integer"):
        out = {"type": "integer"}
        if base == "non-negative integer":
            out["minimum"] = 0
        if lo is not None:
            out["minimum"], out["maximum"] = int(lo), int(hi)
        return out
    if base == "number":
        out = {"type": "number"}
        if lo is not None:
            out["minimum"], out["maximum"] = float(lo), float(hi)
        return out
    if base == "bool":
        return {"type": "boolean"}
    if base == "size":
        # The range is checked by the service at start (units make it awkward in JSON Schema).
        return {"type": ["string", "integer"], "minimum": 0,
                "pattern": f"^[0-9]+({SIZE_UNITS})?$"}
    if base == "duration":
        return {"type": ["string", "integer"], "minimum": 0,
                "pattern": f"^[0-9]+({DURATION_UNITS})?$"}
    if base.startswith("one of "):
        return {"enum": [c.strip() for c in base[len("one of "):].split(",")]}
    if base == "list of strings":
        return {"type": "array", "items": {"type": "string"}}
    sys.exit(f"gen-values-schema: {key}: unknown type '{typ}' (teach type_schema about it)")


def config_schema(svc, rows):
    root = {"type": "object", "additionalProperties": False, "properties": {},
            "description": f"pie-{svc} configuration (docs/configuration.md) without the keys "
                           f"the chart sets: {', '.join(sorted(CHART_OWNED[svc]))}."}
    for key, env, typ, default, desc in rows:
        if key in CHART_OWNED[svc]:
            continue
        node = root
        parts = key.split(".")
        for p in parts[:-1]:
            node = node["properties"].setdefault(
                p, {"type": "object", "additionalProperties": False, "properties": {}})
        leaf = type_schema(typ, key)
        shown = default.strip("`") or '""'
        leaf["description"] = f"{desc} (type: {typ}; default: {shown}; {env})"
        node["properties"][parts[-1]] = leaf
    return root


def strip_descriptions(node):
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main():
    args = sys.argv[1:]
    check = bool(args) and args[0] == "--check"
    if check:
        args = args[1:]
    if len(args) != 1:
        sys.exit("usage: gen-values-schema.py [--check] BIN_DIR")
    bindir = args[0]
    with open(SCHEMA, encoding="utf-8") as f:
        current_text = f.read()
    schema = json.loads(current_text)
    for svc in ("controller", "worker", "lifecycle", "gateway"):
        out = subprocess.run([os.path.join(bindir, f"pie-{svc}"), "--help-config"],
                             check=True, capture_output=True, text=True).stdout
        schema["definitions"][f"{svc}Config"] = config_schema(svc, parse_help(out, svc))
    new_text = json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
    if check:
        # Keys, types, ranges and choices must match; a reworded description need not fail
        # the tests (regenerating picks it up).
        cur = json.dumps(strip_descriptions(json.loads(current_text)), indent=2) + "\n"
        new = json.dumps(strip_descriptions(schema), indent=2) + "\n"
        if new != cur:
            sys.stdout.writelines(difflib.unified_diff(
                cur.splitlines(True), new.splitlines(True),
                "helm/pie/values.schema.json (without descriptions)", "generated"))
            print("helm/pie/values.schema.json is out of date: run "
                  "tests/deploy/gen-values-schema.py build/bin", file=sys.stderr)
            return 1
        print("helm/pie/values.schema.json config sections are up to date")
        return 0
    if new_text != current_text:
        with open(SCHEMA, "w", encoding="utf-8") as f:
            f.write(new_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
