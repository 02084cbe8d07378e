"""The chat page at ``/``: static files inside the package (:mod:`.page`), no build step."""
