# The server section of nanobatch.py, kept in its own file until it is pasted in
# between the Engine and CLI sections, under a "# ---- Server ----" banner. When
# pasting: drop the `from nanobatch import ...` line and move the standard-library
# imports up to the module's import block (dataclass, json, os and sys are there already).

import http.server
import itertools
import json
import os
import queue
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from nanobatch import LLM, SamplingParams, default_model_path

# ---- Server ----
#
# An HTTP front end on the step loop, standard library only.
#
#     handler threads (one per connection)          engine thread (the only one that touches the LLM)
#     parse JSON, build SamplingParams  --inbox-->  drain inbox: add_request / abort_request
#     wait on the request's outbox      <-outbox--  llm.step() -> each RequestOutput to its request's outbox
#     write JSON, NDJSON or SSE
#
# Requests that arrive while others run join the running batch at the next step:
# the engine thread drains the inbox before every step, and sleeps on it when idle.
#
# Where validation happens: the handler thread checks the JSON and builds the
# SamplingParams (its __post_init__ validates the values and touches no engine
# state). Everything that needs the tokenizer (chat template, prompt length, empty
# prompt) runs in the engine thread inside add_request, whose ValueError goes back
# through the request's outbox and becomes a 400. HF fast tokenizers are not safe
# to share between threads, so handler threads never call them.
#
# Endpoints: POST /generate (vLLM's demo server), POST /v1/completions and
# POST /v1/chat/completions (OpenAI), GET /v1/models, GET /health.

MAX_BODY_BYTES = 1 << 20  # larger request bodies get a 400
MAX_DISCARD_BYTES = 64 << 20  # a larger body is not even read away: the connection closes after the 400
CLIENT_CHECK_SECONDS = 0.5  # while a request waits for tokens, how often its handler checks that the client is still there


class ServerError(Exception):
    """A request the server refuses or fails: sent as {"error": {"message", "type", "code"}} with this status."""

    def __init__(self, message, status=400, type="invalid_request_error"):
        super().__init__(message)
        self.status, self.type = status, type

    def body(self):
        return {"error": {"message": str(self), "type": self.type, "code": self.status}}


class ClientGone(Exception):
    """The client hung up; its request has been aborted."""


@dataclass
class Submission:
    request_id: str
    prompt: str | list[int] | None  # text or token ids; None for chat
    messages: list[dict] | None  # chat: turned into a prompt by the chat template, in the engine thread
    params: SamplingParams
    outbox: queue.Queue  # cumulative RequestOutputs until a finished one, or one ServerError


