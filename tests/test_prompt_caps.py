"""Caps that refuse a prompt before the expensive work (fake engine, real HTTP app): the number
of chat messages and all their characters (roles and names too) before the template renders them,
the rendered text before it is tokenized, a text prompt that cannot fit the context before it is
tokenized, and the rest of a batch not tokenized once one prompt is over the context."""

from __future__ import annotations

import functools

from deployments.config import TpserveConfig
from model_fixtures import default_model_path
from scheduler.admission import AdmissionLimits
from test_serving_fake_engine import FakeEngine, assert_error, post, run


class SpyTokenizer:
    """A real tokenizer (or the fake one) that records which of its costly calls ran."""

    def __init__(self, inner, template_prefix: str = "") -> None:
        self.inner = inner
        # Text a 'template' adds (a long system preamble, as some templates have).
        self.template_prefix = template_prefix
        self.rendered = 0
        self.encoded: list[int] = []  # length of each encoded text

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.inner.encode(text, **kwargs)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        self.rendered += 1
        text = self.template_prefix + "".join(f"<{m['role']}>{m.get('content', '')}" for m in messages)
        return text if not tokenize else self.inner.encode(text)


@functools.lru_cache(maxsize=1)
def real_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def engine_with(tokenizer, max_model_len: int = 64, **config) -> FakeEngine:
    engine = FakeEngine()
    engine.tokenizer = tokenizer
    engine.vocab_size = len(tokenizer)
    engine.max_model_len = max_model_len
    engine.admission_limits = AdmissionLimits(max_model_len)
    engine.config = TpserveConfig(**config)
    return engine


def chat(messages, **extra):
    return {"messages": messages, "max_tokens": 2, **extra}


def test_too_many_messages_is_a_400_before_rendering():
    engine = engine_with(SpyTokenizer(real_tokenizer()), max_messages_per_request=4)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 3
    error = assert_error(run(post(engine, "/v1/chat/completions", chat(messages))), 400)
    assert error["param"] == "messages" and "at most 4 messages" in error["message"]
    assert engine.tokenizer.rendered == 0 and not engine.calls
    # At the cap it goes through.
    assert run(post(engine, "/v1/chat/completions", chat(messages[:4]))).status_code == 200


def test_content_less_messages_count_their_roles_and_names():
    """A flood of messages without content is not free: roles and names are characters too."""
    engine = engine_with(SpyTokenizer(real_tokenizer()), max_prompt_chars=300)
    messages = [{"role": "assistant", "name": "n" * 5}] * 20  # no content at all
    error = assert_error(run(post(engine, "/v1/chat/completions", chat(messages + [{"role": "user", "content": "x"}]))), 400)
    assert error["param"] == "messages" and "roles, names and content" in error["message"]
    assert engine.tokenizer.rendered == 0


def test_the_rendered_prompt_is_measured_before_it_is_tokenized():
    tokenizer = SpyTokenizer(real_tokenizer(), template_prefix="You are a helpful assistant. " * 40)
    engine = engine_with(tokenizer, max_model_len=2048, max_prompt_chars=1000)
    error = assert_error(run(post(engine, "/v1/chat/completions", chat([{"role": "user", "content": "hi"}]))), 400)
    assert error["param"] == "messages" and "renders to" in error["message"]
    assert tokenizer.rendered == 1 and tokenizer.encoded == [], "tokenized before the size check"


def test_a_text_prompt_that_cannot_fit_is_refused_before_tokenizing():
    tokenizer = SpyTokenizer(real_tokenizer())
    engine = engine_with(tokenizer, max_model_len=64)
    # No token of this tokenizer covers more than 81 characters: 100 x 64 characters are more
    # than 64 tokens whatever they are.
    error = assert_error(run(post(engine, "/v1/completions", {"prompt": "word " * 1280, "max_tokens": 1})), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert tokenizer.encoded == [], "a prompt that cannot fit was tokenized"
    # The same check on a rendered chat prompt.
    error = assert_error(run(post(engine, "/v1/chat/completions", chat([{"role": "user", "content": "word " * 1280}]))), 400)
    assert error["code"] == "context_length_exceeded" and tokenizer.encoded == []


def test_a_batch_stops_tokenizing_at_the_first_prompt_over_the_context():
    tokenizer = SpyTokenizer(real_tokenizer())
    engine = engine_with(tokenizer, max_model_len=64)
    over = "word " * 100  # 100 tokens, under the no-tokenizing bound (81 x 64 characters)
    body = {"prompt": ["short one", over, "never tokenized", "nor this"], "max_tokens": 1}
    error = assert_error(run(post(engine, "/v1/completions", body)), 400)
    assert error["code"] == "context_length_exceeded"
    assert tokenizer.encoded == [len("short one"), len(over)]
    assert not engine.calls
