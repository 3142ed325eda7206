"""The example workflows, described once: node types, widget values by input name, and links.

``scripts/workflows.py`` builds each description (:mod:`scripts.workflow_desc`) into the UI workflow, the
API twin, the thumbnail and the README of ``workflows/``. Widgets not given here take the node's declared
default. Links are ``node.out(slot)``. Node ids follow the order of ``add`` (the API twin uses the same ids).

Each workflow's ``template`` is its card in the template browser (the UI file's name, which the frontend
shows as the title), numbered in the order of :func:`all_workflows`: the CPU variants first (they run on
any install), then the GPU workflows.
"""

from __future__ import annotations

from typing import Any

from scripts.workflow_desc import FileDecl, WorkflowDesc

WAN_REPO = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files"
FLUX_TE = "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main"
SANA = "ComfyUI_ExtraModels (Sana)"
INFINITEYOU = "ComfyUI_InfiniteYou"
FIXTURES_HOW = "random-weight fixture: `python -m scripts.fixtures` (or the tests) writes it"
DEMO_BUDGET_MB = 256
"""The demo template's decode budget: below what the untiled decode of its 320×256 image needs, so it tiles."""

WAN_NEGATIVE = (
    "blurry, low quality, static, overexposed, washed-out colors, jpeg artifacts, deformed, extra limbs, "
    "still frame, messy background, text, watermark"
)


def _offload(wf: WorkflowDesc, value: Any, keep: Any) -> Any:
    """Offload Manager after sampling: unload everything but ``keep`` (the VAE)."""
    return wf.add("VRAMFit_OffloadManager", value=value, keep=keep, unload="all except kept", method="offload",
                  empty_cache=True)  # fmt: skip


def _tiled_decode(wf: WorkflowDesc, samples: Any, vae: Any) -> Any:
    """Tiled VAE Decode with its defaults: auto tile, traced halo, free memory, unload others."""
    return wf.add("VRAMFit_TiledVAEDecode", samples=samples, vae=vae, tile_size=0, halo=-1, budget_mb=0,
                  unload_others=True, allow_approximate=False)  # fmt: skip


def _monitor(wf: WorkflowDesc, value: Any, label: str, plot: tuple[int, int] = (768, 384)) -> Any:
    return wf.add("VRAMFit_VRAMMonitor", value=value, label=label, plot_width=plot[0], plot_height=plot[1])


WAN21_FILES = (
    FileDecl("wan2.1_t2v_1.3B_fp16.safetensors", "diffusion_models", f"{WAN_REPO}/diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors"),
    FileDecl("umt5_xxl_fp8_e4m3fn_scaled.safetensors", "text_encoders", f"{WAN_REPO}/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors"),
    FileDecl("wan_2.1_vae.safetensors", "vae", f"{WAN_REPO}/vae/wan_2.1_vae.safetensors"),
)  # fmt: skip


