"""Multi-turn episodes: a scripted policy (a test double of the model's sampling that returns fixed
token ids) in the code-repair environment, with the real sandbox, the real chat template
tokenisation and the real tiny model's loss. Its first turn's code fails a visible test, the
failure comes back as the next turn, its second turn fixes the code, and the episode's reward (the
held-out tests) rises; the loss mask is checked token by token and the environment's tokens carry
no gradient. Then the real trainer with code-repair: turns in its metrics and samples, and a
resume that is exact."""

import json
import signal

import pytest
import torch

from hpcrl import protocol
from hpcrl.envs import Environment, Turn, load
from hpcrl.envs.code_repair import CodeRepair, split_tests
from hpcrl.rewards import mix
from hpcrl.rl import algos, config, episodes, policy
from hpcrl.rl.policy import left_pad
from hpcrl.rl.rollout import RolloutBatch, decode_responses, response_mask_from
from hpcrl.rl.tiny import build_tiny_model

from helpers import last_step, read_metrics, wait_for_step
from rl_helpers import run_trainer, start_trainer, write_config

# a chat template whose turn markers are the tiny vocabulary's <s> ... </s>
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<s> assistant {% endif %}")
TESTS = ["assert f(3, 5) == 8", "assert f(7, 2) == 9", "assert f(4, 4) == 8"]  # visible: the first; held out: 2
ROW = {"messages": [{"role": "user", "content": "def f ( a , b ) : return # sum"}], "data_source": "code",
       "ground_truth": json.dumps({"tests": TESTS}), "extra_info": {"split": "train", "index": 0}}
WRONG, FIXED = "def f ( a , b ) : return a - b", "def f ( a , b ) : return a + b"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("m") / "model", hidden_size=32, layers=1, heads=2, max_int=20,
                            vocab="code")
    model, tok = policy.load_policy(path, torch.device("cpu"))
    tok.chat_template = TEMPLATE
    return model, tok


class Scripted:
    """The model's sampling, scripted: call k of generate returns turns[k]'s token ids for every row
    (and records the contexts it was given)."""

    def __init__(self, tok, turns: list):
        self.tok, self.turns, self.contexts = tok, turns, []
        self.max_new_tokens = 16

    def stop_ids(self):
        return [self.tok.eos_token_id]

    def generate(self, prompts, n=1, greedy=False, generators=None, abort=None):
        self.contexts.append([list(p) for p in prompts])
        ids = self.turns[len(self.contexts) - 1]
        ids_, mask = left_pad([p for p in prompts for _ in range(n)], self.tok.pad_token_id)
        response = torch.tensor([ids] * ids_.shape[0])
        rmask = response_mask_from(response, self.stop_ids())
        return RolloutBatch(ids_, mask, response, rmask, None, decode_responses(self.tok, response, rmask))


def _score(cfg):
    reward = mix.Reward(cfg)

    def score(rows, texts, whole_batch=False):
        values, metrics = reward(rows, texts)
        return values, metrics, reward.details
    return score


