"""A resumed run is the run that never stopped: each script, run 3 iterations straight and run 1 iteration then
resumed up to 3 (its run folder moved elsewhere first, as to another machine), logs the same metrics rows
(timings aside) and ends in bitwise-equal checkpoints: every module (the frozen reference included), optimiser,
the replay buffer, env_steps and the RNG states.

Sizes: one task, agent B in swap mode, --explorer-sync-every 2 (syncs at iterations 1 and 3). The resume comes after
iteration 1, so that the resumed iteration 2 plays and trains agent B from its restored weights and optimiser (a
resume after iteration 2 would have the sync overwrite them at once) and iteration 3 syncs it. A training pool of
one task makes every iteration sample the buffered rollouts of the iterations before, those of the checkpoint
included.

The same machinery checks that evaluating (every iteration, or only at the end) changes nothing of the training.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from common import models
from common.run import read_metrics

SMALL = [
    "--tasks-per-iteration", "1", "--group-size", "2", "--reward-mode", "swap", "--explorer-rollouts-per-task", "2",
    "--explorer-sync-every", "2", "--train-pool-size", "1", "--max-steps", "3", "--max-new-tokens", "8",
    "--update-epochs", "1", "--explorer-update-epochs", "1", "--num-eval-tasks", "1", "--eval-every", "1",
    "--no-eval-at-start", "--no-cuda", "--no-save-model",
]  # fmt: skip
EXPLORER_ROLLOUTS = 1 * 2  # tasks per iteration x explorer rollouts per task
# (script, env, extra flags, modules and optimisers a checkpoint must hold)
CASES = [
    ("rspo_grpo_webshop.py", "webshop", [], {"policy", "ref", "explorer"}, {"policy", "explorer"}),
    (
        "rspo_ppo_alfworld.py", "alfworld", [], {"policy", "ref", "critic", "explorer", "explorer_critic"},
        {"policy", "critic", "explorer", "explorer_critic"},
    ),
    ("rspo_gigpo.py", "webshop", ["--env", "webshop"], {"policy", "ref", "explorer"}, {"policy", "explorer"}),
    ("rspo_gigpo.py", "alfworld", ["--env", "alfworld"], {"policy", "ref", "explorer"}, {"policy", "explorer"}),
]  # fmt: skip


# The three runs of a case are three processes forked, one after the other, from one interpreter that has done the
# script's imports (torch, transformers: ~5 s of CPU that each fresh interpreter pays again). A child starts from
# that state alone and runs the script's __main__, as `python script.py ...` does; nothing of one run reaches the
# next except through the run folder. Steps: ["run", argv, log] (stdout and stderr to log) or ["move", a, b]
# (the only run folder in a becomes b).
_RUNNER = r"""
import json, os, runpy, shutil, sys, traceback
script, steps = sys.argv[1], json.loads(sys.argv[2])
runpy.run_path(script)  # its imports and definitions, not its __main__ block
from matplotlib.backends import backend_agg  # noqa: F401  (imported by every run's end: the learning curve)
for step in steps:
    if step[0] == "move":
        (name,) = os.listdir(step[1])
        shutil.move(os.path.join(step[1], name), step[2])
        continue
    _, argv, log = step
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = [script, *argv]
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:  # what the interpreter does with it: an int is the code, a message is printed
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(code))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 0:
        with open(log) as f:
            sys.exit(f"{' '.join(argv)}: exit code {code}\n{f.read()[-5000:]}")
