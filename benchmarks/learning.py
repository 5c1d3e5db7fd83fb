"""Learning benchmark: held-out success after a fixed budget of environment steps, for every script and reward mode.

Every run trains on the embedded default (tiny model, embedded env, small preset) until `--total-env-steps`
environment steps have been taken (explorer steps included), then evaluates on held-out seeds; the initial model's
evaluation (step 0) is run once per (env, seed) and shared by the runs that start from it. Variants per pair:

- outcome          the base algorithm on the sparse outcome reward, a group of G_on policy rollouts
- outcome_big      control: the same with G_on + G_off policy rollouts ("more samples" is not "the swap works")
- process          the base algorithm trained on the misaligned process reward (evaluated on the outcome)
- swap             RSPO: agent B learns the misaligned process reward, the default off-policy correction (tis)
and, on the pairs in SECONDARY_PAIRS with --secondary-seeds seeds:
- swap_one_step    RSPO with the explorer re-copied every iteration and one step on the policy's batch
- swap_none        RSPO without the importance weights
- process_aligned  the base algorithm on the aligned process reward

Outputs (under --out, default benchmarks/results/): `learning.csv` (one row per run; ALFWorld runs add the held-out
games solved per task type at step 0 and at the end, solved_<type>_start / solved_<type> of games_<type>, which are
also printed), `learning_summary.csv` (mean, std and 95% interval over seeds), `learning_paired.csv` (swap minus each
control, paired by seed: mean and 95% interval), `learning.png` (held-out success vs environment steps, one panel per
pair). One seed gives a mean and no interval or std: those cells are blank in the CSVs and printed as '-' or left out.

    python benchmarks/learning.py                  # the whole table: 86 runs (see below)
    python benchmarks/learning.py --only grpo_webshop
    python benchmarks/learning.py --quick          # a short check: 1 seed, 800 env steps, 2 pairs (233-266 s, 2-core EPYCs)
    python benchmarks/learning.py --only grpo_webshop --script-flags "--kl-coef 0.1" --out benchmarks/results/kl01

Does this CPU repeat a committed table? Run some of its seeds with the table's own flags (docs/results.md has them)
and --compare its CSV; the runs it has are printed as the same or with what differs (one command, wrapped here):

    python benchmarks/learning.py --only grpo_webshop --seeds 1 --secondary-seeds 0 --total-env-steps 4000
        --num-eval-tasks 200 --eval-every 20 --out /tmp/check
        --compare benchmarks/results/converged_grpo_webshop/learning.csv

Runs take 4,000 env steps on WebShop and 12,000 on ALFWorld (ENV_BUDGET; --total-env-steps sets one budget for all).
Measured on a 2-core AMD EPYC with AVX2, two runs at a time (2026-12-05/06): the main variants of the WebShop pairs took
2,521 s (GRPO) and 2,457 s (GiGPO) for 5 seeds (benchmarks/results/converged_grpo_webshop, converged_gigpo_webshop);
those of the ALFWorld pairs, 40 runs of 353-956 s (GiGPO outcome_big the shortest, PPO swap the longest), about 3 h 15
min (benchmarks/results/searcher_alfworld_all). So the whole table takes about 5 h (by the run times of seed 1 on two
AVX-512 EPYCs: about 4 h 30 min on one of family 25, about 3 h 30 min on one of family 26): more than the 2.5 h it was
meant to fit, which ALFWorld's 4,000-step budget did, on which no ALFWorld variant learned (docs/results.md, probes 8,
13-15). Those ALFWorld runs spent 53-80% of their time updating (PPO swap: 25 s an iteration for the policy, its critic,
agent B and B's critic, against 4 s of rollout), 11-22% in rollouts, the rest evaluating, checkpointing and starting
(the runs' perf/update_s and perf/rollout_s): a shorter table needs a cheaper update, not a faster env. Evaluating every
10 iterations is a tenth of the table: --eval-every 0 (the start and the end only) ran seed 1 of the four pairs in 0.90
of the time, every final figure the same (docs/results.md, probe 32). Run the pairs apart with --only.

The CSVs are rewritten after every run. Rerunning a command reuses the runs under --out/runs/ that reached the
budget (an interrupted table continues where it stopped), so give a changed setting its own --out.
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import math
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]

# pair -> (script, extra flags)
PAIRS: dict[str, tuple[str, list[str]]] = {
    "grpo_webshop": ("rspo_grpo_webshop.py", []),
    "ppo_alfworld": ("rspo_ppo_alfworld.py", []),
    "gigpo_webshop": ("rspo_gigpo.py", ["--env", "webshop"]),
    "gigpo_alfworld": ("rspo_gigpo.py", ["--env", "alfworld"]),
}
SECONDARY_PAIRS = ("grpo_webshop",)
MAIN_VARIANTS = ("outcome", "outcome_big", "process", "swap")
SECONDARY_VARIANTS = ("swap_one_step", "swap_none", "process_aligned")
# The process reward of the main variants: the one whose optimum is not the outcome's (the paper's setting).
PROCESS_REWARD = "misaligned"
# Every run of an env and seed starts from the same tiny model, and both scripts on an env evaluate it on the same
# held-out seeds with the same prompts, so its step-0 evaluation is one measurement: it is run once per (env, seed)
# with --eval-only and shared (the 51-run table of 2026-12-03 measured it in every run: identical in all of them).
INITIAL_EVAL = {"webshop": "rspo_grpo_webshop.py", "alfworld": "rspo_ppo_alfworld.py"}
G_ON, G_OFF = 4, 4
# Env steps per run (explorer steps included), unless --total-env-steps says otherwise. ALFWorld's failures last all
# 15 turns, so 4,000 env steps are 9-18 updates there, in which no variant learned (docs/results.md, probes 8-15);
# PPO outcome-only learned on validation games by 12,000 (probe 15).
ENV_BUDGET = {"webshop": 4000, "alfworld": 12000}


def variant_flags(variant: str) -> list[str]:
    """The flags that make one variant; every variant uses G_on policy rollouts unless it says otherwise."""
    base = ["--group-size", str(G_ON), "--explorer-rollouts-per-task", str(G_OFF), "--process-reward", PROCESS_REWARD]
    if variant == "outcome":
        return base + ["--reward-mode", "outcome"]
    if variant == "outcome_big":
        return [
            "--group-size",
            str(G_ON + G_OFF),
            "--explorer-rollouts-per-task",
            str(G_OFF),
            "--reward-mode",
            "outcome",
        ]
    if variant == "process":
        return base + ["--reward-mode", "process"]
    swap = ["--reward-mode", "swap", "--explorer", "agent_b", "--off-policy-correction", "tis"]
    if variant == "swap":
        return base + swap
    if variant == "swap_one_step":
        return base + swap + ["--explorer", "one_step"]
    if variant == "swap_none":
        return base + swap + ["--off-policy-correction", "none"]
    if variant == "process_aligned":
        return base + ["--reward-mode", "process", "--process-reward", "aligned"]
    raise ValueError(f"unknown variant {variant!r}")


def jobs_for(
    pairs: list[str], seeds: int, secondary_seeds: int, variants: list[str] | None = None, first_seed: int = 1
) -> list[tuple[str, str, int]]:
    """(pair, variant, seed) of every run: the main variants on every pair and on `seeds` seeds from `first_seed`,
    the secondary ones on SECONDARY_PAIRS with the first `secondary_seeds` of those; only `variants` when given."""
    # Seed by seed, so that a table stopped early holds whole seeds of every variant.
    jobs = [(pair, v, s) for s in range(first_seed, first_seed + seeds) for pair in pairs for v in MAIN_VARIANTS]
    jobs += [
        (pair, v, s)
        for s in range(first_seed, first_seed + min(seeds, secondary_seeds))
        for pair in pairs
        if pair in SECONDARY_PAIRS
        for v in SECONDARY_VARIANTS
    ]
    return [j for j in jobs if variants is None or j[1] in variants]


# two-sided 95% quantiles of Student's t, t_{0.975, df} for df = 1..30 (intervals over a handful of seeds)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t_ci95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width) of the 95% Student-t interval of the mean: t_{0.975, n-1} * s / sqrt(n), s the sample
    std (ddof 1); half-width NaN for a single value (one seed gives no interval). Beyond 31 values t is 1.96."""
    n = len(values)
    mean = statistics.mean(values)
    if n < 2:
        return mean, math.nan
    t = T975[n - 2] if n - 1 <= len(T975) else 1.96
    return mean, t * statistics.stdev(values) / n**0.5


