"""Video VAEs beyond Wan through Temporal-Chunk Video Decode with chunks forced (issue 23): exact where a path
exists, never a crash, and approximate with the reason where not.

* Mochi (``comfy.ldm.genmo``, both hosts): a causal decoder without a host cache whose temporal reach is 46
  latent frames (docs/VIDEO_DECODE.md): the carried-context executor (``memory/executors/carry.py``) decodes it
  in chunks of 1 + k latent frames, each causal convolution reading the previous chunk's last frames: equal to
  VAE Decode within 1e-4, at least 3 chunks; an out-of-memory error inside a chunk halves k and resumes there.
  (The overlap-blend it took before: 29.3 dB, max abs 0.25, k = 2, 4 latent frames.)
* HunyuanVideo 1.5 (``comfy.ldm.hunyuan_video.vae_refiner``, both hosts): attention over the whole clip in its
  mid block, then causal convolutions that carry their last 2 input frames: the carried-context executor runs
  ``conv_in`` and the mid block once on the whole latent, then the up path in chunks of k >= 2 latent frames with
  the host's own carry lists: equal to VAE Decode within 1e-4, at least 3 chunks; an OOM halves k (not below 2).
* LTX-Video 0.9.0, 0.9.1 and 0.9.5+ (``comfy.ldm.lightricks``, both hosts): local in space but symmetric in time
  (~20 latent frames of reach each side): spatial tiles of the whole clip with the traced halo; a timestep-
  conditioned decode mixes unseeded noise into the latent, drawn once on the whole latent as the host draws it, and
  0.9.1's blocks add fresh noise fields per call, replayed from the host's whole-frame draws: equal to VAE Decode
  from the same random state within 1e-4, at least 4 tiles, for a batch of two, and on 0.33 with the host's
  decode split in time (``run_up``) where the tiles are not.
* CogVideoX (``comfy.ldm.cogvideo``, ComfyUI 0.33 only): the host's decode is itself rolling (its low-resolution
  phase on the whole clip, then chunks of 4 frames with causal caches and per-chunk GroupNorm): the carried-context
  executor runs that phase once and then whole numbers of the host's chunks with its caches: equal to VAE Decode
  within 1e-4, 3 chunks. An even number of latent frames decodes to ``4 T`` frames, not the ``4 T - 3`` of its
  ``upscale_ratio``: the output takes the host's count. (Before: an approximate overlap-blend of odd chunks, and
  a shape error on an even latent.)

Mochi, HunyuanVideo 1.5 and LTX-Video run on their narrow twins (``scripts.fixtures.kinds.NARROW_KINDS``: the host's
classes with a half or a quarter of the channels; reach, tiles and chunks depend on the structure, not the width); the
full-size fixtures once per family in ``test_full_size_decode_is_exact`` (``VRAMFIT_FULL_FIXTURES=1``, as CI runs).
"""

from __future__ import annotations

import importlib
import logging
import math
import sys

import pytest
import torch

from scripts.fixtures.host import available
from scripts.fixtures.kinds import FIXTURES
from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow
from tests.helpers import full_size

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]
log = logging.getLogger("vramfit.tests.video_coverage")


@pytest.fixture(scope="module")
def video(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TemporalChunkVideoDecode"].__module__]


def _case(comfy, fixture_vaes, kind: str, shape: tuple[int, ...]):
    vae = fixture_vaes.load(comfy, kind)
    z = structured_latent(shape, seed=4)
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
    return vae, z, ref


def _release(vae) -> None:
    """Unload a fixture VAE from ComfyUI's model management (the big video VAEs hold GBs in float32; one family's
    tests run at a time)."""
    import comfy.model_management as mm

    others = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
    mm.free_memory(1e30, vae.patcher.load_device, keep_loaded=others)


def _held_case(comfy, fixture_vaes, kind: str, shape: tuple[int, ...]):
    """A class fixture's body: :func:`_case`, then the VAE released when the class is done."""
    case = _case(comfy, fixture_vaes, kind, shape)
    yield case
    _release(case[0])


def _oom_in_second_chunk(video, vae, z: torch.Tensor, k: int):
    """``(result, fired)``: the node's decode with ``frames_per_chunk`` k and an OOM injected once, in the second
    chunk."""
    fired: list[int] = []

    def hook(kind: str, step: int) -> None:
        if kind == "step" and step == 1 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected in the second chunk")

    video._FAULT_HOOK = hook
    try:
        return video.decode(vae, {"samples": z}, frames_per_chunk=k), fired
    finally:
        video._FAULT_HOOK = None


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="class")
def mochi(comfy, fixture_vaes):
    yield from _held_case(comfy, fixture_vaes, narrow("mochi"), (1, 12, 4, 4, 4))


