"""
Kernel tests: store_kv and paged_attention, Triton and plain-torch reference,
against an independent float64 oracle (dense causal attention on the dense K/V,
never read back from the cache).

Without a GPU the Triton kernels run on CPU tensors under TRITON_INTERPRET=1,
which this file sets before kernels.py is imported (triton.jit picks compiled or
interpreted at decoration time). With a GPU and TRITON_INTERPRET unset, the same
tests compile the kernels for real on CUDA tensors (bf16 included), and a few
larger CUDA-only tests run.

Sizes: the interpreter costs roughly (programs x key tiles x ops) in numpy
calls, so the property tests keep to what still exercises every path: up to 4
sequences, queries up to 48 tokens over cached prefixes up to 80 (under 200
tokens and 130 positions per sequence: several query blocks and key tiles,
cache blocks from 1 token to larger than a key tile), head_dim up to 128, GQA
groups 1-8, and 30-60 examples per property. The whole file runs in well under
two minutes on 2 CPU cores.

    TRITON_INTERPRET=1 python -m pytest -q test_kernels_part.py
"""

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels.py (and so triton.jit) is imported

import kernels  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

if kernels.TRITON_INTERPRET:
    DEVICE = "cpu"  # interpreted kernels: CPU tensors, even on a machine with a GPU
elif torch.cuda.is_available():
    DEVICE = "cuda"  # compiled kernels
else:
    raise RuntimeError("kernels.py was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 in the environment")
needs_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU with compiled (not interpreted) Triton")

# |got - want| <= ATOL + RTOL * |want|, want in float64 from the same (rounded) inputs
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GARBAGE_BLOCK_IDS = (-1, -(2**31), 2**31 - 1, 2**20)  # what padded block-table entries may hold
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- A paged batch and its float64 oracle ----


@dataclass
class Case:
    seqs: list  # [(context_len, query_len)] per sequence: seq_len = context_len + query_len
    block_size: int
    num_kv_heads: int
    group: int  # query heads per kv head
    head_dim: int
    dtype: torch.dtype
    seed: int = 0
    temperature: float = 1.0  # multiplies q: > 1 sharpens the softmax (exercises the running max)
    q_is_view: bool = False  # q as a strided slice of a wider buffer (like a fused qkv)


