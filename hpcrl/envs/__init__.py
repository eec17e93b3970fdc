"""Environments: what answers the model during an episode, and what the episode earns. Stdlib only.

The agent is the policy (the model); its action is one turn, the text it samples; the environment
reads the turn and either ends the episode or answers with the next messages (a user's or a
tool's); the reward is the sum of the reward terms the environment gave over the episode. One
interface, over a batch of episodes at a time (so a sandbox can run a batch at once):

    reset(rows)               -> the first messages of each row's episodes (the row's prompt)
    step(responses, final)    -> one Turn per episode: its next messages (None: done) and terms

`responses[i]` is episode i's last turn as text (None for an episode already done); `final[i]`
says the trainer gives it no further turn (its turn or token budget is spent): the environment
scores it now and ends it. The trainer owns the budgets (args.env_max_turns, env_max_tokens),
the tokens (the model's as sampled, the environment's tokenised with the chat template and kept
out of the loss: hpcrl/rl/episodes.py) and the advantages (GRPO's, over whole episodes).

The reward function keeps verl's signature, for one turn and for many:

    compute_score(data_source, solution_str, ground_truth, extra_info=None)

An environment scores through `args.reward` (hpcrl/rewards/mix.py) with `score(rows, texts)`:
the one-turn environment passes the row and the response exactly as the trainer always has; a
multi-turn one passes the final answer, the ground truth it chooses (code-repair: the held-out
tests) and the row's extra_info plus `turns` and `messages` (the conversation after the prompt).

    one-turn      the prompt, one response, the reward (the trainer's behaviour before issue 42)
    code-repair   failing visible tests go back as the next turn, up to K turns; the reward runs
                  held-out tests the model never saw (hpcrl/envs/code_repair.py)
    module:Class or /file.py:Class   your own (docs/adapt.md)
"""

from __future__ import annotations

from ..rewards.score import import_target
from .base import Environment, Turn, sequence_tokens  # noqa: F401  (the interface, by its package's name)


def load(cfg, score) -> Environment:
    """The environment args.env names: one-turn | code-repair | module:Class | /file.py:Class."""
    from .code_repair import CodeRepair
    from .one_turn import OneTurn

    spec = cfg["env"]
    builtin = {"one-turn": OneTurn, "code-repair": CodeRepair}
    if spec in builtin:
        return builtin[spec](cfg, score)
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"args.env: {spec!r} is not one of {sorted(builtin)} nor module:Class or /file.py:Class")
    try:
        module = import_target(target, "env")
    except FileNotFoundError as e:
        raise ValueError(f"args.env: {e.filename} does not exist") from None
    except ImportError as e:  # one line at the start, not the reward's message train.py gives an ImportError
        raise ValueError(f"args.env: cannot import {target!r} ({e}); install it into the trainer's environment")
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"args.env: {spec!r} is not a subclass of hpcrl.envs.Environment")
    return cls(cfg, score)