def plus_minus(half: float | str, spec: str = ".3f") -> str:
    """' +- 0.049' for a table cell (the half-width formatted by `spec`), or nothing where there is none (one seed:
    "")."""
    return "" if half == "" else f" +- {half:{spec}}"


def interval(low: float | str, high: float | str) -> str:
    """'[-0.060, +0.032]' for a table cell, or '-' where there is no interval (one seed: "")."""
    return "-" if low == "" else f"[{low:+.3f}, {high:+.3f}]"


def paired_differences(results: list[dict]) -> list[dict]:
    """swap minus each control (outcome, outcome_big, process) on held-out success, paired by seed: the mean and
    95% t interval of the per-seed differences, over the seeds both variants have."""
    rows = []
    for pair in [p for p in PAIRS if any(r["pair"] == p for r in results)]:
        by = {(r["variant"], r["seed"]): r["success"] for r in results if r["pair"] == pair}
        for control in ("outcome", "outcome_big", "process"):
            seeds = sorted(s for v, s in by if v == "swap" and (control, s) in by)
            if not seeds:
                continue
            diffs = [by[("swap", s)] - by[(control, s)] for s in seeds]
            mean, half = t_ci95(diffs)
            rows.append(
                {
                    "pair": pair,
                    "difference": f"swap - {control}",
                    "seeds": len(seeds),
                    "mean": round(mean, 4),
                    "ci95_low": "" if math.isnan(half) else round(mean - half, 4),  # "": one seed, no interval
                    "ci95_high": "" if math.isnan(half) else round(mean + half, 4),
                    "per_seed": " ".join(f"{d:+.3f}" for d in diffs),
                }
            )
    return rows


