"""peagle's exceptions.

PeagleError is user-facing: the CLI prints its message on one line and exits non-zero. EngineError and its
subclasses report a failed engine step with the requests it concerns, so a caller (the server) can decide
what to retry or fail without looking inside the traceback."""


class PeagleError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


class EngineError(Exception):
    """An engine step failed; `request_ids` are the requests whose state it left undefined. The original
    exception is the __cause__."""

    def __init__(self, message: str, request_ids: list):
        super().__init__(message)
        self.request_ids = list(request_ids)


class PrefillError(EngineError):
    """Admitting new requests failed. The engine dropped them (they are neither waiting nor running); the
    requests that were already running are untouched."""


class DecodeError(EngineError):
    """A decode step failed: the running requests' state (caches, drafts) is undefined."""
