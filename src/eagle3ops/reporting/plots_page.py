"""The page `dvc plots show` and `dvc plots diff` write their charts into: .dvc/plots/offline.html, which
.dvc/config names as `plots.html_template`.

DVC's own page loads Vega, Vega-Lite and Vega-Embed from a CDN, so on a machine without internet it shows the PNGs
and silently none of the charts. This page carries the three libraries inline (about 0.9 MB, BSD-3-Clause), bundled
by the PyPI package vl-convert-python, and has no `{scripts}` placeholder, so DVC adds no CDN tags to it. Vega-Lite
is the newest 5.x: the version of the specs DVC's templates and .dvc/plots/drafters.json write.

The committed page is this module's output; after upgrading vl-convert-python, write it again:

    pip install vl-convert-python && python -m eagle3ops.reporting.plots_page
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from eagle3ops.errors import InputError

PAGE = Path(".dvc") / "plots" / "offline.html"
PLOTS_PLACEHOLDER = "{plot_divs}"  # where dvc-render puts the charts (dvc_render.html.HTML)

TEMPLATE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    <title>eagle3ops: DVC plots</title>
    <!-- Vega {vega}, Vega-Lite {vega_lite}, Vega-Embed {vega_embed} (BSD-3-Clause), inline: bundled by
         vl-convert-python {vl_convert} (python -m eagle3ops.reporting.plots_page) -->
    <script>{bundle}</script>
    <style>
        body {{ font-family: sans-serif; }}
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {plots}
</body>
</html>
"""


def page_html() -> str:
    try:
        import vl_convert
        vl_convert_version = version("vl-convert-python")
    except (ImportError, PackageNotFoundError) as missing:
        raise InputError("writing the offline plots page needs vl-convert-python: pip install vl-convert-python") \
            from missing
    vega_lite = [v for v in vl_convert.get_vegalite_versions() if v.startswith("5.")][-1]
    return TEMPLATE.format(vega=vl_convert.get_vega_version(), vega_lite=vega_lite,
                           vega_embed=vl_convert.get_vega_embed_version(), vl_convert=vl_convert_version,
                           bundle=vl_convert.javascript_bundle(vl_version=vega_lite), plots=PLOTS_PLACEHOLDER)


if __name__ == "__main__":
    PAGE.write_text(page_html(), encoding="utf-8")
    print(f"wrote {PAGE}")