class EngineLoop:
    """The engine thread: the only thread that calls the LLM.

    Handler threads talk to it through one inbox of messages: ("add", Submission),
    ("abort", request_id, by_client), ("call", fn, reply) and ("stop",). Each running
    request has an outbox that receives its cumulative outputs, the last one finished.
    A RequestOutput is a snapshot (the engine builds new lists and strings each step),
    so handler threads may read it while the engine runs on."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.inbox = queue.Queue()
        self.outboxes = {}  # request id -> outbox of a running request (engine thread only)
        self.num_client_aborts = 0  # requests aborted because their client hung up
        self.thread = threading.Thread(target=self._run, name="nanobatch-engine", daemon=True)
        self.thread.start()

    # -- called from any thread --

    def submit(self, request_id, prompt, params, messages=None):
        """Queue a request for the next step. Returns its outbox."""
        if not self.thread.is_alive():
            raise ServerError("the engine is not running", 503, "service_unavailable")
        sub = Submission(request_id, prompt, messages, params, queue.Queue())
        self.inbox.put(("add", sub))
        return sub.outbox

    def abort(self, request_id, by_client=False):
        self.inbox.put(("abort", request_id, by_client))

    def call(self, fn):
        """Run fn(llm) in the engine thread between two steps and return its result
        (for tests and introspection: the LLM is never touched from another thread)."""
        if not self.thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        reply = queue.Queue(maxsize=1)
        self.inbox.put(("call", fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def stop(self, timeout=10):
        """Fail the requests still running (503), free their blocks, end the thread."""
        self.inbox.put(("stop",))
        self.thread.join(timeout)

    # -- the engine thread --

    def _run(self):
        need_step = False  # an aborted request's final output comes out of the next step, even with nothing else to run
        while True:
            idle = not (need_step or self.llm.has_unfinished_requests())
            for message in self._drain(block=idle):  # idle: sleep on the inbox, no busy loop
                if message[0] == "stop":
                    return self._close()
                need_step |= self._handle(message)
            if need_step or self.llm.has_unfinished_requests():
                need_step = False
                self._step()

    def _drain(self, block):
        messages = [self.inbox.get()] if block else []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, message):
        """Apply one inbox message; True if the engine must step to report an abort."""
        kind = message[0]
        if kind == "add":
            self._add(message[1])
        elif kind == "abort" and message[1] in self.outboxes:
            _, request_id, by_client = message
            del self.outboxes[request_id]  # nobody reads its final "abort" output
            self.llm.abort_request(request_id)
            self.num_client_aborts += by_client
            return True
        elif kind == "call":
            _, fn, reply = message
            try:
                reply.put((True, fn(self.llm)))
            except Exception as e:
                reply.put((False, e))
        return False

    def _add(self, sub: Submission):
        try:
            prompt = sub.prompt if sub.messages is None else self._chat_prompt(sub.messages)
            self.llm.add_request(prompt, sub.params, sub.request_id)
        except ValueError as e:  # prompt too long, empty, bad token ids, n > max_num_seqs, ...
            sub.outbox.put(ServerError(str(e)))
            return
        except Exception as e:  # a bug, not the client's fault: fail this request, keep serving
            sub.outbox.put(ServerError(f"could not add the request: {e!r}", 500, "internal_server_error"))
            return
        self.outboxes[sub.request_id] = sub.outbox

    def _chat_prompt(self, messages):
        try:
            return self.llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises on what the template forbids (e.g. roles that do not alternate)
            raise ValueError(f"the chat template rejected the messages: {e}") from None

    def _step(self):
        try:
            outputs = self.llm.step()
        except Exception as e:  # fail the running requests, not the server
            self._fail_all(ServerError(f"engine error: {e!r}", 500, "internal_server_error"))
            return
        for out in outputs:
            outbox = self.outboxes.get(out.request_id)
            if outbox is not None:
                outbox.put(out)
            if out.finished:
                self.outboxes.pop(out.request_id, None)

    def _fail_all(self, error):
        for request_id, outbox in self.outboxes.items():
            outbox.put(error)
            try:
                self.llm.abort_request(request_id)
            except Exception:
                pass
        self.outboxes.clear()
        try:
            self.llm.step()  # collects the aborts; their blocks are already free
        except Exception:
            pass

    def _close(self):
        closing = ServerError("the server is shutting down", 503, "service_unavailable")
        for message in self._drain(block=False):  # whatever came in after "stop"
            if message[0] == "add":
                message[1].outbox.put(closing)
            elif message[0] == "call":
                message[2].put((False, closing))
        self._fail_all(closing)


# -- request parsing (handler threads) --

JSON_KINDS = {  # JSON type checks, so that a wrong type is named before SamplingParams checks the value
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)), "a string or a list of strings"),
    "int_list": (lambda v: isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v), "a list of integers"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}
SAMPLING_FIELDS = {  # JSON field (same name in SamplingParams) -> kind
    "n": "int", "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number", "max_tokens": "int",
    "stop": "stop", "stop_token_ids": "int_list", "ignore_eos": "bool", "seed": "int",
}
OPENAI_UNSUPPORTED = {  # OpenAI fields nanobatch does not implement -> the values that mean "off"
    "echo": (False,), "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "tools": ([],), "functions": ([],),
}


def shown(value, limit=80):
    """A JSON value for an error message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_field(body, name, kind, default=None):
    """body[name] checked against a kind of JSON_KINDS; default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    check, description = JSON_KINDS[kind]
    if not check(value):
        raise ServerError(f"'{name}' must be {description}, got {shown(value)}")
    return value


def parse_sampling_params(body, defaults, **extra):
    """SamplingParams from the request's sampling fields over the endpoint's defaults.
    Its __post_init__ validates the values; its ValueError names the field."""
    kwargs = dict(defaults)
    for name, kind in SAMPLING_FIELDS.items():
        value = json_field(body, name, kind)
        if value is not None:
            kwargs[name] = value
    kwargs.update(extra)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise ServerError(str(e)) from None


def parse_generate(body):
    """vLLM's demo /generate: {"prompt", "stream", "use_beam_search", sampling fields..., "logprobs"}."""
    if body.get("use_beam_search"):
        raise ServerError("use_beam_search is not supported: nanobatch has no beam search (ask for n samples instead)")
    unknown = sorted(set(body) - {"prompt", "stream", "use_beam_search", "logprobs", *SAMPLING_FIELDS})
    if unknown:
        raise ServerError(f"unknown field(s) {unknown}; /generate takes prompt, stream, logprobs, use_beam_search and {', '.join(SAMPLING_FIELDS)}")
    if not isinstance(body.get("prompt"), str):
        raise ServerError(f"'prompt' is required and must be a string, got {shown(body.get('prompt'))}")
    stream = json_field(body, "stream", "bool", False)
    return body["prompt"], parse_sampling_params(body, {}, logprobs=json_field(body, "logprobs", "int")), stream


