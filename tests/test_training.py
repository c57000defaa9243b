"""The training loop's parts: packing samples into rows, assembling them, the float32 master weights, and the
variants of training (optimizer, TTT positions, EAGLE-3.1) resuming exactly."""
import copy
import io

import pytest
import torch

from eagle3ops.errors import InputError
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.training.data import OPEN_ROWS, assemble, eval_batches, pack, schedule
from eagle3ops.training.loop import MasterWeights


def samples_of(*lengths: int) -> list[dict]:
    return [{"input_ids": torch.arange(n) + 100 * i, "loss_mask": torch.ones(n, dtype=torch.uint8),
             "aux_hidden": torch.full((n, 3), float(i))} for i, n in enumerate(lengths)]


def test_packing_keeps_every_sample_whole_once_and_fills_the_rows():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (500,), generator=generator).tolist()
    order = torch.randperm(500, generator=generator).tolist()
    rows = pack(lengths, 512, order)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    fill = sum(lengths) / (512 * len(rows))
    assert fill > 0.95, fill
    # first fit in the given order: a row's samples keep that order
    position = {index: n for n, index in enumerate(order)}
    assert all([position[i] for i in row] == sorted(position[i] for i in row) for row in rows)


def test_packing_closes_the_oldest_row_when_too_many_are_open():
    """Samples that each fill a little over half a row open a row each: rows close, oldest first, before more
    than OPEN_ROWS are open, so a sample waits at most that many rows for its step."""
    rows = pack([6] * 20, 10, list(range(20)))
    assert rows == [[i] for i in range(20)]
    lengths = [6] * (OPEN_ROWS + 1) + [4]
    rows = pack(lengths, 10, list(range(len(lengths))))
    assert rows[0] == [0] and [OPEN_ROWS + 1] in [row[1:] for row in rows]  # the 4 joins a row still open


def test_a_sample_longer_than_a_row_is_refused_naming_the_key():
    with pytest.raises(InputError, match="train.packed_length 8 is shorter than a sample of 9 tokens"):
        schedule(samples_of(3, 9), packed_length=8, batch_size=1, seed=0, epochs=1)


def test_the_schedule_is_seeded_per_epoch_and_holds_every_sample_each_epoch():
    samples = samples_of(*range(1, 40))
    by_epoch = schedule(samples, packed_length=64, batch_size=3, seed=7, epochs=2)
    again = schedule(samples, packed_length=64, batch_size=3, seed=7, epochs=2)
    ids = [[[int(s["input_ids"][0]) for s in row] for batch in epoch for row in batch] for epoch in by_epoch]
    assert ids == [[[int(s["input_ids"][0]) for s in row] for batch in epoch for row in batch] for epoch in again]
    assert ids[0] != ids[1]
    assert all(sorted(i for row in epoch for i in row) == sorted(100 * i for i in range(39)) for epoch in ids)
    assert all(len(batch) == 3 for epoch in by_epoch for batch in epoch[:-1])
    held_out = eval_batches(samples, 64, 3)  # in their own order
    assert [int(s["input_ids"][0]) for batch in held_out for row in batch for s in row][:3] == [0, 100, 200]


def test_assembled_rows_carry_each_documents_positions_and_a_padded_tail():
    """A short batch (the last of an epoch) is filled with rows of padding to the shape of the others."""
    rows = [samples_of(3, 2), samples_of(4)]
    batch = assemble(rows, 7, row_count=3)
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2], list(range(7))]
    assert batch["input_ids"].tolist() == [[0, 1, 2, 100, 101, 0, 0], [0, 1, 2, 3, 0, 0, 0], [0] * 7]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0], [0] * 7]
    assert batch["aux_hidden"][0, :, 0].tolist() == [0, 0, 0, 1, 1, 0, 0]


def test_master_weights_train_bf16_weights_through_float32_copies():
    """On a GPU the drafter trains in bf16 while the optimizer keeps float32 masters: the drafter's weights follow
    the masters (rounded), a resume point holds the masters, and the trained drafter comes back in float32."""
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    vocab_size=24, draft_vocab_size=24, target_hidden_size=16))
    before = {name: p.detach().clone() for name, p in draft.named_parameters() if p.requires_grad}
    weights = MasterWeights(draft, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in weights.weights)
    assert all(torch.equal(m, before[name]) for name, m in zip(weights.names, weights.masters))
    optimizer = torch.optim.AdamW(weights.masters, lr=1e-2)
    for _ in range(3):
        weights.release_gradients()
        loss = sum((p.float() ** 2).sum() for p in weights.weights)
        loss.backward()
        weights.take_gradients()
        assert all(m.grad.dtype == torch.float32 for m in weights.masters)
        assert all(p.grad is None for p in weights.weights)  # the bf16 gradients let go at once
        optimizer.step()
        weights.update()
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(weights.weights, weights.masters))
        assert all(m.grad is None for m in weights.masters)  # nothing held into the next forward
    saved = weights.state_dict()
    assert all(saved[name].dtype == torch.float32 and torch.equal(saved[name], m)
               for name, m in zip(weights.names, weights.masters))
    assert not torch.equal(saved["fc.weight"], before["fc.weight"])
    weights.restore()
    assert all(torch.equal(p, m) and p.dtype == torch.float32 for p, m in zip(weights.weights, weights.masters))
    same = MasterWeights(draft, torch.float32)  # in float32 the drafter's weights are the optimizer's
    assert all(m is p for m, p in zip(same.masters, same.weights))


