#!/usr/bin/env bash
# Copy what the GPU checks read into .device_assets/ (git-ignored through .git/info/exclude), because the device
# machine has neither ../shared nor a network.  Then pass `carry: [".device_assets"]` to the device run:
#   bash scripts/prepare_device_assets.sh [path/to/shared]   (default: the repo's ../shared; -h / --help: this text)
#   OUT=$OUT bash scripts/device_check.sh                        (kernel, runtime, CPU vs CUDA conversion)
#   MLA_CONVERT_SHARED=$PWD/.device_assets/shared pytest -m gpu tests/test_device_conversion.py
set -eu
. "$(dirname "$0")/script_args.sh"  # usage (the header comment as --help), abspath (from the caller's folder)
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  -*) echo "prepare_device_assets.sh: error: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "prepare_device_assets.sh: error: one argument at most (the shared folder), got $#" >&2; exit 2; }
# the argument counts from the caller's folder, the default from the repo; both are checked before anything is removed
if [ $# -eq 1 ]; then SHARED="$(abspath "$1")"; else SHARED="$(cd "$(dirname "$0")/../.." && pwd)/shared"; fi
for need in "$SHARED/assets/stories260k" "$SHARED/data/tinystories-valid-excerpt.txt"; do
  [ -e "$need" ] || { echo "prepare_device_assets.sh: error: $SHARED is not a shared folder: no ${need#"$SHARED"/}" >&2; exit 2; }
done
cd "$(dirname "$0")/.."
EXCLUDE="$(git rev-parse --git-path info/exclude)"  # .git is a file in a worktree: ask git where the file is
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.device_assets/' "$EXCLUDE" 2>/dev/null || echo '/.device_assets/' >> "$EXCLUDE"
rm -rf .device_assets
mkdir -p .device_assets/texts .device_assets/shared/assets .device_assets/shared/data
cp -r "$SHARED/assets/stories260k" .device_assets/stories260k
cp -r "$SHARED/assets/stories260k" .device_assets/shared/assets/stories260k
cp "$SHARED/data/tinystories-valid-excerpt.txt" .device_assets/shared/data/
# the excerpt split at the line break nearest its middle: the first half calibrates, the second is held out
python3 - "$SHARED/data/tinystories-valid-excerpt.txt" <<'PY'
import sys
text = open(sys.argv[1], encoding="utf-8").read()
cut = text.index("\n", len(text) // 2)
open(".device_assets/texts/calibration.txt", "w", encoding="utf-8").write(text[:cut])
open(".device_assets/texts/held-out.txt", "w", encoding="utf-8").write(text[cut + 1:])
PY
du -sh .device_assets
