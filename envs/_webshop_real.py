"""Adapter to the original WebShop (princeton-nlp/WebShop, `web_agent_site`) in text observation mode with human
goals, behind the same interface as the embedded shop (envs/webshop.py).

Calls it makes into `web_agent_site` (and nothing else):
  web_agent_site.envs.web_agent_text_env.WebAgentTextEnv(observation_mode="text", human_goals=True, **options)
  env.reset(session=int) -> (obs, _);  env.step(action) -> (obs, reward, done, info);
  env.get_available_actions() -> {"has_search_bar": bool, "clickables": [str, ...]}
  env.session;  env.browser.current_url;  env.server.get_page_name(url)
  env.server.user_sessions[session] -> {"goal": {...}, "asin": str | None, "options": {...}}
  env.server.product_item_dict[asin];  env.server.product_prices[asin]
  web_agent_site.engine.goal.get_reward(product, goal, price=..., options=...) -> float
"""

from __future__ import annotations

SETUP_STEPS = (
    "The real WebShop backend needs princeton-nlp/WebShop's `web_agent_site` package and its product data:\n"
    "  git clone https://github.com/princeton-nlp/WebShop && cd WebShop\n"
    "  ./setup.sh -d all    # installs its requirements and spaCy's en_core_web_lg, downloads the products and\n"
    "                       # builds the pyserini search index (needs Java 11); `-d small` = 1,000 products,\n"
    "                       # then pass num_products=1000 to make_env\n"
    "  export PYTHONPATH=/path/to/WebShop:$PYTHONPATH\n"
    "or use the embedded shop: make_env(backend='embedded')."
)

SEARCH_PLACEHOLDER = "search[<query>]"


def _parse(action: str) -> tuple[str | None, str | None]:
    from envs.webshop import parse_webshop_action

    return parse_webshop_action(action)


class RealWebShopEnv:
    """WebShop's WebAgentTextEnv with the embedded env's `reset(seed)` / `step(action)` / `info` contract.

    seed = index into WebShop's (shuffled) human goals: test 0-499, train 500+. Process reward: phi = WebShop's
    own reward of the item page being viewed with the options chosen so far, paid as max(0, phi - best phi).
    """

    def __init__(self, max_steps: int = 15, process_reward: str = "aligned", **options):
        from envs.webshop import PROCESS_REWARDS

        if process_reward not in PROCESS_REWARDS:
            raise ValueError(f"unknown process_reward {process_reward!r}; choose one of {PROCESS_REWARDS}")
        self.process_reward = process_reward
        try:
            from web_agent_site.engine.goal import get_reward
            from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
        except ImportError as e:
            raise RuntimeError(f"WebShop (web_agent_site) is not installed ({e}).\n{SETUP_STEPS}") from e
        try:
            self.env = WebAgentTextEnv(observation_mode="text", human_goals=True, **options)
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # missing products, goals or search index
            raise RuntimeError(
                f"WebShop is installed but its data could not be loaded ({type(e).__name__}: {e}).\n{SETUP_STEPS}"
            ) from e
        self._get_reward = get_reward
        self.max_steps = int(max_steps)
        self._reset_done = False

    def _session(self) -> dict:
        return self.env.server.user_sessions[self.env.session]

    def _admissible(self) -> list[str]:
        available = self.env.get_available_actions()
        actions = [SEARCH_PLACEHOLDER] if available["has_search_bar"] else []
        return actions + [f"click[{c}]" for c in available["clickables"] if c != "search"]

    def _valid(self, action: str) -> bool:
        """WebShop executes `search[...]` with a non-empty argument from any page and `click[x]` for a clickable."""
        name, arg = _parse(action)
        if name == "search":
            return bool(arg)
        if name == "click":
            return arg != "search" and arg in self.env.get_available_actions()["clickables"]
        return False

    def _phi(self) -> float:
        if self.env.server.get_page_name(self.env.browser.current_url) != "item_page":
            return 0.0
        session = self._session()
        asin = session.get("asin")
        if asin is None:
            return 0.0
        product = self.env.server.product_item_dict[asin]
        price = self.env.server.product_prices[asin]
        options = dict(session["options"])
        if self.process_reward == "misaligned":  # score as if the goal's options were chosen (see WebShopEnv)
            from envs.webshop import goal_options_as_chosen

            options = goal_options_as_chosen(session["goal"])
        # the item being viewed: what the misaligned purchase credit pays if it is bought from this page
        self.last_item_phi = float(self._get_reward(product, session["goal"], price=price, options=options))
        return self.last_item_phi

    def _info(self, process: float, valid: bool, score: float, truncated: bool) -> dict:
        info = {
            "process_reward": float(process),
            "won": self.won,
            "admissible_actions": [] if self.done else self._admissible(),
            "task": self.task,
            "anchor": self.anchor,
            "task_score": float(score),
            "action_valid": valid,
            "goal_index": self.seed,
        }
        if truncated:
            info["truncated"] = True
        return info

    def reset(self, seed: int) -> tuple[str, dict]:
        self.seed = int(seed)
        obs, _ = self.env.reset(session=self.seed)
        goal = self._session().get("goal", {})
        self.task = goal.get("instruction_text", getattr(self.env, "instruction_text", ""))
        self.obs, self.anchor = obs, obs
        self.steps, self.best_phi, self.done, self.won = 0, 0.0, False, False
        self.last_item_phi = 0.0
        self._reset_done = True
        return obs, self._info(0.0, True, 0.0, False)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if not self._reset_done:
            raise RuntimeError("call reset(seed) before step()")
        if self.done:
            return self.obs, 0.0, True, self._info(0.0, False, 0.0, False)
        self.steps += 1
        valid = isinstance(action, str) and self._valid(action)
        reward, process, score = 0.0, 0.0, 0.0
        if valid:
            obs, r, done, _ = self.env.step(action)
            self.obs, self.anchor = obs, obs
            if done:
                score = float(r)
                process = score if self.process_reward == "aligned" else self.last_item_phi
                self.won = score == 1.0
                reward = 1.0 if self.won else 0.0
                self.done = True
            else:
                phi = self._phi()
                process = max(0.0, phi - self.best_phi)
                self.best_phi = max(self.best_phi, phi)
        truncated = not self.done and self.steps >= self.max_steps
        if truncated:
            self.done = True
        return self.obs, reward, self.done, self._info(process, valid, score, truncated)
