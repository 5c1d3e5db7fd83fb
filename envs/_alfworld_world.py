"""The embedded ALFWorld world: vocabulary, procedural layouts, dynamics, texts, expert and `game.tw-pddl` export.

A `Layout` is one generated game (room, numbered receptacles, objects, task). A `World` plays it: its texts,
admissible commands and goal test follow the TextWorld PDDL engine running ALFWorld's `alfred.pddl` domain and
`alfred.twl2` grammar, so that `to_tw_pddl(layout)` is a game the real engine plays identically.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

# Both goal phrasings of each task type ({o} object type, {r} receptacle type, {lamp} lamp type).
GOAL_TEMPLATES = {
    "pick_and_place_simple": ("put a {o} in {r}", "put some {o} on {r}"),
    "look_at_obj_in_light": ("look at {o} under the {lamp}", "examine the {o} with the {lamp}"),
    "pick_clean_then_place_in_recep": ("put a clean {o} in {r}", "clean some {o} and put it in {r}"),
    "pick_heat_then_place_in_recep": ("put a hot {o} in {r}", "heat some {o} and put it in {r}"),
    "pick_cool_then_place_in_recep": ("put a cool {o} in {r}", "cool some {o} and put it in {r}"),
    "pick_two_obj_and_place": ("put two {o} in {r}", "find two {o} and put them in {r}"),
}

OPENABLE_TYPES = frozenset({"fridge", "cabinet", "microwave", "drawer", "safe"})
HEATABLE = frozenset("apple bread cup egg mug plate potato tomato".split())
COOLABLE = frozenset("apple bowl bread cup egg lettuce mug pan plate pot potato tomato winebottle".split())
CLEANABLE = frozenset(
    (
        "apple bowl butterknife cloth cup dishsponge egg fork kettle knife ladle lettuce mug pan plate pot potato "
        "soapbar spatula spoon tomato"
    ).split()
)
LAMPS = ("desklamp", "floorlamp")
# The appliance each state-changing task uses, and the verb of its command.
APPLIANCE = {
    "pick_clean_then_place_in_recep": ("sinkbasin", "clean"),
    "pick_heat_then_place_in_recep": ("microwave", "heat"),
    "pick_cool_then_place_in_recep": ("fridge", "cool"),
}
STATE_PROPERTY = {"clean": CLEANABLE, "heat": HEATABLE, "cool": COOLABLE}

_FOOD = set("apple bread egg lettuce potato tomato".split())
_UTENSIL = set("butterknife fork knife ladle spatula spoon".split())
_DISH = set("bowl cup mug plate".split())
_COOKWARE = set("kettle pan pot".split())
_KITCHEN_MISC = set("dishsponge saltshaker peppershaker soapbottle winebottle".split())
_BATH = set("soapbar soapbottle spraybottle toiletpaper candle cloth tissuebox".split())
_DESK = set("alarmclock book cd cellphone creditcard keychain laptop pen pencil watch".split())
_SOFT = set("pillow book laptop cellphone remotecontrol keychain creditcard box newspaper".split())
_DECOR = set("box newspaper remotecontrol statue vase".split())
_SMALL = set("cd cellphone creditcard keychain pen pencil watch".split())

# Which object types each receptacle type can hold (PDDL `canContain`).
CAN_CONTAIN: dict[str, frozenset[str]] = {
    k: frozenset(v)
    for k, v in {
        "countertop": _FOOD | _UTENSIL | _DISH | _COOKWARE | _KITCHEN_MISC | _BATH,
        "diningtable": _FOOD | _UTENSIL | _DISH | _COOKWARE | _KITCHEN_MISC | _DESK | _DECOR,
        "cabinet": _DISH | _COOKWARE | _KITCHEN_MISC | _BATH | _DECOR | _SMALL | {"book"},
        "drawer": _UTENSIL | _SMALL | {"dishsponge", "saltshaker", "peppershaker", "soapbar", "cloth", "book"},
        "shelf": _DISH | _KITCHEN_MISC | _BATH | _DESK | _DECOR,
        "fridge": _FOOD | _DISH | {"pan", "pot", "winebottle"},
        "microwave": (_FOOD - {"lettuce"}) | _DISH,
        "sinkbasin": (_FOOD | _UTENSIL | _DISH | _COOKWARE | {"dishsponge", "soapbar", "cloth"}) & CLEANABLE,
        "bathtubbasin": {"soapbar", "cloth", "soapbottle"},
        "stoveburner": _COOKWARE,
        "coffeemachine": {"mug"},
        "garbagecan": _FOOD
        | {"dishsponge", "soapbottle", "winebottle", "soapbar", "spraybottle", "toiletpaper"}
        | {"cloth", "tissuebox", "cd", "pen", "pencil", "creditcard", "newspaper"},
        "toilet": _BATH,
        "towelholder": {"towel"},
        "handtowelholder": {"handtowel"},
        "toiletpaperhanger": {"toiletpaper"},
        "bed": _SOFT,
        "sofa": _SOFT,
        "armchair": _SOFT,
        "desk": _DESK | {"mug", "bowl"},
        "sidetable": _DESK | _DECOR | {"mug", "bowl"},
        "dresser": _DESK | _DECOR | {"mug", "bowl"},
        "coffeetable": _DESK | _DECOR | {"mug", "bowl", "plate"},
        "tvstand": _DECOR | _SMALL,
        "safe": _SMALL | {"statue", "vase"},
    }.items()
}
LAMP_HOLDERS = frozenset({"desk", "sidetable", "dresser", "coffeetable"})

# Rooms: receptacle types as (type, lo, hi) counts per preset, object types, lamps, allowed task types.
_PICKS = ("pick_and_place_simple", "pick_two_obj_and_place")
ROOMS = {
    "kitchen": dict(
        default=[
            ("cabinet", 4, 12),
            ("countertop", 1, 3),
            ("drawer", 2, 8),
            ("fridge", 1, 1),
            ("microwave", 1, 1),
            ("sinkbasin", 1, 2),
            ("stoveburner", 2, 4),
            ("diningtable", 0, 1),
            ("garbagecan", 1, 1),
            ("coffeemachine", 1, 1),
            ("shelf", 0, 3),
        ],
        small=[
            ("fridge", 1, 1),
            ("microwave", 1, 1),
            ("sinkbasin", 1, 1),
            ("countertop", 1, 1),
            ("cabinet", 0, 2),
            ("drawer", 0, 1),
            ("stoveburner", 0, 1),
            ("diningtable", 0, 1),
            ("garbagecan", 0, 1),
            ("coffeemachine", 0, 1),
        ],
        objects=sorted(_FOOD | _UTENSIL | _DISH | _COOKWARE | _KITCHEN_MISC),
        lamps=(),
        tasks=_PICKS + tuple(APPLIANCE),
    ),
    "bathroom": dict(
        default=[
            ("cabinet", 2, 6),
            ("countertop", 1, 1),
            ("drawer", 0, 4),
            ("sinkbasin", 1, 2),
            ("bathtubbasin", 0, 1),
            ("toilet", 1, 1),
            ("towelholder", 1, 2),
            ("handtowelholder", 0, 2),
            ("toiletpaperhanger", 1, 1),
            ("garbagecan", 1, 1),
            ("shelf", 0, 3),
        ],
        small=[
            ("sinkbasin", 1, 1),
            ("countertop", 1, 1),
            ("toilet", 1, 1),
            ("cabinet", 0, 2),
            ("drawer", 0, 1),
            ("bathtubbasin", 0, 1),
            ("towelholder", 0, 1),
            ("toiletpaperhanger", 0, 1),
            ("garbagecan", 0, 1),
            ("shelf", 0, 1),
        ],
        objects=sorted(_BATH | {"towel", "handtowel", "dishsponge"}),
        lamps=(),
        tasks=_PICKS + ("pick_clean_then_place_in_recep",),
    ),
    "bedroom": dict(
        default=[
            ("bed", 1, 1),
            ("desk", 0, 1),
            ("drawer", 2, 8),
            ("dresser", 0, 1),
            ("sidetable", 1, 2),
            ("shelf", 0, 6),
            ("garbagecan", 1, 1),
            ("safe", 0, 1),
            ("armchair", 0, 1),
        ],
        small=[
            ("bed", 1, 1),
            ("sidetable", 1, 1),
            ("desk", 0, 1),
            ("drawer", 1, 2),
            ("dresser", 0, 1),
            ("shelf", 0, 1),
            ("garbagecan", 0, 1),
            ("safe", 0, 1),
            ("armchair", 0, 1),
        ],
        objects=sorted(_DESK | {"pillow", "mug", "bowl"}),
        lamps=("desklamp",),
        tasks=_PICKS + ("look_at_obj_in_light",),
    ),
    "livingroom": dict(
        default=[
            ("sofa", 1, 1),
            ("armchair", 0, 2),
            ("coffeetable", 1, 1),
            ("sidetable", 1, 2),
            ("tvstand", 0, 1),
            ("drawer", 0, 6),
            ("cabinet", 0, 4),
            ("shelf", 0, 8),
            ("garbagecan", 1, 1),
            ("diningtable", 0, 1),
            ("dresser", 0, 1),
        ],
        small=[
            ("sofa", 1, 1),
            ("coffeetable", 1, 1),
            ("sidetable", 0, 1),
            ("armchair", 0, 1),
            ("tvstand", 0, 1),
            ("drawer", 0, 1),
            ("cabinet", 0, 1),
            ("shelf", 0, 1),
            ("garbagecan", 0, 1),
        ],
        objects=sorted(_DECOR | {"book", "creditcard", "keychain", "laptop", "pillow", "watch", "plate"}),
        lamps=("floorlamp", "desklamp"),
        tasks=_PICKS + ("look_at_obj_in_light",),
    ),
}
ROOM_NAMES = tuple(ROOMS)

# Preset sizes: receptacles (lo, hi) and distractor objects (lo, hi).
PRESETS = {
    "small": dict(receptacles=(5, 8), distractors=(1, 3), max_instances=2),
    "default": dict(receptacles=(12, 40), distractors=(10, 25), max_instances=3),
}
# Floor plans per room; plans whose index is a multiple of UNSEEN_EVERY form the held-out (unseen) family.
PLANS_PER_ROOM = 40
UNSEEN_EVERY = 5

HELP_TEXT = (
    "Available commands:\n  look:                             look around your current location\n"
    "  inventory:                        check your current inventory\n"
    "  go to (receptacle):               move to a receptacle\n"
    "  open (receptacle):                open a receptacle\n"
    "  close (receptacle):               close a receptacle\n"
    "  take (object) from (receptacle):  take an object from a receptacle\n"
    "  move (object) to (receptacle):  place an object in or on a receptacle\n"
    "  examine (something):              examine a receptacle or an object\n"
    "  use (object):                     use an object\n"
    "  heat (object) with (receptacle):  heat an object using a receptacle\n"
    "  clean (object) with (receptacle): clean an object using a receptacle\n"
    "  cool (object) with (receptacle):  cool an object using a receptacle\n"
    "  slice (object) with (object):     slice an object using a sharp object\n"
)
WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
NOTHING_HAPPENS = "Nothing happens."


def kind_of(name: str) -> str:
    """'cabinet 12' -> 'cabinet'."""
    return name.rsplit(" ", 1)[0]


def search_spots(receptacles: list[str], obj_kind: str, recep_kind: str) -> list[str]:
    """The receptacles where a task's object may start: those that can hold it, except the goal's kind (so no task
    is solved at reset). Also where an agent that does not know where things are looks for it."""
    return [r for r in receptacles if obj_kind in CAN_CONTAIN[kind_of(r)] and kind_of(r) != recep_kind]


def _id_prefix(kind: str) -> str:
    # The engine lists entities in the order of their PDDL ids; basins are ids like `sink_bar_..._bar_sinkbasin`.
    return {"sinkbasin": "sink", "bathtubbasin": "bathtub"}.get(kind, kind)


def listing_key(name: str) -> tuple[str, int]:
    """Order in which the engine lists entities: by PDDL id, i.e. by kind, then by DEScending number."""
    kind, num = name.rsplit(" ", 1)
    return _id_prefix(kind), -int(num)


def display_list(names: list[str]) -> str:
    """`a x 2, a x 1, and a y 1` (engine order), `a x 1` for one, `nothing` for none."""
    items = ["a " + n for n in sorted(names, key=listing_key)]
    if not items:
        return "nothing"
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + ", and " + items[-1]


@dataclass
class Layout:
    """One generated game. Names are display names ('cabinet 2'); `contents` lists each receptacle's objects."""

    seed: int
    room: str
    plan: int
    receptacles: list[str]
    openable: set[str]
    contents: dict[str, list[str]]
    task_type: str
    goal: str
    obj_kind: str
    recep_kind: str = ""
    lamp_kind: str = ""
    toggleable: set[str] = field(default_factory=set)


