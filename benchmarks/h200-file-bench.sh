#!/usr/bin/env bash
# Issue 14 item 5 on the lent H200: one step35 GGUF of the flagship cut to 12 layers (3 dense +
# 9 MoE, 288 NVFP4 experts, BF16 rest, full vocabulary), memra and llama.cpp (CUDA) on it.
# Writes the file with `memra convert synth` (random NVFP4 codes: seconds, not the quantizer's
# minutes), builds llama.cpp's llama-bench for CUDA sm_90 from the llama-cpp-python 0.3.36 sdist's
# vendor/llama.cpp (carried as .gpumodel/llama-src.tgz) meanwhile, then runs `memra bench file`.
# Usage (on the device): MEMRA_COMMIT=<this checkout's commit> bash benchmarks/h200-file-bench.sh   (results under $OUT;
# the device copy's .git may be stale, so the commit is passed in)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PATH=/usr/local/cuda/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
F=/tmp/step35-12l-nvfp4.gguf
LB=/tmp/llama/build/bin/llama-bench
if [ ! -x "$LB" ] && [ -f .gpumodel/llama-src.tgz ]; then
  ( mkdir -p /tmp/llama && tar xzf .gpumodel/llama-src.tgz -C /tmp/llama \
    && t0=$(date +%s) \
    && cmake -S /tmp/llama/llama.cpp -B /tmp/llama/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
         -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
         -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
         -DLLAMA_BUILD_EXAMPLES=OFF > "$OUT/llama-cmake.log" 2>&1 \
    && cmake --build /tmp/llama/build --target llama-bench -j 12 > "$OUT/llama-build.log" 2>&1 \
    && echo "llama.cpp CUDA build: $(( $(date +%s) - t0 )) s" ) > "$OUT/llama-build-time.txt" 2>&1 &
  BUILD=$!
fi
if [ ! -f "$F" ]; then
  /usr/bin/time -v python3 -m memra convert synth --geometry full --layers 12 --dense-layers 3 --mtp-layers 0 \
    --format gguf-nvfp4 --expert-codes random --out "$F" 2> "$OUT/synth-time.log" | tee "$OUT/synth.log"
  grep -E "Elapsed|Maximum resident" "$OUT/synth-time.log"
fi
ls -la "$F"
if [ -n "${BUILD:-}" ]; then wait $BUILD; cat "$OUT/llama-build-time.txt"; tail -3 "$OUT/llama-build.log"; fi
python3 -X importtime -c "import memra.engine.engine, memra.bench.file; from memra import LLM" 2> "$OUT/importtime.log"
ARGS=()
[ -x "$LB" ] && ARGS=(--llama-bench "$LB")
python3 -m memra bench file "$F" "${ARGS[@]}" --json-out "$OUT/file-bench-h200.json" "$@" 2>&1 | tee "$OUT/file-bench.log"
