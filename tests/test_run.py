"""Run plumbing: seeding, config, metrics, checkpoint round trip with RNG states, resume, wandb offline, PNG."""

import dataclasses
import json
import math
import os
import pathlib
import random
import subprocess
from typing import Literal

import numpy as np
import pytest
import torch
from PIL import Image

from common import run as run_mod
from common.run import Run, find_checkpoint, git_commit, mean_ci95, progress, read_metrics, seed_everything


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    """seed_everything changes process-wide torch flags: give other tests in this worker theirs back."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


@dataclasses.dataclass
class Args:
    exp_name: str = "test_run"
    seed: int = 1
    torch_deterministic: bool = True
    track: bool = False
    wandb_project_name: str = "rspo"
    wandb_entity: str | None = None
    env_backend: Literal["embedded", "real"] = "embedded"
    cache_dir: pathlib.Path = pathlib.Path("/tmp/somewhere")
    sizes: tuple[int, ...] = (1, 2)
    learning_rate: float = 1e-5
    eval_only: bool = False
    resume: str | None = None


def _draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randint(0, 10**6, (2,)).tolist()


def test_seed_everything_repeats_all_generators():
    seed_everything(7, torch_deterministic=True)
    a = _draws()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    seed_everything(7)
    assert _draws() == a
    seed_everything(8)
    assert _draws() != a
    seed_everything(7, torch_deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_mean_ci95_hand_computed():
    m, h = mean_ci95([1, 0, 1, 1])
    # mean 0.75; unbiased std = sqrt(((0.25^2)*3 + 0.75^2) / 3) = 0.5; 1.96 * 0.5 / sqrt(4) = 0.49
    assert m == pytest.approx(0.75) and h == pytest.approx(0.49)
    m, h = mean_ci95(np.array([2.0, 4.0, 9.0]))
    assert m == pytest.approx(5.0) and h == pytest.approx(1.96 * math.sqrt(13.0) / math.sqrt(3))
    assert mean_ci95([0.3]) == (0.3, 0.0)
    assert mean_ci95(torch.tensor([1.0, 1.0])) == (1.0, 0.0)
    m, h = mean_ci95([])
    assert math.isnan(m) and h == 0.0


def test_git_commit(monkeypatch, tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=run_mod._REPO_DIR, capture_output=True, text=True)
    assert git_commit() == head.stdout.strip() and len(git_commit()) == 40
    monkeypatch.setattr(run_mod, "_REPO_DIR", tmp_path)  # not a git checkout
    assert git_commit() == "unknown"


def test_config_json_and_metrics(tmp_path):
    run = Run(Args(), "envname__test_run__1__123", runs_dir=str(tmp_path / "runs"))
    assert run.dir == (tmp_path / "runs" / "envname__test_run__1__123").resolve()
    cfg = json.loads((run.dir / "config.json").read_text())
    assert cfg["git_commit"] == git_commit() and cfg["git_commit"] != "unknown"
    assert cfg["args"]["cache_dir"] == "/tmp/somewhere" and cfg["args"]["sizes"] == [1, 2]
    assert cfg["args"]["learning_rate"] == 1e-5 and cfg["args"]["wandb_entity"] is None
    assert "pytest" in cfg["command"] or "python" in cfg["command"]
    assert cfg["start_time"] and cfg["run_name"] == run.run_name

    run.log({"train/success_rate": torch.tensor(0.5), "env_steps": np.int64(40), "losses/kl": np.float32(0.25)}, 0)
    run.log({"train/success_rate": 0.75, "losses/policy_loss": float("nan"), "note": "x", "v": torch.ones(2)}, 1)
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"train/success_rate": 0.5, "env_steps": 40, "losses/kl": 0.25, "iteration": 0}
    assert type(rows[0]["env_steps"]) is int
    assert rows[1]["losses/policy_loss"] is None and rows[1]["v"] == [1.0, 1.0] and rows[1]["iteration"] == 1
    with pytest.raises(TypeError, match="metric 'bad'"):
        run.log({"bad": object()}, 2)
    assert len(read_metrics(run.dir)) == 2  # the bad row wrote nothing

    # Same name again: a fresh folder, never a shared metrics file.
    other = Run(Args(), "envname__test_run__1__123", runs_dir=str(tmp_path / "runs"))
    assert other.dir != run.dir and other.dir.name == "envname__test_run__1__123-1"
    run.close()
    other.close()


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt):
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_checkpoint_round_trip_restores_modules_optimisers_and_rng(tmp_path):
    seed_everything(3)
    run = Run(Args(), "ckpt", runs_dir=str(tmp_path))
    model, opt = _model_and_opt(0)
    critic = torch.nn.Linear(3, 1)
    for _ in range(3):
        _train_step(model, opt)
    gen = np.random.default_rng(11)
    gen.random(5)
    path = run.save_checkpoint(5, {"policy": model, "critic": critic, "explorer": None}, {"policy": opt}, {"gen": gen})
    assert path == run.dir / "checkpoints" / "latest.pt" and path.is_file()
    assert not list(path.parent.glob("*.tmp"))
    after_save = _draws()
    gen_next = gen.random(3).tolist()
    _train_step(model, opt)  # the reference continuation after the checkpoint
    expect = [p.detach().clone() for p in model.parameters()]

    # Fresh process state: other weights, other optimiser, other RNG.
    seed_everything(99)
    model2, opt2 = _model_and_opt(1)
    critic2 = torch.nn.Linear(3, 1)
    resumed = Run(Args(), "ignored", runs_dir=str(tmp_path), resume=str(run.dir))
    assert resumed.dir == run.dir
    out = resumed.load_checkpoint({"policy": model2, "critic": critic2}, {"policy": opt2})
    assert out["iteration"] == 5
    assert _draws() == after_save  # the next random numbers after load equal those after save
    assert out["extra"]["gen"].random(3).tolist() == gen_next
    assert torch.equal(critic2.weight, critic.weight)
    assert opt2.state_dict()["state"][0]["step"] == 3  # the checkpointed optimiser, not opt's 4 steps
    # The same continuation from the restored state reproduces the reference weights exactly (same random
    # batch, same Adam moments).
    _train_step(model2, opt2)
    for p, q in zip(model2.parameters(), expect):
        assert torch.equal(p, q)

    with pytest.raises(KeyError, match="explorer"):
        resumed.load_checkpoint({"explorer": torch.nn.Linear(4, 1)}, {})
    run.close()
    resumed.close()


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    run = Run(Args(), "atomic", runs_dir=str(tmp_path))
    model, opt = _model_and_opt(0)
    run.save_checkpoint(1, {"policy": model}, {"policy": opt})
    before = (run.dir / "checkpoints" / "latest.pt").read_bytes()

    real_save = torch.save

    def crash(obj, f, *a, **k):
        real_save({"partial": True}, f)
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        run.save_checkpoint(2, {"policy": model}, {"policy": opt})
    monkeypatch.setattr(torch, "save", real_save)
    assert (run.dir / "checkpoints" / "latest.pt").read_bytes() == before
    assert Run(Args(), "x", runs_dir=str(tmp_path), resume=str(run.dir)).load_checkpoint({}, {})["iteration"] == 1
    run.close()


def test_resume_truncates_metrics_and_eval_only_leaves_run_alone(tmp_path):
    run = Run(Args(), "res", runs_dir=str(tmp_path))
    model, opt = _model_and_opt(0)
    for it in range(4):
        run.log({"train/success_rate": it / 4, "env_steps": 10 * (it + 1)}, it)
        if it == 1:
            run.save_checkpoint(it, {"policy": model}, {"policy": opt})
    with open(run.metrics_path, "a") as f:
        f.write('{"iteration": 4, "train/succ')  # a crash in the middle of a write
    # Eval-only: reads the checkpoint, writes into its own folder.
    ev = Run(
        Args(eval_only=True), "res_eval", runs_dir=str(tmp_path), resume=str(run.dir / "checkpoints" / "latest.pt")
    )
    assert ev.dir != run.dir and ev.load_checkpoint({"policy": model}, {})["iteration"] == 1
    ev.log({"eval/success_rate": 0.5}, 1)
    ev.close()
    assert len(read_metrics(run.dir)) == 4

    resumed = Run(Args(), "res", runs_dir=str(tmp_path), resume=str(run.dir / "checkpoints"))
    assert resumed.load_checkpoint({"policy": model}, {"policy": opt})["iteration"] == 1
    assert [r["iteration"] for r in read_metrics(run.dir)] == [0, 1]
    resumed.log({"train/success_rate": 0.9}, 2)
    assert [r["iteration"] for r in read_metrics(run.dir)] == [0, 1, 2]
    cfg = json.loads((run.dir / "config.json").read_text())
    assert cfg["run_name"] == "res" and len(cfg["resumes"]) == 1 and cfg["resumes"][0]["git_commit"] == git_commit()
    resumed.close()

    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        find_checkpoint(tmp_path / "does_not_exist")
    with pytest.raises(FileNotFoundError, match="--resume"):
        Run(Args(), "y", runs_dir=str(tmp_path), resume=str(ev.dir))  # a run folder without a checkpoint


def test_learning_curve_png(tmp_path):
    run = Run(Args(), "curve", runs_dir=str(tmp_path))
    empty = run_mod.plot_learning_curve(run.metrics_path, tmp_path / "empty.png")
    for it in range(6):
        row = {"train/success_rate": it / 6, "env_steps": 32 * (it + 1)}
        if it % 2 == 1:
            row.update({"eval/success_rate": it / 7, "eval/success_ci95": 0.1})
        run.log(row, it)
    run.close()
    run.close()  # idempotent
    for png in (run.dir / "learning_curve.png", empty):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(png) as im:
            im.verify()
        with Image.open(png) as im:
            assert im.size == (700, 420)
    # The curves really are drawn: the plot differs from the empty one.
    assert (run.dir / "learning_curve.png").read_bytes() != empty.read_bytes()


def test_wandb_offline_writes_under_the_run_folder(tmp_path, monkeypatch):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    for k in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.delenv(k, raising=False)
    with Run(Args(track=True), "tracked", runs_dir=str(tmp_path / "runs")) as run:
        run.log({"train/success_rate": 0.25, "env_steps": 8}, 0)
        run.log({"train/success_rate": 0.5, "env_steps": 16}, 1)
        run.save_checkpoint(1, {}, {})
        wandb_id = run.config["wandb_id"]
    offline = list((run.dir / "wandb").glob(f"offline-run-*-{wandb_id}"))
    assert len(offline) == 1
    # A resumed run continues the same wandb run id, in the same folder.
    with Run(Args(track=True), "other", runs_dir=str(tmp_path / "runs"), resume=str(run.dir)) as resumed:
        assert resumed.dir == run.dir and resumed.config["wandb_id"] == wandb_id
        resumed.log({"train/success_rate": 0.75, "env_steps": 24}, 2)
    assert len(list((run.dir / "wandb").glob(f"offline-run-*-{wandb_id}*"))) == 2
    files = list(offline[0].glob(f"run-{wandb_id}.wandb"))
    assert files and files[0].stat().st_size > 0
    assert (offline[0] / "logs" / "debug.log").is_file()
    assert not any(p.is_file() for p in elsewhere.rglob("*")), list(elsewhere.rglob("*"))
    assert not [p for p in home.rglob("*") if "wandb" in p.name], list(home.rglob("*"))
    assert "WANDB_CACHE_DIR" not in os.environ  # restored after init
    assert (run.dir / "learning_curve.png").is_file()


def test_progress_disabled_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "1")
    bar = progress(range(3), desc="x")
    assert bar.disable and list(bar) == [0, 1, 2]
    assert not progress(range(2), disable=False).disable
