"""A `Timeline` as a Chrome trace (JSON), the format Perfetto and ``chrome://tracing`` open.

The PNG Gantt chart (`Timeline.to_png`) is for a glance and has no text; this is the
same timeline to zoom and click through: one track per stage named after its module and
stage (``llm s1``), one slice per action (``F mb2``, ``B mb0``, ``SEND_F mb1 -> 2`` with
the peer's stage id) with microbatch and phase as arguments, and a marker at each
phase's end.
Standard library only: a JSON object with ``traceEvents`` (times in microseconds).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from .timed import TimelineView


def chrome_trace(timeline: TimelineView, *, seconds: float = 1.0) -> dict[str, Any]:
    """The trace events of ``timeline``; ``seconds``: what one time unit of it lasts."""
    us = 1e6 * seconds
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "hetjax schedule"}}
    ]
    for info in timeline.schedule.stages:
        name = f"{info.module} s{info.index}"
        events.append(
            {"ph": "M", "pid": 0, "tid": info.stage, "name": "thread_name", "args": {"name": name}}
        )
        events.append(
            {
                "ph": "M",
                "pid": 0,
                "tid": info.stage,
                "name": "thread_sort_index",
                "args": {"sort_index": info.stage},
            }
        )
    for row in timeline.items:
        for t in row:
            a = t.action
            label = f"{a.kind} mb{a.microbatch}"
            if a.edge is not None:
                peer = a.edge.dst_stage if a.edge.src_stage == a.stage else a.edge.src_stage
                label += f" {'->' if a.kind.startswith('SEND') else '<-'} {peer}"
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": a.stage,
                    "name": label,
                    "cat": a.kind,
                    "ts": t.start * us,
                    "dur": t.duration * us,
                    "args": {"microbatch": a.microbatch, "phase": a.phase},
                }
            )
    for phase, end in zip(timeline.schedule.phases, timeline.phase_ends, strict=True):
        events.append({"ph": "i", "pid": 0, "s": "p", "name": f"end of {phase}", "ts": end * us})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    timeline: TimelineView, path: str | pathlib.Path, *, seconds: float = 1.0
) -> pathlib.Path:
    """Writes :func:`chrome_trace` of ``timeline`` to ``path``; returns the path."""
    path = pathlib.Path(path)
    path.write_text(json.dumps(chrome_trace(timeline, seconds=seconds)), encoding="utf-8")
    return path
