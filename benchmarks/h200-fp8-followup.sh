#!/usr/bin/env bash
# Prepared H200 call (memra/kernels/NOTES.md, 2026-12-05): re-tune every FP8 decode shape with the
# fp16x2 candidates, merge the table, then time the --attention-weights fp8 flagship step with the
# new table and with the committed one. Carry .wheels. (The overlap's bit-identity test runs with
# benchmarks/h200-gpu-tests.sh; its A/B is `memra bench decode` with and without --shared-overlap.)
# Usage (on the device): bash benchmarks/h200-fp8-followup.sh   (writes under $OUT)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cp memra/kernels/gemv_configs.json /tmp/gemv-configs-committed.json
timeout 330 python3 -m memra bench census --formats fp8 --t 1,2,4 --tune --moe-t '' \
    --table-out "$OUT/fp8-table.json" --json-out "$OUT/census-fp8.json" 2>&1 | tail -64
python3 benchmarks/merge_gemv_table.py "$OUT/fp8-table.json" && cp memra/kernels/gemv_configs.json "$OUT/"
timeout 100 python3 -m memra bench decode --batches 1,4,16,64 --reps 20 --attention-weights fp8 \
    --json-out "$OUT/decode-fp8attn.json" 2>&1 | tail -8
cp /tmp/gemv-configs-committed.json memra/kernels/gemv_configs.json
timeout 100 python3 -m memra bench decode --batches 1,4,16,64 --reps 20 --attention-weights fp8 \
    --json-out "$OUT/decode-fp8attn-committed-table.json" 2>&1 | tail -6
