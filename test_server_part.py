"""
Server tests: the HTTP front end (server_part.py) on a tiny random Llama, served on
a free loopback port. Requests go through http.client and the official openai
package; engine state is read only through server.engine.call (which runs in the
engine thread, the one thread allowed to touch the LLM).

    OMP_NUM_THREADS=1 python -m pytest -x -q test_server_part.py
"""

import http.client
import json
import os
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch

import server_part
from nanobatch import LLM, EngineStats, SamplingParams, default_model_path
from server_part import start_server

SEED_REQUESTS = [  # vLLM's /generate demo requests, as in the seeds
    {"prompt": "The capital of France is", "n": 1, "use_beam_search": False, "temperature": 0.7, "max_tokens": 10},
    {"prompt": "The largest planet in our solar system is", "n": 1, "use_beam_search": False, "temperature": 0.7, "max_tokens": 10},
    {"prompt": "To be or not to be, that is", "n": 1, "use_beam_search": False, "temperature": 0.7, "max_tokens": 10},
]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (vocab 49152)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama_server")
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(server_model_dir):
    llm = LLM(model=server_model_dir, num_kv_blocks=256, max_num_seqs=64, block_size=16)
    srv, url = start_server(llm, "127.0.0.1", 0)
    srv.test_url = url
    yield srv
    srv.stop()
    assert llm.allocator.num_free_blocks == llm.allocator.num_blocks  # stopped: the engine thread is gone, reading is safe


def engine_state(server):
    def read(llm):
        return {"free": llm.allocator.num_free_blocks, "total": llm.allocator.num_blocks, "busy": llm.has_unfinished_requests(),
                "output_tokens": llm.stats.num_output_tokens, "steps": llm.stats.num_steps, "peak": llm.stats.peak_blocks_in_use}
    return server.engine.call(read)


def wait_all_blocks_free(server, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = engine_state(server)
        if state["free"] == state["total"] and not state["busy"]:
            return state
        time.sleep(0.02)
    pytest.fail(f"blocks still in use after {timeout} s: {state}")


def connect(server, timeout=60):
    parts = urlsplit(server.test_url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def request(server, method, path, body=None, raw=None):
    """(status, parsed JSON body) of one request on a fresh connection."""
    conn = connect(server)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, json.loads(payload)


def post(server, path, body):
    return request(server, "POST", path, body)


def stream(server, path, body):
    """The lines of a streamed response (chunked transfer decoded by http.client), blank lines dropped."""
    conn = connect(server)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    lines = [line.decode().rstrip("\n") for line in resp]
    conn.close()
    return resp.getheader("Content-Type"), [line for line in lines if line]


def sse_events(lines):
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


# ---- /generate (vLLM's demo server) ----


def test_health_and_models(server):
    assert request(server, "GET", "/health") == (200, {"status": "ok"})
    status, body = request(server, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == os.path.basename(server.engine.llm.config.model) and body["data"][0]["max_model_len"] == 512


@pytest.mark.parametrize("seed_request", SEED_REQUESTS, ids=["france", "planet", "hamlet"])
def test_seed_requests(server, seed_request):
    status, body = post(server, "/generate", seed_request)
    assert status == 200 and set(body) == {"text"}
    [text] = body["text"]
    assert text.startswith(seed_request["prompt"]) and len(text) > len(seed_request["prompt"])


def test_generate_n_samples_and_logprobs(server):
    status, body = post(server, "/generate", {"prompt": "Hello, my name is", "n": 3, "temperature": 1.0, "seed": 1,
                                               "max_tokens": 5, "ignore_eos": True, "logprobs": 2})
    assert status == 200 and len(body["text"]) == 3 and len(body["logprobs"]) == 3
    for tokens in body["logprobs"]:
        assert len(tokens) == 5
        for t in tokens:
            assert t["logprob"] <= 0 and t["rank"] >= 1 and len(t["top_logprobs"]) == 2
            assert [x["rank"] for x in t["top_logprobs"]] == [1, 2] and t["top_logprobs"][0]["logprob"] >= t["logprob"]


def test_generate_stream_is_cumulative_ndjson(server):
    body = {"prompt": "The future of AI is", "max_tokens": 8, **GREEDY}
    content_type, lines = stream(server, "/generate", body)
    assert content_type == "application/x-ndjson"
    texts = [json.loads(line)["text"][0] for line in lines]
    assert len(texts) == 8  # one line per token (each token here decodes to whole characters)
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:]))  # each line extends the last
    assert texts[-1] == post(server, "/generate", body)[1]["text"][0]


# ---- OpenAI endpoints ----


