"""Failures the stager reports, each with its documented exit code (dscache_contract.ExitCode).

Every message says what went wrong and what to do about it; the CLI prints it
as one line on stderr and in the termination log.
"""

from __future__ import annotations

from dscache_contract import ExitCode


class StageError(Exception):
    """Base of all expected failures."""

    exit_code = ExitCode.INTERNAL


class UsageError(StageError):
    exit_code = ExitCode.USAGE


class SourceError(StageError):
    exit_code = ExitCode.SOURCE


class NoSpaceError(StageError):
    exit_code = ExitCode.NO_SPACE


class HostileKeysError(StageError):
    exit_code = ExitCode.HOSTILE_KEYS


class DestinationError(StageError):
    exit_code = ExitCode.DESTINATION


class TransientError(StageError):
    exit_code = ExitCode.TRANSIENT


class BusyError(StageError):
    exit_code = ExitCode.BUSY


class RevisionGoneError(StageError):
    exit_code = ExitCode.REVISION_GONE


class CacheGoneError(StageError):
    exit_code = ExitCode.CACHE_GONE
