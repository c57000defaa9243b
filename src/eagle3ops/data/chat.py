"""Chat template -> token ids + loss mask on the assistant's own tokens.

Which template. `load_tokenizer()` (modeling/target.py) calls `use_chat_template()` with `target.chat_template`:
null keeps the tokenizer's own template; a name picks one shipped in `templates/` (`llama-3`, `qwen3`,
`kimi-k2`, written after the families' published templates, see each file's header); a path reads a .jinja
file of the project. It is set as `tokenizer.chat_template`, so everything below, and every caller, renders
with `tokenizer.apply_chat_template` and never sees the choice.

Which tokens get loss. loss_mask[j] == 1 means token j was produced by the assistant: the text of an assistant
turn and its end-of-turn marker (<|eot_id|>, <|im_end|>), never the role header in front of it nor what the
template writes after the marker (Qwen's "\\n"). A model at position j-1 predicts token j, so the first masked
token is the first one *after* the header, the "one-token shift" that is easy to get wrong: the header is the
prompt, the marker that ends the turn is the answer.

How turns are found. A conversation is rendered once, whole: those are the ids the target reads at extraction
and the drafter trains on. Assistant turn i starts where `messages[:i]` rendered with the generation prompt
ends (the prompt the target continued when it wrote that turn), which must be a prefix of the whole rendering.
It ends with its end-of-turn marker: the last special token of the turn rendered as the last message, found
again in the whole text. Character spans map to tokens through the tokenizer's offsets.

Reasoning, and templates that rewrite history. A rendered prefix of a conversation is not always a prefix of
its rendering. Qwen3's template drops the reasoning of assistant turns that come before the last user message,
and gives the last turn a think block, empty if it has no reasoning (Kimi-K2-Thinking's and K2.5's own blank
earlier reasoning to `<think></think>`, and get the same treatment: loss on what the whole rendering shows).
What the target sees, and what gets loss, in the one whole rendering of a Qwen3 conversation:
- the last turn: `<think>\\n...\\n</think>\\n\\n` then its content, exactly what the target writes in thinking
  mode; all of it gets loss, an empty think block included, then <|im_end|>;
- earlier turns: their content only, as the target reads them in history when it answers later; that content
  and its <|im_end|> get loss, their reasoning is not in the sequence and gets none.
The alternative, one sample per assistant turn each rendered as the last, would keep every turn's reasoning at a
cost quadratic in conversation length and break prepare's one sample per conversation; a dataset whose earlier
reasoning matters can be written as one conversation per turn. The shipped `llama-3` and `kimi-k2` keep
reasoning (inline or from `reasoning_content`) in every turn, so there it is masked wherever it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3ops.errors import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Shipped templates (`templates/<name>.jinja`) and the special tokens each writes: the tokenizer must have every
# one as a single token, or the template belongs to another family.
SHIPPED_TEMPLATES = {
    "llama-3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "kimi-k2": ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
}
CHOICES = f"one of {', '.join(SHIPPED_TEMPLATES)} or the path of a .jinja file in the project"


class ChatTemplateError(InputError):
    """No usable chat template, or one that cannot locate the assistant's turns."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def read_chat_template(spec: str) -> str:
    """The template `spec` names (a value of target.chat_template): a shipped name or a project .jinja path."""
    if spec in SHIPPED_TEMPLATES:
        return (resources.files("eagle3ops.data") / "templates" / f"{spec}.jinja").read_text(encoding="utf-8")
    path = Path(spec)
    if path.suffix != ".jinja" or path.is_absolute() or ".." in path.parts:
        raise ChatTemplateError(f"target.chat_template: {spec!r} is not {CHOICES} (relative, without '..')")
    if not path.is_file():
        raise ChatTemplateError(f"target.chat_template: {spec}: file not found")
    return path.read_text(encoding="utf-8")


