"""HF tokenizers from a model directory (tokenizer.json made here with the tokenizers library): ids,
special tokens and the chat template as transformers reads them; the byte tokenizer stays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.engine.tasks import ByteTokenizer
from agent.engine.tokenizer import HFTokenizer, encode_prompt
from planner.errors import SpecError

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer_dir(path: Path, *, chat_template: bool = True, generation_eos: list[int] | None = None) -> Path:
    """A small byte-level BPE tokenizer directory, as a model directory on the Hub would hold one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["sort the digits 3 1 4 1 5", "what is 12 plus 7", "the answer is 19", "héllo wörld"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def test_ids_and_special_tokens_match_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = make_tokenizer_dir(tmp_path / "m")
    ours = HFTokenizer(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    for text in ("sort the digits 3 1 4", "héllo wörld, unseen words!"):
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"] and ids[0] == theirs.bos_token_id
        assert ours.decode(ids[1:] + [theirs.eos_token_id, 5, 6]) == text  # cut at EOS
    assert (ours.pad_id, ours.stop_ids) == (theirs.pad_token_id, (theirs.eos_token_id,))
    assert ours.terminated([5, theirs.eos_token_id]) and not ours.terminated([5, 6])


def test_chat_template_renders_as_transformers_does(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = make_tokenizer_dir(tmp_path / "m")
    ours = HFTokenizer(d, chat_template=True)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    messages = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 12 plus 7"})
    expected = theirs.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert encode_prompt(ours, messages) == list(expected)
    one = theirs.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    one = one["input_ids"] if hasattr(one, "keys") else one
    assert encode_prompt(ours, "hi") == list(one)  # a text prompt wrapped as one user turn
    assert encode_prompt(HFTokenizer(d), "hi") == HFTokenizer(d).encode("hi")  # template off: plain text


def test_generation_config_stop_ids_and_clear_errors(tmp_path: Path) -> None:
    d = make_tokenizer_dir(tmp_path / "m", chat_template=False, generation_eos=[1, 5])
    tok = HFTokenizer(d)
    assert tok.stop_ids == (1, 5) and tok.terminated([9, 5])
    assert tok.decode(tok.encode("what is", bos=False) + [5]) == "what is"
    with pytest.raises(SpecError, match="has no chat template"):
        HFTokenizer(d, chat_template=True)
    with pytest.raises(SpecError, match="chat-message prompts need a chat template"):
        encode_prompt(tok, ({"role": "user", "content": "x"},))
    with pytest.raises(SpecError, match="tokenizer.json does not exist"):
        HFTokenizer(tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    (d / "generation_config.json").unlink()
    with pytest.raises(SpecError, match="'<nope>' is not in the vocabulary"):
        HFTokenizer(d)


def test_byte_tokenizer_is_kept_for_the_synthetic_tasks() -> None:
    tok = ByteTokenizer()
    assert encode_prompt(tok, "12+7=") == [tok.bos_id, *b"12+7="] and tok.stop_ids == (tok.eos_id,)
    with pytest.raises(SpecError, match="need a Hugging Face tokenizer"):
        encode_prompt(tok, ({"role": "user", "content": "x"},))
