"""Charts as inline SVG rendered on the server: no script, no CDN."""

from __future__ import annotations

from collections.abc import Sequence

from .render import esc, seconds

_W, _H = 640, 200
_LEFT, _BOTTOM, _TOP = 56, 24, 12


def _frame(ymax_label: str, x_labels: Sequence[str], title: str) -> str:
    inner_h = _H - _BOTTOM - _TOP
    parts = [f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + inner_h}" class=axis />',
             f'<line x1="{_LEFT}" y1="{_TOP + inner_h}" x2="{_W}" y2="{_TOP + inner_h}" '
             f"class=axis />",
             f'<text x="{_LEFT - 4}" y="{_TOP + 10}" text-anchor=end>{esc(ymax_label)}</text>',
             f'<text x="{_LEFT - 4}" y="{_TOP + inner_h}" text-anchor=end>0</text>']
    n = max(1, len(x_labels))
    step = (_W - _LEFT) / n
    every = max(1, n // 6)
    for i, label in enumerate(x_labels):
        if i % every == 0:
            parts.append(f'<text x="{_LEFT + i * step + 2:.1f}" y="{_H - 6}">{esc(label)}</text>')
    return (f'<svg class=chart viewBox="0 0 {_W} {_H}" role=img aria-label="{esc(title)}">'
            f"<title>{esc(title)}</title>" + "".join(parts))


def line_chart(title: str, x_labels: Sequence[str],
               series: Sequence[tuple[str, Sequence[float | None]]]) -> str:
    """Lines of seconds (None: no data in that slot, the line breaks)."""
    values = [v for _, vs in series for v in vs if v is not None]
    if not values:
        return f'<p class=empty>{esc(title)}: no jobs started in this period</p>'
    top = max(max(values), 0.001) * 1.1
    inner_h = _H - _BOTTOM - _TOP
    step = (_W - _LEFT) / max(1, len(x_labels))
    out = [_frame(seconds(top), x_labels, title)]
    legend = []
    for k, (name, vs) in enumerate(series):
        runs: list[list[str]] = [[]]
        for i, v in enumerate(vs):
            if v is None:
                runs.append([])
                continue
            x = _LEFT + (i + 0.5) * step
            y = _TOP + inner_h * (1 - max(v, 0.0) / top)
            runs[-1].append(f"{x:.1f},{y:.1f}")
        for pts in runs:
            if len(pts) == 1:
                cx, cy = pts[0].split(",")  # a lone point: a dot, not a line
                out.append(f'<circle cx="{cx}" cy="{cy}" r=3 class="series s{k}" />')
            elif pts:
                out.append(f'<polyline points="{" ".join(pts)}" class="series s{k}" />')
        legend.append(f'<span class="key s{k}">{esc(name)}</span>')
    out.append("</svg>")
    return f'<figure>{"".join(out)}<figcaption>{"".join(legend)}</figcaption></figure>'


def bar_chart(title: str, x_labels: Sequence[str], counts: Sequence[int]) -> str:
    top = max(max(counts, default=0), 1)
    inner_h = _H - _BOTTOM - _TOP
    step = (_W - _LEFT) / max(1, len(counts))
    out = [_frame(str(top), x_labels, title)]
    for i, n in enumerate(counts):
        h = inner_h * n / top
        out.append(f'<rect x="{_LEFT + i * step + 1:.1f}" y="{_TOP + inner_h - h:.1f}" '
                   f'width="{max(step - 2, 1):.1f}" height="{h:.1f}" class=bar>'
                   f"<title>{esc(x_labels[i])}: {n}</title></rect>")
    out.append("</svg>")
    return f"<figure>{''.join(out)}</figure>"
