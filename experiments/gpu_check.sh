#!/usr/bin/env bash
# The first command of a session lent a GPU (issue 30): every experiments.gpu_check
# section in one call, within 8 minutes of device time. Through the device tool:
#   run(command="bash experiments/gpu_check.sh", timeout_s=540)
# It writes experiments/results/gpu_check_<card>.json (commit it) and a copy under $OUT
# (what comes back), the JSON after every section; rows past --budget-s are skipped and
# the hard timeout stops a last row that overruns. Extra arguments go to gpu_check
# (e.g. --sections llm_blocks,variants).
set -euo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
out="experiments/results/gpu_check_${card:-gpu}.json"
mkdir -p experiments/results "${OUT:-/tmp}"
status=0
PYTHONUNBUFFERED=1 timeout 480 python3 -m experiments.gpu_check --budget-s 400 --json "$out" "$@" \
  2>&1 | tee "${OUT:-/tmp}/gpu_check.log" || status=$?
cp "$out" "${OUT:-/tmp}/" 2>/dev/null || true
exit "$status"
