"""Run plumbing: seeding, the run folder (config, metrics, checkpoints, learning curve), wandb, progress bars.

Layout of one run:

    runs/{run_name}/config.json          vars(args) + git commit + command line + start time (+ resumes)
    runs/{run_name}/metrics.jsonl        one JSON object per logged iteration
    runs/{run_name}/checkpoints/latest.pt  modules, optimisers, RNG states, iteration, extra
    runs/{run_name}/checkpoints/latest.dcp/  the same under torchrun (N > 1 processes): torch.distributed.checkpoint
                                         shards of the modules and optimisers, and each rank's rank{r}.pt
    runs/{run_name}/learning_curve.png   written by Run.close()
    runs/{run_name}/wandb/               with --track (offline runs keep all their files here)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import pathlib
import random
import secrets
import shlex
import string
import subprocess
import sys
import time
from collections.abc import Iterable

import numpy as np
import torch

from common import distributed

CHECKPOINT_NAME = "latest.pt"
DCP_CHECKPOINT_NAME = "latest.dcp"  # a folder: the checkpoint of a run of several processes (torchrun)
_REPO_DIR = pathlib.Path(__file__).resolve().parents[1]
# Flags that may differ from the run's config.json on --resume: a run may be extended, and where and whether it is
# also recorded (wandb) does not change the experiment. Every other flag must be the run's own.
RESUME_MAY_CHANGE = ("num_iterations", "total_env_steps")
_RECORDING_FLAGS = ("resume", "eval_only", "runs_dir", "track", "wandb_project_name", "wandb_entity")
# The scripts' "to be filled in runtime" fields: they differ only where the flags they come from do.
_DERIVED_FIELDS = ("num_policy_rollouts", "num_explorer_rollouts")
# --eval-only reads only the policy: these must match the run whose checkpoint it reads, the rest is free (a LoRA
# run's checkpoint holds the policy's adapter only, which needs the same base, rank and scale).
EVAL_ONLY_MUST_MATCH = ("env", "model_name", "env_preset", "lora_rank", "lora_alpha")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


# ---------------------------------------------------------------------------------------------------------------
# A user's mistakes
# ---------------------------------------------------------------------------------------------------------------
class BadInput(Exception):
    """A mistake in the command line, or something it names that is missing or unusable (a model, env data, a run
    folder, a checkpoint). The message is one line that names the thing and what to do; the scripts exit with it
    (no traceback) before writing any file."""


class MissingCheckpoint(BadInput, FileNotFoundError):
    """--resume names no readable checkpoint."""


def flag_name(field: str) -> str:
    """The command-line spelling of an Args field: num_eval_tasks -> --num-eval-tasks."""
    return "--" + field.replace("_", "-")


def check_args(
    args,
    *,
    at_least_one: Iterable[str] = (),
    positive: Iterable[str] = (),
    at_most_one: Iterable[str] = (),
    signed: Iterable[str] = ("seed",),
) -> None:
    """Raise BadInput naming the first flag of `args` (a dataclass) that no run can use.

    Every number must be finite in float32 (nan, inf and 1e40 are not: each float flag ends up in float32
    arithmetic) and not negative (except the fields in `signed`); the fields in `at_least_one` (counts and sizes)
    must be >= 1, those in `positive` > 0, those in `at_most_one` <= 1. None (an unset optional flag) passes.
    """
    for field in dataclasses.fields(args):
        v = getattr(args, field.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and not (math.isfinite(v) and abs(v) <= _FLOAT32_MAX):
            raise BadInput(f"{flag_name(field.name)} {v}: must be a finite number (at most {_FLOAT32_MAX:.3g})")
        if v < 0 and field.name not in signed:
            raise BadInput(f"{flag_name(field.name)} {v}: must be >= 0")
    for rule, names, ok in (
        (">= 1", at_least_one, lambda v: v >= 1),
        ("> 0", positive, lambda v: v > 0),
        ("<= 1", at_most_one, lambda v: v <= 1),
    ):
        for name in names:
            v = getattr(args, name)
            if v is not None and not ok(v):
                raise BadInput(f"{flag_name(name)} {v}: must be {rule}")


# ---------------------------------------------------------------------------------------------------------------
# Seeding, git, statistics, progress
# ---------------------------------------------------------------------------------------------------------------
def seed_everything(seed: int, torch_deterministic: bool = True) -> None:
    """Seed python's `random`, numpy's global generator and torch (CPU and every CUDA device).

    torch_deterministic: ask torch for deterministic kernels (`use_deterministic_algorithms(True, warn_only=True)`:
    ops without one warn instead of failing) and deterministic cuDNN; False turns both off again.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if torch_deterministic:
        # cuBLAS needs a fixed workspace for reproducible matmuls; it must be set before the first CUDA call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(torch_deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = torch_deterministic
    torch.backends.cudnn.benchmark = not torch_deterministic