def parse_openai_common(body):
    """stream, stream_options.include_usage, and a 400 for features that are not there."""
    for name, off in OPENAI_UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in off:
            raise ServerError(f"'{name}' is not supported by nanobatch")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ServerError("'best_of' is not supported by nanobatch (it has no beam search); use n")
    stream = json_field(body, "stream", "bool", False)
    include_usage = json_field(json_field(body, "stream_options", "dict", {}), "include_usage", "bool", False)
    return stream, include_usage


def parse_completion(body):
    """OpenAI /v1/completions: one prompt (a string or token ids); max_tokens defaults to 16 as in vLLM."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ServerError("nanobatch takes one prompt per /v1/completions request; send several requests (they are batched together)")
    if not (isinstance(prompt, str) or JSON_KINDS["int_list"][0](prompt)):
        raise ServerError(f"'prompt' is required: a string or a list of token ids, got {shown(prompt)}")
    stream, include_usage = parse_openai_common(body)
    params = parse_sampling_params(body, {"max_tokens": 16}, logprobs=json_field(body, "logprobs", "int"))
    return prompt, params, stream, include_usage


def parse_chat(body):
    """OpenAI /v1/chat/completions; max_tokens (or max_completion_tokens) defaults to the room left in max_model_len."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ServerError(f"'messages' is required: a non-empty list of {{role, content}} objects, got {shown(messages)}")
    messages = [chat_message(m, i) for i, m in enumerate(messages)]
    stream, include_usage = parse_openai_common(body)
    logprobs = json_field(body, "logprobs", "bool", False)
    top_logprobs = json_field(body, "top_logprobs", "int")
    if top_logprobs is not None and not logprobs:
        raise ServerError("'top_logprobs' needs 'logprobs': true")
    defaults = {"max_tokens": json_field(body, "max_completion_tokens", "int")}
    params = parse_sampling_params(body, defaults, logprobs=(top_logprobs or 0) if logprobs else None)
    return messages, params, stream, include_usage


def chat_message(message, i):
    """One chat message as the chat template wants it: role and text content (text parts joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ServerError(f"messages[{i}] must be an object with a string 'role', got {shown(message)}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ServerError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise ServerError(f"messages[{i}].content must be a string or a list of text parts, got {shown(content)}")
    return {"role": message["role"], "content": content or ""}


# -- response formatting (handler threads) --


def visible_text(completion, params):
    """The text a stream may send: a running sample holds back what could be the start
    of a stop string (the engine cuts a stop string off the text once it is complete,
    and a stream cannot take back what it sent)."""
    hold = max(map(len, params.stop), default=1) - 1
    if completion.finish_reason is not None or hold == 0:
        return completion.text
    return completion.text[: max(0, len(completion.text) - hold)]


def usage_counts(out):
    num_prompt, num_output = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def sampled_logprob(entry):
    """(token id, Logprob) of the sampled token: the engine puts it first."""
    return next(iter(entry.items()))


def best_logprobs(entry, k):
    """The k most likely (token id, Logprob) of one position."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:k]


