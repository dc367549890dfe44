"""Helpers of ``experiments/real_models.py`` that need no checkpoint (fast; the sections end to end are
`test_real_experiments.py`, slow)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def section_module(monkeypatch, name: str):
    """``experiments/real/<name>.py``, imported as its command imports it: with ``experiments/`` first on the path."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    return importlib.import_module(f"real.{name}")


@pytest.fixture
def rerope(monkeypatch):
    """Section 10's module."""
    return section_module(monkeypatch, "rerope")


def test_section_9s_seed_0_cells_stand_in_and_say_so(rerope, tmp_path):
    yarn_16k = {"acc,none": 2 / 3, "key_loglikelihood,none": -1.13}
    (tmp_path / "recall.json").write_text(json.dumps({"YaRN": {"hfa_passkey_16k": yarn_16k}}))
    section_9 = rerope.section_9_results(tmp_path)
    assert rerope.section_9_cell(section_9, "YaRN", "hfa_passkey_16k", 0) == {**yarn_16k, "from": "section 9"}
    assert rerope.section_9_cell(section_9, "YaRN", "hfa_passkey_16k", 1) is None  # section 9 ran seed 0 only
    assert rerope.section_9_cell(section_9, "YaRN", "hfa_passkey_32k", 0) is None
    assert rerope.section_9_cell(section_9, "ReRoPE w2048 + logn", "hfa_passkey_16k", 0) is None
    assert (
        rerope.section_9_cell(rerope.section_9_results(tmp_path / "none"), "YaRN", "hfa_passkey_16k", 0)
        is None
    )

    seed_1 = {"acc,none": 1 / 3, "key_loglikelihood,none": -2.25, "seconds": 474.0, "peak_gib": 10.2}
    table = {label: {} for label in rerope.methods()}
    table["YaRN"] = {("hfa_passkey_16k", 0): rerope.section_9_cell(section_9, "YaRN", "hfa_passkey_16k", 0)}
    table["unpatched"] = {
        ("hfa_passkey_16k", 0): rerope.section_9_cell(section_9, "YaRN", "hfa_passkey_16k", 0)
    }
    table["unpatched"][("hfa_passkey_16k", 1)] = seed_1
    text = rerope.report(table, {16384: "hfa_passkey_16k"}, (0.0, 0.5, 1.0), (0, 1, 2), 32768, tmp_path)
    assert "| YaRN | 2/3 (-1.13) |" in text and "| unpatched | 3/6 (-1.69) |" in text
    cost = text.split("Time per prompt set")[1]
    assert "| YaRN | section 9 | not run |" in cost  # reused: no time of its own
    assert "| unpatched | 474 s, 10.2 GiB | not run |" in cost  # the mean of the cells timed here only
    assert "| ReRoPE w2048 | not run |" in cost and (tmp_path / "rerope.png").stat().st_size > 10_000


def test_a_run_on_a_machine_without_the_kept_cells_takes_them_from_the_last_report(rerope, tmp_path):
    timed = {
        "acc,none": 1 / 3,
        "key_loglikelihood,none": -2.0646947224934897,
        "seconds": 703.3,
        "peak_gib": 11.2,
    }
    table = {label: {} for label in rerope.methods()}
    table["ReRoPE w1024"][("hfa_passkey_16k", 1)] = timed
    rerope.report(table, {16384: "hfa_passkey_16k"}, (0.0, 0.5, 1.0), (0, 1, 2), 32768, tmp_path)
    reported = rerope.reported_results(tmp_path)
    assert rerope.reported_cell(reported, "ReRoPE w1024", "hfa_passkey_16k", 1) == timed  # every digit back
    assert rerope.reported_cell(reported, "ReRoPE w1024", "hfa_passkey_16k", 2) is None
    assert rerope.reported_cell(reported, "YaRN", "hfa_passkey_16k", 1) is None
    assert rerope.reported_results(tmp_path / "none") == {}


