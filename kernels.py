"""
kernels.py: the two kernels a paged-KV-cache engine needs, and the three that fuse a decoder
layer's small ops, each as a Triton kernel and a plain-torch reference with the same signature,
plus the dispatcher nanobatch.py calls.

    store_kv(k, v, k_cache, v_cache, slot_mapping)
        write the K/V rows of this step's new tokens into the paged cache
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, plan=None)
        causal attention of the new tokens over everything cached for their sequence
        (prefill, prefill over a cached prefix and decode, mixed freely in one batch)
    rms_norm(x, weight, eps, residual=None)      RMSNorm, with the residual stream's add fused in
    silu_and_mul(gate_up)                        SwiGLU's silu(gate) * up over the merged projection
    rotary(q, k, rope, q_norm, k_norm, eps)      Qwen3's q/k RMSNorm and the rotary embedding of q and k
    rotary_and_store(q, k, v, rope, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps)
        rotary, then store_kv of the rotated k and v (the model's call; one loop on a CPU)
    (on a GPU each is one launch: a decoder layer is ten, with its four matmuls; `bench.py --launches`)

    store_kv_triton / paged_attention_triton   Triton kernels (GPU, or CPU under TRITON_INTERPRET=1); decode
                                               batches too small for the GPU split their keys (split-KV)
    rms_norm_triton / silu_and_mul_triton /    the small ops' Triton kernels, one program per row (or per
    rotary_triton                              token and head): fp32 math, rounded where HF's torch ops round
    tile_config / num_segments                 the kernel's tiles per (arch, dtype, head_dim, phase) and its
                                               split-KV segments, from shapes alone
    compile_static / compile_static_small_ops  the kernels compiled for any NVIDIA arch on a CPU: registers,
                                               spill bytes, shared memory (bench.py --kernels --static)
    store_kv_ref / paged_attention_ref         plain torch, any device: the rule itself, one sequence at a time
    rms_norm_ref / silu_and_mul_ref /          plain torch: HF's ops, rounded where HF rounds
    rotary_ref
    paged_attention_cpu                        the engine's CPU path, planned once per step (plan_paged_attention):
                                               decode rows as compiled loops (numba) or batched torch ops
    store_kv / paged_attention / rms_norm /    dispatch: Triton for CUDA tensors; on a CPU the references, the
    silu_and_mul / rotary / rotary_and_store   CPU attention path and the CPU loops; on a GPU without triton,
                                               the references
    rms_norm_cpu / rotary_cpu /                the model's add + RMSNorm, rotary embedding (+ K/V store) and
    silu_and_mul_cpu / argmax_rows             SiLU * up (bf16 or fp32), the sampler's greedy argmax (bf16), as
                                               compiled loops (or None: the caller uses torch ops)
    pack_linears_cpu / greedy_tokens /         the engine's other CPU speed hooks: bf16 weights packed once
    sample_nucleus / cpu_prefers_bf16 /        for oneDNN, the sampler's argmax and its top-p without a sort,
    kv_pool / release_openmp_workers           whether "auto" picks bf16 on this CPU, the KV pool in huge pages,
                                               the loading thread's idle OpenMP workers ended (any thread steps)

Cache layout (one per layer, for K and for V):
    (num_blocks, block_size, num_kv_heads, head_dim)
    token at position p of a sequence lives at
    block_tables[seq, p // block_size], row p % block_size
    and its flat "slot" is block_id * block_size + p % block_size.

Batch metadata (all tokens of a step are packed into one flat batch, no padding):
    query_start_loc (num_seqs + 1,) int32   sequence i owns q rows query_start_loc[i] : query_start_loc[i+1]
    seq_lens        (num_seqs,) int32       cached + new tokens of each sequence
    block_tables    (num_seqs, max_blocks)  int32, padded; entries past a sequence's last block are never read
    causal rule: query t of a sequence with Q new tokens and seq_len L sits at
    position L - Q + t and sees the keys at positions <= L - Q + t.

Supported by the Triton kernels (anything else raises a ValueError that names it):
any GQA ratio (num_heads % num_kv_heads == 0), head_dim up to 256 (powers of two
are the fast case; others are padded and masked), any cache block size (it is
independent of the key tile), q and caches in float32, float16 or bfloat16 with
an fp32 online softmax, int64 cache offsets. All three attention implementations take
an optional out= to write into (the tests pass one poisoned with NaN); paged_attention and
paged_attention_cpu also take plan=, the CPU path's per-step plan.

Running the Triton kernels without a GPU: set TRITON_INTERPRET=1 in the
environment *before this module is imported* (triton.jit picks compiled or
interpreted at decoration time), then either call the *_triton functions
directly or set `kernels.USE_TRITON_ON_CPU = True` (or NANOBATCH_TRITON_ON_CPU=1)
so that the dispatchers send CPU tensors to Triton as well (how the engine is
tested end to end on Triton):
    TRITON_INTERPRET=1 NANOBATCH_TRITON_ON_CPU=1 python nanobatch.py ...
Without triton installed this module still imports; the engine runs on the CPU
path (on a CPU) or the references (on a GPU), and the *_triton functions raise a
RuntimeError that says so.

Sections, in reading order: imports and switches / shape checks / plain-torch references (the
rule itself; then the layer's small ops) / Triton store_kv / Triton small ops / Triton paged_attention (and
the split-KV merge) / tiles per GPU and when to split, with the wrapper / compiled for any GPU on a CPU /
dispatch (what nanobatch.py calls, plan_paged_attention included). Then, under a banner, the CPU fast paths,
which a learner may skip: the CPU attention (a plan per step; decode rows by compiled loops or batched
torch ops), the greedy argmax, the bf16 RMSNorm and rotary loops, and the engine's other CPU hooks (dtype,
weight packing, greedy tokens, top-p by rejection).
The interpreter rounds fp32 -> bf16 toward zero where a GPU rounds to nearest even: under it, bf16 results
of the small ops are a rounding step from the references' (the tests allow exactly that).
Tests: python -m pytest -q test_nanobatch.py -k "attention or store_kv or kernels or triton"
(it sets TRITON_INTERPRET=1 without a GPU)
"""

import contextlib
import ctypes
import functools
import glob
import math
import os
import re
import subprocess
import tempfile
import threading
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR = None
except ImportError as e:  # CPU-only installs: the references still work

    class _NoTriton:  # just enough for the @triton.jit definitions below to parse
        constexpr = None

        @staticmethod
        def jit(fn=None, **options):  # @triton.jit and @triton.jit(...)
            return fn if fn is not None else (lambda f: f)

    triton = tl = _NoTriton()
    _TRITON_IMPORT_ERROR = e

# ---- Switches ----

