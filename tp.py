"""
Tensor parallelism for nanobatch: one model split over N ranks, so a model N times larger than one
device runs. An option in its own module, as gpt-fast keeps its tp.py: nanobatch.py + kernels.py are
the whole single-device engine, and nanobatch imports this file only when tensor_parallel_size > 1 or
under torchrun.

Megatron-style: q/k/v and gate/up are column-parallel (each rank computes its heads / its slice of the
MLP), o_proj and down_proj row-parallel (each rank's partial sum, then one all-reduce each: two per
layer), the embedding vocab-parallel (each rank looks up its rows, one all-reduce), the lm_head's
logits gathered on rank 0. Rank 0 runs the scheduler and the sampler; each step it broadcasts the
model's inputs, so the other ranks keep no scheduling state of their own (nothing to drift after a
preemption): they hold their shard of the weights and their heads' KV pool, indexed by rank 0's block
ids. gloo on CPU, NCCL on CUDA.

The engine reaches it through one object, `LLM.tp` (a TensorParallel), at these hooks:
    LLM.__init__   nanobatch.start_tensor_parallel -> start(); at its end ready(): ranks > 0 then serve
                   rank 0's steps and exit
    load_model     shard_config (the model's shapes), load_safetensors + shard (only this rank's
                   slices), parallelize (the all-reduces and the logits gather)
    KV pool        min_over_ranks: every rank takes the smallest pool, so block ids agree
    LLM.step       broadcast_step: the step's inputs to the other ranks

Run:  LLM(model=..., tensor_parallel_size=2)     (ranks 1..N-1 spawned on this machine)
      torchrun --nproc-per-node 2 your_script.py   (every rank runs the script; rank 0 drives)
"""

import contextlib
import dataclasses
import datetime
import os
import signal
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

_WORKER_TP = None  # set in a spawned rank before it builds its LLM
_RANK0_TP = None  # rank 0's group in this process (a weakref), while it runs
TP_START_SECONDS = 120  # a rank that has not joined by then (loading is after joining) failed to start


class TPError(RuntimeError):
    """A rank of the tensor-parallel group died or failed to start."""