def build(case):
    """Dense per-sequence K/V and q, plus the paged cache holding them. Every cache
    slot the batch does not own is NaN (unreferenced blocks, and slots past seq_len
    in each last block), padded block-table entries hold garbage ids, and the blocks
    of each sequence are scattered over the cache in shuffled order."""
    g = torch.Generator().manual_seed(case.seed)
    num_heads, D, bs = case.num_kv_heads * case.group, case.head_dim, case.block_size
    seq_lens = [c + n for c, n in case.seqs]
    blocks_per_seq = [math.ceil(L / bs) for L in seq_lens]
    max_blocks = max(blocks_per_seq) + 2  # two padded columns even for the longest sequence
    num_blocks = sum(blocks_per_seq) + 3  # three never-referenced blocks
    ids = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.full((num_blocks, bs, case.num_kv_heads, D), float("nan"), dtype=case.dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.empty(len(case.seqs), max_blocks, dtype=torch.int32)
    ks, vs, qs = [], [], []
    for s, L in enumerate(seq_lens):
        own, ids = ids[: blocks_per_seq[s]], ids[blocks_per_seq[s] :]
        garbage = [GARBAGE_BLOCK_IDS[i] for i in torch.randint(0, len(GARBAGE_BLOCK_IDS), (max_blocks - len(own),), generator=g).tolist()]
        block_tables[s] = torch.tensor(own + garbage, dtype=torch.int32)
        k = torch.randn(L, case.num_kv_heads, D, generator=g).to(case.dtype)  # (L, Hkv, D)
        v = torch.randn(L, case.num_kv_heads, D, generator=g).to(case.dtype)
        pos = torch.arange(L)
        k_cache[block_tables[s, pos // bs].long(), pos % bs] = k
        v_cache[block_tables[s, pos // bs].long(), pos % bs] = v
        ks.append(k)
        vs.append(v)
        qs.append((case.temperature * torch.randn(case.seqs[s][1], num_heads, D, generator=g)).to(case.dtype))
    q = torch.cat(qs)  # (num_tokens, H, D)
    if case.q_is_view:
        wide = torch.full((q.shape[0], num_heads + 3, D), float("nan"), dtype=case.dtype)
        wide[:, 1 : num_heads + 1] = q
        q = wide[:, 1 : num_heads + 1]  # strided: token stride (H + 3) * D
    q_lens = [n for _, n in case.seqs]
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = dict(block_tables=block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=query_start_loc)
    to_dev = lambda t: t.to(DEVICE)  # noqa: E731
    args = (to_dev(q), to_dev(k_cache), to_dev(v_cache), *(to_dev(t) for t in meta.values()), D**-0.5)
    return args, (ks, vs, qs)


def naive_attention(case, dense):
    """float64, one sequence at a time, dense causal mask: (num_tokens, H, D)."""
    outs = []
    for (context_len, q_len), k, v, q in zip(case.seqs, *dense):
        k = k.double().repeat_interleave(case.group, dim=1)  # (L, H, D): head h reads kv head h // group
        v = v.double().repeat_interleave(case.group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * case.head_dim**-0.5  # (H, Q, L)
        q_pos = context_len + torch.arange(q_len)  # position of each query in its sequence
        visible = torch.arange(context_len + q_len)[None, :] <= q_pos[:, None]  # (Q, L)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def check_attention(impl, case):
    args, dense = build(case)
    out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    got = impl(*args, out=out)
    assert got is out
    assert not got.isnan().any(), f"{int(got.isnan().sum())} output elements unwritten or NaN leaked from unused slots"
    tol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got.cpu().double(), naive_attention(case, dense), rtol=tol, atol=tol)


IMPLS = pytest.mark.parametrize("impl", [kernels.paged_attention_triton, kernels.paged_attention_ref], ids=["triton", "ref"])

# ---- paged_attention: properties ----


@st.composite
def cases(draw):
    num_seqs = draw(st.integers(1, 4))
    # query_len 1 is decode; context_len > 0 is a cached prefix (prefix cache hit or chunked prefill)
    seqs = [(draw(st.integers(0, 80)), draw(st.one_of(st.just(1), st.integers(1, 48)))) for _ in range(num_seqs)]
    num_kv_heads, group = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (3, 3), (2, 4), (2, 7), (1, 8)]))
    return Case(
        seqs=seqs,
        block_size=draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32, 64, 128, 256])),  # key tiles are 32 or 64
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=draw(st.sampled_from([16, 32, 64, 128, 8, 24])),  # 8 and 24: padded lanes
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        seed=draw(st.integers(0, 2**31)),
        temperature=draw(st.sampled_from([1.0, 4.0])),
        q_is_view=draw(st.booleans()),
    )


@IMPLS
@PROPERTY
@given(case=cases())
def test_paged_attention_matches_naive(impl, case):
    check_attention(impl, case)


@IMPLS
@settings(PROPERTY, max_examples=30)  # a narrower space than the main property
@given(
    seqs=st.lists(st.tuples(st.integers(0, 120), st.just(1)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 4, 16, 128]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31),
)
def test_paged_attention_decode_only(impl, seqs, block_size, dtype, seed):
    """A batch of only decodes takes the small-tile launch config."""
    check_attention(impl, Case(seqs=seqs, block_size=block_size, num_kv_heads=2, group=4, head_dim=32, dtype=dtype, seed=seed))


# the GQA shapes of real models: 9/3 (SmolLM-135M), 32/8 (Llama-3-8B), 14/2 (Qwen2-0.5B), and MHA
@IMPLS
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (8, 4, 128), (2, 7, 64), (4, 1, 64)])
def test_paged_attention_model_shapes(impl, num_kv_heads, group, head_dim):
    seqs = [(0, 40), (37, 1), (50, 30), (0, 1)]  # prefill, decode, prefix + prefill, first-token decode
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        check_attention(impl, Case(seqs, 16, num_kv_heads, group, head_dim, dtype, seed=7))


