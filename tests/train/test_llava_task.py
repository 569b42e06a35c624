"""The LLaVA task's vocabulary: a fresh LLM takes a larger tokenizer's size
(``model.vocab_size``), instead of refusing a 400-token tokenizer for a 320-token preset."""

from __future__ import annotations

import numpy as np
import pytest

import hetjax.config as hc
from models.llava import demo
from models.llava.task import LlavaTask


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    """A BPE tokenizer of 400 ids (the tiny preset's vocabulary is 320)."""
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    texts = [" ".join("".join(rng.choice(letters, 5)) for _ in range(40)) for _ in range(400)]
    path = demo.train_tokenizer(texts, str(tmp_path_factory.mktemp("tok400")), vocab_size=400)
    from models.llava import HFTokenizer

    assert HFTokenizer(path).vocab_size == 400
    return path


def _config(llava_dir, tokenizer, **model):
    return hc.TrainConfig(
        steps=1,
        model=hc.ModelConfig(**model),
        data=hc.DataConfig(
            global_batch=8,
            sources={llava_dir["train"]: 1.0},
            image_folder=llava_dir["images"],
            tokenizer=tokenizer,
        ),
    )


def test_a_fresh_llm_takes_the_tokenizers_size_or_the_given_one(llava_dir, big_tokenizer):
    assert LlavaTask(_config(llava_dir, big_tokenizer)).config.llm.vocab == 400
    given = LlavaTask(_config(llava_dir, big_tokenizer, vocab_size=512))
    assert given.config.llm.vocab == 512
    assert (
        given.mllm.modules["llm"].num_params()
        > LlavaTask(_config(llava_dir, llava_dir["tokenizer"])).mllm.modules["llm"].num_params()
    )
    # A smaller tokenizer keeps the preset's vocabulary (checkpoints of it stay valid).
    assert LlavaTask(_config(llava_dir, llava_dir["tokenizer"])).config.llm.vocab == 320
    with pytest.raises(ValueError, match=r"has 400 ids .* at least 400 \(model.vocab_size"):
        LlavaTask(_config(llava_dir, big_tokenizer, vocab_size=330))


def test_vocab_size_is_refused_for_a_pretrained_llm():
    with pytest.raises(hc.InvalidConfigError, match="model.vocab_size=512 is for a fresh LLM"):
        hc.TrainConfig(model=hc.ModelConfig(init={"llm": "/x"}, vocab_size=512))


def test_a_qwen_preset_is_not_an_llava_task():
    """A Qwen2.5-VL preset trains through models.qwen.task (the entry point picks it);
    LLaVA's task refuses it in one line instead of failing deep in the data set-up."""
    config = hc.TrainConfig(steps=1, model=hc.ModelConfig(preset="qwen2.5-vl-tiny"))
    with pytest.raises(
        ValueError, match=r"^model 'qwen2.5-vl-tiny' \(Qwen2.5-VL\) is not an LLaVA"
    ):
        LlavaTask(config)