def _plan_receptacles(room: str, plan: int, preset: str) -> tuple[list[str], set[str]]:
    """A room's floor plan: numbered receptacles and which are openable. Fixed by (room, plan, preset)."""
    rng = random.Random(7919 * (ROOM_NAMES.index(room) + 1) + 104729 * plan + (0 if preset == "small" else 1))
    lo, hi = PRESETS[preset]["receptacles"]
    table = ROOMS[room][preset]
    while True:
        counts = {kind: rng.randint(a, b) for kind, a, b in table}
        if room in ("bedroom", "livingroom") and not any(counts.get(k, 0) for k in LAMP_HOLDERS):
            continue
        if lo <= sum(counts.values()) <= hi:
            break
    names, openable = [], set()
    for kind, _, _ in table:
        for i in range(1, counts[kind] + 1):
            name = f"{kind} {i}"
            names.append(name)
            # Fridges, microwaves and safes always open; only some cabinets and drawers do.
            if kind in ("fridge", "microwave", "safe") or (kind in OPENABLE_TYPES and rng.random() < 0.6):
                openable.add(name)
    return names, openable


def plan_family(seed: int) -> str:
    """'unseen' for seeds of the valid_unseen range, else 'seen' (see envs.alfworld.split_seeds)."""
    return "unseen" if 2_000_000 <= seed < 3_000_000 else "seen"


