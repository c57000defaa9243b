"""DVC remotes pushed to and pulled from for real: the project's default local remote, SSH through a real OpenSSH
server on loopback (dvc-ssh), S3 through a real S3-API server on loopback (moto's server, dvc-s3).

The micro pipeline is the one built once for the whole test run (a copy of it). Each remote gets a full round trip: `dvc push`, `git clone` to a fresh directory,
the remote's credentials set there (never in the tracked .dvc/config), `dvc pull`, every output byte-identical to
the original and to the md5s dvc.lock records, linked from the cache rather than copied, and `dvc repro` a no-op.
Hidden states kept out of the remote (`push: false`) cannot be pulled and come back by re-running extract alone.
bench/dvc_scale.py, run on a few MB, shows commits link rather than copy.
"""
import filecmp
import hashlib
import json
import logging
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import yaml
from moto.server import ThreadedMotoServer

from eagle3ops.serving.server import free_port
from helpers import ROOT, commit, copy_workspace, ran_stages, run

pytestmark = [pytest.mark.pipeline, pytest.mark.service]

SSHD = Path("/usr/sbin/sshd")  # Debian's openssh-server
# What could hand the commands credentials from outside: each test gives them only what it configures.
OUTSIDE_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                       "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL", "SSH_AUTH_SOCK")
TRACKED_CONFIG_MUST_NOT_HOLD = ("user", "port", "keyfile", "password", "access_key_id", "secret_access_key")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str | None]:
    """An empty HOME (no ~/.ssh keys, ~/.aws credentials or global DVC config) and no credential variables."""
    return {"HOME": str(tmp_path_factory.mktemp("home")), **dict.fromkeys(OUTSIDE_CREDENTIALS)}


@pytest.fixture(scope="module")
def pipeline(built_pipeline, tmp_path_factory) -> Path:
    """The micro pipeline, run and committed: a copy of the built_pipeline fixture's in <tmp>/repo (its default
    remote is <tmp>/eagle3ops-dvc-storage)."""
    return copy_workspace(built_pipeline[0], tmp_path_factory.mktemp("team") / "repo")


def lock_outputs(repo: Path) -> dict[str, str]:
    """Every output dvc.lock records: path -> md5 (a directory's ends in .dir)."""
    stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {out["path"]: out["md5"] for stage in stages.values() for out in stage.get("outs", [])}


def cached_outputs(repo: Path) -> dict[str, str]:
    """The outputs DVC stores in its cache and remotes (not those `cache: false` leaves to git): path -> md5."""
    in_git = run(["git", "ls-files"], repo).split()
    return {path: md5 for path, md5 in lock_outputs(repo).items()
            if not any(name == path or name.startswith(f"{path}/") for name in in_git)}


def stored_object(storage: Path, md5: str) -> Path:
    """Where a DVC 3 cache or a local / SSH remote keeps the object `md5`."""
    return storage / "files" / "md5" / md5[:2] / md5[2:]


def cache_object(repo: Path, md5: str) -> Path:
    return stored_object(repo / ".dvc" / "cache", md5)


def recorded_files(repo: Path, md5: str) -> dict[str, str]:
    """What an output's md5 in dvc.lock says it holds: {relpath: md5}, from the directory's listing in the cache
    (whose own md5 is the one dvc.lock records); a single file is {"": md5}."""
    if not md5.endswith(".dir"):
        return {"": md5}
    listing = cache_object(repo, md5).read_bytes()
    assert hashlib.md5(listing).hexdigest() + ".dir" == md5
    return {entry["relpath"]: entry["md5"] for entry in json.loads(listing)}


