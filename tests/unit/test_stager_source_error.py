"""source_error reads obstore's (and dscache_native's) messages: a port is not a status code."""

from __future__ import annotations

from obstore.exceptions import GenericError

from dscache_stager.errors import SourceError, TransientError
from dscache_stager.source import S3Source, source_error


def test_a_port_ending_in_403_is_not_access_denied():
    src = S3Source("does-not-exist", "x/", endpoint_url="http://127.0.0.1:41403")
    e = GenericError(
        "Generic S3 error: Error performing GET http://127.0.0.1:41403/does-not-exist?list-type=2 in 1ms - "
        "Server returned non-2xx status code: 404 Not Found: <Error><Code>NoSuchBucket</Code></Error>"
    )
    err = source_error(e, src, 0)
    assert isinstance(err, SourceError) and "no such bucket" in str(err)
    denied = GenericError("Error performing GET http://127.0.0.1:41403/b - status code: 403 Forbidden")
    assert "access denied" in str(source_error(denied, src, 0))
    slow = GenericError("Error performing GET http://127.0.0.1:41403/b - status code: 503 Service Unavailable")
    assert isinstance(source_error(slow, src, 5), TransientError)
