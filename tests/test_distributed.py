"""common/distributed.py: the helpers in one process (the default: each is the identity or the plain operation) and
under a real 2-process gloo group started by torchrun (tests/fsdp_worker.py), where a fully_shard-ed tiny model's
token-mean step over 2 ranks must give the single-process gradient and weights."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from common import distributed, run
from common.models import file_lock


def test_one_process_helpers_are_the_plain_operations(small_lm):
    assert not distributed.active() and distributed.rank() == 0 and distributed.world_size() == 1
    assert distributed.is_main()
    assert distributed.init(torch.device("cpu")) == torch.device("cpu")  # WORLD_SIZE unset: no process group
    assert not distributed.active()
    assert distributed.split([3, 1, 2]) == [3, 1, 2]
    assert distributed.gather((1, 2)) == [1, 2]
    sums = {"tokens": 7, "loss": 0.5}
    assert distributed.sum_all(sums) is sums and distributed.sum_all(3) == 3
    assert distributed.steps([[0, 1], [2]]) == [[0, 1], [2]]
    assert distributed.token_divisor(9) == 9 and distributed.token_divisor(0) == 1
    model = small_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert distributed.shard(model) is model
    assert distributed.shard(model, None) == (model, None)
    with distributed.gathered(model, None):
        pass
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def torchrun_env(repo_root) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.fixture(scope="module")
def worker_out(tmp_path_factory, repo_root, tiny_models) -> pathlib.Path:
    """The folder of tests/fsdp_worker.py's results: first in one process (each script's batch and its update),
    then under torchrun --nproc_per_node 2 (gloo): the helpers' reports and each script's update on 2 ranks."""
    # Run once per test session: under pytest -n 2 the other worker waits for the folder and reads it.
    shared = tmp_path_factory.getbasetemp()  # under xdist: this worker's folder in the session's
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    out, worker = shared / "fsdp_worker", str(repo_root / "tests" / "fsdp_worker.py")
    with file_lock(shared / "fsdp_worker.lock"):
        if not (out / "done").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            for cmd in ([sys.executable, worker, str(out)], [*TORCHRUN, worker, str(out)]):
                proc = subprocess.run(
                    cmd, env=torchrun_env(repo_root), cwd=repo_root, capture_output=True, text=True, timeout=300
                )
                assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            (out / "done").touch()
    return out


@pytest.fixture(scope="module")
def two_ranks(worker_out):
    """Each rank's report (rank{r}.json) of the helpers' checks."""
    return [json.loads((worker_out / f"rank{r}.json").read_text()) for r in range(2)]


def test_task_split_keeps_groups_whole_and_covers_every_task_once(two_ranks):
    r0, r1 = two_ranks
    assert (r0["world"], r1["world"]) == (2, 2)
    # rank 1 passed another list: rank 0's is split (contiguous shares, sizes 3 and 4)
    assert r0["local_tasks"] == [11, 12, 13] and r1["local_tasks"] == [14, 15, 16, 17]
    for report in two_ranks:
        seeds = report["gathered_seeds"]  # (rank, seed) of every env of every rank, gathered in rank order
        assert [s for _, s in seeds] == [s for s in range(11, 18) for _ in range(3)]
        rank_of = {}
        for r, s in seeds:
            assert rank_of.setdefault(s, r) == r, f"task {s} is split across ranks"


def test_metric_reduce_and_step_padding(two_ranks):
    for report in two_ranks:
        assert report["sum_dict"] == {"count": 3, "loss_sum": 0.75}
        assert report["sum_number"] == 3
        assert report["token_divisor"] == pytest.approx((5 + 9) / 2)
    assert two_ranks[0]["steps"] == [0, None] and two_ranks[1]["steps"] == [0, 1]
    # a statistic over the concatenation [1] + [1, 2] (mean 4/3), each rank's part back
    assert two_ranks[0]["across_ranks"] == pytest.approx([-1 / 3])
    assert two_ranks[1]["across_ranks"] == pytest.approx([-1 / 3, 2 / 3])
    fewer_tasks, vllm, fine = two_ranks[0]["check"]
    assert "--tasks-per-iteration 1: must be >= the number of processes (2)" in fewer_tasks
    assert "--rollout-backend vllm" in vllm and fine == "ok"


def test_two_rank_token_mean_step_equals_one_process(two_ranks):
    for report in two_ranks:
        # the clipped total gradient norm (before clipping), the gradients and the weights after one AdamW step
        norm, ref_norm = report["grad_norm"]
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert report["max_grad_diff"] <= 1e-4 * report["max_grad"]
        # Adam's first step is about lr * sign(grad): float noise in tiny gradients moves a weight by a small part
        # of it (measured: 1%)
        assert report["max_weight_change"] > 5e-4
        assert report["max_weight_diff"] <= 0.05 * report["max_weight_change"]


def test_generation_inside_gathered_and_dcp_round_trip(two_ranks):
    for report in two_ranks:
        assert report["generation_equal"] and report["resharded"]
        dcp = report["dcp"]
        assert dcp["moved"] > 0 and dcp["back"] == 0.0 and dcp["back_optimizer"] == 0.0
        assert dcp["state"] == {"note": f"rank {report['rank']}", "world_size": 2}
    assert {".metadata", "rank0.pt", "rank1.pt"} <= set(two_ranks[0]["checkpoint_files"])


def test_run_folder_written_by_rank_0_and_resumed_from_dcp(two_ranks):
    r0, r1 = two_ranks[0]["run"], two_ranks[1]["run"]
    assert r0["dir"] == r1["dir"] == r0["resumed_dir"] == r1["resumed_dir"]  # rank 0's folder (run0), on both
    assert r0["dir"].endswith("run0")
    assert {"config.json", "metrics.jsonl", "checkpoints", "learning_curve.png"} <= set(r0["files"])
    # rank 0's rows only; the resume dropped the row logged after the checkpoint
    assert r0["metrics"] == [{"value": 0.0, "iteration": 1}]
    for rank, report in enumerate((r0, r1)):
        assert report["state"] == {"iteration": 1, "extra": {"buffer": [rank]}}
        assert report["weights_back"] == 0.0
        draw, expected = report["draw"]
        assert draw == expected


def test_dcp_checkpoint_needs_its_number_of_processes(two_ranks):
    folder = next(pathlib.Path(two_ranks[0]["run"]["dir"]).glob("checkpoints/*.dcp"))
    assert run.find_checkpoint(folder.parents[1]) == folder
    with pytest.raises(run.BadInput, match="written by 2 processes and this run has 1"):
        run.read_checkpoint(folder)


@pytest.mark.parametrize("script", ["grpo", "gigpo", "ppo"])
def test_script_update_on_two_ranks_equals_one_process(worker_out, script):
    """The script's rows, advantages and update (2 epochs, one minibatch, padded micro-batches) on a batch of 3
    tasks x 2 rollouts: 2 ranks (tasks 0 | 1, 2) give the one-process advantages, losses and weights."""
    single = torch.load(worker_out / f"{script}_single.pt", weights_only=False)
    ranks = [torch.load(worker_out / f"{script}_rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["index"] for r in ranks] == [[0, 1], [2, 3, 4, 5]]  # each task's group whole on one rank

    def flat(turns: list) -> torch.Tensor:  # a trajectory's advantages: one per turn, or (PPO) per token of each turn
        return torch.tensor([a for turn in turns for a in (turn if isinstance(turn, list) else [turn])])

    for r in ranks:  # the advantages of each rank's trajectories are the one-process ones
        for i, adv in zip(r["index"], r["turn_advantages"]):
            torch.testing.assert_close(flat(adv), flat(single["turn_advantages"][i]), atol=1e-6, rtol=0)
    assert any(flat(adv).abs().max() > 0.5 for adv in single["turn_advantages"])
    for r in ranks:  # the losses and counts over all ranks
        assert r["stats"].keys() == single["stats"].keys()
        for k, v in single["stats"].items():
            assert r["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    initial, weights = single["initial"], single["weights"]
    change = max((weights[k] - initial[k]).abs().max().item() for k in initial)
    assert change > 1e-3
    step = torch.cat([(weights[k] - initial[k]).flatten() for k in initial])
    for r in ranks:
        assert r["weights"].keys() == weights.keys()
        rank_step = torch.cat([(r["weights"][k] - initial[k]).flatten() for k in initial])
        # Adam's steps are about lr * sign(grad), except where a gradient is as small as its eps (1e-8): there the
        # float noise of a sum in another order moves the weight by a visible part of a step (measured with the
        # searcher ALFWorld model: 1 of PPO's 744,832 weights, by 2.5% of the largest change; cosine 0.999998). So the
        # update is compared as a whole, and weight by weight in bulk.
        cosine = torch.nn.functional.cosine_similarity(rank_step, step, dim=0).item()
        off = ((rank_step - step).abs() > 0.01 * change).float().mean().item()
        assert cosine > 0.9999 and off < 1e-4, (cosine, off, (rank_step - step).abs().max().item(), change)


SMALL = [
    "--tasks-per-iteration", "2", "--group-size", "2", "--explorer-rollouts-per-task", "2", "--max-steps", "3",
    "--max-new-tokens", "8", "--train-pool-size", "3", "--num-eval-tasks", "2", "--no-eval-at-start", "--no-cuda",
]  # fmt: skip


@pytest.mark.parametrize(
    "script, extra",
    [("rspo_grpo_webshop.py", []), ("rspo_gigpo.py", ["--env", "webshop"]), ("rspo_ppo_alfworld.py", [])],
)
def test_script_runs_under_torchrun(script, extra, tmp_path, repo_root, tiny_models):
    """torchrun --nproc_per_node 2 on the CPU, swap mode: one iteration writes one run folder (rank 0's metrics,
    config, the DCP checkpoint with each rank's state, the model); GRPO's run then resumes from it for a second."""

    def torchrun(*flags: str) -> str:
        cmd = [*TORCHRUN, script, *SMALL, *extra, "--runs-dir", str(tmp_path), *flags]
        proc = subprocess.run(
            cmd, env=torchrun_env(repo_root), cwd=repo_root, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    out = torchrun("--num-iterations", "1")
    (run_dir,) = tmp_path.iterdir()
    rows = run.read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1]
    row = rows[0]
    assert 0 < row["env_steps"] <= 2 * (2 + 2) * 3 and row["explorer/env_steps"] > 0  # all ranks' steps
    assert row["explorer/update_rows"] > 0 and "losses/policy_loss" in row and "eval/success_rate" in row
    assert row["buffer/size"] == 2 * 2  # every rank's buffered explorer rollouts (a task each)
    assert len([line for line in out.splitlines() if "eval" in line and line.startswith("iter 1:")]) == 1  # rank 0
    assert {"config.json", "metrics.jsonl", "model", "learning_curve.png"} <= {p.name for p in run_dir.iterdir()}
    assert {"rank0.pt", "rank1.pt", ".metadata"} <= {p.name for p in (run_dir / "checkpoints" / "latest.dcp").iterdir()}
    if script == "rspo_grpo_webshop.py":
        out = torchrun("--num-iterations", "2", "--resume", str(run_dir))
        assert "resumed from" in out and "at iteration 1" in out
        assert [r["iteration"] for r in run.read_metrics(run_dir)] == [1, 2]
