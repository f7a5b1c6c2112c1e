"""Live control, the run's side: what an attacher asks of a running RL run (forge.loop.rl).

Settings (`set`), a checkpoint, an eval and a stop are taken at the loop's next step boundary,
before step k trains, and the answer names k; pause, resume and scaling act at once. Every one
is a row of control.jsonl and a console line (forge.loop.live_settings). The door that carries
the calls from outside is forge.loop.control_door; a run never waits on an attacher.
"""

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from forge.data.admission import AdmissionGate
from forge.data.episode import Episode
from forge.loop.evaluation import Evaluator
from forge.loop.generator_handle import GeneratorHandle
from forge.loop.live_settings import (
    LIVE_KEYS,
    ControlRecord,
    LiveKeyError,
    assign,
    checked,
    current,
    live_key,
)
from forge.loop.rollouts import Rollouts
from forge.loop.status import read_status
from forge.loop.trainer_handle import TrainerHandle
from forge.loop.trainer_lifecycle import TrainerLifecycle
from forge.observability.console import say


class Steerable(Protocol):
    """What live control reaches in a run (forge.loop.rl.RLLoop is one)."""

    cfg: Any
    run_dir: Path
    version: int
    gate: AdmissionGate
    buffer: Any
    generator: GeneratorHandle | None
    rollouts: Rollouts
    evaluator: Evaluator | None
    lifecycle: TrainerLifecycle

    @property
    def trainer(self) -> TrainerHandle: ...
    async def state_dict(self) -> dict[str, Any]: ...
    def scalable(self, role: str) -> Any | None: ...
    def check_max_policy_age(self, age: int) -> None: ...
    async def set_max_policy_age(self, age: int) -> None: ...


SCALABLE = ("generator", "environment")  # the roles that run as services of replicas


@dataclass
class _Asked:
    """What waits for the next step boundary; each future resolves to the step it acted at."""

    changes: list[tuple[dict[str, Any], str, asyncio.Future]] = field(default_factory=list)
    checkpoint: list[tuple[str, asyncio.Future]] = field(default_factory=list)
    eval: list[tuple[str, asyncio.Future]] = field(default_factory=list)
    stop: str | None = None


