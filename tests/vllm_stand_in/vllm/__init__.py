"""A stand-in for the part of vLLM's offline API that common/generation.py's VLLMGenerator uses (tests only).

tests/test_vllm_backend.py puts this folder first on a script's PYTHONPATH, so `import vllm` finds it. The engine is
a transformers model loaded from the folder the script hands over; `load_weights` accepts only that model's
parameter names; generation runs the project's HF generator; every start, push and generate is logged (JSON lines)
to $VLLM_STAND_IN_LOG with a digest of the engine's weights. With enable_lora, `generate(..., lora_request=...)`
runs the engine's model with the peft adapter of that folder, loaded once per integer id (as vLLM caches it).
"""

import copy
import hashlib
import json
import os
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.generation import HFGenerator


def _log(**event):
    with open(os.environ["VLLM_STAND_IN_LOG"], "a") as f:
        f.write(json.dumps(event) + "\n")


def digest(model) -> str:
    """A short hash of the model's weights (names and values), also used by the test on its side."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Engine:
    """What apply_model hands to its function: the model, with vLLM's load_weights((name, tensor) pairs)."""

    def __init__(self, model):
        self.model = model

    def load_weights(self, weights):
        params = dict(self.model.named_parameters())
        seen = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:  # tied lm_head is not a separate parameter in some configs
                    if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                        continue
                    raise KeyError(f"vLLM stand-in: no parameter named {name}")
                params[name].copy_(tensor.to(params[name].dtype))
                seen.add(name)
        missing = set(params) - seen
        if missing:
            raise KeyError(f"vLLM stand-in: weights without {sorted(missing)[:3]}")


class LLM:
    def __init__(self, model, tokenizer, **kwargs):
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.asleep = False
        self.enable_lora = kwargs.get("enable_lora", False)
        self.loras = {}  # lora_int_id -> the engine's model with that adapter (a copy: the base stays as pushed)
        _log(event="start", folder=model, digest=digest(self.model), kwargs=sorted(kwargs))

    def apply_model(self, fn):
        assert not self.asleep, "weights pushed into a sleeping engine"
        fn(_Engine(self.model))
        _log(event="push", digest=digest(self.model))

    def reset_prefix_cache(self):
        pass

    def sleep(self, level=1):
        self.asleep = True

    def wake_up(self):
        self.asleep = False

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        assert not self.asleep, "generate on a sleeping engine"
        model = self.model
        if lora_request is not None:
            assert self.enable_lora, "a LoRA request to an engine started without enable_lora"
            if lora_request.lora_int_id not in self.loras:
                from peft import PeftModel

                # vLLM loads an id once; this copy of the base would miss later pushes, which LoRA runs never make.
                loaded = PeftModel.from_pretrained(copy.deepcopy(self.model), lora_request.lora_path).eval()
                self.loras[lora_request.lora_int_id] = loaded
                _log(event="load_lora", id=lora_request.lora_int_id, name=lora_request.lora_name,
                     path=lora_request.lora_path)  # fmt: skip
            model = self.loras[lora_request.lora_int_id]
        gen = HFGenerator(self.tokenizer, max_new_tokens=params.max_tokens)
        ids = [p["prompt_token_ids"] for p in prompts]
        outs = gen.generate(
            model, ids, temperature=params.temperature or 1.0, top_p=params.top_p, greedy=params.temperature == 0.0
        )
        lora_id = None if lora_request is None else lora_request.lora_int_id
        _log(event="generate", prompts=len(ids), digest=digest(self.model), lora_id=lora_id)
        return [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(
                        token_ids=o.token_ids,
                        logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(o.token_ids, o.logprobs)],
                    )
                ]
            )
            for o in outs
        ]
