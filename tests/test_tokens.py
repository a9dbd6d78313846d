"""Exact prompt token counts from ``estimate.tokenizer_file``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from proxy.config import EstimateConfig
from proxy.policyfile import PolicyError, build_policy
from proxy.routing.estimate import Estimator
from proxy.routing.explain import explain_request
from proxy.routing.profile import (
    CHAT_OVERHEAD_TOKENS,
    COMPLETION_PROMPT_OVERHEAD_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    profile_request,
)
from proxy.routing.tokens import TokenCounter, load_counter

from .gateway import policy_for
from .test_cli import tokenlane

WORDS = ["hello", "world", "the", "cat", "sat", "get_weather", "{", "}", '"', ":", "city"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A word-level tokenizer: one token per word or punctuation mark, so counts are known."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_counts_are_the_tokenizers_not_a_ratio(tokenizer_file: str) -> None:
    counter = TokenCounter(tokenizer_file)
    assert counter.count(["hello world", "the cat sat"]) == 5
    assert counter.count(["", "hello"]) == 1


def test_a_chat_prompt_counts_its_text_exactly_plus_the_template(tokenizer_file: str) -> None:
    estimator = Estimator.from_config(EstimateConfig(tokenizer_file=tokenizer_file))
    body = {
        "messages": [
            {"role": "system", "content": "the cat sat"},
            {"role": "user", "content": [{"type": "text", "text": "hello world"}]},
        ],
    }
    profile = profile_request(body, "chat", estimator, 256)
    assert profile.prompt_tokens_est == 5 + 2 * MESSAGE_OVERHEAD_TOKENS + CHAT_OVERHEAD_TOKENS
    # The same text with a ratio of 4 characters a token would be an estimate, not this.
    ratio = profile_request(body, "chat", Estimator(4.0), 256).prompt_tokens_est
    assert ratio != profile.prompt_tokens_est


def test_tools_and_tool_calls_are_counted_too(tokenizer_file: str) -> None:
    estimator = Estimator.from_config(EstimateConfig(tokenizer_file=tokenizer_file))
    plain = {"messages": [{"role": "user", "content": "hello"}]}
    with_tools = {
        **plain,
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    base = profile_request(plain, "chat", estimator, 256).prompt_tokens_est
    assert profile_request(with_tools, "chat", estimator, 256).prompt_tokens_est > base


def test_completion_prompts_are_counted_each(tokenizer_file: str) -> None:
    estimator = Estimator.from_config(EstimateConfig(tokenizer_file=tokenizer_file))
    body = {"prompt": ["hello world", "the cat"]}
    profile = profile_request(body, "completion", estimator, 256)
    assert profile.prompt_tokens_est == 4 + 2 * COMPLETION_PROMPT_OVERHEAD_TOKENS


def test_a_file_that_is_no_tokenizer_is_refused_by_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(PolicyError) as err:
        build_policy(
            policy_for({"p": ["http://127.0.0.1:9"]}, estimate={"tokenizer_file": str(bad)})
        )
    assert any(p.startswith("estimate.tokenizer_file") for p in err.value.problems)
    with pytest.raises(PolicyError):
        build_policy(
            policy_for({"p": ["http://127.0.0.1:9"]}, estimate={"tokenizer_file": "/nonexistent"})
        )


def test_check_and_explain_use_the_tokenizer(tokenizer_file: str, tmp_path: Path) -> None:
    policy = policy_for({"p": ["http://127.0.0.1:9"]}, estimate={"tokenizer_file": tokenizer_file})
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    assert tokenlane("check", str(path)).returncode == 0
    body = {"messages": [{"role": "user", "content": "hello world"}]}
    out = explain_request(build_policy(policy), body, "chat", counter=load_counter(tokenizer_file))
    assert out["tokenizer_file"] == tokenizer_file
    assert out["profile"]["prompt_tokens_est"] == 2 + MESSAGE_OVERHEAD_TOKENS + CHAT_OVERHEAD_TOKENS
    request = tmp_path / "req.json"
    request.write_text(json.dumps(body))
    result = tokenlane("explain", "--config", str(path), str(request), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokenizer_file"] == tokenizer_file
