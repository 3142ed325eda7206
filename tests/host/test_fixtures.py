"""The fixture VAEs load through ComfyUI's real loader as the real architectures, and the latents
are structured (scripts/fixtures/)."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import pathlib
import subprocess
import sys
import time
import uuid

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts.fixtures import files as fixture_files
from scripts.fixtures.cli import comfyui_path
from scripts.fixtures.files import FixtureFolder, make_models, make_room, write_latent_file
from scripts.fixtures.host import available
from scripts.fixtures.kinds import COMFY_KINDS, FIXTURES, KINDS, NARROW_KINDS
from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow_divisor
from scripts.fixtures.weights import FILE_ONLY_KEYS, GENERATOR_VERSION, build_model, build_state_dict
from tests.helpers import full_size

log = logging.getLogger("vramfit.tests.fixtures")
SMALL = "hunyuan_image_narrow"
"""The smallest fixture (51 MB): the file-handling tests write it several times."""
ROOT = pathlib.Path(__file__).resolve().parents[2]
host = pytest.mark.host


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module", params=[pytest.param(k, marks=full_size) if k in NARROW_KINDS else k
                                        for k in COMFY_KINDS])
def loaded(request, comfy, fixture_vaes):
    """(spec, VAE, log messages of the load) via ComfyUI's own VAELoader (a narrow twin under
    ``scripts.fixtures.narrow.narrow_host``); one kind in memory at a time. The full-size kinds with a narrow twin run with
    ``VRAMFIT_FULL_FIXTURES=1``."""
    spec = FIXTURES[request.param]
    if not available(spec.kind):
        pytest.skip(f"{spec.kind}: this host has no {spec.module} (added in ComfyUI {spec.min_comfyui})")
    root = logging.getLogger()
    handler = _Records()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # "Leftover VAE keys" is logged at debug level
    try:
        vae = fixture_vaes.load(comfy, spec.kind)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    yield spec, vae, handler.messages
    del vae


def _decode(vae, latent: torch.Tensor) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = vae.decode(latent)
    return out, time.perf_counter() - t0


def _decode_node(comfy, vae, latent: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``VAEDecode`` node (video frames flattened into the batch: (B*T,H,W,3))."""
    with torch.inference_mode():
        (images,) = comfy.VAEDecode().decode(vae, {"samples": latent})
    return images


# ------------------------------------------------------------------------------------------ models