@pytest.fixture
def eightx(monkeypatch):
    """Section 12's module."""
    return section_module(monkeypatch, "eightx")


def test_section_12_reads_every_document_before_the_other_passkeys_and_draws_those_read(eightx, tmp_path):
    order = eightx.cells()
    first, *others = eightx.methods()
    assert {m for m, _, _ in order[:3]} == {first}
    assert [task for _, task, _ in order[:3]] == [eightx.PASSKEYS] * 3
    assert [(m, task) for m, task, _ in order[3:8]] == [(m, eightx.DOCUMENT) for m in eightx.methods()]
    assert {m for m, _, _ in order[8:]} == set(others) and len(order) == 20
    buckets = ("0-2k", "2k-4k", "4k-8k", "8k-16k", "16k-32k", "32k+")  # as the task reports them
    document = {f"ppl_{b},none": v for b, v in zip(buckets, (4.4, 7.3, 6.2, 9.2, 11.5, 7_000.0))}
    document |= {f"ppl_{b}_stderr,none": "N/A" for b in buckets}
    text = eightx.report(
        {(first, eightx.DOCUMENT, 0.0): {**document, "seconds": 1.0, "peak_gib": 3.0}}, tmp_path
    )
    assert "| method | positions 0-2k |" in text and "| positions 32k+ |\n" in text
    assert f"| {first} | 4.40 | 7.30 | 6.20 | 9.20 | 11.50 | 7,000.00 |" in text
    assert "| unpatched | not run |" in text and (tmp_path / "eightx.png").stat().st_size > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "(no document read yet)" in eightx.report({}, empty) and not (empty / "eightx.png").exists()


@pytest.fixture
def depth100(monkeypatch):
    """Section 10b's module."""
    return section_module(monkeypatch, "depth100")


def test_section_10b_runs_each_tier_over_every_seed_before_the_next(depth100):
    order = depth100.cells()
    assert len(order) == len(set(order)) == 80
    assert order[:3] == [("unpatched", 4096, seed) for seed in (0, 1, 2)]
    past = [cell for cell in order if cell[1] > 8192 and cell[0] in depth100.rerope.methods()]
    tiers = [set(depth100.GOAL_ORDER[:2]), set(depth100.GOAL_ORDER[2:]), set(depth100.rerope.methods())]
    tiers[2] -= tiers[0] | tiers[1]
    sizes = [len(tier) * 6 for tier in tiers]  # 2 lengths x 3 seeds each
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    for tier, start, size in zip(tiers, starts, sizes):
        block = past[start : start + size]
        assert {label for label, _, _ in block} == tier
        runs = [(seed > 0, n > 16384) for _, n, seed in block]  # seed 0 first, then 16k before 32k
        assert runs == sorted(runs)


@pytest.fixture
def ruler(monkeypatch):
    """Section 13's module."""
    return section_module(monkeypatch, "ruler")


def test_section_13_reads_the_ceiling_first_then_what_it_leaves_past_it(ruler):
    first = ruler.cells({})
    assert first[:12] == [("unpatched", task, n) for n in (4096, 8192) for task in ruler.SYNTHETIC]
    assert (
        len(first) == 12 + 8 * 6 + 3 * 6
    )  # every task at 16k and, until 16k is in, the first three methods at 32k
    at_8k = {
        ("unpatched", task, 8192): {"score": 0.0 if task.startswith("niah_multikey") else 0.1}
        for task in ruler.SYNTHETIC
    }
    tasks = [task for task in ruler.SYNTHETIC if not task.startswith("niah_multikey")]
    decided = ruler.cells(at_8k)
    assert {task for _, task, n in decided if n > 8192} == set(tasks)
    scores = dict(zip(ruler.methods(), (0.1, 0.5, 0.3, 0.9, 0.0, 0.2, 0.4, 0.6)))
    at_16k = {(label, task, 16384): {"score": scores[label]} for label in ruler.methods() for task in tasks}
    best = [label for label, _, n in ruler.cells({**at_8k, **at_16k}) if n == 32768]
    assert best[:: len(tasks)] == ["Self-Extend G5 w2048 + logn", "DCA s6144 l512", "unpatched"]


