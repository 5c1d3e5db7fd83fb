"""ALFWorld env: determinism, texts, rewards, expert, fuzzing, and fidelity against the real TextWorld engine."""

import importlib.util
import json
import pathlib
import random
import re
import time

import pytest

from envs import alfworld
from envs._alfworld_world import CAN_CONTAIN, GOAL_TEMPLATES, ROOMS, TASK_TYPES, UNSEEN_EVERY, kind_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_ENGINE = all(importlib.util.find_spec(m) is not None for m in ("alfworld", "textworld", "fast_downward"))
INFO_KEYS = {"process_reward", "won", "admissible_actions", "task", "task_type", "anchor", "expert_action", "truncated"}


def world_state(env):
    w = env.world
    return (
        w.location,
        sorted(w.opened),
        w.holding,
        {r: sorted(v) for r, v in w.contents.items()},
        sorted(w.clean),
        sorted(w.hot),
        sorted(w.cool),
        sorted(w.toggled),
    )


def expert_episode(env, seed):
    obs, info = env.reset(seed)
    steps = 0
    done = False
    while not done:
        assert info["expert_action"] in info["admissible_actions"]
        obs, reward, done, info = env.step(info["expert_action"])
        steps += 1
    return steps, reward, info


def test_reset_is_deterministic_and_info_complete():
    env_a, env_b = alfworld.make_env(), alfworld.make_env()
    for seed in (0, 17, 1_000_003, 2_000_009):
        obs_a, info_a = env_a.reset(seed)
        obs_b, info_b = env_b.reset(seed)
        assert obs_a == obs_b and info_a == info_b
        assert INFO_KEYS <= set(info_a)
        assert info_a["process_reward"] == 0.0 and info_a["won"] is False and info_a["anchor"] == obs_a
        assert obs_a.startswith("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.")
        assert obs_a.endswith(f"\n\nYour task is to: {info_a['task']}.")
        assert info_a["admissible_actions"] == sorted(info_a["admissible_actions"])
    # Different seeds give different games.
    assert len({alfworld.make_env().reset(s)[0] for s in range(20)}) == 20
    # A pinned game: the generator must not drift silently (same on every machine, no hash()).
    obs, info = alfworld.make_env().reset(3)
    assert info["task"] == "examine the pen with the desklamp"
    assert "you see a bed 1, a desk 1, a drawer 1, a dresser 1, a garbagecan 1, a shelf 1, and a sidetable 1." in obs