class LiveControl:
    """The calls a live run answers (`calls()`), and the step boundary that takes them."""

    def __init__(self, run: Steerable) -> None:
        self.run = run
        self.record = ControlRecord(run.run_dir)
        self.running = asyncio.Event()  # cleared while rollouts are paused
        self.running.set()
        self.sampling: dict[str, Any] = {}  # rollouts' sampling changed live
        self.stopping = False
        self._asked = _Asked()
        self._trained: tuple[int, list[Episode]] = (0, [])  # the newest step's batch

    def trained(self, step: int, batch: list[list[Episode]]) -> None:
        """Keeps the batch of `step` for `samples` (the run holds it anyway)."""
        self._trained = (step, [e for rank in batch for e in rank])

    def calls(self) -> dict[str, Callable[..., Awaitable[Any]]]:
        """What the door serves, by the name an attacher calls."""
        return {
            "status": self.status, "samples": self.samples, "set": self.set,
            "pause": self.pause, "resume": self.resume,
            "checkpoint": self.checkpoint, "eval": self.eval, "stop": self.stop,
            "scale": self.scale,
        }  # fmt: skip

    # --- calls ---------------------------------------------------------------------------------

    async def status(self, by: str) -> dict[str, Any]:
        """The folder's status (forge.loop.status) and what only the running driver knows."""
        run = self.run
        # In a thread: a long run's logs take a while to read, and the loop must not wait.
        folder = dataclasses.asdict(await asyncio.to_thread(read_status, run.run_dir))
        folder["run_dir"] = str(folder["run_dir"])
        gate = run.gate
        replicas = run.generator.service.metrics() if run.generator is not None else []
        environments = run.scalable("environment")
        return {
            **folder,
            "version": run.version,
            "paused": not self.running.is_set(),
            "stopping": self.stopping,
            "gate": {"buffered": gate.buffered, "in_flight": gate.in_flight, "limit": gate.limit},
            "buffer": await run.buffer.stats.call_one(),
            # [age, episodes] of the buffered ones: how far behind the trainer they would train.
            "policy_ages": [
                [run.version - v, n] for v, n in (await run.buffer.versions.call_one()).items()
            ],
            "generators": replicas,
            "environments": environments.metrics() if environments is not None else [],
            "trainer_restarts": run.lifecycle.restarts,
            "settings": {short: current(run.cfg, key) for short, key in LIVE_KEYS.items()},
        }

    async def samples(self, n: int, by: str) -> list[dict[str, Any]]:
        """The newest trained batch's first `n` episodes: prompt and text, reward and each
        function's score, advantage, and the policy versions of its tokens."""
        step, episodes = self._trained
        decode = self.run.rollouts.bridge.tokenizer.decode
        return [
            {
                "step": step,
                "episode": e.episode_id,
                "row": e.row,
                "prompt": decode(e.completion.prompt_ids),
                "text": e.completion.text,
                "reward": e.reward,
                "rewards": e.rewards,
                "advantage": e.advantage,
                "versions": sorted(set(e.completion.token_versions)),
            }  # fmt: skip
            for e in episodes[:n]
        ]

    async def set(self, changes: dict[str, Any], by: str) -> dict[str, Any]:
        """Changes settings at the next step boundary; answers the step they take effect at,
        once it is reached.

        Raises:
            LiveKeyError: a key not in LIVE_KEYS, or a value the run refuses (before any change).
        """
        if not changes:
            raise LiveKeyError("set: name at least one setting")
        checked_changes = {}
        for name, value in changes.items():
            key = live_key(name)
            checked_changes[key] = checked(self.run.cfg, key, value)
            self._check_applies(key, checked_changes[key])
        done = asyncio.get_running_loop().create_future()
        self._asked.changes.append((checked_changes, by, done))
        return {"step": await done}

    async def pause(self, by: str) -> dict[str, Any]:
        """Stops starting rollout groups (those started finish and reach the buffer; the
        trainer takes what is buffered)."""
        if self.running.is_set():
            self.running.clear()
            self._said(self.run.version + 1, by, "pause", "rollouts paused: no new groups")
        return {"step": self.run.version + 1}

    async def resume(self, by: str) -> dict[str, Any]:
        """Starts rollout groups again after `pause`."""
        if not self.running.is_set():
            self.running.set()
            self._said(self.run.version + 1, by, "resume", "rollouts resumed")
        return {"step": self.run.version + 1}

    async def checkpoint(self, by: str) -> dict[str, Any]:
        """Checkpoints the step before the next boundary; answers its step."""
        if self.run.cfg.trainer.checkpoint.folder is None:
            raise LiveKeyError("checkpoint: this run has trainer.checkpoint.enabled false")
        done = asyncio.get_running_loop().create_future()
        self._asked.checkpoint.append((by, done))
        return {"step": await done}

    async def eval(self, by: str) -> dict[str, Any]:
        """Evaluates the weights of the step before the next boundary; answers its step."""
        if self.run.evaluator is None:
            raise LiveKeyError("eval: this run has eval.interval 0 (no eval rows)")
        done = asyncio.get_running_loop().create_future()
        self._asked.eval.append((by, done))
        return {"step": await done}

    async def stop(self, by: str) -> dict[str, Any]:
        """Ends the run at the next step boundary as Ctrl-C would: a final checkpoint, the
        plots and export; the same command resumes it. A paused run resumes its rollouts:
        its next step boundary comes after a batch."""
        self._asked.stop = by
        self.running.set()
        return {"step": self.run.version}

    async def scale(self, role: str, n: int, by: str) -> dict[str, Any]:
        """Grows or shrinks a service role to `n` replicas now; a new replica takes the
        newest weights before it takes requests."""
        service = self.run.scalable(role)
        if service is None or role not in SCALABLE:
            raise LiveKeyError(f"scale: {role!r} is not a service of this run ({SCALABLE})")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise LiveKeyError(f"scale: expected a whole number of replicas >= 1, got {n!r}")
        old = service.num_healthy
        await service.scale(n)
        line = f"{role} replicas {old} -> {n}"
        self._said(self.run.version + 1, by, "scale", line, role=role, old=old, new=n)
        return {"replicas": service.num_healthy}

    def close(self) -> None:
        """Answers what still waits for a step boundary: the run ended first."""
        asked, self._asked = self._asked, _Asked()
        waiting = [d for _, _, d in asked.changes] + [d for _, d in asked.checkpoint + asked.eval]
        for done in waiting:
            if not done.done():
                done.set_exception(LiveKeyError("the run ended before its next step"))

    # --- the step boundary ---------------------------------------------------------------------

    async def boundary(self, step: int) -> None:
        """Takes what waits for the step boundary before `step`: settings, then a checkpoint
        and an eval of step-1, then a stop; in sync mode, first waits while rollouts are
        paused (they are made in the step)."""
        if not self.run.cfg.asynchronous:
            await self.running.wait()
        asked, self._asked = self._asked, _Asked()
        for changes, by, done in asked.changes:
            await self._apply(step, changes, by)
            _resolve(done, step)
        if asked.checkpoint and step == 1:  # nothing trained yet: after step 1
            self._asked.checkpoint = asked.checkpoint
        elif asked.checkpoint:
            await self.run.lifecycle.checkpoint(step - 1, self.run.state_dict, asked=True)
            self._said(step - 1, asked.checkpoint[0][0], "checkpoint", f"checkpoint {step - 1}")
            for _, done in asked.checkpoint:
                _resolve(done, step - 1)
        if asked.eval:
            self.run.evaluator.start(step - 1, self.run.version)
            self._said(step - 1, asked.eval[0][0], "eval", f"eval of step {step - 1}")
        for _, done in asked.eval:
            _resolve(done, step - 1)
        if asked.stop is not None:
            self.stopping = True
            self._said(step - 1, asked.stop, "stop", f"stop after step {step - 1}")

    async def _apply(self, step: int, changes: dict[str, Any], by: str) -> None:
        """Puts each setting where the run reads it, recorded with the step it starts at."""
        run = self.run
        for key, new in changes.items():
            old = current(run.cfg, key)
            assign(run.cfg, key, new)
            self.record.append(step, by, key=key, old=old, new=new)
            say(f"live: {key} {old} -> {new} from step {step} (by {by})")
            section, _, leaf = key.rpartition(".")
            if section == "generator.sampling":
                self.sampling[leaf] = new
            elif key == "eval.interval":
                run.evaluator.interval = new
            elif key == "buffer.max_policy_age":
                await run.set_max_policy_age(new)
        if any(_optimisation(key) for key in changes):
            await run.trainer.set_optimisation(run.cfg.trainer)

    def _check_applies(self, key: str, value: Any) -> None:
        """Refuses what the section accepts but this run cannot take live."""
        if key == "eval.interval" and (self.run.evaluator is None or value < 1):
            raise LiveKeyError("eval.interval: eval runs from the start of a run (interval >= 1)")
        if key == "trainer.checkpoint.interval" and self.run.cfg.trainer.checkpoint.folder is None:
            raise LiveKeyError("trainer.checkpoint.interval: checkpoints are off in this run")
        if key == "buffer.max_policy_age":
            self.run.check_max_policy_age(value)

    def _said(self, step: int, by: str, action: str, line: str, **row: Any) -> None:
        self.record.append(step, by, action=action, **row)
        say(f"live: {line} (by {by})")


def _optimisation(key: str) -> bool:
    """Whether `key` is one the trainer takes through `set_optimisation`."""
    return key.startswith("trainer.") and not key.startswith("trainer.checkpoint.")


def _resolve(done: asyncio.Future, step: int) -> None:
    if not done.done():  # the attacher may have gone
        done.set_result(step)
