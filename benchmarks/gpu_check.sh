#!/usr/bin/env bash
# Everything the GPU machine does, in one call (device time is scarce): install the
# carried wheels, build the kernels, run the GPU tests, compute-sanitizer, benchmarks.
# Results and logs go to $OUT. Usage: bash benchmarks/gpu_check.sh STAGE... (two versions of
# some files on one machine: benchmarks/ab_files.sh)
#   stages: env build test errors sanitize racecheck model e2e enginetests engine profile timeline chaincost ablation prefill overhead pdlab persistentab densegemv stepkernels steptimeline stepncu serving bench msweep
#           dequant grid gemmcfg gemmtest pytest variants probe ncu stalls sass opcodes gdb tune aot gptq
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/woq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WOQ_CACHE=${WOQ_CACHE:-/tmp/woq-cache} HF_HUB_OFFLINE=1
PY=python3

# The carried wheels (benchmarks/fetch_gpu_wheels.sh): .whl always, .peers for the kernel benchmarks.
wheels=$(ls .whl/*.whl .peers/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }

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
    build) run build $PY -c "from woq.kernels import ops; import logging; logging.basicConfig(level=logging.INFO); assert ops.available()" ;;
    test) run test $PY -m pytest -q -x -m "gpu and not slow" tests/ ;;
    model)  # the default model's GGUF, carried in two halves (.carry1, .carry2: 64 MiB a call)
      mkdir -p "$WOQ_CACHE/downloads"
      run model bash -c "cat .carry1/gguf.part00 .carry2/gguf.part01 > '$WOQ_CACHE/downloads/SmolLM2-135M-Instruct.Q4_1.gguf' && sha256sum '$WOQ_CACHE/downloads/SmolLM2-135M-Instruct.Q4_1.gguf' && $PY -c 'from woq.models.fetch import fetch_default_model as f; print(f())'" ;;
    enginetests) run enginetests $PY -m pytest -q -x -m gpu tests/test_gpu_engine.py ;;
    engine) run engine $PY benchmarks/engine.py --out "$OUT" ${ENGINE_ARGS:-} ;;
    profile) run profile $PY benchmarks/profile_decode.py --out "$OUT" ${PROFILE_ARGS:-} ;;
    timeline) run timeline $PY benchmarks/decode_timeline.py --out "$OUT" --variants "${TIMELINE_VARIANTS:-full step}" ;;  # its own build (block trace)
    chaincost) run chaincost $PY benchmarks/gemv_chain_cost.py --out "$OUT" ;;
    ablation) run ablation $PY benchmarks/profile_decode.py --ablation --models "${ABLATION_MODELS:-llama3-8b}" --out "$OUT" ${ABLATION_ARGS:-} ;;
    prefill) run prefill $PY benchmarks/prefill_host.py --out "$OUT" ${PREFILL_ARGS:-} ;;
    overhead) run overhead $PY benchmarks/engine.py --metrics-overhead --out "$OUT" ${OVERHEAD_ARGS:-} ;;
    pdlab) run pdlab $PY benchmarks/engine.py --pdl-ab --out "$OUT" ;;
    stepkernels) run stepkernels $PY benchmarks/step_kernels.py --out "$OUT" ${STEPKERNELS_ARGS:-} ;;
    densegemv) run densegemv $PY benchmarks/dense_gemv.py --out "$OUT" ${DENSEGEMV_ARGS:-} ;;
    persistentab) run persistentab $PY benchmarks/engine.py --persistent-ab --out "$OUT" ${PERSISTENTAB_ARGS:-} ;;
    steptimeline) run steptimeline $PY benchmarks/step_timeline.py --out "$OUT" ${STEPTIMELINE_ARGS:-} ;;
    stepncu)  # the persistent step's kernel under Nsight Compute: stall reasons, per-instruction samples (SASS)
      run stepncu bash -c "ncu --clock-control none --kernel-name regex:decode_step_kernel --launch-skip 1 --launch-count 1 \
           --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
           --section MemoryWorkloadAnalysis --section SourceCounters -f -o '$OUT/step' \
           $PY benchmarks/step_timeline.py --out /tmp/step-ncu --positions 128 --variants persistent --replays 1; \
           ncu -i '$OUT/step.ncu-rep' --page details > '$OUT/step_ncu.txt'; \
           ncu -i '$OUT/step.ncu-rep' --page source --csv --print-source sass > '$OUT/step_sass.csv'" ;;
    aot)  # the ahead-of-time build the Docker image uses (here for the GPU at hand only)
      run aot bash -c "WOQ_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=8 $PY -m pip install -q --no-deps --no-build-isolation -e . && ls kernels/_C*.so && WOQ_CACHE=/tmp/empty-cache $PY -c 'from woq.kernels import ops; import glob; assert ops.available(); assert not glob.glob(\"/tmp/empty-cache/torch_extensions/*\"); assert ops.wgmma_configs_available(), \"no sm_90a code in the AOT library\"; print(\"AOT library loaded, no JIT build, wgmma configurations available\")' && WOQ_CACHE=/tmp/empty-cache $PY -m pytest -q -x -m 'gpu and not slow' tests/test_gpu_kernels.py" ;;
    gptq) run gptq $PY benchmarks/gptq_gpu_check.py ;;
    tune) run tune bash -c "$PY benchmarks/tune_shapes.py ${TUNE_ARGS:-} && cp $WOQ_CACHE/tuning/*.json $OUT/" ;;
    serving) run serving $PY benchmarks/serving.py --spawn "--model $WOQ_CACHE/models/SmolLM2-135M-Instruct --served-model-name smollm2 --quant int4 --max-batch-size 64 --max-seq-len 1024 --log-level warning" \
               --concurrency 1,4,16,64 --requests-per-client 5 --offline --out "$OUT" --name serving_h100_smollm2_int4 ;;
    e2e) WOQ_EVAL_TEXT=$PWD/.carry2/test.txt run e2e $PY -m pytest -q -x -s -m "gpu and slow" tests/ ;;
    sanitize) run sanitize compute-sanitizer --tool memcheck --error-exitcode 9 $PY benchmarks/sanitize_kernels.py ;;
    racecheck)  # shared-memory hazards and barrier misuse in the mixed GEMM (ring barriers: mbarriers, cp.async)
      run racecheck bash -c "compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 $PY benchmarks/sanitize_kernels.py --gemm-only && compute-sanitizer --tool synccheck --error-exitcode 9 $PY benchmarks/sanitize_kernels.py --gemm-only" ;;
    bench) run bench $PY benchmarks/kernels.py --out "$OUT" ${BENCH_ARGS:-} ;;
    msweep) run msweep $PY benchmarks/kernels.py --m-sweep --out "$OUT" ${MSWEEP_ARGS:-} ;;
    dequant) run dequant $PY benchmarks/dequant_bench.py --out "$OUT" ${DEQUANT_ARGS:-} ;;
    grid) run grid $PY benchmarks/kernels.py --grid-sweep ${GRID_ARGS:-} ;;
    gemmcfg) run gemmcfg $PY benchmarks/gemm_configs.py ${GEMMCFG_ARGS:-} ;;
    gemmtest) run gemmtest $PY -m pytest -q -x tests/test_gpu_kernels.py -k "mixed_gemm or smaller_gpus" ;;
    pytest) run pytest $PY -m pytest -q -x -m gpu tests/ -k "${PYTEST_K:?PYTEST_K: the tests to run}" ;;
    errors) run errors $PY benchmarks/check_errors.py ;;
    gdb) run gdb cuda-gdb -batch -ex run -ex bt --args $PY benchmarks/check_errors.py --inline-ours ;;
    variants) run variants $PY benchmarks/gemv_variants.py ;;  # the default build; variants: call the script with flag sets
    probe) run probe $PY benchmarks/probe_bandwidth.py ;;
    ncu) run ncu ncu --clock-control none --kernel-name regex:"${NCU_KERNEL:-gemv_kernel|gemv_stream_kernel|gemm_kernel}" --launch-skip 2 --launch-count 1 \
           --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
           --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats \
           $PY benchmarks/profile_gemv.py ${NCU_SHAPE:-28672 8192 1 4} ;;
    stalls) run stalls ncu --clock-control none --kernel-name regex:"${NCU_KERNEL:-gemv_kernel|gemv_stream_kernel|gemm_kernel}" --launch-skip 2 --launch-count 1 \
           --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed_pipe_tensor.*sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum" \
           $PY benchmarks/profile_gemv.py ${NCU_SHAPE:-28672 8192 1 4} ;;
    sass) run sass bash -c 'cuobjdump --dump-sass "$(find "$WOQ_CACHE/torch_extensions" -name "*.so" | head -1)"' ;;
    opcodes) run opcodes $PY benchmarks/sass_opcodes.py ${SASS_KERNELS:?SASS_KERNELS: kernel names, e.g. the .entry names of the PTX} ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
