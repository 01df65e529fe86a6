# KAME server on a CUDA GPU. Build: docker build -t kame .
# Run:   docker run --gpus all -p 8998:8998 -v kame-models:/models -e OPENAI_API_KEY \
#            -e KAME_AUTH_TOKENS='["a-long-random-token"]' kame
# It binds 0.0.0.0, so a token is required (docs/security.md).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
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
RUN python3.11 -m venv /venv && /venv/bin/pip install .

# model downloads (Hugging Face cache) live in a volume
VOLUME ["/models"]
EXPOSE 8998
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s CMD python3.11 -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8998/healthz')" || exit 1
ENTRYPOINT ["/venv/bin/kame", "serve"]
CMD ["--config", "/app/configs/default.toml"]
