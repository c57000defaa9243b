"""Conversation datasets: JSONL in ShareGPT (`conversations`) or OpenAI (`messages`) form.

Every record is normalised to `{"id": str, "messages": [{"role": ..., "content": ...}, ...]}` with roles
system/user/assistant and string contents. OpenAI's content as a list of parts is read when every part is text
(`[{"type": "text", "text": "..."}, ...]`): the texts joined with a newline, as vLLM joins them for a chat template
that takes a string, so the rendering is the one the target is served. Images, audio, tool calls and tool results
are not text the drafter trains on, and are refused with what to do about them. A bad line is an error naming the
file and the line number.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from eagle3ops.errors import InputError

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
ROLES = ("system", "user", "assistant")
# Tools' roles: OpenAI's results (`tool`, formerly `function`), Llama 3's (`ipython`), ShareGPT function-calling
# sets' calls and results
TOOL_ROLES = ("tool", "function", "ipython", "function_call", "observation")
TOOL_CALLS = ("tool_calls", "function_call")  # an assistant turn's calls, beside or instead of its content
SUPPORTED = "supported: system, user and assistant turns whose content is a string or a list of text parts"
WITHOUT_TOOLS = ("drop the conversations (or turns) that use tools, or write the calls and their results into the "
                 "turns' text first, as your target's chat template renders them")


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


def _text(content, where: str) -> str:
    """A turn's content as one string: a string as it is, OpenAI's text parts joined with newlines (vLLM's way for
    a template that takes a string); anything else a DatasetError prefixed with `where`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        got = "null" if content is None else f"a {type(content).__name__}"
        raise DatasetError(f"{where} content is {got}: expected a string or a list of text parts "
                           f"([{{\"type\": \"text\", \"text\": \"...\"}}, ...])")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind is None or kind == "text":
            raise DatasetError(f"{where} content part {number} is not a text part "
                               f"({{\"type\": \"text\", \"text\": \"...\"}}): {json.dumps(part)[:80]}")
        else:
            raise DatasetError(f"{where} content part {number} has type {kind!r}: only text parts are supported "
                               f"(a drafter trains on the target's text); drop the {kind} parts, or the "
                               f"conversations that need them, first")
    return "\n".join(texts)


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
        if not isinstance(turn, dict) or role_key not in turn:
            raise DatasetError(f"{where}: turn {index} needs '{role_key}' and '{content_key}'")
        if turn[role_key] in TOOL_ROLES:
            raise DatasetError(f"{where}: turn {index} has role {turn[role_key]!r}, a tool's turn: tools are not "
                               f"supported ({SUPPORTED}); {WITHOUT_TOOLS}")
        role = role_map.get(turn[role_key]) if isinstance(turn[role_key], str) else None
        if role is None:
            raise DatasetError(f"{where}: turn {index} has unknown role {turn[role_key]!r} "
                               f"(known roles: {', '.join(role_map)})")
        calls = next((key for key in TOOL_CALLS if turn.get(key)), None)
        if calls is not None:
            raise DatasetError(f"{where}: turn {index} ({role}) has {calls!r}: tool calls are not supported "
                               f"({SUPPORTED}); {WITHOUT_TOOLS}")
        if content_key not in turn:
            raise DatasetError(f"{where}: turn {index} needs '{role_key}' and '{content_key}'")
        messages.append({"role": role, "content": _text(turn[content_key], f"{where}: turn {index}")})
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
