"""The simulator's tokenizer, chat template and deterministic output (no I/O)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from loadtest.sim import tokenizer
from loadtest.sim.generate import Output

ENGLISH = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, "
    "his chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly "
    "through the glass doors of Victory Mansions, though not quickly enough to prevent a swirl "
    "of gritty dust from entering along with him. The hallway smelt of boiled cabbage and old "
    "rag mats. At one end of it a coloured poster, too large for indoor display, had been "
    "tacked to the wall. It depicted simply an enormous face, more than a metre wide: the face "
    "of a man of about forty-five, with a heavy black moustache and ruggedly handsome features."
)


def test_tokenizer_english_prose_is_3_5_to_4_5_chars_per_token():
    ratio = len(ENGLISH) / tokenizer.count(ENGLISH)
    assert 3.5 <= ratio <= 4.5


def test_tokenizer_does_not_count_chars_over_four():
    # Digits are a token each and long words split: counts that chars/4 cannot mirror.
    digits = "1234567890" * 8
    assert tokenizer.count(digits) == len(digits)
    assert tokenizer.count(" internationalization") == 5  # 21 chars: chars/4 would say 5.25
    assert tokenizer.count(" a b c d e f") == 6  # 12 chars: chars/4 would say 3


def test_tokenizer_pieces_join_back_to_any_text():
    rng = random.Random(7)
    alphabet = "ab Z_-!?.,\n\t 12 é中文'"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 200)))
        assert "".join(tokenizer.pieces(text)) == text
        assert len(tokenizer.encode(text, special=False)) == len(tokenizer.pieces(text))


def test_tokenizer_ids_are_the_same_in_another_process():
    text = "Hello, world of KV caches!"
    code = f"from loadtest.sim import tokenizer; print(tokenizer.encode({text!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(tokenizer.encode(text))


def test_tokenizer_special_tokens_are_single_qwen_ids():
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 151_644 and ids[-1] == 151_645
    assert tokenizer.decode(ids) == "user\nHi"


def test_chat_template_adds_qwen_default_system_prompt_and_generation_prompt():
    text, media = tokenizer.render_chat([{"role": "user", "content": "Hello"}])
    assert text == (
        f"<|im_start|>system\n{tokenizer.DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert media == 0
    # The fixture's "Hello" exchange reports 34 prompt tokens; the template is most of them.
    assert 25 <= len(tokenizer.chat_prompt_ids([{"role": "user", "content": "Hello"}])) <= 40


def test_chat_template_keeps_a_given_system_prompt_and_counts_images():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
    ]  # fmt: skip
    text, media = tokenizer.render_chat(messages)
    assert tokenizer.DEFAULT_SYSTEM not in text and media == 1
    ids = tokenizer.chat_prompt_ids(messages)
    assert ids.count(tokenizer.MEDIA_PLACEHOLDER_ID) == tokenizer.MEDIA_PART_TOKENS


def test_chat_template_rejects_content_of_the_wrong_type():
    with pytest.raises(tokenizer.TemplateError, match=r"messages\[0\]\.content"):
        tokenizer.render_chat([{"role": "user", "content": 42}])


def _run(out: Output) -> Output:
    while not out.advance():
        pass
    return out


def test_output_has_exactly_max_tokens_and_retokenizes_to_its_ids():
    out = _run(Output(3, max_tokens=200))
    assert len(out.ids) == 200 and out.finish_reason == "length"
    assert tokenizer.encode(out.text) == out.ids


def test_output_is_deterministic_per_seed():
    assert _run(Output(5, max_tokens=50)).text == _run(Output(5, max_tokens=50)).text
    assert _run(Output(5, max_tokens=50)).text != _run(Output(6, max_tokens=50)).text


def test_output_without_limit_ends_with_eos_at_its_natural_length():
    out = _run(Output(9, max_tokens=10_000, natural_len=37))
    assert len(out.ids) == 37 and out.ids[-1] == tokenizer.EOS_ID
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.deltas[-1] == ""  # the end-of-sequence token has no text


def test_output_stop_string_ends_and_is_cut_and_never_half_streamed():
    full = _run(Output(11, max_tokens=300)).text
    stop = full[100:106]  # six characters that are certainly in the text
    out = _run(Output(11, max_tokens=300, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # Deltas are append-only, so this equality also proves no part of the stop string was
    # streamed before the output knew it had stopped.
    assert out.text == full[: full.index(stop)]
    kept = _run(Output(11, max_tokens=300, stop=[stop], include_stop=True))
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert len(kept.ids) == len(out.ids)  # the token that completed the stop string counts
