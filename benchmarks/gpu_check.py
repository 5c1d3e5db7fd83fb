"""The GPU check: the one short script to run the day a CUDA machine is at hand.

    python benchmarks/gpu_check.py                    # on the GPU: bf16 log-prob check, each script 2 iterations --cuda
    python benchmarks/gpu_check.py --cpu              # the same on the CPU in fp32 (--no-cuda), as the tests run it
    python benchmarks/gpu_check.py --scripts grpo ppo --tasks 4 --group-size 4    # a subset, larger groups

The machine needs the Python packages the scripts need (torch, transformers, tyro, ...; no vLLM, no network); the
default tiny models come with the working tree (tiny_models/; a model missing there is built into RSPO_CACHE,
which takes minutes). Nothing is installed: missing packages are named, and
the check stops.

1. Log-probs: the tiny WebShop model generates responses to a few expert-turn prompts with common/generation.py's
   HFGenerator (under bf16 autocast on CUDA, fp32 on the CPU, as the scripts roll out), and each script's
   `token_logprobs` recomputes them with the training forward (right padding, response mask, same temperature).
   The max and mean absolute differences must stay within a tolerance suited to the precision: bf16 rounds
   differently in a KV-cached decode and in a full forward; in fp32 the two agree to float error.
2. Each script (GRPO on WebShop, GiGPO on WebShop and ALFWorld, PPO on ALFWorld) trains 2 iterations in a
   subprocess in swap mode (policy, explorer, replay buffer), evaluates, checkpoints, into a temporary runs folder;
   its per-iteration time (rollout + update) and token rates come from the run's metrics.jsonl (`perf/*`).

Prints one summary table; exits 1 if a check failed, 2 if packages are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What the scripts import on this path (embedded envs, HF generation, no --track): module -> what needs it.
REQUIRED = {
    "torch": "everything",
    "transformers": "the models",
    "tokenizers": "the tiny model's tokenizer",
    "safetensors": "loading the tiny model",
    "tyro": "the scripts' command lines",
    "numpy": "the scripts",
    "tqdm": "common/run.py's progress bar",
    "matplotlib": "common/run.py's learning curve",
    "bm25s": "the embedded WebShop's search",
    "rapidfuzz": "the embedded WebShop's matching",
}
SCRIPTS = {  # key: (script, its extra flags, the env whose tiny model it trains)
    "grpo": ("rspo_grpo_webshop.py", [], "webshop"),
    "gigpo-webshop": ("rspo_gigpo.py", ["--env", "webshop"], "webshop"),
    "gigpo-alfworld": ("rspo_gigpo.py", ["--env", "alfworld"], "alfworld"),
    "ppo": ("rspo_ppo_alfworld.py", [], "alfworld"),
}
LOGPROB_SCRIPTS = ("rspo_grpo_webshop.py", "rspo_gigpo.py", "rspo_ppo_alfworld.py")
TOLERANCE = {"bf16": {"max": 0.25, "mean": 0.02}, "fp32": {"max": 1e-4, "mean": 1e-5}}


def missing_imports() -> list[str]:
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def load_script(filename: str):
    """A script as a module (its `__main__` block does not run), for its module-level functions."""
    spec = importlib.util.spec_from_file_location(filename.removesuffix(".py"), ROOT / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logprob_diffs(
    model,
    generator,
    prompts: list[list[int]],
    token_logprobs,
    *,
    temperature: float,
    autocast,
    forward_temperature=None,
):
    """|generator's log-prob - training forward's log-prob| of every generated token, as one float32 tensor.

    The responses are sampled at `temperature`; the forward (`token_logprobs` of a script, right-padded rows of
    prompt + response, the response mask) runs at `forward_temperature` (default: the same). Both under `autocast`.
    """
    import torch

    forward_temperature = temperature if forward_temperature is None else forward_temperature
    with autocast():
        gens = generator.generate(model, prompts, temperature=temperature)
    device = next(model.parameters()).device
    rows = [p + g.token_ids for p, g in zip(prompts, gens)]
    width = max(len(r) for r in rows)
    pad = generator.tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (p, g) in enumerate(zip(prompts, gens)):
        input_ids[i, : len(rows[i])] = torch.tensor(rows[i])
        attention_mask[i, : len(rows[i])] = 1
        response_mask[i, len(p) - 1 : len(p) - 1 + len(g.token_ids)] = True  # position t predicts token t + 1
    with torch.no_grad(), autocast():
        logprobs, _ = token_logprobs(
            model, input_ids.to(device), attention_mask.to(device), forward_temperature,
            response_mask=response_mask.to(device),
        )  # fmt: skip
    forward = logprobs.float().cpu()[response_mask]
    generated = torch.tensor([lp for g in gens for lp in g.logprobs], dtype=torch.float32)
    return (forward - generated).abs()


def check_logprobs(device, n_prompts: int, max_new_tokens: int, temperatures: list[float], seed: int) -> list[dict]:
    """One result per script: the generator's bf16 (CUDA) / fp32 (CPU) log-probs against its training forward."""
    import torch

    from common import models
    from common.generation import HFGenerator
    from common.prompts import encode_prompt
    from envs import webshop
    from tiny_models import build as tiny_build

    precision = "bf16" if device.type == "cuda" else "fp32"
    tol = TOLERANCE[precision]

    def autocast():
        # As in the scripts: bf16 autocast on CUDA; fp32 on the CPU.
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    model, tokenizer = models.load_model("tiny", env_name="webshop", preset="small", seed=1, device=device)
    model.eval()
    cfg = tiny_build.tiny_config("webshop")
    goals = webshop.split_seeds("test", 2)
    turns = tiny_build.collect_expert_turns("webshop", "small", goals)[:n_prompts]
    prompts = [
        encode_prompt(
            tokenizer, task, obs, hist, adm, history_len=cfg["history_len"], short=True,
            by_number=webshop.TINY_ANSWER_BY_NUMBER, max_prompt_tokens=cfg["max_prompt_tokens"],
        )
        for task, obs, hist, adm, _ in turns
    ]  # fmt: skip
    generator = HFGenerator(tokenizer, max_new_tokens=max_new_tokens)
    results = []
    for filename in LOGPROB_SCRIPTS:
        token_logprobs = load_script(filename).token_logprobs
        torch.manual_seed(seed)
        diffs = torch.cat(
            [
                logprob_diffs(model, generator, prompts, token_logprobs, temperature=t, autocast=autocast)
                for t in temperatures
            ]
        )
        worst, mean = float(diffs.max()), float(diffs.mean())
        ok = worst <= tol["max"] and mean <= tol["mean"]
        detail = (
            f"max {worst:.2e}, mean {mean:.2e} over {diffs.numel()} tokens of {len(prompts)} prompts at "
            f"T={', '.join(map(str, temperatures))} (tolerance {precision}: max {tol['max']:g}, mean {tol['mean']:g})"
        )
        results.append({"check": f"log-probs: generate vs {filename} token_logprobs", "ok": ok, "detail": detail})
    return results


