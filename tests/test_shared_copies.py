"""The pieces a user copies out of the scripts (losses, advantages, the swap, the replay buffer, ...) are repeated in
every script that uses them, so that each script reads alone. Each must be one text: a fix made in one copy and
not the others would make the scripts disagree on the same formula."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ("rspo_grpo_webshop.py", "rspo_gigpo.py", "rspo_ppo_alfworld.py")
SHARED = (
    "compute_grpo_advantages", "token_logprobs", "policy_loss", "kl_k3", "truncated_importance_weights",
    "importance_weight_stats", "Turn", "Trajectory", "swap_rewards", "ReplayBuffer", "pack_by_tokens",
    "NonFiniteLoss", "finite_weights", "explorer_distance_metrics", "pearson", "set_advantages", "turn_rewards",
)  # fmt: skip


def module_level_definitions(path: pathlib.Path) -> dict[str, list[str]]:
    """name -> source text of each module-level def / class of that name (decorators included), in file order."""
    source = path.read_text()
    lines = source.splitlines()
    out: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = ast.get_source_segment(source, node)
            decorators = [lines[d.lineno - 1].strip() for d in node.decorator_list]
            out.setdefault(node.name, []).append("\n".join(decorators + [text]))
    return out


DEFINITIONS = {script: module_level_definitions(ROOT / script) for script in SCRIPTS}


@pytest.mark.parametrize("name", SHARED)
def test_shared_definition_is_one_text(name):
    copies = {script: defs[name] for script, defs in DEFINITIONS.items() if name in defs}
    assert len(copies) >= 2, f"{name} is defined in {sorted(copies)} only: was it renamed? (update SHARED)"
    for script, texts in copies.items():
        assert len(texts) == 1, f"{script} defines {name} {len(texts)} times"
    texts = {script: texts[0] for script, texts in copies.items()}
    reference = next(iter(texts))
    differing = [script for script, text in texts.items() if text != texts[reference]]
    assert not differing, f"{name} differs between {reference} and {', '.join(differing)}: make the copies identical"
