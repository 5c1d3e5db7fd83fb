"""What two implementation levers would take off a training step, on the committed ALFWorld tiny model.

The table's time is nine tenths training (docs/results.md, probe 32). Two ways to make a step cheaper without
changing the algorithm, each timed here on right-padded micro-batches like the scripts' own (ALFWorld-sized rows,
--micro-batch-tokens 4096, one thread):

- causal only: right-padded rows need no attention mask (a real token never attends to the padding after it), so
  the model can take attention_mask=None; time of a forward + backward without the mask / with it;
- no old-log-prob pass: prepare_rows runs one no-grad forward per token to take pi_old before the update; the
  update's own forward could serve for its first minibatch of its first epoch, not for later ones (the policy has
  stepped by then). Time of that no-grad forward / a forward + backward (a PPO minibatch runs the policy's and the
  critic's forward + backward, a reference forward and the critic's old values besides, so skipping the pass saves
  at most this ratio over about three, on the first minibatch's tokens only).

    OMP_NUM_THREADS=1 python benchmarks/update_levers.py

Rows are random tokens (the time does not depend on which); their lengths are ALFWorld's: a short prompt of 110-170
tokens (the tiny model's prompts average 132 at the default history) and a response of 8-24.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from common import models  # noqa: E402


def micro_batch(rng: random.Random, budget: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows filling `budget` tokens, sorted by length as length_sorted_chunks sorts them: input ids,
    attention mask, and the mask of the positions that predict a response token (where the LM head runs)."""
    lengths, responses = [], []
    while sum(lengths) < budget - 200:
        responses.append(rng.randint(8, 24))
        lengths.append(rng.randint(110, 170) + responses[-1])
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    width = max(lengths)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.randint(2, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    response = torch.zeros((len(lengths), width - 1), dtype=torch.bool)
    for k, i in enumerate(order):
        mask[k, : lengths[i]] = 1
        response[k, lengths[i] - 1 - responses[i] : lengths[i] - 1] = True
    return ids, mask, response


def step(model, ids, mask, response, *, causal_only: bool, backward: bool) -> torch.Tensor:
    """The scripts' token_logprobs on the response positions (LM head there only), and its backward."""
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    attention = None if causal_only else mask
    with torch.set_grad_enabled(backward):
        hidden = model.base_model(input_ids=ids, attention_mask=attention, position_ids=position_ids).last_hidden_state
        logits = model.get_output_embeddings()(hidden[:, :-1][response]).float()
        logprobs = logits.gather(-1, ids[:, 1:][response].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        if backward:
            logprobs.sum().backward()
            model.zero_grad(set_to_none=True)
    return logprobs.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (each times every variant once)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, _ = models.load_model("tiny", env_name="alfworld")
    model.train()
    rng = random.Random(args.seed)
    batch = micro_batch(rng, args.micro_batch_tokens, model.config.vocab_size)
    print(f"micro-batch: {batch[0].shape[0]} rows, {int(batch[1].sum())} tokens ({batch[0].numel()} padded)")
    variants = {
        "forward+backward, attention mask": dict(causal_only=False, backward=True),
        "forward+backward, causal only": dict(causal_only=True, backward=True),
        "no-grad forward (old log-probs)": dict(causal_only=False, backward=False),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.repeats + 1):  # round 0 warms up and is not counted
        for name, kw in variants.items():  # interleaved, so that a slower stretch of the machine hits all alike
            start = time.perf_counter()
            step(model, *batch, **kw)
            if round_:
                seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    for name, s in median.items():
        print(f"{name:36s} median {s * 1000:7.1f} ms over {args.repeats}")
    masked, causal, forward = median.values()
    with_mask = step(model, *batch, causal_only=False, backward=False)
    difference = (step(model, *batch, causal_only=True, backward=False) - with_mask).abs()
    print(f"causal only / attention mask: {causal / masked:.2f} (log-probs differ by at most {difference.max():.1e})")
    print(f"no-grad forward / forward+backward: {forward / masked:.2f}")


if __name__ == "__main__":
    main()
