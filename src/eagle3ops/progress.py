"""Progress bars for long work: live on a terminal, a line every half minute in logs (dvc repro, CI)."""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress(total: int, desc: str, unit: str, initial: int = 0) -> tqdm:
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=True,
                mininterval=0.5 if interactive else 30.0, dynamic_ncols=True)
