"""Next-token scores from hidden states without a [rows, V] log-softmax: the language-model head in vocabulary chunks.

Per query row the head keeps the log-normaliser (logsumexp of the logits over the whole vocabulary, accumulated in
float32 chunk by chunk) and the logits of the tokens asked for (a trie node's children), gathered from the same chunk
products; logit - lse is exactly log_softmax over the full vocabulary, the score `transformers` beam search uses.
Working memory per call: rows x chunk floats, whatever the vocabulary size (and on a CPU the chunks stay in cache,
which makes the head faster too). Logits are computed in the model's dtype and accumulated in float32, as
transformers does (logits.float()).

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

    @classmethod
    def of(cls, model, check: bool = True) -> "Head":
        """The head of a transformers causal LM, checked against the model's own logits on a probe."""
        out = model.get_output_embeddings()
        if not isinstance(out, torch.nn.Linear):
            raise ValueError(f"{type(model).__name__}: the output layer is {type(out).__name__}, not a linear head")
        config = model.config
        head = cls(out.weight, out.bias, float(getattr(config, "logit_scale", None) or 1.0),
                   getattr(config, "final_logit_softcapping", None),
                   1 << 26 if out.weight.device.type == "cuda" else 1 << 18)
        if check:
            head.check(model)
        return head

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def chunk_logits(self, hidden: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [R, H] -> float32 logits [R, hi - lo] of tokens lo .. hi - 1, as the model computes them (into
        `out`, a contiguous float32 [R, hi - lo], when given: the head's products then allocate nothing)."""
        w, b = self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi]
        if out is None:
            out = torch.nn.functional.linear(hidden, w, b).float()
        elif hidden.dtype == torch.float32:  # the product written straight into the float32 buffer
            torch.addmm(b, hidden, w.t(), out=out) if b is not None else torch.mm(hidden, w.t(), out=out)
        else:  # in the model's dtype, as transformers computes logits, then upcast (logits.float())
            out.copy_(torch.nn.functional.linear(hidden, w, b))
        if self.scale != 1.0:
            out.mul_(self.scale)
        if self.softcap:
            out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out

    def chunk_size(self, rows: int) -> int:
        """Vocabulary rows per chunk: `budget` floats of logits in all (at least 1024 tokens, at most V)."""
        return max(1024, min(self.vocab_size, self.budget // max(rows, 1)))

    @torch.no_grad()
    def score(self, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
              top_m: int = 0) -> Scores:
        """hidden [R, H], tokens [R, D] (-1 = none) -> Scores: their logits and the normalisers (at temperature 1 and,
        when temperature != 1, at `temperature`); top_m > 0 also returns the top-M tokens of the full vocabulary.
        The vocabulary streams through one float32 buffer of R x chunk (two with a temperature), reused chunk after
        chunk and transformed in place: the working memory is bounded by `budget`, whatever the vocabulary."""
        r, v = hidden.shape[0], self.vocab_size
        step = self.chunk_size(r)
        buf = torch.empty(r * step, device=hidden.device)  # [R * chunk] float32, every chunk's logits in turn
        buf_t = torch.empty_like(buf) if temperature != 1.0 else None
        logits = torch.full(tokens.shape, NEG_INF, device=hidden.device)
        real = tokens >= 0
        lo_tok = int(tokens[real].min()) if real.any() else v
        hi_tok = int(tokens[real].max()) if real.any() else -1
        maxes, sums, sums_t, top_v, top_i = [], [], [], [], []
        for lo in range(0, v, step):
            hi = min(v, lo + step)
            z = self.chunk_logits(hidden, lo, hi, buf[:r * (hi - lo)].view(r, hi - lo))  # [R, c]
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
                sums_t.append(torch.div(z, temperature, out=buf_t[:z.numel()].view_as(z)).exp_().sum(1))
            sums.append(z.exp_().sum(1))
        m = torch.stack(maxes, 1)  # [R, chunks]
        big = m.amax(1, keepdim=True)  # [R, 1]
        lse = big[:, 0] + (torch.stack(sums, 1) * torch.exp(m - big)).sum(1).log()
        scores = Scores(torch.where(real, logits, NEG_INF), lse)
        if temperature != 1.0:
            scores.lse_t = big[:, 0] / temperature + (torch.stack(sums_t, 1) * torch.exp((m - big) / temperature)
                                                      ).sum(1).log()
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
        tol = 1e-4 if self.weight.dtype == torch.float32 else 5e-2
        if not torch.allclose(got, want, atol=tol * (1 + float(want.abs().max())), rtol=0):
            raise ValueError(f"{type(model).__name__}: its logits are not its output layer applied to its last hidden "
                             f"state (max difference {float((got - want).abs().max()):.3g}); this head is not supported")