class TensorParallel:
    """This process's place in the group, and the engine's hooks. On rank 0, shutdown() (or the LLM
    being collected, or exit: a weakref.finalize, so it runs once) tells the other ranks to stop and
    waits for them. The ranks meet in collectives, so a rank 0 stopped between two of them (Ctrl-C,
    an error while the LLM is built) leaves the others waiting inside one, for good: `state` says
    when that may be (before the LLM is ready, and from each step's broadcast to its logits), and
    the ranks are then killed, not told."""

    def __init__(self, rank, size, procs=()):
        self.rank, self.size, self.procs = rank, size, list(procs)  # procs: the ranks rank 0 spawned
        self.state = {"ready": False, "in_step": False}  # shared with the finalizer, which must not hold self
        self.shutdown = weakref.finalize(self, _stop_ranks, rank, self.procs, self.state)

    def ready(self, llm):
        """The end of LLM.__init__: rank 0 may now step; ranks > 0 serve rank 0's steps (and exit)."""
        self.state["ready"] = True
        if self.rank > 0:
            self.serve(llm)

    def check_alive(self):
        if not self.shutdown.alive:
            raise TPError(
                "this LLM's tensor-parallel ranks were stopped (llm.tp.shutdown(), or an interrupted step): "
                "make a new LLM"
            )
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise TPError(
                    f"tensor-parallel rank {rank} died (exit code {proc.exitcode}; its error is on stderr); "
                    "the engine cannot run without it. "
                    "A script that starts ranks needs `if __name__ == '__main__':` around its code"
                )

    @contextlib.contextmanager
    def clear_errors(self):
        """A collective that fails on rank 0 because a rank died says which rank, not gloo's socket error."""
        try:
            yield
        except RuntimeError as error:
            if isinstance(error, TPError) or self.rank != 0:
                raise
            time.sleep(0.5)  # a closed connection may be seen before the process is reaped
            self.check_alive()
            raise TPError(f"a tensor-parallel collective failed: {error}") from error

    def all_reduce(self, x, op=dist.ReduceOp.SUM):
        with self.clear_errors():
            dist.all_reduce(x, op=op)  # in place: over the ranks
        return x

    # -- loading: each rank holds its shard --

    def shard_config(self, cfg):
        """The ModelConfig of this rank's shard (the engine keeps the whole model's for everything else)."""
        return shard_plan(cfg, self.rank, self.size)[1]

    def load_safetensors(self, files):
        """name -> a lazy slice of a safetensors file: shard() reads only this rank's part (~1/N of the bytes)."""
        from safetensors import safe_open

        handles = [safe_open(f, framework="pt") for f in files]
        return {k: h.get_slice(k) for h in handles for k in h.keys()}

    def shard(self, name, t, cfg):
        """This rank's slice of checkpoint tensor `name`. t is a tensor or a lazy safetensors slice (only the
        slice is read). Row-parallel biases live on rank 0 only (zeros elsewhere): the all-reduce adds them once."""
        (q0, kv0, i0), local = shard_plan(cfg, self.rank, self.size)
        d, q, kv, i = (
            cfg.head_dim,
            local.num_heads * cfg.head_dim,
            local.num_kv_heads * cfg.head_dim,
            local.intermediate_size,
        )
        column = {
            "q_proj": (q0 * d, q),
            "k_proj": (kv0 * d, kv),
            "v_proj": (kv0 * d, kv),
            "gate_proj": (i0, i),
            "up_proj": (i0, i),
        }
        row = {"o_proj": (q0 * d, q), "down_proj": (i0, i)}
        module = name.split(".")[-2] if "." in name else ""
        if module in column:
            start, size = column[module]
            return t[start : start + size]  # (size, hidden) or (size,)
        if module in row and name.endswith("weight"):
            start, size = row[module]
            return t[:, start : start + size]  # (hidden, size)
        if module in row:  # the bias, (hidden,)
            return t[:] if self.rank == 0 else torch.zeros(t.get_shape() if hasattr(t, "get_shape") else t.shape)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start = self.rank * local.vocab_size
            rows = t[start : min(start + local.vocab_size, cfg.vocab_size)]  # (<= local vocab, hidden)
            return F.pad(
                rows, (0, 0, 0, local.vocab_size - rows.shape[0])
            )  # padded rows: never looked up, logits cut off
        return t[:]

    def parallelize(self, model, cfg):
        """Where the ranks must meet: two all-reduces per layer, one for the embedding, the logits gather.
        o_proj and down_proj stay plain nn.Linear (CPU weight packing still applies): a forward hook sums
        each rank's partial product (its bias is zero but on rank 0) over the ranks, in place."""
        for layer in model.model.layers:
            for row_parallel in (layer.self_attn.o_proj, layer.mlp.down_proj):
                row_parallel.register_forward_hook(lambda module, args, out: self.all_reduce(out))  # (T, hidden)
        model.model.embed_tokens = VocabParallelEmbedding(
            model.model.embed_tokens, self.rank * model.cfg.vocab_size, self
        )
        model.lm_head = GatheredLMHead(model.lm_head, cfg.vocab_size, self)

    def min_over_ranks(self, num_blocks, device):
        """Every rank sizes its KV pool from its own memory; all take the smallest, so block ids agree.
        On the engine's device: NCCL reduces only CUDA tensors."""
        return int(self.all_reduce(torch.tensor([num_blocks], device=device), op=dist.ReduceOp.MIN))

    # -- each step: rank 0 sends, the others run the model --

    def broadcast_step(self, block_copies, input_ids, positions, meta):
        """Rank 0: this step's inputs to every other rank (one pickled broadcast; on CUDA via host memory)."""
        self.check_alive()
        if self.state["in_step"]:  # the last step never reached its logits: the other ranks wait inside it
            self.shutdown()
            raise TPError(
                "a step of this tensor-parallel LLM was interrupted, so its ranks are out of step; they are "
                "stopped: make a new LLM"
            )
        self.state["in_step"] = True  # until GatheredLMHead has the step's logits
        with self.clear_errors():
            dist.broadcast_object_list([_to_device((block_copies, input_ids, positions, meta), "cpu")], src=0)

    def serve(self, llm):
        """Ranks > 0: run the model on each step rank 0 broadcasts (copy-on-write block copies first, as
        LLM.step does) until rank 0 sends None, then leave the group and exit. The logits go to rank 0. An
        error in the model ends this rank with its traceback (rank 0 then names the rank that died)."""
        while True:
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0)
            except RuntimeError:
                break  # rank 0 went away (the connection closed): nothing left to serve
            if box[0] is None:
                break
            copies, input_ids, positions, meta = _to_device(box[0], llm.device)
            with torch.inference_mode():
                for src, dst in copies:
                    llm.kv_pool[:, :, dst] = llm.kv_pool[:, :, src]
                llm.model(input_ids, positions, llm.layer_caches, meta)
        dist.destroy_process_group()
        sys.exit(0)


