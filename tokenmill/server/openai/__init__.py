"""OpenAI-compatible routes, with vLLM's extras: ``GET /v1/models`` (:mod:`.models`),
``POST /v1/chat/completions`` (:mod:`.chat`), ``POST /v1/completions`` (:mod:`.completions`),
``POST /v1/responses`` (:mod:`.responses`), ``POST /v1/embeddings`` (:mod:`.embeddings`), vLLM's
``POST /score`` and ``/rerank`` (:mod:`.scoring`), ``POST /tokenize`` and ``/detokenize``
(:mod:`.tokenization`); their request bodies
(:mod:`.protocol`), sampling fields (:mod:`.params`) and answers (:mod:`.output`).

- ``max_tokens`` unset: chat runs to the context limit (or ``max_tokens_cap``), completions
  default to 16 as in OpenAI's API.
- ``usage`` counts real tokens: each prompt once, completion tokens over all choices, and in
  ``prompt_tokens_details.cached_tokens`` the prompt tokens the prefix cache served.
- Streamed, each choice's ``finish_reason`` comes in a chunk of its own with no text, as OpenAI
  sends it: a client that stops at the first ``finish_reason`` has all the text.
"""
