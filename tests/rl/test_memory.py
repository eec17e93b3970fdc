"""micro_batch_size 0 on a GPU: rows per pass from the model's shape (hpcrl/rl/memory.py), on the
facts of the one GPU run that ran out of memory, and the trainer's use of it."""

import types
from pathlib import Path

import pytest
import torch

from hpcrl import protocol
from hpcrl.rl import config, memory, policy
from hpcrl.rl.loop import RLTrainer

from rl_helpers import TINY_ARGS

GIB = 2 ** 30
H200 = int(139.8 * GIB)  # torch.cuda's total_memory on the lent H200 (its 141 GB)
# gpu-check's default: Qwen2.5-0.5B's shape, 16 prompts x 8 rows, <= 64 prompt tokens, 256 new ones, bf16
QWEN05 = types.SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, vocab_size=151_936)
PARAMS_05B = 494_032_768


def test_the_whole_batch_that_ran_out_of_an_h200_is_estimated_not_to_fit():
    """The H200 run held 113.8 GiB and asked for 18.6 more in its first backward with all 128 rows in
    one pass: an estimate below that would have let the same batch through again."""
    per_row = memory.row_bytes(QWEN05, 64, 256, "bfloat16")
    state = memory.state_bytes(PARAMS_05B, 1, reference=False)
    assert 128 * per_row + state > (113.8 + 18.6) * GIB
    assert 128 * per_row + state > H200
    # the logits' share: 256 positions x 151,936 entries, several float32 copies
    assert 256 * 151_936 * 4 * 3 < per_row < 2 * GIB
    most = memory.max_rows(H200, state, lambda n: n * per_row, 128)
    rows = memory.even_split(128, most)
    assert 1 <= rows < 128
    assert rows * per_row + state <= H200 // 2 + state  # the split fits in half of what the state leaves
    assert memory.even_split(128, rows) == rows  # a fixed point: each pass takes the same rows
    # today's loss holds one chunk of ~1 GiB of logits, not the rows': the same device takes more rows
    chunk = policy.LOGIT_CHUNK_BYTES // (QWEN05.vocab_size * memory.LOGIT_BYTES)
    assert chunk == 353

    def chunked(n):
        return memory.pass_bytes(QWEN05, n, 64, 256, "bfloat16", False, chunk)
    assert chunked(128) < 128 * per_row / 2
    assert memory.max_rows(H200, state, chunked, 128) > most


def test_the_split_is_even_and_never_empty():
    assert memory.even_split(100, 60) == 50
    assert memory.even_split(128, 43) == 43  # 3 passes: 43, 43, 42
    assert memory.even_split(8, 60) == 8
    assert memory.even_split(5, 1) == 1
    assert memory.max_rows(10 * GIB, 20 * GIB, lambda n: n * GIB, 8) == 1  # the state alone overflows: one row
    assert memory.max_rows(100 * GIB, 20 * GIB, lambda n: n * GIB, 8) == 8  # room for more than there are
    assert memory.max_rows(100 * GIB, 20 * GIB, lambda n: n * GIB, 64) == 40


def test_fsdp_divides_the_state_and_a_reference_adds_to_it():
    one = memory.state_bytes(3_000_000_000, 1, reference=False)
    assert one == 48_000_000_000
    assert memory.state_bytes(3_000_000_000, 4, reference=True) == (48 + 12) * 10 ** 9 // 4


def test_a_cpu_run_takes_the_whole_mini_batch():
    assert memory.device_bytes(torch.device("cpu")) is None


def build_trainer(tmp_path, **args):
    cfg = config.resolve({**TINY_ARGS, "sft_steps": 0, "total_steps": 1, "ppo_epochs": 1, "mini_batches": 1,
                          "eval_before": False, "eval_after": False, "async_save": False, "save_every": 0, **args})
    ctx = protocol.Context(tmp_path, tmp_path / "checkpoints", 1, None, tmp_path / "metrics.jsonl")
    return RLTrainer(cfg, ctx, protocol.StopFlag(ctx, install=False))


