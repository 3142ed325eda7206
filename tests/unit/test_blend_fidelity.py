"""No overlap-blend under 30 dB without the user asking (issue 36 item 3).

Before a blend plan runs, the Temporal-Chunk Video Decode engine measures it (``decode.video.check_blend``): a small
random latent decoded whole by the host and blended at the planned ``k``, PSNR on ``[0, 1]``, cached per structure
(``self_check.verify`` with ``floor_db``; an inconclusive measure never). At or above the floor the blend runs and
its path row states the measured dB; under it, the host's own decode (exact) runs, flagged over budget, unless
``allow_approximate`` is set; a decoder the blend cannot serve (LTX 2.4's diffusion decoder) never blends.
"""

from __future__ import annotations

import math

import pytest
import torch
from vramfit.memory.decode import env as denv
from vramfit.memory.decode import self_check as sc
from vramfit.memory.decode import video as vd
from vramfit.memory.vae.carry_layout import blend_refusal

from tests.unit.test_oom_filter_and_fallback_paths import MiB, TinyVideoVAE


class FirstFrameDecoder(torch.nn.Module):
    """Every output frame leans on the clip's first latent frame (``4 T - 3`` frames, 2x spatial): a chunk decoded
    on its own leans on its own first frame instead, so the overlap-blend is far off."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv3d(4, 3, 1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        x = self.proj(z) + 3 * self.proj(z[:, :, :1])
        x = x.repeat_interleave(2, -1).repeat_interleave(2, -2).repeat_interleave(4, 2)[:, :, 3:]
        return torch.tanh(x)


def _far_off_vae() -> TinyVideoVAE:
    vae = TinyVideoVAE()
    vae.first_stage_model = FirstFrameDecoder()
    return vae


def _decode(vae, z, budget_mb, env=None, **kw) -> vd.VideoDecodeResult:
    return vd.decode_video(vd.make_job(vae, z, "cpu"), env or denv.DecodeEnv(checks=sc.CheckStore()),
                           budget_mb=budget_mb, unload_others=False, **kw)


def _reference(vae, z, shape) -> torch.Tensor:
    with torch.inference_mode():
        return vae.process_output(vae.first_stage_model.decode(z)).movedim(1, -1).reshape(shape).float()


Z = torch.randn(1, 4, 9, 16, 16, generator=torch.Generator().manual_seed(0))


def _blend_budget(vae) -> float:
    """A budget under the host's whole decode (so the plan is an overlap-blend), in MB."""
    whole = _decode(vae, Z, 1024)
    assert whole.plan.path == "host" and not whole.plan.over_budget
    return whole.plan.planned * 0.99 / MiB


def test_a_far_off_blend_is_not_taken_without_the_user_asking():
    vae = _far_off_vae()
    env = denv.DecodeEnv(checks=sc.CheckStore())
    r = _decode(vae, Z, _blend_budget(vae), env)
    rows = dict(r.report.rows)
    assert r.plan.path == "host" and r.plan.exact and r.plan.over_budget, rows
    assert torch.equal(r.images, _reference(vae, Z, r.images.shape))
    path = rows["path"]
    assert path.startswith("exact: the host's own decode") and "allow_approximate" in path, path
    db = float(path.split("measured ")[1].split(" dB")[0])
    assert db < sc.FIDELITY_FLOOR_DB and "vs VAE Decode on the first-use check" in path, path
    assert "OVER BUDGET" in rows["predicted"] and r.report.summary.startswith("exact"), rows
    assert "first use" in rows and "fidelity" in rows["first use"], rows
    # the measure is kept (per structure; this one failed: per file) and not run again
    kept = [k for k in env.checks.keys() if k.startswith("blend-fidelity/")]
    assert len(kept) == 1, kept
    again = _decode(vae, Z, _blend_budget(vae), env)
    assert again.plan.path == "host" and "first use" not in dict(again.report.rows)


def test_the_user_may_ask_for_the_far_off_blend():
    vae = _far_off_vae()
    r = _decode(vae, Z, _blend_budget(vae), allow_approximate=True)
    rows = dict(r.report.rows)
    assert r.plan.path == "blend" and not r.plan.exact and not r.plan.over_budget, rows
    path = rows["path"]
    assert path.startswith("APPROXIMATE: ") and "taken because allow_approximate is on" in path, path
    assert float(path.split("measured ")[1].split(" dB")[0]) < sc.FIDELITY_FLOOR_DB, path
    assert r.report.summary.startswith("approximate"), r.report.summary
    err = (r.images - _reference(vae, Z, r.images.shape)).pow(2).mean().item()
    assert 10 * math.log10(1 / err) < sc.FIDELITY_FLOOR_DB  # what was measured is what the user gets


