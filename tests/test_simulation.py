"""The acceptance simulator during training measures what the eval stage measures, on the same prompts."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3ops.config import DrafterTrainConfig, DraftShapeConfig
from eagle3ops.decoding.speculative import AcceptanceStats, speculative_generate
from eagle3ops.extraction.hf import extract_features
from eagle3ops.spec_settings import SpecSettings
from eagle3ops.training.data import load_feature_samples
from eagle3ops.training.init import new_drafter
from eagle3ops.training.loop import Hooks, Recipe, train_drafter
from eagle3ops.training.simulation import AcceptanceSimulator, held_out_prompts

V, H = 48, 32


def test_held_out_prompts_stop_before_the_first_assistant_token():
    samples = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0]},
               {"input_ids": [1, 2], "loss_mask": [0, 0]},  # no assistant token: no prompt
               {"input_ids": [3, 4, 5], "loss_mask": [1, 1, 1]},  # nothing before it: no prompt
               {"input_ids": [7, 7, 7, 2], "loss_mask": [0, 0, 0, 1]}]
    assert held_out_prompts(samples, 5) == [[5, 6], [7, 7, 7]]
    assert held_out_prompts(samples, 1) == [[5, 6]]


def test_simulated_tau_is_the_eval_tau_of_the_trained_drafter(tmp_path):
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256)).eval()
    samples = []
    for i in range(24):  # the target's own greedy continuations: data a drafter can learn
        prompt = torch.randint(0, V, (6,))
        answer = target.generate(prompt[None], max_new_tokens=14, do_sample=False)[0, 6:]
        ids = torch.cat([prompt, answer]).tolist()
        samples.append({"id": f"s{i:02d}", "input_ids": ids, "loss_mask": [0] * 6 + [1] * len(answer)})
    extract_features(target, samples, [2, 3, 4], tmp_path / "features", batch_size=8, samples_per_shard=8)
    features = load_feature_samples(tmp_path / "features", H)
    t2d = torch.ones(V, dtype=torch.bool)
    draft = new_drafter(target.config, DraftShapeConfig(), [2, 3, 4], target.get_input_embeddings().weight.detach(),
                        torch.zeros(V, dtype=torch.int64), t2d, seed=0)
    prompts = held_out_prompts([{"input_ids": s["input_ids"], "loss_mask": s["loss_mask"]} for s in samples[:4]], 4)
    settings = SpecSettings(k=3)
    simulator = AcceptanceSimulator(target, prompts, settings, max_new_tokens=12, eos_ids=set(), seed=0)
    logged: list[tuple[int, dict]] = []
    optim = DrafterTrainConfig(epochs=30, batch_size=1, packed_length=80, lr=1e-2, optimizer="adamw", ttt_steps=3,
                               log_every=60)
    recipe = Recipe(draft, features, [], target.lm_head.weight.detach(), optim, 0, torch.device("cpu"))
    result, _ = train_drafter(recipe, Hooks(log=lambda step, m: logged.append((step, m)), probe=simulator,
                                            probe_every=60))

    probed = [(step, m["sim/tau"]) for step, m in logged if "sim/tau" in m]
    assert [step for step, _ in probed] == [60, 120, 180]  # every 60 steps, and the last one
    assert probed[-1][1] > max(1.3, probed[0][1])  # acceptance grows as the drafter learns
    assert result.final["sim/tau"] == probed[-1][1] and result.probe_s > 0
    assert any("sim/tau" in row and "train/loss" in row for row in result.history)  # next to loss and accuracy

    # The eval stage's measurement of the finished drafter on the same prompts gives the same tau.
    draft.eval()
    generations = speculative_generate(target, draft, prompts, settings, 12, set(), 0)
    evaluated = AcceptanceStats.merged(3, [g.stats for g in generations])
    assert evaluated.tau == probed[-1][1]
    assert [result.final[f"sim/accept_{i}"] for i in (1, 2, 3)] == evaluated.per_position
