"""Conversation datasets, safetensors shards with their manifest, and the tokenize/split step of `prepare`."""
from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import pytest
import torch

from eagle3ops.data.chat import tokenize_conversation
from eagle3ops.data.conversations import DatasetError, content_id, load_conversations
from eagle3ops.data.prepare import (
    DROPPED_IDS_LISTED,
    TokenizeStats,
    in_eval_split,
    read_tokenized,
    split,
    tokenize_dataset,
    write_tokenized,
)
from eagle3ops.data.shards import MANIFEST, ShardWriter, iter_samples, read_manifest
from eagle3ops.errors import InputError


def write_lines(path: Path, lines: list[str | dict]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def openai(record_id: str, *turns: tuple[str, str]) -> dict:
    return {"id": record_id, "messages": [{"role": r, "content": c} for r, c in turns]}


# --------------------------------------------------------------------------------------------------- conversations

def test_sharegpt_and_openai_normalise_to_same_messages(tmp_path):
    sharegpt = {"id": "c1", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello."},
        {"from": "user", "value": "Bye"},
        {"from": "assistant", "value": "Bye."},
    ]}
    oai = openai("c1", ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"),
                 ("assistant", "Bye."))
    a = load_conversations(write_lines(tmp_path / "sharegpt.jsonl", [sharegpt]))
    b = load_conversations(write_lines(tmp_path / "openai.jsonl", [oai]))
    assert a == b == [{"id": "c1", "messages": oai["messages"]}]


def test_ids_are_strings_and_blank_lines_skipped(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [
        {"id": 7, "messages": [{"role": "user", "content": "x"}]},
        "",
        "   ",
        {"messages": [{"role": "user", "content": "y"}]},
        {"messages": [{"role": "user", "content": "y"}]},
    ])
    records = load_conversations(path)
    # No id: a hash of the conversation stands in (wherever the file lives); repeats are numbered.
    unnamed = content_id([{"role": "user", "content": "y"}])
    assert [r["id"] for r in records] == ["7", unnamed, f"{unnamed}-2"]


def test_malformed_json_names_file_and_exact_line(tmp_path):
    good = openai("a", ("user", "u"), ("assistant", "a"))
    path = write_lines(tmp_path / "bad.jsonl", [good, "", '{"id": "b", "messages": [', openai("c", ("user", "u"))])
    with pytest.raises(DatasetError) as err:
        load_conversations(path)
    assert f"{path}:3:" in str(err.value)
    assert "not valid JSON" in str(err.value)


