"""Model loading (local directories, safetensors only, no remote code, never a hub), tiny test models, and the one
way the decoders hand a transformers forward its KV cache (`with_cache`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that grouped-query attention keeps its key/value heads under a mask on
    the CPU, whose torch kernel takes enable_gqa with a mask: no repeat_kv copy of every key and value per layer and
    forward (transformers repeats them whenever a mask is given, which the token tree always is). Elsewhere, or
    without a mask, transformers' own path."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups == 1
        or query.device.type != "cpu"
        or attention_mask is None
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("sdpa_gqa", sdpa_gqa)
AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)
ATTENTION = ("eager", "sdpa", "sdpa_gqa")

# The KV cache argument of transformers' forwards (a causal LM's, its base model's, a decoder layer's) is named `cache`
# from transformers 5.24 on, where `past_key_values` is a deprecated alias (`deprecate_kwarg` renames it with a
# FutureWarning on every call), and `past_key_values` in 5.17 to 5.23 (where a `cache=` would land in **kwargs and be
# ignored). Every decoder hands its cache to a model or layer through `with_cache`, which passes it under the name the
# forward's signature gives, and reads the one a forward or `generate` returns with `returned_cache`.


def cache_keyword(forward) -> str:
    """The name `forward` (a function or method) takes its KV cache by: "cache" where its signature names it, else
    "past_key_values" where it names that; a forward that names neither is refused (the cache would land in
    **kwargs). inspect.signature reads through transformers' decorators (functools.wraps: `__wrapped__`)."""
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{getattr(forward, '__qualname__', forward)} takes no KV cache argument (cache, past_key_values)")


def cache_keyword_of(module) -> str:
    """`cache_keyword` of the module's class's forward, read once per forward function (a forward replaced on the
    class later is read again)."""
    return _cache_keyword(type(module).forward)


_cache_keyword = functools.cache(cache_keyword)


def with_cache(module, cache, /, *args, keyword: str | None = None, **kwargs):
    """module(*args, **kwargs) with its KV cache `cache` under the name its forward takes (`cache_keyword_of`).
    keyword: that name, decided ahead (`cache_keyword_of` outside a compiled region: the region passes it as a
    constant and reads no signature)."""
    return module(*args, **kwargs, **{keyword or cache_keyword_of(module): cache})


def returned_cache(output):
    """The KV cache a forward's or `generate`'s output holds: its `cache` field (5.24 on), else `past_key_values`."""
    fields = {f.name for f in dataclasses.fields(output)}
    return output.cache if "cache" in fields else output.past_key_values


# Tiny architectures for tests and CPU benchmarks: Llama with grouped-query attention, Qwen2 with
# attention biases (and optional sliding-window layers), Mistral (sliding window), Qwen3 with q/k norms.
# Sizes are set by `tiny_model(..., **overrides)`.
TINY_BODY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY = {
    "llama": dict(model_type="llama", **TINY_BODY),
    "qwen2": dict(model_type="qwen2", **TINY_BODY, use_sliding_window=False),
    "mistral": dict(model_type="mistral", **TINY_BODY, sliding_window=None),
    "qwen3": dict(model_type="qwen3", **TINY_BODY, head_dim=16, use_sliding_window=False),
}


def tiny_config(arch: str, vocab_size: int, **overrides):
    if arch not in TINY:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(TINY)}")
    spec = {**TINY[arch], **overrides}
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **spec,
    )


