#!/usr/bin/env bash
# tiled-mlp gpu-report on a lent GPU machine that has no network (docs/gpu.md, "How to re-measure").
#
#   bash docs/scripts/gpu_report_device.sh prepare   # here, where pip reaches PyPI: wheels into .whl/
#   bash docs/scripts/gpu_report_device.sh run [gpu-report options]   # there, with .whl carried
#
# The device's image holds torch (CUDA), transformers, triton, matplotlib and tqdm (its package list:
# /work/.library/device/KINDS.md); deepspeed and liger-kernel are not there, nor what deepspeed needs beyond
# it (hjson, pydantic and its core). Without them the report still runs: their columns are left out.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.whl
# What the device lacks, at the versions CI pins (.ci/constraints.txt; liger-kernel: the H200 run's).
BINARY="liger-kernel==0.8.5 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5"
case "${1:-}" in
  prepare)
    exclude=$(git rev-parse --git-path info/exclude)  # the checkout's own (a worktree shares its repository's)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    mkdir -p "$WHEELS"
    for spec in $BINARY; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "$spec"
    done
    # deepspeed is published as a source archive only: build its pure-Python wheel here (no ops compiled;
    # it JIT-builds what it needs, and the report's rows need none).
    DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" deepspeed==0.19.8
    du -sh "$WHEELS"
    ;;
  run)
    shift
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
      export PYTHONPATH=/tmp/site
    fi
    export PYTHONUNBUFFERED=1
    status=0
    python3 -m tiled_mlp.cli.main gpu-report --out docs "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_report.log" || status=$?
    cp docs/gpu.md docs/gpu_report.json "${OUT:-/tmp}/"
    cp docs/gpu_bench.png docs/gpu_checkpointed.png "${OUT:-/tmp}/" 2>/dev/null || true
    exit "$status"
    ;;
  *)
    echo "usage: $0 prepare | run [gpu-report options]" >&2
    exit 2
    ;;
esac
