"""Does swap gain where agent B succeeds more often than the policy? Pooled over the committed tables and probes.

For every swap run that has an outcome-only run of the same pair, seed, budget and evaluation goals:
y = swap minus outcome-only held-out success (on the most goals the run was evaluated on: a table's
--final-eval-tasks CSV where there is one), and B's edge in sampled success (run means), measured two ways:
x = B's minus the swap run's policy's, on the same training tasks (explorer_success_all - train_success_all);
x' = B's minus the outcome-only run's policy's. Neither is clean: a swap policy that trains badly raises x and lowers
y (x's r is biased down), an outcome-only policy that trains badly raises x' and raises y (x''s r is biased up):
read the two together. Prints each pair of runs, Pearson's r of each with its 95% interval (Fisher's z), and the
mean y, with its 95% t interval, where B was ahead of its own policy (x > 0) and where it was not, and the
five pairs with the largest x.

Then the premise under it (probes 21-28): does training on the aligned dense reward alone (or, in probe 24, on the
outcome plus a tenth of it; in probes 25-26, on the milestone reward; in probes 27-28, on the milestone reward without
the options, probe 28 with the search hits listed cheapest first) raise success faster than training on the outcome?
Process-only minus outcome-only, paired by seed: sampled training success over the whole run and over its first 10
iterations, and validation success, each with its 95% t interval.

    python benchmarks/explorer_edge.py

Reads CSVs only (nothing is trained). The validation probes 16-19 share their outcome-only runs, so their y's are not
independent of each other: the intervals are a guide, not a test.
"""

from __future__ import annotations

import csv
import functools
import math
import pathlib
import statistics
import sys
from typing import NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from learning import t_ci95  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PROBES = "probe_agent_b_regimes/"

# (label, learning.csv of the runs, the CSV of their re-evaluation on more goals or None, {column: value} that the
# swap runs must match, or None); outcome-only runs are taken from the same file, or from `OUTCOME_FROM`.
SETS = [
    ("test, 500 goals", "converged_grpo_webshop_10/learning.csv", "converged_grpo_webshop_final500/learning_final500.csv", None),
    ("test, 500 goals", "converged_gigpo_webshop/learning.csv", "converged_gigpo_webshop_final500/learning_final500.csv", None),
    ("test, 1,000 games", "searcher_alfworld_all/learning.csv", "searcher_alfworld_all/learning_final1000.csv", None),
    ("probe 16, G_off 4", PROBES + "p16_explorer_share_valid500_learning.csv", None, {"g_on+g_off": "4+4"}),
    ("probe 16, G_off 2", PROBES + "p16_explorer_share_valid500_learning.csv", None, {"g_on+g_off": "4+2"}),
    ("probe 16, G_on = G_off = 2", PROBES + "p16_explorer_share_valid500_learning.csv", None, {"g_on+g_off": "2+2"}),
    ("probe 17, B at 0.7", PROBES + "p17_explorer_temperature07_valid500_learning.csv", None, None),
    ("probe 18, B aligned", PROBES + "p18_aligned_explorer_valid500_learning.csv", None, None),
    ("probe 19, B aligned, lr 1e-3", PROBES + "p19_aligned_explorer_lr1e-3_valid500_learning.csv", None, None),
    ("probe 20, ALFWorld, B aligned", PROBES + "p20_alfworld_ppo_aligned_explorer_valid200_learning.csv", None, None),
    ("probe 22, GiGPO, B aligned", PROBES + "p22_gigpo_webshop_aligned_valid500_learning.csv", None, None),
    ("probe 23, ALFWorld, B aligned", PROBES + "p23_gigpo_alfworld_aligned_valid200_learning.csv", None, None),
    ("probe 25, GiGPO, B milestone", PROBES + "p25_gigpo_webshop_milestone_valid500_learning.csv", None, None),
    ("probe 26, G 2 + 2, B milestone", PROBES + "p26_grpo_webshop_group2_milestone_valid500_learning.csv", None, None),
    ("probe 27, G 2 + 2, B milestone w/o options", PROBES + "p27_grpo_webshop_group2_milestone_blind_valid500_learning.csv", None, None),
    ("probe 27, GiGPO, G 2 + 2, B milestone w/o options", PROBES + "p27_gigpo_webshop_group2_milestone_blind_valid500_learning.csv", None, None),
    ("probe 28, GiGPO, price order, G 2 + 2, B milestone w/o options", PROBES + "p28_gigpo_webshop_price_group2_milestone_blind_valid500_learning.csv", None, None),
]  # fmt: skip
# Outcome-only runs are taken from a runs file itself and, for the files named here, from an earlier probe's file with
# the outcome-only runs of the same goals and seeds (the probe ran only swap or process-only, or only some seeds).
OUTCOME_FROM = {
    PROBES + "p17_explorer_temperature07_valid500_learning.csv": PROBES + "p16_explorer_share_valid500_learning.csv",
    PROBES + "p19_aligned_explorer_lr1e-3_valid500_learning.csv": PROBES + "p18_aligned_explorer_valid500_learning.csv",
    PROBES + "p21_grpo_webshop_process_aligned_valid500_learning.csv": PROBES + "p18_aligned_explorer_valid500_learning.csv",
    PROBES + "p21_ppo_alfworld_process_aligned_valid200_learning.csv": PROBES + "p20_alfworld_ppo_aligned_explorer_valid200_learning.csv",
    PROBES + "p24_grpo_webshop_process_mixed01_valid500_learning.csv": PROBES + "p18_aligned_explorer_valid500_learning.csv",
    PROBES + "p25_grpo_webshop_process_milestone_valid500_learning.csv": PROBES + "p18_aligned_explorer_valid500_learning.csv",
    PROBES + "p25_gigpo_webshop_milestone_valid500_learning.csv": PROBES + "p22_gigpo_webshop_aligned_valid500_learning.csv",
    PROBES + "p27_grpo_webshop_group2_milestone_blind_valid500_learning.csv": PROBES + "p26_grpo_webshop_group2_milestone_valid500_learning.csv",
}  # fmt: skip


