"""Building the benchmark environments by name, their seed pools, and B x G environments stepped in lockstep.

A GRPO-style group is G environments reset with the same seed (same task, same world); B groups make a batch:
`LockstepEnvs(env_name, B * G).reset(group_seeds(task_seeds, G))`. Each turn the script generates one action
for every env that is still active and calls `step` once for all of them.
"""

from __future__ import annotations

import importlib
import operator

ENV_NAMES = ("webshop", "alfworld")
# The held-out split used for evaluation by default: WebShop's test goals, ALFWorld's unseen rooms.
EVAL_SPLIT = {"webshop": "test", "alfworld": "valid_unseen"}


def env_module(env_name: str):
    """The module `envs.<env_name>` (it provides make_env, split_seeds, text_corpus)."""
    if env_name not in ENV_NAMES:
        raise ValueError(f"unknown env {env_name!r}: choose one of {', '.join(ENV_NAMES)}")
    return importlib.import_module(f"envs.{env_name}")


def make_env(env_name: str, backend: str = "embedded", **options):
    """One environment: `envs.<env_name>.make_env(backend=backend, **options)` (options: preset, max_steps, ...)."""
    return env_module(env_name).make_env(backend=backend, **options)


def check_backend(env_name: str, backend: str) -> None:
    """BadInput (one line: what is missing and what to do) when `backend` cannot start here: the real backends
    need their package and data installed. Cheap, so that a script can check before it writes anything."""
    from common.run import BadInput

    problem = env_module(env_name).real_backend_problem() if backend == "real" else None
    if problem:
        raise BadInput(f"--env-backend {backend}: {problem}, or use --env-backend embedded")


def split_seeds(env_name: str, split: str, n: int, backend: str = "embedded") -> list[int]:
    """The first n task seeds of `split` (webshop: "train" | "test"; alfworld: "train" | "valid_seen" |
    "valid_unseen")."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(env_module(env_name).split_seeds(split, n, backend=backend))


# The validation goals start here in the training split, after the goals that any warm start imitated (the tiny
# builder's demonstrations are the first bc_train_seeds = 1,024) and after any training pool up to this size.
VALID_START = 2048


def seed_pools(
    env_name: str, train_pool_size: int, num_eval_tasks: int, backend: str = "embedded", eval_split: str | None = None
) -> tuple[list[int], list[int]]:
    """(train pool, evaluation seeds): the first `train_pool_size` seeds of "train" and the first
    `num_eval_tasks` of `eval_split` (default the held-out EVAL_SPLIT[env_name], disjoint from "train"; "train"
    evaluates on the training goals themselves; "valid" on training goals from VALID_START on (or after the pool,
    if it is larger), never trained on or imitated: the split on which defaults are chosen, so that the held-out
    goals are reported once)."""
    train = split_seeds(env_name, "train", train_pool_size, backend=backend)
    if eval_split == "valid":
        start = max(VALID_START, train_pool_size)
        evaluation = split_seeds(env_name, "train", start + num_eval_tasks, backend=backend)[start:]
        if len(evaluation) < num_eval_tasks:
            raise SystemExit(
                f"--eval-split valid needs {start + num_eval_tasks} training goals of {env_name} ({backend}); "
                f"the split has {start + len(evaluation)}"
            )
    else:
        evaluation = split_seeds(env_name, eval_split or EVAL_SPLIT[env_name], num_eval_tasks, backend=backend)
    return train, evaluation


def group_seeds(task_seeds: list[int], group_size: int) -> list[int]:
    """Each task seed repeated group_size times, groups contiguous: [s0]*G + [s1]*G + ...

    Env i then belongs to group i // group_size."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return [s for s in task_seeds for _ in range(group_size)]


