"""`eagle3ops tracking-server`: the team's MLflow server. Runs, params, metrics, registered models and users live
in PostgreSQL; artifacts are served (proxied) by the server from a local directory or an S3-compatible bucket, so
clients need no storage credentials; MLflow's basic-auth app is on.

No secret comes from a file in git or goes on the command line, which `ps` shows to every user of the machine:
the database password reaches the server as PGPASSWORD, which libpq reads (a password inside EAGLE3OPS_DB_URI is
moved there), and the admin's as MLFLOW_AUTH_ADMIN_PASSWORD, which MLflow reads when it creates the admin user on
its first start against an empty database.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, NoReturn
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from eagle3ops.errors import InputError
from eagle3ops.fs import WORK_DIR, write_text_atomic

DB_URI_ENV = "EAGLE3OPS_DB_URI"
SECRET_KEY_ENV = "MLFLOW_FLASK_SERVER_SECRET_KEY"
PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")
DEFAULT_STATE_DIR = WORK_DIR / "tracking-server"
AUTH_CONFIG = "basic_auth.ini"
# SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; the `team` extra installs psycopg2.
DRIVERS = {"postgresql": "postgresql+psycopg2"}


class ServerSetupError(InputError):
    """The environment lacks what the server needs (a database, the CSRF key)."""


@dataclass(frozen=True)
class ServerOptions:
    """What `eagle3ops tracking-server` takes; cli.py reads them from the command line."""

    host: str = "127.0.0.1"  # 0.0.0.0 serves the team, behind a TLS proxy: basic auth sends the password each time
    port: int = 5000
    workers: int = 4  # server worker processes
    state_dir: Path = DEFAULT_STATE_DIR  # holds AUTH_CONFIG and, unless artifacts_destination says otherwise, artifacts/
    artifacts_destination: str | None = None  # a local directory or s3://BUCKET/PREFIX (None: STATE_DIR/artifacts)
    default_permission: str = "EDIT"  # one of PERMISSIONS: on experiments and models a user did not create
    mlflow_args: tuple[str, ...] = ()  # further `mlflow server` options, as they are


def database(env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """(the PostgreSQL URI for --backend-store-uri, without a password; variables the server's environment needs
    for it). A password in $EAGLE3OPS_DB_URI becomes PGPASSWORD."""
    if env.get(DB_URI_ENV):
        parts = urlsplit(env[DB_URI_ENV])
        if parts.scheme != "postgresql" and not parts.scheme.startswith("postgresql+"):
            raise ServerSetupError(f"${DB_URI_ENV}: expected postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE, "
                                   f"got a {parts.scheme or 'scheme-less'} URI")
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, has_password, password = userinfo.partition(":")
        uri = urlunsplit(parts._replace(scheme=DRIVERS.get(parts.scheme, parts.scheme),
                                        netloc=f"{user}@{hostport}" if user else hostport))
        return uri, ({"PGPASSWORD": unquote(password)} if has_password else {})
    if env.get("PGDATABASE"):  # libpq takes host, port, user and password from PG* itself
        return f"{DRIVERS['postgresql']}:///{quote(env['PGDATABASE'], safe='')}", {}
    raise ServerSetupError(f"no database: set ${DB_URI_ENV}=postgresql://USER@HOST:PORT/DATABASE (the password in "
                           "it, in PGPASSWORD or in ~/.pgpass), or libpq's PGHOST, PGPORT, PGUSER, PGDATABASE")


def auth_config(db_uri: str, default_permission: str) -> str:
    """MLflow's basic_auth.ini: users and permissions in the tracking database (their own tables and migration
    table, alembic_version_auth). The admin's password comes from MLFLOW_AUTH_ADMIN_PASSWORD, never from here; its
    name from MLFLOW_AUTH_ADMIN_USERNAME, which overrides the one here."""
    settings = {
        "default_permission": default_permission,
        "admin_username": "admin",
        "database_uri": db_uri.replace("%", "%%"),  # MLflow reads the file with ConfigParser's % interpolation
        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
    }
    return "[mlflow]\n" + "".join(f"{key} = {value}\n" for key, value in settings.items())


class Launch(NamedTuple):
    argv: list[str]  # `python -m mlflow server ...`: no secret in it
    env: dict[str, str]
    auth_config: Path
    auth_config_text: str
    db_uri: str
    artifacts: str


def server_command(options: ServerOptions, environ: Mapping[str, str]) -> Launch:
    """How to start `mlflow server` from these options and this environment. Raises ServerSetupError when the
    environment cannot start it."""
    if not environ.get(SECRET_KEY_ENV):
        raise ServerSetupError(f"${SECRET_KEY_ENV} is not set: basic auth's CSRF protection needs a key that stays the "
                               f"same across restarts, e.g. export {SECRET_KEY_ENV}=$(python -c 'import secrets; "
                               "print(secrets.token_hex(32))') kept in the server's secret store")
    db_uri, db_env = database(environ)
    state = Path(options.state_dir).absolute()
    artifacts = options.artifacts_destination or str(state / "artifacts")
    auth_config_path = state / AUTH_CONFIG
    env = {key: value for key, value in environ.items() if key != DB_URI_ENV}  # its password is in PGPASSWORD now
    env.update(db_env)
    env["MLFLOW_AUTH_CONFIG_PATH"] = str(auth_config_path)
    argv = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
            "--backend-store-uri", db_uri, "--artifacts-destination", artifacts, "--serve-artifacts",
            "--host", options.host, "--port", str(options.port), "--workers", str(options.workers),
            *options.mlflow_args]
    return Launch(argv, env, auth_config_path, auth_config(db_uri, options.default_permission), db_uri, artifacts)


def serve(options: ServerOptions) -> NoReturn:
    """Write the auth config and become `mlflow server` (exec: signals reach it directly, e.g. from systemd)."""
    launch = server_command(options, os.environ)
    write_text_atomic(launch.auth_config, launch.auth_config_text)
    if "://" not in launch.artifacts:
        Path(launch.artifacts).mkdir(parents=True, exist_ok=True)
    print(f"eagle3ops tracking-server: http://{options.host}:{options.port}, runs and users in {launch.db_uri}, artifacts "
          f"in {launch.artifacts}", file=sys.stderr, flush=True)
    os.execve(sys.executable, launch.argv, launch.env)