def generate_logprobs(entries, k):
    """/generate: per token {token_id, token, logprob, rank, top_logprobs: [the k best]}."""
    def item(token_id, lp):
        return {"token_id": token_id, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank}

    return [{**item(*sampled_logprob(e)), "top_logprobs": [item(*best) for best in best_logprobs(e, k)]} for e in entries]


def completion_logprobs(entries, offset):
    """OpenAI legacy completions logprobs; offset: where the first token starts in the text."""
    tokens = [sampled_logprob(e)[1].decoded_token for e in entries]
    offsets = list(itertools.accumulate(map(len, tokens), initial=offset))
    return {
        "tokens": tokens,
        "token_logprobs": [sampled_logprob(e)[1].logprob for e in entries],
        "top_logprobs": [{lp.decoded_token: lp.logprob for lp in e.values()} for e in entries],  # as vLLM: the k best and the sampled one
        "text_offset": offsets[:-1],
    }


def chat_logprobs(entries, k):
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [the k best]}]}."""
    def item(lp):
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode("utf-8"))}

    return {"content": [{**item(sampled_logprob(e)[1]), "top_logprobs": [item(lp) for _, lp in best_logprobs(e, k)]} for e in entries]}


class StreamDeltas:
    """What a stream has sent of each sample, so that each chunk carries only what is new."""

    def __init__(self, params):
        self.params = params
        self.num_chars, self.num_logprobs, self.done = {}, {}, set()

    def new(self, c):
        """(new text, new logprob entries, finish_reason if it just finished) of sample c, or None."""
        text, entries = visible_text(c, self.params), c.logprobs or []
        delta, new_entries = text[self.num_chars.get(c.index, 0) :], entries[self.num_logprobs.get(c.index, 0) :]
        finish_reason = c.finish_reason if c.finish_reason is not None and c.index not in self.done else None
        if not (delta or new_entries or finish_reason):
            return None
        self.num_chars[c.index], self.num_logprobs[c.index] = len(text), len(entries)
        if finish_reason:
            self.done.add(c.index)
        return delta, new_entries, finish_reason


class GenerateFormat:
    """vLLM's demo server: {"text": [prompt + completion, one per sample]}; streamed as
    newline-delimited JSON with the cumulative text, as the demo does."""

    content_type = "application/x-ndjson"

    def __init__(self, params):
        self.params = params

    def response(self, out):
        body = {"text": [(out.prompt or "") + visible_text(c, self.params) for c in out.outputs]}
        if self.params.logprobs is not None:
            body["logprobs"] = [generate_logprobs(c.logprobs or [], self.params.logprobs) for c in out.outputs]
        return body

    def chunks(self, out):
        return [json.dumps(self.response(out)).encode() + b"\n"]

    def tail(self):
        return []

    def error(self, e):
        return json.dumps(e.body()).encode() + b"\n"


class OpenAIFormat:
    """OpenAI completions (chat=False) or chat completions (chat=True), whole or as
    server-sent events ("data: {...}\\n\\n" ... "data: [DONE]\\n\\n").

    Usage in a stream: with stream_options.include_usage, a last chunk with no choices
    (as OpenAI); otherwise on the chunk that finishes the last sample."""

    content_type = "text/event-stream"

    def __init__(self, chat, request_id, model, params, include_usage):
        self.chat, self.request_id, self.model, self.params = chat, request_id, model, params
        self.include_usage = include_usage
        self.created = int(time.time())
        self.deltas = StreamDeltas(params)
        self.text_offsets = {}  # completions logprobs: sample index -> chars sent so far
        self.sent_roles = False

    def envelope(self, choices, chunk):
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def logprobs(self, entries, index):
        if self.params.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.params.logprobs)
        offset = self.text_offsets.get(index, 0)
        result = completion_logprobs(entries, offset)
        self.text_offsets[index] = offset + sum(len(t) for t in result["tokens"])
        return result

    def response(self, out):
        choices = []
        for c in out.outputs:
            content = {"message": {"role": "assistant", "content": c.text}} if self.chat else {"text": c.text}
            choices.append({"index": c.index, **content, "logprobs": self.logprobs(c.logprobs or [], c.index), "finish_reason": c.finish_reason})
        return {**self.envelope(choices, chunk=False), "usage": usage_counts(out)}

    def chunks(self, out):
        events = []
        if self.chat and not self.sent_roles:  # OpenAI opens each choice with its role
            self.sent_roles = True
            events += [self.envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], True) for i in range(self.params.n)]
        for c in out.outputs:
            new = self.deltas.new(c)
            if new is None:
                continue
            delta, entries, finish_reason = new
            content = {"delta": {"content": delta} if delta else {}} if self.chat else {"text": delta}
            events.append(self.envelope([{"index": c.index, **content, "logprobs": self.logprobs(entries, c.index), "finish_reason": finish_reason}], True))
        if out.finished and self.include_usage:
            events.append({**self.envelope([], True), "usage": usage_counts(out)})
        elif out.finished and events:
            events[-1]["usage"] = usage_counts(out)
        return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]

    def tail(self):
        return [b"data: [DONE]\n\n"]

    def error(self, e):
        return b"data: " + json.dumps(e.body()).encode() + b"\n\n"


# -- HTTP --

ROUTES = {  # path -> (method, handler method); not do_*: BaseHTTPRequestHandler maps any verb X to do_X
    "/generate": ("POST", "on_generate"),
    "/v1/completions": ("POST", "on_completions"),
    "/v1/chat/completions": ("POST", "on_chat"),
    "/v1/models": ("GET", "on_models"),
    "/health": ("GET", "on_health"),
}


class RequestHandler(http.server.BaseHTTPRequestHandler):
    """One connection (keep-alive): parses, submits to the engine thread, waits or streams."""

    protocol_version = "HTTP/1.1"  # keep-alive; streams go out in chunked transfer encoding
    server_version = "nanobatch"

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def dispatch(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        self.body, self.streaming = b"", False  # one handler serves each request of a keep-alive connection
        try:
            if method == "POST":
                self.body = self.read_body()  # first: whatever the answer, the connection stays in step
            if path not in ROUTES:
                raise ServerError(f"no such endpoint: {method} {path} (there are {', '.join(f'{m} {p}' for p, (m, _) in ROUTES.items())})", 404, "not_found_error")
            if ROUTES[path][0] != method:
                raise ServerError(f"{path} takes {ROUTES[path][0]}, not {method}", 405)
            getattr(self, ROUTES[path][1])()
        except ServerError as e:
            self.send_json(e.body(), e.status)
        except (ClientGone, ConnectionError):
            self.close_connection = True
        except Exception as e:  # a bug: answer 500 and keep serving
            self.log_error("error in %s %s: %r", method, path, e)
            self.close_connection = True
            if not self.streaming:
                self.send_json(ServerError(f"internal error: {e!r}", 500, "internal_server_error").body(), 500)

    def log_message(self, format, *args):  # the access log, with --serve only
        if self.server.verbose:
            super().log_message(format, *args)

    def log_error(self, format, *args):  # errors always
        super().log_message(format, *args)

    # -- endpoints --

    def on_generate(self):
        prompt, params, stream = parse_generate(self.read_json())
        self.run_request(f"gen-{uuid.uuid4().hex}", prompt, None, params, stream, GenerateFormat(params))

    def on_completions(self):
        prompt, params, stream, include_usage = parse_completion(self.read_json())
        self.run_openai(prompt, None, params, stream, include_usage, chat=False)

    def on_chat(self):
        messages, params, stream, include_usage = parse_chat(self.read_json())
        self.run_openai(None, messages, params, stream, include_usage, chat=True)

    def on_models(self):
        model = {"id": self.server.model_name, "object": "model", "created": self.server.created, "owned_by": "nanobatch", "max_model_len": self.server.max_model_len}
        self.send_json({"object": "list", "data": [model]})

    def on_health(self):
        alive = self.server.engine.thread.is_alive()
        self.send_json({"status": "ok" if alive else "engine stopped"}, 200 if alive else 503)

    # -- running a request --

    def run_openai(self, prompt, messages, params, stream, include_usage, chat):
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        fmt = OpenAIFormat(chat, request_id, self.server.model_name, params, include_usage)
        self.run_request(request_id, prompt, messages, params, stream, fmt)

    def run_request(self, request_id, prompt, messages, params, stream, fmt):
        outbox = self.server.engine.submit(request_id, prompt, params, messages)
        self.next_client_check = time.monotonic() + CLIENT_CHECK_SECONDS
        outputs = self.outputs(request_id, outbox)
        if not stream:
            *_, final = outputs
            return self.send_json(fmt.response(final))
        first = next(outputs)  # add_request's ValueError still becomes a 400 here, before the 200 goes out
        self.start_stream(fmt.content_type)
        try:
            for out in itertools.chain([first], outputs):
                for chunk in fmt.chunks(out):
                    self.write_chunk(chunk)
            for chunk in fmt.tail():
                self.write_chunk(chunk)
        except ServerError as e:  # the engine failed mid-stream: the status line is gone, report it in-band
            self.write_chunk(fmt.error(e))
        except ConnectionError:  # the client hung up mid-stream: free its blocks now
            self.server.engine.abort(request_id, by_client=True)
            raise
        self.end_stream()

    def outputs(self, request_id, outbox):
        """The request's cumulative outputs, up to the finished one."""
        while True:
            out = self.next_output(request_id, outbox)
            yield out
            if out.finished:
                return

    def next_output(self, request_id, outbox):
        while True:
            try:
                item = outbox.get(timeout=CLIENT_CHECK_SECONDS)
            except queue.Empty:
                item = None
            # a stream finds a lost client when a write fails; a request that is queued or not
            # streamed writes nothing until it ends, so look at the socket now and then
            if time.monotonic() >= self.next_client_check:
                self.next_client_check = time.monotonic() + CLIENT_CHECK_SECONDS
                if self.client_gone():
                    self.server.engine.abort(request_id, by_client=True)
                    raise ClientGone()
            if isinstance(item, ServerError):
                raise item
            if item is not None:
                return item
            if not self.server.engine.thread.is_alive():
                raise ServerError("the engine stopped", 503, "service_unavailable")

    def client_gone(self):
        """True if the peer closed the connection (readable, but nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- reading and writing --

    def read_body(self):
        """The raw request body. One that is not read in full closes the connection after the
        answer (its bytes would otherwise be taken for the next request)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise ServerError("chunked request bodies are not supported: send a Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)  # none: no body (HTTP/1.1)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise ServerError(f"bad Content-Length {self.headers.get('Content-Length')!r}") from None
        if length > MAX_BODY_BYTES:
            self.discard_body(length)
            raise ServerError(f"request body too large: {length} bytes, the limit is {MAX_BODY_BYTES}")
        return self.rfile.read(length)

    def discard_body(self, length):
        # closing a socket with unread data resets the connection, and the client may lose the 400
        # before it reads it: read the body away, unless it is too large even for that
        if length > MAX_DISCARD_BYTES:
            self.close_connection = True
            return
        while length > 0 and (chunk := self.rfile.read(min(length, 1 << 16))):
            length -= len(chunk)

    def read_json(self):
        if not self.body:
            raise ServerError("request body is empty: send a JSON object")
        try:
            body = json.loads(self.body)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ServerError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ServerError(f"request body must be a JSON object, got {type(body).__name__}")
        return body

    def send_json(self, obj, status=200):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self, content_type):
        self.streaming = True
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))  # wfile is unbuffered: each chunk leaves now

    def end_stream(self):
        self.wfile.write(b"0\r\n\r\n")