def test_a_held_out_sample_longer_than_a_row_stops_the_run_before_its_first_step():
    from eagle3ops.config import DrafterTrainConfig
    from eagle3ops.training.loop import Recipe, train_drafter

    draft = Eagle3Draft(DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    vocab_size=24, draft_vocab_size=24, target_hidden_size=16))
    fuse = draft.fuse
    steps = []
    draft.fuse = lambda aux: steps.append(1) or fuse(aux)
    samples = [{"input_ids": torch.randint(0, 24, (n,)), "loss_mask": torch.ones(n, dtype=torch.uint8),
                "aux_hidden": torch.randn(n, 48), "final_hidden": torch.randn(n, 16)} for n in (9, 7, 30)]
    optim = DrafterTrainConfig(epochs=1, batch_size=1, packed_length=16, lr=1e-4, optimizer="adamw", ttt_steps=2,
                               checkpoint_every=0)
    with pytest.raises(InputError, match="train.packed_length 16 is shorter than a sample of 30 tokens"):
        train_drafter(Recipe(draft, samples[:2], samples[2:], torch.randn(24, 16), optim, 0, torch.device("cpu")))
    assert not steps


def test_a_run_reports_the_padded_share_of_its_rows():
    from eagle3ops.config import DrafterTrainConfig
    from eagle3ops.training.loop import Recipe, train_drafter

    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    vocab_size=24, draft_vocab_size=24, target_hidden_size=16))
    draft.t2d.fill_(True)
    samples = [{"input_ids": torch.randint(0, 24, (n,)), "loss_mask": torch.ones(n, dtype=torch.uint8),
                "aux_hidden": torch.randn(n, 48), "final_hidden": torch.randn(n, 16)} for n in (9, 7, 12, 5, 10)]
    optim = DrafterTrainConfig(epochs=2, batch_size=2, packed_length=16, lr=1e-4, optimizer="adamw", ttt_steps=2,
                               checkpoint_every=0)
    result, _ = train_drafter(Recipe(draft, samples, [], torch.randn(24, 16), optim, 0, torch.device("cpu")))
    rows = sum(len(batch) for epoch in schedule(samples, 16, 2, 0, 2) for batch in epoch)
    assert result.tokens == 2 * 43 and result.padding_share == pytest.approx(1 - 86 / (rows * 16))
    assert 0 < result.first_step_s < result.wall_s  # the first step alone, part of the loop's time


def saved_bytes(state) -> bytes:
    """What torch.save writes for a TrainState, as the train stage saves resume points and training_state.pt."""
    buffer = io.BytesIO()
    torch.save(state.to_dict(), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("variant", [{"optimizer": "muon"}, {"optimizer": "muon", "muon_lr": 0.05},
                                     {"ttt_positions": "raised"}, {"eagle31": True}, {"loss": "lk_alpha"},
                                     {"loss": "lk_lambda", "lk_kl_decay": 1.0}],
                         ids=["muon", "muon_lr", "raised", "eagle3.1", "lk_alpha", "lk_lambda"])
def test_each_training_variant_learns_and_resumes_to_the_weights_of_an_uninterrupted_run(variant):
    """Muon (beside AdamW, each with its schedule), raised TTT positions, EAGLE-3.1 and the LK losses: the held-out
    loss falls (alpha, the acceptance probability, logged per TTT step), and a run continued from its resume point (the optimizers' and schedules' states by name) ends bit for bit where the
    uninterrupted run does."""
    from eagle3ops.config import DrafterTrainConfig
    from eagle3ops.training.loop import Hooks, Recipe, TrainState, train_drafter

    settings = {key: value for key, value in variant.items() if key != "eagle31"}
    optim = DrafterTrainConfig(**{"epochs": 3, "batch_size": 2, "packed_length": 48, "ttt_steps": 3, "log_every": 1,
                                  "checkpoint_every": 2, "optimizer": "adamw", **settings})
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 24, (n,), generator=generator),
                "loss_mask": torch.ones(n, dtype=torch.uint8), "aux_hidden": torch.randn(n, 48, generator=generator),
                "final_hidden": torch.randn(n, 16, generator=generator)} for n in range(8, 30, 2)]
    head = torch.randn(24, 16, generator=generator)

    def drafter() -> Eagle3Draft:
        torch.manual_seed(1)
        eagle31 = bool(variant.get("eagle31"))
        draft = Eagle3Draft(DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=24, draft_vocab_size=24,
                                        target_hidden_size=16, fc_norm=eagle31, norm_output=eagle31))
        draft.t2d.fill_(True)
        return draft

    def run(draft, state=None, hooks=Hooks()):
        return train_drafter(Recipe(draft, samples, samples[:4], head, optim, 0, torch.device("cpu")), hooks, state)

    whole = drafter()
    result, whole_state = run(whole)
    assert result.steps >= 6 and result.final["eval/loss"] < result.history[0]["train/loss"]
    assert all(0 < row["train/alpha_2"] < 1 for row in result.history) and 0 < result.final["eval/alpha_2"] < 1
    saved = []
    run(drafter(), hooks=Hooks(checkpoint=lambda state: saved.append(saved_bytes(state))))  # as the stage saves it
    resumed_point = TrainState.from_dict(torch.load(io.BytesIO(saved[1]), weights_only=True))
    assert set(resumed_point.optimizer) == ({"adamw", "muon"} if "optimizer" in variant else {"adamw"})
    resumed = drafter()
    resumed_result, resumed_state = run(resumed, resumed_point)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    # the state saved beside the drafter, byte for byte (DVC hashes training_state.pt), and the whole run's padding
    assert saved_bytes(resumed_state) == saved_bytes(whole_state)
    assert resumed_result.padding_share == result.padding_share


