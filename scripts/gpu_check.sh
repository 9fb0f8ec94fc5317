#!/usr/bin/env bash
# The GPU test run: the CUDA variants of the collective features (tests/gpu) and the heter
# worker's GPU device guard, on a machine with at least one NVIDIA GPU. Elsewhere every test
# skips ("needs a CUDA GPU"). The log goes to ${OUT:-/tmp}/gpu_tests.log; the exit status is
# pytest's (non-zero when a test failed).
#
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="${OUT:-/tmp}/gpu_tests.log"
mkdir -p "$(dirname "$LOG")"

# The parameter server's C kernels; without them it falls back to numpy (slower, same results).
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 \
    || echo "note: the C extension did not build; the parameter server uses numpy"

{
    python3 - <<'PY'
import torch
print("torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
PY
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
} 2>&1 | tee "$LOG"

# A per-test timeout only where the pytest-timeout plugin is installed.
TIMEOUT=()
if python3 -c "import pytest_timeout" 2>/dev/null; then
    TIMEOUT=(-p timeout --timeout 120)
fi

python3 -m pytest -q -p no:cacheprovider "${TIMEOUT[@]}" -m "gpu or not slow" \
    tests/gpu tests/distributed/test_ps_heter_link.py -rs 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
echo "gpu_check: pytest exit status $status (log: $LOG)"
exit "$status"
