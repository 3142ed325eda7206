"""The split and carried-context executors on toy decoders with the described families' shapes (no ComfyUI).

* split (``vae/split_layout.py``, ``executors/split.py``): a DC-AE-shaped decoder whose deepest stages hold a
  global operation: the split falls after them, suffix tiles with a halo of the traced reach equal the whole
  decode, a halo below the reach does not, and an OOM inside a tile resumes to the same result.
* carry (``vae/carry_layout.py``, ``executors/carry.py``): a Mochi-shaped causal decoder (replicate-padded
  causal convs, a temporal depth-to-space that drops the clip's first frames): chunks of 1 + k latent frames
  equal the whole decode for every k, also after an OOM inside a chunk.
* draws (LTX-Video 0.9.1's block noise): a decoder whose blocks add a fresh ``randn(H, W)`` per call and which
  splits time by bytes, as 0.33's ``run_up`` does: tiles that replay the recorded whole-frame draws equal the whole
  decode from one random state, bit for bit, and leave the generator where the host leaves it; tiles drawing their
  own do not.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from vramfit.memory.executors.carry import decode_carried
from vramfit.memory.executors.split import decode_split
from vramfit.memory.measure.reach import traced_reach
from vramfit.memory.measure.sizing import MetaSizer
from vramfit.memory.vae.carry_layout import _ltx_draws, carry_layout
from vramfit.memory.vae.split_layout import is_global, split_layout


def _oom_at(step: int, fired: list[int]):
    """A fault hook that raises one out-of-memory error at ``step`` (recorded in ``fired``)."""

    def hook(k: int) -> None:
        if k == step and not fired:
            fired.append(k)
            raise torch.OutOfMemoryError("injected")

    return hook


# ------------------------------------------------------------------------------------------- split


class ToyAttention(torch.nn.Module):
    """Global: every pixel gets the mean over the whole map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean(dim=(2, 3), keepdim=True)


class RMSNorm(torch.nn.Module):
    """Per pixel over channels (applied channel-last, as diffusers' DC-AE does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class Up(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class Decoder(torch.nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, c, 3, padding=1)
        self.in_shortcut, self.in_shortcut_repeats = True, c // 4
        local = [torch.nn.Sequential(Up(c), torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.SiLU()) for _ in range(2)]
        deep = [torch.nn.Sequential(Up(c), ToyAttention(), torch.nn.Conv2d(c, c, 3, padding=1)),
                torch.nn.Sequential(ToyAttention(), torch.nn.Conv2d(c, c, 1))]
        self.up_blocks = torch.nn.ModuleList(local + deep)  # run from the last (deepest) to the first
        self.norm_out, self.conv_act = RMSNorm(), torch.nn.ReLU()
        self.conv_out = torch.nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(z) + z.repeat_interleave(self.in_shortcut_repeats, dim=1)
        for blk in reversed(self.up_blocks):
            x = blk(x)
        return self.conv_out(self.conv_act(self.norm_out(x.movedim(1, -1)).movedim(-1, 1)))


Decoder.__module__ = "toy.autoencoder_dc"  # the DC-AE description matches diffusers' module by name


class ToyDCAE(torch.nn.Module):
    use_tiling = False

    def __init__(self) -> None:
        super().__init__()
        self.decoder = Decoder()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


@pytest.fixture(scope="module")
def dcae() -> ToyDCAE:
    torch.manual_seed(0)
    return ToyDCAE().eval()


def test_split_falls_after_the_global_stages(dcae):
    lay = split_layout(dcae)
    assert lay.reason is None, lay.reason
    assert [s.name for s in lay.stages[: lay.split]] == ["conv_in", "up_blocks.3", "up_blocks.2"]


def test_split_tiles_with_the_reach_as_halo_are_exact_and_less_are_not(dcae):
    lay = split_layout(dcae)
    z = torch.randn(1, 4, 6, 8)
    with torch.no_grad():
        ref = dcae.decode(z)
        x = lay.prefix(z)
        reach = traced_reach(dcae, lambda: lay.suffix(x), tuple(x.shape[-2:])).total
    halo = math.ceil(reach)
    assert halo >= 2
    out = decode_split(lay, z, 5, halo)
    assert (out - ref).abs().max().item() <= 1e-5
    short = decode_split(lay, z, 5, halo - 2)
    assert (short - ref).abs().max().item() > 1e-3  # the test can fail: a short halo is visible


def test_split_resumes_after_oom_in_a_tile(dcae):
    lay = split_layout(dcae)
    z = torch.randn(1, 4, 6, 8)
    with torch.no_grad():
        ref = dcae.decode(z)
    fired: list[int] = []
    out = decode_split(lay, z, 8, 6, fault_hook=_oom_at(2, fired), min_tile=2)
    assert fired == [2]
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("module, expected", [
    (torch.nn.LayerNorm(8), False),  # over one axis: the channels, moved last (LTX-Video 0.9.0)
    (torch.nn.LayerNorm((8, 4, 4)), True),  # over channels and space
    (torch.nn.GroupNorm(2, 8), True),
    (torch.nn.InstanceNorm2d(8), True),
    (ToyAttention(), True),
    (torch.nn.Conv2d(8, 8, 3), False),
])
def test_is_global_knows_norms_over_space_from_norms_over_channels(module, expected):
    assert is_global(module) is expected


def test_a_decoder_without_a_description_has_no_split():
    assert split_layout(torch.nn.Conv2d(4, 3, 3)).reason is not None


# ------------------------------------------------------------------------------------------- carry


class PConv3d(torch.nn.Conv3d):
    """Causal in time (replicate front padding of ``kt - 1`` frames), as Mochi's."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(cin, cout, 3, padding=(0, 1, 1), padding_mode="replicate")
        self.causal = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, 0, self.kernel_size[0] - 1, 0), mode="replicate")
        return super().forward(x)


