"""The self-check guard of both exact executors (``memory/decode/self_check.py``) on the in-process host.

* A deliberately mismatched decoder (a copy of a model with one layer's behaviour altered) is caught at first
  use and the decode is reported APPROXIMATE with the reason (the verdict); for Wan the auto plan falls back
  to the host's own decode, exact by construction (equal to the altered model's decode).
* The unaltered decoders pass (report row ``check``), the verdict is cached (in memory and in the file the
  node persists it to), and the check is cheap (measured seconds logged).

The altered Wan layer's output depends on how many frames a call holds (as the real ComfyUI 0.33 cache
protocol change did): the host decode and the chunked executor call it with different frame counts, on
either host. The altered KL block scales its output: the host's decode calls the block's ``forward``, the
walker calls its convolutions and norms itself.
"""

from __future__ import annotations

import logging
import sys
import time
import types

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from tests.video_refs import tiny_wan

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.decoder_self_check")

VIDEO_NODE = "VRAMFit_TemporalChunkVideoDecode"
IMAGE_NODE = "VRAMFit_TiledVAEDecode"


def _module(comfy, node_id: str):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[node_id].__module__]


@pytest.fixture()
def fresh_checks(comfy):
    """Both nodes' self-check store replaced by an empty in-memory one (the real one persists verdicts in the
    host's user folder, so a second run would find them)."""
    mod = _module(comfy, VIDEO_NODE)
    self_check = sys.modules[mod.__name__.rsplit(".nodes.", 1)[0] + ".memory.decode.self_check"]
    store = self_check.CheckStore()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(self_check, "store_at", lambda path: store)
        yield store


def _vae(model: torch.nn.Module) -> types.SimpleNamespace:
    """A duck-typed ComfyUI VAE around a tiny Wan model (CPU, float32, no model patcher)."""
    return types.SimpleNamespace(
        first_stage_model=model, vae_dtype=torch.float32, device=torch.device("cpu"), latent_dim=3,
        latent_channels=4, process_output=lambda x: torch.clamp((x + 1.0) / 2.0, 0.0, 1.0))


def _frames(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, T, H, W) on [-1, 1] -> VAEDecode's (B*T, H, W, 3) on [0, 1]."""
    y = torch.clamp((x + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1)
    return y.reshape(-1, *y.shape[-3:])


def _alter_by_frames_per_call(model: torch.nn.Module) -> None:
    """The middle attention block of ``model`` adds 0.1 per frame of the call it is given."""
    attn = model.decoder.middle[1]
    orig = attn.forward

    def forward(x, *args, **kwargs):
        return orig(x, *args, **kwargs) + 0.1 * x.shape[2]

    attn.forward = forward


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def wan_pair(host_config):
    from scripts.host import import_comfy

    import_comfy(host_config)
    plain, altered = tiny_wan("2.1"), tiny_wan("2.1")
    _alter_by_frames_per_call(altered)
    z = structured_latent((1, 4, 4, 3, 5), seed=2)
    with torch.inference_mode():
        refs = {"plain": _frames(plain.decode(z)), "altered": _frames(altered.decode(z))}
    return plain, altered, z, refs


def test_wan_mismatched_decoder_is_caught_and_reported_approximate(comfy, wan_pair, fresh_checks):
    mod = _module(comfy, VIDEO_NODE)
    plain, altered, z, refs = wan_pair
    assert _diff(refs["plain"], refs["altered"]) > 0.05  # the alteration shows in the host's own decode

    r = mod.decode(_vae(altered), {"samples": z}, frames_per_chunk=3)  # calls of 3 frames: the host's 1 or 2
    path = dict(r.report.rows)["path"]
    log.info("altered Wan, k = 3: %s", path)
    assert path.startswith("APPROXIMATE") and "self-check FAILED" in path and "max abs diff" in path
    assert not r.plan.exact and r.plan.path != "host"
    assert _diff(r.images, refs["altered"]) > 1e-3  # the executor indeed does not reproduce this decoder

    # The auto plan takes the host's own decode instead: exact by construction.
    r = mod.decode(_vae(altered), {"samples": z})
    path = dict(r.report.rows)["path"]
    log.info("altered Wan, auto: %s", path)
    assert r.plan.path == "host" and path.startswith("exact: the host's own decode") and "self-check FAILED" in path
    assert _diff(r.images, refs["altered"]) <= 1e-6

    # The unaltered model passes, and says so.
    r = mod.decode(_vae(plain), {"samples": z}, frames_per_chunk=1, tile_size=16)
    rows = dict(r.report.rows)
    assert rows["path"].startswith("exact: causal caches") and "self-check passed" in rows["check"]
    assert _diff(r.images, refs["plain"]) <= 1e-5
    verdicts = [v for v in fresh_checks._values.values()]
    assert sorted(v["ok"] for v in verdicts) == [False, True]


def test_kl_mismatched_decoder_is_caught_and_reported_approximate(comfy, fixture_vaes, kl_vae, fresh_checks):
    mod = _module(comfy, IMAGE_NODE)
    z = structured_latent((1, 4, 8, 10), seed=3)
    r = mod.decode(kl_vae, {"samples": z}, tile_size=32)
    rows = dict(r.report.rows)
    assert rows["path"].startswith("exact: layer-synchronous tiles") and "self-check passed" in rows["check"]

    altered = comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0]  # a copy of the model...
    block = altered.first_stage_model.decoder.up[1].block[0]
    orig = block.forward
    block.forward = lambda x, *a, **kw: orig(x, *a, **kw) * 1.5  # ...with one block's behaviour altered
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(altered, {"samples": z})[0]
    r = mod.decode(altered, {"samples": z}, tile_size=32)
    path = dict(r.report.rows)["path"]
    log.info("altered KL, tile 32 px: %s", path)
    assert path.startswith("approximate") and "self-check FAILED" in path and "max abs diff" in path
    assert ">= the 30 dB floor" in path, path  # the generic tiles' measure (issue 36's floor)
    assert r.plan.path == "generic"
    assert r.images.shape == ref.shape


