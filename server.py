"""
server.py: nanobatch's HTTP server, vLLM's front end on the engine's step loop.

A separate program around the engine, as kernels.py is a companion below it: nanobatch.py
imports this file only for --serve, so nanobatch.py + kernels.py stay the whole engine,
copyable alone and importable without a web stack. This file adds FastAPI on uvicorn (the
stack vLLM uses), pydantic for the request bodies and prometheus_client for /metrics.

    event loop (uvicorn + FastAPI handlers)                engine thread (the only one that touches the LLM;
                                                           under --serve the main thread, which loaded it)
    validate the body (pydantic), SamplingParams  --inbox-->  drain inbox: add_request / abort_request / calls
    await the request's outputs        <-call_soon_threadsafe--  llm.step() -> each RequestOutput to its request
    answer JSON, or stream SSE (OpenAI) / NDJSON (/generate)

Requests that arrive while others run join the running batch at the next step: the engine
thread drains the inbox before every step, and sleeps on it when idle. uvicorn owns the HTTP:
framing, keep-alive, timeouts and the concurrency limit (503 past it).

Where validation happens: pydantic models check the JSON types (a 400 naming the field), the
SamplingParams built in the handler check the values. Everything that needs the tokenizer (chat
template, prompt length, token ids) runs in the engine thread inside add_request, whose
ValueError comes back as a 400. HF fast tokenizers are not safe to share between threads, so
the event loop never calls them.

Endpoints: POST /generate (vLLM's demo server); POST /v1/completions, /v1/chat/completions and
GET /v1/models (OpenAI); POST /tokenize, /detokenize, GET /version, /health, /metrics (vLLM's).

Sections: Config | Engine thread | Metrics | Request bodies | Response formats | Endpoints | HTTP

Run:  python nanobatch.py --serve --port 8000        (default model: SmolLM2-135M-Instruct)
      python server.py --model path/to/hf_folder --port 8000   (nanobatch's flags; --serve implied)
API:  server, url = start_server(llm, "127.0.0.1", 0)   (a background thread; port 0: a free port)
      ... server.stop()
"""

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import h11
import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

import kernels
import nanobatch
from nanobatch import (
    LLM,
    BeamSearchParams,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
    _cut,
    default_model_path,
)


# ---- Config ----

VERSION = "0.1.0"  # GET /version
MAX_BODY_BYTES = 1 << 20  # larger request bodies get a 400
BODY_TIMEOUT_SECONDS = 30  # a request body must arrive within this, or the request gets a 408
INTERNAL_ERROR = "internal server error (the server log has the details)"  # a 500 says no more than this
QUIET_PATHS = {"/health", "/metrics"}  # polled every few seconds: left out of the access log
log = logging.getLogger("nanobatch")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    served_model_name: str | None = (
        None  # the `model` clients name; default: the model argument as given (vLLM's default)
    )
    limit_concurrency: int | None = None  # connections + requests in flight past which requests get a 503 (uvicorn's)
    timeout_keep_alive: int = (
        5  # seconds a connection gets to send each request head (from connecting, or its last response)
    )

    def __post_init__(self):
        nanobatch.check_fields(
            self,
            "ServerConfig.",
            [
                (
                    "port",
                    lambda v: nanobatch._int(v) and 0 <= v <= 65535,
                    "must be an integer from 0 (any free port) to 65535",
                ),
                (
                    "limit_concurrency",
                    lambda v: v is None or (nanobatch._int(v) and v >= 1),
                    "must be a positive integer or None",
                ),
                ("timeout_keep_alive", lambda v: nanobatch._int(v) and v >= 1, "must be a positive integer"),
            ],
        )


class ServerError(Exception):
    """A request the server refuses or fails: sent as {"error": {"message", "type", "param", "code"}} with
    this status. type is vLLM's: the status's name, "BadRequestError", "NotFoundError", ...; param
    names the request field at fault, when one is."""

    def __init__(self, message, status=400, param=None, type=None):
        super().__init__(message)
        self.status, self.param = status, param
        name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
        self.type = type or (name if name.endswith("Error") else name + "Error")

    @classmethod
    def invalid(cls, e, prefix=""):
        """A 400 for the engine's ValueError in the request's words (`max_tokens must ...`, not
        `SamplingParams.max_tokens must ...`), param the field it starts with, as vLLM names it."""
        message = re.sub(r"^(SamplingParams|BeamSearchParams)\.", "", str(e))
        if message.startswith(
            "This model's maximum context length"
        ):  # (a prompt longer than max_model_len: vLLM's words and param)
            return cls(prefix + message, param="input_tokens")
        field = re.match(r"([a-z_.]+)(=| must | cannot | has token id | \S+ exceeds )", message)
        return cls(prefix + message, param=field and field.group(1))

    def body(self):
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


# ---- Engine thread ----


@dataclass
class Submission:
    request_ids: list[str]  # one engine request per prompt
    prompts: (
        list  # texts or token-id lists; chat: one list of messages, rendered by the chat template in the engine thread
    )
    params: SamplingParams  # what the response shows (n outputs per prompt, logprobs, ...)
    chat: dict | None = None  # a chat: the template's options (LLM.chat_prompt's, vLLM's fields); None: plain prompts
    beam: BeamSearchParams | None = None  # use_beam_search: what the engine runs instead of params
    deliver: Callable | None = None  # called in the engine thread with (prompt index, RequestOutput) or a ServerError


def threadsafe(loop, fn):
    """fn, to be called from the engine thread: it runs in the event loop's thread (or not at all once the loop
    has closed). EngineLoop hands one step's calls for the same loop over in one go (call.loop, call.fn): one
    wake-up of the loop per step."""

    def call(*args):
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody waits for this any more
            pass

    call.loop, call.fn = loop, fn
    return call


def run_each(calls):  # in the event loop: one step's deliveries, in the engine's order
    for fn, arg in calls:
        fn(arg)


