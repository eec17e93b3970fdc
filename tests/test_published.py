"""The login-node check that every file a venv pins beyond the default index is published for the
compute nodes (hpcrl/published.py), against a real package index served on loopback.

The index is Python's own http.server (a real process on 127.0.0.1) serving a PEP 503 tree built
in tmp_path from hpcrl/artifacts.yaml: the files perlmutter's venv pins, with the names the
manifest records. Some cases leave a file out or give it a newer glibc tag. HPCRL_INDEX_MAP points
the check's requests for download.pytorch.org and wheels.vllm.ai at it; the requirement set is
the one `hpcrl render --site perlmutter` renders, unchanged. The wheel files are empty: the check
reads only the index pages (and HEAD for direct URLs), as pip would before downloading.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import hpcrl
from hpcrl import artifacts, published

REAL = {"pytorch": "https://download.pytorch.org/whl", "vllm": "https://wheels.vllm.ai"}


@pytest.fixture
def index_server(tmp_path):
    """(root directory served, base URL): http.server on a free loopback port, stopped after."""
    root = tmp_path / "index"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
                             "--directory", str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (...)": it listens once this is printed
        port = re.search(r"port (\d+)", line)
        assert port, f"http.server did not start: {line!r}"
        yield root, f"http://127.0.0.1:{port.group(1)}"
    finally:
        proc.kill()
        proc.wait()


def populate(root: Path, drop: str | None = None, retag: dict | None = None) -> list[str]:
    """The manifest's perlmutter files as a PEP 503 tree under root/pytorch and root/vllm (less
    `drop`; `retag`: file -> the name to publish it under instead). Returns the files written."""
    written = []
    for e in artifacts.load()["files"]:
        index = str(e.get("index") or "")
        base = next((k for k, url in REAL.items() if index.startswith(url)), None)
        if base is None or e.get("variant") == "cpu" or e["file"] == drop:
            continue
        name = (retag or {}).get(e["file"], e["file"])
        where = root / base / index[len(REAL[base]):].strip("/") / artifacts.canonical(e["package"])
        where.mkdir(parents=True, exist_ok=True)
        (where / name).write_bytes(b"")
        written.append(name)
    # what a real project page also lists: other versions and the default CUDA 13 build
    other = root / "vllm" / "0.24.0" / "cu129" / "vllm"
    other.mkdir(parents=True, exist_ok=True)
    (other / "vllm-0.23.0+cu129-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    return written


def env_for(base: str) -> dict:
    return {"HPCRL_INDEX_MAP": f"{REAL['pytorch']}={base}/pytorch,{REAL['vllm']}={base}/vllm"}


VLLM = "vllm-0.24.0+cu129-cp38-abi3-manylinux_2_28_x86_64.whl"


def venv_build(tmp_path: Path, env: dict, *extra: str):
    """`hpcrl venv build` of gsm8k-grpo for perlmutter, its venv under tmp_path (this machine has no
    `module` command, so a build the check lets through fails at once, before pip runs)."""
    spec = tmp_path / "spec.yaml"
    if not spec.exists():
        hpcrl("init", "--recipe", "gsm8k-grpo", "--out", spec)
    return hpcrl("venv", "build", spec, "--site", "perlmutter", "--account", "m1234_g", "--hours", "4",
                 "--set", f"site.venv_root={tmp_path / 'venvs'}", *extra, check=False,
                 env={"HPCRL_HOME": str(tmp_path / "home"), "SCRATCH": str(tmp_path / "scratch"), **env})


def perlmutter_requirements() -> tuple[list[str], dict]:
    from hpcrl import spec, venv

    resolved = spec.resolve(str(Path(artifacts.__file__).parent / "recipes" / "gsm8k-grpo.yaml"), "perlmutter",
                            flags={"account": "m1234_g", "hours": 4})
    return venv.requirements(resolved), resolved["site"]


def test_every_pinned_file_present_passes(tmp_path, index_server, monkeypatch):
    root, base = index_server
    written = populate(root)
    monkeypatch.setenv("HPCRL_INDEX_MAP", env_for(base)["HPCRL_INDEX_MAP"])
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))  # Perlmutter's, where the site's caches go
    reqs, site = perlmutter_requirements()
    warned = []
    out = published.check(reqs, site, warn=warned.append)
    assert not warned
    assert sorted(c.split(":")[0] for c in out.checked) == ["torch==2.11.0+cu129", "vllm==0.24.0+cu129"], out.checked
    assert VLLM in written and any(VLLM in c for c in out.checked)
    # through the CLI: the check lets it through to the build itself
    proc = venv_build(tmp_path, env_for(base))
    assert "building venv" in proc.stderr and "not published" not in proc.stderr, proc.stderr


def test_the_vllm_cu129_file_absent_refuses_in_one_line_naming_it(tmp_path, index_server):
    root, base = index_server
    populate(root, drop=VLLM)
    proc = venv_build(tmp_path, env_for(base))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "vllm==0.24.0+cu129" in lines[0] and "vllm-0.24.0+cu129-*.whl" in lines[0], lines[0]
    assert "https://wheels.vllm.ai/0.24.0/cu129/vllm/" in lines[0]  # the real index, as the user knows it
    assert "cuda_variant" in lines[0] and "--no-check-artifacts" in lines[0]  # what to change
    assert "building venv" not in proc.stderr and not (tmp_path / "venvs").exists(), "nothing half-written"


def test_a_glibc_tag_too_new_for_the_nodes_refuses(tmp_path, index_server):
    root, base = index_server
    newer = VLLM.replace("manylinux_2_28", "manylinux_2_35")
    populate(root, retag={VLLM: newer})
    proc = venv_build(tmp_path, env_for(base))
    assert proc.returncode != 0
    [line] = proc.stderr.strip().splitlines()
    assert newer in line and "needs glibc 2.35" in line and "have 2.31 (site gpu_stack.glibc)" in line, line
    # the same file is fine for nodes with a newer glibc (the site's fact decides)
    proc = venv_build(tmp_path, env_for(base), "--set", "site.gpu_stack.glibc=2.35")
    assert "building venv" in proc.stderr, proc.stderr


def test_no_network_warns_in_one_line_and_builds(tmp_path, index_server):
    root, base = index_server
    populate(root, drop=VLLM)
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
    proc = venv_build(tmp_path, env_for(closed))
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "could not check" in warnings[0] and "127.0.0.1:9" not in warnings[0] \
        and "download.pytorch.org" in warnings[0], proc.stderr
    assert "building venv" in proc.stderr


def test_no_check_artifacts_skips_the_check(tmp_path, index_server):
    root, base = index_server
    populate(root, drop=VLLM)
    proc = venv_build(tmp_path, env_for(base), "--no-check-artifacts")
    assert "vllm==0.24.0+cu129" not in proc.stderr and "building venv" in proc.stderr, proc.stderr


def test_a_direct_url_that_is_not_there_refuses(tmp_path, index_server, monkeypatch):
    root, base = index_server
    (root / "here.whl").write_bytes(b"")
    out = published.check([f"a @ {base}/here.whl"], {})
    assert out.checked == [f"a @ {base}/here.whl"]
    with pytest.raises(published.NotPublished, match=r"^b @ http://127\.0\.0\.1:\d+/gone\.whl: not found \(HTTP 404\)"):
        published.check([f"b @ {base}/gone.whl"], {})


def test_a_local_pin_without_an_index_option_refuses():
    with pytest.raises(published.NotPublished, match=r"^torch==2\.11\.0\+cu129: a local-version pin with no"):
        published.check(["torch==2.11.0+cu129"], {})


def test_plain_pins_and_sets_without_builds_ask_nothing(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("asked the network")

    monkeypatch.setattr(published, "_open", no_network)
    assert published.check(["torch==2.11.0", "numpy>=1.26", "vllm @ git+https://github.com/x/y@abc"], {}).checked == []


# ------------------------------------------------------------------ wheel tags


@pytest.mark.parametrize("filename,python,glibc,ok,needs", [
    ("vllm-0.24.0+cu129-cp38-abi3-manylinux_2_28_x86_64.whl", (3, 12), (2, 31), True, (2, 28)),
    ("vllm-0.24.0+cu129-cp38-abi3-manylinux_2_35_x86_64.whl", (3, 12), (2, 31), False, (2, 35)),
    ("torch-2.11.0+cu129-cp312-cp312-manylinux_2_28_x86_64.whl", (3, 12), (2, 31), True, (2, 28)),
    ("torch-2.11.0+cu129-cp313-cp313-manylinux_2_28_x86_64.whl", (3, 12), (2, 31), False, None),
    ("torch-2.11.0+cu129-cp312-cp312-manylinux_2_28_aarch64.whl", (3, 12), (2, 31), False, None),
    ("torch-2.11.0+cu129-cp312-cp312-win_amd64.whl", (3, 12), (2, 31), False, None),
    ("x-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 12), (2, 17), True, (2, 17)),
    ("x-1.0-cp312-cp312-manylinux1_x86_64.whl", (3, 12), (2, 17), True, (2, 5)),
    ("x-1.0-py3-none-any.whl", (3, 12), (2, 17), True, None),
    ("x-1.0-cp313-abi3-manylinux_2_28_x86_64.whl", (3, 12), (2, 31), False, None),
])
def test_wheel_tags_against_the_nodes(filename, python, glibc, ok, needs):
    wheel = published.parse_wheel(filename)
    assert published.fits(wheel, published.Target(python, glibc, "x86_64")) == (ok, needs)


def test_the_nodes_platform_comes_from_the_site():
    t = published.target({"gpu_stack": {"python_version": "3.12", "glibc": "2.31"}})
    assert (t.python, t.glibc, t.glibc_from) == ((3, 12), (2, 31), "site gpu_stack.glibc")
    assert published.target({}).glibc_from == "this machine's glibc"


def test_the_index_map_rewrites_only_its_prefixes(monkeypatch):
    monkeypatch.setenv("HPCRL_INDEX_MAP", "https://wheels.vllm.ai=http://127.0.0.1:1/v")
    assert published.mapped("https://wheels.vllm.ai/0.24.0/cu129/vllm/") == "http://127.0.0.1:1/v/0.24.0/cu129/vllm/"
    assert published.mapped("https://download.pytorch.org/whl/cu129/") == "https://download.pytorch.org/whl/cu129/"


def test_submit_refuses_before_anything_queues(tmp_path, index_server):
    """`hpcrl submit` runs the same check before its venv build: refused in one line, no run left."""
    root, base = index_server
    populate(root, drop=VLLM)
    venv_build(tmp_path, env_for(base))  # writes the spec
    proc = hpcrl("submit", tmp_path / "spec.yaml", "--site", "perlmutter", "--account", "m1234_g", "--hours", "4",
                 "--set", f"site.venv_root={tmp_path / 'venvs'}", check=False,
                 env={"HPCRL_HOME": str(tmp_path / "home"), "SCRATCH": str(tmp_path / "scratch"), **env_for(base)})
    assert proc.returncode != 0 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert "vllm==0.24.0+cu129" in line and "vllm-0.24.0+cu129-*.whl" in line, line
    assert not any((tmp_path / "home").rglob("state.json")), "a refused submit leaves no run"


def test_an_index_away_never_turns_into_a_refusal(tmp_path, index_server, monkeypatch):
    """torch's index unreachable, vLLM's answering without torch: torch may be on the one not asked."""
    root, base = index_server
    populate(root)
    monkeypatch.setenv("HPCRL_INDEX_MAP", f"{REAL['pytorch']}=http://127.0.0.1:9/pytorch,{REAL['vllm']}={base}/vllm")
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    reqs, site = perlmutter_requirements()
    warned = []
    out = published.check(reqs, site, warn=warned.append)
    assert [c.split(":")[0] for c in out.checked] == ["vllm==0.24.0+cu129"]
    assert len(warned) == 1 and "download.pytorch.org" in warned[0]
