"""The DVC side of a stage run: what `dvc.yaml` declares for it, what `dvc.lock` records (input md5s, each stage
entry's hash), the git state, and the links that make every pipeline run show its whole chain (cached stages linked
to the runs that produced their outputs, experiments tagged with their result commit).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from eagle3ops.tracking.store import PIPELINE_KEY_TAG, ROLE_TAG


def git(root: Path, *args: str) -> str | None:
    """Output of a git command in `root`, or None where there is no git or no repository."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(root: Path) -> tuple[str, bool]:
    """(HEAD commit or "nogit", whether a file git tracks differs from it). What DVC writes is left out: dvc.lock,
    rewritten after every stage, the stages' outputs (metrics, plots and reports live in git) and the .gitignore
    files DVC writes beside new outputs, else the second stage of a fresh clone's first `dvc repro` would already
    call the tree dirty."""
    commit = git(root, "rev-parse", "HEAD")
    if commit is None:
        return _git_state_without_git(root)
    outputs = [f":(exclude,literal){path}" for path in lock_outputs(root / "dvc.lock")]
    status = git(root, "status", "--porcelain", "--", ".", ":(exclude,glob)**/dvc.lock", ":(exclude,glob)**/.gitignore",
                 *outputs)
    return commit, bool(status)


def _git_state_without_git(root: Path) -> tuple[str, bool]:
    """git_state through dulwich (DVC's own git library) on a machine without the git program, such as a lent
    GPU machine: the same commit, the same exclusions."""
    from dulwich import porcelain
    from dulwich.errors import NotGitRepository
    from dulwich.repo import Repo

    try:
        repo = Repo.discover(str(root))
        commit = repo.head().decode()
        status = porcelain.status(repo, untracked_files="all")
    except (NotGitRepository, KeyError, OSError):
        return "nogit", False
    top, here = Path(repo.path).resolve(), root.resolve()
    outputs = [here / out for out in lock_outputs(root / "dvc.lock")]

    def counts(path: bytes) -> bool:  # what `git status -- . :(exclude)...` above would list
        file = top / os.fsdecode(path)
        return (file.is_relative_to(here) and file.name not in ("dvc.lock", ".gitignore")
                and not any(file.is_relative_to(out) for out in outputs))
    changed = [*(path for paths in status.staged.values() for path in paths), *status.unstaged, *status.untracked]
    return commit, any(map(counts, changed))


