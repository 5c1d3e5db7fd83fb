"""Run by tests/test_distributed.py. Under `torchrun --nproc_per_node 2` (gloo, CPU) each rank checks the helpers of
common/distributed.py against the single-process answer and writes what it found to OUT/rank{r}.json; it then feeds
each script's update the batch that one process wrote (see below) and records the advantages, losses and weights
of its 2-rank update in OUT/{script}_rank{r}.pt.

Without torchrun (one process) it plays a small batch with each script's rollout (the real tiny model and env) and
runs the script's update on all of it: OUT/{script}_single.pt holds the trajectories, the advantages, the losses
and the weights after the update.

usage: python tests/fsdp_worker.py OUT                                        (one process, first)
       python -m torch.distributed.run --nproc_per_node 2 tests/fsdp_worker.py OUT
"""

import argparse
import contextlib
import copy
import importlib
import json
import os
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from common import distributed, envs, generation, models, run  # noqa: E402
from common import envs as cenvs  # noqa: E402


def response_token_losses(model, rows: list[tuple[list[int], int]]) -> tuple[torch.Tensor, int]:
    """Sum over the response tokens of -log p(token) (right padding, the LM head on response positions only, as
    the scripts' token_logprobs) and the number of those tokens. rows: (token ids, prompt length)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for k, (ids, prompt_len) in enumerate(rows):
        input_ids[k, : len(ids)] = torch.tensor(ids)
        attention_mask[k, : len(ids)] = 1
        response[k, prompt_len - 1 : len(ids) - 1] = True
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    logits = model.get_output_embeddings()(hidden[response]).float()
    targets = input_ids[:, 1:][response]
    logprobs = torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)
    return -logprobs.sum(), int(response.sum())


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------------------------------------------------------
# Each script's update on one batch: 3 tasks x 2 rollouts trained on the process reward (the tiny model's outcome
# is mostly 0, which would give all-zero advantages), 2 epochs of one minibatch, micro-batches of ~600 tokens (so
# that ranks run different numbers of them and pad). On 2 ranks each plays its tasks' trajectories.
SCRIPTS = {"grpo": "rspo_grpo_webshop.py", "gigpo": "rspo_gigpo.py", "ppo": "rspo_ppo_alfworld.py"}
ENV = {"grpo": "webshop", "gigpo": "webshop", "ppo": "alfworld"}
# the tasks of each env's batch (on WebShop's tasks 0-2 the model's two rollouts are alike: all-zero advantages)
TASKS = {"webshop": [3, 4, 5], "alfworld": [0, 1, 2]}


def load_script(name: str):
    return importlib.import_module(SCRIPTS[name].removesuffix(".py"))  # the repository root is on sys.path


def script_args(name: str, module):
    extra = {"env": "webshop", "norm_adv_by_std": True, "eval_split": "test"} if name == "gigpo" else {}
    return module.Args(
        reward_mode="process", max_steps=6, max_new_tokens=32, minibatch_tokens=10**6, micro_batch_tokens=600, update_epochs=2,
        learning_rate=1e-3, **extra,
    )  # fmt: skip


def play(name: str, module, args, policy, tokenizer) -> list:
    """The batch: 3 tasks x 2 rollouts of the policy (unsharded, one process)."""
    tasks = TASKS[ENV[name]]
    generator = generation.HFGenerator(tokenizer, max_new_tokens=args.max_new_tokens)
    envs = cenvs.LockstepEnvs(ENV[name], 2 * len(tasks), preset="small", max_steps=args.max_steps)
    kw = dict(sampler="policy", iteration=1, temperature=1.0, autocast=contextlib.nullcontext)
    if name == "grpo":
        return module.rollout(policy, generator, envs, tasks, 2, args, **kw)[0]
    if name == "gigpo":
        return module.rollout(policy, generator, tokenizer, envs, tasks, 2, args, **kw)[0]
    return module.rollout(policy, generator, tokenizer, envs, tasks, 2, args, metrics={}, **kw)


def train(name: str, module, args, trajectories, policy, tokenizer) -> dict:
    """The script's own steps from a batch to the updated policy: rows, old and reference log-probs, advantages,
    the update. Returns the turn advantages (per trajectory), the update's statistics and the full weights."""
    ref_model = copy.deepcopy(policy).eval().requires_grad_(False)
    critic = models.build_critic(policy) if name == "ppo" else None
    distributed.shard(policy, ref_model, critic)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate)
    kw = dict(pad_id=tokenizer.pad_token_id, autocast=contextlib.nullcontext)
    if name == "ppo":
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_learning_rate)
        adv, ret, old_v = module.ppo_advantages(trajectories, critic, "process", args, **kw)
        rows = module.make_rows(trajectories, adv, ret, old_v)
        module.prepare_rows(policy, ref_model, rows, args, **kw)
        stats = module.update(policy, optimizer, critic, critic_optimizer, rows, args, epochs=args.update_epochs, **kw)
        turn_adv = [[a.tolist() for a in traj] for traj in adv]
    else:
        rows = module.make_rows(trajectories)
        module.prepare_rows(policy, ref_model, rows, args, **kw)
        if name == "grpo":
            _, flat = module.grpo_turn_advantages(trajectories, "process", args.norm_adv_by_std, args.invalid_penalty)
            module.set_advantages(rows, flat)
            stats = module.update(policy, optimizer, rows, args, args.update_epochs, **kw)
        else:
            _, flat, _ = module.gigpo_turn_advantages(
                trajectories, "process", outcome_scale=args.outcome_scale, gamma=args.gamma,
                step_weight=args.step_adv_weight, norm_by_std=args.norm_adv_by_std,
                similarity_thresh=args.similarity_thresh, invalid_penalty=args.invalid_penalty,
            )  # fmt: skip
            module.set_advantages(rows, flat)
            stats = module.update(policy, optimizer, rows, args, epochs=args.update_epochs, **kw)
        chunks = iter(flat.tolist())
        turn_adv = [[next(chunks) for _ in t.turns] for t in trajectories]
    weights = {k: full(p.detach()).clone() for k, p in policy.named_parameters()}
    if critic is not None:
        weights.update({f"critic.{k}": full(p.detach()).clone() for k, p in critic.named_parameters()})
    return {"turn_advantages": turn_adv, "stats": stats, "weights": weights}


