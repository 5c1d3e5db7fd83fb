"""Tests of rspo_gigpo.py: GiGPO advantages and step returns against hand-computed numbers, the losses, the swap,
the replay buffer, and 2-iteration end-to-end runs of the script on both benchmarks (all reward modes, resume)."""

import contextlib
import json
import math
import subprocess
import sys

import pytest
import torch

import rspo_gigpo as gg
from common import envs as cenvs
from envs import alfworld

# ---------------------------------------------------------------------------------------------------------------
# compute_discounted_step_returns
# ---------------------------------------------------------------------------------------------------------------


def test_discounted_step_returns_contiguous():
    # traj 7: R2 = 2, R1 = 0 + 0.5 * 2 = 1, R0 = 1 + 0.5 * 1 = 1.5; traj 9: R1 = 3, R0 = 0 + 0.5 * 3 = 1.5
    r = gg.compute_discounted_step_returns(torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0]), [7, 7, 7, 9, 9], gamma=0.5)
    assert torch.allclose(r, torch.tensor([1.5, 1.0, 2.0, 1.5, 3.0]))


def test_discounted_step_returns_interleaved_and_tensor_ids():
    # a: turns 0 and 2 -> [1 + 0.9 * 3, 3]; b: turns 1 and 3 -> [2 + 0.9 * 4, 4]
    expected = torch.tensor([3.7, 5.6, 3.0, 4.0])
    r = gg.compute_discounted_step_returns(torch.tensor([1.0, 2.0, 3.0, 4.0]), ["a", "b", "a", "b"], gamma=0.9)
    assert torch.allclose(r, expected)
    r = gg.compute_discounted_step_returns(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 1, 0, 1]), gamma=0.9)
    assert torch.allclose(r, expected)


def test_discounted_step_returns_default_gamma():
    # outcome 10 at the third turn: [0.95^2 * 10, 0.95 * 10, 10]
    r = gg.compute_discounted_step_returns(torch.tensor([0.0, 0.0, 10.0]), [0, 0, 0])
    assert torch.allclose(r, torch.tensor([9.025, 9.5, 10.0]))


# ---------------------------------------------------------------------------------------------------------------
# compute_grpo_advantages / compute_gigpo_advantages
# ---------------------------------------------------------------------------------------------------------------


def test_grpo_advantages_std_and_singleton():
    adv = gg.compute_grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 5.0]), [0, 0, 0, 1])
    std = math.sqrt(7 / 3)  # unbiased std of (1, 0, 3)
    expected = torch.tensor([(1 - 4 / 3) / std, (0 - 4 / 3) / std, (3 - 4 / 3) / std, 5.0])
    assert torch.allclose(adv, expected, atol=1e-5)
    adv = gg.compute_grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 5.0]), [0, 0, 0, 1], norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([-1 / 3, -4 / 3, 5 / 3, 5.0]))


def _shared_state_case():
    # Task group 0. Trajectory A visits s0, s1, s2 and solves at its third turn (return 10); B visits s0, s3, s1,
    # s4 and fails. s1 is shared at different time steps (A: t=1, B: t=2). gamma = 0.5.
    anchors = ["s0", "s1", "s2", "s0", "s3", "s1", "s4"]
    traj = [0, 0, 0, 1, 1, 1, 1]
    episode = torch.tensor([10.0] * 3 + [0.0] * 4)
    step = gg.compute_discounted_step_returns(torch.tensor([0, 0, 10.0, 0, 0, 0, 0]), traj, gamma=0.5)
    assert torch.allclose(step, torch.tensor([2.5, 5.0, 10.0, 0, 0, 0, 0]))
    return episode, step, [0] * 7, traj, anchors