def run_script(key: str, cuda: bool, runs_dir: pathlib.Path, tasks: int, group_size: int, timeout: int) -> dict:
    """Train one script for 2 iterations in a subprocess; its per-iteration times from metrics.jsonl."""
    from common.run import read_metrics

    filename, extra, _ = SCRIPTS[key]
    out = runs_dir / key
    cmd = [
        sys.executable, str(ROOT / filename), *extra, "--cuda" if cuda else "--no-cuda",
        "--num-iterations", "2", "--num-eval-tasks", "4", "--eval-every", "0", "--no-eval-at-start",
        "--tasks-per-iteration", str(tasks), "--group-size", str(group_size),
        "--explorer-rollouts-per-task", str(group_size), "--runs-dir", str(out),
    ]  # fmt: skip
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", CI="1", PYTHONPATH=str(ROOT)
    )
    name = f"run {filename}{' ' + ' '.join(extra) if extra else ''}"
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"check": name, "ok": False, "detail": f"timed out after {timeout} s"}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n    ".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        return {"check": name, "ok": False, "detail": f"exit {proc.returncode}; last lines:\n    {tail}"}
    run_dirs = [p for p in out.iterdir() if p.is_dir()]
    rows = [r for r in read_metrics(run_dirs[0]) if "perf/rollout_s" in r] if len(run_dirs) == 1 else []
    if [r.get("iteration") for r in rows] != [1, 2]:
        return {"check": name, "ok": False, "detail": f"metrics.jsonl has no rows for iterations 1 and 2 ({out})"}
    times = [r["perf/rollout_s"] + r["perf/update_s"] for r in rows]
    last = rows[-1]
    detail = (
        f"iteration 1 {times[0]:.2f} s, iteration 2 {times[1]:.2f} s (rollout {last['perf/rollout_s']:.2f} + update "
        f"{last['perf/update_s']:.2f}), {last['perf/gen_tokens_per_s']:,.0f} generated tok/s, "
        f"{last['perf/train_tokens_per_s']:,.0f} trained tok/s; {wall:.0f} s in all"
    )
    return {"check": name, "ok": True, "detail": detail}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the CPU fallback: --no-cuda runs and fp32 log-probs")
    p.add_argument("--scripts", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS), help="which runs")
    p.add_argument("--tasks", type=int, default=2, help="--tasks-per-iteration of the runs")
    p.add_argument("--group-size", type=int, default=2, help="--group-size and --explorer-rollouts-per-task")
    p.add_argument("--logprob-prompts", type=int, default=8, help="prompts of the log-prob check (0: skip it)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response budget of the log-prob check")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=int, default=900, help="seconds per script run")
    a = p.parse_args(argv)

    missing = missing_imports()
    if missing:
        print("missing Python packages (nothing was installed; `pip install -r requirements.txt` provides them):")
        for name in missing:
            print(f"  {name:14s} needed for {REQUIRED[name]}")
        return 2

    os.environ.setdefault("RSPO_CACHE", str(ROOT / ".rspo_cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    from common import models
    from tiny_models import build as tiny_build

    results: list[dict] = []
    cuda = not a.cpu
    if cuda and not torch.cuda.is_available():
        results.append({"check": "CUDA", "ok": False, "detail": "torch sees no CUDA device (--cpu: the CPU fallback)"})
    device = torch.device("cuda" if cuda and torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"gpu_check on {where}: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}, {torch.get_num_threads()} CPU threads, RSPO_CACHE={os.environ['RSPO_CACHE']}"
    )
    if device.type == "cuda":
        results.append(
            {"check": "bf16", "ok": torch.cuda.is_bf16_supported(), "detail": "torch.cuda.is_bf16_supported()"}
        )

    if not any(r["ok"] is False for r in results):
        env_names = {"webshop"} if a.logprob_prompts > 0 else set()
        env_names |= {SCRIPTS[k][2] for k in a.scripts}
        tiny = models.default_cache_dir() / "tiny"
        for env_name in sorted(env_names):
            before = set(tiny.iterdir()) if tiny.is_dir() else set()
            start = time.perf_counter()
            folder = tiny_build.build_tiny(env_name, "small", 1)
            if folder.parent == tiny_build.COMMITTED_TINY_DIR:
                how = "committed"
            elif folder in before:
                how = "found in the cache"
            else:
                how = f"built now in {time.perf_counter() - start:.0f} s"
            results.append({"check": f"tiny model ({env_name})", "ok": True, "detail": f"{how}: {folder.name}"})
        if a.logprob_prompts > 0:
            results += check_logprobs(device, a.logprob_prompts, a.max_new_tokens, a.temperatures, a.seed)
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            for key in a.scripts:
                print(f"running {' '.join([SCRIPTS[key][0], *SCRIPTS[key][1]])} (2 iterations) ...", flush=True)
                results.append(run_script(key, cuda, pathlib.Path(tmp), a.tasks, a.group_size, a.timeout))

    print(f"\nSummary ({where}, {'bf16 autocast' if device.type == 'cuda' else 'fp32'}):")
    width = max(len(r["check"]) for r in results)
    for r in results:
        print(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['check']:{width}s}  {r['detail']}")
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
