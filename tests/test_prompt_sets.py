"""Benchmark prompt sets: the public files in their usual forms (JSONL and Parquet), format detection, bad input
named by file and line, the set settings in params, and the per-set report."""
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from eagle3ops.config import Config, ConfigError, PromptSetConfig, PromptSetFormat, load_config
from eagle3ops.data.conversations import DatasetError
from eagle3ops.data.prompt_sets import PARSERS, load_set, load_sets
from eagle3ops.reporting.summary import headline, markdown, pipeline_metrics, plot, plot_tau_by_set, tau_by_set_table
from eagle3ops.zoo.corpus import FAMILIES

ROOT = Path(__file__).resolve().parents[1]

MT_BENCH = [
    {"question_id": 81, "category": "writing",
     "turns": ["Compose an engaging travel blog post about a recent trip to Hawaii.",
               "Rewrite your previous response. Start every sentence with the letter A."]},
    {"question_id": 82, "category": "writing", "turns": ["Draft a professional email seeking feedback.", "Take a moment."]},
]
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April. How many clips did she sell?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. How much did she earn?", "answer": "#### 10"},
]
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": "from typing import List\n\n\ndef has_close_elements(numbers: List[float]) -> bool:\n"
     "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other. \"\"\"\n",
     "canonical_solution": "    return False\n", "test": "def check(candidate):\n    pass\n",
     "entry_point": "has_close_elements"},
]
MATH500 = [
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
     "solution": "We have that $r = 3$ ... $\\boxed{(3,\\frac{\\pi}{2})}.$", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
     "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"},
    {"problem": "What is $1+1$?", "solution": "$\\boxed{2}$", "answer": "2", "subject": "Algebra", "level": 1,
     "unique_id": "test/algebra/1.json"},
]


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path: Path, records: list[dict]) -> str:
    pd.DataFrame(records).to_parquet(path)
    return str(path)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("write", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_public_benchmark_files_become_prompts(tmp_path, write):
    suffix = ".jsonl" if write is write_jsonl else ".parquet"
    sets = [PromptSetConfig(name=name, path=write(tmp_path / f"{name}{suffix}", records))
            for name, records in (("mt-bench", MT_BENCH), ("gsm8k", GSM8K), ("humaneval", HUMANEVAL),
                                  ("math500", MATH500))]
    loaded = load_sets(sets)
    assert list(loaded) == ["mt-bench", "gsm8k", "humaneval", "math500"]
    # MT-Bench: the first turn only (the second asks about the model's own first answer)
    assert [p["messages"] for p in loaded["mt-bench"]] == [user(MT_BENCH[0]["turns"][0]), user(MT_BENCH[1]["turns"][0])]
    assert [p["id"] for p in loaded["mt-bench"]] == ["mt-bench/81", "mt-bench/82"]
    # GSM8K: the question alone, zero-shot; no id in the file, so the line (row) number
    assert [p["messages"] for p in loaded["gsm8k"]] == [user(GSM8K[0]["question"]), user(GSM8K[1]["question"])]
    assert [p["id"] for p in loaded["gsm8k"]] == ["gsm8k/1", "gsm8k/2"]
    # HumanEval: the code to complete, verbatim, as the user turn
    assert loaded["humaneval"] == [{"id": "humaneval/HumanEval/0", "set": "humaneval",
                                    "messages": user(HUMANEVAL[0]["prompt"])}]
    assert [p["messages"] for p in loaded["math500"]] == [user(MATH500[0]["problem"]), user(MATH500[1]["problem"])]
    assert loaded["math500"][0]["id"] == "math500/test/precalculus/807.json"
    assert {p["set"] for p in loaded["math500"]} == {"math500"}


def test_conversations_and_plain_prompts(tmp_path):
    chats = write_jsonl(tmp_path / "chats.jsonl", [
        {"id": "c1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": "4"}]},
        {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Red."}]},
    ])
    prompts = load_set(PromptSetConfig(name="chat", path=chats))
    # the reference answer at the end is dropped: the model writes its own reply to the last user turn
    assert prompts[0] == {"id": "chat/c1", "set": "chat", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]}
    assert prompts[1] == {"id": "chat/2", "set": "chat", "messages": user("Name a colour.")}
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "Write a haiku."}, {"id": "x", "prompt": "And another."}])
    assert [(p["id"], p["messages"]) for p in load_set(PromptSetConfig(name="p", path=plain))] == [
        ("p/1", user("Write a haiku.")), ("p/x", user("And another."))]


