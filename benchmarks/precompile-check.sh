#!/usr/bin/env bash
# What the start-up precompile (branch precompile-proc) needs before it can be on by default, on the
# lent GPU, in calls of at most 10 minutes (run the stages back to back: the machine stays warm 30 s):
#   stage ab:    benchmarks/precompile_ab.py on the 12-layer step35 GGUF (written first if missing,
#                ~50 s): cold starts with MEMRA_PRECOMPILE=0 and =1, greedy tokens, TTFT, decode,
#                per-kernel prefill time, kernel binaries, and a second plain start as control.
#   stage tests: tests/test_precompile.py's GPU tests.
#   stage suite: the whole `-m gpu` suite with MEMRA_PRECOMPILE=1 (benchmarks/h200-gpu-tests.sh, SHARD=i/n passed on;
#                needs smollm2's GGUF parts sent ahead, see that script).
#   stage file:  `memra bench file` on the same GGUF with MEMRA_PRECOMPILE=1 (cold and warm start),
#                llama.cpp too when /tmp/llama/build/bin/llama-bench exists (h200-file-bench.sh builds it).
# Usage (on the device): MEMRA_COMMIT=<commit> bash benchmarks/precompile-check.sh tests|ab|suite|file
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=${MEMRA_COMMIT:-unknown}
F=/tmp/step35-12l-nvfp4.gguf
gguf() {
  [ -f "$F" ] || timeout 150 python3 -m memra convert synth --geometry full --layers 12 --dense-layers 3 \
    --mtp-layers 0 --format gguf-nvfp4 --expert-codes random --out "$F" 2>&1 | tail -1
}
case "${1:-}" in
  ab)
    gguf
    timeout 450 python3 benchmarks/precompile_ab.py "$F" "$OUT/precompile-ab-12l-$C.json" 2>&1 | tail -40
    echo "precompile_ab exit: $?"
    ;;
  tests)
    PYTHONPATH=/tmp/site:$PWD:$PWD/tests timeout 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
      tests/test_precompile.py 2>&1 | tail -12 | tee "$OUT/precompile-tests-$C.log"
    ;;
  suite)
    MEMRA_PRECOMPILE=1 timeout 580 bash benchmarks/h200-gpu-tests.sh 2>&1 | tail -30
    for f in "$OUT"/gpu-tests*.log; do cp "$f" "${f%.log}-precompile-on-$C.log" 2>/dev/null; done
    ;;
  file)
    gguf
    ARGS=(); [ -x /tmp/llama/build/bin/llama-bench ] && ARGS=(--llama-bench /tmp/llama/build/bin/llama-bench)
    MEMRA_PRECOMPILE=1 timeout 400 python3 -m memra bench file "$F" "${ARGS[@]}" --gen 64 \
      --json-out "$OUT/file-bench-12l-precompile-$C.json" 2>&1 | tail -14
    ;;
  *) echo "usage: $0 tests|ab|suite|file" >&2; exit 2 ;;
esac