@host
def test_loader_detects_the_real_architecture(loaded, fixture_vaes):
    spec, vae, messages = loaded
    fsm = vae.first_stage_model
    assert type(fsm).__name__ == spec.model_class
    assert type(fsm).__module__ == spec.module
    assert vae.latent_channels == spec.latent_channels
    assert vae.latent_dim == spec.latent_dim
    assert vae.spacial_compression_decode() == spec.spatial_ratio
    expected_t = None if spec.temporal_ratio == 1 else spec.temporal_ratio
    assert vae.temporal_compression_decode() == expected_t
    extra = set(FILE_ONLY_KEYS.get(spec.full or spec.kind, ()))  # a released file's, left over by the loader
    bad = [m for m in messages if "Missing VAE keys" in m
           or ("Leftover VAE keys" in m and not (extra and all(k in m for k in extra)))]
    assert not bad, bad

    import folder_paths

    path = folder_paths.get_full_path_or_raise("vae", fixture_vaes[spec.kind])
    with safetensors.safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert extra <= keys and {spec.model_key(k) for k in keys - extra} == set(fsm.state_dict().keys())
    assert sum(p.numel() for p in fsm.state_dict().values()) in spec.param_counts()
    floats = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
    assert {floats.get(d, d) for d in dtypes} - {"I64"} == {spec.dtype}, dtypes  # int64: batch counts
    assert meta["vramfit_fixture_kind"] == spec.kind
    assert meta["vramfit_fixture_generator"] == GENERATOR_VERSION
    kind, div = spec.full or spec.kind, narrow_divisor(spec.kind)  # a narrow twin: its full kind's facts
    if spec.full is not None:  # a narrow twin: the full kind's classes and key names, 1/div of the widths
        full = build_model(spec.full).state_dict()
        narrow = build_model(spec.kind).state_dict()
        assert {spec.model_key(k) for k in keys - extra} == set(full) == set(narrow)
        cat = kind == "mage"  # Mage-VAE concatenates latent-wide and hidden-wide inputs (s_embedder.proj2, x_embedder)
        for k, v in full.items():  # every dimension kept (kernels, latent channels) or narrower (widths)
            assert all(n in (f, f // div) or (cat and f // div < n < f)
                       for n, f in zip(narrow[k].shape, v.shape, strict=True)), k
        n_full, n_narrow = (sum(v.numel() for v in sd.values()) for sd in (full, narrow))
        hi = 1.25 if kind == "mage" else 1.1  # Mage-VAE's per-patch MLP (32 wide) and latent-side layers keep theirs
        assert 0.9 < n_narrow * div**2 / n_full < hi, (n_narrow, n_full)
        assert all(fsm.state_dict()[k].shape == v.shape for k, v in narrow.items())
    if kind == "wan22":
        assert "decoder.upsamples.0.upsamples.0.residual.2.weight" in keys
    if kind == "hunyuan_video":
        assert fsm.decoder.conv_in.conv.weight.shape[1] == 16
    if kind == "hunyuan_video15":  # comfy/sd.py's "decoder.conv_in.conv.weight" 32-channel branch
        assert fsm.decoder.conv_in.conv.weight.shape[1] == 32 and fsm.decoder.refiner_vae
    if kind == "ltx_video_v0":  # comfy/sd.py's lightricks branch: a 512-wide first up block -> version 0
        assert fsm.decoder.up_blocks[0].res_blocks[0].conv1.conv.weight.shape[0] == 512 // div
        assert not fsm.timestep_conditioning and "decoder.up_blocks.4.norm3.norm.weight" in keys
    if kind == "ltx_video_v1":  # a 1024-wide first up block without encoder.down_blocks.1.conv.conv.bias -> 1
        assert fsm.decoder.up_blocks[0].res_blocks[0].conv1.conv.weight.shape[0] == 1024 // div
        assert fsm.timestep_conditioning and "encoder.down_blocks.1.conv.conv.bias" not in keys
        assert any(getattr(m, "inject_noise", False) for m in fsm.decoder.modules())
    if kind == "mochi":  # comfy/sd.py's genmo mochi branch, both halves prefixed (no prefix rewrite)
        assert "decoder.blocks.2.blocks.3.stack.5.weight" in keys
        assert "encoder.layers.4.layers.1.attn_block.attn.qkv.weight" in keys
        assert not any(k.startswith(("blocks.", "layers.")) for k in keys)
        assert fsm.decoder.blocks[0][0].weight.shape[1] == 12
        assert fsm.encoder.output_proj.weight.shape[0] == 24
    if kind == "cogvideox":  # comfy/sd.py 0.33.0 "CogVideoX VAE"; latent channels from encoder.conv_out
        assert {"decoder.conv_in.conv.weight", "decoder.mid_block.resnets.0.norm1.norm_layer.weight"} <= keys
        assert fsm.encoder.conv_out.conv.weight.shape[0] == 32 and fsm.latent_channels == 16
    if kind == "mage":  # comfy/sd.py 0.33.0 "Mage-VAE": detected and re-prefixed from the released file's keys
        assert "student.dconv_encoder.proj_out.weight" in keys
        assert all(k.startswith(("student.dconv_encoder.", "pipeline.")) for k in keys)
        assert fsm.decoder_model.y_embedder.decoder.conv_in.weight.shape[1] == 128
    if kind == "flux":  # FLUX's ae.safetensors: no quant convs, so ComfyUI builds an AutoencodingEngine
        assert not any("quant_conv" in k for k in keys)
        assert fsm.decoder.conv_in.weight.shape[1] == 16
    if kind == "flux2":  # BFL's flux2-vae keys; ComfyUI builds AutoencoderKL with the latent BatchNorm
        assert {"encoder.quant_conv.weight", "decoder.post_quant_conv.weight", "bn.running_var"} <= keys
        assert not any(k.startswith(("quant_conv.", "post_quant_conv.")) for k in keys)
        assert fsm.bn is not None and fsm.bn.num_features == 128 and fsm.decoder.conv_in.weight.shape[1] == 32
        assert fsm.post_quant_conv.weight.shape[:2] == (32, 32)
        assert fsm.quant_conv.weight.shape[:2] == (64, 64)
        var, mean = fsm.bn.running_var.float(), fsm.bn.running_mean.float()
        assert var.min().item() > 0 and var.std().item() > 0.1 and mean.abs().mean().item() > 0.1


@host
def test_decode_shape_and_statistics(loaded, comfy):
    spec, vae, _ = loaded
    latent = structured_latent(spec.example_latent, seed=1)
    out, seconds = _decode(vae, latent)
    log.info("%s: decode %s -> %s in %.2f s", spec.kind, tuple(latent.shape), tuple(out.shape), seconds)
    assert tuple(out.shape) == spec.example_output
    assert torch.isfinite(out).all()
    assert 0.0 <= out.min().item() and out.max().item() <= 1.0
    assert 0.05 < out.std().item() < 0.35, out.std().item()
    saturated = ((out <= 0.0) | (out >= 1.0)).float().mean().item()
    assert saturated < 0.2, saturated
    # every image / frame has spatial structure
    per_image = out.reshape(-1, *out.shape[-3:]).std(dim=(1, 2, 3))
    assert per_image.min().item() > 0.03, per_image

    # The output depends on the latent: change the last latent frame (or the whole image latent).
    other = structured_latent(spec.example_latent, seed=2)
    if spec.latent_dim == 3:
        changed = latent.clone()
        changed[:, :, -1] = other[:, :, -1]
    else:
        changed = other
    # the second decode goes through ComfyUI's VAEDecode node: the frames flattened into the batch
    images = _decode_node(comfy, vae, changed)
    assert tuple(images.shape) == (math.prod(spec.example_output[:-3]), *spec.example_output[-3:])
    out2 = images.reshape(spec.example_output)
    diff = (out2 - out).abs()
    if spec.latent_dim == 2:
        assert diff.mean().item() > 0.03
        return
    frames_of_last = spec.temporal_ratio  # the last latent frame decodes to the last 4 (Mochi 6) frames
    last = diff[:, -frames_of_last:].mean().item()
    assert last > 0.03, f"the last latent frame barely changes its own frames ({last:.4f})"
    if (spec.full or spec.kind) in ("wan21", "wan22", "mochi"):
        # Wan's and Mochi's decoders are causal (Mochi: per-frame GroupNorm, no attention in the decoder):
        # earlier frames must not change at all. (LTX-Video's is symmetric in time and draws noise.)
        assert diff[:, :-frames_of_last].max().item() == 0.0
    # frames move: consecutive frames differ
    frame_diff = (out[:, 1:] - out[:, :-1]).abs().mean(dim=(0, 2, 3, 4))
    assert frame_diff.min().item() > 0.005, frame_diff


# ------------------------------------------------------------------------- determinism and files


@host
def test_make_models_is_deterministic_idempotent_and_atomic(fixture_vaes, tmp_path, comfy):
    import folder_paths

    rng_before = torch.get_rng_state()
    a = make_models(tmp_path / "a", seed=0, kinds=[SMALL])[SMALL]
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG state changed"
    host_file = pathlib.Path(folder_paths.get_full_path_or_raise("vae", fixture_vaes[SMALL]))
    sd_a = safetensors.torch.load_file(a)
    sd_host = safetensors.torch.load_file(host_file)
    assert sd_a.keys() == sd_host.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k].view(torch.uint8), sd_host[k].view(torch.uint8)), k
    assert all(torch.isfinite(v).all() for v in sd_a.values())

    # idempotent: a current file is not rewritten ...
    st_before = a.stat()
    t0 = time.perf_counter()
    make_models(tmp_path / "a", seed=0, kinds=[SMALL])
    assert time.perf_counter() - t0 < 1.0
    st_after = a.stat()
    assert (st_after.st_ino, st_after.st_mtime_ns) == (st_before.st_ino, st_before.st_mtime_ns)
    # ... unless forced (written to a temporary file, then renamed over it)
    make_models(tmp_path / "a", seed=0, kinds=[SMALL], force=True)
    assert a.stat().st_ino != st_before.st_ino
    sd_forced = safetensors.torch.load_file(a)
    assert all(torch.equal(sd_forced[k].view(torch.uint8), sd_a[k].view(torch.uint8)) for k in sd_a)

    # another seed gives other weights (same keys) and is rebuilt in place of a stale file
    make_models(tmp_path / "a", seed=1, kinds=[SMALL])
    sd_b = safetensors.torch.load_file(a)
    with safetensors.safe_open(str(a), framework="pt") as f:
        assert f.metadata()["vramfit_fixture_seed"] == "1"
    assert sd_b.keys() == sd_a.keys()
    random_keys = [k for k, v in sd_a.items() if v.ndim > 1]  # conv kernels (norm weights are ones)
    differing = [k for k in random_keys if not torch.equal(sd_a[k], sd_b[k])]
    assert random_keys and differing == random_keys

    # a truncated / corrupt file is rebuilt
    a.write_bytes(b"not a safetensors file")
    make_models(tmp_path / "a", seed=0, kinds=[SMALL])
    sd_c = safetensors.torch.load_file(a)
    assert all(torch.equal(sd_c[k], sd_a[k]) for k in sd_a)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [FIXTURES[SMALL].filename]

    with pytest.raises(ValueError, match="unknown fixture kinds"):
        make_models(tmp_path / "a", kinds=["sd3"])