# Send CPU tensors to the Triton kernels in the dispatchers too (they need
# TRITON_INTERPRET=1 set before import). CUDA tensors always go to Triton.
# Set it here, or start with NANOBATCH_TRITON_ON_CPU=1 in the environment.
USE_TRITON_ON_CPU = os.environ.get("NANOBATCH_TRITON_ON_CPU", "0") == "1"
# The CPU path's decode attention, greedy argmax, RMSNorm and rotary embedding as compiled loops (numba,
# when installed) rather than torch ops. Set it here, or start with NANOBATCH_CPU_LOOPS=0 to use the torch ops.
USE_CPU_LOOPS = os.environ.get("NANOBATCH_CPU_LOOPS", "1") == "1"
# A bf16 model loaded on a CPU from a GGUF file keeps its Q4_1 weights in 4 bits too, for steps of a few rows
# (attach_int4). Set it here before loading, or start with NANOBATCH_CPU_INT4=0, for the bf16 weights alone.
USE_CPU_INT4 = os.environ.get("NANOBATCH_CPU_INT4", "1") == "1"
# Whether the kernels below were decorated as interpreted (CPU) functions.
TRITON_INTERPRET = _TRITON_IMPORT_ERROR is None and os.environ.get("TRITON_INTERPRET", "0").lower() in (
    "1",
    "true",
    "on",
    "yes",
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # the fp32 accumulator (BLOCK_M, head_dim) must fit in registers


# ---- Shape checks shared by every implementation ----


def _check_store_kv(k, v, k_cache, v_cache, slot_mapping):
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            "store_kv: k and v must both be (num_tokens, num_kv_heads, head_dim), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"store_kv: caches must be (num_blocks, block_size, {k.shape[1]}, {k.shape[2]}), "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"store_kv: slot_mapping must be int64 of shape ({k.shape[0]},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if (
        k_cache.dtype != v_cache.dtype
        or k_cache.dtype not in _FLOAT_DTYPES
        or k.dtype not in _FLOAT_DTYPES
        or v.dtype not in _FLOAT_DTYPES
    ):
        raise ValueError(
            "store_kv: k, v and the caches must be float32, float16 or bfloat16 (both caches alike), "
            f"got {k.dtype}, {v.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    _check_same_device("store_kv", k, v, k_cache, v_cache, slot_mapping)


def _check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "paged_attention: q must be (num_tokens, num_heads, head_dim) and both caches "
            "(num_blocks, block_size, num_kv_heads, head_dim), "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"paged_attention: {num_heads} query heads of dim {head_dim} "
            f"do not fit {num_kv_heads} kv heads of dim {k_cache.shape[3]}"
        )
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            "paged_attention: q and both caches must share one dtype out of float32, float16, bfloat16, "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    num_seqs = seq_lens.shape[0]
    if (
        seq_lens.dim() != 1
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or query_start_loc.shape != (num_seqs + 1,)
    ):
        raise ValueError(
            f"paged_attention: block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} "
            f"and query_start_loc {tuple(query_start_loc.shape)} disagree on num_seqs"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"paged_attention: {name} must be int32, got {t.dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(
            f"paged_attention: out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    _check_same_device("paged_attention", q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)


def _check_rows(name, x, weight=None, residual=None):
    if x.dtype not in _FLOAT_DTYPES or x.dim() < 2:
        raise ValueError(
            f"{name}: x must be float32, float16 or bfloat16 rows (..., dim), got {x.dtype} {tuple(x.shape)}"
        )
    if weight is not None and (weight.shape != x.shape[-1:] or weight.device != x.device):
        raise ValueError(
            f"{name}: weight must be ({x.shape[-1]},) on {x.device}, got {tuple(weight.shape)} on {weight.device}"
        )
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
    ):
        raise ValueError(
            f"{name}: residual must be a contiguous {x.dtype} tensor of x's shape {tuple(x.shape)}, "
            f"got {residual.dtype} {tuple(residual.shape)}"
        )


def _check_rotary(q, k, rope, q_norm, k_norm):
    if (
        q.dim() != 3
        or k.dim() != 3
        or q.shape[0] != k.shape[0]
        or q.shape[2] != k.shape[2]
        or q.shape[2] % 2
        or q.dtype != k.dtype
    ):
        raise ValueError(
            "rotary: q and k must be (num_tokens, heads, head_dim) of one dtype with an even head_dim, "
            f"got {tuple(q.shape)} {q.dtype} and {tuple(k.shape)} {k.dtype}"
        )
    if rope.shape != (q.shape[0], q.shape[2]) or rope.dtype != torch.float32:
        raise ValueError(
            f"rotary: rope must be float32 ({q.shape[0]}, {q.shape[2]}) (cos | sin per token), "
            f"got {rope.dtype} {tuple(rope.shape)}"
        )
    if (q_norm is None) != (k_norm is None) or (
        q_norm is not None and not q_norm.shape == k_norm.shape == (q.shape[2],)
    ):
        raise ValueError("rotary: q_norm and k_norm come together, each (head_dim,)")
    _check_same_device("rotary", q, k, rope)


def _check_same_device(name, *tensors):
    if len({t.get_device() for t in tensors}) > 1:  # (-1 for the CPU; ints are cheaper than torch.device objects)
        devices = {t.device for t in tensors}
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _on_device(t):
    """Triton launches on the current CUDA device: make it the tensors' one (cuda:1, or another thread)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_triton(name, *tensors):
    """What the Triton kernels need beyond the shared checks."""
    if _TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(
            f"{name}: triton is not installed ({_TRITON_IMPORT_ERROR}); use the *_ref functions or install triton"
        )
    for t in tensors:
        if t.is_cuda:
            continue
        if not TRITON_INTERPRET:
            raise RuntimeError(
                f"{name}: CPU tensors need TRITON_INTERPRET=1 in the environment before kernels.py is imported"
            )
    for t in tensors:
        if t.dim() == 4 and t.stride(-1) != 1:  # caches are never copied: they are written in place
            raise ValueError(f"{name}: cache last dim (head_dim) must be contiguous, got strides {t.stride()}")


# ---- Plain-torch references ----


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    _check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0  # -1 marks a token whose K/V must not be written
    if not keep.all():  # (a decode step has none: indexing with the mask would cost more than the copy)
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    # a flat view: slot s is row s of (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _sequence_kv(cache, block_ids, seq_len):
    """One sequence's first seq_len cache rows, (seq_len, kv_heads, head_dim): a view of the cache when its
    blocks are one contiguous run (the usual case for a prompt's blocks: no copy), else a gathered copy."""
    first, num_blocks = block_ids[0], len(block_ids)
    if block_ids == list(range(first, first + num_blocks)):
        return cache[first : first + num_blocks].flatten(0, 1)[:seq_len]
    ids = torch.tensor(block_ids, device=cache.device)
    return cache.index_select(0, ids).flatten(0, 1)[:seq_len]  # index_select copies whole blocks: fast on CPU


def _attend_sequence(q, k_cache, v_cache, block_table, seq_len, start, q_len, scale, out):
    """Causal attention of one sequence's q_len new tokens (q rows start : start + q_len) over its
    seq_len cached keys, written to the same rows of out."""
    block_ids = block_table[: -(-seq_len // k_cache.shape[1])].tolist()
    k, v = (_sequence_kv(cache, block_ids, seq_len) for cache in (k_cache, v_cache))  # exactly the sequence's keys
    _attend(q[start : start + q_len], k, v, scale, out[start : start + q_len])


def _attend(q, k, v, scale, out, first=None):
    """q (Q, H, D): a sequence's Q positions from `first` on (default: the last Q of its keys); k, v (L, Hkv, D):
    its keys and values from position 0 (rows past first + Q - 1 may follow: no query sees them); out (Q, H, D)
    is written. SDPA runs in the cache's dtype and accumulates in fp32 (no upcasting copies); enable_gqa lets
    each kv head serve its group of query heads without a copy of K and V per query head."""
    q_len, seq_len = q.shape[0], k.shape[0]
    first = seq_len - q_len if first is None else first
    qs, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, Q, D), (1, Hkv, L, D)
    if first == 0:  # a whole prompt: SDPA's own causal rule, query t sees keys 0 .. t (no mask to build or read)
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # after a cached prefix: query token t sits at position first + t and sees keys at positions <= that
        visible = (
            torch.arange(seq_len, device=q.device)[None, :]
            <= torch.arange(first, first + q_len, device=q.device)[:, None]
        )
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale, enable_gqa=True)  # (1, H, Q, D)
    out.copy_(o[0].transpose(0, 1))


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None):
    """The rule itself, one sequence at a time: the exact reference the other paths are tested against.
    Writes `out` if given."""
    _check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    out = torch.empty_like(q) if out is None else out  # (num_tokens, num_heads, head_dim)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    for i, (seq_len, start) in enumerate(zip(seq_lens.tolist(), query_start_loc.tolist())):
        if q_lens[i] > 0:
            _attend_sequence(q, k_cache, v_cache, block_tables[i], seq_len, start, q_lens[i], scale, out)
    return out


# ---- Plain-torch references: a decoder layer's small ops ----
# Each op rounds where HF's model code rounds (to the model's dtype after every torch op on it), so that
# the Triton kernels below, which do the same sums in fp32 registers, can be held to them.


def rms_norm_ref(x, weight, eps, residual=None):
    """HF's RMSNorm of x's rows: weight * (x * rsqrt(mean(x ** 2) + eps)), in fp32, rounded to x's dtype before
    the weight. With residual: the residual stream's add first, x + residual (in x's dtype, as HF adds), and
    (normed rows, x + residual) back. x, residual (..., dim); weight (dim,)."""
    if residual is not None:
        x = residual = x + residual
    x32 = x.float()
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul_ref(gate_up):
    """SwiGLU's activation over the merged gate_up projection: silu(gate) * up. (T, 2 * I) -> (T, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_ref(q, k, rope, q_norm=None, k_norm=None, eps=0.0):
    """Qwen3's per-head RMSNorm of q and k (where q_norm and k_norm weights are given), then the rotary embedding
    of every head, HF's "rotate half" form: x * cos + cat(-x2, x1) * sin. q (T, H, D), k (T, Hkv, D);
    rope (T, D) fp32, each token's cos | sin of its D / 2 rotation angles (Rotary's table). -> new (q, k)."""
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    cos, sin = _cos_sin(rope, q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _cos_sin(rope, dtype):
    """(T, D) rows of cos | sin -> cos and sin, (T, 1, D) each in dtype, each angle twice (HF's cat(freqs, freqs))."""
    cos, sin = rope.chunk(2, dim=-1)
    return torch.cat([cos, cos], dim=-1)[:, None].to(dtype), torch.cat([sin, sin], dim=-1)[:, None].to(dtype)


def _step_cos_sin(rope, dtype):
    """_cos_sin, made once a step on the CPU path: every layer of a step rotates by the same rope rows (the one
    tensor Model.forward gathered), and 4 small ops a layer would cost a CPU decode step ~4%."""
    if _STEP_COS_SIN[0] is not rope or _STEP_COS_SIN[1] != dtype:  # (held, so a new step's rows are another tensor)
        _STEP_COS_SIN[:] = rope, dtype, _cos_sin(rope, dtype)
    return _STEP_COS_SIN[2]


_STEP_COS_SIN = [None, None, None]  # the last step's (rope rows, dtype, (cos, sin))


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---- Triton: store_kv ----
# Grid (num_tokens, num_kv_heads): one program copies one head_dim row of K and
# one of V into the slot its token was given. Nothing to tile, so no tuning.


@triton.jit
def _store_kv_kernel(
    k_ptr,  # (num_tokens, num_kv_heads, head_dim) K rows of this step's new tokens
    v_ptr,  # (num_tokens, num_kv_heads, head_dim) V rows, same shape (strides may differ)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim) written in place
    v_cache_ptr,  # same shape and strides as k_cache
    slot_mapping_ptr,  # (num_tokens,) int64: slot = block_id * block_size + offset, -1 = skip
    stride_k_tok,
    stride_k_head,  # k strides (head_dim is contiguous)
    stride_v_tok,
    stride_v_head,  # v strides
    stride_c_block,
    stride_c_row,
    stride_c_head,  # cache strides, shared by k_cache and v_cache
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (constexpr: a power of two becomes a shift)
    HEAD_DIM: tl.constexpr,  # true head_dim
    HEAD_DIM_PADDED: tl.constexpr,  # next power of two (tl.arange needs one); extra lanes masked
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)  # int64 scalar, so every cache offset below is int64
    if slot < 0:
        return  # a padding token: nothing to write
    dims = tl.arange(0, HEAD_DIM_PADDED)  # (HEAD_DIM_PADDED,)
    mask = dims < HEAD_DIM  # (HEAD_DIM_PADDED,) lanes past head_dim are padding
    dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_row + head * stride_c_head + dims
    token = token.to(tl.int64)
    k = tl.load(k_ptr + token * stride_k_tok + head * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + head * stride_v_head + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping):
    """Slots must be < num_blocks * block_size (not checked: that would sync the GPU)."""
    _check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    _check_triton("store_kv_triton", k, k_cache, v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"store_kv_triton: k_cache and v_cache must share strides, got {k_cache.stride()} and {v_cache.stride()}"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = slot_mapping.contiguous()  # read with unit stride
    with _on_device(k_cache):
        _store_kv_kernel[(num_tokens, num_kv_heads)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
            num_warps=1,  # one row of at most 256 elements: a single warp covers it
        )


# ---- Triton: a decoder layer's small ops, one launch each ----
# On a GPU every torch op is a kernel launch (~3 us), and a small model's decode step is set by their count,
# not by their bytes: HF's RMSNorm is 8 ops, the rotary embedding 5 a tensor, SiLU-times-up 2, each residual
# add 1. Each kernel below does one of these in one launch, reading its rows once and writing them once,
# with fp32 math inside, rounded to the model's dtype wherever the reference (HF) rounds: by an explicit
# round-to-nearest-even (_rounded; a plain cast there and back may be folded away by the compiler), and launched
# with enable_fp_fusion=False (a fused multiply-add would round a product and a sum once).
# One program per row (RMSNorm; SiLU * up in column blocks) or per (token, head) (q/k norm + rotary): the
# rows are a few hundred to a few thousand elements, so a program holds its whole row in registers.


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 values rounded to dtype (to nearest even) and back: where HF's torch ops round. Nothing in fp32."""
    if dtype != tl.float32:
        x = x.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (num_rows, dim) rows to normalise
    residual_ptr,  # (num_rows, dim) the residual stream; with HAS_RESIDUAL, x + residual is written back here
    weight_ptr,  # (dim,)
    out_ptr,  # (num_rows, dim) the normalised rows
    stride_x,
    stride_r,
    stride_out,  # row strides (the last dim is contiguous)
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,  # add the residual first (vLLM's fused_add_rms_norm)
    BLOCK: tl.constexpr,  # next power of two >= dim; extra lanes masked
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the add, rounded to the model's dtype as HF's x + residual is
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = _rounded(x.to(tl.float32) + r.to(tl.float32), x.dtype)  # x + residual, rounded as HF's add
        tl.store(residual_ptr + row * stride_r + cols, x.to(residual_ptr.dtype.element_ty), mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _rounded(
        w * _rounded(x * rstd, out_ptr.dtype.element_ty), out_ptr.dtype.element_ty
    )  # rounded before the weight, as HF
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # (num_rows, 2 * width): gate's columns, then up's
    out_ptr,  # (num_rows, width)
    stride_in,
    stride_out,  # row strides
    width,
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = _rounded(_rounded(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)  # F.silu rounds, then the product
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # (num_tokens, num_heads, head_dim), rotated in place (a strided view of the qkv projection)
    k_ptr,  # (num_tokens, num_kv_heads, head_dim), likewise
    rope_ptr,  # (num_tokens, head_dim) fp32: cos | sin of each token's head_dim / 2 angles
    q_norm_ptr,
    k_norm_ptr,  # (head_dim,) Qwen3's per-head RMSNorm weights (read only with HAS_NORM)
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_rope,
    eps,
    NUM_HEADS: tl.constexpr,  # query heads: programs 0..NUM_HEADS-1 along axis 1 take q, the rest k
    HALF: tl.constexpr,  # head_dim // 2: x1 is a head's first half, x2 its second
    HALF_PADDED: tl.constexpr,  # next power of two (tl.arange needs one); extra lanes masked
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < NUM_HEADS:
        x_ptr, w_ptr = q_ptr + token * stride_q_tok + head * stride_q_head, q_norm_ptr
    else:
        x_ptr, w_ptr = k_ptr + token * stride_k_tok + (head - NUM_HEADS) * stride_k_head, k_norm_ptr
    dtype = q_ptr.dtype.element_ty
    d = tl.arange(0, HALF_PADDED)
    mask = d < HALF
    x1 = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # RMSNorm over the head's head_dim values, rounded as rms_norm_ref
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
        x1 = _rounded(w1 * _rounded(x1 * rstd, dtype), dtype)
        x2 = _rounded(w2 * _rounded(x2 * rstd, dtype), dtype)
    cos = _rounded(tl.load(rope_ptr + token * stride_rope + d, mask=mask, other=0.0), dtype)
    sin = _rounded(tl.load(rope_ptr + token * stride_rope + HALF + d, mask=mask, other=0.0), dtype)
    # x * cos + cat(-x2, x1) * sin in the model's dtype: each product and the sum rounded as HF's torch ops round them
    out1 = _rounded(_rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype), dtype)
    out2 = _rounded(_rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype), dtype)
    tl.store(x_ptr + d, out1.to(dtype), mask=mask)
    tl.store(x_ptr + HALF + d, out2.to(dtype), mask=mask)


def _row_warps(block):
    """Warps for a program that holds a row of `block` elements: about 8 elements a thread, 1 to 16 warps."""
    return min(16, max(1, block // 256))


def rms_norm_triton(x, weight, eps, residual=None):
    """Same contract as rms_norm_ref, but with residual, x + residual is written into residual (in place)."""
    _check_rows("rms_norm_triton", x, weight, residual)
    _check_triton("rms_norm_triton", x)
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (rows, dim): a view where the rows are evenly strided
    x = x if x.stride(-1) == 1 else x.contiguous()
    r = x if residual is None else residual.view(-1, shape[-1])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # (rows, dim)
    if x.shape[0]:
        block = triton.next_power_of_2(shape[-1])
        with _on_device(x):
            _rms_norm_kernel[(x.shape[0],)](
                x,
                r,
                weight,
                out,
                x.stride(0),
                r.stride(0),
                out.stride(0),
                shape[-1],
                eps,
                HAS_RESIDUAL=residual is not None,
                BLOCK=block,
                num_warps=_row_warps(block),
                enable_fp_fusion=False,
            )
    out = out.view(shape)
    return out if residual is None else (out, residual)


def silu_and_mul_triton(gate_up):
    _check_rows("silu_and_mul_triton", gate_up)
    _check_triton("silu_and_mul_triton", gate_up)
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)  # (rows, width)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        with _on_device(gate_up):
            _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
                gate_up,
                out,
                gate_up.stride(0),
                out.stride(0),
                width,
                BLOCK=block,
                num_warps=_row_warps(block),
                enable_fp_fusion=False,
            )
    return out


def rotary_triton(q, k, rope, q_norm=None, k_norm=None, eps=0.0):
    """Same contract as rotary_ref, but q and k are rotated in place (and returned): one launch for both."""
    _check_rotary(q, k, rope, q_norm, k_norm)
    _check_triton("rotary_triton", q, k, rope)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            "rotary_triton: q and k are rotated in place, so their last dim must be contiguous, "
            f"got strides {q.stride()} and {k.stride()}"
        )
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens:
        half = head_dim // 2
        norm = (q_norm, k_norm) if q_norm is not None else (rope, rope)  # (never read without HAS_NORM)
        with _on_device(q):
            _rotary_kernel[(num_tokens, num_heads + k.shape[1])](
                q,
                k,
                rope,
                *norm,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                rope.stride(0),
                eps,
                NUM_HEADS=num_heads,
                HALF=half,
                HALF_PADDED=triton.next_power_of_2(half),
                HAS_NORM=q_norm is not None,
                num_warps=1,  # a head of at most 256 values: one warp
                enable_fp_fusion=False,  # no multiply-adds: each product rounded, as the reference's
            )
    return q, k


# ---- Triton: a linear layer over a few rows (a small decode batch) ----
# A decode step of a few sequences reads every weight once and does 2 FLOPs a weight: its matmuls run at the
# memory's speed, and their time is the weight's bytes over the bandwidth, or should be. For one row times a
# wide weight cuBLAS picks kernels far from that (o_proj's 1 x 2,048 x 1,024 in bf16 took 10 us inside a graph
# on an H200, 0.4 TB/s; down_proj a split-K kernel plus a reduce). This one streams the weight: a program
# reduces BLOCK_N outputs of one row over K, BLOCK_K columns at a time, in fp32, rounded once at the end as
# cuBLAS rounds. A weight a few MB large stays in L2 for the next row's programs.


@triton.jit
def _linear_rows_kernel(
    x_ptr,  # (rows, K)
    w_ptr,  # (N, K), nn.Linear's layout
    bias_ptr,  # (N,) (read only with HAS_BIAS)
    out_ptr,  # (rows, N)
    N,
    K,
    stride_x,
    stride_w,
    stride_out,  # row strides (the last dims are contiguous)
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K))
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


LINEAR_ROWS_MAX = 1  # rows up to which nn.Linears on a GPU take _linear_rows_kernel (RowsLinear); cuBLAS above
LINEAR_TILE = 4096  # weight elements a program loads at a time: BLOCK_N x BLOCK_K
LINEAR_WARPS = 4


def _linear_tiles(K):
    """(BLOCK_N, BLOCK_K) for a weight K columns wide: the whole row in one pass where it fits the tile."""
    block_k = min(triton.next_power_of_2(K), LINEAR_TILE)
    return max(1, LINEAR_TILE // block_k), block_k


def linear_rows_triton(x, weight, bias=None):
    """F.linear(x, weight, bias) for 2-D x, by _linear_rows_kernel (fp32 sums, rounded once to x's dtype)."""
    _check_triton("linear_rows_triton", x, weight)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.stride(-1) != 1:
        raise ValueError(
            f"linear_rows_triton: x (rows, K) and a row-major weight (N, K), got {tuple(x.shape)} and "
            f"{tuple(weight.shape)} with strides {weight.stride()}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    (rows, K), N = x.shape, weight.shape[0]
    out = torch.empty(rows, N, dtype=x.dtype, device=x.device)  # (rows, N)
    if rows:
        block_n, block_k = _linear_tiles(K)
        with _on_device(x):
            _linear_rows_kernel[(triton.cdiv(N, block_n), rows)](
                x,
                weight,
                weight if bias is None else bias,
                out,
                N,
                K,
                x.stride(0),
                weight.stride(0),
                out.stride(0),
                HAS_BIAS=bias is not None,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                num_warps=LINEAR_WARPS,
            )
    return out


class RowsLinear(torch.nn.Linear):
    """An nn.Linear on a GPU that runs steps of up to LINEAR_ROWS_MAX rows by _linear_rows_kernel (use_rows_linear
    swaps this class in); larger ones by F.linear (cuBLAS)."""

    def forward(self, x):
        if x.dim() == 2 and x.shape[0] <= LINEAR_ROWS_MAX:
            return linear_rows_triton(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def prepare_linears(model):
    """load_model's last step for the matmuls: a CPU packs the weights (pack_linears_cpu), a GPU with Triton
    runs its small steps' matmuls by _linear_rows_kernel (use_rows_linear); elsewhere nothing."""
    pack_linears_cpu(model)
    use_rows_linear(model)


def use_rows_linear(model):
    """A model on a GPU with Triton: its decoder layers' nn.Linears become RowsLinears (the lm_head, a weight
    hundreds of MB large, streams at the memory's speed through cuBLAS already). Elsewhere nothing."""
    layers = [m for m in model.model.layers.modules() if type(m) is torch.nn.Linear]
    if layers and layers[0].weight.is_cuda and _use_triton(layers[0].weight):
        for m in layers:
            m.__class__ = RowsLinear


# ---- Triton: paged_attention ----
# Grid (num_q_blocks, num_kv_heads, segments: 1 unless split-KV). A program owns one kv head and BLOCK_Q
# consecutive query tokens of one sequence. GQA packing: the NUM_QUERIES_PER_KV
# query heads that read this kv head all go into the rows of one tile,
#     row = token_in_block * NUM_QUERIES_PER_KV + head_in_group,
# so K and V are loaded once for the whole group, and BLOCK_M = BLOCK_Q *
# NUM_QUERIES_PER_KV rows (rounded up to a power of two >= 16, spare rows masked)
# feed tl.dot. The program walks the sequence's keys in tiles of TILE_N
# positions, gathering each key's cache row through the block table (so the
# cache block size and TILE_N are independent), and keeps an online softmax:
# running max m, running sum l, accumulator acc, all fp32, in base 2 (exp2).
#
# Query blocks -> sequences: sequence s owns the query blocks
#     first[s] .. first[s+1] - 1,   first[s] = query_start_loc[s] // BLOCK_Q + s.
# That range holds at least ceil(q_len / BLOCK_Q) blocks (the floor of the end
# grows by at least floor(q_len / BLOCK_Q), and the "+ s" adds one), and the
# total, first[num_seqs] = num_tokens // BLOCK_Q + num_seqs, comes from shapes
# alone: no GPU -> CPU sync, no Python loop over sequences. Each program finds
# its sequence by a binary search over first[] inside the kernel (log2(num_seqs)
# loads, and no extra launches per layer); a program past its sequence's last
# query exits at once (at most about one idle program per sequence).
#
# Split-KV (flash-decoding): a decode batch of a few long sequences launches only
# num_seqs x kv_heads programs (2 x 8 = 16 on a 132-SM H100) and leaves the GPU
# idle. With NUM_SEGMENTS > 1 a third grid axis cuts each sequence's keys into
# that many segments of whole key tiles; each program writes its rows' running
# max m, sum l and unnormalised acc (fp32) to scratch, and _merge_segments_kernel
# combines them by log-sum-exp: out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M),
# M = max_s m_s. A segment past the sequence's end writes m = -inf, l = 0, acc = 0
# and gets weight 0.


# the block-table width and the sequence count change every step: int arguments that Triton
# specialises (== 1, % 16 == 0) would compile a new variant whenever they cross those values
@triton.jit(do_not_specialize=["stride_bt_seq", "num_seqs"])
def _paged_attention_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim) output, dtype of q
    q_ptr,  # (num_tokens, num_heads, head_dim) queries of this step's tokens
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # same shape and strides as k_cache
    block_tables_ptr,  # (num_seqs, max_blocks_per_seq) int32 block ids; entries past seq_len are never read
    seq_lens_ptr,  # (num_seqs,) int32: cached + new tokens
    query_start_loc_ptr,  # (num_seqs + 1,) int32: sequence s owns q rows [start[s], start[s+1])
    num_seqs,  # sequences in the batch
    qk_scale,  # softmax scale * log2(e): scores live in base 2 so that exp2 does the softmax
    stride_q_tok,
    stride_q_head,  # q strides (head_dim is contiguous)
    stride_o_tok,
    stride_o_head,  # out strides (head_dim is contiguous)
    stride_c_block,
    stride_c_row,
    stride_c_head,  # cache strides, shared by k_cache and v_cache
    stride_bt_seq,  # block_tables row stride
    part_m_ptr,
    part_l_ptr,  # (num_tokens, num_heads, NUM_SEGMENTS) fp32 split-KV scratch (unused when NUM_SEGMENTS == 1)
    part_acc_ptr,  # (num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED) fp32 split-KV scratch
    num_heads,  # query heads: the row stride of the scratch
    NUM_QUERIES_PER_KV: tl.constexpr,  # GQA group size: num_heads // num_kv_heads
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, any value >= 1 (a power of two becomes a shift)
    HEAD_DIM: tl.constexpr,  # true head_dim
    HEAD_DIM_PADDED: tl.constexpr,  # power of two >= 16 (tl.arange, tl.dot); extra lanes masked to 0
    BLOCK_M: tl.constexpr,  # packed (token, head) rows per tile: power of two >= 16
    BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_M // NUM_QUERIES_PER_KV
    TILE_N: tl.constexpr,  # keys per step of the key loop: power of two >= 16
    # run both dots on fp32 operands: fp32 caches (IEEE, not TF32), or bf16 under the interpreter
    DOT_IN_FP32: tl.constexpr,
    # 1, or split-KV: segments per sequence (the third grid axis), merged by _merge_segments_kernel
    NUM_SEGMENTS: tl.constexpr,
    MIN_KEYS: tl.constexpr,  # split-KV: fewest keys a segment takes (MIN_SEGMENT_KEYS, a multiple of TILE_N)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # the sequence of this query block: the last s with first[s] <= q_block (binary search; first[0] = 0)
    lo = q_block * 0  # 0 as an int32 tensor, not Python's 0: the while loop needs lo to keep one type, like hi
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_in_seq = q_block - (q_start // BLOCK_Q + seq)  # see "Query blocks -> sequences"
    if q_block_in_seq * BLOCK_Q >= q_len:
        return  # a spare program: the grid is an upper bound
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step

    # rows of the tile: (token, head) pairs, packed row = token * NUM_QUERIES_PER_KV + head
    rows = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    q_idx = q_block_in_seq * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # (BLOCK_M,) query index within the sequence
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV  # (BLOCK_M,) query head
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)  # (BLOCK_M,) padding rows are never stored
    q_pos = context_len + q_idx  # (BLOCK_M,) position in the sequence: the causal limit of the row
    dims = tl.arange(0, HEAD_DIM_PADDED)  # (HEAD_DIM_PADDED,)
    dim_valid = dims < HEAD_DIM  # (HEAD_DIM_PADDED,)

    token = (q_start + q_idx).to(tl.int64)  # (BLOCK_M,) row of q / out
    q_offs = token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]  # (BLOCK_M, HEAD_DIM_PADDED)
    row_mask = row_valid[:, None] & dim_valid[None, :]  # (BLOCK_M, HEAD_DIM_PADDED)
    q = tl.load(q_ptr + q_offs, mask=row_mask, other=0.0)  # (BLOCK_M, HEAD_DIM_PADDED)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # (BLOCK_M,) running max of base-2 scores
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # (BLOCK_M,) running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)  # (BLOCK_M, HEAD_DIM_PADDED) running P @ V

    # keys past the last query of this tile are invisible to every row: stop there
    num_keys = tl.minimum(seq_len, context_len + (q_block_in_seq + 1) * BLOCK_Q)
    key_lo = 0
    if NUM_SEGMENTS > 1:  # this program's segment: whole key tiles, the last segments may be empty
        # at least MIN_KEYS a segment: a short sequence works in fewer segments (the rest end at once, empty), so the
        # split follows each sequence's length at run time, not the block table's width (graphs fix NUM_SEGMENTS)
        segment_keys = tl.maximum(tl.cdiv(tl.cdiv(num_keys, NUM_SEGMENTS), TILE_N) * TILE_N, MIN_KEYS)
        key_lo = tl.program_id(2) * segment_keys
        num_keys = tl.minimum(num_keys, key_lo + segment_keys)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for key_start in range(key_lo, num_keys, TILE_N):
        key_pos = key_start + tl.arange(0, TILE_N)  # (TILE_N,) positions in the sequence
        key_valid = key_pos < num_keys  # (TILE_N,) never touch block-table entries or slots past seq_len
        block_id = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)  # (TILE_N,)
        key_offs = (
            block_id * stride_c_block + (key_pos % BLOCK_SIZE) * stride_c_row + kv_head * stride_c_head
        )  # (TILE_N,) int64
        kv_mask = key_valid[:, None] & dim_valid[None, :]  # (TILE_N, HEAD_DIM_PADDED)
        # other=0: NaN or garbage in unused slots must not reach P @ V (0 * NaN is NaN)
        k = tl.load(
            k_cache_ptr + key_offs[None, :] + dims[:, None], mask=dim_valid[:, None] & key_valid[None, :], other=0.0
        )  # (HEAD_DIM_PADDED, TILE_N)
        v = tl.load(
            v_cache_ptr + key_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0
        )  # (TILE_N, HEAD_DIM_PADDED)

        if DOT_IN_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")  # (BLOCK_M, TILE_N)
        else:
            s = tl.dot(q, k)  # (BLOCK_M, TILE_N) fp16/bf16 operands, fp32 accumulation
        visible = (
            row_valid[:, None] & key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        )  # (BLOCK_M, TILE_N) causal rule
        s = tl.where(visible, s * qk_scale, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))  # (BLOCK_M,)
        # a row that has seen no visible key yet has m_new = -inf; subtract 0 instead so that
        # exp2(-inf - (-inf)) = NaN never happens: p and alpha come out 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (BLOCK_M,)
        p = tl.math.exp2(s - m_safe[:, None])  # (BLOCK_M, TILE_N)
        alpha = tl.math.exp2(m - m_safe)  # (BLOCK_M,) rescales what was summed under the old max
        l = l * alpha + tl.sum(p, axis=1)
        if DOT_IN_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    if NUM_SEGMENTS > 1:  # unnormalised: _merge_segments_kernel weighs the segments against each other
        part = (token * num_heads + head) * NUM_SEGMENTS + tl.program_id(2)  # (BLOCK_M,) int64 scratch row
        tl.store(part_m_ptr + part, m, mask=row_valid)
        tl.store(part_l_ptr + part, l, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + dims[None, :], acc, mask=row_valid[:, None])
    else:
        acc = acc / tl.where(l > 0.0, l, 1.0)[:, None]  # a row with no visible key gives 0, not NaN
        o_offs = (
            token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        )  # (BLOCK_M, HEAD_DIM_PADDED)
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim) output, dtype of q
    part_m_ptr,
    part_l_ptr,  # (num_tokens, num_heads, NUM_SEGMENTS) fp32: each segment's running max and sum
    part_acc_ptr,  # (num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED) fp32: each segment's unnormalised P @ V
    stride_o_tok,
    stride_o_head,  # out strides (head_dim is contiguous)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,  # power of two
):
    # Grid (num_tokens, num_heads): one program merges the segments of one (token, head) row.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)  # (NUM_SEGMENTS,) int64
    dims = tl.arange(0, HEAD_DIM_PADDED)  # (HEAD_DIM_PADDED,)
    m = tl.load(part_m_ptr + part)  # (NUM_SEGMENTS,) -inf for a segment that saw no key
    m_max = tl.max(m, axis=0)
    weight = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # (NUM_SEGMENTS,) 0 for empty segments
    total = tl.sum(tl.load(part_l_ptr + part) * weight, axis=0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PADDED + dims[None, :])  # (NUM_SEGMENTS, HEAD_DIM_PADDED)
    o = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)  # (HEAD_DIM_PADDED,)
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# ---- Triton: tiles per GPU, and when to split ----
# Registers and shared memory are part of correctness: a tile too large for an arch spills to local
# memory (slow) or fails to launch (OutOfResources). The tiles below are picked per (arch, dtype,
# head_dim, phase) so that every config the engine launches compiles on sm_75/80/86/89/90 with zero
# spill bytes and shared memory within SHARED_LIMIT; `python bench.py --kernels --static` compiles
# them all (compile_static below, no GPU needed) and the README carries its table. Why the rules:
#   - fp32 has no tensor-core path: with IEEE precision (no TF32) tl.dot is FMAs on registers, so its
#     tiles are 16 rows x 16-32 keys, against 16-bit's 16x64 (decode) and 64x32 (prefill) (a 64x64 fp32
#     score tile alone is 32 registers a thread);
#     so is 16-bit on sm_75, where Triton has no mma path (its fp16 tiles spill there at 255 registers);
#   - prefill reuses each K/V tile over BLOCK_M rows, so its rows are many and its key tile small
#     (32, as vLLM's unified attention); head_dim 256 halves the key tile again;
#   - decode has one token a program: 16 rows (tl.dot's least), the GQA heads packed into them.

