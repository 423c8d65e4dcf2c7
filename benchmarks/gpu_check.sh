#!/usr/bin/env bash
# Everything the GPU machine does, in one call (device time is scarce): install the
# carried wheels, build the kernels, run the GPU tests, compute-sanitizer, the maintained
# benchmarks (benchmarks/README.md). Results and logs go to $OUT.
# Usage: bash benchmarks/gpu_check.sh STAGE...   (two versions of some files on one
# machine: benchmarks/ab_files.sh)
#   set-up:     env build model aot
#   tests:      test enginetests gemmtest pytest e2e sanitize racecheck
#   benchmarks: bench msweep tiles engine profile serving startup overhead inplace sampling budget chunkattn decodeattn paged slots pacing
#               engineload dashboard tune served
#   2+ GPUs:    tp (tensor parallelism: its GPU tests, the all-reduce sweep, decode steps and
#               HTTP at TP 1, 2 and, with 4 GPUs, 4; run after `build model`), tp70b (4 GPUs)
#   results:    docs (run here, not on the GPU machine: copies the fetched results over
#               docs/bench; DOCS_FROM=<the fetched folder> bash benchmarks/gpu_check.sh docs)
# Per-stage extra arguments: BENCH_ARGS MSWEEP_ARGS ENGINE_ARGS PROFILE_ARGS TUNE_ARGS
# DASHBOARD_ARGS SERVING_NAME PYTEST_K DECODEATTN_STEP CHUNKATTN_STEP SERVED_NAME SERVED_ARGS
# SERVED_WORKLOADS TILES_TAG TILES_ARGS SLOTS_NAME SLOTS_TGZ.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/woq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WOQ_CACHE=${WOQ_CACHE:-/tmp/woq-cache} HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0  # never NVLink multicast: it can take shared GPUs out of service
PY=python3

# The maintained benchmarks' results, as named in docs/bench (the `docs` stage).
RESULTS="kernels kernels_msweep engine decode_profile serving_h100_smollm2_int4 serving_cpu_int4 serving_cpu_int8 startup_h100_llama3-8b_int4 startup_cpu_smollm2_int4 metrics_overhead gemv_in_place gemv_in_place_server sampling_cost paged_serving paged_serving_pacing step_budget chunk_attention decode_attention engine_load all_reduce tensor_parallel_steps tensor_parallel tensor_parallel_smollm2 tensor_parallel_steps_70b"

