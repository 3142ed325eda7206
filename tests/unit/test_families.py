"""Cost-model keys of unknown VAEs: one class, two structures must not share a model."""

from __future__ import annotations

import types

import torch
from vramfit.memory.cost.calibration import subject, vae_key
from vramfit.memory.vae.families import identify, model_key_name, model_name


class _Decoder(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, width, 3, padding=1)
        self.out = torch.nn.Conv2d(width, 3, 3, padding=1)


def _vae(width: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(first_stage_model=_Decoder(width), device=torch.device("cpu"),
                                 vae_dtype=torch.float32, latent_channels=4, latent_dim=2)  # fmt: skip


def test_unknown_vae_key_separates_structures_of_one_class():
    a, b, a2 = _vae(8), _vae(16), _vae(8)
    assert identify(a) is None
    assert model_name(a) == model_name(b) == f"{_Decoder.__module__}.{_Decoder.__qualname__}"
    assert model_key_name(a) == model_key_name(a2)  # same structure, other weights: one model
    assert model_key_name(a) != model_key_name(b)
    assert model_key_name(a).startswith(model_name(a) + ".")
    assert vae_key(subject(a)) == vae_key(subject(a2))
    assert vae_key(subject(a)) != vae_key(subject(b))
