"""OpenAI- and Anthropic-compatible HTTP server over an Engine, by layer (imports point down only):

- :mod:`~tokenmill.server.background`, :mod:`~tokenmill.server.lifecycle`: serving, starting and
  graceful stopping; :mod:`~tokenmill.server.app`: the app factory, which includes every router;
- the routes, one package per API, never importing each other: :mod:`~tokenmill.server.openai`,
  :mod:`~tokenmill.server.anthropic`, :mod:`~tokenmill.server.operations`;
- :mod:`~tokenmill.server.shared`: what the APIs share (request bodies, sampling parameters, tools,
  message content, running the engine requests of one API call);
- :mod:`~tokenmill.server.http`: HTTP plumbing (state, errors, auth, body and header limits, SSE);
- :mod:`~tokenmill.server.config`: ``ServerConfig``, every server option.
"""
