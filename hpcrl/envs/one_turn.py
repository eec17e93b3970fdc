"""The one-turn environment: the row's prompt, one response, scored by args.reward, done.

The trainer before environments existed, as an environment: the reward is called with the rows and
the responses exactly as it was (verl's compute_score(data_source, solution_str, ground_truth,
extra_info) per sample), over the rank's whole share of the batch (a reward model's `batch`
normalisation then spans the global batch), and the episode's one term is its reward.
"""

from __future__ import annotations

from .base import Environment, Turn


class OneTurn(Environment):
    name = "one-turn"

    def step(self, responses: list, final: list) -> list:
        values, self.metrics, details = self.score(self.rows, list(responses), whole_batch=True)
        return [Turn(None, {"reward": v}, d) for v, d in zip(values, details)]
