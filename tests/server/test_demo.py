"""README command (i), ``scripts/demo.py``: the three-way decode comparison on a small latent, over the API."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from scripts import demo

pytestmark = pytest.mark.server


def test_demo_compares_the_three_decoders(server, fixture_vaes, tmp_path) -> None:
    settings = demo.Settings(latent_hw=(8, 16), budget_mb=32, core_tile=64, core_overlap=16)
    report = demo.compare(
        server.url, server.input_dir, server.output_dir, tmp_path, fixture_vaes["kl_f8"], settings
    )
    assert json.loads((tmp_path / "vram_report.json").read_text())["decoders"] == json.loads(
        json.dumps(report["decoders"])
    )
    untiled, core, vramfit = report["decoders"]
    assert [r["decoder"] for r in report["decoders"]] == [d.title for d in demo.DECODERS]
    assert demo.tiled(report), report["tiled_vae_decode_report"]
    for row in report["decoders"]:
        assert row["seconds"] is not None and row["seconds"] > 0
        assert row["peak_rss_bytes"] and row["peak_over_start_bytes"] is not None
    assert math.isinf(untiled["psnr_db_vs_untiled"]) and untiled["max_abs_diff_8bit"] == 0
    # exact tiles: the untiled image up to float rounding; core's tiles: visibly different
    assert vramfit["psnr_db_vs_untiled"] > 50 and vramfit["max_abs_diff_8bit"] <= 2
    assert core["psnr_db_vs_untiled"] < 40 < vramfit["psnr_db_vs_untiled"]
    with Image.open(report["compare_image"]) as im:
        assert im.width > 3 * 8 * 16 and im.height > 2 * 8 * 8
    with Image.open(report["vram_plot"]) as im:
        assert im.size == (960, 400)
    table = demo.format_table(report["decoders"])
    assert len(table.splitlines()) == 4 and "reference" in table
    assert f"{core['psnr_db_vs_untiled']:.1f} dB" in table


def test_timeline_seconds_reads_the_monitor_table() -> None:
    text = (
        "VRAM Fit | VRAM Monitor | cpu\n"
        "  prompt   : x (2 samples)\n"
        "  timeline :  #  label                     t   allocated\n"
        "               1  pre core tiled        +0.00 s   1.0 MiB\n"
        "               2  core tiled           +12.34 s   1.0 MiB\n"
        "  cost     : 1 ms to sample"
    )
    assert demo.timeline_seconds(text) == {"pre core tiled": 0.0, "core tiled": 12.34}
