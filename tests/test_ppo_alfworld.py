"""Tests of rspo_ppo_alfworld.py: the pure functions against hand-computed numbers, then the script end to end."""

import contextlib
import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

import rspo_ppo_alfworld as p
from common import models

# ---------------------------------------------------------------------------------------------------------------
# compute_turn_gae (gamma = lam = 0.5 keeps the hand arithmetic exact)


def test_turn_gae_terminal_episode_hand_computed():
    # deltas: d2 = 10 - 3 = 7; d1 = 0 + 0.5*3 - 2 = -0.5; d0 = 0 + 0.5*2 - 1 = 0
    # A2 = 7; A1 = -0.5 + 0.25*7 = 1.25; A0 = 0 + 0.25*1.25 = 0.3125
    adv, ret = p.compute_turn_gae(
        torch.tensor([0.0, 0.0, 10.0]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0]), 0.5, 0.5,
        bootstrap_value=100.0,  # ignored: the last turn is terminal
    )  # fmt: skip
    torch.testing.assert_close(adv, torch.tensor([0.3125, 1.25, 7.0]))
    torch.testing.assert_close(ret, torch.tensor([1.3125, 3.25, 10.0]))


def test_turn_gae_truncated_episode_bootstraps():
    r, v = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 2.0])
    # cut by the step limit (done = 0): d1 = 1 + 0.5*4 - 2 = 1; d0 = 0 + 0.5*2 - 1 = 0; A0 = 0.25*1
    adv, ret = p.compute_turn_gae(r, v, torch.tensor([0.0, 0.0]), 0.5, 0.5, bootstrap_value=4.0)
    torch.testing.assert_close(adv, torch.tensor([0.25, 1.0]))
    torch.testing.assert_close(ret, torch.tensor([1.25, 3.0]))
    # the same turns ending in a terminal step: d1 = 1 - 2 = -1, A0 = 0.25 * -1
    adv, _ = p.compute_turn_gae(r, v, torch.tensor([0.0, 1.0]), 0.5, 0.5, bootstrap_value=4.0)
    torch.testing.assert_close(adv, torch.tensor([-0.25, -1.0]))


def test_turn_gae_lambda_limits():
    r = torch.tensor([1.0, 0.0, 2.0, 0.5])
    v = torch.tensor([0.5, -1.0, 2.0, 1.5])
    d = torch.tensor([0.0, 0.0, 0.0, 0.0])
    gamma, boot = 0.9, 3.0
    next_v = torch.tensor([-1.0, 2.0, 1.5, boot])
    # lambda = 0: one-step TD errors
    adv0, _ = p.compute_turn_gae(r, v, d, gamma, 0.0, bootstrap_value=boot)
    torch.testing.assert_close(adv0, r + gamma * next_v - v)
    # lambda = 1: discounted return to the end plus the discounted bootstrap, minus V
    adv1, ret1 = p.compute_turn_gae(r, v, d, gamma, 1.0, bootstrap_value=boot)
    mc = torch.tensor(
        [sum(gamma**k * r[t + k].item() for k in range(4 - t)) + gamma ** (4 - t) * boot for t in range(4)]
    )
    torch.testing.assert_close(adv1, mc - v)
    torch.testing.assert_close(ret1, mc)


def test_turn_gae_padded_batch_matches_single_trajectories():
    r1, v1, d1 = torch.tensor([0.0, 0.0, 10.0]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0])
    r2, v2, d2 = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])
    rewards = torch.tensor([[0.0, 0.0, 10.0], [0.0, 1.0, 77.0]])  # padding holds garbage on purpose
    values = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 55.0]])
    dones = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = p.compute_turn_gae(rewards, values, dones, 0.5, 0.5, torch.tensor([0.0, 4.0]), mask)
    a1, t1 = p.compute_turn_gae(r1, v1, d1, 0.5, 0.5)
    a2, t2 = p.compute_turn_gae(r2, v2, d2, 0.5, 0.5, bootstrap_value=4.0)
    torch.testing.assert_close(adv[0], a1)
    torch.testing.assert_close(adv[1, :2], a2)
    torch.testing.assert_close(ret[1, :2], t2)
    assert adv[1, 2] == 0 and ret[1, 2] == 0
    with pytest.raises(ValueError):
        p.compute_turn_gae(torch.zeros(3), torch.zeros(2), torch.zeros(3))


def test_token_gae_episode_return_variant():
    # gamma = lam = 1, the episode return on the last token: A_k = R - V_k, returns = R
    v = torch.tensor([1.0, 2.0, -1.0])
    adv, ret = p.compute_token_gae(torch.tensor([0.0, 0.0, 10.0]), v)
    torch.testing.assert_close(adv, torch.tensor([9.0, 8.0, 11.0]))
    torch.testing.assert_close(ret, torch.full((3,), 10.0))


