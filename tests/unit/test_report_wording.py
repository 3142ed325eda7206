"""Report wording without ComfyUI (issue 37, item 6; the nodes' reports: ``tests/host/test_report_wording.py``).

* ``predicted_text``: the tensor-level figure first when the planning figure adds overhead to it, the share of the
  budget computed from the planning figure, no budget figure of its own;
* a plan's description (``Tiling.describe``) names no budget and no peak (the report's budget and predicted rows
  do, once);
* ``Budget.describe``: a user budget is one figure, with what is taken off it said once; free memory ends in
  "available for <work>" (decoding or encoding);
* first-use work names what later runs skip ("decodes" or "encodes").
"""

from __future__ import annotations

from vramfit.memory.budget import MiB, compute_budget
from vramfit.memory.decode.first_use import FirstUse
from vramfit.memory.geometry import VaeGeometry
from vramfit.memory.plan.grid import plan_tiling
from vramfit.memory.report import Report, flag_measured_overrun, predicted_text


def test_predicted_text_leads_with_the_tensor_level_figure() -> None:
    two = predicted_text(2040 * MiB, 2048 * MiB, 1000 * MiB, where=", at mid", note="; x1.10: ...")
    assert two.startswith("peak 1,000.0 MiB tensor-level, at mid (compare with measured); planned as 2,040.0 MiB "), two
    assert two.endswith(": 100% of budget; x1.10: ..."), two
    assert "2,048" not in two  # the budget row names the budget
    one = predicted_text(400 * MiB, 2048 * MiB, 400 * MiB)
    assert one == "peak 400.0 MiB (20% of budget)"
    assert predicted_text(138 * MiB, 2048 * MiB, how="meta sizing", over=" - OVER") == \
        "peak 138.0 MiB (7% of budget, meta sizing) - OVER"


class _PerPixel:
    def predict(self, g) -> int:
        return 4096 * g.batch * g.latent_h * g.latent_w


def test_a_plans_description_names_no_budget() -> None:
    geo = VaeGeometry("kl", 8)
    for budget in (20 * MiB, 4 * MiB):  # untiled, then tiles
        p = plan_tiling((2, 4, 32, 40), geo, budget, _PerPixel())
        text = p.describe()
        assert "budget" not in text and "MiB" not in text and "predicted" not in text, text
    assert p.tiled and "halo overhead" in text


def test_budget_row_is_one_figure() -> None:
    user = compute_budget("cpu", lambda d: 40 * 2**30, user_budget_mb=2048)
    assert user.describe() == "cpu: user budget 2,048 MiB of working memory (VAE weights not counted)"
    assert user.describe("encoding") == user.describe()
    less = compute_budget("cpu", lambda d: 40 * 2**30, user_budget_mb=2048, reserve=5 * MiB)
    assert less.describe() == ("cpu: user budget 2,048 MiB of working memory (VAE weights not counted) "
                               "(2,043 MiB after reserve 5 MiB)")
    free = compute_budget("cuda", lambda d: 10 * 2**30, get_total_memory=lambda d: 24 * 2**30,
                          vae_weights_to_load=160 * MiB)
    assert free.describe().endswith(" = 8,851 MiB available for decoding"), free.describe()
    assert free.describe("encoding").endswith(" = 8,851 MiB available for encoding")


def test_over_budget_row_names_no_operation() -> None:
    r = Report("Tiled VAE Encode", "cpu").add("measured", "x")
    assert flag_measured_overrun(r, 600 * MiB, "live tensor bytes", 512 * MiB)
    row = dict(r.rows)["over budget"]
    assert row == "measured peak 600.0 MiB (live tensor bytes) > budget 512.0 MiB, by 88.0 MiB (+17%)", row


def test_first_use_names_what_later_runs_skip() -> None:
    for work in ("decode", "encode"):
        first = FirstUse(work=work)
        first.run("checking exactness", lambda: None)
        assert first.describe().endswith(f"later {work}s skip it"), first.describe()
    assert FirstUse().work == "decode"
