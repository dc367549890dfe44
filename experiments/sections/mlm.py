"""Section ``mlm``: Su's table for an encoder, MLM accuracy of O and E at 64..1024 tokens over the seeds."""

from __future__ import annotations

import json
from pathlib import Path

from .figures import figure, plot_seeds, save
from .runs import run_dir, training_info
from .tables import markdown, mean_and_range

RUNS = {"O": "mlm-o-s{seed}", "E": "mlm-e-s{seed}"}
SEEDS = (0, 1, 2)
LENGTHS = ("64", "128", "256", "512", "1024")


def run(runs: Path, out: Path) -> str:
    """MLM accuracy of O and E at 64..1024 tokens: mean and spread (min..max) over the seeds."""
    accuracy: dict[str, list[dict[str, float]]] = {}
    for label, pattern in RUNS.items():
        for seed in SEEDS:
            info = training_info(run_dir(runs, pattern.format(seed=seed)))
            accuracy.setdefault(label, []).append(info["mlm_accuracy"])
    (out / "mlm.json").write_text(json.dumps(accuracy, indent=1))
    plot_mlm(accuracy, out / "mlm.png")
    rows = [[label, *[mean_and_range(v) for v in by_length(seeds)]] for label, seeds in accuracy.items()]
    return markdown(["", *LENGTHS], rows)


def by_length(seeds: list[dict[str, float]]) -> list[list[float]]:
    """Each seed's accuracy in %, per length of `LENGTHS`."""
    return [[100 * s[n] for s in seeds] for n in LENGTHS]


def plot_mlm(accuracy: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Accuracy against length for O and E: the mean over seeds and their range."""
    fig, (ax,) = figure(1, width=6)
    for label, seeds in accuracy.items():
        plot_seeds(ax, [int(n) for n in LENGTHS], by_length(seeds), f"Attention-{label}")
    ax.set(
        xscale="log",
        xlabel="tokens",
        ylabel="MLM accuracy (%)",
        title=f"RoFormer MLM trained at 64, {len(SEEDS)} seeds",
    )
    ax.set_xticks([int(n) for n in LENGTHS], list(LENGTHS))
    ax.minorticks_off()
    ax.legend()
    save(fig, path)
