"""Never worse than core's node (issue 41 item 1): when the pack's own machinery fails, every decode and encode
node returns what ComfyUI's own node returns, bit for bit, and its report says which step failed and why.

* Each step of each node's flow (``memory/decode/guard.py`` ``STAGES``, entered through ``DecodeEnv.at``) is made to
  raise in turn (``nodes/_decode_node.STAGE_HOOK``); the steps a node visits are pinned, so a new step is seen.
* Real failures deep in the machinery (a cost model's host variant, as Qwen-Image 2.1's VAE raised it; an
  executor) give the same.
* What is not the pack's failure passes through: the user's bad input, Cancel, out of memory.
* A VAE the pack has never seen (a module of this test's own) gets the host's decode, never an error.
* Inputs are never changed (latents, pixels, masks), over every family and node (ComfyUI 0.33's pixel-space VAE
  included: its decoder returns its input, which ComfyUI's output processing would have changed in place).

``VRAMFIT_STRICT`` (set by tests/conftest.py so that other tests see the pack's own failures) is off here.
"""

from __future__ import annotations

import sys

import pytest
import torch

from scripts.fixtures.host import available
from scripts.fixtures.kinds import FIXTURES
from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow
from tests.helpers import assert_freed, unload_and_watch

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]

NODES = {
    "tiled": "VRAMFit_TiledVAEDecode",
    "video": "VRAMFit_TemporalChunkVideoDecode",
    "encode": "VRAMFit_TiledVAEEncode",
    "video_encode": "VRAMFit_TemporalChunkVideoEncode",
    "inpaint": "VRAMFit_VAEEncodeForInpaint",
}
STEPS = {  # the steps each node's flow enters on these fixtures, in order of first entry (each verifies what its
    # plan relies on after planning it)
    "tiled": ["identify", "cost", "prepare", "plan", "check", "weights", "run", "report"],
    "video": ["identify", "prepare", "plan", "check", "weights", "run", "report"],
    "encode": ["identify", "cost", "prepare", "plan", "check", "weights", "run", "report"],
    "video_encode": ["identify", "cost", "prepare", "plan", "check", "weights", "run", "report"],
    "inpaint": ["identify", "cost", "prepare", "plan", "check", "weights", "run", "report"],
}


class Injected(RuntimeError):
    pass


@pytest.fixture(autouse=True)
def not_strict(monkeypatch):
    monkeypatch.setenv("VRAMFIT_STRICT", "0")


@pytest.fixture(scope="module")
def mods(comfy):
    return {k: sys.modules[comfy.NODE_CLASS_MAPPINGS[v].__module__] for k, v in NODES.items()}


@pytest.fixture(scope="module")
def decode_node(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__.rsplit(".", 1)[0]
                       + "._decode_node"]


@pytest.fixture()
def stage_hook(decode_node):
    yield lambda fn: setattr(decode_node, "STAGE_HOOK", fn)
    decode_node.STAGE_HOOK = None


@pytest.fixture(scope="module")
def kl(comfy, fixture_vaes):
    return fixture_vaes.load(comfy, "kl_f8")


@pytest.fixture(scope="module")
def wan(comfy, fixture_vaes):
    return fixture_vaes.load(comfy, "wan21")