class Server(http.server.ThreadingHTTPServer):
    """A thread per connection, plus the engine thread behind them. stop() ends both."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: a burst of clients waits instead of being refused

    def __init__(self, llm: LLM, host="127.0.0.1", port=8000, model_name=None, verbose=False):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), RequestHandler)
        self.engine = EngineLoop(llm)
        self.model_name = model_name or served_model_name(llm)
        self.max_model_len, self.created, self.verbose = llm.max_model_len, int(time.time()), verbose
        self.serve_thread = None

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def stop(self):
        """Stop accepting requests, fail the ones still running (503), end the engine
        thread and close the socket. Call it from another thread than serve_forever's."""
        if self.serve_thread is not None:
            self.shutdown()  # waits for serve_forever to return
            self.serve_thread.join()
        self.engine.stop()
        self.server_close()


def served_model_name(llm):
    path = os.path.normpath(llm.config.model or default_model_path())
    return os.path.splitext(os.path.basename(path))[0] if path.endswith(".gguf") else os.path.basename(path)


def start_server(llm: LLM, host="127.0.0.1", port=0, **server_kwargs):
    """Serve in a background thread (port 0: a free port). Returns (server, url);
    server.stop() ends it. For tests and notebooks."""
    server = Server(llm, host, port, **server_kwargs)
    server.serve_thread = threading.Thread(target=server.serve_forever, name="nanobatch-http", daemon=True)
    server.serve_thread.start()
    return server, server.url