@host
def test_optional_kinds_follow_the_host(fixture_vaes, tmp_path, comfy, monkeypatch, caplog):
    """cogvideox exists from ComfyUI 0.33.0: the default kinds skip it on an older host (0.3.75), an explicit
    request there raises; every other kind is on every host."""
    import folder_paths

    has_cogvideo = importlib.util.find_spec("comfy.ldm.cogvideo") is not None
    assert available("cogvideox") == has_cogvideo
    assert ("cogvideox" in fixture_vaes) == has_cogvideo
    optional = [k for k in KINDS if FIXTURES[k].min_comfyui is not None]
    assert {"cogvideox", "mage", "mage_narrow", "seedvr2", "seedvr2_narrow"} <= set(optional)
    for k in optional:  # each follows its module (SeedVR2: comfy.ldm.seedvr; Mage-VAE: comfy.ldm.mage_flow)
        has = importlib.util.find_spec(FIXTURES[k].module.rsplit(".", 1)[0]) is not None
        assert available(k) == has and (k in fixture_vaes) == has, k
    assert all(available(k) and k in fixture_vaes for k in KINDS if k not in optional)
    if not has_cogvideo:
        expected = r"cogvideox \(comfy\.ldm\.cogvideo\.vae, ComfyUI >= 0\.33\.0\)"
        with pytest.raises(RuntimeError, match=expected):
            make_models(tmp_path / "explicit", kinds=["kl_f8", "cogvideox"])
        assert not (tmp_path / "explicit").exists()  # checked before anything is written

    # The default kinds on a host without the module (simulated where it exists): logged and left out.
    vae_dir = tmp_path / "default"
    vae_dir.mkdir()
    host_file = pathlib.Path(folder_paths.get_full_path_or_raise("vae", fixture_vaes["kl_f8"]))
    (vae_dir / host_file.name).write_bytes(host_file.read_bytes())  # current: only its header is read
    monkeypatch.setattr(fixture_files, "KINDS", ("kl_f8", "cogvideox"))
    monkeypatch.setattr(fixture_files, "available", lambda kind: kind != "cogvideox")
    with caplog.at_level(logging.INFO, logger="vramfit.fixtures"):
        assert make_models(vae_dir) == {"kl_f8": vae_dir / host_file.name}
    assert any(m.startswith("cogvideox: skipped") for m in caplog.messages), caplog.messages
    with pytest.raises(RuntimeError, match="cogvideox"):
        make_models(vae_dir, kinds=["cogvideox"])
    assert sorted(p.name for p in vae_dir.iterdir()) == [host_file.name]


