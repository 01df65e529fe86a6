"""The few domain exceptions of the project; each carries a message fit to show a user."""


class KameError(Exception):
    """Base class of the errors this project raises on purpose."""


class FrontendLoadError(KameError):
    """A front-end source could not be resolved or loaded (missing file, bad shapes, no hub)."""


class EngineError(KameError):
    """The batched engine was used wrongly (no free slot, unknown slot, bad frame)."""


class AudioFileError(KameError):
    """An audio file could not be read or written."""


class SessionError(KameError):
    """A tandem session was asked for something it cannot do (unknown backend, closed session)."""


class SlotsBusy(EngineError):
    """Every engine slot is taken: a new session cannot start now."""
