"""`--rollout-backend vllm` in each script, on a machine without vLLM.

vLLM runs on CUDA only, so here a stand-in `vllm` package (tests/vllm_stand_in/vllm, first on the subprocess's
PYTHONPATH) provides the part of vLLM's offline API that common/generation.py's VLLMGenerator uses: `LLM` (built
from a folder, `apply_model` to push weights, `generate` on prompt token ids, sleep / wake up, prefix-cache reset)
and `SamplingParams`, with LoRA requests (`vllm.lora.request.LoRARequest`, peft adapter folders). Its engine is a transformers model loaded from the folder the script hands over; its
`load_weights` accepts only the names of that model's parameters, and it generates with the project's HF
generator. It logs every push, so a test sees which weights each rollout ran on. What it cannot check is vLLM
itself (its kernels, its own log-probs, its memory sharing): that needs a GPU.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

STAND_IN = pathlib.Path(__file__).parent / "vllm_stand_in"


def _stand_in():
    """The stand-in module, loaded under another name (this process must keep failing `import vllm`)."""
    path = STAND_IN / "vllm"
    spec = importlib.util.spec_from_file_location(
        "vllm_stand_in", path / "__init__.py", submodule_search_locations=[str(path)]
    )  # a package, so that `vllm.lora.request` imports from it once it is sys.modules["vllm"]
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_vllm_rollouts_run_on_the_weights_of_the_model_that_samples(script, repo_root, script_env, tmp_path):
    from common.models import load_model

    log = tmp_path / "engine.jsonl"
    env = dict(script_env, PYTHONPATH=f"{STAND_IN}:{script_env['PYTHONPATH']}", VLLM_STAND_IN_LOG=str(log))
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
    initial = _stand_in().digest(tiny)
    assert start["digest"] == initial
    assert "gpu_memory_utilization" in start["kwargs"]

    # Every generate runs on the weights of the last push, and the first push is the initial policy. With the swap,
    # each iteration pushes the policy, then the explorer (after its process-reward step), then the evaluated
    # policy: at least three different sets of weights in two iterations.
    pushes = [e["digest"] for e in events if e["event"] == "push"]
    generates = [e for e in events if e["event"] == "generate"]
    assert pushes and generates and pushes[0] == initial
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


@pytest.fixture
def stand_in_engine(monkeypatch, tmp_path):
    """The stand-in as `vllm` in this process for one test, logging to a file; returns (module, read_log)."""
    module = _stand_in()
    log = tmp_path / "engine.jsonl"
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_STAND_IN_LOG", str(log))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return module, lambda: [json.loads(line) for line in log.read_text().splitlines()]


def _tokenizer_and_model():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["<action>go to desk 1</action> click[buy now]"] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special[0], pad_token=special[1])
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return tokenizer, Qwen2ForCausalLM(config)


def _sgd_like_step(model, prompt, optimizer):
    ids = torch.tensor([prompt])
    loss = -model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(1, ids[0, 1:, None]).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_weights_are_repushed_after_updates_that_leave_version_counters_unchanged(stand_in_engine, tmp_path):
    """A fused AdamW step, a write through .data (marked by hand) and a load_state_dict each change the weights; the
    next rollout must run on the new ones. The fused step leaves every parameter's autograd `_version` as it was,
    so a generator that watches those counters samples it with stale weights. Unchanged weights are not re-pushed."""
    from common import generation

    module, read_log = stand_in_engine
    tokenizer, model = _tokenizer_and_model()
    gen = generation.make_generator("vllm", tokenizer, max_new_tokens=3, model=model, engine_dir=tmp_path / "engine")
    prompt = tokenizer.encode("<action>go to desk 1</action>")

    def rollout_digest() -> str:
        gen.generate(model, [prompt])
        return read_log()[-1]["digest"]

    assert rollout_digest() == module.digest(model)
    assert rollout_digest() == module.digest(model)
    assert sum(e["event"] == "push" for e in read_log()) == 1  # same weights: pushed once

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    versions = [p._version for p in model.parameters()]
    before = module.digest(model)
    _sgd_like_step(model, prompt, optimizer)
    assert [p._version for p in model.parameters()] == versions and module.digest(model) != before
    assert rollout_digest() == module.digest(model)

    for p in model.parameters():
        p.data.mul_(0.5)
    generation.mark_weights_updated(model)
    assert rollout_digest() == module.digest(model)

    other = _tokenizer_and_model()[1]
    model.load_state_dict(other.state_dict())
    assert rollout_digest() == module.digest(other)
    assert sum(e["event"] == "push" for e in read_log()) == 4


# ---------------------------------------------------------------------------------------------------------------
# LoRA: adapters go to the engine as LoRA requests; the frozen base is never pushed


def _teacher_forced_logprobs(model, prompt: list[int], token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logp = model(input_ids=ids).logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(token_ids)[:, None]).squeeze(1)


def test_lora_views_generate_with_their_own_adapter_and_changed_adapters_get_new_ids(stand_in_engine, tmp_path):
    """The policy's and the explorer's rollouts carry each adapter's log-probs (those of the HF forward of the view)
    and the base view's carry the bare base's; after an update only the updated adapter is written again, under a new
    id; the base weights are never pushed; old adapter folders are removed."""
    from common import generation, models

    module, read_log = stand_in_engine
    tokenizer, model = _tokenizer_and_model()
    base_digest = module.digest(model)
    peft_model = models.add_lora(model, ["policy", "explorer"], rank=4)
    policy, explorer, base = (models.AdapterView(peft_model, name) for name in ("policy", "explorer", None))
    torch.manual_seed(1)
    with torch.no_grad():  # two different adapters (add_lora starts both at B = 0, the base's function)
        for view in (policy, explorer):
            for p in view.parameters():
                p.add_(torch.randn_like(p))
    engine_dir = tmp_path / "engine"
    gen = generation.make_generator("vllm", tokenizer, max_new_tokens=4, model=policy, engine_dir=engine_dir)
    prompt = tokenizer.encode("<action>go to desk 1</action>")

    def check(view, other) -> int:
        """Generate with `view`, check its log-probs against the HF forward; returns the LoRA id it ran with."""
        (g,) = gen.generate(view, [prompt])
        expected = _teacher_forced_logprobs(view, prompt, g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)
        assert not torch.allclose(_teacher_forced_logprobs(other, prompt, g.token_ids), expected, atol=1e-3)
        event = read_log()[-1]
        assert event["event"] == "generate" and event["digest"] == base_digest
        return event["lora_id"]

    start = read_log()[0]
    assert start["digest"] == base_digest and "enable_lora" in start["kwargs"]
    assert (check(policy, explorer), check(explorer, policy), check(base, policy)) == (1, 2, None)
    assert check(policy, explorer) == 1  # unchanged: the same id, not written again

    optimizer = torch.optim.AdamW(explorer.parameters(), lr=1e-1, fused=True)
    _sgd_like_step(explorer, prompt, optimizer)
    assert (check(policy, explorer), check(explorer, policy)) == (1, 3)
    _sgd_like_step(explorer, prompt, optimizer)
    assert (check(explorer, policy), check(policy, explorer)) == (4, 1)
    explorer.load_state_dict(policy.state_dict())  # the explorer's sync to the policy
    (g,) = gen.generate(explorer, [prompt])
    assert read_log()[-1]["lora_id"] == 5
    assert torch.allclose(torch.tensor(g.logprobs), _teacher_forced_logprobs(policy, prompt, g.token_ids), atol=1e-4)

    events = read_log()
    assert not [e for e in events if e["event"] == "push"]
    assert [e["id"] for e in events if e["event"] == "load_lora"] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (engine_dir / "adapters").iterdir()) == ["explorer-4", "explorer-5", "policy-1"]
    with pytest.raises(ValueError, match="AdapterViews"):  # a full model would need a push over the frozen base
        gen.generate(_tokenizer_and_model()[1], [prompt])


def test_lora_script_rolls_out_with_lora_requests(repo_root, script_env, tmp_path):
    """`--lora-rank 4 --rollout-backend vllm` end to end: the engine starts from the initial base, no weights are ever
    pushed, and the policy and the explorer roll out through their own adapters."""
    from common.models import load_model

    log = tmp_path / "engine.jsonl"
    env = dict(script_env, PYTHONPATH=f"{STAND_IN}:{script_env['PYTHONPATH']}", VLLM_STAND_IN_LOG=str(log))
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(repo_root / "rspo_grpo_webshop.py"), *SMALL, "--lora-rank", "4"]
    cmd += ["--rollout-backend", "vllm", "--runs-dir", str(runs)]
    proc = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    events = [json.loads(line) for line in log.read_text().splitlines()]

    tiny, _ = load_model("tiny", env_name="webshop")
    start = events[0]
    assert start["event"] == "start" and start["digest"] == _stand_in().digest(tiny)
    assert not [e for e in events if e["event"] == "push"]
    loads = {e["id"]: e["name"] for e in events if e["event"] == "load_lora"}
    assert {name.split("-")[0] for name in loads.values()} == {"policy", "explorer"}
    generates = [e for e in events if e["event"] == "generate"]
    assert generates and all(e["lora_id"] in loads and e["digest"] == start["digest"] for e in generates)

    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["iteration"] for m in metrics if "train/success_rate" in m] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["losses/policy_loss"])) for m in metrics if "losses/policy_loss" in m)
