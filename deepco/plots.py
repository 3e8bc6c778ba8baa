"""Writing matplotlib figures for the CLI: one place that turns a failed write into a one-line error."""

from __future__ import annotations

from typing import Any

from deepco.errors import UserError


def save_figure(fig: Any, path: str, dpi: int = 120) -> None:
    """Write ``fig`` to ``path`` and close it; a path that cannot be written is a UserError naming it."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise UserError(f"{path}: cannot write the plot: {exc.strerror}") from None
    finally:
        plt.close(fig)
