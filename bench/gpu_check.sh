#!/usr/bin/env bash
# GPU check of the kernels and the engine, as one command for a fresh machine with one NVIDIA GPU:
#
#   bash bench/gpu_check.sh          # report -> $OUT if set, else bench/out/
#
# It does NOT run scripts/bootstrap.sh, which would install the CPU build of torch and needs a network.
# It uses the venv that already holds a CUDA torch and triton: $PDSERVE_GPU_PYTHON if set, else the first
# of python3 on PATH (on the GPU image, /opt/torch/.venv), /opt/torch/.venv/bin/python3, python whose
# torch sees CUDA. The repo goes on PYTHONPATH instead of being pip-installed; wheels carried in .whl/
# are installed offline (--no-deps) into a temporary --target directory appended to PYTHONPATH.
#
# Phases: environment, kernels (bench/gpu_check.py: compile, check against references at real sizes,
# decode GB/s against the measured copy bandwidth, pack/unpack against a plain copy), engine parity
# (PDSERVE_TEST_DEVICE=cuda pytest tests/test_engine_parity.py), tensor parallelism over NCCL (2 GPUs or
# more: tests/test_tensor_parallel.py, tests/test_kv_reshard.py, bench/tp_bench.py --device cuda), report. Each phase has a time limit
# (all together well under 8 minutes); a failing phase is recorded and the next one still runs.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/bench/out}"
mkdir -p "$out"
t_start=$(date +%s)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# PDSERVE_GPU_CHECK_SMOKE="--quick --device cpu" (with TRITON_INTERPRET=1) runs this script's flow on a CPU
# machine with tiny sizes, to test the script itself; it is never needed on the GPU.
[[ -n "${PDSERVE_GPU_CHECK_SMOKE:-}" ]] || unset TRITON_INTERPRET

declare -A result=()
phases=()

log() { echo "[gpu_check $(date +%T) +$(($(date +%s) - t_start))s] $*"; }

# run_phase NAME LIMIT_S LOGFILE CMD... : runs CMD under a time limit, keeps its output in LOGFILE,
# echoes the end of it, and records ok / FAILED in result[NAME]. Never aborts the script.
run_phase() {
  local name=$1 limit=$2 logfile=$3
  shift 3
  phases+=("$name")
  log "phase '$name' (limit ${limit}s, log $(basename "$logfile"))"
  local rc=0
  timeout --kill-after=15 "$limit" "$@" >"$logfile" 2>&1 || rc=$?
  tail -n 60 "$logfile" || true
  if [[ $rc -eq 0 ]]; then
    result[$name]="ok"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    result[$name]="FAILED (timed out after ${limit}s)"
  else
    result[$name]="FAILED (exit $rc)"
  fi
  log "phase '$name': ${result[$name]}"
}

# --- python with CUDA torch + triton --------------------------------------------------------------
cuda_python_ok() {
  "$1" -c 'import os, sys, torch, triton
sys.exit(0 if torch.cuda.is_available() or os.environ.get("PDSERVE_GPU_CHECK_SMOKE") else 1)' >/dev/null 2>&1
}
py=""
for cand in "${PDSERVE_GPU_PYTHON:-}" python3 /opt/torch/.venv/bin/python3 python; do
  [[ -n "$cand" ]] || continue
  command -v "$cand" >/dev/null 2>&1 || continue
  if cuda_python_ok "$cand"; then
    py="$(command -v "$cand")"
    break
  fi
done
phases+=("python")
if [[ -z "$py" ]]; then
  result[python]="FAILED (no python with CUDA torch and triton found; set PDSERVE_GPU_PYTHON)"
  log "${result[python]}"
else
  if compgen -G "$root/.whl/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/pdserve-gpu-site"
    log "installing carried wheels from .whl/ into $site (offline, no deps)"
    if "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --upgrade \
      --target "$site" "$root"/.whl/*.whl; then
      export PYTHONPATH="$PYTHONPATH:$site"
    else
      log "wheel install failed; continuing without them"
    fi
  fi
  result[python]="ok ($py)"
  log "python: $py"