@pytest.mark.parametrize("kind", ["wan21", "kl_f8"])
def test_check_of_a_fixture_vae_is_cheap_and_persisted(comfy, fixture_vaes, kind, tmp_path):
    """The real-size fixture decoders pass; the time is logged (docs/VIDEO_DECODE.md, TILED_DECODE.md); a
    second lookup (a new store on the same file, as in the next ComfyUI session) runs nothing."""
    from vramfit.memory.decode import image as idm
    from vramfit.memory.decode import self_check as sc
    from vramfit.memory.decode import video as vd

    vae = comfy.VAELoader().load_vae(fixture_vaes[kind])[0]
    path = tmp_path / "checks.json"

    def check(store):
        if kind == "wan21":
            return vd.check_chunked(vd.make_job(vae, torch.zeros(1, 16, 3, 2, 2), "cpu"), store)
        return idm.check_exact(idm.make_job(vae, torch.zeros(1, 4, 8, 8), core=True, out_device="cpu"), store)

    verdict = check(sc.CheckStore(path))
    log.info("%s: %s", kind, verdict.describe())
    assert verdict.ok and verdict.max_diff <= verdict.tolerance
    t0 = time.perf_counter()
    again = check(sc.CheckStore(path))
    assert again == verdict  # the stored verdict (a new run would have measured its own seconds)
    assert time.perf_counter() - t0 < min(0.5, verdict.seconds)


def _load_kl(comfy, fixture_vaes, nudge: float = 0.0, nan: bool = False):
    """The fixture KL VAE loaded as ComfyUI's executor loads it (inference mode); ``nudge`` shifts one conv's
    weights (another file of the same structure), ``nan`` breaks one weight (a decode that is non-finite)."""
    with torch.inference_mode():
        vae = comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0]
        w = vae.first_stage_model.decoder.conv_in.weight
        if nudge:
            w.add_(nudge)
        if nan:
            w[0, 0, 0, 0] = float("nan")
    return vae


def _node_decode(mod, vae, z, **kw):
    with torch.inference_mode():
        return mod.decode(vae, {"samples": z}, **kw)