class EngineLoop:
    """The engine thread: the only thread that calls the LLM.

    Others talk to it through one inbox of messages: ("add", Submission), ("abort", request_ids,
    by_client), ("call", fn, reply) and ("stop",). Each running request's outputs go to its
    Submission's deliver, the last one finished. A RequestOutput is a snapshot (the engine builds
    new lists and strings each step), so the event loop may read it while the engine runs on."""

    def __init__(self, llm: LLM, metrics=None, own_thread=True):
        """own_thread: start a thread of its own; else the creating thread is the engine's and calls step_loop()."""
        self.llm, self.metrics = llm, metrics
        self.inbox = queue.Queue()
        self.outboxes = {}  # request id -> (deliver, prompt index) of a running request (engine thread only)
        self.num_client_aborts = 0  # HTTP requests aborted because their client hung up
        self.refused = set()  # requests of a refused batch, aborted: their outputs are not counted in /metrics
        self.closing, self.closed = threading.Lock(), False
        self.own_thread = own_thread
        if own_thread:  # (this thread's idle OpenMP workers would slow down the engine thread's on a CPU)
            kernels.release_openmp_workers()
            self.thread = threading.Thread(target=self.step_loop, name="nanobatch-engine", daemon=True)
            self.thread.start()
        else:
            self.thread = threading.current_thread()

    # -- called from any thread --

    def submit(self, sub: Submission):
        """Queue a request (all its prompts) for the next step; its outputs go to sub.deliver."""
        self._post(("add", sub))

    def abort(self, request_ids, by_client=False):
        self.inbox.put(("abort", request_ids, by_client))

    def call(self, fn):
        """Run fn(llm) in the engine thread between two steps and return its result (blocks the caller:
        for tests and introspection; the event loop awaits run() instead)."""
        reply = queue.Queue(maxsize=1)
        self._post(("call", fn, lambda ok, value: reply.put((ok, value))))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    async def run(self, fn):
        """call() for the event loop: awaits fn(llm) without blocking the loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok, value):
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        self._post(("call", fn, threadsafe(loop, settle)))
        return await future

    def _post(self, message):
        with self.closing:  # a message posted once _close has drained the inbox would wait forever
            if self.closed or not self.thread.is_alive():
                raise ServerError("the engine is not running", 503)
            self.inbox.put(message)

    def stop(self, timeout=10):
        """Fail the requests still running (503), free their blocks, end the thread's loop."""
        self.inbox.put(("stop",))
        if self.own_thread:
            self.thread.join(timeout)

    # -- the engine thread --

    def step_loop(self):
        """The engine's loop, until stop()."""
        while True:
            idle = not self.llm.has_unfinished_requests()
            messages = self._drain(block=idle)  # idle: sleep on the inbox, no busy loop
            for i, message in enumerate(messages):
                if message[0] == "stop":
                    return self._close(messages[i + 1 :])
                self._handle(message)
            if self.llm.has_unfinished_requests():
                self._step()

    def _drain(self, block):
        messages = [self.inbox.get()] if block else []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, message):
        kind = message[0]
        if kind == "add":
            self._add(message[1])
        elif kind == "abort":
            _, request_ids, by_client = message
            running = [
                r for r in request_ids if self.outboxes.pop(r, None) is not None
            ]  # nobody reads their final "abort" output
            for request_id in running:
                self.llm.abort_request(request_id)  # its final output comes out of the next step
            self.num_client_aborts += bool(by_client and running)
        elif kind == "call":
            _, fn, reply = message
            try:
                result = (True, fn(self.llm))
            except Exception as e:
                result = (False, e)
            reply(*result)

    def _add(self, sub: Submission):
        added = []
        try:
            for request_id, prompt in zip(sub.request_ids, sub.prompts):
                self.llm.add_request(
                    self.llm.chat_prompt(prompt, **sub.chat) if sub.chat is not None else prompt,
                    sub.beam or sub.params,
                    request_id,
                )
                added.append(request_id)
        except ValueError as e:  # prompt too long, empty, bad token ids, n > max_num_seqs, ...
            where = f"prompt {len(added)}: " if len(sub.prompts) > 1 else ""
            return self._refuse(sub, added, ServerError.invalid(e, where))
        except Exception:  # a bug, not the client's fault: fail this request, keep serving
            log.exception("could not add request %s", sub.request_ids[0])
            return self._refuse(sub, added, ServerError(INTERNAL_ERROR, 500))
        for index, request_id in enumerate(added):
            self.outboxes[request_id] = (sub.deliver, index)
            if self.metrics is not None:
                self.metrics.admitted(self.llm.requests[request_id])

    def _refuse(self, sub, added, error):
        for request_id in added:  # a batch of prompts runs whole or not at all
            self.llm.abort_request(request_id)
            self.refused.add(request_id)
        sub.deliver(error)

    def _step(self):
        try:
            outputs = self.llm.step()
        except Exception:  # fail the running requests, not the server
            log.exception("engine step failed; failing the running requests")
            return self._fail_all(ServerError(INTERNAL_ERROR, 500))
        if self.metrics is not None:
            self.metrics.stepped(self.llm.stats)
        self._deliver(outputs)

    def _deliver(self, outputs):
        by_loop = {}  # event loop -> [(fn, (prompt index, output))]: each loop is woken once for the whole step
        for out in outputs:
            if self.metrics is not None and out.request_id not in self.refused:
                self.metrics.observe(out)  # first: a client that has its answer sees it counted
            if out.finished:
                self.refused.discard(out.request_id)
            target = self.outboxes.pop(out.request_id, None) if out.finished else self.outboxes.get(out.request_id)
            if target is None:
                continue
            deliver, index = target
            if hasattr(deliver, "loop"):
                by_loop.setdefault(deliver.loop, []).append((deliver.fn, (index, out)))
            else:
                deliver((index, out))
        for loop, calls in by_loop.items():
            threadsafe(loop, run_each)(calls)

    def _fail_all(self, error):
        for request_id, (deliver, _) in self.outboxes.items():
            deliver(error)
            try:
                self.llm.abort_request(request_id)
            except Exception:
                pass
        self.outboxes.clear()
        try:
            self._deliver(self.llm.step())  # collects the aborts; their blocks are already free
        except Exception:
            pass

    def _close(self, after_stop):
        closing = ServerError("the server is shutting down", 503)
        with self.closing:
            self.closed = True
        for message in after_stop + self._drain(block=False):  # whatever came in after "stop"
            if message[0] == "add":
                message[1].deliver(closing)
            elif message[0] == "call":
                message[2](False, closing)
        self._fail_all(closing)


# ---- Metrics ----