def test_completions_stream_sse(server):
    body = {"model": "x", "prompt": "The president of the United States is", "max_tokens": 8, "logprobs": 1, **GREEDY}
    status, whole = post(server, "/v1/completions", body)
    assert status == 200 and whole["object"] == "text_completion"
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == 8
    assert choice["logprobs"]["text_offset"][0] == 0 and "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert whole["usage"]["completion_tokens"] == 8
    assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + 8

    content_type, lines = stream(server, "/v1/completions", body)
    events = sse_events(lines)
    assert content_type == "text/event-stream"
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
    assert [t for e in events for t in e["choices"][0]["logprobs"]["text_offset"]] == choice["logprobs"]["text_offset"]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"] == whole["usage"]


def test_stream_holds_back_a_partial_stop_string(server):
    body = {"prompt": "Once upon a time", "max_tokens": 24, **GREEDY}
    text = post(server, "/v1/completions", body)[1]["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string that the greedy output will meet
    whole = post(server, "/v1/completions", {**body, "stop": stop})[1]["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["text"] == text[: text.index(stop)]
    events = sse_events(stream(server, "/v1/completions", {**body, "stop": stop})[1])
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]


def test_chat_stream_sse(server):
    body = {"model": "x", "messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 2, **GREEDY}
    status, whole = post(server, "/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion"
    [choice] = whole["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and all(len(t["top_logprobs"]) == 2 and t["bytes"] == list(t["token"].encode()) for t in content)
    assert whole["usage"]["completion_tokens"] == 6

    events = sse_events(stream(server, "/v1/chat/completions", body)[1])
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == choice["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"] == whole["usage"]


def test_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.test_url + "/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    extra = {"extra_body": {"ignore_eos": True}}

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2, **extra)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 6
    assert len(completion.choices[0].logprobs.tokens) == 6
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True, **extra))
    assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1, **extra)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    assert len(chat.choices[0].logprobs.content) == 6
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, **extra))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6  # include_usage: a last chunk with no choices


# ---- batching, sharing, aborts ----


