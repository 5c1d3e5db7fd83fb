"""Per-turn prompts, their tokenisation under a length budget, and parsing of the model's action.

A turn's prompt shows the task, the last `history_len` (observation, action) pairs, the current observation and
the admissible actions. Two forms:

- long (instruct LLMs): a plain-language instruction asking for reasoning inside `<think></think>` and exactly
  one action inside `<action></action>`;
- short (`tiny` model, ~1-2k token vocabulary, 512-1024 token context): one line per field, the history shows
  only the previous actions (their observations would triple the prompt), the task text is not repeated inside
  the observation (WebShop pages and ALFWorld's first observation quote it), the admissible actions are
  numbered, and the response is just `<action>...</action>` holding the action or its number (a model of a
  million parameters does not learn to copy a 10-character WebShop product code: 3% exact on held-out turns).
  The actions that the env answers by number (`by_number`, WebShop's product clicks) are written as `#k` in the
  observation, where the page shows their code, and as the bare number in the list: the product and its number
  stand side by side, and a results page takes half the tokens.

Both are deterministic: the same inputs give the same string.
"""

from __future__ import annotations

import re

ACTION_OPEN = "<action>"
ACTION_CLOSE = "</action>"
# Marks an observation whose beginning was cut to fit the prompt budget.
TRUNCATION_MARK = "..."
# Prompt budget of the tiny model's short prompts: its warm start was trained on them (tiny_models/build.py), and the
# scripts use it when --max-prompt-tokens is unset.
TINY_MAX_PROMPT_TOKENS = 512


def _one_line(text: str) -> str:
    """Collapse all whitespace runs (newlines included) to single spaces: the short form is one line per field."""
    return " ".join(text.split())


def _recent(history: list[tuple[str, str]], history_len: int) -> list[tuple[str, str]]:
    # history[-0:] would be the whole list, hence the explicit check.
    if history_len <= 0:
        return []
    return list(history[-history_len:])


def build_prompt(
    task: str,
    obs: str,
    history: list[tuple[str, str]],
    admissible: list[str],
    *,
    history_len: int = 2,
    short: bool = False,
    by_number: re.Pattern | None = None,
) -> str:
    """The prompt text of one turn.

    history: [(observation, action), ...] of the previous turns, oldest first; only the last `history_len`
    are shown (oldest first). admissible: the actions valid now, in the environment's order.
    short=True: the compact form for the `tiny` model (no `<think>` instruction, past actions without their
    observations, numbered actions), e.g. `task: ...\\nprev: <action> | <action>\\nobs: ...\\nactions: 1 a | 2 b\\n`.
    by_number (short form only): a pattern of the actions answered by their number, whose group 1 is the text that
    the observation shows for them (WebShop: the product code in `click[b0...]`); each admissible action it fully
    matches is listed as its bare number k, and that text is written `#k` wherever the observation shows it
    (case-insensitively).
    """
    recent = _recent(history, history_len)
    if short:
        task_text = _one_line(task)
        lines = [f"task: {task_text}"]
        if recent:
            lines.append("prev: " + " | ".join(_one_line(a) for _, a in recent))
        obs_text = _one_line(obs)
        if task_text:
            obs_text = _one_line(obs_text.replace(task_text, ""))
        # Numbered, so that the answer may be the number instead of the text (parse_action resolves it).
        listed = []
        for k, a in enumerate(admissible, 1):
            shown = by_number.fullmatch(a) if by_number is not None else None
            if shown:
                obs_text = re.sub(re.escape(shown.group(1)), f"#{k}", obs_text, flags=re.IGNORECASE)
                listed.append(str(k))
            else:
                listed.append(f"{k} {_one_line(a)}")
        lines.append(f"obs: {obs_text}")
        lines.append("actions: " + " | ".join(listed))
        return "\n".join(lines) + "\n"

    parts = [
        "You are an agent acting in a text-based environment. Complete the task by choosing one action per turn.",
        f"Your task: {task.strip()}",
    ]
    if recent:
        turns = []
        for k, (o, a) in enumerate(recent):
            age = len(recent) - k
            turns.append(f"[{age} turn{'s' if age > 1 else ''} ago]\nObservation: {o.strip()}\nAction: {a.strip()}")
        parts.append(
            f"Your last {len(recent)} turn{'s' if len(recent) > 1 else ''} (oldest first):\n" + "\n".join(turns)
        )
    parts.append(f"Current observation:\n{obs.strip()}")
    if admissible:
        parts.append("Admissible actions:\n" + "\n".join(f"- {a}" for a in admissible))
    else:
        parts.append("Admissible actions: (none listed)")
    parts.append(
        "Think step by step inside <think></think>, then give exactly one action from the admissible actions "
        "inside <action></action>."
    )
    return "\n\n".join(parts) + "\n"


