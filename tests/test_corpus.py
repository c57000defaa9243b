"""Tests for the zoo's generated chat corpus.

Expected answers are recomputed from the prompt text, not read back from `Task.answer`, so a renderer that
ignores the prompt (or a generator whose answer disagrees with its prompt) fails.
"""
from __future__ import annotations

import ast
import json
import operator
import re
from collections import Counter

import pytest

from eagle3ops.zoo.corpus import FAMILIES, STYLES, Task, make_tasks, render_response, to_conversation, to_prompt_record

TASKS = make_tasks(400, seed=7)
THINK = re.compile(r"<think>\n(.*?)\n</think>\n", re.DOTALL)


def _of(family: str) -> list[Task]:
    return [t for t in TASKS if t.family == family]


def _final(response: str) -> str:
    """The part of a response after its think segment (the whole response when there is none)."""
    return response.split("</think>\n", 1)[-1]


def _last_int(text: str) -> int:
    return int(re.findall(r"\d+", text)[-1])


# ---------------------------------------------------------------- determinism and balance


def test_same_seed_same_corpus_and_different_seed_differs() -> None:
    a, b = make_tasks(50, seed=3), make_tasks(50, seed=3)
    assert a == b
    assert [render_response(t, s) for t in a for s in STYLES] == [render_response(t, s) for t in b for s in STYLES]
    assert [t.prompt for t in make_tasks(50, seed=4)] != [t.prompt for t in a]


def test_shorter_corpus_is_a_prefix_of_a_longer_one() -> None:
    assert make_tasks(20, seed=5) == make_tasks(60, seed=5)[:20]


def test_families_round_robin_in_given_order() -> None:
    tasks = make_tasks(10, seed=1, families=("qa", "lists"))
    assert [t.family for t in tasks] == ["qa", "lists"] * 5
    assert [t.family for t in TASKS[:8]] == list(FAMILIES) * 2
    counts = Counter(t.family for t in TASKS[:101])
    assert max(counts.values()) - min(counts.values()) <= 1


def test_system_messages_appear_for_a_minority_of_tasks() -> None:
    tasks = make_tasks(2000, seed=11)
    rate = sum(t.system is not None for t in tasks) / len(tasks)
    assert 0.10 < rate < 0.20


def test_prompts_vary() -> None:
    for family in FAMILIES:
        prompts = [t.prompt for t in _of(family)]
        assert len(set(prompts)) > 0.5 * len(prompts), family
        assert len({p.split()[0] for p in prompts}) >= 3, family  # several phrasing templates in use


# ---------------------------------------------------------------- rendering


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("style", STYLES)
def test_every_style_renders_short_ascii_for_every_family(family: str, style: str) -> None:
    limit = 25 if style == "predecessor" else 60
    for task in _of(family):
        response = render_response(task, style)
        assert response.strip()
        response.encode("ascii")
        task.prompt.encode("ascii")
        assert len(response.split()) <= limit, response
        assert json.loads(json.dumps(task.answer)) == task.answer


def test_successor_has_exactly_one_think_segment_then_an_answer() -> None:
    for task in TASKS:
        response = render_response(task, "successor")
        assert response.startswith("<think>\n")
        assert response.count("<think>") == 1 and response.count("</think>") == 1
        assert THINK.match(response).group(1).strip()
        assert _final(response).strip()
        for style in ("predecessor", "raw"):
            assert "<think>" not in render_response(task, style)


def test_raw_and_predecessor_phrasings_differ() -> None:
    for task in TASKS:
        pred, raw = render_response(task, "predecessor"), render_response(task, "raw")
        succ = _final(render_response(task, "successor"))
        assert pred.splitlines()[0] != raw.splitlines()[0], task.prompt
        assert raw != succ and pred != succ, task.prompt


ARITH = re.compile(r"(\d+) (\+|-|\*|plus|minus|times) (\d+)")
OPS = {"+": operator.add, "plus": operator.add, "-": operator.sub, "minus": operator.sub,
       "*": operator.mul, "times": operator.mul}


@pytest.mark.parametrize("style", STYLES)
def test_arithmetic_answers_are_correct(style: str) -> None:
    for task in _of("arithmetic"):
        a, op, b = ARITH.search(task.prompt).groups()
        assert _last_int(_final(render_response(task, style))) == OPS[op](int(a), int(b)), task.prompt


def test_arithmetic_operands_have_the_documented_sizes() -> None:
    for task in _of("arithmetic"):
        a, op, b = ARITH.search(task.prompt).groups()
        if op in ("*", "times"):
            assert int(a) < 100 and int(b) < 10
        else:
            assert 10 <= int(a) < 1000 and 10 <= int(b) < 1000


def test_successor_reasoning_equations_hold() -> None:
    """Every `x op y ... = z` written in a think segment is true, so the worked steps are real."""
    equation = re.compile(r"(\d+(?: [-+*] \d+)+) = (\d+)\b")
    checked = 0
    for task in _of("arithmetic") + _of("lists"):
        for lhs, rhs in equation.findall(THINK.match(render_response(task, "successor")).group(1)):
            assert eval(lhs) == int(rhs), (task.prompt, lhs, rhs)  # lhs is digits and + - * only
            checked += 1
    assert checked > 100


