"""What a terminal shows: `status` tables, `status RUN`, `sites`, `init --list` and the `logs -f`
progress line, drawn with rich. Imported only when stdout is a terminal (piped output is text.py's
plain text, and rich is never loaded for it: `status | grep` starts as fast as before).

Tables fit the terminal's width: no cell wraps; at 80 columns the least needed columns go (SITE,
JOB, then USED, CHECKPOINT) and LAST METRIC is cut with an ellipsis; a run id is never cut. rich honours NO_COLOR (no colours, same layout).
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.style import Style
from rich.text import Text

# rich.table and rich.live load only for the views that use them (`status RUN`, `logs -f`):
# the list of runs is drawn without them, to start fast

from . import text as plain  # the plain text of the same views

STATE_STYLES = {"RUNNING": "green", "CHECKPOINTING": "cyan", "RESUBMITTED": "cyan", "PENDING": "yellow",
                "COMPLETED": "bold green", "COMPLETE": "bold green", "CONTINUE": "cyan", "FAILED": "bold red",
                "LOST": "red", "CANCELLED": "magenta", "STOPPED": "yellow", "QUEUED": "yellow", "SKIPPED": "dim",
                "UNNEEDED": "dim"}
# columns of the status table a narrow terminal leaves out, first to go first
NARROW_DROP = (("JOB", 0), ("SITE", 0))
VERY_NARROW_DROP = ("USED", "CHECKPOINT", "ETA")  # when even the whole RUN and a cut LAST METRIC do not fit


def console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def _table(headers: list[str], rows: list[list[str]], state_col: str | None = "STATE",
           shrink: tuple = ("RUN", "LAST METRIC"), fold: tuple = ()):
    """Columns two spaces apart, no borders: `shrink` columns give way (ellipsis) when the
    terminal is narrow, `fold` ones wrap, every other one keeps its full width."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold", expand=False)
    for i, h in enumerate(headers):
        natural = max([len(h), *(len(r[i]) for r in rows)])
        give = h in shrink or h in fold
        table.add_column(h, no_wrap=h not in fold, overflow="fold" if h in fold else "ellipsis",
                         min_width=min(natural, 8) if give else natural)
    for r in rows:
        cells = [Text(c, style=STATE_STYLES.get(c, "")) if h == state_col else Text(c) for h, c in zip(headers, r)]
        table.add_row(*cells)
    return table


def _narrow(headers: list[str], rows: list[list[str]], width: int) -> tuple[list[str], list[list[str]]]:
    """Leave out the least needed columns while the table would not fit `width` whole."""
    def need(cols):
        return sum(max([len(headers[i]), *(len(r[i]) for r in rows)]) for i in cols) + 2 * (len(cols) - 1)

    keep = list(range(len(headers)))
    for name, _ in NARROW_DROP:
        if need(keep) <= width:
            break
        keep = [i for i in keep if headers[i] != name]
    return [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]


def status_table(rows: list[dict], out: Console | None = None) -> None:
    """The runs, one line each, fitted to the terminal: the least needed columns left out, then
    LAST METRIC cut with an ellipsis. The id is never cut (every command needs it): when even the
    fewest columns do not fit beside it, each id gets a line of its own above its row. Laid out
    here and coloured with rich's styles (a rich Table costs ~1 ms a row: 1 s for 1,000 runs)."""
    out = out or console()
    headers, cells = _narrow(plain.HEADERS, [plain.table_row(r) for r in rows], out.width)
    while True:
        widths = _fit([max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)], headers,
                      out.width, shrink=("LAST METRIC",))
        spare = [h for h in VERY_NARROW_DROP if h in headers]
        if sum(widths) + 2 * (len(widths) - 1) <= out.width or not spare:
            break
        i = headers.index(spare[0])
        headers, cells = headers[:i] + headers[i + 1:], [r[:i] + r[i + 1:] for r in cells]
    id_lines = sum(widths) + 2 * (len(widths) - 1) > out.width
    if id_lines:  # the ids above their rows; the rest fitted without them
        headers, cells = headers[1:], [r[1:] for r in cells]
        widths = _fit([max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)], headers,
                      out.width - 2, shrink=("LAST METRIC",))
    colour = out.color_system is not None and not out.no_color
    bold = Style(bold=True)

    def paint(text: str, style: Style | None) -> str:
        return style.render(text, color_system=out.color_system) if style and out.color_system else text

    lead = "  " if id_lines else ""
    lines = [(paint("RUN", bold) if id_lines else "")] if id_lines else []
    lines.append(lead + "  ".join(paint(_cut(h, w).ljust(w), bold) for h, w in zip(headers, widths)).rstrip())
    state_at = headers.index("STATE")
    for row, r in zip(rows, cells):
        if id_lines:
            lines.append(row["id"])
        parts = []
        for i, (c, w) in enumerate(zip(r, widths)):
            cell = _cut(c, w).ljust(w)
            parts.append(paint(cell, _style(c) if i == state_at and colour else None))
        lines.append(lead + "  ".join(parts).rstrip())
    out.file.write("\n".join(lines) + "\n")
    out.file.flush()
    for r in rows:
        if r.get("note"):
            out.print(Text(f"{r['id']}: {r['note']}"))