def test_a_faithful_blend_runs_and_states_its_measure():
    vae = TinyVideoVAE()  # frame by frame: the blend equals the host's decode
    r = _decode(vae, Z, _blend_budget(vae))
    path = dict(r.report.rows)["path"]
    assert r.plan.path == "blend" and path.startswith("APPROXIMATE: ") and "measured inf dB (equal)" in path, path
    assert ">= the 30 dB floor" in path, path


def test_fidelity_verdicts_keep_like_the_exactness_verdicts():
    store = sc.CheckStore()
    ref = torch.full((1, 3, 4, 4), 0.5)
    near, far = ref + 0.01, ref + 0.3  # 40 dB, 10.5 dB
    ok = sc.verify("f/a", store, lambda: ref, [("near", lambda: near)], torch.float32, "w1", floor_db=30)
    assert ok.ok and ok.psnr == pytest.approx(40.0, abs=0.01) and store.verdict("f/a", "w2") is not None
    bad = sc.verify("f/b", store, lambda: ref, [("far", lambda: far)], torch.float32, "w1", floor_db=30)
    assert not bad.ok and bad.conclusive and bad.psnr < 11
    assert store.verdict("f/b", "w1") is not None and store.verdict("f/b", "w2") is None  # a failure: per file
    assert "measured 10.5 dB" in bad.describe() and "< the 30 dB floor" in bad.describe()
    nan = sc.verify("f/c", store, lambda: ref, [("nan", lambda: ref * math.nan)], torch.float32, "w1", floor_db=30)
    assert not nan.ok and not nan.conclusive and store.verdict("f/c", "w1") is None  # never kept
    assert sc.Verdict.from_dict(bad.to_dict()) == bad


def test_ltx24_diffusion_decoder_never_blends():
    class CausalDiffusionVAE(torch.nn.Module):
        pass

    CausalDiffusionVAE.__module__ = "comfy.ldm.lightricks.vae.na_diffusion_decoder"
    why = blend_refusal(CausalDiffusionVAE())
    assert why is not None and "noise" in why
    assert blend_refusal(FirstFrameDecoder()) is None


def test_the_hosts_decode_out_of_memory_names_the_measure_and_allow_approximate():
    """Under the floor the host's decode runs over the budget; when it then runs out of memory, the error names
    the node, the measure and ``allow_approximate`` (the user decides)."""
    vae = _far_off_vae()
    budget = _blend_budget(vae)
    decode = vae.first_stage_model.decode

    def oom_on_the_whole_clip(z: torch.Tensor) -> torch.Tensor:
        if z.shape[2] == Z.shape[2] and type(z).__name__ != "FakeTensor" and z.device.type != "meta":
            raise torch.OutOfMemoryError("the whole clip does not fit")
        return decode(z)

    vae.first_stage_model.decode = oom_on_the_whole_clip
    with pytest.raises(RuntimeError, match=r"Temporal-Chunk Video Decode: the host's own decode ran out of memory "
                                           r".*measured [\d.]+ dB.*Set allow_approximate to true"):
        _decode(vae, Z, budget)
    r = _decode(vae, Z, budget, allow_approximate=True)  # the blend's chunks fit
    assert r.plan.path == "blend", dict(r.report.rows)


def test_a_clip_in_one_chunk_is_the_hosts_decode_unmeasured():
    """``frames_per_chunk`` at least the clip's length: the one blend chunk is the host's own decode, reported
    exact without a measure."""
    vae = _far_off_vae()
    z = Z[:, :, :3]
    env = denv.DecodeEnv(checks=sc.CheckStore())
    r = vd.decode_video(vd.make_job(vae, z, "cpu", frames_per_chunk=4), env, budget_mb=1024, unload_others=False)
    path = dict(r.report.rows)["path"]
    assert r.plan.path == "host" and r.plan.exact and "holds the whole clip" in path, path
    assert not [k for k in env.checks.keys() if k.startswith("blend-fidelity/")]
    assert torch.equal(r.images, _reference(vae, z, r.images.shape))
