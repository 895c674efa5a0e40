"""Which objects of a bucket make up a dataset: the source URI and include/exclude.

The operator's source check and the stager both select with this code, so the
revision the operator pins is computed over exactly the objects a stager copies.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass


def parse_source(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ("bucket", "a/b/"). A prefix is always a directory.

    Raises ValueError for anything that is not ``s3://BUCKET[/PREFIX]``.
    """
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ValueError(f"source must look like s3://BUCKET/PREFIX, got {uri!r}")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"source {uri!r} names no bucket; use s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/" if prefix else "")


def normalize_key(key: str) -> str:
    """A listed key as both listers see it: one trailing '/' dropped.

    boto3 returns keys verbatim; obstore (the stager's lister) drops the
    trailing '/' of a directory marker ``a/``. Hashing the key without it
    makes both produce the same records, in the same (server) order.
    """
    return key[:-1] if key.endswith("/") else key


def selected(rel: str, include: list[str] | tuple[str, ...], exclude: list[str] | tuple[str, ...]) -> bool:
    """The include/exclude rule on a key relative to the prefix.

    Taken when it matches any include (or there are none) and no exclude.
    ``*`` also matches ``/``, as in ``aws s3 sync``; matching is case-sensitive.
    """
    if include and not any(fnmatch.fnmatchcase(rel, g) for g in include):
        return False
    return not any(fnmatch.fnmatchcase(rel, g) for g in exclude)


@dataclass(frozen=True)
class Selection:
    """A prefix plus globs; ``relative`` says whether a listed key belongs to the dataset."""

    prefix: str = ""
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def from_source(cls, uri: str, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> Selection:
        return cls(parse_source(uri)[1], tuple(include), tuple(exclude))

    def relative(self, key: str) -> str | None:
        """The path under the data dir for a listed key, or None when not selected.

        The prefix's own directory marker (``prefix/``) is never selected.
        """
        key = normalize_key(key)
        if not key.startswith(self.prefix):
            return None
        rel = key[len(self.prefix) :]
        if not rel or not selected(rel, self.include, self.exclude):
            return None
        return rel
