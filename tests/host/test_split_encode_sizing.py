"""Sizing the split encodes costs less than the encode (issue 43 item 4), on tiny models of the host's own classes
(Wan 2.1 / 2.2, LTX-Video, HunyuanVideo 1.5, Sana's DC-AE) and the node on the Wan 2.1 fixture:

* a sizing run (``size_only``) runs each shape of tile once after the store exists and sizes the same peak, to
  the byte, as the run of every tile, in fewer prefix runs;
* the planner sizes no candidate whose largest tile (with its halo) is not smaller than one sized before it: on a
  frame not much larger than the halo, every smaller tile runs the whole frame again;
* the lower bound before any sizing (what the prefix's residual blocks hold at once on the smallest candidate's
  largest tile, traced: ``vae.encode_split.held_blocks``) is at most every plan's sized peak, and a budget below it
  is the node's error before anything is sized.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vramfit.memory.executors import split_encode as se
from vramfit.memory.measure.sizing import MetaSizer
from vramfit.memory.vae import encode_split as es

from tests.helpers import sized_needs
from tests.video_refs import TINY_HV15_RATIO, TINY_LTX_RATIO, tiny_hv15, tiny_ltx, tiny_wan

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread", "inference_mode")]

# family -> (builder, latent ratio, frames, latent px h x w, tile in prefix px)
CASES = {
    "wan2.1": (lambda: tiny_wan("2.1"), 8, 5, (6, 10), 2),
    "wan2.2": (lambda: tiny_wan("2.2"), 16, 5, (6, 10), 2),
    "ltx_video": (tiny_ltx, TINY_LTX_RATIO, 9, (6, 10), 2),
    "hunyuan_video15": (tiny_hv15, TINY_HV15_RATIO, 5, (6, 10), 2),
    "dc-ae": (None, 8, 0, (6, 10), 4),
}


def _model(family: str):
    build = CASES[family][0]
    if build is not None:
        return build()
    from scripts.sana_vae import _dcae_class
    from tests.host.test_dcae_encode import TINY

    torch.manual_seed(0)
    return _dcae_class()(**TINY).eval()


@pytest.fixture(scope="module")
def models(comfy):
    return {}


def _setup(models, family: str):
    """(model, split, prefix ratio, halo, input shape, tile in prefix px)."""
    if family not in models:
        models[family] = _model(family)
    m = models[family]
    split, reason = es.encode_split(m)
    assert reason is None, reason
    _, ratio, frames, (h, w), tile = CASES[family]
    pr = es.prefix_ratio(m, split, ratio)
    video = frames > 0
    halo = se.split_halo(m, split, pr, 3, torch.float32, torch.device("cpu"), video)
    shape = (1, 3, frames, h * ratio, w * ratio) if video else (1, 3, h * ratio, w * ratio)
    return m, split, pr, halo, shape, tile


def _sized(m, split, pr, halo, shape, tile, size_only) -> tuple[int, int]:
    """(peak bytes, prefix runs) of one sizing run."""
    runs = []

    def counted(model, x):
        runs.append(1)
        return split.prefix(model, x)

    one = dataclasses.replace(split, prefix=counted)
    with MetaSizer([m], torch.float32, "cpu") as s:
        x = torch.empty(shape)
        out = se.encode_split_tiled(m, x, tile, pr, one, halo=halo, size_only=size_only)
        del out, x
    return s.peak_bytes, len(runs)


@pytest.mark.parametrize("family", [f if f != "wan2.2" else pytest.param(f, marks=pytest.mark.slow) for f in CASES])
def test_a_sizing_run_counts_repeated_tiles_to_the_byte(models, family):
    m, split, pr, halo, shape, tile = _setup(models, family)
    full, n_full = _sized(m, split, pr, halo, shape, tile, False)
    memo, n_memo = _sized(m, split, pr, halo, shape, tile, True)
    assert memo == full, (family, memo, full)
    assert n_memo < n_full, (family, n_memo, n_full)


@pytest.fixture(scope="module")
def wan21(comfy, fixture_vaes):
    import sys

    mod = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEEncode"].__module__]
    return mod, comfy.VAELoader().load_vae(fixture_vaes["wan21"])[0]


@pytest.mark.parametrize("hw, least", [((64, 64), 1), ((16, 256), 2)])
def test_the_planner_sizes_only_candidates_with_a_smaller_largest_tile(wan21, monkeypatch, hw, least):
    """A budget nothing fits: the exact candidates sized are those whose largest tile (with its halo) is smaller
    than every one sized before; on a frame of 8 x 8 latent px (within the halo) that is the first alone."""
    from vramfit.memory.plan import encode as pe
    from vramfit.memory.plan.grid import ImpossibleBudgetError

    from tests.host.test_tiled_encode_exact import _pixels

    mod, vae = wan21
    job = mod._validate(vae, _pixels(5, *hw, seed=2), 0)
    assert job.split is not None and job.halo > 0
    sized = []
    real = pe._size

    def recorded(job, cfg, *a, **k):
        if cfg is not None:
            sized.append(cfg)
        return real(job, cfg, *a, **k)

    monkeypatch.setattr(pe, "_size", recorded)
    with pytest.raises(ImpossibleBudgetError):
        pe.plan(job, pe.lower_bound(job)[0])  # at the bound: sized, and nothing fits
    assert len(sized) >= least, sized
    extents = [pe.tile_extent(job, c) for c in sized]
    for k, n in enumerate(extents):  # each sized one smaller on some side than every one sized before it
        assert all(any(a < b for a, b in zip(n, e, strict=True)) for e in extents[:k]), extents
    for cfg in pe.candidates(job):  # every candidate left out is no smaller than one sized
        if cfg not in sized:
            n = pe.tile_extent(job, cfg)
            assert any(all(a >= b for a, b in zip(n, e, strict=True)) for e in extents), (cfg, n, extents)
    if least == 1:
        assert len(sized) == 1 and extents[0] == (hw[0] // 8, hw[1] // 8), (sized, extents)


class _Vae:
    """What the planner reads of ComfyUI's VAE around a tiny model."""

    def __init__(self, model, latent_channels: int):
        self.first_stage_model = model
        self.latent_channels = latent_channels


