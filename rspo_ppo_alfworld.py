"""RSPO with multi-turn PPO (turn-level GAE) on ALFWorld. Docs: docs/rspo_ppo_alfworld.md

Each iteration the policy plays B tasks G_on times. A critic (a value head) reads V at the last prompt token of every
turn; GAE over the turns gives each turn an advantage that all its response tokens carry. In `--reward-mode swap`
(RSPO) an explorer, agent B (a copy of the policy re-synced every K iterations, with its own value head), plays the
same tasks G_off times and takes its own PPO step on its own rollouts with the dense *process* reward. THE SWAP keeps
only the sparse *outcome* reward of its trajectories before they enter a replay buffer; the buffered trajectories of
this iteration's tasks join the policy's batch (their advantages from the policy's critic, their tokens weighted by
truncated importance weights), and the policy learns the outcome reward only. `--reward-mode outcome` and
`--reward-mode process` are the two baselines.
"""

import dataclasses
import functools
import os
import random
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal, Optional

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
    """seed of the experiment (tasks, sampling, the tiny model's warm start)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True` and deterministic algorithms"""
    cuda: bool = True
    """if toggled, CUDA is used when available (bf16 autocast); otherwise the CPU in fp32"""
    track: bool = False
    """if toggled, the run is tracked with Weights and Biases"""
    wandb_project_name: str = "rspo"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of the wandb project"""
    save_model: bool = True
    """whether to save the final policy (save_pretrained) and critic into the run folder"""

    # Environment
    env_backend: Literal["embedded", "real"] = "embedded"
    """`embedded`: the pure-Python ALFWorld replica; `real`: the original games on the TextWorld engine"""
    env_preset: Literal["small", "default"] = "small"
    """embedded world size: `small` for the tiny model on a CPU, `default` close to the original's"""
    max_steps: int = 15
    """steps per episode (ALFWorld's limit is 50: use it with the default preset; the small one's expert needs 10)"""
    process_reward: Literal["aligned", "misaligned"] = "misaligned"
    """dense reward: `misaligned` pays placing an object whatever its clean/hot/cool state (envs/alfworld.py)"""
    history_len: int = 2
    """previous turns in each prompt: (observation, action) pairs; the tiny model's short form: actions only"""
    max_prompt_tokens: int = 1024
    """prompt budget in tokens, oldest history dropped first (at most the context minus --max-new-tokens)"""

    # Model and rollout
    model_name: str = "tiny"
    """`tiny` (local, warm-started on expert turns), `smollm2-135m`, or a Hugging Face id / local path (offline)"""
    tiny_seed: int = 1
    """seed of the tiny model's build (1: the committed one); --seed varies the training run from the same start"""
    lora_rank: int = 0
    """LoRA rank r: policy, agent B and critics train rank-r adapters on one frozen base (0: full weights)"""
    lora_alpha: Optional[float] = None
    """LoRA scale: delta W = (alpha / r) B A (None: alpha = 2 r)"""
    critic_model_name: Optional[str] = None
    """None: the critic is a value head on a copy of the policy; else a separate model with the same tokenizer"""
    rollout_backend: Literal["hf", "vllm"] = "hf"
    """generation backend: Hugging Face generate (CPU/GPU) or vLLM (GPU)"""
    generation_batch_size: Optional[int] = None
    """prompts per HF generate call (None: all active envs at once)"""
    temperature: float = 1.0
    """sampling temperature of training rollouts (old log-probs are recomputed at the same temperature)"""
    max_new_tokens: int = 24
    """response budget per turn in tokens"""

    # Algorithm specific arguments
    num_iterations: int = 30
    """training iterations (one rollout batch and one update each)"""
    total_env_steps: int = 0
    """stop after the iteration whose env steps (explorer included) reach this budget (0: none)"""
    tasks_per_iteration: int = 4
    """B: tasks per iteration"""
    group_size: int = 2
    """G_on: policy rollouts per task (PPO has no group baseline: 1 is allowed)"""
    learning_rate: float = 1e-4
    """policy learning rate (the tiny model; paper-scale runs use 1e-6)"""
    critic_learning_rate: float = 3e-4
    """critic learning rate (its own AdamW)"""
    warmup_iterations: int = 0
    """linear learning-rate warm-up over this many iterations (then constant)"""
    update_epochs: int = 1
    """passes over the batch per update"""
    minibatch_tokens: int = 16384
    """token budget of one optimiser step (sum of prompt+response lengths of its turns)"""
    micro_batch_tokens: int = 4096
    """token budget of one forward/backward (padded rows x length); gradients accumulate over micro-batches"""
    gamma: float = 0.99
    """discount over turns"""
    gae_lambda: float = 0.95
    """GAE lambda over turns"""
    advantage_estimator: Literal["turn_gae", "episode_return_token_gae"] = "turn_gae"
    """`turn_gae`: GAE over the turns; `episode_return_token_gae`: verl-agent's, GAE in each turn to the return"""
    norm_adv: bool = True
    """whiten the advantages over the batch's response tokens (before the invalid-turn penalty)"""
    vf_clip: float = 2.0
    """value clipping range in return units (0.2 x the outcome scale 10): V stays within V_old +- vf_clip"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient epsilon"""
    dual_clip: float = 3.0
    """dual-clip constant c: for negative advantages the loss is at most -c * A"""
    kl_coef: float = 0.01
    """coefficient of the k3 KL to the frozen initial policy"""
    ent_coef: float = 0.001
    """coefficient of the entropy bonus"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (policy and critic each)"""
    outcome_scale: float = 10.0
    """per-turn outcome reward r_t = outcome_scale * (env reward of the step): outcome return = 10 * success"""
    invalid_penalty: float = 0.1
    """subtracted from the advantage of a turn whose response has no parsable <action>...</action>"""

    # RSPO (reward swap)
    reward_mode: Literal["swap", "outcome", "process"] = "swap"
    """`swap`: RSPO; `outcome`: PPO on the outcome reward; `process`: PPO on the process reward"""
    explorer_rollouts_per_task: int = 2
    """G_off: explorer rollouts per task (swap mode)"""
    explorer: Literal["agent_b", "one_step"] = "agent_b"
    """`agent_b`: PPO on its own rollouts; `one_step`: a fresh policy copy, one step on the policy's batch"""
    explorer_sync_every: int = 20
    """agent_b: copy the policy's weights (not its value head) into agent B every this many iterations (0: never)"""
    explorer_learning_rate: Optional[float] = 2.5e-4
    """explorer learning rate (None: --learning-rate); agent B moves faster than the policy on the dense reward"""
    explorer_critic_learning_rate: Optional[float] = None
    """learning rate of the explorer's value head (None: --critic-learning-rate)"""
    explorer_update_epochs: Optional[int] = 2
    """explorer update epochs (None: --update-epochs)"""
    off_policy_correction: Literal["tis", "none"] = "tis"
    """`tis`: weight explorer tokens by min(pi_old / pi_explorer, is_cap); `none`: weight 1"""
    is_cap: float = 2.0
    """cap C of the truncated importance weights"""
    buffer_capacity: int = 256
    """replay buffer capacity (explorer trajectories, FIFO)"""
    buffer_max_age: int = 10
    """iterations a buffered trajectory stays usable (0: only this iteration's)"""
    buffer_extra_other_tasks: int = 0
    """also train on up to this many buffered trajectories of tasks outside the batch (PPO has no groups)"""
    train_pool_size: int = 2048
    """training tasks are drawn from the first this-many train seeds (2,048: the 1,024 the warm start imitated and
    1,024 new ones, so that what the policy learns must hold on games it meets about once)"""

    # Evaluation and checkpoints
    eval_split: Literal["valid_unseen", "valid_seen", "valid"] = "valid_unseen"
    """held-out split (`valid`: train seeds from 2,048 on, for choosing defaults)"""
    eval_every: int = 5
    """evaluate every this many iterations (and after the last; 0: only after the last)"""
    eval_at_start: bool = True
    """also evaluate the initial policy (logged at iteration 0)"""
    num_eval_tasks: int = 32
    """held-out tasks (the first seeds of --eval-split)"""
    eval_temperature: float = 0.0
    """evaluation sampling temperature (0: greedy)"""
    eval_batch_size: int = 64
    """evaluation episodes played in lockstep at once"""
    checkpoint_every: int = 1
    """save runs/{run}/checkpoints/latest.pt every this many iterations (and at the end)"""
    runs_dir: str = "runs"
    """folder of the run folders"""
    resume: Optional[str] = None
    """a run folder: continue from its latest checkpoint (same flags)"""
    eval_only: bool = False
    """evaluate the policy (the --resume checkpoint, else the initial model) and exit"""

    # to be filled in runtime
    num_policy_rollouts: int = 0
    """B * G_on"""
    num_explorer_rollouts: int = 0
    """B * G_off in swap mode, else 0"""


