"""The DVC plots as dvc.yaml declares them: only the designed charts, axes titled, one colour per drafter as in the
report's PNGs, drawn into a page that needs no internet (.dvc/plots/offline.html). The page drawn in Chromium with
the network off: tests/test_pipeline_experiments.py."""
from __future__ import annotations

import configparser
import json
import re
from pathlib import Path

import yaml

from eagle3ops.reporting.plots_page import PAGE, PLOTS_PLACEHOLDER
from eagle3ops.reporting.summary import COLORS

ROOT = Path(__file__).resolve().parents[1]


def dvc_yaml() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())


def test_only_the_designed_charts_are_plots():
    """A plots file a stage declares gets a default chart of its own (its last column against the row number)
    besides the designed one; the curves are plain outputs."""
    for name, stage in dvc_yaml()["stages"].items():
        stage = stage.get("do", stage)
        assert "plots" not in stage, name
        assert not any(str(metric).endswith(".csv") for metric in stage.get("metrics", [])), name  # nor metrics
        for out in stage.get("outs", []):  # cached: with an uncached one, DVC's run cache would skip the stage
            assert not (isinstance(out, dict) and str(next(iter(out))).startswith("plots/")), (name, out)
    designed = [plot for plot in dvc_yaml()["plots"] if isinstance(plot, dict)]
    assert len(designed) == 4
    for plot in designed:
        ((title, spec),) = plot.items()
        assert spec["template"] == "drafters" and spec["x_label"] and spec["y_label"], title


def test_the_template_colours_each_drafter_as_the_reports_pngs_do():
    template = json.loads((ROOT / ".dvc" / "plots" / "drafters.json").read_text())
    scale = template["encoding"]["color"]["scale"]
    assert dict(zip(scale["domain"], scale["range"])) == {str(drafter): colour for drafter, colour in COLORS.items()}
    assert template["encoding"]["strokeDash"]["field"] == "rev"  # experiments apart by dash in `dvc plots diff`
    assert "<DVC_METRIC_DATA>" in json.dumps(template)


def test_dvc_draws_into_the_offline_page():
    config = configparser.ConfigParser()
    config.read(ROOT / ".dvc" / "config")
    assert ROOT / ".dvc" / config["plots"]["html_template"] == ROOT / PAGE  # DVC reads it relative to .dvc/
    page = (ROOT / PAGE).read_text()
    assert page.count(PLOTS_PLACEHOLDER) == 1
    assert "{scripts}" not in page  # where DVC would add its CDN <script src=...> tags
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert "window.vegaEmbed" in page and len(page) > 500_000  # the libraries themselves, inline
