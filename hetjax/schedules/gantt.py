"""Draw a `Timeline` as a Gantt chart into an RGB pixel array (no plotting library).

Layout, top to bottom one row per global stage: a small swatch on the left tells the
stage's module apart (one colour per module); F actions are blue, B actions orange,
sends/recvs that take time grey, each microbatch one of four shades so neighbours stay
distinct; idle time is white; thin grey lines separate rows and red lines mark phase
barriers. There is no text - the image is for eyeballing bubbles, and `Schedule.to_text`
is the readable form.
"""

from __future__ import annotations

import colorsys

import numpy as np

from .timed import TimelineView

_WHITE = (255, 255, 255)
_GRID = (200, 200, 200)
_BARRIER = (220, 40, 40)
_COMM = (150, 150, 150)
_HUES = {"F": 0.60, "B": 0.07}
_MODULE_HUES = (0.33, 0.80, 0.50, 0.15, 0.95, 0.70)
_MARGIN = 6
_SWATCH = 8


def action_colour(kind: str, microbatch: int) -> tuple[int, int, int]:
    """RGB for an action: a hue per kind, one of four shades per microbatch."""
    if kind not in _HUES:
        return _COMM
    shade = microbatch % 4
    return _rgb(_HUES[kind], 0.40 + 0.17 * shade, 0.97 - 0.09 * shade)


def _rgb(hue: float, saturation: float, value: float) -> tuple[int, int, int]:
    red, green, blue = colorsys.hsv_to_rgb(hue, saturation, value)
    return round(255 * red), round(255 * green), round(255 * blue)


def render_gantt(timeline: TimelineView, *, width: int = 1200, row_height: int = 24) -> np.ndarray:
    """Render ``timeline`` as pixels.

    Args:
        timeline: The simulated timeline.
        width: Image width in pixels (at least 40).
        row_height: Pixel height of one stage row (at least 4).

    Returns:
        uint8 array of shape ``(2 * 6 + S * (row_height + 1) + 1, width, 3)`` for S
        stages.

    Raises:
        ValueError: If ``width`` or ``row_height`` is too small.
    """
    if width < 40 or row_height < 4:
        raise ValueError(f"width must be >= 40 and row_height >= 4, got {width}, {row_height}.")
    sched = timeline.schedule
    num = len(timeline.items)
    height = 2 * _MARGIN + num * (row_height + 1) + 1
    img = np.full((height, width, 3), _WHITE, np.uint8)
    left = _MARGIN + _SWATCH + 2
    plot_w = width - left - _MARGIN
    span = timeline.makespan or 1.0

    def x_of(t: float) -> int:
        return left + round(t / span * plot_w)

    top = _MARGIN
    for s in range(num + 1):  # row separators, including the frame's top and bottom
        img[top + s * (row_height + 1), left : left + plot_w + 1] = _GRID
    img[top : top + num * (row_height + 1) + 1, [left, left + plot_w]] = _GRID

    modules = sched.modules
    for s, row in enumerate(timeline.items):
        y0 = top + s * (row_height + 1) + 1
        y1 = y0 + row_height
        hue = _MODULE_HUES[modules.index(sched.stages[s].module) % len(_MODULE_HUES)]
        img[y0 + 1 : y1 - 1, _MARGIN : _MARGIN + _SWATCH] = _rgb(hue, 0.6, 0.75)
        pad = max(1, row_height // 8)
        for t in row:
            if t.duration <= 0:
                continue
            x0, x1 = x_of(t.start), max(x_of(t.end), x_of(t.start) + 1)
            colour = action_colour(t.action.kind, t.action.microbatch)
            img[y0 + pad : y1 - pad, x0:x1] = colour
            if x1 - x0 >= 3:  # a darker left edge separates back-to-back actions
                img[y0 + pad : y1 - pad, x0] = tuple(int(c * 0.6) for c in colour)

    for end in timeline.phase_ends[:-1]:
        img[top : top + num * (row_height + 1) + 1, min(x_of(end), width - 1)] = _BARRIER
    return img