def scripts_single(out_dir: pathlib.Path) -> None:
    for name in SCRIPTS:
        module = load_script(name)
        args = script_args(name, module)
        policy, tokenizer = models.load_model("tiny", env_name=ENV[name])
        torch.manual_seed(0)
        trajectories = play(name, module, args, policy, tokenizer)
        initial = {k: p.detach().clone() for k, p in policy.named_parameters()}
        result = train(name, module, args, trajectories, policy, tokenizer)
        torch.save({"trajectories": trajectories, "initial": initial, **result}, out_dir / f"{name}_single.pt")


def scripts_distributed(out_dir: pathlib.Path) -> None:
    for name in SCRIPTS:
        module = load_script(name)
        args = script_args(name, module)
        single = torch.load(out_dir / f"{name}_single.pt", weights_only=False)
        mine = distributed.split(TASKS[ENV[name]])
        index = [i for i, t in enumerate(single["trajectories"]) if t.task_seed in mine]
        policy, tokenizer = models.load_model("tiny", env_name=ENV[name])
        result = train(name, module, args, [single["trajectories"][i] for i in index], policy, tokenizer)
        torch.save({"index": index, **result}, out_dir / f"{name}_rank{distributed.rank()}.pt")


def main(out_dir: pathlib.Path) -> None:
    distributed.init(torch.device("cpu"))
    rank, world = distributed.rank(), distributed.world_size()
    report: dict = {"rank": rank, "world": world}

    # The task split: rank 0's list counts (rank 1 passes another), groups whole, every task once, in order.
    tasks = [11, 12, 13, 14, 15, 16, 17] if rank == 0 else [99]
    mine = distributed.split(tasks)
    seeds = envs.group_seeds(mine, 3)
    report["local_tasks"] = mine
    report["gathered_seeds"] = distributed.gather([(rank, s) for s in seeds])

    # Reductions: counts summed (ints stay ints), the padding of a step list, the token divisor.
    report["sum_dict"] = distributed.sum_all({"count": rank + 1, "loss_sum": 0.25 * (rank + 1)})
    report["sum_number"] = distributed.sum_all(rank + 1)
    report["steps"] = distributed.steps(list(range(rank + 1)))
    report["token_divisor"] = distributed.token_divisor([5, 9][rank])
    report["across_ranks"] = distributed.across_ranks(
        lambda x: x - x.mean(), torch.tensor([1.0, 2.0][: rank + 1])
    ).tolist()
    checks = []
    for tasks, backend in ((1, "hf"), (2, "vllm"), (2, "hf")):
        try:
            distributed.check(tasks, backend)
            checks.append("ok")
        except run.BadInput as e:
            checks.append(str(e))
    report["check"] = checks

    # A token-mean loss over the global minibatch: 4 rows of different lengths, 3 on rank 0 (in 2 micro-batches)
    # and 1 on rank 1 (1 micro-batch, then a padding step); one clipped AdamW step. The reference: the same
    # model, unsharded, in this process, one micro-batch of all 4 rows.
    policy, tokenizer = models.load_model("tiny", env_name="webshop")
    reference = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(2, 1000, (n,), generator=g).tolist(), p) for n, p in ((12, 7), (9, 3), (15, 10), (7, 2))]
    local_rows = rows[:3] if rank == 0 else rows[3:]
    micro_batches = [local_rows[:2], local_rows[2:]] if rank == 0 else [local_rows]
    distributed.shard(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    n_local = sum(len(ids) - p for ids, p in local_rows)
    divisor = distributed.token_divisor(n_local)
    optimizer.zero_grad(set_to_none=True)
    for chunk in distributed.steps(micro_batches):
        if chunk is None:
            distributed.zero_backward(policy)
            continue
        loss_sum, _ = response_token_losses(policy, chunk)
        (loss_sum / divisor).backward()
    grads = {k: full(p.grad).clone() for k, p in policy.named_parameters()}  # before clipping: its scale counts
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()

    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    loss_sum, n_all = response_token_losses(reference, rows)
    (loss_sum / n_all).backward()
    ref_grads = {k: p.grad.clone() for k, p in reference.named_parameters()}
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    ref_optimizer.step()
    report["grad_norm"] = [float(full(norm)), float(ref_norm)]
    report["max_grad_diff"] = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    report["max_grad"] = max(v.abs().max().item() for v in ref_grads.values())
    weights = {k: full(p.detach()) for k, p in policy.named_parameters()}
    ref_weights = dict(reference.named_parameters())
    report["max_weight_diff"] = max((weights[k] - ref_weights[k].detach()).abs().max().item() for k in ref_weights)
    report["max_weight_change"] = max(
        (ref_weights[k].detach() - p.detach()).abs().max().item()
        for k, p in models.load_model("tiny", env_name="webshop")[0].named_parameters()
    )

    # Generation inside gathered(): rank 1 generates for more prompts and more calls than rank 0 (no hang), and
    # greedy decoding gives what the unsharded reference model gives.
    generator = generation.HFGenerator(tokenizer, max_new_tokens=6)
    prompts = [[5, 6, 7, 8], [9, 10, 11]] * (rank + 1)
    with distributed.gathered(policy):
        gens = [generator.generate(policy, prompts, greedy=True) for _ in range(rank + 1)][-1]
    ref_gens = generator.generate(reference, prompts, greedy=True)
    report["generation_equal"] = [x.token_ids for x in gens] == [x.token_ids for x in ref_gens]
    report["resharded"] = all(type(p).__name__ == "DTensor" for p in policy.parameters())

    # DCP: save, take another step, load: the saved weights and optimiser state come back.
    folder = out_dir / "checkpoint"
    distributed.save_checkpoint(folder, {"policy": policy}, {"policy": optimizer}, {"note": f"rank {rank}"})
    saved = {k: full(p.detach()).clone() for k, p in policy.named_parameters()}
    saved_step = {k: full(v["exp_avg"]).clone() for k, v in zip(saved, optimizer.state.values())}
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    moved = max((full(p.detach()) - saved[k]).abs().max().item() for k, p in policy.named_parameters())
    state = distributed.load_checkpoint(folder, {"policy": policy}, {"policy": optimizer})
    back = max((full(p.detach()) - saved[k]).abs().max().item() for k, p in policy.named_parameters())
    back_opt = max(
        (full(v["exp_avg"]) - saved_step[k]).abs().max().item() for k, v in zip(saved, optimizer.state.values())
    )
    report["dcp"] = {"moved": moved, "back": back, "back_optimizer": back_opt, "state": state}
    report["checkpoint_files"] = sorted(p.name for p in folder.iterdir()) if rank == 0 else []

    # common.run.Run under torchrun: one run folder (rank 0's) written by rank 0 alone; checkpoints through DCP;
    # a resume restores the weights, each rank's extra and RNG states, and drops metrics rows after the checkpoint.
    args = argparse.Namespace(seed=1, track=False, num_iterations=3)
    logger = run.Run(args, f"run{rank}", runs_dir=str(out_dir / "runs"))
    logger.log({"value": float(rank)}, step=1)
    random.seed(100 + rank)
    logger.save_checkpoint(1, {"policy": policy}, {"policy": optimizer}, extra={"buffer": [rank]})
    expected_draw = random.random()  # the first draw after the checkpoint, different on each rank
    logger.log({"value": 2.0}, step=2)
    saved = {k: full(p.detach()).clone() for k, p in policy.named_parameters()}
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    logger.close()
    resumed = run.Run(args, "ignored", runs_dir=str(out_dir / "runs"), resume=str(logger.dir))
    random.seed(0)
    state = resumed.load_checkpoint({"policy": policy}, {"policy": optimizer})
    report["run"] = {
        "dir": str(logger.dir),
        "resumed_dir": str(resumed.dir),
        "files": sorted(p.name for p in logger.dir.iterdir()),
        "metrics": run.read_metrics(logger.dir),
        "state": state,
        "weights_back": max((full(p.detach()) - saved[k]).abs().max().item() for k, p in policy.named_parameters()),
        "draw": [random.random(), expected_draw],
    }
    resumed.close()

    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    scripts_distributed(out_dir)
    distributed.close()


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:
        main(pathlib.Path(sys.argv[1]))
    else:
        scripts_single(pathlib.Path(sys.argv[1]))
