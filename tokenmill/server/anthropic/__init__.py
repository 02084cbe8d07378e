"""Anthropic-compatible routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(:mod:`.messages`); their request bodies (:mod:`.protocol`) and content blocks and tools
(:mod:`.content`)."""
