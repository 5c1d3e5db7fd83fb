"""GPU memory of the training state for Qwen2.5-0.5B/1.5B/7B, from exact parameter counts (nothing is downloaded).

    python benchmarks/memory_table.py                  # markdown tables: parameters, full fine-tuning, LoRA
    python benchmarks/memory_table.py --lora-rank 16

Each model's Qwen2Config is built from the published architecture numbers (the config.json of the Instruct
release) and instantiated on the `meta` device, so its parameters are counted exactly without allocating them; a
closed-form count of the same architecture is printed beside it as a check. What the scripts hold on the GPU:

- full fine-tuning (what the scripts do today): every trained model (policy, explorer in swap mode, and in PPO the
  policy's and the explorer's critics) in fp32, with fp32 gradients and AdamW's two fp32 moments: 16 bytes per
  parameter; the frozen reference (the initial policy) in fp32: 4 bytes. The CUDA path runs the forward under
  bf16 autocast, which casts on the fly and keeps no second copy of the weights.
- LoRA (`--lora-rank r`): one frozen base in bf16 on CUDA (2 bytes per parameter) shared by the policy, the
  explorer and the reference (the base without adapters); rank-r adapters on every linear layer of the decoder
  (q, k, v, o, gate, up, down; not the LM head), one set each for the policy and the explorer, trained in fp32
  (16 bytes per adapter parameter); PPO adds one adapter set and a value head per critic on the same base.
  LoRA runs in one process with HF generate: of its table, only N=1 applies, without the vLLM column.
- N ranks (FSDP, planned): weights, gradients and optimizer states are sharded evenly, so each rank holds 1/N.
- the vLLM engine, colocated on each rank: its own bf16 copy of the weights (2 bytes per parameter of the policy,
  not sharded); on top of it the engine's KV cache, which the scripts size as a share of the GPU
  (gpu_memory_utilization, 0.3 by default, counts weights and cache together).

Not counted: activations (they scale with --micro-batch-tokens), the KV cache, CUDA context and allocator slack.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common.models import Critic  # noqa: E402

# The architecture numbers of the Qwen2.5 Instruct releases' config.json (the base models share them).
QWEN25 = {
    "Qwen2.5-0.5B": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen2.5-1.5B": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen2.5-7B": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, tie_word_embeddings=False,
    ),
}  # fmt: skip
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TRAINED_BYTES = 16  # fp32 weight + fp32 gradient + AdamW exp_avg and exp_avg_sq in fp32
FROZEN_FP32_BYTES = 4
BF16_BYTES = 2
GIB = 2**30


def meta_model(config: Qwen2Config) -> Qwen2ForCausalLM:
    """The model of `config` on the meta device: shapes only, no memory, no download."""
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


def count(module: torch.nn.Module) -> int:
    """Number of distinct parameters (a tied LM head counts once)."""
    return sum(p.numel() for p in module.parameters())


def qwen2_param_count(config: Qwen2Config) -> int:
    """Closed-form parameter count of a Qwen2 causal LM.

    Per layer: q/k/v projections with bias (k and v have num_key_value_heads * head_dim outputs), o projection
    without bias, the SwiGLU MLP (gate, up, down: 3 * hidden * intermediate), two RMSNorm weights. Plus the token
    embedding (vocab * hidden), the final norm, and an LM head of vocab * hidden unless tied to the embedding.
    """
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h
    layer = attention + 3 * h * i + 2 * h
    head = 0 if config.tie_word_embeddings else v * h
    return v * h + config.num_hidden_layers * layer + h + head


def lora_param_count(model: torch.nn.Module, rank: int) -> int:
    """Parameters of rank-`rank` adapters (A: rank x in, B: out x rank) on every decoder linear layer."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DECODER_LINEARS:
            total += rank * (module.in_features + module.out_features)
    return total


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:,.1f}"


def model_numbers(name: str, rank: int) -> dict:
    config = Qwen2Config(**QWEN25[name])
    model = meta_model(config)
    return {
        "name": name,
        "config": config,
        "params": count(model),
        "formula": qwen2_param_count(config),
        "critic": count(Critic(model)),  # the scripts' value model: the LM's trunk (no LM head) + Linear(hidden, 1)
        "lora": lora_param_count(model, rank),
        "critic_head": config.hidden_size + 1,
    }


def full_finetuning(m: dict, ppo: bool) -> dict[str, float]:
    """Bytes of weights, gradients and AdamW states on one rank (N = 1) with full fine-tuning."""
    trained = [m["params"], m["params"]] + ([m["critic"], m["critic"]] if ppo else [])  # policy, explorer, critics
    n_trained = sum(trained)
    return {
        "weights": 4 * n_trained + FROZEN_FP32_BYTES * m["params"],  # + the fp32 reference
        "grads": 4 * n_trained,
        "adamw": 8 * n_trained,
    }


def lora(m: dict, ppo: bool) -> dict[str, float]:
    """Bytes on one rank (N = 1) with LoRA: the bf16 base, and fp32 adapters with gradients and AdamW states."""
    adapters = 2 * m["lora"] + (2 * (m["lora"] + m["critic_head"]) if ppo else 0)
    return {
        "weights": BF16_BYTES * m["params"] + 4 * adapters,
        "grads": 4 * adapters,
        "adamw": 8 * adapters,
    }


def tables(rank: int, ranks: list[int]) -> str:
    rows = [model_numbers(name, rank) for name in QWEN25]
    out = [
        "| model | layers | hidden | parameters (meta count) | closed form | critic (trunk + value head) "
        f"| LoRA r={rank} adapter parameters |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in rows:
        c = m["config"]
        out.append(
            f"| {m['name']} | {c.num_hidden_layers} | {c.hidden_size} | {m['params']:,} | {m['formula']:,} "
            f"| {m['critic']:,} | {m['lora']:,} ({100 * m['lora'] / m['params']:.1f}%) |"
        )
    per_rank = " | ".join(f"N={n}" for n in ranks)
    header = f"| model | script | weights | gradients | AdamW | per rank: {per_rank} | + vLLM bf16 weights per rank |"
    rule = "|---|---|---|---|---|" + "---|" * len(ranks) + "---|"
    for title, fn in (
        ("Full fine-tuning (the scripts today)", full_finetuning),
        (f"LoRA r={rank} (--lora-rank {rank})", lora),
    ):
        note = "weights, gradients and AdamW states on one GPU, then their sum per rank over N ranks"
        out += ["", f"{title}, GiB (2^30 bytes): {note}", "", header, rule]
        for m in rows:
            for script, ppo in (("GRPO, GiGPO", False), ("PPO", True)):
                b = fn(m, ppo)
                total = sum(b.values())
                cells = " | ".join(gib(total / n) for n in ranks)
                out.append(
                    f"| {m['name']} | {script} | {gib(b['weights'])} | {gib(b['grads'])} | {gib(b['adamw'])} "
                    f"| {cells} | {gib(BF16_BYTES * m['params'])} |"
                )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="FSDP world sizes")
    a = p.parse_args()
    print(tables(a.lora_rank, a.ranks))


if __name__ == "__main__":
    main()
