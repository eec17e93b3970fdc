"""HF rollout log-probs, the format warm-up targets, and checkpoint save/load in-process."""

import random
import threading

import pytest
import torch

from hpcrl.checkpoints import store as ckpt_store
from hpcrl.checkpoints.store import CheckpointStore, checkpoint_name
from hpcrl.rl import policy, warmup
from hpcrl.checkpoints.trainer import checkpointer
from hpcrl.rl.rollout import HFGenerateRollout, HFRollout, _top_p_filter, response_mask_from
from hpcrl.rl.tiny import build_tiny_model

from helpers import flip_bit
from hooked_train import delayed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("m") / "model", hidden_size=32, layers=1, heads=2, max_int=60)
    return policy.load_policy(path, torch.device("cpu"))


def test_response_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 3, 9, 3], [5, 6, 7, 8], [3, 1, 1, 1]])
    assert response_mask_from(ids, 3).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


# prompts of different lengths, so rows are left padded
PROMPTS = ["numbers 3 5 target 8 answer", "numbers 4 target 9 answer", "numbers 7 2 1 target 40 answer"]


@pytest.mark.parametrize("engine", [HFRollout, HFGenerateRollout])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_a_training_forward(tiny, temperature, engine):
    """old_logp comes from the sampler itself; it must be what the loss recomputes, else the
    importance ratio is wrong from the first update on (this guards a transformers upgrade)."""
    model, tok = tiny
    torch.manual_seed(0)
    prompts = [tok(p).input_ids for p in PROMPTS[:2]]
    batch = engine(model, tok, temperature=temperature, max_new_tokens=7).generate(prompts, n=3)
    assert batch.response_ids.shape[0] == 6 and len(batch.texts) == 6
    assert not bool(batch.prompt_mask.all())  # the padded path is the one exercised
    for group in (1, 3):  # full forward, and the prompt shared across each group
        with torch.no_grad():
            logp = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                            batch.response_mask, temperature, group_size=group)
        assert torch.allclose(logp * batch.response_mask, batch.old_logp, atol=1e-4)


def test_sampling_loop_greedy_equals_generate(tiny):
    """The hand-written KV-cache loop (prompt prefilled once per group) decodes exactly what
    transformers' generate decodes, padded prompts included."""
    model, tok = tiny
    prompts = [tok(p).input_ids for p in PROMPTS]
    ours = HFRollout(model, tok, max_new_tokens=9).generate(prompts, n=2, greedy=True)
    theirs = HFGenerateRollout(model, tok, max_new_tokens=9).generate(prompts, n=2, greedy=True)
    assert ours.texts == theirs.texts
    width = min(ours.response_ids.shape[1], theirs.response_ids.shape[1])
    assert torch.equal(ours.response_ids[:, :width] * ours.response_mask[:, :width].long(),
                       theirs.response_ids[:, :width] * theirs.response_mask[:, :width].long())
    assert torch.equal(ours.prompt_ids, theirs.prompt_ids) and torch.equal(ours.prompt_mask, theirs.prompt_mask)


def test_shared_prompt_forward_gives_the_full_forward_gradient(tiny):
    """Running each prompt once for its group must not change the loss or its gradient: the
    group's gradients flow back through the shared keys/values."""
    model, tok = tiny
    torch.manual_seed(3)
    prompts = [tok(p).input_ids for p in PROMPTS]
    batch = HFRollout(model, tok, max_new_tokens=6).generate(prompts, n=4)
    weights = torch.randn(batch.response_ids.shape)
    grads = []
    for group in (1, 4):
        model.zero_grad(set_to_none=True)
        logp = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                        batch.response_mask, 1.0, group_size=group)
        (logp * weights * batch.response_mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    for full, shared in zip(*grads):
        assert torch.allclose(full, shared, atol=1e-5, rtol=1e-4)
    assert policy.rows_share_prompts(batch.prompt_ids, batch.prompt_mask, 4)
    assert not policy.rows_share_prompts(batch.prompt_ids[torch.tensor([0, 4, 1, 2])], batch.prompt_mask[:4], 4)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.97, 0.01, 0.01, 0.01]])
    kept = _top_p_filter(probs, 0.7)
    assert (kept > 0).tolist() == [[False, True, False, True], [True, False, False, False]]
    assert torch.equal(kept[0, [1, 3]], probs[0, [1, 3]])


