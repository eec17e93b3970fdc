"""FSDP2 (torch.distributed.fsdp.fully_shard) for `args.parallel: fsdp` on more than one rank.

Each decoder layer and the root are sharded: a rank keeps 1/world of the weights, gradients
and AdamW state between phases. What the loop relies on:

- gradients are reduce-scattered by FSDP itself, which averages over the ranks; the loop's loss
  is already normalised over the global mini-batch (as on the ddp path, which sums), so it is
  multiplied by the world size before backward (LOSS_SCALE). A divide factor of 1 would say the
  same, but it needs ReduceOp.PREMUL_SUM, which gloo does not have;
- every rank must run the same forward/backward calls in training (each is a collective), so
  the loop pads a rank's micro-batches with zero-weighted dummies;
- rollout, evaluation and no-grad log-prob passes run inside `gathered()`: every module is
  unsharded once and stays so for the phase, so ranks may run different numbers of forwards
  (generation needs no collective per token) and the stop check inside them still works;
- checkpoints hold the full (unsharded) state in the ddp/1-rank format, gathered to rank 0, so
  a run moves between world sizes and between ddp and fsdp at any checkpoint.
"""

from __future__ import annotations

import contextlib

import torch


def _api():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def shard(model) -> None:
    """fully_shard every decoder layer, then the root (embeddings, final norm, LM head)."""
    FSDPModule, fully_shard = _api()
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def _decoder_layers(model):
    """The HF model's list of decoder layers (model.model.layers for Llama/Qwen2/Mistral...)."""
    for owner in (getattr(model, "model", None), getattr(getattr(model, "model", None), "decoder", None),
                  getattr(model, "transformer", None)):
        for name in ("layers", "h"):
            layers = getattr(owner, name, None) if owner is not None else None
            if isinstance(layers, torch.nn.ModuleList) and len(layers):
                return list(layers)
    raise ValueError(f"args.parallel: fsdp: cannot find the decoder layers of {type(model).__name__}")


def fsdp_modules(model) -> list:
    FSDPModule, _ = _api()
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model, enabled: bool = True):
    """Every FSDP module unsharded (one all-gather each) for the whole block, resharded after."""
    if not enabled:
        yield
        return
    mods = fsdp_modules(model)
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    for m in mods:
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
        for m in mods:
            # the root's own default is False (its parameters are needed at once by backward)
            m.set_reshard_after_forward(m is not model, recurse=False)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def full_model_state(model, cpu_offload: bool = True) -> dict:
    """The unsharded state_dict (a collective). cpu_offload: on rank 0 only, in CPU memory (the
    other ranks get {}); else on every rank, on the model's device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=cpu_offload))


def full_optimizer_state(model, optimizer) -> dict:
    """The unsharded optimizer state on rank 0 ({} elsewhere; a collective), keyed by parameter
    index as torch.optim.Optimizer.state_dict() is, so the file is the ddp/1-rank one."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))
    if not osd:
        return {}
    index = {fqn: i for i, fqn in enumerate(fqn for g in osd["param_groups"] for fqn in g["params"])}
    groups, start = [], 0
    for g in osd["param_groups"]:
        groups.append({**g, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return {"state": {index[fqn]: s for fqn, s in osd["state"].items()}, "param_groups": groups}


def load_full(model, optimizer, model_sd: dict, optim_sd: dict | None) -> None:
    """Shard a full state (every rank holds it: each read the checkpoint) into model/optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, model_sd, options=_options(full_state_dict=True))
    if optim_sd is None:
        return
    fqns = [name for name, _ in model.named_parameters()]
    state = {fqns[int(i)]: s for i, s in optim_sd["state"].items()}
    groups = [{**g, "params": [fqns[int(i)] for i in g["params"]]} for g in optim_sd["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                             options=_options(full_state_dict=True))


class FullModel:
    """What checkpoint.snapshot reads from a model: the gathered state_dict and the HF config."""

    def __init__(self, state: dict, config):
        self._state, self.config = state, config

    def state_dict(self):
        return self._state


class FullOptimizer:
    def __init__(self, state: dict):
        self._state = state

    def state_dict(self):
        return self._state


class Loading:
    """Targets checkpoint.load_into fills in place: CPU tensors of the full shapes. The real
    model is only touched by commit(), after every file has passed its digest."""

    def __init__(self, model):
        self._model = model
        self.config = model.config
        self._sd = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
        self.optim_sd = None

    def state_dict(self):
        return self._sd

    def parameters(self):
        return iter(self._sd.values())

    def load_state_dict(self, sd):  # as an optimizer (load_into calls optimizer.load_state_dict)
        self.optim_sd = sd

    def commit(self, optimizer) -> None:
        load_full(self._model, optimizer, self._sd, self.optim_sd)