class Pair(NamedTuple):
    """A swap run and its outcome-only run: B's edge over each run's policy (x, x') and swap - outcome (y)."""

    label: str
    pair: str
    seed: int
    x: float
    x_outcome: float
    y: float


# (pair, the process-only runs on the dense reward; their outcome-only runs as OUTCOME_FROM says)
PREMISE = [
    ("GRPO/WebShop", PROBES + "p21_grpo_webshop_process_aligned_valid500_learning.csv"),
    ("PPO/ALFWorld", PROBES + "p21_ppo_alfworld_process_aligned_valid200_learning.csv"),
    ("GiGPO/WebShop", PROBES + "p22_gigpo_webshop_aligned_valid500_learning.csv"),
    ("GiGPO/ALFWorld", PROBES + "p23_gigpo_alfworld_aligned_valid200_learning.csv"),
    ("GRPO/WebShop, outcome + 0.1 x aligned", PROBES + "p24_grpo_webshop_process_mixed01_valid500_learning.csv"),
    ("GRPO/WebShop, milestone", PROBES + "p25_grpo_webshop_process_milestone_valid500_learning.csv"),
    ("GiGPO/WebShop, milestone", PROBES + "p25_gigpo_webshop_milestone_valid500_learning.csv"),
    ("GRPO/WebShop, milestone, G 2", PROBES + "p26_grpo_webshop_group2_milestone_valid500_learning.csv"),
    ("GRPO/WebShop, milestone w/o options, G 2", PROBES + "p27_grpo_webshop_group2_milestone_blind_valid500_learning.csv"),
    ("GiGPO/WebShop, milestone w/o options, G 2", PROBES + "p27_gigpo_webshop_group2_milestone_blind_valid500_learning.csv"),
    ("GiGPO/WebShop, milestone w/o options, G 2, price order", PROBES + "p28_gigpo_webshop_price_group2_milestone_blind_valid500_learning.csv"),
]  # fmt: skip
PREMISE_COLUMNS = ("train_success_all", "train_success_first10", "success")


@functools.cache  # the same CSV serves several sets and premises (probe 18's outcome runs, probes 22-23's own files)
def read(path: str) -> list[dict]:
    with open(RESULTS / path, newline="") as f:
        return list(csv.DictReader(f))


def outcome_runs(path: str) -> dict[tuple[str, str], dict]:
    """The outcome-only runs for the runs of `path` by (pair, seed): its own and those of OUTCOME_FROM[path]."""
    rows = read(path) + (read(OUTCOME_FROM[path]) if path in OUTCOME_FROM else [])
    return {(r["pair"], r["seed"]): r for r in rows if r["variant"] == "outcome"}


