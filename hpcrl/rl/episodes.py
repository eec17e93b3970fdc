"""Episodes of an environment (hpcrl/envs) over a rollout engine: the rollout of one RL step.

Turn 1 is the rollout the trainer always made: each prompt's group sampled in one call, from the
prompt's own stream. Each later turn is one engine call for all live episodes, each from its own
(seed, step, prompt, "turn", turn, sample) stream, so a resume or another world size samples the
same. An episode's sequence after its prompt is, in order:

    the model's turn (its sampled ids, never re-tokenised; loss mask 1)
    the environment's messages (the chat template's turn markers around them; loss mask 0)
    the model's next turn ...

which becomes one row of a RolloutBatch: `response_mask` is the loss mask per token, so the
environment's tokens are context for the model's later tokens and carry no gradient. When every
episode ends after turn 1 (the one-turn environment), the batch is turn 1's, unchanged.

Budgets (multi-turn environments only): args.env_max_turns model turns, and args.env_max_tokens
tokens after the prompt, the model's and the environment's. A turn samples at most what is left
(and max_response_length); the environment is told a turn is final when no turn may follow; an
episode whose next messages would not fit ends there with the terms it had (`cut`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .rollout import RolloutBatch

# a stand-in for an assistant turn's content: the chat template's text after it is the turn's end
_SENTINEL = "\u2063hpcrl-episode-turn\u2063"


@dataclass
class Episode:
    tokens: list = field(default_factory=list)    # after the prompt: the model's and the environment's ids
    mask: list = field(default_factory=list)      # 1.0 on the model's tokens, 0.0 on the environment's
    logp: list = field(default_factory=list)      # the sampler's log-probs (0.0 on the environment's)
    messages: list = field(default_factory=list)  # the conversation after the prompt
    terms: dict = field(default_factory=dict)     # reward terms summed over the turns
    info: dict = field(default_factory=dict)      # the environment's last info (reason, extras)
    turns: int = 0
    env_tokens: int = 0
    done: bool = False
    cut: bool = False                             # ended by the token budget

    @property
    def reward(self) -> float:
        vals = list(self.terms.values())
        return sum(vals[1:], vals[0]) if vals else 0.0  # one term: its value itself (the one-turn reward)


class Budget:
    """A multi-turn environment's budgets; a one-turn one has one turn of max_response_length."""

    def __init__(self, cfg, multi_turn: bool):
        self.turns = int(cfg["env_max_turns"]) if multi_turn else 1
        self.tokens = int(cfg["env_max_tokens"]) if multi_turn else int(cfg["max_response_length"])
        self.per_turn = int(cfg["max_response_length"])


def uses_template(tokenizer, chat_template="auto") -> bool:
    """As policy.prompt_text decides for the prompt."""
    return bool(getattr(tokenizer, "chat_template", None)) if chat_template == "auto" else bool(chat_template)


def environment_ids(tokenizer, messages: list, last_id: int | None, stop_ids, template: bool) -> list:
    """The token ids of the environment's messages after a model turn that ended in `last_id`:
    with a chat template, what it writes after an assistant turn's content (the turn's end unless
    the model sampled it itself, the messages, the next assistant header); without one, the
    messages' contents on their own lines (as the prompt is then written)."""
    if not template:
        return tokenizer("\n" + "\n".join(m["content"] for m in messages) + "\n", add_special_tokens=False).input_ids
    head = [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}]
    full = tokenizer.apply_chat_template(head + list(messages), tokenize=False, add_generation_prompt=True)
    text = full[full.index(_SENTINEL) + len(_SENTINEL):]
    if last_id is not None and last_id in stop_ids:
        said = tokenizer.decode([last_id])  # the model closed its turn: the template's close is its token
        if said and text.lstrip().startswith(said):
            text = text.lstrip()[len(said):]
    return tokenizer(text, add_special_tokens=False).input_ids


def _sampled(batch: RolloutBatch, row: int, limit: int) -> tuple[list, list]:
    """Row `row`'s sampled ids up to and including its stop token (at most `limit`) and their log-probs."""
    n = min(int(batch.response_mask[row].sum().item()), limit)
    ids = batch.response_ids[row, :n].tolist()
    logp = batch.old_logp[row, :n].tolist() if batch.old_logp is not None else [0.0] * n
    return ids, logp


