"""The speculators export read by a real client: vllm-project/speculators' own Eagle3DraftModel (the library vLLM's
drafter layout comes from) loads our export from its directory, and its forward gives our drafter's logits.

speculators trains with raised positions (step k at t + k): its TTT steps equal ours with train.ttt_positions raised,
and only its step 0 equals ours with fixed positions. The export leaves the target's embedding out (vLLM shares the
target's); speculators fills it from the verifier only where its freshly built weight holds a NaN, which under
transformers 5 it often does not: a client copies the verifier's embedding in after loading (docs/serving.md).
"""
from __future__ import annotations

import json

import pytest
import speculators.models.eagle3 as speculators  # the test extra installs it
import torch
from transformers import AutoModelForCausalLM

from eagle3ops.formats.export import export_drafter
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from helpers import ttt_logits

AUX, VD, T, K = [1, 2, 3], 48, 128, 4  # T: its flex block mask is built for whole 128-token tiles


def our_drafter(vocab: int, eagle31: bool, embedding: torch.Tensor) -> Eagle3Draft:
    torch.manual_seed(1)
    draft = Eagle3Draft(DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                                    vocab_size=vocab, draft_vocab_size=VD, target_hidden_size=32, aux_layers=AUX,
                                    max_position_embeddings=512, fc_norm=eagle31, norm_output=eagle31))
    for name, p in draft.named_parameters():
        if p.requires_grad:  # weights large enough that a wrong position or norm shows in the logits
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    draft.embed_tokens.weight.data.copy_(embedding)
    chosen = torch.randperm(vocab)[:VD].sort().values
    draft.d2t.copy_(chosen - torch.arange(VD))
    draft.t2d.zero_()
    draft.t2d[chosen] = True
    return draft.eval()


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_speculators_loads_our_export_and_its_forward_gives_our_logits(eagle31, tmp_path, tiny_target_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    embedding = target.get_input_embeddings().weight.detach()
    ours = our_drafter(embedding.shape[0], eagle31, embedding)
    save_drafter(ours, tmp_path / "drafter")
    assert export_drafter(tmp_path / "drafter", tmp_path / "speculators", "speculators", tiny_target_dir).ok

    theirs = speculators.Eagle3DraftModel.from_pretrained(str(tmp_path / "speculators")).float().eval()
    theirs.embed_tokens.weight.data.copy_(embedding)  # the safe load: the verifier's embedding, always
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert theirs.config.fc_norm is config["fc_norm"] is eagle31 and theirs.config.norm_output is eagle31
    assert (theirs.fc_norm is not None) is eagle31
    assert torch.equal(theirs.d2t.long(), ours.d2t) and torch.equal(theirs.t2d.bool(), ours.t2d)

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, embedding.shape[0], (1, T), generator=generator)  # x_{t+1} at t, one document
    aux = torch.randn(1, T, 3 * 32, generator=generator)
    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    with torch.no_grad():
        theirs(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long),
               position_ids=torch.arange(T)[None], ttt_steps=K)
        positions = torch.arange(T)[None]
        raised = ttt_logits(ours, ids, aux, positions, K, raise_positions=True)
        fixed = ttt_logits(ours, ids, aux, positions, K, raise_positions=False)
    hook.remove()
    assert len(captured) == K
    torch.testing.assert_close(captured[0], fixed[0], rtol=1e-4, atol=1e-4)  # step 0: the positions do not matter
    for k in range(K):
        torch.testing.assert_close(captured[k], raised[k], rtol=1e-4, atol=1e-4)
    for k in range(1, K):  # steps >= 1: speculators raises the positions, so fixed ones differ
        assert not torch.allclose(captured[k], fixed[k], rtol=1e-3, atol=1e-3)
