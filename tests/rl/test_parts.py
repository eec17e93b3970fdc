"""Checkpoints written in parts (hpcrl/checkpoints/trainer/parts.py), in one process: two Checkpointers on one
store play rank 0 and rank 1 (threads, as the background writers of two ranks run), so what
the ranks agree on through the temporary directory is tested without torchrun; the torchrun
runs that write and read such checkpoints for real are in test_dist.py. A plain (unsharded)
model gives fsdp.owned_part the same whole tensors it gathers from shards."""

import pytest
import torch

from hpcrl.checkpoints import store as ckpt_store
from hpcrl.rl import fsdp, policy
from hpcrl.checkpoints.trainer import checkpointer, parts
from hpcrl.rl.tiny import build_tiny_model

from rl_helpers import as_two_ranks, checkpoint_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "model", hidden_size=32, layers=2, heads=2, max_int=60)


@pytest.fixture(scope="module")
def trained(model_dir):
    model, tok = policy.load_policy(model_dir, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return model, tok, opt


def save_in_parts(store_dir, model, opt, tok, step, world=2, broken_rank=None, silent_rank=None, blocked_rank=None,
                  wait_s=30.0, ref=None):
    """Every rank's save_part into one temporary directory; each rank's error (or None)."""
    savers = [checkpointer.Checkpointer(store_dir, keep_last=3, async_save=True, tokenizer=tok) for _ in range(world)]
    tmp = savers[0].store.new_tmp_dir()
    if blocked_rank is not None:  # a directory where its model file goes: its open() fails (an OSError)
        (tmp / parts.part_name("model", blocked_rank, world)).mkdir()
    errors = [None] * world
    for rank in range(world):
        if rank == silent_rank:
            continue
        part, index = fsdp.owned_part(model, opt, rank, world, ref)
        if rank == broken_rank:  # a tensor safetensors cannot hold: this rank's write fails
            part["model"]["bad"] = torch.zeros(2, dtype=torch.complex64)
        common = None
        if rank == 0:
            common = {"ref": None, "rng": checkpointer.rng_state(), "state": {"step": step}, "config": model.config,
                      "index": index}
        savers[rank].save_part(step, tmp, part, rank, world, common, wait_s=wait_s)
    for rank in range(world):
        try:
            savers[rank].wait()
        except Exception as e:
            errors[rank] = e
    return tmp, errors


def test_two_ranks_parts_make_one_checkpoint_every_world_size_reads(trained, model_dir, tmp_path):
    model, tok, opt = trained
    tmp, errors = save_in_parts(tmp_path / "ckpt", model, opt, tok, step=4)
    assert errors == [None, None]
    step, path = ckpt_store.CheckpointStore(tmp_path / "ckpt").find_latest()
    assert step == 4 and not tmp.exists()
    names = sorted(p.name for p in path.iterdir())
    assert [n for n in names if parts.is_part(n)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"]
    assert parts.MODEL_INDEX in names and not [n for n in names if n.startswith(".part")]
    manifest = ckpt_store.read_manifest(path)["files"]
    for name in names:  # every rank's digest reached the manifest, and it is the file's
        if name != ckpt_store.MANIFEST_FILE:
            assert manifest[name][ckpt_store.digest_algorithm()] == ckpt_store.file_digest(path / name), name
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert checkpoint_model(path).keys() == want.keys()
    # a 1-rank process loads it: each part file into the parameters its index names
    fresh, _ = policy.load_policy(model_dir, torch.device("cpu"))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    assert checkpointer.load_into(path, fresh, fresh_opt)["step"] == 4
    assert all(torch.equal(want[k], v) for k, v in fresh.state_dict().items())
    got, ref = fresh_opt.state_dict(), opt.state_dict()
    assert got["param_groups"] == ref["param_groups"] and got["state"].keys() == ref["state"].keys()
    for i, per in ref["state"].items():
        for key, value in per.items():
            assert torch.equal(got["state"][i][key], value), (i, key)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(loaded[k], want[k]) for k in want if k in loaded)


def test_the_shares_are_balanced_and_dealt_round_robin(trained, tmp_path):
    model, tok, opt = trained
    save_in_parts(tmp_path / "ckpt", model, opt, tok, step=2)
    path = ckpt_store.CheckpointStore(tmp_path / "ckpt").find_latest()[1]
    files = ckpt_store.read_manifest(path)["files"]
    sizes = [files[parts.part_name("model", r, 2)]["size"] for r in (0, 1)]
    biggest = max(v.numel() * v.element_size() for v in model.state_dict().values())
    assert abs(sizes[0] - sizes[1]) <= biggest + 4096  # greedy: within one tensor (and the headers)
    shares = [parts.read_share(path, files, r, 2) for r in (0, 1)]
    # rank 0: model-1 and optimizer-1; rank 1: model-2 and optimizer-2; together all, no overlap
    assert not shares[0][0].keys() & shares[1][0].keys()
    assert shares[0][0].keys() | shares[1][0].keys() == model.state_dict().keys()
    assert len(shares[0][2]) == len(shares[1][2]) == 1


def test_a_rank_that_fails_its_part_fails_the_save_and_leaves_no_checkpoint(trained, tmp_path):
    model, tok, opt = trained
    save_in_parts(tmp_path / "ckpt", model, opt, tok, step=2)
    tmp, errors = save_in_parts(tmp_path / "ckpt", model, opt, tok, step=4, broken_rank=1)
    assert "rank 1 failed to write its part" in str(errors[0]) and errors[1] is not None
    store = ckpt_store.CheckpointStore(tmp_path / "ckpt")
    assert store.find_latest()[0] == 2 and store.latest_step() == 2  # the previous one stays the newest
    assert not tmp.exists()  # rank 0 removed the half-written directory


def test_a_rank_whose_write_fails_with_an_os_error_passes_it_on_as_one(trained, tmp_path):
    """(A full disk is an OSError: rank 0 must see one to say 'disk full at PATH'.)"""
    import errno

    model, tok, opt = trained
    tmp, errors = save_in_parts(tmp_path / "ckpt", model, opt, tok, step=4, blocked_rank=1)
    assert isinstance(errors[0], OSError) and errors[0].errno == errno.EISDIR, errors
    assert errors[0].filename == str(tmp / "model-00002-of-00002.safetensors")
    assert isinstance(errors[1], IsADirectoryError)
    assert ckpt_store.CheckpointStore(tmp_path / "ckpt").find_latest() is None and not tmp.exists()


def test_a_rank_that_never_reports_times_the_save_out(trained, tmp_path):
    model, tok, opt = trained
    tmp, errors = save_in_parts(tmp_path / "ckpt", model, opt, tok, step=4, silent_rank=1, wait_s=0.5)
    assert isinstance(errors[0], TimeoutError) and "ranks [1] did not write" in str(errors[0])
    assert ckpt_store.CheckpointStore(tmp_path / "ckpt").find_latest() is None and not tmp.exists()


def test_a_damaged_part_is_refused_by_the_rank_that_reads_it(trained, tmp_path):
    from helpers import flip_bit

    model, tok, opt = trained
    save_in_parts(tmp_path / "ckpt", model, opt, tok, step=2)
    path = ckpt_store.CheckpointStore(tmp_path / "ckpt").find_latest()[1]
    flip_bit(path / "optimizer-00002-of-00002.safetensors")
    files = ckpt_store.read_manifest(path)["files"]
    parts.read_share(path, files, 0, 2)  # rank 0 does not read that file
    with pytest.raises(checkpointer.CorruptFile, match="optimizer-00002-of-00002.safetensors: fails its"):
        parts.read_share(path, files, 1, 2)


def test_assign_is_deterministic_and_whole_tensors():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    owner = parts.assign(sizes, 2)
    assert owner == parts.assign(dict(reversed(list(sizes.items()))), 2)
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert set(parts.assign(sizes, 8).values()) == {0, 1, 2, 3}  # more ranks than tensors: some write none


def test_export_of_a_checkpoint_in_parts_is_a_sharded_model_directory(home, trained, model_dir, tmp_path):
    """`hpcrl export` of an fsdp run: the model's parts and index come out (checked against the
    manifest), the optimizer's parts do not, and from_pretrained loads the directory."""
    from transformers import AutoModelForCausalLM

    from hpcrl import control
    from hpcrl.spec import resolve

    from helpers import hpcrl

    model, tok, opt = trained
    run = control.create_run(resolve(None, "local", [f"args.model={model_dir}"], {"trainer": "builtin"}), "fs")
    _, errors = save_in_parts(run.layout.checkpoints, model, opt, tok, step=6)
    assert errors == [None, None]
    out = tmp_path / "hf"
    hpcrl("export", "fs", "--out", out)
    names = sorted(p.name for p in out.iterdir())
    assert "model-00001-of-00002.safetensors" in names and parts.MODEL_INDEX in names
    assert not [n for n in names if n.startswith("optimizer")] and "rng.pt" not in names
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = model.state_dict()
    assert all(torch.equal(loaded[k], want[k]) for k in want if k in loaded)


def test_ranks_that_see_different_newest_checkpoints_fail_together(trained, tmp_path):
    """A run directory that is not one file system for every node: rank 0 finds step 4, rank 1
    only step 2. Both ranks stop at the same gather with the reason, rather than loading two
    different checkpoints into one model."""
    model, tok, opt = trained
    save_in_parts(tmp_path / "node0", model, opt, tok, step=2)
    save_in_parts(tmp_path / "node0", model, opt, tok, step=4)
    save_in_parts(tmp_path / "node1", model, opt, tok, step=2)

    def resume(rank, gather):
        ckpt = checkpointer.Checkpointer(tmp_path / f"node{rank}", keep_last=3, async_save=False, tokenizer=tok)
        return checkpointer.restore_share(ckpt, rank, 2, gather)

    errors = as_two_ranks(resume)
    assert all(isinstance(e, checkpointer.RanksDisagree) for e in errors), errors
    assert str(errors[0]) == str(errors[1]) and "different newest checkpoints (steps [2, 4])" in str(errors[0])
    assert "a file system every node shares" in str(errors[0])


def test_ranks_that_agree_resume_the_same_step_with_their_own_shares(trained, tmp_path):
    model, tok, opt = trained
    save_in_parts(tmp_path / "ckpt", model, opt, tok, step=4)

    def resume(rank, gather):
        ckpt = checkpointer.Checkpointer(tmp_path / "ckpt", keep_last=3, async_save=False, tokenizer=tok)
        step, path, share = checkpointer.restore_share(ckpt, rank, 2, gather)
        return step, path.name, set(share[0])

    got = as_two_ranks(resume)
    assert got[0][:2] == got[1][:2] and got[0][0] == 4
    assert got[0][2] and got[1][2] and not got[0][2] & got[1][2]  # disjoint shares of the tensors
    assert got[0][2] | got[1][2] == set(model.state_dict())


def test_the_trainer_reports_ranks_that_disagree_in_one_line(tmp_path, monkeypatch, capsys):
    """train.main turns it into the one-line reason `status` shows (stderr and trainer_error.txt),
    exit 1, no traceback. The trainer's run is a stand-in that raises it; the rest is real."""
    from hpcrl import protocol
    from hpcrl.rl import loop, train

    from helpers import protocol_env
    from rl_helpers import write_config

    class Disagreeing:
        def __init__(self, cfg, ctx, stop):
            pass

        def run(self):
            raise checkpointer.RanksDisagree("the ranks see different newest checkpoints (steps [2, 4]): ...")

    config = write_config(tmp_path)
    for key, value in protocol_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(protocol, "StopFlag", lambda ctx: None)  # keep pytest's own signal handlers
    monkeypatch.setattr(loop, "RLTrainer", Disagreeing)
    assert train.main(["--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err == "hpcrl.rl: error: the ranks see different newest checkpoints (steps [2, 4]): ...\n"
    assert (tmp_path / protocol.ERROR_FILE).read_text().startswith("the ranks see different newest")


def test_the_reference_is_written_in_parts_and_read_back_by_one_rank_and_by_shares(trained, model_dir, tmp_path):
    """The KL reference of an fsdp run (after a warm-up it is not the base model) goes in parts
    with the model's names and the model's index: a 1-rank load fills the reference, the shares
    of two ranks hold all of it between them, and export leaves it out."""
    model, tok, opt = trained
    ref, _ = policy.load_policy(model_dir, torch.device("cpu"))  # the base model: unlike the trained one
    assert any(not torch.equal(a, b) for a, b in zip(ref.state_dict().values(), model.state_dict().values()))
    save_in_parts(tmp_path / "ckpt", model, opt, tok, step=2, ref=ref)
    path = ckpt_store.CheckpointStore(tmp_path / "ckpt").find_latest()[1]
    files = ckpt_store.read_manifest(path)["files"]
    assert parts.files_of(files, "ref") == ["ref-00001-of-00002.safetensors", "ref-00002-of-00002.safetensors"]
    fresh, _ = policy.load_policy(model_dir, torch.device("cpu"))
    fresh_ref, _ = policy.load_policy(model_dir, torch.device("cpu"))
    with torch.no_grad():
        for p in fresh_ref.parameters():
            p.zero_()
    checkpointer.load_into(path, fresh, torch.optim.AdamW(fresh.parameters()), fresh_ref)
    assert all(torch.equal(v, fresh_ref.state_dict()[k]) for k, v in ref.state_dict().items())
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    shares = [parts.read_share(path, files, r, 2) for r in (0, 1)]
    # six files dealt round-robin: rank 0 model-1, optimizer-1, ref-1; rank 1 the -2 files
    assert not shares[0][3].keys() & shares[1][3].keys()
    assert shares[0][3].keys() | shares[1][3].keys() == ref.state_dict().keys()
    assert all(torch.equal(v, ref.state_dict()[k]) for s in shares for k, v in s[3].items())
    assert parts.read_share(path, files, 0, 2, ref=False)[3] == {}  # a run without a reference reads none
    from hpcrl.export import _resume_only

    assert _resume_only("ref-00001-of-00002.safetensors") and not _resume_only("model-00001-of-00002.safetensors")
