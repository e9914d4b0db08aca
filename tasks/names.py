"""What a model is called where a repo id's characters are not allowed: Prefect's artifact keys and
event resources, run names, result folders."""

from __future__ import annotations

import re


def model_slug(repo_id: str) -> str:
    """Lowercase letters, digits and single dashes only (what artifact keys allow)."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", repo_id.lower())).strip("-")