def test_section_13s_intervals_hold_their_means(ruler):
    low, high = ruler.interval([1.0] * 20)
    assert 0.83 < low < 0.84 and high == 1.0  # Wilson's, 20 of 20
    low, high = ruler.interval([0.0, 0.5, 1.0, 0.25, 0.75] * 2)
    assert low < 0.5 < high and low >= 0.0 and high <= 1.0


@pytest.fixture
def gemma(monkeypatch):
    """Section 14's module."""
    return section_module(monkeypatch, "gemma")


def test_section_14_runs_in_the_issues_order_and_picks_the_best_for_the_longer_cells(gemma, tmp_path):
    order = gemma.cells({})
    names = gemma.METHOD_NAMES
    first = [(m, 32768, d, 0) for m in names for d in gemma.DEPTHS[:2] if (m, d) != ("dynamic NTK", 0.5)]
    assert order[: len(first)] == first  # dynamic NTK inside 32k: one cell, as it scales nothing there
    assert order[len(first) : len(first) + len(names) - 1] == [
        (m, 32768, 1.0, 0) for m in names if m != "dynamic NTK"
    ]
    assert not any(m == "dynamic NTK" and n <= 32768 and d > 0 for m, n, d, _ in order)
    later = [(n, s) for _, n, d, s in order[len(first) + len(names) - 1 :] if d >= 0]
    assert later[: later.index((16384, 0))] == [
        (32768, s) for s in (1, 2) for _ in range(3 * (len(names) - 1))
    ]
    document = order.index((names[0], gemma.DOCUMENT_TOKENS, -1.0, 0))
    assert {n for _, n, _, _ in order[:document]} == {32768, 16384}
    assert {n for _, n, _, _ in order[document + len(names) :]} == {65536, 131072}
    # at 32k, DCA finds every key and STRING two: they and the next by log-likelihood read 128k
    results = {}
    for name in names:
        for depth in gemma.DEPTHS:
            found = name == "DCA s24576 l2048" or (name.startswith("STRING") and depth > 0)
            loglik = -1.0 if found else -3.0 - names.index(name) / 10
            results[(name, 32768, depth, 0)] = {"acc,none": float(found), "key_loglikelihood,none": loglik}
    best = gemma.ranked(results, (32768, 65536))[: gemma.BEST_OF]
    assert best == ["DCA s24576 l2048", "STRING S=T/3 W128", "unpatched"]
    assert {m for m, n, d, _ in gemma.cells(results) if n == 131072 and d >= 0} == set(best)
    timed = {cell: {**value, "seconds": 90.0, "peak_gib": 2.0} for cell, value in results.items()}
    text = gemma.report(timed, tmp_path)
    assert "| DCA s24576 l2048 | found (-1.00) | found (-1.00) | found (-1.00) | 3 of 3 |" in text
    assert "Passkeys at 32k (inside" in text and "Passkeys at 64k" not in text
    assert (tmp_path / "gemma.png").stat().st_size > 10_000
    assert gemma.reported_results(tmp_path) == timed


def test_section_14s_methods_patch_a_model_of_gemma_3s_layers(gemma):
    """Every method's model_args, at every length read, are options a Gemma-3 takes (RoPE rescaling by layer type,
    on the global layers)."""
    import copy

    from model_zoo import zoo_model

    import hf_attnscale as hfa

    plain = zoo_model("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    for length in (*gemma.PASSKEYS, gemma.DOCUMENT_TOKENS):
        for name, args in gemma.methods(length).items():
            options = {k: v for k, v in args.items()}
            hfa.unpatch(hfa.patch(copy.deepcopy(plain), **options))
            if "rope_parameters" in options:
                assert set(options["rope_parameters"]) == {"full_attention"}, name
