"""Temporal-Chunk Video Encode (issue 24): the Wan prefix/suffix split (``executors.split_encode``) on the host's own
Wan 2.1 / 2.2 classes, and the node as ComfyUI runs it, vs the host's own encode.

* The split: the encoder's local part (``conv1``, ``downsamples``) in spatial tiles extended by its reach, each
  through the host's own chunk loop (0.3.75: chunks of 4 frames, cloned caches; 0.33.0: 2 frames, per-call
  caches, deferred frames); ``middle`` and ``head`` on whole latent frames. Thresholds: max abs diff vs
  ``model.encode`` <= 1e-5 (float32, tiny models: every layer of the host, 8-32 channels), >= 4 tiles, >= 3
  temporal chunks per tile; a halo below the reach differs by > 1e-3 (so the test can fail); an OOM inside a
  tile splits it and resumes (same latent within 1e-5).
* The node on the random-weight fixtures: <= 1e-4 vs ``VAEEncode`` in tiles, ``torch.equal`` untiled, a budget
  below the untiled peak takes tiles within it, bad input names the node and the value, Cancel stops it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch
from vramfit.memory.decode.encode import VIDEO_REPORT_NODE
from vramfit.memory.executors import split_encode as se
from vramfit.memory.vae import encode_split as es

from scripts.fixtures.narrow import narrow
from tests.host.test_tiled_encode_exact import _pixels
from tests.video_refs import tiny_wan

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread", "inference_mode")]
log = logging.getLogger("vramfit.tests.video_encode")

NODE_ID = "VRAMFit_TemporalChunkVideoEncode"
RATIO = {"2.1": 8, "2.2": 16}
MiB = 2**20
WAN = es.DESCRIPTIONS[0]


def _halo(m, ratio: int) -> int:
    """The Wan prefix's traced reach (latent px)."""
    return se.split_halo(m, WAN, ratio, 3, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny(comfy):
    return {v: tiny_wan(v) for v in RATIO}


def _x(version: str, frames: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    r = RATIO[version]
    g = torch.Generator().manual_seed(seed)
    return torch.rand((1, 3, frames, h * r, w * r), generator=g) * 2 - 1


@pytest.mark.parametrize("version, frames", [("2.1", 14), ("2.2", 13), pytest.param("2.1", 13, marks=pytest.mark.slow),
                                             pytest.param("2.2", 14, marks=pytest.mark.slow)])
def test_split_equals_the_hosts_encode(tiny, version, frames):
    m, x = tiny[version], _x(version, frames, 4, 28)
    calls = []
    hook = m.encoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        out = se.encode_split_tiled(m, x, 3, RATIO[version], WAN, progress=lambda d, t: calls.append(0))
    finally:
        hook.remove()
    ref = m.encode(x)
    n_tiles = 2 * 10  # spans(4, 3) x spans(28, 3)
    suffix = 1 + -(-(out.shape[2] - 1) // es.SUFFIX_FRAMES)  # the suffix's calls: [0, 1), then 2 at a time
    chunks = (sum(calls) - suffix) / n_tiles  # the host's encoder calls per tile
    diff = (out - ref).abs().max().item()
    log.info("Wan %s, %d frames: split vs encode max abs %.2e, %.1f chunks per tile", version, frames, diff, chunks)
    assert out.shape == ref.shape and diff <= 1e-5
    assert calls.count(0) == n_tiles >= 4 and chunks >= 3


def test_a_halo_below_the_reach_differs(tiny):
    m, x = tiny["2.1"], _x("2.1", 9, 4, 28)
    assert _halo(m, 8) == 10
    diff = (se.encode_split_tiled(m, x, 4, 8, WAN, halo=3) - m.encode(x)).abs().max().item()
    assert diff > 1e-3, diff


def test_reach_of_the_real_encoders(comfy, fixture_vaes):
    for kind, ratio in (("wan21", 8), (narrow("wan22"), 16)):  # Wan 2.2's narrow twin: the reach is the structure's
        vae = fixture_vaes.load(comfy, kind)
        assert int(vae.spacial_compression_encode()) == ratio
        assert es.encode_split(vae.first_stage_model) == (WAN, None)
        assert _halo(vae.first_stage_model, ratio) == 10


def test_oom_inside_a_tile_splits_it_and_resumes(tiny):
    m, x = tiny["2.2"], _x("2.2", 9, 4, 12)
    ooms = []

    def fault(k: int) -> None:
        if k == 2:
            raise torch.OutOfMemoryError("injected")

    out = se.encode_split_tiled(m, x, 6, 16, WAN, fault_hook=fault, on_oom=lambda: ooms.append(1))
    assert ooms == [1]
    assert (out - m.encode(x)).abs().max().item() <= 1e-5


def test_oom_at_the_smallest_tile_raises_the_original_error(tiny):
    m, x = tiny["2.2"], _x("2.2", 5, 4, 12)
    ooms = []

    def fault(k: int) -> None:
        raise torch.OutOfMemoryError(f"injected {k}")

    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        se.encode_split_tiled(m, x, 6, 16, WAN, fault_hook=fault, on_oom=lambda: ooms.append(1))
    assert ooms == [1]  # the 4x6 tile split once (into 4x3 halves); the first half fails again and ends it


# ------------------------------------------------------------------------------ the node


@pytest.fixture(scope="module")
def mod(comfy):
    """The encode nodes' shared module (``encode``, ``_validate``, ``comfy_env``)."""
    assert comfy.NODE_CLASS_MAPPINGS[NODE_ID].__module__.endswith(".nodes.video_encode")
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEEncode"].__module__]


@pytest.fixture(scope="module")
def wan21(comfy, fixture_vaes):
    vae = comfy.VAELoader().load_vae(fixture_vaes["wan21"])[0]
    pixels = _pixels(13, 16, 64, seed=7)  # 13 frames: 4 latent frames; 2 x 8 latent px
    (ref,) = comfy.VAEEncode().encode(vae, pixels)
    return vae, pixels, ref["samples"].clone()


def test_schema(comfy):
    schema = comfy.NODE_CLASS_MAPPINGS[NODE_ID].define_schema()
    assert schema.display_name == "Temporal-Chunk Video Encode (VRAM Fit)"
    assert [i.id for i in schema.inputs] == ["pixels", "vae", "tile_size", "budget_mb", "unload_others"]


def test_node_tiles_equal_vae_encode(mod, wan21):
    vae, pixels, ref = wan21
    r = mod.encode(vae, pixels, tile_size=16, node=VIDEO_REPORT_NODE)
    rows = dict(r.report.rows)
    assert r.plan.path == "exact" and "1x4 tiles" in r.report.summary, r.report.text()
    assert "self-check passed" in rows["check"] and rows["path"].startswith("exact: the encoder's local part")
    assert r.latent.shape == ref.shape and (r.latent - ref).abs().max().item() <= 1e-4
    auto = mod.encode(vae, pixels)
    assert auto.plan.path == "untiled" and torch.equal(auto.latent, ref)


@pytest.mark.slow
def test_a_budget_below_the_untiled_peak_takes_tiles(comfy, mod, wan21):
    """A budget between the untiled encode's sized peak and that of tiles of 32 px: exact tiles, within it."""
    from vramfit.memory.plan import encode as pe

    vae = wan21[0]
    pixels = _pixels(5, 16, 256, seed=8)  # 2 x 32 latent px: tiles of 4 latent px reach 24 of them
    (ref,) = comfy.VAEEncode().encode(vae, pixels)
    job = mod._validate(vae, pixels, 0)
    untiled, tiled = (pe._out_bytes(job) + pe.encode_peak(job, cfg, pe.PeakStore(), 1 << 30)
                      for cfg in (None, pe.ExactEncode(32, "device")))
    assert tiled < 0.9 * untiled, (tiled, untiled)
    budget = (tiled + untiled) // 2 // MiB
    r = mod.encode(vae, pixels, budget_mb=budget)
    assert r.plan.path == "exact", r.report.text()
    assert r.measured_peak is not None and r.measured_peak <= budget * MiB, r.report.text()
    assert (r.latent - ref["samples"]).abs().max().item() <= 1e-4


def test_bad_tile_size_names_node_and_value(comfy, fixture_vaes, mod):
    vae = fixture_vaes.load(comfy, narrow("wan22"))
    with pytest.raises(ValueError) as e:
        mod.encode(vae, _pixels(5, 32, 32, seed=1), tile_size=24, node=VIDEO_REPORT_NODE)
    assert "Temporal-Chunk Video Encode" in str(e.value) and "tile_size 24" in str(e.value)
    assert "multiple of 16" in str(e.value)


def test_cancel_stops_between_tiles(mod, wan21):
    from vramfit.memory.decode.encode import encode_image

    class Interrupted(Exception):
        pass

    vae, pixels, _ = wan21
    calls = []

    def stop() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Interrupted

    job = mod._validate(vae, pixels, 16)
    env = dataclasses.replace(mod.comfy_env(), should_stop=stop)
    with pytest.raises(Interrupted):
        encode_image(job, env)
    assert len(calls) == 3