def pairs_of(label: str, path: str, final: str | None, match: dict | None) -> list[Pair]:
    """A Pair for each swap run of `path` that has an outcome-only run of its pair and seed."""
    swaps = [r for r in read(path) if r["variant"] == "swap" and all(r[k] == v for k, v in (match or {}).items())]
    outcome = outcome_runs(path)
    again = {(r["pair"], r["variant"], r["seed"]): float(r["success"]) for r in (read(final) if final else [])}

    def success(r: dict) -> float:  # the run's own final evaluation, or its re-evaluation on more goals
        return again.get((r["pair"], r["variant"], r["seed"]), float(r["success"]))

    out = []
    for r in swaps:
        control = outcome.get((r["pair"], r["seed"]))
        if control is not None and r["explorer_success_all"]:
            b = float(r["explorer_success_all"])
            x, x_outcome = b - float(r["train_success_all"]), b - float(control["train_success_all"])
            out.append(Pair(label, r["pair"], int(r["seed"]), x, x_outcome, success(r) - success(control)))
    return out


def premise_differences(process_path: str) -> dict[str, list[float]]:
    """Process-only minus outcome-only per seed (in seed order), for each of PREMISE_COLUMNS."""
    process = {int(r["seed"]): r for r in read(process_path) if r["variant"] == "process"}
    outcome = {int(seed): r for (_, seed), r in outcome_runs(process_path).items()}
    seeds = sorted(process.keys() & outcome.keys())
    return {k: [float(process[s][k]) - float(outcome[s][k]) for s in seeds] for k in PREMISE_COLUMNS}


def pearson_ci95(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Pearson's r and its 95% interval, tanh(atanh(r) -+ 1.96 / sqrt(n - 3))."""
    r = statistics.correlation(xs, ys)
    half = 1.96 / math.sqrt(len(xs) - 3)
    return r, math.tanh(math.atanh(r) - half), math.tanh(math.atanh(r) + half)


def main() -> None:
    data = [p for s in SETS for p in pairs_of(*s)]
    print(f"{'set':<30} {'pair':<15} seed        x       x'  swap - outcome")
    for label, pair, seed, x, x_outcome, y in data:
        print(f"{label:<30} {pair:<15} {seed:>4}  {x:+.3f}  {x_outcome:+.3f}  {y:+14.3f}")
    xs, ys = [d.x for d in data], [d.y for d in data]
    print(f"\n{len(data)} pairs of runs; B - its own policy (x) from {min(xs):+.3f} to {max(xs):+.3f}")
    for name, edge in (("x  (B - the swap run's policy)", xs), ("x' (B - the outcome-only run's policy)",
                                                            [d.x_outcome for d in data])):  # fmt: skip
        r, low, high = pearson_ci95(edge, ys)
        print(f"Pearson r of swap - outcome on {name}: {r:+.3f}, 95% interval [{low:+.3f}, {high:+.3f}]")
    for name, group in (("B ahead (x > 0)", [y for x, y in zip(xs, ys) if x > 0]),
                        ("B not ahead (x <= 0)", [y for x, y in zip(xs, ys) if x <= 0])):  # fmt: skip
        mean, half = t_ci95(group)
        print(f"{name:<21} {len(group):>3} pairs: swap - outcome {mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]")
    print(
        "the five largest x:",
        ", ".join(f"{d.label}, {d.pair} seed {d.seed}: x {d.x:+.3f}, y {d.y:+.3f}" for d in top_x(data, 5)),
    )
    print("\nthe premise: process-only on the dense reward (the aligned one unless named) minus outcome-only, by seed")
    width = max(len(pair) for pair, _ in PREMISE)
    for pair, process_path in PREMISE:
        for column, diffs in premise_differences(process_path).items():
            mean, half = t_ci95(diffs)
            interval = f"[{mean - half:+.3f}, {mean + half:+.3f}]"
            print(f"{pair:<{width}} {len(diffs):>2} seeds  {column:<22} {mean:+.3f} {interval}")


def top_x(data: list[Pair], k: int) -> list[Pair]:
    """The k pairs of runs in which B was furthest ahead of its own policy."""
    return sorted(data, key=lambda d: -d.x)[:k]


if __name__ == "__main__":
    main()
