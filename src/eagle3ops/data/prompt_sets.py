"""Benchmark prompt sets for the eval stage: the public files users keep locally, in their usual forms.

Every prompt comes out as {"id": "<set>/<own id>", "set": name, "messages": [..., user turn]}. A set is one
JSONL file, or a Parquet file (`.parquet`, the form Hugging Face datasets are stored in) with the same columns.
Its `format` is detected from the first record's fields unless given:

  chat       {"messages": [...]} (OpenAI) or {"conversations": [...]} (ShareGPT): the conversation up to its
             last user turn (a trailing reference answer is dropped, so the model writes its own)
  prompt     {"prompt": "..."}: one user turn
  humaneval  {"task_id", "prompt", ...}: the code to complete, verbatim, as one user turn (as SpecForge's
             HumanEval benchmarks send it to the chat endpoint)
  mtbench    {"question_id", "category", "turns": [...]}: the FIRST turn only. The second turn asks about the
             model's own first answer, which a prompt set cannot hold; SpecForge's chat-API MT-Bench runs
             measure the first turn the same way
  gsm8k      {"question", "answer"}: the question, zero-shot
  math500    {"problem", "solution", "answer", ...}: the problem

An id is the record's own ("id", "question_id", "task_id", "unique_id") or else its line (row) number.
A bad record is an error naming the file and line (row).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from pathlib import Path

from eagle3ops.config import PromptSetConfig, PromptSetFormat
from eagle3ops.data.conversations import DatasetError, normalise, read_jsonl

ID_FIELDS = ("id", "question_id", "task_id", "unique_id")


def _text(record: dict, key: str, fmt: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: a {fmt} record needs {key!r} as a non-empty string")
    return value


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _chat(record: dict, where: str) -> list[dict]:
    messages = normalise(record, where)["messages"]
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages or messages[-1]["role"] != "user":
        raise DatasetError(f"{where}: the conversation has no user turn to answer")
    empty = [i for i, message in enumerate(messages) if message["role"] == "user" and not message["content"].strip()]
    if empty:
        raise DatasetError(f"{where}: turn {empty[0]} is a user turn with no text")
    return messages


def _mtbench(record: dict, where: str) -> list[dict]:
    turns = record.get("turns")
    if not isinstance(turns, (list, tuple)) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise DatasetError(f"{where}: an mtbench record needs 'turns', a list of strings")
    return _user(turns[0])


PARSERS: dict[str, Callable[[dict, str], list[dict]]] = {
    "chat": _chat,
    "prompt": lambda record, where: _user(_text(record, "prompt", "prompt", where)),
    "mtbench": _mtbench,
    "gsm8k": lambda record, where: _user(_text(record, "question", "gsm8k", where)),
    "humaneval": lambda record, where: _user(_text(record, "prompt", "humaneval", where)),
    "math500": lambda record, where: _user(_text(record, "problem", "math500", where)),
}  # keyed by config.PromptSetFormat, the names `format` is checked against


def detect_format(record: dict, where: str) -> str:
    """The format a record's fields say it has (module docstring); the most specific field decides."""
    if "messages" in record or "conversations" in record:
        return "chat"
    for field, fmt in (("turns", "mtbench"), ("problem", "math500"), ("question", "gsm8k")):
        if field in record:
            return fmt
    if "prompt" in record:
        return "humaneval" if "task_id" in record else "prompt"
    raise DatasetError(f"{where}: cannot tell the format from the fields {sorted(record)}; set the set's "
                       f"`format` to one of {[str(f) for f in PromptSetFormat]}")


def read_records(path: str | Path) -> Iterator[tuple[int, str, dict]]:
    """Yield (line or row number, "file:line" or "file: row N", record) from a JSONL or Parquet file."""
    path = Path(path)
    if path.suffix != ".parquet":
        for lineno, record in read_jsonl(path):
            yield lineno, f"{path}:{lineno}", record
        return
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise DatasetError(f"{path}: not a readable Parquet file ({err})") from None
    for row, record in enumerate(rows, start=1):
        yield row, f"{path}: row {row}", record


def load_set(prompt_set: PromptSetConfig, limit: int | None = None) -> list[dict]:
    """The first `limit` prompts (all when None) of one set, in file order."""
    fmt, prompts = prompt_set.format, []
    for number, where, record in islice(read_records(prompt_set.path), limit):
        fmt = fmt or detect_format(record, where)
        messages = PARSERS[fmt](record, where)
        own_id = next((record[key] for key in ID_FIELDS if record.get(key) is not None), number)
        prompts.append({"id": f"{prompt_set.name}/{own_id}", "set": prompt_set.name, "messages": messages})
    if not prompts:
        raise DatasetError(f"{prompt_set.path}: no prompts (set {prompt_set.name!r})")
    return prompts


def load_sets(sets: Sequence[PromptSetConfig], max_prompts: int | None = None) -> dict[str, list[dict]]:
    """{set name: prompts} in the configured order; a set's own `limit` overrides `max_prompts`."""
    return {s.name: load_set(s, s.limit if s.limit is not None else max_prompts) for s in sets}
