"""Offload Manager on the real in-process host (--cpu): real graphs through ComfyUI's PromptExecutor."""

from __future__ import annotations

import asyncio
import copy
import gc
import uuid

import pytest
import torch
from vramfit.memory.measure.tracker import PeakTracker
from vramfit.memory.report import Report, fmt_bytes

from scripts.host import prompt_executor

pytestmark = pytest.mark.host


def run_graph(executor, prompt: dict) -> tuple[str, dict, list]:
    """Validate and execute an API-format prompt as ComfyUI's prompt worker does; raise on failure."""
    import execution

    prompt_id = uuid.uuid4().hex
    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    assert valid, (error, node_errors)
    # ComfyUI parses a fresh prompt per request (and caches fingerprints inside it): do the same
    executor.execute(copy.deepcopy(prompt), prompt_id, {}, outputs)
    messages = executor.status_messages
    assert executor.success, [m for m in messages if m[0] == "execution_error"]
    return prompt_id, executor.history_result, messages


@pytest.fixture(scope="module")
def executor(comfy):
    import comfy.model_management as mm

    before = {id(lm.model) for lm in mm.current_loaded_models}
    # one executor for the module: the VAE loaders stay cached (as in a real session); each test
    # changes the latent sizes so that its decodes run and load their VAE again
    ex = prompt_executor()
    yield ex
    ex.reset()  # drop the executor's cached outputs (our models)
    others = [lm for lm in mm.current_loaded_models if id(lm.model) in before]
    mm.free_memory(1e30, torch.device("cpu"), keep_loaded=others)
    gc.collect()
    mm.cleanup_models()


def live_models() -> list:
    """The patchers ComfyUI holds loaded. ``mm.loaded_models()`` also returns None for dead entries: a patcher
    collected while its model is still referenced elsewhere (earlier tests can leave such leaks) stays in
    ``current_loaded_models`` forever, and the Offload Manager skips it, as ComfyUI's ``free_memory`` does."""
    import comfy.model_management as mm

    return [lm.model for lm in mm.current_loaded_models if lm.model is not None]


def live_names() -> list[str]:
    return [type(p.model).__name__ for p in live_models()]


def offload_cls(comfy):
    return comfy.NODE_CLASS_MAPPINGS["VRAMFit_OffloadManager"]


def two_vae_graph(fixture_vaes, size: int, unload="all except kept", method="offload", keep_kl=True) -> dict:
    """KL and Wan 2.1 VAEs both decode (both get loaded), then the Offload Manager keeps the KL VAE.

    ``size`` (pixels, a multiple of 8): a size no other test uses makes the decodes run again.
    """
    g = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["kl_f8"]}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["wan21"]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": 16, "batch_size": 1}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": size, "height": 16, "length": 1, "batch_size": 1}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 0]}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["2", 0]}},
        "7": {"class_type": "ImageBatch", "inputs": {"image1": ["5", 0], "image2": ["6", 0]}},
        "8": {
            "class_type": "VRAMFit_OffloadManager",
            "inputs": {"value": ["7", 0], "unload": unload, "method": method, "empty_cache": True},
        },
        "9": {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}},
    }  # fmt: skip
    if keep_kl:
        g["8"]["inputs"]["keep"] = ["1", 0]
    return g


def _report(history: dict, node: str = "8") -> Report:
    return Report.parse(history["outputs"][node]["text"][0])


def _bytes(row: str) -> int:
    """The first exact byte count ``(<n> B`` of a report row."""
    return int(row.split("(", 1)[1].split(" B", 1)[0])


def _released(rows: dict, name: str) -> int:
    """Bytes the report says model ``name`` released (its line of the ``unloaded`` row)."""
    line = next(x for x in rows["unloaded"].splitlines() if x.startswith(name + ":"))
    return int(line.rsplit("(", 1)[1].split(" B released", 1)[0])


