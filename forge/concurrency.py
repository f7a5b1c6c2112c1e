"""Awaiting many calls together: every value, or the first error as itself."""

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def all_or_none(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Runs `calls` at once and returns their values in order; the first to raise cancels
    the others and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except ExceptionGroup as failed:
        first = failed.exceptions[0]
        raise first from first.__cause__  # its own cause kept; the group is not shown
    return [task.result() for task in tasks]
