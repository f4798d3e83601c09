"""What the store raises. Database drivers' own exceptions never leave the recorder: a failure
of the database becomes a StoreError in the database's own words (StoreValueError when it
refused a value), so that the proxy handles one exception, not SQLAlchemy's and asyncpg's."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from sqlalchemy.exc import DataError, SQLAlchemyError


class SchemaMismatch(RuntimeError):
    """The database was written by a newer version of rl-proxy."""


class SessionConflict(ValueError):
    """A session id is already taken by a session with another key."""


class SessionClosed(RuntimeError):
    """A call into a session that has ended, refused by the database whichever proxy sent it: one
    that looked the session up before another proxy ended it, or a call in flight at its end."""


class StoreError(RuntimeError):
    """The database failed what was asked of it (it is down, or full); the message is the
    database's own words. The one exception the store raises for its database's failures."""


class StoreValueError(StoreError):
    """The database refused a value it cannot hold (an integer past its range, a NUL on PostgreSQL)."""


def store_error(exc: BaseException) -> BaseException:
    """The StoreError that stands for a database driver's exception (others are returned as they are)."""
    reason = getattr(exc, "orig", None) or exc
    words = str(reason) or type(reason).__name__
    if isinstance(exc, DataError):
        return StoreValueError(words)
    if isinstance(exc, SQLAlchemyError | OSError):  # asyncpg's refused connection is not wrapped
        return StoreError(words)
    return exc


P = ParamSpec("P")
R = TypeVar("R")


def translated(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """A store method whose database failures are raised as StoreError."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (SQLAlchemyError, OSError) as exc:
            raise store_error(exc) from exc

    return wrapper
