"""benchmarks/update_levers.py: it times the scripts' own log-prob computation, and its causal-only lever gives the
same log-probs on right-padded rows (the premise of timing it)."""

import pathlib
import random
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import update_levers  # noqa: E402

from rspo_ppo_alfworld import token_logprobs  # noqa: E402


def test_step_is_token_logprobs_and_causal_only_changes_no_logprob(small_lm):
    model = small_lm(seed=3, vocab_size=50).eval()
    ids, mask, response = update_levers.micro_batch(random.Random(1), 600, 50)
    assert ids.shape[0] >= 2 and len(set(mask.sum(1).tolist())) > 1  # rows of different lengths: real padding
    assert torch.equal(mask, torch.sort(mask, dim=1, descending=True, stable=True).values)  # right padding
    expected = token_logprobs(model, ids, mask, response_mask=response)[0][response]
    masked = update_levers.step(model, ids, mask, response, causal_only=False, backward=False)
    causal = update_levers.step(model, ids, mask, response, causal_only=True, backward=False)
    torch.testing.assert_close(masked, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(causal, expected, rtol=0, atol=1e-5)
    # the same rows left-padded: with the mask the same log-probs, without it others (the lever needs right padding)
    shifts = (mask.shape[1] - mask.sum(1)).tolist()
    left = [torch.stack([x[k].roll(n) for k, n in enumerate(shifts)]) for x in (ids, mask, response)]
    assert torch.equal(left[1], mask.flip(1))
    with_mask = update_levers.step(model, *left, causal_only=False, backward=False)
    without = update_levers.step(model, *left, causal_only=True, backward=False)
    torch.testing.assert_close(with_mask, expected, rtol=0, atol=1e-5)
    assert (without - expected).abs().max() > 1e-3


def test_main_prints_both_ratios():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "update_levers.py"), "--repeats", "1", "--micro-batch-tokens", "600"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=True,
    ).stdout  # fmt: skip
    for line in ("causal only / attention mask: ", "no-grad forward / forward+backward: "):
        assert float(out.split(line)[1].split()[0]) > 0
    # the committed model's log-probs, causal only against with the mask (the premise, at the benchmark's own size)
    assert float(out.split("differ by at most ")[1].split(")")[0]) < 1e-5
