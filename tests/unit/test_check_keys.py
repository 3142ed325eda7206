"""The image and encode self-checks' store keys come from one builder (``decode/self_check.check_key``) and stay
byte-identical to the keys earlier versions wrote (users' stored verdicts are found again, not re-checked): each
check's key, captured where it reaches the store, equals the formula it had before the builder (written out here)."""

from __future__ import annotations

import pytest
import torch
from vramfit.memory.cost import exact as dp
from vramfit.memory.decode import floor as fl
from vramfit.memory.decode import image as idm
from vramfit.memory.decode.self_check import check_key, code_fingerprint

from tests.unit.test_image_decode import TinyVAE
from tests.unit.test_tiled_exact import _latent, _model

pytestmark = pytest.mark.usefixtures("one_thread")


class _Found(Exception):
    """Raised by the captured store call: the key is all this test needs."""


@pytest.fixture(scope="module")
def job():
    vae = TinyVAE(_model(ch_mult=(1, 1)), ratio=2)
    return idm.make_job(vae, _latent((1, 4, 6, 6), seed=0), core=True, out_device="cpu")


def _key_of(monkeypatch, module, name: str, call) -> str:
    """The key ``call()`` passes to ``module.name`` (the store's entry)."""
    def capture(key, *a, **kw):
        raise _Found(key)

    monkeypatch.setattr(module, name, capture)
    with pytest.raises(_Found) as e:
        call()
    return str(e.value)


def _head(model) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}/{code_fingerprint(model)}"


def test_the_builder_writes_kind_class_fingerprint_parts_dtype_device():
    m = torch.nn.Conv2d(1, 1, 1)
    cpu = torch.device("cpu")
    assert check_key("k", m, "a", 3, dtype=torch.bfloat16, device=cpu) == f"k/{_head(m)}/a/3/bfloat16/cpu"
    assert check_key("k", m, dtype=torch.float32, device=cpu, fingerprint="fp", suffix="/x") == \
        "k/torch.nn.modules.conv.Conv2d/fp/float32/cpu/x"


def test_the_image_checks_keep_their_keys(job, monkeypatch):
    model, tail = job.vae.first_stage_model, "float32/cpu"
    store = object()
    exact = _key_of(monkeypatch, idm, "checked", lambda: idm.check_exact(job, store))
    assert exact == f"kl-exact/{_head(model)}/exact-{dp.executor_digest()}/{tail}"
    batch = _key_of(monkeypatch, idm, "check_batch", lambda: idm.check_batch_items(job, store))
    assert batch == f"batch/{_head(model)}/{tail}"
    generic = _key_of(monkeypatch, fl, "checked", lambda: fl.check_generic(job, store, (3, 4), 2, 1))
    assert generic == f"generic-fidelity/{_head(model)}/core/t3x4/h2/f1/{tail}"
    split = _key_of(monkeypatch, fl, "checked", lambda: fl.check_batch_split(job, store, (2, 3)))
    assert split == f"batch-fidelity/{_head(model)}/core/2x3/{tail}"
