"""Speed of the embedded WebShop: catalog + BM25 build time, env steps per second (search included).

    python benchmarks/webshop_speed.py                   # both presets
    python benchmarks/webshop_speed.py --presets small --episodes 2000

Two policies per preset, one env, one process, one thread:
- expert: the expert's episodes (1 search with the instruction, paging, item, options, Buy Now);
- random: 15-step episodes of random admissible clicks, where each search uses a fresh random subset of the
  instruction's words (so the search cache rarely helps) and 10% of the actions are invalid strings.
"""

import json
import random
import time
from dataclasses import dataclass, field

import tyro

from envs import webshop


@dataclass
class Args:
    presets: list[str] = field(default_factory=lambda: ["small", "default"])
    """embedded presets to measure"""
    episodes: int = 1000
    """episodes per policy and preset"""
    seed: int = 0
    """seed of the random policy"""
    json_out: str | None = None
    """also write the figures to this JSON file"""


def run_expert(env, episodes: int) -> tuple[int, float]:
    steps, t = 0, time.perf_counter()
    for seed in range(500, 500 + episodes):
        _, info = env.reset(seed)
        done = False
        while not done:
            _, _, done, info = env.step(info["expert_action"])
            steps += 1
    return steps, time.perf_counter() - t


def run_random(env, episodes: int, rng: random.Random) -> tuple[int, float]:
    steps, t = 0, time.perf_counter()
    for seed in range(100_000, 100_000 + episodes):
        _, info = env.reset(seed)
        words = env.goal["search_text"].split()
        done = False
        while not done:
            u = rng.random()
            if u < 0.1:
                action = "click[" + "".join(rng.choices("abc xyz[]", k=8))
            else:
                action = rng.choice(info["admissible_actions"] + ["search[<query>]"])
                if action == "search[<query>]":
                    action = f"search[{' '.join(rng.sample(words, rng.randint(1, len(words))))}]"
            _, _, done, info = env.step(action)
            steps += 1
    return steps, time.perf_counter() - t


if __name__ == "__main__":
    args = tyro.cli(Args)
    rng = random.Random(args.seed)
    results = {}
    for preset in args.presets:
        t = time.perf_counter()
        shop = webshop.get_shop(preset)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        envs = [webshop.make_env(preset=preset) for _ in range(32)]
        make32_s = time.perf_counter() - t
        env = envs[0]
        expert_steps, expert_s = run_expert(env, args.episodes)
        random_steps, random_s = run_random(env, args.episodes, rng)
        results[preset] = {
            "products": len(shop.products),
            "build_s": build_s,
            "make_32_envs_s": make32_s,
            "expert_steps_per_s": expert_steps / expert_s,
            "expert_steps": expert_steps,
            "random_steps_per_s": random_steps / random_s,
            "random_steps": random_steps,
        }
    print(
        f"{'preset':<8} {'products':>8} {'build s':>8} {'32 envs s':>9} {'expert steps/s':>15} {'random steps/s':>15}"
    )
    for preset, r in results.items():
        print(
            f"{preset:<8} {r['products']:>8} {r['build_s']:>8.2f} {r['make_32_envs_s']:>9.4f} "
            f"{r['expert_steps_per_s']:>15.0f} {r['random_steps_per_s']:>15.0f}"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
