"""
kernels.py: the two kernels a paged-KV-cache engine needs, each as a plain-torch
reference and (next step) a Triton kernel, plus the dispatcher nanobatch.py calls.

    store_kv(k, v, k_cache, v_cache, slot_mapping)
        write the K/V rows of this step's new tokens into the paged cache
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        causal attention of the new tokens over everything cached for their sequence

Cache layout (one per layer, for K and for V):
    (num_blocks, block_size, num_kv_heads, head_dim)
    token at position p of a sequence lives at
    block_tables[seq, p // block_size], row p % block_size
    and its flat "slot" is block_id * block_size + p % block_size.
"""

import torch

# ---- Shape checks shared by every implementation ----


def _check_store_kv(k, v, k_cache, v_cache, slot_mapping):
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"store_kv: k and v must both be (num_tokens, num_kv_heads, head_dim), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"store_kv: caches must be (num_blocks, block_size, {k.shape[1]}, {k.shape[2]}), got {tuple(k_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"store_kv: slot_mapping must be int64 of shape ({k.shape[0]},), got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def _check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: q must be (num_tokens, num_heads, head_dim) and both caches (num_blocks, block_size, num_kv_heads, head_dim), got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"paged_attention: {num_heads} query heads of dim {head_dim} do not fit {num_kv_heads} kv heads of dim {k_cache.shape[3]}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"paged_attention: block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} and query_start_loc {tuple(query_start_loc.shape)} disagree on num_seqs")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"paged_attention: {name} must be int32, got {t.dtype}")


# ---- Plain-torch references ----


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    _check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0  # -1 marks a token whose K/V must not be written
    slots = slot_mapping[keep]
    # a flat view: slot s is row s of (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def _gather_kv(cache, block_table_rows, max_len):
    """Gather the cache rows of some sequences into a dense (num_seqs, max_len, kv_heads, head_dim)."""
    num_blocks, block_size = cache.shape[:2]
    blocks_needed = (max_len + block_size - 1) // block_size
    ids = block_table_rows[:, :blocks_needed].long().clamp(0, num_blocks - 1)  # unused entries may hold anything
    dense = cache[ids]  # (num_seqs, blocks_needed, block_size, kv_heads, head_dim)
    return dense.flatten(1, 2)[:, :max_len]  # (num_seqs, max_len, kv_heads, head_dim)


def _attend(q, k, v, key_valid, mask, scale):
    """q (S, Hkv, G*Q, D) packed by kv head; k, v (S, L, Hkv, D); key_valid (S, L) marks the
    gathered rows that belong to the sequence; mask (S, 1, G*Q or 1, L) is the causal rule."""
    k = k.transpose(1, 2).float()  # (S, Hkv, L, D)
    v = v.masked_fill(~key_valid[:, :, None, None], 0.0).transpose(1, 2).float()  # NaN in unused slots: NaN * 0 is NaN
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # (S, Hkv, G*Q, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key gives 0, not NaN
    return probs @ v  # (S, Hkv, G*Q, D)


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Decode rows (query_len 1) are batched into one dense attention; prefill
    sequences go one at a time (their query lengths differ)."""
    _check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens = seq_lens.tolist()
    starts = query_start_loc[:-1].tolist()

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        rows = query_start_loc[idx].long()
        max_len = max(lens[i] for i in decode)
        k = _gather_kv(k_cache, block_tables[idx], max_len)  # (S, L, Hkv, D)
        v = _gather_kv(v_cache, block_tables[idx], max_len)
        qd = q[rows].view(len(decode), num_kv_heads, group, head_dim)  # (S, Hkv, G, D)
        valid = torch.arange(max_len, device=q.device) < seq_lens[idx, None].long()  # (S, L)
        o = _attend(qd, k, v, valid, valid[:, None, None, :], scale)  # (S, Hkv, G, D)
        out[rows] = o.reshape(len(decode), num_heads, head_dim).to(q.dtype)

    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len, start = lens[i], starts[i]
        k = _gather_kv(k_cache, block_tables[i : i + 1], seq_len)  # (1, L, Hkv, D)
        v = _gather_kv(v_cache, block_tables[i : i + 1], seq_len)
        # pack the group's query heads next to each other: (Q, H, D) -> (1, Hkv, G*Q, D), row = head * Q + token
        qs = q[start : start + q_len].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qs = qs.reshape(1, num_kv_heads, group * q_len, head_dim)
        # causal rule: query token t sits at position seq_len - q_len + t and sees keys at positions <= that
        q_pos = torch.arange(q_len, device=q.device).repeat(group) + (seq_len - q_len)  # (G*Q,)
        valid = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (G*Q, L)
        all_keys = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        o = _attend(qs, k, v, all_keys, valid[None, None], scale)  # (1, Hkv, G*Q, D)
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)  # (Q, Hkv, G, D)
        out[start : start + q_len] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


# ---- Dispatch: what nanobatch.py calls ----


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    return store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
