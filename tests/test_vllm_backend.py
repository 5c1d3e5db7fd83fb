"""`--rollout-backend vllm` up to the engine's start, in each script, on a machine without vLLM.

vLLM runs on CUDA only, so here a stand-in `vllm` package (written to a temporary folder that the subprocess
imports first) takes the place of `vllm.LLM`: it checks that the folder the script hands to the engine is one that
transformers loads as a causal LM with its tokenizer, and that it holds the script's initial policy, then stops
the run. The rest of the path (weights pushed into the engine, generation) needs a GPU.
"""

import subprocess
import sys

import pytest

STAND_IN = """
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class LLM:
    def __init__(self, model, tokenizer, **kwargs):
        lm = AutoModelForCausalLM.from_pretrained(model)
        tok = AutoTokenizer.from_pretrained(tokenizer)
        report = {
            "model": model,
            "parameters": sum(p.numel() for p in lm.parameters()),
            "weight_sum": float(sum(p.double().sum() for p in lm.parameters())),
            "round_trip": tok.decode(tok("<action>1</action>").input_ids) == "<action>1</action>",
            "kwargs": sorted(kwargs),
        }
        print("VLLM_STAND_IN " + json.dumps(report), flush=True)
        sys.exit(0)
"""

SCRIPTS = {
    "rspo_grpo_webshop.py": [],
    "rspo_gigpo.py": ["--env", "webshop"],
    "rspo_ppo_alfworld.py": [],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_engine_gets_a_folder_of_the_initial_policy(script, repo_root, script_env, tmp_path):
    import json

    from common.models import load_model

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(STAND_IN)
    env = dict(script_env, PYTHONPATH=f"{tmp_path}:{script_env['PYTHONPATH']}")
    cmd = [
        sys.executable, str(repo_root / script), *SCRIPTS[script], "--rollout-backend", "vllm",
        "--runs-dir", str(tmp_path / "runs"), "--total-env-steps", "64",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("VLLM_STAND_IN ")]
    report = json.loads(line.removeprefix("VLLM_STAND_IN "))
    # a folder inside the run (not the name "tiny"), holding the tiny model the script started from
    assert report["model"].startswith(str(tmp_path / "runs"))
    env_name = "alfworld" if "alfworld" in script else "webshop"
    tiny, _ = load_model("tiny", env_name=env_name)
    assert report["parameters"] == sum(p.numel() for p in tiny.parameters())
    assert report["weight_sum"] == pytest.approx(
        float(sum(p.double().sum() for p in tiny.parameters()).detach()), rel=1e-9
    )
    assert report["round_trip"]
    assert "gpu_memory_utilization" in report["kwargs"]