def _git(*argv: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(_REPO_DIR), *argv], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_commit() -> str:
    """The commit hash of this checkout's HEAD, or "unknown" outside a git checkout (or without git)."""
    return _git("rev-parse", "HEAD") or "unknown"


def mean_ci95(values: Iterable[float]) -> tuple[float, float]:
    """(mean, half-width) of a normal-approximation 95% confidence interval of the mean.

    half-width = 1.96 * s / sqrt(n) with s the unbiased sample standard deviation (ddof=1); it is 0.0 for
    n < 2 (no spread can be estimated). For success rates (0/1 values) this is the Wald interval, which is
    too narrow when the rate is near 0 or 1 or n is small: read it as a rough error bar. An empty input gives
    (nan, 0.0).
    """
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    n = x.size
    if n == 0:
        return float("nan"), 0.0
    mean = float(x.mean())
    if n < 2:
        return mean, 0.0
    return mean, float(1.96 * x.std(ddof=1) / math.sqrt(n))


def progress(iterable: Iterable | None = None, **kw):
    """A tqdm progress bar over `iterable`; off when stderr is not a terminal or $CI is set (pass disable= to
    override)."""
    from tqdm.auto import tqdm

    kw.setdefault("disable", bool(os.environ.get("CI")) or not sys.stderr.isatty())
    kw.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kw)


# ---------------------------------------------------------------------------------------------------------------
# JSON-safe values
# ---------------------------------------------------------------------------------------------------------------
def _json_value(v, where: str):
    """A JSON-serialisable copy of a metric value: tensors and numpy scalars become Python numbers, non-finite
    floats become null (strict JSON has no NaN)."""
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        v = v.item() if v.numel() == 1 else v.tolist()
    elif isinstance(v, np.ndarray):
        v = v.item() if v.size == 1 else v.tolist()
    elif isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (list, tuple)):
        return [_json_value(x, where) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x, f"{where}.{k}") for k, x in v.items()}
    raise TypeError(f"{where}: cannot log a value of type {type(v).__name__} ({v!r:.80})")


