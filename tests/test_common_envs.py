"""common/envs.py against the real embedded environments: groups share a seed, lockstep stepping equals stepping
each env alone, finished envs freeze and can be reset, seed pools are disjoint."""

import numpy as np
import pytest

from common import envs as cenvs
from tiny_models import build as tiny_build

ENV_NAMES = ["webshop", "alfworld"]
MAX_STEPS = {"webshop": 15, "alfworld": 50}


def test_group_seeds():
    assert cenvs.group_seeds([5, 9], 3) == [5, 5, 5, 9, 9, 9]
    assert cenvs.group_seeds([4], 1) == [4]
    assert cenvs.group_seeds([], 2) == []
    with pytest.raises(ValueError):
        cenvs.group_seeds([1], 0)


def test_unknown_env_name():
    with pytest.raises(ValueError, match="unknown env 'minigrid'"):
        cenvs.make_env("minigrid")
    with pytest.raises(ValueError, match="webshop, alfworld"):
        cenvs.LockstepEnvs("minigrid", 2)


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_seed_pools(env_name):
    mod = cenvs.env_module(env_name)
    assert cenvs.split_seeds(env_name, "train", 5) == mod.split_seeds("train", 5)
    train, evaluation = cenvs.seed_pools(env_name, 6, 4)
    assert len(train) == 6 and len(evaluation) == 4 and not set(train) & set(evaluation)
    assert train[:5] == cenvs.split_seeds(env_name, "train", 5)  # the first n seeds of the split
    assert evaluation == cenvs.split_seeds(env_name, cenvs.EVAL_SPLIT[env_name], 4)
    if env_name == "webshop":
        assert train[0] == 500 and evaluation == [0, 1, 2, 3]
    # the validation split: training seeds never trained on and past every warm start's demonstrations
    train, valid = cenvs.seed_pools(env_name, 6, 4, eval_split="valid")
    start = cenvs.VALID_START
    assert valid == cenvs.split_seeds(env_name, "train", start + 4)[start:] and not set(train) & set(valid)
    demonstrated = set(cenvs.split_seeds(env_name, "train", tiny_build.tiny_config(env_name)["bc_train_seeds"]))
    assert not demonstrated & set(valid)
    _, after_big_pool = cenvs.seed_pools(env_name, start + 10, 4, eval_split="valid")
    assert after_big_pool == cenvs.split_seeds(env_name, "train", start + 14)[start + 10 :]


def _actions(infos, rng, k):
    """A mix per env: the expert's action, a random admissible one, or gibberish."""
    out = []
    for i, info in enumerate(infos):
        r = (i + k) % 3
        if r == 0:
            out.append(info["expert_action"])
        elif r == 1:
            out.append(str(rng.choice(info["admissible_actions"])))
        else:
            out.append("dance wildly <action>")
    return out


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_lockstep_equals_independent_envs(env_name):
    task_seeds = cenvs.split_seeds(env_name, "train", 2)
    seeds = cenvs.group_seeds(task_seeds, 3)
    lock = cenvs.LockstepEnvs(env_name, 6, max_steps=6)
    alone = [cenvs.make_env(env_name, max_steps=6) for _ in range(6)]
    obs, infos = lock.reset(seeds)
    ref = [e.reset(s) for e, s in zip(alone, seeds)]
    assert obs == [o for o, _ in ref] and [i["task"] for i in infos] == [i["task"] for _, i in ref]
    # A group shares its task and world; the two groups differ.
    assert len({o for o in obs[:3]}) == 1 and len({o for o in obs[3:]}) == 1 and obs[0] != obs[3]
    assert lock.active == [True] * 6 and lock.steps == [0] * 6 and lock.seeds == seeds

    rng = np.random.default_rng(0)
    done_ref = [False] * 6
    for k in range(8):
        actions = _actions(lock.infos, rng, k)
        actions[5] = None if k == 1 else actions[5]  # a skipped active env
        obs, rewards, dones, infos = lock.step(actions)
        for i, env in enumerate(alone):
            if done_ref[i] or actions[i] is None:
                continue
            o, r, d, info = env.step(actions[i])
            assert (obs[i], rewards[i], dones[i]) == (o, r, d)
            assert infos[i]["admissible_actions"] == info["admissible_actions"]
            done_ref[i] = d
        assert lock.active == [not d for d in done_ref]
        assert dones == done_ref
        if k == 1:
            assert rewards[5] == 0.0 and dones[5] is False and lock.steps[5] == 1
    # max_steps=6 and 8 rounds: everybody is done, every env stopped at its own length.
    assert not any(lock.active) and all(1 <= s <= 6 for s in lock.steps)
    assert all(s == 6 for s, i in zip(lock.steps, lock.infos) if i.get("truncated"))


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_expert_in_lockstep_and_finished_envs_freeze(env_name):
    seeds = cenvs.group_seeds(cenvs.split_seeds(env_name, "train", 2), 2)
    lock = cenvs.LockstepEnvs(env_name, 4, max_steps=MAX_STEPS[env_name])
    lock.reset(seeds)
    total = [0.0] * 4
    frozen = {}
    while any(lock.active):
        # env 1 only plays gibberish: it ends at the step limit, the others when the expert solves the task.
        actions = [None if not a else ("xyzzy" if i == 1 else info["expert_action"]) for i, (a, info) in
                   enumerate(zip(lock.active, lock.infos))]  # fmt: skip
        was_active = list(lock.active)
        obs, rewards, dones, infos = lock.step(actions)
        for i in range(4):
            total[i] += rewards[i]
            if not was_active[i]:
                # A finished env reads its last values again, reward 0 and done.
                assert (obs[i], infos[i], rewards[i], dones[i]) == (*frozen[i], 0.0, True)
            elif dones[i]:
                frozen[i] = (obs[i], infos[i])
    assert total == [1.0, 0.0, 1.0, 1.0]
    assert [lock.infos[i]["won"] for i in range(4)] == [True, False, True, True]
    assert lock.infos[1].get("truncated") is True and lock.steps[1] == MAX_STEPS[env_name]
    # Finished envs start again with new seeds; an env given None stays finished.
    new = cenvs.split_seeds(env_name, "train", 3)[2]
    assert lock.reset_finished([new, new, None, new]) == [0, 1, 3]
    assert lock.active == [True, True, False, True] and lock.steps == [0, 0, lock.steps[2], 0]
    assert lock.seeds == [new, new, seeds[2], new]
    assert lock.obs[0] == lock.obs[1] == cenvs.make_env(env_name).reset(new)[0]


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_bad_calls_are_clear_errors(env_name):
    lock = cenvs.LockstepEnvs(env_name, 2)
    with pytest.raises(RuntimeError, match="before reset"):
        lock.step(["look", "look"])
    seed = cenvs.split_seeds(env_name, "train", 1)[0]
    lock.reset([np.int64(seed), seed])  # numpy integers are seeds too
    with pytest.raises(ValueError, match="one entry per env"):
        lock.step(["look"])
    with pytest.raises(ValueError, match="one entry per env"):
        lock.reset([seed])
    before = list(lock.obs)
    lock.step(["look", None])
    with pytest.raises(TypeError, match="seed of env 1"):
        lock.reset([seed, 1.5])
    assert lock.obs[1] == before[1] and lock.steps == [1, 0]  # nothing changed
    with pytest.raises(TypeError, match="action of env 0"):
        lock.step([3, None])
    with pytest.raises(ValueError):
        cenvs.LockstepEnvs(env_name, 0)