def files_under(path: Path) -> dict[str, Path]:
    if path.is_file():
        return {"": path}
    return {p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*")) if p.is_file()}


def assert_same_outputs(origin: Path, clone: Path) -> None:
    """The clone's outputs are the origin's, byte for byte, and hash to what dvc.lock records; those that came
    from the remote (not git) are links into the clone's cache, read-only, not copies."""
    outputs = lock_outputs(clone)
    assert outputs == lock_outputs(origin)
    for path in outputs:
        mine, theirs = files_under(clone / path), files_under(origin / path)
        assert mine.keys() == theirs.keys(), path
        assert all(filecmp.cmp(mine[name], theirs[name], shallow=False) for name in mine), path
    pulled = cached_outputs(clone)
    assert {"data/prepared", "data/features", "models/drafters/scratch", "models/export"} <= pulled.keys()
    for path, md5 in pulled.items():
        mine = files_under(clone / path)
        recorded = recorded_files(clone, md5)
        assert recorded.keys() == mine.keys(), path
        for name, file in mine.items():
            assert hashlib.md5(file.read_bytes()).hexdigest() == recorded[name], f"{path}/{name}"
            # cache.type "hardlink,...": the workspace file is the cache's, on any filesystem shared with it
            assert os.path.samefile(file, cache_object(clone, recorded[name])), f"{path}/{name} was copied"
            assert not file.stat().st_mode & 0o222, f"{path}/{name} is writable: an edit would change the cache"


def assert_no_credentials_tracked(clone: Path) -> None:
    tracked = (clone / ".dvc" / "config").read_text()
    keys = {line.split("=")[0].strip() for line in tracked.splitlines() if "=" in line}
    assert not keys & set(TRACKED_CONFIG_MUST_NOT_HOLD), tracked
    assert run(["git", "status", "--porcelain"], clone) == ""  # .dvc/config.local is ignored, nothing else moved


def round_trip(origin: Path, remote: str | None, clone: Path, env: dict, local_config: dict[str, str] | None = None,
               credentials: dict[str, str] | None = None, credential_env: dict[str, str] | None = None,
               refusal: str | None = None) -> Path:
    """Push the origin's outputs to `remote` (None: the default one), clone the repository into `clone` and pull
    there, with `local_config` and `credentials` written to the clone's .dvc/config.local and `credential_env` in
    its environment; then check the outputs and that nothing is left to run. A remote that needs credentials first
    refuses the clone that has only `local_config`, with `refusal` in its message."""
    chosen = ["-r", remote] if remote else []
    run(["dvc", "push", *chosen], origin, env)
    run(["git", "clone", "-q", str(origin), str(clone)], origin.parent, env)
    set_local(clone, remote, local_config or {}, env)
    if refusal:  # no credentials in the clone yet: the remote refuses it
        assert refusal in run(["dvc", "pull", *chosen], clone, env, fail=True)
    set_local(clone, remote, credentials or {}, env)
    run(["dvc", "pull", *chosen], clone, {**env, **(credential_env or {})})
    assert_same_outputs(origin, clone)
    assert_no_credentials_tracked(clone)
    assert ran_stages(run(["dvc", "repro"], clone, env)) == []
    assert "Data and pipelines are up to date" in run(["dvc", "status"], clone, env)
    return clone


def set_local(repo: Path, remote: str, options: dict[str, str], env: dict) -> None:
    """This machine's settings of `remote`, in the git-ignored .dvc/config.local."""
    for option, value in options.items():
        run(["dvc", "remote", "modify", "--local", remote, option, value], repo, env)


def add_remote(repo: Path, name: str, url: str, env: dict, **tracked: str) -> None:
    """A team remote as the team commits it: where the data lives (URL, endpoint), no credentials."""
    run(["dvc", "remote", "add", name, url], repo, env)
    for option, value in tracked.items():
        run(["dvc", "remote", "modify", name, option, value], repo, env)
    commit(repo, f"remote {name}")


def test_default_local_remote_needs_no_setup(pipeline, env):
    """The tracked .dvc/config's remote `local`: a directory beside the repository, shared by the clones beside it."""
    clone = round_trip(pipeline, None, pipeline.parent / "clone-local", env)
    storage = pipeline.parent / "eagle3ops-dvc-storage"
    assert all(stored_object(storage, md5).is_file() for md5 in cached_outputs(clone).values())


@dataclass
class SshServer:
    port: int
    user: str
    keyfile: Path
    log: Path


def wait_for_banner(port: int, server: subprocess.Popen, log: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"sshd exited {server.returncode}:\n{log.read_text()}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
                if connection.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"sshd did not answer on port {port}:\n{log.read_text()}")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> Iterator[SshServer]:
    """A real OpenSSH server on 127.0.0.1 (a free port) with a throwaway host key, letting in one throwaway client
    key for the user running the tests. Unprivileged, it can only log that user in; as root (CI) it separates
    privileges through Debian's `sshd` user and /run/sshd."""
    if not SSHD.is_file():
        pytest.skip(f"{SSHD} is missing: install Debian's openssh-server (the README's test command does)")
    directory = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key, "-f", str(directory / key)],
                       check=True)
    shutil.copy(directory / "client_key.pub", directory / "authorized_keys")
    port = free_port()
    config = directory / "sshd_config"
    config.write_text(f"""ListenAddress 127.0.0.1
Port {port}
HostKey {directory / 'host_key'}
AuthorizedKeysFile {directory / 'authorized_keys'}
PidFile {directory / 'sshd.pid'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The throwaway files live under a world-writable /tmp, which strict mode refuses on the way up.
StrictModes no
Subsystem sftp internal-sftp
""")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # root's sshd needs it (systemd would create it)
    log = directory / "sshd.log"
    with log.open("wb") as out:  # -D: stay in the foreground, -e: log to stderr
        server = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_banner(port, server, log)
        yield SshServer(port, pwd.getpwuid(os.geteuid()).pw_name, directory / "client_key", log)
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_ssh_remote_round_trip(pipeline, sshd, env, tmp_path_factory):
    storage = tmp_path_factory.mktemp("ssh-storage")
    add_remote(pipeline, "team-ssh", f"ssh://127.0.0.1{storage}", env)
    login, key = {"user": sshd.user, "port": str(sshd.port)}, {"keyfile": str(sshd.keyfile)}
    set_local(pipeline, "team-ssh", {**login, **key}, env)
    clone = round_trip(pipeline, "team-ssh", pipeline.parent / "clone-ssh", env, local_config=login,
                       credentials=key, refusal="Permission denied")
    assert all(stored_object(storage, md5).is_file() for md5 in cached_outputs(clone).values())
    assert "Accepted publickey" in sshd.log.read_text()


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    """A real S3 API over HTTP on 127.0.0.1 (moto's server, in a thread of this process)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # else a line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def test_s3_remote_round_trip(pipeline, s3_endpoint, env):
    keys = {"access_key_id": "eagle3ops-test", "secret_access_key": "not-a-real-secret"}
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                      aws_access_key_id=keys["access_key_id"], aws_secret_access_key=keys["secret_access_key"])
    s3.create_bucket(Bucket="eagle3ops-dvc")
    add_remote(pipeline, "team-s3", "s3://eagle3ops-dvc/pipeline", env, endpointurl=s3_endpoint)
    set_local(pipeline, "team-s3", keys, env)  # the pushing side keeps its keys in .dvc/config.local ...
    clone = round_trip(pipeline, "team-s3", pipeline.parent / "clone-s3", env,  # ... the pulling side in its
                       credential_env={"AWS_ACCESS_KEY_ID": keys["access_key_id"],  # environment
                                       "AWS_SECRET_ACCESS_KEY": keys["secret_access_key"]},
                       refusal="Unable to locate credentials")
    stored = {item["Key"] for item in s3.list_objects_v2(Bucket="eagle3ops-dvc")["Contents"]}
    assert {f"pipeline/files/md5/{md5[:2]}/{md5[2:]}" for md5 in cached_outputs(clone).values()} <= stored


def test_hidden_states_kept_out_of_the_remote_are_extracted_again(pipeline, env, tmp_path_factory):
    """docs/team.md's option: extract's output with `push: false`. Flipping it re-runs nothing; the remote gets
    everything but the hidden states; a clone cannot pull them, and `dvc repro` re-runs extract alone, to the
    same md5."""
    work = tmp_path_factory.mktemp("no-features")
    gpu_box = work / "gpu-box"  # where extract ran: it has every output (the origin's cache, shared)
    run(["git", "clone", "-q", str(pipeline), str(gpu_box)], work, env)
    run(["dvc", "cache", "dir", "--local", str(pipeline / ".dvc" / "cache")], gpu_box, env)
    run(["dvc", "checkout"], gpu_box, env)
    dvc_yaml = (gpu_box / "dvc.yaml").read_text()
    assert dvc_yaml.count("        - ${extract.out_dir}\n") == 1
    (gpu_box / "dvc.yaml").write_text(dvc_yaml.replace("        - ${extract.out_dir}\n",
                                                       "        - ${extract.out_dir}: {push: false}\n"))
    run(["dvc", "remote", "modify", "local", "url", str(work / "storage")], gpu_box, env)
    commit(gpu_box, "hidden states stay on the GPU box")
    assert "Data and pipelines are up to date" in run(["dvc", "status"], gpu_box, env)
    run(["dvc", "push"], gpu_box, env)
    outputs = cached_outputs(gpu_box)
    in_remote = {path for path, md5 in outputs.items() if stored_object(work / "storage", md5).exists()}
    assert "data/features" not in in_remote and {"data/prepared", "models/drafters/scratch"} <= in_remote

    elsewhere = work / "elsewhere"
    run(["git", "clone", "-q", str(gpu_box), str(elsewhere)], work, env)
    assert "data/features" in run(["dvc", "pull"], elsewhere, env, fail=True)
    assert (elsewhere / "data" / "prepared").is_dir() and not (elsewhere / "data" / "features").exists()
    # the same hidden states again; the report shows extract's timings, which do differ
    assert ran_stages(run(["dvc", "repro"], elsewhere, env)) == ["extract@offline", "report"]
    assert cached_outputs(elsewhere) == outputs  # metrics/extract.json differs: its timings


def test_scale_bench_commits_by_hardlink(env, tmp_path):
    """bench/dvc_scale.py on a few MB: with the project's cache.type, `dvc add` leaves the shards hardlinked to the
    cache (no second copy on disk), and the clone pulls every shard back (the script checks it)."""
    out = tmp_path / "result.json"
    run([sys.executable, str(ROOT / "bench" / "dvc_scale.py"), "--total-gb", "0.008", "--shard-mb", "2",
         "--dir", str(tmp_path), "--out", str(out)], tmp_path, env)
    result = json.loads(out.read_text())
    assert result["files"] == 5 and result["cache_type"] == "hardlink,symlink,copy"
    assert result["link_type"] == "hardlink" and result["scaled_down_from_gb"] is None
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # the temporary repositories are gone