def test_gigpo_shared_state_at_different_time_steps():
    episode, step, groups, traj, anchors = _shared_state_case()
    adv, adv_e, adv_s, sg = gg.compute_gigpo_advantages(episode, step, groups, traj, anchors, return_components=True)
    # A^E: each trajectory once: mean(10, 0) = 5 (turn-weighted rows would give 30/7)
    assert torch.allclose(adv_e, torch.tensor([5.0] * 3 + [-5.0] * 4))
    # s0: {2.5, 0} mean 1.25; s1: {5 (A, t=1), 0 (B, t=2)} mean 2.5; s2, s3, s4 singletons -> 0
    assert torch.allclose(adv_s, torch.tensor([1.25, 2.5, 0.0, -1.25, 0.0, -2.5, 0.0]))
    assert torch.allclose(adv, torch.tensor([6.25, 7.5, 5.0, -6.25, -5.0, -7.5, -5.0]))
    assert sg.tolist() == [0, 1, 2, 0, 3, 1, 4]
    # step_weight scales A^S only
    adv_half = gg.compute_gigpo_advantages(episode, step, groups, traj, anchors, step_weight=0.5)
    assert torch.allclose(adv_half, adv_e + 0.5 * adv_s)


def test_gigpo_normalised_by_std():
    episode, step, groups, traj, anchors = _shared_state_case()
    adv, adv_e, adv_s, _ = gg.compute_gigpo_advantages(
        episode, step, groups, traj, anchors, norm_by_std=True, return_components=True
    )
    h = 1 / math.sqrt(2)  # any pair (x, y): (x - mean) / std = +-1/sqrt(2)
    assert torch.allclose(adv_e, torch.tensor([h] * 3 + [-h] * 4), atol=1e-5)
    assert torch.allclose(adv_s, torch.tensor([h, h, 0.0, -h, 0.0, -h, 0.0]), atol=1e-5)
    assert torch.allclose(adv, adv_e + adv_s)


def test_gigpo_singleton_states_and_groups_do_not_pool_across_tasks():
    # Every anchor unique within its task group; the same text "s" in two task groups must not pool.
    episode = torch.tensor([4.0, 4.0, 0.0, 2.0, 6.0])
    step = torch.tensor([3.0, 4.0, 0.0, 2.0, 6.0])
    groups = ["g0", "g0", "g0", "g1", "g1"]
    traj = [0, 0, 1, 2, 3]
    anchors = ["s", "t", "u", "s", "v"]
    adv, adv_e, adv_s, sg = gg.compute_gigpo_advantages(episode, step, groups, traj, anchors, return_components=True)
    assert torch.all(adv_s == 0)
    assert torch.allclose(adv, adv_e)
    assert torch.allclose(adv_e, torch.tensor([2.0, 2.0, -2.0, -2.0, 2.0]))
    assert len(set(sg.tolist())) == 5


def test_gigpo_repeated_state_inside_one_trajectory():
    # A: s0, s1, s0, s2, solved at t=3 (gamma 0.5 -> [1.25, 2.5, 5, 10]); B: s0, s3, fails.
    anchors = ["s0", "s1", "s0", "s2", "s0", "s3"]
    traj = torch.tensor([0, 0, 0, 0, 1, 1])
    step = gg.compute_discounted_step_returns(torch.tensor([0, 0, 0, 10.0, 0, 0]), traj, gamma=0.5)
    assert torch.allclose(step, torch.tensor([1.25, 2.5, 5.0, 10.0, 0.0, 0.0]))
    episode = torch.tensor([10.0] * 4 + [0.0] * 2)
    adv, adv_e, adv_s, _ = gg.compute_gigpo_advantages(
        episode, step, torch.zeros(6, dtype=torch.long), traj, anchors, return_components=True
    )
    m = (1.25 + 5.0 + 0.0) / 3  # s0 has three members, two of them from A
    assert torch.allclose(adv_s, torch.tensor([1.25 - m, 0.0, 5.0 - m, 0.0, -m, 0.0]))
    assert torch.allclose(adv_e, torch.tensor([5.0] * 4 + [-5.0] * 2))
    # A single trajectory revisiting a state is a non-singleton step group too
    _, _, adv_s1, _ = gg.compute_gigpo_advantages(
        torch.tensor([0.0, 0.0]), torch.tensor([1.0, 3.0]), [0, 0], [0, 0], ["x", "x"], return_components=True
    )
    assert torch.allclose(adv_s1, torch.tensor([-1.0, 1.0]))


