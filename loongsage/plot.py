"""`loongsage plot RUN_DIR`: reward, held-out accuracy and train-inference gap curves as one PNG."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loongsage.metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("reward/mean", "training reward (mean)", axes[0]),
              ("eval/accuracy", "held-out accuracy", axes[1])]
    for key, title, ax in panels:
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key.startswith("eval") else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax = axes[2]
    for key in ("mismatch/abs_logprob_diff", "mismatch/kl"):
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=key)
    ax.set_title("train-inference gap")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