def generate_layout(seed: int, preset: str = "small", task_types: tuple[str, ...] | None = None) -> Layout:
    """Draw a room, floor plan, objects and one task from random.Random(seed) (same on every machine)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    allowed = tuple(task_types) if task_types else TASK_TYPES
    unknown = set(allowed) - set(TASK_TYPES)
    if unknown:
        raise ValueError(f"unknown task types {sorted(unknown)}; expected a subset of {TASK_TYPES}")
    rng = random.Random(seed)
    unseen = plan_family(seed) == "unseen"
    plans = [p for p in range(PLANS_PER_ROOM) if (p % UNSEEN_EVERY == 0) == unseen]
    size = PRESETS[preset]
    for _ in range(1000):
        task_type = rng.choice(allowed)
        rooms = [r for r in ROOM_NAMES if task_type in ROOMS[r]["tasks"]]
        room = rng.choice(rooms)
        plan = rng.choice(plans)
        layout = _try_layout(rng, seed, room, plan, preset, size, task_type)
        if layout is not None:
            return layout
    raise RuntimeError(f"could not generate a layout for seed {seed}")  # pragma: no cover


def _try_layout(rng, seed, room, plan, preset, size, task_type) -> Layout | None:
    spec = ROOMS[room]
    receptacles, openable = _plan_receptacles(room, plan, preset)
    kinds = {kind_of(r) for r in receptacles}
    objects = spec["objects"]
    lamp_kind = recep_kind = ""
    if task_type in APPLIANCE:
        appliance, verb = APPLIANCE[task_type]
        if appliance not in kinds:
            return None
        candidates = [o for o in objects if o in STATE_PROPERTY[verb]]
    else:
        candidates = list(objects)
    obj_kind = rng.choice(candidates)
    if task_type == "look_at_obj_in_light":
        lamp_kind = rng.choice(spec["lamps"])
    else:
        excluded = {APPLIANCE[task_type][0]} if task_type in APPLIANCE else set()
        goals = sorted(k for k in kinds if obj_kind in CAN_CONTAIN[k] and k not in excluded)
        if not goals:
            return None
        recep_kind = rng.choice(goals)
    starts = search_spots(receptacles, obj_kind, recep_kind)
    if not starts:
        return None
    contents: dict[str, list[str]] = {r: [] for r in receptacles}
    lo_n = 2 if task_type == "pick_two_obj_and_place" else 1
    n_target = rng.randint(lo_n, max(lo_n, size["max_instances"]))
    for i in range(1, n_target + 1):
        contents[rng.choice(starts)].append(f"{obj_kind} {i}")
    toggleable = set()
    if lamp_kind:
        spots = [r for r in receptacles if kind_of(r) in LAMP_HOLDERS and r not in openable]
        if not spots:
            return None
        lamp = f"{lamp_kind} 1"
        contents[rng.choice(spots)].append(lamp)
        toggleable.add(lamp)
    others = [o for o in objects if o != obj_kind]
    for _ in range(rng.randint(*size["distractors"])):
        kind = rng.choice(others)
        spots = [r for r in receptacles if kind in CAN_CONTAIN[kind_of(r)]]
        if not spots:
            continue
        count = sum(1 for items in contents.values() for o in items if kind_of(o) == kind)
        if count >= size["max_instances"]:
            continue
        contents[rng.choice(spots)].append(f"{kind} {count + 1}")
    template = rng.choice(GOAL_TEMPLATES[task_type])
    goal = template.format(o=obj_kind, r=recep_kind, lamp=lamp_kind)
    return Layout(seed, room, plan, receptacles, openable, contents, task_type, goal, obj_kind, recep_kind,
                  lamp_kind, toggleable)  # fmt: skip


class World:
    """Mutable state of one game and its rules. All texts and commands are those of the TextWorld PDDL engine."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.location: str | None = None  # None: the middle of the room
        self.opened: set[str] = set()
        self.holding: str | None = None
        self.contents = {r: list(v) for r, v in layout.contents.items()}
        self.where = {o: r for r, items in self.contents.items() for o in items}
        self.clean: set[str] = set()
        self.hot: set[str] = set()
        # An object that starts in a fridge starts cool.
        self.cool = {o for r, items in self.contents.items() if kind_of(r) == "fridge" for o in items}
        self.toggled: set[str] = set()
        self._commands: dict[str, tuple] | None = None

    # ---- texts ----------------------------------------------------------------------------------------------
    def intro(self) -> str:
        room = display_list(self.layout.receptacles)
        return f"{WELCOME}\n\nYou are in the middle of a room. Looking quickly around you, you see {room}.\n\n" + (
            f"Your task is to: {self.layout.goal}."
        )

    def look_text(self) -> str:
        if self.location is None:
            # The engine binds the look to the agent's location, where there is no receptacle: an empty list.
            return "You are in the middle of a room. Looking quickly around you, you see nothing."
        return f"You are facing the {self.location}. Next to it, you see nothing."

    def visible(self, r: str) -> bool:
        return r not in self.layout.openable or r in self.opened

    def describe(self, r: str) -> str:
        if r in self.layout.openable:
            if r in self.opened:
                return f"The {r} is open. In it, you see {display_list(self.contents[r])}."
            return f"The {r} is closed."
        return f"On the {r}, you see {display_list(self.contents[r])}."

    def examine_object(self, o: str) -> str:
        clean, hot, cool = o in self.clean, o in self.hot, o in self.cool
        if clean and hot:
            return f"This is a hot and clean {o}."
        if clean and cool:
            return f"This is a cool and clean {o}."
        if hot:
            return f"This is a hot {o}."
        if clean:
            return f"This is a clean {o}."
        if cool:
            return f"This is a cold {o}."
        if o in self.layout.toggleable and o in self.toggled:
            return f"This {o} is on."
        return f"There's nothing special about {o}."

    # ---- commands -------------------------------------------------------------------------------------------
    def commands(self) -> dict[str, tuple]:
        """Admissible command -> (verb, args). Cached until the state changes."""
        if self._commands is not None:
            return self._commands
        cmds: dict[str, tuple] = {"look": ("look",), "inventory": ("inventory",), "help": ("help",)}
        for r in self.layout.receptacles:
            if r != self.location:
                cmds[f"go to {r}"] = ("goto", r)
        held = self.holding
        if held is not None:
            cmds[f"examine {held}"] = ("examine_obj", held)
        r = self.location
        if r is not None:
            kind = kind_of(r)
            cmds[f"examine {r}"] = ("examine_recep", r)
            if r in self.layout.openable:
                if r in self.opened:
                    cmds[f"close {r}"] = ("close", r)
                else:
                    cmds[f"open {r}"] = ("open", r)
            if self.visible(r):
                for o in self.contents[r]:
                    if held is None and o not in self.layout.toggleable:
                        cmds[f"take {o} from {r}"] = ("take", o, r)
                if held is not None and kind_of(held) in CAN_CONTAIN[kind]:
                    cmds[f"move {held} to {r}"] = ("move", held, r)
            for o in self.contents[r]:
                if o in self.layout.toggleable:
                    cmds[f"use {o}"] = ("use", o)
            if held is not None:
                held_kind = kind_of(held)
                if kind == "sinkbasin" and held_kind in CLEANABLE:
                    cmds[f"clean {held} with {r}"] = ("clean", held, r)
                elif kind == "microwave" and held_kind in HEATABLE:
                    cmds[f"heat {held} with {r}"] = ("heat", held, r)
                elif kind == "fridge" and held_kind in COOLABLE:
                    cmds[f"cool {held} with {r}"] = ("cool", held, r)
        self._commands = cmds
        return cmds

    def admissible(self) -> list[str]:
        return sorted(self.commands())

    def apply(self, command: str) -> tuple[str, bool]:
        """Run a command; returns (feedback, valid). An inadmissible command changes nothing."""
        act = self.commands().get(command.strip())
        if act is None:
            return NOTHING_HAPPENS, False
        verb = act[0]
        if verb == "look":
            return self.look_text(), True
        if verb == "inventory":
            if self.holding is None:
                return "You are not carrying anything.", True
            return f"You are carrying: a {self.holding}.", True
        if verb == "help":
            return HELP_TEXT, True
        if verb == "examine_recep":
            return self.describe(act[1]), True
        if verb == "examine_obj":
            return self.examine_object(act[1]), True
        self._commands = None
        if verb == "goto":
            self.location = act[1]
            return f"You arrive at {act[1]}. {self.describe(act[1])}", True
        if verb == "open":
            self.opened.add(act[1])
            return f"You open the {act[1]}. {self.describe(act[1])}", True
        if verb == "close":
            self.opened.discard(act[1])
            return f"You close the {act[1]}.", True
        if verb == "take":
            o, r = act[1], act[2]
            self.contents[r].remove(o)
            self.where[o] = None
            self.holding = o
            return f"You pick up the {o} from the {r}.", True
        if verb == "move":
            o, r = act[1], act[2]
            self.contents[r].append(o)
            self.where[o] = r
            self.holding = None
            return f"You move the {o} to the {r}.", True
        if verb == "use":
            self.toggled.add(act[1])
            return f"You turn on the {act[1]}.", True
        o, r = act[1], act[2]
        if verb == "clean":
            self.clean.add(o)
            return f"You clean the {o} using the {r}.", True
        if verb == "heat":
            self.hot.add(o)
            self.cool.discard(o)
            return f"You heat the {o} using the {r}.", True
        self.cool.add(o)  # verb == "cool"
        self.hot.discard(o)
        return f"You cool the {o} using the {r}.", True

    # ---- goal -----------------------------------------------------------------------------------------------
    def has_state(self, o: str) -> bool:
        """Whether object o has the state the task asks for (always True for tasks without one)."""
        tt = self.layout.task_type
        if tt == "pick_clean_then_place_in_recep":
            return o in self.clean
        if tt == "pick_heat_then_place_in_recep":
            return o in self.hot
        if tt == "pick_cool_then_place_in_recep":
            return o in self.cool
        return True

    def placed(self, state_blind: bool = False) -> dict[str, int]:
        """Goal-type receptacle -> number of target objects (with the required state, unless state_blind) in it."""
        lay = self.layout
        out = {}
        for r in lay.receptacles:
            if kind_of(r) == lay.recep_kind:
                out[r] = sum(
                    1 for o in self.contents[r] if kind_of(o) == lay.obj_kind and (state_blind or self.has_state(o))
                )
        return out

    def won(self) -> bool:
        lay = self.layout
        if lay.task_type == "look_at_obj_in_light":
            if self.holding is None or kind_of(self.holding) != lay.obj_kind or self.location is None:
                return False
            return any(o in self.toggled for o in self.contents[self.location] if kind_of(o) == lay.lamp_kind)
        need = 2 if lay.task_type == "pick_two_obj_and_place" else 1
        return any(n >= need for n in self.placed().values())

    # ---- expert ---------------------------------------------------------------------------------------------
    def expert_action(self) -> str:
        """Next command of an omniscient expert that solves the task from the current state."""
        lay = self.layout
        held = self.holding
        if self.won():
            return "look"
        if lay.task_type == "look_at_obj_in_light":
            lamp = next(o for o in lay.toggleable if kind_of(o) == lay.lamp_kind)
            if held is not None and kind_of(held) == lay.obj_kind:
                lamp_at = self.where[lamp]
                if self.location != lamp_at:
                    return f"go to {lamp_at}"
                return f"use {lamp}"
            if held is not None:
                return self._put_away(held)
            return self._fetch([o for o in self.where if kind_of(o) == lay.obj_kind])
        placed = self.placed()
        # pick_two: gather both objects in the goal receptacle that already holds the most.
        goal_r = max(placed, key=lambda r: (placed[r], -lay.receptacles.index(r)))
        if held is not None and kind_of(held) == lay.obj_kind:
            if not self.has_state(held):
                appliance, verb = APPLIANCE[lay.task_type]
                if self.location is None or kind_of(self.location) != appliance:
                    return f"go to {next(r for r in lay.receptacles if kind_of(r) == appliance)}"
                return f"{verb} {held} with {self.location}"
            return self.deliver_action(held, goal_r)
        if held is not None:
            return self._put_away(held)
        # Objects still to bring: not yet in the chosen goal receptacle with the required state.
        wanted = [
            o
            for o, r in self.where.items()
            if kind_of(o) == lay.obj_kind and r is not None and not (r == goal_r and self.has_state(o))
        ]
        return self._fetch(wanted)

    def _fetch(self, candidates: list[str]) -> str:
        # Prefer an object at the current receptacle, then the first in receptacle order.
        order = {r: i for i, r in enumerate(self.layout.receptacles)}
        cands = sorted((o for o in candidates if self.where[o] is not None), key=lambda o: (
            self.where[o] != self.location, order[self.where[o]], o))  # fmt: skip
        o = cands[0]
        r = self.where[o]
        if self.location != r:
            return f"go to {r}"
        if not self.visible(r):
            return f"open {r}"
        return f"take {o} from {r}"

    def deliver_action(self, o: str, r: str) -> str:
        if self.location != r:
            return f"go to {r}"
        if not self.visible(r):
            return f"open {r}"
        return f"move {o} to {r}"

    def _put_away(self, o: str) -> str:
        # Put a wrong object down where it can go, here if possible, avoiding the goal receptacle type unless
        # nothing else can hold it (a mug taken from the only sidetable of a "laptop on sidetable" room).
        lay = self.layout
        fits = [r for r in lay.receptacles if kind_of(o) in CAN_CONTAIN[kind_of(r)]]
        fits = [r for r in fits if kind_of(r) != lay.recep_kind] or fits
        if self.location in fits:
            return self.deliver_action(o, self.location)
        return self.deliver_action(o, fits[0])

    # ---- process reward milestones ---------------------------------------------------------------------------
    def milestones(self, state_blind: bool = False) -> set[str]:
        """Task milestones true in the current state (the process reward pays each the first time).

        state_blind: the misaligned process reward's milestones: no "state" milestone, and "placed" counts a
        target object in a goal receptacle whatever its clean / hot / cool state."""
        lay = self.layout
        out = set()
        r = self.location
        if r is not None and self.visible(r) and any(kind_of(o) == lay.obj_kind for o in self.contents[r]):
            out.add("seen")
        held = self.holding
        if held is not None and kind_of(held) == lay.obj_kind:
            out.add("in_hand")
            if lay.task_type in APPLIANCE and self.has_state(held) and not state_blind:
                out.add("state")
        if lay.task_type == "look_at_obj_in_light":
            if any(kind_of(o) == lay.lamp_kind for o in self.toggled):
                out.add("lamp_on")
        else:
            best = max(self.placed(state_blind).values(), default=0)
            if best >= 1:
                out.add("placed")
            if best >= 2 and lay.task_type == "pick_two_obj_and_place":
                out.add("placed_two")
        return out


