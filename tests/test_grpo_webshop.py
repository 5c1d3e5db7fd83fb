"""Tests of rspo_grpo_webshop.py: the pure functions against hand-computed numbers, then the script end to end."""

import json
import math
import subprocess
import sys

import pytest
import torch

import rspo_grpo_webshop as g

# ---------------------------------------------------------------------------------------------------------------
# compute_grpo_advantages


def test_grpo_advantages_hand_computed():
    # group "a": [1, 3]: mean 2, unbiased std sqrt(2); group "b": ties [10, 0, 0, 0]: mean 2.5, std 5.
    returns = torch.tensor([1.0, 3.0, 10.0, 0.0, 0.0, 0.0])
    adv = g.compute_grpo_advantages(returns, ["a", "a", "b", "b", "b", "b"])
    s2 = math.sqrt(2) + 1e-6
    expected = torch.tensor(
        [-1 / s2, 1 / s2, 7.5 / (5 + 1e-6), -2.5 / (5 + 1e-6), -2.5 / (5 + 1e-6), -2.5 / (5 + 1e-6)]
    )
    torch.testing.assert_close(adv, expected)
    # the same with the group of every trajectory as an integer tensor, in another order
    adv_t = g.compute_grpo_advantages(returns[[2, 0, 3, 1, 4, 5]], torch.tensor([7, 3, 7, 3, 7, 7]))
    torch.testing.assert_close(adv_t, expected[[2, 0, 3, 1, 4, 5]])


def test_grpo_advantages_without_std():
    adv = g.compute_grpo_advantages([10.0, 0.0, 0.0, 0.0, 1.0, 3.0], [0, 0, 0, 0, 1, 1], norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([7.5, -2.5, -2.5, -2.5, -1.0, 1.0]))


def test_grpo_advantages_singleton_and_all_equal():
    adv = g.compute_grpo_advantages(torch.tensor([4.0, 10.0, 10.0, 10.0, -2.0]), ["s", "e", "e", "e", "t"])
    torch.testing.assert_close(adv, torch.tensor([4.0, 0.0, 0.0, 0.0, -2.0]))  # singleton: A = R exactly
    adv = g.compute_grpo_advantages(torch.tensor([0.0, 0.0]), [1, 1])
    assert torch.equal(adv, torch.zeros(2))
    with pytest.raises(ValueError):
        g.compute_grpo_advantages(torch.tensor([1.0, 2.0]), [0])


def _turn(valid=True, process=0.5, n_resp=2, prompt=(1, 2, 3)):
    return g.Turn(
        prompt_ids=list(prompt), response_ids=list(range(5, 5 + n_resp)), behaviour_logprobs=[-1.0] * n_resp,
        action="click[x]", valid=valid, anchor_obs="page", outcome_reward=0.0, process_reward=process,
        done=False, truncated=False,
    )  # fmt: skip


def _traj(seed, won, process, sampler="policy", turns=None, iteration=1):
    turns = turns or [_turn(process=process)]
    return g.Trajectory(
        task_seed=seed, group_id=seed, turns=turns, won=won, task_score=1.0 if won else 0.3,
        outcome_return=10.0 * won, process_return=process, sampler=sampler, iteration=iteration,
    )  # fmt: skip


