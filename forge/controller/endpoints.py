"""Marks on actor endpoints that a service reads: which ones it may run twice.

A module of its own, not part of actor.py: the service reads the marks, and the actor module
imports the service.
"""

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def retry_safe(fn: F) -> F:
    """Marks an endpoint as safe to run twice, so a service retries it if its replica dies.

    Put it below `@endpoint`:

        @endpoint
        @retry_safe
        async def generate(self, prompt): ...
    """
    fn.__forge_retry_safe__ = True
    return fn


def is_retry_safe(actor_cls: type, name: str) -> bool:
    """Whether endpoint `name` of `actor_cls` was marked with `retry_safe`."""
    fn = getattr(getattr(actor_cls, name, None), "_method", None)
    while fn is not None:
        if getattr(fn, "__forge_retry_safe__", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False
