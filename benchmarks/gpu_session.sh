#!/usr/bin/env bash
# Issue 24's first device call, in one command (device time is 30 minutes a session and a
# machine takes minutes to start: few, full calls). Run through the device tool, from the
# repository root, with the wheels the image lacks carried in .whl (ortools and what it
# pins; the device's Python is 3.12):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict protobuf==6.33.6
#   run(command="bash benchmarks/gpu_session.sh suite predictions", carry=[".whl"])
#   run(command="bash benchmarks/gpu_session.sh expandable", carry=[".whl"])
#
# Steps, in the order given: `suite` (item 1: the whole suite with the device's CUDA
# torch, the CUDA-only tests listed apart), `predictions` (items 2 and 3 under the
# caching allocator's default configuration), `expandable` (the same with
# expandable_segments). Writes under $OUT (what comes back); each step is bounded so that
# two of them end inside a call's 10 minutes.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers, ortools; print("torch", torch.__version__,
"transformers", transformers.__version__, "ortools", ortools.__version__)'; } \
    | tee "$OUT/versions.txt"

for step in "$@"; do
    case $step in
    suite)
        timeout 300 python3 -m pytest -q -p no:cacheprovider -rs 2>&1 | tail -60 \
            > "$OUT/suite.log"
        timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rA 2>&1 | tail -40 \
            > "$OUT/suite-gpu-only.log"
        tail -3 "$OUT"/suite*.log ;;
    predictions)
        timeout 270 python3 benchmarks/gpu_predictions.py --out "$OUT/gpu_predictions.md" \
            > "$OUT/gpu_predictions.log" 2>&1
        tail -40 "$OUT/gpu_predictions.log" ;;
    expandable)
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 270 \
            python3 benchmarks/gpu_predictions.py --out "$OUT/gpu_predictions-expandable.md" \
            > "$OUT/gpu_predictions-expandable.log" 2>&1
        tail -40 "$OUT/gpu_predictions-expandable.log" ;;
    *) echo "gpu_session.sh: unknown step '$step' (valid: suite, predictions, expandable)"
       exit 2 ;;
    esac
done
