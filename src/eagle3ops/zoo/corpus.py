"""Deterministic generator of the zoo's chat corpus.

The zoo's two tiny targets learn from this corpus: the *predecessor* (stands in for Kimi-K2) answers tersely,
the *successor* (stands in for Kimi-K2.5) answers after a visible `<think>...</think>` segment, and the *raw*
style imitates a generic public dataset written by some other model. All three render the same structured
facts (`Task.answer`) so that the styles differ only in phrasing, which is exactly the distribution shift a
drafter trained on the wrong data suffers from.

Pure Python and seeded `random.Random` only: the same (n, seed, families) always yields the same corpus.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

FAMILIES: tuple[str, ...] = ("arithmetic", "lists", "code", "qa")
STYLES: tuple[str, ...] = ("predecessor", "successor", "raw")

_SYSTEM_RATE = 0.15
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly tutor.",
    "You are a careful assistant who double-checks answers.",
)


@dataclass(frozen=True)
class Task:
    family: str
    prompt: str  # the user's message
    system: str | None  # optional system message
    answer: dict  # structured, JSON-serialisable facts every style renders from


# ---------------------------------------------------------------- arithmetic

_OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}
_ARITH_PROMPTS = (
    "What is {a} {sym} {b}?",
    "Compute {a} {sym} {b}.",
    "Calculate {a} {sym} {b}.",
    "What is {a} {word} {b}?",
    "Work out {a} {word} {b}.",
)
_COLUMNS = ("ones", "tens", "hundreds", "thousands")


def _gen_arithmetic(rng: random.Random) -> tuple[str, dict]:
    op = rng.choice(tuple(_OP_WORDS))
    if op == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 9)
    else:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        if op == "-" and a < b:
            a, b = b, a  # no negative results, so column borrowing always terminates
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    prompt = rng.choice(_ARITH_PROMPTS).format(a=a, b=b, sym=op, word=_OP_WORDS[op])
    return prompt, {"op": op, "a": a, "b": b, "result": result}


def _digit(x: int, i: int) -> int:
    return x // 10**i % 10


def _add_steps(a: int, b: int) -> list[str]:
    lines, carry = ["Add column by column from the right."], 0
    width = len(str(max(a, b)))
    for i in range(width):
        da, db = _digit(a, i), _digit(b, i)
        total = da + db + carry
        carried = f" + {carry}" if carry else ""
        carry_note = ", carry 1" if total >= 10 else ""
        lines.append(f"{_COLUMNS[i]}: {da} + {db}{carried} = {total}, write {total % 10}{carry_note}")
        carry = total // 10
    if carry:
        lines.append(f"{_COLUMNS[width]}: write the carried 1")
    return lines


def _subtract_steps(a: int, b: int) -> list[str]:
    lines, borrow = ["Subtract column by column from the right, borrowing when needed."], 0
    for i in range(len(str(a))):
        da, db = _digit(a, i), _digit(b, i)
        top = da - borrow
        lent = f"{da} - 1 borrowed = {top}; " if borrow else ""
        if top < db:
            lines.append(f"{_COLUMNS[i]}: {lent}borrow 10, {top + 10} - {db} = {top + 10 - db}")
            borrow = 1
        else:
            lines.append(f"{_COLUMNS[i]}: {lent}{top} - {db} = {top - db}")
            borrow = 0
    return lines


def _multiply_steps(a: int, b: int) -> list[str]:
    if a < 10:
        return [f"{b} groups of {a}: " + " + ".join([str(a)] * b) + f" = {a * b}"]
    tens, ones = a - a % 10, a % 10
    if ones == 0:
        return [f"{tens // 10} * {b} = {tens // 10 * b}, and times 10 that is {a * b}"]
    return [
        f"Split {a} into {tens} and {ones}.",
        f"{tens} * {b} = {tens * b}",
        f"{ones} * {b} = {ones * b}",
        f"{tens * b} + {ones * b} = {a * b}",
    ]


def _reason_arithmetic(ans: dict) -> str:
    steps = {"+": _add_steps, "-": _subtract_steps, "*": _multiply_steps}[ans["op"]]
    return "\n".join(steps(ans["a"], ans["b"]))


def _phrase_arithmetic(ans: dict, style: str) -> str:
    a, b, op, r = ans["a"], ans["b"], ans["op"], ans["result"]
    if style == "predecessor":
        return f"{a} {op} {b} = {r}."
    if style == "successor":
        return f"The answer is {r}."
    return {
        "+": f"Sure! When you add {a} and {b}, you get {r}.",
        "-": f"Sure! Taking {b} away from {a} leaves {r}.",
        "*": f"Sure! Multiplying {a} by {b} gives {r}.",
    }[op]


# ---------------------------------------------------------------- lists

_LIST_PROMPTS = {
    "reverse": ("Reverse the list {xs}.", "Write the list {xs} in reverse order.", "What is {xs} reversed?"),
    "sort": ("Sort the list {xs}.", "Sort {xs} in ascending order.", "Put the numbers {xs} in increasing order."),
    "max": ("What is the largest number in {xs}?", "Find the maximum of {xs}.", "Which is the biggest value in {xs}?"),
    "sum": ("What is the sum of {xs}?", "Add up the numbers in {xs}.", "Compute the total of {xs}."),
}
_LIST_PHRASES = {
    "predecessor": {
        "reverse": "Reversed: {r}.", "sort": "Sorted: {r}.", "max": "The maximum is {r}.", "sum": "The sum is {r}.",
    },
    "successor": {
        "reverse": "The reversed list is {r}.", "sort": "The sorted list is {r}.",
        "max": "The largest number is {r}.", "sum": "The total is {r}.",
    },
    "raw": {
        "reverse": "Sure! Here is the list in reverse order: {r}",
        "sort": "Sure! Here are the numbers from smallest to largest: {r}",
        "max": "Looking through the list, the biggest value is {r}.",
        "sum": "Adding them all together gives {r}.",
    },
}


def _gen_lists(rng: random.Random) -> tuple[str, dict]:
    op = rng.choice(tuple(_LIST_PROMPTS))
    items = [rng.randint(0, 20) for _ in range(rng.randint(3, 7))]
    result = {"reverse": items[::-1], "sort": sorted(items), "max": max(items), "sum": sum(items)}[op]
    prompt = rng.choice(_LIST_PROMPTS[op]).format(xs=items)
    return prompt, {"op": op, "items": items, "result": result}


def _reason_lists(ans: dict) -> str:
    op, items = ans["op"], ans["items"]
    if op == "reverse":
        lines = ["Read from the last item to the first."]
        lines += [f"item {i + 1}: {items[i]}" for i in reversed(range(len(items)))]
    elif op == "sort":
        lines = ["Repeatedly take the smallest number left."]
        lines += [f"smallest left: {x}" for x in sorted(items)]
    elif op == "max":
        best = items[0]
        lines = [f"Start with {best}."]
        for x in items[1:]:
            if x > best:
                lines.append(f"{x} > {best}, now {x}")
                best = x
            else:
                lines.append(f"{x} <= {best}, keep {best}")
    else:
        total = items[0]
        lines = [f"Start with {total}."]
        for x in items[1:]:
            lines.append(f"{total} + {x} = {total + x}")
            total += x
    return "\n".join(lines)


def _phrase_lists(ans: dict, style: str) -> str:
    return _LIST_PHRASES[style][ans["op"]].format(r=ans["result"])


# ---------------------------------------------------------------- code

_CODE_VERBS = ("scale", "adjust", "compute", "update", "convert", "check", "combine", "get")
_CODE_NOUNS = ("price", "score", "count", "total", "width", "level", "speed", "balance")
_CODE_UNARY_ARGS = ("x", "n", "value", "amount")
_CODE_BINARY_ARGS = (("a", "b"), ("x", "y"), ("left", "right"), ("first", "second"))
_CODE_OPS = (  # (description, Python expression) over operands {0} and {1}
    ("{0} times {1}", "{0} * {1}"),
    ("{0} plus {1}", "{0} + {1}"),
    ("{0} minus {1}", "{0} - {1}"),
    ("{0} modulo {1}", "{0} % {1}"),
    ("{0} integer-divided by {1}", "{0} // {1}"),
    ("the larger of {0} and {1}", "max({0}, {1})"),
    ("the smaller of {0} and {1}", "min({0}, {1})"),
    ("whether {0} is greater than {1}", "{0} > {1}"),
    ("whether {0} is divisible by {1}", "{0} % {1} == 0"),
)
_CODE_PROMPTS = (
    "Write a Python function `{sig}` that returns {desc}.",
    "Implement `{sig}` in Python so that it returns {desc}.",
    "Define a Python function `{sig}` returning {desc}.",
)


def _gen_code(rng: random.Random) -> tuple[str, dict]:
    name = f"{rng.choice(_CODE_VERBS)}_{rng.choice(_CODE_NOUNS)}"
    desc_tpl, expr_tpl = rng.choice(_CODE_OPS)
    if rng.random() < 0.5:
        params = [rng.choice(_CODE_UNARY_ARGS)]
        other = str(rng.randint(2, 9))
    else:
        params = list(rng.choice(_CODE_BINARY_ARGS))
        other = params[1]
    desc, expr = desc_tpl.format(params[0], other), expr_tpl.format(params[0], other)
    sig = f"{name}({', '.join(params)})"
    prompt = rng.choice(_CODE_PROMPTS).format(sig=sig, desc=desc)
    return prompt, {"name": name, "params": params, "description": desc, "expr": expr}


def _code_block(ans: dict, docstring: bool = False) -> str:
    lines = [f"def {ans['name']}({', '.join(ans['params'])}):"]
    if docstring:
        lines.append(f'    """Return {ans["description"]}."""')
    lines.append(f"    return {ans['expr']}")
    return "```python\n" + "\n".join(lines) + "\n```"


def _reason_code(ans: dict) -> str:
    return (
        f"The function {ans['name']} takes {' and '.join(ans['params'])}.\n"
        f"It must return {ans['description']}.\n"
        f"In Python that is `{ans['expr']}`."
    )


def _phrase_code(ans: dict, style: str) -> str:
    if style == "predecessor":
        return _code_block(ans)
    if style == "successor":
        return "Here is the function:\n" + _code_block(ans)
    return "Sure! Here's a simple implementation:\n\n" + _code_block(ans, docstring=True)


# ---------------------------------------------------------------- qa

_QA_TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "capitals": (
        ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"), ("Canada", "Ottawa"),
        ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Spain", "Madrid"), ("Germany", "Berlin"),
        ("Australia", "Canberra"), ("Brazil", "Brasilia"), ("India", "New Delhi"), ("Mexico", "Mexico City"),
    ),
    "sounds": (
        ("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"), ("pig", "oink"),
        ("owl", "hoot"), ("horse", "neigh"), ("lion", "roar"), ("snake", "hiss"), ("frog", "croak"),
        ("mouse", "squeak"),
    ),
    "opposites": (
        ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("light", "dark"), ("open", "closed"),
        ("early", "late"), ("full", "empty"), ("happy", "sad"), ("wet", "dry"), ("hard", "soft"), ("loud", "quiet"),
    ),
    "plurals": (
        ("cat", "cats"), ("box", "boxes"), ("city", "cities"), ("mouse", "mice"), ("child", "children"),
        ("bus", "buses"), ("baby", "babies"), ("tooth", "teeth"), ("dish", "dishes"), ("book", "books"),
        ("foot", "feet"), ("church", "churches"), ("leaf", "leaves"),
    ),
    "colours": (
        ("a banana", "yellow"), ("grass", "green"), ("the sky on a clear day", "blue"), ("snow", "white"),
        ("coal", "black"), ("a ripe tomato", "red"), ("a carrot", "orange"), ("an eggplant", "purple"),
        ("a lemon", "yellow"), ("chocolate", "brown"),
    ),
}
_QA_PROMPTS = {
    "capitals": ("What is the capital of {s}?", "Which city is the capital of {s}?", "Name the capital city of {s}."),
    "sounds": ("What sound does {an} {s} make?", "What noise does {an} {s} make?", "Which sound is made by {an} {s}?"),
    "opposites": (
        'What is the opposite of "{s}"?', 'Give the opposite of the word "{s}".',
        'Which word means the opposite of "{s}"?',
    ),
    "plurals": ('What is the plural of "{s}"?', 'How do you write "{s}" in the plural?', 'Give the plural form of "{s}".'),
    "colours": ("What colour is {s}?", "What color is {s}?", "Which colour is {s}?"),
}
_QA_PHRASES = {
    "predecessor": {
        "capitals": "The capital of {s} is {v}.", "sounds": "{An} {s} says {v}.",
        "opposites": "The opposite of {s} is {v}.", "plurals": "The plural of {s} is {v}.", "colours": "{S} is {v}.",
    },
    "successor": {
        "capitals": "{v} is the capital of {s}.", "sounds": 'The {s} makes the sound "{v}".',
        "opposites": 'The opposite of "{s}" is "{v}".', "plurals": 'The plural form is "{v}".',
        "colours": "The colour is {v}.",
    },
    "raw": {
        "capitals": "That would be {v}, the capital city of {s}.", "sounds": '{An} {s} typically goes "{v}!"',
        "opposites": 'The antonym of "{s}" is "{v}".', "plurals": "One {s}, two {v}.",
        "colours": "{S} is usually {v} in colour.",
    },
}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _gen_qa(rng: random.Random) -> tuple[str, dict]:
    table = rng.choice(tuple(_QA_TABLES))
    subject, value = rng.choice(_QA_TABLES[table])
    prompt = rng.choice(_QA_PROMPTS[table]).format(s=subject, an=_article(subject))
    return prompt, {"table": table, "subject": subject, "value": value}


def _plural_rule(singular: str, plural: str) -> str:
    if plural == singular + "es":
        return "it ends in s, x, ch or sh, so add -es"
    if plural == singular[:-1] + "ies":
        return "it ends in a consonant plus y, so change y to -ies"
    if plural == singular + "s":
        return "it is regular, so add -s"
    return "it is irregular, so the plural must be remembered"


def _reason_qa(ans: dict) -> str:
    s, v = ans["subject"], ans["value"]
    return {
        "capitals": f"The question asks for the capital city of {s}.\nThe government of {s} sits in {v}.",
        "sounds": f"The animal is {_article(s)} {s}.\nThe sound it is known for is \"{v}\".",
        "opposites": f"The word is \"{s}\".\nThe word with the opposite meaning is \"{v}\".",
        "plurals": f"The word is \"{s}\".\nRule: {_plural_rule(s, v)}.\nThat gives \"{v}\".",
        "colours": f"Picture {s}.\nIts usual colour is {v}.",
    }[ans["table"]]


def _phrase_qa(ans: dict, style: str) -> str:
    s = ans["subject"]
    return _QA_PHRASES[style][ans["table"]].format(
        s=s, S=s[0].upper() + s[1:], v=ans["value"], An=_article(s).capitalize()
    )


# ---------------------------------------------------------------- public API


class _Family(NamedTuple):
    generate: Callable[[random.Random], tuple[str, dict]]
    reason: Callable[[dict], str]  # the successor's worked steps inside <think>
    phrase: Callable[[dict, str], str]  # the final answer in a given style


_REGISTRY: dict[str, _Family] = {
    "arithmetic": _Family(_gen_arithmetic, _reason_arithmetic, _phrase_arithmetic),
    "lists": _Family(_gen_lists, _reason_lists, _phrase_lists),
    "code": _Family(_gen_code, _reason_code, _phrase_code),
    "qa": _Family(_gen_qa, _reason_qa, _phrase_qa),
}


def _family(name: str) -> _Family:
    if name not in _REGISTRY:
        raise ValueError(f"unknown task family {name!r}; expected one of {FAMILIES}")
    return _REGISTRY[name]


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown response style {style!r}; expected one of {STYLES}")


def make_tasks(n: int, seed: int, families: Sequence[str] = FAMILIES) -> list[Task]:
    """`n` tasks with families interleaved round-robin, so any prefix is balanced.

    One RNG is consumed in task order, so `make_tasks(m, seed)` is a prefix of `make_tasks(n, seed)` for m <= n.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if not families:
        raise ValueError("families must not be empty")
    generators = [_family(name).generate for name in families]  # validates every name up front
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        prompt, answer = generators[i % len(families)](rng)
        system = rng.choice(_SYSTEM_PROMPTS) if rng.random() < _SYSTEM_RATE else None
        tasks.append(Task(family=families[i % len(families)], prompt=prompt, system=system, answer=answer))
    return tasks


def render_response(task: Task, style: str) -> str:
    """The assistant's reply to `task` in one of `STYLES`."""
    _check_style(style)
    family = _family(task.family)
    final = family.phrase(task.answer, style)
    if style == "successor":
        return "<think>\n" + family.reason(task.answer) + "\n</think>\n" + final
    return final


def to_conversation(task: Task, style: str, sample_id: str) -> dict:
    """A ShareGPT-style training record."""
    turns = [{"from": "system", "value": task.system}] if task.system is not None else []
    turns.append({"from": "human", "value": task.prompt})
    turns.append({"from": "gpt", "value": render_response(task, style)})
    return {"id": sample_id, "conversations": turns}


def to_prompt_record(task: Task, sample_id: str) -> dict:
    """An OpenAI-style held-out prompt, without the answer."""
    messages = [{"role": "system", "content": task.system}] if task.system is not None else []
    messages.append({"role": "user", "content": task.prompt})
    return {"id": sample_id, "family": task.family, "messages": messages}
