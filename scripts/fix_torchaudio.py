"""Make a torchaudio wheel built for another torch importable (used by setup_host.sh).

ComfyUI 0.33 imports torchaudio at start-up (``comfy/sd.py`` -> the LTX audio VAE). No torchaudio on
PyPI matches the local CPU torch 2.13: the newest (2.11.0, a CUDA build) installs with ``--no-deps``
but its compiled libraries fail to load (``OSError: Could not load this library``), and
``torchaudio/_extension/utils.py:_load_lib`` lets that error stop ``import torchaudio``. This patch
makes ``_load_lib`` report such a library as absent (return False, logged), the case torchaudio
already handles: the compiled ops are unavailable and the pure-Python parts (``resample``,
``MelSpectrogram``, ...) work. Only the torchaudio of the interpreter running it is touched;
idempotent.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import sys

MARK = "# vramfit: guarded load_library"
NEEDLE = "    torch.ops.load_library(paths[0])\n    return True\n"
GUARDED = f"""    {MARK}
    try:
        torch.ops.load_library(paths[0])
    except OSError as e:
        _LG.info("torchaudio: %s does not load with this torch (%s); compiled ops unavailable", paths[0], e)
        return False
    return True
"""


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[vramfit-setup] %(message)s")
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or not spec.submodule_search_locations:
        logging.error("torchaudio is not installed for %s", sys.executable)
        return 1
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "_extension" / "utils.py"
    text = path.read_text()
    if MARK in text:
        logging.info("torchaudio already patched: %s", path)
        return 0
    if NEEDLE not in text:
        logging.error("unexpected torchaudio layout, not patched: %s", path)
        return 1
    path.write_text(text.replace(NEEDLE, GUARDED, 1))
    logging.info("patched %s (a compiled library that does not load counts as absent)", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
