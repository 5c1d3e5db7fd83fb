"""`--rollout-backend vllm` in each script, on a machine without vLLM.

vLLM runs on CUDA only, so here a stand-in `vllm` package (tests/vllm_stand_in/vllm, first on the subprocess's
PYTHONPATH) provides the part of vLLM's offline API that common/generation.py's VLLMGenerator uses: `LLM` (built
from a folder, `apply_model` to push weights, `generate` on prompt token ids, sleep / wake up, prefix-cache reset)
and `SamplingParams`. Its engine is a transformers model loaded from the folder the script hands over; its
`load_weights` accepts only the names of that model's parameters, and it generates with the project's HF
generator. It logs every push, so a test sees which weights each rollout ran on. What it cannot check is vLLM
itself (its kernels, its own log-probs, its memory sharing): that needs a GPU.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

STAND_IN = pathlib.Path(__file__).parent / "vllm_stand_in"


def _stand_in():
    """The stand-in module, loaded under another name (this process must keep failing `import vllm`)."""
    spec = importlib.util.spec_from_file_location("vllm_stand_in", STAND_IN / "vllm" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = [
    "--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "2", "--explorer-rollouts-per-task", "2",
    "--max-steps", "3", "--max-new-tokens", "8", "--num-eval-tasks", "2", "--eval-every", "2", "--train-pool-size", "4",
    "--no-eval-at-start", "--reward-mode", "swap",
]  # fmt: skip
SCRIPTS = {
    "rspo_grpo_webshop.py": [],
    "rspo_gigpo.py": ["--env", "webshop"],
    "rspo_ppo_alfworld.py": [],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_vllm_rollouts_run_on_the_weights_of_the_model_that_samples(script, repo_root, script_env, tmp_path):
    from common.models import load_model

    log = tmp_path / "engine.jsonl"
    env = dict(script_env, PYTHONPATH=f"{STAND_IN}:{script_env['PYTHONPATH']}", VLLM_STAND_IN_LOG=str(log))
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(repo_root / script), *SCRIPTS[script], *SMALL, "--rollout-backend", "vllm"]
    cmd += ["--runs-dir", str(runs)]
    proc = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    events = [json.loads(line) for line in log.read_text().splitlines()]

    # The engine starts from a folder inside the run that holds the initial policy (not the name "tiny").
    start = events[0]
    assert start["event"] == "start" and start["folder"].startswith(str(runs))
    env_name = "alfworld" if "alfworld" in script else "webshop"
    tiny, _ = load_model("tiny", env_name=env_name)
    initial = _stand_in().digest(tiny)
    assert start["digest"] == initial
    assert "gpu_memory_utilization" in start["kwargs"]

    # Every generate runs on the weights of the last push, and the first push is the initial policy. With the swap,
    # each iteration pushes the policy, then the explorer (after its process-reward step), then the evaluated
    # policy: at least three different sets of weights in two iterations.
    pushes = [e["digest"] for e in events if e["event"] == "push"]
    generates = [e for e in events if e["event"] == "generate"]
    assert pushes and generates and pushes[0] == initial
    last = None
    for e in events[1:]:
        if e["event"] == "push":
            last = e["digest"]
        else:
            assert e["digest"] == last
    assert len(set(pushes)) >= 3  # initial policy, then updated policy and explorer weights

    # Both iterations ran to the end and logged finite losses.
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["iteration"] for m in metrics if "train/success_rate" in m] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["losses/policy_loss"])) for m in metrics if "losses/policy_loss" in m)
