"""The compiled engine: `beam_search(..., engine="compiled")` on fixed shapes per bucket, compiled by region.

The eager engine (decoding/beam.py) is the reference; this one returns the same items, token ids, scores and base
stats, and runs the same pieces (`candidates`, `topk_stable`, `pick` from decoding/search.py, the catalog's CSR
children, the model's own decoder layers, the head's chunk products) on shapes that never change within a bucket, so
that each region compiles once with `torch.compile(fullgraph=True, dynamic=False)` (gpt-fast's static KV cache,
transformers' StaticCache):

- **Buckets.** A batch of b users with prompts of s tokens runs as `Bucket.of(b, s, k, depth)`: users padded to a
  power of two (a decode batch is usually the configured batch, its remainder one smaller bucket: log2 buckets at
  most) and the prompt left-padded to 16, 24, 32, 48, 64, 96, ... (each step 1.5x or 1.33x the last: at most a third
  of a prompt is padding, with two buckets per doubling of the length). Padded users are one-token dummies; padded
  columns are masked like any left padding, so real users' results do not depend on the bucket.
- **Slots.** One `Slots` per bucket, allocated once and reused by every batch of that bucket: each layer's keys and
  values [B, H_kv, P + S + T, D] (P shared-prefix columns copied once, S prompt columns, T = K(L-1) tree columns, tree
  column `l K + i` holding beam i's node of level l), the inputs, and the beam state (scores, tokens, catalog nodes,
  each beam's ancestors' tree columns, the level). The regions write them in place (`index_copy_` at tensor offsets),
  and the step's inputs keep their addresses (what a CUDA graph replay needs).
- **Regions** (PyTorch's regional compilation: the cold compile costs about one layer's, not the model's). `prefill`
  (the prompts into the cache, the root's children scored, the first selection) and `step` (the K tokens chosen at the
  last level forwarded as tree nodes, their children scored, the next selection; the same for every level: the level
  is a tensor in the slots) each run an input region (embeddings, positions, mask), every decoder layer through one
  compiled layer region (`run_layer`: the layers differ only in their weights, its inputs; each gets its own cache
  buffers in a `LayerKV`, so no per-layer constant enters its guards), and an output region (norm, children's
  scores, selection): GRAPHS_PER_BUCKET graphs whatever the depth. Selection runs on the device (stable sort: ties to
  the lower (beam, token) pair, as `topk_stable`), children padded to the catalog's widest level. Every tensor
  operation is inside a fullgraph region, so no host sync hides in a step. On CUDA the whole step is captured as one
  CUDA graph (`Engine.step_graph`) and replayed; on a CPU each region's kernels and wrapper are one C++ file
  (cpp_wrapper).
- **Attention.** Each node attends its user's prompt (prefix included) and its own ancestors. "flex": FlexAttention
  with a `BlockMask` built in the input region (on CUDA whole masked blocks are skipped); "sdpa":
  scaled_dot_product_attention over the same mask as an additive tensor. Both keep grouped-query heads unrepeated
  (enable_gqa). The model's decoder layers run unchanged, through views whose config names this attention (the model
  itself is not modified).
- **Head.** The children's log-probabilities (log_softmax over the full vocabulary, float32) from the head's chunk
  products, at most `MAX_CHUNKS` chunks, with no host sync (the eager `Head.score` reads the asked tokens' range).

Llama, Qwen2, Qwen3 and Mistral (whose decoder layers this calls as they are); anything else, sampling beam search
(do_sample) and per-user exclusions run eager (`runs_eager` says why; `beam_search` puts it in
stats["engine_note"]). `warm_up` compiles a bucket ahead and makes smaller decodes snap to it (the nightly actor's
start); `use_compile_cache` points inductor's on-disk cache at a folder per torch version and CPU kernel family.
"""

from __future__ import annotations

import copy
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
import transformers
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AttentionInterface

from decoding.catalog import Catalog
from decoding.head import Head
from decoding.models import cache_keyword_of, with_cache
from decoding.search import Children, Recommendations, candidates, head_of, pick, topk_stable
from decoding.stats import Meter, beam_batch_kv

