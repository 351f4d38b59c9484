"""ServeConfig: the one place of the server's settings. The serve command's flags, create_app, Engine and
server.run are made from it; each test here fails if one of them keeps a setting of its own."""

import dataclasses

import pytest

import gpt2numba as g
from gpt2numba.serve.config import CONNECTION_SETTINGS, ServeConfig, flags
from gpt2numba.cli import commands

pytest.importorskip("starlette", reason="the server needs the [serve] extra")

from test_serve import CONFIG  # noqa: E402  (after the skip: test_serve needs the openai client)


def served_config(monkeypatch, *flags_given) -> ServeConfig:
    """The ServeConfig `gpt2numba serve` hands server.run for these flags (nothing served)."""
    import gpt2numba.serve

    got = []
    monkeypatch.setattr(commands, "resolve_model",
                        lambda model, dtype, activations: (g.random_weights(CONFIG, seed=5), None, "x"))
    monkeypatch.setattr(gpt2numba.serve, "run", lambda w, tokenizer, config: got.append(config), raising=False)
    monkeypatch.delenv("GPT2NUMBA_API_KEY", raising=False)
    assert commands.main(["serve", *flags_given]) == 0
    return got[0]


def test_the_serve_command_takes_every_default_from_serve_config(monkeypatch):
    # (served_config's weights come without a path: the random default, which /v1/models names as such)
    assert served_config(monkeypatch) == ServeConfig(model_name="random-gpt2-small")


def test_every_flag_reaches_the_server(monkeypatch):
    """Each setting given by its flag, with a value other than its default, arrives in the config."""
    given = {"host": "0.0.0.0", "port": 1, "max_batch": 3, "max_step_tokens": 5, "prefix_cache_mb": 7, "kv_cache_mb": 8,
             "max_queue": 9, "max_queued_choices": 11, "max_choices": 10, "max_response_mb": 1.5,
             "max_grammar_bytes": 100, "max_grammar_seconds": 0.5,
             "max_connections": 13, "header_timeout": 2.5, "body_timeout": 3.5, "keep_alive_timeout": 4.5,
             "api_key": "k", "model_name": "m", "shutdown_grace": 6, "draft": "int4", "num_speculative_tokens": 3}
    lookup = {"prompt_lookup": 4}  # (not with a draft)
    assert set(given) | set(lookup) == {name for name, *_ in flags()}  # (a new flag: add it here)
    for settings in (given, {k: v for k, v in given.items() if k not in ("draft", "num_speculative_tokens")} | lookup):
        argv = [part for name, value in settings.items() for part in ("--" + name.replace("_", "-"), str(value))]
        assert served_config(monkeypatch, *argv, "--kv-dtype", "float16") == ServeConfig(**settings, kv_dtype="float16")


def test_the_model_name_is_the_checkpoints():
    assert ServeConfig().named("/models/gpt2-medium/").model_name == "gpt2-medium"
    assert ServeConfig().named("w/model.safetensors").model_name == "model"
    assert ServeConfig().named("openai-community/gpt2").model_name == "gpt2"
    assert ServeConfig().named(None).model_name == "gpt2"
    assert ServeConfig(model_name="mine").named("/models/x").model_name == "mine"


@pytest.mark.parametrize("settings, match", [
    ({"api_key": " "}, "API key"), ({"max_choices": 8, "max_queued_choices": 4}, "max_queued_choices"),
    ({"max_step_tokens": 0}, "max_step_tokens"), ({"prefix_cache_mb": -1}, "prefix_cache_mb"), ({"kv_cache_mb": -1}, "kv_cache_mb"),
    ({"kv_dtype": "half"}, "float32, float16, bfloat16")])
def test_a_setting_out_of_range_is_refused_where_the_config_is_made(settings, match):
    with pytest.raises(g.ConfigError, match=match):
        ServeConfig(**settings)


def test_create_app_takes_a_config_or_its_fields():
    from gpt2numba.serve import create_app

    w, tok = g.random_weights(CONFIG, seed=5), g.load_tokenizer()
    by_keywords = create_app(w, tok, max_batch=3, max_queue=5, model_name="m").state.engine
    by_config = create_app(w, tok, ServeConfig(max_batch=3, max_queue=5, model_name="m")).state.engine
    assert by_keywords.config == by_config.config == ServeConfig(max_batch=3, max_queue=5, model_name="m")
    assert by_keywords.batch.size == 3 and by_keywords.waiting.limits.max_queue == 5
    assert create_app(w, tok).state.engine.config.model_name == "gpt2"
    with pytest.raises(TypeError, match="max_batchs"):
        create_app(w, tok, max_batchs=3)


def test_run_gives_uvicorn_the_connection_settings(monkeypatch):
    from gpt2numba.serve import server

    got = []
    monkeypatch.setattr(server.Server, "run", lambda self: got.append(self))
    monkeypatch.setattr(server.logging, "basicConfig", lambda **kwargs: None)
    connections = {"host": "0.0.0.0", "port": 1, "max_connections": 13, "header_timeout": 2.5,
                   "body_timeout": 3.5, "keep_alive_timeout": 4.5, "shutdown_grace": 6}
    assert set(connections) == set(CONNECTION_SETTINGS)
    server.run(g.random_weights(CONFIG, seed=5), g.load_tokenizer(), max_batch=3, **connections)
    uvicorn = got[0].config
    assert (uvicorn.host, uvicorn.port, uvicorn.timeout_keep_alive) == ("0.0.0.0", 1, 4.5)
    assert uvicorn.timeout_graceful_shutdown == 6 + server.WRITE_GRACE and got[0].grace == 6
    assert uvicorn.http.settings == dataclasses.replace(ServeConfig(max_batch=3), **connections)
    assert got[0].engine.config.max_batch == 3
