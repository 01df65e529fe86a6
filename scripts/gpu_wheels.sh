#!/usr/bin/env bash
# Wheels for scripts/gpu_bench.sh on a GPU machine with no network whose image has python3 with torch but not
# this project's other packages (the lent H200: Python 3.12, torch, transformers, safetensors, sentencepiece,
# huggingface-hub, einops, aiohttp, anyio, httpx, peft, pytest, hypothesis). Writes .whl/: this project's wheel
# and what such an image lacks for the front-end bench, `kame serve` (WebSocket transports; WebRTC answers 501
# without aiortc and PyAV, which are left out for size), `kame bench load`, the GPU tests and the training
# smoke. bitsandbytes (the int8 pass) is repacked with the CPU library and the one CUDA library of the image's
# CUDA (KAME_GPU_CUDA, default 130: the lent H200's torch is cu130): 3 MB instead of 43, since what travels
# is limited to 64 MiB.
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]   # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
rm -rf .whl && mkdir .whl
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
           manylinux_2_31 manylinux_2_34; do
    platforms+=(--platform "${tag}_x86_64")
done
# the versions this project pins or installs beside its pins (pip list in a `pip install -e .` venv)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" -d .whl \
    moshi==0.2.13 sphn==0.2.1 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 soxr==1.0.0 \
    fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 python-multipart==0.0.34 \
    pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 python-dotenv==1.2.4 \
    uvicorn==0.54.0 httptools==0.9.0 websockets==17.4 \
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 distro==1.9.0 \
    py-spy==0.4.3  # the host-side pass's profile (scripts/bench_host.py --profile)
# bitsandbytes as moshi pins it (<0.50), with only the libraries this GPU loads
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" -d .whl/full bitsandbytes==0.49.2
python3 - .whl/full/bitsandbytes-*.whl .whl "${KAME_GPU_CUDA:-130}" <<'PY'
import pathlib, re, sys, zipfile
source, folder, cuda = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
keep = {f"libbitsandbytes_cuda{cuda}.so", "libbitsandbytes_cpu.so"}
def kept(name: str) -> bool:
    library = re.search(r"(libbitsandbytes_\w+\.so)$", name)
    return library is None or library.group(1) in keep
with zipfile.ZipFile(source) as old, zipfile.ZipFile(folder / source.name, "w", zipfile.ZIP_DEFLATED) as new:
    names = [n for n in old.namelist() if kept(n)]
    if not any(n.endswith(f"_cuda{cuda}.so") for n in names):
        sys.exit(f"bitsandbytes has no library for CUDA {cuda}")
    for name in names:
        data = old.read(name)
        if name.endswith(".dist-info/RECORD"):  # the removed files' lines go too
            data = b"".join(line for line in data.splitlines(keepends=True) if kept(line.split(b",")[0].decode()))
        new.writestr(old.getinfo(name), data)
PY
rm -rf .whl/full
python3 -m pip wheel -q --no-deps -w .whl .
rm -rf build
du -sh .whl
