"""benchmarks/throughput.py end to end at its smallest sizes (a subprocess): every table row, finite numbers."""

import json
import math
import re
import subprocess
import sys

import pytest

ROW_PREFIXES = [
    "(a) rollout, 2 envs batched: generated tokens/s",
    "(a) rollout, 2 envs batched: env steps/s",
    "(a) rollout, one env at a time: generated tokens/s",
    "(a) rollout, one env at a time: env steps/s",
    "(a) batched / one at a time: generated tokens/s",
    "(a) batched / one at a time: env steps/s",
    "(a) batched rollout time in generate / in env.step",
    "(b) update (2 envs' turns): trained tokens/s",
    "(b) update: achieved GFLOP/s",
    "(b) fwd+bwd+AdamW only: achieved GFLOP/s",
    "(b) matmul peak GFLOP/s",
    "(b) MFU: update / peak",
    "(b) MFU: fwd+bwd+AdamW / peak",
    "(c) s/iteration at 1 envs",
    "(c) s/iteration at 2 envs",
    "(c) s/iteration at 4 envs",
    "(c) 2x envs / 1x: s/iteration",
    "(c) 4x envs / 1x: s/iteration",
    "after / before: update trained tokens/s",
    "before / after: s/iteration at 1 envs",
    "before / after: s/iteration at 2 envs",
    "before / after: s/iteration at 4 envs",
    "before / after: update CPU seconds, (b) and all of (c)",
    "max abs difference of log-probs / entropies",
]
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:e[-+]?\d+)?%?|nan|inf", re.IGNORECASE)


def _numbers(cell: str) -> list[float]:
    return [float(m.replace(",", "").rstrip("%")) for m in NUMBER.findall(cell)]


@pytest.fixture(scope="module")
def smoke(repo_root, script_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput") / "throughput.json"
    cmd = [
        sys.executable, "benchmarks/throughput.py", "--envs", "1", "--group-size", "1", "--max-steps", "1",
        "--max-new-tokens", "4", "--matmul-size", "64", "--matmul-repeats", "2", "--repeats", "1", "--threads", "1",
        "--experiment", "full-logits", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=repo_root, env=script_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_table_has_every_row_with_finite_numbers(smoke):
    stdout, _ = smoke
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| measurement")]
    names = [line.split(" | ")[0][2:] for line in lines]
    for prefix in ROW_PREFIXES:
        assert sum(n.startswith(prefix) for n in names) == 1, (prefix, names)
    assert len(names) == len(ROW_PREFIXES)
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")][1:]
        values = [x for c in cells if c not in ("", "(same)") for x in _numbers(c)]
        assert values, line
        assert all(math.isfinite(x) and x >= 0 for x in values), line


def test_json_matches_and_experiment_is_exact(smoke):
    _, result = smoke
    assert result["table"]["header"][0] == "measurement" and len(result["table"]["rows"]) == len(ROW_PREFIXES)
    for variant in ("none", "full-logits"):
        res = result["results"][variant]
        assert all(math.isfinite(v) for v in res.values()), res
        for key in ("rollout_batched_gen_tokens_per_s", "update_trained_tokens_per_s", "update_mfu"):
            assert res[key] > 0
        assert set(k for k in res if k.startswith("iteration_s@")) == {
            "iteration_s@1",
            "iteration_s@2",
            "iteration_s@4",
        }
    assert result["raw"]["rollout"]["single"]["env_steps"] == result["raw"]["rollout"]["batched"]["env_steps"] == 2
    # the changed log-probs equal the original ones up to float rounding
    assert result["experiment_ratios"]["max_logprob_difference"] < 1e-4
    # the scripts' code counts fewer FLOPs than the former full-logits one (LM head at response tokens only), the
    # same tokens; the table's "before" column is the experiment
    upd = result["raw"]["update"]
    assert upd["full-logits"]["tokens"] == upd["none"]["tokens"]
    assert upd["none"]["flops"] < upd["full-logits"]["flops"]
    assert result["table"]["header"][1].startswith("before (--experiment full-logits)")
    assert result["machine"]["matmul_peak_flops_per_s"] > 0