def _job(models, family: str):
    from vramfit.memory.plan import encode as pe

    m, split, pr, halo, shape, _ = _setup(models, family)
    return pe.EncodeJob(_Vae(m, 4), torch.empty(shape), family, torch.float32, torch.device("cpu"),
                        torch.device("cpu"), "test", split=split, halo=halo, latent_ratio=CASES[family][1],
                        prefix_ratio=pr)


@pytest.mark.parametrize("family", list(CASES))
def test_the_lower_bound_is_below_every_sized_plan(models, family):
    """:func:`lower_bound` of a split job, from the traced residual blocks before any sizing, is at most the sized
    peak of every plan (the encoder's own forward and every candidate tile), and not a token bound."""
    from vramfit.memory.plan import encode as pe

    job = _job(models, family)
    least, what = pe.lower_bound(job)
    sized = sized_needs(pe, job)
    assert least <= min(sized), (least, sized)
    assert least >= 0.2 * min(sized), (least, sized)  # it refuses what cannot fit, not a token bound
    assert "residual block" in what, what  # the family describes its residual blocks


def test_an_impossible_budget_is_refused_before_any_sizing(wan21, fresh_stores, monkeypatch):
    """Temporal-Chunk Video Encode under a budget below the split's lower bound: the node's error at once, naming
    the node, the budget and the bound; nothing sized."""
    from vramfit.memory.decode.encode import VIDEO_REPORT_NODE
    from vramfit.memory.plan import encode as pe

    from tests.host.test_tiled_encode_exact import _pixels

    mod, vae = wan21
    pixels = _pixels(9, 64, 64, seed=4)
    least = pe.lower_bound(mod._validate(vae, pixels, 0))[0]
    budget_mb = int(least / 2**20 * 0.9)
    assert budget_mb >= 1, least  # 0 would mean free memory

    def no_sizing(*a, **k):
        raise AssertionError("sized a plan for a budget below the lower bound")

    monkeypatch.setattr(pe, "MetaSizer", no_sizing)
    with pytest.raises(ValueError) as e:
        mod.encode(vae, pixels, budget_mb=budget_mb, node=VIDEO_REPORT_NODE)
    text = str(e.value)
    assert "Temporal-Chunk Video Encode" in text and f"{budget_mb}.0 MiB" in text, text
    assert f"at least {least / 2**20:,.1f} MiB" in text and "before any sizing" in text, text
    assert "residual block" in text, text  # the prefix's bound, not the latent alone
