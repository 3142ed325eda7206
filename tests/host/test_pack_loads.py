"""The pack as ComfyUI's own custom-node loader sees it (in-process host)."""

from __future__ import annotations

import pathlib
import sys

import pytest

pytestmark = pytest.mark.host

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_loader_loaded_the_pack(comfy):
    from scripts.host import PACK_LINK_NAME

    assert PACK_LINK_NAME in comfy.LOADED_MODULE_DIRS, sorted(comfy.LOADED_MODULE_DIRS)
    assert pathlib.Path(comfy.LOADED_MODULE_DIRS[PACK_LINK_NAME]).resolve() == ROOT
    pack = next(m for name, m in sys.modules.items() if name.endswith(PACK_LINK_NAME))
    assert callable(pack.comfy_entrypoint)


def test_registered_nodes_match_the_pack(comfy):
    import vramfit.nodes as pack_nodes

    for cls in pack_nodes.node_classes():
        schema = cls.GET_SCHEMA()
        assert schema.node_id.startswith("VRAMFit"), schema.node_id
        assert schema.node_id in comfy.NODE_CLASS_MAPPINGS


def test_pyproject_is_read_by_comfy_config(comfy):
    from comfy_config import config_parser

    cfg = config_parser.extract_node_configuration(str(ROOT))
    assert cfg is not None
    assert cfg.tool_comfy.display_name == "VRAM Fit"
    assert cfg.tool_comfy.publisher_id == "vramfit"
    assert cfg.project.name == "comfyui-vram-fit"


def test_pack_imports_without_comfy_side_effects():
    """Importing the package must not import ComfyUI or torch-heavy node code."""
    import subprocess

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('vf', {str(ROOT / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(ROOT)!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['vf'] = m; spec.loader.exec_module(m)\n"
        "import vf.memory\n"
        "bad = [k for k in sys.modules if k == 'comfy' or k.startswith('comfy.') or k == 'nodes']\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
