"""Conversation datasets: JSONL in ShareGPT (`conversations`) or OpenAI (`messages`) form.

Every record is normalised to `{"id": str, "messages": [{"role": ..., "content": ...}, ...]}` with roles
system/user/assistant. A bad line is an error naming the file and the line number.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from eagle3ops.errors import InputError

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
ROLES = ("system", "user", "assistant")


class DatasetError(InputError):
    """Malformed input data; the message names the file and line."""


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for every non-blank line (CRLF line ends and a UTF-8 byte-order mark are
    accepted)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    with path.open("rb") as lines:
        for lineno, raw in enumerate(lines, start=1):
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark, as editors on Windows write one
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def content_id(messages: list[dict]) -> str:
    """An id for records that have none: a hash of the conversation, stable wherever the file lives."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def normalise(record: dict, where: str) -> dict:
    """One record -> {"id", "messages"}; `where` ("file:line") prefixes every error. A record without an
    "id" gets `content_id` of its messages."""
    if "messages" in record:
        raw_turns, role_key, content_key, role_map = record["messages"], "role", "content", {r: r for r in ROLES}
    elif "conversations" in record:
        raw_turns, role_key, content_key, role_map = record["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise DatasetError(f"{where}: a record needs 'messages' (OpenAI form) or 'conversations' (ShareGPT form)")
    if not isinstance(raw_turns, list) or not raw_turns:
        raise DatasetError(f"{where}: the turn list is empty or not a list")
    messages = []
    for index, turn in enumerate(raw_turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise DatasetError(f"{where}: turn {index} needs '{role_key}' and '{content_key}'")
        role = role_map.get(turn[role_key])
        if role is None:
            raise DatasetError(f"{where}: turn {index} has unknown role {turn[role_key]!r}")
        if not isinstance(turn[content_key], str):
            raise DatasetError(f"{where}: turn {index} content is not a string")
        messages.append({"role": role, "content": turn[content_key]})
    record_id = record["id"] if "id" in record else content_id(messages)
    return {"id": str(record_id), "messages": messages}


def load_conversations(path: str | Path) -> list[dict]:
    """Read and normalise a whole dataset; duplicate ids are an error (they key resumption and splits)."""
    records, seen = [], {}
    for lineno, raw in read_jsonl(path):
        record = normalise(raw, f"{path}:{lineno}")
        if "id" not in raw:  # repeated identical conversations (common in public sets) get numbered
            base, n = record["id"], 1
            while record["id"] in seen:
                n += 1
                record["id"] = f"{base}-{n}"
        if record["id"] in seen:
            raise DatasetError(f"{path}:{lineno}: duplicate id {record['id']!r} (first on line {seen[record['id']]})")
        seen[record["id"]] = lineno
        records.append(record)
    if not records:
        raise DatasetError(f"{path}: no records")
    return records
