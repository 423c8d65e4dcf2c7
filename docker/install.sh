#!/bin/sh
# Install woq and its Python dependencies into the active environment. The Makefile (so
# CI) and the Dockerfile both run this, so the image's install steps are exercised on
# every CI run.
#   TORCH_SPEC   torch requirement (default torch==2.13.0: the CPU wheel of dev machines;
#                the image uses a CUDA 12.8 build)
#   TORCH_INDEX  extra index for torch (the image: https://download.pytorch.org/whl/cu128)
#   WOQ_EXTRAS   extras to install (default: dev; empty: none); WOQ_EDITABLE=1: editable install
set -eu
python -m pip install --quiet --upgrade pip
if [ -n "${TORCH_INDEX:-}" ]; then
  python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}" --extra-index-url "$TORCH_INDEX"
else
  python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
extras="${WOQ_EXTRAS-dev}"
target="."
[ -n "$extras" ] && target=".[$extras]"
if [ "${WOQ_EDITABLE:-0}" = "1" ]; then
  python -m pip install --quiet -e "$target"
else
  python -m pip install --quiet --no-build-isolation "$target"
fi