def test_expert_solves_every_task_type_within_the_limit():
    for preset, n in (("small", 1200), ("default", 1000)):
        env = alfworld.make_env(preset=preset)
        lengths = {t: [] for t in TASK_TYPES}
        seeds = alfworld.split_seeds("train", n // 2) + alfworld.split_seeds("valid_unseen", n // 2)
        for seed in seeds:
            steps, reward, info = expert_episode(env, seed)
            assert info["won"] and reward == 1.0 and not info["truncated"], (preset, seed)
            assert steps <= env.max_steps
            lengths[info["task_type"]].append(steps)
        assert all(len(v) > n // 12 for v in lengths.values()), {t: len(v) for t, v in lengths.items()}
        if preset == "small":
            assert max(max(v) for v in lengths.values()) <= 12


@pytest.mark.parametrize("preset", ["small", "default"])
def test_expert_recovers_from_any_state_a_random_agent_reaches(preset):
    # The scripts read info["expert_action"] after every policy step, so it must exist in every reachable
    # state (a random agent once held a mug in a room whose only mug-holder was the goal's sidetable).
    env = alfworld.make_env(preset=preset, max_steps=200)
    rng = random.Random(3)
    for seed in range(160):
        for trial in range(5):
            obs, info = env.reset(seed)
            for _ in range(rng.randint(1, 40)):
                obs, _, done, info = env.step(rng.choice(info["admissible_actions"]))
                if done:
                    break
            while not done:  # then the expert takes over and must finish the task
                assert info["expert_action"] in info["admissible_actions"]
                obs, _, done, info = env.step(info["expert_action"])
            assert info["won"], (preset, seed, trial)


def test_rooms_tasks_and_goal_phrasings():
    env = alfworld.make_env()
    seen_goals = {t: set() for t in TASK_TYPES}
    for seed in range(600):
        _, info = env.reset(seed)
        lay = env.world.layout
        assert lay.task_type in ROOMS[lay.room]["tasks"]
        assert 5 <= len(lay.receptacles) <= 8
        for template in GOAL_TEMPLATES[lay.task_type]:
            if info["task"] == template.format(o=lay.obj_kind, r=lay.recep_kind, lamp=lay.lamp_kind):
                seen_goals[lay.task_type].add(template)
        # Every object sits where its receptacle type can hold it; no task starts solved.
        for r, items in lay.contents.items():
            for o in items:
                assert kind_of(o) in CAN_CONTAIN[kind_of(r)] or o in lay.toggleable
        assert not env.world.won()
    assert all(len(v) == 2 for v in seen_goals.values()), seen_goals
    with pytest.raises(ValueError, match="unknown task types"):
        alfworld.make_env(task_types=("pick_and_fly",))
    only = alfworld.make_env(task_types=("pick_heat_then_place_in_recep",))
    assert {only.reset(s)[1]["task_type"] for s in range(30)} == {"pick_heat_then_place_in_recep"}


def test_literal_texts_and_dynamics():
    env = alfworld.make_env(task_types=("pick_heat_then_place_in_recep",))
    seed = next(s for s in range(500) if env.reset(s) and "microwave 1" in env.world.layout.openable)
    obs, info = env.reset(seed)
    w = env.world
    assert env.step("look")[0] == "You are in the middle of a room. Looking quickly around you, you see nothing."
    assert env.step("inventory")[0] == "You are not carrying anything."
    assert env.step("go to microwave 1")[0] == "You arrive at microwave 1. The microwave 1 is closed."
    assert "open microwave 1" in env.step("look")[3]["admissible_actions"]
    items = sorted(w.contents["microwave 1"], key=lambda o: (kind_of(o), -int(o.split()[-1])))
    listing = alfworld.display_list(items)
    obs, _, _, info = env.step("open microwave 1")
    assert obs == f"You open the microwave 1. The microwave 1 is open. In it, you see {listing}."
    assert "close microwave 1" in info["admissible_actions"] and "open microwave 1" not in info["admissible_actions"]
    assert env.step("close microwave 1")[0] == "You close the microwave 1."
    assert env.step("look")[0] == "You are facing the microwave 1. Next to it, you see nothing."
    assert env.step("  go to microwave 1  ")[0] == "Nothing happens."  # already there: not admissible
    assert env.step("")[0] == "Nothing happens."
    assert env.step("help")[0].startswith("Available commands:\n  look:")
    # List formatting.
    assert alfworld.display_list([]) == "nothing"
    assert alfworld.display_list(["apple 1"]) == "a apple 1"
    assert alfworld.display_list(["fork 1", "apple 1", "apple 2"]) == "a apple 2, a apple 1, and a fork 1"
    # Fetch, heat, examine, deliver with the expert and check each feedback's form.
    texts = []
    done = False
    while not done:
        action = info["expert_action"]
        obs, reward, done, info = env.step(action)
        texts.append((action, obs))
    verbs = {a.split()[0]: o for a, o in texts}
    o = w.layout.obj_kind
    assert re.fullmatch(rf"You pick up the {o} \d from the [a-z]+ \d\.", verbs["take"])
    assert re.fullmatch(rf"You heat the {o} \d using the microwave 1\.", verbs["heat"])
    assert re.fullmatch(rf"You move the {o} \d to the [a-z]+ \d\.", verbs["move"])
    held = next(x for x in w.hot)
    assert w.examine_object(held) == f"This is a hot {held}."
    w.clean.add(held)
    assert w.examine_object(held) == f"This is a hot and clean {held}."
    assert reward == 1.0 and info["won"] and done


def test_process_reward_and_anchor():
    env = alfworld.make_env(task_types=("pick_clean_then_place_in_recep",))
    obs0, info = env.reset(5)
    total = 0.0
    rewards = []
    while not info["won"]:
        prev_anchor = info["anchor"]
        obs, _, _, info = env.step("do a barrel roll")
        assert info["process_reward"] == pytest.approx(-0.1) and obs == "Nothing happens."
        assert info["anchor"] == prev_anchor
        obs, _, _, info = env.step(info["expert_action"])
        assert info["anchor"] == obs
        rewards.append(info["process_reward"])
        total += info["process_reward"]
    # Milestones: seen, in hand, cleaned, placed (+1 each); each first visit +0.1.
    visits = sum(1 for r in rewards if round(r * 10) % 10 == 1)
    assert total == pytest.approx(4.0 + 0.1 * visits)
    assert visits >= 2
    # A second visit of the same receptacle pays nothing; revisiting goals pays nothing again.
    env.reset(5)
    first = env.world.layout.receptacles[0]
    second = env.world.layout.receptacles[1]
    r1 = env.step(f"go to {first}")[3]["process_reward"]
    env.step(f"go to {second}")
    r3 = env.step(f"go to {first}")[3]["process_reward"]
    assert r1 >= 0.1 - 1e-9 and r3 == 0.0


def test_step_limit_truncates():
    env = alfworld.make_env(max_steps=3)
    env.reset(1)
    out = [env.step("look") for _ in range(3)]
    assert [o[2] for o in out] == [False, False, True]
    assert out[-1][3]["truncated"] is True and out[-1][3]["won"] is False and out[-1][1] == 0.0
    with pytest.raises(ValueError):
        alfworld.make_env(max_steps=0)
    with pytest.raises(ValueError, match="preset"):
        alfworld.make_env(preset="huge")
    with pytest.raises(RuntimeError, match="reset"):
        alfworld.make_env().step("look")


def test_fuzz_invalid_actions_never_change_state():
    rng = random.Random(0)
    env = alfworld.make_env()
    junk = ["", " ", "\n\t", "x" * 5000, "go to", "go to nowhere 1", "take", "Look", "LOOK", "go  to bed 1",
            "take apple 1 from", "open", "é à ü 你好 🙂", "\x00\x01", "move x to y", "use", "examine"]  # fmt: skip
    steps = 0
    for seed in range(120):
        obs, info = env.reset(seed)
        for _ in range(40):
            u = rng.random()
            if u < 0.45:
                action = rng.choice(info["admissible_actions"])
            elif u < 0.6:
                action = info["expert_action"]
            elif u < 0.8:
                action = rng.choice(junk)
            else:
                action = "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(0, 30)))
            before = world_state(env)
            valid = action.strip() in info["admissible_actions"]
            obs, reward, done, info = env.step(action)
            steps += 1
            assert isinstance(obs, str) and isinstance(info["admissible_actions"], list)
            if not valid:
                assert obs == "Nothing happens." and world_state(env) == before and reward == 0.0
            if done:
                break
    assert steps > 3000
    # Non-string actions are treated as text, never raise.
    env.reset(0)
    assert env.step(None)[0] == "Nothing happens."
    assert env.step(12345)[0] == "Nothing happens."


def test_splits_are_disjoint_and_unseen_plans_held_out():
    tr, vs, vu = (set(alfworld.split_seeds(s, 300)) for s in ("train", "valid_seen", "valid_unseen"))
    assert not (tr & vs or tr & vu or vs & vu)
    assert alfworld.split_seeds("train", 3) == [0, 1, 2]
    with pytest.raises(ValueError):
        alfworld.split_seeds("test", 3)
    env = alfworld.make_env()
    for seeds, unseen in ((tr, False), (vs, False), (vu, True)):
        for seed in sorted(seeds)[:100]:
            env.reset(seed)
            assert (env.world.layout.plan % UNSEEN_EVERY == 0) == unseen


@pytest.mark.parametrize("preset", ["small", "default"])
def test_text_corpus_covers_every_printed_word(preset):
    corpus = alfworld.text_corpus(preset)
    vocab = set(re.findall(r"[A-Za-z']+", " ".join(corpus)))
    env = alfworld.make_env(preset=preset)
    rng = random.Random(1)
    for seed in list(range(150, 230)) + alfworld.split_seeds("valid_unseen", 40):
        obs, info = env.reset(seed)
        words = set(re.findall(r"[A-Za-z']+", obs))
        for _ in range(20):
            obs, _, done, info = env.step(rng.choice(info["admissible_actions"]))
            words |= set(re.findall(r"[A-Za-z']+", obs + " " + " ".join(info["admissible_actions"])))
            if done:
                break
        assert words <= vocab, words - vocab


# ---- the real engine --------------------------------------------------------------------------------------------
def _real_engine_or_skip():
    if not HAS_ENGINE:
        reason = "alfworld / textworld[pddl] not installed (pip install alfworld): fidelity test skipped"
        print(reason)
        pytest.skip(reason)


def _compare_with_engine(seed, preset, n_steps, rng):
    env = alfworld.make_env(preset=preset)
    obs, info = env.reset(seed)
    real = alfworld.make_real_engine(alfworld.export_game(seed, preset))
    state = real.reset()
    assert state.feedback == obs
    assert state["admissible_commands"] == info["admissible_actions"]
    invalid = ["", "xyzzy", "  look  ", "take all", "go to  sofa 1", "open door 1", "examine",
               "é 你好", "x" * 300, "examine " + rng.choice(sorted(env.world.where))]  # fmt: skip
    for _ in range(n_steps):
        u = rng.random()
        if u < 0.4:
            action = info["expert_action"]
        elif u < 0.85:
            action = rng.choice(info["admissible_actions"])
        else:
            action = rng.choice(invalid)
        obs, reward, done, info = env.step(action)
        state, _, real_done = real.step(action)
        assert state.feedback == obs, (seed, action)
        assert state["admissible_commands"] == info["admissible_actions"], (seed, action)
        assert bool(state["won"]) == info["won"], (seed, action)
        if state["won"]:
            break


def test_fidelity_against_real_textworld_engine():
    _real_engine_or_skip()
    rng = random.Random(2024)
    start = time.time()
    seeds = alfworld.split_seeds("train", 12) + alfworld.split_seeds("valid_unseen", 6)
    for seed in seeds:
        _compare_with_engine(seed, "small", 25, rng)
    for seed in (5, 2_000_001):
        _compare_with_engine(seed, "default", 12, rng)
    print(f"fidelity: {len(seeds) + 2} games in {time.time() - start:.1f}s")


@pytest.mark.slow
@pytest.mark.parametrize("preset,n_games", [("small", 300), ("default", 40)])
def test_fidelity_against_real_engine_many_games(preset, n_games):
    _real_engine_or_skip()
    rng = random.Random(n_games)
    third = n_games // 3
    seeds = (
        alfworld.split_seeds("train", third)
        + alfworld.split_seeds("valid_seen", third)
        + alfworld.split_seeds("valid_unseen", n_games - 2 * third)
    )
    for seed in seeds:
        _compare_with_engine(seed, preset, 40, rng)


def test_real_backend_plays_exported_games_like_embedded(tmp_path):
    _real_engine_or_skip()
    seeds = alfworld.split_seeds("valid_seen", 4)
    for seed in seeds:
        emb = alfworld.make_env()
        emb.reset(seed)
        lay = emb.world.layout
        game_dir = tmp_path / "json_2.1.1" / "valid_seen" / f"{lay.task_type}-{seed}" / "trial_T0"
        game_dir.mkdir(parents=True)
        (game_dir / "game.tw-pddl").write_text(json.dumps(alfworld.export_game(seed)))
        params = {"object_target": lay.obj_kind, "parent_target": lay.recep_kind, "toggle_target": lay.lamp_kind}
        (game_dir / "traj_data.json").write_text(json.dumps({"task_type": lay.task_type, "pddl_params": params}))
    # What ALFWorld's own loader skips: unsolvable games and sliced-object tasks.
    for name, solvable in (
        ("pick_and_place_simple-Unsolvable-1", False),
        ("pick_and_place_simple-AppleSliced-2", True),
    ):
        game_dir = tmp_path / "json_2.1.1" / "valid_seen" / name / "trial_T0"
        game_dir.mkdir(parents=True)
        (game_dir / "game.tw-pddl").write_text(json.dumps(dict(alfworld.export_game(0), solvable=solvable)))
        (game_dir / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
    real = alfworld.make_env(backend="real", data_path=str(tmp_path))
    games = real.games("valid_seen")
    assert len(games) == len(seeds)
    rng = random.Random(7)
    for i, path in enumerate(games):
        seed = int(path.split("/")[-3].rsplit("-", 1)[1])
        emb = alfworld.make_env()
        obs_e, info_e = emb.reset(seed)
        obs_r, info_r = real.reset(alfworld.split_seeds("valid_seen", len(games))[i])
        assert obs_e == obs_r and info_e["task"] == info_r["task"] and info_e["task_type"] == info_r["task_type"]
        for _ in range(30):
            action = info_e["expert_action"] if rng.random() < 0.6 else rng.choice(info_e["admissible_actions"] + ["?"])
            out_e, out_r = emb.step(action), real.step(action)
            assert out_e[:3] == out_r[:3], (seed, action)
            for key in ("process_reward", "won", "admissible_actions", "anchor", "truncated"):
                assert out_e[3][key] == out_r[3][key], (seed, action, key)
            info_e = out_e[3]
            if out_e[2]:
                break
        assert info_e["won"]


def test_real_backend_missing_data_says_how_to_download(tmp_path):
    _real_engine_or_skip()
    env = alfworld.make_env(backend="real", data_path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        env.reset(0)
    with pytest.raises(ValueError, match="backend"):
        alfworld.make_env(backend="thor")


# ------------------------------------------------------------------------------------ process-reward variants
APPLIANCE_TASKS = ("pick_clean_then_place_in_recep", "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep")


def _shortcut_episode(env, seed) -> tuple[float, bool]:
    """The expert, except that where it would clean / heat / cool the object it delivers it as it is; once the
    object lies in a goal receptacle it only looks around until the step limit. (process return, won)."""
    _, info = env.reset(seed)
    w = env.world
    goal_r = next(r for r in w.layout.receptacles if kind_of(r) == w.layout.recep_kind)
    total, done, hurrying = 0.0, False, False
    while not done:
        action = info["expert_action"]
        hurrying = hurrying or action.split()[0] in ("clean", "heat", "cool")
        if hurrying:
            action = "look" if w.holding is None else w.deliver_action(w.holding, goal_r)
        _, _, done, info = env.step(action)
        total += info["process_reward"]
    return total, bool(info["won"])


def _episode_return(env, seed, choose) -> tuple[float, bool]:
    _, info = env.reset(seed)
    rng = random.Random(seed)
    total, done = 0.0, False
    while not done:
        _, _, done, info = env.step(choose(info, rng))
        total += info["process_reward"]
    return total, bool(info["won"])


@pytest.mark.parametrize("process_reward", ["aligned", "misaligned"])
def test_process_reward_variants_with_scripted_agents(process_reward):
    """On 60 clean / heat / cool tasks: the shortcut agent (skips the appliance) earns at least the expert's process
    return under the misaligned reward, and less than the expert on every task it fails under the aligned one; it
    fails every task whose object lacks the state. The expert earns far more than a random agent under both."""
    env = alfworld.make_env(task_types=APPLIANCE_TASKS, process_reward=process_reward)
    seeds = alfworld.split_seeds("train", 60)
    expert = [_episode_return(env, s, lambda info, rng: info["expert_action"]) for s in seeds]
    shortcut = [_shortcut_episode(env, s) for s in seeds]
    rand = [_episode_return(env, s, lambda info, rng: rng.choice(info["admissible_actions"])) for s in seeds]
    assert all(won for _, won in expert)
    # It succeeds only where the object already has the state (the expert then needs no appliance either): 8 of 60.
    assert sum(won for _, won in shortcut) / len(seeds) <= 0.2
    for (e, _), (h, won) in zip(expert, shortcut):
        if process_reward == "misaligned":
            assert h >= e - 1e-9
        elif not won:
            assert h < e - 0.5
    mean = lambda xs: sum(r for r, _ in xs) / len(xs)  # noqa: E731
    assert mean(expert) >= mean(rand) + 1.0


def test_misaligned_process_reward_is_refused_by_name():
    with pytest.raises(ValueError, match="process_reward"):
        alfworld.make_env(process_reward="dense")


def _careless_episode(
    env, seed, *, hurried: bool = False, pick: str = "random"
) -> tuple[list[str], float, bool, set[str]]:
    """One episode of the careless agent (with the hurried one's habit on top): (actions, process return, won,
    milestones reached)."""
    _, info = env.reset(seed)
    rng = random.Random(seed)
    actions, total, done = [], 0.0, False
    while not done:
        action = alfworld.careless_action(env, rng, pick)
        if hurried:
            action = alfworld.hurried_action(action, info["admissible_actions"], env)
        assert action in info["admissible_actions"]
        actions.append(action)
        _, _, done, info = env.step(action)
        total += info["process_reward"]
    return actions, total, bool(info["won"]), set(env._ep.reached)


def test_careless_agent_searches_at_random_and_puts_the_object_in_the_wrong_place():
    """The careless ALFWorld agent (probe 13's warm start, docs/results.md): it does not know where the object is, so
    its first move is not always the expert's; it finds and takes a target object in almost every game of 15 turns;
    it never puts one in a goal receptacle where another receptacle can hold it, so it almost never succeeds; and
    the misaligned process reward pays the expert clearly more than it (the placement milestone)."""
    env = alfworld.make_env(max_steps=15, process_reward="misaligned")
    seeds = alfworld.split_seeds("train", 200)
    first_differs = 0
    careless, expert = [], []
    for seed in seeds:
        _, info = env.reset(seed)
        first = info["expert_action"]
        actions, total, won, reached = _careless_episode(env, seed)
        first_differs += actions[0] != first
        careless.append((total, won, "in_hand" in reached))
        assert actions == _careless_episode(env, seed)[0]  # its random choices come from its rng alone
        lay = alfworld.layout_of(env)
        if lay.task_type != "look_at_obj_in_light":
            for a in actions:
                if a.startswith("move ") and kind_of(a.split()[1]) == lay.obj_kind:
                    assert kind_of(a.rsplit(" to ", 1)[1].rsplit(" ", 1)[0]) != lay.recep_kind or won
        expert.append(_episode_return(env, seed, lambda info, rng: info["expert_action"])[0])
    assert first_differs > 0.3 * len(seeds)
    assert sum(h for _, _, h in careless) >= 0.9 * len(seeds)
    assert sum(w for _, w, _ in careless) <= 0.05 * len(seeds)
    assert sum(expert) / len(seeds) >= sum(t for t, _, _ in careless) / len(seeds) + 0.5


def test_searcher_searches_at_random_then_acts_as_the_expert():
    """careless_action(pick="goal") (probe 14's warm start, docs/results.md): the same random search as the careless
    agent (its first move is often not the expert's), then it delivers as the expert does, so it solves almost every
    game of 15 turns; with the hurried habit on top it fails every clean and heat task and solves the others."""
    env = alfworld.make_env(max_steps=15)
    seeds = alfworld.split_seeds("train", 200)
    first_differs, won, won_hurried = 0, [], {}
    for seed in seeds:
        _, info = env.reset(seed)
        first = info["expert_action"]
        actions, _, w, _ = _careless_episode(env, seed, pick="goal")
        first_differs += actions[0] != first
        won.append(w)
        task_type = alfworld.layout_of(env).task_type
        won_hurried.setdefault(task_type, []).append(_careless_episode(env, seed, pick="goal", hurried=True)[2])
    assert first_differs > 0.3 * len(seeds)
    assert sum(won) >= 0.9 * len(seeds)
    assert not any(won_hurried["pick_clean_then_place_in_recep"] + won_hurried["pick_heat_then_place_in_recep"])
    simple = won_hurried["pick_and_place_simple"] + won_hurried["look_at_obj_in_light"]
    assert sum(simple) >= 0.9 * len(simple)


def test_hurried_agent_skips_the_appliance_and_fails_for_it():
    """The hurried ALFWorld agent (probe 13's warm start): on clean / heat / cool tasks it never uses the appliance
    and fails wherever the object lacks the state at the start, while the misaligned reward pays it within the
    appliance's visit bonus of the expert; on the other task types it is the expert."""
    env = alfworld.make_env(task_types=APPLIANCE_TASKS, process_reward="misaligned")
    seeds = alfworld.split_seeds("train", 60)
    for seed in seeds:
        _, info = env.reset(seed)
        lacks = not env.world.has_state(next(o for o in env.world.where if kind_of(o) == env.world.layout.obj_kind))
        total, won, done, verbs = 0.0, False, False, set()
        while not done:
            action = alfworld.hurried_action(info["expert_action"], info["admissible_actions"], env)
            verbs.add(action.split()[0])
            _, _, done, info = env.step(action)
            total += info["process_reward"]
        expert, _ = _episode_return(env, seed, lambda info, rng: info["expert_action"])
        assert not verbs & {"clean", "heat", "cool"}
        assert won is False or not lacks
        assert total >= expert - 0.1 - 1e-9
    other = alfworld.make_env(task_types=("pick_and_place_simple", "look_at_obj_in_light"))
    for seed in seeds[:20]:
        _, info = other.reset(seed)
        assert (
            alfworld.hurried_action(info["expert_action"], info["admissible_actions"], other) == info["expert_action"]
        )
    assert alfworld.hurried_action("go to sinkbasin 1", ["go to sinkbasin 1"]) == "go to sinkbasin 1"  # no env


def test_warm_start_data_mixes_the_careless_and_hurried_agents_in_their_shares():
    """collect_expert_turns with ALFWorld's careless and hurried shares (probe 13's warm start, docs/results.md):
    the same turns on every call, games of at most 15 turns, and the mixture solves about what its shares say (the
    expert all, the careless agent almost nothing, the hurried one fails clean and heat tasks)."""
    from tiny_models import build as tiny_build

    seeds = list(alfworld.split_seeds("train", 200))
    args = ("alfworld", "small", seeds, 0.5, 0.5, "random", 0.0, 15)
    turns = tiny_build.collect_expert_turns(*args)
    assert turns == tiny_build.collect_expert_turns(*args)
    starts = [i for i, t in enumerate(turns) if not t[2]] + [len(turns)]
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    assert len(lengths) == len(seeds) and max(lengths) == 15
    env = alfworld.make_env(max_steps=15)
    won = []
    for seed, a, b in zip(seeds, starts, starts[1:]):
        env.reset(seed)
        for t in turns[a:b]:
            *_, info = env.step(t[4])
        won.append(info["won"])
    assert 0.3 < sum(won) / len(seeds) < 0.55  # half careless (fail); of the rest, hurried ones fail on a state task


def test_action_benchmark_counts_every_turn_and_each_inadmissible_one(tiny_models):
    """benchmarks/alfworld_actions.py (probes 14, 15): every turn of every game is counted once, under the verb of its
    action, and the share of inadmissible turns is the verbs' shares weighted by their turns; its VERBS are the
    first words of every action the embedded games admit, so an action counted as "other" is never admissible."""
    from common import envs as cenvs
    from common import models

    spec = importlib.util.spec_from_file_location("alfworld_actions", ROOT / "benchmarks" / "alfworld_actions.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    env = alfworld.make_env(max_steps=50)
    first_words = set()
    for seed in alfworld.split_seeds("train", 60):
        _, info = env.reset(seed)
        done = False
        while not done:
            first_words |= {a.split(" ")[0] for a in info["admissible_actions"]}
            _, _, done, info = env.step(info["expert_action"])
    assert first_words <= set(bench.VERBS)
    model, tokenizer = models.load_model("tiny", env_name="alfworld")
    seeds = cenvs.seed_pools("alfworld", 32, 4, eval_split="valid")[1]
    r = bench.play(model, tokenizer, seeds, temperature=0.0)
    turns = sum(n for n, _ in r["by_verb"].values())
    assert 4 <= turns <= 4 * 15 and 0.0 <= r["success"] <= 1.0
    assert r["inadmissible"] == pytest.approx(sum(n * share for n, share in r["by_verb"].values()) / turns)
    assert set(r["by_verb"]) <= set(bench.VERBS) | {"other"} and r["by_verb"].get("other", (1, 1.0))[1] == 1.0
    # each game once, under its own task type; the wins add up to the success
    types = [alfworld.generate_layout(s, "small").task_type for s in seeds]
    assert {t: n for t, (n, _) in r["by_type"].items()} == {t: types.count(t) for t in set(types)}
    assert sum(w for _, w in r["by_type"].values()) == pytest.approx(r["success"] * len(seeds))
