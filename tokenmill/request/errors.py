"""ParameterError, the one error type for a refused request parameter, and ContextLengthError."""

from __future__ import annotations

import re
from collections.abc import Mapping


class ParameterError(ValueError):
    """A refused request parameter; ``param`` names it, and the message starts with that name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param
        self.detail = message

    def message_for(self, names: Mapping[str, str]) -> str:
        """The message in an API's own parameter names (``names``: engine name -> API name): the
        leading name, and parameter names (those with an underscore) in the rest, renamed."""
        detail = self.detail
        for engine_name, api_name in names.items():
            if "_" in engine_name:
                detail = re.sub(rf"\b{re.escape(engine_name)}\b", api_name, detail)
        return f"{names.get(self.param, self.param)} {detail}"


class ContextLengthError(ParameterError):
    """A prompt that, with the output asked for, does not fit the context limit (``param``: "prompt")."""

    def __init__(self, message: str) -> None:
        super().__init__("prompt", message)
