"""Every artifact a render names beyond the default index is in the cited manifest (issue 39).

Each shipped recipe is rendered as a user renders it (`hpcrl init --recipe`, `hpcrl render`): the
MaxText recipes for every TPU site, every other recipe for perlmutter (the GPU site whose
gpu_stack pins builds). Every index option, direct URL and local-version pin (+cuNNN, +cpu) in the
script, in the files the trainer writes beside it (MaxText's installer) and in what that
installer installs (the GitHub-pinned commits) must be held by hpcrl/artifacts.yaml, which names
for each the public source that shows it was published. This machine cannot reach those hosts:
the manifest is the check here, and a stand-in (tests/test_resolve.py) never decides existence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import ROOT, hpcrl
from hpcrl import artifacts
from test_render import FIXED

RECIPES = sorted(p.stem for p in (ROOT / "hpcrl" / "recipes").glob("*.yaml"))
TPU_SITES = sorted(p.stem for p in (ROOT / "site_configs").glob("*.yaml")
                   if yaml.safe_load(p.read_text(encoding="utf-8")).get("scheduler") == "tpu")
GPU_SITE = ["--site", "perlmutter", "--account", "m1234_g", "--hours", "4", "--total-hours", "8"]
TPU_SET = ["--hours", "4", "--set", "site.project=hpcrl-demo", "--set", "site.zone=us-east5-a",
           "--set", "site.bucket=gs://hpcrl-demo-bucket"]


def trainer_of(recipe: str) -> str:
    return yaml.safe_load((ROOT / "hpcrl" / "recipes" / f"{recipe}.yaml").read_text(encoding="utf-8"))["trainer"]


CASES = [(r, s) for r in RECIPES if trainer_of(r) == "maxtext" for s in TPU_SITES] + \
        [(r, "perlmutter") for r in RECIPES if trainer_of(r) != "maxtext"]


def rendered(tmp_path: Path, recipe: str, site: str) -> str:
    """What a user's render names: the script, plus for MaxText the installer and overrides the
    run directory gets (Trainer.files) and the commits that installer's MaxText command installs."""
    spec = tmp_path / f"{recipe}.yaml"
    hpcrl("init", "--recipe", recipe, "--out", spec, env=FIXED)
    args = GPU_SITE if site == "perlmutter" else ["--site", site, *TPU_SET]
    text = hpcrl("render", spec, *args, "--name", "art", env=FIXED).stdout
    if trainer_of(recipe) == "maxtext":
        from hpcrl.trainers.maxtext import MaxTextTrainer, tpu_github_deps

        text += "\n" + "\n".join(MaxTextTrainer().files(None).values()) + "\n" + "\n".join(tpu_github_deps())
    return text


def test_every_recipe_is_covered():
    assert {r for r, _ in CASES} == set(RECIPES) and TPU_SITES and "perlmutter" in {s for _, s in CASES}


@pytest.mark.parametrize("recipe,site", CASES)
def test_every_artifact_a_render_names_is_in_the_manifest(tmp_path, recipe, site):
    text = rendered(tmp_path, recipe, site)
    found = artifacts.extract(text)
    missing = artifacts.unlisted(found, artifacts.load())
    assert not missing, (f"{recipe} on {site} names artifacts hpcrl/artifacts.yaml does not hold (add each with "
                         f"the public source that shows it was published): " + "; ".join(map(str, missing)))


def test_the_gpu_and_tpu_renders_name_what_the_manifest_is_for(tmp_path):
    """The check above is not vacuous: the renders do name pinned builds (a render that named none
    would pass it trivially)."""
    gpu = {str(a) for a in artifacts.extract(rendered(tmp_path, "verl-gsm8k-grpo", "perlmutter"))}
    assert {"index https://download.pytorch.org/whl/cu129", "index https://wheels.vllm.ai/0.24.0/cu129",
            "torch==2.11.0+cu129", "torchvision==0.26.0+cu129", "torchaudio==2.11.0+cu129",
            "vllm==0.24.0+cu129"} <= gpu, gpu
    tpu = {a.kind for a in artifacts.extract(rendered(tmp_path, "maxtext-llama3.1-8b-grpo", TPU_SITES[0]))}
    assert tpu == {"index", "url", "pin"}, tpu


def test_every_manifest_entry_cites_a_source_and_a_date():
    assert artifacts.problems(artifacts.load()) == []


def test_the_manifest_ships_inside_the_package():
    assert artifacts.MANIFEST.parent == ROOT / "hpcrl" and artifacts.MANIFEST.is_file()
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = data["tool"]["setuptools"].get("package-data", {})
    assert any(g in ("*.yaml", "artifacts.yaml") for key in ("hpcrl", "*") for g in globs.get(key, [])), globs


