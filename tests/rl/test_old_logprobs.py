"""The old policy's log-probs (issue 19, item 3): with several updates per rollout the PPO/GSPO
ratio's denominator comes from the trainer's own forward, not from the sampler, whose kernels
(vLLM's, another dtype's) differ from the trainer's; the sampler's are only logged as
rollout/logp_mismatch."""

import subprocess
import sys

from hpcrl import protocol

from helpers import read_metrics
from rl_helpers import HOOKED, trainer_env, write_config

SHIFT = 0.5  # the test double's sampler reports log-probs this far above the policy's


def test_ratio_uses_the_trainers_forward_and_the_sampler_mismatch_is_logged(tmp_path):
    """A sampler whose log-probs are 0.5 above the policy's (hooked_train.py's test double): were
    they the ratio's denominator, every ratio would start at exp(-0.5) = 0.61 and be clipped; it
    stays near 1 (the policy moves a little over the mini-batches), and the 0.5 is the logged
    mismatch."""
    run_dir = tmp_path / "run"
    write_config(run_dir, sft_steps=0, total_steps=3, eval_before=False, eval_after=False, save_every=0,
                 reward="countdown + 0.1*length", length_norm_chars=10)
    proc = subprocess.run([sys.executable, str(HOOKED), f"--sampler-logp-shift={SHIFT}", "--config",
                           str(run_dir / "trainer.json")], cwd=run_dir, env=trainer_env(run_dir),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == protocol.EXIT_COMPLETE, proc.stderr[-3000:]
    train = [r for r in read_metrics(run_dir) if r.get("phase") == "train"]
    assert len(train) == 3
    for r in train:
        assert abs(r["rollout/logp_mismatch"] - SHIFT) < 1e-3, r
        assert 0.9 < r["ratio_mean"] < 1.1, r
