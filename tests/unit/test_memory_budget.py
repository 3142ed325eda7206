"""Budget: free memory - VAE weights still to load - reserve; a user budget replaces free memory."""

from __future__ import annotations

import pytest
import torch
from vramfit.memory.budget import MiB, compute_budget, default_reserve, weights_to_load

GiB = 1024 * MiB


def test_accelerator_budget_subtracts_weights_and_default_reserve() -> None:
    b = compute_budget(
        torch.device("cuda", 0),
        lambda dev: 10 * GiB,
        get_total_memory=lambda dev: 24 * GiB,
        vae_weights_to_load=160 * MiB,
    )
    reserve = int(24 * GiB * 0.05)  # 5 % of 24 GiB > 256 MiB
    assert b.reserve == reserve
    assert b.available == 10 * GiB - 160 * MiB - reserve
    assert b.user_override is None and b.source == "free memory"
    text = b.describe()
    assert "free 10,240 MiB of 24,576 MiB" in text and "VAE weights to load 160 MiB" in text


def test_small_card_reserve_floor_and_comfy_reserve_floor() -> None:
    assert default_reserve("cuda", 4 * GiB) == 256 * MiB
    assert default_reserve("cuda", None) == 256 * MiB
    b = compute_budget("cuda", lambda d: 3 * GiB, get_total_memory=lambda d: 4 * GiB, reserve_floor=400 * MiB)
    assert b.reserve == 400 * MiB
    assert b.available == 3 * GiB - 400 * MiB


def test_user_budget_overrides_free_memory() -> None:
    b = compute_budget("cuda", lambda d: 40 * GiB, user_budget_mb=512, vae_weights_to_load=100 * MiB)
    assert b.user_override == 512 * MiB
    assert b.reserve == 0  # the user's number is what the decode may use
    assert b.available == 412 * MiB
    assert "user budget 512 MiB" in str(b)
    # an explicit reserve still applies on top of a user budget
    b2 = compute_budget("cuda", lambda d: 40 * GiB, user_budget_mb=512, reserve=12 * MiB)
    assert b2.available == 500 * MiB


def test_never_negative() -> None:
    b = compute_budget("cuda", lambda d: 100 * MiB, vae_weights_to_load=1 * GiB)
    assert b.available == 0


def test_cpu_uses_psutil_and_confirms() -> None:
    psutil = pytest.importorskip("psutil")
    b = compute_budget("cpu")
    avail = psutil.virtual_memory().available
    assert abs(b.free_bytes - avail) < 512 * MiB
    assert b.psutil_available is not None
    assert b.reserve == max(512 * MiB, int(psutil.virtual_memory().total * 0.05))
    assert "psutil" in b.describe()
    # with ComfyUI's get_free_memory passed in, that figure is used
    b2 = compute_budget("cpu", lambda d: 8 * GiB, reserve=0)
    assert b2.available == 8 * GiB


def test_weights_to_load() -> None:
    assert weights_to_load(1000, 400) == 600
    assert weights_to_load(1000, 1000) == 0
    assert weights_to_load(1000, 2000) == 0


def test_accelerator_without_get_free_memory_needs_one() -> None:
    with pytest.raises(ValueError):
        compute_budget("mps")


def test_host_room_is_a_share_of_the_available_ram_less_what_the_decode_keeps_there():
    """A store in host memory may take ``HOST_STORE_SHARE`` of the RAM available after the offload, less the output
    kept in host memory; unknown RAM bounds nothing; a decode on the CPU has no host store."""
    from vramfit.memory.budget import HOST_STORE_SHARE, host_room
    from vramfit.memory.decode.env import DecodeEnv, host_room_for

    assert host_room(None, 5) is None
    assert host_room(1000, 100) == int(1000 * HOST_STORE_SHARE) - 100
    assert host_room(100, 1000) == 0
    env = DecodeEnv(host_ram=lambda: 4 << 30)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert host_room_for(env, cuda, cpu, 1 << 30) == int((4 << 30) * HOST_STORE_SHARE) - (1 << 30)
    assert host_room_for(env, cuda, cuda, 1 << 30) == int((4 << 30) * HOST_STORE_SHARE)
    assert host_room_for(env, cpu, cpu, 1 << 30) is None
    assert host_room_for(DecodeEnv(host_ram=lambda: None), cuda, cpu, 0) is None


def test_the_patchers_own_free_memory_is_shown_beside_the_figure_used() -> None:
    """Newer ComfyUI asks model code to read the patcher's ``get_free_memory`` under dynamic VRAM: it counts the
    VAE's own staged weights as free, so the budget keeps torch's free memory + other models' evictable pages and
    says both."""
    b = compute_budget("cuda", lambda d: 6 * GiB, get_total_memory=lambda d: 24 * GiB, evictable_bytes=2 * GiB,
                       patcher_free=9 * GiB)
    assert b.available == 8 * GiB - b.reserve
    text = b.describe()
    assert "evictable 2,048 MiB" in text and "the VAE patcher's get_free_memory says 9,216 MiB" in text, text
    user = compute_budget("cuda", lambda d: 6 * GiB, user_budget_mb=512, patcher_free=9 * GiB)
    assert user.patcher_free is None and "get_free_memory" not in user.describe()
