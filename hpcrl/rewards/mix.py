"""The trainer's reward for one batch: `args.reward` parsed into weighted named terms.

    reward: code                              # tests passed, in the sandbox
    reward: "code + 0.1*length"               # plus a length penalty (-chars / length_norm_chars)
    reward: "model:/path/to/rm"               # a sequence-classification reward model
    reward: "code + 0.2*judge"                # an LLM judge (args.judge: its endpoint; llm_judge.py)
    reward: "0.5*auto + 0.5*model:/p/rm"      # weighted sum of any of them

A term is `[WEIGHT*]NAME`, terms are joined by ' + ' (spaces around the plus). NAME is one of
auto | countdown | gsm8k | gsm8k_flexible | code | length | model:PATH | judge[:RUBRIC_FILE] | module:function |
/file.py[:function] (the reward interface: hpcrl/rewards/score.py, docs/adapt.md).
Every term's per-sample values are logged as reward/<name>; dict results' extra keys too. A term
given by path is named short (term_names): /x/judge.py:score is judge.score, model:/x/rm model.rm.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

from . import score as rewards

_TERM_RE = re.compile(r"^\s*(?:(?P<w>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*)?(?P<name>\S.*?)\s*$")


def parse_terms(spec: str) -> list[tuple[float, str]]:
    """[(weight, name), ...] of a reward spec; ValueError names the bad term."""
    terms = []
    for part in re.split(r"\s\+\s", spec):
        m = _TERM_RE.match(part)
        if not m:
            raise ValueError(f"args.reward: cannot read the term {part!r}; write [WEIGHT*]NAME joined by ' + '")
        terms.append((float(m["w"]) if m["w"] else 1.0, m["name"]))
    return terms


class Reward:
    """Callable on (examples, texts) -> (scores, metrics); examples as data.load_examples gives them."""

    def __init__(self, cfg: dict, device=None, run_dir=None):
        self.cfg, self.run_dir = cfg, run_dir  # run_dir: where a judge keeps its cache (RUN/judge-cache)
        parsed = parse_terms(cfg["reward"])
        # (weight, name as written: errors say it, short name: metrics and samples say it, callable)
        self.terms = [(w, name, short, self._make(name, device))
                      for (w, name), short in zip(parsed, term_names([n for _, n in parsed]))]

    def _make(self, name: str, device):
        if name == "length":
            norm = float(self.cfg["length_norm_chars"])
            return lambda examples, texts: [-len(t) / norm for t in texts]
        if name.startswith("model:"):
            return ModelReward(name[len("model:"):], device, self.cfg["reward_model_batch_size"],
                               self.cfg["reward_model_normalize"])
        if name in ("code", "auto"):
            return self._code_or_auto(name)
        if name == "judge" or name.startswith("judge:"):
            return self._judge(name)
        return _call_any(rewards.load_reward(name))

    def _judge(self, name: str):
        from . import llm_judge

        judge = llm_judge.Judge(dict(self.cfg.get("judge") or {}), run_dir=self.run_dir,
                                rubric_file=name.partition(":")[2] or None)
        # the built-in route has each row's messages: the judge sees the prompt as the policy did
        return lambda examples, texts: judge.score([llm_judge.prompt_text(e["messages"]) for e in examples], texts)

    def _code_or_auto(self, name: str):
        from .sandbox import cpu_limits

        cfg = self.cfg
        if cfg.get("code_allow_plain"):  # the spec accepts the plain level (the sandbox refuses it otherwise)
            os.environ["HPCRL_SANDBOX_PLAIN"] = "1"
        limits = cpu_limits(cfg["code_timeout_s"], cfg["code_memory_mb"])
        auto = _call_any(rewards.compute_score_batch)

        def score(examples, texts):
            if name == "auto" and not all(str(e["data_source"]).startswith("code") for e in examples):
                return auto(examples, texts)
            return rewards.code_score_batch(texts, [e["ground_truth"] for e in examples], cfg["code_format_score"],
                                            limits, cfg["code_workers"], cfg["code_dedupe"])
        return score

    def __call__(self, examples: list, texts: list, dist=None) -> tuple[list, dict]:
        """dist (training, where every rank scores its share of one global batch): a reward model's
        `batch` normalisation is over the global batch, the same on any number of ranks."""
        total = [0.0] * len(texts)
        metrics = Figures()
        details = [{"terms": {}, "reason": None, "extras": {}} for _ in texts]
        for weight, name, short, fn in self.terms:
            values = fn(examples, texts, dist=dist) if isinstance(fn, ModelReward) else fn(examples, texts)
            if len(values) != len(texts):
                raise ValueError(f"reward {name!r} returned {len(values)} values for {len(texts)} responses")
            scores = [_score_of(v, name) for v in values]
            total = [t + weight * s for t, s in zip(total, scores)]
            metrics.add(_extras(values, scores, short if len(self.terms) > 1 else None))
            _note(details, values, scores, short, len(self.terms) > 1)
        # each sample's own terms, reason and other keys: the trainer keeps them (RUN/samples)
        self.details = details
        return total, metrics


def term_names(names: list[str]) -> list[str]:
    """The name each term is logged under (reward/<name>, a sample's terms): a file reward by its
    file's stem and function (/tmp/x/judge.py:score -> judge.score; compute_score when none is
    named), a model reward by its directory's name (model:/m/my-rm -> model.my-rm), others as
    written. Paths made names that were long, and changed with the directory a run was submitted
    from. Two that would share a name get -2, -3 in the spec's order."""
    out: list[str] = []
    for name in names:
        short = base = _short_name(name)
        n = 1
        while short in out:
            n += 1
            short = f"{base}-{n}"
        out.append(short)
    return out