def use_chat_template(tokenizer: PreTrainedTokenizerBase, spec: str | None, where: str) -> None:
    """Render with `spec` (target.chat_template) when given, else with the tokenizer's own template;
    `where` (the tokenizer's directory) prefixes the errors."""
    if spec is None:
        if not tokenizer.chat_template:
            raise ChatTemplateError(f"{where}: the tokenizer has no chat template; set target.chat_template in "
                                    f"params.yaml to {CHOICES}")
        return
    missing = [token for token in SHIPPED_TEMPLATES.get(spec, ())
               if len(tokenizer(token, add_special_tokens=False)["input_ids"]) != 1]
    if missing:
        raise ChatTemplateError(f"{where}: target.chat_template {spec!r} writes {', '.join(missing)}, which this "
                                f"tokenizer does not have as single tokens: the template is for another model family")
    tokenizer.chat_template = read_chat_template(spec)


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


# A reasoning trace's turn can be megabytes: the closing marker is looked for in a tail of this many characters, four
# times longer each time none is found; the text is tokenized only as far as data.max_len tokens need (HEAD_MARGIN
# tokens beyond them, so that where the text was cut changes none of those kept)
TAIL_CHARS = 1024
HEAD_CHARS_PER_TOKEN = 8
HEAD_MARGIN = 64


def end_of_turn_marker(tokenizer: PreTrainedTokenizerBase, turn: str) -> str | None:
    """The last special token in `turn` (one assistant turn as the template writes it), which closes it; looked for
    from the end, tokenizing as little of the turn as it takes."""
    special = {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    window = TAIL_CHARS
    while True:  # a special token cut at the window's start is not matched: the next, longer window has it whole
        ids = tokenizer(turn[-window:], add_special_tokens=False)["input_ids"]
        found = next((special[token_id] for token_id in reversed(ids) if token_id in special), None)
        if found is not None or window >= len(turn):
            return found
        window *= 4


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendered text and the [start, end) character span of every assistant turn in it, from the
    end of its header to the end of its end-of-turn marker."""
    text = render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], add_generation_prompt=True)
        alone = render(tokenizer, messages[: index + 1])
        if not (text.startswith(prompt) and alone.startswith(prompt)):
            raise ChatTemplateError(f"assistant turn {index}: the chat template writes the conversation before it "
                                    "differently as a prompt than within the whole (its rendered prefixes are not "
                                    "consistent); cannot locate the turn")
        marker = end_of_turn_marker(tokenizer, alone[len(prompt):])
        end = text.find(marker, len(prompt)) if marker else -1
        if end < 0:
            raise ChatTemplateError(f"assistant turn {index}: the chat template closes it with no special token "
                                    "found again in the whole conversation; cannot tell where it ends")
        spans.append((len(prompt), end + len(marker)))
    return text, spans


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_len: int) -> Tokenized:
    text, spans = assistant_spans(tokenizer, messages)
    ids, offsets, truncated = _encode_head(tokenizer, text, max_len)
    mask = [int(any(start <= tok_start < end for start, end in spans)) for tok_start, _ in offsets]
    return Tokenized(ids, mask, truncated)


def _encode_head(tokenizer: PreTrainedTokenizerBase, text: str, max_len: int) -> tuple[list[int], list, bool]:
    """The first `max_len` token ids of `text` and their character offsets, and whether it has more: a head of the
    text is tokenized, longer until it holds HEAD_MARGIN tokens beyond `max_len` (a cut changes only the tokens
    next to it), else the whole text."""
    chars = HEAD_CHARS_PER_TOKEN * (max_len + HEAD_MARGIN)
    while chars < len(text):
        encoding = tokenizer(text[:chars], add_special_tokens=False, return_offsets_mapping=True)
        if len(encoding["input_ids"]) > max_len + HEAD_MARGIN:
            return encoding["input_ids"][:max_len], encoding["offset_mapping"][:max_len], True
        chars *= 4
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoding["input_ids"]
    return ids[:max_len], encoding["offset_mapping"][:max_len], len(ids) > max_len


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a conversation up to and including the assistant header (what generation continues)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
