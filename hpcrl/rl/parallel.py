"""How the trainer's model is spread over the ranks, decided in one place (`parallelize`).

Three layouts, one class each; the trainer calls the same methods whatever the layout:

- `Single`: one process (also ddp or fsdp on one rank: nothing to shard or reduce);
- `Replicated` (`args.parallel: ddp`): every rank holds the whole model; gradients are summed
  over the ranks (dist.all_reduce_grads); rank 0 writes the checkpoints, a resume reads a share
  of the files on each rank and broadcasts it;
- `Sharded` (`args.parallel: fsdp`, FSDP2, see fsdp.py): a rank holds 1/world of the weights,
  gradients and AdamW state; the model is built on meta and each rank reads its own rows; the
  weights are gathered for the phases without gradients (generation, old log-probs); every
  rank writes the tensors it owns.

What differs between them is here (loading, the compute dtype's context, gathering, the loss
scale, the gradient reduction, the forward/backward count, copying weights, saving, restoring);
the collectives that are the identity on one process (dist.sum, dist.gather, ...) are not.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ..checkpoints.trainer import checkpointer as checkpoint
from . import fsdp, policy


class SaveFailed(RuntimeError):
    """Rank 0 could not write a checkpoint (the reason is printed there); every rank stops."""


def of(dist, sharded: bool) -> "Single":
    """The layout of `dist`'s ranks: sharded (fsdp) or replicated (ddp) when there are several."""
    if not dist.enabled:
        return Single(dist)
    return Sharded(dist) if sharded else Replicated(dist)


def parallelize(cfg, dist, device, model_dir, say):
    """(layout, policy, KL reference or None, tokenizer), the models loaded as the layout holds them."""
    par = of(dist, cfg.parallel == "fsdp")
    model, tok = par.load(model_dir, device, cfg.dtype)
    ref = par.reference(model, model_dir, device, cfg.dtype) if cfg.beta > 0 else None
    note = par.describe(model, ref)
    if note:
        say(note)
    return par, model, ref, tok


def collective(dist, fn, every_rank: bool = False) -> None:
    """Run fn on rank 0 (the checkpoint writer; every_rank: on each, as writers of parts) and
    tell every rank whether it worked, so a failed save stops them all at once instead of
    leaving them waiting for rank 0."""
    error = None
    if dist.is_main or every_rank:
        try:
            fn()
        except Exception as e:  # reported below, on rank 0, after the others know
            error = e
    failed = dist.max([float(error is not None)])[0]
    if error is not None:
        raise error
    if failed:
        raise SaveFailed("another rank failed to write its part of a checkpoint" if every_rank
                         else "rank 0 failed to write a checkpoint")


class Single:
    """One process: the whole model, plain autocast, nothing to gather or reduce."""

    sharded = False

    def __init__(self, dist):
        self.dist = dist

    @property
    def loss_scale(self) -> float:
        return 1.0

    @property
    def state_ranks(self) -> int:
        """The ranks the weights and optimizer state are divided over (memory.state_bytes)."""
        return 1

    def load(self, model_dir, device, dtype: str):
        return policy.load_policy(model_dir, device)

    def reference(self, model, model_dir, device, dtype: str):
        ref = copy.deepcopy(model).eval()  # forward only, no optimizer state
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def describe(self, model, ref) -> str | None:
        return None

    def compute(self, device, dtype: str):
        """The forward passes' dtype: autocast over the float32 masters."""
        return policy.autocast(device, dtype)

    def gathered(self, model):
        """The whole weights for a phase of forwards without a collective each (none to gather)."""
        return contextlib.nullcontext()

    def reduce_grads(self, params) -> None:
        self.dist.all_reduce_grads(params)

    def passes(self, n: int) -> int:
        """The forward/backward passes this rank runs for its own n."""
        return n

    def same_path(self, mine: bool) -> bool:
        """Whether every rank takes a forward's two-pass form (a group's prompt once): this rank's
        own choice where a forward has no collective."""
        return mine

    def copy_weights(self, src, dst) -> None:
        dst.load_state_dict(src.state_dict())

    def reload_base(self, model, ref, model_dir, device, dtype: str) -> None:
        """The base weights read again into the policy (and the reference)."""
        base, _ = policy.load_policy(model_dir, device)
        model.load_state_dict(base.state_dict())
        if ref is not None:
            ref.load_state_dict(base.state_dict())

    def wait(self, ckpt) -> None:
        """The last save sealed (each rank writes under fsdp)."""
        collective(self.dist, ckpt.wait, every_rank=True)

    def save(self, ckpt, step: int, model, optimizer, state: dict, ref, background, timeout_s: float) -> None:
        # replicated state: rank 0's copy is every rank's, so rank 0 writes it alone
        collective(self.dist, lambda: ckpt.save_now(step, model, optimizer, state, ref, background))

    def restore(self, ckpt, model, optimizer, ref):
        """(path, trainer state) of the newest intact checkpoint read into the models; (None, a
        truthy state) when a damaged one was partly read in, (None, falsy) when there was none."""
        _, path, state = ckpt.restore(model, optimizer, ref)
        return path, state


