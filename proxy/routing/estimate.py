"""Characters per token, learned per model from the usage replicas report.

The profile (``proxy.routing.profile``) turns characters into an estimate with these ratios
(unless a tokenizer counts the text exactly); each response's ``usage.prompt_tokens`` then
folds back into the ratio of its model.
"""

from __future__ import annotations

from proxy.config import EstimateConfig
from proxy.routing.profile import Profile
from proxy.routing.tokens import TokenCounter, load_counter


class Estimator:
    """Characters-per-token ratios, learned per model from reported usage.

    Each observation's ratio is clamped to [min_ratio, max_ratio] and folded in by an
    exponentially weighted moving average, so one odd response (a prompt of emoji, a truncated
    prompt) moves the estimate a little and never to nonsense. Requests whose cost is dominated
    by guesses (images, audio, video) or that are too short to measure are not learned from.
    """

    __slots__ = (
        "_default",
        "_ratios",
        "alpha",
        "counter",
        "image_tokens",
        "max_models",
        "max_ratio",
        "min_chars",
        "min_ratio",
    )

    def __init__(
        self,
        chars_per_token: float = 4.0,
        image_tokens: int = 576,
        *,
        alpha: float = 0.1,
        min_ratio: float = 1.5,
        max_ratio: float = 8.0,
        min_chars: int = 200,
        max_models: int = 1024,
        counter: TokenCounter | None = None,
    ) -> None:
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        self._default = chars_per_token
        self.image_tokens = image_tokens
        self.alpha = alpha
        self.min_ratio = min_ratio
        self.max_ratio = max_ratio
        self.min_chars = min_chars
        self.max_models = max_models
        self._ratios: dict[str | None, float] = {}
        # Exact text counts from estimate.tokenizer_file; the ratios then serve nothing but
        # the learning that goes on regardless.
        self.counter = counter

    @classmethod
    def from_config(cls, cfg: EstimateConfig) -> Estimator:
        counter = load_counter(cfg.tokenizer_file) if cfg.tokenizer_file else None
        return cls(cfg.chars_per_token, cfg.image_tokens, counter=counter)

    def configure(self, cfg: EstimateConfig) -> None:
        """Apply a reloaded ``estimate`` section, keeping what was learned."""
        self._default = cfg.chars_per_token
        self.image_tokens = cfg.image_tokens

    def ratio(self, model: str | None) -> float:
        """Characters per token for ``model``: learned, else the configured start."""
        return self._ratios.get(model, self._default)

    def learned(self) -> dict[str | None, float]:
        return dict(self._ratios)

    def observe_usage(
        self,
        model: str | None,
        prompt_chars: int,
        reported_prompt_tokens: int,
        fixed_tokens: int = 0,
    ) -> None:
        """Fold one response's ``usage.prompt_tokens`` into ``model``'s ratio.

        ``fixed_tokens`` is the part of the prompt not made of counted characters (template
        framing, token ids); it is subtracted so that only text informs the ratio.
        """
        if prompt_chars < self.min_chars:
            return
        text_tokens = reported_prompt_tokens - fixed_tokens
        if text_tokens <= 0:
            return
        sample = prompt_chars / text_tokens
        if sample < self.min_ratio:
            sample = self.min_ratio
        elif sample > self.max_ratio:
            sample = self.max_ratio
        current = self._ratios.get(model)
        if current is None:
            if len(self._ratios) >= self.max_models:
                return  # bounded memory; a client cannot grow this with made-up model names
            current = self._default
        self._ratios[model] = current + self.alpha * (sample - current)

    def observe(self, profile: Profile, reported_prompt_tokens: int) -> None:
        """``observe_usage`` for a profiled request; skips requests whose cost is mostly guessed."""
        if profile.images or profile.audios or profile.videos:
            return
        self.observe_usage(
            profile.model, profile.prompt_chars, reported_prompt_tokens, profile.fixed_tokens
        )