def test_graph_unloads_the_second_model_and_frees_what_the_tracker_measured(
    executor, fixture_vaes, comfy
) -> None:
    import comfy.model_management as mm

    # the tracker's count of one Wan 2.1 VAE as ComfyUI's VAELoader builds it (same file, same dtype)
    with PeakTracker("cpu") as t:
        wan = comfy.VAELoader().load_vae(fixture_vaes["wan21"])[0]
    tracked = t.end_bytes
    del wan
    gc.collect()
    assert tracked > 400 * 2**20

    # models other tests left loaded (e.g. the session's KL VAE) would be unloaded too and blur the rows
    mm.unload_all_models()
    gc.collect()
    mm.cleanup_models()
    before_graph = live_names()
    prompt_id, hist, messages = run_graph(executor, two_vae_graph(fixture_vaes, 16))
    report = _report(hist)
    rows = dict(report.rows)
    assert report.node == "Offload Manager" and report.device == "cpu"
    assert rows["prompt"].startswith(prompt_id)
    assert rows["before"].startswith(f"{len(before_graph) + 2} models loaded")  # the graph loaded both VAEs
    assert rows["before"].count("WanVAE") == before_graph.count("WanVAE") + 1, rows["before"]
    assert [x.split(":")[0] for x in rows["unloaded"].splitlines()].count("WanVAE") == 1, rows["unloaded"]
    assert "AutoencoderKL" not in rows["unloaded"]
    assert rows["keep"].startswith("AutoencoderKL")
    freed = _released(rows, "WanVAE")
    assert freed > 0 and _bytes(rows["freed"]) >= freed
    assert abs(freed - tracked) <= 0.10 * tracked, (freed, tracked)
    # the loaded-model list shrank: the Wan VAE left, the kept KL VAE stayed fully loaded
    names = live_names()
    assert "WanVAE" not in names and "AutoencoderKL" in names
    assert len(names) == int(rows["before"].split()[0]) - 1
    assert "load and offload device are both cpu" in rows["device"]
    # the verdict: freed, unloaded, kept, time
    n = int(rows["before"].split()[0])
    freed_all = fmt_bytes(_bytes(rows["freed"]))
    assert report.summary == (
        f"freed {freed_all} · unloaded 1 of {n} models · kept AutoencoderKL · {rows['time']}"
    ), report.summary


@pytest.mark.slow
def test_running_the_prompt_twice_runs_the_node_twice(executor, fixture_vaes) -> None:
    graph = two_vae_graph(fixture_vaes, 24)
    first_id, first, _ = run_graph(executor, graph)
    second_id, second, messages = run_graph(executor, graph)
    cached = next(m[1]["nodes"] for m in messages if m[0] == "execution_cached")
    assert "1" in cached and "6" in cached  # loaders and decodes come from ComfyUI's cache
    assert "8" not in cached  # the Offload Manager does not
    r1, r2 = dict(_report(first).rows), dict(_report(second).rows)
    assert r1["prompt"].startswith(first_id) and r2["prompt"].startswith(second_id)
    run1 = int(r1["prompt"].split("run #")[1].split()[0])
    run2 = int(r2["prompt"].split("run #")[1].split()[0])
    assert run2 == run1 + 1
    assert "WanVAE" in r1["unloaded"]
    assert r2["unloaded"] == "nothing"  # cached decodes loaded nothing; the first run unloaded the Wan VAE


def test_nothing_then_everything(executor, fixture_vaes) -> None:
    _, hist, _ = run_graph(executor, two_vae_graph(fixture_vaes, 32, unload="nothing"))
    rows = dict(_report(hist).rows)
    assert rows["unloaded"] == "nothing" and _bytes(rows["freed"]) == 0
    names = live_names()
    assert "WanVAE" in names and "AutoencoderKL" in names

    # same decodes (cached, both VAEs still loaded); only the Offload Manager's option changes
    _, hist, messages = run_graph(executor, two_vae_graph(fixture_vaes, 32, unload="everything"))
    assert "6" in next(m[1]["nodes"] for m in messages if m[0] == "execution_cached")
    rows = dict(_report(hist).rows)
    assert "WanVAE" in rows["unloaded"] and "AutoencoderKL" in rows["unloaded"]  # the kept input is ignored
    names = live_names()
    assert "WanVAE" not in names and "AutoencoderKL" not in names
    assert rows["after"].startswith(f"{len(names)} model")


def test_drop_without_a_server_and_downstream_hints(executor, fixture_vaes) -> None:
    # sampler-like layout: latent -> Offload Manager -> decode with the KL VAE, not wired into keep
    graph = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["kl_f8"]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
        "8": {
            "class_type": "VRAMFit_OffloadManager",
            "inputs": {
                "value": ["3", 0],
                "unload": "all except kept",
                "method": "drop",
                "empty_cache": False,
            },
        },
        "10": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 0]}},
        "11": {"class_type": "PreviewImage", "inputs": {"images": ["10", 0]}},
    }
    _, hist, _ = run_graph(executor, graph)
    rows = dict(_report(hist).rows)
    assert rows["drop"].startswith("not available (no ComfyUI server in this process)")
    assert rows["request"] == "unload all except kept · method drop · empty cache off"
    assert rows["downstream"].startswith(
        "node 10 (VAEDecode).vae uses the VAE of node 1: not wired into value/keep"
    )
    assert "11" not in rows["downstream"]  # PreviewImage takes no model

    graph["8"]["inputs"]["keep"] = ["1", 0]  # wired: no hint any more
    _, hist, _ = run_graph(executor, graph)
    assert "downstream" not in dict(_report(hist).rows)


