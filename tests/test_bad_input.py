"""A user's mistake, in any script, ends in one line on stderr, a non-zero exit and no new or changed file; a
diverging run stops with its iteration and keeps its last good checkpoint.

Mistakes caught before anything starts run the script's `__main__` in this process (runpy: the exit message is
the SystemExit's); the rest run the script in a subprocess with the tiny models, 1-2 iterations.
"""

import hashlib
import importlib.util
import os
import pathlib
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

from common.run import read_metrics

SCRIPTS = {"grpo": "rspo_grpo_webshop.py", "ppo": "rspo_ppo_alfworld.py", "gigpo": "rspo_gigpo.py"}
SMALL = [
    "--num-iterations", "1", "--tasks-per-iteration", "2", "--group-size", "2", "--explorer-rollouts-per-task", "1",
    "--max-steps", "3", "--max-new-tokens", "12", "--train-pool-size", "3", "--update-epochs", "2",
    "--num-eval-tasks", "4", "--eval-every", "0", "--no-eval-at-start", "--no-cuda", "--no-save-model",
]  # fmt: skip
# The reward mode of each script's base run: PPO's is an outcome run, to evaluate and resume it in other modes.
BASE_MODE = {"grpo": "swap", "ppo": "outcome", "gigpo": "swap"}


def _snapshot(folder):
    """{relative path: sha256} of every file under folder: to show that nothing was written or changed."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _exit_message(repo_root, monkeypatch, script, *flags) -> str:
    """Run the script's __main__ in this process; it must stop with a one-line SystemExit message."""
    monkeypatch.setattr(sys, "argv", [SCRIPTS[script], *flags])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(repo_root / SCRIPTS[script]), run_name="__main__")
    message = exc.value.code
    assert isinstance(message, str) and message and "\n" not in message, repr(message)
    return message


def _run(repo_root, script_env, script, *flags, timeout=400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(repo_root / SCRIPTS[script]), *SMALL, *flags]
    return subprocess.run(cmd, cwd=repo_root, env=script_env, capture_output=True, text=True, timeout=timeout)


