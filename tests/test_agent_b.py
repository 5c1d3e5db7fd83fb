"""Agent B, end to end in each script: the explorer's update trains on its own rollouts (not the policy's batch),
and the distance metrics on the action tokens are logged. One policy rollout and three explorer rollouts per task,
so the two batches have different sizes and a script that trains the explorer on the policy's batch fails."""

import json
import math
import subprocess
import sys

import pytest

COMMON = [
    "--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "1", "--explorer-rollouts-per-task", "3",
    "--max-new-tokens", "32", "--train-pool-size", "4", "--num-eval-tasks", "2", "--eval-every", "0",
    "--no-eval-at-start", "--no-save-model", "--minibatch-tokens", "4096", "--micro-batch-tokens", "2048",
    "--reward-mode", "swap", "--explorer-sync-every", "0", "--explorer-learning-rate", "2e-3",
]  # fmt: skip
SCRIPTS = {
    "grpo": ["rspo_grpo_webshop.py", "--max-steps", "4"],
    "gigpo": ["rspo_gigpo.py", "--env", "webshop", "--max-steps", "4"],
    "ppo": ["rspo_ppo_alfworld.py", "--max-steps", "3"],
}


def _run(repo_root, script_env, tmp_path, script, *flags) -> list[dict]:
    name, *script_flags = SCRIPTS[script]
    cmd = [sys.executable, str(repo_root / name), *COMMON, *script_flags, "--runs-dir", str(tmp_path), *flags]
    proc = subprocess.run(cmd, cwd=repo_root, env=script_env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _policy_steps(rows: list[dict]) -> list[int]:
    """Environment steps of the policy's own rollouts in each iteration (the total less the explorer's)."""
    steps, before = [], 0
    for r in rows:
        steps.append(r["env_steps"] - before - r["explorer/env_steps"])
        before = r["env_steps"]
    return steps


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_agent_b_trains_on_its_own_rollouts(repo_root, script_env, tmp_path, script):
    rows = _run(repo_root, script_env, tmp_path, script)
    assert [r["iteration"] for r in rows] == [1, 2]
    # Every explorer turn is one training row of its update (each response holds at least its EOS token).
    assert [r["explorer/update_rows"] for r in rows] == [r["explorer/env_steps"] for r in rows]
    assert [r["explorer/env_steps"] for r in rows] != _policy_steps(rows)  # the two batches differ in size
    for r in rows:
        for key in ("explorer/kl_to_policy", "explorer/kl_to_policy_action", "is_weight/ess", "is_weight/ess_action"):
            assert math.isfinite(r[key]), key
        assert 0.0 < r["is_weight/ess_action"] <= 1.0
    # Never synced, trained at a high rate: agent B has moved away from the policy after its first step.
    assert rows[1]["explorer/kl_to_policy"] > 1e-4


def test_one_step_explorer_trains_on_the_policy_batch(repo_root, script_env, tmp_path):
    """The comparison design: the explorer's one step uses the policy's rows."""
    rows = _run(repo_root, script_env, tmp_path, "grpo", "--explorer", "one_step")
    assert [r["explorer/update_rows"] for r in rows] == _policy_steps(rows)