def tiny_model(
    arch: str,
    vocab_size: int,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    **overrides,
):
    """A randomly initialised causal LM built from a config in memory (never downloaded)."""
    if attn_implementation not in ATTENTION:
        raise ValueError(f"attn_implementation must be one of {ATTENTION}, got {attn_implementation!r}")
    torch.manual_seed(seed)
    config = tiny_config(arch, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def build_model(
    vocab_size: int,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    seed: int = 0,
    arch: str = "llama",
    attn_implementation: str = "sdpa",
    max_positions: int = 512,
):
    """A model trained from scratch: `arch` (Llama by default) of the given size, randomly initialised."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
    return tiny_model(
        arch,
        vocab_size,
        seed=seed,
        attn_implementation=attn_implementation,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
    )


def add_code_tokens(model, tokenizer, levels: int, codes: int, template=None) -> list[str]:
    """The LC-Rec recipe: add the semantic-ID code tokens (named by the template's `code_token`, `<a_12>` by
    default) as tokens of their own to a pretrained causal LM's vocabulary, with a <pad> token if it has none (and a
    <bos> if the template starts prompts with one the tokenizer lacks), and resize its embeddings.
    Returns the tokens added."""
    from decoding.templates import PRESETS

    template = template or PRESETS["codes"]
    wanted = (("pad_token", "<pad>"),) + ((("bos_token", "<bos>"),) if template.bos else ())
    specials = {name: tok for name, tok in wanted if getattr(tokenizer, name) is None}
    tokenizer.add_special_tokens(specials)
    vocab = tokenizer.get_vocab()
    names = [template.code(j, c) for j in range(levels) for c in range(codes)]
    new = [name for name in names if name not in vocab]
    tokenizer.add_tokens(new)
    model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id, model.config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    return list(specials.values()) + new


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} or 'auto', got {dtype!r}")
    return names[dtype]


def check_model_dir(path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a model directory (no config.json)")
    if not list(path.glob("*.safetensors")):
        unsafe = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise ValueError(
            f"{path}: no *.safetensors weights" + (f" (refusing pickled weights {unsafe})" if unsafe else "")
        )
    return path


def check_causal_lm(config, source) -> None:
    """Refuses, naming why, a model genrec-batch cannot decode exactly: an encoder-decoder, or a checkpoint without a
    causal LM head (AutoModelForCausalLM would add an untrained one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{source}: {config.model_type} is an encoder-decoder model; genrec-batch decodes "
            "decoder-only causal LMs (a ...ForCausalLM checkpoint)"
        )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{source}: model type {config.model_type!r} has no causal LM in transformers; genrec-batch "
            "decodes decoder-only causal LMs (a ...ForCausalLM checkpoint)"
        )
    heads = [a for a in config.architectures or [] if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if config.architectures and not heads:
        raise ValueError(
            f"{source}: the checkpoint has no causal LM head (architectures {config.architectures}); "
            "save the ...ForCausalLM model, whose head scores the next token"
        )


def attention_window(config) -> int | None:
    """The shortest attention span any layer has (a sliding window or an attention chunk), None when every layer
    attends to the whole sequence."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        window = window if any("sliding" in t for t in types) else None
    elif getattr(config, "use_sliding_window", True) is False:
        window = None
    spans = [w for w in (window, getattr(config, "attention_chunk_size", None)) if w]
    return min(spans) if spans else None


def check_window(config, tokens: int, source) -> None:
    """genrec-batch keeps every prompt and tree token in the cache and applies attention through its own mask: exact
    for a sliding-window (or chunked-attention) model only when the window covers the longest sequence it decodes,
    `tokens` = prompt + item. Refused otherwise, naming the setting."""
    window = attention_window(config)
    if window is not None and window < tokens:
        name = "sliding_window" if getattr(config, "sliding_window", None) == window else "attention_chunk_size"
        raise ValueError(
            f"{source}: the model attends within {name} = {window} tokens, shorter than the longest "
            f"prompt plus an item ({tokens} tokens); its sliding-window attention would differ from "
            "the full attention genrec-batch computes. Shorten the prompt (max_items of the prompt "
            "template) or use a model whose window covers it"
        )


def load_config(path):
    """A model directory's config, refused (`check_causal_lm`) before any weight is read; its weights are
    `load_model`'s to check (a driver checks an s3:// model's config and tokenizer without them)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    check_causal_lm(config, path)
    return config


def load_model(
    path, device: str | None = None, dtype: str | torch.dtype | None = None, attn_implementation: str = "sdpa_gqa"
):
    """A causal LM from a local directory: safetensors only, no remote code, no hub; an encoder-decoder or a
    checkpoint without a causal LM head is refused (`check_model_dir`, `load_config`)."""
    load_config(check_model_dir(path))
    path = Path(path)
    dev = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        local_files_only=True,
        trust_remote_code=False,
        use_safetensors=True,
        dtype=pick_dtype(dtype, dev),
        attn_implementation=attn_implementation,
    )
    return model.to(dev).eval()


def load_tokenizer(path):
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: tokenizer directory does not exist")
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
