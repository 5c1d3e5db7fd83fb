"""Greedy per-turn accuracy of a warm-started tiny WebShop model on the expert's turns of held-out goals.

    python benchmarks/warmstart_turns.py            # the cached tiny model of webshop-small, seed 1 (built if missing)
    python benchmarks/warmstart_turns.py --goals 100

For each kind of expert turn (search query, product click, option click, buy now, paging) it prints how often
the model's greedy answer, parsed as the scripts parse it, is exactly the expert's action, and on product turns
how often the model picks the first listed product, and the prompts' mean length in tokens (all turns, and the
results pages, where the product turns are). Goals: the last `--goals` of the first 20,000 train goals,
which the warm start (the first 1,024) never saw.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import models  # noqa: E402
from common.generation import HFGenerator  # noqa: E402
from common.prompts import encode_prompt, parse_action  # noqa: E402
from envs import webshop  # noqa: E402
from tiny_models import build as tiny_build  # noqa: E402


def kind(action: str) -> str:
    if action.startswith("search["):
        return "search query"
    if webshop.TINY_ANSWER_BY_NUMBER.fullmatch(action):
        return "product click"
    if action in ("click[buy now]", "click[next >]", "click[< prev]", "click[back to search]"):
        return action
    return "option click"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--goals", type=int, default=40)
    p.add_argument("--seed", type=int, default=1, help="which tiny model (one per seed)")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = tiny_build.tiny_config("webshop")
    model, tok = models.load_model("tiny", env_name="webshop", preset="small", seed=a.seed)
    model.eval()
    goals = list(webshop.split_seeds("train", 20_000))[-a.goals :]
    turns = tiny_build.collect_expert_turns("webshop", "small", goals)
    generator = HFGenerator(tok, max_new_tokens=cfg["max_new_tokens"])
    right: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    first = [0, 0]
    lengths: dict[str, list[int]] = collections.defaultdict(list)
    for start in range(0, len(turns), 32):
        chunk = turns[start : start + 32]
        ids = [
            encode_prompt(
                tok,
                t,
                o,
                h,
                adm,
                history_len=cfg["history_len"],
                short=True,
                by_number=webshop.TINY_ANSWER_BY_NUMBER,
                max_prompt_tokens=cfg["max_prompt_tokens"],
            )
            for t, o, h, adm, _ in chunk
        ]
        for (_, _, _, adm, expert), prompt, gen in zip(chunk, ids, generator.generate(model, ids, greedy=True)):
            answer = parse_action(gen.text, adm)[0]
            k = kind(expert)
            lengths[k].append(len(prompt))
            right[k][0] += answer == expert
            right[k][1] += 1
            if k == "product click":
                first[0] += answer == next(x for x in adm if webshop.TINY_ANSWER_BY_NUMBER.fullmatch(x))
                first[1] += 1
    print(f"{len(goals)} held-out goals, {len(turns)} expert turns, greedy")
    for k, (c, n) in sorted(right.items()):
        print(f"{k:22s} {c}/{n} exact")
    print(f"{'first product picked':22s} {first[0]}/{first[1]} product turns")
    every = [n for ns in lengths.values() for n in ns]
    pages = lengths["product click"]
    print(
        f"{'prompt tokens (mean)':22s} {sum(every) / len(every):.0f} all turns, {sum(pages) / len(pages):.0f} results pages"
    )


if __name__ == "__main__":
    main()
