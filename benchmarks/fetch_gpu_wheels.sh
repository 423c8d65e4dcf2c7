#!/usr/bin/env bash
# The wheels the GPU machine lacks, fetched here from the package registry (it has no
# network): benchmarks/gpu_check.sh installs whatever of them is carried.
#   .whl/    the service's pure-Python dependencies and pydantic-core for CPython 3.12
#            (carried on every call: ~6.5 MB)
#   .peers/  the peer kernels the benchmarks time when installed: bitsandbytes (~43 MB,
#            CUDA binaries inside) and gemlite (Triton, pure Python; built here from its
#            sdist). Carry it only for the kernel benchmarks (the 64 MiB carry limit).
# Versions are pinned to those the GPU runs used (a newer release would otherwise sit next to
# the old wheel in the folder, and installing both fails).
# Usage: bash benchmarks/fetch_gpu_wheels.sh [service] [peers]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${*:-service peers}
py312=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --only-binary=:all:)

for part in $what; do
  case $part in
    service)
      mkdir -p .whl
      pip download -q --no-deps "${py312[@]}" -d .whl \
        fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 pydantic==2.14.3 pydantic-core==2.50.4 \
        pydantic-settings==2.16.3 python-dotenv==1.2.4 typing-inspection==0.4.5 annotated-types==0.8.0 \
        annotated-doc==0.0.7 gguf==0.19.0 opentelemetry-api==1.45.2 llguidance==1.9.1 ;;
    peers)  # the versions ../shared/anchors measured
      mkdir -p .peers
      pip download -q --no-deps "${py312[@]}" -d .peers bitsandbytes==0.50.2
      pip wheel -q --no-deps -w .peers gemlite==0.6.0.post2 ;;
    *) echo "unknown part: $part (service, peers)" >&2; exit 2 ;;
  esac
done
ls -la .whl .peers 2>/dev/null || true
