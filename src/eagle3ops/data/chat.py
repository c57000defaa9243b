"""Chat template -> token ids + loss mask on the assistant's own tokens.

loss_mask[j] == 1 means token j was produced by the assistant: the content of an assistant turn and its
end-of-turn marker, never the role header in front of it. A model at position j-1 predicts token j, so the
first masked token is the first content token *after* the header, the "one-token shift" that is easy to get
wrong: the header is the prompt, the marker that ends the turn is the answer.

Spans are found in characters by rendering growing prefixes of the conversation with the tokenizer's own
template, then mapped to tokens through the offsets; this works for any template whose rendering of a
prefix is a prefix of the whole rendering.
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from eagle3ops.errors import InputError


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character spans of every assistant turn."""
    text = render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(tokenizer, messages[:index], add_generation_prompt=True))
        upto = render(tokenizer, messages[: index + 1])
        if not text.startswith(upto):
            raise InputError("the chat template does not render prefixes consistently; cannot locate assistant spans")
        spans.append((start, len(upto)))
    return text, spans


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_len: int) -> Tokenized:
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    mask = [int(any(start <= tok_start < end for start, end in spans)) for tok_start, _ in offsets]
    truncated = len(ids) > max_len
    return Tokenized(ids[:max_len], mask[:max_len], truncated)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a conversation up to and including the assistant header (what generation continues)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
