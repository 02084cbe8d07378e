"""What every API's request bodies are built from (pydantic).

Only types and nesting are checked in request bodies; value ranges are the engine's to check
(``SamplingParams.validate``), so every API and the Python API reject the same values with the same
messages. Types are strict, as in OpenAI's API: no bool for a number, no string for a number or a
bool, no float for an int (JSON ints are accepted for floats). Unknown fields are ignored: official
clients send fields this server does not use. ``None`` always means "the default", since some
clients send explicit nulls. A whole body nests at most
:data:`~tokenmill.server.http.nesting.MAX_NESTING_DEPTH` levels (:class:`RequestBody`); that is
checked before anything else looks at it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.request import json_nesting
from tokenmill.server.http.nesting import MAX_NESTING_DEPTH, too_deep_message

MAX_DEPTH_ERROR = "nesting_too_deep"


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(Body):
    """A whole request body: its nesting depth is checked on the parsed JSON, before any field."""

    @model_validator(mode="before")
    @classmethod
    def _shallow_enough(cls, data: Any) -> Any:
        if json_nesting(data) > MAX_NESTING_DEPTH:
            raise PydanticCustomError(MAX_DEPTH_ERROR, too_deep_message("the JSON"))
        return data


class FunctionName(Body):
    """A tool named by ``tool_choice`` (its function's name)."""

    name: StrictStr
