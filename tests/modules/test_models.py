import pytest
import torch
import transformers

from lppo.modules.models import HFCausalLM, hidden_size_of
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.validation import SettingError

IDS = {"vocab_size": 20, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_build_is_deterministic_and_leaves_global_rng(arch):
    rng = torch.get_rng_state()
    factory = HFCausalLM(architecture=arch, seed=3)
    a = factory.build(**IDS)
    b = HFCausalLM(architecture=arch, seed=3).build(**IDS)
    c = HFCausalLM(architecture=arch, seed=4).build(**IDS)
    assert torch.equal(rng, torch.get_rng_state())
    assert _equal(a, b)
    assert not _equal(a, c)
    assert isinstance(a, transformers.PreTrainedModel)
    assert hidden_size_of(a) == a.config.hidden_size == 64
    assert a.get_input_embeddings().num_embeddings == 20
    assert a.config.num_hidden_layers == 2
    assert a.config.eos_token_id == 2 and a.config.pad_token_id == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_backbone_matches_body(arch):
    factory = HFCausalLM(architecture=arch, hidden_size=32, num_heads=2)
    lm = factory.build(**IDS)
    backbone = factory.build_backbone(**IDS)
    assert type(backbone) is type(lm.base_model)
    assert _equal(backbone, lm.base_model)
    ids = torch.tensor([[1, 5, 6, 7]])
    h = backbone(input_ids=ids).last_hidden_state
    assert h.shape == (1, 4, hidden_size_of(backbone)) == (1, 4, 32)
    out = lm(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[-1], h)


def test_pretrained_round_trip(tmp_path):
    lm = HFCausalLM(seed=1).build(**IDS)
    lm.save_pretrained(tmp_path)
    factory = HFCausalLM(pretrained_path=str(tmp_path))
    loaded = factory.build(**IDS)
    assert _equal(loaded, lm)
    backbone = factory.build_backbone(**IDS)
    assert _equal(backbone, lm.base_model)


def test_dtype():
    lm = HFCausalLM(dtype="bfloat16").build(**IDS)
    assert next(lm.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs", [{"architecture": "mamba"}, {"dtype": "int8"}, {"hidden_size": 30, "num_heads": 4}]
)
def test_bad_args(kwargs):
    with pytest.raises(ValueError):
        HFCausalLM(**kwargs).validate("model.actor.init_args.model.init_args")


def test_a_checkpoint_with_fewer_embeddings_than_the_tokenizer_is_refused(tmp_path):
    HFCausalLM(seed=1).build(**{**IDS, "vocab_size": 12}).save_pretrained(tmp_path)
    factory = HFCausalLM(pretrained_path=str(tmp_path))
    tok = build_char_tokenizer("abcdefghijklmnop")  # 20 tokens
    key = "model.actor.init_args.model"
    match = (
        rf"{key}\.init_args\.pretrained_path='.*' has 12 token embeddings but the run's "
        r"tokenizer has 20 tokens: .*model\.resize_embeddings: true"
    )
    with pytest.raises(SettingError, match=match):
        factory.check_vocabulary(key, tok, resize=False)
    factory.check_vocabulary(key, tok, resize=True)  # asked for: resized when built
    assert factory.build(**IDS).get_input_embeddings().num_embeddings == 20


def test_a_checkpoint_with_another_tokenizer_is_refused(tmp_path):
    HFCausalLM(seed=1).build(**IDS).save_pretrained(tmp_path)
    build_char_tokenizer("ABCDEFGHIJKLMNOP").save_pretrained(tmp_path)  # 20 tokens, not ours
    factory = HFCausalLM(pretrained_path=str(tmp_path))
    key = "model.reward_model.init_args.model"
    with pytest.raises(SettingError, match=r"ships a tokenizer of 20 tokens that is not the run"):
        factory.check_vocabulary(key, build_char_tokenizer("abcdefghijklmnop"), resize=False)
    factory.check_vocabulary(key, build_char_tokenizer("ABCDEFGHIJKLMNOP"), resize=False)