def test_swapped_members_counted_and_invalid_penalty():
    # task 7: two failed policy rollouts (2 turns, the second invalid) + one successful swapped explorer rollout;
    # returns [0, 0, 10]: mean 10/3, std sqrt(100/3) -> A = [-1/sqrt3, -1/sqrt3, 2/sqrt3]
    policy = [_traj(7, False, 0.4, turns=[_turn(), _turn(valid=False)]) for _ in range(2)]
    explorer = g.swap_rewards([_traj(7, True, 2.0, sampler="explorer")])
    adv, turn_adv = g.grpo_turn_advantages(policy + explorer, "outcome", True, 0.1)
    a = 1 / math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([-a, -a, 2 * a]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(turn_adv, torch.tensor([-a, -a - 0.1, -a, -a - 0.1, 2 * a]), atol=1e-5, rtol=1e-5)
    # before the swap the group was all-failure: no advantage at all
    adv_before, _ = g.grpo_turn_advantages(policy, "outcome", True, 0.0)
    assert g.nonzero_adv_group_share(policy, adv_before) == 0.0
    assert g.nonzero_adv_group_share(policy + explorer, adv) == 1.0


def test_broadcast_to_turns():
    out = g.broadcast_to_turns(
        torch.tensor([1.0, -2.0]), torch.tensor([0, 0, 1]), torch.tensor([False, True, True]), 0.5
    )
    torch.testing.assert_close(out, torch.tensor([1.0, 0.5, -2.5]))


# ---------------------------------------------------------------------------------------------------------------
# policy loss, KL, importance weights


def test_policy_loss_hand_computed():
    # ratios 1.5, 0.5, 5, 0.5 with advantages +1, +1, -1, -1:
    # max(-1.5, -1.2) = -1.2 (clipped); max(-0.5, -0.8) = -0.5; max(5, 1.2) = 5 -> dual clip 3; max(0.5, 0.8) = 0.8
    ratios = torch.tensor([[1.5, 0.5, 5.0, 0.5]])
    old = torch.zeros(1, 4)
    lp = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, clipped = g.policy_loss(lp, old, adv, mask, torch.ones(1, 4), clip_coef=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor(-1.2 - 0.5 + 3.0 + 0.8))
    assert clipped.item() == 2  # tokens 0 and 3 take the clipped branch
    loss.backward()
    # only the unclipped token 1 has gradient: d(-A r)/d lp = -A r = -0.5
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.5, 0.0, 0.0]]))
    # masked tokens and importance weights
    loss_w, _ = g.policy_loss(
        lp, old, adv, torch.tensor([[True, True, False, False]]), torch.tensor([[2.0, 0.5, 9, 9]])
    )
    torch.testing.assert_close(loss_w, torch.tensor(2.0 * -1.2 + 0.5 * -0.5))


def test_zero_advantage_gives_zero_policy_gradient():
    lp = torch.randn(3, 5, requires_grad=True)
    loss, _ = g.policy_loss(
        lp, lp.detach() + 0.3, torch.zeros(3, 1), torch.ones(3, 5, dtype=torch.bool), torch.ones(3, 5)
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(lp.grad) == 0


def test_kl_k3():
    lp, ref = torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3]))
    torch.testing.assert_close(g.kl_k3(lp, ref), torch.tensor([0.5 + math.log(2) - 1, 0.0]))


def test_truncated_importance_weights_capped():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2], [0.5, 0.5, 0.2]]))
    behaviour = torch.log(torch.tensor([[0.1, 1.0, 0.2], [0.1, 1.0, 0.2]]))
    off_policy = torch.tensor([[True], [False]])
    w = g.truncated_importance_weights(old, behaviour, cap=2.0, off_policy=off_policy)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0], [1.0, 1.0, 1.0]]))  # 5 is capped at 2
    assert not w.requires_grad


def test_importance_weight_stats():
    w = torch.tensor([2.0, 0.05, 1.0, 1.0, 7.0])
    stats = g.importance_weight_stats(w, torch.tensor([True, True, True, True, False]))
    assert stats["mean"] == pytest.approx(4.05 / 4)
    assert stats["frac_below_0.1"] == pytest.approx(0.25)
    assert stats["ess"] == pytest.approx(4.05**2 / (4 * 6.0025))
    assert g.importance_weight_stats(w, torch.zeros(5, dtype=torch.bool)) == {}


# ---------------------------------------------------------------------------------------------------------------
# the swap and the replay buffer


def test_swap_drops_process_rewards():
    explorer = [_traj(3, False, 1.7, sampler="explorer"), _traj(3, True, 0.2, sampler="explorer")]
    swapped = g.swap_rewards(explorer)
    assert all(t.process_return is None and all(u.process_reward is None for u in t.turns) for t in swapped)
    assert explorer[0].process_return == 1.7  # the originals are untouched
    torch.testing.assert_close(g.trajectory_returns(swapped, "outcome"), torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError):
        g.trajectory_returns(swapped, "process")


