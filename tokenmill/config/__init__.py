"""The engine's settings: small frozen groups (one file each), gathered in :class:`EngineConfig`,
and the rule table of what does not combine (``rules.py``)."""

from tokenmill.config.dtypes import DTYPES, KV_DTYPES
from tokenmill.config.engine import EngineConfig, Resolved
from tokenmill.config.options import option
from tokenmill.config.runtime import ATTENTION_BACKENDS

__all__ = ["ATTENTION_BACKENDS", "DTYPES", "KV_DTYPES", "EngineConfig", "Resolved", "option"]