NEG_INF = float("-inf")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
ATTENTION = {"flex": "genrec_tree_flex", "sdpa": "genrec_tree_sdpa"}  # engine attention -> registered interface
GRAPHS_PER_BUCKET = 6  # the prefill's and the step's input and output, and the decoder layer at both shapes
MAX_CHUNKS = 16  # vocabulary chunks of the head inside a graph (each is unrolled into it)
RECOMPILE_LIMIT = 256  # graphs per compiled function (every bucket of every model is one)
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------- buckets


def users_bucket(n: int) -> int:
    """Users -> the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def prompt_bucket(n: int) -> int:
    """Prompt tokens -> the smallest of 16, 24, 32, 48, 64, 96, ... (2^i and 1.5 x 2^i) that holds them."""
    size = 16
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
    return size


@dataclass(frozen=True)
class Bucket:
    users: int  # B: rows of every tensor (real users first, then dummies)
    prompt: int  # S: prompt columns after the shared prefix (left padding first)
    k: int  # K beams
    depth: int  # levels decoded (L, or `steps`)

    @classmethod
    def of(cls, users: int, prompt: int, k: int, depth: int) -> Bucket:
        return cls(users_bucket(users), prompt_bucket(prompt), k, depth)


# ---------------------------------------------------------------- the state a bucket's graphs share


@dataclass
class Slots:
    """One bucket's buffers, allocated once and written in place by its graphs. Shapes: B users, S prompt columns,
    P prefix columns, T = K (L - 1) tree columns, L code levels."""

    keys: list  # per layer [B, H_kv, P + S + T, D]
    values: list  # per layer [B, H_kv, P + S + T, D]
    input_ids: torch.Tensor  # [B, S] left-padded prompts
    prompt_mask: torch.Tensor  # [B, P + S] bool: real prompt columns (the prefix's included)
    score: torch.Tensor  # [B, K] float32 sequence log-probs of the beams (-inf: dead)
    token: torch.Tensor  # [B, K] int64 each beam's last token (0 when dead)
    node: torch.Tensor  # [B, K] int64 its catalog trie node (-1: dead)
    tokens: torch.Tensor  # [B, K, L] int64 each beam's tokens so far
    path: torch.Tensor  # [B, K, L - 1] int64 tree columns of each beam's nodes already in the tree (-1: none)
    level: torch.Tensor  # [] int64 levels selected so far
    tie_gap: torch.Tensor  # [B] float32 smallest margin between the k-th and (k+1)-th candidate
    broken: torch.Tensor  # [B] bool non-finite log-probs seen
    prefix_len: int  # P
    captured: dict = field(default_factory=dict)  # id(catalog) -> (catalog, the step's CUDA graph over these slots,
    # the weights' addresses it was captured over)

    @classmethod
    def allocate(cls, model, bucket: Bucket, code_len: int, prefix_kv: list | None) -> Slots:
        c, dev = model.config, model.device
        b, s, k = bucket.users, bucket.prompt, bucket.k
        p = prefix_kv[0][0].shape[2] if prefix_kv else 0
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        cols = p + s + k * (code_len - 1)
        keys = [
            torch.zeros(b, heads, cols, head_dim, dtype=model.dtype, device=dev) for _ in range(c.num_hidden_layers)
        ]
        values = [torch.zeros_like(x) for x in keys]
        for (pk, pv), kk, vv in zip(prefix_kv or [], keys, values):  # the shared prefix: written once, kept
            kk[:, :, :p] = pk
            vv[:, :, :p] = pv
        i64 = dict(dtype=torch.int64, device=dev)
        return cls(
            keys,
            values,
            torch.zeros(b, s, **i64),
            torch.zeros(b, p + s, dtype=torch.bool, device=dev),
            torch.zeros(b, k, device=dev),
            torch.zeros(b, k, **i64),
            torch.zeros(b, k, **i64),
            torch.zeros(b, k, code_len, **i64),
            torch.zeros(b, k, max(code_len - 1, 1), **i64),
            torch.zeros((), **i64),
            torch.zeros(b, device=dev),
            torch.zeros(b, dtype=torch.bool, device=dev),
            p,
        )

    def load(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Prompts [b, s] (b <= B, s <= S) into the bucket's rows: left-padded to S; rows b.. are one-token dummies."""
        b, s = input_ids.shape
        p, big_s = self.prefix_len, self.input_ids.shape[1]
        self.input_ids.zero_()
        self.input_ids[:b, big_s - s :] = input_ids
        self.prompt_mask.zero_()
        self.prompt_mask[:, :p] = True
        self.prompt_mask[:b, p + big_s - s :] = attention_mask.bool()
        self.prompt_mask[b:, -1] = True