def test_explorer_process_rewards_never_reach_the_policy_update():
    """Changing the explorer's process rewards changes nothing in the policy's training rows."""
    policy = [_traj(1, False, 0.3), _traj(1, True, 0.9), _traj(2, False, 0.1), _traj(2, False, 0.0)]

    def policy_rows(explorer_process):
        buffer = g.ReplayBuffer(capacity=10, max_age=0)
        explorer = [
            _traj(2, True, explorer_process, sampler="explorer"),
            _traj(1, False, 2 * explorer_process, "explorer"),
        ]
        buffer.add(g.swap_rewards(explorer), iteration=1)
        batch = policy + buffer.sample([1, 2], iteration=1)
        _, turn_adv = g.grpo_turn_advantages(batch, "outcome", True, 0.1)
        rows = g.make_rows(batch)
        g.set_advantages(rows, turn_adv)
        return rows

    a, b = policy_rows(0.0), policy_rows(123.0)
    assert [r.advantage for r in a] == [r.advantage for r in b]
    assert [r.swapped for r in a] == [False] * 4 + [True] * 2
    # the swapped success in task 2 gives that all-failure group a signal: [0, 0, 10] -> the explorer row is positive
    assert a[4].advantage > 0 and a[2].advantage < 0


def test_replay_buffer_capacity_age_and_tasks():
    buf = g.ReplayBuffer(capacity=3, max_age=1)
    with pytest.raises(ValueError):
        buf.add([_traj(1, False, 0.5, sampler="explorer")], iteration=1)  # not swapped
    buf.add(
        g.swap_rewards([_traj(1, False, 0.1, "explorer", iteration=1), _traj(2, True, 0.1, "explorer", iteration=1)]), 1
    )
    assert [t.task_seed for t in buf.sample([1], iteration=1)] == [1]
    buf.add(
        g.swap_rewards([_traj(1, True, 0.1, "explorer", iteration=2), _traj(3, True, 0.1, "explorer", iteration=2)]), 2
    )
    assert len(buf) == 3  # capacity: the oldest (task 1, iteration 1) left
    assert [(t.task_seed, t.iteration) for t in buf.sample([1, 2], iteration=2)] == [(2, 1), (1, 2)]
    assert [(t.task_seed, t.iteration) for t in buf.sample([1, 2, 3], iteration=3)] == [(1, 2), (3, 2)]  # age > 1 left
    restored = g.ReplayBuffer(capacity=3, max_age=1)
    restored.load_state_dict(buf.state_dict())
    assert restored.sample([1, 3], iteration=3) == buf.sample([1, 3], iteration=3)


def test_pack_by_tokens():
    assert g.pack_by_tokens([3, 4, 2, 9, 1], budget=8, padded=False) == [[0, 1], [2], [3], [4]]
    assert g.pack_by_tokens([3, 4, 2, 9, 1], budget=8, padded=True) == [[0, 1], [2], [3], [4]]
    assert g.pack_by_tokens([2, 2, 2, 2], budget=8, padded=True) == [[0, 1, 2, 3]]
    assert g.pack_by_tokens([1, 4, 1], budget=8, padded=True) == [[0, 1], [2]]


# ---------------------------------------------------------------------------------------------------------------
# the update on a small real transformers model


def _rows(n=5):
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        p, r = 3 + i % 3, 2 + i % 2
        ids = torch.randint(1, 40, (p + r,), generator=gen).tolist()
        rows.append(g.Row(ids, p, [-3.0] * r, advantage=float(i - 2), swapped=i == 4, iteration=1))
    return rows


@pytest.mark.parametrize("use_is", [True, False])
def test_update_is_the_same_under_gradient_accumulation(small_lm, use_is):
    """Token-mean over the minibatch: one micro-batch per row gives the same step as one micro-batch for all."""
    results = []
    for micro in (10_000, 1):
        model, ref = small_lm(), small_lm(1)
        rows = _rows()
        args = g.Args(
            temperature=1.0, is_cap=2.0, minibatch_tokens=10_000, micro_batch_tokens=micro, clip_coef=0.2,
            dual_clip=3.0, kl_coef=0.01, ent_coef=0.001, max_grad_norm=1e9,
            off_policy_correction="tis" if use_is else "none",
        )  # fmt: skip
        g.prepare_rows(model, ref, rows, args, pad_id=0, autocast=g.nullcontext)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        stats = g.update(model, opt, rows, args, epochs=1, pad_id=0, autocast=g.nullcontext)
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), stats, rows))
    (p1, s1, rows1), (p2, s2, _) = results
    torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5)
    assert s1["policy_loss"] == pytest.approx(s2["policy_loss"], rel=1e-5)
    assert s1["clip_frac"] == 0.0 and s1["approx_kl"] == pytest.approx(0.0, abs=1e-10)  # first step: ratio 1
    # only the off-policy row gets weights != 1, capped at 2 (behaviour log-prob -3 is below the model's)
    assert all(torch.all(r.is_weights == 1) for r in rows1[:4])
    assert torch.all(rows1[4].is_weights <= 2.0) and torch.any(rows1[4].is_weights != 1)


