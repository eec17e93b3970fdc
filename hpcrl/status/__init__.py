"""What `status`, `logs`, `metrics` and `plot` show of a run, one component:

- `text`: the plain text (piped output, `--json` rows, `logs`), and the finished-run cache;
- `terminal`: the same views on a terminal, drawn with rich (imported only for a terminal);
- `eta`: pure projections: finish time, segments left, cost, goodput, replay, work at risk;
- `metrics`: a run's metrics.jsonl across its segments, per-segment timing, `hpcrl metrics`;
- `plot`: `hpcrl plot` (matplotlib).

It reads run directories and never reconciles (that is hpcrl/control.py's, done before).
This file imports nothing.
"""
