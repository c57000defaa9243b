"""generate.backend hf: transformers' generate regenerates the assistant turns in left-padded batches."""
import copy

import pytest


@pytest.mark.parametrize("pad_token", ["own", "none"])
def test_batched_regeneration_equals_each_conversation_alone(tiny_target_dir, pad_token):
    """Prompts of different lengths in one batch answer as each alone does, with the tokenizer's pad token and with
    none (SmolLM2's and Llama's tokenizers have none: the end of sequence pads, masked out)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3ops.generation.hf import regenerate

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    if pad_token == "none":
        tokenizer.pad_token = None
        assert tokenizer.pad_token_id is None
    conversations = [{"id": str(i), "messages": [{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": "old"}]}
                     for i, prompt in enumerate(["hi", "a much longer question about the lists and the numbers"])]
    together, stats = regenerate(model, tokenizer, copy.deepcopy(conversations), 2, 12, 0.0, 0)
    alone = [regenerate(model, tokenizer, [conversation], 1, 12, 0.0, 0)[0][0] for conversation in conversations]
    assert together == alone
    assert stats.turns == 2 and all(c["messages"][1]["content"] != "old" for c in together)
