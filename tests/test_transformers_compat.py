"""The KV cache argument of transformers' forwards, whichever name the installed transformers gives it: `cache` from
5.24 on (`past_key_values` there is a deprecated alias that warns on every call), `past_key_values` before. Every
decoder hands its cache over through decoding/models.py's `with_cache`, which reads the name off the forward's
signature once per class; pyproject.toml's pytest settings turn transformers' FutureWarnings into errors, so that the
suite fails under a transformers that deprecates something the code still uses."""

import warnings

import pytest
import torch
import transformers
from _pytest.config import parse_warning_filter
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.utils.deprecation import deprecate_kwarg

from decoding.models import TINY, cache_keyword, cache_keyword_of, returned_cache, tiny_model, with_cache
from tests.helpers import tiny_gemma2

# The first transformers whose forwards take `cache` (pyproject.toml admits 5.17 on).
RENAMED = Version("5.24")
INSTALLED_NAME = "cache" if Version(transformers.__version__) >= RENAMED else "past_key_values"


class Renamed(torch.nn.Module):
    """A forward as transformers 5.24 writes them: `cache`, the old name renamed (with a FutureWarning) by a
    decorator."""

    @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
    def forward(self, hidden, cache=None, use_cache=False):
        return cache


class Before(torch.nn.Module):
    """A forward as transformers 5.17 to 5.23 write them."""

    def forward(self, hidden, past_key_values=None, use_cache=False):
        return past_key_values


class Both(torch.nn.Module):
    def forward(self, hidden, cache=None, past_key_values=None):
        return cache


class Neither(torch.nn.Module):
    def forward(self, hidden, **kwargs):
        return kwargs


def test_the_keyword_is_the_one_the_forward_names():
    assert cache_keyword(Renamed.forward) == cache_keyword_of(Renamed()) == "cache"
    assert cache_keyword(Before.forward) == cache_keyword_of(Before()) == "past_key_values"
    assert cache_keyword_of(Both()) == "cache"
    with pytest.raises(TypeError, match="Neither.forward takes no KV cache argument"):
        cache_keyword_of(Neither())
    cache = object()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert with_cache(Renamed(), cache, torch.zeros(1), use_cache=True) is cache
        assert with_cache(Before(), cache, torch.zeros(1), use_cache=True) is cache
        assert with_cache(Renamed(), cache, torch.zeros(1), keyword="cache") is cache  # decided ahead: not read
    with pytest.raises(FutureWarning, match="`past_key_values` is deprecated"):
        Renamed()(torch.zeros(1), past_key_values=cache)  # what the adapter avoids: an error in the suite


MODELS = {**{arch: lambda v, arch=arch: tiny_model(arch, v, seed=0) for arch in TINY}, "gemma2": tiny_gemma2}


@pytest.mark.parametrize("arch", sorted(MODELS))
@torch.no_grad()
def test_real_forwards_take_the_cache_through_the_adapter_without_a_warning(arch):
    """The causal LM's, the base model's and a decoder layer's forward: the name is the installed transformers' own
    (`cache` from 5.24, `past_key_values` before), the cache handed over under it is the one the forward fills (not
    dropped into **kwargs), and no FutureWarning is raised (any warning is an error here)."""
    model = MODELS[arch](50)
    base, layer = model.base_model, model.base_model.layers[0]
    assert [cache_keyword_of(m) for m in (model, base, layer)] == [INSTALLED_NAME] * 3
    ids = torch.tensor([[1, 5, 7, 9]])
    pos = torch.arange(4)[None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module in (model, base):
            cache = DynamicCache(config=model.config)
            out = with_cache(module, cache, input_ids=ids, position_ids=pos, use_cache=True)
            assert cache.get_seq_length() == 4 and returned_cache(out) is cache
        cache = DynamicCache(config=model.config)
        hidden = base.embed_tokens(ids)
        rope = base.rotary_emb(hidden, pos)
        with_cache(layer, cache, hidden, position_ids=pos, position_embeddings=rope, use_cache=True)
        assert cache.get_seq_length(layer.self_attn.layer_idx) == 4


@torch.no_grad()
def test_generate_returns_its_cache_under_either_name():
    model = tiny_model("llama", 50, seed=0)
    out = model.generate(
        input_ids=torch.tensor([[1, 5, 7]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True
    )
    assert isinstance(returned_cache(out), Cache) and returned_cache(out).get_seq_length() == 4


def test_the_compiled_engine_decides_the_name_outside_its_graphs():
    """The compiled engine's layer region takes the name as a constant, read off the layer's class when the engine
    is made (nothing is compiled here)."""
    from decoding.compiled import Engine

    model = tiny_model("qwen2", 50, seed=0)
    assert Engine.of(model, attention="sdpa").body.cache_keyword == INSTALLED_NAME


@pytest.mark.parametrize(
    "module, fails",
    [
        ("transformers", True),
        ("transformers.utils.output_capturing", True),
        ("transformers.models.qwen2.modeling_qwen2", True),
        ("transformers_extra", False),
        ("torch.nn.modules.module", False),  # any module's forward (transformers' deprecate_kwarg: conftest.py)
        ("torch.serialization", False),
        ("pandas.core.frame", False),
        ("ray.data.dataset", False),
    ],
)
def test_the_suite_settings_scope_future_warnings_as_errors_to_transformers(pytestconfig, module, fails):
    """pyproject.toml's filterwarnings alone (not whatever -W adds), under any transformers: a FutureWarning
    attributed to transformers' code is an error, another library's (torch's Module.__call__ included) stays a
    warning."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        for entry in pytestconfig.getini("filterwarnings"):  # as pytest applies them: the last one first
            warnings.filterwarnings(*parse_warning_filter(entry, escape=False))
        if fails:
            with pytest.raises(FutureWarning, match="deprecated"):
                warnings.warn_explicit("deprecated", FutureWarning, "x.py", 1, module=module)
        else:
            warnings.warn_explicit("deprecated", FutureWarning, "x.py", 1, module=module)
    assert [w.category for w in seen] == ([] if fails else [FutureWarning])


@pytest.mark.skipif(INSTALLED_NAME != "cache", reason="this transformers deprecates no cache argument")
@torch.no_grad()
def test_the_suite_turns_transformers_future_warnings_into_errors():
    """A deprecated argument fails the test whoever its warning names (tests/conftest.py): a base model's forward,
    a causal LM's (its outermost decorator warns with stacklevel=2: torch's Module.__call__), `generate` called from
    here (the warning names this file)."""
    model = tiny_model("qwen2", 50, seed=0)
    ids = torch.tensor([[1, 5, 7]])
    for module in (model.base_model, model):
        with pytest.raises(FutureWarning, match="`past_key_values` is deprecated"):
            module(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    with pytest.raises(FutureWarning, match="`past_key_values` is deprecated"):
        model.generate(input_ids=ids, max_new_tokens=1, past_key_values=DynamicCache(config=model.config))


def test_a_forward_replaced_on_its_class_is_read_again():
    """The keyword is read once per forward function: a class whose forward is replaced later (a kernel-patching
    library) gets the new forward's name, not the old one's."""

    class Patched(torch.nn.Module):
        def forward(self, hidden, past_key_values=None):
            return past_key_values

    cache = object()
    assert with_cache(Patched(), cache, torch.zeros(1)) is cache
    Patched.forward = lambda self, hidden, cache=None, **kwargs: cache
    assert cache_keyword_of(Patched()) == "cache" and with_cache(Patched(), cache, torch.zeros(1)) is cache