@pytest.fixture
def rows_per_forward(monkeypatch):
    """The row counts of the training forwards (the loss's, with gradients)."""
    seen = []
    real = policy.response_logprobs

    def counting(model, prompt_ids, *a, **k):
        if torch.is_grad_enabled():
            seen.append(prompt_ids.shape[0])
        return real(model, prompt_ids, *a, **k)
    monkeypatch.setattr(policy, "response_logprobs", counting)
    return seen


def test_the_trainer_splits_by_the_estimate_on_a_gpu_sized_device(tmp_path, monkeypatch, capfd, rows_per_forward):
    """Test double for the device's memory (no GPU here): a device the estimate says holds 6 of
    the tiny model's rows at a time; its 16 rows go through in 3 passes."""
    probe = build_trainer(tmp_path / "probe")
    per_row = memory.row_bytes(probe.model.config, max(len(p) for p in probe.train_ids), 6, "float32")
    state = memory.state_bytes(sum(p.numel() for p in probe.model.parameters()), 1, reference=True)
    monkeypatch.setattr(memory, "device_bytes", lambda device: state + 2 * 6 * per_row + per_row // 2)
    trainer = build_trainer(tmp_path / "run")
    assert trainer.auto_rows == 6
    assert "at most 6 rows per forward/backward" in capfd.readouterr().out
    assert trainer.run() == 0
    assert rows_per_forward == [6, 6, 4]  # 16 rows: ceil(16 / 3) = 6 a pass


def test_an_explicit_micro_batch_size_is_kept(tmp_path, monkeypatch, rows_per_forward):
    monkeypatch.setattr(memory, "device_bytes", lambda device: 1)  # would mean one row a pass
    trainer = build_trainer(tmp_path, micro_batch_size=5)
    assert trainer.auto_rows is None
    assert trainer.run() == 0
    assert rows_per_forward == [5, 5, 5, 1]


def test_on_a_cpu_zero_is_still_the_whole_mini_batch(tmp_path, rows_per_forward):
    assert build_trainer(tmp_path).run() == 0
    assert rows_per_forward == [16]


def test_gradient_checkpointing_gives_the_same_gradients_through_the_full_forward(tmp_path):
    """transformers drops a layer's KV cache while it recomputes, so the group-shared prompt is
    not used then: the loss takes the full forward, with the same log-probs and gradients."""
    from hpcrl.rl.rollout import HFRollout
    from hpcrl.rl.tiny import build_tiny_model

    model, tok = policy.load_policy(build_tiny_model(tmp_path / "m", hidden_size=32, layers=2, heads=2, max_int=60),
                                    torch.device("cpu"))
    torch.manual_seed(0)
    batch = HFRollout(model, tok, max_new_tokens=5).generate([tok("numbers 3 5 target 8 answer").input_ids,
                                                              tok("numbers 4 target 9 answer").input_ids], n=3)
    weights = torch.randn(batch.response_ids.shape)
    got = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        assert policy.recomputes_layers(model) == checkpointing
        model.zero_grad(set_to_none=True)
        logp = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                        batch.response_mask, 1.0, group_size=3)
        (logp * weights * batch.response_mask).sum().backward()
        got.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = got
    assert torch.allclose(a, b, atol=1e-5)
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)
    model.eval()  # the rollout's mode: no recomputation, the cache is kept
    assert not policy.recomputes_layers(model)
    again = HFRollout(model, tok, max_new_tokens=5).generate([tok("numbers 3 5 target 8 answer").input_ids], n=2,
                                                             greedy=True)
    assert again.response_ids.shape[0] == 2


def test_checkpointing_shrinks_the_estimate_by_about_the_layers(tmp_path):
    per_row = memory.row_bytes(QWEN05, 64, 256, "bfloat16")
    ckpt = memory.row_bytes(QWEN05, 64, 256, "bfloat16", checkpointing=True)
    logits = 256 * QWEN05.vocab_size * memory.LOGIT_BYTES
    assert (per_row - logits) / (ckpt - logits) > 5  # 24 layers' activations -> their inputs + 2 layers


