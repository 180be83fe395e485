#!/usr/bin/env bash
# Copy what the GPU checks read into .device_assets/ (git-ignored through .git/info/exclude), because the device
# machine has neither ../shared nor a network.  Then pass `carry: [".device_assets"]` to the device run:
#   bash scripts/prepare_device_assets.sh [path/to/shared]
#   OUT=$OUT bash scripts/device_check.sh                        (kernel, runtime, CPU vs CUDA conversion)
#   MLA_CONVERT_SHARED=$PWD/.device_assets/shared pytest -m gpu tests/test_device_conversion.py
set -eu
cd "$(dirname "$0")/.."
SHARED="${1:-../shared}"
grep -qx '/.device_assets/' .git/info/exclude 2>/dev/null || echo '/.device_assets/' >> .git/info/exclude
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
