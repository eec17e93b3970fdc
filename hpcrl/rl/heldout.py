"""`hpcrl eval`'s trainer side: a run's checkpoint, or an exported model directory, on rows of
verl's schema, decoded and scored as the run's own evaluation does; pass@k from sampled answers.

    python -m hpcrl.rl.heldout --config RUN/trainer.json --run-dir RUN --out DIR
        [--checkpoint CKPT_DIR | --model DIR] [--data FILE] [--rows N] [--samples N [--k K ...]] [--seed S]

Greedy, always: what evaluate.py does at the run's evaluations, step for step - the first `rows`
rows (default args.eval_size), batches of args.eval_batch_size, greedy decoding by the HF engine
in args.dtype, scored by args.reward, the figures by evaluate.figures. The weights are read as a
resume reads them (the run's base model, the checkpoint's tensors in place, each checked against
its manifest), so a single-process run's checkpoint on its own val split gives its recorded
figures exactly. A run that rolled out with vLLM is evaluated by the HF engine here (greedy
decoding, another kernel: an answer may differ where two tokens tie closely).

Sampled, with --samples N: N answers per prompt at args.temperature / args.top_p, each prompt's
from its own stream (seed, row): the same answers on a rerun, whatever the batch. pass@k is the
Codex paper's unbiased estimator, 1 - C(n-c, k) / C(n, k) for c of n answers passing (`passed`:
the code term's every test, whatever a length term adds), averaged over the prompts; per data
source too when the rows have several (the code rows' own pass@k).

Writes DIR/eval.json (the figures and what they came from) and DIR/samples/step-STEP.jsonl in the
samples store's format (hpcrl/samplestore.py), which `hpcrl samples RUN --eval DIR` shows.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from .. import samplestore
from ..atomicio import atomic_write_json

RESULT_FILE = "eval.json"
# the columns a row needs (docs/adapt.md section 1); extra_info and ability are optional
COLUMNS = ("prompt", "reward_model", "data_source")


class EvalError(ValueError):
    """A bad input of the evaluation, in one line naming the flag."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k answers drawn without replacement from n, c of them
    correct, is correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), exact in integers."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_ks(correct: list[int], n: int, ks: list[int]) -> dict:
    """{"pass@k": mean over prompts} for each k, `correct` the passing answers of each prompt."""
    return {f"pass@{k}": round(sum(pass_at_k(n, c, k) for c in correct) / max(1, len(correct)), 6) for k in ks}


# ---------------------------------------------------------------- inputs