def _config_value(v):
    """Best-effort JSON form of an argument value (paths, enums, dataclasses, containers; else its str)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, enum.Enum):
        return _config_value(v.value)
    if isinstance(v, (pathlib.PurePath, torch.dtype, torch.device)):
        return str(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _config_value(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {str(k): _config_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_config_value(x) for x in v]
    if isinstance(v, (np.generic, torch.Tensor)) and getattr(v, "ndim", 0) == 0:
        return _config_value(v.item())
    return str(v)


def _args_dict(args) -> dict:
    if args is None:
        return {}
    if isinstance(args, dict):
        return dict(args)
    return dict(vars(args))


def _write_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics.jsonl (or of the run folder holding it); unreadable lines (a crash mid-write)
    are skipped."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    if not path.exists():
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Learning curve
# ---------------------------------------------------------------------------------------------------------------
def plot_learning_curve(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "") -> pathlib.Path:
    """PNG of train/success_rate and eval/success_rate (with its 95% bar) against env_steps (iteration when a
    row has no env_steps). Writes a labelled empty plot when there is nothing to draw yet."""
    # The object-oriented API with an explicit Agg canvas: no global backend switch, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_path)
    use_steps = any(r.get("env_steps") is not None for r in rows)
    x_key = "env_steps" if use_steps else "iteration"

    def series(key: str, err_key: str | None = None):
        xs, ys, es = [], [], []
        for r in rows:
            y, x = r.get(key), r.get(x_key)
            if isinstance(y, (int, float)) and isinstance(x, (int, float)):
                xs.append(x)
                ys.append(y)
                e = r.get(err_key) if err_key else None
                es.append(e if isinstance(e, (int, float)) else 0.0)
        return xs, ys, es

    fig = Figure(figsize=(7, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    tx, ty, _ = series("train/success_rate")
    ex, ey, ee = series("eval/success_rate", "eval/success_ci95")
    if tx:
        ax.plot(tx, ty, label="train/success_rate (on-policy rollouts)", color="tab:blue", lw=1.5)
    if ex:
        ax.errorbar(ex, ey, yerr=ee, label="eval/success_rate (95% CI)", color="tab:red", marker="o", ms=4, capsize=3)
    if not tx and not ex:
        ax.text(0.5, 0.5, "no success-rate rows logged yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("environment steps (explorer included)" if use_steps else "iteration")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if tx or ex:
        ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    png_path = pathlib.Path(png_path)
    tmp = png_path.with_name(png_path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, png_path)
    return png_path


# ---------------------------------------------------------------------------------------------------------------
# RNG states
# ---------------------------------------------------------------------------------------------------------------
def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def find_checkpoint(path: str | os.PathLike) -> pathlib.Path:
    """The checkpoint file that `--resume PATH` names: a checkpoint file, a run folder, or its checkpoints/.

    MissingCheckpoint (a FileNotFoundError) with a one-line reason when there is none."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise MissingCheckpoint(f"--resume {path}: no checkpoint found: there is no such run folder or file")
    if _is_dcp(p):
        return p.resolve()
    candidates = [p] if p.is_file() else [p / "checkpoints" / CHECKPOINT_NAME, p / CHECKPOINT_NAME]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    for c in (p / "checkpoints" / DCP_CHECKPOINT_NAME, p / DCP_CHECKPOINT_NAME):
        if _is_dcp(c):
            return c.resolve()
    if (p / "config.json").is_file():
        raise MissingCheckpoint(
            f"--resume {path}: no checkpoint found: the run stopped before its first checkpoint was saved; "
            "start it again without --resume"
        )
    raise MissingCheckpoint(
        f"--resume {path}: no checkpoint found (give a run folder holding checkpoints/{CHECKPOINT_NAME}, "
        f"or a checkpoint file); looked at {', '.join(str(c) for c in candidates)}"
    )