def _episodes(tok, turns, max_turns, group_size=2):
    cfg = config.resolve({"env": "code-repair", "env_max_turns": max_turns, "env_max_tokens": 200,
                          "max_response_length": 16, "reward": "code", "group_size": group_size})
    env = load(cfg, _score(cfg))
    engine = Scripted(tok, turns)
    prompt = policy.encode_prompts(tok, [ROW])[0]
    runner = episodes.Runner(engine, env, tok, episodes.Budget(cfg, env.multi_turn), episodes.uses_template(tok))
    batch, eps = runner.run([ROW], [prompt], group_size, lambda turn, keys: {})
    return batch, eps, engine, prompt


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_a_second_turn_that_fixes_the_code_raises_the_reward_and_only_the_model_tokens_carry_gradient(tiny):
    model, tok = tiny
    eos, unk = tok.eos_token_id, tok.unk_token_id
    # turn 1 holds an <unk> the decoded text drops: the context of turn 2 must still hold it (never re-tokenised)
    t1, t2 = _ids(tok, WRONG) + [unk, eos], _ids(tok, FIXED) + [eos]
    batch, eps, engine, prompt = _episodes(tok, [t1, t2], max_turns=2)
    _, once, _, _ = _episodes(tok, [t1], max_turns=1)

    # the reward rises: the first turn's code alone fails the held-out tests, the repaired one passes them
    assert [ep.reward for ep in once] == [0.0, 0.0] and [ep.turns for ep in once] == [1, 1]
    assert [ep.reward for ep in eps] == [1.0, 1.0] and [ep.turns for ep in eps] == [2, 2]
    assert eps[0].terms == {"heldout": 1.0} and eps[0].info["reason"] == "ok"

    # the feedback: the failing visible test, never a held-out one
    roles = [m["role"] for m in eps[0].messages]
    assert roles == ["assistant", "user", "assistant"]
    fb = eps[0].messages[1]["content"]
    assert "assert f(3, 5) == 8" in fb and "f(7, 2)" not in fb and "f(4, 4)" not in fb
    assert eps[0].messages[2]["content"] == FIXED

    # the environment's tokens: the template's text after an assistant turn the model closed itself
    env_ids = _ids(tok, f" <s> user {fb} </s> <s> assistant ")
    assert env_ids[0] == tok.convert_tokens_to_ids("<s>") and eos in env_ids
    # turn 2's context: the prompt, turn 1's ids as sampled (the <unk> too), the environment's ids
    assert engine.contexts[1] == [prompt + t1 + env_ids] * 2
    width = batch.response_ids.shape[1]
    row = t1 + env_ids + t2
    assert batch.response_ids[0].tolist() == row + [tok.pad_token_id] * (width - len(row))
    want_mask = [1.0] * len(t1) + [0.0] * len(env_ids) + [1.0] * len(t2) + [0.0] * (width - len(row))
    assert batch.response_mask[0].tolist() == want_mask  # token by token
    assert batch.texts == [FIXED, FIXED]

    # the loss (the real model's log-probs, GRPO's surrogate): zero gradient at every environment token
    env_pos = torch.tensor([m == 0.0 for m in want_mask[:len(row)]] + [False] * (width - len(row)))
    logp = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                    batch.response_mask)
    logp.retain_grad()
    adv = torch.tensor([1.0, -0.5])
    loss, _ = algos.policy_loss(logp, logp.detach() - 0.01, adv, batch.response_mask, "grpo", beta=0.0)
    model.zero_grad()
    loss.backward()
    for r in range(2):
        assert torch.all(logp.grad[r, env_pos] == 0.0)
        assert torch.all(logp.grad[r, torch.tensor(want_mask) == 1.0] != 0.0)
    # the same loss with the environment tokens' log-probs cut from the graph: the same parameter gradients
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp2 = policy.response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                     batch.response_mask)
    cut = torch.where(env_pos.expand_as(logp2), logp2.detach() + 5.0, logp2)  # and moved far off
    loss2, _ = algos.policy_loss(cut, logp2.detach() - 0.01, adv, batch.response_mask, "grpo", beta=0.0)
    loss2.backward()
    assert loss2.item() == loss.item()
    for a, b in zip(full, (p.grad for p in model.parameters())):
        assert torch.equal(a, b)


def test_a_turn_that_passes_the_visible_tests_ends_the_episode(tiny):
    _, tok = tiny
    batch, eps, engine, _ = _episodes(tok, [_ids(tok, FIXED) + [tok.eos_token_id]], max_turns=3)
    assert len(engine.contexts) == 1 and [ep.turns for ep in eps] == [1, 1] and [ep.reward for ep in eps] == [1.0, 1.0]
    assert batch.response_mask.sum().item() == 2 * len(_ids(tok, FIXED)) + 2


def test_the_token_budget_ends_an_episode_whose_feedback_does_not_fit(tiny):
    _, tok = tiny
    cfg = config.resolve({"env": "code-repair", "env_max_turns": 3, "env_max_tokens": 20,
                          "max_response_length": 16, "reward": "code"})
    env = load(cfg, _score(cfg))
    engine = Scripted(tok, [_ids(tok, WRONG) + [tok.eos_token_id]])
    runner = episodes.Runner(engine, env, tok, episodes.Budget(cfg, True), True)
    batch, eps = runner.run([ROW], [policy.encode_prompts(tok, [ROW])[0]], 1, lambda turn, keys: {})
    assert eps[0].cut and eps[0].done and eps[0].turns == 1 and eps[0].reward == 0.0  # no term: nothing earned
    assert len(engine.contexts) == 1


def test_split_tests_and_rows_it_refuses():
    assert split_tests(json.dumps({"tests": TESTS, "prefix": "p"})) == (TESTS[:1], TESTS[1:], "p")
    assert split_tests({"tests": TESTS, "visible_tests": ["v"]}) == (["v"], TESTS, "")
    with pytest.raises(ValueError, match="visible and held-out tests"):
        split_tests({"tests": TESTS[:1]})
    with pytest.raises(ValueError, match="ground_truth must be"):
        CodeRepair(config.resolve({}), None).check([{"ground_truth": "[1]"}])


