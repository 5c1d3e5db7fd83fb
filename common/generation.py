"""Generation backends for rollouts: batched Hugging Face `generate` (CPU or GPU) and vLLM (GPU).

Both return, for every prompt, the response text, its token ids and the per-token log-probabilities under the
sampling distribution softmax(logits / temperature) of the model that generated it. The response stops at the
first `</action>` (the end of a turn in this project's response format) or at the tokenizer's EOS token.
"""

from __future__ import annotations

import itertools
import os
import shutil
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary
from transformers import GenerationConfig, PreTrainedModel, StoppingCriteria, StoppingCriteriaList

STOP_STRING = "</action>"


@dataclass
class Generation:
    """One generated response.

    text: decoded response, up to and including the first `</action>` (or up to the EOS token, which is not part
        of the text). token_ids: the response's token ids (EOS included when it ended the response, no padding).
    logprobs: log pi(token) under softmax(logits / temperature) of the generating model, one per token id.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]


def _eos_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


class _StopOnString(StoppingCriteria):
    """Per-sequence stop when the generated tail contains `stop` or the last token is EOS.

    Records, for every row, the response length at which it first stopped (`stop_len`), so that the padding that
    `generate` appends to finished rows never needs to be told apart from real tokens.
    """

    def __init__(self, tokenizer, prompt_len: int, stop: str, eos_ids: list[int]):
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.stop = stop
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long) if eos_ids else None
        # Every token decodes to at least one byte, so the stop string lies within its byte-length in tokens.
        self.window = len(stop.encode("utf-8")) + 1
        self.stop_len: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        n_new = input_ids.shape[1] - self.prompt_len
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if n_new <= 0:
            return done
        tails = input_ids[:, max(self.prompt_len, input_ids.shape[1] - self.window) :].tolist()
        last = input_ids[:, -1].cpu()
        for row, tail in enumerate(tails):
            if row in self.stop_len:
                done[row] = True
                continue
            hit_eos = self.eos_ids is not None and bool((last[row] == self.eos_ids).any())
            if hit_eos or self.stop in self.tokenizer.decode(tail, skip_special_tokens=False):
                self.stop_len[row] = n_new
                done[row] = True
        return done


class HFGenerator:
    """Batched generation with `model.generate`: left padding, KV cache, sampling or greedy decoding.

    Prompts are token-id lists (already templated). `batch_size` bounds how many prompts run through one
    `generate` call (None: all at once); memory grows with batch x new tokens x vocabulary (the kept logits).
    """

    def __init__(self, tokenizer, *, max_new_tokens: int, stop: str = STOP_STRING, batch_size: int | None = None):
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (load it with common.models.load_model)")
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.batch_size = batch_size
        self.eos_ids = _eos_ids(tokenizer)

    @torch.no_grad()
    def generate(
        self,
        model: PreTrainedModel,
        prompts: list[list[int]],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> list[Generation]:
        """Generate one response per prompt.

        Sampling draws from softmax(logits / temperature) restricted to the top-p nucleus (no top-k, no
        repetition penalty, whatever the model's own generation_config says). `greedy=True` (or temperature <= 0)
        takes the argmax. The reported log-probs are always log softmax(logits / T) of the chosen token, with
        T = temperature (T = 1 when temperature <= 0), i.e. what a teacher-forced forward pass at the same
        temperature gives; with top_p < 1 they are not renormalised over the nucleus.
        """
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        step = self.batch_size or len(prompts)
        out: list[Generation] = []
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(prompts), step):
                out.extend(self._generate_batch(model, prompts[start : start + step], temperature, top_p, greedy))
        finally:
            model.train(was_training)
        return out

    def _generate_batch(self, model, prompts, temperature, top_p, greedy) -> list[Generation]:
        device = next(model.parameters()).device
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[row, width - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

        greedy = greedy or temperature <= 0
        temp = temperature if temperature > 0 else 1.0
        # A fresh config, so that no checkpoint default (top_k=50, repetition_penalty, ...) changes the
        # distribution that the log-probs below describe.
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else temp,
            top_p=None if greedy else top_p,
            top_k=None if greedy else 0,
            pad_token_id=pad,
            eos_token_id=self.eos_ids or None,
            bos_token_id=self.tokenizer.bos_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=True,
        )
        stopper = _StopOnString(self.tokenizer, width, self.stop, self.eos_ids)
        saved_config = model.generation_config
        model.generation_config = GenerationConfig()
        try:
            result = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([stopper]),
                # Under torchrun, transformers would otherwise make every rank decode until all ranks are done
                # (one all-reduce per step): ranks generate for different numbers of prompts and turns.
                synced_gpus=False,
            )
        finally:
            model.generation_config = saved_config

        new_tokens = result.sequences[:, width:]  # [B, n]
        # logits: n tensors of [B, V], raw (before temperature / top-p)
        chosen_logprobs = torch.stack(
            [
                F.log_softmax(step_logits.float() / temp, dim=-1).gather(1, new_tokens[:, i : i + 1]).squeeze(1)
                for i, step_logits in enumerate(result.logits)
            ],
            dim=1,
        ).cpu()  # [B, n]
        new_tokens = new_tokens.cpu()
        gens = []
        for row in range(len(prompts)):
            n = stopper.stop_len.get(row, new_tokens.shape[1])
            ids = new_tokens[row, :n].tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut = text.find(self.stop)
            if cut >= 0:
                text = text[: cut + len(self.stop)]
            gens.append(Generation(text=text, token_ids=ids, logprobs=chosen_logprobs[row, :n].tolist()))
        return gens


# ---------------------------------------------------------------------------------------------------------------
# Weight-update counter: tells the vLLM generator when the weights it pushed into the engine are out of date
# ---------------------------------------------------------------------------------------------------------------
_update_numbers = itertools.count(1)
_last_update: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> number of the last update that changed it
_loads_tracked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # modules whose load_state_dict is recorded
_optimizer_hook = None


def mark_weights_updated(params) -> None:
    """Record that `params` (a module's, or an iterable of parameters) changed: they get a fresh update number.

    Optimizer steps, and loads into a module passed to `track_weight_updates`, are recorded without this call; call
    it after changing weights any other way (a write through `.data`, a hand-written weight average).
    """
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    number = next(_update_numbers)
    for p in params:
        _last_update[p] = number


def _mark_optimizer_params(optimizer, args, kwargs) -> None:
    mark_weights_updated(p for group in optimizer.param_groups for p in group["params"])


def _mark_loaded_module(module, incompatible_keys) -> None:
    mark_weights_updated(module)


def track_weight_updates(model: torch.nn.Module | None = None) -> None:
    """Record, from now on, every optimizer step in this process and every `load_state_dict` into `model`.

    A global optimizer step post-hook gives the stepped parameters a fresh update number, whatever the step does
    inside: a fused AdamW writes the weights in one kernel and leaves the parameters' autograd version counters as
    they were, so those cannot tell that the weights moved. A load-state-dict post-hook on `model` does the same
    for loads (the explorer's sync to the policy, a resumed checkpoint). Each hook is installed once.
    """
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_mark_optimizer_params)
    if model is not None and model not in _loads_tracked:
        model.register_load_state_dict_post_hook(_mark_loaded_module)
        _loads_tracked[model] = True


def weights_version(model: torch.nn.Module) -> int:
    """The number of the last recorded update of any of `model`'s parameters (0: none recorded)."""
    return max((_last_update.get(p, 0) for p in model.parameters()), default=0)


class VLLMGenerator:
    """Generation with vLLM's offline `LLM` engine on a GPU, sharing the device with training.

    The engine is created once from `model_path` (a folder written by save_pretrained, or a hub id in the local
    cache). `generate(model, ...)` first copies `model`'s weights into the engine when the engine holds another
    model's weights (the policy and the explorer alternate) or older ones: an explicit update counter
    (`track_weight_updates`, `weights_version`) records every optimizer step and `load_state_dict` of the model,
    so a change is detected without comparing tensors; weights changed in another way need
    `mark_weights_updated(model)`. Log-probs are vLLM's processed log-probs:
    log softmax(logits / T) of the chosen token (top-p renormalised when top_p < 1).
    `gpu_memory_utilization` is the share of GPU memory the engine (weights + KV cache) may take;
    `sleep_between_calls` frees the engine's KV cache between rollouts (vLLM sleep mode) for the training step.

    LoRA (`max_lora_rank` > 0; `model_path` then holds the frozen base, as make_generator writes it for an
    AdapterView): an AdapterView generates with a vLLM LoRA request instead of a weight push. Its adapter is written
    (peft format) into a fresh folder under `lora_dir` with a fresh integer id whenever its weights changed since it
    was last written; an unchanged adapter reuses its id, which the engine keeps loaded. The view of the bare base
    (adapter None, the KL reference) generates with no request. Nothing is ever pushed: the base is frozen.
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_new_tokens: int,
        model_path: str,
        stop: str = STOP_STRING,
        gpu_memory_utilization: float = 0.3,
        sleep_between_calls: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str = "auto",
        max_lora_rank: int = 0,
        lora_dir: str | os.PathLike | None = None,
    ):
        # In-process engine core, so that weights can be pushed as tensors without serialising them.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "--rollout-backend vllm needs vLLM on a CUDA machine: pip install -r requirements-gpu.txt "
                "(or use --rollout-backend hf)"
            ) from e
        self.vllm = vllm
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.sleep_between_calls = sleep_between_calls
        lora_kw = {}
        if max_lora_rank > 0:
            if lora_dir is None:
                raise ValueError("max_lora_rank > 0 needs lora_dir, the folder the adapters are written into")
            # vLLM accepts only some maximum ranks; two adapters (the policy and the explorer) stay loaded.
            max_lora_rank = min(r for r in (8, 16, 32, 64, 128, 256, 512) if r >= max_lora_rank)
            lora_kw = dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=2)
        self.lora_dir = lora_dir
        self._lora_ids = itertools.count(1)
        self._adapters: dict[str, tuple] = {}  # adapter name -> (peft model weakref, version, LoRARequest, folders)
        self.llm = vllm.LLM(
            model=model_path,
            tokenizer=model_path,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep_between_calls,
            max_model_len=max_model_len,
            seed=seed,
            dtype=dtype,
            logprobs_mode="processed_logprobs",
            **lora_kw,
        )
        track_weight_updates()
        self._pushed_model = None  # weakref to the model whose weights the engine holds
        self._pushed_version: tuple | None = None
        if sleep_between_calls:
            self.llm.sleep(level=1)

    @staticmethod
    def _version(model: torch.nn.Module) -> tuple:
        # The update counter, and the autograd version counters as a second signal: an in-place write under
        # no_grad (not through .data) bumps those without going through an optimizer.
        return (weights_version(model), sum(p._version for p in model.parameters()))

    def _is_pushed(self, model: torch.nn.Module) -> bool:
        held = self._pushed_model() if self._pushed_model is not None else None
        return held is model and self._pushed_version == self._version(model)

    def push_weights(self, model: torch.nn.Module) -> None:
        """Copy `model`'s parameters into the engine (by name, through the vLLM model's load_weights)."""
        weights = [(name, t.detach()) for name, t in model.state_dict().items()]

        def load(vllm_model):
            vllm_model.load_weights(weights=weights)

        self.llm.apply_model(load)
        self.llm.reset_prefix_cache()
        self._pushed_model = weakref.ref(model)
        self._pushed_version = self._version(model)

    def _lora_request(self, view):
        """The LoRA request for an AdapterView (None for the bare base), writing its adapter when it changed."""
        if view.adapter is None:
            return None
        version = self._version(view)
        held = self._adapters.get(view.adapter)
        if held is not None and held[0]() is view.peft_model and held[1] == version:
            return held[2]
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        folder = os.path.join(self.lora_dir, f"{view.adapter}-{lora_id}")
        view.save_pretrained(folder)
        folders = (held[3] if held is not None else []) + [folder]
        for old in folders[:-2]:  # the previous folder stays, in case the engine reloads that id
            shutil.rmtree(old, ignore_errors=True)
        request = LoRARequest(f"{view.adapter}-{lora_id}", lora_id, folder)
        self._adapters[view.adapter] = (weakref.ref(view.peft_model), version, request, folders[-2:])
        return request

    def generate(
        self,
        model: PreTrainedModel,
        prompts: list[list[int]],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> list[Generation]:
        """Same contract as HFGenerator.generate."""
        if not prompts:
            return []
        if self.sleep_between_calls:
            self.llm.wake_up()
        track_weight_updates(model)
        lora_request = None
        if _is_adapter_view(model) != (self.lora_dir is not None):
            raise ValueError(
                "AdapterViews (LoRA) generate with an engine started for LoRA (make_generator(model=view)), "
                "and only they do: the engine holds their frozen base"
            )
        if self.lora_dir is not None:
            lora_request = self._lora_request(model)
        elif not self._is_pushed(model):
            self.push_weights(model)
        greedy = greedy or temperature <= 0
        params = self.vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            max_tokens=self.max_new_tokens,
            stop=[self.stop],
            include_stop_str_in_output=True,
            logprobs=0,
            skip_special_tokens=True,
        )
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=lora_request)  # None: no adapter
        if self.sleep_between_calls:
            self.llm.sleep(level=1)
        gens = []
        for out in outputs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            lps = [step[tok].logprob for step, tok in zip(comp.logprobs, ids)]
            # Decoded with the training tokenizer (the engine may load another tokenizer class for the folder).
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut = text.find(self.stop)
            gens.append(
                Generation(text=text[: cut + len(self.stop)] if cut >= 0 else text, token_ids=ids, logprobs=lps)
            )
        return gens


def _is_adapter_view(model) -> bool:
    from common.models import AdapterView

    return isinstance(model, AdapterView)


def _lora_base_weights(hf_model: torch.nn.Module) -> dict:
    """The frozen base of a peft model's HF model, under Hugging Face names (no `base_layer`, no adapter weights)."""
    return {k.replace(".base_layer.", "."): v for k, v in hf_model.state_dict().items() if ".lora_" not in k}


def make_generator(
    backend: str,
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int | None = None,
    model_path: str | None = None,
    model: PreTrainedModel | None = None,
    engine_dir: str | os.PathLike | None = None,
    **vllm_kw,
):
    """backend "hf" -> HFGenerator (batch_size prompts per generate call; None: all).

    backend "vllm" -> VLLMGenerator, its engine started from `model_path` (a save_pretrained folder or a hub id), or,
    without one, from `model` and `tokenizer` saved into `engine_dir` (a run's initial policy, whatever model name
    it was loaded from). When `model` is an AdapterView (LoRA), `engine_dir` gets the frozen base instead, the
    engine enables LoRA at the adapter's rank, and adapters are written under `engine_dir`/adapters.
    vllm_kw go to VLLMGenerator (gpu_memory_utilization, sleep_between_calls, ...).
    """
    if backend == "hf":
        return HFGenerator(tokenizer, max_new_tokens=max_new_tokens, batch_size=batch_size)
    if backend == "vllm":
        if model_path is None:
            if model is None or engine_dir is None:
                raise ValueError(
                    "the vllm backend needs model_path (a folder written by save_pretrained, or a hub id), "
                    "or model and engine_dir to save it into"
                )
            if _is_adapter_view(model):
                model.hf_model.save_pretrained(engine_dir, state_dict=_lora_base_weights(model.hf_model))
            else:
                model.save_pretrained(engine_dir)
            tokenizer.save_pretrained(engine_dir)
            model_path = str(engine_dir)
        if _is_adapter_view(model):
            if engine_dir is None:
                raise ValueError("LoRA rollouts with vllm need engine_dir, the folder the adapters are written into")
            rank = max(config.r for config in model.peft_model.peft_config.values())
            vllm_kw = dict(vllm_kw, max_lora_rank=rank, lora_dir=os.path.join(engine_dir, "adapters"))
        return VLLMGenerator(tokenizer, max_new_tokens=max_new_tokens, model_path=model_path, **vllm_kw)
    raise ValueError(f"unknown rollout backend {backend!r}: expected 'hf' or 'vllm'")