def test_gigpo_similarity_grouping_is_greedy_to_first_representative():
    # ratio("aaaa", "aaab") = 0.75, ratio("aaaa", "aabb") = 0.5, ratio("aaab", "aabb") = 0.75
    sg = gg.build_step_groups([0, 0, 0, 1], ["aaaa", "aaab", "aabb", "aaab"], similarity_thresh=0.7)
    # "aabb" is compared with the group's representative "aaaa" (not with "aaab"): new group; task 1 separate
    assert sg.tolist() == [0, 0, 1, 2]
    assert gg.build_step_groups([0, 0, 0], ["aaaa", "aaab", "aaaa"]).tolist() == [0, 1, 0]
    adv = gg.compute_gigpo_advantages(
        torch.tensor([0.0, 0.0, 0.0]),
        torch.tensor([1.0, 3.0, 8.0]),
        [0, 0, 0],
        [0, 1, 2],
        ["you are at desk 1", "you are at desk 2", "kitchen"],
        similarity_thresh=0.9,
    )
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 0.0]))


def test_gigpo_rejects_inconsistent_inputs():
    with pytest.raises(ValueError, match="one entry per turn"):
        gg.compute_gigpo_advantages(torch.zeros(3), torch.zeros(2), [0, 0, 0], [0, 0, 0], ["a", "b", "c"])
    with pytest.raises(ValueError, match="two task groups"):
        gg.compute_gigpo_advantages(torch.zeros(2), torch.zeros(2), [0, 1], [5, 5], ["a", "b"])
    with pytest.raises(ValueError, match="different episode returns"):
        gg.compute_gigpo_advantages(torch.tensor([1.0, 2.0]), torch.zeros(2), [0, 0], [5, 5], ["a", "b"])


# ---------------------------------------------------------------------------------------------------------------
# Swapped members and the swap
# ---------------------------------------------------------------------------------------------------------------


def _traj(task, anchors, won, sampled_by="policy", process=None, iteration=1):
    n = len(anchors)
    process = process or [0.5] * n
    turns = [
        gg.Turn(
            prompt_ids=[1, 2],
            response_ids=[3],
            behaviour_logprobs=[-0.5],
            action="a",
            valid=True,
            anchor_obs=a,
            outcome_reward=1.0 if (won and t == n - 1) else 0.0,
            process_reward=process[t],
            done=t == n - 1,
            truncated=False,
        )
        for t, a in enumerate(anchors)
    ]
    return gg.Trajectory(
        task_seed=task,
        group_id=task,
        turns=turns,
        won=won,
        task_score=float(won),
        outcome_return=10.0 * won,
        process_return=sum(process),
        sampler=sampled_by,
        iteration=iteration,
    )


ADV_KW = dict(outcome_scale=10.0, gamma=0.95, step_weight=1.0, norm_by_std=False, similarity_thresh=None)


def _adv(trajs, reward, penalty=0.1):
    _, adv, stats = gg.gigpo_turn_advantages(trajs, reward, invalid_penalty=penalty, **ADV_KW)
    return adv, stats


def test_swapped_members_join_episode_and_step_groups():
    p1, p2 = _traj(3, ["a", "b"], False), _traj(3, ["a", "c"], False)
    explorer = _traj(3, ["a", "d", "e"], True, sampled_by="explorer", process=[100.0, -50.0, 7.0])
    adv, stats = _adv([p1, p2], "outcome")
    assert torch.all(adv == 0) and gg.nonzero_adv_group_share([p1, p2], adv) == 0.0
    (swapped,) = gg.swap_rewards([explorer])
    adv, stats = _adv([p1, p2, swapped], "outcome")
    # A^E: mean(0, 0, 10) = 10/3; step returns of E: [9.025, 9.5, 10]; step group "a": {0, 0, 9.025}
    e, m = 10 / 3, 9.025 / 3
    expected = [-e - m, -e, -e - m, -e, 2 * e + 9.025 - m, 2 * e, 2 * e]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)
    assert gg.nonzero_adv_group_share([p1, p2, swapped], adv) == 1.0
    assert stats["gigpo/num_step_groups"] == 5 and stats["gigpo/step_group_size_max"] == 3
    assert stats["gigpo/nonsingleton_turn_frac"] == pytest.approx(3 / 7)