def test_32_concurrent_clients_match_offline_generate(server):
    prompts = [f"Request {i}: the most interesting fact about the number {i * 7} is" for i in range(32)]
    offline = server.engine.call(lambda llm: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False))
    before = engine_state(server)
    answers = [None] * len(prompts)

    def client(i):  # half on /generate, half on /v1/completions
        if i % 2:
            answers[i] = post(server, "/generate", {"prompt": prompts[i], "max_tokens": 8, **GREEDY})[1]["text"][0][len(prompts[i]):]
        else:
            answers[i] = post(server, "/v1/completions", {"prompt": prompts[i], "max_tokens": 8, **GREEDY})[1]["choices"][0]["text"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == [out.outputs[0].text for out in offline]
    steps = engine_state(server)["steps"] - before["steps"]
    assert steps < 32 * 8  # batched: fewer steps than running the 32 requests one after another


def test_n4_shares_the_prompt_blocks(server):
    prompt = "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms"
    body = {"max_tokens": 4, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    server.engine.call(lambda llm: setattr(llm, "stats", EngineStats()))
    status, shared = post(server, "/v1/completions", {"prompt": prompt, "n": 4, **body})
    assert status == 200 and sorted(c["index"] for c in shared["choices"]) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in shared["choices"])
    peak_shared = engine_state(server)["peak"]
    num_prompt = shared["usage"]["prompt_tokens"]
    full, partial = divmod(num_prompt, 16)
    assert full >= 1 and 0 < partial <= 12  # the 4 output tokens stay in the prompt's last block
    assert peak_shared == full + 4  # full prompt blocks shared; each sample copies the partial block on write

    # the same work as four separate requests (different prompts, so no prefix-cache hits), admitted in one step:
    # the engine thread is held in a call until all four are in its inbox
    server.engine.call(lambda llm: setattr(llm, "stats", EngineStats()))
    entered, release = threading.Event(), threading.Event()
    hold = threading.Thread(target=server.engine.call, args=(lambda llm: (entered.set(), release.wait(10)),))
    hold.start()
    assert entered.wait(10)
    separate = [None] * 4

    def client(i):
        separate[i] = post(server, "/v1/completions", {"prompt": f"{i}{i} " + prompt, **body})[1]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while server.engine.inbox.qsize() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in threads + [hold]:
        t.join(30)
    assert all(-(-s["usage"]["prompt_tokens"] // 16) == full + 1 for s in separate)
    assert engine_state(server)["peak"] == 4 * (full + 1) > peak_shared
    wait_all_blocks_free(server)


@pytest.mark.parametrize("path,streamed", [("/generate", True), ("/v1/chat/completions", True), ("/v1/completions", False)])
def test_client_disconnect_aborts_and_frees_blocks(server, monkeypatch, path, streamed):
    monkeypatch.setattr(server_part, "CLIENT_CHECK_SECONDS", 0.05)  # a waiting (non-streamed) request looks at its client this often
    before = engine_state(server)
    num_aborts = server.engine.num_client_aborts
    body = {"max_tokens": 480, "stream": streamed, **GREEDY}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "Tell me a long story."})
    conn = connect(server)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    if streamed:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline()  # the first tokens arrived
    else:
        deadline = time.monotonic() + 10
        while engine_state(server)["output_tokens"] == before["output_tokens"] and time.monotonic() < deadline:
            time.sleep(0.01)  # until it runs
    conn.sock.close()  # hang up mid-request
    conn.close()
    after = wait_all_blocks_free(server)
    assert server.engine.num_client_aborts == num_aborts + 1
    assert after["output_tokens"] - before["output_tokens"] < 480  # it stopped early
    assert post(server, "/generate", {"prompt": "still there?", "max_tokens": 2})[0] == 200


# ---- bad requests ----

TOO_LONG = "word " * 600  # over max_model_len 512
CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [  # (path, body or raw bytes, words the error message must contain)
    ("/generate", b"{not json", "not valid JSON"),
    ("/generate", b"[1, 2]", "JSON object"),
    ("/generate", b"\xff\xfe", "not valid JSON"),
    ("/generate", {"max_tokens": 4}, "'prompt' is required"),
    ("/generate", {"prompt": 5}, "'prompt' is required and must be a string"),
    ("/generate", {"prompt": ""}, "prompt is empty"),
    ("/generate", {"prompt": TOO_LONG}, "max_model_len"),
    ("/generate", {"prompt": "hi", "max_tokens": "10"}, "'max_tokens' must be an integer"),
    ("/generate", {"prompt": "hi", "stream": "yes"}, "'stream' must be true or false"),
    ("/generate", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/generate", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/generate", {"prompt": "hi", "n": 0}, "SamplingParams.n"),
    ("/generate", {"prompt": "hi", "n": 1000}, "max_num_seqs"),
    ("/generate", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/generate", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/generate", {"prompt": "hi", "use_beam_search": True}, "no beam search"),
    ("/generate", {"prompt": "hi", "best_of": 2}, "unknown field(s) ['best_of']"),
    ("/v1/completions", {"model": "x"}, "'prompt' is required"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per"),
    ("/v1/completions", {"prompt": TOO_LONG, "stream": True}, "max_model_len"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "'presence_penalty' is not supported"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "'echo' is not supported"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/chat/completions", {"messages": "hi"}, "'messages' is required"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0] must be an object with a string 'role'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs'"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": 1}}, "'include_usage'"),
    ("/generate", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', "too large"),
]


@pytest.mark.parametrize("path,body,words", BAD_REQUESTS, ids=[f"{i}-{p}" for i, (p, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_400_and_server_keeps_serving(server, path, body, words):
    status, answer = request(server, "POST", path, raw=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert words in answer["error"]["message"], answer
    assert post(server, "/generate", {"prompt": "ok?", "max_tokens": 2})[0] == 200


def test_unknown_path_and_wrong_method(server):
    status, answer = request(server, "POST", "/v2/nothing", {"prompt": "hi"})
    assert status == 404 and "no such endpoint" in answer["error"]["message"]
    status, answer = request(server, "GET", "/generate")
    assert status == 405 and "takes POST" in answer["error"]["message"]
    conn = connect(server)
    conn.request("GENERATE", "/generate", body=b"{}")  # an odd verb reaches no endpoint method
    assert conn.getresponse().status == 501
    conn.close()
    assert wait_all_blocks_free(server)["busy"] is False


def test_keep_alive_connection_survives_errors(server):
    conn = connect(server)
    for raw, status in [(b"{bad", 400), (b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 400), (json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), 200)]:
        conn.request("POST", "/generate", body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == status and json.loads(resp.read())
    conn.request("POST", "/generate", body=b"")
    resp = conn.getresponse()
    assert resp.status == 400 and "empty" in json.loads(resp.read())["error"]["message"]
    conn.close()


def test_engine_error_fails_the_running_requests_and_keeps_serving(server):
    def break_next_step(llm):
        real_step = llm.step

        def broken():
            del llm.step  # back to the real method
            real_step()  # schedules and allocates, as a real failure mid-step would have
            raise RuntimeError("simulated failure")
        llm.step = broken

    server.engine.call(break_next_step)
    status, answer = post(server, "/generate", {"prompt": "boom", "max_tokens": 4})
    assert status == 500 and "simulated failure" in answer["error"]["message"]
    wait_all_blocks_free(server)
    assert post(server, "/generate", {"prompt": "fine", "max_tokens": 2})[0] == 200
