"""The engine's errors, in one place for the engine and the server that maps them to HTTP."""

from __future__ import annotations


class EngineBusyError(RuntimeError):
    """The configuration cannot change while requests run."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its sampling or post-processing); the others went on.
    `param` names the request field at fault when the request's own input could not be followed
    (a constraint reaching a parser limit while generating): the client's error, not the server's."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine thread stopped; nothing more will run."""


class RequestRejectedError(ValueError):
    """The request can never run on this engine (too long, too big for the KV pool, bad ids)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """A setting that can never work; `param` names it (the HTTP error's `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
