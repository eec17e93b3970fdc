"""Mixed precision as the field does it (issue 19, item 1): float32 master weights and AdamW
state, the forward in the recipe's dtype. At the recipes' lr (1e-6) an Adam step moves a weight
by ~lr; in bfloat16 that is below half an ulp of a weight of ~0.01 (ulp ~6e-5), so held in
bfloat16 the weights would barely move."""

import torch
from safetensors.torch import load_file

from hpcrl import protocol
from hpcrl.checkpoints.store import CheckpointStore
from hpcrl.rl import policy
from hpcrl.rl.tiny import build_tiny_model

from rl_helpers import run_trainer, write_config

LR = 1e-6  # the GPU recipes' lr (countdown-grpo, gsm8k-grpo, tinyzero-countdown-builtin)


def adam_step_moves(model, autocast) -> torch.Tensor:
    """|change| / lr of every weight with a real gradient, after one AdamW step at LR (Adam's first
    step moves each by ~lr, whatever the gradient's scale)."""
    torch.manual_seed(0)
    ids = torch.randint(4, 60, (4, 12))
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    opt.step()
    ratios = [((p.detach().float() - before[n]).abs() / LR)[grads[n].abs() > 1e-5]
              for n, p in model.named_parameters()]
    return torch.cat([r.reshape(-1) for r in ratios])


def test_bf16_compute_over_fp32_masters_moves_weights_by_the_update(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", hidden_size=64, layers=2, heads=2, max_int=60)
    model, _ = policy.load_policy(model_dir, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the masters
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    moved = adam_step_moves(model, policy.autocast(torch.device("cpu"), "bfloat16"))
    hook.remove()
    assert seen == [torch.bfloat16]  # the forward ran in the compute dtype
    assert len(moved) > 1000
    # nearly every weight moved by the update itself (fp32 resolves 1e-6 on a weight of ~0.02)
    assert 0.9 < moved.median().item() < 1.1, moved.median()
    assert (moved > 0.5).float().mean().item() > 0.95

    # the same step on weights held in bfloat16 (the old way): the updates round away
    pure, _ = policy.load_policy(model_dir, torch.device("cpu"))
    pure.to(torch.bfloat16)
    lost = adam_step_moves(pure, torch.autocast("cpu", enabled=False))
    assert (lost > 0.5).float().mean().item() < 0.5, "bf16 weights kept the update: this test could not fail"


def test_trainer_in_bf16_keeps_fp32_masters_in_its_checkpoint(tmp_path):
    """The real trainer, dtype bfloat16 at lr 1e-6: its checkpoint holds float32 weights that moved
    by about the update from the base model's (held in bfloat16 they would mostly not move)."""
    run_dir = tmp_path / "run"
    write_config(run_dir, dtype="bfloat16", lr=LR, sft_steps=0, total_steps=1, beta=0.0, ppo_epochs=1,
                 mini_batches=1, reward="countdown + 0.1*length", length_norm_chars=10, eval_before=False,
                 eval_after=False, save_every=0)
    rc, out, err = run_trainer(run_dir)
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    step, path = CheckpointStore(run_dir / "checkpoints").find_latest()
    assert step == 1
    after = load_file(path / "model.safetensors")
    base = load_file(run_dir / "model" / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.float32}
    moved = torch.cat([((after[k] - base[k].float()).abs() / LR).reshape(-1) for k in base])
    assert (moved > 0.5).float().mean().item() > 0.5, f"median move {moved.median().item():.3g} x lr"


def test_export_writes_the_models_dtype_by_default_and_the_asked_one(home, tmp_path):
    """The checkpoint keeps the float32 masters; `hpcrl export` writes the model's own dtype
    (bfloat16 here, as its config.json says) unless --dtype asks for another."""
    import json

    from safetensors import safe_open

    from hpcrl import control
    from hpcrl.export import _header_dtypes
    from hpcrl.checkpoints.trainer import checkpointer
    from hpcrl.spec import resolve

    from helpers import hpcrl

    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, layers=1, heads=2, max_int=60)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))  # a bf16 model
    model, tok = policy.load_policy(model_dir, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run = control.create_run(resolve(None, "local", [f"args.model={model_dir}"], {"trainer": "builtin"}), "mp")
    checkpointer.Checkpointer(run.layout.checkpoints, async_save=False, tokenizer=tok).save_now(
        3, model, opt, {"step": 3})
    saved = CheckpointStore(run.layout.checkpoints).find_latest()[1]
    assert _header_dtypes(saved / "model.safetensors") == {"F32"}  # the masters
    masters = load_file(saved / "model.safetensors")

    hpcrl("export", "mp", "--out", tmp_path / "bf16")
    assert _header_dtypes(tmp_path / "bf16" / "model.safetensors") == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        name = next(iter(masters))
        assert torch.equal(f.get_tensor(name), masters[name].to(torch.bfloat16))

    hpcrl("export", "mp", "--out", tmp_path / "fp32", "--dtype", "float32")
    assert _header_dtypes(tmp_path / "fp32" / "model.safetensors") == {"F32"}
    assert all(torch.equal(t, masters[k]) for k, t in load_file(tmp_path / "fp32" / "model.safetensors").items())


def test_fsdp_in_bf16_keeps_fp32_masters_sharded(tmp_path):
    """fsdp on 2 ranks with dtype bfloat16 (MixedPrecisionPolicy: bf16 gathers, fp32 reduce): the
    parts hold float32 weights that moved by about the update at lr 1e-6."""
    from rl_helpers import DIST_ARGS, checkpoint_model, exit_file_code, start_torchrun

    run_dir = tmp_path / "fsdp"
    write_config(run_dir, **{**DIST_ARGS, "parallel": "fsdp", "dtype": "bfloat16", "lr": LR, "sft_steps": 0,
                             "total_steps": 1, "beta": 0.0, "ppo_epochs": 1, "mini_batches": 1,
                             "eval_before": False, "eval_after": False, "save_every": 0})
    proc = start_torchrun(run_dir)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and exit_file_code(run_dir) == protocol.EXIT_COMPLETE, err[-3000:]
    step, path = CheckpointStore(run_dir / "checkpoints").find_latest()
    assert step == 1 and (path / "model-00002-of-00002.safetensors").exists()
    after = checkpoint_model(path)
    base = load_file(run_dir / "model" / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.float32}
    moved = torch.cat([((after[k] - base[k].float()).abs() / LR).reshape(-1) for k in base])
    assert (moved > 0.5).float().mean().item() > 0.5, f"median move {moved.median().item():.3g} x lr"