def test_zero_advantages_leave_only_kl_and_entropy(small_lm):
    model, ref = small_lm(), small_lm()
    rows = _rows()
    for r in rows:
        r.advantage = 0.0
    args = g.Args(
        temperature=1.0, is_cap=2.0, minibatch_tokens=10_000, micro_batch_tokens=10_000, clip_coef=0.2, dual_clip=3.0,
        kl_coef=0.01, ent_coef=0.0, max_grad_norm=1.0, off_policy_correction="tis",
    )  # fmt: skip
    g.prepare_rows(model, ref, rows, args, pad_id=0, autocast=g.nullcontext)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # ref == model (KL gradient 0 at ratio 1), no entropy: zero advantages must leave the weights unchanged
    g.update(model, opt, rows, args, epochs=1, pad_id=0, autocast=g.nullcontext)
    for a, b in zip(before, model.parameters()):
        torch.testing.assert_close(a, b.detach(), atol=1e-7, rtol=0)


def test_token_logprobs_match_softmax(small_lm):
    model = small_lm()
    ids = torch.tensor([[1, 5, 7, 9]])
    lp, ent = g.token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7, with_entropy=True)
    logits = model(ids).logits[0, :-1] / 0.7
    expected = torch.log_softmax(logits, -1)[torch.arange(3), ids[0, 1:]]
    torch.testing.assert_close(lp[0], expected)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent[0], -(p * torch.log(p)).sum(-1))