def test_greedy_rollout_is_deterministic(tiny):
    model, tok = tiny
    prompts = [tok("numbers 3 5 target 8 answer").input_ids]
    r = HFRollout(model, tok, max_new_tokens=5)
    assert r.generate(prompts, greedy=True).texts == r.generate(prompts, greedy=True).texts


def test_format_target_uses_each_number_once_and_ignores_the_target():
    ex = {"data_source": "countdown", "ground_truth": {"target": 15, "numbers": [3, 5, 7]}}
    targets = {warmup.format_target(ex, random.Random(s)) for s in range(30)}
    for t in targets:
        assert t.startswith("<answer> ") and t.endswith(" </answer>")
        assert sorted(int(x) for x in t.split()[1:-1:2]) == [3, 5, 7]
    assert len(targets) > 5  # random orders and operators, not the solution


def _snapshot(model, step):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return opt, checkpointer.snapshot(model, opt, {"step": step, "sampler": {"epoch": 0, "cursor": step}})


def test_background_save_is_sealed_and_loads_back(tiny, tmp_path):
    model, tok = tiny
    opt, snap = _snapshot(model, 4)
    saver = checkpointer.Checkpointer(tmp_path, keep_last=2, async_save=True, tokenizer=tok)
    saver.save(4, snap)
    saver.wait()
    step, path = saver.latest()
    assert step == 4 and ckpt_store.verify_checkpoint(path) is None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_then = torch.get_rng_state()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.rand(10)
    state = checkpointer.load_into(path, model, opt)
    assert state["step"] == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng_then)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(path).config.model_type == "llama"  # usable as a model dir