@IMPLS
def test_paged_attention_empty_batch(impl):
    args, _ = build(Case([(3, 2)], 4, 1, 1, 16, torch.float32))
    q, k_cache, v_cache, _, _, _, scale = args
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    got = impl(q[:0], k_cache, v_cache, torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), empty, torch.zeros(1, dtype=torch.int32, device=DEVICE), scale)
    assert got.shape == (0, 1, 16)


# ---- store_kv: properties ----


@pytest.mark.parametrize("impl", [kernels.store_kv_triton, kernels.store_kv_ref], ids=["triton", "ref"])
@PROPERTY
@given(
    num_tokens=st.integers(0, 40),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    block_size=st.sampled_from([1, 2, 3, 16, 64]),
    spare_blocks=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31),
)
def test_store_kv_writes_exactly_its_slots(impl, num_tokens, num_kv_heads, head_dim, block_size, spare_blocks, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) + spare_blocks
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=g).to(dtype)  # k and v: strided views, like a fused qkv
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]  # distinct slots: the engine never writes one twice
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1  # padding tokens: write nothing
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)  # (num_blocks, block_size, Hkv, D)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    want_k.view(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep]  # the written slots hold their rows ...
    want_v.view(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep]  # ... every other slot is untouched

    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    impl(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)


# ---- Clear errors ----


def _attention_args(**change):
    """Valid arguments for a small batch, with some replaced."""
    args, _ = build(Case([(5, 3), (0, 1)], 4, 2, 2, 16, torch.float32))
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "scale")
    kwargs = dict(zip(names, args))
    kwargs.update({name: fn(kwargs) for name, fn in change.items()})
    return kwargs


BAD_ATTENTION = {  # what is wrong -> (the change, words the message must contain)
    "q not 3-D": (dict(q=lambda a: a["q"][0]), "num_tokens, num_heads, head_dim"),
    "heads do not divide": (dict(q=lambda a: a["q"][:, :3]), "do not fit"),
    "head_dim differs": (dict(q=lambda a: a["q"][..., :8]), "do not fit"),
    "caches differ": (dict(v_cache=lambda a: a["v_cache"][:, :2]), "both caches"),
    "q float64": (dict(q=lambda a: a["q"].double()), "dtype"),
    "cache dtype differs": (dict(k_cache=lambda a: a["k_cache"].half(), v_cache=lambda a: a["v_cache"].half()), "dtype"),
    "block_tables int64": (dict(block_tables=lambda a: a["block_tables"].long()), "block_tables must be int32"),
    "seq_lens int64": (dict(seq_lens=lambda a: a["seq_lens"].long()), "seq_lens must be int32"),
    "query_start_loc too short": (dict(query_start_loc=lambda a: a["query_start_loc"][:-1]), "disagree on num_seqs"),
    "out wrong shape": (dict(out=lambda a: torch.empty_like(a["q"][1:])), "out must match q"),
}


@pytest.mark.parametrize("impl", [kernels.paged_attention_triton, kernels.paged_attention_ref, kernels.paged_attention], ids=["triton", "ref", "dispatch"])
@pytest.mark.parametrize("bad", BAD_ATTENTION, ids=list(BAD_ATTENTION))
def test_paged_attention_rejects(impl, bad):
    change, words = BAD_ATTENTION[bad]
    with pytest.raises(ValueError, match=words):
        impl(**_attention_args(**change))


def test_paged_attention_triton_rejects_what_only_it_cannot_do():
    wide = torch.zeros(4, 1, 512, device=DEVICE)
    cache = torch.zeros(2, 4, 1, 512, device=DEVICE)
    meta = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32))
    meta = [t.to(DEVICE) for t in meta]
    with pytest.raises(ValueError, match="head_dim 512"):
        kernels.paged_attention_triton(wide, cache, cache, *meta, 1.0)
    strided = torch.zeros(2, 4, 1, 32, 2, device=DEVICE)[..., 0]  # head_dim not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        kernels.paged_attention_triton(torch.zeros(4, 1, 32, device=DEVICE), strided, strided, *meta, 1.0)