def test_whiten_and_value_helpers():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    w = p.whiten(x)
    assert abs(w.mean().item()) < 1e-6 and abs(w.var(unbiased=False).item() - 1) < 1e-4
    # clipped value loss: V_old = 0, clip 1, target 3: V = 2.5 is clipped to 1 -> max(0.125, 2.0) = 2.0
    loss = p.clipped_value_loss(torch.tensor([2.5, 0.5]), torch.zeros(2), torch.tensor([3.0, 0.0]), 1.0)
    torch.testing.assert_close(loss, torch.tensor([2.0, 0.125]))
    assert p.explained_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == pytest.approx(1.0)
    assert p.explained_variance(torch.zeros(2), torch.tensor([1.0, 3.0])) == pytest.approx(0.0)
    assert p.explained_variance(torch.zeros(2), torch.ones(2)) is None


# ---------------------------------------------------------------------------------------------------------------
# policy loss, weights


def test_policy_loss_hand_computed():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 5.0]]))  # ratios against old = 0
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    mask = torch.tensor([[True, True, True, True]])
    loss, clipped = p.policy_loss(lp, old, adv, mask, torch.ones(1, 4), clip_coef=0.2, dual_clip=3.0)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5; token 2: max(2, 2) = 2;
    # token 3: max(5, 1.2) = 5, dual clip: min(5, 3) = 3
    assert loss.item() == pytest.approx(-1.2 - 0.5 + 2.0 + 3.0, abs=1e-5)
    assert clipped.item() == 1
    half = p.policy_loss(lp, old, adv, mask, torch.full((1, 4), 0.5))[0]
    assert half.item() == pytest.approx(0.5 * loss.item(), abs=1e-5)


def test_truncated_importance_weights_and_stats():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.01]]))
    beh = torch.log(torch.tensor([[0.1, 0.9, 0.5]]))
    w = p.truncated_importance_weights(old, beh, 2.0, torch.tensor([[True]]))
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.02]]))
    assert torch.equal(p.truncated_importance_weights(old, beh, 2.0, torch.tensor([[False]])), torch.ones(1, 3))
    s = p.importance_weight_stats(w, torch.ones_like(w, dtype=torch.bool))
    assert s["mean"] == pytest.approx(3.02 / 3)
    assert s["frac_below_0.1"] == pytest.approx(1 / 3)
    assert s["ess"] == pytest.approx(3.02**2 / (3 * (4 + 1 + 0.0004)))


def test_kl_k3():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    torch.testing.assert_close(p.kl_k3(lp, ref), torch.tensor([0.0, math.exp(1) - 2]))


# ---------------------------------------------------------------------------------------------------------------
# critic value indexing (a real Qwen2 backbone built from a config: nothing is downloaded)


@pytest.fixture(scope="module")
def tiny_lm(small_lm):
    return small_lm(pad_token_id=0, eos_token_id=1).eval()


@pytest.fixture(scope="module")
def tiny_critic(tiny_lm):
    critic = models.build_critic(tiny_lm)
    torch.nn.init.normal_(critic.head.weight)  # zero-initialised head: give it values to tell positions apart
    return critic.eval()


# The flags the plumbing reads in these tests, spelled out (a change of a default does not change the tests).
ARGS = p.Args(
    advantage_estimator="turn_gae", gamma=0.99, gae_lambda=0.95, outcome_scale=10.0, norm_adv=True, invalid_penalty=0.1,
    temperature=1.0, is_cap=2.0, minibatch_tokens=10**6, micro_batch_tokens=4096, clip_coef=0.2, dual_clip=3.0,
    vf_clip=2.0, kl_coef=0.01, ent_coef=0.001, max_grad_norm=1.0, off_policy_correction="tis",
)  # fmt: skip
KW = dict(pad_id=0, autocast=contextlib.nullcontext)


