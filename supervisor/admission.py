"""The queue in front of a busy model: requests over its `max_inflight`, served by (priority, arrival).

A waiter holds a future. When a request ends, the scheduler hands its place straight to the best waiter
(the future's result is True: "you are in"), so a newcomer can never slip in between. When the model
stops being servable (unload, crash, reload), every waiter is told to look again (result False).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class AdmissionQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, asyncio.Future[bool]]] = []
        self._pushes = itertools.count()  # ties of arrival go by push
        self._waiting: set[asyncio.Future[bool]] = set()

    def __len__(self) -> int:
        """Requests still waiting (not those that gave up or were already let in)."""
        return len(self._waiting)

    def push(self, priority: int, arrived: float = 0.0) -> asyncio.Future[bool]:
        """Queue a waiter. `arrived`: when its request came (monotonic), so that one told to look again
        (wake_all) keeps its place among its priority when it queues again, rather than going last."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (-priority, arrived, next(self._pushes), future))
        self._waiting.add(future)
        return future

    def forget(self, future: asyncio.Future[bool]) -> None:
        """A waiter gave up (client gone, deadline): it leaves the queue at once, heap entry and all.

        Removing the entry now (not when it reaches the top) keeps the heap as small as the queue even
        under sustained overload, where waiters time out faster than places come free.
        """
        self._waiting.discard(future)
        if not future.done():
            future.cancel()
        for i, entry in enumerate(self._heap):
            if entry[3] is future:
                last = self._heap.pop()
                if i < len(self._heap):
                    self._heap[i] = last
                    heapq.heapify(self._heap)  # O(n), and n is at most max_queue
                break

    def top_priority(self) -> int | None:
        """The priority of the most urgent request waiting, None when none waits."""
        for priority, _, _, future in sorted(self._heap):
            if future in self._waiting:
                return -priority
        return None

    def admit_next(self) -> bool:
        """Let the best waiter in; False if nobody is waiting."""
        while self._heap:
            future = heapq.heappop(self._heap)[3]
            if future in self._waiting:
                self._waiting.discard(future)
                if not future.done():  # done here = cancelled with its task, not yet forgotten
                    future.set_result(True)
                    return True
        return False

    def nudge_best(self) -> None:
        """The best waiter looks again (another replica has room for it); the others keep their places."""
        while self._heap:
            future = heapq.heappop(self._heap)[3]
            if future in self._waiting:
                self._waiting.discard(future)
                if not future.done():
                    future.set_result(False)
                    return

    def wake_all(self) -> None:
        """The model is no longer servable as it was: every waiter must look again, woken best first
        (their tasks run in that order, so a place free at once goes to the first in line)."""
        entries, self._heap = sorted(self._heap), []
        waiting, self._waiting = self._waiting, set()
        for entry in entries:
            future = entry[3]
            if future in waiting and not future.done():
                future.set_result(False)
