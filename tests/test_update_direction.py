"""The direction of learning in each script's update: a response with a positive advantage becomes likelier and
one with a negative advantage less likely, for the policy's own rows and for swapped explorer rows under
importance weights. Each test fails when the surrogate's sign is flipped. Each runs in fp32 (the CPU path) and
under bf16 autocast (the scripts' CUDA path, here on the CPU: the same code, the matmuls in bf16)."""

import contextlib
import copy

import pytest
import torch

import rspo_gigpo
import rspo_grpo_webshop
import rspo_ppo_alfworld
from common import models

PROMPT, GOOD, BAD = [5, 6, 7], [11, 12], [13, 14]
KW = dict(temperature=1.0, pad_id=0, device=torch.device("cpu"))
AUTOCAST = {"fp32": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
LOSS_KW = dict(clip_coef=0.2, dual_clip=3.0, kl_coef=0.01, ent_coef=0.001, max_grad_norm=1.0, use_is_weights=True)


def _group_script(module, autocast):
    """make_row, prepare_rows and update of the GRPO and GiGPO scripts (one advantage per row; LOSS_KW and KW given
    as the script's Args)."""
    args = module.Args(
        temperature=1.0, is_cap=2.0, minibatch_tokens=10_000, micro_batch_tokens=10_000, clip_coef=0.2, dual_clip=3.0,
        kl_coef=0.01, ent_coef=0.001, max_grad_norm=1.0, off_policy_correction="tis",
    )  # fmt: skip

    def make_row(response, behaviour, advantage, swapped):
        return module.Row(PROMPT + response, len(PROMPT), behaviour, advantage, swapped, iteration=1)

    def prepare(model, ref, rows):
        module.prepare_rows(model, ref, rows, args, pad_id=KW["pad_id"], autocast=autocast)

    def update(model, optimizer, rows):
        module.update(model, optimizer, rows, args, epochs=1, pad_id=KW["pad_id"], autocast=autocast)

    return make_row, prepare, update


def _ppo_script(model, autocast):
    """make_row, prepare and update of the PPO script (per-token advantages, a critic trained beside the policy)."""
    p = rspo_ppo_alfworld
    critic = models.build_critic(model)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    args = p.Args(temperature=1.0, is_cap=2.0, minibatch_tokens=10_000, micro_batch_tokens=10_000, vf_clip=2.0,
                  clip_coef=0.2, dual_clip=3.0, kl_coef=0.01, ent_coef=0.001, max_grad_norm=1.0,
                  off_policy_correction="tis")  # fmt: skip

    def make_row(response, behaviour, advantage, swapped):
        return p.Row(PROMPT + response, len(PROMPT), behaviour, advantages=torch.full((len(response),), advantage),
                     returns=torch.zeros(1), old_values=torch.zeros(1), swapped=swapped, iteration=1)  # fmt: skip

    def prepare(model, ref, rows):
        p.prepare_rows(model, ref, rows, args, pad_id=0, autocast=autocast)

    def update(model, optimizer, rows):
        p.update(model, optimizer, critic, critic_optimizer, rows, args, epochs=1, pad_id=0, autocast=autocast)

    return make_row, prepare, update


@pytest.mark.parametrize("precision", list(AUTOCAST))
@pytest.mark.parametrize("swapped", [False, True], ids=["own", "swapped"])
@pytest.mark.parametrize("script", ["grpo", "gigpo", "ppo"])
def test_repeated_updates_make_positive_advantage_responses_likelier(small_lm, script, swapped, precision):
    """One prompt, two responses with advantages +1 and -1. Twenty rollout-and-update rounds (old log-probs
    recomputed each round, as in the scripts) raise the first's log-probability by more than a nat and lower the
    second's as much. Behaviour log-probs are the current model's, so swapped rows get importance weights 1."""
    module = {"grpo": rspo_grpo_webshop, "gigpo": rspo_gigpo, "ppo": rspo_ppo_alfworld}[script]
    model = small_lm(pad_token_id=0, eos_token_id=1)
    ref = copy.deepcopy(model)
    autocast = AUTOCAST[precision]
    make_row, prepare, update = _ppo_script(model, autocast) if script == "ppo" else _group_script(module, autocast)

    def response_logprobs(response) -> list[float]:
        ids = torch.tensor([PROMPT + response])
        with torch.no_grad():
            lp, _ = module.token_logprobs(model, ids, torch.ones_like(ids))
        return lp[0, len(PROMPT) - 1 :].tolist()

    before = sum(response_logprobs(GOOD)), sum(response_logprobs(BAD))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(20):
        rows = [make_row(r, response_logprobs(r), a, swapped) for r, a in ((GOOD, 1.0), (BAD, -1.0))]
        prepare(model, ref, rows)
        update(model, optimizer, rows)
    after = sum(response_logprobs(GOOD)), sum(response_logprobs(BAD))
    assert after[0] > before[0] + 1.0, (before, after)
    assert after[1] < before[1] - 1.0, (before, after)
