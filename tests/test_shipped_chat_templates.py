"""The shipped chat templates (llama-3, qwen3, kimi-k2) and the choice of template, checked token by token.

Each family gets a tiny byte-level BPE tokenizer built offline with the family's special tokens, rendering with
the shipped template. An oracle that reads the special tokens and the family's role headers (not the character
offsets `tokenize_conversation` uses) labels every token with its role and part: header, content or end-of-turn
marker. The loss mask must be 1 on exactly the assistant's content and end marker.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eagle3ops.config import TargetConfig
from eagle3ops.data.chat import SHIPPED_TEMPLATES, ChatTemplateError, prompt_ids, render, tokenize_conversation
from eagle3ops.modeling.target import load_tokenizer
from eagle3ops.zoo.tokenizer import CHAT_TEMPLATE as ZOO_TEMPLATE
from helpers import TEXTS

ROOT = Path(__file__).resolve().parents[1]
PAD = "[PAD]"


@dataclass(frozen=True)
class Family:
    headers: dict[str, str]  # role -> the exact text in front of a message's content
    end: str  # the end-of-turn marker
    think_tokens: bool  # <think> and </think> are (non-special) tokens of the real vocabulary


FAMILIES = {
    "llama-3": Family({role: f"<|start_header_id|>{role}<|end_header_id|>\n\n" for role in ("system", "user", "assistant")},
                      "<|eot_id|>", think_tokens=False),
    "qwen3": Family({role: f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")},
                    "<|im_end|>", think_tokens=True),
    "kimi-k2": Family({role: f"<|im_{role}|>{role}<|im_middle|>" for role in ("system", "user", "assistant")},
                      "<|im_end|>", think_tokens=True),
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
THINK_FIRST = [  # reasoning inline, in the first of two assistant turns
    SYSTEM,
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "<think>\nLet me think step by step.\n</think>\n\nHello! The answer is 42."},
    {"role": "user", "content": "And the question?"},
    {"role": "assistant", "content": "A user thinks about code."},
]
THINK_LAST = [  # reasoning as a reasoning_content field, in the last assistant turn
    SYSTEM,
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "Hello! The answer is 42."},
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "The result is 42.", "reasoning_content": "Let me think step by step."},
]
CONVERSATIONS = {"think_first": THINK_FIRST, "think_last": THINK_LAST}

REASONED_ANSWER = "<think>\nLet me think step by step.\n</think>\n\nHello! The answer is 42."
# The text of each assistant turn that gets loss, in order: what the target sees of it in the whole conversation.
MASKED = {
    ("llama-3", "think_first"): [REASONED_ANSWER + "<|eot_id|>", "A user thinks about code.<|eot_id|>"],
    ("llama-3", "think_last"): ["Hello! The answer is 42.<|eot_id|>",
                                "<think>\nLet me think step by step.\n</think>\n\nThe result is 42.<|eot_id|>"],
    # Qwen3 drops the reasoning of turns before the last user message; the last turn always has a think block.
    ("qwen3", "think_first"): ["Hello! The answer is 42.<|im_end|>",
                               "<think>\n\n</think>\n\nA user thinks about code.<|im_end|>"],
    ("qwen3", "think_last"): ["Hello! The answer is 42.<|im_end|>",
                              "<think>\nLet me think step by step.\n</think>\n\nThe result is 42.<|im_end|>"],
    ("kimi-k2", "think_first"): [REASONED_ANSWER + "<|im_end|>", "A user thinks about code.<|im_end|>"],
    ("kimi-k2", "think_last"): ["Hello! The answer is 42.<|im_end|>",
                                "<think>Let me think step by step.</think>The result is 42.<|im_end|>"],
}
CASES = sorted(MASKED)


def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with family `name`'s special tokens, rendering with its shipped template."""
    specials = [PAD, *SHIPPED_TEMPLATES[name]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXTS, trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if FAMILIES[name].think_tokens:
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ("<think>", "</think>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=FAMILIES[name].end,
                                   additional_special_tokens=specials[1:], clean_up_tokenization_spaces=False)
    fast.chat_template = (resources.files("eagle3ops.data") / "templates" / f"{name}.jinja").read_text()
    return fast


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    return {name: family_tokenizer(name) for name in FAMILIES}


def label_tokens(tok, family: Family, ids: list[int]) -> list[tuple[str | None, str]]:
    """(role, part) per token; part is header | content | end | outside (BOS, Qwen's newline between turns)."""
    labels, role, part, j = [], None, "outside", 0
    while j < len(ids):
        if part != "content" and tok.convert_ids_to_tokens(ids[j]) in tok.all_special_tokens:
            # A message opens: read tokens until they spell one role's header exactly.
            for k in range(j + 1, len(ids) + 1):
                text = tok.decode(ids[j:k])
                found = [r for r, header in family.headers.items() if header == text]
                if found or not any(header.startswith(text) for header in family.headers.values()):
                    break
            if found:
                role, part = found[0], "content"
                labels += [(role, "header")] * (k - j)
                j = k
                continue
        if part == "content" and tok.convert_ids_to_tokens(ids[j]) == family.end:
            labels.append((role, "end"))
            part = "outside"
        else:
            labels.append((role if part == "content" else None, part))
        j += 1
    return labels


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of ones."""
    edges = [j for j in range(len(mask) + 1)
             if (j < len(mask) and mask[j]) != (j > 0 and bool(mask[j - 1]))]
    return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("name,conversation", CASES)
def test_mask_token_by_token(tokenizers, name, conversation):
    tok, family, messages = tokenizers[name], FAMILIES[name], CONVERSATIONS[conversation]
    result = tokenize_conversation(tok, messages, max_len=4096)
    assert not result.truncated and len(result.input_ids) == len(result.loss_mask)
    assert tok.decode(result.input_ids) == render(tok, messages)  # nothing added or lost
    labels = label_tokens(tok, family, result.input_ids)
    # Every message got its header, in order (Llama's system header is there whatever the conversation).
    headers = [role for j, (role, part) in enumerate(labels) if part == "header" and (j == 0 or labels[j - 1] != (role, "header"))]
    assert headers == [m["role"] for m in messages]
    for j, ((role, part), masked) in enumerate(zip(labels, result.loss_mask)):
        assert masked == int(role == "assistant" and part in ("content", "end")), (j, role, part)
    # The masked runs are exactly the assistant turns as the target sees them, each closed by its marker.
    spans = runs(result.loss_mask)
    assert [tok.decode(result.input_ids[a:b]) for a, b in spans] == MASKED[name, conversation]
    for start, _ in spans:  # the one-token shift: the token before a run is the end of the assistant header
        assert tok.decode(result.input_ids[:start]).endswith(family.headers["assistant"])
    # Never the system or user text, never a header.
    unmasked = tok.decode([i for i, m in zip(result.input_ids, result.loss_mask) if not m])
    for message in messages:
        if message["role"] != "assistant":
            assert message["content"] in unmasked
    assert all(family.headers[m["role"]] in unmasked for m in messages)


@pytest.mark.parametrize("name,conversation", CASES)
def test_prompt_ids_end_with_the_assistant_header(tokenizers, name, conversation):
    """What generation continues for turn i is the whole conversation's tokens up to that turn's first loss token."""
    tok, family, messages = tokenizers[name], FAMILIES[name], CONVERSATIONS[conversation]
    full = tokenize_conversation(tok, messages, max_len=4096)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for index, (start, _) in zip(turns, runs(full.loss_mask)):
        ids = prompt_ids(tok, messages[:index])
        assert ids == full.input_ids[:start]
        assert tok.decode(ids).endswith(family.headers["assistant"])


@pytest.mark.parametrize("name,conversation", CASES)
def test_truncation_inside_the_last_turn(tokenizers, name, conversation):
    tok, messages = tokenizers[name], CONVERSATIONS[conversation]
    full = tokenize_conversation(tok, messages, max_len=4096)
    (first, first_end), (last, _) = runs(full.loss_mask)
    cut = tokenize_conversation(tok, messages, max_len=last + 2)
    assert cut.truncated
    assert cut.input_ids == full.input_ids[:last + 2] and cut.loss_mask == full.loss_mask[:last + 2]
    assert sum(cut.loss_mask) == (first_end - first) + 2


def test_rendering_follows_the_published_layouts(tokenizers):
    """The whole text of one conversation per family, as the published templates write it."""
    assert render(tokenizers["llama-3"], THINK_LAST[1:3], add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello world<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! The answer is 42.<|eot_id|>")
    assert render(tokenizers["qwen3"], THINK_FIRST) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello world<|im_end|>\n"
        "<|im_start|>assistant\nHello! The answer is 42.<|im_end|>\n"
        "<|im_start|>user\nAnd the question?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nA user thinks about code.<|im_end|>\n")
    assert render(tokenizers["qwen3"], THINK_FIRST[:2], add_generation_prompt=True).endswith(
        "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n")
    assert render(tokenizers["kimi-k2"], THINK_LAST[1:3], add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hello world<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello! The answer is 42.<|im_end|>")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_default_system_header_is_never_masked(tokenizers, name):
    """Llama's knowledge-date header and Kimi's default system prompt are there without a system message, unmasked."""
    tok = tokenizers[name]
    result = tokenize_conversation(tok, THINK_FIRST[1:], max_len=4096)
    masked = [tok.decode(result.input_ids[a:b]) for a, b in runs(result.loss_mask)]
    assert masked == MASKED[name, "think_first"]
    assert prompt_ids(tok, THINK_FIRST[1:2]) == result.input_ids[:runs(result.loss_mask)[0][0]]


def test_shipped_templates_are_package_data():
    folder = resources.files("eagle3ops.data") / "templates"
    files = sorted(p.name for p in folder.iterdir() if p.name.endswith(".jinja"))
    assert files == sorted(f"{name}.jinja" for name in SHIPPED_TEMPLATES)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["eagle3ops"]
    assert all(any(fnmatch.fnmatch(f"data/templates/{f}", p) for p in patterns) for f in files)


# ------------------------------------------------------------------------- which template: load_tokenizer(target)

def saved_tokenizer(tokenizer, directory: Path) -> str:
    """`tokenizer` saved as a target directory (config.json with just the vocabulary size: no weights needed)."""
    tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"vocab_size": len(tokenizer)}))
    return str(directory)


def test_the_tokenizers_own_template_by_default_and_a_configured_one_overrides_it(tiny_tokenizer, tmp_path):
    path = saved_tokenizer(tiny_tokenizer, tmp_path)
    own = load_tokenizer(TargetConfig(path=path))
    assert own.chat_template == ZOO_TEMPLATE
    assert render(own, THINK_FIRST[1:3]).startswith("<|im_user|>user<|im_middle|>Hello world")
    shipped = load_tokenizer(TargetConfig(path=path, chat_template="kimi-k2"))
    assert render(shipped, THINK_FIRST[1:3]).startswith(
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>")


def test_a_template_file_of_the_project(tiny_tokenizer, tmp_path, monkeypatch):
    path = saved_tokenizer(tiny_tokenizer, tmp_path / "target")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "terse.jinja").write_text(
        "{%- for m in messages -%}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content | upper }}<|im_end|>"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
    tok = load_tokenizer(TargetConfig(path=path, chat_template="templates/terse.jinja"))
    result = tokenize_conversation(tok, THINK_FIRST[1:3], max_len=4096)
    masked = [tok.decode(result.input_ids[a:b]) for a, b in runs(result.loss_mask)]
    assert masked == [REASONED_ANSWER.upper() + "<|im_end|>"]


def test_no_template_anywhere_names_the_key_and_the_choices(tiny_tokenizer, tmp_path):
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    path = saved_tokenizer(bare, tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template; set target.chat_template") as err:
        load_tokenizer(TargetConfig(path=path))
    assert all(name in str(err.value) for name in SHIPPED_TEMPLATES)
    # Configuring one is the fix.
    assert load_tokenizer(TargetConfig(path=path, chat_template="kimi-k2")).chat_template


@pytest.mark.parametrize("spec,message", [
    ("qwen3", r"'qwen3' writes <\|im_start\|>, which this tokenizer does not have as single tokens"),
    ("llama3", r"target.chat_template: 'llama3' is not one of llama-3, qwen3, kimi-k2"),
    ("../outside.jinja", "relative, without '..'"),
    ("/abs/template.jinja", "relative, without '..'"),
    ("missing.jinja", "target.chat_template: missing.jinja: file not found"),
])
def test_bad_chat_template_settings(tiny_tokenizer, tmp_path, monkeypatch, spec, message):
    path = saved_tokenizer(tiny_tokenizer, tmp_path / "target")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ChatTemplateError, match=message):
        load_tokenizer(TargetConfig(path=path, chat_template=spec))
