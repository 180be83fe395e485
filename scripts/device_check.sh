#!/usr/bin/env bash
# The one prepared GPU check (under 8 minutes on one H200): the MLA decode kernel and the runtime
# (scripts/device_kernel_check.sh: benchmarks beside a torch implementation, the `gpu` tests, end-to-end
# decode) and conversion with --device cuda against the CPU (scripts/device_convert_check.py).
#
#   OUT=/some/folder STORIES=path/to/stories260k bash scripts/device_check.sh     (-h / --help: this text)
#   (relative paths in OUT, STORIES, CALIB_TEXT, EVAL_TEXT count from the folder it is started in)
#
# The fine-tuning recipe under FSDP is a separate check (same assets; estimated 2 minutes, not yet run on a GPU):
#   python scripts/device_finetune_check.py --out $OUT/finetune
# Prepare the assets once with scripts/prepare_device_assets.sh.  SKIP_KERNEL=1 runs the conversion part alone, CASES="key ..." only those cases (see --cases); CONVERT_LIMIT (seconds, default 170) caps it.  The texts are halves
# of ../shared/data/tinystories-valid-excerpt.txt (calibration / held-out), copied beside stories260K.
# Everything it writes is packed into $OUT/device_check.tgz (plus $OUT/summary.txt), because a device
# run hands back only a few files.  Needs only what the GPU image has (torch, triton, transformers,
# huggingface_hub, numpy, pytest): no install, no network.  Afterwards, on any machine:
#   tar xzf device_check.tgz -C results
#   python scripts/bench_mla_decode.py --from-json results/kernel/bench_mla_decode.json --write-benchmarks BENCHMARKS.md
#   python scripts/bench_runtime_decode.py --from-json results/kernel/bench_runtime_decode.json --write-benchmarks BENCHMARKS.md
#   python scripts/device_convert_check.py --from-json results/convert/device_convert_check.json --write-benchmarks BENCHMARKS.md
set -u
. "$(dirname "$0")/script_args.sh"  # usage (the header comment as --help), abspath (from the caller's folder)
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "device_check.sh: error: unknown argument '$1' (settings are environment variables; see --help)" >&2; exit 2 ;;
esac
# relative OUT / STORIES / CALIB_TEXT / EVAL_TEXT name the caller's folder, not the repo's (resolved before the cd)
[ -n "${OUT:-}" ] && OUT="$(abspath "$OUT")"
[ -n "${STORIES:-}" ] && STORIES="$(abspath "$STORIES")"
[ -n "${CALIB_TEXT:-}" ] && CALIB_TEXT="$(abspath "$CALIB_TEXT")"
[ -n "${EVAL_TEXT:-}" ] && EVAL_TEXT="$(abspath "$EVAL_TEXT")"
cd "$(dirname "$0")/.."
FINAL="${OUT:-$PWD/device-check}"
WORK="$(mktemp -d)"
mkdir -p "$FINAL"
: > "$WORK/summary.txt"
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS

if [ -z "${SKIP_KERNEL:-}" ]; then
  OUT="$WORK/kernel" timeout --kill-after=5 310 bash scripts/device_kernel_check.sh > "$WORK/kernel.log" 2>&1
  echo "kernel rc=$? $((SECONDS - start))s" | tee -a "$WORK/summary.txt"
  tail -n 8 "$WORK/kernel.log"
fi
pack() { tar czf "$FINAL/device_check.tgz" -C "$WORK" --exclude=convert/work . && cp "$WORK/summary.txt" "$FINAL/summary.txt"; }
pack  # what is done so far comes back even if the run is cut short later

step=$SECONDS
timeout --kill-after=5 "${CONVERT_LIMIT:-170}" python scripts/device_convert_check.py --out "$WORK/convert" ${CASES:+--cases $CASES} \
  --stories "${STORIES:-$PWD/.device_assets/stories260k}" --calib-text "${CALIB_TEXT:-$PWD/.device_assets/texts/calibration.txt}" \
  --eval-text "${EVAL_TEXT:-$PWD/.device_assets/texts/held-out.txt}" > "$WORK/convert.log" 2>&1
echo "convert rc=$? $((SECONDS - step))s" | tee -a "$WORK/summary.txt"
tail -n 30 "$WORK/convert.log"

pack
echo "total $((SECONDS - start))s; results in $FINAL"
