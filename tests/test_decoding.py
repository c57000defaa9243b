"""Capture hooks, extraction, acceptance counting and lossless greedy speculative decoding on tiny models; the
eval stage's measurement at eval.temperature and again at eval.sampled_temperature."""
import copy
import json
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle3ops.config import Config, ConfigError, EvalConfig, PromptSetConfig, TargetConfig, load_config
from eagle3ops.data.shards import iter_samples
from eagle3ops.decoding import evaluation
from eagle3ops.decoding.batching import TargetBatch
from eagle3ops.decoding.evaluation import decode_and_compare, find_parting
from eagle3ops.decoding.speculative import (
    AcceptanceStats,
    speculative_generate,
    speculative_greedy,
    target_generate,
    target_greedy,
)
from eagle3ops.decoding.tree import Candidates, DraftTree
from eagle3ops.errors import InputError
from eagle3ops.extraction.hf import extract_features
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.modeling.target import TargetError, capture, resolve_aux_layers
from eagle3ops.reporting.summary import acceptance_table
from eagle3ops.spec_settings import DecodingError, SpecSettings, sampled_settings
from eagle3ops.stages import eval as eval_stage
from helpers import isolate

V, H, LAYERS = 64, 32, 6




@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def drafter(target, seed=0, draft_vocab=32) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=V, draft_vocab_size=draft_vocab, target_hidden_size=H, aux_layers=[2, 3, 4])
    draft = Eagle3Draft(cfg)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    chosen = torch.arange(draft_vocab) * (V // draft_vocab)
    draft.d2t.copy_(chosen - torch.arange(draft_vocab))
    draft.t2d[chosen] = True
    return draft.eval()


def test_hooks_capture_hf_hidden_state_indices(target):
    ids = torch.randint(0, V, (2, 10))
    with torch.no_grad(), capture(target, [0, 2, 5]) as hooks:
        out = target(input_ids=ids, output_hidden_states=True)
    states = out.hidden_states  # index 0 = embeddings, i = output of layer i-1
    torch.testing.assert_close(hooks.aux(), torch.cat([states[0], states[2], states[5]], dim=-1))
    torch.testing.assert_close(hooks.final(), states[-1])  # after the final norm


def test_aux_layer_range_is_checked():
    assert resolve_aux_layers(None, 61) == [2, 30, 58]
    with pytest.raises(TargetError, match=r"target.aux_layers.*\[99\].*0..5"):
        resolve_aux_layers([2, 3, 99], LAYERS)


def test_extraction_does_not_depend_on_batch_composition(target, tmp_path):
    torch.manual_seed(1)
    samples = [{"id": f"s{i}", "input_ids": torch.randint(0, V, (n,)).tolist(), "loss_mask": [1] * n}
               for i, n in enumerate([5, 13, 9])]
    extract_features(target, samples, [2, 3, 4], tmp_path / "f", batch_size=3, samples_per_shard=2)
    stored = dict(iter_samples(tmp_path / "f"))
    assert set(stored) == {"s0", "s1", "s2"}
    for sample in samples:
        with torch.no_grad(), capture(target, [2, 3, 4]) as hooks:
            target(input_ids=torch.tensor([sample["input_ids"]]))
        got = stored[sample["id"]]
        assert got["input_ids"].tolist() == sample["input_ids"]
        torch.testing.assert_close(got["aux_hidden"], hooks.aux()[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["final_hidden"], hooks.final()[0], rtol=1e-4, atol=1e-5)


def test_acceptance_stats_count_like_the_engines():
    stats = AcceptanceStats(k=3)
    for accepted in (3, 0, 1, 2):
        stats.record(accepted)
    assert stats.tau == pytest.approx(1 + 6 / 4)
    assert stats.per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    other = AcceptanceStats(k=3)
    other.record(3)
    stats.merge(other)
    assert (stats.steps, stats.accepted, stats.accepted_at) == (5, 9, [4, 3, 2])
    assert AcceptanceStats(k=3).tau == 0.0


def test_tau_interval_is_a_bootstrap_over_prompts():
    """The engines' pooled tau of prompts drawn again: deterministic, around tau, wide for few and uneven prompts,
    narrower for more of them, a point for identical ones."""
    from eagle3ops.decoding.speculative import tau_interval

    def prompts(accepted_per_prompt: list[int]) -> list[AcceptanceStats]:
        stats = []
        for accepted in accepted_per_prompt:
            one = AcceptanceStats(k=3)
            for _ in range(10):  # ten verification steps, `accepted` drafts accepted over them
                one.record(0)
            one.accepted = accepted
            stats.append(one)
        return stats

    uneven = prompts([0, 30, 5, 25, 10, 20])
    low, high = tau_interval(uneven)
    assert (low, high) == tau_interval(uneven) and low < AcceptanceStats.merged(3, uneven).tau < high
    assert 1.0 <= low and high <= 4.0 and high - low > 0.5
    narrower = tau_interval(uneven * 16)
    assert narrower[1] - narrower[0] < (high - low) / 2
    assert tau_interval(prompts([12] * 8)) == pytest.approx((2.2, 2.2))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_greedy_equals_target_greedy(target, k, seed):
    torch.manual_seed(100 + seed)
    prompt = torch.randint(0, V, (7,)).tolist()
    eos = {V - 1}
    tokens, stats = speculative_greedy(target, drafter(target, seed), prompt, k, max_new_tokens=40, eos_ids=eos)
    assert tokens == target_greedy(target, prompt, 40, eos)
    assert stats.steps >= 1 and 0 <= stats.accepted <= k * stats.steps


def test_full_acceptance_when_the_drafter_agrees(target):
    """A target and a drafter whose final norms are zeroed both always pick id 0: every draft is accepted."""
    constant = copy.deepcopy(target)
    constant.model.norm.weight.data.zero_()
    draft = drafter(constant)
    draft.norm.weight.data.zero_()
    prompt = [5, 6, 7, 8]
    tokens, stats = speculative_greedy(constant, draft, prompt, k=3, max_new_tokens=17, eos_ids={V - 1})
    assert tokens == target_greedy(constant, prompt, 17, {V - 1}) == [0] * 17
    assert stats.tau == 4.0 and stats.per_position == [1.0, 1.0, 1.0]


# --- trees, batches, the target-side cache with holes -------------------------------------------------------


def prompts_of(lengths, seed=0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V - 1, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_tree_forward_with_holes_matches_each_branch_alone(target, attention):
    """One cached forward of a tree with a 4D mask, on left-padded rows that already hold holes, gives every
    node the logits a plain uncached forward of the prompt + accepted tokens + its own branch gives."""
    target = copy.deepcopy(target)
    target.set_attn_implementation(attention)
    prompts = prompts_of([3, 6])
    tree = DraftTree(tokens=[11, 12, 13, 14, 15], parents=[0, 0, 1, 1, 3])  # blocks: root 0, nodes 1..5
    batch = TargetBatch(target, 2)
    with torch.no_grad():
        batch.prefill(prompts)
        history = [list(p) for p in prompts]
        for path_per_row in ([[0, 1, 3], [0, 2]], [[0, 2], [0, 1, 4, 5]]):  # two rounds: the first leaves holes
            roots = [h[-1] + 1 for h in history]
            ids = torch.tensor([[root, *tree.tokens] for root in roots])
            depths = torch.tensor([tree.depths()] * 2)
            logits = batch.forward(ids, depths, torch.stack([tree.ancestor_mask()] * 2))
            for row in range(2):
                for block in range(len(tree.tokens) + 1):
                    branch = [block]
                    while branch[-1] != 0:
                        branch.append(tree.parents[branch[-1] - 1])
                    alone = history[row] + [int(ids[row, b]) for b in reversed(branch)]
                    expected = target(input_ids=torch.tensor([alone])).logits[0, -1]
                    torch.testing.assert_close(logits[row, block], expected, rtol=1e-4, atol=1e-4)
            keep = torch.zeros(ids.shape, dtype=torch.bool)
            for row, path in enumerate(path_per_row):
                keep[row, path] = True
                history[row] += [int(ids[row, b]) for b in path]
            batch.commit(keep)
        assert batch.lengths.tolist() == [len(h) for h in history]
        # the padded prompts, then each round up to its last kept block
        assert batch.cache.get_seq_length() == batch.valid.shape[1] == 6 + 4 + 6


def test_candidates_keep_sglang_best_nodes_and_their_parents():
    # root children a (0.6), b (0.3); a's children c (0.6 * 0.5), d (0.6 * 0.4); b's e (0.3 * 0.9) ...
    found = Candidates(tokens=[1, 2, 3, 4, 5, 6], scores=[0.6, 0.3, 0.3, 0.24, 0.27, 0.03],
                       parents=[-1, -1, 0, 0, 1, 1])
    tree = found.best(4)  # 0.6, 0.3 (b before its tie c: earlier record), 0.3, 0.27
    assert tree.tokens == [1, 2, 3, 5] and tree.parents == [0, 0, 1, 2]
    assert tree.depths() == [0, 1, 1, 2, 2]
    assert tree.walk(lambda block: {0: 2, 2: 5, 4: 9}[block]) == ([0, 2, 4], 9)


@pytest.mark.parametrize("k, topk, num_draft_tokens", [(3, 2, 6), (2, 3, 8), (4, 2, None)])
def test_greedy_tree_equals_target_greedy(target, k, topk, num_draft_tokens):
    settings = SpecSettings(k=k, topk=topk, num_draft_tokens=num_draft_tokens)
    prompt = prompts_of([7], seed=k)[0]
    [result] = speculative_generate(target, drafter(target, topk), [prompt], settings, 24, {V - 1})
    assert result.tokens == target_greedy(target, prompt, 24, {V - 1})
    assert 0 <= result.stats.accepted <= k * result.stats.steps


@pytest.mark.parametrize("settings", [SpecSettings(k=3), SpecSettings(k=3, topk=2, num_draft_tokens=6),
                                      SpecSettings(k=2, temperature=1.0, top_p=0.9),
                                      SpecSettings(k=3, temperature=0.8, draft_sample_method="probabilistic"),
                                      SpecSettings(k=2, topk=2, num_draft_tokens=5, temperature=1.0)],
                         ids=["chain", "tree", "chain-sampled", "chain-probabilistic", "tree-sampled"])
def test_batch_rows_equal_single_runs(target, settings):
    """Rows of different lengths and acceptance in one batch decode exactly as each alone (same draws: row i
    uses seed + i), so no row reads another's padding, holes or stale draft features."""
    prompts, draft, eos = prompts_of([2, 9, 5, 4], seed=3), drafter(target, 1), {V - 1}
    batched = speculative_generate(target, draft, prompts, settings, 16, eos, seed=10)
    for i, prompt in enumerate(prompts):
        [alone] = speculative_generate(target, draft, [prompt], settings, 16, eos, seed=10 + i)
        assert batched[i].tokens == alone.tokens
        assert batched[i].stats == alone.stats
        if settings.greedy:
            assert alone.tokens == target_greedy(target, prompt, 16, eos)
    merged = AcceptanceStats.merged(settings.k, [g.stats for g in batched])
    assert merged.steps == sum(g.stats.steps for g in batched)


def test_batched_target_generate_equals_target_greedy(target):
    prompts, eos = prompts_of([1, 8, 4], seed=5), {V - 1}
    assert target_generate(target, prompts, 12, eos) == [target_greedy(target, p, 12, eos) for p in prompts]


@pytest.mark.parametrize("num_draft_tokens, per_position", [(11, [1.0, 1.0, 1.0]), (7, [1.0, 1.0, 0.0])])
def test_tree_acceptance_when_the_drafter_agrees(target, num_draft_tokens, per_position):
    """Both models always pick id 0 (lowest id among ties); the drafter's probabilities are uniform. With all
    2 + 4 + 4 candidates the tree holds the path 0, 0, 0; with a budget of 6 only depths 1 and 2 fit (scores
    1/32 and 1/32^2 beat 1/32^3): the accepted length is the path length, not the node count."""
    constant = copy.deepcopy(target)
    constant.model.norm.weight.data.zero_()
    draft = drafter(constant)
    draft.norm.weight.data.zero_()
    settings = SpecSettings(k=3, topk=2, num_draft_tokens=num_draft_tokens)
    [result] = speculative_generate(constant, draft, [[5, 6, 7, 8]], settings, 13, {V - 1})
    assert result.tokens == [0] * 13
    assert result.stats.per_position == per_position and result.stats.tau == 1 + sum(per_position)


@pytest.mark.parametrize("kwargs, key", [
    ({"k": 0}, "k"), ({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"),
    ({"k": 3, "num_draft_tokens": 3}, "num_draft_tokens"),  # a chain verifies k + 1
    ({"k": 2, "topk": 2, "num_draft_tokens": 8}, "num_draft_tokens"),  # only 2 + 4 nodes exist
    ({"topk": 2, "temperature": 1.0, "draft_sample_method": "probabilistic"}, "draft_sample_method"),
    ({"draft_sample_method": "beam"}, "draft_sample_method")])
def test_settings_that_cannot_work_are_refused(kwargs, key):
    with pytest.raises(DecodingError) as err:
        SpecSettings(**kwargs)
    assert err.value.key == key and isinstance(err.value, InputError)


def test_params_name_the_bad_eval_key(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=r"key 'eval.num_draft_tokens': a chain \(topk 1\) verifies k \+ 1 = 4"):
        load_config(params, ["eval.num_draft_tokens=5"])
    with pytest.raises(ConfigError, match=r"key 'eval.batch_size': must be at least 1"):
        load_config(params, ["eval.batch_size=0"])
    # probabilistic drafts in a tree: fine greedy, not at the second measurement's temperature; refused up front
    with pytest.raises(ConfigError, match=r"key 'eval.sampled_temperature': at 1.0: draft_sample_method"):
        load_config(params, ["eval.topk=2", "eval.draft_sample_method=probabilistic"])
    load_config(params, ["eval.topk=2", "eval.draft_sample_method=probabilistic", "eval.sampled_temperature=null"])
    with pytest.raises(ConfigError, match=r"key 'eval.sampled_temperature': must be above 0"):
        load_config(params, ["eval.sampled_temperature=0"])
    cfg = load_config(params, ["eval.topk=2", "eval.num_draft_tokens=6", "eval.temperature=0.7"])
    assert SpecSettings.from_config(cfg.eval) == SpecSettings(k=3, topk=2, num_draft_tokens=6, temperature=0.7)


# --- the eval stage: tau at eval.temperature, then again at eval.sampled_temperature --------------------------


def test_the_sampled_settings_swap_the_temperature_alone():
    tree = SpecSettings(k=4, topk=2, num_draft_tokens=7, top_p=0.9)
    assert sampled_settings(tree, 1.0) == SpecSettings(k=4, topk=2, num_draft_tokens=7, top_p=0.9, temperature=1.0)
    assert sampled_settings(tree, None) is None  # eval.sampled_temperature null: the primary measurement alone
    assert sampled_settings(SpecSettings(temperature=0.7), 0.7) is None  # the primary is at that temperature already
    with pytest.raises(DecodingError, match=r"at 1.0: draft_sample_method: probabilistic drafting is a chain") as err:
        sampled_settings(SpecSettings(topk=2, draft_sample_method="probabilistic"), 1.0)
    assert err.value.key == "sampled_temperature"


def constant_pair(target):
    """A target and a drafter that both always pick id 0 greedily (final norms zeroed: all logits 0); sampled, the
    target's law is uniform over V, so a draft of 0 is accepted 1 time in V."""
    constant = copy.deepcopy(target)
    constant.model.norm.weight.data.zero_()
    draft = drafter(constant, draft_vocab=V)
    draft.norm.weight.data.zero_()
    return constant, draft


def test_the_sampled_pass_decodes_speculatively_alone(target, monkeypatch):
    """reference=False: no target-alone decoding (nothing to check one sampled run against), the same prompts and
    seeds; acceptance at the sampled temperature, far below greedy's for a drafter that only matches the argmax."""
    constant, draft = constant_pair(target)
    prompts = [{"id": f"p{i}", "set": "a" if i < 2 else "b", "messages": [{"ids": ids}]}
               for i, ids in enumerate(prompts_of([4, 7, 5], seed=2))]
    monkeypatch.setattr(evaluation, "prompt_ids", lambda tokenizer, messages: messages[0]["ids"])
    tokenizer = type("Tokenizer", (), {"eos_token_id": V - 1})()
    greedy = SpecSettings(k=3)
    primary = decode_and_compare(constant, draft, tokenizer, prompts, greedy, 16, 2, 7, "test")
    assert primary.overall.tau == 4.0 and not primary.mismatched and primary.plain_tokens == 3 * 16

    def no_reference(*args, **kwargs):
        raise AssertionError("the sampled pass decoded the target alone")

    monkeypatch.setattr(evaluation, "target_generate", no_reference)
    sampled = decode_and_compare(constant, draft, tokenizer, prompts, sampled_settings(greedy, 1.0), 16, 2, 7, "test",
                                 reference=False)
    assert sampled.target_outputs == {} and sampled.mismatched == [] and sampled.plain_tokens == 0
    assert sampled.spec_tokens > 0 and len(sampled.per_prompt) == 3 and set(sampled.per_set) == {"a", "b"}
    assert 1.0 <= sampled.overall.tau < 1.5  # at temperature 0 it would be 4
    again = decode_and_compare(constant, draft, tokenizer, prompts, sampled_settings(greedy, 1.0), 16, 1, 7, "test",
                               reference=False)  # prompt i samples with seed + i, whatever the batch
    assert [s.accepted_at for s in again.per_prompt] == [s.accepted_at for s in sampled.per_prompt]
    block = sampled.decoded(1.0, 7).to_json()
    assert block["temperature"] == 1.0 and "prompts_by_set" not in block
    assert block["tau_ci_low"] <= block["tau"] <= block["tau_ci_high"] and set(block["tau_by_set"]) == {"a", "b"}


def test_a_parting_is_a_near_tie_only_within_the_rounding_of_the_targets_dtype(target):
    """find_parting: the first differing token, the target's logit gap there from one forward over the shared
    prefix, against 2 eps(dtype) max|logit|. The runner-up token of a float32 target is beyond it; the same token
    with its head row copied from the chosen one is an exact tie; bfloat16 allows 2^16 times float32's gap; an
    output that is a prefix of the other is never a near-tie."""
    ids = [5, 9, 17, 3]
    own = target_greedy(target, ids, 4, set())
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids + own[:2]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    parting = find_parting(target, "p0", ids, own, own[:2] + [runner_up, 1])
    assert (parting.prompt, parting.position, parting.target_token, parting.spec_token) == ("p0", 2, own[2], runner_up)
    assert parting.gap == pytest.approx(float(logits[own[2]] - logits[runner_up]), abs=1e-5)
    assert parting.tolerance == pytest.approx(2 * torch.finfo(torch.float32).eps * float(logits.abs().max()), rel=1e-3)
    assert parting.gap > parting.tolerance and not parting.near_tie

    tied = copy.deepcopy(target)
    tied.lm_head.weight.data[runner_up] = tied.lm_head.weight.data[own[2]]
    assert find_parting(tied, "p0", ids, own, own[:2] + [runner_up]).near_tie  # gap 0

    wide = find_parting(copy.deepcopy(target).to(torch.bfloat16), "p0", ids, own, own[:2] + [runner_up])
    assert wide.tolerance / parting.tolerance == pytest.approx(2 ** 16, rel=0.1)

    stopped = find_parting(target, "p0", ids, own, own[:2])
    assert stopped.position == 2 and stopped.gap is None and not stopped.near_tie


def test_eval_counts_a_parting_at_a_tie_as_lossless_and_an_early_stop_as_not(tmp_path, monkeypatch, tiny_target_dir,
                                                                             capsys):
    """The eval stage with the target's own output altered at one prompt: at a token every logit ties (the
    constant target), the prompt parts at a near-tie, and the drafter stays lossless with the count in the metrics,
    the report's table and the log; cut short, it is not lossless."""
    isolate(monkeypatch, tmp_path)
    target_dir, _ = write_constant_models(tiny_target_dir, tmp_path)
    (tmp_path / "data" / "bench").mkdir(parents=True)
    (tmp_path / "data" / "bench" / "chat.jsonl").write_text(
        "".join(json.dumps({"prompt": f"question {i}: the fox writes"}) + "\n" for i in range(3)))
    cfg = Config(target=TargetConfig(path=str(target_dir), lineage_dep=str(target_dir), device="cpu"),
                 eval=EvalConfig(k=3, max_new_tokens=8, engine=None, sets_dir="data/bench", sampled_temperature=None,
                                 batch_size=3,
                                 sets=[PromptSetConfig("chat", "data/bench/chat.jsonl")]))
    cfg.mlflow.registered_model, cfg.mlflow.system_metrics = None, False
    own_outputs = evaluation.target_generate

    def evaluate(alter):
        def altered(*args, **kwargs):
            outputs = own_outputs(*args, **kwargs)
            return [alter(outputs[0]), *outputs[1:]]
        monkeypatch.setattr(evaluation, "target_generate", altered)
        eval_stage.run(cfg, "scratch")
        return json.loads((tmp_path / "metrics" / "eval-scratch.json").read_text())

    metrics = evaluate(lambda tokens: tokens[:3] + [7] + tokens[4:])  # every id ties with id 0 there
    assert (metrics["lossless"], metrics["mismatched_prompts"], metrics["near_tie_prompts"]) == (True, 1, 1)
    assert "parts from the target's own output at token 3: the target's logit gap 0 is within" in capsys.readouterr().out
    assert acceptance_table({"eval-scratch": metrics}).loc[0, "lossless"] == "yes (1 near-tie)"

    metrics = evaluate(lambda tokens: tokens[:3])
    assert (metrics["lossless"], metrics["mismatched_prompts"], metrics["near_tie_prompts"]) == (False, 1, 0)
    assert "one output stops early: NOT lossless" in capsys.readouterr().out
    assert acceptance_table({"eval-scratch": metrics}).loc[0, "lossless"] == "NO (1 prompts)"


ACCEPTANCE = {"tau": 2.0, "accept_1": 0.5, "verify_steps": 8, "accepted_tokens": 8, "tau_by_set": {"chat": 2.0}}


def eval_metrics(vllm: dict | None = None) -> dict:
    """metrics/eval-<drafter>.json of 4 prompts at tau 2; with a vllm block where `vllm` says how it differs from
    one served on cpu-2c by an engine found running."""
    measured = {**ACCEPTANCE, "temperature": 0.0, "emitted_tokens": 16, "spec_tokens_per_s": 1.0, "prompts": 4,
                "prompts_by_set": {"chat": 4}, "time": {"stage_s": 9.0}}
    if vllm is None:
        return measured
    served = {"version": "0.32.0", "tokens_per_s": 300.0, "concurrency": 8, "hardware": "cpu-2c", "engine_starts": 0,
              "engine_start_s": 0.0}
    return {**measured, "vllm": {**ACCEPTANCE, **served, **vllm}}


def test_the_report_counts_the_engines_behind_its_results():
    """The stages that started a vLLM engine, with the time the starts took, and those that found one running;
    the pipeline run's metric is their sum. A pipeline without vLLM says nothing of engines."""
    from eagle3ops.reporting.summary import engine_starts_line, pipeline_metrics

    measured = eval_metrics()
    evals = {drafter: eval_metrics({"engine_starts": n, "engine_start_s": s})
             for drafter, n, s in (("baseline", 1, 31.25), ("scratch", 0, 0.0), ("warm_start", 1, 30.0))}
    metrics = ({f"eval-{drafter}": m for drafter, m in evals.items()}
               | {"target_speed": {"measured": True, "engine_starts": 1, "engine_start_s": 30.0,
                                  "time": {"stage_s": 40.0}},
                  "export": {"engine_started": 0, "time": {"stage_s": 3.0}}})
    assert engine_starts_line(metrics) == (
        "vLLM engines started for these results: 3 (by target_speed 1 in 30.0 s, eval@baseline 1 in 31.2 s, "
        "eval@warm_start 1 in 30.0 s); found running (engine sessions): eval@scratch, export.")
    assert pipeline_metrics(metrics)["vllm/engine_starts"] == 3
    alone = {f"eval-{drafter}": measured for drafter in evals} | {"target_speed": {"measured": False,
                                                                                  "time": {"stage_s": 1.0}}}
    assert engine_starts_line(alone) is None and "vllm/engine_starts" not in pipeline_metrics(alone)


def test_a_speedup_divides_only_speeds_of_the_same_hardware():
    """The target alone (stage target_speed) measured on other hardware than a drafter's eval gives that drafter
    no speed-up, and the report says why and what to run."""
    from eagle3ops.reporting.summary import markdown, served_speedups

    local = eval_metrics({"hardware": "cpu-2c"})
    metrics = {"eval-scratch": local, "eval-warm_start": eval_metrics({"hardware": "H200"}),
               "target_speed": {"measured": True, "tokens_per_s": 200.0, "vllm": {"hardware": "cpu-2c"},
                                "time": {"stage_s": 40.0}}}
    assert served_speedups(metrics) == {"scratch": 1.5}
    report = markdown(metrics, "sqlite:///mlflow.db")
    assert ("No speed-up where the drafter was served on H200: the target alone was measured on cpu-2c (set "
            "hardware.label to the same label, or `dvc repro -f -s target_speed` here).") in report
    assert "No speed-up" not in markdown({**metrics, "eval-warm_start": local}, "sqlite:///mlflow.db")


def write_constant_models(tiny_target_dir: Path, root: Path) -> tuple[Path, Path]:
    """The tiny target with its final norm zeroed (greedy: always id 0; sampled: uniform) and a drafter that always
    drafts id 0, saved where the eval stage reads them; (target dir, drafter dir)."""
    model = LlamaForCausalLM.from_pretrained(tiny_target_dir)
    model.model.norm.weight.data.zero_()
    model.save_pretrained(root / "target")
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(root / "target")
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1,
                      vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=hidden, aux_layers=[1, 2, 3])
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.t2d[:] = True  # the whole vocabulary, d2t all 0
    draft.norm.weight.data.zero_()
    save_drafter(draft, root / "models" / "drafters" / "scratch")
    return root / "target", root / "models" / "drafters" / "scratch"


def test_eval_stage_measures_tau_at_both_temperatures(tmp_path, monkeypatch, tiny_target_dir):
    """The metrics file, the MLflow run and the phases: tau at eval.temperature (greedy: every draft accepted,
    lossless) and, in the `sampled` block, at eval.sampled_temperature 1 (the target's law uniform: almost none);
    with sampled_temperature null, no block and no second decoding."""
    store = isolate(monkeypatch, tmp_path)
    target_dir, _ = write_constant_models(tiny_target_dir, tmp_path)
    (tmp_path / "data" / "bench").mkdir(parents=True)
    for name, count in (("chat", 3), ("code", 2)):
        (tmp_path / "data" / "bench" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{name} question {i}: the fox writes"}) + "\n" for i in range(count)))

    def evaluate(sampled_temperature):
        cfg = Config(target=TargetConfig(path=str(target_dir), lineage_dep=str(target_dir), device="cpu"),
                     eval=EvalConfig(k=3, max_new_tokens=12, engine=None, sets_dir="data/bench",
                                     sets=[PromptSetConfig(n, f"data/bench/{n}.jsonl") for n in ("chat", "code")],
                                     sampled_temperature=sampled_temperature))
        cfg.mlflow.registered_model, cfg.mlflow.system_metrics = None, False
        eval_stage.run(cfg, "scratch")
        return json.loads((tmp_path / "metrics" / "eval-scratch.json").read_text())

    metrics = evaluate(1.0)
    assert metrics["temperature"] == 0.0 and metrics["tau"] == 4.0 and metrics["lossless"] is True
    sampled = metrics["sampled"]
    assert sampled["temperature"] == 1.0
    assert 1.0 <= sampled["tau"] <= 1.0 + 3 and sampled["tau"] < 1.5  # at temperature 0 it would be 4, as above
    assert sampled["tau_ci_low"] <= sampled["tau"] <= sampled["tau_ci_high"]
    assert set(sampled["tau_by_set"]) == {"chat", "code"} and "prompts_by_set" not in sampled
    assert sampled["verify_steps"] > metrics["verify_steps"] and sampled["emitted_tokens"] > 0
    assert metrics["time"]["decode_sampled_s"] > 0 and "lossless" not in sampled
    client = MlflowClient(store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               "tags.`eagle3ops.stage` = 'eval'")
    logged = run.data.metrics
    assert logged["tau"] == 4.0 and logged["sampled/tau"] == sampled["tau"] and "time/decode_sampled_s" in logged
    assert logged["sampled/temperature"] == 1.0 and logged["sampled/tau/code"] == sampled["tau_by_set"]["code"]
    assert logged["sampled/tau_ci_low"] == sampled["tau_ci_low"]

    metrics = evaluate(None)
    assert "sampled" not in metrics and "decode_sampled_s" not in metrics["time"] and metrics["tau"] == 4.0


RECORDED_EVALS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").rglob("eval-*.json"))


@pytest.mark.parametrize("path", RECORDED_EVALS, ids=[f"{p.parent.parent.name}-{p.stem}" for p in RECORDED_EVALS])
def test_recorded_eval_results_read_back_as_they_were_written(path):
    """Every committed metrics/eval-*.json (CPU, H200 and H100 runs of several versions) as EvalResult, written back:
    the same file apart from the stage's phases ("time", tracking/metrics.py) and the figures older versions did not
    record."""
    from eagle3ops.decoding.results import EvalResult

    recorded = json.loads(path.read_text())
    written = EvalResult.read(recorded, str(path)).to_json()
    older = {"temperature", "near_tie_prompts"} - recorded.keys()  # read with their defaults
    assert {k: v for k, v in written.items() if k not in older} == {k: v for k, v in recorded.items() if k != "time"}


def test_an_eval_results_file_that_is_not_one_is_named():
    from eagle3ops.decoding.results import EvalResult
    from eagle3ops.errors import InputError

    with pytest.raises(InputError, match=r"metrics/eval-scratch.json: not an eval's results .*KeyError: 'verify_steps'"):
        EvalResult.read({"tau": 2.0, "accept_1": 0.5, "prompts_by_set": {"a": 1}}, "metrics/eval-scratch.json")
