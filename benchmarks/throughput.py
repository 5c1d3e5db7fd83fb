"""Throughput benchmark of the GRPO pieces (tiny model, embedded WebShop, CPU), all in one process on one machine.

(a) rollout: generated tokens/s and env steps/s of the batched lockstep rollout (one `generate` call per turn for
    all active envs) against playing the same episodes one env at a time (batch 1), and their ratio;
(b) update: trained tokens/s of the GRPO update (old/ref log-probs + epochs of forward/backward/AdamW) and its
    achieved FLOP/s against the matmul peak measured in the same process with the same thread count (MFU);
(c) scaling: seconds per iteration (rollout + update) at 1x, 2x, 4x the number of envs, and the ratios to 1x
    (below 2x and 4x means batching pays).

Model FLOPs (stated so the figure can be checked): for a row of T tokens, one forward pass costs
    F_fwd(T) = 2 * N_mm * T + 4 * L * d * T^2
where N_mm is the number of matmul weights (every nn.Linear: attention q/k/v/o, MLP gate/up/down, and the LM head,
which is tied to the embedding but is still a d x V matmul: a quarter of the tiny model's N_mm), L the number of
layers and d the attention width (the T^2 term is QK^T and AV over the full T x T score matrix, as computed).
The scripts apply the LM head only at the response positions (the only ones a loss reads), so its term counts the
response tokens only (2 * N_head * T_response); under `--experiment full-logits` it counts every position.
A training pass is 3 * F_fwd (backward = 2 x forward); the update phase counts 2 * F_fwd per row for the old and
reference log-probs plus 3 * F_fwd per row per epoch. Padding, softmax/log-softmax, norms and the optimiser are
not counted (they are real work, so MFU is a lower bound on how busy the matmul units are). The peak is the best of
a few fp32 `torch.matmul` of `--matmul-size`^3 (2 n^3 FLOPs each).

`--experiment full-logits` is the update before the speed-up, kept to show its before/after: every update is also
timed with the training script's `token_logprobs` replaced (in this process only) by the former one, which applies
the LM head and the vocabulary softmax at every position, on the same trajectories from the same initial weights;
the report gives the before/after ratios and the largest difference of the log-probs (float rounding only).

    python benchmarks/throughput.py                            # ~5 minutes on 2 shared cores
    python benchmarks/throughput.py --experiment full-logits --threads 1   # before/after of the update
    python benchmarks/throughput.py --envs 1 --max-steps 2 --max-new-tokens 8 --matmul-size 128   # smoke size

Prints a markdown table and writes `--out` (default benchmarks/results/throughput.json).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import math
import os
import pathlib
import platform
import pstats
import random
import sys
import time
from contextlib import contextmanager, nullcontext

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import rspo_grpo_webshop as grpo  # noqa: E402
from common import envs as cenvs  # noqa: E402
from common import generation, models  # noqa: E402
from tiny_models import build as tiny_build  # noqa: E402

SCALES = (1, 2, 4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (matmul peak and model alike)")
    p.add_argument("--envs", type=int, default=8, help="envs at 1x (B*G); (a) and (b) use 2x, (c) 1x, 2x, 4x")
    p.add_argument("--group-size", type=int, default=4, help="G: envs per task (B = envs / G, at least 1)")
    p.add_argument("--max-steps", type=int, default=5, help="env steps per episode (the script: 15)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response budget per turn (the script's default)")
    p.add_argument("--history-len", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--update-epochs", type=int, default=1)
    p.add_argument("--minibatch-tokens", type=int, default=16384)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n x n fp32 matmul of the peak")
    p.add_argument("--matmul-repeats", type=int, default=5)
    p.add_argument(
        "--repeats", type=int, default=2, help="each rollout/update is run this many times; the fastest counts"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--model-name", default="tiny", help="`tiny` (the cached warm-started model) or a local model folder"
    )
    p.add_argument(
        "--experiment",
        choices=["none", *EXPERIMENTS],
        default="none",
        help="also time every update with this change applied, and report before/after: "
        + "; ".join(f"{k}: {v}" for k, v in EXPERIMENTS.items()),
    )
    p.add_argument("--profile", action="store_true", help="print the top of a cProfile of one 1x iteration")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput.json"))
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- measurements


def matmul_peak(n: int, repeats: int) -> float:
    """Best achieved FLOP/s of an fp32 n x n @ n x n matmul (2 n^3 FLOPs) over `repeats` timed runs after a warm-up;
    a run is as many matmuls as take about 20 ms (one for the default n), so that a small n is not timer noise."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    t0 = time.perf_counter()
    torch.matmul(a, b)
    calls = max(1, min(1000, int(0.02 / max(time.perf_counter() - t0, 1e-7))))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.matmul(a, b)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2.0 * n**3 / best


