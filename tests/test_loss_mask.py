"""Assistant loss masking, checked token by token against an oracle that reads the special tokens themselves.

The oracle does not use character offsets (which is how `tokenize_conversation` finds the spans): it walks the
token ids, tracks which role header it is in and whether it is past `<|im_middle|>`, and says which tokens the
assistant produced: its content and its closing `<|im_end|>`, never its header.
"""
from __future__ import annotations

import copy

import pytest

from eagle3ops.data.chat import assistant_spans, prompt_ids, render, tokenize_conversation
from eagle3ops.errors import InputError

MARKER_ROLE = {"<|im_system|>": "system", "<|im_user|>": "user", "<|im_assistant|>": "assistant"}

SINGLE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "How are you today?"},
    {"role": "assistant", "content": "The fox jumps over the lazy dog."},
]
TWO_ROUNDS = [
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "Hello! The answer is 42."},
    {"role": "user", "content": "And the question?"},
    {"role": "assistant", "content": "A user thinks about code."},
]
REASONING = [
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "<think>\nLet me think step by step.\n</think>\nThe result is 42."},
]


def label_tokens(tokenizer, ids: list[int]) -> list[tuple[str | None, str]]:
    """(role, part) per token; part is marker | header | middle | content | end."""
    labels, role, part = [], None, "outside"
    for token in tokenizer.convert_ids_to_tokens(ids):
        if token in MARKER_ROLE:
            role, part = MARKER_ROLE[token], "header"
            labels.append((role, "marker"))
        elif token == "<|im_middle|>":
            labels.append((role, "middle"))
            part = "content"
        elif token == "<|im_end|>":
            labels.append((role, "end"))
            part = "outside"
        else:
            labels.append((role, part))
    return labels


def expected_mask(tokenizer, ids: list[int]) -> list[int]:
    return [int(role == "assistant" and part in ("content", "end")) for role, part in label_tokens(tokenizer, ids)]


def turns(tokenizer, ids: list[int], mask: list[int]) -> list[dict]:
    """Group tokens per turn: role, header ids, content ids, end id, and the mask of each group."""
    out, current = [], None
    for index, (role, part) in enumerate(label_tokens(tokenizer, ids)):
        if part == "marker":
            current = {"role": role, "header": [], "header_mask": [], "content": [], "content_mask": [],
                       "start": index}
            out.append(current)
        group = "content" if part in ("content", "end") else "header"
        current[group].append(ids[index])
        current[f"{group}_mask"].append(mask[index])
    return out


@pytest.mark.parametrize("messages", [SINGLE, TWO_ROUNDS, REASONING], ids=["single", "two_rounds", "reasoning"])
def test_mask_matches_token_oracle(tiny_tokenizer, messages):
    result = tokenize_conversation(tiny_tokenizer, messages, max_len=4096)
    assert not result.truncated
    assert len(result.input_ids) == len(result.loss_mask)
    # The ids are the rendered conversation, nothing added or lost.
    assert tiny_tokenizer.decode(result.input_ids) == render(tiny_tokenizer, messages)
    assert result.loss_mask == expected_mask(tiny_tokenizer, result.input_ids)


@pytest.mark.parametrize("messages", [SINGLE, TWO_ROUNDS, REASONING], ids=["single", "two_rounds", "reasoning"])
def test_each_turn_token_by_token(tiny_tokenizer, messages):
    tok = tiny_tokenizer
    result = tokenize_conversation(tok, messages, max_len=4096)
    groups = turns(tok, result.input_ids, result.loss_mask)
    assert [g["role"] for g in groups] == [m["role"] for m in messages]
    for group, message in zip(groups, messages):
        role = message["role"]
        header = tok.convert_ids_to_tokens(group["header"])
        # Header: role marker, the role word (possibly several BPE pieces), <|im_middle|>; never masked.
        assert header[0] == f"<|im_{role}|>"
        assert header[-1] == "<|im_middle|>"
        assert tok.decode(group["header"][1:-1]) == role
        assert group["header_mask"] == [0] * len(group["header"])
        # Content then the closing marker.
        assert tok.convert_ids_to_tokens(group["content"][-1]) == "<|im_end|>"
        assert tok.decode(group["content"][:-1]) == message["content"]
        want = 1 if role == "assistant" else 0
        assert group["content_mask"] == [want] * len(group["content"]), role


