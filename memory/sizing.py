"""Runs for calibration: a real decode of a given geometry, and its compute-free ``meta`` twin.

* :func:`decode_run` makes ``run(geometry)`` for :func:`.cost_model.calibrate`: it builds a random
  latent of the geometry's shape on the device and calls the decoder (``first_stage_model.decode``
  of a ComfyUI VAE, i.e. the ``full`` executor), dropping the output.
* :class:`MetaSizer` is a tracker (it has ``peak_bytes``) that runs the block on *fake tensors*:
  ``torch._subclasses.FakeTensorMode`` with the modules' parameters swapped for fake ones of the
  requested dtype. Every op runs its shape/dtype logic on ``meta`` storage, nothing is computed or
  allocated, and a :class:`.tracker.PeakTracker` inside the fake mode counts the storages exactly as
  it would for a real run. Fake tensors keep their device (``cpu``), so device-dependent code in the
  decoder (ComfyUI's split attention asks ``get_free_memory`` of the tensor's device) takes the
  same path as a real CPU decode. Measured on the fixture VAEs: the counted peak equals the real
  CPU decode's counted peak to the byte (see docs/MEMORY.md), at ~0.1-2 s for any size.

``calibrate(decode_run(...), geometries, lambda: MetaSizer([model], dtype))`` therefore fits a model
for sizes far too large (or dtypes too slow) to decode on this machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .geometry import Geometry
from .tracker import PeakTracker


def latent_shape(g: Geometry, channels: int) -> tuple[int, ...]:
    """The latent shape a geometry decodes: ``(B,C,H,W)`` or ``(B,C,T,H,W)``."""
    if g.is_video:
        return (g.batch, channels, g.latent_frames, g.latent_h, g.latent_w)
    return (g.batch, channels, g.latent_h, g.latent_w)


def decode_run(
    decode: Callable[[torch.Tensor], Any],
    latent_channels: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Callable[[Geometry], None]:
    """``run(g)``: decode a random latent of ``g``'s shape with ``decode`` under ``no_grad``.

    The latent is created inside the call (so it is part of the tracked pass, as the latent moved
    to the device is in a real decode) and the output is dropped before returning.
    """
    dev = torch.device(device)

    def run(g: Geometry) -> None:
        shape = latent_shape(g, latent_channels)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)  # own generator: the global RNG is left alone
            z = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=dev, dtype=dtype)
            out = decode(z)
            del out, z

    return run


@contextlib.contextmanager
def _swapped_tensors(
    modules: Sequence[torch.nn.Module], make: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """Temporarily replace every parameter and buffer of ``modules`` with ``make(tensor)``."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    seen: set[int] = set()
    try:
        for root in modules:
            for mod in root.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                for store in (mod._parameters, mod._buffers):
                    for name, t in list(store.items()):
                        if t is None:
                            continue
                        saved.append((store, name, t))
                        new = make(t)
                        store[name] = (
                            torch.nn.Parameter(new, requires_grad=False)
                            if isinstance(t, torch.nn.Parameter)
                            else new
                        )
        yield
    finally:
        for store, name, t in reversed(saved):
            store[name] = t


class MetaSizer:
    """A tracker whose block runs on fake tensors (see module docstring). ``peak_bytes`` after exit.

    ``modules``: models whose weights the block uses (swapped for fake tensors of ``dtype`` for
    floating-point weights; other dtypes kept). ``device``: the device the fake tensors claim.
    """

    method = "meta"

    def __init__(
        self,
        modules: Sequence[torch.nn.Module] = (),
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.modules = list(modules)
        self.dtype = dtype
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.end_bytes = 0
        self._stack: contextlib.ExitStack | None = None
        self._tracker: PeakTracker | None = None

    def __enter__(self) -> MetaSizer:
        from torch._subclasses.fake_tensor import FakeTensorMode

        stack = contextlib.ExitStack()
        try:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            stack.enter_context(mode)
            dev, dtype = self.device, self.dtype

            def fake_like(t: torch.Tensor) -> torch.Tensor:
                dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
                return torch.empty(t.shape, dtype=dt, device=dev)

            stack.enter_context(_swapped_tensors(self.modules, fake_like))
            # The fake weights exist before the tracker starts: they are not part of the peak.
            self._tracker = stack.enter_context(PeakTracker(self.device, method="dispatch"))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None and self._tracker is not None
        self._stack.__exit__(*exc)
        self.peak_bytes = self._tracker.peak_bytes
        self.end_bytes = self._tracker.end_bytes
        self._stack = None


def meta_sizer_factory(
    modules: Sequence[torch.nn.Module], dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Callable[[], MetaSizer]:
    def make() -> MetaSizer:
        return MetaSizer(modules, dtype, device)

    return make