def test_swap_drops_process_rewards():
    explorer = _traj(3, ["a", "d"], True, sampled_by="explorer", process=[100.0, -50.0])
    (swapped,) = gg.swap_rewards([explorer])
    assert swapped.process_return is None and swapped.sampler == "explorer"
    assert all(t.process_reward is None for t in swapped.turns)
    assert swapped.outcome_return == 10.0 and swapped.turns[-1].outcome_reward == 1.0
    assert explorer.process_return == 50.0  # the original is untouched
    # nothing derived from the process reward can enter: the process-reward path fails on swapped trajectories
    with pytest.raises(ValueError, match="no process reward"):
        _adv([swapped], "process")
    # and the outcome advantages do not depend on what the process rewards were
    other = gg.swap_rewards([_traj(3, ["a", "d"], True, sampled_by="explorer", process=[-3.0, 9.0])])[0]
    p = _traj(3, ["a", "b"], False)
    a1, _ = _adv([p, swapped], "outcome")
    a2, _ = _adv([p, other], "outcome")
    assert torch.equal(a1, a2)


def test_explorer_uses_process_rewards_as_step_rewards():
    t1 = _traj(0, ["a", "b"], False, process=[1.0, 2.0])
    t2 = _traj(0, ["a", "c"], False, process=[0.0, 0.0])
    t2.turns[1].valid = False
    adv, _ = _adv([t1, t2], "process")
    # episode (process returns 3, 0): +-1.5; step returns t1: [1 + 0.95 * 2, 2], t2: [0, 0]; group "a": +-1.45
    assert torch.allclose(adv, torch.tensor([1.5 + 1.45, 1.5, -1.5 - 1.45, -1.5 - 0.1]), atol=1e-5)


def _naive_gigpo(trajs, gamma, norm):
    """Reference: GiGPO written out turn by turn with plain Python loops (O(N^2))."""
    turns = [(t, traj) for traj in trajs for t in range(len(traj.turns))]

    def step_return(traj, t):
        return sum(gamma**k * 10.0 * traj.turns[t + k].outcome_reward for k in range(len(traj.turns) - t))

    def centred(x, xs):
        if len(xs) == 1:
            return 0.0
        mean = sum(xs) / len(xs)
        std = (sum((v - mean) ** 2 for v in xs) / (len(xs) - 1)) ** 0.5
        return (x - mean) / (std + 1e-6) if norm else x - mean

    out = []
    for t, traj in turns:
        group = [u for u in trajs if u.group_id == traj.group_id]
        a_e = centred(traj.outcome_return, [u.outcome_return for u in group]) if len(group) > 1 else traj.outcome_return
        same = [
            step_return(u, k)
            for k, u in turns
            if u.group_id == traj.group_id and u.turns[k].anchor_obs == traj.turns[t].anchor_obs
        ]
        out.append(a_e + centred(step_return(traj, t), same) - 0.1 * (not traj.turns[t].valid))
    return torch.tensor(out)