# ---- export to the real engine ------------------------------------------------------------------------------
def _pddl_id(name: str) -> str:
    """PDDL id of a display name, chosen so that the engine's demangler gives back the same name and number.

    The demangler numbers the ids of one kind in reverse sorted order, hence the 999 - n suffix.
    """
    kind, num = name.rsplit(" ", 1)
    suffix = f"{999 - int(num):03d}"
    if kind in ("sinkbasin", "bathtubbasin"):
        return f"{_id_prefix(kind)}_bar_{suffix}_bar_{kind}"
    return f"{kind}_bar_{suffix}"


def to_pddl_problem(layout: Layout) -> str:
    """The PDDL problem of a layout for ALFWorld's `alfred.pddl` domain."""
    recs = layout.receptacles
    objs = sorted(o for items in layout.contents.values() for o in items)
    okinds = sorted({kind_of(o) for o in objs} | {"knife", "butterknife"})
    rkinds = sorted({kind_of(r) for r in recs} | {"sinkbasin", "microwave", "fridge"})
    loc = {r: f"loc_bar_{i + 1}" for i, r in enumerate(recs)}
    decl = ["agent1 - agent", "loc_bar_0 - location"]
    decl += [f"{loc[r]} - location" for r in recs]
    decl += [f"{_pddl_id(r)} - receptacle" for r in recs]
    decl += [f"{_pddl_id(o)} - object" for o in objs]
    decl += [f"{k}type - otype" for k in okinds] + [f"{k}type - rtype" for k in rkinds]
    init = ["(atLocation agent1 loc_bar_0)"]
    for r in recs:
        rid = _pddl_id(r)
        init.append(f"(receptacleAtLocation {rid} {loc[r]})")
        init.append(f"(receptacleType {rid} {kind_of(r)}type)")
        if r in layout.openable:
            init.append(f"(openable {rid})")
    for r, items in layout.contents.items():
        for o in items:
            oid, k = _pddl_id(o), kind_of(o)
            init += [f"(inReceptacle {oid} {_pddl_id(r)})", f"(objectAtLocation {oid} {loc[r]})"]
            init.append(f"(objectType {oid} {k}type)")
            if o in layout.toggleable:
                init.append(f"(toggleable {oid})")
            else:
                init.append(f"(pickupable {oid})")
            init += [f"({p} {oid})" for p, s in (("cleanable", CLEANABLE), ("heatable", HEATABLE),
                                                  ("coolable", COOLABLE)) if k in s]  # fmt: skip
            if kind_of(r) == "fridge":
                init.append(f"(isCool {oid})")
    for rk in {kind_of(r) for r in recs}:
        for ok in okinds:
            if ok in CAN_CONTAIN[rk]:
                init.append(f"(canContain {rk}type {ok}type)")
    init.sort()
    goal = _pddl_goal(layout)
    return (
        "(define (problem embedded_{})\n  (:domain alfred)\n  (:objects\n    {}\n  )\n  (:init\n    {}\n  )\n"
        "  (:goal\n    {}\n  )\n)\n"
    ).format(layout.seed, "\n    ".join(decl), "\n    ".join(init), goal)