# ---------------------------------------------------------------- the model's layers, through the tree attention


@dataclass
class LayerKV:
    """What one decoder layer sees as its cache: this forward's keys and values go to columns `cols` [Q] of the
    layer's own buffers, and attention reads their first `end` columns. Each layer is handed its own (the layer's
    `layer_idx` goes unread), so that every layer's call is the same compiled code."""

    keys: torch.Tensor  # [B, H_kv, C, D]
    values: torch.Tensor  # [B, H_kv, C, D]
    cols: torch.Tensor
    end: int

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states [B, H_kv, Q, D] -> this layer's keys and values [B, H_kv, end, D] (this forward's included)."""
        self.keys.index_copy_(2, self.cols, key_states)
        self.values.index_copy_(2, self.cols, value_states)
        return self.keys[:, :, : self.end], self.values[:, :, : self.end]


def flex_tree_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """query [B, H, Q, D], key/value [B, H_kv, C, D], attention_mask a BlockMask -> [B, Q, H, D]."""
    out = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def sdpa_tree_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The same over an additive mask [B, 1, Q, C]."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION["flex"], flex_tree_attention)
AttentionInterface.register(ATTENTION["sdpa"], sdpa_tree_attention)


def tree_layers(model, attention: str) -> list:
    """The model's decoder layers, as views whose attention modules read a config naming the tree attention: the
    same modules and weights, the model untouched."""
    config = copy.copy(model.config)
    config._attn_implementation = ATTENTION[attention]
    views = []
    for layer in model.base_model.layers:
        attn = copy.copy(layer.self_attn)
        attn.config = config
        view = copy.copy(layer)
        view._modules = {**layer._modules, "self_attn": attn}
        views.append(view)
    return views


@dataclass
class Body:
    """What the graphs run: the model's embedding, rotary embedding, decoder layers (views), final norm and head."""

    embed: torch.nn.Module
    rotary: torch.nn.Module
    layers: list
    norm: torch.nn.Module
    head: Head
    attention: str  # "flex" or "sdpa"
    dtype: torch.dtype
    device: torch.device
    cache_keyword: str  # the name the layers' forward takes its cache by (`cache_keyword_of`, read here, not traced)

    def mask(self, allowed, b: int, q: int, c: int):
        """allowed(b, q, c) -> bool (query q of user b attends column c; index tensors that broadcast) -> flex: a
        BlockMask; sdpa: the additive mask [B, 1, Q, C] (0 where attended, the dtype's min elsewhere).
        Compiled flex on the CPU (torch 2.13) lowers only masks that read graph inputs or materialised tensors
        (a torch.cat's output), not a fused elementwise result: the callers build theirs so."""
        if self.attention == "flex":
            return create_block_mask(lambda bi, h, qi, ci: allowed(bi, qi, ci), b, None, q, c, device=self.device)
        dev = self.device
        dense = allowed(
            torch.arange(b, device=dev)[:, None, None],
            torch.arange(q, device=dev)[None, :, None],
            torch.arange(c, device=dev)[None, None, :],
        )  # [B, Q, C]
        return torch.zeros(b, 1, q, c, dtype=self.dtype, device=dev).masked_fill_(
            ~dense[:, None], torch.finfo(self.dtype).min
        )


# ---------------------------------------------------------------- the graphs