# Shared memory a block may use (the opt-in maximum), bytes, per compute capability.
SHARED_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}
CPU_CC = 80  # the arch whose tiles the interpreter runs (tests run the others' too)
MAX_SEGMENTS = 16  # split-KV: most segments per sequence
# split-KV: fewest keys a segment is worth (a multiple of every TILE_N), at launch and in the kernel; on an H200 a
# batch-1 graph of 562-key decodes replayed in 1.06 ms with 64, 1.10 with 128, 1.19 with 256
MIN_SEGMENT_KEYS = 64


def tile_config(cc, dtype, head_dim_padded, group, phase):
    """-> (BLOCK_M, TILE_N, num_warps) for compute capability cc (80 = sm_80), the caches' torch dtype,
    head_dim padded to a power of two >= 16, the GQA group and phase "decode", "split" or "prefill". The arch
    matters little today: before sm_80 (no mma path), and one warp count on sm_80. The tensor-core tiles fit
    sm_86/89's 101,376 B of shared memory, so sm_80/90 take the same ones (larger tiles there would want
    timings on those GPUs to justify them)."""
    if (
        dtype == torch.float32 or cc < 80
    ):  # tl.dot as FMAs: fp32 (IEEE), and 16-bit before sm_80 (Triton's mma needs sm_80)
        tile_n = 32 if head_dim_padded <= 64 and phase != "prefill" else 16
        # more threads share the (16, head_dim) accumulator as it widens: at 4 warps ptxas spills from head_dim 128
        num_warps = max(4, head_dim_padded // 16)
        if cc == 80 and head_dim_padded == 128:
            num_warps = 16  # ptxas spills 16 B at 8 warps there (fp32 split, GQA 1; Triton 3.9)
        return max(16, triton.next_power_of_2(group)), tile_n, num_warps
    if phase == "prefill":  # 64 rows reuse each K/V tile; head_dim 256 needs 8 warps not to spill
        block_m, tile_n, num_warps = 64, 16 if head_dim_padded > 128 else 32, 8 if head_dim_padded > 128 else 4
    else:  # decode and split: one token a program
        block_m, tile_n, num_warps = 16, 32 if head_dim_padded > 128 else 64, 4
    return (
        max(block_m, triton.next_power_of_2(group)),
        tile_n,
        num_warps,
    )  # a group larger than a tile gets BLOCK_M = its size


def num_segments(num_tokens, num_seqs, num_kv_heads, max_keys, sm_count):
    """Split-KV segments per sequence, from shapes alone: 1 (no split) unless the batch is decode only
    and its num_seqs x num_kv_heads programs leave SMs idle; then the least power of two (up to MAX_SEGMENTS)
    that brings the programs to the SM count or more, and no more segments than max_keys (an upper bound on
    a sequence's keys: the block table's width x block_size) fills with MIN_SEGMENT_KEYS each. In the kernel,
    each sequence then works in as many of them as its own keys fill with MIN_SEGMENT_KEYS each (at least one)."""
    programs = num_seqs * num_kv_heads
    if num_tokens != num_seqs or programs == 0 or programs >= sm_count:
        return 1
    segments = min(MAX_SEGMENTS, triton.next_power_of_2(-(-sm_count // programs)), max_keys // MIN_SEGMENT_KEYS)
    return 1 if segments < 2 else 1 << (segments.bit_length() - 1)  # a power of two: the merge's tl.arange


@functools.cache
def _device_facts(device):
    """(compute capability as 80 for sm_80, SM count) of a CUDA device, read once; a CPU (the
    interpreter) gets CPU_CC's tiles and never splits."""
    if device.type != "cuda":
        return CPU_CC, 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor, torch.cuda.get_device_properties(device).multi_processor_count


def kernel_dtype(device, dtype):
    """The dtype (a name, as EngineConfig.dtype) the engine runs on device: bfloat16 becomes float16 on a GPU
    before sm_80 (Turing has no bf16 tensor cores; vLLM advises the same), with a one-line warning."""
    if dtype != "bfloat16" or device.type != "cuda" or _device_facts(device)[0] >= 80:
        return dtype
    warnings.warn(
        f"sm_{_device_facts(device)[0]} has no bfloat16 tensor cores: running in float16 instead", stacklevel=3
    )
    return "float16"


def paged_attention_triton(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, segments=None
):
    """Same contract as paged_attention_ref. Writes `out` if given (every row of a
    token that belongs to a sequence). Expects query_start_loc[-1] == num_tokens and
    valid block ids for positions < seq_len (not checked: that would sync the GPU).
    segments: split-KV segments per sequence (a power of two; None: num_segments decides)."""
    _check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    _check_triton("paged_attention_triton", q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"paged_attention_triton: head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            "paged_attention_triton: k_cache and v_cache must share strides, "
            f"got {k_cache.stride()} and {v_cache.stride()}"
        )
    if segments is not None and (segments < 1 or segments & (segments - 1)):
        raise ValueError(f"paged_attention_triton: segments must be a power of two >= 1, got {segments}")
    if out is None:
        out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
    elif out.stride(-1) != 1:
        raise ValueError(f"paged_attention_triton: out's last dim must be contiguous, got strides {out.stride()}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    # the kernel reads the metadata with unit stride along its last dim (no-ops when it already is)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    cc, sm_count = _device_facts(q.device)
    if segments is None:
        segments = num_segments(num_tokens, num_seqs, num_kv_heads, block_tables.shape[1] * k_cache.shape[1], sm_count)
    phase = "prefill" if num_tokens != num_seqs else "split" if segments > 1 else "decode"
    block_m, tile_n, num_warps = tile_config(cc, q.dtype, head_dim_padded, group, phase)
    block_q = block_m // group
    num_q_blocks = (
        num_tokens // block_q + num_seqs
    )  # an upper bound from shapes alone (see the header above the kernel)
    part_m = part_l = part_acc = out  # unused unless split
    if segments > 1:
        part_m = torch.empty(
            num_tokens, num_heads, segments, dtype=torch.float32, device=q.device
        )  # (tokens, heads, segments)
        part_l = torch.empty_like(part_m)  # (tokens, heads, segments)
        part_acc = torch.empty(
            num_tokens, num_heads, segments, head_dim_padded, dtype=torch.float32, device=q.device
        )  # (tokens, heads, segments, D)

    with _on_device(q):
        _paged_attention_kernel[(num_q_blocks, num_kv_heads, segments)](
            out,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            num_seqs,
            scale * 1.4426950408889634,  # log2(e)
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            part_m,
            part_l,
            part_acc,
            num_heads,
            NUM_QUERIES_PER_KV=group,
            BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            TILE_N=tile_n,
            # the interpreter's bf16 tl.dot returns garbage; fp16 and fp32 are exact there
            DOT_IN_FP32=q.dtype == torch.float32 or (TRITON_INTERPRET and q.dtype == torch.bfloat16),
            NUM_SEGMENTS=segments,
            MIN_KEYS=MIN_SEGMENT_KEYS,
            num_warps=num_warps,
        )
        if segments > 1:
            _merge_segments_kernel[(num_tokens, num_heads)](
                out,
                part_m,
                part_l,
                part_acc,
                out.stride(0),
                out.stride(1),
                HEAD_DIM=head_dim,
                HEAD_DIM_PADDED=head_dim_padded,
                NUM_SEGMENTS=segments,
                num_warps=1,
            )
    return out


# ---- Triton: compiled for any GPU, on a CPU ----
# triton.compile with a GPUTarget runs Triton's real compiler for any compute capability without a GPU:
# the PTX it makes, assembled by the ptxas in the triton wheel (-v), gives registers and spill bytes,
# and the compiled kernel's metadata its shared memory. These are compile-time facts, not timings.
# The pointer and stride arguments are hinted 16-aligned, as the launcher specializes them (but for the
# ones marked do_not_specialize).

_POINTER_DTYPES = {
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "rope_ptr": "*fp32",
    "part_m_ptr": "*fp32",
    "part_l_ptr": "*fp32",
    "part_acc_ptr": "*fp32",
}
_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _ptxas_usage(ptx):
    """(registers, spill bytes stored + loaded) of one kernel's PTX, from the wheel's ptxas -v."""
    ptxas = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell"
    )  # the newest PTX ISA
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch = re.search(r"^\.target (\S+)", ptx, re.M).group(1)  # sm_90a on Hopper: Triton's wgmma needs it
        log = subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return int(re.search(r"Used (\d+) registers", log).group(1)), int(spills.group(1)) + int(spills.group(2))


def _compile_for(fn, cc, dtype, consts, num_warps, **options):
    """One kernel compiled for compute capability cc: (registers, spill bytes, shared bytes)."""
    from triton.backends.compiler import GPUTarget  # here, not at the top: kernels.py imports without triton
    from triton.compiler import ASTSource

    sig = {
        name: "constexpr"
        if name in consts
        else _POINTER_DTYPES.get(name, "*" + dtype)
        if name.endswith("_ptr")
        else "fp32"
        if name in ("qk_scale", "eps")
        else "i32"
        for name in fn.arg_names
    }
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(sig)
        if (name.endswith("_ptr") or name.startswith("stride")) and name not in unspecialized
    }
    constexprs = {(fn.arg_names.index(name),): value for name, value in consts.items()}
    compiled = triton.compile(
        ASTSource(fn, sig, constexprs, aligned),
        target=GPUTarget("cuda", cc, 32),
        options=dict(num_warps=num_warps, **options),
    )
    return (*_ptxas_usage(compiled.asm["ptx"]), compiled.metadata.shared)


def compile_static(cc, dtype, head_dim, group, phase, block_size=16):
    """Compile the attention kernel as paged_attention_triton would launch it on compute capability cc
    (dtype: the caches' torch dtype; phase: "decode", "prefill" or "split"), with no GPU. -> one row per
    kernel (split: the attention kernel and the merge): kernel, arch, dtype, head_dim, group, phase, tiles
    (BLOCK_M x TILE_N and warps), registers, spill_bytes, shared_bytes, shared_limit. Needs TRITON_INTERPRET unset."""
    if TRITON_INTERPRET or _TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(
            "compile_static: needs triton installed and TRITON_INTERPRET unset before kernels.py is imported"
        )
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    block_m, tile_n, num_warps = tile_config(cc, dtype, head_dim_padded, group, phase)
    segments = MAX_SEGMENTS if phase == "split" else 1
    consts = dict(
        NUM_QUERIES_PER_KV=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_M=block_m,
        BLOCK_Q=block_m // group,
        TILE_N=tile_n,
        DOT_IN_FP32=dtype == torch.float32,
        NUM_SEGMENTS=segments,
        MIN_KEYS=MIN_SEGMENT_KEYS,
    )
    name = _TRITON_DTYPES[dtype]
    builds = [("paged_attention", _paged_attention_kernel, consts, num_warps, f"{block_m}x{tile_n}, {num_warps} warps")]
    if phase == "split":
        merge = dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, NUM_SEGMENTS=segments)
        builds.append(("merge_segments", _merge_segments_kernel, merge, 1, f"{segments} segments, 1 warp"))
    rows = []
    for kernel, fn, kernel_consts, warps, tiles in builds:
        registers, spill_bytes, shared_bytes = _compile_for(fn, cc, name, kernel_consts, warps)
        rows.append(
            dict(
                kernel=kernel,
                arch=f"sm_{cc}",
                dtype=name,
                head_dim=head_dim,
                group=group,
                phase=phase,
                tiles=tiles,
                registers=registers,
                spill_bytes=spill_bytes,
                shared_bytes=shared_bytes,
                shared_limit=SHARED_LIMIT[cc],
            )
        )
    return rows


def compile_static_small_ops(cc, dtype, width):
    """Compile the layer's small-op kernels as their wrappers launch them for rows of `width` values (RMSNorm: the
    hidden size; SiLU * up: the intermediate size; the few-row matmul: K; rotary: head_dim, with Qwen3's q/k norm)
    on compute capability cc, with no GPU: rows as compile_static's (head_dim holds the width)."""
    if TRITON_INTERPRET or _TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(
            "compile_static_small_ops: needs triton installed and TRITON_INTERPRET unset before kernels.py is imported"
        )
    norm, silu, half = (
        triton.next_power_of_2(width),
        min(1024, triton.next_power_of_2(width)),
        triton.next_power_of_2(width // 2),
    )
    bn, bk = _linear_tiles(width)  # a weight `width` columns wide
    builds = [
        ("rms_norm+residual", _rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=norm), _row_warps(norm), f"BLOCK {norm}"),
        ("silu_and_mul", _silu_and_mul_kernel, dict(BLOCK=silu), _row_warps(silu), f"BLOCK {silu}"),
        ("linear_rows", _linear_rows_kernel, dict(HAS_BIAS=True, BLOCK_N=bn, BLOCK_K=bk), LINEAR_WARPS, f"{bn}x{bk}"),
    ]
    if width <= MAX_HEAD_DIM:
        builds.append(
            (
                "qk_norm+rotary",
                _rotary_kernel,
                dict(NUM_HEADS=16, HALF=width // 2, HALF_PADDED=half, HAS_NORM=True),
                1,
                f"HALF {half}",
            )
        )
    rows = []
    for kernel, fn, consts, warps, tiles in builds:
        registers, spill_bytes, shared_bytes = _compile_for(
            fn, cc, _TRITON_DTYPES[dtype], consts, warps, enable_fp_fusion=False
        )
        rows.append(
            dict(
                kernel=kernel,
                arch=f"sm_{cc}",
                dtype=_TRITON_DTYPES[dtype],
                head_dim=width,
                group="-",
                phase="-",
                tiles=f"{tiles}, {warps} warps",
                registers=registers,
                spill_bytes=spill_bytes,
                shared_bytes=shared_bytes,
                shared_limit=SHARED_LIMIT[cc],
            )
        )
    return rows


# ---- Dispatch: what nanobatch.py calls ----


def _use_triton(t):
    """CUDA tensors go to Triton (when installed); CPU tensors only when USE_TRITON_ON_CPU is set."""
    if t.is_cuda:
        return _TRITON_IMPORT_ERROR is None
    return USE_TRITON_ON_CPU


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    if _use_triton(k_cache):
        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, plan=None):
    """plan: from plan_paged_attention, made once per step for the CPU path (Triton needs none)."""
    if _use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=out)
    if q.device.type != "cpu":  # a GPU without triton installed: the reference runs on any device
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=out)
    return paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=out, plan=plan)


def rms_norm(x, weight, eps, residual=None):
    """rms_norm_ref's contract: the normalised rows, or with residual (normed rows, x + residual), the add
    written into residual in place (Triton, and the CPU's compiled loops over bf16 or fp32: rms_norm_cpu)."""
    if _use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    out = rms_norm_cpu(x, weight, eps, residual)  # None where the loops do not run
    return rms_norm_ref(x, weight, eps, residual) if out is None else out


def silu_and_mul(gate_up):
    if _use_triton(gate_up):
        return silu_and_mul_triton(gate_up)
    out = silu_and_mul_cpu(gate_up)  # None where the loops do not run
    return silu_and_mul_ref(gate_up) if out is None else out


def rotary(q, k, rope, q_norm=None, k_norm=None, eps=0.0):
    """rotary_ref's contract (in place on Triton); on a CPU, bf16 or fp32 heads go to compiled loops (rotary_cpu)."""
    if _use_triton(q):
        return rotary_triton(q, k, rope, q_norm, k_norm, eps)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    out = rotary_cpu(q, k, rope)  # None where the loops do not run
    if out is not None:
        return out
    cos, sin = _step_cos_sin(rope, q.dtype)  # (T, 1, D) each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_and_store(q, k, v, rope, k_cache, v_cache, slot_mapping, q_norm=None, k_norm=None, eps=0.0):
    """rotary, then store_kv of the rotated k and v -> the rotated q. On a CPU, bf16 or fp32 runs as one compiled loop
    (rotary_cpu with the caches: each rotated k row goes straight to its slot)."""
    if not _use_triton(q):
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
            q_norm = k_norm = None
        out = rotary_cpu(q, k, rope, store=(v, k_cache, v_cache, slot_mapping))  # None where the loops do not run
        if out is not None:
            return out
    q, k = rotary(q, k, rope, q_norm, k_norm, eps)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def plan_paged_attention(block_tables, seq_lens, query_start_loc, block_size, num_kv_heads, dtype):
    """The per-step part of paged_attention_cpu, shared by every layer (dtype: the caches'): None where
    it does not run (Triton, or a GPU without triton installed: the reference)."""
    if _use_triton(block_tables) or block_tables.device.type != "cpu":
        return None
    return _plan(block_tables, seq_lens, query_start_loc, block_size, num_kv_heads, dtype)


# ==== The CPU fast paths (a learner may skip from here) ====
# Everything above runs the engine on any device: the references are the rule, the Triton kernels
# the GPU path. What follows only makes the engine quicker on a CPU: paged_attention_cpu (attention
# planned once per step, decode rows as compiled loops (numba) or batched torch ops, prefill rows on AMX's
# tiles where the CPU has them), then the sampler's greedy argmax over bf16 and the model's RMSNorm, rotary
# embedding and SwiGLU over bf16 or fp32 as compiled loops.
# The tests hold each to the references (or to torch's ops); argmax_rows, rms_norm_cpu and
# rotary_cpu return None where they do not run, and the caller uses torch ops.


# ---- The CPU path: a plan per step; decode rows by compiled loops or batched torch ops ----
# The engine's CPU attention. Per sequence (the reference) costs a dozen small torch ops per
# sequence per layer: at batch 48 and 30 layers, most of the time goes to op overhead. Here the
# work that is the same in every layer (which rows, which blocks, which keys are padding) is
# planned once per step. Decode rows (one query each) then take one of two routes:
#   - compiled loops (numba installed, caches in bf16 or fp32): _decode_attention_loops below, the
#     attention as llama2.c writes it, reads each key and value in place in the paged cache, once.
#     A decode step must read all of its K/V (~175 MiB at batch 48 on the default model), and torch
#     ops cannot read it in place: they gather it first, so they move it about four times over;
#   - batched torch ops (no numba, fp16 caches, or NANOBATCH_CPU_LOOPS=0): decode rows sorted by length, cut into groups
#     of at most DECODE_GROUP_KEYS padded keys, so that little of a group is padding and its copies
#     stay a few MB; per group two gathers and two batched matmuls:
#       - K and V are gathered head-major, (kv_heads * seqs, keys, head_dim), from the cache viewed as
#         (slots * kv_heads, head_dim) rows, so the matmuls take them without another copy (GQA: the
#         query heads of a kv head are the rows of one matrix);
#       - padded keys point at the sequence's last key (finite, never an unowned slot), bias -inf;
#       - q.k and the softmax run in fp32 (K is upcast after the gather); the probabilities are
#         rounded to the cache dtype before P @ V, as in the Triton kernel.
# Prefill sequences go one at a time, as in the reference (their queries fill the matmuls anyway).
DECODE_GROUP_KEYS = 4096  # small enough that a group's copies stay small, large enough that its matmuls stay few
LOOP_DTYPES = {
    torch.bfloat16: (torch.uint16, 16),
    torch.float32: (torch.uint32, 0),
}  # cache dtype -> (its bits, shift to fp32)


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # (n,) int64: the group's q rows (one per sequence)
    kv_rows: torch.Tensor  # (kv_heads * n * num_keys,) int64: rows of cache.view(-1, head_dim), head-major
    bias: torch.Tensor  # (n, 1, num_keys) fp32: 0 for a real key, -inf for padding
    num_keys: int  # the group's longest sequence


@dataclass
class DecodeRows:
    """The compiled loops' inputs: numpy views, made once per step."""

    rows: object  # (n,) int64 numpy array: the decode sequences' q rows
    block_tables: object  # (n, max_blocks) int32 numpy array: their block tables
    seq_lens: object  # (n,) int32 numpy array: their lengths
    parts: int  # each sequence's blocks in this many runs, a job each, merged after (fewer sequences than threads)
    num_keys: int  # keys of all the rows together (the loops' work: num_keys x heads x head_dim multiply-adds)


@dataclass
class PrefillSeq:
    """A sequence with more than one query row: its q rows start : start + q_len, its seq_len keys."""

    index: int  # in the batch
    start: int
    q_len: int
    seq_len: int
    first_slot: int | None  # where its keys start in the cache when its blocks are one run (the usual case)


