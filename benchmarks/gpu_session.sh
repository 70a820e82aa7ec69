#!/usr/bin/env bash
# Issue 24's first device calls, a few commands (device time is 30 minutes a session and a
# machine takes minutes to start: few, full calls). Run through the device tool, from the
# repository root, with the wheels the image lacks carried in .whl (ortools and what it
# pins; the device's Python is 3.12):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict protobuf==6.33.6
#   run(command="bash benchmarks/gpu_session.sh suite", carry=[".whl"])
#   run(command="bash benchmarks/gpu_session.sh predictions expandable", carry=[".whl"])
#   run(command="bash benchmarks/gpu_session.sh peers", carry=[".whl"])
#
# Steps, in the order given: `suite` (item 1: the whole suite with the device's CUDA
# torch, what skipped listed), `predictions` (items 2 and 3 under the
# caching allocator's default configuration), `expandable` (the same with
# expandable_segments), `peers` (item 5: remat against Hugging Face checkpointing,
# save_on_cpu and torch.compile at equal measured peak, in a call of its own). Writes
# under $OUT (what comes back); each step is bounded so that the calls above end inside
# their 10 minutes.
set -uo pipefail
for step in "$@"; do  # before any device time goes into installing
    case $step in suite | predictions | expandable | peers) ;;
    *) echo "gpu_session.sh: unknown step '$step' (valid: suite, predictions, expandable, peers)"
       exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "gpu_session.sh: name the steps to run"; exit 2; }
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
        # -rs lists what skipped and why: nothing should, for want of CUDA, here.
        timeout 480 python3 -m pytest -q -p no:cacheprovider -rs 2>&1 | tail -80 \
            > "$OUT/suite.log"
        tail -25 "$OUT/suite.log" ;;
    predictions)
        timeout 270 python3 benchmarks/gpu_predictions.py --out "$OUT/gpu_predictions.md" \
            > "$OUT/gpu_predictions.log" 2>&1
        tail -40 "$OUT/gpu_predictions.log" ;;
    expandable)
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 270 \
            python3 benchmarks/gpu_predictions.py --out "$OUT/gpu_predictions-expandable.md" \
            > "$OUT/gpu_predictions-expandable.log" 2>&1
        tail -40 "$OUT/gpu_predictions-expandable.log" ;;
    peers)
        timeout 540 python3 benchmarks/gpu_peers.py --out "$OUT/gpu-peers.md" \
            > "$OUT/gpu_peers.log" 2>&1
        tail -40 "$OUT/gpu_peers.log" ;;
    esac
done
