#!/usr/bin/env bash
# Run the GPU code under compute-sanitizer's memcheck, racecheck, synccheck and initcheck.
#
# Usage: scripts/sanitize.sh [TOOL ...]        (default: all four tools, one after the other)
#
# Each tool runs the GPU tests marked `sanitize` (`pytest -m "gpu and sanitize" tests`: the small
# shapes of every stage, every tile plan forced, and the benchmark's workload at T up to 512), with
# CuPy's memory pool off so that every array is its own cudaMalloc (memcheck sees exact bounds,
# initcheck fresh memory). One line per tool is printed, e.g. "memcheck: 0 errors"; the whole
# output goes to $OUT/sanitize-<tool>.log. Exits 1 unless every tool reports 0 errors and every run
# exits 0.
#
# Environment:
#   COMPUTE_SANITIZER  the compute-sanitizer binary; by default the first found on PATH, in
#                      $CUDA_HOME/bin, /usr/local/cuda/bin, or inside the nvidia-cuda-sanitizer-api
#                      wheel installed for $PYTHON
#   PYTHON             the interpreter (default python3)
#   OUT                the folder for the logs (default /tmp)
#   SANITIZE_K         a pytest -k expression to narrow the tests, e.g. "persistent or plan"
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
LOG_DIR=${OUT:-/tmp}
ALL_TOOLS=(memcheck racecheck synccheck initcheck)
if [ $# -gt 0 ]; then TOOLS=("$@"); else TOOLS=("${ALL_TOOLS[@]}"); fi
for tool in "${TOOLS[@]}"; do
  case " ${ALL_TOOLS[*]} " in
    *" $tool "*) ;;
    *) echo "unknown tool '$tool': expected one of ${ALL_TOOLS[*]}" >&2; exit 2 ;;
  esac
done

find_sanitizer() {
  if [ -n "${COMPUTE_SANITIZER:-}" ]; then
    echo "$COMPUTE_SANITIZER"
    return
  fi
  if command -v compute-sanitizer >/dev/null 2>&1; then
    command -v compute-sanitizer
    return
  fi
  local dir
  for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    if [ -n "$dir" ] && [ -x "$dir/bin/compute-sanitizer" ]; then
      echo "$dir/bin/compute-sanitizer"
      return
    fi
  done
  # pip's nvidia-cuda-sanitizer-api: nvidia/cu13/compute-sanitizer/ or nvidia/cuda_sanitizer_api/compute-sanitizer/
  "$PYTHON" - <<'EOF'
import glob, os, site, sys
for base in sys.path + site.getsitepackages() + [site.getusersitepackages()]:
    found = sorted(glob.glob(os.path.join(base, "nvidia", "*", "compute-sanitizer", "compute-sanitizer")))
    if found:
        print(found[-1])
        break
EOF
}

SANITIZER=$(find_sanitizer)
if [ -z "$SANITIZER" ] || [ ! -x "$SANITIZER" ]; then
  echo "compute-sanitizer not found: install the CUDA toolkit or 'pip install nvidia-cuda-sanitizer-api'" \
       "(nvidia-cuda-sanitizer-api-cu12 for CUDA 12), or set COMPUTE_SANITIZER" >&2
  exit 2
fi
OPTIONS=(--error-exitcode 1)
# CUDA's own lookups of driver entry points that this driver lacks are not errors of ours.
if "$SANITIZER" --help 2>&1 | grep -q -- --ignore-getprocaddress-notfound; then
  OPTIONS+=(--ignore-getprocaddress-notfound)
fi

mkdir -p "$LOG_DIR"
echo "$("$SANITIZER" --version 2>&1 | grep -i version | head -n 1) ($SANITIZER)"

# Run one command under one tool, appending to the log; return its exit status.
sanitize() {
  local tool=$1 log=$2
  shift 2
  echo "+ compute-sanitizer --tool $tool ${OPTIONS[*]} $*" >>"$log"
  "$SANITIZER" --tool "$tool" "${OPTIONS[@]}" "$@" >>"$log" 2>&1
}

failed=0
for tool in "${TOOLS[@]}"; do
  log="$LOG_DIR/sanitize-$tool.log"
  : >"$log"
  start=$SECONDS
  runs=1
  status=0
  CUPYMOE_TEST_NO_POOL=1 sanitize "$tool" "$log" "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu and sanitize" \
    ${SANITIZE_K:+-k "$SANITIZE_K"} tests || status=$?
  # racecheck ends a run with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)",
  # the other tools with "ERROR SUMMARY: E errors".
  found=$(grep -Ec '(ERROR|RACECHECK) SUMMARY' "$log")
  errors=$( (grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | awk '{ print $3 }'
             grep -Eo 'RACECHECK SUMMARY: .*\([0-9]+ error' "$log" | grep -Eo '[0-9]+ error$' | awk '{ print $1 }') |
            awk '{ n += $1 } END { print n + 0 }')
  hazards=$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazard' "$log" | awk '{ n += $3 } END { print n + 0 }')
  line="$tool: $errors errors"
  [ "$hazards" -gt 0 ] && line="$line, $hazards race hazards"
  if [ "$found" -lt "$runs" ]; then
    line="$line (only $found of $runs runs printed a summary)"
  fi
  echo "$line (exit $status, $((SECONDS - start)) s, log $log)"
  if [ "$errors" -ne 0 ] || [ "$hazards" -ne 0 ] || [ "$found" -lt "$runs" ] || [ "$status" -ne 0 ]; then
    failed=1
    tail -n 30 "$log" | sed 's/^/    /'
  fi
done
exit "$failed"
