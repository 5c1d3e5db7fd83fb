"""benchmarks/memory_table.py: the closed-form parameter count against a meta-device model, Qwen2.5-0.5B's
published count, the LoRA count by hand, and the bytes per parameter of the tables."""

import importlib.util
import pathlib

import pytest
from transformers import Qwen2Config

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("memory_table", ROOT / "benchmarks" / "memory_table.py")
memory_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_table)


@pytest.mark.parametrize("tied", [True, False])
def test_closed_form_count_is_the_meta_device_count_and_a_hand_count(tied):
    config = Qwen2Config(
        vocab_size=50, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    # By hand, head_dim 2, k/v width 4: q 8*8+8, k and v 8*4+4 each, o 8*8, MLP 3*8*12, two norms of 8.
    layer = 72 + 2 * 36 + 64 + 288 + 16
    hand = 50 * 8 + 2 * layer + 8 + (0 if tied else 50 * 8)
    assert memory_table.qwen2_param_count(config) == hand
    assert memory_table.count(memory_table.meta_model(config)) == hand


def test_qwen25_counts_match_the_published_numbers():
    published = {"Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304, "Qwen2.5-7B": 7_615_616_512}
    for name, n in published.items():
        m = memory_table.model_numbers(name, rank=64)
        assert m["params"] == m["formula"] == n, name
    # The 7B's LM head is untied: its critic has the trunk (no LM head, 152,064 x 3,584) and a value head.
    m = memory_table.model_numbers("Qwen2.5-7B", rank=64)
    assert m["critic"] == 7_615_616_512 - 152_064 * 3_584 + 3_584 + 1


def test_lora_count_by_hand():
    config = Qwen2Config(
        vocab_size=50, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    # r * (in + out) per linear: q (8, 8), k and v (8, 4), o (8, 8), gate and up (8, 12), down (12, 8); not lm_head
    per_layer = 16 + 12 + 12 + 16 + 20 + 20 + 20
    assert memory_table.lora_param_count(memory_table.meta_model(config), rank=3) == 2 * 3 * per_layer


def test_bytes_per_parameter():
    m = {"params": 1000, "critic": 900, "lora": 10, "critic_head": 5}
    # full: policy + explorer at 16 bytes, the fp32 reference at 4; PPO adds two critics at 16
    assert sum(memory_table.full_finetuning(m, ppo=False).values()) == 36 * 1000
    assert sum(memory_table.full_finetuning(m, ppo=True).values()) == 36 * 1000 + 32 * 900
    # LoRA: the bf16 base once, two adapter sets at 16 bytes; PPO adds two critic adapter sets and value heads
    assert sum(memory_table.lora(m, ppo=False).values()) == 2 * 1000 + 32 * 10
    assert sum(memory_table.lora(m, ppo=True).values()) == 2 * 1000 + 32 * 10 + 32 * 15


def test_tables_print_every_model_and_rank():
    text = memory_table.tables(rank=64, ranks=[1, 2, 4, 8])
    for name in memory_table.QWEN25:
        assert sum(line.startswith(f"| {name} |") for line in text.splitlines()) == 5  # counts, 2 full, 2 LoRA
    assert "494,032,768" in text and "| N=8 |" in text