def _one_line_failure(proc) -> str:
    """The one line on stderr of a failed run (progress bars aside: transformers draws one while loading weights)."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if "%|" not in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def base_runs(repo_root, script_env, tmp_path_factory):
    """One finished 1-iteration run per script (never changed by a test: tests work on copies)."""
    runs = {}
    for script, mode in BASE_MODE.items():
        runs_dir = tmp_path_factory.mktemp(f"base_{script}")
        proc = _run(repo_root, script_env, script, "--reward-mode", mode, "--runs-dir", str(runs_dir))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (runs[script],) = runs_dir.iterdir()
    return runs


def _copy(run_dir, tmp_path):
    dst = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, dst)
    return dst


def _iterations(run_dir) -> list[int]:
    return [row["iteration"] for row in read_metrics(run_dir)]


# ---------------------------------------------------------------------------------------------------------------
# Flags, models and env data: one line, before the run folder exists

BAD_FLAGS = [
    ("grpo", ["--tasks-per-iteration", "0"], "--tasks-per-iteration 0"),
    ("grpo", ["--group-size", "0"], "--group-size 0"),
    ("grpo", ["--group-size", "-2"], "--group-size -2"),
    ("grpo", ["--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("grpo", ["--clip-coef", "nan"], "--clip-coef nan"),
    ("grpo", ["--outcome-scale", "1e40"], "--outcome-scale 1e+40"),
    ("ppo", ["--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("ppo", ["--clip-coef", "nan"], "--clip-coef nan"),
    ("ppo", ["--outcome-scale", "1e40"], "--outcome-scale 1e+40"),
    ("ppo", ["--gamma", "1.5"], "--gamma 1.5"),
    ("ppo", ["--group-size", "0"], "--group-size 0"),
    ("ppo", ["--explorer-rollouts-per-task", "0"], "--explorer-rollouts-per-task 0"),
    ("grpo", ["--buffer-capacity", "0"], "--buffer-capacity 0"),
    ("ppo", ["--buffer-capacity", "0"], "--buffer-capacity 0"),
    ("gigpo", ["--buffer-capacity", "0"], "--buffer-capacity 0"),
    ("gigpo", ["--tasks-per-iteration", "0"], "--tasks-per-iteration 0"),
    ("gigpo", ["--group-size", "-1"], "--group-size -1"),
    ("gigpo", ["--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("gigpo", ["--num-eval-tasks", "0"], "--num-eval-tasks 0"),
    ("gigpo", ["--clip-coef", "nan"], "--clip-coef nan"),
    ("gigpo", ["--outcome-scale", "1e40"], "--outcome-scale 1e+40"),
    ("gigpo", ["--env", "webshop", "--num-eval-tasks", "501"], "--num-eval-tasks 501"),
    ("grpo", ["--lora-rank", "-1"], "--lora-rank -1"),
    ("ppo", ["--lora-rank", "4", "--critic-model-name", "tiny"], "--lora-rank 4 with --critic-model-name tiny"),
]
MISSING_MODELS = [(script, "--model-name", name) for script in SCRIPTS for name in ("not-a-model", "/nonexistent/path")]
MISSING_MODELS.append(("ppo", "--critic-model-name", "/nonexistent/critic"))


@pytest.mark.parametrize("script,flags,named", BAD_FLAGS)
def test_bad_flag_is_one_line_before_the_run_folder(repo_root, monkeypatch, tmp_path, script, flags, named):
    message = _exit_message(repo_root, monkeypatch, script, *SMALL, *flags, "--runs-dir", str(tmp_path / "runs"))
    assert named in message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script,flag,name", MISSING_MODELS)
def test_missing_model_is_one_line_before_the_run_folder(repo_root, monkeypatch, tmp_path, script, flag, name):
    message = _exit_message(repo_root, monkeypatch, script, *SMALL, flag, name, "--runs-dir", str(tmp_path / "runs"))
    assert message.startswith(f"{flag} {name}: ")
    assert "huggingface-cli download" in message or "save_pretrained" in message  # what to do about it
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script,env", [("grpo", "webshop"), ("ppo", "alfworld"), ("gigpo", "alfworld")])
def test_real_backend_without_its_data_is_one_line(repo_root, monkeypatch, tmp_path, script, env):
    data = pathlib.Path(os.environ.get("ALFWORLD_DATA", "~/.cache/alfworld")).expanduser() / "json_2.1.1"
    if importlib.util.find_spec("web_agent_site") if env == "webshop" else data.is_dir():
        pytest.skip(f"the real {env} backend is installed here")
    flags = ["--env-backend", "real", "--runs-dir", str(tmp_path / "runs")]
    message = _exit_message(repo_root, monkeypatch, script, *SMALL, *flags)
    assert message.startswith("--env-backend real") and "--env-backend embedded" in message
    assert not (tmp_path / "runs").exists()


def test_bad_flag_prints_one_line_on_stderr(repo_root, script_env, tmp_path):
    proc = _run(repo_root, script_env, "gigpo", "--num-eval-tasks", "0", "--runs-dir", str(tmp_path / "runs"))
    assert proc.returncode == 1 and not proc.stdout
    assert _one_line_failure(proc) == "--num-eval-tasks 0: must be >= 1"
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------------------
# --resume: it names a readable checkpoint of a run with the same flags, or nothing is touched


def test_resume_of_a_missing_folder(repo_root, monkeypatch, tmp_path):
    flags = ["--resume", str(tmp_path / "nope"), "--runs-dir", str(tmp_path / "runs")]
    message = _exit_message(repo_root, monkeypatch, "ppo", *SMALL, *flags)
    assert str(tmp_path / "nope") in message and "no such run folder" in message
    assert not (tmp_path / "runs").exists() and not (tmp_path / "nope").exists()


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_resume_of_a_run_killed_before_its_first_checkpoint(repo_root, monkeypatch, tmp_path, base_runs, script):
    run_dir = _copy(base_runs[script], tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    before = _snapshot(tmp_path)
    flags = ["--reward-mode", BASE_MODE[script], "--resume", str(run_dir), "--runs-dir", str(run_dir.parent)]
    message = _exit_message(repo_root, monkeypatch, script, *SMALL, *flags)
    assert "before its first checkpoint" in message and "without --resume" in message
    assert _snapshot(tmp_path) == before


def test_resume_of_a_truncated_checkpoint_names_the_file(repo_root, monkeypatch, tmp_path, base_runs):
    run_dir = _copy(base_runs["grpo"], tmp_path)
    ckpt = run_dir / "checkpoints" / "latest.pt"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    before = _snapshot(tmp_path)
    flags = ["--resume", str(run_dir), "--runs-dir", str(run_dir.parent)]
    message = _exit_message(repo_root, monkeypatch, "grpo", *SMALL, *flags)
    assert str(ckpt) in message and "cannot be read" in message
    assert _snapshot(tmp_path) == before  # config.json has no new `resumes` entry


def test_resume_with_other_flags_is_refused(repo_root, monkeypatch, tmp_path, base_runs):
    run_dir = _copy(base_runs["grpo"], tmp_path)
    before = _snapshot(tmp_path)
    other = ["--reward-mode", "outcome", "--group-size", "3", "--learning-rate", "1e-3", "--num-iterations", "5"]
    message = _exit_message(repo_root, monkeypatch, "grpo", *SMALL, *other, "--resume", str(run_dir))
    for named in ("--reward-mode outcome (the run's: swap)", "--group-size 3 (the run's: 2)", "--learning-rate 0.001"):
        assert named in message
    assert "--num-iterations" not in message.split("(only")[0]  # a run may be extended
    assert "--num-policy-rollouts" not in message  # derived from --group-size, which is named
    assert _snapshot(tmp_path) == before
    # the reverse: an outcome run resumed in swap mode (was a KeyError on the missing explorer)
    run_dir = _copy(base_runs["ppo"], tmp_path)
    before = _snapshot(run_dir)
    flags = ["--reward-mode", "swap", "--resume", str(run_dir), "--runs-dir", str(run_dir.parent)]
    message = _exit_message(repo_root, monkeypatch, "ppo", *SMALL, *flags)
    assert "--reward-mode swap (the run's: outcome)" in message
    assert _snapshot(run_dir) == before


def test_grpo_resume_extends_and_restores_the_stored_reference(repo_root, script_env, tmp_path, base_runs):
    run_dir = _copy(base_runs["grpo"], tmp_path)
    ckpt_path = run_dir / "checkpoints" / "latest.pt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    ref = ckpt["modules"]["ref"]  # the frozen reference is stored, like in the PPO and GiGPO scripts
    name = next(k for k in ref if ".layers." in k)  # not the embedding, which the LM head may share
    ref[name] = ref[name] + 0.25  # another machine's reference: the resumed run must use this one, not rebuild it
    torch.save(ckpt, ckpt_path)
    flags = ["--num-iterations", "2", "--resume", str(run_dir), "--runs-dir", str(run_dir.parent)]
    proc = _run(repo_root, script_env, "grpo", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    assert after["iteration"] == 2
    assert all(torch.equal(after["modules"]["ref"][k], v) for k, v in ref.items())


# ---------------------------------------------------------------------------------------------------------------
# --eval-only reads the policy alone


def test_ppo_eval_only_of_an_outcome_run_in_swap_mode(repo_root, script_env, tmp_path, base_runs):
    before = _snapshot(base_runs["ppo"])
    proc = _run(repo_root, script_env, "ppo", "--eval-only", "--resume", str(base_runs["ppo"]), "--runs-dir",
                str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval (valid_unseen) success" in proc.stdout
    assert _snapshot(base_runs["ppo"]) == before
    assert len(list(tmp_path.iterdir())) == 1  # the evaluation's own folder


# ---------------------------------------------------------------------------------------------------------------
# Divergence: stop with the iteration number, keep the last good checkpoint


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_divergence_keeps_the_last_good_checkpoint(repo_root, script_env, tmp_path, base_runs, script):
    # The policy's Adam moments are poisoned (as a diverging optimiser leaves them): iteration 2's first policy
    # step makes its weights NaN; with 2 epochs the next loss is NaN too (the path that used to save them).
    run_dir = _copy(base_runs[script], tmp_path)
    ckpt_path = run_dir / "checkpoints" / "latest.pt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    for state in ckpt["optimizers"]["policy"]["state"].values():
        state["exp_avg"].fill_(float("nan"))
    torch.save(ckpt, ckpt_path)
    before = ckpt_path.read_bytes()
    flags = ["--reward-mode", BASE_MODE[script], "--num-iterations", "2", "--resume", str(run_dir)]
    flags += ["--runs-dir", str(run_dir.parent)]
    proc = _run(repo_root, script_env, script, *flags)
    assert proc.returncode != 0
    assert ckpt_path.read_bytes() == before  # the damaged weights, explorer and buffer are not saved
    assert _iterations(run_dir) == [1]
    line = _one_line_failure(proc)
    assert "iteration 2" in line and str(ckpt_path) in line


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_blow_up_with_a_finite_loss_stops_at_its_iteration(repo_root, script_env, tmp_path, script):
    # lr 1e30 with one optimiser step per iteration: the step moves the policy's weights by ~1e30 after a finite
    # loss, and only the next forward pass overflows (it used to save them, then fail in the next rollout). The
    # check after the step stops the run there, before anything is saved.
    flags = ["--reward-mode", "outcome", "--update-epochs", "1", "--num-iterations", "2", "--learning-rate", "1e30"]
    proc = _run(repo_root, script_env, script, *flags, "--runs-dir", str(tmp_path))
    (run_dir,) = tmp_path.iterdir()
    assert not (run_dir / "checkpoints").exists()
    assert _iterations(run_dir) == []
    line = _one_line_failure(proc)
    assert line.startswith("training diverged at iteration 1") and "no checkpoint was written" in line