class LockstepEnvs:
    """`num_envs` environments of one benchmark stepped together.

    State per env i: `obs[i]`, `infos[i]` (the last observation and info), `active[i]` (False once the
    episode is done), `steps[i]` (env.step calls in this episode), `seeds[i]` (the seed of this episode).
    """

    def __init__(self, env_name: str, num_envs: int, backend: str = "embedded", **options):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env_name = env_name
        self.backend = backend
        self.options = dict(options)
        self.envs = [make_env(env_name, backend=backend, **options) for _ in range(num_envs)]
        self.obs: list[str] = [""] * num_envs
        self.infos: list[dict] = [{} for _ in range(num_envs)]
        self.active: list[bool] = [False] * num_envs
        self.steps: list[int] = [0] * num_envs
        self.seeds: list[int | None] = [None] * num_envs
        self._was_reset = [False] * num_envs

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def __len__(self) -> int:
        return len(self.envs)

    def _check_len(self, values: list, what: str) -> None:
        if len(values) != len(self.envs):
            raise ValueError(f"{what}: expected one entry per env ({len(self.envs)}), got {len(values)}")

    @staticmethod
    def _as_seed(i: int, seed) -> int:
        # numpy integers are fine; floats, strings and bools are not.
        if isinstance(seed, bool) or not hasattr(seed, "__index__"):
            raise TypeError(f"seed of env {i} must be an int, got {seed!r}")
        return operator.index(seed)

    def _reset_one(self, i: int, seed: int) -> None:
        obs, info = self.envs[i].reset(seed)
        self.obs[i], self.infos[i] = obs, info
        self.active[i], self.steps[i], self.seeds[i] = True, 0, seed
        self._was_reset[i] = True

    def reset(self, seeds: list[int]) -> tuple[list[str], list[dict]]:
        """Start a new episode in every env, env i with seeds[i] (use `group_seeds` for groups); returns the
        observations and infos of all envs."""
        self._check_len(seeds, "reset(seeds)")
        seeds = [self._as_seed(i, s) for i, s in enumerate(seeds)]  # all checked before any env changes
        for i, seed in enumerate(seeds):
            self._reset_one(i, seed)
        return list(self.obs), list(self.infos)

    def reset_finished(self, seeds: list[int | None]) -> list[int]:
        """Start a new episode only in the envs that are done (or were never reset), env i with seeds[i]
        (None: leave it done); entries for active envs are ignored. Returns the indices that were reset."""
        self._check_len(seeds, "reset_finished(seeds)")
        todo = [(i, self._as_seed(i, s)) for i, s in enumerate(seeds) if not self.active[i] and s is not None]
        for i, seed in todo:
            self._reset_one(i, seed)
        return [i for i, _ in todo]

    def step(self, actions: list[str | None]) -> tuple[list[str], list[float], list[bool], list[dict]]:
        """Step every active env i whose actions[i] is not None; returns (obs, rewards, dones, infos) of all envs.

        An env not stepped (inactive, or action None) returns its last obs and info, reward 0.0 and done =
        not active (so a finished env keeps reading done=True, a skipped active one done=False). Any string is
        a legal action (the env answers an invalid one as the original does).
        """
        self._check_len(actions, "step(actions)")
        if not any(self._was_reset):
            raise RuntimeError("LockstepEnvs.step called before reset()")
        rewards = [0.0] * len(self.envs)
        dones = [not a for a in self.active]
        for i, action in enumerate(actions):
            if action is None or not self.active[i]:
                continue
            if not isinstance(action, str):
                raise TypeError(f"action of env {i} must be a str or None, got {type(action).__name__}")
            obs, reward, done, info = self.envs[i].step(action)
            self.obs[i], self.infos[i] = obs, info
            self.steps[i] += 1
            rewards[i], dones[i] = float(reward), bool(done)
            if done:
                self.active[i] = False
        return list(self.obs), rewards, dones, list(self.infos)

    def close(self) -> None:
        """Close the envs that have a close() (the real backends hold engines/processes)."""
        for env in self.envs:
            close = getattr(env, "close", None)
            if callable(close):
                close()