def _is_dcp(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The state saved by Run.save_checkpoint, read onto the CPU; BadInput naming the file when it cannot be read
    (truncated by a full disk or an interrupted copy, or not a checkpoint). Checkpoints are pickles: read only
    files you trust. A DCP folder (a run of several processes) gives this rank's state, without the modules and
    optimisers (their shards load in Run.load_checkpoint); BadInput unless this run has the same number of
    processes as the one that wrote it."""
    n = distributed.world_size()
    if _is_dcp(pathlib.Path(path)):
        state = distributed.read_rank_state(path)
        if state.get("world_size") != n:
            raise BadInput(
                f"--resume: {path} was written by {state.get('world_size')} processes and this run has {n}: "
                f"resume with torchrun --nproc_per_node {state.get('world_size')}"
            )
        return {**state, "modules": {}, "optimizers": {}}
    if n > 1:
        raise BadInput(f"--resume: {path} was written by one process: resume it without torchrun")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch.load raises many types on a damaged file (zip, pickle, EOF, ...)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise BadInput(
            f"--resume: the checkpoint {path} cannot be read ({reason}); resume from an intact copy of it, or start "
            "the run again"
        ) from e
    if not isinstance(state, dict) or not {"iteration", "modules", "optimizers", "rng"} <= set(state):
        raise BadInput(f"--resume: {path} is not a checkpoint written by these scripts")
    return state


def _run_dir_of(checkpoint: pathlib.Path) -> pathlib.Path:
    parent = checkpoint.parent
    return parent.parent if parent.name == "checkpoints" else parent


# ---------------------------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------------------------
class Run:
    """One training (or evaluation) run: its folder, metrics, checkpoints and optional wandb run.

    Fresh run: creates `{runs_dir}/{run_name}/` (a `-1`, `-2`, ... suffix if that folder already has files).
    `resume` (a run folder or checkpoint file, see `find_checkpoint`): continues in the resumed run's folder;
    `load_checkpoint` restores its state and drops metrics rows logged after the checkpoint. With
    `eval_only` (default: `args.eval_only`) the resumed checkpoint is only read: the evaluation gets its own
    fresh folder and the original run is left untouched.

    If `args.track`: `wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args),
    name=run_name, save_code=True, dir=run folder)`; a resumed run continues the same wandb run id. While wandb
    starts, WANDB_CACHE_DIR / WANDB_DATA_DIR point into the run folder unless set, so an offline run keeps
    all its files there.

    Usable as a context manager (close() on exit, also on error).
    """

    def __init__(
        self,
        args,
        run_name: str,
        runs_dir: str = "runs",
        resume: str | None = None,
        *,
        eval_only: bool | None = None,
    ):
        self.args = args
        self.eval_only = bool(getattr(args, "eval_only", False)) if eval_only is None else bool(eval_only)
        self.resume_checkpoint = find_checkpoint(resume) if resume else None
        self.resuming = self.resume_checkpoint is not None and not self.eval_only
        # Everything --resume names is checked before any file is written or changed.
        self._resume_state = read_checkpoint(self.resume_checkpoint) if self.resume_checkpoint else None
        if self.resume_checkpoint is not None:
            self._check_resumed_flags()
        if self.resuming:
            self.dir = _run_dir_of(self.resume_checkpoint)
        else:  # rank 0 makes the folder (under torchrun the others write into it: checkpoint shards only)
            self.dir = self._fresh_dir(pathlib.Path(runs_dir), run_name) if distributed.is_main() else None
            self.dir = distributed.from_main(self.dir)
        self.run_name = self.dir.name
        self.checkpoint_dir = self.dir / "checkpoints"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.curve_path = self.dir / "learning_curve.png"
        self.config_path = self.dir / "config.json"
        self._closed = False
        self._wandb = None
        self.config = self._write_config()
        if getattr(args, "track", False) and distributed.is_main():
            self._init_wandb()

    @staticmethod
    def _fresh_dir(runs_dir: pathlib.Path, run_name: str) -> pathlib.Path:
        if not run_name or "/" in run_name or run_name in (".", ".."):
            raise ValueError(f"run_name must be a plain folder name, got {run_name!r}")
        runs_dir.mkdir(parents=True, exist_ok=True)
        d, k = runs_dir / run_name, 0
        while True:
            try:
                d.mkdir()
                return d.resolve()
            except FileExistsError:
                if not any(d.iterdir()):
                    return d.resolve()
                k += 1
                d = runs_dir / f"{run_name}-{k}"

    def _check_resumed_flags(self) -> None:
        """BadInput naming the flags that differ from the resumed run's config.json (resuming: all but
        RESUME_MAY_CHANGE and the recording flags; eval-only: EVAL_ONLY_MUST_MATCH). Flags that the run's config
        does not hold (an older version's run) are not compared."""
        config_path = _run_dir_of(self.resume_checkpoint) / "config.json"
        try:
            stored = json.loads(config_path.read_text(encoding="utf-8"))["args"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return  # a checkpoint file outside a run folder: nothing to compare with
        args = _args_dict(self.args)
        if self.eval_only:
            names = [k for k in EVAL_ONLY_MUST_MATCH if k in args]
        else:
            names = [k for k in args if k not in RESUME_MAY_CHANGE + _RECORDING_FLAGS + _DERIVED_FIELDS]
        differ = [k for k in names if k in stored and _config_value(args[k]) != stored[k]]
        if differ:
            listed = ", ".join(f"{flag_name(k)} {_config_value(args[k])} (the run's: {stored[k]})" for k in differ)
            may = " (only " + " and ".join(flag_name(k) for k in RESUME_MAY_CHANGE) + " may change)"
            raise BadInput(
                f"--resume {self.resume_checkpoint}: flags differ from the run's config.json: {listed}; "
                f"give the run's own flags{'' if self.eval_only else may}, or start a new run without --resume"
            )

    def _write_config(self) -> dict:
        entry = {
            "args": {k: _config_value(v) for k, v in _args_dict(self.args).items()},
            "git_commit": git_commit(),
            "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "command": shlex.join([sys.executable, *sys.argv]),
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        config = None
        if self.resuming and self.config_path.exists():
            try:
                config = json.loads(self.config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                config = None
        if config is None:
            config = {"run_name": self.run_name, **entry, "resumes": []}
            if self.resume_checkpoint is not None:
                config["checkpoint_loaded"] = str(self.resume_checkpoint)
        else:
            config.setdefault("resumes", []).append({**entry, "checkpoint_loaded": str(self.resume_checkpoint)})
        if getattr(self.args, "track", False) and not config.get("wandb_id"):
            # A wandb run id ([a-z0-9]) chosen here so that a resumed run continues the same wandb run.
            config["wandb_id"] = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        if distributed.is_main():
            _write_atomic(self.config_path, json.dumps(config, indent=2) + "\n")
        return config

    def _init_wandb(self) -> None:
        import wandb

        overrides = {"WANDB_CACHE_DIR": self.dir / "wandb" / ".cache", "WANDB_DATA_DIR": self.dir / "wandb" / ".data"}
        saved = {k: os.environ.get(k) for k in overrides}
        for k, v in overrides.items():
            if not saved[k]:
                v.mkdir(parents=True, exist_ok=True)
                os.environ[k] = str(v)
        try:
            self._wandb = wandb.init(
                project=getattr(self.args, "wandb_project_name", "rspo"),
                entity=getattr(self.args, "wandb_entity", None),
                config=self.config["args"],
                name=self.run_name,
                id=self.config["wandb_id"],
                resume="allow",
                save_code=True,
                dir=str(self.dir),
            )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # -- metrics --------------------------------------------------------------------------------------------
    def log(self, metrics: dict, step: int) -> None:
        """Append one JSON line {"iteration": step, **metrics} to metrics.jsonl (and log to wandb at `step`).

        Tensors and numpy values become Python numbers (non-finite floats: null); other types raise TypeError.
        Under torchrun only rank 0 writes (the scripts log metrics reduced over the ranks).
        """
        row = {k: _json_value(v, f"metric {k!r}") for k, v in metrics.items()}
        if not distributed.is_main():
            return
        row["iteration"] = int(step)
        line = json.dumps(row, allow_nan=False)
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "iteration"}, step=int(step))

    def _truncate_metrics(self, iteration: int) -> None:
        """Keep only rows of iterations <= `iteration` (rows logged after the checkpoint are redone)."""
        if not distributed.is_main() or not self.metrics_path.exists():
            return
        rows = [r for r in read_metrics(self.metrics_path) if isinstance(r.get("iteration"), int)]
        kept = [json.dumps(r, allow_nan=False) + "\n" for r in rows if r["iteration"] <= iteration]
        _write_atomic(self.metrics_path, "".join(kept))

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        iteration: int,
        modules: dict[str, torch.nn.Module],
        optimizers: dict[str, torch.optim.Optimizer],
        extra: dict | None = None,
    ) -> pathlib.Path:
        """Write checkpoints/latest.pt atomically (temporary file + os.replace): the state dicts of `modules`
        and `optimizers` (None entries skipped), `extra` (any picklable objects, e.g. a replay buffer or a
        numpy Generator), the python/numpy/torch(/CUDA) RNG states and `iteration`, the last completed
        iteration (log an iteration's metrics before saving it).

        Under torchrun (several processes): checkpoints/latest.dcp/, written by all ranks together with
        torch.distributed.checkpoint (each optimiser under the key of the module it steps); each rank's extra and
        RNG states in its own rank{r}.pt there."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        if distributed.world_size() > 1:
            state = {"iteration": int(iteration), "extra": extra if extra is not None else {}, "rng": _rng_state()}
            return distributed.save_checkpoint(self.checkpoint_dir / DCP_CHECKPOINT_NAME, modules, optimizers, state)
        state = {
            "iteration": int(iteration),
            "modules": {k: m.state_dict() for k, m in modules.items() if m is not None},
            "optimizers": {k: o.state_dict() for k, o in optimizers.items() if o is not None},
            "extra": extra if extra is not None else {},
            "rng": _rng_state(),
            "run_name": self.run_name,
            "git_commit": self.config.get("git_commit", "unknown"),
            "time": time.time(),
        }
        path = self.checkpoint_dir / CHECKPOINT_NAME
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def load_checkpoint(
        self, modules: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer]
    ) -> dict:
        """Restore `modules` and `optimizers` (in place) and the RNG states from the resumed checkpoint (or this
        run's own latest.pt); returns {"iteration": int, "extra": dict}, or {} when there is no checkpoint.

        A resumed (not eval-only) run also drops metrics.jsonl rows of iterations after the checkpoint's.
        A module or optimiser asked for but missing from the checkpoint is a KeyError (None entries are skipped).
        Checkpoints are pickles: load only files you trust.
        """
        path, state = self.resume_checkpoint, self._resume_state
        if path is None:
            own = self.checkpoint_dir / (DCP_CHECKPOINT_NAME if distributed.world_size() > 1 else CHECKPOINT_NAME)
            if not own.exists():
                return {}
            path, state = own, read_checkpoint(own)
        elif state is None:
            state = read_checkpoint(path)
        if _is_dcp(path):
            state = distributed.load_checkpoint(path, modules, optimizers)
            _set_rng_state(state["rng"])
            self._resume_state = None
            if self.resuming:
                self._truncate_metrics(state["iteration"])
            return {"iteration": int(state["iteration"]), "extra": state.get("extra", {})}
        for kind, wanted, stored in (
            ("module", modules, state["modules"]),
            ("optimizer", optimizers, state["optimizers"]),
        ):
            missing = [k for k, v in wanted.items() if v is not None and k not in stored]
            if missing:
                raise KeyError(f"checkpoint {path} has no {kind} {missing} (it has {sorted(stored)})")
        for k, m in modules.items():
            if m is not None:
                m.load_state_dict(state["modules"][k])
        for k, o in optimizers.items():
            if o is not None:
                o.load_state_dict(state["optimizers"][k])
        _set_rng_state(state["rng"])
        self._resume_state = None  # the modules hold it now: free the copy
        if self.resuming:
            self._truncate_metrics(state["iteration"])
        return {"iteration": int(state["iteration"]), "extra": state.get("extra", {})}

    # -- end ------------------------------------------------------------------------------------------------
    def close(self, exit_code: int = 0) -> None:
        """Write learning_curve.png and finish the wandb run (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not distributed.is_main():
            return
        try:
            plot_learning_curve(self.metrics_path, self.curve_path, title=self.run_name)
        finally:
            if self._wandb is not None:
                self._wandb.finish(exit_code=exit_code)
                self._wandb = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


__all__ = (
    "BadInput",
    "MissingCheckpoint",
    "Run",
    "check_args",
    "flag_name",
    "find_checkpoint",
    "git_commit",
    "mean_ci95",
    "plot_learning_curve",
    "progress",
    "read_checkpoint",
    "read_metrics",
    "seed_everything",
)
