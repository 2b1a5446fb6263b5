"""OpenAI request/response shapes (the subset treeflash honours; unknown fields are ignored)."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import GenerationConfig
from ..decoding.sampling import GREEDY_BELOW

# OpenAI's own limits where they exist (temperature <= 2, at most 4 stop sequences)
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: int | None = Field(None, ge=1, description="new tokens to generate at most")
    max_completion_tokens: int | None = Field(None, ge=1, description="newer name of max_tokens")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} stop sequences")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request is supported")

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def generation_config(self, defaults: GenerationConfig) -> GenerationConfig:
        """This request's settings: the fields it gives over the server's `defaults` (so a server
        started with --seed S samples requests without a seed reproducibly, with S)."""
        t = defaults.temperature if self.temperature is None else self.temperature
        return defaults.replace(
            max_new_tokens=self.token_limit() or defaults.max_new_tokens,
            temperature=0.0 if t < GREEDY_BELOW else t,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            seed=defaults.seed if self.seed is None else self.seed, stop=self.stop_list() if self.stop is not None else defaults.stop)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] = Field(..., description="text, token ids, or a one-item list of text")
    echo: bool = False


# ---- responses (plain dicts: cheap to build, exactly the OpenAI field names) ----
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, tau: float) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "mean_acceptance_length": round(tau, 4)}


def chat_response(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None,
               use: dict | None = None, empty: bool = False) -> dict:
    choices = [] if empty else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_response(rid: str, model: str, text: str, finish: str, use: dict | None,
                        empty: bool = False) -> dict:
    choices = [] if empty else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """An HTTP error answered as OpenAI-style JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)