def test_first_masked_token_follows_assistant_header(tiny_tokenizer):
    """The one-token shift: mask starts right after <|im_middle|> of the assistant header, not on the header."""
    tok = tiny_tokenizer
    result = tokenize_conversation(tok, TWO_ROUNDS, max_len=4096)
    pieces = tok.convert_ids_to_tokens(result.input_ids)
    mask = result.loss_mask
    starts = [j for j in range(len(mask)) if mask[j] == 1 and (j == 0 or mask[j - 1] == 0)]
    ends = [j for j in range(len(mask)) if mask[j] == 1 and (j + 1 == len(mask) or mask[j + 1] == 0)]
    assert len(starts) == 2 and len(ends) == 2  # one run per assistant turn
    for start, end in zip(starts, ends):
        assert pieces[start - 1] == "<|im_middle|>"
        header_start = max(j for j in range(start) if pieces[j] == "<|im_assistant|>")
        assert tok.decode(result.input_ids[header_start + 1:start - 1]) == "assistant"
        assert all(m == 0 for m in mask[header_start:start])
        assert pieces[end] == "<|im_end|>"
    # The masked text of each run is exactly the assistant content plus its end marker.
    for (start, end), message in zip(zip(starts, ends), [TWO_ROUNDS[1], TWO_ROUNDS[3]]):
        assert tok.decode(result.input_ids[start:end + 1]) == message["content"] + "<|im_end|>"
    # The user turn between the two assistant turns is entirely unmasked, including its <|im_end|>.
    user2 = [j for j, p in enumerate(pieces) if p == "<|im_user|>"][1]
    user2_end = pieces.index("<|im_end|>", user2)
    assert mask[user2:user2_end + 1] == [0] * (user2_end + 1 - user2)


def test_reasoning_segment_is_masked(tiny_tokenizer):
    tok = tiny_tokenizer
    result = tokenize_conversation(tok, REASONING, max_len=4096)
    pieces = tok.convert_ids_to_tokens(result.input_ids)
    think, end_think = pieces.index("<think>"), pieces.index("</think>")
    assert pieces[think - 1] == "<|im_middle|>"  # reasoning is the first thing the assistant generates
    assert result.loss_mask[think:end_think + 1] == [1] * (end_think + 1 - think)
    assert "Let me think step by step." in tok.decode(result.input_ids[think:end_think + 1])
    assert sum(result.loss_mask) == len(tok(REASONING[1]["content"], add_special_tokens=False)["input_ids"]) + 1


def test_non_ascii_content_masked_by_characters(tiny_tokenizer):
    """Offsets are characters, not bytes: multi-byte content must not shift the span."""
    messages = [
        {"role": "user", "content": "Café? ☕ naïve 日本"},
        {"role": "assistant", "content": "Très bien ☕ — 日本語 ok"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "fine"},
    ]
    result = tokenize_conversation(tiny_tokenizer, messages, max_len=4096)
    assert result.loss_mask == expected_mask(tiny_tokenizer, result.input_ids)
    masked = [i for i, m in zip(result.input_ids, result.loss_mask) if m]
    assert tiny_tokenizer.decode(masked) == "Très bien ☕ — 日本語 ok<|im_end|>fine<|im_end|>"


def test_empty_assistant_turn_masks_only_end_marker(tiny_tokenizer):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": ""}]
    result = tokenize_conversation(tiny_tokenizer, messages, max_len=4096)
    assert sum(result.loss_mask) == 1
    last = result.loss_mask.index(1)
    assert tiny_tokenizer.convert_ids_to_tokens(result.input_ids[last]) == "<|im_end|>"
    assert tiny_tokenizer.convert_ids_to_tokens(result.input_ids[last - 1]) == "<|im_middle|>"


def test_assistant_spans_are_character_ranges(tiny_tokenizer):
    text, spans = assistant_spans(tiny_tokenizer, TWO_ROUNDS)
    assert [text[a:b] for a, b in spans] == [TWO_ROUNDS[1]["content"] + "<|im_end|>",
                                             TWO_ROUNDS[3]["content"] + "<|im_end|>"]


