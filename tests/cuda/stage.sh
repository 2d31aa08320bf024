#!/usr/bin/env bash
# tests/cuda/stage.sh — builds the CUDA test binaries here and packs them for a lent GPU machine.
#
# The GPU machine has the CUDA toolkit and driver but not the Debian libraries the binaries link
# (Criterion, OpenBLAS, jansson, ...) and cannot install any. This script builds the GPU-side
# binaries in build-cuda (RelWithDebInfo: -lineinfo for compute-sanitizer and ncu), copies them
# with every shared library they need that is neither glibc's, the C++ runtime's, OpenSSL's nor
# cuBLAS's or NCCL's (the GPU machine has those: libnccl.so.2 is 218 MB, and the binaries find
# the machine's own through LD_LIBRARY_PATH, device_check.sh) and the test models into
# .devrun/stage, and writes
# .devrun/stage.tar.xz (~30 MB). tests/cuda/device_check.sh unpacks and runs it there:
#   tests/cuda/stage.sh
#   device run, carry [".devrun/stage.tar.xz"]:  OUT=$OUT bash tests/cuda/device_check.sh device krn eng ...
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
bin_targets=(unit_test_krn_cuda_device unit_test_krn_cuda unit_test_eng_cuda unit_test_eng_cuda_fault unit_test_eng_cuda_swap unit_test_eng_cuda_offload
             unit_test_eng_cuda_nccl pie-cuda-run bench_cuda bench_gemm pie-controller pie-worker piectl)

# PIE_NCCL=OFF stages binaries that do not link libnccl (for a GPU machine without NCCL)
cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIE_CUDA=ON -DPIE_NCCL="${PIE_NCCL:-ON}" \
      -DCMAKE_CUDA_ARCHITECTURES="${PIE_CUDA_ARCHS:-90}" >/dev/null
cmake --build build-cuda -j"$(nproc)" --target "${bin_targets[@]}" pie_test_models >/dev/null

st=.devrun/stage
rm -rf "$st" .devrun/stage.tar.xz
mkdir -p "$st/bin" "$st/lib" "$st/models"
for t in "${bin_targets[@]}"; do
  f=$(find build-cuda/tests build-cuda/bench build-cuda/bin -maxdepth 1 -type f -name "$t" | head -n 1)
  [ -n "$f" ] || { echo "stage: $t was not built" >&2; exit 1; }
  cp "$f" "$st/bin/"
done
for m in small-bf16 small-f32 tiny-bf16 tiny-f32; do cp -r "build-cuda/models/$m" "$st/models/"; done
for b in "$st"/bin/*; do ldd "$b"; done | awk '/=>/ {print $3}' | sort -u |
  grep -vE '/lib(c|m|pthread|dl|rt|resolv|gcc_s|stdc\+\+|crypto|ssl|cublas|cublasLt|nccl)\.so' |
  while read -r lib; do cp -L "$lib" "$st/lib/"; done
if ls "$st/lib" | grep -q nccl; then echo "stage: libnccl must not be packed" >&2; exit 1; fi
tar -C .devrun -cf - stage | xz -6 -T"$(nproc)" >.devrun/stage.tar.xz
grep -qx '/.devrun/' .git/info/exclude 2>/dev/null || echo '/.devrun/' >>.git/info/exclude
echo "stage: $(du -h .devrun/stage.tar.xz | cut -f1) in .devrun/stage.tar.xz ($(ls "$st/bin" | wc -l) binaries, $(ls "$st/lib" | wc -l) libraries)"
