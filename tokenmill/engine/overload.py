"""The engine's answer when it cannot take more work now (the caller should retry later)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``, or every grammar-compile slot stayed busy
    for the compile timeout; nothing was allocated for the request. Retry later."""