def _short_name(name: str) -> str:
    if name.startswith("model:"):
        return "model." + (Path(name[len("model:"):].rstrip("/")).name or "model")
    if name.startswith("judge:"):  # a judge by its rubric file: judge:/r/style.txt -> judge.style
        return "judge." + (Path(name[len("judge:"):]).stem or "rubric")
    target, _, func = (name, "", "") if name.endswith(".py") else name.partition(":")
    if target.endswith(".py"):
        return f"{Path(target).stem}.{func or 'compute_score'}"
    return name


def _call_any(fn):
    """A (examples, texts) -> values adapter for a per-sample or a batch reward function."""
    if rewards.is_batch_reward(fn):
        return lambda ex, texts: list(fn(data_sources=[e["data_source"] for e in ex], solution_strs=list(texts),
                                         ground_truths=[e["ground_truth"] for e in ex],
                                         extra_infos=[e["extra_info"] for e in ex]))
    return lambda ex, texts: [fn(e["data_source"], t, e["ground_truth"], e["extra_info"]) for e, t in zip(ex, texts)]


def _note(details: list, values: list, scores: list, term: str, many: bool) -> None:
    """Each sample's score under `term`, the first string `reason` a term gave, and the terms'
    other plain keys (prefixed by the term when there are several)."""
    for d, v, s in zip(details, values, scores):
        d["terms"][term] = s
        if not isinstance(v, dict):
            continue
        for k, x in v.items():
            if k == "score":
                continue
            if k == "reason" and isinstance(x, str) and d["reason"] is None:
                d["reason"] = x
            elif x is None or isinstance(x, (bool, int, float, str)):
                d["extras"][f"{term}/{k}" if many else k] = x


def _score_of(value, name: str) -> float:
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward {name!r} returned a dict without 'score' (keys {sorted(value)[:8]})")
        value = value["score"]
    return float(value)


def _extras(values: list, scores: list, term: str | None) -> "Figures":
    """reward/<term> mean, numeric extra keys averaged, string ones as shares per value; each with
    what it is a mean over (Figures.weights), so that calls and ranks combine exactly."""
    out, n = Figures(), max(1, len(values))
    if term:
        out.put(f"reward/{_key(term)}", round(sum(scores) / n, 6), len(values))
    dicts = [v for v in values if isinstance(v, dict)]
    keys = dict.fromkeys(k for d in dicts for k in d if k != "score")
    for k in keys:
        vals = [d.get(k) for d in dicts if k in d]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) or isinstance(v, bool) for v in vals):
            out.put(f"reward/{_key(k)}", round(sum(float(v) for v in vals) / len(vals), 6), len(vals))
        elif all(isinstance(v, str) for v in vals):
            family = f"reward/{_key(k)}/"
            out.weights[family] = len(vals)
            for value, count in Counter(vals).items():
                out[family + _key(value)] = round(count / len(vals), 6)
    return out


class Figures(dict):
    """A batch's reward figures (metrics.jsonl's reward/* keys) and what each one is a mean over
    (`weights`): a mean's number of samples under its own key; a family of shares (reward/reason/ok,
    reward/reason/timeout, ...) the number of samples that had the key, under the family's prefix
    (ending in '/'): a value absent from one batch is a share of 0 there, not a missing figure.
    Those make the figures of several reward calls (a multi-turn step's) and of every rank's share
    of a step combine into the figures of the whole (combine), exactly as if scored at once."""

    def __init__(self, values=(), weights=None):
        super().__init__(values)
        self.weights = dict(weights or {})

    def put(self, key: str, value: float, weight: int) -> None:
        self[key], self.weights[key] = value, weight

    def add(self, other) -> None:
        self.update(other)
        self.weights.update(getattr(other, "weights", {}))


