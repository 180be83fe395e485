#!/usr/bin/env bash
# GPU checks of the MLA decode kernel and the runtime's decode path, in one go (about 2 minutes on one H200, at most
# 5: the three parts are capped at 130 + 100 + 75 s; the kernel benchmark also tunes more tiles and sweeps split counts).
#
#   OUT=/some/folder scripts/device_kernel_check.sh      (OUT unset: REPO/device-kernel-check; relative: from the
#                                                         caller's folder; -h / --help: this text)
#
# Parts, each under its own timeout so that one failing or hanging part does not stop the others:
#   1. bench_kernel   scripts/bench_mla_decode.py: autotune + kernel vs torch, batch {1,16,64,128} x context
#                     {1K,4K,16K} x (512+64 at 16/128 heads, SmolLM2 144+48 / 64+32 at 9 heads), bf16, a
#                     split-count sweep (batch 16 and 64, context 4K), the small memory-bound cases also timed
#                     inside a model step (30 calls over 30 caches in one graph), and last, time permitting,
#                     the tuning again at the runtime's pages of 16 (the tuned table is keyed by page size)
#   2. pytest_gpu     the `gpu`-marked kernel / runtime tests, plus the tiling tests compiled for the GPU
#   3. bench_runtime  scripts/bench_runtime_decode.py: end-to-end decode tok/s, transformers vs our runtime
# Results in $OUT: bench_mla_decode.{json,md}, bench_runtime_decode.{json,md}, pytest_gpu.{log,xml},
# <part>.log, summary.txt (one line per part: exit code and seconds), versions.txt, device_kernel_check.md
# (all tables).  Needs only torch, triton, transformers, numpy, pytest (no install, no network).
# Render the JSON into BENCHMARKS.md afterwards, on any machine:
#   python scripts/bench_mla_decode.py --from-json $OUT/bench_mla_decode.json --write-benchmarks BENCHMARKS.md
#   python scripts/bench_runtime_decode.py --from-json $OUT/bench_runtime_decode.json --write-benchmarks BENCHMARKS.md
set -u
. "$(dirname "$0")/script_args.sh"  # usage (the header comment as --help), abspath (from the caller's folder)
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "device_kernel_check.sh: error: unknown argument '$1' (OUT is an environment variable; see --help)" >&2; exit 2 ;;
esac
[ -n "${OUT:-}" ] && OUT="$(abspath "$OUT")"  # a relative OUT names the caller's folder (resolved before the cd)
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device-kernel-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0              # compile the kernels (the test conftest would otherwise interpret them)
export TRITON_DEFAULT_FP_FUSION=1
export TOKENIZERS_PARALLELISM=false
: > "$OUT/summary.txt"
status=0

part() {  # part NAME SECONDS COMMAND...: run with a timeout, log to $OUT/NAME.log, record rc and time
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
  tail -n 5 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv 2>&1
  python -c 'import sys, torch, triton, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__)' 2>&1
} > "$OUT/versions.txt"
cat "$OUT/versions.txt"

part bench_kernel 130 python scripts/bench_mla_decode.py --time-budget 105 --rep-ms 15 \
  --json "$OUT/bench_mla_decode.json" --markdown "$OUT/bench_mla_decode.md"

part pytest_gpu 100 python -m pytest -v -p no:cacheprovider -o addopts="" --junitxml "$OUT/pytest_gpu.xml" \
  tests/test_mla_decode_kernel.py tests/test_runtime_decode_path.py tests/test_mla_decode_tiling.py \
  -k "gpu or mixed_lengths_with_a_preallocated_table or empty_splits or idle_slots or cannot_see or heads_share or padded_rows or autotune or cut_into or tokens_major" \
  -rs

part bench_runtime 75 python scripts/bench_runtime_decode.py --batches 1 16 --prompt 512 --new-tokens 32 \
  --json "$OUT/bench_runtime_decode.json" --markdown "$OUT/bench_runtime_decode.md"

{
  echo "# Device kernel check ($(date -u +%Y-%m-%dT%H:%MZ))"; echo
  echo '```'; cat "$OUT/versions.txt" "$OUT/summary.txt"; echo '```'; echo
  for f in bench_mla_decode.md bench_runtime_decode.md; do
    [ -f "$OUT/$f" ] && { echo "## $f"; echo; cat "$OUT/$f"; echo; }
  done
  echo "## pytest_gpu (tail)"; echo; echo '```'; tail -n 25 "$OUT/pytest_gpu.log" 2>/dev/null; echo '```'
} > "$OUT/device_kernel_check.md"
echo "results in $OUT (status $status)"
exit $status
