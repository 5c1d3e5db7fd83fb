"""benchmarks/gpu_check.py: its CPU fallback end to end (so that the check cannot rot before a GPU day), the
log-prob comparison it rests on (it must fail when the forward's temperature is not the sampler's), and the
missing-package stop."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_cpu_fallback_end_to_end(script_env, repo_root):
    cmd = [
        sys.executable, "benchmarks/gpu_check.py", "--cpu", "--scripts", "gigpo-webshop", "--logprob-prompts", "4",
        "--max-new-tokens", "16",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=repo_root, env=script_env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-3000:]}\n{proc.stderr[-3000:]}"
    summary = out[out.index("Summary (CPU, fp32)") :]
    for script in gpu_check.LOGPROB_SCRIPTS:
        line = re.search(
            rf"PASS  log-probs: generate vs {script} token_logprobs +max (\S+), mean (\S+) over (\d+)", out
        )
        assert line and float(line[1]) <= 1e-4 and int(line[3]) > 0, summary
    run = re.search(r"PASS  run rspo_gigpo.py --env webshop +iteration 1 (\S+) s, iteration 2 (\S+) s", summary)
    assert run and float(run[1]) > 0 and float(run[2]) > 0, summary
    assert "0 failed" in summary


def test_logprob_check_fails_when_the_forward_temperature_differs(tiny_models):
    from common import models
    from common.generation import HFGenerator

    model, tokenizer = models.load_model("tiny", env_name="webshop")
    prompts = [tokenizer.encode(t) for t in ("search[", "WebShop [SEP] Instruction: [SEP] i need a red shirt")]
    token_logprobs = gpu_check.load_script("rspo_grpo_webshop.py").token_logprobs
    kw = dict(temperature=1.0, autocast=gpu_check.nullcontext)
    generator = HFGenerator(tokenizer, max_new_tokens=8)
    torch.manual_seed(0)
    same = gpu_check.logprob_diffs(model, generator, prompts, token_logprobs, **kw)
    torch.manual_seed(0)
    other = gpu_check.logprob_diffs(model, generator, prompts, token_logprobs, forward_temperature=0.5, **kw)
    assert same.numel() == other.numel() > 0
    assert same.max() <= gpu_check.TOLERANCE["fp32"]["max"]
    assert other.max() > gpu_check.TOLERANCE["bf16"]["max"]


def test_missing_packages_are_named_and_nothing_runs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bm25s", None)  # import bm25s now fails, as on a machine without it
    assert gpu_check.main(["--cpu"]) == 2
    out = capsys.readouterr().out
    assert "bm25s" in out and "Summary" not in out