def test_save_now_reuses_snapshot_buffers_and_saves_what_the_model_held(tiny, tmp_path):
    """Background snapshots copy into the previous snapshot's buffers (no fresh memory), yet each
    checkpoint holds the weights of its own step; a synchronous save writes the live tensors."""
    from safetensors.torch import load_file

    model, tok = tiny
    opt, _ = _snapshot(model, 1)
    saver = checkpointer.Checkpointer(tmp_path, keep_last=5, async_save=True)
    held, ptrs = {}, []
    for step, background in ((1, True), (2, True), (3, False)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
        held[step] = {k: v.clone() for k, v in model.state_dict().items()}
        saver.save_now(step, model, opt, {"step": step, "sampler": {}}, background=background)
        if background:
            ptrs.append(saver._buffers["model"]["model.embed_tokens.weight"].data_ptr())
    saver.wait()
    assert ptrs[0] == ptrs[1]
    for step in (1, 2, 3):
        on_disk = load_file(tmp_path / checkpoint_name(step) / "model.safetensors")
        assert all(torch.equal(on_disk[k], held[step][k]) for k in held[step]), step


def test_save_waits_for_the_pending_one_and_keeps_last_k(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    opt, snap = _snapshot(model, 1)
    monkeypatch.setattr(checkpointer, "write_snapshot", delayed(checkpointer.write_snapshot, 0.3))
    saver = checkpointer.Checkpointer(tmp_path, keep_last=2, async_save=True)
    for step in (1, 2, 3):
        saver.save(step, snap)
        assert threading.active_count() >= 2  # writing in the background
    saver.close()  # the save, and the deletion of the old checkpoints in the background
    assert [s for s, _ in CheckpointStore(tmp_path).list()] == [2, 3]
    assert not list(tmp_path.glob(".tmp-*"))


def _two_checkpoints(model, tmp_path):
    """Checkpoints 1 and 2 with different weights; returns (saver, optimizer, weights of 1)."""
    opt, snap1 = _snapshot(model, 1)
    saver = checkpointer.Checkpointer(tmp_path, keep_last=3, async_save=False)
    saver.save(1, snap1)
    _, snap2 = _snapshot(model, 2)
    saver.save(2, snap2)
    return saver, opt, snap1["model"]


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.safetensors", "rng.pt", "trainer_state.json"])
def test_corrupt_newest_falls_back_with_warning(tiny, tmp_path, capsys, victim):
    """One flipped bit anywhere in the newest checkpoint: the resume path (restore) detects it,
    warns, and loads the previous checkpoint completely - weights included."""
    model, tok = tiny
    saver, opt, weights1 = _two_checkpoints(model, tmp_path)
    flip_bit(tmp_path / checkpoint_name(2) / victim, at=0.9)
    step, path, state = saver.restore(model, opt)
    assert step == 1 and state["step"] == 1 and path.name == checkpoint_name(1)
    assert all(torch.equal(weights1[k], v) for k, v in model.state_dict().items())
    err = capsys.readouterr().err
    assert "step-00000002" in err and victim in err and "falling back" in err


def test_truncated_tensor_file_and_no_intact_checkpoint(tiny, tmp_path, capsys):
    model, tok = tiny
    saver, opt, _ = _two_checkpoints(model, tmp_path)
    for step in (1, 2):
        weights = tmp_path / checkpoint_name(step) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    assert saver.restore(model, opt) == (None, None, False)  # sizes alone told: nothing was read
    _, _, _ = _two_checkpoints(model, tmp_path / "again")
    saver = checkpointer.Checkpointer(tmp_path / "again", async_save=False)
    for step in (1, 2):
        flip_bit(tmp_path / "again" / checkpoint_name(step) / "model.safetensors", at=0.7)
    assert saver.restore(model, opt) == (None, None, True)  # weights were touched: caller reloads
    assert capsys.readouterr().err.count("falling back") >= 2


def test_tensor_files_are_plain_safetensors_and_the_optimizer_round_trips(tiny, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    model, tok = tiny
    opt, snap = _snapshot(model, 3)
    saver = checkpointer.Checkpointer(tmp_path, async_save=False)
    saver.save(3, snap)
    path = saver.latest()[1]
    on_disk = load_file(path / "model.safetensors")  # the reference reader agrees with ours
    assert on_disk.keys() == snap["model"].keys()
    assert all(torch.equal(on_disk[k], snap["model"][k]) for k in on_disk)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    manifest = ckpt_store.read_manifest(path)
    assert manifest["files"]["model.safetensors"] == {
        ckpt_store.digest_algorithm(): ckpt_store.file_digest(path / "model.safetensors"),
        "size": (path / "model.safetensors").stat().st_size}  # the in-stream digest is the file's
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.3)
    checkpointer.load_into(path, model, fresh)
    want, got = snap["optimizer"], fresh.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert want["state"].keys() == got["state"].keys()
    for i, per_param in want["state"].items():
        for key, value in per_param.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


def test_bf16_and_scalars_round_trip(tmp_path):
    from hpcrl.checkpoints.trainer import tensorfile

    tensors = {"w": torch.randn(3, 5).to(torch.bfloat16), "step": torch.tensor(7.0), "mask": torch.tensor([True, False]),
               "empty": torch.zeros(0, 4)}
    entry = tensorfile.write(tmp_path / "t.safetensors", tensors)
    into = {"w": torch.zeros(3, 5, dtype=torch.bfloat16)}
    fresh, _ = tensorfile.load(tmp_path / "t.safetensors", entry, into)
    assert torch.equal(into["w"], tensors["w"]) and fresh.keys() == {"step", "mask", "empty"}
    assert all(torch.equal(fresh[k], tensors[k]) for k in fresh)
    with pytest.raises(tensorfile.ModelMismatch):
        tensorfile.load(tmp_path / "t.safetensors", entry, {"w": torch.zeros(5, 3, dtype=torch.bfloat16)})
    with pytest.raises(tensorfile.CorruptFile):
        tensorfile.load(tmp_path / "t.safetensors", {**entry, "size": entry["size"] + 1})


class _RecordingOptimizer:
    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.grads = [p.grad.clone() for p in self.model.parameters()]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_the_same_gradient(tiny, loss_agg):
    from types import SimpleNamespace

    from hpcrl.rl import config
    from hpcrl.rl.dist import Dist
    from hpcrl.rl.loop import RLTrainer

    model, tok = tiny
    torch.manual_seed(1)
    prompts = [tok("numbers 3 5 target 8 answer").input_ids, tok("numbers 4 target 9 answer").input_ids]
    batch = HFRollout(model, tok, max_new_tokens=6).generate(prompts, n=3)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.2, 0.9])
    grads = {}
    # (micro_batch_size, the most rows a GPU's memory allows when it is 0): 6 rows at most 4 -> 2 passes of 3
    for micro, auto in ((0, None), (2, None), (4, None), (0, 4)):
        cfg = config.resolve({"micro_batch_size": micro, "loss_agg": loss_agg, "beta": 0.1})
        fake = SimpleNamespace(cfg=cfg, model=model, optimizer=_RecordingOptimizer(model), dist=Dist(), fsdp=False,
                               device=torch.device("cpu"), auto_rows=auto)
        for name in ("_loss_scale", "_reduce_grads", "_compute", "_rows_per_pass"):  # the trainer's own
            setattr(fake, name, getattr(RLTrainer, name).__get__(fake))
        ref = RLTrainer._logprobs_no_grad(fake, model, batch) * 0.9
        loss, _ = RLTrainer._optimizer_step(fake, batch, torch.arange(6), adv, ref, single=True)
        grads[micro if auto is None else "auto"] = (loss, fake.optimizer.grads)
    for micro in (2, 4, "auto"):
        assert grads[micro][0] == pytest.approx(grads[0][0], rel=1e-5)
        for g0, g in zip(grads[0][1], grads[micro][1]):
            assert torch.allclose(g0, g, atol=1e-6, rtol=1e-4)


