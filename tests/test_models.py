import pytest
import torch

from decoding.models import check_model_dir, load_model, tiny_model


def test_round_trip_through_safetensors(tmp_path):
    model = tiny_model("qwen2", 50, seed=0)
    model.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    loaded = load_model(tmp_path, device="cpu", dtype="float32")
    x = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits)


def test_refuses_pickled_weights_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        check_model_dir(tmp_path)
    tiny_model("llama", 50).config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"refusing pickled weights \['pytorch_model.bin'\]"):
        load_model(tmp_path)


def test_unknown_choices_raise():
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        tiny_model("gpt9", 50)
    with pytest.raises(ValueError, match="attn_implementation"):
        tiny_model("llama", 50, attn_implementation="flash")


# ---------------------------------------------------------------- models users bring: windows, heads, NaN

from decoding.beam import beam_search  # noqa: E402
from decoding.disc import disc_sample  # noqa: E402
from decoding.speculative import speculative_beam_search  # noqa: E402
from tests.helpers import float32_atol, hf_beam_search, left_padded_prompts, random_catalog  # noqa: E402

LENGTHS = [5, 11, 7, 3, 9, 6]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "arch, window",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 14, "max_window_layers": 0}),
        ("mistral", {"sliding_window": 20}),
    ],
)
def test_sliding_window_models_decode_exactly_when_the_window_covers_the_sequence(attn, arch, window):
    """Qwen2 with sliding-window layers (some or all) and Mistral: beam_search = transformers beam search when the
    window covers the longest prompt (11) plus an item (3); the window used to crash beam_search."""
    cat = random_catalog(200, 3, 6, seed=0)
    model = tiny_model(arch, cat.vocab_size, seed=0, attn_implementation=attn, **window)
    ids, mask = left_padded_prompts(6, LENGTHS, cat.vocab_size, seed=1)
    rec = beam_search(model, ids, mask, cat, 5)
    items, _, scores = hf_beam_search(model, ids, mask, cat, 5)
    assert torch.equal(rec.item_ids, items)
    torch.testing.assert_close(rec.scores, scores, atol=float32_atol(rec.scores, scores), rtol=0)


def test_a_window_shorter_than_prompt_plus_item_is_refused():
    cat = random_catalog(200, 3, 6, seed=0)
    model = tiny_model("qwen2", cat.vocab_size, use_sliding_window=True, sliding_window=12, max_window_layers=0)
    ids, mask = left_padded_prompts(6, LENGTHS, cat.vocab_size, seed=1)
    for decode in (
        lambda: beam_search(model, ids, mask, cat, 5),
        lambda: speculative_beam_search(model, model, ids, mask, cat, 5),
        lambda: disc_sample(model, ids, mask, cat, 5),
    ):
        with pytest.raises(
            ValueError,
            match=r"sliding_window = 12 tokens, shorter than the longest prompt plus an "
            r"item \(14 tokens\)",
        ):
            decode()
    beam_search(model, ids[:, -9:][3:4], mask[:, -9:][3:4], cat, 5)  # a 3-token prompt: 6 tokens fit the window


def test_encoder_decoder_and_headless_models_are_refused(tmp_path):
    from transformers import AutoConfig, LlamaModel

    AutoConfig.for_model("t5", vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2).save_pretrained(
        tmp_path / "t5"
    )
    (tmp_path / "t5" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="t5 is an encoder-decoder model"):
        load_model(tmp_path / "t5")
    LlamaModel(tiny_model("llama", 50).config).save_pretrained(tmp_path / "headless")
    with pytest.raises(ValueError, match=r"no causal LM head \(architectures \['LlamaModel'\]\)"):
        load_model(tmp_path / "headless")


def poisoned(model, token: int):
    """The model with one input token's embedding overflowed to inf: prompts holding it get NaN logits."""
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("inf")
    return model


def test_non_finite_logits_are_flagged_per_user():
    """A user whose prompt drives the model to NaN is flagged in every decoder (stats['non_finite']); the other users
    of the batch decode exactly as they would alone."""
    cat = random_catalog(200, 3, 6, seed=0)
    ids, mask = left_padded_prompts(6, LENGTHS, cat.vocab_size, seed=1)
    bad = int(ids[2, -1])
    hit = (ids == bad).any(1)  # the users whose prompts hold the poisoned token
    assert 0 < int(hit.sum()) < 6
    model = poisoned(tiny_model("llama", cat.vocab_size, seed=0), bad)
    clean = tiny_model("llama", cat.vocab_size, seed=0)
    for name, decode in (
        ("beam", lambda m: beam_search(m, ids, mask, cat, 5)),
        (
            "sample",
            lambda m: beam_search(m, ids, mask, cat, 5, do_sample=True, generator=torch.Generator().manual_seed(0)),
        ),
        ("strict", lambda m: speculative_beam_search(m, clean, ids, mask, cat, 5, draft_beams=10)),
        (
            "relaxed",
            lambda m: speculative_beam_search(
                m, clean, ids, mask, cat, 5, verification="relaxed", generator=torch.Generator().manual_seed(0)
            ),
        ),
        ("disc", lambda m: disc_sample(m, ids, mask, cat, 5, generator=torch.Generator().manual_seed(0))),
    ):
        rec = decode(model)
        assert torch.equal(rec.stats["non_finite"], hit), name
        if name == "beam":
            ok = beam_search(clean, ids[~hit], mask[~hit], cat, 5)
            assert torch.equal(rec.item_ids[~hit], ok.item_ids)
        assert not decode(clean).stats["non_finite"].any(), name
