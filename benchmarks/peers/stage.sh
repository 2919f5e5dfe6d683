#!/usr/bin/env bash
# Stage llama.cpp's source for a GPU machine that reaches no registry: from the llama-cpp-python sdist (which
# vendors llama.cpp), pack what a build of llama-bench and llama-batched-bench needs into OUT/llama.cpp.tar.xz
# (about 4 MB; the device's carry limit is 64 MiB, the whole sdist is 76 MB), with OUT/COMMIT naming the llama.cpp
# commit the sdist vendors (its CHANGELOG's entry for that version).
#
#   benchmarks/peers/stage.sh [SDIST] [OUT]     # OUT defaults to .peers (git-ignored); then carry it
#
# Without SDIST, `pip download` fetches llama-cpp-python's sdist (LLAMA_CPP_PYTHON=0.3.36 unless set).
# Left out: tools/server and tools/ui (a web server), ggml backends other than the CPU's and CUDA's, tests,
# docs, models, examples. build.sh, beside this file, builds it.
set -euo pipefail
SDIST=${1:-}
OUT=${2:-.peers}
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$SDIST" ]; then
    python3 -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$work" >&2
    SDIST=$(ls "$work"/llama_cpp_python-*.tar.gz)
fi
[ -f "$SDIST" ] || { echo "error: $SDIST: no such sdist; give llama-cpp-python's .tar.gz, or nothing to download it" >&2; exit 1; }
tar -xzf "$SDIST" -C "$work"
root=$(ls -d "$work"/llama_cpp_python-*/)
src="$root/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "error: $SDIST vendors no llama.cpp (no vendor/llama.cpp/CMakeLists.txt)" >&2; exit 1; }
version=$(basename "$root" | sed 's/^llama_cpp_python-//')
commit=$(awk -v v="## [$version]" '$0 == v {found = 1; next} found && /^## \[/ {exit} found && /llama.cpp@/ {
    sub(/.*llama.cpp@/, ""); print $1; exit}' "$root/CHANGELOG.md")
for backend in "$src"/ggml/src/ggml-*/; do
    case $(basename "$backend") in ggml-cpu|ggml-cuda) ;; *) rm -rf "$backend" ;; esac
done
rm -rf "$src/tools/server" "$src/tools/ui"
mkdir -p "$OUT"
parts=()
for part in CMakeLists.txt cmake common ggml include src tools vendor gguf-py licenses; do
    [ -e "$src/$part" ] && parts+=("$part")
done
tar -C "$src" -cJf "$work/llama.cpp.tar.xz" "${parts[@]}"
mv "$work/llama.cpp.tar.xz" "$OUT/llama.cpp.tar.xz"
echo "llama.cpp ${commit:-unknown} (vendored by llama-cpp-python $version)" > "$OUT/COMMIT"
echo "staged $OUT/llama.cpp.tar.xz ($(du -h "$OUT/llama.cpp.tar.xz" | cut -f1)): $(cat "$OUT/COMMIT")"
