"""Runs for calibration: a real decode of a given geometry, and its compute-free ``meta`` twin.

* :func:`decode_run` makes ``run(geometry)`` for :func:`..cost.phases.calibrate`: it builds a random
  latent of the geometry's shape on the device and calls the decoder (``first_stage_model.decode``
  of a ComfyUI VAE, i.e. the ``full`` executor), dropping the output.
* :class:`MetaSizer` is a tracker (it has ``peak_bytes``) that runs the block on *fake tensors*:
  ``torch._subclasses.FakeTensorMode`` with the modules' parameters swapped for fake ones of the
  requested dtype, in the sizing thread only (every other reader of the live model, e.g. the VRAM
  monitor or another thread, still sees its real tensors). Every op runs its shape/dtype logic on
  ``meta`` storage, nothing is computed or allocated, and a :class:`.tracker.PeakTracker` inside the fake mode counts the storages exactly as
  it would for a real run. Fake tensors keep their device (``cpu``), so device-dependent code in the
  decoder (ComfyUI's split attention asks ``get_free_memory`` of the tensor's device) takes the
  same path as a real CPU decode. Measured on the fixture VAEs: the counted peak equals the real
  CPU decode's counted peak to the byte (see docs/MEMORY.md), at ~0.1-2 s for any size.

``calibrate(decode_run(...), geometries, lambda: MetaSizer([model], dtype))`` therefore fits a model
for sizes far too large (or dtypes too slow) to decode on this machine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..geometry import Geometry
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
    """``run(g)``: decode a random latent of ``g``'s shape with ``decode`` under ``torch.inference_mode``, as
    ComfyUI's executor runs every node (a decoder may allocate otherwise outside it).

    The latent is created inside the call (so it is part of the tracked pass, as the latent moved
    to the device is in a real decode) and the output is dropped before returning.
    """
    dev = torch.device(device)

    def run(g: Geometry) -> None:
        shape = latent_shape(g, latent_channels)
        with torch.inference_mode():
            gen = torch.Generator().manual_seed(seed)  # own generator: the global RNG is left alone
            z = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=dev, dtype=dtype)
            out = decode(z)
            del out, z

    return run


class _SizingView(dict):
    """A module's ``_parameters`` or ``_buffers`` while a :class:`MetaSizer` runs. It holds the real tensors
    (what other threads, ``gc`` walks and ``dict`` methods see); a sizing thread reads its own fake ones
    through ``[]``, ``get``, ``items`` and ``values``, the accessors ``torch.nn.Module`` uses."""

    def __init__(self, real: dict[str, Any]) -> None:
        super().__init__(real)
        self.real = real
        """The module's own dict, put back when the last sizing thread leaves."""
        self.fakes: dict[int, dict[str, Any]] = {}
        """Thread id -> name -> fake tensor."""

    def _mine(self) -> dict[str, Any] | None:
        return self.fakes.get(threading.get_ident())

    def __getitem__(self, name: str) -> Any:
        mine = self._mine()
        if mine is not None and name in mine:
            return mine[name]
        return dict.__getitem__(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        mine = self._mine()
        if mine is not None and name in mine:
            mine[name] = value
        else:
            dict.__setitem__(self, name, value)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def items(self) -> Any:
        mine = self._mine()
        if mine is None:
            return dict.items(self)
        return [(k, mine.get(k, v)) for k, v in dict.items(self)]

    def values(self) -> Any:
        return [v for _, v in self.items()]


@contextlib.contextmanager
def _swapped_tensors(
    modules: Sequence[torch.nn.Module], make: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """For this thread only, replace every parameter and buffer of ``modules`` with ``make(tensor)``: the
    live model keeps its tensors for everyone else (another thread, a ``gc`` walk of the VRAM monitor)."""
    me = threading.get_ident()
    installed: list[tuple[torch.nn.Module, str, _SizingView, dict[str, Any] | None]] = []
    seen: set[int] = set()
    try:
        for root in modules:
            for mod in root.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                for attr in ("_parameters", "_buffers"):
                    store = mod.__dict__[attr]
                    view = store if isinstance(store, _SizingView) else _SizingView(store)
                    fakes = {}
                    for name, t in dict.items(view):  # the real tensors, also under an outer sizer
                        if t is None:
                            continue
                        new = make(t)
                        fakes[name] = (
                            torch.nn.Parameter(new, requires_grad=False)
                            if isinstance(t, torch.nn.Parameter)
                            else new
                        )
                    installed.append((mod, attr, view, view.fakes.get(me)))
                    view.fakes[me] = fakes
                    mod.__dict__[attr] = view
        yield
    finally:
        for mod, attr, view, outer in reversed(installed):
            if outer is not None:  # nested sizer: the outer one's fakes again
                view.fakes[me] = outer
                continue
            view.fakes.pop(me, None)
            if not view.fakes and mod.__dict__.get(attr) is view:
                view.real.clear()
                view.real.update(dict.items(view))  # writes made meanwhile by other threads are kept
                mod.__dict__[attr] = view.real


class MetaSizer:
    """A tracker whose block runs on fake tensors (see module docstring). ``peak_bytes`` after exit.

    ``modules``: models whose weights the block uses (swapped, for this thread only, for fake tensors of
    ``dtype`` for floating-point weights; other dtypes kept). ``device``: the device the fake tensors claim.
    ``track_host``: also count the fake tensors the block puts in host memory (``cpu``, a store in host memory)
    when ``device`` is another: their peak in ``host_peak_bytes`` (a second dispatch mode; 0 otherwise).
    """

    method = "meta"
    entered = 0
    """Meta sizings begun in this process (a plan step that began one sized a new shape: first-use work,
    :meth:`..decode.first_use.FirstUse.sized`)."""

    def __init__(
        self,
        modules: Sequence[torch.nn.Module] = (),
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        track_host: bool = False,
    ) -> None:
        self.modules = list(modules)
        self.track_host = track_host
        self.dtype = dtype
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.end_bytes = 0
        self.host_peak_bytes = 0
        self._stack: contextlib.ExitStack | None = None
        self._tracker: PeakTracker | None = None
        self._host: PeakTracker | None = None

    def __enter__(self) -> MetaSizer:
        from torch._subclasses.fake_tensor import FakeTensorMode

        MetaSizer.entered += 1
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
            if self.track_host and self.device.type != "cpu":
                self._host = stack.enter_context(PeakTracker("cpu", method="dispatch"))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    @property
    def peak_so_far(self) -> int:
        """Peak bytes reached so far inside the block (a phase's peak, read between phases)."""
        return self._tracker.peak_so_far if self._tracker is not None else self.peak_bytes

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None and self._tracker is not None
        self._stack.__exit__(*exc)
        self.peak_bytes = self._tracker.peak_bytes
        self.end_bytes = self._tracker.end_bytes
        self.host_peak_bytes = self._host.peak_bytes if self._host is not None else 0
        self._stack = None
        self._host = None


def meta_sizer_factory(
    modules: Sequence[torch.nn.Module], dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Callable[[], MetaSizer]:
    def make() -> MetaSizer:
        return MetaSizer(modules, dtype, device)

    return make
