"""Requests as the Tinker API runs them: each call returns a request id at once, its work runs
in the background, and the client polls `retrieve_future` for the result (held open up to
`POLL_S` while the work runs). A training model's requests run in `seq_id` order, whatever
order they arrive in, and a request resent under the same `seq_id` is the same request.
"""

import asyncio
import collections
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

# Under the SDK's 45 s read timeout for one poll, which it re-sends at once after a try_again.
POLL_S = 30.0
# Finished requests whose results are kept for a client polling again (a retry of its poll).
KEPT_RESULTS = 1024


class UserError(ValueError):
    """A request the client got wrong: its message goes back as the SDK's RequestFailedError
    of category "user"."""


class QueueFull(Exception):
    """A model's queue is full: the request is refused for now (HTTP 429, which the SDK
    resends after a pause)."""


@dataclass
class Binary:
    """A result sent as protobuf (forward_backward's and sampling's), not JSON."""

    body: bytes


class Futures:
    """The results of requests, by request id."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        self._finished: collections.deque[str] = collections.deque()
        self._ids = itertools.count()

    def submit(self, work: Awaitable[Any]) -> str:
        """Runs `work` in the background; returns its request id."""
        request_id = f"req-{next(self._ids)}"
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda _: self._keep(request_id))
        self._tasks[request_id] = task
        return request_id

    def _keep(self, request_id: str) -> None:
        self._finished.append(request_id)
        while len(self._finished) > KEPT_RESULTS:
            self._tasks.pop(self._finished.popleft(), None)

    def known(self, request_id: str) -> bool:
        return request_id in self._tasks

    async def retrieve(self, request_id: str) -> Binary | dict[str, Any]:
        """The result of `request_id`, or `{"type": "try_again"}` if it is still running after
        POLL_S; a failed request's error as the SDK reads one (a category and one line)."""
        task = self._tasks[request_id]
        done, _ = await asyncio.wait([task], timeout=POLL_S)
        if not done:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if task.cancelled():
            return {"error": "the request was cancelled: its model was closed", "category": "user"}
        if (error := task.exception()) is not None:
            error = raised_in_actor(error)
            user = isinstance(error, UserError | ValueError)
            return {"error": one_line(error), "category": "user" if user else "server"}
        return task.result()

    def cancel(self, request_id: str) -> None:
        """Cancels `request_id` if it is still running: its result says so."""
        if (task := self._tasks.get(request_id)) is not None:
            task.cancel()

    def cancel_all(self) -> None:
        for task in self._tasks.values():
            task.cancel()


def raised_in_actor(error: BaseException) -> BaseException:
    """What an actor raised, for an error of a call to it (Monarch's ActorError, nested for a
    call of a call); `error` itself otherwise."""
    from monarch.actor import ActorError

    while isinstance(error, ActorError) and error.exception is not None:
        error = error.exception
    return error


def one_line(error: BaseException) -> str:
    """`error`'s message on one line, its type named when the message is empty."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


class SeqOrder:
    """Runs one training model's requests in `seq_id` order (1, 2, ...).

    A request waits until every lower `seq_id` has run: the SDK sends the chunks of a large
    forward_backward together, the first one last. At most `max_pending` wait at once.
    """

    def __init__(self, futures: Futures, max_pending: int, first: int = 1) -> None:
        self.futures = futures
        self.max_pending = max_pending
        self._next = first
        self._turn = asyncio.Condition()
        # seq_id -> request id, of the requests waiting and the last KEPT_RESULTS that ran
        self._ids: dict[int, str] = {}

    def submit(self, seq_id: int, work: Callable[[], Awaitable[Any]]) -> str:
        """The request id of `seq_id`'s request: the one it already has (a resend), or a new
        one whose `work` runs after every lower seq_id's.

        Raises:
            UserError: `seq_id` already ran.
            QueueFull: `max_pending` requests are waiting.
        """
        if seq_id in self._ids:
            return self._ids[seq_id]
        if seq_id < self._next:
            raise UserError(f"seq_id {seq_id} ran long ago (the next is {self._next})")
        if sum(s >= self._next for s in self._ids) >= self.max_pending:
            raise QueueFull(f"{self.max_pending} requests of this model are queued already")
        self._ids[seq_id] = request_id = self.futures.submit(self._in_turn(seq_id, work))
        return request_id

    def cancel(self) -> None:
        """Cancels every request of the model that has not finished (its model is closed)."""
        for request_id in self._ids.values():
            self.futures.cancel(request_id)

    async def _in_turn(self, seq_id: int, work: Callable[[], Awaitable[Any]]) -> Any:
        async with self._turn:
            await self._turn.wait_for(lambda: self._next == seq_id)
        try:
            return await work()
        finally:
            async with self._turn:
                self._ids.pop(seq_id - KEPT_RESULTS, None)
                self._next = seq_id + 1
                self._turn.notify_all()