class Runner:
    """The episodes of one step: `run` returns (batch, episodes) or None when a stop cut it short.

    engine: a rollout engine (generate(prompts, n, abort=..., **streams)); env: an Environment;
    streams(turn, keys): the engine's random streams for turn 1 (keys None: one per prompt) or for
    later turns (keys: (prompt position, sample) per live episode). With several ranks, `sync`
    agrees at each later turn whether any rank has live episodes or was stopped (so a stop cuts
    every rank's rollout at once, and no rank leaves for the update while another decodes)."""

    def __init__(self, engine, env, tokenizer, budget: Budget, template: bool, generation=contextlib.nullcontext,
                 sync=None, plain=contextlib.nullcontext):
        self.engine, self.env, self.tok, self.budget, self.template = engine, env, tokenizer, budget, template
        self.generation = generation  # the context of the decoding (fsdp: the weights gathered; autocast)
        self.plain = plain            # the environment's context inside it: no autocast
        # (live episodes here, this rank's decoding cut) -> (any rank has live ones, any was cut)
        self.sync = sync or (lambda live, cut: (live > 0, cut))
        self.env_s = 0.0  # the environment's time in this step (the step's timing_s/reward)
        # the ids a turn ends at (the HF engines say, vLLM holds them)
        self.stops = set(engine.stop_ids() if hasattr(engine, "stop_ids") else engine.stops)

    def run(self, rows: list, prompt_ids: list, group_size: int, streams, abort=None, encode=None):
        first = self.env.reset(rows, group_size)
        prompts = [ids if msgs == row["messages"] or encode is None else encode(msgs)
                   for ids, msgs, row in zip(prompt_ids, first, rows)]
        if not self.env.multi_turn:
            with self.generation():
                batch = self._generate(prompts, group_size, streams(1, None), self.budget.tokens, abort)
            if batch is None:
                return None
            # the environment (the reward) outside the generation's context, as the reward always ran
            eps = self._first(batch)
            return batch, eps  # one turn each: turn 1's batch as sampled
        # one context for every turn (fsdp: the weights gathered once, however many turns a rank takes)
        with self.generation():
            return self._many(prompts, group_size, streams, abort)

    def _first(self, batch) -> list:
        eps = [Episode() for _ in range(batch.response_ids.shape[0])]
        for i, ep in enumerate(eps):
            self._take(ep, *_sampled(batch, i, self.budget.tokens), batch.texts[i])
        self._answers(eps, self._step(list(batch.texts), [self._final(ep) for ep in eps]))
        return eps

    def _many(self, prompts, group_size, streams, abort):
        batch = self._generate(prompts, group_size, streams(1, None), self.budget.tokens, abort)
        if batch is None:
            self.sync(0, True)  # the other ranks are at a turn's agreement: tell them
            return None
        eps = self._first(batch)
        turn, cut = 1, False
        while True:
            live = [i for i, ep in enumerate(eps) if not ep.done]
            more, any_cut = self.sync(len(live), cut)  # every rank takes every turn
            if any_cut:
                return None
            if not more:
                break
            turn += 1
            keys = [(i // group_size, i % group_size) for i in live]
            cut = not self._turn(eps, live, prompts, group_size, streams(turn, keys) if live else {}, abort)
        if all(ep.turns == 1 for ep in eps) and not any(ep.env_tokens for ep in eps):
            return batch, eps
        return self._assemble(batch, eps), eps

    def _turn(self, eps, live, prompts, group_size, streams, abort) -> bool:
        """One later turn of the live episodes (none: nothing to do but agree); False when a stop
        request cut its decoding short."""
        if not live:
            return True
        contexts = [prompts[i // group_size] + eps[i].tokens for i in live]
        room = max(self.budget.tokens - len(eps[i].tokens) for i in live)
        got = self._generate(contexts, 1, streams, room, abort)
        if got is None:
            return False
        responses = [None] * len(eps)
        for j, i in enumerate(live):
            ids, logp = _sampled(got, j, self.budget.tokens - len(eps[i].tokens))
            responses[i] = self.tok.decode(ids, skip_special_tokens=True)
            self._take(eps[i], ids, logp, responses[i])
        self._answers(eps, self._step(responses, [ep.done or self._final(ep) for ep in eps]), live)
        return True

    def _step(self, responses: list, final: list) -> list:
        t0 = time.monotonic()
        try:
            with self.plain():  # a reward model's forward in its own dtype, never the decoding's autocast
                return self.env.step(responses, final)
        finally:
            self.env_s += time.monotonic() - t0

    def _generate(self, prompts, n, streams, room, abort):
        saved = self.engine.max_new_tokens
        self.engine.max_new_tokens = max(1, min(self.budget.per_turn, room))
        try:
            return self.engine.generate(prompts, n=n, abort=abort, **streams)
        finally:
            self.engine.max_new_tokens = saved

    def _take(self, ep: Episode, ids: list, logp: list, text: str) -> None:
        ep.tokens += ids
        ep.mask += [1.0] * len(ids)
        ep.logp += logp
        ep.messages.append({"role": "assistant", "content": text})
        ep.turns += 1

    def _final(self, ep: Episode) -> bool:
        return ep.turns >= self.budget.turns or len(ep.tokens) >= self.budget.tokens

    def _answers(self, eps: list, turns: list, live=None) -> None:
        """The environment's answers to the live episodes' turns: terms added, messages appended
        (tokenised, masked out), or the episode done (its budget spent: done whatever it said)."""
        if len(turns) != len(eps):
            raise ValueError(f"environment {self.env.name!r} answered {len(turns)} turns for {len(eps)} episodes")
        for i in (range(len(eps)) if live is None else live):
            ep, t = eps[i], turns[i]
            for k, v in t.terms.items():
                ep.terms[k] = ep.terms[k] + float(v) if k in ep.terms else v
            if t.info:
                ep.info = t.info
            if t.messages is None or self._final(ep):
                ep.done = True
                continue
            ids = environment_ids(self.tok, t.messages, ep.tokens[-1] if ep.tokens else None, self.stops,
                                  self.template)
            if len(ep.tokens) + len(ids) >= self.budget.tokens:  # no room for the model to answer
                ep.done = ep.cut = True
                continue
            ep.tokens += ids
            ep.mask += [0.0] * len(ids)
            ep.logp += [0.0] * len(ids)
            ep.env_tokens += len(ids)
            ep.messages += list(t.messages)

    def _assemble(self, first: RolloutBatch, eps: list) -> RolloutBatch:
        """One row per episode after turn 1's prompts: its tokens right padded, the loss mask."""
        width = max(len(ep.tokens) for ep in eps)
        device = first.response_ids.device
        ids = torch.full((len(eps), width), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(eps), width), dtype=torch.float32)
        logp = torch.zeros((len(eps), width), dtype=torch.float32)
        for i, ep in enumerate(eps):
            n = len(ep.tokens)
            ids[i, :n] = torch.tensor(ep.tokens, dtype=torch.long)
            mask[i, :n] = torch.tensor(ep.mask)
            logp[i, :n] = torch.tensor(ep.logp)
        texts = [ep.messages[-1]["content"] if ep.messages else "" for ep in eps]
        old = logp.to(device) * mask.to(device) if first.old_logp is not None else None
        return RolloutBatch(first.prompt_ids, first.prompt_mask, ids.to(device), mask.to(device), old, texts)


def figures(eps: list, env, gather=None) -> dict:
    """A multi-turn environment's figures of the step over the global batch (`gather`: every
    rank's lists, a collective; the one-turn environment adds none, so no collective: its
    records are the trainer's as they always were)."""
    if not env.multi_turn:
        return {}
    mine = [(ep.turns, ep.env_tokens, float(ep.cut), {k: float(v) for k, v in ep.terms.items()}) for ep in eps]
    every = [e for part in gather(mine) for e in part] if gather is not None else mine
    n = max(1, len(every))
    out = {"env/turns_mean": round(sum(e[0] for e in every) / n, 4),
           "env/turns_max": max((e[0] for e in every), default=0),
           "env/env_tokens_mean": round(sum(e[1] for e in every) / n, 3),
           "env/cut_by_tokens": round(sum(e[2] for e in every) / n, 4)}
    for k in dict.fromkeys(k for e in every for k in e[3]):
        out[f"env/term/{k}"] = round(sum(e[3].get(k, 0.0) for e in every) / n, 6)
    return out


def details(eps: list, env) -> list:
    """Each episode's terms, reason and extras for RUN/samples (the one-turn environment's: the
    reward's own, as they always were)."""
    if not env.multi_turn:
        return [ep.info for ep in eps]
    return [{"terms": {k: float(v) for k, v in ep.terms.items()}, "reason": ep.info.get("reason"),
             "extras": {**ep.info.get("extras", {}), "turns": ep.turns, "cut_by_tokens": ep.cut}} for ep in eps]
