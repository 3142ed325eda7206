"""The decode nodes on inputs that ComfyUI 0.33 decodes in new ways (issue 11, item 5), on the real host (--cpu).

* Nested latents: ``comfy.nested_tensor.NestedTensor`` (video + audio streams of LTX-2 / MiniMax H3; the class
  exists in 0.3.75 too) is not a ``torch.Tensor``; its ``shape`` is its first stream's and its ``ndim`` the
  largest of all streams. 0.33's VAE Decode decodes the first stream; both nodes do the same, or refuse it
  with the node's name and the stream's shape when that stream is the wrong kind.
* VAEs that tile and chunk internally (0.33's ``VAE.handles_tiling``) whose grid or structure the pack does not
  reproduce: refused with the node's name, the model and the latent shape. (MiniMax H3's grid is reproduced:
  tests/host/test_host_grid.py; SeedVR2 is decoded in exact tiles: tests/host/test_seedvr2.py.) 0.3.75 has no such VAE: the attribute is set on a real VAE as 0.33's
  ``VAE.__init__`` sets it, so both hosts run every test.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

TILED = "VRAMFit_TiledVAEDecode"
VIDEO = "VRAMFit_TemporalChunkVideoDecode"


def nested(*streams: torch.Tensor):
    """A nested latent built as ComfyUI builds one (``NestedTensor((video, audio))``)."""
    from comfy.nested_tensor import NestedTensor

    return NestedTensor(streams)


def audio_stream() -> torch.Tensor:
    return torch.randn(1, 8, 4, 16, generator=torch.Generator().manual_seed(0))


def internally_tiling(vae):
    """A copy of ``vae`` marked as 0.33 marks VAEs whose model tiles internally."""
    other = copy.copy(vae)
    other.handles_tiling = True
    return other


@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[TILED].__module__]


@pytest.fixture(scope="module")
def video(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__]


@pytest.fixture(scope="module")
def wan_vae(comfy, fixture_vaes):
    return comfy.VAELoader().load_vae(fixture_vaes["wan21"])[0]


def test_a_nested_latent_is_not_a_tensor_and_its_shape_misleads(comfy):
    z = nested(torch.zeros(1, 4, 8, 8), audio_stream())
    assert z.is_nested and not isinstance(z, torch.Tensor)
    assert [tuple(t.shape) for t in z.unbind()] == [(1, 4, 8, 8), (1, 8, 4, 16)]
    assert tuple(z.shape) == (1, 4, 8, 8)  # the first stream's: nothing says there is an audio stream


# ------------------------------------------------------------------------------------ Tiled VAE Decode


def test_tiled_decodes_the_first_stream_of_a_nested_latent(tiled, kl_vae):
    z = structured_latent((1, 4, 8, 8), seed=11)
    plain = tiled.decode(kl_vae, {"samples": z}, tile_size=32)
    both = tiled.decode(kl_vae, {"samples": nested(z, audio_stream())}, tile_size=32)
    assert both.images.shape == (1, 64, 64, 3)
    assert (both.images - plain.images).abs().max().item() <= 1e-6


def test_tiled_refuses_a_nested_video_latent_naming_node_and_stream(tiled, kl_vae):
    with pytest.raises(ValueError) as err:
        tiled.decode(kl_vae, {"samples": nested(torch.zeros(1, 16, 3, 8, 8), audio_stream())})
    text = str(err.value)
    assert text.startswith("[VRAM Fit · Tiled VAE Decode]"), text
    assert "first stream of a nested latent (2 streams) (1, 16, 3, 8, 8)" in text
    assert "wrong VAE for this latent" in text
    assert "Temporal-Chunk Video Decode" not in text  # it rejects it too


def _hosts_decode_of(comfy, node, vae, z, cls: str) -> None:
    """A VAE that tiles internally in a way the pack does not reproduce: VAE Decode's result, never an error, and the
    report says why (never worse than core's node, issue 41)."""
    with torch.inference_mode():
        r = node.decode(vae, {"samples": z})
        (ref,) = comfy.VAEDecode().decode(vae, {"samples": z})
    text = r.report.text()
    assert torch.equal(r.images, ref), text
    assert r.report.summary.startswith(f"host decode: not described: {cls} tiles internally (handles_tiling)"), text


def test_tiled_gives_the_hosts_decode_of_a_vae_that_tiles_internally(comfy, tiled, kl_vae):
    _hosts_decode_of(comfy, tiled, internally_tiling(kl_vae), structured_latent((1, 4, 8, 8), seed=3), "AutoencoderKL")


def test_tiled_refuses_a_torch_nested_tensor(tiled, kl_vae):
    jagged = torch.nested.nested_tensor([torch.zeros(3, 8), torch.zeros(5, 8)], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"^\[VRAM Fit · Tiled VAE Decode\] .*torch nested"):
        tiled.decode(kl_vae, {"samples": jagged})


# ------------------------------------------------------------------------------------ Temporal-Chunk Video Decode


def test_video_decodes_the_video_stream_of_a_nested_latent(video, wan_vae):
    z = structured_latent((1, 16, 2, 8, 8), seed=12)
    plain = video.decode(wan_vae, {"samples": z}, frames_per_chunk=1)
    both = video.decode(wan_vae, {"samples": nested(z, audio_stream())}, frames_per_chunk=1)
    assert both.images.shape == (5, 64, 64, 3)
    assert (both.images - plain.images).abs().max().item() <= 1e-6


def test_video_refuses_a_nested_latent_of_another_family(video, wan_vae):
    """(A nested single-frame Wan latent decodes: tests/host/test_latent_vae_sweep.py.)"""
    with pytest.raises(ValueError) as err:
        video.decode(wan_vae, {"samples": nested(torch.zeros(1, 4, 8, 8), audio_stream())})
    text = str(err.value)
    assert text.startswith("[VRAM Fit · Temporal-Chunk Video Decode]"), text
    assert "video stream of a nested latent (2 streams) (1, 4, 8, 8) has 4 channels" in text
    assert "but the VAE expects 16" in text


def test_video_gives_the_hosts_decode_of_a_vae_that_tiles_internally(comfy, video, wan_vae):
    _hosts_decode_of(comfy, video, internally_tiling(wan_vae), structured_latent((1, 16, 2, 8, 8), seed=3), "WanVAE")


def test_video_refuses_a_non_tensor_latent_without_touching_shape(video, wan_vae):
    with pytest.raises(ValueError, match=r"samples\['samples'\] must be a tensor, got list"):
        video.decode(wan_vae, {"samples": [torch.zeros(1, 16, 2, 8, 8)]})