class Replicated(Single):
    """ddp: every rank the whole model; gradients summed; rank 0 writes."""

    def restore(self, ckpt, model, optimizer, ref):
        # each rank reads a share of the files and sends what it read to the others (whole
        # tensors, broadcast; fsdp: its shards), once every rank found the same newest
        # checkpoint intact (else RanksDisagree on every rank, in one line)
        dist = self.dist
        _, path, share = checkpoint.restore_share(ckpt, dist.rank, dist.world, dist.gather, ref=ref is not None)
        state = False  # nothing is read into the model before every rank's share is intact
        if path is not None:
            fsdp.scatter_share(model, optimizer, dist, *share, ref=ref)
            state = checkpoint.load_common(path)
        return path, state


class Sharded(Replicated):
    """fsdp: no rank ever holds the whole model (nor the reference): built on meta, sharded, read."""

    sharded = True

    @property
    def loss_scale(self) -> float:
        # FSDP's reduce-scatter averages over the ranks; the loop's weights make a global mean
        # that the ddp path sums, so fsdp multiplies the loss back by the world size
        return float(self.dist.world)

    @property
    def state_ranks(self) -> int:
        return self.dist.world

    def _load_sharded(self, model_dir, device, dtype: str):
        return fsdp.load_sharded(model_dir, device, self.dist.rank, self.dist.world, dtype)

    def load(self, model_dir, device, dtype: str):
        model = self._load_sharded(model_dir, device, dtype)
        tok = policy.load_tokenizer(model_dir)
        model.generation_config.pad_token_id = tok.pad_token_id  # as load_policy sets it
        return model, tok

    def reference(self, model, model_dir, device, dtype: str):
        return self._load_sharded(model_dir, device, dtype).eval().requires_grad_(False)

    def describe(self, model, ref) -> str:
        held = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        of_ref = "" if ref is None else f", {sum(p.to_local().numel() for p in ref.parameters())} of the reference's"
        return (f"fsdp: {len(fsdp.fsdp_modules(model))} modules sharded over {self.dist.world} ranks; "
                f"rank 0 holds {held} of {total} parameters{of_ref}")

    def compute(self, device, dtype: str):
        return policy.autocast(device, "float32")  # FSDP's mp_policy casts to the compute dtype

    def gathered(self, model):
        return fsdp.gathered(model, True)

    def reduce_grads(self, params) -> None:
        pass  # the backward itself reduce-scattered them

    def passes(self, n: int) -> int:
        # every forward/backward is a collective: each rank runs the most any rank has
        return max(1, int(self.dist.max([n])[0]))

    def same_path(self, mine: bool) -> bool:
        # a forward's all-gathers are collectives: the shared-prompt form runs the model twice, the
        # plain form once, so every rank takes the plain one unless all share (a micro-batch's rows
        # form whole groups on one rank and not on another: cut from a shuffled mini-batch, or a
        # rank's one-row stand-in when it has none left). Ranks that parted here hung.
        return not self.dist.max([0.0 if mine else 1.0])[0]

    def copy_weights(self, src, dst) -> None:
        fsdp.copy_shards(src, dst)

    def reload_base(self, model, ref, model_dir, device, dtype: str) -> None:
        with torch.no_grad():  # each rank reads its rows of the base weights again
            fsdp.copy_shards(self._load_sharded(model_dir, device, dtype), model)
            if ref is not None:
                fsdp.copy_shards(self._load_sharded(model_dir, device, dtype), ref)

    def save(self, ckpt, step: int, model, optimizer, state: dict, ref, background, timeout_s: float) -> None:
        """Every rank writes the whole tensors it owns (parts.py); the gathering is the snapshot,
        the writing may go on in the background."""
        dist = self.dist
        self.wait(ckpt)  # the last save is sealed; its buffers free
        part, index = fsdp.owned_part(model, optimizer, dist.rank, dist.world, ref)
        made = {}
        collective(dist, lambda: made.update(tmp=str(ckpt.store.new_tmp_dir())))
        tmp = dist.gather(made.get("tmp"))[0]  # rank 0's directory, for every rank to write into
        common = None
        if dist.is_main:  # the reference's tensors are in the parts, like the model's
            common = {"ref": None, "rng": checkpoint.rng_state(), "state": state, "config": model.config,
                      "index": index}
        collective(dist, lambda: ckpt.save_part(step, tmp, part, dist.rank, dist.world, common, background,
                                                wait_s=timeout_s), every_rank=True)