class TestMochi:
    """Mochi's carried chunks (its VAE loaded for this class only)."""

    @pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow)])
    def test_mochi_carried_chunks_are_exact(self, mochi, video, k):
        vae, z, ref = mochi
        r = video.decode(vae, {"samples": z}, frames_per_chunk=k)
        text = r.report.text()
        assert r.plan.path == "carry" and r.plan.exact, text
        assert r.stats["chunks"] >= 3, text
        assert r.report.summary.startswith("exact"), text
        assert "carried chunks: self-check passed" in text, text
        assert r.images.shape == ref.shape, (tuple(r.images.shape), tuple(ref.shape))
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    def test_the_hosts_own_decode_runs_no_carried_check(self, mochi, video, monkeypatch):
        """The verify step: at free memory the host's own decode fits and relies on no chunk executor, so the
        carried chunks' self-check does not run (before: every decode of a carried family ran it first); the chunks
        the user asks for run only after it."""
        vae, z, ref = mochi
        engine = sys.modules[video.__name__.rsplit(".nodes.", 1)[0] + ".memory.decode.video"]
        real, calls = engine.check_carried, []

        def counted(*a, **k):
            calls.append(1)
            return real(*a, **k)

        monkeypatch.setattr(engine, "check_carried", counted)
        r = video.decode(vae, {"samples": z})
        assert r.plan.path == "host" and not calls and "carried chunks" not in r.report.text(), r.report.text()
        assert (r.images - ref).abs().max().item() <= 1e-4
        r = video.decode(vae, {"samples": z}, frames_per_chunk=1)
        assert r.plan.path == "carry" and calls == [1], r.report.text()
        assert "carried chunks: self-check passed" in r.report.text()

    @pytest.mark.slow
    def test_mochi_sizing_run_equals_the_whole_run(self, mochi):
        vae, z, ref = mochi
        model = vae.first_stage_model
        layout = _engine("vae.carry_layout").carry_layout(model).require()
        assert_sizing_run_is_exact(model, layout, (1, 12, 9, 4, 4), (1, 3, 49, 32, 32),
                                   [(2, None, 0, True), (2, None, 0, False)])

    @pytest.mark.slow
    def test_mochi_carried_chunks_resume_after_oom(self, mochi, video):
        vae, z, ref = mochi
        r, fired = _oom_in_second_chunk(video, vae, z, 2)
        text = r.report.text()
        assert fired == [1] and r.stats["shrinks"] == 1, text
        assert "oom" in dict(r.report.rows), text
        assert (r.images - ref).abs().max().item() <= 1e-4, text


@pytest.fixture(scope="class")
def hv15(comfy, fixture_vaes):
    yield from _held_case(comfy, fixture_vaes, narrow("hunyuan_video15"), (1, 32, 7, 2, 3))


