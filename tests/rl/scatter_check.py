"""Run under torchrun (tests/rl/test_dist.py): an fsdp model and AdamW after one step, their
checkpoint parts in memory (fsdp.owned_part, with full_tensor taken away: each tensor goes to its
owner alone; rank r's part standing in for the share rank r
reads), loaded by fsdp.scatter_share into a fresh sharded model and optimizer: every rank's
shards and optimizer state must equal the original's bit for bit. argv[1]: a tiny model's
directory."""

import copy
import sys

import torch

from hpcrl.rl import dist as rl_dist
from hpcrl.rl import fsdp, policy


def trained(model_dir, seed):
    torch.manual_seed(seed)
    model, _ = policy.load_policy(model_dir, torch.device("cpu"))
    ref = copy.deepcopy(model)
    fsdp.shard(model)
    fsdp.shard(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[seed, 2, 3, 4]])).logits.pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        for p in ref.parameters():
            p.to_local().add_(seed)
    return model, ref, opt


def main() -> int:
    d = rl_dist.Dist.from_env({"dist_timeout_s": 60})
    model_dir = sys.argv[1]
    model, ref, opt = trained(model_dir, 1)
    from torch.distributed.tensor import DTensor

    full_tensor = DTensor.full_tensor
    DTensor.full_tensor = None  # a save gathers each tensor to its owner only: no all-gather of everything
    try:
        part, _ = fsdp.owned_part(model, opt, d.rank, d.world, ref)
    finally:
        DTensor.full_tensor = full_tensor
    held = sum(t.numel() for t in part["model"].values())
    total = sum(p.numel() for p in model.parameters())
    print(f"rank {d.rank}: holds {held} of {total} model values after owned_part", flush=True)
    fresh, fresh_ref, fresh_opt = trained(model_dir, 5)  # other weights and state everywhere
    fsdp.scatter_share(fresh, fresh_opt, d, part["model"], part["optimizer"], [part["meta"]], part["ref"],
                       ref=fresh_ref)
    bad = []
    for (name, a), (_, b) in zip(list(model.state_dict().items()) + list(ref.state_dict().items()),
                                 list(fresh.state_dict().items()) + list(fresh_ref.state_dict().items())):
        if not torch.equal(getattr(a, "to_local", lambda: a)(), getattr(b, "to_local", lambda: b)()):
            bad.append(name)
    want, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for i, per in want.items():
        for k, v in per.items():
            w, g = getattr(v, "to_local", lambda: v)(), getattr(got[i][k], "to_local", lambda: got[i][k])()
            if not torch.equal(w, g):
                bad.append(f"optimizer {i}.{k}")
    print(f"rank {d.rank}: {len(bad)} differ: {bad[:5]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    # as the trainer leaves (hpcrl.rl.train.leave): gloo's threads can abort a rank at the
    # interpreter's teardown ("terminate called without an active exception"; seen in a full run)
    from hpcrl.rl.train import leave

    leave(main())