def test_format_given_overrides_detection(tmp_path):
    # a file with both a question and a prompt field: detection says gsm8k, the set says prompt
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"question": "Q?", "prompt": "P!"}])
    assert load_set(PromptSetConfig(name="a", path=path))[0]["messages"] == user("Q?")
    assert load_set(PromptSetConfig(name="a", path=path, format="prompt"))[0]["messages"] == user("P!")


def test_limits_take_the_first_prompts(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K * 3)
    sets = [PromptSetConfig(name="own", path=path, limit=2), PromptSetConfig(name="capped", path=path)]
    loaded = load_sets(sets, max_prompts=5)
    assert [p["id"] for p in loaded["own"]] == ["own/1", "own/2"]  # the set's limit wins over max_prompts
    assert [p["id"] for p in loaded["capped"]] == [f"capped/{i}" for i in range(1, 6)]
    assert len(load_sets(sets[1:])["capped"]) == 6


@pytest.mark.parametrize("lines, fmt, message", [
    (['{"question": "ok", "answer": "1"}', "{not json"], None, r"g\.jsonl:2: not valid JSON"),
    (['{"turns": ["a"]}', "", '{"question_id": 2, "turns": []}'], None,
     r"g\.jsonl:3: an mtbench record needs 'turns'"),
    (['{"question": "ok", "answer": "1"}', '{"question": 7, "answer": "1"}'], None,
     r"g\.jsonl:2: a gsm8k record needs 'question' as a non-empty string"),
    (['{"title": "x", "body": "y"}'], None, r"g\.jsonl:1: cannot tell the format from the fields \['body', 'title'\]"),
    (['{"task_id": "HumanEval/1"}'], "humaneval", r"g\.jsonl:1: a humaneval record needs 'prompt'"),
    (['{"messages": [{"role": "user", "content": "a"}]}', '{"messages": [{"role": "assistant", "content": "b"}]}'],
     None, r"g\.jsonl:2: the conversation has no user turn"),
    (['{"messages": [{"role": "robot", "content": "a"}]}'], None, r"g\.jsonl:1: turn 0 has unknown role 'robot'"),
    ([""], None, r"g\.jsonl: no prompts \(set 'g'\)"),
])
def test_bad_input_names_file_and_line(tmp_path, lines, fmt, message):
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=message):
        load_set(PromptSetConfig(name="g", path=str(path), format=fmt))


def test_bad_parquet_names_file_and_row(tmp_path):
    path = write_parquet(tmp_path / "m.parquet", [MATH500[0], {**MATH500[1], "problem": ""}])
    with pytest.raises(DatasetError, match=r"m\.parquet: row 2: a math500 record needs 'problem'"):
        load_set(PromptSetConfig(name="m", path=path))
    broken = tmp_path / "broken.parquet"
    broken.write_text('{"problem": "this is JSON, not Parquet"}\n')
    with pytest.raises(DatasetError, match=r"broken\.parquet: not a readable Parquet file"):
        load_set(PromptSetConfig(name="b", path=str(broken)))
    with pytest.raises(DatasetError, match=r"absent\.parquet: file not found"):
        load_set(PromptSetConfig(name="b", path=str(tmp_path / "absent.parquet")))


def test_formats_known_to_config_are_the_parsers():
    assert tuple(PARSERS) == tuple(PromptSetFormat)


def test_default_sets_are_the_zoo_families():
    cfg = Config()
    assert [s.name for s in cfg.eval.sets] == list(FAMILIES)
    assert all(Path(s.path).parent == Path(cfg.eval.sets_dir) == Path(cfg.zoo.data_dir) / "bench" for s in cfg.eval.sets)
    params = load_config(ROOT / "params.yaml")
    assert params.eval.sets == cfg.eval.sets and params.eval.sets_dir == cfg.eval.sets_dir


def params_with(tmp_path: Path, **eval_keys) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["eval"].update(eval_keys)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