def load_yaml(text: str):
    """DVC's files (dvc.yaml, dvc.lock, params.yaml), parsed by libyaml where PyYAML has it: every stage reads
    dvc.lock several times, and the pure-Python parser takes a tenth of a second a read."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


ITEM_FIELD = re.compile(r"\$\{\s*item\.(\w+)\s*\}")  # a foreach stage's own value: ${item.keys}
INTERPOLATED = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*\}")  # ${train.out_dir}, ${item.from}, ${key}


def stage_definition(root: Path, stage: str) -> dict | None:
    """What dvc.yaml says of `stage` ("eval@baseline": the `eval` foreach's `do` and its item `baseline`), as
    written, or None when dvc.yaml has no such stage."""
    path = root / "dvc.yaml"
    if not path.is_file():
        return None
    name, _, item = stage.partition("@")
    entry = ((load_yaml(path.read_text(encoding="utf-8")) or {}).get("stages") or {}).get(name)
    if not isinstance(entry, dict):
        return None
    if "foreach" not in entry:
        return entry
    items = entry["foreach"]
    return {**entry["do"], "item": items.get(item) if isinstance(items, dict) else None}


def declared_params(root: Path, stage: str, params_file: str = "params.yaml") -> set[str] | None:
    """The params keys `stage` may read: those its dvc.yaml entry lists under `params` (from `params_file`) and
    those its command, dependencies and outputs interpolate, which DVC also re-runs the stage for. None when
    dvc.yaml has no such stage (nothing to hold it to)."""
    entry = stage_definition(root, stage)
    if entry is None:
        return None
    keys = set()
    variant = entry.get("item") if isinstance(entry.get("item"), dict) else {}
    for item in entry.get("params") or []:
        if isinstance(item, str):  # a key, or ${item.keys}: the variant's own
            keys.add(ITEM_FIELD.sub(lambda field: str(variant.get(field[1], field[0])), item))
        elif isinstance(item, dict):  # {other_params.yaml: [keys]}
            keys.update(key for file, listed in item.items() if file == params_file for key in listed or [])
    written = json.dumps({field: value for field, value in entry.items() if field != "params"})
    keys.update(key for key in INTERPOLATED.findall(written) if key != "key" and not key.startswith("item."))
    return keys


def put_back_outputs(root: Path, stage: str) -> tuple[list[str], list[str]]:
    """After `stage` failed under `dvc repro`: the outputs DVC removed before running it, as dvc.lock records
    them from the last run that succeeded. Those DVC does not cache by path (metrics and plots, `cache: false`)
    are copied back from the copies DVC's run cache keeps of them; returns (the paths put back, the missing
    cached outputs, which `dvc checkout` restores)."""
    from dvc.repo import Repo

    repo = Repo(str(root))
    put_back, cached = [], []
    for found in repo.stage.collect(stage):
        for out in found.outs:
            path = root / out.def_path
            if path.exists() or out.hash_info is None or not out.hash_info.value:
                continue
            if out.use_cache:
                cached.append(out.def_path)
                continue
            copy = Path(repo.cache.local.oid_to_path(out.hash_info.value))
            if copy.is_file() and not out.hash_info.isdir:
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(copy, path)  # a copy: the cache's own file stays read-only
                put_back.append(out.def_path)
    return put_back, cached


def pipeline_params(root: Path) -> set[str]:
    """The params keys that some stage of dvc.yaml declares: those that define a pipeline run."""
    path = root / "dvc.yaml"
    stages = ((load_yaml(path.read_text(encoding="utf-8")) or {}).get("stages") or {}) if path.is_file() else {}
    keys: set[str] = set()
    for name, entry in stages.items():
        items = entry.get("foreach") if isinstance(entry, dict) else None
        for stage in ([f"{name}@{item}" for item in items] if isinstance(items, dict) else [name]):
            keys |= declared_params(root, stage) or set()
    return keys


def params_overrides(root: Path, params_file: str = "params.yaml") -> dict[str, object]:
    """{key: value} where the work tree's params file differs from the commit's: what `dvc exp run -S` set (or
    an edit not committed yet)."""
    committed, current = git(root, "show", f"HEAD:{params_file}"), root / params_file
    if committed is None or not current.is_file():
        return {}
    before, after = (_flat(load_yaml(text) or {}) for text in (committed, current.read_text(encoding="utf-8")))
    return {key: value for key, value in after.items() if before.get(key, object()) != value}


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _normalise(path: str | Path, root: Path) -> str:
    return Path(os.path.relpath(os.path.abspath(path), root)).as_posix()


def lock_stages(lock: Path) -> dict[str, dict]:
    """{stage name: its dvc.lock entry}; empty when there is no lock yet."""
    if not lock.is_file():
        return {}
    return (load_yaml(lock.read_text(encoding="utf-8")) or {}).get("stages") or {}


def lock_outputs(lock: Path) -> dict[str, str]:
    """{output path: md5} over every stage of a dvc.lock."""
    return {out["path"]: str(out["md5"]) for entry in lock_stages(lock).values()
            for out in entry.get("outs") or [] if "path" in out and "md5" in out}


def input_md5s(inputs: Sequence[str | Path], root: Path) -> dict[str, str]:
    """md5 that dvc.lock records for each input as some stage's output; inputs it does not list are left out."""
    recorded = {_normalise(root / path, root): md5 for path, md5 in lock_outputs(root / "dvc.lock").items()}
    wanted = (_normalise(path, root) for path in inputs)
    return {path: recorded[path] for path in wanted if path in recorded}


CHECKED_INPUT_BYTES = 16 * 2**30  # inputs up to this are held to dvc.lock; hidden-state shards (larger) carry sha256s


def changed_inputs(md5s: dict[str, str], root: Path) -> list[str]:
    """Inputs (`input_md5s`: path -> the md5 dvc.lock records) whose bytes are not the recorded ones, each as
    "path: what differs": an edit in place, or a DVC cache object changed through its hardlink (the workspace file
    *is* the cache's). A directory is compared file by file with the listing DVC keeps in its cache (where the cache
    no longer has it, only files are checked); inputs over CHECKED_INPUT_BYTES are left to DVC."""
    changed = []
    for path, md5 in md5s.items():
        target = root / path
        files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
        if sum(p.stat().st_size for p in files) > CHECKED_INPUT_BYTES:
            continue
        if not md5.endswith(".dir"):
            if target.is_file() and (found := _md5(target)) != md5:
                changed.append(f"{path}: md5 {found}, dvc.lock records {md5}")
            continue
        recorded = {name: md5_ for name, (md5_, _) in dir_listing(md5, root).items()}
        if not recorded:
            continue
        present = {p.relative_to(target).as_posix(): p for p in files}
        for name in sorted(recorded.keys() | present.keys()):
            if name not in present or name not in recorded:
                changed.append(f"{path}/{name}: {'missing' if name not in present else 'not in the recorded output'}")
            elif _md5(present[name]) != recorded[name]:
                changed.append(f"{path}/{name}: its bytes are not the ones dvc.lock records (md5 {recorded[name]})")
    return changed


def dir_listing(md5: str, root: Path) -> dict[str, tuple[str, Path]]:
    """{relative path: (its md5, its object in DVC's cache)} of the directory output DVC recorded as `md5`
    (ending in .dir); empty where the cache does not hold the listing."""
    cache = dvc_cache_dir(root)
    listing = cache / md5[:2] / md5[2:] if cache else None
    if listing is None or not listing.is_file():
        return {}
    return {entry["relpath"]: (entry["md5"], cache / entry["md5"][:2] / entry["md5"][2:])
            for entry in json.loads(listing.read_text(encoding="utf-8"))}


def _md5(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "md5").hexdigest()


