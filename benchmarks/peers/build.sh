#!/usr/bin/env bash
# Build llama-bench and llama-batched-bench from what stage.sh packed: with CUDA where a GPU answers
# nvidia-smi (Hopper: sm_90; LLAMA_CUDA=ON or OFF decides instead), else for the CPU alone (3 minutes on 2 CPUs).
# FlashAttention's CUDA kernels are left out unless LLAMA_CUDA_FA=ON: they double the build time, and llama-bench
# then runs without them (its rows record `flash_attn`; a user's own build would have them).
#
#   benchmarks/peers/build.sh [STAGED] [BUILD]   # STAGED defaults to .peers, BUILD to build/llama.cpp
#                                                # (git-ignored, not carried); prints the binaries' folder last
# The source is unpacked into BUILD/source (same_model.py compiles against it), and STAGED/COMMIT copied to
# BUILD/COMMIT: the build's own commit field (llama-bench's `build_commit`) comes from git, which would otherwise
# answer with the commit of a repository around BUILD (this project's), so git is kept from looking above BUILD.
set -euo pipefail
STAGED=${1:-.peers}
BUILD=${2:-build/llama.cpp}
[ -f "$STAGED/llama.cpp.tar.xz" ] || {
    echo "error: $STAGED/llama.cpp.tar.xz is missing: run benchmarks/peers/stage.sh first" >&2; exit 1; }
src="$BUILD/source"
rm -rf "$src" && mkdir -p "$src" && tar -xJf "$STAGED/llama.cpp.tar.xz" -C "$src"
cp "$STAGED/COMMIT" "$BUILD/COMMIT" 2>/dev/null || echo "llama.cpp (unknown commit: no $STAGED/COMMIT)" > "$BUILD/COMMIT"
export GIT_CEILING_DIRECTORIES
GIT_CEILING_DIRECTORIES=$(cd "$BUILD" && pwd)
cuda=${LLAMA_CUDA:-}  # ON or OFF; unset: ON where a GPU answers nvidia-smi
if [ -z "$cuda" ]; then cuda=OFF; nvidia-smi >/dev/null 2>&1 && cuda=ON; fi
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S "$src" -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=$cuda \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA="${LLAMA_CUDA_FA:-OFF}" -DGGML_CUDA_NCCL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$BUILD" --target llama-bench llama-batched-bench -j "$(nproc)" >&2
echo "$BUILD/bin"