class DepthToSpaceTime(torch.nn.Module):
    def __init__(self, st: int, s: int) -> None:
        super().__init__()
        self.temporal_expansion, self.spatial_expansion = st, s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st, s = self.temporal_expansion, self.spatial_expansion
        b, c, t, h, w = x.shape
        y = x.reshape(b, c // (st * s * s), st, s, s, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
        y = y.reshape(b, c // (st * s * s), t * st, h * s, w * s)
        return y[:, :, st - 1 :]


class CausalDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(
            PConv3d(3, 8), torch.nn.SiLU(), PConv3d(8, 8 * 3 * 4), DepthToSpaceTime(3, 2), PConv3d(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


CausalDecoder.__module__ = "toy.genmo.vae.model"  # the Mochi description matches ComfyUI's module by name


class ToyMochi(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = CausalDecoder()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


@pytest.fixture(scope="module")
def mochi() -> ToyMochi:
    torch.manual_seed(1)
    return ToyMochi().eval()


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_carried_chunks_equal_the_whole_decode(mochi, k):
    lay = carry_layout(mochi)
    assert lay.reason is None and len(lay.forwards) == 4
    z = torch.randn(1, 3, 6, 3, 4)
    with torch.no_grad():
        ref = mochi.decode(z)
    out = torch.empty_like(ref)
    stats: dict = {}
    decode_carried(mochi, lay, z, k, out=out, dtype=torch.float32, compute_device="cpu", stats=stats)
    assert stats["chunks"] == 1 + math.ceil(5 / k)
    assert (out - ref).abs().max().item() <= 1e-5
    assert not any("forward" in vars(m) for m in mochi.modules())  # the modules' own forwards are back


def test_chunks_without_the_carried_context_differ(mochi):
    """What the executor adds: each chunk decoded on its own (restarting the causal padding) is not exact."""
    z = torch.randn(1, 3, 6, 3, 4)
    with torch.no_grad():
        ref = mochi.decode(z)
        parts = [mochi.decode(z[:, :, :1]), mochi.decode(z[:, :, 1:3])[:, :, 2:]]
    n = parts[0].shape[2] + parts[1].shape[2]
    assert (torch.cat(parts, dim=2) - ref[:, :, :n]).abs().max().item() > 1e-3


def test_carried_chunks_resume_after_oom(mochi):
    lay = carry_layout(mochi)
    z = torch.randn(1, 3, 7, 3, 4)
    with torch.no_grad():
        ref = mochi.decode(z)
    fired: list[int] = []
    out, stats = torch.empty_like(ref), {}
    decode_carried(mochi, lay, z, 4, out=out, dtype=torch.float32, compute_device="cpu",
                   fault_hook=_oom_at(2, fired), stats=stats)
    assert fired == [2] and stats["shrinks"] == 1 and stats["frames_per_chunk"] == 2
    assert (out - ref).abs().max().item() <= 1e-5


def test_carried_chunks_in_place_restart_the_tile_after_oom(mochi):
    """In place (``rollback`` False) no context is kept: an OOM in the third chunk decodes the clip again from its
    first chunk with half the ``k``; same frames, and progress goes back to where the tile started."""
    lay = carry_layout(mochi)
    z = torch.randn(1, 3, 7, 3, 4)
    with torch.no_grad():
        ref = mochi.decode(z)
    fired: list[int] = []
    seen: list[int] = []
    out, stats = torch.full_like(ref, float("nan")), {}
    decode_carried(mochi, lay, z, 4, out=out, dtype=torch.float32, compute_device="cpu", rollback=False,
                   fault_hook=_oom_at(2, fired), progress=lambda done, total: seen.append(done), stats=stats)
    assert fired == [2] and stats["shrinks"] == 1 and stats["frames_per_chunk"] == 2 and not stats["rollback"]
    # [0, 1), [1, 5) done; [5, 7) failed: again [0, 1), [1, 3), [3, 5), [5, 7)
    assert stats["chunks"] == 6 and seen == [1, 5, 1, 3, 5, 7], seen
    assert (out - ref).abs().max().item() <= 1e-5


# ------------------------------------------------------------------------------------ carry planner


def _linear_plan(ks, tiles, modes, peak, budget):
    """The search plan_carry replaces, as a reference: every candidate in preference order, the first that fits;
    else, flagged, the first within 1 / 0.95 of the last (the smallest)."""
    order = [(k, tile, rollback) for tile in tiles for k in (ks if tile is None else ks[-1:]) for rollback in modes]
    for limit, over in ((budget, False), (peak(*order[-1]) / 0.95, True)):
        for c in order:
            if peak(*c) <= limit:
                return c, over


@pytest.mark.parametrize("temporal, tiles_on, k_user, t, halo", [
    (True, True, 0, 31, 8), (True, False, 0, 13, 8), (False, True, 0, 16, 8), (True, True, 3, 9, 8),
    (True, True, 0, 2, 8), (True, True, 0, 31, 20)])
def test_carry_planner_bisects_to_the_linear_searchs_choice(monkeypatch, temporal, tiles_on, k_user, t, halo):
    """plan_carry's bisection picks what trying every candidate in order picks, for every budget, with peaks that
    grow with k, the tile and a kept context, in at most a handful of meta runs (a linear search sizes up to ~40);
    tiles narrower than the halo, or whose halo reaches across the frame (halo 20 on 34x60), are not candidates."""
    import types

    from vramfit.memory.plan import video as pv
    from vramfit.memory.vae.carry_layout import Description

    h, w = 34, 60
    desc = Description("toy", lambda m: None, min_k=2, temporal=temporal, tiles=tiles_on)
    job = types.SimpleNamespace(z=torch.empty(1, 4, t, h, w), family="toy", tile_size=0,
                                carry=types.SimpleNamespace(description=desc, family="toy"))

    def peak(k, tile, rollback):
        area = (h * w) if tile is None else min(h, tile[0] + 2 * halo) * min(w, tile[1] + 2 * halo)
        return 1000 + area * (k + (3 if rollback else 1)) + (k * 7 if rollback else 0)

    calls = []
    monkeypatch.setattr(pv, "carry_planned", lambda job, k, peaks, tile=None, rollback=True: calls.append(1) or
                        peak(k, tile, rollback))
    monkeypatch.setattr(pv, "_job_halo", lambda job: halo)
    monkeypatch.setattr(pv, "carry_floor", lambda job, peaks: 0)
    monkeypatch.setattr(pv, "output_geometry", lambda job: (0, 8))
    ks = ([t] if not temporal else [desc.fit(k_user)] if k_user else
          sorted({desc.fit(k) for k in range(2, min(t - 1, pv.CARRY_MAX_K) + 1)} or {2}, reverse=True))
    tiles = [None, *(tl for tl in pv._carry_tiles(h, w)
                     if max(tl) >= halo and (tl[0] + 2 * halo < h or tl[1] + 2 * halo < w))]
    tiles = tiles if tiles_on else [None]
    assert len(tiles) < len(pv._carry_tiles(h, w)) + 1 or halo == 8
    modes = (True, False) if temporal else (True,)
    budgets = sorted({peak(k, tile, m) + d for k in ks for tile in tiles for m in modes for d in (-1, 0)} | {0})
    worst = 0
    for budget in budgets:
        calls.clear()
        p = pv.plan_carry(job, budget, k_user, pv.PeakStore())
        want, over = _linear_plan(ks, tiles, modes, peak, budget)
        assert (p.config.k, p.config.tile, p.config.rollback) == want and p.over_budget == over, budget
        worst = max(worst, len(calls))
    assert worst <= 2 + 2 * (len(ks) * len(tiles)).bit_length() + 2, worst


def test_carry_planner_stops_at_the_prefix_floor(monkeypatch):
    """When nothing fits, the flagged plan is the fastest within 5 % of the least any plan holds: when the floor
    (the prefix plus the output) does not fit and whole frames come within 5 % of it, no tile is sized; tiles that
    save under 5 % are not taken; tiles that save more are."""
    import types

    from vramfit.memory.plan import video as pv
    from vramfit.memory.vae.carry_layout import Description

    desc = Description("toy", lambda m: None, min_k=2, tiles=True)
    job = types.SimpleNamespace(z=torch.empty(1, 4, 9, 34, 60), family="toy", tile_size=0,
                                carry=types.SimpleNamespace(description=desc, family="toy"))
    calls, tiled, floor = [], [990], [980]
    monkeypatch.setattr(pv, "carry_planned", lambda job, k, peaks, tile=None, rollback=True: calls.append(
        (k, tile, rollback)) or (1000 + k if tile is None else tiled[0]))
    monkeypatch.setattr(pv, "_job_halo", lambda job: 4)
    monkeypatch.setattr(pv, "output_geometry", lambda job: (0, 8))
    monkeypatch.setattr(pv, "carry_floor", lambda job, peaks: floor[0])
    p = pv.plan_carry(job, 900, 0, pv.PeakStore())  # preferred 1008, within 5 % of the floor
    assert p.over_budget and (p.config.k, p.config.tile, p.config.rollback) == (8, None, True), calls
    assert all(tile is None for _, tile, _ in calls) and len(calls) <= 6, calls
    calls.clear()
    p = pv.plan_carry(job, 985, 0, pv.PeakStore())  # the floor fits; the smallest (990) saves under 5 %
    assert p.over_budget and (p.config.k, p.config.tile, p.config.rollback) == (8, None, True), calls
    calls.clear()
    tiled[0], floor[0] = 600, 500
    p = pv.plan_carry(job, 400, 0, pv.PeakStore())  # nothing fits; tiles hold 0.6x: the largest such, flagged
    assert p.over_budget and p.config.tile == (30, 30) and p.planned == 600 and len(calls) <= 10, calls


class _NoisyBlock(torch.nn.Module):
    """LTX 0.9.1's noise: a fresh field per call, after each of two operations, scaled per channel."""

    inject_noise = True

    def __init__(self) -> None:
        super().__init__()
        self.scale1, self.scale2 = (torch.nn.Parameter(torch.randn(2, 1, 1)) for _ in range(2))

    def _feed_spatial_noise(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        field = torch.randn(h.shape[-2:], device=h.device, dtype=h.dtype)[None]
        return h + (field * scale)[None, :, None, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._feed_spatial_noise(x, self.scale1)
        return self._feed_spatial_noise(x * 2, self.scale2)


class _NoisyDecoder(torch.nn.Module):
    """Two noisy blocks around a 2x up-sampling; the second runs on chunks in time of at most 600 bytes each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_NoisyBlock(), _NoisyBlock()])

    def forward(self, x: torch.Tensor, timestep: object = None) -> torch.Tensor:
        x = F.interpolate(self.blocks[0](x), scale_factor=(1, 2, 2))
        n = max(1, x.numel() * x.element_size() // 600)
        return torch.cat([self.blocks[1](c) for c in torch.chunk(x, n, dim=2)], dim=2)


class _NoisyVae(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = _NoisyDecoder()


def test_tiles_replaying_the_hosts_draws_equal_its_decode():
    torch.manual_seed(3)
    model, x = _NoisyVae(), torch.randn(1, 2, 5, 4, 6)

    def tiled(replay: bool) -> torch.Tensor:
        out = torch.empty(1, 2, 5, 8, 12)
        draws = _ltx_draws(model, x) if replay else None
        for ya in (0, 2):
            for xa in (0, 3):  # 2x3 tiles: one chunk in time each, where the whole frame makes five
                if draws is None:
                    y = model.decoder(x[..., ya : ya + 2, xa : xa + 3])
                else:
                    with draws.replayed((ya, xa)):
                        y = model.decoder(x[..., ya : ya + 2, xa : xa + 3])
                out[..., 2 * ya : 2 * ya + 4, 2 * xa : 2 * xa + 6] = y
        return out

    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        ref, after = model.decoder(x), torch.randn(3)
        torch.manual_seed(0)
        replayed, after_replay = tiled(True), torch.randn(3)
        torch.manual_seed(0)
        fresh = tiled(False)
    assert torch.equal(replayed, ref) and torch.equal(after_replay, after)
    assert not torch.allclose(fresh, ref, atol=1e-3)
    with torch.no_grad(), pytest.raises(RuntimeError, match="leaves the host's"):
        with _ltx_draws(model, x).replayed((3, 0)):
            model.decoder(x[..., 2:4, 0:3])


def test_a_sizing_run_counts_the_draws_not_their_recording():
    """The draws record the host's calls with a fake run of the whole decoder; a sizing run (the planner's) must
    count the fields it keeps, not that run's activations, or every tiled plan would be sized at least as the
    whole frame."""
    model = _NoisyVae()
    with torch.no_grad(), MetaSizer([model], torch.float32) as sizer:
        x = torch.empty(1, 2, 5, 16, 24)
        draws = _ltx_draws(model, x)
        fields = sum(f.numel() * f.element_size() for spans in draws.spans.values() for _, _, f in spans)
    assert sizer.peak_bytes == x.numel() * x.element_size() + fields