def _to_device(step, device):
    copies, input_ids, positions, meta = step
    fields = {
        f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name != "attn_plan"
    }  # the plan is made per rank
    tensors = {name: v.to(device) for name, v in fields.items() if isinstance(v, torch.Tensor)}
    return copies, input_ids.to(device), positions.to(device), dataclasses.replace(meta, attn_plan=None, **tensors)


def shard_plan(cfg, rank, size):
    """Where this rank's slices start: (first query head, first KV head, first MLP column), and its
    ModelConfig: its query heads, its KV heads, its MLP columns, its vocabulary rows (padded to ceil(V/N)).
    KV heads are split whole, each with its group of query heads (SmolLM2's 3 over 2 ranks: 1 and 2);
    with fewer KV heads than ranks, each rank holds a copy of the KV head its query heads read."""
    r, n, heads, kv_heads = rank, size, cfg.num_heads, cfg.num_kv_heads
    if kv_heads >= n:
        kv0, kv1 = r * kv_heads // n, (r + 1) * kv_heads // n
        group = heads // kv_heads
        q0, num_q, num_kv = kv0 * group, (kv1 - kv0) * group, kv1 - kv0
    elif n % kv_heads == 0 and heads % n == 0:
        kv0, num_kv, num_q = r * kv_heads // n, 1, heads // n
        q0 = r * num_q
    else:
        raise ValueError(
            f"tensor_parallel_size {n} exceeds the model's {kv_heads} KV heads, so it must be a multiple of them "
            f"and divide its {heads} attention heads"
        )
    i0, i1 = r * cfg.intermediate_size // n, (r + 1) * cfg.intermediate_size // n
    local = dataclasses.replace(
        cfg, num_heads=num_q, num_kv_heads=num_kv, intermediate_size=i1 - i0, vocab_size=-(-cfg.vocab_size // n)
    )
    return (q0, kv0, i0), local


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, start + local vocab): it looks up its own ids, zeros for the rest, then
    all-reduce."""

    def __init__(self, embedding, start, tp):
        super().__init__()
        self.embedding, self.start, self.tp = embedding, start, tp

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.embedding.num_embeddings)  # (T,)
        x = self.embedding(local.clamp(0, self.embedding.num_embeddings - 1))  # (T, hidden)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class GatheredLMHead(nn.Module):
    """Each rank's logits for its vocabulary slice, gathered on rank 0 (the sampler's rank); None elsewhere."""

    def __init__(self, linear, vocab_size, tp):
        super().__init__()
        self.linear, self.vocab_size, self.tp = linear, vocab_size, tp

    def forward(self, x):
        logits = self.linear(x).contiguous()  # (S, local vocab)
        parts = [torch.empty_like(logits) for _ in range(self.tp.size)] if self.tp.rank == 0 else None
        with self.tp.clear_errors():
            dist.gather(logits, parts, dst=0)
        self.tp.state["in_step"] = False  # every rank is through this step
        return torch.cat(parts, dim=-1)[:, : self.vocab_size] if parts else None  # (S, vocab): padding cut off


# ---- Starting and stopping the ranks ----


def start(config):
    """This process's place in the group: under torchrun (WORLD_SIZE set) the env:// rendezvous; else
    rank 0, which spawns ranks 1..N-1 on this machine and waits for them to join (in a spawned rank:
    the place it was given)."""
    import nanobatch

    if _WORKER_TP is not None:
        return _WORKER_TP
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # torchrun: every rank runs this same program
        if config.tensor_parallel_size not in (1, world):
            raise ValueError(
                f"tensor_parallel_size is {config.tensor_parallel_size} but torchrun started {world} ranks"
            )
        config.tensor_parallel_size, rank = world, int(os.environ["RANK"])
        config.device = _rank_device(config.device, int(os.environ.get("LOCAL_RANK", rank)))
        timeout = datetime.timedelta(days=365) if rank else None  # see _rank_main
        dist.init_process_group(_backend(config.device), rank=rank, world_size=world, timeout=timeout)
        return TensorParallel(rank, world)
    global _RANK0_TP
    if (earlier := _RANK0_TP and _RANK0_TP()) is not None and not earlier.state["ready"]:
        earlier.shutdown()  # an LLM whose construction failed (its error may still hold it): its ranks go
    if dist.is_initialized():
        raise ValueError(
            "this process already runs a tensor-parallel LLM: one per process (delete it, or call llm.tp.shutdown())"
        )
    hf_config = nanobatch.read_config(config.model or nanobatch.default_model_path())[0]
    shard_plan(
        nanobatch.ModelConfig.from_hf(hf_config), 0, config.tensor_parallel_size
    )  # a size the heads refuse fails before spawning
    tp = _spawn_ranks(config)
    _RANK0_TP = weakref.ref(tp)
    return tp


def _rank_device(device, local_rank):
    """This rank's device: one GPU per rank, made current (NCCL's object broadcasts use it); a CPU as it is."""
    if not device.startswith("cuda"):
        return device
    torch.cuda.set_device(f"cuda:{local_rank}")
    return f"cuda:{local_rank}"


def _backend(device):
    return "nccl" if device.startswith("cuda") else "gloo"


def _spawn_ranks(config):
    import torch.multiprocessing as mp

    n = config.tensor_parallel_size
    config.device = _rank_device(config.device, 0)
    # rank 0 hosts the rendezvous store; the ranks check in there first, so that one that fails to
    # start is seen while rank 0 waits (process liveness), not after a rendezvous timeout
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of this process's threads or CUDA state
    kwargs = dataclasses.asdict(config)
    tp = TensorParallel(
        0, n, [ctx.Process(target=_rank_main, args=(r, n, store.port, kwargs), daemon=True) for r in range(1, n)]
    )
    for proc in tp.procs:
        proc.start()
    deadline = time.monotonic() + TP_START_SECONDS
    while not store.check([f"joined/{r}" for r in range(1, n)]):
        tp.check_alive()
        if time.monotonic() > deadline:
            tp.shutdown()
            raise TPError(f"tensor-parallel ranks did not start within {TP_START_SECONDS} s")
        time.sleep(0.05)
    dist.init_process_group(_backend(config.device), store=store, rank=0, world_size=n)
    return tp


def _rank_main(rank, size, port, kwargs):
    """A spawned rank: join the group, build the same LLM (its shard), serve rank 0's steps."""
    import nanobatch

    global _WORKER_TP
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the whole process group: rank 0 decides (as vLLM's workers)
    if kwargs["device"] == "cpu":  # the ranks share this machine's cores: N processes of all-core threads would fight
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    store.set(f"joined/{rank}", "1")
    kwargs = {**kwargs, "device": _rank_device(kwargs["device"], rank)}
    # a rank waits for rank 0's next step as long as rank 0 stays idle: no collective timeout that matters
    dist.init_process_group(
        _backend(kwargs["device"]), store=store, rank=rank, world_size=size, timeout=datetime.timedelta(days=365)
    )
    _WORKER_TP = TensorParallel(rank, size)
    nanobatch.LLM(**kwargs)  # does not return: its TensorParallel.serve serves rank 0's steps, then exits


def _stop_ranks(rank, procs, state):
    stuck = not state["ready"] or state["in_step"]  # the ranks wait inside a collective that will never end
    try:
        if rank == 0 and dist.is_initialized() and all(p.is_alive() for p in procs) and not stuck:
            dist.broadcast_object_list([None], src=0)  # None: stop
    except RuntimeError:
        pass  # a rank is gone already: the group cannot carry the message; kill below
    for proc in (p for p in procs if p.pid is not None):  # started ones
        proc.join(timeout=0 if stuck else 10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if dist.is_initialized():
        dist.destroy_process_group()
