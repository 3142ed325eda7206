"""MiniMax H3's video VAE on the newest stored upstream ``comfy/ldm/minimax/vae.py`` (Comfy-Org ``19315e86``, loaded
over a ComfyUI 0.33.0 host by ``scripts.upstream.newest``): its tiled decode blends each tile against its already
blended neighbours and decodes a row of tiles per decoder call. The pack finds that grid by structure (its
``_decode_tile_row``), proves it at first use and reproduces it one tile (or one row group) at a time within the
budget, equal to core ``VAEDecode`` under the same overlay (issue 41 item 5).

The VAE is built as the newest ``sd.py`` builds it (``scripts.upstream_minimax``: a real ``comfy.sd.VAE`` with that
branch's attributes, a narrow random-weight model of the newest classes and key names), once with float weights and
once with the decoder's transformer linears int8 + ConvRot (``comfy.ops.mixed_precision_ops``). 0.33.0 only: 0.3.75
has no ``comfy.ldm.minimax``.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

VIDEO = "VRAMFit_TemporalChunkVideoDecode"
TILED_ENCODE = "VRAMFit_TiledVAEEncode"
VIDEO_ENCODE_NODE = "Temporal-Chunk Video Encode"
SHAPE = (1, 24, 12, 10, 10)
"""12 latent frames (two clips of the host's grid, the second's kept tail flushed: 39 frames), 160x160 px: 3x3
tiles of 64 px."""
MiB = 2**20


def _pack(comfy, name: str):
    """The pack's module ``name`` as ComfyUI loaded it (under the pack's folder name, not ``vramfit``)."""
    return sys.modules[f"{comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__.rsplit('.', 2)[0]}.{name}"]


@pytest.fixture(scope="module")
def newest(comfy):
    """The newest ``comfy/ldm/minimax/vae.py`` over the host for this module's tests (0.33.0's after)."""
    if importlib.util.find_spec("comfy.ldm.minimax") is None:
        pytest.skip("this host (ComfyUI 0.3.75) has no comfy.ldm.minimax: the newest minimax/vae.py loads over "
                    "ComfyUI 0.33.0's modules")
    from scripts.upstream_minimax import newest_minimax

    with newest_minimax() as mv:
        yield mv


def _vae(quantized: bool):
    from scripts.upstream_minimax import minimax_vae

    with torch.inference_mode():  # as ComfyUI's loader runs (int8 weights are re-wrapped under inference mode)
        return minimax_vae(quantized=quantized)


@pytest.fixture(scope="module")
def vaes(newest) -> dict:
    """``{quantized: VAE}``: built once each for the module."""
    return {}


@pytest.fixture(scope="module", params=[False, True], ids=["float", "int8-convrot"])
def minimax(newest, vaes, request):
    import comfy.ops

    if request.param not in vaes:
        vaes[request.param] = _vae(request.param)
    vae = vaes[request.param]
    assert type(vae.first_stage_model) is newest.MiniMaxH3VideoVAE and vae.handles_tiling
    linear = vae.first_stage_model.decoder.transformer_blocks[0].attn.to_qkv
    assert isinstance(linear.weight, comfy.ops.QuantizedTensor) is request.param
    return vae


@pytest.fixture(scope="module")
def case(comfy, minimax):
    z = structured_latent(SHAPE, seed=5)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(minimax, {"samples": z})
    return z, ref


def _host_peak(minimax, z) -> int:
    """Live tensor peak of the host's own decode (``first_stage_model.decode``, its float32 output included)."""
    from vramfit.memory.measure.tracker import PeakTracker

    with PeakTracker("cpu") as host, torch.inference_mode():
        minimax.first_stage_model.decode(z)
    return int(host.peak_bytes)


