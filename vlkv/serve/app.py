"""FastAPI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``.

A handler parses and validates the body (size, JSON, pydantic, model, limits, images, policy), builds
a runtime :class:`Request`, tokenizes and preprocesses its prompt in a worker thread (never on the
engine thread, whose running streams would wait) and hands it to the engine thread; the engine
thread's ``submit`` decides whether the model can take it (position limit, pool size) before any
answer starts, so every refusal is a 4xx with one line. Then it streams (SSE) or collects the tokens. A client that goes away
cancels its request, which frees its KV slots at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from vlkv.runtime.request import Request, Status
from vlkv.serve.config import ServeConfig
from vlkv.serve.detok import Detokenizer
from vlkv.serve.engine_loop import DONE, EngineLoop, ShuttingDown, Ticket
from vlkv.serve.errors import ApiError, one_line
from vlkv.serve.metrics import ServeMetrics
from vlkv.serve.schemas import ChatRequest, CompletionRequest
from vlkv.serve.translate import (
    chat_prompt,
    check_request_compresses,
    completion_prompt,
    encode,
    make_request_policy,
    make_sampler,
    max_new_tokens,
    parse_json,
)

log = logging.getLogger("vlkv.serve")
COMPLETIONS_DEFAULT_TOKENS = 16  # the OpenAI completions API's default max_tokens
RETRY_AFTER_S = "1"
POLL_S = 0.25  # how often a non-streaming handler checks for a vanished client


@dataclass
class ServerState:
    """What the routes share: settings, the engine, its thread and the metrics."""

    config: ServeConfig
    engine: object  # vlkv.runtime.engine.Engine (tokenizer, eos ids, loaded model)
    loop: EngineLoop
    metrics: ServeMetrics
    model_id: str
    position_limit: int | None
    encoder: object = None  # vlkv.runtime.encoder_pool.EncoderPool, or None: encode in the handler's thread
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop.start()
        yield
        state.draining = True
        state.loop.stop()
        if state.encoder is not None:
            state.encoder.shutdown()

    app = FastAPI(title="vlkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.vlkv = state

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        if (400 <= err.status < 500 and err.status != 499) or err.status == 503:  # 499: cancelled, counted
            state.metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        if 400 <= err.status_code < 500:
            state.metrics.rejected.labels(str(err.status_code)).inc()
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            ApiError(err.status_code, str(err.detail), kind).body(), status_code=err.status_code
        )

    @app.exception_handler(Exception)
    async def _internal(request, err: Exception):
        log.exception("unhandled error in a request handler")
        body = ApiError(
            500, f"internal error: {type(err).__name__}: {one_line(str(err))}", "server_error"
        ).body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse({"status": "engine stopped", "error": state.loop.fatal}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "vlkv"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        req = await _parse(http, ChatRequest, state)
        prompt, uuids = await chat_prompt(req, state.engine.loaded, state.config)
        return await _answer(http, state, req, prompt, uuids, "chat", state.config.max_tokens)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        req = await _parse(http, CompletionRequest, state)
        return await _answer(http, state, req, completion_prompt(req), [], "text", COMPLETIONS_DEFAULT_TOKENS)

    return app


# ---------------------------------------------------------------------- request → ticket
async def _parse(http: HttpRequest, model, state: ServerState):
    cfg = state.config
    if state.draining:
        raise ApiError(
            503, "the server is shutting down", "service_unavailable", headers={"Retry-After": "5"}
        )
    length = http.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
        raise ApiError(413, f"request body is {length} bytes; this server takes at most {cfg.max_body_bytes}")
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > cfg.max_body_bytes:
            raise ApiError(
                413, f"request body is larger than this server's limit of {cfg.max_body_bytes} bytes"
            )
    data = parse_json(bytes(body))
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        req = model.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None
    if req.model != state.model_id:
        raise ApiError(
            404,
            f"model {req.model[:80]!r} is not served here; this server serves {state.model_id!r}",
            "not_found_error",
            "model",
        )
    if state.loop.queued >= cfg.max_queue:  # early, before any image is decoded; exact at submit
        raise _busy(cfg)
    return req


def _busy(cfg: ServeConfig) -> ApiError:
    return ApiError(
        429,
        f"server busy: {cfg.max_queue} requests already queued (--max-queue); retry later",
        "rate_limit_error",
        headers={"Retry-After": RETRY_AFTER_S},
    )


def _link_spec(req, cfg):
    """The request's link settings (its ``vlkv`` field, else the server's), or None without a store."""
    opts = getattr(req, "vlkv", None)
    fields = ("link_k", "link_pick", "link_r", "link_deviation", "store_budget", "store_scorer", "store_rank")
    asked = {name: getattr(opts, name, None) for name in fields} if opts is not None else {}
    method = (opts.link if opts is not None and opts.link is not None else None) or cfg.link
    if method == "none":
        return None
    if not cfg.store:
        raise ApiError(400, "vlkv.link needs a server started with --store", param="vlkv.link")
    try:
        spec = cfg.link_spec(
            method=method,
            k=asked.get("link_k"),
            pick=asked.get("link_pick"),
            r=asked.get("link_r"),
            deviation=asked.get("link_deviation"),
            store_budget=asked.get("store_budget"),
            store_scorer=asked.get("store_scorer"),
            store_rank=asked.get("store_rank"),
        )
    except ValueError as err:
        raise ApiError(400, str(err), param="vlkv.link") from None
    return spec


def _validation_error(err: ValidationError) -> ApiError:
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    return ApiError(400, f"{loc or 'body'}: {msg}{more}", param=loc or None)


async def _answer(http, state: ServerState, req, prompt, uuids, kind: str, default_tokens: int):
    cfg = state.config
    request = Request(
        prompt,
        make_request_policy(req, cfg, state.position_limit, state.model_id),
        max_new_tokens(req, cfg, default_tokens),
        make_sampler(req),
        stop_at_eos=not req.ignore_eos,
        link=_link_spec(req, cfg),
        tenant=req.cache_salt or "default",  # vLLM's cache_salt scopes stored records to a tenant
    )
    # Encoding runs in a worker thread (its processor call in the encoder pool's process, so the
    # GIL stays free for the engine thread): the engine thread only queues an encoded prompt.
    param = "messages" if kind == "chat" else "prompt"
    request.batch = await asyncio.to_thread(encode, state.engine, prompt, param, state.encoder)
    check_request_compresses(req, request.policy, request.batch)
    request.extras["image_uuids"] = uuids  # aliases only: records are keyed by the pixels (docs/serving.md)
    request.extras["cache_salt"] = req.cache_salt
    loop = asyncio.get_running_loop()
    ticket = Ticket(request, loop, time.monotonic() + cfg.request_timeout_s)
    if not state.loop.submit(ticket, cfg.max_queue):
        raise _busy(cfg)
    try:
        await asyncio.wait_for(asyncio.shield(ticket.accepted), cfg.request_timeout_s + 5)
    except asyncio.CancelledError:
        state.loop.cancel(ticket)
        raise
    except TimeoutError:
        state.loop.cancel(ticket)
        raise ApiError(504, "request timed out before it was queued", "timeout_error") from None
    except ShuttingDown as err:
        raise ApiError(503, str(err), "service_unavailable", headers={"Retry-After": "5"}) from None
    except (
        Exception
    ) as err:  # what Scheduler.submit refused: too large for the pool or the model, a bad prompt
        raise ApiError(
            400, str(err) or type(err).__name__, param="messages" if kind == "chat" else "prompt"
        ) from None
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(
            _sse(state, ticket, kind, rid, usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return JSONResponse(await _collect(http, state, ticket, kind, rid))


# ---------------------------------------------------------------------- answers
def _finish_reason(state: ServerState, request: Request) -> str:
    eos = state.engine.eos_ids if request.stop_at_eos else ()
    return "stop" if request.tokens and request.tokens[-1] in eos else "length"


def _usage(request: Request) -> dict:
    p, c = request.prompt_tokens, len(request.tokens)
    # OpenAI's and vLLM's field: prompt tokens reused from a stored prefix or record (0: none)
    cached = {"cached_tokens": request.cached_tokens}
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": cached,
    }


def _failure(state: ServerState, ticket: Ticket) -> ApiError | None:
    """None for a finished request; otherwise the error its client gets."""
    request = ticket.request
    if request.status is Status.FINISHED:
        return None
    if ticket.timed_out:
        return ApiError(504, f"request timed out after {state.config.request_timeout_s:g} s", "timeout_error")
    if request.status is Status.FAILED:
        return ApiError(500, f"request failed: {request.error}", "server_error")
    return ApiError(503, "request cancelled: the server is shutting down", "service_unavailable")


def _extras(request: Request) -> dict:
    final = request.final
    return {
        "policy": request.policy.name,
        "budget": float(request.policy.budget),
        "kv_bytes": final.get("kv_bytes"),
        "full_kv_bytes": final.get("full_kv_bytes"),
        "preemptions": request.preemptions,
    }


async def _collect(http, state: ServerState, ticket: Ticket, kind: str, rid: str) -> dict:
    tokens: list[int] = []
    clock = asyncio.get_running_loop().time
    next_check = clock() + POLL_S
    while True:
        try:
            item = await asyncio.wait_for(ticket.events.get(), POLL_S)
        except TimeoutError:
            item = None
        if item is DONE:
            break
        if item is not None:
            tokens.append(item)
        if clock() < next_check:  # tokens may arrive faster than POLL_S: check on a clock, not on idleness
            continue
        next_check = clock() + POLL_S
        if await http.is_disconnected():
            state.loop.cancel(ticket)
            raise ApiError(499, "client disconnected")
        if not state.loop.alive:
            raise ApiError(503, "the engine stopped", "service_unavailable")
    request = ticket.request
    error = _failure(state, ticket)
    if error is not None:
        raise error
    text = state.engine.tokenizer.decode(tokens, skip_special_tokens=True)
    reason = _finish_reason(state, request)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    choice["token_ids"] = tokens
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": state.model_id,
        "choices": [choice],
        "usage": _usage(request),
        "vlkv": _extras(request),
    }


def sse(obj) -> str:
    """One SSE event. JSON with every non-ASCII character escaped: U+2028, U+0085 and friends are line
    breaks to ``str.splitlines`` and to several SSE clients, and would cut an event in two."""
    return f"data: {json.dumps(obj, ensure_ascii=True)}\n\n"


async def _sse(state: ServerState, ticket: Ticket, kind: str, rid: str, include_usage: bool):
    """SSE ``data: {json}`` chunks, then ``data: [DONE]``; an error after the start is an error chunk."""
    created, detok = int(time.time()), Detokenizer(state.engine.tokenizer)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(text: str | None, tokens: list[int], reason: str | None = None, role: bool = False) -> str:
        if kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        choice["token_ids"] = tokens
        body = {"id": rid, "object": obj, "created": created, "model": state.model_id, "choices": [choice]}
        return sse(body)

    try:
        if kind == "chat":
            yield chunk("", [], role=True)
        done = False
        while not done:
            items = [await ticket.events.get()]
            while not ticket.events.empty():
                items.append(ticket.events.get_nowait())
            done = items[-1] is DONE
            tokens = [t for t in items if t is not DONE]
            if tokens:
                yield chunk(detok.add(tokens), tokens)
        request = ticket.request
        error = _failure(state, ticket)
        if error is not None:
            yield sse(error.body())
        else:
            yield chunk(detok.finish(), [], _finish_reason(state, request))
        if include_usage:
            body = {"id": rid, "object": obj, "created": created, "model": state.model_id, "choices": []}
            body["usage"] = _usage(request)
            yield sse(body)
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): a running request is cancelled, its KV freed
        if not ticket.request.done:
            state.loop.cancel(ticket)
