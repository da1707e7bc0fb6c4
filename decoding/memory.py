"""A decode's working memory: the largest batch that fits a device.

`fit_batch(...)`: the users per decode that fit in the free memory of a device, from the models' shapes (every layer's
keys and values for the prompt and the tree tokens, the widest transients of a forward), K, L, the prompt length and a
headroom. An estimate: the nightly actor halves its batch on out-of-memory all the same. `parameter_count(config)`:
a model's weights; `audit_placement(...)`: whether the precision audit's float32 copies fit the device, the host or
neither (pipeline/sizing.py builds docs/sizing.md's table from them).
"""

from __future__ import annotations

import os

import torch


def bytes_per_user(config, prompt_len: int, tree_tokens: int, queries: int, dtype: torch.dtype) -> int:
    """Peak bytes one user adds to a decode of `config`'s model: its rows of the tree cache (every layer's keys and
    values over the prompt and `tree_tokens` tree tokens), plus the wider of the prompt forward's transients (the MLP's
    gate, up and product, the q/k/v projections, the layer's output, over the prompt) and a tree step's (the same over
    `queries` tree tokens, with their float32 attention scores), in `dtype`."""
    size = torch.finfo(dtype).bits // 8
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    columns = prompt_len + tree_tokens
    cache = 2 * layers * kv_heads * head_dim * columns * size
    width = 3 * inter + (heads + 2 * kv_heads) * head_dim + 3 * hidden  # one token's transients in a layer
    step = queries * width * size + queries * heads * columns * 4
    return int(cache + max(prompt_len * width * size, step))


def decode_bytes_per_user(
    target,
    prompt_len: int,
    k: int,
    code_len: int,
    dtype: torch.dtype,
    mode: str = "beam",
    draft=None,
    draft_beams: int | None = None,
    gamma: int | None = None,
) -> int:
    """bytes_per_user for a decoding mode: beam search holds K(L-1) tree tokens and runs K queries a step; DISC up to
    2KL (its cache's capacity); speculative decoding the target's K(L + gamma) and the draft's N L (N drafted
    sequences), with K gamma verify queries."""
    if mode.startswith("atspeed") and draft is not None:
        n, g = draft_beams or max(40, k), gamma or code_len
        return bytes_per_user(target.config, prompt_len, k * (code_len + g), k * g, dtype) + bytes_per_user(
            draft.config, prompt_len, n * code_len, n, dtype
        )
    tree = 2 * k * code_len if mode == "disc" else k * (code_len - 1)
    return bytes_per_user(target.config, prompt_len, tree, 2 * k if mode == "disc" else k, dtype)


def fit_batch(
    per_user: int, free_bytes: int, head_bytes: int = 8 << 26, headroom: float = 0.2, most: int = 4096
) -> int:
    """The largest batch (at least 1, at most `most`) of users of `per_user` bytes that fits in `free_bytes` after a
    `headroom` fraction is kept back and the head's vocabulary buffers (`head_bytes`: two float32 buffers of the CUDA
    budget, decoding/head.py) are set aside."""
    return int(max(1, min(most, usable_bytes(free_bytes, head_bytes, headroom) // max(per_user, 1))))


def usable_bytes(free_bytes: int, head_bytes: int = 8 << 26, headroom: float = 0.2) -> float:
    """What a decode may use of `free_bytes`: a `headroom` fraction kept back, the head's buffers set aside."""
    return free_bytes * (1 - headroom) - head_bytes


def parameter_count(config) -> int:
    """The weights of a Llama-, Mistral-, Qwen2- or Qwen3-like decoder from its config: embeddings (and an untied LM
    head), per layer the q/k/v/o projections (q/k/v biases: Qwen2's, or `attention_bias`), the gated MLP and its
    RMSNorms, and the final norm."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    bias = getattr(config, "attention_bias", config.model_type == "qwen2")
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv) * bias
    norms = 2 * hidden + (2 * head_dim if config.model_type == "qwen3" else 0)  # Qwen3: q and k RMSNorms too
    layer = attention + 3 * hidden * inter + norms
    embed = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return embed + config.num_hidden_layers * layer + hidden


def audit_placement(
    weights: int, per_user: int, beside: int, device_free: int | None, host_free: int
) -> tuple[str | None, str]:
    """Where the precision audit's float32 copies go -> ("device" | "cpu" | None, why). "device" when their
    `weights`, one audited user's float32 decode (`per_user`) and `beside` (the run's own decode batch, which shares
    the device with them while the audit lasts) fit the device's usable memory (`device_free`; None: the actor has no
    GPU); else "cpu" when the weights and one user's decode fit the host's available memory; else None: skipped."""
    need, gib = weights + per_user, 1 << 30
    if device_free is not None and need + beside <= usable_bytes(device_free):
        return "device", ""
    if need <= usable_bytes(host_free, head_bytes=0):
        return "cpu", ""
    where = "" if device_free is None else f"the device has {device_free / gib:.1f} GiB free, "
    return None, (
        f"the float32 copies need {need / gib:.1f} GiB (+ {beside / gib:.1f} GiB of the run's decode batch on a "
        f"device): {where}the host {host_free / gib:.1f} GiB available"
    )


def host_free_memory() -> int:
    """Bytes the host can still give (MemAvailable of /proc/meminfo; elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def trim_host_heap() -> bool:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim) -> whether it could. Building a large
    catalog index frees temporaries several times the index's size, which glibc otherwise keeps in the process for
    reuse: an actor would hold them for its whole life. A no-op (False) without glibc."""
    import ctypes
    import ctypes.util

    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a decode can still allocate on `device` (CUDA: free + what torch's allocator holds unused); None on CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
