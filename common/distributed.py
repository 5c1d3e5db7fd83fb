"""Data parallelism under torchrun: FSDP2 sharding, the task split, reductions, DCP checkpoints.

`torchrun --nproc_per_node N rspo_x.py ...` starts N processes (ranks). Every rank holds a shard of each model
(FSDP2's `fully_shard`), plays its share of the iteration's tasks (each task's whole group on one rank, so group
advantages are the single-process ones), and takes part in every optimiser step: the gradients of all ranks are
averaged by FSDP's reduce-scatter, and the scripts divide each rank's summed token losses by `token_divisor` so
that the step follows the token-mean over the global minibatch. Rank 0 alone writes the run folder.

One process (WORLD_SIZE unset or 1) is the default: then no process group exists and every helper here is the
identity or the plain single-process operation, so the scripts' one-process path is unchanged.

Generation under FSDP2: each forward pass all-gathers every layer's shards, a collective that needs all ranks,
but ranks generate for different numbers of turns and tokens. Inside `gathered(model)` every FSDP module is
unsharded once (all ranks together) and kept whole, so that generation and other passes without gradients run
any number of times on each rank without communication; transformers must not synchronise the ranks' decoding
either (common/generation.py passes synced_gpus=False). The update's forward and backward passes stay sharded,
so every rank runs as many of them as the busiest rank: `steps` pads a rank's list of minibatches or
micro-batches with None, for which `zero_backward` runs a pass that adds nothing to the gradients.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import os
import pathlib
import shutil
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_MESH = None  # the 1-D device mesh of all ranks (set by init)
_DEVICE = torch.device("cpu")  # where this rank's collectives put their tensors (gloo: CPU, NCCL: its GPU)


# ---------------------------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------------------------
def init(device: torch.device) -> torch.device:
    """Join torchrun's process group when it started more than one process; returns this rank's device.

    torchrun sets WORLD_SIZE, RANK, LOCAL_RANK and the rendezvous address. On CUDA each rank takes GPU LOCAL_RANK
    and NCCL; on the CPU, gloo. The other ranks' print() is silenced (rank 0 prints the run's progress once; pass
    force=True to print from any rank); errors still show. Without torchrun (or with one process) nothing happens
    and `device` is returned.
    """
    global _MESH, _DEVICE
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    _MESH = init_device_mesh(device.type, (dist.get_world_size(),))
    _DEVICE = device
    if dist.get_rank() != 0:
        builtin_print = builtins.print

        def rank_print(*args, force: bool = False, **kwargs):
            if force:
                builtin_print(*args, **kwargs)

        builtins.print = rank_print
    return device


def active() -> bool:
    """True under torchrun with more than one process (after init)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """True on the rank that writes the run folder (rank 0; the only process without torchrun)."""
    return rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def close() -> None:
    """End a script under torchrun: once every rank has got here (rank 0 has written the run folder), leave the
    process group and end this process at once, with exit code 0. Without torchrun, nothing.

    Why end the process here: a torchrun rank that went on into the interpreter's normal shutdown aborted now and
    then in CI ("terminate called without an active exception", SIGABRT), after its work was done and even after
    destroy_process_group; torchrun then fails the whole run. That message is a C++ thread object destroyed while
    its thread still runs, which happens in the native libraries' teardown, not in this code. Everything a rank
    owns is written and closed by then, so os._exit skips only that teardown."""
    if active():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ---------------------------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------------------------
