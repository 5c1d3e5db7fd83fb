"""Steps per second of the embedded ALFWorld env and of the real TextWorld PDDL engine on the same games.

    PYTHONPATH=. python benchmarks/alfworld_speed.py --preset small --num-games 10 --steps-per-game 30

Both play the same exported games (`envs.alfworld.export_game`) with the same action sequence (expert actions mixed
with random admissible ones and invalid strings). The ratio is what matters: it is the speed-up of training on the
embedded replica. Real-engine reset (parsing the PDDL, grounding) is timed separately from its steps.
"""

import argparse
import random
import time

from envs import alfworld


def action_plan(preset: str, seed: int, steps: int) -> list[str]:
    """A fixed action sequence for one game, drawn while playing the embedded env."""
    rng = random.Random(seed)
    env = alfworld.make_env(preset=preset, max_steps=steps)
    _, info = env.reset(seed)
    actions = []
    for _ in range(steps):
        u = rng.random()
        if u < 0.5:
            action = info["expert_action"]
        elif u < 0.9:
            action = rng.choice(info["admissible_actions"])
        else:
            action = "jump around"
        actions.append(action)
        _, _, done, info = env.step(action)
        if done:
            break
    return actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=["small", "default"])
    parser.add_argument("--num-games", type=int, default=10)
    parser.add_argument("--steps-per-game", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20, help="embedded replays per game (it is fast)")
    args = parser.parse_args()

    seeds = alfworld.split_seeds("train", args.num_games)
    plans = {s: action_plan(args.preset, s, args.steps_per_game) for s in seeds}
    n_steps = sum(len(p) for p in plans.values())

    env = alfworld.make_env(preset=args.preset, max_steps=10**9)
    start = time.perf_counter()
    for _ in range(args.repeats):
        for seed, plan in plans.items():
            env.reset(seed)
            for action in plan:
                env.step(action)
    embedded_s = time.perf_counter() - start
    resets = args.repeats * len(plans)
    embedded_sps = args.repeats * n_steps / embedded_s
    print(f"embedded  ({args.preset}): {embedded_sps:10.0f} steps/s  (reset + steps, {resets} episodes, info included)")

    try:
        games = {s: alfworld.export_game(s, args.preset) for s in seeds}
        engine = alfworld.make_real_engine(games[seeds[0]])
    except ImportError as e:
        print(f"real engine unavailable: {e}")
        return
    reset_s = step_s = 0.0
    for seed, plan in plans.items():
        t0 = time.perf_counter()
        engine = alfworld.make_real_engine(games[seed])
        engine.reset()
        t1 = time.perf_counter()
        for action in plan:
            engine.step(action)
        t2 = time.perf_counter()
        reset_s += t1 - t0
        step_s += t2 - t1
    real_sps = n_steps / step_s
    print(
        f"real engine ({args.preset}): {real_sps:8.1f} steps/s  (steps only); load+reset {reset_s / len(plans):.2f}s/game"
    )
    print(f"ratio embedded / real: {embedded_sps / real_sps:.0f}x  ({n_steps} steps on {len(plans)} games)")


if __name__ == "__main__":
    main()
