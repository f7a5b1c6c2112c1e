"""Starting a run's roles: the list the placement plan placed, in one spawn."""

import asyncio
from collections.abc import Sequence
from typing import Any

from forge.controller import get_provisioner
from forge.placement.roles import Role


async def spawn_roles(roles: Sequence[Role]) -> dict[str, Any]:
    """Starts every role at once and returns its handle by name: a Service for a `service`
    role, else the actor mesh.

    The Provisioner places meshes in the order they ask, and the plan placed the roles in
    list order: each role's processes are placed before the next role starts, and the slow
    part, starting them, overlaps.
    """
    provisioner = get_provisioner()
    tasks = []
    for role in roles:
        meshes = role.resources.num_replicas if role.service else 1
        placed = asyncio.ensure_future(provisioner.wait_placed(provisioner.placed + meshes))
        tasks.append(asyncio.ensure_future(spawn_role(role)))
        # A role that fails before it is placed ends the wait too; gather raises its error.
        await asyncio.wait([placed, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
        placed.cancel()
    handles = await asyncio.gather(*tasks)
    return {role.name: handle for role, handle in zip(roles, handles, strict=True)}


async def spawn_role(role: Role) -> Any:
    """Starts one role (a dead trainer's respawn); see `spawn_roles`."""
    options = role.actor.options(**vars(role.resources), group=role.group)
    if role.service:
        return await options.as_service(*role.args)
    return await options.as_actor(*role.args)
