"""Moved to scheduler/admission.py (the scheduler applies the same rule); kept as an alias."""

from scheduler.admission import (  # noqa: F401
    CONTEXT_LENGTH_EXCEEDED,
    EMPTY_PROMPT,
    INVALID_MAX_TOKENS,
    AdmissionError,
    AdmissionLimits,
    check_admission,
    resolve_max_tokens,
)