def matmul_weights(model: torch.nn.Module) -> int:
    """N_mm: weights of every nn.Linear (the tied LM head included: it is a d x V matmul)."""
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))


def forward_flops(
    lengths: list[int], n_mm: int, n_layers: int, d_attn: int, n_head: int = 0, head_tokens: list[int] | None = None
) -> float:
    """sum over rows of F_fwd(T) = 2 N_mm T + 4 L d T^2; with head_tokens, the LM head (n_head weights) is counted
    at head_tokens[i] positions of row i instead of all T: 2 (N_mm - n_head) T + 2 n_head T_head + 4 L d T^2."""
    if head_tokens is None:
        return float(sum(2 * n_mm * t + 4 * n_layers * d_attn * t * t for t in lengths))
    return float(
        sum(
            2 * (n_mm - n_head) * t + 2 * n_head * h + 4 * n_layers * d_attn * t * t
            for t, h in zip(lengths, head_tokens)
        )
    )


def training_rows(trajs: list, turn_adv: torch.Tensor) -> list:
    """The script's training rows with their turn advantages (make_rows + set_advantages)."""
    rows = grpo.make_rows(trajs)
    grpo.set_advantages(rows, turn_adv)
    return rows


class TimedLockstepEnvs(cenvs.LockstepEnvs):
    """LockstepEnvs that adds the wall time of reset/step (the env's own work) to `env_s`."""

    env_s = 0.0

    def reset(self, seeds):
        t0 = time.perf_counter()
        try:
            return super().reset(seeds)
        finally:
            self.env_s += time.perf_counter() - t0

    def step(self, actions):
        t0 = time.perf_counter()
        try:
            return super().step(actions)
        finally:
            self.env_s += time.perf_counter() - t0


