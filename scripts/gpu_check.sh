#!/usr/bin/env bash
# The GPU run, one command: the machine (torch, CUDA, NCCL, nvidia-smi), the C extensions built
# in place, the CUDA tests (tests/gpu and the heter worker's GPU test, each with a timeout), then
# benchmarks/gpu_step.py (the GPT example's tokens/s and model-FLOPs utilisation under fleetx
# beside the same loop in raw PyTorch). Every step has its own time limit inside an overall
# budget of about 8 minutes (the tests at most 5, the benchmark what is left, at most 3.5), so
# the run ends by then whatever hangs.
#
#   bash scripts/gpu_check.sh              # on a machine with an NVIDIA GPU
#   bash scripts/gpu_check.sh --cpu-smoke  # anywhere: the tests skip, the benchmark runs tiny
#
# Without a GPU the tests skip ("needs a CUDA GPU"); the benchmark is skipped too, unless
# --cpu-smoke runs its tiny CPU size to exercise the code. Tests of two NCCL ranks need two
# GPUs and skip with fewer. What comes back, in ${OUT:-/tmp}: gpu_check.log (everything printed),
# gpu_tests.xml (JUnit), gpu_step.json (the benchmark) and gpu_check.json (the environment, the
# test counts, every failed or skipped test with its message, the benchmark's results). Exit
# status: pytest's when a test failed or the test run timed out, else the benchmark's.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
case "${1:-}" in
    --cpu-smoke) SMOKE=1 ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_check.sh [--cpu-smoke]" >&2; exit 2 ;;
esac
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BUDGET_S=480                  # the whole run
TESTS_S=300                   # the test run at most
BENCH_S=210                   # the benchmark at most
BENCH_RESERVE_S=150           # kept for the benchmark while the tests run
HETER_GPU_TEST=tests/distributed/test_ps_heter_link.py::test_on_a_gpu_the_heter_worker_runs_the_section_there_and_trains_alike

# Seconds a step may take: its own cap, or what the budget leaves after `reserve` seconds.
limit() {
    local cap=$1 reserve=$2 left
    left=$(( BUDGET_S - SECONDS - reserve ))
    (( left < cap )) && cap=$left
    (( cap < 10 )) && cap=10
    echo "$cap"
}

environment() {
    echo "== environment"
    timeout 60 python3 scripts/gpu_report.py env || echo "gpu_check: torch did not import"
    echo "cpus: $(nproc), C compiler: $(command -v "${CC:-cc}" || echo none)"
    timeout 30 nvidia-smi 2>&1 || echo "nvidia-smi: not found or failed"
}

build() {
    echo "== C extensions (the PS kernels and the dataset parser; without them numpy runs)"
    local log
    if log=$(timeout 180 python3 setup.py -q build_ext --inplace 2>&1); then
        echo "built in place"
    else
        echo "note: the C extensions did not build; fleetx falls back to numpy (same results)"
        echo "$log" | tail -5
    fi
}

run_tests() {
    echo "== tests (tests/gpu and the heter worker's GPU test)"
    local args=(-p no:cacheprovider -q -rs --durations=25 -m gpu
                --junitxml "$OUT/gpu_tests.xml" tests/gpu "$HETER_GPU_TEST")
    if python3 -c "import pytest_timeout" 2>/dev/null; then
        args+=(--timeout 150)  # a hanging test fails with its traceback; the others still run
    fi
    # CI=true: a test skipped for anything but absent hardware fails (tests/conftest.py)
    local cap status
    cap=$(limit "$TESTS_S" "$BENCH_RESERVE_S")
    CI=true timeout -k 15 "$cap" python3 -m pytest "${args[@]}"
    status=$?
    if (( status == 124 || status == 137 )); then
        echo; echo "gpu_check: the test run passed its ${cap} s limit and was stopped"
    fi
    return "$status"
}

run_benchmark() {
    echo "== benchmark (benchmarks/gpu_step.py)"
    local cap
    cap=$(limit "$BENCH_S" 15)
    if (( SMOKE )); then
        timeout -k 15 "$cap" python3 benchmarks/gpu_step.py --size tiny --device cpu \
            --rounds 2 --steps 1 --warmup 1 --json "$OUT/gpu_step.json"
    elif python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
        # rounds stop starting 60 s before the limit: model building and warm-up come first
        timeout -k 15 "$cap" python3 benchmarks/gpu_step.py --rounds 7 --steps 30 \
            --max-seconds $(( cap - 60 )) --json "$OUT/gpu_step.json"
    else
        echo "no CUDA device: benchmark skipped (--cpu-smoke runs its tiny CPU size)"
    fi
}

main() {
    rm -f "$OUT/gpu_tests.xml" "$OUT/gpu_step.json" "$OUT/gpu_check.json"
    environment
    build
    run_tests
    local tests=$?
    run_benchmark
    local bench=$?
    echo "== summary (${SECONDS} s)"
    timeout 60 python3 scripts/gpu_report.py summary "$OUT" "$tests" "$bench"
    (( tests != 0 )) && return "$tests"
    return "$bench"
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