@pytest.mark.parametrize("eval_keys, message", [
    ({"sets": [{"name": "mt", "path": "data/bench/question.jsonl"}]},
     r"key 'eval.sets\[0\].path': 'data/bench/question.jsonl' is not inside eval.sets_dir"),
    ({"sets": [{"name": "a", "path": "data/zoo/bench/a.jsonl"}, {"name": "a", "path": "data/zoo/bench/b.jsonl"}]},
     r"key 'eval.sets\[1\].name': 'a': every set needs a name of its own"),
    ({"sets": [{"name": "a", "path": "data/zoo/bench/a.jsonl", "format": "alpaca"}]},
     r"key 'eval.sets\[0\].format': 'alpaca' is not one of \['chat', 'prompt'"),
    ({"sets": [{"name": "a", "path": "data/zoo/bench/a.jsonl", "limit": 0}]}, r"key 'eval.sets\[0\].limit'"),
    ({"sets": []}, r"key 'eval.sets': name at least one prompt set"),
    ({"backend": "tensorrt"}, r"key 'eval.backend': Invalid value 'tensorrt', expected one of \[hf, vllm, sglang\]"),
    ({"backend": "sglang"}, r"key 'eval.server_url': backend sglang measures on a running server"),
    ({"engine": "sglang"}, r"key 'eval.engine': Invalid value 'sglang', expected one of \[vllm\]"),
    ({"engine_tolerance": -0.1}, r"key 'eval.engine_tolerance': must be at least 0"),
    ({"backend": "sglang", "server_url": "localhost:30000"}, r"key 'eval.server_url'.*'localhost:30000'"),
    ({"backend": "vllm", "server_url": "http://127.0.0.1:8000", "concurrency": 0}, r"key 'eval.concurrency'"),
])
def test_set_and_backend_settings_are_checked(tmp_path, eval_keys, message):
    with pytest.raises(ConfigError, match=message):
        load_config(params_with(tmp_path, **eval_keys))


def test_own_sets_in_their_directory_are_accepted(tmp_path):
    cfg = load_config(params_with(tmp_path, sets_dir="data/bench", backend="vllm", server_url="http://127.0.0.1:8000",
                                  sets=[{"name": "mt-bench", "path": "data/bench/mt_bench/question.jsonl", "limit": 80},
                                        {"name": "gsm8k", "path": "data/bench/gsm8k.parquet", "format": "gsm8k"}]))
    assert cfg.eval.sets == [PromptSetConfig("mt-bench", "data/bench/mt_bench/question.jsonl", None, 80),
                             PromptSetConfig("gsm8k", "data/bench/gsm8k.parquet", "gsm8k", None)]


def eval_metrics(tau: float, by_set: dict[str, float], prompts: dict[str, int], **extra) -> dict:
    return {"tau": tau, "accept_1": 0.5, "accept_2": 0.25, "verify_steps": 40, "accepted_tokens": 30,
            "emitted_tokens": 70, "spec_tokens_per_s": 10.0, "lossless": True, "mismatched_prompts": 0,
            "prompts": sum(prompts.values()), "tau_by_set": by_set, "prompts_by_set": prompts,
            "time": {"stage_s": 1.0}, **extra}