def test_critic_values_read_at_the_last_prompt_token(tiny_critic):
    seqs = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    plens = [3, 2, 1]  # prompt = the first plen tokens
    got = p.critic_values(tiny_critic, seqs, plens, ARGS, per_token=False, **KW)
    per_tok = p.critic_values(tiny_critic, seqs, plens, ARGS, per_token=True, **KW)
    with torch.no_grad():
        for s, n, g, pt in zip(seqs, plens, got, per_tok):
            alone = tiny_critic(torch.tensor([s[:n]]), torch.ones(1, n, dtype=torch.long))[0]
            full = tiny_critic(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
            torch.testing.assert_close(g, alone[-1:])  # the prompt's last token, not the padding or the response
            torch.testing.assert_close(pt, full[n - 1 : len(s) - 1])  # V before each response token
            assert len(pt) == len(s) - n
    # pure indexing on a [B, T] value tensor
    values = torch.arange(12.0).view(3, 4)
    torch.testing.assert_close(
        p.last_prompt_token_values(values, torch.tensor([1, 4, 2])), torch.tensor([0.0, 7.0, 9.0])
    )
    with pytest.raises(ValueError):
        p.last_prompt_token_values(values, torch.tensor([0, 1, 1]))


# ---------------------------------------------------------------------------------------------------------------
# the swap and the replay buffer


def _turn(process=0.5, n_resp=2, prompt=(2, 3, 4), outcome=0.0, done=False, truncated=False, valid=True):
    return p.Turn(
        prompt_ids=list(prompt), response_ids=list(range(5, 5 + n_resp)), behaviour_logprobs=[-1.0] * n_resp,
        action="go to desk 1", valid=valid, anchor_obs="room", outcome_reward=outcome, process_reward=process,
        done=done, truncated=truncated,
    )  # fmt: skip


def _traj(seed, won, process=(0.3, 1.0), sampler="policy", iteration=1, truncated=False):
    turns = [_turn(process=process[0], prompt=(2, 3, 4)), _turn(process=process[1], prompt=(2, 3, 6, 7))]
    turns[-1].done = True
    turns[-1].truncated = truncated
    turns[-1].outcome_reward = float(won)
    return p.Trajectory(
        task_seed=seed, group_id=seed, turns=turns, won=won, task_type="pick_and_place_simple",
        outcome_return=10.0 * won, process_return=sum(process), sampler=sampler, iteration=iteration,
        next_prompt_ids=[2, 3, 8] if truncated else None,
    )  # fmt: skip


def test_swap_drops_process_rewards():
    trajs = [_traj(3, True, sampler="explorer")]
    swapped = p.swap_rewards(trajs)
    assert swapped[0].process_return is None and all(t.process_reward is None for t in swapped[0].turns)
    assert trajs[0].process_return is not None  # the originals are untouched
    assert swapped[0].outcome_return == 10.0 and swapped[0].turns[0].behaviour_logprobs == [-1.0, -1.0]
    torch.testing.assert_close(p.turn_rewards(swapped, "outcome", 10.0)[1], torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError):
        p.turn_rewards(swapped, "process", 10.0)


def test_explorer_process_rewards_never_reach_the_policy_update(tiny_critic):
    policy = [_traj(7, False, truncated=True), _traj(7, False)]
    a = p.swap_rewards([_traj(7, True, process=(5.0, -3.0), sampler="explorer")])
    b = p.swap_rewards([_traj(7, True, process=(float("nan"), 1e9), sampler="explorer")])
    adv_a, ret_a, v_a = p.ppo_advantages(policy + a, tiny_critic, "outcome", ARGS, **KW)
    adv_b, ret_b, v_b = p.ppo_advantages(policy + b, tiny_critic, "outcome", ARGS, **KW)
    for x, y in ((adv_a, adv_b), (ret_a, ret_b), (v_a, v_b)):
        for tx, ty in zip(x, y):
            for u, w in zip(tx, ty):
                assert torch.isfinite(u).all()
                torch.testing.assert_close(u, w)
    # the policy's critic values the swapped turns too (same prompts -> same values as the policy's own turns)
    torch.testing.assert_close(v_a[2][0], v_a[0][0])
    with pytest.raises(ValueError):
        p.ppo_advantages(policy + a, tiny_critic, "process", ARGS, **KW)


def test_ppo_advantages_bootstrap_and_invalid_penalty(tiny_critic):
    traj = _traj(1, False, process=(0.0, 0.0), truncated=True)
    traj.turns[0].valid = False
    adv, ret, old_v = p.ppo_advantages([traj], tiny_critic, "outcome", dataclasses.replace(ARGS, norm_adv=False), **KW)
    v = torch.cat(old_v[0])
    boot = p.critic_values(tiny_critic, [[2, 3, 8]], [3], ARGS, per_token=False, **KW)[0]
    expected, _ = p.compute_turn_gae(torch.zeros(2), v, torch.zeros(2), 0.99, 0.95, bootstrap_value=boot.item())
    torch.testing.assert_close(adv[0][0], (expected[0] - 0.1).expand(2))  # turn 0 invalid: -0.1 after GAE
    torch.testing.assert_close(adv[0][1], expected[1].expand(2))
    torch.testing.assert_close(torch.cat(ret[0]), expected + v)
    # whitened: zero mean over the response tokens (before the penalty)
    no_penalty = dataclasses.replace(ARGS, invalid_penalty=0.0)
    adv_w, _, _ = p.ppo_advantages([traj, _traj(2, True)], tiny_critic, "outcome", no_penalty, **KW)
    assert abs(torch.cat([a for t in adv_w for a in t]).mean().item()) < 1e-5


def test_replay_buffer_capacity_age_tasks_and_extra():
    import random

    buf = p.ReplayBuffer(capacity=3, max_age=1)
    with pytest.raises(ValueError):
        buf.add([_traj(1, True, sampler="explorer")], 1)  # not swapped
    buf.add(p.swap_rewards([_traj(1, True, sampler="explorer"), _traj(2, False, sampler="explorer")]), 1)
    buf.add(p.swap_rewards([_traj(3, True, sampler="explorer"), _traj(1, False, sampler="explorer")]), 2)
    assert len(buf) == 3  # capacity: the first (task 1, won) left
    assert [t.task_seed for t in buf.sample([1, 2], 2)] == [2, 1]
    with_others = buf.sample([1], 2, num_other=5, rng=random.Random(0))
    assert sorted(t.task_seed for t in with_others) == [1, 2, 3]
    assert len(buf.sample([1], 2, num_other=1, rng=random.Random(0))) == 2
    assert [t.task_seed for t in buf.sample([1, 2, 3], 3)] == [3, 1]  # age: iteration 1's entry expired
    state = buf.state_dict()
    other = p.ReplayBuffer(3, 1)
    other.load_state_dict(state)
    assert [(j, t.task_seed, t.won) for j, t in other.entries] == [(j, t.task_seed, t.won) for j, t in buf.entries]


# ---------------------------------------------------------------------------------------------------------------
# update


def _rows(tiny_critic, swapped_last=True):
    trajs = [_traj(1, False, truncated=True), _traj(2, True)]
    if swapped_last:
        trajs += p.swap_rewards([_traj(2, True, sampler="explorer")])
    adv, ret, old_v = p.ppo_advantages(trajs, tiny_critic, "outcome", ARGS, **KW)
    rows = p.make_rows(trajs, adv, ret, old_v)
    assert [r.swapped for r in rows] == [t.sampler == "explorer" for t in trajs for _ in t.turns]
    return rows


def test_update_is_the_same_under_gradient_accumulation(tiny_lm, tiny_critic):
    import copy

    results = []
    for micro_tokens in (4096, 8):  # one micro-batch, or one row per micro-batch
        torch.manual_seed(0)
        model, critic = copy.deepcopy(tiny_lm), copy.deepcopy(tiny_critic)
        rows = _rows(critic)
        args = dataclasses.replace(ARGS, micro_batch_tokens=micro_tokens, max_grad_norm=1e9)
        p.prepare_rows(model, tiny_lm, rows, args, **KW)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        copt = torch.optim.SGD(critic.parameters(), lr=0.1)
        stats = p.update(model, opt, critic, copt, rows, args, epochs=1, **KW)
        results.append((stats, [q.detach().clone() for q in model.parameters()], critic.head.weight.detach().clone()))
    (s0, p0, h0), (s1, p1, h1) = results
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h0, h1, atol=1e-6, rtol=1e-5)
    assert s0["value_loss"] == pytest.approx(s1["value_loss"], rel=1e-5)
    assert s0["value_loss"] > 0 and "kl" in s0 and "explained_variance" in s0