def test_inverse_cdf_sampling_follows_the_distribution():
    from hpcrl.rl.rollout import _sample

    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0]).repeat(20000, 1)
    draws = _sample(probs)
    counts = torch.bincount(draws, minlength=6).float() / len(draws)
    assert counts[[0, 2, 5]].sum() == 0  # zero-probability tokens are never drawn
    assert torch.allclose(counts, probs[0], atol=0.015)
    unnormalised = torch.tensor([[0.0, 0.0, 2.0], [3.0, 0.0, 0.0]])  # top-p leaves rows unnormalised
    assert _sample(unnormalised).tolist() == [2, 0]


@pytest.mark.parametrize("engine", [HFRollout, HFGenerateRollout])
def test_a_response_ending_in_a_second_stop_token_is_masked_there(tmp_path, engine):
    """Qwen2.5-Instruct's generation config stops at <|im_end|> or <|endoftext|>, and the latter is
    also its pad token: a response ending in the second stop token must be masked right after it
    (not all ones: padding in the loss), and the sampling loops must stop there as vLLM does."""
    import copy

    # a fresh model (the module's is trained by other tests, and its greedy output may repeat one token)
    model, tok = policy.load_policy(build_tiny_model(tmp_path / "m", hidden_size=32, layers=1, heads=2, max_int=60),
                                    torch.device("cpu"))
    prompts = [tok(PROMPTS[0]).input_ids]
    plain = engine(model, tok, max_new_tokens=8).generate(prompts, greedy=True)
    ids = plain.response_ids[0].tolist()
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and ids[i] != tok.eos_token_id)
    second = ids[k]
    qwen_like = copy.deepcopy(tok)
    qwen_like.pad_token = tok.convert_ids_to_tokens(second)  # pad == the second stop token
    config = copy.deepcopy(model.generation_config)
    model.generation_config.eos_token_id = [tok.eos_token_id, second]
    try:
        batch = engine(model, qwen_like, max_new_tokens=8).generate(prompts, greedy=True)
    finally:
        model.generation_config = config
    assert batch.response_ids[0, :k + 1].tolist() == ids[:k + 1]
    assert batch.response_mask[0].tolist() == [1.0] * (k + 1) + [0.0] * (batch.response_ids.shape[1] - k - 1)
    assert batch.texts[0] == tok.decode(ids[:k + 1], skip_special_tokens=True)


def test_the_stop_ids_are_the_generation_configs_and_the_tokenizers():
    from types import SimpleNamespace

    from hpcrl.rl.rollout import stop_token_ids

    tok = SimpleNamespace(eos_token_id=7)
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=[9, 7])) == [7, 9]
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=4)) == [4, 7]
    assert stop_token_ids(tok, None) == [7]
    ids = torch.tensor([[5, 9, 7, 7], [5, 7, 9, 9], [1, 2, 3, 4]])
    assert response_mask_from(ids, [7, 9]).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
