"""Where a vLLM start goes, on this machine: a server started as the stages start it (serving/vllm.py), each line
of its log stamped as it appears, cut into phases.

    python bench/vllm_start.py [--repeat 2] [--drafter] [--out bench/results/vllm_start-<host>.json]

The target is a tiny Llama of the zoo's shape (built here, offline), so the model's own load is a small part:
what is measured is the fixed cost every start pays, whatever the model. Phases, from the log:
  api import      process start to the API server's first log line (importing vLLM and torch, parsing arguments)
  model config    to "Resolved architecture" (the model's config, vLLM's registry inspecting the architecture)
  engine spawn    to the engine-core process's first line (a spawned process: vLLM and torch imported again)
  engine init     to "init engine ... took" (loading the weights, the KV cache, the warm-up)
  api ready       to /health answering 200 (the API server's routes, the tokenizer, the chat template)
`--repeat` starts it again with vLLM's own caches (~/.cache/vllm) as the first start left them; `--cold-cache`
gives each start an empty VLLM_CACHE_ROOT instead. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2
from tabulate import tabulate

from eagle3ops.config import TinyLlamaConfig, VllmConfig
from eagle3ops.formats.export import export_drafter
from eagle3ops.formats.specforge import save_drafter
from eagle3ops.modeling.draft import DraftConfig, Eagle3Draft
from eagle3ops.serving.server import free_port, stop_process_group
from eagle3ops.serving.vllm import installed_version, serve_argv, serve_env
from eagle3ops.tracking.hardware import fingerprint, label
from eagle3ops.zoo.targets import build_llama, save_target
from eagle3ops.zoo.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# (phase, the log line that ends it); the last phase ends when /health answers
PHASES = [("api import", re.compile(r"^\(APIServer pid=\d+\)")),
          ("model config", re.compile(r"Resolved architecture")),
          ("engine spawn", re.compile(r"^\(EngineCore pid=\d+\)")),
          ("engine init", re.compile(r"init engine .* took"))]
TEXTS = [f"The fox number {i} jumps over {i * 7} lazy dogs. Hello world, how are you today?" for i in range(40)]


def tiny_target(directory: Path) -> Path:
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    save_target(build_llama(TinyLlamaConfig(), tokenizer, seed=0), tokenizer, directory)
    return directory


def tiny_drafter(target: Path, directory: Path) -> Path:
    shape = json.loads((target / "config.json").read_text())
    draft = Eagle3Draft(DraftConfig(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                                    num_attention_heads=shape["num_attention_heads"],
                                    num_key_value_heads=shape["num_key_value_heads"],
                                    vocab_size=shape["vocab_size"], draft_vocab_size=shape["vocab_size"],
                                    target_hidden_size=shape["hidden_size"], aux_layers=[1, 3, 5],
                                    max_position_embeddings=shape["max_position_embeddings"]))
    draft.t2d.fill_(True)
    save_drafter(draft, directory / "trained")
    export_drafter(directory / "trained", directory / "speculators", "speculators", target)
    return directory / "speculators"  # as eval serves it (decoding/served.py)


def stamped_lines(log: Path, stamps: list[tuple[float, str]], done: threading.Event) -> None:
    """Append (seconds since the epoch, line) for each line of `log` as it is written, until `done`."""
    while not log.exists() and not done.is_set():
        time.sleep(0.02)
    with open(log, encoding="utf-8", errors="replace") as stream:
        partial = ""
        while True:
            chunk = stream.readline()
            if chunk:
                partial += chunk
                if partial.endswith("\n"):
                    stamps.append((time.time(), partial.rstrip("\n")))
                    partial = ""
                continue
            if done.is_set():
                return
            time.sleep(0.02)


def one_start(target: Path, drafter: Path | None, scratch: Path, env: dict[str, str]) -> dict:
    port, log = free_port(), scratch / f"vllm-{time.time_ns()}.log"
    argv = serve_argv(target, "float32", VllmConfig(), port, drafter=drafter)
    stamps: list[tuple[float, str]] = []
    done = threading.Event()
    reader = threading.Thread(target=stamped_lines, args=(log, stamps, done), daemon=True)
    reader.start()
    began = time.time()
    with open(log, "wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, env={**os.environ, **serve_env(VllmConfig()), **env})
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"vLLM exited with {server.returncode}; the end of its log:\n"
                                 + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            time.sleep(0.05)
        ready = time.time()
    finally:
        stop_process_group(server)
        done.set()
        reader.join()
    phases, since = {}, began
    for name, pattern in PHASES:
        at = next((t for t, line in stamps if pattern.search(line) and t >= since), None)
        if at is None:
            raise SystemExit(f"no log line for the phase {name!r} ({pattern.pattern}); the log: {log}")
        phases[name], since = round(at - since, 2), at
    phases["api ready"] = round(ready - since, 2)
    return {"ready_s": round(ready - began, 2), "phases_s": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2, help="starts to measure (default 2)")
    parser.add_argument("--drafter", action="store_true", help="serve a tiny EAGLE-3 drafter beside the target, "
                                                               "as eval does")
    parser.add_argument("--cold-cache", action="store_true", help="an empty VLLM_CACHE_ROOT for every start")
    parser.add_argument("--out", type=Path, help="the JSON (default bench/results/vllm_start-<hardware>.json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-start-") as scratch_dir:
        scratch = Path(scratch_dir)
        target = tiny_target(scratch / "target")
        drafter = tiny_drafter(target, scratch / "drafter") if args.drafter else None
        starts = []
        for i in range(args.repeat):
            env = {"VLLM_CACHE_ROOT": str(scratch / f"vllm-cache-{i}")} if args.cold_cache else {}
            starts.append(one_start(target, drafter, scratch, env))
            print(f"start {i + 1}/{args.repeat}: ready in {starts[-1]['ready_s']:.1f} s", file=sys.stderr, flush=True)
    names = [name for name, _ in PHASES] + ["api ready"]
    rows = [[f"start {i + 1}", *(s["phases_s"][n] for n in names), s["ready_s"]] for i, s in enumerate(starts)]
    print(tabulate(rows, headers=["", *names, "ready"], floatfmt=".1f"))
    result = {"vllm": installed_version(), "hardware": label(fingerprint()), "python": platform.python_version(),
              "cpus": os.cpu_count(), "drafter": args.drafter, "cold_cache": args.cold_cache, "starts": starts,
              "command": " ".join(["python", "bench/vllm_start.py", *sys.argv[1:]])}
    out = args.out or ROOT / "bench" / "results" / f"vllm_start-{result['hardware']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
