"""benchmarks/learning.py: reading finished runs, reusing them on a rerun, and the tables (no training here)."""

import csv
import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("learning_benchmark", ROOT / "benchmarks" / "learning.py")
learning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning)


def write_run(
    out, name, evals: list[tuple[int, float, float]], seconds: float | None = None, train=(0.1,), explorer=None
):
    """A run folder as the scripts write it: training rows (sampled success `train`, and agent B's `explorer` on
    the same iterations when given), then the evaluations."""
    run = out / "runs" / name
    (run / "exp_1").mkdir(parents=True)
    rows = [{"iteration": k + 1, "env_steps": k, "train/success_rate": v} for k, v in enumerate(train)]
    for row, b in zip(rows, explorer or ()):
        row["explorer/success_rate"] = b
    for steps, success, score in evals:
        rows.append({"env_steps": steps, "eval/success_rate": success, "eval/score": score})
    (run / "exp_1" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if seconds is not None:
        (run / "seconds.txt").write_text(f"{seconds}\n")
    return run


def test_finished_run_reads_the_first_and_last_evaluation(tmp_path):
    evals = [(0, 0.25, 70.0), (3000, 0.5, 75.0), (6010, 0.75, 80.0)]
    run = write_run(tmp_path, "grpo_webshop__swap__2", evals, 12.5, train=[k / 20 for k in range(20)])
    r = learning.finished_run(run, 6000)
    assert (r["pair"], r["variant"], r["seed"]) == ("grpo_webshop", "swap", 2)
    assert (r["success_start"], r["success"], r["score_start"], r["score"]) == (0.25, 0.75, 70.0, 80.0)
    assert r["env_steps"] == 6010 and r["seconds"] == 12.5
    assert r["curve"] == [(0, 0.25), (3000, 0.5), (6010, 0.75)]
    assert r["train_success_first10"] == pytest.approx(0.225) and r["train_success_last10"] == pytest.approx(0.725)
    assert r["train_success_all"] == pytest.approx(0.475) and r["explorer_success_all"] == ""  # no agent B here
    # Short of the budget, or no metrics at all: not finished, so a rerun trains it again.
    assert learning.finished_run(run, 7000) is None
    assert learning.finished_run(tmp_path / "runs" / "ppo_alfworld__outcome__1", 10) is None


def test_explorer_and_policy_success_on_the_same_iterations(tmp_path):
    """A swap run logs agent B's sampled success beside the policy's; both are averaged over every iteration, and
    an iteration whose explorer value is null (written as None) does not count."""
    run = write_run(
        tmp_path, "ppo_alfworld__swap__1", [(0, 0.1, 0.0), (100, 0.2, 0.0)], train=[0.0, 0.25, 0.5],
        explorer=[0.5, None, 0.25],
    )  # fmt: skip
    r = learning.finished_run(run, 100)
    assert r["train_success_all"] == pytest.approx(0.25) and r["explorer_success_all"] == pytest.approx(0.375)
    other = learning.finished_run(write_run(tmp_path, "ppo_alfworld__swap__2", [(0, 0.1, 0.0), (100, 0.3, 0.0)],
                                            train=[0.5], explorer=[0.125]), 100)  # fmt: skip
    (row,) = learning.summarise([r, other])
    assert row["train_success_all_mean"] == pytest.approx(0.375)
    assert row["explorer_success_all_mean"] == pytest.approx(0.25)


def test_rerun_reuses_finished_runs_without_training(tmp_path, monkeypatch):
    write_run(tmp_path, "ppo_alfworld__outcome__1", [(0, 0.1, float("nan")), (500, 0.3, float("nan"))])

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(learning.subprocess, "run", no_training)
    r = learning.run_one("ppo_alfworld", "outcome", 1, 500, 10, 5, tmp_path, initial=None)
    assert r["success"] == 0.3 and r["seconds"] == ""


def test_shared_step0_evaluation_starts_runs_without_their_own(tmp_path, monkeypatch):
    """Runs made with --no-eval-at-start take step 0 from the shared --eval-only run of their (env, seed)."""
    run = write_run(tmp_path, "gigpo_webshop__swap__3", [(2000, 0.4, 71.0), (4010, 0.5, 74.0)])
    assert learning.finished_run(run, 4000) is None  # no step 0 to compare with
    initial = {"iteration": 0, "env_steps": 0, "eval/success_rate": 0.25, "eval/score": 66.0}
    r = learning.finished_run(run, 4000, initial)
    assert (r["success_start"], r["score_start"], r["success"]) == (0.25, 66.0, 0.5)
    assert r["curve"] == [(0, 0.25), (2000, 0.4), (4010, 0.5)]
    # the shared evaluation is one --eval-only run per (env, seed), reused on a rerun; pairs name their env last
    assert learning.pair_env("gigpo_webshop") == "webshop" and learning.pair_env("ppo_alfworld") == "alfworld"
    calls = []

    def fake_script(script, flags, runs_dir, what):
        calls.append((script, flags))
        write_run(runs_dir.parent.parent, runs_dir.name, [(0, 0.3, 60.0)])
        return 1.0

    monkeypatch.setattr(learning, "run_script", fake_script)
    for _ in range(2):
        row = learning.initial_eval("webshop", 3, 100, tmp_path)
        assert row["eval/success_rate"] == 0.3 and row["env_steps"] == 0
    ((script, flags),) = calls
    assert script == "rspo_grpo_webshop.py" and "--eval-only" in flags and flags[flags.index("--seed") + 1] == "3"


def test_tables_summarise_over_seeds(tmp_path):
    results = [
        learning.finished_run(write_run(tmp_path, f"grpo_webshop__outcome__{s}", [(0, a, 60.0), (100, b, sc)]), 100)
        for s, a, b, sc in [(1, 0.2, 0.3, 70.0), (2, 0.4, 0.5, 80.0)]
    ]
    summary = learning.write_tables(results, tmp_path, "")
    (row,) = summary
    assert row["seeds"] == 2 and row["success_start_mean"] == pytest.approx(0.3)
    assert row["success_mean"] == pytest.approx(0.4) and row["success_std"] == pytest.approx(0.1414, abs=1e-4)
    assert row["score_mean"] == 75.0 and row["score_std"] == pytest.approx(7.07, abs=0.01)
    with open(tmp_path / "learning.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["seed"] for r in rows] == ["1", "2"] and "curve" not in rows[0]
    # --add-runs: an earlier table's runs read back as they were written (without their curves), so the tables
    # over both sets of seeds are the ones over all the runs at once
    back = learning.read_runs(tmp_path / "learning.csv")
    assert back == [{k: v for k, v in r.items() if k != "curve"} for r in results]
    assert learning.summarise(back) == summary


def test_compare_names_the_runs_that_repeat_an_earlier_table_and_what_differs(tmp_path):
    """--compare: a run is the same only if every repeated figure is equal to the digit (no tolerance: a CSV
    reads back the float it was written from); a run the earlier table does not have is not compared."""

    def runs(out, finals):
        return [
            learning.finished_run(write_run(out, f"grpo_webshop__swap__{s}", [(0, 0.07, 50.2), (4000, b, sc)]), 4000)
            for s, b, sc in finals
        ]

    learning.write_tables(runs(tmp_path / "earlier", [(1, 0.17, 62.1), (2, 0.28, 62.1)]), tmp_path, "")
    reference = learning.read_runs(tmp_path / "learning.csv")
    now = runs(tmp_path / "now", [(1, 0.17, 62.1), (2, 0.275, 62.1000001), (3, 0.2, 60.0)])
    same, lines = learning.compare_runs(now, reference)
    assert same == 1
    assert lines == [
        "grpo_webshop swap seed 1: the same",
        "grpo_webshop swap seed 2: differs: success 0.28 -> 0.275, score 62.1 -> 62.1000001",
    ]
    # ALFWorld: the games solved per type count where both rows have them (rows written before they were: not)
    row = {"pair": "ppo_alfworld", "variant": "swap", "seed": 1, "env_steps": 12071, "success_start": 0.135}
    row |= {"success": 0.16, "score_start": "", "score": "", "solved_look": 8, "solved_heat_start": 0}
    rerun = row | {"env_steps": 12069, "success": 0.165, "solved_look": 9, "solved_heat_start": 1, "solved_two": 2}
    assert learning.compare_runs([rerun], [row]) == (
        0,
        ["ppo_alfworld swap seed 1: differs: env_steps 12071 -> 12069, success 0.16 -> 0.165, solved_heat_start 0 -> 1, "
         "solved_look 8 -> 9"],
    )  # fmt: skip
    older = {k: v for k, v in row.items() if not k.startswith("solved_")}
    assert learning.compare_runs([row], [older]) == (1, ["ppo_alfworld swap seed 1: the same"])


def test_later_seeds_extend_an_earlier_table():
    """--first-seed 6 --seeds 5: seeds 6-10 of every variant, secondary variants on the first of them."""
    jobs = learning.jobs_for(["grpo_webshop"], seeds=5, secondary_seeds=1, first_seed=6)
    assert sorted({s for _, _, s in jobs}) == [6, 7, 8, 9, 10]
    assert {s for _, v, s in jobs if v not in learning.MAIN_VARIANTS} == {6}
    assert len([j for j in jobs if j[1] in learning.MAIN_VARIANTS]) == 4 * 5


def test_step0_evaluation_takes_the_script_flags_that_can_change_the_start(tmp_path, monkeypatch):
    """A table's --script-flags (here the turn limit) reach its step-0 evaluation, run by the env's first pair's
    script, in a folder of its own: a flagless table's start is neither reused for it nor overwritten by it."""
    calls = []

    def fake_script(script, flags, runs_dir, what):
        calls.append((script, flags, runs_dir.name))
        write_run(runs_dir.parent.parent, runs_dir.name, [(0, 0.1 * len(calls), 60.0)])
        return 1.0

    monkeypatch.setattr(learning, "run_script", fake_script)
    plain = learning.initial_evals([("gigpo_webshop", 2)], 50, tmp_path, "valid", 1)
    flagged = learning.initial_evals([("gigpo_webshop", 2), ("grpo_webshop", 2)], 50, tmp_path, "valid", 1,
                                     ("--max-steps", "10"))  # fmt: skip
    again = learning.initial_evals([("gigpo_webshop", 2)], 50, tmp_path, "valid", 1, ("--max-steps", "10"))
    assert [row["eval/success_rate"] for row in (plain[("webshop", 2)], flagged[("webshop", 2)])] == [0.1, 0.2]
    assert again[("webshop", 2)]["eval/success_rate"] == 0.2  # reused, not run a third time
    (plain_call, flagged_call) = calls
    assert plain_call[0] == "rspo_grpo_webshop.py" and "--max-steps" not in plain_call[1]
    script, flags, folder = flagged_call
    assert script == "rspo_grpo_webshop.py" and flags[-2:] == ["--max-steps", "10"] and "--eval-only" in flags
    assert folder != plain_call[2] and folder.startswith(plain_call[2] + "__flags")
    # with only a GiGPO pair, GiGPO's script (with its --env) evaluates the flagged start
    learning.initial_evals([("gigpo_webshop", 4)], 50, tmp_path, "valid", 1, ("--max-steps", "10"))
    assert calls[-1][0] == "rspo_gigpo.py" and calls[-1][1][:2] == ["--env", "webshop"]


def test_script_flags_follow_the_benchmark_flags(tmp_path, monkeypatch):
    """--script-flags reach the training run after the benchmark's own flags, so they override its defaults."""
    calls = []

    def fake_script(script, flags, runs_dir, what):
        calls.append((script, flags))
        write_run(runs_dir.parent.parent, runs_dir.name, [(0, 0.2, 60.0), (120, 0.3, 65.0)])
        return 2.0

    monkeypatch.setattr(learning, "run_script", fake_script)
    r = learning.run_one("gigpo_webshop", "swap", 2, 100, 10, 5, tmp_path, None, ("--kl-coef", "0.1"))
    ((script, flags),) = calls
    assert script == "rspo_gigpo.py" and flags[:2] == ["--env", "webshop"]
    assert flags[-2:] == ["--kl-coef", "0.1"] and flags[flags.index("--reward-mode") + 1] == "swap"
    assert r["success"] == 0.3 and r["seconds"] == 2.0


def test_t_interval_hand_computed():
    # values 0.1, 0.3, 0.5: mean 0.3, s = 0.2, t_{0.975,2} = 4.303 -> half-width 4.303 * 0.2 / sqrt(3) = 0.49687
    mean, half = learning.t_ci95([0.1, 0.3, 0.5])
    assert mean == pytest.approx(0.3) and half == pytest.approx(0.49687, abs=1e-5)
    mean, half = learning.t_ci95([0.4])
    assert mean == 0.4 and math.isnan(half)  # one value: no interval
    # five seeds: t_{0.975,4} = 2.776
    mean, half = learning.t_ci95([0.0, 0.1, 0.2, 0.3, 0.4])
    assert mean == pytest.approx(0.2) and half == pytest.approx(2.776 * 0.158114 / 5**0.5, abs=1e-5)


def test_paired_differences_by_seed_hand_computed(tmp_path):
    """swap - control per seed: seeds 1, 2, 3 give +0.10, +0.20, +0.00 against outcome: mean 0.1, s = 0.1,
    half-width 4.303 * 0.1 / sqrt(3) = 0.24843; a control run missing for a seed leaves that seed out."""
    success = {
        ("swap", 1): 0.5, ("swap", 2): 0.6, ("swap", 3): 0.3,
        ("outcome", 1): 0.4, ("outcome", 2): 0.4, ("outcome", 3): 0.3,
        ("process", 1): 0.6, ("process", 2): 0.5,
    }  # fmt: skip
    results = [
        learning.finished_run(write_run(tmp_path, f"grpo_webshop__{v}__{s}", [(0, 0.2, 60.0), (100, x, 70.0)]), 100)
        for (v, s), x in success.items()
    ]
    rows = {r["difference"]: r for r in learning.paired_differences(results)}
    assert set(rows) == {"swap - outcome", "swap - process"}  # no outcome_big run: no row
    d = rows["swap - outcome"]
    assert d["seeds"] == 3 and d["mean"] == pytest.approx(0.1)
    assert d["ci95_low"] == pytest.approx(0.1 - 0.24843, abs=1e-4) and d["ci95_high"] == pytest.approx(
        0.34843, abs=1e-4
    )
    assert d["per_seed"] == "+0.100 +0.200 +0.000"
    p = rows["swap - process"]
    assert p["seeds"] == 2 and p["mean"] == pytest.approx(0.0) and p["per_seed"] == "-0.100 +0.100"
    learning.write_tables(results, tmp_path, "")
    with open(tmp_path / "learning_paired.csv") as f:
        assert [r["difference"] for r in csv.DictReader(f)] == ["swap - outcome", "swap - process"]


def test_one_seed_gives_no_interval(tmp_path, capsys):
    """One seed has a mean and no 95% interval or std: blank in the CSVs and not printed as a zero-width interval
    (a --quick table printed '0.156 +- 0.000' and '[-0.031, -0.031]')."""
    results = [
        learning.finished_run(write_run(tmp_path, f"grpo_webshop__{v}__1", [(0, 0.2, 60.0), (100, x, 70.0)]), 100)
        for v, x in (("swap", 0.5), ("outcome", 0.4))
    ]
    summary = learning.write_tables(results, tmp_path, "")
    assert [
        (s["variant"], s["success_mean"], s["success_ci95"], s["success_std"], s["score_std"]) for s in summary
    ] == [
        ("outcome", 0.4, "", "", ""),
        ("swap", 0.5, "", "", ""),
    ]
    (d,) = learning.paired_differences(results)
    assert (d["mean"], d["ci95_low"], d["ci95_high"], d["per_seed"]) == (0.1, "", "", "+0.100")
    with open(tmp_path / "learning_paired.csv") as f:
        (row,) = csv.DictReader(f)
    assert (row["ci95_low"], row["ci95_high"]) == ("", "")
    learning.print_tables(summary, results, "held-out")
    out = capsys.readouterr().out
    assert "| grpo_webshop | swap | 0.200 | 0.500 | 70.0 |" in out
    assert "| grpo_webshop | swap - outcome | +0.100 | - | +0.100 |" in out
    assert "+- 0.000" not in out and "+- 0.0 " not in out


def test_jobs_main_variants_everywhere_secondary_on_one_pair():
    jobs = learning.jobs_for(["grpo_webshop", "ppo_alfworld"], seeds=5, secondary_seeds=3)
    main = [j for j in jobs if j[1] in learning.MAIN_VARIANTS]
    assert len(main) == 2 * 4 * 5
    secondary = [j for j in jobs if j[1] not in learning.MAIN_VARIANTS]
    assert {j[0] for j in secondary} == {"grpo_webshop"} and len(secondary) == 3 * 3
    flags = learning.variant_flags("process")
    assert flags[flags.index("--process-reward") + 1] == "misaligned"
    aligned = learning.variant_flags("process_aligned")
    assert aligned[len(aligned) - 1 - aligned[::-1].index("--process-reward") + 1] == "aligned"  # the last one wins
    only = learning.jobs_for(
        ["grpo_webshop", "ppo_alfworld"], seeds=2, secondary_seeds=2, variants=["swap", "swap_none"]
    )
    assert only == [(p, "swap", s) for s in (1, 2) for p in ("grpo_webshop", "ppo_alfworld")] + [
        ("grpo_webshop", "swap_none", s) for s in (1, 2)
    ]
    one_step = learning.variant_flags("swap_one_step")
    assert one_step[len(one_step) - 1 - one_step[::-1].index("--explorer") + 1] == "one_step"


def test_alfworld_runs_count_the_games_solved_per_task_type(tmp_path):
    """An ALFWorld run's last eval/success_<type> times the games of that type among its evaluation seeds (from
    its config.json) gives solved_<type>; the step-0 counts come from the start's evaluation. A table with WebShop
    runs first still gets every column (empty in the WebShop rows), and reads back as it was written."""
    from common import envs as cenvs
    from envs import alfworld

    config = {"env_backend": "embedded", "env_preset": "small", "eval_split": "valid_unseen", "num_eval_tasks": 12,
              "train_pool_size": 8}  # fmt: skip
    _, seeds = cenvs.seed_pools("alfworld", 8, 12, eval_split="valid_unseen")
    types = [alfworld.generate_layout(s, "small").task_type for s in seeds]
    games = {t: types.count(t) for t in set(types)}
    # solve every game of the first type seen, none of the others; at step 0 one game of it (or none)
    first_type = types[0]
    start = {"env_steps": 0, "eval/success_rate": 1 / 12, "eval/score": 0.0}
    start.update({f"eval/success_{t}": (1 / games[t] if t == first_type else 0.0) for t in games})
    run = write_run(tmp_path, "ppo_alfworld__swap__1", [(500, games[first_type] / 12, 0.0)])
    rows = (run / "exp_1" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(rows[-1]) | {f"eval/success_{t}": (1.0 if t == first_type else 0.0) for t in games}
    (run / "exp_1" / "metrics.jsonl").write_text("\n".join([*rows[:-1], json.dumps(last)]) + "\n")
    (run / "exp_1" / "config.json").write_text(json.dumps({"args": config}))
    r = learning.finished_run(run, 500, start)
    short = learning.TASK_TYPES[first_type]
    assert r[f"solved_{short}"] == games[first_type] and r[f"solved_{short}_start"] == 1
    assert sum(r[f"games_{s}"] for s in learning.TASK_TYPES.values()) == 12
    assert all(r[f"solved_{s}"] == 0 for s in learning.TASK_TYPES.values() if s != short)
    # a task type with no evaluation game: 0 of 0
    absent = [s for t, s in learning.TASK_TYPES.items() if t not in games]
    assert all(r[f"games_{s}"] == 0 and r[f"solved_{s}"] == 0 for s in absent)

    webshop = learning.finished_run(
        write_run(tmp_path, "grpo_webshop__swap__1", [(0, 0.1, 50.0), (400, 0.2, 60.0)]), 400
    )
    assert not any(k.startswith(("solved_", "games_")) for k in webshop)
    learning.write_tables([webshop, r], tmp_path, "")
    back = learning.read_runs(tmp_path / "learning.csv")
    assert back == [{k: v for k, v in x.items() if k != "curve"} for x in (webshop, r)]
    lines = learning.type_table([webshop, r])
    assert lines[0].startswith("\n| ppo_alfworld: games solved") and f"{short} ({games[first_type]})" in lines[0]
    assert lines[2].split(" | ")[0] == "| step 0" and lines[3].startswith("| swap | [1] |")
    assert not learning.type_table([webshop])


def test_final_evaluation_measures_the_last_checkpoint_on_more_seeds(tmp_path, monkeypatch):
    """--final-eval-tasks N: one --eval-only run of each finished run's checkpoint on N held-out seeds (the pair's
    flags first, the table's --script-flags last), reused on a rerun; its row pairs it with the start on N seeds."""
    run = write_run(tmp_path, "gigpo_alfworld__swap__2", [(0, 0.1, 0.0), (900, 0.3, 0.0)])
    (run / "exp_1" / "checkpoints").mkdir()
    result = learning.finished_run(run, 900)
    calls = []

    def fake_script(script, flags, runs_dir, what):
        calls.append((script, flags, runs_dir.name))
        write_run(runs_dir.parent.parent, runs_dir.name, [(900, 0.25, 0.0)])
        return 1.0

    monkeypatch.setattr(learning, "run_script", fake_script)
    start = {"env_steps": 0, "eval/success_rate": 0.125}
    for _ in range(2):
        row = learning.final_eval(result, 1000, tmp_path, start, ("--model-name", "x"))
        assert (row["pair"], row["variant"], row["seed"], row["env_steps"]) == ("gigpo_alfworld", "swap", 2, 900)
        assert (row["success_start"], row["success"]) == (0.125, 0.25)
    ((script, flags, name),) = calls
    assert script == "rspo_gigpo.py" and name == "final__gigpo_alfworld__swap__2__n1000"
    assert flags[:2] == ["--env", "alfworld"] and flags[-2:] == ["--model-name", "x"]
    assert "--eval-only" in flags and flags[flags.index("--resume") + 1] == str(run / "exp_1")
    assert flags[flags.index("--num-eval-tasks") + 1] == "1000"
    # a run folder without its checkpoint cannot be measured again: the error names it
    other = learning.finished_run(write_run(tmp_path, "ppo_alfworld__swap__2", [(0, 0.1, 0.0), (900, 0.3, 0.0)]), 900)
    with pytest.raises(RuntimeError, match="ppo_alfworld__swap__2: 0 run folders with checkpoints"):
        learning.final_eval(other, 1000, tmp_path, start)
