"""A decoder that mixes the items of its batch (SVD's temporal decoder: ``AutoencodingEngine`` whose decoder is
``comfy.ldm.modules.temporal_ae.VideoDecoder``, time mixing in every res block and at the output) is never split
into passes and called exact (issue 36, item 1).

The VAE is built as a user's file loads it: a state dict with the host's key names (random weights from the host's
own classes, the config ``comfy/sd.py`` builds for ``decoder.mid.block_1.mix_factor``) through ``comfy.sd.VAE``,
decoded by Tiled VAE Decode against core ``VAEDecode``. Thresholds: a report that says exact is within 1e-4 (max
abs, images on [0, 1]) of ``VAEDecode``; a batch decoded in several passes differs by > 1e-3 (so the exact ones
could fail).
"""

from __future__ import annotations

import sys

import pytest
import torch

from scripts.fixtures import structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

NODE_ID = "VRAMFit_TiledVAEDecode"
MiB = 2**20
SHAPE = (3, 4, 8, 8)
"""Three frames of 64x64 px: one frame's untiled decode is some MiB, the whole batch about three times that."""


def _svd_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the SVD VAE ``comfy.sd.VAE`` builds for a file with ``decoder.mid.block_1.mix_factor``
    (its config, the host's classes), keyed as such a file."""
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    from scripts import fixtures

    enc = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
           "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    dec = dict(enc, video_kernel_size=[3, 1, 1], alpha=0.0)
    with torch.device("meta"):
        model = AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": enc},
            decoder_config={"target": "comfy.ldm.modules.temporal_ae.VideoDecoder", "params": dec})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if not [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                continue
            module.to_empty(device="cpu", recurse=False)
            if not fixtures._torch_reset(module):  # VideoResBlock's learned blend: any logit, away from 0/1
                with torch.no_grad():
                    module.mix_factor.normal_()
    return model.state_dict()


@pytest.fixture(scope="module")
def svd_vae(comfy):
    import comfy.sd

    vae = comfy.sd.VAE(sd=_svd_state_dict())
    assert type(vae.first_stage_model.decoder).__name__ == "VideoDecoder"
    return vae


@pytest.fixture(scope="module")
def mod(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[NODE_ID].__module__]


@pytest.fixture(scope="module")
def case(comfy, svd_vae):
    z = structured_latent(SHAPE, seed=4)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(svd_vae, {"samples": z})
    return z, ref


def _decode(mod, vae, z, **kw):
    with torch.inference_mode():
        return mod.decode(vae, {"samples": z}, **kw)


def _never_wrongly_exact(r, ref) -> float:
    diff = (r.images - ref).abs().max().item()
    if r.report.summary.startswith("exact"):
        assert diff <= 1e-4, (diff, r.report.summary)
    return diff


def test_the_hosts_svd_decoder_mixes_its_batch(svd_vae, case):
    """The premise: the host decodes SVD's batch as one video, so splitting it changes every frame."""
    z, _ = case
    model = svd_vae.first_stage_model
    with torch.inference_mode():
        whole = model.decode(z)
        parts = torch.cat([model.decode(z[i : i + 1]) for i in range(z.shape[0])])
    assert (whole - parts).abs().max().item() > 1e-2


def test_the_kl_walker_refuses_svd_cleanly(mod, svd_vae):
    """No TypeError from ``VideoResBlock.forward`` (it needs ``temb``): the walker's structure check refuses the
    decoder with the reason."""
    from vramfit.memory.vae.kl_layout import unsupported_reason

    reason = unsupported_reason(svd_vae.first_stage_model)
    assert reason is not None and "time mixing" in reason


def test_the_whole_batch_in_one_pass_when_it_fits(mod, svd_vae, case):
    z, ref = case
    r = _decode(mod, svd_vae, z, budget_mb=4096)
    assert r.plan.path == "untiled" and r.plan.config.images_per_pass == 3
    assert r.report.summary.startswith("exact")
    assert _never_wrongly_exact(r, ref) <= 1e-4


def test_a_budget_below_the_whole_batch_is_approximate(mod, svd_vae, case):
    """The issue's case: a budget for one or two of the three frames per pass. Either the whole batch in one pass
    or the report says approximate, with the batch self-check's verdict as the reason."""
    z, ref = case
    whole = _decode(mod, svd_vae, z, budget_mb=4096).plan.planned
    one = _decode(mod, svd_vae, z[:1], budget_mb=4096).plan.planned
    assert one < whole
    r = _decode(mod, svd_vae, z, budget_mb=(one + whole) // 2 // MiB)
    rows = dict(r.report.rows)
    diff = _never_wrongly_exact(r, ref)
    assert r.plan.path == "untiled" and r.plan.config.images_per_pass < 3, r.plan.description
    assert r.report.summary.startswith("approximate") and not r.plan.exact
    assert "mixes the items of its batch" in rows["path"] and "VideoDecoder" in rows["path"]
    assert rows["path"].startswith("approximate: untiled")
    assert diff > 1e-3  # split, so not the host's result: the label above is needed


def test_tiles_of_40_px_are_approximate_without_a_crash(mod, svd_vae, case, caplog):
    """The issue's second case: a tile size forces tiles; the walker refuses SVD's decoder cleanly (no caught
    TypeError stored as a failed self-check) and the generic tiles, one frame per pass, say approximate."""
    z, ref = case
    with caplog.at_level("WARNING"):
        r = _decode(mod, svd_vae, z, tile_size=40, budget_mb=4096)
    rows = dict(r.report.rows)
    _never_wrongly_exact(r, ref)
    assert r.plan.path == "generic" and r.report.summary.startswith("approximate")
    assert "temb" not in caplog.text and "TypeError" not in rows["path"]
    assert "time mixing" in rows["path"] and "mixes the items of its batch" in rows["path"]
