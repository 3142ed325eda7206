#!/usr/bin/env bash
# The GPU suite: one part per call on a lent GPU device (see docs/BENCHMARKS.md "GPU suite").
#
#   bash bench/gpu_suite.sh PART [--hosts 0.3.75,0.33.0] [--modes on,off] [--models wan21] [--sizes 8192]
#       [--deadline S]
#   (--hosts: default every host of the kit, which lacks 0.33.0 when scripts/gpu_kit.sh had no source for it;
#   naming a host the kit lacks is an error)
#   bash bench/gpu_suite.sh PART --cpu --small      # the dry run (CPU, tiny sizes; the default tests run it)
#
# PART: tests | image | encode | video | scenes. From the repository root, with the kit (scripts/gpu_kit.sh -> .gpu/)
# present. Installs the kit's site into a temporary folder when the interpreter is CPython 3.12 (the
# device's), unpacks each ComfyUI of the kit and links this pack into it, then runs bench/gpu_suite.py.
# Results: $OUT/PART.{json,md,log} ($OUT: set by the device tool; default outputs/gpu_suite).
#
# Environment: VRAMFIT_GPU_KIT (default .gpu), VRAMFIT_GPU_WORK (default /tmp/vramfit-gpu),
# VRAMFIT_SUITE_PYTHON (default python3), VRAMFIT_SUITE_MODELS (the models/ folder every unpacked host uses:
# default <work>/models, shared, so each random-weight model is written once; the dry run passes the test
# host's, where the fixtures already are).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PART="${1:?usage: gpu_suite.sh tests|image|encode|video|scenes [options]}"; shift
KIT="${VRAMFIT_GPU_KIT:-$ROOT/.gpu}"
WORK="${VRAMFIT_GPU_WORK:-${TMPDIR:-/tmp}/vramfit-gpu}"
OUTDIR="${OUT:-$ROOT/outputs/gpu_suite}"
PY="${VRAMFIT_SUITE_PYTHON:-python3}"
MODELS="${VRAMFIT_SUITE_MODELS:-$WORK/models}"
log() { echo "[vramfit-gpu] $*" >&2; }
[[ -d "$KIT/hosts" ]] || { log "no kit at $KIT: run 'bash scripts/gpu_kit.sh' first"; exit 2; }
mkdir -p "$WORK/hosts" "$OUTDIR"

# 1. The packages the device lacks (cp312 only: the dry run's interpreter keeps its own packages).
if [[ -f "$KIT/site.tar.xz" ]]; then
  if [[ "$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')" == 312 ]]; then
    if [[ "$(cat "$WORK/site.id" 2>/dev/null)" != "$(cat "$KIT/site.tar.xz.id" 2>/dev/null)" ]]; then
      rm -rf "$WORK/site"; mkdir -p "$WORK/site"
      tar -C "$WORK/site" -xJf "$KIT/site.tar.xz"
      cp "$KIT/site.tar.xz.id" "$WORK/site.id"
      log "installed the kit's packages into $WORK/site"
    fi
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    log "not installing the kit's CPython 3.12 packages into $("$PY" -V 2>&1): using the interpreter's own"
  fi
fi

# 2. Each ComfyUI of the kit, unpacked once (per kit file), with this pack linked in; a host unpacked
# earlier from a kit file that is gone (a kit rebuilt without 0.33.0) is removed, so it never runs.
shopt -s nullglob
tarballs=("$KIT"/hosts/comfyui-*.tar.xz)
(( ${#tarballs[@]} )) || { log "no ComfyUI in $KIT/hosts: run 'bash scripts/gpu_kit.sh' first"; exit 2; }
for dest in "$WORK"/hosts/comfyui-*; do
  if [[ ! -f "$KIT/hosts/$(basename "$dest").tar.xz" ]]; then
    rm -rf "$dest"; log "removed $dest: the kit no longer holds $(basename "$dest")"
  fi
done
log "the kit's hosts: $(for t in "${tarballs[@]}"; do basename "$t" .tar.xz; done | tr '\n' ' ')"
for tarball in "${tarballs[@]}"; do
  name="$(basename "$tarball" .tar.xz)"
  dest="$WORK/hosts/$name"
  if [[ "$(cat "$dest/.id" 2>/dev/null)" != "$(cat "$tarball.id" 2>/dev/null)" ]]; then
    rm -rf "$dest"; mkdir -p "$dest"
    tar -C "$dest" -xJf "$tarball"
    rm -f "$dest/ComfyUI/extra_model_paths.yaml"
    cp "$tarball.id" "$dest/.id"
    log "unpacked $name into $dest"
  fi
  mkdir -p "$dest/ComfyUI/custom_nodes"
  ln -sfn "$ROOT" "$dest/ComfyUI/custom_nodes/ComfyUI-VRAM-Fit"
  if [[ ! -L "$dest/ComfyUI/models" ]]; then
    mkdir -p "$MODELS"; cp -rn "$dest/ComfyUI/models/." "$MODELS/"; rm -rf "$dest/ComfyUI/models"
  fi
  ln -sfn "$MODELS" "$dest/ComfyUI/models"
done

cd "$ROOT"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >&2 || true
exec "$PY" -m bench.gpu_suite "$PART" --work "$WORK" --out "$OUTDIR" "$@"