def _store_args(**change):
    kwargs = dict(
        k=torch.zeros(3, 2, 16), v=torch.zeros(3, 2, 16), k_cache=torch.zeros(4, 2, 2, 16), v_cache=torch.zeros(4, 2, 2, 16),
        slot_mapping=torch.tensor([0, 5, -1]),
    )
    kwargs.update({name: fn(kwargs) for name, fn in change.items()})
    return {name: t.to(DEVICE) for name, t in kwargs.items()}


BAD_STORE = {
    "k and v differ": (dict(v=lambda a: a["v"][:2]), "k and v must both be"),
    "cache heads differ": (dict(k_cache=lambda a: a["k_cache"][:, :, :1], v_cache=lambda a: a["v_cache"][:, :, :1]), "caches must be"),
    "slot_mapping int32": (dict(slot_mapping=lambda a: a["slot_mapping"].int()), "slot_mapping must be int64"),
    "slot_mapping short": (dict(slot_mapping=lambda a: a["slot_mapping"][:2]), "slot_mapping must be int64"),
    "int cache": (dict(k_cache=lambda a: a["k_cache"].long(), v_cache=lambda a: a["v_cache"].long()), "float32, float16 or bfloat16"),
}


@pytest.mark.parametrize("impl", [kernels.store_kv_triton, kernels.store_kv_ref, kernels.store_kv], ids=["triton", "ref", "dispatch"])
@pytest.mark.parametrize("bad", BAD_STORE, ids=list(BAD_STORE))
def test_store_kv_rejects(impl, bad):
    change, words = BAD_STORE[bad]
    with pytest.raises(ValueError, match=words):
        impl(**_store_args(**change))


# ---- Dispatch and the CPU switch ----


def test_dispatch_picks_triton_for_cuda_or_the_cpu_switch(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "paged_attention_triton", lambda *a, **kw: calls.append("triton"))
    monkeypatch.setattr(kernels, "paged_attention_ref", lambda *a, **kw: calls.append("ref"))
    monkeypatch.setattr(kernels, "store_kv_triton", lambda *a, **kw: calls.append("triton"))
    monkeypatch.setattr(kernels, "store_kv_ref", lambda *a, **kw: calls.append("ref"))
    args = _attention_args()
    for flag in (False, True):
        monkeypatch.setattr(kernels, "USE_TRITON_ON_CPU", flag)
        calls.clear()
        kernels.paged_attention(**args)
        kernels.store_kv(**_store_args())
        assert calls == ["triton" if DEVICE == "cuda" or flag else "ref"] * 2


def test_dispatch_with_cpu_switch_runs_triton_and_matches(monkeypatch):
    monkeypatch.setattr(kernels, "USE_TRITON_ON_CPU", True)
    case = Case([(20, 5), (9, 1)], 8, 2, 3, 32, torch.float32, seed=3)
    check_attention(kernels.paged_attention, case)


def _run_python(code, interpret, triton_on_cpu=False):
    """Run code in a fresh interpreter (kernels.py freshly imported) from this directory."""
    env = {name: value for name, value in os.environ.items() if name not in ("TRITON_INTERPRET", "NANOBATCH_TRITON_ON_CPU")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if triton_on_cpu:
        env["NANOBATCH_TRITON_ON_CPU"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)), env=env, capture_output=True, text=True)


def test_without_triton_the_refs_work_and_triton_says_why():
    code = """
import sys
sys.modules["triton"] = None  # as if not installed: `import triton` raises ImportError
import torch, kernels
k_cache = torch.zeros(2, 4, 1, 16)
kernels.store_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), k_cache, k_cache.clone(), torch.tensor([5]))
assert k_cache[1, 1].eq(1).all()
out = kernels.paged_attention(torch.ones(1, 1, 16), k_cache, k_cache, torch.tensor([[0, 1]], dtype=torch.int32),
                              torch.tensor([6], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.25)
assert out.shape == (1, 1, 16)
try:
    kernels.paged_attention_triton(torch.ones(1, 1, 16), k_cache, k_cache, torch.tensor([[0, 1]], dtype=torch.int32),
                                   torch.tensor([6], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.25)
except RuntimeError as e:
    assert "triton is not installed" in str(e), e
else:
    raise AssertionError("no error")
"""
    result = _run_python(code, interpret=True)
    assert result.returncode == 0, result.stderr


