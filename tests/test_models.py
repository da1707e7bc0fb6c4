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