def serve(llm: LLM, host="127.0.0.1", port=8000):
    """Serve until Ctrl-C (the CLI's --serve)."""
    server = Server(llm, host, port, verbose=True)
    print(f"nanobatch: serving {server.model_name} at {server.url} (POST /generate, /v1/completions, /v1/chat/completions; GET /v1/models, /health)", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


README_SECTION = r'''
## Serving over HTTP

`--serve` starts an HTTP server (standard library only) in front of the engine:
one engine thread runs the step loop, and requests that arrive while others run
join the running batch at the next step.

```bash
python nanobatch.py --serve                      # default model, http://127.0.0.1:8000
python nanobatch.py --model path/to/model --serve --host 0.0.0.0 --port 8000
```

Endpoints: `POST /generate` (the JSON of vLLM's original demo server),
`POST /v1/completions` and `POST /v1/chat/completions` (OpenAI format, `stream: true`
for server-sent events), `GET /v1/models`, `GET /health`.

vLLM's demo requests work as they are (`use_beam_search: true` gets a 400: there is
no beam search here; ask for `n` samples, which share the prompt's KV blocks):

```bash
curl http://localhost:8000/generate -X POST -d '{
    "prompt": "The capital of France is",
    "n": 1,
    "use_beam_search": false,
    "temperature": 0.7,
    "max_tokens": 10
}' -H 'Content-Type: application/json'

curl http://localhost:8000/generate -X POST -d '{
    "prompt": "The largest planet in our solar system is",
    "n": 1,
    "use_beam_search": false,
    "temperature": 0.7,
    "max_tokens": 10
}' -H 'Content-Type: application/json'

curl http://localhost:8000/generate -X POST -d '{
    "prompt": "To be or not to be, that is",
    "n": 1,
    "use_beam_search": false,
    "temperature": 0.7,
    "max_tokens": 10
}' -H 'Content-Type: application/json'
```

Each answers `{"text": [prompt + completion, ...]}`, one entry per sample. `/generate`
also takes `top_p`, `top_k`, `min_p`, `stop`, `stop_token_ids`, `seed`, `ignore_eos`,
`logprobs` (k: adds a `logprobs` field) and `stream` (newline-delimited JSON with the
text so far, as tokens arrive).

With the `openai` package:

```python
from openai import OpenAI

client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")
model = client.models.list().data[0].id
print(client.completions.create(model=model, prompt="The capital of France is", max_tokens=10).choices[0].text)
chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a planet."}], max_tokens=20)
print(chat.choices[0].message.content)
for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to 5."}], max_tokens=20, stream=True):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
```

As in vLLM, `max_tokens` defaults to 16 for completions; for chat it defaults to the
room left in `max_model_len`. `temperature` defaults to 1.0. Extra fields `top_k`,
`min_p`, `ignore_eos` and `stop_token_ids` are accepted (`extra_body=` in the openai
client). Logprobs: `logprobs: k` for completions, `logprobs: true, top_logprobs: k`
for chat. Unsupported OpenAI features (`echo`, `suffix`, penalties, `logit_bias`,
tools) and bad input (malformed JSON, missing or wrongly typed fields, invalid
sampling values, a prompt longer than `max_model_len`, a body over 1 MiB) get a 400
with `{"error": {"message": ..., "type": "invalid_request_error"}}` naming the
problem; a client that disconnects mid-request has its request aborted and its KV
blocks freed.
'''