if [ "$*" != docs ]; then
  # The carried wheels (benchmarks/fetch_gpu_wheels.sh): .whl always, .peers for the kernel benchmarks.
  wheels=$(ls .whl/*.whl .peers/*.whl 2>/dev/null || true)
  if [ -n "$wheels" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
fi

# The Llama-3-8B-shaped random checkpoint (its tokenizer carried in .tok/), written once per
# machine: the command the serving stages run first, inside their `bash -c` strings.
RANDOM_8B="$PY -c \"import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from startup import write_random_model as w; w('llama3-8b', Path('/tmp/llama3-8b'), Path('.tok'))\""

status=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name rc=$rc ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || status=1
}

for stage in "$@"; do
  case $stage in
    env) run env bash -c "nvidia-smi; $PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'" ;;
    build) run build $PY -c "from woq.kernels import build; from woq.kernels.options import RuntimeOptions; import logging; logging.basicConfig(level=logging.INFO); assert build.load(RuntimeOptions())" ;;
    test) run test $PY -m pytest -q -x -m "gpu and not slow" tests/ ;;
    model)  # the default model's GGUF (94 MiB), carried in three parts, one a call on one held machine (64 MiB a
      # call, ~19 MiB of it the tree and .whl): `split -n 3 -d <the GGUF> gguf.part`, part0N into .carry(N+1)/;
      # a carried path not named in a later call stays, so the last call finds all three
      mkdir -p "$WOQ_CACHE/downloads"
      run model bash -c "cat .carry1/gguf.part00 .carry2/gguf.part01 .carry3/gguf.part02 > '$WOQ_CACHE/downloads/SmolLM2-135M-Instruct.Q4_1.gguf' && sha256sum '$WOQ_CACHE/downloads/SmolLM2-135M-Instruct.Q4_1.gguf' && $PY -c 'from woq.models.fetch import fetch_default_model as f; print(f())'" ;;
    enginetests) run enginetests $PY -m pytest -q -x -m gpu tests/test_gpu_engine.py ;;
    engine) run engine $PY benchmarks/engine.py --out "$OUT" ${ENGINE_ARGS:-} ;;
    profile) run profile $PY benchmarks/profile_decode.py --out "$OUT" ${PROFILE_ARGS:-} ;;
    aot)  # the ahead-of-time build the Docker image uses (here for the GPU at hand only)
      run aot bash -c "WOQ_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=8 $PY -m pip install -q --no-deps --no-build-isolation -e . && ls kernels/_C*.so && WOQ_CACHE=/tmp/empty-cache $PY -c 'from woq.kernels import build, ops; from woq.kernels.options import RuntimeOptions; import glob; assert build.load(RuntimeOptions()); assert not glob.glob(\"/tmp/empty-cache/torch_extensions/*\"); assert ops.wgmma_configs_available(), \"no sm_90a code in the AOT library\"; print(\"AOT library loaded, no JIT build, wgmma configurations available\")' && WOQ_CACHE=/tmp/empty-cache $PY -m pytest -q -x -m 'gpu and not slow' tests/test_gpu_kernels.py" ;;
    tune) run tune bash -c "$PY benchmarks/tune_shapes.py ${TUNE_ARGS:-} && cp $WOQ_CACHE/tuning/*.json $OUT/" ;;
    serving) run serving $PY benchmarks/serving.py --spawn "--model $WOQ_CACHE/models/SmolLM2-135M-Instruct --served-model-name smollm2 --quant int4 --max-num-seqs 64 --max-seq-len 1024 --log-level warning" \
               --concurrency 1,4,16,64 --requests-per-client 5 --offline --out "$OUT" --name "${SERVING_NAME:-serving_h100_smollm2_int4}" ;;
    startup)  # needs the default model (its tokenizer): run after `model`
      run startup $PY benchmarks/startup.py --random-config llama3-8b --workdir /tmp/llama3-8b --device cuda --runs ${STARTUP_RUNS:-1} --out "$OUT" --name startup_h100_llama3-8b_int4 ;;
    overhead) run overhead $PY benchmarks/metrics_overhead.py --rounds ${OVERHEAD_ROUNDS:-8} --out "$OUT" ;;
    inplace)  # each GEMV in the step against its chain; then as the dashboard's server runs (its stage's model, prompts, sampling)
      run inplace bash -c "$PY benchmarks/gemv_in_place.py --out $OUT && $RANDOM_8B && $PY benchmarks/gemv_in_place.py --prompt 43 --sample-every 8 --stamped-layers 3 --paired --temperature 0.7 --max-num-seqs 16 --model /tmp/llama3-8b --out $OUT --name gemv_in_place_server" ;;
    sampling) run sampling $PY benchmarks/sampling_cost.py --tokenizer .tok --out "$OUT" ;;  # (the Llama-3 tokenizer carried in .tok/)
    budget) run budget $PY benchmarks/step_budget.py --out "$OUT" ;;
    chunkattn) run chunkattn $PY benchmarks/chunk_attention.py --step ${CHUNKATTN_STEP:-64/3,64/2,32/3} --out "$OUT" ;;
    decodeattn) run decodeattn $PY benchmarks/decode_attention.py --step ${DECODEATTN_STEP:-32/3,64/3,32/2,128/2} --out "$OUT" ;;
    engineload) run engineload bash -c "$RANDOM_8B && $PY benchmarks/engine_load.py --model /tmp/llama3-8b --config mix512:512:1 --config sep2048:2048:0 --out $OUT" ;;
    paged) run paged bash -c "$RANDOM_8B && $PY benchmarks/paged_serving.py --server 'paged=--model /tmp/llama3-8b --quant int4 --max-seq-len 8192 --max-queue 512 --log-level warning' --server 'no-prefix=--model /tmp/llama3-8b --quant int4 --max-seq-len 8192 --max-queue 512 --no-prefix-caching --log-level warning' --out $OUT" ;;
    slots)  # the before/after of the paged KV cache on one machine: this tree's defaults on every workload (and
      # --no-prefix-caching on the chat), then the slot cache's tree (e58e439, carried: git archive --format=tar.gz
      # -o .slots/e58e439.tgz e58e439) installed in its place; this tree installed again after
      A="--model /tmp/llama3-8b --quant int4 --max-seq-len 8192 --max-queue 512 --log-level warning"
      N=${SLOTS_NAME:-paged_vs_slots}
      run slots bash -c "$RANDOM_8B && $PY benchmarks/paged_serving.py --server 'paged=$A' --out $OUT --name $N \
        && $PY benchmarks/paged_serving.py --server 'no-prefix=$A --no-prefix-caching' --workloads chat --out $OUT --name $N \
        && rm -rf /tmp/slots && mkdir /tmp/slots && tar xzf ${SLOTS_TGZ:-.slots/e58e439.tgz} -C /tmp/slots \
        && cd /tmp/slots && $PY -m pip install -q --no-deps --no-build-isolation -e . \
        && $PY $PWD/benchmarks/paged_serving.py --server 'slots=$A --max-batch-size 64 --gpu-memory-fraction 0.9' --out $OUT --name $N; \
        rc=\$?; cd $PWD && $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null; exit \$rc" ;;
    served)  # one 8B int4 server, chosen workloads: a side of a served A/B (benchmarks/ab_files.sh, B_ENV=SERVED_NAME=...)
      run served bash -c "$RANDOM_8B && $PY benchmarks/paged_serving.py --server '${SERVED_NAME:-served}=--model /tmp/llama3-8b --quant int4 --max-seq-len 8192 --max-queue 512 --log-level warning ${SERVED_ARGS:-}' --workloads ${SERVED_WORKLOADS:-c1,p515_c16,p515_c64} --out $OUT --name paged_serving_served" ;;
    pacing)  # the default (prompt chunks paced by step times, --mixed-step-ratio 2) against the token budget alone, one machine
      run pacing bash -c "$RANDOM_8B && $PY benchmarks/paged_serving.py --server 'budget=--model /tmp/llama3-8b --quant int4 --max-seq-len 8192 --max-queue 512 --mixed-step-ratio 0 --log-level warning' --server 'paced2=--model /tmp/llama3-8b --quant int4 --max-seq-len 8192 --max-queue 512 --log-level warning' --workloads c1,p515_c16,p515_c64,p6150_c16,mixed_c128 --out $OUT --name paged_serving_pacing" ;;
    tp)  # (tp1-per-op: one GPU through a kernel per op, the 8B greedy check's noise floor)
      sizes=$($PY -c "import torch; n = torch.cuda.device_count(); print(','.join(str(s) for s in (1, 2, 4) if s <= n))")
      servers=""; for s in ${sizes//,/ }; do servers="$servers --server tp$s=--tensor-parallel-size=$s"; done
      run tptests $PY -m pytest -q -m gpu tests/test_peer_all_reduce.py tests/test_tensor_parallel.py \
        tests/test_gpu_decode_step.py::test_persistent_step_across_ranks_matches_the_kernel_per_op_step
      run allreduce $PY benchmarks/all_reduce.py --sizes "${sizes#1,}" --out "$OUT"
      run tpsmollm2 $PY benchmarks/tensor_parallel.py --common "--model $WOQ_CACHE/models/SmolLM2-135M-Instruct --quant int4" \
        $servers --concurrency 1 --requests-per-client 8 --out "$OUT" --name tensor_parallel_smollm2
      run tp8b bash -c "$RANDOM_8B && $PY benchmarks/tensor_parallel_steps.py --model /tmp/llama3-8b --sizes $sizes --out $OUT && $PY benchmarks/tensor_parallel.py --common '--model /tmp/llama3-8b --quant int4 --max-seq-len 4096' $servers --server tp1-per-op=--decode-step=off --out $OUT" ;;
    tp70b)  # a 70B-shaped random int4 checkpoint (39 GB, written straight as woq), GPU steps at TP 2 and 4
      run tp70b bash -c "$PY benchmarks/random_woq.py --config llama3-70b --out /tmp/llama3-70b-woq && $PY benchmarks/tensor_parallel_steps.py --model /tmp/llama3-70b-woq --sizes 2,4 --batches 1,16 --out $OUT --name tensor_parallel_steps_70b" ;;
    dashboard)  # a live 8B int4 server scraped by Prometheus (its binary carried in .prom/, the tokenizer in .tok/)
      run dashboard bash -c "$RANDOM_8B && PATH=\$PWD/.prom:\$PATH $PY benchmarks/dashboard_snapshot.py --serve-args '--model /tmp/llama3-8b --served-model-name llama3-8b --quant int4 --max-seq-len 1024 --max-num-seqs 16 --log-level warning' --seconds 40 --clients 4 --max-tokens 64 --timing-every 8 --eager-check 8 --out $OUT/dashboard_h100.png ${DASHBOARD_ARGS:-}" ;;
    e2e) run e2e $PY -m pytest -q -x -s -m "gpu and slow" tests/ ;;
    sanitize) run sanitize compute-sanitizer --tool memcheck --error-exitcode 9 $PY benchmarks/sanitize_kernels.py ;;
    racecheck)  # shared-memory hazards and barrier misuse in the mixed GEMM (ring barriers: mbarriers, cp.async, tensor copies)
      run racecheck bash -c "compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 $PY benchmarks/sanitize_kernels.py --gemm-only && compute-sanitizer --tool synccheck --error-exitcode 9 $PY benchmarks/sanitize_kernels.py --gemm-only" ;;
    bench) run bench $PY benchmarks/linear_kernels.py --out "$OUT" ${BENCH_ARGS:-} ;;
    msweep) run msweep $PY benchmarks/linear_kernels.py --m-sweep --out "$OUT" ${MSWEEP_ARGS:-} ;;
    tiles) run tiles $PY benchmarks/gemm_tiles.py --tag "${TILES_TAG:-tree}" --out "$OUT" ${TILES_ARGS:-} ;;  # one side of a fixed-tile GEMM A/B
    gemmtest) run gemmtest $PY -m pytest -q -x tests/test_gpu_kernels.py -k "mixed_gemm or smaller_gpus" ;;
    pytest) run pytest $PY -m pytest -q -x -m gpu tests/ -k "${PYTEST_K:?PYTEST_K: the tests to run}" ;;
    docs)  # copy each maintained benchmark's md/json/png from $DOCS_FROM (default $OUT) over docs/bench
      from=${DOCS_FROM:-$OUT}; n=0
      for name in $RESULTS; do
        for ext in md json png; do
          if [ -f "$from/$name.$ext" ]; then cp "$from/$name.$ext" "docs/bench/$name.$ext" && n=$((n + 1)) && echo "docs/bench/$name.$ext"; fi
        done
      done
      for ext in md json; do [ -f "$from/quality.$ext" ] && cp "$from/quality.$ext" "docs/quality.$ext" && n=$((n + 1)) && echo "docs/quality.$ext"; done
      echo "=== docs: $n files from $from" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
