"""The target's identity: what the lineage records about the target instead of hashing its weights.

A real target is hundreds of GB; DVC would read all of it at every `dvc status`. Its identity is cheap instead:
the repository id and commit (target.id, target.revision), a sha256 over the files that define everything but
the weights (config.json, generation_config.json, the tokenizer files, the shard index `*.index.json`, which
names every tensor and its shard, and any modeling code `*.py` that trust_remote_code would run), and the
number and total size of the weight files. Weights replaced in place with the same names and sizes go
unnoticed: pin target.revision to the commit you downloaded, and it is checked against the download's own
record (huggingface_hub's cache path or `--local-dir` metadata).
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from fnmatch import fnmatch
from pathlib import Path

from eagle3ops.config import TargetConfig
from eagle3ops.modeling.target import TargetError, check_model_dir

DIGESTED = ("config.json", "generation_config.json", "*.index.json", "tokenizer*", "special_tokens_map.json",
            "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken", "tiktoken.model", "chat_template.*", "*.py")
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
COMMIT = re.compile(r"[0-9a-f]{40}")
# What a target built from a package (not downloaded) records of its source, a "revision" among it
SOURCE_RECORD = "eagle3ops-source.json"


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch(name, pattern) for pattern in patterns)


def downloaded_revision(path: str | Path) -> str | None:
    """The commit a Hugging Face download of this directory came from, where the download recorded one:
    the hub cache's `.../snapshots/<commit>/`, or the metadata `huggingface-cli download --local-dir` keeps; or the
    revision a target the zoo built from a package records (zoo/smollm2.py)."""
    path = Path(path).absolute()
    source = path / SOURCE_RECORD
    if source.is_file():
        return json.loads(source.read_text(encoding="utf-8")).get("revision")
    if path.parent.name == "snapshots" and COMMIT.fullmatch(path.name):
        return path.name
    metadata = path / ".cache" / "huggingface" / "download" / "config.json.metadata"
    if metadata.is_file():
        first = metadata.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0].strip()
        return first if COMMIT.fullmatch(first) else None
    return None


def target_identity(path: str | Path, id: str, revision: str | None) -> dict:
    """{id, revision, downloaded_revision, digest, digested_files, weight_files, weight_bytes} of the target
    directory; reads only its small files. Raises TargetError when `revision` is not the downloaded commit."""
    path = check_model_dir(path)
    downloaded = downloaded_revision(path)
    if revision and downloaded and not downloaded.startswith(revision.lower()):
        raise TargetError(f"target.revision is {revision!r} but {path} holds commit {downloaded} (as its download "
                          f"recorded it); set target.revision to that commit or download the one you pinned")
    files = sorted(p for p in path.iterdir() if p.is_file())
    digested = [p for p in files if _matches(p.name, DIGESTED)]
    weights = [p for p in files if _matches(p.name, WEIGHTS)]
    digest = hashlib.sha256()
    for file in digested:  # name, then the file's own hash: no two file sets can run together into one stream
        digest.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return {"id": id, "revision": revision, "downloaded_revision": downloaded, "digest": digest.hexdigest(),
            "digested_files": [p.name for p in digested], "weight_files": len(weights),
            "weight_bytes": sum(p.stat().st_size for p in weights)}


def identity_params(target: TargetConfig) -> dict[str, str]:
    """The identity as MLflow params (`target_identity.*`), for every stage run that uses the target. Warns
    when DVC tracks something else than this target (target.path changed, target.lineage_dep left behind)."""
    dep, path = Path(target.lineage_dep), Path(target.path)
    if dep != path and path not in dep.parents:
        print(f"eagle3ops: warning: target.lineage_dep ({target.lineage_dep}) is not in target.path "
              f"({target.path}): DVC does not track this target; set target.lineage_dep to "
              f"{path / 'config.json'}", file=sys.stderr, flush=True)
    identity = target_identity(target.path, target.id, target.revision)
    return {f"target_identity.{key}": ",".join(value) if isinstance(value, list) else str(value)
            for key, value in identity.items()}
