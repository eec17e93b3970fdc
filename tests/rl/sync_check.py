"""Run under torchrun (tests/rl/test_dist.py): the vLLM weight sync's memory on fsdp ranks.

An fsdp model after a backward and an AdamW step (its gradients still held), synced by the
trainer's own RLTrainer._sync_rollout into an ENGINE TEST DOUBLE (no vLLM in this venv): it
copies each tensor it is handed into its own buffers, as vLLM's in-place reload does, and tracks
the bytes the sync holds beyond the model state: the tensors it was handed that are still alive
(weakref finalizers) plus the gradients not yet freed. Prints "rank R: peak P largest L" (bytes;
L: the largest tensor in bfloat16). argv[1]: a tiny model's directory."""

import sys
import types
import weakref

import torch

from hpcrl.rl import config
from hpcrl.rl import dist as rl_dist
from hpcrl.rl import fsdp, policy
from hpcrl.rl.loop import RLTrainer


class EngineDouble:
    """Test double of VllmRollout.sync_weights: copies, never keeps a handed tensor."""

    def __init__(self, model, grads_alive):
        self.buffers = {n: torch.empty(p.shape, dtype=torch.bfloat16) for n, p in model.named_parameters()}
        self.alive, self.peak, self.grads_alive = 0, 0, grads_alive

    def _gone(self, n):
        self.alive -= n

    def sync_weights(self, weights):
        if hasattr(weights, "state_dict"):
            weights = weights.state_dict().items()
        for name, t in weights:
            n = t.numel() * t.element_size()
            self.alive += n
            weakref.finalize(t, self._gone, n)
            self.peak = max(self.peak, self.alive + self.grads_alive())
            if name in self.buffers:
                self.buffers[name].copy_(t)
            del t


def main() -> int:
    d = rl_dist.Dist.from_env({"dist_timeout_s": 60})
    torch.manual_seed(0)
    model, _ = policy.load_policy(sys.argv[1], torch.device("cpu"))
    fsdp.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.pow(2).mean().backward()
    opt.step()

    def grads_alive():
        return sum(p.grad.to_local().numel() * 4 for p in model.parameters() if p.grad is not None)

    engine = EngineDouble(model, grads_alive)
    cfg = config.resolve({"rollout": "vllm", "dtype": "bfloat16"})
    trainer = types.SimpleNamespace(cfg=cfg, fsdp=True, model=model,
                                    optimizer=opt, rollout=engine)
    RLTrainer._sync_rollout(trainer)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    bad = [n for n, b in engine.buffers.items() if not torch.equal(b, full[n].to(torch.bfloat16))]
    largest = max(p.numel() for p in model.parameters()) * 2
    print(f"rank {d.rank}: peak {engine.peak} largest {largest} wrong {len(bad)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