def _tokenize(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        # Render to text first and tokenise without special tokens: the template already holds them, and this
        # avoids depending on apply_chat_template's return type across transformers versions.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(prompt).input_ids)


def encode_prompt(
    tokenizer,
    task: str,
    obs: str,
    history: list[tuple[str, str]],
    admissible: list[str],
    *,
    history_len: int = 2,
    short: bool = False,
    by_number: re.Pattern | None = None,
    max_prompt_tokens: int | None = None,
) -> list[int]:
    """Token ids of the turn's prompt, at most `max_prompt_tokens` long (None: no limit).

    With `tokenizer.chat_template` set the prompt is one user message with the generation prompt appended;
    otherwise it is `tokenizer(prompt).input_ids`. Over budget, in this order until it fits:
    1. drop the oldest history turns (down to none);
    2. cut the current observation from the left (its newest text is kept, prefixed with "...");
    3. drop admissible actions from the end of the list.
    The task and the instruction are never cut: if they alone exceed the budget a ValueError says so.
    """
    if max_prompt_tokens is not None and max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")

    def encode(h: int, o: str, adm: list[str]) -> list[int]:
        text = build_prompt(task, o, history, adm, history_len=h, short=short, by_number=by_number)
        return _tokenize(tokenizer, text)

    h = min(max(history_len, 0), len(history))
    ids = encode(h, obs, admissible)
    if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
        return ids

    # 1. Oldest history turns first.
    while h > 0:
        h -= 1
        ids = encode(h, obs, admissible)
        if len(ids) <= max_prompt_tokens:
            return ids

    # 2. Keep the longest suffix of the observation that fits (binary search on its length in characters;
    # token counts are monotone in the suffix length up to tokenizer merges, so the result is re-checked).
    def cut(k: int) -> str:
        return TRUNCATION_MARK + obs[len(obs) - k :] if k > 0 else TRUNCATION_MARK

    if len(encode(0, cut(0), admissible)) <= max_prompt_tokens:
        lo, hi = 0, len(obs) - 1  # lo always fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(encode(0, cut(mid), admissible)) <= max_prompt_tokens:
                lo = mid
            else:
                hi = mid - 1
        return encode(0, cut(lo), admissible)

    # 3. Nothing of the observation fits: shorten the admissible list, keeping its first entries.
    lo, hi = 0, len(admissible) - 1  # number of actions kept
    if len(encode(0, cut(0), [])) > max_prompt_tokens:
        n = len(encode(0, cut(0), []))
        raise ValueError(
            f"max_prompt_tokens={max_prompt_tokens} is too small: the instruction and task alone take {n} tokens"
        )
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(0, cut(0), admissible[:mid])) <= max_prompt_tokens:
            lo = mid
        else:
            hi = mid - 1
    return encode(0, cut(0), admissible[:lo])


def parse_action(text: str, admissible: list[str] | None = None) -> tuple[str, bool]:
    """(action, valid): the stripped text inside the LAST complete `<action>...</action>` of `text`.

    The tags are matched exactly (lower case). "Last complete" pair: the last `<action>` that is followed by
    a `</action>`, up to the first `</action>` after it; so nested or repeated tags resolve to the innermost
    text, and a trailing unfinished `<action>...` is ignored. No complete pair, or only whitespace inside:
    ("", False). With `admissible` (the numbered list of the short prompt), an answer that is a number k in
    1..len(admissible) becomes admissible[k - 1]; any other number stays as it is (the env finds it invalid).
    Never raises on a str.
    """
    end = text.rfind(ACTION_CLOSE)
    if end < 0:
        return "", False
    start = text.rfind(ACTION_OPEN, 0, end)
    if start < 0:
        return "", False
    # The first closing tag after that opening one: "<action>x</action></action>" gives "x".
    end = text.find(ACTION_CLOSE, start)
    action = text[start + len(ACTION_OPEN) : end].strip()
    if not action:
        return "", False
    digits = action.lstrip("0") or "0"
    # The length test comes first: int() refuses strings of more than 4,300 digits (Python's str-to-int limit).
    if admissible and action.isascii() and action.isdigit() and len(digits) <= len(str(len(admissible))):
        if 1 <= int(digits) <= len(admissible):
            action = admissible[int(digits) - 1]
    return action, True


def format_response(action: str, short: bool) -> str:
    """The expert's response text for behaviour cloning on `action`.

    short: `<action>{action}</action>` (the `tiny` model's whole response format). long: a one-sentence
    `<think>` naming the step, then the action, so that the target follows the long prompt's instruction.
    """
    if short:
        return f"{ACTION_OPEN}{action}{ACTION_CLOSE}"
    return f"<think>The next step towards the task is: {action}.</think>\n{ACTION_OPEN}{action}{ACTION_CLOSE}"


def action_token_mask(tokenizer, response_ids: list[int]) -> list[bool]:
    """Which response tokens write the action: those whose text overlaps the inside of the last complete
    `<action>...</action>` (the span `parse_action` reads). The tags, EOS and any text around them are format
    tokens (False): near-deterministic, they would hide how far two models' action choices differ. All False
    when the response has no complete action. Token texts are decoded one by one and concatenated."""
    pieces = [tokenizer.decode([t]) for t in response_ids]
    text = "".join(pieces)
    end = text.rfind(ACTION_CLOSE)
    start = text.rfind(ACTION_OPEN, 0, end) if end >= 0 else -1
    if start < 0:
        return [False] * len(pieces)
    inner_start = start + len(ACTION_OPEN)
    inner_end = text.find(ACTION_CLOSE, start)
    mask, pos = [], 0
    for piece in pieces:
        mask.append(pos < inner_end and pos + len(piece) > inner_start)
        pos += len(piece)
    return mask