def test_prompt_ids_is_prefix_up_to_assistant_header(tiny_tokenizer):
    tok = tiny_tokenizer
    for messages, n_prompt in ((SINGLE, 2), (TWO_ROUNDS, 3)):
        full = tokenize_conversation(tok, messages, max_len=4096)
        ids = prompt_ids(tok, messages[:n_prompt])
        last_start = max(j for j in range(len(full.loss_mask))
                         if full.loss_mask[j] == 1 and (j == 0 or full.loss_mask[j - 1] == 0))
        assert ids == full.input_ids[:last_start]
        assert tok.convert_ids_to_tokens(ids[-1]) == "<|im_middle|>"
        header_start = max(j for j, p in enumerate(tok.convert_ids_to_tokens(ids)) if p == "<|im_assistant|>")
        assert tok.decode(ids[header_start:]) == "<|im_assistant|>assistant<|im_middle|>"
        assert tok.decode(ids) == render(tok, messages[:n_prompt]) + "<|im_assistant|>assistant<|im_middle|>"


def test_truncation(tiny_tokenizer):
    full = tokenize_conversation(tiny_tokenizer, TWO_ROUNDS, max_len=4096)
    n = len(full.input_ids)
    cut = tokenize_conversation(tiny_tokenizer, TWO_ROUNDS, max_len=n - 5)
    assert cut.truncated is True
    assert len(cut.input_ids) == len(cut.loss_mask) == n - 5
    assert cut.input_ids == full.input_ids[:n - 5]
    assert cut.loss_mask == full.loss_mask[:n - 5]
    exact = tokenize_conversation(tiny_tokenizer, TWO_ROUNDS, max_len=n)
    assert exact.truncated is False and exact.input_ids == full.input_ids and exact.loss_mask == full.loss_mask
    assert tokenize_conversation(tiny_tokenizer, TWO_ROUNDS, max_len=n + 10).truncated is False


def test_inconsistent_template_is_an_input_error(tiny_tokenizer):
    """A template that writes the history differently as a prompt than within the whole cannot locate a turn."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (  # numbers messages from the end: every earlier message changes as the conversation grows
        "{%- for message in messages -%}<|im_user|>{{ loop.revindex }}<|im_middle|>{{ message['content'] }}<|im_end|>"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    )
    with pytest.raises(InputError, match="assistant turn 1: .* prefixes are not consistent"):
        tokenize_conversation(tok, TWO_ROUNDS, max_len=4096)


def test_turn_without_special_end_marker_is_an_input_error(tiny_tokenizer):
    """With no special token closing a turn there is no telling where the assistant stopped."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{%- for message in messages -%}[{{ message['role'] }}]{{ message['content'] }}{%- endfor -%}"
        "{%- if not add_generation_prompt -%}[done]{%- endif -%}"
    )
    with pytest.raises(InputError, match="assistant turn 1: .* no special token"):
        tokenize_conversation(tok, TWO_ROUNDS, max_len=4096)


def test_a_long_turn_tokenizes_as_its_whole_text_would(tiny_tokenizer):
    """A reasoning trace of about 300 KB: the closing marker found from the turn's end and only the head that
    data.max_len needs tokenized, with the ids, mask and truncation of tokenizing the whole text."""
    words = " ".join(f"step{i % 97} then {i}" for i in range(20000))
    messages = [{"role": "user", "content": "Think long."},
                {"role": "assistant", "content": f"<think>\n{words}\n</think>\nDone."}]
    text, spans = assistant_spans(tiny_tokenizer, messages)
    whole = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = whole["input_ids"]
    mask = [int(any(start <= at < end for start, end in spans)) for at, _ in whole["offset_mapping"]]
    assert len(text) > 300_000 and mask[-1] == 1  # the closing marker, far from the turn's start, is masked
    for max_len in (50, 4096, len(ids) - 1, len(ids), len(ids) + 5):
        result = tokenize_conversation(tiny_tokenizer, messages, max_len)
        assert result.input_ids == ids[:max_len] and result.loss_mask == mask[:max_len], max_len
        assert result.truncated == (len(ids) > max_len)
