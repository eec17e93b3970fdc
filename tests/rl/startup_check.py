"""Run under torchrun (tests/rl/test_dist.py, scripts/bench_startup.py): what an fsdp rank holds
at start-up. argv: MODEL_DIR MODE, MODE "meta" (fsdp.load_sharded, the trainer's path, model and
KL reference) or "full" (the path before issue 19: every rank loads the whole model, deep-copies
it for the reference, then shards both). Prints one line per rank: its peak RSS growth over the
start-up (VmHWM, reset just before), the model's float32 bytes, and, for "meta", whether every
shard equals its rows of the weights on disk."""

import copy
import sys

import torch

from hpcrl.rl import dist as rl_dist
from hpcrl.rl import fsdp, policy


def status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> int:
    d = rl_dist.Dist.from_env({"dist_timeout_s": 120, "device": "cpu"})
    model_dir, mode = sys.argv[1], sys.argv[2]
    cpu = torch.device("cpu")
    fsdp.build_on_meta(model_dir)  # the modelling code imported (~100 MB, either mode) before the peak is reset
    d.barrier()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now: the peak of what follows
        f.write("5")
    rss0 = status_kb("VmRSS")
    if mode == "meta":
        model = fsdp.load_sharded(model_dir, cpu, d.rank, d.world)
        ref = fsdp.load_sharded(model_dir, cpu, d.rank, d.world)
    else:
        model, _ = policy.load_policy(model_dir, cpu)
        ref = copy.deepcopy(model)
        fsdp.shard(model)
        fsdp.shard(ref)
    peak_mb = (status_kb("VmHWM") - rss0) / 1024
    full_mb = sum(p.numel() * 4 for p in model.parameters()) / 2 ** 20
    differ = []
    if mode == "meta":
        from safetensors.torch import load_file

        on_disk = load_file(f"{model_dir}/model.safetensors")
        tied = fsdp._tied_names(model)
        for m in (model, ref):
            for name, p in m.named_parameters():
                want = on_disk.get(name, on_disk.get(tied.get(name)))
                start, stop = fsdp._rows(p, d.rank, d.world)
                if not torch.equal(p.to_local(), want[start:stop].float()):
                    differ.append(name)
    d.barrier()
    print(f"rank {d.rank}: mode {mode} peak {peak_mb:.1f} MB model {full_mb:.1f} MB; {len(differ)} differ {differ[:3]}",
          flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    # as the trainer leaves (hpcrl.rl.train.leave): gloo's threads can abort a rank at the
    # interpreter's teardown ("terminate called without an active exception"; seen in a full run)
    from hpcrl.rl.train import leave

    leave(main())