def test_a_run_with_gradient_checkpointing_trains(tmp_path, rows_per_forward, capfd):
    trainer = build_trainer(tmp_path, gradient_checkpointing=True)
    assert "gradient checkpointing: 1 decoder layers recompute" in capfd.readouterr().out
    assert trainer.model.is_gradient_checkpointing and trainer.model.training
    assert trainer.run() == 0
    assert rows_per_forward == [16]
    assert trainer.model.training  # the rollout's eval mode did not stick


# Qwen2.5's shapes (config.json: hidden, intermediate, layers, attention heads, KV heads; parameter
# counts with tied embeddings; the largest tensor: the embedding, vocabulary x hidden)
QWEN = {"0.5B": (896, 4864, 24, 14, 2, 494_032_768), "1.5B": (1536, 8960, 28, 12, 2, 1_543_714_304),
        "3B": (2048, 11008, 36, 16, 2, 3_085_938_688)}
A100_40 = int(40_536 * 2 ** 20)  # a Perlmutter GPU as nvidia-smi counts it (40,536 MiB)


def _recipe(name):
    import yaml

    from hpcrl.rl import config

    spec = yaml.safe_load((Path(memory.__file__).parents[1] / "recipes" / f"{name}.yaml").read_text())
    args, ranks = spec["args"], spec.get("resources", {}).get("gpus_per_node", 4)
    size = next(k for k in QWEN if k.lower() + "-" in args["model"].lower() or k.lower() in args["model"].lower())
    h, i, layers, heads, kv, params = QWEN[size]
    shape = types.SimpleNamespace(hidden_size=h, intermediate_size=i, num_hidden_layers=layers, vocab_size=151_936,
                                  num_attention_heads=heads, num_key_value_heads=kv)
    rest = params - 151_936 * h  # the embedding (the largest tensor), then tensors of at most hidden x intermediate
    numels = [151_936 * h] + [h * i] * (rest // (h * i)) + [rest % (h * i)]
    return config.resolve({k: v for k, v in args.items() if k != "model"}), ranks, shape, numels


@pytest.mark.parametrize("name", ["gsm8k-grpo", "gsm8k-gspo", "countdown-grpo", "mbpp-code-grpo",
                                  "tinyzero-countdown-builtin"])
def test_every_gpu_recipe_fits_a_perlmutter_a100_by_the_estimate(name):
    """Written after the recipes' comments were found to count bf16 weights and AdamW (2-4 bytes a
    parameter) after float32 masters made it 16, and activations of 8 rows of 1024-1280 tokens as
    'a few GB' (the estimate: 25-80 GiB): four of the five did not fit. Since issue 27 it counts
    the rank's vLLM engine (weights in the compute dtype, KV cache, overhead; resident the whole
    time) and the weight sync's peak (one tensor gathered whole), each beside the model state."""
    args, ranks, shape, numels = _recipe(name)
    assert args["rollout"] == "vllm" and args["micro_batch_size"] >= 1
    sharded = args["parallel"] == "fsdp"
    chunk = args["logit_chunk_tokens"] or policy.LOGIT_CHUNK_BYTES // (151_936 * memory.LOGIT_BYTES)
    share, util = memory.engine_plan(shape, numels, args, ranks, sharded, args["beta"] > 0, A100_40, chunk)
    state = memory.state_bytes(sum(numels), ranks if sharded else 1, args["beta"] > 0)
    weights = sum(numels) * 2 // args["vllm_tensor_parallel_size"]
    assert share >= weights + memory.ENGINE_OVERHEAD + 256 * memory.kv_bytes_per_token(shape, args["dtype"])
    assert util == pytest.approx(share / A100_40, abs=0.01)
    train = state + memory.pass_bytes(shape, args["micro_batch_size"], args["max_prompt_length"],
                                      args["max_response_length"], args["dtype"], args["gradient_checkpointing"], chunk)
    sync = state + memory.sync_bytes(max(numels), args["dtype"])
    used = share + max(train, sync)
    assert used <= memory.SAFETY * A100_40, f"{name}: {used / GIB:.1f} GiB of {A100_40 / GIB:.1f}"


def test_the_engine_share_is_what_it_wants_within_what_training_leaves():
    args, ranks, shape, numels = _recipe("tinyzero-countdown-builtin")
    small = {**args, "batch_size": 4, "eval_batch_size": 4}
    chunk = policy.LOGIT_CHUNK_BYTES // (151_936 * memory.LOGIT_BYTES)
    want = memory.engine_bytes(shape, sum(numels), "bfloat16", 5, 1280)
    assert memory.engine_plan(shape, numels, small, ranks, True, True, A100_40, chunk)[0] == want
    share, _ = memory.engine_plan(shape, numels, args, ranks, True, True, A100_40, chunk)
    assert share < memory.engine_bytes(shape, sum(numels), "bfloat16", 64 * 5, 1280)  # capped by training
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size"):  # 3B unsharded beside its engine
        memory.engine_plan(shape, numels, args, 1, False, True, A100_40, chunk)


def test_ddp_of_a_15b_model_beside_vllm_cannot_fit_a_40gb_gpu():
    """Why the 1.5B recipes shard: the whole float32 state and the reference exceed what vLLM leaves."""
    assert memory.state_bytes(QWEN["1.5B"][-1], 1, reference=True) + 0.3 * A100_40 > A100_40


@pytest.mark.parametrize("group", [1, 3])
def test_chunked_logits_give_the_same_logprobs_and_gradients(tmp_path, group):
    """The LM head over 5 response tokens at a time (recomputed in the backward) against the whole
    response at once: padded prompts, a temperature, the group-shared prompt and the full path."""
    from hpcrl.rl.rollout import HFRollout
    from hpcrl.rl.tiny import build_tiny_model

    model, tok = policy.load_policy(build_tiny_model(tmp_path / "m", hidden_size=32, layers=2, heads=2, max_int=60),
                                    torch.device("cpu"))
    torch.manual_seed(0)
    batch = HFRollout(model, tok, max_new_tokens=6).generate([tok("numbers 3 5 target 8 answer").input_ids,
                                                              tok("numbers 4 target 9 answer").input_ids], n=3)
    assert not bool(batch.prompt_mask.all()) and batch.response_ids.numel() > 5
    weights = torch.randn(batch.response_ids.shape)
    got = []
    for chunk in (0, 5):
        assert policy.logit_chunk_tokens(model, chunk) == (chunk or policy.LOGIT_CHUNK_BYTES // (
            model.config.vocab_size * memory.LOGIT_BYTES))
        model.zero_grad(set_to_none=True)
        logp = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                        batch.response_mask, 0.7, group_size=group, chunk_tokens=chunk)
        (logp * weights * batch.response_mask).sum().backward()
        with torch.no_grad():  # the reference's pass: chunks without recomputation
            again = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                             batch.response_mask, 0.7, group_size=group, chunk_tokens=chunk)
        assert torch.allclose(again, logp.detach(), atol=1e-6)
        got.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = got
    assert torch.allclose(a, b, atol=1e-5)
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4)


def test_chunked_logits_hold_a_chunk_not_the_response(tmp_path):
    """The logits' memory: with chunks of 4 tokens no tensor of the whole response's logits is
    ever made (the LM head's outputs are watched by a forward hook)."""
    from hpcrl.rl.tiny import build_tiny_model

    model, _ = policy.load_policy(build_tiny_model(tmp_path / "m", hidden_size=32, layers=1, heads=2, max_int=60),
                                  torch.device("cpu"))
    shapes = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    prompt, response = torch.randint(3, 50, (2, 5)), torch.randint(3, 50, (2, 9))
    logp = policy.response_logprobs(model, prompt, torch.ones_like(prompt), response, torch.ones(2, 9), 1.0,
                                    chunk_tokens=4)
    logp.sum().backward()
    vocab = model.config.vocab_size
    assert max(s[-2] * (s[0] if len(s) == 3 else 1) for s in shapes) <= 4  # forward, and the recompute
    assert (4, vocab) in shapes and (2, 1, vocab) in shapes  # chunks, and the model's own 1-position head