@pytest.mark.parametrize("norm", [False, True])
def test_gigpo_on_real_alfworld_anchors_matches_naive_reference(norm):
    """Episodes of the embedded ALFWorld env (expert with random detours and invalid turns) share real anchor
    states; the batch computation equals a turn-by-turn reference."""
    import random

    rng = random.Random(0)
    seeds = cenvs.split_seeds("alfworld", "train", 2)
    trajs = []
    for seed in seeds:
        for member in range(4):
            env = cenvs.make_env("alfworld", preset="small", max_steps=8)
            obs, info = env.reset(seed)
            turns, done = [], False
            while not done:
                r = rng.random()
                action = (
                    info["expert_action"]
                    if r < 0.6 or member == 0
                    else ("bad" if r < 0.7 else rng.choice(info["admissible_actions"]))
                )
                anchor = info["anchor"]
                obs, reward, done, info = env.step(action)
                turns.append(
                    gg.Turn(
                        [1], [2], [-1.0], action, action != "bad", anchor, reward, info["process_reward"], done, False
                    )
                )
            won = bool(info["won"])
            trajs.append(gg.Trajectory(seed, seed, turns, won, 10.0 * won, 0.0, "policy", 1, task_score=float(won)))
    kw = dict(ADV_KW, norm_by_std=norm)
    _, adv, stats = gg.gigpo_turn_advantages(trajs, "outcome", invalid_penalty=0.1, **kw)
    assert torch.allclose(adv, _naive_gigpo(trajs, 0.95, norm), atol=1e-4)
    assert stats["gigpo/nonsingleton_turn_frac"] > 0.3  # expert prefixes revisit the same states
    assert any(t.won for t in trajs) and not all(t.won for t in trajs)


# ---------------------------------------------------------------------------------------------------------------
# Losses, importance weights, buffer
# ---------------------------------------------------------------------------------------------------------------


def test_policy_loss_clip_and_dual_clip():
    old = torch.zeros(2, 2)
    lp = torch.log(torch.tensor([[1.5, 0.9], [5.0, 0.5]]))
    adv = torch.tensor([1.0, -1.0])
    w = torch.tensor([[1.0, 1.0], [1.0, 0.5]])
    # (0,0): max(-1.5, -1.2) = -1.2 clipped; (0,1): -0.9; (1,0): max(5, 1.2) = 5 -> dual clip 3; (1,1): 0.8 * 0.5
    loss, clipped = gg.policy_loss(lp, old, adv, torch.ones(2, 2), w)
    assert loss.item() == pytest.approx(-1.2 - 0.9 + 3.0 + 0.4, abs=1e-5)
    assert clipped.item() == 2
    loss, clipped = gg.policy_loss(lp, old, adv, torch.tensor([[1, 0], [1, 1]]), w)
    assert loss.item() == pytest.approx(-1.2 + 3.0 + 0.4, abs=1e-5)
    loss, _ = gg.policy_loss(lp, old, adv, torch.ones(2, 2), w, dual_clip=0.0)
    assert loss.item() == pytest.approx(-1.2 - 0.9 + 5.0 + 0.4, abs=1e-5)


def test_kl_and_importance_weights():
    kl = gg.kl_k3(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    old, behaviour = torch.log(torch.tensor([0.3, 0.1, 0.01])), torch.log(torch.tensor([0.1, 0.2, 0.2]))
    w = gg.truncated_importance_weights(old, behaviour, cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, 0.5, 0.05]))
    own = gg.truncated_importance_weights(old, behaviour, cap=2.0, off_policy=torch.tensor([True, False, True]))
    assert torch.allclose(own, torch.tensor([2.0, 1.0, 0.05]))
    stats = gg.importance_weight_stats(w, torch.ones(3, dtype=torch.bool))
    assert stats["mean"] == pytest.approx(0.85) and stats["frac_below_0.1"] == pytest.approx(1 / 3)
    assert stats["ess"] == pytest.approx(2.55**2 / (3 * (4 + 0.25 + 0.0025)))
    assert gg.importance_weight_stats(w, torch.zeros(3, dtype=torch.bool)) == {}


