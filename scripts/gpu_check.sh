#!/usr/bin/env bash
# The GPU path on a CUDA machine, in at most 8 minutes (GPU_CHECK_BUDGET_S): installs vLLM (the
# `gpu` extra, pinned in pyproject.toml) into its own virtualenv .venv-gpu with gapless itself,
# runs the GPU tests (the generator contract over the vLLM engine, then tests/unit/test_vllm_engine.py,
# each in its own process: one vLLM engine per process) and the Qwen2.5-0.5B-shape generation
# benchmark (bench/real_shapes.py --device cuda), and prints one JSON line:
#   {"ok": bool, "stage": where it stopped, "contract_rc", "vllm_tests_rc", "bench": {...}, "wall_s"}
# Exit status 0 only when everything passed. Without a CUDA device it says so and exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
VENV=${GPU_VENV:-.venv-gpu}
START=$SECONDS
LOG=$(mktemp -d)
left() { echo $(( BUDGET_S - (SECONDS - START) )); }
report() {  # report OK STAGE [key=value ...]: the one JSON line
  python3 - "$@" <<'PY'
import json, sys
ok, stage, *pairs = sys.argv[1:]
out = {"ok": ok == "1", "stage": stage}
for pair in pairs:
    key, _, value = pair.partition("=")
    try:
        out[key] = json.loads(value)
    except ValueError:
        out[key] = value
print(json.dumps(out))
PY
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  report 0 device "reason=no CUDA device (nvidia-smi finds none)" "wall_s=$((SECONDS - START))"; exit 1
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

if ! "$VENV/bin/python" -c "import vllm, gapless" >/dev/null 2>&1; then
  VLLM_PIN=$(grep -o 'vllm==[0-9.]*' pyproject.toml | head -1)
  { [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"; } &&
  timeout "$(left)" "$VENV/bin/python" -m pip install -q "$VLLM_PIN" pytest >"$LOG/install.txt" 2>&1 &&
  # gapless without its CPU torch pin: vLLM's CUDA torch stays
  timeout "$(left)" "$VENV/bin/python" -m pip install -q --no-deps -e . >>"$LOG/install.txt" 2>&1
  if ! "$VENV/bin/python" -c "import vllm, gapless" >/dev/null 2>&1; then
    report 0 install "gpu=$GPU" "reason=could not install $VLLM_PIN (no package index reachable?): $(tail -1 "$LOG/install.txt" | tr '"' "'")" \
      "wall_s=$((SECONDS - START))"; exit 1
  fi
fi
PY="$VENV/bin/python"
export PYTHONPATH=src

timeout "$(( $(left) / 3 ))" "$PY" -m pytest -q -m vllm tests/unit/test_generator_contract.py >"$LOG/contract.txt" 2>&1
CONTRACT_RC=$?
timeout "$(( $(left) / 2 ))" "$PY" -m pytest -q -m vllm tests/unit/test_vllm_engine.py >"$LOG/vllm_tests.txt" 2>&1
VLLM_RC=$?
timeout "$(left)" "$PY" bench/real_shapes.py --device cuda --shapes qwen2.5-0.5b >"$LOG/bench.txt" 2>&1
BENCH_RC=$?
BENCH=$(tail -1 "$LOG/bench.txt")
python3 -c 'import json,sys; json.loads(sys.argv[1])' "$BENCH" 2>/dev/null || BENCH='null'
OK=$([ $CONTRACT_RC = 0 ] && [ $VLLM_RC = 0 ] && [ $BENCH_RC = 0 ] && echo 1 || echo 0)
report "$OK" done "gpu=$GPU" "contract_rc=$CONTRACT_RC" "contract=$(tail -1 "$LOG/contract.txt" | tr '"' "'")" \
  "vllm_tests_rc=$VLLM_RC" "vllm_tests=$(tail -1 "$LOG/vllm_tests.txt" | tr '"' "'")" "bench_rc=$BENCH_RC" "bench=$BENCH" \
  "wall_s=$((SECONDS - START))"
[ "$OK" = 1 ]