def test_the_newest_grid_is_found_by_structure(comfy, minimax, case, monkeypatch):
    """``_decode_tile_row`` makes it the neighbour-blended grid; 0.33.0's raw-edge reproduction of it is another
    result (so the comparisons below could fail), and so is its untiled decode."""
    hg = _pack(comfy, "memory.executors.host_grid")
    plan = _pack(comfy, "memory.plan.host_grid")
    model = minimax.first_stage_model
    assert hg.grid_kind(model) == hg.BLENDED
    assert plan.host_grid_of(model) == f"the host's own video grid ({hg.BLENDED})"
    cfg = plan.grid_config(model, SHAPE)
    assert (len(cfg.rows[0]), len(cfg.cols[0]), len(cfg.clips)) == (3, 3, 2), cfg
    z, ref = case
    out = torch.empty(tuple(model.decode_output_shape(SHAPE)))
    with monkeypatch.context() as m:
        m.setattr(hg, "grid_kind", lambda model: hg.RAW)
        with torch.inference_mode():
            hg.decode_host_grid(model, z, out=out, compute_device="cpu", dtype=torch.float32)
    assert (out[0].permute(1, 2, 3, 0) - ref).abs().max().item() > 1e-3
    model.tiling = False
    try:
        with torch.inference_mode():
            untiled = model.decode(z)
    finally:
        model.tiling = True
    assert (untiled[0].permute(1, 2, 3, 0) - ref).abs().max().item() > 1e-3


def test_neither_grid_takes_the_hosts_decode(comfy, minimax):
    """A row method that cannot take ``(z_row, x_idx, x_len)`` is neither grid: the video node takes the host's own
    decode and says why (the model untiled here, so the host's decode never calls that method)."""
    hg = _pack(comfy, "memory.executors.host_grid")
    video = sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__]

    class Raw:
        pass

    assert hg.grid_kind(Raw()) == hg.RAW
    model = minimax.first_stage_model
    z = structured_latent((1, 24, 2, 3, 3), seed=4)
    model._decode_tile_row, model.tiling = (lambda z_row, x_idx: iter(())), False
    try:
        assert hg.grid_kind(model) is None and _pack(comfy, "memory.plan.host_grid").host_grid_of(model) is None
        with torch.inference_mode():
            (ref,) = comfy.VAEDecode().decode(minimax, {"samples": z})
            r = video.decode(minimax, {"samples": z})
    finally:
        del model._decode_tile_row
        model.tiling = True
    text = r.report.text()
    assert "tiles internally (handles_tiling) in a way the pack does not reproduce" in text, text
    assert torch.equal(r.images, ref), text


def test_video_node_equals_vae_decode_within_a_budget_below_the_hosts_peak(comfy, minimax, case):
    """Temporal-Chunk Video Decode: the newest grid checked at first use and reproduced one tile (or row group) at
    a time, equal to VAE Decode under the same overlay, within a budget below the host decode's own peak (halfway
    between that and the executor's predicted peak, one tile per call, its output buffer included)."""
    from vramfit.memory.decode.video import make_job
    from vramfit.memory.plan.host_grid import grid_peak
    from vramfit.memory.plan.video import PeakStore, out_bytes

    video = sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__]
    z, ref = case
    host = _host_peak(minimax, z)
    job = make_job(minimax, z, "cpu")
    planned = grid_peak(job, PeakStore(), 1) + out_bytes(job, int(ref.shape[0]), *ref.shape[1:3])
    assert planned < host, (planned, host)
    budget_mb = (planned + host) // 2 // MiB
    with torch.inference_mode():
        r = video.decode(minimax, {"samples": z}, budget_mb=budget_mb)
    text = r.report.text()
    assert r.plan.path == "host_grid" and r.plan.exact and not r.plan.over_budget, text
    assert "exact (the host's own tiled result reproduced)" in text and "self-check passed" in text, text
    assert "neighbour-blended grid" in text and "18 grid tiles" in r.report.summary, text
    assert "memory_used_decode" in dict(r.report.rows)["model estimate"], text
    assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB < host, (r.measured_peak, host, text)
    assert r.images.shape == ref.shape and torch.equal(r.images, ref), text


def test_a_roomy_budget_takes_row_groups(comfy, minimax, case):
    """With room, several of a row's tiles go to one decoder call (the host's own ``_decode_tile_row``): still
    VAE Decode's result."""
    video = sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__]
    z, ref = case
    with torch.inference_mode():
        r = video.decode(minimax, {"samples": z}, budget_mb=1024)
    text = r.report.text()
    assert r.plan.path == "host_grid" and r.plan.config.batch == 3, text
    assert "3 of a row's tiles per decoder call" in text, text
    assert torch.equal(r.images, ref), text