def test_replay_buffer_capacity_age_and_state():
    buf = gg.ReplayBuffer(capacity=3, max_age=1)
    with pytest.raises(ValueError, match="swapped"):
        buf.add([_traj(1, ["a"], True, "explorer")], iteration=1)
    buf.add(gg.swap_rewards([_traj(1, ["a"], True, "explorer"), _traj(2, ["b"], False, "explorer")]), iteration=1)
    assert [t.task_seed for t in buf.sample([1, 5], iteration=1)] == [1]
    assert [t.task_seed for t in buf.sample([1, 2], iteration=2)] == [1, 2]  # age 1 <= max_age
    buf.add(gg.swap_rewards([_traj(3, ["c"], True, "explorer", iteration=2)] * 2), iteration=2)
    assert len(buf) == 3  # capacity: the oldest entry left first
    assert [t.task_seed for t in buf.sample([1, 2, 3], iteration=2)] == [2, 3, 3]
    other = gg.ReplayBuffer(capacity=3, max_age=1)
    other.load_state_dict(buf.state_dict())
    assert other.sample([2, 3], iteration=2) == buf.sample([2, 3], iteration=2)
    assert [t.task_seed for t in buf.sample([1, 2, 3], iteration=3)] == [3, 3]  # the iteration-1 entry expired
    assert len(buf) == 2


def test_token_logprobs_padding_invariant(small_lm):
    model = small_lm(vocab_size=50).eval()
    seq = torch.tensor([[5, 7, 9, 11, 13]])
    ref, none = gg.token_logprobs(model, seq, torch.ones_like(seq), temperature=0.7)
    assert none is None
    left = torch.tensor([[0, 0, 5, 7, 9, 11, 13]])
    left_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    lp, ent = gg.token_logprobs(model, left, left_mask, temperature=0.7, with_entropy=True)
    assert torch.allclose(lp[:, 2:], ref, atol=1e-5)
    assert ent.shape == lp.shape and torch.all(ent > 0)
    logits = model(seq).logits[0, :-1] / 0.7
    assert torch.allclose(ref[0], torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None]).squeeze(-1), atol=1e-5)


def test_bool_flag_pair():
    argv = ["--env", "webshop", "--no-norm-adv-by-std", "--norm-adv-by-std", "--norm-adv-by-std", "True"]
    out = gg.bool_flag_pair(argv, "norm-adv-by-std")
    assert out == ["--env", "webshop", "--norm-adv-by-std", "False", "--norm-adv-by-std", "True"] + [
        "--norm-adv-by-std",
        "True",
    ]


# ---------------------------------------------------------------------------------------------------------------
# the script end to end (subprocess, tiny sizes)
# ---------------------------------------------------------------------------------------------------------------

SMALL = [
    "--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "2", "--explorer-rollouts-per-task", "2",
    "--max-steps", "4", "--max-new-tokens", "12", "--train-pool-size", "3", "--num-eval-tasks", "2",
    "--eval-every", "2", "--no-eval-at-start", "--minibatch-tokens", "4096", "--micro-batch-tokens", "2048",
]  # fmt: skip
KEYS = [
    "iteration", "env_steps", "train/success_rate", "train/outcome_return", "train/process_return",
    "train/episode_length", "train/invalid_turn_rate", "train/nonzero_adv_groups_before_swap", "losses/policy_loss",
    "losses/kl", "losses/entropy", "losses/clip_frac", "losses/approx_kl", "perf/rollout_s", "perf/update_s",
    "perf/gen_tokens_per_s", "perf/train_tokens_per_s", "gigpo/num_step_groups", "gigpo/step_group_size_mean",
    "gigpo/step_group_size_max", "gigpo/nonsingleton_turn_frac", "gigpo/abs_episode_adv", "gigpo/abs_step_adv",
]  # fmt: skip
SWAP_KEYS = [
    "train/nonzero_adv_groups_after_swap", "explorer/success_rate", "explorer/kl_to_policy", "is_weight/mean",
    "is_weight/frac_below_0.1", "is_weight/ess", "buffer/sampled",
]  # fmt: skip


