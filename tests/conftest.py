"""Test-wide settings: nothing reaches a hub, wandb stays offline, tiny models are cached once per test session."""

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Set before any test imports transformers or wandb.
os.environ.setdefault("RSPO_CACHE", str(ROOT / ".rspo_cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under `pytest -n 2` each worker gets one core: two threads per worker oversubscribe a 2-core machine and run
# the tiny models several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def small_lm():
    """Factory of one-layer Qwen2 causal LMs with random weights: small_lm(seed=0, vocab_size=40, **config), where
    config adds Qwen2Config fields (e.g. pad_token_id). Nothing is downloaded."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def make(seed: int = 0, vocab_size: int = 40, **config):
        torch.manual_seed(seed)
        cfg = Qwen2Config(
            vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, **config,
        )  # fmt: skip
        return Qwen2ForCausalLM(cfg)

    return make


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_models() -> None:
    """Build (or find in the cache) the default tiny models before a script subprocess needs them.

    The first build on a fresh clone takes minutes; done here it runs without the subprocess timeouts. The
    file lock in build_tiny runs one build at a time (WebShop's uses both cores): the other xdist worker waits
    for, then reuses, the models.
    """
    from tiny_models.build import build_tiny

    for env_name in ("webshop", "alfworld"):
        build_tiny(env_name, "small", 1)


@pytest.fixture(scope="session")
def script_env(tmp_path_factory, tiny_models) -> dict:
    """Environment for running a script in a subprocess: offline, the shared tiny-model cache, 1 thread."""
    env = dict(os.environ)
    env.update(
        RSPO_CACHE=os.environ["RSPO_CACHE"],
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path_factory.mktemp("wandb")),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    return env
