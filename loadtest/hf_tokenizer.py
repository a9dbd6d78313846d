"""A Hugging Face tokenizer built on this machine, for clients that insist on loading one.

inference-perf loads a tokenizer (``transformers.AutoTokenizer``) to count prompt and output
tokens, by default the served model's, from the Hub. The simulator's model is named
``Qwen/Qwen2.5-0.5B-Instruct`` but nothing of it exists here, and a benchmark should not
download one, so ``build`` writes a small byte-level BPE, trained on the texts it is given
(the benchmark's prompts and a sample of the simulator's replies), into a directory that
``AutoTokenizer.from_pretrained(dir)`` loads as a ``PreTrainedTokenizerFast``. Byte-level:
any text encodes, so no count is lost to an unknown token; counts are near the server's, not
equal.
No chat template: inference-perf's chat and Messages modes send messages as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ("<|endoftext|>",)
# The 256 bytes, the special token, and merges of the training text: enough for most of the
# simulator's words to be one token, as they are to the simulator (so counts come out close).
VOCAB_SIZE = 2048


def build(directory: Path, texts: Iterable[str]) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; return it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        # The class transformers builds from tokenizer.json alone, no Python of ours.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL[0],
        "pad_token": SPECIAL[0],
        # Qwen2.5's context: a finite bound, or transformers warns on every count.
        "model_max_length": 32768,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


__all__ = ["build"]
