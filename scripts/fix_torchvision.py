"""Make a CUDA-only torchvision wheel importable on a CPU-only torch (used by setup_host.sh).

torchvision 0.28 has no CPU build on PyPI. Its CUDA wheel installs, but ``import torchvision``
fails with ``operator torchvision::nms does not exist``: ``_meta_registrations.py`` registers fake
kernels for the compiled ops ``nms``/``qnms`` even when the compiled extension could not load.
This patch skips those two registrations when the compiled ops are missing (the same guard the
file already applies to its other ops), so the pure-Python parts that ComfyUI imports work.
It only touches the installed torchvision of the interpreter running it, and is idempotent.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import sys

MARK = "# vramfit: guarded register_fake"
GUARD = f'''
{MARK}
def _vramfit_register_fake(name):
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn

'''


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[vramfit-setup] %(message)s")
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        logging.error("torchvision is not installed for %s", sys.executable)
        return 1
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    text = path.read_text()
    if MARK in text:
        logging.info("torchvision already patched: %s", path)
        return 0
    needle = '@torch.library.register_fake("torchvision::'
    if needle not in text:
        logging.error("unexpected torchvision layout, not patched: %s", path)
        return 1
    anchor = "\n\n@functools.lru_cache"
    text = text.replace(needle, '@_vramfit_register_fake("torchvision::')
    text = text.replace(anchor, "\n" + GUARD + anchor.lstrip("\n"), 1)
    path.write_text(text)
    logging.info("patched %s (fake kernels only when compiled ops exist)", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
