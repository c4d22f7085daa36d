"""Retries for remote I/O: transient errors only, exponential backoff with jitter, a deadline."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from asymstore.errors import AsymstoreError, PermanentRemoteError, RemoteUnavailableError

logger = logging.getLogger(__name__)
T = TypeVar("T")

_PERMANENT = (
    "AccessDenied", "Access Denied", "NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "InvalidBucketName", "AllAccessDisabled", "Forbidden", "NotImplemented", "Permission denied",
)






_JITTER = random.Random()
"""The library's own generator for the backoff's jitter (see :class:`_JitteredExponential`)."""


class _JitteredExponential(wait_exponential):
    """Exponential backoff with full jitter, like tenacity's ``wait_random_exponential``, from a private generator.

    tenacity's own draws from the global ``random`` module, whose state belongs to the training loop
    (it is part of every checkpoint): a retry on the store's thread would change it behind the loop's
    back, and a resumed run would no longer match an uninterrupted one.
    """

    def __call__(self, retry_state: RetryCallState) -> float:
        return _JITTER.uniform(0, super().__call__(retry_state=retry_state))


def is_transient(exc: BaseException) -> bool:
    """Return True for errors worth retrying: network and server trouble, not permission or absence."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    if isinstance(exc, PermanentRemoteError):
        return False
    if isinstance(exc, OSError):
        return not any(marker in str(exc) for marker in _PERMANENT)
    return False


class RetryPolicy:
    """How hard a remote tier tries before it gives up on one operation.

    Args:
        attempts: most attempts per operation.
        deadline_s: overall time budget per operation, retries included.
        initial_s: first backoff (doubles, with jitter, up to ``max_backoff_s``).
        max_backoff_s: longest single wait.
    """

    def __init__(self, attempts: int = 8, deadline_s: float = 60.0, initial_s: float = 0.2,
                 max_backoff_s: float = 5.0) -> None:
        """Store the settings."""
        self.attempts = attempts
        self.deadline_s = deadline_s
        self.initial_s = initial_s
        self.max_backoff_s = max_backoff_s
        self.retries = 0  # total retries taken, for status reports

    async def run(self, what: str, fn: Callable[[], T]) -> T:
        """Run blocking ``fn`` in a thread, retrying transient failures.

        Raises:
            PermanentRemoteError: a non-transient error (not retried).
            RemoteUnavailableError: transient errors until the deadline or attempt limit.
        """
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts) | stop_after_delay(self.deadline_s),
            wait=_JitteredExponential(multiplier=self.initial_s, max=self.max_backoff_s),
            retry=retry_if_exception(is_transient),
            before_sleep=self._count,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await asyncio.to_thread(fn)
        except Exception as exc:
            if isinstance(exc, AsymstoreError):  # already typed (a size check, a nested retry)
                raise
            if is_transient(exc):
                raise RemoteUnavailableError(f"{what}: gave up after retries: {exc}") from exc
            raise PermanentRemoteError(f"{what}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _count(self, state: object) -> None:
        self.retries += 1
        logger.info("retrying remote I/O: %s", getattr(getattr(state, "outcome", None), "exception", lambda: None)())