@dataclass
class AmxPrefill:
    """The AMX prefill loops' inputs (_prefill_attention_amx), made once per step: numpy arrays."""

    seqs: object  # (n, 4) int64: each prefill sequence's first q row, q rows, keys, first key in the V^T scratch
    block_tables: object  # (n, max_blocks) int32: their block tables
    key_jobs: object  # (m, 3) int64: (sequence, kv head, block of 32 keys) whose V^T tile phase 1 writes
    jobs: object  # (j, 3) int64: (sequence, kv head, AMX_QUERIES queries), thread t's: job_ends[t] to job_ends[t + 1]
    job_ends: object  # (threads + 1,) int64
    num_keys: int  # the scratch's keys (each sequence's rounded up to 32)
    query_keys: int  # the keys each query sees, summed over the queries


@dataclass
class CpuAttentionPlan:
    decode: list  # [DecodeGroup] for the torch ops, or [DecodeRows] for the compiled loops
    prefill: list  # [PrefillSeq]
    amx: AmxPrefill | None = None  # the prefill sequences again, for the AMX loops where they run


def _first_slot(block_table, seq_len, block_size):
    """The first cache slot of a sequence whose blocks are one run of ids, else None."""
    ids = block_table[: -(-seq_len // block_size)].tolist()
    return ids[0] * block_size if ids == list(range(ids[0], ids[0] + len(ids))) else None


def _plan(block_tables, seq_lens, query_start_loc, block_size, num_kv_heads, dtype):
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens, starts = seq_lens.tolist(), query_start_loc[:-1].tolist()
    prefill = [
        PrefillSeq(i, starts[i], n, lens[i], _first_slot(block_tables[i], lens[i], block_size))
        for i, n in enumerate(q_lens)
        if n > 1
    ]
    plan = CpuAttentionPlan(decode=[], prefill=prefill)
    if prefill and dtype == torch.bfloat16 and block_size % AMX_ROWS == 0 and _amx_prefill_loops() is not None:
        plan.amx = _amx_prefill_plan(prefill, block_tables, num_kv_heads)
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode and _decode_loops(dtype) is not None:
        idx = torch.tensor(decode)
        # a job per sequence reads each cache block in one pass; with fewer sequences than threads each one's blocks
        # are cut into runs (a job each, their softmax sums merged after), so that no thread idles
        parts = -(-_loop_threads() // len(decode))
        plan.decode.append(
            DecodeRows(
                np.array([starts[i] for i in decode], np.int64),
                block_tables[idx].numpy(),
                seq_lens[idx].numpy(),
                parts,
                sum(lens[i] for i in decode),
            )
        )
        return plan
    group = []
    for i in sorted(decode, key=lens.__getitem__):
        if group and (len(group) + 1) * lens[i] > DECODE_GROUP_KEYS:  # lens[i]: the longest so far
            plan.decode.append(_decode_group(group, lens, starts, block_tables, seq_lens, block_size, num_kv_heads))
            group = []
        group.append(i)
    if group:
        plan.decode.append(_decode_group(group, lens, starts, block_tables, seq_lens, block_size, num_kv_heads))
    return plan


def attend_decode_rows(loops, q, k_cache, v_cache, rows: DecodeRows, scale, out):
    """The compiled decode loops (_decode_loops(dtype)) over a step's DecodeRows: q, the caches and out (q's shape,
    contiguous) as their bits, no copy."""
    bits, shift = LOOP_DTYPES[k_cache.dtype]
    num_heads, head_dim = q.shape[1:]
    loops(
        rows.num_keys * num_heads * head_dim,  # multiply-adds of q.k (and as many of p.v)
        *(t.view(bits).numpy() for t in (q, k_cache, v_cache)),
        shift,
        rows.parts,
        rows.rows,
        rows.block_tables,
        rows.seq_lens,
        scale,
        out.view(bits).numpy(),
    )


def _decode_group(seqs, lens, starts, block_tables, seq_lens, block_size, num_kv_heads):
    idx, n, num_keys = torch.tensor(seqs), len(seqs), lens[seqs[-1]]
    pos = torch.arange(num_keys).expand(n, num_keys)  # (n, L) key positions
    last = seq_lens[idx, None].long() - 1  # (n, 1)
    key = torch.minimum(pos, last)  # padding reads the sequence's last key, then is masked out
    slots = block_tables[idx].long().gather(1, key // block_size) * block_size + key % block_size  # (n, L)
    kv_rows = slots.flatten()[None, :] * num_kv_heads + torch.arange(num_kv_heads)[:, None]  # (Hkv, n * L)
    bias = torch.zeros(n, 1, num_keys).masked_fill_((pos > last)[:, None, :], float("-inf"))
    return DecodeGroup(torch.tensor([starts[i] for i in seqs]), kv_rows.flatten(), bias, num_keys)


def paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, plan=None):
    """paged_attention for CPU tensors: decode rows as the plan routes them (compiled loops or torch
    groups; the plan is made here if not given); prefill sequences all in one call of the AMX loops where
    they run (_prefill_attention_cpu_amx), else as in the reference, their keys padded (PREFILL_KEYS: the
    padding slots of a sequence's last block are zeroed). Writes `out` if given."""
    _check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    loops = _decode_loops(q.dtype)
    if plan is None or (loops is None and any(isinstance(g, DecodeRows) for g in plan.decode)):
        plan = _plan(
            block_tables, seq_lens, query_start_loc, block_size, num_kv_heads, q.dtype
        )  # (again: the loops cannot run it)
    out = torch.empty_like(q) if out is None else out  # (num_tokens, num_heads, head_dim)
    for g in plan.decode:
        if isinstance(g, DecodeRows):  # the compiled loops
            o = out if out.is_contiguous() else torch.empty_like(q)
            attend_decode_rows(loops, q.contiguous(), k_cache, v_cache, g, scale, o)
            if o is not out:
                out[g.rows] = o[g.rows]
            continue
        n, L = len(g.rows), g.num_keys
        # row = slot * Hkv + kv head of a view of the engine's (contiguous) caches (a copy of a strided one)
        k, v = (
            c.reshape(-1, head_dim).index_select(0, g.kv_rows).view(num_kv_heads * n, L, head_dim)
            for c in (k_cache, v_cache)
        )
        k = k.float()  # (Hkv * n, L, D)
        qg = q[g.rows].view(n, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads * n, group, head_dim)
        scores = torch.bmm(qg.float(), k.transpose(1, 2)).view(num_kv_heads, n, group, L)  # (Hkv, n, G, L) fp32
        probs = (scores * scale + g.bias).softmax(-1).to(q.dtype).view(num_kv_heads * n, group, L)
        o = torch.bmm(probs, v).view(num_kv_heads, n, group, head_dim)  # (Hkv, n, G, D)
        out[g.rows] = o.transpose(0, 1).reshape(n, num_heads, head_dim)
    if plan.prefill and _prefill_attention_cpu_amx(q, k_cache, v_cache, plan.amx, scale, out):
        return out
    if plan.prefill:  # as in the reference, with each sequence's keys a slice of the cache where they can be
        k_slots, v_slots = (c.reshape(-1, num_kv_heads, head_dim) for c in (k_cache, v_cache))  # (slots, Hkv, D)
    for p in plan.prefill:
        # its keys to a multiple of PREFILL_KEYS, within its own blocks: zeros that no query sees (causal)
        num_keys = min(-(-p.seq_len // PREFILL_KEYS) * PREFILL_KEYS, -(-p.seq_len // block_size) * block_size)
        if p.first_slot is None:  # blocks out of order: a copy of the whole blocks
            k, v = (
                _sequence_kv(c, block_tables[p.index][: -(-num_keys // block_size)].tolist(), num_keys)
                for c in (k_cache, v_cache)
            )
        else:  # the last block's own slots past the prompt (its next tokens' slots, written before they are read)
            k, v = (slots[p.first_slot : p.first_slot + num_keys] for slots in (k_slots, v_slots))
        if num_keys > p.seq_len:  # zeros: a freed block's old values may be inf or NaN, and 0 * NaN is NaN
            k[p.seq_len :], v[p.seq_len :] = 0, 0
        rows = slice(p.start, p.start + p.q_len)
        _attend(q[rows], k, v, scale, out[rows], p.seq_len - p.q_len)
    return out


def _prefill_attention_cpu_amx(q, k_cache, v_cache, amx, scale, out):
    """Every prefill row of the plan in one call of the AMX loops (_prefill_attention_amx), written to out;
    False (nothing written) where they do not run: no AMX plan, head_dim not a multiple of 32, strided caches."""
    num_heads, head_dim = q.shape[1:]
    if amx is None or head_dim % 32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    o = out if out.is_contiguous() else torch.empty_like(q)
    vt = torch.empty(amx.num_keys * k_cache.shape[2] * head_dim, dtype=torch.uint16)  # the loops' V^T tiles
    _amx_prefill_loops()(
        amx.query_keys * num_heads * head_dim,  # multiply-adds of q.k (and as many of p.v)
        q.contiguous().view(torch.uint32).numpy(),  # bf16 pairs
        *(c.view(torch.uint16).numpy() for c in (k_cache, v_cache)),
        amx.block_tables,
        amx.seqs,
        amx.key_jobs,
        amx.jobs,
        amx.job_ends,
        scale,
        _amx_tiles(),
        vt.numpy(),
        o.view(torch.uint16).numpy(),
        AMX_QUERIES,
    )
    if o is not out:
        for start, q_len in amx.seqs[:, :2].tolist():
            out[start : start + q_len] = o[start : start + q_len]
    return True


# A prefill's keys are padded to a multiple of this for SDPA: torch's CPU flash attention runs up to 2.2x
# faster at such key counts (kernels.md), and a causal row never sees the padding.
PREFILL_KEYS = 16


def _decode_loops(dtype):
    """The compiled decode loops for caches of this dtype, or None: numba not installed, switched
    off (USE_CPU_LOOPS), failed to compile (a warning says why), or a dtype they do not read
    (fp16: numba has no fp16 arithmetic on a CPU)."""
    if not USE_CPU_LOOPS or dtype not in LOOP_DTYPES:
        return None
    return _compile_loops(dtype)


@functools.cache
def _compile_loops(dtype):
    """The loops compiled for one cache dtype and tried once on a tiny batch, or None."""
    bits, shift = LOOP_DTYPES[dtype]
    q, cache = torch.zeros(1, 1, 1, dtype=dtype).view(bits), torch.zeros(1, 1, 1, 1, dtype=dtype).view(bits)
    probe = (
        q.numpy(),
        cache.numpy(),
        cache.numpy(),
        shift,
        1,
        np.zeros(1, np.int64),
        np.zeros((1, 1), np.int32),
        np.ones(1, np.int32),
        1.0,
        q.clone().numpy(),
    )
    return _compile(_decode_attention_loops, probe, "the compiled decode loops are off", "the CPU path uses torch ops")


def _numba():
    """numba, with this module's names that the loops read set for it to compile them; None if not installed."""
    try:
        import numba
    except ImportError:
        return None
    global prange, carray, prefetch, _as_f32, _as_u32
    prange = numba.prange  # read by the loops when numba compiles them: their outer loop runs in parallel
    carray = numba.carray  # an array over a data pointer (the C functions')
    prefetch = _prefetch_intrinsic()
    _as_f32, _as_u32 = _bit_cast_intrinsics()
    for helper in _LOOP_HELPERS:  # the helpers the loops call become numba functions too (inlined into the loops)
        if not hasattr(globals()[helper], "py_func"):
            globals()[helper] = numba.njit(inline="always")(globals()[helper])
    global BF16_DOT, _bf16_dot, _bf16_add_pair
    BF16_DOT = _bf16_dot_on_this_cpu()
    _bf16_dot, _bf16_add_pair = _bf16_dot_intrinsics()
    global AVX2_Q4_1, _q4_1_dot
    AVX2_Q4_1 = _numba_cpu_has("avx2", "fma")
    _q4_1_dot = _q4_1_dot_intrinsic()
    global AMX_PREFILL, _tile_config, _tile_load, _tile_store, _tile_dot, _tile_zero, _tile_release
    AMX_PREFILL = _amx_on_this_cpu()
    _tile_config, _tile_load, _tile_store, _tile_dot, _tile_zero, _tile_release = _amx_intrinsics()
    return numba


def _compile(loops, probe, what, fallback):
    """numba's compiled loops, tried once on the probe arguments; None (with a warning naming `what` went
    off and the `fallback`) if numba is not installed or cannot compile them."""
    numba = _numba()
    if numba is None:
        return None
    announce_compile(loops)
    try:
        # cache=True: compiled once per checkout (seconds), then loaded from __pycache__; reassoc lets the
        # dot products run in SIMD lanes (IEEE infinities and NaNs are kept); numpy's error model: 0/0 gives
        # NaN (a row whose every score is -inf, as in the reference), not an exception; nogil: other Python
        # threads (a server's event loop) run while the loops do, as they do during torch's ops
        compiled = numba.njit(
            parallel=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy", cache=True
        )(loops)
        compiled(*probe)
    except Exception as e:  # e.g. no writable cache folder, or a numba that cannot compile this
        warnings.warn(f"kernels: {what} ({type(e).__name__}: {e}); {fallback}")
        return None

    def run(work, *args):
        """work: the call's elements or multiply-adds; a small call runs on the calling thread alone."""
        threads = _loop_threads() if work >= LOOP_MIN_WORK else 1
        if getattr(_threads_set, "n", None) != threads:  # (numba's setter costs ~15 us a call inside a step)
            numba.set_num_threads(threads)  # per calling thread
            _threads_set.n = threads
        return compiled(*args)

    return run


# Below this much work (elements or multiply-adds: torch's own grain size) a loop runs on the calling thread.
# Waking numba's other threads costs ~20 us a call on an idle machine, and where another process holds one of
# their cores the call waits for that thread's turn (milliseconds); one decode row's norm or rotary takes ~1 us.
LOOP_MIN_WORK = 32768


_threads_set = threading.local()  # .n: the thread count this thread last gave numba


def _loop_threads():
    """The compiled loops' threads: torch's, as far as numba has them."""
    import numba

    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


def announce_compile(loops):
    """A first run compiles the loops (tens of seconds on a few cores, while the first step waits):
    say so once, unless numba's cache (__pycache__/kernels.<name>-<line>.*.nbi) already has them."""
    global _announced
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    if _announced or glob.glob(os.path.join(folder, f"{__name__}.{loops.__name__}-*.nbi")):
        return
    _announced = True
    message = (
        "nanobatch: compiling the CPU loops with numba, once per checkout "
        "(up to a minute on 2 cores; later runs load them from its cache)"
    )
    try:  # a line of its own above a progress bar that is showing (generate's), not glued to it
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)
    except ImportError:
        print(message, file=sys.stderr, flush=True)


_announced = False  # announce_compile has spoken
prange = range  # numba.prange once _compile has run; plain range if the loops run as Python
carray = None  # numba.carray once _compile has run


def _prefetch_nothing(array, index):
    """prefetch where the loops run as Python (a hint to the CPU that Python cannot give)."""


prefetch = _prefetch_nothing  # _prefetch_intrinsic() once _compile has run


def _element_pointer(context, builder, sig, args, k, index, kind):
    """For an intrinsic's code: a pointer to element `index` of its C-contiguous array argument k (counted over the
    array's memory), as a pointer to `kind` (a load or store through it says the element's alignment: LLVM would
    assume a vector's own, 64 bytes)."""
    data = context.make_array(sig.args[k])(context, builder, args[k]).data
    return builder.bitcast(builder.gep(data, [index]), kind.as_pointer())


@functools.cache
def _prefetch_intrinsic():
    """prefetch(array, index) as numba compiles it: the CPU starts loading the cache line of array's element
    `index` (counted over the array's memory, C order) without waiting for it: LLVM's prefetch instruction."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, array, index):
        def codegen(context, builder, signature, args):
            address = _element_pointer(context, builder, signature, args, 0, args[1], ir.IntType(8))
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]), "llvm.prefetch.p0i8"
            )
            builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, locality 3 (all levels), data
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch


def _numba_cpu_has(*features):
    """Whether numba compiles for this machine's CPU (its default) and that CPU has every one of these features
    (LLVM's names: "avx2", "avx512bf16", "amx-tile", ...)."""
    import numba
    from llvmlite import binding

    found = binding.get_host_cpu_features()
    return not numba.config.CPU_NAME and all(found.get(f) for f in features)


def _bf16_dot_on_this_cpu():
    """Whether numba compiles for this machine's CPU and that CPU has AVX512-BF16."""
    return _numba_cpu_has("avx512bf16")


@functools.cache
def _bf16_dot_intrinsics():
    """_bf16_dot and _bf16_add_pair as numba compiles them: on bf16 bits (uint16 arrays), where the CPU has
    AVX512-BF16 (BF16_DOT), LLVM's intrinsic for its dot-product instruction (vdpbf16ps: 16 fp32 lanes, each
    adding two bf16 products, exact in fp32), 32 elements at a time."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    class BFloat(ir.Type):  # LLVM's bfloat, which llvmlite has no class for
        def _to_string(self):
            return "bfloat"

        def __eq__(self, other):
            return isinstance(other, BFloat)

        def __hash__(self):
            return hash("bfloat")

    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    lanes, values = ir.VectorType(f32, 16), ir.VectorType(BFloat(), 32)  # 16 fp32 sums; 32 bf16 values
    on_this_cpu = _bf16_dot_on_this_cpu()

    def runs_on(array_type):
        return on_this_cpu and array_type.dtype == types.uint16

    def dpbf16ps(builder, acc, x, y):  # acc[l] + x[2l] * y[2l] + x[2l + 1] * y[2l + 1] for the 16 lanes l
        kind = ir.FunctionType(lanes, [lanes, values, values])
        return builder.call(
            cgutils.get_or_insert_function(builder.module, kind, "llvm.x86.avx512bf16.dpbf16ps.512"), [acc, x, y]
        )

    @intrinsic
    def dot(typingctx, a, i, b, j, n):
        """sum over e < n (a multiple of 32) of a[i + e] * b[j + e] in fp32, over the arrays' memory."""

        def codegen(context, builder, sig, args):
            if not runs_on(sig.args[0]):  # fp32 bits, or no AVX512-BF16: never called (BF16_DOT, shift)
                return f32(0.0)
            sums = cgutils.alloca_once_value(builder, ir.Constant(lanes, None))
            with cgutils.for_range_slice(builder, i64(0), args[4], i64(32)) as (e, _):
                x, y = (
                    builder.load(
                        _element_pointer(context, builder, sig, args, k, builder.add(args[k + 1], e), values), align=2
                    )
                    for k in (0, 2)
                )
                builder.store(dpbf16ps(builder, builder.load(sums), x, y), sums)
            reduce = ir.FunctionType(f32, [f32, lanes])
            reduce = cgutils.get_or_insert_function(builder.module, reduce, "llvm.vector.reduce.fadd.v16f32")
            return builder.call(reduce, [f32(-0.0), builder.load(sums)], fastmath=("reassoc",))

        return types.float32(a, types.intp, b, types.intp, types.intp), codegen  # (numba casts to these)

    @intrinsic
    def add_pair(typingctx, acc, at, p, r, v, i, j, n):
        """acc[at + e] += p * v[i + e] + r * v[j + e] for e < n (a multiple of 32), over the arrays' memory, with
        p and r rounded to bf16."""

        def codegen(context, builder, sig, args):
            if not runs_on(sig.args[4]):
                return context.get_dummy_value()
            at, p, r, i, j, n = args[1], args[2], args[3], args[5], args[6], args[7]  # (acc and v: by address())
            two = ir.Constant(ir.VectorType(f32, 2), None)
            two = builder.insert_element(builder.insert_element(two, p, i32(0)), r, i32(1))
            two = builder.bitcast(builder.fptrunc(two, ir.VectorType(BFloat(), 2)), i32)  # p and r rounded to bf16
            weights = builder.insert_element(ir.Constant(ir.VectorType(i32, 16), None), two, i32(0))
            weights = builder.shuffle_vector(weights, weights, ir.Constant(ir.VectorType(i32, 16), [0] * 16))
            weights = builder.bitcast(weights, values)  # p, r, p, r, ...
            halves = ir.VectorType(ir.IntType(16), 32)
            with cgutils.for_range_slice(builder, i64(0), n, i64(32)) as (e, _):
                rows = [
                    builder.load(
                        _element_pointer(context, builder, sig, args, 4, builder.add(start, e), halves), align=2
                    )
                    for start in (i, j)
                ]
                for half in (0, 16):  # v[i + d], v[j + d] side by side for 16 d at a time: p * one + r * other
                    side_by_side = [x for d in range(half, half + 16) for x in (d, 32 + d)]
                    pair = builder.shuffle_vector(rows[0], rows[1], ir.Constant(ir.VectorType(i32, 32), side_by_side))
                    out = _element_pointer(
                        context, builder, sig, args, 0, builder.add(at, builder.add(e, i64(half))), lanes
                    )
                    sums = dpbf16ps(builder, builder.load(out, align=4), weights, builder.bitcast(pair, values))
                    builder.store(sums, out, align=4)
            return context.get_dummy_value()

        return types.void(acc, types.intp, types.float32, types.float32, v, *[types.intp] * 3), codegen

    return dot, add_pair


@functools.cache
def _bit_cast_intrinsics():
    """_as_f32 and _as_u32 as numba compiles them: LLVM's bitcast between a uint32 and an fp32 (no
    instruction at all), so that a loop widens, rounds and narrows bf16 values in registers."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def as_f32(typingctx, bits):
        return types.float32(types.uint32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())

    @intrinsic
    def as_u32(typingctx, value):
        return types.uint32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(32))

    return as_f32, as_u32


@functools.cache
def _q4_1_dot_intrinsic():
    """_q4_1_dot(nibbles, i, d, m, j, x, k, scales, sums, l, blocks, rows) as numba compiles it, with AVX2's integer
    products: for each of `rows` (a constant) rows r of int16 activations x (at x[k + 32 blocks r], their scales and
    sums at scales[l + blocks r] and sums[..]), the sum over blocks b of d[j + b] * scales[.. + b] * (q . x) +
    m[j + b] * sums[.. + b] (d and m fp16 bits), q block b's 32 weights (the 16 bytes at nibbles[i + 16 b], low
    nibbles its weights 0-15, high ones 16-31, as a GGUF's Q4_1 block) and x the row's 32 activations of that
    block -> a tuple of `rows` fp32 sums. Each block's weights are unpacked once for all the rows; q . x is two
    vpmaddwd (16-bit products, summed in pairs into 8 int32 lanes: exact); eight blocks' sums are then gathered into
    one vector, a lane a block, and go to fp32 lanes times their scales (FMA), the last blocks one at a time. Only
    where AVX2_Q4_1 (else never called: zeros)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i16, i32, i64, f32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    lanes, halves, nibbles = ir.VectorType(f32, 8), ir.VectorType(i16, 16), ir.VectorType(ir.IntType(8), 16)

    def function(builder, name, result, arguments):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, arguments), name)

    @intrinsic
    def dot(typingctx, q, i, d, m, j, x, k, scales, sums, l, blocks, rows):
        if not isinstance(rows, types.IntegerLiteral):
            return None
        count = rows.literal_value

        def codegen(context, builder, sig, args):
            def element(a, index, kind):  # a pointer to element `index` of array argument a
                return _element_pointer(context, builder, sig, args, a, index, kind)

            if not AVX2_Q4_1:  # (no x86 instruction for another CPU's compiler to meet)
                return context.make_tuple(builder, sig.return_type, [f32(0.0)] * count)
            i, j, k, l, blocks = args[1], args[4], args[6], args[9], args[10]
            acc = [cgutils.alloca_once_value(builder, ir.Constant(lanes, None)) for _ in range(count)]
            pmaddwd = function(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(i32, 8), [halves, halves])
            fma = function(builder, "llvm.fma.v8f32", lanes, [lanes] * 3)
            i32s = lambda *values: ir.Constant(ir.VectorType(i32, len(values)), list(values))  # noqa: E731

            def products(b):  # block b's q . x for each row: 8 int32 lanes whose sum it is
                packed = builder.load(element(0, builder.add(i, builder.mul(b, i64(16))), nibbles), align=1)
                packed = builder.zext(packed, halves)  # a byte a lane: its low nibble, its high one
                low = builder.and_(packed, ir.Constant(halves, [15] * 16))  # weights 0-15
                high = builder.lshr(packed, ir.Constant(halves, [4] * 16))  # weights 16-31
                rows = []
                for r in range(count):
                    at = builder.add(k, builder.mul(builder.add(builder.mul(blocks, i64(r)), b), i64(32)))
                    pair = [
                        builder.call(pmaddwd, [w, builder.load(element(5, start, halves), align=2)])
                        for w, start in ((low, at), (high, builder.add(at, i64(16))))
                    ]
                    rows.append(builder.add(*pair))
                return rows

            def load(a, index, n, kind):  # n elements of array argument a from index: fp16 bits widened (F16C)
                v = builder.load(element(a, index, ir.VectorType(i16 if kind == "fp16" else f32, n)), align=2)
                return (
                    builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), n)), ir.VectorType(f32, n))
                    if kind == "fp16"
                    else v
                )

            def add_blocks(r, b, n, total):  # acc[r] += total * d * scale + m * sum of blocks b .. b + n - 1
                row = builder.add(l, builder.add(builder.mul(blocks, i64(r)), b))
                d, m = load(2, builder.add(j, b), n, "fp16"), load(3, builder.add(j, b), n, "fp16")
                scale, total_x = load(7, row, n, "fp32"), load(8, row, n, "fp32")
                if n == 1:  # one block: its scale in every lane, its m * sum(x) in lane 0
                    d, m, scale, total_x = (
                        builder.shuffle_vector(v, v, i32s(*[0] * 8)) for v in (d, m, scale, total_x)
                    )
                    m = builder.insert_element(ir.Constant(lanes, 0.0), builder.extract_element(m, i32(0)), i32(0))
                total = builder.call(fma, [builder.sitofp(total, lanes), builder.fmul(d, scale), builder.load(acc[r])])
                builder.store(builder.call(fma, [m, total_x, total]), acc[r])

            def pairs(a, b):  # (a0+a1, a2+a3, b0+b1, b2+b3 | the same of lanes 4-7), as vphaddd
                even, odd = i32s(0, 2, 8, 10, 4, 6, 12, 14), i32s(1, 3, 9, 11, 5, 7, 13, 15)
                return builder.add(builder.shuffle_vector(a, b, even), builder.shuffle_vector(a, b, odd))

            # eight blocks at a time: their sums gathered into one vector (a lane a block: exact, |q . x| < 2 ** 24)
            with cgutils.for_range(builder, builder.udiv(blocks, i64(8))) as loop:
                b = builder.mul(loop.index, i64(8))
                p = list(zip(*[products(builder.add(b, i64(t))) for t in range(8)]))  # p[r]: 8 blocks' lanes
                for r in range(count):
                    h = [pairs(p[r][t], p[r][t + 1]) for t in range(0, 8, 2)]
                    h = [pairs(h[0], h[1]), pairs(h[2], h[3])]  # (each: 4 blocks' lanes 0-3 | their lanes 4-7)
                    low, high = (
                        builder.shuffle_vector(*h, o)
                        for o in (i32s(0, 1, 2, 3, 8, 9, 10, 11), i32s(4, 5, 6, 7, 12, 13, 14, 15))
                    )
                    add_blocks(r, b, 8, builder.add(low, high))
            with cgutils.for_range(builder, blocks, start=builder.mul(builder.udiv(blocks, i64(8)), i64(8))) as loop:
                for r, total in enumerate(products(loop.index)):  # the last blocks one at a time
                    add_blocks(r, loop.index, 1, total)
            reduce = function(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, lanes])
            totals = [builder.call(reduce, [f32(-0.0), builder.load(s)], fastmath=("reassoc",)) for s in acc]
            return context.make_tuple(builder, sig.return_type, totals)

        arguments = (q, types.intp, d, m, types.intp, x, types.intp, scales, sums, types.intp, types.intp, rows)
        return types.UniTuple(types.float32, count)(*arguments), codegen

    return dot


AVX2_Q4_1 = False  # whether the Q4_1 loops run on this CPU (_q4_1_dot_intrinsic): set by _numba()
_q4_1_dot = None


# Plain functions until _compile makes them numba functions. They must stay in this file: numba's
# cache (cache=True) notices a change to this file, not to another one.
_LOOP_HELPERS = (
    "_widen",
    "_load",
    "_round_as",
    "_to",
    "_widened",
    "_bf16",
    "_narrow",
    "_round",
    "_exp",
    "_block_softmax",
    "_write_heads",
    "_rotate_head",
    "_rms_norm_row",
    "_rotary_token",
    "_silu_and_mul_row",
)


# 2**f for f in [0, 1): a degree-5 polynomial (least squares at Chebyshev nodes, relative error 1e-7,
# about fp32's rounding), lowest power first. The loops' exp is built on it: a libm call per score does not
# run in SIMD lanes.
EXP2_POLY = (
    0.9999998957631347,
    0.693154620003295,
    0.24014077009186627,
    0.05586328265919315,
    0.008946214666375036,
    0.0018951072910012572,
)
LOG2_E = 1.4426950408889634
_EXP2_POLY32 = tuple(np.float32(c) for c in EXP2_POLY)  # (numba reads a global tuple as constants)


def _decode_attention_loops(q, k, v, shift, parts, rows, block_tables, seq_lens, scale, out):
    """Decode attention as plain loops (numba compiles them): each sequence's one query row
    against its keys and values, read in place from the paged cache, once, with an online
    softmax over cache blocks (as the Triton kernel does over key tiles: a running max, and
    the sums rescaled when a block raises it).
    - q (T, H, D), k, v (num_blocks, block_size, Hkv, D): the tensors' bits as C-contiguous numpy
      arrays (t.view(torch.uint16) for bf16, widened to fp32 by shift 16: bf16 is the top half of an
      fp32; t.view(torch.uint32) for fp32, shift 0). Sequence i's one query row is q[rows[i]]; query
      head j reads kv head j // (H // Hkv).
    - parts: a job per sequence (all its kv heads: each block of its cache is one contiguous read, which
      memory streams fastest), or, with parts > 1, a job per run of its blocks (jobs for every thread
      when there are fewer sequences than threads: split-K, as the Triton kernel's segments); the runs'
      softmax sums are merged after, each rescaled to the largest of their maxima.
    - block_tables (n, max_blocks) int32: only the first ceil(seq_len / block_size) ids of a row are
      read, and must be valid (numba checks no bounds); seq_lens (n,) int32, each >= 1.
    - scale multiplies q.k (head_dim ** -0.5); out (T, H, D), q's bits: row rows[i] is overwritten
      (rounded to bf16, to nearest even, for shift 16).
    Compiled by _compile (numba.njit(parallel=True, fastmath reassoc and contract)); it reads prange,
    EXP2_POLY and LOG2_E from this module. Two ways through a block: on a CPU with AVX512-BF16, bf16 bits
    and head_dim a multiple of 32, its dot-product instruction takes q.k and p.v straight from the bits
    (_bf16_dot_intrinsics; the weights p rounded to bf16, as torch's CPU flash attention and the Triton
    kernel round them); else the block is widened to fp32 rows first, and every inner loop runs over them
    with no call in it, so LLVM gives it SIMD lanes."""
    n, num_heads, head_dim = len(rows), q.shape[1], q.shape[2]
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    bf16_dot = BF16_DOT and shift == 16 and head_dim % 32 == 0
    key_stride = num_kv_heads * head_dim  # between one key's (or value's) row and the next, in the cache
    # the parts' running max, sum and accumulator of each query head, merged after the jobs (where parts > 1)
    part_best = np.empty((n * parts if parts > 1 else 0, num_heads), np.float32)
    part_total = np.empty_like(part_best)
    part_acc = np.empty((len(part_best), num_heads, head_dim), np.float32)
    for job in prange(n * parts):  # job: sequence i's run `part` of its blocks
        i, part = job // parts, job % parts
        q_bits = np.empty((num_heads, head_dim), np.uint32)
        qh = q_bits.view(np.float32)  # the sequence's query heads, widened, then scaled
        for g in range(num_heads):
            for d in range(head_dim):
                q_bits[g, d] = np.uint32(q[rows[i], g, d]) << shift
            for d in range(head_dim):
                qh[g, d] *= np.float32(scale)
        key_bits = np.empty((block_size, num_kv_heads, head_dim), np.uint32)
        value_bits = np.empty((block_size, num_kv_heads, head_dim), np.uint32)
        keys, values = (
            key_bits.view(np.float32),
            value_bits.view(np.float32),
        )  # one block of its kv heads, widened
        weights = np.empty((group, block_size), np.float32)  # the block's scores, then exp(score - best)
        pow2 = np.empty(block_size, np.float32)  # (_block_softmax's scratch)
        best = np.full(num_heads, -np.inf, np.float32)  # the running max score of each query head
        total = np.zeros(num_heads, np.float32)  # sum of exp(score - best)
        acc = np.zeros((num_heads, head_dim), np.float32)  # sum of exp(score - best) * value
        num_blocks = (seq_lens[i] + block_size - 1) // block_size
        for b in range(part * num_blocks // parts, (part + 1) * num_blocks // parts):
            block, num = block_tables[i, b], min(block_size, seq_lens[i] - b * block_size)
            # where the next block's rows start: fetched while this one is computed (the PV loop below asks
            # for one key's lines at a time; asked for all at once here, the fetches crowd out this block's)
            ahead = b + 1 < (part + 1) * num_blocks // parts
            next_rows = block_tables[i, b + 1 if ahead else b] * block_size * num_kv_heads
            if not bf16_dot:
                for t in range(num):
                    for h in range(num_kv_heads):
                        if shift == 16:  # a loop per shift: with the shift a constant, LLVM widens 16 lanes at a time
                            for d in range(head_dim):
                                key_bits[t, h, d] = np.uint32(k[block, t, h, d]) << 16
                            for d in range(head_dim):
                                value_bits[t, h, d] = np.uint32(v[block, t, h, d]) << 16
                        else:  # fp32 caches: shift 0 (LOOP_DTYPES has no other)
                            for d in range(head_dim):
                                key_bits[t, h, d] = np.uint32(k[block, t, h, d])
                            for d in range(head_dim):
                                value_bits[t, h, d] = np.uint32(v[block, t, h, d])
            for h in range(num_kv_heads):
                row = (block * block_size * num_kv_heads + h) * head_dim  # key t's: row + t * key_stride
                for g in range(group):
                    qi = h * group + g  # the query head
                    if bf16_dot:
                        query = (rows[i] * num_heads + qi) * head_dim
                        for t in range(num):
                            weights[g, t] = _bf16_dot(q, query, k, row + t * key_stride, head_dim) * np.float32(scale)
                    else:
                        for t in range(num):
                            score = np.float32(0.0)
                            for d in range(head_dim):
                                score += qh[qi, d] * keys[t, h, d]
                            weights[g, t] = score
                    _block_softmax(weights, g, num, best, total, acc, qi, pow2)
                keys_per_pass = 2 if bf16_dot else 1  # (AVX512-BF16 adds two keys' products at once)
                for t in range(
                    0, num, keys_per_pass
                ):  # keys outer: the group's accumulator rows are independent chains
                    if ahead:
                        for key in range(t, t + keys_per_pass):
                            for line in range(0, head_dim, 64 // k.itemsize):  # a 64-byte cache line at a time
                                prefetch(k, (next_rows + key * num_kv_heads + h) * head_dim + line)
                                prefetch(v, (next_rows + key * num_kv_heads + h) * head_dim + line)
                    if not bf16_dot:
                        for g in range(group):
                            for d in range(head_dim):
                                acc[h * group + g, d] += weights[g, t] * values[t, h, d]
                        continue
                    u = min(t + 1, num - 1)  # an odd last key goes with itself, at weight 0
                    for g in range(group):
                        other = weights[g, u] if u > t else np.float32(0.0)
                        at = (h * group + g) * head_dim
                        _bf16_add_pair(
                            acc, at, weights[g, t], other, v, row + t * key_stride, row + u * key_stride, head_dim
                        )
        if parts > 1:  # (merged below)
            part_best[job, :], part_total[job, :], part_acc[job, :, :] = best, total, acc
            continue
        _write_heads(acc, total, q_bits, shift, out, rows[i])
    for job in range(0, len(part_best), parts):  # each sequence's runs merged, in order
        i = job // parts
        acc, total = part_acc[job], part_total[job]
        for other in range(job + 1, job + parts):
            for g in range(num_heads):
                best = max(part_best[job, g], part_best[other, g])
                if best == -np.inf:  # (no key of either part has a finite score yet)
                    continue
                mine, theirs = math.exp(part_best[job, g] - best), math.exp(part_best[other, g] - best)
                total[g] = total[g] * mine + part_total[other, g] * theirs
                for d in range(head_dim):
                    acc[g, d] = acc[g, d] * mine + part_acc[other, g, d] * theirs
                part_best[job, g] = best
        q_bits = np.empty((num_heads, head_dim), np.uint32)
        _write_heads(acc, total, q_bits, shift, out, rows[i])


def _write_heads(acc, total, bits, shift, out, row):
    """The decode loops' last step: acc / total of each query head, as the cache's bits (rounded to bf16, to nearest
    even, for shift 16), into out[row]; bits: (heads, head_dim) uint32 scratch."""
    values = bits.view(np.float32)
    for g in range(acc.shape[0]):
        for d in range(acc.shape[1]):
            values[g, d] = acc[g, d] / total[g]
        if shift == 16:
            _round(bits[g])
        for d in range(acc.shape[1]):
            out[row, g, d] = bits[g, d] >> shift


def _block_softmax(weights, g, num, best, total, acc, qi, pow2):
    """One block's num scores of query head qi (weights[g]) -> exp(score - best), best the running max score:
    the online softmax's step. What was summed so far (total[qi], acc[qi]) is rescaled where the block raises
    it. exp(score - best) = 2**y with y <= 0: 2**whole from the exponent bits (0 below 2**-126, made in
    pow2), 2**frac from EXP2_POLY (a libm call per score does not run in SIMD lanes). (Indices, not slices or
    views: a new array costs a reference count, two atomic operations, each call.)"""
    new_best = best[qi]
    for t in range(num):
        new_best = max(new_best, weights[g, t])
    if new_best == -np.inf:  # every score so far is -inf: nothing to weigh (exp(-inf - -inf) is NaN)
        for t in range(num):
            weights[g, t] = 0.0
        return
    rescale = np.float32(1.0)
    if new_best > best[qi]:  # what was summed so far, at the new max
        rescale = np.float32(math.exp(best[qi] - new_best))
        best[qi] = new_best
        for d in range(acc.shape[1]):
            acc[qi, d] *= rescale
    c0, c1, c2, c3, c4, c5 = _EXP2_POLY32
    for t in range(num):
        y = max((weights[g, t] - new_best) * np.float32(LOG2_E), np.float32(-127.0))
        whole = np.floor(y)
        frac = y - whole
        weights[g, t] = c0 + frac * (c1 + frac * (c2 + frac * (c3 + frac * (c4 + frac * c5))))
        pow2[t] = _as_f32(np.uint32(np.int32(whole) + 127) << 23)  # 2**whole, from the exponent bits
    block_total = np.float32(0.0)
    for t in range(num):
        weights[g, t] *= pow2[t]
        block_total += weights[g, t]
    total[qi] = total[qi] * rescale + block_total


BF16_DOT = False  # whether the loops use AVX512-BF16's instruction (_bf16_dot_intrinsics): set by _numba()
_bf16_dot = _bf16_add_pair = None


# ---- The CPU path: prefill attention on AMX's tiles ----
# Intel's AMX (Sapphire Rapids on) multiplies 16 x 32 bf16 tiles into 16 x 16 fp32 ones in one instruction
# (tdpbf16ps), as oneDNN's matmuls here do. Where numba compiles for such a CPU, every prefill row of a step
# goes through one call of these loops instead of a torch SDPA call per sequence: flash attention over 32 queries
# and 32 keys at a time, the scores and the accumulator in fp32, the weights rounded to bf16 (as torch's CPU flash
# attention rounds them). The tiles are transposed against the usual way round, S^T = K . Q^T and
# O^T += V^T . P^T, so that K is read from the cache as it lies (16 keys of one block are a tile's 16 rows) and the
# online softmax runs with the 32 queries as SIMD lanes, no horizontal sums.

AMX_ROWS = 16  # a tile's rows: 16 keys of one cache block (block sizes a multiple of it), or 16 queries' columns
AMX_LAZY_RESCALE = 8.0  # a score may pass the reference its weight is taken against (the max of the blocks
# before) by this much before the reference moves up to it: weights up to e**8 (bf16 keeps its relative precision
# at any size), and the rescale of everything summed so far is rare after the first blocks
AMX_QUERIES = 32  # queries a job: two tiles' columns, the softmax's SIMD lanes. Passed to the loops at run time:
# with a constant trip count LLVM unrolls their lane loops into scalar code instead of vectorising them


def _prefill_attention_amx(q, k, v, block_tables, seqs, key_jobs, jobs, job_ends, scale, tiles, vt, out, lanes):
    """Causal attention of every prefill row of a step (AmxPrefill's sequences) on AMX tiles.
    - q (T, H, D / 2) uint32: the queries' bf16 pairs; k, v (num_blocks, block_size, Hkv, D) uint16: the caches'
      bits (block_size a multiple of 16; head_dim D a multiple of 32); out (T, H, D) uint16: the sequences' rows
      written (rounded to bf16, to nearest even).
    - seqs (n, 4): first q row, q rows, keys, first key in vt; block_tables (n, max_blocks) int32.
    - Phase 1 (key_jobs): V^T tiles into vt, 32 keys x 16 dims each (zeros past a sequence's last key: a freed
      slot's old values may be NaN, and 0 * NaN is NaN). Phase 2 (jobs, split per thread by job_ends): 32 queries
      of one query head against their keys, 32 at a time: S^T = K . Q^T in four tiles, the online softmax per query
      lane, O^T += V^T . P^T into the fp32 accumulator (read into a tile, added to, stored back).
    tiles: the 64-byte tile configuration (_amx_tiles: every tile 16 rows of 64 bytes); lanes: AMX_QUERIES (32:
    the tiles hold two 16-query halves)."""
    num_heads, head_dim = q.shape[1], q.shape[2] * 2
    block_size, num_kv_heads = v.shape[1], v.shape[2]
    group, chunks, dim_tiles = num_heads // num_kv_heads, head_dim // 32, head_dim // 16
    scale = np.float32(scale)
    key_stride = num_kv_heads * head_dim * 2  # bytes from one key's row to the next in the cache
    for job in prange(key_jobs.shape[0]):
        i, h, b = key_jobs[job, 0], key_jobs[job, 1], key_jobs[job, 2]
        at = ((seqs[i, 3] // 32 + b) * num_kv_heads + h) * dim_tiles * 512  # tile (b, h, d // 16): 16 rows of 32 keys
        for half in range(2):  # 16 keys at a time: they lie in one block
            pos = b * 32 + half * 16
            n = min(16, seqs[i, 2] - pos)  # of them in the sequence
            block, first_row = block_tables[i, pos // block_size] if n > 0 else 0, pos % block_size
            for d in range(head_dim):  # (a row of 16 keys written at once; the values read down the block)
                for key in range(16):
                    vt[at + d * 32 + half * 16 + key] = v[block, first_row + key, h, d] if key < n else 0
    row = lanes * 4  # bytes from one row of the lane arrays to the next: a tile's row stride in them
    for t in prange(len(job_ends) - 1):
        _tile_config(tiles)
        q_t = np.empty((chunks, 16, lanes), np.uint32)  # Q^T: (dim pair, query), a bf16 pair each
        s_t = np.empty((32, lanes), np.float32)  # S^T: 32 keys x the queries, from four tiles
        p_t = np.empty((16, lanes), np.uint32)  # P^T: (key pair, query), the weights of two keys as bf16
        acc = np.empty((head_dim, lanes), np.float32)  # O^T: sum of weight x value, per query
        o_t = np.empty((head_dim, lanes), np.int16)  # O^T rounded to bf16
        ref, total = np.empty(lanes, np.float32), np.empty(lanes, np.float32)  # weights are exp(score - ref); their sum
        top, block_total = np.empty(lanes, np.float32), np.empty(lanes, np.float32)  # a block's max score; its weights'
        rescale = np.empty(lanes, np.float32)
        for job in range(job_ends[t], job_ends[t + 1]):
            i, h, tile = jobs[job, 0], jobs[job, 1], jobs[job, 2]
            start, q_len, seq_len, vt_first = seqs[i, 0], seqs[i, 1], seqs[i, 2], seqs[i, 3]
            first, rows = seq_len - q_len + tile * lanes, min(lanes, q_len - tile * lanes)  # query r at first + r
            for g in range(group):
                qh = h * group + g
                for c in range(chunks):  # (a short job repeats its last query: lanes never written out)
                    for pair in range(16):
                        for r in range(lanes):
                            q_t[c, pair, r] = q[start + tile * lanes + min(r, rows - 1), qh, c * 16 + pair]
                for r in range(lanes):
                    total[r] = 0.0
                for b in range((first + rows - 1) // 32 + 1):  # blocks of 32 keys up to the job's last query
                    second = b * 32 + 16 < seq_len  # the block's second 16 keys exist
                    _tile_zero(0)
                    _tile_zero(1)
                    _tile_zero(2)
                    _tile_zero(3)
                    # where keys b * 32 and b * 32 + 16 start in the cache (16 keys lie in one block)
                    at0 = (block_tables[i, b * 32 // block_size] * block_size + b * 32 % block_size) * num_kv_heads + h
                    pos = min(b * 32 + 16, seq_len - 1)
                    at1 = (block_tables[i, pos // block_size] * block_size + pos % block_size) * num_kv_heads + h
                    for c in range(chunks):  # tiles: 0-3 S^T (keys 0-15 / 16-31 x queries 0-15 / 16-31), 4-5 K, 6-7 Q^T
                        _tile_load(6, q_t, c * 16 * lanes, row)
                        _tile_load(7, q_t, c * 16 * lanes + 16, row)
                        _tile_load(4, k, at0 * head_dim + c * 32, key_stride)  # 16 keys' 32 dims
                        _tile_dot(0, 4, 6)
                        _tile_dot(2, 4, 7)
                        if second:
                            _tile_load(5, k, at1 * head_dim + c * 32, key_stride)
                            _tile_dot(1, 5, 6)
                            _tile_dot(3, 5, 7)
                    _tile_store(0, s_t, 0, row)
                    _tile_store(2, s_t, 16, row)
                    _tile_store(1, s_t, 16 * lanes, row)
                    _tile_store(3, s_t, 16 * lanes + 16, row)
                    if b * 32 + 31 > first:  # on the diagonal: key j is seen by the queries at or after it
                        for j in range(32):
                            for r in range(lanes):
                                s_t[j, r] = s_t[j, r] if first + r >= b * 32 + j else -np.inf
                    if b == 0:  # the first block's max: the reference the weights are taken against
                        for r in range(lanes):
                            top[r] = -np.inf
                        for j in range(32):
                            for r in range(lanes):
                                top[r] = max(top[r], s_t[j, r])
                        for r in range(lanes):
                            ref[r] = top[r] * scale  # (finite: every query sees key 0)
                    for attempt in range(2):  # weights exp(score - ref); again if a score passed ref by too much
                        for r in range(lanes):
                            top[r], block_total[r] = -np.inf, 0.0
                        for pair in range(16):
                            for r in range(lanes):
                                s0, s1 = s_t[2 * pair, r], s_t[2 * pair + 1, r]
                                w0, w1 = _exp(s0 * scale - ref[r]), _exp(s1 * scale - ref[r])
                                top[r] = max(top[r], max(s0, s1))
                                block_total[r] += w0 + w1
                                p_t[pair, r] = np.uint32(np.uint16(_narrow(_bf16(w0)))) | (
                                    np.uint32(np.uint16(_narrow(_bf16(w1)))) << 16
                                )
                        moved = False
                        for r in range(lanes):
                            moved |= top[r] * scale > ref[r] + np.float32(AMX_LAZY_RESCALE)
                        if not moved:
                            break
                        for r in range(lanes):  # ref up to the block's max, and what was summed so far rescaled
                            new_ref = max(ref[r], top[r] * scale)
                            rescale[r] = _exp(ref[r] - new_ref)
                            ref[r], total[r] = new_ref, total[r] * rescale[r]
                        for d in range(head_dim):
                            for r in range(lanes):
                                acc[d, r] *= rescale[r]
                    for r in range(lanes):
                        total[r] += block_total[r]
                    _tile_load(6, p_t, 0, row)  # tiles: 0-1 O^T (queries 0-15 / 16-31), 5 V^T, 6-7 P^T
                    _tile_load(7, p_t, 16, row)
                    at = ((vt_first // 32 + b) * num_kv_heads + h) * dim_tiles * 512
                    for dt in range(dim_tiles):
                        _tile_load(5, vt, at + dt * 512, 64)
                        if b == 0:
                            _tile_zero(0)
                            _tile_zero(1)
                        else:
                            _tile_load(0, acc, dt * 16 * lanes, row)
                            _tile_load(1, acc, dt * 16 * lanes + 16, row)
                        _tile_dot(0, 5, 6)
                        _tile_dot(1, 5, 7)
                        _tile_store(0, acc, dt * 16 * lanes, row)
                        _tile_store(1, acc, dt * 16 * lanes + 16, row)
                for r in range(lanes):
                    rescale[r] = np.float32(1.0) / total[r]
                for d in range(head_dim):  # rounded with the queries as lanes, then turned into the output's rows
                    for r in range(lanes):
                        o_t[d, r] = _narrow(_bf16(acc[d, r] * rescale[r]))
                for r in range(rows):
                    for d in range(head_dim):
                        out[start + tile * lanes + r, qh, d] = o_t[d, r]
        _tile_release()


def _amx_prefill_plan(prefill, block_tables, num_kv_heads):
    """AmxPrefill for a step's prefill sequences: its jobs (AMX_QUERIES queries each) dealt to the loops' threads,
    longest first, each to the thread with the least work so far (a job's work: the keys its queries read)."""
    firsts, total = [], 0
    for p in prefill:
        firsts.append(total)
        total += -(-p.seq_len // 32) * 32
    seqs = np.array([[p.start, p.q_len, p.seq_len, f] for p, f in zip(prefill, firsts)], np.int64)
    key_jobs = [
        (i, h, b) for i, p in enumerate(prefill) for h in range(num_kv_heads) for b in range(-(-p.seq_len // 32))
    ]
    work = []
    for i, p in enumerate(prefill):
        for tile in range(-(-p.q_len // AMX_QUERIES)):
            keys = p.seq_len - p.q_len + min(p.q_len, (tile + 1) * AMX_QUERIES)
            work += [(keys, i, h, tile) for h in range(num_kv_heads)]
    threads = _loop_threads()
    lists, loads = [[] for _ in range(threads)], [0] * threads
    for keys, i, h, tile in sorted(work, reverse=True):
        t = loads.index(min(loads))
        lists[t].append((i, h, tile))
        loads[t] += keys
    return AmxPrefill(
        seqs,
        block_tables[[p.index for p in prefill]].numpy(),
        np.array(key_jobs, np.int64).reshape(-1, 3),
        np.array([job for jobs in lists for job in jobs], np.int64).reshape(-1, 3),
        np.cumsum([0] + [len(jobs) for jobs in lists]).astype(np.int64),
        total,
        sum(p.q_len * (2 * p.seq_len - p.q_len + 1) // 2 for p in prefill),
    )


@functools.cache
def _amx_tiles():
    """AMX's tile configuration (ldtilecfg's 64 bytes): palette 1, each of the 8 tiles 16 rows of 64 bytes."""
    tiles = np.zeros(64, np.uint8)
    tiles[0] = 1
    tiles[16:32].view(np.uint16)[:] = 64
    tiles[48:56] = 16
    return tiles


@functools.cache
def _amx_prefill_loops():
    """The AMX prefill loops compiled and tried on a tiny prefill, or None: numba missing, a CPU without AMX
    (AMX_PREFILL), or a failure (a warning says which)."""
    numba = _numba() if USE_CPU_LOOPS else None
    if numba is None or not AMX_PREFILL:
        return None
    q, cache = np.zeros((2, 1, 16), np.uint32), np.zeros((1, 16, 1, 32), np.uint16)
    seqs, jobs = np.array([[0, 2, 2, 0]], np.int64), np.zeros((1, 3), np.int64)
    probe = (q, cache, cache, np.zeros((1, 1), np.int32), seqs, jobs, jobs, np.array([0, 1], np.int64), 1.0)
    probe += (_amx_tiles(), np.zeros(32 * 32, np.uint16), np.zeros((2, 1, 32), np.uint16), AMX_QUERIES)
    return _compile(_prefill_attention_amx, probe, "the AMX prefill loops are off", "prefill attention uses SDPA")


AMX_PREFILL = False  # whether numba compiles for this CPU and it has AMX with bf16 (and Linux lets us use it)
_tile_config = _tile_load = _tile_store = _tile_dot = _tile_zero = _tile_release = None


def _amx_on_this_cpu():
    """Whether numba compiles for this machine's CPU, that CPU has AMX's tiles and bf16 products, and Linux
    grants this process the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM; oneDNN asks the same)."""
    if not _numba_cpu_has("amx-tile", "amx-bf16"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, XTILEDATA
    except (OSError, AttributeError):
        return False


@functools.cache
def _amx_intrinsics():
    """AMX's instructions as numba compiles them (LLVM's intrinsics; a tile is named by its number, 0-7, a
    constant): config(tiles), load(tile, array, index, stride) and store(tile, array, index, stride) (16 rows
    of 64 bytes from element `index` of the array's memory, rows `stride` bytes apart), dot(c, a, b) (tile c +=
    a . b: a's rows of 32 bf16 by b's rows of 16 bf16 pairs, tdpbf16ps), zero(tile) and release()."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i64 = ir.IntType(8), ir.IntType(64)

    def call(builder, name, arg_types, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), arg_types), name)
        builder.call(fn, args)

    def tile(t):
        return i8(t.literal_value)

    @intrinsic
    def config(typingctx, tiles):
        def codegen(context, builder, sig, args):
            address = _element_pointer(context, builder, sig, args, 0, i64(0), i8)
            call(builder, "llvm.x86.ldtilecfg", [i8.as_pointer()], [address])
            return context.get_dummy_value()

        return types.void(tiles), codegen

    def load_or_store(name):
        @intrinsic
        def move(typingctx, t, array, index, stride):
            if not isinstance(t, types.IntegerLiteral):
                return None

            def codegen(context, builder, sig, args):
                address = _element_pointer(context, builder, sig, args, 1, args[2], i8)
                call(builder, name, [i8, i8.as_pointer(), i64], [tile(sig.args[0]), address, args[3]])
                return context.get_dummy_value()

            return types.void(t, array, types.int64, types.int64), codegen

        return move

    @intrinsic
    def dot(typingctx, c, a, b):
        if not all(isinstance(t, types.IntegerLiteral) for t in (c, a, b)):
            return None

        def codegen(context, builder, sig, args):
            call(builder, "llvm.x86.tdpbf16ps", [i8] * 3, [tile(t) for t in sig.args])
            return context.get_dummy_value()

        return types.void(c, a, b), codegen

    @intrinsic
    def zero(typingctx, t):
        if not isinstance(t, types.IntegerLiteral):
            return None

        def codegen(context, builder, sig, args):
            call(builder, "llvm.x86.tilezero", [i8], [tile(sig.args[0])])
            return context.get_dummy_value()

        return types.void(t), codegen

    @intrinsic
    def release(typingctx):
        def codegen(context, builder, sig, args):
            call(builder, "llvm.x86.tilerelease", [], [])
            return context.get_dummy_value()

        return types.void(), codegen

    return config, load_or_store("llvm.x86.tileloadd64"), load_or_store("llvm.x86.tilestored64"), dot, zero, release


# ---- The CPU path: greedy argmax over bf16 logits ----
# A greedy step's sampler is one argmax per row over the vocabulary (256 rows x 49152 bf16 is 25 MB).
# torch's argmax on bf16 is slow there; these loops compare the bf16 bits as 16-bit integers in SIMD
# lanes, in two passes that never branch per element.


def argmax_rows(logits):
    """The first index of each row's maximum, as torch.argmax gives it (a NaN counts as the maximum,
    -0.0 equals +0.0), for a CPU bf16 (rows, vocab) tensor -> (rows,) int64; None where the loops do
    not run (another device or dtype, numba not installed or USE_CPU_LOOPS off): the caller uses torch."""
    if not USE_CPU_LOOPS or logits.device.type != "cpu" or logits.dtype != torch.bfloat16 or logits.dim() != 2:
        return None
    loops = _compile_argmax()
    if loops is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    loops(logits.numel(), logits.contiguous().view(torch.int16).numpy(), out.numpy())
    return out


@functools.cache
def _compile_argmax():
    probe = (np.zeros((1, 3), np.int16), np.zeros(1, np.int64))
    return _compile(_argmax_loops, probe, "the compiled argmax is off", "the sampler uses torch ops")


def _argmax_loops(x, out):
    """x (rows, vocab) int16: bf16 bits (sign, then magnitude); out (rows,) int64.
    Pass 1: the largest and smallest bits, and whether a NaN (magnitude above inf's 0x7F80) is there.
    The best float is then the largest bits if any is >= 0 (a positive float; ordered like its bits),
    else the smallest (among negative floats, the smallest magnitude). Pass 2: the first index holding
    it, as a min over indices (no early exit: it runs in SIMD lanes)."""
    rows, vocab = x.shape
    for i in prange(rows):
        hi, lo, nan = np.int16(-32768), np.int16(32767), False
        for j in range(vocab):
            hi = max(hi, x[i, j])
            lo = min(lo, x[i, j])
            nan |= (x[i, j] & np.int16(0x7FFF)) > np.int16(0x7F80)
        first, none = np.int32(vocab), np.int32(vocab)
        if nan:  # argmax's best is the first NaN
            for j in range(vocab):
                first = min(first, np.int32(j) if (x[i, j] & np.int16(0x7FFF)) > np.int16(0x7F80) else none)
        else:
            best = hi if hi >= 0 else lo
            same = np.int16(-32768) if best == 0 else best  # +0.0's bits are 0, -0.0's are 0x8000: equal floats
            for j in range(vocab):
                first = min(first, np.int32(j) if (x[i, j] == best) | (x[i, j] == same) else none)
        out[i] = first


# ---- The CPU path: a decoder layer's small ops over bf16 (or fp32), as compiled loops ----
# Each torch op over a bf16 (tokens, hidden) tensor widens it to fp32, computes, rounds back and
# writes a whole new tensor: the residual add and HF's RMSNorm are 9 such ops, the rotary embedding
# of q and k and the K/V store 8, SwiGLU's silu(gate) * up 2 (and a whole tensor between them); a loop reads its
# inputs once and writes its results once.
# The loops round to bf16 where torch does (round to nearest even, NaN kept), so the residual add and
# the rotary embedding are torch's bit for bit (but for the sign and payload bits of a NaN); RMSNorm
# differs only where the sum of squares, added in another order, moves x across a rounding step
# (rarely; two ulps at most, after weight * x). Over fp32 (an fp32 model) the same loops round nothing:
# each op's one pass against torch's several, within a few fp32 ulps of them. Each returns None where it does
# not run (not CPU bf16 or fp32 tensors, numba not installed or USE_CPU_LOOPS off): the caller uses torch ops.


def rms_norm_cpu(x, weight, eps, residual=None):
    """weight * bf16(x * rsqrt(mean(x**2) + eps)), with x in fp32 as HF computes it. x (..., dim) bf16 (or fp32,
    no rounding). With residual (x's shape, contiguous): x + residual first, written into residual ->
    (normed, residual)."""
    if residual is not None and x.numel() < LOOP_MIN_WORK and _c_rows(x, residual, weight):
        one_thread = _rms_norm_c(x.dtype)  # a decode step's norms: one C call on the data pointers
        if one_thread is not None:
            out = torch.empty_like(x)
            rows, dim = x.shape
            one_thread(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, rows, dim, eps)
            return out, residual
    if not _loops_apply(x, weight, *([] if residual is None else [residual])) or weight.shape != x.shape[-1:]:
        return None
    if residual is not None and not (residual.shape == x.shape and residual.is_contiguous()):
        return None
    loops = _compile_elementwise(_rms_norm_loops)
    if loops is None:
        return None
    x2 = x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    r2 = x2[:0] if residual is None else residual.view(x2.shape)  # no rows: no add
    one_thread = _rms_norm_c(x.dtype) if x2.numel() < LOOP_MIN_WORK and weight.is_contiguous() else None
    if one_thread is not None:  # a few rows (Qwen3's q/k norms in a decode step): a C call on the data pointers
        one_thread(*(t.data_ptr() for t in (x2, r2, weight, out)), len(x2), len(r2), x2.shape[1], eps)
    else:
        loops(x2.numel(), *(_elements(t) for t in (x2, r2, weight, out)), eps)
    return out.view(x.shape) if residual is None else (out.view(x.shape), residual)


def _c_rows(x, residual, weight):
    """What the C functions read through data pointers: x (rows, dim) and residual (its shape), weight (dim,),
    CPU bf16 (or fp32) and contiguous. In as few torch calls as check it: a decode step's small ops run right after a
    matmul, whose weights leave the caches cold, and each distinct torch call then costs its own cache misses
    (docs/kernels.md has the figures)."""
    return (
        USE_CPU_LOOPS
        and x.dtype == residual.dtype == weight.dtype
        and x.dtype in ELEMENTS
        and x.is_cpu
        and residual.is_cpu
        and weight.is_cpu
        and x.dim() == 2
        and x.shape == residual.shape
        and weight.shape == x.shape[1:]
        and x.is_contiguous()
        and residual.is_contiguous()
        and weight.is_contiguous()
    )


@functools.cache
def _rms_norm_c(dtype):
    element = ELEMENTS[dtype] + "*"
    return _c_function(_rms_norm_pointers, *[element] * 4, "int64", "int64", "int64", "float64")


@functools.cache
def _c_function(fn, *arg_types):
    """fn (arguments: numba type names, "int16*" a pointer to int16s) compiled by numba.cfunc, as a ctypes function
    taking pointers as ints (data_ptr()), or None where numba is missing or cannot compile it (with a warning; the
    caller takes its other route). A decode step's small calls
    go this way: a call through ctypes on the data pointers skips the numpy views and numba's dispatch of the
    parallel loops (each runs cold after the matmuls; docs/kernels.md has the figures)."""
    numba = _numba() if USE_CPU_LOOPS else None
    if numba is None:
        return None
    announce_compile(fn)
    try:
        types = [
            numba.types.CPointer(getattr(numba.types, t[:-1])) if t[-1] == "*" else getattr(numba.types, t)
            for t in arg_types
        ]
        compiled = numba.cfunc(
            numba.types.void(*types), fastmath={"reassoc", "contract"}, error_model="numpy", cache=True
        )(fn)
        function = compiled.ctypes
        function.argtypes = [ctypes.c_void_p if t[-1] == "*" else a for t, a in zip(arg_types, function.argtypes)]
        return function
    except Exception as e:  # e.g. no writable cache folder
        warnings.warn(f"kernels: the C function {fn.__name__} is off ({type(e).__name__}: {e}); the loops run instead")
        return None


def rotary_cpu(q, k, rope, store=None):
    """rotary_ref's rotary embedding (no q/k norm) of q (T, H, D) and k (T, Hkv, D) bf16 or fp32 (each head's last
    dim contiguous), by rope (T, D) fp32 -> new (q, k). With store = (v, k_cache, v_cache, slot_mapping): store_kv's
    write of the rotated k and of v into the caches (q's dtype), in the same loop -> the new q."""
    if q.dim() != 3 or k.dim() != 3 or not _loops_apply(q, k) or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    tokens, _, head_dim = q.shape
    if head_dim % 2 or k.shape[::2] != q.shape[::2] or rope.shape != (tokens, head_dim) or rope.dtype != torch.float32:
        return None
    if store is None:
        k_out = torch.empty(k.shape, dtype=k.dtype)
        v, v_out, slots = k[:0], k_out[:0], torch.arange(tokens)  # k's rows in order; no v
    else:
        v, k_cache, v_cache, slots = store
        if not (_loops_apply(q, v, k_cache, v_cache) and v.stride(-1) == 1) or slots.device.type != "cpu":
            return None
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        _check_store_kv(k, v, k_cache, v_cache, slots)  # (the loops check no bounds; slots must be in the caches)
        k_out, v_out = k_cache, v_cache  # (their slots: rows of (Hkv, D))
    loops = _compile_elementwise(_rotary_loops)
    if loops is None:
        return None
    q_out, rope = torch.empty_like(q, memory_format=torch.contiguous_format), rope.contiguous()
    # q, k and v as rows of head_dim-wide heads (the qkv output's views): a decode step's call a C function
    one_thread = _rotary_c(q.dtype) if q.numel() + k.numel() < ROTARY_C_WORK and _head_rows(q, k, v, slots) else None
    if one_thread is not None:
        pointers = (t.data_ptr() for t in (q, k, v, rope, slots, q_out, k_out, v_out))
        slots_out = k_out.shape[0] * k_out.shape[1] if store is not None else tokens  # (a cache's slots, or k's rows)
        sizes = (q.shape[1], k.shape[1], head_dim, len(v), slots_out)
        one_thread(*pointers, tokens, q.stride(0), k.stride(0), v.stride(0), *sizes)
    else:
        if store is not None:
            k_out, v_out = (c.view(-1, *c.shape[2:]) for c in (k_out, v_out))  # (slots, Hkv, D)
        bits = [_elements(t) for t in (q, k, v, q_out, k_out, v_out)]
        loops(q.numel() + k.numel(), *bits[:3], rope.numpy(), slots.numpy(), *bits[3:])
    return q_out if store is not None else (q_out, k_out)


def _head_rows(q, k, v, slots):
    """Whether q, k and v are rows of head_dim-wide heads side by side (the qkv output's views), as _rotary_pointers
    reads them."""
    head_dim = q.shape[2]
    return (
        q.stride(1) == k.stride(1) == v.stride(1) == head_dim
        and q.stride(0) % head_dim == k.stride(0) % head_dim == v.stride(0) % head_dim == 0
        and slots.is_contiguous()
    )


@functools.cache
def _rotary_c(dtype):
    element = ELEMENTS[dtype] + "*"
    return _c_function(_rotary_pointers, *[element] * 3, "float32*", "int64*", *[element] * 3, *["int64"] * 9)


# Below this many q and k elements rotary_cpu calls _rotary_pointers on the calling thread: a decode step's
# rotary takes less time there than waking numba's threads does.
ROTARY_C_WORK = 4 * LOOP_MIN_WORK


def silu_and_mul_cpu(gate_up):
    """silu_and_mul_ref of bf16 rows (T, 2 * I) in one pass -> (T, I): torch's bits (silu in fp32, rounded to bf16,
    then the product rounded; fp32 rows within its rounding), or None where the loops do not run."""
    if not _loops_apply(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        return None
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    one_thread = _silu_and_mul_c(gate_up.dtype) if gate_up.numel() < LOOP_MIN_WORK else None
    if one_thread is not None:  # a decode step's few rows: one C call on the data pointers
        one_thread(gate_up.data_ptr(), out.data_ptr(), *out.shape)
        return out
    loops = _compile_elementwise(_silu_and_mul_loops)
    if loops is None:
        return None
    loops(gate_up.numel(), _elements(gate_up), _elements(out))
    return out


@functools.cache
def _silu_and_mul_c(dtype):
    return _c_function(_silu_and_mul_pointers, *[ELEMENTS[dtype] + "*"] * 2, "int64", "int64")


ELEMENTS = {torch.bfloat16: "int16", torch.float32: "float32"}  # the small ops' loops: dtype -> their element type


def _loops_apply(*tensors):
    return (
        USE_CPU_LOOPS
        and all(t.is_cpu and t.dtype == tensors[0].dtype for t in tensors)
        and tensors[0].dtype in ELEMENTS
    )


def _elements(t):
    """A tensor as the loops' numpy array: bf16 as its bits (int16), fp32 as it is."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@functools.cache
def _compile_elementwise(loops):
    row, head = np.zeros((1, 2), np.int16), np.zeros((1, 1, 2), np.int16)  # one token: a row of 2, a head of 2
    probe = {
        _rms_norm_loops: (row, row, row[0], row.copy(), 1e-6),
        _rotary_loops: (
            *[np.zeros((1, 2, 2), np.int16)[:, :1]] * 3,
            np.zeros((1, 2), np.float32),
            np.zeros(1, np.int64),
        )
        + (head.copy(),) * 3,  # q, k, v: strided views of the qkv projection's output
        _silu_and_mul_loops: (row, row[:, :1].copy()),
    }[loops]
    return _compile(loops, probe, f"the compiled {loops.__name__} are off", "the model uses torch ops")


def _as_f32(bits):
    """The fp32 whose bits are bits (a uint32): a bit cast, as numba compiles it (_bit_cast_intrinsics)."""
    return np.uint32(bits).view(np.float32)


def _as_u32(value):
    """The bits of an fp32 value, as a uint32 (the reverse bit cast)."""
    return np.float32(value).view(np.uint32)


def _widen(h):
    """bf16 bits (an int16) -> the fp32 value (bf16 is the top half of an fp32)."""
    return _as_f32(np.uint32(np.uint16(h)) << 16)


def _widened(bits):
    """bf16 bits (an int16 array), or fp32 values -> a new fp32 array of their values."""
    values = np.empty(len(bits), np.float32)
    for d in range(len(bits)):
        values[d] = _load(bits[d])
    return values


# The small ops' loops run over bf16 bits (int16 arrays) or fp32 arrays alike: numba compiles them once per
# element type, and these three, given an element of the tensor (`like`), keep only that type's branch.


def _load(x):
    """An element -> its fp32 value: bf16 bits widened, an fp32 as it is."""
    if isinstance(x, np.float32):
        return x
    return _widen(x)


def _round_as(value, like):
    """An fp32 value rounded where torch rounds to the tensor's dtype: to bf16 for bf16 bits, else as it is."""
    if isinstance(like, np.float32):
        return value
    return _bf16(value)


def _to(value, like):
    """An fp32 value, rounded, as the tensor's element: bf16 bits, or the fp32 itself."""
    if isinstance(like, np.float32):
        return value
    return _narrow(_bf16(value))


def _bf16(value):
    """An fp32 value rounded to bf16 (still an fp32), to nearest even, a NaN kept a (quiet) NaN: torch's .to(bf16)."""
    b = _as_u32(value)
    rounded = ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16) << 16
    return _as_f32(np.uint32(0x7FC00000) if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


def _narrow(value):
    """A rounded fp32 value -> its bf16 bits (an int16)."""
    return np.int16(np.uint16(_as_u32(value) >> 16))


def _round(values):
    """Round fp32 values (a uint32 view of them) to bf16 in place."""
    for d in range(len(values)):
        values[d] = _as_u32(_bf16(_as_f32(values[d])))


def _exp(x):
    """exp of an fp32 value in SIMD lanes: 2**y, y = x * log2(e), as 2**floor(y) from the exponent bits (0 below
    2**-126, inf from 2**128) times EXP2_POLY at y's fraction (numba has no exp that vectorises)."""
    y = min(max(x * np.float32(LOG2_E), np.float32(-127.0)), np.float32(128.0))
    whole = np.floor(y)
    frac = y - whole
    c0, c1, c2, c3, c4, c5 = _EXP2_POLY32
    return (c0 + frac * (c1 + frac * (c2 + frac * (c3 + frac * (c4 + frac * c5))))) * _as_f32(
        np.uint32(np.int32(whole) + 127) << 23
    )


def _silu_and_mul_loops(gate_up, out):
    """gate_up (T, 2 * I), out (T, I): bf16 bits (or fp32). silu(g) = g / (1 + exp(-g)) in fp32 rounded to bf16,
    times up, rounded: torch's two ops (its exp and this one agree to fp32's last bits, which bf16 rounds away; in
    fp32, within a few of them). Infinities and NaNs as torch: silu(-inf) is NaN, silu(inf) inf."""
    for i in prange(gate_up.shape[0]):
        _silu_and_mul_row(gate_up[i], out[i])


def _silu_and_mul_pointers(gate_up, out, rows, n):
    """_silu_and_mul_loops on the calling thread, over data pointers (as _rms_norm_pointers): out (rows, n)."""
    gate_up, out = carray(gate_up, (rows, 2 * n)), carray(out, (rows, n))
    for i in range(rows):
        _silu_and_mul_row(gate_up[i], out[i])


def _silu_and_mul_row(gate_up, out):
    n, like = len(out), gate_up[0]
    for d in range(n):
        g = _load(gate_up[d])
        silu = _round_as(g / (np.float32(1.0) + _exp(-g)), like)
        out[d] = _to(silu * _load(gate_up[n + d]), like)


def _rms_norm_loops(x, residual, weight, out, eps):
    """x (rows, dim), residual (rows, dim) or (0, dim): no add, weight (dim,), out (rows, dim): bf16 bits (or fp32)."""
    rows, dim = x.shape
    w, add = _widened(weight), residual.shape[0] > 0
    for i in prange(rows):
        _rms_norm_row(x[i], residual[i] if add else x[i], add, w, eps, out[i])


def _rms_norm_pointers(x, residual, weight, out, rows, residual_rows, dim, eps):
    """_rms_norm_loops on the calling thread, over the tensors' data pointers: compiled as a C function
    (_c_function), called through ctypes without numpy views or numba's type dispatch."""
    x, out = carray(x, (rows, dim)), carray(out, (rows, dim))  # (typed pointers: int16 for bf16 bits, or fp32)
    residual, w = carray(residual, (residual_rows, dim)), _widened(carray(weight, (dim,)))
    for i in range(rows):
        _rms_norm_row(x[i], residual[i] if residual_rows else x[i], residual_rows > 0, w, eps, out[i])


def _rms_norm_row(x, residual, add, w, eps, out):
    """One row: where add, x + residual in x's dtype, written back into residual; then its RMSNorm into out.
    Two passes over the row, each element widened, rounded and narrowed in registers."""
    dim, like = len(x), x[0]
    v = np.empty(dim, np.float32)  # the row in fp32 (after the add)
    squares = np.float32(0.0)
    for d in range(dim):
        value = _load(x[d])
        if add:  # the residual stream's add, in x's dtype
            value = _round_as(value + _load(residual[d]), like)
            residual[d] = _to(value, like)
        v[d] = value
        squares += value * value
    scale = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + np.float32(eps))
    for d in range(dim):
        out[d] = _to(_round_as(v[d] * scale, like) * w[d], like)  # x.to(dtype), then weight * x in it


def _rotary_loops(q, k, v, rope, slots, q_out, k_out, v_out):
    """q (T, H, D), k, v (T, Hkv, D): bf16 bits (or fp32), last dim contiguous (v: (0, Hkv, D) for none); rope (T, D)
    fp32, cos | sin of each token's D / 2 angles, rounded to bf16 here as HF's cos.to(bf16); q_out (T, H, D);
    k_out, v_out (rows, Hkv, D): token i's rotated k and its v go to row slots[i] (none where it is -1)."""
    for i in prange(q.shape[0]):
        _rotary_token(i, q, k, v, rope, slots, q_out, k_out, v_out)


def _rotary_pointers(
    q, k, v, rope, slots, q_out, k_out, v_out, tokens, q_row, k_row, v_row, heads, kv_heads, head_dim, v_rows, k_slots
):
    """_rotary_loops on the calling thread, over data pointers (as _rms_norm_pointers), for q, k and v whose
    rows (q_row, k_row, v_row elements apart) hold their heads side by side. v has v_rows rows (0: no v and
    no v_out); k_out (and v_out) k_slots: the cache's slots in a store, else tokens."""
    q = carray(q, (tokens, q_row // head_dim, head_dim))[:, :heads]  # (typed pointers: int16 bits, or fp32)
    k = carray(k, (tokens, k_row // head_dim, head_dim))[:, :kv_heads]
    v = carray(v, (v_rows, v_row // head_dim, head_dim))[:, :kv_heads]
    rope, slots = carray(rope, (tokens, head_dim)), carray(slots, (tokens,))
    q_out = carray(q_out, (tokens, heads, head_dim))
    k_out = carray(k_out, (k_slots, kv_heads, head_dim))
    v_out = carray(v_out, (k_slots if v_rows else 0, kv_heads, head_dim))
    for i in range(tokens):
        _rotary_token(i, q, k, v, rope, slots, q_out, k_out, v_out)


def _rotary_token(i, q, k, v, rope, slots, q_out, k_out, v_out):
    """Token i of _rotary_loops: its q heads rotated into q_out[i]; where slots[i] >= 0, its k heads rotated
    into k_out[slots[i]] and its v copied into v_out[slots[i]]."""
    half = q.shape[2] // 2
    c, s = np.empty(half, np.float32), np.empty(half, np.float32)  # HF's cat(freqs, freqs): each angle twice
    for d in range(half):
        c[d], s[d] = _round_as(rope[i, d], q[i, 0, 0]), _round_as(rope[i, half + d], q[i, 0, 0])
    x = np.empty(2 * half, np.float32)  # a head, widened
    for h in range(q.shape[1]):
        _rotate_head(q[i, h], c, s, x, q_out[i, h])
    slot = slots[i]
    if slot < 0:  # -1: this token's K/V are not written
        return
    for h in range(k.shape[1]):
        _rotate_head(k[i, h], c, s, x, k_out[slot, h])
    if v.shape[0]:
        for h in range(v.shape[1]):
            for d in range(2 * half):
                v_out[slot, h, d] = v[i, h, d]


def _rotate_head(head, c, s, x, out):
    """One head: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), each product and the sum
    rounded to the head's dtype as torch's ops do. c, s: the half-width cos and sin (rounded); x: the head's fp32
    scratch (widened there first: a strided view of the qkv output does not run in SIMD lanes, a contiguous row
    does)."""
    half, like = len(c), head[0]
    for d in range(2 * half):
        x[d] = _load(head[d])
    for d in range(half):
        x1, x2 = x[d], x[d + half]
        out[d] = _to(_round_as(x1 * c[d], like) - _round_as(x2 * s[d], like), like)
        out[d + half] = _to(_round_as(x2 * c[d], like) + _round_as(x1 * s[d], like), like)


# ---- The CPU path: which dtype, the KV pool's pages, weight packing, greedy argmax and top-p without a sort ----


def cpu_flags():
    """This CPU's feature flags as /proc/cpuinfo names them, plus "vendor:<vendor_id>" (empty where unreadable)."""
    flags = set()
    if hasattr(torch.cpu, "get_capabilities"):  # recent torch: cpuinfo's view of the CPU
        caps = torch.cpu.get_capabilities()
        flags = {flag for flag, present in caps.items() if present is True}
        flags |= {"vendor:AuthenticAMD"} if "AMD" in str(caps.get("cpu_name", "")) else set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    flags |= set(value.split())
                elif key.strip() == "vendor_id":
                    flags.add("vendor:" + value.strip())
    except OSError:
        pass
    return flags


def cpu_prefers_bf16(flags=None):
    """Whether dtype "auto" picks bfloat16 on this CPU (flags: cpu_flags() if None), by what was measured
    (the README's table): with AMX, bf16 (its tile matmuls); on an AMD CPU with AVX512-BF16, bf16 too (torch's
    fp32 matmuls are 1.4-3x slower than oneDNN's packed bf16 ones there); on an Intel CPU with AVX512-BF16
    but no AMX, fp32 (its bf16 matmuls and the conversions around them cost more than reading half the
    bytes saves); without bf16 instructions torch emulates bf16, so fp32."""
    flags = cpu_flags() if flags is None else flags
    return "amx_bf16" in flags or ("avx512_bf16" in flags and "vendor:AuthenticAMD" in flags)


HUGE_PAGE = 2 << 20  # bytes in an x86 or arm64 Linux huge page
MADV_HUGEPAGE = 14  # Linux's madvise advice: back this range with huge pages where the kernel can


def kv_pool(shape, dtype, device):
    """The zeroed KV pool. On a Linux CPU, in 2 MB pages (transparent huge pages, asked for with madvise before
    the zeros touch it): a decode step reads K/V from thousands of blocks all over the pool, and with 4 KB pages
    each block is a page-table walk, whose misses also evict the matmuls' weights from the TLB. Elsewhere, or
    where madvise refuses (no THP in the kernel, THP switched off), torch.zeros."""
    if torch.device(device).type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched pages; room to start on a 2 MB line
    start = -raw.data_ptr() % HUGE_PAGE
    pool = raw[start : start + nbytes]
    try:
        madvise = ctypes.CDLL(None).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise(pool.data_ptr(), nbytes - nbytes % HUGE_PAGE, MADV_HUGEPAGE)  # (an error: 4 KB pages, as before)
    except (OSError, AttributeError):
        pass
    return pool.view(dtype).view(shape).zero_()


def release_openmp_workers():
    """Ends the calling thread's idle OpenMP worker threads in every libgomp the process has loaded (torch's, and
    the one numba's loops use); the next parallel region this thread starts makes new ones. libgomp counts the
    workers of every thread that ever ran a parallel region, idle or not, and once they outnumber the cores it
    stops letting workers spin between regions: each region started from another thread then waits for its
    workers to wake up (docs/kernels.md). So an engine loaded in one thread and stepped in another
    (start_server, a user's own thread) runs at full speed only once the loading thread's workers are gone.
    Linux only (it reads /proc/self/maps); nothing where a libgomp lacks OpenMP 5.0's omp_pause_resource_all."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).omp_pause_resource_all(2)  # omp_pause_hard: this thread's pool of workers ends
        except (OSError, AttributeError):
            pass


class PackedLinear(torch.nn.Linear):
    """An nn.Linear whose weight is in oneDNN's blocked layout (pack_linears_cpu swaps this class in)."""

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears_cpu(model):
    """A CPU model in bf16 or fp32: every nn.Linear's weight reordered once, at load, into oneDNN's
    blocked layout (the model's merged qkv_proj and gate_up_proj as they are: one matmul each). In bf16,
    F.linear hands oneDNN torch's plain layout and oneDNN reorders it at every call; packing once is what
    torch.compile's freezing does on a CPU, with the same results bit for bit. In fp32, F.linear is MKL's
    sgemm, which has no packed form for a small batch; oneDNN's packed one does the same sums in another
    order (results within rounding: _agrees) and runs a decode step's matmuls faster. One layer at a time,
    so memory stays the same once loading ends (a tied lm_head gets its own packed copy of the embedding).
    Tried on one layer first: a torch or CPU without these oneDNN ops (bf16 needs AVX512 or AVX-NE-CONVERT),
    or one whose results differ, keeps F.linear, with a warning. Any other device or dtype: nothing to do."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    first = linears[0] if linears else None
    if first is None or first.weight.device.type != "cpu" or first.weight.dtype not in (torch.bfloat16, torch.float32):
        return
    try:
        probe = torch.randn(3, first.in_features, dtype=first.weight.dtype, generator=torch.Generator().manual_seed(0))
        packed = torch.ops.mkldnn._reorder_linear_weight(first.weight.detach())
        if not _agrees(torch.ops.mkldnn._linear_pointwise(probe, packed, first.bias, "none", [], ""), first(probe)):
            raise ValueError("results differ from F.linear")
    except Exception as e:
        warnings.warn(f"CPU weight packing is off ({type(e).__name__}: {e}); the matmuls use F.linear")
        return
    for m in linears:
        w = packed if m is first else torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
        m.weight = torch.nn.Parameter(w, requires_grad=False)
        m.__class__ = PackedLinear


# ---- The CPU path: a GGUF's 4-bit weights, for small batches ----
# A decode step of a few sequences reads every weight once per step: its matmuls run at the memory's speed, and
# a weight in 4 bits is a quarter of the bytes of bf16, an eighth of fp32's. A GGUF's Q4_1 blocks (32 weights:
# 4-bit q, a scale d and a minimum m, w = q * d + m) are kept as the file has them (d and m its fp16 bits: 20 bytes
# a block), and x . w of a block = d * (q . x) + m * sum(x). With AVX2 (_q4_1_loops), x in 16-bit integers by
# blocks of 32 (a scale each: the block's largest |x| is 32767) and q . x in integers, as llama.cpp does in 8 bits:
# 16 keep each x within 1 / 65534 of its block's largest, far inside the bf16 rounding of the other path. Without
# AVX2 or numba, torch's int4 CPU matmul, which computes (q - 8) * scale + zero: scale = d, zero = m + 8 * d, each
# stored as bf16 beside bf16 activations (its fast form; an fp32 model's rows are rounded to bf16 for it). Only up to
# INT4_MAX_ROWS rows: from there on oneDNN's packed matmul, whose work per weight read is cheaper, is faster; an
# fp32 model's calls take the AVX2 loops up to Q4_1_MAX_ROWS rows (oneDNN's fp32 matmul passes them at ~24).

INT4_MAX_ROWS = 8
Q4_1_MAX_ROWS = 16
Q4_1_BLOCK = 32


def q4_1_parts(raw, shape):
    """A Q4_1 tensor's raw bytes (rows, blocks * 20) -> (q, d, m): q (rows, cols) uint8 in 0..15, d and m
    (rows, blocks) fp32 (exactly the file's fp16 values). A block is d, m (fp16 each), then 16 bytes whose low
    nibbles are its weights 0-15 and high nibbles its weights 16-31."""
    blocks = torch.from_numpy(np.asarray(raw)).reshape(shape[0], -1, 20)
    d, m = (blocks[..., i : i + 2].contiguous().view(torch.float16)[..., 0].float() for i in (0, 2))
    nibbles = blocks[..., 4:]
    return torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(shape), d, m


class Int4Linear(PackedLinear):
    """PackedLinear with a second, 4-bit copy of its weight (attach_int4) for calls of up to max_rows rows:
    the file's blocks for _q4_1_loops (.q4_1: nibbles, d, m), else torch's int4 layout (.int4)."""

    def max_rows(self, dtype):
        return Q4_1_MAX_ROWS if self.q4_1 is not None and dtype == torch.float32 else INT4_MAX_ROWS

    def forward(self, x):
        if x.dim() != 2 or x.shape[0] > self.max_rows(x.dtype):
            return super().forward(x)
        if self.q4_1 is not None:  # (numpy arrays: a tensor's .numpy() costs ~2 us a call)
            rows = x.float().contiguous().numpy()
            y = torch.from_numpy(_compile_q4_1()(rows.size * self.out_features, rows, *self.q4_1))
        else:
            rows = x.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.int4, Q4_1_BLOCK, self.int4_scales)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def attach_int4(linear, q, d, m):
    """Give a bf16 or fp32 PackedLinear the 4-bit copy of its weight, from q (out, in) in 0..15 and d, m
    (out, in / 32) fp32 values of fp16s (a GGUF's): the file's blocks where the AVX2 loops compile, else torch's int4
    layout if this torch has the int4 CPU matmul; returns whether it did."""
    if not USE_CPU_INT4 or type(linear) is not PackedLinear:  # (packed: bf16 or fp32)
        return False
    if _numba() is not None and AVX2_Q4_1 and _compile_q4_1() is not None:  # (_numba() sets AVX2_Q4_1)
        halves = [t.half() for t in (d, m)]
        if not all(torch.equal(h.float(), t.float()) for h, t in zip(halves, (d, m))):
            return False  # (scales that are not fp16s: the dense weight stays exact)
        blocks = q.view(q.shape[0], -1, Q4_1_BLOCK).to(torch.uint8)
        nibbles = (blocks[..., :16] | blocks[..., 16:] << 4).reshape(q.shape[0], -1)  # (out, in / 2)
        halves = [h.contiguous().view(torch.int16).numpy().view(np.uint16) for h in halves]  # (their bits)
        linear.q4_1 = (nibbles.contiguous().numpy(), *halves)
    else:
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        except (AttributeError, RuntimeError):
            return False
        linear.q4_1, linear.int4 = None, packed
        scales = torch.stack([d, m + 8 * d], dim=-1)  # (out, in / 32, 2)
        linear.int4_scales = scales.transpose(0, 1).contiguous().bfloat16()  # (in / 32, out, 2)
    linear.__class__ = Int4Linear
    return True


@functools.cache
def _compile_q4_1():
    x, q, d = np.zeros((1, Q4_1_BLOCK), np.float32), np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint16)
    probe = (x, q, d, d)  # one row, one block, its scale and minimum (fp16 bits)
    return _compile(_q4_1_loops, probe, "the Q4_1 loops are off", "the 4-bit weights use torch's int4 matmul")


Q4_1_CHUNK = 16  # output rows a parallel job makes


def _q4_1_loops(x, nibbles, d, m):
    """x @ w.T, w = q * d + m by blocks of 32: x (rows, k) fp32, nibbles (n, k / 2) uint8 (q, as the file's Q4_1
    blocks), d and m (n, k / 32) uint16 (the file's fp16 bits) -> (rows, n) fp32. x first in int16 by blocks, with
    each block's scale and sum (_q4_1_dot's products, and m * sum(x) in fp32)."""
    rows, k = x.shape
    n, blocks = nibbles.shape[0], k // Q4_1_BLOCK
    out = np.empty((rows, n), np.float32)
    xq, scales, sums = (
        np.empty((rows, k), np.int16),
        np.empty((rows, blocks), np.float32),
        np.empty((rows, blocks), np.float32),
    )
    for r in range(rows):
        for b in range(blocks):
            largest, total = np.float32(0.0), np.float32(0.0)
            for i in range(b * Q4_1_BLOCK, (b + 1) * Q4_1_BLOCK):
                largest, total = max(largest, abs(x[r, i])), total + x[r, i]
            scales[r, b], sums[r, b] = largest / np.float32(32767.0), total  # (inf or NaN: the sums carry it)
            inverse = np.float32(32767.0) / largest if largest > 0 else np.float32(0.0)
            for i in range(b * Q4_1_BLOCK, (b + 1) * Q4_1_BLOCK):
                xq[r, i] = np.int16(np.round(x[r, i] * inverse))
    for job in prange((n + Q4_1_CHUNK - 1) // Q4_1_CHUNK):
        for j in range(job * Q4_1_CHUNK, min(n, (job + 1) * Q4_1_CHUNK)):
            at = j * blocks * 16  # weight row j's blocks (its scales: j * blocks)
            for r in range(0, rows - 3, 4):  # four rows share each block's unpacked weights
                totals = _q4_1_dot(nibbles, at, d, m, j * blocks, xq, r * k, scales, sums, r * blocks, blocks, 4)
                for e in range(4):
                    out[r + e, j] = totals[e]
            if rows % 4 >= 2:  # then two, then one
                r = rows - rows % 4
                out[r, j], out[r + 1, j] = _q4_1_dot(
                    nibbles, at, d, m, j * blocks, xq, r * k, scales, sums, r * blocks, blocks, 2
                )
            if rows % 2:
                r = rows - 1
                out[r, j] = _q4_1_dot(nibbles, at, d, m, j * blocks, xq, r * k, scales, sums, r * blocks, blocks, 1)[0]
    return out


# ---- The CPU path: a decode step's layer as one chain of compiled calls ----
# With the 4-bit weights, a one-row decode step's compiled code (the Q4_1 loops, attention, the C small ops) is about
# two thirds of it; the rest is the Python between them: nine module calls a layer, each op's dispatch and checks,
# tensor views, run cold after the matmuls have streamed their weights through the caches (at 48 rows, ~5% of a
# step). decode_layer_cpu calls the same functions on the same inputs in the same order as the op-by-op path, so
# its results are the same bits; the layer's modules are only read for their weights, and each linear's own forward
# makes its product (Int4Linear's 4-bit loops where they take the step, else oneDNN's packed matmul or F.linear).
# It applies to bf16 or fp32 layers without Qwen3's q/k norms or hooks on their linears (decode_layer_applies: tp.py
# sums o and down in hooks), in a decode step whose attention the compiled loops plan and whose norms and rotary
# embedding take their one-thread C functions (rows x hidden under LOOP_MIN_WORK); the other steps run op by op.


def decode_layer_applies(layer):
    """Whether decode_layer_cpu can run this DecoderLayer (its weights; each step's inputs are checked per call)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    dtype = layer.input_layernorm.weight.dtype
    return (
        all(type(lin) in (torch.nn.Linear, PackedLinear, Int4Linear) for lin in linears)
        and not any(lin._forward_hooks or lin._forward_pre_hooks for lin in linears)
        and not hasattr(attn, "q_norm")
        and dtype in ELEMENTS
        and all(
            t.is_cpu and t.dtype == dtype
            for t in (layer.post_attention_layernorm.weight, *(lin.weight for lin in linears))
        )
    )


def decode_layer_cpu(layer, x, residual, rope, kv_cache, meta):
    """DecoderLayer.forward of a decode step (meta.decode_only) on bf16 or fp32 rows, for a layer decode_layer_applies
    to: -> (the MLP's output, residual + x + attention's output), residual updated in place as the norms do; or None
    where the step is not one it runs (the caller runs the layer op by op)."""
    plan, (k_cache, v_cache), slots = meta.attn_plan, kv_cache, meta.slot_mapping
    rows, hidden = x.shape
    dtype = x.dtype
    if not (meta.decode_only and plan is not None and not plan.prefill and rows * hidden < LOOP_MIN_WORK):
        return None  # (a prefill, or rows whose norms take their threaded loops)
    if len(plan.decode) != 1 or not isinstance(plan.decode[0], DecodeRows) or len(plan.decode[0].rows) != rows:
        return None
    if not (residual.dtype == k_cache.dtype == v_cache.dtype == layer.input_layernorm.weight.dtype == dtype):
        return None
    if not all(t.is_contiguous() for t in (x, residual, k_cache, v_cache, slots, rope)):  # (read through pointers)
        return None
    attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if rows * (heads + kv_heads) * head_dim >= ROTARY_C_WORK:
        return None  # (the rotary embedding takes its threaded loops there, not the C function)
    norm, rotary, attention, g = _rms_norm_c(dtype), _rotary_c(dtype), _decode_loops(dtype), plan.decode[0]
    if norm is None or rotary is None or attention is None:
        return None
    q4_1 = _compile_q4_1() if dtype == torch.float32 and rows <= Q4_1_MAX_ROWS else None

    def linear(a, lin):  # lin.forward(a); Int4Linear's 4-bit loops called here (its checks: ~5% of a 1-row step)
        if q4_1 is None or getattr(lin, "q4_1", None) is None or lin.bias is not None:
            return lin.forward(a)
        return torch.from_numpy(q4_1(a.numel() * lin.out_features, a.numpy(), *lin.q4_1))

    h = torch.empty_like(x)
    norm(x.data_ptr(), residual.data_ptr(), n1.weight.data_ptr(), h.data_ptr(), rows, rows, hidden, n1.eps)
    qkv = linear(h, attn.qkv_proj)  # (rows, q | k | v): heads side by side
    q, width, size = torch.empty(rows, heads, head_dim, dtype=dtype), qkv.shape[1], qkv.element_size()
    k_at, v_at = qkv.data_ptr() + size * heads * head_dim, qkv.data_ptr() + size * (heads + kv_heads) * head_dim
    pointers = (qkv.data_ptr(), k_at, v_at, rope.data_ptr(), slots.data_ptr(), q.data_ptr())
    sizes = (rows, width, width, width, heads, kv_heads, head_dim, rows, k_cache.shape[0] * k_cache.shape[1])
    rotary(*pointers, k_cache.data_ptr(), v_cache.data_ptr(), *sizes)  # q rotated; k rotated and v stored
    o = torch.empty_like(q)
    attend_decode_rows(attention, q, k_cache, v_cache, g, attn.scale, o)
    o = linear(o.view(rows, -1), attn.o_proj)
    norm(o.data_ptr(), residual.data_ptr(), n2.weight.data_ptr(), h.data_ptr(), rows, rows, hidden, n2.eps)
    act = silu_and_mul(linear(h, mlp.gate_up_proj))  # (its C function, or its loops)
    return linear(act, mlp.down_proj), residual


# A GGUF's Q8_0 matrix (the default model's embedding, tied: its lm_head) is blocks of 32 int8 weights q and an fp16
# scale d, w = q * d. A small step reads the lm_head's weights once: 113 MB in fp32, 32 as the file's int8 values
# and fp32 scales. For an fp32 model, Q8Linear's compiled loops take those (q * d in fp32 is exactly the model's
# weight, summed in another order) for calls of up to INT4_MAX_ROWS rows. (A bf16 model's lm_head holds q * d
# rounded to bf16, 57 MB: the file's values would change its logits by that rounding.)

Q8_0_BLOCK = 32


def q8_0_parts(raw, shape):
    """A Q8_0 tensor's raw bytes (rows, blocks * 34) -> (q, d): q (rows, cols) int8, d (rows, blocks) fp32 (exactly
    the file's fp16 scales). A block is d (fp16), then its 32 weights."""
    blocks = torch.from_numpy(np.asarray(raw)).reshape(shape[0], -1, 2 + Q8_0_BLOCK)
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0].float()
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(shape), d


class Q8Linear(PackedLinear):
    """PackedLinear with the file's Q8_0 copy of its weight (attach_q8_0) for calls of up to INT4_MAX_ROWS rows."""

    def forward(self, x):
        if x.dim() != 2 or x.shape[0] > INT4_MAX_ROWS:
            return super().forward(x)
        rows, out = x.float().contiguous(), torch.empty(x.shape[0], self.out_features)
        _compile_q8_0()(
            rows.numel() * self.out_features, rows.numpy(), self.q8.numpy(), self.q8_scales.numpy(), out.numpy()
        )
        return out if self.bias is None else out + self.bias


def attach_q8_0(linear, q, d):
    """Give an fp32 PackedLinear the file's 8-bit copy of its weight, q (out, in) int8 and d (out, in / 32) fp32,
    where the loops compile; returns whether it did."""
    if not USE_CPU_INT4 or type(linear) is not PackedLinear or linear.weight.dtype != torch.float32:
        return False
    if _compile_q8_0() is None:  # (numba missing, or it cannot compile the loops: a warning said why)
        return False
    linear.q8, linear.q8_scales = q.contiguous(), d.contiguous()
    linear.__class__ = Q8Linear
    return True


@functools.cache
def _compile_q8_0():
    x, q = np.zeros((1, Q8_0_BLOCK), np.float32), np.zeros((1, Q8_0_BLOCK), np.int8)  # one row, one block
    probe = (x, q, np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))  # + its scale, the output
    return _compile(_q8_0_loops, probe, "the Q8_0 loops are off", "the lm_head uses its packed weight")


Q8_0_CHUNK = 64  # output rows a parallel job makes


def _q8_0_loops(x, q, d, out):
    """out = x @ w.T, w = q * d by blocks of 32: x (rows, k) fp32, q (n, k) int8, d (n, k / 32) fp32, out (rows, n).
    A weight row's products go to 32 partial sums, one per position in a block (SIMD lanes, summed once at the
    row's end): a sum per block, or a row of weights made first, runs 4x slower."""
    rows, k = x.shape
    n = q.shape[0]
    for job in prange((n + Q8_0_CHUNK - 1) // Q8_0_CHUNK):
        partial = np.empty(Q8_0_BLOCK, np.float32)
        for j in range(job * Q8_0_CHUNK, min(n, (job + 1) * Q8_0_CHUNK)):
            for r in range(rows):
                for i in range(Q8_0_BLOCK):
                    partial[i] = 0.0
                for b in range(k // Q8_0_BLOCK):
                    scale = d[j, b]
                    for i in range(Q8_0_BLOCK):
                        partial[i] += (np.float32(q[j, b * Q8_0_BLOCK + i]) * scale) * x[r, b * Q8_0_BLOCK + i]
                total = np.float32(0.0)
                for i in range(Q8_0_BLOCK):
                    total += partial[i]
                out[r, j] = total


def _agrees(got, want):
    """bf16: bit for bit (so the greedy tokens do not change). fp32: within rounding (MKL and oneDNN add in
    different orders; F.linear itself differs across batch sizes by as much)."""
    return torch.equal(got, want) if got.dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def greedy_tokens(logits, chunk=1024, loops=True):
    """The first best token of each row, as argmax gives it. bf16 on a CPU: argmax_rows's compiled
    loops when numba is there (and loops=True). Else in two levels, faster than one argmax over the
    whole row on a CPU: the best chunk of `chunk` tokens (amax: one vectorised pass, no indices), then
    the best token inside it. On the GPU path (Triton's), one argmax: one launch. logits (S, vocab) -> (S,)."""
    if _use_triton(logits) or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    tokens = argmax_rows(logits) if loops else None
    if tokens is not None:
        return tokens
    rows, vocab = logits.shape
    n = vocab // chunk
    maxes = logits[:, : n * chunk].view(rows, n, chunk).amax(dim=-1)  # (S, n)
    if n * chunk < vocab:  # the last, shorter chunk
        maxes = torch.cat([maxes, logits[:, n * chunk :].amax(dim=-1, keepdim=True)], dim=1)
    best = maxes.argmax(dim=-1)  # (S,) the first chunk holding the row's maximum
    cols = (best[:, None] * chunk + torch.arange(chunk, device=logits.device)).clamp_(max=vocab - 1)  # (S, chunk)
    return best * chunk + logits.gather(1, cols).argmax(dim=-1)


def sample_nucleus(x, top_p, min_p, uniforms, exact, max_rounds=64):
    """Top-p (and min-p) without sorting the vocabulary, by rejection (the sampler's path for top-p
    alone on a CPU, where a full sort per row is what costs): draw from the whole distribution and
    accept the token if it passes min-p and the tokens more likely than it hold less than top_p of the
    mass min-p keeps (vLLM's order: min-p first; it is then in the nucleus, ties kept together as the
    sampler's sort path keeps them). An accepted draw follows the distribution restricted to the kept
    tokens, exactly; the kept mass is >= top_p, so a row needs about 1 / top_p rounds. Rows still
    undecided after max_rounds go to exact(x, num_best, top_k, top_p, min_p, u), the sampler's sort.
    x (R, vocab); uniforms(list of rows) -> (len,) draws -> token ids (R,)."""
    probs = torch.softmax(x, dim=-1)  # (R, vocab)
    cdf, floor = probs.cumsum(dim=-1), min_p * probs.amax(dim=-1)
    nucleus = top_p * torch.where(probs >= floor[:, None], probs, 0.0).sum(dim=-1)  # (R,): top_p of what min-p keeps
    tokens = torch.full((len(x),), -1, dtype=torch.int64, device=x.device)  # (R,), -1: not yet accepted
    for _ in range(max_rounds):
        rows = (tokens < 0).nonzero()[:, 0]
        if len(rows) == 0:
            return tokens
        pending_probs, pending_cdf = (probs, cdf) if len(rows) == len(x) else (probs[rows], cdf[rows])  # (n, vocab)
        u = uniforms(rows.tolist()) * pending_cdf[:, -1]
        draw = torch.searchsorted(pending_cdf, u[:, None], right=True).clamp_(max=x.shape[1] - 1)  # (n, 1)
        p = pending_probs.gather(1, draw)  # (n, 1)
        above = torch.where(pending_probs > p, pending_probs, 0.0).sum(
            dim=-1
        )  # mass of the strictly more likely tokens
        accept = (above < nucleus[rows]) & (p[:, 0] >= floor[rows])
        tokens[rows[accept]] = draw[accept, 0]
    undecided = tokens < 0  # (almost never: a kept mass below 1/64 under min-p) an exact sort decides them
    if undecided.any():
        j = undecided.nonzero()[:, 0]
        k = torch.full((len(j),), x.shape[1], device=x.device)
        tokens[j] = exact(x[j], x.shape[1], k, top_p[j], min_p[j], uniforms(j.tolist()))
    return tokens