def read_runs(path: pathlib.Path) -> list[dict]:
    """The runs of an earlier table's learning.csv, as run_one returns them (without their curves)."""

    def value(key: str, text: str):
        if key in ("pair", "variant") or text == "":
            return text
        number = float(text)
        return int(number) if key in ("seed", "env_steps") or key.startswith(("solved_", "games_")) else number

    with open(path, newline="") as f:
        rows = [{k: value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]
    # a per-type column is empty in the runs that have none (WebShop beside ALFWorld): they read back without it
    return [{k: v for k, v in r.items() if v != "" or not k.startswith(("solved_", "games_"))} for r in rows]


# What a rerun of a run must repeat, to the digit, to call it the same run (besides the per-type counts, solved_*)
REPEATED = ("env_steps", "success_start", "success", "score_start", "score")


def compare_runs(results: list[dict], reference: list[dict]) -> tuple[int, list[str]]:
    """--compare: the runs of `results` that `reference` (an earlier table's rows) also has, by (pair, variant, seed).

    Returns (how many of them repeat their row exactly in REPEATED and in the solved_* counts both rows have, one
    line per run compared). A value written to a CSV reads back as the same float, so "the same" is ==, not a
    tolerance.
    """
    earlier = {(r["pair"], r["variant"], r["seed"]): r for r in reference}
    same, lines = 0, []
    for r in results:
        e = earlier.get((r["pair"], r["variant"], r["seed"]))
        if e is None:
            continue
        keys = [*REPEATED, *sorted(k for k in r.keys() & e.keys() if k.startswith("solved_"))]  # older rows: none
        differ = [f"{k} {e.get(k, '')} -> {r.get(k, '')}" for k in keys if r.get(k, "") != e.get(k, "")]
        same += not differ
        what = "the same" if not differ else "differs: " + ", ".join(differ)
        lines.append(f"{r['pair']} {r['variant']} seed {r['seed']}: {what}")
    return same, lines


def read_metrics(path: pathlib.Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pair_env(pair: str) -> str:
    """The env of a pair: the last part of its name (grpo_webshop -> webshop)."""
    return pair.rsplit("_", 1)[1]


# ALFWorld's task types and the short names of the per-type columns (solved_<short>, games_<short>)
TASK_TYPES = {
    "pick_and_place_simple": "simple", "look_at_obj_in_light": "look", "pick_two_obj_and_place": "two",
    "pick_clean_then_place_in_recep": "clean", "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
}  # fmt: skip


@functools.cache
def games_by_type(preset: str, eval_split: str, num_eval_tasks: int, train_pool_size: int) -> dict[str, int]:
    """How many of the evaluation games of the embedded ALFWorld are of each task type (the scripts' seed pools)."""
    sys.path.insert(0, str(ROOT))
    from common import envs as cenvs
    from envs import alfworld

    _, seeds = cenvs.seed_pools("alfworld", train_pool_size, num_eval_tasks, eval_split=eval_split)
    types = [alfworld.generate_layout(s, preset).task_type for s in seeds]
    return {t: types.count(t) for t in TASK_TYPES if t in types}


def solved_by_type(runs_dir: pathlib.Path, first: dict, last: dict) -> dict[str, int]:
    """ALFWorld: held-out games solved per task type at step 0 (solved_<short>_start) and at the last evaluation
    (solved_<short>), and the games of each type (games_<short>): a run's eval/success_<type> times the number of
    its evaluation games of that type, read from the run's config.json. {} where the run logs no task types
    (WebShop) or did not play the embedded ALFWorld."""
    configs = list(runs_dir.glob("*/config.json"))
    args = json.loads(configs[0].read_text())["args"] if len(configs) == 1 else {}
    if args.get("env_backend") != "embedded" or not any(f"eval/success_{t}" in last for t in TASK_TYPES):
        return {}
    games = games_by_type(args["env_preset"], args["eval_split"], args["num_eval_tasks"], args["train_pool_size"])
    out = {}
    for task_type, short in TASK_TYPES.items():
        key = f"eval/success_{task_type}"
        n = games.get(task_type, 0)
        out[f"games_{short}"] = n
        out[f"solved_{short}_start"] = round(first[key] * n) if key in first else ""
        out[f"solved_{short}"] = round(last[key] * n) if key in last else (0 if n == 0 else "")
    return out


def run_script(script: str, flags: list[str], runs_dir: pathlib.Path, what: str) -> float:
    """Run one script into a fresh `runs_dir` (its output in runs_dir.log); the seconds it took. Raises on failure."""
    shutil.rmtree(runs_dir, ignore_errors=True)  # what an interrupted run left
    cmd = [sys.executable, str(ROOT / script), *flags, "--runs-dir", str(runs_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.time()
    log = runs_dir.with_suffix(".log")
    runs_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}); see {log}")
    return time.time() - t0


def eval_rows(runs_dir: pathlib.Path) -> list[dict]:
    """The held-out evaluation rows of the one run in `runs_dir` ([] when there is none)."""
    paths = list(runs_dir.glob("*/metrics.jsonl"))
    return [r for r in read_metrics(paths[0]) if "eval/success_rate" in r] if len(paths) == 1 else []


def initial_eval(
    env_name: str,
    seed: int,
    eval_tasks: int,
    out: pathlib.Path,
    eval_split: str = "held-out",
    script_flags: tuple[str, ...] = (),
    pair: str | None = None,
) -> dict:
    """The step-0 evaluation row of (env, seed)'s initial model: one --eval-only run, reused when it is there.
    eval_split "held-out" is each script's default split; "valid" training seeds from common.envs.VALID_START on.
    script_flags (the table's --script-flags) can change the start itself (--env-preset, --max-steps, --model-name,
    ...): with them the evaluation runs with them, by `pair`'s script, in a folder named by a hash of the flags."""
    suffix = "" if eval_split == "held-out" else f"__{eval_split}"
    script, extra = PAIRS[pair] if script_flags and pair else (INITIAL_EVAL[env_name], [])
    if script_flags:
        suffix += "__flags" + hashlib.sha1(shlex.join(script_flags).encode()).hexdigest()[:8]
    runs_dir = out / "runs" / f"initial__{env_name}__{seed}__n{eval_tasks}{suffix}"
    if not eval_rows(runs_dir):
        flags = [*extra, "--eval-only", "--seed", str(seed), "--num-eval-tasks", str(eval_tasks)]
        flags += ["--exp-name", "initial", *split_flags(eval_split), *script_flags]
        run_script(script, flags, runs_dir, f"step-0 evaluation of {env_name} seed {seed}")
    return eval_rows(runs_dir)[0]


def initial_evals(
    pairs_seeds: list[tuple[str, int]],
    eval_tasks: int,
    out: pathlib.Path,
    eval_split: str,
    jobs: int,
    script_flags: tuple[str, ...] = (),
) -> dict[tuple[str, int], dict]:
    """initial_eval of the (env, seed) of every (pair, seed), `jobs` at a time, each once: run before the runs or
    evaluations that share a start, which would otherwise evaluate it into the same folder at the same time. With
    script_flags, by the script of the env's first pair (in PAIRS' order) among them."""
    starts = sorted({(pair_env(pair), seed) for pair, seed in pairs_seeds})
    pair_of = {}
    for pair in sorted({p for p, _ in pairs_seeds}, key=list(PAIRS).index):
        pair_of.setdefault(pair_env(pair), pair)

    def evaluate(env_seed: tuple[str, int]) -> dict:
        env, seed = env_seed
        return initial_eval(env, seed, eval_tasks, out, eval_split, script_flags, pair_of[env])

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(zip(starts, pool.map(evaluate, starts)))


def split_flags(eval_split: str) -> list[str]:
    """The scripts' flags for the benchmark's --eval-split: none for the held-out default."""
    return [] if eval_split == "held-out" else ["--eval-split", eval_split]


def run_one(
    pair: str,
    variant: str,
    seed: int,
    budget: int,
    eval_tasks: int,
    eval_every: int,
    out: pathlib.Path,
    initial: dict,
    script_flags: tuple[str, ...] = (),
    eval_split: str = "held-out",
) -> dict:
    """One training run of `pair`/`variant`/`seed` to `budget` env steps (reused when it is already in `out`).

    script_flags go to the script after the benchmark's own (a later flag wins, so they can change any default)."""
    script, extra = PAIRS[pair]
    runs_dir = out / "runs" / f"{pair}__{variant}__{seed}"
    done = finished_run(runs_dir, budget, initial)
    if done is not None:  # a rerun of an interrupted benchmark reuses the runs that reached the budget
        return done
    flags = [
        *extra,
        *variant_flags(variant),
        "--seed",
        str(seed),
        "--total-env-steps",
        str(budget),
        "--num-iterations",
        "100000",
        "--eval-every",
        str(eval_every),
        "--num-eval-tasks",
        str(eval_tasks),
        "--no-eval-at-start",  # the shared initial_eval
        "--exp-name",
        f"{pair}_{variant}",
        *split_flags(eval_split),
        *script_flags,
    ]
    seconds = run_script(script, flags, runs_dir, f"{pair}/{variant}/seed {seed}")
    result = finished_run(runs_dir, budget, initial)
    if result is None:
        raise RuntimeError(f"{pair}/{variant}/seed {seed} ended before {budget} env steps; see {runs_dir}.log")
    result["seconds"] = round(seconds, 1)
    (runs_dir / "seconds.txt").write_text(f"{seconds:.1f}\n")
    return result


def final_eval(
    result: dict,
    eval_tasks: int,
    out: pathlib.Path,
    start: dict,
    script_flags: tuple[str, ...] = (),
    eval_split: str = "held-out",
) -> dict:
    """A finished run's final policy measured again, on the first `eval_tasks` held-out seeds: the same table's
    row for it, from one --eval-only run of its last checkpoint (reused when it is there) and `start`, the
    initial_eval row of its (env, seed) on as many seeds. More games narrow the evaluation's share of the spread
    between seeds; nothing is trained or chosen on them."""
    pair, variant, seed = result["pair"], result["variant"], result["seed"]
    script, extra = PAIRS[pair]
    name = f"{pair}__{variant}__{seed}"
    runs_dir = out / "runs" / f"final__{name}__n{eval_tasks}"
    if not eval_rows(runs_dir):
        runs = [c.parent for c in (out / "runs" / name).glob("*/checkpoints")]
        if len(runs) != 1:
            raise RuntimeError(f"{name}: {len(runs)} run folders with checkpoints under {out / 'runs' / name}")
        (run,) = runs
        flags = [*extra, "--eval-only", "--resume", str(run), "--num-eval-tasks", str(eval_tasks)]
        flags += ["--exp-name", "final", *split_flags(eval_split), *script_flags]
        run_script(script, flags, runs_dir, f"final evaluation of {name} on {eval_tasks} seeds")
    last = eval_rows(runs_dir)[0]
    return {
        "pair": pair,
        "variant": variant,
        "seed": seed,
        "env_steps": result["env_steps"],
        "success_start": start["eval/success_rate"],
        "success": last["eval/success_rate"],
        "score_start": start.get("eval/score", ""),
        "score": last.get("eval/score", ""),
        **solved_by_type(runs_dir, start, last),
    }


def finished_run(runs_dir: pathlib.Path, budget: int, initial: dict | None = None) -> dict | None:
    """The result of the run in `runs_dir` if its last evaluation reached `budget` env steps, else None.

    pair, variant and seed come from the folder name; held-out success/score at step 0 (the run's own evaluation
    at step 0 if it has one, else `initial`, the shared one) and at the last evaluation; the sampled success of
    the policy's training rollouts over the first and the last 10 iterations, and over every iteration beside agent
    B's on the same tasks (swap runs; "" in the others); seconds from seconds.txt ("" when the run was written by
    an older version of this script).
    """
    evals = eval_rows(runs_dir)
    if not evals or evals[-1]["env_steps"] < budget:
        return None
    if evals[0]["env_steps"] > 0:
        if initial is None:
            return None
        evals = [initial] + evals
    rows = read_metrics(next(runs_dir.glob("*/metrics.jsonl")))
    train = [r["train/success_rate"] for r in rows if "train/success_rate" in r]  # sampled, the policy's own
    explorer = [r["explorer/success_rate"] for r in rows if r.get("explorer/success_rate") is not None]
    pair, variant, seed = runs_dir.name.split("__")
    first, last = evals[0], evals[-1]
    seconds = runs_dir / "seconds.txt"
    return {
        "pair": pair,
        "variant": variant,
        "seed": int(seed),
        "env_steps": last["env_steps"],
        "success_start": first["eval/success_rate"],
        "success": last["eval/success_rate"],
        "score_start": first.get("eval/score", ""),
        "score": last.get("eval/score", ""),
        "train_success_first10": _rounded_mean(train[:10]),
        "train_success_last10": _rounded_mean(train[-10:]),
        "train_success_all": _rounded_mean(train),
        "explorer_success_all": _rounded_mean(explorer),
        "seconds": float(seconds.read_text()) if seconds.is_file() else "",
        **solved_by_type(runs_dir, first, last),
        "curve": [(r["env_steps"], r["eval/success_rate"]) for r in evals],
    }


def _rounded_mean(values: list[float]):
    """The mean to 4 decimals, or "" (an empty CSV cell) when there is nothing to average."""
    return round(statistics.mean(values), 4) if values else ""


def _mean_of(rows: list[dict], key: str):
    return _rounded_mean([r[key] for r in rows if r.get(key, "") != ""])


def summarise(results: list[dict]) -> list[dict]:
    rows = []
    keys = sorted({(r["pair"], r["variant"]) for r in results}, key=lambda k: (list(PAIRS).index(k[0]), k[1]))
    for pair, variant in keys:
        rs = [r for r in results if r["pair"] == pair and r["variant"] == variant]
        succ = [r["success"] for r in rs]
        start = [r["success_start"] for r in rs]
        scores = [r["score"] for r in rs if r["score"] != ""]
        mean, half = t_ci95(succ)
        rows.append(
            {
                "pair": pair,
                "variant": variant,
                "seeds": len(rs),
                "success_start_mean": round(statistics.mean(start), 4),
                "success_mean": round(mean, 4),
                "success_ci95": "" if math.isnan(half) else round(half, 4),  # "": one seed, no interval
                "train_success_first10_mean": _mean_of(rs, "train_success_first10"),
                "train_success_last10_mean": _mean_of(rs, "train_success_last10"),
                "train_success_all_mean": _mean_of(rs, "train_success_all"),
                "explorer_success_all_mean": _mean_of(rs, "explorer_success_all"),
                "success_std": round(statistics.stdev(succ), 4) if len(succ) > 1 else "",
                "score_mean": round(statistics.mean(scores), 2) if scores else "",
                "score_std": round(statistics.stdev(scores), 2) if len(scores) > 1 else "",
                "env_steps_mean": round(statistics.mean(r["env_steps"] for r in rs)),
            }
        )
    return rows


def write_tables(results: list[dict], out: pathlib.Path, suffix: str) -> list[dict]:
    """learning{suffix}.csv (one row per run), learning{suffix}_summary.csv and learning{suffix}_paired.csv;
    returns the summary rows."""
    # the columns of every run, in order of first appearance (ALFWorld runs add per-type ones; "" where absent)
    columns = list(dict.fromkeys(k for r in results for k in r if k != "curve"))
    with open(out / f"learning{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows({k: v for k, v in r.items() if k != "curve"} for r in results)
    summary = summarise(results)
    with open(out / f"learning{suffix}_summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    paired = paired_differences(results)
    if paired:
        with open(out / f"learning{suffix}_paired.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(paired[0]))
            w.writeheader()
            w.writerows(paired)
    return summary


def type_table(results: list[dict]) -> list[str]:
    """Markdown lines: held-out games solved per task type, at step 0 and after the budget per seed, for each
    pair and variant whose runs have per-type counts (ALFWorld); [] when none has."""
    lines = []
    for pair in [p for p in PAIRS if any(r["pair"] == p and "games_simple" in r for r in results)]:
        rs = [r for r in results if r["pair"] == pair and "games_simple" in r]
        games = {short: rs[0][f"games_{short}"] for short in TASK_TYPES.values()}
        header = " | ".join(f"{short} ({n})" for short, n in games.items())
        lines += [f"\n| {pair}: games solved | seeds | {header} |", "|---|---|" + "---|" * len(games)]
        starts = {short: sorted({r[f"solved_{short}_start"] for r in rs} - {""}) for short in games}
        cells = " | ".join(" ".join(map(str, starts[short])) or "-" for short in games)
        lines.append(f"| step 0 | {sorted({r['seed'] for r in rs})} | {cells} |")
        for variant in sorted({r["variant"] for r in rs}):
            vs = sorted((r for r in rs if r["variant"] == variant), key=lambda r: r["seed"])
            cells = " | ".join(" ".join(str(r[f"solved_{short}"]) for r in vs) for short in games)
            lines.append(f"| {variant} | {[r['seed'] for r in vs]} | {cells} |")
    return lines


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [p for p in PAIRS if any(r["pair"] == p for r in results)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 3.6), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        for variant in sorted({r["variant"] for r in results if r["pair"] == pair}):
            rs = [r for r in results if r["pair"] == pair and r["variant"] == variant]
            # Average the seeds' curves on the eval points they share by index.
            n = min(len(r["curve"]) for r in rs)
            xs = [statistics.mean(r["curve"][i][0] for r in rs) for i in range(n)]
            ys = [statistics.mean(r["curve"][i][1] for r in rs) for i in range(n)]
            ax.plot(xs, ys, marker="o", ms=3, label=variant)
        ax.set_title(pair)
        ax.set_xlabel("environment steps (explorer included)")
        ax.set_ylabel("held-out success")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=list(PAIRS), action="append", help="run only this pair (repeatable)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="short check (4.5 minutes on 2 cores, docs/benchmarks.md): 1 seed, 800 env steps, 32 held-out seeds, two pairs",
    )
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=1, help="the seeds are first-seed .. first-seed + seeds - 1")
    p.add_argument(
        "--add-runs",
        type=pathlib.Path,
        action="append",
        default=[],
        help="an earlier table's learning.csv (other seeds of the same setting, repeatable): its runs join this "
        "table's CSVs and printed tables; the PNG shows this command's runs only",
    )
    p.add_argument(
        "--compare",
        type=pathlib.Path,
        action="append",
        default=[],
        help="an earlier table's learning.csv (repeatable): after the runs, say which of them repeat that table's "
        "row of the same pair, variant and seed to the digit (env steps, success and score at step 0 and at the "
        "end, games solved per type): the check that another machine reproduces a committed table",
    )
    p.add_argument(
        "--variant",
        dest="variants",
        choices=[*MAIN_VARIANTS, *SECONDARY_VARIANTS],
        action="append",
        help="run only this variant (repeatable; a probe, not the table)",
    )
    p.add_argument("--secondary-seeds", type=int, default=2, help="seeds of the secondary variants")
    p.add_argument(
        "--total-env-steps",
        type=int,
        default=None,
        help="budget per run, explorer steps included (default: 4,000 on WebShop, 12,000 on ALFWorld)",
    )
    p.add_argument(
        "--num-eval-tasks", type=int, default=200, help="held-out seeds per evaluation (200: the README's tables)"
    )
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument(
        "--final-eval-tasks",
        type=int,
        default=0,
        help="also evaluate every run's final checkpoint (and the start) on this many held-out seeds, after the "
        "runs, and write the tables on them as learning_final<N>*.csv (0: no)",
    )
    p.add_argument(
        "--eval-split",
        choices=["held-out", "valid"],
        default="held-out",
        help="`held-out`: the test goals (WebShop) / valid_unseen (ALFWorld), reported once; `valid`: training "
        "seeds from 2,048 on, never trained on or imitated, where defaults are chosen (give it its own --out)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one CPU thread each)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--script-flags",
        default="",
        help="extra flags for every training run and evaluation, the step-0 one included, e.g. '--kl-coef 0.1' (give "
        "such a table its own --out)",
    )
    a = p.parse_args()
    script_flags = tuple(shlex.split(a.script_flags))
    pairs = a.only or list(PAIRS)
    seeds, budget, eval_tasks, eval_every = a.seeds, a.total_env_steps, a.num_eval_tasks, a.eval_every
    if a.quick:
        pairs = a.only or ["grpo_webshop", "ppo_alfworld"]
        seeds, budget, eval_tasks, eval_every = 1, 800, 32, 5
    budgets = {env: budget or b for env, b in ENV_BUDGET.items()}  # env -> env steps per run
    a.out.mkdir(parents=True, exist_ok=True)
    jobs = jobs_for(pairs, seeds, 0 if a.quick else a.secondary_seeds, a.variants, a.first_seed)
    earlier = [r for path in a.add_runs for r in read_runs(path)]
    if {(r["pair"], r["variant"], r["seed"]) for r in earlier} & set(jobs):
        sys.exit("--add-runs: a run of those tables is also one of this command's (pair, variant, seed)")
    goals = "validation" if a.eval_split == "valid" else "held-out"
    shown = ", ".join(f"{budgets[e]} on {e}" for e in sorted({pair_env(p) for p in pairs}))
    print(f"{len(jobs)} runs, budget {shown} env steps each, {eval_tasks} {goals} seeds, {a.jobs} in parallel")
    t0 = time.time()
    failures: list[str] = []
    results: list[dict] = []
    suffix = "_quick" if a.quick else ""
    lock = threading.Lock()

    # Step 0 of every (env, seed) first, shared by the runs on it (a failure here stops the table: nothing to share)
    initial = initial_evals([(pair, s) for pair, _, s in jobs], eval_tasks, a.out, a.eval_split, a.jobs, script_flags)
    print(f"step-0 evaluations of {len(initial)} (env, seed) models: {time.time() - t0:.0f} s")

    def attempt(job):
        # One failed run is reported at the end; it does not throw away the hours of runs around it. The CSVs
        # are rewritten after every run, so an interrupted table keeps what it measured (and a rerun of the
        # same command reuses those runs).
        try:
            env = pair_env(job[0])
            start = initial[(env, job[2])]
            r = run_one(*job, budgets[env], eval_tasks, eval_every, a.out, start, script_flags, a.eval_split)
        except Exception as e:  # noqa: BLE001 - the message names the run and its log
            failures.append(str(e))
            print(f"FAILED: {e}", flush=True)
            return
        with lock:
            results.append(r)
            write_tables(earlier + results, a.out, suffix)
        print(f"{r['pair']:15s} {r['variant']:12s} seed {r['seed']}: success {r['success']:.3f} ({r['seconds']} s)")

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        list(pool.map(attempt, jobs))
    if not results:
        sys.exit("every run failed:\n" + "\n".join(failures))
    results.sort(key=lambda r: jobs.index((r["pair"], r["variant"], r["seed"])))
    plot(results, a.out / f"learning{suffix}.png")
    results = sorted(earlier + results, key=lambda r: (r["seed"], list(PAIRS).index(r["pair"])))
    summary = write_tables(results, a.out, suffix)
    print_tables(summary, results, goals)
    mine = [r for r in results if r not in earlier]  # --add-runs: their checkpoints are in another --out
    if a.compare:
        same, lines = compare_runs(mine, [r for path in a.compare for r in read_runs(path)])
        print(f"\n--compare: {same} of {len(lines)} runs found in {', '.join(map(str, a.compare))} repeat their row")
        print("\n".join(lines))
    if a.final_eval_tasks:
        print(f"\nThe final policies on the first {a.final_eval_tasks} {goals} seeds (--final-eval-tasks):")
        n = a.final_eval_tasks
        initial = initial_evals([(r["pair"], r["seed"]) for r in mine], n, a.out, a.eval_split, a.jobs, script_flags)
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            finals = list(pool.map(
                lambda r: final_eval(r, n, a.out, initial[(pair_env(r["pair"]), r["seed"])], script_flags,
                                     a.eval_split), mine,
            ))  # fmt: skip
        print_tables(write_tables(finals, a.out, f"{suffix}_final{n}"), finals, goals)
    print(f"\ntotal {time.time() - t0:.0f} s; written to {a.out}")
    if failures:
        sys.exit(f"{len(failures)} of {len(jobs)} runs failed (left out of the table):\n" + "\n".join(failures))


def print_tables(summary: list[dict], results: list[dict], goals: str) -> None:
    """The summary, the paired differences and (ALFWorld) the games solved per task type, as markdown."""
    print(
        f"\n| pair | variant | {goals} success at step 0 | after the budget (mean +- 95% interval) | WebShop score "
        "| sampled training success, first -> last 10 iterations | policy / agent B sampled, every iteration "
        "| env steps | seeds |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        score = "-" if s["score_mean"] == "" else f"{s['score_mean']}{plus_minus(s['score_std'], '')}"
        first, last, policy, b = (
            s[k] if s[k] != "" else "-"
            for k in ("train_success_first10_mean", "train_success_last10_mean", "train_success_all_mean",
                      "explorer_success_all_mean")
        )  # fmt: skip
        print(
            f"| {s['pair']} | {s['variant']} | {s['success_start_mean']:.3f} | {s['success_mean']:.3f}"
            f"{plus_minus(s['success_ci95'])} | {score} | {first} -> {last} | {policy} / {b} | {s['env_steps_mean']} "
            f"| {s['seeds']} |"
        )
    print("\n| pair | paired by seed | mean | 95% interval | per seed |\n|---|---|---|---|---|")
    for d in paired_differences(results):
        print(
            f"| {d['pair']} | {d['difference']} | {d['mean']:+.3f} | {interval(d['ci95_low'], d['ci95_high'])} "
            f"| {d['per_seed']} |"
        )
    for line in type_table(results):
        print(line)


if __name__ == "__main__":
    main()