@functools.cache
def dvc_cache_dir(root: Path) -> Path | None:
    """DVC's local cache of md5-addressed files (`cache.dir` where set, e.g. by `eagle3ops reproduce`); None outside
    a DVC repository."""
    from dvc.exceptions import NotDvcRepoError  # a second's import, only for a stage reading a directory DVC tracks
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            return Path(repo.cache.local.path)
    except NotDvcRepoError:
        return None


LOCK_HASH_TAG = "eagle3ops.lock_hash"


CACHED_FROM_TAG = "eagle3ops.cached_from"


def lock_hashes(root: Path) -> dict[str, str]:
    """{dvc stage name: hash of its dvc.lock entry}. Equal hashes mean the same command, deps, params and outs:
    the run that wrote the entry produced exactly those outputs."""
    return {name: hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for name, entry in lock_stages(root / "dvc.lock").items()}


def _stage_runs(client: MlflowClient, experiment_id: str, extra: str = "") -> list:
    query = f"tags.`{ROLE_TAG}` = 'stage'" + (f" and {extra}" if extra else "")
    return client.search_runs([experiment_id], filter_string=query, order_by=["attributes.start_time DESC"],
                              max_results=5000)


def stamp_finished_stages(client: MlflowClient, experiment_id: str, root: Path) -> None:
    """Tag the newest finished, unstamped run of each stage with the dvc.lock hash DVC wrote after it ran.

    DVC writes a stage's lock entry only once the stage has succeeded, so the next stage to start (or the
    report at the end) is the first process that can tie the run to the outputs it produced.
    """
    hashes = lock_hashes(root)
    if not hashes:
        return
    stamped = {r.data.tags.get(LOCK_HASH_TAG) for r in _stage_runs(client, experiment_id, f"tags.`{LOCK_HASH_TAG}` != ''")}
    for run in _stage_runs(client, experiment_id, "attributes.status = 'FINISHED'"):
        tags = run.data.tags
        stage = tags.get("eagle3ops.dvc_stage")
        if stage in hashes and LOCK_HASH_TAG not in tags and hashes[stage] not in stamped:
            client.set_tag(run.info.run_id, LOCK_HASH_TAG, hashes[stage])
            stamped.add(hashes[stage])


RESULT_COMMIT_TAG = "eagle3ops.result_commit"


def tag_experiment_commits(client: MlflowClient, experiment_id: str, root: Path) -> None:
    """`dvc exp run` commits its results only after the last stage: tag each experiment's parent run with that
    commit as soon as a later process (the next stage run, or `compare`) can see it under refs/exps."""
    refs = git(root, "for-each-ref", "refs/exps", "--format=%(refname) %(objectname)")
    if not refs:
        return
    commits = {ref.rsplit("/", 1)[-1]: sha for ref, sha in (line.split() for line in refs.splitlines())}
    parents = client.search_runs([experiment_id], f"tags.`{ROLE_TAG}` = 'pipeline'", max_results=5000)
    for parent in parents:
        name = parent.data.tags.get(PIPELINE_KEY_TAG)
        if name in commits and RESULT_COMMIT_TAG not in parent.data.tags:
            client.set_tag(parent.info.run_id, RESULT_COMMIT_TAG, commits[name])


def defined_stages(root: Path) -> set[str]:
    """The stages dvc.yaml makes with the current params, as DVC resolves it."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return {stage.addressing for stage in repo.index.stages}


def link_cached_stages(client: MlflowClient, experiment_id: str, parent_id: str, root: Path) -> list[str]:
    """Give the pipeline run a child for every stage DVC skipped: a FINISHED link run that names the run which
    produced the cached outputs (found by dvc.lock hash) and carries its params and final metrics, so every
    parent shows the whole chain. Returns the linked stage names."""
    stamp_finished_stages(client, experiment_id, root)
    pipeline_name = client.get_run(parent_id).info.run_name
    present = {r.data.tags.get("eagle3ops.dvc_stage")
               for r in _stage_runs(client, experiment_id, f"tags.`mlflow.parentRunId` = '{parent_id}'")}
    linked = []
    hashes = lock_hashes(root)
    defined = defined_stages(root) if hashes else set()
    for stage, lock_hash in hashes.items():
        if stage in present or stage not in defined:  # dvc.lock keeps a stage dvc.yaml no longer makes (extract@offline
            continue                                  # once training is online) until it is run again
        producers = _stage_runs(client, experiment_id, f"tags.`{LOCK_HASH_TAG}` = '{lock_hash}'")
        original = next((r for r in producers if CACHED_FROM_TAG not in r.data.tags), None)
        if original is None:
            continue
        tags = {k: v for k, v in original.data.tags.items() if not k.startswith("mlflow.")}
        tags.update({CACHED_FROM_TAG: original.info.run_id, "mlflow.parentRunId": parent_id})
        link = client.create_run(original.info.experiment_id, run_name=f"{stage} · {pipeline_name} (cached)", tags=tags)
        client.log_batch(link.info.run_id,
                         metrics=[Metric(k, v, int(time.time() * 1000), 0) for k, v in original.data.metrics.items()],
                         params=[Param(k, v) for k, v in original.data.params.items()])
        client.set_terminated(link.info.run_id, "FINISHED")
        linked.append(stage)
    return linked
