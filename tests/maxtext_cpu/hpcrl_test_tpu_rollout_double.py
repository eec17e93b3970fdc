"""TEST DOUBLE of MaxText's vLLM-on-TPU rollout: lets MaxText 0.2.5's own RL trainer run on a CPU.

Never part of hpcrl: it lives under tests/, is not in the wheel, and a real job cannot reach it
(tests/maxtext_cpu/sitecustomize.py installs it only when a test puts that folder on PYTHONPATH
and sets HPCRL_TEST_TPU_ROLLOUT_DOUBLE=1).

Why: train_rl.py imports `maxtext.integration.vllm.maxtext_vllm_adapter` (-> tpu_inference ->
vllm, TPU Pallas kernels; `vllm-tpu` on PyPI is source only) at import time, and hard-codes its
rollout engine (`functools.partial(MaxTextVllmRollout, maxtext_config=...)`; no key selects
Tunix's "vanilla" rollout). This module stands in for both modules:

- `maxtext_vllm_adapter`: `register()` does nothing (it registers MaxText's model with vLLM);
- `maxtext_vllm_rollout.MaxTextVllmRollout`: a Tunix rollout (base_rollout.BaseRollout) that
  samples from the rollout copy of the MaxText model itself, recomputing the whole sequence for
  every new token (no KV cache: tiny models only), with the temperature / top-k of the rollout
  config, stopping at EOS. Everything else (config, model, Tunix learner, rewards, Orbax
  checkpoints, resume) is MaxText's and Tunix's own code, unchanged.

HPCRL_TEST_ROLLOUT_DELAY_S (seconds, default 0) makes each generate() take at least that long, as
a real rollout of long answers would: a tier test sets it so that a segment's walltime holds a
bounded number of steps however fast the machine is (a tiny model steps in ~0.3 s). A value that
is a path names a file holding the seconds, read at every call, so that a test can give one
segment a slower pace than the next.
"""

from __future__ import annotations

import functools
import os
import time

if os.environ.get("HPCRL_TEST_TPU_ROLLOUT_DOUBLE") != "1":
    raise ImportError("hpcrl_test_tpu_rollout_double is a test double: set HPCRL_TEST_TPU_ROLLOUT_DOUBLE=1 in a test only")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.generate import tokenizer_adapter  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402


def _delay_s() -> float:
    value = os.environ.get("HPCRL_TEST_ROLLOUT_DELAY_S") or "0"
    if value.startswith("/"):  # a file the test rewrites between segments
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read().strip() or "0"
        except OSError:
            value = "0"
    return float(value)


def register(*args, **kwargs):
    """maxtext_vllm_adapter.register(): there is no vLLM to register MaxText's model with."""


class MaxTextVllmRollout(base_rollout.BaseRollout):
    """Samples with the MaxText model (through Tunix's MaxText adapter) by full recomputation."""

    def __init__(self, rollout_actor, tokenizer, mesh, rollout_config, maxtext_config=None,
                 cache_config_or_size=None):  # pylint: disable=super-init-not-called
        self._model = rollout_actor
        self._tok = tokenizer_adapter.TokenizerAdapter(tokenizer)
        self._mesh = mesh
        self._calls = 0
        self._seed = int(getattr(maxtext_config, "init_weights_seed", 0) or 0)
        self._sample = None  # jitted per (prompt length, new tokens)

    # -- BaseRollout

    def model(self):
        return self._model

    def pad_id(self) -> int:
        return self._tok.pad_id()

    def eos_id(self) -> int:
        return self._tok.eos_id()

    def update_params(self, params, filter_types=None) -> None:
        nnx.update(self._model, params)

    def get_per_token_logps(self, prompt_tokens, completion_tokens, **kwargs):
        graphdef, state = nnx.split(self._model)
        return common.compute_per_token_logps(graphdef, state, prompt_tokens=prompt_tokens,
                                              completion_tokens=completion_tokens, pad_id=self.pad_id(),
                                              eos_id=self.eos_id(), stop_gradient=True, return_logits=False)

    def generate(self, prompts, rollout_config, **kwargs):
        started = time.monotonic()
        plen, new = int(rollout_config.max_prompt_length), int(rollout_config.max_tokens_to_generate)
        pad, eos = self.pad_id(), self.eos_id()
        bos = self._tok.bos_id()
        rows = []
        for p in prompts:
            ids = list(self._tok.encode(p))
            if bos is not None and bos >= 0 and (not ids or ids[0] != bos):
                ids = [bos] + ids
            rows.append(ids[-plen:])
        prompt = np.full((len(rows), plen), pad, dtype=np.int32)
        for i, ids in enumerate(rows):
            prompt[i, plen - len(ids):] = ids  # left padded, as Tunix's samplers return them
        temperature = float(rollout_config.temperature or 0.0)
        top_k = int(rollout_config.top_k or 0)
        seed = rollout_config.seed if getattr(rollout_config, "seed", None) is not None else self._seed
        key = jax.random.fold_in(jax.random.PRNGKey(int(seed)), self._calls)
        self._calls += 1
        graphdef, state = nnx.split(self._model)
        shape = (plen, new, pad, temperature > 0, top_k > 0)
        if self._sample is None or self._sample[0] != shape:  # one compilation per shape, not per call
            self._sample = (shape, jax.jit(functools.partial(_sample, graphdef, new=new, pad=pad, greedy=temperature <= 0,
                                                             use_top_k=top_k > 0)))
        tokens = np.asarray(self._sample[1](state, jnp.asarray(prompt), key, jnp.float32(max(temperature, 1e-6)),
                                            jnp.int32(max(top_k, 1))))
        out_tokens, texts = [], []
        for row in tokens:
            gen = row[plen:]
            stop = np.flatnonzero(gen == eos)
            gen = gen[: stop[0]] if stop.size else gen
            out_tokens.append(gen)
            texts.append(self._tok.decode(gen.tolist()))
        time.sleep(max(0.0, _delay_s() - (time.monotonic() - started)))
        return base_rollout.RolloutOutput(text=texts, logits=[None] * len(texts), tokens=out_tokens,
                                          left_padded_prompt_tokens=prompt, logprobs=None)


def _positions(tokens, pad):
    mask = (tokens != pad).astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def _sample(graphdef, state, prompt, key, temperature, top_k, *, new, pad, greedy, use_top_k):
    b, plen = prompt.shape
    buf = jnp.concatenate([prompt, jnp.full((b, new), pad, prompt.dtype)], axis=1)

    def step(i, carry):
        buf, key = carry
        model = nnx.merge(graphdef, state)  # built inside the loop's trace: MaxText's decoder mutates itself
        positions = _positions(buf, pad)
        logits, _ = model(buf, positions, None, None)
        last = jax.lax.dynamic_index_in_dim(logits, plen + i - 1, axis=1, keepdims=False).astype(jnp.float32)
        if greedy:
            nxt = jnp.argmax(last, axis=-1)
        else:
            last = last / temperature
            if use_top_k:
                ranked = jnp.sort(last, axis=-1)[:, ::-1]
                kth = jax.lax.dynamic_index_in_dim(ranked, jnp.minimum(top_k, last.shape[-1]) - 1, axis=1)
                last = jnp.where(last < kth, -jnp.inf, last)
            key, sub = jax.random.split(key)
            nxt = jax.random.categorical(sub, last, axis=-1)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None].astype(buf.dtype), plen + i, axis=1)
        return buf, key

    buf, _ = jax.lax.fori_loop(0, new, step, (buf, key))
    return buf
