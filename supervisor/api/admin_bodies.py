"""The bodies of the admin actions (load, unload, pin, unpin), which the admin routes validate with.

Apart from supervisor/api/schemas.py, whose other models only describe the API (/openapi.json) and are
imported when the document is first asked for: these are needed from the start.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Action(BaseModel):
    """An admin action's options: an unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", defer_build=True)


class LoadRequest(_Action):
    """POST /v1/admin/models/{name}/load."""

    overrides: dict[str, Any] | None = Field(
        default=None, description="engine-specific load overrides; the model's load_constraints list them"
    )
    replicas: int | None = Field(default=None, ge=1, le=64)
    wait: bool = True
    keep_alive: float | str | None = Field(default=None, description='seconds or a duration like "5m"')
    restart: bool = False


class UnloadRequest(_Action):
    """POST /v1/admin/models/{name}/unload."""

    queued: Literal["serve", "cancel"] = "serve"


class PinRequest(_Action):
    """POST /v1/admin/models/{name}/pin."""

    wait: bool = True


class UnpinRequest(_Action):
    """POST /v1/admin/models/{name}/unpin: no options (no body, or {})."""
