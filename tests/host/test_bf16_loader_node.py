"""bf16 Loader on the real in-process host (--cpu): fixture VAE, a random-weight Wan 2.1 DiT, a checkpoint, bad files."""

from __future__ import annotations

import gc
import os
import pathlib

import pytest
import torch
from vramfit.memory.measure.monitor import module_weight_bytes
from vramfit.memory.report import Report

pytestmark = pytest.mark.host

DIT_FILE = "vramfit_fixture_wan21_dit_tiny.safetensors"
CKPT_FILE = "vramfit_fixture_ckpt_wan21_tiny.safetensors"


@pytest.fixture(autouse=True)
def _unload_what_the_test_loaded(comfy):
    import comfy.model_management as mm

    before = {id(lm.model) for lm in mm.current_loaded_models}
    yield
    keep = [lm for lm in mm.current_loaded_models if id(lm.model) in before]
    mm.free_memory(1e30, torch.device("cpu"), keep_loaded=keep)
    gc.collect()
    mm.cleanup_models()


def loader(comfy):
    return comfy.NODE_CLASS_MAPPINGS["VRAMFit_Bf16Loader"]


def build_tiny_wan21_dit(seed: int = 0) -> dict[str, torch.Tensor]:
    """State dict of a real ComfyUI Wan 2.1 text-to-video DiT, shrunk (dim 128, 2 blocks), random fp32.

    ComfyUI detects the architecture from the keys (``head.modulation`` -> Wan 2.1, no image
    embedding -> t2v) and reads dim, ffn_dim and the block count from the shapes, so the file loads
    as a ``WAN21`` model through ``comfy.sd.load_diffusion_model`` like a real release.
    """
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    with torch.device("meta"):
        model = WanModel(
            model_type="t2v", dim=128, ffn_dim=256, num_heads=1, num_layers=2, in_dim=16, out_dim=16,
            text_len=16, operations=comfy.ops.disable_weight_init,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, value in model.state_dict().items():
        scale = 1.0 if key.endswith(("norm.weight", "norm_q.weight", "norm_k.weight")) else 0.05
        base = torch.ones(value.shape) if scale == 1.0 else torch.randn(value.shape, generator=gen) * scale
        sd[key] = base.contiguous()
    return sd


@pytest.fixture(scope="module")
def tiny_dit(comfy) -> str:
    """``diffusion_models/<file>`` of the tiny Wan 2.1 DiT, written into the host's diffusion-model folder."""
    import folder_paths
    import safetensors.torch

    folder = pathlib.Path(folder_paths.get_folder_paths("diffusion_models")[0])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / DIT_FILE
    tmp = folder / f".{DIT_FILE}.{os.getpid()}.tmp"
    safetensors.torch.save_file(build_tiny_wan21_dit(), str(tmp))
    os.replace(tmp, path)
    return f"diffusion_models/{DIT_FILE}"


def _blocked(value) -> str | None:
    return value.message if type(value).__name__ == "ExecutionBlocker" else None


def _rows(out) -> dict[str, str]:
    report = Report.parse(out.result[3])
    assert report.node == "bf16 Loader"
    assert out.ui.as_dict()["text"][0] == out.result[3]
    rows = dict(report.rows)
    # the verdict: dtype, bytes loaded against the file, what was loaded, how it computes
    first = rows["after"].split(" (", 1)[0]
    assert report.summary.startswith(f"{rows['dtype'].split()[0]} · {first} loaded, "), report.summary
    s = report.summary
    assert s.endswith("computed as stored") or " · cast per layer to " in s, s
    return rows


def _exact(row: str) -> int:
    return int(row.split("(", 1)[1].split(" B", 1)[0])


def test_vae_loads_with_bf16_weights_half_the_fp32_bytes_and_decodes(comfy, fixture_vaes) -> None:
    from scripts.fixtures.latents import structured_latent

    name = f"vae/{fixture_vaes['kl_f8']}"
    out = loader(comfy).execute(model=name, weight_dtype="bf16")
    model, clip, vae = out.result[:3]
    rows = _rows(out)
    params = list(vae.first_stage_model.parameters())
    n = sum(p.numel() for p in params)
    assert {p.dtype for p in params} == {torch.bfloat16}
    loaded = module_weight_bytes(vae.first_stage_model)
    assert loaded == 2 * n == (4 * n) // 2  # half the fp32 bytes, exactly
    assert _exact(rows["VAE"]) == loaded and _exact(rows["after"]) == loaded
    assert _exact(rows["before"]) == os.path.getsize(vae_path(fixture_vaes["kl_f8"])) - _header_len(
        fixture_vaes["kl_f8"]
    )
    assert f"{n} floating-point values" in rows["before"]
    # ComfyUI does not compute bf16 on a CPU: the clear fallback message, and the decode dtype
    assert "cpu cannot compute bfloat16" in rows["compute"] and rows["compute"].startswith("float32")
    assert vae.vae_dtype == torch.float32
    assert "has no MODEL output" in _blocked(model) and "has no CLIP output" in _blocked(clip)

    # decode through ComfyUI's own VAEDecode node: close to the same VAE loaded by ComfyUI (fp32)
    latent = {"samples": structured_latent((1, 4, 4, 4), seed=3)}
    image = comfy.VAEDecode().decode(vae, latent)[0]
    reference = comfy.VAEDecode().decode(comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0], latent)[0]
    assert image.shape == reference.shape == (1, 32, 32, 3) and torch.isfinite(image).all()
    mse = float(((image - reference) ** 2).mean().detach())
    psnr = 10 * torch.log10(torch.tensor(1.0 / max(mse, 1e-12)))
    assert psnr > 40, f"bf16-stored VAE decode PSNR {float(psnr):.1f} dB vs fp32"
    del vae, out
    gc.collect()