def test_column_addition_shows_carries() -> None:
    task = Task("arithmetic", "What is 47 + 385?", None, {"op": "+", "a": 47, "b": 385, "result": 432})
    think = THINK.match(render_response(task, "successor")).group(1)
    assert "ones: 7 + 5 = 12, write 2, carry 1" in think
    assert "tens: 4 + 8 + 1 = 13, write 3, carry 1" in think
    assert "hundreds: 0 + 3 + 1 = 4, write 4" in think


LIST_OPS = {"Reverse": lambda xs: xs[::-1], "reverse": lambda xs: xs[::-1], "Sort": sorted, "increasing": sorted,
            "largest": max, "maximum": max, "biggest": max, "sum": sum, "Add up": sum, "total": sum}


@pytest.mark.parametrize("style", STYLES)
def test_list_answers_are_correct(style: str) -> None:
    for task in _of("lists"):
        items = ast.literal_eval(re.search(r"\[[\d, ]*\]", task.prompt).group(0))
        assert 3 <= len(items) <= 7
        (fn,) = {fn for key, fn in LIST_OPS.items() if key in task.prompt}
        expected = fn(items)
        final = _final(render_response(task, style))
        if isinstance(expected, list):
            assert ast.literal_eval(re.findall(r"\[[\d, ]*\]", final)[-1]) == expected, task.prompt
        else:
            assert _last_int(final) == expected, task.prompt


CODE_DESCRIPTIONS = [  # prompt wording -> what the function must compute
    (r"(\w+) times (\w+)", operator.mul),
    (r"(\w+) plus (\w+)", operator.add),
    (r"(\w+) minus (\w+)", operator.sub),
    (r"(\w+) modulo (\w+)", operator.mod),
    (r"(\w+) integer-divided by (\w+)", operator.floordiv),
    (r"the larger of (\w+) and (\w+)", max),
    (r"the smaller of (\w+) and (\w+)", min),
    (r"whether (\w+) is greater than (\w+)", operator.gt),
    (r"whether (\w+) is divisible by (\w+)", lambda x, y: x % y == 0),
]


@pytest.mark.parametrize("style", STYLES)
def test_code_answers_define_the_requested_function(style: str) -> None:
    for task in _of("code"):
        name, params = re.search(r"`(\w+)\(([^)]*)\)`", task.prompt).groups()
        params = params.split(", ")
        (fn, operands) = next(
            (fn, m.groups()) for pattern, fn in CODE_DESCRIPTIONS
            if (m := re.search(r"return(?:s|ing) " + pattern + r"\.$", task.prompt))
        )
        code = re.search(r"```python\n(.*?)\n```", _final(render_response(task, style)), re.DOTALL).group(1)
        namespace: dict = {}
        exec(code, namespace)
        for args in [(17, 4), (9, 3), (2, 7)]:
            env = dict(zip(params, args))
            expected = fn(*(env[o] if o in env else int(o) for o in operands))
            assert namespace[name](*args[: len(params)]) == expected, (task.prompt, code)


@pytest.mark.parametrize("style", STYLES)
def test_qa_answers_state_the_fact_about_the_asked_subject(style: str) -> None:
    facts: dict[str, str] = {}
    for task in _of("qa"):
        subject, value = task.answer["subject"], task.answer["value"]
        assert subject in task.prompt
        assert value in _final(render_response(task, style))
        assert facts.setdefault(subject + task.answer["table"], value) == value
    capital = Task("qa", "What is the capital of France?", None, {"table": "capitals", "subject": "France", "value": "Paris"})
    assert "Paris" in render_response(capital, style)


# ---------------------------------------------------------------- records


def test_conversation_record_shape() -> None:
    with_system = next(t for t in TASKS if t.system is not None)
    without = next(t for t in TASKS if t.system is None)
    rec = to_conversation(with_system, "successor", "s-1")
    assert rec == {"id": "s-1", "conversations": [
        {"from": "system", "value": with_system.system},
        {"from": "human", "value": with_system.prompt},
        {"from": "gpt", "value": render_response(with_system, "successor")},
    ]}
    rec = to_conversation(without, "raw", "s-2")
    assert [turn["from"] for turn in rec["conversations"]] == ["human", "gpt"]
    json.dumps(rec)


def test_prompt_record_shape_has_no_answer() -> None:
    with_system = next(t for t in TASKS if t.system is not None)
    without = next(t for t in TASKS if t.system is None)
    assert to_prompt_record(with_system, "p-1") == {"id": "p-1", "family": with_system.family, "messages": [
        {"role": "system", "content": with_system.system},
        {"role": "user", "content": with_system.prompt},
    ]}
    rec = to_prompt_record(without, "p-2")
    assert rec["messages"] == [{"role": "user", "content": without.prompt}]
    assert render_response(without, "predecessor") not in json.dumps(rec)


# ---------------------------------------------------------------- errors


def test_unknown_family_is_named() -> None:
    with pytest.raises(ValueError, match="poetry"):
        make_tasks(4, seed=0, families=("arithmetic", "poetry"))
    with pytest.raises(ValueError, match="poetry"):
        render_response(Task("poetry", "Write a haiku.", None, {}), "raw")


def test_unknown_style_is_named() -> None:
    with pytest.raises(ValueError, match="verbose"):
        render_response(TASKS[0], "verbose")
    with pytest.raises(ValueError, match="verbose"):
        to_conversation(TASKS[0], "verbose", "x")
