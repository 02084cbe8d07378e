"""EngineConfig: every engine setting, gathered from the groups (one file each in this package).

The settings stay flat where a user sets them (``LLM(page_size=16)``, ``--page-size 16``: vLLM's
names): :class:`EngineConfig` inherits every group's fields, checks each group and the rule table's
rows over settings alone when it is made, and hands each room of the engine only its group
(:attr:`EngineConfig.cache`, :attr:`~EngineConfig.scheduler`, ...). :meth:`EngineConfig.resolve`
computes the values derived from the settings and the checkpoint, once per engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

import torch

from tokenmill.config.cache import CacheOptions
from tokenmill.config.limits import LimitOptions
from tokenmill.config.lora import LoRAOptions
from tokenmill.config.model import ModelOptions
from tokenmill.config.parallel import ParallelOptions
from tokenmill.config.pooling import PoolingOptions
from tokenmill.config.rules import check_rules
from tokenmill.config.runtime import RuntimeOptions
from tokenmill.config.scheduler import SchedulerOptions
from tokenmill.config.speculative import SpeculativeOptions

Group = TypeVar("Group")

GROUPS: tuple[type, ...] = (
    ModelOptions,
    RuntimeOptions,
    CacheOptions,
    SchedulerOptions,
    ParallelOptions,
    LimitOptions,
    SpeculativeOptions,
    LoRAOptions,
    PoolingOptions,
)
"""The groups, in the order ``--help`` lists their options."""


class GroupView(Generic[Group]):
    """A configuration's values of one group alone, as that group (a room's settings)."""

    def __init__(self, cls: type[Group]) -> None:
        self.cls = cls

    @overload
    def __get__(self, config: None, owner: type) -> GroupView[Group]: ...

    @overload
    def __get__(self, config: EngineConfig, owner: type) -> Group: ...

    def __get__(self, config: EngineConfig | None, owner: type) -> GroupView[Group] | Group:
        return self if config is None else config.group(self.cls)


@dataclass(frozen=True)
class Resolved:
    """The values derived from the settings and the checkpoint (:meth:`EngineConfig.resolve`)."""

    model_path: Path
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_context_len: int  # most positions one sequence may hold: the setting, capped by the model's


@dataclass(frozen=True)
class EngineConfig(*reversed(GROUPS)):  # type: ignore[misc]  # a dataclass's fields come base by base, last first
    """Engine settings. All fields can be passed as keyword arguments to ``LLM(...)``; each is an
    :func:`~tokenmill.config.option`, its help and section in the field's metadata."""

    def __post_init__(self) -> None:
        for group in GROUPS:
            group.__post_init__(self)  # type: ignore[attr-defined]
        check_rules(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, naming any unknown one in the error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def group(self, cls: type[Group]) -> Group:
        """This configuration's values of group ``cls`` alone."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})  # type: ignore[arg-type]

    checkpoint = GroupView(ModelOptions)
    runtime = GroupView(RuntimeOptions)
    cache = GroupView(CacheOptions)
    scheduler = GroupView(SchedulerOptions)
    limits = GroupView(LimitOptions)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (checked as a new configuration)."""
        return dataclasses.replace(self, **changes)

    def resolve(self, model_path: Path, checkpoint_dtype: torch.dtype | None, model_max_context: int) -> Resolved:
        """The derived values for the checkpoint at ``model_path`` (its own dtype and longest context)."""
        dtype = self.resolved_dtype(checkpoint_dtype)
        longest = min(self.max_context_len or model_max_context, model_max_context)
        return Resolved(model_path, self.resolved_device(), dtype, self.resolved_kv_dtype(dtype), longest)