def _wan21_models(wf: WorkflowDesc, prompt: str) -> tuple[Any, Any, Any, Any]:
    """Wan 2.1 T2V 1.3B, its text encoder and VAE loaded; ``(model, positive, negative, vae)`` nodes."""
    unet = wf.add("UNETLoader", unet_name="wan2.1_t2v_1.3B_fp16.safetensors", weight_dtype="default")
    clip = wf.add("CLIPLoader", clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan", device="default")
    vae = wf.add("VAELoader", vae_name="wan_2.1_vae.safetensors")
    model = wf.add("ModelSamplingSD3", model=unet.out(), shift=8.0)
    pos = wf.add("CLIPTextEncode", title="Positive prompt", clip=clip.out(), text=prompt)
    neg = wf.add("CLIPTextEncode", title="Negative prompt", clip=clip.out(), text=WAN_NEGATIVE)
    return model, pos, neg, vae


def _wan21_sample_and_save(wf: WorkflowDesc, models: tuple[Any, Any, Any, Any], latent: Any, denoise: float,
                           prefix: str) -> None:
    """KSampler → Offload Manager → Temporal-Chunk Video Decode → VRAM Monitor → MP4 (``models``: as
    :func:`_wan21_models` gives them)."""
    model, pos, neg, vae = models
    sampled = wf.add(
        "KSampler", model=model.out(), positive=pos.out(), negative=neg.out(), latent_image=latent.out(),
        seed=42, steps=30, cfg=6.0, sampler_name="uni_pc", scheduler="simple", denoise=denoise,
    )  # fmt: skip
    offload = _offload(wf, sampled.out(), keep=vae.out())
    frames = wf.add(
        "VRAMFit_TemporalChunkVideoDecode", samples=offload.out(), vae=vae.out(),
        frames_per_chunk=0, tile_size=0, budget_mb=0, unload_others=True, allow_approximate=False,
    )  # fmt: skip
    monitor = _monitor(wf, frames.out(), "after decode")
    video = wf.add("CreateVideo", images=monitor.out(), fps=16.0)
    wf.add("SaveVideo", video=video.out(), filename_prefix=prefix, format="auto", codec="auto")


def wan21_t2v(resolution: str) -> WorkflowDesc:
    width, height = {"480p": (832, 480), "720p": (1280, 720)}[resolution]
    wf = WorkflowDesc(
        name=f"vramfit_wan21_t2v_1_3b_{resolution}",
        template=f"VRAM Fit {7 if resolution == '480p' else 8} - Wan 2.1 T2V {resolution}",
        title=f"Wan 2.1 T2V 1.3B, {width}×{height}, 81 frames",
        summary=(
            f"Text to video with Wan 2.1 T2V 1.3B at {width}×{height}, 81 frames (5 s at 16 fps). After "
            "sampling, the Offload Manager unloads the diffusion model and the text encoder (keeping the VAE), "
            "the Temporal-Chunk Video Decode decodes a few latent frames at a time within the free memory, "
            "exactly (causal caches carried across chunks: no blinking at chunk borders), and the VRAM Monitor "
            "records the memory before the video is saved as MP4."
        ),
        files=list(WAN21_FILES),
    )
    model, pos, neg, vae = _wan21_models(
        wf, "A red fox trotting through fresh snow in a pine forest at sunrise, soft golden light, "
        "snowflakes drifting, cinematic tracking shot",
    )
    latent = wf.add("EmptyHunyuanLatentVideo", width=width, height=height, length=81, batch_size=1)
    _wan21_sample_and_save(wf, (model, pos, neg, vae), latent, 1.0, f"video/vramfit_wan21_{resolution}")
    return wf


def sana_2048_batch2() -> WorkflowDesc:
    wf = WorkflowDesc(
        name="vramfit_sana_1600m_2048_batch2",
        template="VRAM Fit 6 - Sana 2K, batch 2",
        title="Sana 1600M, 2048×2048, batch 2",
        summary=(
            "Sana 1600M 2K (BF16) through the ComfyUI_ExtraModels Sana nodes, two 2048×2048 images. The seed "
            "case of VRAM Fit: with the diffusion model and Gemma still resident, the DC-AE decode of the batch "
            "went from 12.9 GB to 22.9 GB. The Offload Manager unloads everything but the VAE after sampling, and "
            "the Tiled VAE Decode decodes within what is free, exactly: untiled when it fits, else in exact split "
            "tiles (DC-AE's linear-attention stages once on the whole latent at 1/8 resolution, its ResBlock "
            "stages in tiles with a halo of their reach; proven equal to the untiled decode by the first-use "
            "self-check, said in the report). "
            "Graph and sampler settings follow NVlabs/Sana's ComfyUI example Sana_FlowEuler_2K.json."
        ),
        packs=[SANA],
        files=[
            FileDecl("Sana_1600M_2Kpx_BF16.pth", "sana", None,
                     "downloaded by Sana Checkpoint Loader on first use (Hugging Face Efficient-Large-Model/Sana_1600M_2Kpx_BF16)"),
            FileDecl("gemma-2-2b-it", "text_encoders", None,
                     "downloaded by Gemma Loader on first use (Hugging Face Efficient-Large-Model/gemma-2-2b-it)"),
            FileDecl("dc-ae-f32c32-sana-1.0-diffusers", "vae", None,
                     "downloaded by ExtraVAELoader on first use (Hugging Face mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers)"),
        ],  # fmt: skip
    )
    model = wf.add(
        "SanaCheckpointLoader", ckpt_name="Efficient-Large-Model/Sana_1600M_2Kpx_BF16",
        model="SanaMS_1600M_P1_D20_2K", dtype="BF16",
    )  # fmt: skip
    gemma = wf.add("GemmaLoader", model_name="Efficient-Large-Model/gemma-2-2b-it", device="cuda", dtype="BF16")
    vae = wf.add(
        "ExtraVAELoader", vae_name="mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers",
        vae_type="dcae-f32c32-sana-1.0-diffusers", dtype="BF16",
    )  # fmt: skip
    res = wf.add("SanaResolutionSelect", model="2K", ratio="1.00")
    latent = wf.add("EmptySanaLatentImage", width=res.out(0), height=res.out(1), batch_size=2)
    pos = wf.add(
        "SanaTextEncode", GEMMA=gemma.out(),
        text="A lighthouse on a rocky coast at dusk, waves breaking, dramatic clouds, highly detailed",
    )  # fmt: skip
    neg = wf.add("GemmaTextEncode", GEMMA=gemma.out(), text="")
    sampled = wf.add(
        "KSampler", model=model.out(), positive=pos.out(), negative=neg.out(), latent_image=latent.out(),
        seed=1057228702589644, steps=28, cfg=2.0, sampler_name="euler", scheduler="normal", denoise=1.0,
    )  # fmt: skip
    offload = _offload(wf, sampled.out(), keep=vae.out())
    images = _tiled_decode(wf, offload.out(), vae.out())
    monitor = _monitor(wf, images.out(), "after decode")
    wf.add("SaveImage", images=monitor.out(), filename_prefix="vramfit_sana_2048")
    return wf


def infiniteyou_flux() -> WorkflowDesc:
    wf = WorkflowDesc(
        name="vramfit_infiniteyou_flux",
        template="VRAM Fit 5 - InfiniteYou FLUX",
        title="InfiniteYou (FLUX.1-dev), bf16 Loader + Offload + Tiled Decode",
        summary=(
            "Identity-preserving portrait with InfiniteYou-FLUX (sim_stage1, empty face-pose control image). "
            "The bf16 Loader loads FLUX.1-dev in bf16 (half of fp32, reported), the Offload Manager unloads the "
            "diffusion model, InfuseNet and the text encoders after sampling, and the Tiled VAE Decode decodes "
            "exactly (FLUX's VAE is a GroupNorm KL VAE) within the free memory. Put your ID photo (one clear "
            "face) into ComfyUI's input folder."
        ),
        packs=[INFINITEYOU],
        files=[
            FileDecl("flux1-dev.safetensors", "diffusion_models", "https://huggingface.co/black-forest-labs/FLUX.1-dev/resolve/main/flux1-dev.safetensors"),
            FileDecl("clip_l.safetensors", "text_encoders", f"{FLUX_TE}/clip_l.safetensors"),
            FileDecl("t5xxl_fp16.safetensors", "text_encoders", f"{FLUX_TE}/t5xxl_fp16.safetensors"),
            FileDecl("ae.safetensors", "vae", "https://huggingface.co/black-forest-labs/FLUX.1-schnell/resolve/main/ae.safetensors"),
            FileDecl("sim_stage1/image_proj_model.bin", "infinite_you", None,
                     "downloaded by ID Embedding Model Loader on first use (Hugging Face ByteDance/InfiniteYou, infu_flux_v1.0/)"),
            FileDecl("sim_stage1/infusenet_sim_bf16.safetensors", "infinite_you", None,
                     "downloaded by Load InfuseNet on first use (Hugging Face ByteDance/InfiniteYou, infu_flux_v1.0/)"),
            FileDecl("antelopev2/*.onnx", "insightface/models", None, "downloaded by ID Embedding Model Loader on first use"),
            FileDecl("id_photo.png", "input", None, "your ID photo (one clear face)"),
        ],  # fmt: skip
    )
    flux = wf.add("VRAMFit_Bf16Loader", model="diffusion_models/flux1-dev.safetensors", weight_dtype="bf16")
    clip = wf.add(
        "DualCLIPLoader", clip_name1="clip_l.safetensors", clip_name2="t5xxl_fp16.safetensors",
        type="flux", device="default",
    )  # fmt: skip
    vae = wf.add("VAELoader", vae_name="ae.safetensors")
    pos = wf.add(
        "CLIPTextEncode", title="Prompt", clip=clip.out(),
        text="A portrait of the person as an astronaut on the Moon, studio lighting, detailed, 85mm photo",
    )  # fmt: skip
    guided = wf.add("FluxGuidance", conditioning=pos.out(), guidance=3.5)
    neg = wf.add("CLIPTextEncode", title="Negative (unused at cfg 1)", clip=clip.out(), text="")
    photo = wf.add("LoadImage", title="ID photo", image="id_photo.png")
    id_models = wf.add(
        "IDEmbeddingModelLoader", image_proj_model_name="sim_stage1/image_proj_model.bin",
        image_proj_num_tokens=8, face_analysis_provider="CUDA", face_analysis_det_size="AUTO",
    )  # fmt: skip
    id_embedding = wf.add(
        "ExtractIDEmbedding", face_detector=id_models.out(0), arcface_model=id_models.out(1),
        image_proj_model=id_models.out(2), image=photo.out(0),
    )  # fmt: skip
    infusenet = wf.add("InfuseNetLoader", controlnet_name="sim_stage1/infusenet_sim_bf16.safetensors")
    pose = wf.add("EmptyImage", title="Empty face-pose control", width=864, height=1152, batch_size=1, color=0)
    applied = wf.add(
        "InfuseNetApply", positive=guided.out(), negative=neg.out(), id_embedding=id_embedding.out(),
        control_net=infusenet.out(), image=pose.out(), vae=vae.out(),
        strength=1.0, start_percent=0.0, end_percent=1.0,
    )  # fmt: skip
    latent = wf.add("EmptySD3LatentImage", width=864, height=1152, batch_size=1)
    sampled = wf.add(
        "KSampler", model=flux.out(0), positive=applied.out(0), negative=applied.out(1), latent_image=latent.out(),
        seed=42, steps=30, cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0,
    )  # fmt: skip
    offload = _offload(wf, sampled.out(), keep=vae.out())
    images = _tiled_decode(wf, offload.out(), vae.out())
    monitor = _monitor(wf, images.out(), "after decode")
    wf.add("SaveImage", images=monitor.out(), filename_prefix="vramfit_infiniteyou")
    return wf


def decode_8k() -> WorkflowDesc:
    wf = WorkflowDesc(
        name="vramfit_8k_decode_sdxl_vae",
        template="VRAM Fit 4 - 8K SDXL decode",
        title="8K decode (8192×8192) with the SDXL KL VAE",
        summary=(
            "An 8192×8192 decode: SDXL samples at 1024×1024, the latent is upscaled 8× (bislerp) to 1024×1024 "
            "latent pixels, and the Tiled VAE Decode decodes it in single-pass tiles sized to the free memory, "
            "exactly (the SDXL/PixArt-Σ VAE is a GroupNorm KL VAE: same image as VAE Decode, no seams). "
            "ComfyUI's own VAE Decode would need tens of GB here; its tiled decode decodes every pixel three "
            "times and shows seams."
        ),
        files=[
            FileDecl("sd_xl_base_1.0.safetensors", "checkpoints", "https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0/resolve/main/sd_xl_base_1.0.safetensors"),
            FileDecl("sdxl_vae.safetensors", "vae", "https://huggingface.co/stabilityai/sdxl-vae/resolve/main/sdxl_vae.safetensors"),
        ],  # fmt: skip
        notes="Any KL-f8 latent of that size decodes the same way, e.g. from `LoadLatent` of a saved latent.",
    )
    ckpt = wf.add("CheckpointLoaderSimple", ckpt_name="sd_xl_base_1.0.safetensors")
    vae = wf.add("VAELoader", vae_name="sdxl_vae.safetensors")
    pos = wf.add(
        "CLIPTextEncode", title="Positive prompt", clip=ckpt.out(1),
        text="A vast alpine valley with a glacier lake, tiny village, morning mist, ultra detailed landscape",
    )  # fmt: skip
    neg = wf.add("CLIPTextEncode", title="Negative prompt", clip=ckpt.out(1), text="blurry, low quality, watermark")
    latent = wf.add("EmptyLatentImage", width=1024, height=1024, batch_size=1)
    sampled = wf.add(
        "KSampler", model=ckpt.out(0), positive=pos.out(), negative=neg.out(), latent_image=latent.out(),
        seed=42, steps=25, cfg=7.0, sampler_name="dpmpp_2m", scheduler="karras", denoise=1.0,
    )  # fmt: skip
    big = wf.add("LatentUpscaleBy", samples=sampled.out(), upscale_method="bislerp", scale_by=8.0)
    offload = _offload(wf, big.out(), keep=vae.out())
    before = _monitor(wf, offload.out(), "before decode")
    images = _tiled_decode(wf, before.out(), vae.out())
    after = _monitor(wf, images.out(), "after decode")
    wf.add("SaveImage", images=after.out(), filename_prefix="vramfit_8k")
    return wf


def img2img_4k_sdxl() -> WorkflowDesc:
    wf = WorkflowDesc(
        name="vramfit_img2img_4k_sdxl",
        template="VRAM Fit 9 - SDXL 4K img2img",
        title="4K img2img / upscale (4096×4096) with SDXL, exact tiled encode and decode",
        summary=(
            "An image upscaled to 4096×4096 and refined by SDXL (denoise 0.35). The Tiled VAE Encode encodes it "
            "exactly within the free memory (the encoder's GroupNorm statistics shared across tiles, its mid "
            "block on the whole latent: the same latent as VAE Encode, where core's tiled encode normalises each "
            "tile alone and the sampler amplifies the difference); after sampling the Offload Manager unloads "
            "the UNet and the text encoders, and the Tiled VAE Decode decodes exactly. At 4096² ComfyUI's own "
            "VAE Encode needs ~55 GB by its own estimate (1767 bytes per pixel in bf16)."
        ),
        files=[
            FileDecl("sd_xl_base_1.0.safetensors", "checkpoints", "https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0/resolve/main/sd_xl_base_1.0.safetensors"),
            FileDecl("sdxl_vae.safetensors", "vae", "https://huggingface.co/stabilityai/sdxl-vae/resolve/main/sdxl_vae.safetensors"),
            FileDecl("example.png", "input", None, "ships with ComfyUI (every install has it); load your own photo instead"),
        ],  # fmt: skip
        notes="FLUX.1 / FLUX.2: the same graph with their VAE; both encode exactly through the same walker.",
    )
    ckpt = wf.add("CheckpointLoaderSimple", ckpt_name="sd_xl_base_1.0.safetensors")
    vae = wf.add("VAELoader", vae_name="sdxl_vae.safetensors")
    photo = wf.add("LoadImage", image="example.png")
    big = wf.add("ImageScale", image=photo.out(), upscale_method="lanczos", width=4096, height=4096, crop="center")
    latent = wf.add("VRAMFit_TiledVAEEncode", pixels=big.out(), vae=vae.out(), tile_size=0, budget_mb=0,
                    unload_others=True)
    pos = wf.add(
        "CLIPTextEncode", title="Positive prompt", clip=ckpt.out(1),
        text="a highly detailed photograph, sharp focus, fine texture, natural light",
    )  # fmt: skip
    neg = wf.add("CLIPTextEncode", title="Negative prompt", clip=ckpt.out(1), text="blurry, low quality, watermark")
    sampled = wf.add(
        "KSampler", model=ckpt.out(0), positive=pos.out(), negative=neg.out(), latent_image=latent.out(),
        seed=42, steps=20, cfg=6.0, sampler_name="dpmpp_2m", scheduler="karras", denoise=0.35,
    )  # fmt: skip
    offload = _offload(wf, sampled.out(), keep=vae.out())
    images = _tiled_decode(wf, offload.out(), vae.out())
    after = _monitor(wf, images.out(), "after decode")
    wf.add("SaveImage", images=after.out(), filename_prefix="vramfit_img2img_4k")
    return wf


def demo_cpu() -> WorkflowDesc:
    """The CPU demo: ComfyUI's own example image encoded in exact tiles, then decoded in tiles under a small
    budget."""
    wf = WorkflowDesc(
        name="vramfit_demo_cpu",
        template="VRAM Fit 1 - Tiled demo (CPU)",
        title=f"VRAM Fit demo (CPU): Tiled VAE Decode under a {DEMO_BUDGET_MB} MiB budget",
        summary=(
            "ComfyUI's example image (`input/example.png`, in every install) scaled to 320×256 and encoded by the "
            "random-weight SD/SDXL KL VAE through the Tiled VAE Encode in 128-px tiles (exact: the same latent as "
            "VAE Encode), then VRAM Monitor → Offload Manager → Tiled VAE Decode → VRAM Monitor, "
            f"the image and the memory timeline saved. The decode runs under a {DEMO_BUDGET_MB} MiB budget, less "
            "than the untiled decode needs, so its report shows the tiled plan on the exact path (the same image "
            "as VAE Decode, no seams). Beside it, VAE Encode for Inpaint (VRAM Fit) encodes the same image with "
            "its mask (Load Image's alpha; none here) as the core inpaint node does. Runs on CPU in seconds; "
            "random weights decode to noise-like images."
        ),
        cpu=True,
        files=[
            FileDecl("vramfit_fixture_kl_f8.safetensors", "vae", None, FIXTURES_HOW),
            FileDecl("example.png", "input", None, "ships with ComfyUI (every install has it)"),
        ],  # fmt: skip
    )
    vae = wf.add("VAELoader", vae_name="vramfit_fixture_kl_f8.safetensors")
    photo = wf.add("LoadImage", image="example.png")
    scaled = wf.add("ImageScale", image=photo.out(), upscale_method="area", width=320, height=256, crop="center")
    latent = wf.add("VRAMFit_TiledVAEEncode", pixels=scaled.out(), vae=vae.out(), tile_size=128, budget_mb=0,
                    unload_others=True)
    before = _monitor(wf, latent.out(), "before offload", plot=(512, 256))
    offload = _offload(wf, before.out(), keep=vae.out())
    images = wf.add(
        "VRAMFit_TiledVAEDecode", samples=offload.out(), vae=vae.out(),
        tile_size=0, halo=-1, budget_mb=DEMO_BUDGET_MB, unload_others=True, allow_approximate=False,
    )  # fmt: skip
    after = _monitor(wf, images.out(), "after decode", plot=(512, 256))
    wf.add("SaveImage", images=after.out(0), filename_prefix="vramfit_demo")
    wf.add("SaveImage", title="Save VRAM timeline", images=after.out(2), filename_prefix="vramfit_vram_timeline")
    inpaint = wf.add("VRAMFit_VAEEncodeForInpaint", pixels=scaled.out(), vae=vae.out(), mask=photo.out(1),
                     grow_mask_by=6, tile_size=128, budget_mb=0, unload_others=True)
    wf.add("VRAMFit_VRAMMonitor", value=inpaint.out(), label="inpaint latent", plot_width=512, plot_height=256)
    return wf


def image_cpu() -> WorkflowDesc:
    wf = WorkflowDesc(
        name="vramfit_image_cpu",
        template="VRAM Fit 2 - Image decode (CPU)",
        title="Image decode (CPU variant): bf16 Loader → Offload → Tiled VAE Decode",
        summary=(
            "The CPU variant of the image workflows (Sana, InfiniteYou, 8K): the random-weight SD/SDXL KL VAE "
            "loaded in bf16 by the bf16 Loader, a 128×128 batch of 2, Offload Manager, and a Tiled VAE Decode "
            "forced into 64-pixel tiles (exact path), with VRAM Monitors around the decode. No model downloads; "
            "runs in seconds."
        ),
        cpu=True,
        files=[FileDecl("vramfit_fixture_kl_f8.safetensors", "vae", None, FIXTURES_HOW)],
    )
    loader = wf.add("VRAMFit_Bf16Loader", model="vae/vramfit_fixture_kl_f8.safetensors", weight_dtype="bf16")
    latent = wf.add("EmptyLatentImage", width=128, height=128, batch_size=2)
    before = wf.add("VRAMFit_VRAMMonitor", value=latent.out(), label="before decode", plot_width=512, plot_height=256)
    offload = _offload(wf, before.out(), keep=loader.out(2))
    images = wf.add(
        "VRAMFit_TiledVAEDecode", samples=offload.out(), vae=loader.out(2),
        tile_size=64, halo=-1, budget_mb=0, unload_others=True, allow_approximate=False,
    )  # fmt: skip
    after = wf.add("VRAMFit_VRAMMonitor", value=images.out(), label="after decode", plot_width=512, plot_height=256)
    wf.add("SaveImage", images=after.out(0), filename_prefix="vramfit_image_cpu")
    wf.add("SaveImage", title="Save VRAM timeline", images=after.out(2), filename_prefix="vramfit_image_cpu_vram")
    return wf


def video_cpu() -> WorkflowDesc:
    wf = WorkflowDesc(
        name="vramfit_video_cpu",
        template="VRAM Fit 3 - Video decode (CPU)",
        title="Wan 2.1 video decode (CPU variant): Offload → Temporal-Chunk Decode → MP4, and the frames re-encoded",
        summary=(
            "The CPU variant of the Wan 2.1 workflows: the random-weight Wan 2.1 VAE, a 64×64 latent video of 9 "
            "frames, Offload Manager → Temporal-Chunk Video Decode (one latent frame per chunk, exact) → VRAM "
            "Monitor → MP4; the decoded frames also go back through Temporal-Chunk Video Encode in 32-px tiles "
            "(exact: the latent of VAE Encode), as the video-to-video template does. No model downloads; runs in "
            "seconds."
        ),
        cpu=True,
        files=[FileDecl("vramfit_fixture_wan21.safetensors", "vae", None, FIXTURES_HOW)],
    )
    vae = wf.add("VAELoader", vae_name="vramfit_fixture_wan21.safetensors")
    latent = wf.add("EmptyHunyuanLatentVideo", width=64, height=64, length=9, batch_size=1)
    offload = _offload(wf, latent.out(), keep=vae.out())
    frames = wf.add(
        "VRAMFit_TemporalChunkVideoDecode", samples=offload.out(), vae=vae.out(),
        frames_per_chunk=1, tile_size=0, budget_mb=0, unload_others=True, allow_approximate=False,
    )  # fmt: skip
    monitor = wf.add("VRAMFit_VRAMMonitor", value=frames.out(), label="after decode", plot_width=512, plot_height=256)
    video = wf.add("CreateVideo", images=monitor.out(), fps=16.0)
    wf.add("SaveVideo", video=video.out(), filename_prefix="video/vramfit_video_cpu", format="auto", codec="auto")
    again = wf.add("VRAMFit_TemporalChunkVideoEncode", pixels=frames.out(), vae=vae.out(), tile_size=32,
                   budget_mb=0, unload_others=True)
    wf.add("VRAMFit_VRAMMonitor", value=again.out(), label="after re-encode", plot_width=512, plot_height=256)
    return wf


def wan21_v2v() -> WorkflowDesc:
    wf = WorkflowDesc(
        name="vramfit_wan21_v2v_480p",
        template="VRAM Fit 10 - Wan 2.1 V2V 480p",
        title="Wan 2.1 T2V 1.3B video-to-video, 832×480, 81 frames",
        summary=(
            "A video in (Load Video from `input/`), its first 81 frames scaled to 832×480, encoded by the "
            "Temporal-Chunk Video Encode (exact: the latent of VAE Encode, in spatial tiles when the whole clip "
            "does not fit), re-sampled at denoise 0.6, then Offload Manager → Temporal-Chunk Video Decode → MP4. "
            "Put any video named `input_video.mp4` in ComfyUI's input folder."
        ),
        files=[*WAN21_FILES, FileDecl("input_video.mp4", "input", None, "your own video (at least 81 frames)")],
    )
    model, pos, neg, vae = _wan21_models(
        wf, "The same scene as a watercolour painting, soft washes of colour, paper texture"
    )
    source = wf.add("LoadVideo", file="input_video.mp4")
    parts = wf.add("GetVideoComponents", video=source.out())
    first = wf.add("ImageFromBatch", image=parts.out(0), batch_index=0, length=81)
    scaled = wf.add("ImageScale", image=first.out(), upscale_method="lanczos", width=832, height=480, crop="center")
    latent = wf.add("VRAMFit_TemporalChunkVideoEncode", pixels=scaled.out(), vae=vae.out(), tile_size=0,
                    budget_mb=0, unload_others=True)
    _wan21_sample_and_save(wf, (model, pos, neg, vae), latent, 0.6, "video/vramfit_wan21_v2v")
    return wf


def all_workflows() -> list[WorkflowDesc]:
    """Every example workflow, in the order of their template numbers."""
    return [
        demo_cpu(),
        image_cpu(),
        video_cpu(),
        decode_8k(),
        infiniteyou_flux(),
        sana_2048_batch2(),
        wan21_t2v("480p"),
        wan21_t2v("720p"),
        img2img_4k_sdxl(),
        wan21_v2v(),
    ]


CPU_WORKFLOWS = ("vramfit_demo_cpu", "vramfit_image_cpu", "vramfit_video_cpu")
"""Names (API twins ``workflows/api/<name>.json``) of the workflows that run on CPU with the fixture VAEs."""
CPU_TEMPLATES = tuple(d.template_name for d in all_workflows() if d.name in CPU_WORKFLOWS)
"""The same workflows' template names (UI files ``workflows/<template>.json``, the cards' titles)."""
