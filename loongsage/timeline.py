"""Where time goes: per-track intervals (generate, train, weight sync) saved as a Chrome/Perfetto
trace (`timeline.json`, open in ui.perfetto.dev or chrome://tracing) and rendered as a PNG in which
idle bubbles are the gaps in each row."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

TRACKS = ["start-up", "engines: generate", "trainer: train", "weight sync", "controller: wait for batch", "eval"]


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, str, float, float]] = []  # track, name, start s, end s
        self.counters: list[tuple[str, float, dict[str, float]]] = []  # name, time s, values

    def count(self, name: str, values: dict[str, float]) -> None:
        """A counter sample now (Perfetto draws each name as a stacked track): e.g. the engines' time
        split of the step that just ended."""
        if values:
            self.counters.append((name, time.perf_counter() - self.t0, values))

    def add(self, track: str, name: str, start: float, end: float) -> None:
        self.events.append((track, name, start - self.t0, end - self.t0))

    @contextmanager
    def span(self, track: str, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(track, name, start, time.perf_counter())

    def save(self, path: str | Path) -> Path:
        tracks = sorted({e[0] for e in self.events}, key=lambda t: TRACKS.index(t) if t in TRACKS else 99)
        tid = {t: i + 1 for i, t in enumerate(tracks)}
        trace = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid[t], "args": {"name": t}} for t in tracks]
        trace += [{"name": name, "ph": "X", "pid": 1, "tid": tid[track], "ts": round(s * 1e6),
                   "dur": round((e - s) * 1e6)} for track, name, s, e in self.events]
        trace += [{"name": name, "ph": "C", "pid": 1, "ts": round(t * 1e6), "args": values}
                  for name, t, values in self.counters]
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
        return path


def render_timeline(run_dir: str | Path, out: str | Path | None = None, last_s: float | None = 30.0) -> Path:
    """PNG of the trace's last `last_s` seconds (all of it when None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "timeline.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no timeline (is {run_dir} a run directory of loongsage train?)")
    trace = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    spans = [e for e in trace if e["ph"] == "X"]
    end = max(e["ts"] + e["dur"] for e in spans) / 1e6
    start = max(0.0, end - last_s) if last_s else 0.0
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(names) + 1.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (tid, _) in enumerate(sorted(names.items())):
        bars = [(e["ts"] / 1e6, e["dur"] / 1e6) for e in spans if e["tid"] == tid and (e["ts"] + e["dur"]) / 1e6 >= start]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[row % len(colors)])
        busy = sum(min(d, s + d - start) for s, d in bars)
        ax.text(end, row, f" {100 * busy / max(end - start, 1e-9):.0f}% busy", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), [names[t] for t in sorted(names)])
    ax.set_xlim(start, end + 0.12 * (end - start))
    ax.set_xlabel("seconds since the run started (gaps are idle time)")
    ax.set_title(f"{run_dir}: last {end - start:.0f}s")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "timeline.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
