"""What a render names beyond the default package index, and the manifest of what was published
(hpcrl/artifacts.yaml: each file with the public source that shows it exists and the date read).

A render names three kinds of artifact that no default-index resolve can vouch for:
- index options: `--extra-index-url URL` / `--index-url URL`, and uv's `--torch-backend=B`
  (which reads https://download.pytorch.org/whl/B);
- direct URLs: `name @ https://...whl`, `name @ git+https://...@commit`;
- local-version pins: `name==V+local` (+cu129, +cpu): only an index other than PyPI serves those.
`extract` finds them in any text (a script, its requirement comments, a written installer);
`unlisted` says which of them the manifest does not hold. Pure: no network (hpcrl/published.py asks
the real indexes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .resolve import canonical  # PEP 503's name normalisation, one definition

MANIFEST = Path(__file__).with_name("artifacts.yaml")
TORCH_BACKEND_INDEX = "https://download.pytorch.org/whl/{backend}"

_INDEX = re.compile(r"--(?:extra-)?index-url[= ]+['\"]?((?:https?|file)://[^\s'\"]+)")
_BACKEND = re.compile(r"--torch-backend[= ]+['\"]?([A-Za-z0-9.]+)")
_DIRECT = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*@\s*((?:git\+)?https?://[^\s'\"]+)")
# a version then +local; the name may carry extras (maxtext[tpu-post-train]==...)
_LOCAL_PIN = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.!]*)\+([A-Za-z0-9.]+)")


@dataclass(frozen=True)
class Artifact:
    kind: str         # "index" | "url" | "pin"
    value: str        # the index URL, the direct URL, or name==version+variant
    package: str = ""
    version: str = ""
    variant: str = ""

    def __str__(self) -> str:
        return {"index": f"index {self.value}", "url": f"{self.package} @ {self.value}"}.get(self.kind, self.value)


def _index_key(url: str) -> str:
    return url.rstrip("/")


def extract(text: str) -> list[Artifact]:
    """Every index option, direct URL and local-version pin named in `text`, in order, once each."""
    found: dict[tuple, Artifact] = {}

    def add(a: Artifact) -> None:
        found.setdefault((a.kind, a.value), a)

    spans = []  # where a found item sits in the text, to put them in order
    for m in _INDEX.finditer(text):
        spans.append((m.start(), Artifact("index", _index_key(m.group(1)))))
    for m in _BACKEND.finditer(text):
        spans.append((m.start(), Artifact("index", TORCH_BACKEND_INDEX.format(backend=m.group(1)))))
    for m in _DIRECT.finditer(text):
        url = m.group(2).rstrip(".,;)")
        spans.append((m.start(), Artifact("url", url, package=canonical(m.group(1)))))
    for m in _LOCAL_PIN.finditer(text):
        name, version, variant = canonical(m.group(1)), m.group(2), m.group(3).rstrip(".")
        spans.append((m.start(), Artifact("pin", f"{name}=={version}+{variant}", name, version, variant)))
    for _, a in sorted(spans, key=lambda s: s[0]):
        add(a)
    return list(found.values())


def load(path: Path = MANIFEST) -> dict:
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return {"indexes": list(data.get("indexes") or []), "files": list(data.get("files") or [])}


def unlisted(artifacts: list[Artifact], manifest: dict) -> list[Artifact]:
    """The artifacts the manifest does not hold (empty: every one has a cited source)."""
    indexes = {_index_key(str(e["url"])) for e in manifest["indexes"]}
    urls = {str(e["url"]) for e in manifest["files"] if e.get("url")}
    pins = {(canonical(str(e["package"])), str(e["version"]), str(e["variant"]))
            for e in manifest["files"] if e.get("variant")}
    out = []
    for a in artifacts:
        held = {"index": a.value in indexes, "url": a.value in urls,
                "pin": (a.package, a.version, a.variant) in pins}[a.kind]
        if not held:
            out.append(a)
    return out


def problems(manifest: dict) -> list[str]:
    """Entries that could not show what they claim: no source, no date, a pin without its index."""
    out = []
    indexes = {_index_key(str(e.get("url"))) for e in manifest["indexes"]}
    for e in manifest["indexes"] + manifest["files"]:
        label = e.get("url") or f"{e.get('package')}=={e.get('version')}"
        if not e.get("source"):
            out.append(f"{label}: no public source")
        if not re.match(r"^\d{4}-\d\d-\d\d$", str(e.get("checked") or "")):
            out.append(f"{label}: no date checked (YYYY-MM-DD)")
    for e in manifest["files"]:
        if e.get("variant") and _index_key(str(e.get("index"))) not in indexes:
            out.append(f"{e['package']}=={e['version']}+{e['variant']}: its index {e.get('index')} is not listed")
        if e.get("file") and not str(e["file"]).startswith(
                f"{str(e['package']).replace('-', '_')}-{e['version']}{'+' + str(e['variant']) if e.get('variant') else ''}-"):
            out.append(f"{e['package']}: file {e['file']} is not of version {e['version']}")
    return out
