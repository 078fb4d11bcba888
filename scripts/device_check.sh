#!/usr/bin/env bash
# On a GPU machine: install cupymoe, run the GPU test tier, the examples and the FP8 plans probe
# (which times the trial plans), then the benchmark suite from a wheel install, run outside the
# checkout, with bf16 and with FP8 weights (DEVICE_CHECK_SUITES="bf16" for one), then the FP8 suite
# with each plan named in DEVICE_CHECK_FP8_PLANS forced (e.g. "PERSISTENT_FP8_128": a
# trial plan's A/B in the same call). Logs, the suites' JSON and plots go to $OUT (default
# /tmp/cupymoe-device). One call does it all.
set -uo pipefail
out="${OUT:-/tmp/cupymoe-device}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 2

python3 -m pip install --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

echo "== GPU tests"
python3 -m pytest -q tests -m gpu -p no:cacheprovider --durations=8 ${DEVICE_CHECK_K:+-k "$DEVICE_CHECK_K"} \
  >"$out/pytest-gpu.log" 2>&1
tests_rc=$?
tail -n 20 "$out/pytest-gpu.log"

echo "== examples"
for example in quickstart.py torch_interop.py jax_interop.py family_block.py "family_block.py --fp8"; do
  echo "-- $example"
  python3 examples/$example 2>&1 | tail -n 4
done | tee "$out/examples.log"

echo "== FP8 plans and trial plans (plans.FP8_TRIAL_PLANS), forced: ms, bits equal"
python3 benchmarks/probes/fp8_plans.py --tokens 1 64 512 4096 8192 --reps 5 2>&1 | tee "$out/fp8-plans.log" | tail -n 6

echo "== benchmark suite, from a wheel install, outside the checkout"
python3 -m pip install --no-deps --no-build-isolation . >>"$out/pip.log" 2>&1 || { tail "$out/pip.log"; exit 1; }
bench_rc=0
for weights in ${DEVICE_CHECK_SUITES:-bf16 fp8}; do
  (cd /tmp && python3 -c 'import cupymoe; print("cupymoe from", cupymoe.__file__)' &&
   python3 -m cupymoe.bench --weights "$weights" --out "$out") >"$out/suite-$weights.log" 2>&1 || bench_rc=$?
  grep -v '^\[' "$out/suite-$weights.log" | tail -n 30
done
for plan in ${DEVICE_CHECK_FP8_PLANS:-}; do
  (cd /tmp && python3 -m cupymoe.bench --weights fp8 --plan "$plan" --no-peer --out "$out") \
    >"$out/suite-fp8-$plan.log" 2>&1 || bench_rc=$?
  grep -v '^\[' "$out/suite-fp8-$plan.log" | tail -n 20
done

echo "== exit codes: tests $tests_rc, suite $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