# --- the drafter training starts from: built without a wasted random initialisation ---------------------------------

def new_tiny_drafter(embedding: torch.Tensor, seed: int) -> Eagle3Draft:
    from transformers import LlamaConfig

    from eagle3ops.config import DraftShapeConfig
    from eagle3ops.training.init import new_drafter

    target = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=64, max_position_embeddings=128)
    ids = torch.arange(0, 64, 4)  # a draft vocabulary of 16
    t2d = torch.zeros(64, dtype=torch.bool).index_fill_(0, ids, True)
    return new_drafter(target, DraftShapeConfig(), [1, 2, 3], embedding, ids - torch.arange(16), t2d, seed)


def test_a_new_drafter_is_seeded_and_on_the_host_the_drafter_it_was_before_it_took_a_device():
    """Scratch: the same seed gives the same weights, on the CPU those of the former construction (seed, build on the
    host, copy the embedding in); the frozen embedding is the target's tensor itself, converted once when its dtype
    is another."""
    embedding = torch.randn(64, 16)
    draft, again, other = (new_tiny_drafter(embedding, seed) for seed in (3, 3, 4))
    torch.manual_seed(3)
    before = Eagle3Draft(copy.deepcopy(draft.cfg))
    before.embed_tokens.weight.data.copy_(embedding)
    before.d2t.copy_(draft.d2t)
    before.t2d.copy_(draft.t2d)
    for name, tensor in before.state_dict().items():
        assert torch.equal(draft.state_dict()[name], tensor) and torch.equal(again.state_dict()[name], tensor), name
    assert not torch.equal(other.fc.weight, draft.fc.weight)
    weight = draft.embed_tokens.weight
    assert weight.data_ptr() == embedding.data_ptr() and not weight.requires_grad
    assert [name for name, p in draft.named_parameters() if not p.requires_grad] == ["embed_tokens.weight"]
    from_bf16 = new_tiny_drafter(embedding.bfloat16(), 3).embed_tokens.weight
    assert from_bf16.dtype == torch.float32 and torch.equal(from_bf16, embedding.bfloat16().float())
    with pytest.raises(InputError, match=r"the target's embedding is \(64, 8\)"):
        new_tiny_drafter(torch.zeros(64, 8), 3)


@pytest.mark.parametrize("layout", ["sglang", "eagle"])
def test_a_saved_drafter_loads_without_drawing_a_random_number(layout, tmp_path):
    """load_any_drafter (eval, a warm start) builds the drafter on the meta device and fills it from its checkpoint
    (ours, or the EAGLE authors' in fp16): the checkpoint's tensors, the target's embedding itself, and the random
    generator untouched, re-heading included."""
    from eagle3ops.formats.checkpoint import load_any_drafter, read_drafter
    from eagle3ops.formats.specforge import WEIGHTS, read_weights, save_drafter
    from eagle3ops.training.init import rehead

    embedding = torch.randn(64, 16)
    source = tmp_path / "source"
    save_drafter(new_tiny_drafter(embedding, 5), source)
    if layout == "eagle":
        tensors = read_weights(source)
        torch.save({name: t.half() if t.is_floating_point() else t for name, t in tensors.items()},
                   source / "pytorch_model.bin")
        (source / WEIGHTS).unlink()
    state = torch.get_rng_state()
    loaded = load_any_drafter(source, embedding)
    saved = read_drafter(source).weights  # every tensor but the embedding, as the checkpoint holds it
    for name, tensor in saved.items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(loaded.state_dict()[name].dtype)), name
    ids = torch.arange(1, 64, 2)  # another draft vocabulary, of 32, sharing no token with the source's
    t2d = torch.zeros(64, dtype=torch.bool).index_fill_(0, ids, True)
    assert rehead(loaded, ids - torch.arange(32), t2d, torch.randn(64, 16, generator=torch.Generator())) == 32
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn: no random initialisation ran
    assert loaded.lm_head.weight.shape == (32, 16) and loaded.lm_head.weight.requires_grad
    assert all(t.device.type == "cpu" for t in loaded.state_dict().values())
    assert loaded.embed_tokens.weight.data_ptr() == embedding.data_ptr()
