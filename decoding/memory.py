"""A decode's working memory: the heap that gives freed buffers back, and the largest batch that fits a GPU.

`return_freed_memory()`: glibc's malloc raises its mmap threshold each time a large buffer is freed (up to 32 MB), so
the megabyte-sized temporaries of a forward (activations, the head's vocabulary chunks) land on the heap after the
first one, where fragments keep them resident: peak RSS climbs batch after batch above what is ever live. A fixed
threshold serves every buffer above it from mmap and unmaps it on free, so peak RSS tracks the live working memory
(at vocabulary 152k, prompt 300, K 20, batch 8: about 75 MB instead of 128-160 MB). Called once per decoding process.

`fit_batch(...)`: the users per decode that fit in the free memory of a device, from the model's shape (every layer's
keys and values for the prompt and the K(L-1) tree tokens, the widest activations of a prompt forward), K, L, the
prompt length and a headroom.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 1 << 20  # buffers of 1 MiB and more: mmap, given back on free


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold (see the module doc); True when set, False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False


def bytes_per_user(config, k: int, code_len: int, prompt_len: int, dtype: torch.dtype) -> int:
    """Peak bytes one user adds to a beam-search decode of `config`'s model: its rows of the tree cache (every layer's
    keys and values over prompt + K(L-1) tree tokens) plus the widest transient of the prompt forward (the MLP's
    gate, up and product over the prompt, the q/k/v projections, the layer's output), in `dtype`."""
    size = torch.finfo(dtype).bits // 8
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", 4 * hidden)
    columns = prompt_len + k * (code_len - 1)
    cache = 2 * layers * kv_heads * head_dim * columns * size
    forward = prompt_len * (3 * inter + (heads + 2 * kv_heads) * head_dim + 3 * hidden) * size
    step = k * (3 * inter + 4 * hidden) * size + k * heads * columns * 4  # a tree step, float32 attention scores
    return cache + max(forward, step)


def fit_batch(config, k: int, code_len: int, prompt_len: int, free_bytes: int, dtype: torch.dtype,
              head_bytes: int = 4 << 26, headroom: float = 0.2, most: int = 4096) -> int:
    """The largest batch (at least 1, at most `most`) whose decode fits in `free_bytes` after a `headroom` fraction is
    kept back and the head's vocabulary buffer (`head_bytes`, decoding/head.py) is set aside."""
    usable = free_bytes * (1 - headroom) - head_bytes
    return int(max(1, min(most, usable // bytes_per_user(config, k, code_len, prompt_len, dtype))))


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a decode can still allocate on `device` (CUDA: free + what torch's allocator holds unused); None on CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
