"""Pictures of a benchmark run: ``sizebackend bench --plot FILE`` and
``benchmarks/bench_latency.py --plot FILE``.

A figure is a row of panels; a panel is grouped bars (one group per x label, one bar per
variant) with a title and a unit. ``.svg`` is written by this module alone (no
dependency); ``.png`` needs matplotlib (``pip install dynamo_sizebackend[plot]``), and
without it the error says so before any benchmark runs (:func:`check_path`).
"""
from __future__ import annotations

import html
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

#: One colour per variant, in order (colour-blind safe: Okabe and Ito's palette).
COLOURS = ("#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
FORMATS = (".svg", ".png")


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    groups: Sequence[str]  # x labels
    values: Mapping[str, Sequence[float | None]]  # variant: one value per group (None: absent)


def check_path(path: str) -> None:
    """Raise ``ValueError`` now for a file this module cannot write."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"--plot {path!r}: the file must end in .svg or .png")
    if ext == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(f"--plot {path!r}: a .png needs matplotlib (pip install "
                             "'dynamo_sizebackend[plot]'); or write a .svg, which needs "
                             "nothing") from None


def write(path: str, title: str, panels: Sequence[Panel]) -> None:
    check_path(path)
    if path.lower().endswith(".png"):
        _png(path, title, panels)
    else:
        with open(path, "w") as f:
            f.write(svg(title, panels))


def _variants(panels: Sequence[Panel]) -> list[str]:
    return list(dict.fromkeys(name for p in panels for name in p.values))


def svg(title: str, panels: Sequence[Panel]) -> str:
    """The figure as an SVG document: a bar (``<rect class="bar">``) per value, with
    its variant, group and value in a ``<title>`` (a tooltip in a browser)."""
    variants = _variants(panels)
    colour = {v: COLOURS[i % len(COLOURS)] for i, v in enumerate(variants)}
    width, height, top, bottom, left = 420, 300, 40, 50, 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" '
           f'height="{height + 30 + 18 * len(variants)}" font-family="sans-serif" font-size="11">',
           f'<text x="10" y="18" font-size="14">{html.escape(title)}</text>']
    for k, panel in enumerate(panels):
        x0, plot_w, plot_h = k * width + left, width - left - 20, height - top - bottom
        peak = max((v for vals in panel.values.values() for v in vals if v is not None), default=1.0) or 1.0
        out.append(f'<text x="{x0}" y="{top - 8}" font-size="12">{html.escape(panel.title)}</text>')
        out.append(f'<line x1="{x0}" y1="{top + plot_h}" x2="{x0 + plot_w}" y2="{top + plot_h}" stroke="#444"/>')
        out.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{top + plot_h}" stroke="#444"/>')
        for tick in range(5):
            value = peak * tick / 4
            y = top + plot_h - plot_h * tick / 4
            out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{value:.3g}</text>')
        out.append(f'<text x="{x0 - 45}" y="{top + plot_h / 2}" transform="rotate(-90 {x0 - 45} '
                   f'{top + plot_h / 2})" text-anchor="middle">{html.escape(panel.unit)}</text>')
        group_w = plot_w / max(1, len(panel.groups))
        shown = [v for v in variants if v in panel.values]
        bar_w = group_w * 0.8 / max(1, len(shown))
        for g, group in enumerate(panel.groups):
            gx = x0 + g * group_w + group_w * 0.1
            out.append(f'<text x="{gx + group_w * 0.4:.1f}" y="{top + plot_h + 14}" '
                       f'text-anchor="middle">{html.escape(str(group))}</text>')
            for b, variant in enumerate(shown):
                value = panel.values[variant][g]
                if value is None:
                    continue
                h = plot_h * value / peak
                out.append(
                    f'<rect class="bar" x="{gx + b * bar_w:.1f}" y="{top + plot_h - h:.1f}" '
                    f'width="{bar_w * 0.9:.1f}" height="{h:.1f}" fill="{colour[variant]}">'
                    f'<title>{html.escape(variant)} {html.escape(str(group))}: {value:.4g} '
                    f'{html.escape(panel.unit)}</title></rect>')
    for i, variant in enumerate(variants):  # legend
        y = height + 14 + 18 * i
        out.append(f'<rect x="{left}" y="{y - 9}" width="10" height="10" fill="{colour[variant]}"/>')
        out.append(f'<text x="{left + 16}" y="{y}">{html.escape(variant)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _png(path: str, title: str, panels: Sequence[Panel]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = _variants(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        shown = [v for v in variants if v in panel.values]
        width = 0.8 / max(1, len(shown))
        for b, variant in enumerate(shown):
            xs = [g + b * width for g, v in enumerate(panel.values[variant]) if v is not None]
            ys = [v for v in panel.values[variant] if v is not None]
            ax.bar(xs, ys, width * 0.9, label=variant,
                   color=COLOURS[variants.index(variant) % len(COLOURS)])
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(panel.groups))], list(panel.groups))
        ax.set_title(panel.title)
        ax.set_ylabel(panel.unit)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