def combine(parts: list) -> Figures:
    """The figures of [(figures, n), ...] (n: the samples each part scored) as one batch's: each
    mean weighted by what it is a mean over; a share over its family's samples in every part (0
    where a part's family lacks the value); a figure without weights (a plain dict's) by n.
    One part is returned as it is."""
    if len(parts) == 1:
        return parts[0][0] if isinstance(parts[0][0], Figures) else Figures(parts[0][0])
    families = {f for m, _ in parts for f in getattr(m, "weights", {}) if f.endswith("/")}

    def family_of(key: str) -> str | None:  # the longest family prefix of a share's key
        return max((f for f in families if key.startswith(f)), key=len, default=None)

    sums, counts, totals, family = {}, {}, {}, {}  # family: a share's key -> its family's prefix
    for m, n in parts:
        weights = getattr(m, "weights", {})
        numbers = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        shares = {k: f for k in numbers if k not in weights and (f := family_of(k))}
        for f in set(shares.values()) | (families & weights.keys()):
            totals[f] = totals.get(f, 0) + weights.get(f, n)
        for k, v in numbers.items():
            w = weights.get(shares[k], n) if k in shares else weights.get(k, n)
            sums[k] = sums.get(k, 0.0) + v * w
            if k in shares:
                family[k] = shares[k]  # over its family's samples in every part (totals)
            else:
                counts[k] = counts.get(k, 0) + w
    out = Figures(weights=totals)
    for k, s in sums.items():
        if k in family:
            out[k] = round(s / totals[family[k]], 6)
        elif counts[k]:
            out.put(k, round(s / counts[k], 6), counts[k])
    return out


def _key(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(s))[:60]


class ModelReward:
    """A Hugging Face sequence-classification model's first logit for prompt + response, batched on
    the trainer's device; normalize: none | batch (z-score over the batch) | sigmoid."""

    def __init__(self, path: str, device, batch_size: int = 16, normalize: str = "none"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        # recipes say $SCRATCH/...: expanded here, in the job's own environment (as rl/prepare.py does)
        path = Path(os.path.expandvars(str(path))).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"args.reward: model:{path} is not a Hugging Face model directory (no config.json)")
        self.torch = torch
        self.device = device or torch.device("cpu")
        self.tok = AutoTokenizer.from_pretrained(path)
        # a long input loses its beginning, not the response's end (what the reward is about)
        self.tok.truncation_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tok.pad_token_id
        self.batch_size, self.normalize = batch_size, normalize
        self.max_len = min(int(self.tok.model_max_length or 2048), 1 << 20,
                           int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048))

    def _text(self, example: dict, response: str) -> str:
        messages = example["messages"]
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        return " ".join(m["content"] for m in messages) + " " + response

    def encode(self, strings: list):
        return self.tok(strings, return_tensors="pt", padding=True, truncation=True, max_length=self.max_len)

    def __call__(self, examples: list, texts: list, dist=None) -> list:
        """dist: an object whose sum(list) adds each entry over the ranks (dist.Dist): `batch`
        normalisation uses the global batch's mean and std (a collective: every rank calls it)."""
        torch, out = self.torch, []
        strings = [self._text(e, t) for e, t in zip(examples, texts)]
        with torch.no_grad():
            for start in range(0, len(strings), self.batch_size):
                enc = self.encode(strings[start:start + self.batch_size])
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
                out.extend(logits[:, 0].float().cpu().tolist())
        if self.normalize == "sigmoid":
            return [float(torch.sigmoid(torch.tensor(v))) for v in out]
        if self.normalize == "batch":
            return zscore(out, dist)
        return out


def zscore(values: list, dist=None) -> list:
    """(v - mean) / (std + 1e-6) over the global batch (every rank's values; std with n - 1)."""
    t = [float(v) for v in values]
    n, s = float(len(t)), sum(t)
    if dist is not None:
        n, s = dist.sum([n, s])
    if n < 2:
        return t
    mean = s / n
    sq = sum((v - mean) ** 2 for v in t)  # about the global mean: no cancellation of large sums
    if dist is not None:
        sq = dist.sum([sq])[0]
    std = (sq / (n - 1)) ** 0.5
    return [(v - mean) / (std + 1e-6) for v in t]
