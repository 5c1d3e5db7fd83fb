"""benchmarks/explorer_edge.py: the pooled link between agent B's edge and swap's gain, against hand-computed numbers."""

import importlib.util
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("explorer_edge", ROOT / "benchmarks" / "explorer_edge.py")
edge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(edge)


def test_pearson_ci95_by_hand():
    # deviations (-2,-1,0,1,2) and (-1,-2,1,0,2): r = 8 / sqrt(10 * 10) = 0.8; Fisher half-width 1.96 / sqrt(5 - 3)
    r, low, high = edge.pearson_ci95([1, 2, 3, 4, 5], [2, 1, 4, 3, 5])
    assert r == pytest.approx(0.8)
    assert low == pytest.approx(math.tanh(math.atanh(0.8) - 1.96 / math.sqrt(2)))
    assert (low, high) == pytest.approx((-0.2796, 0.9861), abs=1e-4)


def by_seed(pairs, pair, seed):
    (hit,) = [p for p in pairs if p[1] == pair and p[2] == seed]
    return hit[3:]


def test_pairs_from_a_table_use_its_larger_re_evaluation():
    # converged_grpo_webshop_10 seed 1: B 0.0699, swap policy 0.0533, outcome policy 0.1278 (sampled, run means);
    # on the 500 test goals swap 0.146, outcome 0.184 (not the 200-goal 0.17 and 0.22)
    label, path, final, match = edge.SETS[0]
    x, x_outcome, y = by_seed(edge.pairs_of(label, path, final, match), "grpo_webshop", 1)
    assert (x, x_outcome, y) == pytest.approx((0.0699 - 0.0533, 0.0699 - 0.1278, 0.146 - 0.184))


def test_pairs_from_a_probe_pick_its_setting_and_borrow_outcome_runs():
    sets = {label: (path, final, match) for label, path, final, match in edge.SETS}
    # probe 16, G_off 2, seed 3: swap 0.248 (B 0.1223, policy 0.125); the file's outcome run 0.174 (policy 0.178),
    # not one of the other settings' swap runs of seed 3 (0.166, 0.244)
    x, x_outcome, y = by_seed(edge.pairs_of("p16", *sets["probe 16, G_off 2"]), "grpo_webshop", 3)
    assert (x, x_outcome, y) == pytest.approx((0.1223 - 0.125, 0.1223 - 0.178, 0.248 - 0.174))
    # probe 17 has no outcome runs of its own: seed 3's swap 0.194 (B 0.1196, policy 0.1375) against probe 16's
    x, x_outcome, y = by_seed(edge.pairs_of("p17", *sets["probe 17, B at 0.7"]), "grpo_webshop", 3)
    assert (x, x_outcome, y) == pytest.approx((0.1196 - 0.1375, 0.1196 - 0.178, 0.194 - 0.174))
    # probe 25's file holds outcome runs of seeds 6-10 only; its swap of seed 4 (0.342; B 0.1818, policy 0.1307)
    # pairs with probe 22's outcome run (0.192, policy 0.1195)
    x, x_outcome, y = by_seed(edge.pairs_of("p25", *sets["probe 25, GiGPO, B milestone"]), "gigpo_webshop", 4)
    assert (x, x_outcome, y) == pytest.approx((0.1818 - 0.1307, 0.1818 - 0.1195, 0.342 - 0.192))
    # probe 27's swap of seed 2 (0.274; B 0.1113, policy 0.1367) pairs with probe 26's two-rollout outcome run (0.206,
    # policy 0.1904), not with the four-rollout ones of probe 18
    label = "probe 27, G 2 + 2, B milestone w/o options"
    x, x_outcome, y = by_seed(edge.pairs_of(label, *sets[label]), "grpo_webshop", 2)
    assert (x, x_outcome, y) == pytest.approx((0.1113 - 0.1367, 0.1113 - 0.1904, 0.274 - 0.206))
    # probe 28's swap of seed 8 (0.056; B 0.0717, policy 0.1379, its largest lag) against its own file's outcome
    # run (0.058, policy 0.0954), not probe 27's outcome run of seed 8 (relevance order)
    label = "probe 28, GiGPO, price order, G 2 + 2, B milestone w/o options"
    x, x_outcome, y = by_seed(edge.pairs_of(label, *sets[label]), "gigpo_webshop", 8)
    assert (x, x_outcome, y) == pytest.approx((0.0717 - 0.1379, 0.0717 - 0.0954, 0.056 - 0.058))


def test_premise_differences_pair_process_and_outcome_runs_by_seed():
    premise = dict(edge.PREMISE)
    d = edge.premise_differences(premise["GRPO/WebShop"])
    # seed 1: process (aligned) sampled 0.1071, validation 0.184; probe 18's outcome-only 0.1278 and 0.168
    assert len(d["success"]) == 10
    assert (d["train_success_all"][0], d["success"][0]) == pytest.approx((0.1071 - 0.1278, 0.184 - 0.168))
    d = edge.premise_differences(premise["PPO/ALFWorld"])
    # seed 1's outcome-only run is probe 20's (0.200), seed 4's sits in probe 21's own file (0.190)
    assert d["success"] == pytest.approx([0.145 - 0.200, 0.170 - 0.190, 0.195 - 0.165, 0.155 - 0.190, 0.160 - 0.160])
    # probe 23 holds both variants in one file (its swap runs are not read here): validation 0.170 - 0.205, ...
    d = edge.premise_differences(premise["GiGPO/ALFWorld"])
    assert d["success"] == pytest.approx([0.170 - 0.205, 0.200 - 0.165, 0.150 - 0.190, 0.165 - 0.195, 0.165 - 0.200])
    # probe 25 under GiGPO: outcome-only seeds 1-5 from probe 22, 6-10 from its own file (validation success)
    d = edge.premise_differences(premise["GiGPO/WebShop, milestone"])
    assert len(d["success"]) == 10
    assert [d["success"][i] for i in (0, 5, 8)] == pytest.approx([0.200 - 0.220, 0.194 - 0.214, 0.206 - 0.108])
    # probe 26 (two rollouts per task): seed 7's milestone run 0.306 against its own file's outcome-only run 0.182
    d = edge.premise_differences(premise["GRPO/WebShop, milestone, G 2"])
    assert (len(d["success"]), d["success"][6]) == (10, pytest.approx(0.306 - 0.182))
    # probe 27: seed 10's run on the milestone reward without options 0.086 against probe 26's outcome-only run 0.208
    d = edge.premise_differences(premise["GRPO/WebShop, milestone w/o options, G 2"])
    assert (len(d["success"]), d["success"][9]) == (10, pytest.approx(0.086 - 0.208))
    # probe 27 under GiGPO holds both variants: seed 9, the one seed in which process-only led, 0.186 against 0.162
    d = edge.premise_differences(premise["GiGPO/WebShop, milestone w/o options, G 2"])
    assert (len(d["success"]), d["success"][8]) == (10, pytest.approx(0.186 - 0.162))
    # probe 28 (price order): seed 6, process-only 0.032 against outcome-only 0.054 on validation
    d = edge.premise_differences(premise["GiGPO/WebShop, milestone w/o options, G 2, price order"])
    assert (len(d["success"]), d["success"][5]) == (10, pytest.approx(0.032 - 0.054))