@pytest.mark.parametrize("record, message", [
    ({"id": "x", "messages": [{"role": "user"}]}, "turn 0 needs 'role' and 'content'"),
    ({"id": "x", "messages": [{"role": "user", "content": "u"}, {"content": "a"}]}, "turn 1 needs 'role' and 'content'"),
    ({"id": "x", "conversations": [{"from": "human"}]}, "turn 0 needs 'from' and 'value'"),
    ({"id": "x", "conversations": [{"from": "bot", "value": "hi"}]},
     "turn 0 has unknown role 'bot' (known roles: system, human, user, gpt, assistant)"),
    ({"id": "x", "messages": [{"role": "tool", "content": "hi"}]}, "turn 0 has role 'tool', a tool's turn"),
    ({"id": "x", "conversations": [{"from": "observation", "value": "hi"}]}, "turn 0 has role 'observation'"),
    ({"id": "x", "messages": [{"role": ["user"], "content": "hi"}]}, "turn 0 has unknown role ['user']"),
    ({"id": "x", "messages": "hello"}, "empty or not a list"),
    ({"id": "x", "messages": []}, "empty or not a list"),
    ({"id": "x", "messages": [{"role": "user", "content": None}]},
     'turn 0 content is null: expected a string or a list of text parts ([{"type": "text", "text": "..."}, ...])'),
    ({"id": "x", "messages": [{"role": "user", "content": 7}]}, "turn 0 content is a int: expected a string"),
    ({"id": "x", "messages": [{"role": "assistant", "tool_calls": [{"id": "call_1"}]}]},
     "turn 0 (assistant) has 'tool_calls': tool calls are not supported"),
    ({"id": "x", "messages": [{"role": "assistant", "content": "Let me look.", "function_call": {"name": "f"}}]},
     "turn 0 (assistant) has 'function_call': tool calls are not supported"),
    ({"id": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                           {"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     "turn 0 content part 1 has type 'image_url': only text parts are supported"),
    ({"id": "x", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "drop the input_audio parts, or the conversations that need them, first"),
    ({"id": "x", "messages": [{"role": "user", "content": ["hi"]}]}, "turn 0 content part 0 is not a text part"),
    ({"id": "x", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "turn 0 content part 0 is not a text part"),
    ({"id": "x", "text": "hello"}, "needs 'messages'"),
    ([1, 2], "expected a JSON object, got list"),
])
def test_bad_record_names_file_and_line(tmp_path, record, message):
    path = write_lines(tmp_path / "d.jsonl", [openai("ok", ("user", "u"), ("assistant", "a")), record])
    with pytest.raises(DatasetError) as err:
        load_conversations(path)
    assert str(err.value).startswith(f"{path}:2: ")
    assert message in str(err.value)


def test_openai_text_parts_read_as_the_plain_string(tmp_path, tiny_tokenizer):
    """Content as OpenAI's list of text parts, as users' datasets often have it: the same messages, ids and tokens
    as the plain string; several parts joined by a newline, as vLLM renders them for the target."""
    plain = openai("p", ("system", "Be brief."), ("user", "Hi, what is the fox?"), ("assistant", "A quick animal."))
    parts = {"id": "p", "messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                                     for m in plain["messages"]]}
    read_plain = load_conversations(write_lines(tmp_path / "plain.jsonl", [plain]))
    read_parts = load_conversations(write_lines(tmp_path / "parts.jsonl", [parts]))
    assert read_parts == read_plain
    tokens = tokenize_conversation(tiny_tokenizer, read_parts[0]["messages"], 64)
    assert tokens == tokenize_conversation(tiny_tokenizer, plain["messages"], 64) and sum(tokens.loss_mask) > 0
    unnamed = [{k: v for k, v in record.items() if k != "id"} for record in (plain, parts)]  # content_id alike
    assert load_conversations(write_lines(tmp_path / "a.jsonl", unnamed[:1])) == \
        load_conversations(write_lines(tmp_path / "b.jsonl", unnamed[1:]))
    two = {"id": "q", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                 {"type": "text", "text": "there"}]}]}
    assert load_conversations(write_lines(tmp_path / "two.jsonl", [two]))[0]["messages"][0]["content"] == "Hi\nthere"


def test_tool_calls_are_refused_with_what_to_do(tmp_path):
    """An assistant turn that calls a tool (content null), and the tool's answer: one line naming the file, line and
    turn, what is supported and what to do."""
    tools = {"id": "t", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]}
    path = write_lines(tmp_path / "d.jsonl", [openai("ok", ("user", "u"), ("assistant", "a")), tools])
    with pytest.raises(DatasetError) as err:
        load_conversations(path)
    assert str(err.value) == (
        f"{path}:2: turn 1 (assistant) has 'tool_calls': tool calls are not supported (supported: system, user and "
        f"assistant turns whose content is a string or a list of text parts); drop the conversations (or turns) that "
        f"use tools, or write the calls and their results into the turns' text first, as your target's chat template "
        f"renders them")
    del tools["messages"][1]  # the tool's result alone
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:2: turn 1 has role 'tool', a tool's turn: tools "
                                           rf"are not supported \(supported: .*\); drop the conversations"):
        load_conversations(write_lines(path, [openai("ok", ("user", "u"), ("assistant", "a")), tools]))


def test_duplicate_id_names_both_lines(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [
        openai("a", ("user", "u")), openai("dup", ("user", "u")), openai("b", ("user", "u")), openai("dup", ("user", "v")),
    ])
    with pytest.raises(DatasetError) as err:
        load_conversations(path)
    assert str(err.value) == f"{path}:4: duplicate id 'dup' (first on line 2)"


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match="no records") as err:
        load_conversations(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match="file not found") as err:
        load_conversations(path)
    assert str(path) in str(err.value)
    assert issubclass(DatasetError, InputError)


# ---------------------------------------------------------------------------------------------------------- shards

LENGTHS = [3, 1, 4, 2, 5]


