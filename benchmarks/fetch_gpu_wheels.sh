#!/usr/bin/env bash
# The wheels the GPU machine lacks, fetched here from the package registry (it has no
# network): benchmarks/gpu_check.sh installs whatever of them is carried.
#   .whl/    the service's pure-Python dependencies and pydantic-core for CPython 3.12
#            (carried on every call: ~3.4 MB)
#   .peers/  the peer kernels the benchmarks time when installed: bitsandbytes (~43 MB,
#            CUDA binaries inside) and gemlite (Triton, pure Python; built here from its
#            sdist). Carry it only for the kernel benchmarks (the 64 MiB carry limit).
# Usage: bash benchmarks/fetch_gpu_wheels.sh [service] [peers]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${*:-service peers}
py312=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
       --platform manylinux_2_24_x86_64 --only-binary=:all:)

for part in $what; do
  case $part in
    service)
      mkdir -p .whl
      pip download -q --no-deps "${py312[@]}" -d .whl \
        fastapi starlette uvicorn h11 pydantic pydantic-core pydantic-settings python-dotenv typing-inspection \
        annotated-types annotated-doc gguf opentelemetry-api ;;
    peers)
      mkdir -p .peers
      pip download -q --no-deps "${py312[@]}" -d .peers bitsandbytes
      pip wheel -q --no-deps -w .peers gemlite ;;
    *) echo "unknown part: $part (service, peers)" >&2; exit 2 ;;
  esac
done
ls -la .whl .peers 2>/dev/null || true