def test_triton_on_cpu_without_interpreter_says_why():
    code = """
import torch, kernels
assert kernels.USE_TRITON_ON_CPU  # from NANOBATCH_TRITON_ON_CPU=1
try:
    kernels.store_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16), torch.tensor([5]))
except RuntimeError as e:
    assert "TRITON_INTERPRET=1" in str(e), e
else:
    raise AssertionError("no error")
"""
    result = _run_python(code, interpret=False, triton_on_cpu=True)
    assert result.returncode == 0, result.stderr


# ---- Real compilation, even without a GPU ----
# The interpreter accepts things the compiler rejects (tl.dot shapes, dtypes,
# control flow), so compile both kernels for an H100 (sm_90) with triton's own
# compiler and ptxas, in a fresh process where TRITON_INTERPRET is unset. Nothing
# runs; this only proves the kernels build for the launch configs the wrappers use.

COMPILE_FOR_SM90 = """
import triton, torch, kernels
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, pointer_dtype, consts, num_warps):
    # int arguments that are multiples of 16 and 16-byte aligned pointers, as the launcher would specialize them
    sig = {name: "constexpr" if name in consts else pointer_dtype(name) if name.endswith("_ptr") else "fp32" if name == "qk_scale" else "i32"
           for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name.endswith("_ptr") or name.startswith("stride")}
    constexprs = {(fn.arg_names.index(name),): value for name, value in consts.items()}
    triton.compile(ASTSource(fn, sig, constexprs, aligned), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

INT_PTRS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "q_block_seq_ptr": "*i32", "slot_mapping_ptr": "*i64"}
for dtype, group, head_dim, block_size, num_tokens in [("fp16", 4, 128, 16, 9), ("fp16", 4, 128, 16, 8), ("bf16", 7, 64, 1, 9), ("fp32", 1, 24, 256, 9)]:
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    block_m, block_q, tile_n = kernels._launch_config(num_tokens, 8, group, head_dim_padded)
    consts = dict(NUM_QUERIES_PER_KV=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
                  BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, DOT_IN_FP32=dtype == "fp32")
    build(kernels._paged_attention_kernel, lambda name: INT_PTRS.get(name, "*" + dtype), consts, num_warps=4)
build(kernels._store_kv_kernel, lambda name: INT_PTRS.get(name, "*bf16"), dict(BLOCK_SIZE=16, HEAD_DIM=80, HEAD_DIM_PADDED=128), num_warps=1)
print("compiled")
"""


def test_kernels_compile_for_sm90():
    result = _run_python(COMPILE_FOR_SM90, interpret=False)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


# ---- CUDA only: real compilation at model sizes ----


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_model_sized_batch(dtype, block_size):
    """Llama-3-8B heads (32/8, head_dim 128), long cached prefixes, prefills and decodes in one batch."""
    seqs = [(0, 300), (1500, 1), (700, 129), (2047, 1), (0, 1), (64, 64)]
    check_attention(kernels.paged_attention, Case(seqs, block_size, 8, 4, 128, dtype, seed=11))
    decodes = [(n, 1) for n in (1, 17, 513, 2000, 4095)]
    check_attention(kernels.paged_attention, Case(decodes, block_size, 8, 4, 128, dtype, seed=12))


@needs_gpu
def test_cuda_store_kv_large_slots():
    """Slots past 2**31 / (Hkv * D) elements: the cache offsets must be int64."""
    num_blocks, block_size = 2**31 // (16 * 2 * 64) + 8, 16  # the last blocks start past element 2**31
    k_cache = torch.zeros(num_blocks, block_size, 2, 64, dtype=torch.float16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([num_blocks * block_size - 1, 3], device="cuda")
    k = torch.randn(2, 2, 64, dtype=torch.float16, device="cuda")
    kernels.store_kv(k, -k, k_cache, v_cache, slots)
    assert torch.equal(k_cache[-1, -1], k[0]) and torch.equal(v_cache[0, 3], -k[1])