def ragged_samples() -> list[tuple[str, dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (f"s{i}", {"input_ids": torch.arange(100 * i, 100 * i + n, dtype=torch.int32),
                   "hidden": torch.randn(n, 3, generator=generator),
                   "loss_mask": (torch.arange(n) % 2).to(torch.uint8)})
        for i, n in enumerate(LENGTHS)
    ]


def write_shards(out_dir: Path, background: bool = False) -> dict:
    writer = ShardWriter(out_dir, samples_per_shard=2, meta={"split": "train"}, background=background)
    for sample_id, tensors in ragged_samples():
        writer.add(sample_id, tensors)
    return writer.close()


def test_background_writer_writes_the_same_files(tmp_path):
    """Extraction writes each shard in a thread while the next fills: the files must be those of a plain writer."""
    plain, background = write_shards(tmp_path / "plain"), write_shards(tmp_path / "background", background=True)
    assert plain == background
    for shard in plain["shards"]:
        assert (tmp_path / "plain" / shard["file"]).read_bytes() == (tmp_path / "background" / shard["file"]).read_bytes()


def test_background_write_error_reaches_the_caller(tmp_path):
    """A shard that fails in the writing thread fails the caller (at the next add or close), not silently."""
    out = tmp_path / "train"
    writer = ShardWriter(out, samples_per_shard=1, background=True)
    writer.add("s0", {"hidden": torch.zeros(2, 2, dtype=torch.complex64)})  # no safetensors dtype for it
    with pytest.raises(KeyError):
        writer.close()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_shard_round_trip_and_manifest(tmp_path):
    out = tmp_path / "features" / "train"
    manifest = write_shards(out)
    assert manifest == read_manifest(out)
    assert manifest["split"] == "train"
    assert manifest["samples"] == 5 and manifest["tokens"] == sum(LENGTHS)
    assert [s["file"] for s in manifest["shards"]] == [f"shard-{i:05d}.safetensors" for i in range(3)]
    assert [s["samples"] for s in manifest["shards"]] == [2, 2, 1]
    assert [s["tokens"] for s in manifest["shards"]] == [3 + 1, 4 + 2, 5]
    for shard in manifest["shards"]:
        assert shard["sha256"] == hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest()
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *(s["file"] for s in manifest["shards"])])

    got = list(iter_samples(out))
    want = ragged_samples()
    assert [sample_id for sample_id, _ in got] == [sample_id for sample_id, _ in want]
    for (_, tensors), (_, expected) in zip(got, want):
        assert set(tensors) == set(expected)  # `offsets` is internal
        for name, tensor in expected.items():
            assert tensors[name].dtype == tensor.dtype
            assert torch.equal(tensors[name], tensor), name
    # Nothing half-written left beside the output.
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".partial")]


def test_resumed_writer_counts_skipped_inputs(tmp_path):
    """An input skipped before a complete shard (NaN states) is not done again by a resumed run."""
    out = tmp_path / "features"
    samples = ragged_samples()
    writer = ShardWriter(out, samples_per_shard=2, resumable=True)
    writer.add(*samples[0])
    writer.skip(samples[1][0])
    writer.add(*samples[2])  # completes the first shard: 3 inputs behind it
    writer.add(*samples[3])  # pending, lost with the "crash"
    resumed = ShardWriter(out, samples_per_shard=2, resumable=True)
    assert resumed.samples_done == 3 and resumed.skipped_ids == ["s1"]
    resumed.add(*samples[3])
    resumed.add(*samples[4])
    manifest = resumed.close()
    assert manifest["samples"] == 4 and manifest["shards"][0]["skipped"] == ["s1"]
    assert [sample_id for sample_id, _ in iter_samples(out)] == ["s0", "s2", "s3", "s4"]


def test_corrupted_shard_is_detected(tmp_path):
    out = tmp_path / "train"
    write_shards(out)
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a byte of tensor data, not the header: the file still parses
    shard.write_bytes(bytes(data))
    samples = iter_samples(out)
    assert [next(samples)[0], next(samples)[0]] == ["s0", "s1"]  # shard 0 is intact
    with pytest.raises(InputError, match="sha256") as err:
        next(samples)
    assert "shard-00001.safetensors" in str(err.value)
    # Without verification the (silently wrong) data is read: the check is what catches it.
    assert len(list(iter_samples(out, verify=False))) == 5


