"""What a tiny ALFWorld model does on games it never saw: success (in all and by task type), and how often it names
an action that the game does not admit (which the env answers with "Nothing happens."), by the action's verb.

    python benchmarks/alfworld_actions.py                       # the committed tiny model, greedy and sampled
    python benchmarks/alfworld_actions.py --model <folder> --games 200

Games: the first `--games` validation games (`--eval-split valid` of the scripts: training seeds from 2,048 on,
never imitated or trained on), 15 turns each, played as the scripts play them (the short prompt, two turns of
history), once greedily and once at temperature 1 (`--temperatures`). docs/results.md, probes 14 and 15.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import envs as cenvs  # noqa: E402
from common import models  # noqa: E402
from envs import alfworld  # noqa: E402
from tiny_models import build as tiny_build  # noqa: E402

# the first words of the admissible actions of the embedded ALFWorld (anything else, "other", is never admissible)
VERBS = ("go", "take", "move", "open", "close", "use", "heat", "cool", "clean", "examine", "look", "inventory", "help")


def play(model, tokenizer, seeds: list[int], temperature: float, max_steps: int = 15) -> dict:
    """One episode per seed: {"success", "by_type": {task type: (games, won)}, "inadmissible": share of all turns,
    "by_verb": {verb: (turns, share)}}."""
    cfg = tiny_build.tiny_config("alfworld")
    won, turns = tiny_build.play_episodes(
        model, tokenizer, "alfworld", "small", seeds, temperature=temperature, history_len=cfg["history_len"],
        max_prompt_tokens=cfg["max_prompt_tokens"], max_new_tokens=cfg["max_new_tokens"], max_steps=max_steps,
    )  # fmt: skip
    verbs: dict[str, list[bool]] = collections.defaultdict(list)  # verb -> [not admissible, ...] per turn
    for action, admissible in turns:
        verb = action.split(" ")[0] if action else ""
        verbs[verb if verb in VERBS else "other"].append(action not in admissible)
    types: dict[str, list[bool]] = {t: [] for t in alfworld.TASK_TYPES}  # task type -> [won, ...] per game
    for seed, w in zip(seeds, won):
        types[alfworld.generate_layout(seed, "small").task_type].append(w)
    return {
        "success": sum(won) / len(seeds),
        "by_type": {t: (len(w), sum(w)) for t, w in types.items() if w},
        "inadmissible": sum(action not in admissible for action, admissible in turns) / len(turns),
        "by_verb": {v: (len(b), sum(b) / len(b)) for v, b in sorted(verbs.items(), key=lambda kv: -len(kv[1]))},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (the committed ALFWorld model) or a model folder")
    p.add_argument("--games", type=int, default=200)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tokenizer = models.load_model(a.model, env_name="alfworld")
    model.eval()
    _, seeds = cenvs.seed_pools("alfworld", 32, a.games, eval_split="valid")
    for t in a.temperatures:
        r = play(model, tokenizer, seeds, t)
        verbs = ", ".join(f"{v} {share:.2f} of {n}" for v, (n, share) in r["by_verb"].items())
        types = ", ".join(f"{t} {w}/{n}" for t, (n, w) in r["by_type"].items())
        print(
            f"temperature {t:g}: success {r['success']:.3f} on {len(seeds)} validation games ({types}); "
            f"inadmissible actions {r['inadmissible']:.3f} of the turns ({verbs})"
        )


if __name__ == "__main__":
    main()
