"""The decoding shapes `bench gpu` runs and `bench gpu --plan` costs (one list behind both): SID-GR's, Qwen2.5-0.5B's
and the shapes grid as `Shape`s, parity's dtypes, a cell's useful FLOPs per user, and the cold compile expected before
a run has compiled anything.

Useful FLOPs per user (the roofline): 2 x the body's parameters x (prompt + K(L-1)) tokens, plus 2 x hidden x vocabulary
x (1 + K(L-1)) head rows (exact scores need each row's full normaliser); attention's own products are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.bench.inputs import llama
from pipeline.bench.params import GpuParams

QWEN3_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
)
QWEN2_5_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
)
SMOKE_MODEL = dict(  # the anchor and the Qwen2.5 cell at smoke sizes
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
DTYPES = ("float32", "bfloat16", "float16")  # parity's
# A cold compile of one bucket's graphs, compiled by region (random Qwen3, hidden 128, prompt 40, K 8, batch 8, a
# fresh inductor cache; CPU seconds on a 2-core CPU, `bench compile`), by layers: what a compiled cell is expected to
# cost before this run has compiled anything (docs/benchmarks.md has the whole-step figures it replaced)
COLD_COMPILE_S = ((2, 33.5), (8, 35.6), (28, 38.1))


@dataclass
class Shape:
    """One decoding shape: a random `arch` model of `model` (tiny_model overrides) over `vocab` tokens, `users`
    prompts of `prompt` tokens (0: two of beam_search's largest batches), top-`k` over a catalog of `code_len`-token
    semantic IDs (Beauty's 4-level catalog after the text vocabulary, or `items` random ones of 256 codes per level)."""

    name: str
    vocab: int
    prompt: int
    k: int
    users: int
    model: dict
    arch: str = "llama"
    code_len: int = 4
    items: int | None = None
    batches: dict = field(default_factory=dict)  # method -> batch (None: beam_search's largest that fits)
    reference_users: int | None = None  # users given to transformers (its users/s is per user all the same)

    @property
    def layers(self) -> int:
        return self.model["num_hidden_layers"]


def prior_compile_s(layers: int) -> float:
    """COLD_COMPILE_S at `layers`, interpolated (and extended linearly past its last point)."""
    xs, ys = zip(*COLD_COMPILE_S)
    if layers <= xs[-1]:
        return float(np.interp(layers, xs, ys))
    return ys[-1] + (layers - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])


def sid_gr(p: GpuParams, batch: int | None) -> Shape:
    """SID-GR's shape (Qwen3-1.7B, vocabulary 151,936, context 1000, beam 256, 3 code tokens, 1M random items) at
    `batch` (None: the largest that fits, over two such batches)."""
    model, vocab, k, prompt, items = (
        (SMOKE_MODEL, 4096, 8, 40, 2000) if p.smoke else (QWEN3_1_7B, 151936, 256, 1000, 1_000_000)
    )
    users = 0 if batch is None else 2 * batch if p.smoke else {8: 32, 1: 8}[batch]
    name = f"SID-GR batch {batch or 'largest'}"
    return Shape(name, vocab, prompt, k, users, model, "qwen3", 3, items, batches={"beam_search": batch})


def qwen(p: GpuParams) -> Shape:
    """Qwen2.5-0.5B's shape: vocabulary 151,936, prompt 300, K 20, Beauty's catalog after the text vocabulary, at
    the largest batch that fits."""
    if p.smoke:
        return Shape("Qwen2.5-0.5B", 4096, 40, 5, 0, SMOKE_MODEL, "qwen2")
    return Shape("Qwen2.5-0.5B", 151936, 300, 20, 0, QWEN2_5_0_5B, "qwen2")


def grid(p: GpuParams) -> list[Shape]:
    """The shapes grid: vocabulary x prompt x K on a random Llama of layers x hidden."""
    model = dict(llama(p.hidden, p.layers, p.heads), max_position_embeddings=2048)
    cells = [(2048, 40, 5)] if p.smoke else [(v, s, k) for v in (32768, 152667) for s in (300, 1000) for k in (20, 50)]
    return [
        Shape(
            f"V={v} S={s} K={k}",
            v,
            s,
            k,
            4 if p.smoke else 64,
            model,
            batches={"beam_search": 2 if p.smoke else None, "transformers": 2 if p.smoke else p.batch},
            reference_users=None if p.smoke else 16,
        )
        for v, s, k in cells
    ]


def useful_flops(model, prompt: int, k: int, code_len: int) -> float:
    """Per user: the prompt and the K(L-1) tree tokens through the body (2 x its parameters each), plus 1 + K(L-1)
    full-vocabulary head rows."""
    body = sum(p.numel() for name, p in model.base_model.named_parameters() if "embed_tokens" not in name)
    vocab, hidden = model.get_output_embeddings().weight.shape
    tree = k * (code_len - 1)
    return 2.0 * body * (prompt + tree) + 2.0 * hidden * vocab * (1 + tree)
