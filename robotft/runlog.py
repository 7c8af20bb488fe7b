"""Run-directory logging: TensorBoard scalars, a JSON-lines copy of every scalar, optional Weights & Biases,
PNG curves, and the progress bars every stage shows."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

PROGRESS_INTERVAL_S = 30.0
"""Seconds between progress lines when stderr is not a terminal (`$ROBOTFT_PROGRESS_INTERVAL` overrides)."""


class _LineTqdm(tqdm):
    """A tqdm bar that prints each refresh as its own line: a CI log or `| tee` file then holds short readable
    lines instead of one line of carriage-return redraws that grows to megabytes."""

    line_interval_s = PROGRESS_INTERVAL_S
    _last_line = -float("inf")
    _last_n = -1

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Print a line at most every `line_interval_s` (postfix updates included), and the final state."""
        if self.disable:
            return True
        now = self._time()
        final = self.total is not None and self.n >= self.total
        if self.n == self._last_n or (now - self._last_line < self.line_interval_s and not final):
            return True
        self._last_line, self._last_n = now, self.n
        self.fp.write((msg if msg is not None else self.__str__()).strip() + "\n")
        self.fp.flush()
        return True

    def close(self) -> None:
        """Print the final state once (tqdm's own close would redraw it with a carriage return)."""
        if self.disable:  # a disabled bar never opened its stream
            return super().close()
        if self.n != self._last_n:
            self.fp.write(self.__str__().strip() + "\n")
            self.fp.flush()
        self._last_n = self.n
        fp, self.fp = self.fp, open(os.devnull, "w")  # noqa: SIM115 - closed just below
        try:
            super().close()
        finally:
            self.fp.close()
            self.fp = fp


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """The progress bar of every long operation, on stderr: a live tqdm bar in a terminal; elsewhere one line
    every `PROGRESS_INTERVAL_S` seconds (and at the end). Takes tqdm's arguments."""
    file = kwargs.pop("file", sys.stderr)
    if getattr(file, "isatty", lambda: False)():
        return tqdm(iterable, file=file, dynamic_ncols=True, **kwargs)
    interval = float(os.environ.get("ROBOTFT_PROGRESS_INTERVAL", PROGRESS_INTERVAL_S))
    kwargs.pop("dynamic_ncols", None)
    bar = _LineTqdm(iterable, file=file, mininterval=interval, ascii=True,
                    bar_format="{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
                    **kwargs)
    bar.line_interval_s = interval
    return bar


@dataclasses.dataclass
class WandbConfig:
    """Weights & Biases logging (opt-in, `--wandb`; needs the `wandb` extra). Every scalar logged to TensorBoard
    is also sent to W&B, with the run's resolved config."""

    enabled: bool = False
    """Log to Weights & Biases as well as to TensorBoard and metrics.jsonl."""
    project: str = "robotft"
    """W&B project."""
    entity: str = ""
    """W&B entity (user or team); '' uses your default."""
    name: str = ""
    """Run name; '' uses the run directory's name."""
    mode: str = "online"
    """`online`, `offline` (written under `<run>/wandb`, upload later with `wandb sync`) or `disabled`."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Run tags."""


class RunLogger:
    """Scalars go to TensorBoard (`<run>/tb`), to `<run>/metrics.jsonl` (for plots and scripts) and, when enabled,
    to Weights & Biases."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None, wandb: WandbConfig | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """`resume_step`: a resumed run drops what was logged after its checkpoint (it is logged again).
        `config`: the run's resolved config, recorded by W&B."""
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
        self.wandb = _start_wandb(wandb, self.run_dir, config) if wandb is not None and wandb.enabled else None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.tb.close()
        self._jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start_wandb(cfg: WandbConfig, run_dir: Path, config: dict[str, Any] | None) -> Any:
    """A W&B run for `run_dir`; a resumed run directory continues the same W&B run (its id is kept in
    `<run>/wandb_run_id`)."""
    from robotft.optional import require

    wandb = require("wandb", "wandb", "--wandb")
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    return wandb.init(project=cfg.project, entity=cfg.entity or None, name=cfg.name or run_dir.name,
                      mode=cfg.mode, tags=cfg.tags, dir=str(run_dir), id=run_id, resume="allow", config=config)


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


def capped_update(bar: tqdm) -> Callable[[int], None]:
    """`n -> bar.update(n)`, never past the bar's total: an evaluation on parallel envs also finishes the
    surplus episodes of its last round, which do not count."""

    def update(n: int) -> None:
        bar.update(min(n, max(bar.total - bar.n, 0)))

    return update
