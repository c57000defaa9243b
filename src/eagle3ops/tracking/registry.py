"""The model registry: every evaluated drafter a version, the alias `champion` on the best."""
from __future__ import annotations

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

CHAMPION = "champion"


def register_drafter(client: MlflowClient, run, name: str, source: str, tau: float) -> str:
    """A new version of registered model `name` from the drafter at `source`, tagged with its tau and lineage;
    the alias `champion` moves to it when its tau beats the current champion's. Returns the version."""
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="EAGLE-3 drafters, SpecForge/SGLang layout, with their tau")
    lineage = {k: v for k, v in run.data.tags.items() if k.startswith(("eagle3ops.", "dvc.input.", "hardware.label"))}
    version = client.create_model_version(name, source, run_id=run.info.run_id, tags={**lineage, "tau": f"{tau:.4f}"})
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
        best = float(champion.tags.get("tau", "-inf"))
    except MlflowException:
        best = float("-inf")
    if tau > best:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    return version.version