def score_children(head: Head, hidden: torch.Tensor, catalog: Catalog, node: torch.Tensor, width: int):
    """hidden [B, Q, H] at tree nodes whose catalog nodes are node [B, Q] (-1: dead) -> their children padded to
    `width`: token, child node, log-prob (log_softmax over the full vocabulary, -inf where none) [B, Q, D], and
    broken [B, Q] (non-finite scores). The vocabulary in at most MAX_CHUNKS chunks; no host sync."""
    b, q = node.shape
    tok, child, valid = (x.view(b, q, -1) for x in catalog.children(node.flatten(), width))  # [B, Q, D]
    rows = hidden.reshape(b * q, -1)  # [R, H]
    rows = rows.float() if head.product == "upcast" else rows
    asked = torch.where(valid, tok, -1).view(b * q, -1)  # [R, D]
    v = head.vocab_size
    step = max(head.chunk_size(b * q), -(-v // MAX_CHUNKS))
    logits = torch.full(asked.shape, NEG_INF, device=hidden.device)  # [R, D]
    maxes, sums = [], []
    for lo in range(0, v, step):
        hi = min(v, lo + step)
        z = head.chunk_logits(rows, lo, hi)  # [R, c] float32
        inside = (asked >= lo) & (asked < hi)
        logits = torch.where(inside, z.gather(1, (asked - lo).clamp(0, hi - lo - 1)), logits)
        m = z.amax(1)  # [R]
        maxes.append(m)
        sums.append((z - m[:, None]).exp().sum(1))
    m = torch.stack(maxes, 1)  # [R, chunks]
    big = m.amax(1, keepdim=True)
    lse = big[:, 0] + (torch.stack(sums, 1) * torch.exp(m - big)).sum(1).log()  # [R]
    broken = (~torch.isfinite(lse) | torch.isnan(logits).any(1)).view(b, q)
    logp = (logits - lse[:, None]).view(b, q, -1).masked_fill(~valid, NEG_INF)
    return Children(tok, child, logp, broken)


def select(kids, score: torch.Tensor, s: Slots) -> torch.Tensor:
    """The next level's top-K (beam, token) pairs from kids [B, W, D] of the beams scored score [B, W], written into
    the slots (score, token, node, tokens, tie_gap, level) -> parent beam [B, K] (-1: dead)."""
    k = s.score.shape[1]
    cand, tok, child, d = candidates(kids, score)
    values, flat = topk_stable(cand, k + 1)  # [B, K + 1]
    top, beam, token, node = pick(cand, tok, child, d, flat[:, :k])
    gap = values[:, k - 1] - values[:, k]
    s.tie_gap.copy_(torch.minimum(s.tie_gap, torch.where(torch.isnan(gap), float("inf"), gap)))
    tokens = s.tokens.gather(1, beam.clamp(min=0)[:, :, None].expand_as(s.tokens))  # [B, K, L]
    s.tokens.copy_(tokens.scatter(2, s.level.expand(*beam.shape, 1), token[:, :, None]))
    s.score.copy_(top)
    s.token.copy_(token)
    s.node.copy_(node)
    s.level.add_(1)
    return beam


def run_layer(layer, hidden: torch.Tensor, mask, pos: torch.Tensor, rope, kv: LayerKV, keyword: str) -> torch.Tensor:
    """hidden [B, Q, H] through one decoder layer (view), its keys and values into `kv`, handed to the layer under
    `keyword` (Body.cache_keyword, a constant of the graph) -> [B, Q, H]. The region compiled once per shape and
    reused by every layer: the layers differ only in their weights, which are its inputs."""
    return with_cache(
        layer,
        kv,
        hidden,
        keyword=keyword,
        attention_mask=mask,
        position_ids=pos,
        position_embeddings=rope,
        use_cache=True,
    )


def prefill_in(body: Body, s: Slots):
    """The prompts [B, S] after the prefix -> what the layers take: embeddings [B, S, H], the mask (causal over real
    tokens), positions [B, S] over real tokens, the rotary embeddings, and the cache columns [S] they fill."""
    b, n = s.input_ids.shape
    p, dev = s.prefix_len, s.input_ids.device
    pos = ((s.prompt_mask.long().cumsum(1) - 1).clamp(min=0))[:, p:]  # [B, S]
    mask = body.mask(lambda bi, qi, ci: (ci <= qi + p) & s.prompt_mask[bi, ci], b, n, p + n)
    hidden = body.embed(s.input_ids)
    return hidden, mask, pos, body.rotary(hidden, pos), torch.arange(p, p + n, device=dev)


def prefill_out(body: Body, catalog: Catalog, s: Slots, hidden: torch.Tensor) -> None:
    """The layers' output [B, S, H] -> the root's children scored at the last column, level 0 selected."""
    b, dev = hidden.shape[0], hidden.device
    root = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    kids = score_children(body.head, body.norm(hidden[:, -1:]), catalog, root, max(catalog.max_children))
    s.broken.copy_(kids.broken[:, 0])
    s.tie_gap.fill_(float("inf"))
    s.tokens.zero_()
    s.path.fill_(-1)
    s.level.zero_()
    select(kids, torch.zeros(b, 1, device=dev), s)


def step_in(body: Body, s: Slots):
    """The K tokens selected at level l - 1 (l = s.level), as tree nodes (tree columns (l - 1) K + i, under their
    beams' nodes) -> embeddings [B, K, H], the mask (prompt and ancestors), positions [B, K], the rotary embeddings,
    their cache columns [K], and each beam's tree columns [B, K, L - 1] (itself included)."""
    b, k = s.score.shape
    dev = s.score.device
    t = k * (s.tokens.shape[2] - 1)  # tree columns (not read off a layer's keys: nothing here knows the depth)
    last = s.level - 1  # [] the level of the tokens forwarded now
    alive = s.node >= 0  # [B, K]
    col = last * k + torch.arange(k, device=dev)  # [K] their tree columns
    path = torch.where(alive[:, :, None], s.path, -1)  # a dead beam's token hangs off the prompt, as in eager
    path = path.scatter(2, last.expand(b, k, 1), col.expand(b, k)[:, :, None])  # [B, K, L - 1] itself included
    tree = (path[:, :, :, None] == torch.arange(t, device=dev)).any(2)  # [B, K, T]
    allowed = torch.cat([s.prompt_mask[:, None, :].expand(b, k, -1), tree], 2)  # [B, K, P + S + T]
    mask = body.mask(lambda bi, qi, ci: allowed[bi, qi, ci], b, k, allowed.shape[2])
    pos = s.prompt_mask.sum(1, keepdim=True) + torch.where(alive, last, 0)  # [B, K] prompt length + depth - 1
    hidden = body.embed(s.token)
    return hidden, mask, pos, body.rotary(hidden, pos), s.prompt_mask.shape[1] + col, path


def step_out(body: Body, catalog: Catalog, s: Slots, hidden: torch.Tensor, path: torch.Tensor) -> None:
    """The layers' output [B, K, H] -> the beams' children scored, level l selected, the kept beams' tree columns."""
    kids = score_children(body.head, body.norm(hidden), catalog, s.node, max(catalog.max_children))
    s.broken.copy_(s.broken | kids.broken.any(1))
    beam = select(kids, s.score, s)
    s.path.copy_(path.gather(1, beam.clamp(min=0)[:, :, None].expand_as(path)))


# ---------------------------------------------------------------- the engine


def flex_compiles(device: torch.device) -> bool:
    """Whether inductor lowers FlexAttention on `device`: CUDA, or a CPU running AVX2 kernels or wider."""
    return device.type == "cuda" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def unsupported(model) -> str | None:
    """Why `model` cannot run compiled (None: it can)."""
    kind = getattr(model.config, "model_type", None)
    if kind not in ARCHITECTURES:
        return (
            f"{type(model).__name__} (model_type {kind!r}): the compiled engine runs {', '.join(ARCHITECTURES)} "
            "decoder layers; this model runs eager"
        )
    return None


@dataclass
class Engine:
    """One model's compiled engine: its layers as tree-attention views, the compiled regions (the prefill's and the
    step's input and output, and one decoder layer that every layer runs), a Slots per bucket (kept for the model's
    lifetime) and what compiling cost."""

    body: Body
    cuda_graphs: bool
    warm: set = field(default_factory=set)  # buckets compiled ahead (`warm_up`): smaller decodes run in them
    slots: dict = field(default_factory=dict)  # (bucket, code length, prefix) -> Slots
    graphs: int = 0  # graphs dynamo compiled for this engine
    pool: object = None  # the CUDA graph memory pool every captured step of this engine shares
    compile_s: float = 0.0  # wall seconds of the calls that compiled one (the compilation and that one run)

    def __post_init__(self):
        # on a CPU the graph's kernels and wrapper as one C++ file: one compiler run per graph, not one per kernel
        # (cold compiles 30-40% faster here) and no Python between kernels
        opts = None if self.body.device.type == "cuda" else {"cpp_wrapper": True}
        region = lambda fn: torch.compile(fn, fullgraph=True, dynamic=False, options=opts)  # noqa: E731
        self.layer = region(run_layer)
        self.prefill_in, self.prefill_out = region(prefill_in), region(prefill_out)
        self.step_in, self.step_out = region(step_in), region(step_out)

    def layers(self, s: Slots, hidden: torch.Tensor, mask, pos: torch.Tensor, rope, cols: torch.Tensor, end: int):
        """hidden [B, Q, H] through every decoder layer (the same compiled region), keys and values into the slots'
        columns `cols` [Q] -> [B, Q, H]."""
        for layer, keys, values in zip(self.body.layers, s.keys, s.values):
            hidden = self.layer(
                layer, hidden, mask, pos, rope, LayerKV(keys, values, cols, end), self.body.cache_keyword
            )
        return hidden

    def prefill(self, catalog: Catalog, s: Slots) -> None:
        """The prompts into the cache after the prefix, the root's children scored, level 0 selected."""
        hidden, mask, pos, rope, cols = self.prefill_in(self.body, s)
        hidden = self.layers(s, hidden, mask, pos, rope, cols, s.prompt_mask.shape[1])
        self.prefill_out(self.body, catalog, s, hidden)

    def step(self, catalog: Catalog, s: Slots) -> None:
        """The tokens of the last level into the tree, their children scored, the next level selected: the same
        regions for every level (the level is a tensor in the slots). Every tensor operation runs inside a region
        compiled with fullgraph=True, where a host sync cannot hide (it would break the graph, an error)."""
        hidden, mask, pos, rope, cols, path = self.step_in(self.body, s)
        hidden = self.layers(s, hidden, mask, pos, rope, cols, s.keys[0].shape[2])
        self.step_out(self.body, catalog, s, hidden, path)

    def step_graph(self, catalog: Catalog, s: Slots) -> None:
        """The step as one CUDA graph over the slots, the catalog and the weights (read and written in place, at
        fixed addresses): the bucket's first step runs for real on a side stream (compiling what is cold), then is
        captured on that stream, on the model's device, into the engine's one memory pool; every later step replays
        the capture while the weights are where it recorded them (host-side addresses: no sync), else captures
        anew."""
        weights = self.weight_addresses()
        kept = s.captured.get(id(catalog))
        if kept and kept[2] == weights:
            kept[1].replay()
            return
        device = self.body.device
        with torch.cuda.device(device):
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.step(catalog, s)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=side):  # recorded, not run: replays run it
                self.step(catalog, s)
        s.captured[id(catalog)] = (catalog, graph, weights)  # the catalog kept alive: the graph reads its memory

    def weight_addresses(self) -> tuple:
        """Where the weights a captured step reads are (data pointer, dtype, device of each): a moved or recast
        model gives other addresses, and its steps are captured again rather than replayed over freed memory."""
        modules = [self.body.embed, self.body.norm, *self.body.layers]
        tensors = [p for m in modules for p in m.parameters()] + [self.body.head.weight]
        return tuple((t.data_ptr(), t.dtype, t.device) for t in tensors)

    @classmethod
    def of(cls, model, attention: str | None = None, cuda_graphs: bool | None = None) -> Engine:
        """The model's engine (made on first use). attention: "flex" or "sdpa" (None: flex on CUDA, sdpa elsewhere,
        where it compiles in a fraction of flex's time); cuda_graphs: the step replayed as a CUDA graph (None: on
        CUDA)."""
        why = unsupported(model)
        if why:
            raise ValueError(why)
        cuda = model.device.type == "cuda"
        attention = attention or ("flex" if cuda else "sdpa")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")
        if attention == "flex" and not flex_compiles(model.device):
            raise ValueError(
                "FlexAttention compiles on a CPU with AVX2 kernels or wider; this process runs "
                f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY): use attention='sdpa'"
            )
        key = (attention, cuda if cuda_graphs is None else cuda_graphs)
        if key[1] and not cuda:
            raise ValueError(f"cuda_graphs needs a CUDA device; the model is on {model.device}")
        engines = _ENGINES.setdefault(model, {})
        if key not in engines:
            base = model.base_model
            layers = tree_layers(model, attention)
            body = Body(
                base.embed_tokens,
                base.rotary_emb,
                layers,
                base.norm,
                head_of(model),
                attention,
                model.dtype,
                model.device,
                cache_keyword_of(layers[0]),
            )
            engines[key] = cls(body, key[1])
        return engines[key]

    def bucket_for(self, users: int, prompt: int, k: int, depth: int) -> Bucket:
        """The smallest warm bucket that holds the batch (padding it), else the batch's own bucket."""
        fits = [w for w in self.warm if (w.k, w.depth) == (k, depth) and w.users >= users and w.prompt >= prompt]
        return min(fits, key=lambda w: (w.users * w.prompt, w.users)) if fits else Bucket.of(users, prompt, k, depth)

    def slots_for(self, model, bucket: Bucket, catalog: Catalog, prefix) -> Slots:
        key = (bucket, catalog.code_len, prefix)
        if key not in self.slots:
            self.slots[key] = Slots.allocate(model, bucket, catalog.code_len, prefix.kv(model) if prefix else None)
        return self.slots[key]

    def drop(self, bucket: Bucket) -> None:
        """Frees a bucket's slots and stops snapping to it (after it ran out of memory)."""
        self.warm.discard(bucket)
        self.slots = {key: s for key, s in self.slots.items() if key[0] != bucket}

    def run(self, graph, catalog: Catalog, s: Slots) -> None:
        """One call of `prefill`, `step` or `step_graph`; a call that compiled counts into `graphs` and `compile_s`
        (no device sync: on CUDA the host's time, which compiling dominates)."""
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            graph(catalog, s)
        new = counters["stats"]["unique_graphs"] - before
        if new:
            self.graphs += new
            self.compile_s += time.perf_counter() - t0


