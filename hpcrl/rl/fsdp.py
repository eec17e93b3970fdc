"""FSDP2 (torch.distributed.fsdp.fully_shard) for `args.parallel: fsdp` on more than one rank.

Each decoder layer and the root are sharded: a rank keeps 1/world of the weights, gradients
and AdamW state between phases. The model (and the KL reference) is built on the meta device,
sharded, and each rank reads only its own rows from the safetensors files (load_sharded): no rank
ever holds the whole model. Parameters and AdamW state are float32; with a bf16 `dtype` FSDP
gathers the weights in bf16 for compute and reduces gradients in float32. What the loop relies on:

- gradients are reduce-scattered by FSDP itself, which averages over the ranks; the loop's loss
  is already normalised over the global mini-batch (as on the ddp path, which sums), so it is
  multiplied by the world size before backward (LOSS_SCALE). A divide factor of 1 would say the
  same, but it needs ReduceOp.PREMUL_SUM, which gloo does not have;
- every rank must run the same forward/backward calls in training (each is a collective), so
  the loop pads a rank's micro-batches with zero-weighted dummies;
- rollout, evaluation and no-grad log-prob passes run inside `gathered()`: every module is
  unsharded once and stays so for the phase, so ranks may run different numbers of forwards
  (generation needs no collective per token) and the stop check inside them still works;
- the KL reference is sharded alike (a rank holds 1/world of it), gathered for its no-grad pass
  like the policy's; the end of the warm-up copies each rank's shards into it;
- checkpoints are written in parts (parts.py): each tensor's shards are gathered to the rank
  that owns it (about 1/world of the bytes each; nothing else moves) and it writes them, and a resume has each rank read a share of the
  files and scatter every tensor's shards from the rank that read it. The tensors are whole in
  the files, so a run moves between world sizes and between ddp and fsdp at any checkpoint.
"""

from __future__ import annotations

import contextlib

import torch

from ..checkpoints.trainer import parts


def _api():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def shard(model, compute_dtype: str = "float32") -> None:
    """fully_shard every decoder layer, then the root (embeddings, final norm, LM head).

    The sharded parameters stay float32 (the master weights; AdamW's state follows them); with a
    lower compute dtype FSDP gathers them in that dtype for the forward and backward, and reduces
    the gradients in float32 (MixedPrecisionPolicy), as torch's and verl's recipes do."""
    FSDPModule, fully_shard = _api()
    kw = {}
    if compute_dtype != "float32":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, compute_dtype), reduce_dtype=torch.float32)
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory) and their buffers
    for real: the rotary embedding's inv_freq is computed at construction and is in no file."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # (one already there may be tied: kept as it is)
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_on_meta(model_dir):
    """The model of `model_dir`'s config with its parameters on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_sharded(model_dir, device, rank: int, world: int, compute_dtype: str = "float32"):
    """The model of a local HF directory sharded over the ranks without any rank ever holding all
    of it: built on the meta device, sharded, given memory for its own shards only, and each rank
    reads just its rows of every tensor from the safetensors files (no collective). A rank's peak
    is its 1/world share of the float32 weights (plus the buffers, which are tiny)."""
    model = build_on_meta(model_dir)
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # to_empty forgets their values
    shard(model, compute_dtype)
    model.to_empty(device=device)
    tied = _tied_names(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
        _read_shares(model, model_dir, rank, world, tied)
    model.generation_config.pad_token_id = model.config.pad_token_id
    from .policy import keep_declared_dtype

    keep_declared_dtype(model, model_dir)
    return model


def _tied_names(model) -> dict:
    """name -> the first name of the same parameter (tied embeddings: the file holds only that one)."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _read_shares(model, model_dir, rank: int, world: int, tied: dict) -> None:
    from pathlib import Path

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (fsdp start-up reads safetensors only)")
    where = {}
    for f in files:
        with safe_open(f, "pt") as g:
            for key in g.keys():
                where[key] = f
    for name, p in model.named_parameters():
        source = name if name in where else tied.get(name, name)
        if source not in where:
            raise ValueError(f"{model_dir}: no weights for {name} in its safetensors files")
        local = p.to_local() if isinstance(p, DTensor) else p
        start, stop = _rows(p, rank, world) if isinstance(p, DTensor) else (0, p.shape[0] if p.dim() else 0)
        with safe_open(where[source], "pt") as g:
            part = g.get_slice(source)
            rows = part[start:stop] if p.dim() else part[:]
        if tuple(rows.shape) != tuple(local.shape):
            raise ValueError(f"{model_dir}: {source} has {tuple(rows.shape)} rows for this rank, its shard "
                             f"{tuple(local.shape)}")
        local.copy_(rows)
    for name, b in model.named_buffers():  # a persistent buffer in the files (Llama and Qwen have none)
        if name in where:
            with safe_open(where[name], "pt") as g:
                b.copy_(g.get_tensor(name))


