"""The tiny model's builder: a Qwen2 causal LM of about 1M parameters with a byte-level BPE tokenizer trained on the
embedded environment's texts, warm-started by behaviour cloning on demonstration turns until it is a weak agent (its
success rate at the training temperature lies in a band: 10-40% by default; 2-10% on WebShop, which imitates careless
and hurried demonstrations to convergence: an exploration-limited start; ALFWorld imitates a searcher for 3,000
steps, with no band). One per (env, preset, seed), built once and cached on disk (save_pretrained), keyed by the hash
of its config and the env's texts; the default ones (seed 1) are committed in this folder.
`common.models.load_model("tiny", ...)` calls build_tiny, which finds or builds the folder.

    python -m tiny_models.build --env webshop --seed 2     # prints the folder it found or built
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import sys
import time

import torch
from torch import nn
from transformers import PreTrainedTokenizerFast

from common import envs as cenvs
from common.models import default_cache_dir, file_lock
from common.prompts import TINY_MAX_PROMPT_TOKENS, build_prompt, encode_prompt, format_response, parse_action

# Everything that determines the tiny model; its hash names the cache folder (with the env's own fingerprint).
TINY_CONFIG = {
    "version": 6,
    "vocab_size": 1536,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    # prompts of the warm start (and of the scripts with --model-name tiny)
    "history_len": 2,
    "max_prompt_tokens": TINY_MAX_PROMPT_TOKENS,
    "max_new_tokens": 32,
    # behaviour cloning
    "bc_threads": 1,  # torch threads of the build, fixed (not the machine's count) so the weights are the same
    "bc_train_seeds": 1024,
    # share of the BC episodes played by the env's hurried demonstrator (`hurried_action`) instead of its expert
    "bc_hurried_share": 0.0,
    # share of the BC episodes played by the env's careless demonstrator (`careless_action`), drawn independently
    # of the hurried share (a careless and hurried episode opens a random product and buys it at once)
    "bc_careless_share": 0.0,
    # (optional) "bc_careless_pick": the product the careless demonstrator opens on a results page, "random" (any
    # listed one, when the key is absent, so the committed ALFWorld model's hash stands) or "last" (WebShop's default)
    # (optional) "bc_dawdle_prob": the chance per item-page turn, in every episode, that the demonstrator opens a
    # sub-page instead (the env's `dawdling_action`; 0 when the key is absent)
    "bc_batch_size": 16,
    "bc_learning_rate": 3e-3,
    "bc_warmup_steps": 10,
    "bc_min_lr_ratio": 0.05,  # cosine decay to this share of the peak rate at bc_max_steps
    "bc_max_steps": 1200,
    "bc_eval_every": 200,
    "bc_eval_tasks": 32,
    "bc_eval_temperature": 1.0,
    # (optional) "bc_episode_steps": the turns of a demonstration or evaluation episode (absent: the env's default)
    # (optional) "bc_answer_by_number": True to answer every listed action by its number in the short prompt's list
    # (the list still shows each action's text), instead of its text (absent: False)
    "success_band": (0.10, 0.40),
}
# Per-env changes to TINY_CONFIG. WebShop: the paper's regime, where learning on the outcome is exploration-limited.
# The demonstrations mix two habits that only the outcome reveals: 95% of the episodes open the *last* listed product
# (careless; it solves 16% of the training goals) and, independently, 50% buy without choosing the options
# (hurried), so the demonstrators succeed on 10% of the training goals. The model imitates them to convergence
# (3,000 steps, evaluated once, at the end, where its sampled success must lie at 2-10% on 64 goals): it fails by
# habits that RL can unlearn, not by a lack of skill (docs/tiny_model.md). One fixed thread gives the same weights on
# every run of one CPU kind (tiny_models/ holds seed 1's). ALFWorld: every episode is played by a *searcher*
# (careless_action with pick "goal": it opens receptacles at random until it holds the object, then acts as the
# expert), and half of them, drawn independently, also skip the appliance (hurried), so the demonstrators solve 51% of
# the 15-turn training games; imitated for 3,000 steps and evaluated once, at the end (no band: it reaches 16% on 64
# training games, 0.125 greedily on 200 validation games). The expert that walks straight to objects it cannot see,
# imitated alone (the default until 2026-12-06), gave a model that names what is not in the room in 78% of its turns
# on new games, from which nothing learned (docs/results.md, probes 13-15).
TINY_ENV_CONFIG = {
    "alfworld": {
        "bc_careless_share": 1.0,
        "bc_careless_pick": "goal",
        "bc_hurried_share": 0.5,
        "bc_episode_steps": 15,
        "bc_max_steps": 3000,
        "bc_eval_every": 3000,
        "bc_eval_tasks": 64,
        "success_band": (0.0, 1.0),
    },
    "webshop": {
        "bc_careless_share": 0.95,
        "bc_hurried_share": 0.5,
        "bc_careless_pick": "last",
        "bc_max_steps": 3000,
        "bc_threads": 1,
        "bc_eval_every": 3000,
        "bc_eval_tasks": 64,
        "success_band": (0.02, 0.10),
    },
}


def tiny_config(env_name: str) -> dict:
    """The tiny model's config for `env_name`: TINY_CONFIG with that env's TINY_ENV_CONFIG entries."""
    return {**TINY_CONFIG, **TINY_ENV_CONFIG.get(env_name, {})}


# The default tiny models, built once by build_tiny and committed, so that every machine starts from the same
# weights (a build on another CPU kind gives other weights: floating-point sums differ). A folder here is used when
# its name, which ends in the hash of the config and the env's texts, is the one build_tiny would build.
COMMITTED_TINY_DIR = pathlib.Path(__file__).resolve().parent


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def train_tiny_tokenizer(texts: list[str], vocab_size: int, extra_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer (any string encodes; decode(encode(s)) == s) trained on `texts`.

    Special tokens: `<|endoftext|>` (EOS, also BOS in the config), `<|pad|>`; `<action>`, `</action>` and each of
    `extra_tokens` (an env's frequent markup, e.g. WebShop's " [SEP]", which BPE would split in three at the
    brackets) are single tokens (added, not special: they are kept by decode). No BOS is prepended.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<action>", "</action>", *extra_tokens)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def _tiny_model(tokenizer, cfg: dict, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny(
    env_name: str,
    preset: str = "small",
    seed: int = 1,
    *,
    cache_dir: str | None = None,
    warm_start: bool = True,
    config: dict | None = None,
) -> pathlib.Path:
    """The folder of the tiny model of (env, preset, seed): the committed one (tiny_models/) if it has this
    config's hash, else the cache folder, building it first if it is not there.

    Folder: <cache>/tiny/<env>-<preset>-seed<seed>-<hash>/ with the save_pretrained model and tokenizer and
    warmstart.json (what the warm start reached). The hash covers `config` (default TINY_CONFIG) and the
    environment's text corpus, so a change of either builds a new model. A file lock makes concurrent callers
    (test workers, benchmark jobs) build one model at a time, each once; the folder appears atomically when
    complete.
    """
    cfg = dict(tiny_config(env_name) if config is None else config)
    cfg["warm_start"] = warm_start
    env = cenvs.env_module(env_name)
    corpus = list(env.text_corpus(preset))
    key = _hash({"cfg": cfg, "env": env_name, "preset": preset, "seed": seed, "corpus": _hash(corpus)})
    name = f"{env_name}-{preset}-seed{seed}-{key}"
    if (COMMITTED_TINY_DIR / name / "warmstart.json").exists():
        return COMMITTED_TINY_DIR / name
    final = default_cache_dir(cache_dir) / "tiny" / name
    if (final / "warmstart.json").exists():
        return final
    # One build at a time per cache, whichever model: each runs bc_threads threads, and two builds side by side
    # on 2 cores oversubscribe them (measured: 6x slower each). A caller waiting here uses no CPU.
    with file_lock(final.parent / ".build.lock"):
        if (final / "warmstart.json").exists():
            return final
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        # A fixed thread count (bc_threads), not the machine's: the same floating-point reduction order on every
        # machine, so the build is deterministic.
        threads = torch.get_num_threads()
        torch.set_num_threads(cfg["bc_threads"])
        try:
            with torch.random.fork_rng(devices=[]):
                report = _build_tiny_into(tmp, env_name, preset, seed, cfg, corpus)
        finally:
            torch.set_num_threads(threads)
        report.update(env=env_name, preset=preset, seed=seed, config=cfg)
        (tmp / "warmstart.json").write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, final)
    return final


def collect_expert_turns(
    env_name: str,
    preset: str,
    seeds: list[int],
    hurried_share: float = 0.0,
    careless_share: float = 0.0,
    careless_pick: str = "random",
    dawdle_prob: float = 0.0,
    max_steps: int | None = None,
) -> list[tuple[str, str, list, list[str], str]]:
    """Every turn of the embedded expert on `seeds`: (task, obs, history, admissible, expert_action).

    history holds the (observation, action) pairs of the episode's previous turns, as the scripts build it.
    hurried_share: the share of the episodes (drawn per seed, the same on every run) that the env's
    `hurried_action` plays instead of the expert; an env without one (None) is played by the expert alone.
    careless_share: likewise for the env's `careless_action(env, rng)` (drawn independently of the hurried share;
    `hurried_action` then applies to what the careless player does), whose random choices come from a generator
    seeded by the episode's seed; careless_pick ("random" or "last") is the product it opens on a results page.
    dawdle_prob: in every episode, the chance per item-page turn that the env's `dawdling_action` opens a
    sub-page instead (applied after the others; 0: never). max_steps: the turns of an episode (None: the env's
    default).
    """
    module = cenvs.env_module(env_name)
    hurried = module.hurried_action if hurried_share > 0 else None
    careless = module.careless_action if careless_share > 0 else None
    dawdling = module.dawdling_action if dawdle_prob > 0 else None
    env = module.make_env(backend="embedded", preset=preset, **({} if max_steps is None else {"max_steps": max_steps}))
    turns = []
    for seed in seeds:
        sloppy = careless is not None and random.Random(f"careless-{seed}").random() < careless_share
        rushed = hurried is not None and random.Random(f"hurried-{seed}").random() < hurried_share
        rng = random.Random(f"careless-choices-{seed}")
        dawdle_rng = random.Random(f"dawdle-{seed}")
        obs, info = env.reset(seed)
        history: list[tuple[str, str]] = []
        done = False
        while not done:
            action = careless(env, rng, careless_pick) if sloppy else info["expert_action"]
            if rushed:
                action = hurried(action, info["admissible_actions"], env)
            if dawdling is not None:
                action = dawdling(action, info["admissible_actions"], dawdle_rng, dawdle_prob)
            turns.append((info["task"], obs, list(history), list(info["admissible_actions"]), action))
            history.append((obs, action))
            obs, _, done, info = env.step(action)
    return turns


def tiny_expert_answer(env_module, action: str, admissible: list[str], every: bool = False) -> str:
    """What the tiny model learns to answer for the expert's `action`: its number in the short prompt's list
    when the env names it in `TINY_ANSWER_BY_NUMBER` (WebShop's product codes), or when `every` (the config's
    `bc_answer_by_number`) and it is listed; else the action's text."""
    pattern = env_module.TINY_ANSWER_BY_NUMBER
    if action in admissible and (every or (pattern is not None and pattern.fullmatch(action))):
        return str(admissible.index(action) + 1)
    return action