def test_aborted_writer_leaves_nothing(tmp_path):
    out = tmp_path / "train"
    writer = ShardWriter(out, samples_per_shard=2)
    for sample_id, tensors in ragged_samples()[:3]:  # one shard flushed, one sample pending
        writer.add(sample_id, tensors)
    writer.abort()
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_close_replaces_previous_output(tmp_path):
    out = tmp_path / "train"
    out.mkdir()
    (out / "stale.safetensors").write_text("old")
    write_shards(out)
    assert not (out / "stale.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["train"]


def test_not_a_shard_directory(tmp_path):
    with pytest.raises(InputError, match="no manifest"):
        list(iter_samples(tmp_path))


# --------------------------------------------------------------------------------------------- tokenize and split

def test_tokenize_dataset_counts_truncation_and_drops(tiny_tokenizer):
    short = openai("short", ("user", "Hi"), ("assistant", "Hello."))
    long_answer = openai("long_answer", ("user", "Hi"), ("assistant", "The fox jumps over the lazy dog. " * 20))
    long_prompt = openai("long_prompt", ("user", "The fox jumps over the lazy dog. " * 20), ("assistant", "Ok."))
    max_len = 40
    samples, stats = tokenize_dataset(tiny_tokenizer, [short, long_answer, long_prompt], max_len, "src.jsonl")
    assert [s["id"] for s in samples] == ["short", "long_answer"]
    assert stats.conversations == 3 and stats.kept == 2
    assert stats.truncated == 2  # long_answer kept but cut; long_prompt cut and dropped
    assert stats.dropped_no_assistant == 1 and stats.dropped_ids == ["long_prompt"]
    assert len(samples[1]["input_ids"]) == max_len == len(samples[1]["loss_mask"])
    assert stats.tokens == sum(len(s["input_ids"]) for s in samples)
    assert stats.loss_tokens == sum(sum(s["loss_mask"]) for s in samples)
    # The short sample's loss tokens: "Hello." and <|im_end|>.
    masked = [i for i, m in zip(samples[0]["input_ids"], samples[0]["loss_mask"]) if m]
    assert tiny_tokenizer.decode(masked) == "Hello.<|im_end|>"


def test_the_metrics_name_the_dropped_samples_up_to_a_cap():
    few = TokenizeStats(conversations=10, dropped_no_assistant=2, dropped_ids=["a", "b"])
    assert few.metrics()["dropped_ids"] == ["a", "b"] and few.metrics()["dropped_no_assistant"] == 2
    assert few.dropped_line("metrics/prepare.json") == ("2 of 10 conversations dropped, no assistant token within "
                                                        "data.max_len: a, b (all in metrics/prepare.json, dropped_ids)")
    ids = [f"c{i}" for i in range(DROPPED_IDS_LISTED + 5)]
    many = TokenizeStats(conversations=2000, dropped_no_assistant=len(ids), dropped_ids=ids)
    assert many.metrics()["dropped_ids"] == ids[:DROPPED_IDS_LISTED] and many.metrics()["dropped_no_assistant"] == 1005
    assert many.dropped_line("m.json") == (f"1005 of 2000 conversations dropped, no assistant token within data.max_len: "
                                           f"c0, c1, c2, c3, c4, ... (the first {DROPPED_IDS_LISTED} in m.json, dropped_ids)")
    assert TokenizeStats(conversations=3).dropped_line("m.json") is None


def test_the_prepare_stage_names_what_it_dropped(tmp_path, monkeypatch, capsys, tiny_target_dir):
    """A conversation whose only assistant turn lies past data.max_len: counted, printed with its id, and its id in
    the stage's metrics file."""
    from eagle3ops.cli import main
    from helpers import isolate

    isolate(monkeypatch, tmp_path)
    long_prompt = "The fox jumps over the lazy dog. " * 20
    records = [openai(f"c{i}", ("user", f"Hi {i}"), ("assistant", f"Hello {i}.")) for i in range(6)]
    records += [openai(f"long{i}", ("user", long_prompt), ("assistant", "Ok.")) for i in range(2)]
    (tmp_path / "data" / "generated").mkdir(parents=True)
    write_lines(tmp_path / "data" / "generated" / "conversations.jsonl", records)
    target = {"path": str(tiny_target_dir), "lineage_dep": str(tiny_target_dir / "config.json")}
    (tmp_path / "params.yaml").write_text(json.dumps({"target": target,
                                                      "data": {"max_len": 40, "draft_vocab_size": 32},
                                                      "mlflow": {"system_metrics": False}}))
    assert main(["prepare"]) == 0
    metrics_file = Path("metrics/prepare.json")
    assert ("prepare: 2 of 8 conversations dropped, no assistant token within data.max_len: long0, long1 "
            f"(all in {metrics_file}, dropped_ids)\n") in capsys.readouterr().out
    metrics = json.loads((tmp_path / metrics_file).read_text())
    assert metrics["dropped_ids"] == ["long0", "long1"] and metrics["dropped_no_assistant"] == 2
    assert metrics["kept"] == 6


def test_tokenize_dataset_all_dropped(tiny_tokenizer):
    long_prompt = openai("p", ("user", "The fox jumps over the lazy dog. " * 20), ("assistant", "Ok."))
    no_assistant = openai("q", ("user", "Hi"))
    with pytest.raises(DatasetError) as err:
        tokenize_dataset(tiny_tokenizer, [long_prompt, no_assistant], 16, "data/src.jsonl")
    assert "max_len=16" in str(err.value)
    assert str(err.value).startswith("data/src.jsonl:")
    assert "2 conversations" in str(err.value)


def test_tokenized_round_trip(tmp_path, tiny_tokenizer):
    conversations = [openai(f"c{i}", ("user", f"Question {i}?"), ("assistant", f"Answer {i}.")) for i in range(3)]
    samples, _ = tokenize_dataset(tiny_tokenizer, conversations, 64, "x")
    manifest = write_tokenized(samples, tmp_path / "train", {"split": "train"})
    assert manifest["samples"] == 3
    assert read_tokenized(tmp_path / "train") == samples


def test_split_is_stable_and_matches_fraction():
    samples = [{"id": f"conv-{i:05d}", "input_ids": [i]} for i in range(2000)]
    train, held_out = split(samples, 0.05)
    assert len(train) + len(held_out) == 2000
    assert {s["id"] for s in train}.isdisjoint(s["id"] for s in held_out)
    assert 60 <= len(held_out) <= 140  # 100 expected; binomial sd ~10
    shuffled = samples[:]
    random.Random(3).shuffle(shuffled)
    train2, held_out2 = split(shuffled, 0.05)
    assert {s["id"] for s in held_out2} == {s["id"] for s in held_out}
    assert {s["id"] for s in train2} == {s["id"] for s in train}
    # A subset keeps its members' assignment (the decision depends on the id alone).
    sub_train, sub_held = split(samples[:1000], 0.05)
    assert {s["id"] for s in sub_held} == {s["id"] for s in held_out if int(s["id"][5:]) < 1000}
    assert all(in_eval_split(s["id"], 0.05) for s in held_out)
    # No eval split asked for: everything trains.
    assert split(samples, 0.0) == (samples, [])


def test_split_keeps_one_held_out_sample_for_tiny_datasets():
    ids = [i for i in (f"t{n}" for n in range(50)) if not in_eval_split(i, 0.05)][:3]
    train, held_out = split([{"id": i} for i in ids], 0.05)
    assert len(train) == 2 and len(held_out) == 1


def test_tiny_dataset_fallback_is_order_independent():
    ids = [i for i in (f"t{n}" for n in range(50)) if not in_eval_split(i, 0.05)][:3]
    _, held_a = split([{"id": i} for i in ids], 0.05)
    _, held_b = split([{"id": i} for i in reversed(ids)], 0.05)
    assert held_a == held_b


def test_streamed_safetensors_file_reads_back_with_safetensors(tmp_path):
    from safetensors.torch import load_file

    from eagle3ops.data.shards import write_safetensors

    parts = {"h": [torch.randn(3, 4).to(torch.bfloat16), torch.zeros(0, 4, dtype=torch.bfloat16),
                   torch.randn(2, 4).to(torch.bfloat16)],
             "mask": [torch.tensor([True, False]), torch.tensor([True])],
             "ids": [torch.arange(5, dtype=torch.int32)[::2]]}  # a strided part is written as its values
    digest = write_safetensors(tmp_path / "x.safetensors", parts, {"note": "n"})
    assert digest == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    loaded = load_file(str(tmp_path / "x.safetensors"))
    for name, pieces in parts.items():
        assert torch.equal(loaded[name], torch.cat(pieces)), name
        assert loaded[name].dtype == pieces[0].dtype
