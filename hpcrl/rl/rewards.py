"""Moved to hpcrl/rewards/score.py (issue 40). This name stays because specs, runs and reward
files made before the move name it: `args.reward: hpcrl.rl.rewards:compute_score`,
`from hpcrl.rl import rewards`, and verl's `reward.custom_reward_function.path=<...>/hpcrl/rl/rewards.py`
(loaded by path: no package, so the file is found beside this one). Stdlib only, as score.py is."""

if __package__:
    import sys

    from ..rewards import score as _moved

    sys.modules[__name__] = _moved  # one module under both names: a monkeypatch or a cache is shared
else:
    import importlib.util as _util
    import os as _os

    _path = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "rewards", "score.py")
    _spec = _util.spec_from_file_location("hpcrl_moved_rewards_score", _path)
    _moved = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_moved)
    globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
