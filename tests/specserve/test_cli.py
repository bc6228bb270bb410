"""The ``specserve`` command line: generate, up, serve, and their errors."""

from __future__ import annotations

import pytest

from specserve import cli

# --------------------------------------------------------------------------- without a stack


def test_up_without_redis_server_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    """No redis-server on PATH and no --redis-url: a clear error before anything starts."""
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    code = cli.main(
        [
            "up",
            "--port",
            "0",
            "--target-model",
            str(tmp_path / "target"),
            "--draft-model",
            str(tmp_path / "draft"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "redis-server is not installed" in err
    assert "apt-get install redis-server" in err and "--redis-url" in err


def test_up_without_models_says_which_flags_or_script(monkeypatch, capsys, tmp_path):
    import specserve.models

    monkeypatch.setattr(specserve.models, "DEMO_MODELS_DIR", tmp_path / "nowhere")
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err
    assert "--target-model DIR --draft-model DIR" in err
    assert "scripts/train_demo_pair.py" in err


def test_up_needs_both_model_flags(capsys, tmp_path):
    assert cli.main(["up", "--target-model", str(tmp_path)]) == 2
    assert "pass both --target-model DIR and --draft-model DIR" in capsys.readouterr().err


def test_serve_reads_flags_over_environment(monkeypatch):
    from specserve.config import CoordinatorSettings

    monkeypatch.setenv("SPECSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("SPECSERVE_PORT", "1234")
    parser = cli._role_parser("coordinator", CoordinatorSettings)
    options = parser.parse_args(["--port", "4321", "--target-endpoints", "a:1,b:2", "--auth-tokens", "t1"])
    settings = CoordinatorSettings(**{k: v for k, v in vars(options).items() if v is not None})
    assert settings.port == 4321  # the flag wins
    assert settings.max_batch_size == 7  # the environment fills the rest
    assert settings.target_endpoints == ["a:1", "b:2"]
    assert cli._secrets(settings) == ["t1"]


def test_serve_with_bad_settings_says_what_is_wrong(capsys):
    assert cli.main(["serve", "target", "--port", "70000", "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert "invalid target settings" in err and "port" in err


def test_generate_against_a_dead_address_fails_cleanly(capsys):
    from redis_server import free_port

    assert cli.main(["generate", "hi", "--addr", f"127.0.0.1:{free_port()}", "--retries", "0"]) == 1
    assert "error: Unavailable: " in capsys.readouterr().err


def test_gamma_flag_parsing():
    assert cli._parse_gamma("auto") is None
    assert cli._parse_gamma("3") == 3
    with pytest.raises(cli.CliError, match="--gamma must be"):
        cli._parse_gamma("lots")