def test_a_non_finite_vae_is_no_verdict_and_does_not_downgrade_good_ones(comfy, fixture_vaes, fresh_checks):
    """Issue 22 (2): a broken file's check could not conclude: nothing cached, the report says exactness is
    unverified; good files of the same structure then decode exactly."""
    mod = _module(comfy, IMAGE_NODE)
    z = structured_latent((1, 4, 8, 10), seed=3)
    broken = _load_kl(comfy, fixture_vaes, nan=True)
    r = _node_decode(mod, broken, z, tile_size=32)
    path = dict(r.report.rows)["path"]
    log.info("non-finite KL: %s", path)
    # Nor can the approximate tiles' fidelity be measured: the host's own decode (issue 36's floor), saying why
    assert path.startswith("exact: untiled") and "fidelity could not be measured" in path, path
    assert "could not conclude" in path and "unverified" in path, path
    r = _node_decode(mod, broken, z, tile_size=32, allow_approximate=True)
    path = dict(r.report.rows)["path"]
    assert path.startswith("approximate") and "could not conclude" in path and "unverified" in path, path
    assert "fidelity not measured" in path and "taken because allow_approximate is on" in path, path
    assert len(fresh_checks) == 0  # no verdict cached

    good = _load_kl(comfy, fixture_vaes, nudge=1e-3)
    r = _node_decode(mod, good, z, tile_size=32)
    rows = dict(r.report.rows)
    assert rows["path"].startswith("exact: layer-synchronous tiles") and "self-check passed" in rows["check"]
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(good, {"samples": z})[0]
    assert _diff(r.images, ref) <= 1e-4


@pytest.mark.slow
def test_a_cached_failure_is_per_file_and_rechecked_with_the_env_switch(comfy, fixture_vaes, fresh_checks,
                                                                       monkeypatch):
    """A real failure stored for file A does not condemn file B of the same structure; A's report says how to
    re-check, and ``VRAMFIT_RECHECK=1`` re-checks it (A is in fact fine: the pass replaces the failure)."""
    from vramfit.memory.decode import self_check as sc

    mod = _module(comfy, IMAGE_NODE)
    monkeypatch.delenv("VRAMFIT_RECHECK", raising=False)
    z = structured_latent((1, 4, 8, 10), seed=4)
    a, b = _load_kl(comfy, fixture_vaes), _load_kl(comfy, fixture_vaes, nudge=2e-3)
    assert dict(_node_decode(mod, a, z, tile_size=32).report.rows)["path"].startswith("exact")
    (key,) = fresh_checks.keys()
    weights_a = sc.weights_digest(a.first_stage_model)
    fresh_checks.drop(key)  # as if A had failed: its failure stored for its weights
    fresh_checks.put(f"{key}#{weights_a}", sc.Verdict(False, 0.3, 1e-4, "tiles of 16 px", 1.0).to_dict())

    path = dict(_node_decode(mod, a, z, tile_size=32).report.rows)["path"]
    assert path.startswith("approximate") and "FAILED" in path and "VRAMFIT_RECHECK=1" in path, path
    b_path = dict(_node_decode(mod, b, z, tile_size=32).report.rows)["path"]
    assert b_path.startswith("exact"), b_path  # B checks itself

    monkeypatch.setenv("VRAMFIT_RECHECK", "1")  # A is re-checked, not passed through B's stored pass
    r = _node_decode(mod, a, z, tile_size=32)
    assert dict(r.report.rows)["path"].startswith("exact"), dict(r.report.rows)["path"]
    assert fresh_checks.get(f"{key}#{weights_a}") is None and fresh_checks.get(key)["ok"]


def test_first_use_work_is_shown_on_the_node_and_reported_once(comfy, fixture_vaes, fresh_checks,
                                                               monkeypatch):
    """Issue 22 (5): the once-per-structure self-check is announced on the node while it runs and timed in the
    report's ``first use`` row; the next decode does no such work and says nothing of it."""
    mod = _module(comfy, IMAGE_NODE)
    comfy_mod = sys.modules[mod.__name__.rsplit(".", 1)[0] + "._comfy"]
    shown: list[str] = []
    monkeypatch.setattr(comfy_mod, "progress_text", lambda node_id=None: shown.append)
    vae, z = _load_kl(comfy, fixture_vaes, nudge=3e-3), structured_latent((1, 4, 8, 10), seed=5)
    report = _node_decode(mod, vae, z, tile_size=32).report
    rows = dict(report.rows)
    assert "checking exactness" in rows["first use"] and "once per VAE structure" in rows["first use"], rows
    assert " · first use +" in report.summary, report.summary  # the verdict line says why it took longer
    assert shown and shown[0].startswith("first use of this VAE: checking exactness"), shown
    n = len(shown)
    report = _node_decode(mod, vae, z, tile_size=32).report
    assert "first use" not in dict(report.rows) and "first use" not in report.summary and len(shown) == n