class Bench:
    """The model, tokenizer, generator and env pools shared by every measurement of one run."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device("cpu")
        self.policy, self.tokenizer = models.load_model(
            args.model_name, env_name="webshop", preset="small", seed=args.seed
        )
        self.ref = None
        self.generator = generation.make_generator("hf", self.tokenizer, max_new_tokens=args.max_new_tokens)
        self.pool: dict[int, TimedLockstepEnvs] = {}
        cfg = self.policy.config
        self.n_layers, self.d_attn = (
            cfg.num_hidden_layers,
            cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
        )
        self.n_mm = matmul_weights(self.policy)
        head = self.policy.get_output_embeddings()
        self.n_head = head.in_features * head.out_features
        # The script's settings (its rollout, prepare_rows and update read them from its Args); the prompts are the
        # tiny model's short form whatever --model-name is, as the script writes them for the tiny model.
        self.script_args = grpo.Args(
            model_name="tiny", max_prompt_tokens=tiny_build.TINY_CONFIG["max_prompt_tokens"],
            history_len=args.history_len, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            outcome_scale=10.0, is_cap=2.0, minibatch_tokens=args.minibatch_tokens,
            micro_batch_tokens=args.micro_batch_tokens, clip_coef=0.2, dual_clip=3.0, kl_coef=0.01, ent_coef=0.001,
            max_grad_norm=1.0, off_policy_correction="tis",
        )  # fmt: skip
        self.train_seeds = cenvs.split_seeds("webshop", "train", 4 * max(1, args.envs // args.group_size) * 4)
        self.initial_state = {k: v.clone() for k, v in self.policy.state_dict().items()}

    def reset_model(self) -> None:
        """The same initial weights before every measurement, so that every one updates the same model."""
        self.policy.load_state_dict(self.initial_state)
        self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=2e-4)

    def envs(self, n: int) -> TimedLockstepEnvs:
        if n not in self.pool:
            self.pool[n] = TimedLockstepEnvs("webshop", n, preset="small", max_steps=self.args.max_steps)
        self.pool[n].env_s = 0.0
        return self.pool[n]

    def rollout(self, task_seeds: list[int], group_size: int) -> tuple[list, dict]:
        """The script's rollout, `--repeats` times from the same torch seed (the same episodes each time: sampling,
        envs and model are seeded/unchanged); the stats of the fastest run (a shared machine only ever slows down)."""
        envs = self.envs(len(task_seeds) * group_size)
        best, first = None, None
        for _ in range(self.args.repeats):
            torch.manual_seed(self.args.seed)
            envs.env_s = 0.0
            t0 = time.perf_counter()
            trajs, stats = grpo.rollout(
                self.policy, self.generator, envs, task_seeds, group_size, self.script_args, sampler="policy",
                iteration=1, temperature=self.args.temperature, autocast=nullcontext,
            )  # fmt: skip
            stats = dict(stats, wall_s=time.perf_counter() - t0, env_s=envs.env_s)
            first = first or trajs
            if best is None or stats["wall_s"] < best["wall_s"]:
                best = stats
        return first, best

    def update(self, trajs: list) -> dict:
        """prepare_rows (old + ref log-probs) and update() of the script, outcome reward; returns times, tokens, FLOPs."""
        a = self.args
        _, turn_adv = grpo.grpo_turn_advantages(trajs, "outcome", True, 0.1)
        rows = training_rows(trajs, turn_adv)
        pad_id = self.tokenizer.pad_token_id
        t0, c0 = time.perf_counter(), time.process_time()
        grpo.prepare_rows(self.policy, self.ref, rows, self.script_args, pad_id, nullcontext)
        t1 = time.perf_counter()
        stats = grpo.update(self.policy, self.optimizer, rows, self.script_args, a.update_epochs, pad_id, nullcontext)
        t2, c2 = time.perf_counter(), time.process_time()
        lengths = [len(r.input_ids) for r in rows]
        # the script applies the LM head at response positions only; the full-logits experiment at all of them
        head_tokens = None
        if grpo.token_logprobs is not token_logprobs_full_vocab:
            head_tokens = [len(r.input_ids) - r.prompt_len for r in rows]
        fwd = forward_flops(lengths, self.n_mm, self.n_layers, self.d_attn, self.n_head, head_tokens)
        return {
            "prepare_s": t1 - t0,
            "train_s": t2 - t1,
            "update_s": t2 - t0,
            "update_cpu_s": c2 - c0,  # CPU time of this process: less sensitive to other processes' load
            "rows": len(rows),
            "tokens": sum(lengths),
            "trained_tokens": stats["trained_tokens"],
            "flops": 2 * fwd + 3 * fwd * a.update_epochs,
            "train_flops": 3 * fwd * a.update_epochs,
        }

    def tasks(self, num_envs: int) -> tuple[list[int], int]:
        """(task seeds, G) for num_envs envs: B = num_envs / G tasks (G shrinks when num_envs < G)."""
        g = min(self.args.group_size, num_envs)
        b = max(1, num_envs // g)
        return self.train_seeds[:b], g


def log(msg: str) -> None:
    print(f"[throughput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(bench: Bench, args: argparse.Namespace, variants: list[str]) -> dict:
    """All three measurements; every update is timed once per variant (the experiment first, then today's code),
    on the same trajectories from the same initial weights, so that before/after differ only in the change."""

    def updates(trajs: list) -> dict:
        # --repeats rounds, the variants interleaved within a round (a drifting load hits both alike); fastest kept
        out: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name in variants:
                bench.reset_model()
                torch.manual_seed(args.seed)
                with experiment(name):
                    u = bench.update(trajs)
                if name not in out or u["update_s"] < out[name]["update_s"]:
                    out[name] = u
        return out

    out: dict = {}
    n_ab = 2 * args.envs

    # (a) rollout: batched lockstep against one env at a time, the same episodes' seeds and sampler
    bench.reset_model()
    task_seeds, g = bench.tasks(n_ab)
    log(f"(a) batched rollout, {n_ab} envs")
    trajs, batched = bench.rollout(task_seeds, g)
    log(f"(a) the same {n_ab} episodes one env at a time")
    single = {"env_steps": 0, "gen_tokens": 0, "gen_s": 0.0, "wall_s": 0.0, "env_s": 0.0}
    for seed in cenvs.group_seeds(task_seeds, g):
        _, s = bench.rollout([seed], 1)
        single = {k: single[k] + s[k] for k in single}
    out["rollout"] = {"envs": n_ab, "batched": batched, "single": single}

    # (b) update on the batched rollout's trajectories
    log(f"(b) update ({', '.join(variants)})")
    out["update"] = updates(trajs)
    if len(variants) > 1:
        out["max_logprob_difference"] = max_logprob_difference(bench, trajs)

    # (c) scaling: rollout + update at 1x, 2x, 4x envs, each from the same initial weights
    out["scaling"] = {}
    for k in SCALES:
        n = k * args.envs
        bench.reset_model()
        task_seeds, g = bench.tasks(n)
        log(f"(c) iteration at {n} envs")
        trajs, r = bench.rollout(task_seeds, g)
        out["scaling"][n] = {"rollout": r, "update": updates(trajs)}
    return out


def summarise(raw: dict, peak: float, variant: str) -> dict[str, float]:
    """The figures of the table from the raw numbers of measure(), with the updates of `variant`."""
    b, s, u = raw["rollout"]["batched"], raw["rollout"]["single"], raw["update"][variant]
    res = {
        "rollout_batched_gen_tokens_per_s": b["gen_tokens"] / b["wall_s"],
        "rollout_batched_env_steps_per_s": b["env_steps"] / b["wall_s"],
        "rollout_single_gen_tokens_per_s": s["gen_tokens"] / s["wall_s"],
        "rollout_single_env_steps_per_s": s["env_steps"] / s["wall_s"],
        "rollout_batched_generate_share": b["gen_s"] / b["wall_s"],
        "rollout_batched_env_share": b["env_s"] / b["wall_s"],
        "update_trained_tokens_per_s": u["tokens"] / u["update_s"],
        "update_flops_per_s": u["flops"] / u["update_s"],
        "train_step_flops_per_s": u["train_flops"] / u["train_s"],
    }
    res["rollout_speedup_gen_tokens"] = res["rollout_batched_gen_tokens_per_s"] / res["rollout_single_gen_tokens_per_s"]
    res["rollout_speedup_env_steps"] = res["rollout_batched_env_steps_per_s"] / res["rollout_single_env_steps_per_s"]
    res["update_mfu"] = res["update_flops_per_s"] / peak
    res["train_step_mfu"] = res["train_step_flops_per_s"] / peak
    sizes = sorted(raw["scaling"], key=int)

    def iteration_s(n) -> float:
        it = raw["scaling"][n]
        return it["rollout"]["wall_s"] + it["update"][variant]["update_s"]

    base = raw["scaling"][sizes[0]]
    for n in sizes:
        it = raw["scaling"][n]
        res[f"iteration_s@{n}"] = iteration_s(n)
        res[f"iteration_rollout_share@{n}"] = it["rollout"]["wall_s"] / iteration_s(n)
        res[f"iteration_ratio@{n}"] = iteration_s(n) / iteration_s(sizes[0])
        # per env step, so that episodes that happen to be shorter or longer do not hide the scaling
        res[f"iteration_ratio_per_env_step@{n}"] = (iteration_s(n) / it["rollout"]["env_steps"]) / (
            iteration_s(sizes[0]) / base["rollout"]["env_steps"]
        )
    return res


# ---------------------------------------------------------------------------------------------- the experiment


def token_logprobs_full_vocab(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grpo.token_logprobs as it was before the speed-up: the LM head and the vocabulary softmax at every position.

    The response mask is ignored, so the d x V head matmul, log-softmax and entropy run on all T-1 positions of each
    row rather than the K response positions; the values at the response positions are the same (the callers read
    only those).
    """
    return _ORIGINAL["token_logprobs"](model, input_ids, attention_mask, temperature, with_entropy)


_ORIGINAL = {"token_logprobs": grpo.token_logprobs}
EXPERIMENTS = {"full-logits": "the update before the speed-up: LM head + vocabulary softmax at every position"}


@contextmanager
def experiment(name: str):
    """Apply an opt-in change to the training script's functions (module attributes) for the duration of the block."""
    if name == "none":
        yield
        return
    if name != "full-logits":
        raise ValueError(f"unknown experiment {name!r}")
    grpo.token_logprobs = token_logprobs_full_vocab
    try:
        yield
    finally:
        grpo.token_logprobs = _ORIGINAL["token_logprobs"]


def max_logprob_difference(bench: Bench, trajs: list) -> float:
    """Largest |difference| of log-probs and entropies at response positions, the script's code vs the full-logits
    experiment, on the training rows of `trajs` (both must compute the same numbers, up to float rounding)."""
    rows = training_rows(trajs, torch.zeros(sum(len(t.turns) for t in trajs)))
    batch = grpo.collate(rows[:16], bench.tokenizer.pad_token_id, bench.device)
    mask = batch["response_mask"]
    with torch.no_grad():
        lp, ent = grpo.token_logprobs(
            bench.policy, batch["input_ids"], batch["attention_mask"], 1.0, True, response_mask=mask
        )
        lp2, ent2 = token_logprobs_full_vocab(bench.policy, batch["input_ids"], batch["attention_mask"], 1.0, True)
    return max((lp - lp2)[mask].abs().max().item(), (ent - ent2)[mask].abs().max().item())


# ---------------------------------------------------------------------------------------------- report


def fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def table_rows(res: dict[str, float], raw: dict, peak: float) -> list[tuple[str, str]]:
    n_ab = raw["rollout"]["envs"]
    rows = [
        (f"(a) rollout, {n_ab} envs batched: generated tokens/s", fmt(res["rollout_batched_gen_tokens_per_s"])),
        (f"(a) rollout, {n_ab} envs batched: env steps/s", fmt(res["rollout_batched_env_steps_per_s"])),
        ("(a) rollout, one env at a time: generated tokens/s", fmt(res["rollout_single_gen_tokens_per_s"])),
        ("(a) rollout, one env at a time: env steps/s", fmt(res["rollout_single_env_steps_per_s"])),
        ("(a) batched / one at a time: generated tokens/s", fmt(res["rollout_speedup_gen_tokens"]) + "x"),
        ("(a) batched / one at a time: env steps/s", fmt(res["rollout_speedup_env_steps"]) + "x"),
        (
            "(a) batched rollout time in generate / in env.step",
            "{:.0%} / {:.0%}".format(res["rollout_batched_generate_share"], res["rollout_batched_env_share"]),
        ),  # fmt: skip
        (f"(b) update ({n_ab} envs' turns): trained tokens/s", fmt(res["update_trained_tokens_per_s"])),
        ("(b) update: achieved GFLOP/s (old+ref fwd, fwd+bwd)", fmt(res["update_flops_per_s"] / 1e9)),
        ("(b) fwd+bwd+AdamW only: achieved GFLOP/s", fmt(res["train_step_flops_per_s"] / 1e9)),
        ("(b) matmul peak GFLOP/s (fp32, same threads)", fmt(peak / 1e9)),
        ("(b) MFU: update / peak", f"{res['update_mfu']:.2%}"),
        ("(b) MFU: fwd+bwd+AdamW / peak", f"{res['train_step_mfu']:.2%}"),
    ]
    sizes = sorted(raw["scaling"], key=int)
    for n in sizes:
        rows.append((f"(c) s/iteration at {n} envs (rollout share)", "{} ({:.0%})".format(
            fmt(res[f"iteration_s@{n}"]), res[f"iteration_rollout_share@{n}"])))  # fmt: skip
    for n in sizes[1:]:
        k = int(n) // int(sizes[0])
        rows.append((f"(c) {k}x envs / 1x: s/iteration (per env step)", "{}x ({}x)".format(
            fmt(res[f"iteration_ratio@{n}"]), fmt(res[f"iteration_ratio_per_env_step@{n}"]))))  # fmt: skip
    return rows


def markdown(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def profile_iteration(bench: Bench, args: argparse.Namespace) -> str:
    bench.reset_model()
    task_seeds, g = bench.tasks(args.envs)
    prof = cProfile.Profile()
    prof.enable()
    trajs, _ = bench.rollout(task_seeds, g)
    bench.update(trajs)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    return s.getvalue()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if min(args.envs, args.group_size, args.threads, args.repeats, args.matmul_repeats, args.max_steps) < 1:
        raise SystemExit("--envs, --group-size, --threads, --repeats, --matmul-repeats, --max-steps must be >= 1")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    t_start = time.perf_counter()
    peak_start = matmul_peak(args.matmul_size, args.matmul_repeats)
    bench = Bench(args)
    if args.profile:
        print(profile_iteration(bench, args))

    # before (the experiment: the code as it was) and after (today's code), or today's code alone
    variants = ["none"] if args.experiment == "none" else [args.experiment, "none"]
    raw = measure(bench, args, variants)
    # Measured again at the end (a shared machine drifts); the higher one is the peak, so MFU is not flattered.
    peak_end = matmul_peak(args.matmul_size, args.matmul_repeats)
    peak = max(peak_start, peak_end)
    res = {name: summarise(raw, peak, name) for name in variants}

    base_rows = table_rows(res["none"], raw, peak)
    header: tuple[str, ...] = ("measurement", "value")
    rows = [list(r) for r in base_rows]
    ratios: dict = {}
    if len(variants) > 1:
        name = variants[0]
        header = ("measurement", f"before (--experiment {name})", "after (the scripts' code)")
        exp_rows = table_rows(res[name], raw, peak)
        # the rollout does not call the changed code: its rows are the same measurement
        rows = [[m, "(same)" if m.startswith("(a)") else v, w] for (m, v), (_, w) in zip(exp_rows, base_rows)]
        before, after = res[name], res["none"]
        ratios["update_trained_tokens_per_s"] = (
            after["update_trained_tokens_per_s"] / before["update_trained_tokens_per_s"]
        )
        rows.append(["after / before: update trained tokens/s", "", fmt(ratios["update_trained_tokens_per_s"]) + "x"])
        for n in sorted(raw["scaling"], key=int):
            ratios[f"iteration_s@{n}"] = before[f"iteration_s@{n}"] / after[f"iteration_s@{n}"]
            rows.append([f"before / after: s/iteration at {n} envs", "", fmt(ratios[f"iteration_s@{n}"]) + "x"])
        cpu = [raw["update"][v]["update_cpu_s"] for v in variants]
        cpu += [sum(raw["scaling"][n]["update"][v]["update_cpu_s"] for n in raw["scaling"]) for v in variants]
        ratios["update_cpu_s_b"] = cpu[0] / cpu[1]
        ratios["update_cpu_s_c"] = cpu[2] / cpu[3]
        rows.append(["before / after: update CPU seconds, (b) and all of (c)", "", "{}x, {}x".format(
            fmt(ratios["update_cpu_s_b"]), fmt(ratios["update_cpu_s_c"]))])  # fmt: skip
        ratios["max_logprob_difference"] = raw["max_logprob_difference"]
        rows.append(["max abs difference of log-probs / entropies", "", f"{raw['max_logprob_difference']:.1e}"])

    cfg = bench.policy.config
    report_file = pathlib.Path(str(bench.policy.name_or_path)) / "warmstart.json"
    warm_start = json.loads(report_file.read_text()).get("warm_start") if report_file.is_file() else None
    n_params = sum(p.numel() for p in bench.policy.parameters())
    print(
        f"model {args.model_name} (warm-started: {warm_start}): {n_params:,} parameters, N_mm = {bench.n_mm:,} matmul weights (LM head "
        f"{cfg.hidden_size}x{cfg.vocab_size} = {cfg.hidden_size * cfg.vocab_size:,}), L = {bench.n_layers}, "
        f"d = {bench.d_attn}; threads {args.threads}; envs {args.envs} x (1, 2, 4); max_steps {args.max_steps}; "
        f"max_new_tokens {args.max_new_tokens}; matmul peak {peak_start / 1e9:.1f} GFLOP/s at the start, "
        f"{peak_end / 1e9:.1f} at the end; the fastest of {args.repeats} runs of each measurement"
    )
    print()
    print(markdown([tuple(r) for r in rows], header))
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")

    result = {
        "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "matmul_peak_flops_per_s": peak,
            "matmul_peak_flops_per_s_at_start": peak_start,
            "matmul_peak_flops_per_s_at_end": peak_end,
        },
        "model": {
            "path": str(bench.policy.name_or_path),
            "warm_start": warm_start,
            "parameters": n_params,
            "matmul_weights": bench.n_mm,
            "layers": bench.n_layers,
            "attention_width": bench.d_attn,
            "vocab_size": cfg.vocab_size,
            "flops_formula": "F_fwd(T) = 2*N_mm*T + 4*L*d*T^2; update = sum_rows (2 + 3*epochs) * F_fwd(T)",
        },
        "results": res,
        "raw": json.loads(json.dumps(raw, default=str)),
        "experiment_ratios": ratios,
        "table": {"header": list(header), "rows": rows},
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
