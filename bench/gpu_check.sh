#!/usr/bin/env bash
# The GPU check of issue #25, in one short run (about 8 minutes at most) on a machine with an
# NVIDIA GPU: the cuda params of the device-parametrised tests (every monitor, the dump, the
# metrics, the callbacks; no host synchronisation inside a monitored step; NCCL with 2+ GPUs),
# then the GPU benchmarks with small sizes (bench_paired.py --device cuda, bench_fused_stats.py
# --device cuda). Results go to $OUT (or ./gpu_check_out): pytest.log, junit.xml,
# bench_paired_cuda.md, bench_fused_stats_cuda.txt, env.txt.
#
# Installs nothing when a Python with a CUDA build of torch is found ($PYTHON, .venv/bin/python,
# python3, in that order). Otherwise, with TORCH_SPEC set (e.g. TORCH_SPEC=torch), it installs
# that torch into .venv first (network needed); without it, it stops and says why.
#
#   bash bench/gpu_check.sh                      # on a GPU box
#   OUT=/tmp/results bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

PY=""
for candidate in ${PYTHON:-} .venv/bin/python python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    echo "no Python with a CUDA build of torch: installing $TORCH_SPEC into .venv"
    test -x .venv/bin/python || python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade --force-reinstall "$TORCH_SPEC" numpy pytest && PY=.venv/bin/python
  fi
  if [ -z "$PY" ] || ! has_cuda "$PY"; then
    echo "gpu_check: no CUDA device usable from Python (torch.cuda.is_available() is False everywhere);" \
         "run on a GPU machine, or set TORCH_SPEC to install a CUDA build of torch" | tee "$OUT_DIR/env.txt"
    exit 2
  fi
fi

{
  echo "python: $PY"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  git rev-parse HEAD 2>/dev/null || true
} | tee "$OUT_DIR/env.txt"

status=0
if "$PY" -c "import pytest" 2>/dev/null; then
  echo "== tests (cuda params) =="
  timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT_DIR/junit.xml" \
    -k "cuda or nccl or device_row or device_tensors" \
    tests/test_device_e2e.py tests/test_device_copy.py tests/test_device_nccl.py tests/test_stats.py \
    tests/test_dump_checksums.py 2>&1 | tee "$OUT_DIR/pytest.log"
  status=${PIPESTATUS[0]}
else
  echo "pytest is not installed for $PY: tests skipped (pip install pytest)" | tee "$OUT_DIR/pytest.log"
  status=3
fi

echo "== bench_paired --device cuda =="
timeout 150 "$PY" bench/bench_paired.py --device cuda --model gpu --pairs 8 --warmup 2 \
  --configs control,v2-weight_grad,v2-wg+opt+param,floor,v2-module,v1-wg+mv+param,dump-L0 \
  2>&1 | tee "$OUT_DIR/bench_paired_cuda.md"

echo "== bench_fused_stats --device cuda (eager reductions against torch.compile/Triton) =="
timeout 75 "$PY" bench/bench_fused_stats.py --device cuda --sizes 65536 1048576 16777216 --repeats 3 \
  2>&1 | tee "$OUT_DIR/bench_fused_stats_cuda.txt"

echo "gpu_check: tests exit status $status; results in $OUT_DIR"
exit "$status"