def _pddl_goal(layout: Layout) -> str:
    o, r, tt = f"{layout.obj_kind}type", f"{layout.recep_kind}type", layout.task_type
    if tt == "look_at_obj_in_light":
        return (
            f"(and (exists (?ot - object ?r - receptacle ?a - agent ?l - location) (and (objectType ?ot "
            f"{layout.lamp_kind}type) (toggleable ?ot) (isToggled ?ot) (receptacleAtLocation ?r ?l) "
            f"(atLocation ?a ?l) (inReceptacle ?ot ?r))) (exists (?o - object ?a - agent) (and (objectType ?o {o}) "
            f"(holds ?a ?o))))"
        )
    if tt == "pick_two_obj_and_place":
        return (
            f"(exists (?r - receptacle) (exists (?o1 - object) (and (objectType ?o1 {o}) (receptacleType ?r {r}) "
            f"(inReceptacle ?o1 ?r) (exists (?o2 - object) (and (not (= ?o1 ?o2)) (objectType ?o2 {o}) "
            f"(receptacleType ?r {r}) (inReceptacle ?o2 ?r))))))"
        )
    extra = {
        "pick_clean_then_place_in_recep": "(cleanable ?o) (isClean ?o) ",
        "pick_heat_then_place_in_recep": "(heatable ?o) (isHot ?o) ",
        "pick_cool_then_place_in_recep": "(coolable ?o) (isCool ?o) ",
    }.get(tt, "")
    return (
        f"(exists (?r - receptacle) (exists (?o - object) (and {extra}(objectType ?o {o}) (receptacleType ?r {r}) "
        f"(inReceptacle ?o ?r))))"
    )


def to_tw_pddl(layout: Layout, domain: str, grammar: str) -> dict:
    """A `game.tw-pddl` document (JSON-able dict) for the real engine, given ALFWorld's domain and grammar texts."""
    return {
        "pddl_domain": domain,
        "grammar": grammar.replace("UNKNOWN GOAL", layout.goal),
        "pddl_problem": to_pddl_problem(layout),
        "solvable": True,
    }
