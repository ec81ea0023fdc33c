"""Section 3, settings: the one reader (Settings) for the server and the proxy, precedence, defaults, and every
unusable value an error naming its variable."""

from __future__ import annotations

import pytest

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast


def test_config_defaults() -> None:
    config = cs.Config.from_env({})
    assert config == cs.Config(root=config.root)
    assert config.base_url == "http://127.0.0.1:8000/v1"
    assert (config.model, config.api_key, config.timeout, config.tokenizer) == (None, None, 180.0, "auto")
    assert config.max_context_tokens == 32768 and config.archive_dir is None


def test_config_precedence_and_trailing_slash() -> None:
    env = {
        "OPENAI_SHRINK_MODEL": "c",
        "OMLX_SHRINK_MODEL": "b",
        "CONTEXT_SHRINK_MODEL": "a",
        "OMLX_SHRINK_BASE_URL": "http://h:1/v1/",
        "OPENAI_SHRINK_BASE_URL": "http://other/v1",
        "OPENAI_SHRINK_TIMEOUT": "7",
    }
    config = cs.Config.from_env(env)
    assert config.model == "a"
    assert config.base_url == "http://h:1/v1"
    assert config.timeout == 7.0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TIMEOUT", "soon"),
        ("TIMEOUT", "-3"),
        ("TIMEOUT", "inf"),
        ("TOKENIZER", "sentencepiece"),
        ("MAX_CONTEXT_TOKENS", "lots"),
        ("MAX_CONTEXT_TOKENS", "0"),
        ("MAX_CONTEXT_TOKENS", "-5"),
        ("MAX_CONTEXT_TOKENS", "99999999"),
        ("RESERVE_TOKENS", "1e3"),
        ("SUMMARY_CONTEXT_TOKENS", "12"),
        ("MAX_TEXT_BYTES", "0"),
        ("CHAT_FORMAT", "vicuna"),
        ("LOG_LEVEL", "loud"),
        ("TOOLS", "core, bogus"),
        ("TOOLS", ","),
        ("EXTRA_HEADERS", '["api-key", "s3cret"]'),
    ],
)
def test_config_a_value_that_cannot_be_used_is_an_error_naming_the_variable(name: str, value: str) -> None:
    for prefix in ("CONTEXT_SHRINK_", "OMLX_SHRINK_"):
        with pytest.raises(cs.ConfigError) as raised:
            cs.Config.from_env({prefix + name: value})
        assert raised.value.variable == prefix + name and prefix + name in str(raised.value)
        assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("4096", 4096), ("1000000", 1_000_000), ("AUTO", "auto")])
def test_config_max_context_in_range(value: str, expected: int | str) -> None:
    assert cs.Config.from_env({"CONTEXT_SHRINK_MAX_CONTEXT_TOKENS": value}).max_context_tokens == expected


def test_config_extra_headers_and_secret_not_in_repr() -> None:
    config = cs.Config.from_env(
        {"CONTEXT_SHRINK_EXTRA_HEADERS": '{"api-key": "azure-secret"}', "CONTEXT_SHRINK_API_KEY": "sk-secret"}
    )
    assert config.extra_headers == {"api-key": "azure-secret"}
    assert "sk-secret" not in repr(config) and "azure-secret" not in repr(config)


def test_main_refuses_to_start_on_a_bad_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTEXT_SHRINK_RESERVE_TOKENS", "-1")
    assert cs.main(["count", "--input", "-"]) == 2
    assert "CONTEXT_SHRINK_RESERVE_TOKENS='-1'" in capsys.readouterr().err