class ServerMetrics:
    """vLLM's Prometheus metrics under its current (0.32) names, labels (model_name, engine) and
    meanings, so that a dashboard made for vLLM reads them. Counted in the engine thread from each
    RequestOutput; the gauges and the preemption count are read from the engine when /metrics is
    scraped. One registry per server."""

    TTFT_BUCKETS = (
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    )
    ITL_BUCKETS = (
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
    )
    ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    REQUEST_BUCKETS = (
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
    )

    def __init__(self, model_name, llm: LLM):
        disable_created_metrics()  # as vLLM: no *_created series (a process-wide setting of prometheus_client)
        self.registry = CollectorRegistry()
        self.max_model_len = llm.max_model_len
        labels = {
            "model_name": model_name,
            "engine": "0",
        }  # one engine per server (vLLM numbers its data-parallel engines)

        def metric(kind, name, doc, **kwargs):
            return kind(name, doc, list(labels), registry=self.registry, **kwargs).labels(**labels)

        token_buckets = [
            b * 10**e for e in range(len(str(llm.max_model_len))) for b in (1, 2, 5) if b * 10**e <= llm.max_model_len
        ]  # vLLM's 1-2-5 series
        self.num_running = metric(Gauge, "vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = metric(Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason (all wait for capacity here).",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.waiting_capacity = by_reason.labels(**labels, reason="capacity")
        by_reason.labels(**labels, reason="deferred").set(0)  # vLLM's LoRA budget, KV transfer: never here
        self.kv_usage = metric(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage: the fraction of blocks in use (1 = all)."
        )
        self.preemptions = metric(
            Counter, "vllm:num_preemptions", "Sequences preempted (their blocks freed, to be recomputed)."
        )
        self.prefix_queries = metric(
            Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = metric(Counter, "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_cached = metric(
            Counter, "vllm:prompt_tokens_cached", "Prompt tokens served from a cache (here: the prefix cache alone)."
        )
        self.prompt_tokens = metric(Counter, "vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = metric(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.request_prompt_tokens = metric(
            Histogram, "vllm:request_prompt_tokens", "Prompt tokens per finished request.", buckets=token_buckets
        )
        self.request_generation_tokens = metric(
            Histogram,
            "vllm:request_generation_tokens",
            "Generated tokens per finished request (all samples).",
            buckets=token_buckets,
        )
        self.request_max_generation = metric(
            Histogram,
            "vllm:request_max_num_generation_tokens",
            "Tokens of the longest sample per finished request.",
            buckets=token_buckets,
        )
        self.request_n = metric(
            Histogram, "vllm:request_params_n", "Samples (or beams) per finished request.", buckets=(1, 2, 5, 10, 20)
        )
        self.request_computed = metric(
            Histogram,
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed (not cached) per finished request.",
            buckets=token_buckets,
        )
        self.ttft = metric(
            Histogram, "vllm:time_to_first_token_seconds", "Time to first token.", buckets=self.TTFT_BUCKETS
        )
        self.itl = metric(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Time between two tokens of a sample.",
            buckets=self.ITL_BUCKETS,
        )
        self.tpot = metric(
            Histogram,
            "vllm:request_time_per_output_token_seconds",
            "Per request: time per output token after the first.",
            buckets=self.ITL_BUCKETS,
        )
        self.e2e = metric(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            buckets=self.REQUEST_BUCKETS,
        )
        self.queue = metric(
            Histogram, "vllm:request_queue_time_seconds", "Arrival to first scheduled.", buckets=self.REQUEST_BUCKETS
        )
        self.inference = metric(
            Histogram, "vllm:request_inference_time_seconds", "First scheduled to finish.", buckets=self.REQUEST_BUCKETS
        )
        self.prefill = metric(
            Histogram,
            "vllm:request_prefill_time_seconds",
            "First scheduled to first token.",
            buckets=self.REQUEST_BUCKETS,
        )
        self.decode = metric(
            Histogram, "vllm:request_decode_time_seconds", "First token to finish.", buckets=self.REQUEST_BUCKETS
        )
        self.iteration_tokens = metric(
            Histogram, "vllm:iteration_tokens_total", "Tokens computed per engine step.", buckets=self.ITERATION_BUCKETS
        )
        self.request_max_tokens = metric(
            Histogram,
            "vllm:request_params_max_tokens",
            "The max_tokens of each finished request (the room left when unset).",
            buckets=token_buckets,
        )
        self.request_preemptions = metric(
            Histogram,
            "vllm:request_num_preemptions",
            "Times each finished request was preempted.",
            buckets=(1, 2, 3, 4, 5, 10, 20),
        )
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            [*labels, "source"],
            registry=self.registry,
        )
        self.prompt_computed, self.prompt_local_hit = (
            by_source.labels(**labels, source=s) for s in ("local_compute", "local_cache_hit")
        )
        by_source.labels(**labels, source="external_kv_transfer")  # no KV transfer here: stays 0
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that held them.",
            [*labels, "source"],
            registry=self.registry,
        )
        self.prompt_cached_device = cached_by_source.labels(
            **labels, source="device"
        )  # the one tier here: the KV pool itself
        for source in ("host", "p2p", "disk", "external_unspecified"):
            cached_by_source.labels(**labels, source=source)
        self._constant_series(llm, labels)
        self.num_counted = {}  # request id -> its output tokens counted so far (engine thread)
        self.max_tokens = {}  # request id -> its max_tokens, from its admission to its end (engine thread)
        self.preemptions_read = 0  # llm.stats.num_preemptions at the last scrape
        self.num_steps = 0  # llm.stats.num_steps at the last step's observation

    def _constant_series(self, llm, labels):
        """Series vLLM's dashboards expect, set up once: sleep states and admission rejections (constant here),
        request_success by finish reason (observe counts it) and cache_config_info (the KV cache's settings)."""
        model_name = labels["model_name"]
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state: awake = 1 (this engine never sleeps).",
            [*labels, "sleep_state"],
            registry=self.registry,
        )
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(**labels, sleep_state=state).set(value)
        rejections = Counter(
            "vllm:admission_rejections",
            "Admissions refused by a queue limit (none here: a busy server queues).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.labels(model_name=model_name, reason=reason)
        success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.success = {
            reason: success.labels(**labels, finished_reason=reason)
            for reason in ("stop", "length", "abort", "error", "repetition")
        }  # vLLM's FinishReason
        # vLLM's cache_config_info: the KV cache's settings (CacheConfig's field names) and the engine as labels
        # of a constant 1, no model_name
        c = llm.config
        info = {
            "block_size": c.block_size,
            "num_gpu_blocks": llm.allocator.num_blocks,
            "enable_prefix_caching": c.enable_prefix_caching,
            "cache_dtype": "auto",
            "gpu_memory_utilization": c.gpu_memory_utilization,
        }
        info = {"engine": labels["engine"], **{k: str(v) for k, v in info.items()}}
        Gauge(
            "vllm:cache_config_info", "Information of the KV cache config.", list(info), registry=self.registry
        ).labels(**info).set(1)

    def observe(self, out: RequestOutput):
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if out.request_id not in self.num_counted and num_tokens:  # its first token: the prompt has been computed
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prefix_queries.inc(len(out.prompt_token_ids))
            self.prefix_hits.inc(out.num_cached_tokens)
            self.prompt_cached.inc(out.num_cached_tokens)
            self.prompt_cached_device.inc(out.num_cached_tokens)
            self.prompt_local_hit.inc(out.num_cached_tokens)
            self.prompt_computed.inc(len(out.prompt_token_ids) - out.num_cached_tokens)
            self.num_counted[out.request_id] = 0
        if out.request_id in self.num_counted:
            self.generation_tokens.inc(num_tokens - self.num_counted[out.request_id])
            self.num_counted[out.request_id] = num_tokens
        if out.finished:
            self.num_counted.pop(out.request_id, None)
            self._observe_finished(out)

    def _observe_finished(self, out):
        reasons = {c.finish_reason for c in out.outputs}
        self.success["abort" if "abort" in reasons else "length" if "length" in reasons else "stop"].inc()
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        self.request_max_generation.observe(longest)
        self.request_n.observe(len(out.outputs))
        self.request_computed.observe(len(out.prompt_token_ids) - (out.num_cached_tokens or 0))
        if out.request_id in self.max_tokens:
            self.request_max_tokens.observe(self.max_tokens.pop(out.request_id))
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.request_preemptions.observe(m.num_preemptions)
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.inference.observe(m.finished_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            self.decode.observe(m.finished_time - m.first_token_time)
            if m.first_scheduled_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            if longest > 1:  # samples run side by side: time per token of the longest
                mean_gap = (m.finished_time - m.first_token_time) / (longest - 1)
                self.tpot.observe(mean_gap)
                for _ in range(
                    longest - 1
                ):  # one per gap, as vLLM counts them; only the final output is seen, so each is the mean gap
                    self.itl.observe(mean_gap)

    def admitted(self, request):
        # as vLLM: an unset max_tokens is the room the context leaves
        self.max_tokens[request.request_id] = request.params.max_tokens or self.max_model_len - len(
            request.prompt_token_ids
        )

    def stepped(self, stats):
        if stats.num_steps != self.num_steps:  # the model ran (a step with nothing to run records no stats)
            self.num_steps = stats.num_steps
            self.iteration_tokens.observe(stats.num_step_tokens)

    def read_engine(self, llm: LLM):
        """The gauges, read in the engine thread."""
        self.num_running.set(len({s.request.request_id for s in llm.scheduler.running}))
        num_waiting = len({s.request.request_id for s in llm.scheduler.waiting})
        self.num_waiting.set(num_waiting)
        self.waiting_capacity.set(num_waiting)  # every waiting request waits for capacity here
        self.kv_usage.set(1 - llm.allocator.num_free_blocks / llm.allocator.num_blocks)
        self.preemptions.inc(llm.stats.num_preemptions - self.preemptions_read)
        self.preemptions_read = llm.stats.num_preemptions


# ---- Request bodies ----
#
# pydantic checks the JSON types (strictly, but for numbers: see Int), SamplingParams the values.


def structured_outputs_from_request(body):
    """The constraint of an OpenAI-style request body, or None, from one of: response_format
    ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}),
    vLLM's `structured_outputs` object, or its legacy guided_json / guided_regex / guided_choice /
    guided_grammar. A ValueError (a 400) names the field."""
    given = {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            schema = fmt.get("json_schema")
            schema = schema.get("schema") if isinstance(schema, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema object")
            given["response_format"] = {"json": schema}
        elif kind != "text":
            raise ValueError(
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got {_cut(repr(kind))}"
            )
    if body.get("structured_outputs") is not None:
        fields = body["structured_outputs"]
        if not isinstance(fields, dict):
            raise ValueError(
                "structured_outputs must be an object with one of json, regex, choice, grammar, json_object"
            )
        unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise ValueError(
                f"structured_outputs: unsupported field(s) {unknown}; "
                "nanobatch takes json, regex, choice, grammar, json_object"
            )
        given["structured_outputs"] = {k: v for k, v in fields.items() if v is not None}
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if body.get(name) is not None:
            given[name] = {name.removeprefix("guided_"): body[name]}
    if len(given) > 1:
        raise ValueError(f"give one structured output constraint, got {', '.join(given)}")
    if not given:
        return None
    ((name, fields),) = given.items()
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:  # in the request's words: guided_choice, structured_outputs.choice, response_format
        named = lambda m: f"{name}.{m[1]}" if name == "structured_outputs" else name  # noqa: E731
        message, found = re.subn(r"StructuredOutputsParams\.(\w+)", named, str(e))
        raise ValueError(message if found else f"{name}: {e}") from None


def one_of(description):
    """One error for a union, saying what it takes (pydantic would report one per member)."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "must be " + description) from None

    return WrapValidator(check)


Stop = Annotated[str | list[str], one_of("a string or a list of strings")]
Prompt = Annotated[
    str | list[int] | list[str] | list[list[int]],
    one_of("a string, a list of token ids, or a list of either (a batch)"),
]


# Numbers and booleans may come as strings ("max_tokens": "5", "stream": "false") and booleans as 0 / 1, as
# vLLM's lax pydantic models take them; every other type is strict.
Int = Annotated[int, Strict(False)]
Float = Annotated[float, Strict(False)]
Bool = Annotated[bool, Strict(False)]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # unknown fields are ignored, as vLLM does


class Sampling(Body):
    """SamplingParams fields under their (vLLM) names; None: the SamplingParams default."""

    n: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    max_tokens: Int | None = None
    stop: Stop | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[int, float] | None = None  # JSON keys are strings: {"50256": -100}
    allowed_token_ids: list[Int] | None = None  # vLLM's extras
    bad_words: list[str] | None = None
    min_tokens: Int | None = None
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None
    prompt_logprobs: Int | None = None

    def sampling_params(self, defaults=None, **fields):
        """SamplingParams of the fields sent, else of `defaults` (the model's generation_config.json settings, as vLLM's
        OpenAI server takes them), else SamplingParams' own; `fields` (the endpoint's own) over all. Its ValueError
        is a 400."""
        names = [
            name
            for name in type(self).model_fields
            if name in SamplingParams.__dataclass_fields__ and name not in STRUCTURED_OUTPUT_FIELDS
        ]
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        try:
            constraint = structured_outputs_from_request(
                {name: getattr(self, name, None) for name in STRUCTURED_OUTPUT_FIELDS}
            )
            return SamplingParams(**{**(defaults or {}), **given, **fields}, structured_outputs=constraint)
        except ValueError as e:
            raise ServerError.invalid(e) from None


class Generate(Sampling):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    stream: Bool | None = None
    logprobs: Int | None = None
    use_beam_search: Bool = False
    length_penalty: float | None = None  # beam search: a finished beam scores cum_logprob / length ** length_penalty


class StreamOptions(Body):
    include_usage: Bool | None = None
    continuous_usage_stats: Bool | None = None  # with include_usage: the usage so far on every chunk too (vLLM's)

    @staticmethod
    def usage(body):
        """(include_usage, continuous_usage_stats) of a request, as vLLM reads them: the second needs the first."""
        include = bool(body.stream_options and body.stream_options.include_usage)
        return include, include and bool(body.stream_options.continuous_usage_stats)


class OpenAI(Sampling):
    model: str | None = None  # None: the served model
    request_id: str | None = (
        None  # the response's id (after cmpl- or chatcmpl-) unless an X-Request-Id header gives one; None: random
    )
    stream: Bool | None = None  # None (null or absent) is false here and below: some clients send every field
    stream_options: StreamOptions | None = None
    use_beam_search: Bool | None = None  # vLLM's extra: beam search with n beams (completions; see beam_search_params)
    length_penalty: float | None = None
    # asked-for features that are not implemented: declared so that UNSUPPORTED_FIELDS refuses them
    logprob_token_ids: list[int] | None = None  # vLLM's extras, from here to priority
    truncate_prompt_tokens: Int | None = None
    add_special_tokens: Bool | None = (
        None  # vLLM's default: true for completions, false for chat (the template adds them)
    )
    spaces_between_special_tokens: Bool | None = None
    return_tokens_as_token_ids: Bool | None = None
    return_token_ids: Bool | None = None
    priority: Int | None = None
    # structured outputs: checked by structured_outputs_from_request (one constraint; its ValueError is a 400)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class Completion(OpenAI):
    prompt: Prompt | None = None  # optional to pydantic, as in vLLM: its absence is a BadRequestError naming it
    echo: Bool | None = None
    logprobs: Int | None = None
    suffix: Any = None
    best_of: Int | None = None  # taken and ignored, as vLLM 0.32 does (no best-of ranking: n samples come back)


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: str
    content: (
        Annotated[str | list[TextPart], one_of('a string or a list of text parts ({"type": "text", "text": ...})')]
        | None
    ) = None

    def for_template(self):  # (LLM.chat_prompt joins text parts as vLLM's does)
        content = [p.model_dump() for p in self.content] if isinstance(self.content, list) else self.content
        return {"role": self.role, "content": content or ""}


class ChatTemplate(Body):
    """vLLM's chat-template options, on chat completions and /tokenize: passed to LLM.chat_prompt (chat_template,
    a client's own Jinja, is refused: see UNSUPPORTED_FIELDS)."""

    add_generation_prompt: Bool | None = None
    continue_final_message: Bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    def template(self):
        names = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class Chat(OpenAI, ChatTemplate):
    messages: list[Message] = Field(min_length=1)
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    max_completion_tokens: Int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    echo: Bool | None = None  # vLLM's chat extra (continue the last message's role): not implemented


class Tokenize(ChatTemplate):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None  # tokenized as the chat template renders them
    add_special_tokens: Bool = True
    return_token_strs: Bool | None = None  # also each token's string, as the tokenizer's vocabulary has it


class Detokenize(Body):
    model: str | None = None
    tokens: list[int]


# Fields that would change the output but are not implemented: a 400 naming the field, never a
# silent 200. A feature that implements one (structured outputs, beam search) deletes its entries
# here and reads the field from the request model.
UNSUPPORTED_FIELDS = {  # field -> (does the request ask for it?, why it is refused)
    "suffix": (lambda v, body: bool(v), "text insertion is not implemented"),
    "use_beam_search": (
        lambda v, body: bool(v) and hasattr(body, "messages"),
        "beam search is served on /v1/completions and /generate",
    ),
    **{name: (lambda v, body: bool(v), "tool calling is not implemented") for name in ("tools", "functions")},
    **{
        name: (lambda v, body: v not in (None, "none", "auto"), "tool calling is not implemented")
        for name in ("tool_choice", "function_call")
    },
    # vLLM's extras, refused where they differ from vLLM's defaults (a client may send every field)
    **{
        name: (lambda v, body: v is not None, "it is not implemented")
        for name in ("logprob_token_ids", "truncate_prompt_tokens")
    },
    **{
        name: (lambda v, body: bool(v), "it is not implemented")
        for name in ("return_tokens_as_token_ids", "return_token_ids", "priority")
    },
    "spaces_between_special_tokens": (lambda v, body: v is False, "it is not implemented"),
    # (on completions and chat; /tokenize takes add_special_tokens for a prompt)
    "add_special_tokens": (
        lambda v, body: isinstance(body, OpenAI) and v is not None and v != (not isinstance(body, Chat)),
        "prompts are tokenized as vLLM's default does (completions with special tokens, chat without)",
    ),
    "echo": (
        lambda v, body: bool(v) and hasattr(body, "messages"),
        "chat echo is not implemented",
    ),  # completions' echo is
    # a client's own Jinja would run in the engine thread, unbounded: vLLM too refuses it unless its server trusts them
    "chat_template": (
        lambda v, body: v is not None,
        "a request's own chat template is not run (vLLM's needs --trust-request-chat-template)",
    ),
}
STRUCTURED_OUTPUT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def reject_unsupported(body):
    for name, (asked, why) in UNSUPPORTED_FIELDS.items():
        if asked(getattr(body, name, None), body):
            raise ServerError(f"'{name}' is not supported: {why}", param=name)
    if (
        (options := getattr(body, "stream_options", None)) and options.model_fields_set and not body.stream
    ):  # vLLM's 400 ({} passes)
        raise ServerError("'stream_options' is only allowed with stream: true", param="stream_options")
    if (
        isinstance(body, OpenAI) and body.stream and body.prompt_logprobs
    ):  # vLLM's 400 (0 passes): a stream has no place for them
        raise ServerError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    return body


def beam_search_params(body, params, default_temperature=None):
    """vLLM's `use_beam_search` (/generate, and an extra field of /v1/completions): beam search with
    n beams, the n best returned, best first; None when the request does not ask for it. The response
    is shaped by params (n outputs per prompt) as for sampling; default_temperature: the generation config's."""
    if not body.use_beam_search:
        return None
    if body.stream:
        raise ServerError("use_beam_search does not stream (the beams are known only at the end); send stream: false")
    # a field is refused for what it asks, read from params against the defaults (both normalised): 0 asks for
    # something (logprobs 0: each token's logprob; seed 0), a default sent as such (top_p 1, top_k -1, stop []) does not
    default = SamplingParams()
    taken = [name for name in BEAM_REFUSES if getattr(params, name) != getattr(default, name)]
    if getattr(body, "echo", None):
        taken.append("echo")
    taken += [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(body, name, None) is not None]
    if taken:
        raise ServerError(f"use_beam_search does not take {', '.join(taken)}")
    temperature = next((t for t in (body.temperature, default_temperature) if t is not None), 0.0)
    if params.max_tokens is None:  # ("max_tokens": null)
        raise ServerError(
            "use_beam_search needs max_tokens as a number (null, up to max_model_len, is not served with beams)",
            param="max_tokens",
        )
    try:
        return BeamSearchParams(
            beam_width=params.n,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            temperature=temperature,
            length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
        )
    except ValueError as e:
        raise ServerError.invalid(e) from None


BEAM_REFUSES = (
    "stop",
    "stop_token_ids",
    "logprobs",
    "prompt_logprobs",
    "seed",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "allowed_token_ids",
    "bad_words",
)  # SamplingParams fields beam search ignores


def validation_message(error):
    """A pydantic ValidationError as one line that names the field."""
    problems = error.errors(include_url=False)
    unknown = sorted(str(p["loc"][-1]) for p in problems if p["type"] == "extra_forbidden")
    if unknown:
        return f"unknown field(s) {unknown}"
    p = problems[0]
    where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in p["loc"]).lstrip(".")
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    if p["type"] == "json_invalid":
        return f"request body is not valid JSON: {p['ctx']['error']}"
    if not where:
        return "request body must be a JSON object" if p["type"] == "model_type" else p["msg"]
    if p["type"] == "missing":
        return f"'{where}' is required{more}"
    return f"'{where}': {p['msg']}{more}"


async def read_json(request, model):
    """The request body validated by a pydantic model; a 4xx naming the problem if it does not fit."""
    declared = int(request.headers.get("content-length") or 0)  # h11 has checked that it is a number
    if declared > MAX_BODY_BYTES:  # refused unread: uvicorn reads the rest away and keeps the connection in step
        raise ServerError(f"request body too large: {declared} bytes, the limit is {MAX_BODY_BYTES}")
    try:
        body = await asyncio.wait_for(read_body(request), BODY_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        raise ServerError(f"the request body did not arrive within {BODY_TIMEOUT_SECONDS} s", 408) from None
    if not body:
        raise ServerError("request body is empty: send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:  # jiter refuses lone surrogates and deep nesting here too
        loc = e.errors(include_url=False)[0][
            "loc"
        ]  # vLLM 0.32 (FastAPI's validation): type "Bad Request", param body.<field>
        raise ServerError(
            validation_message(e), param=".".join(map(str, ("body", *loc))), type=HTTPStatus.BAD_REQUEST.phrase
        ) from None


async def read_body(request):
    body = bytearray()
    async for chunk in request.stream():  # chunked bodies too: uvicorn has decoded the framing
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ServerError(f"request body too large: over {MAX_BODY_BYTES} bytes")
    return bytes(body)


# ---- Response formats ----
#
# Built in the event loop from RequestOutputs, which are snapshots (see EngineLoop).


def usage_counts(outs):
    # echo with max_tokens 0 counts its one dropped token, as vLLM does (it is computed)
    num_prompt = sum(len(o.prompt_token_ids) for o in outs)
    num_output = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def finite(logprob):
    """A logprob as JSON can carry it: a token the grammar forbade has -inf, sent as -9999.0, as vLLM does."""
    return max(logprob, -9999.0)


def sampled_logprob(entry):
    """(token id, Logprob) of the sampled (or prompt) token: the engine puts it first."""
    return next(iter(entry.items()))


def best_logprobs(entry, k):
    """The k most likely (token id, Logprob) of one position."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:k]


def generate_logprobs(entries, k):
    """/generate: per token {token_id, token, logprob, rank, top_logprobs: [the k best]}."""

    def item(token_id, lp):
        return {"token_id": token_id, "token": lp.decoded_token, "logprob": finite(lp.logprob), "rank": lp.rank}

    return [
        {**item(*sampled_logprob(e)), "top_logprobs": [item(*best) for best in best_logprobs(e, k)]} for e in entries
    ]


def completion_logprobs(entries, offset, k, first_token=""):
    """OpenAI legacy completions logprobs: per token the chosen one and the k best (at most k + 1: an echoed prompt's
    entries may hold more, as prompt_logprobs asked). An entry of None (the first prompt token under echo: it has
    no logprob) gives nulls, and first_token is its text. offset: where the first token starts in the text."""
    tokens = [first_token if e is None else sampled_logprob(e)[1].decoded_token for e in entries]
    offsets = list(itertools.accumulate(map(len, tokens), initial=offset))
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else finite(sampled_logprob(e)[1].logprob) for e in entries],
        "top_logprobs": [
            None if e is None else {lp.decoded_token: finite(lp.logprob) for lp in itertools.islice(e.values(), k + 1)}
            for e in entries
        ],
        "text_offset": offsets[:-1],
    }


def chat_logprobs(entries, k):
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [the k best]}]}."""

    def item(lp):
        return {
            "token": lp.decoded_token,
            "logprob": finite(lp.logprob),
            "bytes": list(lp.decoded_token.encode("utf-8")),
        }

    return {
        "content": [
            {**item(sampled_logprob(e)[1]), "top_logprobs": [item(lp) for _, lp in best_logprobs(e, k)]}
            for e in entries
        ]
    }


def vllm_prompt_logprobs(entries):
    """vLLM's `prompt_logprobs` field: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    return [
        None
        if e is None
        else {tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for tid, lp in e.items()}
        for e in entries or []
    ]


class StreamDeltas:
    """What a stream has sent of each choice, so that each chunk carries only what is new."""

    def __init__(self):
        self.num_chars, self.num_entries, self.done = {}, {}, set()

    def new(self, key, text, entries, finish_reason):
        """(new text, new logprob entries, finish_reason if it just finished) of a choice, or None."""
        delta, new_entries = text[self.num_chars.get(key, 0) :], entries[self.num_entries.get(key, 0) :]
        finish_reason = finish_reason if key not in self.done else None
        if not (delta or new_entries or finish_reason):
            return None
        self.num_chars[key], self.num_entries[key] = len(text), len(entries)
        if finish_reason:
            self.done.add(key)
        return delta, new_entries, finish_reason


class GenerateFormat:
    """vLLM's demo server: {"text": [prompt + completion, one per sample]}; streamed as
    newline-delimited JSON with the cumulative text (as the demo does) and the new logprobs."""

    content_type = "application/x-ndjson"
    echo = None

    def __init__(self, params):
        self.params = params
        self.deltas = StreamDeltas()

    def body(self, out, new_only):
        body = {"text": [(out.prompt or "") + c.text for c in out.outputs]}
        if self.params.logprobs is not None:
            entries = [c.logprobs or [] for c in out.outputs]
            if new_only:  # a stream sends each logprob once
                entries = [(self.deltas.new(c.index, "", e, None) or ("", []))[1] for c, e in zip(out.outputs, entries)]
            body["logprobs"] = [generate_logprobs(e, self.params.logprobs) for e in entries]
        return body

    def response(self, outs):
        return self.body(outs[0], new_only=False)

    def chunks(self, index, out):
        return [json.dumps(self.body(out, new_only=True)).encode() + b"\n"]

    def tail(self):
        return []

    def error(self, e):
        return json.dumps(e.body()).encode() + b"\n"


class OpenAIFormat:
    """OpenAI completions (chat=False) or chat completions (chat=True), whole or as server-sent
    events ("data: {...}\\n\\n" ... "data: [DONE]\\n\\n"). Choice i * n + j is sample j of prompt i.

    Usage in a stream: only with stream_options.include_usage, on a last chunk with no choices (as OpenAI);
    with continuous_usage_stats too, each chunk also carries its prompt's and choice's usage so far (as vLLM)."""

    content_type = "text/event-stream"

    def __init__(
        self,
        chat,
        request_id,
        model,
        params,
        num_prompts=1,
        usage=(False, False),
        echo=False,
        prompt_only=False,
        prompt_logprobs=False,
    ):
        self.chat, self.request_id, self.model, self.params = chat, request_id, model, params
        self.num_prompts = num_prompts
        self.include_usage, self.continuous_usage = usage  # see StreamOptions.usage
        self.echo = (
            {} if echo else None
        )  # completions with echo: prompt index -> (prompt text, its first token's text), from the engine thread
        self.prompt_only = prompt_only  # echo with max_tokens 0: the prompt is the whole answer
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field was asked for
        self.created = int(time.time())
        self.deltas = StreamDeltas()
        self.text_offsets = {}  # completions logprobs: choice -> chars sent so far
        self.finished = {}  # prompt index -> its final output (stream)
        self.sent_roles = False
        self.role = "assistant"  # chat: the reply's role

    def envelope(self, choices, chunk):
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def usage_so_far(self, out, num_output):
        """continuous_usage_stats: a chunk's usage field, its prompt's tokens and its choice's so far (as vLLM)."""
        if not self.continuous_usage:
            return {}
        num_prompt = len(out.prompt_token_ids)
        return {
            "usage": {
                "prompt_tokens": num_prompt,
                "completion_tokens": num_output,
                "total_tokens": num_prompt + num_output,
            }
        }

    def parts(self, index, out, c, text):
        """(text, logprob entries, finish_reason) of one choice; with echo the prompt's come first."""
        entries, finish_reason = c.logprobs or [], c.finish_reason
        if self.prompt_only:
            text, entries, finish_reason = "", [], finish_reason and "length"
        if self.echo is not None:
            text, entries = self.echo[index][0] + text, (out.prompt_logprobs or []) + entries
        return text, entries, finish_reason

    def logprobs(self, entries, key, index):
        if self.params.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.params.logprobs)
        offset = self.text_offsets.get(key, 0)
        result = completion_logprobs(
            entries, offset, self.params.logprobs, self.echo[index][1] if self.echo is not None else ""
        )
        self.text_offsets[key] = offset + sum(len(t) for t in result["tokens"])
        return result

    def response(self, outs):
        choices = []
        for index, out in enumerate(outs):
            for c in out.outputs:
                key = index * self.params.n + c.index
                text, entries, finish_reason = self.parts(index, out, c, c.text)
                content = {"message": {"role": self.role, "content": text}} if self.chat else {"text": text}
                choice = {
                    "index": key,
                    **content,
                    "logprobs": self.logprobs(entries, key, index),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if self.prompt_logprobs and not self.chat:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        response = {**self.envelope(choices, chunk=False), "usage": usage_counts(outs)}
        if self.prompt_logprobs and self.chat:  # as vLLM: a chat has one prompt, its logprobs beside the choices
            response["prompt_logprobs"] = vllm_prompt_logprobs(outs[0].prompt_logprobs)
        return response

    def chunks(self, index, out):
        events = []
        if self.chat and not self.sent_roles:  # OpenAI opens each choice with its role
            self.sent_roles = True
            events += [
                {
                    **self.envelope(
                        [
                            {
                                "index": i,
                                "delta": {"role": self.role, "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        True,
                    ),
                    **self.usage_so_far(out, 0),
                }
                for i in range(self.params.n)
            ]
        for c in out.outputs:
            key = index * self.params.n + c.index
            new = self.deltas.new(key, *self.parts(index, out, c, c.text))
            if new is None:
                continue
            delta, entries, finish_reason = new
            content = (
                {"delta": {"content": delta}} if self.chat else {"text": delta}
            )  # the last chat delta too: {"content": ""}, as vLLM
            choice = {
                "index": key,
                **content,
                "logprobs": self.logprobs(entries, key, index),
                "finish_reason": finish_reason,
            }
            if (
                finish_reason or not self.chat
            ):  # vLLM's stop_reason: on every completion chunk, on a chat choice's last chunk only
                choice["stop_reason"] = c.stop_reason if finish_reason else None
            events.append({**self.envelope([choice], True), **self.usage_so_far(out, len(c.token_ids))})
        if out.finished:
            self.finished[index] = out
        if len(self.finished) == self.num_prompts:  # the last prompt just finished
            if self.include_usage:  # else no usage at all, as OpenAI and vLLM
                events.append({**self.envelope([], True), "usage": usage_counts(list(self.finished.values()))})
        return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]

    def tail(self):
        return [b"data: [DONE]\n\n"]

    def error(self, e):  # then [DONE], as vLLM ends a stream that failed
        return b"data: " + json.dumps(e.body()).encode() + b"\n\n" + self.tail()[0]


def echo_pieces(llm, out):
    """(prompt text, text of its first token) for echo; in the engine thread (it holds the tokenizer)."""
    text = out.prompt if out.prompt is not None else llm.tokenizer.decode(out.prompt_token_ids)
    return text, llm.tokenizer.decode(out.prompt_token_ids[:1])


# ---- Endpoints ----
#
# One module-level handler per endpoint, which finds the Server it serves at request.app.state.server
# (build_app puts it there) instead of closing over it inside build_app: each endpoint reads on its
# own, and the servers of one process (the tests start several) share the handlers.


class Pending:
    """A submitted request seen from the event loop: the engine thread puts its (prompt index,
    RequestOutput)s, or a ServerError, on an asyncio queue."""

    def __init__(self, engine: EngineLoop, sub: Submission):
        self.engine, self.sub = engine, sub
        self.queue = asyncio.Queue()
        sub.deliver = threadsafe(asyncio.get_running_loop(), self.queue.put_nowait)
        self.unfinished = set(range(len(sub.prompts)))
        engine.submit(sub)

    async def next(self):
        item = await self.queue.get()
        if isinstance(item, ServerError):
            self.unfinished.clear()  # the engine has ended (or never started) every prompt of it
            raise item
        index, out = item
        if out.finished:
            self.unfinished.discard(index)
        return index, out

    async def finals(self):
        """Every prompt's final output, in prompt order."""
        outs = {}
        while self.unfinished:
            index, out = await self.next()
            outs[index] = out
        return [outs[i] for i in range(len(self.sub.prompts))]

    def abort(self):
        """The client hung up: free the blocks now."""
        if self.unfinished:
            self.engine.abort(self.sub.request_ids, by_client=True)
            self.unfinished.clear()


async def unless_hung_up(request, pending, work):
    """The result of coroutine `work`, or None if the client hangs up first (the request is then aborted)."""
    work, gone = asyncio.ensure_future(work), asyncio.ensure_future(hang_up(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            pending.abort()
    # a just-cancelled task is not done yet: its result() would raise InvalidStateError
    return work.result() if work.done() and not work.cancelled() else None


async def hang_up(request):
    # the body has been read: the next message uvicorn has for this request is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


routes = APIRouter()  # the endpoints below; build_app adds them to the app


async def refused(request, e: ServerError):
    return JSONResponse(e.body(), e.status)


async def no_route(request, e: HTTPException):  # Starlette's 404 / 405
    method, path = request.method, request.url.path
    message = {
        404: f"no such endpoint: {method} {path}",
        405: f"{path} takes {(e.headers or {}).get('Allow')}, not {method}",
    }
    error = ServerError(message.get(e.status_code, str(e.detail)), e.status_code)
    return JSONResponse(error.body(), e.status_code, headers=e.headers)


async def hung_up(request, e):  # the client left while sending its body: nobody reads the answer
    return Response(status_code=499)


async def bug(request, e):  # uvicorn logs the traceback; the client gets no internals
    return JSONResponse(ServerError(INTERNAL_ERROR, 500).body(), 500)


def check_max_tokens(server, params, name="max_tokens"):
    """vLLM's server refuses a max_tokens that no output could reach (its LLM, and nanobatch's, run to the
    context's end)."""
    if params.max_tokens is not None and params.max_tokens > server.max_model_len:
        raise ServerError(
            f"{name}={params.max_tokens} cannot be greater than max_model_len={server.max_model_len}. "
            "Please request fewer output tokens.",
            param=name,
        )
    return params


def client_request_id(request, body):
    """vLLM's: the X-Request-Id header, else the body's request_id, else 16 random hex digits."""
    return request.headers.get("X-Request-Id") or body.request_id or uuid.uuid4().hex[:16]


def check_model(server, body):
    if body.model and body.model != server.model_name:  # (None or "": the served model)
        # vLLM's words, and the name that would do
        raise ServerError(f"The model `{body.model}` does not exist. Valid aliases: {server.model_name}.", 404, "model")
    return body


async def ask(engine, fn):
    """fn(llm) in the engine thread; its ValueError is a 400."""
    try:
        return await engine.run(fn)
    except ValueError as e:
        raise ServerError.invalid(e) from None


async def respond(request: Request, sub, fmt, stream):
    if not stream:  # only the final output crosses threads: no per-step snapshots
        sub.params = dataclasses.replace(sub.params, output_kind="final_only")
    pending = Pending(request.app.state.server.engine, sub)
    if not stream:
        outs = await unless_hung_up(request, pending, pending.finals())
        if outs is None:
            return Response(status_code=499)
        for index, out in enumerate(outs):
            await fill_echo(pending.engine, fmt, index, out)
        return JSONResponse(fmt.response(outs))
    first = await unless_hung_up(request, pending, pending.next())  # add_request's ValueError is still a 400 here
    if first is None:
        return Response(status_code=499)
    return AbortingStream(
        pending,
        stream_body(pending, fmt, first),
        headers={"Content-Type": fmt.content_type, "Cache-Control": "no-cache"},
    )


class AbortingStream(StreamingResponse):
    """A stream that aborts its request however the response ends: Starlette cancels the stream of a client
    that hung up, and may do so before the body's generator has started (a finally in it would never run)."""

    def __init__(self, pending, body, headers):
        super().__init__(body, headers=headers)
        self.pending = pending

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.pending.abort()  # still running: the client hung up (after the last chunk, nothing is left to abort)


async def stream_body(pending, fmt, item):
    try:
        while True:
            await fill_echo(pending.engine, fmt, *item)
            for chunk in fmt.chunks(*item):
                yield chunk
            if not pending.unfinished:
                break
            item = await pending.next()
        for chunk in fmt.tail():
            yield chunk
    except ServerError as e:  # the engine failed mid-stream: the status line is gone, report it in-band
        yield fmt.error(e)


async def fill_echo(engine, fmt, index, out):
    if fmt.echo is not None and index not in fmt.echo:
        fmt.echo[index] = await engine.run(lambda llm: echo_pieces(llm, out))


@routes.post("/generate")
async def generate(request: Request):
    body = reject_unsupported(await read_json(request, Generate))
    # vLLM's /generate makes SamplingParams(**body): no generation-config defaults,
    # and "max_tokens": null is up to max_model_len
    unbounded = {"max_tokens": None} if body.max_tokens is None and "max_tokens" in body.model_fields_set else {}
    params = check_max_tokens(request.app.state.server, body.sampling_params(logprobs=body.logprobs, **unbounded))
    sub = Submission([f"gen-{uuid.uuid4().hex}"], [body.prompt], params, beam=beam_search_params(body, params))
    return await respond(request, sub, GenerateFormat(params), bool(body.stream))


@routes.post("/v1/completions")
async def completions(request: Request):
    server = request.app.state.server
    body = reject_unsupported(check_model(server, await read_json(request, Completion)))
    if body.prompt is None:
        raise ServerError("'prompt' is required", param="prompt")
    one = isinstance(body.prompt, str) or all(isinstance(t, int) for t in body.prompt)
    prompts = [body.prompt] if one else body.prompt
    prompt_only = bool(body.echo) and body.max_tokens == 0  # score the prompt: one token is generated, and dropped
    k = body.logprobs
    prompt_k = (
        k if body.echo and body.prompt_logprobs is None else body.prompt_logprobs
    )  # (echo shows the first k + 1 of each)
    # "max_tokens": null is 16, as absent (vLLM 0.32's); beam search takes no sampling settings,
    # so no defaults for them either
    defaults = {} if body.use_beam_search else server.sampling_defaults
    params = check_max_tokens(
        server,
        body.sampling_params(
            defaults, logprobs=k, prompt_logprobs=prompt_k, **({"max_tokens": 1} if prompt_only else {})
        ),
    )
    request_id = f"cmpl-{client_request_id(request, body)}"
    with_prompt_logprobs = body.prompt_logprobs is not None or (
        bool(body.echo) and k is not None
    )  # vLLM sends them for echo + logprobs too
    fmt = OpenAIFormat(
        False,
        request_id,
        server.model_name,
        params,
        len(prompts),
        StreamOptions.usage(body),
        bool(body.echo),
        prompt_only,
        with_prompt_logprobs,
    )
    beam = beam_search_params(body, params, server.sampling_defaults.get("temperature"))
    sub = Submission(
        [f"{request_id}-{i}-{uuid.uuid4().hex[:8]}" for i in range(len(prompts))], prompts, params, beam=beam
    )
    return await respond(request, sub, fmt, bool(body.stream))


@routes.post("/v1/chat/completions")
async def chat(request: Request):
    server = request.app.state.server
    body = reject_unsupported(check_model(server, await read_json(request, Chat)))
    if body.top_logprobs and not body.logprobs:  # (0 is taken without it, as vLLM's)
        raise ServerError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    if (
        body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20
    ):  # (the engine's message would name its field, logprobs)
        raise ServerError(
            f"top_logprobs must be an integer from 0 to 20, got {body.top_logprobs}", param="top_logprobs"
        )
    # None: the generation config's max_new_tokens, else up to max_model_len (vLLM's)
    max_tokens = next(
        (m for m in (body.max_completion_tokens, body.max_tokens, server.default_max_tokens) if m is not None), None
    )
    params = body.sampling_params(
        server.sampling_defaults, max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None
    )
    check_max_tokens(
        server, params, "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    request_id = f"chatcmpl-{client_request_id(request, body)}"
    fmt = OpenAIFormat(
        True,
        request_id,
        server.model_name,
        params,
        1,
        StreamOptions.usage(body),
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    if body.add_generation_prompt is False:  # the reply continues the last message: vLLM gives it that message's role
        fmt.role = body.messages[-1].role
    sub = Submission(
        [f"{request_id}-{uuid.uuid4().hex[:8]}"],
        [[m.for_template() for m in body.messages]],
        params,
        chat=body.template(),
    )
    return await respond(request, sub, fmt, bool(body.stream))


@routes.post("/tokenize")
async def tokenize(request: Request):
    server = request.app.state.server
    body = reject_unsupported(check_model(server, await read_json(request, Tokenize)))
    if (body.prompt is None) == (body.messages is None):
        raise ServerError("send one of 'prompt' or 'messages'")

    def encode(llm):  # (token ids, their strings as the vocabulary has them, if asked)
        if body.messages is not None:  # the chat template holds its own special tokens
            ids = llm.chat_prompt([m.for_template() for m in body.messages], **body.template())["prompt_token_ids"]
        else:
            ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return ids, llm.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

    token_ids, token_strs = await ask(server.engine, encode)
    return {
        "count": len(token_ids),
        "max_model_len": server.max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }


@routes.post("/detokenize")
async def detokenize(request: Request):
    server = request.app.state.server
    body = check_model(server, await read_json(request, Detokenize))

    def decode(llm):
        vocab_size = llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        return llm.tokenizer.decode(body.tokens)

    return {"prompt": await ask(server.engine, decode)}


@routes.get("/v1/models")
async def list_models(request: Request):
    server = request.app.state.server
    model = {
        "id": server.model_name,
        "object": "model",
        "created": server.created,
        "owned_by": "nanobatch",
        "root": server.model_path,
        "max_model_len": server.max_model_len,
    }
    return {"object": "list", "data": [model]}


@routes.get("/health")
async def health(request: Request):
    alive = request.app.state.server.engine.thread.is_alive()
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, 200 if alive else 503)


@routes.get("/version")
async def version():
    return {"version": VERSION}


@routes.get("/metrics")
async def metrics(request: Request):
    server = request.app.state.server
    await server.engine.run(server.metrics.read_engine)
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(server):
    """The FastAPI app: the routes above, and every error as {"error": {...}} JSON."""
    app = FastAPI(
        title="nanobatch", version=VERSION, openapi_url=None
    )  # bodies are parsed by hand (read_json): no schema to show
    app.state.server = server
    app.include_router(routes)
    app.add_exception_handler(ServerError, refused)
    app.add_exception_handler(HTTPException, no_route)
    app.add_exception_handler(ClientDisconnect, hung_up)
    app.add_exception_handler(Exception, bug)
    return app


# ---- HTTP ----


class HTTPProtocol(H11Protocol):
    """uvicorn's h11 protocol (strict framing: conflicting Content-Lengths, transfer codings other
    than chunked and over-long heads get a 400) with a deadline on each request head.

    A connection gets timeout_keep_alive seconds to send each request head, from connecting or
    from its last response. (uvicorn alone times out only the silence after a response: a
    connection that never sends a request, or sends a byte a second, would stay open.)"""

    head_deadline = None
    closed = False

    def connection_made(self, transport):
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data):
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self):
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc):
        self.closed = True
        self._watch_head()
        super().connection_lost(exc)

    def _watch_head(self):
        waiting = self.conn.their_state is h11.IDLE and not self.closed
        if waiting and self.head_deadline is None:
            self.head_deadline = self.loop.call_later(self.timeout_keep_alive, self.transport.close)
        elif not waiting and self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None


class QuietProbes(logging.Filter):
    """The access log without the health checks and metric scrapes (they come every few seconds)."""

    def filter(self, record):
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            len(args) > 2 and str(args[2]).split("?")[0] in QUIET_PATHS
        )  # uvicorn's args: client, method, path, ...


class Server:
    """uvicorn serving the app on one socket, and the engine thread behind it. stop() ends both."""

    def __init__(self, llm: LLM, config: ServerConfig, log_config=None, engine_here=False):
        """engine_here: the engine's loop runs in this thread (serve_forever), not one of its own (start_server)."""
        self.config = config
        self.model_path = os.path.normpath(os.path.expanduser(llm.config.model or default_model_path()))
        self.model_name = config.served_model_name or served_model_name(llm)
        self.max_model_len, self.created = llm.max_model_len, int(time.time())
        # what a completion or chat request leaves out comes from generation_config.json, as in vLLM's server;
        # its max_new_tokens only where a chat sends no max_tokens, at most max_model_len
        defaults, plain = llm.get_default_sampling_params(), SamplingParams()
        self.sampling_defaults = {
            f: getattr(defaults, f) for f in nanobatch.GENERATION_DEFAULTS if getattr(defaults, f) != getattr(plain, f)
        }
        new_tokens = llm.generation_config.get("max_new_tokens")
        self.default_max_tokens = None if new_tokens is None else min(new_tokens, llm.max_model_len)
        self.socket = socket.create_server(
            (config.host, config.port), family=socket.AF_INET6 if ":" in config.host else socket.AF_INET, backlog=128
        )
        self.metrics = ServerMetrics(self.model_name, llm)
        self.engine = EngineLoop(llm, self.metrics, own_thread=not engine_here)
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(
                build_app(self),
                http=HTTPProtocol,
                ws="none",
                lifespan="off",
                log_config=log_config,
                backlog=128,
                limit_concurrency=config.limit_concurrency,
                timeout_keep_alive=config.timeout_keep_alive,
                timeout_graceful_shutdown=5,
            )
        )
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, QuietProbes) for f in access.filters):
            access.addFilter(QuietProbes())
        self.thread = None

    @property
    def url(self):
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self):
        """Serve until Ctrl-C: the engine's loop in this thread (the one that loaded the model, whose OpenMP
        workers its steps use: see kernels.release_openmp_workers), uvicorn in a thread of its own; Ctrl-C and
        SIGTERM reach this thread and end both."""
        if self.engine.thread is not threading.current_thread():
            raise RuntimeError("serve_forever runs the engine's loop: make the Server with engine_here=True")

        def http():
            try:
                self.uvicorn.run(sockets=[self.socket])
            finally:  # (uvicorn ended, or failed to start: the engine's loop ends too)
                self.engine.stop()

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        if threading.current_thread() is threading.main_thread():  # uvicorn, in its thread, leaves signals to this
            signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: a graceful stop
        uvicorn_thread = threading.Thread(target=http, name="nanobatch-http", daemon=True)
        uvicorn_thread.start()
        try:
            self.engine.step_loop()
        except KeyboardInterrupt:
            self.engine._close([])  # the requests still running get a 503
        finally:
            self.uvicorn.should_exit = True  # uvicorn answers what is in flight, then stops
            uvicorn_thread.join(30)

    def stop(self):
        """Fail the requests still running (503), end the engine thread, stop uvicorn and close the socket."""
        self.engine.stop()  # first: the handlers waiting on it answer and end
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(30)
        self.socket.close()


def check_port_free(host, port):
    """Bind-test the port (the CLI does it before the model load, so that a busy port fails at once).
    SO_REUSEADDR, as the server's own socket: only a port someone listens on counts as busy."""
    if port == 0:
        return  # any free port: the server picks one
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise OSError(
            f"cannot serve on host {host!r}: {e.strerror} (pick an address of this machine with --host)"
        ) from None
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else e.strerror  # (create_server's strerror repeats the address)
        raise OSError(
            f"cannot serve on port {port} of {host}: {reason} (another server there? pick one with --port)"
        ) from None


def served_model_name(llm):
    # as vLLM: the model argument as given (clients such as `vllm bench serve --model X` send X back); the default
    # model by its name, not a path into site-packages
    return llm.config.model or "SmolLM2-135M-Instruct"


def warm_up(llm: LLM):
    """One short request before serving, as vLLM's start-up runs one: what a first step sets up (on a CPU the
    compiled loops, loaded from numba's cache or compiled, and oneDNN's kernels) is not the first clients' wait."""
    prompt_len = max(1, min(256, llm.max_model_len - 2))  # long enough for the prefill's parallel loops
    llm.generate([{"prompt_token_ids": [0] * prompt_len}], SamplingParams(max_tokens=2), use_tqdm=False)


def start_server(llm: LLM, host="127.0.0.1", port=0, **server_config):
    """Serve in a background thread (port 0: a free port). Returns (server, url);
    server.stop() ends it. For tests and notebooks."""
    server = Server(llm, ServerConfig(host, port, **server_config))
    server.thread = threading.Thread(
        target=server.uvicorn.run, kwargs={"sockets": [server.socket]}, name="nanobatch-http", daemon=True
    )
    server.thread.start()
    deadline = time.monotonic() + 30
    while not server.uvicorn.started and server.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, server.url


def serve(llm: LLM, config: ServerConfig | None = None):
    """Serve until Ctrl-C (the CLI's --serve), with uvicorn's log format and access log."""
    warm_up(llm)
    server = Server(llm, config or ServerConfig(), log_config=LOGGING_CONFIG, engine_here=True)
    print(
        f"nanobatch: serving {server.model_name} at {server.url} "
        "(POST /generate, /v1/completions, /v1/chat/completions, /tokenize, /detokenize; "
        "GET /v1/models, /health, /metrics, /version)",
        file=sys.stderr,
    )
    server.serve_forever()


if __name__ == "__main__":
    sys.modules.setdefault(
        "server", sys.modules[__name__]
    )  # nanobatch's --serve imports `server`: this module, not a second copy
    nanobatch.main(["--serve", *sys.argv[1:]])
