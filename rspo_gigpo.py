"""RSPO with GiGPO (group-in-group policy optimisation) on WebShop or ALFWorld. Docs: docs/rspo_gigpo.md

GiGPO adds step-level credit to GRPO: inside a task group, turns that start from the same environment state
(the anchor state) form a step group across trajectories and time steps, and their discounted step returns are
compared with each other. The advantage of a turn is A = A^E + w * A^S (episode advantage plus step advantage).
RSPO (reward swap) lets an explorer ("agent B", a copy of the policy re-synced every K iterations) play the same
tasks and learn the dense process reward with GiGPO on its own rollouts, swaps its trajectories' rewards back to
the outcome and adds them to their task's groups (episode groups and anchor-state groups) in the policy's
outcome-reward update. `--reward-mode outcome|process` runs the baselines.
"""

import dataclasses
import difflib
import functools
import os
import random
import sys
import time
from collections import deque
from collections.abc import Hashable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import tyro

from common import distributed, generation, models, prompts, run
from common import envs as cenvs


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (tasks, sampling)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True` and deterministic algorithms"""
    cuda: bool = True
    """if toggled, CUDA is used when available (bf16 autocast); otherwise the CPU in fp32"""
    track: bool = False
    """if toggled, the run is tracked with Weights and Biases"""
    wandb_project_name: str = "rspo"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    save_model: bool = True
    """whether to save the final policy (save_pretrained) into the run folder"""

    # Environment
    env: Literal["alfworld", "webshop"] = "alfworld"
    """the benchmark"""
    env_backend: Literal["embedded", "real"] = "embedded"
    """`embedded`: the pure-Python replica; `real`: the original environment (installed separately)"""
    env_preset: Literal["small", "default"] = "small"
    """embedded world size: `small` for the tiny model on a CPU, `default` close to the original's"""
    max_steps: int | None = None
    """steps per episode (None: ALFWorld's 50; 15 on WebShop and on ALFWorld's embedded small preset)"""
    process_reward: Literal["aligned", "misaligned"] = "misaligned"
    """the dense reward: `aligned` agrees with the outcome at its optimum; `misaligned` forgets part of the task"""
    history_len: int = 2
    """previous (observation, action) turns in each prompt (the tiny model's short form: actions only)"""
    max_prompt_tokens: int | None = None
    """prompt budget, oldest history dropped first (None: the tiny model's 512, else 4096; within the context)"""

    # Model and rollout
    model_name: str = "tiny"
    """`tiny` (local, warm-started on expert turns), `smollm2-135m`, or a Hugging Face id / local path (offline)"""
    tiny_seed: int = 1
    """which tiny model: the seed of its build (1: the committed one; others are built on first use)"""
    lora_rank: int = 0
    """LoRA rank r: the policy and agent B train rank-r adapters on one frozen base (0: full weights)"""
    lora_alpha: float | None = None
    """LoRA scale: delta W = (alpha / r) B A (None: alpha = 2 r)"""
    rollout_backend: Literal["hf", "vllm"] = "hf"
    """generation backend: Hugging Face generate (CPU/GPU) or vLLM (GPU)"""
    generation_batch_size: int | None = None
    """prompts per HF generate call (None: all active envs at once)"""
    temperature: float = 1.0
    """sampling temperature of training rollouts (old log-probs are recomputed at the same temperature)"""
    max_new_tokens: int = 32
    """response budget per turn in tokens"""

    # Algorithm specific arguments
    num_iterations: int = 30
    """training iterations (one rollout batch and one update each)"""
    total_env_steps: int = 0
    """stop after the iteration whose environment steps (explorer included) reach this budget (0: none)"""
    tasks_per_iteration: int = 4
    """B: tasks (GiGPO episode groups) per iteration"""
    group_size: int = 4
    """G_on: policy rollouts per task"""
    learning_rate: float | None = None
    """policy learning rate of the tiny model (None: 2e-4 on WebShop; 1e-4 on ALFWorld, where 2e-4 and more did not
    learn); paper-scale runs use 1e-6"""
    warmup_iterations: int = 0
    """linear learning-rate warm-up over this many iterations (then constant)"""
    update_epochs: int = 1
    """passes over the batch per policy update"""
    minibatch_tokens: int = 16384
    """token budget of one optimiser step (sum of prompt+response lengths of its turns)"""
    micro_batch_tokens: int = 4096
    """token budget of one forward/backward (padded rows x length); gradients accumulate over micro-batches"""
    gamma: float = 0.95
    """discount of the GiGPO step returns R_t = sum_k gamma^k r_{t+k}"""
    step_adv_weight: float = 1.0
    """w in A = A^E + w * A^S"""
    norm_adv_by_std: bool | None = None
    """divide A^E and A^S by their group's std (None: ALFWorld yes, WebShop no; --no-norm-adv-by-std also works)"""
    similarity_thresh: float | None = None
    """group similar anchor states (difflib ratio >= this to a group's first anchor) instead of identical ones"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient epsilon"""
    dual_clip: float = 3.0
    """dual-clip constant c: for negative advantages the loss is at most -c * A"""
    kl_coef: float = 0.01
    """coefficient of the k3 KL to the frozen initial policy"""
    ent_coef: float = 0.001
    """coefficient of the entropy bonus"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    outcome_scale: float = 10.0
    """outcome return R = outcome_scale * success (paid as the reward of the solving turn)"""
    invalid_penalty: float = 0.1
    """subtracted from the advantage of a turn whose response has no parsable <action>...</action>"""

    # RSPO (reward swap)
    reward_mode: Literal["swap", "outcome", "process"] = "swap"
    """`swap`: RSPO; `outcome`: GiGPO on the outcome reward; `process`: GiGPO on the process reward"""
    explorer_rollouts_per_task: int = 4
    """G_off: explorer rollouts per task (swap mode)"""
    explorer: Literal["agent_b", "one_step"] = "agent_b"
    """`agent_b`: persistent, learns on its own rollouts; `one_step` (comparison): re-copied, one step, then plays"""
    explorer_sync_every: int = 20
    """agent_b: copy the policy's weights into the explorer every this many iterations (0: never)"""
    explorer_learning_rate: float | None = 5e-4
    """explorer learning rate (None: --learning-rate); agent B moves faster than the policy on the dense reward"""
    explorer_update_epochs: int | None = 2
    """explorer update epochs (None: --update-epochs)"""
    off_policy_correction: Literal["tis", "none"] = "tis"
    """`tis`: weight explorer tokens by min(pi_old / pi_explorer, is_cap); `none`: weight 1"""
    is_cap: float = 2.0
    """cap C of the truncated importance weights"""
    buffer_capacity: int = 256
    """replay buffer capacity (explorer trajectories, FIFO)"""
    buffer_max_age: int = 10
    """iterations a buffered trajectory stays usable (0: only this iteration's)"""
    train_pool_size: int | None = None
    """training tasks are drawn from the first this-many train seeds (None: 32 on WebShop, so that goals recur;
    2,048 on ALFWorld, as in rspo_ppo_alfworld.py)"""

    # Evaluation and checkpoints
    eval_every: int = 5
    """evaluate every this many iterations (and after the last; 0: only after the last)"""
    eval_at_start: bool = True
    """also evaluate the initial policy (logged at iteration 0)"""
    num_eval_tasks: int = 50
    """held-out tasks (the first seeds of --eval-split)"""
    eval_split: str | None = None
    """held-out split (None: WebShop `test`, ALFWorld `valid_unseen`; `valid`: train seeds from 2,048 on, never seen)"""
    eval_temperature: float = 0.0
    """evaluation sampling temperature (0: greedy)"""
    eval_batch_size: int = 64
    """evaluation episodes played in lockstep at once"""
    checkpoint_every: int = 1
    """save runs/{run}/checkpoints/latest.pt every this many iterations (and at the end)"""
    runs_dir: str = "runs"
    """folder of the run folders"""
    resume: str | None = None
    """a run folder: continue from its latest checkpoint (same flags)"""
    eval_only: bool = False
    """evaluate the policy (the --resume checkpoint, else the initial model) and exit"""

    # to be filled in runtime
    num_policy_rollouts: int = 0
    """B * G_on"""
    num_explorer_rollouts: int = 0
    """B * G_off in swap mode, else 0"""


# ALGO LOGIC: advantages, losses, the swap and the replay buffer (pure functions, nothing reads args)


def _keys(ids) -> list:
    """Ids as a list of hashable values (an integer tensor becomes its Python ints)."""
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def _members(keys: list) -> dict:
    """key -> list of row indices, in order of first appearance."""
    groups: dict = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return groups


def compute_grpo_advantages(
    returns: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[Hashable],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantage of each row (a trajectory) from its group's return statistics.

    returns: [N] one return per row (a float tensor keeps its dtype, anything else becomes float32); group_ids:
    N hashable values or an [N] integer tensor; rows with equal ids form a group, each row counts once.
    A_i = (R_i - mean_{j in g(i)} R_j) / (std_{j in g(i)} R_j + eps), std unbiased (torch.std's default);
    norm_by_std=False drops the division. A singleton group has mean 0 and std 1 (A = R). Returns [N].
    """
    returns = torch.as_tensor(returns)
    returns = returns.float() if not torch.is_floating_point(returns) else returns
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if returns.dim() != 1 or len(ids) != returns.shape[0]:
        raise ValueError(f"returns must be 1-D with one group id each, got {tuple(returns.shape)} and {len(ids)} ids")
    index: dict[Hashable, int] = {}
    inverse = torch.tensor([index.setdefault(g, len(index)) for g in ids], dtype=torch.long, device=returns.device)
    counts = torch.bincount(inverse, minlength=len(index)).to(returns.dtype)
    mean = torch.zeros(len(index), dtype=returns.dtype, device=returns.device).index_add_(0, inverse, returns) / counts
    sq_dev = torch.zeros_like(mean).index_add_(0, inverse, (returns - mean[inverse]) ** 2)
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    advantages = returns - mean[inverse]
    if norm_by_std:
        denom = torch.where(singleton, torch.ones_like(std), std + eps)
        advantages = advantages / denom[inverse]
    return advantages


def compute_episode_advantages(
    episode_returns: torch.Tensor, group_ids, traj_ids, norm_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """GiGPO episode advantage A^E: GRPO over the trajectories of each task group, broadcast to their turns.

    All inputs one entry per turn: episode_returns [N] (the trajectory's return, equal on all its turns),
    group_ids, traj_ids (N hashable values or [N] integer tensors). Each trajectory counts once in its group's
    mean and std, however many turns it has. Returns [N].
    """
    groups, trajs = _keys(group_ids), _keys(traj_ids)
    first_turn = {}
    for i, t in enumerate(trajs):
        if t not in first_turn:
            first_turn[t] = i
        elif groups[i] != groups[first_turn[t]]:
            raise ValueError(
                f"trajectory {t!r} has turns in two task groups ({groups[first_turn[t]]!r}, {groups[i]!r})"
            )
        elif episode_returns[i] != episode_returns[first_turn[t]]:
            raise ValueError(f"trajectory {t!r} has different episode returns on its turns")
    order = list(first_turn)
    rows = torch.tensor([first_turn[t] for t in order], device=episode_returns.device)
    traj_adv = compute_grpo_advantages(episode_returns[rows], [groups[first_turn[t]] for t in order], norm_by_std, eps)
    position = {t: k for k, t in enumerate(order)}
    return traj_adv[torch.tensor([position[t] for t in trajs], device=episode_returns.device)]


def build_step_groups(group_ids, anchor_obs: list[str], similarity_thresh: float | None = None) -> torch.Tensor:
    """Step-group index of every turn: turns of the same task group with the same anchor state share one.

    group_ids: N hashable values or an [N] integer tensor; anchor_obs: N strings. Time steps and trajectories
    do not matter, only (task group, anchor). With similarity_thresh=s: turns are visited in order; a turn joins
    the first existing step group of its task group whose representative (the anchor of the group's first turn)
    has difflib.SequenceMatcher(None, representative, anchor).ratio() >= s, else it founds a new group.
    Identical anchors always share a group. Returns an [N] long tensor, groups numbered 0..K-1 in order of
    first appearance.
    """
    groups = _keys(group_ids)
    if len(groups) != len(anchor_obs):
        raise ValueError(f"{len(groups)} group ids but {len(anchor_obs)} anchors")
    index: dict = {}  # (task group, anchor) -> step group
    representatives: dict = {}  # task group -> [(anchor, step group), ...] in creation order
    out: list[int] = []
    num_groups = 0
    for g, anchor in zip(groups, anchor_obs):
        if (g, anchor) not in index:
            found = None
            if similarity_thresh is not None:
                for rep, k in representatives.get(g, []):
                    if difflib.SequenceMatcher(None, rep, anchor).ratio() >= similarity_thresh:
                        found = k
                        break
            if found is None:
                found, num_groups = num_groups, num_groups + 1
                representatives.setdefault(g, []).append((anchor, found))
            index[(g, anchor)] = found
        out.append(index[(g, anchor)])
    return torch.tensor(out, dtype=torch.long)


def compute_step_advantages(
    step_returns: torch.Tensor, step_group_ids: torch.Tensor, norm_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """GiGPO step advantage A^S over step groups.

    step_returns: [N] discounted returns R_{i,t}; step_group_ids: [N] (from build_step_groups).
    A^S_{i,t} = R_{i,t} - mean_{(j,k) in s(i,t)} R_{j,k}, divided by (std + eps) when norm_by_std (unbiased std);
    every turn of the step group counts (a state visited twice by one trajectory counts twice).
    A singleton step group gives 0. Returns [N].
    """
    step_returns = step_returns.float()
    adv = torch.zeros_like(step_returns)
    for idx in _members(_keys(step_group_ids)).values():
        if len(idx) == 1:
            continue
        idx_t = torch.tensor(idx, device=step_returns.device)
        r = step_returns[idx_t]
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std() + eps)
        adv[idx_t] = a
    return adv


def compute_gigpo_advantages(
    episode_returns: torch.Tensor, step_returns: torch.Tensor, group_ids, traj_ids, anchor_obs: list[str],
    step_weight: float = 1.0, norm_by_std: bool = False, eps: float = 1e-6, similarity_thresh: float | None = None,
    return_components: bool = False,
):  # fmt: skip
    """GiGPO advantage of every turn: A_{i,t} = A^E_i + step_weight * A^S_{i,t}.

    All inputs one entry per turn (N turns of the batch, any order, a trajectory's turns in time order):
    episode_returns [N] (the trajectory's return on each of its turns), step_returns [N] (R_{i,t} =
    sum_k gamma^k r_{i,t+k}, see compute_discounted_step_returns), group_ids (task group) and traj_ids: N
    hashable values or [N] integer tensors, anchor_obs: N anchor-state strings.
    A^E: compute_episode_advantages; A^S: compute_step_advantages over build_step_groups (identical, or similar,
    anchors within a task group, across trajectories and time steps; singleton groups give 0).
    Returns [N]; with return_components=True a tuple (A [N], A^E [N], A^S [N], step_group_ids [N] long).
    """
    n = len(episode_returns)
    if not (len(step_returns) == len(_keys(group_ids)) == len(_keys(traj_ids)) == len(anchor_obs) == n):
        raise ValueError("episode_returns, step_returns, group_ids, traj_ids and anchor_obs need one entry per turn")
    episode_adv = compute_episode_advantages(episode_returns, group_ids, traj_ids, norm_by_std, eps)
    step_group_ids = build_step_groups(group_ids, anchor_obs, similarity_thresh)
    step_adv = compute_step_advantages(step_returns, step_group_ids.to(step_returns.device), norm_by_std, eps)
    adv = episode_adv + step_weight * step_adv
    return (adv, episode_adv, step_adv, step_group_ids) if return_components else adv


def compute_discounted_step_returns(rewards: torch.Tensor, traj_ids, gamma: float = 0.95) -> torch.Tensor:
    """Discounted return of every turn within its trajectory: R_{i,t} = sum_{k>=0} gamma^k r_{i,t+k}.

    rewards: [N] per-turn rewards; traj_ids: N hashable values or an [N] integer tensor. The turns of one
    trajectory appear in time order (they need not be contiguous). Returns [N].
    """
    rewards = rewards.float()
    out = torch.empty_like(rewards)
    for idx in _members(_keys(traj_ids)).values():
        running = rewards.new_zeros(())
        for i in reversed(idx):
            running = rewards[i] + gamma * running
            out[i] = running
    return out


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(x_{t+1} | x_{<=t}) under softmax(logits / temperature), and optionally the entropy at each position.

    input_ids, attention_mask: [B, T], either padding side: position ids follow the attention mask (as in
    generation with left padding; with right padding they are the model's default 0, 1, ... on the real tokens).
    Returns logprobs [B, T-1] and entropy H = log Z - sum_v p_v z_v [B, T-1] or None, both float32 (position t
    predicts token t+1). With response_mask [B, T-1] (bool), the LM head and the softmax run only where it is True
    and the other positions are 0: the losses read response tokens only, a few percent of a multi-turn row, so
    this skips most of the vocabulary-sized work (the same numbers where the mask is True).
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if response_mask is None:
        logits, targets = model(**kw).logits[:, :-1], input_ids[:, 1:]
    else:
        hidden = model.base_model(**kw).last_hidden_state[:, :-1][response_mask]
        logits, targets = model.get_output_embeddings()(hidden), input_ids[:, 1:][response_mask]  # [K, V], [K]
    logits = logits.float() / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    logprobs = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1) if with_entropy else None
    if response_mask is not None:

        def scatter(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(response_mask.shape, dtype=x.dtype, device=x.device).masked_scatter(response_mask, x)

        logprobs = scatter(logprobs)
        entropy = scatter(entropy) if entropy is not None else None
    return logprobs, entropy


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: torch.Tensor,
    clip_coef: float = 0.2,
    dual_clip: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate with dual clip, weighted by (detached) importance weights; summed over response tokens.

    logprobs, old_logprobs, response_mask (bool or 0/1), is_weights: [B, T]; advantages: [B] or [B, 1] (a turn's
    advantage on all its tokens) or [B, T] (per token, e.g. token GAE).
    r = exp(logprobs - old_logprobs); l = max(-A r, -A clip(r, 1-eps, 1+eps)); for A < 0, l = min(l, -c A)
    (dual clip, c = dual_clip; c <= 1 switches it off); token loss = w * l. Returns (sum of token losses over the
    mask, number of masked tokens where the clipped term was taken). The caller divides the sum by the
    minibatch's response-token count (token-mean, unchanged by gradient accumulation).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = response_mask.bool()
    advantages = advantages.expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    if dual_clip > 1.0:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    clipped = ((loss_clipped > loss_unclipped) & mask).sum()
    return (is_weights.detach() * loss * mask.to(loss.dtype)).sum(), clipped


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(ref - lp) - (ref - lp) - 1 (>= 0, unbiased on pi's samples)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def truncated_importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float, off_policy: torch.Tensor | None = None
) -> torch.Tensor:
    """w = min(pi_old / pi_behaviour, cap) = min(exp(old - behaviour), cap) per token, detached.

    old_logprobs, behaviour_logprobs: [B, T]; off_policy: a bool mask broadcastable to [B, T] ([B, T] or [B, 1]:
    the rows sampled by another model), whose other tokens get w = 1 (the trained model's own samples), or None
    (every token is weighted). Returns [B, T].
    """
    w = torch.exp(old_logprobs - behaviour_logprobs).clamp(max=cap)
    if off_policy is not None:
        w = torch.where(off_policy, w, torch.ones_like(w))
    return w.detach()


def importance_weight_stats(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Distribution of importance weights over the masked tokens (weights, mask: the same shape, mask bool or 0/1):
    mean, share below 0.1, and the normalised effective sample size ESS = (sum w)^2 / (n sum w^2) in (0, 1].
    Empty dict when the mask is empty."""
    w = weights[mask.bool()].double()
    if w.numel() == 0:
        return {}
    return {
        "mean": w.mean().item(),
        "frac_below_0.1": (w < 0.1).double().mean().item(),
        "ess": (w.sum() ** 2 / (w.numel() * (w**2).sum())).item(),
    }


@dataclass
class Turn:
    """One turn: a training row (prompt -> response) and what the environment answered."""

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]  # log pi_behaviour(token) at the sampling temperature, one per response id
    action: str  # what the environment received
    valid: bool  # the response had a parsable <action>...</action>
    anchor_obs: str  # info["anchor"] of the state the turn acted in (GiGPO's step-group key)
    outcome_reward: float  # env reward of the step (1.0 on the solving step)
    process_reward: float | None  # info["process_reward"]; None once swapped
    done: bool  # the episode ended at this turn (solved, or the step limit)
    truncated: bool  # ... and it was the step limit that ended it (not terminal for GAE)


@dataclass
class Trajectory:
    task_seed: int
    group_id: int  # the task seed: every rollout of a task is in one group (GRPO group, GiGPO episode group)
    turns: list[Turn]
    won: bool
    outcome_return: float  # outcome_scale * won
    process_return: float | None  # sum of the turns' process rewards; None once swapped
    sampler: str  # "policy" or "explorer"
    iteration: int  # the iteration that sampled it
    task_score: float | None = None  # WebShop purchase reward R in [0, 1] (0 without a purchase); ALFWorld: won
    task_type: str = ""  # ALFWorld task type (pick_and_place_simple, ...); "" where there is none
    next_prompt_ids: list[int] | None = None  # prompt after the last turn of a truncated episode (PPO's bootstrap)


def swap_rewards(trajectories: list[Trajectory]) -> list[Trajectory]:
    """THE SWAP: copies of the (explorer) trajectories that keep only their outcome reward.

    Process rewards (per turn and the return) are removed (set to None), so nothing derived from the dense
    reward can reach the policy's update: an accidental use fails loudly instead of training on it.
    """
    swapped = []
    for traj in trajectories:
        turns = [dataclasses.replace(t, process_reward=None) for t in traj.turns]
        swapped.append(dataclasses.replace(traj, turns=turns, process_return=None))
    return swapped


def turn_rewards(
    trajectories: list[Trajectory], reward: Literal["outcome", "process"], outcome_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(episode return per turn [M], per-turn reward [M]) of the flattened turns, on the outcome or process reward.

    outcome: episode return = outcome_return, turn reward = outcome_scale * env reward (non-zero only at the
    solving turn, so the undiscounted sum is the outcome return); process: process_return and the turns'
    process rewards (a swapped trajectory has none: ValueError).
    """
    episode, rewards = [], []
    for traj in trajectories:
        for turn in traj.turns:
            if reward == "outcome":
                episode.append(traj.outcome_return)
                rewards.append(outcome_scale * turn.outcome_reward)
            elif traj.process_return is None or turn.process_reward is None:
                raise ValueError("a swapped trajectory has no process reward: it can only be trained on its outcome")
            else:
                episode.append(traj.process_return)
                rewards.append(turn.process_reward)
    return torch.tensor(episode, dtype=torch.float32), torch.tensor(rewards, dtype=torch.float32)


class ReplayBuffer:
    """FIFO of swapped explorer trajectories (task id, outcome return and behaviour log-probs are inside each).

    capacity: the oldest entries leave first; max_age: an entry added at iteration j is usable while
    iteration - j <= max_age (0: only in the iteration that added it).
    """

    def __init__(self, capacity: int, max_age: int):
        if capacity < 1 or max_age < 0:
            raise ValueError(f"buffer capacity must be >= 1 and max age >= 0, got {capacity} and {max_age}")
        self.capacity, self.max_age = capacity, max_age
        self.entries: deque[tuple[int, Trajectory]] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, trajectories: list[Trajectory], iteration: int) -> None:
        if any(t.process_return is not None for t in trajectories):
            raise ValueError("only swapped trajectories (outcome reward only) enter the replay buffer")
        self.entries.extend((iteration, t) for t in trajectories)

    def sample(
        self,
        task_ids: torch.Tensor | Sequence[int],
        iteration: int,
        num_other: int = 0,
        rng: random.Random | None = None,
    ) -> list[Trajectory]:
        """The stored trajectories of these tasks (seeds, or an integer tensor of them) that are at most max_age
        iterations old (expired ones leave), then up to `num_other` of the other tasks' (drawn without replacement
        with `rng`, else the `random` module, kept in buffer order)."""
        self.entries = deque(((j, t) for j, t in self.entries if iteration - j <= self.max_age), maxlen=self.capacity)
        tasks = set(task_ids.tolist() if isinstance(task_ids, torch.Tensor) else task_ids)
        same = [t for _, t in self.entries if t.task_seed in tasks]
        others = [t for _, t in self.entries if t.task_seed not in tasks]
        if num_other <= 0 or not others:
            return same
        picked = sorted((rng or random).sample(range(len(others)), min(num_other, len(others))))
        return same + [others[i] for i in picked]

    def state_dict(self) -> dict:
        return {"entries": [(j, dataclasses.asdict(t)) for j, t in self.entries]}

    def load_state_dict(self, state: dict) -> None:
        self.entries = deque(maxlen=self.capacity)
        for j, t in state["entries"]:
            turns = [Turn(**turn) for turn in t["turns"]]
            self.entries.append((j, Trajectory(**{**t, "turns": turns})))


# Script plumbing: rollout, GiGPO advantages of a batch, training rows, update, evaluation (these may read args)


@distributed.full_weights  # torchrun: the full weights on every rank while it generates (no collectives)
def rollout(
    model, generator, tokenizer, envs, task_seeds, group_size: int, args: Args, *, sampler: str, iteration: int,
    temperature: float, autocast,
) -> tuple[list[Trajectory], dict]:  # fmt: skip
    """Play len(task_seeds) * group_size episodes in lockstep (group = same seed), one batched generate per turn
    (greedy at temperature 0). Stats: env steps, generated tokens, seconds of generation.

    Records per turn the prompt/response ids, behaviour log-probs, the anchor state the turn acted in and both
    rewards. A response without a parsable action is an invalid turn; the env gets it verbatim and answers as
    the original does (ALFWorld `Nothing happens.`, WebShop the same page; the anchor stays put).
    """
    short = models.is_tiny(args.model_name)  # the tiny model's short prompt numbers the admissible actions
    by_number = cenvs.env_module(args.env).TINY_ANSWER_BY_NUMBER if short else None  # WebShop's products as #k
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    budget = args.max_prompt_tokens or (prompts.TINY_MAX_PROMPT_TOKENS if short else 4096)  # tiny: its warm start's
    budget = min(budget, context - args.max_new_tokens)
    seeds = cenvs.group_seeds(list(task_seeds), group_size)
    n = len(seeds)
    obs, infos = envs.reset(seeds)
    task_types = [str(info.get("task_type", "")) for info in infos]  # ALFWorld's; WebShop has none
    histories: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    turns: list[list[Turn]] = [[] for _ in range(n)]
    active = [True] * n
    stats = {"env_steps": 0, "gen_tokens": 0, "gen_s": 0.0}
    while any(active):
        idx = [i for i in range(n) if active[i]]
        batch_prompts = [prompts.encode_prompt(
            tokenizer, infos[i]["task"], obs[i], histories[i], infos[i]["admissible_actions"],
            history_len=args.history_len, short=short, by_number=by_number, max_prompt_tokens=budget,
        ) for i in idx]  # fmt: skip
        t0 = time.perf_counter()
        with autocast():
            gens = generator.generate(
                model, batch_prompts, temperature=temperature if temperature > 0 else 1.0, top_p=1.0,
                greedy=temperature <= 0,
            )  # fmt: skip
        stats["gen_s"] += time.perf_counter() - t0
        actions: list[str | None] = [None] * n
        valid: list[bool] = [False] * n
        for k, i in enumerate(idx):
            # an answer "3" to the short prompt is the third admissible action; an invalid one goes to the env verbatim
            action, valid[i] = prompts.parse_action(gens[k].text, infos[i]["admissible_actions"] if short else None)
            actions[i] = action if valid[i] else gens[k].text
            stats["gen_tokens"] += len(gens[k].token_ids)
        next_obs, rewards, dones, next_infos = envs.step(actions)
        for k, i in enumerate(idx):
            g = gens[k]
            if len(g.logprobs) != len(g.token_ids):
                raise RuntimeError(f"generator returned {len(g.logprobs)} log-probs for {len(g.token_ids)} tokens")
            turns[i].append(Turn(
                prompt_ids=batch_prompts[k], response_ids=list(g.token_ids), behaviour_logprobs=list(g.logprobs),
                action=actions[i], valid=valid[i], anchor_obs=infos[i]["anchor"], outcome_reward=float(rewards[i]),
                process_reward=float(next_infos[i]["process_reward"]), done=bool(dones[i]),
                truncated=bool(next_infos[i].get("truncated", False)),
            ))  # fmt: skip
            histories[i].append((obs[i], actions[i]))
            obs[i], infos[i] = next_obs[i], next_infos[i]
            active[i] = not dones[i]
    trajectories = []
    for i in range(n):
        won = bool(infos[i]["won"])
        trajectories.append(Trajectory(
            task_seed=seeds[i], group_id=seeds[i], turns=turns[i], won=won,
            task_score=float(infos[i].get("task_score", float(won))), outcome_return=args.outcome_scale * float(won),
            process_return=float(sum(t.process_reward for t in turns[i])), sampler=sampler, iteration=iteration,
            task_type=task_types[i],
        ))  # fmt: skip
    stats["env_steps"] = sum(len(t) for t in turns)
    return trajectories, stats


def gigpo_turn_advantages(
    trajectories: list[Trajectory], reward: Literal["outcome", "process"], *, outcome_scale, gamma, step_weight,
    norm_by_std, similarity_thresh, invalid_penalty,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:  # fmt: skip
    """GiGPO over the flattened turns of `trajectories` (swapped ones are ordinary members of their task's episode
    group and anchor-state groups). Returns (A [M], A - invalid_penalty * invalid [M], step-group statistics)."""
    episode, rewards = turn_rewards(trajectories, reward, outcome_scale)
    traj_ids = torch.tensor([i for i, t in enumerate(trajectories) for _ in t.turns], dtype=torch.long)
    group_ids = [t.group_id for t in trajectories for _ in t.turns]
    anchors = [turn.anchor_obs for t in trajectories for turn in t.turns]
    invalid = torch.tensor([not turn.valid for t in trajectories for turn in t.turns], dtype=torch.float32)
    step_returns = compute_discounted_step_returns(rewards, traj_ids, gamma)
    adv, adv_e, adv_s, step_groups = compute_gigpo_advantages(
        episode, step_returns, group_ids, traj_ids, anchors, step_weight=step_weight, norm_by_std=norm_by_std,
        similarity_thresh=similarity_thresh, return_components=True,
    )  # fmt: skip
    sizes = torch.bincount(step_groups).float()
    stats = {
        "gigpo/num_step_groups": float(len(sizes)),
        "gigpo/step_group_size_mean": sizes.mean().item(),
        "gigpo/step_group_size_max": sizes.max().item(),
        "gigpo/nonsingleton_turn_frac": (sizes[step_groups] > 1).float().mean().item(),
        "gigpo/abs_episode_adv": adv_e.abs().mean().item(),
        "gigpo/abs_step_adv": adv_s.abs().mean().item(),
    }
    return adv, adv - invalid_penalty * invalid, stats


def nonzero_adv_group_share(trajectories: list[Trajectory], turn_advantages: torch.Tensor) -> float:
    """Share of task groups in which some turn has a non-zero advantage (a group that gives a gradient)."""
    groups: dict[int, bool] = {}
    for g, a in zip([t.group_id for t in trajectories for _ in t.turns], turn_advantages.tolist()):
        groups[g] = groups.get(g, False) or abs(a) > 1e-8
    return sum(groups.values()) / max(1, len(groups))


@dataclass
class Row:
    """One training row: a turn's prompt + response, its advantage, and whether it is a swapped explorer turn."""

    input_ids: list[int]
    prompt_len: int
    behaviour_logprobs: list[float]
    advantage: float
    swapped: bool  # a swapped explorer turn in the policy's update: importance-weighted, no KL / entropy term
    iteration: int  # the iteration that sampled it
    turn_index: int = 0  # position of the turn in the batch's list of all turns (indexes the turn advantages)
    old_logprobs: torch.Tensor | None = None  # [response_len], filled by prepare_rows
    ref_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None


def make_rows(trajectories: list[Trajectory], turn_offset: int = 0) -> list[Row]:
    """Training rows of all turns with a response (advantages 0 until set_advantages). A trajectory whose reward
    was swapped gives swapped rows; agent B's own rollouts, process reward still on them, are its own rows."""
    rows, k = [], turn_offset
    for traj in trajectories:
        for turn in traj.turns:
            if turn.response_ids:  # an empty response has no token to train on
                ids, swapped = turn.prompt_ids + turn.response_ids, traj.process_return is None
                rows.append(Row(ids, len(turn.prompt_ids), turn.behaviour_logprobs, 0.0, swapped, traj.iteration, k))
            k += 1
    return rows


def set_advantages(rows: list[Row], turn_advantages: torch.Tensor) -> None:
    """row.advantage = turn_advantages[row.turn_index] for every row (turn_advantages: [M], one per flattened turn)."""
    for r in rows:
        r.advantage = float(turn_advantages[r.turn_index])


def pack_by_tokens(lengths: list[int], budget: int, padded: bool) -> list[list[int]]:
    """Consecutive index chunks whose token count stays within budget (sum of lengths, or rows x max length when
    padded); a row longer than the budget gets a chunk of its own."""
    chunks, cur, total, longest = [], [], 0, 0
    for i, n in enumerate(lengths):
        cost = max(longest, n) * (len(cur) + 1) if padded else total + n
        if cur and cost > budget:
            chunks.append(cur)
            cur, total, longest = [], 0, 0
        cur.append(i)
        total, longest = total + n, max(longest, n)
    if cur:
        chunks.append(cur)
    return chunks


def collate(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded [b, T] ids and mask; [b, T-1] response mask and per-token fields (position t predicts t+1)."""
    b, width = len(rows), max(len(r.input_ids) for r in rows)
    out = {
        "input_ids": torch.full((b, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, width), dtype=torch.long),
        "response_mask": torch.zeros((b, width - 1), dtype=torch.bool),
    }
    per_token = {"old": "old_logprobs", "ref": "ref_logprobs", "w": "is_weights"}
    for key in per_token:
        out[key] = torch.zeros((b, width - 1))
    for k, r in enumerate(rows):
        n, s = len(r.input_ids), r.prompt_len - 1
        out["input_ids"][k, :n] = torch.tensor(r.input_ids)
        out["attention_mask"][k, :n] = 1
        out["response_mask"][k, s : n - 1] = True
        for key, name in per_token.items():
            if getattr(r, name) is not None:
                out[key][k, s : n - 1] = torch.as_tensor(getattr(r, name), dtype=torch.float32)
    out["advantages"] = torch.tensor([r.advantage for r in rows]).unsqueeze(1)
    out["own"] = torch.tensor([not r.swapped for r in rows]).unsqueeze(1)
    return {k: v.to(device) for k, v in out.items()}


@torch.no_grad()
@distributed.full_weights
def prepare_rows(model, ref_model, rows: list[Row], args: Args, *, pad_id: int, autocast) -> None:
    """Fill each row's old log-probs (`model` before its update) and reference log-probs ([response_len], at the
    sampling temperature) and its truncated importance weights min(pi_old / pi_behaviour, is_cap) (1 if own)."""
    by_length = sorted(rows, key=lambda r: len(r.input_ids))  # less padding
    device = next(model.parameters()).device  # the reference's too (a LoRA reference, the bare base, has none)
    for net, field in ((model, "old_logprobs"), (ref_model, "ref_logprobs")):
        was_training = net.training
        net.eval()
        for chunk in pack_by_tokens([len(r.input_ids) for r in by_length], args.micro_batch_tokens, padded=True):
            b = collate([by_length[i] for i in chunk], pad_id, device)
            with autocast():
                lp, _ = token_logprobs(
                    net, b["input_ids"], b["attention_mask"], args.temperature, response_mask=b["response_mask"]
                )
            for k, i in enumerate(chunk):
                setattr(by_length[i], field, lp[k][b["response_mask"][k]].cpu())
        net.train(was_training)
    for r in rows:
        behaviour = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
        r.is_weights = truncated_importance_weights(r.old_logprobs, behaviour, args.is_cap, torch.tensor(r.swapped))


class NonFiniteLoss(RuntimeError):
    """A non-finite loss, or weights that an optimiser step made non-finite: the update stops before using them."""


def finite_weights(model: torch.nn.Module) -> bool:
    """True when the sum of the squared weights is finite in float32, i.e. every |w| is below ~1.8e19: a learning
    rate that blows up gives weights whose next forward pass overflows even while they are finite themselves."""
    total = torch.stack([p.detach().float().square().sum() for p in model.parameters()]).sum()  # FSDP: all shards
    return bool(torch.isfinite(total))


def update(model, optimizer, rows: list[Row], args: Args, *, epochs: int, pad_id: int, autocast) -> dict[str, float]:
    """Policy-gradient update: epochs x token-budget minibatches (one AdamW step each) x micro-batches (gradient
    accumulation). Loss per minibatch = sum(policy token losses) / n_response_tokens
    + kl_coef * sum(k3 KL) / n_own_tokens - ent_coef * sum(entropy) / n_own_tokens (own: not swapped)."""
    model.train()
    device = next(model.parameters()).device
    sums = {"policy_loss": 0.0, "kl": 0.0, "entropy": 0.0, "approx_kl": 0.0, "clip": 0.0, "tokens": 0, "own": 0}
    trained_tokens = 0
    for _ in range(epochs):
        order = torch.randperm(len(rows)).tolist()
        # torchrun: every rank steps as often (None: a padding step) and the token means are over all ranks' tokens
        minibatches = pack_by_tokens([len(rows[i].input_ids) for i in order], args.minibatch_tokens, padded=False)
        for minibatch in distributed.steps(minibatches):
            mb_rows = sorted((rows[order[i]] for i in minibatch or []), key=lambda r: len(r.input_ids))  # less padding
            n_tokens = distributed.token_divisor(sum(len(r.input_ids) - r.prompt_len for r in mb_rows))
            n_own = distributed.token_divisor(sum(len(r.input_ids) - r.prompt_len for r in mb_rows if not r.swapped))
            optimizer.zero_grad(set_to_none=True)
            micro_batches = pack_by_tokens([len(r.input_ids) for r in mb_rows], args.micro_batch_tokens, padded=True)
            for chunk in distributed.steps(micro_batches):
                if chunk is None:
                    distributed.zero_backward(model)
                    continue
                b = collate([mb_rows[i] for i in chunk], pad_id, device)
                mask = b["response_mask"]
                with autocast():
                    logprobs, entropy = token_logprobs(
                        model, b["input_ids"], b["attention_mask"], args.temperature, with_entropy=args.ent_coef != 0,
                        response_mask=mask,
                    )  # fmt: skip
                weights = b["w"] if args.off_policy_correction == "tis" else torch.ones_like(b["w"])
                pg_sum, n_clipped = policy_loss(
                    logprobs, b["old"], b["advantages"], mask, weights, args.clip_coef, args.dual_clip
                )
                own = (mask & b["own"]).float()
                kl_sum = (kl_k3(logprobs, b["ref"]) * own).sum()
                ent_sum = (entropy * own).sum() if entropy is not None else torch.zeros((), device=device)
                loss = pg_sum / n_tokens + args.kl_coef * kl_sum / n_own - args.ent_coef * ent_sum / n_own
                if not torch.isfinite(loss):
                    raise NonFiniteLoss(f"loss = {loss.item()}")
                loss.backward()
                with torch.no_grad():
                    log_ratio = (logprobs - b["old"])[mask]
                    sums["approx_kl"] += (torch.exp(log_ratio) - 1 - log_ratio).sum().item()
                for key, value in (("policy_loss", pg_sum), ("kl", kl_sum), ("entropy", ent_sum), ("clip", n_clipped)):
                    sums[key] += value.item()
                sums["tokens"] += int(mask.sum())
                sums["own"] += int(own.sum())
                trained_tokens += int(b["attention_mask"].sum())
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            if not finite_weights(model):
                raise NonFiniteLoss("an optimiser step made the weights non-finite")
    sums, trained_tokens, n_rows = distributed.sum_all((sums, trained_tokens, len(rows)))  # torchrun: all ranks'
    n, n_own = max(1, sums["tokens"]), max(1, sums["own"])
    stats = {"policy_loss": sums["policy_loss"] / n, "kl": sums["kl"] / n_own, "clip_frac": sums["clip"] / n}
    stats.update(approx_kl=sums["approx_kl"] / n, trained_tokens=trained_tokens, update_rows=n_rows)
    if args.ent_coef != 0:
        stats["entropy"] = sums["entropy"] / n_own
    return stats


@distributed.full_weights
def evaluate(model, generator, tokenizer, make_envs, seeds: list[int], args: Args, *, autocast) -> dict[str, float]:
    """Held-out episodes (one per seed): success rate (and WebShop score, 100 * mean purchase reward), 95% CIs;
    on ALFWorld also the success per task type."""
    won, scores, types, seeds = [], [], [], distributed.split(seeds)  # torchrun: each rank plays its share
    for start in range(0, len(seeds), args.eval_batch_size):
        chunk = seeds[start : start + args.eval_batch_size]
        trajectories, _ = rollout(
            model, generator, tokenizer, make_envs(len(chunk)), chunk, 1, args, sampler="policy", iteration=-1,
            temperature=args.eval_temperature, autocast=autocast,
        )  # fmt: skip
        won += [float(t.won) for t in trajectories]
        scores += [100.0 * t.task_score for t in trajectories]
        types += [t.task_type for t in trajectories]
    won, scores, types = distributed.gather(won), distributed.gather(scores), distributed.gather(types)
    metrics = dict(zip(("eval/success_rate", "eval/success_ci95"), run.mean_ci95(won)))
    if args.env == "webshop":
        metrics["eval/score"], metrics["eval/score_ci95"] = run.mean_ci95(scores)
    for task_type in sorted(set(types) - {""}):
        metrics[f"eval/success_{task_type}"] = float(np.mean([w for w, t in zip(won, types) if t == task_type]))
    return metrics


def explorer_distance_metrics(swapped_rows: list[Row], iteration: int, tokenizer) -> dict[str, float]:
    """How far agent B is from the policy, on all response tokens and on the action tokens alone (the tokens inside
    <action>...</action>; the tags and EOS are near-deterministic and would hide the difference): the importance
    weights of every swapped row, and KL(explorer || policy) (k3, pi_policy / pi_explorer) on this iteration's."""
    if not swapped_rows:
        return {}
    action = torch.tensor(
        [m for r in swapped_rows for m in prompts.action_token_mask(tokenizer, r.input_ids[r.prompt_len :])]
    )
    w = torch.cat([r.is_weights for r in swapped_rows])
    out = {f"is_weight/{k}": v for k, v in importance_weight_stats(w, torch.ones_like(action)).items()}
    out.update({f"is_weight/{k}_action": v for k, v in importance_weight_stats(w, action).items()})
    fresh = torch.tensor([r.iteration == iteration for r in swapped_rows for _ in r.is_weights])
    if fresh.any():
        lp_explorer = torch.cat([torch.tensor(r.behaviour_logprobs) for r in swapped_rows])
        lp_policy = torch.cat([r.old_logprobs for r in swapped_rows])
        kl = kl_k3(lp_explorer, lp_policy)
        out["explorer/kl_to_policy"] = kl[fresh].mean().item()
        if (fresh & action).any():
            out["explorer/kl_to_policy_action"] = kl[fresh & action].mean().item()
    return out


def pearson(x: list[float], y: list[float]) -> float | None:
    """Correlation of two lists; None when either is constant (undefined)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) < 2 or xa.std() == 0 or ya.std() == 0:
        return None
    return float(np.corrcoef(xa, ya)[0, 1])


def bool_flag_pair(argv: list[str], name: str) -> list[str]:
    """Let `--name` / `--no-name` set an Optional[bool] field (tyro itself wants `--name {None,True,False}`)."""
    out = []
    for k, a in enumerate(argv):
        nxt = argv[k + 1] if k + 1 < len(argv) else None
        if a == f"--{name}" and nxt not in ("True", "False", "None"):
            out += [f"--{name}", "True"]
        elif a == f"--no-{name}":
            out += [f"--{name}", "False"]
        else:
            out.append(a)
    return out


@contextmanager
def timed(metrics: dict, key: str):
    """Add the seconds spent in the `with` block to metrics[key]."""
    start = time.perf_counter()
    yield
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


if __name__ == "__main__":
    args = tyro.cli(Args, args=bool_flag_pair(sys.argv[1:], "norm-adv-by-std"))
    # torchrun: join the process group; each rank takes its GPU (or the CPU with gloo)
    device = distributed.init(torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu"))
    # Per-benchmark defaults (GiGPO's settings: ALFWorld mean/std normalisation, WebShop mean-only). ALFWorld's step
    # limit is 50; the embedded small preset's expert needs at most 10 steps, so 15 there (CPU time).
    if args.max_steps is None:
        small_alfworld = args.env == "alfworld" and args.env_backend == "embedded" and args.env_preset == "small"
        args.max_steps = 50 if args.env == "alfworld" and not small_alfworld else 15
    if args.norm_adv_by_std is None:
        args.norm_adv_by_std = args.env == "alfworld"
    if args.eval_split is None:
        args.eval_split = {"alfworld": "valid_unseen", "webshop": "test"}[args.env]
    if args.learning_rate is None:
        args.learning_rate = {"alfworld": 1e-4, "webshop": 2e-4}[args.env]
    if args.train_pool_size is None:
        args.train_pool_size = {"alfworld": 2048, "webshop": 32}[args.env]
    swap = args.reward_mode == "swap"
    args.num_policy_rollouts = args.tasks_per_iteration * args.group_size
    args.num_explorer_rollouts = args.tasks_per_iteration * args.explorer_rollouts_per_task if swap else 0
    if args.train_pool_size < args.tasks_per_iteration:
        raise SystemExit(f"--train-pool-size ({args.train_pool_size}) must be >= --tasks-per-iteration")
    run_name = f"{args.env}__{args.exp_name}__{args.seed}__{int(time.time())}"
    # A mistake in the flags, the model, the env's data or the --resume run ends here, in one line, before any
    # file is written (run.Run checks that --resume names a readable checkpoint of a run with these flags).
    try:
        run.check_args(
            args,
            at_least_one=(
                "max_steps", "max_prompt_tokens", "generation_batch_size", "max_new_tokens", "num_iterations",
                "tasks_per_iteration", "group_size", "update_epochs", "minibatch_tokens", "micro_batch_tokens",
                "num_eval_tasks", "eval_batch_size", "checkpoint_every",
                *(["explorer_rollouts_per_task", "buffer_capacity"] if swap else []),
            ),
            positive=("temperature", "max_grad_norm", "is_cap", "similarity_thresh"),
            at_most_one=("gamma", "similarity_thresh"),
        )  # fmt: skip
        try:  # the training and evaluation goals (the evaluation split exists; WebShop has 500 test goals)
            train_pool, eval_seeds = cenvs.seed_pools(
                args.env,
                args.train_pool_size,
                args.num_eval_tasks,
                backend=args.env_backend,
                eval_split=args.eval_split,
            )
        except ValueError as e:
            raise run.BadInput(f"--eval-split {args.eval_split} --num-eval-tasks {args.num_eval_tasks}: {e}") from None
        models.check_model_name(args.model_name)
        models.check_lora(args.lora_rank)
        cenvs.check_backend(args.env, args.env_backend)
        distributed.check(args.tasks_per_iteration, args.rollout_backend)
        logger = run.Run(args, run_name, runs_dir=args.runs_dir, resume=args.resume)
    except run.BadInput as err:
        raise SystemExit(str(err)) from None
    run.seed_everything(args.seed + distributed.rank(), args.torch_deterministic)  # torchrun: each rank samples its own

    def autocast():  # bf16 autocast on CUDA, fp32 on the CPU: one code path on both
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    # The policy, its frozen reference (the initial policy) and, in swap mode, the explorer (agent B)
    policy, tokenizer = models.load_model(
        args.model_name, env_name=args.env, preset=args.env_preset, seed=args.tiny_seed, device=device
    )
    # LoRA (--lora-rank > 0): the policy and agent B are adapters on one frozen base, which is the KL reference
    policy, explorer, ref_model, _ = models.policy_explorer_reference(
        policy, device, explorer=swap, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha
    )
    distributed.shard(policy, ref_model, explorer)  # torchrun: FSDP2, before the optimisers (they step the shards)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate)
    explorer_lr = args.explorer_learning_rate if args.explorer_learning_rate is not None else args.learning_rate
    explorer_epochs = args.explorer_update_epochs if args.explorer_update_epochs is not None else args.update_epochs
    explorer_optimizer = torch.optim.AdamW(explorer.parameters(), lr=explorer_lr) if swap else None
    buffer = ReplayBuffer(args.buffer_capacity, args.buffer_max_age)
    # vLLM starts from a save_pretrained copy of the initial policy (rollout_model/ in the run: --model-name may be
    # "tiny", which is no folder); the generator pushes the sampling model's weights into it before each rollout.
    generator = generation.make_generator(
        args.rollout_backend, tokenizer, max_new_tokens=args.max_new_tokens, batch_size=args.generation_batch_size,
        model=policy, engine_dir=logger.dir / "rollout_model",
    )  # fmt: skip
    pad_id = tokenizer.pad_token_id

    @functools.cache
    def make_envs(n: int) -> cenvs.LockstepEnvs:  # one set of n lockstep environments, made once
        return cenvs.LockstepEnvs(
            args.env, n, backend=args.env_backend, preset=args.env_preset, max_steps=args.max_steps,
            process_reward=args.process_reward,
        )  # fmt: skip

    def advantages(trajectories: list[Trajectory], reward: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
        return gigpo_turn_advantages(
            trajectories, reward, outcome_scale=args.outcome_scale, gamma=args.gamma, step_weight=args.step_adv_weight,
            norm_by_std=args.norm_adv_by_std, similarity_thresh=args.similarity_thresh,
            invalid_penalty=args.invalid_penalty,
        )  # fmt: skip

    def prepare(model, rows: list[Row]) -> None:  # old log-probs (before the model's update), reference, IS weights
        prepare_rows(model, ref_model, rows, args, pad_id=pad_id, autocast=autocast)

    def train(model, optimizer, rows: list[Row], epochs: int) -> dict[str, float]:
        return update(model, optimizer, rows, args, epochs=epochs, pad_id=pad_id, autocast=autocast)

    # Resume (save_checkpoint and load_checkpoint skip the explorer's None entries outside swap mode)
    start_iteration, env_steps = 1, 0
    modules = {"policy": policy, "ref": ref_model, "explorer": explorer}
    optimizers = {"policy": optimizer, "explorer": explorer_optimizer}
    if args.eval_only:  # only the policy is read: a checkpoint of any reward mode can be evaluated
        modules, optimizers = {"policy": policy}, {}
    if args.resume:  # run.Run has checked that the checkpoint exists and that the flags are the run's
        state = logger.load_checkpoint(modules, optimizers)
        start_iteration, env_steps = state["iteration"] + 1, state["extra"]["env_steps"]
        if not args.eval_only:
            buffer.load_state_dict(state["extra"]["buffer"])
        print(f"resumed from {args.resume} at iteration {state['iteration']} ({env_steps} env steps)")

    def run_eval(iteration: int) -> dict[str, float]:
        metrics = evaluate(policy, generator, tokenizer, make_envs, eval_seeds, args, autocast=autocast)
        print(f"iter {iteration}: eval " + " ".join(f"{k[5:]} {v:.3f}" for k, v in metrics.items()), flush=True)
        return metrics

    if args.eval_only:
        logger.log({"env_steps": env_steps, **run_eval(start_iteration - 1)}, step=start_iteration - 1)
        logger.close()
        raise SystemExit(0)
    if args.eval_at_start and start_iteration == 1:
        logger.log({"env_steps": 0, **run_eval(0)}, step=0)

    policy_reward = "process" if args.reward_mode == "process" else "outcome"
    try:
        for iteration in run.progress(range(start_iteration, args.num_iterations + 1), desc="iterations"):
            warmup = min(1.0, iteration / args.warmup_iterations) if args.warmup_iterations > 0 else 1.0
            for opt, lr in ((optimizer, args.learning_rate), (explorer_optimizer, explorer_lr)):
                for group in opt.param_groups if opt is not None else []:
                    group["lr"] = lr * warmup
            metrics: dict[str, float] = {"perf/rollout_s": 0.0, "perf/update_s": 0.0}

            # ROLLOUT: the policy plays B tasks x G_on, then (swap mode) the explorer the same tasks x G_off
            with timed(metrics, "perf/rollout_s"):
                task_seeds = distributed.split(random.sample(train_pool, args.tasks_per_iteration))  # torchrun: a share
                batch, stats = rollout(
                    policy, generator, tokenizer, make_envs(len(task_seeds) * args.group_size), task_seeds,
                    args.group_size, args, sampler="policy", iteration=iteration, temperature=args.temperature,
                    autocast=autocast,
                )  # fmt: skip
            rollout_stats = [stats]
            with timed(metrics, "perf/update_s"):
                rows = make_rows(batch)
                prepare(policy, rows)  # before any update: the one-step explorer starts from these log-probs
                if swap and args.explorer == "one_step":  # the comparison: a fresh copy, one step on the policy's batch
                    explorer.load_state_dict(policy.state_dict())
                    explorer_rows = [dataclasses.replace(r) for r in rows]
                    set_advantages(explorer_rows, advantages(batch, "process")[1])
                    explorer_stats = train(explorer, explorer_optimizer, explorer_rows, explorer_epochs)
                elif swap and args.explorer_sync_every > 0 and (iteration - 1) % args.explorer_sync_every == 0:
                    explorer.load_state_dict(policy.state_dict())  # agent B back within reach of the IS weights
            if swap:
                with timed(metrics, "perf/rollout_s"):
                    explorer_trajectories, stats = rollout(
                        explorer, generator, tokenizer, make_envs(len(task_seeds) * args.explorer_rollouts_per_task),
                        task_seeds, args.explorer_rollouts_per_task, args, sampler="explorer", iteration=iteration,
                        temperature=args.temperature, autocast=autocast,
                    )  # fmt: skip
                rollout_stats.append(stats)
            rollout_stats = distributed.sum_all(rollout_stats)  # torchrun: all ranks' counts (and seconds)
            env_steps += sum(s["env_steps"] for s in rollout_stats)

            # THE SWAP (RSPO): the explorer's trajectories, rewards swapped to the outcome, enter the buffer; the
            # buffered ones of this iteration's tasks join their task's groups in the policy's batch
            buffered = []
            if swap:
                buffer.add(swap_rewards(explorer_trajectories), iteration)
                buffered = buffer.sample(task_seeds, iteration)
                with timed(metrics, "perf/update_s"):
                    swapped_rows = make_rows(buffered, turn_offset=sum(len(t.turns) for t in batch))
                    prepare(policy, swapped_rows)
                rows += swapped_rows

            # ADVANTAGES: GiGPO over each task's episode group and anchor-state groups (swapped members included)
            with timed(metrics, "perf/update_s"):
                adv_policy_only, _, _ = advantages(batch, policy_reward)
                adv, turn_adv, gigpo_stats = advantages(batch + buffered, policy_reward)
                set_advantages(rows, turn_adv)

            # UPDATE: agent B on its own rollouts with the process reward (its own groups: on-policy for it), then
            # the policy on the outcome reward (the process reward in --reward-mode process)
            with timed(metrics, "perf/update_s"):
                if swap and args.explorer == "agent_b":
                    explorer_rows = make_rows(explorer_trajectories)
                    prepare(explorer, explorer_rows)
                    set_advantages(explorer_rows, advantages(explorer_trajectories, "process")[1])
                    explorer_stats = train(explorer, explorer_optimizer, explorer_rows, explorer_epochs)
                policy_stats = train(policy, optimizer, rows, args.update_epochs)

            # LOG: the training curve comes from the policy's own rollouts only
            if distributed.active():  # torchrun: every rank's rollouts (each task's group is whole on one rank)
                batch, buffered = distributed.gather(batch), distributed.gather(buffered)
                explorer_trajectories = distributed.gather(explorer_trajectories) if swap else []
                swapped_rows = distributed.gather(swapped_rows) if swap else []
                adv_policy_only, _, _ = advantages(batch, policy_reward)
                adv, _, gigpo_stats = advantages(batch + buffered, policy_reward)
            trained_tokens = policy_stats.pop("trained_tokens")
            if swap:
                trained_tokens += explorer_stats.pop("trained_tokens")
                metrics["explorer/env_steps"] = rollout_stats[1]["env_steps"]
                metrics.update({f"explorer/{k}": v for k, v in explorer_stats.items()})
                metrics["explorer/success_rate"] = float(np.mean([t.won for t in explorer_trajectories]))
                metrics["explorer/process_return"] = float(np.mean([t.process_return for t in explorer_trajectories]))
                metrics["buffer/size"], metrics["buffer/sampled"] = distributed.sum_all(len(buffer)), len(buffered)
                metrics.update(explorer_distance_metrics(swapped_rows, iteration, tokenizer))
                metrics["train/nonzero_adv_groups_after_swap"] = nonzero_adv_group_share(batch + buffered, adv)
            metrics["train/nonzero_adv_groups_before_swap"] = nonzero_adv_group_share(batch, adv_policy_only)
            metrics.update(gigpo_stats)
            metrics.update({f"losses/{k}": v for k, v in policy_stats.items() if k != "update_rows"})
            outcome, process = [t.outcome_return for t in batch], [t.process_return for t in batch]
            gen_tokens, gen_s = (sum(s[k] for s in rollout_stats) for k in ("gen_tokens", "gen_s"))
            metrics.update(
                {
                    "env_steps": env_steps,
                    "train/success_rate": float(np.mean([t.won for t in batch])),
                    "train/outcome_return": float(np.mean(outcome)),
                    "train/process_return": float(np.mean(process)),
                    "train/episode_length": float(np.mean([len(t.turns) for t in batch])),
                    "train/invalid_turn_rate": float(np.mean([not u.valid for t in batch for u in t.turns])),
                    "charts/learning_rate": optimizer.param_groups[0]["lr"],
                    "perf/gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9),
                    "perf/train_tokens_per_s": trained_tokens / max(metrics["perf/update_s"], 1e-9),
                }
            )
            if args.env == "webshop":
                metrics["train/score"] = 100.0 * float(np.mean([t.task_score for t in batch]))
            if (corr := pearson(process, outcome)) is not None:
                metrics["train/process_outcome_corr"] = corr
            last = iteration == args.num_iterations or 0 < args.total_env_steps <= env_steps
            if last or (args.eval_every > 0 and iteration % args.eval_every == 0):
                metrics.update(run_eval(iteration))
            logger.log(metrics, step=iteration)
            print(
                f"iter {iteration}: steps {env_steps} success {metrics['train/success_rate']:.2f} "
                f"step groups {metrics['gigpo/num_step_groups']:.0f} (non-singleton turns "
                f"{metrics['gigpo/nonsingleton_turn_frac']:.2f}) |A^E| {metrics['gigpo/abs_episode_adv']:.3f} "
                f"|A^S| {metrics['gigpo/abs_step_adv']:.3f}",
                flush=True,
            )

            # SAVE: policy, reference, explorer, their optimisers, the replay buffer, env steps and RNG states
            if last or iteration % args.checkpoint_every == 0:
                run_state = {"env_steps": env_steps, "buffer": buffer.state_dict()}
                logger.save_checkpoint(iteration, modules, optimizers, extra=run_state)
            if last:
                break
    except NonFiniteLoss as err:  # nothing of the failed iteration is saved (weights, explorer, buffer)
        path = logger.checkpoint_dir / run.CHECKPOINT_NAME
        kept = f"the last good checkpoint is kept: {path}" if path.is_file() else "no checkpoint was written"
        raise SystemExit(f"training diverged at iteration {iteration} ({err}); {kept}") from None

    if args.save_model:
        distributed.save_pretrained(logger.dir / "model", policy, tokenizer)  # torchrun: rank 0, the full weights
    logger.close()
    distributed.close()  # torchrun: every rank waits for rank 0's files, leaves the process group and exits