def vae_path(filename: str) -> str:
    import folder_paths

    return folder_paths.get_full_path("vae", filename)


def _header_len(filename: str) -> int:
    with open(vae_path(filename), "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _forward(patcher) -> torch.Tensor:
    import comfy.model_management as mm

    mm.load_models_gpu([patcher])
    x = torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    context = torch.randn(1, 16, 4096, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.tensor([0.5]), c_crossattn=context).float()


def test_diffusion_model_loads_detected_in_bf16_and_fp8(comfy, tiny_dit) -> None:
    cls = loader(comfy)
    reference = cls.execute(model=tiny_dit, weight_dtype="fp32")
    ref_model = reference.result[0]
    assert type(ref_model.model).__name__ == "WAN21"  # detected from the keys by ComfyUI
    fp32_bytes = module_weight_bytes(ref_model.model)
    ref_out = _forward(ref_model)

    out = cls.execute(model=tiny_dit, weight_dtype="bf16")
    patcher = out.result[0]
    rows = _rows(out)
    assert type(patcher.model).__name__ == "WAN21"
    counts: dict[torch.dtype, int] = {}
    for p in patcher.model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    total = sum(counts.values())
    # ComfyUI keeps a few tensors (the patch-embedding conv) in fp32: everything else is bf16
    assert set(counts) <= {torch.bfloat16, torch.float32} and counts[torch.bfloat16] >= 0.99 * total
    loaded = module_weight_bytes(patcher.model)
    tensors = list(patcher.model.parameters()) + list(patcher.model.buffers())
    assert loaded == sum(t.numel() * t.element_size() for t in tensors)
    assert abs(loaded - fp32_bytes / 2) <= 0.01 * fp32_bytes, (loaded, fp32_bytes)
    assert _exact(rows["after"]) == loaded
    assert "cannot compute bfloat16" in rows["compute"]  # CPU: bf16 storage, fp32 compute (manual cast)
    assert _blocked(out.result[2]) and _blocked(out.result[1])
    out_bf16 = _forward(patcher)
    rel = float((out_bf16 - ref_out).norm() / ref_out.norm())
    assert torch.isfinite(out_bf16).all() and rel < 0.005, rel  # measured 0.07 %

    fp8 = cls.execute(model=tiny_dit, weight_dtype="fp8_e4m3fn").result[0]
    dtypes = {p.dtype for p in fp8.model.parameters()}
    assert torch.float8_e4m3fn in dtypes
    assert module_weight_bytes(fp8.model) < 0.30 * fp32_bytes
    out_fp8 = _forward(fp8)
    rel8 = float((out_fp8 - ref_out).norm() / ref_out.norm())
    assert torch.isfinite(out_fp8).all() and rel8 < 0.05, rel8  # measured 1.1 %


def test_checkpoint_loads_model_and_vae_in_bf16(comfy, tiny_dit, fixture_vaes) -> None:
    import folder_paths
    import safetensors.torch

    dit = safetensors.torch.load_file(folder_paths.get_full_path("diffusion_models", DIT_FILE))
    vae_sd = safetensors.torch.load_file(vae_path(fixture_vaes["kl_f8"]))
    sd = {"model.diffusion_model." + k: v for k, v in dit.items()}
    sd.update({"vae." + k: v for k, v in vae_sd.items()})  # Wan 2.1 checkpoints keep their VAE under vae.
    folder = pathlib.Path(folder_paths.get_folder_paths("checkpoints")[0])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CKPT_FILE
    safetensors.torch.save_file(sd, str(path))
    del dit, vae_sd, sd
    try:
        out = loader(comfy).execute(model=f"checkpoints/{CKPT_FILE}", weight_dtype="bf16")
        model, clip, vae = out.result[:3]
        rows = _rows(out)
        assert type(model.model).__name__ == "WAN21"
        assert {p.dtype for p in vae.first_stage_model.parameters()} == {torch.bfloat16}
        assert sum(p.numel() for p in model.model.parameters() if p.dtype == torch.bfloat16) > 0
        assert "has no text encoder weights" in _blocked(clip)
        after = module_weight_bytes(model.model) + module_weight_bytes(vae.first_stage_model)
        assert _exact(rows["after"]) == after
        assert "MODEL (WAN21)" in rows and "VAE" in rows
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture
def bad_files(comfy, fixture_vaes):
    import folder_paths

    folder = pathlib.Path(folder_paths.get_folder_paths("vae")[0])
    good = pathlib.Path(vae_path(fixture_vaes["kl_f8"])).read_bytes()[:3_000_000]
    files = {
        "truncated": folder / "vramfit_fixture_truncated.safetensors",
        "garbage": folder / "vramfit_fixture_not_safetensors.safetensors",
        "pickle": folder / "vramfit_fixture_pickle.ckpt",
    }
    files["truncated"].write_bytes(good)
    files["garbage"].write_bytes(b"PK\x03\x04" + bytes(range(256)) * 16)  # a zip (torch.save) header
    files["pickle"].write_bytes(b"\x80\x02}q\x00.")
    yield {k: v.name for k, v in files.items()}
    for f in files.values():
        f.unlink(missing_ok=True)


def test_bad_files_and_names_give_clear_errors(comfy, bad_files) -> None:
    cls = loader(comfy)

    def error(model: str, weight_dtype: str = "bf16") -> str:
        with pytest.raises(ValueError) as e:
            cls.execute(model=model, weight_dtype=weight_dtype)
        text = str(e.value)
        assert text.startswith("[VRAM Fit · bf16 Loader]"), text
        return text

    truncated = error(f"vae/{bad_files['truncated']}")
    assert bad_files["truncated"] in truncated and "is truncated" in truncated and "3000000" in truncated
    garbage = error(f"vae/{bad_files['garbage']}")
    assert bad_files["garbage"] in garbage and "is not a safetensors file" in garbage
    pickle = error(f"vae/{bad_files['pickle']}")
    assert bad_files["pickle"] in pickle and "only safetensors" in pickle
    for name in ("vae/../../../etc/passwd.safetensors", "../vae/x.safetensors", "vae/sub/../x.safetensors"):
        assert "'..', '.' and absolute paths are not allowed" in error(name) and name in error(name)
    missing = error("vae/vramfit_no_such_file.safetensors")
    assert (
        "vramfit_no_such_file.safetensors" in missing and "not a file in ComfyUI's 'vae' folders" in missing
    )
    assert "folder 'loras'" in error("loras/x.safetensors")
    assert "weight_dtype must be one of" in error(f"vae/{bad_files['truncated']}", weight_dtype="int4")
    # the same messages reach ComfyUI's prompt validation
    msg = cls.validate_inputs(model="vae/../x.safetensors")
    assert isinstance(msg, str) and "bf16 Loader" in msg and "vae/../x.safetensors" in msg
    # the combo lists only safetensors files of the three folders
    options = cls.GET_SCHEMA().inputs[0].options
    assert f"vae/{bad_files['truncated']}" in options and f"vae/{bad_files['pickle']}" not in options
    assert all(o.split("/", 1)[0] in ("vae", "diffusion_models", "checkpoints") for o in options)


def test_schema_contract(comfy) -> None:
    schema = loader(comfy).GET_SCHEMA()
    assert schema.display_name == "bf16 Loader (VRAM Fit)" and schema.description
    assert all(i.tooltip for i in schema.inputs) and all(o.tooltip for o in schema.outputs)
    assert schema.inputs[1].default == "bf16"
    assert schema.inputs[1].options == ["bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2"]
