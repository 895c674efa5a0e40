"""Failures the stager reports, each with its documented exit code.

Every message says what went wrong and what to do about it; the CLI prints it
as one line on stderr and in the termination log.
"""

from __future__ import annotations


class StageError(Exception):
    """Base of all expected failures."""

    exit_code = 1


class UsageError(StageError):
    """Bad command line or source URI."""

    exit_code = 2


class SourceError(StageError):
    """The bucket cannot be read: no such bucket, access denied, bad credentials, unreachable endpoint."""

    exit_code = 3


class NoSpaceError(StageError):
    """The destination cannot hold the objects still to copy."""

    exit_code = 4


class HostileKeysError(StageError):
    """Object keys that cannot be written safely under the destination."""

    exit_code = 5


class DestinationError(StageError):
    """Writing the destination failed: disk full, permissions, a read-only filesystem."""

    exit_code = 6


class TransientError(StageError):
    """S3 kept failing (throttling, 5xx, dropped connections) after every retry."""

    exit_code = 7


class BusyError(StageError):
    """A stager is filling the copy right now; the wipe was not done and can be retried later."""

    exit_code = 8


EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "internal error (a bug: please report it with the log)",
    2: UsageError.__doc__ or "",
    3: SourceError.__doc__ or "",
    4: NoSpaceError.__doc__ or "",
    5: HostileKeysError.__doc__ or "",
    6: DestinationError.__doc__ or "",
    7: TransientError.__doc__ or "",
    8: BusyError.__doc__ or "",
}
