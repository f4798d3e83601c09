"""Does a shipped example learn, and how reliably: its training config run once per seed, each
from the untrained model in a directory of its own; held-out success before and after (sampled
and greedy) per seed with the mean and spread, every seed's metrics in one file with a `seed`
column, and every seed's held-out curve in one plot (`make soak-learning`: hours on 2 cores).

    python -m benchmarks.learning harness_adapters/examples/shell/train.yaml --seeds 1 2 3

A seed whose run finished (its last evaluation is in its metrics) is not run again, and one
that stopped goes on from its last checkpoint: a long series can be taken up where it stopped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from harness_adapters.config import load_config
from trainer.config import TrainConfig
from trainer.loop import latest_checkpoint, read_metrics
from trainer.run import train


def finished(config: TrainConfig) -> bool:
    metrics = config.out_dir / "metrics.jsonl"
    return metrics.exists() and any(r["step"] == config.train.steps for r in read_metrics(metrics)[1])


def summary(seed: int, metrics: Path) -> dict[str, Any]:
    steps, evals = read_metrics(metrics)
    first, last = evals[0], evals[-1]
    return {
        "seed": seed,
        "before": first["heldout_success"],
        "after": last["heldout_success"],
        "before_greedy": first["heldout_success_greedy"],
        "after_greedy": last["heldout_success_greedy"],
        "minutes": max(r["time"] for r in steps + evals) / 60,
    }


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.0%} ± {sd:.0%}"


def plot(runs: dict[int, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, metrics in runs.items():
        evals = read_metrics(metrics)[1]
        (line,) = ax.plot([r["step"] for r in evals], [r["heldout_success"] for r in evals], "o-", label=f"seed {seed}")
        greedy = [r["heldout_success_greedy"] for r in evals]
        ax.plot([r["step"] for r in evals], greedy, "s--", color=line.get_color(), alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out success (solid: sampled, dashed: greedy)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", type=Path, help="[default: runs/<run>-seeds]")
    args = parser.parse_args()
    out = args.out or Path("runs") / f"{load_config(args.config, TrainConfig).run}-seeds"
    runs: dict[int, Path] = {}
    for seed in args.seeds:
        config = load_config(args.config, TrainConfig)
        config.out = str(out / f"seed-{seed}")
        config.train.grpo = {**config.train.grpo, "seed": seed}
        if not finished(config):  # from its last checkpoint, or from the start
            resume = latest_checkpoint(config.out_dir) is not None
            if not resume:
                shutil.rmtree(config.out_dir, ignore_errors=True)
            print(f"seed {seed}: {config.out}", flush=True)
            train(config, resume)
        runs[seed] = config.out_dir / "metrics.jsonl"
    rows = [summary(seed, metrics) for seed, metrics in runs.items()]
    with open(out / "metrics.jsonl", "w") as combined:  # every seed's rows, with a seed column
        for seed, metrics in runs.items():
            steps, evals = read_metrics(metrics)
            for row in sorted(steps + evals, key=lambda r: r["time"]):
                combined.write(json.dumps({**row, "seed": seed}) + "\n")
    plot(runs, out / "training.png")
    print("| seed | held-out sampled, before -> after | greedy, before -> after | minutes |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['before']:.0%} -> {r['after']:.0%} | "
            f"{r['before_greedy']:.0%} -> {r['after_greedy']:.0%} | {r['minutes']:.0f} |"
        )
    gains = [r["after"] - r["before"] for r in rows]
    greedy = [r["after_greedy"] - r["before_greedy"] for r in rows]
    print(
        f"| mean ± sd | {spread([r['before'] for r in rows])} -> {spread([r['after'] for r in rows])} "
        f"(gain {spread(gains)}) | {spread([r['before_greedy'] for r in rows])} -> "
        f"{spread([r['after_greedy'] for r in rows])} (gain {spread(greedy)}) | "
        f"{statistics.fmean(r['minutes'] for r in rows):.0f} |"
    )
    print(f"metrics (a seed column): {out / 'metrics.jsonl'}; plot: {out / 'training.png'}")


if __name__ == "__main__":
    main()
