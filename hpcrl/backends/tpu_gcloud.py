"""What gcloud's queued-resource output means (pure): the state table, `describe`/`list` JSON as
documented (unknown fields ignored), and gcloud's error texts mapped to the one-line fix."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import BackendError
from .base import JobState

# The one mapping from queued-resource states (state.state) to hpcrl's JobState.
STATES = {
    "CREATING": JobState.PENDING, "ACCEPTED": JobState.PENDING, "WAITING_FOR_RESOURCES": JobState.PENDING,
    "PROVISIONING": JobState.PENDING, "ACTIVE": JobState.RUNNING,
    "SUSPENDING": JobState.PREEMPTED, "SUSPENDED": JobState.PREEMPTED,  # spot preemption or run duration over
    "FAILED": JobState.FAILED,
    "DELETING": JobState.CANCELLED,  # its VM is going away (deleted by itself, the watcher or cancel)
}


@dataclass
class QrStatus:
    qr_id: str
    state: str             # the raw state.state
    job_state: JobState
    initiator: str = ""    # state.stateInitiator: USER or SERVICE
    error: str = ""        # state.failedData.error.message


def _status_of(obj: dict) -> QrStatus:
    if not isinstance(obj, dict):
        raise BackendError(f"gcloud queued-resources: expected a JSON object, got {type(obj).__name__}")
    st = obj.get("state") if isinstance(obj.get("state"), dict) else {}
    raw = str(st.get("state") or "STATE_UNSPECIFIED")
    failed = st.get("failedData") if isinstance(st.get("failedData"), dict) else {}
    err = failed.get("error")
    message = err.get("message", "") if isinstance(err, dict) else str(err or "")
    return QrStatus(qr_id=str(obj.get("name", "")).rsplit("/", 1)[-1], state=raw,
                    job_state=STATES.get(raw, JobState.UNKNOWN), initiator=str(st.get("stateInitiator") or ""),
                    error=message)


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except ValueError:
        raise BackendError(f"gcloud {what}: output is not JSON: {text.strip()[:120]!r}") from None


def parse_describe(text: str) -> QrStatus:
    """`describe --format=json`: one queued resource (unknown extra fields are ignored)."""
    return _status_of(_json(text, "describe"))


def parse_list(text: str) -> list[QrStatus]:
    data = _json(text, "list")
    if not isinstance(data, list):
        raise BackendError(f"gcloud list: expected a JSON list, got {type(data).__name__}")
    return [_status_of(obj) for obj in data]


# gcloud's messages (stderr, or failedData.error) -> what the user must do. First match wins.
_EXPLAIN = [
    (r"You do not currently have an active account|does not have any valid credentials|Reauthentication failed|"
     r"problem refreshing your current auth tokens|gcloud auth login",
     "gcloud is not authenticated: run `gcloud auth login` (on a VM or in CI: `gcloud auth activate-service-account`)"),
    (r"required property \[project\] is not currently set|Failed to find attribute \[project\]",
     "no Google Cloud project: pass --set site.project=P or run `gcloud config set project P`"),
    (r"quota|RESOURCE_EXHAUSTED",
     "quota exceeded for {accelerator_type} ({provisioning}) in {zone}: request TPU quota (console: IAM & Admin > "
     "Quotas), or try --set site.provisioning=spot or another zone with --set site.zone=Z"),
    (r"accelerator.?type.*(not (available|supported|found|valid)|invalid|unknown)|"
     r"(invalid|unknown|unsupported).*accelerator.?type|not available in zone",
     "zone {zone} does not offer {accelerator_type}: list the zones that do with `gcloud compute tpus "
     "accelerator-types list --zone=Z`, then pass --set site.zone=Z"),
    (r"API has not been used|SERVICE_DISABLED|tpu\.googleapis\.com.*(disabled|not enabled)",
     "the Cloud TPU API is off in {project}: run `gcloud services enable tpu.googleapis.com --project={project}`"),
    (r"PERMISSION_DENIED|permission denied|does not have permission",
     "your account may not create TPUs in {project}: ask for roles/tpu.admin (and storage access to the bucket)"),
]


def explain(message: str, site: dict) -> str | None:
    """The one-line fix for a gcloud error text, or None when it is not one we know."""
    for pattern, fix in _EXPLAIN:
        if re.search(pattern, message or "", re.I | re.S):
            return fix.format(**{k: site.get(k) or "?" for k in ("project", "zone", "accelerator_type", "provisioning")})
    return None
