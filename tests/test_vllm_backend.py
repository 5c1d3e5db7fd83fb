"""`--rollout-backend vllm` in each script, on a machine without vLLM.

vLLM runs on CUDA only, so here a stand-in `vllm` package (written to a temporary folder that the subprocess
imports first) provides the part of vLLM's offline API that common/generation.py's VLLMGenerator uses: `LLM` (built
from a folder, `apply_model` to push weights, `generate` on prompt token ids, sleep / wake up, prefix-cache reset)
and `SamplingParams`. Its engine is a transformers model loaded from the folder the script hands over; its
`load_weights` accepts only the names of that model's parameters, and it generates with the project's HF
generator. It logs every push, so a test sees which weights each rollout ran on. What it cannot check is vLLM
itself (its kernels, its own log-probs, its memory sharing): that needs a GPU.
"""

import json
import subprocess
import sys

import pytest
import torch

STAND_IN = '''
import hashlib
import json
import os
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.generation import HFGenerator

LOG = os.environ["VLLM_STAND_IN_LOG"]


def _log(**event):
    with open(LOG, "a") as f:
        f.write(json.dumps(event) + "\\n")


def _digest(model):
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
        _log(event="start", folder=model, digest=_digest(self.model), kwargs=sorted(kwargs))

    def apply_model(self, fn):
        assert not self.asleep, "weights pushed into a sleeping engine"
        fn(_Engine(self.model))
        _log(event="push", digest=_digest(self.model))

    def reset_prefix_cache(self):
        pass

    def sleep(self, level=1):
        self.asleep = True

    def wake_up(self):
        self.asleep = False

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.asleep, "generate on a sleeping engine"
        gen = HFGenerator(self.tokenizer, max_new_tokens=params.max_tokens)
        ids = [p["prompt_token_ids"] for p in prompts]
        outs = gen.generate(self.model, ids, temperature=params.temperature or 1.0, top_p=params.top_p,
                            greedy=params.temperature == 0.0)
        _log(event="generate", prompts=len(ids), digest=_digest(self.model))
        return [
            SimpleNamespace(outputs=[SimpleNamespace(
                token_ids=o.token_ids,
                logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(o.token_ids, o.logprobs)],
            )])
            for o in outs
        ]
'''

SMALL = [
    "--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "2", "--explorer-rollouts-per-task", "2",
    "--max-steps", "3", "--max-new-tokens", "8", "--num-eval-tasks", "2", "--eval-every", "2", "--train-pool-size", "4",
    "--no-eval-at-start", "--reward-mode", "swap",
]  # fmt: skip
SCRIPTS = {
    "rspo_grpo_webshop.py": [],
    "rspo_gigpo.py": ["--env", "webshop"],
    "rspo_ppo_alfworld.py": [],
}


def _digest(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_vllm_rollouts_run_on_the_weights_of_the_model_that_samples(script, repo_root, script_env, tmp_path):
    from common.models import load_model

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "engine.jsonl"
    env = dict(script_env, PYTHONPATH=f"{tmp_path}:{script_env['PYTHONPATH']}", VLLM_STAND_IN_LOG=str(log))
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(repo_root / script), *SCRIPTS[script], *SMALL, "--rollout-backend", "vllm"]
    cmd += ["--runs-dir", str(runs)]
    proc = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    events = [json.loads(line) for line in log.read_text().splitlines()]

    # The engine starts from a folder inside the run that holds the initial policy (not the name "tiny").
    start = events[0]
    assert start["event"] == "start" and start["folder"].startswith(str(runs))
    env_name = "alfworld" if "alfworld" in script else "webshop"
    tiny, _ = load_model("tiny", env_name=env_name)
    assert start["digest"] == _digest(tiny)
    assert "gpu_memory_utilization" in start["kwargs"]

    # Every generate runs on the weights of the last push, and the first push is the initial policy. With the swap,
    # each iteration pushes the policy, then the explorer (after its process-reward step), then the evaluated
    # policy: at least three different sets of weights in two iterations.
    pushes = [e["digest"] for e in events if e["event"] == "push"]
    generates = [e for e in events if e["event"] == "generate"]
    assert pushes and generates and pushes[0] == _digest(tiny)
    last = None
    for e in events[1:]:
        if e["event"] == "push":
            last = e["digest"]
        else:
            assert e["digest"] == last
    assert len(set(pushes)) >= 3  # initial policy, then updated policy and explorer weights

    # Both iterations ran to the end and logged finite losses.
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["iteration"] for m in metrics if "train/success_rate" in m] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["losses/policy_loss"])) for m in metrics if "losses/policy_loss" in m)
