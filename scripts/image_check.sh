#!/usr/bin/env bash
# The Dockerfile built and run for real, without a Docker engine and without pulling an image: podman
# builds the Dockerfile's own steps on a stand-in base (Debian 12 minbase from Debian's packages, made by
# debootstrap; the Dockerfile's comment says what differs from the CUDA base), starts the container,
# waits for /healthz and runs one client turn against it, as .ci/run does for the first run. About 5
# minutes on a 2-core machine from nothing (measured: 267 s to debootstrap and build, most of it pip's
# torch and CUDA wheels, and 37 s to start it and talk; a rebuild with the layers cached: 40 s).
#   scripts/image_check.sh            # needs root (apt-get, debootstrap, podman); KAME_IMAGE_PORT to move the port
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
BASE=localhost/kame-standin-base:bookworm-1
IMAGE=localhost/kame:check
NAME=kame-image-check
PORT=${KAME_IMAGE_PORT:-18997}
PYTHON=${PYTHON:-.venv/bin/python}  # the client's side: README's environment

if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman buildah debootstrap runc fuse-overlayfs uidmap >/dev/null
fi
# runc and cgroupfs: crun refuses this VM's hybrid cgroups (v1 controllers beside a v2 mount)
podman() { command podman --runtime runc --cgroup-manager cgroupfs "$@" 2> >(grep -v 'level=warning' >&2); }

# the stand-in base, once per machine: Debian 12's minimal system, imported as an image
if ! podman image exists "$BASE"; then
    echo "== the stand-in base: debootstrap bookworm (minbase)"
    root=$(mktemp -d)
    debootstrap --variant=minbase --include=ca-certificates bookworm "$root" http://deb.debian.org/debian >/dev/null
    # the host's trusted certificates, for pip inside the build: a network whose TLS goes through a proxy
    # of its own CA (this machine's) is trusted in the container as on the host
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - "$BASE" >/dev/null
    rm -rf "$root"
fi

# the build's RUN steps and the container share the host's network (no bridge or port mapping to set
# up); the container's limits are set below this VM's (podman's defaults, even --ulimit host, fail in runc)
echo "== podman build (the Dockerfile on $BASE)"
build_log=$(mktemp)
if ! podman build --network host --build-arg BASE="$BASE" -t "$IMAGE" . >"$build_log" 2>&1; then
    tail -40 "$build_log"; echo "the image did not build"; exit 1
fi
grep -E '^(STEP|COMMIT)' "$build_log" | cut -c1-120
podman image prune -f >/dev/null  # the image this tag named before, now unnamed (about 7.5 GB)
echo "built in $((SECONDS - started)) s"

token=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(16))')
podman rm -f "$NAME" >/dev/null 2>&1 || true
stop_container() { podman logs "$NAME" >"${KAME_IMAGE_LOG:-/dev/null}" 2>&1 || true; podman rm -f "$NAME" >/dev/null 2>&1 || true; }
trap stop_container EXIT
podman run -d --name "$NAME" --network host --ulimit nofile=16384:16384 --ulimit nproc=8192:8192 \
    -e KAME_PORT="$PORT" -e KAME_AUTH_TOKENS="[\"$token\"]" "$IMAGE" >/dev/null

echo "== the container: /healthz"
for _ in $(seq 600); do
    if curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1; then break; fi
    if [ "$(podman inspect -f '{{.State.Running}}' "$NAME")" != true ]; then podman logs "$NAME"; echo "the container exited"; exit 1; fi
    sleep 0.5
done
curl -fsS "http://127.0.0.1:$PORT/healthz"; echo

echo "== one client turn"
answer=$(mktemp --suffix=.wav)
"$PYTHON" -m kame.cli client --url "ws://127.0.0.1:$PORT/api/chat" --token "$token" \
    --input tests/fixtures/question.wav --output "$answer" --tail 6
test -s "$answer" || { echo "no answer was written"; exit 1; }
podman stop -t 30 "$NAME" >/dev/null
podman logs "$NAME" 2>&1 | grep -q "Application shutdown complete" || { podman logs "$NAME" | tail -40; echo "the server did not stop cleanly"; exit 1; }
echo "image check: ok in $((SECONDS - started)) s"
