"""The first decode of each fixture image family plans from shipped cost models: nothing is calibrated.

Tiled VAE Decode's first decode of a VAE structure needs the untiled decode's cost model
(``memory/cost/data/*.json``) and, for KL decoders, the exact executor's (``memory/cost/data/exact/*.json``).
A structure without shipped models is calibrated by meta sizing at first use (measured on a busy 2-core CPU,
0.3.75: FLUX.1's exact models 12 s, FLUX.2's 33.5 s; Hunyuan Image 2.1's 7 s). Here the node's cost-model
stores are fresh, pointed at an empty folder (only the shipped defaults behind them), and each first decode
under a budget that forces tiles must calibrate nothing: no calibrations in the result or the report, nothing learned or written. Sana's
DC-AE (loaded as ComfyUI_ExtraModels does, exact split tiles) needs the untiled model and its suffix's
(``bench/cost_model.py --families dcae_sana --write``). The shipped models are keyed by the real structure, so Hunyuan
Image 2.1 runs on its full-size fixture (``VRAMFIT_FULL_FIXTURES=1``; its narrow twin is another structure).
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from scripts.fixtures.kinds import FIXTURES, NARROW_KINDS
from scripts.fixtures.latents import structured_latent
from tests.helpers import full_size

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.first_use_shipped")

NODE_ID = "VRAMFit_TiledVAEDecode"
OUT_PX = 128
BUDGET_MB = {"kl_f8": 48, "flux": 48, "flux2": 48, "hunyuan_image": 48, "dcae_sana": 0}
"""Below the untiled decode of a 128x128 image (float32, CPU), above exact tiles. The DC-AE's tiles are set by
the user (``TILE``); its budget is the free memory."""
TILE = {"dcae_sana": 32}
OUT = {"dcae_sana": 64}
"""The DC-AE's image: 2x2 suffix tiles of 4x4 px at 1/8 resolution."""
PATH = {"kl_f8": "exact", "flux": "exact", "flux2": "exact", "hunyuan_image": "exact", "dcae_sana": "split"}


@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[NODE_ID].__module__]


@pytest.fixture
def fresh_stores(tiled, monkeypatch, tmp_path):
    """The node's cost-model stores, new, backed by files in an empty folder (the shipped defaults behind)."""
    base = tiled.__name__.rsplit(".nodes.", 1)[0]
    node_env = sys.modules[f"{base}.nodes._decode_node"]
    exact = sys.modules[f"{base}.memory.cost.exact"]
    phases = sys.modules[f"{base}.memory.cost.phases"]
    stores = {
        "cost_models.json": phases.CostModelStore(tmp_path / "cost_models.json"),
        "exact_cost_models.json": exact.ExactCostStore(tmp_path / "exact_cost_models.json"),
    }
    monkeypatch.setattr(node_env, "_STORES", dict(stores))
    return stores, tmp_path


@pytest.fixture
def loaded_vae(comfy, fixture_vaes, host_config, request):
    """The fixture VAE of ``request.param`` as the workflows load it; unloaded afterwards."""
    import comfy.model_management as mm

    if request.param == "dcae_sana":
        from scripts.sana_vae import load_dcae

        yield load_dcae(str(host_config.models_dir / "vae" / fixture_vaes["dcae_sana"]), torch.float32)
        return
    vae = comfy.VAELoader().load_vae(fixture_vaes[request.param])[0]
    yield vae
    others = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
    mm.free_memory(1e30, vae.patcher.load_device, keep_loaded=others)


@pytest.mark.parametrize("loaded_vae", [pytest.param(k, marks=full_size) if k in NARROW_KINDS else k
                                        for k in BUDGET_MB], indirect=True)
def test_first_tiled_decode_calibrates_nothing(tiled, loaded_vae, fresh_stores, request) -> None:
    kind = request.node.callspec.params["loaded_vae"]
    stores, folder = fresh_stores
    spec = FIXTURES[kind]
    px = OUT.get(kind, OUT_PX)
    side = px // spec.spatial_ratio
    z = structured_latent((1, spec.latent_channels, side, side), seed=7)
    with torch.inference_mode():
        r = tiled.decode(loaded_vae, {"samples": z}, budget_mb=BUDGET_MB[kind], tile_size=TILE.get(kind, 0))
    text = r.report.text()
    log.info("%s: first decode planned in %.2f s, decoded in %.2f s\n%s", kind, r.plan_seconds, r.seconds,
             text)
    # Tiles, not the untiled decode: the plan needed the untiled model and the tiles' (exact ones) too.
    assert r.plan.path == PATH[kind], text
    c = r.plan.config
    assert c.rows * c.cols > 1 if kind == "dcae_sana" else not c.whole, text
    assert r.images.shape == (1, px, px, 3)
    assert r.calibrations == [], (r.calibrations, text)
    assert "calibrated" not in dict(r.report.rows), text
    assert not any("calibrat" in value for _, value in r.report.rows), text
    for name, store in stores.items():
        learned = [k for k in store.keys() if not store.is_default(k)]
        assert learned == [], (name, learned)
    assert sorted(p.name for p in folder.iterdir()) == [], "a cost model was learned and written"
