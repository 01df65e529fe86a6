"""The few domain exceptions of the project; each carries a message fit to show a user."""


class KameError(Exception):
    """Base class of the errors this project raises on purpose.

    `exit_code` is what a `kame` command ends with on it: 2 bad input or usage, 3 the server
    cannot be reached, 4 the server is busy (no free slot, too many sessions from this address),
    5 the server refused the credentials or the origin."""

    exit_code = 2


class FrontendLoadError(KameError):
    """A front-end source could not be resolved or loaded (missing file, bad shapes, no hub)."""


class EngineError(KameError):
    """The batched engine was used wrongly (no free slot, unknown slot, bad frame)."""


class AudioFileError(KameError):
    """An audio file could not be read or written."""


class KnowledgeError(KameError):
    """The knowledge base cannot be used: a missing directory, an unusable index file, bad settings."""


class SessionError(KameError):
    """A tandem session was asked for something it cannot do (unknown backend, closed session)."""


class SlotsBusy(EngineError):
    """Every engine slot is taken: a new session cannot start now."""