def test_one_missing_keep_is_one_downstream_line(executor, fixture_vaes) -> None:
    """Two decodes (and a second Offload Manager's keep) read the VAE that is not wired into keep: the
    report names that one problem once, with every input that uses the VAE (it listed it once per input)."""
    graph = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["kl_f8"]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 24, "height": 16, "batch_size": 1}},
        "8": {"class_type": "VRAMFit_OffloadManager",
              "inputs": {"value": ["3", 0], "unload": "all except kept", "method": "offload",
                         "empty_cache": False}},
        "9": {"class_type": "VRAMFit_OffloadManager",
              "inputs": {"value": ["8", 0], "unload": "nothing", "method": "offload", "empty_cache": False,
                         "keep": ["1", 0]}},
        "10": {"class_type": "VAEDecode", "inputs": {"samples": ["9", 0], "vae": ["1", 0]}},
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 0]}},
        "11": {"class_type": "PreviewImage", "inputs": {"images": ["10", 0]}},
        "13": {"class_type": "PreviewImage", "inputs": {"images": ["12", 0]}},
    }  # fmt: skip
    _, hist, _ = run_graph(executor, graph)
    report = _report(hist)
    lines = dict(report.rows)["downstream"].splitlines()
    assert lines == [
        "node 9 (VRAMFit_OffloadManager).keep, node 10 (VAEDecode).vae, node 12 (VAEDecode).vae use the "
        "VAE of node 1: not wired into value/keep - unloaded now, reloaded by the first that runs"
    ], lines
    assert report.text().count("the VAE of node 1") == 1


def test_gguf_style_patcher_subclass_is_unloaded(comfy) -> None:
    """A ModelPatcher subclass with tensor-subclass weights (as ComfyUI-GGUF's) goes through the node."""
    from comfy import model_management as mm
    from comfy import model_patcher, ops

    class QuantTensor(torch.Tensor):  # stands in for GGUF's GGMLTensor
        tensor_type = "Q8_0"

    class GGUFLikePatcher(model_patcher.ModelPatcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.unpatch_calls = 0

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            self.unpatch_calls += 1
            return super().unpatch_model(device_to, unpatch_weights)

    with PeakTracker("cpu") as t:
        net = torch.nn.Sequential(*[ops.disable_weight_init.Linear(512, 512) for _ in range(4)])
        for layer in net:
            w = torch.randn(512, 512).as_subclass(QuantTensor)
            layer.weight = torch.nn.Parameter(w, requires_grad=False)
            layer.bias = torch.nn.Parameter(torch.zeros(512), requires_grad=False)
    assert all(isinstance(layer.weight, QuantTensor) for layer in net)
    cpu = torch.device("cpu")
    patcher = GGUFLikePatcher(net, load_device=cpu, offload_device=cpu)
    keep_patcher = GGUFLikePatcher(torch.nn.Linear(8, 8), load_device=cpu, offload_device=cpu)
    mm.load_models_gpu([patcher, keep_patcher])
    assert any(p is patcher for p in live_models()) and patcher.loaded_size() > 0
    calls_after_load = (patcher.unpatch_calls, keep_patcher.unpatch_calls)

    from comfy_execution.utils import CurrentNodeContext

    cls = offload_cls(comfy)
    value = {"model": keep_patcher}  # a value holding a model: that model is kept
    with CurrentNodeContext("gguf-test", "42"):
        out = cls.execute(value=value, unload="all except kept", method="offload", empty_cache=True)
    rows = dict(Report.parse(out.result[1]).rows)
    assert out.result[0] is value  # pass-through, unchanged
    assert not any(p is patcher for p in live_models())
    assert any(p is keep_patcher for p in live_models())
    assert patcher.loaded_size() == 0 and patcher.unpatch_calls > calls_after_load[0]  # its own unpatch ran
    assert keep_patcher.unpatch_calls == calls_after_load[1] and keep_patcher.loaded_size() > 0
    assert "Sequential" in rows["unloaded"] and rows["keep"].startswith("Linear")
    assert " · kept Linear · " in Report.parse(out.result[1]).summary
    freed = _released(rows, "Sequential")
    assert freed > 0 and abs(freed - t.end_bytes) <= 0.10 * t.end_bytes, (freed, t.end_bytes)
    assert out.ui.as_dict()["text"][0] == out.result[1]
    mm.free_memory(
        1e30, cpu, keep_loaded=[lm for lm in mm.current_loaded_models if lm.model is not keep_patcher]
    )
    del patcher, keep_patcher, net
    gc.collect()


def test_schema_contract(comfy) -> None:
    cls = offload_cls(comfy)
    schema = cls.GET_SCHEMA()
    assert schema.display_name == "Offload Manager (VRAM Fit)" and schema.description
    assert schema.not_idempotent and schema.is_output_node
    assert all(i.tooltip for i in schema.inputs) and all(o.tooltip for o in schema.outputs)
    a, b = cls.fingerprint_inputs(), cls.fingerprint_inputs()
    assert a != a and a != b  # NaN: never equal, so ComfyUI never reuses a cached run
    assert cls.validate_inputs(unload="all except kept", method="drop") is True
    msg = cls.validate_inputs(unload="some", method="offload")
    assert "Offload Manager" in msg and "'some'" in msg