def _run_script(repo_root, script_env, *flags, timeout=300):
    cmd = [sys.executable, str(repo_root / "rspo_gigpo.py"), *SMALL, *flags]
    proc = subprocess.run(cmd, cwd=repo_root, env=script_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _only_run(runs_dir):
    (run_dir,) = [p for p in runs_dir.iterdir() if p.is_dir()]
    return run_dir


def _check_run(run_dir, env, mode, norm_by_std=None):
    rows = _metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    eval_keys = ["eval/success_rate", "eval/success_ci95"] + (
        ["eval/score", "eval/score_ci95"] if env == "webshop" else []
    )
    assert set(eval_keys) <= set(rows[1]) and "eval/success_rate" not in rows[0]
    assert ("eval/score" in rows[1]) == (env == "webshop")
    config = json.loads((run_dir / "config.json").read_text())["args"]
    by_type = {k[len("eval/success_") :]: v for k, v in rows[1].items() if k.startswith("eval/success_")}
    del by_type["rate"], by_type["ci95"]
    if env == "webshop":
        assert not by_type
    else:  # success per task type: the games of each type among the evaluation seeds, weighted, give the whole
        n, pool, split = config["num_eval_tasks"], config["train_pool_size"], config["eval_split"]
        _, seeds = cenvs.seed_pools("alfworld", pool, n, eval_split=split)
        types = [alfworld.generate_layout(s, config["env_preset"]).task_type for s in seeds]
        assert set(by_type) == set(types)
        whole = sum(by_type[t] * types.count(t) for t in by_type) / len(types)
        assert whole == pytest.approx(rows[1]["eval/success_rate"])
    for r in rows:
        missing = [k for k in KEYS + (SWAP_KEYS if mode == "swap" else []) if k not in r]
        assert not missing, f"{env} {mode}: missing {missing}"
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        if mode != "swap":
            assert not any(k.startswith(("explorer/", "is_weight/")) for k in r)
        # every member of a task group starts from the same state: the t=0 anchors always form a step group
        assert r["gigpo/step_group_size_max"] >= 2 and r["gigpo/nonsingleton_turn_frac"] > 0
        assert r["gigpo/num_step_groups"] >= 2  # at least one per task group
    assert 0 < rows[0]["env_steps"] < rows[1]["env_steps"]
    if mode == "swap":
        # explorer steps count too: 2 tasks x (2 policy + 2 explorer) episodes of at least one step each
        assert rows[0]["env_steps"] >= 8 and rows[0]["buffer/sampled"] >= 4
    assert (run_dir / "checkpoints" / "latest.pt").is_file()
    assert (run_dir / "model" / "config.json").is_file()
    assert config["reward_mode"] == mode and config["env"] == env
    # per-benchmark default: ALFWorld mean/std, WebShop mean-only
    assert config["norm_adv_by_std"] == (env == "alfworld" if norm_by_std is None else norm_by_std)


@pytest.fixture(scope="module")
def swap_run(repo_root, script_env, tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("gigpo_swap")
    _run_script(repo_root, script_env, "--env", "alfworld", "--track", "--runs-dir", str(runs_dir))
    return _only_run(runs_dir)


def test_script_alfworld_swap_tracked(swap_run):
    _check_run(swap_run, "alfworld", "swap")
    assert (swap_run / "wandb").exists() or any(swap_run.rglob("*.wandb")), "the --track run left no wandb files"
    ckpt = torch.load(swap_run / "checkpoints" / "latest.pt", map_location="cpu", weights_only=False)
    assert ckpt["iteration"] == 2 and {"policy", "ref", "explorer"} <= set(ckpt["modules"])
    assert len(ckpt["extra"]["buffer"]["entries"]) >= 8  # 2 iterations x 2 tasks x 2 explorer rollouts


@pytest.mark.parametrize(
    "env,mode,extra",
    [
        ("alfworld", "outcome", ["--similarity-thresh", "0.9"]),
        ("alfworld", "process", []),
        ("webshop", "swap", ["--explorer-sync-every", "2", "--off-policy-correction", "none"]),
        ("webshop", "outcome", ["--norm-adv-by-std"]),
        ("webshop", "process", []),
    ],
)
def test_script_env_and_reward_modes(repo_root, script_env, tmp_path, env, mode, extra):
    _run_script(repo_root, script_env, "--env", env, "--reward-mode", mode, *extra, "--runs-dir", str(tmp_path))
    _check_run(_only_run(tmp_path), env, mode, norm_by_std=True if "--norm-adv-by-std" in extra else None)


def test_script_resume_and_eval_only(repo_root, script_env, swap_run):
    before = _metrics(swap_run)
    _run_script(
        repo_root, script_env, "--env", "alfworld", "--num-iterations", "3", "--resume", str(swap_run),
        "--runs-dir", str(swap_run.parent),
    )  # fmt: skip
    rows = _metrics(swap_run)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[:2] == before  # the earlier rows are kept as they were
    assert rows[2]["env_steps"] > before[1]["env_steps"]
    assert "eval/success_rate" in rows[2]  # the last iteration evaluates
    ckpt = torch.load(swap_run / "checkpoints" / "latest.pt", map_location="cpu", weights_only=False)
    assert ckpt["iteration"] == 3
    proc = _run_script(
        repo_root, script_env, "--env", "alfworld", "--eval-only", "--resume", str(swap_run),
        "--runs-dir", str(swap_run.parent),
    )  # fmt: skip
    assert "eval success_rate" in proc.stdout


@pytest.mark.parametrize("env", ["webshop", "alfworld"])
def test_script_evaluates_on_the_validation_split(repo_root, script_env, tmp_path, env):
    """--eval-split valid (training goals from 2,048 on, where defaults are chosen) is accepted on both envs."""
    proc = _run_script(
        repo_root, script_env, "--env", env, "--eval-only", "--eval-split", "valid", "--num-eval-tasks", "2",
        "--runs-dir", str(tmp_path),
    )  # fmt: skip
    assert "eval success_rate" in proc.stdout
    assert json.loads((_only_run(tmp_path) / "config.json").read_text())["args"]["eval_split"] == "valid"


def test_rows_skip_empty_responses_and_keep_turn_indices():
    a, b = _traj(0, ["x", "y", "z"], False), gg.swap_rewards([_traj(0, ["x"], True, sampled_by="explorer")])[0]
    a.turns[1].response_ids, a.turns[1].behaviour_logprobs = [], []
    rows = gg.make_rows([a]) + gg.make_rows([b], turn_offset=3)
    assert [r.turn_index for r in rows] == [0, 2, 3]
    gg.set_advantages(rows, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert [r.advantage for r in rows] == [1.0, 3.0, 4.0]
    assert [r.swapped for r in rows] == [False, False, True]  # the swapped trajectory's rows only


def test_update_is_the_same_under_gradient_accumulation(small_lm):
    """Token-mean over the minibatch: one row per micro-batch gives the same step as one micro-batch for all."""
    gen = torch.Generator().manual_seed(3)
    params = []
    for micro in (10_000, 1):
        model, ref = small_lm(0), small_lm(1)
        rows = []
        for i in range(5):
            p, r = 3 + i % 3, 2 + i % 2
            ids = torch.randint(1, 40, (p + r,), generator=gen.manual_seed(i)).tolist()
            rows.append(gg.Row(ids, p, [-3.0] * r, float(i - 2), swapped=i == 4, iteration=1))
        args = gg.Args(
            temperature=1.0, is_cap=2.0, minibatch_tokens=10_000, micro_batch_tokens=micro, clip_coef=0.2,
            dual_clip=3.0, kl_coef=0.01, ent_coef=0.001, max_grad_norm=1e9, off_policy_correction="tis",
        )  # fmt: skip
        kw = dict(pad_id=0, autocast=contextlib.nullcontext)
        gg.prepare_rows(model, ref, rows, args, **kw)
        assert all(torch.all(r.is_weights == 1) for r in rows[:4]) and torch.all(rows[4].is_weights <= 2.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        stats = gg.update(model, opt, rows, args, epochs=1, **kw)
        assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == pytest.approx(0.0, abs=1e-10)
        params.append(torch.cat([q.detach().flatten() for q in model.parameters()]))
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)
    assert not torch.equal(params[0], torch.cat([q.detach().flatten() for q in small_lm(0).parameters()]))