def test_tiled_node_decodes_a_batch_of_single_frames(comfy, minimax):
    """Tiled VAE Decode: a 4-D latent on this video VAE is one frame per batch item (two here: the host decodes
    them together, the executor item by item), through the same grid."""
    tiled = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]
    z = structured_latent((2, 24, 10, 10), seed=7)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(minimax, {"samples": z.unsqueeze(2)})
        r = tiled.decode(minimax, {"samples": z})
    text = r.report.text()
    assert r.plan.path == "host_grid" and "exact (the host's own tiled result reproduced)" in text, text
    assert r.images.shape == ref.shape and torch.equal(r.images, ref), text


def test_an_oom_inside_a_tile_resumes(comfy, minimax, case):
    """An out-of-memory error in a decoder call: a row group is halved, a single tile decoded again; the
    finished tiles are kept and the result is still VAE Decode's."""
    hg = _pack(comfy, "memory.executors.host_grid")
    z, ref = case
    model = minimax.first_stage_model
    for batch, steps in ((1, 19), (3, 11)):  # 18 tiles, one twice; 3 rows x 2 clips, one group halved then 1+2
        fired: list[int] = []

        def hook(step: int, fired=fired) -> None:
            if step == 4 and not fired:
                fired.append(step)
                raise torch.OutOfMemoryError("injected")

        stats: dict = {}
        out = torch.empty(tuple(model.decode_output_shape(SHAPE)))
        with torch.inference_mode():
            hg.decode_host_grid(model, z, out=out, compute_device="cpu", dtype=torch.float32, row_batch=batch,
                                fault_hook=hook, oom_exceptions=(torch.OutOfMemoryError,), stats=stats)
        assert fired == [4] and stats["restarts"] == 1, stats
        assert stats["steps"] == steps, stats
        assert torch.equal(out[0].permute(1, 2, 3, 0), ref), batch


def test_an_oom_through_the_node_is_reported(comfy, minimax, case):
    """The same through the video decode (the node's engine): the report counts the decoder call made again."""
    from vramfit.memory.decode.env import DecodeEnv
    from vramfit.memory.decode.self_check import CheckStore
    from vramfit.memory.decode.video import decode_video, make_job

    z, ref = case
    fired: list[int] = []

    def hook(kind: str, step: int) -> None:
        if kind == "step" and step == 2 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected")

    env = DecodeEnv(checks=CheckStore(), fault_hook=hook, oom_exceptions=(torch.OutOfMemoryError,))
    with torch.inference_mode():
        r = decode_video(make_job(minimax, z, "cpu"), env, budget_mb=64)
    text = r.report.text()
    assert fired == [2] and r.plan.path == "host_grid", text
    assert "made again after an out-of-memory error" in dict(r.report.rows)["oom"], text
    assert torch.equal(r.images, ref), text


def _pixels(frames: int, h: int, w: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((frames, h, w, 3), generator=gen)


@pytest.mark.parametrize("node", ["tiled", "video"])
def test_encode_nodes_equal_vae_encode(comfy, vaes, node):
    """Tiled VAE Encode and Temporal-Chunk Video Encode: VAE Encode's latent (the host's own encode, which tiles
    itself, with the reason in the report). The float model only: the quantized file's encoder is the same."""
    if False not in vaes:
        vaes[False] = _vae(False)
    vae = vaes[False]
    mod = sys.modules[comfy.NODE_CLASS_MAPPINGS[TILED_ENCODE].__module__]
    pixels = _pixels(5, 80, 64, seed=3)  # 5 frames: 2 latent frames; 2x1 of the host's 64 px encode tiles
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(vae, pixels)
        kw = {"node": VIDEO_ENCODE_NODE} if node == "video" else {}
        r = mod.encode(vae, pixels, **kw)
    text = r.report.text()
    assert r.latent.shape == ref["samples"].shape and torch.equal(r.latent, ref["samples"]), text
    path = dict(r.report.rows)["path"]
    assert path.startswith("exact: the host's own encode") and "(" in path, text