def _rows(p, rank: int, world: int) -> tuple[int, int]:
    """This rank's rows of a parameter sharded on dim 0 (FSDP2's Shard(0): torch.chunk's split)."""
    from torch.distributed.tensor import Shard

    if list(p.placements) != [Shard(0)]:
        raise ValueError(f"unexpected fsdp placement {p.placements}")
    n = p.shape[0]
    chunk = -(-n // world)
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


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


def stream_weights(model, dtype):
    """(name, whole tensor in `dtype`) for every tensor of the model's state_dict, one at a time:
    a sharded one is cast on its shards and all-gathered alone (a collective: every rank walks the
    same names in the same order), so at most one whole tensor exists at once. For the vLLM
    engine's weight sync; a plain (ddp) model's tensors are cast only when `dtype` differs."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, t in model.state_dict().items():
            t = t.detach()
            if t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t.full_tensor() if isinstance(t, DTensor) else t


def owned_part(model, optimizer, rank: int, world: int, ref=None) -> tuple[dict, tuple]:
    """This rank's part of a checkpoint: the whole model tensors parts.assign gives it, on CPU,
    and their optimizer state flattened as checkpoint.write_part wants it (and, given the sharded
    KL reference, its tensors of the same names); with the index (weight_map, total bytes).
    A collective: every tensor's shards are gathered to its owner only (one gather per tensor,
    the same order on every rank), so a save moves each byte once, to the rank that writes it,
    instead of all-gathering everything on every rank."""
    from ..checkpoints.trainer.checkpointer import flatten_optimizer

    sd = model.state_dict()
    owner = parts.assign({n: t.numel() * t.element_size() for n, t in sd.items()}, world)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    weight_map = {n: parts.part_name("model", owner[n], world) for n in sd}

    def owned(state):
        out = {}
        for name, t in state.items():
            got = _to_owner(t, owner[name], rank, world)
            if got is not None:
                out[name] = got
        return out

    mine = owned(sd)
    mine_ref = None if ref is None else owned(ref.state_dict())
    osd = optimizer.state_dict()  # state keyed by parameter index, as a 1-rank run saves it
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, p in enumerate(params):
        o = owner[names[id(p)]]
        for key, value in sorted(osd["state"].get(i, {}).items()):
            if isinstance(value, torch.Tensor):
                value = _to_owner(value, o, rank, world)
            if o == rank:
                state.setdefault(i, {})[key] = value
    tensors, meta = flatten_optimizer({"state": state, "param_groups": osd["param_groups"]})
    return {"model": mine, "optimizer": tensors, "meta": meta, "ref": mine_ref}, (weight_map, total)


def _to_owner(t, owner: int, rank: int, world: int):
    """The whole tensor, on CPU, on rank `owner` (None elsewhere): a sharded one's Shard(0) pieces
    gathered there (padded to torch.chunk's size, as gather wants equal pieces); a replicated one
    (AdamW's step) copied by its owner, who has it already."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach().to("cpu", copy=True) if rank == owner else None
    start, stop = _rows(t, rank, world)
    chunk = -(-t.shape[0] // world)
    local = t.to_local().detach()
    piece = local.new_zeros((chunk, *t.shape[1:]))
    piece[:stop - start].copy_(local)
    group = t.device_mesh.get_group()
    if rank != owner:
        tdist.gather(piece, dst=owner, group=group)
        return None
    pieces = [torch.empty_like(piece) for _ in range(world)]
    tdist.gather(piece, gather_list=pieces, dst=owner, group=group)
    return torch.cat(pieces)[:t.shape[0]].cpu()


def scatter_share(model, optimizer, dist, model_t: dict, optim_t: dict, metas: list, ref_t: dict | None = None,
                  ref=None) -> None:
    """Load a checkpoint every rank read a share of (parts.read_share): each tensor's shards go
    from the rank that holds it to every rank (the placements of the live parameter), the rest
    (AdamW's step; under ddp, whose model is not sharded, every tensor) is broadcast; the sharded KL reference likewise, when the checkpoint holds
    one (else it stays the base model). Raises ModelMismatch on every rank alike when the
    checkpoint does not fit the model."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ..checkpoints.trainer.checkpointer import optimizer_state_dict
    from ..checkpoints.trainer.tensorfile import ModelMismatch

    ref_t = {REF + n: t for n, t in (ref_t or {}).items()}  # the reference's names are the model's
    held = dist.gather({n: (list(t.shape), str(t.dtype)) for n, t in {**model_t, **optim_t, **ref_t}.items()})
    metas = [m for ms in dist.gather(metas) for m in ms]
    owner, spec = {}, {}
    for rank, names in enumerate(held):
        for n, s in names.items():
            owner[n], spec[n] = rank, s

    def spread(name, like_shape, like_dtype, like):
        shape, dtype = spec[name]
        if shape != list(like_shape) or dtype != str(like_dtype):
            raise ModelMismatch(f"checkpoint tensor {name} is {dtype}{shape}, the model has "
                                f"{like_dtype}{list(like_shape)}")
        device = like.device if like is not None else _device(model)
        mine = model_t.get(name, optim_t.get(name, ref_t.get(name)))
        src = mine.to(device) if mine is not None else torch.empty(like_shape, dtype=like_dtype, device=device)
        if isinstance(like, DTensor):
            return distribute_tensor(src, like.device_mesh, like.placements, src_data_rank=owner[name])
        tdist.broadcast(src, owner[name])
        return src

    sd = model.state_dict()
    lacking = sorted(set(sd) - set(owner))
    if lacking:
        raise ModelMismatch(f"the checkpoint lacks {len(lacking)} tensors of the model, e.g. {lacking[0]}")
    new = {n: spread(n, t.shape, t.dtype, t) for n, t in sd.items()}
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, new, options=_options(full_state_dict=False))
    if ref is not None and any(n.startswith(REF) for n in owner):
        ref_sd = ref.state_dict()
        if set(ref_sd) != {n[len(REF):] for n in owner if n.startswith(REF)}:
            raise ModelMismatch("the checkpoint's reference model does not have the model's tensors")
        set_model_state_dict(ref, {n: spread(REF + n, t.shape, t.dtype, t) for n, t in ref_sd.items()},
                             options=_options(full_state_dict=False))
    if not metas:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for name in sorted(n for n in owner if n.startswith("state.")):  # the same order on every rank
        _, index, key = name.split(".", 2)
        p = params[int(index)]
        shape, dtype = spec[name]
        param_shaped = shape == list(p.shape)
        state.setdefault(int(index), {})[key] = spread(
            name, p.shape if param_shaped else torch.Size(shape),
            p.dtype if param_shaped else getattr(torch, dtype.split(".")[-1]), p if param_shaped else None)
    optimizer.load_state_dict(optimizer_state_dict(state, parts.merge_optimizer_meta(metas)))


REF = "ref/"  # the reference's tensors beside the model's of the same names, in scatter_share


def copy_shards(src, dst) -> None:
    """dst's weights := src's, for two models sharded alike (the KL reference after the warm-up):
    each rank copies its own shards, no communication."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        theirs = src.state_dict()
        for name, t in dst.state_dict().items():
            s = theirs[name]
            if isinstance(t, DTensor):
                if t.placements != s.placements:
                    raise ValueError(f"{name}: the two models are not sharded alike")
                t.to_local().copy_(s.to_local())
            else:
                t.copy_(s)


def _device(model):
    p = next(model.parameters())
    return p.to_local().device if hasattr(p, "to_local") else p.device
