"""The typed boundary to matplotlib (the optional ``viz`` extra).

Imported on first use only; an explicit ``Figure`` on the Agg canvas (no pyplot, no global
backend switch). The protocols let ``mypy --strict`` check this package without matplotlib.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, Protocol

from attrs import define

from ._errors import MissingExtraError

PIN = "matplotlib==3.11.2"
"""The version tested; the ``viz`` extra asks for ``matplotlib>=3.5`` (``set_yticks(labels=)``)."""


class Axes(Protocol):
    def broken_barh(self, xranges: Sequence[tuple[float, float]],
                    yrange: tuple[float, float], **style: Any) -> object: ...

    def text(self, x: float, y: float, s: str, **style: Any) -> object: ...

    def plot(self, xs: Sequence[float], ys: Sequence[float], **style: Any) -> object: ...

    def set_xlim(self, left: float, right: float) -> object: ...

    def set_ylim(self, bottom: float, top: float) -> object: ...

    def set_xticks(self, ticks: Sequence[float], labels: Sequence[str] = ...,
                   **style: Any) -> object: ...

    def set_yticks(self, ticks: Sequence[float], labels: Sequence[str] = ...,
                   **style: Any) -> object: ...

    def set_title(self, label: str, **style: Any) -> object: ...

    def legend(self, *, handles: Sequence[object], **style: Any) -> object: ...


class Figure(Protocol):
    def add_axes(self, rect: tuple[float, float, float, float], **style: Any) -> Axes: ...


class Canvas(Protocol):
    def print_png(self, filename_or_obj: IO[bytes]) -> None: ...


class FigureFactory(Protocol):
    def __call__(self, *, figsize: tuple[float, float], dpi: int,
                 layout: str | None = ...) -> Figure: ...


class CanvasFactory(Protocol):
    def __call__(self, figure: Figure) -> Canvas: ...


class PatchFactory(Protocol):
    def __call__(self, *, facecolor: str, label: str, edgecolor: str = ...,
                 hatch: str | None = ...) -> object: ...


@define(frozen=True)
class Matplotlib:
    figure: FigureFactory
    canvas: CanvasFactory
    patch: PatchFactory


def load() -> Matplotlib:
    """matplotlib's Figure, Agg canvas and Patch, or :class:`MissingExtraError`."""
    try:
        figure = importlib.import_module("matplotlib.figure")
        agg = importlib.import_module("matplotlib.backends.backend_agg")
        patches = importlib.import_module("matplotlib.patches")
    except ImportError as exc:
        raise MissingExtraError(
            f"drawing memory pictures needs matplotlib, which is not installed ({exc}). "
            f"Install flatpool's 'viz' extra: pip install 'flatpool[viz]' (tested with {PIN}).",
            "viz",
        ) from exc
    return Matplotlib(figure.Figure, agg.FigureCanvasAgg, patches.Patch)


@contextmanager
def plain_text() -> Iterator[None]:
    """Text drawn in the block is shown as written: a name like ``a$b`` would otherwise be
    parsed as mathtext (garbled, or an error that aborts the picture)."""
    matplotlib = importlib.import_module("matplotlib")
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        yield