def test_token_logprobs_response_mask_equals_full_head_and_gradient(small_lm):
    """The response-only LM head gives the same log-probs, entropies and gradients on the masked positions."""
    ids = torch.tensor([[1, 5, 7, 9, 4, 2], [3, 8, 6, 2, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[False, False, True, True, True], [False, True, True, False, False]])
    grads = []
    for response_mask in (None, mask):
        model = small_lm()
        lp, ent = g.token_logprobs(model, ids, attn, 0.7, with_entropy=True, response_mask=response_mask)
        if response_mask is not None:
            assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
        (lp[mask].sum() + ent[mask].sum()).backward()
        grads.append(([p.grad.clone() for p in model.parameters()], lp[mask].detach(), ent[mask].detach()))
    (g_full, lp_full, ent_full), (g_masked, lp_masked, ent_masked) = grads
    torch.testing.assert_close(lp_masked, lp_full)
    torch.testing.assert_close(ent_masked, ent_full)
    for a, b in zip(g_full, g_masked):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# the script end to end (subprocess, tiny sizes)

SMALL = [
    "--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "2", "--explorer-rollouts-per-task", "2",
    "--max-steps", "4", "--max-new-tokens", "12", "--train-pool-size", "3", "--num-eval-tasks", "2",
    "--eval-every", "2", "--minibatch-tokens", "4096", "--micro-batch-tokens", "2048",
]  # fmt: skip
KEYS = [
    "iteration", "env_steps", "train/success_rate", "train/outcome_return", "train/process_return",
    "train/episode_length", "train/invalid_turn_rate", "train/nonzero_adv_groups_before_swap", "losses/policy_loss",
    "losses/kl", "losses/entropy", "losses/clip_frac", "losses/approx_kl", "perf/rollout_s", "perf/update_s",
    "perf/gen_tokens_per_s", "perf/train_tokens_per_s",
]  # fmt: skip
SWAP_KEYS = ["train/nonzero_adv_groups_after_swap", "explorer/success_rate", "explorer/kl_to_policy", "is_weight/mean",
             "is_weight/frac_below_0.1", "is_weight/ess"]  # fmt: skip
EVAL_KEYS = ["eval/success_rate", "eval/success_ci95", "eval/score", "eval/score_ci95"]


def _run_script(repo_root, script_env, *flags, timeout=300):
    cmd = [sys.executable, str(repo_root / "rspo_grpo_webshop.py"), *SMALL, *flags]
    proc = subprocess.run(cmd, cwd=repo_root, env=script_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _only_run(runs_dir):
    (run_dir,) = [p for p in runs_dir.iterdir() if p.is_dir()]
    return run_dir


@pytest.fixture(scope="module")
def swap_run(repo_root, script_env, tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs_swap")
    _run_script(repo_root, script_env, "--reward-mode", "swap", "--track", "--runs-dir", str(runs_dir))
    return _only_run(runs_dir)


def _check_run(run_dir, mode):
    rows = _metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert set(EVAL_KEYS) <= set(rows[0]) and set(EVAL_KEYS) <= set(rows[2]) and "eval/score" not in rows[1]
    for r in rows[1:]:
        missing = [k for k in KEYS + (SWAP_KEYS if mode == "swap" else []) if k not in r]
        assert not missing, f"{mode}: missing {missing}"
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        if mode != "swap":
            assert not any(k.startswith(("explorer/", "is_weight/")) for k in r)
    policy_steps = [r["env_steps"] for r in rows]
    assert 0 == policy_steps[0] < policy_steps[1] < policy_steps[2]
    if mode == "swap":
        # explorer steps count too: 2 tasks x (2 policy + 2 explorer) episodes of at least one step each
        assert rows[1]["env_steps"] >= 8 and rows[1]["buffer/sampled"] >= 4
    assert (run_dir / "checkpoints" / "latest.pt").is_file()
    assert (run_dir / "model" / "config.json").is_file()
    assert json.loads((run_dir / "config.json").read_text())["args"]["reward_mode"] == mode


def test_script_swap(swap_run):
    _check_run(swap_run, "swap")
    assert (swap_run / "wandb").exists() or any(swap_run.rglob("*.wandb")), "the --track run left no wandb files"
    ckpt = torch.load(swap_run / "checkpoints" / "latest.pt", map_location="cpu", weights_only=False)
    assert ckpt["iteration"] == 2 and {"policy", "explorer"} <= set(ckpt["modules"])
    assert len(ckpt["extra"]["buffer"]["entries"]) >= 8  # 2 iterations x 2 tasks x 2 explorer rollouts


@pytest.mark.parametrize("mode", ["outcome", "process"])
def test_script_baselines(repo_root, script_env, tmp_path, mode):
    _run_script(repo_root, script_env, "--reward-mode", mode, "--runs-dir", str(tmp_path))
    _check_run(_only_run(tmp_path), mode)


def test_script_resume_and_eval_only(repo_root, script_env, swap_run):
    before = _metrics(swap_run)
    _run_script(
        repo_root, script_env, "--num-iterations", "3", "--resume", str(swap_run), "--runs-dir", str(swap_run.parent)
    )
    rows = _metrics(swap_run)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert rows[:3] == before  # the earlier rows are kept as they were
    assert rows[3]["env_steps"] > before[2]["env_steps"]
    assert set(EVAL_KEYS) <= set(rows[3])  # the last iteration evaluates
    ckpt = torch.load(swap_run / "checkpoints" / "latest.pt", map_location="cpu", weights_only=False)
    assert ckpt["iteration"] == 3
    proc = _run_script(
        repo_root, script_env, "--eval-only", "--resume", str(swap_run), "--runs-dir", str(swap_run.parent)
    )
    assert "eval success" in proc.stdout and "(2 test goals)" in proc.stdout
    # the training pool as the evaluation set (how well the policy fits the goals it trains on)
    train_dir = swap_run.parent / "eval_train"
    proc = _run_script(
        repo_root, script_env, "--eval-only", "--eval-split", "train", "--num-eval-tasks", "3",
        "--runs-dir", str(train_dir),
    )  # fmt: skip
    assert "(3 train goals)" in proc.stdout
    (row,) = _metrics(_only_run(train_dir))
    assert set(EVAL_KEYS) <= set(row) and row["iteration"] == 0
