#!/bin/sh
# deploy/docker/runtime-deps.sh — prints, one per line, the distribution packages that provide
# the shared libraries the given binaries load (ldd → dpkg -S). The build stages of
# deploy/docker/Dockerfile run it so each runtime stage installs exactly the libraries its
# binaries were linked against, from the same distribution release, instead of a hand-kept list
# of sonames that drifts when the code gains a dependency.
#
# Libraries under /usr/local/cuda* (cudart, cuBLAS, NCCL) are left out: the CUDA runtime base
# image of the worker provides them. Fails (exit 1) when a library belongs to no package or is
# not found at all, so a runtime image never silently lacks one.
# Usage: runtime-deps.sh BINARY...
set -eu
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
tmp=$(mktemp)
trap 'rm -f "$tmp" "$tmp.libs" "$tmp.paths" "$tmp.owners" "$tmp.pkgs"' EXIT
for bin in "$@"; do
    out=$(ldd "$bin") || { echo "runtime-deps: ldd $bin failed" >&2; exit 1; }
    if echo "$out" | grep -q 'not found'; then
        echo "runtime-deps: $bin: unresolved libraries:" >&2
        echo "$out" | grep 'not found' >&2
        exit 1
    fi
    echo "$out" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' >>"$tmp"
done
sort -u "$tmp" >"$tmp.libs"
# Every spelling of every library path, looked up with one dpkg -S (each call reads the whole
# package database). With merged /usr the database may record either spelling.
: >"$tmp.paths"
while read -r lib; do
    real=$(readlink -f "$lib")
    case "$real" in /usr/local/cuda*) continue ;; esac
    printf '%s\n%s\n%s\n%s\n' "$lib" "$real" "${real#/usr}" "/usr$lib" >>"$tmp.paths"
done <"$tmp.libs"
# "pkg:arch: /path" (or "pkg1, pkg2: /path" for diverted files) -> "/path pkg"
sort -u "$tmp.paths" | xargs -r dpkg -S 2>/dev/null | sed -n 's/^\([^:,]*\)[^ ]*: \(\/.*\)$/\2 \1/p' >"$tmp.owners" || true
: >"$tmp.pkgs"
while read -r lib; do
    real=$(readlink -f "$lib")
    case "$real" in /usr/local/cuda*) continue ;; esac
    pkg=""
    for p in "$lib" "$real" "${real#/usr}" "/usr$lib"; do
        pkg=$(awk -v p="$p" '$1 == p { print $2; exit }' "$tmp.owners")
        [ -z "$pkg" ] || break
    done
    [ -n "$pkg" ] || { echo "runtime-deps: no package provides $lib ($real)" >&2; exit 1; }
    echo "$pkg" >>"$tmp.pkgs"
done <"$tmp.libs"
sort -u "$tmp.pkgs" | grep -v -E '^(cuda-|libcublas|libnccl|libcudnn)' || true