fi

# --- phases ---------------------------------------------------------------------------------------
# the smoke run (a CPU machine) runs each test phase's flow on the CPU (gloo for tensor parallelism)
test_device=cuda tp_bench_args=""
[[ -z "${PDSERVE_GPU_CHECK_SMOKE:-}" ]] || test_device=cpu tp_bench_args="--smoke"
if [[ -n "$py" ]]; then
  run_phase "environment" 30 "$out/env.log" bash -c '
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || nvidia-smi
    else
      echo "nvidia-smi: not found"
    fi
    "$0" -c "import sys, torch, triton; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \
\"cuda\", torch.version.cuda, \"triton\", triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\")"
  ' "$py"
  # shellcheck disable=SC2086  # the smoke-test arguments are meant to split
  run_phase "kernels" 270 "$out/kernels.log" "$py" bench/gpu_check.py --out "$out" ${PDSERVE_GPU_CHECK_SMOKE:-}
  if [[ -f tests/test_engine_parity.py ]]; then
    run_phase "engine parity" 120 "$out/parity.log" env PDSERVE_TEST_DEVICE=$test_device \
      "$py" -m pytest -q -p no:cacheprovider -o addopts="" -ra tests/test_engine_parity.py
  else
    phases+=("engine parity")
    result["engine parity"]="skipped (tests/test_engine_parity.py not in this checkout)"
  fi
  # Tensor parallelism over NCCL, a GPU a rank: TP 2 against TP 1 (greedy, seeded, logits), the resharded
  # KV transfer (TP 2 pools on two GPUs mapped by CUDA IPC, the channel over NCCL), then bench/tp_bench.py.
  ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [[ $test_device == cpu || $ngpu -ge 2 ]]; then
    run_phase "tensor parallel" 180 "$out/tp.log" env PDSERVE_TEST_DEVICE=$test_device bash -c '
      "$0" -m pytest -q -p no:cacheprovider -o addopts="" -ra tests/test_tensor_parallel.py tests/test_kv_reshard.py \
        && "$0" bench/tp_bench.py --device "$1" $2' "$py" "$test_device" "$tp_bench_args"
  else
    phases+=("tensor parallel")
    result["tensor parallel"]="skipped (TP over NCCL needs 2 GPUs; $ngpu visible)"
  fi
else
  for name in environment kernels "engine parity" "tensor parallel"; do
    phases+=("$name")
    result[$name]="skipped (no CUDA python)"
  done
fi

# --- report ---------------------------------------------------------------------------------------
report="$out/gpu_report.md"
{
  echo "# pdserve GPU check"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), \
$(($(date +%s) - t_start)) s in all."
  [[ -f "$out/env.log" ]] && { echo; echo '```'; cat "$out/env.log"; echo '```'; }
  echo
  echo "| phase | result |"
  echo "| --- | --- |"
  for name in "${phases[@]}"; do echo "| $name | ${result[$name]} |"; done
  echo
  if [[ -f "$out/kernels.md" ]]; then
    cat "$out/kernels.md"
  elif [[ -f "$out/kernels.log" ]]; then
    echo "## Kernels: no report written; end of log"; echo; echo '```'; tail -n 80 "$out/kernels.log"; echo '```'
  fi
  if [[ -f "$out/parity.log" ]]; then
    echo; echo "## Engine parity on the GPU (end of log)"; echo; echo '```'; tail -n 40 "$out/parity.log"; echo '```'
  fi
  if [[ -f "$out/tp.log" ]]; then
    echo; echo "## Tensor parallelism (end of log)"; echo; echo '```'; tail -n 30 "$out/tp.log"; echo '```'
  fi
} >"$report"
log "report: $report"
cat "$report"

for name in "${phases[@]}"; do
  [[ ${result[$name]} == ok* || ${result[$name]} == skipped* ]] || exit 1
done
exit 0