def evaluate_success(model, tokenizer, env_name: str, preset: str, seeds: list[int], **options) -> float:
    """Share of `seeds` solved by `model`: play_episodes with the same arguments."""
    won, _ = play_episodes(model, tokenizer, env_name, preset, seeds, **options)
    return sum(won) / len(won)


def play_episodes(
    model,
    tokenizer,
    env_name: str,
    preset: str,
    seeds: list[int],
    *,
    temperature: float = 1.0,
    history_len: int = 2,
    max_prompt_tokens: int = 512,
    max_new_tokens: int = 48,
    max_steps: int | None = None,
) -> tuple[list[bool], list[tuple[str, list[str]]]]:
    """One episode of `model` per seed with short prompts, sampling at `temperature` (<= 0: greedy), in episodes
    of `max_steps` turns (None: the env's default): (won per seed, (action, admissible actions) of every turn)."""
    from common.generation import HFGenerator

    by_number = cenvs.env_module(env_name).TINY_ANSWER_BY_NUMBER
    options = {} if max_steps is None else {"max_steps": max_steps}
    envs = cenvs.LockstepEnvs(env_name, len(seeds), backend="embedded", preset=preset, **options)
    generator = HFGenerator(tokenizer, max_new_tokens=max_new_tokens)
    obs, infos = envs.reset(seeds)
    histories: list[list[tuple[str, str]]] = [[] for _ in seeds]
    won = [False] * len(seeds)
    turns: list[tuple[str, list[str]]] = []
    while any(envs.active):
        live = [i for i, a in enumerate(envs.active) if a]
        prompts = [
            encode_prompt(
                tokenizer,
                infos[i]["task"],
                obs[i],
                histories[i],
                infos[i]["admissible_actions"],
                history_len=history_len,
                short=True,
                by_number=by_number,
                max_prompt_tokens=max_prompt_tokens,
            )
            for i in live
        ]
        actions: list[str | None] = [None] * len(seeds)
        for i, gen in zip(live, generator.generate(model, prompts, temperature=temperature)):
            actions[i] = parse_action(gen.text, infos[i]["admissible_actions"])[0]
            histories[i].append((obs[i], actions[i]))
            turns.append((actions[i], infos[i]["admissible_actions"]))
        obs, _, _, infos = envs.step(actions)
        for i in live:
            won[i] = won[i] or bool(infos[i]["won"])
    return won, turns