def shard(*models: nn.Module | None):
    """Apply FSDP2 to each model (None passes through) and return them: the same objects, now sharded.

    fully_shard goes on each decoder layer (the classes a Hugging Face model lists in `_no_split_modules`), then
    on the base model together with the LM head when the model has one (the scripts call both directly to run the
    head on response positions only; tied embeddings must be in one group), then on the model itself (the root).
    Build optimisers after this (the parameters are replaced by sharded DTensors); copy models before it.
    """
    if not active():
        return models[0] if len(models) == 1 else models
    from torch.distributed.fsdp import fully_shard

    for model in models:
        if model is None:
            continue
        layer_classes = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
        for m in model.modules():
            if type(m).__name__ in layer_classes:
                fully_shard(m, mesh=_MESH)
        base = getattr(model, "base_model", model)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and base is not model:
            fully_shard([base, head], mesh=_MESH)
        fully_shard(model, mesh=_MESH)
        # FSDP takes as root the first module to run forward: make it this one, before a direct call of the base.
        ids = torch.zeros((1, 1), dtype=torch.long, device=_DEVICE)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        for m in _fsdp_modules(model):  # the root keeps its weights whole after a forward: the optimiser needs shards
            m.reshard()
        if not all(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise RuntimeError(f"shard: some parameters of {type(model).__name__} are not sharded")
    return models[0] if len(models) == 1 else models


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(*models: nn.Module | None) -> Iterator[None]:
    """Inside: every rank holds the full weights of these sharded models (None skipped), so that forward passes
    without gradients (generation, old and reference log-probs, evaluation) need no communication and may run a
    different number of times on each rank. Entering and leaving are collective: all ranks at the same place.
    Nothing may change the weights or run backward inside. One process: does nothing. Re-entrant."""
    models = tuple(m for m in models if m is not None and active() and not getattr(m, "_rspo_gathered", False))
    for model in models:
        model._rspo_gathered = True
        for m in _fsdp_modules(model):
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
    try:
        yield
    finally:
        for model in models:
            for m in _fsdp_modules(model):
                m.reshard()
                m.set_reshard_after_forward(m is not model, recurse=False)  # FSDP's default: the root stays whole
            model._rspo_gathered = False


def full_weights(fn):
    """Decorator: `fn` runs inside `gathered(...)` of the sharded models among its arguments (rollouts, no-grad
    log-probs, evaluation: passes without gradients that ranks run different numbers of times). One process: the
    plain call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not active():
            return fn(*args, **kwargs)
        with gathered(*(a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module) and _fsdp_modules(a))):
            return fn(*args, **kwargs)

    return wrapper


def steps(chunks: Sequence) -> list:
    """`chunks` (a rank's minibatches or micro-batches) padded with None to the largest count on any rank: each
    forward and backward of a sharded model is collective, so every rank runs as many. One process: unchanged."""
    chunks = list(chunks)
    if not active():
        return chunks
    n = torch.tensor([len(chunks)], dtype=torch.long, device=_DEVICE)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return chunks + [None] * (int(n.item()) - len(chunks))


def zero_backward(model: nn.Module) -> None:
    """A forward and backward through `model` (a causal LM or a model taking input_ids and attention_mask) whose
    gradients are zero: a rank's padding step (see `steps`) joins FSDP's collectives and adds nothing. One
    process: nothing (no rank waits for it)."""
    if not active():
        return
    ids = torch.zeros((1, 2), dtype=torch.long, device=_DEVICE)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    out = getattr(out, "logits", out)
    (out.float().sum() * 0.0).backward()


# ---------------------------------------------------------------------------------------------------------------
# The task split and reductions
# ---------------------------------------------------------------------------------------------------------------
def split(items: Sequence) -> list:
    """This rank's contiguous share of `items` (rank 0's list, so that every rank splits the same one): rank r of W
    gets items[n r // W : n (r + 1) // W]. Tasks are split whole, so a task's group stays on one rank; `gather`
    puts the shares back in order. One process: all of them."""
    items = list(items)
    if not active():
        return items
    items, r, w = from_main(items), rank(), world_size()
    return items[len(items) * r // w : len(items) * (r + 1) // w]


def gather(items: Sequence) -> list:
    """The lists of all ranks concatenated in rank order (every rank gets the whole list). One process: a copy."""
    items = list(items)
    if not active():
        return items
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def across_ranks(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (e.g. whitening) applied to the concatenation along dim 0 of every rank's x, and this rank's part of the
    result: a statistic over the global batch. One process: fn(x)."""
    if not active():
        return fn(x)
    parts = gather([x.detach().cpu()])
    offset = sum(len(p) for p in parts[: rank()])
    return fn(torch.cat(parts).to(x.device))[offset : offset + len(x)]


def from_main(value):
    """Rank 0's `value` on every rank (e.g. the run folder that rank 0 made). One process: value."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclasses.dataclass
class _Leaf:
    index: int
    is_int: bool


def _skeleton(v):
    """v with every number replaced by a zero of its type (dicts, lists and tuples kept)."""
    if isinstance(v, dict):
        return {k: _skeleton(u) for k, u in v.items()}
    if isinstance(v, (list, tuple)):
        return [_skeleton(u) for u in v]
    return 0 if isinstance(v, int) and not isinstance(v, bool) else 0.0


def _merge(a, b):
    """The union of two skeletons (a dict key missing on one rank counts as 0 there)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {
            **{k: _merge(u, b[k]) if k in b else u for k, u in a.items()},
            **{k: u for k, u in b.items() if k not in a},
        }
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_merge(u, w) for u, w in zip(a, b)]
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        raise ValueError(f"sum_all: the ranks passed different structures ({a!r} and {b!r})")
    return a if isinstance(a, int) and isinstance(b, int) else 0.0


def _fill(v, skeleton):
    """v with the keys of `skeleton` that it lacks (zeros); a dict keeps its type (e.g. a defaultdict)."""
    if isinstance(v, dict):
        items = {k: _fill(v[k], u) if k in v else u for k, u in skeleton.items()}
        return type(v)(v.default_factory, items) if isinstance(v, defaultdict) else type(v)(items)
    if isinstance(v, (list, tuple)):
        return type(v)(_fill(u, w) for u, w in zip(v, skeleton))
    return v


def sum_all(x):
    """Numbers summed over the ranks: a number, a tensor, or a dict / list / tuple of numbers (nested; a dict key
    that some ranks lack counts as 0 there; ints stay ints), in one all-reduce. One process: x itself."""
    if not active():
        return x
    if isinstance(x, torch.Tensor):
        t = x.detach().to(_DEVICE, copy=True)
        dist.all_reduce(t)
        return t.to(x.device)
    if isinstance(x, (dict, list, tuple)):
        skeletons: list[Any] = [None] * world_size()
        dist.all_gather_object(skeletons, _skeleton(x))
        union = skeletons[0]
        for other in skeletons[1:]:
            union = _merge(union, other)
        x = _fill(x, union)
    leaves: list[float] = []

    def flatten(v):  # the same structure with the position in `leaves` (and int-ness) at each number
        if isinstance(v, dict):
            items = {k: flatten(u) for k, u in v.items()}
            return type(v)(v.default_factory, items) if isinstance(v, defaultdict) else type(v)(items)
        if isinstance(v, (list, tuple)):
            return type(v)(flatten(u) for u in v)
        leaves.append(float(v))
        return _Leaf(len(leaves) - 1, isinstance(v, int) and not isinstance(v, bool))

    shape = flatten(x)
    total = torch.tensor(leaves, dtype=torch.float64, device=_DEVICE)
    dist.all_reduce(total)
    values = total.tolist()

    def rebuild(v):
        if isinstance(v, _Leaf):
            return int(round(values[v.index])) if v.is_int else values[v.index]
        if isinstance(v, dict):
            items = {k: rebuild(u) for k, u in v.items()}
            return type(v)(v.default_factory, items) if isinstance(v, defaultdict) else type(v)(items)
        return type(v)(rebuild(u) for u in v)

    return rebuild(shape)


def token_divisor(n: int) -> float:
    """The divisor of a rank's summed token losses for a token-mean over the global minibatch: with the sum N of
    every rank's n, max(1, N) / world size, because FSDP averages the ranks' gradients (so the step follows
    sum of all token losses / N). One process: max(1, n)."""
    if not active():
        return max(1, n)
    return max(1, sum_all(int(n))) / world_size()


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints (torch.distributed.checkpoint)
# ---------------------------------------------------------------------------------------------------------------
def _rank_file(folder: pathlib.Path, r: int) -> pathlib.Path:
    return folder / f"rank{r}.pt"


def save_checkpoint(
    folder: pathlib.Path, modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], state: dict
) -> pathlib.Path:
    """Write a DCP checkpoint: every rank's shards of `modules` and `optimizers` (each optimiser under the key of
    the module it steps; None entries skipped), and this rank's `state` (RNG states, replay buffer, ...) as
    rank{r}.pt. Collective. Written into `folder`.tmp, then renamed, so that a crash keeps the previous one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    folder = pathlib.Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    sharded = {
        "modules": {k: get_model_state_dict(m) for k, m in modules.items() if m is not None},
        "optimizers": {k: get_optimizer_state_dict(modules[k], o) for k, o in optimizers.items() if o is not None},
    }
    dcp.save(sharded, checkpoint_id=str(tmp))
    with open(_rank_file(tmp, rank()), "wb") as f:
        torch.save({**state, "world_size": world_size()}, f)
        f.flush()
        os.fsync(f.fileno())
    barrier()
    if is_main():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return folder


def read_rank_state(folder: pathlib.Path) -> dict:
    """This rank's `state` from a DCP checkpoint folder (rank 0's without torchrun), with "world_size"."""
    return torch.load(_rank_file(pathlib.Path(folder), rank()), map_location="cpu", weights_only=False)


def load_checkpoint(
    folder: pathlib.Path, modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]
) -> dict:
    """Restore `modules` and `optimizers` (in place, as sharded now) from a DCP checkpoint folder; returns this
    rank's `state`. Collective. The world size must be the one that wrote it (checked by the caller)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sharded = {
        "modules": {k: get_model_state_dict(m) for k, m in modules.items() if m is not None},
        "optimizers": {k: get_optimizer_state_dict(modules[k], o) for k, o in optimizers.items() if o is not None},
    }
    dcp.load(sharded, checkpoint_id=str(folder))
    for k, m in modules.items():
        if m is not None:
            set_model_state_dict(m, sharded["modules"][k])
    for k, o in optimizers.items():
        if o is not None:
            set_optimizer_state_dict(modules[k], o, sharded["optimizers"][k])
    return read_rank_state(folder)


