"""LoRA (common/models.py: add_lora, AdapterView) on the real tiny model: each view runs its own adapter in every
forward, generation and trunk pass, the reference view is the base model exactly, a sync or a checkpoint moves one
adapter's weights into another view, and a final save is a peft adapter folder."""

import copy
import importlib.util
import pathlib

import pytest
import torch
from peft import PeftModel

from common import models
from common.generation import HFGenerator
from common.run import BadInput, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
ADAPTERS = ["policy", "explorer", "critic"]
TEXTS = [
    "WebShop [SEP] Instruction: [SEP] i need a long clip-in hair extension <action>search[hair extension]</action>",
    "Back to Search [SEP] < Prev [SEP] color [SEP] black [SEP] Buy Now <action>click[buy now]</action>",
]


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): the tiny WebShop model, never wrapped (tests wrap copies of it)."""
    return models.load_model("tiny", env_name="webshop")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[1]


def fresh_model(tiny):
    return copy.deepcopy(tiny[0])


@pytest.fixture
def lora(tiny):
    """A fresh tiny model with the three adapters, and its views: {name: AdapterView} plus "ref" (the base)."""
    peft_model = models.add_lora(fresh_model(tiny), ADAPTERS, rank=4)
    views = {name: models.AdapterView(peft_model, name) for name in ADAPTERS}
    views["ref"] = models.AdapterView(peft_model, None)
    return peft_model, views


@pytest.fixture
def batch(tokenizer):
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")  # left padding: the batches the scripts run
    return enc.input_ids, enc.attention_mask


def logprobs(model, batch) -> torch.Tensor:
    ids, mask = batch
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def perturb(view, scale=0.05, seed=0):
    """Move every weight of the view's adapter (B included, so the adapter stops computing the base model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in view.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def policy_loss(view, batch) -> torch.Tensor:
    ids, mask = batch
    logits = view(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()


def test_views_hold_only_their_adapter(lora, tiny):
    peft_model, views = lora
    policy = views["policy"]
    keys = list(policy.state_dict())
    assert keys and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys)
    assert not any("policy" in k for k in keys)  # adapter-name-free: loads into any other view
    assert keys == list(views["explorer"].state_dict())
    # every linear layer of the decoder, not the LM head: 3 layers x 7 linears x (A, B)
    assert len(keys) == 3 * 7 * 2 and not any("lm_head" in k for k in keys)
    adapter_ids = {id(p) for n, p in peft_model.named_parameters() if ".policy." in n}
    assert {id(p) for p in policy.parameters()} == adapter_ids
    assert all(p.requires_grad for p in policy.parameters())
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if "lora_" not in n)  # the frozen base
    assert list(views["ref"].parameters()) == [] and views["ref"].state_dict() == {}
    # benchmarks/memory_table.py counts what an adapter trains
    spec = importlib.util.spec_from_file_location("memory_table", ROOT / "benchmarks" / "memory_table.py")
    memory_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_table)
    assert sum(p.numel() for p in policy.parameters()) == memory_table.lora_param_count(tiny[0], rank=4)


def test_reference_is_the_base_model_exactly(lora, batch, tiny):
    _, views = lora
    expected = logprobs(tiny[0], batch)  # the un-wrapped model, loaded separately
    for name in ADAPTERS:
        perturb(views[name], seed=len(name))
    logprobs(views["policy"], batch)  # the policy adapter is active when the reference runs next
    assert torch.equal(logprobs(views["ref"], batch), expected)
    assert not torch.allclose(logprobs(views["policy"], batch), expected, atol=1e-3)
    assert torch.equal(logprobs(views["ref"], batch), expected)


