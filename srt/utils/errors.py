"""Every error type srt raises across a module boundary, in one small module that any part of
srt may import (it imports nothing).

Configuration and loading (raised before or while the processes start; all ``ValueError``s):

    ConfigError                 a flag or ServerArgs value is invalid; the message says what to change
    ModelNotFoundError          --model-path (or the default model package) is missing
    UnsupportedModelError       the checkpoint's architecture has no srt implementation
    UnknownAttentionBackendError an attention backend name that is not registered
    DtypeError                  an unknown dtype name
    WeightLoadError             a checkpoint does not match the model
    GGUFError                   a GGUF file srt cannot load

Serving: every error a request can meet carries the HTTP status it maps to, so that the Engine raises a
typed exception and the HTTP server answers with OpenAI's error body without guessing:

    RequestError        400  the request is invalid (bad sampling parameter, prompt too long ...)
    QueueFullError      429  --max-queued-requests is reached (``retry_after`` seconds)
    RequestAbortedError 4xx/5xx  the request was aborted (explicitly or by the scheduler; a 503 may
                        carry ``retry_after``: --max-queue-time, the server shutting down)
    RequestTimeoutError 408  the request's deadline (``timeout`` / X-Request-Timeout) passed
    EngineDeadError     503  a child process died; the engine is shutting down
    LaunchError         --   a child process failed at start-up (the message holds its traceback)
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message says what to change."""


class ModelNotFoundError(ConfigError):
    """The model (or the default model package) is not where ``--model-path`` says."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no srt implementation."""


class UnknownAttentionBackendError(ValueError):
    """An attention backend name that is not registered."""


class DtypeError(ValueError):
    """An unknown dtype name was requested."""


class WeightLoadError(ValueError):
    """A checkpoint does not match the model (missing, unexpected or misshaped weights)."""


class GGUFError(ValueError):
    """The GGUF file is not one srt can load (bad header, unsupported architecture or tensor)."""


class LoRAError(ConfigError):
    """A LoRA adapter srt cannot serve over this model (bad folder, unsupported PEFT option, a
    target the model lacks, a rank above --max-lora-rank, shapes of another base model)."""


class SrtError(Exception):
    """Base class of srt's serving errors. ``status_code`` is the matching HTTP status."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None  # seconds; sent as the Retry-After header when set

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestError(SrtError, ValueError):
    """An invalid request; ``param`` names the offending field when there is one."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(RequestError):
    """Prompt + max_new_tokens does not fit in the context (the message gives the numbers)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class QueueFullError(SrtError):
    """Too many requests are waiting; retry after ``retry_after`` seconds."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestAbortedError(SrtError):
    """The request was aborted before it finished (``status_code`` from the abort reason)."""

    error_type = "request_aborted"
    code = "aborted"

    def __init__(self, message: str, status_code: int = 499, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after = retry_after
        if 400 <= status_code < 500 and status_code != 499:
            self.error_type = "invalid_request_error"
        elif status_code >= 500:
            self.error_type = "server_error"


class RequestTimeoutError(SrtError, TimeoutError):
    """The request's deadline passed before it finished (it was aborted wherever it was)."""

    status_code = 408
    error_type = "timeout_error"
    code = "request_timeout"


class EngineDeadError(SrtError, RuntimeError):
    """A child process (scheduler or detokenizer) died: nothing can be served any more."""

    status_code = 503
    error_type = "server_error"
    code = "engine_dead"


class LaunchError(SrtError, RuntimeError):
    """A child process failed during start-up; the message includes the child's traceback."""

    def __init__(self, process_name: str, message: str) -> None:
        super().__init__(f"{process_name} process failed to start:\n{message}")
        self.process_name = process_name
        self.child_message = message
