"""Matplotlib set-up shared by the benchmark scripts: headless backend, one size, one save."""

from __future__ import annotations


def new_axes():
    """A (figure, axes) pair drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6.4, 4.2))


def save(fig, ax, path: str, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