def save_state_dict(module: nn.Module, path: pathlib.Path) -> None:
    """torch.save(module.state_dict(), path); under torchrun rank 0 writes the full weights gathered from the
    shards (collective)."""
    if not active():
        torch.save(module.state_dict(), path)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main():
        torch.save(full, path)
    barrier()


def save_pretrained(folder: pathlib.Path, *objects) -> None:
    """obj.save_pretrained(folder) for each model or tokenizer; under torchrun rank 0 writes, a sharded model's full
    weights gathered from the shards (collective)."""
    for obj in objects:
        if active() and isinstance(obj, nn.Module):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(obj, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if is_main():
                obj.save_pretrained(folder, state_dict=full)
        elif is_main():
            obj.save_pretrained(folder)
    barrier()


def check(tasks_per_iteration: int, rollout_backend: str = "hf") -> None:
    """common.run.BadInput when a run cannot be split over this many processes: fewer tasks per iteration than
    ranks (each rank plays whole tasks), or the vLLM backend (its engine holds the full weights itself; not wired
    to FSDP). One process: nothing to check."""
    from common.run import BadInput

    if not active():
        return
    if tasks_per_iteration < world_size():
        raise BadInput(
            f"--tasks-per-iteration {tasks_per_iteration}: must be >= the number of processes ({world_size()}), "
            "each of which plays whole tasks"
        )
    if rollout_backend != "hf":
        raise BadInput(f"--rollout-backend {rollout_backend}: under torchrun only `hf` generation is supported")