def _pixels(b: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.rand((b, h, w, 3), generator=torch.Generator().manual_seed(seed))


def _mask() -> torch.Tensor:
    mask = torch.zeros((1, 48, 40))
    mask[:, 8:24, 8:32] = 1.0
    return mask


def _case(name: str, comfy, mods, kl, wan):
    """``(pack, core)``: the node's call, returning ``(tensor, report)``, and ComfyUI's own node's tensor, on the
    same input."""
    vae, x = {
        "tiled": (kl, {"samples": structured_latent((1, 4, 6, 5), seed=1)}),
        "video": (wan, {"samples": structured_latent((1, 16, 2, 2, 3), seed=1)}),
        "encode": (kl, _pixels(1, 48, 40)),
        "video_encode": (wan, _pixels(5, 16, 24)),
        "inpaint": (kl, _pixels(1, 48, 40)),
    }[name]
    mod = mods[name]

    def pack():
        if name in ("tiled", "video"):
            r = mod.decode(vae, x)
            return r.images, r.report
        if name == "inpaint":
            latent, result = mod.encode_inpaint(vae, x, _mask(), 6)
            return latent["samples"], result.report
        r = mod.encode(vae, x)
        return r.latent, r.report

    def core():
        if name in ("tiled", "video"):
            return comfy.VAEDecode().decode(vae, x)[0]
        if name == "inpaint":
            return comfy.VAEEncodeForInpaint().encode(vae, x, _mask(), 6)[0]["samples"]
        return comfy.VAEEncode().encode(vae, x)[0]["samples"]

    return pack, core


def _work(name: str) -> str:
    return "decode" if name in ("tiled", "video") else "encode"


@pytest.mark.parametrize("name", list(NODES))
def test_each_step_that_fails_gives_the_core_nodes_output_and_names_the_step(name, comfy, mods, kl, wan,
                                                                              stage_hook):
    from vramfit.memory.decode.guard import STAGES

    pack, core = _case(name, comfy, mods, kl, wan)
    seen: list[str] = []
    stage_hook(lambda s: seen.append(s) if s not in seen else None)
    own, _ = pack()
    assert seen == STEPS[name], f"{name}: the flow's steps changed: {seen}"
    ref = core().clone()
    work = _work(name)
    for stage in STEPS[name]:
        def hook(s: str, stage: str = stage) -> None:
            if s == stage:
                raise Injected(f"injected at {stage}")

        stage_hook(hook)
        got, report = pack()
        text = report.text()
        assert torch.equal(got, ref), f"{name} failing at {stage}: not VAE {work.capitalize()}'s output\n{text}"
        assert report.summary.startswith(f"host {work}: the pack's own path failed: Injected: injected at {stage}"), \
            text
        assert f"failed in its {STAGES[stage]}" in dict(report.rows)["path"], text
        assert ".py:" in dict(report.rows)["failed at"], text


def test_a_real_failure_deep_in_the_machinery_is_named(comfy, mods, kl, wan, monkeypatch):
    """The crash Qwen-Image 2.1's VAE gave (a RuntimeError from the cost model's host variant, reached while the
    job is made) and one inside an executor: VAE Decode's output, the step and the place named."""
    calibration = _pack_module(mods, "memory.cost.calibration")
    video_engine = _pack_module(mods, "memory.decode.video")

    def host_variant(*a, **k):
        raise RuntimeError("expected input[1, 48, 3, 2, 2] to have 64 channels")

    pack, core = _case("tiled", comfy, mods, kl, wan)
    with monkeypatch.context() as m:
        m.setattr(calibration, "host_variant", host_variant)
        got, report = pack()
    text = report.text()
    assert torch.equal(got, core()), text
    assert report.summary.startswith("host decode: the pack's own path failed: RuntimeError: expected input"), text
    assert "memory/cost/calibration.py" in dict(report.rows)["failed at"], text

    def broken(*a, **k):
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(video_engine, "decode_wan_chunked", broken)
    pack, core = _case("video", comfy, mods, kl, wan)
    got, report = pack()
    text = report.text()
    assert torch.equal(got, core()), text
    assert "failed in its executor: IndexError: tuple index out of range" in dict(report.rows)["path"], text


def test_bad_input_cancel_and_out_of_memory_are_passed_on(comfy, mods, kl, wan, stage_hook):
    import comfy.model_management as mm

    with pytest.raises(ValueError, match=r"\[VRAM Fit · Tiled VAE Decode\] tile_size 7"):
        mods["tiled"].decode(kl, {"samples": structured_latent((1, 4, 6, 5))}, tile_size=7)
    with pytest.raises(ValueError, match=r"has 16 channels but the VAE expects 4"):
        mods["tiled"].decode(kl, {"samples": structured_latent((1, 16, 6, 5))})
    for exc in (mm.InterruptProcessingException(), torch.OutOfMemoryError("injected")):
        def hook(s: str, exc=exc) -> None:
            if s == "plan":
                raise exc

        stage_hook(hook)
        for name in ("tiled", "video", "encode"):
            pack, _ = _case(name, comfy, mods, kl, wan)
            with pytest.raises(type(exc)):
                pack()


def _pack_module(mods, name: str):
    """The pack's module ``name`` as ComfyUI loaded it (under the pack's folder name, not ``vramfit``)."""
    return sys.modules[f"{mods['tiled'].__name__.rsplit('.', 2)[0]}.{name}"]


def _unknown_class(name: str, frames: bool) -> type:
    """A decoder class of a module the pack has never seen (this test's own)."""
    import types

    mod = types.ModuleType(f"someones_vae_pack.{name}")

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            conv = torch.nn.Conv3d if frames else torch.nn.Conv2d
            self.conv = conv(16 if frames else 4, 12, 3, padding=1)
            self.out = conv(3, 3, 3, padding=1)

        def decode(self, z: torch.Tensor) -> torch.Tensor:
            x = self.conv(z)
            if frames:  # (B, 12, T, H, W) -> (B, 3, T, 2H, 2W)
                b, c, t, h, w = x.shape
                x = torch.nn.functional.pixel_shuffle(x.movedim(2, 1).reshape(b * t, c, h, w), 2)
                x = x.reshape(b, t, 3, 2 * h, 2 * w).movedim(1, 2)
            else:
                x = torch.nn.functional.pixel_shuffle(x, 2)
            return self.out(torch.tanh(x))

    Decoder.__module__ = mod.__name__
    Decoder.__qualname__ = Decoder.__name__ = "Decoder"
    mod.Decoder = Decoder
    sys.modules[mod.__name__] = mod
    return Decoder


@pytest.mark.parametrize("frames", [False, True], ids=["image", "video"])
def test_a_vae_the_pack_has_never_seen_gets_the_hosts_decode_never_an_error(comfy, mods, kl, wan, frames):
    import copy

    vae = copy.copy(wan if frames else kl)
    vae.first_stage_model = _unknown_class("video" if frames else "image", frames)()
    vae.upscale_ratio = (lambda a: a, 2, 2) if frames else 2
    vae.upscale_index_formula = None
    shape = (1, 16, 3, 6, 5) if frames else (1, 4, 6, 5)
    z = structured_latent(shape, seed=5)
    (ref,) = comfy.VAEDecode().decode(vae, {"samples": z})
    for name in ("tiled", "video"):
        for budget in (0, 1):  # a budget the host's decode fits and one it does not
            r = mods[name].decode(vae, {"samples": z}, budget_mb=budget)
            text = r.report.text()
            assert r.images.shape == ref.shape and (r.images - ref).abs().max().item() <= 1e-5, text
            assert "not described" in dict(r.report.rows).get("structure", ""), text


FAMILIES = ["kl_f8", "flux", "flux2", "hunyuan_image", "hunyuan_image_refiner", "mage", "wan21", "wan22",
            "hunyuan_video", "mochi", "cogvideox", "hunyuan_video15", "cosmos", "ltx_video", "seedvr2"]
DEFAULT_FAMILIES = {"kl_f8", "flux2", "wan21", "cogvideox", "seedvr2"}
"""One family per kind of executor in a user's default run (image KL, its 128-channel twin, causal video, grid video,
SeedVR2's own; the last two on 0.33); every family in the slow tier (CI)."""


def _encode_pixels(spec) -> torch.Tensor:
    out = spec.example_output
    frames = out[0] * (out[1] if len(out) == 5 else 1)
    return _pixels(frames, out[-3], out[-2], seed=3)


@pytest.mark.parametrize("family", [f if f in DEFAULT_FAMILIES else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_no_node_changes_its_inputs(comfy, mods, fixture_vaes, family):
    """Latents, pixels and masks are bit-identical after every pack node, on every family (and each node's
    output is VAE Decode's / VAE Encode's within float noise, or the same error); the VAE is freed once dropped."""
    kind = narrow(family)
    if not available(kind):
        pytest.skip(f"this host has no {FIXTURES[kind].module}")
    spec = FIXTURES[kind]
    vae = fixture_vaes.load(comfy, kind)
    z = structured_latent(spec.example_latent, seed=2)
    pixels = _encode_pixels(spec)
    mask = torch.zeros(pixels.shape[:3])
    mask[:, : pixels.shape[1] // 2] = 1.0
    given = (z.clone(), pixels.clone(), mask.clone())
    calls = {
        "tiled": lambda v: mods["tiled"].decode(v, {"samples": z}, tile_size=32),
        "video": lambda v: mods["video"].decode(v, {"samples": z}, frames_per_chunk=1),
        "encode": lambda v: mods["encode"].encode(v, pixels),
        "video_encode": lambda v: mods["video_encode"].encode(v, pixels),
    }
    if spec.latent_dim == 2:
        calls["inpaint"] = lambda v: mods["inpaint"].encode_inpaint(v, pixels[:1], mask[:1], 6)
    for name, call in calls.items():
        try:
            call(vae)
        except ValueError as e:  # the user's input error (a frame count the encoder takes, a tile size)
            assert type(e).__name__ == "NodeInputError", f"{family} {name}: {e!r}"
        for before, after, what in zip(given, (z, pixels, mask), ("latent", "pixels", "mask"), strict=True):
            assert torch.equal(before, after), f"{family}: {name} changed its {what}"
    # No node keeps the VAE alive once the graph drops it.
    model = unload_and_watch(vae)
    del vae
    assert_freed(model, family)


def test_the_pixel_space_latent_stays_untouched(comfy, mods):
    """ComfyUI 0.33's pixel-space VAE (``VAELoader`` "pixel_space"): its decoder returns its input and ComfyUI's
    output processing works in place; the pack's decode gave images 0.50 apart on a second run and left core's
    VAE Decode 0.75 off."""
    import importlib.util

    if importlib.util.find_spec("comfy.pixel_space_convert") is None:
        pytest.skip("this host has no pixel-space VAE (ComfyUI 0.33 has it)")
    (vae,) = comfy.VAELoader().load_vae("pixel_space")
    z = torch.rand((1, 3, 24, 20), generator=torch.Generator().manual_seed(0)) * 2 - 1
    given = z.clone()
    (ref,) = comfy.VAEDecode().decode(vae, {"samples": z.clone()})
    for name in ("tiled", "video", "tiled"):
        r = mods[name].decode(vae, {"samples": z})
        assert torch.equal(z, given), f"{name} changed the latent"
        assert (r.images - ref).abs().max().item() <= 1e-6, r.report.text()
    for tile in (0, 32):
        r = mods["encode"].encode(vae, ref, tile_size=tile)
        assert torch.equal(z, given)