"""


def _run_steps(repo_root, script_env, script, steps) -> None:
    cmd = [sys.executable, "-c", _RUNNER, str(repo_root / script), json.dumps(steps)]
    proc = subprocess.run(cmd, cwd=repo_root, env=script_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _only_run(runs_dir):
    (run_dir,) = list(runs_dir.iterdir())
    return run_dir


def _checkpoint(run_dir) -> dict:
    return torch.load(run_dir / "checkpoints" / "latest.pt", map_location="cpu", weights_only=False)


def _is_timing(key: str) -> bool:
    """Wall-clock seconds (perf/rollout_s) and throughputs (perf/gen_tokens_per_s): they differ between any two runs."""
    return key.endswith("_s")


def _without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if not _is_timing(k)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # -0.0 and 0.0, or two NaNs, differ here


def _differences(a, b, where: str = "") -> list[str]:
    """The places where two checkpoint values differ (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
        return [] if same and torch.equal(_bits(a), _bits(b)) else [where]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def _state_differences(final: dict, other: dict) -> list[str]:
    """Where two runs' final checkpoints differ: modules, optimisers, the extra state (buffer, env_steps), RNG states."""
    return [
        d for part in ("modules", "optimizers", "extra", "rng") for d in _differences(final[part], other[part], part)
    ]


@pytest.mark.parametrize(
    "script,env,flags,module_names,optimizer_names", CASES, ids=["grpo", "ppo", "gigpo-webshop", "gigpo-alfworld"]
)
def test_resumed_run_equals_the_straight_run(
    repo_root, script_env, tmp_path, script, env, flags, module_names, optimizer_names
):
    straight, moved = tmp_path / "straight", tmp_path / "elsewhere" / "run"
    argv = [*SMALL, *flags]
    steps = [
        ["run", [*argv, "--num-iterations", "3", "--runs-dir", str(straight)], str(tmp_path / "straight.log")],
        ["run", [*argv, "--num-iterations", "1", "--runs-dir", str(tmp_path / "first")], str(tmp_path / "first.log")],
        # another machine: the run folder alone, at another path, is all the resumed run gets
        ["move", str(tmp_path / "first"), str(moved)],
        ["run", [*argv, "--num-iterations", "3", "--resume", str(moved), "--runs-dir", str(moved.parent)],
         str(tmp_path / "resumed.log")],
    ]  # fmt: skip
    _run_steps(repo_root, script_env, script, steps)
    straight = _only_run(straight)
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    assert "at iteration 1 " in (tmp_path / "resumed.log").read_text()

    # The same metrics rows, timings aside; the resumed iterations exercised agent B and the buffer.
    rows, resumed_rows = read_metrics(straight), read_metrics(moved)
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in resumed_rows] == [1, 2, 3]
    for row, resumed in zip(rows, resumed_rows):
        timings = sorted(k for k in row if _is_timing(k))
        assert timings and all(k.startswith("perf/") for k in timings), timings
        assert _without_timings(resumed) == _without_timings(row), f"iteration {row['iteration']}"
    for row in rows[1:]:
        assert row["explorer/env_steps"] > 0
        assert row["buffer/sampled"] > EXPLORER_ROLLOUTS  # this iteration's and the ones before
        assert "eval/success_rate" in row

    # The same final state, bit for bit.
    final, resumed_final = _checkpoint(straight), _checkpoint(moved)
    assert final["iteration"] == resumed_final["iteration"] == 3
    assert not _state_differences(final, resumed_final)
    (resume,) = json.loads((moved / "config.json").read_text())["resumes"]
    assert resume["checkpoint_loaded"] == str(moved.resolve() / "checkpoints" / "latest.pt")

    # A checkpoint holds every module and optimiser of the run, the frozen reference included (the initial policy
    # as the script loads it, not the trained one), the RNG states, env_steps and every buffered rollout.
    assert set(final["modules"]) == module_names and set(final["optimizers"]) == optimizer_names
    assert {"python", "numpy", "torch"} <= set(final["rng"]) and final["extra"]["env_steps"] == rows[-1]["env_steps"]
    assert len(final["extra"]["buffer"]["entries"]) == 3 * EXPLORER_ROLLOUTS
    initial, _ = models.load_model("tiny", env_name=env, preset="small", seed=1)
    assert not _differences(final["modules"]["ref"], initial.state_dict(), "ref")
    assert _differences(final["modules"]["policy"], initial.state_dict(), "policy")  # the policy did train


@pytest.mark.parametrize(
    "script,env,flags", [c[:3] for c in CASES], ids=["grpo", "ppo", "gigpo-webshop", "gigpo-alfworld"]
)
def test_evaluating_more_often_changes_no_training(repo_root, script_env, tmp_path, script, env, flags):
    """A run that evaluates every iteration and one that evaluates only at its end train the same, bit for bit: the
    evaluations draw nothing from the training's random streams and touch no model. So the learning table's
    --eval-every sets how many points its curves have, and its cost, never a run's final figures."""
    i = SMALL.index("--eval-every")
    argv = [*SMALL[:i], *SMALL[i + 2 :], *flags]
    steps = [
        ["run", [*argv, "--num-iterations", "3", "--eval-every", str(every), "--runs-dir", str(tmp_path / f"e{every}")],
         str(tmp_path / f"e{every}.log")]
        for every in (1, 0)
    ]  # fmt: skip
    _run_steps(repo_root, script_env, script, steps)
    often, once = _only_run(tmp_path / "e1"), _only_run(tmp_path / "e0")
    rows, rows_once = read_metrics(often), read_metrics(once)
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in rows_once] == [1, 2, 3]
    assert all("eval/success_rate" in r for r in rows)
    assert ["eval/success_rate" in r for r in rows_once] == [False, False, True]

    def training(row: dict) -> dict:
        return {k: v for k, v in _without_timings(row).items() if not k.startswith("eval/")}

    for row, row_once in zip(rows, rows_once):
        assert training(row) == training(row_once), f"iteration {row['iteration']}"
    final, final_once = _checkpoint(often), _checkpoint(once)
    assert not _state_differences(final, final_once)
    assert rows[-1]["eval/success_rate"] == rows_once[-1]["eval/success_rate"]