def test_make_room_deletes_the_largest_spare_fixtures_first(tmp_path, monkeypatch, caplog):
    """On a small disk other fixture files go, largest first: never the kept ones, the workflows' own or a
    file that is not a fixture; what cannot fit raises naming the folder and the need."""
    import shutil

    sizes = {"kl_f8": 1, "wan21": 2, "wan22": 50, "mochi": 30, "flux": 10, "hunyuan_video15": 80}
    for kind, mib in sizes.items():
        (tmp_path / FIXTURES[kind].filename).write_bytes(b"\0" * (mib << 20))
    (tmp_path / "users_own_vae.safetensors").write_bytes(b"\0" * (90 << 20))
    base = 5 << 20  # free bytes before anything is deleted
    held0 = sum(p.stat().st_size for p in tmp_path.iterdir())

    def disk_usage(path):
        held = sum(p.stat().st_size for p in tmp_path.iterdir())
        return shutil._ntuple_diskusage(1 << 40, 0, base + held0 - held)

    monkeypatch.setattr(fixture_files.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(fixture_files, "DISK_MARGIN", 1 << 20)
    with caplog.at_level(logging.INFO, logger="vramfit.fixtures"):
        deleted = make_room(tmp_path, 40 << 20, keep=[tmp_path / FIXTURES["wan22"].filename])
    # 5 MiB free + the 80 MiB file > 41 MiB: only the largest spare file goes (wan22 is kept)
    assert [p.name for p in deleted] == [FIXTURES["hunyuan_video15"].filename]
    assert any("deleted to make room" in m for m in caplog.messages)
    deleted = make_room(tmp_path, 140 << 20)  # 85 MiB free: wan22, then mochi
    assert [p.name for p in deleted] == [FIXTURES[k].filename for k in ("wan22", "mochi")]
    with pytest.raises(OSError, match=r"has 0\.\d GiB free; the next file needs 0\.3 GiB"):
        make_room(tmp_path, 300 << 20)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([FIXTURES[k].filename for k in ("kl_f8", "wan21")] + ["users_own_vae.safetensors"])


@host
def test_fixture_folder_makes_each_file_when_named(fixture_vaes, comfy):
    """``fixture_vaes`` is a :class:`FixtureFolder`: a fixture deleted to make room comes back when named."""
    import folder_paths

    assert isinstance(fixture_vaes, FixtureFolder)
    assert "kl_f8" in fixture_vaes and "sd3" not in fixture_vaes and list(fixture_vaes) == [
        k for k in KINDS if available(k)
    ]
    path = pathlib.Path(folder_paths.get_full_path_or_raise("vae", fixture_vaes[SMALL]))
    before = safetensors.torch.load_file(path)
    path.unlink()
    assert fixture_vaes[SMALL] == path.name and path.is_file()
    after = safetensors.torch.load_file(path)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(KeyError):
        fixture_vaes["sd3"]


@host
def test_video_weights_are_deterministic(fixture_vaes, comfy):
    """A second build of the Wan 2.1 weights (in memory) equals the host file bit for bit."""
    import folder_paths

    sd = build_state_dict("wan21", seed=0)
    host_file = folder_paths.get_full_path_or_raise("vae", fixture_vaes["wan21"])
    with safetensors.safe_open(host_file, framework="pt") as f:
        assert set(f.keys()) == set(sd)
        for k in sorted(sd)[:: max(1, len(sd) // 40)]:
            assert torch.equal(f.get_tensor(k).view(torch.uint8), sd[k].view(torch.uint8)), k
    gammas = [v for k, v in sd.items() if k.endswith(".gamma")]
    assert gammas and all(torch.all(g == 1) for g in gammas)
    # causal temporal kernels weigh the current frame most
    w = sd["decoder.middle.0.residual.2.weight"].float()
    per_tap = w.pow(2).mean(dim=(0, 1, 3, 4))
    assert per_tap[-1] > 5 * per_tap[0]


@host
def test_latent_file_round_trips_through_load_latent(comfy):
    import folder_paths

    samples = structured_latent((2, 16, 3, 5, 7), seed=4)
    name = f"vramfit_test_{uuid.uuid4().hex}.latent"
    path = pathlib.Path(folder_paths.get_input_directory()) / name
    try:
        write_latent_file(path, samples)
        with safetensors.safe_open(str(path), framework="pt") as f:
            assert set(f.keys()) == {"latent_tensor", "latent_format_version_0"}
        assert name in comfy.LoadLatent.INPUT_TYPES()["required"]["latent"][0]
        assert comfy.LoadLatent.VALIDATE_INPUTS(name) is True
        (loaded_latent,) = comfy.LoadLatent().load(name)
        assert loaded_latent["samples"].dtype == torch.float32
        assert torch.equal(loaded_latent["samples"], samples)  # no legacy 1/0.18215 multiplier

        half = structured_latent((1, 4, 13, 21), seed=5, dtype=torch.float16)
        write_latent_file(path, half)
        (loaded_half,) = comfy.LoadLatent().load(name)
        assert torch.equal(loaded_half["samples"], half.float())
    finally:
        path.unlink(missing_ok=True)
    assert not list(path.parent.glob(f".{name}*"))


@host
def test_cli_writes_into_vae_dir(tmp_path, host_config):
    env = dict(os.environ, COMFYUI_PATH=str(host_config.comfyui_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.fixtures",
            "--vae-dir",
            str(tmp_path),
            "--kinds",
            SMALL,
            "--seed",
            "3",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / FIXTURES[SMALL].filename
    assert out.is_file()
    assert str(out) in proc.stderr
    with safetensors.safe_open(str(out), framework="pt") as f:
        assert f.metadata()["vramfit_fixture_seed"] == "3"


def test_comfyui_path_from_host_env(tmp_path, monkeypatch):
    (tmp_path / "host.env").write_text(
        "# comment\nCOMFYUI_PATH=/somewhere/ComfyUI\nVRAMFIT_PYTHON=/x/python\n"
    )
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path))
    assert comfyui_path() == pathlib.Path("/somewhere/ComfyUI")
    monkeypatch.setenv("COMFYUI_PATH", "/elsewhere")
    assert comfyui_path() == pathlib.Path("/elsewhere")


def test_specs_are_consistent():
    assert tuple(FIXTURES) == KINDS
    for kind, spec in FIXTURES.items():
        assert spec.kind == kind
        assert spec.filename == f"vramfit_fixture_{kind}.safetensors"
        assert len(spec.example_latent) == spec.latent_dim + 2
        assert spec.example_latent[1] == spec.latent_channels
        b, *spatial = spec.example_latent[:1] + spec.example_latent[2:]
        expected = [s * spec.spatial_ratio for s in spatial[-2:]]
        if spec.latent_dim == 3:
            # the causal video VAEs give 1 + r (T - 1) frames; Hunyuan Image 2.1's refiner (zero-padded, not causal)
            # r T (a 1-frame latent: the host keeps the last of its r frames)
            refiner = (spec.full or kind) == "hunyuan_image_refiner"
            frames = spatial[0] * spec.temporal_ratio - (0 if refiner else spec.temporal_ratio - 1)
            expected = [frames, *expected]
        assert spec.example_output == (b, *expected, 3), kind
    assert COMFY_KINDS == tuple(k for k in KINDS if k != "dcae_sana") and "cogvideox" in COMFY_KINDS
    assert FIXTURES["kl_f8"].dtype == torch.float16
    assert FIXTURES["mochi"].dtype == FIXTURES["cogvideox"].dtype == torch.bfloat16
    assert FIXTURES["mochi"].example_output[1] == 6 * FIXTURES["mochi"].example_latent[2] - 5
    assert FIXTURES["cogvideox"].min_comfyui == FIXTURES["mage"].min_comfyui == "0.33.0"
    assert all(FIXTURES[k].min_comfyui is None for k in KINDS
               if k not in ("cogvideox", "mage", "mage_narrow", "seedvr2", "seedvr2_narrow"))
    mage = FIXTURES["mage_narrow"]  # comfy/sd.py detects Mage-VAE by student.dconv_encoder.proj_out.weight
    assert mage.file_key("dconv_encoder.proj_out.weight") == "student.dconv_encoder.proj_out.weight"
    assert mage.model_key("pipeline.blocks.0.conv1.weight") == "decoder_model.blocks.0.conv1.weight"
    assert FIXTURES["wan21"].dtype == FIXTURES["wan22"].dtype == FIXTURES["flux2"].dtype == torch.bfloat16
    flux2 = FIXTURES["flux2"]
    assert (flux2.latent_channels, flux2.spatial_ratio) == (128, 16)
    for key in ("quant_conv.weight", "post_quant_conv.bias", "decoder.conv_in.weight", "bn.running_mean"):
        assert flux2.model_key(flux2.file_key(key)) == key
    assert flux2.file_key("post_quant_conv.bias") == "decoder.post_quant_conv.bias"
    assert FIXTURES["flux"].file_key("decoder.conv_in.weight") == "decoder.conv_in.weight"


# ---------------------------------------------------------------------------------------- latents


def test_structured_latent_basics():
    rng_before = torch.get_rng_state()
    x = structured_latent((2, 4, 13, 21), seed=0)
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG state changed"
    assert x.shape == (2, 4, 13, 21) and x.dtype == torch.float32
    assert torch.isfinite(x).all()
    assert torch.equal(x, structured_latent((2, 4, 13, 21), seed=0))
    assert not torch.equal(x, structured_latent((2, 4, 13, 21), seed=1))
    assert (x[0] - x[1]).abs().mean() > 0.3, "batch items must differ"
    for item in x:
        assert 0.8 < item.std().item() < 1.25
    assert structured_latent((1, 48, 2, 3, 5), dtype=torch.bfloat16).dtype == torch.bfloat16
    assert structured_latent((1, 1, 1, 1)).shape == (1, 1, 1, 1)
    with pytest.raises(ValueError):
        structured_latent((4, 8, 8))
    with pytest.raises(ValueError):
        structured_latent((1, 4, 0, 8))


def test_structured_latent_has_regions_with_different_statistics():
    x = structured_latent((1, 4, 64, 64), seed=0)[0]
    blocks = x.unfold(1, 8, 8).unfold(2, 8, 8)  # C, 8, 8, 8, 8
    block_means = blocks.mean(dim=(-1, -2))
    block_stds = blocks.std(dim=(-1, -2))
    iid_spread = x.std().item() / 8  # std of 8x8-block means for i.i.d. values
    for c in range(x.shape[0]):
        assert block_means[c].std().item() > 2 * iid_spread, c
        assert block_stds[c].max().item() > 2.5 * block_stds[c].min().item(), c
    # channels are not copies of each other
    corr = torch.corrcoef(x.reshape(x.shape[0], -1))
    assert (corr - torch.eye(x.shape[0])).abs().max().item() < 0.95


def test_structured_video_latent_changes_smoothly():
    v = structured_latent((1, 16, 9, 13, 21), seed=3)
    step = torch.stack([(v[:, :, t + 1] - v[:, :, t]).abs().mean() for t in range(8)])
    far = (v[:, :, 8] - v[:, :, 0]).abs().mean()
    assert step.min() > 0.05, "consecutive frames must differ"
    assert step.max() < 0.7 * far, "consecutive frames must be closer than distant ones"
    assert v.std().item() == pytest.approx(1.0, abs=0.05)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 2),
    c=st.sampled_from([1, 4, 16, 48]),
    t=st.one_of(st.none(), st.integers(1, 6)),
    h=st.integers(1, 23),
    w=st.integers(1, 23),
    seed=st.integers(0, 2**31),
)
def test_structured_latent_any_shape(b, c, t, h, w, seed):
    shape = (b, c, h, w) if t is None else (b, c, t, h, w)
    x = structured_latent(shape, seed=seed)
    assert x.shape == shape
    assert torch.isfinite(x).all()
    assert torch.equal(x, structured_latent(shape, seed=seed))
    if x[0].numel() > 64:
        assert 0.5 < x[0].std().item() < 1.5