def runs_eager(model, do_sample: bool = False, exclude=None) -> str | None:
    """Why a beam search of `model` runs eager under engine="compiled" (None: the compiled engine covers it)."""
    return (
        unsupported(model)
        or ("sampling beam search (do_sample) runs eager" if do_sample else None)
        or ("per-user exclusions run eager" if exclude is not None else None)
    )


@torch.no_grad()
def compiled_beam_search(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    catalog: Catalog,
    k: int,
    steps: int | None = None,
    prefix=None,
    attention: str | None = None,
) -> Recommendations:
    """`beam_search(..., engine="compiled")` where `runs_eager` finds nothing against it: the same arguments and
    result (items, token ids, scores, the base stats and beam search's extras, computed as eager computes them for the
    real users and prompt length), plus engine, bucket_users, bucket_prompt, compile_s and graphs_compiled (the
    graphs this call compiled; 0 once warm)."""
    b, s = input_ids.shape
    depth = catalog.code_len if steps is None else steps
    p = len(prefix) if prefix is not None else 0
    engine = Engine.of(model, attention)
    bucket = engine.bucket_for(b, s, k, depth)
    slots = engine.slots_for(model, bucket, catalog, prefix)
    compile_s, graphs = engine.compile_s, engine.graphs
    meter = Meter(input_ids.device)
    slots.load(input_ids, attention_mask)
    try:
        with meter.phase("prefill"):
            engine.run(engine.prefill, catalog, slots)
        meter.forward("target", input_ids)
        for _ in range(depth - 1):
            engine.run(engine.step_graph if engine.cuda_graphs else engine.step, catalog, slots)
            meter.forward("target", slots.token[:b])
    except torch.OutOfMemoryError:  # the caller retries smaller: this bucket's buffers are not kept
        engine.drop(bucket)
        raise
    meter.kv(b * (p + s + k * (depth - 1)))
    score, node, tokens = slots.score[:b].clone(), slots.node[:b].clone(), slots.tokens[:b, :, :depth].clone()
    alive = node >= 0
    stats = meter.result(
        beam_batch_kv(b, k, s, depth),
        kv_len=p + s + k * (depth - 1),
        kv_batch=b,
        tree_tokens=k * (depth - 1),
        non_finite=slots.broken[:b].clone(),
        tie_gap=slots.tie_gap[:b].clone(),
        engine="compiled",
        bucket_users=bucket.users,
        bucket_prompt=bucket.prompt,
        compile_s=engine.compile_s - compile_s,
        graphs_compiled=engine.graphs - graphs,
    )
    tokens, score = torch.where(alive[:, :, None], tokens, -1), torch.where(alive, score, NEG_INF)
    if depth == catalog.code_len:
        return Recommendations.of(catalog, node, tokens, score, stats)
    return Recommendations(torch.full_like(node, -1), tokens, score, stats)