def load_rows(path) -> list[dict]:
    """The examples of a parquet (or JSON lines) file of verl's schema; EvalError when it is
    missing, unreadable or of another schema."""
    from . import data

    path = Path(path)
    if not path.is_file():
        raise EvalError(f"--data {path}: no such file")
    try:
        records = data.read_records(path)
    except Exception as e:  # pyarrow's and pandas' errors have no common base: any is a bad file
        raise EvalError(f"--data {path}: cannot read it ({e.__class__.__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not records:
        raise EvalError(f"--data {path}: no rows")
    missing = [c for c in COLUMNS if c not in records[0]]
    if missing:
        raise EvalError(f"--data {path}: not verl's schema (docs/adapt.md section 1): no column "
                        f"{', '.join(missing)}; it has {', '.join(sorted(map(str, records[0])))}")
    try:
        return data.load_examples(path)
    except (KeyError, TypeError, AttributeError) as e:
        raise EvalError(f"--data {path}: a row does not fit verl's schema (docs/adapt.md section 1): "
                        f"{e.__class__.__name__}: {e}") from None


def load_model(cfg, run_dir: Path, checkpoint: Path | None, model_dir: Path | None, device):
    """(model, tokenizer, base model directory): an exported directory as from_pretrained reads
    it, or the run's base model with the checkpoint's weights read in place (as a resume)."""
    from ..checkpoints.trainer import checkpointer
    from . import policy, prepare

    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise EvalError(f"--model {model_dir}: not a Hugging Face model directory (no config.json); "
                            "`hpcrl export RUN --out DIR` writes one")
        model, tok = policy.load_policy(model_dir, device)
        return model, tok, model_dir
    base = prepare.prepare_model(cfg, run_dir)
    model, tok = policy.load_policy(base, device)
    checkpointer.load_model(checkpoint, model)
    return model, tok, base


def make_engine(cfg, model, tok):
    from .rollout import HFGenerateRollout, HFRollout

    engine = HFGenerateRollout if cfg.rollout == "hf-generate" else HFRollout
    return engine(model, tok, cfg.temperature, cfg.top_p, cfg.max_response_length, record_logprobs=False)


# ---------------------------------------------------------------- the evaluation


def decode(cfg, engine, reward, ids: list, examples: list, device, n: int = 0, seed: int = 0):
    """(scores, summed reward metrics, records) of every row: greedy (n=0), or n sampled answers a
    row. Batches as evaluate.py's (args.eval_batch_size prompts), in the compute dtype."""
    import torch

    from . import policy
    from .dist import generator

    scores, extra, records = [], {}, []
    bs = cfg.eval_batch_size
    with torch.random.fork_rng(), policy.autocast(device, cfg.dtype):
        for at in range(0, len(ids), bs):
            rows = list(range(at, min(at + bs, len(ids))))
            if n:
                batch = engine.generate([ids[i] for i in rows], n=n,
                                        generators=[generator(device, seed, "eval", i) for i in rows])
            else:
                batch = engine.generate([ids[i] for i in rows], n=1, greedy=True)
            exs = [examples[i] for i in rows for _ in range(max(1, n))]
            values, metrics = reward(exs, batch.texts)
            scores.extend(values)
            for k, v in metrics.items():  # weighted into a mean over the split, as evaluate.py does
                extra[k] = extra.get(k, 0.0) + v * len(values)
            records += _records(exs, [i for i in rows for _ in range(max(1, n))], batch.texts, values,
                                getattr(reward, "details", None), "sampled" if n else "greedy")
    return scores, extra, records


def _records(examples: list, rows: list, texts: list, values: list, details: list | None, decoding: str) -> list:
    """The samples store's records of a batch (rl/samples.py's, less the advantage and segment a
    training step has): the row's turns and answer, its score, terms and reason, how decoded."""
    out = []
    for j, (ex, text, value) in enumerate(zip(examples, texts, values)):
        d = details[j] if details and j < len(details) else {}
        out.append({"group": rows[j], "row": rows[j], "decoding": decoding,
                    "turns": [*ex["messages"], {"role": "assistant", "content": text}],
                    "reward": float(value), "terms": d.get("terms", {}), "reason": d.get("reason"),
                    "extras": d.get("extras", {}), "data_source": ex.get("data_source"),
                    "ground_truth": ex.get("ground_truth")})
    return out


def passed(record: dict) -> bool:
    """A sampled answer passes when its code (or auto) term scores 1.0 - every test passed, or the
    rule reward's right answer - whatever other terms add (a length penalty); with neither term,
    when its reward reaches 1.0 (the evaluation's accuracy)."""
    terms = record.get("terms") or {}
    return next((terms[t] for t in ("code", "auto") if t in terms), record["reward"]) >= 1.0


def sampled_figures(records: list, examples: list, n: int, ks: list[int]) -> dict:
    """pass@k over every prompt, and over each data source's when there are several; the sampled
    answers' mean reward. `records`: n answers of each prompt in turn."""
    from .evaluate import figures

    correct = [sum(passed(r) for r in records[i * n:(i + 1) * n]) for i in range(len(examples))]
    out = {"n": n, **pass_at_ks(correct, n, ks),
           "reward_mean": figures([r["reward"] for r in records], {})["eval/reward_mean"]}
    sources = sorted({str(e.get("data_source")) for e in examples})
    if len(sources) > 1:
        for src in sources:
            mine = [c for c, e in zip(correct, examples) if str(e.get("data_source")) == src]
            out.update({f"{key}/{src}": v for key, v in pass_at_ks(mine, n, ks).items()})
    return out


def evaluate(ns) -> dict:
    from . import config, prepare

    t0 = time.monotonic()
    cfg = config.load(ns.config)
    run_dir = Path(ns.run_dir)
    # the rows first, before torch loads: a wrong file is refused in a second
    data_path = Path(ns.data) if ns.data else prepare.prepare_data(cfg, run_dir)[1]
    examples = load_rows(data_path)
    of_rows = len(examples)
    limit = cfg.eval_size if ns.rows is None else ns.rows  # the run's evaluations' rows, by default
    examples = examples[:limit] if limit else examples

    import torch

    from ..rewards import mix as reward_mix
    from . import policy
    from .evaluate import figures

    if cfg.threads:  # the run's thread count: a CPU's sums, and so a close greedy tie, as the run's
        torch.set_num_threads(int(cfg.threads))
    device = policy.pick_device(cfg.device)
    reward = reward_mix.Reward(cfg, device)  # a reward that does not import fails before the model loads
    model, tok, _ = load_model(cfg, run_dir, Path(ns.checkpoint) if ns.checkpoint else None,
                               Path(ns.model) if ns.model else None, device)
    ids = policy.encode_prompts(tok, examples, chat_template=cfg.chat_template, max_prompt_length=cfg.max_prompt_length)
    engine = make_engine(cfg, model, tok)
    scores, extra, records = decode(cfg, engine, reward, ids, examples, device)
    result = {"step": ns.step, "checkpoint": ns.checkpoint, "model": ns.model, "data": str(data_path),
              "rows": len(examples), "of_rows": of_rows,
              "reward": cfg.reward, "greedy": figures(scores, extra)}
    if ns.samples:
        seed = cfg.seed if ns.seed is None else ns.seed
        ks = sorted(set(ns.k or [1, ns.samples]))
        _, _, s_records = decode(cfg, engine, reward, ids, examples, device, n=ns.samples, seed=seed)
        result["sampled"] = {**sampled_figures(s_records, examples, ns.samples, ks), "seed": seed,
                             "temperature": cfg.temperature, "top_p": cfg.top_p}
        records += s_records
    out = Path(ns.out)
    writer = samplestore.Writer(out, max_mb=1e6)
    writer.resume_at(-1)  # an earlier evaluation into this directory: its samples go
    writer.write(ns.step, [{"step": ns.step, "sample": i, **r} for i, r in enumerate(records)])
    result.update(seconds=round(time.monotonic() - t0, 3), time=round(time.time(), 3))
    atomic_write_json(out / RESULT_FILE, result)
    return result


def summary(result: dict) -> list[str]:
    g = result["greedy"]
    lines = [f"greedy: reward_mean={g['eval/reward_mean']:.4f} accuracy={g['eval/accuracy']:.4f} "
             f"n={g['eval/n']} (of {result['of_rows']} rows)"]
    s = result.get("sampled")
    if s:
        lines.append(f"sampled ({s['n']} a prompt, temperature {s['temperature']}, seed {s['seed']}): "
                     + " ".join(f"{k}={v:.4f}" for k, v in s.items() if k.startswith("pass@"))
                     + f" reward_mean={s['reward_mean']:.4f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcrl.rl.heldout", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the run's trainer.json")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a checkpoint directory of the run's store")
    which.add_argument("--model", help="an exported model directory")
    p.add_argument("--step", type=int, default=0, help="the checkpoint's step (the samples' step)")
    p.add_argument("--data")
    p.add_argument("--rows", type=int)
    p.add_argument("--samples", type=int, default=0)
    p.add_argument("--k", type=int, action="append")
    p.add_argument("--seed", type=int)
    ns = p.parse_args(argv)
    from ..checkpoints.trainer.tensorfile import CorruptFile, ModelMismatch
    from .config import ConfigError

    if ns.k and (not ns.samples or max(ns.k) > ns.samples or min(ns.k) < 1):
        print(f"hpcrl.rl: error: --k {max(ns.k)}: pass@k needs 1 <= k <= --samples ({ns.samples})", file=sys.stderr)
        return 2
    try:
        result = evaluate(ns)
    except (EvalError, ConfigError, FileNotFoundError) as e:
        print(f"hpcrl.rl: error: {e}", file=sys.stderr)
        return 2
    except (CorruptFile, ModelMismatch) as e:
        print(f"hpcrl.rl: error: checkpoint {ns.checkpoint}: {e}", file=sys.stderr)
        return 2
    for line in summary(result):
        print(f"hpcrl.rl: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