# ALGO LOGIC: advantages, value loss, policy loss, importance weights, the swap, the replay buffer
# (pure: nothing reads args)


def compute_turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
    bootstrap_value: float | torch.Tensor = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the turns of one trajectory or of a padded batch.

    rewards, values, dones: [T] or [N, T] (padded at the end); values[t] = V(s_t) at turn t's last prompt token;
    dones[t] = 1 where the task ended the episode at turn t (0 where the step limit cut it). mask: [N, T] (or [T]),
    1 on real turns (None: all real). bootstrap_value: scalar or [N], V of the state after each trajectory's last
    real turn; it counts only where that turn is not done.

        delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_t) - V(s_t)     (V(s_{t+1}) = bootstrap after the last turn)
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1}       = sum_k (gamma lam)^k delta_{t+k}
        R_t     = A_t + V(s_t)                                         (the critic's target)

    Returns (advantages, returns), shaped like rewards, 0 on padding.
    """
    if rewards.shape != values.shape or rewards.shape != dones.shape:
        raise ValueError(f"rewards, values, dones differ in shape: {rewards.shape}, {values.shape}, {dones.shape}")
    single = rewards.dim() == 1
    if single:
        rewards, values, dones = rewards[None], values[None], dones[None]
        mask = None if mask is None else mask[None]
    if rewards.dim() != 2:
        raise ValueError(f"expected [T] or [N, T] tensors, got {tuple(rewards.shape)}")
    n, horizon = rewards.shape
    rewards, values, dones = rewards.float(), values.float(), dones.float()
    mask = torch.ones_like(rewards) if mask is None else mask.float()
    boot = torch.as_tensor(bootstrap_value, dtype=torch.float32, device=rewards.device).expand(n)
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros(n, device=rewards.device)
    for t in reversed(range(horizon)):
        if t == horizon - 1:
            next_value = boot
        else:
            # the step after the last real turn is padding: its value is the bootstrap, its advantage 0
            next_value = torch.where(mask[:, t + 1] > 0, values[:, t + 1], boot)
            next_adv = next_adv * mask[:, t + 1]
        nonterminal = 1.0 - dones[:, t]
        delta = rewards[:, t] + gamma * next_value * nonterminal - values[:, t]
        next_adv = (delta + gamma * lam * nonterminal * next_adv) * mask[:, t]
        advantages[:, t] = next_adv
    returns = (advantages + values) * mask
    if single:
        return advantages[0], returns[0]
    return advantages, returns


def compute_token_gae(
    token_rewards: torch.Tensor, token_values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response tokens of ONE turn, the turn being an episode that ends after its last token.

    token_rewards, token_values: [L]; token_values[k] = V of the state before response token k (k = 0: the last
    prompt token). delta_k = r_k + gamma V_{k+1} - V_k (V_L = 0), A_k = sum_j (gamma lam)^j delta_{k+j}.
    verl-agent's multi-turn PPO puts the episode return R on the last token with gamma = lam = 1, so A_k = R - V_k.
    Returns (advantages, returns = A + V), both [L].
    """
    advantages = torch.zeros(token_rewards.shape[0])
    next_adv, next_value = 0.0, 0.0
    for k in reversed(range(token_rewards.shape[0])):
        delta = token_rewards[k] + gamma * next_value - token_values[k]
        next_adv = delta + gamma * lam * next_adv
        advantages[k] = next_adv
        next_value = token_values[k]
    return advantages, advantages + token_values.float()


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over all elements (population variance). One element gives 0."""
    if x.numel() == 0:
        return x
    return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + eps)


def last_prompt_token_values(values: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """values: [B, T] critic output on right-padded rows (prompt first); prompt_lengths: [B].
    Returns [B]: V at position prompt_len - 1, the last prompt token (the state the turn's response starts from)."""
    if (prompt_lengths < 1).any() or (prompt_lengths > values.shape[1]).any():
        raise ValueError("prompt lengths must lie in [1, T]")
    return values.gather(1, (prompt_lengths.long() - 1).unsqueeze(1)).squeeze(1)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """Per element: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) (same shapes in and out)."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> Optional[float]:
    """1 - Var(R - V) / Var(R) (1: perfect critic, 0: no better than a constant); None when Var(R) = 0."""
    if returns.numel() < 2 or returns.var(unbiased=False).item() == 0:
        return None
    return 1.0 - ((returns - values).var(unbiased=False) / returns.var(unbiased=False)).item()


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


# Script plumbing: timing, rollout, critic values, training rows, update, evaluation (these read args)


@contextmanager
def timed(metrics: dict, key: str):
    """Adds the seconds spent in the `with` block to metrics[key]."""
    start = time.perf_counter()
    yield
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


@distributed.full_weights  # torchrun: the full weights on every rank while it generates (no collectives)
def rollout(
    model, generator, tokenizer, envs, task_seeds, group_size, args, *, sampler, iteration, temperature, metrics,
    autocast,
) -> list[Trajectory]:  # fmt: skip
    """Play len(task_seeds) x group_size episodes in lockstep (same seed = same task), one batched generate per turn
    (temperature 0: greedy); adds the generated tokens and the generation seconds to metrics["gen_tokens", "gen_s"].
    A truncated episode also records the prompt its next turn would have had (the critic's bootstrap state)."""
    short = models.is_tiny(args.model_name)  # the tiny model's short prompt form
    by_number = cenvs.env_module("alfworld").TINY_ANSWER_BY_NUMBER if short else None
    context = getattr(model.config, "max_position_embeddings", None) or 10**9
    max_prompt_tokens = min(args.max_prompt_tokens, context - args.max_new_tokens)
    seeds = cenvs.group_seeds(list(task_seeds), group_size)
    n = len(seeds)
    obs, infos = envs.reset(seeds)
    task_types = [str(info.get("task_type", "")) for info in infos]
    histories: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    turns: list[list[Turn]] = [[] for _ in range(n)]
    next_prompts: list[Optional[list[int]]] = [None] * n
    active = [True] * n

    def encode(i: int) -> list[int]:
        return prompts.encode_prompt(
            tokenizer, infos[i]["task"], obs[i], histories[i], infos[i]["admissible_actions"],
            history_len=args.history_len, short=short, by_number=by_number, max_prompt_tokens=max_prompt_tokens,
        )  # fmt: skip

    while any(active):
        idx = [i for i in range(n) if active[i]]
        batch_prompts = [encode(i) for i in idx]
        with timed(metrics, "gen_s"), autocast():
            gens = generator.generate(model, batch_prompts, temperature=temperature or 1.0, greedy=temperature <= 0)
        metrics["gen_tokens"] = metrics.get("gen_tokens", 0) + sum(len(g.token_ids) for g in gens)
        actions: list[str | None] = [None] * n
        valid = {}
        for k, i in enumerate(idx):
            # the short prompt numbers the admissible actions: an answer "3" is the third of them
            action, valid[i] = prompts.parse_action(gens[k].text, infos[i]["admissible_actions"] if short else None)
            # an unparsable response goes to the env verbatim: it answers as the original does (`Nothing happens.`)
            actions[i] = action if valid[i] else gens[k].text
        next_obs, rewards, dones, next_infos = envs.step(actions)
        for k, i in enumerate(idx):
            truncated = bool(dones[i]) and bool(next_infos[i].get("truncated", False))
            turns[i].append(Turn(
                prompt_ids=batch_prompts[k], response_ids=list(gens[k].token_ids),
                behaviour_logprobs=list(gens[k].logprobs), action=actions[i], valid=valid[i],
                anchor_obs=infos[i]["anchor"], outcome_reward=float(rewards[i]),
                process_reward=float(next_infos[i]["process_reward"]), done=bool(dones[i]), truncated=truncated,
            ))  # fmt: skip
            histories[i].append((obs[i], actions[i]))
            obs[i], infos[i] = next_obs[i], next_infos[i]
            active[i] = not dones[i]
            if truncated:
                next_prompts[i] = encode(i)
    return [
        Trajectory(
            task_seed=seeds[i], group_id=seeds[i], turns=turns[i], won=bool(infos[i]["won"]), task_type=task_types[i],
            outcome_return=args.outcome_scale * float(bool(infos[i]["won"])),
            process_return=float(sum(t.process_reward for t in turns[i])), sampler=sampler, iteration=iteration,
            next_prompt_ids=next_prompts[i],
        )
        for i in range(n)
    ]  # fmt: skip


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


def length_sorted_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Padded micro-batches of indices grouped by similar length (less padding); every index appears once."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [[order[j] for j in chunk] for chunk in pack_by_tokens([lengths[i] for i in order], budget, padded=True)]


def right_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, T] ids (right-padded with pad_id) and attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for k, s in enumerate(seqs):
        ids[k, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[k, : len(s)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
@distributed.full_weights
def critic_values(critic, seqs, prompt_lens, args, *, per_token: bool, pad_id: int, autocast) -> list[torch.Tensor]:
    """Critic values of each sequence (prompt + response, the response may be empty): [1] at the last prompt
    token, or with per_token [len(seq) - prompt_len] before every response token (entry 0 = last prompt token)."""
    device = next(critic.parameters()).device
    out: list[torch.Tensor] = [torch.zeros(0)] * len(seqs)
    for chunk in length_sorted_chunks([len(s) for s in seqs], args.micro_batch_tokens):
        ids, mask = right_pad([seqs[i] for i in chunk], pad_id, device)
        with autocast():
            v = critic(ids, mask).float()
        last = last_prompt_token_values(v, torch.tensor([prompt_lens[i] for i in chunk], device=device)).cpu()
        for k, i in enumerate(chunk):
            out[i] = v[k, prompt_lens[i] - 1 : len(seqs[i]) - 1].cpu() if per_token else last[k : k + 1]
    return out


def ppo_advantages(
    trajectories: list[Trajectory], critic, reward: Literal["outcome", "process"], args, *, pad_id: int, autocast
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per trajectory and turn: token advantages [len(response)] (whitened over the batch's response tokens, then
    the invalid-turn penalty), value targets and the critic's old values ([1] per turn, or per token)."""
    per_token = args.advantage_estimator == "episode_return_token_gae"
    turns = [u for t in trajectories for u in t.turns]
    seqs = [u.prompt_ids + (u.response_ids if per_token else []) for u in turns]
    kw = dict(pad_id=pad_id, autocast=autocast)
    values = iter(critic_values(critic, seqs, [len(u.prompt_ids) for u in turns], args, per_token=per_token, **kw))
    # the per-turn variant bootstraps a truncated trajectory from the state after its last turn
    boot_seqs = [t.next_prompt_ids for t in trajectories if t.turns[-1].truncated and t.next_prompt_ids]
    boot_seqs = [] if per_token else boot_seqs
    boots = iter(critic_values(critic, boot_seqs, [len(s) for s in boot_seqs], args, per_token=False, **kw))

    adv, ret, old_v = [], [], []
    for t in trajectories:
        _, r = turn_rewards([t], reward, args.outcome_scale)
        v_turns = [next(values) for _ in t.turns]
        if per_token:  # verl-agent: each turn is its own episode whose last token earns the whole episode return
            token_rewards = [torch.zeros(len(u.response_ids)) for u in t.turns]
            for x in token_rewards:
                x[-1:] = r.sum()
            a_turns, r_turns = zip(*(compute_token_gae(x, v) for x, v in zip(token_rewards, v_turns)))
            adv.append(list(a_turns))
            ret.append(list(r_turns))
            old_v.append(v_turns)
            continue
        v = torch.cat(v_turns)
        dones = torch.tensor([float(u.done and not u.truncated) for u in t.turns])
        boot = next(boots).item() if t.turns[-1].truncated and t.next_prompt_ids else 0.0
        a, rt = compute_turn_gae(r, v, dones, args.gamma, args.gae_lambda, bootstrap_value=boot)
        adv.append([a[k].expand(len(u.response_ids)).clone() for k, u in enumerate(t.turns)])
        ret.append(list(rt.split(1)))
        old_v.append(list(v.split(1)))

    if args.norm_adv:  # torchrun: over every rank's tokens
        flat = distributed.across_ranks(whiten, torch.cat([a for traj in adv for a in traj]))
        chunks = iter(flat.split([len(a) for tr in adv for a in tr]))
        adv = [[next(chunks) for _ in traj] for traj in adv]
    for t, a_traj in zip(trajectories, adv):
        for k, turn in enumerate(t.turns):
            if not turn.valid:
                a_traj[k] = a_traj[k] - args.invalid_penalty
    return adv, ret, old_v


@dataclass
class Row:
    """One training row: a turn's prompt + response with its advantages and value targets."""

    input_ids: list[int]
    prompt_len: int
    behaviour_logprobs: list[float]
    advantages: torch.Tensor  # [response_len]
    returns: torch.Tensor  # [1] (value target at the last prompt token) or [response_len] (per token)
    old_values: torch.Tensor  # same shape as returns
    # an explorer turn in the policy's update, its reward swapped: importance-weighted; no KL, entropy or value loss
    swapped: bool
    iteration: int  # the iteration that sampled it
    old_logprobs: Optional[torch.Tensor] = None  # [response_len], filled by prepare_rows
    ref_logprobs: Optional[torch.Tensor] = None
    is_weights: Optional[torch.Tensor] = None


def make_rows(trajectories, advantages, returns, old_values) -> list[Row]:
    """One row per turn with a response (an empty one has no token to train on)."""
    return [
        Row(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids), turn.behaviour_logprobs, a, r, v,
            swapped=traj.process_return is None, iteration=traj.iteration)
        for traj, a_traj, r_traj, v_traj in zip(trajectories, advantages, returns, old_values)
        for turn, a, r, v in zip(traj.turns, a_traj, r_traj, v_traj)
        if turn.response_ids
    ]  # fmt: skip


def collate(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded [b, T] ids and mask; [b, T-1] response mask and per-token fields (position t predicts t+1);
    value_mask [b, T-1]: where the value loss reads the critic (the last prompt token, or every response position);
    swapped [b, 1]."""
    b, width = len(rows), max(len(r.input_ids) for r in rows)
    per_token = {
        "behaviour": "behaviour_logprobs", "old": "old_logprobs", "ref": "ref_logprobs", "w": "is_weights",
        "advantages": "advantages",
    }  # fmt: skip
    out = {key: torch.zeros((b, width - 1)) for key in (*per_token, "returns", "old_values")}
    out["response_mask"] = torch.zeros((b, width - 1), dtype=torch.bool)
    out["value_mask"] = torch.zeros((b, width - 1), dtype=torch.bool)
    for k, r in enumerate(rows):
        n, s, m = len(r.input_ids), r.prompt_len - 1, len(r.returns)
        out["response_mask"][k, s : n - 1] = True
        for key, field in per_token.items():
            if getattr(r, field) is not None:
                out[key][k, s : n - 1] = torch.as_tensor(getattr(r, field), dtype=torch.float32)
        out["value_mask"][k, s : s + m] = True
        out["returns"][k, s : s + m] = r.returns
        out["old_values"][k, s : s + m] = r.old_values
    out["swapped"] = torch.tensor([r.swapped for r in rows]).unsqueeze(1)
    ids, mask = right_pad([r.input_ids for r in rows], pad_id, device)
    return {"input_ids": ids, "attention_mask": mask, **{k: v.to(device) for k, v in out.items()}}


@torch.no_grad()
@distributed.full_weights
def prepare_rows(model, ref_model, rows: list[Row], args, *, pad_id: int, autocast) -> None:
    """Fill each row's old log-probs (the model before its update), reference log-probs and truncated IS weights."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    for chunk in length_sorted_chunks([len(r.input_ids) for r in rows], args.micro_batch_tokens):
        b = collate([rows[i] for i in chunk], pad_id, device)
        ids, attention, response = b["input_ids"], b["attention_mask"], b["response_mask"]
        with autocast():
            old, _ = token_logprobs(model, ids, attention, args.temperature, response_mask=response)
            ref, _ = token_logprobs(ref_model, ids, attention, args.temperature, response_mask=response)
        w = truncated_importance_weights(old, b["behaviour"], args.is_cap, b["swapped"])
        for k, i in enumerate(chunk):
            m = response[k]
            rows[i].old_logprobs, rows[i].ref_logprobs = old[k][m].cpu(), ref[k][m].cpu()
            rows[i].is_weights = w[k][m].cpu()
    model.train(was_training)


class NonFiniteLoss(RuntimeError):
    """A non-finite loss, or weights that an optimiser step made non-finite: the update stops before using them."""


def finite_weights(model: torch.nn.Module) -> bool:
    """True when the sum of the squared weights is finite in float32, i.e. every |w| is below ~1.8e19: a learning
    rate that blows up gives weights whose next forward pass overflows even while they are finite themselves."""
    total = torch.stack([p.detach().float().square().sum() for p in model.parameters()]).sum()  # FSDP: all shards
    return bool(torch.isfinite(total))


def update(model, optimizer, critic, critic_optimizer, rows, args, *, epochs, pad_id, autocast) -> dict[str, float]:
    """PPO update: epochs x token-budget minibatches (one AdamW step each for policy and critic) x micro-batches.

    Policy loss per minibatch = sum(policy token losses) / n_response_tokens
                                + kl_coef * sum(k3 KL) / n_own_tokens - ent_coef * sum(entropy) / n_own_tokens;
    value loss per minibatch  = sum(clipped value losses) / n_value_targets, over the own rows only
    (own = not swapped: swapped explorer turns train the policy, not its critic).
    """
    device = next(model.parameters()).device
    model.train()
    critic.train()
    sums: dict[str, float] = defaultdict(float)  # loss sums and token counts over the update
    trained_tokens = 0
    for _ in range(epochs):
        order = torch.randperm(len(rows)).tolist()
        # torchrun: every rank steps as often (None: a padding step) and the token means are over all ranks' tokens
        minibatches = pack_by_tokens([len(rows[i].input_ids) for i in order], args.minibatch_tokens, padded=False)
        for minibatch in distributed.steps(minibatches):
            mb_rows = [rows[order[i]] for i in minibatch or []]
            n_tokens = distributed.token_divisor(sum(len(r.input_ids) - r.prompt_len for r in mb_rows))
            n_own = distributed.token_divisor(sum(len(r.input_ids) - r.prompt_len for r in mb_rows if not r.swapped))
            n_values = distributed.sum_all(sum(len(r.returns) for r in mb_rows if not r.swapped))
            optimizer.zero_grad(set_to_none=True)
            critic_optimizer.zero_grad(set_to_none=True)
            # gradient accumulation does not depend on the order of the micro-batches: group similar lengths
            micro_batches = length_sorted_chunks([len(r.input_ids) for r in mb_rows], args.micro_batch_tokens)
            for chunk in distributed.steps(micro_batches):
                if chunk is None:
                    distributed.zero_backward(model)
                    if n_values > 0:
                        distributed.zero_backward(critic)
                    continue
                b = collate([mb_rows[i] for i in chunk], pad_id, device)
                mask, own_row = b["response_mask"], ~b["swapped"].squeeze(1)  # [b, T-1] and [b]
                with autocast():
                    logprobs, entropy = token_logprobs(
                        model, b["input_ids"], b["attention_mask"], args.temperature, with_entropy=args.ent_coef != 0,
                        response_mask=mask,
                    )  # fmt: skip
                weights = b["w"] if args.off_policy_correction == "tis" else torch.ones_like(b["w"])
                pg_sum, n_clipped = policy_loss(
                    logprobs, b["old"], b["advantages"], mask, weights, clip_coef=args.clip_coef,
                    dual_clip=args.dual_clip,
                )  # fmt: skip
                own = (mask & own_row[:, None]).float()
                kl_sum = (kl_k3(logprobs, b["ref"]) * own).sum()
                ent_sum = (entropy * own).sum() if entropy is not None else torch.zeros((), device=device)
                loss = pg_sum / n_tokens + args.kl_coef * kl_sum / n_own - args.ent_coef * ent_sum / n_own
                if not torch.isfinite(loss):
                    raise NonFiniteLoss(f"policy loss = {loss.item()}")
                loss.backward()
                if n_values > 0 and bool(own_row.any()):
                    with autocast():
                        values = critic(b["input_ids"][own_row], b["attention_mask"][own_row]).float()[:, :-1]
                    vm = b["value_mask"][own_row]
                    vf_sum = clipped_value_loss(
                        values[vm], b["old_values"][own_row][vm], b["returns"][own_row][vm], args.vf_clip
                    ).sum()
                    if not torch.isfinite(vf_sum):
                        raise NonFiniteLoss(f"value loss = {vf_sum.item()}")
                    (vf_sum / n_values * distributed.world_size()).backward()  # FSDP averages over the ranks
                    sums["value_loss"] += vf_sum.item()
                    sums["values"] += int(vm.sum())
                elif n_values > 0:
                    distributed.zero_backward(critic)  # torchrun: no own row here, another rank's critic steps
                with torch.no_grad():
                    log_ratio = (logprobs - b["old"])[mask]
                    approx_kl = (torch.exp(log_ratio) - 1 - log_ratio).sum()
                for key, x in (("policy_loss", pg_sum), ("kl", kl_sum), ("entropy", ent_sum), ("clip", n_clipped),
                               ("approx_kl", approx_kl), ("tokens", mask.sum()), ("own", own.sum())):  # fmt: skip
                    sums[key] += x.item()
                trained_tokens += int(b["attention_mask"].sum())
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            if n_values > 0:
                torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
                critic_optimizer.step()
            for name, m in (("policy", model), ("critic", critic)):
                if not finite_weights(m):
                    raise NonFiniteLoss(f"an optimiser step made the {name}'s weights non-finite")
    sums, trained_tokens, n_rows = distributed.sum_all((sums, trained_tokens, len(rows)))  # torchrun: all ranks'
    n = max(1, sums["tokens"])
    stats = {
        "policy_loss": sums["policy_loss"] / n, "clip_frac": sums["clip"] / n, "approx_kl": sums["approx_kl"] / n,
        "trained_tokens": trained_tokens, "update_rows": n_rows,
    }  # fmt: skip
    if sums["own"]:
        stats["kl"] = sums["kl"] / sums["own"]
        if args.ent_coef != 0:
            stats["entropy"] = sums["entropy"] / sums["own"]
    if sums["values"]:
        stats["value_loss"] = sums["value_loss"] / sums["values"]
    own_rows = distributed.gather([(r.old_values, r.returns) for r in rows if not r.swapped])  # torchrun: all ranks'
    if own_rows:
        ev = explained_variance(torch.cat([v for v, _ in own_rows]), torch.cat([ret for _, ret in own_rows]))
        if ev is not None:
            stats["explained_variance"] = ev
    return stats


@distributed.full_weights
def evaluate(model, generator, tokenizer, make_envs, seeds, args, iteration, *, autocast) -> dict[str, float]:
    """Held-out episodes (one per seed) at --eval-temperature: success rate with its 95% interval, and per task type."""
    trajs: list[Trajectory] = []
    seeds = distributed.split(seeds)  # torchrun: each rank plays its share of the seeds
    for start in range(0, len(seeds), args.eval_batch_size):
        chunk = seeds[start : start + args.eval_batch_size]
        trajs += rollout(
            model, generator, tokenizer, make_envs(len(chunk)), chunk, 1, args, sampler="policy", iteration=-1,
            temperature=args.eval_temperature, metrics={}, autocast=autocast,
        )  # fmt: skip
    trajs = distributed.gather(trajs)
    success, success_ci = run.mean_ci95([float(t.won) for t in trajs])
    metrics = {"eval/success_rate": success, "eval/success_ci95": success_ci}
    for task_type in sorted({t.task_type for t in trajs if t.task_type}):
        metrics[f"eval/success_{task_type}"] = float(np.mean([t.won for t in trajs if t.task_type == task_type]))
    print(f"iter {iteration}: eval ({args.eval_split}) success {success:.3f} +- {success_ci:.3f} ({len(trajs)} tasks)")
    return metrics


def nonzero_outcome_group_share(trajectories: list[Trajectory], task_seeds: Sequence[int]) -> float:
    """Share of the tasks with at least one success among `trajectories`: PPO has no group baseline, so GRPO's
    "the group's advantages are not all zero" becomes "the task has an outcome signal beyond the critic's"."""
    won = {s: False for s in task_seeds}
    for t in trajectories:
        if t.task_seed in won:
            won[t.task_seed] = won[t.task_seed] or t.outcome_return != 0
    return sum(won.values()) / max(1, len(won))


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


if __name__ == "__main__":
    args = tyro.cli(Args)
    # torchrun: join the process group; each rank takes its GPU (or the CPU with gloo)
    device = distributed.init(torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu"))
    swap = args.reward_mode == "swap"
    args.num_policy_rollouts = args.tasks_per_iteration * args.group_size
    args.num_explorer_rollouts = args.tasks_per_iteration * args.explorer_rollouts_per_task if swap else 0
    run_name = f"alfworld__{args.exp_name}__{args.seed}__{int(time.time())}"
    # A mistake in the flags, the models, the env's data or the --resume run ends here, in one line, before any
    # file is written (Run checks that --resume names a readable checkpoint of a run with these flags).
    try:
        if args.train_pool_size < args.tasks_per_iteration:
            raise run.BadInput(f"--train-pool-size ({args.train_pool_size}) must be >= --tasks-per-iteration")
        run.check_args(
            args,
            at_least_one=(
                "max_steps", "max_prompt_tokens", "generation_batch_size", "max_new_tokens", "num_iterations",
                "tasks_per_iteration", "group_size", "update_epochs", "minibatch_tokens", "micro_batch_tokens",
                "num_eval_tasks", "eval_batch_size", "checkpoint_every",
            ) + (("explorer_rollouts_per_task", "buffer_capacity") if swap else ()),
            positive=("temperature", "vf_clip", "max_grad_norm", "is_cap"),
            at_most_one=("gamma", "gae_lambda"),
        )  # fmt: skip
        models.check_model_name(args.model_name)
        if args.critic_model_name is not None:
            models.check_model_name(args.critic_model_name, flag="--critic-model-name")
        models.check_lora(args.lora_rank, args.critic_model_name)
        cenvs.check_backend("alfworld", args.env_backend)
        distributed.check(args.tasks_per_iteration, args.rollout_backend)
        logger = run.Run(args, run_name, runs_dir=args.runs_dir, resume=args.resume)
    except run.BadInput as err:
        raise SystemExit(str(err)) from None
    run.seed_everything(args.seed + distributed.rank(), args.torch_deterministic)  # torchrun: each rank samples its own

    def autocast():  # bf16 autocast on CUDA, fp32 on the CPU: the same code path on both
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def fallback(value, default):  # an unset (None) explorer flag takes the policy's value
        return default if value is None else value

    # Models: the policy and its critic, the frozen reference (the initial policy), and in swap mode agent B with
    # its own value head (trained on process returns, never synced from the policy's critic)
    load_kw = dict(env_name="alfworld", preset=args.env_preset, seed=args.tiny_seed, device=device)
    policy, tokenizer = models.load_model(args.model_name, **load_kw)
    # LoRA (--lora-rank > 0): policy, agent B and their critics are adapters on one frozen base, the KL reference
    critics = ("critic", "explorer_critic")
    policy, explorer, ref_model, lora = models.policy_explorer_reference(
        policy, device, explorer=swap, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, extra_adapters=critics
    )
    if lora is not None:
        critic, explorer_critic = (models.Critic(models.AdapterView(lora, n)) for n in critics)
    else:  # build_critic draws its value head's initial weights (the copies above draw nothing: the same weights)
        critic = models.build_critic(policy, args.critic_model_name, **load_kw).to(device)
        explorer_critic = models.build_critic(policy, args.critic_model_name, **load_kw).to(device) if swap else None
    modules = {"policy": policy, "critic": critic, "ref": ref_model}
    base_lr = {"policy": args.learning_rate, "critic": args.critic_learning_rate}
    if swap:
        modules.update(explorer=explorer, explorer_critic=explorer_critic)
        base_lr["explorer"] = fallback(args.explorer_learning_rate, args.learning_rate)
        base_lr["explorer_critic"] = fallback(args.explorer_critic_learning_rate, args.critic_learning_rate)
    distributed.shard(*modules.values())  # torchrun: FSDP2, before the optimisers (they step the shards)
    optimizers = {k: torch.optim.AdamW(modules[k].parameters(), lr=lr) for k, lr in base_lr.items()}
    explorer_epochs = fallback(args.explorer_update_epochs, args.update_epochs)
    buffer = ReplayBuffer(args.buffer_capacity, args.buffer_max_age)
    # vLLM starts from a save_pretrained folder of the initial policy (--model-name may be "tiny", not a folder);
    # later weights are pushed into it by the generator.
    generator = generation.make_generator(
        args.rollout_backend, tokenizer, max_new_tokens=args.max_new_tokens, batch_size=args.generation_batch_size,
        model=policy, engine_dir=logger.dir / "rollout_model",
    )  # fmt: skip
    pad_id = tokenizer.pad_token_id

    @functools.cache
    def make_envs(n: int) -> cenvs.LockstepEnvs:  # one set of n lockstep envs, reused for every batch of n
        return cenvs.LockstepEnvs(
            "alfworld", n, backend=args.env_backend, preset=args.env_preset, max_steps=args.max_steps,
            process_reward=args.process_reward,
        )  # fmt: skip

    train_pool, eval_seeds = cenvs.seed_pools(
        "alfworld", args.train_pool_size, args.num_eval_tasks, backend=args.env_backend, eval_split=args.eval_split
    )

    # Resume (eval-only reads the policy alone: a checkpoint of any reward mode can be evaluated)
    start_iteration, env_steps = 1, 0
    if args.resume:
        state = logger.load_checkpoint(*(({"policy": policy}, {}) if args.eval_only else (modules, optimizers)))
        if not state:
            raise SystemExit(f"--resume {args.resume}: no checkpoint found in that run folder")
        loop_state = state["extra"]  # what the loop saves beside the models: env steps and the replay buffer
        start_iteration, env_steps = state["iteration"] + 1, loop_state["env_steps"]
        if not args.eval_only:
            buffer.load_state_dict(loop_state["buffer"])
        print(f"resumed from {args.resume} at iteration {state['iteration']} ({env_steps} env steps)")
    run_eval = functools.partial(evaluate, policy, generator, tokenizer, make_envs, eval_seeds, args, autocast=autocast)
    if args.eval_only:
        it = start_iteration - 1
        logger.log({"iteration": it, "env_steps": env_steps, **run_eval(it)}, step=it)
        logger.close()
        raise SystemExit(0)
    if args.eval_at_start and start_iteration == 1:
        logger.log({"iteration": 0, "env_steps": 0, **run_eval(0)}, step=0)

    def train_explorer(trajectories: list[Trajectory]) -> tuple[list[Row], dict[str, float]]:
        """Agent B's PPO step on the process reward, its own value head giving the values."""
        adv, ret, old_v = ppo_advantages(trajectories, explorer_critic, "process", args, pad_id=pad_id,
                                         autocast=autocast)  # fmt: skip
        rows = make_rows(trajectories, adv, ret, old_v)
        prepare_rows(explorer, ref_model, rows, args, pad_id=pad_id, autocast=autocast)
        stats = update(
            explorer, optimizers["explorer"], explorer_critic, optimizers["explorer_critic"], rows, args,
            epochs=explorer_epochs, pad_id=pad_id, autocast=autocast,
        )  # fmt: skip
        return rows, stats

    policy_reward = "process" if args.reward_mode == "process" else "outcome"
    try:
        for iteration in run.progress(range(start_iteration, args.num_iterations + 1), desc="iterations"):
            warmup = min(1.0, iteration / args.warmup_iterations) if args.warmup_iterations > 0 else 1.0
            for name, opt in optimizers.items():
                for group in opt.param_groups:
                    group["lr"] = base_lr[name] * warmup
            metrics: dict[str, float] = {"iteration": iteration}

            # ROLLOUT: B tasks x G_on policy rollouts; in swap mode agent B then plays the same tasks G_off times
            task_seeds = distributed.split(random.sample(train_pool, args.tasks_per_iteration))  # torchrun: a share
            with timed(metrics, "perf/rollout_s"):
                batch = rollout(
                    policy, generator, tokenizer, make_envs(len(task_seeds) * args.group_size), task_seeds,
                    args.group_size, args, sampler="policy", iteration=iteration, temperature=args.temperature,
                    metrics=metrics, autocast=autocast,
                )  # fmt: skip
            env_steps += distributed.sum_all(sum(len(t.turns) for t in batch))
            train_trajectories, one_step_rows = batch, []
            if swap:
                with timed(metrics, "perf/update_s"):
                    if args.explorer == "one_step":  # the comparison: a fresh copy, one step on the policy's batch
                        explorer.load_state_dict(policy.state_dict())
                        one_step_rows, explorer_stats = train_explorer(batch)
                    elif args.explorer_sync_every > 0 and (iteration - 1) % args.explorer_sync_every == 0:
                        explorer.load_state_dict(policy.state_dict())  # back within reach of the importance weights
                with timed(metrics, "perf/rollout_s"):
                    explorer_trajectories = rollout(
                        explorer, generator, tokenizer, make_envs(len(task_seeds) * args.explorer_rollouts_per_task),
                        task_seeds, args.explorer_rollouts_per_task, args, sampler="explorer", iteration=iteration,
                        temperature=args.temperature, metrics=metrics, autocast=autocast,
                    )  # fmt: skip
                metrics["explorer/env_steps"] = distributed.sum_all(sum(len(t.turns) for t in explorer_trajectories))
                env_steps += metrics["explorer/env_steps"]

                # THE SWAP: agent B's trajectories keep only their outcome reward; the buffered ones of this
                # iteration's tasks join the policy's batch
                buffer.add(swap_rewards(explorer_trajectories), iteration)
                train_trajectories = batch + buffer.sample(task_seeds, iteration, args.buffer_extra_other_tasks)
                metrics["buffer/size"] = distributed.sum_all(len(buffer))
                metrics["buffer/sampled"] = distributed.sum_all(len(train_trajectories) - len(batch))

            with timed(metrics, "perf/update_s"):
                # ADVANTAGES: turn-level GAE with the POLICY's critic, for its own and the swapped turns alike
                adv, ret, old_v = ppo_advantages(
                    train_trajectories, critic, policy_reward, args, pad_id=pad_id, autocast=autocast
                )

                # UPDATE: agent B on its own rollouts with the process reward, then the policy on the outcome reward
                # (the process reward in --reward-mode process)
                if swap and args.explorer == "agent_b":
                    _, explorer_stats = train_explorer(explorer_trajectories)
                rows = make_rows(train_trajectories, adv, ret, old_v)
                # one_step: the explorer had the policy's weights when it prepared its rows of the batch (the first
                # rows here): its old and reference log-probs are the policy's
                for row, shared in zip(rows, one_step_rows):
                    assert row.input_ids == shared.input_ids
                    row.old_logprobs, row.ref_logprobs = shared.old_logprobs, shared.ref_logprobs
                    row.is_weights = torch.ones_like(shared.old_logprobs)
                prepare_rows(policy, ref_model, rows[len(one_step_rows) :], args, pad_id=pad_id, autocast=autocast)
                swapped_rows = distributed.gather([r for r in rows if r.swapped])  # torchrun: all ranks'
                metrics.update(explorer_distance_metrics(swapped_rows, iteration, tokenizer))
                policy_stats = update(
                    policy, optimizers["policy"], critic, optimizers["critic"], rows, args, epochs=args.update_epochs,
                    pad_id=pad_id, autocast=autocast,
                )  # fmt: skip

            # LOG: the training curve is the policy's own rollouts
            if distributed.active():  # torchrun: every rank's rollouts and tasks
                batch, train_trajectories, task_seeds = (
                    distributed.gather(x) for x in (batch, train_trajectories, task_seeds)
                )
                explorer_trajectories = distributed.gather(explorer_trajectories) if swap else []
            outcome, process = [t.outcome_return for t in batch], [t.process_return for t in batch]
            trained_tokens = policy_stats["trained_tokens"] + (explorer_stats["trained_tokens"] if swap else 0)
            metrics.update(
                {
                    "env_steps": env_steps,
                    "train/success_rate": float(np.mean([t.won for t in batch])),
                    "train/outcome_return": float(np.mean(outcome)),
                    "train/process_return": float(np.mean(process)),
                    "train/episode_length": float(np.mean([len(t.turns) for t in batch])),
                    "train/invalid_turn_rate": float(np.mean([not u.valid for t in batch for u in t.turns])),
                    "train/truncated_rate": float(np.mean([t.turns[-1].truncated for t in batch])),
                    "train/nonzero_adv_groups_before_swap": nonzero_outcome_group_share(batch, task_seeds),
                    "charts/learning_rate": optimizers["policy"].param_groups[0]["lr"],
                    "perf/gen_tokens_per_s": metrics.pop("gen_tokens") / max(metrics.pop("gen_s"), 1e-9),
                    "perf/train_tokens_per_s": trained_tokens / max(metrics["perf/update_s"], 1e-9),
                }
            )
            losses = {k: v for k, v in policy_stats.items() if k not in ("trained_tokens", "update_rows")}
            metrics.update({f"losses/{k}": v for k, v in losses.items()})
            if swap:
                after = nonzero_outcome_group_share(train_trajectories, task_seeds)
                metrics["train/nonzero_adv_groups_after_swap"] = after
                metrics.update({f"explorer/{k}": v for k, v in explorer_stats.items() if k != "trained_tokens"})
                metrics["explorer/success_rate"] = float(np.mean([t.won for t in explorer_trajectories]))
                metrics["explorer/process_return"] = float(np.mean([t.process_return for t in explorer_trajectories]))
            corr = pearson(process, outcome)
            if corr is not None:
                metrics["train/process_outcome_corr"] = corr
            last = iteration == args.num_iterations or 0 < args.total_env_steps <= env_steps
            if last or (args.eval_every > 0 and iteration % args.eval_every == 0):
                metrics.update(run_eval(iteration))
            logger.log(metrics, step=iteration)

            # SAVE (the checkpoint's `extra`: env steps and the replay buffer)
            if last or iteration % args.checkpoint_every == 0:
                loop_state = {"env_steps": env_steps, "buffer": buffer.state_dict()}
                logger.save_checkpoint(iteration, modules, optimizers, extra=loop_state)
            if last:
                break
    except NonFiniteLoss as err:
        # Nothing is saved: the weights (and in swap mode the explorer and the buffer) hold the failed iteration.
        path = logger.checkpoint_dir / run.CHECKPOINT_NAME
        kept = f"the last good checkpoint is kept: {path}" if path.is_file() else "no checkpoint was written"
        raise SystemExit(f"training diverged at iteration {iteration} ({err}); {kept}") from None

    if args.save_model:
        distributed.save_pretrained(logger.dir / "model", policy, tokenizer)  # torchrun: rank 0, the full weights
        distributed.save_state_dict(critic, logger.dir / "critic.pt")
    logger.close()
    distributed.close()  # torchrun: every rank waits for rank 0's files, leaves the process group and exits
