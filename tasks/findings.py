"""A rule's finding, the one shape every check reports in (checkpoint rules, GPU rules), so the
artifacts render them all alike."""

from __future__ import annotations

from pydantic import BaseModel


class Violation(BaseModel):
    rule: str  # a stable id, e.g. packed-layout, fp8-kv-on-sm12x
    module: str  # what it is about: a module name, a setting, a config field
    message: str