def test_value_loss_uses_only_own_turns(tiny_lm, tiny_critic):
    import copy

    critic = copy.deepcopy(tiny_critic)
    rows = _rows(critic)
    own_targets = sum(len(r.returns) for r in rows if not r.swapped)
    assert own_targets < sum(len(r.returns) for r in rows)
    # a critic trained only on the swapped rows would not move: give the own rows no value target
    rows_swapped_only = [r for r in rows if r.swapped]
    p.prepare_rows(tiny_lm, tiny_lm, rows_swapped_only, ARGS, **KW)
    before = [q.detach().clone() for q in critic.parameters()]
    copt = torch.optim.SGD(critic.parameters(), lr=0.1)
    model = copy.deepcopy(tiny_lm)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = p.update(model, opt, critic, copt, rows_swapped_only, ARGS, epochs=1, **KW)
    assert "value_loss" not in stats and "kl" not in stats
    for a, b in zip(before, critic.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# end to end (subprocess, tiny sizes)

TINY = [
    "--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "1", "--explorer-rollouts-per-task", "1",
    "--max-steps", "3", "--max-new-tokens", "8", "--num-eval-tasks", "2", "--eval-every", "2", "--train-pool-size", "4",
    "--no-eval-at-start", "--no-cuda", "--no-save-model",
]  # fmt: skip

REQUIRED = [
    "iteration", "env_steps", "train/success_rate", "train/outcome_return", "train/process_return",
    "train/episode_length", "train/invalid_turn_rate", "train/nonzero_adv_groups_before_swap", "losses/policy_loss",
    "losses/value_loss", "losses/kl", "losses/entropy", "losses/clip_frac", "losses/approx_kl",
    "perf/rollout_s", "perf/update_s", "perf/gen_tokens_per_s", "perf/train_tokens_per_s",
]  # fmt: skip
SWAP_ONLY = [
    "train/nonzero_adv_groups_after_swap", "explorer/success_rate", "explorer/kl_to_policy", "is_weight/mean",
    "is_weight/frac_below_0.1", "is_weight/ess",
]  # fmt: skip


def _run(script_env, repo_root, runs_dir, *extra, timeout=240):
    cmd = [sys.executable, str(repo_root / "rspo_ppo_alfworld.py"), *TINY, "--runs-dir", str(runs_dir), *extra]
    out = subprocess.run(cmd, env=script_env, cwd=repo_root, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["outcome", "process"])
def test_smoke_baselines(script_env, repo_root, tmp_path, mode):
    _run(script_env, repo_root, tmp_path, "--reward-mode", mode)
    (run_dir,) = tmp_path.iterdir()
    rows = _metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    for key in REQUIRED:
        assert key in rows[-1], key
        assert rows[-1][key] is not None and math.isfinite(rows[-1][key]), key
    assert not any(k.startswith("explorer/") or k.startswith("is_weight/") for k in rows[-1])
    if mode == "process":  # -0.1 per inadmissible step and the bootstrap make the value targets differ
        assert any(isinstance(r.get("losses/explained_variance"), float) for r in rows)
    assert "eval/success_rate" in rows[-1] and "eval/success_ci95" in rows[-1]
    assert any(k.startswith("eval/success_") and k not in ("eval/success_rate", "eval/success_ci95") for k in rows[-1])
    assert 0 < rows[0]["env_steps"] < rows[1]["env_steps"] <= 2 * 2 * 3


def test_smoke_swap_tracked_then_resume(script_env, repo_root, tmp_path):
    _run(script_env, repo_root, tmp_path, "--reward-mode", "swap", "--track")
    (run_dir,) = tmp_path.iterdir()
    rows = _metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    for key in REQUIRED + SWAP_ONLY:
        assert key in rows[-1], key
    # env steps count the explorer's rollouts too: 2 tasks x (1 policy + 1 explorer) x <= 3 steps per iteration
    assert rows[0]["env_steps"] > rows[0]["train/episode_length"] * 2 - 1e-9
    assert rows[1]["buffer/size"] >= 2
    assert (run_dir / "checkpoints" / "latest.pt").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "the offline wandb run was not written"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["args"]["reward_mode"] == "swap"

    out = _run(
        script_env, repo_root, tmp_path, "--reward-mode", "swap", "--num-iterations", "3", "--resume", str(run_dir)
    )
    assert "iteration 2" in out.stdout
    rows = _metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[2]["env_steps"] > rows[1]["env_steps"]
    ckpt = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=False)
    assert ckpt["iteration"] == 3
    assert {"policy", "critic", "ref", "explorer", "explorer_critic"} <= set(ckpt["modules"])
    assert len(ckpt["extra"]["buffer"]["entries"]) >= 2


def test_non_finite_loss_is_reported(tiny_lm, tiny_critic):
    import copy

    model, critic = copy.deepcopy(tiny_lm), copy.deepcopy(tiny_critic)
    rows = _rows(critic, swapped_last=False)
    rows[0].advantages = torch.full_like(rows[0].advantages, float("nan"))
    p.prepare_rows(model, tiny_lm, rows, ARGS, **KW)
    opt, copt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
    with pytest.raises(p.NonFiniteLoss):
        p.update(model, opt, critic, copt, rows, ARGS, epochs=1, **KW)


def test_length_sorted_chunks_cover_every_index_once():
    lengths = [5, 40, 7, 38, 6, 100]
    chunks = p.length_sorted_chunks(lengths, budget=80)
    assert sorted(i for c in chunks for i in c) == list(range(6))
    for c in chunks:  # within budget unless a single long row
        assert len(c) == 1 or max(lengths[i] for i in c) * len(c) <= 80
    assert [5] in chunks  # the longest row alone
