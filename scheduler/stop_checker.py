"""When a request stops after appending a token (stop strings are the detokenizer's job)."""

from __future__ import annotations

from scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    params = request.sampling_params
    last = request.output_token_ids[-1]
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and request.is_eos(last):
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