# ------------------------------------------------------------------ the extraction itself


def test_extract_finds_index_options_direct_urls_and_local_pins():
    text = """# Its requirements:
#   --extra-index-url https://download.pytorch.org/whl/cu129
#   --extra-index-url https://wheels.vllm.ai/0.24.0/cu129/
#   torch==2.11.0+cu129
#   maxtext[tpu-post-train]==0.2.5
#   vllm @ https://github.com/vllm-project/vllm/releases/download/v0.24.0/vllm-0.24.0+cu128-cp38-abi3-manylinux_2_28_x86_64.whl
uv pip install --torch-backend=cpu --resolution=lowest -r req.txt
pip install --index-url=https://example.org/simple "x==1.0"
vllm @ git+https://github.com/vllm-project/vllm@d626108b1841888ec90aced33367149a6bbc7e4b
(maxtext[tpu-post-train]==0.2.5: torch==2.11.0+cpu from PyTorch's CPU index)
numpy>=1.26 transformers==5.9.0
"""
    got = [(a.kind, a.value) for a in artifacts.extract(text)]
    assert got == [
        ("index", "https://download.pytorch.org/whl/cu129"),
        ("index", "https://wheels.vllm.ai/0.24.0/cu129"),  # trailing slash: the same index
        ("pin", "torch==2.11.0+cu129"),
        ("url", "https://github.com/vllm-project/vllm/releases/download/v0.24.0/"
                "vllm-0.24.0+cu128-cp38-abi3-manylinux_2_28_x86_64.whl"),
        ("index", "https://download.pytorch.org/whl/cpu"),  # uv's torch backend reads PyTorch's index
        ("index", "https://example.org/simple"),
        ("url", "git+https://github.com/vllm-project/vllm@d626108b1841888ec90aced33367149a6bbc7e4b"),
        ("pin", "torch==2.11.0+cpu"),
    ], got  # plain pins (transformers==5.9.0, maxtext[...]==0.2.5) come from the default index: not artifacts


def test_unlisted_names_what_the_manifest_lacks_and_nothing_else():
    manifest = {"indexes": [{"url": "https://download.pytorch.org/whl/cu129/"}],
                "files": [{"package": "torch", "version": "2.11.0", "variant": "cu129"},
                          {"package": "tpu_inference", "url": "https://x/y.zip"}]}
    found = artifacts.extract("--extra-index-url https://download.pytorch.org/whl/cu129\n"
                              "--extra-index-url https://download.pytorch.org/whl/cu128\n"
                              "torch==2.11.0+cu129\nTorch==2.11.0+cu128\ntorch==2.12.0+cu129\n"
                              "tpu-inference @ https://x/y.zip\ntpu-inference @ https://x/z.zip\n")
    assert [str(a) for a in artifacts.unlisted(found, manifest)] == [
        "index https://download.pytorch.org/whl/cu128", "torch==2.11.0+cu128", "torch==2.12.0+cu129",
        "tpu-inference @ https://x/z.zip"]


def test_todays_never_published_cu128_pins_are_refused():
    """The requirement lines perlmutter rendered before issue 39 (a vLLM +cu128 wheel that was
    never published, from an index the manifest holds no source for)."""
    old = ["--extra-index-url https://download.pytorch.org/whl/cu128", "torch==2.11.0+cu128",
           "vllm @ https://github.com/vllm-project/vllm/releases/download/v0.24.0/"
           "vllm-0.24.0+cu128-cp38-abi3-manylinux_2_28_x86_64.whl"]
    missing = artifacts.unlisted(artifacts.extract("\n".join(old)), artifacts.load())
    assert len(missing) == 3 and "vllm-0.24.0+cu128" in str(missing[-1])


def test_problems_catches_an_entry_without_source_or_date():
    bad = {"indexes": [{"url": "https://i"}],
           "files": [{"package": "torch", "version": "2.11.0", "variant": "cu129", "index": "https://other",
                      "file": "torch-2.12.0+cu129-cp312-cp312-manylinux_2_28_x86_64.whl"}]}
    assert artifacts.problems(bad) == [
        "https://i: no public source", "https://i: no date checked (YYYY-MM-DD)",
        "torch==2.11.0: no public source", "torch==2.11.0: no date checked (YYYY-MM-DD)",
        "torch==2.11.0+cu129: its index https://other is not listed",
        "torch: file torch-2.12.0+cu129-cp312-cp312-manylinux_2_28_x86_64.whl is not of version 2.11.0"]
