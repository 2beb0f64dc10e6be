#!/usr/bin/env bash
# The GPU check of distributed ROOT on a machine with one CUDA device, in under 8 minutes:
# the CUDA/NCCL tests, the optimizer step table against torch.optim.Muon, and rootopt
# train's tokens/s and MFU on the embedded default; one JSON (benchmarks/device_check.py
# says what is in it). Without CUDA, or with --dry, it parses and plans, runs nothing and
# exits 0 (CI runs that: tests/test_dist_device.py).
#
#   benchmarks/device_check.sh OUT.json [--dry]
#   python benchmarks/render_dist_results.py --device OUT.json ...   # the docs' GPU tables
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# rootopt and rootopt-analysis (analysis/: the step table's operation counter) of this checkout
export PYTHONPATH="$here/../src:$here/../analysis${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python}"
# the parts have their own limits (480 s in all); this is the backstop
exec timeout --kill-after=10 540 "$python" "$here/device_check.py" "$@"
