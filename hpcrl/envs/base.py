"""The environment interface (hpcrl/envs/__init__.py says what an environment is). Stdlib only."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Turn:
    """The environment's answer to one episode's turn."""

    messages: list | None                        # the next messages ({role, content}); None: done
    terms: dict = field(default_factory=dict)    # reward terms earned by this turn (name -> float)
    info: dict = field(default_factory=dict)     # kept with the sample: reason, extras


class Environment:
    """The base of every environment: one row -> its prompt, then one turn scored and done.

    Subclasses override `step` (and `reset` when the first messages are not the row's prompt).
    `self.score(rows, texts)` is the run's reward (args.reward) over a batch of rows (episodes'
    rows, in `self.rows` after reset) and answers: (values, metrics, details), details each
    sample's terms, reason and extras. `whole_batch=True` (the one-turn environment only): every
    rank scores its whole share at once, so a reward model's batch normalisation is global.
    """

    name = "one-turn"
    multi_turn = False  # True: the trainer may give an episode more than one turn

    def __init__(self, cfg, score):
        self.cfg, self.score = cfg, score
        self.rows: list = []
        self.metrics: dict = {}   # the last step's figures, logged with the step (reward/*, env/*)

    def reset(self, rows: list, group_size: int) -> list:
        """Start group_size episodes per row; returns each row's first messages (its group's)."""
        self.rows = [r for r in rows for _ in range(group_size)]
        return [r["messages"] for r in rows]

    def check(self, rows: list) -> None:
        """Raise ValueError (one line) for a training row this environment cannot run: at the start."""

    def step(self, responses: list, final: list) -> list:
        """One Turn per episode for its last turn's text (None: the episode is already done)."""
        raise NotImplementedError


def sequence_tokens(cfg) -> int:
    """The most tokens after a prompt in one row of the batch: max_response_length for one turn;
    a multi-turn environment's episode (its turns and the environment's messages) takes up to
    env_max_tokens. What vLLM's context and the memory estimate must hold."""
    if cfg.get("env", "one-turn") == "one-turn":
        return int(cfg["max_response_length"])
    return max(int(cfg["max_response_length"]), int(cfg.get("env_max_tokens") or 0))


