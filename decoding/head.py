"""Next-token scores from hidden states without a [rows, V] log-softmax: the language-model head in vocabulary chunks.

Per query row the head keeps the log-normaliser (logsumexp of the logits over the whole vocabulary, accumulated in
float32 chunk by chunk) and the logits of the tokens asked for (a trie node's children), gathered from the same chunk
products; logit - lse is exactly log_softmax over the full vocabulary, the score `transformers` beam search uses.
Working memory per call: rows x chunk floats, whatever the vocabulary size (and on a CPU the chunks stay in cache,
which makes the head faster too).

Logits are float32 whatever the model's dtype: with a bfloat16 / float16 model the body stays in half precision, but
the head's product takes the half-precision hidden states and weights and accumulates and writes float32 (on CUDA a
matrix product with a float32 output dtype; elsewhere each chunk of weights upcast into a reused float32 buffer).
Rounding logits to bfloat16 (spacing 0.06-0.125 at magnitudes 8-16, as transformers does before `logits.float()`)
would move scores by more than the gaps that decide a trained model's ranks.

`Head.of(model)` reads the model's output layer (weight, bias) and its logit transforms (Cohere's logit_scale,
Gemma's final_logit_softcapping), then checks itself once against the model's own forward on a probe: a model whose
head does something else is refused, naming the mismatch, never scored differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class Scores:
    """Next-token scores of R query rows."""

    logits: torch.Tensor  # [R, D] float32 logits of the tokens asked for, -inf where a token is -1
    lse: torch.Tensor  # [R] float32 log-normaliser over the full vocabulary (temperature 1)
    lse_t: torch.Tensor | None = None  # [R] the same of logits / temperature, when a temperature was given
    top_tokens: torch.Tensor | None = None  # [R, M] the M highest-scoring tokens of the full vocabulary
    top_logits: torch.Tensor | None = None  # [R, M] their logits

    @property
    def logp(self) -> torch.Tensor:
        """log_softmax over the full vocabulary of the tokens asked for [R, D]."""
        return self.logits - self.lse[:, None]


@dataclass
class Head:
    weight: torch.Tensor  # [V, H] the output embedding
    bias: torch.Tensor | None  # [V]
    scale: float = 1.0  # logit_scale (Cohere)
    softcap: float | None = None  # final_logit_softcapping (Gemma 2 / 3)
    budget: int = 1 << 20  # floats of one chunk of logits (rows x chunk)
    product: str = "float32"  # how a chunk's float32 logits are computed: float32 (a float32 model), out_dtype (half
    # inputs, float32 output: CUDA), upcast (each chunk of half weights copied into a float32 buffer first), model
    # (in the model's dtype, then upcast: transformers' rounding; `bench precision` measures what it costs)

    @classmethod
    def of(cls, model, check: bool = True) -> Head:
        """The head of a transformers causal LM, checked against the model's own logits on a probe."""
        out = model.get_output_embeddings()
        if not isinstance(out, torch.nn.Linear):
            raise ValueError(f"{type(model).__name__}: the output layer is {type(out).__name__}, not a linear head")
        config = model.config
        head = cls(
            out.weight,
            out.bias,
            float(getattr(config, "logit_scale", None) or 1.0),
            getattr(config, "final_logit_softcapping", None),
            1 << 26 if out.weight.device.type == "cuda" else 1 << 18,
            float32_product(out.weight),
        )
        if check:
            head.check(model)
        return head

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @torch.no_grad()
    def chunk_logits(
        self, hidden: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None, wbuf: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [R, H] -> float32 logits [R, hi - lo] of tokens lo .. hi - 1: the model's logits, with the product
        accumulated and written in float32 (into `out`, a contiguous float32 [R, hi - lo], when given; `wbuf`, at
        least (hi - lo) x H float32, holds the upcast weights: the head's products then allocate nothing)."""
        w, b = self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi]
        if out is None:
            out = torch.empty(hidden.shape[0], hi - lo, device=hidden.device)
        if self.product == "out_dtype":  # half inputs, float32 accumulation and output
            torch.mm(hidden, w.t(), out_dtype=torch.float32, out=out)
        elif self.product == "model":
            out.copy_(torch.nn.functional.linear(hidden, w, b))
            b = None
        else:
            if self.product == "upcast":
                w = w.float() if wbuf is None else wbuf[: w.numel()].view_as(w).copy_(w)  # [c, H] float32, exact
                hidden = hidden.float()
            torch.mm(hidden, w.t(), out=out)
        if b is not None:
            out.add_(b)
        if self.scale != 1.0:
            out.mul_(self.scale)
        if self.softcap:
            out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out

    def chunk_size(self, rows: int) -> int:
        """Vocabulary rows per chunk: `budget` floats of logits in all (and of upcast weights: `upcast`), at least
        1024 tokens, at most V."""
        width = max(rows, self.weight.shape[1] if self.product == "upcast" else 1)
        return max(1024, min(self.vocab_size, self.budget // width))

    @torch.no_grad()
    def score(self, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, top_m: int = 0) -> Scores:
        """hidden [R, H], tokens [R, D] (-1 = none) -> Scores: their logits and the normalisers (at temperature 1 and,
        when temperature != 1, at `temperature`); top_m > 0 also returns the top-M tokens of the full vocabulary.
        The vocabulary streams through one float32 buffer of R x chunk (two with a temperature), reused chunk after
        chunk and transformed in place: the working memory is bounded by `budget`, whatever the vocabulary."""
        r, v = hidden.shape[0], self.vocab_size
        step = self.chunk_size(r)
        buf = torch.empty(r * step, device=hidden.device)  # [R * chunk] float32, every chunk's logits in turn
        wbuf = torch.empty(step * self.weight.shape[1], device=hidden.device) if self.product == "upcast" else None
        hidden = hidden.float() if self.product == "upcast" else hidden  # [R, H] once, not per chunk
        buf_t = torch.empty_like(buf) if temperature != 1.0 else None
        logits = torch.full(tokens.shape, NEG_INF, device=hidden.device)
        real = tokens >= 0
        lo_tok = int(tokens[real].min()) if real.any() else v
        hi_tok = int(tokens[real].max()) if real.any() else -1
        maxes, sums, sums_t, top_v, top_i = [], [], [], [], []
        for lo in range(0, v, step):
            hi = min(v, lo + step)
            z = self.chunk_logits(hidden, lo, hi, buf[: r * (hi - lo)].view(r, hi - lo), wbuf)  # [R, c]
            if lo_tok < hi and hi_tok >= lo:  # the asked tokens in this chunk
                inside = real & (tokens >= lo) & (tokens < hi)
                logits = torch.where(inside, z.gather(1, (tokens - lo).clamp(0, hi - lo - 1)), logits)
            if top_m:
                values, index = z.topk(min(top_m, hi - lo), 1)
                top_v.append(values)
                top_i.append(index + lo)
            m = z.amax(1)  # [R]
            maxes.append(m)
            z.sub_(m[:, None])  # z - m <= 0 from here on
            if buf_t is not None:
                sums_t.append(torch.div(z, temperature, out=buf_t[: z.numel()].view_as(z)).exp_().sum(1))
            sums.append(z.exp_().sum(1))
        m = torch.stack(maxes, 1)  # [R, chunks]
        big = m.amax(1, keepdim=True)  # [R, 1]
        lse = big[:, 0] + (torch.stack(sums, 1) * torch.exp(m - big)).sum(1).log()
        scores = Scores(torch.where(real, logits, NEG_INF), lse)
        if temperature != 1.0:
            scores.lse_t = (
                big[:, 0] / temperature + (torch.stack(sums_t, 1) * torch.exp((m - big) / temperature)).sum(1).log()
            )
        if top_m:
            values, pick = torch.cat(top_v, 1).topk(min(top_m, v), 1)
            scores.top_logits, scores.top_tokens = values, torch.cat(top_i, 1).gather(1, pick)
        return scores

    def check(self, model) -> None:
        """One probe forward: the model's own logits must equal this head's on its hidden states."""
        device = self.weight.device
        probe = torch.arange(3, device=device)[None] % self.vocab_size  # [1, 3]
        with torch.no_grad():
            want = model(input_ids=probe).logits[0].float()  # [3, V]
            got = self.chunk_logits(model.base_model(input_ids=probe).last_hidden_state[0], 0, self.vocab_size)
        tol = 1e-4 if self.weight.dtype == torch.float32 else 5e-2  # half: the model's logits are rounded to it
        if not torch.allclose(got, want, atol=tol * (1 + float(want.abs().max())), rtol=0):
            raise ValueError(
                f"{type(model).__name__}: its logits are not its output layer applied to its last hidden "
                f"state (max difference {float((got - want).abs().max()):.3g}); this head is not supported"
            )


def float32_product(weight: torch.Tensor) -> str:
    """How the head computes float32 logits from `weight` [V, H]: "float32" for a float32 head; for a half-precision
    one "out_dtype" where this torch multiplies half inputs into a float32 output (CUDA), else "upcast"."""
    if weight.dtype == torch.float32:
        return "float32"
    if weight.device.type == "cuda":
        a = weight[:2]
        try:
            torch.mm(a, a.t(), out_dtype=torch.float32, out=torch.empty(2, 2, device=a.device))
            return "out_dtype"
        except (RuntimeError, TypeError, NotImplementedError):  # a torch without aten::mm.dtype_out for CUDA
            pass
    return "upcast"