def test_report_has_tau_per_set_for_each_drafter(tmp_path):
    prompts = {"gsm8k": 3, "mt-bench": 2}
    metrics = {
        "eval-baseline": eval_metrics(1.2, {"gsm8k": 1.3, "mt-bench": 1.1}, prompts),
        "eval-scratch": eval_metrics(2.5, {"gsm8k": 2.8, "mt-bench": 2.1}, prompts),
        "eval-warm_start": {**eval_metrics(2.9, {"gsm8k": 3.1, "mt-bench": 2.6}, prompts),
                            "accept_1": None, "accept_2": None},
    }
    del metrics["eval-warm_start"]["lossless"]
    table = tau_by_set_table(metrics)
    assert table.to_dict("records") == [
        {"set": "gsm8k", "temperature": "T=0", "prompts": 3, "baseline": 1.3, "scratch": 2.8, "warm_start": 3.1},
        {"set": "mt-bench", "temperature": "T=0", "prompts": 2, "baseline": 1.1, "scratch": 2.1, "warm_start": 2.6},
        {"set": "overall", "temperature": "T=0", "prompts": 5, "baseline": 1.2, "scratch": 2.5, "warm_start": 2.9},
    ]
    text = markdown(metrics, "sqlite:///mlflow.db")
    assert "## Acceptance length tau per benchmark set" in text
    assert "| mt-bench | T=0 | 2 | 1.100 | 2.100 | 2.600 |" in re.sub(" +", " ", text)
    assert "| warm_start | 2.900 |" in re.sub(" +", " ", text) and "not checked" in text
    assert "T=1" not in text and "tau_sampled" not in headline(metrics)  # eval.sampled_temperature null
    plot_tau_by_set(metrics, tmp_path / "tau_by_set.png")
    assert (tmp_path / "tau_by_set.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tau_by_set_table({}).empty
    plot_tau_by_set({}, tmp_path / "empty.png")  # before any eval has run, the report still renders
    assert (tmp_path / "empty.png").stat().st_size > 0


def sampled(tau: float, by_set: dict[str, float], **extra) -> dict:
    """The `sampled` block of an eval's metrics: tau again at eval.sampled_temperature."""
    return {"temperature": 1.0, "tau": tau, "tau_ci_low": round(tau - 0.1, 4), "tau_ci_high": round(tau + 0.12, 4),
            "accept_1": 0.4, "accept_2": 0.15, "verify_steps": 40, "accepted_tokens": 22, "emitted_tokens": 62,
            "spec_tokens_per_s": 5.0, "tau_by_set": by_set, **extra}


def test_report_shows_tau_at_both_temperatures(tmp_path):
    """Wherever tau is shown per drafter: at eval.temperature (T=0) and at eval.sampled_temperature (T=1), each with
    its interval and labelled by its temperature; a drafter measured at the primary temperature alone shows '-'."""
    prompts = {"gsm8k": 3, "mt-bench": 2}
    metrics = {
        "eval-baseline": {**eval_metrics(1.2, {"gsm8k": 1.3, "mt-bench": 1.1}, prompts, temperature=0.0,
                                         tau_ci_low=1.1, tau_ci_high=1.3),
                          "sampled": sampled(1.05, {"gsm8k": 1.1, "mt-bench": 1.0})},
        "eval-scratch": {**eval_metrics(3.51, {"gsm8k": 3.6, "mt-bench": 3.4}, prompts, temperature=0.0,
                                        tau_ci_low=3.37, tau_ci_high=3.63, draft_vocab_coverage=1.0,
                                        target_params=100, target_bytes=400, target_tokens_per_s=50.0,
                                        time={"stage_s": 30.0, "load_s": 1.0, "decode_sampled_s": 9.5}),
                         "sampled": sampled(2.71, {"gsm8k": 2.9, "mt-bench": 2.4})},
        "eval-warm_start": eval_metrics(3.5, {"gsm8k": 3.6, "mt-bench": 3.3}, prompts),
    }
    text = re.sub(" +", " ", markdown(metrics, "sqlite:///mlflow.db"))
    assert "| drafter | tau T=0 | T=0 95% CI | tau T=1 | T=1 95% CI | lossless | vocab coverage |" in text
    assert "| scratch | 3.510 | 3.37-3.63 | 2.710 | 2.61-2.83 | yes | 1.000 |" in text
    assert "| warm_start | 3.500 | not measured | - | not measured | yes | - |" in text
    assert "| scratch | T=1 | 0.400 | 0.150 | - |" in text  # acceptance by draft position, per temperature
    assert "| mt-bench | T=1 | 2 | 1.000 | 2.400 | - |" in text and "| overall | T=1 | 5 | 1.050 | 2.710 | - |" in text
    assert "| eval-scratch | 30.0 | 1.0 | 9.5 |" in text  # the stage's second decoding, timed apart
    rendered = markdown(metrics, "sqlite:///mlflow.db")
    widest = max(len(line) for line in rendered.splitlines() if line.startswith("|"))
    assert widest <= 120, widest
    assert tau_by_set_table(metrics)[["set", "temperature"]].values.tolist() == [
        ["gsm8k", "T=0"], ["gsm8k", "T=1"], ["mt-bench", "T=0"], ["mt-bench", "T=1"], ["overall", "T=0"],
        ["overall", "T=1"]]
    assert headline(metrics)["tau_sampled"] == {"baseline": 1.05, "scratch": 2.71}
    flat = pipeline_metrics(metrics)
    assert (flat["tau/scratch"], flat["tau_sampled/scratch"]) == (3.51, 2.71) and "tau_sampled/warm_start" not in flat
    plot_tau_by_set(metrics, tmp_path / "tau_by_set.png")
    plot(metrics, {}, tmp_path / "comparison.png")
    for name in ("tau_by_set.png", "comparison.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
