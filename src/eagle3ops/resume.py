"""Mid-run state on disk, so a stage killed after an hour of work resumes instead of starting over.

DVC removes a stage's outputs before it runs the stage, so the state lives outside them, under
`.eagle3ops/resume/`, in a file named by the stage and a hash of everything that determines its result (the
resolved params and the md5s of its inputs): a later run with other inputs never picks it up. It is written
through a temporary file and an atomic rename, so a kill or a full disk leaves the previous state whole, and removed
once the stage has written its outputs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from eagle3ops.fs import WORK_DIR, atomic_path

RESUME_DIR = WORK_DIR / "resume"


class ResumePoint:
    def __init__(self, path: Path):
        self.path = path

    def load(self) -> dict | None:
        """The saved state; None when there is none or it is unreadable (then the stage starts over). Loaded
        with weights_only: a file that needs unpickling code is never executed."""
        if not self.path.is_file():
            return None
        try:
            return torch.load(self.path, weights_only=True)
        except Exception as err:
            print(f"ignoring unreadable resume state {self.path} ({type(err).__name__}); starting over", flush=True)
            return None

    def save(self, state: dict) -> None:
        """Replace the saved state with `state`; a full disk is one line (fs.DiskFullError), the last state kept."""
        kept = "the last resume point is kept" if self.path.is_file() else "no resume point was saved yet"
        with atomic_path(self.path, then=f"{kept}: free space and run again to resume") as tmp:
            torch.save(state, tmp)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def resume_point(stage: str, determinants: dict, root: Path = Path(".")) -> ResumePoint:
    """The resume file of `stage` for these determinants (params digest, input md5s, ...)."""
    key = hashlib.sha256(json.dumps(determinants, sort_keys=True).encode()).hexdigest()[:16]
    return ResumePoint(root / RESUME_DIR / f"{stage}-{key}.pt")
