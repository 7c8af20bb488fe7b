"""Run-directory logging: TensorBoard scalars, a JSON-lines copy of every scalar, and PNG curves."""

from __future__ import annotations

import json
from pathlib import Path


class RunLogger:
    """Scalars go to TensorBoard (`<run>/tb`) and to `<run>/metrics.jsonl` (for plots and scripts)."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        """`resume_step`: a resumed run drops what was logged after its checkpoint (it is logged again)."""
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        purge = None
        if resume_step is not None:
            purge = resume_step + 1
            kept = [r for r in read_metrics(self.run_dir) if r["step"] <= resume_step]
            (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        self.tb.close()
        self._jsonl.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullLogger:
    """The logger of a process that must not write the run's logs (torchrun ranks other than 0)."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Drop the scalars: rank 0 logs for the whole job."""

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc) -> None:
        return None


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(
    series: dict[str, tuple[list[float], list[float]]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    bands: dict[str, tuple[list[float], list[float]]] | None = None,
) -> Path:
    """Line plot of named `(x, y)` series (optional `(lo, hi)` bands) saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="o", label=name)
        if bands and name in bands:
            lo, hi = bands[name]
            ax.fill_between(x, lo, hi, alpha=0.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
