# woq for NVIDIA GPUs (T4 sm_75, A100 sm_80, A10/3090 sm_86, L4/4090 sm_89, H100 sm_90).
#   docker build -t woq .
#   docker run --gpus all -p 8000:8000 -v woq-cache:/cache woq                       # default model
#   docker run --gpus all -p 8000:8000 -v /path/to/model:/models/m:ro -e WOQ_MODEL=/models/m \
#              -e WOQ_QUANT=int4 -v woq-cache:/cache woq
# Configuration: WOQ_* environment variables (README: Configuration) or flags after the
# image name, e.g. `docker run ... woq --quant int4 --max-num-seqs 32`.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu22.04

# --- build: compile the kernels ahead of time for every target GPU ----------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY docker/install.sh docker/install.sh
COPY woq woq
COPY service service
COPY engine engine
COPY models models
COPY kernels kernels
# Same install script as `make install` (and CI); torch for CUDA 12.8, kernels built ahead of time.
ENV TORCH_SPEC=torch==2.11.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128 WOQ_EXTRAS="" \
    WOQ_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;8.9;9.0a" MAX_JOBS=4
RUN python -m pip install --quiet setuptools==80.9.0 wheel==0.45.1 ninja==1.11.1.3 \
 && sh docker/install.sh \
 && python -c "import pathlib, woq.kernels as k; assert list(pathlib.Path(k.__file__).parent.glob('_C*.so'))"

# --- runtime: CUDA runtime libraries, the venv, a non-root user ---------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
RUN useradd --create-home --uid 10001 woq \
 && mkdir -p /cache /models \
 && chown woq:woq /cache /models
USER 10001
ENV PATH=/opt/venv/bin:$PATH \
    WOQ_HOST=0.0.0.0 WOQ_PORT=8000 WOQ_CACHE=/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
VOLUME ["/cache", "/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["sh", "-c", "curl -fsS http://127.0.0.1:${WOQ_PORT}/health || exit 1"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["woq", "serve"]
