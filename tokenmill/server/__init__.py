"""OpenAI- and Anthropic-compatible HTTP server over an Engine: the app factory is in
:mod:`tokenmill.server.app`, starting and graceful stopping in :mod:`tokenmill.server.lifecycle`."""