def _bc_batches(examples: list[tuple[list[int], list[int]]], batch_size: int, generator: torch.Generator):
    """Endless shuffled epochs of right-padded (input_ids, attention_mask, labels); labels -100 off the response.

    Each epoch is shuffled, cut into pools of 32 batches, each pool sorted by length before it is cut into
    batches (less padding: WebShop prompts range from ~100 to ~500 tokens), and the batches are shuffled.
    """
    while True:
        order = torch.randperm(len(examples), generator=generator).tolist()
        order = order[: len(order) - len(order) % batch_size]
        pool = 32 * batch_size
        batches = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start : start + pool], key=lambda k: len(examples[k][0]) + len(examples[k][1]))
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        for b in torch.randperm(len(batches), generator=generator).tolist():
            rows = [examples[k] for k in batches[b]]
            width = max(len(p) + len(r) for p, r in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for i, (p, r) in enumerate(rows):
                n = len(p) + len(r)
                ids[i, :n] = torch.tensor(p + r)
                mask[i, :n] = 1
                labels[i, len(p) : n] = torch.tensor(r)
            yield ids, mask, labels


def response_loss(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions with a label (the response).

    Equal to `model(input_ids, attention_mask, labels=labels).loss`, but the LM head runs only on the positions
    that predict a labelled token, not on the whole prompt.
    """
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[keep]).float()
    return nn.functional.cross_entropy(logits, targets[keep])


def bc_learning_rate(step: int, steps: int, peak: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of BC step `step` (0-based) of `steps`: linear warm-up times a cosine decay from 1 at
    step 0 to min_lr_ratio at step `steps`."""
    cosine = 0.5 * (1.0 + math.cos(math.pi * step / steps))
    return peak * min(1.0, (step + 1) / max(1, warmup_steps)) * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def behaviour_clone(
    model,
    examples,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    warmup_steps: int,
    seed: int,
    min_lr_ratio: float = 1.0,
):
    """Generator of BC steps on (prompt_ids, response_ids) examples: cross-entropy on response tokens only.

    AdamW, linear warm-up, then cosine decay from learning_rate to min_lr_ratio * learning_rate at `steps`
    (min_lr_ratio=1: constant); yields the loss of every step. Deterministic given seed. The decay matters on
    WebShop: at a constant 3e-3 the per-step loss keeps swinging between 0.03 and 2.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    batches = _bc_batches(examples, batch_size, generator)
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = bc_learning_rate(step, steps, learning_rate, warmup_steps, min_lr_ratio)
        loss = response_loss(model, *next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        yield loss.item()


def _build_tiny_into(folder: pathlib.Path, env_name: str, preset: str, seed: int, cfg: dict, corpus: list[str]):
    start = time.time()
    env = cenvs.env_module(env_name)
    train_seeds = list(env.split_seeds("train", cfg["bc_train_seeds"]))
    turns = collect_expert_turns(
        env_name,
        preset,
        train_seeds,
        cfg["bc_hurried_share"],
        cfg["bc_careless_share"],
        cfg.get("bc_careless_pick", "random"),
        cfg.get("bc_dawdle_prob", 0.0),
        cfg.get("bc_episode_steps"),
    )
    short = dict(history_len=cfg["history_len"], short=True, by_number=env.TINY_ANSWER_BY_NUMBER)
    prompts = [build_prompt(t, o, h, a, **short) for t, o, h, a, _ in turns]
    every = cfg.get("bc_answer_by_number", False)
    responses = [format_response(tiny_expert_answer(env, action, a, every), short=True) for _, _, _, a, action in turns]
    tokenizer = train_tiny_tokenizer(corpus + prompts + responses, cfg["vocab_size"], env.TINY_TOKENS)
    tokenizer.model_max_length = cfg["max_position_embeddings"]
    model = _tiny_model(tokenizer, cfg, seed)
    report: dict = {"parameters": sum(p.numel() for p in model.parameters()), "expert_turns": len(turns)}

    evals = []
    if cfg["warm_start"]:
        examples = [
            (
                encode_prompt(tokenizer, t, o, h, a, **short, max_prompt_tokens=cfg["max_prompt_tokens"]),
                tokenizer(r).input_ids,
            )
            for (t, o, h, a, _), r in zip(turns, responses)
        ]
        eval_seeds = train_seeds[: cfg["bc_eval_tasks"]]
        low, high = cfg["success_band"]

        def success() -> float:
            torch.manual_seed(seed)
            return evaluate_success(
                model,
                tokenizer,
                env_name,
                preset,
                eval_seeds,
                temperature=cfg["bc_eval_temperature"],
                history_len=cfg["history_len"],
                max_prompt_tokens=cfg["max_prompt_tokens"],
                max_new_tokens=cfg["max_new_tokens"],
                max_steps=cfg.get("bc_episode_steps"),
            )

        steps = behaviour_clone(
            model,
            examples,
            steps=cfg["bc_max_steps"],
            batch_size=cfg["bc_batch_size"],
            learning_rate=cfg["bc_learning_rate"],
            warmup_steps=cfg["bc_warmup_steps"],
            min_lr_ratio=cfg["bc_min_lr_ratio"],
            seed=seed,
        )
        best = None  # (distance to the band, step, success, state_dict)
        for step, loss in enumerate(steps, start=1):
            if step % cfg["bc_eval_every"] and step != cfg["bc_max_steps"]:
                continue
            rate = success()
            seconds = round(time.time() - start, 1)
            evals.append({"step": step, "loss": round(loss, 4), "success": rate, "seconds": seconds})
            print(
                f"[tiny {env_name}-{preset}] warm start step {step}: loss {loss:.3f}, success {rate:.2f} ({seconds:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
            distance = max(low - rate, rate - high, 0.0)
            if best is None or distance <= best[0]:  # ties: the more trained model
                best = (distance, step, rate, {k: v.clone() for k, v in model.state_dict().items()})
            if distance == 0.0 or rate > high:
                break
        _, bc_steps, rate, state = best
        model.load_state_dict(state)
        report.update(warm_start=True, success=rate, bc_steps=bc_steps, in_band=low <= rate <= high)
    else:
        report.update(warm_start=False, success=None, bc_steps=0, in_band=None)
    model.eval()
    report["evaluations"] = evals
    report["build_seconds"] = round(time.time() - start, 1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tiny_models.build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--env", required=True, choices=cenvs.ENV_NAMES)
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=1, help="one model per seed; seed 1 is committed")
    p.add_argument("--cache-dir", default=None, help="default: $RSPO_CACHE, else ~/.cache/rspo")
    p.add_argument("--no-warm-start", action="store_true", help="the untrained model (its own cache entry)")
    a = p.parse_args(argv)
    print(build_tiny(a.env, a.preset, a.seed, cache_dir=a.cache_dir, warm_start=not a.no_warm_start))


if __name__ == "__main__":
    main()
