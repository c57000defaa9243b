"""A byte-level BPE tokenizer with Kimi-style chat markers, trained offline on the zoo corpus."""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, PAD, END = "[BOS]", "[PAD]", "<|im_end|>"
ROLE_MARKERS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]
SPECIAL_TOKENS = [BOS, PAD, END, *ROLE_MARKERS]
THINK_TOKENS = ["<think>", "</think>"]  # ordinary added tokens, as in Kimi-K2.5: they decode as text

# Kimi-K2's layout: <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>, no separators. The rendering of any
# prefix of a conversation is a prefix of its rendering, which data/chat.py relies on to find assistant spans.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=END, pad_token=PAD,
                                   additional_special_tokens=ROLE_MARKERS, chat_template=CHAT_TEMPLATE,
                                   model_max_length=4096, clean_up_tokenization_spaces=False)