class TestHunyuanVideo15:
    """HunyuanVideo 1.5's prefix and carried chunks and tiles (its VAE loaded for this class only)."""

    @pytest.mark.parametrize("k", [pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
    def test_hunyuan_video15_carried_chunks_are_exact(self, hv15, video, k):
        vae, z, ref = hv15
        r = video.decode(vae, {"samples": z}, frames_per_chunk=k)
        text = r.report.text()
        assert r.plan.path == "carry" and r.plan.exact, text
        assert r.stats["chunks"] >= 3, text
        assert r.report.summary.startswith("exact"), text
        assert "carried chunks: self-check passed" in text and "mid block" in text, text
        assert r.images.shape == ref.shape, (tuple(r.images.shape), tuple(ref.shape))
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    def test_hunyuan_video15_carried_tiles_are_exact(self, hv15, video):
        """Spatial tiles: the chunks after the prefix are local, each tile carries its own context (tile_size 16 px:
        one latent px per tile core, 2x3 tiles, each read with the traced halo)."""
        vae, z, ref = hv15
        r = video.decode(vae, {"samples": z}, frames_per_chunk=2, tile_size=16)
        text = r.report.text()
        assert r.plan.path == "carry" and r.plan.config.tile == (1, 1) and r.stats["tiles"] == 6, text
        assert r.plan.halo >= 7, text  # the up path's first stage alone reaches 7 latent px
        assert "tile-chunks" in r.report.summary and r.report.summary.startswith("exact"), text
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    @pytest.mark.slow
    def test_hunyuan_video15_in_place_holds_less_and_is_exact(self, hv15, video):
        """Context spent in place, as the host spends its carry lists: the same frames in less memory than with the
        rollback copy (live tensor bytes), and the planner predicts the difference."""
        from vramfit.memory.decode.video import make_job
        from vramfit.memory.executors.carry import decode_carried
        from vramfit.memory.measure.tracker import PeakTracker
        from vramfit.memory.plan.video import PeakStore, carry_chunk_peak, carry_floor, carry_planned

        vae, z, ref = hv15
        model = vae.first_stage_model
        job = make_job(vae, z, "cpu", frames_per_chunk=2)
        peaks, outs = {}, {}
        for rollback in (True, False):
            out = torch.empty((1, 3, ref.shape[0], ref.shape[1], ref.shape[2]), dtype=torch.float32)
            with PeakTracker("cpu") as t:
                decode_carried(model, job.carry, z, 2, out=out, dtype=job.dtype, compute_device="cpu",
                               rollback=rollback)
            peaks[rollback], outs[rollback] = t.peak_bytes, out
        assert torch.equal(outs[True], outs[False])
        got = vae.process_output(outs[False])[0].permute(1, 2, 3, 0)  # (frames, H, W, 3), as VAE Decode
        assert (got - ref).abs().max().item() <= 1e-4
        predicted = {rb: carry_chunk_peak(job, 2, PeakStore(), rollback=rb) for rb in (True, False)}
        log.info("hv15 carried chunks: tracked rollback %d / in place %d B; predicted %d / %d B", peaks[True],
                 peaks[False], predicted[True], predicted[False])
        assert peaks[False] < peaks[True] and predicted[False] < predicted[True], (peaks, predicted)
        floor = carry_floor(job, PeakStore())  # the prefix on the whole latent, plus the output buffer
        planned = carry_planned(job, 2, PeakStore(), rollback=False)
        assert out.numel() * 4 < floor <= planned, (floor, planned)

    def test_hunyuan_video15_resumes_after_oom_not_below_two_frames(self, hv15, video):
        vae, z, ref = hv15
        r, fired = _oom_in_second_chunk(video, vae, z, 3)
        text = r.report.text()
        # k = 3 halves to 1, held at the family's 2: chunks [0, 3), [3, 6) failed, [3, 5), [5, 7)
        assert fired == [1] and r.stats["shrinks"] == 1 and r.stats["frames_per_chunk"] == 2, text
        assert (r.images - ref).abs().max().item() <= 1e-4, text



class _Small(torch.nn.Module):
    """The host's HunyuanVideo 1.5 ``Decoder`` class at small widths (so tiles are far smaller than the frame)."""

    def __init__(self, decoder_cls: type) -> None:
        super().__init__()
        self.decoder = decoder_cls(z_channels=4, out_channels=3, block_out_channels=[16, 16, 8], num_res_blocks=1,
                                   ffactor_spatial=4, ffactor_temporal=2)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


def _small_ltx():
    """The host's LTX-Video ``VideoVAE`` class at small widths (no timestep conditioning, symmetric in time)."""
    ltx = importlib.import_module("comfy.ldm.lightricks.vae.causal_video_autoencoder")
    blocks = [["res_x", {"num_layers": 1}], ["compress_all", {"residual": True, "multiplier": 2}],
              ["res_x", {"num_layers": 1}]]
    return ltx.VideoVAE(config={"dims": 3, "latent_channels": 128, "encoder_blocks": [["res_x", {"num_layers": 1}]],
                                "decoder_blocks": blocks, "patch_size": 2, "norm_layer": "pixel_norm",
                                "causal_decoder": False})


def _init_small(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # ComfyUI's ops skip initialisation
        stats = [(n, b) for n, b in model.named_buffers() if n.endswith("-of-means")]  # LTX's latent statistics
        for name, p in list(model.named_parameters()) + stats:
            if name.endswith(("gamma", "std-of-means")):
                torch.nn.init.uniform_(p, 0.5, 1.5)
            elif p.ndim > 1:
                torch.nn.init.normal_(p, std=p[0].numel() ** -0.5)
            else:
                torch.nn.init.normal_(p, std=0.02)
    return model.eval()


@pytest.mark.parametrize("family, channels, halo, exact", [
    ("hunyuan_video15", 4, None, True), ("hunyuan_video15", 4, 3, False),
    ("ltx_video", 128, None, True), ("ltx_video", 128, 2, False)])
def test_tiles_need_the_traced_halo(comfy, family, channels, halo, exact):
    """4x4 tiles of a 16x16 latent through the host's own classes at small widths: with the traced halo equal to
    the host's decode; with a shorter one, not (so the halo matters and the tile tests can fail)."""
    vae_mod = sys.modules[[m for m in sys.modules if m.endswith(".memory.vae.carry_layout")][0]]
    carry = importlib.import_module(vae_mod.__name__.replace(".vae.carry_layout", ".executors.carry"))
    plan_video = importlib.import_module(vae_mod.__name__.replace(".vae.carry_layout", ".plan.video"))
    torch.manual_seed(0)
    if family == "hunyuan_video15":
        model = _init_small(_Small(importlib.import_module("comfy.ldm.hunyuan_video.vae_refiner").Decoder))
    else:
        model = _init_small(_small_ltx())
    layout = vae_mod.carry_layout(model).require()
    assert layout.family == family
    z = torch.randn(1, channels, 3, 16, 16)
    with torch.inference_mode():
        ref = model.decode(z).float()
        traced = plan_video.carry_halo(model, layout, channels, torch.float32, torch.device("cpu"))
        out = torch.empty_like(ref)
        stats: dict = {}
        carry.decode_carried(model, layout, z, 2, out=out, dtype=torch.float32, compute_device="cpu",
                             tile=(4, 4), halo=traced if halo is None else halo, stats=stats)
    diff = (out - ref).abs().max().item()
    assert stats["tiles"] == 16 and traced < 12, (stats, traced)
    assert (diff <= 1e-4) == exact, (diff, traced)


def _engine(name: str):
    """A module of the pack's engine (``memory.<name>``), as the host imported it."""
    vae_mod = [m for m in sys.modules if m.endswith(".memory.vae.carry_layout")][0]
    return importlib.import_module(vae_mod.replace(".vae.carry_layout", f".{name}"))


def assert_sizing_run_is_exact(model, layout, z_shape, out_shape, cases):
    """The planner's sizing run of the carried executor (one tile per shape; the first three chunks and the last)
    meta-sizes the same peak as running every tile and chunk, for each ``(k, tile, halo, rollback)``."""
    carry, sizing = _engine("executors.carry"), _engine("measure.sizing")
    for k, tile, halo, rollback in cases:
        peaks = []
        for sized in (False, True):
            with torch.inference_mode(), sizing.MetaSizer([model], torch.float32, torch.device("cpu")) as sizer:
                z = torch.empty(z_shape, dtype=torch.float32)
                out = torch.empty(out_shape, dtype=torch.float32)
                stats: dict = {}
                carry.decode_carried(model, layout, z, k, out=out, dtype=torch.float32, compute_device="cpu",
                                     tile=tile, halo=halo, rollback=rollback, stats=stats, sizing=sized)
                del out, z
            peaks.append(sizer.peak_bytes)
        assert peaks[0] == peaks[1] > 0, (k, tile, rollback, peaks)


@pytest.mark.parametrize("family", [pytest.param("hunyuan_video15", marks=pytest.mark.slow), "ltx_video"])
def test_sizing_run_equals_the_whole_run(comfy, family):
    """Many chunks and 3x3 tiles of three shapes (the host's classes at small widths): the shortened sizing run
    the planner uses gives the same meta-sized peak as the whole run."""
    torch.manual_seed(0)
    if family == "hunyuan_video15":
        model = _init_small(_Small(importlib.import_module("comfy.ldm.hunyuan_video.vae_refiner").Decoder))
        z_shape, ks = (1, 4, 11, 15, 16), (2, 3)
    else:
        model = _init_small(_small_ltx())
        z_shape, ks = (1, 128, 3, 15, 16), (3,)
    layout = _engine("vae.carry_layout").carry_layout(model).require()
    with torch.inference_mode():
        out_shape = tuple(model.decode(torch.zeros(z_shape)).shape)
        halo = _engine("plan.video").carry_halo(model, layout, z_shape[1], torch.float32, torch.device("cpu"))
    modes = (True, False) if layout.description.temporal else (True,)
    assert_sizing_run_is_exact(model, layout, z_shape, out_shape,
                               [(k, tile, halo if tile else 0, rb) for k in ks for tile in (None, (5, 6))
                                for rb in modes])


def _seeded(fn):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        return fn()


def _host_decode(comfy, vae, z):
    with torch.inference_mode():
        return _seeded(lambda: comfy.VAEDecode().decode(vae, {"samples": z})[0].clone())


@pytest.fixture(scope="class", params=[narrow("ltx_video"), pytest.param(narrow("ltx_video_v0"), marks=pytest.mark.slow),
                                       narrow("ltx_video_v1")])
def ltx(comfy, fixture_vaes, request):
    """0.9.5+ (timestep-conditioned: the host's decode draws noise into the latent), 0.9.0 (channel LayerNorms, no
    noise) and 0.9.1 (noise into the latent, and fresh fields in its blocks on every call); narrow twins."""
    vae = fixture_vaes.load(comfy, request.param)
    z = structured_latent((1, 128, 2, 2, 2), seed=4)
    ref, again = _host_decode(comfy, vae, z), _host_decode(comfy, vae, z)
    with torch.inference_mode():
        other = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
    noise = FIXTURES[request.param].full != "ltx_video_v0"
    assert torch.equal(ref, again) and torch.equal(ref, other) != noise  # 0.9.0 alone draws no noise
    yield vae, z, ref
    _release(vae)


class TestLtxVideo:
    """LTX-Video's whole-clip tiles, each version the hosts detect that can be exact (its VAE loaded for this class
    only)."""

    def test_ltx_video_tiles_are_exact(self, ltx, video):
        vae, z, ref = ltx
        r = _seeded(lambda: video.decode(vae, {"samples": z}, tile_size=32))
        text = r.report.text()
        assert r.plan.path == "carry" and r.stats["tiles"] == 4 and r.stats["chunks"] == 4, text
        assert r.report.summary.startswith("exact") and "carried chunks: self-check passed" in text, text
        assert "noise" in text or not vae.first_stage_model.timestep_conditioning, text
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    def test_ltx_video_without_chunks_in_time(self, ltx, video):
        """frames_per_chunk is not used: the decoder is symmetric in time, one chunk per tile is the whole clip."""
        vae, z, ref = ltx
        r = _seeded(lambda: video.decode(vae, {"samples": z}, frames_per_chunk=1))
        text = r.report.text()
        assert r.plan.path == "carry" and r.stats["frames_per_chunk"] == 2, text
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    def test_ltx_video_batch_of_two_draws_the_hosts_noise(self, ltx, comfy, video):
        """Two clips in one latent, against the host decoding them one after the other from one random state (a
        timestep-conditioned host decoder takes one clip per call: its timestep embedding has batch 1; the
        host's VAE Decode of both at once fails on 0.33 where memory lets it batch them)."""
        vae, z, _ = ltx
        z2 = torch.cat([z, structured_latent(tuple(z.shape), seed=5)])
        with torch.inference_mode():
            ref = _seeded(lambda: torch.cat([comfy.VAEDecode().decode(vae, {"samples": z2[i : i + 1]})[0]
                                             for i in range(2)]))
        r = _seeded(lambda: video.decode(vae, {"samples": z2}, tile_size=32))
        text = r.report.text()
        assert r.plan.path == "carry" and r.stats["tiles"] == 4 and r.images.shape == ref.shape, text
        assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_ltx_video_091_replays_the_hosts_chunks_in_time(comfy, fixture_vaes, video, monkeypatch):
    """ComfyUI 0.33 decodes LTX-Video in temporal chunks sized by bytes (``run_up``), and each chunk's blocks draw
    their own 0.9.1 noise field: a tile, fewer bytes, is split otherwise. The tiles add, frame by frame, the field of
    the host's chunk that frame was in. Forced here with a tiny chunk size; first proven to change the host's own
    decode, so the test can fail."""
    mod = importlib.import_module("comfy.ldm.lightricks.vae.causal_video_autoencoder")
    if not hasattr(mod, "get_max_chunk_size"):
        pytest.skip("this host's LTX-Video decoder does not split time (run_up is ComfyUI 0.33+)")
    vae = fixture_vaes.load(comfy, narrow("ltx_video_v1"))
    try:
        z = structured_latent((1, 128, 3, 2, 2), seed=4)
        whole = _host_decode(comfy, vae, z)
        monkeypatch.setattr(mod, "get_max_chunk_size", lambda device: 4096)
        ref = _host_decode(comfy, vae, z)
        assert not torch.equal(ref, whole)  # the host's chunks in time drew other noise
        r = _seeded(lambda: video.decode(vae, {"samples": z}, tile_size=32))
        text = r.report.text()
        assert r.plan.path == "carry" and r.stats["tiles"] == 4 and r.report.summary.startswith("exact"), text
        assert (r.images - ref).abs().max().item() <= 1e-4, text
    finally:
        _release(vae)


@full_size
@pytest.mark.parametrize("kind", ["mochi", "hunyuan_video15", "ltx_video", "ltx_video_v0", "ltx_video_v1"])
def test_full_size_decode_is_exact(comfy, fixture_vaes, video, kind):
    """The full-size fixture of each family (1.2 B parameters for HunyuanVideo 1.5 and LTX-Video 0.9.5+), as
    ComfyUI's loader detects it from the file: the same exact path as its narrow twin above."""
    if kind in ("mochi", "hunyuan_video15"):
        shape = (1, 12, 4, 4, 4) if kind == "mochi" else (1, 32, 7, 2, 3)
        vae, z, ref = _case(comfy, fixture_vaes, kind, shape)
        run = lambda: video.decode(vae, {"samples": z}, frames_per_chunk=2)  # noqa: E731
    else:
        vae, z = fixture_vaes.load(comfy, kind), structured_latent((1, 128, 2, 2, 2), seed=4)
        ref = _host_decode(comfy, vae, z)
        run = lambda: _seeded(lambda: video.decode(vae, {"samples": z}, tile_size=32))  # noqa: E731
    try:
        r = run()
        text = r.report.text()
        assert r.plan.path == "carry" and r.plan.exact and r.report.summary.startswith("exact"), text
        assert r.stats["chunks"] >= 3 if kind in ("mochi", "hunyuan_video15") else r.stats["tiles"] == 4, text
        assert r.images.shape == ref.shape and (r.images - ref).abs().max().item() <= 1e-4, text
    finally:
        _release(vae)


@pytest.fixture(scope="class")
def cog(comfy, fixture_vaes):
    if not available("cogvideox"):
        pytest.skip("CogVideoX's VAE is not in this host (ComfyUI >= 0.33.0)")
    yield from _held_case(comfy, fixture_vaes, "cogvideox", (1, 16, 3, 4, 4))


class TestCogVideoX:
    """CogVideoX's rolling decode reproduced in chunks of its own 4-frame grid (its VAE loaded for this class)."""

    @pytest.mark.parametrize("k, chunks", [(4, 3), (8, 2)])
    def test_cogvideox_carried_chunks_are_exact(self, cog, video, k, chunks):
        vae, z, ref = cog
        r = video.decode(vae, {"samples": z}, frames_per_chunk=k)
        text = r.report.text()
        assert r.plan.path == "carry" and r.plan.exact, text
        assert r.stats["chunks"] == chunks and f"k = {k} frames/chunk" in text, text  # 9 frames: [4, 4, 1] / [8, 1]
        assert r.report.summary.startswith("exact") and "carried chunks: self-check passed" in text, text
        assert r.images.shape == ref.shape == (9, 32, 32, 3), (tuple(r.images.shape), tuple(ref.shape))
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    def test_cogvideox_chunks_keep_the_hosts_grid(self, cog, video):
        """A chunk size off the host's 4-frame grid (its GroupNorm statistics are per host chunk) is rounded to it."""
        vae, z, ref = cog
        r = video.decode(vae, {"samples": z}, frames_per_chunk=6)
        text = r.report.text()
        assert r.plan.config.k == 4 and r.stats["chunks"] == 3, text
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    def test_cogvideox_even_latent_has_the_hosts_frame_count(self, comfy, cog, video):
        """An even number of latent frames decodes to 4 T frames, not the 4 T - 3 of the VAE's upscale_ratio: the
        output has the host's count, whole and in chunks (before: a shape error)."""
        vae = cog[0]
        z = structured_latent((1, 16, 4, 4, 4), seed=6)
        with torch.inference_mode():
            ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
        assert ref.shape[0] == 16
        whole = video.decode(vae, {"samples": z})
        assert whole.plan.path == "host" and whole.images.shape == ref.shape, whole.report.text()
        assert (whole.images - ref).abs().max().item() <= 1e-4
        r = video.decode(vae, {"samples": z}, frames_per_chunk=4)
        text = r.report.text()
        assert r.plan.path == "carry" and r.stats["chunks"] == 4 and r.images.shape == ref.shape, text
        assert (r.images - ref).abs().max().item() <= 1e-4, text

    def test_cogvideox_sizing_run_equals_the_whole_run(self, cog):
        model = cog[0].first_stage_model
        layout = _engine("vae.carry_layout").carry_layout(model).require()
        assert_sizing_run_is_exact(model, layout, (1, 16, 5, 4, 4), (1, 3, 17, 32, 32),
                                   [(4, None, 0, True), (4, None, 0, False)])

    def test_cogvideox_resumes_after_oom_on_the_grid(self, comfy, cog, video):
        vae = cog[0]
        z = structured_latent((1, 16, 4, 4, 4), seed=6)
        with torch.inference_mode():
            ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
        r, fired = _oom_in_second_chunk(video, vae, z, 8)
        text = r.report.text()
        # [0, 8) done, [8, 16) failed: k 8 halves to 4, [8, 12), [12, 16)
        assert fired == [1] and r.stats["shrinks"] == 1 and r.stats["frames_per_chunk"] == 4, text
        assert r.stats["chunks"] == 3 and (r.images - ref).abs().max().item() <= 1e-4, text