def test_an_update_of_one_adapter_changes_only_its_view(lora, batch):
    _, views = lora
    for name in ADAPTERS:  # distinct adapters, so that running the wrong one would show
        perturb(views[name], seed=len(name))
    before = {name: logprobs(view, batch) for name, view in views.items()}
    optimizer = torch.optim.AdamW(views["explorer"].parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        policy_loss(views["explorer"], batch).backward()
        logprobs(views["policy"], batch)  # another adapter and the reference run between the steps
        logprobs(views["ref"], batch)
        optimizer.step()
    after = {name: logprobs(view, batch) for name, view in views.items()}
    assert (after["explorer"] - before["explorer"]).abs().max() > 1e-2
    for name in ("policy", "critic", "ref"):
        assert torch.equal(after[name], before[name]), name


def test_interleaved_forwards_give_each_adapter_its_own_gradient(lora, batch):
    """The PPO update runs the policy and then the critic before one backward pass: each adapter gets the gradient
    it gets alone, and switching adapters leaves every requires_grad flag as it was."""
    _, views = lora
    perturb(views["policy"], seed=1)
    critic = models.Critic(views["critic"])
    with torch.no_grad():
        critic.head.weight.normal_()
    ids, mask = batch

    def grads(view):
        return [p.grad.clone() for p in view.parameters()]

    policy_loss(views["policy"], batch).backward()
    alone = grads(views["policy"])
    views["policy"].zero_grad()
    critic(ids, mask).square().mean().backward()
    critic_alone = grads(views["critic"])
    views["critic"].zero_grad()

    loss = policy_loss(views["policy"], batch)
    with torch.no_grad():
        logprobs(views["ref"], batch)
    loss = loss + critic(ids, mask).square().mean()
    logprobs(views["explorer"], batch)
    loss.backward()
    for a, b in zip(grads(views["policy"]), alone):
        torch.testing.assert_close(a, b)
    for a, b in zip(grads(views["critic"]), critic_alone):
        torch.testing.assert_close(a, b)
    assert all(p.grad is None for p in views["explorer"].parameters())
    assert all(p.requires_grad for name in ADAPTERS for p in views[name].parameters())


def test_explorer_sync_copies_the_policy_adapter(lora, batch):
    _, views = lora
    perturb(views["policy"], seed=1)
    perturb(views["explorer"], seed=2)
    assert not torch.allclose(logprobs(views["explorer"], batch), logprobs(views["policy"], batch), atol=1e-3)
    views["explorer"].load_state_dict(views["policy"].state_dict())
    assert torch.equal(logprobs(views["explorer"], batch), logprobs(views["policy"], batch))
    assert all(p.requires_grad for p in views["explorer"].parameters())
    # a copy, not shared tensors: the explorer's next update leaves the policy alone
    perturb(views["explorer"], seed=3)
    assert not torch.allclose(logprobs(views["explorer"], batch), logprobs(views["policy"], batch), atol=1e-3)


def test_adapters_start_as_copies_of_the_first(tiny):
    peft_model = models.add_lora(fresh_model(tiny), ADAPTERS, rank=4)
    states = [models.AdapterView(peft_model, name).state_dict() for name in ADAPTERS]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        assert all(torch.equal(state[k], states[0][k]) for k in state)
    # A is random (kaiming), B is zero: the adapters start as the base model
    assert any(v.abs().sum() > 0 for k, v in states[0].items() if "lora_A" in k)
    assert all(v.abs().sum() == 0 for k, v in states[0].items() if "lora_B" in k)


def test_state_dict_round_trip_into_a_fresh_model(lora, batch, tiny, tmp_path):
    """A checkpoint (the views' and the critic's state dicts, and an optimizer's) restores into a new run's views."""
    _, views = lora
    critic = models.Critic(views["critic"])
    optimizer = torch.optim.AdamW(views["policy"].parameters(), lr=1e-2)
    policy_loss(views["policy"], batch).backward()
    optimizer.step()
    perturb(views["explorer"], seed=2)
    with torch.no_grad():
        critic.head.bias.fill_(0.5)
        perturb(views["critic"], seed=3)
    path = tmp_path / "ckpt.pt"
    torch.save({"policy": views["policy"].state_dict(), "explorer": views["explorer"].state_dict(),
                "critic": critic.state_dict(), "ref": views["ref"].state_dict(),
                "optimizer": optimizer.state_dict()}, path)  # fmt: skip
    state = torch.load(path)

    fresh = models.add_lora(fresh_model(tiny), ADAPTERS, rank=4)
    new = {name: models.AdapterView(fresh, name) for name in ADAPTERS}
    new_critic = models.Critic(new["critic"])
    new_optimizer = torch.optim.AdamW(new["policy"].parameters(), lr=1e-2)
    for name in ("policy", "explorer"):
        new[name].load_state_dict(state[name])
    new_critic.load_state_dict(state["critic"])
    models.AdapterView(fresh, None).load_state_dict(state["ref"])
    new_optimizer.load_state_dict(state["optimizer"])
    for name in ("policy", "explorer"):
        assert torch.equal(logprobs(new[name], batch), logprobs(views[name], batch)), name
    assert torch.equal(new_critic(*batch), critic(*batch))
    # the restored optimizer takes the same next step
    for view, opt in ((views["policy"], optimizer), (new["policy"], new_optimizer)):
        opt.zero_grad()
        policy_loss(view, batch).backward()
        opt.step()
    assert torch.equal(logprobs(new["policy"], batch), logprobs(views["policy"], batch))


def test_generation_and_trunk_run_the_views_adapter(lora, batch, tokenizer):
    """HFGenerator (the model's generate) and the trunk pass (`base_model`, as token_logprobs uses it with a
    response mask, and the critic) run the view's adapter, whichever adapter ran before."""
    _, views = lora
    perturb(views["policy"], scale=0.2, seed=1)
    generator = HFGenerator(tokenizer, max_new_tokens=6)
    prompt = tokenizer(TEXTS[0]).input_ids[:20]
    gens = {}
    for name in ("policy", "explorer", "policy"):
        logprobs(views["critic"], batch)  # leaves another adapter active
        (gen,) = generator.generate(views[name], [prompt], greedy=True)
        ids = torch.tensor([prompt + gen.token_ids])
        expected = logprobs(views[name], (ids, torch.ones_like(ids)))[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, rtol=0, atol=1e-5)
        gens[name] = gen.logprobs
    assert gens["policy"] != gens["explorer"]
    for name in ("policy", "ref"):
        logprobs(views["explorer"], batch)
        hidden = views[name].base_model(input_ids=batch[0], attention_mask=batch[1]).last_hidden_state
        with torch.no_grad():
            logits = views[name].get_output_embeddings()(hidden)
            expected = views[name](input_ids=batch[0], attention_mask=batch[1]).logits
        torch.testing.assert_close(logits, expected)


def test_save_pretrained_writes_a_peft_adapter(lora, batch, tiny, tmp_path):
    _, views = lora
    perturb(views["policy"], seed=1)
    views["policy"].save_pretrained(tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = PeftModel.from_pretrained(fresh_model(tiny), tmp_path / "model")
    assert torch.equal(logprobs(loaded, batch), logprobs(views["policy"], batch))
    with pytest.raises(ValueError):
        views["ref"].save_pretrained(tmp_path / "ref")


def test_alpha_and_base_dtype(tiny):
    peft_model = models.add_lora(fresh_model(tiny), ["policy"], rank=4, alpha=3.0, base_dtype=torch.bfloat16)
    config = peft_model.peft_config["policy"]
    assert (config.r, config.lora_alpha) == (4, 3.0)
    assert all(p.dtype == torch.float32 for p in models.AdapterView(peft_model, "policy").parameters())
    assert all(p.dtype == torch.bfloat16 for n, p in peft_model.named_parameters() if "lora_" not in n)
    assert (
        models.add_lora(fresh_model(tiny), ["policy"], rank=8).peft_config["policy"].lora_alpha == 16
    )  # default 2 * rank
    with pytest.raises(KeyError):
        models.AdapterView(peft_model, "explorer")


def test_check_lora(monkeypatch):
    with pytest.raises(BadInput, match="--lora-rank -1: must be >= 0"):
        models.check_lora(-1)
    models.check_lora(0)
    models.check_lora(4)
    with pytest.raises(BadInput, match="critics are adapters"):
        models.check_lora(4, "tiny")
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun
    with pytest.raises(BadInput, match="one process"):
        models.check_lora(4)
    models.check_lora(0)


# ---------------------------------------------------------------------------------------------------------------
# each script with --lora-rank 4, end to end: 2 iterations straight, and 1 iteration resumed up to 2, then an
# evaluation of the saved checkpoint (the runs fork from one interpreter: tests/test_resume.py's runner)

LORA_SMALL = [
    "--lora-rank", "4", "--reward-mode", "swap", "--tasks-per-iteration", "1", "--group-size", "2",
    "--explorer-rollouts-per-task", "2", "--explorer-sync-every", "2", "--train-pool-size", "1", "--max-steps", "3",
    "--max-new-tokens", "8", "--update-epochs", "1", "--explorer-update-epochs", "1", "--num-eval-tasks", "1",
    "--eval-every", "1", "--no-eval-at-start", "--no-cuda",
]  # fmt: skip
LORA_CASES = {
    "grpo": ("rspo_grpo_webshop.py", [], {"policy", "explorer"}),
    "ppo": ("rspo_ppo_alfworld.py", [], {"policy", "explorer", "critic", "explorer_critic"}),
    "gigpo": ("rspo_gigpo.py", ["--env", "webshop"], {"policy", "explorer"}),
}


@pytest.mark.parametrize("script", list(LORA_CASES))
def test_lora_run_resumes_as_the_straight_run(repo_root, script_env, tmp_path, script):
    from test_resume import _checkpoint, _differences, _only_run, _run_steps, _without_timings

    path, flags, trained = LORA_CASES[script]
    argv = [*LORA_SMALL, *flags]
    resumed = tmp_path / "resumed" / "run"
    steps = [
        ["run", [*argv, "--num-iterations", "2", "--runs-dir", str(tmp_path / "straight")], str(tmp_path / "a.log")],
        ["run", [*argv, "--num-iterations", "1", "--runs-dir", str(tmp_path / "first")], str(tmp_path / "b.log")],
        ["move", str(tmp_path / "first"), str(resumed)],
        ["run", [*argv, "--num-iterations", "2", "--resume", str(resumed), "--runs-dir", str(resumed.parent)],
         str(tmp_path / "c.log")],
        ["run", [*argv, "--eval-only", "--resume", str(resumed), "--runs-dir", str(tmp_path / "eval")],
         str(tmp_path / "d.log")],
    ]  # fmt: skip
    _run_steps(repo_root, script_env, path, steps)
    straight = _only_run(tmp_path / "straight")

    rows, resumed_rows = read_metrics(straight), read_metrics(resumed)
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in resumed_rows] == [1, 2]
    assert [_without_timings(r) for r in resumed_rows] == [_without_timings(r) for r in rows]
    assert rows[-1]["explorer/env_steps"] > 0 and "eval/success_rate" in read_metrics(_only_run(tmp_path / "eval"))[0]
    final, resumed_final = _checkpoint(straight), _checkpoint(resumed)
    for part in ("modules", "optimizers", "extra", "rng"):
        assert not _differences(final[part], resumed_final[part], part)

    # The checkpoint holds adapters (and PPO's value heads) only, each trained by its own optimiser; the reference
    # is the base: nothing to store. The final save is the policy's peft adapter.
    modules = final["modules"]
    assert set(modules) == trained | {"ref"} and modules["ref"] == {} and set(final["optimizers"]) == trained
    for name in trained:
        assert all("lora_A" in k or "lora_B" in k or k.startswith("head.") for k in modules[name]), name
        (group,) = final["optimizers"][name]["param_groups"]
        assert len(group["params"]) == len(modules[name])
    # agent B trained (on its dense process reward) away from its start, B = 0, and from the policy (no sync yet)
    assert any(v.abs().sum() > 0 for k, v in modules["explorer"].items() if "lora_B" in k)
    assert _differences(modules["explorer"], modules["policy"], "explorer")
    assert sorted(p.name for p in (straight / "model").iterdir() if p.name.startswith("adapter")) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]  # fmt: skip
    base, _ = models.load_model("tiny", env_name="alfworld" if script == "ppo" else "webshop")
    saved = PeftModel.from_pretrained(copy.deepcopy(base), straight / "model")
    policy = models.AdapterView(models.add_lora(base, ["policy"], rank=4), "policy")
    policy.load_state_dict(modules["policy"])
    batch = (torch.tensor([[5, 6, 7, 8, 9]]), torch.ones(1, 5, dtype=torch.long))
    assert torch.equal(logprobs(saved, batch), logprobs(policy, batch))