def warm_up(
    model, catalog: Catalog, users: int, prompt: int, k: int, prefix=None, attention: str | None = None
) -> Bucket:
    """Compiles the bucket of `users` prompts of `prompt` tokens (after `prefix`) by decoding one dummy batch of that
    size, and keeps it warm: every later decode of k beams that fits in it runs in it, padded, instead of compiling
    a bucket of its own (the nightly actor's decode batches snap to the bucket it compiled at start)."""
    engine = Engine.of(model, attention)
    bucket = Bucket.of(users, prompt, k, catalog.code_len)
    engine.warm.add(bucket)
    ids = torch.zeros(users, prompt, dtype=torch.int64, device=catalog.device)
    compiled_beam_search(model, ids, torch.ones_like(ids), catalog, k, prefix=prefix, attention=attention)
    return bucket


def compile_totals(model) -> tuple[float, int]:
    """Seconds the model's engines spent in calls that compiled, and the graphs they compiled, so far."""
    engines = _ENGINES.get(model, {}).values()
    return sum(e.compile_s for e in engines), sum(e.graphs for e in engines)


def use_compile_cache(base: str) -> str:
    """Points inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, read at every compile) at `base`/<torch version>-<CPU
    kernel family> and returns that folder. One folder per family: torch 2.13's cache does not key its entries by
    ATEN_CPU_CAPABILITY, and code compiled under one family fails to build, or crashes, when loaded under another."""
    family = torch.backends.cpu.get_cpu_capability().lower()
    folder = os.path.join(os.path.expanduser(base), f"torch-{torch.__version__}-{family}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def device_tag(device: torch.device) -> str:
    """The hardware a compile is for: `cpu-<kernel family>` or `cuda-<device name>-sm<capability>`."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(device))
        return f"cuda-{name}-sm{major}{minor}"
    return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


def compile_key(model, model_sha256: str, users: int, prompt: int, k: int, levels: int, prefix_len: int = 0) -> str:
    """Where a bucket's compiled graphs are kept in object storage: torch and transformers versions (the traced
    layers are transformers' code), device and capability, the model's weights (sha256) and dtype, and the bucket
    (decoding a batch of `users` prompts of `prompt` tokens after a prefix of `prefix_len`, k beams, `levels`
    codes)."""
    b = Bucket.of(users, prompt, k, levels)
    dtype = str(model.dtype).removeprefix("torch.")
    return (
        f"torch-{torch.__version__}-transformers-{transformers.__version__}/{device_tag(model.device)}/"
        f"model-{model_sha256[:16]}-{dtype}/"
        f"b{b.users}-p{b.prompt}-x{prefix_len}-k{b.k}-l{b.depth}"
    )


def cold_compiles() -> int:
    """Graphs inductor has built from scratch in this process (its FX-graph cache's misses; a hit loads one)."""
    return int(counters["inductor"]["fxgraph_cache_miss"])