def _style(state: str) -> Style | None:
    name = STATE_STYLES.get(state)
    return Style.parse(name) if name else None


def _fit(widths: list[int], headers: list[str], width: int, shrink: tuple, least: int = 10) -> list[int]:
    """Narrow the `shrink` columns, the widest first and none below `least`, until the row fits."""
    widths = list(widths)
    over = sum(widths) + 2 * (len(widths) - 1) - width
    cols = [headers.index(n) for n in shrink if n in headers]
    while over > 0:
        i = max(cols, key=lambda c: widths[c], default=None)
        if i is None or widths[i] <= least:
            break
        widths[i] -= 1
        over -= 1
    return widths


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)] + "\u2026"


def detail(run, state: dict, row: dict, out: Console | None = None) -> None:
    """`status RUN` on a terminal: the run's row, a sparkline of its headline metric, progress,
    cost and goodput, its segments and every path."""
    out = out or console()
    status_table([row], out)
    name, values = plain.headline_series(run)
    if values:
        spark = plain.sparkline(values, width=max(10, min(60, out.width - 40)))
        out.print(Text.assemble((f"{name} ", "bold"), (spark, "cyan"),
                                f" {values[0]:.3g} -> {values[-1]:.3g} over {len(values)} steps"))
    for label, text in plain.detail_sections(run, state, row):
        out.print(Text.assemble((f"{label}: ", "bold"), text))
    out.print()
    out.print(Text("segments", style="bold"))
    out.print(_table(plain.SEG_HEADERS, plain.segment_rows(state, row), shrink=("JOB", "START", "END")))
    from rich.table import Table

    paths = Table(box=None, show_header=False, pad_edge=False)
    paths.add_column(style="bold", no_wrap=True)
    paths.add_column(overflow="fold")
    for label, p in plain.detail_paths(run):
        paths.add_row(label, str(p))
    out.print(Text("paths", style="bold"))
    out.print(paths)


def plain_table(headers: list[str], rows: list[list[str]], fold: tuple = (), out: Console | None = None) -> None:
    """A table with no state column (sites, recipes); `fold` columns wrap instead of being cut."""
    (out or console()).print(_table(headers, rows, state_col=None, shrink=(), fold=fold))


# ---------------------------------------------------------------- logs -f


def progress_text(row: dict, width: int = 80) -> Text:
    """state, segment k/N, step/total, ETA, headline metric, run id: one line for under a streamed
    log, the most needed parts first and each only if it fits `width` whole (never cut)."""
    eta = row.get("eta") or {}
    total = eta.get("total_steps")
    parts = [(row["state"], STATE_STYLES.get(row["state"], "")), f"seg {row['segments']}/{row['segments_planned']}",
             f"step {plain._s(row['step'])}/{plain._s(total)}"]
    if plain.is_active_row(row):
        if eta.get("finish_time"):
            parts.append(f"ETA {time.strftime('%H:%M', time.localtime(eta['finish_time']))} "
                         f"({plain.duration(eta['eta_s'])})")
        else:
            parts.append("ETA ?")
    if row.get("metric") is not None:
        parts.append(f"{row['metric_name']} {row['metric']:.4g}")
    parts.append((row["id"], "bold"))
    kept, used = [], 0
    for p in parts:
        n = len(p[0] if isinstance(p, tuple) else p) + (2 if kept else 0)
        if used + n > width:
            continue
        kept += (["  "] if kept else []) + [p]
        used += n
    text = Text.assemble(*kept)
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


class _LiveWriter:
    """A file-like `out` for plain.follow that prints whole log lines above the live line."""

    def __init__(self, live):
        self.live = live

    def write(self, data: str) -> None:
        self.live.console.print(Text(data.rstrip("\n")), soft_wrap=True, highlight=False, markup=False)

    def flush(self) -> None:
        pass


def follow_with_progress(run, index: int, poll_s: float = 0.5) -> None:
    """`logs -f` on a terminal: the log streamed, the progress line kept under it."""
    from rich.live import Live

    out = console()

    def line():
        return progress_text(plain.summary(run, run.state()), out.width)

    with Live(line(), console=out, refresh_per_second=4, transient=False, redirect_stdout=False,
              redirect_stderr=False) as live:
        def tick():
            live.update(line())

        plain.follow(run, index, _LiveWriter(live), follow_on=True, poll_s=poll_s, on_tick=tick)
        tick()


def is_terminal() -> bool:
    return sys.stdout.isatty()


# ---------------------------------------------------------------- samples


SAMPLE_STYLES = {"head": "bold", "score": "cyan", "role": "dim", "prompt": "dim", "response": ""}


def samples(chosen: list[dict], head: str, out: Console | None = None) -> None:
    """`hpcrl samples` on a terminal: status/samples.py's lines (wrapped to the terminal's width,
    at least 40), styled by kind."""
    from . import samples as view

    out = out or console()
    out.print(Text(head, style="bold"))
    for line, kind in view.lines(chosen, out.width):
        t = Text(line, style=SAMPLE_STYLES.get(kind, ""))
        t.no_wrap = True
        out.print(t)
