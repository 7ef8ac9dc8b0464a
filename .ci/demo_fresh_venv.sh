#!/usr/bin/env bash
# The README's demo command on a fresh machine: a new virtual environment holding only the package's
# own dependencies (no test extra, so nothing pulls in numpy & co. by accident), a non-editable
# install (as from a wheel), run from a directory outside the checkout. A short run: 20 steps, then
# check that the weights and the summary were written.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q "$repo"
cd "$work"
OMP_NUM_THREADS=1 "$work/venv/bin/zerospeed" demo --steps 20 --eval-interval 10 --max-bytes 2000000 \
    --val-bytes 100000 --eval-windows 8 --sample-bytes 20 --no-progress --out "$work/run" | tee "$work/demo.log"
test -s "$work/run/model.safetensors" || { echo "demo wrote no model.safetensors" >&2; exit 1; }
"$work/venv/bin/python" - "$work/run/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["steps"] == 20 and s["world_size"] == 2, s
assert s["val_bits_per_byte"] < 8.0, s  # below a uniform guess over bytes
print(f"fresh-venv demo: OK, {s['steps']} steps, validation {s['val_bits_per_byte']:.3f} bits/byte")
PY