def test_an_environment_of_ones_own_by_path_and_a_bad_name(tmp_path):
    path = tmp_path / "myenv.py"
    path.write_text("from hpcrl.envs import Environment, Turn\n"
                    "class Echo(Environment):\n"
                    "    multi_turn = True\n"
                    "    def step(self, responses, final):\n"
                    "        return [Turn(None, {'len': float(len(r or ''))}) for r in responses]\n")
    env = load(config.resolve({"env": f"{path}:Echo"}), None)
    assert isinstance(env, Environment) and env.multi_turn
    assert env.reset([ROW], 2) == [ROW["messages"]] and len(env.rows) == 2
    assert env.step(["ab", None], [False, True])[0] == Turn(None, {"len": 2.0})
    for bad, msg in ((f"{tmp_path}/none.py:X", "does not exist"), ("hpcrl.envs:Turn", "not a subclass"),
                     ("no_such_package.envs:X", "cannot import 'no_such_package.envs'")):
        with pytest.raises(ValueError, match=msg):
            load(config.resolve({"env": bad}), None)
    with pytest.raises(config.ConfigError, match=r"args.env: 'nothing' is not an environment; use one-turn \| "):
        config.resolve({"env": "nothing"})  # at render and submit too: the schema's check


# ------------------------------------------------------------------ the real trainer, multi-turn

CODE_REPAIR = {"model": "tiny", "tiny_max_int": 20, "tiny_vocab": "code", "data": "code-tiny",
               "code_tiny_train_size": 64, "code_tiny_test_size": 10, "reward": "code", "env": "code-repair",
               "env_max_turns": 3, "env_max_tokens": 160, "chat_template": False, "prompt_template": "base",
               "max_response_length": 4, "eval_size": 10, "eval_batch_size": 10, "samples_every": 1}


def _sandbox_env() -> dict:
    import os

    return {"HPCRL_SANDBOX_PLAIN": "1"} if os.environ.get("HPCRL_SANDBOX_PLAIN") == "1" else {}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("repair")
    write_config(run_dir, **CODE_REPAIR)
    rc, out, err = run_trainer(run_dir, **_sandbox_env())
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    return run_dir


def test_the_trainer_runs_code_repair_episodes_with_turns_in_metrics_and_samples(straight):
    train = [r for r in read_metrics(straight) if r.get("phase") == "train"]
    assert len(train) == 6
    for r in train:
        assert 1.0 <= r["env/turns_mean"] <= 3 and r["env/turns_max"] <= 3 and "env/env_tokens_mean" in r
    assert any(r["env/turns_mean"] > 1 for r in train)  # failing code got feedback and another turn
    recs = [json.loads(line) for f in sorted((straight / "samples").glob("*.jsonl")) for line in f.open()]
    long = [r for r in recs if r["extras"]["turns"] > 1]
    assert long, "no episode of more than one turn was kept"
    turns = long[0]["turns"]
    assert [t["role"] for t in turns[-3:]] == ["assistant", "user", "assistant"]
    assert "Fix the code" in turns[-2]["content"]
    assert all(set(r["terms"]) <= {"heldout"} for r in recs)


def test_a_multi_turn_run_resumes_exactly(straight, tmp_path):
    run_dir = tmp_path / "cut"
    write_config(run_dir, **CODE_REPAIR)
    proc = start_trainer(run_dir, step_delay_s=0.4, **_sandbox_env())
    wait_for_step(run_dir, 4, 600, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == protocol.EXIT_CONTINUE, err[-3000:]
    assert 4 <= last_step(run_dir) < 8
    rc, out, err = run_trainer(run_dir, segment=2, **_sandbox_env())
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    keys = ("step", "loss", "reward_mean", "reward_std", "kl", "response_len_mean", "env/turns_mean",
            "env/env_tokens_mean", "env/term/heldout")
    steps = lambda d: {r["step"]: {k: r.get(k) for k in keys} for r in read_metrics(d) if r.get("phase") == "train"}
    assert steps(run_dir) == steps(straight)
    from safetensors.torch import load_file

    final = lambda d: load_file(d / "checkpoints" / "step-00000008" / "model.safetensors")
    a, b = final(run_dir), final(straight)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_between_turns_abandons_the_step_and_the_resume_is_still_exact(straight, tmp_path):
    """A stop inside step 4's episodes (step 3 done and not yet saved: the stop saves it): the step
    is dropped and its rows are drawn again on resume."""
    run_dir = tmp_path / "cut"
    write_config(run_dir, **CODE_REPAIR)
    proc = start_trainer(run_dir, hooks=("--usr1-in-rollout-of-step=4",), **_sandbox_env())
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == protocol.EXIT_CONTINUE, err[-3000:]
    assert "step 4 abandoned in its rollout" in out + err and last_step(run_dir) == 3, (out + err)[-3000:]
    rc, out, err = run_trainer(run_dir, segment=2, **_sandbox_env())
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    keys = ("step", "loss", "reward_mean", "env/turns_mean", "env/env_tokens_mean", "env/term/heldout")
    steps = lambda d: {r["step"]: {k: r.get(k) for k in keys} for r in read_metrics(d) if r.get("phase") == "train"}
    assert steps(run_dir) == steps(straight)
    rows = lambda d: [[r["row"] for r in map(json.loads, (d / "samples" / f"step-{s:08d}.jsonl").open())]
                      for s in range(3, 9)]  # the RL steps (1-2 warm up)
    assert rows(run_dir) == rows(straight)  # the same rows, step for step


def test_two_fsdp_ranks_with_shuffled_mini_batches_and_two_epochs_finish_as_one_rank(tmp_path):
    """With several mini-batches a rank's micro-batch may hold whole groups (the prompt run once,
    then the responses: two forwards) while another's does not (one forward), or a rank has no
    rows left and runs a one-row stand-in: under fsdp each forward is a collective, and the ranks
    hung there until both took the same form (parallel.Sharded.same_path)."""
    import os
    import signal
    import subprocess

    from rl_helpers import exit_file_code, start_torchrun

    one, two = tmp_path / "one", tmp_path / "two"
    args = {**CODE_REPAIR, "ppo_epochs": 2, "mini_batches": 2, "total_steps": 4}
    write_config(one, **args)
    rc, out, err = run_trainer(one, **_sandbox_env())
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    write_config(two, **args, parallel="fsdp")
    proc = start_torchrun(two, 2, **_sandbox_env())
    try:  # a bound for the hang this test is about, far above the ~20 s the run takes
        out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("two fsdp ranks hung in their update (their forwards took different forms)")
    assert proc.returncode == 0 and exit_file_code(two) == protocol.EXIT_COMPLETE, err[-3000:]
    losses = lambda d: [r["loss"] for r in read_metrics(d) if r.get("phase") == "train"]
    assert len(losses(one)) == 4 and losses(two) == pytest.approx(losses(one), rel=1e-3, abs=1e-6)
    # the reward's figures are the whole batch's on two ranks too (rank 0's half was logged before)
    figures = lambda d: [{k: v for k, v in r.items() if k.startswith(("reward/", "env/"))}
                         for r in read_metrics(d) if r.get("phase") == "train"]
    assert all("reward/reason/syntax_error" in f for f in figures(one)), figures(one)
    assert figures(two) == [pytest.approx(f, abs=2e-6) for f in figures(one)], (figures(one), figures(two))


def test_code_repair_on_rows_without_tests_is_a_one_line_error_at_the_start(tmp_path):
    write_config(tmp_path, env="code-repair")  # countdown rows: no tests to show or hold out
    rc, out, err = run_trainer(tmp_path)
    assert rc == 2, err[-2000:]
    assert "hpcrl.rl: error: env code-repair: ground_truth must be {'tests': [...]}" in err
    assert "Traceback" not in err and not (tmp_path / "checkpoints").exists()


def test_two_fsdp_ranks_take_the_same_episodes_as_one(tmp_path):
    """Each rank runs its own episodes, turn by turn, and the ranks agree once a turn whether any has
    live ones (fsdp gathers the weights once for all the turns): the same episodes, from streams
    keyed by prompt position and not by rank, as on one rank. One update per step (several:
    the next test)."""
    from rl_helpers import exit_file_code, start_torchrun

    one, two = tmp_path / "one", tmp_path / "two"
    args = {**CODE_REPAIR, "ppo_epochs": 1, "mini_batches": 1}
    write_config(one, **args)
    rc, out, err = run_trainer(one, **_sandbox_env())
    assert rc == protocol.EXIT_COMPLETE, err[-3000:]
    write_config(two, **args, parallel="fsdp")
    proc = start_torchrun(two, 2, **_sandbox_env())
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and exit_file_code(two) == protocol.EXIT_COMPLETE, err[-3000:]
    keys = ("step", "reward_mean", "reward_std", "response_len_mean", "env/turns_mean", "env/turns_max",
            "env/env_tokens_mean", "env/term/heldout", "env/cut_by_tokens")
    steps = lambda d: {r["step"]: {k: r.get(k) for k in keys} for r in read_metrics(d) if r.get("phase") == "train"}
    assert steps(two) == steps(one) and len(steps(one)) == 6
    losses = lambda d: [r["loss"] for r in read_metrics(d) if r.get("phase") == "train"]
    assert losses(two) == pytest.approx(losses(one), rel=1e-3, abs=1e-6)
